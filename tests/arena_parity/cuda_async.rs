//! `CudaAsyncResource` beside RMM's `cuda_async_memory_resource`: the exact maximum, the
//! default pool and views of existing pools.

use super::*;

fn free_async_mr(mr: &CudaAsyncResource, ptr: DevicePtr, bytes: usize, stream: &Stream) {
    // SAFETY: allocated from `mr` with `bytes`, unused, freed once.
    unsafe { mr.deallocate(ptr, bytes, stream) }.unwrap();
}

/// Finding 5: under `maximum_pool_size: Some(4 MiB)`, `allocate(4 MiB)` then `allocate(1 MiB)`
/// both succeeded on an H200 (the driver rounds `maxSize` up) while the simulated device
/// refused the second. Now both devices refuse it, and the maximum is exact to the 256 bytes:
/// 4 MiB in two odd sizes fits, one byte more does not. A free counts when it is issued.
#[test]
fn cuda_async_maximum_holds_on_every_device() {
    for device in devices() {
        let what = label(&device);
        let s = device.create_stream().unwrap();
        let mr = CudaAsyncResource::new(
            &device,
            CudaAsyncOptions {
                maximum_pool_size: Some(4 * MIB),
                ..CudaAsyncOptions::default()
            },
        )
        .unwrap();
        assert_eq!(mr.maximum_bytes(), 4 * MIB, "{what}");
        let all = mr.allocate(4 * MIB, &s).unwrap();
        assert_eq!(mr.allocated_bytes(), 4 * MIB, "{what}");
        match mr.allocate(MIB, &s) {
            Err(Error::OutOfMemory {
                requested,
                available,
                maximum,
            }) => assert_eq!((requested, available, maximum), (MIB, 0, 4 * MIB), "{what}"),
            Ok(ptr) => {
                free_async_mr(&mr, ptr, MIB, &s);
                panic!("{what}: 1 MiB more than the 4 MiB maximum was served");
            }
            Err(e) => panic!("{what}: {e}"),
        }
        // Counted when issued: the count drops at once.
        free_async_mr(&mr, all, 4 * MIB, &s);
        assert_eq!(mr.allocated_bytes(), 0, "{what}");
        s.synchronize_blocking().unwrap();

        // Exactly 4 MiB in two sizes that are not multiples of the driver's granularity.
        let a = mr.allocate(3 * MIB + 1000, &s).unwrap();
        let b = mr.allocate(MIB - 1024, &s).unwrap();
        assert_eq!(mr.allocated_bytes(), 4 * MIB, "{what}");
        assert!(
            matches!(
                mr.allocate(1, &s),
                // The size counted against the maximum: one byte, rounded to 256 (as the
                // limiting adaptor reports it).
                Err(Error::OutOfMemory {
                    requested: 256,
                    available: 0,
                    ..
                })
            ),
            "{what}: one byte past the maximum"
        );
        free_async_mr(&mr, b, MIB - 1024, &s);
        let c = mr.allocate(MIB - 1024, &s).unwrap();
        free_async_mr(&mr, a, 3 * MIB + 1000, &s);
        free_async_mr(&mr, c, MIB - 1024, &s);
        assert_eq!(mr.allocated_bytes(), 0, "{what}");
        // More than the maximum fails at once, without a driver call.
        assert!(matches!(
            mr.allocate(4 * MIB + 1, &s),
            Err(Error::OutOfMemory { .. })
        ));
        s.synchronize_blocking().unwrap();
    }
}

/// Threads racing for the last bytes under the maximum never pass it together.
#[test]
fn cuda_async_maximum_holds_under_threads() {
    for device in devices() {
        let what = label(&device);
        let mr = CudaAsyncResource::new(
            &device,
            CudaAsyncOptions {
                maximum_pool_size: Some(8 * MIB),
                ..CudaAsyncOptions::default()
            },
        )
        .unwrap();
        let served = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    let s = device.create_stream().unwrap();
                    let mut mine = Vec::new();
                    for _ in 0..8 {
                        if let Ok(ptr) = mr.allocate(MIB, &s) {
                            mine.push(ptr);
                        }
                    }
                    served.fetch_add(mine.len(), std::sync::atomic::Ordering::SeqCst);
                    // Hold them until every thread has tried.
                    std::thread::sleep(Duration::from_millis(50));
                    mine.into_iter()
                        .for_each(|ptr| free_async_mr(&mr, ptr, MIB, &s));
                    s.synchronize_blocking().unwrap();
                });
            }
        });
        let served = served.into_inner();
        assert!(
            served <= 8,
            "{what}: {served} MiB served under an 8 MiB maximum"
        );
        assert_eq!(mr.allocated_bytes(), 0, "{what}");
    }
}

/// A resource over the device's default pool (RMM's `cuda_async_view_memory_resource`): two of
/// them share it, a resource made by `new` does not, dropping a view leaves the pool working,
/// and the pool's counters see every view's memory.
#[test]
fn cuda_async_default_pool_is_shared_and_left_alone() {
    for device in devices() {
        let what = label(&device);
        let s = device.create_stream().unwrap();
        let a = CudaAsyncResource::default_pool(&device).unwrap();
        let b = CudaAsyncResource::default_pool(&device).unwrap();
        let own = CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap();
        assert!(a.shares_pool_with(&b), "{what}");
        assert!(!a.shares_pool_with(&own), "{what}");
        assert_eq!(a.maximum_bytes(), device.total_memory(), "{what}");
        let x = a.allocate(2 * MIB, &s).unwrap();
        assert!(
            b.used_bytes().unwrap() >= 2 * MIB,
            "{what}: b does not see a's memory"
        );
        // SAFETY: `x` is live until freed below; used on `s` only.
        unsafe { s.fill_u32(x, 7, 2 * MIB / 4) }.unwrap();
        assert_eq!(read_u32(&s, x, 4), vec![7; 4], "{what}");
        free_async_mr(&a, x, 2 * MIB, &s);
        drop(a);
        // The pool is still there for b, and for a new view.
        let y = b.allocate(MIB, &s).unwrap();
        let c = CudaAsyncResource::default_pool(&device).unwrap();
        assert!(c.shares_pool_with(&b), "{what}");
        let z = c.allocate(MIB, &s).unwrap();
        free_async_mr(&b, y, MIB, &s);
        free_async_mr(&c, z, MIB, &s);
        s.synchronize_blocking().unwrap();
        assert_eq!(b.allocated_bytes() + c.allocated_bytes(), 0, "{what}");
    }
}

/// A resource over a pool someone else made (here another resource's, by its raw handle):
/// CUDA only. It shares the pool and leaves it alone when dropped. On the simulated device a
/// raw handle is refused with a typed error.
#[test]
fn cuda_async_view_of_an_existing_pool() {
    for device in devices() {
        let what = label(&device);
        let owner = CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap();
        let Some(raw) = owner.raw_pool() else {
            assert!(device.is_simulated(), "{what}: no raw pool on a GPU");
            // SAFETY: a null handle, which must be refused without being used.
            let refused = unsafe { CudaAsyncResource::view(&device, std::ptr::null_mut()) };
            assert!(
                matches!(refused, Err(Error::InvalidArgument { .. })),
                "{what}: {refused:?}"
            );
            continue;
        };
        let s = device.create_stream().unwrap();
        // SAFETY: `raw` is `owner`'s pool, of this device, and `owner` outlives the view and
        // everything allocated through it.
        let view = unsafe { CudaAsyncResource::view(&device, raw) }.unwrap();
        assert!(view.shares_pool_with(&owner), "{what}");
        let x = view.allocate(MIB, &s).unwrap();
        assert!(owner.used_bytes().unwrap() >= MIB, "{what}");
        free_async_mr(&view, x, MIB, &s);
        s.synchronize_blocking().unwrap();
        drop(view);
        let y = owner.allocate(MIB, &s).unwrap();
        free_async_mr(&owner, y, MIB, &s);
        s.synchronize_blocking().unwrap();
        // SAFETY: a null handle, which must be refused without being used.
        let refused = unsafe { CudaAsyncResource::view(&device, std::ptr::null_mut()) };
        assert!(
            matches!(refused, Err(Error::InvalidArgument { .. })),
            "{what}"
        );
    }
}
