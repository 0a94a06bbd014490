//! cudarc both ways: a [`Device`] on a cudarc context, a [`Stream`] on a cudarc stream, and
//! ours handed to cudarc, so that a kernel a user loads and launches with cudarc's launch
//! builder runs on our stream, on our buffers, with no host synchronization in between.
//!
//! # Ownership
//!
//! Both sides hold cudarc's own reference-counted handles, so neither can pull a context or a
//! stream from under the other, and no `unsafe` is asked of the user:
//!
//! - **Contexts.** A CUDA [`Device`] always holds its context through cudarc's
//!   `Arc<CudaContext>`: [`Device::cuda`] has cudarc retain the GPU's primary context (the one
//!   `CudaContext::new(ordinal)` gives, so a cudarc user of the same GPU shares it anyway), and
//!   [`Device::from_cudarc`] takes the user's `Arc` (a primary context or one made with
//!   `new_non_primary` / `from_raw_context`) and retains nothing more.
//!   [`Device::cudarc_context`] hands that same `Arc` out. The context is released when the
//!   last holder on either side lets go.
//! - **Streams.** Every CUDA [`Stream`] is a cudarc stream: [`Device::create_stream`] has
//!   cudarc make it (`CudaContext::new_stream`, non-blocking), and [`Stream::from_cudarc`]
//!   adopts the user's. The `Stream` holds cudarc's `Arc<CudaStream>`;
//!   [`Stream::cudarc_stream`] clones it. The driver's stream is destroyed (its queued work
//!   still runs) when the last `Arc` goes, ours or a clone that cudarc code keeps (a
//!   `CudaSlice` allocated on it, say). cudarc's `wrap_borrowed_stream` (0.19.10, cudarc
//!   PR #597), which wraps a handle without owning it and leaves its lifetime to the caller,
//!   is not needed: both sides own.
//!
//! # Ordering (what is safe without synchronizing)
//!
//! Work that cudarc queues on [`Stream::cudarc_stream`] *is* work on our stream: the same
//! driver stream, so stream order holds between our work and cudarc's with nothing in between.
//! Our buffers are cudarc kernel arguments (`PushKernelArg` for `&DeviceBuffer`,
//! `&mut DeviceBuffer`, `&DeviceVec<T>`, `&mut DeviceVec<T>`): memory allocated on a stream may
//! be used by a launch queued on that stream after the allocation, and its free (at the
//! buffer's drop) is queued after the launch. Launching on *another* stream than the buffer's
//! needs what any second stream needs: make it wait for an event of the buffer's stream, and
//! [`DeviceBuffer::record_stream`](crate::DeviceBuffer::record_stream) it, so its free waits
//! for that stream too. cudarc's own event tracking applies to its `CudaSlice`s only; our
//! buffers carry their own.
//!
//! # Caveats
//!
//! - cudarc synchronizes a context (the host waits for it) when the *first* stream of the
//!   context is made through it, if the context tracks events (cudarc's default). For a device
//!   of ours that is at its first `create_stream`; for a shared context with work already
//!   running, the first stream either side makes waits for that work once.
//! - A cudarc stream adopted twice gives two `Stream`s (two ids) on one driver stream. That is
//!   correct, only slower: the pool treats memory freed on one as another stream's and orders
//!   its reuse with an event.
//! - On the simulated device there is no cudarc: these return `None` or an error.

use std::sync::Arc as StdArc;

use cudarc::driver::{CudaContext, CudaStream};

use crate::device::{cuda, Backend, CudaOptions, Device};
use crate::error::{Error, Result};
use crate::stream::Stream;

impl Device {
    /// A CUDA device on a context that a cudarc user made: the context is shared (this device
    /// holds the `Arc`; nothing is retained or created again). Same defaults as
    /// [`Device::cuda`]. See the module `cudarc_interop` for ownership and ordering.
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
