//! The pattern kernels: fill memory with values unique to a seed, and count, on the GPU, the
//! words that differ from them. What a soak test (`examples/soak.rs`) needs to check every
//! buffer it hands out without copying it back: memory handed out twice, or overwritten by a
//! use that was not ordered, shows as mismatches.

use crate::device::sim::Op;
use crate::device::{sim, DevicePtr, FaultKind};
use crate::error::{Error, Result};
use crate::stream::{check_range, check_word_range, Stream};

impl Stream {
    /// The value that [`fill_pattern_u32`](Self::fill_pattern_u32) writes to word `index` of
    /// memory filled with `seed`: splitmix64's finalizer of `seed + (index + 1) *
    /// 0x9E3779B97F4A7C15`, its two halves xored (the same function as the CUDA kernels'
    /// `streamalloc_pattern` in `kernels/streamalloc.cu`). Seeds that differ give unrelated
    /// sequences.
    ///
    /// ```
    /// use streamalloc::Stream;
    /// assert_ne!(Stream::pattern_u32(1, 0), Stream::pattern_u32(2, 0));
    /// assert_ne!(Stream::pattern_u32(1, 0), Stream::pattern_u32(1, 1));
    /// ```
    pub fn pattern_u32(seed: u64, index: u64) -> u32 {
        sim::pattern_u32(seed, index)
    }

    /// Built-in kernel: writes [`pattern_u32(seed, i)`](Self::pattern_u32) to word `i` of the
    /// `count` 32-bit words at `dst`.
    ///
    /// On CUDA it needs a `kernels/streamalloc.ptx` made from the `.cu` file that has it
    /// (`kernels/build.sh`): with an older one, every launch fails with
    /// [`Error::Driver`] for `cuModuleGetFunction(streamalloc_fill_pattern_u32)`
    /// (`CUDA_ERROR_NOT_FOUND`), and nothing else is affected.
    ///
    /// A range that wraps past the top of the address space is refused with
    /// [`Error::InvalidAddress`] (nothing is queued).
    ///
    /// # Safety
    /// `[dst, dst + 4 * count)` is live, 4-aligned device memory until the stream reaches this.
    pub unsafe fn fill_pattern_u32(&self, dst: DevicePtr, seed: u64, count: usize) -> Result<()> {
        check_word_range(dst, count)?;
        if count == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract.
        self.enqueue(
            FaultKind::Launch,
            |d, s| unsafe { d.fill_pattern_u32(dst.0, seed, count, s) },
            || Op::FillPatternU32 {
                dst: dst.0,
                seed,
                count,
            },
        )
    }

    /// Built-in kernel: adds to the `u64` at `counter` how many of the `count` 32-bit words at
    /// `src` differ from [`pattern_u32(seed, i)`](Self::pattern_u32), in stream order. Only
    /// the count crosses to the host (when it reads the counter), not the memory checked.
    ///
    /// On CUDA each GPU thread adds its own count with one `atomicAdd`, so launches on several
    /// streams may share a counter; the simulated device's race detector still sees each add
    /// as a write of the counter, and reports adds from streams that are not ordered with each
    /// other: give each stream a counter of its own. A kernel missing from an old PTX file
    /// fails as for [`fill_pattern_u32`](Self::fill_pattern_u32).
    ///
    /// Errors: [`Error::InvalidArgument`] if `counter` is not 8-aligned.
    ///
    /// A range that wraps past the top of the address space is refused with
    /// [`Error::InvalidAddress`] (nothing is queued).
    ///
    /// # Safety
    /// `[src, src + 4 * count)` is live, 4-aligned device memory and `[counter, counter + 8)`
    /// live device memory, until the stream reaches this.
    pub unsafe fn count_mismatches_u32(
        &self,
        src: DevicePtr,
        seed: u64,
        count: usize,
        counter: DevicePtr,
    ) -> Result<()> {
        // Wrapping ranges are refused at the call (see `check_range`).
        check_word_range(src, count)?;
        check_range(counter, 8)?;
        if !counter.0.is_multiple_of(8) {
            return Err(Error::InvalidArgument {
                what: "count_mismatches_u32: the counter must be 8-byte aligned",
            });
        }
        if count == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract.
        self.enqueue(
            FaultKind::Launch,
            |d, s| unsafe { d.count_mismatches_u32(src.0, seed, count, counter.0, s) },
            || Op::CountMismatchesU32 {
                src: src.0,
                seed,
                count,
                counter: counter.0,
            },
        )
    }
}
