//! Deadlines for futures on any runtime: one lazily started thread that sleeps until the next
//! deadline and wakes its waker. Used by `Allocate::timeout`; not on any fast path.
//!
//! Its lock and condvar are the crate's `sync` ones, so the loom model
//! (`loom-tests/timer.rs`) runs this code: a [`Timer`] of its own, on a clock it moves by hand.
//! Under the loom cfg the global timer starts no thread (time does not pass in a loom model, as
//! `park_timeout` is `park` there): a deadline registered by a user's model never falls due.

// Under the loom cfg outside the crate's tests nothing runs the timer's loop or its hand-moved
// clock (the global timer starts no thread): they are there for the model.
#![cfg_attr(all(streamalloc_loom, not(test)), allow(dead_code))]

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::task::Waker;
use std::time::Instant;

use crate::error::Result;
use crate::sync::{Arc, Condvar, Mutex};

/// The deadlines. Every live deadline has one entry in `heap` and its waker in `wakers`; a
/// cancelled one (its `Deadline` dropped) has only its heap entry, which the timer thread
/// discards when it reaches the top and [`compact`](State::compact) once such entries
/// outnumber the live ones.
struct State {
    heap: BinaryHeap<Reverse<(Instant, u64)>>,
    wakers: HashMap<u64, Waker>,
    next_id: u64,
    /// Set to end the thread once nothing is due (only the loom model's timer is ever shut
    /// down: loom requires every thread of a model to finish; the global one runs for good).
    shutdown: bool,
    /// When the thread's timed sleep ends (`None`: asleep for good, or awake). The loom
    /// model's clock reads it to end the sleep when its time passes, as the OS would: loom's
    /// timed wait never times out.
    #[cfg(streamalloc_loom)]
    sleeping_until: Option<Instant>,
}

impl State {
    /// Rebuilds the heap without its cancelled entries once they outnumber the live ones. A
    /// cancelled entry would otherwise stay until it fell due (an hour for an hour's timeout
    /// served at once: a server waiting for memory thousands of times a second kept millions).
    /// A compaction costs the heap's length, less than twice the entries cancelled since the
    /// last one: a constant per drop, amortised.
    fn compact(&mut self) {
        let live = self.wakers.len();
        if self.heap.len().saturating_sub(live) > live {
            let wakers = &self.wakers;
            self.heap
                .retain(|&Reverse((_, id))| wakers.contains_key(&id));
        }
    }
}

/// What time it is for a timer.
enum Clock {
    /// The OS clock.
    Os,
    /// The loom model's clock: `base` plus the milliseconds it was moved on by hand
    /// ([`Timer::advance`]).
    #[cfg(streamalloc_loom)]
    Manual {
        base: Instant,
        millis: crate::sync::AtomicU64,
    },
}

/// A set of deadlines and the thread that fires them ([`Timer::run`]).
pub(crate) struct Timer {
    state: Mutex<State>,
    /// Notified when a deadline earlier than every other is added, and on shutdown.
    changed: Condvar,
    clock: Clock,
}

impl std::fmt::Debug for Timer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Timer")
    }
}

impl Timer {
    fn new(clock: Clock) -> Self {
        Timer {
            state: Mutex::new(State {
                heap: BinaryHeap::new(),
                wakers: HashMap::new(),
                next_id: 0,
                shutdown: false,
                #[cfg(streamalloc_loom)]
                sleeping_until: None,
            }),
            changed: Condvar::new(),
            clock,
        }
    }

    fn now(&self) -> Instant {
        match &self.clock {
            Clock::Os => Instant::now(),
            #[cfg(streamalloc_loom)]
            Clock::Manual { base, millis } => {
                *base + std::time::Duration::from_millis(millis.load(crate::sync::Ordering::SeqCst))
            }
        }
    }

    /// The timer thread: fires what is due, then sleeps until the next deadline or a change;
    /// returns once shut down with nothing due.
    pub(crate) fn run(&self) {
        let mut state = self.state.lock();
        loop {
            let now = self.now();
            // The planted bug: a deadline within a millisecond counts as due.
            let now = if planted!(FIRES_EARLY) {
                now + std::time::Duration::from_millis(1)
            } else {
                now
            };
            let mut due = Vec::new();
            while let Some(&Reverse((at, id))) = state.heap.peek() {
                // A cancelled entry on top goes now, not when it falls due: the thread then
                // sleeps towards the first live deadline, and wakes for no cancelled one it has
                // not already started to wait for.
                if at > now && state.wakers.contains_key(&id) {
                    break;
                }
                state.heap.pop();
                if let Some(waker) = state.wakers.remove(&id) {
                    due.push(waker);
                }
            }
            if !due.is_empty() {
                drop(state);
                for waker in due {
                    // A waker that panics must not end this thread: every later deadline would
                    // then never fire (a review's finding). Logged, as the reactor does.
                    if let Err(payload) = crate::completion::catch_unwind(|| waker.wake()) {
                        tracing::error!(
                            panic = crate::completion::panic_message(&*payload),
                            "a waker panicked when its deadline fell due; the timer goes on"
                        );
                    }
                }
                state = self.state.lock();
                continue;
            }
            if state.shutdown {
                return;
            }
            state = match state.heap.peek() {
                Some(&Reverse((at, _))) => {
                    #[cfg(streamalloc_loom)]
                    {
                        state.sleeping_until = Some(at);
                    }
                    #[allow(unused_mut)] // written only under loom
                    let mut state = self
                        .changed
                        .wait_timeout(state, at.saturating_duration_since(now));
                    #[cfg(streamalloc_loom)]
                    {
                        state.sleeping_until = None;
                    }
                    state
                }
                None => self.changed.wait(state),
            };
        }
    }

    /// Adds a deadline: `waker` is woken at `at` (or soon after) unless the id is cancelled.
    fn register(&self, at: Instant, waker: &Waker) -> u64 {
        let mut state = self.state.lock();
        let id = state.next_id;
        state.next_id += 1;
        state.heap.push(Reverse((at, id)));
        state.wakers.insert(id, waker.clone());
        drop(state);
        if planted!(NEW_WITHOUT_NOTIFY) {
            // The planted bug: a thread asleep for good (no deadline) or until a later one
            // never learns of this deadline.
            return id;
        }
        self.changed.notify_one();
        id
    }

    /// Cancels a deadline: its waker is dropped now, so a deadline cancelled before it fell
    /// due is never woken. (One that fell due just before may be being woken: the thread took
    /// its waker out under the lock.)
    fn cancel(&self, id: u64) {
        if planted!(CANCEL_KEEPS_WAKER) {
            // The planted bug: the waker stays, and is woken when the deadline falls due.
            return;
        }
        // The heap entry stays for now (removing it from a binary heap costs its length);
        // without its waker it wakes nobody, and it goes when it reaches the top or with the
        // next compaction. No need to wake the timer thread: at worst it wakes once at this
        // entry's instant, as it would have.
        let mut state = self.state.lock();
        let waker = state.wakers.remove(&id);
        if waker.is_some() {
            state.compact();
        }
        // Dropped after the lock: a waker's drop is the executor's code, and may drop a task
        // whose future holds another deadline, whose drop cancels it here (a review found this
        // thread then deadlocked on the timer's lock, and with it every deadline in the
        // process).
        drop(state);
        drop(waker);
    }
}

/// The loom model's handles on a timer (`loom-tests/timer.rs`).
#[cfg(streamalloc_loom)]
impl Timer {
    /// A timer on a clock that stands still until [`advance`](Self::advance)d. The model runs
    /// its [`run`](Self::run) on a thread of its own.
    pub(crate) fn manual() -> Arc<Timer> {
        Arc::new(Timer::new(Clock::Manual {
            base: Instant::now(),
            millis: crate::sync::AtomicU64::new(0),
        }))
    }

    /// The instant `millis` after the manual clock's start.
    pub(crate) fn at(&self, millis: u64) -> Instant {
        match &self.clock {
            Clock::Manual { base, .. } => *base + std::time::Duration::from_millis(millis),
            Clock::Os => Instant::now() + std::time::Duration::from_millis(millis),
        }
    }

    /// Milliseconds since the manual clock's start.
    pub(crate) fn millis(&self) -> u64 {
        match &self.clock {
            Clock::Manual { millis, .. } => millis.load(crate::sync::Ordering::SeqCst),
            Clock::Os => 0,
        }
    }

    /// Moves the manual clock on to `millis`, and ends the thread's timed sleep if it is over
    /// by then, as the OS ends a timed wait. Under the timer's lock, so the thread cannot read
    /// the old time, miss this, and sleep on (no OS clock stands still between a thread's read
    /// and its sleep long enough to lose a timeout: the timeout is relative).
    pub(crate) fn advance(&self, to: u64) {
        let state = self.state.lock();
        if let Clock::Manual { millis, .. } = &self.clock {
            millis.store(to, crate::sync::Ordering::SeqCst);
        }
        let over = state.sleeping_until.is_some_and(|at| at <= self.now());
        drop(state);
        if over {
            self.changed.notify_one();
        }
    }

    /// Ends the thread once nothing is due.
    pub(crate) fn shut_down(&self) {
        self.state.lock().shutdown = true;
        self.changed.notify_one();
    }
}

/// The process's timer, its thread started on first use. An error if the OS cannot start the
/// thread; the next call tries again.
#[cfg(not(streamalloc_loom))]
fn timer() -> Result<Arc<Timer>> {
    static TIMER: crate::sync::plain::Mutex<Option<Arc<Timer>>> =
        crate::sync::plain::Mutex::new(None);
    #[cfg(test)]
    if tests::REFUSE_START.with(|refuse| refuse.get()) {
        // A unit test of a caller's error path (`Wait::poll`): this thread's next start is
        // refused, as the OS would, on a slot of its own (the process's timer may be running).
        let empty = crate::sync::plain::Mutex::new(None);
        return get_or_start(&empty, |_| {
            Err(std::io::Error::new(
                std::io::ErrorKind::WouldBlock,
                "resource temporarily unavailable",
            ))
        });
    }
    get_or_start(&TIMER, |run| {
        crate::sync::thread::Builder::new()
            .name("sa-timer".into())
            .spawn(run)
            .map(drop)
    })
}

/// The timer in `slot`, or a new one whose thread `spawn` starts (kept in `slot` only if it
/// started).
#[cfg(not(streamalloc_loom))]
fn get_or_start(
    slot: &crate::sync::plain::Mutex<Option<Arc<Timer>>>,
    spawn: impl FnOnce(Box<dyn FnOnce() + Send>) -> std::io::Result<()>,
) -> Result<Arc<Timer>> {
    let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(timer) = &*slot {
        return Ok(timer.clone());
    }
    let timer = Arc::new(Timer::new(Clock::Os));
    let theirs = timer.clone();
    spawn(Box::new(move || theirs.run())).map_err(|e| {
        tracing::error!(error = %e, "the OS could not start the timer thread (sa-timer)");
        crate::error::Error::io(
            "starting the thread that keeps deadlines (sa-timer) for a wait with a timeout",
            &e,
        )
    })?;
    *slot = Some(timer.clone());
    Ok(timer)
}

/// Under loom: a timer with no thread, so a deadline of a user's model never falls due (loom
/// has no time). The timer's own model builds one with a thread ([`Timer::manual`]).
#[cfg(streamalloc_loom)]
fn timer() -> Result<Arc<Timer>> {
    Ok(Arc::new(Timer::new(Clock::Os)))
}

/// A registered deadline; dropping it cancels the wakeup.
#[derive(Debug)]
pub(crate) struct Deadline {
    timer: Arc<Timer>,
    id: u64,
}

impl Deadline {
    /// Wakes `waker` at `at` (or soon after). An error only if the timer thread is not running
    /// and the OS cannot start it: the deadline could never fire.
    pub(crate) fn new(at: Instant, waker: &Waker) -> Result<Deadline> {
        Ok(Deadline::on(timer()?, at, waker))
    }

    /// A deadline kept by `timer`.
    pub(crate) fn on(timer: Arc<Timer>, at: Instant, waker: &Waker) -> Deadline {
        let id = timer.register(at, waker);
        Deadline { timer, id }
    }

    /// Wakes this waker instead. If the deadline has fallen due already (the timer woke the
    /// old waker after the caller last looked at the time), wakes `waker` now: the task that
    /// polls the future now must learn of it, and the old waker may be another task's.
    pub(crate) fn set_waker(&self, waker: &Waker) {
        let mut state = self.timer.state.lock();
        match state.wakers.get_mut(&self.id) {
            Some(old) => {
                if !old.will_wake(waker) {
                    let old = std::mem::replace(old, waker.clone());
                    // Dropped after the lock (see `Timer::cancel`).
                    drop(state);
                    drop(old);
                }
            }
            // Gone: fired (only this `Deadline`'s Drop cancels it). Woken outside the lock.
            None => {
                drop(state);
                waker.wake_by_ref();
            }
        }
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        self.timer.cancel(self.id);
    }
}

/// Bugs the loom model plants (`loom-tests/timer.rs`), constant off otherwise; read through
/// `planted!`.
#[cfg(streamalloc_loom)]
pub(crate) mod planted {
    /// A new deadline does not notify the thread: asleep with no deadline (or until a later
    /// one), it never fires this one.
    pub(crate) static NEW_WITHOUT_NOTIFY: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);
    /// A cancelled deadline keeps its waker, which is woken when it falls due.
    pub(crate) static CANCEL_KEEPS_WAKER: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);
    /// The thread takes a deadline less than a millisecond away for due, and wakes it early.
    pub(crate) static FIRES_EARLY: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);
}

#[cfg(all(test, not(streamalloc_loom)))]
pub(crate) mod tests {
    std::thread_local! {
        /// Set by a unit test: the process's timer (`timer()`) acts as if the OS refused to
        /// start its thread, on this thread only (other tests run on their own threads).
        pub(crate) static REFUSE_START: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::task::{Wake, Waker};
    use std::time::{Duration, Instant};

    use super::{get_or_start, timer, Deadline};

    struct Panics;
    impl Wake for Panics {
        fn wake(self: Arc<Self>) {
            panic!("a waker that panics (timer test)");
        }
    }

    struct Flag(AtomicBool);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    /// A waker that panics when its deadline falls due does not stop the deadlines after it
    /// (a review found the timer thread ended by the panic, and every later deadline lost).
    #[test]
    fn a_panicking_waker_does_not_stop_the_timer() {
        let panics = Deadline::new(Instant::now(), &Waker::from(Arc::new(Panics))).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let flag = Arc::new(Flag(AtomicBool::new(false)));
        let later = Deadline::new(
            Instant::now() + Duration::from_millis(10),
            &Waker::from(flag.clone()),
        )
        .unwrap();
        let start = Instant::now();
        while !flag.0.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            flag.0.load(Ordering::SeqCst),
            "the deadline after a panic never fired"
        );
        drop((panics, later));
    }

    /// A future polled with a new waker just after its deadline fell due (its poll saw the
    /// time before the deadline, the timer then fired the old waker, then the poll handed
    /// over the new one) must still be woken: `set_waker` used to find the entry gone and do
    /// nothing, so the task that now owned the future never learnt of its timeout.
    #[test]
    fn a_waker_set_after_the_deadline_fired_is_woken() {
        let timer = crate::sync::Arc::new(super::Timer::new(super::Clock::Os));
        let old = Arc::new(Flag(AtomicBool::new(false)));
        let new = Arc::new(Flag(AtomicBool::new(false)));
        let deadline = Deadline::on(timer.clone(), Instant::now(), &Waker::from(old.clone()));
        // No thread: run the loop here once; shut down, it returns after firing what is due.
        timer.state.lock().shutdown = true;
        timer.run();
        assert!(old.0.load(Ordering::SeqCst), "the deadline did not fire");
        deadline.set_waker(&Waker::from(new.clone()));
        assert!(
            new.0.load(Ordering::SeqCst),
            "a waker handed over after the deadline fired was never woken"
        );
    }

    /// How many entries the timer's heap holds, live and cancelled.
    fn heap_len() -> usize {
        timer().unwrap().state.lock().heap.len()
    }

    /// A request that waits for memory with a long timeout and is served early drops its
    /// deadline; the deadline's heap entry used to stay until the timeout's instant. A server
    /// under memory backpressure (say 1,000 waits a second with
    /// `Allocate::timeout(Duration::from_secs(3600))`) kept 3.6 million dead entries, growing
    /// memory, and the timer thread woke once for each when it fell due. Here 100,000 cancelled
    /// deadlines must leave fewer than 1,000 entries (other tests' deadlines may be live).
    #[test]
    fn cancelled_deadlines_do_not_pile_up_in_the_heap() {
        let waker = Waker::from(Arc::new(Flag(AtomicBool::new(false))));
        let at = Instant::now() + Duration::from_secs(3600);
        let before = heap_len();
        for _ in 0..100_000 {
            drop(Deadline::new(at, &waker).unwrap());
        }
        let left = heap_len().saturating_sub(before);
        assert!(
            left < 1_000,
            "100,000 cancelled deadlines left {left} entries in the timer's heap"
        );
    }

    /// The OS refusing the timer thread is an error for the wait that needed it (no panic), and
    /// the next wait tries again: a timer whose thread never started is not kept.
    #[test]
    fn a_timer_thread_the_os_refuses_is_an_error_and_tried_again() {
        let slot = crate::sync::plain::Mutex::new(None);
        let refused = get_or_start(&slot, |_| {
            Err(std::io::Error::new(
                std::io::ErrorKind::WouldBlock,
                "resource temporarily unavailable",
            ))
        });
        let err = refused.expect_err("a timer without its thread was handed out");
        assert!(
            err.to_string().contains("sa-timer") && err.to_string().contains("unavailable"),
            "{err}"
        );
        assert!(
            slot.lock().unwrap().is_none(),
            "a timer with no thread was kept"
        );
        let started = get_or_start(&slot, |run| {
            std::thread::Builder::new().spawn(run).map(drop)
        });
        let timer = started.expect("the second start failed");
        let flag = Arc::new(Flag(AtomicBool::new(false)));
        let deadline = Deadline::on(timer.clone(), Instant::now(), &Waker::from(flag.clone()));
        let start = Instant::now();
        while !flag.0.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            flag.0.load(Ordering::SeqCst),
            "the restarted timer never fired"
        );
        drop(deadline);
    }
}
