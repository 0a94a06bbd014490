//! The four base resources (`CudaResource`, `CudaAsyncResource`, `ManagedResource`,
//! `PinnedHostResource`), and the `ExpandablePoolResource` that stands on the device's virtual
//! memory calls, on every available device (see `common`), to the bar of RMM's
//! memory-resource tests: zero bytes, sizes up to 1 GiB, out of memory, random mixes,
//! threads, producer/consumer across streams, and each resource's own promises.

mod common;

use std::collections::BTreeMap;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use common::{devices, eventually, label};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::cuda_async::{CudaAsyncOptions, CudaAsyncResource};
use streamalloc::resource::managed::ManagedResource;
use streamalloc::resource::pinned::{PinnedHostOptions, PinnedHostResource};
use streamalloc::{
    Device, DevicePtr, Error, ExpandablePoolResource, MemoryKind, MemoryResource, SimConfig,
    Stream, ALIGNMENT,
};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
const PIB: usize = 1 << 50;

/// splitmix64: a tiny seeded generator, enough for reproducible random mixes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Below `n` (n > 0).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// A size from 0 to `max`, spread evenly over the orders of magnitude.
    fn size(&mut self, max_log2: u32) -> usize {
        let bits = self.below(max_log2 as u64 + 1) as u32;
        self.below(1u64 << bits) as usize + usize::from(bits > 0)
    }
}

/// Every base resource of `device`, shared, with its name.
fn resources(device: &Device) -> Vec<(&'static str, Arc<dyn MemoryResource>)> {
    vec![
        ("cuda", Arc::new(CudaResource::new(device))),
        (
            "cuda_async",
            Arc::new(CudaAsyncResource::new(device, CudaAsyncOptions::default()).unwrap()),
        ),
        ("managed", Arc::new(ManagedResource::new(device))),
        ("pinned", Arc::new(PinnedHostResource::new(device))),
        (
            "expandable",
            Arc::new(ExpandablePoolResource::new(device, Default::default()).unwrap()),
        ),
    ]
}

/// The simulated device with delays that widen race windows, plus `devices()`.
fn devices_with_a_slow_sim() -> Vec<Device> {
    let mut all = devices();
    all.push(Device::simulated(SimConfig {
        op_delay: Duration::from_micros(20),
        op_jitter: Duration::from_micros(100),
        seed: 11,
        ..SimConfig::default()
    }));
    all
}

fn host_ptr(ptr: DevicePtr) -> *mut u8 {
    ptr.as_raw() as usize as *mut u8
}

/// Reads `count` words at `src` (device memory) on `stream`, waiting for them.
fn read_words(stream: &Stream, src: DevicePtr, count: usize) -> Vec<u32> {
    let mut host = vec![0u32; count];
    // SAFETY: `host` has `count` words and is not touched until synchronize_blocking returns;
    // callers pass live memory of at least `4 * count` bytes.
    unsafe { stream.copy_dtoh(host.as_mut_ptr() as *mut u8, src, count * 4) }.unwrap();
    stream.synchronize_blocking().unwrap();
    host
}

/// Writes `tag` at the start and the end of the allocation and reads it back: through the
/// host pointer for pinned memory, with the fill kernel and a copy back otherwise. Touches at
/// most 8 KiB at each end, so a lazily backed 1 GiB allocation stays cheap.
fn write_and_check(kind: MemoryKind, ptr: DevicePtr, bytes: usize, stream: &Stream, tag: u32) {
    if kind == MemoryKind::PinnedHost {
        let p = host_ptr(ptr);
        let n = bytes.min(8 * KIB);
        // SAFETY: `p` is `bytes` of live host memory that only this test uses.
        unsafe {
            std::ptr::write_bytes(p, tag as u8, n);
            std::ptr::write_bytes(p.add(bytes - n), tag as u8, n);
            assert_eq!(p.read(), tag as u8);
            assert_eq!(p.add(bytes - 1).read(), tag as u8);
            assert_eq!(p.add(bytes / 2).read_volatile(), p.add(bytes / 2).read());
        }
        return;
    }
    let words = bytes / 4;
    if words == 0 {
        return;
    }
    let n = words.min(2 * KIB);
    let tail = ptr.offset((words - n) * 4);
    // SAFETY: both ranges lie inside the `bytes` live bytes at `ptr`, which stay live until
    // read_words synchronizes the stream.
    unsafe {
        stream.fill_u32(ptr, tag, n).unwrap();
        stream.fill_u32(tail, tag, n).unwrap();
    }
    assert!(read_words(stream, ptr, n).iter().all(|&w| w == tag));
    assert!(read_words(stream, tail, n).iter().all(|&w| w == tag));
}

/// Inserts `[ptr, ptr + bytes)` into `live`, panicking if it overlaps a live range.
fn insert_disjoint(live: &mut BTreeMap<u64, usize>, ptr: DevicePtr, bytes: usize, what: &str) {
    let (start, end) = (ptr.as_raw(), ptr.as_raw() + bytes as u64);
    if let Some((&p, &b)) = live.range(..=start).next_back() {
        assert!(
            p + b as u64 <= start,
            "{what}: {ptr:?}+{bytes} overlaps {p:#x}+{b}"
        );
    }
    if let Some((&p, &b)) = live.range(start..).next() {
        assert!(end <= p, "{what}: {ptr:?}+{bytes} overlaps {p:#x}+{b}");
    }
    live.insert(start, bytes);
}

// ===== every resource =====

#[test]
fn zero_bytes_is_a_null_pointer_that_deallocates() {
    for device in devices() {
        let stream = device.create_stream().unwrap();
        for (name, r) in resources(&device) {
            let what = format!("{} {name}", label(&device));
            let ptr = r.allocate(0, &stream).unwrap();
            assert_eq!(ptr, DevicePtr(0), "{what}");
            // SAFETY: the null pointer of a zero-byte allocation, given back once.
            unsafe { r.deallocate(ptr, 0, &stream) }.unwrap();
            assert_eq!(r.device().id(), device.id(), "{what}");
        }
        stream.synchronize_blocking().unwrap();
    }
}

#[test]
fn sizes_from_4_bytes_to_1_gib_are_aligned_distinct_and_writable() {
    let sizes = [
        4,
        8,
        100,
        256,
        1000,
        4 * KIB,
        64 * KIB,
        MIB,
        10 * MIB + 4,
        100 * MIB,
        GIB,
    ];
    for device in devices() {
        let stream = device.create_stream().unwrap();
        for (name, r) in resources(&device) {
            let what = format!("{} {name}", label(&device));
            let mut live = BTreeMap::new();
            let mut blocks = Vec::new();
            for (i, &bytes) in sizes.iter().enumerate() {
                let ptr = r
                    .allocate(bytes, &stream)
                    .unwrap_or_else(|e| panic!("{what}: {bytes} bytes: {e}"));
                assert_ne!(ptr, DevicePtr(0), "{what}: {bytes} bytes");
                assert_eq!(
                    ptr.as_raw() % ALIGNMENT as u64,
                    0,
                    "{what}: {ptr:?} ({bytes} bytes) is not {ALIGNMENT}-aligned"
                );
                insert_disjoint(&mut live, ptr, bytes, &what);
                write_and_check(r.memory_kind(), ptr, bytes, &stream, 0x5A00 + i as u32);
                blocks.push((ptr, bytes));
            }
            for (ptr, bytes) in blocks {
                // SAFETY: allocated above with `bytes`, its uses synchronized, freed once.
                unsafe { r.deallocate(ptr, bytes, &stream) }.unwrap();
            }
            stream.synchronize_blocking().unwrap();
        }
    }
}

#[test]
fn one_pib_is_out_of_memory_and_the_resource_still_allocates() {
    for device in devices() {
        let stream = device.create_stream().unwrap();
        for (name, r) in resources(&device) {
            let what = format!("{} {name}", label(&device));
            match r.allocate(PIB, &stream) {
                Err(Error::OutOfMemory {
                    requested,
                    available,
                    ..
                }) => {
                    assert_eq!(requested, PIB, "{what}");
                    assert!(available < PIB, "{what}: available {available}");
                }
                other => panic!("{what}: 1 PiB gave {other:?}"),
            }
            let err = r.allocate(PIB, &stream).unwrap_err();
            assert!(err.is_out_of_memory(), "{what}: {err}");
            assert!(err.to_string().contains(&PIB.to_string()), "{what}: {err}");
            let ptr = r.allocate(MIB, &stream).unwrap();
            write_and_check(r.memory_kind(), ptr, MIB, &stream, 7);
            // SAFETY: allocated just above, its uses synchronized, freed once.
            unsafe { r.deallocate(ptr, MIB, &stream) }.unwrap();
        }
        stream.synchronize_blocking().unwrap();
    }
}

#[test]
fn random_allocate_free_mix_never_overlaps() {
    for device in devices() {
        let stream = device.create_stream().unwrap();
        for (name, r) in resources(&device) {
            let what = format!("{} {name}", label(&device));
            let mut rng = Rng(0x5EED ^ name.len() as u64);
            let mut live: BTreeMap<u64, usize> = BTreeMap::new();
            let ops = if device.is_simulated() { 3000 } else { 1000 };
            for _ in 0..ops {
                if live.is_empty() || rng.below(100) < 55 {
                    let bytes = rng.size(20); // up to 1 MiB
                    let ptr = r.allocate(bytes, &stream).unwrap();
                    if bytes == 0 {
                        assert_eq!(ptr, DevicePtr(0));
                        // SAFETY: the null pointer of a zero-byte allocation.
                        unsafe { r.deallocate(ptr, 0, &stream) }.unwrap();
                        continue;
                    }
                    assert_eq!(ptr.as_raw() % ALIGNMENT as u64, 0, "{what}");
                    insert_disjoint(&mut live, ptr, bytes, &what);
                } else {
                    let nth = rng.below(live.len() as u64) as usize;
                    let (&ptr, _) = live.iter().nth(nth).unwrap();
                    let bytes = live.remove(&ptr).unwrap();
                    // SAFETY: live and allocated with `bytes`; nothing uses it; freed once.
                    unsafe { r.deallocate(DevicePtr(ptr), bytes, &stream) }.unwrap();
                }
            }
            // Every live block holds its own word: overlapping blocks would clobber one.
            let blocks: Vec<(u64, usize)> = live.into_iter().collect();
            for (i, &(ptr, bytes)) in blocks.iter().enumerate() {
                if bytes >= 4 {
                    if r.memory_kind() == MemoryKind::PinnedHost {
                        // SAFETY: live host memory of at least 4 bytes, used by no one else.
                        unsafe { (host_ptr(DevicePtr(ptr)) as *mut u32).write(i as u32) };
                    } else {
                        // SAFETY: live memory of at least 4 bytes until the reads below.
                        unsafe { stream.fill_u32(DevicePtr(ptr), i as u32, 1) }.unwrap();
                    }
                }
            }
            for (i, &(ptr, bytes)) in blocks.iter().enumerate() {
                if bytes >= 4 {
                    let word = if r.memory_kind() == MemoryKind::PinnedHost {
                        // SAFETY: as above.
                        unsafe { (host_ptr(DevicePtr(ptr)) as *const u32).read() }
                    } else {
                        read_words(&stream, DevicePtr(ptr), 1)[0]
                    };
                    assert_eq!(word, i as u32, "{what}: block {ptr:#x} was overwritten");
                }
            }
            for (ptr, bytes) in blocks {
                // SAFETY: live, allocated with `bytes`, its uses synchronized, freed once.
                unsafe { r.deallocate(DevicePtr(ptr), bytes, &stream) }.unwrap();
            }
            stream.synchronize_blocking().unwrap();
        }
    }
}

#[test]
fn four_threads_at_once_each_on_its_own_stream() {
    for device in devices_with_a_slow_sim() {
        for (name, r) in resources(&device) {
            let what = format!("{} {name}", label(&device));
            // Every live range of every thread: no two may overlap.
            let live = Arc::new(Mutex::new(BTreeMap::new()));
            let threads: Vec<_> = (0..4u32)
                .map(|t| {
                    let (device, r, live, what) =
                        (device.clone(), r.clone(), live.clone(), what.clone());
                    std::thread::spawn(move || {
                        let stream = device.create_stream().unwrap();
                        let scratch = device.malloc(64 * KIB).unwrap();
                        let mut rng = Rng(u64::from(t) * 1_000_003 + 17);
                        for round in 0..60u32 {
                            let bytes = (rng.size(15) + 4) & !3; // 4 B to 32 KiB, whole words
                            let ptr = r.allocate(bytes, &stream).unwrap();
                            insert_disjoint(&mut live.lock().unwrap(), ptr, bytes, &what);
                            let tag = (t << 16) | round;
                            let words = bytes / 4;
                            if r.memory_kind() == MemoryKind::PinnedHost {
                                // Write on the host, copy to the device after some GPU work,
                                // and give the block back before that copy has run: nobody may
                                // get (and overwrite) it until it has.
                                let host = host_ptr(ptr) as *mut u32;
                                // SAFETY: `bytes` of live host memory, this thread's alone;
                                // `scratch` has room for 64 KiB.
                                unsafe {
                                    for w in 0..words {
                                        host.add(w).write(tag);
                                    }
                                    stream.spin(Duration::from_micros(200)).unwrap();
                                    stream.copy_htod(scratch, host as *const u8, bytes).unwrap();
                                }
                            } else {
                                // SAFETY: live memory until the stream runs the copy.
                                unsafe {
                                    stream.fill_u32(ptr, tag, words).unwrap();
                                    stream.copy_dtod(scratch, ptr, bytes).unwrap();
                                }
                            }
                            live.lock().unwrap().remove(&ptr.as_raw());
                            // SAFETY: allocated above with `bytes`; its uses are queued on
                            // `stream` before this point; freed once.
                            unsafe { r.deallocate(ptr, bytes, &stream) }.unwrap();
                            let back = read_words(&stream, scratch, words);
                            assert!(
                                back.iter().all(|&w| w == tag),
                                "{what}: thread {t} round {round}: the block was reused too soon"
                            );
                        }
                        stream.synchronize_blocking().unwrap();
                        // SAFETY: the stream that used it is synchronized.
                        unsafe { device.free(scratch) }.unwrap();
                    })
                })
                .collect();
            for thread in threads {
                thread.join().unwrap();
            }
        }
    }
}

#[test]
fn producer_and_consumer_on_two_threads_and_two_streams() {
    for device in devices_with_a_slow_sim() {
        for (name, r) in resources(&device) {
            let what = format!("{} {name}", label(&device));
            let (tx, rx) = mpsc::channel::<(DevicePtr, usize, u32, streamalloc::Event)>();
            let producer = {
                let (device, r) = (device.clone(), r.clone());
                std::thread::spawn(move || {
                    let a = device.create_stream().unwrap();
                    let mut rng = Rng(99);
                    for i in 0..100u32 {
                        let bytes = (rng.size(16) + 4) & !3;
                        let ptr = r.allocate(bytes, &a).unwrap();
                        if r.memory_kind() == MemoryKind::PinnedHost {
                            // SAFETY: `bytes` of live host memory, this thread's until sent.
                            unsafe { std::ptr::write_bytes(host_ptr(ptr), i as u8, bytes) };
                        } else {
                            // SAFETY: live until the consumer frees it after waiting for `a`.
                            unsafe { a.fill_u32(ptr, i, bytes / 4) }.unwrap();
                        }
                        tx.send((ptr, bytes, i, a.record().unwrap())).unwrap();
                    }
                })
            };
            let b = device.create_stream().unwrap();
            for (ptr, bytes, i, ready) in rx {
                b.wait(&ready).unwrap();
                if r.memory_kind() == MemoryKind::PinnedHost {
                    // SAFETY: the producer's writes happened before the send; live memory.
                    let first = unsafe { host_ptr(ptr).read() };
                    let last = unsafe { host_ptr(ptr).add(bytes - 1).read() };
                    assert_eq!((first, last), (i as u8, i as u8), "{what}: item {i}");
                } else {
                    let n = (bytes / 4).min(64);
                    let back = read_words(&b, ptr, n);
                    assert!(back.iter().all(|&w| w == i), "{what}: item {i}");
                }
                // SAFETY: allocated by the producer with `bytes`; every use is ordered before
                // this point of `b` (it waited for `a`); freed once.
                unsafe { r.deallocate(ptr, bytes, &b) }.unwrap();
            }
            producer.join().unwrap();
            b.synchronize_blocking().unwrap();
        }
    }
}

#[test]
fn freeing_memory_that_queued_work_still_uses_is_safe() {
    for device in devices() {
        let stream = device.create_stream().unwrap();
        for (name, r) in resources(&device) {
            let what = format!("{} {name}", label(&device));
            let ptr = r.allocate(MIB, &stream).unwrap();
            stream.spin(Duration::from_millis(20)).unwrap();
            if r.memory_kind() != MemoryKind::PinnedHost {
                // SAFETY: live until the free below, which is ordered after this fill.
                unsafe { stream.fill_u32(ptr, 3, MIB / 4) }.unwrap();
            }
            // SAFETY: allocated above; its only use is queued on `stream` before this point.
            unsafe { r.deallocate(ptr, MIB, &stream) }.unwrap();
            stream
                .synchronize_blocking()
                .unwrap_or_else(|e| panic!("{what}: the stream faulted: {e}"));
        }
    }
}

#[test]
fn bad_pointers_and_streams_of_other_devices_are_typed_errors() {
    for device in devices() {
        let stream = device.create_stream().unwrap();
        let other = Device::simulated(SimConfig::default());
        let foreign = other.create_stream().unwrap();
        for (name, r) in resources(&device) {
            let what = format!("{} {name}", label(&device));
            assert!(
                matches!(r.allocate(256, &foreign), Err(Error::WrongDevice { .. })),
                "{what}"
            );
            // SAFETY: rejected before anything is freed.
            let null_with_bytes = unsafe { r.deallocate(DevicePtr(0), 256, &stream) };
            assert!(
                matches!(
                    null_with_bytes,
                    Err(Error::UnknownPointer { ptr: 0, bytes: 256 })
                ),
                "{what}: {null_with_bytes:?}"
            );
            let ptr = r.allocate(1000, &stream).unwrap();
            // SAFETY: rejected before anything is freed.
            let wrong = unsafe { r.deallocate(ptr, 1000, &foreign) };
            assert!(matches!(wrong, Err(Error::WrongDevice { .. })), "{what}");
            // SAFETY: zero bytes with a real pointer is rejected before anything is freed.
            let zero = unsafe { r.deallocate(ptr, 0, &stream) };
            assert!(matches!(zero, Err(Error::UnknownPointer { .. })), "{what}");
            // A pointer it never handed out: every resource can tell on the simulated device;
            // on a GPU only the pinned one checks (the driver's own error is not probed there).
            if device.is_simulated() || r.memory_kind() == MemoryKind::PinnedHost {
                let bogus = DevicePtr(ptr.as_raw() + 4096 * 1024 * 1024);
                // SAFETY: the resource must reject a pointer it never handed out.
                let err = unsafe { r.deallocate(bogus, 1000, &stream) }.unwrap_err();
                assert!(
                    matches!(err, Error::UnknownPointer { ptr: p, bytes: 1000 } if p == bogus.as_raw()),
                    "{what}: {err:?}"
                );
            }
            if r.memory_kind() == MemoryKind::PinnedHost {
                // Another size class than the block's.
                // SAFETY: rejected before anything is freed.
                let err = unsafe { r.deallocate(ptr, 100_000, &stream) }.unwrap_err();
                assert!(matches!(err, Error::UnknownPointer { .. }), "{what}");
            }
            // Nothing was lost: the real free still works.
            // SAFETY: allocated above with 1000 bytes, unused, freed once.
            unsafe { r.deallocate(ptr, 1000, &stream) }.unwrap();
        }
        stream.synchronize_blocking().unwrap();
    }
}

#[test]
fn dropping_resources_and_streams_leaks_no_handles() {
    for device in devices() {
        {
            let stream = device.create_stream().unwrap();
            let rs = resources(&device);
            for (_, r) in &rs {
                let ptr = r.allocate(4 * KIB, &stream).unwrap();
                stream.spin(Duration::from_millis(5)).unwrap();
                // SAFETY: unused, freed once.
                unsafe { r.deallocate(ptr, 4 * KIB, &stream) }.unwrap();
            }
            // Dropped with frees pending on the stream (the pinned resource waits for them).
        }
        assert!(
            eventually(Duration::from_secs(5), || device.handle_count() == 1),
            "{}: {} handles left",
            label(&device),
            device.handle_count()
        );
    }
}

#[test]
fn resources_are_send_sync_debug_and_report_their_kind() {
    fn send_sync<T: Send + Sync + std::fmt::Debug>() {}
    send_sync::<CudaResource>();
    send_sync::<CudaAsyncResource>();
    send_sync::<ManagedResource>();
    send_sync::<PinnedHostResource>();
    send_sync::<ExpandablePoolResource>();
    let device = Device::simulated(SimConfig::default());
    let kinds: Vec<MemoryKind> = resources(&device)
        .iter()
        .map(|(_, r)| r.memory_kind())
        .collect();
    assert_eq!(
        kinds,
        [
            MemoryKind::Device,
            MemoryKind::Device,
            MemoryKind::Managed,
            MemoryKind::PinnedHost,
            MemoryKind::Device
        ]
    );
    for (name, r) in resources(&device) {
        let debug = format!("{r:?}");
        assert!(!debug.is_empty(), "{name}");
    }
}

// ===== CudaAsyncResource =====

#[test]
fn cuda_async_counters_move_and_trim_gives_memory_back() {
    for device in devices() {
        let what = label(&device);
        let stream = device.create_stream().unwrap();
        let r = CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap();
        assert_eq!(r.release_threshold().unwrap(), usize::MAX, "{what}");
        assert_eq!(r.used_bytes().unwrap(), 0, "{what}");
        assert_eq!(r.reserved_bytes().unwrap(), 0, "{what}");

        let bytes = 64 * MIB;
        let ptr = r.allocate(bytes, &stream).unwrap();
        let (used, reserved) = (r.used_bytes().unwrap(), r.reserved_bytes().unwrap());
        assert!(
            used >= bytes && reserved >= used,
            "{what}: {used} {reserved}"
        );

        // SAFETY: unused, freed once.
        unsafe { r.deallocate(ptr, bytes, &stream) }.unwrap();
        stream.synchronize_blocking().unwrap();
        assert_eq!(r.used_bytes().unwrap(), 0, "{what}");
        let kept = r.reserved_bytes().unwrap();
        assert!(kept >= bytes, "{what}: the pool kept {kept} bytes");

        // Reuse from what the pool keeps: it does not grow.
        let again = r.allocate(bytes, &stream).unwrap();
        assert_eq!(r.reserved_bytes().unwrap(), kept, "{what}");
        // SAFETY: unused, freed once.
        unsafe { r.deallocate(again, bytes, &stream) }.unwrap();
        stream.synchronize_blocking().unwrap();

        r.trim_to(0).unwrap();
        assert_eq!(r.reserved_bytes().unwrap(), 0, "{what}");
        assert_eq!(r.used_bytes().unwrap(), 0, "{what}");

        // A live allocation survives a trim.
        let live = r.allocate(bytes, &stream).unwrap();
        r.trim_to(0).unwrap();
        assert!(r.reserved_bytes().unwrap() >= bytes, "{what}");
        write_and_check(MemoryKind::Device, live, bytes, &stream, 9);
        // SAFETY: its uses are synchronized; freed once.
        unsafe { r.deallocate(live, bytes, &stream) }.unwrap();
        stream.synchronize_blocking().unwrap();
    }
}

#[test]
fn cuda_async_initial_size_threshold_and_maximum() {
    for device in devices() {
        let what = label(&device);
        let stream = device.create_stream().unwrap();

        // Primed with 32 MiB: reserved before anything is allocated, and reused.
        let primed = CudaAsyncResource::new(
            &device,
            CudaAsyncOptions {
                initial_pool_size: Some(32 * MIB),
                ..CudaAsyncOptions::default()
            },
        )
        .unwrap();
        let reserved = primed.reserved_bytes().unwrap();
        assert!(reserved >= 32 * MIB, "{what}: primed pool holds {reserved}");
        assert_eq!(primed.used_bytes().unwrap(), 0, "{what}");
        let ptr = primed.allocate(32 * MIB, &stream).unwrap();
        assert_eq!(primed.reserved_bytes().unwrap(), reserved, "{what}");
        // SAFETY: unused, freed once.
        unsafe { primed.deallocate(ptr, 32 * MIB, &stream) }.unwrap();

        // Threshold zero: freed memory goes back at the next synchronization.
        let lean = CudaAsyncResource::new(
            &device,
            CudaAsyncOptions {
                release_threshold: Some(0),
                ..CudaAsyncOptions::default()
            },
        )
        .unwrap();
        assert_eq!(lean.release_threshold().unwrap(), 0, "{what}");
        let ptr = lean.allocate(16 * MIB, &stream).unwrap();
        // SAFETY: unused, freed once.
        unsafe { lean.deallocate(ptr, 16 * MIB, &stream) }.unwrap();
        stream.synchronize_blocking().unwrap();
        assert_eq!(lean.reserved_bytes().unwrap(), 0, "{what}");
        lean.set_release_threshold(usize::MAX).unwrap();
        assert_eq!(lean.release_threshold().unwrap(), usize::MAX, "{what}");

        // A pool of at most 64 MiB.
        let capped = CudaAsyncResource::new(
            &device,
            CudaAsyncOptions {
                maximum_pool_size: Some(64 * MIB),
                ..CudaAsyncOptions::default()
            },
        )
        .unwrap();
        assert_eq!(capped.maximum_bytes(), 64 * MIB);
        let first = capped.allocate(48 * MIB, &stream).unwrap();
        match capped.allocate(48 * MIB, &stream) {
            Err(Error::OutOfMemory {
                requested, maximum, ..
            }) => {
                assert_eq!(requested, 48 * MIB, "{what}");
                assert_eq!(maximum, 64 * MIB, "{what}");
            }
            other => panic!("{what}: past the maximum: {other:?}"),
        }
        // SAFETY: unused, freed once.
        unsafe { capped.deallocate(first, 48 * MIB, &stream) }.unwrap();
        stream.synchronize_blocking().unwrap();
        let second = capped.allocate(48 * MIB, &stream).unwrap();
        // SAFETY: unused, freed once.
        unsafe { capped.deallocate(second, 48 * MIB, &stream) }.unwrap();
        stream.synchronize_blocking().unwrap();
    }
}

#[test]
fn cuda_async_frees_are_stream_ordered() {
    for device in devices() {
        let what = label(&device);
        let r = CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap();
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let n = 256 * KIB / 4;
        let x = r.allocate(n * 4, &a).unwrap();
        a.spin(Duration::from_millis(20)).unwrap();
        // SAFETY: `x` is live until the free below, which `a` reaches after this fill.
        unsafe { a.fill_u32(x, 0xAAAA, n) }.unwrap();
        // SAFETY: its only use is queued on `a` before this point.
        unsafe { r.deallocate(x, n * 4, &a) }.unwrap();
        // Another stream allocates at once and writes its own value; the fill on `a` must not
        // land in it, whatever address the driver picks.
        let y = r.allocate(n * 4, &b).unwrap();
        // SAFETY: live until freed below.
        unsafe { b.fill_u32(y, 0xBBBB, n) }.unwrap();
        a.synchronize_blocking().unwrap();
        let back = read_words(&b, y, n);
        assert!(back.iter().all(|&w| w == 0xBBBB), "{what}");
        // SAFETY: its uses are synchronized; freed once.
        unsafe { r.deallocate(y, n * 4, &b) }.unwrap();
        b.synchronize_blocking().unwrap();
    }
}

// ===== ManagedResource =====

#[test]
fn managed_refuses_more_than_the_device_can_hold() {
    for device in devices() {
        let what = label(&device);
        let stream = device.create_stream().unwrap();
        let r = ManagedResource::new(&device);
        let free = device.free_memory().unwrap();
        match r.allocate(free + 64 * MIB, &stream) {
            Err(Error::OutOfMemory {
                requested,
                available,
                maximum,
            }) => {
                assert_eq!(requested, free + 64 * MIB, "{what}");
                assert!(available < requested, "{what}");
                assert_eq!(maximum, device.total_memory(), "{what}");
            }
            other => panic!("{what}: more than free memory gave {other:?}"),
        }
        // What it has handed out counts, touched or not: with 1 GiB out, a request for the
        // rest of the card plus one byte is refused without asking the driver.
        let held = r.allocate(GIB, &stream).unwrap();
        assert_eq!(r.outstanding_bytes(), GIB, "{what}");
        let rest = device.total_memory() - GIB + 1;
        match r.allocate(rest, &stream) {
            Err(Error::OutOfMemory { available, .. }) => {
                assert!(available <= device.total_memory() - GIB, "{what}")
            }
            other => panic!("{what}: oversubscription gave {other:?}"),
        }
        write_and_check(MemoryKind::Managed, held, GIB, &stream, 5);
        // SAFETY: its uses are synchronized; freed once.
        unsafe { r.deallocate(held, GIB, &stream) }.unwrap();
        assert_eq!(r.outstanding_bytes(), 0, "{what}");
        stream.synchronize_blocking().unwrap();
    }
}

#[test]
fn managed_on_a_small_simulated_device_adds_up_untouched_allocations() {
    let device = Device::simulated(SimConfig {
        total_memory: 64 * MIB,
        ..SimConfig::default()
    });
    let stream = device.create_stream().unwrap();
    let r = ManagedResource::new(&device);
    let a = r.allocate(40 * MIB, &stream).unwrap();
    let err = r.allocate(40 * MIB, &stream).unwrap_err();
    assert!(
        matches!(err, Error::OutOfMemory { requested, available, maximum }
            if requested == 40 * MIB && available <= 24 * MIB && maximum == 64 * MIB),
        "{err:?}"
    );
    let b = r.allocate(16 * MIB, &stream).unwrap();
    // SAFETY: unused, freed once each.
    unsafe {
        r.deallocate(a, 40 * MIB, &stream).unwrap();
        r.deallocate(b, 16 * MIB, &stream).unwrap();
    }
    stream.synchronize_blocking().unwrap();
    let c = r.allocate(40 * MIB, &stream).unwrap();
    // SAFETY: unused, freed once.
    unsafe { r.deallocate(c, 40 * MIB, &stream) }.unwrap();
    stream.synchronize_blocking().unwrap();
}

// ===== PinnedHostResource =====

#[test]
fn pinned_block_is_reused_only_after_the_gpu_is_done_with_it() {
    for device in devices() {
        let what = label(&device);
        let stream = device.create_stream().unwrap();
        let r = PinnedHostResource::new(&device);
        let bytes = 64 * KIB;
        let a = r.allocate(bytes, &stream).unwrap();
        assert_eq!(r.stats().host_allocations, 1, "{what}");

        // The clock starts before the kernel is queued: queueing and recording can block for a
        // while when another test makes a device-synchronizing call, and only time since
        // `started` bounds how long the kernel has been running.
        let started = Instant::now();
        stream.spin(Duration::from_millis(30)).unwrap();
        // SAFETY: unused by the host from here on; the GPU work before it is the spin.
        unsafe { r.deallocate(a, bytes, &stream) }.unwrap();
        let b = r.allocate(bytes, &stream).unwrap();
        let still_running = started.elapsed() < Duration::from_millis(25);
        if still_running {
            assert_ne!(a, b, "{what}: reused while the stream still ran");
            assert_eq!(r.stats().pending_blocks, 1, "{what}");
        }

        stream.synchronize_blocking().unwrap();
        // The stream is done: the next allocation of that size gets `a` back, without pinning
        // more memory (even if the reactor has not moved it to the cache yet).
        let pinned_before = r.stats().host_allocations;
        let c = r.allocate(bytes, &stream).unwrap();
        // Unless `b` already got `a` back (the spin was over by then, as a slow queueing can
        // make it), `c` does, without pinning more memory.
        if b != a {
            assert_eq!(c, a, "{what}: the finished block was not reused");
            assert_eq!(r.stats().host_allocations, pinned_before, "{what}");
        }
        // SAFETY: unused, freed once each.
        unsafe {
            r.deallocate(b, bytes, &stream).unwrap();
            r.deallocate(c, bytes, &stream).unwrap();
        }
        stream.synchronize_blocking().unwrap();
        assert!(
            eventually(Duration::from_secs(2), || r.stats().cached_blocks == 2),
            "{what}: {:?}",
            r.stats()
        );
    }
}

#[test]
fn pinned_copy_staging_round_trip_and_reuse_waits_for_the_copy() {
    for device in devices() {
        let what = label(&device);
        let stream = device.create_stream().unwrap();
        let r = PinnedHostResource::new(&device);
        let n = 16 * KIB;
        let bytes = n * 4;
        let dev = device.malloc(bytes).unwrap();

        // Stage data in: host writes, async copy to the device, free the staging block at once.
        let up = r.allocate(bytes, &stream).unwrap();
        let host = host_ptr(up) as *mut u32;
        let started = Instant::now();
        // SAFETY: `bytes` of live host memory that only this test uses; `dev` is live.
        unsafe {
            for i in 0..n {
                host.add(i).write(i as u32 * 3);
            }
            stream.spin(Duration::from_millis(30)).unwrap();
            stream.copy_htod(dev, host as *const u8, bytes).unwrap();
            r.deallocate(up, bytes, &stream).unwrap();
        }
        // A new staging block of the same size must be another one while the copy is queued:
        // scribbling on it must not change what reaches the device.
        let other = r.allocate(bytes, &stream).unwrap();
        if started.elapsed() < Duration::from_millis(25) {
            assert_ne!(
                other, up,
                "{what}: the staging block was reused before its copy ran"
            );
        }
        if other != up {
            // SAFETY: live host memory that only this test uses.
            unsafe { std::ptr::write_bytes(host_ptr(other), 0xFF, bytes) };
        }
        // Stage data out through the new block.
        // SAFETY: `other` is live until it is freed below, after the synchronize.
        unsafe { stream.copy_dtoh(host_ptr(other), dev, bytes) }.unwrap();
        stream.synchronize_blocking().unwrap();
        let out = host_ptr(other) as *const u32;
        for i in (0..n).step_by(997) {
            // SAFETY: the copy into it has run (synchronized).
            assert_eq!(
                unsafe { out.add(i).read() },
                i as u32 * 3,
                "{what}: word {i}"
            );
        }
        // SAFETY: unused from here on; freed once each.
        unsafe {
            r.deallocate(other, bytes, &stream).unwrap();
            stream.synchronize_blocking().unwrap();
            device.free(dev).unwrap();
        }
    }
}

#[test]
fn pinned_cache_hits_do_not_pin_again() {
    for device in devices() {
        let what = label(&device);
        let stream = device.create_stream().unwrap();
        let r = PinnedHostResource::new(&device);
        // 1000 and 1024 bytes share a size class.
        for round in 0..200 {
            let bytes = if round % 2 == 0 { 1000 } else { 1024 };
            let ptr = r.allocate(bytes, &stream).unwrap();
            // SAFETY: live host memory that only this test uses.
            unsafe { std::ptr::write_bytes(host_ptr(ptr), round as u8, bytes) };
            // SAFETY: unused from here on; freed once.
            unsafe { r.deallocate(ptr, bytes, &stream) }.unwrap();
            if round % 10 == 9 {
                stream.synchronize_blocking().unwrap();
            }
        }
        stream.synchronize_blocking().unwrap();
        let stats = r.stats();
        // Between synchronizations at most ten blocks are in flight.
        assert!(stats.host_allocations <= 10, "{what}: {stats:?}");
        assert_eq!(stats.live_blocks, 0, "{what}");
    }
}

#[test]
fn pinned_release_and_the_cache_limit() {
    for device in devices() {
        let what = label(&device);
        let stream = device.create_stream().unwrap();
        let r = PinnedHostResource::with_options(
            &device,
            PinnedHostOptions {
                max_cached_bytes: MIB,
            },
        );
        let a = r.allocate(MIB, &stream).unwrap();
        let b = r.allocate(MIB, &stream).unwrap();
        // SAFETY: unused, freed once each.
        unsafe {
            r.deallocate(a, MIB, &stream).unwrap();
            r.deallocate(b, MIB, &stream).unwrap();
        }
        stream.synchronize_blocking().unwrap();
        assert!(
            eventually(Duration::from_secs(2), || {
                let s = r.stats();
                s.cached_blocks == 1 && s.retired_blocks == 1 && s.pending_blocks == 0
            }),
            "{what}: {:?}",
            r.stats()
        );
        assert_eq!(r.stats().cached_bytes, MIB, "{what}");

        // A hit takes the cached block; a miss reuses the retired one before pinning more.
        let pinned = r.stats().host_allocations;
        let c = r.allocate(MIB, &stream).unwrap();
        let d = r.allocate(MIB, &stream).unwrap();
        assert!(
            [a, b].contains(&c) && [a, b].contains(&d) && c != d,
            "{what}"
        );
        assert_eq!(r.stats().host_allocations, pinned, "{what}");
        // SAFETY: unused, freed once each.
        unsafe {
            r.deallocate(c, MIB, &stream).unwrap();
            r.deallocate(d, MIB, &stream).unwrap();
        }
        stream.synchronize_blocking().unwrap();
        assert!(eventually(Duration::from_secs(2), || r
            .stats()
            .pending_blocks
            == 0));

        r.release().unwrap();
        let s = r.stats();
        assert_eq!(
            (s.cached_blocks, s.cached_bytes, s.retired_blocks),
            (0, 0, 0),
            "{what}"
        );
        let e = r.allocate(MIB, &stream).unwrap();
        assert_eq!(r.stats().host_allocations, pinned + 1, "{what}");
        // SAFETY: unused, freed once.
        unsafe { r.deallocate(e, MIB, &stream) }.unwrap();
        stream.synchronize_blocking().unwrap();
    }
}

#[test]
fn pinned_drop_waits_for_pending_blocks() {
    for device in devices() {
        let stream = device.create_stream().unwrap();
        let r = PinnedHostResource::new(&device);
        let ptr = r.allocate(4 * KIB, &stream).unwrap();
        stream.spin(Duration::from_millis(30)).unwrap();
        // SAFETY: unused from here on; freed once.
        unsafe { r.deallocate(ptr, 4 * KIB, &stream) }.unwrap();
        let started = Instant::now();
        drop(r);
        // The drop waited for the spin before freeing the block.
        assert!(
            started.elapsed() >= Duration::from_millis(20)
                || stream.record().unwrap().is_complete(),
            "{}",
            label(&device)
        );
        stream.synchronize_blocking().unwrap();
    }
}
