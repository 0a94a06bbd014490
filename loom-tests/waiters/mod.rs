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
//! - The future is [`Alloc`], a copy of `Allocate::poll` (src/resource/allocate.rs), calling
//!   the queue in the same order: `Allocate` needs a `MemoryResource`, whose `device()` returns
//!   a `&Device`, which cannot be built under loom. Deadlines are left out: a timeout leaves
//!   the queue through the same `remove` as a cancellation.
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
//! - The all-or-nothing models drive [`AllocSet`], a copy of `Wait::poll` with `AllocateAll`'s
//!   attempt (take every piece or give back what was taken), against the real queue and its
//!   `quietly`: the head's give-back must not wake the head itself (else it polls itself in a
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
// The fake resource, the queue under test, and `Allocate::poll`.
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
}

type Real = waiters::MemoryWaiters;

/// Bugs planted in [`Alloc`] (the copy of `Allocate::poll`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum PollBug {
    None,
    /// No retry after registering as first in line.
    NoRetry,
    /// The first try ignores the queue (`is_empty`), taking memory ahead of earlier waiters.
    Barging,
}

/// `Allocate`: the same calls to the queue in the same order as `Allocate::poll` and its Drop.
struct Alloc<'a, Q: Queue> {
    memory: &'a dyn TryTake,
    waiters: &'a Q,
    bytes: usize,
    id: Option<u64>,
    bug: PollBug,
    /// How it was served, once it was: for the models' path counts.
    served: Option<&'static str>,
}

/// Served by the first try (nobody waiting), by the retry after registering as first, or by
/// the retry of a queued waiter woken with the baton.
const FAST: &str = "fast";
const RETRY: &str = "retry after register";
const BATON: &str = "baton";

impl<'a, Q: Queue> Alloc<'a, Q> {
    fn new(memory: &'a dyn TryTake, waiters: &'a Q, bug: PollBug) -> Self {
        Alloc {
            memory,
            waiters,
            bytes: N,
            id: None,
            bug,
            served: None,
        }
    }

    fn leave(&mut self, served: bool) {
        if let Some(id) = self.id.take() {
            self.waiters.remove(id, served);
        }
    }
}

impl<Q: Queue> Future for Alloc<'_, Q> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let waiters = this.waiters;
        // The common case, kept to one try: not queued, nobody waiting.
        // (Its failure here is out of memory within what the resource could hold: worth
        // waiting.)
        if this.id.is_none()
            && (this.bug == PollBug::Barging || waiters.is_empty())
            && this.memory.try_take(this.bytes)
        {
            this.served = Some(FAST);
            return Poll::Ready(());
        }
        let try_now = match this.id {
            // Not queued and the try above failed, or others wait (FIFO: queue behind them).
            None => false,
            // Queued: try when woken with the baton.
            Some(id) => waiters.poll_entry(id, cx.waker()).unwrap_or(true),
        };
        if try_now && this.memory.try_take(this.bytes) {
            this.served = Some(BATON);
            this.leave(true);
            return Poll::Ready(());
        }
        if this.id.is_none() {
            let (id, first) = waiters.register(this.bytes, cx.waker());
            this.id = Some(id);
            // Memory freed between our failed try and the registration notified nobody: try
            // once more if we are first in line.
            if first && this.bug != PollBug::NoRetry && this.memory.try_take(this.bytes) {
                this.served = Some(RETRY);
                this.leave(true);
                return Poll::Ready(());
            }
        }
        Poll::Pending
    }
}

impl<Q: Queue> Drop for Alloc<'_, Q> {
    fn drop(&mut self) {
        // Cancelled while waiting: leave the queue, passing on a wakeup we may have been given.
        self.leave(false);
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
