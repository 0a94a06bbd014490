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
//! completion changes. Run on the crate's `Completion`, and on [`Planted`], a copy of its
//! publication order with the stamp written after the lock is released.

use std::time::Instant;

use super::*;
use crate::sync::AtomicU8;

/// What the model needs of a completion.
trait Stamped: Send + Sync + 'static {
    fn result(&self) -> Option<Result<()>>;
    fn complete(&self, result: Result<()>) -> bool;
    fn completed_at(&self) -> Option<Instant>;
}

impl Stamped for Completion {
    fn result(&self) -> Option<Result<()>> {
        Completion::result(self)
    }
    fn complete(&self, result: Result<()>) -> bool {
        Completion::complete(self, result)
    }
    fn completed_at(&self) -> Option<Instant> {
        Completion::completed_at(self)
    }
}

/// `Completion`'s state and stamp, with the bug: the result is published under the lock, the
/// stamp written after it is released.
struct Planted {
    done: AtomicU8,
    stamp: Mutex<Option<Instant>>,
}

impl Stamped for Planted {
    fn result(&self) -> Option<Result<()>> {
        (self.done.load(Ordering::Acquire) != 0).then_some(Ok(()))
    }
    fn complete(&self, _: Result<()>) -> bool {
        {
            let _guard = self.stamp.lock();
            if self.done.load(Ordering::Relaxed) != 0 {
                return false;
            }
            self.done.store(1, Ordering::Release);
        }
        *self.stamp.lock() = Some(Instant::now());
        true
    }
    fn completed_at(&self) -> Option<Instant> {
        *self.stamp.lock()
    }
}

/// The reactor's poll of the head (`reached`: what the device says) against the task's
/// completion of it.
fn poll_vs_task<C: Stamped>(completion: C, reached: bool) {
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

/// The stamp written after the result is published: the reactor can see the result and no
/// stamp.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_stamp_after_result() {
    must_fail(
        module_path!(),
        "planted_stamp_after_result",
        "stamp missing",
        || {
            check(None, || {
                poll_vs_task(
                    Planted {
                        done: AtomicU8::new(0),
                        stamp: Mutex::new(None),
                    },
                    false,
                )
            });
        },
    );
}
