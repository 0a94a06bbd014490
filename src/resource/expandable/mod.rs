//! `ExpandablePoolResource`: a pool on virtual memory, whose footprint follows its live memory.

pub(crate) mod core;
#[cfg(all(test, not(streamalloc_loom)))]
mod settle_tests;
mod snapshot;
#[cfg(all(test, not(streamalloc_loom)))]
mod trim_order_tests;

use std::fmt;
// std's `Arc` and `Weak`, not `crate::sync`'s: the release job holds a `Weak` of the pool,
// which loom's `Arc` lacks; the pool as a whole is not loom-modelled (its bookkeeping,
// `core.rs`, is).
use std::sync::{Arc as StdArc, Weak};

use self::core::{Expander, ReleaseTrigger, Taken};
use super::held_for_trim::{HeldOrder, Ticket};
use super::pool::{failed_stream, forget_failed, PoolStats};
use super::trim_waits::{run_blocking, Await, Block, TrimWaits};
use super::waiters::{MemoryWaiters, WaitStats};
use super::{aligned_size, check_stream, MemoryResource};
use crate::device::vmm::{self, Reservation};
use crate::device::{Device, DevicePtr};
use crate::error::{Error, Result};
use crate::stream::{Stream, StreamId};

/// Sizes and policies of an [`ExpandablePoolResource`].
///
/// ```
/// use streamalloc::resource::expandable::ExpandableOptions;
///
/// let options = ExpandableOptions {
///     initial: 256 << 20,
///     release_threshold: Some(1 << 30),
///     ..ExpandableOptions::default()
/// };
/// assert_eq!(options.reserve, None); // the device's total memory
/// ```
#[derive(Debug, Clone, Default)]
pub struct ExpandableOptions {
    /// Bytes of virtual addresses to reserve for each of the pool's shards (8, or fewer where
    /// the address space has no room for 8); `None` for the device's total memory (rounded up
    /// to the allocation granularity). Addresses cost no memory: only what is mapped does.
    pub reserve: Option<usize>,
    /// The most memory the pool may map at once (rounded up to the granularity); `None` for
    /// the whole reservation. At most the reservation.
    pub maximum: Option<usize>,
    /// Bytes mapped at construction (rounded up to the granularity; may be 0). From 32 MiB a
    /// shard up it is mapped in pieces, one at the start of each shard's range, which belong
    /// to no shard until a request its own shard cannot serve claims one: its range's piece
    /// as it lies, else another range's, moved into its own if it is at most 64 MiB (an unmap
    /// and a map per unit, once; larger pieces are taken where they lie). So one thread's
    /// memory ends up in one range, where it coalesces (WORKLOADS.md's `churn-1t` grown from
    /// 256 MiB: 1.13 times its peak live memory mapped on an H100, against 1.16 with the
    /// pieces given to their ranges' shards up front), and threads on different shards each
    /// start in their own. Unclaimed pieces count as free memory, and a trim releases them
    /// first.
    pub initial: usize,
    /// Mapped bytes the pool keeps before it gives fully free granules back on its own (as
    /// the driver pool's release threshold): once it maps more than this and a granule's worth
    /// of memory was freed since the last try, the device's blocking-work thread trims it down
    /// toward the threshold, in stream order. `None` (the default): only
    /// [`trim`](ExpandablePoolResource::trim) gives memory back.
    pub release_threshold: Option<usize>,
    /// The unit the pool maps, unmaps and trims by, one physical allocation each
    /// (`cuMemCreate`, `cuMemMap`, `cuMemSetAccess`): rounded up to the device's allocation
    /// granularity times a power of two. `None` (the default): [`DEFAULT_MAP_GRANULES`]
    /// granules, 8 MiB on an H100 or H200. A mapping costs mostly per allocation, not per
    /// byte (on an H100, 51 µs for one 2 MiB granule, 45 µs for four: `benches/vmm_probe.rs`),
    /// so a unit of one granule makes a pool grown from small spend about four times as long
    /// mapping; a larger unit gives memory back in coarser pieces (a unit is unmapped only
    /// when all of it is free). `Some(1)` gives the granularity itself: trims exact to the
    /// granule.
    pub map_unit: Option<usize>,
    /// Which free block a request is cut from: [`ExpandablePlacement::LowAddress`] (the
    /// default) keeps memory low in each range, so that less of it is mapped, for a little
    /// more time per request than [`ClosestFit`](ExpandablePlacement::ClosestFit).
    pub placement: ExpandablePlacement,
    /// Bytes of small blocks each shard keeps aside for their stream's next request of the
    /// same size, as [`PoolOptions::small_block_cache`](super::PoolOptions::small_block_cache)
    /// (which says how it works). `None` (the default) or `Some(0)`: none. Off by default
    /// because this pool is for footprint: cached blocks do not coalesce while they wait, and
    /// on `churn-1t` grown from 256 MiB an H100 mapped 808 MiB with the pool's 4 MiB a shard
    /// against 800 without (1.141 and 1.130 times peak live; run48 of 2026-11-26). A growth, a
    /// trim and a move of free memory between ranges empty the caches first.
    pub small_block_cache: Option<usize>,
}

/// Which free block an [`ExpandablePoolResource`] cuts a request from ([`ExpandableOptions::placement`]).
///
/// Measured on WORKLOADS.md's `churn-1t` grown from 256 MiB, in the default 8 MiB unit
/// (`engine_lab::expandable`, seeds 1 to 7; the simulated device with its race detector off for
/// the time, on the 2-core development machine, 2026-11-26): peak mapped / peak live 1.111 to
/// 1.164 (mean 1.140) with `LowAddress` against 1.141 to 1.211 (mean 1.186) with
/// `ClosestFit`; 67 to 70 ns/op against 57 to 61 (`PoolResource`: 58 to 69).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ExpandablePlacement {
    /// The lowest address among the blocks that fit in the two smallest size classes that hold
    /// one: new blocks go low in the range, and its top stays free in whole units, which the
    /// pool does not need to map (or can unmap).
    #[default]
    LowAddress,
    /// The closest fit (within 3%), as [`PoolResource`](super::PoolResource) places blocks:
    /// about 10% faster per request, and 3 to 4% more memory mapped on `churn-1t` (an H100:
    /// 1.19 times peak live against 1.16).
    ClosestFit,
}

/// The default mapping unit of an [`ExpandablePoolResource`], in allocation granules
/// ([`ExpandableOptions::map_unit`]).
pub const DEFAULT_MAP_GRANULES: usize = 4;

/// A pool that grows by mapping physical memory into one reserved range of virtual addresses
/// (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`), a *unit* at a time, as PyTorch's
/// expandable segments do. The unit ([`granule`](Self::granule)) is a whole number of the
/// driver's allocation granules (2 MiB on an H100 or H200): 4 by default, one physical
/// allocation each ([`ExpandableOptions::map_unit`]; below, "granule" means this unit).
///
/// It has the stream semantics of [`PoolResource`](super::PoolResource) (the same free-list
/// engine: same-stream reuse at once, reuse on other streams ordered by events, awaitable
/// allocation, the same [`PoolStats`]), with two differences:
///
/// - **No seams.** Its memory lies in one address range per shard (8, as the pool's shards:
///   threads whose requests go to different shards take different locks), and a thread's
///   growths map into its own shard's range first, so any free block coalesces with its free
///   neighbours in that range, whenever they were mapped; a growth maps only what the request
///   needs beyond the free block it extends. Free memory in different ranges does not
///   coalesce (nor across a live block), so at the maximum a growth first *moves* memory: it
///   unmaps wholly free granules of the other ranges, and of its own away from the block it
///   extends (those whose last users' work has finished: the stream is asked, the host never
///   waits), and maps that room where it extends ([`relocations`](Self::relocations) counts
///   these). Memory freed on a stream still busy is not moved: a request that needs it
///   fails until that work is done; with `allocate_async` it waits, while the pool waits for
///   the stream off the caller's thread and then notes what it had freed as finished (so
///   memory freed on a stream that always has new work queued moves too). A pool of separate
///   chunks never merges across them, so it holds more than it uses after a change of sizes.
/// - **Trim gives memory back a granule at a time.** [`trim`](Self::trim) unmaps and releases
///   every fully free granule (where the pool can only return wholly free chunks), after
///   waiting for the work of the stream that last used it. The device's free memory rises by
///   what was unmapped.
///
/// Pick it over the pool when the footprint must follow live memory (phases of different
/// sizes, a long-running server that must give memory back); the pool is a little cheaper when
/// it grows (one `cuMemAlloc` per chunk against a create, a map and an access per unit) and
/// works over any upstream.
///
/// Dropping it synchronizes the streams it knows and unmaps everything (buffers keep it alive
/// until they are gone).
pub struct ExpandablePoolResource {
    inner: StdArc<Inner>,
}

struct Inner {
    device: Device,
    core: Expander<Stream, Reservation>,
    waiters: MemoryWaiters,
    /// The release threshold in bytes (`u64::MAX`: none).
    threshold: u64,
    /// Bytes freed since the last automatic release began, and whether one is queued or
    /// running (counted only with a threshold).
    release: ReleaseTrigger,
    /// For the automatic release job to find the pool, if it still exists.
    me: Weak<Inner>,
}

impl fmt::Debug for ExpandablePoolResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExpandablePoolResource")
            .field("reservation", &self.inner.core.backing)
            .field("maximum", &self.inner.core.maximum())
            .field("stats", &self.stats())
            .finish()
    }
}

impl ExpandablePoolResource {
    /// A pool on `device`. Errors: a maximum above the reservation, an initial size above the
    /// maximum, a mapping unit larger than the device's memory ([`Error::InvalidSize`]); a
    /// reservation the address space has no room for ([`Error::OutOfMemory`] with the room
    /// left, where the device knows it); the device's error if it cannot map `initial`.
    pub fn new(device: &Device, options: ExpandableOptions) -> Result<Self> {
        let granularity = vmm::granularity(device)?;
        // A power of two of granules: the range is reserved aligned to the unit (the pool
        // finds free units by address), and the driver aligns reservations to powers of two.
        let granule = options
            .map_unit
            .map_or(DEFAULT_MAP_GRANULES, |unit| unit.div_ceil(granularity))
            .max(1)
            .checked_next_power_of_two()
            .and_then(|granules| granules.checked_mul(granularity))
            .ok_or(Error::InvalidSize {
                size: options.map_unit.unwrap_or(0),
                reason: "the mapping unit overflows when rounded up to the allocation granularity",
            })?;
        // A unit larger than the device could never be mapped: every request would fail.
        if granule > device.total_memory() {
            return Err(Error::InvalidSize {
                size: granule,
                reason: "the mapping unit is larger than the device's memory",
            });
        }
        let round = |size: usize, reason| {
            size.checked_next_multiple_of(granule)
                .ok_or(Error::InvalidSize { size, reason })
        };
        let reserve = round(
            options.reserve.unwrap_or(device.total_memory()),
            "the reservation overflows when rounded up to the allocation granularity",
        )?;
        let maximum = match options.maximum {
            Some(max) => round(
                max,
                "the maximum overflows when rounded up to the allocation granularity",
            )?,
            None => reserve,
        };
        if maximum > reserve {
            return Err(Error::InvalidSize {
                size: maximum,
                reason: "the pool's maximum is above its reservation",
            });
        }
        if options.initial > maximum {
            return Err(Error::InvalidSize {
                size: options.initial,
                reason: "the pool's initial size is above its maximum",
            });
        }
        let (reservation, regions) = reserve_regions(device, reserve, granule)?;
        let core = Expander::with_regions(reservation, maximum as u64, regions);
        (core.heap).set_low_placement(options.placement == ExpandablePlacement::LowAddress);
        let cache = options.small_block_cache.unwrap_or(0);
        (core.heap).set_cache(cache as u64);
        core.map_initial(options.initial as u64)?;
        let threshold = options.release_threshold.map_or(u64::MAX, |t| t as u64);
        let release = ReleaseTrigger::new(core.granule());
        let inner = StdArc::new_cyclic(|me| Inner {
            device: device.clone(),
            core,
            waiters: MemoryWaiters::new(),
            threshold,
            release,
            me: me.clone(),
        });
        Ok(Self { inner })
    }

    /// The most the pool may map.
    pub fn maximum(&self) -> usize {
        self.inner.core.maximum() as usize
    }

    /// The unit of mapping and of trimming, in bytes: [`ExpandableOptions::map_unit`], a
    /// multiple of the device's allocation granularity.
    pub fn granule(&self) -> usize {
        self.inner.core.granule() as usize
    }

    /// The reserved range of addresses, every shard's: `(first address, bytes)`.
    pub fn reservation(&self) -> (DevicePtr, usize) {
        let r = &self.inner.core.backing;
        (DevicePtr(r.base()), r.size())
    }

    /// What the pool holds and has done. `reserved` is the memory mapped, `chunks` the
    /// units mapped, `free` counts the initial size's unclaimed pieces, and `growth_time` the
    /// mapping of growths and of moved pieces (the unmaps of moves and trims are not in it).
    pub fn stats(&self) -> PoolStats {
        let core = &self.inner.core;
        let engine = core.stats();
        PoolStats {
            reserved: core.reserved() as usize,
            peak_reserved: core.peak_reserved() as usize,
            free: engine.free_bytes as usize,
            free_blocks: engine.free_blocks,
            chunks: core.mapped_granules(),
            streams: engine.streams,
            grows: core.grows(),
            // It maps what each request lacks: no step for a cap to cut.
            capped_grows: 0,
            growth_time: core.growth_time(),
            stream_waits: engine.waits,
            shard_spills: engine.spills,
            idle_reuses: engine.idle_skips,
            in_use: engine.in_use as usize,
            // The engine sums its shards' peaks (an upper bound): never more than what was
            // ever mapped, as `PoolStats` promises (a review found it above, once memory had
            // moved between ranges).
            peak_in_use: engine.peak_in_use.min(core.peak_reserved()) as usize,
            cache_hits: engine.cache_hits,
        }
    }

    /// How many growths at the maximum first moved free memory: unmapped wholly free granules
    /// of other shards' ranges, or of the request's own away from where it grows, whose last
    /// users had finished, to map that room where the request coalesces (free memory in
    /// different ranges never coalesces, nor across a live block).
    pub fn relocations(&self) -> u64 {
        self.inner.core.relocations()
    }

    /// How many pieces of the initial size a thread claimed from another shard's range, and
    /// so moved (unmapped in that range, mapped in the claimer's, once each; see
    /// [`ExpandableOptions::initial`]).
    pub fn initial_moves(&self) -> u64 {
        self.inner.core.claim_moves()
    }

    /// What waiting for memory in [`allocate_async`](crate::AllocateAsync::allocate_async) has
    /// cost.
    pub fn wait_stats(&self) -> WaitStats {
        self.inner.waiters.stats()
    }

    /// Checks the invariants of every free list and that no two share memory. Slow; for tests.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.inner.core.heap.check()
    }

    /// Unmaps and releases every fully free granule, each once the GPU work of the stream
    /// that last used it has finished (awaited here, never inside a lock). First it folds the
    /// lists of streams the user has dropped back into the pool, as
    /// [`PoolResource::trim`](super::PoolResource::trim) does, and moves every stream's free
    /// blocks to the pool's fresh memory once that stream's work is done (so free memory that
    /// different streams freed coalesces into whole granules). Returns the bytes unmapped.
    /// Live buffers are untouched: a granule any of whose bytes is handed out stays mapped.
    ///
    /// On an error of its own work (a failed unmap), what was not unmapped goes back where it
    /// was: nothing is lost, and the pool works as before.
    ///
    /// A stream whose work failed (a sticky error) does not fail the trim, as in
    /// [`PoolResource::trim`](super::PoolResource::trim): a dropped one is let go of as if it
    /// had synchronized once it answers idle, and the granules last freed on a live one stay
    /// mapped and free (both logged at warn level with the error), as a capture's do; the rest
    /// is unmapped, and the trim returns `Ok` with the bytes it did unmap.
    ///
    /// A stream under a user's graph capture cannot be waited for (its captured work runs
    /// only when the graph is launched): the granules last freed on it (or coalesced with
    /// memory freed on it) stay mapped and free (kept, logged at debug level as kept for a
    /// capture), and the rest is unmapped as usual; the trim returns `Ok` with the bytes it
    /// did unmap. A later trim, once the capture has ended, unmaps the rest. The automatic
    /// release past [`ExpandableOptions::release_threshold`] does the same.
    ///
    /// It takes out of the lists only what it will unmap. While it waits for those granules'
    /// streams, a request on another thread that finds no fit maps more as usual; at the
    /// maximum, it takes every range the trims hold back into the lists instead of failing,
    /// and is served from them after the streams that freed them (GPU-side, as any reuse).
    /// The trim then unmaps only what is still its own, and returns those bytes. While the
    /// trim unmaps, a request at the maximum is refused as if the trim had finished first
    /// ([`allocate_async`](crate::AllocateAsync::allocate_async) waits instead, and is woken
    /// when the trim ends): a request never waits for the GPU.
    ///
    /// # Cancel safety
    /// Cancel-safe: dropped while it waits for a stream, it puts the granules it took out back
    /// where they were, free and usable (a review found them mapped and out of the lists, never
    /// handed out again, until the pool was dropped).
    pub async fn trim(&self) -> Result<usize> {
        self.inner.trim_to_with(0, Await).await
    }

    /// [`trim`](Self::trim) for synchronous code: blocks the calling thread while it waits.
    pub fn trim_blocking(&self) -> Result<usize> {
        self.inner.trim_to_blocking(0)
    }

    /// Like [`trim`](Self::trim), but stops once at most `keep` bytes stay mapped (the highest
    /// addresses go first).
    pub async fn trim_to(&self, keep: usize) -> Result<usize> {
        self.inner.trim_to_with(keep as u64, Await).await
    }

    /// [`trim_to`](Self::trim_to) for synchronous code.
    pub fn trim_to_blocking(&self, keep: usize) -> Result<usize> {
        self.inner.trim_to_blocking(keep as u64)
    }
}

impl Inner {
    /// [`trim_to_with`](Self::trim_to_with) blocking (the public `_blocking` trims, and the
    /// automatic release past the threshold).
    fn trim_to_blocking(&self, keep: u64) -> Result<usize> {
        run_blocking(self.trim_to_with(keep, Block))
    }

    /// The trim, waiting with `waits` (`.await` or blocking).
    async fn trim_to_with(&self, keep: u64, waits: impl TrimWaits) -> Result<usize> {
        // Idle streams are let go of first (their waits leave every tag). Free neighbours
        // freed on different streams have coalesced already: a granule half freed on one
        // stream and half on another is one free block. Every idle stream is waited for,
        // whatever fails: one failure must not skip the others.
        for stream in self.core.heap.idle_streams() {
            match waits.stream(&stream).await {
                Ok(()) => self.core.heap.forget(stream),
                // Kept (not forgotten) until the capture ends: its work cannot be waited for.
                Err(Error::StreamCapturing { .. }) => {}
                // Let go of as ended: see `forget_failed`.
                Err(e) => forget_failed(&self.core.heap, stream, &e),
            }
        }
        // Put back if this future is dropped while it waits (a failed wait keeps only its own
        // stream's ranges: `keep_for_failure`).
        let (taken, streams) = TakenForTrim::take(self, keep);
        let mut captured = Vec::new();
        let mut failed = Vec::new();
        for stream in streams {
            match waits.stream(&stream).await {
                Ok(()) => {}
                Err(Error::StreamCapturing { .. }) => captured.push(stream.id()),
                // Kept: see `failed_stream`.
                Err(e) => failed.push(failed_stream(&stream, &e)),
            }
        }
        taken.keep_for_capture(&captured);
        taken.keep_for_failure(&failed);
        taken.unmap()
    }

    /// Unmaps ranges whose streams were synchronized after they were taken.
    fn unmap(&self, taken: Vec<Taken<Stream>>) -> Result<usize> {
        let _span = tracing::debug_span!("trim", ranges = taken.len()).entered();
        // Room under the maximum came back: a waiter for a large block may now grow. Told on
        // the way out, a panic out of an unmap included (the simulated race detector's `Panic`
        // mode: `unmap_ranges` puts the pool right, then lets it go on), or the waiters slept
        // until some later free.
        let _tell = NotifyOnDrop(&self.waiters);
        // SAFETY: every range was taken out of the lists before its stream was synchronized
        // (by the callers, after `hold_free`), so the work that last used it has finished;
        // fresh ranges were never used.
        let (released, result) = unsafe { self.core.unmap_ranges(taken) };
        tracing::debug!(released, "unmapped");
        result.map(|()| released as usize)
    }

    /// After a refused request: if a move at the maximum left memory of busy streams, wait
    /// for those streams on the device's blocking-work thread, note what they had freed
    /// finished, and then wake the memory waiters (the memory can move now). Without this a
    /// waiter of `allocate_async` would wait for a free that may never come.
    ///
    /// The note is what lets the memory move: the waiters' retry does not ask the stream
    /// again, which a stream that always has work queued answers busy every time (the job
    /// woke them, their retry was refused and queued the job again, until a timeout: a
    /// review's finding). At most one job is queued per stream (`Expander::take_busy`): a
    /// storm of refusals queued one each.
    fn settle_busy(&self) {
        let busy = self.core.take_busy();
        if busy.is_empty() {
            return;
        }
        let me = self.me.clone();
        self.device.reactor().offload(
            "expandable pool: busy streams' memory",
            Box::new(move || {
                // The pool is not kept alive across the waits: looked up for each note.
                let Some(waits) = me.upgrade().map(|pool| pool.core.settle_started(&busy)) else {
                    return;
                };
                let mut finished = false;
                for (stream, wait) in busy.into_iter().zip(waits) {
                    match stream.synchronize_blocking() {
                        Ok(()) => {
                            finished = true;
                            if let Some(pool) = me.upgrade() {
                                pool.core.heap.note_host_waited(wait);
                            }
                        }
                        // Not a failure: the user's code is capturing the stream into a graph,
                        // whose work the host cannot wait for. Its memory stays where it is
                        // until a later request (or trim) finds the capture over.
                        Err(e @ Error::StreamCapturing { .. }) => tracing::debug!(
                            error = %e,
                            stream = %stream.id(),
                            "a busy stream is being captured into a CUDA graph: its memory is kept for the capture"
                        ),
                        Err(e) => tracing::warn!(
                            error = %e,
                            stream = %stream.id(),
                            "a stream's work failed: its memory stays"
                        ),
                    }
                }
                // Only if some memory can move now: a waiter woken for nothing would fail
                // again and queue this again, in a loop.
                if let Some(pool) = me.upgrade().filter(|_| finished) {
                    pool.waiters.notify();
                }
            }),
        );
    }

    /// After a free: with a release threshold, once more than it is mapped and a granule's
    /// worth was freed since the last release began, queue a trim toward it on the device's
    /// blocking-work thread (it waits for streams; a free never does). A free while one is
    /// queued or running queues none: that one looks again when it ends.
    fn maybe_release(&self, freed: u64) {
        if self.threshold == u64::MAX {
            return;
        }
        if (self.release).freed(freed, || self.core.reserved() > self.threshold) {
            self.queue_release();
        }
    }

    /// Queues the automatic release; once it has trimmed, it queues itself again if a
    /// granule's worth was freed meanwhile and more than the threshold is still mapped (its
    /// job had already taken its ranges: memory freed since would stay mapped until the next
    /// free, which may never come). Each time again follows a granule's worth of frees, so it
    /// stops once frees do; queued, not looped, so that other blocking work runs in between.
    fn queue_release(&self) {
        let (me, threshold) = (self.me.clone(), self.threshold);
        self.device.reactor().offload(
            "expandable pool release",
            Box::new(move || {
                let Some(pool) = me.upgrade() else { return };
                // A panic is caught here, not by the blocking-work thread: `ended` must run,
                // or the trigger stays pending and the pool never releases again.
                match crate::completion::catch_unwind(|| pool.trim_to_blocking(threshold)) {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "the expandable pool's release failed")
                    }
                    Err(payload) => tracing::error!(
                        panic = crate::completion::panic_message(&*payload),
                        "the expandable pool's release panicked"
                    ),
                }
                if (pool.release).ended(|| pool.core.reserved() > threshold) {
                    pool.queue_release();
                }
            }),
        );
    }
}

// SAFETY: blocks are cut from the resource's own mapped granules by the stream-ordered engine,
// which hands out no byte twice and orders reuse across streams; granules are unmapped only once
// free and finished on the GPU (`expandable`).
unsafe impl MemoryResource for ExpandablePoolResource {
    fn device(&self) -> &Device {
        &self.inner.device
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        let inner = &*self.inner;
        check_stream(&inner.device, stream)?;
        if bytes == 0 {
            return Ok(DevicePtr(0));
        }
        let size = aligned_size(bytes)? as u64;
        if size > inner.core.maximum() {
            return Err(inner.core.out_of_memory(size));
        }
        let ptr = match inner.core.heap.take(size, stream, &inner.core) {
            Ok(addr) => DevicePtr(addr),
            Err(e) => {
                inner.settle_busy();
                // A failed ordering puts the block it found back: tell the waiters, as a free
                // would (see the pool's `allocate`).
                if !e.is_out_of_memory() {
                    inner.waiters.notify();
                }
                return Err(e);
            }
        };
        // The race detector of the simulated device checks blocks (a no-op on CUDA).
        inner.device.note_allocation(ptr, size as usize, stream);
        Ok(ptr)
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        let inner = &*self.inner;
        check_stream(&inner.device, stream)?;
        if bytes == 0 {
            return if ptr.0 == 0 {
                Ok(())
            } else {
                Err(Error::UnknownPointer { ptr: ptr.0, bytes })
            };
        }
        let size = aligned_size(bytes)? as u64;
        // A range not wholly mapped was never handed out (the lists would take it: it lies in
        // one of their chunks, the shards' ranges).
        if !ptr.0.is_multiple_of(super::ALIGNMENT as u64) || !inner.core.is_mapped(ptr.0, size) {
            return Err(Error::UnknownPointer { ptr: ptr.0, bytes });
        }
        // Noted before the block is back in a list, from where another thread may hand it out
        // again; a race's panic (the `Panic` mode) comes once it is back.
        inner.device.note_free_then(ptr, size as usize, stream, || {
            if !inner.core.heap.give(ptr.0, size, stream) {
                return Err(Error::UnknownPointer { ptr: ptr.0, bytes });
            }
            inner.waiters.notify();
            inner.maybe_release(size);
            Ok(())
        })
    }

    /// The set's total, each request rounded up, against the maximum.
    fn check_set(&self, sizes: &[usize]) -> Result<()> {
        super::check_set_within(sizes, self.maximum(), aligned_size)
    }

    fn memory_waiters(&self) -> Option<&MemoryWaiters> {
        Some(&self.inner.waiters)
    }

    fn memory_snapshot(&self) -> Option<super::snapshot::Snapshot> {
        Some(self.snapshot())
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Frees may still be queued on the streams the pool holds: let them run before the
        // reservation (dropped after this) unmaps everything; or, if one cannot be waited for
        // (a graph capture), the reservation stays mapped.
        if !super::wait_for_streams_at_drop("ExpandablePoolResource", self.core.heap.streams()) {
            self.core.backing.keep_at_drop();
        }
    }
}

/// Ranges a trim took out of the lists ([`Expander::hold_free`]), put back (and the memory
/// waiters told: a request may have been refused while they were out) if the trim ends before
/// it unmaps them (the trim's future dropped while it waits); those of a stream under a
/// capture or whose synchronization failed go back before
/// ([`keep_for_capture`](Self::keep_for_capture), [`keep_for_failure`](Self::keep_for_failure)).
/// [`unmap`](Self::unmap) unmaps those a request at the maximum has not taken back.
struct TakenForTrim<'a> {
    inner: &'a Inner,
    /// `None` once unmapped (nothing then to put back on drop).
    ticket: Option<Ticket>,
}

impl<'a> TakenForTrim<'a> {
    /// Takes free granules out of the lists for a trim down to `keep` bytes mapped (under the
    /// growth lock and the trims' list's, with no driver call), orders each onto one of its
    /// streams with those locks let go (a review found a request at the maximum, and every
    /// growth, waiting behind those records and waits), and returns the streams to wait for
    /// before they are unmapped.
    fn take(inner: &'a Inner, keep: u64) -> (Self, Vec<Stream>) {
        let (ticket, ranges) = inner.core.hold_free(keep);
        // From here on, put back on drop (an ordering that unwinds included).
        let taken = TakenForTrim {
            inner,
            ticket: Some(ticket),
        };
        let (streams, went_back) = inner.core.order_held(ticket, ranges);
        if went_back {
            // Memory back in the lists (its ordering failed): a request refused while it was
            // out may fit now. Told with every lock let go.
            inner.waiters.notify();
        }
        (taken, streams)
    }

    /// Puts back in the lists, free and mapped, the ranges still the trim's whose stream is in
    /// `captured` (under a user's graph capture: its work cannot be waited for, so they cannot
    /// be unmapped now), and logs what was kept; the rest stays the trim's to unmap.
    fn keep_for_capture(&self, captured: &[StreamId]) {
        let (ranges, bytes) = self.keep_on(captured);
        if ranges > 0 {
            tracing::debug!(
                ranges,
                bytes,
                streams = captured.len(),
                "trim: ranges kept mapped for a capture (their streams are being captured into a CUDA graph, whose work the host cannot wait for)"
            );
        }
    }

    /// Puts back in the lists, free and mapped, the ranges still the trim's whose stream's
    /// synchronization failed (see [`failed_stream`]), and logs what was kept; the rest stays
    /// the trim's to unmap.
    fn keep_for_failure(&self, failed: &[StreamId]) {
        let (ranges, bytes) = self.keep_on(failed);
        if ranges > 0 {
            tracing::warn!(
                ranges,
                bytes,
                streams = failed.len(),
                "trim: ranges kept mapped, free: the work of the streams they were freed on failed"
            );
        }
    }

    /// Puts back in the lists, free and mapped (as freed on their stream), the ranges still
    /// the trim's freed on a stream in `streams`, and tells the waiters: how many, and their
    /// bytes.
    fn keep_on(&self, streams: &[StreamId]) -> (usize, u64) {
        let Some(ticket) = self.ticket else {
            return (0, 0);
        };
        if streams.is_empty() {
            return (0, 0);
        }
        let mut bytes = 0;
        let ranges = self
            .inner
            .core
            .put_back_some_held(ticket, |(_, size, order)| {
                let stays = matches!(order, HeldOrder::On(Some(s)) if streams.contains(&s.id()));
                if stays {
                    bytes += size;
                }
                stays
            });
        if ranges > 0 {
            // Memory back in the lists: a request refused while it was out may fit now.
            self.inner.waiters.notify();
        }
        (ranges, bytes)
    }

    /// Unmaps the ranges still the trim's (no longer put back on drop): the bytes unmapped.
    /// With no lock held: no request waits for the driver's unmapping.
    fn unmap(mut self) -> Result<usize> {
        let Some(ticket) = self.ticket.take() else {
            return Ok(0);
        };
        let unmapped = self.inner.unmap(self.inner.core.release_held(ticket));
        self.inner.core.unmapped_held();
        unmapped
    }
}

impl Drop for TakenForTrim<'_> {
    fn drop(&mut self) {
        let Some(ticket) = self.ticket.take() else {
            return;
        };
        if self.inner.core.put_back_held(ticket) {
            self.inner.waiters.notify();
        }
    }
}

/// Tells the memory waiters when dropped, unwinding or not.
struct NotifyOnDrop<'a>(&'a MemoryWaiters);

impl Drop for NotifyOnDrop<'_> {
    fn drop(&mut self) {
        self.0.notify();
    }
}

/// How many shards (address ranges) an expandable pool has at most: the pool's.
const REGIONS: usize = 8;

/// Reserves `reserve` bytes of addresses for each of [`REGIONS`] shards, or for half as many
/// where the address space has no room (down to one, whose error is the caller's).
fn reserve_regions(device: &Device, reserve: usize, unit: usize) -> Result<(Reservation, usize)> {
    let mut regions = REGIONS;
    loop {
        let attempt = match reserve.checked_mul(regions) {
            Some(total) => Reservation::new(device, total, unit),
            None => Err(Error::InvalidSize {
                size: reserve,
                reason: "the reservation overflows the address space",
            }),
        };
        match attempt {
            Ok(reservation) => return Ok((reservation, regions)),
            Err(e) if regions == 1 => return Err(e),
            Err(e) => {
                tracing::debug!(error = %e, regions, "no room for the shards' reservations: fewer");
                regions /= 2;
            }
        }
    }
}
