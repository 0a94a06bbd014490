//! The per-stream free-list engine that [`PoolResource`](super::pool::PoolResource) and
//! [`FixedSizeResource`](super::fixed_size::FixedSizeResource) share: RMM's
//! `stream_ordered_memory_resource`, with a lock per stream instead of one for the pool.
//!
//! Each stream that frees memory has its own [`FreeList`], keyed by the stream's unique id (a
//! driver handle can be reused; our ids cannot). Memory freed on stream S is handed to later
//! requests on S at once: stream order makes that safe. The fast path takes only S's lock, found
//! through a thread-local cache, so threads on different streams never wait on each other.
//!
//! When S's list cannot serve a request, in this order:
//! 1. *fresh* memory, that no stream has used (chunks allocated synchronously): no ordering
//!    needed;
//! 2. a *steal*: a block from another stream D's list; an event is recorded on D **now** and S
//!    waits on it. RMM records an event at every free instead; recording at the steal costs one
//!    event per steal rather than per free, and it covers every block D holds, including blocks
//!    D took over from other lists (D waited on their streams first, so the fix of RMM issue
//!    2489, recording the guard again after a merge, holds by construction). The donor is the
//!    list with the closest fit, and the whole block moves: its remainder joins S's list (S
//!    waited on D, so all of it is S's to use). D's lock is held from the take to the end of the ordering, so a
//!    failed ordering puts the block back into a list that no merge can have retired meanwhile;
//! 3. *merge* (RMM issue 2039, and what keeps memory from stranding across streams): the lists
//!    of streams the user has dropped (we hold the last handle), and then up to
//!    `merge_limit` other streams' lists, fullest first, move wholesale into S's list after S
//!    waits on each (one event and one GPU-side wait per list: the host never waits, and no
//!    request waits on more than one event per stream). There free neighbours coalesce whatever
//!    stream freed them; fresh memory joins too (without waiting), or it could never coalesce
//!    with freed memory. Dropped streams' lists are retired and their stream handles released;
//! 4. *grow* from the upstream ([`Grow`]; at its maximum the upstream may first give back
//!    wholly free chunks, which after step 3 mostly sit in S's list, so they go back on S);
//! 5. out of memory: *merge every list* into S's, try once more, and if that moved anything,
//!    grow once more (a chunk that the merge made whole can now go back to make room); then the
//!    error.
//!
//! The engine is generic over what it needs from a stream ([`EngineStream`]): the resources use
//! it with [`Stream`] (the default), and the loom model `loom-tests/free_lists.rs` with a fake
//! stream that records the ordering edges. Monomorphized: no dynamic dispatch.

use std::collections::HashMap;
use std::fmt;

use rustc_hash::FxHashMap;

use super::free_list::FreeList;
use crate::error::{Error, Result};
use crate::stream::Stream;
use crate::sync::{Arc, AtomicI64, AtomicU64, Mutex, Ordering};

/// What the engine needs from a stream.
pub(crate) trait EngineStream: Clone {
    /// How the stream is named in traces and messages.
    type Name: fmt::Display;

    /// The stream's process-unique id (a driver handle can be reused; this cannot).
    fn uid(&self) -> u64;

    /// The stream's name, for traces and messages.
    fn name(&self) -> Self::Name;

    /// How many handles to the stream exist; 1 when the engine holds the only one (the user
    /// dropped the stream: its list is idle).
    fn handle_count(&self) -> usize;

    /// Orders `later` after all work queued on `self` so far: an event recorded on `self` now,
    /// and a (GPU-side) wait for it queued on `later`.
    fn order_before(&self, later: &Self) -> Result<()>;

    /// The last list this thread looked up for (engine `uid`, stream `uid`), if the stream type
    /// keeps a thread-local cache. None by default.
    fn cached(_engine: u64, _stream: u64) -> Option<Arc<StreamList<Self>>> {
        None
    }

    /// Remembers `list` as the last lookup of this thread.
    fn cache(_engine: u64, _stream: u64, _list: &Arc<StreamList<Self>>) {}

    /// Drops this thread's cached lists of engine `engine`, if it has any (so that a retired
    /// list, and the stream handle it holds, can go).
    fn forget_cached(_engine: u64) {}

    /// Drops this thread's cached list for (`engine`, `stream`), if it has one (it is stale).
    fn uncache(_engine: u64, _stream: u64) {}

    /// Runs `f` on the cached list for (`engine`, `stream`) without cloning its `Arc` (two
    /// atomic operations saved on the fast path); `None` if it is not cached. `f` must not
    /// touch the cache.
    fn with_cached<R>(
        engine: u64,
        stream: u64,
        f: impl FnOnce(&StreamList<Self>) -> R,
    ) -> Option<R> {
        Self::cached(engine, stream).map(|list| f(&list))
    }

    /// Runs `f` on each list of `engine` in this thread's cache, except `stream`'s, until it
    /// returns `Some`. None by default.
    fn find_cached<R>(
        _engine: u64,
        _stream: u64,
        _f: impl FnMut(&StreamList<Self>) -> Option<R>,
    ) -> Option<R> {
        None
    }
}

impl EngineStream for Stream {
    type Name = crate::stream::StreamId;

    #[inline]
    fn uid(&self) -> u64 {
        Stream::id(self).get()
    }

    fn name(&self) -> crate::stream::StreamId {
        Stream::id(self)
    }

    fn handle_count(&self) -> usize {
        Stream::handle_count(self)
    }

    fn order_before(&self, later: &Self) -> Result<()> {
        self.record().and_then(|event| later.wait(&event))
    }

    #[inline]
    fn cached(engine: u64, stream: u64) -> Option<Arc<StreamList<Self>>> {
        cache::get(engine, stream)
    }

    #[inline]
    fn cache(engine: u64, stream: u64, list: &Arc<StreamList<Self>>) {
        cache::put(engine, stream, list)
    }

    fn forget_cached(engine: u64) {
        cache::forget(engine, None)
    }

    fn uncache(engine: u64, stream: u64) {
        cache::forget(engine, Some(stream))
    }

    #[inline]
    fn with_cached<R>(
        engine: u64,
        stream: u64,
        f: impl FnOnce(&StreamList<Self>) -> R,
    ) -> Option<R> {
        cache::with(engine, stream, f)
    }

    fn find_cached<R>(
        engine: u64,
        stream: u64,
        f: impl FnMut(&StreamList<Self>) -> Option<R>,
    ) -> Option<R> {
        cache::find(engine, stream, f)
    }
}

/// Where new memory comes from.
pub(crate) trait Grow<S = Stream> {
    /// A new chunk of at least `min` bytes, allocated for use on `stream`: `(base, size)`. Its
    /// error is the resource's out-of-memory error, with its numbers.
    fn grow(&self, min: u64, stream: &S) -> Result<(u64, u64)>;
}

/// One stream's free memory.
pub(crate) struct StreamList<S = Stream> {
    /// The stream's uid (the registry's key).
    uid: u64,
    state: Mutex<ListState<S>>,
}

struct ListState<S> {
    /// The stream, kept so a steal can record an event on it. Holding it keeps a dropped
    /// stream's handle alive until its list is merged away; `None` once the list is retired
    /// or the engine is gone. A thread's cache of lists (`cache`) may hold a list for as long
    /// as the thread lives: the handle must not live that long with it, or a dropped device
    /// (its contexts, streams and pinned staging memory) would never be released (issue 16:
    /// the staging block that compute-sanitizer reported leaked at exit).
    stream: Option<S>,
    free: FreeList,
    /// Merged away: its blocks moved to another list. A stale cached handle must look again.
    retired: bool,
    /// Bytes handed out minus bytes given back through this list since its last flush into
    /// [`StreamLists::in_use`]: a count kept under the lock the fast path already holds, so
    /// that the statistics cost no shared atomic per operation.
    net: i64,
    /// The blocks handed out to requests on this list's stream: address → size. A free must
    /// name one of them, with its size, in some list (see [`StreamLists::give`]): a pointer the
    /// pool never handed out, or a wrong size, would otherwise put memory that is in use, or
    /// that another list holds, into a free list (issue 16: two lists sharing memory).
    live: FxHashMap<u64, u64>,
}

impl<S: EngineStream> StreamList<S> {
    /// The list's stream, if the list still has it (not retired, engine alive).
    fn stream(&self) -> Option<S> {
        self.state.lock().stream.clone()
    }

    /// Whether the user has dropped the list's stream (the list holds its only handle).
    fn idle(&self) -> bool {
        self.state
            .lock()
            .stream
            .as_ref()
            .is_some_and(|s| s.handle_count() == 1)
    }
}

impl<S> ListState<S> {
    /// Retires the list: no request may use it again, and its stream handle goes.
    fn retire(&mut self) -> Option<S> {
        self.retired = true;
        self.stream.take()
    }
}

/// A list flushes its `net` count into the shared one once it reaches this many bytes either
/// way. The shared count (and so the peak, which only flushes and `stats` raise) is off by at
/// most this much per list, either way: a stream's unflushed allocations are missing from it,
/// another's unflushed frees are still in it. At 1 MiB a fifth of churn's
/// operations flushed (every request of 1 MiB or more), and the shared atomics cost 30 ns per
/// operation on an H200 host.
const FLUSH: i64 = 16 << 20;

struct Registry<S> {
    lists: FxHashMap<u64, Arc<StreamList<S>>>,
    /// Every chunk's `(start, size)`, for lists made later.
    chunks: Vec<(u64, u64)>,
}

/// The free lists of one resource.
pub(crate) struct StreamLists<S = Stream> {
    /// Distinguishes this engine's entries in the thread-local cache.
    uid: u64,
    /// Memory that no stream has used yet: anyone takes from it without waiting.
    fresh: Mutex<FreeList>,
    registry: Mutex<Registry<S>>,
    steals: AtomicU64,
    merges: AtomicU64,
    /// How many non-idle lists a request may merge into its own before the pool grows.
    merge_limit: usize,
    /// Whether lists keep their blocks in use (`ListState::live`) and frees are checked
    /// against them.
    check_frees: bool,
    /// Held by a request through its merges and growth (see `take_slow`).
    slow: Mutex<()>,
    /// Bytes handed out, less what the lists' `net` counts hold back.
    in_use: AtomicI64,
    /// The most `in_use` has been (to within [`FLUSH`] per list).
    peak_in_use: AtomicI64,
    /// The live entries of lists whose streams the user dropped (merged away or retired):
    /// their blocks may still come back, on any stream. They move here under the registry's
    /// lock, which a free's search holds too (see [`StreamLists::orphan_live`]).
    orphans: Mutex<FxHashMap<u64, u64>>,
}

impl<S: EngineStream> fmt::Debug for StreamLists<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // One statement per lock: `free_bytes` takes the registry's lock itself.
        let streams = self.registry.lock().lists.len();
        f.debug_struct("StreamLists")
            .field("streams", &streams)
            .field("free_bytes", &self.free_bytes())
            .finish()
    }
}

#[cfg(not(streamalloc_loom))]
mod cache {
    //! The thread-local cache of the last four (engine, stream) → list lookups, for
    //! [`Stream`]'s lists, most recent first. Several: a thread that allocates on one stream
    //! and frees on another (the hand-off of `churn-xs`, a pipeline stage) would otherwise miss
    //! on every operation and take the registry's lock each time, and a free of a block
    //! handed out on another stream finds its live entry in one of the cached lists (four
    //! streams per thread, as `churn-xs-1t` drives, stay cached). Not under loom: loom objects
    //! must not outlive a model.
    use std::cell::RefCell;

    use super::StreamList;
    use crate::stream::Stream;
    use crate::sync::Arc;

    /// (engine uid, stream uid, the stream's list), most recent first.
    type Entry = Option<(u64, u64, Arc<StreamList<Stream>>)>;

    const WAYS: usize = 4;

    thread_local! {
        static LAST: RefCell<[Entry; WAYS]> = const { RefCell::new([None, None, None, None]) };
    }

    fn is(entry: &Entry, uid: u64, stream: u64) -> bool {
        matches!(entry, Some((u, s, _)) if *u == uid && *s == stream)
    }

    // `#[inline]`: the engine is generic, so its lookups are compiled in the crate that uses the
    // pool; without it this small function would be called across crates on every operation.
    #[inline]
    pub(super) fn get(uid: u64, stream: u64) -> Option<Arc<StreamList<Stream>>> {
        LAST.with(|last| {
            last.borrow()
                .iter()
                .find(|e| is(e, uid, stream))
                .and_then(|e| e.as_ref().map(|(_, _, list)| list.clone()))
        })
    }

    #[inline]
    pub(super) fn put(uid: u64, stream: u64, list: &Arc<StreamList<Stream>>) {
        // `try_with`: during thread teardown the cache may already be gone.
        let _ = LAST.try_with(|last| {
            let mut last = last.borrow_mut();
            // Moves the entries before this one's old place (or all, the last falling out)
            // down one, and puts it first.
            let at = last
                .iter()
                .position(|e| is(e, uid, stream))
                .unwrap_or(WAYS - 1);
            last[..=at].rotate_right(1);
            last[0] = Some((uid, stream, list.clone()));
        });
    }

    /// `f` on the cached list, borrowed in place.
    #[inline]
    pub(super) fn with<R>(
        uid: u64,
        stream: u64,
        f: impl FnOnce(&StreamList<Stream>) -> R,
    ) -> Option<R> {
        LAST.try_with(|last| {
            let last = last.borrow();
            let entry = last.iter().find(|e| is(e, uid, stream))?;
            entry.as_ref().map(|(_, _, list)| f(list))
        })
        .ok()
        .flatten()
    }

    /// `f` on each cached list of engine `uid` but `stream`'s, until it returns `Some`.
    pub(super) fn find<R>(
        uid: u64,
        stream: u64,
        mut f: impl FnMut(&StreamList<Stream>) -> Option<R>,
    ) -> Option<R> {
        LAST.try_with(|last| {
            last.borrow().iter().find_map(|e| match e {
                Some((u, s, list)) if *u == uid && *s != stream => f(list),
                _ => None,
            })
        })
        .ok()
        .flatten()
    }

    /// Drops the cached lists of engine `uid` (of `stream` only, if given).
    pub(super) fn forget(uid: u64, stream: Option<u64>) {
        let _ = LAST.try_with(|last| {
            for entry in last.borrow_mut().iter_mut() {
                if entry
                    .as_ref()
                    .is_some_and(|(u, s, _)| *u == uid && stream.is_none_or(|x| x == *s))
                {
                    *entry = None;
                }
            }
        });
    }
}

#[cfg(streamalloc_loom)]
mod cache {
    use super::StreamList;
    use crate::stream::Stream;
    use crate::sync::Arc;

    pub(super) fn get(_: u64, _: u64) -> Option<Arc<StreamList<Stream>>> {
        None
    }

    pub(super) fn put(_: u64, _: u64, _: &Arc<StreamList<Stream>>) {}

    pub(super) fn forget(_: u64, _: Option<u64>) {}

    pub(super) fn with<R>(_: u64, _: u64, _: impl FnOnce(&StreamList<Stream>) -> R) -> Option<R> {
        None
    }

    pub(super) fn find<R>(
        _: u64,
        _: u64,
        _: impl FnMut(&StreamList<Stream>) -> Option<R>,
    ) -> Option<R> {
        None
    }
}

/// Bugs the loom models plant, one at a time, to see them caught (`loom-tests/`): switches
/// that exist only under the loom cfg, and are constant `false` otherwise.
#[cfg(streamalloc_loom)]
pub(crate) mod planted {
    use std::sync::atomic::{AtomicBool, Ordering};

    /// `retire_idle` moves the live entries of dropped streams' lists to the orphans after it
    /// has let go of the registry's lock (the lists already out of it): a free can miss them in
    /// both places.
    pub(crate) static MOVE_UNLOCKED: AtomicBool = AtomicBool::new(false);
    /// `take_whole_chunks` reports whole chunks of streams' lists as fresh: the pool would give
    /// them back upstream on its own stream, not after their last use.
    pub(crate) static CHUNKS_AS_FRESH: AtomicBool = AtomicBool::new(false);

    pub(super) fn move_unlocked() -> bool {
        MOVE_UNLOCKED.load(Ordering::Relaxed)
    }

    pub(super) fn chunks_as_fresh() -> bool {
        CHUNKS_AS_FRESH.load(Ordering::Relaxed)
    }
}

#[cfg(not(streamalloc_loom))]
mod planted {
    #[inline(always)]
    pub(super) const fn move_unlocked() -> bool {
        false
    }

    #[inline(always)]
    pub(super) const fn chunks_as_fresh() -> bool {
        false
    }
}

static NEXT_UID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Statistics of the engine.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct EngineStats {
    pub(crate) streams: usize,
    pub(crate) free_bytes: u64,
    pub(crate) free_blocks: usize,
    pub(crate) steals: u64,
    pub(crate) merges: u64,
    pub(crate) in_use: u64,
    pub(crate) peak_in_use: u64,
}

impl<S: EngineStream> StreamLists<S> {
    /// An engine whose requests merge every other list before the resource grows.
    pub(crate) fn new() -> Self {
        Self::with_merge_limit(usize::MAX)
    }

    /// An engine whose requests merge at most `merge_limit` other streams' lists (besides
    /// the lists of dropped streams, which are always merged) before the resource grows.
    pub(crate) fn with_merge_limit(merge_limit: usize) -> Self {
        Self::with_options(merge_limit, true)
    }

    /// [`with_merge_limit`](Self::with_merge_limit), with frees checked against the blocks in
    /// use (`check_frees`) or not (a free is then only checked against the free blocks of the
    /// list it goes to, and one that names memory in use corrupts the lists).
    pub(crate) fn with_options(merge_limit: usize, check_frees: bool) -> Self {
        Self {
            merge_limit,
            check_frees,
            slow: Mutex::new(()),
            in_use: AtomicI64::new(0),
            peak_in_use: AtomicI64::new(0),
            orphans: Mutex::new(FxHashMap::default()),
            uid: NEXT_UID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            fresh: Mutex::new(FreeList::new()),
            registry: Mutex::new(Registry {
                lists: FxHashMap::default(),
                chunks: Vec::new(),
            }),
            steals: AtomicU64::new(0),
            merges: AtomicU64::new(0),
        }
    }

    /// The list of `stream`, made on first use.
    fn list_for(&self, stream: &S) -> Arc<StreamList<S>> {
        let id = stream.uid();
        if let Some(list) = S::cached(self.uid, id) {
            return list;
        }
        let list = {
            let mut registry = self.registry.lock();
            let chunks = &registry.chunks;
            let make = || {
                let mut free = FreeList::new();
                for &(start, size) in chunks {
                    free.add_chunk(start, size);
                }
                Arc::new(StreamList {
                    uid: id,
                    state: Mutex::new(ListState {
                        stream: Some(stream.clone()),
                        free,
                        retired: false,
                        net: 0,
                        live: FxHashMap::default(),
                    }),
                })
            };
            match registry.lists.get(&id) {
                Some(list) => list.clone(),
                None => {
                    let list = make();
                    registry.lists.insert(id, list.clone());
                    list
                }
            }
        };
        S::cache(self.uid, id, &list);
        list
    }

    /// Runs `f` on `stream`'s free list, under its lock.
    fn with_own<R>(&self, stream: &S, mut f: impl FnMut(&mut FreeList) -> R) -> R {
        self.with_own_state(stream, |state| f(&mut state.free))
    }

    /// Runs `f` on `stream`'s list state, under its lock.
    #[inline]
    fn with_own_state<R>(&self, stream: &S, mut f: impl FnMut(&mut ListState<S>) -> R) -> R {
        // The fast path: this thread's cached list, used in place.
        let cached = S::with_cached(self.uid, stream.uid(), |list| {
            let mut state = list.state.lock();
            (!state.retired).then(|| f(&mut state))
        });
        if let Some(Some(result)) = cached {
            return result;
        }
        loop {
            let list = self.list_for(stream);
            let mut state = list.state.lock();
            if !state.retired {
                return f(&mut state);
            }
            // Only reachable through a stale cache entry; the registry has the live list.
            drop(state);
            S::uncache(self.uid, stream.uid());
        }
    }

    /// A new chunk: every list accepts frees inside it and merges no block across its start.
    pub(crate) fn add_chunk(&self, start: u64, size: u64) {
        let mut registry = self.registry.lock();
        // Issue 11: memory mapped inside a chunk already registered (the expandable pool's one
        // reserved range) is accepted there already, and must not become a merge boundary.
        if (registry.chunks.iter()).any(|&(s, n)| s <= start && start + size <= s + n) {
            return;
        }
        registry.chunks.push((start, size));
        self.fresh.lock().add_chunk(start, size);
        for list in registry.lists.values() {
            list.state.lock().free.add_chunk(start, size);
        }
    }

    /// A chunk went back upstream.
    pub(crate) fn remove_chunk(&self, start: u64) {
        let mut registry = self.registry.lock();
        registry.chunks.retain(|c| c.0 != start);
        self.fresh.lock().remove_chunk(start);
        for list in registry.lists.values() {
            list.state.lock().free.remove_chunk(start);
        }
    }

    /// Memory any stream may use at once (a chunk allocated synchronously).
    pub(crate) fn give_fresh(&self, addr: u64, size: u64) {
        let given = self.fresh.lock().give(addr, size);
        debug_assert!(given, "a fresh chunk overlapped free memory");
    }

    /// Gives memory back on `stream` (a free). False, and nothing changes, unless
    /// `[addr, addr + size)` is a block this engine handed out and has not taken back: a
    /// pointer it never handed out, one inside a block, a wrong size and a second free are all
    /// refused.
    #[inline]
    pub(crate) fn give(&self, addr: u64, size: u64, stream: &S) -> bool {
        // The common case: the block was handed out on the stream it comes back on.
        let here = self.with_own_state(stream, |state| {
            if !self.check_frees {
                return Some(self.given_back(state, addr, size));
            }
            let live = unlive(&mut state.live, addr, size)?;
            if live {
                let given = self.given_back(state, addr, size);
                debug_assert!(given, "a live block overlapped free memory");
            }
            Some(live)
        });
        match here {
            Some(given) => given,
            None => self.give_from_elsewhere(addr, size, stream),
        }
    }

    /// A free of a block handed out through another list (another stream's, or one that a
    /// merge moved): its live entry is found there and removed, and the memory goes to
    /// `stream`'s list.
    #[cold]
    fn give_from_elsewhere(&self, addr: u64, size: u64, stream: &S) -> bool {
        let me = stream.uid();
        let mut found = S::find_cached(self.uid, me, |list| {
            unlive(&mut list.state.lock().live, addr, size)
        });
        if found.is_none() {
            // Every list, then the orphans, all under the registry's lock (registry, then a
            // list or the orphans: the lock order of `add_chunk` and `orphan_live`). An entry
            // moves to the orphans under that lock too, so this finds it in one or the other.
            found = self
                .registry
                .lock()
                .lists
                .values()
                .find_map(|list| unlive(&mut list.state.lock().live, addr, size))
                .or_else(|| unlive(&mut self.orphans.lock(), addr, size));
        }
        if found != Some(true) {
            return false;
        }
        self.with_own_state(stream, |state| {
            let given = self.given_back(state, addr, size);
            debug_assert!(given, "a live block overlapped free memory");
            given
        })
    }

    /// Puts a freed block into `state`'s list and counts it given back; false (nothing
    /// counted) if it overlaps free memory there.
    #[inline]
    fn given_back(&self, state: &mut ListState<S>, addr: u64, size: u64) -> bool {
        let given = state.free.give(addr, size);
        if given {
            self.count(state, -(size as i64));
        }
        given
    }

    /// Counts a block handed out through `state`'s list and, if frees are checked, notes it
    /// live there.
    #[inline]
    fn handed_out(&self, state: &mut ListState<S>, addr: u64, size: u64) {
        self.count(state, size as i64);
        if self.check_frees {
            state.live.insert(addr, size);
        }
    }

    /// Moves the live entries of `list` (of a stream the user dropped) to the orphans. The
    /// caller holds the registry's lock and takes `list` out of the registry under it; a free
    /// that searches (`give_from_elsewhere`) holds that lock across every list and the orphans,
    /// so it finds each entry in one place or the other. (Lock order: registry, then a list or
    /// the orphans.)
    fn orphan_live(&self, list: &StreamList<S>) {
        let live = std::mem::take(&mut list.state.lock().live);
        if !live.is_empty() {
            self.orphans.lock().extend(live);
        }
    }

    /// Moves blocks (not handed out) into `stream`'s list, coalescing them there.
    fn give_blocks(&self, blocks: &[(u64, u64)], stream: &S) {
        self.with_own(stream, |free| {
            for &(addr, size) in blocks {
                let given = free.give(addr, size);
                debug_assert!(given, "a moved block overlapped free memory");
            }
        });
    }

    /// Counts `bytes` handed out (positive) or given back (negative) through a list.
    #[inline]
    fn count(&self, state: &mut ListState<S>, bytes: i64) {
        state.net += bytes;
        if state.net.abs() >= FLUSH {
            self.flush(state);
        }
    }

    fn flush(&self, state: &mut ListState<S>) {
        let now = self.in_use.fetch_add(state.net, Ordering::Relaxed) + state.net;
        state.net = 0;
        self.raise_peak(now);
    }

    fn raise_peak(&self, now: i64) {
        // A load first: the peak rarely moves, and a read-modify-write would take the line.
        if now > self.peak_in_use.load(Ordering::Relaxed) {
            self.peak_in_use.fetch_max(now, Ordering::Relaxed);
        }
    }

    /// `size` bytes for use on `stream`, by the whole policy of this module's doc.
    #[inline]
    pub(crate) fn take(&self, size: u64, stream: &S, upstream: &impl Grow<S>) -> Result<u64> {
        // The stream's own list, then fresh memory (no ordering needed either way), counted
        // under the list's lock. Lock order: a list, then `fresh` (nothing takes a list's lock
        // while it holds `fresh`).
        let own = self.with_own_state(stream, |state| {
            let addr = state
                .free
                .take(size)
                .or_else(|| self.fresh.lock().take(size));
            if let Some(addr) = addr {
                self.handed_out(state, addr, size);
            }
            addr
        });
        match own {
            Some(addr) => Ok(addr),
            None => {
                let addr = self.take_slow(size, stream, upstream)?;
                // Counted in the requester's own list, as every free is counted in the list
                // it goes to: the shared count then only ever moves in flushes.
                self.with_own_state(stream, |state| self.handed_out(state, addr, size));
                Ok(addr)
            }
        }
    }

    /// Everything after the stream's own list and fresh memory.
    #[cold]
    fn take_slow(&self, size: u64, stream: &S, upstream: &impl Grow<S>) -> Result<u64> {
        if let Some(addr) = self.steal(size, stream)? {
            return Ok(addr);
        }
        // One request at a time past this point: blocks in flight between lists during a
        // merge would look missing to a second request, which would grow the pool for them.
        // Steals stay outside: a request that a steal serves never waits behind a growth.
        let _slow = self.slow.lock();
        let own_or_fresh = self.with_own(stream, |free| free.take(size));
        if let Some(addr) = own_or_fresh.or_else(|| self.fresh.lock().take(size)) {
            return Ok(addr);
        }
        if let Some(addr) = self.steal(size, stream)? {
            return Ok(addr);
        }
        let own = |this: &Self| this.with_own(stream, |free| free.take(size));
        if self.merge_into(stream, self.merge_limit)? > 0 {
            if let Some(addr) = own(self) {
                return Ok(addr);
            }
        }
        let grown = match upstream.grow(size, stream) {
            Err(e) if e.is_out_of_memory() => {
                // Other streams may have freed memory since, or the merge above was limited:
                // merge everything, and if that moved anything, try again, growing once more
                // (a chunk the merge made whole can go back upstream to make room).
                if self.merge_into(stream, usize::MAX)? == 0 {
                    return Err(e);
                }
                if let Some(addr) = own(self) {
                    return Ok(addr);
                }
                upstream.grow(size, stream)?
            }
            other => other?,
        };
        // An upstream that extends the requester's free memory (the expandable pool maps only
        // what the request lacks beyond this list's free block at its end) can come back to
        // find that block stolen meanwhile (steals run outside `slow`): then it grows again,
        // extending what it mapped. A few tries; a plain upstream serves the first.
        let mut grown = grown;
        for _ in 0..4 {
            let (base, chunk) = grown;
            self.add_chunk(base, chunk);
            let rest = self.with_own(stream, |free| {
                free.give(base, chunk);
                free.take(size)
            });
            if let Some(addr) = rest {
                return Ok(addr);
            }
            grown = upstream.grow(size, stream)?;
        }
        Err(Error::InvalidArgument {
            what: "the upstream gave a chunk smaller than asked for",
        })
    }

    /// Takes a block from another stream's list, ordering `stream` after that stream. The
    /// donor is the list with the closest fit (as one list holding every block would choose):
    /// taking the first fit found would split large blocks that a later request needs whole,
    /// while smaller fits sat in other lists.
    fn steal(&self, size: u64, stream: &S) -> Result<Option<u64>> {
        let me = stream.uid();
        let donors: Vec<Arc<StreamList<S>>> = self
            .registry
            .lock()
            .lists
            .iter()
            .filter(|(&id, _)| id != me)
            .map(|(_, list)| list.clone())
            .collect();
        let mut best: Option<(u64, &Arc<StreamList<S>>)> = None;
        for donor in &donors {
            let state = donor.state.lock();
            if state.retired {
                continue;
            }
            if let Some(fit) = state.free.fit(size) {
                if best.is_none_or(|(b, _)| fit < b) {
                    best = Some((fit, donor));
                    if fit == size {
                        break;
                    }
                }
            }
        }
        let Some((_, donor)) = best else {
            return Ok(None);
        };

        // The donor's lock stays held through the ordering: if it fails, the block goes back
        // into a list that no merge can have retired meanwhile. Recording an event and
        // queueing a wait are quick enqueues that never wait for the GPU.
        let mut state = donor.state.lock();
        let Some(donor_stream) = state.stream.clone().filter(|_| !state.retired) else {
            return Ok(None);
        };
        // The whole block: once `stream` waits on the donor, all of it is ours to use, and its
        // remainder serves this stream's next requests without another steal (after a growth,
        // the other streams would otherwise take the new chunk from its grower piece by piece).
        // Another request may have taken the fit since we looked: then there is none.
        let Some((addr, whole)) = state.free.take_whole(size) else {
            return Ok(None);
        };
        let _span = tracing::debug_span!("steal", bytes = size, block = whole, from = %donor_stream.name(), to = %stream.name()).entered();
        // The block's free was enqueued on the donor before we found it in its list, so an
        // event recorded on the donor now comes after it.
        if let Err(e) = donor_stream.order_before(stream) {
            let given = state.free.give(addr, whole);
            debug_assert!(given, "a stolen block could not go back");
            return Err(e);
        }
        // The donor's lock goes before ours is taken: two streams stealing from each other
        // must not hold one list's lock while waiting for the other's.
        drop(state);
        if whole > size {
            self.give_blocks(&[(addr + size, whole - size)], stream);
        }
        self.steals.fetch_add(1, Ordering::Relaxed);
        Ok(Some(addr))
    }

    /// Moves other streams' lists into `stream`'s, after `stream` waits on each: every list
    /// whose stream the user dropped (it is then retired, and its stream handle released), and
    /// up to `limit` others that hold memory, fullest first. Fresh memory joins too. Returns
    /// how many blocks moved.
    fn merge_into(&self, stream: &S, limit: usize) -> Result<usize> {
        // Fresh memory joins too: it needs no ordering, and left apart it could never coalesce
        // with memory that came back to this list (a request for the whole pool, say).
        let fresh = self.fresh.lock().drain();
        self.give_blocks(&fresh, stream);
        let mut moved = fresh.len();
        let me = stream.uid();
        let donors: Vec<(Arc<StreamList<S>>, bool)> = {
            let mut registry = self.registry.lock();
            let mut busy: Vec<(u64, u64)> = Vec::new();
            let mut idle: Vec<u64> = Vec::new();
            for (&id, list) in registry.lists.iter().filter(|(&id, _)| id != me) {
                // The list holds one handle; if that is the only one, the stream is idle.
                if list.idle() {
                    idle.push(id);
                } else if limit > 0 {
                    let bytes = list.state.lock().free.free_bytes();
                    if bytes > 0 {
                        busy.push((id, bytes));
                    }
                }
            }
            busy.sort_unstable_by_key(|&(_, bytes)| std::cmp::Reverse(bytes));
            busy.truncate(limit);
            let mut donors: Vec<(Arc<StreamList<S>>, bool)> = Vec::new();
            for id in idle {
                if let Some(list) = registry.lists.remove(&id) {
                    // Its blocks in use come back on other streams now.
                    self.orphan_live(&list);
                    donors.push((list, true));
                }
            }
            for (id, _) in busy {
                if let Some(list) = registry.lists.get(&id) {
                    donors.push((list.clone(), false));
                }
            }
            donors
        };
        if donors.is_empty() {
            return Ok(moved);
        }
        let _span =
            tracing::debug_span!("merge", into = %stream.name(), lists = donors.len(), limit)
                .entered();
        let result = self.merge_lists(stream, donors, &mut moved);
        self.merges.fetch_add(1, Ordering::Relaxed);
        result.map(|()| moved)
    }

    /// The second half of [`merge_into`](Self::merge_into): moves each donor's blocks (and a
    /// dropped stream's live entries) into `stream`'s list, after `stream` waits on the donor.
    fn merge_lists(
        &self,
        stream: &S,
        donors: Vec<(Arc<StreamList<S>>, bool)>,
        moved: &mut usize,
    ) -> Result<()> {
        let mut result = Ok(());
        for (donor, idle) in donors {
            let (blocks, donor_stream) = {
                let mut state = donor.state.lock();
                let Some(donor_stream) = state.stream.clone().filter(|_| !state.retired) else {
                    continue;
                };
                if idle {
                    // Its count moves to the shared one: the list is going away (its stream
                    // handle too, below, once the blocks are safely elsewhere).
                    state.retired = true;
                    self.flush(&mut state);
                }
                (state.free.drain(), donor_stream)
            };
            // After a failure, lists are put back as they were (retired ones into the
            // registry again), so nothing is lost.
            let ordered = if result.is_ok() && !blocks.is_empty() {
                donor_stream.order_before(stream)
            } else {
                result.clone()
            };
            match ordered {
                Ok(()) => {
                    self.give_blocks(&blocks, stream);
                    *moved += blocks.len();
                    if idle {
                        donor.state.lock().retire();
                    }
                }
                Err(e) => {
                    let mut state = donor.state.lock();
                    if state.retired && !idle {
                        // Retired meanwhile (it cannot be while we hold `slow`, but a list
                        // that no registry holds must never receive memory): a live list of
                        // the donor's stream takes the blocks.
                        drop(state);
                        self.give_blocks(&blocks, &donor_stream);
                        result = Err(e);
                        continue;
                    }
                    for &(addr, size) in &blocks {
                        state.free.give(addr, size);
                    }
                    if idle {
                        state.retired = false;
                        drop(state);
                        self.registry.lock().lists.insert(donor.uid, donor.clone());
                    }
                    result = Err(e);
                }
            }
        }
        result
    }

    /// Takes the lists of streams the user has dropped out of the registry: `(stream, its
    /// blocks)`. The caller waits for each stream and then gives the blocks to
    /// [`give_fresh_blocks`](Self::give_fresh_blocks), or back with
    /// [`give_blocks_to`](Self::give_blocks_to) if it cannot.
    pub(crate) fn retire_idle(&self) -> Vec<(S, Vec<(u64, u64)>)> {
        S::forget_cached(self.uid);
        // Not while a request merges: a list it drained and must put back (its ordering
        // failed) would otherwise be retired under it.
        let _slow = self.slow.lock();
        let lists: Vec<Arc<StreamList<S>>> = {
            let mut registry = self.registry.lock();
            let idle: Vec<u64> = registry
                .lists
                .iter()
                .filter(|(_, list)| list.idle())
                .map(|(&id, _)| id)
                .collect();
            idle.into_iter()
                .filter_map(|id| registry.lists.remove(&id))
                .inspect(|list| {
                    if !planted::move_unlocked() {
                        self.orphan_live(list);
                    }
                })
                .collect()
        };
        if planted::move_unlocked() {
            for list in &lists {
                self.orphan_live(list);
            }
        }
        lists
            .into_iter()
            .filter_map(|list| {
                let mut state = list.state.lock();
                if state.retired {
                    return None;
                }
                self.flush(&mut state);
                let blocks = state.free.drain();
                let stream = state.retire()?;
                drop(state);
                Some((stream, blocks))
            })
            .collect()
    }

    /// Blocks whose last use the host knows to be finished: any stream may take them at once.
    pub(crate) fn give_fresh_blocks(&self, blocks: &[(u64, u64)]) {
        let mut fresh = self.fresh.lock();
        for &(addr, size) in blocks {
            let given = fresh.give(addr, size);
            debug_assert!(given, "a block overlapped fresh memory");
        }
    }

    /// Blocks (not handed out) back into `stream`'s list, as if freed there.
    pub(crate) fn give_blocks_to(&self, blocks: &[(u64, u64)], stream: &S) {
        self.give_blocks(blocks, stream);
    }

    /// Takes out every block that is exactly one of `chunks`, for returning upstream. Returns
    /// `(base, size, the stream it was freed on)`, `None` for fresh memory.
    pub(crate) fn take_whole_chunks(&self, chunks: &[(u64, u64)]) -> Vec<(u64, u64, Option<S>)> {
        let mut out = Vec::new();
        let mut left: HashMap<u64, u64> = chunks.iter().copied().collect();
        {
            let mut fresh = self.fresh.lock();
            left.retain(|&base, &mut size| {
                let whole = fresh.take_exact(base, size);
                if whole {
                    out.push((base, size, None));
                }
                !whole
            });
        }
        let lists: Vec<Arc<StreamList<S>>> = self.registry.lock().lists.values().cloned().collect();
        for list in lists {
            let mut state = list.state.lock();
            left.retain(|&base, &mut size| {
                let whole = state.free.take_exact(base, size);
                if whole {
                    let freed_on = (!planted::chunks_as_fresh())
                        .then(|| state.stream.clone())
                        .flatten();
                    out.push((base, size, freed_on));
                }
                !whole
            });
        }
        out
    }

    /// The largest free block in any list (a scan: for error messages).
    pub(crate) fn largest_free_block(&self) -> u64 {
        let mut largest = self.fresh.lock().blocks().map(|b| b.1).max().unwrap_or(0);
        let lists: Vec<Arc<StreamList<S>>> = self.registry.lock().lists.values().cloned().collect();
        for list in lists {
            let state = list.state.lock();
            largest = largest.max(state.free.blocks().map(|b| b.1).max().unwrap_or(0));
        }
        largest
    }

    /// Free bytes in every list.
    pub(crate) fn free_bytes(&self) -> u64 {
        self.stats().free_bytes
    }

    pub(crate) fn stats(&self) -> EngineStats {
        let mut stats = EngineStats {
            steals: self.steals.load(Ordering::Relaxed),
            merges: self.merges.load(Ordering::Relaxed),
            ..EngineStats::default()
        };
        let mut in_use = self.in_use.load(Ordering::Relaxed);
        {
            let fresh = self.fresh.lock();
            stats.free_bytes += fresh.free_bytes();
            stats.free_blocks += fresh.len();
        }
        let lists: Vec<Arc<StreamList<S>>> = self.registry.lock().lists.values().cloned().collect();
        stats.streams = lists.len();
        for list in lists {
            let state = list.state.lock();
            stats.free_bytes += state.free.free_bytes();
            stats.free_blocks += state.free.len();
            in_use += state.net;
        }
        let peak = self.peak_in_use.fetch_max(in_use, Ordering::Relaxed);
        stats.in_use = in_use.max(0) as u64;
        stats.peak_in_use = peak.max(in_use).max(0) as u64;
        stats
    }

    /// The streams whose lists hold memory (to synchronize before returning chunks upstream).
    pub(crate) fn streams(&self) -> Vec<S> {
        self.registry
            .lock()
            .lists
            .values()
            .filter_map(|l| l.stream())
            .collect()
    }

    /// Checks every list's invariants, that no two lists share a byte, and that no block in
    /// use overlaps free memory or another block in use. Tests only.
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        // (start, size, in use)
        let mut all: Vec<(u64, u64, bool)> = Vec::new();
        {
            let fresh = self.fresh.lock();
            fresh.check().map_err(|e| format!("fresh list: {e}"))?;
            all.extend(fresh.blocks().map(|(a, s)| (a, s, false)));
        }
        all.extend(self.orphans.lock().iter().map(|(&a, &s)| (a, s, true)));
        let lists: Vec<Arc<StreamList<S>>> = self.registry.lock().lists.values().cloned().collect();
        for list in lists {
            let state = list.state.lock();
            state
                .free
                .check()
                .map_err(|e| format!("stream {}: {e}", list.uid))?;
            all.extend(state.free.blocks().map(|(a, s)| (a, s, false)));
            all.extend(state.live.iter().map(|(&a, &s)| (a, s, true)));
        }
        all.sort_unstable();
        for w in all.windows(2) {
            let ((a, x, a_live), (b, y, b_live)) = (w[0], w[1]);
            if a + x > b {
                let what = match (a_live, b_live) {
                    (false, false) => "two lists share memory",
                    (true, true) => "two blocks in use overlap",
                    _ => "a block in use overlaps free memory",
                };
                return Err(format!("{what}: {:x?} and {:x?}", (a, x), (b, y)));
            }
        }
        Ok(())
    }
    // ===== for the expandable pool (resource/expandable): added by issue 11 =====

    /// The free blocks of `stream`'s list that end at `start` and that start at `end`: their
    /// sizes (0 where there is none). What memory mapped at `[start, end)` and given to that
    /// list would coalesce with.
    pub(crate) fn free_around(&self, stream: &S, start: u64, end: u64) -> (u64, u64) {
        self.with_own(stream, |free| {
            (free.free_ending_at(start), free.free_starting_at(end))
        })
    }

    /// Takes every block out of every list (the lists stay, empty): `(stream, its blocks)` for
    /// each list that held any. The caller waits for each stream and then gives the blocks to
    /// [`give_fresh_blocks`](Self::give_fresh_blocks), where free neighbours freed on different
    /// streams coalesce, or back with [`give_blocks_to`](Self::give_blocks_to) if it cannot.
    pub(crate) fn drain_lists(&self) -> Vec<(S, Vec<(u64, u64)>)> {
        let lists: Vec<Arc<StreamList<S>>> = self.registry.lock().lists.values().cloned().collect();
        let mut out = Vec::new();
        for list in lists {
            let mut state = list.state.lock();
            if let Some(stream) = state.stream.clone().filter(|_| !state.retired) {
                if state.free.len() > 0 {
                    out.push((stream, state.free.drain()));
                }
            }
        }
        out
    }

    /// Takes the `granule`-aligned part out of every free block, in every list and the fresh
    /// memory, for unmapping: `(start, size, the stream whose list held it)`, `None` for fresh
    /// memory. The unaligned ends stay free where they were. Give a range back with
    /// [`give_blocks_to`](Self::give_blocks_to) or [`give_fresh_blocks`](Self::give_fresh_blocks)
    /// if it cannot be unmapped.
    pub(crate) fn take_aligned(&self, granule: u64) -> Vec<(u64, u64, Option<S>)> {
        fn aligned(free: &mut FreeList, granule: u64, mut out: impl FnMut(u64, u64)) {
            let blocks: Vec<(u64, u64)> = free.blocks().collect();
            for (addr, size) in blocks {
                let lo = addr.next_multiple_of(granule);
                let hi = (addr + size) / granule * granule;
                if lo < hi && free.take_range(addr, lo, hi) {
                    out(lo, hi - lo);
                }
            }
        }
        let mut out = Vec::new();
        aligned(&mut self.fresh.lock(), granule, |a, n| {
            out.push((a, n, None))
        });
        let lists: Vec<Arc<StreamList<S>>> = self.registry.lock().lists.values().cloned().collect();
        for list in lists {
            let mut state = list.state.lock();
            let Some(stream) = state.stream.clone().filter(|_| !state.retired) else {
                continue;
            };
            aligned(&mut state.free, granule, |a, n| {
                out.push((a, n, Some(stream.clone())))
            });
        }
        out
    }
}

impl<S> Drop for StreamLists<S> {
    /// Lets go of every list's stream: threads' caches may hold the lists themselves for as
    /// long as the threads live, but not the streams (and through them the devices).
    fn drop(&mut self) {
        for list in self.registry.lock().lists.values() {
            let mut state = list.state.lock();
            state.retire();
            state.free = FreeList::new();
            state.live = FxHashMap::default();
        }
    }
}

/// Removes the live entry of the block at `addr`: `Some(true)` if it was there with `size`,
/// `Some(false)` (and it stays) if it was there with another size, `None` if it was not there.
/// (The arena's live tables use it too.)
pub(crate) fn unlive(live: &mut FxHashMap<u64, u64>, addr: u64, size: u64) -> Option<bool> {
    match live.get(&addr) {
        Some(&held) if held == size => {
            live.remove(&addr);
            Some(true)
        }
        Some(_) => Some(false),
        None => None,
    }
}

// ===== a read-only view, for snapshots (src/resource/snapshot.rs) =====

/// One list's free blocks, `(addr, size)`, with its stream's uid (`None`: fresh memory).
pub(crate) type ListBlocks = (Option<u64>, Vec<(u64, u64)>);

impl<S: EngineStream> StreamLists<S> {
    /// Every free block, list by list: `(None, blocks)` for fresh memory, `(Some(stream uid),
    /// blocks)` for each stream's list. One lock at a time (the fresh list's, the registry's,
    /// then each list's in turn), each held only while that list's blocks are copied out.
    pub(crate) fn free_blocks_by_list(&self) -> Vec<ListBlocks> {
        let mut out = vec![(None, self.fresh.lock().blocks().collect())];
        let lists: Vec<Arc<StreamList<S>>> = self.registry.lock().lists.values().cloned().collect();
        for list in lists {
            let blocks = {
                let state = list.state.lock();
                if state.retired {
                    continue;
                }
                state.free.blocks().collect()
            };
            out.push((Some(list.uid), blocks));
        }
        out
    }
}
