//! Planted bugs: the same models against the crate's `Completion` with one bug switched on in
//! src (`completion::planted`; until the eighteenth session a copy of `Completion` carried them).
//! Each must fail; they are ignored by default (`-- --ignored` runs them). `must_fail` runs the model in a
//! child process and checks the message loom or the model gave when it caught the bug.

use super::callbacks::{callbacks_vs_complete_model, double_complete_model};
use super::wakers::{
    await_vs_complete_model, deregister_vs_complete_model, hurry_vs_register_model,
    register_vs_complete_model,
};
use super::{check, failure, must_fail};

use crate::completion::Completion;

/// The crate's `Completion`, with `bug` switched on in src (`completion::planted`). Each
/// planted test runs in a child process of its own (`must_fail`), so the switch stays on only
/// there.
fn planted(bug: Bug) -> Completion {
    bug.switch()
        .store(true, std::sync::atomic::Ordering::Relaxed);
    Completion::new()
}

/// Bug: `hurry` takes the wakers under the lock but sets its flag after releasing it; a waiter
/// that registers in between is neither in the list nor sees the flag.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_hurry_flag_outside_lock() {
    must_fail(
        module_path!(),
        "planted_hurry_flag_outside_lock",
        "lost pre-wake",
        || {
            check(None, || {
                hurry_vs_register_model(|| planted(Bug::HurryFlagOutsideLock))
            });
        },
    );
}

/// Bug: `register_waker` reads `result()` before taking the waiters lock.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_result_checked_outside_lock() {
    must_fail(
        module_path!(),
        "planted_result_checked_outside_lock",
        "lost wakeup",
        || {
            check(None, || {
                register_vs_complete_model(|| planted(Bug::ResultCheckedOutsideLock), || Ok(()))
            });
        },
    );
}

/// The same bug, caught as a deadlock by the `block_on` model.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_result_checked_outside_lock_deadlocks() {
    must_fail(
        module_path!(),
        "planted_result_checked_outside_lock_deadlocks",
        "deadlock; threads",
        || {
            check(None, || {
                await_vs_complete_model(|| planted(Bug::ResultCheckedOutsideLock), || Ok(()))
            });
        },
    );
}

/// Bug: `complete` drains the waiters, releases the lock, and only then stores the state.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_state_stored_after_drain() {
    must_fail(
        module_path!(),
        "planted_state_stored_after_drain",
        "lost wakeup",
        || {
            check(None, || {
                register_vs_complete_model(|| planted(Bug::StateStoredAfterDrain), || Ok(()))
            });
        },
    );
}

/// The same bug loses a racing callback.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_state_stored_after_drain_loses_callback() {
    must_fail(
        module_path!(),
        "planted_state_stored_after_drain_loses_callback",
        "racing callback: runs",
        || {
            check(None, || {
                callbacks_vs_complete_model(|| planted(Bug::StateStoredAfterDrain))
            });
        },
    );
}

/// Bug: `complete` publishes `FAILED` before it writes the error; the lock-free `result()`
/// fast path can then see `FAILED` with no error.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_state_before_error() {
    must_fail(
        module_path!(),
        "planted_state_before_error",
        "event failed without an error",
        || {
            check(None, || {
                await_vs_complete_model(|| planted(Bug::StateBeforeError), || Err(failure()))
            });
        },
    );
}

/// Bug: `complete` does not check that the event is still pending.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_complete_twice() {
    must_fail(
        module_path!(),
        "planted_complete_twice",
        "exactly one complete must win",
        || {
            check(None, || {
                double_complete_model(|| planted(Bug::NoPendingCheck))
            });
        },
    );
}

/// Bug: `register_callback` reads `result()` before taking the waiters lock.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_callback_checked_outside_lock() {
    must_fail(
        module_path!(),
        "planted_callback_checked_outside_lock",
        "racing callback: runs",
        || {
            check(None, || {
                callbacks_vs_complete_model(|| planted(Bug::CallbackCheckedOutsideLock))
            });
        },
    );
}

/// Bug: `deregister` indexes the slot (`wakers[key]`), which panics once `complete` has taken
/// the slots.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_deregister_indexes() {
    must_fail(
        module_path!(),
        "planted_deregister_indexes",
        "index out of bounds",
        || {
            check(None, || {
                deregister_vs_complete_model(|| planted(Bug::DeregisterIndexes))
            });
        },
    );
}

/// The bugs, each a switch in src/completion.rs (`completion::planted`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Bug {
    /// `register_waker` checks `result()` before taking the waiters lock.
    ResultCheckedOutsideLock,
    /// `complete` stores the state after it released the lock with the drained waiters.
    StateStoredAfterDrain,
    /// `complete` stores `FAILED` before it writes the error.
    StateBeforeError,
    /// `complete` does not check that the event is still pending.
    NoPendingCheck,
    /// `register_callback` checks `result()` before taking the waiters lock.
    CallbackCheckedOutsideLock,
    /// `deregister` indexes `wakers[key]` instead of `get_mut(key)`.
    DeregisterIndexes,
    /// `hurry` sets its flag after releasing the lock it took the wakers under.
    HurryFlagOutsideLock,
}

impl Bug {
    fn switch(self) -> &'static std::sync::atomic::AtomicBool {
        use crate::completion::planted as p;
        match self {
            Bug::ResultCheckedOutsideLock => &p::RESULT_CHECKED_OUTSIDE_LOCK,
            Bug::StateStoredAfterDrain => &p::STATE_STORED_AFTER_DRAIN,
            Bug::StateBeforeError => &p::STATE_BEFORE_ERROR,
            Bug::NoPendingCheck => &p::NO_PENDING_CHECK,
            Bug::CallbackCheckedOutsideLock => &p::CALLBACK_CHECKED_OUTSIDE_LOCK,
            Bug::DeregisterIndexes => &p::DEREGISTER_INDEXES,
            Bug::HurryFlagOutsideLock => &p::HURRY_FLAG_OUTSIDE_LOCK,
        }
    }
}
