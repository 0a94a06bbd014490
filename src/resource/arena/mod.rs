//! [`ArenaResource`]: a global arena of superblocks and an arena per stream, RMM's
//! `arena_memory_resource`, for workloads that fragment a best-fit pool.
//!
//! # Design
//!
//! Memory comes from the upstream in *chunks* (the initial size at construction, then growth up
//! to the maximum). The **global arena** holds the free memory of every chunk as *regions*,
//! ordered by address and coalesced (never across two chunks, so each chunk can go back upstream
//! whole), with a size index for best fit. It hands out two things:
//!
//! - **superblocks** (`superblock_size`, 1 MiB by default, RMM's minimum superblock) lent to a
//!   **stream arena**: each stream that allocates has one, and serves every request of at most
//!   `superblock_size` bytes from the superblocks it holds, through its own free list (the
//!   pool's two-level segregated fit: O(1) good fit and coalescing, no merge across two
//!   superblocks). Threads on different streams take different locks: the global arena is not
//!   on the fast path.
//! - **large blocks**: a request above `superblock_size` is carved straight from a global region
//!   (RMM: `global_arena::handles(size)`), and goes back there when freed.
//!
//! A region whose remainder would be smaller than a superblock is handed out whole (the slack
//! stays with the block or superblock and returns with it), so the global arena never keeps
//! slivers no superblock could use.
//!
//! ## Stream order
//!
//! - Memory freed on stream S into S's own arena is reused on S at once, with no event.
//! - A block of S's arena freed on another stream T (a *remote free*) does not enter S's free
//!   list at once: it waits in S's `remote` queue with a handle of T. When S next runs short
//!   (or at a defragmentation), S *adopts* the queue: for each distinct T an event is recorded
//!   on T **then** (the free was issued on T before, so the event comes after it) and S waits on
//!   it on the GPU; then the blocks join S's list. RMM synchronizes T on the host instead.
//! - A superblock that goes back to the global arena, and a large block freed on T, carry a
//!   *guard*: an event recorded on the stream it was last ordered on, when it is given back.
//!   Whoever takes the memory from the global arena later makes its stream wait on every guard
//!   of the region it came from (unless the guard is its own stream's, or already complete).
//!   Coalesced regions keep the union of their guards, one per stream: the latest, known by a
//!   ticket taken together with the recording under the lock of the stream's arena (every
//!   guard of a stream is recorded under it, never under the global lock). A chunk grown on
//!   stream T is guarded by T as well (a stream-ordered upstream hands it out in T's order).
//!
//! ## Superblocks going back, and moving between streams
//!
//! As in RMM, a stream arena keeps its superblocks, wholly free ones included, until a
//! defragmentation: a stream whose use of memory goes up and down does not bounce superblocks
//! through the global arena (each trip costs an event and the global lock). Since every
//! defragmentation comes before any growth, the memory idle streams keep is reclaimed before
//! the arena takes more from the upstream: keeping them costs no peak memory. (Measured on a
//! replay of a million events: keeping at most one free superblock per stream gave the same
//! peak, 20% slower.)
//!
//! A superblock that is only partly free is not stranded with its stream either. RMM's
//! defragmentation hands every superblock, partly used ones included, to the global arena,
//! where any arena can take it. Here, when a small request finds nothing in its stream arena,
//! nor in the global arena after a defragmentation, its stream arena takes over another
//! stream's partly used superblock with a free block large enough (the one with the most free
//! bytes): its stream waits on an event recorded on the donor's stream (every block free in
//! the donor's list was freed there), and the superblock moves with its free blocks, its live
//! blocks and its pending remote frees. A live block freed later on the donor's stream is a
//! remote free of its new owner. So one small live block never keeps the rest of a superblock
//! from the streams that need it (RMM's test "free on another thread after superblocks moved
//! between streams" passes).
//!
//! ## Streams the user drops
//!
//! A stream arena holds a handle of its stream (and so the driver's stream). When the user has
//! dropped the stream, a defragmentation, or the making of the next new stream's arena (a
//! program that drops streams makes others), gives back what its arena holds free (its remote
//! frees adopted first, its free superblocks guarded by an event recorded on the stream, as
//! any superblock going back) and forgets it once it holds nothing, letting go of the stream.
//! One that still holds live blocks stays until they are freed (on another stream) and one of
//! those comes again.
//!
//! ## Chunks going back
//!
//! Free regions never merge across two chunks, so an arena that grew in several chunks could
//! refuse a request for all of its memory while all of it is free. Before it fails for want
//! of room (at its maximum, or the upstream out of memory), it gives every wholly free chunk
//! back upstream (in stream order: on its own stream, after waiting on the GPU for the
//! chunk's guards) and grows one large enough instead, if that makes the room. The chunks
//! leave the global arena, and the room the growth needs is claimed in the reserved count,
//! before the growth lock is let go for the frees (over `CudaResource` each is a `cuMemFree`,
//! which waits for the whole device): other requests grow meanwhile into what room is left,
//! and one that finds nothing at the maximum waits for the give-back to end before it fails.
//! [`trim`](ArenaResource::trim) and [`trim_blocking`](ArenaResource::trim_blocking) give the
//! wholly free chunks back on demand, waiting for the GPU first.
//!
//! ## When memory runs short
//!
//! A request the stream arena cannot serve, in this order: adopt the stream's remote frees;
//! take a superblock (or a large block) from the global arena; then, one request at a time
//! (with `defragment` and `trim`, so that no request looks while memory is on its way from one
//! place to another), try that again; **defragment** (every stream
//! arena adopts its remote frees and returns every wholly free superblock, where they coalesce;
//! arenas of streams the user dropped and that hold nothing are forgotten) and try again; for a
//! small request, **move** a partly used superblock from another stream; **grow** from the
//! upstream (doubling what the arena holds, at least the request, halving the try on failure,
//! never past `maximum`; over device memory no more beyond the request than the device has
//! free, as [`PoolResource`](crate::resource::pool::PoolResource) says under "Growth near the
//! device's limit"), giving wholly free chunks back first where the room needs it, and
//! try again; then [`Error::OutOfMemory`] with the numbers, after logging
//! [`dump`](ArenaResource::dump) at `debug` level.
//!
//! ## Differences from RMM
//!
//! - Nothing blocks the host: RMM synchronizes the freeing stream for a free into another
//!   arena and for a large free, and the whole device before defragmenting; here events order
//!   the streams on the GPU.
//! - RMM's defragmentation moves every superblock to the global arena; here only wholly free
//!   ones go there, and a partly used one moves straight to the stream arena that needs it
//!   (see above): the same memory becomes usable, with one owner at a time for its blocks.
//! - RMM's arena has a fixed size; this one can start small, grow up to `maximum`, and give
//!   wholly free chunks back.
//! - No per-thread arenas: RMM uses them for the per-thread default stream, which this crate
//!   does not have; every stream is explicit.
//!
//! ## Locks
//!
//! One lock for the global arena, one per stream arena, one for the registry of stream arenas.
//! A stream arena's lock may be taken while the registry's or the global one is held, never
//! the other way round, and two stream arenas' locks are never held at once. The allocation
//! fast path takes only its stream arena's lock; a free of a block of another stream's arena
//! looks its owner up under the global lock and takes the owner's lock before letting the
//! global one go, so that a superblock moving between stream arenas (under the global lock)
//! is never seen halfway. No driver call is made under the global lock on the paths that run
//! often: a guard's event is recorded under its stream arena's lock, and guards are merged
//! without querying their events (at most one per stream is kept; waits skip the complete
//! ones). Moving a superblock between streams records and waits under it: rare, and it must
//! not be seen halfway.
//!
//! ## Files
//!
//! `global.rs` (the global arena and its guards), `stream_arena.rs` (a stream's arena and its
//! superblocks), `alloc.rs` (serving and taking back memory), `trim.rs` (chunks going back
//! upstream), `dump.rs` (the dump and the invariant checker).

use std::fmt;

use rustc_hash::FxHashMap;

use self::global::{Global, Guards, WholeChunk};
use self::stream_arena::{cache, StreamArena};
use super::give_backs::GiveBacks;
use super::held_for_trim::HeldForTrim;
use super::waiters::MemoryWaiters;
use super::{aligned_size, check_stream, MemoryKind, MemoryResource, ALIGNMENT};
use crate::device::{Device, DevicePtr};
use crate::error::{Error, Result};
use crate::stream::Stream;
use crate::sync::plain::Arc as StdArc;
use crate::sync::{Arc, AtomicBool, AtomicU64, Mutex, Ordering};

mod alloc;
mod dump;
mod global;
#[cfg(streamalloc_loom)]
pub(crate) mod planted;
mod snapshot;
mod stream_arena;
mod trim;

/// The default superblock size: RMM's minimum superblock, 1 MiB.
pub const DEFAULT_SUPERBLOCK_SIZE: usize = 1 << 20;

/// Sizes of an [`ArenaResource`].
#[derive(Debug, Clone)]
pub struct ArenaOptions {
    /// Bytes taken from the upstream at construction (RMM's `arena_size`; a multiple of 256, may
    /// be 0). RMM's arena never grows; this one grows up to `maximum`, so set both to the same
    /// value for RMM's behaviour.
    pub initial: usize,
    /// The most the arena may hold from its upstream (a multiple of 256, at least `initial`);
    /// `None` for the device's total memory.
    pub maximum: Option<usize>,
    /// The size of the superblocks lent to stream arenas, and the threshold above which a request
    /// is served by the global arena directly (a multiple of 256, at least 256). Default 1 MiB,
    /// RMM's minimum superblock.
    ///
    /// Requests above it all take the global arena's one lock, so threads that make many of them
    /// do not scale: on `churn-4t` (requests up to 8 MiB, a fifth of them above 1 MiB) four
    /// threads took 377 to 406 ns per operation with the default and 55 to 71 with 8 MiB
    /// superblocks, for the same peak memory (`BENCHMARKS.md`). Set it at least as large as the
    /// requests a thread makes often; each stream arena then holds superblocks that large.
    pub superblock_size: usize,
}

impl Default for ArenaOptions {
    fn default() -> Self {
        Self {
            initial: 0,
            maximum: None,
            superblock_size: DEFAULT_SUPERBLOCK_SIZE,
        }
    }
}

/// What an arena holds and has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ArenaStats {
    /// Bytes held from the upstream.
    pub reserved: usize,
    /// The most ever held from the upstream.
    pub peak_reserved: usize,
    /// Upstream chunks held.
    pub chunks: usize,
    /// Bytes handed out (rounded up to 256 bytes). A block freed on another stream than its
    /// owner's counts as given back at once, though its owner adopts it into its free list
    /// only later (`remote_frees_pending` counts those).
    pub in_use: usize,
    /// Free bytes in the global arena.
    pub global_free: usize,
    /// Free regions in the global arena.
    pub global_free_regions: usize,
    /// The largest free region of the global arena: the largest large block it can serve now.
    pub largest_global_free: usize,
    /// Free bytes inside superblocks lent to stream arenas.
    pub arena_free: usize,
    /// Superblocks lent to stream arenas.
    pub superblocks: usize,
    /// Stream arenas.
    pub streams: usize,
    /// Large blocks handed out by the global arena.
    pub large_allocations: usize,
    /// Blocks freed on another stream than their arena's, not adopted yet.
    pub remote_frees_pending: usize,
    /// Defragmentations run (on allocation failure or by [`ArenaResource::defragment`]).
    pub defragments: u64,
    /// Times the arena grew from its upstream after construction.
    pub grows: u64,
    /// Partly used superblocks moved from one stream arena to another, for requests nothing
    /// else could serve.
    pub superblock_moves: u64,
    /// Wholly free chunks given back upstream (by a trim, or to grow a larger one).
    pub chunks_released: u64,
}

static NEXT_UID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

// ===== the resource =====

/// RMM's `arena_memory_resource`: a global arena of superblocks from the upstream, and an arena
/// per stream that takes superblocks from it. Small requests (up to the superblock size) are
/// served by the stream's arena under the stream's own lock; larger ones by the global arena.
/// Memory is reused in stream order: at once on the stream that freed it, and on another stream
/// only after that stream waits on an event (see the [module documentation](self) for the
/// design).
///
/// Compared with [`PoolResource`](super::pool::PoolResource), whose per-stream lists share
/// blocks of any size, the arena keeps each stream's small blocks inside its own superblocks,
/// so long-lived small blocks scattered over the pool do not cut up the memory that large
/// requests need: the workloads that fragment a best-fit pool.
///
/// On failure it defragments (returns every stream arena's free superblocks to the global
/// arena, where they coalesce) and tries again, then moves a partly used superblock of another
/// stream to the requesting one (small requests), then grows up to its maximum, giving wholly
/// free chunks back upstream first where that makes the room; then [`Error::OutOfMemory`].
/// [`trim`](Self::trim) gives wholly free chunks back on demand. [`dump`](Self::dump)
/// describes its state; it is logged with `tracing::debug!` when it runs out.
///
/// Dropping it synchronizes the streams it knows and returns every chunk upstream.
pub struct ArenaResource<U: MemoryResource> {
    upstream: U,
    device: Device,
    superblock: u64,
    maximum: u64,
    /// Distinguishes this resource's entries in the thread-local cache.
    uid: u64,
    global: Mutex<Global>,
    registry: Mutex<FxHashMap<u64, Arc<StreamArena>>>,
    /// Held by whatever moves memory between the stream arenas, the global arena and the
    /// upstream (a request past its first try, `defragment`, `trim`): one at a time, so that a
    /// request about to fail sees no memory halfway between two places.
    slow: Mutex<()>,
    /// Bytes held from the upstream, including chunks being grown, and the room that a request
    /// giving whole chunks back to grow claims until it grows (`GrowthClaim`): changed
    /// only under `slow`, except when a give-back of chunks fails (their bytes stay).
    reserved: AtomicU64,
    peak_reserved: AtomicU64,
    grows: AtomicU64,
    defragments: AtomicU64,
    superblock_moves: AtomicU64,
    chunks_released: AtomicU64,
    /// Tickets of guard events (see `record_guard`).
    next_ticket: AtomicU64,
    /// Tasks waiting in `allocate_async` for memory to come back. The upstream's queue, if it
    /// has one, relays to it ([`MemoryWaiters::stacked_over`]), as the pool's does.
    waiters: StdArc<MemoryWaiters>,
    /// Set where the upstream's queue relayed a notification during a growth, under `slow`:
    /// [`allocate`](MemoryResource::allocate) tells the waiters once the request is over
    /// (see `MemoryWaiters::deferring`, and the pool's `tell_waiters`).
    tell_waiters: AtomicBool,
    /// Whole chunks that trims took out of the global arena and hold while they wait for the
    /// streams that last used them: a request at the maximum takes them back
    /// (`resource/held_for_trim.rs`), as the pool's does.
    held_for_trim: HeldForTrim<WholeChunk>,
    /// A stream of the arena's own, for the initial chunk and for returning chunks upstream.
    own: Stream,
    /// Requests giving whole chunks back upstream to grow, with `slow` let go: a request at the
    /// maximum waits for one to end before it fails, since the room comes back at its end.
    give_backs: GiveBacks,
}

impl<U: MemoryResource> fmt::Debug for ArenaResource<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ArenaResource")
            .field("upstream", &self.upstream)
            .field("superblock_size", &self.superblock)
            .field("maximum", &self.maximum)
            .field("stats", &self.stats())
            .finish()
    }
}

impl<U: MemoryResource> ArenaResource<U> {
    /// An arena over `upstream`. Errors: sizes that are not multiples of 256, a zero superblock
    /// size, `initial` above `maximum` ([`Error::InvalidSize`]); the upstream's error if it
    /// cannot provide `initial`.
    pub fn new(upstream: U, options: ArenaOptions) -> Result<Self> {
        let device = upstream.device().clone();
        // The default is the device's memory, rounded down to the alignment: a device (a
        // simulated one, made with any size) need not hold a multiple of 256 bytes, and a
        // maximum the user never gave must not be refused.
        let maximum = (options.maximum).unwrap_or(device.total_memory() / ALIGNMENT * ALIGNMENT);
        let checks: [(usize, bool, &'static str); 3] = [
            (
                options.initial,
                options.initial.is_multiple_of(ALIGNMENT),
                "the arena's initial size must be a multiple of 256 bytes",
            ),
            (
                maximum,
                maximum.is_multiple_of(ALIGNMENT),
                "the arena's maximum size must be a multiple of 256 bytes",
            ),
            (
                options.superblock_size,
                options.superblock_size >= ALIGNMENT
                    && options.superblock_size.is_multiple_of(ALIGNMENT),
                "the arena's superblock size must be a non-zero multiple of 256 bytes",
            ),
        ];
        for (size, ok, reason) in checks {
            if !ok {
                return Err(Error::InvalidSize { size, reason });
            }
        }
        if options.initial > maximum {
            return Err(Error::InvalidSize {
                size: options.initial,
                reason: "the arena's initial size is above its maximum",
            });
        }
        if options.superblock_size > maximum {
            // Small requests grow by a whole superblock: above the maximum, every one would
            // fail with memory "available" (a review's finding).
            return Err(Error::InvalidSize {
                size: options.superblock_size,
                reason: "the arena's superblock size is above its maximum",
            });
        }
        let own = device.create_stream()?;
        // After the last step that can fail before the arena exists (whose drop undoes it).
        let waiters = MemoryWaiters::stacked_over(&upstream);
        let arena = Self {
            own,
            device,
            upstream,
            superblock: options.superblock_size as u64,
            maximum: maximum as u64,
            uid: NEXT_UID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            global: Mutex::new(Global::new()),
            registry: Mutex::new(FxHashMap::default()),
            slow: Mutex::new(()),
            reserved: AtomicU64::new(0),
            peak_reserved: AtomicU64::new(0),
            grows: AtomicU64::new(0),
            defragments: AtomicU64::new(0),
            superblock_moves: AtomicU64::new(0),
            chunks_released: AtomicU64::new(0),
            next_ticket: AtomicU64::new(0),
            tell_waiters: AtomicBool::new(false),
            waiters,
            held_for_trim: HeldForTrim::new(),
            give_backs: GiveBacks::new(),
        };
        if options.initial > 0 {
            let size = options.initial as u64;
            let ptr = arena.upstream.allocate(options.initial, &arena.own)?;
            // Allocated in stream order on our own stream; once that has run, any stream may
            // use it without waiting.
            if let Err(e) = arena.own.synchronize_blocking() {
                // SAFETY: just allocated from this upstream with this size, never handed out.
                let _ = unsafe { arena.upstream.deallocate(ptr, options.initial, &arena.own) };
                return Err(e);
            }
            arena.reserved.store(size, Ordering::Relaxed);
            arena.peak_reserved.store(size, Ordering::Relaxed);
            let mut global = arena.global.lock();
            global.chunks.insert(ptr.0, size);
            global.insert_free(ptr.0, size, Guards::default());
        }
        Ok(arena)
    }

    /// The upstream resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }

    /// The most the arena may hold from its upstream.
    pub fn maximum(&self) -> usize {
        self.maximum as usize
    }

    /// The superblock size, which is also the largest request a stream arena serves.
    pub fn superblock_size(&self) -> usize {
        self.superblock as usize
    }

    /// What the arena holds and has done. Takes every lock: not for a hot loop.
    ///
    /// The global arena's lock is held while the stream arenas are read (as `check_invariants`
    /// takes them): a superblock taken from the global arena between the two reads was counted
    /// twice, free there and in its stream arena (a review's finding), and one moving between
    /// two stream arenas (under the global lock) could show in both. A superblock on its way
    /// between the global arena and a stream arena may still show in neither for a moment.
    pub fn stats(&self) -> ArenaStats {
        let mut stats = ArenaStats {
            reserved: self.reserved.load(Ordering::Relaxed) as usize,
            peak_reserved: self.peak_reserved.load(Ordering::Relaxed) as usize,
            defragments: self.defragments.load(Ordering::Relaxed),
            grows: self.grows.load(Ordering::Relaxed),
            superblock_moves: self.superblock_moves.load(Ordering::Relaxed),
            chunks_released: self.chunks_released.load(Ordering::Relaxed),
            ..ArenaStats::default()
        };
        let global = self.global.lock();
        stats.chunks = global.chunks.len();
        stats.global_free = global.free_bytes() as usize;
        stats.global_free_regions = global.regions.len();
        stats.largest_global_free = global.largest_free() as usize;
        stats.superblocks = global.lent.len();
        stats.large_allocations = global.large.len();
        stats.in_use = global.large.values().map(|l| l.size as usize).sum();
        // Global, then registry, then each stream arena: the order `check_invariants` uses, and
        // nothing takes the global lock under the registry's or a stream arena's.
        let arenas = self.arenas();
        stats.streams = arenas.len();
        for arena in arenas {
            let state = arena.state.lock();
            stats.arena_free += state.free.free_bytes() as usize;
            let used: u64 = state.superblocks.values().map(|sb| sb.used).sum();
            stats.in_use += used.saturating_sub(state.remote_bytes()) as usize;
            stats.remote_frees_pending += state.remote.len();
        }
        drop(global);
        stats
    }

    /// Every stream arena, in stream order.
    fn arenas(&self) -> Vec<Arc<StreamArena>> {
        let mut arenas: Vec<(u64, Arc<StreamArena>)> = self
            .registry
            .lock()
            .iter()
            .map(|(&id, a)| (id, a.clone()))
            .collect();
        arenas.sort_unstable_by_key(|&(id, _)| id);
        arenas.into_iter().map(|(_, a)| a).collect()
    }

    /// Returns every stream arena's wholly free superblocks to the global arena, where they
    /// coalesce, after each arena adopts the blocks freed on other streams; forgets the arenas
    /// of streams the user dropped once they hold nothing. What `allocate` does before it
    /// fails; call it to make the memory that idle streams keep available to large requests.
    /// Never blocks on the GPU. Returns how many superblocks went back.
    pub fn defragment(&self) -> usize {
        let returned = {
            let _slow = self.slow.lock();
            self.defragment_quietly()
        };
        if returned > 0 {
            self.waiters.notify();
        }
        returned
    }
}

// SAFETY: blocks are cut from chunks of the upstream (itself a `MemoryResource`); the global and
// stream arenas hand out no byte twice, and a block freed on another stream enters its arena's
// free list only after an event on that stream is waited on (`arena`, "Stream order").
unsafe impl<U: MemoryResource> MemoryResource for ArenaResource<U> {
    fn device(&self) -> &Device {
        &self.device
    }

    fn memory_kind(&self) -> MemoryKind {
        self.upstream.memory_kind()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        // The stream first: another device's stream is the caller's mistake whatever the
        // size, and a zero-byte request must not hide it.
        check_stream(&self.device, stream)?;
        if bytes == 0 {
            return Ok(DevicePtr(0));
        }
        let size = aligned_size(bytes)? as u64;
        if size > self.maximum {
            return Err(self.out_of_memory(size));
        }
        // What a growth holds back, told once the request holds no lock: here, or while a
        // panic unwinds past them.
        let tell = self.waiters.tell_held_back(&self.tell_waiters);
        let taken = if size <= self.superblock {
            self.allocate_small(size, stream)
        } else {
            self.allocate_large(size, stream)
        };
        drop(tell);
        let ptr = DevicePtr(taken?);
        // The race detector of the simulated device checks blocks, not chunks (a no-op on CUDA).
        self.device.note_allocation(ptr, size as usize, stream);
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
        let size = aligned_size(bytes)? as u64;
        if !ptr.0.is_multiple_of(ALIGNMENT as u64) {
            return Err(Error::UnknownPointer { ptr: ptr.0, bytes });
        }
        // Noted before the block is back in the arena, from where another thread may hand it
        // out; a race's panic (the `Panic` mode) comes once it is back.
        self.device.note_free_then(ptr, size as usize, stream, || {
            if size <= self.superblock {
                self.free_small(ptr.0, size, stream)
            } else {
                self.free_large(ptr.0, size, stream)
            }
            .map_err(|e| match e {
                Error::UnknownPointer { ptr, .. } => Error::UnknownPointer { ptr, bytes },
                other => other,
            })?;
            self.waiters.notify();
            Ok(())
        })
    }

    /// The set's total, each request rounded up, against the maximum.
    fn check_set(&self, sizes: &[usize]) -> Result<()> {
        super::check_set_within(sizes, self.maximum(), aligned_size)
    }

    fn memory_waiters(&self) -> Option<&MemoryWaiters> {
        Some(&self.waiters)
    }

    fn memory_snapshot(&self) -> Option<super::snapshot::Snapshot> {
        Some(self.snapshot())
    }
}

impl<U: MemoryResource> Drop for ArenaResource<U> {
    fn drop(&mut self) {
        MemoryWaiters::unstack_from(&self.waiters, &self.upstream);
        cache::forget(self.uid);
        // Frees may still be queued on the streams the arenas belong to, or on the streams that
        // guard free regions: let them run, then give every chunk back on our own stream.
        let arenas = std::mem::take(&mut *self.registry.lock());
        let mut streams = Vec::new();
        for arena in arenas.values() {
            streams.push(arena.stream.clone());
            streams.extend(arena.state.lock().remote.iter().map(|r| r.stream.clone()));
        }
        if !super::wait_for_streams_at_drop("ArenaResource", streams) {
            // Kept: the stream arenas (and the lent superblocks holding them) go, the chunks
            // stay allocated.
            return;
        }
        let mut global = std::mem::replace(&mut *self.global.lock(), Global::new());
        let mut withheld = Vec::new();
        for (&addr, region) in &global.regions {
            for guard in &region.guards.0 {
                let _ = guard.event.synchronize_blocking();
                // Its wait failed, yet nothing says the GPU is done with the region: its chunk
                // is leaked below, not freed under work that may still use it.
                if guard.event.withholds_callbacks() {
                    withheld.push((addr, region.size));
                }
            }
        }
        for (addr, size) in withheld {
            global.leak(addr, size);
        }
        // The lent superblocks hold the stream arenas: drop them before the chunks go.
        global.lent.clear();
        drop(arenas);
        let _ = self.own.synchronize_blocking();
        for (base, size) in std::mem::take(&mut global.chunks) {
            if global.holds_leaked(base, size) {
                tracing::error!(
                    base,
                    size,
                    "an arena chunk with leaked memory is not returned upstream"
                );
                continue;
            }
            // SAFETY: the arena is going away, so nothing is handed out from it any more, and
            // no buffer holds memory from it (buffers keep the resource alive); every stream
            // that used it was synchronized above.
            if let Err(e) = unsafe {
                self.upstream
                    .deallocate(DevicePtr(base), size as usize, &self.own)
            } {
                tracing::warn!(error = %e, base, size, "could not return an arena chunk upstream");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resource::cuda::CudaResource;
    use crate::SimConfig;

    #[test]
    fn a_region_whose_guard_withholds_its_callbacks_is_not_handed_out() {
        let device = Device::simulated(SimConfig::default());
        let options = ArenaOptions {
            initial: 8 << 20,
            maximum: Some(32 << 20),
            superblock_size: 1 << 20,
        };
        let r = ArenaResource::new(CudaResource::new(&device), options).unwrap();
        let (s1, s2) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        // A large block (above the superblock size), still in use on `s1` when freed there.
        let ptr = r.allocate(2 << 20, &s1).unwrap();
        s1.spin(std::time::Duration::from_millis(300)).unwrap();
        // SAFETY: allocated above, unused on the host; freed once.
        unsafe { r.deallocate(ptr, 2 << 20, &s1) }.unwrap();
        let event = {
            let global = r.global.lock();
            let guards = &global.regions[&ptr.0].guards.0;
            let guard = guards.iter().find(|g| g.stream == s1.id()).unwrap();
            guard.event.clone()
        };
        event.withhold_callbacks_for_test();
        assert!(event.withholds_callbacks());
        // Its result is an error, but nothing says the GPU is done with the region: `s2` must
        // not get it (before, the error was taken for done, and `s2` did not even wait).
        let next = r.allocate(2 << 20, &s2).unwrap();
        assert_ne!(
            next, ptr,
            "a region was handed out with nothing saying the GPU was done with it"
        );
        r.check_invariants().unwrap();
        // A trim neither fails on it nor gives its chunk back upstream.
        r.trim_blocking().unwrap();
        assert!(r.global.lock().holds_leaked(ptr.0, 2 << 20));
        r.check_invariants().unwrap();
        // SAFETY: as above.
        unsafe { r.deallocate(next, 2 << 20, &s2) }.unwrap();
        s1.synchronize_blocking().unwrap();
        s2.synchronize_blocking().unwrap();
    }
}
