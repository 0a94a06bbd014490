//! [`CallbackResource`]: allocation and free through closures, RMM's
//! `callback_memory_resource`.

use std::fmt;

use super::{check_stream, MemoryKind, MemoryResource, ALIGNMENT};
use crate::device::{Device, DevicePtr};
use crate::error::{Error, Result};
use crate::stream::Stream;

type AllocateFn = dyn Fn(usize, &Stream) -> Result<DevicePtr> + Send + Sync;
type DeallocateFn = dyn Fn(DevicePtr, usize, &Stream) -> Result<()> + Send + Sync;

/// A resource that allocates and frees through two closures, for memory that comes from
/// somewhere this crate does not know (another library's allocator, a test double). RMM's
/// `callback_memory_resource`, with closures in place of function pointers and a `void*`.
///
/// What it adds to the closures, so that it keeps the [`MemoryResource`] contract:
///
/// - zero bytes returns a null pointer, and a null pointer with zero bytes is taken back,
///   without calling the closures;
/// - a stream of another device is refused ([`Error::WrongDevice`]) before any closure runs,
///   and before the zero-byte case (as every resource refuses it, whatever the size);
/// - a pointer from `allocate` that is null or not 256-aligned is an error
///   ([`Error::InvalidArgument`]; a misaligned one is first given back through `deallocate`);
/// - so `deallocate` refuses a null pointer with a non-zero size, and a misaligned one
///   ([`Error::UnknownPointer`]), without calling the closure.
///
/// Everything else is the closures' business: `deallocate` must be stream-ordered and must not
/// block if the resource is to keep the crate's promises, and the closures are called from
/// whatever threads allocate (hence `Send + Sync`).
///
/// ```
/// use std::sync::Arc;
/// use streamalloc::resource::callback::CallbackResource;
/// use streamalloc::{Device, MemoryResource, SimConfig};
///
/// let device = Device::simulated(SimConfig::default());
/// let (d1, d2) = (device.clone(), device.clone());
/// let allocate = move |bytes, _stream: &_| d1.malloc(bytes);
/// let deallocate = move |ptr, _bytes, stream: &streamalloc::Stream| {
///     stream.synchronize_blocking()?;
///     // SAFETY: only pointers from `malloc` above come back here, once their stream is done.
///     unsafe { d2.free(ptr) }
/// };
/// // SAFETY: every pointer comes from the device's own `malloc`, and goes back to `free` once
/// // the stream that frees it has finished with it.
/// let mr = unsafe { CallbackResource::new(&device, allocate, deallocate) };
/// let stream = device.create_stream()?;
/// let ptr = mr.allocate(1000, &stream)?;
/// // SAFETY: allocated above with 1000 bytes, unused, freed once.
/// unsafe { mr.deallocate(ptr, 1000, &stream)? };
/// # Ok::<(), streamalloc::Error>(())
/// ```
pub struct CallbackResource {
    device: Device,
    kind: MemoryKind,
    allocate: Box<AllocateFn>,
    deallocate: Box<DeallocateFn>,
}

impl fmt::Debug for CallbackResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CallbackResource")
            .field("device", &self.device.id())
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

impl CallbackResource {
    /// A resource of `device` (device memory) whose `allocate(bytes, stream)` calls
    /// `allocate(bytes, stream)` and whose `deallocate(ptr, bytes, stream)` calls
    /// `deallocate(ptr, bytes, stream)`.
    ///
    /// # Safety
    /// The closures keep [`MemoryResource`]'s contract (its "Safety" section): every pointer
    /// `allocate` returns is memory of `device` of at least the bytes asked for, that nothing
    /// else uses until it comes back through `deallocate`; buffers made from this resource
    /// queue copies into it from safe code.
    pub unsafe fn new<A, D>(device: &Device, allocate: A, deallocate: D) -> Self
    where
        A: Fn(usize, &Stream) -> Result<DevicePtr> + Send + Sync + 'static,
        D: Fn(DevicePtr, usize, &Stream) -> Result<()> + Send + Sync + 'static,
    {
        Self {
            device: device.clone(),
            kind: MemoryKind::Device,
            allocate: Box::new(allocate),
            deallocate: Box::new(deallocate),
        }
    }

    /// The same resource, reporting `kind` as the kind of memory its closures hand out.
    ///
    /// # Safety
    /// The closures hand out memory of that kind (code that trusts the kind may access it
    /// from the host).
    pub unsafe fn with_memory_kind(mut self, kind: MemoryKind) -> Self {
        self.kind = kind;
        self
    }
}

// SAFETY: the closures' memory is what `CallbackResource::new`'s caller promised (it is
// `unsafe`); this adds the null, alignment and device checks.
unsafe impl MemoryResource for CallbackResource {
    fn device(&self) -> &Device {
        &self.device
    }

    fn memory_kind(&self) -> MemoryKind {
        self.kind
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        // The stream first, as every other resource does: another device's stream is the
        // caller's mistake whatever the size, and a zero-byte request must not hide it.
        check_stream(&self.device, stream)?;
        if bytes == 0 {
            return Ok(DevicePtr(0));
        }
        let ptr = (self.allocate)(bytes, stream)?;
        if ptr.0 == 0 {
            return Err(Error::InvalidArgument {
                what: "the allocate callback returned a null pointer for a non-zero size",
            });
        }
        if ptr.0 % ALIGNMENT as u64 != 0 {
            if let Err(e) = (self.deallocate)(ptr, bytes, stream) {
                tracing::warn!(error = %e, ptr = ptr.0, "could not give back a misaligned pointer");
            }
            return Err(Error::InvalidArgument {
                what: "the allocate callback returned a pointer that is not 256-byte aligned",
            });
        }
        Ok(ptr)
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        // The stream first, as in `allocate`.
        check_stream(&self.device, stream)?;
        if bytes == 0 {
            return if ptr.0 == 0 {
                Ok(())
            } else {
                Err(Error::UnknownPointer { ptr: ptr.0, bytes })
            };
        }
        // `allocate` never hands out a null or misaligned pointer for a non-zero size (it
        // refuses the closure's), so such a pointer is not ours: refused here, as every other
        // resource refuses it, rather than passed to a closure that may trust it (a review
        // found both reaching the closure).
        if ptr.0 == 0 || !ptr.0.is_multiple_of(ALIGNMENT as u64) {
            return Err(Error::UnknownPointer { ptr: ptr.0, bytes });
        }
        (self.deallocate)(ptr, bytes, stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SimConfig;

    /// A resource whose closures must never run.
    fn never_called(device: &Device) -> CallbackResource {
        let allocate =
            |_: usize, _: &Stream| -> Result<DevicePtr> { panic!("the allocate closure ran") };
        let deallocate = |_: DevicePtr, _: usize, _: &Stream| -> Result<()> {
            panic!("the deallocate closure ran")
        };
        // SAFETY: the closures never hand out or take back memory (they panic if called).
        unsafe { CallbackResource::new(device, allocate, deallocate) }
    }

    #[test]
    fn zero_bytes_on_another_devices_stream_is_refused() {
        let device = Device::simulated(SimConfig::default());
        let other = Device::simulated(SimConfig::default());
        let theirs = other.create_stream().unwrap();
        let mr = never_called(&device);
        assert!(
            matches!(mr.allocate(0, &theirs), Err(Error::WrongDevice { .. })),
            "a zero-byte request on another device's stream was not refused"
        );
        // SAFETY: a null pointer of zero bytes: nothing is freed.
        let freed = unsafe { mr.deallocate(DevicePtr(0), 0, &theirs) };
        assert!(matches!(freed, Err(Error::WrongDevice { .. })), "{freed:?}");
        // On its own device's stream zero bytes is still a null pointer, no closure called.
        let mine = device.create_stream().unwrap();
        assert_eq!(mr.allocate(0, &mine).unwrap(), DevicePtr(0));
        // SAFETY: as above.
        unsafe { mr.deallocate(DevicePtr(0), 0, &mine) }.unwrap();
    }
}
