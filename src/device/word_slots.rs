//! Which completion words may go to a new stream (`cuda_words.rs`): the bookkeeping, apart from
//! the pinned pages, so that its loom model (`loom-tests/words.rs`) drives this very code with
//! the GPU's late write as a thread of its own.
//!
//! A word is handed out, then *retired* when its stream and every event of it are gone, with
//! the last value queued to it. The GPU may still write that value later: a stream dropped with
//! work queued. So a retired word becomes free only once it holds that value ([`settle`]), and
//! only a free word goes to a new stream: the new stream's first event would otherwise read
//! complete when the old stream's last write lands (their sequence numbers both start at 0).
//!
//! [`settle`]: WordSlots::settle

/// The slots of a device's words: free, or retired with the last value queued to each.
#[derive(Default)]
pub(crate) struct WordSlots {
    /// Slots no stream holds, settled: free to hand out.
    free: Vec<u32>,
    /// Slots of streams gone, with the last value queued to each.
    retired: Vec<(u32, u32)>,
    /// Slots made so far (the next one made is this).
    made: u32,
}

impl WordSlots {
    /// A slot for a new stream: a free one, after the retired slots that hold their last value
    /// (`value` reads a slot's word) have become free; `None` if there is none (the caller
    /// makes more: [`add`](Self::add)).
    pub(crate) fn take(&mut self, value: impl Fn(u32) -> u32) -> Option<u32> {
        self.settle(value);
        self.free.pop()
    }

    /// Makes `n` new slots, hands out the first and keeps the rest free.
    pub(crate) fn add(&mut self, n: u32) -> u32 {
        let first = self.made;
        self.made += n;
        self.free.extend((first + 1..first + n).rev());
        first
    }

    /// `slot`'s stream is gone; `last` is the last value queued to its word.
    pub(crate) fn retire(&mut self, slot: u32, last: u32) {
        if planted!(REUSED_AT_ONCE) {
            self.free.push(slot);
            return;
        }
        self.retired.push((slot, last));
    }

    /// Moves the retired slots whose word holds its last value to the free list.
    pub(crate) fn settle(&mut self, value: impl Fn(u32) -> u32) {
        let mut i = 0;
        while i < self.retired.len() {
            let (slot, last) = self.retired[i];
            if value(slot) == last {
                self.retired.swap_remove(i);
                self.free.push(slot);
            } else {
                i += 1;
            }
        }
    }

    /// The retired slots still waiting for their last write (after a [`settle`](Self::settle)).
    pub(crate) fn unsettled(&self) -> impl Iterator<Item = u32> + '_ {
        self.retired.iter().map(|&(slot, _)| slot)
    }
}

/// A bug the loom model plants (`loom-tests/words.rs`), constant off otherwise; read through
/// `planted!`.
#[cfg(streamalloc_loom)]
pub(crate) mod planted {
    /// A retired slot is free at once, its last write pending or not.
    pub(crate) static REUSED_AT_ONCE: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);
}
