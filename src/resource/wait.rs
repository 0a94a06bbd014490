//! The waiting core of an awaitable allocation, shared by [`Allocate`](super::Allocate) (one
//! request) and [`AllocateAll`](super::AllocateAll) (several at once): the try, the place in
//! the resource's [`MemoryWaiters`] queue (`waiters.rs`), the deadline, and the cancellation.
//! Below both futures, so that neither names the other.

use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::waiters::{self, Leave, MemoryWaiters};
use crate::error::{Error, Result};
use crate::timer::Deadline;

/// How an attempt is made: whether it is the queue's head trying with the baton (or the retry
/// just after it registered first in line). Only the head may keep its own rollbacks quiet
/// (see [`MemoryWaiters::quietly`]): everyone it could wake is behind it in the queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Attempt {
    /// Not in the queue (the first try, with nobody waiting).
    Fresh,
    /// First in line: the only queued waiter that tries.
    Head,
}

/// The place of one waiting request in its resource's queue, its deadline and its statistics:
/// the state machine of [`Allocate`](super::Allocate) and [`AllocateAll`](super::AllocateAll), which differ
/// only in what one attempt does.
pub(crate) struct Wait {
    /// What the request needs in all (for the queue's statistics and the logs).
    pub(crate) bytes: usize,
    /// What it takes of the resource (its footprint: rounded up, padded as the resource's
    /// adaptors ask), compared with the maximum the queue learned: a request whose footprint
    /// is above it can never fit, though its `bytes` are not (a review found such requests,
    /// through a limit that is no multiple of 256 or an aligning adaptor, queued for ever
    /// behind a waiter, where alone they failed at once).
    need: usize,
    /// Our entry in the resource's queue, while we wait.
    pub(crate) id: Option<u64>,
    /// When it started waiting (its first try failed).
    started: Option<Instant>,
    /// How long it may wait, counted from `started`.
    pub(crate) limit: Option<Duration>,
    pub(crate) deadline: Option<Instant>,
    timer: Option<Deadline>,
}

impl Wait {
    pub(crate) fn new(bytes: usize) -> Self {
        Self::needing(bytes, bytes)
    }

    /// A wait for `bytes` that take `need` bytes of the resource (see `need`).
    pub(crate) fn needing(bytes: usize, need: usize) -> Self {
        Self {
            bytes,
            need,
            id: None,
            started: None,
            limit: None,
            deadline: None,
            timer: None,
        }
    }

    /// Whether it is in the queue.
    pub(crate) fn is_queued(&self) -> bool {
        self.id.is_some()
    }

    fn leave(&mut self, waiters: Option<&MemoryWaiters>, why: Leave) {
        if let (Some(id), Some(w)) = (self.id.take(), waiters) {
            w.remove(id, why);
        }
        self.timer = None;
    }

    /// Cancelled (dropped) while waiting: leave the queue, passing on a wakeup we may have
    /// been given.
    pub(crate) fn cancel(&mut self, waiters: Option<&MemoryWaiters>) {
        if self.id.is_some() {
            self.leave(waiters, Leave::Cancelled);
        }
    }

    /// One poll of a waiting request. `attempt` tries to get everything; an error that
    /// [`worth_waiting`] accepts makes it wait in `waiters` (FIFO, see the module
    /// `waiters`), any other error ends the wait.
    ///
    /// A newcomer that finds others waiting queues behind them without a try (FIFO), but
    /// first `check`s what waiting cannot cure (a stream of another device, a size that
    /// overflows) and compares its size with the resource's maximum as the queue learned it:
    /// such a request fails at once. (A review found these queued, waiting until they reached
    /// the head.)
    pub(crate) fn poll<T>(
        &mut self,
        waiters: Option<&MemoryWaiters>,
        cx: &mut Context<'_>,
        mut attempt: impl FnMut(Attempt) -> Result<T>,
        check: impl FnOnce() -> Result<()>,
    ) -> Poll<Result<T>> {
        if self.id.is_none() {
            let barging = planted!(BARGING);
            // (The planted bug: a newcomer tries first whoever waits.)
            match waiters.filter(|w| !barging && !w.is_empty()) {
                // The common case, kept to one try: nobody waiting.
                None => match attempt(Attempt::Fresh) {
                    Ok(got) => return Poll::Ready(Ok(got)),
                    Err(e) if worth_waiting(&e) && waiters.is_some() => {
                        note_maximum(waiters, &e);
                    }
                    Err(e) => return Poll::Ready(Err(e)),
                },
                Some(w) => {
                    if let Err(e) = check() {
                        return Poll::Ready(Err(e));
                    }
                    if let Some(maximum) = w.known_maximum().filter(|&m| self.need > m) {
                        return Poll::Ready(Err(Error::OutOfMemory {
                            requested: self.need,
                            available: 0,
                            maximum,
                        }));
                    }
                }
            }
        }
        let try_now = match (self.id, waiters) {
            // Not queued: the try above failed, or others wait (FIFO: queue behind them).
            (None, _) => None,
            // Queued: try when woken with the baton. (An entry that is gone, which nothing
            // does, is tried as if it were not queued.)
            (Some(id), Some(w)) => match w.poll_entry(id, cx.waker()) {
                Some(true) => Some(Attempt::Head),
                Some(false) => None,
                None => Some(Attempt::Fresh),
            },
            (Some(_), None) => Some(Attempt::Fresh),
        };
        if let Some(how) = try_now {
            match attempt(how) {
                Ok(got) => {
                    let waited = self.started.map(|t| t.elapsed()).unwrap_or_default();
                    self.leave(waiters, Leave::Served(waited));
                    return Poll::Ready(Ok(got));
                }
                Err(e) if worth_waiting(&e) && waiters.is_some() => note_maximum(waiters, &e),
                Err(e) => {
                    self.leave(waiters, Leave::Cancelled);
                    return Poll::Ready(Err(e));
                }
            }
        }
        let Some(waiters) = waiters else {
            unreachable!("without a queue every outcome above returns")
        };
        if self.id.is_none() {
            let started = waiters::now();
            self.started = Some(started);
            // A limit too far ahead to be an `Instant` (`Duration::MAX`: "no limit") sets no
            // deadline.
            if let Some(at) = self.limit.and_then(|limit| started.checked_add(limit)) {
                self.deadline = Some(self.deadline.map_or(at, |d| d.min(at)));
            }
            tracing::debug!(bytes = self.bytes, "waiting for memory");
            let (id, first) = waiters.register(self.bytes, cx.waker());
            self.id = Some(id);
            // Memory freed between our failed try and the registration notified nobody: try
            // once more if we are first in line. Its errors count as any try's (a review
            // found this one's dropped: a device error turned into a wait).
            let first = first && !planted!(NO_RETRY);
            if first {
                match attempt(Attempt::Head) {
                    Ok(got) => {
                        self.leave(Some(waiters), Leave::Served(Duration::ZERO));
                        return Poll::Ready(Ok(got));
                    }
                    Err(e) if worth_waiting(&e) => {}
                    Err(e) => {
                        self.leave(Some(waiters), Leave::Cancelled);
                        return Poll::Ready(Err(e));
                    }
                }
            }
        }
        if let Some(at) = self.deadline {
            if Instant::now() >= at {
                let waited = self.started.map(|t| t.elapsed()).unwrap_or_default();
                self.leave(Some(waiters), Leave::TimedOut);
                tracing::debug!(bytes = self.bytes, ?waited, "wait for memory timed out");
                return Poll::Ready(Err(Error::Timeout { waited }));
            }
            match &self.timer {
                Some(timer) => timer.set_waker(cx.waker()),
                None => match Deadline::new(at, cx.waker()) {
                    Ok(timer) => self.timer = Some(timer),
                    // No timer thread (the OS refused to start one): nothing would end the wait
                    // at its deadline, so it ends now with the error rather than outlive its
                    // limit unnoticed (and the crate does not panic).
                    Err(e) => {
                        self.leave(Some(waiters), Leave::Cancelled);
                        return Poll::Ready(Err(e));
                    }
                },
            }
        }
        Poll::Pending
    }
}

/// Runs `undo`, the give-back of what a failed try of `how` took: quietly for the head (its
/// own notifications would wake only itself, into a loop of failing tries; see
/// [`MemoryWaiters::quietly`]), loudly for a fresh try (the head may have failed because of
/// what it held).
pub(crate) fn give_back(how: Attempt, waiters: Option<&MemoryWaiters>, undo: impl FnOnce()) {
    // (The planted bugs: every give-back loud, or every one quiet.)
    let how = match (planted!(GIVE_BACK_LOUD), planted!(GIVE_BACK_QUIET)) {
        (true, _) => Attempt::Fresh,
        (_, true) => Attempt::Head,
        _ => how,
    };
    match (how, waiters) {
        (Attempt::Head, Some(waiters)) => waiters.quietly(undo),
        _ => undo(),
    }
}

/// Notes the maximum of an out-of-memory error in the queue (see `MemoryWaiters::note_maximum`).
fn note_maximum(waiters: Option<&MemoryWaiters>, e: &Error) {
    if let (Some(w), Error::OutOfMemory { maximum, .. }) = (waiters, e) {
        w.note_maximum(*maximum);
    }
}

/// An error that waiting can cure: out of memory now, within what the resource could hold.
pub(crate) fn worth_waiting(e: &Error) -> bool {
    matches!(e, Error::OutOfMemory { requested, maximum, .. } if requested <= maximum)
}

/// Bugs the loom models plant (`loom-tests/waiters/queue.rs`, `sets.rs`), constant off otherwise;
/// read through `planted!`.
#[cfg(streamalloc_loom)]
pub(crate) mod planted {
    /// No retry after registering as first in line: memory freed between the failed try and
    /// the registration notified nobody, and the waiter waits for good.
    pub(crate) static NO_RETRY: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);
    /// A newcomer's first try ignores the queue: it takes memory ahead of earlier waiters.
    pub(crate) static BARGING: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);
    /// A failed try always gives back loudly: the head wakes itself with its own give-back,
    /// and tries again in a loop.
    pub(crate) static GIVE_BACK_LOUD: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);
    /// A failed try always gives back quietly: a fresh try's give-back does not wake the head
    /// it made fail (two sets that each took half the memory both wait for good).
    pub(crate) static GIVE_BACK_QUIET: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use std::task::{Context, Poll, Waker};
    use std::time::Duration;

    use super::{MemoryWaiters, Wait};
    use crate::error::Error;

    /// A request with a deadline that must wait, when the OS refuses to start the timer thread
    /// that would keep its deadline: the poll ends with the error (no panic, no wait that
    /// nothing would end at its deadline), and the request is out of the queue.
    #[test]
    fn a_deadline_whose_timer_thread_the_os_refuses_ends_the_wait_with_the_error() {
        let waiters = MemoryWaiters::new();
        let mut wait = Wait::new(256);
        wait.limit = Some(Duration::from_secs(60));
        let mut cx = Context::from_waker(Waker::noop());
        crate::timer::tests::REFUSE_START.with(|refuse| refuse.set(true));
        let polled = wait.poll(
            Some(&waiters),
            &mut cx,
            |_| -> crate::Result<()> {
                Err(Error::OutOfMemory {
                    requested: 256,
                    available: 0,
                    maximum: 1024,
                })
            },
            || Ok(()),
        );
        crate::timer::tests::REFUSE_START.with(|refuse| refuse.set(false));
        let err = match polled {
            Poll::Ready(Err(e)) => e,
            Poll::Ready(Ok(())) => panic!("served with no memory"),
            Poll::Pending => panic!("waiting with no timer to end the wait at its deadline"),
        };
        assert!(matches!(err, Error::Io { .. }), "{err:?}");
        assert!(err.to_string().contains("sa-timer"), "{err}");
        assert!(!wait.is_queued(), "the request stayed in the queue");
        assert!(waiters.is_empty(), "the queue kept the request");
        assert_eq!(waiters.stats().waiting, 0);
    }
}
