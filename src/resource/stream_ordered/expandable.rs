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
        let mut heap = self.shards[shard & (self.shards.len() - 1)].lock();
        // Cached blocks are free memory that a mapping next to them should coalesce with.
        heap.free.uncache_all();
        (
            heap.free.free_ending_at(start),
            heap.free.free_starting_at(end),
        )
    }

    /// The growth lock (`slow`), which every request holds through its last look at the
    /// lists and its growth: the expandable pool's trim holds it while it takes ranges out
    /// of the lists (see `Expander::hold_free`).
    pub(crate) fn growth_lock(&self) -> MutexGuard<'_, ()> {
        self.slow.lock()
    }

    /// Takes up to `want` bytes (rounded up to granules) of `granule`-aligned free memory out
    /// of the lists, for unmapping: the highest addresses first, from the last shard down (the
    /// expandable pool's ranges lie in its shards in address order). Returns `(start, size,
    /// the tag it had)`. The unaligned ends stay free, and so does what it does not take: it
    /// goes back under the shard's lock that took it out, so no request finds it missing.
    ///
    /// No driver call: the caller orders each range onto one stream of its tag
    /// ([`order_taken`](Self::order_taken)) once it has let go of its own locks, and puts
    /// back with [`give_back_tagged`](Self::give_back_tagged) what it cannot unmap (as it
    /// was), or with [`give_blocks_to`](Self::give_blocks_to) /
    /// [`give_fresh_blocks`](Self::give_fresh_blocks) once ordered.
    pub(crate) fn take_aligned_tagged(&self, granule: u64, want: u64) -> Vec<(u64, u64, Waits)> {
        let mut out = Vec::new();
        let mut left = want.div_ceil(granule) * granule;
        for shard in self.shards.iter().rev() {
            if left == 0 {
                break;
            }
            let mut heap = shard.lock();
            let mut ranges = heap.free.take_aligned(granule);
            ranges.sort_unstable_by_key(|r| std::cmp::Reverse(r.0));
            for (addr, size, tag) in ranges {
                // The top of the range, the bottom back with its tag.
                let part = size.min(left);
                left -= part;
                if part < size {
                    let given = heap.free.give_range(addr, size - part, tag);
                    debug_assert!(given, "a range taken out could not go back");
                }
                if part > 0 {
                    out.push((addr + size - part, part, tag));
                }
            }
        }
        out
    }
}

impl<S: EngineStream> StreamHeap<S> {
    /// Takes up to `want` bytes (rounded up to granules, the highest addresses first) of
    /// `granule`-aligned free memory out of the shards (in `keep_shard`, only ranges that
    /// `keep` does not overlap: the room being made for, and the free blocks it extends),
    /// where the work of every stream that freed it has finished: fresh memory, memory whose
    /// streams are noted done past its frees, or whose streams say they are idle (asked
    /// outside the lock). The expandable pool unmaps it at once and maps its room where a
    /// refused request can use it. The rest goes back as it was; a range the caller cannot
    /// unmap goes back with [`give_fresh_blocks`](Self::give_fresh_blocks) (its work has
    /// finished). Also returns the streams that said they were busy (once each), whose memory
    /// was left.
    pub(crate) fn take_idle_aligned(
        &self,
        granule: u64,
        keep_shard: usize,
        keep: std::ops::Range<u64>,
        want: u64,
    ) -> (Vec<(u64, u64)>, Vec<S>) {
        let mut out = Vec::new();
        let mut busy: Vec<S> = Vec::new();
        let mut left = want.div_ceil(granule) * granule;
        let keep_shard = keep_shard & (self.shards.len() - 1);
        for (k, shard) in self.shards.iter().enumerate() {
            if left == 0 {
                break;
            }
            // Under the lock: the aligned free ranges, and the handles of the streams whose
            // work each one waits for (none where every stream is noted done past its free).
            // What `keep` overlaps goes back at once: it never leaves the list.
            let mut taken: Vec<(u64, u64, Waits, Vec<S>)> = {
                let mut heap = shard.lock();
                let ranges = heap.free.take_aligned(granule);
                let mut taken = Vec::with_capacity(ranges.len());
                for (addr, size, tag) in ranges {
                    if k == keep_shard && addr < keep.end && keep.start < addr + size {
                        let given = heap.free.give_range(addr, size, tag);
                        debug_assert!(given, "a range taken out could not go back");
                        continue;
                    }
                    let streams = heap.unfinished(&tag);
                    taken.push((addr, size, tag, streams));
                }
                taken
            };
            taken.sort_unstable_by_key(|t| std::cmp::Reverse(t.0));
            let mut back = Vec::new();
            for (addr, size, tag, streams) in taken {
                if left == 0 {
                    back.push((addr, size, tag));
                    continue;
                }
                let mut finished = true;
                for stream in streams {
                    if busy.iter().any(|b| b.uid() == stream.uid())
                        || !(stream.is_idle() || planted!(RELOCATED_BUSY))
                    {
                        finished = false;
                        if !busy.iter().any(|b| b.uid() == stream.uid()) {
                            busy.push(stream);
                        }
                    }
                }
                if !finished {
                    back.push((addr, size, tag));
                    continue;
                }
                // The top of the range, the bottom back (it stays free with its tag).
                let part = size.min(left);
                left -= part;
                if part < size {
                    back.push((addr, size - part, tag));
                }
                out.push((addr + size - part, part));
            }
            let mut heap = shard.lock();
            for (addr, size, tag) in back {
                let given = heap.free.give_range(addr, size, tag);
                debug_assert!(given, "a range taken out could not go back");
            }
        }
        (out, busy)
    }
}

/// A stream's epochs, bumped in every shard that knows it before the host waits for the
/// stream ([`bump_for_host_wait`](StreamHeap::bump_for_host_wait)): what
/// [`note_host_waited`](StreamHeap::note_host_waited) notes done once the wait succeeded.
#[derive(Debug)]
pub(crate) struct HostWait {
    /// `(shard, slot, registration, epoch bumped to)`, for each shard that knew the stream.
    /// The registration ([`Entry::reg`]), not the stream's uid: a trim may forget the stream
    /// while the host waits, and another stream take its slot, or the same stream be
    /// registered there again with its epochs counted from 0, and neither must be noted done.
    bumped: Vec<(usize, u32, u64, u64)>,
}

impl<S: EngineStream> StreamHeap<S> {
    /// Bumps `stream`'s epoch in each shard that knows it, under that shard's lock, before the
    /// caller waits on the host for all work queued on the stream so far (the expandable
    /// pool's job for the streams a move found busy). Every free on the stream tagged below
    /// the bumped epoch came before the bump, so its last use was queued before the wait
    /// began: once the wait succeeds, [`note_host_waited`](Self::note_host_waited) notes
    /// those frees finished, as an idle answer does in [`order`](Self::order). Without it, a
    /// stream that always has work queued (a pipeline's compute stream) never answers idle,
    /// and a move at the maximum ([`take_idle_aligned`](Self::take_idle_aligned)) never takes
    /// what it freed, however long ago: the host's wait woke the waiters, and their retry
    /// asked the stream again and found new work (a review's finding;
    /// `tests/expandable_review3.rs`). Frees tagged since are not covered.
    pub(crate) fn bump_for_host_wait(&self, stream: &S) -> HostWait {
        let uid = stream.uid();
        let mut bumped = Vec::new();
        for (k, shard) in self.shards.iter().enumerate() {
            let mut heap = shard.lock();
            let Some(&slot) = heap.slots.get(&uid) else {
                continue;
            };
            if let Some(entry) = heap.entry_mut(slot) {
                entry.epoch += 1;
                bumped.push((k, slot, entry.reg, entry.epoch));
            }
        }
        HostWait { bumped }
    }

    /// After the host's wait for a stream succeeded (begun after
    /// [`bump_for_host_wait`](Self::bump_for_host_wait) returned `wait`): notes the stream done
    /// up to the epochs bumped, in each shard that still holds the registration bumped.
    pub(crate) fn note_host_waited(&self, wait: HostWait) {
        for (k, slot, reg, epoch) in wait.bumped {
            let Some(shard) = self.shards.get(k) else {
                continue;
            };
            let mut heap = shard.lock();
            if let Some(entry) = heap.entry_mut(slot).filter(|e| e.reg == reg) {
                let epoch = if planted!(HOST_WAIT_BUMPED_AFTER) {
                    entry.epoch += 1;
                    entry.epoch
                } else {
                    epoch
                };
                entry.done = entry.done.max(epoch);
            }
        }
    }
}

impl<S: EngineStream> Heap<S> {
    /// Handles of the streams whose work a block tagged `tag` still waits for: those it
    /// names that are not noted done past its free (every stream, for a tag that names more
    /// than it holds).
    fn unfinished(&self, tag: &Waits) -> Vec<S> {
        let live = |slot: u32| self.entry(slot).map(|e| e.stream.clone());
        if tag.every() {
            return (0..self.entries.len() as u32).filter_map(live).collect();
        }
        tag.pairs()
            .iter()
            .filter(|&&(d, at)| self.entry(d).is_some_and(|e| e.done <= at))
            .filter_map(|&(d, _)| live(d))
            .collect()
    }
}
