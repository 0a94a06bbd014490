//! Step 2 of the order of resort: a *steal*, one block of another stream's list, after an
//! event recorded on that stream now.

use super::*;

impl<S: EngineStream> StreamLists<S> {
    /// Takes a block from another stream's list, ordering `stream` after that stream. The
    /// donor is the list with the closest fit (as one list holding every block would choose):
    /// taking the first fit found would split large blocks that a later request needs whole,
    /// while smaller fits sat in other lists.
    pub(super) fn steal(&self, size: u64, stream: &S) -> Result<Option<u64>> {
        let me = stream.uid();
        let donors: Vec<Arc<StreamList<S>>> = self
            .registry
            .lock()
            .lists
            .iter()
            .filter(|(&id, _)| id != me)
            .map(|(_, list)| list.clone())
            .collect();
        let mut best: Option<(u64, &Arc<StreamList<S>>)> = None;
        for donor in &donors {
            let state = donor.state.lock();
            if state.retired {
                continue;
            }
            if let Some(fit) = state.free.fit(size) {
                if best.is_none_or(|(b, _)| fit < b) {
                    best = Some((fit, donor));
                    if fit == size {
                        break;
                    }
                }
            }
        }
        let Some((_, donor)) = best else {
            return Ok(None);
        };

        // The donor's lock stays held through the ordering: if it fails, the block goes back
        // into a list that no merge can have retired meanwhile. Recording an event and
        // queueing a wait are quick enqueues that never wait for the GPU.
        let mut state = donor.state.lock();
        let Some(donor_stream) = state.stream.clone().filter(|_| !state.retired) else {
            return Ok(None);
        };
        // The whole block: once `stream` waits on the donor, all of it is ours to use, and its
        // remainder serves this stream's next requests without another steal (after a growth,
        // the other streams would otherwise take the new chunk from its grower piece by piece).
        // Another request may have taken the fit since we looked: then there is none.
        let Some((addr, whole)) = state.free.take_whole(size) else {
            return Ok(None);
        };
        let _span = tracing::debug_span!("steal", bytes = size, block = whole, from = %donor_stream.name(), to = %stream.name()).entered();
        // The block's free was enqueued on the donor before we found it in its list, so an
        // event recorded on the donor now comes after it.
        if let Err(e) = donor_stream.order_before(stream) {
            let given = state.free.give(addr, whole);
            debug_assert!(given, "a stolen block could not go back");
            return Err(e);
        }
        // The donor's lock goes before ours is taken: two streams stealing from each other
        // must not hold one list's lock while waiting for the other's.
        drop(state);
        if whole > size {
            self.give_blocks(&[(addr + size, whole - size)], stream);
        }
        self.steals.fetch_add(1, Ordering::Relaxed);
        Ok(Some(addr))
    }
}
