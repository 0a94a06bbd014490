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
/// - It keeps its resource alive (a [`ResourceRef`]).
pub struct DeviceBuffer {
    ptr: DevicePtr,
    /// Bytes in use; at most `capacity`.
    len: usize,
    /// Bytes allocated from `resource` at `ptr`: what the free gives back.
    capacity: usize,
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
                this.capacity,
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
    ///
    /// `other` may be a stream of another GPU (a kernel there reading this memory through
    /// peer access, see [`Device::enable_peer_access`](crate::Device::enable_peer_access)) or
    /// of another simulated device: the free waits for it all the same. `Err(WrongDevice)` for
    /// a simulated device and a GPU.
    pub fn record_stream(&mut self, other: &Stream) -> Result<()> {
        self.resource.device().check_peer(other.device())?;
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
        self.use_on_any_device(other)
    }

    /// [`use_on`](Self::use_on) for a stream that may be of another device (a copy between
    /// devices): the caller checked that the devices may meet (`Device::check_peer`).
    fn use_on_any_device(&self, other: &Stream) -> Result<()> {
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

    /// Resizes to `bytes`. Within the [`capacity`](Self::capacity) it only changes the length:
    /// the memory and its address stay (bytes past the old length are not initialized). Past
    /// it, the buffer moves to a new allocation of exactly `bytes` from the same resource, with
    /// the old contents copied on its stream, and the old memory is freed as a drop frees it.
    ///
    /// On error (no memory, or the copy could not be queued) the buffer is as it was.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use streamalloc::{CudaResource, Device, DeviceBuffer, PoolOptions, PoolResource, SimConfig};
    /// # let device = Device::simulated(SimConfig::default());
    /// # let pool = Arc::new(PoolResource::new(CudaResource::new(&device), PoolOptions::default())?);
    /// # let stream = device.create_stream()?;
    /// let mut buf = DeviceBuffer::new(&pool, 256, &stream)?;
    /// buf.memset(7)?;
    /// buf.resize(1024)?; // past the capacity: new memory, the first 256 bytes copied
    /// assert_eq!((buf.len(), buf.capacity()), (1024, 1024));
    /// # let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    /// let bytes = rt.block_on(buf.to_host())?;
    /// assert!(bytes[..256].iter().all(|&b| b == 7));
    /// # Ok::<(), streamalloc::Error>(())
    /// ```
    pub fn resize(&mut self, bytes: usize) -> Result<()> {
        if bytes > self.capacity {
            self.reallocate(bytes)?;
        }
        self.len = bytes;
        Ok(())
    }

    /// Makes room for at least `additional` more bytes past [`len`](Self::len): if the
    /// capacity is smaller than `len + additional`, moves the contents to a new allocation of
    /// exactly that size (as `Vec::reserve_exact`; RMM's `reserve` takes the new capacity
    /// itself). The length stays.
    ///
    /// `Err(InvalidSize)` if `len + additional` overflows; on any error the buffer is as it was.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use streamalloc::{CudaResource, Device, DeviceBuffer, PoolOptions, PoolResource, SimConfig};
    /// # let device = Device::simulated(SimConfig::default());
    /// # let pool = Arc::new(PoolResource::new(CudaResource::new(&device), PoolOptions::default())?);
    /// # let stream = device.create_stream()?;
    /// let mut buf = DeviceBuffer::new(&pool, 100, &stream)?;
    /// buf.reserve(900)?;
    /// assert_eq!((buf.len(), buf.capacity()), (100, 1000));
    /// let ptr = buf.as_ptr();
    /// buf.resize(1000)?; // no reallocation: it fits
    /// assert_eq!(buf.as_ptr(), ptr);
    /// # Ok::<(), streamalloc::Error>(())
    /// ```
    pub fn reserve(&mut self, additional: usize) -> Result<()> {
        let needed = self.len.checked_add(additional).ok_or(Error::InvalidSize {
            size: additional,
            reason: "the length plus the additional bytes overflows usize",
        })?;
        if needed > self.capacity {
            self.reallocate(needed)?;
        }
        Ok(())
    }

    /// Gives the memory past [`len`](Self::len) back: if the capacity is larger than the
    /// length, moves the contents to a new allocation of exactly `len` bytes (an empty buffer
    /// holds no memory) and frees the old one as a drop frees it. The only call that shrinks
    /// the allocation ([`resize`](Self::resize) to smaller never does).
    ///
    /// On error the buffer is as it was.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use streamalloc::{CudaResource, Device, DeviceBuffer, PoolOptions, PoolResource, SimConfig};
    /// # let device = Device::simulated(SimConfig::default());
    /// # let pool = Arc::new(PoolResource::new(CudaResource::new(&device), PoolOptions::default())?);
    /// # let stream = device.create_stream()?;
    /// let mut buf = DeviceBuffer::new(&pool, 1 << 20, &stream)?;
    /// buf.resize(4096)?;
    /// assert_eq!(buf.capacity(), 1 << 20);
    /// buf.shrink_to_fit()?;
    /// assert_eq!((buf.len(), buf.capacity()), (4096, 4096));
    /// # Ok::<(), streamalloc::Error>(())
    /// ```
    pub fn shrink_to_fit(&mut self) -> Result<()> {
        if self.capacity > self.len {
            self.reallocate(self.len)?;
        }
        Ok(())
    }

    /// Moves the contents to a new allocation of `capacity` bytes from the same resource on
    /// the buffer's stream, keeping the first `min(len, capacity)` bytes (copied in stream
    /// order); the old memory is freed as a drop frees it (after every recorded use). On error
    /// nothing changed.
    fn reallocate(&mut self, capacity: usize) -> Result<()> {
        let ptr = self.resource.allocate(capacity, &self.stream)?;
        let keep = self.len.min(capacity);
        if keep > 0 {
            // SAFETY: both ranges are live allocations of at least `keep` bytes, used in order
            // on this stream; the old one is freed after this copy in stream order.
            if let Err(e) = unsafe { self.stream.copy_dtod(ptr, self.ptr, keep) } {
                // SAFETY: just allocated on this stream with this size; the failed copy was not
                // queued, so nothing uses it.
                let _ = unsafe { self.resource.deallocate(ptr, capacity, &self.stream) };
                return Err(e);
            }
        }
        let mut new = Self::from_parts(ptr, capacity, self.resource.clone(), &self.stream);
        new.len = keep;
        drop(std::mem::replace(self, new));
        Ok(())
    }

    /// A copy of the contents in new memory (of exactly `len()` bytes) from the same resource,
    /// on the buffer's stream.
    pub fn try_clone(&self) -> Result<Self> {
        self.try_clone_to(&self.resource, &self.stream)
    }

    /// A copy of the contents in new memory from `resource`, for use on `stream` (RMM's
    /// `device_buffer(other, stream, mr)`): the copy is queued on `stream` after the work
    /// queued on this buffer's stream so far (GPU-side; the host does not wait), and `stream`
    /// is recorded as a use of this buffer, so its free waits for the copy.
    ///
    /// `resource` and `stream` may be of another device than this buffer's (another GPU, or
    /// another simulated device): the copy between devices is queued on `stream` as above
    /// (`cuMemcpyPeerAsync`: no peer access needed), after a GPU-side wait for this buffer's
    /// stream.
    ///
    /// Errors: [`Error::WrongDevice`] if `resource` and `stream` are of different devices, or
    /// one is simulated and the other a GPU; the resource's error if it has no memory, a driver
    /// error if the copy or the ordering cannot be queued. Nothing is allocated when an error
    /// is returned.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use streamalloc::{CudaResource, Device, DeviceBuffer, PoolOptions, PoolResource, SimConfig};
    /// # let device = Device::simulated(SimConfig::default());
    /// # let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    /// let pool = Arc::new(PoolResource::new(CudaResource::new(&device), PoolOptions::default())?);
    /// let other_pool = Arc::new(CudaResource::new(&device));
    /// let (a, b) = (device.create_stream()?, device.create_stream()?);
    /// let mut buf = DeviceBuffer::new(&pool, 1024, &a)?;
    /// buf.memset(42)?;
    /// let copy = buf.try_clone_to(&other_pool, &b)?; // on `b`, from `other_pool`
    /// assert_eq!(copy.stream().id(), b.id());
    /// drop(buf); // safe at once: its free waits for the copy on `b`
    /// assert!(rt.block_on(copy.to_host())?.iter().all(|&x| x == 42));
    /// # Ok::<(), streamalloc::Error>(())
    /// ```
    pub fn try_clone_to(&self, resource: &impl AsResourceRef, stream: &Stream) -> Result<Self> {
        let resource = resource.resource_ref();
        check_device(&resource, stream)?;
        let here = self.resource.device();
        here.check_peer(stream.device())?;
        let copy = Self::new(&resource, self.len, stream)?;
        if self.len > 0 {
            self.use_on_any_device(stream)?;
            // SAFETY: both are live allocations of at least `len` bytes (this one of `here`,
            // the copy of `stream`'s device); `stream` is ordered after this buffer's stream,
            // and recorded as a use of it, so this buffer is freed only after the copy; the
            // copy is freed in order on `stream`.
            unsafe { stream.copy_peer(copy.ptr, self.ptr, here, self.len) }?;
        }
        Ok(copy)
    }

    /// A buffer of `bytes` from `resource` on `stream`, holding a copy of the device memory at
    /// `src` (RMM's `device_buffer(source_data, size, stream, mr)`, for device memory). The copy
    /// is queued on `stream`; the host does not wait.
    ///
    /// Errors as [`new`](Self::new), and a driver error if the copy cannot be queued (the new
    /// memory is then freed). A source range the simulated device does not know fails the
    /// stream ([`Error::InvalidAddress`] from its next synchronization).
    ///
    /// # Safety
    /// - `[src, src + bytes)` is device memory of `stream`'s device (or memory the device can
    ///   read, such as managed or mapped page-locked memory);
    /// - it stays allocated until `stream` reaches the copy;
    /// - whatever writes it is ordered before this point of `stream`.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use streamalloc::{CudaResource, Device, DeviceBuffer, PoolOptions, PoolResource, SimConfig};
    /// # let device = Device::simulated(SimConfig::default());
    /// # let pool = Arc::new(PoolResource::new(CudaResource::new(&device), PoolOptions::default())?);
    /// # let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    /// let stream = device.create_stream()?;
    /// let raw = device.malloc(512)?; // memory someone else owns
    /// // SAFETY: 512 live bytes of this device, freed only after the stream is synchronized.
    /// unsafe { stream.memset_d8(raw, 9, 512)? };
    /// // SAFETY: as above, and the memset that writes it is queued before the copy on `stream`.
    /// let buf = unsafe { DeviceBuffer::copy_from_device_ptr(&pool, raw, 512, &stream)? };
    /// assert!(rt.block_on(buf.to_host())?.iter().all(|&x| x == 9));
    /// stream.synchronize_blocking()?;
    /// // SAFETY: from `malloc`, freed once, no work uses it any more.
    /// unsafe { device.free(raw)? };
    /// # Ok::<(), streamalloc::Error>(())
    /// ```
    pub unsafe fn copy_from_device_ptr(
        resource: &impl AsResourceRef,
        src: DevicePtr,
        bytes: usize,
        stream: &Stream,
    ) -> Result<Self> {
        let buf = Self::new(resource, bytes, stream)?;
        if bytes > 0 {
            // SAFETY: `buf` is a live allocation of `bytes`, freed in order on `stream` after
            // this copy; the source range is the caller's contract.
            unsafe { stream.copy_dtod(buf.ptr, src, bytes) }?;
        }
        Ok(buf)
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
    /// The allocation's size (the buffer's capacity).
    len: usize,
    /// Taken by the release, which runs once.
    resource: crate::sync::Mutex<Option<ResourceRef>>,
    stream: Stream,
}

impl PendingFree {
    fn release(&self) {
        let Some(resource) = self.resource.lock().take() else {
            return;
        };
        // SAFETY: the buffer's memory, from this resource with this length, freed once (only
        // the last of the events gets here, and it takes the resource); every use on other
        // streams has completed and later work on `stream` is ordered after the free.
        if let Err(e) = unsafe { resource.deallocate(self.ptr, self.len, &self.stream) } {
            tracing::error!(error = %e, ptr = ?self.ptr, bytes = self.len, "a deferred free failed");
        }
        // This may be the last handle of the resource: its Drop (a pool synchronizing its
        // streams and returning its chunks) must not run on the completion reactor.
        if crate::offload::on_reactor_thread() {
            self.stream
                .device()
                .reactor()
                .offload("drop a buffer's resource", Box::new(move || drop(resource)));
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let uses = std::mem::take(&mut *self.uses.lock());
        if uses.is_empty() {
            // SAFETY: our memory, from this resource with this size, used only on `stream`
            // (in stream order before this point), freed once.
            if let Err(e) = unsafe {
                self.resource
                    .deallocate(self.ptr, self.capacity, &self.stream)
            } {
                tracing::error!(error = %e, ptr = ?self.ptr, bytes = self.capacity, "freeing a buffer failed");
            }
            return;
        }
        let events: Result<Vec<Event>> = uses.iter().map(Stream::record).collect();
        let events = match events {
            Ok(events) => events,
            Err(e) => {
                // Without events we cannot know when the other streams are done: keep the
                // memory rather than risk handing it out under running work.
                tracing::error!(error = %e, ptr = ?self.ptr, bytes = self.capacity, "could not record the buffer's uses; its memory is leaked");
                return;
            }
        };
        let pending = PendingFree {
            ptr: self.ptr,
            len: self.capacity,
            resource: crate::sync::Mutex::new(Some(self.resource.clone())),
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
