//! Memory and streams going back: dropped streams let go of, blocks returned as fresh or as
//! freed on a stream, whole chunks taken out for the upstream, and the engine's drop.

use super::*;

impl<S: EngineStream> StreamHeap<S> {
    /// The streams the user has dropped (the engine holds their only handle). The caller waits
    /// on the host for each one's work, and then calls [`forget`](Self::forget) with it.
    pub(crate) fn idle_streams(&self) -> Vec<S> {
        let heap = self.state.lock();
        heap.entries
            .iter()
            .flatten()
            .filter(|e| e.stream.handle_count() == 1 || planted::idle_ignores_handles())
            .map(|e| e.stream.clone())
            .collect()
    }

    /// Lets go of `stream`, whose work the host has seen finish (after
    /// [`idle_streams`](Self::idle_streams)): no free block needs an ordering after it any
    /// more, and the engine's handle goes. Nothing happens if anyone but the engine and the
    /// caller still holds the stream (a free on it could still come, and its tag would name a
    /// forgotten stream).
    pub(crate) fn forget(&self, stream: S) {
        let entry = {
            let mut heap = self.state.lock();
            if stream.handle_count() > 2 && !planted::idle_ignores_handles() {
                return;
            }
            let Some(slot) = heap.slots.remove(&stream.uid()) else {
                return;
            };
            heap.free.for_each_tag(|tag| tag.forget(slot));
            let entry = heap.entries[slot as usize].take();
            for other in heap.entries.iter_mut().flatten() {
                if let Some(w) = other.waited.get_mut(slot as usize) {
                    *w = 0;
                }
            }
            heap.spare.push(slot);
            heap.last = (0, 0);
            entry
        };
        // The handles go after the lock: a stream's drop takes locks of its own.
        drop(entry);
        drop(stream);
    }

    /// Blocks whose last use the host knows to be finished: any stream may take them at once.
    pub(crate) fn give_fresh_blocks(&self, blocks: &[(u64, u64)]) {
        let mut heap = self.state.lock();
        for &(addr, size) in blocks {
            let given = heap.free.give(addr, size);
            debug_assert!(given, "a block overlapped free memory");
        }
    }

    /// Blocks (not handed out) back into the free list, as if freed on `stream`.
    pub(crate) fn give_blocks_to(&self, blocks: &[(u64, u64)], stream: &S) {
        let mut heap = self.state.lock();
        let slot = heap.slot(stream);
        let tag = heap.freed_on(slot);
        for &(addr, size) in blocks {
            let given = heap.free.give_tagged(addr, size, tag);
            debug_assert!(given, "a block overlapped free memory");
        }
    }

    /// Takes out every free block that is exactly one of `chunks`, for returning upstream.
    /// Returns `(base, size, the stream whose work must finish first)`, `None` for memory
    /// that needs no ordering. A chunk freed on several streams is ordered onto one of them
    /// first (the others' events, waited on by it); one whose ordering fails stays free.
    pub(crate) fn take_whole_chunks(&self, chunks: &[(u64, u64)]) -> Vec<(u64, u64, Option<S>)> {
        let taken: Vec<(u64, u64, Waits)> = {
            let mut heap = self.state.lock();
            chunks
                .iter()
                .filter_map(|&(base, size)| {
                    heap.free
                        .take_exact_tagged(base, size)
                        .map(|tag| (base, size, tag))
                })
                .collect()
        };
        taken
            .into_iter()
            .filter_map(|(base, size, tag)| match self.onto_one(&tag) {
                Ok(stream) => {
                    let stream = stream.filter(|_| !planted::chunks_as_fresh());
                    Some((base, size, stream))
                }
                Err(e) => {
                    tracing::warn!(error = %e, base, "a free chunk stays: ordering failed");
                    let given = self.state.lock().free.give_tagged(base, size, tag);
                    debug_assert!(given, "a chunk taken out could not go back");
                    None
                }
            })
            .collect()
    }

    /// One stream after which the memory tagged `tag` may be reused by anyone (or released):
    /// the first stream it names, after every other it names has been ordered before it.
    /// `None` if the tag names none.
    pub(super) fn onto_one(&self, tag: &Waits) -> Result<Option<S>> {
        let mut heap = self.state.lock();
        let first = match tag.first() {
            Some(slot) => Some(slot),
            // More streams than the tag holds: every stream.
            None if tag.every() => heap.slots.values().copied().min(),
            None => None,
        };
        let Some(slot) = first else {
            return Ok(None);
        };
        let Some(stream) = heap.entry(slot).map(|e| e.stream.clone()) else {
            return Ok(None);
        };
        let orders = self.orders_for(&mut heap, slot, tag);
        drop(heap);
        self.order(&stream, slot, orders)?;
        Ok(Some(stream))
    }
}

impl<S> Drop for StreamHeap<S> {
    /// Lets go of every stream's handle, after the lock.
    fn drop(&mut self) {
        let entries = std::mem::take(&mut self.state.lock().entries);
        drop(entries);
    }
}
