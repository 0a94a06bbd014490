//! Growths that give wholly free chunks back upstream with the growth lock let go (the pool's
//! and the arena's, at their maximum): over `CudaResource` each chunk is a `cuMemFree`, which
//! waits for the whole device, and every other request that needs to grow would wait that long
//! behind the lock. While the lock is let go, the growth keeps its room from other growths by a
//! claim in the resource's `reserved` count ([`GrowthClaim`]), and a request that finds nothing
//! at the maximum meanwhile waits for every give-back under way to end before it fails
//! ([`GiveBacks::wait_for_under_way`]): the room comes back then. Loom model:
//! `loom-tests/give_backs.rs`.

use crate::sync::{AtomicU64, Condvar, Mutex, MutexGuard, Ordering};
// The planted bugs' switches, read through `planted!` (they exist only under the loom cfg).
#[cfg(streamalloc_loom)]
use crate::resource::stream_ordered::planted;

/// The give-backs for growth of one resource: which are under way.
pub(crate) struct GiveBacks {
    counts: Mutex<Counts>,
    /// Told when one ends.
    ended: Condvar,
}

#[derive(Default)]
struct Counts {
    /// Give-backs begun so far: the next one's number.
    begun: u64,
    /// The numbers of those under way (a few at most: one per growth at the maximum).
    under_way: Vec<u64>,
    /// Give-backs ended so far (for the planted bug's wait for one).
    #[cfg(streamalloc_loom)]
    ended: u64,
}

impl GiveBacks {
    pub(crate) fn new() -> Self {
        Self {
            counts: Mutex::new(Counts::default()),
            ended: Condvar::new(),
        }
    }

    /// A growth about to give chunks back with the growth lock let go (called under it):
    /// `claimed` bytes of room added to `reserved` until the claim is dropped, and the
    /// give-back counted as under way. The resource's waiters are the caller's to tell, once it
    /// has let go of the growth lock (a waker may run a task inline, which may ask this
    /// resource for memory).
    pub(crate) fn claim<'a>(&'a self, reserved: &'a AtomicU64, claimed: u64) -> GrowthClaim<'a> {
        reserved.fetch_add(claimed, Ordering::AcqRel);
        let mut counts = self.counts.lock();
        let number = counts.begun;
        counts.begun += 1;
        counts.under_way.push(number);
        drop(counts);
        GrowthClaim {
            give_backs: self,
            reserved,
            claimed,
            number,
        }
    }

    /// For a request about to fail for want of memory, holding the growth lock (`slow`, of
    /// `lock`): if growths are giving chunks back with the lock let go, waits for every one of
    /// them under way now to end (the room, and what their growths leave free, come back
    /// then), with the lock let go, and takes it again. Whether it waited: the request should
    /// look, and grow, once more.
    ///
    /// Every one, not the first to end: while one gives back, frees (which take no growth
    /// lock) can leave another chunk wholly free for a second growth to give back, and the
    /// first's room goes to its own growth; a request that looked again after only that one
    /// failed while the second's room was still coming (a review's finding). Only those under
    /// way at the call: one begun later does not keep it waiting, so the wait is bounded.
    pub(crate) fn wait_for_under_way<'s>(
        &self,
        slow: MutexGuard<'s, ()>,
        lock: &'s Mutex<()>,
    ) -> (MutexGuard<'s, ()>, bool) {
        // A give-back begins only under the growth lock, which the caller holds: every one
        // begun before this look is numbered below `begun`.
        let mut counts = self.counts.lock();
        if counts.under_way.is_empty() {
            return (slow, false);
        }
        let seen = counts.begun;
        #[cfg(streamalloc_loom)]
        let ended = counts.ended;
        drop(slow);
        let _span = tracing::debug_span!("wait_for_growth_give_back").entered();
        loop {
            #[cfg(streamalloc_loom)]
            if planted!(WAITS_FOR_ONE_ONLY) && counts.ended > ended {
                // The planted bug: back to looking once any one has ended.
                break;
            }
            if !counts.under_way.iter().any(|&n| n < seen) {
                break;
            }
            counts = self.ended.wait(counts);
        }
        drop(counts);
        (lock.lock(), true)
    }
}

/// The room a growth giving whole chunks back keeps from other growths while the growth lock
/// is let go: the rest of the room it needs, and (added by the growth as they go) the bytes of
/// the chunks given back, still counted in `reserved`. Dropped under the growth lock once the
/// growth took it again, right before it grows (or on unwinding): the room back, the requests
/// waiting at [`GiveBacks::wait_for_under_way`] told.
pub(crate) struct GrowthClaim<'a> {
    give_backs: &'a GiveBacks,
    reserved: &'a AtomicU64,
    /// Bytes it holds in `reserved`.
    pub(crate) claimed: u64,
    /// Its give-back's number ([`GiveBacks::claim`]).
    number: u64,
}

impl Drop for GrowthClaim<'_> {
    fn drop(&mut self) {
        self.reserved.fetch_sub(self.claimed, Ordering::AcqRel);
        if planted!(TOLD_BEFORE_ENDED) {
            // The planted bug: the waiters told before the end is counted.
            self.give_backs.ended.notify_all();
        }
        let mut counts = self.give_backs.counts.lock();
        counts.under_way.retain(|&n| n != self.number);
        #[cfg(streamalloc_loom)]
        {
            counts.ended += 1;
        }
        drop(counts);
        if !planted!(TOLD_BEFORE_ENDED) {
            self.give_backs.ended.notify_all();
        }
    }
}
