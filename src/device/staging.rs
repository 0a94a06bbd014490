//! Page-locked staging blocks for host↔device copies that must not block the host.
//!
//! From ordinary (pageable) host memory the driver's copies can block the calling thread (a
//! device-to-host copy returns only once it has run). The buffers' copies go through these
//! blocks instead. The cache lives in the device and holds only raw blocks (a resource would
//! hold a `Device`, a cycle that would keep the device alive forever); a block goes back to it
//! once the copy that used it has completed (`Event::on_complete`), never before.
//!
//! A block whose copy may be queued but whose event could not be recorded goes back behind a
//! later event of the same stream; if no event can be recorded at all (the stream or the
//! context is broken) it is leaked rather than reused under a copy that may still write it.

use crate::error::Result;
use crate::stream::Stream;
use crate::sync::Mutex;

/// Blocks are cached in power-of-two sizes from this one up.
const MIN_BLOCK: usize = 4096;
/// The most a device keeps cached; beyond it, a returned block is freed.
const MAX_CACHED: usize = 64 << 20;

/// A pinned host block of `size` bytes (a power of two).
#[derive(Debug)]
pub(crate) struct StagingBlock {
    pub(crate) ptr: *mut u8,
    pub(crate) size: usize,
}

// SAFETY: a block is plain page-locked host memory; whoever holds the `StagingBlock` owns it
// exclusively (it is in the cache or with exactly one copy, never both).
unsafe impl Send for StagingBlock {}

#[derive(Default)]
pub(crate) struct Staging {
    /// Free blocks by size (log2).
    free: Mutex<(Vec<Vec<StagingBlock>>, usize)>,
}

impl Staging {
    /// The size of block that serves `bytes`.
    fn block_size(bytes: usize) -> usize {
        bytes.max(MIN_BLOCK).next_power_of_two()
    }

    /// A cached block of at least `bytes`, or `None`.
    pub(crate) fn take(&self, bytes: usize) -> Option<StagingBlock> {
        let class = Self::block_size(bytes).trailing_zeros() as usize;
        let mut free = self.free.lock();
        let block = free.0.get_mut(class)?.pop()?;
        free.1 -= block.size;
        Some(block)
    }

    /// Keeps `block` for reuse, or hands it back to be freed if the cache is full.
    pub(crate) fn put(&self, block: StagingBlock) -> Option<StagingBlock> {
        let mut free = self.free.lock();
        if free.1 + block.size > MAX_CACHED {
            return Some(block);
        }
        let class = block.size.trailing_zeros() as usize;
        if free.0.len() <= class {
            free.0.resize_with(class + 1, Vec::new);
        }
        free.1 += block.size;
        free.0[class].push(block);
        None
    }

    /// Every cached block, for freeing when the device goes away.
    pub(crate) fn drain(&self) -> Vec<StagingBlock> {
        let mut free = self.free.lock();
        free.1 = 0;
        free.0.drain(..).flatten().collect()
    }
}

impl super::Device {
    /// A pinned block of at least `bytes` for staging a copy: from the cache, else new.
    pub(crate) fn staging_block(&self, bytes: usize) -> Result<StagingBlock> {
        if let Some(block) = self.inner.staging.take(bytes) {
            return Ok(block);
        }
        let size = Staging::block_size(bytes);
        Ok(StagingBlock {
            ptr: self.malloc_host(size)?,
            size,
        })
    }

    /// Gives a block back at once: the caller knows no queued copy uses it any more.
    pub(crate) fn return_staging(&self, block: StagingBlock) {
        if let Some(block) = self.inner.staging.put(block) {
            // SAFETY: the block came from `malloc_host` of this device and nothing uses it.
            if let Err(e) = unsafe { self.free_host(block.ptr) } {
                tracing::warn!(error = %e, "could not free a staging block");
            }
        }
    }

    /// Gives a block back once `event` completes (the copy that used it is queued before it).
    pub(crate) fn return_staging_after(&self, block: StagingBlock, event: &crate::Event) {
        let device = self.clone();
        event.on_complete(Box::new(move |_| device.return_staging(block)));
    }

    /// Gives a block back whose copy on `stream` may be queued but has no event after it (the
    /// record failed): behind a new event of `stream`, which the copy precedes. If that cannot
    /// be recorded either, the block is leaked (logged): reusing it could let the copy write
    /// into the next user's data.
    pub(crate) fn return_staging_after_queued(&self, block: StagingBlock, stream: &Stream) {
        match stream.record() {
            Ok(event) => self.return_staging_after(block, &event),
            Err(e) => tracing::error!(
                error = %e,
                bytes = block.size,
                "could not fence a staging block behind its copy; it is leaked"
            ),
        }
    }
}
