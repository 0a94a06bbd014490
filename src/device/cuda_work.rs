//! Work queued on a real GPU's stream: copies, memsets, prefetches and the crate's kernels
//! (fill, scale, spin, from the PTX that `cuda.rs` loads). Beside `cuda.rs`, like
//! `cuda_vmm.rs`; every call binds the device's context first.

use std::ffi::c_void;
use std::time::Duration;

use cudarc::driver::{result, sys};

use super::cuda::{check, raw, CudaDevice, RawStream, BLOCK};
use crate::error::Result;

impl CudaDevice {
    /// # Safety
    /// `dst` is `bytes` of live device memory; `src` stays readable until the stream reaches
    /// the copy.
    pub(crate) unsafe fn copy_htod(
        &self,
        dst: u64,
        src: *const u8,
        bytes: usize,
        stream: RawStream,
    ) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the caller's contract.
        raw("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, bytes, stream.0)
        })
    }

    /// # Safety
    /// `src` is `bytes` of live device memory; `dst` stays writable, and untouched by anyone
    /// else, until the stream reaches the copy.
    pub(crate) unsafe fn copy_dtoh(
        &self,
        dst: *mut u8,
        src: u64,
        bytes: usize,
        stream: RawStream,
    ) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the caller's contract.
        raw("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, bytes, stream.0)
        })
    }

    /// # Safety
    /// Both ranges are live device memory.
    pub(crate) unsafe fn copy_dtod(
        &self,
        dst: u64,
        src: u64,
        bytes: usize,
        stream: RawStream,
    ) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the caller's contract.
        raw("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream.0)
        })
    }

    /// # Safety
    /// `dst` is `bytes` of live device memory.
    pub(crate) unsafe fn memset_d8(
        &self,
        dst: u64,
        value: u8,
        bytes: usize,
        stream: RawStream,
    ) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the caller's contract.
        raw("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(dst, value, bytes, stream.0)
        })
    }

    /// # Safety
    /// `dst` is `4 * count` bytes of live, 4-aligned device memory.
    pub(crate) unsafe fn memset_d32(
        &self,
        dst: u64,
        value: u32,
        count: usize,
        stream: RawStream,
    ) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the caller's contract.
        raw("cuMemsetD32Async", unsafe {
            sys::cuMemsetD32Async(dst, value, count, stream.0)
        })
    }

    /// # Safety
    /// `[ptr, ptr + bytes)` is managed memory that stays allocated until the stream reaches this.
    pub(crate) unsafe fn prefetch(&self, ptr: u64, bytes: usize, stream: RawStream) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: an all-zero CUmemLocation is valid plain data; we set both fields.
        let mut location: sys::CUmemLocation = unsafe { std::mem::zeroed() };
        location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        location.id = self.ordinal as i32;
        // SAFETY: the caller's contract; the stream is live.
        check("cuMemPrefetchAsync", unsafe {
            result::mem_prefetch_async(ptr, bytes, location, stream.0)
        })
    }

    fn grid(&self, count: usize) -> u32 {
        let needed = count.div_ceil(BLOCK as usize).max(1);
        needed.min(self.multiprocessors as usize * 8) as u32
    }

    /// Launches one of the crate's grid-stride kernels over `count` elements on `stream`, in
    /// the device's context.
    ///
    /// # Safety
    /// `params` point to values of the types of `function`'s parameters, in order, and every
    /// pointer among them names memory the kernel may touch until the stream has run it.
    unsafe fn launch_over(
        &self,
        function: sys::CUfunction,
        count: usize,
        params: &mut [*mut c_void],
        stream: RawStream,
    ) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the caller's contract; the launch copies the parameter values before it
        // returns, and the grid-stride loop covers `count` elements whatever the grid.
        check("cuLaunchKernel", unsafe {
            result::launch_kernel(
                function,
                (self.grid(count), 1, 1),
                (BLOCK, 1, 1),
                0,
                stream.0,
                params,
            )
        })
    }

    /// # Safety
    /// `dst` is `4 * count` bytes of live, 4-aligned device memory.
    pub(crate) unsafe fn fill_u32(
        &self,
        dst: u64,
        value: u32,
        count: usize,
        stream: RawStream,
    ) -> Result<()> {
        let (mut dst, mut value, mut count64) = (dst, value, count as u64);
        let mut params = [
            &mut dst as *mut u64 as *mut c_void,
            &mut value as *mut u32 as *mut c_void,
            &mut count64 as *mut u64 as *mut c_void,
        ];
        // SAFETY: the parameters match the kernel's signature (u32*, u32, u64) and the launch
        // copies them before returning; `dst` is the caller's contract.
        unsafe { self.launch_over(self.kernels().fill_u32, count, &mut params, stream) }
    }

    /// # Safety
    /// `dst` is `4 * count` bytes of live, 4-aligned device memory.
    pub(crate) unsafe fn scale_f32(
        &self,
        dst: u64,
        factor: f32,
        count: usize,
        stream: RawStream,
    ) -> Result<()> {
        let (mut dst, mut factor, mut count64) = (dst, factor, count as u64);
        let mut params = [
            &mut dst as *mut u64 as *mut c_void,
            &mut factor as *mut f32 as *mut c_void,
            &mut count64 as *mut u64 as *mut c_void,
        ];
        // SAFETY: as in `fill_u32`; the signature is (f32*, f32, u64).
        unsafe { self.launch_over(self.kernels().scale_f32, count, &mut params, stream) }
    }

    /// # Safety
    /// `dst` is `4 * count` bytes of live, 4-aligned device memory.
    pub(crate) unsafe fn fill_pattern_u32(
        &self,
        dst: u64,
        seed: u64,
        count: usize,
        stream: RawStream,
    ) -> Result<()> {
        let function = self.kernels().fill_pattern_u32.clone()?;
        let (mut dst, mut seed, mut count64) = (dst, seed, count as u64);
        let mut params = [
            &mut dst as *mut u64 as *mut c_void,
            &mut seed as *mut u64 as *mut c_void,
            &mut count64 as *mut u64 as *mut c_void,
        ];
        // SAFETY: as in `fill_u32`; the signature is (u32*, u64, u64).
        unsafe { self.launch_over(function, count, &mut params, stream) }
    }

    /// # Safety
    /// `src` is `4 * count` bytes of live, 4-aligned device memory; `counter` is 8 bytes of
    /// live, 8-aligned device memory.
    pub(crate) unsafe fn count_mismatches_u32(
        &self,
        src: u64,
        seed: u64,
        count: usize,
        counter: u64,
        stream: RawStream,
    ) -> Result<()> {
        let function = self.kernels().count_mismatches_u32.clone()?;
        let (mut src, mut seed, mut count64, mut counter) = (src, seed, count as u64, counter);
        let mut params = [
            &mut src as *mut u64 as *mut c_void,
            &mut seed as *mut u64 as *mut c_void,
            &mut count64 as *mut u64 as *mut c_void,
            &mut counter as *mut u64 as *mut c_void,
        ];
        // SAFETY: as in `fill_u32`; the signature is (const u32*, u64, u64, u64*); both
        // pointers are the caller's contract.
        unsafe { self.launch_over(function, count, &mut params, stream) }
    }

    pub(crate) fn spin(&self, duration: Duration, stream: RawStream) -> Result<()> {
        self.ctx.bind()?;
        let mut ns = duration.as_nanos().min(u64::MAX as u128) as u64;
        // Cycles at the highest clock rate: no more than the duration at any real clock.
        let mut cycles =
            (u128::from(ns) * u128::from(self.clock_khz) / 1_000_000).min(u64::MAX as u128) as u64;
        let mut params = [
            &mut ns as *mut u64 as *mut c_void,
            &mut cycles as *mut u64 as *mut c_void,
        ];
        // SAFETY: the kernel takes two u64 and touches no memory.
        check("cuLaunchKernel", unsafe {
            result::launch_kernel(
                self.kernels().spin,
                (1, 1, 1),
                (1, 1, 1),
                0,
                stream.0,
                &mut params,
            )
        })
    }
}
