//! Callbacks against `complete`: each runs exactly once, registered before completion or racing
//! it, and two racing `complete`s: one wins, its result sticks, everything runs once.

use super::*;

// ---------------------------------------------------------------------------------------------
// (c) callbacks run exactly once, registered before completion or racing it.
// ---------------------------------------------------------------------------------------------

/// A callback registered before, one registered on a racing thread (run by that thread if
/// `register_callback` hands it back, as `Event::on_complete` does), and a racing waker. Each
/// callback runs exactly once with the completed result; `first` is told exactly once.
pub(super) fn callbacks_vs_complete_model<C: Core>(new: fn() -> C) {
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
pub(super) fn callback_and_waker_vs_complete_model<C: Core>(new: fn() -> C) {
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
pub(super) fn double_complete_model<C: Core>(new: fn() -> C) {
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
