//! Virtual memory management on a real GPU: the driver calls of [`super::vmm`] (reserve an
//! address range, create physical memory a granule at a time, map it, give it access, unmap
//! and release it). A file of its own, beside `cuda.rs`, so that the VMM calls stay together;
//! like `cuda.rs` it binds the device's context before every call.
//!
//! Each unit of the reservation (its `granule`: a multiple of the driver's granularity, the
//! expandable pool's `map_unit`) is its own physical allocation (`cuMemCreate` of one unit):
//! `cuMemUnmap` can only unmap whole mappings, and a pool that returns memory a unit at a time
//! needs a mapping per unit (PyTorch's expandable segments do the same, per segment). What a
//! mapping costs is mostly per allocation, not per byte (`benches/vmm_probe.rs`).

use cudarc::driver::sys;
use rustc_hash::FxHashMap;

use super::cuda::{with_capture_relaxed, CudaDevice};
use crate::error::{Error, Result};
use crate::sync::Mutex;

fn call(name: &'static str, r: sys::CUresult) -> Result<()> {
    r.result().map_err(|e| Error::driver(name, e))
}

/// Device memory of `device`, pinned, with no exportable handle: the physical memory an
/// expandable pool maps.
fn properties(device: &CudaDevice) -> sys::CUmemAllocationProp {
    // SAFETY: an all-zero CUmemAllocationProp is valid plain data (no handle types, no flags);
    // we set the fields that matter.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device.ordinal as i32;
    prop
}

/// The driver's minimum allocation granularity for device memory of `device`
/// (`cuMemGetAllocationGranularity`): 2 MiB on an H100 or H200.
pub(crate) fn granularity(device: &CudaDevice) -> Result<usize> {
    device.ctx.bind()?;
    let prop = properties(device);
    let mut granule = 0usize;
    // SAFETY: `prop` is initialized and the driver writes one size_t into `granule`.
    call("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granule,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    Ok(granule.max(1))
}

/// A reserved virtual address range of a GPU, and the physical allocation mapped at each of
/// its granules.
pub(crate) struct CudaReservation {
    base: u64,
    size: usize,
    granule: usize,
    /// The physical allocation mapped at each mapped granule, by index.
    handles: Mutex<FxHashMap<usize, sys::CUmemGenericAllocationHandle>>,
}

impl CudaReservation {
    /// Reserves `size` bytes (a non-zero multiple of `granule`) of `device`'s address space
    /// (`cuMemAddressReserve`), aligned to the granule.
    pub(crate) fn new(device: &CudaDevice, size: usize, granule: usize) -> Result<Self> {
        device.ctx.bind()?;
        let mut base: sys::CUdeviceptr = 0;
        let r = with_capture_relaxed(|| {
            // SAFETY: the driver writes one device pointer into `base`; no fixed address is
            // asked for (0) and there are no flags.
            unsafe { sys::cuMemAddressReserve(&mut base, size, granule, 0, 0) }
        });
        call("cuMemAddressReserve", r)?;
        Ok(Self {
            base,
            size,
            granule,
            handles: Mutex::new(FxHashMap::default()),
        })
    }

    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    /// Maps granules `first..first + count` (unmapped now), a physical allocation each, and
    /// gives the device read-write access to them. All or none: on a failure midway, what this
    /// call mapped is unmapped and released again.
    ///
    /// With the thread's capture mode relaxed ([`with_capture_relaxed`]): a growth beside a
    /// user's graph capture must not spoil it.
    pub(crate) fn map(&self, device: &CudaDevice, first: usize, count: usize) -> Result<()> {
        with_capture_relaxed(|| self.map_relaxed(device, first, count))
    }

    fn map_relaxed(&self, device: &CudaDevice, first: usize, count: usize) -> Result<()> {
        device.ctx.bind()?;
        let prop = properties(device);
        let mut handles = self.handles.lock();
        let mut done = 0;
        let mut result = Ok(());
        while done < count {
            let index = first + done;
            if handles.contains_key(&index) {
                // Still mapped: an earlier call's rollback could not unmap it (see below), and
                // the pool took it as unmapped. Its memory is there and ours: use it as is.
                done += 1;
                continue;
            }
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: `prop` is initialized; the driver writes one handle on success.
            if let Err(e) = call("cuMemCreate", unsafe {
                sys::cuMemCreate(&mut handle, self.granule, &prop, 0)
            }) {
                result = Err(e);
                break;
            }
            let addr = self.base + (index * self.granule) as u64;
            // SAFETY: `[addr, addr + granule)` lies in our reservation and nothing is mapped
            // there (the table says so, under its lock); `handle` is a fresh allocation of
            // exactly one granule.
            if let Err(e) = call("cuMemMap", unsafe {
                sys::cuMemMap(addr, self.granule, 0, handle, 0)
            }) {
                // SAFETY: our fresh, unmapped handle, released once.
                let _ = unsafe { sys::cuMemRelease(handle) };
                result = Err(e);
                break;
            }
            handles.insert(index, handle);
            done += 1;
        }
        if result.is_ok() {
            // SAFETY: an all-zero CUmemAccessDesc is valid plain data; both fields are set.
            let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
            desc.location = prop.location;
            desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
            let addr = self.base + (first * self.granule) as u64;
            // SAFETY: the range is the granules mapped just above; `desc` is one initialized
            // descriptor.
            result = call("cuMemSetAccess", unsafe {
                sys::cuMemSetAccess(addr, count * self.granule, &desc, 1)
            });
        }
        if result.is_err() {
            for index in first..first + done {
                // SAFETY: mapped by this call a moment ago; nothing has used it (its memory
                // was never handed out).
                if let Err(e) = unsafe { self.unmap_locked(&mut handles, index) } {
                    tracing::warn!(error = %e, index, "could not undo a partial mapping");
                }
            }
        }
        result
    }

    /// Unmaps granule `index` (`cuMemUnmap`) and releases its physical memory
    /// (`cuMemRelease`). Unmapping an unmapped granule does nothing.
    ///
    /// # Safety
    /// No queued or running work uses the granule.
    pub(crate) unsafe fn unmap(&self, device: &CudaDevice, index: usize) -> Result<()> {
        device.ctx.bind()?;
        let mut handles = self.handles.lock();
        // SAFETY: the caller's contract.
        with_capture_relaxed(|| unsafe { self.unmap_locked(&mut handles, index) })
    }

    /// # Safety
    /// As [`unmap`](Self::unmap); the context is bound and `handles` is our table, locked.
    unsafe fn unmap_locked(
        &self,
        handles: &mut FxHashMap<usize, sys::CUmemGenericAllocationHandle>,
        index: usize,
    ) -> Result<()> {
        let Some(&handle) = handles.get(&index) else {
            return Ok(());
        };
        let addr = self.base + (index * self.granule) as u64;
        // SAFETY: exactly the range one cuMemMap mapped; the caller's contract says nothing
        // uses it.
        call("cuMemUnmap", unsafe { sys::cuMemUnmap(addr, self.granule) })?;
        handles.remove(&index);
        // SAFETY: the handle of the mapping just removed, released once.
        if let Err(e) = call("cuMemRelease", unsafe { sys::cuMemRelease(handle) }) {
            // The granule is unmapped all the same, and must be reported so: an error here
            // would leave the pool taking it as mapped, and handing out memory that is not
            // (a review's finding). The physical memory may be lost to the process.
            tracing::warn!(error = %e, index, "unmapped a granule but could not release its memory");
        }
        Ok(())
    }

    /// Unmaps everything and gives the address range back (`cuMemAddressFree`).
    ///
    /// # Safety
    /// No queued or running work uses any of the range, and the reservation is not used again.
    pub(crate) unsafe fn free(&self, device: &CudaDevice) {
        if device.ctx.bind().is_err() {
            return;
        }
        with_capture_relaxed(|| {
            // SAFETY: the caller's contract.
            unsafe { self.free_relaxed(&mut self.handles.lock()) }
        })
    }

    /// # Safety
    /// As [`free`](Self::free); the context is bound and `handles` is our table, locked.
    unsafe fn free_relaxed(
        &self,
        handles: &mut FxHashMap<usize, sys::CUmemGenericAllocationHandle>,
    ) {
        let mut mapped: Vec<usize> = handles.keys().copied().collect();
        mapped.sort_unstable();
        for index in mapped {
            // SAFETY: the caller's contract.
            if let Err(e) = unsafe { self.unmap_locked(handles, index) } {
                tracing::warn!(error = %e, index, "could not unmap a granule");
            }
        }
        // SAFETY: our reservation, with nothing mapped any more, freed once.
        if let Err(e) = call("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(self.base, self.size)
        }) {
            tracing::warn!(error = %e, "could not free a reserved address range");
        }
    }
}
