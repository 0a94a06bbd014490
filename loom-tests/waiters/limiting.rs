//! `LimitingAdaptor`: its byte count, allocation and rollback (`Limit`, the real ones) over the
//! fake resource, with its own queue: a rollback wakes the waiter it refused, never the waiter
//! itself.

use super::*;

/// The planted rollback bugs (switches in src/resource/adaptor/limiting.rs).
use crate::resource::adaptor::limiting_planted as planted;

/// `LimitingAdaptor`'s own `allocate` and `deallocate` (`Limit::allocate_through` and
/// `Limit::release`: reserve, try the upstream, roll back; give back and notify) over the fake
/// resource as its upstream, with the adaptor's queue. (The adaptor itself needs an upstream
/// `MemoryResource` and a `Stream`; only its rounding and the call of the upstream are not run.)
struct Limited {
    limit: crate::resource::adaptor::Limit,
    upstream: Memory,
    waiters: Real,
    /// Tries so far, and the most a model allows: a waiter that wakes itself tries again and
    /// again (its polls cannot be counted instead: loom's `block_on` wakes spuriously, and a
    /// spurious wake without the baton tries nothing).
    tries: std::sync::atomic::AtomicUsize,
    max_tries: usize,
}

impl Limited {
    fn new(limit: usize, upstream_free: usize, max_tries: usize) -> Self {
        Limited {
            limit: crate::resource::adaptor::Limit::new(limit),
            upstream: Memory::new(upstream_free),
            waiters: Real::new(),
            tries: std::sync::atomic::AtomicUsize::new(0),
            max_tries,
        }
    }

    /// `deallocate`: the upstream takes the bytes back (its own queue is not ours), then the
    /// adaptor gives its count back and wakes its first waiter.
    fn free(&self, bytes: usize) {
        self.upstream.free.fetch_add(bytes, Ordering::Release);
        self.limit.release(bytes, &self.waiters);
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
        (self.limit)
            .allocate_through(bytes, &self.waiters, || self.upstream.take_or_refuse(bytes))
            .is_ok()
    }
}

/// Switches the planted bug `bug` on (in a `must_fail` child).
fn plant(bug: &std::sync::atomic::AtomicBool) {
    bug.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// A limit of 2N over an upstream with N free. X makes one request for 2N, which the upstream
/// refuses: while X holds its reservation, the limit refuses W's request for N, at its first
/// try, its retry after registering, or its retry with the baton. X's rollback must wake W.
fn limit_rollback_wakes_the_refused() {
    let limited = Arc::new(Limited::new(2 * N, N, usize::MAX));
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
fn limit_rollback_does_not_wake_itself() {
    // The first try, the retry after registering, the try with the baton F's free gives.
    let limited = Arc::new(Limited::new(2 * N, 0, 3));
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
    check_paths(None, &[], |_| limit_rollback_wakes_the_refused());
}

#[test]
fn limiting_rollback_does_not_wake_the_waiter_itself() {
    check_paths(None, &[], |_| limit_rollback_does_not_wake_itself());
}

/// Bug: a rollback never notifies (`ROLLBACK_NEVER_NOTIFIES`). A waiter the limit refused while the reservation was held
/// is never woken.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_limiting_rollback_never_notifies() {
    must_fail(
        module_path!(),
        "planted_limiting_rollback_never_notifies",
        "deadlock",
        || {
            plant(&planted::ROLLBACK_NEVER_NOTIFIES);
            check_paths(None, &[], |_| limit_rollback_wakes_the_refused())
        },
    );
}

/// Bug (the code before the fix): a rollback always notifies (`ROLLBACK_ALWAYS_NOTIFIES`). The waiter is the first in line,
/// so its own rollback wakes it, and it tries again and again until the free comes.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_limiting_rollback_always_notifies() {
    must_fail(
        module_path!(),
        "planted_limiting_rollback_always_notifies",
        "woke itself",
        || {
            plant(&planted::ROLLBACK_ALWAYS_NOTIFIES);
            check_paths(Some(2), &[], |_| limit_rollback_does_not_wake_itself())
        },
    );
}

/// Bug in the adaptor's own count (`Limit::reserve`): a refusal leaves no mark
/// (`REFUSAL_NOT_MARKED`), so the rollback that caused it
/// wakes nobody, and the refused waiter sleeps with the memory free.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_limit_refusal_not_marked() {
    must_fail(
        module_path!(),
        "planted_limit_refusal_not_marked",
        "deadlock",
        || {
            plant(&planted::REFUSAL_NOT_MARKED);
            check_paths(None, &[], |_| limit_rollback_wakes_the_refused())
        },
    );
}
