//! [`BinningResource`]: requests routed by size to bins, RMM's `binning_memory_resource`.

use std::fmt;
use std::sync::Arc as StdArc;

// `snapshot()`, in its own file.
mod snapshot;

use super::fixed_size::FixedSizeResource;
use super::waiters::MemoryWaiters;
use super::{aligned_size, MemoryKind, MemoryResource, ResourceRef};
use crate::device::{Device, DevicePtr};
use crate::error::{Error, Result};
use crate::stream::Stream;

/// RMM's default for fixed-size bins: blocks taken from the upstream 128 at a time.
pub const DEFAULT_BLOCKS_PER_CHUNK: usize = 128;

/// What serves one bin.
enum BinResource<U: MemoryResource> {
    /// A [`FixedSizeResource`] over the shared upstream.
    Fixed(Box<FixedSizeResource<StdArc<U>>>),
    /// A resource given to [`BinningBuilder::add_bin`].
    Given(ResourceRef),
}

impl<U: MemoryResource> BinResource<U> {
    fn resource(&self) -> &dyn MemoryResource {
        match self {
            BinResource::Fixed(r) => &**r,
            BinResource::Given(r) => &**r,
        }
    }
}

struct Bin<U: MemoryResource> {
    /// The largest request the bin serves.
    size: usize,
    resource: BinResource<U>,
}

/// Where requests larger than every bin go.
enum Fallback {
    Upstream,
    Given(ResourceRef),
}

/// Requests routed by size (RMM's `binning_memory_resource`): each bin serves the requests of
/// at most its size that no smaller bin serves, and a *fallback* serves the requests larger
/// than every bin. A bin is a [`FixedSizeResource`] over the shared upstream (blocks of the
/// bin's size: constant-time allocation and no fragmentation for small, frequent sizes), or any
/// resource given to [`add_bin`](BinningBuilder::add_bin). The fallback is the upstream, or a
/// resource given to [`fallback`](BinningBuilder::fallback).
///
/// `allocate(bytes)` picks the smallest bin whose size is at least `bytes`; `deallocate(ptr,
/// bytes)` picks by the same rule, so memory goes back to the resource it came from (the
/// `bytes` given back must be those asked for, as for every resource). A free whose size routes
/// it to a given bin or the fallback but whose range lies in a fixed-size bin's memory is
/// refused with [`Error::UnknownPointer`], nothing freed: the upstream (which a given bin may
/// be) handed that memory to the bin and would take the bin's whole chunk back.
///
/// It reports its upstream's [`memory_kind`](MemoryResource::memory_kind); bins and a fallback
/// given must hand out the same kind ([`build`](BinningBuilder::build) refuses others).
///
/// ```
/// use streamalloc::resource::binning::BinningResource;
/// use streamalloc::resource::cuda::CudaResource;
/// use streamalloc::resource::pool::{PoolOptions, PoolResource};
/// use streamalloc::{Device, MemoryResource, SimConfig};
///
/// let device = Device::simulated(SimConfig::default());
/// let pool = PoolResource::new(CudaResource::new(&device), PoolOptions::default())?;
/// // Fixed-size bins of 256 KiB .. 4 MiB over the pool, the pool itself for larger requests:
/// // the configuration of RMM's replay benchmark.
/// let mr = BinningResource::builder(pool).bins_pow2(18, 22).build()?;
/// assert_eq!(mr.bin_sizes(), vec![1 << 18, 1 << 19, 1 << 20, 1 << 21, 1 << 22]);
/// let stream = device.create_stream()?;
/// let ptr = mr.allocate(300_000, &stream)?; // from the 512 KiB bin
/// // SAFETY: allocated above with these bytes, unused, freed once.
/// unsafe { mr.deallocate(ptr, 300_000, &stream)? };
/// # Ok::<(), streamalloc::Error>(())
/// ```
///
/// It has its own queue of tasks waiting for memory ([`memory_waiters`]), so that
/// [`allocate_async`] and [`allocate_all_async`] through it wait (a bin or the fallback out of
/// memory) instead of failing at once. The queues of the upstream, of every fixed-size bin and
/// of every bin or fallback given that has one relay their notifications to it, and every free
/// through it notifies it: memory that comes back through a bin, through the fallback, or
/// straight into the shared upstream wakes its first waiter. One queue serves every size,
/// first come, first served: a request waits behind an earlier one even when that one waits
/// for another bin (as a small request waits behind a large one in a pool's queue). (Before a review it had none: a request through it failed at
/// once whenever a bin or the fallback was out of memory, however soon memory came back.)
/// Its queue learns the maximums that out-of-memory errors report, and a request larger than
/// the smallest of them fails at once while others wait: a bin or fallback given with a
/// smaller maximum than the others' can thus refuse a larger request that another of them
/// could serve later.
///
/// [`memory_waiters`]: MemoryResource::memory_waiters
/// [`allocate_async`]: crate::AllocateAsync::allocate_async
/// [`allocate_all_async`]: crate::AllocateAsync::allocate_all_async
pub struct BinningResource<U: MemoryResource> {
    upstream: StdArc<U>,
    device: Device,
    /// Sorted by size, sizes distinct.
    bins: Vec<Bin<U>>,
    fallback: Fallback,
    /// Tasks waiting in `allocate_async` through it; relayed to by the queues below (see the
    /// type's documentation), which stop relaying when it is dropped.
    waiters: StdArc<MemoryWaiters>,
}

impl<U: MemoryResource> fmt::Debug for BinningResource<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BinningResource")
            .field("upstream", &self.upstream)
            .field("bins", &self.bin_sizes())
            .field(
                "fallback",
                &match &self.fallback {
                    Fallback::Upstream => "upstream".to_owned(),
                    Fallback::Given(r) => format!("{r:?}"),
                },
            )
            .finish()
    }
}

/// Builds a [`BinningResource`]: `BinningResource::builder(upstream)`, then bins, then
/// [`build`](Self::build).
pub struct BinningBuilder<U: MemoryResource> {
    upstream: U,
    bins: Vec<(usize, Option<ResourceRef>)>,
    fallback: Option<ResourceRef>,
    blocks_per_chunk: usize,
    error: Option<Error>,
}

impl<U: MemoryResource> fmt::Debug for BinningBuilder<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BinningBuilder")
            .field("bins", &self.bins.iter().map(|b| b.0).collect::<Vec<_>>())
            .field("blocks_per_chunk", &self.blocks_per_chunk)
            .finish_non_exhaustive()
    }
}

impl<U: MemoryResource> BinningBuilder<U> {
    /// A fixed-size bin for each power of two from `2^min_log2` to `2^max_log2` bytes (RMM's
    /// constructor with minimum and maximum bin exponents). An error at
    /// [`build`](Self::build) if `min_log2 > max_log2` or `max_log2` does not fit a `usize`.
    pub fn bins_pow2(mut self, min_log2: u32, max_log2: u32) -> Self {
        if min_log2 > max_log2 || max_log2 >= usize::BITS {
            // The number that breaks the rule: a too-large exponent, else the minimum above it.
            let bad = if max_log2 >= usize::BITS {
                max_log2
            } else {
                min_log2
            };
            self.error.get_or_insert(Error::InvalidSize {
                size: bad as usize,
                reason: "bin exponents must satisfy min_log2 <= max_log2 < usize::BITS",
            });
            return self;
        }
        for k in min_log2..=max_log2 {
            self.bins.push((1usize << k, None));
        }
        self
    }

    /// A bin for requests of at most `size` bytes (and more than the next smaller bin's), served
    /// by `resource`, or, with `None`, by a [`FixedSizeResource`] of `size` bytes (rounded up to
    /// 256) over the upstream. A later bin of the same size (as asked, or as rounded up for a
    /// fixed-size bin) replaces an earlier one, whichever serves each. An error at
    /// [`build`](Self::build) for a zero size, or a resource of another device or of another
    /// [`MemoryKind`] than the upstream.
    pub fn add_bin(mut self, size: usize, resource: impl Into<Option<ResourceRef>>) -> Self {
        self.bins.push((size, resource.into()));
        self
    }

    /// Serve requests larger than every bin from `resource` instead of the upstream. An error at
    /// [`build`](Self::build) for a resource of another device or of another [`MemoryKind`]
    /// than the upstream.
    pub fn fallback(mut self, resource: ResourceRef) -> Self {
        self.fallback = Some(resource);
        self
    }

    /// Blocks each fixed-size bin takes from the upstream at a time (default
    /// [`DEFAULT_BLOCKS_PER_CHUNK`], RMM's). A large bin with many blocks per chunk reserves a
    /// lot of memory on first use: 128 blocks of 4 MiB is 512 MiB.
    pub fn blocks_per_chunk(mut self, blocks: usize) -> Self {
        self.blocks_per_chunk = blocks;
        self
    }

    /// The resource. Errors: the first bad argument given to the builder; a fixed-size bin that
    /// cannot be made ([`FixedSizeResource::new`]'s errors); a resource of another device
    /// ([`Error::WrongDevice`]); a bin or fallback given that hands out another
    /// [`MemoryKind`] than the upstream ([`Error::InvalidArgument`]: the binning resource
    /// reports the upstream's kind for everything it hands out).
    pub fn build(self) -> Result<BinningResource<U>> {
        if let Some(e) = self.error {
            return Err(e);
        }
        let device = self.upstream.device().clone();
        // The binning resource reports the upstream's kind for all it hands out (the unsafe
        // contract of `memory_kind`), so every resource given must hand out that kind.
        let kind = self.upstream.memory_kind();
        let upstream = StdArc::new(self.upstream);
        if let Some(fallback) = &self.fallback {
            device.check_same(fallback.device())?;
            if fallback.memory_kind() != kind {
                return Err(Error::InvalidArgument {
                    what: "the fallback hands out another kind of memory than the upstream",
                });
            }
        }
        // Each bin with its size as asked (a fixed-size bin's own is rounded up to 256).
        let mut bins: Vec<(usize, Bin<U>)> = Vec::with_capacity(self.bins.len());
        for (size, given) in self.bins {
            if size == 0 {
                return Err(Error::InvalidSize {
                    size,
                    reason: "a bin's size must be non-zero",
                });
            }
            let bin = match given {
                Some(resource) => {
                    device.check_same(resource.device())?;
                    if resource.memory_kind() != kind {
                        return Err(Error::InvalidArgument {
                            what: "a bin given to add_bin hands out another kind of memory than \
                                   the upstream",
                        });
                    }
                    Bin {
                        size,
                        resource: BinResource::Given(resource),
                    }
                }
                None => Bin {
                    size: aligned_size(size)?,
                    resource: BinResource::Fixed(Box::new(FixedSizeResource::new(
                        upstream.clone(),
                        size,
                        self.blocks_per_chunk,
                    )?)),
                },
            };
            // A later bin of the same size replaces an earlier one: the same size as asked, or
            // as served. (Comparing the served sizes alone kept a given bin of 1000 bytes beside
            // a fixed-size bin asked for 1000, rounded to 1024: a review's finding.)
            bins.retain(|(asked, b)| *asked != size && b.size != bin.size);
            bins.push((size, bin));
        }
        let mut bins: Vec<Bin<U>> = bins.into_iter().map(|(_, b)| b).collect();
        bins.sort_by_key(|b| b.size);
        let fallback = self.fallback.map_or(Fallback::Upstream, Fallback::Given);
        // After the last step that can fail (the drop of the resource undoes it): memory that
        // comes back to any resource below may serve a request waiting in our queue.
        let waiters = MemoryWaiters::stacked_over(&*upstream);
        let binning = BinningResource {
            upstream,
            device,
            bins,
            fallback,
            waiters,
        };
        for below in binning.below() {
            if let Some(queue) = below.memory_waiters() {
                queue.relay_to(&binning.waiters);
            }
        }
        Ok(binning)
    }
}

impl<U: MemoryResource> BinningResource<U> {
    /// A builder of a binning resource over `upstream`, with no bins yet.
    pub fn builder(upstream: U) -> BinningBuilder<U> {
        BinningBuilder {
            upstream,
            bins: Vec::new(),
            fallback: None,
            blocks_per_chunk: DEFAULT_BLOCKS_PER_CHUNK,
            error: None,
        }
    }

    /// RMM's `binning_memory_resource(upstream, min_size_exponent, max_size_exponent)`:
    /// fixed-size bins of `2^min_log2` .. `2^max_log2` bytes over `upstream`, which serves
    /// larger requests.
    pub fn new(upstream: U, min_log2: u32, max_log2: u32) -> Result<Self> {
        Self::builder(upstream)
            .bins_pow2(min_log2, max_log2)
            .build()
    }

    /// The upstream (shared with the fixed-size bins).
    pub fn upstream(&self) -> &U {
        &self.upstream
    }

    /// The bins' sizes, smallest first (a fixed-size bin's rounded up to 256 bytes).
    pub fn bin_sizes(&self) -> Vec<usize> {
        self.bins.iter().map(|b| b.size).collect()
    }

    /// The index (in [`bin_sizes`](Self::bin_sizes)) of the bin that serves `bytes`; `None`
    /// for the fallback.
    pub fn bin_for(&self, bytes: usize) -> Option<usize> {
        let i = self.bins.partition_point(|b| b.size < bytes);
        (i < self.bins.len()).then_some(i)
    }

    /// The bins' resources and a given fallback: every resource below it but the upstream.
    fn below(&self) -> impl Iterator<Item = &dyn MemoryResource> {
        let fallback = match &self.fallback {
            Fallback::Upstream => None,
            Fallback::Given(r) => Some(&**r),
        };
        (self.bins.iter().map(|b| b.resource.resource())).chain(fallback)
    }

    /// The resource that serves `bytes` (non-zero).
    fn route(&self, bytes: usize) -> &dyn MemoryResource {
        match self.bin_for(bytes) {
            Some(i) => self.bins[i].resource.resource(),
            None => match &self.fallback {
                Fallback::Upstream => &*self.upstream,
                Fallback::Given(r) => &**r,
            },
        }
    }
}

// SAFETY: each size goes to one bin or to the fallback (the upstream or a resource given), each
// a `MemoryResource`, and is freed through the same one.
unsafe impl<U: MemoryResource> MemoryResource for BinningResource<U> {
    fn device(&self) -> &Device {
        &self.device
    }

    fn memory_kind(&self) -> MemoryKind {
        self.upstream.memory_kind()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        // The stream first: another device's stream is the caller's mistake whatever the
        // size, and a zero-byte request must not hide it.
        self.device.check_same(stream.device())?;
        if bytes == 0 {
            return Ok(DevicePtr(0));
        }
        self.route(bytes).allocate(bytes, stream)
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.device.check_same(stream.device())?;
        if bytes == 0 {
            return if ptr.0 == 0 {
                Ok(())
            } else {
                Err(Error::UnknownPointer { ptr: ptr.0, bytes })
            };
        }
        // A size that routes to the fallback or to a given bin goes to a resource that may be
        // the upstream the fixed-size bins take their chunks from (a given bin may be that very
        // pool): a wrong size there could give a bin's chunk back while its blocks are handed
        // out. Only a fixed-size bin hands out memory of its chunks, so such a free is always
        // wrong. A fixed-size bin checks the frees routed to it itself.
        let to_a_fixed_bin = matches!(
            self.bin_for(bytes).map(|i| &self.bins[i].resource),
            Some(BinResource::Fixed(_))
        );
        let in_a_fixed_bin = || {
            (self.bins.iter()).any(|b| match &b.resource {
                BinResource::Fixed(f) => f.overlaps(ptr.0, bytes as u64),
                BinResource::Given(_) => false,
            })
        };
        if !to_a_fixed_bin && in_a_fixed_bin() {
            return Err(Error::UnknownPointer { ptr: ptr.0, bytes });
        }
        let serving = self.route(bytes);
        // SAFETY: the caller's contract; the same size picks the resource `allocate` used.
        unsafe { serving.deallocate(ptr, bytes, stream) }?;
        // Memory came back: a task waiting through us may take it. A resource with a queue
        // notified it (the trait's contract), and every such queue below relays to ours (set
        // up when it was built): only a bin or fallback given with none needs ours notified
        // here (each notification is a full fence).
        if serving.memory_waiters().is_none() {
            self.waiters.notify();
        }
        Ok(())
    }

    fn memory_waiters(&self) -> Option<&MemoryWaiters> {
        Some(&self.waiters)
    }

    /// The footprint the resource that serves `bytes` counts (a fixed-size bin: a whole
    /// block), so that an all-or-nothing set of small requests that needs more blocks than the
    /// upstream holds fails at once instead of waiting for ever.
    fn footprint(&self, bytes: usize) -> Result<usize> {
        if bytes == 0 {
            return Ok(0);
        }
        self.route(bytes).footprint(bytes)
    }

    fn memory_snapshot(&self) -> Option<super::snapshot::Snapshot> {
        Some(self.snapshot())
    }
}

impl<U: MemoryResource> Drop for BinningResource<U> {
    fn drop(&mut self) {
        // The resources below outlive this call (our fields): they stop relaying to a queue
        // that nobody can wait in any more.
        MemoryWaiters::unstack_from(&self.waiters, &*self.upstream);
        for below in self.below() {
            MemoryWaiters::unstack_from(&self.waiters, below);
        }
    }
}
