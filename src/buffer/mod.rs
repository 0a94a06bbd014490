//! `DeviceBuffer`: untyped device memory from a resource, freed in stream order when dropped.
//!
//! Here: the type, how one is made, and its streams. `reallocate`: new memory with the contents
//! (resize, reserve, clones); `copy`: copies to and from the host; `free`: how it goes back to
//! its resource; `kernel_args`: buffers as cudarc kernel arguments.

use std::fmt;
use std::mem::ManuallyDrop;
use std::time::Duration;

use crate::device::DevicePtr;
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::resource::{AllocateAsync, AsResourceRef, ResourceRef};
use crate::stream::Stream;
use crate::sync::Mutex;

/// How many streams a buffer keeps as uses before a new use lets go of those nobody else holds
/// (see `DeviceBuffer::add_use`): the common buffer, used on a few streams, pays nothing.
const USES_BEFORE_SETTLING: usize = 8;

pub(crate) mod copy;
mod free;
mod kernel_args;
mod reallocate;

pub(crate) use self::copy::{copy_in, copy_out};
// The loom model of the deferred free (loom-tests/deferred_free.rs) drives it.
#[cfg(all(test, streamalloc_loom))]
#[cfg(streamalloc_loom)]
pub(crate) use self::free::{planted as free_planted, release_after_all};

/// Device memory of `len()` bytes from a [`MemoryResource`](crate::MemoryResource), used on a
/// stream (RMM's `device_buffer`).
///
/// - Its allocation may be larger than its length ([`capacity`](Self::capacity)): a
///   [`resize`](Self::resize) within the capacity keeps the memory and its address, and
///   [`reserve`](Self::reserve) and [`shrink_to_fit`](Self::shrink_to_fit) reallocate, as for
///   a `Vec` (and RMM's `device_buffer`).
/// - It remembers the stream it is used on ([`stream`](Self::stream),
///   [`set_stream`](Self::set_stream)); [`record_stream`](Self::record_stream) marks a use on
///   another one (PyTorch's `record_stream`).
/// - Dropping it never blocks the host and never loses memory: with no other stream recorded,
///   the memory goes back to its resource at once, in stream order on its stream; with other
///   streams recorded, an event is recorded on each and the memory goes back (on its stream)
///   once they have all completed, through the device's completion reactor. Either way it goes
///   back exactly once, whatever the order of drops, streams and threads.
/// - It keeps its resource alive (a [`ResourceRef`]). If its handle is the last one when its
///   memory goes back (the resource's other handles, the user's among them, dropped first),
///   the resource is dropped on the device's blocking-work thread, not where the buffer drops
///   (nor on the completion reactor): a resource's Drop may block, a pool's waiting for every
///   stream it served before it returns its memory upstream. So a pool dropped that way gives
///   its memory back to its upstream (the driver, on a GPU) shortly after, not by the time the
///   buffer's `drop` returns. A caller that needs it back at a known point keeps a handle of
///   the resource and drops it last, once the buffers' frees have run (a buffer used on other
///   streams frees once they are done): that drop runs the resource's Drop on the caller's
///   thread, and returns once it is done. (On a simulated device that runs its streams
///   inline, the resource is dropped where the buffer drops, off its reactor: there is
///   nothing to wait for, and no thread is started for it.)
pub struct DeviceBuffer {
    ptr: DevicePtr,
    /// Bytes in use; at most `capacity`.
    len: usize,
    /// Bytes allocated from `resource` at `ptr`: what the free gives back.
    capacity: usize,
    /// Taken out only by the drop (`free.rs`), which hands the last handle of the resource to
    /// the device's blocking-work thread rather than dropping it where the buffer drops.
    resource: ManuallyDrop<ResourceRef>,
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
            .field("capacity", &self.capacity)
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

    /// [`alloc`](Self::alloc), giving up with [`Error::Timeout`] after `limit` (or with
    /// [`Error::Io`] at once if it must wait and the OS cannot start the thread that keeps the
    /// deadlines; see [`Allocate::timeout`](crate::resource::Allocate::timeout)).
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

    /// Allocates one buffer per `(bytes, stream)` request from `resource`, **all or none**,
    /// waiting (as a future) until the whole set fits at once; see
    /// [`allocate_all_async`](AllocateAsync::allocate_all_async). The buffers come in the
    /// order of `requests`. This is what a task that needs several buffers should use: one that
    /// awaits them one by one holds the first while it waits for the next, and tasks doing that
    /// can deadlock, each holding what another waits for.
    ///
    /// # Cancel safety
    /// Cancel-safe: a dropped future leaves the queue and holds nothing.
    pub async fn alloc_all(
        resource: &impl AsResourceRef,
        requests: &[(usize, &Stream)],
    ) -> Result<Vec<Self>> {
        Self::alloc_all_inner(resource.resource_ref(), requests, None).await
    }

    /// [`alloc_all`](Self::alloc_all), giving up with [`Error::Timeout`] after `limit`.
    pub async fn alloc_all_timeout(
        resource: &impl AsResourceRef,
        requests: &[(usize, &Stream)],
        limit: Duration,
    ) -> Result<Vec<Self>> {
        Self::alloc_all_inner(resource.resource_ref(), requests, Some(limit)).await
    }

    async fn alloc_all_inner(
        resource: ResourceRef,
        requests: &[(usize, &Stream)],
        limit: Option<Duration>,
    ) -> Result<Vec<Self>> {
        for (_, stream) in requests {
            check_device(&resource, stream)?;
        }
        let wait = resource.allocate_all_async(requests.iter().copied());
        let ptrs = match limit {
            Some(limit) => wait.timeout(limit).await?,
            None => wait.await?,
        };
        Ok(ptrs
            .into_iter()
            .zip(requests)
            .map(|(ptr, &(bytes, stream))| Self::from_parts(ptr, bytes, resource.clone(), stream))
            .collect())
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
            capacity: len,
            resource: ManuallyDrop::new(resource),
            stream: stream.clone(),
            uses: Mutex::new(Vec::new()),
        }
    }

    /// Takes ownership of memory allocated from `resource` on `stream`.
    ///
    /// # Safety
    /// `ptr` came from `resource.allocate(len, s)` on a stream `s` that `stream` is ordered
    /// after (`stream` itself, or one that waited for it), or these are the parts
    /// [`into_raw_parts`](Self::into_raw_parts) gave up (`len` its capacity); and nothing else
    /// will free it.
    pub unsafe fn from_raw_parts(
        ptr: DevicePtr,
        len: usize,
        resource: ResourceRef,
        stream: &Stream,
    ) -> Self {
        Self::from_parts(ptr, len, resource, stream)
    }

    /// Gives up ownership without freeing: `(ptr, capacity, resource, stream)`, the allocation
    /// as [`from_raw_parts`](Self::from_raw_parts) takes it back (the size is the allocation's,
    /// [`capacity`](Self::capacity), which is what freeing it needs). Other streams
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
            self.stream.wait(&other.record_unwatched()?)?;
        }
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped, so each field is moved out exactly once (the
        // `Copy` ones are copied); the list of uses is dropped here, its streams now ordered
        // before `stream`.
        unsafe {
            drop(std::ptr::read(&this.uses));
            Ok((
                this.ptr,
                this.capacity,
                ManuallyDrop::into_inner(std::ptr::read(&this.resource)),
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

    /// Bytes allocated: at least [`len`](Self::len). A resize up to it keeps the memory.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use streamalloc::{CudaResource, Device, DeviceBuffer, PoolOptions, PoolResource, SimConfig};
    /// # let device = Device::simulated(SimConfig::default());
    /// # let pool = Arc::new(PoolResource::new(CudaResource::new(&device), PoolOptions::default())?);
    /// let stream = device.create_stream()?;
    /// let mut buf = DeviceBuffer::new(&pool, 4096, &stream)?;
    /// let ptr = buf.as_ptr();
    /// buf.resize(1000)?; // smaller: same memory, same address (RMM's ResizeSmaller)
    /// assert_eq!((buf.len(), buf.capacity(), buf.as_ptr()), (1000, 4096, ptr));
    /// buf.resize(4096)?; // back up within the capacity: still the same memory
    /// assert_eq!(buf.as_ptr(), ptr);
    /// # Ok::<(), streamalloc::Error>(())
    /// ```
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The stream it is used on: where it was allocated, or set since.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Moves the buffer to `stream`: later work uses it there, and it is freed there.
    /// `stream` is ordered after the work queued on the old stream so far (an event recorded
    /// there and a GPU-side wait: the host does not block), and the old stream is recorded as
    /// a use, so the free also waits for what is queued there later.
    ///
    /// The ordering matters even for a buffer the caller never touched on the old stream: the
    /// pool may have handed it out on that stream with no ordering at all, straight from a free
    /// there whose last user is still queued (unlike RMM's `set_stream`, which leaves this to
    /// the caller, and unlike this method before a review found the safe `memset` on the new
    /// stream racing the previous owner's copy). On an error nothing changes.
    pub fn set_stream(&mut self, stream: &Stream) -> Result<()> {
        check_device(&self.resource, stream)?;
        if stream.id() != self.stream.id() {
            stream.wait(&self.stream.record_unwatched()?)?;
            let old = std::mem::replace(&mut self.stream, stream.clone());
            self.add_use(old);
        }
        Ok(())
    }

    /// Marks a use on `other`: the free waits for the work queued on `other` up to the drop,
    /// as PyTorch's `record_stream`. Cheap: the event is recorded only at drop. The mark stays
    /// through a move to new memory ([`resize`](Self::resize) past the capacity,
    /// [`reserve`](Self::reserve), [`shrink_to_fit`](Self::shrink_to_fit)).
    ///
    /// `other` may be a stream of another GPU (a kernel there reading this memory through
    /// peer access, see [`Device::enable_peer_access`](crate::Device::enable_peer_access)) or
    /// of another simulated device: the free waits for it all the same. `Err(WrongDevice)` for
    /// a simulated device and a GPU.
    ///
    /// The buffer keeps a handle of each stream it was used on until it drops (so do the
    /// methods that use it on another stream: [`try_clone_to`](Self::try_clone_to),
    /// [`set_stream`](Self::set_stream), `DeviceVec::to_host` on another stream). Once it
    /// holds 8, a new use first lets go of those whose every other handle is gone, after
    /// ordering the buffer's own stream behind the work queued there (a GPU-side wait: later
    /// work on the buffer's stream waits for it), so a long-lived buffer used on a fresh
    /// stream per request keeps no more than a few of them alive. A stream whose driver handle
    /// was handed out (`cuda_stream`, `cudarc_stream`, `Stream::from_cudarc`) is kept: work
    /// may still reach it through that handle.
    pub fn record_stream(&mut self, other: &Stream) -> Result<()> {
        self.resource.device().check_peer(other.device())?;
        if other.id() != self.stream.id() {
            self.add_use(other.clone());
        }
        Ok(())
    }

    fn add_use(&self, other: Stream) {
        let mut uses = self.uses.lock();
        if uses.iter().any(|s| s.id() == other.id()) {
            return;
        }
        if uses.len() >= USES_BEFORE_SETTLING {
            // A stream whose only handle is this list's (its user dropped it, and no event,
            // buffer or free holds it), and whose driver handle was never handed out (cudarc
            // code may queue on an exposed one with no handle of ours: a review's finding),
            // can get no more work: what the free must wait for there is queued already. So the buffer's own stream waits for it now (GPU-side, as
            // `into_raw_parts` does for every use) and the handle goes. Kept, a long-lived
            // buffer used on a fresh stream per request (weights cloned or read for each) held
            // every such stream (a driver stream, a simulated device's thread) and the pools'
            // records of it until it dropped, which no trim could let go of (a review's
            // finding). A stream whose record or wait fails stays a use.
            uses.retain(|used| {
                used.users() > 1 || used.activity().is_none() || !self.settle_use(used)
            });
        }
        uses.push(other);
    }

    /// Orders the buffer's stream after the work queued on `used` so far (an event there, a
    /// GPU-side wait): whether it did, so that the free no longer needs `used`.
    fn settle_use(&self, used: &Stream) -> bool {
        match (used.record_unwatched()).and_then(|event| self.stream.wait(&event)) {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(error = %e, stream = %used.id(), "a buffer keeps a dropped stream as a use: its ordering failed");
                false
            }
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
        self.use_on_any_device(other)
    }

    /// [`use_on`](Self::use_on) for a stream that may be of another device (a copy between
    /// devices): the caller checked that the devices may meet (`Device::check_peer`).
    fn use_on_any_device(&self, other: &Stream) -> Result<()> {
        if other.id() != self.stream.id() {
            self.add_use(other.clone());
            other.wait(&self.stream.record_unwatched()?)?;
        }
        Ok(())
    }

    /// The resource it came from.
    pub fn resource(&self) -> &ResourceRef {
        &self.resource
    }
}

fn check_device(resource: &ResourceRef, stream: &Stream) -> Result<()> {
    resource.device().check_same(stream.device())
}
