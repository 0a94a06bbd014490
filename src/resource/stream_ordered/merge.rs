//! Steps 3 and 5 of the order of resort: *merges*, other streams' lists (dropped streams' first)
//! moved wholesale into the requester's after it waits on each.

use super::*;

impl<S: EngineStream> StreamLists<S> {
    /// Moves other streams' lists into `stream`'s, after `stream` waits on each: every list
    /// whose stream the user dropped (it is then retired, and its stream handle released), and
    /// up to `limit` others that hold memory, fullest first. Fresh memory joins too. Returns
    /// how many blocks moved.
    pub(super) fn merge_into(&self, stream: &S, limit: usize) -> Result<usize> {
        // Fresh memory joins too: it needs no ordering, and left apart it could never coalesce
        // with memory that came back to this list (a request for the whole pool, say).
        let fresh = self.fresh.lock().drain();
        self.give_blocks(&fresh, stream);
        let mut moved = fresh.len();
        let me = stream.uid();
        let donors: Vec<(Arc<StreamList<S>>, bool)> = {
            let mut registry = self.registry.lock();
            let mut busy: Vec<(u64, u64)> = Vec::new();
            let mut idle: Vec<u64> = Vec::new();
            for (&id, list) in registry.lists.iter().filter(|(&id, _)| id != me) {
                // The list holds one handle; if that is the only one, the stream is idle.
                if list.idle() {
                    idle.push(id);
                } else if limit > 0 {
                    let bytes = list.state.lock().free.free_bytes();
                    if bytes > 0 {
                        busy.push((id, bytes));
                    }
                }
            }
            busy.sort_unstable_by_key(|&(_, bytes)| std::cmp::Reverse(bytes));
            busy.truncate(limit);
            let mut donors: Vec<(Arc<StreamList<S>>, bool)> = Vec::new();
            for id in idle {
                if let Some(list) = registry.lists.remove(&id) {
                    // Its blocks in use come back on other streams now.
                    self.orphan_live(&list);
                    donors.push((list, true));
                }
            }
            for (id, _) in busy {
                if let Some(list) = registry.lists.get(&id) {
                    donors.push((list.clone(), false));
                }
            }
            donors
        };
        if donors.is_empty() {
            return Ok(moved);
        }
        let _span =
            tracing::debug_span!("merge", into = %stream.name(), lists = donors.len(), limit)
                .entered();
        let result = self.merge_lists(stream, donors, &mut moved);
        self.merges.fetch_add(1, Ordering::Relaxed);
        result.map(|()| moved)
    }

    /// The second half of [`merge_into`](Self::merge_into): moves each donor's blocks (and a
    /// dropped stream's live entries) into `stream`'s list, after `stream` waits on the donor.
    fn merge_lists(
        &self,
        stream: &S,
        donors: Vec<(Arc<StreamList<S>>, bool)>,
        moved: &mut usize,
    ) -> Result<()> {
        let mut result = Ok(());
        for (donor, idle) in donors {
            let (blocks, donor_stream) = {
                let mut state = donor.state.lock();
                let Some(donor_stream) = state.stream.clone().filter(|_| !state.retired) else {
                    continue;
                };
                if idle {
                    // Its count moves to the shared one: the list is going away (its stream
                    // handle too, below, once the blocks are safely elsewhere).
                    state.retired = true;
                    self.flush(&mut state);
                }
                (state.free.drain(), donor_stream)
            };
            // After a failure, lists are put back as they were (retired ones into the
            // registry again), so nothing is lost.
            let ordered = if result.is_ok() && !blocks.is_empty() {
                donor_stream.order_before(stream)
            } else {
                result.clone()
            };
            match ordered {
                Ok(()) => {
                    self.give_blocks(&blocks, stream);
                    *moved += blocks.len();
                    if idle {
                        // The stream's last handle goes after the list's lock.
                        let stream = donor.state.lock().retire();
                        drop(stream);
                    }
                }
                Err(e) => {
                    let mut state = donor.state.lock();
                    if state.retired && !idle {
                        // Retired meanwhile (it cannot be while we hold `slow`, but a list
                        // that no registry holds must never receive memory): a live list of
                        // the donor's stream takes the blocks.
                        drop(state);
                        self.give_blocks(&blocks, &donor_stream);
                        result = Err(e);
                        continue;
                    }
                    for &(addr, size) in &blocks {
                        state.free.give(addr, size);
                    }
                    if idle {
                        state.retired = false;
                        drop(state);
                        self.registry.lock().lists.insert(donor.uid, donor.clone());
                    }
                    result = Err(e);
                }
            }
        }
        result
    }
}
