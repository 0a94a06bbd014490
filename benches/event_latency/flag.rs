//! `--observer flag`: the observer's clock from the GPU's own write into pinned host memory
//! (`cuStreamWriteValue32`, queued right after the awaited event) instead of a second event
//! spun on with `cuEventQuery`. The observer then makes no driver call at all, so it cannot
//! contend with the reactor's and the task's queries for the driver's locks; `doorbell_probe`
//! showed the flag seen within a microsecond of the event (medians).

use std::ffi::c_void;

use cudarc::driver::{result, sys};

/// A pinned, device-mapped word the GPU writes.
pub struct Flag {
    /// The host address (a `*mut u32`, kept as an integer to share it with the observer).
    host: usize,
    /// The device's address of the same word.
    dptr: sys::CUdeviceptr,
}

impl Flag {
    /// A new flag, reading 0; `None` if the driver refuses. The device's context must be current
    /// on the calling thread (it is after any stream operation of this crate on it).
    pub fn new() -> Option<Flag> {
        // SAFETY: a fresh pinned allocation of 64 bytes, freed by `Drop`.
        let host = unsafe {
            result::malloc_host(
                64,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }
        .ok()? as *mut u32;
        // SAFETY: `host` is 64 bytes, ours.
        unsafe { std::ptr::write_volatile(host, 0) };
        let mut dptr: sys::CUdeviceptr = 0;
        // SAFETY: `host` was allocated with DEVICEMAP.
        let mapped =
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, host as *mut c_void, 0) };
        let flag = Flag {
            host: host as usize,
            dptr,
        };
        (mapped == sys::CUresult::CUDA_SUCCESS).then_some(flag)
    }

    /// Queues the GPU's write of `value` on `stream` (a raw `CUstream`), after everything
    /// queued before it; whether the driver took it.
    pub fn write(&self, stream: usize, value: u32) -> bool {
        // SAFETY: `stream` is a live stream of the device whose context is current (the caller
        // just queued work on it); `dptr` maps our pinned word, which outlives the write (the
        // caller sees each write land before the flag is dropped).
        let written =
            unsafe { sys::cuStreamWriteValue32_v2(stream as sys::CUstream, self.dptr, value, 0) };
        written == sys::CUresult::CUDA_SUCCESS
    }

    /// The word, as the GPU last wrote it.
    pub fn read(&self) -> u32 {
        // SAFETY: the allocation lives as long as `self`.
        unsafe { std::ptr::read_volatile(self.host as *const u32) }
    }
}

impl Drop for Flag {
    fn drop(&mut self) {
        // SAFETY: allocated by `new` with cuMemHostAlloc; every write queued to it has landed
        // (each one was read back before the next sample).
        let _ = unsafe { result::free_host(self.host as *mut c_void) };
    }
}
