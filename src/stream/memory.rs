//! The device's stream-ordered memory calls: `malloc_async`/`free_async` (the driver's
//! stream-ordered allocator) and `free_after` (a synchronous allocation freed once a stream's
//! queued work has run). Methods of [`Device`], here because they take a [`Stream`]: the device
//! layer below does not name streams.

use crate::device::memory::check_size;
use crate::device::{mismatch, sim, Backend, Device, DevicePtr, FaultKind};
use crate::error::Result;
use crate::stream::{RawStream, Stream};

impl Device {
    /// Frees memory from [`malloc`](Self::malloc) or [`malloc_managed`](Self::malloc_managed)
    /// once the work queued so far on `stream` has run. On CUDA this is `cuMemFree`, which
    /// itself waits for the device's pending work before it frees (so the calling thread may
    /// block); the simulated device queues the free on `stream` instead, so that a use still
    /// queued there does not fault.
    ///
    /// `Err(UnknownPointer)` on the simulated device for a pointer that is not a live
    /// allocation, or whose free is queued already (the driver reports its own error on CUDA).
    ///
    /// # Safety
    /// `ptr` came from `malloc` or `malloc_managed` on this device and is freed once; all work
    /// that uses it is ordered before this point of `stream`.
    pub(crate) unsafe fn free_after(&self, ptr: DevicePtr, stream: &Stream) -> Result<()> {
        self.check_same(stream.device())?;
        match (&self.inner.backend, &*stream.queue_handle()) {
            // cuMemFree "may perform implicit synchronization" (the driver's documentation),
            // which is no promise: the stream is synchronized first (a review's finding), so
            // every use ordered before this point has finished. Off the reactor thread (the
            // callers use `run_blocking`), like cuMemFree itself.
            (Backend::Cuda(d), crate::stream::RawStream::Cuda(s)) => {
                // Not during a user's capture of the stream: illegal, and it would spoil it.
                stream.refuse_while_capturing("freeing with cuMemFree")?;
                d.synchronize_stream(*s)?;
                // SAFETY: the caller's contract; every use of `ptr` was ordered before this
                // point of `stream`, which the host has just seen finish.
                unsafe { d.free(ptr.0) }
            }
            (Backend::Sim(d), crate::stream::RawStream::Sim(s)) => {
                d.fault(FaultKind::Free)?;
                // Marked as being freed now, so that a second free queued before the stream
                // reaches this one is refused here (`begin_free`). A free has no footprint for
                // the race detector to reject, so `push` always queues it, and the stream
                // always ends the mark.
                d.memory.begin_free(ptr.0)?;
                s.push(sim::Op::Free(ptr.0))
            }
            _ => Err(mismatch()),
        }
    }
    /// Allocates `bytes` in stream order from the driver's stream-ordered allocator
    /// (`cuMemAllocFromPoolAsync`), from a pool this device handle owns whose release
    /// threshold is raised so freed memory stays pooled. The memory may be used by work queued
    /// on `stream` after this call, and elsewhere once ordered after it.
    ///
    /// `Err(StreamCapturing)` while your code captures `stream` into a graph (the driver would
    /// make a graph memory node of it, not memory).
    pub fn malloc_async(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        check_size(bytes)?;
        self.check_same(stream.device())?;
        stream.refuse_while_capturing("an allocation from the driver's pool")?;
        match (&self.inner.backend, &*stream.queue_handle()) {
            (Backend::Cuda(d), RawStream::Cuda(s)) => d.malloc_async(bytes, *s),
            (Backend::Sim(d), RawStream::Sim(s)) => d
                .fault(FaultKind::Allocate)
                .and_then(|()| d.malloc_async(bytes, s)),
            _ => Err(mismatch()),
        }
        .map(DevicePtr)
        .map_err(|e| self.oom(bytes, e))
    }

    /// Frees memory from [`malloc_async`](Self::malloc_async) in stream order: it becomes
    /// reusable when `stream` reaches this point. Never blocks.
    ///
    /// `Err(UnknownPointer)` on the simulated device for a pointer that is not a live
    /// allocation, or whose free is queued already (the driver reports its own error on CUDA).
    ///
    /// # Safety
    /// `ptr` came from `malloc_async` on this device and is freed once; all work that uses it
    /// is ordered before this point of `stream`. `Err(StreamCapturing)`, and nothing freed,
    /// while your code captures `stream` into a graph.
    pub unsafe fn free_async(&self, ptr: DevicePtr, stream: &Stream) -> Result<()> {
        self.check_same(stream.device())?;
        stream.refuse_while_capturing("a free into the driver's pool")?;
        match (&self.inner.backend, &*stream.queue_handle()) {
            // SAFETY: the caller's contract.
            (Backend::Cuda(d), RawStream::Cuda(s)) => unsafe { d.free_async(ptr.0, *s) },
            (Backend::Sim(d), RawStream::Sim(s)) => {
                d.fault(FaultKind::Free)?;
                // As in `free_after`: marked now, so that a second free is refused here.
                d.memory.begin_free(ptr.0)?;
                s.push(sim::Op::Free(ptr.0))
            }
            _ => Err(mismatch()),
        }
    }
}
