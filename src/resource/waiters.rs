//! The memory waiters queue behind `allocate_async`: tasks that wait for memory instead of
//! failing, served first come, first served.
//!
//! Protocol (the loom models in `loom-tests/waiters/` check it):
//! - a task whose allocation failed registers, then **tries once more** if it is first in line:
//!   memory freed between its failed try and its registration found nobody to notify;
//! - a free calls [`MemoryWaiters::notify`]: the first waiter is marked notified (it holds the
//!   *baton*) and woken; with nobody waiting this costs one atomic load;
//! - the woken first waiter tries again. On success it leaves and passes the baton to the next
//!   (memory may be left for it too); on failure it keeps its place and waits for the next free;
//! - a waiter that leaves while first in line (success, cancellation, timeout) wakes the next:
//!   memory too small for it may be enough for the next one. So a notification is never
//!   swallowed by a dropped future.
//!
//! - a waiter that takes memory and gives it back within one try (`allocate_all_async`: part
//!   of its set fitted, the rest did not) does so through the resource's `deallocate`, which
//!   notifies. If the head did that loudly it would wake itself, try again at once and fail
//!   again, in a loop while the memory stays short. So the head gives back *quietly*
//!   ([`MemoryWaiters::quietly`]): its own thread's notifications of this queue are dropped
//!   for the length of the give-back. Nobody else can miss them: every other queued waiter
//!   is behind the head and gets the baton when the head leaves, and frees on other threads
//!   notify as always. A waiter that is not queued (its first try) gives back loudly: the head
//!   may have failed because of what it held.
//!
//! - a resource stacked over another that has its own queue (a limiting adaptor over a pool,
//!   or over another limit) can be refused *below*, where frees notify the lower queue, not
//!   its own. So the lower queue *relays* every notification to the queues registered above it
//!   ([`MemoryWaiters::relay_to`]): memory that comes back below reaches a request waiting
//!   above, whichever path it was freed through. (A review found a request refused by a lower
//!   limit asleep until its deadline while the lower limit's frees woke only the lower queue.)
//!
//! Policy: strict FIFO. While anyone waits, a new `allocate_async` queues behind them even if
//! its request would fit now; so a large request is never starved by small ones that keep
//! fitting, at the price of small requests waiting behind a large head. (Synchronous
//! `allocate` never waits, so it does not queue.)

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::task::Waker;
use std::time::{Duration, Instant};

use crate::sync::plain::{Arc as StdArc, RwLock};
use crate::sync::{fence, AtomicBool, AtomicU64, AtomicUsize, Mutex, Ordering};

crate::sync::thread_local! {
    /// The queue (its address) whose notifications from this thread are dropped: set by
    /// [`MemoryWaiters::quietly`] for the length of a head waiter's give-back; 0 for none.
    // loom's `thread_local!` takes no `const { }` initializer.
    #[allow(clippy::missing_const_for_thread_local)]
    static QUIET: Cell<usize> = Cell::new(0);
    /// The queue (its address) whose notifications from this thread are held back, and
    /// whether one came: set by [`MemoryWaiters::deferring`] while a resource calls its
    /// upstream under a lock of its own; `(0, false)` for none.
    #[allow(clippy::missing_const_for_thread_local)]
    static DEFER: Cell<(usize, bool)> = Cell::new((0, false));
    /// The wakers of other queues' heads, notified on this thread while it held a queue's
    /// notifications back ([`MemoryWaiters::deferring`]): woken once it holds none, by the
    /// outermost request's [`TellHeldBack`]. A pool over a pool grows under its `slow` through
    /// the inner pool's `allocate`, which may tell the inner pool's own waiters (a growth of
    /// its own that gave chunks back); a waker is the executor's code, and a task it polls
    /// there that asks the outer pool for memory waited for ever on the lock its own thread
    /// held. `deferring` held back only the one queue it was called for.
    #[allow(clippy::missing_const_for_thread_local)]
    static STASH: RefCell<Vec<Waker>> = RefCell::new(Vec::new());
}

/// How many wakers wait in threads' [`STASH`]es: a request's [`TellHeldBack`] reads this one
/// word, not its thread-local, when nothing was stashed anywhere (nearly always). Only the
/// thread that stashed drains its stash, and its own writes are in its program order, so a
/// relaxed count suffices; another thread reading it stale looks at its own empty stash.
static STASHED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Wakes `waker` now, or, if this thread holds a queue's notifications back
/// ([`MemoryWaiters::deferring`]), when it no longer does (see [`STASH`]).
fn wake_or_stash(waker: Waker) {
    let deferring = DEFER.try_with(|d| d.get().0 != 0).unwrap_or(false);
    let mut waker = Some(waker);
    if deferring {
        // Without the thread-local (a thread being torn down) the wake is at once, as before.
        let _ = STASH.try_with(|stash| {
            if let Some(waker) = waker.take() {
                stash.borrow_mut().push(waker);
                STASHED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        });
    }
    if let Some(waker) = waker {
        wake(waker);
    }
}

/// Wakes `waker`. While a panic unwinds (a notification from a guard that gives memory back
/// as an upstream's panic passes: `TellHeldBack`, the limiting adaptor's rollback, a pool's
/// give-back of what is left), a waker that panicked too would abort the process, a panic in
/// a drop during a panic: its panic is dropped instead, and the first one goes on. The waiter
/// it belonged to is the executor's to account for.
fn wake(waker: Waker) {
    if !std::thread::panicking() {
        waker.wake();
        return;
    }
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| waker.wake()));
}

/// Wakes what this thread stashed ([`STASH`]), unless it still holds a queue back (an inner
/// request's guard inside an outer growth: the outer request's guard tells them).
fn wake_stashed() {
    if STASHED.load(std::sync::atomic::Ordering::Relaxed) == 0 {
        return;
    }
    if DEFER.try_with(|d| d.get().0 != 0).unwrap_or(false) {
        return;
    }
    let wakers = STASH
        .try_with(|stash| std::mem::take(&mut *stash.borrow_mut()))
        .unwrap_or_default();
    if wakers.is_empty() {
        return;
    }
    STASHED.fetch_sub(wakers.len(), std::sync::atomic::Ordering::Relaxed);
    if planted!(STASH_DROPS) {
        return;
    }
    // Every one woken even if one panics (a waker is the executor's code); the first panic
    // then goes on, unless a panic already unwinds (a second one would abort the process).
    let mut first_panic = None;
    for waker in wakers {
        let woken = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| waker.wake()));
        if let Err(panic) = woken {
            first_panic.get_or_insert(panic);
        }
    }
    if let Some(panic) = first_panic.filter(|_| !std::thread::panicking()) {
        std::panic::resume_unwind(panic);
    }
}

struct Entry {
    id: u64,
    bytes: usize,
    waker: Waker,
    /// Holds the baton: woken to try again.
    notified: bool,
}

#[derive(Default)]
struct Queue {
    entries: VecDeque<Entry>,
    next_id: u64,
}

/// The waiters of one resource, and what waiting has cost.
pub struct MemoryWaiters {
    queue: Mutex<Queue>,
    /// Entries in the queue, readable without the lock: a free with nobody waiting checks only
    /// this.
    len: AtomicUsize,
    bytes_waiting: AtomicUsize,
    waits: AtomicU64,
    wait_ns: AtomicU64,
    max_wait_ns: AtomicU64,
    timeouts: AtomicU64,
    /// The smallest maximum known for the requests that wait here (0: none yet): those that
    /// out-of-memory errors which made a request wait reported, and the one a resource noted
    /// itself (the limiting adaptor, its limit). A newcomer that finds others waiting queues
    /// behind them without a try, and one larger than this fails at once instead. A queue
    /// shared by layers (an adaptor's over its upstream's) hears of several: each bounds what
    /// any request waiting here can get, so the smallest is the tightest true bound. (A review
    /// found the last one kept: a wait the upstream caused put the upstream's larger maximum
    /// in place of a limit, and a request above the limit queued.) Std's: a single word.
    maximum: std::sync::atomic::AtomicUsize,
    /// The queues of the resources stacked above this one that can be refused here (see
    /// [`relay_to`](Self::relay_to)): every notification of this queue is theirs too. Std's
    /// lock, not loom's: it changes only when such a resource is made or dropped, when nobody
    /// can wait in its queue. Copy-on-write behind an `Arc`, so that a notification takes a
    /// snapshot and lets go of the lock before it wakes anyone (see
    /// [`notify_relays`](Self::notify_relays)).
    relays: RwLock<StdArc<Vec<StdArc<MemoryWaiters>>>>,
    /// Whether `relays` has any, readable without the lock: a queue with nothing above it (a
    /// pool used directly) pays one load per notification for them.
    has_relays: std::sync::atomic::AtomicBool,
    /// Run after each [`register`](Self::register), past its fence, outside the lock: set by
    /// a resource that must act when a request starts waiting (`CudaAsyncResource` records
    /// events behind the frees issued while nobody waited, so that the GPU reaching them
    /// wakes this request). Set once, before the queue is shared. A queue stacked over one
    /// with a hook ([`stacked_over`](Self::stacked_over)) runs that hook too: its requests
    /// wait for the memory below as much as that queue's own do (a limiting adaptor over a
    /// `CudaAsyncResource` refused by the driver).
    arrival: crate::sync::plain::OnceLock<StdArc<dyn Fn() + Send + Sync>>,
}

/// What waiting for memory has cost a resource.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WaitStats {
    /// Tasks waiting now.
    pub waiting: usize,
    /// Bytes they wait for.
    pub bytes_waiting: usize,
    /// Waits that ended with memory.
    pub waits: u64,
    /// Their total time.
    pub total_wait: Duration,
    /// The longest one.
    pub max_wait: Duration,
    /// Waits that ran past their deadline.
    pub timeouts: u64,
}

impl std::fmt::Debug for MemoryWaiters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryWaiters")
            .field("stats", &self.stats())
            .finish()
    }
}

impl Default for MemoryWaiters {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryWaiters {
    /// An empty queue.
    pub fn new() -> Self {
        Self {
            queue: Mutex::new(Queue::default()),
            len: AtomicUsize::new(0),
            bytes_waiting: AtomicUsize::new(0),
            waits: AtomicU64::new(0),
            wait_ns: AtomicU64::new(0),
            max_wait_ns: AtomicU64::new(0),
            timeouts: AtomicU64::new(0),
            maximum: std::sync::atomic::AtomicUsize::new(0),
            relays: RwLock::new(StdArc::new(Vec::new())),
            has_relays: std::sync::atomic::AtomicBool::new(false),
            arrival: crate::sync::plain::OnceLock::new(),
        }
    }

    /// Runs `hook` after every registration from now on (see the field `arrival`); a second
    /// hook is ignored. The hook may notify this queue, and must not register in it.
    pub(crate) fn on_arrival(&self, hook: StdArc<dyn Fn() + Send + Sync>) {
        let _ = self.arrival.set(hook);
    }

    /// From now on, every [`notify`](Self::notify) of this queue notifies `above` too: for a
    /// resource stacked over this queue's with a queue of its own (a limiting adaptor), whose
    /// requests this resource can refuse. Memory that comes back here, through whatever path,
    /// may serve them; without the relay they would wait for a free through their own resource.
    /// Call [`stop_relaying`](Self::stop_relaying) when that resource is dropped.
    pub(crate) fn relay_to(&self, above: &StdArc<MemoryWaiters>) {
        let mut relays = self.relays.write().unwrap_or_else(|e| e.into_inner());
        if !relays.iter().any(|r| StdArc::ptr_eq(r, above)) {
            StdArc::make_mut(&mut relays).push(above.clone());
        }
        self.has_relays
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Undoes [`relay_to`](Self::relay_to).
    pub(crate) fn stop_relaying(&self, above: &StdArc<MemoryWaiters>) {
        let mut relays = self.relays.write().unwrap_or_else(|e| e.into_inner());
        StdArc::make_mut(&mut relays).retain(|r| !StdArc::ptr_eq(r, above));
        self.has_relays
            .store(!relays.is_empty(), std::sync::atomic::Ordering::Release);
    }

    /// A new queue for a resource stacked over `upstream`, which relays to it if it has a
    /// queue of its own (see [`relay_to`](Self::relay_to)): a pool or an arena over a limiting
    /// adaptor, a limit over a pool or another limit. The resource calls
    /// [`unstack_from`](Self::unstack_from) with the same upstream when it is dropped.
    pub(crate) fn stacked_over<U: super::MemoryResource + ?Sized>(
        upstream: &U,
    ) -> StdArc<MemoryWaiters> {
        let queue = StdArc::new(MemoryWaiters::new());
        if let Some(below) = upstream.memory_waiters() {
            below.relay_to(&queue);
            // A request refused below and waiting here must start what a request arriving
            // below would (see the field `arrival`): without it, a free issued below while
            // nobody waited there never woke this queue once the GPU reached it.
            if let Some(hook) = below.arrival.get().filter(|_| !planted!(HOOK_NOT_STACKED)) {
                queue.on_arrival(hook.clone());
            }
        }
        queue
    }

    /// Undoes [`stacked_over`](Self::stacked_over): `upstream`'s queue stops relaying to
    /// `queue`, whose resource is going.
    pub(crate) fn unstack_from<U: super::MemoryResource + ?Sized>(
        queue: &StdArc<MemoryWaiters>,
        upstream: &U,
    ) {
        if let Some(below) = upstream.memory_waiters() {
            below.stop_relaying(queue);
        }
    }

    /// Notifies the queues this one relays to (see [`relay_to`](Self::relay_to)).
    fn notify_relays(&self) {
        if !self.has_relays.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        // A snapshot, and the lock let go before anyone is woken: a wake runs the waker's code,
        // which may drop a resource stacked over this queue, and its `stop_relaying` takes
        // this lock for writing. Held across the wakes (as it was), that deadlocked the free
        // that notified. A queue unstacked meanwhile may get one needless notification.
        let relays = StdArc::clone(&self.relays.read().unwrap_or_else(|e| e.into_inner()));
        for above in relays.iter() {
            above.notify();
        }
    }

    /// Notes a maximum of the requests that wait here: from an out-of-memory error that made a
    /// request wait, or a resource's own (see the field). Keeps the smallest; 0 says nothing.
    pub(crate) fn note_maximum(&self, maximum: usize) {
        if maximum == 0 {
            return;
        }
        let relaxed = std::sync::atomic::Ordering::Relaxed;
        let _ = (self.maximum).fetch_update(relaxed, relaxed, |known| {
            (known == 0 || maximum < known).then_some(maximum)
        });
    }

    /// The resource's maximum, if a request has waited here before.
    pub(crate) fn known_maximum(&self) -> Option<usize> {
        let maximum = self.maximum.load(std::sync::atomic::Ordering::Relaxed);
        (maximum > 0).then_some(maximum)
    }

    /// Memory came back to the resource: the first waiter tries again. Call it after every
    /// free (and whenever else memory may have become available). Cheap when nobody waits.
    pub fn notify(&self) {
        // Store buffering: a waiter writes `len` then reads the resource's state; a free writes
        // the state then reads `len`. Without a full fence on both sides each could miss the
        // other's write and the wakeup would be lost (the waiter's fence is in `register`).
        if !planted!(NO_FENCES) {
            fence(Ordering::SeqCst);
        }
        let waiting = self.len.load(Ordering::Relaxed) != 0;
        let relays = self.has_relays.load(std::sync::atomic::Ordering::Acquire);
        // Nobody to wake here or above: a free with nobody waiting costs a fence and two loads.
        if !waiting && !relays {
            return;
        }
        // Held back on this thread (`deferring`), the queues above with it: told once the
        // resource's lock is let go.
        if self.held_back() {
            return;
        }
        // The queues above first, and whatever this queue's own state: memory that came back
        // here may serve a request waiting there. Each does its own fence and checks.
        if relays {
            self.notify_relays();
        }
        if !waiting {
            return;
        }
        // The head giving back what its own try took (see the module doc). Read only when
        // someone waits, so a free with nobody waiting still costs one load.
        // `try_with`: a free from a thread-local's destructor (after QUIET is gone) is loud.
        if QUIET.try_with(|q| q.get()).unwrap_or(0) == self.addr() {
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
            wake_or_stash(waker);
        }
    }

    /// Runs `f` with the calling thread's notifications of this queue dropped: for the head
    /// waiter (first in line, trying with the baton or just after registering first) giving
    /// back the part of a set it could not complete (see the module doc). Never call it from
    /// anyone else: a waiter that is not the head would swallow a notification the head needs.
    pub(crate) fn quietly<T>(&self, f: impl FnOnce() -> T) -> T {
        /// Restores the previous mark, even if `f` panics.
        struct Restore(usize);
        impl Drop for Restore {
            fn drop(&mut self) {
                let _ = QUIET.try_with(|q| q.set(self.0));
            }
        }
        // Without the thread-local (a thread being torn down) the give-back is loud: at worst
        // one needless retry.
        let _restore = QUIET.try_with(|q| q.replace(self.addr())).ok().map(Restore);
        f()
    }

    /// Runs `f` (a resource's call to its upstream under a lock of its own, a growth under
    /// the engine's `slow`) with this thread's notifications of this queue, and of the queues
    /// above it, held back; if one came, `tell` is set (on unwind too), for the resource to
    /// [`notify`](Self::notify) once it holds no lock. The upstream's queue relays here: a
    /// free or a rollback inside its `allocate` notified this queue at once, and a waker is
    /// the executor's code, which may poll its task there and then; a task that asks this
    /// resource for memory on the slow path then waits for ever on the lock its own thread
    /// holds (a review found a pool over a pool at its maximum so, `tell_waiters` having
    /// covered only the pool's own notifications). Any other queue's waiter notified on this
    /// thread meanwhile (the inner pool's own, told by its request) is woken later too
    /// ([`STASH`]), by the outermost [`tell_held_back`](Self::tell_held_back) guard: so call
    /// this only inside a request that holds one.
    pub(crate) fn deferring<T>(&self, tell: &AtomicBool, f: impl FnOnce() -> T) -> T {
        /// Restores the previous mark, and sets `tell` if a notification came, even if `f`
        /// panics.
        struct Restore<'a> {
            previous: (usize, bool),
            tell: &'a AtomicBool,
        }
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                let came = DEFER.try_with(|d| d.replace(self.previous).1);
                if came.unwrap_or(false) && !planted!(DEFER_DROPS) {
                    self.tell.store(true, Ordering::Release);
                }
            }
        }
        // Without the thread-local (a thread being torn down) nothing is held back: the
        // notifications are told at once, as before.
        let previous = DEFER.try_with(|d| d.replace((self.addr(), false)));
        let _restore = previous.ok().map(|previous| Restore { previous, tell });
        f()
    }

    /// A guard for a resource's request: when it drops (the request over, or unwinding, after
    /// the resource's locks, which the request's inner frames hold and let go first), it tells
    /// this queue what a growth held back ([`deferring`](Self::deferring) set `tell`). Told by a
    /// line after the request instead, a notification held back when the upstream's
    /// `allocate` notified and then panicked was never told (a review's finding).
    pub(crate) fn tell_held_back<'a>(&'a self, tell: &'a AtomicBool) -> TellHeldBack<'a> {
        TellHeldBack {
            waiters: self,
            tell,
        }
    }

    /// Whether this thread holds this queue's notifications back ([`deferring`]); if so, notes
    /// that one came.
    ///
    /// [`deferring`]: Self::deferring
    fn held_back(&self) -> bool {
        DEFER
            .try_with(|d| {
                let (addr, _) = d.get();
                let mine = addr == self.addr();
                if mine {
                    d.set((addr, true));
                }
                mine
            })
            .unwrap_or(false)
    }

    /// Whether this thread is inside [`quietly`](Self::quietly) for this queue or for one it
    /// relays to ([`relay_to`](Self::relay_to)): a notify now would be dropped there. A
    /// resource that keeps a mark of refusals to wake someone later (the limiting adaptor)
    /// keeps it then: the give-back that would have woken the head is not the release that the
    /// mark is waiting for. (A lower limit that cleared its mark while the head of the queue
    /// above gave back quietly would leave that head asleep when a request it was refused
    /// because of rolls back.) Keeping a mark costs at most one needless wake-up later.
    pub(crate) fn is_quiet(&self) -> bool {
        let quiet = QUIET.try_with(|q| q.get()).unwrap_or(0);
        quiet != 0 && self.reaches(quiet)
    }

    /// Whether the queue at `addr` is this one or one this one relays to, transitively.
    fn reaches(&self, addr: usize) -> bool {
        if self.addr() == addr {
            return true;
        }
        if !self.has_relays.load(std::sync::atomic::Ordering::Acquire) {
            return false;
        }
        let relays = self.relays.read().unwrap_or_else(|e| e.into_inner());
        relays.iter().any(|above| above.reaches(addr))
    }

    /// This queue's identity for [`QUIET`]: its address, stable while it is borrowed.
    fn addr(&self) -> usize {
        self as *const Self as usize
    }

    /// True if anyone waits.
    pub fn is_empty(&self) -> bool {
        self.len.load(Ordering::Acquire) == 0
    }

    /// Whether anyone waits here or in a queue this one relays to, transitively (see
    /// [`relay_to`](Self::relay_to)): a request there can be refused by this queue's resource,
    /// and so waits for its memory too. The queue this thread gives back
    /// [`quietly`](Self::quietly) for, if any, is left out: its head is the one giving back,
    /// and must not be woken by it (a loop of failing tries), but a waiter in any other queue
    /// here or above must be (a review found `CudaAsyncResource` left one asleep whenever the
    /// quiet queue was merely reachable from its own).
    pub(crate) fn waits_but_the_quiet(&self) -> bool {
        self.waits_except(QUIET.try_with(|q| q.get()).unwrap_or(0))
    }

    /// Whether anyone waits here or above, in a queue other than the one at `quiet`.
    fn waits_except(&self, quiet: usize) -> bool {
        if self.addr() != quiet && !self.is_empty() {
            return true;
        }
        if !self.has_relays.load(std::sync::atomic::Ordering::Acquire) {
            return false;
        }
        // A snapshot, as `notify_relays` takes: no lock held while the queues above are read.
        let relays = StdArc::clone(&self.relays.read().unwrap_or_else(|e| e.into_inner()));
        relays.iter().any(|above| above.waits_except(quiet))
    }

    /// What waiting has cost so far.
    pub fn stats(&self) -> WaitStats {
        WaitStats {
            waiting: self.len.load(Ordering::Acquire),
            bytes_waiting: self.bytes_waiting.load(Ordering::Relaxed),
            waits: self.waits.load(Ordering::Relaxed),
            total_wait: Duration::from_nanos(self.wait_ns.load(Ordering::Relaxed)),
            max_wait: Duration::from_nanos(self.max_wait_ns.load(Ordering::Relaxed)),
            timeouts: self.timeouts.load(Ordering::Relaxed),
        }
    }

    /// Joins the end of the queue. Returns the entry's id and whether it is first in line.
    pub(crate) fn register(&self, bytes: usize, waker: &Waker) -> (u64, bool) {
        let mut queue = self.queue.lock();
        let id = queue.next_id;
        queue.next_id += 1;
        queue.entries.push_back(Entry {
            id,
            bytes,
            waker: waker.clone(),
            notified: false,
        });
        self.len.fetch_add(1, Ordering::Release);
        self.bytes_waiting.fetch_add(bytes, Ordering::Relaxed);
        // Pairs with the fence in `notify`: our retry after registering sees a free that missed
        // us, or that free sees us (see `notify`).
        if !planted!(NO_FENCES) {
            fence(Ordering::SeqCst);
        }
        let first = queue.entries.len() == 1;
        drop(queue);
        // After the fence: whatever a free wrote before its own fence and its load of `len`
        // found nobody (the hook reads it), the hook sees.
        if let Some(hook) = self.arrival.get() {
            hook();
        }
        (id, first)
    }

    /// For a queued entry: whether it holds the baton (clearing it: the caller is about to try),
    /// and stores the latest waker. `None` if the entry is gone.
    pub(crate) fn poll_entry(&self, id: u64, waker: &Waker) -> Option<bool> {
        let mut queue = self.queue.lock();
        let entry = queue.entries.iter_mut().find(|e| e.id == id)?;
        let old = (!entry.waker.will_wake(waker))
            .then(|| std::mem::replace(&mut entry.waker, waker.clone()));
        let notified = std::mem::replace(&mut entry.notified, false);
        // The replaced waker dropped after the lock: its drop is the executor's code, and may
        // drop a task whose future waits here too, whose drop leaves this queue (`remove`): a
        // review found that thread deadlocked on the queue's lock.
        drop(queue);
        drop(old);
        Some(notified)
    }

    /// Leaves the queue: `Some(waited)` after a successful wait, `None` after cancellation or a
    /// timeout. If it was first in line, the next waiter is woken to try (see the module doc).
    pub(crate) fn remove(&self, id: u64, outcome: Leave) {
        // The entry (its waker) is dropped after the lock (see `poll_entry`).
        let (next, _entry) = {
            let mut queue = self.queue.lock();
            let Some(at) = queue.entries.iter().position(|e| e.id == id) else {
                return;
            };
            let entry = queue
                .entries
                .remove(at)
                .expect("found above under the lock");
            self.len.fetch_sub(1, Ordering::Release);
            self.bytes_waiting.fetch_sub(entry.bytes, Ordering::Relaxed);
            // (The planted bug: the baton is not passed on.)
            let next = if at == 0 && !planted!(NO_HAND_OFF) {
                queue.entries.front_mut().map(|next| {
                    next.notified = true;
                    next.waker.clone()
                })
            } else {
                None
            };
            (next, entry)
        };
        match outcome {
            Leave::Served(waited) => {
                let ns = waited.as_nanos().min(u64::MAX as u128) as u64;
                self.waits.fetch_add(1, Ordering::Relaxed);
                self.wait_ns.fetch_add(ns, Ordering::Relaxed);
                self.max_wait_ns.fetch_max(ns, Ordering::Relaxed);
            }
            Leave::TimedOut => {
                self.timeouts.fetch_add(1, Ordering::Relaxed);
            }
            Leave::Cancelled => {}
        }
        if let Some(waker) = next {
            wake_or_stash(waker);
        }
    }
}

/// Why a waiter leaves the queue.
pub(crate) enum Leave {
    Served(Duration),
    TimedOut,
    Cancelled,
}

/// The start of a wait, for its statistics.
pub(crate) fn now() -> Instant {
    Instant::now()
}

/// See [`MemoryWaiters::tell_held_back`].
pub(crate) struct TellHeldBack<'a> {
    waiters: &'a MemoryWaiters,
    tell: &'a AtomicBool,
}

impl Drop for TellHeldBack<'_> {
    fn drop(&mut self) {
        // Other queues' wakers this request's growth notified: woken now, the locks let go
        // (the outermost request's guard, if this one ran inside another's growth).
        wake_stashed();
        // A load first: the fast path writes nothing shared.
        if !(self.tell.load(Ordering::Relaxed) && self.tell.swap(false, Ordering::AcqRel)) {
            return;
        }
        // Also while the upstream's panic unwinds: a waker's panic then is caught (`wake`).
        self.waiters.notify();
    }
}

/// Bugs the loom models plant (`loom-tests/waiters/queue.rs`, `nested.rs`), constant off
/// otherwise; read through `planted!`.
#[cfg(streamalloc_loom)]
pub(crate) mod planted {
    use std::sync::atomic::AtomicBool;

    /// `remove` does not wake the next waiter when the first leaves: a notification the
    /// leaving head held is swallowed.
    pub(crate) static NO_HAND_OFF: AtomicBool = AtomicBool::new(false);
    /// `register` and `notify` without their SeqCst fences: the waiter's retry and the free's
    /// `len` load can each miss the other's write (store buffering).
    pub(crate) static NO_FENCES: AtomicBool = AtomicBool::new(false);
    /// `stacked_over` does not pass the arrival hook of the queue below to the new queue: a
    /// request waiting above never starts what one arriving below would.
    pub(crate) static HOOK_NOT_STACKED: AtomicBool = AtomicBool::new(false);
    /// `deferring` drops the notifications it held back instead of setting `tell`: the
    /// waiters of a resource whose growth's upstream freed memory are never told.
    pub(crate) static DEFER_DROPS: AtomicBool = AtomicBool::new(false);
    /// The wakers stashed while a thread held another queue back are dropped instead of woken
    /// when it lets go: an inner resource's waiter, told during an outer one's growth, sleeps.
    pub(crate) static STASH_DROPS: AtomicBool = AtomicBool::new(false);
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use std::sync::Arc as StdArc;
    use std::task::{Wake, Waker};
    use std::time::Duration;

    use super::MemoryWaiters;

    /// A waker that, when woken, unstacks a queue from `below`: what dropping a limiting
    /// adaptor stacked over `below` does (`MemoryWaiters::unstack_from`), run by a wake that
    /// polls or drops a task inline.
    struct Unstacks {
        below: StdArc<MemoryWaiters>,
        other: StdArc<MemoryWaiters>,
    }

    impl Wake for Unstacks {
        fn wake(self: StdArc<Self>) {
            self.below.stop_relaying(&self.other);
        }
    }

    /// A relayed notification wakes a waiter above; that wake unstacks a resource from the
    /// queue below. The relays' lock was held across the wake, so the unstacking (a write of
    /// the same lock, on the same thread) deadlocked the free that notified.
    #[test]
    fn a_wake_run_by_a_relayed_notification_can_unstack_from_the_queue_below() {
        let below = StdArc::new(MemoryWaiters::new());
        let above = StdArc::new(MemoryWaiters::new());
        let other = StdArc::new(MemoryWaiters::new());
        below.relay_to(&above);
        below.relay_to(&other);
        let waker = Waker::from(StdArc::new(Unstacks {
            below: below.clone(),
            other: other.clone(),
        }));
        let (id, first) = above.register(256, &waker);
        assert!(first);
        let (done, finished) = std::sync::mpsc::channel();
        let notifier = below.clone();
        // Detached: if it deadlocks, the test fails without waiting for it.
        std::thread::spawn(move || {
            notifier.notify();
            let _ = done.send(());
        });
        assert!(
            finished.recv_timeout(Duration::from_secs(10)).is_ok(),
            "a free's notification deadlocked: the relays' lock was held across a wake"
        );
        assert!(
            !below.reaches(other.addr()),
            "the unstacking did not happen"
        );
        above.remove(id, super::Leave::Cancelled);
    }
}
