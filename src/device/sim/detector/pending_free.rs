//! A resource's free of a block, noted before the resource has taken the block back, and
//! forgotten if the resource refuses it.
//!
//! A suballocating resource notes a free before the block is back in its lists (from there
//! another thread may hand the block out at once, and that thread's note of the allocation
//! must find the free). But the resource may refuse the free: a block of another resource of
//! the same device, a size that is not the block's. Noted for good, such a free marked a block
//! that is still its owner's freed: the owner's next use read as a use after free (a false
//! race), and its real free found no live block to check (a review's finding). So the free is
//! pending until the resource answers: [`Detector::confirm_free`] keeps it (and the race it
//! found), [`Detector::refuse_free`] puts the block's shadow back as it was.
//!
//! The shadow is put back whole, so whatever another thread's operation noted inside the
//! block between the two (its owner's use, running beside the refused free) goes with it: a
//! missed race at worst. Such a use is also checked against the pending free while it lasts;
//! the window is the resource's own check, and only a free the caller got wrong opens it.

use super::{Detector, Race, Seg};

/// A free noted by [`Detector::free_pending`], awaiting the resource's answer.
pub(crate) struct PendingFree {
    /// The block, when it has bytes (nothing was noted otherwise).
    block: Option<(u64, u64)>,
    /// The shadow of the block's range before the free, segment by segment.
    before: Vec<(u64, Seg)>,
    /// The race the free found: kept and logged only once the free stands.
    race: Option<Race>,
}

impl Detector {
    /// A resource's free of the block of `bytes` at `ptr` on stream `idx`, as
    /// [`free`](Self::free) notes it, with what undoes it if the resource refuses the free.
    pub(crate) fn free_pending(&self, idx: u32, ptr: u64, bytes: usize) -> PendingFree {
        let mut st = self.lock();
        let block = ptr
            .checked_add(bytes as u64)
            .map(|end| (ptr, end))
            .filter(|(start, end)| start < end);
        let before = match block {
            Some((start, end)) => {
                st.split(start);
                st.split(end);
                let range = st.segs.range(start..end);
                range.map(|(&key, seg)| (key, seg.clone())).collect()
            }
            None => Vec::new(),
        };
        // A block that wraps is logged there, and nothing is noted.
        let race = Self::free_unnoted(&mut st, Some(idx), ptr, Some(bytes), false, false);
        PendingFree {
            block,
            before,
            race,
        }
    }

    /// The resource took the block back: the free stands, and its race (if any) is kept and
    /// logged, and handed back for [`settle`](Self::settle).
    pub(crate) fn confirm_free(&self, pending: PendingFree) -> Option<Race> {
        let race = pending.race?;
        self.lock().note(Some(race))
    }

    /// The resource refused the free: the block's shadow goes back to what it was before it
    /// (the block live, its uses as they were), and the race the free found is dropped.
    pub(crate) fn refuse_free(&self, pending: PendingFree) {
        let Some((start, end)) = pending.block else {
            return;
        };
        let mut st = self.lock();
        st.forget(start, end);
        st.segs.extend(pending.before);
    }
}
