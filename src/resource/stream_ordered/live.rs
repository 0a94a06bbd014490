//! The blocks in use: a free on one stream of a block handed out through another list finds
//! its live entry there (or among the orphans of dropped streams), so that every free is checked
//! against what the engine handed out (issue 16).

use super::*;

impl<S: EngineStream> StreamLists<S> {
    /// A free of a block handed out through another list (another stream's, or one that a
    /// merge moved): its live entry is found there and removed, and the memory goes to
    /// `stream`'s list.
    #[cold]
    pub(super) fn give_from_elsewhere(&self, addr: u64, size: u64, stream: &S) -> bool {
        let me = stream.uid();
        let mut found = S::find_cached(self.uid, me, |list| {
            unlive(&mut list.state.lock().live, addr, size)
        });
        if found.is_none() {
            // Every list, then the orphans, all under the registry's lock (registry, then a
            // list or the orphans: the lock order of `add_chunk` and `orphan_live`). An entry
            // moves to the orphans under that lock too, so this finds it in one or the other.
            found = self
                .registry
                .lock()
                .lists
                .values()
                .find_map(|list| unlive(&mut list.state.lock().live, addr, size))
                .or_else(|| unlive(&mut self.orphans.lock(), addr, size));
        }
        if found != Some(true) {
            return false;
        }
        self.with_own_state(stream, |state| {
            let given = self.given_back(state, addr, size);
            debug_assert!(given, "a live block overlapped free memory");
            given
        })
    }

    /// Moves the live entries of `list` (of a stream the user dropped) to the orphans. The
    /// caller holds the registry's lock and takes `list` out of the registry under it; a free
    /// that searches (`give_from_elsewhere`) holds that lock across every list and the orphans,
    /// so it finds each entry in one place or the other. (Lock order: registry, then a list or
    /// the orphans.)
    pub(super) fn orphan_live(&self, list: &StreamList<S>) {
        let live = std::mem::take(&mut list.state.lock().live);
        if !live.is_empty() {
            self.orphans.lock().extend(live);
        }
    }
}

/// Removes the live entry of the block at `addr`: `Some(true)` if it was there with `size`,
/// `Some(false)` (and it stays) if it was there with another size, `None` if it was not there.
/// (The arena's live tables use it too.)
pub(crate) fn unlive(live: &mut FxHashMap<u64, u64>, addr: u64, size: u64) -> Option<bool> {
    match live.get(&addr) {
        Some(&held) if held == size => {
            live.remove(&addr);
            Some(true)
        }
        Some(_) => Some(false),
        None => None,
    }
}
