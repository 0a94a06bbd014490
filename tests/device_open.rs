//! Opening CUDA devices while other threads work on the same GPU (tenth session). GPU only.
//!
//! `Device::cuda` made a new handle of the primary context for each device and loaded the
//! crate's kernels into it: loading a module waits for all the work queued in the context, and
//! cudarc synchronizes the context (`cuCtxSynchronize`) on a handle's first stream. Every open
//! waited for all the process's GPU work, and on an H100 that `cuCtxSynchronize` crashed
//! inside the driver twice in about 190 runs of `base_resources`, whose test threads open
//! devices while others work. The devices of a GPU now share one handle, its kernels and its
//! first stream (`src/device/cuda/opened.rs`), made without cudarc's synchronization. The first
//! test fails with a handle and a module per open (run95's planted build). The second did not
//! reproduce the crash before the change (0 of 54 runs of a heavier version): it checks that
//! opens and drops on many threads, beside work, keep working.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

// The two tests take turns (`common::take_turns`). The second one's `cuMemFree`s wait for the
// device to be idle, and while one waits, the driver holds up other threads' launches, records
// and stream creations on that GPU (run103: 950 ms of a 1 s kernel). Beside it the first
// test's `record` returned only once its 3 s kernel was done, and the event read complete (16
// of 40 runs in run101).

use streamalloc::{CudaOptions, CudaResource, Device, MemoryResource};

#[test]
fn opening_a_device_does_not_wait_for_other_work_on_the_gpu() {
    let _turn = common::take_turns();
    let Some(first) = common::gpu_with("device_open", CudaOptions::default()) else {
        return;
    };
    let stream = first.create_stream().unwrap();
    // Long enough that the second open, a few ms, ends well before it: the check below is
    // not about time.
    stream.spin(Duration::from_secs(3)).unwrap();
    let behind = stream.record().unwrap();
    let started = Instant::now();
    let second = Device::cuda(0).unwrap();
    let opened_in = started.elapsed();
    // Were the open a context synchronization, the kernel and the event behind it would be
    // done by now.
    let state = behind.query();
    assert!(
        state.is_none(),
        "opening a device waited for another device's work ({opened_in:?}; the event: {state:?})"
    );
    drop(second);
    behind.synchronize_blocking().unwrap();
}

#[test]
fn devices_opened_and_dropped_on_many_threads_at_once() {
    let _turn = common::take_turns();
    let Some(held) = common::gpu_with("device_open", CudaOptions::default()) else {
        return;
    };
    // DEVICE_OPEN_ROUNDS: opens per thread (8 threads); DEVICE_OPEN_HOLD=0 lets the primary
    // context go back to zero retains between opens (the held device keeps it otherwise).
    let rounds: usize = std::env::var("DEVICE_OPEN_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let held = (std::env::var("DEVICE_OPEN_HOLD").as_deref() != Ok("0")).then_some(held);
    let stop = Arc::new(AtomicBool::new(false));
    // Four threads keep work going meanwhile (kernels, allocations and frees, streams made and
    // destroyed), as the other tests of a binary do.
    let work: Vec<_> = (0..4)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let device = Device::cuda(0).unwrap();
                let resource = CudaResource::new(&device);
                while !stop.load(Ordering::Relaxed) {
                    let stream = device.create_stream().unwrap();
                    stream.spin(Duration::from_micros(100)).unwrap();
                    let ptr = resource.allocate(1 << 20, &stream).unwrap();
                    stream.record().unwrap();
                    // SAFETY: unused, freed once.
                    unsafe { resource.deallocate(ptr, 1 << 20, &stream) }.unwrap();
                }
            })
        })
        .collect();
    let openers: Vec<_> = (0..8)
        .map(|_| {
            std::thread::spawn(move || {
                for _ in 0..rounds {
                    let device = Device::cuda(0).unwrap();
                    let stream = device.create_stream().unwrap();
                    stream.record().unwrap().synchronize_blocking().unwrap();
                }
            })
        })
        .collect();
    for thread in openers {
        thread.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    for thread in work {
        thread.join().unwrap();
    }
    drop(held);
}
