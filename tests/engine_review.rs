//! A review of the stream-ordered engine (`src/resource/stream_ordered/`) and the pool over it:
//! each test here failed before the fix its comment names. Simulated device only: the race
//! detector is the simulated device's, and the faults are injected there.

mod common;

use std::time::Duration;

use common::{free, poll_once};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{
    Device, FaultKind, Faults, MemoryResource, RaceDetection, SimConfig, SimExecution,
};

const MIB: usize = 1 << 20;

fn device() -> (Device, Faults) {
    let faults = Faults::new();
    let device = Device::simulated(SimConfig {
        race_detection: RaceDetection::Record,
        faults: faults.clone(),
        ..SimConfig::default()
    });
    (device, faults)
}

/// A trim forgets a stream the user dropped once it has synchronized it. But the engine can
/// queue work on such a stream after that synchronization: memory taken out for release is
/// ordered onto one stream its tag names (the others' events waited on by it), and a release
/// that fails puts the memory back as freed on that stream. Forgetting the stream then cleared
/// the tag, and the memory went back upstream (or to another stream) with no ordering after
/// the other streams' work, which was still running.
#[test]
fn a_stream_ordered_onto_after_its_trim_synchronized_it_is_not_forgotten() {
    let (device, faults) = device();
    let pool = PoolResource::new(
        CudaResource::new(&device),
        PoolOptions {
            initial: 0,
            maximum: Some(4 * MIB),
            small_block_cache: 0,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let d = device.create_stream().unwrap();
    let e = device.create_stream().unwrap();
    let s = device.create_stream().unwrap();
    // One chunk of 2 MiB: half freed on `d` (unused), half used and freed on `e`, whose work
    // (a long spin, then a write into it) is still running when the pool gives the chunk back.
    let x = pool.allocate(MIB, &d).unwrap();
    let y = pool.allocate(MIB, &e).unwrap();
    assert_eq!(pool.stats().chunks, 1, "{:?}", pool.stats());
    e.spin(Duration::from_millis(1500)).unwrap();
    // SAFETY: `y` is 1 MiB handed out on `e`, freed below on `e` after this write.
    unsafe { e.memset_d8(y, 7, MIB) }.unwrap();
    d.spin(Duration::from_millis(100)).unwrap();
    free(&pool, x, MIB, &d);
    free(&pool, y, MIB, &e);
    // The user is done with `d`: a trim waits for it, then forgets it.
    drop(d);
    let mut trim = std::pin::pin!(pool.trim());
    assert!(
        poll_once(trim.as_mut()).is_pending(),
        "the trim waits for `d`"
    );
    // Meanwhile a request at the maximum gives the wholly free chunk back to grow one large
    // enough: the chunk is ordered onto `d` (which now waits for `e`'s write), and its release
    // fails, so it goes back as freed on `d`.
    faults.fail_next(FaultKind::Free);
    assert!(pool.allocate(3 * MIB, &s).is_err());
    assert_eq!(faults.injected(FaultKind::Free), 1);
    assert_eq!(pool.stats().free, 2 * MIB, "{:?}", pool.stats());
    // The trim's wait for `d` (recorded before `d` was made to wait for `e`) ends; what it gives
    // back must still wait for `e`'s write.
    let released = common::runtime().block_on(trim).unwrap();
    assert_eq!(released, 2 * MIB);
    // Without the fix the chunk went back upstream before `e`'s write: the simulated device
    // reports the write to freed memory when `e` reaches it.
    let after = e.synchronize_blocking();
    let races = device.take_races();
    assert!(races.is_empty(), "{races:#?}");
    after.unwrap();
    s.synchronize_blocking().unwrap();
}

/// The peak in use is summed over the pool's shards (each counts its own under its lock). A
/// pool at its maximum gives a chunk of one thread's shard back and grows one in another's, so
/// the shards' peaks can add up to more than the pool ever held: here 5 MiB in use at the peak
/// of a pool whose maximum is 4 MiB.
#[test]
fn the_peak_in_use_never_passes_what_the_pool_held() {
    let (device, _) = device();
    let pool = std::sync::Arc::new(
        PoolResource::new(
            CudaResource::new(&device),
            PoolOptions {
                initial: 0,
                maximum: Some(4 * MIB),
                ..PoolOptions::default()
            },
        )
        .unwrap(),
    );
    // Each request on a thread of its own: threads start in different shards.
    for bytes in [2 * MIB, 3 * MIB] {
        let (pool, device) = (pool.clone(), device.clone());
        std::thread::spawn(move || {
            let s = device.create_stream().unwrap();
            let p = pool.allocate(bytes, &s).unwrap();
            free(&*pool, p, bytes, &s);
            s.synchronize_blocking().unwrap();
        })
        .join()
        .unwrap();
    }
    let stats = pool.stats();
    assert!(
        stats.peak_in_use <= stats.peak_reserved && stats.peak_reserved <= 4 * MIB,
        "{stats:?}"
    );
    assert!(stats.peak_in_use >= 3 * MIB, "{stats:?}");
}

/// Below its maximum the pool grows from an upstream that can run out first (a device shared
/// with other users, a smaller upstream). Its wholly free chunks then went nowhere: a request
/// larger than each of them failed (and an `allocate_async` waited for a free that might never
/// come) with enough memory free in the pool, where at the maximum the same chunks go back
/// upstream to grow one large enough. The device runs each operation as it is queued: the
/// chunks' frees, which the simulated device queues on their streams, have run when the pool
/// tries again, as CUDA's `cuMemFree` (which `CudaResource` calls after synchronizing the
/// stream) has returned the memory when it returns.
#[test]
fn a_request_the_upstream_refuses_gets_the_pools_free_chunks() {
    let device = Device::simulated(SimConfig {
        total_memory: 8 * MIB,
        execution: SimExecution::Inline,
        ..SimConfig::default()
    });
    let pool = PoolResource::new(
        CudaResource::new(&device),
        PoolOptions {
            initial: 0,
            maximum: None,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let s = device.create_stream().unwrap();
    // Two chunks of 2 MiB, both free.
    let x = pool.allocate(2 * MIB, &s).unwrap();
    let y = pool.allocate(2 * MIB, &s).unwrap();
    assert_eq!(pool.stats().chunks, 2, "{:?}", pool.stats());
    free(&pool, x, 2 * MIB, &s);
    free(&pool, y, 2 * MIB, &s);
    // Another user of the device takes the rest of its memory.
    let other = CudaResource::new(&device);
    let theirs = other.allocate(4 * MIB, &s).unwrap();
    // 3 MiB: no free block holds it, and the device has no room to grow, but the pool holds
    // 4 MiB free in whole chunks.
    let p = pool
        .allocate(3 * MIB, &s)
        .unwrap_or_else(|e| panic!("{e}: {:?}", pool.stats()));
    free(&pool, p, 3 * MIB, &s);
    common::check_pool(&pool);
    free(&other, theirs, 4 * MIB, &s);
}
