//! The simulated device against CUDA's documented behaviour, where a difference would let a
//! test pass on the simulated device and fail on a GPU.

use streamalloc::{Device, Error, SimConfig};

/// `cuMemsetD32Async` refuses a destination that is not 4-aligned (`CUDA_ERROR_INVALID_VALUE`),
/// and a kernel that reads or writes a word at a misaligned address faults
/// (`CUDA_ERROR_MISALIGNED_ADDRESS`, reported at the next synchronization). The simulated
/// device did both without complaint, so a test with an off-by-one offset passed there and
/// failed on a GPU. Simulated only: on a GPU the kernel's fault would break the context for
/// the rest of this test binary.
#[test]
fn misaligned_word_operations_fail_as_on_a_gpu() {
    let device = Device::simulated(SimConfig::default());
    let raw = device.malloc(4096).unwrap();

    let s = device.create_stream().unwrap();
    // SAFETY: 4096 live bytes of this device, freed only after every stream has synchronized.
    let memset = unsafe { s.memset_d32(raw.offset(2), 7, 4) };
    assert!(
        matches!(memset, Err(Error::Driver { code: 1, .. })),
        "{memset:?}"
    );
    // Refused at the call: the stream is not broken.
    s.synchronize_blocking().unwrap();
    // SAFETY: as above; 4-aligned.
    unsafe { s.memset_d32(raw.offset(4), 7, 4) }.unwrap();
    s.synchronize_blocking().unwrap();

    type Kernel = fn(&streamalloc::Stream, streamalloc::DevicePtr) -> streamalloc::Result<()>;
    let kernels: [(&str, Kernel); 4] = [
        // SAFETY (each): 4096 live bytes as above; the offsets stay inside them.
        ("fill_u32", |s, p| unsafe { s.fill_u32(p, 1, 4) }),
        ("scale_f32", |s, p| unsafe { s.scale_f32(p, 2.0, 4) }),
        ("fill_pattern_u32", |s, p| unsafe {
            s.fill_pattern_u32(p, 3, 4)
        }),
        ("count_mismatches_u32", |s, p| unsafe {
            // The source at `p`; the counter (8-aligned, as the call checks) further on.
            let counter = streamalloc::DevicePtr((p.0 + 2048) & !7);
            s.count_mismatches_u32(p, 3, 4, counter)
        }),
    ];
    for (name, launch) in kernels {
        let s = device.create_stream().unwrap();
        launch(&s, raw.offset(1)).unwrap();
        let done = s.synchronize_blocking();
        assert!(
            matches!(done, Err(Error::Driver { code: 716, .. })),
            "{name}: {done:?}"
        );
        // Aligned, on a fresh stream: fine.
        let s = device.create_stream().unwrap();
        launch(&s, raw.offset(8)).unwrap();
        s.synchronize_blocking().unwrap();
    }
    // SAFETY: from `malloc`, freed once, every stream that used it synchronized.
    unsafe { device.free(raw) }.unwrap();
}

/// Zero bytes of work touch no memory: a copy or memset of nothing is a no-op whatever the
/// address, as CUDA takes it (and as the race detector and the reservations' granule check
/// already did), so a raw copy into an empty vector (whose address is null) leaves the stream
/// working. The simulated device looked the address up anyway, failed the operation with
/// `InvalidAddress` and so poisoned the stream: every later event on it failed.
#[test]
fn zero_byte_copies_and_memsets_touch_nothing() {
    use std::sync::Arc;
    use streamalloc::resource::cuda::CudaResource;
    use streamalloc::resource::pool::{PoolOptions, PoolResource};
    use streamalloc::DeviceVec;

    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut devices = vec![Device::simulated(SimConfig::default())];
    if let Ok(gpu) = Device::cuda(0) {
        devices.push(gpu);
    }
    for device in devices {
        let pool = Arc::new(
            PoolResource::new(CudaResource::new(&device), PoolOptions::default()).unwrap(),
        );
        let s = device.create_stream().unwrap();
        let empty = DeviceVec::<u32>::new(&pool, 0, &s).unwrap();
        let full = DeviceVec::from_host(&pool, &[1u32, 2, 3], &s).unwrap();
        let mut host = [0u8; 4];
        // SAFETY: each moves zero bytes; `empty` and `full` outlive the stream's work (it is
        // synchronized below).
        unsafe {
            s.copy_htod(empty.as_ptr(), host.as_ptr(), 0).unwrap();
            s.copy_dtoh(host.as_mut_ptr(), empty.as_ptr(), 0).unwrap();
            s.copy_dtod(empty.as_ptr(), full.as_ptr(), 0).unwrap();
            s.copy_dtod(full.as_ptr(), empty.as_ptr(), 0).unwrap();
            s.memset_d8(empty.as_ptr(), 1, 0).unwrap();
            s.memset_d32(empty.as_ptr(), 1, 0).unwrap();
        }
        s.synchronize_blocking()
            .unwrap_or_else(|e| panic!("{}: the stream failed: {e}", device.name()));
        assert_eq!(rt.block_on(full.to_host(&s)).unwrap(), [1, 2, 3]);
    }
}

/// The memset half of [`misaligned_word_operations_fail_as_on_a_gpu`] on a GPU too (a refused
/// call breaks nothing there): checks the claim the simulated device was changed to follow,
/// that `cuMemsetD32Async` refuses a destination that is not 4-aligned at the call.
#[test]
fn a_misaligned_word_memset_is_refused_at_the_call_on_every_device() {
    let mut devices = vec![Device::simulated(SimConfig::default())];
    if let Ok(gpu) = Device::cuda(0) {
        devices.push(gpu);
    }
    for device in devices {
        let raw = device.malloc(4096).unwrap();
        let s = device.create_stream().unwrap();
        // SAFETY: 4096 live bytes of this device, freed only after the stream synchronized.
        let memset = unsafe { s.memset_d32(raw.offset(2), 7, 4) };
        assert!(
            matches!(memset, Err(Error::Driver { code: 1, .. })),
            "{}: {memset:?}",
            device.name()
        );
        s.synchronize_blocking().unwrap();
        // SAFETY: as above; nothing was queued on it.
        unsafe { device.free(raw) }.unwrap();
    }
}

/// Page-locked host memory is device-accessible, as on a GPU (`cuMemHostAlloc` with
/// `PORTABLE | DEVICEMAP`, whose device address under unified addressing is the host
/// address): memsets, kernels and copies on a buffer of `PinnedHostResource`, within a device
/// and to another, and the host sees what they wrote. The simulated device looked only in
/// its device memory and failed every such operation with `InvalidAddress`, poisoning the
/// stream, so the resource's promise (work on the stream may use the memory) did not hold.
#[test]
fn device_work_uses_pinned_host_memory_as_on_a_gpu() {
    use std::sync::Arc;
    use streamalloc::resource::cuda::CudaResource;
    use streamalloc::resource::pinned::PinnedHostResource;
    use streamalloc::{DeviceBuffer, MemoryAccess, RaceDetection};

    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let sim = || {
        Device::simulated(SimConfig {
            race_detection: RaceDetection::Error,
            ..SimConfig::default()
        })
    };
    let mut devices = vec![(sim(), sim())];
    if let (Ok(gpu), Ok(again)) = (Device::cuda(0), Device::cuda(0)) {
        devices.push((gpu, again));
    }
    for (device, other) in devices {
        let name = device.name().to_owned();
        let (s, t) = (
            device.create_stream().unwrap(),
            other.create_stream().unwrap(),
        );
        let pinned = Arc::new(PinnedHostResource::new(&device));
        let plain = Arc::new(CudaResource::new(&device));
        let elsewhere = Arc::new(CudaResource::new(&other));
        let mut buf = DeviceBuffer::new(&pinned, 4096, &s).unwrap();
        let host = buf.as_ptr().as_raw() as usize as *const u8;
        buf.memset(7).unwrap();
        s.synchronize_blocking()
            .unwrap_or_else(|e| panic!("{name}: the memset failed: {e}"));
        // SAFETY: 4096 live bytes of host memory; the memset that wrote them has run.
        assert_eq!(unsafe { (host.read(), host.add(4095).read()) }, (7, 7));
        // SAFETY: 1024 words of the buffer, live until after the stream synchronizes.
        unsafe { s.fill_u32(buf.as_ptr(), 0x0909_0909, 1024) }.unwrap();
        s.declare_access(buf.as_ptr(), 4096, MemoryAccess::Read, "reader")
            .unwrap();
        assert_eq!(rt.block_on(buf.to_host()).unwrap(), vec![9; 4096], "{name}");
        let copy = buf.try_clone_to(&plain, &s).unwrap();
        let back = copy.try_clone_to(&pinned, &s).unwrap();
        let far = buf.try_clone_to(&elsewhere, &t).unwrap();
        let far_back = far.try_clone_to(&pinned, &s).unwrap();
        assert_eq!(
            rt.block_on(copy.to_host()).unwrap(),
            vec![9; 4096],
            "{name}"
        );
        assert_eq!(
            rt.block_on(back.to_host()).unwrap(),
            vec![9; 4096],
            "{name}"
        );
        assert_eq!(rt.block_on(far.to_host()).unwrap(), vec![9; 4096], "{name}");
        assert_eq!(
            rt.block_on(far_back.to_host()).unwrap(),
            vec![9; 4096],
            "{name}"
        );
        s.synchronize_blocking()
            .unwrap_or_else(|e| panic!("{name}: the stream failed: {e}"));
        t.synchronize_blocking()
            .unwrap_or_else(|e| panic!("{name}: the other device's stream failed: {e}"));
    }
}

/// A declared access whose range wraps past the top of the address space is refused at the
/// call with `InvalidAddress`, as every stream operation refuses one: no memory can hold it.
/// The race detector clipped its end to the top instead and checked (and remembered) what was
/// left, so a stand-in kernel's off-by-a-sign size went unreported, or was reported as a race
/// over memory far past the buffer. Refused on a GPU too (where the declaration is otherwise
/// a no-op), so that code behaves alike on both.
#[test]
fn a_declared_access_that_wraps_is_refused_at_the_call() {
    use streamalloc::{DevicePtr, MemoryAccess, RaceDetection};

    let mut devices = vec![Device::simulated(SimConfig {
        race_detection: RaceDetection::Record,
        ..SimConfig::default()
    })];
    if let Ok(gpu) = Device::cuda(0) {
        devices.push(gpu);
    }
    for device in devices {
        let name = device.name().to_owned();
        let raw = device.malloc(4096).unwrap();
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        a.declare_access(raw, 4096, MemoryAccess::Write, "writer")
            .unwrap();
        let top = DevicePtr(u64::MAX - 15);
        for (ptr, bytes) in [(top, 32), (raw, usize::MAX)] {
            let declared = b.declare_access(ptr, bytes, MemoryAccess::Read, "reader");
            assert!(
                matches!(declared, Err(Error::InvalidAddress { ptr: p, bytes: n })
                    if p == ptr.as_raw() && n == bytes),
                "{name}: {declared:?}"
            );
        }
        // Nothing was checked or remembered: no race with `a`'s write.
        assert!(device.races().is_empty(), "{name}: {:?}", device.races());
        a.synchronize_blocking().unwrap();
        b.synchronize_blocking().unwrap();
        // SAFETY: from `malloc`, freed once; no work uses it (both streams are idle).
        unsafe { device.free(raw) }.unwrap();
    }
}

/// `cuMemPrefetchAsync` takes managed memory: device memory from `cuMemAlloc` and page-locked
/// host memory are refused at the call with `CUDA_ERROR_INVALID_VALUE` (the crate's
/// `PrefetchAdaptor` prefetches managed memory only for that reason). The simulated device took
/// any range, so a prefetch of the wrong memory passed there and failed on a GPU.
#[test]
fn a_prefetch_of_memory_that_is_not_managed_is_refused_at_the_call() {
    use streamalloc::DevicePtr;

    let mut devices = vec![Device::simulated(SimConfig::default())];
    if let Ok(gpu) = Device::cuda(0) {
        devices.push(gpu);
    }
    for device in devices {
        let name = device.name().to_owned();
        let s = device.create_stream().unwrap();
        let managed = device.malloc_managed(4096).unwrap();
        let plain = device.malloc(4096).unwrap();
        let host = device.malloc_host(4096).unwrap();
        // SAFETY: each range is 4096 live bytes, freed only after the stream synchronized.
        unsafe { s.prefetch(managed, 4096) }
            .unwrap_or_else(|e| panic!("{name}: managed memory: {e}"));
        for (what, ptr) in [("device", plain), ("pinned", DevicePtr(host as u64))] {
            // SAFETY: as above.
            let prefetched = unsafe { s.prefetch(ptr, 4096) };
            assert!(
                matches!(prefetched, Err(Error::Driver { code: 1, .. })),
                "{name}: {what} memory: {prefetched:?}"
            );
        }
        // Refused at the call: the stream is not broken.
        s.synchronize_blocking().unwrap();
        // SAFETY: allocated above, each freed once; no work uses them (the stream is idle).
        unsafe {
            device.free(managed).unwrap();
            device.free(plain).unwrap();
            device.free_host(host).unwrap();
        }
    }
}
