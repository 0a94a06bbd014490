//! What the expandable pool (`resource/expandable`, issue 11) needs of the engine: the free
//! neighbours of a range it maps, and the granule-aligned free memory to unmap.

use super::*;

impl<S: EngineStream> StreamHeap<S> {
    /// A chunk (one region of the expandable pool's addresses) in `shard` (modulo the shard
    /// count), its memory a hole until mapped and given.
    pub(crate) fn add_chunk_in(&self, shard: usize, start: u64, size: u64) {
        self.add_chunk_to(shard & (self.shards.len() - 1), start, size);
    }

    /// The shard this thread's requests go to first (see `home`): the region the expandable
    /// pool maps into first for it.
    pub(crate) fn home_shard(&self) -> usize {
        self.home()
    }

    /// The sizes of the free blocks of `shard` that end at `start` and that start at `end` (0
    /// where there is none): what memory mapped at `[start, end)` would coalesce with.
    pub(crate) fn free_around(&self, shard: usize, start: u64, end: u64) -> (u64, u64) {
        let heap = self.shards[shard & (self.shards.len() - 1)].lock();
        (
            heap.free.free_ending_at(start),
            heap.free.free_starting_at(end),
        )
    }

    /// Takes the `granule`-aligned part out of every free block, for unmapping: `(start, size,
    /// the stream whose work must finish first)`, `None` for memory that needs no ordering. The
    /// unaligned ends stay free. Give a range back with
    /// [`give_blocks_to`](Self::give_blocks_to) or [`give_fresh_blocks`](Self::give_fresh_blocks)
    /// if it cannot be unmapped.
    pub(crate) fn take_aligned(&self, granule: u64) -> Vec<(u64, u64, Option<S>)> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            let taken = shard.lock().free.take_aligned(granule);
            for (addr, size, tag) in taken {
                match self.onto_one(shard, &tag) {
                    Ok(stream) => out.push((addr, size, stream)),
                    Err(e) => {
                        tracing::warn!(error = %e, addr, "a free range stays mapped: ordering failed");
                        let given = shard.lock().free.give_range(addr, size, tag);
                        debug_assert!(given, "a range taken out could not go back");
                    }
                }
            }
        }
        out
    }
}
