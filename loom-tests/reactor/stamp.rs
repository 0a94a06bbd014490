//! The completion stamp (`Completion::completed_at`, issue 18). The predicting reactor polls a
//! head, and when another thread completed it first (a pre-woken task polling its own event)
//! it restarts the stream's clock at that thread's stamp instead of at its own look
//! (`poll_heads` in src/reactor.rs). So a thread that has seen the result must find the stamp:
//! `complete_for` writes it under the waiters lock before it publishes the result, and
//! `completed_at` reads it under that lock.
//!
//! The model: the reactor's poll of a head (complete it if the device says so, else see who
//! did) races the task's completion of the same event. In every interleaving exactly one of
//! them completes it, and the reactor, whichever it was, finds a stamp that no later
//! completion changes. Run on the crate's `Completion`, and with the bug switched on in it
//! (`completion::planted::STAMP_AFTER_RESULT`: the stamp written after the lock is released;
//! until the eighteenth session a copy of the publication order carried it).

use super::*;

/// The reactor's poll of the head (`reached`: what the device says) against the task's
/// completion of it.
fn poll_vs_task(completion: Completion, reached: bool) {
    let completion = Arc::new(completion);
    let task = {
        let completion = completion.clone();
        thread::spawn(move || completion.complete(Ok(())))
    };
    let reactor = {
        let completion = completion.clone();
        thread::spawn(move || {
            // `poll_heads`: complete it if the device says so; else, if done, by whom.
            let mut seen_here = false;
            if completion.result().is_none() && reached {
                seen_here = completion.complete(Ok(()));
            }
            if completion.result().is_none() {
                return (seen_here, None);
            }
            let stamp = completion.completed_at();
            assert!(
                stamp.is_some(),
                "stamp missing: the reactor saw the result before the completing thread's stamp"
            );
            (seen_here, stamp)
        })
    };
    let by_task = task.join().unwrap();
    let (seen_here, stamp) = reactor.join().unwrap();
    assert!(by_task != seen_here, "completed twice or never");
    if stamp.is_some() {
        assert_eq!(
            completion.completed_at(),
            stamp,
            "a later completion moved the stamp"
        );
    }
}

/// On the crate's `Completion`, the device saying reached and not. Exhaustive.
#[test]
fn completion_stamp_before_result() {
    for reached in [true, false] {
        check(None, move || poll_vs_task(Completion::new(), reached));
    }
}

/// The stamp written after the result is published (`completion::planted::STAMP_AFTER_RESULT`):
/// the reactor can see the result and no stamp.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_stamp_after_result() {
    must_fail(
        module_path!(),
        "planted_stamp_after_result",
        "stamp missing",
        || {
            crate::completion::planted::STAMP_AFTER_RESULT
                .store(true, std::sync::atomic::Ordering::Relaxed);
            check(None, || poll_vs_task(Completion::new(), false));
        },
    );
}
