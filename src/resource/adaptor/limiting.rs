//! [`LimitingAdaptor`]: a byte limit on what goes through it (RMM's
//! `limiting_resource_adaptor`), with its own queue of tasks waiting for memory.

use std::fmt;

use crate::device::{Device, DevicePtr};
use crate::error::{Error, Result};
use crate::resource::{aligned_size, MemoryKind, MemoryResource, MemoryWaiters, WaitStats};
use crate::stream::Stream;
use crate::sync::plain::Arc as StdArc;
use crate::sync::{AtomicUsize, Ordering};

/// Caps the bytes outstanding through it at a limit (RMM's `limiting_resource_adaptor`).
///
/// - Each allocation counts as its size rounded up to 256 bytes
///   ([`ALIGNMENT`](crate::ALIGNMENT)), the memory it really takes. Exact at the edge:
///   allocations adding up to exactly the limit succeed, one more byte fails.
/// - Over the limit it returns [`Error::OutOfMemory`] with `requested` = the rounded size,
///   `available` = limit − used, `maximum` = limit, without calling the upstream.
/// - The upstream's errors pass through unchanged, and the reservation made for the request
///   is given back (nothing leaks).
/// - **It has its own [`MemoryWaiters`]** (returned by `memory_waiters()`, not the upstream's):
///   every successful `deallocate` through it notifies them, and so does a reservation given
///   back after an upstream failure *if the limit refused someone meanwhile* (that refusal may
///   have been a waiter's retry, which our reservation made fail). A rollback that refused
///   nobody notifies nobody: the caller is often the first waiter itself, and waking it for its
///   own rollback would make it retry at once, forever, while the upstream stays full. So
///   [`allocate_async`](crate::AllocateAsync::allocate_async) on it waits for memory freed
///   through it instead of failing, and a request above the limit fails at once.
/// - **A wait caused below is woken from below.** If the upstream has a queue of its own (a
///   pool, or another `LimitingAdaptor` under this one), this adaptor's queue hears every
///   notification of it: memory freed straight into the upstream (by another user of a shared
///   pool or lower limit), and a lower limit's rollback that refused someone, wake a request
///   of ours that the upstream refused, as a free through this adaptor does. (Before a review,
///   only frees through this adaptor woke it: a request that a lower limit refused slept until
///   its deadline, or for ever.) An upstream without a queue (a [`CudaResource`] straight on
///   the driver) cannot say when memory comes back: a wait it caused is woken by frees
///   through this adaptor only.
///
/// [`CudaResource`]: crate::CudaResource
///
/// `used` is one atomic, reserved by compare-and-swap before the upstream call: threads cannot
/// pass the limit together, and no lock is taken.
pub struct LimitingAdaptor<U: MemoryResource> {
    upstream: U,
    limit: Limit,
    /// Shared, so that the upstream's queue can relay its notifications to it
    /// ([`MemoryWaiters::relay_to`]) while the adaptor moves.
    waiters: StdArc<MemoryWaiters>,
}

/// The byte count of a [`LimitingAdaptor`] and its refusal mark, apart from the adaptor so that
/// the loom models (`loom-tests/waiters.rs`) run this very code.
#[derive(Debug)]
pub(crate) struct Limit {
    limit: usize,
    /// Bytes reserved (outstanding allocations, rounded up to 256, plus requests between their
    /// reservation and the upstream's answer; never above `limit`), and in bit 0 (`REFUSED`)
    /// whether the limit refused a request since the last release. Sizes are multiples of 256,
    /// so bit 0 is free. One atomic, so that a refusal and a release are ordered: a rollback
    /// either sees the refusal its reservation caused, or the refused request saw the rollback.
    state: AtomicUsize,
}

/// Bit 0 of `Limit::state`: the limit refused a request since the last release.
const REFUSED: usize = 1;

impl Limit {
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            limit,
            state: AtomicUsize::new(0),
        }
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes reserved now.
    pub(crate) fn used(&self) -> usize {
        self.state.load(Ordering::Acquire) & !REFUSED
    }

    /// Reserves `size` bytes (a multiple of 256) under the limit, or returns the bytes that
    /// were reserved then (and marks the refusal, for [`give_back`](Self::give_back)).
    pub(crate) fn reserve(&self, size: usize) -> std::result::Result<(), usize> {
        let mut state = self.state.load(Ordering::Acquire);
        if planted!(CHECK_THEN_ADD) {
            // The planted bug: the check and the count are two steps.
            let used = state & !REFUSED;
            if used
                .checked_add(size)
                .is_none_or(|total| total > self.limit)
            {
                return Err(used);
            }
            self.state.fetch_add(size, Ordering::AcqRel);
            return Ok(());
        }
        loop {
            let used = state & !REFUSED;
            let fits = used.checked_add(size).filter(|&total| total <= self.limit);
            // A refusal is written too (even when the bit is already set): it must be ordered
            // with the releases in `state`'s modification order.
            let next = match fits {
                Some(total) => total | (state & REFUSED),
                None => state | REFUSED,
            };
            if fits.is_none() && planted!(REFUSAL_NOT_MARKED) {
                // The planted bug: a refusal leaves no mark for the rollback to see.
                return Err(used);
            }
            match self
                .state
                .compare_exchange_weak(state, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) if fits.is_some() => return Ok(()),
                Ok(_) => return Err(used),
                Err(actual) => state = actual,
            }
        }
    }

    /// Gives `size` bytes back, clearing the refusal mark; returns whether it was set: whether
    /// the limit refused a request since the last release (perhaps because of these bytes).
    pub(crate) fn give_back(&self, size: usize) -> bool {
        self.give_back_marking(size, false)
    }

    /// Gives `size` bytes back and leaves the refusal mark as it is: for a give-back whose
    /// notification is dropped (the head waiter's, [`MemoryWaiters::quietly`]), which wakes
    /// nobody, so a later rollback must still see the refusals that came before it.
    pub(crate) fn give_back_quietly(&self, size: usize) {
        self.give_back_marking(size, true);
    }

    /// `LimitingAdaptor::allocate` once the size is rounded (`size`, a multiple of 256):
    /// reserves it under the limit (or fails with the numbers of the refusal), asks `upstream`,
    /// and on the upstream's failure rolls the reservation back ([`rollback`](Self::rollback)).
    /// Apart from the adaptor so that the loom models (`loom-tests/waiters/limiting.rs`) run it
    /// over a fake upstream.
    pub(crate) fn allocate_through<T>(
        &self,
        size: usize,
        waiters: &MemoryWaiters,
        upstream: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        self.reserve(size).map_err(|used| {
            tracing::debug!(
                requested = size,
                used,
                limit = self.limit,
                "LimitingAdaptor: over the limit"
            );
            Error::OutOfMemory {
                requested: size,
                available: self.limit.saturating_sub(used),
                maximum: self.limit,
            }
        })?;
        // A panic out of the upstream (a failure callback or a log writer below that panics)
        // hands the caller nothing: the reservation goes back with it, as RMM's adaptor gives
        // it back on any exception. Kept, the limit would stay short of it for good (a
        // review's finding).
        let on_unwind = RollbackOnUnwind(self, waiters, size);
        let got = upstream();
        std::mem::forget(on_unwind);
        match got {
            Ok(got) => Ok(got),
            Err(e) => {
                // Our reservation may have made a waiter fail meanwhile: `rollback` wakes it
                // then, and only then.
                self.rollback(size, waiters);
                Err(e)
            }
        }
    }

    /// Memory freed through the adaptor: give it back and wake the first waiter. Inside the
    /// head waiter's quiet give-back (`allocate_all_async` returning part of a set), whose
    /// notification is dropped, the refusal mark stays: a request that reserved before the
    /// head was refused, and fails upstream later, must still wake the head when it rolls
    /// back (a review found the head of a set left asleep with the memory free). That holds
    /// for the head of a queue above this one that we relay to as well: its give-back comes
    /// down through us, and it may have been refused here.
    pub(crate) fn release(&self, size: usize, waiters: &MemoryWaiters) {
        self.give_back_freed(size, waiters);
        // Dropped for the quiet queue only: the others (ours when the quiet head is above us,
        // the ones above when it is ours) hear of it.
        waiters.notify();
    }

    /// [`release`](Self::release)'s give-back without its notification, for a caller that
    /// notifies more queues than `waiters` (`CudaAsyncResource`): the refusal mark stays
    /// inside a quiet give-back of `waiters` or of a queue it relays to.
    pub(crate) fn give_back_freed(&self, size: usize, waiters: &MemoryWaiters) {
        if waiters.is_quiet() {
            self.give_back_quietly(size);
        } else {
            self.give_back(size);
        }
    }

    /// The upstream refused a request we had reserved for: give the reservation back, and wake
    /// the first waiter only if the limit refused someone while we held it (that may have been
    /// the waiter's retry). Otherwise nobody's failure was ours, and the first waiter is often
    /// the caller itself: waking it would only make it fail again at once, in a loop.
    fn rollback(&self, size: usize, waiters: &MemoryWaiters) {
        if self.roll_back(size) {
            waiters.notify();
        }
    }

    /// [`rollback`](Self::rollback)'s give-back: whether the first waiter must be woken (the
    /// limit refused someone while the reservation was held), for a caller that notifies more
    /// queues than one (`CudaAsyncResource`).
    pub(crate) fn roll_back(&self, size: usize) -> bool {
        let refused = self.give_back(size);
        // (The planted bugs: a rollback that always notifies, the code before the fix; one
        // that never does.)
        if planted!(ROLLBACK_ALWAYS_NOTIFIES) {
            true
        } else {
            refused && !planted!(ROLLBACK_NEVER_NOTIFIES)
        }
    }

    fn give_back_marking(&self, size: usize, keep_mark: bool) -> bool {
        // Never below zero, even if a caller broke `deallocate`'s contract with a wrong size
        // that the upstream accepted.
        let previous = self
            .state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |state| {
                let mark = if keep_mark { state & REFUSED } else { 0 };
                Some((state & !REFUSED).saturating_sub(size) | mark)
            })
            .unwrap_or_else(|state| state);
        previous & REFUSED != 0
    }
}

impl<U: MemoryResource> fmt::Debug for LimitingAdaptor<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitingAdaptor")
            .field("upstream", &self.upstream)
            .field("limit", &self.limit())
            .field("used", &self.used())
            .field("waiters", &self.waiters)
            .finish()
    }
}

impl<U: MemoryResource> LimitingAdaptor<U> {
    /// Lets at most `limit` bytes (counted in 256-byte units) be outstanding through it.
    pub fn new(upstream: U, limit: usize) -> Self {
        // The upstream can refuse our requests too (a pool at its maximum, a lower limit): its
        // notifications must reach our waiters (see the type's documentation).
        let waiters = MemoryWaiters::stacked_over(&upstream);
        // No request above the limit can ever be served: one that comes while others wait
        // (and so queues without a try) fails at once, whatever the errors that made them
        // wait said of the upstream's maximum.
        // Rounded down, as every request is counted rounded up (a limit of 1,000 serves at
        // most 768 bytes): a request of 1,000 bytes behind a waiter fails at once, as it does
        // alone (a review found it queued).
        waiters.note_maximum(limit - limit % crate::resource::ALIGNMENT);
        Self {
            upstream,
            limit: Limit::new(limit),
            waiters,
        }
    }

    /// The upstream resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }

    /// The limit, in bytes (RMM's `get_allocation_limit`).
    pub fn limit(&self) -> usize {
        self.limit.limit()
    }

    /// Bytes outstanding, each allocation rounded up to 256 (RMM's `get_allocated_bytes`).
    pub fn used(&self) -> usize {
        self.limit.used()
    }

    /// Bytes that can still be allocated: limit − used.
    pub fn available(&self) -> usize {
        self.limit().saturating_sub(self.used())
    }

    /// What waiting for memory in `allocate_async` on this adaptor has cost.
    pub fn wait_stats(&self) -> WaitStats {
        self.waiters.stats()
    }
}

impl<U: MemoryResource> Drop for LimitingAdaptor<U> {
    fn drop(&mut self) {
        // The upstream outlives this call (it is our field); it stops relaying to a queue that
        // nobody can wait in any more.
        MemoryWaiters::unstack_from(&self.waiters, &self.upstream);
    }
}

/// Rolls a reservation of `.2` bytes back when dropped: dropped only by an unwind out of the
/// upstream's `allocate` (forgotten otherwise).
struct RollbackOnUnwind<'a>(&'a Limit, &'a MemoryWaiters, usize);

impl Drop for RollbackOnUnwind<'_> {
    fn drop(&mut self) {
        self.0.rollback(self.2, self.1);
    }
}

/// Gives `.2` bytes back to the limit when dropped: dropped only by an unwind out of the
/// upstream's `deallocate` (forgotten otherwise).
struct ReleaseOnUnwind<'a>(&'a Limit, &'a MemoryWaiters, usize);

impl Drop for ReleaseOnUnwind<'_> {
    fn drop(&mut self) {
        if self.2 > 0 {
            self.0.release(self.2, self.1);
        }
    }
}

// SAFETY: every allocation is the upstream's (itself a `MemoryResource`), passed on unchanged;
// the adaptor only refuses past its limit.
unsafe impl<U: MemoryResource> MemoryResource for LimitingAdaptor<U> {
    fn device(&self) -> &Device {
        self.upstream.device()
    }

    fn memory_kind(&self) -> MemoryKind {
        self.upstream.memory_kind()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        if bytes == 0 {
            return self.upstream.allocate(bytes, stream);
        }
        let size = aligned_size(bytes)?;
        (self.limit).allocate_through(size, &self.waiters, || {
            self.upstream.allocate(bytes, stream)
        })
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        // `bytes` was accepted by `allocate`, so rounding it cannot overflow.
        let size = if bytes > 0 {
            aligned_size(bytes).unwrap_or(bytes)
        } else {
            0
        };
        // The simulated device's race detector, in its `Panic` mode, panics out of the
        // upstream's `deallocate` once the block is back there (a free not ordered after a
        // use): the budget goes back too, or a caller that caught the panic found the limit a
        // block short for good (a review's finding).
        let on_unwind = ReleaseOnUnwind(&self.limit, &self.waiters, size);
        // SAFETY: the caller's contract, passed on: `ptr` came from our `allocate`, which is the
        // upstream's with the same `bytes`.
        let freed = unsafe { self.upstream.deallocate(ptr, bytes, stream) };
        std::mem::forget(on_unwind);
        freed?;
        if size > 0 {
            (self.limit).release(size, &self.waiters);
        }
        Ok(())
    }

    fn memory_waiters(&self) -> Option<&MemoryWaiters> {
        Some(&self.waiters)
    }

    /// The limit's own count (`bytes` rounded up to 256), not the upstream's: a set is
    /// refused at once only if it can never fit the layer that refuses it, and under the
    /// limit a request counts no more than this, whatever an aligned adaptor below asks of the
    /// pool beneath it.
    fn footprint(&self, bytes: usize) -> Result<usize> {
        aligned_size(bytes)
    }

    /// The set's rounded total against the limit, then the upstream's own check: each layer
    /// counts the set its own way.
    fn check_set(&self, sizes: &[usize]) -> Result<()> {
        crate::resource::check_set_within(sizes, self.limit.limit(), aligned_size)?;
        self.upstream.check_set(sizes)
    }
    fn memory_snapshot(&self) -> Option<crate::resource::snapshot::Snapshot> {
        self.upstream.memory_snapshot()
    }
}

/// Bugs the loom models plant (`loom-tests/waiters/limiting.rs`), constant off otherwise;
/// read through `planted!`.
#[cfg(streamalloc_loom)]
pub(crate) mod planted {
    /// A rollback after an upstream failure always notifies (the code before the fix): the
    /// first waiter, rolling back its own try, wakes itself and tries again in a loop.
    pub(crate) static ROLLBACK_ALWAYS_NOTIFIES: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);
    /// A rollback never notifies: a waiter the limit refused while the reservation was held
    /// is never woken.
    pub(crate) static ROLLBACK_NEVER_NOTIFIES: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);
    /// `Limit::reserve` refuses without marking the refusal: a rollback that made a waiter's
    /// retry fail does not know it, and wakes nobody.
    pub(crate) static REFUSAL_NOT_MARKED: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);
    /// `Limit::reserve` checks the limit with a load and counts with a separate add: two
    /// threads can both pass the check (`loom-tests/cuda_async.rs`, through
    /// `CudaAsyncResource`'s maximum).
    pub(crate) static CHECK_THEN_ADD: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);
}
