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
//!    2489, recording the guard again after a merge, holds by construction). The remainder of the
//!    stolen block stays with D;
//! 3. *merge idle lists* (RMM issue 2039): lists whose stream the user has dropped (we hold the
//!    last handle) move wholesale into S's list, after S waits on each, where they coalesce;
//!    fresh memory joins them (without waiting), or it could never coalesce with freed memory;
//! 4. *grow* from the upstream ([`Grow`]);
//! 5. out of memory: *merge every list* into S's and try once more; then the error.
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
use crate::sync::{Arc, AtomicU64, Mutex, Ordering};

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

    /// Remembers `list` as the last lookup of this thread (stream uid 0 forgets it).
    fn cache(_engine: u64, _stream: u64, _list: &Arc<StreamList<Self>>) {}
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
}

/// Where new memory comes from.
pub(crate) trait Grow<S = Stream> {
    /// A new chunk of at least `min` bytes, allocated for use on `stream`: `(base, size)`. Its
    /// error is the resource's out-of-memory error, with its numbers.
    fn grow(&self, min: u64, stream: &S) -> Result<(u64, u64)>;
}

/// One stream's free memory.
pub(crate) struct StreamList<S = Stream> {
    /// The stream, kept so a steal can record an event on it. Holding it keeps a dropped
    /// stream's handle alive until its list is merged away.
    stream: S,
    state: Mutex<ListState>,
}

struct ListState {
    free: FreeList,
    /// Merged away: its blocks moved to another list. A stale cached handle must look again.
    retired: bool,
}

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
}

impl<S: EngineStream> fmt::Debug for StreamLists<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamLists")
            .field("streams", &self.registry.lock().lists.len())
            .field("free_bytes", &self.free_bytes())
            .finish()
    }
}

#[cfg(not(streamalloc_loom))]
mod cache {
    //! The thread-local cache of the last (engine, stream) → list lookup, for [`Stream`]'s
    //! lists. Not under loom: loom objects must not outlive a model.
    use std::cell::RefCell;

    use super::StreamList;
    use crate::stream::Stream;
    use crate::sync::Arc;

    /// (engine uid, stream uid, the stream's list).
    type Last = Option<(u64, u64, Arc<StreamList<Stream>>)>;

    thread_local! {
        static LAST: RefCell<Last> = const { RefCell::new(None) };
    }

    // `#[inline]`: the engine is generic, so its lookups are compiled in the crate that uses the
    // pool; without it this small function would be called across crates on every operation.
    #[inline]
    pub(super) fn get(uid: u64, stream: u64) -> Option<Arc<StreamList<Stream>>> {
        LAST.with(|last| match &*last.borrow() {
            Some((u, s, list)) if *u == uid && *s == stream => Some(list.clone()),
            _ => None,
        })
    }

    #[inline]
    pub(super) fn put(uid: u64, stream: u64, list: &Arc<StreamList<Stream>>) {
        // `try_with`: during thread teardown the cache may already be gone.
        let _ = LAST.try_with(|last| *last.borrow_mut() = Some((uid, stream, list.clone())));
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
}

impl<S: EngineStream> StreamLists<S> {
    pub(crate) fn new() -> Self {
        Self {
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
                    stream: stream.clone(),
                    state: Mutex::new(ListState {
                        free,
                        retired: false,
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
        loop {
            let list = self.list_for(stream);
            let mut state = list.state.lock();
            if !state.retired {
                return f(&mut state.free);
            }
            // Only reachable through a stale cache entry; the registry has the live list.
            drop(state);
            S::cache(self.uid, 0, &list);
        }
    }

    /// A new chunk: every list accepts frees inside it and merges no block across its start.
    pub(crate) fn add_chunk(&self, start: u64, size: u64) {
        let mut registry = self.registry.lock();
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

    /// Gives memory back on `stream` (a free). False if it is already free there.
    pub(crate) fn give(&self, addr: u64, size: u64, stream: &S) -> bool {
        self.with_own(stream, |free| free.give(addr, size))
    }

    /// `size` bytes for use on `stream`, by the whole policy of this module's doc.
    pub(crate) fn take(&self, size: u64, stream: &S, upstream: &impl Grow<S>) -> Result<u64> {
        if let Some(addr) = self.with_own(stream, |free| free.take(size)) {
            return Ok(addr);
        }
        if let Some(addr) = self.fresh.lock().take(size) {
            return Ok(addr);
        }
        if let Some(addr) = self.steal(size, stream)? {
            return Ok(addr);
        }
        if self.merge_into(stream, true)? > 0 {
            if let Some(addr) = self.with_own(stream, |free| free.take(size)) {
                return Ok(addr);
            }
        }
        match upstream.grow(size, stream) {
            Ok((base, chunk)) => {
                self.add_chunk(base, chunk);
                let rest = self.with_own(stream, |free| {
                    free.give(base, chunk);
                    free.take(size)
                });
                rest.ok_or(Error::InvalidArgument {
                    what: "the upstream gave a chunk smaller than asked for",
                })
            }
            Err(oom) => {
                if self.merge_into(stream, false)? > 0 {
                    if let Some(addr) = self.with_own(stream, |free| free.take(size)) {
                        return Ok(addr);
                    }
                }
                Err(oom)
            }
        }
    }

    /// Takes a block from another stream's list, ordering `stream` after that stream.
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
        for donor in donors {
            let got = {
                let mut state = donor.state.lock();
                if state.retired {
                    continue;
                }
                state.free.take(size)
            };
            let Some(addr) = got else { continue };
            let _span = tracing::debug_span!("steal", bytes = size, from = %donor.stream.name(), to = %stream.name()).entered();
            // The block's free was enqueued on the donor before we found it in its list, so an
            // event recorded on the donor now comes after it.
            let ordered = donor.stream.order_before(stream);
            if let Err(e) = ordered {
                donor.state.lock().free.give(addr, size);
                return Err(e);
            }
            self.steals.fetch_add(1, Ordering::Relaxed);
            return Ok(Some(addr));
        }
        Ok(None)
    }

    /// Moves other streams' lists into `stream`'s, after `stream` waits on each: only lists
    /// whose stream the user dropped (`idle_only`), which are then retired, or all of them.
    /// Returns how many blocks moved.
    fn merge_into(&self, stream: &S, idle_only: bool) -> Result<usize> {
        // Fresh memory joins too: it needs no ordering, and left apart it could never coalesce
        // with memory that came back to this list (a request for the whole pool, say).
        let fresh = self.fresh.lock().drain();
        for &(addr, size) in &fresh {
            self.give(addr, size, stream);
        }
        let merged_fresh = fresh.len();
        let me = stream.uid();
        let donors: Vec<(Arc<StreamList<S>>, bool)> = {
            let mut registry = self.registry.lock();
            let chosen: Vec<(u64, bool)> = registry
                .lists
                .iter()
                .filter(|(&id, _)| id != me)
                // The list holds one handle; if that is the only one, the stream is idle.
                .map(|(&id, list)| (id, list.stream.handle_count() == 1))
                .filter(|&(_, idle)| idle || !idle_only)
                .collect();
            chosen
                .into_iter()
                .map(|(id, idle)| {
                    let list = if idle {
                        registry.lists.remove(&id)
                    } else {
                        registry.lists.get(&id).cloned()
                    };
                    (list.expect("chosen from the registry under its lock"), idle)
                })
                .collect()
        };
        if donors.is_empty() {
            return Ok(0);
        }
        let _span =
            tracing::debug_span!("merge", into = %stream.name(), lists = donors.len(), idle_only)
                .entered();
        let mut moved = merged_fresh;
        for (donor, idle) in donors {
            let blocks = {
                let mut state = donor.state.lock();
                state.retired |= idle;
                state.free.drain()
            };
            if blocks.is_empty() {
                continue;
            }
            let ordered = donor.stream.order_before(stream);
            // On failure the blocks go back where they were (the donor, even if retired: it is
            // put back in the registry), so nothing is lost.
            let target_is_donor = ordered.is_err();
            if target_is_donor && idle {
                donor.state.lock().retired = false;
                self.registry
                    .lock()
                    .lists
                    .insert(donor.stream.uid(), donor.clone());
            }
            for &(addr, size) in &blocks {
                if target_is_donor {
                    donor.state.lock().free.give(addr, size);
                } else {
                    self.give(addr, size, stream);
                }
            }
            ordered?;
            moved += blocks.len();
        }
        self.merges.fetch_add(1, Ordering::Relaxed);
        Ok(moved)
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
                    out.push((base, size, Some(list.stream.clone())));
                }
                !whole
            });
        }
        out
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
        }
        stats
    }

    /// The streams whose lists hold memory (to synchronize before returning chunks upstream).
    pub(crate) fn streams(&self) -> Vec<S> {
        self.registry
            .lock()
            .lists
            .values()
            .map(|l| l.stream.clone())
            .collect()
    }

    /// Checks every list's invariants and that no two lists share a byte. Tests only.
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        let mut all: Vec<(u64, u64)> = Vec::new();
        {
            let fresh = self.fresh.lock();
            fresh.check().map_err(|e| format!("fresh list: {e}"))?;
            all.extend(fresh.blocks());
        }
        let lists: Vec<Arc<StreamList<S>>> = self.registry.lock().lists.values().cloned().collect();
        for list in lists {
            let state = list.state.lock();
            state
                .free
                .check()
                .map_err(|e| format!("{}: {e}", list.stream.name()))?;
            all.extend(state.free.blocks());
        }
        all.sort_unstable();
        for w in all.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(format!(
                    "two lists share memory: {:x?} and {:x?}",
                    w[0], w[1]
                ));
            }
        }
        Ok(())
    }
}
