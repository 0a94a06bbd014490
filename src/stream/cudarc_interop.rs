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
    /// **Graph capture.** Your cudarc code may capture the stream into a graph
    /// (`begin_capture` .. `end_capture`, in any mode). Nothing this crate does spoils the
    /// capture or pulls another stream into it (`tests/graph_capture.rs`, on an H100):
    /// - Work queued on the stream through this crate (copies, memsets, the built-in kernels)
    ///   is captured like yours, and runs at each launch of the graph.
    /// - What cannot be done during a capture is refused with
    ///   [`Error::StreamCapturing`](crate::Error::StreamCapturing), and nothing is done:
    ///   [`record`](Self::record) (and what records: `synchronize`, `to_host`, ...),
    ///   [`wait`](Self::wait), [`synchronize_blocking`](Self::synchronize_blocking), and a
    ///   pool's request that would have to order one stream after another through this one
    ///   (memory freed here, asked for on another stream, or the other way round). A buffer
    ///   dropped during the capture with a use recorded on this stream keeps its memory
    ///   (logged), as for any use that cannot be recorded. [`is_idle`](Self::is_idle) reads
    ///   "not idle".
    /// - The crate's allocations and queries (`cuMemAlloc`, `cuStreamQuery`, ...), which the
    ///   driver forbids during a capture (on the capturing thread, or on every thread in global
    ///   mode), run with the calling thread's capture mode relaxed, as PyTorch's allocator does:
    ///   a pool may grow, and other streams go on, while you capture.
    ///
    /// What a capture allocates is yours to keep alive: memory the graph uses must stay
    /// allocated until its last launch has run, and a free on the stream (or any stream)
    /// orders nothing after launches the crate never saw. Allocate before the capture and free
    /// after the graph's last launch, or give the capture a pool of its own (as PyTorch's
    /// graph-private pools): a pool that only the capturing stream uses never needs to order
    /// one stream after another, so its requests during the capture are served from its free
    /// memory or by growing (a pool over `CudaResource`; not over `CudaAsyncResource`, whose
    /// allocations a capture refuses, nor an arena, which records as it grows).
    ///
    /// Capture a stream of your own: everything queued on the stream during the capture is
    /// captured, whoever queues it, so a [`StreamPool`](crate::StreamPool) stream that other
    /// tasks also use would take their work into your graph.
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
