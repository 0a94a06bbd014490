//! What a free block's reuse must wait for: the streams its memory was last freed on, each with
//! that stream's *epoch* at the free ([`Waits`], the free list's block tag), and the epochs.
//!
//! Every stream the engine knows has an epoch, a counter that an *ordering* bumps: to order a
//! stream S after everything stream D has queued so far, the engine bumps D's epoch to `n`,
//! records an event on D and has S wait for it, and then notes that S has seen D up to `n`
//! (`waited[S][D] = n`). A block freed on D is tagged with D's epoch at the free, `e`. Its use on
//! S is ordered after the free once S has seen D past `e` (`waited[S][D] > e`): the free was
//! tagged, under the engine's lock, before the bump to `n > e`, and the bump comes before the
//! event is recorded, so the event follows every use of the block that D had queued by then.
//! A free tagged after the bump carries `n` and is not covered by that event, rightly.

use crate::resource::free_list::BlockTag;

/// How many (stream, epoch) pairs a tag holds before it gives up counting and stands for every
/// stream. Coalescing across more than four streams is rare (a workload whose blocks four
/// streams free has tags of at most four), and the fallback is correct, only slower.
const CAP: usize = 4;

/// The streams (by slot) a free block's reuse must be ordered after, with their epochs at the
/// free; `every`: more streams than fit, so every stream's current epoch (conservative).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Waits {
    len: u8,
    every: bool,
    at: [(u32, u64); CAP],
}

impl Waits {
    /// A block freed on the stream in `slot` at its epoch `epoch`.
    #[inline]
    pub(crate) fn one(slot: u32, epoch: u64) -> Self {
        let mut at = [(0, 0); CAP];
        at[0] = (slot, epoch);
        Waits {
            len: 1,
            every: false,
            at,
        }
    }

    /// Needs no ordering at all (fresh memory, or memory whose streams the host saw finish).
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0 && !self.every
    }

    /// Names the stream in `slot` and no other.
    #[inline]
    pub(crate) fn is_only(&self, slot: u32) -> bool {
        self.len == 1 && !self.every && self.at[0].0 == slot
    }

    /// Stands for every stream (more than [`CAP`] were joined).
    pub(crate) fn every(&self) -> bool {
        self.every
    }

    /// The (slot, epoch) pairs it holds.
    #[inline]
    pub(crate) fn pairs(&self) -> &[(u32, u64)] {
        &self.at[..self.len as usize]
    }

    /// Adds `slot` at `epoch` (the later of two epochs of one stream wins).
    fn add(&mut self, slot: u32, epoch: u64) {
        if self.every {
            return;
        }
        if let Some(pair) = self.at[..self.len as usize]
            .iter_mut()
            .find(|p| p.0 == slot)
        {
            pair.1 = pair.1.max(epoch);
        } else if (self.len as usize) < CAP {
            self.at[self.len as usize] = (slot, epoch);
            self.len += 1;
        } else {
            self.every = true;
            self.len = 0;
        }
    }

    /// Drops `slot` (its stream's work is known finished, and the slot may be reused).
    pub(crate) fn forget(&mut self, slot: u32) {
        let len = self.len as usize;
        if let Some(i) = self.at[..len].iter().position(|p| p.0 == slot) {
            self.at[i] = self.at[len - 1];
            self.len -= 1;
        }
    }

    /// The first stream's slot, if any (which stream a snapshot shows a block under).
    pub(crate) fn first(&self) -> Option<u32> {
        self.pairs().first().map(|p| p.0)
    }
}

impl BlockTag for Waits {
    #[inline]
    fn join(&mut self, other: &Self) {
        if other.every {
            self.every = true;
            self.len = 0;
            return;
        }
        for &(slot, epoch) in other.pairs() {
            self.add(slot, epoch);
        }
    }
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use super::*;

    #[test]
    fn joins_keep_the_later_epoch_and_overflow_to_every() {
        let mut w = Waits::one(1, 5);
        w.join(&Waits::one(1, 3));
        assert_eq!(w.pairs(), &[(1, 5)]);
        w.join(&Waits::one(2, 7));
        assert_eq!(w.pairs(), &[(1, 5), (2, 7)]);
        w.forget(1);
        assert_eq!(w.pairs(), &[(2, 7)]);
        for slot in 3..7 {
            w.join(&Waits::one(slot, 1));
        }
        assert!(w.every() && w.pairs().is_empty() && !w.is_empty());
        assert!(Waits::default().is_empty());
    }
}
