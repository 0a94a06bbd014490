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
///   idle, **and so may other threads**: while a `cuMemFree` waits, the driver holds up every
///   other thread's kernel launches, event records, copies, host functions (the completion
///   reactor's doorbells among them), stream creations and page-locked allocations on that
///   GPU until it is done (an H100, driver 580.159.04: 950 ms each behind a 1 s kernel on
///   another stream; queries of events and streams, and stream waits, did not wait;
///   BENCHMARKS.md, "A waiting cuMemFree holds up the GPU's other threads"). (The simulated
///   device queues the free on the stream instead, which is as safe and does not block.) Put a
///   pool in front of it where frees must not block, and trim that pool where a pause of every
///   thread's launches is acceptable;
/// - a `deallocate` called on a device's completion reactor thread (a buffer's deferred free,
///   once the other streams it was used on are done) does not block that thread: the
///   `cuMemFree` is handed to the device's blocking-work thread (`sa-blocking-N`), and an error
///   is logged there instead of returned (see the crate docs, "The completion reactor
///   thread").
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

// SAFETY: each allocation is a fresh `cuMemAlloc` (the simulated device's allocation) of at least
// the bytes asked for, freed only through `deallocate`.
unsafe impl MemoryResource for CudaResource {
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
    /// documentation). On a completion reactor thread (a deferred free) it is handed to the
    /// device's blocking-work thread instead, and returns at once.
    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        check_stream(&self.device, stream)?;
        match (ptr.0, bytes) {
            (0, 0) => Ok(()),
            (0, _) | (_, 0) => Err(Error::UnknownPointer { ptr: ptr.0, bytes }),
            _ => {
                let (device, stream) = (self.device.clone(), stream.clone());
                crate::device::run_blocking(
                    &self.device,
                    "cuMemFree (CudaResource::deallocate)",
                    // SAFETY: the caller's contract: `ptr` came from `allocate` (so from
                    // `Device::malloc` of this device), is freed once, and its uses are
                    // ordered before this point of `stream`, so also before any later point
                    // (the blocking-work thread may free it later; nobody else uses it).
                    move || unsafe { free(&device, ptr, bytes, &stream) },
                )
            }
        }
    }
}

/// `cuMemFree` of `bytes` at `ptr` (the simulated device queues the free on `stream`), logged
/// at trace level. Shared with [`ManagedResource`](crate::resource::managed::ManagedResource).
///
/// # Safety
/// `ptr` came from `Device::malloc` or `Device::malloc_managed` of `device`, is freed once, and
/// its uses are ordered before this point of `stream`.
pub(crate) unsafe fn free(
    device: &Device,
    ptr: DevicePtr,
    bytes: usize,
    stream: &Stream,
) -> Result<()> {
    tracing::trace!(?ptr, bytes, "cuMemFree");
    // SAFETY: the caller's contract.
    unsafe { device.free_after(ptr, stream) }.map_err(|e| match e {
        Error::UnknownPointer { ptr, .. } => Error::UnknownPointer { ptr, bytes },
        other => other,
    })
}
