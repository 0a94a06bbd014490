//! The race detector's host clock: only what the user's code observes (an awaited, queried or
//! synchronized event, a stream's synchronize or idle answer) orders later work on every stream.
//! The crate's own checks (the staging block's `on_complete`, the completion reactor's polls, a
//! pool's idle probe) must not: each test is a stream-order bug that a review found unreported
//! once the crate had internally seen the writer's work finish. Simulated device only.

use std::sync::Arc;
use std::time::Duration;

use streamalloc::resource::cuda::CudaResource;
use streamalloc::{
    Device, DeviceVec, MemoryAccess, RaceDetection, RaceKind, SimConfig, SimExecution,
};

fn device(execution: SimExecution) -> Device {
    Device::simulated(SimConfig {
        execution,
        race_detection: RaceDetection::Record,
        ..SimConfig::default()
    })
}

// ===== the crate's own completion observations order the user's streams =====

/// The canonical user bug: upload on `a`, consume on `b` with no wait. Inline (what loom models
/// of users' code run on): `from_host`'s staging block is returned through `Event::on_complete`,
/// which queries the (already complete) event, which joins `a`'s clock into the host clock,
/// which is joined into every stream's next operation: `b`'s read counts as ordered after
/// `a`'s copy, though nothing in the user's code orders it. The same bug with a raw
/// `copy_htod` (no staging, no query) is caught, so the verdict depends on the crate's
/// internal bookkeeping, not on stream order.
#[test]
fn inline_upload_then_unordered_read_on_another_stream_is_caught() {
    // Control: the raw copy, nothing queried: caught.
    {
        let device = device(SimExecution::Inline);
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let ptr = device.malloc(4096).unwrap();
        let data = vec![5u8; 4096];
        // SAFETY: 4096 live bytes; inline, the copy has run when the call returns.
        unsafe { a.copy_htod(ptr, data.as_ptr(), 4096) }.unwrap();
        b.declare_access(ptr, 4096, MemoryAccess::Read, "consumer")
            .unwrap();
        let races = device.take_races();
        assert!(
            races.iter().any(|r| r.kind == RaceKind::ReadAfterWrite),
            "control (raw copy_htod) missed: {races:?}"
        );
        a.synchronize_blocking().unwrap();
        b.synchronize_blocking().unwrap();
        // SAFETY: from malloc, both streams synchronized.
        unsafe { device.free(ptr) }.unwrap();
    }
    // The same bug through the safe upload.
    let device = device(SimExecution::Inline);
    let res = Arc::new(CudaResource::new(&device));
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let v = DeviceVec::<u32>::from_host(&res, &[5; 1024], &a).unwrap();
    // `b` never waits for `a`: on a GPU the upload may still be running.
    b.declare_access(v.as_ptr(), 4096, MemoryAccess::Read, "consumer")
        .unwrap();
    let races = device.take_races();
    b.synchronize_blocking().unwrap();
    drop(v);
    a.synchronize_blocking().unwrap();
    assert!(
        races.iter().any(|r| r.kind == RaceKind::ReadAfterWrite),
        "from_host on a, read on b with no wait: missed ({races:?})"
    );
}

/// The same with worker threads: once the completion reactor has seen the staging event of
/// `copy_from_host` complete (here, 200 ms later; the host thread never looked at it), every
/// stream counts as ordered after `a`'s write.
#[test]
fn threaded_upload_then_unordered_read_on_another_stream_is_caught() {
    // Control: a raw copy, the same pause, nobody queries an event: caught.
    {
        let device = device(SimExecution::Threads);
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let ptr = device.malloc(4096).unwrap();
        let data = vec![5u8; 4096];
        // SAFETY: 4096 live bytes; `data` outlives the synchronize below.
        unsafe { a.copy_htod(ptr, data.as_ptr(), 4096) }.unwrap();
        std::thread::sleep(Duration::from_millis(200));
        b.declare_access(ptr, 4096, MemoryAccess::Read, "consumer")
            .unwrap();
        let races = device.take_races();
        a.synchronize_blocking().unwrap();
        b.synchronize_blocking().unwrap();
        // SAFETY: from malloc, both streams synchronized.
        unsafe { device.free(ptr) }.unwrap();
        assert!(
            races.iter().any(|r| r.kind == RaceKind::ReadAfterWrite),
            "control (raw copy_htod) missed: {races:?}"
        );
    }
    let device = device(SimExecution::Threads);
    let res = Arc::new(CudaResource::new(&device));
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let v = DeviceVec::<u32>::from_host(&res, &[5; 1024], &a).unwrap();
    std::thread::sleep(Duration::from_millis(200)); // the host does other work
    b.declare_access(v.as_ptr(), 4096, MemoryAccess::Read, "consumer")
        .unwrap();
    let races = device.take_races();
    b.synchronize_blocking().unwrap();
    drop(v);
    a.synchronize_blocking().unwrap();
    assert!(
        races.iter().any(|r| r.kind == RaceKind::ReadAfterWrite),
        "copy_from_host on a, read on b with no wait: missed ({races:?})"
    );
}

/// The same root cause through a pool's opportunistic reuse (inline, deterministic): the pool
/// asks whether `a` is idle before handing `b` a block `a` freed, and the idle answer joins all
/// of `a`'s clock into the host's, so the user's own unrelated buffer `x`, written on `a`, counts
/// as ordered before everything `b` does from then on.
#[test]
fn a_pools_idle_probe_does_not_order_unrelated_memory() {
    use streamalloc::{DeviceBuffer, PoolOptions, PoolResource};
    let device = device(SimExecution::Inline);
    let pool = Arc::new(
        PoolResource::new(
            CudaResource::new(&device),
            PoolOptions {
                initial: 0,
                maximum: Some(4 << 20),
                ..PoolOptions::default()
            },
        )
        .unwrap(),
    );
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let x = device.malloc(4096).unwrap();
    // SAFETY: 4096 live bytes.
    unsafe { a.memset_d8(x, 1, 4096) }.unwrap(); // the user's write of `x` on `a`
    drop(DeviceBuffer::new(&pool, 4096, &a).unwrap());
    let stolen = DeviceBuffer::new(&pool, 4096, &b).unwrap(); // the pool's business
    println!("{:?}", pool.stats());
    // The user's bug: `b` reads `x` with no wait for `a`.
    b.declare_access(x, 4096, MemoryAccess::Read, "consumer")
        .unwrap();
    let races = device.take_races();
    drop(stolen);
    a.synchronize_blocking().unwrap();
    b.synchronize_blocking().unwrap();
    // SAFETY: from malloc, both streams synchronized.
    unsafe { device.free(x) }.unwrap();
    assert!(
        races.iter().any(|r| r.kind == RaceKind::ReadAfterWrite),
        "x written on a, read on b with no wait: missed ({races:?})"
    );
}

/// The same root cause through a driver pool (`cuMemAllocFromPoolAsync`), which hands a block
/// to another stream once its free has run: that orders the block's reuse, not the allocating
/// stream's other work. It once joined the freeing stream's whole clock into the allocating
/// one, hiding this read of unrelated memory.
#[test]
fn a_driver_pools_reuse_does_not_order_unrelated_memory() {
    use streamalloc::resource::cuda_async::{CudaAsyncOptions, CudaAsyncResource};
    use streamalloc::MemoryResource;
    let device = device(SimExecution::Inline);
    let pool = CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap();
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let x = device.malloc(4096).unwrap();
    // SAFETY: 4096 live bytes.
    unsafe { a.memset_d8(x, 1, 4096) }.unwrap(); // the user's write of `x` on `a`
    let first = pool.allocate(4096, &a).unwrap();
    // SAFETY: unused, freed once.
    unsafe { pool.deallocate(first, 4096, &a) }.unwrap();
    let again = pool.allocate(4096, &b).unwrap(); // inline, the free has run: reused
    assert_eq!(again, first, "the driver pool did not reuse the block");
    // Its reuse is clean: `b` may use the block.
    // SAFETY: 4096 live bytes.
    unsafe { b.memset_d8(again, 2, 4096) }.unwrap();
    assert_eq!(device.races(), Vec::new());
    // The user's bug: `b` reads `x` with no wait for `a`.
    b.declare_access(x, 4096, MemoryAccess::Read, "consumer")
        .unwrap();
    let races = device.take_races();
    // SAFETY: freed once, after its last use on `b`.
    unsafe { pool.deallocate(again, 4096, &b) }.unwrap();
    a.synchronize_blocking().unwrap();
    b.synchronize_blocking().unwrap();
    // SAFETY: from malloc, both streams synchronized.
    unsafe { device.free(x) }.unwrap();
    assert!(
        races.iter().any(|r| r.kind == RaceKind::ReadAfterWrite),
        "x written on a, read on b with no wait: missed ({races:?})"
    );
}

// ===== what the user's code observes still orders everything queued after it =====

/// How the user's code sees `a`'s write of `x` complete, before it reads `x` on `b`.
#[derive(Clone, Copy, Debug)]
enum Observation {
    Await,
    Query,
    IsComplete,
    SynchronizeEvent,
    StreamIsIdle,
    StreamSynchronize,
    StreamSynchronizeBlocking,
}

/// Each of the user's observations of `a`'s write orders `b`'s later read (no false race),
/// inline and with worker threads; the crate's own look first (a staging block's callback)
/// does not stand in for it, and does not make the user's look count twice or not at all.
#[test]
fn the_users_observations_order_later_work_on_every_stream() {
    use Observation::*;
    for execution in [SimExecution::Inline, SimExecution::Threads] {
        for how in [
            Await,
            Query,
            IsComplete,
            SynchronizeEvent,
            StreamIsIdle,
            StreamSynchronize,
            StreamSynchronizeBlocking,
        ] {
            let device = device(execution);
            let res = Arc::new(CudaResource::new(&device));
            let (a, b) = (
                device.create_stream().unwrap(),
                device.create_stream().unwrap(),
            );
            // `from_host` returns its staging block through `on_complete`: the crate looks at
            // the event before the user does.
            let v = DeviceVec::<u32>::from_host(&res, &[5; 1024], &a).unwrap();
            let event = a.record().unwrap();
            match how {
                Await => futures::executor::block_on(event.clone()).unwrap(),
                Query => {
                    while event.query().is_none() {
                        std::thread::yield_now();
                    }
                }
                IsComplete => {
                    while !event.is_complete() {
                        std::thread::yield_now();
                    }
                }
                SynchronizeEvent => event.synchronize_blocking().unwrap(),
                StreamIsIdle => {
                    while !a.is_idle().unwrap() {
                        std::thread::yield_now();
                    }
                }
                StreamSynchronize => futures::executor::block_on(a.synchronize()).unwrap(),
                StreamSynchronizeBlocking => a.synchronize_blocking().unwrap(),
            }
            b.declare_access(v.as_ptr(), 4096, MemoryAccess::Read, "consumer")
                .unwrap();
            b.synchronize_blocking().unwrap();
            drop(v);
            a.synchronize_blocking().unwrap();
            assert_eq!(device.races(), Vec::new(), "{execution:?}, {how:?}");
        }
    }
}

/// A buffer used on two streams and dropped: the crate frees it once the events recorded on
/// both have completed, which only the crate saw (its callback): the free is clean, and the
/// user's unordered read of other memory on the freeing stream is still caught after it.
#[test]
fn a_deferred_free_is_clean_and_orders_nothing_else() {
    use streamalloc::DeviceBuffer;
    for execution in [SimExecution::Inline, SimExecution::Threads] {
        let device = device(execution);
        let res = Arc::new(CudaResource::new(&device));
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let x = device.malloc(4096).unwrap();
        // SAFETY: 4096 live bytes.
        unsafe { a.memset_d8(x, 1, 4096) }.unwrap(); // the user's write of `x` on `a`
        let mut y = DeviceBuffer::new(&res, 4096, &b).unwrap();
        b.wait(&a.record().unwrap()).unwrap();
        y.memset(2).unwrap();
        y.record_stream(&a).unwrap();
        a.wait(&b.record().unwrap()).unwrap();
        a.declare_access(y.as_ptr(), 4096, MemoryAccess::Read, "reader")
            .unwrap();
        drop(y); // freed on `b` once the events on `a` and `b` complete
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            device.take_races(),
            Vec::new(),
            "{execution:?}: the deferred free"
        );
        let c = device.create_stream().unwrap();
        c.declare_access(x, 4096, MemoryAccess::Read, "consumer")
            .unwrap();
        let races = device.take_races();
        for s in [&a, &b, &c] {
            s.synchronize_blocking().unwrap();
        }
        // SAFETY: from malloc, every stream synchronized.
        unsafe { device.free(x) }.unwrap();
        assert!(
            races.iter().any(|r| r.kind == RaceKind::ReadAfterWrite),
            "{execution:?}: x written on a, read on c with no wait: missed ({races:?})"
        );
    }
}
