//! The completion state that every handle of one recorded event shares: done or not, the result,
//! the wakers of the futures awaiting it, and the deferred work (frees) to run once it is done.
//!
//! The protocol that makes wakeups impossible to lose: `complete` stores the result *while
//! holding the waiters lock* and drains the waiters in the same critical section; `register_*`
//! checks for a result under that same lock before it stores a waker. So a waker is either stored
//! before the drain (and woken by it) or sees the result (and never waits). The loom models in
//! `loom-tests/completion/` check this (`wakers.rs`, `callbacks.rs`, and the planted bugs of
//! `planted.rs`); those of `loom-tests/reactor/` check the reactor that drives it.
//!
//! Wakers and callbacks are other people's code (a runtime's waker, a free into a user's memory
//! resource), run on whichever thread completes the event: usually the device's completion
//! reactor. Each one runs under `catch_unwind`: a panic is logged (error level, with what ran
//! and for which event) and the others still run, so one panic neither kills the reactor nor
//! loses the wakeups and frees queued behind it.

use std::task::Waker;
use std::time::Instant;

use crate::error::{Error, Result};
use crate::sync::{AtomicBool, AtomicU8, Mutex, Ordering};

/// Work to run once, on the thread that observes completion, with the event's result.
pub(crate) type Callback = Box<dyn FnOnce(&Result<()>) + Send>;

const PENDING: u8 = 0;
const OK: u8 = 1;
const FAILED: u8 = 2;
/// Failed, with its callbacks withheld ([`Completion::fail_withholding_callbacks`]): a result
/// for the waiters, never a reason to run a callback.
const WITHHELD: u8 = 3;

pub(crate) struct Completion {
    /// `PENDING`, `OK`, `FAILED` or `WITHHELD`. Written only under `waiters`' lock; read
    /// without it on the fast path.
    state: AtomicU8,
    /// The error, written before `state` becomes `FAILED` or `WITHHELD` and never changed after.
    error: Mutex<Option<Error>>,
    waiters: Mutex<Waiters>,
    /// Set by the reactor shortly before the predicted completion ([`hurry`](Self::hurry)):
    /// a future that registers its waker while it is set wakes its own task again at once, so
    /// that the task keeps polling instead of its worker parking. Written only under `waiters`'
    /// lock, so a registration either sees it or was stored before the pre-wake took the
    /// wakers.
    hurry: AtomicBool,
}

#[derive(Default)]
struct Waiters {
    /// One slot per future that is waiting; a future keeps its slot index as its key.
    wakers: Vec<Option<Waker>>,
    /// Slots that futures gave back.
    free: Vec<usize>,
    callbacks: Vec<Callback>,
    /// Whether the reactor was already told to watch this event.
    watched: bool,
    /// When the event was completed (by whichever thread did), stamped under this lock before
    /// the result is published. The predicting reactor uses it as the stream's last
    /// completion when another thread (a pre-woken task) completed the event before the
    /// reactor's own poll: the reactor's later look would make the next prediction late.
    completed_at: Option<Instant>,
}

/// What a registration found.
pub(crate) enum Registration {
    /// The event is complete; nothing was stored.
    Done(Result<()>),
    /// The waker or callback is stored. `first` is true exactly once per event: the caller must
    /// then hand the event to the reactor.
    Stored { first: bool },
}

impl Completion {
    pub(crate) fn new() -> Self {
        Self {
            state: AtomicU8::new(PENDING),
            error: Mutex::new(None),
            waiters: Mutex::new(Waiters::default()),
            hurry: AtomicBool::new(false),
        }
    }

    /// The result if the event is known to be complete. Never asks the device.
    pub(crate) fn result(&self) -> Option<Result<()>> {
        match self.state.load(Ordering::Acquire) {
            PENDING => None,
            OK => Some(Ok(())),
            _ => Some(Err(self.error.lock().clone().unwrap_or(
                Error::InvalidArgument {
                    what: "event failed without an error (a bug in streamalloc)",
                },
            ))),
        }
    }

    /// Records the result, wakes every waiting future and runs every callback, on this thread,
    /// outside the lock. Only the first call has an effect; it returns whether this was it.
    ///
    /// A waker or callback that panics is caught and logged; the rest still run (see the
    /// module docs). (The crate calls [`complete_for`](Self::complete_for); the loom models
    /// and the unit tests call this.)
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn complete(&self, result: Result<()>) -> bool {
        self.complete_for(result, None)
    }

    /// [`complete`](Self::complete) for the event `(stream id, sequence number)`, which a
    /// caught panic's log names.
    pub(crate) fn complete_for(&self, result: Result<()>, event: Option<(u64, u64)>) -> bool {
        let state = if result.is_ok() { OK } else { FAILED };
        self.finish(result, state, event)
    }

    /// Fails the event with `error` for its waiters (woken, as by [`complete`](Self::complete))
    /// but never runs its callbacks: those stored are dropped unrun, and so is every one
    /// registered later ([`register_callback`](Self::register_callback) keeps it;
    /// [`withholds_callbacks`](Self::withholds_callbacks) tells `Event::on_complete`). For an
    /// event whose completion nothing can tell (`reactor::settle_after_panic`): its callbacks
    /// free memory the GPU may still use. Returns how many callbacks were withheld (zero if
    /// the event was already complete, which then stands).
    pub(crate) fn fail_withholding_callbacks(
        &self,
        error: Error,
        event: Option<(u64, u64)>,
    ) -> usize {
        let withheld = self.waiters.lock().callbacks.len();
        match self.finish(Err(error), WITHHELD, event) {
            true => withheld,
            false => 0,
        }
    }

    /// Whether the event's callbacks are withheld
    /// ([`fail_withholding_callbacks`](Self::fail_withholding_callbacks)).
    pub(crate) fn withholds_callbacks(&self) -> bool {
        self.state.load(Ordering::Acquire) == WITHHELD
    }

    /// [`complete_for`](Self::complete_for) into `state`; with `WITHHELD` the callbacks are
    /// dropped unrun.
    fn finish(&self, result: Result<()>, state: u8, event: Option<(u64, u64)>) -> bool {
        // The loom models' planted bugs (`planted`): the state published before the error is
        // written, or after the lock is let go.
        let (before_error, after_drain) = (
            planted!(STATE_BEFORE_ERROR),
            planted!(STATE_STORED_AFTER_DRAIN),
        );
        let (wakers, callbacks) = {
            let mut waiters = self.waiters.lock();
            if self.state.load(Ordering::Relaxed) != PENDING && !planted!(NO_PENDING_CHECK) {
                return false;
            }
            if before_error {
                self.state.store(state, Ordering::Release);
            }
            if let Err(e) = &result {
                *self.error.lock() = Some(e.clone());
            }
            // Before the result is published: whoever sees the result and then takes this lock
            // sees the stamp (`completed_at`).
            if !planted!(STAMP_AFTER_RESULT) {
                waiters.completed_at = Some(Instant::now());
            }
            if !before_error && !after_drain {
                self.state.store(state, Ordering::Release);
            }
            waiters.free.clear();
            (
                std::mem::take(&mut waiters.wakers),
                std::mem::take(&mut waiters.callbacks),
            )
        };
        if after_drain {
            self.state.store(state, Ordering::Release);
        }
        if planted!(STAMP_AFTER_RESULT) {
            // The planted bug: the stamp written after the result was published.
            self.waiters.lock().completed_at = Some(Instant::now());
        }
        for waker in wakers.into_iter().flatten() {
            guarded(WAKER, event, || waker.wake());
        }
        if state == WITHHELD {
            // Dropped unrun, off the lock: their memory is leaked (see the caller). One by one
            // and guarded, as a run is: a drop is other people's code too (a capture's last
            // handle of a user's memory resource), and its panic must not reach our caller.
            for callback in callbacks {
                guarded(WITHHELD_DROP, event, move || drop(callback));
            }
            return true;
        }
        for callback in callbacks {
            run_callback(callback, &result, event);
        }
        true
    }

    /// Stores `waker` in the future's slot (`key`), replacing an older waker of the same future
    /// unless it would wake the same task. While the event is hurried ([`hurry`](Self::hurry))
    /// it also wakes `waker` at once (after the lock), so the future is polled again soon.
    pub(crate) fn register_waker(&self, key: &mut Option<usize>, waker: &Waker) -> Registration {
        // The planted bug: the result looked at before the lock, not under it.
        let outside = planted!(RESULT_CHECKED_OUTSIDE_LOCK);
        if outside {
            if let Some(result) = self.result() {
                return Registration::Done(result);
            }
        }
        // A waker this one replaces, dropped after the lock is let go: its drop is a runtime's
        // code, and may drop a task holding another handle of this event, whose drop
        // deregisters (this lock again).
        let mut replaced = None;
        let (registration, hurry) = {
            let mut waiters = self.waiters.lock();
            // Under the lock that `complete` publishes under: either it has published (we see
            // the result) or it will drain the waker we store.
            if !outside {
                if let Some(result) = self.result() {
                    return Registration::Done(result);
                }
            }
            match *key {
                Some(k) => match waiters.wakers.get_mut(k) {
                    Some(Some(old)) if old.will_wake(waker) => {}
                    Some(slot) => replaced = slot.replace(waker.clone()),
                    // Unreachable while pending: slots are only dropped by `complete`.
                    None => *key = Some(Self::new_slot(&mut waiters, waker)),
                },
                None => *key = Some(Self::new_slot(&mut waiters, waker)),
            }
            let first = !std::mem::replace(&mut waiters.watched, true);
            // Relaxed: written only under this lock, which orders it.
            (
                Registration::Stored { first },
                self.hurry.load(Ordering::Relaxed),
            )
        };
        drop(replaced);
        if hurry {
            guarded(WAKER, None, || waker.wake_by_ref());
        }
        registration
    }

    /// The reactor expects the event within its pre-wake lead (`on`), or no longer does. On:
    /// wakes every waiting future now (keeping their wakers for the completion) and makes each
    /// later registration wake its task again at once, until switched off or complete. A
    /// no-op once complete. Allocates a list of the wakers: reactor thread only, never a hot
    /// path.
    pub(crate) fn hurry(&self, on: bool) {
        let wakers: Vec<Waker> = {
            let waiters = self.waiters.lock();
            if self.state.load(Ordering::Relaxed) != PENDING {
                return;
            }
            if !planted!(HURRY_FLAG_OUTSIDE_LOCK) {
                self.hurry.store(on, Ordering::Relaxed);
            }
            if !on {
                return;
            }
            waiters.wakers.iter().flatten().cloned().collect()
        };
        if planted!(HURRY_FLAG_OUTSIDE_LOCK) {
            // The planted bug: a registration between the lock and this store is missed.
            self.hurry.store(on, Ordering::Relaxed);
        }
        for waker in wakers {
            guarded(WAKER, None, || waker.wake());
        }
    }

    /// Wakes every waiting future without completing the event, keeping their wakers: their
    /// tasks poll the event again and ask the device themselves. For the reactor when its own
    /// look at the event panicked (`reactor::poll_heads`). A no-op once complete.
    pub(crate) fn wake_waiters(&self) {
        let wakers: Vec<Waker> = {
            let waiters = self.waiters.lock();
            if self.state.load(Ordering::Relaxed) != PENDING {
                return;
            }
            waiters.wakers.iter().flatten().cloned().collect()
        };
        for waker in wakers {
            guarded(WAKER, None, || waker.wake());
        }
    }

    /// When the event was completed, by whichever thread; `None` while pending. Once
    /// [`result`](Self::result) has returned a result, this returns the instant.
    pub(crate) fn completed_at(&self) -> Option<Instant> {
        self.waiters.lock().completed_at
    }

    /// Whether the event is hurried (for the loom models).
    #[allow(dead_code)]
    pub(crate) fn hurried(&self) -> bool {
        let _waiters = self.waiters.lock();
        self.hurry.load(Ordering::Relaxed)
    }

    fn new_slot(waiters: &mut Waiters, waker: &Waker) -> usize {
        match waiters.free.pop() {
            Some(k) => {
                waiters.wakers[k] = Some(waker.clone());
                k
            }
            None => {
                waiters.wakers.push(Some(waker.clone()));
                waiters.wakers.len() - 1
            }
        }
    }

    /// A future that stops waiting gives its slot back. After completion this is a no-op.
    ///
    /// The waker is dropped after the lock is let go (see `register_waker`).
    pub(crate) fn deregister(&self, key: usize) {
        let mut waiters = self.waiters.lock();
        if planted!(DEREGISTER_INDEXES) {
            // The planted bug: indexing the slot, which `complete` may have taken away.
            let waker = waiters.wakers[key].take();
            if waker.is_some() {
                waiters.free.push(key);
            }
            drop(waiters);
            return drop(waker);
        }
        let waker = waiters.wakers.get_mut(key).and_then(Option::take);
        if waker.is_some() {
            waiters.free.push(key);
        }
        drop(waiters);
        drop(waker);
    }

    /// Stores `callback` to run at completion. If the event is already complete, hands the
    /// callback back with the result, for the caller to run.
    pub(crate) fn register_callback(
        &self,
        callback: Callback,
    ) -> std::result::Result<Registration, (Callback, Result<()>)> {
        // The planted bug: the result looked at before the lock, not under it.
        let outside = planted!(CALLBACK_CHECKED_OUTSIDE_LOCK);
        if outside {
            if let Some(result) = self.result() {
                return Err((callback, result));
            }
        }
        let mut waiters = self.waiters.lock();
        if self.state.load(Ordering::Relaxed) == WITHHELD {
            // Never run (`fail_withholding_callbacks`): kept with the others, never drained.
            waiters.callbacks.push(callback);
            return Ok(Registration::Stored { first: false });
        }
        if !outside {
            if let Some(result) = self.result() {
                return Err((callback, result));
            }
        }
        waiters.callbacks.push(callback);
        Ok(Registration::Stored {
            first: !std::mem::replace(&mut waiters.watched, true),
        })
    }

    /// How many futures are waiting (for the loom models and, later, statistics).
    #[allow(dead_code)]
    pub(crate) fn waiting(&self) -> usize {
        self.waiters
            .lock()
            .wakers
            .iter()
            .filter(|w| w.is_some())
            .count()
    }
}

/// Bugs the loom models plant (`loom-tests/completion/planted.rs`), constant off otherwise;
/// read through [`planted!`].
#[cfg(streamalloc_loom)]
pub(crate) mod planted {
    use std::sync::atomic::AtomicBool;

    /// `register_waker` looks at the result before it takes the waiters lock.
    pub(crate) static RESULT_CHECKED_OUTSIDE_LOCK: AtomicBool = AtomicBool::new(false);
    /// `complete` publishes the state after it let go of the lock with the drained waiters.
    pub(crate) static STATE_STORED_AFTER_DRAIN: AtomicBool = AtomicBool::new(false);
    /// `complete` publishes `FAILED` before it writes the error.
    pub(crate) static STATE_BEFORE_ERROR: AtomicBool = AtomicBool::new(false);
    /// `complete` does not check that the event is still pending.
    pub(crate) static NO_PENDING_CHECK: AtomicBool = AtomicBool::new(false);
    /// `register_callback` looks at the result before it takes the waiters lock.
    pub(crate) static CALLBACK_CHECKED_OUTSIDE_LOCK: AtomicBool = AtomicBool::new(false);
    /// `deregister` indexes `wakers[key]` instead of `get_mut(key)`.
    pub(crate) static DEREGISTER_INDEXES: AtomicBool = AtomicBool::new(false);
    /// `hurry` sets its flag after letting go of the lock it took the wakers under.
    pub(crate) static HURRY_FLAG_OUTSIDE_LOCK: AtomicBool = AtomicBool::new(false);
    /// `complete` writes the stamp (`completed_at`) after the result is published and the lock
    /// let go (`loom-tests/reactor/stamp.rs`).
    pub(crate) static STAMP_AFTER_RESULT: AtomicBool = AtomicBool::new(false);
}

/// What a caught panic's log says ran: a task's waker.
const WAKER: &str = "Waker::wake of a task awaiting the event";
/// ... or a callback.
const CALLBACK: &str =
    "a callback run at the event's completion (a deferred free into a memory resource, or the \
     return of a staging block)";

/// ... or the drop of a callback withheld (`Completion::fail_withholding_callbacks`).
const WITHHELD_DROP: &str = "the drop, unrun, of a callback withheld from an event whose \
     completion is unknown";

/// Runs `callback` with `result`, catching and logging a panic (see the module docs). For
/// callers that run a callback themselves (`Event::on_complete` on an event already complete).
pub(crate) fn run_callback(callback: Callback, result: &Result<()>, event: Option<(u64, u64)>) {
    guarded(CALLBACK, event, move || callback(result));
}

/// Drops `callback` unrun, catching and logging a panic of its captures' drops: for a callback
/// withheld from an event whose completion is unknown (`Event::on_complete` on such an event),
/// as [`Completion::fail_withholding_callbacks`] drops those it held.
pub(crate) fn drop_withheld(callback: Callback, event: Option<(u64, u64)>) {
    guarded(WITHHELD_DROP, event, move || drop(callback));
}

/// Runs `f`; a panic is caught and logged at error level with `what` ran, for which event, and
/// on which thread.
fn guarded(what: &'static str, event: Option<(u64, u64)>, f: impl FnOnce()) {
    if let Err(payload) = catch_unwind(f) {
        let (stream, seq) = event.unzip();
        tracing::error!(
            ran = what,
            stream,
            seq,
            thread = std::thread::current().name().unwrap_or("<unnamed>"),
            panic = panic_message(&*payload),
            "a panic in a waker or callback was caught while completing an event; the event's \
             other wakers and callbacks still run"
        );
    }
}

/// The message of a panic payload (`panic!` makes a `&str` or a `String`).
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("<a panic payload that is not a string>")
}

/// `std::panic::catch_unwind`. Under loom it catches nothing: loom reports a failed model
/// (an assertion, a causality violation, a deadlock) by panicking, and that panic must reach
/// loom, not a log.
#[cfg(not(streamalloc_loom))]
pub(crate) fn catch_unwind<R>(
    f: impl FnOnce() -> R,
) -> std::result::Result<R, Box<dyn std::any::Any + Send>> {
    // Unwind safety: what `f` touches is its own (a waker, a callback and what it captured) or
    // state that is complete before `f` runs (the event's result); nothing of ours is left
    // half-updated by a panic in it.
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
}

/// `std::panic::catch_unwind`. Under loom it catches nothing: loom reports a failed model
/// (an assertion, a causality violation, a deadlock) by panicking, and that panic must reach
/// loom, not a log.
#[cfg(streamalloc_loom)]
pub(crate) fn catch_unwind<R>(
    f: impl FnOnce() -> R,
) -> std::result::Result<R, Box<dyn std::any::Any + Send>> {
    Ok(f())
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::sync::Arc;
    use std::task::{Wake, Waker};

    use super::*;

    struct Counting(AtomicUsize);

    impl Wake for Counting {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, SeqCst);
        }
    }

    struct Panicking;

    impl Wake for Panicking {
        fn wake(self: Arc<Self>) {
            panic!("a waker that panics (completion unit test)");
        }
    }

    /// A hurried event wakes its waiting futures at once, and each future that registers while
    /// it is hurried wakes itself; after `hurry(false)` only the completion wakes.
    #[test]
    fn hurry_wakes_waiters_and_registrations() {
        let completion = Completion::new();
        let counter = Arc::new(Counting(AtomicUsize::new(0)));
        let waker = Waker::from(counter.clone());
        let mut key = None;
        let wakes = || counter.0.load(SeqCst);
        assert!(matches!(
            completion.register_waker(&mut key, &waker),
            Registration::Stored { first: true }
        ));
        assert_eq!(wakes(), 0);
        completion.hurry(true);
        assert_eq!(wakes(), 1, "the pre-wake");
        assert!(completion.hurried());
        let _ = completion.register_waker(&mut key, &waker);
        assert_eq!(wakes(), 2, "a registration while hurried wakes itself");
        completion.hurry(false);
        let _ = completion.register_waker(&mut key, &waker);
        assert_eq!(wakes(), 2, "no self-wake once the hurry is off");
        assert!(completion.complete(Ok(())));
        assert_eq!(wakes(), 3, "the completion");
        completion.hurry(true);
        assert!(!completion.hurried(), "a complete event is never hurried");
        assert_eq!(wakes(), 3);
    }

    /// The first completion stamps the instant (for the predicting reactor); a second changes
    /// nothing.
    #[test]
    fn completion_is_stamped_once() {
        let completion = Completion::new();
        assert_eq!(completion.completed_at(), None);
        let before = Instant::now();
        assert!(completion.complete(Ok(())));
        let at = completion.completed_at().expect("stamped");
        assert!(before <= at && at <= Instant::now());
        assert!(!completion.complete(Ok(())));
        assert_eq!(completion.completed_at(), Some(at));
    }

    /// A waker whose last reference drops while the event is pending records whether the
    /// event's waiters lock was held then. A runtime's waker can own a task (the last
    /// reference to one that was cancelled), and that task another handle of the same event:
    /// its drop deregisters, which takes that lock again (std's mutex: a deadlock or a panic).
    struct DropProbe {
        completion: Arc<Completion>,
        dropped_under_lock: Arc<AtomicUsize>,
        dropped: Arc<AtomicUsize>,
    }

    impl Wake for DropProbe {
        fn wake(self: Arc<Self>) {}
    }

    impl Drop for DropProbe {
        fn drop(&mut self) {
            self.dropped.fetch_add(1, SeqCst);
            if self.completion.waiters.try_lock().is_none() {
                self.dropped_under_lock.fetch_add(1, SeqCst);
            }
        }
    }

    /// A future's waker replaced by another task's, and a future dropped while waiting: each
    /// drops the waker it had stored, and must do so after letting go of the waiters lock. Both
    /// dropped it under the lock.
    #[test]
    fn stored_wakers_are_dropped_outside_the_lock() {
        let completion = Arc::new(Completion::new());
        let (under_lock, dropped) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let probe = || {
            Waker::from(Arc::new(DropProbe {
                completion: completion.clone(),
                dropped_under_lock: under_lock.clone(),
                dropped: dropped.clone(),
            }))
        };
        let other = Waker::from(Arc::new(Counting(AtomicUsize::new(0))));
        // Replaced: a future first polled by one task, then by another.
        let mut key = None;
        let _ = completion.register_waker(&mut key, &probe());
        let _ = completion.register_waker(&mut key, &other);
        assert_eq!(
            dropped.load(SeqCst),
            1,
            "the replaced waker was not dropped"
        );
        // Deregistered: a waiting future dropped.
        let mut key = None;
        let _ = completion.register_waker(&mut key, &probe());
        completion.deregister(key.expect("a slot"));
        assert_eq!(
            dropped.load(SeqCst),
            2,
            "the deregistered waker was not dropped"
        );
        assert_eq!(
            under_lock.load(SeqCst),
            0,
            "a waker was dropped under the lock"
        );
    }

    /// Panics when dropped: a callback's capture whose drop is other people's code (the last
    /// handle of a user's memory resource).
    struct PanicsOnDrop;

    impl Drop for PanicsOnDrop {
        fn drop(&mut self) {
            panic!("a capture whose drop panics (completion unit test)");
        }
    }

    /// Callbacks withheld ([`Completion::fail_withholding_callbacks`]) are dropped unrun; one
    /// whose drop panics is caught and logged, as one that runs is, and the others are still
    /// dropped. The panic reached the caller: the blocking-work thread, or, on a reactor with
    /// no thread, whoever handed the event over (a buffer's drop).
    #[test]
    fn a_withheld_callback_whose_drop_panics_is_contained() {
        let completion = Completion::new();
        let dropped = Arc::new(AtomicUsize::new(0));
        let capture = PanicsOnDrop;
        let _ = completion.register_callback(Box::new(move |_| drop(capture)));
        struct Counted(Arc<AtomicUsize>);
        impl Drop for Counted {
            fn drop(&mut self) {
                self.0.fetch_add(1, SeqCst);
            }
        }
        let counted = Counted(dropped.clone());
        let _ = completion.register_callback(Box::new(move |_| drop(counted)));
        let error = Error::InvalidArgument {
            what: "withheld (completion unit test)",
        };
        let withheld = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            completion.fail_withholding_callbacks(error, Some((1, 2)))
        }));
        assert!(
            matches!(withheld, Ok(2)),
            "the drop's panic reached the caller"
        );
        assert_eq!(
            dropped.load(SeqCst),
            1,
            "the other callback was not dropped"
        );
        assert!(completion.withholds_callbacks());
    }

    /// Wakers and callbacks that panic, each stored before a good one: `complete` returns, every
    /// good one ran, and the result stands.
    #[test]
    fn panics_in_wakers_and_callbacks_are_contained() {
        let completion = Completion::new();
        let good = Arc::new(Counting(AtomicUsize::new(0)));
        let (mut bad_key, mut good_key) = (None, None);
        let _ = completion.register_waker(&mut bad_key, &Waker::from(Arc::new(Panicking)));
        let _ = completion.register_waker(&mut good_key, &Waker::from(good.clone()));
        let ran = Arc::new(AtomicUsize::new(0));
        assert!(matches!(
            completion
                .register_callback(Box::new(|_| panic!("a callback that panics (unit test)"))),
            Ok(Registration::Stored { first: false })
        ));
        let r = ran.clone();
        assert!(matches!(
            completion.register_callback(Box::new(move |result| {
                assert_eq!(*result, Ok(()));
                r.fetch_add(1, SeqCst);
            })),
            Ok(Registration::Stored { first: false })
        ));

        assert!(completion.complete(Ok(())));
        assert_eq!(good.0.load(SeqCst), 1, "the good waker was not woken");
        assert_eq!(ran.load(SeqCst), 1, "the good callback did not run");
        assert_eq!(completion.result(), Some(Ok(())));
        // A callback handed back for an event already complete is guarded too.
        run_callback(
            Box::new(|_| panic!("a late callback that panics (unit test)")),
            &Ok(()),
            Some((1, 2)),
        );
    }
}
