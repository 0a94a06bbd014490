//! Planted bugs: the models against the crate's `Reactor` with one bug switched on in
//! src/reactor.rs (`reactor::planted`; until the eighteenth session they ran on the mirror). Each must fail; they are
//! ignored by default (`-- --ignored` runs them) and check how loom caught the bug. And the
//! `loom_false_positive_*` tests that pin down two loom 0.7.2 bugs.

use super::events::{await_one, callback_then_shutdown};
use super::*;

/// Switches `bug` on in src/reactor.rs (`reactor::planted`). Each planted test runs in a child
/// process of its own (`must_fail`), so the switch stays on only there.
fn switch_on(bug: &std::sync::atomic::AtomicBool) {
    bug.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// `Bell::wait` parks without first consuming a ring that came before it: a ring that found
/// the flag already set did not unpark, so nothing wakes the reactor.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_wait_skips_flag() {
    must_fail(
        module_path!(),
        "planted_wait_skips_flag",
        "deadlock; threads",
        || {
            switch_on(&crate::reactor::planted::WAIT_SKIPS_FLAG);
            check(Some(3), || await_one::<Reactor>((), Publish::Mutex));
        },
    );
}

/// `Reactor::watch` rings before it pushes the event: the reactor can wake, find the inbox
/// empty and park again, and the event is never polled.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_ring_before_push() {
    must_fail(
        module_path!(),
        "planted_ring_before_push",
        "deadlock; threads",
        || {
            switch_on(&crate::reactor::planted::RING_BEFORE_PUSH);
            check(Some(3), || await_one::<Reactor>((), Publish::Mutex));
        },
    );
}

/// `Reactor`'s Drop sets `shutdown` without ringing: a parked reactor never exits.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_drop_without_ring() {
    must_fail(
        module_path!(),
        "planted_drop_without_ring",
        "deadlock; threads",
        || {
            switch_on(&crate::reactor::planted::DROP_WITHOUT_RING);
            check(Some(3), || await_one::<Reactor>((), Publish::Mutex));
        },
    );
}

/// The thread exits on `shutdown` even while it still watches events: a deferred free
/// registered before the device was dropped never runs.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_shutdown_drops_pending() {
    must_fail(
        module_path!(),
        "planted_shutdown_drops_pending",
        "a deferred callback was dropped without running",
        || {
            switch_on(&crate::reactor::planted::SHUTDOWN_DROPS_PENDING);
            check(Some(3), || {
                callback_then_shutdown::<Reactor>((), Publish::Mutex)
            });
        },
    );
}

/// `Bell::wait` clears the flag after parking with an RMW that does not acquire
/// (`swap(false, Release)`). A ring that found the flag set skipped the unpark, and the
/// reactor, not having acquired the ringer's release, reads the device flag stale and parks for
/// good. A real (C11-consistent) lost wakeup when the device publishes with an atomic; src's
/// old `store(false, Release)` had the same weakness (README.md, "Findings").
#[test]
#[ignore = "planted bug: must fail"]
fn planted_clear_without_acquire() {
    must_fail(
        module_path!(),
        "planted_clear_without_acquire",
        "deadlock; threads",
        || {
            switch_on(&crate::reactor::planted::CLEAR_WITHOUT_ACQUIRE);
            check(Some(3), || await_one::<Reactor>((), Publish::Atomic));
        },
    );
}

/// Not a bug of ours: the mirror with src's exact clear (`store(false, Release)`) and the
/// simulated device's mutex-published flag, which no C11 execution can deadlock, "deadlocks"
/// under loom 0.7.2 (tokio-rs/loom#254: the store is placed between a ringer's swap read and
/// write). Passes (loom reports the deadlock) while loom has the bug.
#[test]
#[ignore = "documents a loom 0.7.2 bug: passes while loom has it"]
fn loom_false_positive_store_races_swap() {
    must_fail(
        module_path!(),
        "loom_false_positive_store_races_swap",
        "deadlock; threads",
        || {
            let config = mirror::Config {
                clear: mirror::Clear::Store,
                ..MIRROR
            };
            check(Some(3), move || {
                await_one::<mirror::Reactor>(config, Publish::Mutex)
            });
        },
    );
}

/// Not a bug of ours: the mirror parking with loom's own `thread::park`/`unpark`, as src does,
/// fails under loom 0.7.2 (tokio-rs/loom#249: an unpark aimed at a thread blocked on a mutex
/// wakes it while the mutex is still held). Passes (loom reports the failure) while loom has
/// the bug.
#[test]
#[ignore = "documents a loom 0.7.2 bug: passes while loom has it"]
fn loom_false_positive_unpark_in_lock() {
    must_fail(
        module_path!(),
        "loom_false_positive_unpark_in_lock",
        "expected to be able to acquire lock",
        || {
            let config = mirror::Config {
                park: mirror::Park::Loom,
                ..MIRROR
            };
            check(Some(3), move || {
                await_one::<mirror::Reactor>(config, Publish::Mutex)
            });
        },
    );
}
