//! The driver's stream-ordered memory pools as `CudaAsyncResource` holds them ([`AsyncPool`]):
//! one it owns, or a view of the device's default pool or of another. Allocations and frees
//! are ordered on a [`Stream`], which is why this is the stream layer's.

use std::fmt;

use crate::device::memory::check_size;
use crate::device::{cuda, mismatch, sim, Backend, Device, DevicePtr, FaultKind};
use crate::error::{Error, Result};
use crate::stream::{RawStream, Stream};
use crate::sync::plain::Arc as PlainArc;

/// Settings of an [`AsyncPool`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct AsyncPoolSettings {
    /// Freed bytes the pool keeps across synchronizations (`u64::MAX`: all of them).
    pub(crate) release_threshold: u64,
    /// The most the pool may hold (`maxSize` on CUDA, which the driver rounds up; no cap on
    /// the simulated pool, see `AsyncPool::new`); `None`: the device's memory.
    pub(crate) maximum: Option<usize>,
}

/// A driver memory pool, as a resource holds it: one it created and owns (`cuMemPoolCreate` on
/// CUDA, [`sim::memory::SimPool`] on the simulated device), or a view of one that exists
/// already (the device's default pool, or a pool someone else made), which it only uses.
/// Allocations are stream-ordered (`cuMemAllocFromPoolAsync`), and so are frees
/// (`cuMemFreeAsync`). Dropping an owned pool destroys it; memory still allocated from it is
/// released once freed (the driver's rule, which the simulated pool follows). Dropping a view
/// leaves the pool as it is.
pub(crate) struct AsyncPool {
    device: Device,
    raw: RawPool,
    maximum: Option<usize>,
    /// Created by this handle, destroyed by its drop; false for a view.
    owned: bool,
}

/// The simulated devices' default pools: one per device, made on first use and kept while the
/// device lives (as a CUDA context keeps its device's default pool). Entries of dropped devices
/// are let go at the next lookup. Not in the loom build, where a model's objects must not
/// outlive it: there each lookup makes a new pool.
#[cfg(not(streamalloc_loom))]
static SIM_DEFAULT_POOLS: std::sync::Mutex<
    Vec<(
        std::sync::Weak<crate::device::DeviceInner>,
        PlainArc<sim::memory::SimPool>,
    )>,
> = std::sync::Mutex::new(Vec::new());

enum RawPool {
    Cuda(cuda::RawPool),
    // A plain `Arc`, as the simulated memory's own: loom never models the device's memory.
    Sim(PlainArc<sim::memory::SimPool>),
}

impl fmt::Debug for AsyncPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("AsyncPool");
        s.field("device", &self.device.id());
        if let Ok(reserved) = self.reserved() {
            s.field("reserved", &reserved);
        }
        if let Ok(used) = self.used() {
            s.field("used", &used);
        }
        s.field("maximum", &self.maximum)
            .field("owned", &self.owned)
            .finish()
    }
}

impl AsyncPool {
    pub(crate) fn new(device: &Device, settings: AsyncPoolSettings) -> Result<AsyncPool> {
        if settings.maximum == Some(0) {
            return Err(Error::InvalidSize {
                size: 0,
                reason: "a pool's maximum size must be at least one byte",
            });
        }
        let raw = match device.backend() {
            Backend::Cuda(d) => RawPool::Cuda(
                d.create_pool(settings.release_threshold, settings.maximum.unwrap_or(0))?,
            ),
            // No cap on the simulated pool: the driver's `maxSize` is only a physical cap,
            // rounded up to its own granularity and loose (it reuses a block freed on the same
            // stream before the GPU reaches the free, which the simulated pool cannot), so the
            // resource above enforces the maximum by counting, on both devices alike.
            Backend::Sim(d) => RawPool::Sim(sim::memory::SimPool::create(
                &d.memory,
                settings.release_threshold,
                usize::MAX,
            )),
        };
        Ok(AsyncPool {
            device: device.clone(),
            raw,
            maximum: settings.maximum,
            owned: true,
        })
    }

    /// A view of `device`'s default pool (`cuDeviceGetDefaultMemPool`): the pool that
    /// `cuMemAllocAsync` and other libraries in the process use. On the simulated device, a
    /// pool per device made on first use (release threshold 0, no maximum, as the driver's).
    pub(crate) fn default_pool(device: &Device) -> Result<AsyncPool> {
        let raw = match device.backend() {
            Backend::Cuda(d) => RawPool::Cuda(d.default_pool()?),
            Backend::Sim(d) => RawPool::Sim(Self::sim_default_pool(device, d)),
        };
        Ok(AsyncPool {
            device: device.clone(),
            raw,
            maximum: None,
            owned: false,
        })
    }

    #[cfg(not(streamalloc_loom))]
    fn sim_default_pool(device: &Device, d: &sim::SimDevice) -> PlainArc<sim::memory::SimPool> {
        let mut pools = SIM_DEFAULT_POOLS.lock().unwrap_or_else(|e| e.into_inner());
        pools.retain(|(owner, _)| owner.strong_count() > 0);
        let me = crate::sync::Arc::downgrade(&device.inner);
        if let Some((_, pool)) = pools.iter().find(|(owner, _)| owner.ptr_eq(&me)) {
            return pool.clone();
        }
        let pool = sim::memory::SimPool::create(&d.memory, 0, usize::MAX);
        pools.push((me, pool.clone()));
        pool
    }

    #[cfg(streamalloc_loom)]
    fn sim_default_pool(_: &Device, d: &sim::SimDevice) -> PlainArc<sim::memory::SimPool> {
        sim::memory::SimPool::create(&d.memory, 0, usize::MAX)
    }

    /// A view of an existing driver pool, which this handle uses and never destroys. CUDA
    /// only: a raw pool handle means nothing to the simulated device
    /// ([`Error::InvalidArgument`] there).
    ///
    /// # Safety
    /// `pool` is a live `CUmemoryPool` of `device`'s memory, and stays live as long as this
    /// view and every allocation made through it.
    pub(crate) unsafe fn view(
        device: &Device,
        pool: cudarc::driver::sys::CUmemoryPool,
    ) -> Result<AsyncPool> {
        match device.backend() {
            Backend::Cuda(_) if !pool.is_null() => Ok(AsyncPool {
                device: device.clone(),
                raw: RawPool::Cuda(cuda::Handle(pool)),
                maximum: None,
                owned: false,
            }),
            Backend::Cuda(_) => Err(Error::InvalidArgument {
                what: "a null driver memory pool handle",
            }),
            Backend::Sim(_) => Err(Error::InvalidArgument {
                what: "a raw driver memory pool handle can only be viewed on a CUDA device",
            }),
        }
    }

    /// The driver's handle of the pool (CUDA only), to give to code that uses it directly.
    pub(crate) fn raw_handle(&self) -> Option<cudarc::driver::sys::CUmemoryPool> {
        match &self.raw {
            RawPool::Cuda(p) => Some(p.0),
            RawPool::Sim(_) => None,
        }
    }

    /// Whether two handles use the same pool.
    pub(crate) fn same_pool(&self, other: &AsyncPool) -> bool {
        match (&self.raw, &other.raw) {
            (RawPool::Cuda(a), RawPool::Cuda(b)) => a.0 == b.0,
            (RawPool::Sim(a), RawPool::Sim(b)) => PlainArc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// The pool's identity on its device, for what the resources over it share
    /// ([`Device::pool_shared`]): the driver's handle on CUDA, the simulated pool's address.
    /// Two handles of one pool have the same key.
    pub(crate) fn key(&self) -> usize {
        match &self.raw {
            RawPool::Cuda(p) => p.0 as usize,
            RawPool::Sim(p) => PlainArc::as_ptr(p) as usize,
        }
    }

    pub(crate) fn device(&self) -> &Device {
        &self.device
    }

    /// The pool's limit, or the device's memory.
    pub(crate) fn maximum(&self) -> usize {
        self.maximum.unwrap_or(self.device.total_memory())
    }

    /// The largest request that could ever succeed: the pool's limit, or the device's memory,
    /// which the simulated device hands out in whole blocks (`SimMemory::room`).
    fn largest_request(&self) -> usize {
        match self.device.backend() {
            Backend::Cuda(_) => self.maximum(),
            Backend::Sim(d) => self.maximum().min(d.memory.room().1),
        }
    }

    /// `bytes` (at least one) for work queued on `stream` after this call. On failure:
    /// `OutOfMemory` with what the device has free plus what the pool keeps (capped by the
    /// pool's maximum), and the largest request that could ever succeed; on the simulated
    /// device both in whole blocks, so that a request of `available` succeeds.
    ///
    /// A request larger than the pool's maximum (or the device's memory, in whole blocks on the
    /// simulated device) fails at once, without a driver call.
    pub(crate) fn alloc_async(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        check_size(bytes)?;
        self.device.check_same(stream.device())?;
        if bytes > self.largest_request() {
            return Err(self.oom(
                bytes,
                Error::OutOfMemory {
                    requested: bytes,
                    available: 0,
                    maximum: 0,
                },
            ));
        }
        // Under a user's graph capture `cuMemAllocFromPoolAsync` would make a graph memory
        // node: an address with memory behind it only while the graph runs, which the crate
        // would take for memory of the pool's (a review's finding). Refused instead.
        stream.refuse_while_capturing("an allocation from the driver's pool")?;
        match (&self.raw, self.device.backend(), &*stream.queue_handle()) {
            (RawPool::Cuda(p), Backend::Cuda(d), RawStream::Cuda(s)) => d.pool_alloc(*p, bytes, *s),
            (RawPool::Sim(p), Backend::Sim(d), RawStream::Sim(s)) => d
                .fault(FaultKind::Allocate)
                .and_then(|()| d.pool_alloc(p, bytes, s)),
            _ => Err(mismatch()),
        }
        .map(DevicePtr)
        .map_err(|e| self.oom(bytes, e))
    }

    fn oom(&self, requested: usize, err: Error) -> Error {
        if !err.is_out_of_memory() {
            return err;
        }
        let maximum = self.largest_request();
        let used = self.used().unwrap_or(0);
        let kept = self
            .reserved()
            .map_or(0, |reserved| reserved.saturating_sub(used));
        // The simulated device grants whole 512-byte blocks: its raw free bytes overstated what
        // a request gets (a 1,000-byte device refused 600 bytes with 1,000 available), as
        // `Device::oom`'s did. What the pool keeps is whole blocks already.
        let free = match self.device.backend() {
            Backend::Cuda(_) => self.device.free_memory().unwrap_or(0),
            Backend::Sim(d) => d.memory.room().0,
        };
        let available = free.saturating_add(kept).min(maximum.saturating_sub(used));
        Error::OutOfMemory {
            requested,
            available,
            maximum,
        }
    }

    /// Frees `ptr` in stream order: the pool may reuse it once `stream` reaches this point.
    /// Never blocks.
    ///
    /// # Safety
    /// `ptr` came from `alloc_async` of this pool and is freed once; all work that uses it is
    /// ordered before this point of `stream`.
    pub(crate) unsafe fn free_async(&self, ptr: DevicePtr, stream: &Stream) -> Result<()> {
        self.device.check_same(stream.device())?;
        // Captured, the free would run only at the graph's launches (never, or once a launch):
        // refused, and the memory stays the caller's.
        stream.refuse_while_capturing("a free into the driver's pool")?;
        match (&self.raw, self.device.backend(), &*stream.queue_handle()) {
            // SAFETY: the caller's contract; cuMemFreeAsync takes pool memory of any pool.
            (RawPool::Cuda(_), Backend::Cuda(d), RawStream::Cuda(s)) => unsafe {
                d.free_async(ptr.0, *s)
            },
            (RawPool::Sim(p), Backend::Sim(d), RawStream::Sim(s)) => {
                d.fault(FaultKind::Free)?;
                // Out of the live table now, so that a second free queued before the stream
                // reaches this one is refused here (`begin_free`). A free has no footprint for
                // the race detector to reject, so `push` always queues it, and the stream
                // always completes it.
                p.begin_free(ptr.0)?;
                s.push(sim::Op::PoolFree {
                    pool: p.clone(),
                    ptr: ptr.0,
                })
            }
            _ => Err(mismatch()),
        }
    }

    /// Gives freed memory back to the device, keeping at least `keep` bytes reserved
    /// (`cuMemPoolTrimTo`; nothing if the pool reserves less). Memory whose free the GPU has
    /// not reached stays.
    pub(crate) fn trim_to(&self, keep: usize) -> Result<()> {
        match (&self.raw, self.device.backend()) {
            (RawPool::Cuda(p), Backend::Cuda(d)) => d.pool_trim(*p, keep),
            (RawPool::Sim(p), _) => {
                p.trim_to(keep);
                Ok(())
            }
            _ => Err(mismatch()),
        }
    }

    /// Bytes of device memory the pool holds: in use, and freed but kept.
    pub(crate) fn reserved(&self) -> Result<usize> {
        match (&self.raw, self.device.backend()) {
            (RawPool::Cuda(p), Backend::Cuda(d)) => d.pool_reserved(*p).map(saturate),
            (RawPool::Sim(p), _) => Ok(p.counters().0),
            _ => Err(mismatch()),
        }
    }

    /// Bytes of the pool in live allocations (on CUDA, frees count once the GPU reaches them).
    pub(crate) fn used(&self) -> Result<usize> {
        match (&self.raw, self.device.backend()) {
            (RawPool::Cuda(p), Backend::Cuda(d)) => d.pool_used(*p).map(saturate),
            (RawPool::Sim(p), _) => Ok(p.counters().1),
            _ => Err(mismatch()),
        }
    }

    pub(crate) fn release_threshold(&self) -> Result<u64> {
        match (&self.raw, self.device.backend()) {
            (RawPool::Cuda(p), Backend::Cuda(d)) => d.pool_threshold(*p),
            (RawPool::Sim(p), _) => Ok(p.release_threshold()),
            _ => Err(mismatch()),
        }
    }

    pub(crate) fn set_release_threshold(&self, threshold: u64) -> Result<()> {
        match (&self.raw, self.device.backend()) {
            (RawPool::Cuda(p), Backend::Cuda(d)) => d.set_pool_threshold(*p, threshold),
            (RawPool::Sim(p), _) => {
                p.set_release_threshold(threshold);
                Ok(())
            }
            _ => Err(mismatch()),
        }
    }
}

impl Drop for AsyncPool {
    fn drop(&mut self) {
        if !self.owned {
            // A view: the pool is someone else's (or the device's), and stays.
            return;
        }
        match (&self.raw, self.device.backend()) {
            // SAFETY: the pool is ours, destroyed only here, and `&mut self` means nothing
            // allocates from it any more.
            (RawPool::Cuda(p), Backend::Cuda(d)) => unsafe { d.destroy_pool(*p) },
            (RawPool::Sim(p), _) => p.destroy(),
            _ => {}
        }
    }
}

fn saturate(bytes: u64) -> usize {
    usize::try_from(bytes).unwrap_or(usize::MAX)
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use super::*;
    use crate::device::{SimConfig, SimExecution};

    /// (requested, available, maximum) of an out-of-memory error.
    fn numbers(result: Result<DevicePtr>) -> (usize, usize, usize) {
        match result {
            Err(Error::OutOfMemory {
                requested,
                available,
                maximum,
            }) => (requested, available, maximum),
            other => panic!("not out of memory: {other:?}"),
        }
    }

    /// An out-of-memory error of the simulated driver pool tells the truth: `available` is the
    /// largest request that succeeds now, `maximum` the largest that ever can. Memory goes in
    /// blocks of 512 bytes, so 1,000 bytes hold one: the pool reported the device's raw free
    /// bytes and its unrounded size (`(600, 1000, 1000)`), overriding the simulated memory's
    /// own numbers.
    #[test]
    fn out_of_memory_numbers_are_requests_that_succeed() {
        let device = Device::simulated(SimConfig {
            total_memory: 1000,
            execution: SimExecution::Inline,
            ..SimConfig::default()
        });
        let stream = device.create_stream().unwrap();
        let pool = AsyncPool::new(
            &device,
            AsyncPoolSettings {
                release_threshold: u64::MAX,
                maximum: None,
            },
        )
        .unwrap();
        assert_eq!(numbers(pool.alloc_async(600, &stream)), (600, 512, 512));
        // Larger than the device: refused up front, with the same numbers.
        assert_eq!(numbers(pool.alloc_async(1000, &stream)), (1000, 512, 512));
        // Exactly `available`: granted, and then nothing is left.
        let ptr = pool.alloc_async(512, &stream).unwrap();
        assert_eq!(numbers(pool.alloc_async(1, &stream)), (1, 0, 512));
        // Freed, the pool keeps the block (threshold at its maximum), and counts it available.
        // SAFETY: handed out above on `stream`, unused.
        unsafe { pool.free_async(ptr, &stream) }.unwrap();
        stream.synchronize_blocking().unwrap();
        assert_eq!(pool.reserved().unwrap(), 512);
        assert_eq!(numbers(pool.alloc_async(513, &stream)), (513, 512, 512));
        let ptr = pool.alloc_async(512, &stream).unwrap();
        // SAFETY: handed out above on `stream`, unused.
        unsafe { pool.free_async(ptr, &stream) }.unwrap();

        // A pool limit that the device's whole blocks cannot reach: they bound it.
        let limited = AsyncPool::new(
            &device,
            AsyncPoolSettings {
                release_threshold: 0,
                maximum: Some(700),
            },
        )
        .unwrap();
        stream.synchronize_blocking().unwrap();
        pool.trim_to(0).unwrap();
        assert_eq!(numbers(limited.alloc_async(700, &stream)), (700, 512, 512));
        let ptr = limited.alloc_async(512, &stream).unwrap();
        // SAFETY: handed out above on `stream`, unused.
        unsafe { limited.free_async(ptr, &stream) }.unwrap();
    }
}
