//! `Device`: the one place that talks to a GPU, real ([`cuda`]) or simulated ([`sim`]).
//!
//! A `Device` is a cheap clonable handle. Streams, events and (later) resources keep a clone, so
//! the device lives as long as anything that needs it. Each device has one completion reactor
//! thread (see `reactor.rs`).

pub(crate) mod cuda;
mod cuda_vmm;
mod cudarc_interop;
mod peer;
pub(crate) mod sim;
pub(crate) mod staging;
pub(crate) mod vmm;

use std::fmt;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::reactor::Reactor;
use crate::stream::Stream;
use crate::sync::{Arc, AtomicU64, Ordering};

pub use self::sim::{
    FaultKind, Faults, MemoryAccess, Race, RaceBlock, RaceDetection, RaceKind, RaceSite, SimConfig,
    SimExecution,
};

/// A device address. Plain data: holding one is safe, using it is what the unsafe methods of
/// [`Stream`] and [`Device`] guard.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The raw address (a `CUdeviceptr` on CUDA).
    pub fn as_raw(self) -> u64 {
        self.0
    }

    /// The address `bytes` further on. Wraps on overflow, like pointer arithmetic on the GPU.
    pub fn offset(self, bytes: usize) -> DevicePtr {
        DevicePtr(self.0.wrapping_add(bytes as u64))
    }
}

impl fmt::Debug for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DevicePtr({:#x})", self.0)
    }
}

/// Which kind of device a [`Device`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// A real GPU, through the CUDA driver.
    Cuda,
    /// The in-process simulated device.
    Simulated,
}

/// Settings of a CUDA device handle: how its completion reactor waits for the GPU.
///
/// On the H200 we measured, the driver's own ways to wake a sleeping thread (host functions,
/// blocking-sync events) arrive 250-450 µs after an event once the wait is longer than ~100 µs,
/// while polling sees it within ~1 µs (`benches/doorbell_probe.rs`). So while events are
/// pending the reactor polls; [`reactor_strategy`](Self::reactor_strategy) says when. With
/// nothing pending it parks and uses no CPU, whatever the strategy.
#[derive(Debug, Clone)]
pub struct CudaOptions {
    /// When the reactor polls while events are pending (see [`WakeStrategy`]).
    pub reactor_strategy: WakeStrategy,
    /// How long the reactor polls in a hot loop after the last completion or registration, for
    /// events it has no prediction for ([`WakeStrategy::Predict`]) or for all of them
    /// ([`WakeStrategy::Backoff`]). Longer keeps the wake latency at a few µs for GPU work of
    /// up to that length, at the cost of up to that much CPU per burst; zero goes straight to
    /// sleeping polls.
    pub reactor_spin: Duration,
    /// The longest sleep between polls while events without a prediction are pending: the
    /// worst-case added latency for long GPU work, against about one cheap poll per sleep of
    /// CPU.
    pub reactor_max_sleep: Duration,
    /// With [`WakeStrategy::Predict`]: wake the tasks awaiting an event this long before its
    /// predicted completion, and have them poll it until it completes (each poll of the future
    /// wakes its own task again, so the runtime's worker never parks), or until the prediction
    /// proves wrong. This hides the runtime's wakeup of a parked worker (a futex wake, ~140 µs
    /// on the VM we measured) at the cost of that worker's CPU for about this long per awaited
    /// event. `None`: tasks are woken when the event completes.
    pub reactor_prewake: Option<Duration>,
}

/// When a CUDA device's completion reactor polls the GPU while events are pending. Measured
/// side by side by `benches/event_latency.rs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WakeStrategy {
    /// Predict when each stream's oldest watched event completes, from that stream's history
    /// (the time its recent events took from the moment the GPU could start on them to their
    /// completion), sleep until just before the prediction and poll in a hot loop through it.
    /// The margin adapts to how late the thread's sleeps end and how far off the predictions
    /// were. Events without a prediction (a stream's first, or one past all its predictions)
    /// are polled as [`Backoff`](Self::Backoff) does.
    Predict,
    /// Poll in a hot loop for `reactor_spin` after each completion or registration, then
    /// between sleeps that double from 20 µs up to `reactor_max_sleep`, with a doorbell (a host
    /// function behind the event) to cut a sleep short. The strategy before predictions.
    Backoff,
    /// Poll in a hot loop for as long as any event is pending: a core kept busy while work is
    /// pending (none when nothing is).
    Spin,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            reactor_strategy: WakeStrategy::Predict,
            reactor_spin: Duration::from_micros(500),
            reactor_max_sleep: Duration::from_millis(1),
            reactor_prewake: Some(Duration::from_micros(250)),
        }
    }
}

impl CudaOptions {
    /// Poll in a hot loop for as long as any event is pending ([`WakeStrategy::Spin`]): wake
    /// latency of a few µs whatever the length of the GPU work, for one core kept busy while
    /// work is pending (no CPU when nothing is). What `cudaStreamSynchronize` does by default,
    /// but for every awaiting task at once.
    pub fn low_latency() -> Self {
        Self {
            reactor_strategy: WakeStrategy::Spin,
            reactor_prewake: None,
            ..Self::default()
        }
    }

    /// The reactor as it was before predictions ([`WakeStrategy::Backoff`], no pre-wake): for
    /// comparison.
    pub fn backoff() -> Self {
        Self {
            reactor_strategy: WakeStrategy::Backoff,
            reactor_prewake: None,
            ..Self::default()
        }
    }
}

/// Unique ids for devices (handles of the same GPU opened twice get different ids).
static NEXT_DEVICE_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A GPU, or the simulated device. Clone it freely: clones share the device.
#[derive(Clone)]
pub struct Device {
    pub(crate) inner: Arc<DeviceInner>,
}

pub(crate) struct DeviceInner {
    pub(crate) id: u64,
    pub(crate) backend: Backend,
    /// Declared after `backend`, so it shuts down after the backend's handles are released.
    /// Set at once, except on a simulated device whose streams run inline: nothing there waits
    /// for its events (they complete as they are recorded), so its reactor, a thread, is only
    /// started if something asks for it (`Device::reactor`).
    pub(crate) reactor: crate::sync::plain::OnceLock<Reactor>,
    /// Streams created so far (for ids in logs; stream ids themselves are global).
    pub(crate) streams_created: AtomicU64,
    /// Pinned blocks for the buffers' host copies.
    pub(crate) staging: staging::Staging,
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        for block in self.staging.drain() {
            // SAFETY: cached blocks are ours and unused (a block is cached only after the copy
            // that used it completed); the backend is still alive (fields drop after this).
            let freed = match &self.backend {
                Backend::Cuda(d) => unsafe { d.free_host(block.ptr) },
                Backend::Sim(d) => d.host.free(block.ptr),
            };
            if let Err(e) = freed {
                tracing::warn!(error = %e, "could not free a staging block");
            }
        }
    }
}

pub(crate) enum Backend {
    Cuda(cuda::CudaDevice),
    Sim(sim::SimDevice),
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("id", &self.id())
            .field("kind", &self.kind())
            .field("name", &self.name())
            .finish()
    }
}

/// `CUDA device 0 (NVIDIA H200)` or `simulated device (streamalloc simulated device)`.
impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.ordinal() {
            Some(ordinal) => write!(f, "CUDA device {ordinal} ({})", self.name()),
            None => write!(f, "simulated device ({})", self.name()),
        }
    }
}

impl Device {
    /// Opens GPU `ordinal` through the CUDA driver, with default [`CudaOptions`].
    ///
    /// Errors: [`Error::NoDriver`] if `libcuda` cannot be loaded, [`Error::InvalidDevice`] if
    /// there is no such ordinal (with how many devices there are), [`Error::Driver`] if a
    /// driver call fails. Never panics.
    pub fn cuda(ordinal: usize) -> Result<Device> {
        Self::cuda_with(ordinal, CudaOptions::default())
    }

    /// Opens GPU `ordinal` with the given options.
    pub fn cuda_with(ordinal: usize, options: CudaOptions) -> Result<Device> {
        let backend = cuda::CudaDevice::open(ordinal)?;
        Ok(Self::open_cuda(backend, options))
    }

    /// A device handle, with its reactor, on an opened CUDA backend.
    fn open_cuda(backend: cuda::CudaDevice, options: CudaOptions) -> Device {
        let ordinal = backend.ordinal;
        let id = NEXT_DEVICE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let reactor = Reactor::start(
            format!("sa-reactor-{id}"),
            cuda::CudaDoorbells::new(backend.ctx.clone(), &options),
        );
        tracing::info!(
            device = id,
            ordinal,
            name = %backend.name,
            total_memory = backend.total_memory,
            "opened CUDA device"
        );
        Self::from_parts(id, Backend::Cuda(backend), reactor)
    }

    /// An in-process simulated device with the same semantics as a GPU (see [`SimConfig`]).
    ///
    /// # Panics
    /// Only if the operating system cannot start the reactor thread, as `std::thread::spawn`.
    pub fn simulated(config: SimConfig) -> Device {
        let id = NEXT_DEVICE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let reactor = (config.execution != SimExecution::Inline)
            .then(|| Reactor::start(format!("sa-reactor-{id}"), sim::SimDoorbells));
        let backend = sim::SimDevice::new(config, reactor.as_ref().map(Reactor::bell));
        Self::from_parts(id, Backend::Sim(backend), reactor)
    }

    fn from_parts(id: u64, backend: Backend, reactor: impl Into<Option<Reactor>>) -> Device {
        let cell = crate::sync::plain::OnceLock::new();
        if let Some(reactor) = reactor.into() {
            let _ = cell.set(reactor);
        }
        Device {
            inner: Arc::new(DeviceInner {
                id,
                backend,
                reactor: cell,
                streams_created: AtomicU64::new(0),
                staging: staging::Staging::default(),
            }),
        }
    }

    /// CUDA device 0 if a driver and a GPU are there, else a simulated device with default
    /// settings; it logs which (at `info`) and why.
    ///
    /// `STREAMALLOC_DEVICE` overrides the choice: `cuda` or `cuda:N` (an error if that GPU
    /// cannot be opened), `sim` or `simulated`.
    pub fn default_device() -> Result<Device> {
        match std::env::var("STREAMALLOC_DEVICE").ok().as_deref() {
            Some("sim") | Some("simulated") => {
                tracing::info!("STREAMALLOC_DEVICE asks for the simulated device");
                return Ok(Device::simulated(SimConfig::default()));
            }
            Some("cuda") => return Device::cuda(0),
            Some(other) if other.starts_with("cuda:") => {
                let ordinal = other[5..].parse().map_err(|_| Error::InvalidArgument {
                    what: "STREAMALLOC_DEVICE must be `cuda`, `cuda:N`, `sim` or `simulated`",
                })?;
                return Device::cuda(ordinal);
            }
            Some(_) => {
                return Err(Error::InvalidArgument {
                    what: "STREAMALLOC_DEVICE must be `cuda`, `cuda:N`, `sim` or `simulated`",
                })
            }
            None => {}
        }
        match Device::cuda(0) {
            Ok(device) => {
                tracing::info!(name = %device.name(), "default device: CUDA device 0");
                Ok(device)
            }
            Err(why) => {
                tracing::info!(reason = %why, "default device: simulated (no usable GPU)");
                Ok(Device::simulated(SimConfig::default()))
            }
        }
    }

    /// How many CUDA devices the driver reports: `Err(NoDriver)` without a driver, `Ok(0)` with
    /// a driver but no GPU.
    pub fn cuda_device_count() -> Result<usize> {
        cuda::driver_device_count()
    }

    /// A process-unique id of this device handle (clones share it).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// Whether this is a real GPU or the simulated device.
    pub fn kind(&self) -> DeviceKind {
        match self.inner.backend {
            Backend::Cuda(_) => DeviceKind::Cuda,
            Backend::Sim(_) => DeviceKind::Simulated,
        }
    }

    /// The fault plan of a simulated device (`None` on CUDA): arm it to make driver calls
    /// fail. See [`Faults`].
    pub fn faults(&self) -> Option<&Faults> {
        match &self.inner.backend {
            Backend::Cuda(_) => None,
            Backend::Sim(d) => Some(&d.config.faults),
        }
    }

    /// True for the simulated device.
    pub fn is_simulated(&self) -> bool {
        self.kind() == DeviceKind::Simulated
    }

    /// The CUDA ordinal, for a real GPU.
    pub fn ordinal(&self) -> Option<usize> {
        match &self.inner.backend {
            Backend::Cuda(d) => Some(d.ordinal),
            Backend::Sim(_) => None,
        }
    }

    /// The device's name, e.g. `NVIDIA H200`.
    pub fn name(&self) -> &str {
        match &self.inner.backend {
            Backend::Cuda(d) => &d.name,
            Backend::Sim(d) => &d.config.name,
        }
    }

    /// Total device memory in bytes.
    pub fn total_memory(&self) -> usize {
        match &self.inner.backend {
            Backend::Cuda(d) => d.total_memory,
            Backend::Sim(d) => d.config.total_memory,
        }
    }

    /// Device memory free right now, in bytes (memory that pools hold counts as used).
    pub fn free_memory(&self) -> Result<usize> {
        match &self.inner.backend {
            Backend::Cuda(d) => d.mem_info().map(|(free, _)| free),
            Backend::Sim(d) => Ok(d.memory.info().0),
        }
    }

    /// A new stream on this device (non-blocking with respect to the legacy default stream).
    pub fn create_stream(&self) -> Result<Stream> {
        self.inner.streams_created.fetch_add(1, Ordering::Relaxed);
        Stream::new(self)
    }

    /// How many handles share this device: its clones, and every stream and event of it (each
    /// holds one), including events the reactor still watches. Once all of those are gone it
    /// is 1 again, which is how the tests check that nothing leaked.
    pub fn handle_count(&self) -> usize {
        Arc::strong_count(&self.inner)
    }

    /// The device's completion reactor, started here if it was not yet (an inline simulated
    /// device's: see `DeviceInner::reactor`).
    pub(crate) fn reactor(&self) -> &Reactor {
        if let Some(reactor) = self.inner.reactor.get() {
            return reactor;
        }
        // Only an inline device gets here. Its markers never ring a bell: they are reached
        // before anyone can watch them, so the reactor completes each at its first poll (the
        // registration rings its own bell). Started outside the cell's lock (a loom thread
        // must not be switched out inside a std lock); a racing thread's reactor is dropped,
        // which stops its thread.
        let reactor = Reactor::start(format!("sa-reactor-{}", self.inner.id), sim::SimDoorbells);
        let _ = self.inner.reactor.set(reactor);
        self.inner.reactor.get().expect("set above")
    }

    /// The device's completion reactor if it runs (see [`reactor`](Self::reactor)).
    pub(crate) fn started_reactor(&self) -> Option<&Reactor> {
        self.inner.reactor.get()
    }

    pub(crate) fn backend(&self) -> &Backend {
        &self.inner.backend
    }

    /// `Err(WrongDevice)` unless `other` is this device.
    pub(crate) fn check_same(&self, other: &Device) -> Result<()> {
        if self.id() == other.id() {
            Ok(())
        } else {
            Err(Error::WrongDevice {
                expected: self.id(),
                found: other.id(),
            })
        }
    }

    fn oom(&self, requested: usize, err: Error) -> Error {
        if err.is_out_of_memory() {
            Error::OutOfMemory {
                requested,
                available: self.free_memory().unwrap_or(0),
                maximum: self.total_memory(),
            }
        } else {
            err
        }
    }

    /// The host's numbers for an out-of-memory error of page-locked host memory.
    fn host_oom(requested: usize, err: Error) -> Error {
        if err.is_out_of_memory() {
            let (available, maximum) = host_memory().unwrap_or((0, 0));
            Error::OutOfMemory {
                requested,
                available,
                maximum,
            }
        } else {
            err
        }
    }

    // ===== raw memory =====

    /// Allocates `bytes` of device memory (`cuMemAlloc`), synchronously: slow (it may
    /// synchronize the device) and meant for the layers above, which pool it.
    ///
    /// Errors: [`Error::InvalidSize`] for zero bytes, [`Error::OutOfMemory`] when the device
    /// cannot provide them.
    pub fn malloc(&self, bytes: usize) -> Result<DevicePtr> {
        check_size(bytes)?;
        match &self.inner.backend {
            Backend::Cuda(d) => d.malloc(bytes),
            Backend::Sim(d) => d.fault(FaultKind::Allocate).and_then(|()| d.malloc(bytes)),
        }
        .map(DevicePtr)
        .map_err(|e| self.oom(bytes, e))
    }

    /// Frees memory from [`malloc`](Self::malloc).
    ///
    /// # Safety
    /// `ptr` came from `malloc` on this device, is freed once, and no queued or running work
    /// still uses it.
    pub unsafe fn free(&self, ptr: DevicePtr) -> Result<()> {
        match &self.inner.backend {
            // SAFETY: the caller's contract.
            Backend::Cuda(d) => unsafe { d.free(ptr.0) },
            Backend::Sim(d) => d.fault(FaultKind::Free).and_then(|()| d.free_now(ptr.0)),
        }
    }

    /// Frees memory from [`malloc`](Self::malloc) or [`malloc_managed`](Self::malloc_managed)
    /// once the work queued so far on `stream` has run. On CUDA this is `cuMemFree`, which
    /// itself waits for the device's pending work before it frees (so the calling thread may
    /// block); the simulated device queues the free on `stream` instead, so that a use still
    /// queued there does not fault.
    ///
    /// `Err(UnknownPointer)` on the simulated device for a pointer that is not a live
    /// allocation (the driver reports its own error on CUDA).
    ///
    /// # Safety
    /// `ptr` came from `malloc` or `malloc_managed` on this device and is freed once; all work
    /// that uses it is ordered before this point of `stream`.
    pub(crate) unsafe fn free_after(&self, ptr: DevicePtr, stream: &Stream) -> Result<()> {
        self.check_same(stream.device())?;
        match (&self.inner.backend, stream.raw()) {
            // SAFETY: the caller's contract; cuMemFree waits for the device's pending work,
            // which includes every use queued on `stream`.
            (Backend::Cuda(d), crate::stream::RawStream::Cuda(_)) => unsafe { d.free(ptr.0) },
            (Backend::Sim(d), crate::stream::RawStream::Sim(s)) => {
                d.fault(FaultKind::Free)?;
                if !d.memory.is_allocation(ptr.0) {
                    return Err(Error::UnknownPointer {
                        ptr: ptr.0,
                        bytes: 0,
                    });
                }
                s.push(sim::Op::Free(ptr.0))
            }
            _ => Err(mismatch()),
        }
    }

    /// Allocates `bytes` of managed (unified) memory (`cuMemAllocManaged`, attached
    /// globally): usable by work on every stream and, on a GPU, by the host. Free it with
    /// [`free`](Self::free). On the simulated device it is device memory like
    /// [`malloc`](Self::malloc)'s (the host cannot dereference it there).
    ///
    /// The driver lets managed memory oversubscribe the GPU, and on some machines asking for
    /// more than the card has can hang it: check [`free_memory`](Self::free_memory) first, as
    /// `ManagedResource` does.
    ///
    /// Errors: [`Error::InvalidSize`] for zero bytes, [`Error::OutOfMemory`] when the driver
    /// refuses.
    pub fn malloc_managed(&self, bytes: usize) -> Result<DevicePtr> {
        check_size(bytes)?;
        match &self.inner.backend {
            Backend::Cuda(d) => d.malloc_managed(bytes),
            Backend::Sim(d) => d.fault(FaultKind::Allocate).and_then(|()| d.malloc(bytes)),
        }
        .map(DevicePtr)
        .map_err(|e| self.oom(bytes, e))
    }

    /// Allocates `bytes` of page-locked host memory (`cuMemHostAlloc`, portable and mapped):
    /// the host reads and writes it through the returned pointer, copies to and from it run
    /// without staging, and with unified addressing the GPU can use the same address. At
    /// least 256-aligned. Slow (the pages are pinned one by one): pool it. On the simulated
    /// device it is ordinary host memory, zeroed.
    ///
    /// A request for more than the host's available memory fails at once, without asking the
    /// driver: pinned memory cannot be swapped out.
    ///
    /// Errors: [`Error::InvalidSize`] for zero bytes, [`Error::OutOfMemory`] (with the host's
    /// available and total memory where the platform reports them, else zeros).
    pub fn malloc_host(&self, bytes: usize) -> Result<*mut u8> {
        check_size(bytes)?;
        if let Some((available, maximum)) = host_memory() {
            if bytes > available {
                return Err(Error::OutOfMemory {
                    requested: bytes,
                    available,
                    maximum,
                });
            }
        }
        match &self.inner.backend {
            Backend::Cuda(d) => d.malloc_host(bytes),
            Backend::Sim(d) => d
                .fault(FaultKind::HostAllocate)
                .and_then(|()| d.host.alloc(bytes)),
        }
        .map_err(|e| Self::host_oom(bytes, e))
    }

    /// Frees memory from [`malloc_host`](Self::malloc_host). On CUDA `cuMemFreeHost` may wait
    /// for the device. `Err(InvalidAddress)` on the simulated device for a pointer it did not
    /// hand out.
    ///
    /// # Safety
    /// `ptr` came from `malloc_host` on this device and is freed once; no queued or running
    /// work and no host code uses it any more.
    pub unsafe fn free_host(&self, ptr: *mut u8) -> Result<()> {
        match &self.inner.backend {
            // SAFETY: the caller's contract.
            Backend::Cuda(d) => unsafe { d.free_host(ptr) },
            Backend::Sim(d) => d.fault(FaultKind::HostFree).and_then(|()| d.host.free(ptr)),
        }
    }

    /// Allocates `bytes` in stream order from the driver's stream-ordered allocator
    /// (`cuMemAllocFromPoolAsync`), from a pool this device handle owns whose release
    /// threshold is raised so freed memory stays pooled. The memory may be used by work queued
    /// on `stream` after this call, and elsewhere once ordered after it.
    pub fn malloc_async(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        check_size(bytes)?;
        self.check_same(stream.device())?;
        match (&self.inner.backend, stream.raw()) {
            (Backend::Cuda(d), crate::stream::RawStream::Cuda(s)) => d.malloc_async(bytes, *s),
            (Backend::Sim(d), crate::stream::RawStream::Sim(s)) => d
                .fault(FaultKind::Allocate)
                .and_then(|()| d.malloc_async(bytes, s)),
            _ => Err(mismatch()),
        }
        .map(DevicePtr)
        .map_err(|e| self.oom(bytes, e))
    }

    /// Frees memory from [`malloc_async`](Self::malloc_async) in stream order: it becomes
    /// reusable when `stream` reaches this point. Never blocks.
    ///
    /// # Safety
    /// `ptr` came from `malloc_async` on this device and is freed once; all work that uses it
    /// is ordered before this point of `stream`.
    pub unsafe fn free_async(&self, ptr: DevicePtr, stream: &Stream) -> Result<()> {
        self.check_same(stream.device())?;
        match (&self.inner.backend, stream.raw()) {
            // SAFETY: the caller's contract.
            (Backend::Cuda(d), crate::stream::RawStream::Cuda(s)) => unsafe {
                d.free_async(ptr.0, *s)
            },
            (Backend::Sim(d), crate::stream::RawStream::Sim(s)) => {
                d.fault(FaultKind::Free)?;
                s.push(sim::Op::Free(ptr.0))
            }
            _ => Err(mismatch()),
        }
    }
}

// ===== driver memory pools =====

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
    Vec<(std::sync::Weak<DeviceInner>, Arc<sim::memory::SimPool>)>,
> = std::sync::Mutex::new(Vec::new());

enum RawPool {
    Cuda(cuda::RawPool),
    Sim(Arc<sim::memory::SimPool>),
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
            Backend::Sim(d) => RawPool::Sim(Arc::new(sim::memory::SimPool::new(
                d.memory.clone(),
                settings.release_threshold,
                usize::MAX,
            ))),
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
            Backend::Cuda(d) => {
                // Here rather than in cuda.rs, which holds every other driver call, only
                // because this change was limited to this section; it belongs there.
                d.ctx.bind()?;
                let dev = cudarc::driver::result::device::get(d.ordinal as i32)
                    .map_err(|e| Error::driver("cuDeviceGet", e))?;
                let mut pool: cudarc::driver::sys::CUmemoryPool = std::ptr::null_mut();
                // SAFETY: `dev` is a valid device (the context is retained) and `pool` is a
                // place for one handle, which the driver writes on success.
                unsafe { cudarc::driver::sys::cuDeviceGetDefaultMemPool(&mut pool, dev) }
                    .result()
                    .map_err(|e| Error::driver("cuDeviceGetDefaultMemPool", e))?;
                RawPool::Cuda(cuda::Handle(pool))
            }
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
    fn sim_default_pool(device: &Device, d: &sim::SimDevice) -> Arc<sim::memory::SimPool> {
        let mut pools = SIM_DEFAULT_POOLS.lock().unwrap_or_else(|e| e.into_inner());
        pools.retain(|(owner, _)| owner.strong_count() > 0);
        let me = Arc::downgrade(&device.inner);
        if let Some((_, pool)) = pools.iter().find(|(owner, _)| owner.ptr_eq(&me)) {
            return pool.clone();
        }
        let pool = Arc::new(sim::memory::SimPool::new(d.memory.clone(), 0, usize::MAX));
        pools.push((me, pool.clone()));
        pool
    }

    #[cfg(streamalloc_loom)]
    fn sim_default_pool(_: &Device, d: &sim::SimDevice) -> Arc<sim::memory::SimPool> {
        Arc::new(sim::memory::SimPool::new(d.memory.clone(), 0, usize::MAX))
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
            (RawPool::Sim(a), RawPool::Sim(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    pub(crate) fn device(&self) -> &Device {
        &self.device
    }

    /// The pool's limit, or the device's memory.
    pub(crate) fn maximum(&self) -> usize {
        self.maximum.unwrap_or(self.device.total_memory())
    }

    /// `bytes` (at least one) for work queued on `stream` after this call. On failure:
    /// `OutOfMemory` with what the device has free plus what the pool keeps (capped by the
    /// pool's maximum).
    ///
    /// A request larger than the pool's maximum (or the device's memory) fails at once,
    /// without a driver call.
    pub(crate) fn alloc_async(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        check_size(bytes)?;
        self.device.check_same(stream.device())?;
        if bytes > self.maximum() {
            return Err(self.oom(
                bytes,
                Error::OutOfMemory {
                    requested: bytes,
                    available: 0,
                    maximum: 0,
                },
            ));
        }
        match (&self.raw, self.device.backend(), stream.raw()) {
            (RawPool::Cuda(p), Backend::Cuda(d), crate::stream::RawStream::Cuda(s)) => {
                d.pool_alloc(*p, bytes, *s)
            }
            (RawPool::Sim(p), Backend::Sim(d), crate::stream::RawStream::Sim(s)) => d
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
        let maximum = self.maximum();
        let used = self.used().unwrap_or(0);
        let kept = self
            .reserved()
            .map_or(0, |reserved| reserved.saturating_sub(used));
        let available = self
            .device
            .free_memory()
            .unwrap_or(0)
            .saturating_add(kept)
            .min(maximum.saturating_sub(used));
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
        match (&self.raw, self.device.backend(), stream.raw()) {
            // SAFETY: the caller's contract; cuMemFreeAsync takes pool memory of any pool.
            (RawPool::Cuda(_), Backend::Cuda(d), crate::stream::RawStream::Cuda(s)) => unsafe {
                d.free_async(ptr.0, *s)
            },
            (RawPool::Sim(p), Backend::Sim(d), crate::stream::RawStream::Sim(s)) => {
                d.fault(FaultKind::Free)?;
                if !p.owns(ptr.0) {
                    return Err(Error::UnknownPointer {
                        ptr: ptr.0,
                        bytes: 0,
                    });
                }
                s.push(sim::Op::PoolFree {
                    pool: p.clone(),
                    ptr: ptr.0,
                })
            }
            _ => Err(mismatch()),
        }
    }

    /// Gives freed memory back to the device until the pool holds at most `keep` bytes, or
    /// nothing it can release (memory whose free the GPU has not reached stays).
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

/// The host's (available, total) memory in bytes, where the platform reports them
/// (`/proc/meminfo` on Linux).
fn host_memory() -> Option<(usize, usize)> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| -> Option<usize> {
        let line = info.lines().find(|l| l.starts_with(name))?;
        let kib: usize = line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        kib.checked_mul(1024)
    };
    let total = field("MemTotal:")?;
    let available = field("MemAvailable:").unwrap_or(total);
    Some((available, total))
}

fn check_size(bytes: usize) -> Result<()> {
    if bytes == 0 {
        Err(Error::InvalidSize {
            size: 0,
            reason: "a device allocation needs at least one byte",
        })
    } else {
        Ok(())
    }
}

/// A stream whose backend is not its device's: impossible through the public API.
pub(crate) fn mismatch() -> Error {
    Error::InvalidArgument {
        what: "stream and device backends differ (a bug in streamalloc)",
    }
}
