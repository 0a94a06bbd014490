//! `DeviceVec<T>` and `DeviceScalar<T>`: typed device memory for plain-data `T`.

use std::fmt;
use std::marker::PhantomData;
use std::mem::size_of;

use bytemuck::Pod;

use crate::buffer::{copy_in, copy_out, DeviceBuffer};
use crate::device::DevicePtr;
use crate::error::{Error, Result};
use crate::resource::{AsResourceRef, ResourceRef, ALIGNMENT};
use crate::stream::Stream;

/// The bytes of `len` elements of `T`, for a `T` that device memory can hold: `InvalidSize`
/// if they overflow `usize`, `InvalidAlignment` (with `T`'s alignment) if `T` is aligned past
/// [`ALIGNMENT`], all that a resource promises, so that its elements could be misaligned (a
/// kernel reading them faults on a GPU).
fn bytes_for<T>(len: usize) -> Result<usize> {
    check_alignment::<T>()?;
    len.checked_mul(size_of::<T>()).ok_or(Error::InvalidSize {
        size: len,
        reason: "the element count overflows usize when multiplied by the element size",
    })
}

/// `InvalidAlignment` unless every allocation of a resource (aligned to [`ALIGNMENT`]) is
/// aligned for `T`.
fn check_alignment<T>() -> Result<()> {
    match std::mem::align_of::<T>() {
        align if align <= ALIGNMENT => Ok(()),
        alignment => Err(Error::InvalidAlignment { alignment }),
    }
}

/// `len()` elements of plain-data `T` in device memory, uninitialized until written (RMM's
/// `device_uvector`). All of [`DeviceBuffer`]'s rules apply: stream-ordered, `record_stream`,
/// a drop that never blocks (and a vector holding the last handle of its resource has the
/// resource dropped on the device's blocking-work thread, as a buffer has).
pub struct DeviceVec<T: Pod> {
    buf: DeviceBuffer,
    len: usize,
    _elem: PhantomData<T>,
}

impl<T: Pod> fmt::Debug for DeviceVec<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceVec")
            .field("len", &self.len)
            .field("elem", &std::any::type_name::<T>())
            .field("buf", &self.buf)
            .finish()
    }
}

impl<T: Pod> DeviceVec<T> {
    /// `len` uninitialized elements from `resource` on `stream`; fails at once when memory is
    /// short.
    ///
    /// `Err(InvalidAlignment)` for a `T` aligned past [`ALIGNMENT`] (resources promise no
    /// more, so its elements could be misaligned); the same holds for every constructor.
    pub fn new(resource: &impl AsResourceRef, len: usize, stream: &Stream) -> Result<Self> {
        let buf = DeviceBuffer::new(resource, bytes_for::<T>(len)?, stream)?;
        Ok(Self::from_buffer_unchecked(buf, len))
    }

    /// `len` uninitialized elements, waiting for memory (see [`DeviceBuffer::alloc`]).
    ///
    /// # Cancel safety
    /// Cancel-safe, as [`DeviceBuffer::alloc`].
    pub async fn alloc(resource: &impl AsResourceRef, len: usize, stream: &Stream) -> Result<Self> {
        let buf = DeviceBuffer::alloc(resource, bytes_for::<T>(len)?, stream).await?;
        Ok(Self::from_buffer_unchecked(buf, len))
    }

    /// `len` zeroed elements.
    pub fn zeroed(resource: &impl AsResourceRef, len: usize, stream: &Stream) -> Result<Self> {
        let mut v = Self::new(resource, len, stream)?;
        v.buf.memset(0)?;
        Ok(v)
    }

    /// A copy of `data`, queued on `stream`. Never blocks on the GPU (staged through
    /// page-locked memory).
    pub fn from_host(resource: &impl AsResourceRef, data: &[T], stream: &Stream) -> Result<Self> {
        let mut v = Self::new(resource, data.len(), stream)?;
        v.copy_from_host(data)?;
        Ok(v)
    }

    /// [`from_host`](Self::from_host), waiting for memory.
    pub async fn alloc_from_host(
        resource: &impl AsResourceRef,
        data: &[T],
        stream: &Stream,
    ) -> Result<Self> {
        let mut v = Self::alloc(resource, data.len(), stream).await?;
        v.copy_from_host(data)?;
        Ok(v)
    }

    fn from_buffer_unchecked(buf: DeviceBuffer, len: usize) -> Self {
        Self {
            buf,
            len,
            _elem: PhantomData,
        }
    }

    /// Views a buffer as elements.
    ///
    /// Unless the buffer's length is a multiple of the element size (for a zero-sized `T`,
    /// unless the buffer is empty: its elements take no bytes), the error
    /// ([`Error::InvalidSize`], through [`FromBufferError::error`]; [`Error::InvalidAlignment`]
    /// for a `T` aligned past [`ALIGNMENT`]) hands the buffer back unchanged ([`FromBufferError::into_buffer`]): a refused buffer is neither freed nor lost.
    /// `?` into the crate's [`Error`] drops (frees) it, as dropping it would.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use streamalloc::{CudaResource, Device, DeviceBuffer, DeviceVec, Error, PoolOptions, PoolResource, SimConfig};
    /// # let device = Device::simulated(SimConfig::default());
    /// # let pool = Arc::new(PoolResource::new(CudaResource::new(&device), PoolOptions::default())?);
    /// # let stream = device.create_stream()?;
    /// let buf = DeviceBuffer::new(&pool, 10, &stream)?;
    /// let err = DeviceVec::<u32>::from_buffer(buf).unwrap_err(); // 10 bytes: not whole u32s
    /// assert!(matches!(err.error(), Error::InvalidSize { size: 10, .. }));
    /// let buf = err.into_buffer(); // the same buffer, still ours
    /// let v = DeviceVec::<u16>::from_buffer(buf)?; // 5 u16s
    /// assert_eq!(v.len(), 5);
    /// # Ok::<(), streamalloc::Error>(())
    /// ```
    pub fn from_buffer(buf: DeviceBuffer) -> Result<Self, FromBufferError> {
        if let Err(error) = check_alignment::<T>() {
            return Err(FromBufferError {
                error,
                buffer: Box::new(buf),
            });
        }
        // Zero-sized elements take no bytes, so a buffer's length says nothing of how many
        // there are: only an empty buffer is taken (as no elements). (It used to take a
        // 10-byte buffer as 10 of them.)
        let refused = match size_of::<T>() {
            0 => (!buf.is_empty())
                .then_some("a buffer of zero-sized elements holds no bytes; this one has some"),
            size => (!buf.len().is_multiple_of(size))
                .then_some("the buffer's length is not a multiple of the element size"),
        };
        if let Some(reason) = refused {
            return Err(FromBufferError {
                error: Error::InvalidSize {
                    size: buf.len(),
                    reason,
                },
                buffer: Box::new(buf),
            });
        }
        let len = buf.len().checked_div(size_of::<T>()).unwrap_or(0);
        Ok(Self::from_buffer_unchecked(buf, len))
    }

    /// The untyped buffer.
    pub fn into_buffer(self) -> DeviceBuffer {
        self.buf
    }

    /// The untyped buffer, borrowed.
    pub fn buffer(&self) -> &DeviceBuffer {
        &self.buf
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements the allocation can hold: at least [`len`](Self::len) (`usize::MAX` for a
    /// zero-sized `T`). A resize up to it keeps the memory and its address.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use streamalloc::{CudaResource, Device, DeviceVec, PoolOptions, PoolResource, SimConfig};
    /// # let device = Device::simulated(SimConfig::default());
    /// # let pool = Arc::new(PoolResource::new(CudaResource::new(&device), PoolOptions::default())?);
    /// # let stream = device.create_stream()?;
    /// # let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    /// let mut v = DeviceVec::<u32>::new(&pool, 1000, &stream)?;
    /// let ptr = v.as_ptr();
    /// v.resize(10)?; // smaller: the same memory (RMM's ResizeSmaller)
    /// assert_eq!((v.len(), v.capacity(), v.as_ptr()), (10, 1000, ptr));
    /// # Ok::<(), streamalloc::Error>(())
    /// ```
    pub fn capacity(&self) -> usize {
        match size_of::<T>() {
            0 => usize::MAX,
            size => self.buf.capacity() / size,
        }
    }

    /// Makes room for at least `additional` more elements past [`len`](Self::len), moving the
    /// contents to a new allocation of exactly that much if the capacity is smaller (see
    /// [`DeviceBuffer::reserve`]). The length stays.
    ///
    /// `Err(InvalidSize)` if the new capacity overflows (in elements or in bytes); on any error
    /// the vector is as it was.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use streamalloc::{CudaResource, Device, DeviceVec, PoolOptions, PoolResource, SimConfig};
    /// # let device = Device::simulated(SimConfig::default());
    /// # let pool = Arc::new(PoolResource::new(CudaResource::new(&device), PoolOptions::default())?);
    /// # let stream = device.create_stream()?;
    /// # let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    /// let mut v = DeviceVec::from_host(&pool, &[1.0f32, 2.0], &stream)?;
    /// v.reserve(98)?;
    /// assert_eq!((v.len(), v.capacity()), (2, 100));
    /// let ptr = v.as_ptr();
    /// v.resize(100)?; // fits: no reallocation
    /// assert_eq!(v.as_ptr(), ptr);
    /// assert_eq!(rt.block_on(v.to_host(&stream))?[..2], [1.0, 2.0]);
    /// # Ok::<(), streamalloc::Error>(())
    /// ```
    pub fn reserve(&mut self, additional: usize) -> Result<()> {
        let needed = self.len.checked_add(additional).ok_or(Error::InvalidSize {
            size: additional,
            reason: "the length plus the additional elements overflows usize",
        })?;
        let bytes = bytes_for::<T>(needed)?;
        self.buf.reserve(bytes.saturating_sub(self.buf.len()))
    }

    /// Gives the memory past [`len`](Self::len) back, moving the contents to an allocation of
    /// exactly `len` elements (see [`DeviceBuffer::shrink_to_fit`]): the one call that shrinks
    /// the allocation. On error the vector is as it was.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use streamalloc::{CudaResource, Device, DeviceVec, PoolOptions, PoolResource, SimConfig};
    /// # let device = Device::simulated(SimConfig::default());
    /// # let pool = Arc::new(PoolResource::new(CudaResource::new(&device), PoolOptions::default())?);
    /// # let stream = device.create_stream()?;
    /// # let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    /// let mut v = DeviceVec::from_host(&pool, &[7u64; 1000], &stream)?;
    /// v.resize(3)?;
    /// v.shrink_to_fit()?;
    /// assert_eq!((v.len(), v.capacity()), (3, 3));
    /// assert_eq!(rt.block_on(v.to_host(&stream))?, [7, 7, 7]);
    /// # Ok::<(), streamalloc::Error>(())
    /// ```
    pub fn shrink_to_fit(&mut self) -> Result<()> {
        self.buf.shrink_to_fit()
    }

    /// `Err(IndexOutOfBounds)` unless `index < len`.
    fn check_index(&self, index: usize) -> Result<()> {
        if index < self.len {
            Ok(())
        } else {
            Err(Error::IndexOutOfBounds {
                index,
                len: self.len,
            })
        }
    }

    /// The device address of element `index` (which must be in bounds).
    fn element_ptr(&self, index: usize) -> DevicePtr {
        // In bounds, so `index * size` is below the byte length and cannot overflow.
        self.as_ptr().offset(index * size_of::<T>())
    }

    /// Element `index`, copied to the host after the work queued on the vector's stream so far
    /// (RMM's `element`), without copying the rest. The task waits by `.await`.
    ///
    /// `Err(IndexOutOfBounds)` for `index >= len()`.
    ///
    /// # Cancel safety
    /// Cancel-safe: a dropped future's staging block is reused only once its copy has run.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use streamalloc::{CudaResource, Device, DeviceVec, PoolOptions, PoolResource, SimConfig};
    /// # let device = Device::simulated(SimConfig::default());
    /// # let pool = Arc::new(PoolResource::new(CudaResource::new(&device), PoolOptions::default())?);
    /// # let stream = device.create_stream()?;
    /// # let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    /// let v = DeviceVec::from_host(&pool, &[10u32, 20, 30], &stream)?;
    /// assert_eq!(rt.block_on(v.element(1))?, 20);
    /// assert!(matches!(
    ///     rt.block_on(v.element(3)),
    ///     Err(streamalloc::Error::IndexOutOfBounds { index: 3, len: 3 })
    /// ));
    /// # Ok::<(), streamalloc::Error>(())
    /// ```
    pub async fn element(&self, index: usize) -> Result<T> {
        self.check_index(index)?;
        let mut value = T::zeroed();
        copy_out(
            self.stream(),
            self.element_ptr(index),
            bytemuck::bytes_of_mut(&mut value),
            self.stream(),
        )
        .await?;
        Ok(value)
    }

    /// The first element, or `None` for an empty vector (as `[T]::first`; RMM's
    /// `front_element`). Stream-ordered as [`element`](Self::element).
    ///
    /// # Cancel safety
    /// Cancel-safe, as [`element`](Self::element).
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use streamalloc::{CudaResource, Device, DeviceVec, PoolOptions, PoolResource, SimConfig};
    /// # let device = Device::simulated(SimConfig::default());
    /// # let pool = Arc::new(PoolResource::new(CudaResource::new(&device), PoolOptions::default())?);
    /// # let stream = device.create_stream()?;
    /// # let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    /// let v = DeviceVec::from_host(&pool, &[1i16, 2, 3], &stream)?;
    /// assert_eq!(rt.block_on(v.first())?, Some(1));
    /// assert_eq!(rt.block_on(v.last())?, Some(3));
    /// let empty = DeviceVec::<i16>::new(&pool, 0, &stream)?;
    /// assert_eq!(rt.block_on(empty.first())?, None);
    /// # Ok::<(), streamalloc::Error>(())
    /// ```
    pub async fn first(&self) -> Result<Option<T>> {
        match self.len {
            0 => Ok(None),
            _ => self.element(0).await.map(Some),
        }
    }

    /// The last element, or `None` for an empty vector (as `[T]::last`; RMM's
    /// `back_element`). Stream-ordered as [`element`](Self::element); see
    /// [`first`](Self::first) for an example.
    ///
    /// # Cancel safety
    /// Cancel-safe, as [`element`](Self::element).
    pub async fn last(&self) -> Result<Option<T>> {
        match self.len {
            0 => Ok(None),
            len => self.element(len - 1).await.map(Some),
        }
    }

    /// Writes `value` to element `index`, queued on the vector's stream (RMM's
    /// `set_element_async`): work queued there later sees it. Never blocks on the GPU: the
    /// value is staged through page-locked memory, so unlike RMM's it need not outlive the
    /// call.
    ///
    /// `Err(IndexOutOfBounds)` for `index >= len()`; on a driver error the element may or may
    /// not be written.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use streamalloc::{CudaResource, Device, DeviceVec, PoolOptions, PoolResource, SimConfig};
    /// # let device = Device::simulated(SimConfig::default());
    /// # let pool = Arc::new(PoolResource::new(CudaResource::new(&device), PoolOptions::default())?);
    /// # let stream = device.create_stream()?;
    /// # let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    /// let mut v = DeviceVec::<f64>::zeroed(&pool, 4, &stream)?;
    /// v.set_element(2, 0.5)?;
    /// assert_eq!(rt.block_on(v.to_host(&stream))?, [0.0, 0.0, 0.5, 0.0]);
    /// assert!(v.set_element(4, 1.0).is_err()); // out of bounds: a typed error, nothing written
    /// # Ok::<(), streamalloc::Error>(())
    /// ```
    pub fn set_element(&mut self, index: usize, value: T) -> Result<()> {
        self.check_index(index)?;
        copy_in(
            self.buf.stream(),
            self.element_ptr(index),
            bytemuck::bytes_of(&value),
        )
    }

    /// The device address of the first element.
    pub fn as_ptr(&self) -> DevicePtr {
        self.buf.as_ptr()
    }

    /// The stream it is used on.
    pub fn stream(&self) -> &Stream {
        self.buf.stream()
    }

    /// See [`DeviceBuffer::set_stream`].
    pub fn set_stream(&mut self, stream: &Stream) -> Result<()> {
        self.buf.set_stream(stream)
    }

    /// See [`DeviceBuffer::record_stream`].
    pub fn record_stream(&mut self, other: &Stream) -> Result<()> {
        self.buf.record_stream(other)
    }

    /// The resource it came from.
    pub fn resource(&self) -> &ResourceRef {
        self.buf.resource()
    }

    /// Copies `data` (exactly `len()` elements) in, on its stream. Never blocks on the GPU.
    pub fn copy_from_host(&mut self, data: &[T]) -> Result<()> {
        if data.len() != self.len {
            return Err(Error::InvalidSize {
                size: data.len(),
                reason: "copy_from_host needs exactly the vector's length",
            });
        }
        copy_in(
            self.buf.stream(),
            self.buf.as_ptr(),
            bytemuck::cast_slice(data),
        )
    }

    /// The elements, copied to the host on `stream` after the work queued on the vector's own
    /// stream so far (`stream` is ordered after it GPU-side). The task waits by `.await`.
    ///
    /// A `stream` other than the vector's own is recorded as a use of its memory (as
    /// [`record_stream`](Self::record_stream) would, though this takes `&self`): the vector's
    /// free waits for the copy queued there, whether this future completes, fails or is
    /// dropped. And the vector's own stream is ordered after that copy (GPU-side, once it is
    /// queued): a write there after this future is dropped, such as
    /// [`copy_from_host`](Self::copy_from_host), cannot overtake the read.
    ///
    /// # Cancel safety
    /// Cancel-safe: a dropped future's staging block is reused only once its copy has run, and
    /// the vector's memory is freed only after it.
    pub async fn to_host(&self, stream: &Stream) -> Result<Vec<T>> {
        self.buf.use_on(stream)?;
        let mut out = crate::buffer::copy::host_vec(self.len)?;
        copy_out(
            stream,
            self.as_ptr(),
            bytemuck::cast_slice_mut(&mut out),
            self.stream(),
        )
        .await?;
        Ok(out)
    }

    /// Resizes to `len` elements, keeping the first `min(old, new)`; new elements are
    /// uninitialized. Within the [`capacity`](Self::capacity) the memory and its address stay
    /// (a resize to smaller never reallocates: [`shrink_to_fit`](Self::shrink_to_fit) does);
    /// past it the vector moves to an allocation of exactly `len` elements (see
    /// [`DeviceBuffer::resize`]). On error the vector is as it was.
    pub fn resize(&mut self, len: usize) -> Result<()> {
        self.buf.resize(bytes_for::<T>(len)?)?;
        self.len = len;
        Ok(())
    }

    /// A copy in new memory (of exactly `len()` elements) from the same resource, on the
    /// vector's stream.
    pub fn try_clone(&self) -> Result<Self> {
        Ok(Self::from_buffer_unchecked(self.buf.try_clone()?, self.len))
    }

    /// A copy in new memory from `resource`, for use on `stream`, in one call (RMM's
    /// `device_uvector(other, stream, mr)`): queued on `stream` after the work queued on this
    /// vector's stream so far, with `stream` recorded as a use of this vector (its free waits
    /// for the copy). See [`DeviceBuffer::try_clone_to`] for the errors.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use streamalloc::{CudaResource, Device, DeviceVec, PoolOptions, PoolResource, SimConfig};
    /// # let device = Device::simulated(SimConfig::default());
    /// # let pool = Arc::new(PoolResource::new(CudaResource::new(&device), PoolOptions::default())?);
    /// # let stream = device.create_stream()?;
    /// # let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    /// let host_side = Arc::new(streamalloc::CudaResource::new(&device));
    /// let other = device.create_stream()?;
    /// let v = DeviceVec::from_host(&pool, &[1u8, 2, 3], &stream)?;
    /// let w = v.try_clone_to(&host_side, &other)?;
    /// drop(v); // its free waits for the copy on `other`
    /// assert_eq!(rt.block_on(w.to_host(&other))?, [1, 2, 3]);
    /// # Ok::<(), streamalloc::Error>(())
    /// ```
    pub fn try_clone_to(&self, resource: &impl AsResourceRef, stream: &Stream) -> Result<Self> {
        Ok(Self::from_buffer_unchecked(
            self.buf.try_clone_to(resource, stream)?,
            self.len,
        ))
    }

    /// A vector of `len` elements from `resource` on `stream`, holding a copy of the `T`s at
    /// the device address `src` (queued on `stream`; the host does not wait). See
    /// [`DeviceBuffer::copy_from_device_ptr`].
    ///
    /// `Err(InvalidSize)` if `len` elements overflow `usize` in bytes.
    ///
    /// # Safety
    /// As [`DeviceBuffer::copy_from_device_ptr`], for `len * size_of::<T>()` bytes at `src`,
    /// which hold valid `T`s (any bytes are, for plain data) once the writes ordered before
    /// the copy have run.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use streamalloc::{CudaResource, Device, DeviceVec, PoolOptions, PoolResource, SimConfig};
    /// # let device = Device::simulated(SimConfig::default());
    /// # let pool = Arc::new(PoolResource::new(CudaResource::new(&device), PoolOptions::default())?);
    /// # let stream = device.create_stream()?;
    /// # let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    /// let v = DeviceVec::from_host(&pool, &[5u32, 6, 7, 8], &stream)?;
    /// // SAFETY: the last two elements of `v`: live, written before this point of `stream`, and
    /// // `v` outlives the copy (it is dropped at the end, after the read below).
    /// let tail = unsafe {
    ///     DeviceVec::<u32>::copy_from_device_ptr(&pool, v.as_ptr().offset(8), 2, &stream)?
    /// };
    /// assert_eq!(rt.block_on(tail.to_host(&stream))?, [7, 8]);
    /// # Ok::<(), streamalloc::Error>(())
    /// ```
    pub unsafe fn copy_from_device_ptr(
        resource: &impl AsResourceRef,
        src: DevicePtr,
        len: usize,
        stream: &Stream,
    ) -> Result<Self> {
        let bytes = bytes_for::<T>(len)?;
        // SAFETY: the caller's contract, for these `bytes`.
        let buf = unsafe { DeviceBuffer::copy_from_device_ptr(resource, src, bytes, stream) }?;
        Ok(Self::from_buffer_unchecked(buf, len))
    }
}

/// The error of [`DeviceVec::from_buffer`]: why the buffer was refused, and the buffer itself,
/// handed back unchanged (as `std`'s `IntoInnerError` hands back its writer), so that a refusal
/// loses no memory. Converts into [`Error`] (dropping the buffer, which frees it in stream
/// order as any drop does) for `?`.
pub struct FromBufferError {
    error: Error,
    /// Boxed to keep the `Result` small (the refusal is the rare path).
    buffer: Box<DeviceBuffer>,
}

impl FromBufferError {
    /// Why the buffer was refused ([`Error::InvalidSize`], with its length, or
    /// [`Error::InvalidAlignment`] for an element type aligned past [`ALIGNMENT`]).
    pub fn error(&self) -> &Error {
        &self.error
    }

    /// The refused buffer, as it was given.
    pub fn into_buffer(self) -> DeviceBuffer {
        *self.buffer
    }

    /// Both: the error and the buffer.
    pub fn into_parts(self) -> (Error, DeviceBuffer) {
        (self.error, *self.buffer)
    }
}

impl fmt::Debug for FromBufferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FromBufferError")
            .field("error", &self.error)
            .field("buffer", &self.buffer)
            .finish()
    }
}

impl fmt::Display for FromBufferError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The error's own message (as `std`'s `IntoInnerError`), so `source` stays empty.
        fmt::Display::fmt(&self.error, f)
    }
}

impl std::error::Error for FromBufferError {}

impl From<FromBufferError> for Error {
    /// The error alone; the buffer is dropped (freed in stream order).
    fn from(e: FromBufferError) -> Self {
        e.error
    }
}

/// One `T` in device memory (RMM's `device_scalar`).
pub struct DeviceScalar<T: Pod> {
    vec: DeviceVec<T>,
}

impl<T: Pod> fmt::Debug for DeviceScalar<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceScalar")
            .field("vec", &self.vec)
            .finish()
    }
}

impl<T: Pod> DeviceScalar<T> {
    /// An uninitialized scalar.
    pub fn new(resource: &impl AsResourceRef, stream: &Stream) -> Result<Self> {
        Ok(Self {
            vec: DeviceVec::new(resource, 1, stream)?,
        })
    }

    /// An uninitialized scalar, waiting for memory.
    pub async fn alloc(resource: &impl AsResourceRef, stream: &Stream) -> Result<Self> {
        Ok(Self {
            vec: DeviceVec::alloc(resource, 1, stream).await?,
        })
    }

    /// A scalar holding `value` (copied in on `stream`).
    pub fn from_value(resource: &impl AsResourceRef, value: T, stream: &Stream) -> Result<Self> {
        Ok(Self {
            vec: DeviceVec::from_host(resource, &[value], stream)?,
        })
    }

    /// Sets the value, on its stream.
    pub fn set(&mut self, value: T) -> Result<()> {
        self.vec.copy_from_host(&[value])
    }

    /// The value, after the work queued on its stream so far.
    pub async fn value(&self) -> Result<T> {
        let stream = self.vec.stream().clone();
        Ok(self.vec.to_host(&stream).await?[0])
    }

    /// The device address.
    pub fn as_ptr(&self) -> DevicePtr {
        self.vec.as_ptr()
    }

    /// The stream it is used on.
    pub fn stream(&self) -> &Stream {
        self.vec.stream()
    }

    /// See [`DeviceBuffer::record_stream`].
    pub fn record_stream(&mut self, other: &Stream) -> Result<()> {
        self.vec.record_stream(other)
    }
}

// SAFETY: as for `DeviceBuffer`: a reference to the `CUdeviceptr` (a `u64` field that lives as
// long as the vector), passed by value to the kernel.
unsafe impl<'a, 'b: 'a, T: Pod> cudarc::driver::PushKernelArg<&'b DeviceVec<T>>
    for cudarc::driver::LaunchArgs<'a>
{
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceVec<T>) -> &mut Self {
        self.arg(&arg.buf)
    }
}

// SAFETY: as above.
unsafe impl<'a, 'b: 'a, T: Pod> cudarc::driver::PushKernelArg<&'b mut DeviceVec<T>>
    for cudarc::driver::LaunchArgs<'a>
{
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DeviceVec<T>) -> &mut Self {
        self.arg(&mut arg.buf)
    }
}
