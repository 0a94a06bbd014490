//! [`AlignedAdaptor`]: alignments above 256 bytes (RMM's `aligned_resource_adaptor`).

use std::collections::HashMap;
use std::fmt;

use crate::device::{Device, DevicePtr};
use crate::error::{Error, Result};
use crate::resource::{MemoryKind, MemoryResource, MemoryWaiters, ALIGNMENT};
use crate::stream::Stream;
use crate::sync::Mutex;

/// What the upstream handed out for one aligned allocation.
#[derive(Debug, Clone, Copy)]
struct Origin {
    /// The upstream's pointer (at or below the aligned one).
    ptr: u64,
    /// The size asked of the upstream.
    size: usize,
    /// The size the caller asked for, which `deallocate` must repeat.
    bytes: usize,
}

/// Hands out memory aligned to `alignment` bytes (a power of two, above the 256 that every
/// resource gives), for allocations of at least `threshold` bytes (RMM's
/// `aligned_resource_adaptor` and its `alignment_threshold`).
///
/// - For an aligned allocation it asks the upstream for `bytes` rounded up to `alignment`, plus
///   `alignment − 256` (so an aligned start is always inside), returns the first aligned address
///   in it, and remembers aligned pointer → upstream pointer and size, to give back exactly what
///   it got.
/// - Allocations below `threshold`, zero-byte ones, and every allocation when `alignment` is
///   256 or less, pass straight through (no over-allocation, nothing remembered).
/// - A `deallocate` looks the pointer up in the table before anything else: an aligned
///   allocation freed with another size than it was allocated with (one below the threshold
///   included), or a pointer it does not remember with a size that would be aligned, returns
///   [`Error::UnknownPointer`] with the caller's pointer and size, without calling the upstream.
///
/// The table is a hash map under one mutex, never held across an upstream call. The upstream's
/// errors pass through, except that its [`Error::UnknownPointer`] for an aligned allocation
/// names the caller's pointer and size, not the padded ones it was given; a size whose
/// over-allocation overflows is [`Error::InvalidSize`].
pub struct AlignedAdaptor<U: MemoryResource> {
    upstream: U,
    /// A power of two, at least 256.
    alignment: usize,
    threshold: usize,
    /// Outstanding aligned allocations: aligned pointer → what the upstream gave.
    origins: Mutex<HashMap<u64, Origin>>,
}

impl<U: MemoryResource> fmt::Debug for AlignedAdaptor<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedAdaptor")
            .field("upstream", &self.upstream)
            .field("alignment", &self.alignment)
            .field("threshold", &self.threshold)
            .field("outstanding", &self.origins.lock().len())
            .finish()
    }
}

impl<U: MemoryResource> AlignedAdaptor<U> {
    /// Aligns every allocation to `alignment` bytes. `Err(InvalidAlignment)` unless `alignment`
    /// is a power of two (`upstream` is dropped then). Alignments of 256 or less are allowed and
    /// change nothing: every resource aligns to 256 already.
    pub fn new(upstream: U, alignment: usize) -> Result<Self> {
        Self::with_threshold(upstream, alignment, 0)
    }

    /// Aligns allocations of at least `threshold` bytes to `alignment` bytes; smaller ones pass
    /// through with the upstream's 256-byte alignment. `Err(InvalidAlignment)` unless
    /// `alignment` is a power of two (`upstream` is dropped then).
    pub fn with_threshold(upstream: U, alignment: usize, threshold: usize) -> Result<Self> {
        if !alignment.is_power_of_two() {
            return Err(Error::InvalidAlignment { alignment });
        }
        Ok(Self {
            upstream,
            alignment: alignment.max(ALIGNMENT),
            threshold,
            origins: Mutex::new(HashMap::new()),
        })
    }

    /// The upstream resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }

    /// The alignment of aligned allocations: what was asked, or 256 if that was less.
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// The smallest allocation that is aligned.
    pub fn threshold(&self) -> usize {
        self.threshold
    }

    /// Whether an allocation of `bytes` passes straight through.
    fn passes_through(&self, bytes: usize) -> bool {
        bytes == 0 || self.alignment == ALIGNMENT || bytes < self.threshold
    }

    /// What to ask of the upstream for `bytes` aligned: rounded up to the alignment, plus room
    /// to slide the start up to the next aligned address.
    fn upstream_size(&self, bytes: usize) -> Result<usize> {
        bytes
            .checked_next_multiple_of(self.alignment)
            .and_then(|b| b.checked_add(self.alignment - ALIGNMENT))
            .ok_or(Error::InvalidSize {
                size: bytes,
                reason: "the size overflows when padded for the AlignedAdaptor's alignment",
            })
    }
}

// SAFETY: every pointer handed out lies inside one upstream allocation (itself a
// `MemoryResource`) of at least the bytes asked for plus the alignment's slack, and only one is
// handed out per upstream allocation.
unsafe impl<U: MemoryResource> MemoryResource for AlignedAdaptor<U> {
    fn device(&self) -> &Device {
        self.upstream.device()
    }

    fn memory_kind(&self) -> MemoryKind {
        self.upstream.memory_kind()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        if self.passes_through(bytes) {
            return self.upstream.allocate(bytes, stream);
        }
        let size = self.upstream_size(bytes)?;
        let ptr = self.upstream.allocate(size, stream)?;
        // The upstream's pointer is 256-aligned and `size` leaves `alignment - 256` bytes of
        // slack after the rounded-up request, so the aligned start and `bytes` after it are
        // inside what the upstream gave.
        let Some(aligned) = ptr.0.checked_next_multiple_of(self.alignment as u64) else {
            // Only at the very top of the address space, which no device hands out.
            // SAFETY: just allocated from the upstream with `size` on `stream`, never used.
            let _ = unsafe { self.upstream.deallocate(ptr, size, stream) };
            return Err(Error::InvalidAddress {
                ptr: ptr.0,
                bytes: size,
            });
        };
        let origin = Origin {
            ptr: ptr.0,
            size,
            bytes,
        };
        if let Some(old) = self.origins.lock().insert(aligned, origin) {
            tracing::error!(
                aligned,
                old_upstream_ptr = old.ptr,
                "AlignedAdaptor: the upstream handed out memory that is still outstanding"
            );
        }
        Ok(DevicePtr(aligned))
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        // The table first, whatever the size: an aligned allocation freed with a size that
        // would pass through must not reach the upstream with the aligned pointer (an upstream
        // that ignores sizes, as `cuMemFree` does, would free it and leave the entry stale).
        // With no alignment above 256 nothing is ever in the table.
        if planted!(FORGET_AFTER_UPSTREAM) {
            // The planted bug: the memory goes back upstream before its origin is forgotten.
            let origin = match self.origins.lock().get(&ptr.0) {
                Some(o) if o.bytes == bytes => (o.ptr, o.size),
                _ => return Err(Error::UnknownPointer { ptr: ptr.0, bytes }),
            };
            // SAFETY: as below.
            unsafe {
                self.upstream
                    .deallocate(DevicePtr(origin.0), origin.1, stream)
            }?;
            self.origins.lock().remove(&ptr.0);
            return Ok(());
        }
        let origin = if self.alignment == ALIGNMENT {
            None
        } else {
            let mut origins = self.origins.lock();
            match origins.get(&ptr.0) {
                Some(o) if o.bytes == bytes => origins.remove(&ptr.0),
                Some(_) => return Err(Error::UnknownPointer { ptr: ptr.0, bytes }),
                None => None,
            }
        };
        let Some(origin) = origin else {
            if self.passes_through(bytes) {
                // SAFETY: the caller's contract, passed on: an allocation of this size that we
                // do not remember was the upstream's own.
                return unsafe { self.upstream.deallocate(ptr, bytes, stream) };
            }
            return Err(Error::UnknownPointer { ptr: ptr.0, bytes });
        };
        // SAFETY: `origin` is what the upstream handed out for this allocation, given back
        // once (we removed it from the table), after the uses the caller ordered before this
        // point of `stream`.
        let result = unsafe {
            self.upstream
                .deallocate(DevicePtr(origin.ptr), origin.size, stream)
        };
        if result.is_err() {
            // Not freed: still outstanding.
            self.origins.lock().insert(ptr.0, origin);
        }
        // The upstream's refusal names its own pointer and padded size; the caller gave theirs.
        result.map_err(|e| match e {
            Error::UnknownPointer { .. } => Error::UnknownPointer { ptr: ptr.0, bytes },
            e => e,
        })
    }

    fn memory_waiters(&self) -> Option<&MemoryWaiters> {
        self.upstream.memory_waiters()
    }

    /// What the upstream is asked for: for an aligned allocation, `bytes` padded for the
    /// alignment (a set of them can never fit a pool that holds their unpadded sizes).
    fn footprint(&self, bytes: usize) -> Result<usize> {
        if self.passes_through(bytes) {
            self.upstream.footprint(bytes)
        } else {
            self.upstream.footprint(self.upstream_size(bytes)?)
        }
    }

    /// The sizes as the upstream is asked for them (padded for the alignment), passed on.
    fn check_set(&self, sizes: &[usize]) -> Result<()> {
        let asked = sizes
            .iter()
            .map(|&bytes| {
                if self.passes_through(bytes) {
                    Ok(bytes)
                } else {
                    self.upstream_size(bytes)
                }
            })
            .collect::<Result<Vec<usize>>>()?;
        self.upstream.check_set(&asked)
    }
    fn memory_snapshot(&self) -> Option<crate::resource::snapshot::Snapshot> {
        self.upstream.memory_snapshot()
    }
}

/// A bug the loom model plants (`loom-tests/adaptor_tables.rs`), constant off otherwise; read
/// through `planted!`.
#[cfg(streamalloc_loom)]
pub(crate) mod planted {
    /// `deallocate` gives the memory back upstream before it forgets the origin: another thread
    /// can get the same address meanwhile, and its origin is the one forgotten.
    pub(crate) static FORGET_AFTER_UPSTREAM: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);
}
