//! [`FailureCallbackAdaptor`]: a callback on out-of-memory that may free memory and ask for a
//! retry (RMM's `failure_callback_resource_adaptor`).

use std::fmt;

use crate::device::{Device, DevicePtr};
use crate::error::Result;
use crate::resource::{MemoryKind, MemoryResource, MemoryWaiters};
use crate::stream::Stream;
use crate::sync::{AtomicU64, Ordering};

/// The callback's type: called with the bytes requested, returns whether to try again.
type Callback = dyn Fn(usize) -> bool + Send + Sync;

/// Calls a callback when the upstream runs out of memory, and retries while it returns `true`
/// (RMM's `failure_callback_resource_adaptor`).
///
/// - On an out-of-memory error from the upstream ([`Error::is_out_of_memory`]: the crate's
///   `OutOfMemory` or the driver's), it calls `callback(bytes)` with the bytes requested. If
///   the callback returns `true` (it freed something, spilled a cache, waited...), the
///   allocation is tried again, and so on; when it returns `false`, the last error is returned.
/// - Other errors are returned at once, without calling the callback.
/// - The callback runs on the allocating thread with no lock of this adaptor held, so it may
///   free memory through this adaptor or its upstream. A callback that returns `true` forever
///   while nothing can be freed makes the allocation retry forever, as in RMM: count the tries
///   in the callback if that can happen.
///
/// [`Error::is_out_of_memory`]: crate::Error::is_out_of_memory
pub struct FailureCallbackAdaptor<U: MemoryResource> {
    upstream: U,
    callback: Box<Callback>,
    /// Times the callback was called, for `Debug` and [`callbacks`](Self::callbacks).
    calls: AtomicU64,
}

impl<U: MemoryResource> fmt::Debug for FailureCallbackAdaptor<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FailureCallbackAdaptor")
            .field("upstream", &self.upstream)
            .field("callback", &"Fn(usize) -> bool")
            .field("callbacks", &self.callbacks())
            .finish()
    }
}

impl<U: MemoryResource> FailureCallbackAdaptor<U> {
    /// Calls `callback(bytes)` whenever `upstream` runs out of memory for a request of `bytes`,
    /// and retries while it returns `true`.
    pub fn new(upstream: U, callback: impl Fn(usize) -> bool + Send + Sync + 'static) -> Self {
        Self {
            upstream,
            callback: Box::new(callback),
            calls: AtomicU64::new(0),
        }
    }

    /// The upstream resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }

    /// How many times the callback has been called.
    pub fn callbacks(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }
}

// SAFETY: every allocation is the upstream's (itself a `MemoryResource`), passed on unchanged; a
// failure only calls the callback and retries.
unsafe impl<U: MemoryResource> MemoryResource for FailureCallbackAdaptor<U> {
    fn device(&self) -> &Device {
        self.upstream.device()
    }

    fn memory_kind(&self) -> MemoryKind {
        self.upstream.memory_kind()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        loop {
            match self.upstream.allocate(bytes, stream) {
                Err(e) if e.is_out_of_memory() => {
                    self.calls.fetch_add(1, Ordering::Relaxed);
                    let retry = (self.callback)(bytes);
                    tracing::debug!(
                        bytes,
                        retry,
                        error = %e,
                        "FailureCallbackAdaptor: out of memory, callback called"
                    );
                    if !retry {
                        return Err(e);
                    }
                }
                other => return other,
            }
        }
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
