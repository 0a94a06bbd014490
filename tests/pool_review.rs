//! The pool's findings of the review (issue 19) and of RMM's tests (issue 20), each a test that
//! failed before its fix: a trim racing a grow, a request that fits but grew the pool, a request
//! for the whole pool refused at its maximum, streams kept alive by their lists, and the error
//! paths of steals, trims and releases under injected driver faults.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{devices, label};
use streamalloc::resource::callback::CallbackResource;
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{Device, DevicePtr, Error, FaultKind, Faults, MemoryResource, SimConfig, Stream};

const MIB: usize = 1 << 20;

fn pool(device: &Device, initial: usize, maximum: usize) -> PoolResource<CudaResource> {
    PoolResource::new(
        CudaResource::new(device),
        PoolOptions {
            initial,
            maximum: Some(maximum),
            ..PoolOptions::default()
        },
    )
    .unwrap()
}

fn free(pool: &impl MemoryResource, ptr: DevicePtr, bytes: usize, stream: &Stream) {
    // SAFETY: every test frees what it allocated from `pool`, once; nothing used the memory.
    unsafe { pool.deallocate(ptr, bytes, stream) }.unwrap();
}

fn check<U: MemoryResource>(pool: &PoolResource<U>) {
    pool.check_invariants()
        .unwrap_or_else(|e| panic!("pool invariants: {e}"));
}

/// Issue 19, finding 5: 2 contiguous MiB were free (1 MiB freed on `s` beside 1 MiB fresh), yet
/// the pool grew.
#[test]
fn a_request_that_fits_does_not_grow_the_pool() {
    for device in devices() {
        let pool = pool(&device, 2 * MIB, 64 * MIB);
        let s = device.create_stream().unwrap();
        let a = pool.allocate(MIB, &s).unwrap();
        free(&pool, a, MIB, &s);
        let b = pool.allocate(2 * MIB, &s).unwrap();
        let stats = pool.stats();
        assert_eq!(stats.grows, 0, "{}: {stats:?}", label(&device));
        assert_eq!(stats.reserved, 2 * MIB, "{}: {stats:?}", label(&device));
        free(&pool, b, 2 * MIB, &s);
        check(&pool);
    }
}

/// Issue 20, finding 1 (the shape of RMM issue 2039): a pool at its maximum, every block free
/// but spread over two streams' lists, must serve a request for all of it at once.
#[test]
fn the_whole_pool_is_served_when_free_blocks_are_spread_over_streams() {
    for device in devices() {
        let pool = pool(&device, 0, 8 * MIB);
        let (a, b, c) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let blocks: Vec<DevicePtr> = (0..16)
            .map(|_| pool.allocate(MIB / 2, &a).unwrap())
            .collect();
        assert_eq!(pool.stats().reserved, 8 * MIB, "{}", label(&device));
        b.wait(&a.record().unwrap()).unwrap();
        for (i, p) in blocks.into_iter().enumerate() {
            free(&pool, p, MIB / 2, if i % 2 == 0 { &a } else { &b });
        }
        a.synchronize_blocking().unwrap();
        b.synchronize_blocking().unwrap();
        let all = pool
            .allocate(8 * MIB, &c)
            .unwrap_or_else(|e| panic!("{}: {e} ({:?})", label(&device), pool.stats()));
        check(&pool);
        free(&pool, all, 8 * MIB, &c);
        c.synchronize_blocking().unwrap();
    }
}

/// Issue 20, finding 2: a stream per task, dropped after use, must not stay alive in the pool.
#[test]
fn dropped_streams_are_released_by_trim() {
    for device in devices() {
        let pool = pool(&device, 4 * MIB, 64 * MIB);
        let before = device.handle_count();
        for _ in 0..100 {
            let s = device.create_stream().unwrap();
            let p = pool.allocate(MIB, &s).unwrap();
            free(&pool, p, MIB, &s);
            s.synchronize_blocking().unwrap();
        }
        pool.trim_blocking().unwrap();
        let stats = pool.stats();
        assert_eq!(stats.streams, 0, "{}: {stats:?}", label(&device));
        assert_eq!(
            device.handle_count(),
            before,
            "{}: the pool keeps stream handles",
            label(&device)
        );
        assert_eq!(stats.in_use, 0, "{}: {stats:?}", label(&device));
        check(&pool);
        // The folded memory serves any stream again.
        let s = device.create_stream().unwrap();
        let p = pool.allocate(4 * MIB, &s).unwrap();
        free(&pool, p, 4 * MIB, &s);
    }
}

/// An upstream of fake addresses that reuses a freed address at once (as `cuMemAlloc` may) and
/// then takes 200 ms to return from its deallocate.
fn slow_reusing_upstream(device: &Device) -> CallbackResource {
    /// The next fresh base, and the bases given back.
    type Ranges = Arc<Mutex<(u64, Vec<u64>)>>;
    let ranges: Ranges = Arc::new(Mutex::new((1 << 40, Vec::new())));
    let (ra, rd) = (ranges.clone(), ranges);
    CallbackResource::new(
        device,
        move |bytes, _| {
            let mut r = ra.lock().unwrap();
            // Bases 1 GiB apart, so a freed base can be handed out again for any size.
            assert!(bytes <= 1 << 30);
            if let Some(base) = r.1.pop() {
                return Ok(DevicePtr(base));
            }
            let base = r.0;
            r.0 += 1 << 30;
            Ok(DevicePtr(base))
        },
        move |ptr, _, _| {
            rd.lock().unwrap().1.push(ptr.0);
            std::thread::sleep(Duration::from_millis(200));
            Ok(())
        },
    )
}

/// Issue 19, finding 2: the trim unregistered its chunk only after the upstream returned, by
/// when a concurrent grow had registered the same (reused) address: the live chunk was deleted.
#[test]
fn a_trim_racing_a_grow_keeps_the_new_chunk() {
    let device = Device::simulated(SimConfig::default());
    let pool = PoolResource::new(
        slow_reusing_upstream(&device),
        PoolOptions {
            initial: MIB,
            maximum: Some(64 * MIB),
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let s = device.create_stream().unwrap();
    let block = std::thread::scope(|scope| {
        let trim = scope.spawn(|| pool.trim_blocking());
        std::thread::sleep(Duration::from_millis(50)); // inside the upstream's deallocate
        let block = pool.allocate(MIB, &s).unwrap();
        assert_eq!(trim.join().unwrap().unwrap(), MIB);
        block
    });
    let stats = pool.stats();
    assert_eq!(stats.chunks, 1, "{stats:?}");
    assert_eq!(stats.free + stats.in_use, stats.reserved, "{stats:?}");
    free(&pool, block, MIB, &s);
    check(&pool);
}

fn faulty() -> (Device, Faults) {
    let faults = Faults::new();
    let device = Device::simulated(SimConfig {
        faults: faults.clone(),
        ..SimConfig::default()
    });
    (device, faults)
}

/// A steal whose ordering fails returns the error and loses nothing; the next try steals.
#[test]
fn a_failed_steal_loses_nothing() {
    let (device, faults) = faulty();
    let pool = pool(&device, MIB, 64 * MIB);
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let p = pool.allocate(MIB, &a).unwrap();
    free(&pool, p, MIB, &a);
    faults.fail_next(FaultKind::Record);
    let err = pool.allocate(MIB, &b).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Driver {
                call: "cuEventRecord",
                ..
            }
        ),
        "{err}"
    );
    let stats = pool.stats();
    assert_eq!(
        (stats.free, stats.in_use, stats.grows),
        (MIB, 0, 0),
        "{stats:?}"
    );
    check(&pool);
    let p = pool.allocate(MIB, &b).unwrap();
    assert_eq!(pool.stats().steals, 1);
    free(&pool, p, MIB, &b);
}

/// Issue 19: a failed synchronization in `trim` stranded the chunks it had taken out.
#[test]
fn a_failed_trim_puts_its_chunks_back() {
    let (device, faults) = faulty();
    let pool = pool(&device, 0, 64 * MIB);
    let a = device.create_stream().unwrap();
    let p = pool.allocate(2 * MIB, &a).unwrap();
    free(&pool, p, 2 * MIB, &a);
    faults.fail_next(FaultKind::Synchronize);
    let err = pool.trim_blocking().unwrap_err();
    assert!(
        matches!(
            err,
            Error::Driver {
                call: "cuStreamSynchronize",
                ..
            }
        ),
        "{err}"
    );
    let stats = pool.stats();
    assert_eq!(
        (stats.free, stats.reserved),
        (2 * MIB, 2 * MIB),
        "{stats:?}"
    );
    check(&pool);
    assert_eq!(pool.trim_blocking().unwrap(), 2 * MIB);
    assert_eq!(pool.stats().reserved, 0);
}

/// Issue 19: at its maximum the pool returns free chunks to grow one large enough; when the
/// upstream's free fails, the chunk must stay with the stream it was freed on (reuse elsewhere
/// still ordered after that stream: a steal), not become fresh memory any stream takes at once.
#[test]
fn a_failed_release_at_the_maximum_keeps_stream_order() {
    let (device, faults) = faulty();
    let pool = pool(&device, 0, 4 * MIB);
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let x = pool.allocate(2 * MIB, &a).unwrap();
    let y = pool.allocate(2 * MIB, &a).unwrap();
    assert_eq!(pool.stats().chunks, 2);
    free(&pool, x, 2 * MIB, &a);
    free(&pool, y, 2 * MIB, &a);
    faults.fail_always(FaultKind::Free);
    let err = pool.allocate(4 * MIB, &a).unwrap_err();
    faults.clear();
    assert!(
        matches!(err, Error::OutOfMemory { .. } | Error::Driver { .. }),
        "{err}"
    );
    let stats = pool.stats();
    assert_eq!(
        (stats.free, stats.reserved),
        (4 * MIB, 4 * MIB),
        "{stats:?}"
    );
    check(&pool);
    let steals = stats.steals;
    let p = pool.allocate(2 * MIB, &b).unwrap();
    assert_eq!(pool.stats().steals, steals + 1, "{:?}", pool.stats());
    free(&pool, p, 2 * MIB, &b);
    // And once the faults stop, the whole request is served.
    b.synchronize_blocking().unwrap();
    let all = pool.allocate(4 * MIB, &a).unwrap();
    free(&pool, all, 4 * MIB, &a);
}

/// `PoolStats` counts bytes in use and their peak.
#[test]
fn stats_count_bytes_in_use() {
    for device in devices() {
        let pool = pool(&device, 8 * MIB, 64 * MIB);
        let s = device.create_stream().unwrap();
        let blocks: Vec<DevicePtr> = (0..6).map(|_| pool.allocate(MIB, &s).unwrap()).collect();
        assert_eq!(pool.stats().in_use, 6 * MIB, "{}", label(&device));
        for p in blocks {
            free(&pool, p, MIB, &s);
        }
        let stats = pool.stats();
        assert_eq!(stats.in_use, 0, "{}: {stats:?}", label(&device));
        assert_eq!(stats.peak_in_use, 6 * MIB, "{}: {stats:?}", label(&device));
    }
}
