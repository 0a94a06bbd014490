//! `allocate_async`: an allocation that waits for memory instead of failing.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::allocate_all::AllocateAll;
use super::waiters::{self, Leave, MemoryWaiters};
use super::MemoryResource;
use crate::device::DevicePtr;
use crate::error::{Error, Result};
use crate::stream::Stream;
use crate::timer::Deadline;

/// `allocate_async` for every [`MemoryResource`] (and `dyn MemoryResource`).
pub trait AllocateAsync: MemoryResource {
    /// Allocates `bytes` for `stream`, waiting (as a future, no thread parked) while the
    /// resource is out of memory but could get memory back: a pool at its maximum, a limiting
    /// adaptor. It returns at once when memory is there, through the same path as
    /// [`allocate`](MemoryResource::allocate). A request larger than the resource could ever
    /// hold, or any error other than running out, fails at once. Waiters are served first come,
    /// first served (see [`MemoryWaiters`]). Add a deadline with [`Allocate::timeout`].
    fn allocate_async<'a>(&'a self, bytes: usize, stream: &'a Stream) -> Allocate<'a, Self> {
        Allocate {
            resource: self,
            stream,
            wait: Wait::new(bytes),
        }
    }

    /// Allocates every request of `requests` (`(bytes, stream)` pairs), **all or none**,
    /// waiting (as a future) until all of them fit at once. The real fix for a task that needs
    /// several buffers: one that holds some while it awaits the others can deadlock with
    /// peers doing the same (each holding what the others wait for); a task that waits here
    /// holds nothing while it waits.
    ///
    /// - Returns the pointers in the order of `requests`; an empty set is served at once.
    /// - Waits in the same FIFO queue as [`allocate_async`](Self::allocate_async), as one
    ///   waiter for the sum of its sizes: it is served when its turn comes and the whole set
    ///   fits, and nobody behind it is served first.
    /// - A set that can never fit fails at once: one request larger than the resource's
    ///   maximum, or sizes (each rounded up to [`ALIGNMENT`](crate::ALIGNMENT)) adding up to
    ///   more than it ([`Error::OutOfMemory`] with `requested` = that sum), or a size so large
    ///   that the sum overflows ([`Error::InvalidSize`]). Any other error ends it too, with
    ///   nothing held.
    /// - Each try allocates the requests largest first (the best order for packing) and,
    ///   if one fails, gives back what it took (in stream order, on each request's stream,
    ///   before any use) and waits for the next free.
    ///
    /// Add a deadline with [`AllocateAll::timeout`].
    fn allocate_all_async<'a>(
        &'a self,
        requests: impl IntoIterator<Item = (usize, &'a Stream)>,
    ) -> AllocateAll<'a, Self> {
        AllocateAll::new(self, requests.into_iter().collect())
    }
}

impl<R: MemoryResource + ?Sized> AllocateAsync for R {}

/// The future of [`AllocateAsync::allocate_async`].
///
/// # Cancel safety
/// Cancel-safe: dropping it while it waits removes it from the queue, and if it had been woken
/// to try, the next waiter is woken in its place. Nothing was allocated.
#[must_use = "futures do nothing unless awaited"]
pub struct Allocate<'a, R: MemoryResource + ?Sized> {
    resource: &'a R,
    stream: &'a Stream,
    wait: Wait,
}

impl<R: MemoryResource + ?Sized> fmt::Debug for Allocate<'_, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Allocate")
            .field("bytes", &self.wait.bytes)
            .field("waiting", &self.wait.id.is_some())
            .finish()
    }
}

impl<'a, R: MemoryResource + ?Sized> Allocate<'a, R> {
    /// Gives up with [`Error::Timeout`] (saying how long it waited) if no memory came within
    /// `limit` of the moment it started waiting (its first try failing; memory that is there at
    /// once never times out). Works on any runtime: a crate thread keeps the deadlines. A limit
    /// so long that its end cannot be represented (`Duration::MAX`, say) means no limit.
    pub fn timeout(mut self, limit: Duration) -> Self {
        self.wait.limit = Some(limit);
        self
    }

    /// Like [`timeout`](Self::timeout), with an instant.
    pub fn deadline(mut self, at: Instant) -> Self {
        self.wait.deadline = Some(at);
        self
    }
}

impl<R: MemoryResource + ?Sized> Future for Allocate<'_, R> {
    type Output = Result<DevicePtr>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<DevicePtr>> {
        let this = self.get_mut();
        let (resource, stream, bytes) = (this.resource, this.stream, this.wait.bytes);
        this.wait.poll(resource.memory_waiters(), cx, |_| {
            resource.allocate(bytes, stream)
        })
    }
}

impl<R: MemoryResource + ?Sized> Drop for Allocate<'_, R> {
    fn drop(&mut self) {
        // Cancelled while waiting: leave the queue, passing on a wakeup we may have been given.
        let waiters = self.resource.memory_waiters();
        self.wait.cancel(waiters);
    }
}

// ===== the waiting core, shared with `AllocateAll` =====

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
/// the state machine of [`Allocate`] and [`AllocateAll`](super::AllocateAll), which differ
/// only in what one attempt does.
pub(crate) struct Wait {
    /// What the request needs in all (for the queue's statistics and the logs).
    pub(crate) bytes: usize,
    /// Our entry in the resource's queue, while we wait.
    id: Option<u64>,
    /// When it started waiting (its first try failed).
    started: Option<Instant>,
    /// How long it may wait, counted from `started`.
    pub(crate) limit: Option<Duration>,
    pub(crate) deadline: Option<Instant>,
    timer: Option<Deadline>,
}

impl Wait {
    pub(crate) fn new(bytes: usize) -> Self {
        Self {
            bytes,
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
    pub(crate) fn poll<T>(
        &mut self,
        waiters: Option<&MemoryWaiters>,
        cx: &mut Context<'_>,
        mut attempt: impl FnMut(Attempt) -> Result<T>,
    ) -> Poll<Result<T>> {
        // The common case, kept to one try: not queued, nobody waiting.
        if self.id.is_none() && waiters.is_none_or(|w| w.is_empty()) {
            match attempt(Attempt::Fresh) {
                Ok(got) => return Poll::Ready(Ok(got)),
                Err(e) if worth_waiting(&e) && waiters.is_some() => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        let try_now = match (self.id, waiters) {
            // Not queued and the try above failed, or others wait (FIFO: queue behind them).
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
                Err(e) if worth_waiting(&e) && waiters.is_some() => {}
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
            // once more if we are first in line.
            if first {
                if let Ok(got) = attempt(Attempt::Head) {
                    self.leave(Some(waiters), Leave::Served(Duration::ZERO));
                    return Poll::Ready(Ok(got));
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
                None => self.timer = Some(Deadline::new(at, cx.waker())),
            }
        }
        Poll::Pending
    }
}

/// An error that waiting can cure: out of memory now, within what the resource could hold.
pub(crate) fn worth_waiting(e: &Error) -> bool {
    matches!(e, Error::OutOfMemory { requested, maximum, .. } if requested <= maximum)
}
