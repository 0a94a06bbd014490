//! `allocate_async`: an allocation that waits for memory instead of failing.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

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
            bytes,
            stream,
            id: None,
            started: None,
            limit: None,
            deadline: None,
            timer: None,
        }
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
    bytes: usize,
    stream: &'a Stream,
    /// Our entry in the resource's queue, while we wait.
    id: Option<u64>,
    /// When it started waiting (its first try failed).
    started: Option<Instant>,
    /// How long it may wait, counted from `started`.
    limit: Option<Duration>,
    deadline: Option<Instant>,
    timer: Option<Deadline>,
}

impl<R: MemoryResource + ?Sized> fmt::Debug for Allocate<'_, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Allocate")
            .field("bytes", &self.bytes)
            .field("waiting", &self.id.is_some())
            .finish()
    }
}

impl<'a, R: MemoryResource + ?Sized> Allocate<'a, R> {
    /// Gives up with [`Error::Timeout`] (saying how long it waited) if no memory came within
    /// `limit` of the moment it started waiting (its first try failing; memory that is there at
    /// once never times out). Works on any runtime: a crate thread keeps the deadlines. A limit
    /// so long that its end cannot be represented (`Duration::MAX`, say) means no limit.
    pub fn timeout(mut self, limit: Duration) -> Self {
        self.limit = Some(limit);
        self
    }

    /// Like [`timeout`](Self::timeout), with an instant.
    pub fn deadline(mut self, at: Instant) -> Self {
        self.deadline = Some(at);
        self
    }

    fn waiters(&self) -> Option<&'a MemoryWaiters> {
        self.resource.memory_waiters()
    }

    fn leave(&mut self, why: Leave) {
        if let (Some(id), Some(w)) = (self.id.take(), self.waiters()) {
            w.remove(id, why);
        }
        self.timer = None;
    }
}

/// An error that waiting can cure: out of memory now, within what the resource could hold.
fn worth_waiting(e: &Error) -> bool {
    matches!(e, Error::OutOfMemory { requested, maximum, .. } if requested <= maximum)
}

impl<R: MemoryResource + ?Sized> Future for Allocate<'_, R> {
    type Output = Result<DevicePtr>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<DevicePtr>> {
        let this = self.get_mut();
        let waiters = this.waiters();
        // The common case, kept to one try: not queued, nobody waiting.
        if this.id.is_none() && waiters.is_none_or(|w| w.is_empty()) {
            match this.resource.allocate(this.bytes, this.stream) {
                Ok(ptr) => return Poll::Ready(Ok(ptr)),
                Err(e) if worth_waiting(&e) && waiters.is_some() => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        let try_now = match (this.id, waiters) {
            // Not queued and the try above failed, or others wait (FIFO: queue behind them).
            (None, _) => false,
            // Queued: try when woken with the baton.
            (Some(id), Some(w)) => w.poll_entry(id, cx.waker()).unwrap_or(true),
            (Some(_), None) => true,
        };
        if try_now {
            match this.resource.allocate(this.bytes, this.stream) {
                Ok(ptr) => {
                    let waited = this.started.map(|t| t.elapsed()).unwrap_or_default();
                    this.leave(Leave::Served(waited));
                    return Poll::Ready(Ok(ptr));
                }
                Err(e) if worth_waiting(&e) && waiters.is_some() => {}
                Err(e) => {
                    this.leave(Leave::Cancelled);
                    return Poll::Ready(Err(e));
                }
            }
        }
        let Some(waiters) = waiters else {
            unreachable!("without a queue every outcome above returns")
        };
        if this.id.is_none() {
            let started = waiters::now();
            this.started = Some(started);
            // A limit too far ahead to be an `Instant` (`Duration::MAX`: "no limit") sets no
            // deadline.
            if let Some(at) = this.limit.and_then(|limit| started.checked_add(limit)) {
                this.deadline = Some(this.deadline.map_or(at, |d| d.min(at)));
            }
            tracing::debug!(bytes = this.bytes, stream = %this.stream.id(), "waiting for memory");
            let (id, first) = waiters.register(this.bytes, cx.waker());
            this.id = Some(id);
            // Memory freed between our failed try and the registration notified nobody: try
            // once more if we are first in line.
            if first {
                if let Ok(ptr) = this.resource.allocate(this.bytes, this.stream) {
                    this.leave(Leave::Served(Duration::ZERO));
                    return Poll::Ready(Ok(ptr));
                }
            }
        }
        if let Some(at) = this.deadline {
            if Instant::now() >= at {
                let waited = this.started.map(|t| t.elapsed()).unwrap_or_default();
                this.leave(Leave::TimedOut);
                tracing::debug!(bytes = this.bytes, ?waited, "wait for memory timed out");
                return Poll::Ready(Err(Error::Timeout { waited }));
            }
            match &this.timer {
                Some(timer) => timer.set_waker(cx.waker()),
                None => this.timer = Some(Deadline::new(at, cx.waker())),
            }
        }
        Poll::Pending
    }
}

impl<R: MemoryResource + ?Sized> Drop for Allocate<'_, R> {
    fn drop(&mut self) {
        // Cancelled while waiting: leave the queue, passing on a wakeup we may have been given.
        if self.id.is_some() {
            self.leave(Leave::Cancelled);
        }
    }
}
