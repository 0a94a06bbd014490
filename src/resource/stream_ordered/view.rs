//! Read-only views of the engine: statistics, the largest free block, the streams it holds, the
//! invariant checker, and the free blocks by stream for snapshots (`resource/snapshot.rs`).

use super::*;

/// Free blocks `(addr, size)` shown under one stream's uid (`None`: memory that needs no
/// ordering).
pub(crate) type ListBlocks = (Option<u64>, Vec<(u64, u64)>);

impl<S: EngineStream> StreamHeap<S> {
    /// The largest free block (a scan: for error messages).
    pub(crate) fn largest_free_block(&self) -> u64 {
        let reserved = self.reserve.lock().iter().map(|c| c.1).max().unwrap_or(0);
        (self.shards.iter())
            .map(|shard| shard.lock().free.blocks().map(|b| b.1).max().unwrap_or(0))
            .max()
            .unwrap_or(0)
            .max(reserved)
    }

    /// Bytes handed out now, summed over the shards (each read under its lock; a request
    /// between two reads may be counted in neither or both).
    pub(crate) fn in_use(&self) -> u64 {
        self.shards.iter().map(|shard| shard.lock().in_use).sum()
    }

    /// Sums over the shards. The peak in use is each shard's peak summed: exact with one
    /// shard, an upper bound with several (their peaks need not coincide). Empties the
    /// small-block caches first, so that the free blocks counted are coalesced ones.
    pub(crate) fn stats(&self) -> EngineStats {
        let mut stats = EngineStats {
            waits: self.waits.load(Ordering::Relaxed),
            spills: self.spills.load(Ordering::Relaxed),
            idle_skips: self.idle_skips.load(Ordering::Relaxed),
            ..EngineStats::default()
        };
        // Held while the shards are read: a chunk moving from the reserve into a shard moves
        // under this lock (`take_reserve`), so it is counted once.
        let reserve = self.reserve.lock();
        for &(_, size) in reserve.iter() {
            stats.free_bytes += size;
            stats.free_blocks += 1;
        }
        let mut uids: Vec<u64> = Vec::new();
        for shard in self.shards.iter() {
            // Read only: the small-block cache stays as it is, its blocks counted one each
            // (`PoolStats::free_blocks`). Emptying it here, as this did, made every look at the
            // statistics (a server's metrics, a test's check) change what the next requests
            // found, and the cache's same-size reuse never happened between a free and a look.
            let heap = shard.lock();
            uids.extend(heap.slots.keys().copied());
            stats.free_bytes += heap.free.free_bytes();
            stats.free_blocks += heap.free.len();
            stats.in_use += heap.in_use;
            stats.peak_in_use += heap.peak_in_use;
            stats.cache_hits += heap.free.cache_hits();
        }
        drop(reserve);
        uids.sort_unstable();
        uids.dedup();
        stats.streams = uids.len();
        stats
    }

    /// Every stream the engine holds (to synchronize before returning chunks upstream).
    pub(crate) fn streams(&self) -> Vec<S> {
        self.streams_where(|_| true)
    }

    /// One handle of each stream with an entry that `keep` accepts (a stream has an entry in
    /// every shard that served it). Deduplicated through a set: a server that makes a stream
    /// per request can hold thousands, and a search of the list so far for each entry, under
    /// the shard's lock, would cost their square.
    pub(super) fn streams_where(&self, keep: impl Fn(&Entry<S>) -> bool) -> Vec<S> {
        let mut seen = rustc_hash::FxHashSet::default();
        let mut out: Vec<S> = Vec::new();
        for shard in self.shards.iter() {
            let heap = shard.lock();
            for e in heap.entries.iter().flatten() {
                if keep(e) && seen.insert(e.uid) {
                    out.push((*e.stream).clone());
                }
            }
        }
        out
    }

    /// Checks the free list's invariants, that no block in use overlaps free memory or
    /// another block in use, and that every tag names a stream the engine holds. Tests only.
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        // (start, size, in use)
        let mut all: Vec<(u64, u64, bool)> = Vec::new();
        for &(base, size) in self.reserve.lock().iter() {
            if self.table.covers(base, size) {
                return Err(format!(
                    "reserved chunk {:x?} is also in a shard",
                    (base, size)
                ));
            }
            all.push((base, size, false));
        }
        for (i, shard) in self.shards.iter().enumerate() {
            let heap = shard.lock();
            heap.free.check().map_err(|e| format!("shard {i}: {e}"))?;
            for (addr, size, tag) in heap.free.tagged_blocks() {
                if let Some(&(slot, _)) = tag.pairs().iter().find(|p| heap.entry(p.0).is_none()) {
                    return Err(format!(
                        "shard {i}: free block {:x?} waits on slot {slot}, which holds no stream",
                        (addr, size)
                    ));
                }
                if self.table.shard_of(addr, size) != Some(i as u32) {
                    return Err(format!(
                        "shard {i}: free block {:x?} lies in no chunk of the shard",
                        (addr, size)
                    ));
                }
            }
            all.extend(heap.free.blocks().map(|(a, s)| (a, s, false)));
            all.extend(heap.free.used_blocks().map(|(a, s)| (a, s, true)));
            let live = heap.free.used_bytes();
            if live != heap.in_use {
                return Err(format!(
                    "shard {i}: {live} bytes live, {} counted in use",
                    heap.in_use
                ));
            }
        }
        all.sort_unstable();
        for w in all.windows(2) {
            let ((a, x, a_live), (b, y, b_live)) = (w[0], w[1]);
            if a + x > b {
                let what = match (a_live, b_live) {
                    (false, false) => "free blocks overlap",
                    (true, true) => "two blocks in use overlap",
                    _ => "a block in use overlaps free memory",
                };
                return Err(format!("{what}: {:x?} and {:x?}", (a, x), (b, y)));
            }
        }
        Ok(())
    }

    /// Every free block, grouped by the first stream its tag names (`None`: no ordering
    /// needed; a block freed on several streams shows under one of them), the small-block
    /// caches emptied first.
    pub(crate) fn free_blocks_by_list(&self) -> Vec<ListBlocks> {
        let mut by: FxHashMap<Option<u64>, Vec<(u64, u64)>> = FxHashMap::default();
        by.insert(None, self.reserve.lock().clone());
        for shard in self.shards.iter() {
            let mut heap = shard.lock();
            heap.free.uncache_all();
            for (addr, size, tag) in heap.free.tagged_blocks() {
                let uid = tag.first().and_then(|slot| heap.entry(slot)).map(|e| e.uid);
                by.entry(uid).or_default().push((addr, size));
            }
        }
        let mut out: Vec<ListBlocks> = by.into_iter().collect();
        out.sort_unstable_by_key(|l| l.0);
        out
    }
}
