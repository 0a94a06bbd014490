//! cudarc both ways: a `Device` on a cudarc context, a `Stream` on a cudarc stream, ours
//! handed to cudarc, and a kernel launched with cudarc's launch builder on our stream and our
//! buffers with no host synchronization in between.
//!
//! Needs a GPU: cudarc has no simulated device. On a machine without one, each GPU test prints
//! why it checked nothing (with `STREAMALLOC_REQUIRE_GPU=1` a missing GPU fails instead, in
//! `common::devices`). What the simulated device can say (no cudarc handles) is checked there.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{label, runtime};
use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use streamalloc::{Device, DeviceVec, Error, Stream};

const MIB: usize = 1 << 20;
/// The crate's own kernels, loaded a second time through cudarc as a user's module.
const PTX: &str = include_str!("../kernels/streamalloc.ptx");

/// The CUDA devices of `common::devices`, or a printed reason. Every GPU test of this binary
/// takes its turn (`common::take_turns`) first: during `is_idle_during_a_cudarc_capture_..`'s
/// capture another test's `cuStreamCreate` failed with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`
/// and invalidated the capture (run176, one of two suites on an H100).
fn gpus(test: &str) -> Vec<Device> {
    common::gpus(test, "cudarc cannot run on the simulated device")
}

/// A user's kernel (the fill kernel, loaded through cudarc in the device's context) launched
/// with cudarc's launch builder on `stream`'s cudarc handle, writing `value` into `v`.
fn cudarc_fill(device: &Device, stream: &Stream, v: &mut DeviceVec<u32>, value: u32) {
    let ctx = device.cudarc_context().expect("a CUDA device");
    let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(PTX)).unwrap();
    let fill = module.load_function("streamalloc_fill_u32").unwrap();
    let cs = stream.cudarc_stream().expect("a CUDA stream");
    let count = v.len() as u64;
    let mut launch = cs.launch_builder(&fill);
    launch.arg(v).arg(&value).arg(&count);
    // SAFETY: the kernel's signature is (u32*, u32, u64); `v` holds `count` u32s allocated on
    // `stream`, and this launch is queued on that same driver stream, after the allocation and
    // before the vector's free.
    unsafe { launch.launch(LaunchConfig::for_num_elems(count as u32)) }.unwrap();
}

/// The case: our stream handed to cudarc; our work, then cudarc's launch, then ours
/// again, then the copy back, all queued without the host waiting. A long spin before the
/// launch makes a launch that ran on any other stream overtake the zeroing (and be wiped by
/// it): only stream order gives first half 77, second half 5.
#[test]
fn a_cudarc_kernel_runs_on_our_stream_and_buffers_without_synchronizing() {
    let _turn = common::take_turns();
    let rt = runtime();
    for device in gpus("a_cudarc_kernel_runs_on_our_stream_and_buffers_without_synchronizing") {
        let p = Arc::new(common::pool(&device, 4 * MIB, 4 * MIB));
        let s = device.create_stream().unwrap();
        let cs = s.cudarc_stream().unwrap();
        assert_eq!(
            Some(cs.cu_stream()),
            s.cuda_stream(),
            "the same driver stream"
        );
        assert_eq!(
            cs.context().cu_ctx(),
            device.cudarc_context().unwrap().cu_ctx(),
            "the same context"
        );
        let n = 1 << 16;
        let mut v = DeviceVec::<u32>::zeroed(&p, n, &s).unwrap();
        s.spin(Duration::from_millis(20)).unwrap();
        cudarc_fill(&device, &s, &mut v, 77);
        // SAFETY: the second half of `v`, on its stream, after the cudarc launch.
        unsafe { s.fill_u32(v.as_ptr().offset(n / 2 * 4), 5, n / 2) }.unwrap();
        let host = rt.block_on(v.to_host(&s)).unwrap();
        assert!(host[..n / 2].iter().all(|&x| x == 77), "{}", label(&device));
        assert!(host[n / 2..].iter().all(|&x| x == 5), "{}", label(&device));
        // The vector goes back to the pool in stream order after the launch; the stream's
        // cudarc handle outlives our `Stream`.
        drop(v);
        drop(s);
        cs.synchronize().unwrap();
        common::assert_all_back_within(&p, Duration::from_secs(5), &label(&device));
        println!("{}: cudarc launch on our stream: ok", label(&device));
    }
}

/// A stream cudarc made, adopted as ours: our pool allocates on it, cudarc launches on it, our
/// copy back reads the result, in stream order. Dropping our `Stream` leaves cudarc's usable.
#[test]
fn a_cudarc_stream_adopted_as_ours() {
    let _turn = common::take_turns();
    let rt = runtime();
    for device in gpus("a_cudarc_stream_adopted_as_ours") {
        let ctx = device.cudarc_context().unwrap();
        let cs = ctx.new_stream().unwrap();
        let ours = Stream::from_cudarc(&device, cs.clone()).unwrap();
        assert_eq!(ours.cuda_stream(), Some(cs.cu_stream()));
        let p = Arc::new(common::pool(&device, 4 * MIB, 4 * MIB));
        let mut v = DeviceVec::<u32>::zeroed(&p, 4096, &ours).unwrap();
        ours.spin(Duration::from_millis(10)).unwrap();
        cudarc_fill(&device, &ours, &mut v, 9);
        assert!(rt
            .block_on(v.to_host(&ours))
            .unwrap()
            .iter()
            .all(|&x| x == 9));
        drop(v);
        drop(ours);
        cs.synchronize().unwrap();
        common::assert_all_back_within(&p, Duration::from_secs(5), &label(&device));
        println!("{}: adopted cudarc stream: ok", label(&device));
    }
}

/// cudarc's per-thread default stream is a different stream on every thread that names it:
/// refused (a review found it adopted, and the crate's calls from its own threads landing on
/// other streams, out of order).
#[test]
fn the_per_thread_default_stream_is_refused() {
    let _turn = common::take_turns();
    for device in gpus("the_per_thread_default_stream_is_refused") {
        let ctx = device.cudarc_context().unwrap();
        let per_thread = ctx.per_thread_stream();
        assert!(matches!(
            Stream::from_cudarc(&device, per_thread),
            Err(streamalloc::Error::InvalidArgument { .. })
        ));
    }
}

/// A `Device` on a context a cudarc user made shares it (the same `Arc`, no other context);
/// a stream of another context is refused with a typed error.
#[test]
fn a_device_on_a_cudarc_context_shares_it() {
    let _turn = common::take_turns();
    let rt = runtime();
    for gpu in gpus("a_device_on_a_cudarc_context_shares_it") {
        let ordinal = gpu.ordinal().unwrap();
        let ctx = CudaContext::new(ordinal).unwrap();
        let device = Device::from_cudarc(ctx.clone()).unwrap();
        assert!(Arc::ptr_eq(&device.cudarc_context().unwrap(), &ctx));
        assert_eq!(device.ordinal(), Some(ordinal));
        // The primary context: the same one `Device::cuda` uses.
        assert_eq!(
            ctx.cu_ctx(),
            gpu.cudarc_context().unwrap().cu_ctx(),
            "{}",
            label(&gpu)
        );
        let p = Arc::new(common::pool(&device, 4 * MIB, 4 * MIB));
        let s = device.create_stream().unwrap();
        let mut v = DeviceVec::<u32>::from_host(&p, &[1u32; 1024], &s).unwrap();
        cudarc_fill(&device, &s, &mut v, 3);
        assert!(rt.block_on(v.to_host(&s)).unwrap().iter().all(|&x| x == 3));
        drop(v);
        common::assert_all_back_within(&p, Duration::from_secs(5), &label(&device));

        // A stream of another (non-primary) context of the same GPU does not belong to it.
        let other = CudaContext::new_non_primary(ordinal, 0).unwrap();
        let foreign = other.new_stream().unwrap();
        match Stream::from_cudarc(&device, foreign) {
            Err(Error::InvalidArgument { .. }) => {}
            other => panic!("{}: {other:?}", label(&gpu)),
        }
        println!("{}: device on a cudarc context: ok", label(&gpu));
    }
}

/// The simulated device has no cudarc handles, and refuses a cudarc stream with a typed error
/// (which needs a GPU to make one: checked in the GPU run).
#[test]
fn the_simulated_device_has_no_cudarc_handles() {
    let device = Device::simulated(Default::default());
    let s = device.create_stream().unwrap();
    assert!(device.cudarc_context().is_none());
    assert!(s.cudarc_stream().is_none());
    for gpu in gpus("the_simulated_device_has_no_cudarc_handles (cudarc part)") {
        let cs = gpu.cudarc_context().unwrap().new_stream().unwrap();
        match Stream::from_cudarc(&device, cs) {
            Err(Error::InvalidArgument { .. }) => {}
            other => panic!("{}: {other:?}", label(&gpu)),
        }
    }
}

/// Two contexts of one GPU (ours, the primary; a cudarc user's non-primary one): the crate says
/// each can access the other's memory (`can_access_peer`, and `enable_peer_access` does
/// nothing), and it is so: a kernel queued in the non-primary context writes a buffer
/// allocated in the primary one, ordered after its zeroing, and the values arrive. A review
/// doubted it (allocations belong to their context); run on an H100, driver 580.159.04
/// (thirteenth session).
#[test]
fn two_contexts_of_one_gpu_reach_each_others_memory() {
    let _turn = common::take_turns();
    for gpu in gpus("two_contexts_of_one_gpu_reach_each_others_memory") {
        let ordinal = gpu.ordinal().unwrap();
        let other = Device::from_cudarc(CudaContext::new_non_primary(ordinal, 0).unwrap()).unwrap();
        assert!(gpu.can_access_peer(&other).unwrap(), "{}", label(&gpu));
        other.enable_peer_access(&gpu).unwrap();
        let memory = Arc::new(streamalloc::CudaResource::new(&gpu));
        let (sa, sb) = (gpu.create_stream().unwrap(), other.create_stream().unwrap());
        let mut v = DeviceVec::<u32>::zeroed(&memory, 1024, &sa).unwrap();
        sb.wait(&sa.record().unwrap()).unwrap();
        v.record_stream(&sb).unwrap();
        // SAFETY: `other` can access `gpu`'s memory (checked above); `sb` is ordered after the
        // zeroing, and `v`'s free waits for `sb` (`record_stream`).
        unsafe { sb.fill_u32(v.as_ptr(), 5, 1024) }.unwrap();
        sb.synchronize_blocking()
            .unwrap_or_else(|e| panic!("{}: the other context's kernel: {e}", label(&gpu)));
        sa.wait(&sb.record().unwrap()).unwrap();
        let host = runtime().block_on(v.to_host(&sa)).unwrap();
        assert!(host.iter().all(|&x| x == 5), "{}", label(&gpu));
    }
}

/// `is_idle` on a stream whose cudarc handle the user's code is capturing into a graph:
/// `cuStreamQuery` is illegal during capture and invalidates it (CUDA Programming Guide, stream
/// capture, "Prohibited and Unhandled Operations"), and the pools ask the same question of an
/// exposed stream for their own use (`Stream::probe_idle`). The answer is "not idle", asked
/// without `cuStreamQuery`, and the capture still ends with a graph (a review's finding).
#[test]
fn is_idle_during_a_cudarc_capture_leaves_the_capture_valid() {
    let _turn = common::take_turns();
    use cudarc::driver::sys;
    for gpu in gpus("is_idle_during_a_cudarc_capture_leaves_the_capture_valid") {
        let s = gpu.create_stream().unwrap();
        let cs = s.cudarc_stream().unwrap();
        s.synchronize_blocking().unwrap();
        // Thread-local: the reactor's own driver calls on its thread are none of this test's.
        cs.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        let idle = s.is_idle();
        let graph = cs.end_capture(sys::CUgraphInstantiate_flags(0));
        assert!(
            matches!(idle, Ok(false)),
            "{}: is_idle during capture: {idle:?}",
            label(&gpu)
        );
        assert!(
            graph.is_ok(),
            "{}: the capture was invalidated: {:?}",
            label(&gpu),
            graph.err()
        );
        drop(graph);
        assert!(s.is_idle().is_ok(), "{}", label(&gpu));
    }
}
