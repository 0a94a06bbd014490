//! Orderings: a stream made to wait, on the GPU, for the streams that freed the memory it is
//! about to use (the protocol is in `waits.rs`).

use super::*;

/// One ordering to make: after the stream in `slot` (`stream`), up to its epoch `epoch`.
pub(super) struct Order<S> {
    slot: u32,
    epoch: u64,
    stream: S,
}

impl<S: EngineStream> StreamHeap<S> {
    /// The orderings the stream in `slot` needs before it may use a block tagged `tag`, each
    /// with the stream's epoch already bumped (under the lock the caller holds: a free tagged
    /// after this is not covered by the event the ordering records). Empty if it needs none.
    pub(super) fn orders_for(&self, heap: &mut Heap<S>, slot: u32, tag: &Waits) -> Vec<Order<S>> {
        let mut orders = Vec::new();
        let Some(me) = heap.entry(slot) else {
            return orders;
        };
        let needed: Vec<u32> = if tag.every() {
            // More streams than a tag holds: every stream, at its current epoch.
            (0..heap.entries.len() as u32)
                .filter(|&d| d != slot && heap.entry(d).is_some())
                .collect()
        } else {
            tag.pairs()
                .iter()
                .filter(|&&(d, at)| d != slot && me.waited(d) <= at)
                .map(|&(d, _)| d)
                .collect()
        };
        for d in needed {
            let Some(donor) = heap.entry_mut(d) else {
                continue;
            };
            let epoch = if planted::bump_after_order() {
                donor.epoch + 1
            } else {
                donor.epoch += 1;
                donor.epoch
            };
            orders.push(Order {
                slot: d,
                epoch,
                stream: donor.stream.clone(),
            });
        }
        orders
    }

    /// Makes `orders` for `stream` (in `slot` of `shard`), outside the shard's lock, then notes
    /// what the stream has waited on. On an error, the orderings made so far stand (harmless: a wait
    /// more), and the caller puts its block back.
    pub(super) fn order(
        &self,
        shard: &Shard<S>,
        stream: &S,
        slot: u32,
        orders: Vec<Order<S>>,
    ) -> Result<()> {
        let _span =
            tracing::debug_span!("stream_wait", to = %stream.name(), streams = orders.len())
                .entered();
        let mut made = Vec::with_capacity(orders.len());
        let mut result = Ok(());
        for order in orders {
            if !planted::unordered() {
                if let Err(e) = order.stream.order_before(stream) {
                    result = Err(e);
                    break;
                }
            }
            made.push((order.slot, order.epoch));
            // The streams' handles go outside the lock.
            drop(order.stream);
        }
        self.waits.fetch_add(made.len() as u64, Ordering::Relaxed);
        let mut heap = shard.lock();
        for (d, epoch) in made {
            if planted::bump_after_order() {
                if let Some(donor) = heap.entry_mut(d) {
                    donor.epoch = donor.epoch.max(epoch);
                }
            }
            if let Some(me) = heap.entry_mut(slot) {
                me.note_waited(d, epoch);
            }
        }
        result
    }
}
