//! cudarc both ways: a [`Device`] on a cudarc context, a [`Stream`] on a cudarc stream, and
//! ours handed to cudarc, so that a kernel a user loads and launches with cudarc's launch
//! builder runs on our stream, on our buffers, with no host synchronization in between.
//!
//! The full notes (ownership, ordering, caveats) are in the public design notes,
//! `crate::implementation`, section "cudarc", so that users see them.

use std::sync::Arc as StdArc;

use cudarc::driver::{CudaContext, CudaStream};

use crate::device::{cuda, Backend, CudaOptions, Device};
use crate::error::{Error, Result};
use crate::stream::Stream;

impl Device {
    /// A CUDA device on a context that a cudarc user made: the context is shared (this device
    /// holds the `Arc`; nothing is retained or created again). Same defaults as
    /// [`Device::cuda`]. See [the design notes](crate::implementation#cudarc) for ownership, ordering
    /// and caveats.
    ///
    /// Errors: [`Error::Driver`] if a driver call fails (loading the crate's kernels in the
    /// context, reading the device's properties).
    pub fn from_cudarc(ctx: StdArc<CudaContext>) -> Result<Device> {
        Self::from_cudarc_with(ctx, CudaOptions::default())
    }

    /// [`from_cudarc`](Self::from_cudarc) with the given options.
    pub fn from_cudarc_with(ctx: StdArc<CudaContext>, options: CudaOptions) -> Result<Device> {
        let backend = cuda::CudaDevice::on_context(cuda::Context::from_cudarc(ctx))?;
        Ok(Self::open_cuda(backend, options))
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

impl Stream {
    /// cudarc's handle of this stream (an `Arc` clone): work queued through it with cudarc
    /// (`launch_builder`, copies) is queued on this very stream, in order with ours, with no
    /// synchronization needed. `None` on the simulated device. The driver's stream lives as
    /// long as any clone does, even after every `Stream` of it is dropped.
    pub fn cudarc_stream(&self) -> Option<StdArc<CudaStream>> {
        self.cudarc_handle().cloned()
    }

    /// A `Stream` of `device` on a stream that cudarc made (`new_stream`, `fork`, ...): the
    /// `Stream` holds the `Arc`, so the driver's stream lives while either side uses it.
    ///
    /// Errors: [`Error::InvalidArgument`] if `device` is simulated, or if `stream` belongs to
    /// another context than the device's (make the device with
    /// [`Device::from_cudarc`] on the stream's context, or use [`Device::cuda`] of the same
    /// GPU: both share the primary context).
    pub fn from_cudarc(device: &Device, stream: StdArc<CudaStream>) -> Result<Stream> {
        let Backend::Cuda(d) = device.backend() else {
            return Err(Error::InvalidArgument {
                what: "a cudarc stream cannot belong to the simulated device",
            });
        };
        if stream.context().cu_ctx() != d.ctx.cudarc().cu_ctx() {
            return Err(Error::InvalidArgument {
                what: "the cudarc stream belongs to another context than the device's",
            });
        }
        device
            .inner
            .streams_created
            .fetch_add(1, crate::sync::Ordering::Relaxed);
        Ok(Stream::on_cudarc(device, stream))
    }
}
