//! What the expandable pool (`resource/expandable`, issue 11) needs of the engine: the free
//! neighbours of a range it maps, every list drained, and the granule-aligned free memory to
//! unmap.

use super::*;

impl<S: EngineStream> StreamLists<S> {
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
