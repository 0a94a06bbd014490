//! `BinningResource`: RMM's shared tests, routing to the smallest bin, fixed bins sharing the
//! upstream, bad arguments.

use super::*;
use streamalloc::resource::managed::ManagedResource;
use streamalloc::resource::pinned::PinnedHostResource;

/// Counts what goes through it: a tiny stand-in for a tracking adaptor.
#[derive(Debug)]
struct Counting {
    inner: CudaResource,
    allocs: Mutex<Vec<usize>>,
    frees: Mutex<Vec<usize>>,
}

impl Counting {
    fn new(device: &Device) -> Arc<Self> {
        Arc::new(Self {
            inner: CudaResource::new(device),
            allocs: Mutex::new(Vec::new()),
            frees: Mutex::new(Vec::new()),
        })
    }

    fn allocs(&self) -> Vec<usize> {
        self.allocs.lock().unwrap().clone()
    }

    fn frees(&self) -> Vec<usize> {
        self.frees.lock().unwrap().clone()
    }
}

// SAFETY: every allocation is the inner resource's, passed on unchanged; this only counts.
unsafe impl MemoryResource for Counting {
    fn device(&self) -> &Device {
        self.inner.device()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> streamalloc::Result<DevicePtr> {
        self.allocs.lock().unwrap().push(bytes);
        self.inner.allocate(bytes, stream)
    }

    unsafe fn deallocate(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        stream: &Stream,
    ) -> streamalloc::Result<()> {
        self.frees.lock().unwrap().push(bytes);
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.deallocate(ptr, bytes, stream) }
    }
}

fn binning_over_pool(device: &Device) -> BinningResource<PoolResource<CudaResource>> {
    let pool = PoolResource::new(
        CudaResource::new(device),
        PoolOptions {
            initial: 0,
            maximum: Some(4096 * MIB),
            ..PoolOptions::default()
        },
    )
    .unwrap();
    BinningResource::builder(pool)
        .bins_pow2(18, 22)
        .blocks_per_chunk(8)
        .build()
        .unwrap()
}

#[test]
fn binning_shared_tests() {
    for device in devices() {
        let b = binning_over_pool(&device);
        zero_bytes(&b, &device);
        assert_eq!(b.upstream().stats().reserved, 0);
        sizes_from_4_bytes_to_1_gib(&b, &device);
        one_pib_is_out_of_memory(&b, &device);
        random_mix(&b, &device, &|| b.upstream().check_invariants().unwrap());
        four_threads(&b, &device);
        producer_consumer(&b, &device);
        b.upstream().check_invariants().unwrap();
    }
}

#[test]
fn binning_routes_sizes_to_the_smallest_bin_that_holds_them() {
    for device in devices() {
        let bins = [
            Counting::new(&device),
            Counting::new(&device),
            Counting::new(&device),
        ];
        let fallback = Counting::new(&device);
        let b = BinningResource::builder(CudaResource::new(&device))
            .add_bin(4 * KIB, bins[1].clone() as ResourceRef)
            .add_bin(KIB, bins[0].clone() as ResourceRef)
            .add_bin(64 * KIB, bins[2].clone() as ResourceRef)
            .fallback(fallback.clone())
            .build()
            .unwrap();
        assert_eq!(b.bin_sizes(), vec![KIB, 4 * KIB, 64 * KIB]);
        assert_eq!(b.bin_for(1), Some(0));
        assert_eq!(b.bin_for(KIB + 1), Some(1));
        assert_eq!(b.bin_for(64 * KIB + 1), None);
        let s = device.create_stream().unwrap();
        let sizes = [
            1,
            KIB,
            KIB + 1,
            4 * KIB,
            4 * KIB + 1,
            64 * KIB,
            64 * KIB + 1,
            MIB,
        ];
        let ptrs: Vec<_> = sizes.iter().map(|&n| b.allocate(n, &s).unwrap()).collect();
        assert_eq!(bins[0].allocs(), vec![1, KIB]);
        assert_eq!(bins[1].allocs(), vec![KIB + 1, 4 * KIB]);
        assert_eq!(bins[2].allocs(), vec![4 * KIB + 1, 64 * KIB]);
        assert_eq!(fallback.allocs(), vec![64 * KIB + 1, MIB]);
        for (ptr, n) in ptrs.into_iter().zip(sizes) {
            free(&b, ptr, n, &s);
        }
        // Frees go back by the same rule.
        assert_eq!(bins[0].frees(), vec![1, KIB]);
        assert_eq!(bins[1].frees(), vec![KIB + 1, 4 * KIB]);
        assert_eq!(bins[2].frees(), vec![4 * KIB + 1, 64 * KIB]);
        assert_eq!(fallback.frees(), vec![64 * KIB + 1, MIB]);
        // Zero bytes reach no bin.
        assert_eq!(b.allocate(0, &s).unwrap(), DevicePtr(0));
        assert_eq!(bins[0].allocs().len(), 2);
    }
}

/// Fixed-size bins take chunks of `blocks_per_chunk` blocks from the shared upstream; larger
/// requests go to the upstream as they are.
#[test]
fn binning_fixed_bins_share_the_upstream() {
    for device in devices() {
        let upstream = Counting::new(&device);
        let b = BinningResource::builder(upstream.clone())
            .bins_pow2(10, 12)
            .blocks_per_chunk(4)
            .build()
            .unwrap();
        assert_eq!(b.bin_sizes(), vec![1024, 2048, 4096]);
        let s = device.create_stream().unwrap();
        let sizes = [1000, 2000, 4000, 5000, 900];
        let ptrs: Vec<_> = sizes.iter().map(|&n| b.allocate(n, &s).unwrap()).collect();
        // One chunk per bin used (the second 1 KiB block comes from the first chunk), then
        // the fallback's request.
        assert_eq!(upstream.allocs(), vec![4 * 1024, 4 * 2048, 4 * 4096, 5000]);
        let mut sorted: Vec<u64> = ptrs.iter().map(|p| p.0).collect();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), sizes.len(), "{}", label(&device));
        for (ptr, n) in ptrs.into_iter().zip(sizes) {
            free(&b, ptr, n, &s);
        }
        assert_eq!(
            upstream.frees(),
            vec![5000],
            "bins keep their chunks until dropped"
        );
        drop(b);
        assert_eq!(
            upstream.frees().len(),
            4,
            "dropping the bins returns their chunks"
        );
    }
}

/// A free with a wrong size that routes past every bin, to the upstream the fixed-size bins
/// share, naming a bin's chunk with the chunk's own size: the upstream did hand that range
/// out, so only the binning resource can refuse it. A review found it accepted: the chunk
/// went back upstream and was handed out again over a block still in use.
#[test]
fn binning_refuses_a_wrong_size_free_of_a_bins_chunk() {
    for device in devices() {
        let p = common::pool(&device, 0, 64 * MIB);
        let b = BinningResource::builder(p)
            .bins_pow2(8, 10)
            .blocks_per_chunk(128)
            .build()
            .unwrap();
        let s = device.create_stream().unwrap();
        let first = b.allocate(256, &s).unwrap();
        let second = b.allocate(256, &s).unwrap();
        let chunk = 128 * 256;
        // SAFETY: a deliberately wrong free, which the resource must refuse untouched.
        let wrong = unsafe { b.deallocate(first, chunk, &s) };
        assert!(
            matches!(wrong, Err(Error::UnknownPointer { .. })),
            "{}: {wrong:?}",
            label(&device)
        );
        let large = b.allocate(chunk, &s).unwrap();
        assert!(
            large.0 >= second.0 + 256 || large.0 + chunk as u64 <= first.0,
            "{}: a bin's chunk handed out again while its blocks are in use",
            label(&device)
        );
        free(&b, large, chunk, &s);
        free(&b, second, 256, &s);
        free(&b, first, 256, &s);
    }
}

/// A free with a wrong size that routes to a bin given to `add_bin`, the very pool the
/// fixed-size bins take their chunks from, naming a fixed bin's block: only the binning
/// resource can refuse it. A review found it accepted: the pool took back the bin's whole
/// chunk while three of its blocks were handed out.
#[test]
fn binning_refuses_a_wrong_size_free_routed_to_a_given_bin() {
    for device in devices() {
        let p = Arc::new(common::pool(&device, MIB, 64 * MIB));
        // A fixed bin of 256-byte blocks, 4 to a chunk of 1024 bytes from the pool, and the
        // pool itself serving 257..=1024 bytes.
        let b = BinningResource::builder(p.clone())
            .add_bin(256, None)
            .add_bin(1024, p.clone() as ResourceRef)
            .blocks_per_chunk(4)
            .build()
            .unwrap();
        let s = device.create_stream().unwrap();
        let blocks: Vec<_> = (0..4).map(|_| b.allocate(200, &s).unwrap()).collect();
        let first = *blocks.iter().min().unwrap();
        let before = p.stats();
        // SAFETY: a deliberately wrong free (1000 bytes routes to the given bin), which the
        // resource must refuse untouched.
        let wrong = unsafe { b.deallocate(first, 1000, &s) };
        assert_eq!(
            wrong,
            Err(Error::UnknownPointer {
                ptr: first.0,
                bytes: 1000
            }),
            "{}",
            label(&device)
        );
        assert_eq!(p.stats(), before, "{}: the pool changed", label(&device));
        p.check_invariants().unwrap();
        // The chunk is still the bin's: what the given bin hands out lies outside it.
        let other = b.allocate(1000, &s).unwrap();
        assert!(
            other.0 >= first.0 + 1024 || other.0 + 1000 <= first.0,
            "{}: a bin's chunk handed out again while its blocks are in use",
            label(&device)
        );
        free(&b, other, 1000, &s);
        for ptr in blocks {
            free(&b, ptr, 200, &s);
        }
        drop(b);
        assert_eq!(p.stats().in_use, 0, "{}: not all came back", label(&device));
        p.check_invariants().unwrap();
    }
}

/// The binning resource reports its upstream's memory kind for everything it hands out, so a
/// bin or fallback given must hand out that kind. A review found a pinned-host binning
/// resource built with a device-memory bin: it said host-accessible and handed out device
/// memory, which the unsafe `MemoryResource` contract forbids.
#[test]
fn binning_refuses_given_bins_and_fallbacks_of_another_memory_kind() {
    for device in devices() {
        let device_memory: ResourceRef = Arc::new(CudaResource::new(&device));
        let pinned: ResourceRef = Arc::new(PinnedHostResource::new(&device));
        let managed: ResourceRef = Arc::new(ManagedResource::new(&device));
        let pinned_up = || BinningResource::builder(PinnedHostResource::new(&device));
        let device_up = || BinningResource::builder(CudaResource::new(&device));
        for built in [
            pinned_up()
                .add_bin(KIB, device_memory.clone())
                .build()
                .err(),
            pinned_up().fallback(device_memory.clone()).build().err(),
            device_up().add_bin(KIB, pinned.clone()).build().err(),
            device_up()
                .add_bin(KIB, None)
                .fallback(managed.clone())
                .build()
                .err(),
        ] {
            assert!(
                matches!(built, Some(Error::InvalidArgument { .. })),
                "{}: a resource of another memory kind was taken ({built:?})",
                label(&device)
            );
        }
        // Resources of the upstream's kind are taken, and the kind reported is theirs.
        let b = pinned_up()
            .add_bin(KIB, pinned.clone())
            .fallback(pinned.clone())
            .build()
            .unwrap();
        assert_eq!(b.memory_kind(), MemoryKind::PinnedHost);
        let s = device.create_stream().unwrap();
        for bytes in [100, 4 * KIB] {
            let ptr = b.allocate(bytes, &s).unwrap();
            free(&b, ptr, bytes, &s);
        }
        // The resources refused are as they were.
        let ptr = device_memory.allocate(KIB, &s).unwrap();
        free(&*device_memory, ptr, KIB, &s);
    }
}

#[test]
fn binning_bad_arguments_are_errors() {
    let device = &devices()[0];
    let build_err = |builder: streamalloc::resource::binning::BinningBuilder<CudaResource>| {
        builder.build().unwrap_err()
    };
    let up = || BinningResource::builder(CudaResource::new(device));
    assert!(matches!(
        build_err(up().bins_pow2(12, 10)),
        Error::InvalidSize { .. }
    ));
    assert!(matches!(
        build_err(up().bins_pow2(10, 64)),
        Error::InvalidSize { .. }
    ));
    assert!(matches!(
        build_err(up().add_bin(0, None)),
        Error::InvalidSize { .. }
    ));
    assert!(matches!(
        build_err(up().add_bin(1024, None).blocks_per_chunk(0)),
        Error::InvalidSize { .. }
    ));
    let other = Device::simulated(SimConfig::default());
    assert!(matches!(
        build_err(up().add_bin(1024, Arc::new(CudaResource::new(&other)) as ResourceRef)),
        Error::WrongDevice { .. }
    ));
    assert!(matches!(
        build_err(up().fallback(Arc::new(CudaResource::new(&other)))),
        Error::WrongDevice { .. }
    ));
    // A later bin of the same size replaces the earlier one.
    let b = up()
        .add_bin(1000, None)
        .add_bin(1024, None)
        .build()
        .unwrap();
    assert_eq!(b.bin_sizes(), vec![1024]);
    let s = other.create_stream().unwrap();
    assert!(matches!(
        b.allocate(100, &s),
        Err(Error::WrongDevice { .. })
    ));
}

/// Bin exponents out of order: the error names the exponent that breaks the rule (the minimum
/// above the maximum), not the maximum (a review found `bins_pow2(70, 22)` reported 22).
#[test]
fn binning_bad_exponents_name_the_bad_one() {
    let device = Device::simulated(SimConfig::default());
    for (min, max, bad) in [(70, 22, 70), (8, 64, 64), (8, 200, 200)] {
        let err = BinningResource::builder(CudaResource::new(&device))
            .bins_pow2(min, max)
            .build()
            .unwrap_err();
        assert!(
            matches!(err, Error::InvalidSize { size, .. } if size == bad),
            "bins_pow2({min}, {max}): {err:?}"
        );
    }
}
