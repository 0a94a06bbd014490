//! `allocate_all_async`: several allocations at once, all or none, waiting for memory as one.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::wait::{Attempt, Wait};
use super::MemoryResource;
use crate::device::DevicePtr;
use crate::error::{Error, Result};
use crate::stream::Stream;

/// The future of [`AllocateAsync::allocate_all_async`](super::AllocateAsync::allocate_all_async):
/// every request of a set, or none.
///
/// # Cancel safety
/// Cancel-safe: dropping it while it waits removes it from the queue (passing on a wakeup it
/// may have been given, as [`Allocate`](super::Allocate) does), and it holds no memory while
/// it waits: a try that could not complete the set gave back what it took before returning.
/// Never forget (`mem::forget`) a waiting one: see [`Allocate`](super::Allocate).
#[must_use = "futures do nothing unless awaited"]
pub struct AllocateAll<'a, R: MemoryResource + ?Sized> {
    set: Set<'a, R>,
    wait: Wait,
}

/// What an [`AllocateAll`] asks for, apart from its place in the queue.
struct Set<'a, R: MemoryResource + ?Sized> {
    resource: &'a R,
    /// The requests, in the caller's order.
    requests: Vec<(usize, &'a Stream)>,
    /// Indices into `requests`, largest first: the order each try allocates in.
    order: Vec<usize>,
    /// The sum of the requests' [`footprint`](MemoryResource::footprint)s (their sizes rounded
    /// up to the alignment, unless an adaptor asks more); `None` if it overflows.
    total: Option<usize>,
}

impl<R: MemoryResource + ?Sized> fmt::Debug for AllocateAll<'_, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AllocateAll")
            .field(
                "sizes",
                &self.set.requests.iter().map(|r| r.0).collect::<Vec<_>>(),
            )
            .field("total", &self.set.total)
            .field("waiting", &self.wait.is_queued())
            .finish()
    }
}

impl<'a, R: MemoryResource + ?Sized> AllocateAll<'a, R> {
    pub(crate) fn new(resource: &'a R, requests: Vec<(usize, &'a Stream)>) -> Self {
        // What each request takes of the resource, as its layers count it (an aligned
        // adaptor's padding included): a set whose sum is above a maximum can never fit.
        let total = requests.iter().try_fold(0usize, |sum, &(bytes, _)| {
            sum.checked_add(resource.footprint(bytes).ok()?)
        });
        let mut order: Vec<usize> = (0..requests.len()).collect();
        // Stable: equal sizes keep the caller's order.
        order.sort_by_key(|&i| std::cmp::Reverse(requests[i].0));
        Self {
            set: Set {
                resource,
                requests,
                order,
                total,
            },
            wait: Wait::new(total.unwrap_or(usize::MAX)),
        }
    }

    /// Gives up with [`Error::Timeout`] if the set could not be had within `limit` of the
    /// moment it started waiting; see [`Allocate::timeout`](super::Allocate::timeout).
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

/// A set whose sizes, each rounded up, add up to more than `usize::MAX`.
fn overflow() -> Error {
    Error::InvalidSize {
        size: usize::MAX,
        reason: "the sizes of the set, each rounded up to the 256-byte alignment (and padded \
                 as the resource's adaptors ask), add up to more than usize::MAX",
    }
}

impl<R: MemoryResource + ?Sized> Set<'_, R> {
    /// One try at the whole set: every request, largest first; on the first failure, what was
    /// taken goes back and the error says what the whole set needed.
    fn attempt(&self, how: Attempt) -> Result<Vec<DevicePtr>> {
        let Some(total) = self.total else {
            return Err(overflow());
        };
        // What this try took goes back on an unwind too: a resource whose `allocate` panics
        // partway through the set (a failure callback or a log writer of the user's that
        // panics), caught by the caller, would otherwise lose the requests taken before it.
        let mut taken = Taken {
            set: self,
            got: vec![None; self.requests.len()],
            how,
        };
        for &i in &self.order {
            let (bytes, stream) = self.requests[i];
            match self.resource.allocate(bytes, stream) {
                Ok(ptr) => taken.got[i] = Some(ptr),
                Err(e) => {
                    drop(taken);
                    // A set that some layer can never hold, as that layer counts it: its
                    // error, which no wait cures. (The sum below is the top layer's count; a
                    // layer beneath may count more: an aligned adaptor's padding.)
                    if e.is_out_of_memory() {
                        self.check_sizes()?;
                    }
                    return Err(match e {
                        // The set as a whole: waiting is worth it only if the sum can ever fit.
                        Error::OutOfMemory {
                            requested,
                            available,
                            maximum,
                        } => Error::OutOfMemory {
                            requested: requested.max(total),
                            available,
                            maximum,
                        },
                        other => other,
                    });
                }
            }
        }
        let got = std::mem::take(&mut taken.got);
        Ok(got
            .into_iter()
            .map(|p| p.expect("every request was allocated"))
            .collect())
    }

    /// What no wait can cure, found without allocating: a total that overflows, a stream of
    /// another device.
    fn check(&self) -> Result<()> {
        if self.total.is_none() {
            return Err(overflow());
        }
        (self.requests.iter())
            .try_for_each(|&(_, stream)| self.resource.device().check_same(stream.device()))?;
        self.check_sizes()
    }

    /// Whether every layer of the resource can ever hold the set
    /// ([`MemoryResource::check_set`]).
    fn check_sizes(&self) -> Result<()> {
        let sizes: Vec<usize> = self.requests.iter().map(|&(bytes, _)| bytes).collect();
        self.resource.check_set(&sizes)
    }

    /// Gives back the part of the set that a failed try took. The head waiter does it quietly
    /// (its own notifications would wake only itself, into a loop of failing tries; see
    /// `MemoryWaiters::quietly`); a fresh try loudly (the head may have failed because of it).
    fn give_back(&self, got: &[Option<DevicePtr>], how: Attempt) {
        let undo = || {
            for (&(bytes, stream), ptr) in self.requests.iter().zip(got) {
                let Some(ptr) = *ptr else { continue };
                // SAFETY: `ptr` came from `allocate(bytes, stream)` of this resource in this
                // try, nothing was queued on it (it never left this function), and it is given
                // back once, on the stream it was allocated for.
                if let Err(e) = unsafe { self.resource.deallocate(ptr, bytes, stream) } {
                    // Nothing to do but say so: the resource refused its own pointer.
                    tracing::warn!(error = %e, ptr = ptr.0, bytes, "allocate_all: give-back failed");
                }
            }
        };
        super::wait::give_back(how, self.resource.memory_waiters(), undo);
    }
}

/// The part of a set that one try has taken: given back when dropped (a failed try, or an
/// unwind out of the resource's `allocate`), unless the try took it all and emptied `got`.
struct Taken<'s, 'a, R: MemoryResource + ?Sized> {
    set: &'s Set<'a, R>,
    got: Vec<Option<DevicePtr>>,
    how: Attempt,
}

impl<R: MemoryResource + ?Sized> Drop for Taken<'_, '_, R> {
    fn drop(&mut self) {
        if self.got.iter().any(Option::is_some) {
            self.set.give_back(&self.got, self.how);
        }
    }
}

impl<R: MemoryResource + ?Sized> Future for AllocateAll<'_, R> {
    type Output = Result<Vec<DevicePtr>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Vec<DevicePtr>>> {
        let this = self.get_mut();
        let set = &this.set;
        if set.requests.is_empty() {
            return Poll::Ready(Ok(Vec::new()));
        }
        if set.requests.iter().all(|&(bytes, _)| bytes == 0) {
            // Costs nothing and never waits (null pointers), queue or no queue, as a single
            // request of 0 bytes (`Allocate`); a review found such a set queued behind a
            // waiter for memory that might never come.
            return Poll::Ready(set.attempt(Attempt::Fresh));
        }
        this.wait.poll(
            set.resource.memory_waiters(),
            cx,
            |how| set.attempt(how),
            || set.check(),
        )
    }
}

impl<R: MemoryResource + ?Sized> Drop for AllocateAll<'_, R> {
    fn drop(&mut self) {
        let waiters = self.set.resource.memory_waiters();
        self.wait.cancel(waiters);
    }
}
