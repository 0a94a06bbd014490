//! How an arena serves requests and takes memory back: stream arenas, superblocks taken from
//! the global arena, moved between streams and returned to it, large blocks, growth, and
//! frees (on the owner's stream or on another).

use super::global::{Guard, Guards, Large, Lent, WholeChunk};
use super::stream_arena::{cache, LocalFree, Remote, StreamArena};
use super::ArenaResource;
use crate::device::DevicePtr;
use crate::error::{Error, Result};
use crate::resource::give_backs::GrowthClaim;
use crate::resource::growth::{step_within_free, Unreserve};
use crate::resource::{MemoryResource, ALIGNMENT};
use crate::stream::{Stream, StreamId};
use crate::sync::{Arc, MutexGuard, Ordering};
// The planted bugs' switches, read through `planted!` (they exist only under the loom cfg).
#[cfg(streamalloc_loom)]
use super::planted;

impl<U: MemoryResource> ArenaResource<U> {
    // ===== stream arenas =====

    /// The arena of `stream`, made on first use.
    ///
    /// Making one also lets go of the arenas of streams the user dropped
    /// ([`let_go_of_dropped`](Self::let_go_of_dropped)): each holds a handle of its stream
    /// (and so the driver's stream) until it is forgotten, which only a defragmentation did,
    /// and a program that makes a stream per task and never runs short kept every one of them.
    /// A new stream is when a program that drops streams makes another, and the registry's lock
    /// is taken then anyway: no cost on the paths that find their arena.
    pub(super) fn arena_for(&self, stream: &Stream) -> Arc<StreamArena> {
        let id = stream.id().get();
        if let Some(arena) = cache::get(self.uid, id) {
            return arena;
        }
        let (arena, dropped) = {
            let mut registry = self.registry.lock();
            if let Some(arena) = registry.get(&id) {
                (arena.clone(), Vec::new())
            } else {
                // Once 0, a count stays 0: nothing but a handle can make another.
                let dropped: Vec<Arc<StreamArena>> = (registry.values())
                    .filter(|a| a.stream.users() == 0)
                    .cloned()
                    .collect();
                let arena = Arc::new(StreamArena::new(stream));
                registry.insert(id, arena.clone());
                (arena, dropped)
            }
        };
        cache::put(self.uid, id, &arena);
        if !dropped.is_empty() {
            self.let_go_of_dropped(dropped);
        }
        arena
    }

    /// Gives back what the arenas of dropped streams hold free and forgets those left with
    /// nothing (see [`tidy`](Self::tidy): their superblocks go back to the global arena guarded
    /// by an event recorded on their stream, so whoever takes them is ordered after its work),
    /// letting go of their stream. Under `slow`, as a defragmentation, so that a request about
    /// to fail sees no superblock halfway to the global arena; where something holds it (a
    /// request that grows, on this thread too: a growth looks its arena up under it) this waits
    /// for nothing and lets them be: the next new stream or defragmentation lets go of them.
    fn let_go_of_dropped(&self, dropped: Vec<Arc<StreamArena>>) {
        let Some(_slow) = self.slow.try_lock() else {
            return;
        };
        let _span = tracing::debug_span!("let_go_of_dropped", arenas = dropped.len()).entered();
        for arena in &dropped {
            // The frees that made these superblocks free have woken the waiters already (as
            // for `defragment_quietly`).
            self.tidy(arena);
        }
        // The handles of the streams forgotten go here, last: a stream's drop takes locks of
        // its own (it went with `_slow` held before as well, in `defragment_quietly`).
        drop(dropped);
    }

    /// The arena of `stream` if it has one.
    fn existing_arena_for(&self, stream: &Stream) -> Option<Arc<StreamArena>> {
        let id = stream.id().get();
        cache::get(self.uid, id).or_else(|| self.registry.lock().get(&id).cloned())
    }

    /// Orders `arena`'s stream after the streams its remote frees were issued on, then gives
    /// the blocks to its free list; takes `want` bytes afterwards if asked. A block whose
    /// superblock moved to another stream arena meanwhile is forwarded to it. The frees of a
    /// stream under a user's graph capture stay queued; the capture's error is noted in
    /// `skipped` (see [`with_retries`](Self::with_retries)).
    pub(super) fn adopt(
        &self,
        arena: &StreamArena,
        remote: Vec<Remote>,
        want: Option<u64>,
        skipped: &mut Option<Error>,
    ) -> Result<Option<u64>> {
        let _span =
            tracing::debug_span!("adopt", stream = %arena.stream.id(), blocks = remote.len())
                .entered();
        let mut ordered: Vec<StreamId> = Vec::new();
        let mut capturing: Vec<StreamId> = Vec::new();
        for r in &remote {
            let id = r.stream.id();
            if id == arena.stream.id() || ordered.contains(&id) || capturing.contains(&id) {
                continue;
            }
            if planted!(ADOPT_UNORDERED) {
                // The planted bug: no ordering after the freeing stream.
                continue;
            }
            // The free was issued on `r.stream` before now, so this event comes after it.
            let ordering = match r.stream.record_unwatched() {
                Ok(event) => arena.stream.wait(&event),
                // The freeing stream under a user's graph capture: its frees cannot be ordered
                // after until the capture ends; the rest are adopted (a review found the
                // owner's request failing instead, as long as the capture lasted).
                Err(e @ Error::StreamCapturing { .. }) => {
                    capturing.push(id);
                    *skipped = Some(e);
                    continue;
                }
                Err(e) => Err(e),
            };
            if let Err(e) = ordering {
                self.put_back_remote(arena, remote);
                return Err(e);
            }
            ordered.push(id);
        }
        let remote = if capturing.is_empty() {
            remote
        } else {
            let (later, now): (Vec<Remote>, Vec<Remote>) =
                (remote.into_iter()).partition(|r| capturing.contains(&r.stream.id()));
            self.put_back_remote(arena, later);
            now
        };
        let mut moved_away = Vec::new();
        let got = {
            let mut state = arena.state.lock();
            for r in remote {
                match state.give(r.addr, r.size) {
                    LocalFree::Done => {}
                    LocalFree::NotMine => moved_away.push(r),
                    LocalFree::DoubleFree => tracing::warn!(
                        addr = r.addr,
                        size = r.size,
                        "a block freed on another stream was already free (double free)"
                    ),
                }
            }
            want.and_then(|size| state.take(size))
        };
        for r in moved_away {
            self.forward_remote(r);
        }
        Ok(got)
    }

    /// Remote frees an adoption took out of `arena` and could not order: they wait again, in
    /// the arena that holds their superblock now. One may have moved to another stream arena
    /// while they were out (a move takes only the remote frees still queued); put back into
    /// `arena`, it counted in `arena`'s remote bytes against superblocks `arena` no longer
    /// holds, and the new owner showed it in use (`stats().in_use` counted a freed block).
    fn put_back_remote(&self, arena: &StreamArena, remote: Vec<Remote>) {
        let moved_away: Vec<Remote> = {
            let mut state = arena.state.lock();
            let (mine, moved): (Vec<Remote>, Vec<Remote>) = remote
                .into_iter()
                .partition(|r| state.find(r.addr, r.size).is_some());
            state.remote.extend(mine);
            moved
        };
        for r in moved_away {
            self.forward_remote(r);
        }
    }

    /// A remote free whose superblock moved to another stream arena while it waited: it waits
    /// there now (still with the stream it was freed on, which that arena will wait for).
    fn forward_remote(&self, r: Remote) {
        let global = self.global.lock();
        let Some(owner) = global.owner_of(r.addr, r.size) else {
            tracing::warn!(
                addr = r.addr,
                size = r.size,
                "a block freed on another stream is in no superblock (double free)"
            );
            return;
        };
        // Global, then stream arena: the lock order of a move, which cannot slip in between.
        let mut state = owner.state.lock();
        drop(global);
        state.remote.push(r);
    }

    /// Gives superblocks (already out of `arena`) back to the global arena, guarded by an event
    /// on `arena`'s stream. If the event cannot be recorded they go back to the arena. Returns
    /// how many went to the global arena: none on that failure (`defragment` reports this
    /// count, and wakes the memory waiters only when memory really moved).
    pub(super) fn release(&self, arena: &StreamArena, superblocks: Vec<(u64, u64)>) -> usize {
        if superblocks.is_empty() {
            return 0;
        }
        let _span = tracing::debug_span!(
            "release_superblocks",
            stream = %arena.stream.id(),
            count = superblocks.len()
        )
        .entered();
        match self.record_guard(arena) {
            Ok(guard) => {
                let count = superblocks.len();
                let mut global = self.global.lock();
                for (base, size) in superblocks {
                    global.lent.remove(&base);
                    global.insert_free(base, size, Guards::one(guard.clone()));
                }
                count
            }
            Err(e) => {
                if let Error::StreamCapturing { .. } = e {
                    // Not a failure: the user's code is capturing the stream into a graph, and
                    // no guard can be recorded there until it ends (a trim keeps them).
                    tracing::debug!(error = %e, "superblocks kept for a capture: they stay with their stream");
                } else {
                    tracing::warn!(error = %e, "could not record an event: superblocks stay with their stream");
                }
                let mut state = arena.state.lock();
                for (base, size) in superblocks {
                    state.add_superblock(base, size);
                }
                0
            }
        }
    }

    /// Records a guard on `arena`'s stream. Every guard of a stream is recorded under its
    /// arena's lock, with a ticket taken there: so of two guards of one stream the higher ticket
    /// is the later event, and the global lock is never held across the driver call (it was,
    /// and every large free and superblock release waited on it: the arena's poor scaling).
    pub(super) fn record_guard(&self, arena: &StreamArena) -> Result<Guard> {
        let _order = arena.state.lock();
        let ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        // Queried (`is_complete`) by requests, never awaited or watched: no completion word,
        // whose write would cost each guard about 1.3 µs (the arena's `churn-1t` read 1.3 to
        // 1.5 times slower with it on an H100, BENCHMARKS, issue 18).
        let event = arena.stream.record_unwatched()?;
        Ok(Guard::new(arena.stream.id(), ticket, event))
    }

    /// [`defragment`](Self::defragment) without waking the waiters: what an allocation does
    /// before it fails. (A waiter retrying would otherwise wake itself with the superblocks
    /// its own retry returned; every free that made them free has notified already.)
    pub(super) fn defragment_quietly(&self) -> usize {
        let _span = tracing::debug_span!("defragment").entered();
        let mut returned = 0;
        for arena in self.arenas() {
            returned += self.tidy(&arena);
        }
        self.defragments.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(returned, "defragmented");
        returned
    }

    /// What a defragmentation does to one stream arena, under `slow`: it adopts its remote
    /// frees, gives its wholly free superblocks back to the global arena, and is forgotten if
    /// the user dropped its stream and it holds nothing. Returns how many superblocks went
    /// back.
    fn tidy(&self, arena: &Arc<StreamArena>) -> usize {
        let remote = std::mem::take(&mut arena.state.lock().remote);
        if !remote.is_empty() {
            if let Err(e) = self.adopt(arena, remote, None, &mut None) {
                tracing::debug!(error = %e, stream = %arena.stream.id(), "could not adopt remote frees");
            }
        }
        let empty = arena.state.lock().take_all_empty();
        // What `release` gave back, not what it tried to: a superblock whose guard could
        // not be recorded stays with its stream (it was counted as returned).
        let returned = self.release(arena, empty);
        // Forget the arena of a stream the user dropped, once it holds nothing.
        if arena.stream.users() == 0 {
            let mut registry = self.registry.lock();
            let mut state = arena.state.lock();
            if state.superblocks.is_empty() && state.remote.is_empty() {
                state.retired = true;
                registry.remove(&arena.stream.id().get());
            }
        }
        returned
    }

    // ===== allocation =====

    /// Tries `attempt`; then, one request at a time (`slow`), tries again, defragments and
    /// tries again; then, for a small request (`arena` given), moves a partly used superblock
    /// of another stream to `arena`; then grows by at least `grow_min` (or the room left under
    /// the maximum, if less and it holds `size`; giving wholly free chunks back upstream first
    /// where that is what makes room) and tries again; at the maximum, takes back what trims
    /// hold (`resource/held_for_trim.rs`) and tries and grows once more; then out of memory.
    ///
    /// Defragmenting, growing and giving chunks back move memory out of one place before it
    /// reaches another; a request that looked in between found nothing, and at the maximum
    /// failed with the memory free (eight threads on a fresh arena, each its first request:
    /// `tests/no_spurious_oom.rs`). They all run under `slow` (as `trim` and `defragment` do),
    /// so a request that holds it sees every move finished.
    ///
    /// `skipped`: the error of a stream under a user's graph capture whose memory the request
    /// passed over (its remote frees, a superblock it could lend), if any. A request that then
    /// ends out of memory fails with that error instead: memory it could have had is held up
    /// by the capture, and the end of a capture wakes no waiter, so an awaitable request must
    /// not wait for it (a review found one waiting after the capture ended, with the memory
    /// there). Before, such a request failed with the capture's error at once.
    fn with_retries(
        &self,
        size: u64,
        grow_min: u64,
        stream: &Stream,
        arena: Option<&Arc<StreamArena>>,
        mut skipped: Option<Error>,
        attempt: impl FnMut() -> Option<Result<u64>>,
    ) -> Result<u64> {
        let result = self.retries(size, grow_min, stream, arena, &mut skipped, attempt);
        match (result, skipped) {
            (Err(e), Some(capture)) if e.is_out_of_memory() => Err(capture),
            (result, _) => result,
        }
    }

    /// [`with_retries`](Self::with_retries)' steps.
    fn retries(
        &self,
        size: u64,
        grow_min: u64,
        stream: &Stream,
        arena: Option<&Arc<StreamArena>>,
        skipped: &mut Option<Error>,
        mut attempt: impl FnMut() -> Option<Result<u64>>,
    ) -> Result<u64> {
        if let Some(result) = attempt() {
            return result;
        }
        let mut slow = self.slow.lock();
        // Before the last looks: a trim that puts its chunks back after this is seen by the
        // recall below.
        let trim_epoch = self.held_for_trim.epoch();
        if let Some(result) = attempt() {
            return result;
        }
        self.defragment_quietly();
        if let Some(result) = attempt() {
            return result;
        }
        if let Some(arena) = arena {
            if let Some(result) = self.move_superblock(arena, size, skipped) {
                return result;
            }
        }
        // Another thread may take the new chunk before we do: grow again then. Each growth
        // raises `reserved`, so this ends at the maximum at the latest.
        let (mut recalled, mut waited) = (false, false);
        // The upstream's own limit, where a growth found it: the final error says no more is
        // available or could ever be held than the upstream allows.
        let (mut upstream_available, mut upstream_maximum) = (u64::MAX, u64::MAX);
        loop {
            let grown;
            (slow, grown) = self.grow(slow, grow_min, size, stream);
            // A maximum of 0 is an error without numbers (some out-of-memory errors leave them
            // for a caller to fill in): nothing known, nothing capped.
            if let Err(Error::OutOfMemory {
                available,
                maximum: maximum @ 1..,
                ..
            }) = grown
            {
                upstream_available = upstream_available.min(available as u64);
                upstream_maximum = upstream_maximum.min(maximum as u64);
            }
            match grown {
                Ok(()) => {
                    if let Some(result) = attempt() {
                        return result;
                    }
                }
                Err(e) if !e.is_out_of_memory() => return Err(e),
                // At the maximum, perhaps while a trim waits for the GPU with whole free chunks
                // out of the global arena: those back, one more look, and growth again (which
                // gives whole free chunks back upstream first where that makes room). A request
                // that can grow leaves the trims what they hold.
                Err(_) if !recalled && self.recall_trimmed(trim_epoch) => {
                    recalled = true;
                    if let Some(result) = attempt() {
                        return result;
                    }
                }
                Err(_) if !waited => {
                    // Another request may be giving chunks back upstream to grow, with `slow`
                    // let go: the room (and what its growth leaves free) comes back at its end.
                    let again;
                    (slow, again) = self.wait_for_growth_give_backs(slow);
                    if !again {
                        break;
                    }
                    waited = true;
                    if let Some(result) = attempt() {
                        return result;
                    }
                }
                Err(_) => break,
            }
        }
        drop(slow);
        let err = self.out_of_memory_within(size, upstream_available, upstream_maximum);
        let _span = tracing::debug_span!("out_of_memory", requested = size).entered();
        if tracing::enabled!(tracing::Level::DEBUG) {
            tracing::debug!(dump = %self.dump(), "arena out of memory");
        }
        Err(err)
    }

    pub(super) fn allocate_small(&self, size: u64, stream: &Stream) -> Result<u64> {
        let arena = self.arena_for(stream);
        let remote = {
            let mut state = arena.state.lock();
            if state.retired {
                // Unreachable through a live stream handle; look again, bypassing the cache.
                drop(state);
                cache::forget(self.uid);
                return self.allocate_small(size, stream);
            }
            if let Some(addr) = state.take(size) {
                return Ok(addr);
            }
            std::mem::take(&mut state.remote)
        };
        let mut skipped = None;
        if !remote.is_empty() {
            if let Some(addr) = self.adopt(&arena, remote, Some(size), &mut skipped)? {
                return Ok(addr);
            }
        }
        let grow_min = self.superblock.max(size);
        self.with_retries(size, grow_min, stream, Some(&arena), skipped, || {
            // Another thread on this stream may have freed or acquired memory meanwhile.
            if let Some(addr) = arena.state.lock().take(size) {
                return Some(Ok(addr));
            }
            self.acquire_superblock(&arena, size)
        })
    }

    /// Takes a superblock from the global arena for `arena` and `size` bytes from it.
    fn acquire_superblock(&self, arena: &Arc<StreamArena>, size: u64) -> Option<Result<u64>> {
        let (base, extent, guards) = {
            let mut global = self.global.lock();
            let (base, extent, guards) = global.take(self.superblock, size, self.superblock)?;
            global.lent.insert(
                base,
                Lent {
                    size: extent,
                    arena: arena.clone(),
                },
            );
            (base, extent, guards)
        };
        let _span = tracing::debug_span!(
            "acquire_superblock",
            stream = %arena.stream.id(),
            base,
            size = extent
        )
        .entered();
        match guards.order(&arena.stream) {
            Ok(true) => {}
            Ok(false) => {
                // A guard withholds its callbacks (it did so after `take` looked): leaked, not
                // used; the caller looks again, or grows.
                let mut global = self.global.lock();
                global.lent.remove(&base);
                global.leak(base, extent);
                return None;
            }
            Err(e) => {
                let mut global = self.global.lock();
                global.lent.remove(&base);
                global.insert_free(base, extent, guards);
                return Some(Err(e));
            }
        }
        let mut state = arena.state.lock();
        state.add_superblock(base, extent);
        Some(state.take(size).ok_or(Error::InvalidArgument {
            what: "a new superblock could not serve the request it was taken for",
        }))
    }

    /// Moves a partly used superblock with a free block of at least `size` bytes from another
    /// stream's arena to `recipient`, after `recipient`'s stream waits on an event recorded on
    /// the donor's (every block free in the donor's list was freed there, or adopted after the
    /// donor waited for its stream), and takes `size` bytes from it. RMM's defragmentation
    /// gives every superblock, partly used or not, to the global arena, where any arena can
    /// take it; this moves one, when a request needs it. Its live blocks go with it: their
    /// frees on the donor's stream become remote frees of `recipient`.
    ///
    /// Lock order: the global arena's (which keeps frees from looking up the owner halfway),
    /// then the donor's, released, then the recipient's.
    fn move_superblock(
        &self,
        recipient: &Arc<StreamArena>,
        size: u64,
        skipped: &mut Option<Error>,
    ) -> Option<Result<u64>> {
        let me = recipient.stream.id();
        let donors: Vec<Arc<StreamArena>> = self
            .arenas()
            .into_iter()
            .filter(|a| a.stream.id() != me)
            .collect();
        let mut global = self.global.lock();
        for donor in donors {
            let mut state = donor.state.lock();
            if state.retired {
                continue;
            }
            let Some(base) = state.best_to_move(size) else {
                continue;
            };
            let _span = tracing::debug_span!(
                "move_superblock",
                base,
                from = %donor.stream.id(),
                to = %me,
                requested = size
            )
            .entered();
            // Recorded under the donor's lock: every block in its list was freed before.
            let event = match donor.stream.record_unwatched() {
                Ok(event) => event,
                // The donor under a user's graph capture: its blocks cannot be ordered after
                // until the capture ends. Another donor, or a growth, serves (a review found
                // every other stream's request failing while one stream was captured).
                Err(e @ Error::StreamCapturing { .. }) => {
                    *skipped = Some(e);
                    continue;
                }
                Err(e) => return Some(Err(e)),
            };
            if let Err(e) = recipient.stream.wait(&event) {
                return Some(Err(e));
            }
            let moving = state.detach(base)?;
            drop(state);
            if let Some(lent) = global.lent.get_mut(&base) {
                lent.arena = recipient.clone();
            }
            let mut mine = recipient.state.lock();
            drop(global);
            mine.attach(moving);
            self.superblock_moves.fetch_add(1, Ordering::Relaxed);
            return Some(mine.take(size).ok_or(Error::InvalidArgument {
                what: "a moved superblock could not serve the request it was moved for",
            }));
        }
        None
    }

    pub(super) fn allocate_large(&self, size: u64, stream: &Stream) -> Result<u64> {
        self.with_retries(size, size, stream, None, None, || {
            let (addr, extent, guards) = {
                let mut global = self.global.lock();
                let (addr, extent, guards) = global.take(size, size, self.superblock)?;
                global.large.insert(addr, Large { size, extent });
                (addr, extent, guards)
            };
            match guards.order(stream) {
                Ok(true) => {}
                Ok(false) => {
                    // As in `acquire_superblock`: leaked, and the caller looks again.
                    let mut global = self.global.lock();
                    global.large.remove(&addr);
                    global.leak(addr, extent);
                    return None;
                }
                Err(e) => {
                    let mut global = self.global.lock();
                    global.large.remove(&addr);
                    global.insert_free(addr, extent, guards);
                    return Some(Err(e));
                }
            }
            Some(Ok(addr))
        })
    }

    /// Takes a new chunk of at least `min` bytes from the upstream, on `stream`, for a request
    /// of `need` bytes (at most `min`): where less than `min` is left under the maximum, what
    /// is left, if that holds `need`. If that fails for want of memory (the room under the
    /// maximum, or the upstream's), and giving the wholly free chunks back would make room, it
    /// gives them back (in stream order: the host does not wait for the GPU) and tries once
    /// more: free memory spread over chunks too small for the request would otherwise keep it
    /// failing forever, everything free or not.
    ///
    /// Called under `slow`, whose guard it takes and hands back: the give-back runs with `slow`
    /// let go. Over `CudaResource` each chunk given back is a `cuMemFree`, which waits for the
    /// whole device to be idle (milliseconds), and every other request that needs growth, a
    /// defragmentation or a superblock moved would wait that long behind `slow`. Letting it go
    /// is safe: the chunks are out of the global arena before (nothing else can hand them out
    /// or give them back), their bytes and the rest of the room this growth needs stay counted
    /// in `reserved` until it takes `slow` again (`GrowthClaim`: a request growing meanwhile
    /// grows only into what is left, so it cannot take the room this one gave memory back
    /// for, and the maximum holds), and a request at the maximum that finds nothing meanwhile
    /// waits for the give-back to end before it fails (`wait_for_growth_give_backs`).
    fn grow<'s>(
        &'s self,
        slow: MutexGuard<'s, ()>,
        min: u64,
        need: u64,
        stream: &Stream,
    ) -> (MutexGuard<'s, ()>, Result<()>) {
        // A small request grows by a superblock; with less than that left under the maximum,
        // no small request could ever use the room, and each would fail with it "available"
        // (a review's finding). A smaller superblock serves it instead.
        // Where even the request does not fit the room, the whole `min` is asked for: giving
        // wholly free chunks back below then makes room for a full superblock, as before.
        let room = (self.maximum).saturating_sub(self.reserved.load(Ordering::Relaxed));
        let min = if (need..min).contains(&room) {
            room
        } else {
            min
        };
        match self.grow_from_upstream(min, stream) {
            Err(e) if e.is_out_of_memory() => {
                let Some((mut claim, chunks)) = self.take_whole_chunks_for_growth(min) else {
                    return (slow, Err(e));
                };
                drop(slow);
                let _span = tracing::debug_span!(
                    "release_for_growth",
                    requested = min,
                    chunks = chunks.len()
                )
                .entered();
                // With no lock held (see above).
                let (released, error) = self.return_chunks(chunks, false);
                if let Some(e) = error {
                    tracing::warn!(error = %e, "could not give a free chunk back upstream to grow");
                }
                claim.claimed += released;
                let slow = self.slow.lock();
                // The room back for this growth, under `slow`: no other growth comes between.
                drop(claim);
                if released == 0 {
                    return (slow, Err(e));
                }
                let grown = self.grow_from_upstream(min, stream);
                (slow, grown)
            }
            other => (slow, other),
        }
    }

    fn grow_from_upstream(&self, min: u64, stream: &Stream) -> Result<()> {
        // A new chunk's guard is an event recorded on `stream`: refused under a user's graph
        // capture, after the chunk was allocated, and its free on the same stream refused too
        // (a chunk lost per growth: a review's finding). Refused before anything is allocated.
        stream.refuse_while_capturing("an arena's growth")?;
        let reserved = self.reserved.load(Ordering::Relaxed);
        let room = self.maximum.saturating_sub(reserved);
        if min > room {
            return Err(self.out_of_memory(min));
        }
        // Double what we hold (at least the request, at most the room left, and over device
        // memory no more beyond the request than is free: see `growth`); halve on failure.
        let mut attempt = reserved
            .max(min)
            .min(room)
            .next_multiple_of(ALIGNMENT as u64)
            .min(room);
        attempt = step_within_free(&self.device, self.upstream.memory_kind(), min, attempt);
        let _span = tracing::debug_span!("grow", requested = min, reserved, attempt).entered();
        loop {
            let now = self.reserved.fetch_add(attempt, Ordering::AcqRel) + attempt;
            let result = if now > self.maximum {
                Err(self.out_of_memory(attempt))
            } else {
                // Given back if the upstream's allocate unwinds (a panic caught by the caller).
                let unreserve = Unreserve {
                    reserved: &self.reserved,
                    size: attempt,
                };
                // Under `slow`: what the upstream's queue relays here is told once the request
                // is over (see `MemoryWaiters::deferring`).
                let allocated = (self.waiters).deferring(&self.tell_waiters, || {
                    self.upstream.allocate(attempt as usize, stream)
                });
                std::mem::forget(unreserve);
                allocated
            };
            match result {
                Ok(ptr) => {
                    let guard = match self.record_guard(&self.arena_for(stream)) {
                        Ok(guard) => guard,
                        Err(e) => {
                            // SAFETY: just allocated from this upstream on `stream` with this
                            // size, never handed out.
                            if let Err(free) =
                                unsafe { self.upstream.deallocate(ptr, attempt as usize, stream) }
                            {
                                tracing::error!(error = %free, bytes = attempt, "a chunk grown for a failed request could not be given back; it is leaked");
                            }
                            self.reserved.fetch_sub(attempt, Ordering::AcqRel);
                            return Err(e);
                        }
                    };
                    let mut global = self.global.lock();
                    global.chunks.insert(ptr.0, attempt);
                    global.insert_free(ptr.0, attempt, Guards::one(guard));
                    drop(global);
                    self.peak_reserved.fetch_max(now, Ordering::AcqRel);
                    self.grows.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(chunk = attempt, "arena grew");
                    return Ok(());
                }
                Err(e) => {
                    self.reserved.fetch_sub(attempt, Ordering::AcqRel);
                    if !e.is_out_of_memory() {
                        return Err(e);
                    }
                    if attempt <= min {
                        tracing::debug!("upstream out of memory");
                        return Err(self.upstream_out_of_memory(min, &e));
                    }
                    // Down to the request itself, never below it (see the pool's `grow`).
                    attempt = (attempt / 2).next_multiple_of(ALIGNMENT as u64).max(min);
                }
            }
        }
    }

    /// Takes every wholly free chunk out of the global arena to give it back upstream, if the
    /// room under the maximum plus what they hold is at least `min` (otherwise it would give
    /// memory away for nothing), and claims the rest of the room that `min` needs (added to
    /// `reserved` until the claim is dropped). Under `slow`.
    fn take_whole_chunks_for_growth(&self, min: u64) -> Option<(GrowthClaim<'_>, Vec<WholeChunk>)> {
        let (chunks, extra) = {
            let mut global = self.global.lock();
            let room = self
                .maximum
                .saturating_sub(self.reserved.load(Ordering::Relaxed));
            let whole = global.whole_chunk_bytes();
            if whole == 0 || room.saturating_add(whole) < min {
                return None;
            }
            let extra = if planted!(CLAIM_ONLY_THE_CHUNKS) {
                0
            } else {
                min.saturating_sub(whole).min(room)
            };
            (global.take_whole_chunks(), extra)
        };
        if chunks.is_empty() {
            return None;
        }
        Some((self.give_backs.claim(&self.reserved, extra), chunks))
    }

    /// For a request at the maximum about to fail, holding `slow`: if requests are giving whole
    /// chunks back to grow (with `slow` let go), waits for every one under way to end (the room,
    /// and what their growths leave free, come back then), with `slow` let go, and takes it
    /// again.
    /// Whether it waited (the request should look, and grow, once more).
    fn wait_for_growth_give_backs<'s>(
        &'s self,
        slow: MutexGuard<'s, ()>,
    ) -> (MutexGuard<'s, ()>, bool) {
        self.give_backs.wait_for_under_way(slow, &self.slow)
    }

    pub(super) fn out_of_memory(&self, requested: u64) -> Error {
        self.out_of_memory_within(requested, u64::MAX, u64::MAX)
    }

    /// Out of memory because the upstream refused a growth, with the upstream's numbers where
    /// it gave them (see [`out_of_memory_within`](Self::out_of_memory_within)).
    fn upstream_out_of_memory(&self, requested: u64, upstream: &Error) -> Error {
        match *upstream {
            Error::OutOfMemory {
                available,
                maximum: maximum @ 1..,
                ..
            } => self.out_of_memory_within(requested, available as u64, maximum as u64),
            // The host could not back the memory (a simulated device's): not ours to wait
            // for, whatever our maximum says; as it is.
            Error::HostOutOfMemory { .. } => upstream.clone(),
            // Not out of memory, or out of memory with no numbers (a maximum of 0): our own.
            _ => self.out_of_memory(requested),
        }
    }

    /// [`out_of_memory`](Self::out_of_memory) where the room under the maximum counts for at
    /// most `upstream_available`, and the maximum is at most `upstream_maximum`: room under our
    /// own maximum is no use when the upstream cannot fill it, and a request above what the
    /// upstream can ever hold must not be taken for one worth waiting for (`allocate_async`
    /// over a smaller pool waited for ever: a review's finding, as the pool's was).
    fn out_of_memory_within(
        &self,
        requested: u64,
        upstream_available: u64,
        upstream_maximum: u64,
    ) -> Error {
        let reserved = self.reserved.load(Ordering::Relaxed);
        let global_free = self.global.lock().free_bytes();
        let arena_free: u64 = self
            .arenas()
            .iter()
            .map(|a| a.state.lock().free.free_bytes())
            .sum();
        let room = self
            .maximum
            .saturating_sub(reserved)
            .min(upstream_available);
        Error::OutOfMemory {
            requested: requested as usize,
            available: (room + global_free + arena_free) as usize,
            maximum: self.maximum.min(upstream_maximum) as usize,
        }
    }

    // ===== deallocation =====

    pub(super) fn free_small(&self, addr: u64, size: u64, stream: &Stream) -> Result<()> {
        let unknown = Error::UnknownPointer {
            ptr: addr,
            bytes: size as usize,
        };
        if let Some(arena) = self.existing_arena_for(stream) {
            let outcome = arena.state.lock().give_live(addr, size);
            match outcome {
                LocalFree::Done => return Ok(()),
                LocalFree::DoubleFree => return Err(unknown),
                LocalFree::NotMine => {}
            }
        }
        // A block of another stream's arena: it waits there until that arena adopts it. The
        // owner's lock is taken before the global one is let go, so a move of the superblock
        // cannot come in between.
        let global = self.global.lock();
        let owner = global.owner_of(addr, size).ok_or(unknown.clone())?;
        // (The planted bug: the global lock let go of at once, before the owner's is taken.)
        let global = (!planted!(GLOBAL_RELEASED_EARLY)).then_some(global);
        let mut state = owner.state.lock();
        drop(global);
        if state.find(addr, size).is_none() {
            return Err(unknown);
        }
        if owner.stream.id() == stream.id() {
            // The superblock moved to our own arena after we looked: free it there.
            return match state.give_live(addr, size) {
                LocalFree::Done => Ok(()),
                LocalFree::DoubleFree | LocalFree::NotMine => Err(unknown),
            };
        }
        // No longer live from here on: a second free of it is refused.
        if !state.unlive(addr, size) {
            return Err(unknown);
        }
        tracing::trace!(addr, size, owner = %owner.stream.id(), on = %stream.id(), "remote free");
        state.remote.push(Remote {
            addr,
            size,
            stream: stream.clone(),
        });
        Ok(())
    }

    pub(super) fn free_large(&self, addr: u64, size: u64, stream: &Stream) -> Result<()> {
        // Claimed under the global lock (a second free of it is refused from here on), guarded
        // outside it, given back under it.
        let large = {
            let mut global = self.global.lock();
            match global.large.get(&addr) {
                Some(&large) if large.size == size => {
                    global.large.remove(&addr);
                    large
                }
                _ => {
                    return Err(Error::UnknownPointer {
                        ptr: addr,
                        bytes: size as usize,
                    })
                }
            }
        };
        match self.record_guard(&self.arena_for(stream)) {
            Ok(guard) => {
                self.global
                    .lock()
                    .insert_free(addr, large.extent, Guards::one(guard));
                Ok(())
            }
            Err(e) => {
                // Not freed: still handed out.
                self.global.lock().large.insert(addr, large);
                // `deallocate` told the simulated device's race detector the block was freed
                // (it must, before the block can be handed out again); it is the caller's
                // still, so tell it the block is live again on `stream`, or the caller's next
                // use of it is reported as a use after free (a review's finding). A no-op on
                // CUDA.
                self.device
                    .note_allocation(DevicePtr(addr), size as usize, stream);
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resource::arena::ArenaOptions;
    use crate::resource::cuda::CudaResource;
    use crate::{Device, FaultKind, Faults, SimConfig};

    const KIB: u64 = 1 << 10;

    /// An adoption takes its arena's remote frees out, orders its stream after theirs, then
    /// gives them to its free list. A superblock may move to another stream meanwhile (a move
    /// takes only the remote frees still queued); the ordering failing then put the moved
    /// superblock's remote free back into the old owner, whose remote bytes counted it against
    /// superblocks it no longer held, while the new owner showed the freed block in use.
    #[test]
    fn a_failed_adoption_gives_a_moved_superblocks_remote_free_to_its_new_owner() {
        let faults = Faults::new();
        let device = Device::simulated(SimConfig {
            faults: faults.clone(),
            ..SimConfig::default()
        });
        let options = ArenaOptions {
            initial: 4 << 20,
            maximum: Some(4 << 20),
            superblock_size: 1 << 20,
        };
        let r = ArenaResource::new(CudaResource::new(&device), options).unwrap();
        let streams: Vec<Stream> = (0..3).map(|_| device.create_stream().unwrap()).collect();
        let (s1, s2, s3) = (&streams[0], &streams[1], &streams[2]);
        let size = 256 * KIB;
        let a = r.allocate(size as usize, s1).unwrap();
        let b = r.allocate(size as usize, s1).unwrap();
        // SAFETY: allocated above, unused; freed once.
        unsafe { r.deallocate(a, size as usize, s2) }.unwrap();
        let owner = r.arena_for(s1);
        // An adoption on `s1` takes the queue out (as `allocate_small` does)...
        let remote = std::mem::take(&mut owner.state.lock().remote);
        assert_eq!(remote.len(), 1);
        // ... a request on `s3` moves the superblock over meanwhile...
        let recipient = r.arena_for(s3);
        let c = r
            .move_superblock(&recipient, size, &mut None)
            .unwrap()
            .unwrap();
        // ... and the event on `s2` that would order `s1` after the free cannot be recorded.
        faults.fail_next(FaultKind::Record);
        assert!(r.adopt(&owner, remote, None, &mut None).is_err());
        assert_eq!(faults.injected(FaultKind::Record), 1);
        let stats = r.stats();
        assert_eq!(
            stats.in_use,
            2 * size as usize,
            "a freed block counts as in use after a failed adoption: {stats:?}"
        );
        assert_eq!(stats.remote_frees_pending, 1, "{stats:?}");
        assert!(owner.state.lock().remote.is_empty());
        assert_eq!(recipient.state.lock().remote.len(), 1);
        r.check_invariants().unwrap();
        // The new owner adopts it: everything comes back.
        // SAFETY: allocated above, unused; each freed once.
        unsafe { r.deallocate(DevicePtr(b.0), size as usize, s1) }.unwrap();
        // SAFETY: as above.
        unsafe { r.deallocate(DevicePtr(c), size as usize, s3) }.unwrap();
        assert_eq!(r.defragment(), 1);
        let stats = r.stats();
        assert_eq!((stats.in_use, stats.superblocks), (0, 0), "{stats:?}");
        r.check_invariants().unwrap();
        for s in &streams {
            s.synchronize_blocking().unwrap();
        }
    }

    /// An arena of `maximum` bytes holding 1 MiB (one superblock), and two streams.
    fn capture_scene(maximum: usize) -> (ArenaResource<CudaResource>, Stream, Stream) {
        let device = Device::simulated(SimConfig::default());
        let options = ArenaOptions {
            initial: 1 << 20,
            maximum: Some(maximum),
            superblock_size: 1 << 20,
        };
        let r = ArenaResource::new(CudaResource::new(&device), options).unwrap();
        let (s, t) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        (r, s, t)
    }

    /// While the user captures a stream that holds the only superblock (partly used), a small
    /// request on another stream grows: the move of that superblock, whose ordering the
    /// capture refuses, is skipped. It failed with `StreamCapturing` instead.
    #[test]
    fn a_capturing_donor_is_skipped_and_the_arena_grows() {
        let (r, s, t) = capture_scene(64 << 20);
        let kept = r.allocate(1000, &s).unwrap();
        s.pretend_capture(true);
        let got = r.allocate(1000, &t).expect("served by a growth");
        assert_eq!(r.stats().reserved, 2 << 20);
        s.pretend_capture(false);
        // SAFETY: allocated above on these streams, unused, freed once.
        unsafe {
            r.deallocate(got, 1000, &t).unwrap();
            r.deallocate(kept, 1000, &s).unwrap();
        }
    }

    /// While the user captures a stream that freed one of another stream's blocks, that
    /// stream's next small request adopts the rest of its remote frees (none here) and goes
    /// on: the capturing stream's free waits for the capture to end. It failed with
    /// `StreamCapturing` instead.
    #[test]
    fn a_remote_free_on_a_capturing_stream_waits_for_the_capture() {
        let (r, s, t) = capture_scene(64 << 20);
        let a = r.allocate(1 << 20, &t).unwrap();
        s.wait(&t.record().unwrap()).unwrap();
        // SAFETY: allocated above, its use ordered before the free on `s`; freed once.
        unsafe { r.deallocate(a, 1 << 20, &s) }.unwrap();
        s.pretend_capture(true);
        let got = r
            .allocate(1000, &t)
            .expect("served while the freeing stream captures");
        // The free stays among `t`'s remote frees until the capture ends.
        s.pretend_capture(false);
        // SAFETY: allocated above on `t`, unused, freed once.
        unsafe { r.deallocate(got, 1000, &t) }.unwrap();
        r.check_invariants().unwrap();
    }

    /// At its maximum, a request that passes over memory held up by a capture (a remote free
    /// issued on the capturing stream; a superblock of it that could be lent) fails with the
    /// capture's error, which an awaitable request does not wait on: it waited, and the end of
    /// the capture woke nobody (a review's finding).
    #[test]
    fn at_the_maximum_memory_held_up_by_a_capture_is_the_captures_error() {
        use crate::AllocateAsync;
        use std::future::Future;
        let (r, s, t) = capture_scene(1 << 20);
        // `t`'s whole superblock, freed on `s`, which then captures.
        let a = r.allocate(1 << 20, &t).unwrap();
        s.wait(&t.record().unwrap()).unwrap();
        // SAFETY: allocated above, its use ordered before the free on `s`; freed once.
        unsafe { r.deallocate(a, 1 << 20, &s) }.unwrap();
        s.pretend_capture(true);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut wait = Box::pin(r.allocate_async(1000, &t));
        match wait.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(Err(Error::StreamCapturing { .. })) => {}
            other => panic!("a request the capture held up: {other:?}"),
        }
        s.pretend_capture(false);
        let got = r.allocate(1000, &t).expect("served once the capture ended");
        // SAFETY: allocated above on `t`, unused, freed once.
        unsafe { r.deallocate(got, 1000, &t) }.unwrap();
    }
}
