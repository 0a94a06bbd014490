//! Two `LimitingAdaptor`s stacked: their real byte counts (`Limit`) and their real queues
//! (`MemoryWaiters`), the lower queue relaying its notifications to the upper one
//! (`MemoryWaiters::relay_to`, as `LimitingAdaptor::new` sets up), over a fake upstream. A
//! request through the upper limit that the *lower* limit refuses waits in the upper queue;
//! memory coming back below must wake it:
//!
//! - a free through the lower limit alone (another user of it), and
//! - the lower limit's rollback of a request (through the upper limit) that held the
//!   reservation the waiter was refused because of, and then failed upstream.
//!
//! A lost wake-up leaves `block_on` parked for ever: loom reports a deadlock. The planted
//! tests leave the relay out (the code before the fix) and expect that deadlock.
//!
//! The future is a copy of `Allocate::poll` (src/resource/allocate.rs) reduced to what these
//! models need, as `waiters::Alloc` is (private to that module, so it is not reused here).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc as StdArc;
use std::task::{Context, Poll};
use std::time::Duration;

use loom::future::block_on;
use loom::thread;

use super::{check_paths, must_fail, Seen, Shared};
use crate::resource::adaptor::Limit;
use crate::resource::waiters::{Leave, MemoryWaiters};
use crate::sync::{Arc, AtomicUsize, Ordering};

/// The bytes a request asks for.
const N: usize = 256;

/// Two limits over an upstream of `free` bytes; the lower limit's queue relays to the upper's
/// unless `relay` is off (the planted bug: the code before the fix).
struct Nested {
    upper: Limit,
    upper_waiters: StdArc<MemoryWaiters>,
    lower: Limit,
    lower_waiters: MemoryWaiters,
    upstream: AtomicUsize,
}

impl Nested {
    fn new(upper: usize, lower: usize, upstream: usize, relay: bool) -> Self {
        let nested = Nested {
            upper: Limit::new(upper),
            upper_waiters: StdArc::new(MemoryWaiters::new()),
            lower: Limit::new(lower),
            lower_waiters: MemoryWaiters::new(),
            upstream: AtomicUsize::new(upstream),
        };
        if relay {
            nested.lower_waiters.relay_to(&nested.upper_waiters);
        }
        nested
    }

    /// The upstream's `allocate`.
    fn take_upstream(&self, bytes: usize) -> bool {
        let mut free = self.upstream.load(Ordering::Acquire);
        loop {
            if free < bytes {
                return false;
            }
            match self.upstream.compare_exchange(
                free,
                free - bytes,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(now) => free = now,
            }
        }
    }

    /// The lower `LimitingAdaptor::allocate`: reserve, the upstream, a rollback that notifies
    /// only if the limit refused someone meanwhile.
    fn take_lower(&self, bytes: usize) -> bool {
        if self.lower.reserve(bytes).is_err() {
            return false;
        }
        if self.take_upstream(bytes) {
            return true;
        }
        if self.lower.give_back(bytes) {
            self.lower_waiters.notify();
        }
        false
    }

    /// The upper `LimitingAdaptor::allocate`, over the lower one.
    fn take(&self, bytes: usize) -> bool {
        if self.upper.reserve(bytes).is_err() {
            return false;
        }
        if self.take_lower(bytes) {
            return true;
        }
        if self.upper.give_back(bytes) {
            self.upper_waiters.notify();
        }
        false
    }

    /// The lower `LimitingAdaptor::deallocate` (not through the upper one): the upstream takes
    /// the bytes back, then the lower limit gives its count back and notifies its queue.
    fn free_lower(&self, bytes: usize) {
        self.upstream.fetch_add(bytes, Ordering::Release);
        self.lower.give_back(bytes);
        self.lower_waiters.notify();
    }

    /// The upper `LimitingAdaptor::deallocate`: through the lower one, then the upper count.
    fn free(&self, bytes: usize) {
        self.free_lower(bytes);
        self.upper.give_back(bytes);
        self.upper_waiters.notify();
    }
}

/// Served by a queued waiter's try with the baton: it waited, and was woken.
const BATON: &str = "baton";

/// `allocate_async` through the upper limit: the calls `Allocate::poll` makes to the upper
/// queue, in its order.
struct Alloc<'a> {
    nested: &'a Nested,
    id: Option<u64>,
    served: Option<&'static str>,
}

impl Future for Alloc<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let waiters = &*this.nested.upper_waiters;
        if this.id.is_none() && waiters.is_empty() && this.nested.take(N) {
            this.served = Some("fast");
            return Poll::Ready(());
        }
        let try_now = match this.id {
            None => false,
            Some(id) => waiters.poll_entry(id, cx.waker()).unwrap_or(true),
        };
        if try_now && this.nested.take(N) {
            this.served = Some(BATON);
            this.leave(Leave::Served(Duration::ZERO));
            return Poll::Ready(());
        }
        if this.id.is_none() {
            let (id, first) = waiters.register(N, cx.waker());
            this.id = Some(id);
            if first && this.nested.take(N) {
                this.served = Some("retry after register");
                this.leave(Leave::Served(Duration::ZERO));
                return Poll::Ready(());
            }
        }
        Poll::Pending
    }
}

impl Alloc<'_> {
    fn leave(&mut self, why: Leave) {
        if let Some(id) = self.id.take() {
            self.nested.upper_waiters.remove(id, why);
        }
    }
}

impl Drop for Alloc<'_> {
    fn drop(&mut self) {
        self.leave(Leave::Cancelled);
    }
}

/// An upper limit of 2N over a lower limit of N that another path fills (it holds N through
/// the lower limit alone); the upstream has plenty. W asks the upper limit for N and is
/// refused by the lower one; F frees the other path's N through the lower limit only. W must
/// be served.
fn a_free_below_wakes_the_waiter_above(relay: bool, seen: &Shared<Seen>) {
    let nested = Arc::new(Nested::new(2 * N, N, 4 * N, relay));
    assert!(nested.take_lower(N), "the other path's block");
    let f = {
        let nested = nested.clone();
        thread::spawn(move || nested.free_lower(N))
    };
    let mut w = Alloc {
        nested: &nested,
        id: None,
        served: None,
    };
    block_on(&mut w);
    let served = w.served.expect("block_on returned: served");
    seen.note(served, true);
    drop(w);
    f.join().unwrap();
    nested.free(N);
    assert!(nested.upper_waiters.is_empty(), "a waiter was left behind");
    assert_eq!((nested.upper.used(), nested.lower.used()), (0, 0));
    assert_eq!(nested.upstream.load(Ordering::SeqCst), 4 * N);
}

/// An upper limit of 4N over a lower limit of 2N over an upstream with N free. R asks the
/// upper limit for 2N: it reserves under both limits, the upstream refuses, and it rolls back.
/// While R holds its reservation, the lower limit refuses W (N through the upper limit): its
/// rollback there must wake W, whose queue is the upper limit's.
fn a_rollback_below_wakes_the_waiter_above(relay: bool, seen: &Shared<Seen>) {
    let nested = Arc::new(Nested::new(4 * N, 2 * N, N, relay));
    let r = {
        let nested = nested.clone();
        thread::spawn(move || assert!(!nested.take(2 * N), "the upstream holds only N"))
    };
    let mut w = Alloc {
        nested: &nested,
        id: None,
        served: None,
    };
    block_on(&mut w);
    let served = w.served.expect("block_on returned: served");
    seen.note(served, true);
    drop(w);
    r.join().unwrap();
    nested.free(N);
    assert!(nested.upper_waiters.is_empty(), "a waiter was left behind");
    assert_eq!((nested.upper.used(), nested.lower.used()), (0, 0));
    assert_eq!(nested.upstream.load(Ordering::SeqCst), N);
}

#[test]
fn nested_limits_a_free_below_wakes_the_waiter_above() {
    // Served after waiting (woken by the free below) in some executions, or it checks nothing.
    check_paths(None, &[BATON], |seen| {
        a_free_below_wakes_the_waiter_above(true, seen)
    });
}

#[test]
fn nested_limits_a_rollback_below_wakes_the_waiter_above() {
    check_paths(None, &[BATON], |seen| {
        a_rollback_below_wakes_the_waiter_above(true, seen)
    });
}

/// Bug (the code before the fix): the lower queue does not relay. The free below notifies the
/// lower queue, where nobody waits; W sleeps with the memory free.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_nested_limits_no_relay_free() {
    must_fail(
        module_path!(),
        "planted_nested_limits_no_relay_free",
        "deadlock",
        || {
            check_paths(None, &[], |seen| {
                a_free_below_wakes_the_waiter_above(false, seen)
            })
        },
    );
}

/// Bug (the code before the fix): no relay, so the lower limit's rollback that saw W's
/// refusal notifies only the lower queue.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_nested_limits_no_relay_rollback() {
    must_fail(
        module_path!(),
        "planted_nested_limits_no_relay_rollback",
        "deadlock",
        || {
            check_paths(None, &[], |seen| {
                a_rollback_below_wakes_the_waiter_above(false, seen)
            })
        },
    );
}
