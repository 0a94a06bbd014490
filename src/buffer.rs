//! `DeviceBuffer`: untyped device memory from a resource, freed in stream order when dropped.

use std::fmt;
use std::time::Duration;

use crate::completion::Callback;
use crate::device::DevicePtr;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::resource::{AllocateAsync, AsResourceRef, ResourceRef};
use crate::stream::Stream;
use crate::sync::{Arc, AtomicUsize, Mutex, Ordering};

/// Device memory of `len()` bytes from a [`MemoryResource`](crate::MemoryResource), used on a
/// stream (RMM's `device_buffer`).
///
/// - It remembers the stream it is used on ([`stream`](Self::stream),
///   [`set_stream`](Self::set_stream)); [`record_stream`](Self::record_stream) marks a use on
///   another one (PyTorch's `record_stream`).
/// - Dropping it never blocks the host and never loses memory: with no other stream recorded,
///   the memory goes back to its resource at once, in stream order on its stream; with other
///   streams recorded, an event is recorded on each and the memory goes back (on its stream)
///   once they have all completed, through the device's completion reactor. Either way it goes
///   back exactly once, whatever the order of drops, streams and threads.
/// - It keeps its resource alive (a [`ResourceRef`]).
pub struct DeviceBuffer {
    ptr: DevicePtr,
    len: usize,
    resource: ResourceRef,
    stream: Stream,
    /// Other streams that used the memory (each once); the free waits for each. Behind a lock
    /// so that `&self` methods that queue work on another stream (`DeviceVec::to_host`, the
    /// copies) can add theirs: a use is added *before* its work is queued, so a drop that
    /// follows (which needs the borrow to have ended) always sees it.
    uses: Mutex<Vec<Stream>>,
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("stream", &self.stream.id())
            .field(
                "uses",
                &self.uses.lock().iter().map(|s| s.id()).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl DeviceBuffer {
    /// Allocates `bytes` from `resource` for use on `stream`. Fails at once when memory is
    /// short ([`Error::OutOfMemory`]); [`alloc`](Self::alloc) waits instead.
    pub fn new(resource: &impl AsResourceRef, bytes: usize, stream: &Stream) -> Result<Self> {
        let resource = resource.resource_ref();
        check_device(&resource, stream)?;
        let ptr = resource.allocate(bytes, stream)?;
        Ok(Self::from_parts(ptr, bytes, resource, stream))
    }

    /// Allocates `bytes` from `resource` for use on `stream`, waiting (as a future) while the
    /// resource is out of memory but can get memory back; see
    /// [`allocate_async`](AllocateAsync::allocate_async).
    ///
    /// # Cancel safety
    /// Cancel-safe: a dropped future leaves the queue and has allocated nothing.
    pub async fn alloc(
        resource: &impl AsResourceRef,
        bytes: usize,
        stream: &Stream,
    ) -> Result<Self> {
        Self::alloc_inner(resource.resource_ref(), bytes, stream, None).await
    }

    /// [`alloc`](Self::alloc), giving up with [`Error::Timeout`] after `limit`.
    pub async fn alloc_timeout(
        resource: &impl AsResourceRef,
        bytes: usize,
        stream: &Stream,
        limit: Duration,
    ) -> Result<Self> {
        Self::alloc_inner(resource.resource_ref(), bytes, stream, Some(limit)).await
    }

    async fn alloc_inner(
        resource: ResourceRef,
        bytes: usize,
        stream: &Stream,
        limit: Option<Duration>,
    ) -> Result<Self> {
        check_device(&resource, stream)?;
        let wait = resource.allocate_async(bytes, stream);
        let ptr = match limit {
            Some(limit) => wait.timeout(limit).await?,
            None => wait.await?,
        };
        Ok(Self::from_parts(ptr, bytes, resource, stream))
    }

    /// Memory from the device's current resource
    /// ([`current_resource`](crate::resource::current_resource): a `CudaResource` unless set).
    pub fn with_current_resource(bytes: usize, stream: &Stream) -> Result<Self> {
        Self::new(
            &crate::resource::current_resource(stream.device()),
            bytes,
            stream,
        )
    }

    fn from_parts(ptr: DevicePtr, len: usize, resource: ResourceRef, stream: &Stream) -> Self {
        Self {
            ptr,
            len,
            resource,
            stream: stream.clone(),
            uses: Mutex::new(Vec::new()),
        }
    }

    /// Takes ownership of memory allocated from `resource` on `stream`.
    ///
    /// # Safety
    /// `ptr` came from `resource.allocate(len, stream)` and nothing else will free it.
    pub unsafe fn from_raw_parts(
        ptr: DevicePtr,
        len: usize,
        resource: ResourceRef,
        stream: &Stream,
    ) -> Self {
        Self::from_parts(ptr, len, resource, stream)
    }

    /// Gives up ownership without freeing: `(ptr, len, resource, stream)`. Other streams
    /// recorded with `record_stream` (or used by a copy) are ordered into `stream` first
    /// (GPU-side), so freeing on it later is safe.
    ///
    /// On error (an event could not be recorded on another stream, or `stream` could not be
    /// made to wait for it) the buffer is dropped as [`drop`](Drop) drops it: its free still
    /// waits for every stream that used it, so nothing is lost and stream order holds.
    pub fn into_raw_parts(self) -> Result<(DevicePtr, usize, ResourceRef, Stream)> {
        // Not taken out of the buffer before the loop: if any step fails, the buffer's drop
        // still sees every use and orders the free after each.
        let uses = self.uses.lock().clone();
        for other in &uses {
            self.stream.wait(&other.record()?)?;
        }
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped, so each field is moved out exactly once (the
        // `Copy` ones are copied); the list of uses is dropped here, its streams now ordered
        // before `stream`.
        unsafe {
            drop(std::ptr::read(&this.uses));
            Ok((
                this.ptr,
                this.len,
                std::ptr::read(&this.resource),
                std::ptr::read(&this.stream),
            ))
        }
    }

    /// The device address (null for zero bytes).
    pub fn as_ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for zero bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The stream it is used on: where it was allocated, or set since.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Moves the buffer to `stream`: later work uses it there, and it is freed there. The
    /// caller orders `stream` after work already queued on the old one (or records the old one
    /// with `record_stream`, which this does for you).
    pub fn set_stream(&mut self, stream: &Stream) -> Result<()> {
        check_device(&self.resource, stream)?;
        if stream.id() != self.stream.id() {
            let old = std::mem::replace(&mut self.stream, stream.clone());
            self.add_use(old);
        }
        Ok(())
    }

    /// Marks a use on `other`: the free waits for the work queued on `other` up to the drop,
    /// as PyTorch's `record_stream`. Cheap: the event is recorded only at drop.
    pub fn record_stream(&mut self, other: &Stream) -> Result<()> {
        check_device(&self.resource, other)?;
        if other.id() != self.stream.id() {
            self.add_use(other.clone());
        }
        Ok(())
    }

    fn add_use(&self, other: Stream) {
        let mut uses = self.uses.lock();
        if !uses.iter().any(|s| s.id() == other.id()) {
            uses.push(other);
        }
    }

    /// Prepares a use of the memory by work queued on `other` from here on, for methods that
    /// take `&self`: checks the device, and for a stream other than the buffer's own, records
    /// it as a use (so the free waits for it, whatever becomes of the work queued there) and
    /// orders `other` after the work queued on the buffer's stream so far (GPU-side).
    ///
    /// The use is recorded before anything can fail, so a caller that then queues nothing
    /// costs only a later event at drop.
    pub(crate) fn use_on(&self, other: &Stream) -> Result<()> {
        check_device(&self.resource, other)?;
        if other.id() != self.stream.id() {
            self.add_use(other.clone());
            other.wait(&self.stream.record()?)?;
        }
        Ok(())
    }

    /// The resource it came from.
    pub fn resource(&self) -> &ResourceRef {
        &self.resource
    }

    /// Resizes to `bytes`, keeping the first `min(old, new)` bytes (copied on its stream); the
    /// old memory is freed as a drop frees it.
    pub fn resize(&mut self, bytes: usize) -> Result<()> {
        if bytes == self.len {
            return Ok(());
        }
        let ptr = self.resource.allocate(bytes, &self.stream)?;
        let keep = bytes.min(self.len);
        if keep > 0 {
            // SAFETY: both ranges are live allocations of at least `keep` bytes, used in order
            // on this stream; the old one is freed after this copy in stream order.
            if let Err(e) = unsafe { self.stream.copy_dtod(ptr, self.ptr, keep) } {
                // SAFETY: just allocated on this stream, never used.
                let _ = unsafe { self.resource.deallocate(ptr, bytes, &self.stream) };
                return Err(e);
            }
        }
        let new = Self::from_parts(ptr, bytes, self.resource.clone(), &self.stream);
        drop(std::mem::replace(self, new));
        Ok(())
    }

    /// A copy of the contents in new memory from the same resource, on `stream`'s order.
    pub fn try_clone(&self) -> Result<Self> {
        let copy = Self::new(&self.resource, self.len, &self.stream)?;
        if self.len > 0 {
            // SAFETY: both are live buffers of `len` bytes used in order on this stream.
            unsafe { self.stream.copy_dtod(copy.ptr, self.ptr, self.len) }?;
        }
        Ok(copy)
    }

    /// Sets every byte to `value`, on the buffer's stream.
    pub fn memset(&mut self, value: u8) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        // SAFETY: `len` live bytes, used in order on the buffer's stream.
        unsafe { self.stream.memset_d8(self.ptr, value, self.len) }
    }

    /// Copies `data` (exactly `len()` bytes) to the device, on the buffer's stream. Never blocks
    /// on the GPU: the bytes go through a page-locked staging block that returns to the device's
    /// cache once the copy has run.
    pub fn copy_from_host(&mut self, data: &[u8]) -> Result<()> {
        if data.len() != self.len {
            return Err(Error::InvalidSize {
                size: data.len(),
                reason: "copy_from_host needs exactly the buffer's length",
            });
        }
        copy_in(&self.stream, self.ptr, data)
    }

    /// The contents, copied to the host after the work queued on the buffer's stream so far.
    /// The task waits by `.await`; no thread blocks.
    ///
    /// # Cancel safety
    /// Cancel-safe: the staging block of a dropped future returns to the cache only once the
    /// copy into it has run.
    pub async fn to_host(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.len];
        copy_out(&self.stream, self.ptr, &mut out).await?;
        Ok(out)
    }
}

fn check_device(resource: &ResourceRef, stream: &Stream) -> Result<()> {
    resource.device().check_same(stream.device())
}

/// Stages `data` and queues its copy to `dst` on `stream`. Never blocks on the GPU.
///
/// On error the copy may or may not have been queued (the event after it could not be
/// recorded): the destination's contents are then unspecified, and the staging block goes back
/// to the cache only behind a later event of `stream` (`Device::return_staging_after_queued`).
pub(crate) fn copy_in(stream: &Stream, dst: DevicePtr, data: &[u8]) -> Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    let device = stream.device();
    let block = device.staging_block(data.len())?;
    // SAFETY: the block has at least `data.len()` bytes and is ours alone until returned.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), block.ptr, data.len()) };
    // SAFETY: `dst` is a live allocation of `data.len()` bytes (the caller's buffer); the block
    // stays valid and unchanged until the event after the copy completes.
    let queued =
        unsafe { stream.copy_htod(dst, block.ptr, data.len()) }.and_then(|()| stream.record());
    match queued {
        Ok(event) => {
            device.return_staging_after(block, &event);
            Ok(())
        }
        Err(e) => {
            // The copy may be queued: the block is reused only behind a later event.
            device.return_staging_after_queued(block, stream);
            Err(e)
        }
    }
}

/// Copies `out.len()` bytes from `src` to `out` through a staging block, after the work queued
/// on `stream`.
///
/// The staging block goes back to the device's cache only once nothing queued can still write
/// it: at once if no copy was attempted, after the copy's event if it was recorded, else behind
/// a later event of `stream` (or never, if none can be recorded): whether the future
/// completes, fails or is dropped.
pub(crate) async fn copy_out(stream: &Stream, src: DevicePtr, out: &mut [u8]) -> Result<()> {
    if out.is_empty() {
        return Ok(());
    }
    /// Returns the block when dropped, as above.
    struct Guard<'a> {
        stream: &'a Stream,
        block: Option<crate::device::staging::StagingBlock>,
        /// A copy into the block was asked of the stream (it may be queued even if the call
        /// failed).
        queued: bool,
        /// Recorded after the copy.
        event: Option<Event>,
    }
    impl Drop for Guard<'_> {
        fn drop(&mut self) {
            if let Some(block) = self.block.take() {
                let device = self.stream.device();
                match (&self.event, self.queued) {
                    (Some(event), _) => device.return_staging_after(block, event),
                    (None, true) => device.return_staging_after_queued(block, self.stream),
                    (None, false) => device.return_staging(block),
                }
            }
        }
    }
    let device = stream.device();
    let mut guard = Guard {
        stream,
        block: Some(device.staging_block(out.len())?),
        queued: false,
        event: None,
    };
    // (The raw pointer is re-read from the guard after the await, so the future stays `Send`.)
    let block_ptr =
        |guard: &Guard<'_>| guard.block.as_ref().map_or(std::ptr::null_mut(), |b| b.ptr);
    guard.queued = true;
    // SAFETY: `src` is a live allocation of `out.len()` bytes (the caller's buffer); the block
    // has at least that many bytes and nobody else touches it until the guard returns it, which
    // is only once the copy can no longer write it.
    unsafe { stream.copy_dtoh(block_ptr(&guard), src, out.len()) }?;
    let event = stream.record()?;
    guard.event = Some(event.clone());
    event.await?;
    // SAFETY: the copy into the block has completed (the event after it did).
    unsafe { std::ptr::copy_nonoverlapping(block_ptr(&guard), out.as_mut_ptr(), out.len()) };
    Ok(())
}

/// What a buffer with other uses leaves behind: freed once every use's event completes.
struct PendingFree {
    ptr: DevicePtr,
    len: usize,
    resource: ResourceRef,
    stream: Stream,
}

impl PendingFree {
    fn release(&self) {
        // SAFETY: the buffer's memory, from this resource with this length, freed once (only
        // the last of the events gets here); every use on other streams has completed and
        // later work on `stream` is ordered after the free.
        if let Err(e) = unsafe { self.resource.deallocate(self.ptr, self.len, &self.stream) } {
            tracing::error!(error = %e, ptr = ?self.ptr, len = self.len, "a deferred free failed");
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let uses = std::mem::take(&mut *self.uses.lock());
        if uses.is_empty() {
            // SAFETY: our memory, from this resource with this length, used only on `stream`
            // (in stream order before this point), freed once.
            if let Err(e) = unsafe { self.resource.deallocate(self.ptr, self.len, &self.stream) } {
                tracing::error!(error = %e, ptr = ?self.ptr, len = self.len, "freeing a buffer failed");
            }
            return;
        }
        let events: Result<Vec<Event>> = uses.iter().map(Stream::record).collect();
        let events = match events {
            Ok(events) => events,
            Err(e) => {
                // Without events we cannot know when the other streams are done: keep the
                // memory rather than risk handing it out under running work.
                tracing::error!(error = %e, ptr = ?self.ptr, len = self.len, "could not record the buffer's uses; its memory is leaked");
                return;
            }
        };
        let pending = PendingFree {
            ptr: self.ptr,
            len: self.len,
            resource: self.resource.clone(),
            stream: self.stream.clone(),
        };
        release_after_all(&events, move || pending.release(), Event::on_complete);
    }
}

/// Runs `release` exactly once, after every one of `events` has completed (`on_complete`
/// registers a callback with one event, or runs it at once if the event is already complete).
///
/// The countdown starts at the number of events *before* the first callback is registered: a
/// callback may run during `on_complete`, or on another thread while the next one registers, so
/// counting up while registering could reach zero early. The callback that brings it to zero
/// releases; its `AcqRel` decrement makes the release see everything the other events'
/// callbacks saw. With no events, releases at once. The loom model `loom-tests/deferred_free.rs`
/// checks it.
pub(crate) fn release_after_all<E>(
    events: &[E],
    release: impl Fn() + Send + Sync + 'static,
    on_complete: impl Fn(&E, Callback),
) {
    if events.is_empty() {
        return release();
    }
    let countdown = Arc::new((AtomicUsize::new(events.len()), release));
    for event in events {
        let countdown = countdown.clone();
        on_complete(
            event,
            Box::new(move |_| {
                let (remaining, release) = &*countdown;
                if remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
                    release();
                }
            }),
        );
    }
}

// ===== cudarc kernel arguments =====

// SAFETY: pushes a reference to the buffer's `CUdeviceptr` (a `u64`, which cudarc passes as a
// kernel parameter by value), borrowed for as long as the launch arguments. The caller orders
// the launch's stream after the buffer's, as for any kernel argument.
unsafe impl<'a, 'b: 'a> cudarc::driver::PushKernelArg<&'b DeviceBuffer>
    for cudarc::driver::LaunchArgs<'a>
{
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceBuffer) -> &mut Self {
        self.arg(&arg.ptr.0)
    }
}

// SAFETY: as above, for a buffer the kernel may write.
unsafe impl<'a, 'b: 'a> cudarc::driver::PushKernelArg<&'b mut DeviceBuffer>
    for cudarc::driver::LaunchArgs<'a>
{
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DeviceBuffer) -> &mut Self {
        self.arg(&arg.ptr.0)
    }
}
