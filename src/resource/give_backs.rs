//! Growths that give wholly free chunks back upstream with the growth lock let go (the pool's
//! and the arena's, at their maximum): over `CudaResource` each chunk is a `cuMemFree`, which
//! waits for the whole device, and every other request that needs to grow would wait that long
//! behind the lock. While the lock is let go, the growth keeps its room from other growths by a
//! claim in the resource's `reserved` count ([`GrowthClaim`]), and a request that finds nothing
//! at the maximum meanwhile waits for the give-back to end before it fails
//! ([`GiveBacks::wait_for_one`]): the room comes back then. Loom model:
//! `loom-tests/give_backs.rs`.

use crate::sync::{AtomicU64, Condvar, Mutex, MutexGuard, Ordering};
// The planted bugs' switches, read through `planted!` (they exist only under the loom cfg).
#[cfg(streamalloc_loom)]
use crate::resource::stream_ordered::planted;

/// The give-backs for growth of one resource: how many are under way, and how many ended.
pub(crate) struct GiveBacks {
    counts: Mutex<Counts>,
    /// Told when one ends.
    ended: Condvar,
}

#[derive(Default)]
struct Counts {
    in_flight: u64,
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
        self.counts.lock().in_flight += 1;
        GrowthClaim {
            give_backs: self,
            reserved,
            claimed,
        }
    }

    /// For a request about to fail for want of memory, holding the growth lock (`slow`, of
    /// `lock`): if growths are giving chunks back with the lock let go, waits for one of them to
    /// end (the room, and what its growth leaves free, come back then), with the lock let go,
    /// and takes it again. Whether it waited: the request should look, and grow, once more.
    pub(crate) fn wait_for_one<'s>(
        &self,
        slow: MutexGuard<'s, ()>,
        lock: &'s Mutex<()>,
    ) -> (MutexGuard<'s, ()>, bool) {
        // `in_flight` grows only under the growth lock, which the caller holds: a give-back
        // begun before this look is counted, and one that ends meanwhile bumps `ended`.
        let mut counts = self.counts.lock();
        if counts.in_flight == 0 {
            return (slow, false);
        }
        let mut seen = counts.ended;
        drop(slow);
        if planted!(ENDED_READ_AFTER_SLOW) {
            // The planted bug: the counts let go with `slow`, and `ended` read once more after:
            // a give-back that ends in between is taken as not ended, and nothing tells again.
            drop(counts);
            counts = self.counts.lock();
            seen = counts.ended;
        }
        let _span = tracing::debug_span!("wait_for_growth_give_back").entered();
        while counts.ended == seen {
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
/// waiting at [`GiveBacks::wait_for_one`] told.
pub(crate) struct GrowthClaim<'a> {
    give_backs: &'a GiveBacks,
    reserved: &'a AtomicU64,
    /// Bytes it holds in `reserved`.
    pub(crate) claimed: u64,
}

impl Drop for GrowthClaim<'_> {
    fn drop(&mut self) {
        self.reserved.fetch_sub(self.claimed, Ordering::AcqRel);
        if planted!(TOLD_BEFORE_ENDED) {
            // The planted bug: the waiters told before the end is counted.
            self.give_backs.ended.notify_all();
        }
        let mut counts = self.give_backs.counts.lock();
        counts.in_flight -= 1;
        counts.ended += 1;
        drop(counts);
        if !planted!(TOLD_BEFORE_ENDED) {
            self.give_backs.ended.notify_all();
        }
    }
}
