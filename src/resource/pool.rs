//! `PoolResource`: a coalescing suballocator over any upstream, whose free memory every stream shares.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant};

// `snapshot()`, in its own file.
mod snapshot;

use super::give_backs::{GiveBacks, GrowthClaim};
use super::growth::{step_within_free, Unreserve};
use super::held_for_trim::{HeldForTrim, HeldOrder, Ticket};
use super::stream_ordered::{Grow, StreamHeap};
use super::trim_waits::{run_blocking, Await, Block, TrimWaits};
use super::waiters::{MemoryWaiters, WaitStats};
use super::{aligned_size, check_stream, MemoryResource, ALIGNMENT};
use crate::device::{Device, DevicePtr};
use crate::error::{Error, Result};
use crate::stream::{Stream, StreamId};
use crate::sync::plain::Arc as StdArc;
use crate::sync::{AtomicBool, AtomicU64, Mutex, MutexGuard, Ordering};

/// Sizes and policies of a [`PoolResource`].
///
/// ```
/// use streamalloc::PoolOptions;
///
/// let options = PoolOptions {
///     initial: 256 << 20,
///     maximum: Some(8 << 30),
///     ..PoolOptions::default()
/// };
/// assert_eq!(options.growth_divisor, 8);
/// ```
#[derive(Debug, Clone)]
pub struct PoolOptions {
    /// Bytes taken from the upstream at construction (a multiple of 256; may be 0). From
    /// 256 MiB up it is taken as 8 equal chunks, one per shard of the pool's free memory (so
    /// that threads start out on different locks): a single request larger than one of them
    /// then makes the pool grow.
    pub initial: usize,
    /// The most the pool may ever hold from its upstream (a multiple of 256, at least
    /// `initial`); `None` for the device's total memory.
    pub maximum: Option<usize>,
    /// How much the pool asks for when it grows: at least the request, and at least
    /// 1/`growth_divisor` of what it holds, and at least 2 MiB (never past the maximum).
    /// 1 doubles the pool at each growth (few, large chunks: more memory held than used);
    /// the default, 8, holds at most about 1/8 more than the peak needed, in more chunks
    /// (`BENCHMARKS.md` has the figures). 0 is taken as 1.
    pub growth_divisor: u32,
    /// How much waiting between streams a request avoids at the cost of memory: a request on
    /// stream S whose best-fitting free block was freed on another stream (so S would wait on
    /// the GPU for that stream first: an event recorded there and waited on) takes instead a
    /// block S need not wait for, if one is at most this fraction larger (0.5: 50% larger).
    /// 0 (the default) always takes the best fit: the least memory held (`BENCHMARKS.md` has
    /// the figures for both). Negative or not finite is taken as 0.
    pub reuse_slack: f64,
    /// Whether a request whose block was freed on another stream first asks that stream
    /// whether all its work has finished (`cuStreamQuery`, one driver call), and reuses the
    /// block with no GPU-side wait if so, instead of recording an event there and waiting on it
    /// (two driver calls, and a dependency between the streams' future work). On by default,
    /// as the driver's own pool does (`CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC`); an idle
    /// answer covers everything that stream had freed, for every stream.
    /// [`PoolStats::idle_reuses`] counts them. A stream once seen idle, on which nothing was
    /// queued since (this crate counts what it queues on each stream), is still idle: it is
    /// not asked again, so a hand-off between idle streams costs no driver call at all. Work
    /// queued through the stream's driver handle is not counted, so a stream whose handle was
    /// handed out ([`Stream::cuda_stream`](crate::Stream::cuda_stream),
    /// [`Stream::cudarc_stream`](crate::Stream::cudarc_stream), a stream made by cudarc) is
    /// asked every time. Off, every cross-stream reuse waits on the GPU (`BENCHMARKS.md` has
    /// the figures for both).
    pub opportunistic_reuse: bool,
    /// A bound on what the pool holds against what it uses: a growth asks for no more than
    /// keeps the pool's reserved bytes within `growth_cap` times the most it has had in use (as
    /// seen at its growths, the request included). Where even the request passes that (free
    /// memory too fragmented to serve it), the growth is the request alone (at least 2 MiB).
    /// So the step never carries the pool past the cap; only its `initial` size and
    /// fragmentation can. `None` always grows by the [`growth_divisor`](Self::growth_divisor)
    /// step. The default, 1.3: without it, a pool grown from 256 MiB reached 1.301 times its
    /// peak in use on `churn-4t` and `churn-xs-4t` (the step landing one growth late); with it,
    /// more growths of smaller chunks (`BENCHMARKS.md` has the figures for both). Values below
    /// 1 or not finite are taken as 1.
    pub growth_cap: Option<f64>,
    /// Bytes of small blocks (at most 64 KiB) that each of the pool's 8 shards keeps aside
    /// when they are freed, whole and uncoalesced, for the next request of the same size on
    /// the same stream, which then takes the block back with no search, split or coalescing
    /// (stream order covers the reuse: no event, no wait). Only a block freed on the stream
    /// that allocated it, by a thread whose shard it came from, is kept: one handed off to
    /// another stream goes to the free blocks at once, as before. Another stream's request of
    /// that size sends a kept block to the free blocks, where it coalesces and is reused after
    /// an ordering as any other. The caches never make the pool grow or fail: a request that
    /// finds no fit empties its shard's cache and looks again, one about to grow empties every
    /// cache first, and so do `trim`, a release at the maximum, [`stats`](PoolResource::stats)
    /// and snapshots. The default, 4 MiB (32 MiB over the shards at most): on `churn-1t` it
    /// serves 43% of the requests and runs 13% fewer instructions per operation, for 0.01
    /// more peak memory grown from 256 MiB (`BENCHMARKS.md`). 0 turns it off.
    pub small_block_cache: usize,
}

impl Default for PoolOptions {
    fn default() -> Self {
        Self {
            initial: 0,
            maximum: None,
            growth_divisor: 8,
            reuse_slack: 0.0,
            opportunistic_reuse: true,
            growth_cap: Some(DEFAULT_GROWTH_CAP),
            small_block_cache: DEFAULT_SMALL_BLOCK_CACHE,
        }
    }
}

/// How many shards the pool's free memory is kept in (each chunk in one, each stream's requests
/// going to one first): threads on streams of different shards take different locks.
const SHARDS: usize = 8;

/// The least an initial chunk per shard holds: smaller initial sizes stay one chunk (a request
/// larger than one piece would otherwise make the pool grow).
const SPLIT_MIN: u64 = 32 << 20;

/// The least a pool grows by: smaller chunks would cost more upstream calls than they save.
const MIN_GROWTH: u64 = 2 << 20;

/// [`PoolOptions::growth_cap`]'s default.
pub const DEFAULT_GROWTH_CAP: f64 = 1.3;

/// [`PoolOptions::small_block_cache`]'s default: 4 MiB per shard.
pub const DEFAULT_SMALL_BLOCK_CACHE: usize = 4 << 20;

/// What a pool holds and has done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes held from the upstream.
    pub reserved: usize,
    /// The most ever held from the upstream.
    pub peak_reserved: usize,
    /// Bytes free in the pool (reserved minus handed out, minus memory being trimmed).
    pub free: usize,
    /// Free blocks, each coalesced with its free neighbours, but for those the small-block
    /// caches hold ([`PoolOptions::small_block_cache`]), which count one each until a request
    /// or a trim puts them back (reading the statistics changes nothing).
    pub free_blocks: usize,
    /// Upstream chunks held.
    pub chunks: usize,
    /// Streams the pool holds: every stream it has served or taken a free on, until `trim`
    /// lets go of those the user has dropped.
    pub streams: usize,
    /// Times the pool grew from its upstream after construction.
    pub grows: u64,
    /// How many of those growths [`PoolOptions::growth_cap`] made smaller than the
    /// [`growth_divisor`](PoolOptions::growth_divisor) step.
    pub capped_grows: u64,
    /// Time spent in the upstream's allocations for those growths (the driver's share of
    /// growing: on CUDA, `cuMemAlloc` of a new chunk). A pool grown from small pays it inside
    /// the requests that grew it.
    pub growth_time: Duration,
    /// Cross-stream waits: times a request's stream was made to wait (on the GPU: an event
    /// recorded on another stream and waited on) before reusing memory that other stream
    /// freed. One wait covers everything that stream had freed so far.
    pub stream_waits: u64,
    /// Requests that their thread's shard of free memory could not serve, served from another
    /// thread's shard (the best fit among the shards not busy at that moment, or, before the
    /// pool grows, among all): a high count against the requests means threads share memory
    /// more than the shards assume.
    pub shard_spills: u64,
    /// Cross-stream reuses that needed no wait: the stream that freed the memory was idle when
    /// asked, or known idle since with nothing queued on it ([`PoolOptions::opportunistic_reuse`]).
    pub idle_reuses: u64,
    /// Bytes handed out and not yet given back.
    pub in_use: usize,
    /// The most bytes handed out at once: each shard of the pool's free memory counts its
    /// peak under its own lock, and this is their sum, so exact for a pool one thread uses and
    /// an upper bound otherwise (the shards' peaks need not coincide), never more than
    /// [`peak_reserved`](Self::peak_reserved).
    pub peak_in_use: usize,
    /// Requests served from the small-block caches ([`PoolOptions::small_block_cache`]).
    pub cache_hits: u64,
}

/// A coalescing suballocator over any upstream (RMM's `pool_memory_resource`), whose free
/// memory every stream shares.
///
/// - One free list for every stream, a two-level segregated fit: a block within 3% of the best
///   fit, and coalescing with both neighbours whatever stream freed them, in constant time;
///   blocks never merge across upstream chunks. So memory freed on one stream never strands
///   there while another grows the pool (issue 10: grown from 256 MiB, WORKLOADS.md's runs
///   hold 0.82 to 1.23 times their peak live memory; `BENCHMARKS.md`). The list is kept in 8
///   shards, each chunk in one: a thread's requests go to its own shard first, then to the
///   best fit of the others, so that threads mostly take different locks.
/// - Each free block remembers the streams it was freed on. A request on the stream that freed
///   its block uses it at once (stream order); one on another stream is first ordered after
///   that stream on the GPU (an event recorded there and a wait for it: the host never waits),
///   which also covers everything that stream had freed so far. [`PoolStats::stream_waits`]
///   counts them. If that stream is idle when asked (all its work finished), no wait is needed
///   at all ([`PoolOptions::opportunistic_reuse`]).
/// - A request no free block fits grows the pool: it asks the upstream for a chunk (at least
///   the request and 1/[`PoolOptions::growth_divisor`] of what it holds, but no more than
///   keeps it within [`PoolOptions::growth_cap`] times its use, and, over device memory, no
///   more beyond the request than the device has free: see "Growth near the device's
///   limit"), halving the try on
///   failure, never past `maximum`; at the maximum it first gives wholly free chunks back
///   upstream (in stream order) to make room for one large enough, and so it does when the
///   upstream runs out below the maximum. Only when all of that fails,
///   [`Error::OutOfMemory`] with requested, available and maximum bytes.
/// - [`trim`](Self::trim) lets go of streams the user has dropped and returns wholly free
///   chunks to the upstream.
///
/// **Growth near the device's limit.** A `cuMemAlloc` short of memory makes the driver release
/// all that every stream-ordered driver pool of the process keeps (a
/// [`CudaAsyncResource`](super::cuda_async::CudaAsyncResource)'s, the default pool that other
/// libraries allocate from) before it succeeds or fails. So over device memory the pool asks
/// for more than a request only out of the memory the device has free (less 64 MiB): its
/// growth step never empties those caches for memory nobody has asked for, nor fails and is
/// halved on the way. The request itself may still take them, as it would from the driver
/// directly.
///
/// Dropping the pool synchronizes the streams it knows and returns every chunk upstream (the
/// buffers that hold it keep it alive until they are gone).
pub struct PoolResource<U: MemoryResource> {
    upstream: U,
    device: Device,
    heap: StreamHeap,
    /// Upstream chunks: base → size.
    chunks: Mutex<BTreeMap<u64, u64>>,
    /// Bytes held from upstream, including chunks being grown (reserved before the upstream
    /// call, so two threads growing at once cannot pass the maximum together).
    reserved: AtomicU64,
    peak_reserved: AtomicU64,
    grows: AtomicU64,
    /// Growths the cap made smaller than the step.
    capped_grows: AtomicU64,
    /// Nanoseconds spent in the upstream's allocations for growth.
    growth_nanos: AtomicU64,
    maximum: u64,
    growth_divisor: u64,
    /// [`PoolOptions::growth_cap`], at least 1.
    growth_cap: Option<f64>,
    /// The most in use (with the request) seen at a growth: a floor of the pool's peak in use,
    /// which `growth_cap` multiplies. Written under the engine's growth lock.
    use_floor: AtomicU64,
    /// Tasks waiting in `allocate_async` for memory to come back. Shared with the upstream's
    /// queue, if it has one, which relays to it ([`MemoryWaiters::stacked_over`]): a pool over
    /// a limiting adaptor that others use too is refused there, and memory they give back
    /// there must wake its waiters (a review found such waiters asleep until a free through
    /// the pool itself).
    waiters: StdArc<MemoryWaiters>,
    /// Whole chunks that trims took out of the lists and hold while they wait for the streams
    /// that freed them: a request at the maximum takes them back ([`Grow::recall_trimmed`]).
    held_for_trim: HeldForTrim<HeldChunk>,
    /// A stream of the pool's own, for the initial chunk and for returning chunks at drop.
    own: Stream,
    /// Growths giving whole chunks back upstream with the engine's `slow` let go: a request at
    /// the maximum that finds nothing meanwhile waits for every one under way to end before it
    /// fails, since the room comes back at their end.
    give_backs: GiveBacks,
    /// Set where waiters must be told of memory back in the lists or room back under the
    /// maximum, found with the engine's `slow` held (a recall from the trims, a growth's
    /// give-back ending): [`allocate`](MemoryResource::allocate) tells them once the request
    /// is over and holds no lock. A waker is the executor's code, which may poll its task at
    /// once; a task that then asks this pool for memory on the slow path would wait for ever
    /// on `slow`, held by its own thread (a review found the waiters of a pool stacked over
    /// this one woken under it; and, later, this pool's own, relayed from its upstream's queue
    /// during a growth: `MemoryWaiters::deferring`).
    tell_waiters: AtomicBool,
}

/// A whole free chunk out of the lists: base, size, and the stream it was last freed on (none
/// for memory never handed out), on which it goes back upstream.
type TakenChunk = (u64, u64, Option<Stream>);

/// A whole chunk a trim holds (`held_for_trim`): base, size, and how it stands with the
/// streams that last used it (ordered: on the stream it goes upstream on; `None`, on the
/// pool's own).
type HeldChunk = (u64, u64, HeldOrder<Stream>);

impl<U: MemoryResource> fmt::Debug for PoolResource<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolResource")
            .field("upstream", &self.upstream)
            .field("maximum", &self.maximum)
            .field("stats", &self.stats())
            .finish()
    }
}

impl<U: MemoryResource> PoolResource<U> {
    /// A pool over `upstream`. Errors: `initial` or `maximum` not a multiple of 256, `initial`
    /// above `maximum` ([`Error::InvalidSize`]); the upstream's error if it cannot provide
    /// `initial`.
    pub fn new(upstream: U, options: PoolOptions) -> Result<Self> {
        let device = upstream.device().clone();
        // The default is the device's memory, rounded down to the alignment: a device (a
        // simulated one, made with any size) need not hold a multiple of 256 bytes, and a
        // maximum the user never gave must not be refused.
        let maximum = (options.maximum).unwrap_or(device.total_memory() / ALIGNMENT * ALIGNMENT);
        for (size, what) in [(options.initial, "initial"), (maximum, "maximum")] {
            if !size.is_multiple_of(ALIGNMENT) {
                return Err(Error::InvalidSize {
                    size,
                    reason: if what == "initial" {
                        "the pool's initial size must be a multiple of 256 bytes"
                    } else {
                        "the pool's maximum size must be a multiple of 256 bytes"
                    },
                });
            }
        }
        if options.initial > maximum {
            return Err(Error::InvalidSize {
                size: options.initial,
                reason: "the pool's initial size is above its maximum",
            });
        }
        let own = device.create_stream()?;
        // After the last step that can fail before the pool exists (whose drop undoes it).
        let waiters = MemoryWaiters::stacked_over(&upstream);
        let pool = Self {
            own,
            give_backs: GiveBacks::new(),
            tell_waiters: AtomicBool::new(false),
            device,
            upstream,
            heap: StreamHeap::with_options(options.reuse_slack, SHARDS)
                .with_opportunistic(options.opportunistic_reuse)
                .with_cache(options.small_block_cache as u64),
            chunks: Mutex::new(BTreeMap::new()),
            reserved: AtomicU64::new(0),
            peak_reserved: AtomicU64::new(0),
            grows: AtomicU64::new(0),
            capped_grows: AtomicU64::new(0),
            growth_nanos: AtomicU64::new(0),
            maximum: maximum as u64,
            growth_divisor: u64::from(options.growth_divisor.max(1)),
            growth_cap: options
                .growth_cap
                .map(|cap| if cap.is_finite() { cap.max(1.0) } else { 1.0 }),
            use_floor: AtomicU64::new(0),
            waiters,
            held_for_trim: HeldForTrim::new(),
        };
        if options.initial > 0 {
            // One chunk per shard when each would hold at least `SPLIT_MIN`, into the engine's
            // reserve: each thread's shard takes chunks from there as it needs them, so that
            // threads work on different locks (a pool that never grows would otherwise keep
            // every thread on the one shard holding all its memory), and one thread keeps all
            // its memory in its own shard.
            let initial = options.initial as u64;
            let pieces = if initial >= SHARDS as u64 * SPLIT_MIN {
                SHARDS as u64
            } else {
                1
            };
            let piece = initial / pieces / ALIGNMENT as u64 * ALIGNMENT as u64;
            let mut grown = Vec::new();
            // The growths run `deferring`, which holds back, and stashes, what the upstream's
            // `allocate` notifies (a limit's rollback tells its waiters): told when this guard
            // drops, as a request's guard does. Without it, a waiter of another queue stashed
            // here slept until this thread's next request, or for ever if the thread ended (a
            // review of the stash).
            let tell = pool.waiters.tell_held_back(&pool.tell_waiters);
            for i in 0..pieces {
                let size = if i + 1 == pieces {
                    initial - piece * (pieces - 1)
                } else {
                    piece
                };
                grown.push(pool.grow_exactly(size, &pool.own)?);
            }
            drop(tell);
            // The chunks were allocated in stream order on our own stream; once that has run,
            // any stream may use them without waiting: they are fresh.
            pool.own.synchronize_blocking()?;
            for (base, size) in grown {
                pool.heap.add_reserve(base, size);
            }
        }
        Ok(pool)
    }

    /// The upstream resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }

    /// The most the pool may hold from its upstream.
    pub fn maximum(&self) -> usize {
        self.maximum as usize
    }

    /// What the pool holds and has done.
    pub fn stats(&self) -> PoolStats {
        let engine = self.heap.stats();
        // Read after the engine's: a block counted there came from a chunk whose reservation
        // was counted before the chunk reached a shard's lock.
        let peak_reserved = self.peak_reserved.load(Ordering::Acquire);
        PoolStats {
            reserved: self.reserved.load(Ordering::Relaxed) as usize,
            peak_reserved: peak_reserved as usize,
            free: engine.free_bytes as usize,
            free_blocks: engine.free_blocks,
            chunks: self.chunks.lock().len(),
            streams: engine.streams,
            grows: self.grows.load(Ordering::Relaxed),
            capped_grows: self.capped_grows.load(Ordering::Relaxed),
            growth_time: Duration::from_nanos(self.growth_nanos.load(Ordering::Relaxed)),
            stream_waits: engine.waits,
            shard_spills: engine.spills,
            idle_reuses: engine.idle_skips,
            in_use: engine.in_use as usize,
            // The shards' peaks summed can pass what the pool ever held: at its maximum the
            // pool gives one shard's chunk back and grows another's, and both shards keep their
            // peaks (a review found 5 MiB reported in use under a 4 MiB maximum). Nothing can be
            // in use beyond what is held, so the lesser is still an upper bound.
            peak_in_use: engine.peak_in_use.min(peak_reserved) as usize,
            cache_hits: engine.cache_hits,
        }
    }

    /// Reserves `size` bytes of the maximum and takes them from the upstream on `stream`.
    fn grow_exactly(&self, size: u64, stream: &Stream) -> Result<(u64, u64)> {
        let reserved = self.reserved.fetch_add(size, Ordering::AcqRel) + size;
        if reserved > self.maximum {
            self.reserved.fetch_sub(size, Ordering::AcqRel);
            return Err(self.out_of_memory(size));
        }
        // Given back if the upstream's allocate unwinds: the room would otherwise stay
        // claimed for good, and the pool short of its maximum ever after.
        let unreserve = Unreserve {
            reserved: &self.reserved,
            size,
        };
        // Under `slow` (a growth): what the upstream's queue relays here is told once the
        // request is over (`tell_waiters`; see `MemoryWaiters::deferring`).
        let allocated = (self.waiters).deferring(&self.tell_waiters, || {
            self.upstream.allocate(size as usize, stream)
        });
        std::mem::forget(unreserve);
        match allocated {
            Ok(ptr) => {
                self.peak_reserved.fetch_max(reserved, Ordering::AcqRel);
                self.chunks.lock().insert(ptr.0, size);
                Ok((ptr.0, size))
            }
            Err(e) => {
                self.reserved.fetch_sub(size, Ordering::AcqRel);
                Err(e)
            }
        }
    }

    /// `available` is the largest request that could have succeeded: the largest free block,
    /// or the room left under the maximum, whichever is larger (free bytes spread over blocks
    /// and chunks cannot serve one request, so they are not "available" to it).
    fn out_of_memory(&self, requested: u64) -> Error {
        self.out_of_memory_within(requested, u64::MAX, usize::MAX)
    }

    /// Out of memory because the upstream refused a growth, with the upstream's numbers where
    /// it gave them: `available` no more than the upstream said it had (room under our own
    /// maximum is no use when the upstream cannot fill it), and `maximum` no more than the
    /// upstream's, so that a request it can never serve is not taken for one worth waiting
    /// for. (A review found a pool over a smaller pool reporting its own maximum: awaitable
    /// requests for more than the inner pool could ever hold waited for ever.)
    fn upstream_out_of_memory(&self, requested: u64, upstream: &Error) -> Error {
        match *upstream {
            // A maximum of 0 is an error without numbers (some out-of-memory errors leave them
            // for a caller to fill in, a user's `CallbackResource` may give none): nothing
            // known, nothing capped, or every awaitable request would fail at once.
            Error::OutOfMemory {
                available,
                maximum: maximum @ 1..,
                ..
            } => self.out_of_memory_within(requested, available as u64, maximum),
            // The host could not back the memory (a simulated device's): not ours to wait
            // for, whatever our maximum says; as it is.
            Error::HostOutOfMemory { .. } => upstream.clone(),
            _ => self.out_of_memory(requested),
        }
    }

    /// [`out_of_memory`](Self::out_of_memory) where the room under the maximum counts for at
    /// most `upstream_available`, and the maximum is at most `upstream_maximum`.
    fn out_of_memory_within(
        &self,
        requested: u64,
        upstream_available: u64,
        upstream_maximum: usize,
    ) -> Error {
        let room = (self.maximum)
            .saturating_sub(self.reserved.load(Ordering::Relaxed))
            .min(upstream_available);
        Error::OutOfMemory {
            requested: requested as usize,
            available: room.max(self.heap.largest_free_block()) as usize,
            maximum: (self.maximum as usize).min(upstream_maximum),
        }
    }

    /// What waiting for memory in [`allocate_async`](crate::AllocateAsync::allocate_async) has
    /// cost: tasks waiting now, bytes they wait for, wait times.
    pub fn wait_stats(&self) -> WaitStats {
        self.waiters.stats()
    }

    /// Checks the invariants of every free list and that no two share memory. Slow; for tests.
    ///
    /// Not a consistent snapshot: it reads the shards of the free memory one after another, so
    /// an operation on another thread during the check can make it see a state the pool was
    /// never in. Call it while no other thread allocates or frees (`examples/soak` holds a gate
    /// around the pool's calls for it).
    #[doc(hidden)]
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.heap.check()
    }

    /// Lets go of the streams the user has dropped (once their GPU work is done, no free block
    /// needs to wait for them), then returns every wholly free chunk to the upstream, waiting
    /// (by `.await`, never inside a lock) for the GPU work on the streams it was freed on.
    /// Returns the bytes released.
    ///
    /// On an error of its own work (a failed upstream free), what was not given back is put
    /// back where it was: nothing is lost, and the pool works as before.
    ///
    /// A stream whose work failed (a sticky error: a fault poisons the stream, as it breaks a
    /// CUDA context) does not fail the trim: a synchronization that fails so returns only once
    /// the stream's work has ended, and the failure is reported on the user's own operations on
    /// that stream. A dropped one is let go of as if it had synchronized (logged at warn level
    /// with its error) once it answers idle (on CUDA a stream of a broken context never does:
    /// its memory then stays in the pool, and each trim asks again); the chunks last freed on
    /// a live one stay in the pool, free (logged at warn level), as a capture's do, and the
    /// rest is released. The trim then returns `Ok`
    /// with the bytes it did release. Before, one such stream made every trim fail, releasing
    /// nothing, for the process's life.
    ///
    /// A stream under a user's graph capture cannot be waited for (its captured work runs
    /// only when the graph is launched, and a synchronization would invalidate the capture):
    /// the chunks last freed on it stay in the pool, free (kept, logged at debug level as kept
    /// for a capture), and the rest is released as usual. The trim then returns `Ok` with the
    /// bytes it did release; a later trim, once the capture has ended, releases the rest. A
    /// dropped stream under a capture is let go of only at a later trim.
    ///
    /// While it waits for those streams, the chunks it took are out of the free list. A request
    /// on another thread that finds no fit grows the pool as usual; at the maximum, it takes
    /// every chunk the trims hold back into the list instead of failing, and is served from
    /// them after the streams that freed them (GPU-side, as any reuse). The trim then gives
    /// back only what is still its own, and returns those bytes. While the trim gives its
    /// chunks upstream, a request at the maximum is refused as if the trim had finished first
    /// ([`allocate_async`](crate::AllocateAsync::allocate_async) waits instead, and is woken
    /// when the trim ends): a request never waits for the GPU.
    ///
    /// Over [`CudaResource`](super::cuda::CudaResource), each chunk given back is a
    /// `cuMemFree`, which waits for the whole device to be idle and meanwhile holds up every
    /// thread's launches on that GPU (see `CudaResource`): trim between phases, not beside
    /// latency-sensitive work.
    ///
    /// # Cancel safety
    /// Cancel-safe: dropped while it waits for a stream, it puts the chunks it took out back
    /// where they were, free and usable (a review found them out of the lists, never handed out
    /// again, until the pool was dropped).
    pub async fn trim(&self) -> Result<usize> {
        self.trim_with(Await).await
    }

    /// [`trim`](Self::trim) for synchronous code: blocks the calling thread while it waits.
    pub fn trim_blocking(&self) -> Result<usize> {
        run_blocking(self.trim_with(Block))
    }

    /// The trim, waiting with `waits` (`.await` or blocking).
    async fn trim_with(&self, waits: impl TrimWaits) -> Result<usize> {
        // Every idle stream is waited for, whatever fails: one failure must not skip the others.
        for stream in self.heap.idle_streams() {
            match waits.stream(&stream).await {
                Ok(()) => self.heap.forget(stream),
                // Kept (not forgotten) until the capture ends: its work cannot be waited for.
                Err(Error::StreamCapturing { .. }) => {}
                Err(e) => forget_failed(&self.heap, stream, &e),
            }
        }
        // Put back if this future is dropped while it waits (a failed wait keeps only its own
        // stream's chunks: `keep_for_failure`).
        let (taken, streams) = TakenForTrim::take(self);
        let mut captured = Vec::new();
        let mut failed = Vec::new();
        for stream in &streams {
            if captured.contains(&stream.id()) || failed.contains(&stream.id()) {
                continue;
            }
            match waits.stream(stream).await {
                Ok(()) => {}
                Err(Error::StreamCapturing { .. }) => captured.push(stream.id()),
                // Kept: see `failed_stream`.
                Err(e) => failed.push(failed_stream(stream, &e)),
            }
        }
        taken.keep_for_capture(&captured);
        taken.keep_for_failure(&failed);
        taken.give_back()
    }

    /// Whole chunks taken out for release go back, as freed on the stream they must wait for.
    /// Waiters are told: a request may have failed while they were out.
    fn put_back(&self, taken: &[(u64, u64, Option<Stream>)]) {
        if self.put_back_quietly(taken) {
            self.waiters.notify();
        }
    }

    /// [`put_back`](Self::put_back) without telling the waiters: whether they should be told
    /// (something went back). For the callers that put back under the trims' lock
    /// (`held_for_trim`), who tell them once it is let go: a waker is the executor's code, which
    /// may poll its task at once, and a task that asks this pool for memory on the slow path
    /// takes that lock (a review found waiters of a pool stacked over this one woken under it).
    fn put_back_quietly(&self, taken: &[(u64, u64, Option<Stream>)]) -> bool {
        for (base, size, stream) in taken {
            self.put_back_chunk(*base, *size, stream.as_ref());
        }
        !taken.is_empty()
    }

    /// One whole chunk back in the lists, as freed on `stream` (the one it must wait for), or
    /// as fresh memory.
    fn put_back_chunk(&self, base: u64, size: u64, stream: Option<&Stream>) {
        match stream {
            Some(stream) => self.heap.give_blocks_to(&[(base, size)], stream),
            None => self.heap.give_back_fresh_chunk(base, size),
        }
    }

    /// [`put_back_quietly`](Self::put_back_quietly) for chunks the trims held: one still
    /// tagged goes back with its tag, as it was taken.
    fn put_back_held(&self, held: &[HeldChunk]) -> bool {
        for (base, size, order) in held {
            match order {
                HeldOrder::Tagged(tag) => self.heap.give_back_tagged(*base, *size, *tag),
                HeldOrder::On(stream) => self.put_back_chunk(*base, *size, stream.as_ref()),
            }
        }
        !held.is_empty()
    }

    /// For a trim, under the trims' lock: every wholly free chunk out of the lists, with its
    /// tag (no driver call: [`TakenForTrim::take`] orders them once that lock is let go).
    fn take_whole_chunks_tagged(&self) -> Vec<HeldChunk> {
        let chunks: Vec<(u64, u64)> = self.chunks.lock().iter().map(|(&b, &s)| (b, s)).collect();
        (chunks.into_iter())
            .filter_map(|(base, size)| {
                let order = match self.heap.take_whole_chunk(base, size)? {
                    Some(tag) => HeldOrder::Tagged(tag),
                    None => HeldOrder::On(None),
                };
                Some((base, size, order))
            })
            .collect()
    }

    /// For a growth of `min` bytes that found no room (at the maximum, or the upstream out of
    /// memory): every wholly free chunk out of the lists, to give back upstream so that the
    /// growth can try again with that room, and the rest of the room under the maximum that
    /// `min` needs claimed (added to `reserved` until the claim is dropped). None if there
    /// was no whole free chunk, or one that holds `min` by itself (put back: the request
    /// looks again). Free memory spread over chunks too small for a request would
    /// otherwise keep it failing (and an `allocate_async` waiting), everything free or not.
    /// Under the engine's `slow`.
    fn take_whole_chunks_for_growth(&self, min: u64) -> Option<(GrowthClaim<'_>, Vec<TakenChunk>)> {
        let whole = self.take_whole_chunks();
        if whole.is_empty() {
            return None;
        }
        // A wholly free chunk that holds the request by itself was freed since the request's
        // last look (frees take no lock a growth holds). Giving it back to grow a smaller one
        // only cuts the pool into pieces (`awaitable`'s 64 tasks at the maximum did so under
        // load, 4 to 20 growths a run, since the give-back at the maximum was made): back in
        // the lists, and the request looks again (`take_slow`).
        if whole.iter().any(|&(_, size, _)| size >= min) {
            if self.put_back_quietly(&whole) {
                self.tell_waiters.store(true, Ordering::Release);
            }
            return None;
        }
        let bytes: u64 = whole.iter().map(|&(_, size, _)| size).sum();
        let room = self
            .maximum
            .saturating_sub(self.reserved.load(Ordering::Relaxed));
        // Giving them all back would still leave too little room for the request: keep them
        // (a review found the pool freeing chunks, each a device-wide `cuMemFree`, for a
        // request it then refused, and growing them again for the next; the arena checked).
        // Put back untold: they were out only under `slow`, which every request takes before
        // it fails, so none failed for want of them; and a waiter told here would be told by
        // its own try (a request the pool at its maximum cannot serve), try again at once, fail
        // again the same way, in a loop for as long as the memory stays short.
        if room.saturating_add(bytes) < min {
            self.put_back_quietly(&whole);
            return None;
        }
        let extra = min.saturating_sub(bytes).min(room);
        // Room under the maximum comes back (and chunks perhaps back in the lists) when the
        // claim goes: a request refused at the maximum meanwhile may fit then. The claim goes
        // under `slow`, so the waiters are told after it (`tell_waiters`), not by the claim.
        let claim = (self.give_backs).claim(&self.reserved, extra);
        Some((claim, whole))
    }

    fn take_whole_chunks(&self) -> Vec<(u64, u64, Option<Stream>)> {
        let chunks: Vec<(u64, u64)> = self.chunks.lock().iter().map(|(&b, &s)| (b, s)).collect();
        self.heap.take_whole_chunks(&chunks)
    }

    /// Gives whole chunks (out of the free list) back upstream, each on the stream it was freed
    /// on (or our own, for fresh memory), which orders the release after its last use.
    fn release_chunks(&self, taken: Vec<(u64, u64, Option<Stream>)>) -> Result<usize> {
        match self.release_chunks_counted(taken, false) {
            (_, Some(e)) => Err(e),
            (released, None) => Ok(released),
        }
    }

    /// [`release_chunks`](Self::release_chunks), with the bytes given back also on an error
    /// (the first). With `keep_room`, those bytes stay counted in `reserved` (the caller's
    /// [`GrowthClaim`] takes them over) and no waiter is told: the room is not back yet.
    fn release_chunks_counted(
        &self,
        taken: Vec<(u64, u64, Option<Stream>)>,
        keep_room: bool,
    ) -> (usize, Option<Error>) {
        let _span = tracing::debug_span!("trim", chunks = taken.len()).entered();
        let mut first_error = None;
        // What is owed if the upstream's `deallocate` unwinds (see `ReleaseLeft`).
        let mut left = ReleaseLeft {
            pool: self,
            chunks: taken.into_iter(),
            in_flight: 0,
            released: 0,
            keep_room,
        };
        for (base, size, stream) in left.chunks.by_ref() {
            // Unregister first: once the upstream has the chunk back it may hand the same
            // address out again, and a concurrent grow would register it; removing after the
            // call would then delete that new, live chunk.
            self.chunks.lock().remove(&base);
            self.heap.remove_chunk(base);
            let on = stream.as_ref().unwrap_or(&self.own);
            left.in_flight = size;
            // SAFETY: a whole chunk, out of every list and unregistered, so nothing can hand
            // it out again; it came from this upstream with this size, and its last use is
            // ordered before this point of `on` (it was freed there, or never used).
            let freed = unsafe { self.upstream.deallocate(DevicePtr(base), size as usize, on) };
            left.in_flight = 0;
            match freed {
                Ok(()) => {
                    if !keep_room {
                        self.reserved.fetch_sub(size, Ordering::AcqRel);
                    }
                    left.released += size;
                }
                Err(e) => {
                    // Keep it: registered again, and free again as freed on the stream it waits
                    // for, so reuse elsewhere is still ordered after that stream.
                    self.chunks.lock().insert(base, size);
                    self.heap.add_chunk(base, size);
                    self.put_back(&[(base, size, stream)]);
                    match e {
                        // The upstream refused a free ordered on a stream that a user's graph
                        // capture began on since: kept, as the trim keeps such chunks.
                        Error::StreamCapturing { .. } => tracing::debug!(
                            base,
                            size,
                            "a chunk kept for a capture: its stream is being captured into a CUDA graph"
                        ),
                        e => {
                            first_error.get_or_insert(e);
                        }
                    }
                }
            }
        }
        let released = left.released as usize;
        tracing::debug!(released, "trimmed");
        if released > 0 && !keep_room {
            // Room under the maximum came back: a request refused at the maximum (perhaps
            // while these chunks were out of the lists) may fit now. A review found waiters
            // left asleep with the room there (the expandable pool already did this).
            self.waiters.notify();
        }
        (released, first_error)
    }
}

impl<U: MemoryResource> Grow for PoolResource<U> {
    fn trim_epoch(&self) -> u64 {
        self.held_for_trim.epoch()
    }

    fn recall_trimmed(&self, epoch: u64) -> bool {
        // Under `slow`: the waiters are told once the request is over (`tell_waiters`).
        (self.held_for_trim).recall(epoch, |chunks| {
            if self.put_back_held(&chunks) {
                self.tell_waiters.store(true, Ordering::Release);
            }
        })
    }

    /// A growth that gives nothing back: [`grow_under`](Grow::grow_under) gives the wholly
    /// free chunks back upstream when this fails, with the engine's `slow` let go.
    fn grow(&self, min: u64, stream: &Stream) -> Result<(u64, u64)> {
        let reserved = self.reserved.load(Ordering::Relaxed);
        let room = self.maximum.saturating_sub(reserved);
        if min > room {
            let _span = tracing::debug_span!(
                "out_of_memory",
                requested = min,
                reserved,
                maximum = self.maximum
            )
            .entered();
            tracing::debug!("request above the room left under the maximum");
            return Err(self.out_of_memory(min));
        }
        // At least the request and a share of what we hold (at most the room left); halve on
        // failure.
        let mut attempt = within(
            (reserved / self.growth_divisor).max(MIN_GROWTH).max(min),
            room,
        );
        let mut is_capped = false;
        if let Some(cap) = self.growth_cap {
            // What the cap allows over what is held, from the most ever in use at a growth
            // (a floor of the peak in use), and never less than the request.
            let in_use = self.heap.in_use().saturating_add(min);
            let floor = self
                .use_floor
                .fetch_max(in_use, Ordering::Relaxed)
                .max(in_use);
            // (An `as` cast saturates: a cap so large that this passes `u64::MAX` allows all
            // the room there is.)
            let allowed = ((floor as f64 * cap) as u64).saturating_sub(reserved);
            let capped = within(allowed.max(MIN_GROWTH).max(min), room);
            if capped < attempt {
                tracing::debug!(step = attempt, capped, floor, "growth capped");
                attempt = capped;
                is_capped = true;
            }
        }
        let fits = step_within_free(&self.device, self.upstream.memory_kind(), min, attempt);
        if fits < attempt {
            tracing::debug!(step = attempt, fits, "growth held to the free memory");
            attempt = fits;
        }
        let _span = tracing::debug_span!("grow", requested = min, reserved, attempt).entered();
        loop {
            let started = Instant::now();
            let grown = self.grow_exactly(attempt, stream);
            let nanos = started.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64;
            self.growth_nanos.fetch_add(nanos, Ordering::Relaxed);
            match grown {
                Ok(chunk) => {
                    self.grows.fetch_add(1, Ordering::Relaxed);
                    if is_capped {
                        self.capped_grows.fetch_add(1, Ordering::Relaxed);
                    }
                    tracing::debug!(chunk = chunk.1, "pool grew");
                    return Ok(chunk);
                }
                // Halved down to the request itself, never below it: an upstream with room for
                // the request but not for half the step must still be asked for the request
                // (a review found the pool refusing, and an awaited request waiting for ever,
                // over a limit of 1.5 MiB asked for 1.25: 2 MiB, then 1 MiB, then the error).
                Err(e) if attempt > min && e.is_out_of_memory() => {
                    attempt = (attempt / 2).next_multiple_of(ALIGNMENT as u64).max(min);
                }
                // The upstream ran out below our maximum (a device shared with other users, a
                // smaller upstream): `grow_under` gives our wholly free chunks back, as at the
                // maximum, and tries once more (a review's finding).
                Err(e) if e.is_out_of_memory() => {
                    tracing::debug!("upstream out of memory");
                    return Err(self.upstream_out_of_memory(min, &e));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// [`grow`](Grow::grow); if that finds no room (at the maximum: blocks never merge across
    /// chunks; or the upstream out of memory below it), the wholly free chunks go back
    /// upstream, in stream order, and it grows once more.
    ///
    /// The give-back runs with `slow` let go: over `CudaResource` each chunk is a `cuMemFree`,
    /// which waits for the whole device to be idle (milliseconds), and every other request
    /// that needs growth would wait that long behind `slow`. Letting it go is safe: the chunks
    /// are out of the lists and unregistered first (nothing else can hand them out or give
    /// them back), each is freed on the stream it was freed on (after its last use), their
    /// bytes and the rest of the room this growth needs stay counted in `reserved` until it
    /// takes `slow` again ([`GrowthClaim`]: a request growing meanwhile grows only into what is
    /// left, so the maximum holds and the room stays this growth's), and a request that finds
    /// nothing meanwhile waits for the give-back to end before it fails
    /// ([`wait_for_give_backs`](Grow::wait_for_give_backs)).
    fn grow_under<'s>(
        &self,
        slow: MutexGuard<'s, ()>,
        lock: &'s Mutex<()>,
        min: u64,
        stream: &Stream,
    ) -> (MutexGuard<'s, ()>, Result<(u64, u64)>) {
        let e = match self.grow(min, stream) {
            Err(e) if e.is_out_of_memory() => e,
            other => return (slow, other),
        };
        let Some((mut claim, whole)) = self.take_whole_chunks_for_growth(min) else {
            return (slow, Err(e));
        };
        drop(slow);
        let released = {
            let _span =
                tracing::debug_span!("release_for_growth", requested = min, chunks = whole.len())
                    .entered();
            // With no lock held (see above).
            let (released, error) = self.release_chunks_counted(whole, true);
            if let Some(e) = error {
                // The chunks it could not free are back in the lists, free.
                tracing::warn!(error = %e, "could not release free chunks to grow");
            }
            released
        };
        claim.claimed += released as u64;
        let slow = lock.lock();
        // The room back for this growth, under `slow`: no other growth comes between. The
        // waiters are told once the request is over and `slow` let go (`tell_waiters`).
        drop(claim);
        self.tell_waiters.store(true, Ordering::Release);
        if released == 0 {
            return (slow, Err(e));
        }
        let grown = self.grow(min, stream);
        (slow, grown)
    }

    /// Waits, with `slow` let go, for the growths' give-backs under way to end; whether there
    /// was one (see [`Grow::wait_for_give_backs`]).
    fn wait_for_give_backs<'s>(
        &self,
        slow: MutexGuard<'s, ()>,
        lock: &'s Mutex<()>,
    ) -> (MutexGuard<'s, ()>, bool) {
        self.give_backs.wait_for_under_way(slow, lock)
    }
}

/// A release of whole chunks upstream ([`PoolResource::release_chunks_counted`]) under way,
/// for the case that the upstream's `deallocate` unwinds: the chunks not yet given back go
/// back in the lists (out of them, and still registered and counted, they were lost to the
/// pool for good: a review's finding), and the room of the chunk in flight (whether the
/// upstream took it back or not, it is no longer the pool's) and, for a growth
/// (`keep_room`), of those given back already leaves `reserved`, since no growth takes it over.
struct ReleaseLeft<'a, U: MemoryResource> {
    pool: &'a PoolResource<U>,
    /// The chunks not yet given back.
    chunks: std::vec::IntoIter<(u64, u64, Option<Stream>)>,
    /// The size of the chunk in the upstream's `deallocate`, 0 between calls.
    in_flight: u64,
    /// Bytes given back so far.
    released: u64,
    keep_room: bool,
}

impl<U: MemoryResource> Drop for ReleaseLeft<'_, U> {
    fn drop(&mut self) {
        if self.in_flight == 0 {
            return;
        }
        let rest: Vec<_> = self.chunks.by_ref().collect();
        tracing::error!(
            chunk = self.in_flight,
            left = rest.len(),
            "the upstream panicked giving a chunk back: the chunk is taken as given back, the \
             others go back in the lists"
        );
        let given_up = self.in_flight + if self.keep_room { self.released } else { 0 };
        self.pool.reserved.fetch_sub(given_up, Ordering::AcqRel);
        // Tells the waiters, for these and for the room; and a request that found nothing
        // held by a trim looks again (the epoch moves on, as at a trim's end).
        self.pool.put_back(&rest);
        if rest.is_empty() {
            self.pool.waiters.notify();
        }
        self.pool.held_for_trim.given_back();
    }
}

/// `bytes` rounded up to [`ALIGNMENT`], at most `room`: never an
/// overflow, whatever a large cap or step asks for (a review found `growth_cap: Some(f64::MAX)`
/// panicking in debug builds and growing by 0 bytes in release ones).
fn within(bytes: u64, room: u64) -> u64 {
    bytes
        .min(room)
        .checked_next_multiple_of(ALIGNMENT as u64)
        .map_or(room, |b| b.min(room))
}

// SAFETY: blocks are cut from chunks of the upstream (itself a `MemoryResource`) by the
// stream-ordered engine, whose block table hands out no byte twice and takes back only blocks it
// handed out, and which orders every reuse across streams (`stream_ordered`).
unsafe impl<U: MemoryResource> MemoryResource for PoolResource<U> {
    fn device(&self) -> &Device {
        &self.device
    }

    fn memory_kind(&self) -> super::MemoryKind {
        self.upstream.memory_kind()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        // The stream first: another device's stream is the caller's mistake whatever the
        // size, and a zero-byte request must not hide it.
        check_stream(&self.device, stream)?;
        if bytes == 0 {
            return Ok(DevicePtr(0));
        }
        let size = aligned_size(bytes)? as u64;
        if size > self.maximum {
            return Err(self.out_of_memory(size));
        }
        // What the request finds to tell the waiters under the engine's locks (or a growth
        // holds back), told once it holds none: here, or while a panic unwinds past them.
        let tell = self.waiters.tell_held_back(&self.tell_waiters);
        let taken = self.heap.take(size, stream, self);
        drop(tell);
        let ptr = match taken {
            Ok(addr) => DevicePtr(addr),
            Err(e) => {
                // A failed ordering (a driver error) puts the block it found back: a task whose
                // try missed it meanwhile is told, as a free would tell it (an engine review's
                // finding: it slept until the next free).
                if !e.is_out_of_memory() {
                    self.waiters.notify();
                }
                return Err(e);
            }
        };
        // The race detector of the simulated device checks blocks, not chunks (a no-op on CUDA).
        self.device.note_allocation(ptr, size as usize, stream);
        Ok(ptr)
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        check_stream(&self.device, stream)?;
        if bytes == 0 {
            return if ptr.0 == 0 {
                Ok(())
            } else {
                Err(Error::UnknownPointer { ptr: ptr.0, bytes })
            };
        }
        let size = aligned_size(bytes)? as u64;
        if !ptr.0.is_multiple_of(ALIGNMENT as u64) {
            return Err(Error::UnknownPointer { ptr: ptr.0, bytes });
        }
        // Noted before the block is back in a list, from where another thread may hand it out
        // again; a race's panic (the `Panic` mode) comes once it is back.
        self.device.note_free_then(ptr, size as usize, stream, || {
            if !self.heap.give(ptr.0, size, stream) {
                return Err(Error::UnknownPointer { ptr: ptr.0, bytes });
            }
            self.waiters.notify();
            Ok(())
        })
    }

    /// The set's total, each request rounded up, against the maximum.
    fn check_set(&self, sizes: &[usize]) -> Result<()> {
        super::check_set_within(sizes, self.maximum as usize, aligned_size)
    }

    fn memory_waiters(&self) -> Option<&MemoryWaiters> {
        Some(&self.waiters)
    }

    fn memory_snapshot(&self) -> Option<super::snapshot::Snapshot> {
        Some(self.snapshot())
    }
}

impl<U: MemoryResource> Drop for PoolResource<U> {
    fn drop(&mut self) {
        MemoryWaiters::unstack_from(&self.waiters, &self.upstream);
        // Frees may still be queued on the streams the lists belong to: let them run, then give
        // every chunk back on our own stream.
        if !super::wait_for_streams_at_drop("PoolResource", self.heap.streams()) {
            return;
        }
        let chunks = std::mem::take(&mut *self.chunks.lock());
        for (base, size) in chunks {
            // SAFETY: the pool is going away, so nothing is handed out from it any more, and
            // no buffer holds memory from it (buffers keep the pool alive); every stream that
            // used it was synchronized above.
            if let Err(e) = unsafe {
                self.upstream
                    .deallocate(DevicePtr(base), size as usize, &self.own)
            } {
                tracing::warn!(error = %e, base, size, "could not return a pool chunk upstream");
            }
        }
    }
}

/// A trim's first stage, for a dropped stream whose synchronization failed (not for a
/// capture): logged, and let go of as one that synchronized, so that one failed stream does
/// not fail every trim, releasing nothing, for the process's life (a review's finding).
///
/// Why that is sound: a synchronization that fails with the stream's own error returns only
/// once the stream's queued work has ended. On CUDA a sticky error ends the context's work.
/// On the simulated device, `synchronize`/`synchronize_blocking` wait for a marker queued
/// behind the work; the stream's worker completes it only when it reaches it (every earlier
/// operation has run, or been skipped once the stream was poisoned: `sim::stream`'s
/// `Executor::execute`), and a poisoned stream completes it with its first error. What else
/// fails a synchronization fails the call itself (an injected `Synchronize` or `Record`
/// fault), before any wait, with the work perhaps still queued: for that case
/// [`StreamHeap::forget`] asks the stream, under each shard's lock, whether it is idle, and
/// keeps it where it is not (named again by the next trim), so nothing freed on it is
/// handed out or given upstream while its work may run.
pub(crate) fn forget_failed(heap: &StreamHeap, stream: Stream, error: &Error) {
    tracing::warn!(
        error = %error,
        stream = %stream.id(),
        "trim: a dropped stream's work failed; let go of as ended (its error is reported on the user's operations on it)"
    );
    heap.forget(stream);
}

/// A trim's second stage, for a stream its memory waits for whose synchronization failed
/// (not for a capture): logged, and its id, whose memory the trim keeps in the pool, free
/// and still ordered after the stream (`keep_for_failure`), as it keeps a capture's; the
/// rest is released. Kept rather than released: the failure may be the call's, with the
/// stream's work still queued (see [`forget_failed`]), and a kept block is reused only
/// after the stream, as any. Not the trim's error: the failure is the stream's, reported on
/// the user's operations on it, and a trim that failed for it would fail for ever.
pub(crate) fn failed_stream(stream: &Stream, error: &Error) -> StreamId {
    tracing::warn!(
        error = %error,
        stream = %stream.id(),
        "trim: a stream's work failed; the memory freed on it stays in the pool, free"
    );
    stream.id()
}

/// Whole chunks a trim took out of the free list (held in the pool's `held_for_trim`), put
/// back ([`PoolResource::put_back`]) if the trim ends before it gives them upstream (the
/// trim's future dropped while it waits); those of a stream under a capture or whose
/// synchronization failed go back before ([`keep_for_capture`](Self::keep_for_capture),
/// [`keep_for_failure`](Self::keep_for_failure)).
/// [`give_back`](Self::give_back) gives upstream those a request at the maximum has not taken
/// back.
struct TakenForTrim<'a, U: MemoryResource> {
    pool: &'a PoolResource<U>,
    /// `None` once given back (nothing then to put back on drop).
    ticket: Option<Ticket>,
}

impl<'a, U: MemoryResource> TakenForTrim<'a, U> {
    /// Takes every wholly free chunk out of the lists for a trim, and the streams to wait for
    /// before the chunks go upstream.
    ///
    /// The chunks are out of the lists and held under the trims' lock, so that a recall finds
    /// them in one or the other; each is then ordered onto one of the streams that freed it
    /// (events recorded on the others, a wait on it: driver calls) with that lock let go, for
    /// every request at the maximum takes it (a review found them waiting behind the trim's
    /// driver calls). A request that recalls a chunk meanwhile puts it back with its tag, as
    /// it was: the trim's ordering of it is then one GPU-side wait more, and the chunk is no
    /// longer the trim's to note as ordered, to wait for, or to give back.
    fn take(pool: &'a PoolResource<U>) -> (Self, Vec<Stream>) {
        let (ticket, chunks) = pool.held_for_trim.hold(|| pool.take_whole_chunks_tagged());
        // From here on, put back on drop (an ordering that unwinds included).
        let taken = TakenForTrim {
            pool,
            ticket: Some(ticket),
        };
        let mut streams = Vec::new();
        let mut tell = false;
        for (base, size, order) in chunks {
            let HeldOrder::Tagged(tag) = order else {
                continue;
            };
            let is = |&(b, _, _): &HeldChunk| b == base;
            match pool.heap.order_whole_chunk(base, size, &tag) {
                Ok(on) => {
                    let still = (pool.held_for_trim).replace(
                        ticket,
                        is,
                        (base, size, HeldOrder::On(on.clone())),
                    );
                    if still {
                        streams.extend(on);
                    }
                }
                // Stays free, as it was (a stream of its tag under a user's graph capture, a
                // failed driver call), if still the trim's.
                Err(e) => {
                    let kept = (pool.held_for_trim).put_back_some(ticket, is, |chunks| {
                        tell |= pool.put_back_held(&chunks);
                    });
                    // Logged only then: one recalled meanwhile is no longer the trim's, and may
                    // have gone upstream with a growth at the maximum (in no shard, hence the
                    // error), which is no failure (a review found it warned of as one).
                    if kept > 0 {
                        StreamHeap::<Stream>::log_kept(&e, base, size);
                    }
                }
            }
        }
        // The waiters told with the trims' lock let go (see `put_back_quietly`).
        if tell {
            pool.waiters.notify();
        }
        (taken, streams)
    }

    /// Puts back in the pool, free, the chunks still the trim's whose stream is in `captured`
    /// (under a user's graph capture: its work cannot be waited for, so they cannot go
    /// upstream now), and logs what was kept; the rest stays the trim's to give back.
    fn keep_for_capture(&self, captured: &[StreamId]) {
        let (chunks, bytes) = self.keep_on(captured);
        if chunks > 0 {
            tracing::debug!(
                chunks,
                bytes,
                streams = captured.len(),
                "trim: chunks kept for a capture (their streams are being captured into a CUDA graph, whose work the host cannot wait for)"
            );
        }
    }

    /// Puts back in the pool, free, the chunks still the trim's whose stream's synchronization
    /// failed (see [`failed_stream`]), and logs what was kept; the rest stays the trim's.
    fn keep_for_failure(&self, failed: &[StreamId]) {
        let (chunks, bytes) = self.keep_on(failed);
        if chunks > 0 {
            tracing::warn!(
                chunks,
                bytes,
                streams = failed.len(),
                "trim: chunks kept in the pool, free: the work of the streams they were freed on failed"
            );
        }
    }

    /// Puts back in the pool, free (as freed on their stream), the chunks still the trim's
    /// ordered onto a stream in `streams`: how many, and their bytes.
    fn keep_on(&self, streams: &[StreamId]) -> (usize, u64) {
        let Some(ticket) = self.ticket else {
            return (0, 0);
        };
        if streams.is_empty() {
            return (0, 0);
        }
        let pool = self.pool;
        let mut bytes = 0;
        let mut tell = false;
        let chunks = (pool.held_for_trim).put_back_some(
            ticket,
            |(_, size, order)| {
                let stays = matches!(order, HeldOrder::On(Some(s)) if streams.contains(&s.id()));
                if stays {
                    bytes += size;
                }
                stays
            },
            |chunks| tell = pool.put_back_held(&chunks),
        );
        // The waiters told once the trims' lock is let go (see `put_back_quietly`).
        if tell {
            pool.waiters.notify();
        }
        (chunks, bytes)
    }

    /// Gives upstream the chunks still the trim's (no longer put back on drop): the bytes
    /// given back. With no lock held: over `CudaResource` each is a `cuMemFree`, which waits
    /// for the whole device to be idle, and no request waits for it.
    fn give_back(mut self) -> Result<usize> {
        let Some(ticket) = self.ticket.take() else {
            return Ok(0);
        };
        let pool = self.pool;
        let mut ordered = Vec::new();
        let mut unordered = Vec::new();
        for (base, size, order) in pool.held_for_trim.release(ticket) {
            match order {
                HeldOrder::On(on) => ordered.push((base, size, on)),
                tagged => unordered.push((base, size, tagged)),
            }
        }
        // None: `take` ordered every chunk before it returned. One never ordered must not go
        // upstream (its streams' work may still use it): back as it was.
        debug_assert!(unordered.is_empty(), "a trim's chunk was never ordered");
        if pool.put_back_held(&unordered) {
            pool.waiters.notify();
        }
        let given = pool.release_chunks(ordered);
        pool.held_for_trim.given_back();
        given
    }
}

impl<U: MemoryResource> Drop for TakenForTrim<'_, U> {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            let pool = self.pool;
            let mut tell = false;
            (pool.held_for_trim).put_back(ticket, |chunks| tell = pool.put_back_held(&chunks));
            // The waiters told once the trims' lock is let go (see `put_back_quietly`).
            if tell {
                pool.waiters.notify();
            }
        }
    }
}

#[cfg(all(test, not(streamalloc_loom)))]
mod review_tests {
    use std::future::Future;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};
    use std::time::Duration;

    use super::*;
    use crate::resource::cuda::CudaResource;
    use crate::resource::lock_probes::{AtSpan, LockAtFault, Locked};
    use crate::{AllocateAsync, SimConfig};

    const MIB: usize = 1 << 20;

    /// A waker that notes whether the inner pool's list of memory held for trims was locked
    /// when it ran: a waker is the executor's code, free to poll the task at once (a task that
    /// then asks the inner pool for memory on the slow path reads that list: a self-deadlock).
    struct Probe {
        inner: Arc<PoolResource<CudaResource>>,
        wakes: AtomicUsize,
        under_lock: AtomicBool,
    }

    impl Wake for Probe {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }

        fn wake_by_ref(self: &Arc<Self>) {
            self.wakes.fetch_add(1, SeqCst);
            if self.inner.held_for_trim.is_locked() || self.inner.heap.slow_is_locked() {
                self.under_lock.store(true, SeqCst);
            }
        }
    }

    struct Noop;

    impl Wake for Noop {
        fn wake(self: Arc<Self>) {}
    }

    /// A waker that notes whether the outer pool's growth lock (`slow`) was held when it ran.
    struct OuterProbe {
        outer: Arc<PoolResource<Arc<PoolResource<CudaResource>>>>,
        wakes: AtomicUsize,
        under_lock: AtomicBool,
    }

    impl Wake for OuterProbe {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }

        fn wake_by_ref(self: &Arc<Self>) {
            self.wakes.fetch_add(1, SeqCst);
            if self.outer.heap.slow_is_locked() {
                self.under_lock.store(true, SeqCst);
            }
        }
    }

    /// A pool over a pool at its maximum (8 MiB: `b` 2 MiB held, two wholly free chunks of
    /// 3 MiB), a task waiting for 7 MiB (never while `b` is held) on the outer pool, or on the
    /// inner one with `on_inner`; the outer pool's growth (under its `slow`) for another
    /// request of 5 MiB asks the inner one, which gives its two free chunks back to grow one
    /// that holds it, and tells its waiters when its request is over, still inside the outer
    /// growth (relayed to the outer queue too). The waiter must be told once the outer request
    /// is over, never under the outer `slow` (a task polled by its waker there, asking the
    /// outer pool for memory, would wait for ever on the lock its thread holds).
    fn a_growth_through_an_inner_pool_that_gives_back(on_inner: bool) {
        let device = Device::simulated(SimConfig::default());
        let options = |maximum| PoolOptions {
            initial: 0,
            maximum,
            small_block_cache: 0,
            ..PoolOptions::default()
        };
        let inner = Arc::new(
            PoolResource::new(CudaResource::new(&device), options(Some(8 * MIB))).unwrap(),
        );
        let s = device.create_stream().unwrap();
        let b = inner.allocate(2 * MIB, &s).unwrap();
        let c1 = inner.allocate(3 * MIB, &s).unwrap();
        let c2 = inner.allocate(3 * MIB, &s).unwrap();
        let stats = inner.stats();
        assert_eq!((stats.chunks, stats.reserved), (3, 8 * MIB), "the scene");
        let outer = Arc::new(PoolResource::new(inner.clone(), options(None)).unwrap());
        let probe = Arc::new(OuterProbe {
            outer: outer.clone(),
            wakes: AtomicUsize::new(0),
            under_lock: AtomicBool::new(false),
        });
        let waker = Waker::from(probe.clone());
        let mut wait: std::pin::Pin<Box<dyn Future<Output = Result<DevicePtr>> + '_>> = if on_inner
        {
            Box::pin(inner.allocate_async(7 * MIB, &s))
        } else {
            Box::pin(outer.allocate_async(7 * MIB, &s))
        };
        let mut cx = Context::from_waker(&waker);
        assert!(matches!(wait.as_mut().poll(&mut cx), Poll::Pending));
        for c in [c1, c2] {
            // SAFETY: handed out above on `s`, never used, freed once on `s`.
            unsafe { inner.deallocate(c, 3 * MIB, &s) }.unwrap();
        }
        assert!(
            probe.wakes.load(SeqCst) > 0,
            "the frees did not tell the waiter"
        );
        // Tries again, and stays in line (6 MiB free for 7).
        assert!(matches!(wait.as_mut().poll(&mut cx), Poll::Pending));
        probe.wakes.store(0, SeqCst);
        let p = outer.allocate(5 * MIB, &s).unwrap();
        assert_eq!(
            inner.stats().chunks,
            2,
            "the inner pool did not give back to grow"
        );
        assert!(probe.wakes.load(SeqCst) > 0, "the waiter was not told");
        assert!(
            !probe.under_lock.load(SeqCst),
            "a waker ran under the outer pool's growth lock"
        );
        drop(wait);
        // SAFETY: handed out above on `s`, never used, freed once on `s`.
        unsafe { outer.deallocate(p, 5 * MIB, &s) }.unwrap();
        // SAFETY: as above.
        unsafe { inner.deallocate(b, 2 * MIB, &s) }.unwrap();
        s.synchronize_blocking().unwrap();
    }

    /// The waiter on the outer pool: `deferring` holds back what the inner queue relays to
    /// the outer one (a review's finding: it was told under the outer `slow`).
    #[test]
    fn a_growth_wakes_no_waiter_under_its_own_lock_through_the_upstream() {
        a_growth_through_an_inner_pool_that_gives_back(false);
    }

    /// The waiter on the inner pool: its queue is not the one `deferring` was called for, and
    /// its head was woken under the outer `slow`; it is stashed and woken by the outer
    /// request's guard now.
    #[test]
    fn a_growth_wakes_no_inner_waiter_under_its_own_lock() {
        a_growth_through_an_inner_pool_that_gives_back(true);
    }

    /// The trimmed pool, the second stream and the waiting trim, handed to a test's action.
    type Trim<'a> = std::pin::Pin<Box<dyn Future<Output = Result<usize>> + 'a>>;

    /// An inner pool of at most `inner_max` bytes with a trim waiting for a busy stream (a
    /// whole free chunk last used there), and an outer pool of 2 MiB over it, at its maximum,
    /// with a task waiting for memory there. `act` runs with the inner pool, the second stream
    /// and the trim, and returns what to finish with; between, the waiter must have been
    /// told, and its waker never run under the inner pool's trims' list or growth lock.
    fn a_waiter_above_a_waiting_trim(
        inner_max: usize,
        act: impl for<'a> FnOnce(
            &'a Arc<PoolResource<CudaResource>>,
            &'a Stream,
            Trim<'a>,
        ) -> Box<dyn FnOnce() + 'a>,
    ) {
        let device = Device::simulated(SimConfig::default());
        let options = |maximum| PoolOptions {
            initial: 0,
            maximum: Some(maximum),
            small_block_cache: 0,
            ..PoolOptions::default()
        };
        let inner =
            Arc::new(PoolResource::new(CudaResource::new(&device), options(inner_max)).unwrap());
        let (d, s) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        // A whole free chunk last used on a busy stream: the trim takes it and waits.
        let x = inner.allocate(2 * MIB, &d).unwrap();
        d.spin(Duration::from_millis(1500)).unwrap();
        // SAFETY: handed out above on `d`, freed on `d`.
        unsafe { inner.deallocate(x, 2 * MIB, &d) }.unwrap();
        let noop = Waker::from(Arc::new(Noop));
        let mut trim: Trim<'_> = Box::pin(inner.trim());
        assert!(trim
            .as_mut()
            .poll(&mut Context::from_waker(&noop))
            .is_pending());
        // An outer pool at its maximum, with a task waiting for memory there.
        let outer = PoolResource::new(inner.clone(), options(2 * MIB)).unwrap();
        let y = outer.allocate(2 * MIB, &s).unwrap();
        let probe = Arc::new(Probe {
            inner: inner.clone(),
            wakes: AtomicUsize::new(0),
            under_lock: AtomicBool::new(false),
        });
        let waker = Waker::from(probe.clone());
        let mut wait = Box::pin(outer.allocate_async(2 * MIB, &s));
        assert!(matches!(
            wait.as_mut().poll(&mut Context::from_waker(&waker)),
            Poll::Pending
        ));
        let finish = act(&inner, &s, trim);
        assert!(probe.wakes.load(SeqCst) > 0, "the waiter was not told");
        assert!(
            !probe.under_lock.load(SeqCst),
            "a waker ran under the trims' list or the growth lock"
        );
        drop(wait);
        // SAFETY: handed out above on `s`, freed on `s`.
        unsafe { outer.deallocate(y, 2 * MIB, &s) }.unwrap();
        finish();
        d.synchronize_blocking().unwrap();
        s.synchronize_blocking().unwrap();
    }

    /// A trim dropped while it waits puts its chunks back and tells the waiters, the queues
    /// stacked over the pool's included. It told them with the trims' list locked, so the
    /// waker of a task waiting on an outer pool ran under the inner pool's lock.
    #[test]
    fn a_cancelled_trim_wakes_no_waiter_under_its_lock() {
        a_waiter_above_a_waiting_trim(8 * MIB, |_, _, trim| {
            // The trim cancelled: its chunk goes back, and the waiters are told.
            drop(trim);
            Box::new(|| {})
        });
    }

    /// A request at the maximum takes back what a trim holds, and tells the waiters (memory
    /// came back to the lists), the queues stacked over the pool's included. It told them with
    /// the growth lock held, so the waker of a task waiting on an outer pool ran under it: a
    /// waker that polls its task at once, which then needs the inner pool to grow, waits for
    /// ever on a lock its own thread holds.
    #[test]
    fn a_recall_from_a_trim_wakes_no_waiter_under_the_growth_lock() {
        // The inner pool at its maximum with the trim's chunk and the outer pool's.
        a_waiter_above_a_waiting_trim(4 * MIB, |inner, s, trim| {
            // A request at the inner pool's maximum takes the trim's chunk back.
            let z = inner.allocate(2 * MIB, s).unwrap();
            Box::new(move || {
                // SAFETY: handed out above on `s`, freed on `s`.
                unsafe { inner.deallocate(z, 2 * MIB, s) }.unwrap();
                let _ = common_block_on(trim);
            })
        });
    }

    /// The pool of the trim-ordering scenes below: no initial memory, no small-block cache,
    /// at most `maximum` bytes.
    fn trim_scene_pool(device: &Device, maximum: usize) -> Arc<PoolResource<CudaResource>> {
        let options = PoolOptions {
            initial: 0,
            maximum: Some(maximum),
            small_block_cache: 0,
            ..PoolOptions::default()
        };
        Arc::new(PoolResource::new(CudaResource::new(device), options).unwrap())
    }

    /// A new 4 MiB chunk of `pool`, handed out in halves, one on each stream: freed, the chunk
    /// is one free block whose tag names both (its ordering onto one makes driver calls).
    fn halves_on(
        pool: &PoolResource<CudaResource>,
        s1: &Stream,
        s2: &Stream,
    ) -> (DevicePtr, DevicePtr) {
        let x = pool.allocate(4 * MIB, s1).unwrap();
        // SAFETY: handed out above on `s1`, unused.
        unsafe { pool.deallocate(x, 4 * MIB, s1) }.unwrap();
        (
            pool.allocate(2 * MIB, s1).unwrap(),
            pool.allocate(2 * MIB, s2).unwrap(),
        )
    }

    /// Frees each block on its stream behind a 300 ms spin queued on each stream once: the
    /// streams are busy when a trim that follows asks.
    fn free_behind_spins(
        pool: &PoolResource<CudaResource>,
        blocks: &[(DevicePtr, usize, &Stream)],
    ) {
        let mut spun = Vec::new();
        for (_, _, stream) in blocks {
            if !spun.contains(&stream.id()) {
                spun.push(stream.id());
                stream.spin(Duration::from_millis(300)).unwrap();
            }
        }
        for &(ptr, size, stream) in blocks {
            // SAFETY: the callers' blocks, handed out on these streams, unused, freed once.
            unsafe { pool.deallocate(ptr, size, stream) }.unwrap();
        }
    }

    /// Whether `pool`'s list of what trims hold is locked now (see `lock_probes`).
    fn trims_list_locked(pool: &Arc<PoolResource<CudaResource>>) -> Locked {
        let pool = pool.clone();
        Box::new(move || pool.held_for_trim.is_locked())
    }

    /// A trim orders a chunk freed on two streams onto one of them (a record on the other, a
    /// wait): driver calls, made with the trims' lock let go, which every request at the
    /// maximum takes. They were made under it. The record fails here (an injected fault, so
    /// that the call can be seen): the chunk stays free, and the next trim releases it.
    #[test]
    fn a_trim_orders_its_chunks_with_the_trims_lock_let_go() {
        use crate::{FaultKind, Faults};
        use tracing_subscriber::layer::SubscriberExt;

        let faults = Faults::new();
        let device = Device::simulated(SimConfig {
            faults: faults.clone(),
            ..SimConfig::default()
        });
        let pool = trim_scene_pool(&device, 8 * MIB);
        let (s1, s2) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        // One chunk of 4 MiB, half freed on each stream (busy): one block freed on both.
        let (a, b) = halves_on(&pool, &s1, &s2);
        assert_eq!(pool.stats().chunks, 1);
        free_behind_spins(&pool, &[(a, 2 * MIB, &s1), (b, 2 * MIB, &s2)]);
        faults.fail_next(FaultKind::Record);
        let seen = Arc::new(AtomicUsize::new(0));
        let under_lock = Arc::new(AtomicBool::new(false));
        let subscriber = tracing_subscriber::registry().with(LockAtFault {
            locked: trims_list_locked(&pool),
            faults: seen.clone(),
            under_lock: under_lock.clone(),
        });
        let released = tracing::subscriber::with_default(subscriber, || pool.trim_blocking());
        assert_eq!(
            faults.injected(FaultKind::Record),
            1,
            "the trim ordered no chunk"
        );
        assert_eq!(seen.load(SeqCst), 1);
        assert!(
            !under_lock.load(SeqCst),
            "a trim's driver call under the trims' lock"
        );
        // The chunk whose ordering failed stays, free, as it was.
        assert_eq!(released.unwrap(), 0);
        assert_eq!(pool.stats().free, 4 * MIB);
        pool.check_invariants().unwrap();
        assert_eq!(pool.trim_blocking().unwrap(), 4 * MIB);
        assert_eq!(pool.stats().reserved, 0);
    }

    /// A request at the maximum recalls the chunk a trim is ordering onto its streams (with the
    /// trims' lock let go): it goes back to its list as it was taken and serves the request,
    /// and the trim, its ordering done, neither notes it as its own nor gives it upstream.
    #[test]
    fn a_chunk_recalled_while_its_trim_orders_it_stays_in_the_pool() {
        use tracing_subscriber::layer::SubscriberExt;

        let device = Device::simulated(SimConfig::default());
        let pool = trim_scene_pool(&device, 4 * MIB);
        let (s1, s2, s3) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        // The pool's one chunk, at its maximum, half freed on each of two busy streams.
        let (a, b) = halves_on(&pool, &s1, &s2);
        free_behind_spins(&pool, &[(a, 2 * MIB, &s1), (b, 2 * MIB, &s2)]);
        // When the trim orders the chunk onto one of its streams, a request at the maximum.
        let served = Arc::new(std::sync::Mutex::new(None));
        let under_lock = Arc::new(AtomicBool::new(false));
        let action = {
            let (pool, served, s3) = (pool.clone(), served.clone(), s3.clone());
            Box::new(move || *served.lock().unwrap() = Some(pool.allocate(2 * MIB, &s3)))
        };
        let subscriber = tracing_subscriber::registry().with(AtSpan {
            name: "stream_wait",
            locked: trims_list_locked(&pool),
            action: std::sync::Mutex::new(Some(action)),
            under_lock: under_lock.clone(),
        });
        let released = tracing::subscriber::with_default(subscriber, || pool.trim_blocking());
        assert!(!under_lock.load(SeqCst), "the trim ordered under its lock");
        let y = (served.lock().unwrap().take())
            .expect("the trim ordered no chunk")
            .expect("the request at the maximum was served from the trim's chunk");
        assert_eq!(released.unwrap(), 0, "the trim gave back a recalled chunk");
        let stats = pool.stats();
        assert_eq!((stats.reserved, stats.chunks), (4 * MIB, 1));
        assert_eq!((stats.in_use, stats.free), (2 * MIB, 2 * MIB));
        pool.check_invariants().unwrap();
        // SAFETY: handed out above on `s3`, unused.
        unsafe { pool.deallocate(y, 2 * MIB, &s3) }.unwrap();
        assert_eq!(pool.trim_blocking().unwrap(), 4 * MIB);
    }

    /// A `tracing` layer that keeps the message of every warning this crate logs.
    struct Warnings(Arc<std::sync::Mutex<Vec<String>>>);

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Warnings {
        fn on_event(
            &self,
            event: &tracing::Event<'_>,
            _: tracing_subscriber::layer::Context<'_, S>,
        ) {
            let meta = event.metadata();
            if *meta.level() != tracing::Level::WARN || !meta.target().starts_with("streamalloc") {
                return;
            }
            struct Message(String);
            impl tracing::field::Visit for Message {
                fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn fmt::Debug) {
                    self.0.push_str(&format!(" {}={v:?}", f.name()));
                }
            }
            let mut message = Message(String::new());
            event.record(&mut message);
            self.0.lock().unwrap().push(message.0);
        }
    }

    /// Two chunks a trim took: while it orders the first onto its streams, a request at the
    /// maximum recalls both and, fitting in neither, gives them back upstream and grows one
    /// that fits. The trim's ordering of the second then finds it in no shard: no longer the
    /// trim's, and nothing failed. It logged a warning that the chunk stayed because its
    /// ordering failed (neither was true: the chunk had gone upstream).
    #[test]
    fn a_chunk_recalled_and_given_upstream_while_its_trim_orders_is_no_failure() {
        use tracing_subscriber::layer::SubscriberExt;

        let device = Device::simulated(SimConfig::default());
        let pool = trim_scene_pool(&device, 8 * MIB);
        let (s1, s2, s3) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        // Two chunks of 4 MiB, the pool at its maximum: the first half freed on each of two
        // busy streams (its ordering makes driver calls), the second freed on one.
        let (a, b) = halves_on(&pool, &s1, &s2);
        let c = pool.allocate(4 * MIB, &s1).unwrap();
        assert_eq!((pool.stats().chunks, pool.stats().reserved), (2, 8 * MIB));
        free_behind_spins(
            &pool,
            &[(a, 2 * MIB, &s1), (b, 2 * MIB, &s2), (c, 4 * MIB, &s1)],
        );
        // When the trim orders the first chunk, a request that fits in neither.
        let served = Arc::new(std::sync::Mutex::new(None));
        let under_lock = Arc::new(AtomicBool::new(false));
        let action = {
            let (pool, served, s3) = (pool.clone(), served.clone(), s3.clone());
            Box::new(move || *served.lock().unwrap() = Some(pool.allocate(6 * MIB, &s3)))
        };
        let warnings = Arc::new(std::sync::Mutex::new(Vec::new()));
        let subscriber = tracing_subscriber::registry()
            .with(AtSpan {
                name: "stream_wait",
                locked: trims_list_locked(&pool),
                action: std::sync::Mutex::new(Some(action)),
                under_lock: under_lock.clone(),
            })
            .with(Warnings(warnings.clone()));
        let released = tracing::subscriber::with_default(subscriber, || pool.trim_blocking());
        assert!(!under_lock.load(SeqCst), "the trim ordered under its lock");
        let y = (served.lock().unwrap().take())
            .expect("the trim ordered no chunk")
            .expect("the request at the maximum was served from a chunk grown for it");
        assert_eq!(released.unwrap(), 0, "the trim gave back a recalled chunk");
        let warnings = warnings.lock().unwrap().clone();
        assert!(warnings.is_empty(), "warnings: {warnings:?}");
        let stats = pool.stats();
        assert_eq!((stats.chunks, stats.in_use), (1, 6 * MIB));
        pool.check_invariants().unwrap();
        // SAFETY: handed out above on `s3`, unused.
        unsafe { pool.deallocate(y, 6 * MIB, &s3) }.unwrap();
    }

    /// Drives `fut` to its end on this thread.
    fn common_block_on<F: Future + ?Sized>(fut: std::pin::Pin<Box<F>>) -> F::Output {
        let mut fut = fut;
        let waker = Waker::from(Arc::new(Noop));
        loop {
            if let Poll::Ready(out) = fut.as_mut().poll(&mut Context::from_waker(&waker)) {
                return out;
            }
            std::thread::yield_now();
        }
    }
}
