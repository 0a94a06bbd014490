//! The simulated device with `SimExecution::Inline` (what loom models of users' code run on):
//! stream work runs on the queueing thread, events are complete when recorded, no thread is
//! started, and the race detector reports what it reports with worker threads.

mod common;

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::cuda_async::{CudaAsyncOptions, CudaAsyncResource};
use streamalloc::{
    Device, DeviceBuffer, Error, MemoryAccess, PoolOptions, PoolResource, RaceDetection, RaceKind,
    SimConfig, SimExecution,
};

fn inline(race_detection: RaceDetection) -> Device {
    Device::simulated(SimConfig {
        execution: SimExecution::Inline,
        race_detection,
        ..SimConfig::default()
    })
}

/// The names of this process's threads (Linux: `/proc/self/task/*/comm`).
#[cfg(target_os = "linux")]
fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .map(|name| name.trim().to_owned())
        .collect()
}

#[test]
fn events_are_complete_when_recorded_and_data_is_there() {
    let device = inline(RaceDetection::Panic);
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let mut buffer = DeviceBuffer::new(&Arc::new(CudaResource::new(&device)), 64, &a).unwrap();
    buffer.memset(7).unwrap();
    let written = a.record().unwrap();
    assert!(
        matches!(written.query(), Some(Ok(()))),
        "inline: done when recorded"
    );
    b.wait(&written).unwrap();
    // A blocking read on the other stream: nothing to wait for.
    let mut out = vec![0u8; 64];
    // SAFETY: 64 live bytes each; the copy has run when the call returns (inline).
    unsafe { b.copy_dtoh(out.as_mut_ptr(), buffer.as_ptr(), 64) }.unwrap();
    b.synchronize_blocking().unwrap();
    assert_eq!(out, vec![7u8; 64]);
    buffer.record_stream(&b).unwrap();
    drop(buffer);
    assert_eq!(device.races(), Vec::new());
}

#[cfg(target_os = "linux")]
#[test]
fn starts_no_thread() {
    let device = inline(RaceDetection::Panic);
    let pool = Arc::new(
        PoolResource::new(
            CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap(),
            PoolOptions::default(),
        )
        .unwrap(),
    );
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let mut buffer = DeviceBuffer::new(&pool, 1024, &a).unwrap();
    buffer.memset(1).unwrap();
    b.wait(&a.record().unwrap()).unwrap();
    buffer.record_stream(&b).unwrap();
    futures::executor::block_on(async {
        b.synchronize().await.unwrap();
        a.record().unwrap().await.unwrap();
    });
    drop(buffer);
    let ours = format!("sa-reactor-{}", device.id());
    let names = thread_names();
    assert!(
        !names.contains(&ours),
        "an inline device started its reactor: {names:?}"
    );
    for stream in [&a, &b] {
        let worker = format!("sa-sim-{}", stream.id().get());
        assert!(
            !names.contains(&worker),
            "an inline stream started a worker: {names:?}"
        );
    }
}

#[test]
fn races_are_reported_as_with_threads() {
    let kinds = |execution| {
        let device = Device::simulated(SimConfig {
            execution,
            race_detection: RaceDetection::Error,
            ..SimConfig::default()
        });
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let mut buffer = DeviceBuffer::new(&Arc::new(CudaResource::new(&device)), 256, &a).unwrap();
        buffer.memset(1).unwrap();
        // `b` did not wait for `a`'s memset: a read there is not ordered after the write.
        let err = b
            .declare_access(buffer.as_ptr(), 256, MemoryAccess::Read, "reader")
            .unwrap_err();
        assert!(matches!(err, Error::StreamRace { .. }), "{err}");
        // Nor is the free on `a` ordered after a use on `b` (none was queued: not a race).
        drop(buffer);
        b.synchronize_blocking().unwrap();
        device
            .races()
            .iter()
            .map(|race| race.kind)
            .collect::<Vec<_>>()
    };
    let inline = kinds(SimExecution::Inline);
    assert_eq!(inline, vec![RaceKind::ReadAfterWrite]);
    assert_eq!(inline, kinds(SimExecution::Threads));
}

/// An allocation from a full pool waits, as a future, and is woken by a free on another
/// thread: the memory waiters work the same inline.
#[test]
fn an_allocation_waits_for_a_free() {
    let device = inline(RaceDetection::Panic);
    let pool = Arc::new(
        PoolResource::new(
            CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap(),
            PoolOptions {
                maximum: Some(256),
                ..PoolOptions::default()
            },
        )
        .unwrap(),
    );
    let a = device.create_stream().unwrap();
    let first = DeviceBuffer::new(&pool, 256, &a).unwrap();
    let mut next = pin!(DeviceBuffer::alloc(&pool, 256, &a));
    let waker = futures::task::noop_waker();
    assert!(next
        .as_mut()
        .poll(&mut Context::from_waker(&waker))
        .is_pending());
    let freeing = std::thread::spawn(move || drop(first));
    freeing.join().unwrap();
    let Poll::Ready(got) = next.as_mut().poll(&mut Context::from_waker(&waker)) else {
        panic!("the free did not serve the waiting allocation");
    };
    drop(got.unwrap());
    assert_eq!(pool.wait_stats().waits, 1);
    assert_eq!(device.races(), Vec::new());
}
