//! Memory going back: lists of dropped streams retired (their streams released), blocks returned
//! as fresh or to a stream, whole chunks taken out for the upstream, and the engine's drop.

use super::*;

impl<S: EngineStream> StreamLists<S> {
    /// Takes the lists of streams the user has dropped out of the registry: `(stream, its
    /// blocks)`. The caller waits for each stream and then gives the blocks to
    /// [`give_fresh_blocks`](Self::give_fresh_blocks), or back with
    /// [`give_blocks_to`](Self::give_blocks_to) if it cannot.
    pub(crate) fn retire_idle(&self) -> Vec<(S, Vec<(u64, u64)>)> {
        S::forget_cached(self.uid);
        // Not while a request merges: a list it drained and must put back (its ordering
        // failed) would otherwise be retired under it.
        let _slow = self.slow.lock();
        let lists: Vec<Arc<StreamList<S>>> = {
            let mut registry = self.registry.lock();
            let idle: Vec<u64> = registry
                .lists
                .iter()
                .filter(|(_, list)| list.idle())
                .map(|(&id, _)| id)
                .collect();
            idle.into_iter()
                .filter_map(|id| registry.lists.remove(&id))
                .inspect(|list| {
                    if !planted::move_unlocked() {
                        self.orphan_live(list);
                    }
                })
                .collect()
        };
        if planted::move_unlocked() {
            for list in &lists {
                self.orphan_live(list);
            }
        }
        lists
            .into_iter()
            .filter_map(|list| {
                let mut state = list.state.lock();
                if state.retired {
                    return None;
                }
                // A list not retired has its stream; taken first, so that no block is drained
                // from a list that could not say which stream to wait for.
                let stream = state.retire()?;
                self.flush(&mut state);
                let blocks = state.free.drain();
                drop(state);
                Some((stream, blocks))
            })
            .collect()
    }

    /// Blocks whose last use the host knows to be finished: any stream may take them at once.
    pub(crate) fn give_fresh_blocks(&self, blocks: &[(u64, u64)]) {
        let mut fresh = self.fresh.lock();
        for &(addr, size) in blocks {
            let given = fresh.give(addr, size);
            debug_assert!(given, "a block overlapped fresh memory");
        }
    }

    /// Blocks (not handed out) back into `stream`'s list, as if freed there.
    pub(crate) fn give_blocks_to(&self, blocks: &[(u64, u64)], stream: &S) {
        self.give_blocks(blocks, stream);
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
            // A list without its stream (retired, or the engine going away) could not say
            // which stream its chunks must wait for: they stay where they are.
            let Some(stream) = state.stream.clone().filter(|_| !state.retired) else {
                continue;
            };
            left.retain(|&base, &mut size| {
                let whole = state.free.take_exact(base, size);
                if whole {
                    let freed_on = (!planted::chunks_as_fresh()).then(|| stream.clone());
                    out.push((base, size, freed_on));
                }
                !whole
            });
        }
        out
    }
}

impl<S> Drop for StreamLists<S> {
    /// Lets go of every list's stream: threads' caches may hold the lists themselves for as
    /// long as the threads live, but not the streams (and through them the devices).
    fn drop(&mut self) {
        // The handles go after every lock is let go: a stream's drop takes locks of its own
        // (the simulated device's queue, the reactor's inbox).
        let mut streams = Vec::new();
        for list in self.registry.lock().lists.values() {
            let mut state = list.state.lock();
            streams.extend(state.retire());
            state.free = FreeList::new();
            state.live = FxHashMap::default();
        }
        drop(streams);
    }
}
