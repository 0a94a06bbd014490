//! The simulated device: the same semantics as a GPU, on host memory, in this process.
//!
//! Each stream is a queue that its own worker thread executes in order; events complete when the
//! worker reaches them; a wait blocks the worker until the other stream's event completes; device
//! memory is host memory at device-like addresses, checked on every access. It is what CI runs,
//! what the tests use when there is no GPU, and what a user without a GPU gets by default.

pub(crate) mod faults;
mod kernels;
pub(crate) mod memory;
pub(crate) mod stream;
pub(crate) mod vmm;

use std::time::Duration;

pub use self::faults::{FaultKind, Faults};
use self::memory::{SimHostMemory, SimMemory};
pub(crate) use self::stream::{HostPtr, Op, SimMarker, SimStream};
use crate::error::Result;
use crate::reactor::{Bell, Doorbells, Watch};
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
        }
    }
}

pub(crate) struct SimDevice {
    pub(crate) config: SimConfig,
    pub(crate) memory: Arc<SimMemory>,
    /// Page-locked host memory (`malloc_host`): plain host memory, tracked.
    pub(crate) host: SimHostMemory,
    /// The reactor's bell, rung by every marker the streams reach.
    pub(crate) bell: Arc<Bell>,
}

impl SimDevice {
    pub(crate) fn new(config: SimConfig, bell: Arc<Bell>) -> Self {
        Self {
            memory: Arc::new(SimMemory::new(config.total_memory)),
            host: SimHostMemory::new(),
            config,
            bell,
        }
    }

    /// `Err` with the injected error if the fault plan says this call of `kind` fails.
    pub(crate) fn fault(&self, kind: FaultKind) -> Result<()> {
        self.config.faults.check(kind)
    }

    pub(crate) fn create_stream(&self, id: u64) -> Result<Arc<SimStream>> {
        self.fault(FaultKind::CreateStream)?;
        SimStream::start(id, self.memory.clone(), &self.config)
    }

    pub(crate) fn record(&self, stream: &SimStream) -> Arc<SimMarker> {
        let marker = Arc::new(SimMarker::new(self.bell.clone()));
        stream.push(Op::Record(marker.clone()));
        marker
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
