//! How far a suballocator's growth may reach beyond its request: the pool and the arena ask
//! their upstream for more than a request needs (a share of what they hold), and halve the try
//! when it is refused.
//!
//! Over device memory that step is held to the free memory, because a `cuMemAlloc` or
//! `cuMemCreate` short of memory makes the driver release all that every stream-ordered pool
//! of the process keeps (a `CudaAsyncResource`'s, the default pool other libraries allocate
//! from) before it succeeds or fails (`BENCHMARKS.md`, "A failed cuMemAlloc empties the
//! driver's pools"; the simulated device does the same). A step past the free memory would
//! take their caches for memory nobody has asked for yet, or fail and be halved, each failure
//! emptying them again. The request alone may still take them: that memory is needed.

use super::{MemoryKind, ALIGNMENT};
use crate::device::Device;
use crate::sync::{AtomicU64, Ordering};

/// Bytes claimed in a suballocator's `reserved` for an upstream call, given back if that call
/// unwinds (`std::mem::forget` it once the call returns): the room would otherwise stay
/// claimed for good, and the resource short of its maximum ever after (reviews found the pool,
/// then the arena, so).
pub(crate) struct Unreserve<'a> {
    pub(crate) reserved: &'a AtomicU64,
    pub(crate) size: u64,
}

impl Drop for Unreserve<'_> {
    fn drop(&mut self) {
        self.reserved.fetch_sub(self.size, Ordering::AcqRel);
    }
}

/// What a growth beyond its request leaves of the device's free memory: the driver rounds
/// allocations up to its own pages and keeps some memory for itself, so a request of all the
/// free memory may fail.
const FREE_MARGIN: u64 = 64 << 20;

/// Free memory is counted in these (the driver's large pages).
const PAGE: u64 = 2 << 20;

/// `step` (at least `min`, both multiples of [`ALIGNMENT`]) held to what `device` has free
/// less [`FREE_MARGIN`], in whole pages, but never below `min`, when the upstream hands out
/// device memory (`kind`). Other kinds, or a device that cannot say, leave `step` as it is.
/// One `cuMemGetInfo` when the step goes beyond the request.
pub(super) fn step_within_free(device: &Device, kind: MemoryKind, min: u64, step: u64) -> u64 {
    if step <= min || kind != MemoryKind::Device {
        return step;
    }
    let Ok(free) = device.free_memory() else {
        return step;
    };
    let fits = (free as u64).saturating_sub(FREE_MARGIN) / PAGE * PAGE;
    debug_assert_eq!(fits % ALIGNMENT as u64, 0);
    step.min(fits.max(min))
}
