//! `Device`: the one place that talks to a GPU, real ([`cuda`]) or simulated ([`sim`]).
//!
//! A `Device` is a cheap clonable handle. Streams, events and (later) resources keep a clone, so
//! the device lives as long as anything that needs it. Each device has one completion reactor
//! thread (see `reactor.rs`).

pub(crate) mod cuda;
mod cuda_peer;
mod cuda_pools;
mod cuda_vmm;
pub(crate) mod cuda_words;
mod cuda_work;
mod cudarc_interop;
mod ids;
pub(crate) mod memory;
mod peer;
pub(crate) mod sim;
pub(crate) mod staging;
pub(crate) mod vmm;
pub(crate) mod word_slots;

use std::fmt;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::reactor::Reactor;
use crate::sync::{Arc, AtomicU64};

pub use self::ids::{DevicePtr, StreamId};

pub use self::sim::{
    FaultKind, Faults, MemoryAccess, Race, RaceBlock, RaceDetection, RaceKind, RaceSite, SimConfig,
    SimExecution,
};

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
    /// event. Behind long work the lead grows to 1/40 of the predicted time, at most four times
    /// this (a worker parked longer wakes more slowly: 500 µs behind 20 ms kernels). `None`:
    /// tasks are woken when the event completes.
    pub reactor_prewake: Option<Duration>,
    /// Completion words (on by default): each stream gets a word of pinned host memory that
    /// the GPU writes right after every event recorded on it
    /// ([`Stream::record`](crate::Stream::record); `cuStreamWriteValue32`, one more driver
    /// call per record, about 1.3 µs on an H100 host), so that the reactor and the tasks
    /// polling an event read a word instead of calling `cuEventQuery`. Calls to the driver
    /// from several threads at once wait for each other; a load does not, and p99 wake-ups
    /// behind 20 µs to 20 ms kernels fell from 13 to 63 µs to 2 to 32 µs over twelve rounds on
    /// four H100 hosts (on the two noisiest of the session, 112 to 126 µs at 200 µs in three
    /// rounds of four: `BENCHMARKS.md`, issue 18). The crate's own events that nothing polls
    /// (those only for another stream to wait on) write no word. The driver is still asked
    /// every 100 µs about an event whose word has not moved, which reports a failed stream.
    /// An event whose word was written reads complete (`Ok`) even if another stream's work
    /// has failed since (the driver's query would report that sticky error). No word is
    /// written while a stream is captured into a graph. Off: every poll is a driver query, and
    /// records cost what the driver's record does.
    pub completion_words: bool,
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
    /// are polled as [`Backoff`](Self::Backoff) does until its sleeps reach
    /// `reactor_max_sleep`; from there their doorbells wake the thread (with 100 ms sleeps as
    /// a backstop), which saves the CPU of a poll every `reactor_max_sleep` (an H200 with
    /// 1,000 events pending on new streams: 7 to 9 ms of CPU a second against 26 to 31) at the
    /// cost of the doorbell's latency for such an event (250 to 450 µs on the VMs measured,
    /// where a poll at the cap would sometimes have seen it sooner).
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
            completion_words: true,
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

    /// The reactor as it was before predictions ([`WakeStrategy::Backoff`], no pre-wake, no
    /// completion words): for comparison.
    pub fn backoff() -> Self {
        Self {
            reactor_strategy: WakeStrategy::Backoff,
            reactor_prewake: None,
            completion_words: false,
            ..Self::default()
        }
    }
}

/// Unique ids for devices (handles of the same GPU opened twice get different ids).
static NEXT_DEVICE_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A GPU, or the simulated device. Clone it freely: clones share the device.
///
/// # The driver's current context
/// On a GPU, every call of the crate first makes the device's primary context current on the
/// calling thread (when it is not already), and leaves it so, as cudarc does. Code on the same
/// thread that uses the CUDA runtime or driver API for another GPU (`cudaSetDevice`,
/// `cuCtxSetCurrent`) must make its own device current again before its own calls.
///
/// # Dropping a device
/// Dropping the last clone of a device frees its pinned host memory (staging blocks, the pages
/// of completion words: `cuMemFreeHost`), and dropping the last device of a GPU in the process
/// unloads the crate's kernels (`cuModuleUnload`). The driver makes both wait for all the work
/// queued in the GPU's context, the user's included: behind a 300 ms kernel, the drop took
/// 300 ms on an H100 (`tests/kernels_outlive_device.rs`, which prints it). Work the crate queued
/// on a cudarc stream that outlives every device (its kernels too) still runs. Drop devices
/// off an async runtime's workers, or after the GPU's work is done, where the wait matters.
///
/// The last clone dropped on a completion reactor thread (captured by an event's callback, or
/// held by a resource a deferred free drops there) is torn down on a short-lived thread,
/// `sa-teardown-N`, instead: those driver calls would hold up every wakeup of the reactor.
#[derive(Clone)]
pub struct Device {
    /// Taken only by `Drop`, which may hand the last one to another thread
    /// (`tear_down_off_reactor`); every other use reads it through the `ManuallyDrop`.
    pub(crate) inner: std::mem::ManuallyDrop<Arc<DeviceInner>>,
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: `inner` is taken once, here, and `self` is not used after its drop.
        let inner = unsafe { std::mem::ManuallyDrop::take(&mut self.inner) };
        // Only the last handle looks at the thread: one thread-local read per device, not per
        // clone dropped.
        if let Some(inner) = last_handle(inner) {
            if crate::offload::on_reactor_thread() {
                tear_down_off_reactor(inner);
            }
        }
    }
}

/// The device itself if `inner` was its last handle; else drops the handle. Atomic with std's
/// `Arc::into_inner`: of two last handles dropped at once, exactly one gets it.
#[cfg(not(streamalloc_loom))]
fn last_handle(inner: Arc<DeviceInner>) -> Option<DeviceInner> {
    Arc::into_inner(inner)
}

/// Under loom the handle is dropped where it is, the device with it if it was the last: loom's
/// `Arc` has no `into_inner`, and its `try_unwrap` is one more loom operation in every drop of
/// every model. Nothing there makes a driver call, and no model drops a device on a reactor.
#[cfg(streamalloc_loom)]
fn last_handle(inner: Arc<DeviceInner>) -> Option<DeviceInner> {
    drop(inner);
    None
}

/// Drops a device whose last handle went on a completion reactor thread on a short-lived
/// thread, `sa-teardown-N`: its teardown (`DeviceInner`'s drop: `cuMemFreeHost` of staging
/// blocks and word pages, destroying cached events and the driver pool, perhaps unloading the
/// kernels) waits for the GPU, and nothing may block the reactor. The whole `DeviceInner` goes,
/// so its drop runs as anywhere else, fields in their documented order. The reactor's loop
/// needs none of it: it owns its queues, bell, doorbells and blocking-work queue, and the
/// `Reactor` handle dropped there only tells it to exit once nothing is left to watch. Not the
/// device's blocking-work thread: the device may have no reactor at all (an inline simulated
/// device dropped on another device's reactor). If the OS refuses the thread, the teardown runs
/// here, logged at error level: late for the reactor's tasks, but not lost.
fn tear_down_off_reactor(inner: DeviceInner) {
    let id = inner.id;
    let name = format!("sa-teardown-{id}");
    // The device comes back with the refusal, so that it can be dropped in place.
    let slot = crate::sync::plain::Arc::new(crate::sync::plain::Mutex::new(Some(inner)));
    let theirs = slot.clone();
    let spawned = match refuse_teardown_thread() {
        Some(refused) => Err(refused),
        None => crate::sync::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                let inner = theirs.lock().unwrap_or_else(|e| e.into_inner()).take();
                if let Err(payload) = crate::completion::catch_unwind(move || drop(inner)) {
                    tracing::error!(
                        device = id,
                        panic = crate::completion::panic_message(&*payload),
                        "a panic in a device's teardown was caught"
                    );
                }
            })
            .map(drop),
    };
    if let Err(e) = spawned {
        tracing::error!(error = %e, thread = %name, device = id, "the OS could not start a device's teardown thread; tearing it down on the completion reactor thread");
        drop(slot.lock().unwrap_or_else(|e| e.into_inner()).take());
    }
}

#[cfg(all(test, not(streamalloc_loom)))]
thread_local! {
    /// Set by a test: the next teardown thread this thread starts is refused, as by an OS out of
    /// threads.
    static REFUSE_TEARDOWN_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The refusal a test asked for ([`REFUSE_TEARDOWN_THREAD`]), once.
#[cfg(all(test, not(streamalloc_loom)))]
fn refuse_teardown_thread() -> Option<std::io::Error> {
    REFUSE_TEARDOWN_THREAD
        .with(|refuse| refuse.replace(false))
        .then(|| std::io::Error::new(std::io::ErrorKind::WouldBlock, "refused by a test"))
}

/// The OS alone refuses a teardown thread outside tests.
#[cfg(not(all(test, not(streamalloc_loom))))]
#[inline]
fn refuse_teardown_thread() -> Option<std::io::Error> {
    None
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
    /// On CUDA with `CudaOptions::completion_words`, the pages of its streams' words.
    pub(crate) words: Option<std::sync::Arc<cuda_words::Words>>,
    /// What the resources over one driver pool share (`CudaAsyncResource`'s waiters, so that a
    /// free through one view wakes a request waiting in another), by the pool's key
    /// (`AsyncPool::key`). Weak: the resources own it; a dead entry is let go at the next
    /// lookup. Std's lock: taken only when such a resource is made, never on an allocation or
    /// a free.
    pub(crate) pool_shared: crate::sync::plain::Mutex<Vec<(usize, PoolShared)>>,
    /// A test's probe: told, at the teardown, whether it runs on a reactor thread, and on which
    /// thread.
    #[cfg(all(test, not(streamalloc_loom)))]
    pub(crate) teardown_probe:
        crate::sync::plain::Mutex<Option<std::sync::mpsc::Sender<(bool, String)>>>,
}

/// An entry of [`DeviceInner::pool_shared`]: type-erased, since the resource layer's type is
/// above this one.
pub(crate) type PoolShared = crate::sync::plain::Weak<dyn std::any::Any + Send + Sync>;

impl Drop for DeviceInner {
    fn drop(&mut self) {
        #[cfg(all(test, not(streamalloc_loom)))]
        if let Some(probe) = self.teardown_probe.lock().unwrap().take() {
            let thread = std::thread::current()
                .name()
                .unwrap_or("<unnamed>")
                .to_owned();
            let _ = probe.send((crate::offload::on_reactor_thread(), thread));
        }
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
    /// The crate's calls into the driver make the device's context current on the calling
    /// thread (`cuCtxSetCurrent`) and leave it so, as cudarc does. Code on the same thread that
    /// uses the CUDA runtime API with another GPU, or pushes and pops contexts itself, sets its
    /// own again after calling into the crate.
    ///
    /// Every device opened on one GPU while another is alive shares its handle of the primary
    /// context and the crate's kernels (each keeps its own reactor, options and streams): the
    /// first open loads the kernels, which waits for work already queued in the context (by
    /// other libraries), and later opens wait for nothing.
    ///
    /// Errors: [`Error::NoDriver`] if `libcuda` cannot be loaded, [`Error::InvalidDevice`] if
    /// there is no such ordinal (with how many devices there are), [`Error::Driver`] if a
    /// driver call fails, [`Error::Io`] if the operating system cannot start the device's
    /// completion reactor thread; a missing driver or GPU is an error, not a panic.
    pub fn cuda(ordinal: usize) -> Result<Device> {
        Self::cuda_with(ordinal, CudaOptions::default())
    }

    /// Opens GPU `ordinal` with the given options.
    pub fn cuda_with(ordinal: usize, options: CudaOptions) -> Result<Device> {
        let backend = cuda::CudaDevice::open(ordinal)?;
        Self::open_cuda(backend, options)
    }

    /// A device handle, with its reactor, on an opened CUDA backend.
    fn open_cuda(backend: cuda::CudaDevice, options: CudaOptions) -> Result<Device> {
        let words = options
            .completion_words
            .then(|| cuda_words::Words::new(backend.ctx.clone()));
        let ordinal = backend.ordinal;
        let id = NEXT_DEVICE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let reactor = Reactor::start(
            format!("sa-reactor-{id}"),
            cuda::CudaDoorbells::new(backend.ctx.clone(), &options),
        )?;
        tracing::info!(
            device = id,
            ordinal,
            name = %backend.name,
            total_memory = backend.total_memory,
            "opened CUDA device"
        );
        Ok(Self::from_parts(id, Backend::Cuda(backend), reactor, words))
    }

    /// An in-process simulated device with the same semantics as a GPU (see [`SimConfig`]).
    ///
    /// Never panics. A device with threaded streams ([`SimExecution::Threads`]) starts its
    /// completion reactor thread here (its streams ring that reactor's bell as they reach
    /// events, so it cannot be started later instead). If the operating system refuses that
    /// thread, the refusal is logged at error level and the device runs its streams inline
    /// instead ([`SimExecution::Inline`]: the same semantics and race detection, needing no
    /// thread, with each operation run by the thread that queues it); its
    /// [`sim_execution`](Self::sim_execution) then says `Inline`. Use
    /// [`try_simulated`](Self::try_simulated) to get the refusal as an error instead. An inline
    /// device starts no thread here.
    pub fn simulated(config: SimConfig) -> Device {
        Self::simulated_starting(config, start_sim_reactor)
    }

    /// [`simulated`](Self::simulated), but a refusal of the reactor thread by the operating
    /// system is an [`Error::Io`] (naming the thread and the OS's message) instead of a
    /// fallback to inline execution. Nothing is started or kept when it returns an error.
    pub fn try_simulated(config: SimConfig) -> Result<Device> {
        Self::try_simulated_starting(config, start_sim_reactor)
    }

    /// [`simulated`](Self::simulated), starting a threaded device's reactor with `start` (a
    /// test's seam: a refusal by the OS).
    pub(crate) fn simulated_starting(
        mut config: SimConfig,
        start: impl FnOnce(String) -> Result<Reactor>,
    ) -> Device {
        let id = NEXT_DEVICE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let reactor = match config.execution {
            SimExecution::Inline => None,
            _ => match start(format!("sa-reactor-{id}")) {
                Ok(reactor) => Some(reactor),
                Err(e) => {
                    // Inline execution is a valid schedule of the same stream order (a GPU
                    // infinitely faster than the host): every event is complete when
                    // recorded, so nothing needs a reactor thread to complete it. Its own
                    // reactor is started lazily, or goes threadless (`lazy_reactor`).
                    tracing::error!(
                        error = %e,
                        device = id,
                        "the OS refused a simulated device's completion reactor thread; the \
                         device runs its streams inline (SimExecution::Inline) instead"
                    );
                    config.execution = SimExecution::Inline;
                    None
                }
            },
        };
        Self::open_sim(id, config, reactor)
    }

    /// [`try_simulated`](Self::try_simulated), starting a threaded device's reactor with
    /// `start` (a test's seam, as [`simulated_starting`](Self::simulated_starting)).
    pub(crate) fn try_simulated_starting(
        config: SimConfig,
        start: impl FnOnce(String) -> Result<Reactor>,
    ) -> Result<Device> {
        let id = NEXT_DEVICE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let reactor = match config.execution {
            SimExecution::Inline => None,
            _ => Some(start(format!("sa-reactor-{id}"))?),
        };
        Ok(Self::open_sim(id, config, reactor))
    }

    /// A simulated device `id` with `reactor`, which a device with threaded streams must have.
    fn open_sim(id: u64, config: SimConfig, reactor: Option<Reactor>) -> Device {
        let backend = sim::SimDevice::new(config, reactor.as_ref().map(Reactor::bell));
        Self::from_parts(id, Backend::Sim(backend), reactor, None)
    }

    /// How a simulated device runs its streams' work (`None` on CUDA): its
    /// [`SimConfig::execution`], or [`SimExecution::Inline`] if the device fell back to it
    /// because the OS refused its reactor thread ([`simulated`](Self::simulated)).
    pub fn sim_execution(&self) -> Option<SimExecution> {
        match &self.inner.backend {
            Backend::Cuda(_) => None,
            Backend::Sim(d) => Some(d.config.execution),
        }
    }

    fn from_parts(
        id: u64,
        backend: Backend,
        reactor: impl Into<Option<Reactor>>,
        words: Option<std::sync::Arc<cuda_words::Words>>,
    ) -> Device {
        let cell = crate::sync::plain::OnceLock::new();
        if let Some(reactor) = reactor.into() {
            let _ = cell.set(reactor);
        }
        Device {
            inner: std::mem::ManuallyDrop::new(Arc::new(DeviceInner {
                id,
                backend,
                reactor: cell,
                streams_created: AtomicU64::new(0),
                staging: staging::Staging::default(),
                words,
                pool_shared: crate::sync::plain::Mutex::new(Vec::new()),
                #[cfg(all(test, not(streamalloc_loom)))]
                teardown_probe: crate::sync::plain::Mutex::new(None),
            })),
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
        let name = format!("sa-reactor-{}", self.inner.id);
        let reactor = lazy_reactor(name.clone(), || Reactor::start(name, sim::SimDoorbells));
        let _ = self.inner.reactor.set(reactor);
        self.inner.reactor.get().expect("set above")
    }

    /// What the resources over the driver pool keyed `key` share: the one that lives, or a
    /// new one from `make` (kept weakly: the callers own it). Taken only when a resource is
    /// made.
    pub(crate) fn pool_shared<T: std::any::Any + Send + Sync>(
        &self,
        key: usize,
        make: impl FnOnce() -> T,
    ) -> crate::sync::plain::Arc<T> {
        let mut entries = (self.inner.pool_shared)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        entries.retain(|(_, shared)| shared.strong_count() > 0);
        let found = entries
            .iter()
            .filter(|(k, _)| *k == key)
            .find_map(|(_, shared)| shared.upgrade()?.downcast::<T>().ok());
        if let Some(shared) = found {
            return shared;
        }
        let made = crate::sync::plain::Arc::new(make());
        let erased: crate::sync::plain::Arc<dyn std::any::Any + Send + Sync> = made.clone();
        entries.push((key, crate::sync::plain::Arc::downgrade(&erased)));
        made
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
}

/// Starts a simulated device's reactor thread, `name`.
fn start_sim_reactor(name: String) -> Result<Reactor> {
    Reactor::start(name, sim::SimDoorbells)
}

/// An inline simulated device's reactor, started on first use by `start`; if the OS refuses
/// its thread, a [threadless](Reactor::threadless) one (logged at error level) rather than an
/// error: the callers (an event's first wait, a deferred free, work handed off a reactor
/// thread) return nothing, or nothing they could fail with, and they need no thread, since an
/// inline device's events are complete when recorded and the blocking-work queue keeps its own
/// fallback. It is kept: the device does not try again.
fn lazy_reactor(name: String, start: impl FnOnce() -> Result<Reactor>) -> Reactor {
    start().unwrap_or_else(|e| {
        tracing::error!(error = %e, "an inline simulated device goes on without a completion reactor thread; its events are completed by whoever hands them over");
        Reactor::threadless(name)
    })
}

/// Runs `job`, a blocking driver call, where it may block: here and now (returning its
/// result) unless this is a reactor thread, else on `device`'s blocking-work thread (returning
/// `Ok(())`; an error is logged with `what`).
pub(crate) fn run_blocking(
    device: &Device,
    what: &'static str,
    job: impl FnOnce() -> Result<()> + Send + 'static,
) -> Result<()> {
    if !crate::offload::on_reactor_thread() {
        return job();
    }
    device.reactor().offload(
        what,
        Box::new(move || {
            if let Err(e) = job() {
                tracing::error!(error = %e, job = what, "blocking work handed off the completion reactor failed");
            }
        }),
    );
    Ok(())
}

/// A stream whose backend is not its device's: impossible through the public API.
pub(crate) fn mismatch() -> Error {
    Error::InvalidArgument {
        what: "stream and device backends differ (a bug in streamalloc)",
    }
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use super::*;

    /// A reactor start that the OS refuses, as `thread::Builder::spawn` reports it.
    fn refused(name: String) -> Result<Reactor> {
        Reactor::start_with(name, sim::SimDoorbells, |_, _| {
            Err(std::io::Error::new(
                std::io::ErrorKind::WouldBlock,
                "resource temporarily unavailable",
            ))
        })
    }

    /// `Device::simulated` with threaded streams, its reactor thread refused by the OS: no
    /// panic (the crate's rule for a refused resource), and a device whose streams, events and
    /// waits work: it falls back to inline execution, which needs no reactor thread. It used
    /// to panic.
    #[test]
    fn a_simulated_device_whose_reactor_thread_is_refused_does_not_panic() {
        let config = SimConfig {
            execution: SimExecution::Threads,
            ..SimConfig::default()
        };
        let device = std::panic::catch_unwind(|| Device::simulated_starting(config, refused))
            .expect("Device::simulated panicked when the OS refused its reactor thread");
        assert_eq!(device.sim_execution(), Some(SimExecution::Inline));
        let stream = device.create_stream().expect("a stream");
        let other = device.create_stream().expect("another stream");
        let event = stream.record().expect("an event");
        other.wait(&event).expect("a wait");
        assert_eq!(futures::executor::block_on(event.clone()), Ok(()));
        assert_eq!(other.synchronize_blocking(), Ok(()));
        assert_eq!(futures::executor::block_on(other.synchronize()), Ok(()));
    }

    /// `Device::try_simulated` returns the refusal as an [`Error::Io`] naming the thread and
    /// the OS's message.
    #[test]
    fn try_simulated_returns_a_refused_reactor_thread_as_an_error() {
        let config = SimConfig {
            execution: SimExecution::Threads,
            ..SimConfig::default()
        };
        let err = Device::try_simulated_starting(config, refused)
            .expect_err("a threaded device without its reactor thread was handed out");
        assert!(
            matches!(err, Error::Io { .. })
                && err.to_string().contains("sa-reactor")
                && err.to_string().contains("unavailable"),
            "{err}"
        );
        let device = Device::try_simulated(SimConfig::default()).expect("a simulated device");
        assert_eq!(device.sim_execution(), Some(SimConfig::default().execution));
    }

    /// A threaded simulated device whose last handle goes on its own completion reactor
    /// thread: held by an event's deferred callback, which first runs `first` there, and by the
    /// event, which the reactor drops once it completed it. Returns where the device was torn
    /// down: whether on a reactor thread, and the thread's name.
    fn drop_last_handle_on_the_reactor(first: impl FnOnce() + Send + 'static) -> (bool, String) {
        let device = Device::simulated(SimConfig {
            execution: SimExecution::Threads,
            ..SimConfig::default()
        });
        let (tx, rx) = std::sync::mpsc::channel();
        *device.inner.teardown_probe.lock().unwrap() = Some(tx);
        let stream = device.create_stream().expect("a stream");
        // The stream waits on a marker that nothing reaches until the test says so: the event
        // recorded behind it is pending, deterministically, when its callback is registered.
        let gate = std::sync::Arc::new(sim::SimMarker::new(None, None));
        match &*stream.queue_handle() {
            crate::stream::RawStream::Sim(s) => s.push(sim::Op::Wait(gate.clone())),
            crate::stream::RawStream::Cuda(_) => unreachable!("a simulated stream"),
        }
        .expect("the wait is queued");
        let event = stream.record().expect("an event");
        let captured = device.clone();
        event.on_complete(Box::new(move |_| {
            first();
            drop(captured);
        }));
        drop((event, stream, device));
        gate.complete(Ok(()));
        // A bound against a hang, not a timing check: the teardown takes microseconds.
        rx.recv_timeout(std::time::Duration::from_secs(60))
            .expect("the device was never torn down")
    }

    /// A device whose last handle goes on its own completion reactor thread: its teardown,
    /// driver calls that wait for the GPU on CUDA, must run on another thread, and run. It ran
    /// on the reactor thread.
    #[test]
    fn a_device_dropped_on_its_reactor_thread_is_torn_down_off_it() {
        let (on_reactor, thread) = drop_last_handle_on_the_reactor(|| {});
        assert!(
            !on_reactor,
            "the device was torn down on a completion reactor thread ({thread})"
        );
        assert!(thread.starts_with("sa-teardown-"), "torn down on {thread}");
    }

    /// The same with the teardown thread refused by the OS: the device is torn down where it
    /// is, on the reactor thread, rather than lost (no panic, no leak).
    #[test]
    fn a_refused_teardown_thread_tears_the_device_down_in_place() {
        let (on_reactor, thread) =
            drop_last_handle_on_the_reactor(|| REFUSE_TEARDOWN_THREAD.with(|r| r.set(true)));
        assert!(on_reactor, "torn down off the reactor, on {thread}");
        assert!(thread.starts_with("sa-reactor-"), "torn down on {thread}");
    }
}
