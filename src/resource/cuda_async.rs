//! [`CudaAsyncResource`]: the driver's stream-ordered allocator (`cuMemAllocFromPoolAsync` /
//! `cuMemFreeAsync`) on a pool of its own, as RMM's `cuda_async_memory_resource`, or on a pool
//! that exists already (the device's default pool among them), as RMM's
//! `cuda_async_view_memory_resource`.

use std::fmt;

use rustc_hash::FxHashMap;

use crate::device::{Device, DevicePtr};
use crate::error::{Error, Result};
use crate::resource::adaptor::Limit;
use crate::resource::stream_ordered::kept::Kept;
use crate::resource::waiters::MemoryWaiters;
use crate::resource::{aligned_size, check_stream, MemoryKind, MemoryResource};
use crate::stream::Stream;
use crate::stream::{AsyncPool, AsyncPoolSettings};
use crate::sync::plain::{Arc as StdArc, Mutex as PlainMutex, RwLock};
use crate::sync::{AtomicU64, Mutex, Ordering};

/// Settings of a [`CudaAsyncResource`].
///
/// ```
/// use streamalloc::resource::cuda_async::CudaAsyncOptions;
///
/// // Prime the pool with 256 MiB, keep at most 1 GiB of freed memory across synchronizations.
/// let options = CudaAsyncOptions {
///     initial_pool_size: Some(256 << 20),
///     release_threshold: Some(1 << 30),
///     ..CudaAsyncOptions::default()
/// };
/// ```
#[derive(Debug, Clone, Default)]
pub struct CudaAsyncOptions {
    /// How many freed bytes the pool keeps when a stream, an event or the device synchronizes
    /// (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`); above it, freed memory goes back to the device.
    /// `None`: keep everything (the threshold at its maximum), so steady-state allocation never
    /// reaches the driver's slow path; [`CudaAsyncResource::trim_to`] gives memory back.
    pub release_threshold: Option<usize>,
    /// Bytes to allocate and free once at construction, so the pool starts with that much
    /// memory (RMM's `initial_pool_size`). Only stays if the release threshold allows it,
    /// and until a `cuMemAlloc` in the process finds too little free memory (see
    /// [`CudaAsyncResource`]).
    /// `None` or zero: start empty.
    pub initial_pool_size: Option<usize>,
    /// The most this resource hands out at once, in bytes: the driver pool's
    /// `CUmemPoolProps::maxSize`, and a count the resource keeps itself (see
    /// [`CudaAsyncResource`]: the driver rounds `maxSize` up to its own granularity, so it
    /// alone would let a little more through). `None`: the device's memory.
    pub maximum_pool_size: Option<usize>,
}

/// Device memory from the driver's stream-ordered allocator, on a driver pool that this
/// resource creates and owns ([`new`](Self::new): not the device's default pool, which other
/// libraries in the process may reconfigure or trim), or on one that exists already
/// ([`default_pool`](Self::default_pool), [`view`](Self::view)), to share memory with code that
/// allocates from it directly.
///
/// What it promises:
///
/// - `allocate` is `cuMemAllocFromPoolAsync` on the given stream and `deallocate` is
///   `cuMemFreeAsync` on it: truly stream-ordered, and neither blocks the host. Memory freed on
///   one stream is reused by another only once the driver has ordered the two (it tracks
///   that itself);
/// - allocations are at least 256-aligned; zero bytes gives a null pointer without a driver
///   call, and `deallocate` takes it back with zero bytes;
/// - **the maximum holds exactly, on every device.** The driver rounds a pool's `maxSize` up
///   to its own granularity (on an H200, a pool of 4 MiB served 4 MiB and then 1 MiB more), so
///   the resource counts the bytes it has handed out itself, each allocation rounded up to 256
///   bytes ([`allocated_bytes`](Self::allocated_bytes)), and refuses a request that would take
///   the count past `maximum_pool_size`, before calling the driver. A free counts when it is
///   *issued*, not when the GPU reaches it: the count is the bytes the program holds, which is
///   what a maximum is about, and it needs no host wait. So right after a free the driver may
///   still refuse a request the count allows (the freed memory is not reusable until the
///   stream reaches the free, and the pool's physical limit is the driver's); that is an
///   [`Error::OutOfMemory`] too, and nothing is lost;
/// - **a free must name an allocation of this resource with its size.** The resource keeps a
///   table of what it handed out (pointer → size rounded up to 256, as the other resources
///   keep), and refuses, with [`Error::UnknownPointer`] and before the driver is called, a
///   free of a pointer it did not hand out (or already freed: a double free is caught here,
///   on both devices, not left to the driver), or with a size that does not round to the
///   allocation's. Without the table a wrong size moved the count by that size, so the
///   maximum stopped holding; RMM's `cuda_async_memory_resource` keeps none, and the table
///   costs a lock of one of several shards per allocation and per free, next to a driver call
///   that costs far more. A view's table knows this resource's allocations only: memory that
///   other code allocated from the shared pool is freed by that code, not through the view;
/// - `allocate` fails with [`Error::OutOfMemory`] carrying the bytes requested, what could
///   still be had (under the resource's own maximum: the maximum minus the count; from the
///   driver: the device's free memory plus what the pool keeps, within the pool's maximum) and
///   the maximum; the resource works as before afterwards;
/// - [`trim_to`](Self::trim_to), [`reserved_bytes`](Self::reserved_bytes) and
///   [`used_bytes`](Self::used_bytes) expose the pool's state (for a view, the shared pool's:
///   every user's memory, not only this resource's);
/// - the memory the pool keeps is a cache, not a reservation: **a `cuMemAlloc` anywhere in
///   the process that finds too little free memory makes the driver release all that every
///   driver pool keeps** (whatever its release threshold) and try again (driver 580.159.04:
///   after one failed request a pool primed with 32 MiB held none, 20 times of 20; a request
///   of the free memory plus 256 MiB succeeded by taking all of a pool's kept 1 GiB;
///   BENCHMARKS.md, "A failed cuMemAlloc empties the driver's pools"). So a `PoolResource`
///   over [`CudaResource`](super::cuda::CudaResource) that grows to the device's limit takes
///   this resource's cache, and `initial_pool_size` is memory to start with, not memory set
///   aside. `Device::malloc` refuses a request larger than the device before the driver, so
///   an impossible request costs nothing; the simulated device models the rest;
/// - **[`allocate_async`] waits for memory freed through it.** The resource can run out (its
///   maximum reached, or the driver refusing: the device out of memory) and get memory back (a
///   free through it), so it has a queue of [`MemoryWaiters`], as the pools do. Every free
///   notifies it when it is issued (the count falls then, and the driver may reuse the memory
///   in stream order at once), and, while someone waits, once more when the GPU reaches the
///   free (an event watched by the completion reactor: the driver pool holds the memory for
///   any stream then); so does [`trim_to`](Self::trim_to). A request larger than the maximum
///   (rounded down to 256 bytes) can never fit and fails at once. A free issued while nobody
///   waited records nothing (its fast path is a few loads of its stream's slot, a fence and a
///   few loads more), but its stream is remembered, whatever other streams free meanwhile: a
///   request that starts waiting before the GPU reaches that free records an event there and
///   is woken when the GPU gets there. Every resource over the same driver pool (two views
///   of the default pool, an owner and a view of its pool) shares these: a free or a trim
///   through one wakes the others' waiters too.
///   Memory freed by other code, not through any resource, wakes nobody: such a request waits
///   for the next free through one, or its deadline;
/// - dropping a resource made by [`new`](Self::new) destroys its pool. Memory still allocated
///   from it is released by the driver once freed, so drop every buffer made from it first;
///   buffers hold a [`ResourceRef`](crate::ResourceRef), so as long as they are made through
///   one they keep the resource alive and this happens by itself. Dropping a view leaves its
///   pool alone.
///
/// On the simulated device the pool is modelled: see `SimPool` in the device layer. Freed
/// blocks are kept once the stream reaches the free and are reused for requests of the same
/// rounded size; the release threshold is applied at each free rather than at each
/// synchronization; it has no `maxSize` of its own (the resource's count is the maximum on
/// both devices).
///
/// [`allocate_async`]: crate::AllocateAsync::allocate_async
pub struct CudaAsyncResource {
    pool: AsyncPool,
    /// The most it hands out at once (`maximum_pool_size`); `None`: no limit of its own.
    maximum: Option<usize>,
    /// Bytes handed out and not given back through this resource, each allocation rounded up
    /// to 256: reserved before the driver is asked (so threads cannot pass the maximum
    /// together), given back when a free is issued (by the size in `sizes`, the
    /// allocation's). The limiting adaptor's count, with its mark of refusals: a request the
    /// driver refuses gives its reservation back, and wakes the first waiter if the maximum
    /// refused someone meanwhile (perhaps that waiter, because of the reservation). Without
    /// the mark that waiter slept with room under the maximum (a review's finding). No
    /// maximum: a limit of `usize::MAX`.
    count: Limit,
    /// What it handed out and not given back: pointer → size rounded up to 256 (see the type's
    /// documentation), in shards by pointer so that threads on different streams seldom share
    /// a lock. Std's locks: like the simulated device's own allocation table, loom need not
    /// model them (nothing else is done under them).
    sizes: SizeTable,
    /// Tasks waiting for memory ([`allocate_async`](crate::AllocateAsync::allocate_async)),
    /// notified by every free and trim, and by the GPU reaching a free issued while someone
    /// waited. Shared with those completion callbacks, which may outlive the resource. A
    /// review found the resource without one: a request at its maximum failed at once instead
    /// of waiting for memory freed through it.
    waiters: StdArc<MemoryWaiters>,
    /// What every resource over the same driver pool shares (two views of the default pool,
    /// a view and its owner): their queues, so that a free through one wakes the others'
    /// waiters, and the streams of the frees issued while nobody waited.
    shared: StdArc<PoolWaiters>,
}

/// The slots of [`PoolWaiters::pending`]. One under loom: a slot is chosen by stream id, and
/// ids are process-wide counters, different in each of a model's executions (loom requires
/// each execution to reach the same atomics). One slot is also the case the model needs: every
/// two streams share it.
const PENDING_SLOTS: usize = if cfg!(streamalloc_loom) { 1 } else { 16 };

/// The ids a free reads without the lock in each slot (see [`PendingSlot`]): the streams of the
/// first this many entries of the slot's list. Two under loom, so that a third stream in the
/// slot takes the slow path (and its pruning) within a small model.
const PENDING_WAYS: usize = if cfg!(streamalloc_loom) { 2 } else { 4 };

/// The waiters of every [`CudaAsyncResource`] over one driver pool, kept per device by the
/// pool's key ([`Device::pool_shared`]): memory freed through any of them comes back to the
/// one pool, so any of their requests may use it.
///
/// It also remembers the streams that frees were issued on while nobody waited, so that a
/// request arriving later can be woken when the GPU reaches them: the driver's pool reuses
/// freed memory for another stream only then. A stream goes to one of a few slots by its id,
/// and a slot keeps a list of every stream noted in it (see [`PendingSlot`]): a free that
/// finds its stream among the first few ids of its slot writes nothing (a few loads); a request
/// that starts waiting records an event on each remembered stream and empties the lists.
///
/// A slot once kept one stream, and a free on another stream of the same slot replaced it:
/// the first stream's free was forgotten, and a request that started waiting before the GPU
/// reached it was not woken when it did (a review's finding: ids come from one process-wide
/// counter, so any program with more than 16 streams, or two ids 16 apart, met it; a waiter
/// without a deadline slept until some unrelated free). Now nothing noted leaves a list but
/// to a request's arrival, which records an event on it, or to pruning, which drops only a
/// stream the GPU has finished (its frees are in the pool, where a request's own try finds
/// them).
///
/// The protocol, with the queue's fences (`MemoryWaiters::notify` and `register`): a free
/// notes its stream *before* its fence and its load of the queues' lengths; a request
/// registers (its fence) *before* it reads the slots. So either the free sees the request and
/// records its own event, or the request sees the stream, and records one after the free.
/// (`loom-tests/cuda_async.rs` checks it, with a planted free that notes its stream after, and
/// the lists, with a planted slot that keeps one stream.)
pub(crate) struct PoolWaiters {
    /// The queues of the resources over the pool. Std's lock: it changes only when one is made
    /// or dropped; a free reads it only when the pool has several.
    ///
    /// Copied on write: a notification clones the list (one count) and lets go of the lock
    /// before it wakes anyone. A waker is the executor's code, which may drop a task holding
    /// another resource over this pool, whose drop [`leave`](Self::leave)s here: under the
    /// read lock that thread waited for ever on the write lock (a review's finding), as a
    /// wake under `MemoryWaiters`' relays' lock once did.
    queues: RwLock<StdArc<Vec<StdArc<MemoryWaiters>>>>,
    /// Whether `queues` has more than one, readable without the lock.
    several: std::sync::atomic::AtomicBool,
    pending: [PendingSlot; PENDING_SLOTS],
    /// The streams that [`arrived`](PoolWaiters::arrived) recorded an event on, for the loom
    /// model to check that none was forgotten (the inline device completes every event at
    /// once, so a wake from one stream's event cannot tell whether another's was recorded).
    #[cfg(streamalloc_loom)]
    watched: std::sync::Mutex<Vec<u64>>,
}

/// The streams that frees were issued on while nobody waited, in one slot, until a request
/// reads them.
///
/// Invariant, whenever the lock is free: `ways[i]` is the id of `streams[i]` for every `i`
/// below both lengths, and 0 past the list's end. So an id that a free reads in `ways` without
/// the lock names a stream in the list, or one that a request's arrival took (and recorded an
/// event on) after the free was issued, or one pruned as finished: each covers the free (see
/// [`PoolWaiters::note_slow`] for the order pruning keeps).
struct PendingSlot {
    /// The ids of the list's first entries, 0 for none: what a free checks without the lock.
    /// Written under it.
    ways: [AtomicU64; PENDING_WAYS],
    /// The streams, each once, kept (handles that do not count as a user's, see
    /// `Stream::users`). Past [`PENDING_WAYS`] only when that many in the slot are busy:
    /// pruning runs when the ways are full.
    streams: Mutex<Vec<Kept<Stream>>>,
}

impl PendingSlot {
    /// Writes the ways from the list (under its lock).
    fn publish(&self, streams: &[Kept<Stream>]) {
        for (at, way) in self.ways.iter().enumerate() {
            way.store(
                streams.get(at).map_or(0, |s| s.id().get()),
                Ordering::Relaxed,
            );
        }
    }

    /// Empties the ways (under the lock): before a stream leaves the list, or while pruning.
    fn clear_ways(&self) {
        for way in &self.ways {
            way.store(0, Ordering::Relaxed);
        }
    }
}

impl fmt::Debug for PoolWaiters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolWaiters").finish_non_exhaustive()
    }
}

impl PoolWaiters {
    fn new() -> Self {
        Self {
            queues: RwLock::new(StdArc::new(Vec::new())),
            several: std::sync::atomic::AtomicBool::new(false),
            pending: std::array::from_fn(|_| PendingSlot {
                ways: std::array::from_fn(|_| AtomicU64::new(0)),
                streams: Mutex::new(Vec::new()),
            }),
            #[cfg(streamalloc_loom)]
            watched: std::sync::Mutex::new(Vec::new()),
        }
    }

    fn join(this: &StdArc<Self>, queue: &StdArc<MemoryWaiters>) {
        let weak = StdArc::downgrade(this);
        queue.on_arrival(StdArc::new(move || {
            if let Some(shared) = weak.upgrade() {
                PoolWaiters::arrived(&shared);
            }
        }));
        let mut queues = this.queues.write().unwrap_or_else(|e| e.into_inner());
        let mut new = Vec::clone(&queues);
        new.push(queue.clone());
        this.several
            .store(new.len() > 1, std::sync::atomic::Ordering::Release);
        *queues = StdArc::new(new);
    }

    fn leave(&self, queue: &StdArc<MemoryWaiters>) {
        let mut queues = self.queues.write().unwrap_or_else(|e| e.into_inner());
        let mut new = Vec::clone(&queues);
        new.retain(|q| !StdArc::ptr_eq(q, queue));
        self.several
            .store(new.len() > 1, std::sync::atomic::Ordering::Release);
        // The old list goes after the lock: its last queue's drop is nobody's code, but a
        // list is never dropped under the lock that guards it.
        let old = std::mem::replace(&mut *queues, StdArc::new(new));
        drop(queues);
        drop(old);
    }

    /// The queues now, with the lock let go (see `queues`).
    fn snapshot(&self) -> StdArc<Vec<StdArc<MemoryWaiters>>> {
        self.queues
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Runs `f` on every queue but `own`, if the pool has several.
    fn others(&self, own: &MemoryWaiters, mut f: impl FnMut(&MemoryWaiters)) {
        if !self.several.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        for queue in self.snapshot().iter().filter(|q| !std::ptr::eq(&***q, own)) {
            f(queue);
        }
    }

    /// Memory came back to the pool: every queue's first waiter tries again.
    fn notify_all(&self) {
        for queue in self.snapshot().iter() {
            queue.notify();
        }
    }

    /// A free is being issued on `stream` (call it before the queues are notified): remembers
    /// the stream for a request that arrives before the GPU reaches the free. The common case,
    /// a stream noted already since the last request arrived, is a few relaxed loads.
    #[inline]
    fn note_free(&self, stream: &Stream) {
        let id = stream.id().get();
        let slot = &self.pending[(id as usize) % PENDING_SLOTS];
        // Relaxed: the fence of the notification that follows orders it (see the type).
        if slot
            .ways
            .iter()
            .any(|way| way.load(Ordering::Relaxed) == id)
        {
            return;
        }
        self.note_slow(slot, stream);
    }

    /// [`note_free`](Self::note_free) for a stream not in the slot's ways: adds it to the list
    /// unless it is there already (past the ways, or noted by a racing free), first pruning
    /// the list if the ways are full.
    ///
    /// Pruning drops the streams whose work the GPU has finished (`Stream::probe_idle`: on
    /// CUDA a `cuStreamQuery`, here only, with the slot's lock held, when the ways are full).
    /// It empties the ways *before* it asks: a free racing on a stream being asked about
    /// either was queued before the question (the stream is busy and stays), or after it, and
    /// then the emptied ways happen before that free's load (the stream's own queue, the
    /// simulated stream's lock or the driver's, orders the question before the free), so the
    /// free takes this slow path and notes its stream again. Without pruning the lists would
    /// grow with every stream ever freed on while nobody waited.
    #[cold]
    fn note_slow(&self, slot: &PendingSlot, stream: &Stream) {
        let id = stream.id().get();
        let mut streams = slot.streams.lock();
        if let Some(at) = streams.iter().position(|s| s.id().get() == id) {
            // Busy past the ways: into them, for this stream's next free (the stream it
            // swaps with stays in the list).
            if at >= PENDING_WAYS {
                let to = at % PENDING_WAYS;
                streams.swap(at, to);
                slot.ways[to].store(id, Ordering::Relaxed);
            }
            return;
        }
        let mut gone = Vec::new();
        if planted!(ONE_PER_SLOT) {
            // The old slot: the new stream replaces what was noted.
            slot.clear_ways();
            gone.append(&mut streams);
        } else if streams.len() >= PENDING_WAYS {
            slot.clear_ways();
            let mut at = 0;
            while at < streams.len() {
                // A failed question (a device error) is taken as busy: kept.
                if streams[at].probe_idle().unwrap_or(false) {
                    gone.push(streams.swap_remove(at));
                } else {
                    at += 1;
                }
            }
        }
        streams.push(Kept::new(stream));
        slot.publish(&streams);
        drop(streams);
        // A stream's last handle may go here, outside the lock.
        drop(gone);
    }

    /// A request started waiting in one of the queues (after its registration's fence): for
    /// every stream a free was issued on while nobody waited, an event that wakes the queues
    /// when the GPU gets there. Memory whose free the GPU reached already is in the pool,
    /// where the request's own try after registering finds it; the event then completes at
    /// once and costs one needless try at most.
    ///
    /// Every slot's lock is taken (a request that waits is the slow path): the ways are empty
    /// for a moment while a free prunes its slot, so they cannot say that a list is empty.
    fn arrived(this: &StdArc<Self>) {
        for slot in &this.pending {
            let taken = {
                let mut streams = slot.streams.lock();
                slot.clear_ways();
                std::mem::take(&mut *streams)
            };
            for stream in &taken {
                #[cfg(streamalloc_loom)]
                this.watched
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(stream.id().get());
                Self::wake_after(this, stream);
            }
        }
    }

    /// Notifies every queue once `stream` reaches its current end.
    fn wake_after(this: &StdArc<Self>, stream: &Stream) {
        match stream.record() {
            Ok(event) => {
                let shared = this.clone();
                // Only wakes tasks: no CUDA call on the reactor thread, and the queues are
                // dropped there at worst, which makes none either.
                event.on_complete(Box::new(move |_| shared.notify_all()));
            }
            // A stream being captured into a graph (or a device error): the waiters were
            // notified when the free was issued, and a later free notifies again.
            Err(e) => tracing::debug!(
                error = %e,
                "CudaAsyncResource: no event after a free for its waiters"
            ),
        }
    }
}

/// The shards of a [`CudaAsyncResource`]'s size table.
const SHARDS: usize = 16;

/// Pointer → rounded size, sharded by pointer.
struct SizeTable([PlainMutex<FxHashMap<u64, usize>>; SHARDS]);

impl SizeTable {
    fn new() -> Self {
        Self(std::array::from_fn(|_| {
            PlainMutex::new(FxHashMap::default())
        }))
    }

    fn shard(&self, ptr: u64) -> std::sync::MutexGuard<'_, FxHashMap<u64, usize>> {
        // Allocations are 256-aligned (and the driver's larger ones more): mix the bits above
        // the alignment so that neighbouring pointers spread over the shards.
        let mixed = (ptr >> 8).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let at = (mixed >> 60) as usize % SHARDS;
        // A poisoned shard (a panic while it was held: only a map operation runs there) is
        // still consistent.
        self.0[at].lock().unwrap_or_else(|e| e.into_inner())
    }

    fn insert(&self, ptr: u64, size: usize) {
        self.shard(ptr).insert(ptr, size);
    }

    /// Takes `ptr` out if it is there with `size`; the size it has otherwise.
    fn take(&self, ptr: u64, size: usize) -> std::result::Result<(), Option<usize>> {
        let mut shard = self.shard(ptr);
        match shard.get(&ptr) {
            Some(&have) if have == size => {
                shard.remove(&ptr);
                Ok(())
            }
            other => Err(other.copied()),
        }
    }

    fn len(&self) -> usize {
        self.0
            .iter()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).len())
            .sum()
    }
}

impl CudaAsyncResource {
    /// A resource with a new driver pool on `device`.
    ///
    /// With `initial_pool_size`, it allocates that much on a stream of its own, frees it and
    /// waits for that stream (a blocking wait of a few milliseconds at most), so the memory is
    /// in the pool when `new` returns.
    ///
    /// Errors: [`Error::Driver`] if the pool cannot be made, [`Error::OutOfMemory`] if the
    /// initial size cannot be had, [`Error::InvalidSize`] for a maximum of zero.
    pub fn new(device: &Device, options: CudaAsyncOptions) -> Result<Self> {
        let pool = AsyncPool::new(
            device,
            AsyncPoolSettings {
                release_threshold: options.release_threshold.map_or(u64::MAX, |t| t as u64),
                maximum: options.maximum_pool_size,
            },
        )?;
        let resource = Self::over(pool, options.maximum_pool_size);
        if let Some(initial) = options.initial_pool_size.filter(|&n| n > 0) {
            let stream = device.create_stream()?;
            let ptr = resource.pool.alloc_async(initial, &stream)?;
            // SAFETY: `ptr` was just allocated from this pool on `stream`, nothing uses it, and
            // it is freed once.
            if let Err(e) = unsafe { resource.pool.free_async(ptr, &stream) } {
                // A refused free freed nothing, and no one but this call knows the block:
                // returning now would drop the pool with it still allocated, and a driver pool
                // gives its memory back only once all of it is freed (a review's finding).
                tracing::warn!(error = %e, "the priming free failed; trying it again");
                // SAFETY: as above; the refused try freed nothing, so this is still the one
                // free of `ptr`.
                if let Err(again) = unsafe { resource.pool.free_async(ptr, &stream) } {
                    tracing::error!(
                        error = %again,
                        bytes = initial,
                        "the priming free failed twice; the block stays allocated"
                    );
                    return Err(e);
                }
            }
            stream.synchronize_blocking()?;
        }
        tracing::debug!(
            device = device.id(),
            initial = options.initial_pool_size,
            release_threshold = options.release_threshold,
            maximum = options.maximum_pool_size,
            "created a stream-ordered driver pool"
        );
        Ok(resource)
    }

    /// A resource over `device`'s default memory pool, the pool that `cuMemAllocAsync` (and so
    /// most libraries that allocate stream-ordered) uses: RMM's
    /// `cuda_async_view_memory_resource` of `cudaDeviceGetDefaultMemPool`. Memory freed by
    /// either side is reused by the other. It changes no setting of the pool (its release
    /// threshold is the driver's default, 0, unless someone raised it) and has no maximum of
    /// its own. On the simulated device, every call for one device shares one pool, kept while
    /// the device lives.
    ///
    /// ```
    /// use streamalloc::{CudaAsyncResource, Device, MemoryResource, SimConfig};
    ///
    /// let device = Device::simulated(SimConfig::default());
    /// let stream = device.create_stream()?;
    /// let a = CudaAsyncResource::default_pool(&device)?;
    /// let b = CudaAsyncResource::default_pool(&device)?;
    /// assert!(a.shares_pool_with(&b));
    /// let ptr = a.allocate(1 << 20, &stream)?;
    /// // SAFETY: unused, freed once, on the stream it was allocated on.
    /// unsafe { a.deallocate(ptr, 1 << 20, &stream)? };
    /// # Ok::<(), streamalloc::Error>(())
    /// ```
    ///
    /// Errors: [`Error::Driver`] if the driver has no pool for the device.
    pub fn default_pool(device: &Device) -> Result<Self> {
        Ok(Self::over(AsyncPool::default_pool(device)?, None))
    }

    /// A resource over `pool`, with nothing handed out yet.
    fn over(pool: AsyncPool, maximum: Option<usize>) -> Self {
        let shared = pool.device().pool_shared(pool.key(), PoolWaiters::new);
        let waiters = StdArc::new(MemoryWaiters::new());
        PoolWaiters::join(&shared, &waiters);
        let resource = Self {
            pool,
            maximum,
            count: Limit::new(maximum.unwrap_or(usize::MAX)),
            sizes: SizeTable::new(),
            waiters,
            shared,
        };
        resource.note_maximum();
        resource
    }

    /// Tells the queue the most any request can get, so that a newcomer larger than that
    /// fails at once even while others wait: the maximum rounded down to 256 bytes, since
    /// every request is counted rounded up (a maximum of 1,000 serves at most 768 bytes in
    /// one request; a request of 1,000, behind a waiter, queued until its turn). Under 256,
    /// nothing: no request ever fits, so none waits.
    fn note_maximum(&self) {
        let maximum = self.maximum_bytes();
        self.waiters
            .note_maximum(maximum - maximum % crate::resource::ALIGNMENT);
    }

    /// A resource over an existing driver pool, made by other code (`cuMemPoolCreate`, or
    /// `cuDeviceGetMemPool`): RMM's `cuda_async_view_memory_resource`. It uses the pool and
    /// never destroys it, changes none of its settings, and has no maximum of its own. CUDA
    /// only: on the simulated device it returns [`Error::InvalidArgument`] (use
    /// [`default_pool`](Self::default_pool) there, or share the resource itself).
    ///
    /// # Safety
    /// `pool` is a live `CUmemoryPool` of `device`'s memory (device-located, of this device),
    /// and stays live as long as this resource and every allocation made through it.
    pub unsafe fn view(device: &Device, pool: cudarc::driver::sys::CUmemoryPool) -> Result<Self> {
        // SAFETY: the caller's contract, passed on.
        let pool = unsafe { AsyncPool::view(device, pool) }?;
        Ok(Self::over(pool, None))
    }

    /// The driver's handle of the pool, to give to code that allocates from it directly (CUDA
    /// only; `None` on the simulated device). Valid as long as this resource lives (for a
    /// view, as long as its owner keeps it).
    pub fn raw_pool(&self) -> Option<cudarc::driver::sys::CUmemoryPool> {
        self.pool.raw_handle()
    }

    /// Whether `other` allocates from the same driver pool (two views of the default pool do).
    pub fn shares_pool_with(&self, other: &CudaAsyncResource) -> bool {
        self.pool.same_pool(&other.pool)
    }

    /// Bytes handed out through this resource and not given back, each allocation rounded up
    /// to 256 bytes; a free counts when it is issued (see the type's documentation). What the
    /// maximum is checked against.
    pub fn allocated_bytes(&self) -> usize {
        self.count.used()
    }

    /// Gives freed memory back to the device, keeping at least `keep_bytes` reserved
    /// (`cuMemPoolTrimTo`: "If the pool has less than minBytesToKeep reserved, the TrimTo
    /// operation is a no-op. Otherwise the pool will be guaranteed to have at least
    /// minBytesToKeep bytes reserved after the operation"). So the pool may keep more than
    /// `keep_bytes` afterwards (the driver releases whole chunks of its own; the simulated
    /// pool, whole blocks), never less than it had or `keep_bytes`, whichever is smaller;
    /// `trim_to(0)` gives back all it can. Memory in use, and memory whose free the GPU has not
    /// reached yet, stays: synchronize the streams that freed it first to give all of it
    /// back. Never blocks on the GPU.
    pub fn trim_to(&self, keep_bytes: usize) -> Result<()> {
        let _span = tracing::debug_span!("trim", keep_bytes).entered();
        self.pool.trim_to(keep_bytes)?;
        // Memory went back to the device, which a request the driver refused may use (one
        // through another resource over the pool too).
        self.shared.notify_all();
        Ok(())
    }

    /// Bytes of device memory the pool holds: in use and freed-but-kept
    /// (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`). The driver reserves in large chunks, so this
    /// can exceed the sum of the allocations.
    pub fn reserved_bytes(&self) -> Result<usize> {
        self.pool.reserved()
    }

    /// Bytes of the pool in live allocations (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT`).
    pub fn used_bytes(&self) -> Result<usize> {
        self.pool.used()
    }

    /// The release threshold in bytes (`usize::MAX`: keep everything).
    pub fn release_threshold(&self) -> Result<usize> {
        self.pool
            .release_threshold()
            .map(|t| usize::try_from(t).unwrap_or(usize::MAX))
    }

    /// Sets the release threshold (see [`CudaAsyncOptions::release_threshold`]).
    pub fn set_release_threshold(&self, bytes: usize) -> Result<()> {
        self.pool.set_release_threshold(bytes as u64)
    }

    /// The streams that requests arriving in the queues over this pool recorded an event on
    /// (see `PoolWaiters::watched`), for the loom model.
    #[cfg(streamalloc_loom)]
    pub(crate) fn watched_streams(&self) -> Vec<u64> {
        self.shared
            .watched
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The most this resource hands out at once: its maximum size, or the device's memory.
    pub fn maximum_bytes(&self) -> usize {
        self.maximum.unwrap_or_else(|| self.pool.maximum())
    }

    /// Counts `size` more bytes, unless that would pass the maximum.
    fn reserve(&self, bytes: usize, size: usize) -> Result<()> {
        self.count.reserve(size).map_err(|allocated| {
            let maximum = self.count.limit();
            tracing::debug!(
                requested = bytes,
                allocated,
                maximum,
                "CudaAsyncResource: over its maximum"
            );
            // The size counted (rounded to 256), as the limit compares it: with a maximum
            // that is not a multiple of 256, `bytes` may be at most the maximum while its
            // rounded size is not, and an error saying so would have waiters wait for
            // memory that can never come (a review's finding).
            Error::OutOfMemory {
                requested: size,
                available: maximum.saturating_sub(allocated),
                maximum,
            }
        })
    }

    /// The driver refused a request reserved for: the reservation goes back, and if the
    /// maximum refused someone meanwhile (perhaps a waiter's retry, because of it), the first
    /// waiter of every queue over the pool tries again. Otherwise nobody's failure was ours,
    /// and the first waiter is often the caller itself: waking it would only make it fail
    /// again at once, in a loop.
    fn roll_back(&self, size: usize) {
        if self.count.roll_back(size) {
            self.waiters.notify();
            self.shared.others(&self.waiters, MemoryWaiters::notify);
        }
    }

    /// A free issued through the resource: its bytes back. Inside the head waiter's quiet
    /// give-back the refusal mark stays (see `LimitingAdaptor`'s `release`): a request that
    /// reserved before the head was refused, and that the driver refuses later, must still
    /// wake the head.
    fn unreserve(&self, size: usize) {
        self.count.give_back_freed(size, &self.waiters);
    }
}

impl Drop for CudaAsyncResource {
    fn drop(&mut self) {
        self.shared.leave(&self.waiters);
    }
}

impl fmt::Debug for CudaAsyncResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaAsyncResource")
            .field("pool", &self.pool)
            .field("maximum", &self.maximum)
            .field("allocated", &self.allocated_bytes())
            .field("allocations", &self.sizes.len())
            .finish()
    }
}

// SAFETY: each allocation is the driver's stream-ordered `cuMemAllocFromPoolAsync` on the
// caller's stream (the simulated device's equivalent), of at least the bytes asked for, freed
// only through `deallocate`.
unsafe impl MemoryResource for CudaAsyncResource {
    fn device(&self) -> &Device {
        self.pool.device()
    }

    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Device
    }

    /// `cuMemAllocFromPoolAsync` on `stream`, within the resource's maximum. Never blocks.
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        check_stream(self.pool.device(), stream)?;
        if bytes == 0 {
            return Ok(DevicePtr(0));
        }
        let size = aligned_size(bytes)?;
        self.reserve(bytes, size)?;
        let ptr = self.pool.alloc_async(bytes, stream).inspect_err(|_| {
            self.roll_back(size);
        })?;
        // Nobody can free `ptr` before it is returned, so the entry is there for its free.
        self.sizes.insert(ptr.0, size);
        Ok(ptr)
    }

    /// `cuMemFreeAsync` on `stream`. Never blocks.
    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        check_stream(self.pool.device(), stream)?;
        match (ptr.0, bytes) {
            (0, 0) => Ok(()),
            (0, _) | (_, 0) => Err(Error::UnknownPointer { ptr: ptr.0, bytes }),
            _ => {
                let unknown = Error::UnknownPointer { ptr: ptr.0, bytes };
                // A size that cannot be rounded was never handed out.
                let size = aligned_size(bytes).map_err(|_| unknown.clone())?;
                // Out of the table first, so that two frees of one pointer racing each other
                // cannot both reach the driver; put back if the driver refuses.
                if let Err(have) = self.sizes.take(ptr.0, size) {
                    tracing::debug!(
                        ptr = format_args!("{:#x}", ptr.0),
                        bytes,
                        handed_out = have,
                        "CudaAsyncResource: a free of a pointer it did not hand out, or with \
                         another size"
                    );
                    return Err(unknown);
                }
                // SAFETY: the caller's contract: `ptr` came from `allocate` (so from this
                // pool), is freed once, and its uses are ordered before this point of `stream`
                // (the table just confirmed that it is live, and of this size).
                let freeing = || unsafe { self.pool.free_async(ptr, stream) };
                // A racing free panics in the simulated device's `Panic` mode, once the free is
                // queued (the stream's push settles the race after queuing it): the block is
                // freed, so it is given back and its stream noted before the panic goes on, as
                // the other resources do (`note_free_then`). The panic left the count and the
                // waiters as they were: `allocated_bytes` kept the block for good, and a waiter
                // was never told (a review's finding). Caught rather than handled in a guard's
                // drop, so that the wakes run before the unwinding, not inside it (a waker that
                // panicked there would abort the process).
                let freed = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(freeing)) {
                    Ok(freed) => freed,
                    Err(race) => {
                        self.unreserve(size);
                        self.freed(stream);
                        std::panic::resume_unwind(race);
                    }
                };
                if let Err(e) = freed {
                    // Nothing was freed: the allocation is still live, and still counted.
                    self.sizes.insert(ptr.0, size);
                    return Err(match e {
                        Error::UnknownPointer { ptr, .. } => Error::UnknownPointer { ptr, bytes },
                        other => other,
                    });
                }
                // Counted when issued (see the type's documentation), and only once the pool
                // took the free: a refused one leaves the count alone, or the maximum would
                // stop holding. The size is the allocation's (the table's).
                self.unreserve(size);
                self.freed(stream);
                Ok(())
            }
        }
    }

    fn memory_waiters(&self) -> Option<&MemoryWaiters> {
        Some(&self.waiters)
    }
}

impl CudaAsyncResource {
    /// A free through the resource was issued on `stream`: the first waiter of every resource
    /// over the pool tries again now (the count fell, and the driver may reuse the memory in
    /// stream order at once), and, if anyone waits, again once the GPU reaches the free, when
    /// the driver pool holds the memory for any stream. Without that second wake a request
    /// refused by the driver (the device out of memory) right after the free would sleep until
    /// the next one. If nobody waits, the stream is remembered instead (see [`PoolWaiters`]),
    /// for a request that starts waiting before the GPU reaches the free.
    ///
    /// With nobody waiting, the fast path costs a few loads of the stream's slot (a lock and a
    /// write only for a stream not noted there since the last request arrived), a fence and a
    /// few loads more. Nothing is recorded during a
    /// quiet give-back (the head waiter's own part of a set it could not complete) unless a
    /// queue other than the quiet one waits (another view's, this resource's own below a quiet
    /// adaptor's, one above it): the head alone would wake itself when the GPU got there, in a
    /// loop of failing tries at the GPU's pace. With another waiter the event wakes every
    /// queue, the quiet head's too, which may then try and give back again while that waiter
    /// stays refused: a loop at the GPU's pace for as long as both wait, a cost the review of
    /// the twenty-second session accepted over the waiter it left asleep before.
    fn freed(&self, stream: &Stream) {
        // Before the notification's fence (see `PoolWaiters`).
        if !planted!(NOTE_AFTER) {
            self.shared.note_free(stream);
        }
        self.waiters.notify();
        self.shared.others(&self.waiters, MemoryWaiters::notify);
        // Waiters of the queues stacked above count (a limiting adaptor's, refused here): their
        // request's try after the first wake above is refused as much as one of ours. During a
        // quiet give-back, all but the quiet queue's.
        let mut someone = self.waiters.waits_but_the_quiet();
        self.shared
            .others(&self.waiters, |q| someone |= q.waits_but_the_quiet());
        if someone {
            PoolWaiters::wake_after(&self.shared, stream);
        }
        if planted!(NOTE_AFTER) {
            self.shared.note_free(stream);
        }
    }
}

/// Bugs the loom model plants (`loom-tests/cuda_async.rs`), constant off otherwise; read
/// through `planted!`.
#[cfg(streamalloc_loom)]
pub(crate) mod planted {
    /// A free notes its stream for later waiters after its notification and its last look
    /// at the queues (the fence, the loads of their lengths, the check for anyone waiting),
    /// not before: a request registering in between sees neither the stream nor is seen, and
    /// sleeps through the free. (Planted after the notification only, it is no bug since a
    /// request's arrival locks each slot: a note that locks the slot after the arrival is
    /// ordered after its registration, and the check for anyone waiting that follows sees
    /// it.)
    pub(crate) static NOTE_AFTER: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);
    /// A slot keeps one stream, as it once did: a free on another stream of the slot replaces
    /// the one noted, whose free a request arriving later is then never woken by.
    pub(crate) static ONE_PER_SLOT: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);
}
