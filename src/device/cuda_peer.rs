//! Several GPUs: peer access between two, and copies from one to another. Beside `cuda.rs`,
//! like `cuda_vmm.rs`.

use cudarc::driver::{result, sys};

use super::cuda::{check, raw, CudaDevice, RawStream};
use crate::error::Result;

impl CudaDevice {
    /// Whether kernels of this GPU can access `peer`'s memory (`cuDeviceCanAccessPeer`).
    pub(crate) fn can_access_peer(&self, peer: &CudaDevice) -> Result<bool> {
        let mut can = 0;
        // SAFETY: `can` is one writable int; both devices are valid.
        raw("cuDeviceCanAccessPeer", unsafe {
            sys::cuDeviceCanAccessPeer(
                &mut can,
                self.ctx.cudarc().cu_device(),
                peer.ctx.cudarc().cu_device(),
            )
        })?;
        Ok(can != 0)
    }

    /// Lets kernels of this GPU's context access `peer`'s memory (`cuCtxEnablePeerAccess`, one
    /// direction). Already enabled is success.
    pub(crate) fn enable_peer_access(&self, peer: &CudaDevice) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the peer's context is alive (its device holds it); flags must be 0.
        match unsafe { sys::cuCtxEnablePeerAccess(peer.ctx.raw(), 0) } {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
                Ok(())
            }
            r => raw("cuCtxEnablePeerAccess", r),
        }
    }

    /// Queues a copy of `bytes` from `src` (memory of `src_device`) to `dst` (memory of this
    /// device) on `stream` of this device (`cuMemcpyPeerAsync`: needs no peer access; the
    /// driver stages it when the GPUs cannot reach each other).
    ///
    /// # Safety
    /// Both ranges are live memory of their devices until the stream reaches the copy, and the
    /// source's writers are ordered before it.
    pub(crate) unsafe fn copy_peer(
        &self,
        dst: u64,
        src_device: &CudaDevice,
        src: u64,
        bytes: usize,
        stream: RawStream,
    ) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the caller's contract; both contexts are alive.
        check("cuMemcpyPeerAsync", unsafe {
            result::memcpy_peer_async(
                self.ctx.raw(),
                dst,
                src_device.ctx.raw(),
                src,
                bytes,
                stream.0,
            )
        })
    }
}
