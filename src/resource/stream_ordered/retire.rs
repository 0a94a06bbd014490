//! Memory and streams going back: dropped streams let go of, blocks returned as fresh or as
//! freed on a stream, whole chunks taken out for the upstream, and the engine's drop.

use super::*;

impl<S: EngineStream> StreamHeap<S> {
    /// The streams the user has dropped: no handle of them is left but those that resources
    /// keep ([`Kept`]). The caller waits on the host for each one's work, and then calls
    /// [`forget`](Self::forget) with it.
    pub(crate) fn idle_streams(&self) -> Vec<S> {
        // Once 0, it stays 0: only a handle that exists can make another, and the engine makes
        // none for a user (its own clones, like the one returned, only make the stream look
        // busier than it is).
        self.streams_where(|e| e.stream.users() == 0 || planted!(IDLE_IGNORES_HANDLES))
    }

    /// Lets go of `stream`, whose work the host has seen finish (after
    /// [`idle_streams`](Self::idle_streams)): no free block needs an ordering after it any
    /// more, and the engine's handles go. Nothing happens if any handle but the caller's and
    /// those resources keep is left (a free on it could still come, and its tag would name a
    /// forgotten stream).
    ///
    /// The stream is also asked whether it is still idle, in each shard under that shard's
    /// lock, and stays in a shard where it is not: the engine itself may have queued work on
    /// it after the caller's wait. Memory taken out for release is ordered onto one stream its
    /// tag names ([`onto_one`](Self::onto_one): that stream waits for the others' events), and
    /// goes back into the lists tagged with that stream if the release fails or the trim ends
    /// early; forgetting the stream then cleared the tag, and the memory went to any stream, or
    /// back upstream, while the other streams' work still ran (a review found the release at
    /// the maximum's failed free doing it; `tests/engine_review.rs`). Every tag in a shard that
    /// names the stream was made after the work it waits for was queued, so an idle answer
    /// under the shard's lock covers them all. A stream left is named again by the next
    /// [`idle_streams`](Self::idle_streams).
    pub(crate) fn forget(&self, stream: S) {
        if stream.users() != 1 && !planted!(IDLE_IGNORES_HANDLES) {
            return;
        }
        let mut gone = Vec::new();
        for shard in self.shards.iter() {
            let mut heap = shard.lock();
            if !heap.slots.contains_key(&stream.uid())
                || !(stream.is_idle() || planted!(FORGET_IGNORES_LATER_WORK))
            {
                continue;
            }
            let Some(slot) = heap.slots.remove(&stream.uid()) else {
                continue;
            };
            heap.free.for_each_tag(|tag| tag.forget(slot));
            gone.extend(heap.entries[slot as usize].take());
            for other in heap.entries.iter_mut().flatten() {
                if let Some(w) = other.waited.get_mut(slot as usize) {
                    *w = 0;
                }
            }
            heap.spare.push(slot);
            heap.last = (0, 0);
        }
        // The handles go after the locks: a stream's drop takes locks of its own.
        drop(gone);
        drop(stream);
    }

    /// Blocks whose last use the host knows to be finished: any stream may take them at once.
    pub(crate) fn give_fresh_blocks(&self, blocks: &[(u64, u64)]) {
        for &(addr, size) in blocks {
            let given = self
                .shard_of(addr, size)
                .is_some_and(|shard| shard.lock().free.give_range(addr, size, Waits::default()));
            debug_assert!(given, "a block overlapped another or no chunk");
        }
    }

    /// Blocks (not handed out) back into the free list, as if freed on `stream`.
    pub(crate) fn give_blocks_to(&self, blocks: &[(u64, u64)], stream: &S) {
        for &(addr, size) in blocks {
            let given = self.shard_of(addr, size).is_some_and(|shard| {
                let mut heap = shard.lock();
                let slot = heap.slot(stream);
                let tag = heap.freed_on(slot);
                heap.free.give_range(addr, size, tag)
            });
            debug_assert!(given, "a block overlapped another or no chunk");
        }
    }

    /// Takes out every free block that is exactly one of `chunks`, for returning upstream.
    /// Returns `(base, size, the stream whose work must finish first)`, `None` for memory
    /// that needs no ordering. A chunk freed on several streams is ordered onto one of them
    /// first (the others' events, waited on by it); one whose ordering fails stays free.
    pub(crate) fn take_whole_chunks(&self, chunks: &[(u64, u64)]) -> Vec<(u64, u64, Option<S>)> {
        chunks
            .iter()
            .filter_map(|&(base, size)| {
                let Some(tag) = self.take_whole_chunk(base, size)? else {
                    return Some((base, size, None));
                };
                match self.order_whole_chunk(base, size, &tag) {
                    Ok(stream) => Some((base, size, stream)),
                    Err(e) => {
                        Self::log_kept(&e, base, size);
                        self.give_back_tagged(base, size, tag);
                        None
                    }
                }
            })
            .collect()
    }

    /// [`take_whole_chunks`](Self::take_whole_chunks)' first half for one chunk, which makes
    /// no driver call: the chunk `[base, base + size)` out of the reserve or of its shard's
    /// list if it is there whole and free. `None` if it is not; `Some(None)` for memory that
    /// needs no ordering (the reserve's); else its tag, for
    /// [`order_whole_chunk`](Self::order_whole_chunk), or to go back as it was
    /// ([`give_back_tagged`](Self::give_back_tagged)).
    pub(crate) fn take_whole_chunk(&self, base: u64, size: u64) -> Option<Option<Waits>> {
        if self.take_reserved(base, size) {
            return Some(None);
        }
        let shard = self.shard_of(base, size)?;
        let tag = shard.lock().free.take_exact_tagged(base, size)?;
        Some(Some(tag))
    }

    /// [`take_whole_chunks`](Self::take_whole_chunks)' second half: the chunk taken out with
    /// `tag` ordered onto one stream it names ([`onto_one`](Self::onto_one): driver calls), the
    /// stream whose work must finish before it goes upstream (`None`: none needed). On an
    /// error (e.g. a stream of the tag under a user's graph capture) the chunk is the caller's
    /// to put back with its tag.
    pub(crate) fn order_whole_chunk(&self, base: u64, size: u64, tag: &Waits) -> Result<Option<S>> {
        let stream = self.order_taken(base, size, tag)?;
        Ok(stream.filter(|_| !planted!(CHUNKS_AS_FRESH)))
    }

    /// Memory `[base, base + size)` of a chunk, taken out of its shard's list with `tag` (a
    /// whole chunk, or the expandable pool's granules: `take_aligned_tagged`), ordered onto one
    /// stream the tag names ([`onto_one`](Self::onto_one): driver calls, so with no lock of
    /// the caller's held): the stream whose work must finish before it is given back (`None`:
    /// none needed). On an error (e.g. a stream of the tag under a user's graph capture) the
    /// memory is the caller's to put back with its tag.
    pub(crate) fn order_taken(&self, base: u64, size: u64, tag: &Waits) -> Result<Option<S>> {
        let shard = self.shard_of(base, size).ok_or(Error::InvalidArgument {
            what: "memory taken out for release is in no shard",
        })?;
        self.onto_one(shard, tag)
    }

    /// Memory taken out by [`take_whole_chunk`](Self::take_whole_chunk) (or the expandable
    /// pool's `take_aligned_tagged`) back in its shard's list with the tag it had: as if it
    /// had never been taken out.
    pub(crate) fn give_back_tagged(&self, base: u64, size: u64, tag: Waits) {
        let given = self
            .shard_of(base, size)
            .is_some_and(|shard| shard.lock().free.give_range(base, size, tag));
        debug_assert!(given, "a chunk taken out could not go back");
    }

    /// Logs why memory taken out for release (a pool's whole chunk, an expandable pool's
    /// granules) stays: its ordering failed with `e`.
    pub(crate) fn log_kept(e: &Error, base: u64, size: u64) {
        match e {
            // A stream of the tag under a user's graph capture: no ordering through it
            // until the capture ends. Kept, as a trim keeps such memory.
            Error::StreamCapturing { .. } => {
                tracing::debug!(error = %e, base, size, "free memory kept for a capture");
            }
            e => tracing::warn!(error = %e, base, size, "free memory stays: ordering failed"),
        }
    }

    /// One stream after which the memory of `shard` tagged `tag` may be reused by anyone (or
    /// released): the first stream it names that the engine still knows, after every other it
    /// names has been ordered before it. `None` if it names none the engine still knows: a
    /// stream is forgotten only after the host saw its work finish.
    ///
    /// Not simply the tag's first stream: `tag` was taken out of the shard (a chunk going
    /// back, granules being unmapped) before this call, so a trim on another thread may have
    /// forgotten that stream meanwhile, and [`forget`](Self::forget) clears only the tags
    /// still in the shards. Giving up on the first would release memory that the tag's other
    /// streams may still be using (a review's finding; `order_tests.rs`).
    pub(super) fn onto_one(&self, shard: &Shard<S>, tag: &Waits) -> Result<Option<S>> {
        let mut heap = shard.lock();
        let first = if tag.every() {
            // More streams than the tag holds: every stream.
            heap.slots.values().copied().min()
        } else if planted!(ONTO_FIRST_ONLY) {
            tag.first().filter(|&slot| heap.entry(slot).is_some())
        } else {
            (tag.pairs().iter())
                .map(|&(slot, _)| slot)
                .find(|&slot| heap.entry(slot).is_some())
        };
        let Some(slot) = first else {
            return Ok(None);
        };
        let Some(stream) = heap.entry(slot).map(|e| e.stream.clone()) else {
            return Ok(None);
        };
        let mut orders = Orders::new();
        self.orders_for(&mut heap, slot, tag, &mut orders);
        drop(heap);
        self.order(shard, &stream, slot, &mut orders)?;
        Ok(Some(stream))
    }
}

impl<S: EngineStream> Drop for StreamHeap<S> {
    /// Lets go of every stream's handle, after the locks.
    fn drop(&mut self) {
        let entries: Vec<_> = self
            .shards
            .iter()
            .map(|shard| std::mem::take(&mut shard.lock().entries))
            .collect();
        drop(entries);
    }
}
