//! The simulated device's memory: host memory at addresses that look like device addresses.
//!
//! Every allocation gets a fresh address range with a guard gap after it, so a use after free
//! or an overrun is an [`Error::InvalidAddress`], not a silent read of someone else's bytes:
//! addresses are handed out in one sweep up the device's range (16 TiB), which comes round to
//! freed ranges only once it has reached the range's end. Bytes are atomics: work on two
//! streams that races on one buffer is a data race in the user's program, as on a GPU, but
//! never undefined behaviour in ours.
//!
//! Also here: the simulated device's page-locked host memory ([`SimHostMemory`], plain host
//! memory with a table so frees can be checked, which device work may use as on a GPU) and its
//! driver memory pools ([`SimPool`]).

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;

use rustc_hash::{FxHashMap, FxHashSet};

use super::granules::{Granules, ADDRESS_SPACE};
use super::host_bytes::HostBytes;
use crate::error::{Error, Result};
// Plain `Arc`s: loom never models the memory (`sync::plain`), and `block` clones one under the
// table's std lock, where no loom operation may run.
use crate::sync::plain::{Arc, DataByte, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak};

/// Where the simulated address space starts: above every address the host hands out (user
/// space ends below 2^47 on x86-64 and 2^48 on aarch64, unless a mapping asks for more), so
/// that, as under CUDA's unified addressing, a device address is never also an address of
/// page-locked host memory, which device work may use too ([`SimMemory::bytes`]). It was
/// `0x7f00_0000_0000`, where the host's own mappings lie: a pinned block's address could be a
/// simulated device block's.
const BASE: u64 = 1 << 48;
/// Each simulated device's addresses start this far after the previous one's (16 TiB), so
/// that, as under CUDA's unified addressing, no two devices hand out the same address: a
/// pointer of one device used on another is an `InvalidAddress`, never another block's bytes.
const DEVICE_SPAN: u64 = 1 << 44;
/// Allocations start on this boundary (cudaMalloc gives at least 256).
pub(crate) const ALIGN: u64 = 512;
/// Unmapped bytes after each allocation, so overruns fault.
const GUARD: u64 = 64 << 10;
/// From this size up, a block's host bytes are a mapping with no swap reserved
/// ([`HostBytes::reserved`]) rather than heap memory (see `alloc_as`).
const LARGE_BLOCK: usize = 2 << 20;

/// The largest request that `bytes` of free memory can grant: whole blocks of [`ALIGN`], since
/// an allocation takes its size rounded up to one (1,000 bytes grant 512).
pub(crate) fn usable(bytes: usize) -> usize {
    bytes - bytes % ALIGN as usize
}

pub(crate) struct Block {
    base: u64,
    bytes: HostBytes,
    /// A reserved virtual range (`sim/vmm.rs`): only its mapped granules may be accessed.
    mapping: Option<Arc<Granules>>,
    /// Managed memory (`cuMemAllocManaged`), which alone a prefetch takes.
    managed: bool,
}

impl Block {
    /// The bytes of `[ptr, ptr + len)`, which must lie inside this block.
    fn range(&self, ptr: u64, len: usize) -> &[DataByte] {
        let start = (ptr - self.base) as usize;
        &self.bytes[start..start + len]
    }
}

struct State {
    blocks: BTreeMap<u64, Arc<Block>>,
    /// Allocations whose free is queued on a stream ([`SimMemory::begin_free`]) and has not
    /// run yet: still live (work queued before the free may use them), but not to be freed
    /// again.
    freeing: FxHashSet<u64>,
    used: usize,
    /// Where the sweep of addresses goes on from ([`State::place`]).
    next: u64,
    /// This device's address range: `DEVICE_SPAN` bytes from `start`.
    start: u64,
    end: u64,
}

impl State {
    /// Whether `ptr` is the start of a live allocation (`cuMemAlloc`'s, not a reserved
    /// virtual range: the driver refuses `cuMemFree` of one, and freeing it here took the
    /// whole reservation out of the table and its size out of the memory in use, which a
    /// review found going past the device's total).
    fn is_allocated(&self, ptr: u64) -> bool {
        self.blocks.get(&ptr).is_some_and(|b| b.mapping.is_none())
    }

    /// Where `size` bytes at a multiple of `align`, with a guard gap after them, fit in this
    /// device's range: the first room from where the sweep is, else (the sweep has reached the
    /// range's end) the first from the range's start, among freed addresses. `None` if live
    /// blocks leave no room. Never past the range's end, which is the next device's start.
    fn place(&self, size: u64, align: u64) -> Option<u64> {
        self.room(self.next, size, align)
            .or_else(|| self.room(self.start, size, align))
    }

    /// The first room for `size` bytes at a multiple of `align` from `from` on, clear of every
    /// live block and its guard gap, with a guard gap of its own before the range's end.
    fn room(&self, from: u64, size: u64, align: u64) -> Option<u64> {
        let clear = |block: &Block| block.base + block.bytes.len() as u64 + GUARD;
        let mut at = from;
        loop {
            at = at.checked_next_multiple_of(align)?;
            // The live block that starts before `at` may reach it, with its guard gap.
            if let Some((_, block)) = self.blocks.range(..at).next_back() {
                if clear(block) > at {
                    at = clear(block);
                    continue;
                }
            }
            let end = at.checked_add(size)?.checked_add(GUARD)?;
            if end > self.end {
                return None;
            }
            // Each step passes a live block, so this ends.
            match self.blocks.range(at..end).next() {
                Some((_, block)) => at = clear(block),
                None => return Some(at),
            }
        }
    }
}

pub(crate) struct SimMemory {
    total: usize,
    state: RwLock<State>,
    /// The driver pools made on this memory ([`SimPool::create`]), so that a `cuMemAlloc`
    /// short of memory can take what they keep, as the driver does
    /// ([`release_pools`](Self::release_pools)).
    pools: Mutex<Vec<Weak<SimPool>>>,
    /// Told when a driver pool gives a block back to the device: the device's race detector,
    /// if detection is on (set once, by the device, before any pool exists). A trait object,
    /// not the detector's type: the detector names this module, not the other way round.
    pool_releases: std::sync::OnceLock<Weak<dyn PoolReleases>>,
}

/// What wants to know that a driver pool gave a block back to the device (the race detector,
/// which forgets the block past its bound of kept frees from then on).
pub(crate) trait PoolReleases: Send + Sync {
    /// The freed block at `ptr` went back to the device.
    fn released_by_pool(&self, ptr: u64);
}

impl SimMemory {
    /// Sets who is told when a driver pool gives a block back ([`PoolReleases`]); once,
    /// before any pool is made on this memory.
    pub(crate) fn tell_pool_releases_to(&self, listener: Weak<dyn PoolReleases>) {
        let _ = self.pool_releases.set(listener);
    }

    pub(crate) fn new(total: usize) -> Self {
        // Wraps back to the first range after about a million devices in one process: a
        // reuse of addresses far beyond what any test makes.
        static DEVICES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = DEVICES.fetch_add(1, Relaxed) % ((u64::MAX - BASE) / DEVICE_SPAN);
        let start = BASE + n * DEVICE_SPAN;
        Self {
            total,
            state: RwLock::new(State {
                blocks: BTreeMap::new(),
                freeing: FxHashSet::default(),
                used: 0,
                next: start,
                start,
                end: start + DEVICE_SPAN,
            }),
            pools: Mutex::new(Vec::new()),
            pool_releases: std::sync::OnceLock::new(),
        }
    }

    /// What the driver does when a `cuMemAlloc` or a `cuMemCreate` finds too little free
    /// memory: every pool on the device gives back all it keeps (not only what the request
    /// lacks), and the request tries again (driver 580.159.04: a pool keeping 1 GiB kept none
    /// afterwards, and a `cuMemAlloc` of the free memory plus 256 MiB succeeded; BENCHMARKS.md,
    /// "A failed cuMemAlloc empties the driver's pools"). Returns whether anything was given
    /// back.
    pub(crate) fn release_pools(&self) -> bool {
        // The pools are gathered under the registry's lock and trimmed after it: a pool's
        // lock is taken before the memory's, never under the registry's.
        let pools: Vec<Arc<SimPool>> = {
            let mut pools = self.pools.lock().unwrap_or_else(|e| e.into_inner());
            pools.retain(|p| p.strong_count() > 0);
            pools.iter().filter_map(Weak::upgrade).collect()
        };
        let mut released = false;
        for pool in pools {
            let mut state = pool.state();
            released |= state.kept_bytes > 0;
            let used = state.used;
            state.release_until(self, used);
        }
        released
    }

    /// (free, total) in bytes.
    pub(crate) fn info(&self) -> (usize, usize) {
        let used = self.read().used;
        (self.total - used, self.total)
    }

    /// The numbers of an out-of-memory error: the largest request that would succeed now and
    /// the largest that ever could (the free and the total memory, in whole blocks).
    pub(crate) fn room(&self) -> (usize, usize) {
        let (free, total) = self.info();
        (usable(free), usable(total))
    }

    /// [`room`](Self::room) for a `cuMemAlloc`, which short of memory takes what the driver
    /// pools keep ([`release_pools`](Self::release_pools)): that memory counts as free.
    pub(crate) fn room_for_malloc(&self) -> (usize, usize) {
        // Gathered under the registry's lock, each pool's lock taken after it and let go
        // before the memory's is (the order of `release_pools`).
        let pools: Vec<Arc<SimPool>> = {
            let pools = self.pools.lock().unwrap_or_else(|e| e.into_inner());
            pools.iter().filter_map(Weak::upgrade).collect()
        };
        let kept: usize = pools.iter().map(|pool| pool.state().kept_bytes).sum();
        let (free, total) = self.info();
        (usable(free.saturating_add(kept).min(total)), usable(total))
    }

    fn read(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn alloc(&self, bytes: usize) -> Result<u64> {
        self.alloc_as(bytes, false)
    }

    /// As [`alloc`](Self::alloc), for managed memory (`cuMemAllocManaged`).
    pub(crate) fn alloc_managed(&self, bytes: usize) -> Result<u64> {
        self.alloc_as(bytes, true)
    }

    fn alloc_as(&self, bytes: usize, managed: bool) -> Result<u64> {
        if bytes == 0 {
            return Err(Error::InvalidSize {
                size: 0,
                reason: "a device allocation needs at least one byte",
            });
        }
        let rounded = bytes
            .checked_next_multiple_of(ALIGN as usize)
            .ok_or(Error::InvalidSize {
                size: bytes,
                reason: "the size overflows when rounded up to the allocation granularity",
            })?;
        let mut state = self.write();
        let free = self.total - state.used;
        // In whole blocks: what a request can be granted (the bytes themselves were reported,
        // so a 1,000-byte device refused `malloc(1000)` with 1,000 available).
        let oom = Error::OutOfMemory {
            requested: bytes,
            available: usable(free),
            maximum: usable(self.total),
        };
        if rounded > free {
            return Err(oom);
        }
        // Within this device's address range, like every allocation of it. No room there (live
        // blocks and their guard gaps fill it) is out of memory too: the room comes back as
        // memory is freed.
        let base = state.place(rounded as u64, ALIGN).ok_or(oom.clone())?;
        // The host bytes behind it: a large block as a reservation's (no swap reserved), so
        // that the device's promise holds, host memory only for the pages touched; from the
        // heap, a single block larger than the host's memory and swap was refused, and
        // reported as the device out of memory with the device's numbers, so that a request
        // that could never be served looked worth waiting for (a review found
        // `DeviceBuffer::alloc` waiting for ever). Whatever the host still refuses is its own
        // error, not the device's.
        let storage = if rounded >= LARGE_BLOCK {
            HostBytes::reserved(rounded)
        } else {
            HostBytes::zeroed(rounded)
        }
        .ok_or(Error::HostOutOfMemory { requested: rounded })?;
        state.next = base + rounded as u64 + GUARD;
        state.used += rounded;
        state.blocks.insert(
            base,
            Arc::new(Block {
                base,
                bytes: storage,
                mapping: None,
                managed,
            }),
        );
        Ok(base)
    }

    /// Whether `ptr` is the start of a live allocation whose free is not queued already (what
    /// `free` and `begin_free` accept).
    pub(crate) fn is_allocation(&self, ptr: u64) -> bool {
        let state = self.read();
        state.is_allocated(ptr) && !state.freeing.contains(&ptr)
    }

    /// Frees `ptr` now (`cuMemFree` of an idle device). `InvalidAddress` for anything but a
    /// live allocation whose free is not queued already.
    pub(crate) fn free(&self, ptr: u64) -> Result<()> {
        let mut state = self.write();
        if state.freeing.contains(&ptr) || !state.is_allocated(ptr) {
            return Err(Error::InvalidAddress { ptr, bytes: 0 });
        }
        Self::remove(&mut state, ptr)
    }

    /// A free of `ptr` is being queued on a stream (`Op::Free`, which [`end_free`] completes
    /// when the stream reaches it). The allocation is marked now, not when the stream gets
    /// there, so that a second free of it is refused at once, as the driver refuses it, instead
    /// of being accepted and failing on the stream, which would poison the stream.
    /// `UnknownPointer` for anything but a live allocation whose free is not queued already.
    ///
    /// [`end_free`]: Self::end_free
    pub(crate) fn begin_free(&self, ptr: u64) -> Result<()> {
        let mut state = self.write();
        if !state.is_allocated(ptr) || !state.freeing.insert(ptr) {
            return Err(Error::UnknownPointer { ptr, bytes: 0 });
        }
        Ok(())
    }

    /// The stream reached the free of `ptr` that [`begin_free`](Self::begin_free) marked.
    pub(crate) fn end_free(&self, ptr: u64) -> Result<()> {
        let mut state = self.write();
        state.freeing.remove(&ptr);
        Self::remove(&mut state, ptr)
    }

    fn remove(state: &mut State, ptr: u64) -> Result<()> {
        if !state.is_allocated(ptr) {
            return Err(Error::InvalidAddress { ptr, bytes: 0 });
        }
        if let Some(block) = state.blocks.remove(&ptr) {
            state.used -= block.bytes.len();
        }
        Ok(())
    }

    /// The memory that holds all of `[ptr, ptr + len)`, for device work: a live block of this
    /// device, or else page-locked host memory of any simulated device (`cuMemHostAlloc` with
    /// `PORTABLE | DEVICEMAP`: under unified addressing its device address is the host
    /// address, usable by every device's work). A review found every device operation on
    /// pinned memory failing here with `InvalidAddress`, which poisoned the stream.
    fn bytes(&self, ptr: u64, len: usize) -> Result<Bytes> {
        match self.block(ptr, len) {
            Ok(block) => Ok(Bytes::Device(block)),
            Err(e) => host_block(ptr, len).map(Bytes::Host).ok_or(e),
        }
    }

    /// Whether all of `[ptr, ptr + len)` is memory known not to be managed: a block of this
    /// device from anything but `cuMemAllocManaged`, or page-locked host memory. `false` for
    /// managed memory and for what this device does not know (another device's memory).
    pub(crate) fn is_unmanaged(&self, ptr: u64, len: usize) -> bool {
        match self.block(ptr, len) {
            Ok(block) => !block.managed,
            Err(_) => host_block(ptr, len).is_some(),
        }
    }

    /// The live block that holds all of `[ptr, ptr + len)`.
    pub(crate) fn block(&self, ptr: u64, len: usize) -> Result<Arc<Block>> {
        let bad = Error::InvalidAddress { ptr, bytes: len };
        let state = self.read();
        let (_, block) = state.blocks.range(..=ptr).next_back().ok_or(bad.clone())?;
        let end = ptr.checked_add(len as u64).ok_or(bad.clone())?;
        if end > block.base + block.bytes.len() as u64 {
            return Err(bad);
        }
        if let Some(mapping) = &block.mapping {
            mapping.check(block.base, ptr, len)?;
        }
        Ok(block.clone())
    }

    /// Runs `f` on the bytes of `[ptr, ptr + len)`. Zero bytes are no memory, at any address
    /// (CUDA takes zero-byte work as a no-op): `f` gets an empty slice. A review found a
    /// zero-byte copy into an empty buffer (at null) failing here, which poisoned its stream.
    pub(crate) fn with<R>(
        &self,
        ptr: u64,
        len: usize,
        f: impl FnOnce(&[DataByte]) -> R,
    ) -> Result<R> {
        if len == 0 {
            return Ok(f(&[]));
        }
        let bytes = self.bytes(ptr, len)?;
        Ok(f(bytes.range(ptr, len)))
    }

    /// Copies `bytes` bytes from `src` to `dst`, each inside a live block or page-locked host
    /// memory (nothing, at any addresses, for zero bytes, as [`with`](Self::with)).
    pub(crate) fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let (from, to) = (self.bytes(src, bytes)?, self.bytes(dst, bytes)?);
        for (d, s) in to.range(dst, bytes).iter().zip(from.range(src, bytes)) {
            d.store(s.load(Relaxed), Relaxed);
        }
        Ok(())
    }
}

// ===== virtual memory (the rest is in sim/vmm.rs) =====

impl SimMemory {
    /// Reserves `size` bytes of address space starting at a multiple of `align` (0 or 1: any
    /// address), backed by lazily zeroed host memory that costs nothing until touched, however
    /// large ([`HostBytes::reserved`]); only the granules `mapping` marks as mapped may be
    /// accessed. Counts nothing against the device's memory (mapping does, through `charge`).
    /// `OutOfMemory` with the room left in this device's address range if `size` does not
    /// fit there, and with nothing available if the host refuses the range.
    pub(crate) fn reserve(&self, size: usize, align: u64, mapping: Arc<Granules>) -> Result<u64> {
        let oom = |available| Error::OutOfMemory {
            requested: size,
            available,
            maximum: ADDRESS_SPACE as usize,
        };
        let mut state = self.write();
        // Within this device's address range (16 TiB), like every allocation of it.
        let left = state.end.saturating_sub(state.next) as usize;
        let base = state.place(size as u64, align.max(1)).ok_or(oom(left))?;
        let storage = HostBytes::reserved(size).ok_or(oom(0))?;
        state.next = base + size as u64 + GUARD;
        let block = Block {
            base,
            bytes: storage,
            mapping: Some(mapping),
            managed: false,
        };
        state.blocks.insert(base, Arc::new(block));
        Ok(base)
    }

    /// Gives a reservation's address range back (its granules are unmapped by then).
    pub(crate) fn unreserve(&self, base: u64) {
        self.write().blocks.remove(&base);
    }

    /// Counts `bytes` of physical memory as used (`cuMemCreate`), or `OutOfMemory` if the
    /// device has less even once the driver pools have given back what they keep (as the
    /// driver does for a `cuMemCreate` short of memory: run99, see
    /// [`release_pools`](Self::release_pools)).
    pub(crate) fn charge(&self, bytes: usize) -> Result<()> {
        match self.try_charge(bytes) {
            Err(e) if e.is_out_of_memory() && self.release_pools() => self.try_charge(bytes),
            other => other,
        }
    }

    fn try_charge(&self, bytes: usize) -> Result<()> {
        let mut state = self.write();
        let available = self.total - state.used;
        if bytes > available {
            return Err(Error::OutOfMemory {
                requested: bytes,
                available,
                maximum: self.total,
            });
        }
        state.used += bytes;
        Ok(())
    }

    /// Gives back what `charge` counted.
    pub(crate) fn uncharge(&self, bytes: usize) {
        let mut state = self.write();
        state.used = state.used.saturating_sub(bytes);
    }
}

impl SimMemory {
    /// Copies `bytes` bytes from `src` in `from` (another device's memory) to `dst` in this
    /// one: a copy between simulated GPUs (nothing for zero bytes). Either side may be
    /// page-locked host memory, as for [`copy`](Self::copy).
    pub(crate) fn copy_from(
        &self,
        dst: u64,
        from: &SimMemory,
        src: u64,
        bytes: usize,
    ) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        let (source, to) = (from.bytes(src, bytes)?, self.bytes(dst, bytes)?);
        for (d, s) in to.range(dst, bytes).iter().zip(source.range(src, bytes)) {
            d.store(s.load(Relaxed), Relaxed);
        }
        Ok(())
    }
}

// ===== page-locked host memory =====

/// Memory that device work touches ([`SimMemory::bytes`]).
enum Bytes {
    Device(Arc<Block>),
    Host(Arc<HostBlock>),
}

impl Bytes {
    /// The bytes of `[ptr, ptr + len)`, which must lie inside this memory.
    fn range(&self, ptr: u64, len: usize) -> &[DataByte] {
        match self {
            Bytes::Device(block) => block.range(ptr, len),
            Bytes::Host(block) => block.range(ptr, len),
        }
    }
}

/// One host allocation: the pointer the global allocator returned and its layout, the
/// address handed out and its length, and the [`SimHostMemory`] that made it. Freed when the
/// last reference goes: the table's, or that of device work still running on it (a free
/// while work uses the memory breaks the free's contract, but frees nothing under it).
struct HostBlock {
    base: *mut u8,
    layout: Layout,
    /// The address handed out (inside the allocation, 256-aligned) and its bytes.
    ptr: u64,
    len: usize,
    owner: u64,
}

// SAFETY: a `HostBlock` owns its allocation; the bytes are only read or written through
// `range`, as atomics, and the pointer is otherwise only used to give the memory back to the
// global allocator, once, on drop.
unsafe impl Send for HostBlock {}
// SAFETY: as above; `&HostBlock` gives access to the bytes only as atomics.
unsafe impl Sync for HostBlock {}

impl HostBlock {
    /// The bytes of `[ptr, ptr + len)`, which must lie inside `[self.ptr, self.ptr + self.len)`.
    fn range(&self, ptr: u64, len: usize) -> &[DataByte] {
        let inside = (ptr.checked_sub(self.ptr))
            .and_then(|offset| offset.checked_add(len as u64))
            .is_some_and(|end| end <= self.len as u64);
        assert!(inside, "a host range outside its block");
        let at = self.ptr as usize + (ptr - self.ptr) as usize;
        // SAFETY: `[at, at + len)` lies inside the live allocation (checked above; the block
        // is freed only on drop, after this borrow). `DataByte` (`AtomicU8`) has the size and
        // alignment of `u8`, and is written only through shared references, as atomics. Host
        // code that writes the bytes while device work uses them without waiting for it is a
        // data race in the user's program (its `unsafe` use of the host pointer), as on a GPU.
        unsafe { std::slice::from_raw_parts(at as *const DataByte, len) }
    }
}

impl Drop for HostBlock {
    fn drop(&mut self) {
        // SAFETY: `base` was allocated by the global allocator with exactly this layout, and
        // a block is dropped once: the last reference to it is gone.
        unsafe { std::alloc::dealloc(self.base, self.layout) };
    }
}

/// Every simulated device's live page-locked host allocations, by the address handed out:
/// one table, since device work on any simulated device may use them (they are `PORTABLE`).
/// A plain lock (loom never models the memory), never held while another is taken.
static HOST_BLOCKS: RwLock<BTreeMap<u64, Arc<HostBlock>>> = RwLock::new(BTreeMap::new());

fn host_blocks() -> RwLockReadGuard<'static, BTreeMap<u64, Arc<HostBlock>>> {
    HOST_BLOCKS.read().unwrap_or_else(|e| e.into_inner())
}

fn host_blocks_mut() -> RwLockWriteGuard<'static, BTreeMap<u64, Arc<HostBlock>>> {
    HOST_BLOCKS.write().unwrap_or_else(|e| e.into_inner())
}

/// The live page-locked host allocation that holds all of `[ptr, ptr + len)`.
fn host_block(ptr: u64, len: usize) -> Option<Arc<HostBlock>> {
    let end = ptr.checked_add(len as u64)?;
    let blocks = host_blocks();
    let (_, block) = blocks.range(..=ptr).next_back()?;
    (end <= block.ptr + block.len as u64).then(|| block.clone())
}

/// Alignment of the simulated device's host allocations (what `ALIGNMENT` promises).
const HOST_ALIGN: usize = 256;

/// The simulated device's "page-locked" host memory: ordinary host memory from the global
/// allocator, 256-aligned, recorded in a table (by the address handed out) so that `free`
/// rejects a pointer this device did not hand out instead of corrupting the heap, and so that
/// device work may use it ([`SimMemory::bytes`]). Allocations come from `calloc`, so large ones
/// cost nothing until they are touched.
pub(crate) struct SimHostMemory {
    /// Which allocations of the process-wide table are this device's.
    id: u64,
}

impl SimHostMemory {
    pub(crate) fn new() -> Self {
        static IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Self {
            id: IDS.fetch_add(1, Relaxed),
        }
    }

    /// `bytes` zeroed host bytes at a 256-aligned address, or `OutOfMemory` (with `available`
    /// and `maximum` left for the caller to fill in) when the host cannot provide them.
    pub(crate) fn alloc(&self, bytes: usize) -> Result<*mut u8> {
        let oom = Error::OutOfMemory {
            requested: bytes,
            available: 0,
            maximum: 0,
        };
        // Alignment 1 so that the allocator takes the `calloc` path (lazy zero pages for large
        // sizes); the alignment is made by hand inside the slack.
        let layout = bytes
            .checked_add(HOST_ALIGN - 1)
            .and_then(|size| Layout::from_size_align(size, 1).ok())
            .ok_or(oom.clone())?;
        // SAFETY: `layout` has a non-zero size (at least HOST_ALIGN - 1 bytes).
        let base = unsafe { std::alloc::alloc_zeroed(layout) };
        if base.is_null() {
            return Err(oom);
        }
        let offset = (base as usize).next_multiple_of(HOST_ALIGN) - base as usize;
        // SAFETY: `offset < HOST_ALIGN`, and the allocation has `bytes + HOST_ALIGN - 1` bytes,
        // so `base + offset` and the `bytes` after it lie inside it.
        let ptr = unsafe { base.add(offset) };
        let block = HostBlock {
            base,
            layout,
            ptr: ptr as u64,
            len: bytes,
            owner: self.id,
        };
        host_blocks_mut().insert(ptr as u64, Arc::new(block));
        Ok(ptr)
    }

    /// Whether `ptr` is a live allocation of this memory's `alloc`.
    pub(crate) fn owns(&self, ptr: *mut u8) -> bool {
        host_blocks()
            .get(&(ptr as u64))
            .is_some_and(|block| block.owner == self.id)
    }

    /// Frees an allocation of `alloc`; `InvalidAddress` for any other pointer.
    pub(crate) fn free(&self, ptr: *mut u8) -> Result<()> {
        let mut blocks = host_blocks_mut();
        match blocks.get(&(ptr as u64)) {
            Some(block) if block.owner == self.id => {
                // Freed after the table's lock, or by the device work still using it once it
                // has run.
                let block = blocks.remove(&(ptr as u64));
                drop(blocks);
                drop(block);
                Ok(())
            }
            _ => Err(Error::InvalidAddress {
                ptr: ptr as u64,
                bytes: 0,
            }),
        }
    }
}

impl Drop for SimHostMemory {
    fn drop(&mut self) {
        // The device is gone, so nothing can use the memory through it any more. The blocks
        // leave the table under its lock and are freed after it.
        let mut gone = Vec::new();
        host_blocks_mut().retain(|_, block| {
            let keep = block.owner != self.id;
            if !keep {
                gone.push(block.clone());
            }
            keep
        });
        drop(gone);
    }
}

// ===== driver memory pools =====

/// A driver memory pool of the simulated device, as `cuMemPoolCreate` makes one.
///
/// Allocations come from the device's memory at once. A free is queued on its stream
/// (`Op::PoolFree`; the block leaves the live table then, so a second free is refused at once,
/// as the driver refuses it) and takes effect when the stream reaches it: the block is then
/// *kept* by the
/// pool (still allocated in device memory, so it counts against the device's free memory, as a
/// driver pool's reserved memory does) and reused for a later allocation of the same rounded
/// size, on any stream: its freeing stream has already run every use of it. Kept blocks go back
/// to the device when the pool holds more than its release threshold (checked at each free,
/// where the driver checks at synchronizations), on `trim_to` (only while at least its `keep`
/// stays reserved, as the driver's), when an allocation would not fit otherwise, and when the
/// pool is destroyed.
///
/// `reserved` = `used` + kept bytes; both count whole blocks (sizes rounded up to the
/// simulated allocation granularity).
pub(crate) struct SimPool {
    memory: Arc<SimMemory>,
    state: RwLock<PoolState>,
}

struct PoolState {
    /// Live allocations: address to rounded size.
    live: FxHashMap<u64, usize>,
    /// Allocations whose free is queued on a stream ([`SimPool::begin_free`]) and has not
    /// run yet: address to rounded size. Still counted in `used`.
    freeing: FxHashMap<u64, usize>,
    /// Freed blocks whose free the stream has reached, by rounded size.
    kept: BTreeMap<usize, Vec<u64>>,
    used: usize,
    kept_bytes: usize,
    release_threshold: u64,
    /// The most the pool may hold (`usize::MAX`: only the device's memory limits it).
    maximum: usize,
    /// Once destroyed, blocks whose free arrives later go straight back to the device.
    destroyed: bool,
    /// The device's race detector, if it is on: told when a kept block goes back to the
    /// device, so that it forgets the block as it forgets other frees.
    detector: Option<Weak<dyn PoolReleases>>,
}

impl PoolState {
    fn reserved(&self) -> usize {
        self.used + self.kept_bytes
    }

    /// Gives kept blocks back to the device, largest first, until `reserved() <= keep` or none
    /// is left.
    fn release_until(&mut self, memory: &SimMemory, keep: usize) {
        while self.reserved() > keep {
            let Some(mut entry) = self.kept.last_entry() else {
                return;
            };
            let size = *entry.key();
            let ptr = entry.get_mut().pop();
            if entry.get().is_empty() {
                entry.remove();
            }
            if let Some(ptr) = ptr {
                self.kept_bytes -= size;
                // Cannot fail: kept blocks are live allocations of `memory`, owned by the pool.
                let _ = memory.free(ptr);
                self.released(ptr);
            }
        }
    }

    /// `cuMemPoolTrimTo`: gives kept blocks back, largest first, but only a block whose release
    /// leaves at least `keep` bytes reserved. The driver: "If the pool has less than
    /// minBytesToKeep reserved, the TrimTo operation is a no-op. Otherwise the pool will be
    /// guaranteed to have at least minBytesToKeep bytes reserved after the operation." A trim
    /// once went through [`release_until`](Self::release_until), which stops only at or below
    /// `keep` and so could end far below it (a kept block of 4 MiB and one of 1 MiB, trimmed
    /// to 2 MiB, left none; a review's finding). The release threshold, the room an
    /// allocation needs under the maximum and a device allocation short of memory still give
    /// back down to at most their bound.
    fn trim_keeping(&mut self, memory: &SimMemory, keep: usize) {
        // Largest first; a size that would pass below `keep` is skipped for smaller ones,
        // which may still fit above it.
        let sizes: Vec<usize> = self.kept.keys().rev().copied().collect();
        for size in sizes {
            while self.reserved().saturating_sub(size) >= keep {
                let Some(blocks) = self.kept.get_mut(&size) else {
                    break;
                };
                let ptr = blocks.pop();
                if blocks.is_empty() {
                    self.kept.remove(&size);
                }
                let Some(ptr) = ptr else {
                    break;
                };
                self.kept_bytes -= size;
                // Cannot fail: kept blocks are live allocations of `memory`, owned by the pool.
                let _ = memory.free(ptr);
                self.released(ptr);
            }
        }
    }

    /// Tells the race detector that the block at `ptr` went back to the device.
    fn released(&self, ptr: u64) {
        if let Some(detector) = self.detector.as_ref().and_then(Weak::upgrade) {
            detector.released_by_pool(ptr);
        }
    }
}

impl SimPool {
    /// A pool on `memory`, known to it so that a device allocation short of memory can take
    /// what the pool keeps ([`SimMemory::release_pools`]).
    pub(crate) fn create(
        memory: &Arc<SimMemory>,
        release_threshold: u64,
        maximum: usize,
    ) -> Arc<Self> {
        let pool = Arc::new(Self::new(memory.clone(), release_threshold, maximum));
        let mut pools = memory.pools.lock().unwrap_or_else(|e| e.into_inner());
        pools.retain(|p| p.strong_count() > 0);
        pools.push(Arc::downgrade(&pool));
        pool
    }

    fn new(memory: Arc<SimMemory>, release_threshold: u64, maximum: usize) -> Self {
        let detector = memory.pool_releases.get().cloned();
        Self {
            memory,
            state: RwLock::new(PoolState {
                live: FxHashMap::default(),
                freeing: FxHashMap::default(),
                kept: BTreeMap::new(),
                used: 0,
                kept_bytes: 0,
                release_threshold,
                maximum,
                destroyed: false,
                detector,
            }),
        }
    }

    fn state(&self) -> RwLockWriteGuard<'_, PoolState> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    /// (reserved, used) bytes.
    pub(crate) fn counters(&self) -> (usize, usize) {
        let state = self.state();
        (state.reserved(), state.used)
    }

    pub(crate) fn release_threshold(&self) -> u64 {
        self.state().release_threshold
    }

    pub(crate) fn set_release_threshold(&self, threshold: u64) {
        let mut state = self.state();
        state.release_threshold = threshold;
        let keep = usize::try_from(threshold).unwrap_or(usize::MAX);
        state.release_until(&self.memory, keep);
    }

    pub(crate) fn alloc(&self, bytes: usize) -> Result<u64> {
        let rounded = bytes
            .checked_next_multiple_of(ALIGN as usize)
            .ok_or(Error::InvalidSize {
                size: bytes,
                reason: "the size overflows when rounded up to the allocation granularity",
            })?;
        let mut state = self.state();
        if let Some(blocks) = state.kept.get_mut(&rounded) {
            if let Some(ptr) = blocks.pop() {
                if blocks.is_empty() {
                    state.kept.remove(&rounded);
                }
                state.kept_bytes -= rounded;
                state.used += rounded;
                state.live.insert(ptr, rounded);
                return Ok(ptr);
            }
        }
        if state.used.saturating_add(rounded) > state.maximum {
            return Err(Error::OutOfMemory {
                requested: bytes,
                available: state.maximum - state.used,
                maximum: state.maximum,
            });
        }
        // Make room under the maximum from kept blocks of other sizes.
        let room = state.maximum - rounded;
        state.release_until(&self.memory, room);
        let ptr = match self.memory.alloc(bytes) {
            Ok(ptr) => ptr,
            Err(e) if e.is_out_of_memory() && state.kept_bytes > 0 => {
                // What the pool keeps is the device's too: give it back and try again.
                let used = state.used;
                state.release_until(&self.memory, used);
                self.memory.alloc(bytes)?
            }
            Err(e) => return Err(e),
        };
        state.used += rounded;
        state.live.insert(ptr, rounded);
        Ok(ptr)
    }

    /// A free of `ptr` is being queued on a stream (`Op::PoolFree`, which [`free`] completes
    /// when the stream reaches it). The block leaves the live table now, not when the stream
    /// gets there, so that a second free of it is refused at once, as the driver refuses it,
    /// instead of being accepted and failing on the stream, which would poison the stream.
    /// `UnknownPointer` for anything but a live allocation of this pool.
    ///
    /// [`free`]: Self::free
    pub(crate) fn begin_free(&self, ptr: u64) -> Result<()> {
        let mut state = self.state();
        let size = state
            .live
            .remove(&ptr)
            .ok_or(Error::UnknownPointer { ptr, bytes: 0 })?;
        state.freeing.insert(ptr, size);
        Ok(())
    }

    /// The stream reached the free of `ptr` that [`begin_free`](Self::begin_free) queued.
    pub(crate) fn free(&self, ptr: u64) -> Result<()> {
        let mut state = self.state();
        let size = state
            .freeing
            .remove(&ptr)
            .ok_or(Error::InvalidAddress { ptr, bytes: 0 })?;
        state.used -= size;
        if state.destroyed {
            let freed = self.memory.free(ptr);
            state.released(ptr);
            return freed;
        }
        state.kept.entry(size).or_default().push(ptr);
        state.kept_bytes += size;
        let keep = usize::try_from(state.release_threshold).unwrap_or(usize::MAX);
        state.release_until(&self.memory, keep);
        Ok(())
    }

    /// `cuMemPoolTrimTo`: gives kept blocks back while the pool still reserves at least `keep`
    /// bytes (see [`PoolState::trim_keeping`]).
    pub(crate) fn trim_to(&self, keep: usize) {
        self.state().trim_keeping(&self.memory, keep);
    }

    /// `cuMemPoolDestroy`: kept blocks go back now, live ones when their frees arrive.
    pub(crate) fn destroy(&self) {
        let mut state = self.state();
        state.destroyed = true;
        state.release_until(&self.memory, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A range with room for three blocks of 512 bytes and their guard gaps: a fourth is out of
    /// memory (never an address past the range's end, which is the next device's), and room
    /// freed between live blocks is handed out again once it fits, guard gap included.
    #[test]
    fn a_full_address_range_is_out_of_memory_and_freed_room_is_reused() {
        let memory = SimMemory::new(1 << 30);
        let start = {
            let mut state = memory.write();
            state.end = state.start + 3 * (ALIGN + GUARD);
            state.start
        };
        let step = ALIGN + GUARD;
        let blocks: Vec<u64> = (0..3)
            .map(|_| memory.alloc(ALIGN as usize).unwrap())
            .collect();
        assert_eq!(blocks, [start, start + step, start + 2 * step]);
        let full = memory.alloc(1);
        assert!(
            matches!(full, Err(Error::OutOfMemory { requested: 1, .. })),
            "{full:?}"
        );
        memory.free(blocks[1]).unwrap();
        // Its guard gap would reach the next block.
        let large = memory.alloc(2 * ALIGN as usize);
        assert!(matches!(large, Err(Error::OutOfMemory { .. })), "{large:?}");
        assert_eq!(memory.alloc(ALIGN as usize).unwrap(), blocks[1]);
        assert!(matches!(memory.alloc(1), Err(Error::OutOfMemory { .. })));
    }

    /// An out-of-memory error of the simulated device tells the truth: `available` is the
    /// largest request that succeeds now, `maximum` the largest that ever can, and a request
    /// of exactly `available` succeeds. Memory goes in blocks of 512 bytes, so 1,000 bytes
    /// hold one: `malloc(1000)` was refused with `available: 1000, maximum: 1000`.
    #[test]
    fn out_of_memory_numbers_are_requests_that_succeed() {
        use crate::device::{DevicePtr, SimConfig, SimExecution};
        let device = crate::Device::simulated(SimConfig {
            total_memory: 1000,
            execution: SimExecution::Inline,
            ..SimConfig::default()
        });
        let oom = |r: Result<DevicePtr>| match r {
            Err(Error::OutOfMemory {
                requested,
                available,
                maximum,
            }) => (requested, available, maximum),
            other => panic!("not out of memory: {other:?}"),
        };
        assert_eq!(oom(device.malloc(1000)), (1000, 512, 512));
        assert_eq!(oom(device.malloc_managed(600)), (600, 512, 512));
        let stream = device.create_stream().unwrap();
        assert_eq!(oom(device.malloc_async(513, &stream)), (513, 512, 512));
        // Exactly `available`: granted, and then nothing is left.
        let ptr = device.malloc(512).unwrap();
        assert_eq!(oom(device.malloc(1)), (1, 0, 512));
        // SAFETY: nothing uses it.
        unsafe { device.free(ptr) }.unwrap();
        let ptr = device.malloc_managed(512).unwrap();
        // SAFETY: nothing uses it.
        unsafe { device.free(ptr) }.unwrap();
    }

    /// A `malloc` short of memory takes what the driver pools keep (`release_pools`), so a
    /// request larger than the device, refused at once, counts that memory among what is
    /// available: `malloc` of all of it succeeds. It reported only the device's free memory,
    /// half of what a request could get here.
    #[test]
    fn out_of_memory_numbers_count_what_the_driver_pools_keep() {
        use crate::device::{SimConfig, SimExecution};
        use crate::resource::cuda_async::{CudaAsyncOptions, CudaAsyncResource};
        let device = crate::Device::simulated(SimConfig {
            total_memory: 4096,
            execution: SimExecution::Inline,
            ..SimConfig::default()
        });
        // Keeps 2,048 bytes, allocated and freed at once.
        let pool = CudaAsyncResource::new(
            &device,
            CudaAsyncOptions {
                release_threshold: None,
                initial_pool_size: Some(2048),
                ..CudaAsyncOptions::default()
            },
        )
        .unwrap();
        assert_eq!(
            device.free_memory().unwrap(),
            2048,
            "the pool keeps nothing"
        );
        match device.malloc(5000) {
            Err(Error::OutOfMemory {
                available, maximum, ..
            }) => assert_eq!((available, maximum), (4096, 4096)),
            other => panic!("not out of memory: {other:?}"),
        }
        // All of it: granted (the pool gives back what it kept).
        let ptr = device.malloc(4096).unwrap();
        // SAFETY: nothing uses it.
        unsafe { device.free(ptr) }.unwrap();
        drop(pool);
    }

    /// `cuMemAllocAsync` hands out an address again only once the free that gave it back has
    /// run (the simulated memory frees it when the stream reaches the free), so its reuse on
    /// another stream is ordered by the device, as a driver pool's is. Once the sweep of
    /// addresses had come round, the race detector took such a reuse for a block handed out
    /// before its free on another stream (a false `ReuseBeforeFree`).
    #[test]
    fn an_address_the_device_gives_again_after_its_free_ran_is_no_race() {
        use super::super::{Op, RaceDetection, SimConfig, SimDevice, SimExecution};
        use crate::device::StreamId;
        let device = SimDevice::new(
            SimConfig {
                race_detection: RaceDetection::Record,
                execution: SimExecution::Inline,
                ..SimConfig::default()
            },
            None,
        );
        {
            // Room for two blocks: the third allocation comes round to the first's address.
            let mut state = device.memory.write();
            state.end = state.start + 2 * (ALIGN + GUARD);
        }
        let a = device.create_stream(StreamId::next()).unwrap();
        let b = device.create_stream(StreamId::next()).unwrap();
        let first = device.malloc_async(512, &a).unwrap();
        device.memory.begin_free(first).unwrap();
        // Inline: the free runs now, and the address is free again.
        a.push(Op::Free(first)).unwrap();
        let _second = device.malloc_async(512, &b).unwrap();
        let third = device.malloc_async(512, &b).unwrap();
        assert_eq!(third, first);
        let races = device.races.as_ref().unwrap().races();
        assert!(races.is_empty(), "{races:?}");
    }

    /// As for `cuMemAllocAsync`: a reservation (`cuMemAddressReserve`) gets an address range
    /// again only once the frees that gave it back have run, so a block a pool hands out in
    /// it is no reuse of what was freed there before. It was checked against the old free's
    /// stream order, and reported as reused before its free on another stream.
    #[test]
    fn a_reservation_over_freed_addresses_is_no_race() {
        use super::super::granules::GRANULE;
        use super::super::vmm::SimReservation;
        use super::super::{Op, RaceDetection, SimConfig, SimDevice, SimExecution};
        use crate::device::StreamId;
        let device = SimDevice::new(
            SimConfig {
                race_detection: RaceDetection::Record,
                execution: SimExecution::Inline,
                ..SimConfig::default()
            },
            None,
        );
        {
            // Room for one granule: the reservation comes round to the freed block's address.
            let mut state = device.memory.write();
            state.end = state.start + GRANULE as u64 + GUARD;
        }
        let a = device.create_stream(StreamId::next()).unwrap();
        let b = device.create_stream(StreamId::next()).unwrap();
        let freed = device.malloc_async(GRANULE, &a).unwrap();
        device.memory.begin_free(freed).unwrap();
        // Inline: the free runs now, and the addresses are free again.
        a.push(Op::Free(freed)).unwrap();
        let reservation = SimReservation::new(&device, GRANULE, GRANULE).unwrap();
        assert_eq!(reservation.base(), freed);
        reservation.map(&device, 0, 1).unwrap();
        device.note_allocation(freed, 4096, &b);
        let races = device.races.as_ref().unwrap().races();
        assert!(races.is_empty(), "{races:?}");
    }
}
