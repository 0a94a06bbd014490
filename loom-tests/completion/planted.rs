//! Planted bugs: the same models against a copy of `Completion` with one bug each. Each must
//! fail; they are ignored by default (`-- --ignored` runs them). `must_fail` runs the model in a
//! child process and checks the message loom or the model gave when it caught the bug.

use std::task::Waker;

use super::callbacks::{
    callback_and_waker_vs_complete_model, callbacks_vs_complete_model, double_complete_model,
};
use super::wakers::{
    await_vs_complete_model, deregister_vs_complete_model, drop_future_vs_complete_model,
    hurry_vs_register_model, register_vs_complete_model, rewake_vs_complete_model,
};
use super::{check, failure, must_fail};

use crate::completion::{Callback, Registration};
use crate::error::{Error, Result};
use crate::sync::{AtomicBool, AtomicU8, Mutex, Ordering};

fn planted(bug: Bug) -> Completion {
    Completion::new(bug)
}

/// Sanity: the copy with no bug switched on passes the models the real code passes.
/// Exhaustive (no preemption bound), as are all the planted tests below.
#[test]
#[ignore = "checks the planted copy itself; run with --ignored"]
fn planted_none_passes() {
    check(None, || {
        register_vs_complete_model(|| planted(Bug::None), || Ok(()))
    });
    check(None, || {
        register_vs_complete_model(|| planted(Bug::None), || Err(failure()))
    });
    check(None, || {
        await_vs_complete_model(|| planted(Bug::None), || Err(failure()))
    });
    check(None, || deregister_vs_complete_model(|| planted(Bug::None)));
    check(None, || rewake_vs_complete_model(|| planted(Bug::None)));
    check(None, || {
        drop_future_vs_complete_model(|| planted(Bug::None))
    });
    check(None, || callbacks_vs_complete_model(|| planted(Bug::None)));
    check(None, || {
        callback_and_waker_vs_complete_model(|| planted(Bug::None))
    });
    check(None, || double_complete_model(|| planted(Bug::None)));
    check(None, || hurry_vs_register_model(|| planted(Bug::None)));
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

// A copy of src/completion.rs's `Completion` with switchable bugs. `Bug::None` is the same
// logic as the real one.

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Bug {
    None,
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

const PENDING: u8 = 0;
const OK: u8 = 1;
const FAILED: u8 = 2;

pub(super) struct Completion {
    bug: Bug,
    state: AtomicU8,
    error: Mutex<Option<Error>>,
    waiters: Mutex<Waiters>,
    hurry: AtomicBool,
}

#[derive(Default)]
struct Waiters {
    wakers: Vec<Option<Waker>>,
    free: Vec<usize>,
    callbacks: Vec<Callback>,
    watched: bool,
}

impl Completion {
    pub(super) fn new(bug: Bug) -> Self {
        Self {
            bug,
            state: AtomicU8::new(PENDING),
            error: Mutex::new(None),
            waiters: Mutex::new(Waiters::default()),
            hurry: AtomicBool::new(false),
        }
    }

    fn new_slot(waiters: &mut Waiters, waker: &Waker) -> usize {
        match waiters.free.pop() {
            Some(k) => {
                waiters.wakers[k] = Some(waker.clone());
                k
            }
            None => {
                waiters.wakers.push(Some(waker.clone()));
                waiters.wakers.len() - 1
            }
        }
    }
}

impl super::Core for Completion {
    fn result(&self) -> Option<Result<()>> {
        match self.state.load(Ordering::Acquire) {
            PENDING => None,
            OK => Some(Ok(())),
            _ => Some(Err(self.error.lock().clone().unwrap_or(
                Error::InvalidArgument {
                    what: "event failed without an error (a bug in streamalloc)",
                },
            ))),
        }
    }

    fn complete(&self, result: Result<()>) -> bool {
        let state = if result.is_ok() { OK } else { FAILED };
        let (wakers, callbacks) = {
            let mut waiters = self.waiters.lock();
            if self.bug != Bug::NoPendingCheck && self.state.load(Ordering::Relaxed) != PENDING {
                return false;
            }
            if self.bug == Bug::StateBeforeError {
                self.state.store(state, Ordering::Release);
            }
            if let Err(e) = &result {
                *self.error.lock() = Some(e.clone());
            }
            if !matches!(self.bug, Bug::StateBeforeError | Bug::StateStoredAfterDrain) {
                self.state.store(state, Ordering::Release);
            }
            waiters.free.clear();
            (
                std::mem::take(&mut waiters.wakers),
                std::mem::take(&mut waiters.callbacks),
            )
        };
        if self.bug == Bug::StateStoredAfterDrain {
            self.state.store(state, Ordering::Release);
        }
        for waker in wakers.into_iter().flatten() {
            waker.wake();
        }
        for callback in callbacks {
            callback(&result);
        }
        true
    }

    fn register_waker(&self, key: &mut Option<usize>, waker: &Waker) -> Registration {
        if self.bug == Bug::ResultCheckedOutsideLock {
            if let Some(result) = self.result() {
                return Registration::Done(result);
            }
        }
        let mut waiters = self.waiters.lock();
        if self.bug != Bug::ResultCheckedOutsideLock {
            if let Some(result) = self.result() {
                return Registration::Done(result);
            }
        }
        match *key {
            Some(k) => match waiters.wakers.get_mut(k) {
                Some(Some(old)) if old.will_wake(waker) => {}
                Some(slot) => *slot = Some(waker.clone()),
                None => *key = Some(Self::new_slot(&mut waiters, waker)),
            },
            None => *key = Some(Self::new_slot(&mut waiters, waker)),
        }
        let first = !std::mem::replace(&mut waiters.watched, true);
        let hurry = self.hurry.load(Ordering::Relaxed);
        drop(waiters);
        if hurry {
            waker.wake_by_ref();
        }
        Registration::Stored { first }
    }

    fn deregister(&self, key: usize) {
        let mut waiters = self.waiters.lock();
        if self.bug == Bug::DeregisterIndexes {
            if waiters.wakers[key].take().is_some() {
                waiters.free.push(key);
            }
            return;
        }
        if let Some(slot) = waiters.wakers.get_mut(key) {
            if slot.take().is_some() {
                waiters.free.push(key);
            }
        }
    }

    fn register_callback(
        &self,
        callback: Callback,
    ) -> std::result::Result<Registration, (Callback, Result<()>)> {
        if self.bug == Bug::CallbackCheckedOutsideLock {
            if let Some(result) = self.result() {
                return Err((callback, result));
            }
        }
        let mut waiters = self.waiters.lock();
        if self.bug != Bug::CallbackCheckedOutsideLock {
            if let Some(result) = self.result() {
                return Err((callback, result));
            }
        }
        waiters.callbacks.push(callback);
        Ok(Registration::Stored {
            first: !std::mem::replace(&mut waiters.watched, true),
        })
    }

    fn waiting(&self) -> usize {
        self.waiters
            .lock()
            .wakers
            .iter()
            .filter(|w| w.is_some())
            .count()
    }

    fn hurry(&self, on: bool) {
        let wakers: Vec<Waker> = {
            let waiters = self.waiters.lock();
            if self.state.load(Ordering::Relaxed) != PENDING {
                return;
            }
            if self.bug != Bug::HurryFlagOutsideLock {
                self.hurry.store(on, Ordering::Relaxed);
            }
            if !on {
                return;
            }
            waiters.wakers.iter().flatten().cloned().collect()
        };
        if self.bug == Bug::HurryFlagOutsideLock {
            self.hurry.store(on, Ordering::Relaxed);
        }
        for waker in wakers {
            waker.wake();
        }
    }
}
