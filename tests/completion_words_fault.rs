//! Completion words and a failed stream (`CudaOptions::completion_words`, issue 18): a kernel
//! that faults stops the stream, so the word after it is never written; the event must still
//! resolve, with the driver's error (the driver is asked about an event whose word has not
//! moved every 100 µs). Its own test binary: the fault poisons the process's CUDA context.
//!
//! Needs a GPU; without one it prints why it checked nothing (with `STREAMALLOC_REQUIRE_GPU=1`
//! a missing GPU fails instead).

mod common;

use std::time::Duration;

use common::{gpu_with, runtime};
use streamalloc::{CudaOptions, DevicePtr};

#[test]
fn an_event_behind_a_faulting_kernel_resolves_with_the_error() {
    let options = CudaOptions {
        completion_words: true,
        ..CudaOptions::default()
    };
    let Some(device) = gpu_with(
        "an_event_behind_a_faulting_kernel_resolves_with_the_error",
        options,
    ) else {
        return;
    };
    let rt = runtime();
    let stream = device.create_stream().unwrap();
    // A first event, reached: the word works on this stream.
    stream.spin(Duration::from_millis(1)).unwrap();
    let before = stream.record().unwrap();
    rt.block_on(before.clone()).unwrap();
    stream.spin(Duration::from_millis(2)).unwrap();
    // SAFETY: deliberately not: a write to an address no allocation holds, to make the kernel
    // fault. The process's context is lost after it; this binary holds no other test.
    let launched = unsafe { stream.fill_u32(DevicePtr(0x1000), 7, 1 << 20) };
    if launched.is_err() {
        return println!("the faulting kernel was refused at launch: {launched:?}");
    }
    let Ok(event) = stream.record() else {
        return println!("the record after the fault was refused: the driver saw it first");
    };
    let result =
        rt.block_on(async { tokio::time::timeout(Duration::from_secs(20), event.clone()).await });
    let result = result.expect("the event behind a faulting kernel never resolved");
    assert!(
        result.is_err(),
        "the event resolved Ok behind a faulting kernel"
    );
    assert!(matches!(event.query(), Some(Err(_))));
    println!("resolved with {result:?}");
}
