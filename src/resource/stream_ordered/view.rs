//! Read-only views of the engine: statistics, the largest free block, the streams it holds, the
//! invariant checker, and the free blocks by stream for snapshots (`resource/snapshot.rs`).

use super::*;

/// Free blocks `(addr, size)` shown under one stream's uid (`None`: memory that needs no
/// ordering).
pub(crate) type ListBlocks = (Option<u64>, Vec<(u64, u64)>);

impl<S: EngineStream> StreamHeap<S> {
    /// The largest free block (a scan: for error messages).
    pub(crate) fn largest_free_block(&self) -> u64 {
        let heap = self.state.lock();
        heap.free.blocks().map(|b| b.1).max().unwrap_or(0)
    }

    pub(crate) fn stats(&self) -> EngineStats {
        let heap = self.state.lock();
        EngineStats {
            streams: heap.slots.len(),
            free_bytes: heap.free.free_bytes(),
            free_blocks: heap.free.len(),
            waits: self.waits.load(Ordering::Relaxed),
            in_use: heap.in_use,
            peak_in_use: heap.peak_in_use,
        }
    }

    /// Every stream the engine holds (to synchronize before returning chunks upstream).
    pub(crate) fn streams(&self) -> Vec<S> {
        let heap = self.state.lock();
        heap.entries
            .iter()
            .flatten()
            .map(|e| e.stream.clone())
            .collect()
    }

    /// Checks the free list's invariants, that no block in use overlaps free memory or
    /// another block in use, and that every tag names a stream the engine holds. Tests only.
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        let heap = self.state.lock();
        heap.free.check()?;
        for (addr, size, tag) in heap.free.tagged_blocks() {
            if let Some(&(slot, _)) = tag.pairs().iter().find(|p| heap.entry(p.0).is_none()) {
                return Err(format!(
                    "free block {:x?} waits on slot {slot}, which holds no stream",
                    (addr, size)
                ));
            }
        }
        // (start, size, in use)
        let mut all: Vec<(u64, u64, bool)> =
            heap.free.blocks().map(|(a, s)| (a, s, false)).collect();
        all.extend(heap.live.iter().map(|(&a, &s)| (a, s, true)));
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
        let live: u64 = heap.live.values().sum();
        if self.check_frees && live != heap.in_use {
            return Err(format!("{live} bytes live, {} counted in use", heap.in_use));
        }
        Ok(())
    }

    /// Every free block, grouped by the first stream its tag names (`None`: no ordering
    /// needed; a block freed on several streams shows under one of them).
    pub(crate) fn free_blocks_by_list(&self) -> Vec<ListBlocks> {
        let heap = self.state.lock();
        let mut by: FxHashMap<Option<u64>, Vec<(u64, u64)>> = FxHashMap::default();
        by.insert(None, Vec::new());
        for (addr, size, tag) in heap.free.tagged_blocks() {
            let uid = tag
                .first()
                .and_then(|slot| heap.entry(slot))
                .map(|e| e.stream.uid());
            by.entry(uid).or_default().push((addr, size));
        }
        let mut out: Vec<ListBlocks> = by.into_iter().collect();
        out.sort_unstable_by_key(|l| l.0);
        out
    }
}
