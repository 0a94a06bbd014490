//! The stream-ordered engine that [`PoolResource`](super::pool::PoolResource),
//! [`FixedSizeResource`](super::fixed_size::FixedSizeResource) and the expandable pool share:
//! RMM's `stream_ordered_memory_resource`, with one free structure for every stream instead of
//! one per stream (issue 10).
//!
//! All memory lives in one block table (`blocks.rs`: every block, free or handed out, linked to
//! its address neighbours, free blocks filed by size in a TLSF index, `tlsf.rs`), whatever
//! stream freed it: free neighbours coalesce at once, and a request gets the best fit over
//! everything free. So memory never strands in one stream's list while another stream grows
//! the pool. A per-stream design (RMM's, and ours until issue 10) reuses
//! a stream's own frees without any ordering, but blocks freed on different streams do not
//! coalesce until a merge, and by then the layout is fragmented: grown from 256 MiB, the
//! hand-off runs of WORKLOADS.md reserved 1.5 to 1.9 times their peak live memory, against
//! 1.03 to 1.17 for one shared list (`engine_lab`).
//!
//! Stream order is kept by *tags*: each free block carries the streams its memory was freed on,
//! each with that stream's epoch at the free ([`Waits`], see `waits.rs`). A request on stream S
//! that gets a block freed on S needs nothing (stream order). A block freed on another stream D
//! after S last waited on D needs an *ordering*: an event recorded on D now and a wait for it
//! queued on S (GPU-side: the host never waits), which covers everything D had freed so far,
//! so the next such block from D costs nothing. No request waits on more than one event per
//! stream named in its block's tag. Orderings are made outside the engine's lock.
//!
//! *Opportunistic reuse* (on by default, as the driver's own pool has it): before recording an
//! event on D, the engine asks D whether it is idle (`cuStreamQuery`, one driver call instead
//! of two). If so, every free on D tagged before the question has finished on the GPU, and D
//! is noted *done* up to the epoch bumped before the question: any stream may take those blocks
//! with no ordering at all. A busy answer (or a failed query) falls back to the ordering.
//!
//! The table is kept in shards (8 for the pool and the expandable pool, whose address range per
//! shard is one chunk; 1 for the fixed-size pool), each chunk in one, so that threads mostly
//! take different locks (`chunks.rs` maps addresses to shards for frees, without a lock). A
//! request, in order: its thread's shard (best fit; orderings as its block's tag asks); a chunk
//! of the reserve (the pool's initial memory, in pieces) moved into the thread's shard; while
//! the upstream has memory to claim (the expandable pool's initial pieces,
//! [`Grow::has_unclaimed`]), a claim into the thread's shard on the slow path; the best fit of
//! the other shards; then, one request at a time (`slow`), all of that again and a growth into
//! the thread's shard ([`Grow`]; the pool, at its maximum, first gives wholly free chunks
//! back); then the upstream's error.
//!
//! Streams are registered on first use and keep a slot (their epoch and what they waited on)
//! and a handle (to record events on). A stream the user has dropped is let go by `trim`:
//! [`StreamHeap::idle_streams`] names them, the caller waits for each on the host, and
//! [`StreamHeap::forget`] drops it from every tag and releases its handle. A stream used again
//! after that is registered again, often in its old slot, with its epochs counted from 0: each
//! registration has its own number, which a note made outside the lock (an ordering, an idle
//! answer, a host's wait) checks before it lands.
//!
//! Here: the engine's state, requests and frees; beside it `blocks.rs` (the block table),
//! `waits.rs` (the tags), `chunks.rs` (the chunk-to-shard table), `order.rs` (orderings),
//! `retire.rs` (memory and streams going back), `view.rs` (statistics, the invariant checker,
//! snapshots), `expandable.rs` (what the expandable pool needs), `stream.rs` (what
//! [`Stream`] gives the engine) and `planted.rs` (the loom models' switches).
//!
//! The engine is generic over what it needs from a stream ([`EngineStream`]): the resources use
//! it with [`Stream`] (the default), and the loom models in `loom-tests/free_lists/` with a
//! fake stream that records the ordering edges. Monomorphized: no dynamic dispatch.

use std::cell::Cell;
use std::fmt;

use rustc_hash::FxHashMap;

use crate::error::{Error, Result};
use crate::stream::Stream;
use crate::sync::{AtomicU64, Mutex, MutexGuard, Ordering};

mod addr_map;
mod blocks;
mod chunks;
mod expandable;
pub(crate) mod kept;
mod order;
#[cfg(all(test, not(streamalloc_loom)))]
mod order_tests;
pub(crate) mod planted;
mod retire;
mod stream;
mod view;
mod waits;

/// The block table, for `engine_lab`'s floor.
#[cfg(test)]
pub(crate) use blocks::BlockTable as BlockTableForLab;
use blocks::{BlockTable, NO_OWNER};
/// The chunk table, for its loom model (`loom-tests/chunk_table.rs`, compiled only into the
/// loom cfg's tests).
#[cfg(all(test, streamalloc_loom))]
pub(crate) use chunks::ChunkTable as ChunkTableForLoom;
use chunks::ChunkTable;
pub(crate) use expandable::HostWait;
pub(crate) use kept::Kept;
#[cfg(test)]
pub(crate) use kept::Users;
use order::Orders;
pub(crate) use view::ListBlocks;
pub(crate) use waits::Waits;

/// What the engine needs from a stream.
pub(crate) trait EngineStream: Clone {
    /// How the stream is named in traces and messages.
    type Name: fmt::Display;

    /// The stream's process-unique id (a driver handle can be reused; this cannot).
    fn uid(&self) -> u64;

    /// The stream's name, for traces and messages.
    fn name(&self) -> Self::Name;

    /// How many handles to the stream exist outside the registries of streams that resources
    /// keep ([`Kept`]): 0 once the user has dropped the stream and nothing else (a buffer, a
    /// free still to come) holds it, whatever other resources also served it.
    fn users(&self) -> usize;

    /// Takes this handle out of [`users`](Self::users) (`kept`) or puts it back (`!kept`):
    /// [`Kept`] calls it when it takes a handle and before it lets it go.
    fn set_kept(&self, kept: bool);

    /// Orders `later` after all work queued on `self` so far: an event recorded on `self` now,
    /// and a (GPU-side) wait for it queued on `later`.
    fn order_before(&self, later: &Self) -> Result<()>;

    /// Whether all work queued on the stream so far has completed (`cuStreamQuery`), so that
    /// memory it freed needs no ordering at all. An error counts as busy: the ordering that
    /// follows reports it if it persists.
    fn is_idle(&self) -> bool;

    /// How many operations have been queued on the stream so far, if that is known (`None`:
    /// work may reach it unseen). Read before an idle answer and found unchanged later, it
    /// says that the stream is still idle, with no driver call.
    fn activity(&self) -> Option<u64>;

    /// Called when the stream is taken as still idle because its activity has not changed
    /// since it was seen idle: whether that may stand. On CUDA it always does (the count is
    /// the proof, and no driver call is made); the simulated device looks at its queue, which
    /// tells its race detector that the crate has seen the stream's work finish, as an idle
    /// answer does (the detector counts the pool's notes of allocations and frees as points of
    /// the stream).
    fn confirm_quiet(&self) -> bool {
        true
    }
}

/// Where new memory comes from.
pub(crate) trait Grow<S = Stream> {
    /// A new chunk of at least `min` bytes, allocated for use on `stream`: `(base, size)`. Its
    /// error is the resource's out-of-memory error, with its numbers.
    fn grow(&self, min: u64, stream: &S) -> Result<(u64, u64)>;

    /// [`grow`](Self::grow), called with the engine's `slow` lock (`lock`) held, whose guard
    /// it takes and hands back. An upstream whose growth has slow work to do first lets `slow`
    /// go for it: the pool at its maximum gives wholly free chunks back upstream, and over
    /// `CudaResource` each is a `cuMemFree`, which waits for the whole device (milliseconds);
    /// every other request that needs to grow would wait that long behind `slow`.
    fn grow_under<'s>(
        &self,
        slow: MutexGuard<'s, ()>,
        _lock: &'s Mutex<()>,
        min: u64,
        stream: &S,
    ) -> (MutexGuard<'s, ()>, Result<(u64, u64)>) {
        let grown = self.grow(min, stream);
        (slow, grown)
    }

    /// For a request whose growth failed for want of memory, holding `slow` (`lock`): if
    /// growths are giving memory back upstream with `slow` let go ([`grow_under`](Self::grow_under)),
    /// waits for every one under way to end (the room, and what their growths leave free, come
    /// back then) with `slow` let go, and takes it again. Whether it waited: the request should look, and
    /// grow, once more, as it effectively did when the give-back ran under `slow`.
    fn wait_for_give_backs<'s>(
        &self,
        slow: MutexGuard<'s, ()>,
        _lock: &'s Mutex<()>,
    ) -> (MutexGuard<'s, ()>, bool) {
        (slow, false)
    }

    /// Whether memory of the upstream's waits to be [`claim`](Self::claim)ed (the expandable
    /// pool's initial memory, in pieces that belong to no shard yet). A hint, read with no
    /// lock: while it says so, a request its home shard cannot serve claims a piece (on the
    /// slow path) instead of taking memory from other threads' shards, where its blocks would
    /// never coalesce with its own.
    #[inline]
    fn has_unclaimed(&self) -> bool {
        false
    }

    /// Gives a piece of unclaimed memory to the requesting thread's home shard, as fresh free
    /// memory, for a request of `min` bytes: whether there was one. Called with the engine's
    /// `slow` lock held, like [`grow`](Self::grow).
    fn claim(&self, _min: u64, _stream: &S) -> bool {
        false
    }

    /// The epoch of the memory that trims hold (`resource/held_for_trim.rs`), read before a
    /// request's last look: [`recall_trimmed`](Self::recall_trimmed) compares it.
    fn trim_epoch(&self) -> u64 {
        0
    }

    /// Puts the memory that trims hold while they wait for the GPU back in the free lists, as
    /// if they had not taken it (`resource/held_for_trim.rs`), for a request whose
    /// [`grow`](Self::grow) failed: whether the request should look and grow once more
    /// (there was some; or, since the request read `epoch` from
    /// [`trim_epoch`](Self::trim_epoch), a trim that ended early put memory back, or a trim
    /// finished giving memory back). Called with the engine's `slow` lock held; the trims give
    /// back only what is still theirs when their waits end.
    fn recall_trimmed(&self, _epoch: u64) -> bool {
        false
    }
}

/// A stream the engine knows.
struct Entry<S: EngineStream> {
    stream: Kept<S>,
    /// `stream.uid()`, kept here so that checking a tag against the requester reads no handle.
    uid: u64,
    /// This registration's number in the shard (from [`Heap::registered`]): what a note made
    /// outside the lock (an ordering, an idle answer, a host's wait) checks the slot against.
    /// Not the uid: epochs count per registration, and a stream forgotten and registered
    /// again, into the same slot (`spare` hands slots back last in, first out), starts again
    /// at epoch 0, so a note of its old registration's epoch would cover its new frees (a
    /// review's finding; `order_tests.rs`).
    reg: u64,
    /// Bumped by every ordering after this stream; frees on it are tagged with it.
    epoch: u64,
    /// Frees on this stream tagged below `done` are known finished on the GPU (the stream was
    /// seen idle after the bump to `done`): any stream may reuse them without an ordering.
    done: u64,
    /// The stream's [`activity`](EngineStream::activity) read before its last idle answer:
    /// while the stream's count still reads this, nothing was queued on it since, and it is
    /// still idle (*quiet*).
    quiet_at: Option<u64>,
    /// `waited[d]`: this stream is ordered after the stream in slot `d` up to that stream's
    /// epoch `waited[d]` (exclusive: its frees tagged below it are covered).
    waited: Vec<u64>,
}

impl<S: EngineStream> Entry<S> {
    fn waited(&self, slot: u32) -> u64 {
        self.waited.get(slot as usize).copied().unwrap_or(0)
    }

    fn note_waited(&mut self, slot: u32, epoch: u64) {
        let slot = slot as usize;
        if self.waited.len() <= slot {
            self.waited.resize(slot + 1, 0);
        }
        self.waited[slot] = self.waited[slot].max(epoch);
    }
}

/// Everything under the engine's lock.
struct Heap<S: EngineStream> {
    /// Every block of the shard's chunks, free or handed out. A free must name a block handed
    /// out, with its size: a pointer never handed out, or a wrong size, would otherwise put
    /// memory that is in use among the free blocks (issue 16).
    free: BlockTable<Waits>,
    /// Stream uid → its slot in `entries`.
    slots: FxHashMap<u64, u32>,
    entries: Vec<Option<Entry<S>>>,
    /// Slots of forgotten streams, for reuse.
    spare: Vec<u32>,
    /// Registrations so far: the next one's [`Entry::reg`]. Per shard, under its lock (not a
    /// global count: the loom models stay deterministic).
    registered: u64,
    /// The last (uid, slot) looked up: most operations come in runs on one stream.
    last: (u64, u32),
    /// Bytes handed out, and the most there have been.
    in_use: u64,
    peak_in_use: u64,
}

impl<S: EngineStream> Heap<S> {
    /// `stream`'s slot, registering it on first use.
    #[inline]
    fn slot(&mut self, stream: &S) -> u32 {
        let uid = stream.uid();
        if self.last.0 == uid {
            return self.last.1;
        }
        let slot = match self.slots.get(&uid) {
            Some(&slot) => slot,
            None => self.register(uid, stream),
        };
        self.last = (uid, slot);
        slot
    }

    /// Whether every stream `tag` names is the one with `uid` (a block freed on the stream
    /// that asks for it: stream order, no ordering needed).
    #[inline]
    fn only(&self, tag: &Waits, uid: u64) -> bool {
        !tag.every()
            && (tag.pairs().iter()).all(|&(d, _)| self.entry(d).is_some_and(|e| e.uid == uid))
    }

    #[cold]
    fn register(&mut self, uid: u64, stream: &S) -> u32 {
        self.registered += 1;
        let entry = Entry {
            stream: Kept::new(stream),
            uid,
            reg: self.registered,
            epoch: 0,
            done: 0,
            quiet_at: None,
            waited: Vec::new(),
        };
        let slot = match self.spare.pop() {
            Some(slot) => {
                self.entries[slot as usize] = Some(entry);
                slot
            }
            None => {
                self.entries.push(Some(entry));
                (self.entries.len() - 1) as u32
            }
        };
        self.slots.insert(uid, slot);
        slot
    }

    fn entry(&self, slot: u32) -> Option<&Entry<S>> {
        self.entries.get(slot as usize).and_then(Option::as_ref)
    }

    fn entry_mut(&mut self, slot: u32) -> Option<&mut Entry<S>> {
        self.entries.get_mut(slot as usize).and_then(Option::as_mut)
    }

    /// The tag of a block freed now on the stream in `slot`.
    #[inline]
    fn freed_on(&self, slot: u32) -> Waits {
        Waits::one(slot, self.entry(slot).map_or(0, |e| e.epoch))
    }

    /// The small-block cache's block of exactly `size` bytes, if it was freed on `stream`
    /// (whose order covers its reuse: no ordering, no tag to look at further).
    #[inline]
    fn take_cached(&mut self, size: u64, stream: &S) -> Option<u64> {
        let slot = self.slot(stream);
        let accept = |tag: &Waits| tag.is_only(slot) || planted!(CACHE_ANY_STREAM);
        let addr = self.free.take_cached(size, accept, owner(slot))?;
        self.count_out(size);
        Some(addr)
    }

    #[inline]
    fn count_out(&mut self, size: u64) {
        self.in_use += size;
        if self.in_use > self.peak_in_use {
            self.peak_in_use = self.in_use;
        }
    }
}

/// One shard: a free list and the streams it has seen, under one lock.
type Shard<S> = Mutex<Heap<S>>;

/// A shard on cache lines of its own: the shards' locks and counters change on every operation,
/// and neighbours sharing a line would make threads on different shards contend anyway.
#[repr(align(128))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;

    #[inline]
    fn deref(&self) -> &T {
        &self.0
    }
}

/// The free memory of one resource, shared by every stream, and the streams it has seen.
///
/// In shards: each chunk belongs to one, and a request goes first to its thread's *home* shard
/// (threads are spread over the shards in turn), then to a chunk of the reserve moved into
/// it, then to the best fit of the others, before the pool grows into the home shard. Free
/// blocks coalesce within their chunk whatever stream freed them, as they would in one list
/// (blocks never merge across chunks anyway), while threads working on different streams take
/// different locks: one lock for every thread cost 20 to 30 times the time of per-stream locks
/// on four threads on an H200 host (issue 10; `BENCHMARKS.md`).
pub(crate) struct StreamHeap<S: EngineStream = Stream> {
    shards: Box<[Padded<Shard<S>>]>,
    /// Which shard each chunk is in, for frees.
    table: ChunkTable,
    /// Held by a request through its growth: two requests that both find nothing would
    /// otherwise both grow.
    slow: Mutex<()>,
    /// Fresh chunks in no shard yet (the pool's initial memory, in pieces): a request its home
    /// shard cannot serve moves one into that shard before it looks at other threads' shards.
    /// So one thread ends up with all the memory it uses in its own shard, and threads take
    /// their shares as they need them, instead of a split fixed at construction (which left a
    /// single thread's memory in eight shards, most requests missing at home: `churn-1t`
    /// started at 2 GiB ran 25% slower than started at 256 MiB, issue 10's run22).
    reserve: Mutex<Vec<(u64, u64)>>,
    /// How many chunks `reserve` holds: read without its lock, so that a request with nothing
    /// in reserve takes no lock for it. Std's, not `crate::sync`'s: only a hint (the count is
    /// read again under the lock), and the loom models put nothing in reserve.
    reserved_chunks: std::sync::atomic::AtomicUsize,
    /// Chunks moved out of the reserve into a shard so far, counted once the chunk is in the
    /// shard's list (under the reserve's lock): a request about to fail looks again if a move
    /// ended while it looked ([`take_slow`](Self::take_slow)).
    reserve_moves: AtomicU64,
    /// Orderings made (a request's stream waiting on another's event).
    waits: AtomicU64,
    /// Requests served by a shard other than their thread's home shard.
    spills: AtomicU64,
    /// How much larger (a fraction) than the best fit a block the requester need not wait
    /// for may be, to be taken instead (`PoolOptions::reuse_slack`).
    slack: f64,
    /// Whether an ordering first asks the freeing stream whether it is idle, and makes none if
    /// it is (`PoolOptions::opportunistic_reuse`).
    opportunistic: bool,
    /// Orderings not made because the freeing stream was idle.
    idle_skips: AtomicU64,
}

impl<S: EngineStream> fmt::Debug for StreamHeap<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stats = self.stats();
        f.debug_struct("StreamHeap")
            .field("streams", &stats.streams)
            .field("free_bytes", &stats.free_bytes)
            .finish()
    }
}

/// Statistics of the engine.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct EngineStats {
    pub(crate) streams: usize,
    pub(crate) free_bytes: u64,
    pub(crate) free_blocks: usize,
    pub(crate) waits: u64,
    /// Requests served by a shard other than their thread's.
    pub(crate) spills: u64,
    /// Orderings not made: the freeing stream was idle.
    pub(crate) idle_skips: u64,
    pub(crate) in_use: u64,
    pub(crate) peak_in_use: u64,
    /// Requests served by the small-block caches.
    pub(crate) cache_hits: u64,
}

impl<S: EngineStream> StreamHeap<S> {
    /// An engine of one shard, taking the best fit whatever the waits.
    pub(crate) fn new() -> Self {
        Self::with_options(0.0, 1)
    }

    /// An engine of `shards` shards (at least 1, rounded up to a power of two), preferring
    /// blocks that need no wait up to `slack` larger than the best fit.
    pub(crate) fn with_options(slack: f64, shards: usize) -> Self {
        let shard = || {
            Padded(Mutex::new(Heap {
                free: BlockTable::new(),
                slots: FxHashMap::default(),
                entries: Vec::new(),
                spare: Vec::new(),
                registered: 0,
                last: (0, 0),
                in_use: 0,
                peak_in_use: 0,
            }))
        };
        Self {
            // A power of two, so that a thread's home is a mask, not a division.
            shards: (0..shards.max(1).next_power_of_two())
                .map(|_| shard())
                .collect(),
            table: ChunkTable::new(),
            slow: Mutex::new(()),
            reserve: Mutex::new(Vec::new()),
            reserved_chunks: std::sync::atomic::AtomicUsize::new(0),
            reserve_moves: AtomicU64::new(0),
            waits: AtomicU64::new(0),
            spills: AtomicU64::new(0),
            idle_skips: AtomicU64::new(0),
            opportunistic: true,
            slack: if slack.is_finite() {
                slack.max(0.0)
            } else {
                0.0
            },
        }
    }

    /// Whether blocks are placed at the lowest address among the near fits instead of at the
    /// closest fit (the expandable pool's choice: [`BlockTable::place_low`]).
    pub(crate) fn set_low_placement(&self, on: bool) {
        for shard in self.shards.iter() {
            shard.lock().free.place_low(on);
        }
    }

    /// Gives each shard a small-block cache of `budget` bytes (0: none, the default): see
    /// `blocks.rs`'s `Cache`.
    pub(crate) fn set_cache(&self, budget: u64) {
        for shard in self.shards.iter() {
            shard.lock().free.set_cache(budget);
        }
    }

    /// [`set_cache`](Self::set_cache), as a builder.
    pub(crate) fn with_cache(self, budget: u64) -> Self {
        self.set_cache(budget);
        self
    }

    /// Empties every shard's small-block cache into its free blocks: whether any held a block.
    pub(crate) fn uncache_everywhere(&self) -> bool {
        let mut any = false;
        for shard in self.shards.iter() {
            let mut heap = shard.lock();
            any |= heap.free.cached_blocks() > 0;
            heap.free.uncache_all();
        }
        any
    }

    /// Whether the growth lock (`slow`) is held now (by any thread): for tests that check what
    /// runs under it.
    #[cfg(all(test, not(streamalloc_loom)))]
    pub(crate) fn slow_is_locked(&self) -> bool {
        self.slow.try_lock().is_none()
    }

    /// Whether orderings first ask the freeing stream whether it is idle (on by default).
    pub(crate) fn with_opportunistic(mut self, on: bool) -> Self {
        self.opportunistic = on;
        self
    }

    /// The shard this thread's requests go to first: by thread, not by stream, because the
    /// shards are there so that threads do not contend (one thread driving several streams,
    /// as a pipeline's scheduler does, keeps the best fit over all its memory).
    #[inline]
    fn home(&self) -> usize {
        thread_index() & (self.shards.len() - 1)
    }

    /// A new chunk, in the first shard: frees inside it are accepted, and no block merges
    /// across its start.
    pub(crate) fn add_chunk(&self, start: u64, size: u64) {
        self.add_chunk_to(0, start, size);
    }

    fn add_chunk_to(&self, shard: usize, start: u64, size: u64) {
        // Issue 11: memory mapped inside a chunk already registered (one of the expandable
        // pool's reserved ranges) is accepted there already, and must not become a merge
        // boundary.
        if self.table.covers(start, size) {
            return;
        }
        self.shards[shard].lock().free.add_chunk(start, size);
        self.table.add(start, size, shard as u32);
    }

    /// A chunk went back upstream.
    pub(crate) fn remove_chunk(&self, start: u64) {
        if let Some(shard) = self.table.remove(start) {
            self.shards[shard as usize].lock().free.remove_chunk(start);
        }
    }

    /// The shard whose chunk holds `[addr, addr + size)`.
    #[inline]
    fn shard_of(&self, addr: u64, size: u64) -> Option<&Shard<S>> {
        self.table
            .shard_of(addr, size)
            .map(|i| &*self.shards[i as usize])
    }

    /// Memory any stream may use at once (a chunk allocated synchronously), inside a chunk
    /// already registered.
    pub(crate) fn give_fresh(&self, addr: u64, size: u64) {
        let given = self
            .shard_of(addr, size)
            .is_some_and(|shard| shard.lock().free.give_range(addr, size, Waits::default()));
        debug_assert!(given, "a fresh chunk overlapped a block or no chunk");
    }

    /// A whole chunk taken out by [`take_whole_chunks`](Self::take_whole_chunks) as needing no
    /// ordering, back where it was: its shard, or the reserve if no shard holds it (it came
    /// from there).
    pub(crate) fn give_back_fresh_chunk(&self, base: u64, size: u64) {
        if self.table.covers(base, size) {
            self.give_fresh(base, size);
        } else {
            self.add_reserve(base, size);
        }
    }

    /// Gives memory back on `stream` (a free). False, and nothing changes, unless
    /// `[addr, addr + size)` is a block this engine handed out and has not taken back: a
    /// pointer it never handed out, one inside a block, a wrong size and a second free are all
    /// refused.
    #[inline]
    pub(crate) fn give(&self, addr: u64, size: u64, stream: &S) -> bool {
        let Some(shard) = self.shard_of(addr, size) else {
            return false;
        };
        let mut heap = shard.lock();
        // Checked first: a refused free registers no stream.
        let Some(used) = heap.free.used_slot(addr, size) else {
            return false;
        };
        let slot = heap.slot(stream);
        let tag = heap.freed_on(slot);
        if heap.free.may_cache(&used, owner(slot)) {
            heap.free.cache(used, tag);
        } else {
            let freed = heap.free.free_used(used);
            heap.free.join_tag(freed, &tag);
        }
        heap.in_use -= size;
        true
    }

    /// `size` bytes for use on `stream`: the best fit of the stream's home shard, else of
    /// another, ordered after the streams that freed it; else a growth.
    ///
    /// A block whose ordering is refused because a stream is under a user's graph capture
    /// (the donor, which cannot record into it, or the requester, which cannot wait on an
    /// event recorded outside it) goes back, and the request is served from a chunk grown for
    /// it, which needs no ordering ([`take_fresh`](Self::take_fresh)).
    #[inline]
    pub(crate) fn take(&self, size: u64, stream: &S, upstream: &impl Grow<S>) -> Result<u64> {
        let taken = match self.take_any(size, stream, false, upstream) {
            Ok(Some(addr)) => return Ok(addr),
            Ok(None) => self.take_contended(size, stream, upstream),
            Err(e) => Err(e),
        };
        match taken {
            Err(refused @ Error::StreamCapturing { .. }) => {
                self.take_fresh(size, stream, upstream, refused)
            }
            taken => taken,
        }
    }

    /// `size` bytes from a chunk grown for this request, from its start, tagged as freed on
    /// `stream` (so no ordering is needed): for a request whose best fit could not be ordered
    /// for a graph capture (`refused`: the error returned if the pool cannot grow, or the chunk
    /// cannot serve it unordered). Were the request to search again, it would find the same
    /// block.
    ///
    /// A plain upstream's chunk is a block of its own. An upstream that extends free memory
    /// (the expandable pool) may join it to the free block before it: that block's tag then
    /// asks for the ordering again, and the request fails with `refused` (the memory stays
    /// free in the pool).
    #[cold]
    fn take_fresh(
        &self,
        size: u64,
        stream: &S,
        upstream: &impl Grow<S>,
        refused: Error,
    ) -> Result<u64> {
        let mut slow = self.slow.lock();
        let _span = tracing::debug_span!("grow for a request refused by a capture", size).entered();
        // Before the growth, as `take_slow` reads it before its last look.
        let trim_epoch = upstream.trim_epoch();
        let mut grown;
        (slow, grown) = upstream.grow_under(slow, &self.slow, size, stream);
        // Out of memory (at the maximum), perhaps while a trim waits for the GPU with whole
        // chunks out of the lists: those back in the lists, as `take_slow` does (a review found
        // this path failing with them held). The capturing stream cannot be ordered after their
        // streams (a captured wait for an event recorded outside the capture invalidates it:
        // run150), so one more look serves it only from memory that needs no ordering onto it
        // (fresh, freed on it, or of a stream now idle); else one more growth, which at the
        // maximum gives whole free chunks (those recalled among them) back upstream in their
        // streams' order and grows a fresh chunk, which needs none.
        if matches!(grown, Err(Error::OutOfMemory { .. })) && upstream.recall_trimmed(trim_epoch) {
            match self.take_any(size, stream, true, upstream) {
                Ok(Some(addr)) => return Ok(addr),
                // The best fit still needs an ordering the capture refuses (it went back).
                Ok(None) | Err(Error::StreamCapturing { .. }) => {}
                Err(e) => return Err(e),
            }
            (slow, grown) = upstream.grow_under(slow, &self.slow, size, stream);
        }
        // Held to the end: one growth at a time.
        let _slow = slow;
        let (base, chunk) = match grown {
            Ok(grown) => grown,
            // At the maximum (or any other failure) the capture's refusal is what the request
            // ran into: memory is free, only not orderable now.
            Err(e) => {
                tracing::debug!(error = %e, "no growth for a request refused by a capture");
                return Err(refused);
            }
        };
        self.add_chunk_to(self.home(), base, chunk);
        let Some(shard) = self.shard_of(base, chunk) else {
            return Err(Error::InvalidArgument {
                what: "the upstream gave a chunk that overlaps another",
            });
        };
        let mut heap = shard.lock();
        let slot = heap.slot(stream);
        let tag = heap.freed_on(slot);
        if !heap.free.give_range(base, chunk, tag) {
            return Err(Error::InvalidArgument {
                what: "the upstream gave a chunk that overlaps another",
            });
        }
        match heap.free.take_at(base, size) {
            Some((addr, tag)) if tag.is_empty() || heap.only(&tag, stream.uid()) => {
                heap.count_out(size);
                Ok(addr)
            }
            Some((addr, tag)) => {
                let given = heap.free.free(addr, size, tag);
                debug_assert!(given, "a block taken from a fresh chunk could not go back");
                Err(refused)
            }
            None => Err(refused),
        }
    }

    /// [`take`](Self::take) once the look at the shards whose lock was free found nothing:
    /// every shard again, waiting for each lock, before the growth lock. A busy shard is
    /// another thread at work in its own memory, its lock held for one request; the growth
    /// lock may be held through a growth, a driver call of about 100 µs for 20 MiB. Four
    /// threads grown from 256 MiB on an H100: 170 to 190 requests a run took the growth lock,
    /// and about half of them found a fit once they had it, after waiting there behind another
    /// request; with this look first, 72 to 89 took it (run57, run66), and `churn-4t` and
    /// `churn-xs-4t` ran 1 to 9% faster (`BENCHMARKS.md`). Not on every miss: waiting for each
    /// busy shard on each of a run's thousands of misses cost `churn-4t` half again its time
    /// (run23).
    #[cold]
    fn take_contended(&self, size: u64, stream: &S, upstream: &impl Grow<S>) -> Result<u64> {
        match self.take_any(size, stream, true, upstream)? {
            Some(addr) => Ok(addr),
            None => self.take_slow(size, stream, upstream),
        }
    }

    /// The home shard's fit, else a chunk from the reserve moved into the home shard, else the
    /// best fit of the other shards (with `every_shard` false, of those whose lock is free now);
    /// not the other shards while `upstream` has memory to claim ([`Grow::has_unclaimed`]).
    #[inline]
    fn take_any(
        &self,
        size: u64,
        stream: &S,
        every_shard: bool,
        upstream: &impl Grow<S>,
    ) -> Result<Option<u64>> {
        let home = self.home();
        if let Some(addr) = self.take_free(&self.shards[home], None, size, stream, true)? {
            return Ok(Some(addr));
        }
        if self
            .reserved_chunks
            .load(std::sync::atomic::Ordering::Relaxed)
            > 0
        {
            if let Some(addr) = self.take_reserve(home, size, stream)? {
                return Ok(Some(addr));
            }
        }
        // Memory waits to be claimed: the request claims it on the slow path, into its home
        // shard, rather than take other threads' memory.
        if upstream.has_unclaimed() {
            return Ok(None);
        }
        // The shard that served this thread's last spill: where its memory went, if its home
        // keeps missing (a thread whose working set ended up in another thread's shard would
        // otherwise look through every shard on every request: 127,423 times in one
        // `churn-4t` repeat of run26).
        if let Some(second) = self.second_home().filter(|&j| j != home) {
            if let Some(addr) = self.take_free(&self.shards[second], None, size, stream, false)? {
                self.spills.fetch_add(1, Ordering::Relaxed);
                return Ok(Some(addr));
            }
        }
        self.take_elsewhere(home, size, stream, every_shard)
    }

    /// The shard of this engine that last served a spill of the calling thread, if any.
    #[inline]
    fn second_home(&self) -> Option<usize> {
        let (engine, shard) = SECOND_HOME.with(Cell::get);
        // The bound too: another engine made at a dropped one's address may have fewer shards.
        (engine == self as *const Self as usize && shard < self.shards.len()).then_some(shard)
    }

    fn set_second_home(&self, shard: usize) {
        SECOND_HOME.with(|s| s.set((self as *const Self as usize, shard)));
    }

    /// Fresh memory, a whole chunk that no shard holds yet (the pool's initial memory): it
    /// waits in the reserve until a thread's shard needs it.
    pub(crate) fn add_reserve(&self, base: u64, size: u64) {
        let mut reserve = self.reserve.lock();
        reserve.push((base, size));
        self.reserved_chunks
            .store(reserve.len(), std::sync::atomic::Ordering::Relaxed);
    }

    /// Takes out of the reserve the chunk `base` if it is there (a trim releasing it).
    fn take_reserved(&self, base: u64, size: u64) -> bool {
        let mut reserve = self.reserve.lock();
        let Some(at) = reserve.iter().position(|&c| c == (base, size)) else {
            return false;
        };
        reserve.swap_remove(at);
        self.reserved_chunks
            .store(reserve.len(), std::sync::atomic::Ordering::Relaxed);
        true
    }

    /// The smallest chunk of the reserve that holds `size`, moved into shard `home`, with
    /// `size` bytes taken from it; `None` if none is large enough.
    #[cold]
    fn take_reserve(&self, home: usize, size: u64, stream: &S) -> Result<Option<u64>> {
        let mut reserve = self.reserve.lock();
        let best = (0..reserve.len())
            .filter(|&i| reserve[i].1 >= size)
            .min_by_key(|&i| reserve[i].1);
        let Some(at) = best else {
            return Ok(None);
        };
        let (base, chunk) = reserve.swap_remove(at);
        self.reserved_chunks
            .store(reserve.len(), std::sync::atomic::Ordering::Relaxed);
        let _span = tracing::debug_span!("reserve chunk to shard", base, chunk, home).entered();
        let mut reserve = Some(reserve);
        if planted!(RESERVE_RELEASED_EARLY) {
            reserve = None;
        }
        self.add_chunk_to(home, base, chunk);
        // The chunk reaches the shard's free list before the reserve's lock goes (lock order:
        // the reserve, then a shard), so that `stats`, which holds it while it reads the
        // shards, finds the chunk in one or the other, never in neither; and the reserve's
        // lock goes before the take, whose orderings are driver calls. The shard's lock is
        // held throughout, so no other request takes the chunk in between.
        let shard = &self.shards[home];
        let mut heap = shard.lock();
        let given = heap.free.give_range(base, chunk, Waits::default());
        debug_assert!(given, "a reserved chunk overlapped a block");
        // Under the reserve's lock, with the chunk in the shard's list (see `take_slow`).
        self.reserve_moves.fetch_add(1, Ordering::Release);
        drop(reserve);
        self.take_locked(shard, heap, size, stream, true)
    }

    /// The best fit among the other shards (as one list would choose: taking the first fit
    /// found would split large blocks that a later request needs whole), looked at one lock at
    /// a time; if another request took it meanwhile, the next best. Without `every_shard`,
    /// only shards whose lock is free now: a busy shard is another thread at work in its own
    /// memory, and waiting for each in turn cost `churn-4t` grown from 256 MiB half again its
    /// time (run23); the request looks at every shard, waiting, before it takes the growth lock
    /// ([`take_contended`](Self::take_contended)), and again under it
    /// ([`take_slow`](Self::take_slow)).
    #[cold]
    fn take_elsewhere(
        &self,
        home: usize,
        size: u64,
        stream: &S,
        every_shard: bool,
    ) -> Result<Option<u64>> {
        let n = self.shards.len();
        let fit_in = |i: usize| {
            let heap = if every_shard {
                Some(self.shards[i].lock())
            } else {
                self.shards[i].try_lock()
            };
            heap.and_then(|heap| heap.free.fit(size))
                .map(|fit| (fit, i))
        };
        let mut fits: Vec<(u64, usize)> =
            (1..n).map(|k| (home + k) % n).filter_map(fit_in).collect();
        fits.sort_unstable();
        for (_, i) in fits {
            if let Some(addr) = self.take_free(&self.shards[i], None, size, stream, false)? {
                self.spills.fetch_add(1, Ordering::Relaxed);
                self.set_second_home(i);
                return Ok(Some(addr));
            }
        }
        Ok(None)
    }

    /// `shard`'s best fit for `size`, handed out on `stream` after the orderings its tag
    /// needs; `None` if no block is large enough. `fresh` (a chunk just grown) is first given
    /// to the free list under the same lock, so that no other request takes it in between.
    /// `home`: the shard is the calling thread's own (see [`take_locked`](Self::take_locked)).
    #[inline]
    fn take_free(
        &self,
        shard: &Shard<S>,
        fresh: Option<(u64, u64)>,
        size: u64,
        stream: &S,
        home: bool,
    ) -> Result<Option<u64>> {
        let mut heap = shard.lock();
        if let Some((base, chunk)) = fresh {
            // Grown for use on `stream`: a stream-ordered upstream (the driver's pool, another
            // pool) hands out memory that is ready only in that stream's order, so it is
            // tagged as if freed there now. The request itself needs nothing; another stream
            // takes the rest after an ordering or an idle answer, as for any other free (a
            // review found a nested pool handing such memory to a third stream at once).
            let slot = heap.slot(stream);
            let tag = heap.freed_on(slot);
            let given = heap.free.give_range(base, chunk, tag);
            debug_assert!(given, "a fresh chunk overlapped a block");
        }
        self.take_locked(shard, heap, size, stream, home)
    }

    /// [`take_free`](Self::take_free) once `shard`'s lock is held (`heap`).
    #[inline]
    fn take_locked(
        &self,
        shard: &Shard<S>,
        mut heap: MutexGuard<'_, Heap<S>>,
        size: u64,
        stream: &S,
        home: bool,
    ) -> Result<Option<u64>> {
        if home && heap.free.has_cached(size) {
            if let Some(addr) = heap.take_cached(size, stream) {
                return Ok(Some(addr));
            }
        }
        // A block taken from another thread's shard is not its taker's to cache: that thread's
        // requests look in its own shard's cache, and a block freed into this one would wait
        // there for a request that never comes (four threads grown from 256 MiB grew half
        // again as often with it).
        let owner = if home && heap.free.caches(size) {
            owner(heap.slot(stream))
        } else {
            NO_OWNER
        };
        let mut taken = self.search(&mut heap, size, stream, owner);
        if taken.is_none() && heap.free.cached_blocks() > 0 {
            taken = self.search_uncached(&mut heap, size, stream, owner);
        }
        let Some((addr, tag)) = taken else {
            return Ok(None);
        };
        let peak_before = heap.peak_in_use;
        heap.count_out(size);
        let counted_to = heap.in_use;
        if tag.is_empty() || heap.only(&tag, stream.uid()) {
            return Ok(Some(addr));
        }
        let slot = heap.slot(stream);
        let mut orders = Orders::new();
        self.orders_for(&mut heap, slot, &tag, &mut orders);
        if orders.is_empty() {
            return Ok(Some(addr));
        }
        drop(heap);
        match self.order(shard, stream, slot, &mut orders) {
            Ok(()) => Ok(Some(addr)),
            Err(Error::StreamCapturing { .. }) if planted!(REFUSED_ORDER_HANDS_OUT) => {
                Ok(Some(addr))
            }
            Err(e) => {
                // The block goes back as it was: nothing is lost, and its tag still asks for
                // the orderings that failed.
                let mut heap = shard.lock();
                // Nor is the peak raised by a block never handed out. Lowered only if nothing
                // has raised it since: exact on one thread, still an upper bound on several
                // (the other threads' counts in between included this block).
                if heap.peak_in_use == counted_to && counted_to > peak_before {
                    heap.peak_in_use = peak_before.max(heap.in_use - size);
                }
                heap.in_use -= size;
                let given = heap.free.free(addr, size, tag);
                debug_assert!(
                    given,
                    "a block taken for a failed ordering could not go back"
                );
                Err(e)
            }
        }
    }

    /// The free block `heap`'s table gives `size` bytes from for the stream in `slot`, by the
    /// engine's placement, and its tag.
    #[inline(always)]
    fn search(
        &self,
        heap: &mut Heap<S>,
        size: u64,
        stream: &S,
        owner: u16,
    ) -> Option<(u64, Waits)> {
        if self.slack > 0.0 {
            let slot = heap.slot(stream);
            let Heap { free, entries, .. } = heap;
            free.take_preferring(size, self.slack, |tag| covered(entries, slot, tag), owner)
        } else {
            heap.free.take_tagged_by(size, owner)
        }
    }

    /// [`search`](Self::search) once nothing fits among the free blocks: the shard's
    /// small-block cache goes back to them, coalesced, before the request looks at other
    /// shards or grows the pool.
    #[cold]
    fn search_uncached(
        &self,
        heap: &mut Heap<S>,
        size: u64,
        stream: &S,
        owner: u16,
    ) -> Option<(u64, Waits)> {
        heap.free.uncache_all();
        self.search(heap, size, stream, owner)
    }

    /// Growth: one request at a time, into the stream's home shard.
    #[cold]
    fn take_slow(&self, size: u64, stream: &S, upstream: &impl Grow<S>) -> Result<u64> {
        let mut slow = self.slow.lock();
        // Before the last look: a trim that puts memory back after it is seen by the recall.
        let trim_epoch = upstream.trim_epoch();
        // Pieces of the upstream's that belong to no shard yet go to this thread's home shard,
        // one at a time, until the request fits there or none is left. This ends: each claim
        // takes at least one piece, nothing adds pieces after construction (a trim only takes
        // them), and the hint says none once the last is gone.
        while upstream.has_unclaimed() {
            let home = &self.shards[self.home()];
            if let Some(addr) = self.take_free(home, None, size, stream, true)? {
                return Ok(addr);
            }
            if !upstream.claim(size, stream) {
                break;
            }
        }
        // Another request may have grown the pool, or freed, while this one waited; and the
        // fast path skipped the shards that were busy.
        loop {
            let moved = self.reserve_moves.load(Ordering::Acquire);
            if let Some(addr) = self.take_any(size, stream, true, upstream)? {
                return Ok(addr);
            }
            // A chunk on its way from the reserve into a shard is in neither for a moment:
            // a look at both then finds nothing, and at the maximum the request would fail
            // with that memory free (about one run in fifteen of `multi_device`'s moving
            // tasks). The move holds the reserve's lock throughout: once this request has had
            // it, every move begun before is over, and if one ended since the look began,
            // look again (each move empties a chunk of the reserve, so this ends).
            drop(self.reserve.lock());
            if planted!(RESERVE_MOVES_IGNORED)
                || self.reserve_moves.load(Ordering::Acquire) == moved
            {
                break;
            }
        }
        // The small-block caches hold free memory that no search sees: back to the free
        // blocks, coalesced, before the pool grows for want of it.
        if self.uncache_everywhere() {
            if let Some(addr) = self.take_any(size, stream, true, upstream)? {
                return Ok(addr);
            }
        }
        let home = self.home();
        let first;
        (slow, first) = upstream.grow_under(slow, &self.slow, size, stream);
        let mut grown = match first {
            Ok(grown) => grown,
            // Out of memory (at the maximum), perhaps while a trim waits for the GPU with free
            // memory out of the lists: that memory back in the lists, then one more look and
            // growth (which at the maximum gives whole free chunks back first). A request that
            // can grow leaves the trims what they hold; other errors are the request's.
            Err(Error::OutOfMemory { .. }) if upstream.recall_trimmed(trim_epoch) => {
                if let Some(addr) = self.take_any(size, stream, true, upstream)? {
                    return Ok(addr);
                }
                let again;
                (slow, again) = upstream.grow_under(slow, &self.slow, size, stream);
                again?
            }
            // Out of memory while another request gives memory back upstream to grow, with
            // `slow` let go: its room, and what its growth leaves free, come back at its end.
            Err(e @ Error::OutOfMemory { .. }) => {
                let waited;
                (slow, waited) = upstream.wait_for_give_backs(slow, &self.slow);
                if !waited {
                    // Frees land without `slow`: memory freed since the look above (a whole
                    // chunk a growth at the maximum found free and put back) serves it now.
                    // (It also finds a piece whose move out of the reserve ended since: the
                    // planted bug of the look after such moves must skip this one too.)
                    if planted!(RESERVE_MOVES_IGNORED) {
                        return Err(e);
                    }
                    return match self.take_any(size, stream, true, upstream)? {
                        Some(addr) => Ok(addr),
                        None => Err(e),
                    };
                }
                if let Some(addr) = self.take_any(size, stream, true, upstream)? {
                    return Ok(addr);
                }
                let again;
                (slow, again) = upstream.grow_under(slow, &self.slow, size, stream);
                again?
            }
            Err(e) => return Err(e),
        };
        // Held to the end: one growth at a time.
        let _slow = slow;
        // An upstream that extends free memory (the expandable pool maps only what the request
        // lacks beyond the free block at its end) can come back to find that block taken
        // meanwhile (requests served from the free list do not take `slow`): then it grows
        // again, extending what it mapped. A few tries; a plain upstream serves the first.
        // Each try grows only after the one before failed, so that every chunk grown is added
        // below (growing after the last try dropped that chunk: upstream memory in no list).
        for tries in 0..4 {
            if tries > 0 {
                grown = upstream.grow(size, stream)?;
            }
            let (base, chunk) = grown;
            self.add_chunk_to(home, base, chunk);
            let Some(shard) = self.shard_of(base, chunk) else {
                return Err(Error::InvalidArgument {
                    what: "the upstream gave a chunk that overlaps another",
                });
            };
            if let Some(addr) = self.take_free(shard, Some((base, chunk)), size, stream, true)? {
                return Ok(addr);
            }
        }
        Err(Error::InvalidArgument {
            what: "the upstream gave a chunk smaller than asked for",
        })
    }
}

crate::sync::thread_local! {
    /// (the engine's address, the shard of it that last served a spill of this thread). A hint
    /// of where to look first, with no bearing on what is safe; an engine dropped and another
    /// made at its address only gets a wrong first look. `crate::sync`'s thread-local: under
    /// loom a std one would carry the hint from one execution into the next (an engine made
    /// at the same address), which loom takes for a model that is not deterministic.
    // loom's `thread_local!` takes no `const { }` initializer.
    #[allow(clippy::missing_const_for_thread_local)]
    static SECOND_HOME: Cell<(usize, usize)> = Cell::new((0, 0));
}

/// A small number for the calling thread, handed out in turn to threads as they first ask.
#[inline]
fn thread_index() -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    // Std's, not `crate::sync`'s: a counter that only spreads threads over shards, with no
    // bearing on what is safe (under loom every model thread may well get the same shard).
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static MINE: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    MINE.with(|mine| {
        if mine.get() == usize::MAX {
            mine.set(NEXT.fetch_add(1, Relaxed));
        }
        mine.get()
    })
}

/// The block table's owner for the stream in `slot`: its slot, where it fits ([`NO_OWNER`]
/// past 65,534 streams, whose blocks then skip the small-block cache).
#[inline]
fn owner(slot: u32) -> u16 {
    u16::try_from(slot).unwrap_or(NO_OWNER)
}

/// Whether the stream in `slot` may use a block tagged `tag` without an ordering.
#[inline]
fn covered<S: EngineStream>(entries: &[Option<Entry<S>>], slot: u32, tag: &Waits) -> bool {
    let Some(me) = entries.get(slot as usize).and_then(Option::as_ref) else {
        return false;
    };
    !tag.every()
        && (tag.pairs().iter()).all(|&(d, at)| {
            d == slot
                || me.waited(d) > at
                || (entries.get(d as usize))
                    .and_then(Option::as_ref)
                    .is_some_and(|e| e.done > at)
        })
}

#[cfg(all(test, not(streamalloc_loom)))]
mod review_tests {
    use std::sync::atomic::{AtomicU64 as StdU64, Ordering::SeqCst};

    use super::*;
    use crate::{Device, SimConfig};

    /// An upstream whose every chunk is half of what is asked: as an upstream that extends the
    /// free block at its end (the expandable pool) gives, when that block was taken meanwhile.
    struct Short {
        next: StdU64,
        grown: StdU64,
    }

    impl Grow for Short {
        fn grow(&self, min: u64, _: &Stream) -> Result<(u64, u64)> {
            self.grown.fetch_add(min / 2, SeqCst);
            Ok((self.next.fetch_add(min, SeqCst), min / 2))
        }
    }

    /// A request that the upstream's chunks never serve fails after a few tries; every chunk
    /// grown for it must be in the engine, free. The last try grew a chunk and dropped it: the
    /// upstream's memory, held by nobody's list (the expandable pool's mapped granules, a hole
    /// for good).
    #[test]
    fn a_growth_that_never_fits_keeps_every_chunk_it_grew() {
        const B: u64 = 1 << 20;
        let device = Device::simulated(SimConfig::default());
        let stream = device.create_stream().unwrap();
        let heap: StreamHeap = StreamHeap::with_options(0.0, 1);
        let short = Short {
            next: StdU64::new(0x1000_0000),
            grown: StdU64::new(0),
        };
        match heap.take(2 * B, &stream, &short) {
            Err(Error::InvalidArgument { .. }) => {}
            r => panic!("{r:?}"),
        }
        let grown = short.grown.load(SeqCst);
        assert!(grown > 0);
        assert_eq!(heap.stats().free_bytes, grown, "a grown chunk was lost");
        heap.check().unwrap();
    }
}
