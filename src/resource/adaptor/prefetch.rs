//! [`PrefetchAdaptor`]: prefetches managed memory to the device after each allocation (RMM's
//! `prefetch_resource_adaptor`).

use std::fmt;

use crate::device::{Device, DevicePtr};
use crate::error::Result;
use crate::resource::{MemoryKind, MemoryResource, MemoryWaiters};
use crate::stream::Stream;
use crate::sync::{AtomicU64, Ordering};

/// After each allocation of managed memory, queues a prefetch of it to the device on the
/// allocation's stream (RMM's `prefetch_resource_adaptor`), so that the first kernel that
/// touches it does not fault its pages in one by one.
///
/// - Only when the upstream's [`memory_kind`](MemoryResource::memory_kind) is
///   [`MemoryKind::Managed`]: device memory is on the device already, and the driver's prefetch
///   rejects it. For other kinds it is a plain pass-through.
/// - The prefetch is stream-ordered (queued on the allocation's stream, the host does not wait)
///   and only a hint: if it cannot be queued, the allocation still succeeds and the failure is
///   logged with `tracing::warn!`. Zero-byte allocations are not prefetched.
///
/// The prefetch is [`Stream::prefetch`] (`cuMemPrefetchAsync` to the stream's device; nothing on
/// the simulated device).
pub struct PrefetchAdaptor<U: MemoryResource> {
    upstream: U,
    /// Prefetches requested (allocations of managed memory made through it).
    requested: AtomicU64,
}

impl<U: MemoryResource> fmt::Debug for PrefetchAdaptor<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrefetchAdaptor")
            .field("upstream", &self.upstream)
            .field("prefetches_requested", &self.prefetches_requested())
            .finish()
    }
}

impl<U: MemoryResource> PrefetchAdaptor<U> {
    /// Prefetches what `upstream` hands out, when it is managed memory.
    pub fn new(upstream: U) -> Self {
        Self {
            upstream,
            requested: AtomicU64::new(0),
        }
    }

    /// The upstream resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }

    /// How many allocations asked for a prefetch (managed memory, more than zero bytes).
    pub fn prefetches_requested(&self) -> u64 {
        self.requested.load(Ordering::Relaxed)
    }

    /// Queues the prefetch of `bytes` at `ptr` to the device on `stream`.
    fn prefetch(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.requested.fetch_add(1, Ordering::Relaxed);
        // SAFETY: `ptr` is managed memory just allocated from the upstream for `bytes`, which
        // the caller will free only in stream order after this point of `stream`.
        unsafe { stream.prefetch(ptr, bytes) }
    }
}

// SAFETY: every allocation is the upstream's (itself a `MemoryResource`), passed on unchanged;
// the adaptor only queues a prefetch.
unsafe impl<U: MemoryResource> MemoryResource for PrefetchAdaptor<U> {
    fn device(&self) -> &Device {
        self.upstream.device()
    }

    fn memory_kind(&self) -> MemoryKind {
        self.upstream.memory_kind()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        let ptr = self.upstream.allocate(bytes, stream)?;
        if bytes > 0 && self.upstream.memory_kind() == MemoryKind::Managed {
            if let Err(e) = self.prefetch(ptr, bytes, stream) {
                tracing::warn!(
                    ptr = ptr.0,
                    bytes,
                    error = %e,
                    "PrefetchAdaptor: the prefetch could not be queued; the memory is usable"
                );
            }
        }
        Ok(ptr)
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.upstream.deallocate(ptr, bytes, stream) }
    }

    fn memory_waiters(&self) -> Option<&MemoryWaiters> {
        self.upstream.memory_waiters()
    }

    fn footprint(&self, bytes: usize) -> Result<usize> {
        self.upstream.footprint(bytes)
    }

    fn check_set(&self, sizes: &[usize]) -> Result<()> {
        self.upstream.check_set(sizes)
    }
    fn memory_snapshot(&self) -> Option<crate::resource::snapshot::Snapshot> {
        self.upstream.memory_snapshot()
    }
}
