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
//! Here: the lists, the requests' fast path (own list, then fresh memory), growth and the order
//! of resort; beside it `steal.rs`, `merge.rs`, `live.rs` (every free checked against the blocks
//! handed out), `retire.rs` (memory going back), `view.rs` (statistics, the invariant checker,
//! snapshots), `expandable.rs` (what the expandable pool needs), `cache.rs` (the thread-local
//! list cache of [`Stream`]) and `planted.rs` (the loom models' switches).
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

mod cache;
mod expandable;
mod live;
mod merge;
#[cfg(streamalloc_loom)]
pub(crate) mod planted;
#[cfg(not(streamalloc_loom))]
mod planted;
mod retire;
mod steal;
mod view;

pub(crate) use live::unlive;
pub(crate) use view::ListBlocks;

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
}
