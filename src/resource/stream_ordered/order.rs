//! Orderings: a stream made to wait, on the GPU, for the streams that freed the memory it is
//! about to use (the protocol is in `waits.rs`).

use smallvec::SmallVec;

use super::*;

/// The orderings one request needs: one per stream its block's tag names (at most four but
/// for the rare tag that stands for every stream), so kept inline.
pub(super) type Orders<S> = SmallVec<[Order<S>; 4]>;

/// An ordering made (or found needless: the stream was idle), to note under the lock again.
struct Made {
    slot: u32,
    /// The stream's registration ([`Entry::reg`]): the slot may hold another stream by then,
    /// or the same stream registered again, whose epochs start again at 0.
    reg: u64,
    epoch: u64,
    /// The stream answered idle: no ordering was made.
    idle: bool,
    /// The stream's activity, read before the question.
    activity: Option<u64>,
}

/// One ordering to make: after the stream in `slot` (`stream`, registered as `reg`), up to
/// its epoch `epoch`.
pub(super) struct Order<S> {
    slot: u32,
    reg: u64,
    epoch: u64,
    stream: S,
}

impl<S: EngineStream> StreamHeap<S> {
    /// The orderings the stream in `slot` needs before it may use a block tagged `tag`, each
    /// with the stream's epoch already bumped (under the lock the caller holds: a free tagged
    /// after this is not covered by the event the ordering records), pushed onto `orders`
    /// (none if it needs none). Into the caller's list, not returned: the list is about 130
    /// to 200 bytes inline, and a return moved it with a `memcpy` on every request that
    /// reused another stream's memory (3% of `churn-xs-1t`'s instructions with the pass into
    /// [`order`](Self::order)).
    pub(super) fn orders_for(
        &self,
        heap: &mut Heap<S>,
        slot: u32,
        tag: &Waits,
        orders: &mut Orders<S>,
    ) {
        let Some(me) = heap.entry(slot) else {
            return;
        };
        let mut needed: SmallVec<[u32; 4]> = SmallVec::new();
        if tag.every() {
            // More streams than a tag holds: every stream, at its current epoch.
            needed.extend(
                (0..heap.entries.len() as u32).filter(|&d| d != slot && heap.entry(d).is_some()),
            );
        } else {
            for &(d, at) in tag.pairs() {
                let finished = heap.entry(d).is_some_and(|e| e.done > at);
                if d != slot && me.waited(d) <= at && !finished {
                    needed.push(d);
                }
            }
        }
        let mut quiet = 0;
        for d in needed {
            let Some(donor) = heap.entry_mut(d) else {
                continue;
            };
            let epoch = if planted!(BUMP_AFTER_ORDER) {
                donor.epoch + 1
            } else {
                donor.epoch += 1;
                donor.epoch
            };
            if self.opportunistic && is_quiet(donor) {
                // Seen idle before, and nothing queued on it since: every free tagged below
                // the epoch just bumped came before now, after its last use, and that use has
                // finished. As an idle answer would, with no driver call.
                donor.done = donor.done.max(epoch);
                quiet += 1;
                continue;
            }
            orders.push(Order {
                slot: d,
                reg: donor.reg,
                epoch,
                stream: donor.stream.clone(),
            });
        }
        if quiet > 0 {
            self.idle_skips.fetch_add(quiet, Ordering::Relaxed);
        }
    }

    /// Makes `orders` for `stream` (in `slot` of `shard`), outside the shard's lock, then notes
    /// what the stream has waited on; `orders` is left empty. With opportunistic reuse, a
    /// freeing stream that is idle (all its work finished: `cuStreamQuery`, one driver call
    /// instead of a record and a wait) needs no ordering, and it is noted as finished up to the
    /// epoch bumped before the question, for every stream. On an error, the orderings made so
    /// far stand (harmless: a wait more), and the caller puts its block back.
    pub(super) fn order(
        &self,
        shard: &Shard<S>,
        stream: &S,
        slot: u32,
        orders: &mut Orders<S>,
    ) -> Result<()> {
        let _span =
            tracing::debug_span!("stream_wait", to = %stream.name(), streams = orders.len())
                .entered();
        // The registration is kept because the lock is let go: a trim may forget a dropped
        // stream meanwhile and a new stream take its slot, or the same stream be registered
        // again there (a trim's put-back on it, an outer pool's release to a pool on it) with
        // its epochs counted from 0 again, and what is noted below must land on neither.
        let mut made: SmallVec<[Made; 4]> = SmallVec::new();
        let mut result = Ok(());
        for order in orders.drain(..) {
            // Read before the question: work queued after it would not be covered by an idle
            // answer, so it must show as a change of the count.
            let activity = order.stream.activity();
            let idle =
                self.opportunistic && (order.stream.is_idle() || planted!(BUSY_TAKEN_AS_IDLE));
            if !idle && !planted!(UNORDERED) {
                if let Err(e) = order.stream.order_before(stream) {
                    result = Err(e);
                    break;
                }
            }
            made.push(Made {
                slot: order.slot,
                reg: order.reg,
                epoch: order.epoch,
                idle,
                activity,
            });
            // The streams' handles go outside the lock.
            drop(order.stream);
        }
        let skipped = made.iter().filter(|m| m.idle).count() as u64;
        self.waits
            .fetch_add(made.len() as u64 - skipped, Ordering::Relaxed);
        if skipped > 0 {
            self.idle_skips.fetch_add(skipped, Ordering::Relaxed);
        }
        let mut heap = shard.lock();
        let me = stream.uid();
        for Made {
            slot: d,
            reg,
            epoch,
            idle,
            activity,
        } in made
        {
            if heap.entry(d).is_none_or(|e| e.reg != reg) {
                // Forgotten while the lock was let go (its slot may hold another stream now,
                // or the same one registered again): `forget` cleared it from every tag, so
                // nothing is left to note.
                continue;
            }
            if planted!(BUMP_AFTER_ORDER) {
                if let Some(donor) = heap.entry_mut(d) {
                    donor.epoch = donor.epoch.max(epoch);
                }
            }
            if idle {
                if let Some(donor) = heap.entry_mut(d) {
                    // Every free tagged below `epoch` came before the bump, which came before
                    // the question: their last uses were queued before it and have finished.
                    // A free tagged since carries `epoch` or later and is not covered.
                    let done = if planted!(DONE_AT_THE_ANSWER) {
                        donor.epoch + 1
                    } else {
                        epoch
                    };
                    donor.done = donor.done.max(done);
                    donor.quiet_at = if planted!(ACTIVITY_AFTER_THE_ANSWER) {
                        donor.stream.activity()
                    } else {
                        activity
                    };
                }
            } else {
                if let Some(donor) = heap.entry_mut(d) {
                    donor.quiet_at = None;
                }
                if let Some(e) = heap.entry_mut(slot).filter(|e| e.uid == me) {
                    e.note_waited(d, epoch);
                }
            }
        }
        result
    }
}

/// Whether `donor` was seen idle and nothing was queued on it since (its activity count reads
/// what it read before that idle answer).
#[inline]
fn is_quiet<S: EngineStream>(donor: &Entry<S>) -> bool {
    if planted!(QUIET_IGNORES_ACTIVITY) {
        return donor.quiet_at.is_some();
    }
    donor
        .quiet_at
        .is_some_and(|at| donor.stream.activity() == Some(at))
        && donor.stream.confirm_quiet()
}
