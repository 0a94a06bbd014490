//! Waiters against `complete`: a registration racing it (told `Done`, or woken: never lost), a
//! waiter that leaves or re-polls while it completes, and the reactor's pre-wake (`hurry`).

use super::*;

// ---------------------------------------------------------------------------------------------
// (a) complete racing register_waker: the waiter is told Done, or is woken. Never lost.
// ---------------------------------------------------------------------------------------------

/// One thread completes while this one registers a waker. If the registration was stored, the
/// waker is woken exactly once; if it saw Done, it is the completed result and nothing is stored.
pub(super) fn register_vs_complete_model<C: Core>(new: fn() -> C, result: fn() -> Result<()>) {
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
pub(super) fn await_vs_complete_model<C: Core>(new: fn() -> C, result: fn() -> Result<()>) {
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
pub(super) fn deregister_vs_complete_model<C: Core>(new: fn() -> C) {
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
pub(super) fn rewake_vs_complete_model<C: Core>(new: fn() -> C) {
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
pub(super) fn drop_future_vs_complete_model<C: Core>(new: fn() -> C) {
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
// (f) the reactor's pre-wake (`hurry`) racing a registration, then the completion.
// ---------------------------------------------------------------------------------------------

/// The reactor hurries the event (predicting its completion soon) while this thread registers
/// a waker; then the event completes. The waiter must hear of the hurry either way: woken by the
/// pre-wake (it was stored before) or woken by its own registration (it saw the flag). Then the
/// completion wakes it as usual, and nothing stays stored.
pub(super) fn hurry_vs_register_model<C: Core>(new: fn() -> C) {
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
