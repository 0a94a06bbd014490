//! `Stream`: an ordered queue of GPU work, with an id that is never reused.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use crate::device::sim::{HostPtr, Op};
pub use crate::device::StreamId;
use crate::device::{cuda, cuda_words, mismatch, sim, Backend, Device, DevicePtr, FaultKind};
use crate::error::{Error, Result};
use crate::event::{Event, RawEvent};
use crate::sync::{Arc, AtomicBool, AtomicU64, AtomicUsize, Mutex, Ordering};

// The pattern kernels (`fill_pattern_u32`, `count_mismatches_u32`), in their own file.
mod pattern;

pub(crate) use self::async_pool::{AsyncPool, AsyncPoolSettings};

mod async_pool;
mod cudarc_interop;
mod memory;
mod sim_hooks;
mod staging;

impl Device {
    /// A new stream on this device (non-blocking with respect to the legacy default stream).
    pub fn create_stream(&self) -> Result<Stream> {
        self.inner.streams_created.fetch_add(1, Ordering::Relaxed);
        Stream::new(self)
    }
}

/// A stream of one device. Cheap to clone; clones are the same stream, which is destroyed when
/// the last clone is dropped. Dropping it with work still queued is safe: the work runs to the
/// end (on CUDA the driver finishes it; on the simulated device the worker drains its queue).
pub struct Stream {
    inner: Arc<StreamInner>,
}

impl Clone for Stream {
    #[inline]
    fn clone(&self) -> Self {
        // Relaxed, as an `Arc`'s own count: a new handle is made from one that exists, so the
        // count cannot reach 0 meanwhile.
        self.inner.users.fetch_add(1, Ordering::Relaxed);
        Stream {
            inner: self.inner.clone(),
        }
    }
}

impl Drop for Stream {
    #[inline]
    fn drop(&mut self) {
        // Release: whatever this handle did (a free queued on the stream) comes before a
        // resource's Acquire read of 0 (`users`), which then lets go of the stream.
        self.inner.users.fetch_sub(1, Ordering::Release);
    }
}

pub(crate) enum RawStream {
    Cuda(cuda::RawStream),
    Sim(Arc<sim::SimStream>),
}

struct StreamInner {
    id: StreamId,
    raw: RawStream,
    /// The next record sequence number; the reactor orders a stream's events by them and asks
    /// the device only about each stream's first, so the numbers must follow the order in which
    /// the records reach the GPU. Locked across the driver's record for that: with the number
    /// taken after the record, two threads recording on one stream could get them the other
    /// way round, and the earlier event's waiters would be woken only once the later one
    /// completes (issue 19).
    seq: Mutex<u64>,
    /// On CUDA, cudarc's handle of the driver's stream, which owns it: made by cudarc for us
    /// (`Device::create_stream`) or given by a cudarc user (`Stream::from_cudarc`). The driver's
    /// stream lives as long as this or any clone that cudarc code holds. `None` on the
    /// simulated device.
    cudarc: Option<std::sync::Arc<cudarc::driver::CudaStream>>,
    /// Cleared when the stream goes (before the reactor is told to forget it), and read by the
    /// reactor through each event recorded on it: a doorbell for an event of a stream already
    /// gone would make the reactor a watcher stream that nobody forgets (a review's finding).
    /// Std's: a hint for what the reactor keeps, with no bearing on what is safe.
    alive: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// On CUDA, this stream's own event for [`Stream::order_before`]: recorded here and waited
    /// on by the later stream under this lock, then left for the next ordering (a wait captures
    /// the recording current when it is enqueued, so re-recording it is safe).
    order_event: Mutex<Option<cuda::RawEvent>>,
    /// How many operations have been queued on the stream through this crate (every access to
    /// its handle for queuing: [`Stream::queue_handle`]). A pool that saw the stream idle
    /// when this read `n`, and reads `n` again, knows that the stream is still idle without
    /// asking the driver ([`Stream::activity`]).
    activity: AtomicU64,
    /// The driver's handle was handed out ([`Stream::cuda_stream`], [`Stream::cudarc_stream`],
    /// or a stream made by cudarc): work may reach the stream unseen, so `activity` says
    /// nothing.
    exposed: AtomicBool,
    /// On CUDA with `CudaOptions::completion_words`, the word the GPU writes right after each
    /// watched event: the count of those written so far (queued under `seq`'s lock, in order).
    word: Option<Arc<cuda_words::Word>>,
    /// The handles that no resource keeps for itself ([`Stream::users`]): every `Stream` counts
    /// one, and a resource's registry of the streams it served
    /// ([`set_kept`](Stream::set_kept)) takes its own back out. The `Arc`'s count could not
    /// say this: two resources on one stream (a pool over a pool, a pool beside an arena) each
    /// counted the other's handle as a user's, and neither ever let go of the stream (a
    /// review's finding).
    users: AtomicUsize,
    /// Tests only: the simulated stream answers as a CUDA stream under a user's graph capture
    /// does ([`Stream::pretend_capture`]). Std's: a test's switch, not a protocol for loom.
    #[cfg(test)]
    pretend_capture: std::sync::atomic::AtomicBool,
    /// Last, so dropped last: where this handle is the device's last, the device's teardown
    /// (off the reactor threads) must come after the word and the cudarc stream above, so
    /// that it holds the last handles on the pages of words (`cuMemFreeHost` blocks) and on
    /// the context. Dropped first, it left them to whichever thread dropped the stream, a
    /// reactor's perhaps, running a deferred free (a review's finding).
    device: Device,
}

/// A stream's handle lent to queue one operation ([`Stream::queue_handle`]); the operation
/// counts as activity when this goes, after it was queued.
pub(crate) struct Queuing<'a>(&'a Stream);

impl std::ops::Deref for Queuing<'_> {
    type Target = RawStream;

    #[inline]
    fn deref(&self) -> &RawStream {
        &self.0.inner.raw
    }
}

impl Drop for Queuing<'_> {
    #[inline]
    fn drop(&mut self) {
        // After the operation was queued, not before: a pool that reads the count before
        // asking whether the stream is idle must not see this operation counted while the
        // driver has not got it yet (the idle answer would not cover it, and the unchanged
        // count would later say nothing was queued since). Relaxed: a pool reads the count
        // under its lock, after a free that the caller made after queuing (program order, or
        // the caller's own synchronization), so the lock's happens-before carries it there.
        self.0.inner.activity.fetch_add(1, Ordering::Relaxed);
    }
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("id", &self.inner.id)
            .field("device", &self.inner.device.id())
            .finish()
    }
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        let event = self.order_event.lock().take();
        if let (Some(event), Backend::Cuda(d)) = (event, self.device.backend()) {
            d.release_event(event);
        }
        // A CUDA stream is destroyed by cudarc when the last `Arc` of its handle goes: ours
        // (the field, after this) or a clone held by cudarc code.
        if let RawStream::Sim(s) = &self.raw {
            s.close();
        }
        self.alive
            .store(false, std::sync::atomic::Ordering::Release);
        // A reactor not started yet has armed nothing for this stream.
        if let Some(reactor) = self.device.started_reactor() {
            reactor.forget_stream(self.id.get());
        }
    }
}

impl Stream {
    pub(crate) fn new(device: &Device) -> Result<Stream> {
        let id = StreamId::next();
        let (raw, cudarc) = match device.backend() {
            Backend::Cuda(d) => {
                let (raw, owner) = d.create_stream()?;
                (RawStream::Cuda(raw), Some(owner))
            }
            Backend::Sim(d) => (RawStream::Sim(d.create_stream(id)?), None),
        };
        Ok(Self::from_parts(id, device, raw, cudarc))
    }

    /// A stream of `device` on a stream that cudarc owns (checked by the caller to belong to
    /// the device's context).
    pub(crate) fn on_cudarc(
        device: &Device,
        stream: std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> Stream {
        let raw = RawStream::Cuda(cuda::Handle(stream.cu_stream()));
        let made = Self::from_parts(StreamId::next(), device, raw, Some(stream));
        // cudarc code may queue work on it that never passes through `queue_handle`.
        made.expose();
        made
    }

    fn from_parts(
        id: StreamId,
        device: &Device,
        raw: RawStream,
        cudarc: Option<std::sync::Arc<cudarc::driver::CudaStream>>,
    ) -> Stream {
        Stream {
            inner: Arc::new(StreamInner {
                id,
                device: device.clone(),
                raw,
                seq: Mutex::new(0),
                order_event: Mutex::new(None),
                cudarc,
                alive: std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true)),
                activity: AtomicU64::new(0),
                exposed: AtomicBool::new(false),
                word: Self::new_word(device),
                users: AtomicUsize::new(1),
                #[cfg(test)]
                pretend_capture: std::sync::atomic::AtomicBool::new(false),
            }),
        }
    }

    /// A completion word for a new stream of `device`, if it has them on; without one (the
    /// driver refused a page) its events are polled through the driver, as they are without
    /// the option.
    fn new_word(device: &Device) -> Option<Arc<cuda_words::Word>> {
        match device.inner.words.as_ref()?.word() {
            Ok(word) => Some(Arc::new(word)),
            Err(e) => {
                tracing::warn!(error = %e, "no completion word for a new stream");
                None
            }
        }
    }

    /// cudarc's handle of this stream, on CUDA (`None` on the simulated device).
    pub(crate) fn cudarc_handle(&self) -> Option<&std::sync::Arc<cudarc::driver::CudaStream>> {
        self.expose();
        self.inner.cudarc.as_ref()
    }

    /// The stream's unique id.
    pub fn id(&self) -> StreamId {
        self.inner.id
    }

    /// The device it belongs to.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// How many handles of this stream exist outside the registries of the resources that
    /// served it (the user's, and those of buffers, events and frees still to come). 0: the
    /// user has dropped the stream, and nothing can queue on it or free on it any more, so a
    /// resource may let go of it. Acquire: pairs with a handle's drop.
    pub(crate) fn users(&self) -> usize {
        self.inner.users.load(Ordering::Acquire)
    }

    /// Takes this handle out of the [`users`](Self::users) (`kept`: a resource keeps it in its
    /// registry of streams) or puts it back (`!kept`: before the kept handle goes). Every
    /// `set_kept(true)` on a handle is matched by a `set_kept(false)` on it before its drop
    /// (the engine's `Kept`), or the count would go wrong.
    pub(crate) fn set_kept(&self, kept: bool) {
        if kept {
            self.inner.users.fetch_sub(1, Ordering::Release);
        } else {
            self.inner.users.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The stream's handle, to queue an operation on it (`&*stream.queue_handle()`, the guard
    /// kept until the operation is queued, as a temporary of the `match` that queues it):
    /// counted as activity when the guard goes (see [`activity`](Self::activity)). Every
    /// operation this crate queues takes the handle here.
    #[inline]
    pub(crate) fn queue_handle(&self) -> Queuing<'_> {
        Queuing(self)
    }

    /// The stream's handle for what queues nothing (the race detector's notes of allocations
    /// and frees, queries).
    #[inline]
    pub(crate) fn raw_unqueued(&self) -> &RawStream {
        &self.inner.raw
    }

    /// How many operations this crate has queued on the stream, or `None` if work may reach it
    /// unseen (its driver handle was handed out). The pool's opportunistic reuse keeps the
    /// count read before an idle answer (`cuStreamQuery`): while it stays the same, nothing was
    /// queued since, the stream is still idle, and no driver call is needed to know it.
    #[inline]
    pub(crate) fn activity(&self) -> Option<u64> {
        if self.inner.exposed.load(Ordering::Relaxed) {
            return None;
        }
        Some(self.inner.activity.load(Ordering::Relaxed))
    }

    /// Whether a stream whose [`activity`](Self::activity) has not changed since it was seen
    /// idle may be taken as still idle: always on CUDA, with no driver call. The simulated
    /// device asks its queue (empty, since nothing was queued), which also tells its race
    /// detector that the crate has seen everything on the stream finish, as the pool's idle
    /// probe does ([`probe_idle`](Self::probe_idle)): the detector counts allocations and frees
    /// noted on the stream as points of it.
    #[inline]
    pub(crate) fn confirm_quiet(&self) -> bool {
        match &self.inner.raw {
            RawStream::Cuda(_) => true,
            RawStream::Sim(s) => s.probe_idle(),
        }
    }

    /// `Err(StreamCapturing)` if the user's code is capturing this stream into a CUDA graph
    /// (through its handle) now. Only a stream whose handle went out can be captured (the
    /// crate never captures), and only such a stream pays for the question
    /// (`cuStreamIsCapturing`, legal during a capture).
    #[inline]
    pub(crate) fn refuse_while_capturing(&self, operation: &'static str) -> Result<()> {
        #[cfg(test)]
        if self.pretending_capture() {
            return Err(crate::Error::StreamCapturing { operation });
        }
        if !self.inner.exposed.load(Ordering::Relaxed) {
            return Ok(());
        }
        match (&self.inner.raw, self.inner.device.backend()) {
            (RawStream::Cuda(s), Backend::Cuda(d)) if d.capturing(*s)? => {
                Err(crate::Error::StreamCapturing { operation })
            }
            _ => Ok(()),
        }
    }

    /// Tests only: from now on (`on`) or no longer, this stream answers as a CUDA stream whose
    /// handle went out and that the user's code captures into a graph: every operation that
    /// [`refuse_while_capturing`](Self::refuse_while_capturing) guards is refused with
    /// `StreamCapturing`, and the crate's idle probes answer "not idle" (as
    /// `CudaDevice::stream_idle` answers a stream that may be captured). The simulated device
    /// has no graph capture of its own; this is the smallest stand-in for one.
    #[cfg(test)]
    pub(crate) fn pretend_capture(&self, on: bool) {
        // Only a stream whose handle went out can be captured: its activity says nothing.
        self.expose();
        (self.inner.pretend_capture).store(on, std::sync::atomic::Ordering::SeqCst);
    }

    /// Tests only: whether [`pretend_capture`](Self::pretend_capture) is on.
    #[cfg(test)]
    pub(crate) fn pretending_capture(&self) -> bool {
        (self.inner.pretend_capture).load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Work may reach the stream without this crate seeing it: [`activity`](Self::activity)
    /// says nothing from now on.
    fn expose(&self) {
        if !self.inner.exposed.load(Ordering::Relaxed) {
            self.inner.exposed.store(true, Ordering::Relaxed);
        }
    }

    /// The driver's handle, for launching your own kernels (e.g. through cudarc) on this
    /// stream; `None` on the simulated device. The handle is valid while this `Stream` lives.
    ///
    /// Work queued through the handle is unseen by this crate, so from the first call on, a
    /// pool's opportunistic reuse asks the driver whether the stream is idle every time
    /// (`cuStreamQuery`) instead of knowing that nothing was queued since it last was. A
    /// stream whose handle went out may be captured into a graph: what the crate does then
    /// is under [`cudarc_stream`](Self::cudarc_stream) ("Graph capture").
    pub fn cuda_stream(&self) -> Option<cudarc::driver::sys::CUstream> {
        self.expose();
        match &self.inner.raw {
            RawStream::Cuda(s) => Some(s.0),
            RawStream::Sim(_) => None,
        }
    }

    /// Records an event at this point of the stream: it completes when the stream gets there.
    /// On CUDA, events come from a per-device free list, so recording does not create one.
    ///
    /// With completion words on (`CudaOptions::completion_words`, the default), the GPU also
    /// writes the count of the stream's watched events so far into the stream's word right
    /// after it: about 1.3 µs more per record on an H100 host, for wake-ups that need no driver
    /// call.
    ///
    /// `Err(StreamCapturing)` while your code captures the stream into a graph (see
    /// [`cudarc_stream`](Self::cudarc_stream)).
    pub fn record(&self) -> Result<Event> {
        self.record_with(true)
    }

    /// An event that neither the reactor nor an awaiting task will poll: one only for another
    /// stream to wait on ([`wait`](Self::wait)), for a blocking synchronization, or queried
    /// now and then (the arena's guards). No completion word is written for it.
    pub(crate) fn record_unwatched(&self) -> Result<Event> {
        self.record_with(false)
    }

    fn record_with(&self, watched: bool) -> Result<Event> {
        // An event recorded into a capture is no point of the stream the host can see: the
        // reactor's `cuEventQuery` of it is illegal, and a stream made to wait on it joins the
        // capture (run150: the capture invalidated, or another stream's work recorded into the
        // user's graph instead of run).
        self.refuse_while_capturing("recording an event")?;
        let device = &self.inner.device;
        // Uncontended unless threads record on this stream at once, when the driver
        // serializes the records anyway.
        let mut next = self.inner.seq.lock();
        let mut word = None;
        let raw = match (&*self.queue_handle(), device.backend()) {
            (RawStream::Cuda(s), Backend::Cuda(d)) => {
                let event = d.record(*s)?;
                // Not captured (refused above), so the word's write runs now, not at each
                // launch of a graph.
                if let Some(w) = self.inner.word.as_ref().filter(|_| watched) {
                    // Without the write the event is polled through the driver: slower to
                    // notice, never wrong.
                    match w.write(*s) {
                        Ok(value) => word = Some((w.clone(), value)),
                        Err(e) => tracing::debug!(error = %e, "completion word not written"),
                    }
                }
                RawEvent::Cuda(event)
            }
            (RawStream::Sim(s), Backend::Sim(d)) => {
                d.fault(FaultKind::Record)?;
                RawEvent::Sim(d.record(s)?)
            }
            _ => return Err(mismatch()),
        };
        #[cfg(all(test, not(streamalloc_loom)))]
        tests::after_raw_record();
        let seq = *next;
        *next += 1;
        drop(next);
        Ok(Event::new(
            device.clone(),
            (self.inner.id, self.inner.alive.clone()),
            seq,
            raw,
            word,
        ))
    }

    /// Whether all work queued on this stream so far has completed (`cuStreamQuery`); the host
    /// does not wait. `true` means what [`synchronize_blocking`](Self::synchronize_blocking)
    /// returning means: memory that work used may be reused anywhere. A stream being captured
    /// into a graph (through its cudarc handle) reads `false`, without the `cuStreamQuery` that
    /// would invalidate the capture.
    ///
    /// ```
    /// # use streamalloc::{Device, SimConfig};
    /// let device = Device::simulated(SimConfig::default());
    /// let stream = device.create_stream()?;
    /// stream.synchronize_blocking()?;
    /// assert!(stream.is_idle()?);
    /// # Ok::<(), streamalloc::Error>(())
    /// ```
    pub fn is_idle(&self) -> Result<bool> {
        #[cfg(test)]
        if self.pretending_capture() {
            return Ok(false);
        }
        match (&self.inner.raw, self.inner.device.backend()) {
            (RawStream::Cuda(s), Backend::Cuda(d)) => {
                d.stream_idle(*s, self.inner.exposed.load(Ordering::Relaxed))
            }
            (RawStream::Sim(s), Backend::Sim(d)) => {
                d.fault(FaultKind::Query)?;
                Ok(s.idle())
            }
            _ => Err(mismatch()),
        }
    }

    /// Makes work queued on `later` from now on wait for all work queued on this stream so far
    /// (the host does not wait): [`record`](Self::record) then [`wait`](Self::wait), but on
    /// CUDA with this stream's own reusable event, so that the pool's cross-stream orderings
    /// cost two driver calls and no event object.
    pub(crate) fn order_before(&self, later: &Stream) -> Result<()> {
        // Neither end may be under a capture: a record there is captured, and a captured wait
        // for an event recorded outside it invalidates the capture (run150).
        self.refuse_while_capturing("ordering another stream after this one")?;
        later.refuse_while_capturing("waiting for another stream")?;
        let device = &self.inner.device;
        match (
            &*self.queue_handle(),
            &*later.queue_handle(),
            device.backend(),
        ) {
            (RawStream::Cuda(s), RawStream::Cuda(l), Backend::Cuda(d))
                if later.inner.device.id() == device.id() =>
            {
                // Held from the record to the wait: another thread's record in between would
                // only make ours wait for more, but the event must not go back to the device
                // while in use.
                let mut slot = self.inner.order_event.lock();
                let event = match *slot {
                    Some(event) => {
                        d.record_into(event, *s)?;
                        event
                    }
                    None => *slot.insert(d.record(*s)?),
                };
                d.wait(*l, event)
            }
            _ => self.record_unwatched().and_then(|event| later.wait(&event)),
        }
    }

    /// Makes work queued on this stream after this call wait until `event` completes. The host
    /// does not wait. The event may be of another device (CUDA allows it, and so do simulated
    /// devices among themselves); `Err(WrongDevice)` for an event of a simulated device on a
    /// GPU's stream or the other way round; `Err(StreamCapturing)` while your code captures
    /// this stream into a graph (a captured wait for an event recorded outside the capture
    /// would invalidate it).
    pub fn wait(&self, event: &Event) -> Result<()> {
        self.inner.device.check_peer(event.device())?;
        // A captured wait for an event recorded outside the capture invalidates it (run150:
        // `cuStreamWaitEvent` answered CUDA_ERROR_STREAM_CAPTURE_INVALIDATED).
        self.refuse_while_capturing("waiting for an event")?;
        match (
            &*self.queue_handle(),
            event.raw(),
            self.inner.device.backend(),
        ) {
            (RawStream::Cuda(s), RawEvent::Cuda(e), Backend::Cuda(d)) => d.wait(*s, *e),
            (RawStream::Sim(s), RawEvent::Sim(m), Backend::Sim(d)) => {
                d.fault(FaultKind::Wait)?;
                if d.fault(FaultKind::SkipWait).is_err() {
                    // A planted bug (see `FaultKind::SkipWait`): the wait is lost.
                    return Ok(());
                }
                s.push(Op::Wait(m.clone()))
            }
            _ => Err(mismatch()),
        }
    }

    /// Waits, as a future, until all work queued before this call has run. No thread is
    /// parked. The point waited for is taken here, not at the first poll: work queued between
    /// this call and the `.await` is not waited for. A failed record is the future's result.
    ///
    /// # Cancel safety
    /// Cancel-safe: dropping the future stops waiting; the event recorded by the call stays on
    /// the stream, where it orders nothing.
    pub fn synchronize(&self) -> impl Future<Output = Result<()>> + Send + 'static {
        // Recorded now, not in an `async` body (which would run only at the first poll, and
        // then cover work queued after the call: a review's finding).
        let event = self.record();
        async move { event?.await }
    }

    /// Blocks the calling thread until all work queued so far has run. For synchronous code;
    /// in async code use [`synchronize`](Self::synchronize). `Err(StreamCapturing)` while
    /// your code captures the stream into a graph.
    pub fn synchronize_blocking(&self) -> Result<()> {
        // `cuStreamSynchronize` of a capturing stream is illegal and invalidates the capture;
        // its captured work runs only when the graph is launched.
        self.refuse_while_capturing("a blocking synchronization")?;
        match (&self.inner.raw, self.inner.device.backend()) {
            (RawStream::Cuda(s), Backend::Cuda(d)) => d.synchronize_stream(*s),
            (RawStream::Sim(s), Backend::Sim(d)) => {
                d.fault(FaultKind::Synchronize)?;
                // A marker of its own, not `self.record()`: `cuStreamSynchronize` records no
                // event on a GPU, so a fault planted for the next `cuEventRecord` must neither
                // fail this call nor be used up by it (a review found both). The marker is
                // queued (counted as activity, as a record was); `wait` is the host seeing the
                // stream's work complete, as for a synchronized event.
                let queued = self.queue_handle();
                let marker = d.record(s);
                drop(queued);
                marker?.wait()
            }
            _ => Err(mismatch()),
        }
    }

    /// Queues a kernel that keeps the stream busy for `duration` of GPU time and touches no
    /// memory: for tests and benchmarks that need work in flight.
    pub fn spin(&self, duration: Duration) -> Result<()> {
        self.enqueue(
            FaultKind::Launch,
            |d, s| d.spin(duration, s),
            || Op::Spin(duration),
        )
    }

    /// Runs the CUDA or the simulated form of one operation.
    fn enqueue(
        &self,
        kind: FaultKind,
        cuda: impl FnOnce(&cuda::CudaDevice, cuda::RawStream) -> Result<()>,
        sim: impl FnOnce() -> Op,
    ) -> Result<()> {
        match (&*self.queue_handle(), self.inner.device.backend()) {
            (RawStream::Cuda(s), Backend::Cuda(d)) => cuda(d, *s),
            (RawStream::Sim(s), Backend::Sim(d)) => {
                d.fault(kind)?;
                s.push(sim())
            }
            _ => Err(mismatch()),
        }
    }

    // ===== memory operations on raw pointers =====
    //
    // The safe, owning forms are the buffers' methods; these are what they are built on.

    /// Sets `bytes` bytes at `dst` to `value`.
    ///
    /// A range that wraps past the top of the address space is refused with
    /// [`Error::InvalidAddress`] (nothing is queued).
    ///
    /// # Safety
    /// `[dst, dst + bytes)` is live device memory of this device, and stays so until the stream
    /// reaches this operation.
    pub unsafe fn memset_d8(&self, dst: DevicePtr, value: u8, bytes: usize) -> Result<()> {
        check_range(dst, bytes)?;
        // SAFETY: the caller's contract.
        self.enqueue(
            FaultKind::Copy,
            |d, s| unsafe { d.memset_d8(dst.0, value, bytes, s) },
            || Op::Memset8 {
                dst: dst.0,
                value,
                bytes,
            },
        )
    }

    /// Sets `count` 32-bit words at `dst` to `value`.
    ///
    /// A range that wraps past the top of the address space is refused with
    /// [`Error::InvalidAddress`] (nothing is queued).
    ///
    /// # Safety
    /// `[dst, dst + 4 * count)` is live, 4-aligned device memory, until the stream reaches this.
    pub unsafe fn memset_d32(&self, dst: DevicePtr, value: u32, count: usize) -> Result<()> {
        check_word_range(dst, count)?;
        // SAFETY: the caller's contract.
        self.enqueue(
            FaultKind::Copy,
            |d, s| unsafe { d.memset_d32(dst.0, value, count, s) },
            || Op::Memset32 {
                dst: dst.0,
                value,
                count,
            },
        )
    }

    /// Copies `bytes` bytes from host memory to the device.
    ///
    /// On CUDA, from ordinary (pageable) host memory the driver stages the data before it
    /// returns, and may first wait for work already queued on the stream: the call can block.
    /// From page-locked memory it returns at once.
    ///
    /// A device range that wraps past the top of the address space is refused with
    /// [`Error::InvalidAddress`], a host range that wraps with [`Error::InvalidArgument`]
    /// (nothing is queued).
    ///
    /// # Safety
    /// `src` is readable for `bytes` bytes and stays valid and unchanged until the stream
    /// reaches this copy; `[dst, dst + bytes)` is live device memory until then.
    pub unsafe fn copy_htod(&self, dst: DevicePtr, src: *const u8, bytes: usize) -> Result<()> {
        check_range(dst, bytes)?;
        check_host_range(src, bytes)?;
        // SAFETY: the caller's contract.
        self.enqueue(
            FaultKind::Copy,
            |d, s| unsafe { d.copy_htod(dst.0, src, bytes, s) },
            || Op::HtoD {
                dst: dst.0,
                src: HostPtr(src as *mut u8),
                bytes,
            },
        )
    }

    /// Copies `bytes` bytes from the device to host memory.
    ///
    /// On CUDA, into ordinary (pageable) host memory the driver returns only once the copy has
    /// run, so the calling thread blocks behind everything queued before it on the stream
    /// (measured on an H200: 50.6 ms behind a 50 ms kernel). Into page-locked memory it returns
    /// at once. In async code, await an event recorded before the copy, or use page-locked
    /// memory.
    ///
    /// A device range that wraps past the top of the address space is refused with
    /// [`Error::InvalidAddress`], a host range that wraps with [`Error::InvalidArgument`]
    /// (nothing is queued).
    ///
    /// # Safety
    /// `dst` is writable for `bytes` bytes, and nothing else reads or writes it until the
    /// stream reaches this copy; `[src, src + bytes)` is live device memory until then.
    pub unsafe fn copy_dtoh(&self, dst: *mut u8, src: DevicePtr, bytes: usize) -> Result<()> {
        check_range(src, bytes)?;
        check_host_range(dst, bytes)?;
        // SAFETY: the caller's contract.
        self.enqueue(
            FaultKind::Copy,
            |d, s| unsafe { d.copy_dtoh(dst, src.0, bytes, s) },
            || Op::DtoH {
                dst: HostPtr(dst),
                src: src.0,
                bytes,
            },
        )
    }

    /// Copies `bytes` bytes between two device ranges.
    ///
    /// A range that wraps past the top of the address space is refused with
    /// [`Error::InvalidAddress`] (nothing is queued).
    ///
    /// # Safety
    /// Both ranges are live device memory of this device until the stream reaches the copy.
    pub unsafe fn copy_dtod(&self, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<()> {
        check_range(dst, bytes)?;
        check_range(src, bytes)?;
        // SAFETY: the caller's contract.
        self.enqueue(
            FaultKind::Copy,
            |d, s| unsafe { d.copy_dtod(dst.0, src.0, bytes, s) },
            || Op::DtoD {
                dst: dst.0,
                src: src.0,
                bytes,
            },
        )
    }

    /// Copies `bytes` bytes from `src`, memory of `src_device`, to `dst`, memory of this
    /// stream's device, in this stream's order (`cuMemcpyPeerAsync`; no peer access needed).
    /// `src_device` may be this device too. The safe form is
    /// [`DeviceBuffer::try_clone_to`](crate::DeviceBuffer::try_clone_to) with a resource of the
    /// other device.
    ///
    /// Errors: `WrongDevice` for a simulated device and a GPU.
    ///
    /// A range that wraps past the top of the address space is refused with
    /// [`Error::InvalidAddress`] (nothing is queued).
    ///
    /// # Safety
    /// Both ranges are live memory of their devices until the stream reaches the copy, and the
    /// work that writes the source (on any device) is ordered before this point of the stream
    /// (an event of the source's stream waited for with [`wait`](Self::wait)).
    pub unsafe fn copy_peer(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        src_device: &Device,
        bytes: usize,
    ) -> Result<()> {
        let device = &self.inner.device;
        device.check_peer(src_device)?;
        if device.id() == src_device.id() {
            // SAFETY: the caller's contract. (`copy_dtod` checks the ranges.)
            return unsafe { self.copy_dtod(dst, src, bytes) };
        }
        check_range(dst, bytes)?;
        check_range(src, bytes)?;
        match (
            &*self.queue_handle(),
            device.backend(),
            src_device.backend(),
        ) {
            (RawStream::Cuda(s), Backend::Cuda(d), Backend::Cuda(from)) => {
                // SAFETY: the caller's contract.
                unsafe { d.copy_peer(dst.0, from, src.0, bytes, *s) }
            }
            (RawStream::Sim(s), Backend::Sim(d), Backend::Sim(from)) => {
                d.fault(FaultKind::Copy)?;
                s.push(Op::CopyPeer {
                    dst: dst.0,
                    from: from.memory.clone(),
                    src: src.0,
                    bytes,
                })
            }
            _ => Err(mismatch()),
        }
    }

    /// Migrates managed memory to this stream's device ahead of use (`cuMemPrefetchAsync`), in
    /// stream order; the host does not wait. A hint: the memory is usable without it. The
    /// simulated device has no separate memories and moves nothing, but refuses memory it
    /// knows is not managed, as the driver does.
    ///
    /// A range that wraps past the top of the address space is refused with
    /// [`Error::InvalidAddress`] (nothing is queued).
    ///
    /// # Safety
    /// `[ptr, ptr + bytes)` is managed memory of this device that stays allocated until the
    /// stream reaches the prefetch.
    pub unsafe fn prefetch(&self, ptr: DevicePtr, bytes: usize) -> Result<()> {
        check_range(ptr, bytes)?;
        match (&*self.queue_handle(), self.inner.device.backend()) {
            // SAFETY: the caller's contract.
            (RawStream::Cuda(s), Backend::Cuda(d)) => unsafe { d.prefetch(ptr.0, bytes, *s) },
            (RawStream::Sim(_), Backend::Sim(d)) => d.prefetch(ptr.0, bytes),
            _ => Err(mismatch()),
        }
    }

    /// Built-in kernel: writes `value` to `count` 32-bit words at `dst` (an `f32` fill is
    /// `value.to_bits()`).
    ///
    /// A range that wraps past the top of the address space is refused with
    /// [`Error::InvalidAddress`] (nothing is queued).
    ///
    /// # Safety
    /// `[dst, dst + 4 * count)` is live, 4-aligned device memory until the stream reaches this.
    pub unsafe fn fill_u32(&self, dst: DevicePtr, value: u32, count: usize) -> Result<()> {
        check_word_range(dst, count)?;
        if count == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract.
        self.enqueue(
            FaultKind::Launch,
            |d, s| unsafe { d.fill_u32(dst.0, value, count, s) },
            || Op::FillU32 {
                dst: dst.0,
                value,
                count,
            },
        )
    }

    /// Built-in kernel: multiplies `count` `f32`s at `dst` by `factor`, in place.
    ///
    /// A range that wraps past the top of the address space is refused with
    /// [`Error::InvalidAddress`] (nothing is queued).
    ///
    /// # Safety
    /// `[dst, dst + 4 * count)` is live, 4-aligned device memory until the stream reaches this.
    pub unsafe fn scale_f32(&self, dst: DevicePtr, factor: f32, count: usize) -> Result<()> {
        check_word_range(dst, count)?;
        if count == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract.
        self.enqueue(
            FaultKind::Launch,
            |d, s| unsafe { d.scale_f32(dst.0, factor, count, s) },
            || Op::ScaleF32 {
                dst: dst.0,
                factor,
                count,
            },
        )
    }
}

/// A count of 32-bit words whose byte size fits in `usize`.
fn check_words(count: usize) -> Result<()> {
    count.checked_mul(4).map(|_| ()).ok_or(Error::InvalidSize {
        size: count,
        reason: "the word count overflows usize when multiplied by 4",
    })
}

/// A device range `[ptr, ptr + bytes)` whose end does not wrap past the top of the address
/// space (zero bytes are no memory, at any address). No allocation can hold a wrapping range,
/// so it is refused at the call with `InvalidAddress`, on both devices alike: queued, the
/// simulated stream failed when it reached it (poisoning every later event of the stream), and
/// a GPU's driver or kernel was handed a range that wraps (a kernel's access there faults, a
/// sticky error that ends the context). Cheap; the rest of a range's validity stays the
/// caller's contract.
fn check_range(ptr: DevicePtr, bytes: usize) -> Result<()> {
    match bytes == 0 || ptr.0.checked_add(bytes as u64).is_some() {
        true => Ok(()),
        false => Err(Error::InvalidAddress { ptr: ptr.0, bytes }),
    }
}

/// As [`check_range`], for `count` 32-bit words (their byte size checked first).
fn check_word_range(ptr: DevicePtr, count: usize) -> Result<()> {
    check_words(count)?;
    check_range(ptr, count * 4)
}

/// A host range of `bytes` bytes at `ptr` that does not wrap past the end of the address space
/// (what no host memory can be: refused, as a device range is by [`check_range`]).
fn check_host_range(ptr: *const u8, bytes: usize) -> Result<()> {
    match bytes == 0 || (ptr as usize).checked_add(bytes).is_some() {
        true => Ok(()),
        false => Err(Error::InvalidArgument {
            what: "the host range wraps past the end of the address space",
        }),
    }
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use std::cell::RefCell;
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::mpsc;
    use std::sync::Mutex;
    use std::task::{Context, Poll, Wake, Waker};
    use std::time::Duration;

    use crate::{Device, SimConfig};

    thread_local! {
        /// Runs inside `Stream::record` between the driver's record and the sequence number.
        static AFTER_RAW_RECORD: RefCell<Option<Box<dyn FnMut()>>> = RefCell::new(None);
    }

    /// The test seam `Stream::record` calls (only in this crate's unit tests).
    pub(super) fn after_raw_record() {
        AFTER_RAW_RECORD.with(|hook| {
            if let Some(hook) = hook.borrow_mut().as_mut() {
                hook();
            }
        });
    }

    struct ChannelWaker(Mutex<mpsc::Sender<()>>);

    impl Wake for ChannelWaker {
        fn wake(self: std::sync::Arc<Self>) {
            let _ = self.0.lock().unwrap_or_else(|e| e.into_inner()).send(());
        }
    }

    /// An event says whether its stream still exists: the CUDA doorbells keep no watcher
    /// stream for the events of a stream that is gone (one would outlive the reactor's
    /// `forget` of it: a review found one driver stream lost per stream dropped with an event
    /// pending).
    #[test]
    fn an_event_knows_when_its_stream_is_gone() {
        let device = Device::simulated(SimConfig::default());
        let stream = device.create_stream().unwrap();
        let event = stream.record().unwrap();
        let clone = stream.clone();
        drop(stream);
        assert!(event.stream_alive(), "a clone still holds the stream");
        drop(clone);
        assert!(!event.stream_alive(), "the stream is gone");
    }

    /// Two threads record on one stream: thread 1's event is recorded first on the GPU, but
    /// thread 2 takes its sequence number first (it records while thread 1 is between the
    /// driver's record and its own number). The reactor orders a stream's events by number and
    /// asks the device only about the head, so with inverted numbers thread 1's event, reached
    /// long before, would wait behind thread 2's, which is queued after a minute of GPU work.
    /// Record order and number order must agree: thread 1's waiter is woken when its event is
    /// reached.
    #[test]
    fn sequence_numbers_follow_the_gpu_order_of_records() {
        const HANG: Duration = Duration::from_secs(20);
        let device = Device::simulated(SimConfig::default());
        let stream = device.create_stream().unwrap();
        // Keeps the GPU from reaching thread 1's event before it is awaited.
        stream.spin(Duration::from_millis(500)).unwrap();

        let (recorded_tx, recorded) = mpsc::channel();
        let (go_tx, go) = mpsc::channel::<()>();
        let first = {
            let stream = stream.clone();
            std::thread::spawn(move || {
                AFTER_RAW_RECORD.with(|hook| {
                    *hook.borrow_mut() = Some(Box::new(move || {
                        let _ = recorded_tx.send(());
                        // Wait for thread 2's record; with record and number taken atomically,
                        // thread 2 is blocked until this one is done, hence the bound.
                        let _ = go.recv_timeout(Duration::from_millis(300));
                    }));
                });
                let event = stream.record().unwrap();
                AFTER_RAW_RECORD.with(|hook| hook.borrow_mut().take());
                event
            })
        };
        recorded.recv().unwrap();
        // Thread 2 (this one): a minute of GPU work, then an event, behind thread 1's.
        stream.spin(Duration::from_secs(60)).unwrap();
        let mut second = stream.record().unwrap();
        let _ = go_tx.send(());
        let mut first = first.join().unwrap();

        let (tx, woken) = mpsc::channel();
        let waker = Waker::from(std::sync::Arc::new(ChannelWaker(Mutex::new(tx))));
        let mut cx = Context::from_waker(&waker);
        // Both events are watched by the reactor.
        assert!(Pin::new(&mut second).poll(&mut cx).is_pending());
        let mut ready = false;
        for _ in 0..10 {
            if let Poll::Ready(result) = Pin::new(&mut first).poll(&mut cx) {
                result.unwrap();
                ready = true;
                break;
            }
            if woken.recv_timeout(HANG).is_err() {
                break;
            }
        }
        assert!(
            ready,
            "the first recorded event was not woken when the GPU reached it: it waits behind \
             a later event of its stream"
        );
    }

    /// Every operation queued counts as activity, a question does not, and once the driver's
    /// handle is handed out the count says nothing (work may come through it unseen).
    #[test]
    fn activity_counts_what_is_queued_until_the_handle_is_handed_out() {
        let device = Device::simulated(SimConfig::default());
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let start = a.activity().unwrap();
        a.spin(Duration::from_micros(1)).unwrap();
        let event = a.record().unwrap();
        assert_eq!(a.activity(), Some(start + 2));
        b.wait(&event).unwrap();
        let before = (a.activity().unwrap(), b.activity().unwrap());
        a.order_before(&b).unwrap();
        assert!(a.activity().unwrap() > before.0 && b.activity().unwrap() > before.1);
        a.synchronize_blocking().unwrap();
        let settled = a.activity().unwrap();
        assert!(a.is_idle().unwrap());
        assert_eq!(a.activity(), Some(settled), "a question is no activity");
        // SAFETY: not used: only handed out.
        let _ = a.cuda_stream();
        assert_eq!(a.activity(), None);
        assert!(b.activity().is_some());
    }
}
