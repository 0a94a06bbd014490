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

// ---------------------------------------------------------------------------------------------
// The models.
// ---------------------------------------------------------------------------------------------

/// One waiter, no memory; another thread frees enough for it. The free may come before the
/// waiter's first try, between its try and its registration (nobody to notify: the retry after
/// registering must find it), or after it registered (`notify` must wake it).
fn wake_on_free<Q: Queue>(bug: PollBug, seen: &Seen) {
    let waiters = Arc::new(Q::new());
    let memory = Arc::new(Memory::new(0));
    let freer = {
        let (waiters, memory) = (waiters.clone(), memory.clone());
        thread::spawn(move || memory.give(N, &*waiters))
    };
    let mut a = Alloc::new(&*memory, &*waiters, bug);
    block_on(&mut a);
    seen.note(a.served.expect("served"), true);
    drop(a);
    freer.join().unwrap();
    settled(&*waiters, &memory, 0);
}

/// Two waiters, A registered before B; memory for one comes back. A must be served first: it
/// then frees its block, which B gets. (`order` records who was served, in order.)
fn fifo<Q: Queue>(bug: PollBug, seen: &Seen) {
    let waiters = Arc::new(Q::new());
    let memory = Arc::new(Memory::new(0));
    let order = Arc::new(Mutex::new(Vec::new()));

    // A registers first (its try fails: nothing is free yet).
    let (_, waker) = CountingWaker::new();
    let mut a = Alloc::new(&*memory, &*waiters, bug);
    assert!(poll_once(&mut a, &waker).is_pending());
    let a_id = a.id.take().expect("A is queued");
    drop(a);

    let first = {
        let (waiters, memory, order) = (waiters.clone(), memory.clone(), order.clone());
        thread::spawn(move || {
            // The same waiter, now awaited on its own thread with another waker.
            let mut a = Alloc::new(&*memory, &*waiters, bug);
            a.id = Some(a_id);
            block_on(&mut a);
            order.lock().push("A");
            memory.give(N, &*waiters);
        })
    };
    let freer = {
        let (waiters, memory) = (waiters.clone(), memory.clone());
        thread::spawn(move || memory.give(N, &*waiters))
    };
    let mut b = Alloc::new(&*memory, &*waiters, bug);
    block_on(&mut b);
    seen.note(b.served.expect("served"), true);
    drop(b);
    order.lock().push("B");
    memory.give(N, &*waiters);

    first.join().unwrap();
    freer.join().unwrap();
    assert_eq!(
        *order.lock(),
        ["A", "B"],
        "not served first come, first served"
    );
    settled(&*waiters, &memory, N);
}

/// A waiter X is polled `polls` times on its own thread (0: dropped before it ever registers;
/// 1: dropped while queued, holding the baton if the free came first; 2: dropped after a
/// second poll, its retry with the baton) and then dropped, while another thread frees memory
/// for one and a waiter B awaits on this thread. If X got the memory, it frees it again. B must
/// be served whatever X did: a notification X took is passed on when X leaves.
fn cancel<Q: Queue>(polls: usize, seen: &Shared<Seen>) {
    let waiters = Arc::new(Q::new());
    let memory = Arc::new(Memory::new(0));
    let cancelled = {
        let (waiters, memory, seen) = (waiters.clone(), memory.clone(), seen.clone());
        thread::spawn(move || {
            let (counter, waker) = CountingWaker::new();
            let mut x = Alloc::new(&*memory, &*waiters, PollBug::None);
            for _ in 0..polls {
                if poll_once(&mut x, &waker).is_ready() {
                    memory.give(N, &*waiters);
                    break;
                }
            }
            seen.note(WOKEN_THEN_CANCELLED, x.id.is_some() && counter.wakes() > 0);
            drop(x);
        })
    };
    let freer = {
        let (waiters, memory) = (waiters.clone(), memory.clone());
        thread::spawn(move || memory.give(N, &*waiters))
    };
    let mut b = Alloc::new(&*memory, &*waiters, PollBug::None);
    block_on(&mut b);
    seen.note(b.served.expect("served"), true);
    drop(b);
    memory.give(N, &*waiters);
    cancelled.join().unwrap();
    freer.join().unwrap();
    settled(&*waiters, &memory, N);
}

/// X was woken (a notification: it held the baton then) and was dropped while queued.
const WOKEN_THEN_CANCELLED: &str = "X woken, then cancelled";

/// Exhaustive (no preemption bound). Every way to be served is taken.
#[test]
fn wake_on_free_one_waiter() {
    check_paths(None, &[FAST, RETRY, BATON], |seen| {
        wake_on_free::<Real>(PollBug::None, seen)
    });
}

/// Bound 3: 3 threads.
#[test]
fn fifo_two_waiters() {
    check_paths(Some(4), &[BATON], |seen| fifo::<Real>(PollBug::None, seen));
}

/// Bound 3: 3 threads; one run per cancellation point. Dropped after a poll, X is dropped
/// holding a notification in some executions, and B is served by the baton it passed on.
#[test]
fn cancel_at_every_point() {
    for polls in 0..=2 {
        let paths: &[&str] = if polls == 0 {
            &[FAST, RETRY, BATON]
        } else {
            &[WOKEN_THEN_CANCELLED, BATON]
        };
        check_paths(Some(3), paths, move |seen| cancel::<Real>(polls, seen));
    }
}

// ---------------------------------------------------------------------------------------------
// LimitingAdaptor: its byte count (`Limit`, the real one) over the fake resource, with its own
// queue.
// ---------------------------------------------------------------------------------------------

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
    let mut w = Alloc::new(&*limited, &limited.waiters, PollBug::None);
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
    let mut w = Alloc::new(&*limited, &limited.waiters, PollBug::None);
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

// ---------------------------------------------------------------------------------------------
// All-or-nothing sets (`allocate_all_async`): a waiter needing several pieces at once, whose
// failed try gives back what it took, quietly when it is the head (`MemoryWaiters::quietly`).
// ---------------------------------------------------------------------------------------------

/// How a failed try of a set gives back the pieces it took.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum GiveBack {
    /// src's: quietly when the head (trying with the baton, or retrying after registering
    /// first), loudly on a fresh try.
    HeadQuiet,
    /// Planted: always loudly (the head wakes itself with its own give-back, in a loop).
    Loud,
    /// Planted: always quietly (a fresh try's give-back does not wake the head it made fail).
    Quiet,
}

/// `AllocateAll`: the calls of `Wait::poll` (src/resource/allocate.rs) with the attempt of
/// `AllocateAll` (src/resource/allocate_all.rs): `pieces` blocks of N, all or none.
struct AllocSet<'a> {
    memory: &'a Memory,
    waiters: &'a Real,
    pieces: usize,
    id: Option<u64>,
    give_back: GiveBack,
    /// Tries so far, and the most the model allows (as for `Limited`: a waiter that wakes
    /// itself tries again and again; loom's `block_on` also polls spuriously, so polls cannot
    /// be counted instead).
    tries: std::sync::atomic::AtomicUsize,
    max_tries: usize,
}

impl<'a> AllocSet<'a> {
    fn new(memory: &'a Memory, waiters: &'a Real, pieces: usize, give_back: GiveBack) -> Self {
        AllocSet {
            memory,
            waiters,
            pieces,
            id: None,
            give_back,
            tries: std::sync::atomic::AtomicUsize::new(0),
            max_tries: usize::MAX,
        }
    }

    /// One try at the whole set; `head`: `Attempt::Head` (quiet give-back in src).
    fn attempt(&self, head: bool) -> bool {
        let tries = 1 + self
            .tries
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        assert!(
            tries <= self.max_tries,
            "tried {tries} times: it woke itself"
        );
        let mut got = 0;
        while got < self.pieces && self.memory.try_take(N) {
            got += 1;
        }
        if got == self.pieces {
            return true;
        }
        let undo = || {
            for _ in 0..got {
                self.memory.give(N, self.waiters);
            }
        };
        match (self.give_back, head) {
            (GiveBack::HeadQuiet, true) | (GiveBack::Quiet, _) => self.waiters.quietly(undo),
            (GiveBack::HeadQuiet, false) | (GiveBack::Loud, _) => undo(),
        }
        false
    }

    fn leave(&mut self, served: bool) {
        if let Some(id) = self.id.take() {
            Queue::remove(self.waiters, id, served);
        }
    }
}

impl Future for AllocSet<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let waiters = this.waiters;
        if this.id.is_none() && Queue::is_empty(waiters) && this.attempt(false) {
            return Poll::Ready(());
        }
        let try_now = match this.id {
            None => None,
            Some(id) => match Queue::poll_entry(waiters, id, cx.waker()) {
                Some(true) => Some(true),
                Some(false) => None,
                None => Some(false),
            },
        };
        if let Some(head) = try_now {
            if this.attempt(head) {
                this.leave(true);
                return Poll::Ready(());
            }
        }
        if this.id.is_none() {
            let (id, first) = Queue::register(waiters, this.pieces * N, cx.waker());
            this.id = Some(id);
            if first && this.attempt(true) {
                this.leave(true);
                return Poll::Ready(());
            }
        }
        Poll::Pending
    }
}

impl Drop for AllocSet<'_> {
    fn drop(&mut self) {
        self.leave(false);
    }
}

/// N free; another N held, freed by F. W needs 2N, all or none: each of its failed tries takes
/// one N and gives it back. W must be served after three tries at most (its first, its retry
/// after registering first, its try with the baton F's free gives): its own give-backs must
/// not wake it.
fn set_head_does_not_wake_itself(give_back: GiveBack) {
    let waiters = Arc::new(Real::new());
    let memory = Arc::new(Memory::new(N));
    let f = {
        let (waiters, memory) = (waiters.clone(), memory.clone());
        thread::spawn(move || memory.give(N, &*waiters))
    };
    let mut w = AllocSet::new(&memory, &waiters, 2, give_back);
    w.max_tries = 3;
    block_on(&mut w);
    drop(w);
    f.join().unwrap();
    memory.give(2 * N, &*waiters);
    settled(&*waiters, &memory, 2 * N);
}

/// 2N free; X and Y each need 2N, all or none, and free it once served. Their tries can
/// interleave so that each takes one N and both fail; then whoever is queued must be woken by
/// the other's give-back (a fresh try gives back loudly), and both are served.
fn two_sets_share_the_memory(give_back: GiveBack, seen: &Shared<Seen>) {
    let waiters = Arc::new(Real::new());
    let memory = Arc::new(Memory::new(2 * N));
    let x = {
        let (waiters, memory, seen) = (waiters.clone(), memory.clone(), seen.clone());
        thread::spawn(move || {
            let mut x = AllocSet::new(&memory, &waiters, 2, give_back);
            block_on(&mut x);
            seen.note(
                SET_RETRIED,
                x.tries.load(std::sync::atomic::Ordering::Relaxed) > 1,
            );
            drop(x);
            memory.give(2 * N, &*waiters);
        })
    };
    let mut y = AllocSet::new(&memory, &waiters, 2, give_back);
    block_on(&mut y);
    seen.note(
        SET_RETRIED,
        y.tries.load(std::sync::atomic::Ordering::Relaxed) > 1,
    );
    drop(y);
    memory.give(2 * N, &*waiters);
    x.join().unwrap();
    settled(&*waiters, &memory, 2 * N);
}

/// A set was tried more than once: its first try failed (the other held part of the memory).
const SET_RETRIED: &str = "a set tried more than once";

/// Exhaustive.
#[test]
fn set_head_gives_back_without_waking_itself() {
    check_paths(None, &[], |_| {
        set_head_does_not_wake_itself(GiveBack::HeadQuiet)
    });
}

/// Bound 3: 2 threads.
#[test]
fn two_sets_both_served() {
    check_paths(Some(3), &[SET_RETRIED], |seen| {
        two_sets_share_the_memory(GiveBack::HeadQuiet, seen)
    });
}

/// Bug: the head gives back loudly, waking itself: it tries again and again while F has not
/// freed.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_set_give_back_always_loud() {
    must_fail(
        module_path!(),
        "planted_set_give_back_always_loud",
        "woke itself",
        || {
            check_paths(Some(2), &[], |_| {
                set_head_does_not_wake_itself(GiveBack::Loud)
            })
        },
    );
}

/// Bug: a fresh try gives back quietly too. Y, queued first, failed its retry because X held
/// one N; X's fresh try then fails and gives its N back without waking Y; X queues behind Y
/// without trying: both wait, with all the memory free.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_set_give_back_always_quiet() {
    must_fail(
        module_path!(),
        "planted_set_give_back_always_quiet",
        "deadlock",
        || {
            check_paths(Some(3), &[], |seen| {
                two_sets_share_the_memory(GiveBack::Quiet, seen)
            })
        },
    );
}

// ---------------------------------------------------------------------------------------------
// Planted bugs: in the copy of `Allocate::poll` (`PollBug`), or in a copy of `MemoryWaiters`
// with one bug switched on (`planted::Waiters`).
// ---------------------------------------------------------------------------------------------

/// Sanity: the copy of the queue with no bug passes the models the real queue passes.
#[test]
#[ignore = "checks the planted copy itself; run with --ignored"]
fn planted_none_passes() {
    type Q = planted::Waiters<{ planted::NONE }>;
    check_paths(None, &[FAST, RETRY, BATON], |seen| {
        wake_on_free::<Q>(PollBug::None, seen)
    });
    check_paths(Some(3), &[BATON], |seen| fifo::<Q>(PollBug::None, seen));
    for polls in 0..=2 {
        check_paths(Some(3), &[BATON], move |seen| cancel::<Q>(polls, seen));
    }
}

/// Bug: `Allocate::poll` registers without trying again: a free between the failed try and the
/// registration notified nobody.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_no_retry_after_register() {
    must_fail(
        module_path!(),
        "planted_no_retry_after_register",
        "deadlock",
        || {
            check_paths(None, &[], |seen| {
                wake_on_free::<Real>(PollBug::NoRetry, seen)
            })
        },
    );
}

/// Bug: `remove` does not pass the baton to the next waiter when the first leaves.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_no_baton_hand_off() {
    must_fail(
        module_path!(),
        "planted_no_baton_hand_off",
        "deadlock",
        || {
            check_paths(Some(3), &[], |seen| {
                cancel::<planted::Waiters<{ planted::NO_HAND_OFF }>>(1, seen)
            })
        },
    );
}

/// Bug: no SeqCst fences in `register` and `notify`: the waiter's retry and the free's `notify`
/// can each miss the other's write (store buffering).
#[test]
#[ignore = "planted bug: must fail"]
fn planted_no_fences() {
    must_fail(module_path!(), "planted_no_fences", "deadlock", || {
        check_paths(None, &[], |seen| {
            wake_on_free::<planted::Waiters<{ planted::NO_FENCES }>>(PollBug::None, seen)
        })
    });
}

/// Bug: the first try of a new waiter ignores the queue (takes memory ahead of earlier
/// waiters).
#[test]
#[ignore = "planted bug: must fail"]
fn planted_barging() {
    must_fail(
        module_path!(),
        "planted_barging",
        "not served first come, first served",
        || check_paths(Some(3), &[], |seen| fifo::<Real>(PollBug::Barging, seen)),
    );
}

/// A copy of src/resource/waiters.rs's `MemoryWaiters` (the queue, not the statistics) with
/// switchable bugs. `NONE` is the same logic as the real one.
mod planted {
    use std::collections::VecDeque;
    use std::task::Waker;

    use crate::sync::{fence, AtomicUsize, Mutex, Ordering};

    pub(crate) const NONE: u8 = 0;
    /// `remove` does not wake the next waiter when the first leaves.
    pub(crate) const NO_HAND_OFF: u8 = 1;
    /// `register` and `notify` without their SeqCst fences.
    pub(crate) const NO_FENCES: u8 = 2;

    struct Entry {
        id: u64,
        waker: Waker,
        notified: bool,
    }

    #[derive(Default)]
    struct Queue {
        entries: VecDeque<Entry>,
        next_id: u64,
    }

    pub(crate) struct Waiters<const BUG: u8> {
        queue: Mutex<Queue>,
        len: AtomicUsize,
    }

    impl<const BUG: u8> super::Queue for Waiters<BUG> {
        fn new() -> Self {
            Waiters {
                queue: Mutex::new(Queue::default()),
                len: AtomicUsize::new(0),
            }
        }

        fn notify(&self) {
            if BUG != NO_FENCES {
                fence(Ordering::SeqCst);
            }
            if self.len.load(Ordering::Relaxed) == 0 {
                return;
            }
            let waker = {
                let mut queue = self.queue.lock();
                match queue.entries.front_mut() {
                    Some(head) if !head.notified => {
                        head.notified = true;
                        Some(head.waker.clone())
                    }
                    _ => None,
                }
            };
            if let Some(waker) = waker {
                waker.wake();
            }
        }

        fn is_empty(&self) -> bool {
            self.len.load(Ordering::Acquire) == 0
        }

        fn register(&self, _bytes: usize, waker: &Waker) -> (u64, bool) {
            let mut queue = self.queue.lock();
            let id = queue.next_id;
            queue.next_id += 1;
            queue.entries.push_back(Entry {
                id,
                waker: waker.clone(),
                notified: false,
            });
            self.len.fetch_add(1, Ordering::Release);
            if BUG != NO_FENCES {
                fence(Ordering::SeqCst);
            }
            (id, queue.entries.len() == 1)
        }

        fn poll_entry(&self, id: u64, waker: &Waker) -> Option<bool> {
            let mut queue = self.queue.lock();
            let entry = queue.entries.iter_mut().find(|e| e.id == id)?;
            if !entry.waker.will_wake(waker) {
                entry.waker = waker.clone();
            }
            Some(std::mem::replace(&mut entry.notified, false))
        }

        fn remove(&self, id: u64, _served: bool) {
            let next = {
                let mut queue = self.queue.lock();
                let Some(at) = queue.entries.iter().position(|e| e.id == id) else {
                    return;
                };
                queue.entries.remove(at);
                self.len.fetch_sub(1, Ordering::Release);
                if at == 0 && BUG != NO_HAND_OFF {
                    queue.entries.front_mut().map(|next| {
                        next.notified = true;
                        next.waker.clone()
                    })
                } else {
                    None
                }
            };
            if let Some(waker) = next {
                waker.wake();
            }
        }
    }
}
