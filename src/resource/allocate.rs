//! `allocate_async`: an allocation that waits for memory instead of failing.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::allocate_all::AllocateAll;
use super::wait::Wait;
use super::MemoryResource;
use crate::device::DevicePtr;
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::stream::Stream;

/// `allocate_async` for every [`MemoryResource`] (and `dyn MemoryResource`).
pub trait AllocateAsync: MemoryResource {
    /// Allocates `bytes` for `stream`, waiting (as a future, no thread parked) while the
    /// resource is out of memory but could get memory back: a pool at its maximum, a limiting
    /// adaptor. It returns at once when memory is there, through the same path as
    /// [`allocate`](MemoryResource::allocate). A request larger than the resource could ever
    /// hold, or any error other than running out, fails at once. Waiters are served first come,
    /// first served (see [`MemoryWaiters`](crate::MemoryWaiters)). Add a deadline with
    /// [`Allocate::timeout`].
    fn allocate_async<'a>(&'a self, bytes: usize, stream: &'a Stream) -> Allocate<'a, Self> {
        Allocate {
            resource: self,
            stream,
            // An overflowing size fails its check before it is compared.
            wait: Wait::needing(bytes, self.footprint(bytes).unwrap_or(usize::MAX)),
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
///
/// Leaking it instead (`mem::forget` of a future that has waited, or of the task that holds
/// it) leaves its entry in the queue for good, and the queue is strictly first come, first
/// served: once that entry is first, the waiters behind it (and every later `allocate_async`)
/// wait until their deadlines, or for ever without one. Nothing unsafe happens, but drop a
/// waiting future; never forget it.
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
    ///
    /// The deadlines' thread (`sa-timer`) starts the first time a request with a deadline has
    /// to wait. If the operating system cannot start it, that request ends with
    /// [`Error::Io`](crate::Error::Io) instead of waiting past its deadline; a later one tries
    /// again.
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
        if bytes == 0 {
            // Costs nothing and never waits (a null pointer), queue or no queue.
            return Poll::Ready(resource.allocate(0, stream));
        }
        this.wait.poll(
            resource.memory_waiters(),
            cx,
            |_| resource.allocate(bytes, stream),
            || {
                resource.device().check_same(stream.device())?;
                // The footprint, so that one that overflows (an adaptor's padding) is the
                // adaptor's error here too, not an out-of-memory at the maximum.
                resource.footprint(bytes)?;
                // A request that no layer can ever hold (its padded size past the pool's
                // maximum under a limit that counts it unpadded) fails now, not at the head.
                resource.check_set(&[bytes])
            },
        )
    }
}

impl<R: MemoryResource + ?Sized> Drop for Allocate<'_, R> {
    fn drop(&mut self) {
        // Cancelled while waiting: leave the queue, passing on a wakeup we may have been given.
        let waiters = self.resource.memory_waiters();
        self.wait.cancel(waiters);
    }
}
