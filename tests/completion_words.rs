//! Completion words (`CudaOptions::completion_words`, issue 18): events whose completion the
//! host reads from a word the GPU writes right after them, instead of asking the driver.
//!
//! Needs a GPU: the simulated device has no words (its events are atomics already). On a
//! machine without one, each test prints why it checked nothing (with
//! `STREAMALLOC_REQUIRE_GPU=1` a missing GPU fails instead).

mod common;

use std::time::Duration;

use common::{gpu_with, runtime, take_turns};
use streamalloc::{CudaOptions, Device};

// The tests take turns (`take_turns`): each times events against kernels it queued, and a
// test's device going away (its pages of words freed with `cuMemFreeHost`, which waits for the
// device to be idle) held up another's launches until its 300 ms kernel was done, which then
// read complete "early" (1 of 8 in run119).

/// GPU 0 with completion words on, or `None` (said) without a GPU: the simulated device has
/// no words.
fn gpu(test: &str) -> Option<Device> {
    let options = CudaOptions {
        completion_words: true,
        ..CudaOptions::default()
    };
    gpu_with(test, options)
}

/// Events behind kernels read pending while their kernel runs and complete after, in order,
/// awaited and queried, on several streams.
#[test]
fn events_complete_when_the_gpu_passes_them() {
    let _turn = take_turns();
    let Some(device) = gpu("events_complete_when_the_gpu_passes_them") else {
        return;
    };
    let rt = runtime();
    let streams: Vec<_> = (0..3).map(|_| device.create_stream().unwrap()).collect();
    for round in 0..20 {
        let mut events = vec![];
        let queued = std::time::Instant::now();
        for stream in &streams {
            stream.spin(Duration::from_millis(50)).unwrap();
            events.push(stream.record().unwrap());
            stream.spin(Duration::from_micros(200)).unwrap();
            events.push(stream.record().unwrap());
        }
        // The first of each stream sits behind 50 ms of GPU work queued just now (unless this
        // thread lost its CPU for most of that: then nothing is checked).
        let complete = events.iter().step_by(2).filter(|e| e.is_complete()).count();
        let elapsed = queued.elapsed();
        assert!(
            complete == 0 || elapsed > Duration::from_millis(40),
            "round {round}: {complete} events read complete {elapsed:?} into 50 ms kernels"
        );
        rt.block_on(async {
            for event in events.iter().cloned() {
                event.await.unwrap();
            }
        });
        assert!(events.iter().all(|e| e.is_complete()));
        assert!(events.iter().all(|e| matches!(e.query(), Some(Ok(())))));
    }
    for stream in &streams {
        stream.synchronize_blocking().unwrap();
    }
}

/// A stream dropped with work queued leaves a write of its word still to come: its word must
/// not go to a new stream before that write lands, or the new stream's first event would read
/// complete when the old stream's work finishes (its sequence numbers start where the old
/// one's did). Fails with `Words::word` taking retired words without waiting (checked once).
#[test]
fn a_dropped_streams_late_write_does_not_complete_a_new_streams_event() {
    let _turn = take_turns();
    let Some(device) = gpu("a_dropped_streams_late_write_does_not_complete_a_new_streams_event")
    else {
        return;
    };
    for round in 0..5 {
        // Many at once, so that some of their words would be handed out again below.
        let old: Vec<_> = (0..8).map(|_| device.create_stream().unwrap()).collect();
        for stream in &old {
            stream.spin(Duration::from_millis(30)).unwrap();
            drop(stream.record().unwrap());
        }
        drop(old);
        let new: Vec<_> = (0..8).map(|_| device.create_stream().unwrap()).collect();
        let events: Vec<_> = new
            .iter()
            .map(|s| {
                s.spin(Duration::from_millis(300)).unwrap();
                s.record().unwrap()
            })
            .collect();
        // The old streams' kernels end about 30 ms in; the new ones' about 300 ms.
        std::thread::sleep(Duration::from_millis(120));
        let early = events.iter().filter(|e| e.is_complete()).count();
        assert_eq!(
            early, 0,
            "round {round}: {early} of 8 events read complete while their kernels still ran"
        );
        for (stream, event) in new.iter().zip(&events) {
            stream.synchronize_blocking().unwrap();
            assert!(event.is_complete());
        }
    }
}

/// The word never says more than the driver would: when an event first reads complete, a raw
/// event recorded on the stream just before it has completed too (`cuEventQuery`), over many
/// events behind kernels of random lengths on two streams. A word written ahead of the work
/// before it would hand out memory still in use.
#[test]
fn an_event_never_reads_complete_before_the_work_in_front_of_it() {
    let _turn = take_turns();
    use cudarc::driver::sys;
    let Some(device) = gpu("an_event_never_reads_complete_before_the_work_in_front_of_it") else {
        return;
    };
    let streams: Vec<_> = (0..2).map(|_| device.create_stream().unwrap()).collect();
    let mut seed = 7u64;
    let (mut early, mut pending_at_record) = (0, 0);
    for i in 0..1_000 {
        let stream = &streams[i % 2];
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        stream
            .spin(Duration::from_micros((seed >> 33) % 300))
            .unwrap();
        let raw_stream = stream.cuda_stream().expect("a CUDA stream");
        let mut before: sys::CUevent = std::ptr::null_mut();
        // SAFETY: creates one event into `before`, destroyed below.
        let made = unsafe {
            sys::cuEventCreate(
                &mut before,
                sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32,
            )
        };
        assert_eq!(made, sys::CUresult::CUDA_SUCCESS);
        // SAFETY: both handles are live.
        let recorded = unsafe { sys::cuEventRecord(before, raw_stream) };
        assert_eq!(recorded, sys::CUresult::CUDA_SUCCESS);
        let event = stream.record().unwrap();
        if !event.is_complete() {
            pending_at_record += 1;
        }
        while !event.is_complete() {
            std::hint::spin_loop();
        }
        // SAFETY: a live event.
        let raw_done = unsafe { sys::cuEventQuery(before) };
        if raw_done != sys::CUresult::CUDA_SUCCESS {
            early += 1;
        }
        // SAFETY: ours; its recording has completed or is abandoned with the event.
        unsafe { sys::cuEventDestroy_v2(before) };
    }
    println!(
        "{pending_at_record} of 1000 events pending when recorded, {early} read complete early"
    );
    assert_eq!(
        early, 0,
        "events read complete before the work in front of them"
    );
    for stream in &streams {
        stream.synchronize_blocking().unwrap();
    }
}

/// A record on a stream being captured into a graph (cudarc code can capture a stream whose
/// handle went out) queues no word write: captured, the write would land at every launch of
/// the graph, on any stream, and complete the stream's pending events early. Here the graph
/// is launched on another stream while an event of the captured stream waits behind a 300 ms
/// kernel. Fails with the capture check removed from `Stream::record` (a review's finding).
/// Since the seventeenth session the record itself is refused during the capture
/// (`Error::StreamCapturing`, `tests/graph_capture.rs`), which queues no write either.
#[test]
fn a_graph_captured_from_a_stream_does_not_complete_its_events() {
    let _turn = take_turns();
    use cudarc::driver::sys;
    let Some(device) = gpu("a_graph_captured_from_a_stream_does_not_complete_its_events") else {
        return;
    };
    let stream = device.create_stream().unwrap();
    let other = device.create_stream().unwrap();
    let (raw, raw_other) = (stream.cuda_stream().unwrap(), other.cuda_stream().unwrap());
    stream.spin(Duration::from_millis(300)).unwrap();
    let queued = std::time::Instant::now();
    let pending = stream.record().unwrap();
    let ok = sys::CUresult::CUDA_SUCCESS;
    // SAFETY: a live stream of the current context; relaxed mode, so that other threads' calls
    // (the tests beside this one) are not refused while it captures.
    let begun = unsafe {
        sys::cuStreamBeginCapture_v2(
            raw,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        )
    };
    assert_eq!(begun, ok);
    let captured = stream.record();
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: ends the capture begun above, writing the graph.
    assert_eq!(unsafe { sys::cuStreamEndCapture(raw, &mut graph) }, ok);
    assert!(
        matches!(captured, Err(streamalloc::Error::StreamCapturing { .. })),
        "a record while capturing: {captured:?}"
    );
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: a graph just captured; writes one executable graph.
    assert_eq!(
        unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) },
        ok
    );
    for _ in 0..3 {
        // SAFETY: a live executable graph, on a live stream.
        assert_eq!(unsafe { sys::cuGraphLaunch(exec, raw_other) }, ok);
    }
    other.synchronize_blocking().unwrap();
    let early = pending.is_complete();
    if queued.elapsed() < Duration::from_millis(250) {
        assert!(
            !early,
            "an event behind a running kernel read complete after a graph launch"
        );
    }
    stream.synchronize_blocking().unwrap();
    assert!(pending.is_complete());
    // SAFETY: both ours, launched and finished (`other` is synchronized).
    unsafe {
        sys::cuGraphExecDestroy(exec);
        sys::cuGraphDestroy(graph);
    }
}
