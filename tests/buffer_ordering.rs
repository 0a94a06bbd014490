//! Issue 19's buffer findings: frees ordered after every stream that used the memory, and the
//! staging blocks of host copies, on the error paths too (simulated device, fault injection).

mod common;

use std::future::Future;
use std::sync::Arc;
use std::task::Context;
use std::time::Duration;

use common::{eventually, runtime};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{Device, DeviceVec, Error, FaultKind, Faults, SimConfig};

const MIB: usize = 1 << 20;

fn sim() -> (Device, Faults) {
    let faults = Faults::new();
    let device = Device::simulated(SimConfig {
        faults: faults.clone(),
        ..SimConfig::default()
    });
    (device, faults)
}

/// A pool that starts empty, so that each allocation grows a chunk that `trim` can give back.
fn pool(device: &Device) -> Arc<PoolResource<CudaResource>> {
    Arc::new(
        PoolResource::new(
            CudaResource::new(device),
            PoolOptions {
                initial: 0,
                maximum: Some(64 * MIB),
            },
        )
        .unwrap(),
    )
}

fn all_back(p: &PoolResource<CudaResource>) -> bool {
    let s = p.stats();
    s.free == s.reserved
}

/// Polls `fut` once, then drops it.
fn poll_once_and_drop<F: Future>(fut: F) {
    let mut fut = std::pin::pin!(fut);
    let waker = futures::task::noop_waker();
    let _ = fut.as_mut().poll(&mut Context::from_waker(&waker));
}

/// Issue 19, finding 1: `DeviceVec::to_host(&self, b)` queues a copy on `b`; the vector's free
/// (on its own stream) must wait for it even when the future is dropped before the copy ran.
/// Before the fix the free went back to the pool at once, `trim` returned the chunk upstream,
/// and `b`'s copy read freed memory (`InvalidAddress` from `b`).
#[test]
fn a_dropped_copy_on_another_stream_holds_the_free() {
    let (device, _) = sim();
    let p = pool(&device);
    let a = device.create_stream().unwrap();
    let b = device.create_stream().unwrap();
    let v = DeviceVec::from_host(&p, &vec![5u32; 1 << 16], &a).unwrap(); // 256 KiB
    b.spin(Duration::from_millis(300)).unwrap();
    poll_once_and_drop(v.to_host(&b));
    drop(v);
    p.trim_blocking().unwrap();
    b.synchronize_blocking()
        .expect("b's copy ran on memory that was freed under it");
    a.synchronize_blocking().unwrap();
    assert!(
        eventually(Duration::from_secs(10), || all_back(&p)),
        "{:?}",
        p.stats()
    );
    p.trim_blocking().unwrap();
    assert_eq!(p.stats().reserved, 0, "{:?}", p.stats());
}

/// The same with a future that failed after its copy was queued (the event after the copy could
/// not be recorded): the copy still runs, so the free must still wait for it.
#[test]
fn a_failed_copy_on_another_stream_holds_the_free() {
    let (device, faults) = sim();
    let rt = runtime();
    let p = pool(&device);
    let a = device.create_stream().unwrap();
    let b = device.create_stream().unwrap();
    let v = DeviceVec::from_host(&p, &vec![5u32; 1 << 16], &a).unwrap();
    b.spin(Duration::from_millis(300)).unwrap();
    // Record #1 orders `b` after `a`; #2 is the event after the copy on `b`.
    faults.fail_nth(FaultKind::Record, 2);
    let err = rt.block_on(v.to_host(&b)).unwrap_err();
    assert!(matches!(err, Error::Driver { .. }), "{err:?}");
    assert_eq!(faults.injected(FaultKind::Record), 1);
    drop(v);
    p.trim_blocking().unwrap();
    b.synchronize_blocking()
        .expect("b's copy ran on memory that was freed under it");
    assert!(
        eventually(Duration::from_secs(10), || all_back(&p)),
        "{:?}",
        p.stats()
    );
}

/// And with a future that completed: nothing is pending, the free is immediate and the memory
/// comes back.
#[test]
fn a_completed_copy_on_another_stream_frees_normally() {
    let (device, _) = sim();
    let rt = runtime();
    let p = pool(&device);
    let a = device.create_stream().unwrap();
    let b = device.create_stream().unwrap();
    let v = DeviceVec::from_host(&p, &[1u16, 2, 3], &a).unwrap();
    assert_eq!(rt.block_on(v.to_host(&b)).unwrap(), [1, 2, 3]);
    drop(v);
    a.synchronize_blocking().unwrap();
    b.synchronize_blocking().unwrap();
    assert!(
        eventually(Duration::from_secs(10), || all_back(&p)),
        "{:?}",
        p.stats()
    );
}
