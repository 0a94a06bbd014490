//! cudarc both ways: a [`Device`] on a cudarc context (here), a [`Stream`](crate::Stream) on a
//! cudarc stream (`stream/cudarc_interop.rs`, the stream layer's), and
//! ours handed to cudarc, so that a kernel a user loads and launches with cudarc's launch
//! builder runs on our stream, on our buffers, with no host synchronization in between.
//!
//! The full notes (ownership, ordering, caveats) are in the public design notes,
//! `crate::implementation`, section "cudarc", so that users see them.

use std::sync::Arc as StdArc;

use cudarc::driver::CudaContext;

use crate::device::{cuda, Backend, CudaOptions, Device};
use crate::error::Result;

impl Device {
    /// A CUDA device on a context that a cudarc user made: the context is shared (this device
    /// holds the `Arc`; nothing is retained or created again). Same defaults as
    /// [`Device::cuda`]. See [the design notes](crate::implementation#cudarc) for ownership, ordering
    /// and caveats.
    ///
    /// If the context has made no stream yet and tracks events (cudarc's default), this makes
    /// its first stream, and cudarc then synchronizes the context: the host waits, once, for
    /// the work already running in it.
    ///
    /// Errors: [`Error::Driver`] if a driver call fails (loading the crate's kernels in the
    /// context, reading the device's properties), [`Error::Io`] if the operating system cannot
    /// start the device's completion reactor thread.
    ///
    /// [`Error::Driver`]: crate::Error::Driver
    /// [`Error::Io`]: crate::Error::Io
    pub fn from_cudarc(ctx: StdArc<CudaContext>) -> Result<Device> {
        Self::from_cudarc_with(ctx, CudaOptions::default())
    }

    /// [`from_cudarc`](Self::from_cudarc) with the given options.
    pub fn from_cudarc_with(ctx: StdArc<CudaContext>, options: CudaOptions) -> Result<Device> {
        let backend = cuda::CudaDevice::on_context(cuda::Context::from_cudarc(ctx))?;
        Self::open_cuda(backend, options)
    }

    /// cudarc's handle of this device's context, to load modules and launch kernels with
    /// cudarc in the very context our streams and memory live in; `None` on the simulated
    /// device. The same `Arc` the device holds (a clone): for a device from
    /// [`from_cudarc`](Self::from_cudarc), the user's own.
    pub fn cudarc_context(&self) -> Option<StdArc<CudaContext>> {
        match self.backend() {
            Backend::Cuda(d) => Some(d.ctx.cudarc().clone()),
            Backend::Sim(_) => None,
        }
    }
}
