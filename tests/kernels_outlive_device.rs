//! The crate's kernels queued on a stream whose cudarc handle outlives every `Device`: the
//! last device of a GPU unloads the crate's module (`cuModuleUnload`), and a launch of it may
//! still wait in the queue, behind other work, on the user's cudarc stream. The queued launch
//! must still run, and the stream must not fail.
//!
//! In a binary of its own: were the driver to fail such a launch, the context's error could
//! spoil other tests of the process. Needs a GPU (cudarc has no simulated device). It also
//! prints how long each drop took (not asserted: tests check, benchmarks measure), which the
//! docs of `Device` cite.

mod common;

use std::time::{Duration, Instant};

use cudarc::driver::DevicePtr as _;
use streamalloc::{CudaOptions, Device, DevicePtr};

/// Queues a 300 ms spin, then the crate's fill kernel into memory of cudarc's, on a stream of
/// a device opened with `options`; drops the stream, the device, then a second handle of the
/// same GPU (the last: the module goes with it); then waits on the cudarc stream and checks
/// the fill.
fn fill_queued_past_the_last_device(options: CudaOptions, label: &str) {
    let Ok(device) = Device::cuda_with(0, options) else {
        println!("{label}: skipped, no GPU");
        return;
    };
    // A second handle of the same GPU: while it lives, the module stays loaded.
    let other = Device::cuda(0).unwrap();
    let n = 1 << 20;
    let stream = device.create_stream().unwrap();
    let cs = stream.cudarc_stream().expect("a CUDA stream");
    // The user's memory, from cudarc: it outlives the crate.
    let buf = cs.alloc_zeros::<u32>(n).unwrap();
    let raw = {
        let (raw, _sync) = buf.device_ptr(&cs);
        raw
    };
    // The fill waits behind the spin: it has not started when the devices go.
    stream.spin(Duration::from_millis(300)).unwrap();
    // SAFETY: `buf` holds `n` u32s, allocated on this driver stream and kept alive below until
    // after the stream is synchronized.
    unsafe { stream.fill_u32(DevicePtr(raw), 7, n) }.unwrap();
    drop(stream);
    let started = Instant::now();
    drop(device);
    let first_dropped_in = started.elapsed();
    let started = Instant::now();
    drop(other);
    let last_dropped_in = started.elapsed();
    let synced = cs.synchronize();
    println!(
        "{label}: the device dropped in {first_dropped_in:?}, the GPU's last device in \
         {last_dropped_in:?}; then the cudarc stream: {synced:?}"
    );
    synced.expect("the user's stream, with the crate's kernel queued on it, completes");
    let host = cs.clone_dtoh(&buf).unwrap();
    assert!(
        host.iter().all(|&x| x == 7),
        "{label}: the queued fill ran: {} of {n} words are 7",
        host.iter().filter(|&&x| x == 7).count()
    );
}

#[test]
fn a_kernel_queued_on_a_cudarc_stream_runs_after_the_last_device_goes() {
    if common::gpus(
        "a_kernel_queued_on_a_cudarc_stream_runs_after_the_last_device_goes",
        "cudarc cannot run on the simulated device",
    )
    .is_empty()
    {
        return;
    }
    fill_queued_past_the_last_device(CudaOptions::default(), "completion words on (the default)");
    fill_queued_past_the_last_device(
        CudaOptions {
            completion_words: false,
            ..CudaOptions::default()
        },
        "completion words off",
    );
}
