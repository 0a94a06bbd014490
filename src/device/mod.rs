//! `Device`: the one place that talks to a GPU, real ([`cuda`]) or simulated ([`sim`]).
//!
//! A `Device` is a cheap clonable handle. Streams, events and (later) resources keep a clone, so
//! the device lives as long as anything that needs it. Each device has one completion reactor
//! thread (see `reactor.rs`).

pub(crate) mod cuda;
pub(crate) mod sim;

use std::fmt;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::reactor::Reactor;
use crate::stream::Stream;
use crate::sync::{Arc, AtomicU64, Ordering};

pub use self::sim::SimConfig;

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
/// pending the reactor polls: in a hot loop for `reactor_spin` after each completion or new
/// registration, then between sleeps that double from 20 µs up to `reactor_max_sleep`. With
/// nothing pending it parks and uses no CPU.
#[derive(Debug, Clone)]
pub struct CudaOptions {
    /// How long the reactor polls in a hot loop after the last completion or registration.
    /// Longer keeps the wake latency at a few µs for GPU work of up to that length, at the cost
    /// of up to that much CPU per burst; zero goes straight to sleeping polls.
    pub reactor_spin: Duration,
    /// The longest sleep between polls while events are pending: the worst-case added latency
    /// for long GPU work, against about one cheap poll per sleep of CPU.
    pub reactor_max_sleep: Duration,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            reactor_spin: Duration::from_micros(500),
            reactor_max_sleep: Duration::from_millis(1),
        }
    }
}

impl CudaOptions {
    /// Poll in a hot loop for as long as any event is pending: wake latency of a few µs
    /// whatever the length of the GPU work, for one core kept busy while work is pending (no
    /// CPU when nothing is). What `cudaStreamSynchronize` does by default, but for every
    /// awaiting task at once.
    pub fn low_latency() -> Self {
        Self {
            reactor_spin: Duration::from_secs(3600),
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
    pub(crate) reactor: Reactor,
    /// Streams created so far (for ids in logs; stream ids themselves are global).
    pub(crate) streams_created: AtomicU64,
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
        let id = NEXT_DEVICE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let reactor = Reactor::start(
            format!("sa-reactor-{id}"),
            cuda::CudaDoorbells::new(
                backend.ctx.clone(),
                options.reactor_spin,
                options.reactor_max_sleep,
            ),
        );
        tracing::info!(
            device = id,
            ordinal,
            name = %backend.name,
            total_memory = backend.total_memory,
            "opened CUDA device"
        );
        Ok(Self::from_parts(id, Backend::Cuda(backend), reactor))
    }

    /// An in-process simulated device with the same semantics as a GPU (see [`SimConfig`]).
    ///
    /// # Panics
    /// Only if the operating system cannot start the reactor thread, as `std::thread::spawn`.
    pub fn simulated(config: SimConfig) -> Device {
        let id = NEXT_DEVICE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let reactor = Reactor::start(format!("sa-reactor-{id}"), sim::SimDoorbells);
        let backend = sim::SimDevice::new(config, reactor.bell());
        Self::from_parts(id, Backend::Sim(backend), reactor)
    }

    fn from_parts(id: u64, backend: Backend, reactor: Reactor) -> Device {
        Device {
            inner: Arc::new(DeviceInner {
                id,
                backend,
                reactor,
                streams_created: AtomicU64::new(0),
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

    pub(crate) fn reactor(&self) -> &Reactor {
        &self.inner.reactor
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
            Backend::Sim(d) => d.memory.alloc(bytes),
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
            Backend::Sim(d) => d.memory.free(ptr.0),
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
            (Backend::Sim(d), crate::stream::RawStream::Sim(_)) => d.memory.alloc(bytes),
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
            (Backend::Sim(_), crate::stream::RawStream::Sim(s)) => {
                s.push(sim::Op::Free(ptr.0));
                Ok(())
            }
            _ => Err(mismatch()),
        }
    }
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
