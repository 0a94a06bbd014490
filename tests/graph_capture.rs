//! The crate beside a user's CUDA graph capture: a stream whose cudarc handle went out may be
//! captured by the user's code (`begin_capture` .. `end_capture`). While it is, nothing the
//! crate does may spoil the capture (an illegal call invalidates it: `end_capture` then fails)
//! or pull another of the crate's streams into it (a stream that waits on an event recorded
//! during the capture joins it: its work is recorded into the graph instead of running, and
//! `end_capture` fails with `CUDA_ERROR_STREAM_CAPTURE_UNJOINED`). What cannot be done during
//! the capture is refused with `Error::StreamCapturing` (CUDA Programming Guide, stream
//! capture: "Cross-stream Dependencies and Events", "Prohibited and Unhandled Operations").
//!
//! Needs a GPU: the simulated device has no cudarc handles and no capture.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{label, runtime};
use cudarc::driver::{sys, CudaGraph, DriverError};
use streamalloc::{Device, DeviceVec, Error, MemoryResource, Stream};

const MIB: usize = 1 << 20;

/// The CUDA devices of `common::devices`, or a printed reason.
fn gpus(test: &str) -> Vec<Device> {
    common::gpus(test, "the simulated device has no graph capture")
}

/// The binary's tests take turns: during a global-mode capture the driver refuses every
/// thread's "potentially unsafe" calls, and a refused call spoils the capture; the crate's own
/// run relaxed, but another test's own (cudarc's `cuGraphInstantiate` in `end_capture`, say)
/// do not (run154, where the tests ran side by side).
fn one_capture_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    common::take_turns()
}

/// Runs `op` while `s` is captured (thread-local mode: the crate's reactor thread is not this
/// one), and returns what it returned and what ending the capture gave.
fn during_capture<T>(
    s: &Stream,
    op: impl FnOnce() -> T,
) -> (T, std::result::Result<Option<CudaGraph>, DriverError>) {
    let cs = s.cudarc_stream().expect("a CUDA stream");
    cs.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap();
    let out = op();
    let graph = cs.end_capture(sys::CUgraphInstantiate_flags(0));
    (out, graph)
}

/// What an operation during the capture may answer: done, or refused for the capture.
fn done_or_refused<T: std::fmt::Debug>(what: &str, gpu: &Device, r: &streamalloc::Result<T>) {
    println!("{}: {what}: {r:?}", label(gpu));
    assert!(
        matches!(r, Ok(_) | Err(Error::StreamCapturing { .. })),
        "{}: {what}: {r:?}",
        label(gpu)
    );
}

/// The capture ended with a graph, and the stream works again after it.
fn capture_survived(
    what: &str,
    gpu: &Device,
    s: &Stream,
    graph: std::result::Result<Option<CudaGraph>, DriverError>,
) {
    println!(
        "{}: {what}: end_capture: {:?}",
        label(gpu),
        graph.as_ref().err()
    );
    assert!(
        graph.is_ok(),
        "{}: {what}: the capture was spoiled: {:?}",
        label(gpu),
        graph.err()
    );
    s.synchronize_blocking()
        .unwrap_or_else(|e| panic!("{}: {what}: the stream after the capture: {e}", label(gpu)));
}

/// An event recorded during the capture would be one the reactor polls (`cuEventQuery` on a
/// captured event is illegal) and other streams wait on (which joins them to the capture).
#[test]
fn a_record_on_a_capturing_stream_is_refused() {
    let _turn = one_capture_at_a_time();
    for gpu in gpus("a_record_on_a_capturing_stream_is_refused") {
        let s = gpu.create_stream().unwrap();
        let (r, graph) = during_capture(&s, || s.record());
        assert!(
            matches!(r, Err(Error::StreamCapturing { .. })),
            "{}: {r:?}",
            label(&gpu)
        );
        capture_survived("record", &gpu, &s, graph);
        // And the stream records again once the capture is over.
        s.record().unwrap().synchronize_blocking().unwrap();
    }
}

/// `cuStreamSynchronize` on a capturing stream is illegal and spoils the capture; the host
/// could not wait for captured work anyway (it runs only when the graph is launched).
#[test]
fn a_blocking_synchronize_of_a_capturing_stream_is_refused() {
    let _turn = one_capture_at_a_time();
    for gpu in gpus("a_blocking_synchronize_of_a_capturing_stream_is_refused") {
        let s = gpu.create_stream().unwrap();
        let (r, graph) = during_capture(&s, || s.synchronize_blocking());
        assert!(
            matches!(r, Err(Error::StreamCapturing { .. })),
            "{}: {r:?}",
            label(&gpu)
        );
        capture_survived("synchronize", &gpu, &s, graph);
    }
}

/// Memory freed on `s` before its capture, asked for on another stream `t` during it: the pool
/// would order `t` after `s` by an event recorded on `s`, that is, into the capture, which `t`
/// would then join (its work recorded into the user's graph, not run). It must not: the
/// ordering is refused, the request is served from a chunk grown for it (the pool has room),
/// the capture ends with a graph, and `t` runs its work.
#[test]
fn another_streams_request_is_not_pulled_into_the_capture() {
    let _turn = one_capture_at_a_time();
    for gpu in gpus("another_streams_request_is_not_pulled_into_the_capture") {
        let p = Arc::new(common::pool(&gpu, 8 * MIB, 64 * MIB));
        let (s, t) = (gpu.create_stream().unwrap(), gpu.create_stream().unwrap());
        s.cuda_stream().unwrap();
        let a = p.allocate(8 * MIB, &s).unwrap();
        s.spin(Duration::from_millis(5)).unwrap();
        // SAFETY: from `p` with this size on `s`, used only on `s` before this point.
        unsafe { p.deallocate(a, 8 * MIB, &s) }.unwrap();
        let (r, graph) = during_capture(&s, || {
            let r = p.allocate(8 * MIB, &t);
            if let Ok(b) = r {
                // t's own work, queued during the capture: it must run now, not in the graph.
                // SAFETY: `b` holds 8 MiB for use on `t`.
                unsafe { t.fill_u32(b, 3, 2 * MIB) }.unwrap();
            }
            r
        });
        assert!(r.is_ok(), "{}: t's request: {r:?}", label(&gpu));
        capture_survived("t's request", &gpu, &s, graph);
        t.synchronize_blocking()
            .unwrap_or_else(|e| panic!("{}: t after the capture: {e}", label(&gpu)));
        if let Ok(b) = r {
            let host = common::read_u32(&t, b, 2 * MIB);
            assert!(
                host.iter().all(|&x| x == 3),
                "{}: t's fill did not run",
                label(&gpu)
            );
            // SAFETY: `b` came from `p` with this size on `t`; its fill has finished.
            unsafe { p.deallocate(b, 8 * MIB, &t) }.unwrap();
        }
    }
}

/// The capturing stream asks for memory another stream freed: ordering it after that stream
/// (an event recorded outside the capture, waited on by the capturing stream) would spoil the
/// capture. Refused, and served from a chunk grown for it instead.
#[test]
fn a_capturing_streams_request_for_another_streams_memory() {
    let _turn = one_capture_at_a_time();
    for gpu in gpus("a_capturing_streams_request_for_another_streams_memory") {
        let p = Arc::new(common::pool(&gpu, 8 * MIB, 64 * MIB));
        let (s, u) = (gpu.create_stream().unwrap(), gpu.create_stream().unwrap());
        let a = p.allocate(8 * MIB, &u).unwrap();
        u.spin(Duration::from_millis(5)).unwrap();
        // SAFETY: from `p` with this size on `u`, used only on `u` before this point.
        unsafe { p.deallocate(a, 8 * MIB, &u) }.unwrap();
        let (r, graph) = during_capture(&s, || p.allocate(8 * MIB, &s));
        assert!(r.is_ok(), "{}: s's request: {r:?}", label(&gpu));
        capture_survived("s's request", &gpu, &s, graph);
        if let Ok(b) = r {
            // SAFETY: `b` came from `p` with this size on `s`; the graph that used nothing of
            // it was never launched.
            unsafe { p.deallocate(b, 8 * MIB, &s) }.unwrap();
        }
    }
}

/// A pool that must grow (`cuMemAlloc`) for a request on the capturing stream, from the
/// capturing thread.
#[test]
fn a_growth_on_the_capturing_thread() {
    let _turn = one_capture_at_a_time();
    for gpu in gpus("a_growth_on_the_capturing_thread") {
        let p = Arc::new(common::pool(&gpu, 2 * MIB, 64 * MIB));
        let s = gpu.create_stream().unwrap();
        let (r, graph) = during_capture(&s, || p.allocate(16 * MIB, &s));
        done_or_refused("a growth", &gpu, &r);
        capture_survived("a growth", &gpu, &s, graph);
        if let Ok(b) = r {
            // SAFETY: `b` came from `p` with this size on `s`, unused.
            unsafe { p.deallocate(b, 16 * MIB, &s) }.unwrap();
        }
    }
}

/// The expandable pool's growth (`cuMemCreate`, `cuMemMap`, `cuMemSetAccess`) on the
/// capturing thread.
#[test]
fn an_expandable_growth_on_the_capturing_thread() {
    let _turn = one_capture_at_a_time();
    use streamalloc::{ExpandableOptions, ExpandablePoolResource};
    for gpu in gpus("an_expandable_growth_on_the_capturing_thread") {
        let p = ExpandablePoolResource::new(
            &gpu,
            ExpandableOptions {
                initial: 2 * MIB,
                reserve: Some(256 * MIB),
                ..ExpandableOptions::default()
            },
        )
        .unwrap();
        let s = gpu.create_stream().unwrap();
        let (r, graph) = during_capture(&s, || p.allocate(32 * MIB, &s));
        done_or_refused("an expandable growth", &gpu, &r);
        capture_survived("an expandable growth", &gpu, &s, graph);
        if let Ok(b) = r {
            // SAFETY: `b` came from `p` with this size on `s`, unused.
            unsafe { p.deallocate(b, 32 * MIB, &s) }.unwrap();
        }
    }
}

/// A global-mode capture (CUDA's and cudarc's default) forbids `cuMemAlloc` on every thread
/// while it lasts: another thread's pool, growing on its own stream meanwhile, must neither
/// fail for it nor spoil the capture.
#[test]
fn another_threads_growth_beside_a_global_capture() {
    let _turn = one_capture_at_a_time();
    for gpu in gpus("another_threads_growth_beside_a_global_capture") {
        let p = Arc::new(common::pool(&gpu, 2 * MIB, 64 * MIB));
        let (s, t) = (gpu.create_stream().unwrap(), gpu.create_stream().unwrap());
        let cs = s.cudarc_stream().unwrap();
        cs.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
            .unwrap();
        let r =
            std::thread::scope(|scope| scope.spawn(|| p.allocate(16 * MIB, &t)).join()).unwrap();
        let graph = cs.end_capture(sys::CUgraphInstantiate_flags(0));
        println!("{}: another thread's growth: {r:?}", label(&gpu));
        assert!(r.is_ok(), "{}: {r:?}", label(&gpu));
        capture_survived("another thread's growth", &gpu, &s, graph);
        // SAFETY: from `p` with this size on `t`, unused.
        unsafe { p.deallocate(r.unwrap(), 16 * MIB, &t) }.unwrap();
    }
}

/// A buffer used on the capturing stream (`record_stream`) and dropped during the capture: its
/// free would wait for an event recorded into the capture. The memory must not come back
/// before the stream's real work is done; kept (leaked, with an error logged) is the answer
/// that promises nothing wrong.
#[test]
fn a_buffer_used_on_a_capturing_stream_dropped_during_the_capture() {
    let _turn = one_capture_at_a_time();
    for gpu in gpus("a_buffer_used_on_a_capturing_stream_dropped_during_the_capture") {
        let p = Arc::new(common::pool(&gpu, 8 * MIB, 64 * MIB));
        let (s, t) = (gpu.create_stream().unwrap(), gpu.create_stream().unwrap());
        let mut v = DeviceVec::<u32>::zeroed(&p, 1024, &t).unwrap();
        s.wait(&t.record().unwrap()).unwrap();
        v.record_stream(&s).unwrap();
        let ((), graph) = during_capture(&s, || drop(v));
        capture_survived("a buffer's drop", &gpu, &s, graph);
        t.synchronize_blocking().unwrap();
    }
}

/// `CudaResource` frees with `cuMemFree` after synchronizing the stream: illegal during the
/// capture.
#[test]
fn a_cuda_resource_free_on_a_capturing_stream() {
    let _turn = one_capture_at_a_time();
    for gpu in gpus("a_cuda_resource_free_on_a_capturing_stream") {
        let r = streamalloc::CudaResource::new(&gpu);
        let s = gpu.create_stream().unwrap();
        let a = r.allocate(MIB, &s).unwrap();
        // SAFETY: from `r` with this size, unused.
        let (freed, graph) = during_capture(&s, || unsafe { r.deallocate(a, MIB, &s) });
        done_or_refused("cuMemFree", &gpu, &freed);
        capture_survived("cuMemFree", &gpu, &s, graph);
        if freed.is_err() {
            // SAFETY: not freed above; nothing used it.
            unsafe { r.deallocate(a, MIB, &s) }.unwrap();
        }
    }
}

/// The crate's own kernels are captured as any other: a fill queued during the capture runs
/// at each launch of the graph, on the stream it is launched on.
#[test]
fn the_crates_kernels_run_in_a_captured_graph() {
    let _turn = one_capture_at_a_time();
    let rt = runtime();
    for gpu in gpus("the_crates_kernels_run_in_a_captured_graph") {
        let p = Arc::new(common::pool(&gpu, 8 * MIB, 64 * MIB));
        let s = gpu.create_stream().unwrap();
        let v = DeviceVec::<u32>::zeroed(&p, 4096, &s).unwrap();
        s.synchronize_blocking().unwrap();
        // SAFETY: `v` lives past every launch of the graph (synchronized below); on `s`.
        let (r, graph) = during_capture(&s, || unsafe { s.fill_u32(v.as_ptr(), 7, 4096) });
        r.unwrap();
        let graph = graph.unwrap().expect("a graph");
        assert!(rt.block_on(v.to_host(&s)).unwrap().iter().all(|&x| x == 0));
        graph.launch().unwrap();
        let host = rt.block_on(v.to_host(&s)).unwrap();
        assert!(host.iter().all(|&x| x == 7), "{}", label(&gpu));
        s.synchronize_blocking().unwrap();
    }
}

/// The calls the pools make for requests on other streams, made by the capturing thread while
/// a capture is under way, on streams and events that are not captured: each leaves the
/// capture valid. Before the crate relaxed the thread's capture mode around them,
/// `cuStreamQuery` and `cuEventQuery` failed with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and
/// invalidated the capture, in both modes (run151).
#[test]
fn calls_on_other_streams_during_a_capture() {
    let _turn = one_capture_at_a_time();
    type Call = fn(&Stream, &Stream, &streamalloc::Event) -> streamalloc::Result<()>;
    let calls: [(&str, Call); 7] = [
        (
            "allocate and free with cuMemAlloc/cuMemFree on another stream",
            |u, _, _| {
                let r = streamalloc::CudaResource::new(u.device());
                let p = r.allocate(MIB, u)?;
                // SAFETY: from `r` with this size, unused.
                unsafe { r.deallocate(p, MIB, u) }
            },
        ),
        (
            "trim a pool whose memory another stream freed",
            |u, _, _| {
                let p = common::pool(u.device(), 4 * MIB, 64 * MIB);
                let a = p.allocate(16 * MIB, u)?;
                // SAFETY: from `p` with this size, unused.
                unsafe { p.deallocate(a, 16 * MIB, u) }?;
                p.trim_blocking().map(drop)
            },
        ),
        ("query a busy stream", |u, _, _| u.is_idle().map(drop)),
        ("record on another stream", |u, _, _| u.record().map(drop)),
        ("query an event of another stream", |_, _, e| {
            e.query().unwrap_or(Ok(()))
        }),
        ("make one stream wait for an event", |_, t, e| t.wait(e)),
        ("order one stream after another", |u, t, _| {
            t.wait(&u.record()?)
        }),
    ];
    for gpu in gpus("calls_on_other_streams_during_a_capture") {
        for mode in [
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        ] {
            for (what, call) in calls {
                let (s, t, u) = (
                    gpu.create_stream().unwrap(),
                    gpu.create_stream().unwrap(),
                    gpu.create_stream().unwrap(),
                );
                u.spin(Duration::from_millis(20)).unwrap();
                let e = u.record().unwrap();
                let cs = s.cudarc_stream().unwrap();
                cs.begin_capture(mode).unwrap();
                let r = call(&u, &t, &e);
                let graph = cs.end_capture(sys::CUgraphInstantiate_flags(0));
                println!(
                    "{}: {mode:?}: {what}: {r:?}; end_capture: {:?}",
                    label(&gpu),
                    graph.as_ref().err()
                );
                assert!(r.is_ok(), "{}: {mode:?}: {what}: {r:?}", label(&gpu));
                assert!(
                    graph.is_ok(),
                    "{}: {mode:?}: {what}: {:?}",
                    label(&gpu),
                    graph.err()
                );
                u.synchronize_blocking().unwrap();
                t.synchronize_blocking().unwrap();
            }
        }
    }
}

/// An event awaited while the user's code holds a global-mode capture open on another stream:
/// the reactor's polls (`cuEventQuery`, on its own thread) must neither fail nor spoil the
/// capture (global mode forbids such calls on every thread; the reactor's thread is relaxed).
#[test]
fn an_awaited_event_completes_beside_a_global_capture() {
    let _turn = one_capture_at_a_time();
    let rt = runtime();
    for gpu in gpus("an_awaited_event_completes_beside_a_global_capture") {
        let (s, u) = (gpu.create_stream().unwrap(), gpu.create_stream().unwrap());
        u.spin(Duration::from_millis(30)).unwrap();
        let done = u.record().unwrap();
        let cs = s.cudarc_stream().unwrap();
        cs.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
            .unwrap();
        // Awaited from another thread (tokio's), as a server would.
        let r = rt.block_on(async { tokio::spawn(done).await.unwrap() });
        let graph = cs.end_capture(sys::CUgraphInstantiate_flags(0));
        assert!(r.is_ok(), "{}: {r:?}", label(&gpu));
        capture_survived("an awaited event", &gpu, &s, graph);
    }
}

/// What relaxing the capture mode around a call costs: the two `cuThreadExchangeStreamCaptureMode`
/// calls, timed (printed; no threshold), beside a `cuStreamQuery` of an idle stream.
#[test]
fn what_relaxing_the_capture_mode_costs() {
    let _turn = one_capture_at_a_time();
    for gpu in gpus("what_relaxing_the_capture_mode_costs") {
        let s = gpu.create_stream().unwrap();
        s.synchronize_blocking().unwrap();
        let n = 200_000;
        let start = std::time::Instant::now();
        for _ in 0..n {
            let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
            // SAFETY: swaps the thread's mode with a valid value, and back.
            unsafe {
                sys::cuThreadExchangeStreamCaptureMode(&mut mode);
                sys::cuThreadExchangeStreamCaptureMode(&mut mode);
            }
        }
        let exchange = start.elapsed().as_nanos() as f64 / n as f64;
        let start = std::time::Instant::now();
        for _ in 0..n {
            assert!(s.is_idle().unwrap());
        }
        let query = start.elapsed().as_nanos() as f64 / n as f64;
        println!(
            "{}: two exchanges of the capture mode: {exchange:.1} ns; is_idle of an idle stream (with them): {query:.1} ns",
            label(&gpu)
        );
    }
}

/// The pattern the docs give for allocating during a capture: a pool of the capture's own,
/// used only by the capturing stream. Its requests need no ordering of one stream after
/// another, so during the capture it serves them from its free memory (a block freed in the
/// capture and taken again, in the graph's stream order) or by growing; the graph then runs
/// with that memory at each launch, and the pool is dropped after the graph's last launch.
#[test]
fn a_pool_of_the_captures_own_serves_it() {
    let _turn = one_capture_at_a_time();
    let rt = runtime();
    for gpu in gpus("a_pool_of_the_captures_own_serves_it") {
        let private = Arc::new(common::pool(&gpu, 2 * MIB, 64 * MIB));
        let shared = Arc::new(common::pool(&gpu, 8 * MIB, 64 * MIB));
        let s = gpu.create_stream().unwrap();
        let out = DeviceVec::<u32>::zeroed(&shared, 1024, &s).unwrap();
        s.synchronize_blocking().unwrap();
        let n = MIB / 4;
        let (r, graph) = during_capture(&s, || -> streamalloc::Result<()> {
            // A scratch block, filled and given back; the next takes its memory again; and a
            // growth for one larger than the pool.
            let a = private.allocate(MIB, &s)?;
            // SAFETY: `a` holds 1 MiB for use on `s`; freed after its use, on `s`.
            unsafe {
                s.fill_u32(a, 1, n)?;
                private.deallocate(a, MIB, &s)?;
            }
            let b = private.allocate(MIB, &s)?;
            let c = private.allocate(4 * MIB, &s)?;
            // SAFETY: `b` and `c` are for use on `s`; `out` lives past the graph's launches.
            unsafe {
                s.fill_u32(b, 9, 1024)?;
                s.copy_dtod(out.as_ptr(), b, 1024 * 4)?;
                private.deallocate(b, MIB, &s)?;
                private.deallocate(c, 4 * MIB, &s)?;
            }
            Ok(())
        });
        r.unwrap_or_else(|e| panic!("{}: {e}", label(&gpu)));
        let graph = graph.unwrap().expect("a graph");
        graph.launch().unwrap();
        graph.launch().unwrap();
        let host = rt.block_on(out.to_host(&s)).unwrap();
        assert!(host.iter().all(|&x| x == 9), "{}", label(&gpu));
        s.synchronize_blocking().unwrap();
        drop(graph);
        drop(private);
    }
}

/// A staged copy (`from_host`, `to_host`) on a capturing stream is refused before anything is
/// queued: captured, the copy would run at each launch of the graph from a staging block
/// reused meanwhile, and `from_host` failing on the event after it then freed the vector the
/// captured copy writes (a review's finding). Nothing leaks: the pool gets everything back.
#[test]
fn staged_copies_on_a_capturing_stream_are_refused() {
    let _turn = one_capture_at_a_time();
    let rt = runtime();
    for gpu in gpus("staged_copies_on_a_capturing_stream_are_refused") {
        let p = Arc::new(common::pool(&gpu, 8 * MIB, 64 * MIB));
        let s = gpu.create_stream().unwrap();
        let v = DeviceVec::<u32>::zeroed(&p, 1024, &s).unwrap();
        s.synchronize_blocking().unwrap();
        let ((up, down), graph) = during_capture(&s, || {
            let up = DeviceVec::<u32>::from_host(&p, &[1u32; 1024], &s).map(drop);
            let down = rt.block_on(v.to_host(&s)).map(drop);
            (up, down)
        });
        for (what, r) in [("from_host", up), ("to_host", down)] {
            assert!(
                matches!(r, Err(Error::StreamCapturing { .. })),
                "{}: {what}: {r:?}",
                label(&gpu)
            );
        }
        capture_survived("staged copies", &gpu, &s, graph);
        drop(v);
        common::assert_all_back_within(&p, Duration::from_secs(5), &label(&gpu));
    }
}

/// The driver's stream-ordered pool on a capturing stream: `cuMemAllocFromPoolAsync` would make
/// a graph memory node (an address with memory only while the graph runs): refused.
#[test]
fn the_drivers_pool_refuses_a_capturing_stream() {
    let _turn = one_capture_at_a_time();
    for gpu in gpus("the_drivers_pool_refuses_a_capturing_stream") {
        let r = common::primed_async_pool(&gpu, 8 * MIB);
        let s = gpu.create_stream().unwrap();
        let a = r.allocate(MIB, &s).unwrap();
        let ((got, freed), graph) = during_capture(&s, || {
            // SAFETY: from `r` with this size, unused; on a refusal it stays allocated.
            (r.allocate(MIB, &s), unsafe { r.deallocate(a, MIB, &s) })
        });
        assert!(
            matches!(got, Err(Error::StreamCapturing { .. })),
            "{}: {got:?}",
            label(&gpu)
        );
        assert!(
            matches!(freed, Err(Error::StreamCapturing { .. })),
            "{}: {freed:?}",
            label(&gpu)
        );
        capture_survived("the driver's pool", &gpu, &s, graph);
        // SAFETY: not freed above.
        unsafe { r.deallocate(a, MIB, &s) }.unwrap();
    }
}

/// An arena that must grow for a request on a capturing stream refuses before it allocates
/// (its chunk's guard is an event on that stream): no chunk is lost.
#[test]
fn an_arena_does_not_grow_on_a_capturing_stream() {
    let _turn = one_capture_at_a_time();
    for gpu in gpus("an_arena_does_not_grow_on_a_capturing_stream") {
        let arena = common::arena(&gpu, 2 * MIB, 64 * MIB);
        let s = gpu.create_stream().unwrap();
        let before = arena.stats().reserved;
        let (r, graph) = during_capture(&s, || arena.allocate(16 * MIB, &s));
        assert!(
            matches!(r, Err(Error::StreamCapturing { .. })),
            "{}: {r:?}",
            label(&gpu)
        );
        capture_survived("an arena's growth", &gpu, &s, graph);
        assert_eq!(arena.stats().reserved, before, "{}", label(&gpu));
    }
}

/// A pool dropped while a stream it served is being captured: the host cannot wait for that
/// stream (its earlier work may still use the pool's memory), so the pool keeps its memory
/// (leaked, logged) instead of freeing it under that work. Before, the drop ignored the
/// refused synchronize and freed every chunk (a review's finding). The same for the expandable
/// pool, whose reservation stays mapped.
#[test]
fn a_pool_dropped_during_a_capture_of_its_stream_keeps_its_memory() {
    let _turn = one_capture_at_a_time();
    use streamalloc::{ExpandableOptions, ExpandablePoolResource};
    for gpu in gpus("a_pool_dropped_during_a_capture_of_its_stream_keeps_its_memory") {
        const HELD: usize = 256 * MIB;
        for expandable in [false, true] {
            let s = gpu.create_stream().unwrap();
            let pool: Box<dyn MemoryResource> = if expandable {
                Box::new(
                    ExpandablePoolResource::new(
                        &gpu,
                        ExpandableOptions {
                            initial: HELD,
                            reserve: Some(2 * HELD),
                            ..ExpandableOptions::default()
                        },
                    )
                    .unwrap(),
                )
            } else {
                Box::new(common::pool(&gpu, HELD, 2 * HELD))
            };
            let a = pool.allocate(MIB, &s).unwrap();
            s.spin(Duration::from_millis(5)).unwrap();
            // SAFETY: from `pool` with this size on `s`, used on `s` only.
            unsafe { pool.deallocate(a, MIB, &s) }.unwrap();
            let before = gpu.free_memory().unwrap();
            let ((), graph) = during_capture(&s, || drop(pool));
            capture_survived("a pool's drop", &gpu, &s, graph);
            let after = gpu.free_memory().unwrap();
            println!(
                "{}: expandable {expandable}: free memory {before} before the drop, {after} after",
                label(&gpu)
            );
            assert!(
                after < before + HELD / 2,
                "{}: expandable {expandable}: the pool freed its memory under a capture of its stream ({before} -> {after} bytes free)",
                label(&gpu)
            );
        }
    }
}
