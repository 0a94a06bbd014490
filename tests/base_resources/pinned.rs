//! `PinnedHostResource`: block reuse after the GPU, copy staging, the cache, release and its
//! limit, drop waiting for pending blocks.

use super::*;

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

/// A cached block whose `cuMemFreeHost` fails in `release` (a simulated fault) is kept, not
/// forgotten: it stays the resource's, as a retired block, and a later `release` frees it.
/// Before, the block had left the cache's lists and was lost: pinned until the process ends,
/// counted nowhere.
#[test]
fn pinned_release_keeps_a_block_whose_free_fails() {
    let faults = streamalloc::Faults::new();
    let device = Device::simulated(SimConfig {
        faults: faults.clone(),
        ..SimConfig::default()
    });
    let stream = device.create_stream().unwrap();
    let r = PinnedHostResource::new(&device);
    let ptr = r.allocate(4 * KIB, &stream).unwrap();
    // SAFETY: unused, freed once.
    unsafe { r.deallocate(ptr, 4 * KIB, &stream) }.unwrap();
    stream.synchronize_blocking().unwrap();
    assert!(
        eventually(Duration::from_secs(2), || r.stats().cached_blocks == 1),
        "{:?}",
        r.stats()
    );
    faults.fail_next(streamalloc::FaultKind::HostFree);
    assert!(r.release().is_err());
    assert_eq!(faults.injected(streamalloc::FaultKind::HostFree), 1);
    let s = r.stats();
    assert_eq!(
        s.cached_blocks + s.retired_blocks,
        1,
        "the block whose free failed was lost: {s:?}"
    );
    // Tried again, and freed this time: nothing is left.
    r.release().unwrap();
    let s = r.stats();
    assert_eq!((s.cached_blocks, s.retired_blocks), (0, 0), "{s:?}");
}
