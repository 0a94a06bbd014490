//! Two `Device`s on one GPU with different CUDA contexts: the primary context
//! (`Device::cuda`) and a cudarc non-primary one (`CudaContext::new_non_primary`, through
//! `Device::from_cudarc`). Does memory of one reach kernels of the other, and do
//! `can_access_peer` and `enable_peer_access` tell the truth about it?
//!
//! On an H100 with driver 580.159.04 (run175, 2026-11-28) it does, both ways, though the driver
//! answers `cuDeviceCanAccessPeer(d, d)` with 0 and `cuCtxEnablePeerAccess` between the two
//! contexts with `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED`: contexts on one GPU share its memory
//! without peer access. So `can_access_peer` says yes for the same GPU without asking the
//! driver, and `enable_peer_access` has nothing to enable there; this test checks that a
//! kernel finds what `can_access_peer` says, on every GPU it runs on.
//!
//! Needs a GPU (cudarc has no simulated device); without one each test says it checked
//! nothing.

mod common;

use cudarc::driver::{sys, CudaContext};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::{Device, MemoryResource};

const COUNT: usize = 1 << 16;

/// Whether a kernel queued on `writer`'s stream can fill memory `owner` allocated (read back
/// through `owner`), and the driver's answers along the way, printed.
fn kernel_reaches(owner: &Device, writer: &Device) -> bool {
    let memory = CudaResource::new(owner);
    let owner_stream = owner.create_stream().unwrap();
    let bytes = COUNT * 4;
    let ptr = memory.allocate(bytes, &owner_stream).unwrap();
    // SAFETY: `ptr` holds `bytes` bytes allocated on `owner_stream`, zeroed there before use.
    unsafe { owner_stream.memset_d8(ptr, 0, bytes) }.unwrap();
    owner_stream.synchronize_blocking().unwrap();
    let writer_stream = writer.create_stream().unwrap();
    // SAFETY: `ptr` holds COUNT u32s; the owner's stream has finished with it (synchronized
    // above) and touches it again only after this stream is synchronized below.
    let queued = unsafe { writer_stream.fill_u32(ptr, 7, COUNT) };
    let ran = queued.and_then(|()| writer_stream.synchronize_blocking());
    println!("  fill from the other context: {ran:?}");
    let mut host = vec![0u32; COUNT];
    // SAFETY: `host` holds `bytes` bytes; `ptr` is the owner's, idle on its streams.
    let read = unsafe { owner_stream.copy_dtoh(host.as_mut_ptr().cast(), ptr, bytes) }
        .and_then(|()| owner_stream.synchronize_blocking());
    println!("  read back: {read:?}, first word {}", host[0]);
    // SAFETY: allocated above with this size; the streams that used it were synchronized.
    unsafe { memory.deallocate(ptr, bytes, &owner_stream) }.unwrap();
    ran.is_ok() && read.is_ok() && host.iter().all(|&w| w == 7)
}

#[test]
fn two_contexts_on_one_gpu_say_whether_they_reach_each_other() {
    let test = "two_contexts_on_one_gpu_say_whether_they_reach_each_other";
    for primary in common::gpus(test, "a cudarc context needs a GPU") {
        let ordinal = primary.ordinal().unwrap();
        let ctx = CudaContext::new_non_primary(ordinal, 0).unwrap();
        let other = Device::from_cudarc(ctx.clone()).unwrap();
        let primary_ctx = primary.cudarc_context().unwrap();
        assert_ne!(ctx.cu_ctx(), primary_ctx.cu_ctx(), "two contexts");

        let mut can = -1;
        // SAFETY: `can` is one writable int; the device handle is valid.
        let r = unsafe { sys::cuDeviceCanAccessPeer(&mut can, ctx.cu_device(), ctx.cu_device()) };
        println!("cuDeviceCanAccessPeer(d{ordinal}, d{ordinal}): {r:?}, {can}");
        ctx.bind_to_thread().unwrap();
        // SAFETY: the primary context is alive (`primary` holds it); flags must be 0.
        let r = unsafe { sys::cuCtxEnablePeerAccess(primary_ctx.cu_ctx(), 0) };
        println!("cuCtxEnablePeerAccess(non-primary -> primary): {r:?}");

        let says = other.can_access_peer(&primary).unwrap();
        let enable = other.enable_peer_access(&primary);
        println!("can_access_peer: {says}, enable_peer_access: {enable:?}");
        println!("primary's memory, a kernel of the non-primary context:");
        let reaches = kernel_reaches(&primary, &other);
        println!("non-primary's memory, a kernel of the primary context:");
        let back = kernel_reaches(&other, &primary);
        assert_eq!(
            says, reaches,
            "can_access_peer must say what a kernel finds"
        );
        assert_eq!(says, back, "both ways");
    }
}
