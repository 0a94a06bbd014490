//! The operations a simulated stream queues ([`Op`]): copies, fills, the built-in kernels,
//! markers (events) and frees, with the memory each touches for the race detector. Below both
//! the stream that queues and runs them (`stream.rs`) and the kernels that execute the
//! arithmetic ones (`kernels.rs`).

use std::time::Duration;

use super::marker::SimMarker;
use super::memory::{SimMemory, SimPool};
use super::races::MemoryAccess;
use crate::sync::plain::Arc as PlainArc;
use crate::sync::Arc;

/// A host pointer an operation will read or write when the stream reaches it.
pub(crate) struct HostPtr(pub(crate) *mut u8);

// SAFETY: the caller of the unsafe enqueue method that made this promised the pointee stays
// valid, and is not touched by anyone else, until the stream has executed the operation; only
// the thread that executes it dereferences it (the stream's worker, or under
// `SimExecution::Inline` the queueing thread, under the queue's lock).
unsafe impl Send for HostPtr {}

pub(crate) enum Op {
    Memset8 {
        dst: u64,
        value: u8,
        bytes: usize,
    },
    Memset32 {
        dst: u64,
        value: u32,
        count: usize,
    },
    HtoD {
        dst: u64,
        src: HostPtr,
        bytes: usize,
    },
    DtoH {
        dst: HostPtr,
        src: u64,
        bytes: usize,
    },
    DtoD {
        dst: u64,
        src: u64,
        bytes: usize,
    },
    /// A copy from another simulated device's memory (`cuMemcpyPeerAsync`).
    CopyPeer {
        dst: u64,
        from: PlainArc<SimMemory>,
        src: u64,
        bytes: usize,
    },
    FillU32 {
        dst: u64,
        value: u32,
        count: usize,
    },
    ScaleF32 {
        dst: u64,
        factor: f32,
        count: usize,
    },
    FillPatternU32 {
        dst: u64,
        seed: u64,
        count: usize,
    },
    /// Counts the words of `src` that differ from the pattern of `seed` into the `u64` at
    /// `counter`.
    CountMismatchesU32 {
        src: u64,
        seed: u64,
        count: usize,
        counter: u64,
    },
    Spin(Duration),
    Record(Arc<SimMarker>),
    Wait(Arc<SimMarker>),
    Free(u64),
    /// `cuMemFreeAsync` of memory from a driver pool: the pool keeps the block from here on.
    PoolFree {
        pool: PlainArc<SimPool>,
        ptr: u64,
    },
}

/// An operation's name and the ranges it touches (the first `usize` of the two), for the race
/// detector.
pub(super) type Footprint = (&'static str, [(u64, usize, MemoryAccess); 2], usize);

impl Op {
    /// The first address the operation accesses as a word that is not aligned for the word,
    /// and the alignment it needs: what a GPU refuses (`cuMemsetD32Async`) or faults on (a
    /// kernel's access, `CUDA_ERROR_MISALIGNED_ADDRESS`).
    pub(super) fn misaligned(&self) -> Option<(u64, u64)> {
        let check = |ptr: u64, align: u64| (!ptr.is_multiple_of(align)).then_some((ptr, align));
        match *self {
            Op::Memset32 { dst, .. }
            | Op::FillU32 { dst, .. }
            | Op::ScaleF32 { dst, .. }
            | Op::FillPatternU32 { dst, .. } => check(dst, 4),
            Op::CountMismatchesU32 { src, counter, .. } => {
                check(src, 4).or_else(|| check(counter, 8))
            }
            _ => None,
        }
    }

    /// The memory the operation reads and writes, for the race detector, and its name.
    pub(super) fn footprint(&self) -> Option<Footprint> {
        use MemoryAccess::{Read, Write};
        let words = |count: usize| count.saturating_mul(4);
        let one = |op, ptr, bytes, access| Some((op, [(ptr, bytes, access); 2], 1));
        match *self {
            Op::Memset8 { dst, bytes, .. } => one("memset_d8", dst, bytes, Write),
            Op::Memset32 { dst, count, .. } => one("memset_d32", dst, words(count), Write),
            Op::HtoD { dst, bytes, .. } => one("copy_htod", dst, bytes, Write),
            Op::DtoH { src, bytes, .. } => one("copy_dtoh", src, bytes, Read),
            Op::DtoD { dst, src, bytes } => {
                Some(("copy_dtod", [(src, bytes, Read), (dst, bytes, Write)], 2))
            }
            // The source is another device's memory: its read is checked by that device's
            // detector (`SimStream::push`), the write here.
            Op::CopyPeer { dst, bytes, .. } => one("copy_peer", dst, bytes, Write),
            Op::FillU32 { dst, count, .. } => one("fill_u32", dst, words(count), Write),
            Op::ScaleF32 { dst, count, .. } => one("scale_f32", dst, words(count), Write),
            Op::FillPatternU32 { dst, count, .. } => {
                one("fill_pattern_u32", dst, words(count), Write)
            }
            // The counter is read, added to and written: a write, for the detector.
            Op::CountMismatchesU32 {
                src,
                count,
                counter,
                ..
            } => Some((
                "count_mismatches_u32",
                [(src, words(count), Read), (counter, 8, Write)],
                2,
            )),
            _ => None,
        }
    }
}
