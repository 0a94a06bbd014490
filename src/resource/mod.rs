//! Memory resources: [`MemoryResource`], the trait every resource and adaptor implements, and
//! its implementations.
//!
//! Resources compose by value as RMM's do (`PoolResource<CudaResource>`). A buffer keeps its
//! resource alive through a [`ResourceRef`] (`Arc<dyn MemoryResource>`): wrap a resource in an
//! `Arc` to make buffers from it.

use std::fmt;
use std::sync::Arc as StdArc;

use crate::device::{Device, DevicePtr};
use crate::error::{Error, Result};
use crate::stream::Stream;

/// Every allocation of every resource is aligned to at least this many bytes.
pub const ALIGNMENT: usize = 256;

/// What kind of memory a resource hands out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Device memory: usable by GPU work only.
    Device,
    /// Managed (unified) memory: usable by the host and the GPU.
    Managed,
    /// Page-locked host memory: usable by the host, and by the GPU through unified addressing.
    PinnedHost,
}

/// A source of memory, stream-ordered.
///
/// `allocate(bytes, stream)` returns memory that work queued on `stream` after the call may use;
/// `deallocate(ptr, bytes, stream)` gives it back in stream order: the resource may hand it to
/// later work on `stream` at once, and to other streams only once ordered after `stream`. Neither
/// blocks the host.
///
/// Every allocation is aligned to at least [`ALIGNMENT`] bytes. Zero bytes is allowed, costs
/// nothing, and returns a null pointer that `deallocate` accepts back with zero bytes.
///
/// # Safety
///
/// Buffers trust what a resource hands out: their safe methods queue copies and fills into
/// it, and free it when dropped. So an implementation promises, as `GlobalAlloc`'s do, that
/// `allocate(bytes, stream)` with `bytes > 0` returns (or fails) only
///
/// - memory of at least `bytes` bytes, aligned to [`ALIGNMENT`], of the kind
///   [`memory_kind`](Self::memory_kind) says, that work on `stream` and on the device of
///   [`device`](Self::device) may use;
/// - that no other allocation still live (of this resource or any other) overlaps, and that
///   nothing else uses until it is given back through [`deallocate`](Self::deallocate) and
///   the work ordered before that point of the freeing stream has run; work queued on
///   `stream` after the call is ordered after every earlier use of it.
///
/// An adaptor that passes on its upstream's allocations (itself a `MemoryResource`) keeps
/// these by construction. Before a review, this trait was safe to implement, and safe code
/// could build a buffer over memory it did not own ([`callback::CallbackResource`] returning
/// another buffer's address); `CallbackResource::new` is `unsafe` now for the same reason.
pub unsafe trait MemoryResource: Send + Sync + fmt::Debug {
    /// The device the memory belongs to.
    fn device(&self) -> &Device;

    /// The kind of memory handed out.
    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Device
    }

    /// Allocates `bytes` for use on `stream`. `Err(OutOfMemory)` (with requested, available and
    /// maximum bytes) when the resource cannot provide them now; nothing is lost on error.
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr>;

    /// Gives `ptr` back in stream order on `stream`. Never blocks. Returns
    /// `Err(UnknownPointer)` where the resource can tell the pointer is not one of its own.
    ///
    /// # Safety
    /// `ptr` came from `allocate` of this resource with this `bytes`, is given back once, and
    /// all work that uses it is ordered before this point of `stream`.
    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()>;

    /// The queue of tasks waiting for memory from this resource, for resources that can run
    /// out and get memory back (a pool at its maximum, a limiting adaptor): what
    /// [`allocate_async`](AllocateAsync::allocate_async) waits in. Such a resource calls
    /// [`MemoryWaiters::notify`] whenever memory comes back. Adaptors return their upstream's
    /// (or their own, if they can run out themselves: the crate's
    /// [`LimitingAdaptor`](adaptor::LimitingAdaptor) has the upstream's queue relay its
    /// notifications to its own, so that a request the upstream refused is woken when memory
    /// comes back there). `None`: `allocate_async` fails as `allocate` does.
    fn memory_waiters(&self) -> Option<&MemoryWaiters> {
        None
    }

    /// What the resource holds, block by block ([`Snapshot`]), for the
    /// suballocating resources (pool, arena, fixed-size, binning) and the adaptors in front of
    /// them (they pass their upstream's on). `None` for resources that hand out whole
    /// allocations from the driver, which have no blocks to show.
    fn memory_snapshot(&self) -> Option<snapshot::Snapshot> {
        None
    }

    /// How much of the resource's capacity an allocation of `bytes` takes, as far as it can
    /// tell without allocating, and never more than what a layer that can refuse the request
    /// counts for it. An all-or-nothing set
    /// ([`allocate_all_async`](AllocateAsync::allocate_all_async)) sums these to tell a set
    /// that can never fit (more than a maximum) from one that must wait. Default: `bytes`
    /// rounded up to [`ALIGNMENT`]; an adaptor that asks more of its upstream
    /// ([`AlignedAdaptor`](adaptor::AlignedAdaptor)) says so, and one that forwards passes its
    /// upstream's on. `Err(InvalidSize)` where that overflows.
    fn footprint(&self, bytes: usize) -> Result<usize> {
        aligned_size(bytes)
    }

    /// Whether requests of `sizes` can ever be held at once by this resource and every layer
    /// beneath it, each layer counting them its own way: `Err(OutOfMemory)` from the first
    /// layer whose maximum the set's total passes, with that total (as that layer counts it) as
    /// `requested`, so that no wait is made for it; else `Ok`. One
    /// [`footprint`](Self::footprint) cannot tell it for a stack whose layers count
    /// differently: under a limiting adaptor a request counts its rounded size, and an aligned
    /// adaptor beneath asks the pool for it padded; a set whose padded total passed the pool's
    /// maximum waited for ever, its unpadded total being within it (a review's finding). A
    /// resource with a maximum checks the set against it, an adaptor maps the sizes as it asks
    /// its upstream for them and passes the call on. Default: `Ok` (no maximum known here; the
    /// set's own out-of-memory errors decide, as before).
    fn check_set(&self, sizes: &[usize]) -> Result<()> {
        let _ = sizes;
        Ok(())
    }
}

/// [`MemoryResource::check_set`] for a layer that holds at most `maximum` bytes and counts a
/// request as `footprint` says.
pub(crate) fn check_set_within(
    sizes: &[usize],
    maximum: usize,
    footprint: impl Fn(usize) -> Result<usize>,
) -> Result<()> {
    let mut total = 0usize;
    for &bytes in sizes {
        total = total.saturating_add(footprint(bytes)?);
    }
    if total > maximum {
        return Err(Error::OutOfMemory {
            requested: total,
            available: 0,
            maximum,
        });
    }
    Ok(())
}

/// A type-erased, shareable resource: what buffers hold to keep their resource alive.
pub type ResourceRef = StdArc<dyn MemoryResource>;

/// Anything a buffer can take its resource from: an `Arc` of a resource, or a [`ResourceRef`].
pub trait AsResourceRef {
    /// A shared handle to the resource (a reference-count increment, no allocation).
    fn resource_ref(&self) -> ResourceRef;
}

impl<R: MemoryResource + 'static> AsResourceRef for StdArc<R> {
    fn resource_ref(&self) -> ResourceRef {
        self.clone()
    }
}

impl AsResourceRef for ResourceRef {
    fn resource_ref(&self) -> ResourceRef {
        self.clone()
    }
}

/// A shared resource is a resource: adaptors and pools can take `Arc<R>` (or a
/// [`ResourceRef`]) as their upstream.
// SAFETY: forwards to `R`, itself a `MemoryResource`.
unsafe impl<R: MemoryResource + ?Sized> MemoryResource for StdArc<R> {
    fn device(&self) -> &Device {
        (**self).device()
    }

    fn memory_kind(&self) -> MemoryKind {
        (**self).memory_kind()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        (**self).allocate(bytes, stream)
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { (**self).deallocate(ptr, bytes, stream) }
    }

    fn memory_waiters(&self) -> Option<&MemoryWaiters> {
        (**self).memory_waiters()
    }

    fn memory_snapshot(&self) -> Option<snapshot::Snapshot> {
        (**self).memory_snapshot()
    }

    fn footprint(&self, bytes: usize) -> Result<usize> {
        (**self).footprint(bytes)
    }

    fn check_set(&self, sizes: &[usize]) -> Result<()> {
        (**self).check_set(sizes)
    }
}

/// `bytes` rounded up to [`ALIGNMENT`], or `InvalidSize` if that overflows.
#[allow(dead_code)] // used by the resources being written
pub(crate) fn aligned_size(bytes: usize) -> Result<usize> {
    bytes
        .checked_next_multiple_of(ALIGNMENT)
        .ok_or(Error::InvalidSize {
            size: bytes,
            reason: "the size overflows when rounded up to the 256-byte alignment",
        })
}

/// Waits on the host for every stream of `streams` before a resource (`resource`, for the log)
/// gives its memory back at its drop. `false` if one of them is under a user's graph capture
/// (`Error::StreamCapturing`): its earlier work may still use the memory and the host cannot
/// wait for it, so the caller keeps the memory (leaked, and logged here) rather than free it
/// under that work (a review's finding: the drops ignored the refusal and freed). Other errors
/// are ignored, as before (a device that failed has no work left running).
pub(crate) fn wait_for_streams_at_drop(
    resource: &'static str,
    streams: impl IntoIterator<Item = Stream>,
) -> bool {
    let mut captured = 0;
    for stream in streams {
        if let Err(Error::StreamCapturing { .. }) = stream.synchronize_blocking() {
            captured += 1;
        }
    }
    if captured > 0 {
        tracing::error!(
            resource,
            streams = captured,
            "dropped while a stream it served is being captured into a CUDA graph: its memory is kept (leaked), since work on that stream may still use it"
        );
    }
    captured == 0
}

/// `Err(WrongDevice)` unless `stream` belongs to `device`.
#[allow(dead_code)]
pub(crate) fn check_stream(device: &Device, stream: &Stream) -> Result<()> {
    device.check_same(stream.device())
}

// ===== waiting for memory =====
mod allocate;
mod allocate_all;
// `pub(crate)`: the loom models (loom-tests/waiters/) poll `Wait` itself and plant its bugs.
pub(crate) mod wait;
// `pub(crate)`: the loom models (loom-tests/waiters.rs) drive the queue and name `Leave`.
pub(crate) mod waiters;
pub use self::allocate::{Allocate, AllocateAsync};
pub use self::allocate_all::AllocateAll;
pub use self::waiters::{MemoryWaiters, WaitStats};

// ===== the resources =====
// Base resources, over the device layer.
pub mod cuda;
pub mod cuda_async;
pub mod managed;
pub mod pinned;
// The pool and its engine.
#[cfg(test)]
mod capture_trim_tests;
#[cfg(test)]
mod engine_lab;
pub mod expandable;
pub mod fixed_size;
pub(crate) mod free_list;
#[cfg(all(test, not(streamalloc_loom)))]
mod lock_probes;
// `pub(crate)`: the loom model (loom-tests/give_backs.rs) drives it.
pub(crate) mod give_backs;
mod growth;
pub(crate) mod held_for_trim;
pub mod pool;
pub(crate) mod stream_ordered;
pub(crate) mod tlsf;
mod trim_waits;
// The rest of RMM's family.
pub mod adaptor;
pub mod arena;
pub mod binning;
pub mod callback;
pub mod current;
// What they hold, for people to look at.
pub mod snapshot;

pub use self::arena::{ArenaOptions, ArenaResource, ArenaStats};
pub use self::binning::{BinningBuilder, BinningResource};
pub use self::callback::CallbackResource;
pub use self::cuda::CudaResource;
pub use self::cuda_async::{CudaAsyncOptions, CudaAsyncResource};
pub use self::current::{current_resource, reset_current_resource, set_current_resource};
pub use self::expandable::{ExpandableOptions, ExpandablePlacement, ExpandablePoolResource};
pub use self::fixed_size::FixedSizeResource;
pub use self::managed::ManagedResource;
pub use self::pinned::{PinnedHostOptions, PinnedHostResource, PinnedHostStats};
pub use self::pool::{PoolOptions, PoolResource, PoolStats};
pub use self::snapshot::{Block, BlockState, Chunk, ChunkKind, Snapshot};
