//! Models of the memory waiters queue behind `allocate_async` (src/resource/waiters.rs,
//! `MemoryWaiters`): tasks wait for memory in FIFO order, a free wakes the first (it holds the
//! *baton*), and a waiter that leaves while first passes the baton on.
//!
//! What must hold in every interleaving: a waiter is woken when memory it fits in comes back
//! (a lost wakeup leaves `block_on` parked forever: loom reports a deadlock), the first
//! registered is served first, a waiter cancelled at any point (before registering, holding the
//! baton, after a retry) neither swallows a notification nor stays in the queue, and no byte of
//! the fake resource is lost.
//!
//! # What runs
//! - The queue is the crate's own `MemoryWaiters` (`crate::resource::waiters`, a `pub(crate)`
//!   module so that the models, a module of the crate, can name `Leave`, which `remove`
//!   takes), not a copy.
//! - The future is [`Alloc`], which polls the crate's `Wait` (src/resource/wait.rs): all of
//!   `Allocate::poll` but the zero-byte shortcut and the resource call, which `Alloc`'s attempt
//!   replaces with the fake resource (`Allocate` itself needs a `MemoryResource` and a
//!   `Stream`; the resource here is the fake below). Its bugs are switches in src
//!   (`resource::wait::planted`). Deadlines are left out: a timeout leaves the queue through
//!   the same `remove` as a cancellation. Only over the planted copy of the queue does `Alloc`
//!   run a copy of the same calls (`Wait::poll` takes the real queue).
//! - The resource is [`Memory`]: free bytes in an `AtomicUsize`; a try takes them with a CAS
//!   loop (acquire), a free adds them (release) and calls `notify`, as `PoolResource::deallocate`
//!   does. Relaxed/acq-rel atomics are the weakest a resource could use: the store buffering
//!   between a waiter's registration and a free's `notify` is there unless the queue's SeqCst
//!   fences forbid it (loom models SeqCst fences), which `planted_no_fences` shows.
//!
//! - The `LimitingAdaptor` models drive the adaptor's real byte count (`Limit`, from
//!   src/resource/adaptor/limiting.rs) over the fake resource as its upstream, with the
//!   adaptor's own queue ([`Limited`]): a waiter refused by the limit while another request
//!   held a reservation that it then rolled back must be woken by that rollback, and a
//!   waiter's own rollback must not wake it (it polled itself in a loop: issue 19, finding 4).
//!
//! - The all-or-nothing models drive `AllocSet`: the crate's `Wait::poll` with `AllocateAll`'s
//!   attempt (take every piece or give back what was taken, through the crate's
//!   `wait::give_back`), against the real queue and its `quietly`: the head's give-back must not wake the head itself (else it polls itself in a
//!   loop), and a fresh try's give-back must wake the head it may have made fail (else two
//!   sets that each took half the memory both wait forever, with all of it free).
//!
//! Threads: 2-3 per model; bounds per test.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use loom::future::block_on;
use loom::thread;

use super::{check_paths, must_fail, CountingWaker, Seen, Shared};
use crate::sync::{Arc, AtomicUsize, Mutex, Ordering};

/// The crate's own waiting state machine (src/resource/wait.rs), which `Allocate::poll` runs.
use crate::resource::wait::{Attempt, Wait};
/// The crate's own queue (src/resource/waiters.rs; see the module doc).
use crate::resource::waiters;

// The models by what they drive, each file with its default and planted `#[test]`s; the copy of
// the queue with bugs planted in it.
mod limiting;
mod planted;
mod queue;
mod sets;

/// The bytes every waiter asks for.
const N: usize = 256;

// ---------------------------------------------------------------------------------------------
// The fake resource, the queue under test, and `Allocate::poll` (the crate's `Wait::poll`).
// ---------------------------------------------------------------------------------------------

/// A resource's free bytes.
struct Memory {
    free: AtomicUsize,
}

impl Memory {
    fn new(free: usize) -> Self {
        Memory {
            free: AtomicUsize::new(free),
        }
    }

    /// `allocate`: takes `bytes` if that many are free.
    fn try_take(&self, bytes: usize) -> bool {
        let mut free = self.free.load(Ordering::Acquire);
        loop {
            if free < bytes {
                return false;
            }
            match self.free.compare_exchange(
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

    /// `deallocate`: the bytes come back, then the waiters are told.
    fn give<Q: Queue>(&self, bytes: usize, waiters: &Q) {
        self.free.fetch_add(bytes, Ordering::Release);
        waiters.notify();
    }

    fn free(&self) -> usize {
        self.free.load(Ordering::SeqCst)
    }
}

/// What [`Alloc`] allocates from: `allocate`, true if served.
trait TryTake {
    fn try_take(&self, bytes: usize) -> bool;
}

impl TryTake for Memory {
    fn try_take(&self, bytes: usize) -> bool {
        Memory::try_take(self, bytes)
    }
}

/// What the models need from a waiters queue.
trait Queue: Send + Sync + 'static {
    fn new() -> Self;
    fn notify(&self);
    fn is_empty(&self) -> bool;
    fn register(&self, bytes: usize, waker: &Waker) -> (u64, bool);
    fn poll_entry(&self, id: u64, waker: &Waker) -> Option<bool>;
    /// `remove(id, Leave::Served(..))` if `served`, else `remove(id, Leave::Cancelled)`.
    fn remove(&self, id: u64, served: bool);
    /// One poll of `alloc`: the copy of `Wait::poll`'s calls, unless the queue is the real one.
    fn poll_alloc(alloc: &mut Alloc<'_, Self>, cx: &mut Context<'_>) -> Poll<()>
    where
        Self: Sized,
    {
        alloc.poll_copy(cx)
    }
    /// `alloc` dropped: leave the queue if in it.
    fn cancel_alloc(alloc: &mut Alloc<'_, Self>)
    where
        Self: Sized,
    {
        alloc.leave_copy(false)
    }
}

impl Queue for waiters::MemoryWaiters {
    fn new() -> Self {
        waiters::MemoryWaiters::new()
    }
    fn notify(&self) {
        waiters::MemoryWaiters::notify(self)
    }
    fn is_empty(&self) -> bool {
        waiters::MemoryWaiters::is_empty(self)
    }
    fn register(&self, bytes: usize, waker: &Waker) -> (u64, bool) {
        waiters::MemoryWaiters::register(self, bytes, waker)
    }
    fn poll_entry(&self, id: u64, waker: &Waker) -> Option<bool> {
        waiters::MemoryWaiters::poll_entry(self, id, waker)
    }
    fn remove(&self, id: u64, served: bool) {
        let outcome = if served {
            waiters::Leave::Served(Duration::ZERO)
        } else {
            waiters::Leave::Cancelled
        };
        waiters::MemoryWaiters::remove(self, id, outcome)
    }
    fn poll_alloc(alloc: &mut Alloc<'_, Self>, cx: &mut Context<'_>) -> Poll<()> {
        alloc.poll_real(cx)
    }
    fn cancel_alloc(alloc: &mut Alloc<'_, Self>) {
        // `Allocate`'s Drop.
        alloc.wait.cancel(Some(alloc.waiters))
    }
}

type Real = waiters::MemoryWaiters;

/// `Allocate`: the crate's own `Wait::poll` (src/resource/wait.rs, the whole state machine of
/// `Allocate::poll` but for the zero-byte shortcut and the resource call), with an attempt that
/// takes from the fake resource, and `Wait::cancel` on drop as `Allocate`'s Drop does. Its
/// bugs are switches in src (`resource::wait::planted`).
///
/// Over a planted copy of the queue (`planted::Waiters`, which `Wait::poll`, taking the real
/// `MemoryWaiters`, cannot use) it runs [`Alloc::poll_copy`], a copy of the same calls in the
/// same order.
struct Alloc<'a, Q: Queue> {
    memory: &'a dyn TryTake,
    waiters: &'a Q,
    /// The real state machine (its `id` is the place in the queue; the copy uses it too).
    wait: Wait,
    /// How it was served, once it was: for the models' path counts.
    served: Option<&'static str>,
}

/// Served by the first try (nobody waiting), by the retry after registering as first, or by
/// the retry of a queued waiter woken with the baton.
const FAST: &str = "fast";
const RETRY: &str = "retry after register";
const BATON: &str = "baton";

impl<'a, Q: Queue> Alloc<'a, Q> {
    fn new(memory: &'a dyn TryTake, waiters: &'a Q) -> Self {
        Alloc {
            memory,
            waiters,
            wait: Wait::new(N),
            served: None,
        }
    }

    /// The copy of `Wait::poll`'s calls to the queue, for the planted copies of the queue.
    fn poll_copy(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let waiters = self.waiters;
        // The common case, kept to one try: not queued, nobody waiting.
        if self.wait.id.is_none() && waiters.is_empty() && self.memory.try_take(N) {
            self.served = Some(FAST);
            return Poll::Ready(());
        }
        let try_now = match self.wait.id {
            // Not queued and the try above failed, or others wait (FIFO: queue behind them).
            None => false,
            // Queued: try when woken with the baton.
            Some(id) => waiters.poll_entry(id, cx.waker()).unwrap_or(true),
        };
        if try_now && self.memory.try_take(N) {
            self.served = Some(BATON);
            self.leave_copy(true);
            return Poll::Ready(());
        }
        if self.wait.id.is_none() {
            let (id, first) = waiters.register(N, cx.waker());
            self.wait.id = Some(id);
            // Memory freed between our failed try and the registration notified nobody: try
            // once more if we are first in line.
            if first && self.memory.try_take(N) {
                self.served = Some(RETRY);
                self.leave_copy(true);
                return Poll::Ready(());
            }
        }
        Poll::Pending
    }

    fn leave_copy(&mut self, served: bool) {
        if let Some(id) = self.wait.id.take() {
            self.waiters.remove(id, served);
        }
    }
}

impl<'a> Alloc<'a, Real> {
    /// `Allocate::poll`: the crate's `Wait::poll`.
    fn poll_real(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let memory = self.memory;
        let queued = self.wait.is_queued();
        let mut last = None;
        let polled = self.wait.poll(
            Some(self.waiters),
            cx,
            |how| {
                last = Some(how);
                if memory.try_take(N) {
                    Ok(())
                } else {
                    // Out of memory within what the resource could hold: worth waiting.
                    Err(crate::Error::OutOfMemory {
                        requested: N,
                        available: 0,
                        maximum: MAXIMUM,
                    })
                }
            },
            || Ok(()),
        );
        match polled {
            Poll::Ready(Ok(())) => {
                self.served = Some(match (queued, last) {
                    (true, _) => BATON,
                    (false, Some(Attempt::Fresh)) => FAST,
                    (false, _) => RETRY,
                });
                Poll::Ready(())
            }
            Poll::Ready(Err(e)) => panic!("a wait for memory failed: {e}"),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// The resource's maximum as its out-of-memory errors tell it (more than any model holds).
const MAXIMUM: usize = 16 * N;

impl<Q: Queue> Future for Alloc<'_, Q> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        Q::poll_alloc(self.get_mut(), cx)
    }
}

impl<Q: Queue> Drop for Alloc<'_, Q> {
    fn drop(&mut self) {
        // Cancelled while waiting: leave the queue, passing on a wakeup we may have been given.
        Q::cancel_alloc(self);
    }
}

/// Polls `future` once with `waker`.
fn poll_once<F: Future + Unpin>(future: &mut F, waker: &Waker) -> Poll<F::Output> {
    Pin::new(future).poll(&mut Context::from_waker(waker))
}

/// After every thread is done: nobody waits, and every byte is back.
fn settled<Q: Queue>(waiters: &Q, memory: &Memory, bytes: usize) {
    assert!(waiters.is_empty(), "a waiter was left behind in the queue");
    assert_eq!(memory.free(), bytes, "bytes lost or made up");
}
