//! `FixedSizeResource`: blocks of one size, on the same per-stream engine as the pool.

use std::fmt;

// `snapshot()`, in its own file.
mod snapshot;

use super::stream_ordered::{Grow, StreamHeap};
use super::waiters::MemoryWaiters;
use super::{aligned_size, check_stream, MemoryResource, ALIGNMENT};
use crate::device::{Device, DevicePtr};
use crate::error::{Error, Result};
use crate::stream::Stream;
use crate::sync::plain::Arc as StdArc;
use crate::sync::{AtomicBool, AtomicU64, Mutex, Ordering};

/// Blocks of one size (RMM's `fixed_size_memory_resource`): every allocation of at most
/// `block_size` bytes gets one block. Upstream chunks of `blocks_per_chunk` blocks, in the pool's
/// engine (one free list for every stream: same-stream reuse at once, reuse on another stream
/// ordered by an event).
/// Larger requests are an error ([`Error::InvalidSize`]): put it behind a binning resource.
/// Unlike RMM's, which starts out with one chunk of `blocks_per_chunk` blocks, it takes no chunk
/// at construction: the first allocation does.
///
/// It can run out (its upstream refusing a chunk) and get memory back (a block freed through
/// it), so it has its own queue of [`MemoryWaiters`]: [`allocate_async`] waits there for a
/// block, every free notifies it, and so does memory coming back to the upstream's queue, if
/// it has one. Each request counts a whole block of its capacity
/// ([`footprint`](MemoryResource::footprint)).
///
/// Dropping it synchronizes the streams it knows and returns every chunk upstream.
///
/// [`allocate_async`]: crate::AllocateAsync::allocate_async
pub struct FixedSizeResource<U: MemoryResource> {
    upstream: U,
    device: Device,
    block: u64,
    blocks_per_chunk: u64,
    heap: StreamHeap,
    chunks: Mutex<Vec<(u64, u64)>>,
    reserved: AtomicU64,
    own: Stream,
    /// Tasks waiting for a block ([`allocate_async`](crate::AllocateAsync::allocate_async)),
    /// relayed to from the upstream's queue. A review found the resource without one: a
    /// request over an upstream at its maximum failed at once instead of waiting for a block
    /// freed through it.
    waiters: StdArc<MemoryWaiters>,
    /// Set where the upstream's queue relayed a notification during a growth, under the
    /// engine's `slow`: [`allocate`](MemoryResource::allocate) tells the waiters once the
    /// request is over (see `MemoryWaiters::deferring`, and the pool's `tell_waiters`).
    tell_waiters: AtomicBool,
}

impl<U: MemoryResource> fmt::Debug for FixedSizeResource<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FixedSizeResource")
            .field("block_size", &self.block)
            .field("reserved", &self.reserved.load(Ordering::Relaxed))
            .finish()
    }
}

impl<U: MemoryResource> FixedSizeResource<U> {
    /// Blocks of `block_size` bytes (rounded up to 256), taken from `upstream`
    /// `blocks_per_chunk` at a time (RMM's default is 128). Errors for a zero size or count.
    pub fn new(upstream: U, block_size: usize, blocks_per_chunk: usize) -> Result<Self> {
        if block_size == 0 || blocks_per_chunk == 0 {
            return Err(Error::InvalidSize {
                size: 0,
                reason: "a fixed-size resource needs a non-zero block size and blocks per chunk",
            });
        }
        let block = aligned_size(block_size)? as u64;
        block
            .checked_mul(blocks_per_chunk as u64)
            .ok_or(Error::InvalidSize {
                size: blocks_per_chunk,
                reason: "block size times blocks per chunk overflows",
            })?;
        Ok(Self {
            own: upstream.device().create_stream()?,
            waiters: MemoryWaiters::stacked_over(&upstream),
            device: upstream.device().clone(),
            upstream,
            block,
            blocks_per_chunk: blocks_per_chunk as u64,
            heap: StreamHeap::new(),
            chunks: Mutex::new(Vec::new()),
            reserved: AtomicU64::new(0),
            tell_waiters: AtomicBool::new(false),
        })
    }

    /// The size of every block.
    pub fn block_size(&self) -> usize {
        self.block as usize
    }

    /// Bytes held from the upstream.
    pub fn reserved(&self) -> usize {
        self.reserved.load(Ordering::Relaxed) as usize
    }

    /// Checks the invariants of every free list. Slow; for tests.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.heap.check()
    }
}

impl<U: MemoryResource> Grow for FixedSizeResource<U> {
    fn grow(&self, _min: u64, stream: &Stream) -> Result<(u64, u64)> {
        let size = self.block * self.blocks_per_chunk;
        let _span = tracing::debug_span!("grow", chunk = size, block = self.block).entered();
        // Under the engine's `slow`: what the upstream's queue relays here is told once the
        // request is over.
        let ptr = (self.waiters).deferring(&self.tell_waiters, || {
            self.upstream.allocate(size as usize, stream)
        })?;
        // Counted under the chunk list's lock, which `snapshot` reads both under: counted
        // after the lock was let go, a snapshot in between showed chunks summing to more than
        // `reserved`.
        let mut chunks = self.chunks.lock();
        chunks.push((ptr.0, size));
        self.reserved.fetch_add(size, Ordering::Relaxed);
        drop(chunks);
        Ok((ptr.0, size))
    }
}

impl<U: MemoryResource> FixedSizeResource<U> {
    /// Whether `[addr, addr + len)` overlaps one of its chunks: memory it holds, which a free
    /// through another resource over the same upstream must not give back (the binning
    /// resource's fallback and given bins; reviews found wrong-size frees handing a bin's chunk
    /// out twice).
    pub(crate) fn overlaps(&self, addr: u64, len: u64) -> bool {
        let end = addr.saturating_add(len);
        (self.chunks.lock().iter())
            .any(|&(base, size)| addr < base.saturating_add(size) && base < end)
    }
}

// SAFETY: blocks are cut from chunks of the upstream (itself a `MemoryResource`) by the
// stream-ordered engine, whose block table hands out no byte twice and takes back only blocks it
// handed out, in stream order.
unsafe impl<U: MemoryResource> MemoryResource for FixedSizeResource<U> {
    fn device(&self) -> &Device {
        &self.device
    }

    fn memory_kind(&self) -> super::MemoryKind {
        self.upstream.memory_kind()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        // The stream first: another device's stream is the caller's mistake whatever the
        // size, and a zero-byte request must not hide it.
        check_stream(&self.device, stream)?;
        if bytes == 0 {
            return Ok(DevicePtr(0));
        }
        if bytes as u64 > self.block {
            return Err(Error::InvalidSize {
                size: bytes,
                reason: "larger than the fixed-size resource's block size",
            });
        }
        // What a growth holds back, told once the request holds no lock: here, or while a
        // panic unwinds past them.
        let tell = self.waiters.tell_held_back(&self.tell_waiters);
        let taken = self.heap.take(self.block, stream, self);
        drop(tell);
        let ptr = DevicePtr(taken?);
        // The race detector of the simulated device checks blocks, not chunks (a no-op on CUDA).
        self.device
            .note_allocation(ptr, self.block as usize, stream);
        Ok(ptr)
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        check_stream(&self.device, stream)?;
        if bytes == 0 {
            return if ptr.0 == 0 {
                Ok(())
            } else {
                Err(Error::UnknownPointer { ptr: ptr.0, bytes })
            };
        }
        if bytes as u64 > self.block || !ptr.0.is_multiple_of(ALIGNMENT as u64) {
            return Err(Error::UnknownPointer { ptr: ptr.0, bytes });
        }
        // Noted before the block is back in a list, from where another thread may hand it out
        // again; a race's panic (the `Panic` mode) comes once it is back.
        self.device
            .note_free_then(ptr, self.block as usize, stream, || {
                if !self.heap.give(ptr.0, self.block, stream) {
                    return Err(Error::UnknownPointer { ptr: ptr.0, bytes });
                }
                // A block came back: a task waiting in `allocate_async` may take it.
                self.waiters.notify();
                Ok(())
            })
    }

    fn memory_waiters(&self) -> Option<&MemoryWaiters> {
        Some(&self.waiters)
    }

    /// A whole block for any request it serves (zero bytes take nothing): what the request
    /// takes of the upstream's memory, so that an all-or-nothing set of small requests that
    /// needs more blocks than the upstream's maximum holds fails at once instead of waiting
    /// for ever. Larger requests, which `allocate` refuses, count their rounded size.
    fn footprint(&self, bytes: usize) -> Result<usize> {
        match bytes {
            0 => Ok(0),
            b if b as u64 <= self.block => Ok(self.block as usize),
            b => aligned_size(b),
        }
    }

    fn memory_snapshot(&self) -> Option<super::snapshot::Snapshot> {
        Some(self.snapshot())
    }
}

impl<U: MemoryResource> Drop for FixedSizeResource<U> {
    fn drop(&mut self) {
        MemoryWaiters::unstack_from(&self.waiters, &self.upstream);
        if !super::wait_for_streams_at_drop("FixedSizeResource", self.heap.streams()) {
            return;
        }
        for (base, size) in std::mem::take(&mut *self.chunks.lock()) {
            // SAFETY: as in `PoolResource`'s Drop: nothing is handed out any more and every
            // stream that used the memory was synchronized.
            if let Err(e) = unsafe {
                self.upstream
                    .deallocate(DevicePtr(base), size as usize, &self.own)
            } {
                tracing::warn!(error = %e, base, size, "could not return a chunk upstream");
            }
        }
    }
}
