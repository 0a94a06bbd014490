//! Giving wholly free upstream chunks back: [`trim`](ArenaResource::trim) and
//! [`trim_blocking`](ArenaResource::trim_blocking), and the same without waiting when an
//! allocation needs the room to grow a larger chunk.

use super::global::WholeChunk;
use super::ArenaResource;
use crate::device::DevicePtr;
use crate::error::{Error, Result};
use crate::resource::held_for_trim::Ticket;
use crate::resource::trim_waits::{run_blocking, Await, Block, TrimWaits};
use crate::resource::MemoryResource;
use crate::sync::Ordering;

/// Chunks taken out of the global arena for a trim, held in the arena's `held_for_trim` list
/// under the trim's ticket while it waits (a request at the maximum may take them back
/// meanwhile: `ArenaResource::recall_trimmed`). Dropped before they went upstream (the trim
/// future was dropped, or a wait failed), those still the trim's go back to the global arena
/// as they were, and the memory waiters are told: what makes [`ArenaResource::trim`]
/// cancel-safe.
struct Taken<'a, U: MemoryResource> {
    arena: &'a ArenaResource<U>,
    /// `None` once the chunks went on their way upstream.
    ticket: Option<Ticket>,
}

impl<U: MemoryResource> Drop for Taken<'_, U> {
    fn drop(&mut self) {
        let Some(ticket) = self.ticket.take() else {
            return;
        };
        let mut restored = false;
        self.arena.held_for_trim.put_back(ticket, |chunks| {
            restored = !chunks.is_empty();
            self.arena.restore_chunks(chunks);
        });
        // While the chunks were out they still counted against the maximum: a request at the
        // maximum was refused, and its `allocate_async` waits for memory to come back. This is
        // it coming back, and no free may follow to wake it (a review found it waiting forever).
        if restored {
            self.arena.waiters.notify();
        }
    }
}

impl<U: MemoryResource> Taken<'_, U> {
    /// The chunks at `bases` back in the global arena, free, with their guards (a later user
    /// is still ordered after them); the rest stays held for the trim. Waiters are told, as
    /// when the trim ends: a request refused at the maximum meanwhile may fit now.
    fn keep(&self, bases: &[u64]) {
        let Some(ticket) = self.ticket.filter(|_| !bases.is_empty()) else {
            return;
        };
        let kept = (self.arena.held_for_trim).put_back_some(
            ticket,
            |chunk| bases.contains(&chunk.base),
            |chunks| self.arena.restore_chunks(chunks),
        );
        if kept > 0 {
            self.arena.waiters.notify();
        }
    }
}

/// A trim's wait for a chunk's guard that failed (the work that last used the chunk failed:
/// a sticky error, as a faulting kernel gives a stream or a CUDA context; or the wait call
/// itself failed): logged, and the chunk's base, which the trim keeps in the arena, free,
/// still guarded, while the rest is released. Not the trim's error: a failed event stays
/// failed, and a trim that failed for it would release nothing for the process's life (a
/// review found the arena's trims doing so; the pools' were fixed before).
fn failed_guard(chunk: &WholeChunk, error: &Error) -> u64 {
    tracing::warn!(
        error = %error,
        chunk = chunk.base,
        size = chunk.size,
        "trim: the work that last used an arena chunk failed; the chunk stays in the arena, free"
    );
    chunk.base
}

impl<U: MemoryResource> ArenaResource<U> {
    /// Returns every wholly free upstream chunk to the upstream, and returns the bytes given
    /// back. First every stream arena adopts its remote frees and gives its wholly free
    /// superblocks back to the global arena (a [`defragment`](Self::defragment)); a chunk that
    /// is then one free region goes. It waits (by `.await`, holding no lock) for the events
    /// that guard each chunk, the last work of every stream that used it, then frees it
    /// upstream on the arena's own stream. Chunks with a live block stay. Waiters in
    /// [`allocate_async`](crate::AllocateAsync::allocate_async) are woken when bytes went
    /// back: the room under the maximum grew. While it waits, a request at the maximum that
    /// only those chunks could serve takes them back (ordered after their last users, as any
    /// reuse is), as the pool's does; the trim then gives back only what is still its own.
    ///
    /// Errors: the upstream's error for a chunk it refused (that chunk stays, usable as before;
    /// the others still go). Nothing is lost either way.
    ///
    /// A chunk whose guard's wait fails (the work that last used it failed: a sticky error, as
    /// a faulting kernel gives a stream or a CUDA context) does not fail the trim: it stays in
    /// the arena, free and still guarded (logged at warn level), and the rest is released; the
    /// trim returns `Ok` with the bytes it did release. Before, one such chunk made every trim
    /// fail, releasing nothing, for the process's life.
    ///
    /// Beside a user's graph capture: superblocks that a capturing stream's arena holds stay
    /// with it (no guard can be recorded on that stream until the capture ends; logged at
    /// debug level as kept for a capture), and so does their chunk; chunks freed before the
    /// capture began, and every other chunk, go as usual (their guards are events recorded
    /// before it). The trim returns `Ok` with the bytes it gave back.
    ///
    /// # Cancel safety
    /// Cancel-safe: dropped while it waits, it puts the chunks it took back where they were,
    /// free and usable, and wakes the waiters of `allocate_async` (a request at the maximum was
    /// refused while the chunks were out); the chunks already given back stay given back.
    pub async fn trim(&self) -> Result<usize> {
        self.trim_with(Await).await
    }

    /// [`trim`](Self::trim) for synchronous code: blocks the calling thread while it waits for
    /// the GPU.
    pub fn trim_blocking(&self) -> Result<usize> {
        run_blocking(self.trim_with(Block))
    }

    /// The trim, waiting with `waits` (`.await` or blocking).
    async fn trim_with(&self, waits: impl TrimWaits) -> Result<usize> {
        let (taken, chunks) = self.take_for_trim();
        tracing::debug!(
            chunks = chunks.len(),
            "trim: waiting for the chunks' guards"
        );
        let mut failed = Vec::new();
        for chunk in &chunks {
            for guard in &chunk.guards.0 {
                // An event that withholds its callbacks fails its waits, yet the trim goes on:
                // `return_chunks` leaks that chunk, and the others still go.
                if let Err(e) = waits.event(&guard.event).await {
                    if !guard.event.withholds_callbacks() {
                        failed.push(failed_guard(chunk, &e));
                        break;
                    }
                }
            }
        }
        taken.keep(&failed);
        self.finish_trim(taken)
    }

    /// Takes the wholly free chunks out of the global arena for a trim, held under its ticket,
    /// and a copy of them (to wait for their guards).
    fn take_for_trim(&self) -> (Taken<'_, U>, Vec<WholeChunk>) {
        // Under `slow`: a request does not look while superblocks move to the global arena.
        let _slow = self.slow.lock();
        self.defragment_quietly();
        let (ticket, chunks) = (self.held_for_trim).hold(|| self.global.lock().take_whole_chunks());
        let taken = Taken {
            arena: self,
            ticket: Some(ticket),
        };
        (taken, chunks)
    }

    /// Gives upstream the chunks still the trim's once its waits are over (a request at the
    /// maximum may have taken some back meanwhile). With no lock held: over `CudaResource`
    /// each is a `cuMemFree`, which waits for the whole device to be idle, and no request
    /// waits for it.
    fn finish_trim(&self, mut taken: Taken<'_, U>) -> Result<usize> {
        let Some(ticket) = taken.ticket.take() else {
            return Ok(0);
        };
        let chunks = self.held_for_trim.release(ticket);
        // Here, not around the waits: a span entered across an `.await` would make the trim's
        // future not `Send`.
        let _span = tracing::debug_span!("trim", chunks = chunks.len()).entered();
        let (released, error) = self.return_chunks(chunks, true);
        self.held_for_trim.given_back();
        tracing::debug!(released, "trimmed");
        // Room under the maximum came back, or a chunk the upstream refused came back to the
        // global arena (see `Taken`'s drop): either may serve a request refused meanwhile.
        if released > 0 || error.is_some() {
            self.waiters.notify();
        }
        match error {
            Some(e) => Err(e),
            None => Ok(released as usize),
        }
    }

    /// Frees chunks taken out of the global arena upstream, on the arena's own stream after it
    /// waits (on the GPU) for each chunk's guards. A chunk whose wait or free fails goes back
    /// to the global arena, with its guards. Returns the bytes given back and the first error.
    /// With `settle` the bytes leave `reserved` as each chunk goes; without, they stay there
    /// for the caller to take off (a growth keeps the room for itself: `GrowthClaim`).
    pub(super) fn return_chunks(
        &self,
        chunks: Vec<WholeChunk>,
        settle: bool,
    ) -> (u64, Option<Error>) {
        let mut first_error = None;
        // What is owed if the upstream's `deallocate` unwinds (see `ReturnLeft`).
        let mut left = ReturnLeft {
            arena: self,
            chunks: chunks.into_iter(),
            in_flight: 0,
            released: 0,
            settle,
        };
        for chunk in left.chunks.by_ref() {
            left.in_flight = chunk.size;
            let freed = chunk.guards.order(&self.own).and_then(|ordered| {
                if !ordered {
                    // A guard withholds its callbacks: nothing says the GPU is done with the
                    // chunk, so it is leaked (back in the chunk map, all of it leaked: never
                    // handed out, never given back), still counted in `reserved`.
                    let mut global = self.global.lock();
                    global.chunks.insert(chunk.base, chunk.size);
                    global.leak(chunk.base, chunk.size);
                    return Ok(false);
                }
                // SAFETY: a whole chunk, out of the global arena's regions and chunk map, so
                // nothing can hand it out again; it came from this upstream with this size
                // (`grow` or `new` registered it so), and every use of it is ordered before
                // this point of our own stream: its guards are the last events of every stream
                // that freed memory in it, and we just made our stream wait for them.
                unsafe {
                    self.upstream
                        .deallocate(DevicePtr(chunk.base), chunk.size as usize, &self.own)
                }
                .map(|()| true)
            });
            left.in_flight = 0;
            match freed {
                Ok(false) => {}
                Ok(true) => {
                    if settle {
                        self.reserved.fetch_sub(chunk.size, Ordering::AcqRel);
                    }
                    self.chunks_released.fetch_add(1, Ordering::Relaxed);
                    left.released += chunk.size;
                    tracing::debug!(base = chunk.base, size = chunk.size, "chunk given back");
                }
                Err(e) => {
                    tracing::debug!(error = %e, base = chunk.base, "chunk kept");
                    self.global.lock().restore_chunk(chunk);
                    first_error.get_or_insert(e);
                }
            }
        }
        (left.released, first_error)
    }
}

/// A return of whole chunks upstream ([`ArenaResource::return_chunks`]) under way, for the
/// case that the upstream's `deallocate` (or the guards' ordering) unwinds: the chunks not yet
/// given back go back to the global arena (out of it, and still counted, they were lost to the
/// arena for good: a review's finding), and the room of the chunk in flight (whether the
/// upstream took it back or not, it is no longer the arena's) and, without `settle` (a
/// growth's), of those given back already leaves `reserved`, since no growth takes it over.
struct ReturnLeft<'a, U: MemoryResource> {
    arena: &'a ArenaResource<U>,
    /// The chunks not yet given back.
    chunks: std::vec::IntoIter<WholeChunk>,
    /// The size of the chunk on its way upstream, 0 between chunks.
    in_flight: u64,
    /// Bytes given back so far.
    released: u64,
    settle: bool,
}

impl<U: MemoryResource> Drop for ReturnLeft<'_, U> {
    fn drop(&mut self) {
        if self.in_flight == 0 {
            return;
        }
        let arena = self.arena;
        let rest: Vec<WholeChunk> = self.chunks.by_ref().collect();
        tracing::error!(
            chunk = self.in_flight,
            left = rest.len(),
            "the upstream panicked giving a chunk back: the chunk is taken as given back, the \
             others go back to the arena"
        );
        let given_up = self.in_flight + if self.settle { 0 } else { self.released };
        arena.reserved.fetch_sub(given_up, Ordering::AcqRel);
        let mut global = arena.global.lock();
        for chunk in rest {
            global.restore_chunk(chunk);
        }
        drop(global);
        // The room, and the chunks back: a request refused meanwhile may fit; and a request
        // that found nothing held by a trim looks again (the epoch moves on, as at its end).
        arena.held_for_trim.given_back();
        arena.waiters.notify();
    }
}

impl<U: MemoryResource> ArenaResource<U> {
    /// For a request whose growth failed for want of memory (at the maximum): the chunks that
    /// trims hold while they wait for the GPU, back in the global arena with their guards (so
    /// that their reuse is ordered after their last users, as any reuse of a free region is);
    /// whether the request should look and grow once more (there were some, or since it read
    /// `epoch` a trim put its chunks back or finished giving them back). Called under `slow`.
    pub(super) fn recall_trimmed(&self, epoch: u64) -> bool {
        (self.held_for_trim).recall(epoch, |chunks| self.restore_chunks(chunks))
    }

    /// Chunks a trim held back in the global arena as they were, free, with their guards.
    fn restore_chunks(&self, chunks: Vec<WholeChunk>) {
        let mut global = self.global.lock();
        for chunk in chunks {
            global.restore_chunk(chunk);
        }
    }
}
