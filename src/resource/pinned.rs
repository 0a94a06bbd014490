//! [`PinnedHostResource`]: page-locked host memory for staging copies, with a cache of freed
//! blocks that are reused only once the GPU work that used them is done.
//!
//! ## How a block moves
//!
//! ```text
//!   allocate ──► live ──deallocate(stream)──► pending ──event done (reactor)──► ready ─┐
//!      ▲                 records an event         │                                   │
//!      │                 on the stream            └──(cache full)──► retired          │
//!      └──────────────────────────────────────────── allocate (same size class) ◄─────┘
//! ```
//!
//! - `deallocate` records an event on the stream and files the block as *pending* under its
//!   size class; `Event::on_complete` moves it to *ready* when the GPU reaches the event. The
//!   callback runs on the device's reactor thread, so it only takes the cache's lock, moves an
//!   address between two lists and drops an event handle: no driver call, no wait.
//! - `allocate` pops a ready block of the size class: one lock, two hash lookups, no driver
//!   call. On a miss it looks at the oldest pending block of the class and asks its event
//!   (one query): if the GPU is done with it but the reactor has not run the callback yet, it
//!   takes the block directly. Only then does it pin new memory (`cuMemHostAlloc`, slow).
//! - A block is never handed out while it is pending, not even for the stream it was freed
//!   on: the host writes staging memory right after allocating it, and a host write is not
//!   ordered behind queued GPU work the way a device write on the same stream would be.
//! - Size classes are quarter powers of two from 256 bytes (256, 320, 384, 448, 512, 640, ...):
//!   at most 25% of a block is slack, and blocks of nearby sizes share a class.
//! - The cache keeps at most `max_cached_bytes` of ready blocks. A block that completes when
//!   the cache is full is *retired*: it cannot be freed on the reactor thread (`cuMemFreeHost`
//!   waits for the device to be idle), so the next allocation miss,
//!   [`PinnedHostResource::release`], or the drop of the resource frees it. That free is the
//!   costly part: a `cuMemFreeHost` waits for all the GPU's work, and while it waits the
//!   driver holds up every other thread's launches and records on that GPU (an H100: 950 ms
//!   behind a 1 s kernel on another stream, where the pinning itself, `cuMemHostAlloc`, took
//!   0.05 ms; BENCHMARKS.md, "A waiting cuMemFree holds up the GPU's other threads"). Size
//!   `max_cached_bytes` to the staging memory in flight so that blocks do not retire.

use std::collections::VecDeque;
use std::fmt;

use rustc_hash::FxHashMap;

use crate::device::{Device, DevicePtr};
use crate::error::{Error, Result};
use crate::event::Event;
use crate::resource::{check_stream, MemoryKind, MemoryResource};
use crate::stream::Stream;
use crate::sync::{Arc, Mutex};

/// The smallest size class: every block is at least this big (and [`ALIGNMENT`]-aligned).
///
/// [`ALIGNMENT`]: crate::ALIGNMENT
const MIN_CLASS: usize = 256;

/// How many completed pending blocks an allocation miss tries to take before it pins new
/// memory.
const CLAIM_TRIES: usize = 4;

/// The size class of a request: `bytes` rounded up to the next quarter power of two (at least
/// [`MIN_CLASS`]), or `None` if that overflows.
fn size_class(bytes: usize) -> Option<usize> {
    if bytes <= MIN_CLASS {
        return Some(MIN_CLASS);
    }
    // floor(log2(bytes - 1)) >= 8, so the quarter step is at least 64.
    let log = usize::BITS - 1 - (bytes - 1).leading_zeros();
    bytes.checked_next_multiple_of(1usize << (log - 2))
}

/// Settings of a [`PinnedHostResource`].
#[derive(Debug, Clone)]
pub struct PinnedHostOptions {
    /// The most freed memory the cache keeps ready for reuse, in bytes. Blocks freed beyond it
    /// are given back to the driver (on the next allocation miss, on
    /// [`release`](PinnedHostResource::release), or when the resource is dropped), and each
    /// such `cuMemFreeHost` waits for the whole GPU to be idle (see the module's docs): size
    /// it to the staging memory in flight.
    pub max_cached_bytes: usize,
}

impl Default for PinnedHostOptions {
    /// 256 MiB of cached blocks.
    fn default() -> Self {
        Self {
            max_cached_bytes: 256 << 20,
        }
    }
}

/// A snapshot of a [`PinnedHostResource`]'s cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PinnedHostStats {
    /// Blocks handed out and not given back.
    pub live_blocks: usize,
    /// Blocks given back whose GPU work is done: the next allocations of their size class
    /// take them.
    pub cached_blocks: usize,
    /// Bytes of the cached blocks (whole size classes).
    pub cached_bytes: usize,
    /// Blocks given back whose GPU work has not completed yet.
    pub pending_blocks: usize,
    /// Blocks done with but not cached (the cache was full), waiting to be freed.
    pub retired_blocks: usize,
    /// How many times the resource pinned new memory (`cuMemHostAlloc`) since it was made.
    pub host_allocations: u64,
}

/// Page-locked (pinned) host memory: the host reads and writes it through the address, copies
/// between it and the device run asynchronously and at full speed, and with unified
/// addressing a kernel can use the same address. The [`DevicePtr`] it hands out holds the host
/// address (`ptr.as_raw() as *mut u8`); its [`memory_kind`](MemoryResource::memory_kind) is
/// [`MemoryKind::PinnedHost`].
///
/// What it promises:
///
/// - **a block is reused only after the GPU work that used it is done**: `deallocate(ptr,
///   bytes, stream)` records an event on `stream` and the block returns to the cache when the
///   GPU reaches it; until then no allocation, on any stream, gets it. Neither call blocks.
/// - allocation is fast when the cache hits: freed blocks are kept by size class, so repeated
///   staging allocations of similar sizes do not pin memory again (pinning costs about a
///   millisecond per call, far more for large sizes);
/// - blocks are at least 256-aligned; zero bytes gives a null pointer without a driver call,
///   and `deallocate` takes it back with zero bytes; a pointer it did not hand out, or a size
///   of another class than the one it was allocated with, is [`Error::UnknownPointer`];
/// - a request for more than the host's available memory is [`Error::OutOfMemory`] (requested,
///   the host's available and total memory), decided before asking the driver; on a driver
///   failure the cache is released and the request retried once.
///
/// See the [module documentation](self) for the design. Dropping the resource frees the cached
/// blocks and, after **blocking** until their GPU work completes, the pending ones; blocks
/// still handed out are left alone (leaked, with a warning): drop what uses them first.
pub struct PinnedHostResource {
    device: Device,
    shared: Arc<Shared>,
}

/// What the resource and the completion callbacks share.
struct Shared {
    max_cached: usize,
    cache: Mutex<Cache>,
}

/// A freed block waiting for the GPU.
struct Pending {
    ptr: u64,
    /// Recorded on the freeing stream after the block's last use.
    event: Event,
    /// Which free of `ptr` this is (a counter of the cache): the same address can be pending
    /// again, after a later free, by the time an earlier free's callback or claim comes for it,
    /// and must then stay pending (it did: the ABA that let `base_resources`' four-thread test
    /// see a block reused before its copy ran, about one run in twenty).
    token: u64,
}

/// The blocks of the resource, by state. Every field is only read or written while the
/// `Shared::cache` lock is held; no driver call and no wait happens under it.
#[derive(Default)]
struct Cache {
    /// Handed out: address to size class.
    live: FxHashMap<u64, usize>,
    /// Done with, reusable at once: size class to addresses (last freed on top).
    ready: FxHashMap<usize, Vec<u64>>,
    ready_bytes: usize,
    ready_blocks: usize,
    /// Freed, waiting for their events: size class to blocks, in the order they were freed.
    pending: FxHashMap<usize, VecDeque<Pending>>,
    pending_blocks: usize,
    /// Done with but over the cache's limit: (address, size class), to be freed by a user
    /// thread.
    retired: Vec<(u64, usize)>,
    host_allocations: u64,
    /// The next [`Pending::token`].
    next_token: u64,
}

impl Cache {
    /// Takes a ready block of `class` and marks it live.
    fn take_ready(&mut self, class: usize) -> Option<u64> {
        let blocks = self.ready.get_mut(&class)?;
        let ptr = blocks.pop()?;
        if blocks.is_empty() {
            self.ready.remove(&class);
        }
        self.ready_bytes -= class;
        self.ready_blocks -= 1;
        self.live.insert(ptr, class);
        Some(ptr)
    }

    /// Removes the pending free `token` of `ptr` (of `class`), if it is still pending.
    fn take_pending(&mut self, ptr: u64, class: usize, token: u64) -> Option<Pending> {
        let queue = self.pending.get_mut(&class)?;
        let at = queue
            .iter()
            .position(|p| p.ptr == ptr && p.token == token)?;
        let pending = queue.remove(at);
        if queue.is_empty() {
            self.pending.remove(&class);
        }
        self.pending_blocks -= 1;
        pending
    }
}

impl Shared {
    fn lock(&self) -> crate::sync::MutexGuard<'_, Cache> {
        self.cache.lock()
    }

    /// The event of the block `ptr` completed: cache it, or retire it if the cache is full.
    /// Runs on the reactor thread (or wherever the completion was first observed): only moves
    /// the address between lists, and drops the event handle outside the lock.
    fn completed(&self, ptr: u64, class: usize, token: u64) {
        let pending = {
            let mut cache = self.lock();
            // Gone already: an allocation miss took it (and it may be pending again, after a
            // later free: that one waits for its own event), or the resource is being dropped.
            let Some(pending) = cache.take_pending(ptr, class, token) else {
                return;
            };
            if cache.ready_bytes.saturating_add(class) <= self.max_cached {
                cache.ready.entry(class).or_default().push(ptr);
                cache.ready_bytes += class;
                cache.ready_blocks += 1;
            } else {
                cache.retired.push((ptr, class));
            }
            pending
        };
        drop(pending);
    }
}

impl PinnedHostResource {
    /// A resource of `device`'s page-locked host memory with default options. Makes no driver
    /// call: memory is pinned on the first allocations.
    pub fn new(device: &Device) -> Self {
        Self::with_options(device, PinnedHostOptions::default())
    }

    /// A resource with the given options.
    pub fn with_options(device: &Device, options: PinnedHostOptions) -> Self {
        Self {
            device: device.clone(),
            shared: Arc::new(Shared {
                max_cached: options.max_cached_bytes,
                cache: Mutex::new(Cache::default()),
            }),
        }
    }

    /// Frees every cached block, and every retired one, back to the driver
    /// (`cuMemFreeHost`, which waits for the device to be idle and meanwhile holds up other
    /// threads' launches on it). Blocks in use or still pending stay.
    /// Returns the first error, after trying every block.
    pub fn release(&self) -> Result<()> {
        let blocks = {
            let mut cache = self.shared.lock();
            let mut blocks = drain_ready(&mut cache);
            blocks.append(&mut cache.retired);
            blocks
        };
        let _span = tracing::debug_span!("pinned release", blocks = blocks.len()).entered();
        self.free_all(blocks)
    }

    /// A snapshot of the cache's counters.
    pub fn stats(&self) -> PinnedHostStats {
        let cache = self.shared.lock();
        PinnedHostStats {
            live_blocks: cache.live.len(),
            cached_blocks: cache.ready_blocks,
            cached_bytes: cache.ready_bytes,
            pending_blocks: cache.pending_blocks,
            retired_blocks: cache.retired.len(),
            host_allocations: cache.host_allocations,
        }
    }

    /// Frees `blocks` (address and size class; no longer in any list, GPU work done); the
    /// first error, after all. A block the driver does not free is retired again, so that the
    /// next miss, `release` or the drop tries again: still the resource's, not lost (a
    /// review's finding: it had left every list, and stayed pinned, counted nowhere).
    fn free_all(&self, blocks: impl IntoIterator<Item = (u64, usize)>) -> Result<()> {
        let mut first = Ok(());
        let mut kept = Vec::new();
        for (ptr, class) in blocks {
            // SAFETY: every caller passes blocks that came from `malloc_host` of this device,
            // that it has just removed from the cache's lists (so they are freed once: one
            // whose free fails goes back to a list only after the attempt), and whose GPU work
            // is done and which no host code uses (they were given back).
            let freed = unsafe { self.device.free_host(ptr as *mut u8) };
            if let Err(e) = freed {
                tracing::warn!(ptr, error = %e, "could not free pinned host memory; kept");
                first = first.and(Err(e));
                kept.push((ptr, class));
            }
        }
        if !kept.is_empty() {
            self.shared.lock().retired.append(&mut kept);
        }
        first
    }

    /// The slow path of `allocate`: no ready block of `class`.
    fn allocate_slow(&self, bytes: usize, class: usize) -> Result<DevicePtr> {
        // 1. A pending block whose GPU work is done but whose callback has not run yet.
        for _ in 0..CLAIM_TRIES {
            let (ptr, event, token) = {
                let mut cache = self.shared.lock();
                if let Some(ptr) = cache.take_ready(class) {
                    return Ok(DevicePtr(ptr));
                }
                match cache.pending.get(&class).and_then(|q| q.front()) {
                    Some(oldest) => (oldest.ptr, oldest.event.clone(), oldest.token),
                    None => break,
                }
            };
            // Outside the lock: completing the event here runs its callback on this thread.
            // Asked before the look below: the withheld state is a result, set perhaps on
            // another thread meanwhile, and never changes once set; looked at first, a block
            // withheld between the look and the query was taken for done (a review's finding).
            let done = event.query_for_crate().is_some();
            // An event that withholds its callbacks has an error for a result, yet nothing says
            // the GPU is done with the block (its query and wait panicked): taken for done, the
            // block went out under work that may still use it. It is leaked instead, out of
            // the pending list so that it does not stand in front of its class's later frees.
            if event.withholds_callbacks() {
                let leaked = self.shared.lock().take_pending(ptr, class, token);
                if let Some(leaked) = leaked {
                    tracing::error!(
                        ptr,
                        class,
                        "a pinned block whose event withholds its callbacks is leaked"
                    );
                    drop(leaked);
                }
                continue;
            }
            if !done {
                break;
            }
            let mut cache = self.shared.lock();
            if planted!(CLAIM_LEAVES_PENDING) {
                // The planted bug: claimed, but still pending, so its callback caches it too.
                cache.live.insert(ptr, class);
                return Ok(DevicePtr(ptr));
            }
            if let Some(pending) = cache.take_pending(ptr, class, token) {
                cache.live.insert(ptr, class);
                drop(cache);
                drop(pending);
                return Ok(DevicePtr(ptr));
            }
            // Its callback cached it meanwhile (or another thread took it): look again.
        }

        // 2. A retired block of this class; the others are freed now, this path being slow.
        let (reuse, free) = {
            let mut cache = self.shared.lock();
            if let Some(ptr) = cache.take_ready(class) {
                return Ok(DevicePtr(ptr));
            }
            let mut retired = std::mem::take(&mut cache.retired);
            let reuse = retired
                .iter()
                .position(|&(_, c)| c == class)
                .map(|at| retired.swap_remove(at).0);
            if let Some(ptr) = reuse {
                cache.live.insert(ptr, class);
            }
            (reuse, retired)
        };
        // Errors were logged; failing to free an old block must not fail this allocation.
        let _ = self.free_all(free);
        if let Some(ptr) = reuse {
            return Ok(DevicePtr(ptr));
        }

        // 3. Pin new memory; if the driver refuses, give the cache back and try once more.
        let _span = tracing::debug_span!("pin host memory", bytes, class).entered();
        let ptr = match self.device.malloc_host(class) {
            Ok(ptr) => ptr,
            // Retry only if giving the cache back can make room (unknown host numbers: zeros).
            Err(Error::OutOfMemory {
                available, maximum, ..
            }) if {
                let cached = self.stats().cached_bytes;
                cached > 0 && (maximum == 0 || class <= available.saturating_add(cached))
            } =>
            {
                let _ = self.release();
                self.device
                    .malloc_host(class)
                    .map_err(|e| with_requested(e, bytes))?
            }
            Err(e) => return Err(with_requested(e, bytes)),
        };
        let mut cache = self.shared.lock();
        cache.live.insert(ptr as u64, class);
        cache.host_allocations += 1;
        Ok(DevicePtr(ptr as u64))
    }
}

/// A bug the loom model plants (`loom-tests/pinned.rs`), constant off otherwise.
#[cfg(streamalloc_loom)]
pub(crate) mod planted {
    /// An allocation miss claims a pending block whose event is done without taking it out of
    /// the pending list: the block's completion callback then caches it as well, and the next
    /// allocation of its class gets it while it is still handed out.
    pub(crate) static CLAIM_LEAVES_PENDING: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);
}

/// Takes every ready block out of `cache`: (address, size class).
fn drain_ready(cache: &mut Cache) -> Vec<(u64, usize)> {
    cache.ready_bytes = 0;
    cache.ready_blocks = 0;
    cache
        .ready
        .drain()
        .flat_map(|(class, blocks)| blocks.into_iter().map(move |ptr| (ptr, class)))
        .collect()
}

/// An out-of-memory error for the caller's byte count (not the size class asked of the
/// driver).
fn with_requested(err: Error, requested: usize) -> Error {
    match err {
        Error::OutOfMemory {
            available, maximum, ..
        } => Error::OutOfMemory {
            requested,
            available,
            maximum,
        },
        other => other,
    }
}

impl fmt::Debug for PinnedHostResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedHostResource")
            .field("device", &self.device.id())
            .field("max_cached_bytes", &self.shared.max_cached)
            .field("stats", &self.stats())
            .finish()
    }
}

// SAFETY: each allocation is page-locked host memory of at least the bytes asked for: fresh from
// the driver, or a cached block whose last GPU use the driver reported done; freed only through
// `deallocate`.
unsafe impl MemoryResource for PinnedHostResource {
    fn device(&self) -> &Device {
        &self.device
    }

    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::PinnedHost
    }

    /// A cached block of the size class whose GPU work is done, or newly pinned memory. The
    /// host may use it at once, and so may work on any stream.
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        check_stream(&self.device, stream)?;
        if bytes == 0 {
            return Ok(DevicePtr(0));
        }
        let class = size_class(bytes).ok_or(Error::InvalidSize {
            size: bytes,
            reason: "the size overflows when rounded up to its size class",
        })?;
        // Bound first: a guard in the `match` would be held through `allocate_slow`, which
        // takes the lock again.
        let ready = self.shared.lock().take_ready(class);
        let ptr = match ready {
            Some(ptr) => {
                tracing::trace!(bytes, class, "pinned cache hit");
                DevicePtr(ptr)
            }
            None => self.allocate_slow(bytes, class)?,
        };
        // The simulated device's race detector tracks page-locked memory as device memory: a
        // cached block handed to another stream is a reuse, ordered by the event the cache
        // saw complete, and its new uses are not checked against its old owner's.
        self.device.note_allocation(ptr, bytes, stream);
        Ok(ptr)
    }

    /// Records an event on `stream` and caches the block once the GPU reaches it. Never
    /// blocks. On error (a bad pointer, or the event could not be recorded) the block stays
    /// the caller's.
    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        check_stream(&self.device, stream)?;
        let unknown = Error::UnknownPointer { ptr: ptr.0, bytes };
        match (ptr.0, bytes) {
            (0, 0) => return Ok(()),
            (0, _) | (_, 0) => return Err(unknown),
            _ => {}
        }
        let class = size_class(bytes).ok_or(unknown.clone())?;
        {
            let mut cache = self.shared.lock();
            match cache.live.get(&ptr.0) {
                Some(&c) if c == class => {
                    cache.live.remove(&ptr.0);
                }
                _ => return Err(unknown),
            }
        }
        // Noted before the event is recorded, so that the event (whose completion lets the
        // block go to another stream) is ordered after the free in the race detector's eyes;
        // a race's panic (its `Panic` mode) comes once the block is filed, so none is lost.
        let file = || -> Result<()> {
            let event = match stream.record() {
                Ok(event) => event,
                Err(e) => {
                    self.shared.lock().live.insert(ptr.0, class);
                    // Still the caller's: live again for the detector too (on the stream that
                    // freed it, so ordered after its free).
                    self.device.note_allocation(ptr, bytes, stream);
                    return Err(e);
                }
            };
            let token = {
                let mut cache = self.shared.lock();
                let token = cache.next_token;
                cache.next_token += 1;
                cache.pending.entry(class).or_default().push_back(Pending {
                    ptr: ptr.0,
                    event: event.clone(),
                    token,
                });
                cache.pending_blocks += 1;
                token
            };
            let shared = self.shared.clone();
            let block = ptr.0;
            // Filed as pending before the callback is registered: the callback may run at once.
            event.on_complete(Box::new(move |_| shared.completed(block, class, token)));
            Ok(())
        };
        self.device.note_free_then(ptr, bytes, stream, file)
    }
}

impl Drop for PinnedHostResource {
    fn drop(&mut self) {
        let (done, pending, live) = {
            let mut cache = self.shared.lock();
            let mut done = drain_ready(&mut cache);
            done.append(&mut cache.retired);
            let pending: Vec<(Pending, usize)> = cache
                .pending
                .drain()
                .flat_map(|(class, q)| q.into_iter().map(move |p| (p, class)))
                .collect();
            cache.pending_blocks = 0;
            (done, pending, cache.live.len())
        };
        let _ = self.free_all(done);
        for (block, class) in pending {
            // The GPU may still use it: wait (blocking) before the memory goes back. A failed
            // stream still ran everything before its fault; the memory is free to go.
            let _ = block.event.synchronize_blocking();
            // Unless nothing says the GPU is done with it (the event withholds its callbacks):
            // then the block is leaked, not freed under work that may still use it.
            if block.event.withholds_callbacks() {
                tracing::error!(
                    ptr = block.ptr,
                    "a pinned block whose event withholds its callbacks is leaked"
                );
                continue;
            }
            let _ = self.free_all([(block.ptr, class)]);
        }
        // Blocks the driver would not free went back to `retired`: nothing will try again.
        let unfreed = self.shared.lock().retired.len();
        if unfreed > 0 {
            tracing::warn!(
                blocks = unfreed,
                "PinnedHostResource dropped with blocks the driver would not free; they are leaked"
            );
        }
        if live > 0 {
            tracing::warn!(
                blocks = live,
                "PinnedHostResource dropped with blocks still handed out; they are leaked"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SimConfig;

    /// The ABA behind `base_resources::four_threads_at_once_each_on_its_own_stream`'s rare
    /// "reused too soon": a block freed, claimed by an allocation miss before its callback ran,
    /// used and freed again behind slow work; the first free's callback then comes late. It
    /// must not release the second free (keyed by address alone, it did: the block went to the
    /// ready list with its copy still queued, and the next allocation took it).
    #[test]
    fn a_late_callback_does_not_release_a_later_free_of_the_same_block() {
        let device = Device::simulated(SimConfig::default());
        let r = PinnedHostResource::new(&device);
        let s = device.create_stream().unwrap();
        let ptr = r.allocate(1000, &s).unwrap();
        let class = size_class(1000).unwrap();
        // Free 1, filed as `deallocate` files it, with its callback held back (run by hand).
        let first = s.record().unwrap();
        first.synchronize_blocking().unwrap();
        {
            let mut cache = r.shared.lock();
            cache.live.remove(&ptr.0);
            let token = cache.next_token;
            cache.next_token += 1;
            cache.pending.entry(class).or_default().push_back(Pending {
                ptr: ptr.0,
                event: first,
                token,
            });
            cache.pending_blocks += 1;
        }
        // A miss claims it (its event is done), and the block is freed again behind slow work.
        assert_eq!(r.allocate(1000, &s).unwrap(), ptr);
        s.spin(std::time::Duration::from_millis(300)).unwrap();
        // SAFETY: allocated above, unused on the host; freed once.
        unsafe { r.deallocate(ptr, 1000, &s) }.unwrap();
        // Free 1's callback, late.
        r.shared.completed(ptr.0, class, 0);
        let next = r.allocate(1000, &s).unwrap();
        assert_ne!(
            next, ptr,
            "a block was handed out while its second free was pending"
        );
        s.synchronize_blocking().unwrap();
        // SAFETY: as above.
        unsafe { r.deallocate(next, 1000, &s) }.unwrap();
        s.synchronize_blocking().unwrap();
    }

    /// A pending block whose event withholds its callbacks (its query and wait both panicked:
    /// nothing says whether the GPU is done with it) must stay out of use. The event's result
    /// is an error, which the claim of an allocation miss took for "done": it handed the block
    /// out with its GPU work (here a 300 ms spin) possibly still running.
    #[test]
    fn a_block_whose_event_withholds_its_callbacks_is_not_handed_out() {
        let device = Device::simulated(SimConfig::default());
        let r = PinnedHostResource::new(&device);
        let s = device.create_stream().unwrap();
        let ptr = r.allocate(1000, &s).unwrap();
        s.spin(std::time::Duration::from_millis(300)).unwrap();
        // SAFETY: allocated above, unused on the host; freed once.
        unsafe { r.deallocate(ptr, 1000, &s) }.unwrap();
        let class = size_class(1000).unwrap();
        let event = r.shared.lock().pending[&class][0].event.clone();
        assert_eq!(
            event.withhold_callbacks_for_test(),
            1,
            "the cache's callback"
        );
        let next = r.allocate(1000, &s).unwrap();
        assert_ne!(
            next, ptr,
            "a block was handed out with nothing saying the GPU was done with it"
        );
        s.synchronize_blocking().unwrap();
        // SAFETY: as above.
        unsafe { r.deallocate(next, 1000, &s) }.unwrap();
        s.synchronize_blocking().unwrap();
    }

    #[test]
    fn size_classes_are_quarter_powers_of_two() {
        assert_eq!(size_class(1), Some(256));
        assert_eq!(size_class(256), Some(256));
        assert_eq!(size_class(257), Some(320));
        assert_eq!(size_class(1000), Some(1024));
        assert_eq!(size_class(1024), Some(1024));
        assert_eq!(size_class(1025), Some(1280));
        assert_eq!(size_class(1 << 20), Some(1 << 20));
        assert_eq!(size_class((1 << 20) + 1), Some(5 << 18));
        assert_eq!(size_class(1 << 50), Some(1 << 50));
        assert_eq!(size_class(usize::MAX), None);
        let mut previous = 0;
        for bytes in (1..100_000).step_by(7) {
            let class = size_class(bytes).unwrap();
            assert!(class >= bytes && class >= previous, "{bytes} -> {class}");
            assert!(
                class <= MIN_CLASS || class * 4 <= bytes * 5 + 4 * 64,
                "{bytes} -> {class}"
            );
            previous = class;
        }
    }
}
