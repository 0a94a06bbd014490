//! A buffer moved to new memory with its contents: `resize` past the capacity, `reserve`,
//! `shrink_to_fit`, clones (`try_clone`, `try_clone_to`) and `copy_from_device_ptr`. The old
//! memory is freed as a drop frees it.

use crate::device::DevicePtr;
use crate::error::{Error, Result};
use crate::resource::{AsResourceRef, ResourceRef};
use crate::stream::Stream;
use crate::sync::Mutex;

use super::{check_device, DeviceBuffer};

impl DeviceBuffer {
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
    /// order); the old memory is freed as a drop frees it (after every recorded use), and the
    /// recorded uses stay recorded for the new memory. On error nothing changed.
    fn reallocate(&mut self, capacity: usize) -> Result<()> {
        let ptr = self.resource.allocate(capacity, &self.stream)?;
        // Owned by a buffer before anything else can fail or panic: if the copy fails, or
        // panics (the simulated device's race detector panics at a racing copy in its `Panic`
        // mode, and a caller may catch it), dropping `new` gives the memory back, in order on
        // this stream. The raw pointer used to be held bare here, and a panic leaked it.
        let mut new = Self::from_parts(
            ptr,
            capacity,
            ResourceRef::clone(&self.resource),
            &self.stream,
        );
        let keep = self.len.min(capacity);
        if keep > 0 {
            // SAFETY: both ranges are live allocations of at least `keep` bytes, used in order
            // on this stream; the old one is freed after this copy in stream order, and so is
            // the new one if this fails (`new`'s drop).
            unsafe { self.stream.copy_dtod(new.ptr, self.ptr, keep) }?;
        }
        new.len = keep;
        // The streams recorded as uses stay recorded: `record_stream` promises that the
        // buffer's free waits for them up to its drop, and the caller may go on using the
        // buffer there (now the new memory) without recording them again. The old memory
        // keeps them too, for the work queued there so far.
        new.uses = Mutex::new(self.uses.lock().clone());
        drop(std::mem::replace(self, new));
        Ok(())
    }

    /// A copy of the contents in new memory (of exactly `len()` bytes) from the same resource,
    /// on the buffer's stream.
    pub fn try_clone(&self) -> Result<Self> {
        self.try_clone_to(&*self.resource, &self.stream)
    }

    /// A copy of the contents in new memory from `resource`, for use on `stream` (RMM's
    /// `device_buffer(other, stream, mr)`): the copy is queued on `stream` after the work
    /// queued on this buffer's stream so far (GPU-side; the host does not wait), and `stream`
    /// is recorded as a use of this buffer, so its free waits for the copy. This buffer's
    /// stream is then ordered after the copy (GPU-side too), so that work queued there later,
    /// a [`memset`](Self::memset) or a kernel writing the buffer, does not overtake the read.
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
            // The caller may write this buffer on its stream as soon as this returns (its
            // borrow ends here): that write must not overtake the read queued on `stream`.
            stream.order_before(&self.stream)?;
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
}
