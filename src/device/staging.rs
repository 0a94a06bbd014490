//! Page-locked staging blocks for host↔device copies that must not block the host.
//!
//! From ordinary (pageable) host memory the driver's copies can block the calling thread (a
//! device-to-host copy returns only once it has run). The buffers' copies go through these
//! blocks instead. The cache lives in the device and holds only raw blocks (a resource would
//! hold a `Device`, a cycle that would keep the device alive forever); a block goes back to it
//! once the copy that used it has completed (`Event::on_complete`), never before.
//!
//! ## Where blocks are freed
//!
//! The completion callback that gives a block back runs on the device's reactor thread, where
//! no blocking driver call may run (`cuMemFreeHost` may wait for the device, and every wake-up
//! of the device would stall behind it). So the callback only files the block: in the cache,
//! or, when the cache already holds [`MAX_CACHED`] bytes, in a list of *retired* blocks. Retired
//! blocks are freed by the next staging call on a user's thread (a copy to or from the device,
//! which may pin memory anyway), or reused by it if one has the size it needs, or freed when
//! the device is dropped. A user thread that gives a block back directly (no copy pending on
//! it) frees an excess block at once.
//!
//! The two calls that give a block back behind an event or a stream are the stream layer's
//! (`stream/staging.rs`): the device layer does not name streams or events.
//!
//! A block whose copy may be queued but whose event could not be recorded goes back behind a
//! later event of the same stream; if no event can be recorded at all (the stream or the
//! context is broken) it is leaked rather than reused under a copy that may still write it.

use crate::error::Result;
use crate::sync::Mutex;

/// Blocks are cached in power-of-two sizes from this one up; larger blocks are multiples of it.
const MIN_BLOCK: usize = 4096;
/// The most a device keeps cached; beyond it, a returned block is freed.
const MAX_CACHED: usize = 64 << 20;

/// A pinned host block of `size` bytes (a power of two up to [`MAX_CACHED`], a multiple of
/// [`MIN_BLOCK`] beyond).
#[derive(Debug)]
pub(crate) struct StagingBlock {
    pub(crate) ptr: *mut u8,
    pub(crate) size: usize,
}

// SAFETY: a block is plain page-locked host memory; whoever holds the `StagingBlock` owns it
// exclusively (it is in the cache, retired, or with exactly one copy, never two of these).
unsafe impl Send for StagingBlock {}

/// The cached blocks. Only read or written under `Staging::free`'s lock; no driver call is made
/// under it.
#[derive(Default)]
struct Cache {
    /// Free blocks by size class (log2 of the size).
    classes: Vec<Vec<StagingBlock>>,
    /// Bytes in `classes`.
    bytes: usize,
    /// Blocks given back on the reactor thread when the cache was full: to be freed (or reused)
    /// by a user thread.
    retired: Vec<StagingBlock>,
}

#[derive(Default)]
pub(crate) struct Staging {
    free: Mutex<Cache>,
}

impl Staging {
    /// The size of block that serves `bytes`: a power of two up to [`MAX_CACHED`], the sizes
    /// the cache holds. A larger block is never cached (it is freed, or retired and reused
    /// only by a request it fits), so it is rounded up to a multiple of [`MIN_BLOCK`] only:
    /// rounding it up to a power of two pinned up to twice the copy's size, and could fail a
    /// copy with `OutOfMemory` where the host had the memory it needs.
    fn block_size(bytes: usize) -> usize {
        let bytes = bytes.max(MIN_BLOCK);
        if bytes <= MAX_CACHED {
            bytes.next_power_of_two()
        } else {
            // A slice holds at most `isize::MAX` bytes, so this does not overflow; were it to,
            // the exact size still serves (never a smaller block).
            bytes.checked_next_multiple_of(MIN_BLOCK).unwrap_or(bytes)
        }
    }

    /// A cached (or retired) block that serves `bytes`, or `None`; and every other retired
    /// block, for the caller to free.
    fn take(&self, bytes: usize) -> (Option<StagingBlock>, Vec<StagingBlock>) {
        let size = Self::block_size(bytes);
        let mut free = self.free.lock();
        let mut retired = std::mem::take(&mut free.retired);
        // Only power-of-two sizes have a class: a larger size's trailing zeros name the class
        // of a smaller block.
        if size.is_power_of_two() {
            let class = size.trailing_zeros() as usize;
            if let Some(block) = free.classes.get_mut(class).and_then(Vec::pop) {
                free.bytes -= block.size;
                return (Some(block), retired);
            }
        }
        // A retired block it fits and does not waste half of (for a power of two, exactly
        // its size).
        let reuse = retired
            .iter()
            .position(|b| b.size >= size && b.size / 2 < size)
            .map(|at| retired.swap_remove(at));
        (reuse, retired)
    }

    /// Keeps `block` for reuse; hands it back if the cache is full.
    fn put(&self, block: StagingBlock) -> Option<StagingBlock> {
        let mut free = self.free.lock();
        Self::cache(&mut free, block)
    }

    /// Keeps `block` for reuse, or retires it if the cache is full. Never frees: for the
    /// reactor thread.
    pub(crate) fn put_or_retire(&self, block: StagingBlock) {
        let mut free = self.free.lock();
        if let Some(block) = Self::cache(&mut free, block) {
            free.retired.push(block);
        }
    }

    fn cache(free: &mut Cache, block: StagingBlock) -> Option<StagingBlock> {
        // Only power-of-two blocks have a class (a larger block is never one: see
        // `block_size`).
        if free.bytes + block.size > MAX_CACHED || !block.size.is_power_of_two() {
            return Some(block);
        }
        let class = block.size.trailing_zeros() as usize;
        if free.classes.len() <= class {
            free.classes.resize_with(class + 1, Vec::new);
        }
        free.bytes += block.size;
        free.classes[class].push(block);
        None
    }

    /// Bytes in retired blocks (held pinned until a staging call or the device's drop); for the
    /// tests that use it, which the loom build leaves out.
    #[cfg(all(test, not(streamalloc_loom)))]
    pub(crate) fn retired_bytes(&self) -> usize {
        self.free.lock().retired.iter().map(|b| b.size).sum()
    }

    /// Every cached and retired block, for freeing when the device goes away.
    pub(crate) fn drain(&self) -> Vec<StagingBlock> {
        let mut free = self.free.lock();
        free.bytes = 0;
        let mut blocks: Vec<StagingBlock> = free.classes.drain(..).flatten().collect();
        blocks.append(&mut free.retired);
        blocks
    }
}

impl super::Device {
    /// A pinned block of at least `bytes` for staging a copy: from the cache, else new. Frees
    /// the blocks the reactor retired meanwhile (this runs on a user's thread).
    pub(crate) fn staging_block(&self, bytes: usize) -> Result<StagingBlock> {
        let (block, retired) = self.inner.staging.take(bytes);
        self.free_staging(retired);
        if let Some(block) = block {
            return Ok(block);
        }
        let size = Staging::block_size(bytes);
        Ok(StagingBlock {
            ptr: self.malloc_host(size)?,
            size,
        })
    }

    /// Gives a block back at once: the caller knows no queued copy uses it any more. Frees it
    /// if the cache is full, so it must not run on the reactor thread.
    pub(crate) fn return_staging(&self, block: StagingBlock) {
        if let Some(block) = self.inner.staging.put(block) {
            self.free_staging([block]);
        }
    }

    /// Frees staging blocks (`cuMemFreeHost`, which may wait for the device): never on the
    /// reactor thread.
    fn free_staging(&self, blocks: impl IntoIterator<Item = StagingBlock>) {
        for block in blocks {
            debug_assert!(
                !crate::offload::on_reactor_thread(),
                "a staging block freed on the reactor thread"
            );
            // SAFETY: the block came from `malloc_host` of this device, was cached or retired
            // (so the copy that used it completed) and has just left the cache: nothing uses
            // it and it is freed once.
            if let Err(e) = unsafe { self.free_host(block.ptr) } {
                tracing::warn!(error = %e, "could not free a staging block");
            }
        }
    }
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use super::*;
    use crate::{Device, SimConfig};

    /// A block too large for the cache is never cached, so rounding it up to a power of two
    /// bought nothing and pinned up to twice the copy's size (a 33 GiB upload pinned 64 GiB, or
    /// failed with `OutOfMemory` on a host that had the 33).
    #[test]
    fn a_block_beyond_the_cache_pins_about_what_the_copy_needs() {
        let device = Device::simulated(SimConfig::default());
        let bytes = MAX_CACHED + 1;
        let block = device.staging_block(bytes).unwrap();
        assert!(block.size >= bytes);
        assert!(
            block.size < bytes + MIN_BLOCK,
            "{} bytes pinned to stage {bytes}",
            block.size
        );
        device.return_staging(block);
    }

    /// Blocks of the cache's sizes are still served from it, and a large block of a size that
    /// is no power of two is never taken for a small class (nor a small one for it).
    #[test]
    fn cached_and_retired_blocks_serve_only_requests_they_fit() {
        let device = Device::simulated(SimConfig::default());
        let small = device.staging_block(100).unwrap();
        assert_eq!(small.size, MIN_BLOCK);
        let small_ptr = small.ptr;
        device.return_staging(small);
        // A large request whose size has as many trailing zeros as the small class.
        let large = device.staging_block(MAX_CACHED + MIN_BLOCK).unwrap();
        assert!(large.size >= MAX_CACHED + MIN_BLOCK);
        // Given back on the reactor's path: the cache cannot hold it, so it is retired...
        device.inner.staging.put_or_retire(large);
        // ... and the small request still gets the small cached block.
        let small = device.staging_block(MIN_BLOCK).unwrap();
        assert_eq!((small.ptr, small.size), (small_ptr, MIN_BLOCK));
        device.return_staging(small);
        // The retired block serves a large request it fits.
        let large = device.staging_block(MAX_CACHED + 1).unwrap();
        let ptr = large.ptr;
        device.inner.staging.put_or_retire(large);
        let again = device.staging_block(MAX_CACHED + 2).unwrap();
        assert!(again.size >= MAX_CACHED + 2);
        assert_eq!(again.ptr, ptr);
        device.return_staging(again);
    }
}
