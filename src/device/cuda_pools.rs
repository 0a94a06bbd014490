//! The driver's stream-ordered memory pools on a real GPU: the pool behind `malloc_async`,
//! pools a `CudaAsyncResource` creates or views, their attributes and trim, and the
//! stream-ordered allocations and frees from them. Beside `cuda.rs`, like `cuda_vmm.rs`; every
//! call binds the device's context first.

use std::ffi::c_void;

use cudarc::driver::{result, sys};

use super::cuda::{check, raw, with_capture_relaxed, CudaDevice, Handle, RawPool, RawStream};
use crate::error::{Error, Result};

impl CudaDevice {
    /// The driver pool of `malloc_async`: ours (not the device's default pool, which other
    /// libraries in the process may trim), with the release threshold at its maximum so freed
    /// memory stays in the pool instead of going back to the driver at every synchronize.
    fn pool(&self) -> Result<sys::CUmemoryPool> {
        if let Some(pool) = self.pool.get() {
            return Ok(pool.0);
        }
        let pool = self.create_pool(u64::MAX, 0)?;
        match self.pool.set(pool) {
            Ok(()) => Ok(pool.0),
            Err(_) => {
                // Another thread won the race; keep its pool.
                // SAFETY: `pool` is ours and unused.
                unsafe { self.destroy_pool(pool) };
                Ok(self.pool.get().map_or(pool.0, |p| p.0))
            }
        }
    }

    /// A new driver pool of device memory on this device (`cuMemPoolCreate`), that keeps up to
    /// `release_threshold` bytes of freed memory across synchronizations, and grows to at most
    /// `max_size` bytes (0: the driver's own limit).
    pub(crate) fn create_pool(&self, release_threshold: u64, max_size: usize) -> Result<RawPool> {
        self.ctx.bind()?;
        // SAFETY: an all-zero CUmemPoolProps is valid plain data; we set the fields that matter.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = self.ordinal as i32;
        props.maxSize = max_size;
        // SAFETY: `props` is fully initialized above.
        let pool = with_capture_relaxed(|| unsafe { result::mem_pool::create(&props) })
            .map(Handle)
            .map_err(|e| Error::driver("cuMemPoolCreate", e))?;
        if let Err(e) = self.set_pool_threshold(pool, release_threshold) {
            // SAFETY: the pool is ours and unused.
            unsafe { self.destroy_pool(pool) };
            return Err(e);
        }
        Ok(pool)
    }

    /// The device's default pool (`cuDeviceGetDefaultMemPool`): the one `cuMemAllocAsync`
    /// and other libraries in the process use. Not ours to destroy.
    pub(crate) fn default_pool(&self) -> Result<RawPool> {
        self.ctx.bind()?;
        let dev = result::device::get(self.ordinal as i32)
            .map_err(|e| Error::driver("cuDeviceGet", e))?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `dev` is a valid device (the context is retained) and `pool` is a place for
        // one handle, which the driver writes on success.
        check("cuDeviceGetDefaultMemPool", unsafe {
            sys::cuDeviceGetDefaultMemPool(&mut pool, dev).result()
        })?;
        Ok(Handle(pool))
    }

    /// Reads a `cuuint64_t` attribute of a pool (`cuMemPoolGetAttribute`).
    fn pool_attribute(&self, pool: RawPool, attr: sys::CUmemPool_attribute) -> Result<u64> {
        self.ctx.bind()?;
        let mut value: u64 = 0;
        // SAFETY: the pool is live (its owner holds it), and every attribute read here
        // (thresholds and memory counters) is a cuuint64_t, which `value` is.
        check("cuMemPoolGetAttribute", unsafe {
            result::mem_pool::get_attribute(pool.0, attr, &mut value as *mut u64 as *mut c_void)
        })?;
        Ok(value)
    }

    /// Bytes of device memory the pool holds (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`).
    pub(crate) fn pool_reserved(&self, pool: RawPool) -> Result<u64> {
        self.pool_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
        )
    }

    /// Bytes of the pool in live allocations (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT`).
    pub(crate) fn pool_used(&self, pool: RawPool) -> Result<u64> {
        self.pool_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
        )
    }

    pub(crate) fn pool_threshold(&self, pool: RawPool) -> Result<u64> {
        self.pool_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
        )
    }

    pub(crate) fn set_pool_threshold(&self, pool: RawPool, threshold: u64) -> Result<()> {
        self.ctx.bind()?;
        let mut threshold = threshold;
        // SAFETY: the pool is live; the release threshold attribute is a cuuint64_t, which
        // `threshold` is, and the driver only reads it.
        check("cuMemPoolSetAttribute", unsafe {
            result::mem_pool::set_attribute(
                pool.0,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut threshold as *mut u64 as *mut c_void,
            )
        })
    }

    /// Releases freed memory of the pool, keeping at least `keep` bytes reserved
    /// (`cuMemPoolTrimTo`; a no-op if it reserves less). Memory of frees the GPU has not
    /// reached yet stays.
    pub(crate) fn pool_trim(&self, pool: RawPool, keep: usize) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the pool is live (its owner holds it).
        check(
            "cuMemPoolTrimTo",
            with_capture_relaxed(|| unsafe { result::mem_pool::trim_to(pool.0, keep) }),
        )
    }

    /// `cuMemAllocFromPoolAsync`: `bytes` from `pool`, usable by work queued on `stream` after
    /// this call. With the thread's capture mode relaxed, as the pool's other calls: during a
    /// user's global-mode capture on any thread, `cuMemFreeAsync` on a stream that is not
    /// captured failed with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and spoiled the capture
    /// (run154). (A capturing stream is refused before: `AsyncPool`.)
    pub(crate) fn pool_alloc(&self, pool: RawPool, bytes: usize, stream: RawStream) -> Result<u64> {
        self.ctx.bind()?;
        // SAFETY: pool and stream are live (their owners hold them); the memory handed out is
        // uninitialized device memory, which only unsafe device operations can read.
        with_capture_relaxed(|| unsafe { result::mem_pool::alloc_async(pool.0, bytes, stream.0) })
            .map_err(|e| Error::driver("cuMemAllocFromPoolAsync", e))
    }

    /// Destroys a pool (`cuMemPoolDestroy`). Memory still allocated from it, or whose free the
    /// GPU has not reached yet, is released by the driver once it is all freed.
    ///
    /// # Safety
    /// `pool` came from `create_pool`, is destroyed once, and nothing allocates from it after
    /// this call.
    pub(crate) unsafe fn destroy_pool(&self, pool: RawPool) {
        if self.ctx.bind().is_ok() {
            // SAFETY: the caller's contract.
            let _ = with_capture_relaxed(|| unsafe { result::mem_pool::destroy(pool.0) });
        }
    }

    pub(crate) fn malloc_async(&self, bytes: usize, stream: RawStream) -> Result<u64> {
        let pool = self.pool()?;
        self.pool_alloc(Handle(pool), bytes, stream)
    }

    /// # Safety
    /// `ptr` came from `malloc_async`, and work using it is ordered before this point of
    /// `stream`.
    pub(crate) unsafe fn free_async(&self, ptr: u64, stream: RawStream) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the caller's contract.
        raw(
            "cuMemFreeAsync",
            with_capture_relaxed(|| unsafe { sys::cuMemFreeAsync(ptr, stream.0) }),
        )
    }
}
