//! The global arena: the free memory of every upstream chunk as coalesced *regions*, the
//! superblocks lent to stream arenas, the large blocks handed out, and the *guards* (events)
//! that order whoever takes a region after the streams that last used it.

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::FxHashMap;

use super::stream_arena::StreamArena;
use crate::error::Result;
use crate::event::Event;
use crate::stream::{Stream, StreamId};
use crate::sync::Arc;

// ===== guards =====

/// An event that whoever takes a piece of memory must be ordered after.
#[derive(Clone)]
pub(super) struct Guard {
    pub(super) stream: StreamId,
    /// Taken together with the recording, under the lock of the stream's arena (see
    /// `ArenaResource::record_guard`): of two guards of one stream, the higher ticket is the
    /// later event.
    ticket: u64,
    pub(super) event: Event,
}

impl Guard {
    /// A guard from an event just recorded on `stream` with `ticket`. The caller holds the lock
    /// that orders every recording of a guard on `stream`.
    pub(super) fn new(stream: StreamId, ticket: u64, event: Event) -> Self {
        Guard {
            stream,
            ticket,
            event,
        }
    }
}

/// The guards of a free region: at most one per stream.
#[derive(Clone, Default)]
pub(super) struct Guards(pub(super) Vec<Guard>);

impl Guards {
    pub(super) fn one(guard: Guard) -> Self {
        Guards(vec![guard])
    }

    fn add(&mut self, guard: Guard) {
        match self.0.iter_mut().find(|g| g.stream == guard.stream) {
            Some(g) if g.ticket < guard.ticket => *g = guard,
            Some(_) => {}
            None => self.0.push(guard),
        }
    }

    /// Merges in another region's guards: at most one per stream stays, so the list is bounded
    /// by the streams that used the memory. Guards the GPU has passed are not dropped here:
    /// that needs a driver query per event, and this runs under the global lock (it did, once);
    /// `order` skips them.
    fn merge(&mut self, other: Guards) {
        for guard in other.0 {
            self.add(guard);
        }
    }

    /// Makes `stream` wait for every guard of another stream that is not complete yet.
    /// `Ok(false)` where a guard of another stream withholds its callbacks
    /// (`Event::withholds_callbacks`): its result is an error, yet nothing says the GPU is done
    /// with the memory (the device's query and wait of it both panicked), so the memory must
    /// be leaked, never used or freed. (A guard of `stream` itself needs no wait, withheld or
    /// not: the stream's new work runs after its old.)
    pub(super) fn order(&self, stream: &Stream) -> Result<bool> {
        for g in &self.0 {
            if g.stream == stream.id() {
                continue;
            }
            match g.event.query_for_crate() {
                None => stream.wait(&g.event)?,
                // Looked at after the result: the state that withholds the callbacks is the
                // one the result was published with, so this cannot miss it.
                Some(_) if g.event.withholds_callbacks() => return Ok(false),
                Some(_) => {}
            }
        }
        Ok(true)
    }

    /// Whether a guard withholds its callbacks: nothing says the GPU is done with the memory.
    /// An atomic load per guard, no driver call: cheap enough under the global lock.
    fn withheld(&self) -> bool {
        self.0.iter().any(|g| g.event.withholds_callbacks())
    }

    /// The streams of the guards the GPU has not passed yet (or that nothing says it has: an
    /// event that withholds its callbacks), for the dump.
    pub(super) fn describe(&self) -> String {
        let streams: Vec<String> = self
            .0
            .iter()
            .filter(|g| g.event.query_for_crate().is_none() || g.event.withholds_callbacks())
            .map(|g| g.stream.to_string())
            .collect();
        if streams.is_empty() {
            return String::new();
        }
        format!(", ordered after {}", streams.join(", "))
    }
}

// ===== the global arena =====

pub(super) struct Region {
    pub(super) size: u64,
    pub(super) guards: Guards,
}

/// A superblock lent to a stream arena.
pub(super) struct Lent {
    pub(super) size: u64,
    pub(super) arena: Arc<StreamArena>,
}

/// A large block: the size asked for, and the extent handed out (the size, or a whole region).
#[derive(Clone, Copy)]
pub(super) struct Large {
    pub(super) size: u64,
    pub(super) extent: u64,
}

/// A wholly free upstream chunk taken out of the global arena, on its way back upstream.
#[derive(Clone)]
pub(super) struct WholeChunk {
    pub(super) base: u64,
    pub(super) size: u64,
    /// Whoever last used any of it: the upstream free must be ordered after them.
    pub(super) guards: Guards,
}

pub(super) struct Global {
    /// Free regions: address → region. Coalesced within a chunk.
    pub(super) regions: BTreeMap<u64, Region>,
    /// The same regions as (size, address), for best fit.
    pub(super) by_size: BTreeSet<(u64, u64)>,
    /// Superblocks lent to stream arenas: base → owner.
    pub(super) lent: BTreeMap<u64, Lent>,
    /// Large blocks handed out: address → sizes.
    pub(super) large: FxHashMap<u64, Large>,
    /// Upstream chunks: base → size. No region merges across a chunk's base. A chunk on its
    /// way back upstream is not in it (nor in `regions`), but still counts in the resource's
    /// `reserved` until the upstream took it.
    pub(super) chunks: BTreeMap<u64, u64>,
    /// Leaked memory: address → size. Free, but guarded by an event that withholds its
    /// callbacks (see [`Guards::order`]): nothing says the GPU is done with it, so it is never
    /// handed out again, and its chunk is never given back upstream.
    pub(super) leaked: BTreeMap<u64, u64>,
}

impl Global {
    pub(super) fn new() -> Self {
        Self {
            regions: BTreeMap::new(),
            by_size: BTreeSet::new(),
            lent: BTreeMap::new(),
            large: FxHashMap::default(),
            chunks: BTreeMap::new(),
            leaked: BTreeMap::new(),
        }
    }

    /// Leaks `[addr, addr + size)`, taken out of the free regions (or a chunk on its way
    /// upstream): an event that guards it withholds its callbacks.
    pub(super) fn leak(&mut self, addr: u64, size: u64) {
        tracing::error!(
            addr,
            size,
            "arena memory whose guard withholds its callbacks (nothing says the GPU is done \
             with it) is leaked"
        );
        self.leaked.insert(addr, size);
    }

    /// Whether the chunk at `base` of `size` bytes holds leaked memory (so it must never go
    /// back upstream).
    pub(super) fn holds_leaked(&self, base: u64, size: u64) -> bool {
        self.leaked.range(base..base + size).next().is_some()
    }

    pub(super) fn free_bytes(&self) -> u64 {
        self.regions.values().map(|r| r.size).sum()
    }

    pub(super) fn largest_free(&self) -> u64 {
        self.by_size.iter().next_back().map_or(0, |&(size, _)| size)
    }

    /// Gives `[addr, addr + size)` back, merging it with free neighbours of the same chunk.
    pub(super) fn insert_free(&mut self, mut addr: u64, mut size: u64, mut guards: Guards) {
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
        self.by_size.insert((size, addr));
        self.regions.insert(addr, Region { size, guards });
    }

    /// Takes `need` bytes from the best-fitting region, or, if no region holds `need`, a whole
    /// region of at least `min` bytes. The rest of the region stays unless it would be smaller
    /// than `split_min`; then the whole region goes. Returns (address, extent, guards).
    pub(super) fn take(
        &mut self,
        need: u64,
        min: u64,
        split_min: u64,
    ) -> Option<(u64, u64, Guards)> {
        let (size, addr, region) = loop {
            let fit = self
                .by_size
                .range((need, 0)..)
                .next()
                .or_else(|| self.by_size.range((min, 0)..).next())
                .copied()?;
            let (size, addr) = fit;
            self.by_size.remove(&fit);
            let region = self.regions.remove(&addr)?;
            // Taken for done, a withheld guard's error let the region go out under work that
            // may still use it: leaked instead, and the next fit looked for.
            if region.guards.withheld() {
                self.leak(addr, size);
                continue;
            }
            break (size, addr, region);
        };
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
    pub(super) fn owner_of(&self, addr: u64, size: u64) -> Option<Arc<StreamArena>> {
        let (&base, lent) = self.lent.range(..=addr).next_back()?;
        // Checked, as `StreamArena::find`: a bad pointer near `u64::MAX` is refused.
        let end = addr.checked_add(size)?;
        (end <= base + lent.size).then(|| lent.arena.clone())
    }

    /// Bytes in chunks that are wholly free (one region spans the whole chunk).
    pub(super) fn whole_chunk_bytes(&self) -> u64 {
        self.chunks
            .iter()
            .filter(|&(base, &size)| self.regions.get(base).is_some_and(|r| r.size == size))
            .map(|(_, &size)| size)
            .sum()
    }

    /// Takes every wholly free chunk out: out of `regions` and out of `chunks`, so that nothing
    /// hands it out and a chunk the upstream gives again at the same address can be registered
    /// while this one goes back.
    pub(super) fn take_whole_chunks(&mut self) -> Vec<WholeChunk> {
        let whole: Vec<(u64, u64)> = self
            .chunks
            .iter()
            .filter(|&(base, &size)| self.regions.get(base).is_some_and(|r| r.size == size))
            .map(|(&base, &size)| (base, size))
            .collect();
        // A whole chunk whose guard withholds its callbacks is leaked, not given back: its
        // free upstream would run under work that may still use it.
        let (withheld, whole): (Vec<_>, Vec<_>) = whole
            .into_iter()
            .partition(|(base, _)| self.regions[base].guards.withheld());
        for (base, size) in withheld {
            self.regions.remove(&base);
            self.by_size.remove(&(size, base));
            self.leak(base, size);
        }
        whole
            .into_iter()
            .filter_map(|(base, size)| {
                let region = self.regions.remove(&base)?;
                self.by_size.remove(&(size, base));
                self.chunks.remove(&base);
                Some(WholeChunk {
                    base,
                    size,
                    guards: region.guards,
                })
            })
            .collect()
    }

    /// A chunk taken out by [`take_whole_chunks`](Self::take_whole_chunks) that stays after
    /// all (the upstream refused it, or a trim was cancelled): free again, as it was.
    pub(super) fn restore_chunk(&mut self, chunk: WholeChunk) {
        self.chunks.insert(chunk.base, chunk.size);
        self.insert_free(chunk.base, chunk.size, chunk.guards);
    }
}
