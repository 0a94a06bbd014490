//! Models of `Completion` (src/completion.rs): the lock protocol that makes a wakeup impossible to
//! lose, waiters that leave, callbacks that run exactly once, and racing `complete`s.
//!
//! Every model is written against the [`Core`] trait, implemented by the crate's `Completion`
//! (the `#[test]`s that run by default) and by [`planted::Completion`], a copy of it with one bug
//! switched on (the `#[ignore]`d `planted_*` tests, which expect loom to catch that bug).
//!
//! All models here are small (2-3 threads, a handful of lock sections) and are explored
//! exhaustively: preemption bound `None` unless the test says otherwise.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use loom::future::block_on;
use loom::thread;

use super::{check, must_fail, CountingWaker};
use crate::completion::{Callback, Completion, Registration};
use crate::error::{Error, Result};
use crate::sync::{Arc, AtomicUsize, Ordering};

/// What the models need from a completion state.
trait Core: Send + Sync + 'static {
    fn result(&self) -> Option<Result<()>>;
    fn complete(&self, result: Result<()>) -> bool;
    fn register_waker(&self, key: &mut Option<usize>, waker: &Waker) -> Registration;
    fn deregister(&self, key: usize);
    #[allow(clippy::type_complexity)]
    fn register_callback(
        &self,
        callback: Callback,
    ) -> std::result::Result<Registration, (Callback, Result<()>)>;
    fn waiting(&self) -> usize;
    fn hurry(&self, on: bool);
}

impl Core for Completion {
    fn result(&self) -> Option<Result<()>> {
        Completion::result(self)
    }
    fn complete(&self, result: Result<()>) -> bool {
        Completion::complete(self, result)
    }
    fn register_waker(&self, key: &mut Option<usize>, waker: &Waker) -> Registration {
        Completion::register_waker(self, key, waker)
    }
    fn deregister(&self, key: usize) {
        Completion::deregister(self, key)
    }
    fn register_callback(
        &self,
        callback: Callback,
    ) -> std::result::Result<Registration, (Callback, Result<()>)> {
        Completion::register_callback(self, callback)
    }
    fn waiting(&self) -> usize {
        Completion::waiting(self)
    }
    fn hurry(&self, on: bool) {
        Completion::hurry(self, on)
    }
}

fn real() -> Completion {
    Completion::new()
}

/// The failure the models complete with when they need an error (its payload is checked).
fn failure() -> Error {
    Error::Driver {
        call: "cuStreamSynchronize",
        code: 700,
        name: "CUDA_ERROR_ILLEGAL_ADDRESS".into(),
    }
}

/// A future that waits as `Event::poll` does, minus the device query: the lock-free
/// `result()` fast path, then `register_waker`. Dropping it deregisters, as `Event`'s Drop does.
struct Wait<C: Core> {
    core: Arc<C>,
    key: Option<usize>,
}

impl<C: Core> Future for Wait<C> {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = self.get_mut();
        if let Some(result) = this.core.result() {
            return Poll::Ready(result);
        }
        match this.core.register_waker(&mut this.key, cx.waker()) {
            Registration::Done(result) => Poll::Ready(result),
            Registration::Stored { .. } => Poll::Pending,
        }
    }
}

impl<C: Core> Drop for Wait<C> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.core.deregister(key);
        }
    }
}

/// A callback that counts its runs in `runs` and checks it is given `expected`.
fn counting_callback(runs: &Arc<AtomicUsize>, expected: Result<()>) -> Callback {
    let runs = runs.clone();
    Box::new(move |result: &Result<()>| {
        assert_eq!(*result, expected, "callback ran with the wrong result");
        runs.fetch_add(1, Ordering::SeqCst);
    })
}

// ---------------------------------------------------------------------------------------------
// (a) complete racing register_waker: the waiter is told Done, or is woken. Never lost.
// ---------------------------------------------------------------------------------------------

/// One thread completes while this one registers a waker. If the registration was stored, the
/// waker is woken exactly once; if it saw Done, it is the completed result and nothing is stored.
fn register_vs_complete_model<C: Core>(new: fn() -> C, result: fn() -> Result<()>) {
    let core = Arc::new(new());
    let (counter, waker) = CountingWaker::new();

    let completer = {
        let core = core.clone();
        thread::spawn(move || assert!(core.complete(result())))
    };
    let mut key = None;
    let registration = core.register_waker(&mut key, &waker);
    completer.join().unwrap();

    match registration {
        Registration::Done(got) => {
            assert_eq!(got, result());
            assert!(key.is_none(), "Done must not hand out a slot");
            assert_eq!(counter.wakes(), 0);
        }
        Registration::Stored { first } => {
            assert!(first, "the only registration must be the first");
            assert!(key.is_some());
            assert_eq!(
                counter.wakes(),
                1,
                "stored waker not woken exactly once: lost wakeup"
            );
        }
    }
    assert_eq!(core.result(), Some(result()));
    assert_eq!(core.waiting(), 0);
}

/// The same race driven as a future with `loom::future::block_on`: a lost wakeup leaves the
/// waiting thread parked forever, which loom reports as a deadlock. Also checks the lock-free
/// `result()` fast path sees the error the completer stored.
fn await_vs_complete_model<C: Core>(new: fn() -> C, result: fn() -> Result<()>) {
    let core = Arc::new(new());
    let completer = {
        let core = core.clone();
        thread::spawn(move || assert!(core.complete(result())))
    };
    let got = block_on(Wait {
        core: core.clone(),
        key: None,
    });
    assert_eq!(got, result());
    completer.join().unwrap();
    assert_eq!(core.waiting(), 0);
}

/// Exhaustive (no preemption bound).
#[test]
fn register_vs_complete_ok() {
    check(None, || register_vs_complete_model(real, || Ok(())));
}

/// Exhaustive (no preemption bound).
#[test]
fn register_vs_complete_err() {
    check(None, || register_vs_complete_model(real, || Err(failure())));
}

/// Exhaustive (no preemption bound).
#[test]
fn await_vs_complete_ok() {
    check(None, || await_vs_complete_model(real, || Ok(())));
}

/// Exhaustive (no preemption bound).
#[test]
fn await_vs_complete_err() {
    check(None, || await_vs_complete_model(real, || Err(failure())));
}

// ---------------------------------------------------------------------------------------------
// (b) a waiter leaves (future dropped) while another thread completes.
// ---------------------------------------------------------------------------------------------

/// A waiter registers and then drops its future (deregister) on one thread; a second waiter
/// registers on another; this thread completes. No panic (a deregister after `complete` finds
/// no slot), the staying waiter is never lost, the leaving one is woken at most once, and the
/// state ends complete with no waiter left.
fn deregister_vs_complete_model<C: Core>(new: fn() -> C) {
    let core = Arc::new(new());

    let leaver = {
        let core = core.clone();
        thread::spawn(move || {
            let (counter, waker) = CountingWaker::new();
            let mut key = None;
            let registration = core.register_waker(&mut key, &waker);
            if let Some(k) = key.take() {
                core.deregister(k);
            }
            let stored = matches!(registration, Registration::Stored { .. });
            (
                stored,
                matches!(registration, Registration::Stored { first: true }),
                counter,
            )
        })
    };
    let stayer = {
        let core = core.clone();
        thread::spawn(move || {
            let (counter, waker) = CountingWaker::new();
            let mut key = None;
            let registration = core.register_waker(&mut key, &waker);
            let stored = match registration {
                Registration::Done(ref r) => {
                    assert_eq!(*r, Ok(()));
                    false
                }
                Registration::Stored { .. } => true,
            };
            (
                stored,
                matches!(registration, Registration::Stored { first: true }),
                counter,
            )
        })
    };
    assert!(core.complete(Ok(())));

    let (leaver_stored, leaver_first, leaver_counter) = leaver.join().unwrap();
    let (stayer_stored, stayer_first, stayer_counter) = stayer.join().unwrap();
    assert!(leaver_counter.wakes() <= 1, "a waker woken twice");
    assert_eq!(
        stayer_counter.wakes(),
        usize::from(stayer_stored),
        "the staying waiter was stored but not woken exactly once"
    );
    assert_eq!(
        usize::from(leaver_first) + usize::from(stayer_first),
        usize::from(leaver_stored || stayer_stored),
        "`first` must be told exactly once"
    );
    assert_eq!(core.waiting(), 0);
    assert_eq!(core.result(), Some(Ok(())));
    // A late registration sees the result.
    let mut key = None;
    let (_, waker) = CountingWaker::new();
    assert!(matches!(
        core.register_waker(&mut key, &waker),
        Registration::Done(Ok(()))
    ));
}

/// A waiter polls twice with different wakers (moved to another task), racing completion: the
/// second waker replaces the first in its slot, so exactly one of them is woken if any was stored.
fn rewake_vs_complete_model<C: Core>(new: fn() -> C) {
    let core = Arc::new(new());
    let completer = {
        let core = core.clone();
        thread::spawn(move || assert!(core.complete(Ok(()))))
    };
    let (c1, w1) = CountingWaker::new();
    let (c2, w2) = CountingWaker::new();
    let mut key = None;
    let r1 = core.register_waker(&mut key, &w1);
    let r2 = core.register_waker(&mut key, &w2);
    completer.join().unwrap();
    match (r1, r2) {
        (Registration::Done(_), Registration::Done(_)) => {
            assert_eq!(c1.wakes() + c2.wakes(), 0)
        }
        (Registration::Stored { first: true }, Registration::Done(_)) => {
            assert_eq!((c1.wakes(), c2.wakes()), (1, 0))
        }
        (Registration::Stored { first: true }, Registration::Stored { first: false }) => {
            assert_eq!((c1.wakes(), c2.wakes()), (0, 1))
        }
        _ => panic!("impossible registration sequence"),
    }
    assert_eq!(core.waiting(), 0);
}

/// The `block_on` form of (b): a future is polled once (stored), then dropped, while another
/// thread completes; then a second future on this thread must still resolve.
fn drop_future_vs_complete_model<C: Core>(new: fn() -> C) {
    let core = Arc::new(new());
    let completer = {
        let core = core.clone();
        thread::spawn(move || assert!(core.complete(Ok(()))))
    };
    {
        let (_, waker) = CountingWaker::new();
        let mut cx = Context::from_waker(&waker);
        let mut first = Wait {
            core: core.clone(),
            key: None,
        };
        let _ = Pin::new(&mut first).poll(&mut cx);
        // dropped here, possibly while `complete` runs
    }
    let second = block_on(Wait {
        core: core.clone(),
        key: None,
    });
    assert_eq!(second, Ok(()));
    completer.join().unwrap();
    assert_eq!(core.waiting(), 0);
}

/// Exhaustive (no preemption bound).
#[test]
fn deregister_vs_complete() {
    check(None, || deregister_vs_complete_model(real));
}

/// Exhaustive (no preemption bound).
#[test]
fn rewake_vs_complete() {
    check(None, || rewake_vs_complete_model(real));
}

/// Exhaustive (no preemption bound).
#[test]
fn drop_future_vs_complete() {
    check(None, || drop_future_vs_complete_model(real));
}

// ---------------------------------------------------------------------------------------------
// (c) callbacks run exactly once, registered before completion or racing it.
// ---------------------------------------------------------------------------------------------

/// A callback registered before, one registered on a racing thread (run by that thread if
/// `register_callback` hands it back, as `Event::on_complete` does), and a racing waker. Each
/// callback runs exactly once with the completed result; `first` is told exactly once.
fn callbacks_vs_complete_model<C: Core>(new: fn() -> C) {
    let core = Arc::new(new());
    let before = Arc::new(AtomicUsize::new(0));
    let racing = Arc::new(AtomicUsize::new(0));
    let firsts = Arc::new(AtomicUsize::new(0));

    match core.register_callback(counting_callback(&before, Err(failure()))) {
        Ok(Registration::Stored { first: true }) => {
            firsts.fetch_add(1, Ordering::SeqCst);
        }
        _ => panic!("a pending event must store the first callback as `first`"),
    }

    let registrar = {
        let (core, racing, firsts) = (core.clone(), racing.clone(), firsts.clone());
        thread::spawn(move || {
            match core.register_callback(counting_callback(&racing, Err(failure()))) {
                Ok(Registration::Stored { first }) => {
                    if first {
                        firsts.fetch_add(1, Ordering::SeqCst);
                    }
                }
                Ok(Registration::Done(_)) => panic!("register_callback never answers Done"),
                Err((callback, result)) => callback(&result),
            }
        })
    };
    assert!(core.complete(Err(failure())));
    registrar.join().unwrap();

    assert_eq!(
        before.load(Ordering::SeqCst),
        1,
        "callback registered before: runs"
    );
    assert_eq!(racing.load(Ordering::SeqCst), 1, "racing callback: runs");
    assert_eq!(
        firsts.load(Ordering::SeqCst),
        1,
        "`first` told exactly once"
    );
}

/// Nothing registered before: a callback and a waker race each other and completion for
/// `first`. Exactly one stored registration is `first` (and one is, if any was stored).
fn callback_and_waker_vs_complete_model<C: Core>(new: fn() -> C) {
    let core = Arc::new(new());
    let runs = Arc::new(AtomicUsize::new(0));

    let registrar = {
        let (core, runs) = (core.clone(), runs.clone());
        thread::spawn(
            move || match core.register_callback(counting_callback(&runs, Ok(()))) {
                Ok(Registration::Stored { first }) => Some(first),
                Ok(Registration::Done(_)) => panic!("register_callback never answers Done"),
                Err((callback, result)) => {
                    callback(&result);
                    None
                }
            },
        )
    };
    let completer = {
        let core = core.clone();
        thread::spawn(move || assert!(core.complete(Ok(()))))
    };
    let (counter, waker) = CountingWaker::new();
    let mut key = None;
    let waker_first = match core.register_waker(&mut key, &waker) {
        Registration::Stored { first } => Some(first),
        Registration::Done(_) => None,
    };
    let callback_first = registrar.join().unwrap();
    completer.join().unwrap();

    let stored = [callback_first, waker_first].into_iter().flatten();
    let (stored, firsts) = stored.fold((0, 0), |(s, f), first| (s + 1, f + usize::from(first)));
    assert_eq!(
        firsts,
        usize::from(stored > 0),
        "`first` must be told exactly once"
    );
    assert_eq!(counter.wakes(), usize::from(waker_first.is_some()));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Exhaustive (no preemption bound).
#[test]
fn callbacks_vs_complete() {
    check(None, || callbacks_vs_complete_model(real));
}

/// Exhaustive (no preemption bound).
#[test]
fn callback_and_waker_vs_complete() {
    check(None, || callback_and_waker_vs_complete_model(real));
}

// ---------------------------------------------------------------------------------------------
// (d) two threads complete at once: one wins, its result sticks, everything runs once.
// ---------------------------------------------------------------------------------------------

/// A waker and a callback are registered, then two threads complete with different results.
/// Exactly one `complete` returns true; the stored result is the winner's; the waker is woken
/// once and the callback runs once, with the winner's result.
fn double_complete_model<C: Core>(new: fn() -> C) {
    let core = Arc::new(new());
    let (counter, waker) = CountingWaker::new();
    let mut key = None;
    assert!(matches!(
        core.register_waker(&mut key, &waker),
        Registration::Stored { first: true }
    ));
    let seen = Arc::new(crate::sync::Mutex::new(Vec::<Result<()>>::new()));
    {
        let seen = seen.clone();
        let callback: Callback = Box::new(move |r: &Result<()>| seen.lock().push(r.clone()));
        assert!(matches!(
            core.register_callback(callback),
            Ok(Registration::Stored { first: false })
        ));
    }

    let other = {
        let core = core.clone();
        thread::spawn(move || core.complete(Err(failure())))
    };
    let mine = core.complete(Ok(()));
    let theirs = other.join().unwrap();

    assert!(
        mine ^ theirs,
        "exactly one complete must win (mine {mine}, theirs {theirs})"
    );
    let winner = if mine { Ok(()) } else { Err(failure()) };
    assert_eq!(core.result(), Some(winner.clone()));
    assert_eq!(counter.wakes(), 1, "the waiter must be woken exactly once");
    assert_eq!(
        *seen.lock(),
        vec![winner],
        "the callback must run once, with the winner"
    );
}

/// Exhaustive (no preemption bound).
#[test]
fn double_complete() {
    check(None, || double_complete_model(real));
}

// ---------------------------------------------------------------------------------------------
// (f) the reactor's pre-wake (`hurry`) racing a registration, then the completion.
// ---------------------------------------------------------------------------------------------

/// The reactor hurries the event (predicting its completion soon) while this thread registers
/// a waker; then the event completes. The waiter must hear of the hurry either way: woken by the
/// pre-wake (it was stored before) or woken by its own registration (it saw the flag). Then the
/// completion wakes it as usual, and nothing stays stored.
fn hurry_vs_register_model<C: Core>(new: fn() -> C) {
    let core = Arc::new(new());
    let (counter, waker) = CountingWaker::new();
    let reactor = {
        let core = core.clone();
        thread::spawn(move || core.hurry(true))
    };
    let mut key = None;
    let registration = core.register_waker(&mut key, &waker);
    assert!(matches!(registration, Registration::Stored { first: true }));
    reactor.join().unwrap();
    assert!(
        counter.wakes() >= 1,
        "lost pre-wake: a waiter registered around a hurry was neither woken nor told to hurry"
    );
    let before = counter.wakes();
    assert!(core.complete(Ok(())));
    assert_eq!(counter.wakes(), before + 1, "the completion did not wake");
    assert_eq!(core.waiting(), 0);
}

/// Exhaustive (no preemption bound).
#[test]
fn hurry_vs_register() {
    check(None, || hurry_vs_register_model(real));
}

// ---------------------------------------------------------------------------------------------
// Planted bugs: the same models against a copy of `Completion` with one bug each. Each must
// fail; they are ignored by default (`-- --ignored` runs them). `must_fail` runs the model in a
// child process and checks the message loom or the model gave when it caught the bug.
// ---------------------------------------------------------------------------------------------

fn planted(bug: planted::Bug) -> planted::Completion {
    planted::Completion::new(bug)
}

/// Sanity: the copy with no bug switched on passes the models the real code passes.
/// Exhaustive (no preemption bound), as are all the planted tests below.
#[test]
#[ignore = "checks the planted copy itself; run with --ignored"]
fn planted_none_passes() {
    use planted::Bug;
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
                hurry_vs_register_model(|| planted(planted::Bug::HurryFlagOutsideLock))
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
                register_vs_complete_model(
                    || planted(planted::Bug::ResultCheckedOutsideLock),
                    || Ok(()),
                )
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
                await_vs_complete_model(
                    || planted(planted::Bug::ResultCheckedOutsideLock),
                    || Ok(()),
                )
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
                register_vs_complete_model(
                    || planted(planted::Bug::StateStoredAfterDrain),
                    || Ok(()),
                )
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
                callbacks_vs_complete_model(|| planted(planted::Bug::StateStoredAfterDrain))
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
                await_vs_complete_model(
                    || planted(planted::Bug::StateBeforeError),
                    || Err(failure()),
                )
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
                double_complete_model(|| planted(planted::Bug::NoPendingCheck))
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
                callbacks_vs_complete_model(|| planted(planted::Bug::CallbackCheckedOutsideLock))
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
                deregister_vs_complete_model(|| planted(planted::Bug::DeregisterIndexes))
            });
        },
    );
}

/// A copy of src/completion.rs's `Completion` with switchable bugs. `Bug::None` is the same
/// logic as the real one.
mod planted {
    use std::task::Waker;

    use crate::completion::{Callback, Registration};
    use crate::error::{Error, Result};
    use crate::sync::{AtomicBool, AtomicU8, Mutex, Ordering};

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
                if self.bug != Bug::NoPendingCheck && self.state.load(Ordering::Relaxed) != PENDING
                {
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
}
