//! `DeviceVec<T>` and `DeviceScalar<T>`: typed device memory for plain-data `T`.

use std::fmt;
use std::marker::PhantomData;
use std::mem::size_of;

use bytemuck::Pod;

use crate::buffer::{copy_in, copy_out, DeviceBuffer};
use crate::device::DevicePtr;
use crate::error::{Error, Result};
use crate::resource::{AsResourceRef, ResourceRef};
use crate::stream::Stream;

fn bytes_for<T>(len: usize) -> Result<usize> {
    len.checked_mul(size_of::<T>()).ok_or(Error::InvalidSize {
        size: len,
        reason: "the element count overflows usize when multiplied by the element size",
    })
}

/// `len()` elements of plain-data `T` in device memory, uninitialized until written (RMM's
/// `device_uvector`). All of [`DeviceBuffer`]'s rules apply: stream-ordered, `record_stream`,
/// a drop that never blocks.
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

    /// Views a buffer as elements; `Err(InvalidSize)` unless its length is a multiple of the
    /// element size.
    pub fn from_buffer(buf: DeviceBuffer) -> Result<Self> {
        if !buf.len().is_multiple_of(size_of::<T>().max(1)) {
            return Err(Error::InvalidSize {
                size: buf.len(),
                reason: "the buffer's length is not a multiple of the element size",
            });
        }
        let len = buf.len() / size_of::<T>().max(1);
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
    /// dropped.
    ///
    /// # Cancel safety
    /// Cancel-safe: a dropped future's staging block is reused only once its copy has run, and
    /// the vector's memory is freed only after it.
    pub async fn to_host(&self, stream: &Stream) -> Result<Vec<T>> {
        self.buf.use_on(stream)?;
        let mut out = vec![T::zeroed(); self.len];
        copy_out(stream, self.as_ptr(), bytemuck::cast_slice_mut(&mut out)).await?;
        Ok(out)
    }

    /// Resizes to `len` elements, keeping the first `min(old, new)`; new elements are
    /// uninitialized.
    pub fn resize(&mut self, len: usize) -> Result<()> {
        self.buf.resize(bytes_for::<T>(len)?)?;
        self.len = len;
        Ok(())
    }

    /// A copy in new memory from the same resource.
    pub fn try_clone(&self) -> Result<Self> {
        Ok(Self::from_buffer_unchecked(self.buf.try_clone()?, self.len))
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
