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
//!   (`resource::wait::planted`), as are the queue's (`resource::waiters::planted`). Deadlines
//!   are left out: a timeout leaves the queue through the same `remove` as a cancellation.
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
//! - The nested models (`nested.rs`) stack two such limits, the lower queue relaying to the
//!   upper one as `LimitingAdaptor::new` sets up: a request the lower limit refused is woken
//!   by a free through the lower limit alone, and by the lower limit's rollback that refused
//!   it.
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

use loom::future::block_on;
use loom::thread;

use super::{check_paths, must_fail, CountingWaker, Seen, Shared};
use crate::sync::{Arc, AtomicUsize, Mutex, Ordering};

/// The crate's own waiting state machine (src/resource/wait.rs), which `Allocate::poll` runs.
use crate::resource::wait::{Attempt, Wait};
/// The crate's own queue (src/resource/waiters.rs; see the module doc).
use crate::resource::waiters;

// The models by what they drive, each file with its default and planted `#[test]`s.
mod limiting;
mod nested;
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
    fn give(&self, bytes: usize, waiters: &Real) {
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

    /// `allocate` as a resource answers it: `bytes` taken, or out of memory within what the
    /// resource could hold (worth waiting for).
    fn take_or_refuse(&self, bytes: usize) -> crate::Result<()> {
        if self.try_take(bytes) {
            Ok(())
        } else {
            Err(crate::Error::OutOfMemory {
                requested: bytes,
                available: 0,
                maximum: MAXIMUM,
            })
        }
    }
}

impl TryTake for Memory {
    fn try_take(&self, bytes: usize) -> bool {
        Memory::try_take(self, bytes)
    }
}

/// The queue: the crate's own.
type Real = waiters::MemoryWaiters;

/// `Allocate`: the crate's own `Wait::poll` (src/resource/wait.rs, the whole state machine of
/// `Allocate::poll` but for the zero-byte shortcut and the resource call), with an attempt that
/// takes from the fake resource, and `Wait::cancel` on drop as `Allocate`'s Drop does. Its
/// bugs, and the queue's, are switches in src (`resource::wait::planted`,
/// `resource::waiters::planted`).
struct Alloc<'a> {
    memory: &'a dyn TryTake,
    waiters: &'a Real,
    /// The real state machine (its `id` is the place in the queue).
    wait: Wait,
    /// How it was served, once it was: for the models' path counts.
    served: Option<&'static str>,
}

/// Served by the first try (nobody waiting), by the retry after registering as first, or by
/// the retry of a queued waiter woken with the baton.
const FAST: &str = "fast";
const RETRY: &str = "retry after register";
const BATON: &str = "baton";

impl<'a> Alloc<'a> {
    fn new(memory: &'a dyn TryTake, waiters: &'a Real) -> Self {
        Alloc {
            memory,
            waiters,
            wait: Wait::new(N),
            served: None,
        }
    }

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
                memory.take_or_refuse(N)
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

impl Future for Alloc<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.get_mut().poll_real(cx)
    }
}

impl Drop for Alloc<'_> {
    fn drop(&mut self) {
        // `Allocate`'s Drop: cancelled while waiting, leave the queue, passing on a wakeup we
        // may have been given.
        self.wait.cancel(Some(self.waiters))
    }
}

/// Polls `future` once with `waker`.
fn poll_once<F: Future + Unpin>(future: &mut F, waker: &Waker) -> Poll<F::Output> {
    Pin::new(future).poll(&mut Context::from_waker(waker))
}

/// After every thread is done: nobody waits, and every byte is back.
fn settled(waiters: &Real, memory: &Memory, bytes: usize) {
    assert!(waiters.is_empty(), "a waiter was left behind in the queue");
    assert_eq!(memory.free(), bytes, "bytes lost or made up");
}
