//! The simulated device: the same semantics as a GPU, on host memory, in this process.
//!
//! Each stream is a queue that its own worker thread executes in order; events complete when the
//! worker reaches them; a wait blocks the worker until the other stream's event completes; device
//! memory is host memory at device-like addresses, checked on every access. It is what CI runs,
//! what the tests use when there is no GPU, and what a user without a GPU gets by default.

pub(crate) mod detector;
pub(crate) mod faults;
pub(crate) mod granules;
mod hooks;
mod host_bytes;
mod kernels;
mod marker;
pub(crate) mod memory;
mod op;
pub(crate) mod races;
pub(crate) mod stream;
pub(crate) mod vmm;

use std::time::Duration;

use self::detector::{Detector, Reuse};
pub use self::faults::{FaultKind, Faults};
pub(crate) use self::kernels::pattern_u32;
pub(crate) use self::marker::SimMarker;
use self::memory::{SimHostMemory, SimMemory, SimPool};
pub(crate) use self::op::{HostPtr, Op};
pub use self::races::{MemoryAccess, Race, RaceBlock, RaceDetection, RaceKind, RaceSite};
pub(crate) use self::stream::SimStream;
use crate::device::StreamId;
use crate::error::Result;
use crate::reactor::{Bell, Doorbells, Watch};
use crate::sync::plain::Arc as PlainArc;
use crate::sync::Arc;

/// Settings of a simulated device.
///
/// ```
/// use std::time::Duration;
/// use streamalloc::SimConfig;
///
/// // Slow every operation down by 50-150 µs to widen race windows in a test.
/// let config = SimConfig {
///     op_delay: Duration::from_micros(50),
///     op_jitter: Duration::from_micros(100),
///     ..SimConfig::default()
/// };
/// ```
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// The name the device reports.
    pub name: String,
    /// The device memory it pretends to have, in bytes. Host memory is only used for what is
    /// allocated (and, for large allocations, only for the pages that are touched).
    pub total_memory: usize,
    /// A delay before every stream operation.
    pub op_delay: Duration,
    /// A further random delay, up to this long, before every stream operation (deterministic
    /// for a given `seed` and stream).
    pub op_jitter: Duration,
    /// Seed of the jitter.
    pub seed: u64,
    /// Driver faults to inject (none by default). Keep a clone to arm it while the device
    /// runs; see [`Faults`].
    pub faults: Faults,
    /// The stream-order race detector: whether it runs and what it does with a race (by
    /// default it panics in builds with debug assertions, and records and logs otherwise). See
    /// [`RaceDetection`] and the README's "Testing your own code".
    pub race_detection: RaceDetection,
    /// Who runs the streams' work: a worker thread per stream ([`SimExecution::Threads`], the
    /// default), or the host thread that queues each operation, at once
    /// ([`SimExecution::Inline`], the default under `--cfg streamalloc_loom`, for loom models
    /// of your code).
    pub execution: SimExecution,
}

/// Who runs the simulated device's stream work ([`SimConfig::execution`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SimExecution {
    /// Each stream has a worker thread that runs its queue in order, beside the host, as a
    /// GPU does: an event completes some time after it is recorded, and the completion
    /// reactor wakes its waiters.
    Threads,
    /// Each operation runs on the thread that queues it, before the call returns: the device
    /// is a GPU infinitely faster than the host. Every event has completed by the time
    /// `record` returns, so awaiting one (or a stream's `synchronize`) never waits, and no
    /// thread is started: no stream worker and, unless something needs it, no completion
    /// reactor. Stream order and the race detector work as with threads: the detector judges
    /// by stream order (its clocks), not by when work runs, so it reports the same races.
    /// What it cannot show is work that is late: host code that reads the result of device
    /// work it did not wait for reads it finished.
    ///
    /// It is made for loom models of code that uses streamalloc (README, "Testing your own
    /// code"), where every thread of the crate is one more thread for loom to interleave and
    /// loom allows five; it is also a deterministic device for ordinary unit tests. A wait on
    /// an event of another simulated device that runs [`Threads`](Self::Threads) blocks the
    /// queueing thread until that event completes.
    Inline,
}

impl Default for SimExecution {
    /// [`Inline`](Self::Inline) under `--cfg streamalloc_loom`, else
    /// [`Threads`](Self::Threads).
    fn default() -> Self {
        if cfg!(streamalloc_loom) {
            SimExecution::Inline
        } else {
            SimExecution::Threads
        }
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            name: "streamalloc simulated device".to_owned(),
            total_memory: 16 << 30,
            op_delay: Duration::ZERO,
            op_jitter: Duration::ZERO,
            seed: 0,
            faults: Faults::new(),
            race_detection: RaceDetection::default(),
            execution: SimExecution::default(),
        }
    }
}

pub(crate) struct SimDevice {
    pub(crate) config: SimConfig,
    pub(crate) memory: PlainArc<SimMemory>,
    /// Page-locked host memory (`malloc_host`): plain host memory, tracked, which device work
    /// may use as on a GPU.
    pub(crate) host: SimHostMemory,
    /// The reactor's bell, rung by every marker the streams reach; `None` when the streams run
    /// inline (their markers are reached before anyone can watch them).
    pub(crate) bell: Option<Arc<Bell>>,
    /// The stream-order race detector, unless it is off.
    pub(crate) races: Option<PlainArc<Detector>>,
}

impl SimDevice {
    pub(crate) fn new(config: SimConfig, bell: Option<Arc<Bell>>) -> Self {
        let memory = PlainArc::new(SimMemory::new(config.total_memory));
        let races = (config.race_detection != RaceDetection::Off)
            .then(|| PlainArc::new(Detector::new(config.race_detection)));
        if let Some(races) = &races {
            // Other devices' streams find it to check their peer copies' reads of this memory
            // and to forward what the host has seen (see the detector's module docs).
            detector::register(&memory, races);
        }
        Self {
            memory,
            host: SimHostMemory::new(),
            races,
            config,
            bell,
        }
    }

    /// `Err` with the injected error if the fault plan says this call of `kind` fails.
    pub(crate) fn fault(&self, kind: FaultKind) -> Result<()> {
        self.config.faults.check(kind)
    }

    pub(crate) fn create_stream(&self, id: StreamId) -> Result<Arc<SimStream>> {
        self.fault(FaultKind::CreateStream)?;
        SimStream::start(id, self.memory.clone(), &self.config, self.races.as_ref())
    }

    pub(crate) fn record(&self, stream: &SimStream) -> Result<Arc<SimMarker>> {
        let marker = Arc::new(SimMarker::new(self.bell.clone(), self.races.clone()));
        stream.push(Op::Record(marker.clone()))?;
        Ok(marker)
    }

    // ===== device memory, as the race detector sees it =====

    /// `cuMemAlloc`: memory any later work may use (its allocation point is the host's). Short
    /// of memory, it takes what the device's driver pools keep and tries again, as the driver
    /// does ([`SimMemory::release_pools`]).
    pub(crate) fn malloc(&self, bytes: usize) -> Result<u64> {
        let ptr = match self.memory.alloc(bytes) {
            Err(e) if e.is_out_of_memory() && self.memory.release_pools() => {
                self.memory.alloc(bytes)?
            }
            other => other?,
        };
        self.track_allocation(ptr, bytes)
    }

    /// `cuMemAllocManaged`: as [`malloc`](Self::malloc), but short of memory it fails without
    /// touching the driver pools. (Whether the driver takes pool memory for managed memory was
    /// not measured: managed memory may oversubscribe the GPU, so it rarely fails there.)
    pub(crate) fn malloc_managed(&self, bytes: usize) -> Result<u64> {
        let ptr = self.memory.alloc_managed(bytes)?;
        self.track_allocation(ptr, bytes)
    }

    /// `cuMemPrefetchAsync`: nothing to move (the simulated device has one memory), but memory
    /// known not to be managed (this device's from `cuMemAlloc`, a pool or a reservation, and
    /// page-locked host memory) is refused at the call with `CUDA_ERROR_INVALID_VALUE`, as the
    /// driver refuses it; a review found it taken, so a wrong prefetch passed here and failed on
    /// a GPU. Memory this device does not know (another device's, which may be managed) is
    /// taken, as before.
    pub(crate) fn prefetch(&self, ptr: u64, bytes: usize) -> Result<()> {
        if bytes == 0 || !self.memory.is_unmanaged(ptr, bytes) {
            return Ok(());
        }
        Err(crate::error::Error::Driver {
            call: "cuMemPrefetchAsync",
            code: 1,
            name: format!(
                "CUDA_ERROR_INVALID_VALUE (the simulated device: {ptr:#x}, {bytes} bytes, is not \
                 managed memory)"
            ),
        })
    }

    /// Tells the race detector of a new allocation that any later work may use.
    fn track_allocation(&self, ptr: u64, bytes: usize) -> Result<u64> {
        if let Some(races) = &self.races {
            let race = races.allocate(None, ptr, bytes, true, Reuse::Check);
            races.settle(race, false)?;
        }
        Ok(ptr)
    }

    /// `cuMemAllocAsync`: memory for work queued on `stream` from here on. The device hands
    /// an address out again only once the free that gave it back has run (the simulated
    /// memory frees a block when its stream reaches the free): that orders the reuse, as for a
    /// driver pool's ([`Reuse::Device`]). Checked against the free's stream order, an address
    /// the sweep had come round to was reported as reused before its free (a review's
    /// finding).
    pub(crate) fn malloc_async(&self, bytes: usize, stream: &SimStream) -> Result<u64> {
        let ptr = self.memory.alloc(bytes)?;
        if let Some((races, idx)) = stream.races() {
            let race = races.allocate(Some(idx), ptr, bytes, true, Reuse::Device);
            races.settle(race, false)?;
        }
        Ok(ptr)
    }

    /// `cuMemAllocFromPoolAsync`: a driver pool reuses a block only once its free has run,
    /// which orders this block's new owner after the old one's free (and nothing else of the
    /// allocating stream: the reuse follows from when the free ran, not from stream order).
    pub(crate) fn pool_alloc(
        &self,
        pool: &SimPool,
        bytes: usize,
        stream: &SimStream,
    ) -> Result<u64> {
        let ptr = pool.alloc(bytes)?;
        if let Some((races, idx)) = stream.races() {
            let race = races.allocate(Some(idx), ptr, bytes, true, Reuse::Device);
            races.settle(race, false)?;
        }
        Ok(ptr)
    }

    /// `cuMemHostAlloc`: page-locked host memory, which work on any stream may read and write
    /// (through its address, as device memory, or as the host side of a copy). The race
    /// detector tracks it as a raw allocation of the host, as `cuMemAlloc`'s: the uses of it
    /// by this device's streams are checked against each other and against its free
    /// ([`free_host`](Self::free_host)). It was not known to the detector, so work on two
    /// streams racing on pinned memory, or a free of it under a queued copy, went unreported.
    /// Work of another simulated device on it is not checked (each detector knows its own
    /// device's allocations): a missed race, never a false one.
    pub(crate) fn malloc_host(&self, bytes: usize) -> Result<*mut u8> {
        let ptr = self.host.alloc(bytes)?;
        self.track_allocation(ptr as u64, bytes)?;
        Ok(ptr)
    }

    /// `cuMemFreeHost`: as [`free_now`](Self::free_now), every use by a stream must be ordered
    /// before what the host (or the crate) has seen complete; then the detector forgets the
    /// block (see [`Detector::free_pinned`]). `InvalidAddress` for a pointer this device did
    /// not hand out, which the detector does not know either.
    pub(crate) fn free_host(&self, ptr: *mut u8) -> Result<()> {
        let race = self.races.as_ref().and_then(|races| {
            // Only this device's own blocks: a pointer of another device's (refused below)
            // may still be one of that device's live pinned blocks, and the shadow here has
            // no raw block at its address.
            self.host
                .owns(ptr)
                .then(|| races.free_pinned(ptr as u64))
                .flatten()
        });
        let freed = self.host.free(ptr);
        if let Some(races) = &self.races {
            races.settle(race, false)?;
        }
        freed
    }

    /// `cuMemFree`: every use must be ordered before what the host has seen complete (or the
    /// crate has: see the detector's module docs).
    /// Noted before the memory is freed (and another thread may allocate it again); a race's
    /// panic (the `Panic` mode) comes once it is freed, so that a caller that catches it has
    /// not lost the memory.
    pub(crate) fn free_now(&self, ptr: u64) -> Result<()> {
        let race = match &self.races {
            Some(races) if self.memory.is_allocation(ptr) => {
                races.free(None, ptr, None, true, false)
            }
            _ => None,
        };
        let freed = self.memory.free(ptr);
        if let Some(races) = &self.races {
            races.settle(race, false)?;
        }
        freed
    }
}

/// The simulated device needs no doorbells: every marker rings the bell when its stream
/// reaches it.
pub(crate) struct SimDoorbells;

impl Doorbells for SimDoorbells {
    fn spin(&self) -> Duration {
        Duration::ZERO
    }

    fn max_sleep(&self) -> Option<Duration> {
        None
    }

    fn arm(&mut self, _: &dyn Watch, _: &Arc<Bell>) -> bool {
        true
    }

    fn forget(&mut self, _: u64) {}
}
