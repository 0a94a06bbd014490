//! cudarc both ways, the stream's side: a [`Stream`] on a cudarc stream, and ours handed to
//! cudarc. The device's side (`Device::from_cudarc`) is `device/cudarc_interop.rs`; the notes
//! are in [the design notes](crate::implementation#cudarc).

use std::sync::Arc as StdArc;

use cudarc::driver::CudaStream;

use crate::device::{Backend, Device};
use crate::error::{Error, Result};
use crate::stream::Stream;

impl Stream {
    /// cudarc's handle of this stream (an `Arc` clone): work queued through it with cudarc
    /// (`launch_builder`, copies) is queued on this very stream, in order with ours, with no
    /// synchronization needed. `None` on the simulated device. The driver's stream lives as
    /// long as any clone does, even after every `Stream` of it is dropped.
    ///
    /// Work queued through cudarc is unseen by this crate, so from the first call on, a pool's
    /// opportunistic reuse asks the driver whether the stream is idle every time instead of
    /// knowing that nothing was queued on it since it last was
    /// ([`PoolOptions::opportunistic_reuse`](crate::PoolOptions::opportunistic_reuse)).
    ///
    /// **Graph capture.** Your cudarc code may capture the stream into a graph. While it does,
    /// [`is_idle`](Self::is_idle) and the pools' idle question read "not idle" without the
    /// `cuStreamQuery` that would spoil the capture, and [`record`](Self::record) queues no
    /// completion write into the graph. Other work of this crate on the stream during the
    /// capture is not supported: an event it records there and then watches or waits on
    /// (`to_host`, a buffer's free ordered after a use on another stream, a pool ordering
    /// another stream after memory freed here) would pull its own streams into your capture,
    /// and the capture would fail to end. Capture work that allocates and frees nothing of
    /// this crate's, or allocate before the capture and free after it.
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
        // `CU_STREAM_PER_THREAD` (cudarc's `per_thread_stream`) names the default stream of
        // whichever thread makes the call: the crate calls the driver from many threads (tokio
        // workers, the reactor, the blocking-work thread), each of which would queue on a
        // stream of its own, and stream order would not hold (a review's finding).
        if stream.cu_stream() as usize == 0x2 {
            return Err(Error::InvalidArgument {
                what: "the per-thread default stream (CU_STREAM_PER_THREAD) is another stream on \
                       every thread; make a stream with `CudaContext::new_stream`",
            });
        }
        device
            .inner
            .streams_created
            .fetch_add(1, crate::sync::Ordering::Relaxed);
        Ok(Stream::on_cudarc(device, stream))
    }
}
