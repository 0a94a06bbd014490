//! A resource adaptor that lets the pool's invariant checker see the pool at rest.
//!
//! The pools' `check_invariants` reads each shard of the free memory under its own lock, one
//! after another. While other threads allocate, the shards read first can change before the
//! last is read (a block handed out from one and freed, a growth), and the check could see a
//! state the pool was never in. So every call into the pool takes a shared lock here, for that
//! call only (never across an `.await`: `allocate_async` retries through `allocate`), and the
//! checker takes it exclusively: it sees a state the pool was really in. Frees that the completion reactor runs (a buffer used on several streams) go through
//! here too, and wait the few milliseconds of a check.

use std::fmt;
use std::sync::RwLock;

use streamalloc::resource::snapshot::Snapshot;
use streamalloc::resource::{PoolStats, WaitStats};
use streamalloc::{
    Device, DevicePtr, ExpandablePoolResource, MemoryResource, MemoryWaiters, PoolResource, Result,
    Stream,
};

/// A resource with an invariant checker and the pool statistics: `PoolResource` and
/// `ExpandablePoolResource`.
pub trait Checked: MemoryResource + 'static {
    /// The resource's own invariant checker.
    fn check(&self) -> std::result::Result<(), String>;
    /// Its statistics.
    fn pool_stats(&self) -> PoolStats;
    /// What waiting for memory has cost.
    fn waits(&self) -> WaitStats;
    /// The most it may hold, as it took `--pool-mib` (the expandable pool rounds up to whole
    /// mapping units).
    fn maximum(&self) -> usize;
}

impl<U: MemoryResource + 'static> Checked for PoolResource<U> {
    fn check(&self) -> std::result::Result<(), String> {
        self.check_invariants()
    }
    fn pool_stats(&self) -> PoolStats {
        self.stats()
    }
    fn waits(&self) -> WaitStats {
        self.wait_stats()
    }
    fn maximum(&self) -> usize {
        self.maximum()
    }
}

impl Checked for ExpandablePoolResource {
    fn check(&self) -> std::result::Result<(), String> {
        self.check_invariants()
    }
    fn pool_stats(&self) -> PoolStats {
        self.stats()
    }
    fn waits(&self) -> WaitStats {
        self.wait_stats()
    }
    fn maximum(&self) -> usize {
        self.maximum()
    }
}

/// `inner`, with every allocate and free under a shared lock that [`Gate::at_rest`] takes
/// exclusively.
pub struct Gate<R> {
    inner: R,
    lock: RwLock<()>,
}

impl<R: fmt::Debug> fmt::Debug for Gate<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gate").field("inner", &self.inner).finish()
    }
}

impl<R: Checked> Gate<R> {
    pub fn new(inner: R) -> Self {
        Self {
            inner,
            lock: RwLock::new(()),
        }
    }

    pub fn inner(&self) -> &R {
        &self.inner
    }

    /// Runs the invariant checker with no allocate or free in progress. Blocks the calling
    /// thread for the check (a few milliseconds): call it off the async workers.
    pub fn check_at_rest(&self) -> std::result::Result<(), String> {
        let _alone = self.lock.write().unwrap_or_else(|e| e.into_inner());
        self.inner.check()
    }
}

// SAFETY: every allocation is the wrapped resource's (itself a `MemoryResource`), passed on
// unchanged.
unsafe impl<R: Checked> MemoryResource for Gate<R> {
    fn device(&self) -> &Device {
        self.inner.device()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        let _shared = self.lock.read().unwrap_or_else(|e| e.into_inner());
        self.inner.allocate(bytes, stream)
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        let _shared = self.lock.read().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the caller's contract, passed on unchanged.
        unsafe { self.inner.deallocate(ptr, bytes, stream) }
    }

    // The pool's own queue: `allocate_async` on the gate waits there, and the pool's frees
    // wake it.
    fn memory_waiters(&self) -> Option<&MemoryWaiters> {
        self.inner.memory_waiters()
    }

    fn memory_snapshot(&self) -> Option<Snapshot> {
        self.inner.memory_snapshot()
    }
}
