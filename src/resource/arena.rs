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
//!   ticket taken under the global lock together with the recording. A chunk grown on stream T
//!   is guarded by T as well (a stream-ordered upstream hands it out in T's order).
//!
//! ## Superblocks going back
//!
//! As in RMM, a stream arena keeps its superblocks, wholly free ones included, until a
//! defragmentation: a stream whose use of memory goes up and down does not bounce superblocks
//! through the global arena (each trip costs an event and the global lock). Since every
//! defragmentation comes before any growth, the memory idle streams keep is reclaimed before
//! the arena takes more from the upstream: keeping them costs no peak memory. (Measured on a
//! replay of a million events: keeping at most one free superblock per stream gave the same
//! peak, 20% slower.)
//!
//! ## When memory runs short
//!
//! A request the stream arena cannot serve, in this order: adopt the stream's remote frees;
//! take a superblock (or a large block) from the global arena; **defragment** (every stream
//! arena adopts its remote frees and returns every wholly free superblock, where they coalesce;
//! arenas of streams the user dropped and that hold nothing are forgotten) and try again; grow
//! from the upstream (doubling what the arena holds, at least the request, halving the try on
//! failure, never past `maximum`) and try again; then [`Error::OutOfMemory`] with the numbers,
//! after logging [`dump`](ArenaResource::dump) at `debug` level.
//!
//! ## Differences from RMM
//!
//! - Nothing blocks the host: RMM synchronizes the freeing stream for a free into another
//!   arena and for a large free, and the whole device before defragmenting; here events order
//!   the streams on the GPU.
//! - RMM's defragmentation moves every superblock, partly used ones included, to the global
//!   arena; here only wholly free ones go (a partly used superblock stays with its stream, so
//!   its live blocks keep one owner).
//! - RMM's arena has a fixed size; this one can start small and grow up to `maximum`.
//! - No per-thread arenas: RMM uses them for the per-thread default stream, which this crate
//!   does not have; every stream is explicit.
//!
//! ## Locks
//!
//! One lock for the global arena, one per stream arena, one for the registry of stream arenas.
//! A stream arena's lock may be taken while the registry's is held (and, in the invariant
//! checker only, the global one), never the other way round; the allocation and free paths
//! never hold a stream arena's lock and the global lock at once.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::{self, Write as _};

use rustc_hash::FxHashMap;

use super::free_list::FreeList;
use super::waiters::MemoryWaiters;
use super::{aligned_size, check_stream, MemoryKind, MemoryResource, ALIGNMENT};
use crate::device::{Device, DevicePtr};
use crate::error::{Error, Result};
use crate::event::Event;
use crate::stream::{Stream, StreamId};
use crate::sync::{Arc, AtomicU64, Mutex, Ordering};

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
    /// is served by the global arena directly (a multiple of 256, at least 256). Default 1 MiB.
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
    /// Bytes handed out (rounded up to 256 bytes; a block freed on another stream counts until
    /// its owner adopts it).
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
}

// ===== guards =====

/// An event that whoever takes a piece of memory must be ordered after.
#[derive(Clone)]
struct Guard {
    stream: StreamId,
    /// Taken under the global lock together with the recording: of two guards of one stream,
    /// the higher ticket is the later event.
    ticket: u64,
    event: Event,
}

/// The guards of a free region: at most one per stream.
#[derive(Clone, Default)]
struct Guards(Vec<Guard>);

impl Guards {
    fn one(guard: Guard) -> Self {
        Guards(vec![guard])
    }

    fn add(&mut self, guard: Guard) {
        match self.0.iter_mut().find(|g| g.stream == guard.stream) {
            Some(g) if g.ticket < guard.ticket => *g = guard,
            Some(_) => {}
            None => self.0.push(guard),
        }
    }

    fn merge(&mut self, other: Guards) {
        for guard in other.0 {
            self.add(guard);
        }
        self.prune();
    }

    /// Drops the guards the GPU has passed.
    fn prune(&mut self) {
        self.0.retain(|g| !g.event.is_complete());
    }

    /// Makes `stream` wait for every guard of another stream that is not complete yet.
    fn order(&self, stream: &Stream) -> Result<()> {
        for g in &self.0 {
            if g.stream != stream.id() && !g.event.is_complete() {
                stream.wait(&g.event)?;
            }
        }
        Ok(())
    }

    fn describe(&self) -> String {
        if self.0.is_empty() {
            return String::new();
        }
        let streams: Vec<String> = self.0.iter().map(|g| g.stream.to_string()).collect();
        format!(", ordered after {}", streams.join(", "))
    }
}

// ===== the global arena =====

struct Region {
    size: u64,
    guards: Guards,
}

/// A superblock lent to a stream arena.
struct Lent {
    size: u64,
    arena: Arc<StreamArena>,
}

/// A large block: the size asked for, and the extent handed out (the size, or a whole region).
#[derive(Clone, Copy)]
struct Large {
    size: u64,
    extent: u64,
}

struct Global {
    /// Free regions: address → region. Coalesced within a chunk.
    regions: BTreeMap<u64, Region>,
    /// The same regions as (size, address), for best fit.
    by_size: BTreeSet<(u64, u64)>,
    /// Superblocks lent to stream arenas: base → owner.
    lent: BTreeMap<u64, Lent>,
    /// Large blocks handed out: address → sizes.
    large: FxHashMap<u64, Large>,
    /// Upstream chunks: base → size. No region merges across a chunk's base.
    chunks: BTreeMap<u64, u64>,
    next_ticket: u64,
}

impl Global {
    fn new() -> Self {
        Self {
            regions: BTreeMap::new(),
            by_size: BTreeSet::new(),
            lent: BTreeMap::new(),
            large: FxHashMap::default(),
            chunks: BTreeMap::new(),
            next_ticket: 0,
        }
    }

    /// Records a guard on `stream`. Recording under the global lock makes tickets follow the
    /// order of the events on each stream.
    fn guard(&mut self, stream: &Stream) -> Result<Guard> {
        let event = stream.record()?;
        self.next_ticket += 1;
        Ok(Guard {
            stream: stream.id(),
            ticket: self.next_ticket,
            event,
        })
    }

    fn free_bytes(&self) -> u64 {
        self.regions.values().map(|r| r.size).sum()
    }

    fn largest_free(&self) -> u64 {
        self.by_size.iter().next_back().map_or(0, |&(size, _)| size)
    }

    /// Gives `[addr, addr + size)` back, merging it with free neighbours of the same chunk.
    fn insert_free(&mut self, mut addr: u64, mut size: u64, mut guards: Guards) {
        let left = self
            .regions
            .range(..addr)
            .next_back()
            .filter(|(&a, r)| a + r.size == addr)
            .map(|(&a, _)| a);
        if let Some(left) = left.filter(|_| !self.chunks.contains_key(&addr)) {
            if let Some(region) = self.regions.remove(&left) {
                self.by_size.remove(&(region.size, left));
                guards.merge(region.guards);
                addr = left;
                size += region.size;
            }
        }
        let end = addr + size;
        if !self.chunks.contains_key(&end) {
            if let Some(region) = self.regions.remove(&end) {
                self.by_size.remove(&(region.size, end));
                guards.merge(region.guards);
                size += region.size;
            }
        }
        guards.prune();
        self.by_size.insert((size, addr));
        self.regions.insert(addr, Region { size, guards });
    }

    /// Takes `need` bytes from the best-fitting region, or, if no region holds `need`, a whole
    /// region of at least `min` bytes. The rest of the region stays unless it would be smaller
    /// than `split_min`; then the whole region goes. Returns (address, extent, guards).
    fn take(&mut self, need: u64, min: u64, split_min: u64) -> Option<(u64, u64, Guards)> {
        let fit = self
            .by_size
            .range((need, 0)..)
            .next()
            .or_else(|| self.by_size.range((min, 0)..).next())
            .copied()?;
        let (size, addr) = fit;
        self.by_size.remove(&fit);
        let region = self.regions.remove(&addr)?;
        if size >= need && size - need >= split_min {
            let rest = Region {
                size: size - need,
                guards: region.guards.clone(),
            };
            self.by_size.insert((rest.size, addr + need));
            self.regions.insert(addr + need, rest);
            Some((addr, need, region.guards))
        } else {
            Some((addr, size, region.guards))
        }
    }

    /// The stream arena holding the superblock that contains `[addr, addr + size)`.
    fn owner_of(&self, addr: u64, size: u64) -> Option<Arc<StreamArena>> {
        let (&base, lent) = self.lent.range(..=addr).next_back()?;
        (addr + size <= base + lent.size).then(|| lent.arena.clone())
    }
}

// ===== stream arenas =====

struct Superblock {
    size: u64,
    /// Bytes handed out from it, including blocks freed on other streams not adopted yet.
    used: u64,
}

/// A block of this arena freed on another stream, waiting to be adopted.
struct Remote {
    addr: u64,
    size: u64,
    stream: Stream,
}

struct ArenaState {
    /// Free blocks of every superblock; each superblock's base is a boundary.
    free: FreeList,
    superblocks: BTreeMap<u64, Superblock>,
    remote: Vec<Remote>,
    /// Forgotten by the registry (its stream was dropped and it held nothing): look again.
    retired: bool,
}

/// The arena of one stream.
struct StreamArena {
    stream: Stream,
    state: Mutex<ArenaState>,
}

enum LocalFree {
    /// Freed.
    Done,
    /// In one of this arena's superblocks, but already free.
    DoubleFree,
    /// Not in this arena.
    NotMine,
}

impl ArenaState {
    fn new() -> Self {
        Self {
            free: FreeList::new(),
            superblocks: BTreeMap::new(),
            remote: Vec::new(),
            retired: false,
        }
    }

    /// The base of the superblock containing `[addr, addr + size)`.
    fn find(&self, addr: u64, size: u64) -> Option<u64> {
        let (&base, sb) = self.superblocks.range(..=addr).next_back()?;
        (addr + size <= base + sb.size).then_some(base)
    }

    fn take(&mut self, size: u64) -> Option<u64> {
        let addr = self.free.take(size)?;
        if let Some((_, sb)) = self.superblocks.range_mut(..=addr).next_back() {
            sb.used += size;
        }
        Some(addr)
    }

    fn add_superblock(&mut self, base: u64, size: u64) {
        self.superblocks.insert(base, Superblock { size, used: 0 });
        self.free.add_boundary(base);
        let given = self.free.give(base, size);
        debug_assert!(given, "a new superblock overlapped free memory");
    }

    /// Takes a wholly free superblock out of the arena.
    fn remove_superblock(&mut self, base: u64) -> Option<(u64, u64)> {
        let size = self.superblocks.get(&base).filter(|sb| sb.used == 0)?.size;
        if !self.free.take_exact(base, size) {
            debug_assert!(false, "an unused superblock is not one free block");
            return None;
        }
        self.superblocks.remove(&base);
        self.free.remove_boundary(base);
        Some((base, size))
    }

    /// Gives a block back to its superblock (which stays, even if wholly free, until a
    /// defragmentation).
    fn give(&mut self, addr: u64, size: u64) -> LocalFree {
        let Some(base) = self.find(addr, size) else {
            return LocalFree::NotMine;
        };
        if !self.free.give(addr, size) {
            return LocalFree::DoubleFree;
        }
        let Some(sb) = self.superblocks.get_mut(&base) else {
            return LocalFree::NotMine;
        };
        debug_assert!(sb.used >= size, "more freed than handed out");
        sb.used = sb.used.saturating_sub(size);
        LocalFree::Done
    }

    /// Takes every wholly free superblock out.
    fn take_all_empty(&mut self) -> Vec<(u64, u64)> {
        let empty: Vec<u64> = self
            .superblocks
            .iter()
            .filter(|(_, sb)| sb.used == 0)
            .map(|(&b, _)| b)
            .collect();
        empty
            .into_iter()
            .filter_map(|b| self.remove_superblock(b))
            .collect()
    }

    fn remote_bytes(&self) -> u64 {
        self.remote.iter().map(|r| r.size).sum()
    }
}

#[cfg(not(streamalloc_loom))]
mod cache {
    //! The thread-local cache of the last (arena resource, stream) → stream arena lookup. Not
    //! under loom: loom objects must not outlive a model.
    use std::cell::RefCell;

    use super::StreamArena;
    use crate::sync::Arc;

    thread_local! {
        static LAST: RefCell<Option<(u64, u64, Arc<StreamArena>)>> = const { RefCell::new(None) };
    }

    pub(super) fn get(uid: u64, stream: u64) -> Option<Arc<StreamArena>> {
        LAST.with(|last| match &*last.borrow() {
            Some((u, s, arena)) if *u == uid && *s == stream => Some(arena.clone()),
            _ => None,
        })
    }

    pub(super) fn put(uid: u64, stream: u64, arena: &Arc<StreamArena>) {
        // `try_with`: during thread teardown the cache may already be gone.
        let _ = LAST.try_with(|last| *last.borrow_mut() = Some((uid, stream, arena.clone())));
    }

    pub(super) fn forget(uid: u64) {
        let _ = LAST.try_with(|last| {
            let mut last = last.borrow_mut();
            if matches!(&*last, Some((u, _, _)) if *u == uid) {
                *last = None;
            }
        });
    }
}

#[cfg(streamalloc_loom)]
mod cache {
    use super::StreamArena;
    use crate::sync::Arc;

    pub(super) fn get(_: u64, _: u64) -> Option<Arc<StreamArena>> {
        None
    }

    pub(super) fn put(_: u64, _: u64, _: &Arc<StreamArena>) {}

    pub(super) fn forget(_: u64) {}
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
/// arena, where they coalesce) and tries again, then grows up to its maximum; then
/// [`Error::OutOfMemory`]. [`dump`](Self::dump) describes its state; it is logged with
/// `tracing::debug!` when it runs out.
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
    /// Bytes held from the upstream, including chunks being grown.
    reserved: AtomicU64,
    peak_reserved: AtomicU64,
    grows: AtomicU64,
    defragments: AtomicU64,
    /// Tasks waiting in `allocate_async` for memory to come back.
    waiters: MemoryWaiters,
    /// A stream of the arena's own, for the initial chunk and for returning chunks at drop.
    own: Stream,
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
        let maximum = options.maximum.unwrap_or(device.total_memory());
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
        let arena = Self {
            own: device.create_stream()?,
            device,
            upstream,
            superblock: options.superblock_size as u64,
            maximum: maximum as u64,
            uid: NEXT_UID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            global: Mutex::new(Global::new()),
            registry: Mutex::new(FxHashMap::default()),
            reserved: AtomicU64::new(0),
            peak_reserved: AtomicU64::new(0),
            grows: AtomicU64::new(0),
            defragments: AtomicU64::new(0),
            waiters: MemoryWaiters::new(),
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

    /// What the arena holds and has done. Takes every lock in turn: not for a hot loop.
    pub fn stats(&self) -> ArenaStats {
        let mut stats = ArenaStats {
            reserved: self.reserved.load(Ordering::Relaxed) as usize,
            peak_reserved: self.peak_reserved.load(Ordering::Relaxed) as usize,
            defragments: self.defragments.load(Ordering::Relaxed),
            grows: self.grows.load(Ordering::Relaxed),
            ..ArenaStats::default()
        };
        {
            let global = self.global.lock();
            stats.chunks = global.chunks.len();
            stats.global_free = global.free_bytes() as usize;
            stats.global_free_regions = global.regions.len();
            stats.largest_global_free = global.largest_free() as usize;
            stats.superblocks = global.lent.len();
            stats.large_allocations = global.large.len();
            stats.in_use = global.large.values().map(|l| l.size as usize).sum();
        }
        let arenas = self.arenas();
        stats.streams = arenas.len();
        for arena in arenas {
            let state = arena.state.lock();
            stats.arena_free += state.free.free_bytes() as usize;
            let used: u64 = state.superblocks.values().map(|sb| sb.used).sum();
            stats.in_use += used.saturating_sub(state.remote_bytes()) as usize;
            stats.remote_frees_pending += state.remote.len();
        }
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

    /// A description of the arena's state, RMM's `dump_memory_log`: what it holds, the global
    /// arena's free regions (with the fragmentation of its free memory, `1 - largest free
    /// region / free bytes`), and each stream arena's superblocks. Logged at `debug` level when
    /// an allocation fails.
    pub fn dump(&self) -> String {
        let stats = self.stats();
        let mut out = String::new();
        let _ = writeln!(
            out,
            "arena resource on {}: reserved {} in {} chunk(s) (peak {}, maximum {}), in use {}, \
             superblock size {}",
            self.device,
            fmt_bytes(stats.reserved as u64),
            stats.chunks,
            fmt_bytes(stats.peak_reserved as u64),
            fmt_bytes(self.maximum),
            fmt_bytes(stats.in_use as u64),
            fmt_bytes(self.superblock),
        );
        let _ = writeln!(
            out,
            "  defragmentations: {}, grows: {}",
            stats.defragments, stats.grows
        );
        {
            let global = self.global.lock();
            let free = global.free_bytes();
            let largest = global.largest_free();
            let _ = writeln!(
                out,
                "  global arena: {} free region(s), {} free, largest {}, fragmentation {:.2}%",
                global.regions.len(),
                fmt_bytes(free),
                fmt_bytes(largest),
                fragmentation(free, largest)
            );
            for (&addr, region) in &global.regions {
                let _ = writeln!(
                    out,
                    "    free region {:#x}..{:#x} ({}){}",
                    addr,
                    addr + region.size,
                    fmt_bytes(region.size),
                    region.guards.describe()
                );
            }
            let large: u64 = global.large.values().map(|l| l.extent).sum();
            let _ = writeln!(
                out,
                "  large blocks: {} ({}), superblocks lent: {}",
                global.large.len(),
                fmt_bytes(large),
                global.lent.len()
            );
        }
        let arenas = self.arenas();
        let _ = writeln!(out, "  stream arenas: {}", arenas.len());
        for arena in arenas {
            let state = arena.state.lock();
            let _ = writeln!(
                out,
                "    {}: {} superblock(s), {} free in {} block(s), {} remote free(s) pending{}",
                arena.stream.id(),
                state.superblocks.len(),
                fmt_bytes(state.free.free_bytes()),
                state.free.len(),
                state.remote.len(),
                if arena.stream.handle_count() == 1 {
                    " (stream dropped)"
                } else {
                    ""
                }
            );
            for (&base, sb) in &state.superblocks {
                let _ = writeln!(
                    out,
                    "      superblock {:#x}..{:#x} ({}): {} in use{}",
                    base,
                    base + sb.size,
                    fmt_bytes(sb.size),
                    fmt_bytes(sb.used),
                    if sb.used == 0 { " (free)" } else { "" }
                );
            }
        }
        out
    }

    /// Returns every stream arena's wholly free superblocks to the global arena, where they
    /// coalesce, after each arena adopts the blocks freed on other streams; forgets the arenas
    /// of streams the user dropped once they hold nothing. What `allocate` does before it
    /// fails; call it to make the memory that idle streams keep available to large requests.
    /// Never blocks on the GPU. Returns how many superblocks went back.
    pub fn defragment(&self) -> usize {
        let _span = tracing::debug_span!("defragment").entered();
        let mut returned = 0;
        for arena in self.arenas() {
            let remote = std::mem::take(&mut arena.state.lock().remote);
            if !remote.is_empty() {
                if let Err(e) = self.adopt(&arena, remote, None) {
                    tracing::debug!(error = %e, stream = %arena.stream.id(), "could not adopt remote frees");
                }
            }
            let empty = arena.state.lock().take_all_empty();
            returned += empty.len();
            self.release(&arena, empty);
            // Forget the arena of a stream the user dropped, once it holds nothing.
            if arena.stream.handle_count() == 1 {
                let mut registry = self.registry.lock();
                let mut state = arena.state.lock();
                if state.superblocks.is_empty() && state.remote.is_empty() {
                    state.retired = true;
                    registry.remove(&arena.stream.id().get());
                }
            }
        }
        self.defragments.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(returned, "defragmented");
        if returned > 0 {
            self.waiters.notify();
        }
        returned
    }

    /// Checks the invariants of the global arena and of every stream arena, and that their
    /// memory tiles the upstream chunks exactly. Slow; for tests.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let global = self.global.lock();
        let arenas = self.arenas();
        let mut pieces: Vec<(u64, u64, &'static str)> = Vec::new();
        let mut last_end: Option<u64> = None;
        for (&addr, region) in &global.regions {
            if region.size == 0 || !region.size.is_multiple_of(ALIGNMENT as u64) {
                return Err(format!("region {addr:#x}: bad size {}", region.size));
            }
            if !global.by_size.contains(&(region.size, addr)) {
                return Err(format!("region {addr:#x}: missing from the size index"));
            }
            if last_end == Some(addr) && !global.chunks.contains_key(&addr) {
                return Err(format!("regions at {addr:#x} not coalesced"));
            }
            last_end = Some(addr + region.size);
            pieces.push((addr, region.size, "free region"));
        }
        if global.by_size.len() != global.regions.len() {
            return Err("the size index and the regions disagree".into());
        }
        for (&base, lent) in &global.lent {
            pieces.push((base, lent.size, "superblock"));
            let state = lent.arena.state.lock();
            match state.superblocks.get(&base) {
                Some(sb) if sb.size == lent.size => {}
                _ => {
                    return Err(format!(
                        "superblock {base:#x} lent to {} which does not hold it",
                        lent.arena.stream.id()
                    ))
                }
            }
        }
        for (&addr, large) in &global.large {
            pieces.push((addr, large.extent, "large block"));
        }
        pieces.sort_unstable();
        for w in pieces.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(format!(
                    "{} {:#x}+{} overlaps {} {:#x}",
                    w[0].2, w[0].0, w[0].1, w[1].2, w[1].0
                ));
            }
        }
        for &(addr, size, what) in &pieces {
            let inside = global
                .chunks
                .range(..=addr)
                .next_back()
                .is_some_and(|(&b, &s)| addr + size <= b + s);
            if !inside {
                return Err(format!("{what} {addr:#x}+{size} is not inside one chunk"));
            }
        }
        let tiled: u64 = pieces.iter().map(|p| p.1).sum();
        let chunks: u64 = global.chunks.values().sum();
        if tiled != chunks {
            return Err(format!(
                "chunks hold {chunks} bytes, regions, superblocks and large blocks {tiled}"
            ));
        }
        for arena in arenas {
            let state = arena.state.lock();
            let id = arena.stream.id();
            state.free.check().map_err(|e| format!("{id}: {e}"))?;
            let mut free_in: BTreeMap<u64, u64> = BTreeMap::new();
            for (addr, size) in state.free.blocks() {
                let base = state.find(addr, size).ok_or_else(|| {
                    format!("{id}: free block {addr:#x}+{size} outside its superblocks")
                })?;
                *free_in.entry(base).or_default() += size;
            }
            for (&base, sb) in &state.superblocks {
                match global.lent.get(&base) {
                    Some(lent) if lent.arena.stream.id() == id => {}
                    _ => return Err(format!("{id}: superblock {base:#x} is not lent to it")),
                }
                let free = free_in.get(&base).copied().unwrap_or(0);
                if free + sb.used != sb.size {
                    return Err(format!(
                        "{id}: superblock {base:#x}: {free} free + {} used != {}",
                        sb.used, sb.size
                    ));
                }
            }
        }
        Ok(())
    }

    // ===== stream arenas =====

    /// The arena of `stream`, made on first use.
    fn arena_for(&self, stream: &Stream) -> Arc<StreamArena> {
        let id = stream.id().get();
        if let Some(arena) = cache::get(self.uid, id) {
            return arena;
        }
        let arena = self
            .registry
            .lock()
            .entry(id)
            .or_insert_with(|| {
                Arc::new(StreamArena {
                    stream: stream.clone(),
                    state: Mutex::new(ArenaState::new()),
                })
            })
            .clone();
        cache::put(self.uid, id, &arena);
        arena
    }

    /// The arena of `stream` if it has one.
    fn existing_arena_for(&self, stream: &Stream) -> Option<Arc<StreamArena>> {
        let id = stream.id().get();
        cache::get(self.uid, id).or_else(|| self.registry.lock().get(&id).cloned())
    }

    /// Orders `arena`'s stream after the streams its remote frees were issued on, then gives
    /// the blocks to its free list; takes `want` bytes afterwards if asked.
    fn adopt(
        &self,
        arena: &StreamArena,
        remote: Vec<Remote>,
        want: Option<u64>,
    ) -> Result<Option<u64>> {
        let _span =
            tracing::debug_span!("adopt", stream = %arena.stream.id(), blocks = remote.len())
                .entered();
        let mut ordered: Vec<StreamId> = Vec::new();
        for r in &remote {
            let id = r.stream.id();
            if id == arena.stream.id() || ordered.contains(&id) {
                continue;
            }
            // The free was issued on `r.stream` before now, so this event comes after it.
            if let Err(e) = r.stream.record().and_then(|e| arena.stream.wait(&e)) {
                arena.state.lock().remote.extend(remote);
                return Err(e);
            }
            ordered.push(id);
        }
        let mut state = arena.state.lock();
        for r in remote {
            match state.give(r.addr, r.size) {
                LocalFree::Done => {}
                LocalFree::DoubleFree | LocalFree::NotMine => tracing::warn!(
                    addr = r.addr,
                    size = r.size,
                    "a block freed on another stream was already free (double free)"
                ),
            }
        }
        Ok(want.and_then(|size| state.take(size)))
    }

    /// Gives superblocks (already out of `arena`) back to the global arena, guarded by an event
    /// on `arena`'s stream. If the event cannot be recorded they go back to the arena.
    fn release(&self, arena: &StreamArena, superblocks: Vec<(u64, u64)>) {
        if superblocks.is_empty() {
            return;
        }
        let _span = tracing::debug_span!(
            "release_superblocks",
            stream = %arena.stream.id(),
            count = superblocks.len()
        )
        .entered();
        {
            let mut global = self.global.lock();
            match global.guard(&arena.stream) {
                Ok(guard) => {
                    for (base, size) in superblocks {
                        global.lent.remove(&base);
                        global.insert_free(base, size, Guards::one(guard.clone()));
                    }
                    drop(global);
                    self.waiters.notify();
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not record an event: superblocks stay with their stream")
                }
            }
        }
        let mut state = arena.state.lock();
        for (base, size) in superblocks {
            state.add_superblock(base, size);
        }
    }

    // ===== allocation =====

    /// Tries `attempt`, then defragments and tries again, then grows by at least `grow_min`
    /// and tries again; then out of memory.
    fn with_retries(
        &self,
        size: u64,
        grow_min: u64,
        stream: &Stream,
        mut attempt: impl FnMut() -> Option<Result<u64>>,
    ) -> Result<u64> {
        if let Some(result) = attempt() {
            return result;
        }
        self.defragment();
        if let Some(result) = attempt() {
            return result;
        }
        // Another thread may take the new chunk before we do: grow again then. Each growth
        // raises `reserved`, so this ends at the maximum at the latest.
        loop {
            match self.grow(grow_min, stream) {
                Ok(()) => {
                    if let Some(result) = attempt() {
                        return result;
                    }
                }
                Err(e) if !e.is_out_of_memory() => return Err(e),
                Err(_) => break,
            }
        }
        let err = self.out_of_memory(size);
        let _span = tracing::debug_span!("out_of_memory", requested = size).entered();
        if tracing::enabled!(tracing::Level::DEBUG) {
            tracing::debug!(dump = %self.dump(), "arena out of memory");
        }
        Err(err)
    }

    fn allocate_small(&self, size: u64, stream: &Stream) -> Result<u64> {
        let arena = self.arena_for(stream);
        let remote = {
            let mut state = arena.state.lock();
            if state.retired {
                // Unreachable through a live stream handle; look again, bypassing the cache.
                drop(state);
                cache::forget(self.uid);
                return self.allocate_small(size, stream);
            }
            if let Some(addr) = state.take(size) {
                return Ok(addr);
            }
            std::mem::take(&mut state.remote)
        };
        if !remote.is_empty() {
            if let Some(addr) = self.adopt(&arena, remote, Some(size))? {
                return Ok(addr);
            }
        }
        let grow_min = self.superblock.max(size);
        self.with_retries(size, grow_min, stream, || {
            // Another thread on this stream may have freed or acquired memory meanwhile.
            if let Some(addr) = arena.state.lock().take(size) {
                return Some(Ok(addr));
            }
            self.acquire_superblock(&arena, size)
        })
    }

    /// Takes a superblock from the global arena for `arena` and `size` bytes from it.
    fn acquire_superblock(&self, arena: &Arc<StreamArena>, size: u64) -> Option<Result<u64>> {
        let (base, extent, guards) = {
            let mut global = self.global.lock();
            let (base, extent, guards) = global.take(self.superblock, size, self.superblock)?;
            global.lent.insert(
                base,
                Lent {
                    size: extent,
                    arena: arena.clone(),
                },
            );
            (base, extent, guards)
        };
        let _span = tracing::debug_span!(
            "acquire_superblock",
            stream = %arena.stream.id(),
            base,
            size = extent
        )
        .entered();
        if let Err(e) = guards.order(&arena.stream) {
            let mut global = self.global.lock();
            global.lent.remove(&base);
            global.insert_free(base, extent, guards);
            return Some(Err(e));
        }
        let mut state = arena.state.lock();
        state.add_superblock(base, extent);
        Some(state.take(size).ok_or(Error::InvalidArgument {
            what: "a new superblock could not serve the request it was taken for",
        }))
    }

    fn allocate_large(&self, size: u64, stream: &Stream) -> Result<u64> {
        self.with_retries(size, size, stream, || {
            let (addr, extent, guards) = {
                let mut global = self.global.lock();
                let (addr, extent, guards) = global.take(size, size, self.superblock)?;
                global.large.insert(addr, Large { size, extent });
                (addr, extent, guards)
            };
            if let Err(e) = guards.order(stream) {
                let mut global = self.global.lock();
                global.large.remove(&addr);
                global.insert_free(addr, extent, guards);
                return Some(Err(e));
            }
            Some(Ok(addr))
        })
    }

    /// Takes a new chunk of at least `min` bytes from the upstream, on `stream`.
    fn grow(&self, min: u64, stream: &Stream) -> Result<()> {
        let reserved = self.reserved.load(Ordering::Relaxed);
        let room = self.maximum.saturating_sub(reserved);
        if min > room {
            return Err(self.out_of_memory(min));
        }
        // Double what we hold (at least the request, at most the room left); halve on failure.
        let mut attempt = reserved
            .max(min)
            .min(room)
            .next_multiple_of(ALIGNMENT as u64)
            .min(room);
        let _span = tracing::debug_span!("grow", requested = min, reserved, attempt).entered();
        loop {
            let now = self.reserved.fetch_add(attempt, Ordering::AcqRel) + attempt;
            let result = if now > self.maximum {
                Err(self.out_of_memory(attempt))
            } else {
                self.upstream.allocate(attempt as usize, stream)
            };
            match result {
                Ok(ptr) => {
                    let mut global = self.global.lock();
                    let guard = match global.guard(stream) {
                        Ok(guard) => guard,
                        Err(e) => {
                            drop(global);
                            // SAFETY: just allocated from this upstream on `stream` with this
                            // size, never handed out.
                            let _ =
                                unsafe { self.upstream.deallocate(ptr, attempt as usize, stream) };
                            self.reserved.fetch_sub(attempt, Ordering::AcqRel);
                            return Err(e);
                        }
                    };
                    global.chunks.insert(ptr.0, attempt);
                    global.insert_free(ptr.0, attempt, Guards::one(guard));
                    drop(global);
                    self.peak_reserved.fetch_max(now, Ordering::AcqRel);
                    self.grows.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(chunk = attempt, "arena grew");
                    return Ok(());
                }
                Err(e) => {
                    self.reserved.fetch_sub(attempt, Ordering::AcqRel);
                    if !e.is_out_of_memory() {
                        return Err(e);
                    }
                    if attempt / 2 < min {
                        tracing::debug!("upstream out of memory");
                        return Err(self.out_of_memory(min));
                    }
                    attempt = (attempt / 2).next_multiple_of(ALIGNMENT as u64);
                }
            }
        }
    }

    fn out_of_memory(&self, requested: u64) -> Error {
        let reserved = self.reserved.load(Ordering::Relaxed);
        let global_free = self.global.lock().free_bytes();
        let arena_free: u64 = self
            .arenas()
            .iter()
            .map(|a| a.state.lock().free.free_bytes())
            .sum();
        Error::OutOfMemory {
            requested: requested as usize,
            available: (self.maximum.saturating_sub(reserved) + global_free + arena_free) as usize,
            maximum: self.maximum as usize,
        }
    }

    // ===== deallocation =====

    fn free_small(&self, addr: u64, size: u64, stream: &Stream) -> Result<()> {
        let unknown = Error::UnknownPointer {
            ptr: addr,
            bytes: size as usize,
        };
        if let Some(arena) = self.existing_arena_for(stream) {
            let outcome = arena.state.lock().give(addr, size);
            match outcome {
                LocalFree::Done => return Ok(()),
                LocalFree::DoubleFree => return Err(unknown),
                LocalFree::NotMine => {}
            }
        }
        // A block of another stream's arena: it waits there until that arena adopts it.
        let owner = self
            .global
            .lock()
            .owner_of(addr, size)
            .ok_or(unknown.clone())?;
        if owner.stream.id() == stream.id() {
            return Err(unknown);
        }
        let mut state = owner.state.lock();
        if state.find(addr, size).is_none() {
            return Err(unknown);
        }
        tracing::trace!(addr, size, owner = %owner.stream.id(), on = %stream.id(), "remote free");
        state.remote.push(Remote {
            addr,
            size,
            stream: stream.clone(),
        });
        Ok(())
    }

    fn free_large(&self, addr: u64, size: u64, stream: &Stream) -> Result<()> {
        let mut global = self.global.lock();
        let large = match global.large.get(&addr) {
            Some(&large) if large.size == size => large,
            _ => {
                return Err(Error::UnknownPointer {
                    ptr: addr,
                    bytes: size as usize,
                })
            }
        };
        let guard = global.guard(stream)?;
        global.large.remove(&addr);
        global.insert_free(addr, large.extent, Guards::one(guard));
        Ok(())
    }
}

impl<U: MemoryResource> MemoryResource for ArenaResource<U> {
    fn device(&self) -> &Device {
        &self.device
    }

    fn memory_kind(&self) -> MemoryKind {
        self.upstream.memory_kind()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        if bytes == 0 {
            return Ok(DevicePtr(0));
        }
        check_stream(&self.device, stream)?;
        let size = aligned_size(bytes)? as u64;
        if size > self.maximum {
            return Err(self.out_of_memory(size));
        }
        if size <= self.superblock {
            self.allocate_small(size, stream)
        } else {
            self.allocate_large(size, stream)
        }
        .map(DevicePtr)
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        if bytes == 0 {
            return if ptr.0 == 0 {
                Ok(())
            } else {
                Err(Error::UnknownPointer { ptr: ptr.0, bytes })
            };
        }
        check_stream(&self.device, stream)?;
        let size = aligned_size(bytes)? as u64;
        if !ptr.0.is_multiple_of(ALIGNMENT as u64) {
            return Err(Error::UnknownPointer { ptr: ptr.0, bytes });
        }
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
    }

    fn memory_waiters(&self) -> Option<&MemoryWaiters> {
        Some(&self.waiters)
    }
}

impl<U: MemoryResource> Drop for ArenaResource<U> {
    fn drop(&mut self) {
        cache::forget(self.uid);
        // Frees may still be queued on the streams the arenas belong to, or on the streams that
        // guard free regions: let them run, then give every chunk back on our own stream.
        let arenas = std::mem::take(&mut *self.registry.lock());
        for arena in arenas.values() {
            let _ = arena.stream.synchronize_blocking();
            let remote: Vec<Stream> = arena
                .state
                .lock()
                .remote
                .iter()
                .map(|r| r.stream.clone())
                .collect();
            for stream in remote {
                let _ = stream.synchronize_blocking();
            }
        }
        let mut global = std::mem::replace(&mut *self.global.lock(), Global::new());
        for region in global.regions.values() {
            for guard in &region.guards.0 {
                let _ = guard.event.synchronize_blocking();
            }
        }
        // The lent superblocks hold the stream arenas: drop them before the chunks go.
        global.lent.clear();
        drop(arenas);
        let _ = self.own.synchronize_blocking();
        for (base, size) in std::mem::take(&mut global.chunks) {
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

/// `1 - largest / free`, in percent (0 with nothing free).
fn fragmentation(free: u64, largest: u64) -> f64 {
    if free == 0 {
        0.0
    } else {
        (1.0 - largest as f64 / free as f64) * 100.0
    }
}

/// `1.50 MiB (1572864 B)`-style sizes for the dump.
fn fmt_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = "B";
    for u in UNITS {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = u;
    }
    format!("{value:.2} {unit}")
}
