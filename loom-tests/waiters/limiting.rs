//! `LimitingAdaptor`: its byte count (`Limit`, the real one) over the fake resource, with its own
//! queue: a rollback wakes the waiter it refused, never the waiter itself.

use super::*;

/// What a rollback after an upstream failure does.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Rollback {
    /// The adaptor's: notify if the limit refused someone meanwhile.
    IfRefused,
    /// Planted: always notify (before the fix: the waiter woke itself).
    Always,
    /// Planted: never notify (a waiter refused because of the reservation is never woken).
    Never,
}

/// `LimitingAdaptor::allocate` and `deallocate` over `upstream`, with the adaptor's queue.
struct Limited {
    limit: crate::resource::adaptor::Limit,
    upstream: Memory,
    waiters: Real,
    rollback: Rollback,
    /// Tries so far, and the most a model allows: a waiter that wakes itself tries again and
    /// again (its polls cannot be counted instead: loom's `block_on` wakes spuriously, and a
    /// spurious wake without the baton tries nothing).
    tries: std::sync::atomic::AtomicUsize,
    max_tries: usize,
}

impl Limited {
    fn new(limit: usize, upstream_free: usize, rollback: Rollback, max_tries: usize) -> Self {
        Limited {
            limit: crate::resource::adaptor::Limit::new(limit),
            upstream: Memory::new(upstream_free),
            waiters: Real::new(),
            rollback,
            tries: std::sync::atomic::AtomicUsize::new(0),
            max_tries,
        }
    }

    /// `deallocate`: the upstream takes the bytes back (its own queue is not ours), then the
    /// adaptor gives its count back and wakes its first waiter.
    fn free(&self, bytes: usize) {
        self.upstream.free.fetch_add(bytes, Ordering::Release);
        self.limit.give_back(bytes);
        self.waiters.notify();
    }
}

impl TryTake for Limited {
    fn try_take(&self, bytes: usize) -> bool {
        let tries = 1 + self
            .tries
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        assert!(
            tries <= self.max_tries,
            "tried {tries} times: it woke itself"
        );
        if self.limit.reserve(bytes).is_err() {
            return false;
        }
        if self.upstream.try_take(bytes) {
            return true;
        }
        let refused = self.limit.give_back(bytes);
        let notify = match self.rollback {
            Rollback::IfRefused => refused,
            Rollback::Always => true,
            Rollback::Never => false,
        };
        if notify {
            self.waiters.notify();
        }
        false
    }
}

/// A limit of 2N over an upstream with N free. X makes one request for 2N, which the upstream
/// refuses: while X holds its reservation, the limit refuses W's request for N, at its first
/// try, its retry after registering, or its retry with the baton. X's rollback must wake W.
fn limit_rollback_wakes_the_refused(rollback: Rollback) {
    let limited = Arc::new(Limited::new(2 * N, N, rollback, usize::MAX));
    let x = {
        let limited = limited.clone();
        thread::spawn(move || assert!(!limited.try_take(2 * N), "the upstream holds only N"))
    };
    let mut w = Alloc::new(&*limited, &limited.waiters);
    block_on(&mut w);
    drop(w);
    x.join().unwrap();
    limited.free(N);
    assert!(limited.waiters.is_empty(), "a waiter was left behind");
    assert_eq!(limited.limit.used(), 0, "the count leaked");
    assert_eq!(limited.upstream.free(), N, "bytes lost or made up");
}

/// A limit of 2N over an upstream with nothing free; N are held through the adaptor. W waits
/// for N: each of its tries reserves, fails upstream and rolls back. F frees the N. W must be
/// served after three tries at most: its own rollbacks must not wake it.
fn limit_rollback_does_not_wake_itself(rollback: Rollback) {
    // The first try, the retry after registering, the try with the baton F's free gives.
    let limited = Arc::new(Limited::new(2 * N, 0, rollback, 3));
    limited.limit.reserve(N).expect("the held block");
    let f = {
        let limited = limited.clone();
        thread::spawn(move || limited.free(N))
    };
    let mut w = Alloc::new(&*limited, &limited.waiters);
    block_on(&mut w);
    drop(w);
    f.join().unwrap();
    limited.free(N);
    assert!(limited.waiters.is_empty(), "a waiter was left behind");
    assert_eq!(limited.limit.used(), 0, "the count leaked");
}

#[test]
fn limiting_rollback_wakes_a_waiter_it_refused() {
    check_paths(None, &[], |_| {
        limit_rollback_wakes_the_refused(Rollback::IfRefused)
    });
}

#[test]
fn limiting_rollback_does_not_wake_the_waiter_itself() {
    check_paths(None, &[], |_| {
        limit_rollback_does_not_wake_itself(Rollback::IfRefused)
    });
}

/// Bug: a rollback never notifies. A waiter the limit refused while the reservation was held
/// is never woken.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_limiting_rollback_never_notifies() {
    must_fail(
        module_path!(),
        "planted_limiting_rollback_never_notifies",
        "deadlock",
        || {
            check_paths(None, &[], |_| {
                limit_rollback_wakes_the_refused(Rollback::Never)
            })
        },
    );
}

/// Bug (the code before the fix): a rollback always notifies. The waiter is the first in line,
/// so its own rollback wakes it, and it tries again and again until the free comes.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_limiting_rollback_always_notifies() {
    must_fail(
        module_path!(),
        "planted_limiting_rollback_always_notifies",
        "woke itself",
        || {
            check_paths(Some(2), &[], |_| {
                limit_rollback_does_not_wake_itself(Rollback::Always)
            })
        },
    );
}

/// Bug in the adaptor's own count (`Limit`, not the model's copy of the rollback): a refusal
/// leaves no mark (`limiting_planted::REFUSAL_NOT_MARKED`), so the rollback that caused it
/// wakes nobody, and the refused waiter sleeps with the memory free.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_limit_refusal_not_marked() {
    must_fail(
        module_path!(),
        "planted_limit_refusal_not_marked",
        "deadlock",
        || {
            crate::resource::adaptor::limiting_planted::REFUSAL_NOT_MARKED
                .store(true, std::sync::atomic::Ordering::Relaxed);
            check_paths(None, &[], |_| {
                limit_rollback_wakes_the_refused(Rollback::IfRefused)
            })
        },
    );
}
