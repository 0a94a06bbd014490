//! Read-only views of the engine: statistics, the largest free block, the streams it holds, the
//! invariant checker, and the free blocks list by list for snapshots (`resource/snapshot.rs`).

use super::*;

impl<S: EngineStream> StreamLists<S> {
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
}

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
