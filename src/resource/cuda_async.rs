//! [`CudaAsyncResource`]: the driver's stream-ordered allocator (`cuMemAllocFromPoolAsync` /
//! `cuMemFreeAsync`) on a pool of its own, as RMM's `cuda_async_memory_resource`.

use std::fmt;

use crate::device::{AsyncPool, AsyncPoolSettings, Device, DevicePtr};
use crate::error::{Error, Result};
use crate::resource::{check_stream, MemoryKind, MemoryResource};
use crate::stream::Stream;

/// Settings of a [`CudaAsyncResource`].
///
/// ```
/// use streamalloc::resource::cuda_async::CudaAsyncOptions;
///
/// // Prime the pool with 256 MiB, keep at most 1 GiB of freed memory across synchronizations.
/// let options = CudaAsyncOptions {
///     initial_pool_size: Some(256 << 20),
///     release_threshold: Some(1 << 30),
///     ..CudaAsyncOptions::default()
/// };
/// ```
#[derive(Debug, Clone, Default)]
pub struct CudaAsyncOptions {
    /// How many freed bytes the pool keeps when a stream, an event or the device synchronizes
    /// (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`); above it, freed memory goes back to the device.
    /// `None`: keep everything (the threshold at its maximum), so steady-state allocation never
    /// reaches the driver's slow path; [`CudaAsyncResource::trim_to`] gives memory back.
    pub release_threshold: Option<usize>,
    /// Bytes to allocate and free once at construction, so the pool starts with that much
    /// memory (RMM's `initial_pool_size`). Only stays if the release threshold allows it.
    /// `None` or zero: start empty.
    pub initial_pool_size: Option<usize>,
    /// The most the pool may hold (`CUmemPoolProps::maxSize`); `None`: the device's memory.
    pub maximum_pool_size: Option<usize>,
}

/// Device memory from the driver's stream-ordered allocator, on a driver pool that this
/// resource creates and owns (not the device's default pool, which other libraries in the
/// process may reconfigure or trim).
///
/// What it promises:
///
/// - `allocate` is `cuMemAllocFromPoolAsync` on the given stream and `deallocate` is
///   `cuMemFreeAsync` on it: truly stream-ordered, and neither blocks the host. Memory freed on
///   one stream is reused by another only once the driver has ordered the two (it tracks
///   that itself);
/// - allocations are at least 256-aligned; zero bytes gives a null pointer without a driver
///   call, and `deallocate` takes it back with zero bytes;
/// - `allocate` fails with [`Error::OutOfMemory`] carrying the bytes requested, what could
///   still be had (the device's free memory plus what the pool keeps, within the pool's
///   maximum) and the maximum; the resource works as before afterwards;
/// - [`trim_to`](Self::trim_to), [`reserved_bytes`](Self::reserved_bytes) and
///   [`used_bytes`](Self::used_bytes) expose the pool's state;
/// - dropping it destroys the pool. Memory still allocated from it is released by the driver
///   once freed, so drop every buffer made from it first; buffers hold a
///   [`ResourceRef`](crate::ResourceRef), so as long as they are made through one they keep
///   the resource alive and this happens by itself.
///
/// On the simulated device the pool is modelled: see `SimPool` in the device layer. Freed
/// blocks are kept once the stream reaches the free and are reused for requests of the same
/// rounded size; the release threshold is applied at each free rather than at each
/// synchronization.
pub struct CudaAsyncResource {
    pool: AsyncPool,
}

impl CudaAsyncResource {
    /// A resource with a new driver pool on `device`.
    ///
    /// With `initial_pool_size`, it allocates that much on a stream of its own, frees it and
    /// waits for that stream (a blocking wait of a few milliseconds at most), so the memory is
    /// in the pool when `new` returns.
    ///
    /// Errors: [`Error::Driver`] if the pool cannot be made, [`Error::OutOfMemory`] if the
    /// initial size cannot be had, [`Error::InvalidSize`] for a maximum of zero.
    pub fn new(device: &Device, options: CudaAsyncOptions) -> Result<Self> {
        let pool = AsyncPool::new(
            device,
            AsyncPoolSettings {
                release_threshold: options.release_threshold.map_or(u64::MAX, |t| t as u64),
                maximum: options.maximum_pool_size,
            },
        )?;
        let resource = Self { pool };
        if let Some(initial) = options.initial_pool_size.filter(|&n| n > 0) {
            let stream = device.create_stream()?;
            let ptr = resource.pool.alloc_async(initial, &stream)?;
            // SAFETY: `ptr` was just allocated from this pool on `stream`, nothing uses it, and
            // it is freed once.
            unsafe { resource.pool.free_async(ptr, &stream) }?;
            stream.synchronize_blocking()?;
        }
        tracing::debug!(
            device = device.id(),
            initial = options.initial_pool_size,
            release_threshold = options.release_threshold,
            maximum = options.maximum_pool_size,
            "created a stream-ordered driver pool"
        );
        Ok(resource)
    }

    /// Gives freed memory back to the device until the pool holds at most `keep_bytes`
    /// (`cuMemPoolTrimTo`). Memory in use, and memory whose free the GPU has not reached yet,
    /// stays: synchronize the streams that freed it first to give all of it back. Never
    /// blocks on the GPU.
    pub fn trim_to(&self, keep_bytes: usize) -> Result<()> {
        let _span = tracing::debug_span!("trim", keep_bytes).entered();
        self.pool.trim_to(keep_bytes)
    }

    /// Bytes of device memory the pool holds: in use and freed-but-kept
    /// (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`). The driver reserves in large chunks, so this
    /// can exceed the sum of the allocations.
    pub fn reserved_bytes(&self) -> Result<usize> {
        self.pool.reserved()
    }

    /// Bytes of the pool in live allocations (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT`).
    pub fn used_bytes(&self) -> Result<usize> {
        self.pool.used()
    }

    /// The release threshold in bytes (`usize::MAX`: keep everything).
    pub fn release_threshold(&self) -> Result<usize> {
        self.pool
            .release_threshold()
            .map(|t| usize::try_from(t).unwrap_or(usize::MAX))
    }

    /// Sets the release threshold (see [`CudaAsyncOptions::release_threshold`]).
    pub fn set_release_threshold(&self, bytes: usize) -> Result<()> {
        self.pool.set_release_threshold(bytes as u64)
    }

    /// The most the pool may hold: its maximum size, or the device's memory.
    pub fn maximum_bytes(&self) -> usize {
        self.pool.maximum()
    }
}

impl fmt::Debug for CudaAsyncResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaAsyncResource")
            .field("pool", &self.pool)
            .finish()
    }
}

impl MemoryResource for CudaAsyncResource {
    fn device(&self) -> &Device {
        self.pool.device()
    }

    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Device
    }

    /// `cuMemAllocFromPoolAsync` on `stream`. Never blocks.
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        check_stream(self.pool.device(), stream)?;
        if bytes == 0 {
            return Ok(DevicePtr(0));
        }
        self.pool.alloc_async(bytes, stream)
    }

    /// `cuMemFreeAsync` on `stream`. Never blocks.
    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        check_stream(self.pool.device(), stream)?;
        match (ptr.0, bytes) {
            (0, 0) => Ok(()),
            (0, _) | (_, 0) => Err(Error::UnknownPointer { ptr: ptr.0, bytes }),
            // SAFETY: the caller's contract: `ptr` came from `allocate` (so from this pool),
            // is freed once, and its uses are ordered before this point of `stream`.
            _ => unsafe { self.pool.free_async(ptr, stream) }.map_err(|e| match e {
                Error::UnknownPointer { ptr, .. } => Error::UnknownPointer { ptr, bytes },
                other => other,
            }),
        }
    }
}
