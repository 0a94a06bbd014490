//! The completion state that every handle of one recorded event shares: done or not, the result,
//! the wakers of the futures awaiting it, and the deferred work (frees) to run once it is done.
//!
//! The protocol that makes wakeups impossible to lose: `complete` stores the result *while
//! holding the waiters lock* and drains the waiters in the same critical section; `register_*`
//! checks for a result under that same lock before it stores a waker. So a waker is either stored
//! before the drain (and woken by it) or sees the result (and never waits). The loom model in
//! `loom-tests/reactor.rs` checks this.

use std::task::Waker;

use crate::error::{Error, Result};
use crate::sync::{AtomicU8, Mutex, Ordering};

/// Work to run once, on the thread that observes completion, with the event's result.
pub(crate) type Callback = Box<dyn FnOnce(&Result<()>) + Send>;

const PENDING: u8 = 0;
const OK: u8 = 1;
const FAILED: u8 = 2;

pub(crate) struct Completion {
    /// `PENDING`, `OK` or `FAILED`. Written only under `waiters`' lock; read without it on the
    /// fast path.
    state: AtomicU8,
    /// The error, written before `state` becomes `FAILED` and never changed after.
    error: Mutex<Option<Error>>,
    waiters: Mutex<Waiters>,
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
    pub(crate) fn complete(&self, result: Result<()>) -> bool {
        let (wakers, callbacks) = {
            let mut waiters = self.waiters.lock();
            if self.state.load(Ordering::Relaxed) != PENDING {
                return false;
            }
            let state = match &result {
                Ok(()) => OK,
                Err(e) => {
                    *self.error.lock() = Some(e.clone());
                    FAILED
                }
            };
            self.state.store(state, Ordering::Release);
            waiters.free.clear();
            (
                std::mem::take(&mut waiters.wakers),
                std::mem::take(&mut waiters.callbacks),
            )
        };
        for waker in wakers.into_iter().flatten() {
            waker.wake();
        }
        for callback in callbacks {
            callback(&result);
        }
        true
    }

    /// Stores `waker` in the future's slot (`key`), replacing an older waker of the same future
    /// unless it would wake the same task.
    pub(crate) fn register_waker(&self, key: &mut Option<usize>, waker: &Waker) -> Registration {
        let mut waiters = self.waiters.lock();
        if let Some(result) = self.result() {
            return Registration::Done(result);
        }
        match *key {
            Some(k) => match waiters.wakers.get_mut(k) {
                Some(Some(old)) if old.will_wake(waker) => {}
                Some(slot) => *slot = Some(waker.clone()),
                // Unreachable while pending: slots are only dropped by `complete`.
                None => *key = Some(Self::new_slot(&mut waiters, waker)),
            },
            None => *key = Some(Self::new_slot(&mut waiters, waker)),
        }
        Registration::Stored {
            first: !std::mem::replace(&mut waiters.watched, true),
        }
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
    pub(crate) fn deregister(&self, key: usize) {
        let mut waiters = self.waiters.lock();
        if let Some(slot) = waiters.wakers.get_mut(key) {
            if slot.take().is_some() {
                waiters.free.push(key);
            }
        }
    }

    /// Stores `callback` to run at completion. If the event is already complete, hands the
    /// callback back with the result, for the caller to run.
    pub(crate) fn register_callback(
        &self,
        callback: Callback,
    ) -> std::result::Result<Registration, (Callback, Result<()>)> {
        let mut waiters = self.waiters.lock();
        if let Some(result) = self.result() {
            return Err((callback, result));
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
