//! Two `LimitingAdaptor`s stacked: their real byte counts, allocation, rollback and release
//! (`Limit`, as `limiting.rs` runs one) and their real queues, the lower queue relaying its
//! notifications to the upper one (`MemoryWaiters::relay_to`, as `LimitingAdaptor::new` sets
//! up through `MemoryWaiters::stacked_over`), over the fake resource. A request through the
//! upper limit (the crate's `Wait::poll`, [`Alloc`]) that the *lower* limit refuses waits in
//! the upper queue; memory coming back below must wake it:
//!
//! - a free through the lower limit alone (another user of it), and
//! - the lower limit's rollback of a request (through the upper limit) that held the
//!   reservation the waiter was refused because of, and then failed upstream.
//!
//! And a resource that calls its upstream under a lock of its own (a pool's growth under
//! `slow`) holds back what the upstream's queue relays to its own (`MemoryWaiters::deferring`),
//! telling its waiters once the lock is let go: what it held back must still reach them.
//!
//! A lost wake-up leaves `block_on` parked for ever: loom reports a deadlock. The planted
//! tests leave the relay out (the code before the fix), or drop what was held back
//! (`resource::waiters::planted::DEFER_DROPS`), and expect that deadlock.

use std::sync::Arc as StdArc;

use super::*;
use crate::resource::adaptor::Limit;

/// Two limits over an upstream of `free` bytes; the lower limit's queue relays to the upper's
/// unless `relay` is off (the planted bug: the code before the fix).
struct Nested {
    upper: Limit,
    upper_waiters: StdArc<Real>,
    lower: Limit,
    lower_waiters: Real,
    upstream: Memory,
}

impl Nested {
    fn new(upper: usize, lower: usize, upstream: usize, relay: bool) -> Self {
        let nested = Nested {
            upper: Limit::new(upper),
            upper_waiters: StdArc::new(Real::new()),
            lower: Limit::new(lower),
            lower_waiters: Real::new(),
            upstream: Memory::new(upstream),
        };
        if relay {
            nested.lower_waiters.relay_to(&nested.upper_waiters);
        }
        nested
    }

    /// The lower `LimitingAdaptor::allocate`, over the fake resource.
    fn take_lower(&self, bytes: usize) -> crate::Result<()> {
        (self.lower).allocate_through(bytes, &self.lower_waiters, || {
            self.upstream.take_or_refuse(bytes)
        })
    }

    /// The lower `LimitingAdaptor::deallocate` (not through the upper one): the fake resource
    /// takes the bytes back (its own queue is not the limits'), then the lower limit releases.
    fn free_lower(&self, bytes: usize) {
        self.upstream.free.fetch_add(bytes, Ordering::Release);
        self.lower.release(bytes, &self.lower_waiters);
    }

    /// The upper `LimitingAdaptor::deallocate`: through the lower one, then the upper limit.
    fn free(&self, bytes: usize) {
        self.free_lower(bytes);
        self.upper.release(bytes, &self.upper_waiters);
    }

    /// After every thread is done: nobody waits, both counts are back to 0, and the fake
    /// resource holds `bytes` free.
    fn settled(&self, bytes: usize) {
        assert!(self.upper_waiters.is_empty(), "a waiter was left behind");
        assert_eq!((self.upper.used(), self.lower.used()), (0, 0));
        assert_eq!(self.upstream.free(), bytes, "bytes lost or made up");
    }
}

/// The upper `LimitingAdaptor::allocate`, over the lower one.
impl TryTake for Nested {
    fn try_take(&self, bytes: usize) -> bool {
        (self.upper)
            .allocate_through(bytes, &self.upper_waiters, || self.take_lower(bytes))
            .is_ok()
    }
}

/// Polls W (a request for N through the upper limit) to the end, and notes how it was served.
fn wait_for_n(nested: &Nested, seen: &Shared<Seen>) {
    let mut w = Alloc::new(nested, &nested.upper_waiters);
    block_on(&mut w);
    seen.note(w.served.expect("block_on returned: served"), true);
}

/// An upper limit of 2N over a lower limit of N that another path fills (it holds N through
/// the lower limit alone); the upstream has plenty. W asks the upper limit for N and is
/// refused by the lower one; F frees the other path's N through the lower limit only. W must
/// be served.
fn a_free_below_wakes_the_waiter_above(relay: bool, seen: &Shared<Seen>) {
    let nested = Arc::new(Nested::new(2 * N, N, 4 * N, relay));
    nested.take_lower(N).expect("the other path's block");
    let f = {
        let nested = nested.clone();
        thread::spawn(move || nested.free_lower(N))
    };
    wait_for_n(&nested, seen);
    f.join().unwrap();
    nested.free(N);
    nested.settled(4 * N);
}

/// An upper limit of 4N over a lower limit of 2N over an upstream with N free. R asks the
/// upper limit for 2N: it reserves under both limits, the upstream refuses, and it rolls back.
/// While R holds its reservation, the lower limit refuses W (N through the upper limit): its
/// rollback there must wake W, whose queue is the upper limit's.
fn a_rollback_below_wakes_the_waiter_above(relay: bool, seen: &Shared<Seen>) {
    let nested = Arc::new(Nested::new(4 * N, 2 * N, N, relay));
    let r = {
        let nested = nested.clone();
        thread::spawn(move || assert!(!nested.try_take(2 * N), "the upstream holds only N"))
    };
    wait_for_n(&nested, seen);
    r.join().unwrap();
    nested.free(N);
    nested.settled(N);
}

#[test]
fn nested_limits_a_free_below_wakes_the_waiter_above() {
    // Served after waiting (woken by the free below) in some executions, or it checks nothing.
    check_paths(None, &[BATON], |seen| {
        a_free_below_wakes_the_waiter_above(true, seen)
    });
}

#[test]
fn nested_limits_a_rollback_below_wakes_the_waiter_above() {
    check_paths(None, &[BATON], |seen| {
        a_rollback_below_wakes_the_waiter_above(true, seen)
    });
}

/// Bug (the code before the fix): the lower queue does not relay. The free below notifies the
/// lower queue, where nobody waits; W sleeps with the memory free.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_nested_limits_no_relay_free() {
    must_fail(
        module_path!(),
        "planted_nested_limits_no_relay_free",
        "deadlock",
        || {
            check_paths(None, &[], |seen| {
                a_free_below_wakes_the_waiter_above(false, seen)
            })
        },
    );
}

/// Bug (the code before the fix): no relay, so the lower limit's rollback that saw W's
/// refusal notifies only the lower queue.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_nested_limits_no_relay_rollback() {
    must_fail(
        module_path!(),
        "planted_nested_limits_no_relay_rollback",
        "deadlock",
        || {
            check_paths(None, &[], |seen| {
                a_rollback_below_wakes_the_waiter_above(false, seen)
            })
        },
    );
}

/// As [`a_free_below_wakes_the_waiter_above`], but the free below runs inside the upper queue's
/// `deferring` (what a pool over the lower resource does around its upstream call during a
/// growth, under its `slow`): the relayed notification is held back, `tell` set, and the
/// upper queue told after (the pool's `allocate`, once it holds no lock). W must be served.
fn a_held_back_free_below_still_wakes_the_waiter_above(seen: &Shared<Seen>) {
    let nested = Arc::new(Nested::new(2 * N, N, 4 * N, true));
    nested.take_lower(N).expect("the other path's block");
    let g = {
        let nested = nested.clone();
        thread::spawn(move || {
            let tell = crate::sync::AtomicBool::new(false);
            (nested.upper_waiters).deferring(&tell, || nested.free_lower(N));
            // The lock let go: what was held back is told.
            if tell.swap(false, Ordering::AcqRel) {
                nested.upper_waiters.notify();
            }
        })
    };
    wait_for_n(&nested, seen);
    g.join().unwrap();
    nested.free(N);
    nested.settled(4 * N);
}

#[test]
fn nested_limits_a_held_back_free_below_still_wakes_the_waiter_above() {
    check_paths(
        None,
        &[BATON],
        a_held_back_free_below_still_wakes_the_waiter_above,
    );
}

/// Bug: `deferring` drops what it held back (`DEFER_DROPS`): W sleeps with the memory free.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_nested_limits_held_back_free_dropped() {
    must_fail(
        module_path!(),
        "planted_nested_limits_held_back_free_dropped",
        "deadlock",
        || {
            crate::resource::waiters::planted::DEFER_DROPS
                .store(true, std::sync::atomic::Ordering::Relaxed);
            check_paths(
                None,
                &[],
                a_held_back_free_below_still_wakes_the_waiter_above,
            )
        },
    );
}

/// A request through the lower limit alone: W of the stash models, waiting in the lower
/// queue.
struct Lower<'a>(&'a Nested);

impl TryTake for Lower<'_> {
    fn try_take(&self, bytes: usize) -> bool {
        self.0.take_lower(bytes).is_ok()
    }
}

/// A request waiting in the *lower* queue (W, refused by the lower limit, which another path
/// fills) while G, inside the upper queue's `deferring` (a pool over the lower resource
/// growing under its `slow`), frees below: the lower queue's head is notified there, on a
/// thread that holds the upper resource's lock, so its waker is stashed
/// (`waiters::wake_or_stash`) and woken by G's request guard (`tell_held_back`) once the lock
/// is let go. W must be served.
fn a_free_below_during_a_growth_above_wakes_the_waiter_below(seen: &Shared<Seen>) {
    let nested = Arc::new(Nested::new(2 * N, N, 4 * N, true));
    nested.take_lower(N).expect("the other path's block");
    let g = {
        let nested = nested.clone();
        thread::spawn(move || {
            let tell = crate::sync::AtomicBool::new(false);
            let guard = nested.upper_waiters.tell_held_back(&tell);
            (nested.upper_waiters).deferring(&tell, || nested.free_lower(N));
            // The request over, the lock let go: the guard wakes what was stashed.
            drop(guard);
        })
    };
    {
        let lower = Lower(&nested);
        let mut w = Alloc::new(&lower, &nested.lower_waiters);
        block_on(&mut w);
        seen.note(w.served.expect("block_on returned: served"), true);
    }
    g.join().unwrap();
    nested.free_lower(N);
    assert!(nested.lower_waiters.is_empty(), "a waiter was left behind");
    assert_eq!((nested.upper.used(), nested.lower.used()), (0, 0));
    assert_eq!(nested.upstream.free(), 4 * N, "bytes lost or made up");
}

#[test]
fn nested_limits_a_free_below_during_a_growth_above_wakes_the_waiter_below() {
    check_paths(
        None,
        &[BATON],
        a_free_below_during_a_growth_above_wakes_the_waiter_below,
    );
}

/// Bug: the stashed wakers are dropped, not woken (`STASH_DROPS`): W sleeps with the memory
/// free.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_nested_limits_stashed_wake_dropped() {
    must_fail(
        module_path!(),
        "planted_nested_limits_stashed_wake_dropped",
        "deadlock",
        || {
            crate::resource::waiters::planted::STASH_DROPS
                .store(true, std::sync::atomic::Ordering::Relaxed);
            check_paths(
                None,
                &[],
                a_free_below_during_a_growth_above_wakes_the_waiter_below,
            )
        },
    );
}
