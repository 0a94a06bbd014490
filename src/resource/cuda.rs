//! [`CudaResource`]: device memory straight from the driver (`cuMemAlloc` / `cuMemFree`), as
//! RMM's `cuda_memory_resource`.

use std::fmt;

use crate::device::{Device, DevicePtr};
use crate::error::{Error, Result};
use crate::resource::{check_stream, MemoryKind, MemoryResource};
use crate::stream::Stream;

/// Device memory from `cuMemAlloc`, given back with `cuMemFree`: no pooling, no state.
///
/// Every allocation is a driver call, and a slow one: use it as the upstream of a pool, not for
/// buffers made in a loop. What it promises:
///
/// - allocations are at least 256-aligned ([`ALIGNMENT`](crate::ALIGNMENT)); zero bytes gives a
///   null pointer without a driver call, and `deallocate` takes it back with zero bytes;
/// - `allocate` fails with [`Error::OutOfMemory`] carrying the bytes requested, the device's
///   free memory and its total, and the resource works as before afterwards;
/// - `deallocate` ignores stream order the way RMM's `cuda_memory_resource` does: on a GPU,
///   `cuMemFree` waits for all the device's pending work before it frees, so it is safe for
///   memory still used by queued work, but **the calling thread may block** until the device is
///   idle. (The simulated device queues the free on the stream instead, which is as safe and
///   does not block.) Put a pool in front of it where frees must not block.
///
/// It holds only a [`Device`] handle, so it is cheap to make and to clone.
#[derive(Clone)]
pub struct CudaResource {
    device: Device,
}

impl CudaResource {
    /// A resource of `device`'s memory. Makes no driver call.
    pub fn new(device: &Device) -> Self {
        Self {
            device: device.clone(),
        }
    }
}

impl fmt::Debug for CudaResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaResource")
            .field("device", &self.device.id())
            .finish()
    }
}

impl MemoryResource for CudaResource {
    fn device(&self) -> &Device {
        &self.device
    }

    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Device
    }

    /// `cuMemAlloc`: slow, synchronous with respect to the device, not ordered on `stream`
    /// (the memory is usable by any stream at once).
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        check_stream(&self.device, stream)?;
        if bytes == 0 {
            return Ok(DevicePtr(0));
        }
        self.device.malloc(bytes)
    }

    /// `cuMemFree`: may block the calling thread until the device is idle (see the type's
    /// documentation).
    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        check_stream(&self.device, stream)?;
        match (ptr.0, bytes) {
            (0, 0) => Ok(()),
            (0, _) | (_, 0) => Err(Error::UnknownPointer { ptr: ptr.0, bytes }),
            // SAFETY: the caller's contract: `ptr` came from `allocate` (so from
            // `Device::malloc` of this device), is freed once, and its uses are ordered before
            // this point of `stream`.
            _ => unsafe { self.device.free_after(ptr, stream) }.map_err(|e| match e {
                Error::UnknownPointer { ptr, .. } => Error::UnknownPointer { ptr, bytes },
                other => other,
            }),
        }
    }
}
