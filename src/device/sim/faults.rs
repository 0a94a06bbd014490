//! Fault injection for the simulated device: make the Nth driver call of a kind fail, every call
//! of a kind, or each with a probability and a seed, so that every error path of the layers
//! above can be driven by a test.
//!
//! A [`Faults`] plan is shared: [`SimConfig::faults`](super::SimConfig::faults) holds one, the
//! device keeps it, and the test keeps a clone to arm and disarm it while the device runs. When
//! nothing is armed a call costs one relaxed atomic load.

use std::fmt;

use crate::error::{Error, Result};
// Plain std: a test's own switchboard, not a protocol for loom to explore (and so a `SimConfig`
// can be made outside a loom model). No loom operation runs under the plan's lock.
use crate::sync::plain::{Arc, AtomicBool, Mutex, MutexGuard};
use std::sync::atomic::Ordering;

/// The kinds of driver call the simulated device can be made to fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FaultKind {
    /// Device memory allocation: `cuMemAlloc`, `cuMemAllocManaged`, `cuMemAllocFromPoolAsync`.
    Allocate,
    /// Device memory free: `cuMemFree`, `cuMemFreeAsync`.
    Free,
    /// Page-locked host allocation (`cuMemHostAlloc`).
    HostAllocate,
    /// Page-locked host free (`cuMemFreeHost`).
    HostFree,
    /// Recording an event (`cuEventRecord`).
    Record,
    /// Making a stream wait for an event (`cuStreamWaitEvent`).
    Wait,
    /// Queueing a copy or a memset (`cuMemcpy*Async`, `cuMemsetD*Async`).
    Copy,
    /// Launching a kernel (the built-in fill, scale, spin and pattern kernels).
    Launch,
    /// Blocking synchronization of a stream (`cuStreamSynchronize`).
    Synchronize,
    /// Creating a stream (`cuStreamCreate`).
    CreateStream,
    /// Not an error: a stream's wait (`cuStreamWaitEvent`) that this rule fires on is dropped
    /// and reported as done, as a bug that forgets the wait would. For showing that the race
    /// detector ([`SimConfig::race_detection`](super::SimConfig::race_detection)) catches
    /// what the missing order allows (a pool's reuse of memory freed on another stream, a copy on another stream).
    /// Checked after [`Wait`](Self::Wait), on waits that did not fail.
    SkipWait,
    /// Creating physical memory for a virtual memory mapping (`cuMemCreate`): what fails when
    /// the device is out of memory as an expandable pool grows.
    MemCreate,
    /// Mapping physical memory into a reserved address range (`cuMemMap`).
    MemMap,
    /// Asking whether a stream is idle (`cuStreamQuery`): [`Stream::is_idle`](crate::Stream::is_idle),
    /// and the pools' opportunistic reuse, which takes a failed query as a busy stream.
    Query,
}

impl FaultKind {
    /// The driver call an injected error of this kind names.
    pub fn call(self) -> &'static str {
        match self {
            FaultKind::Allocate => "cuMemAlloc",
            FaultKind::Free => "cuMemFree",
            FaultKind::HostAllocate => "cuMemHostAlloc",
            FaultKind::HostFree => "cuMemFreeHost",
            FaultKind::Record => "cuEventRecord",
            FaultKind::Wait | FaultKind::SkipWait => "cuStreamWaitEvent",
            FaultKind::Copy => "cuMemcpyAsync",
            FaultKind::Launch => "cuLaunchKernel",
            FaultKind::Synchronize => "cuStreamSynchronize",
            FaultKind::CreateStream => "cuStreamCreate",
            FaultKind::MemCreate => "cuMemCreate",
            FaultKind::MemMap => "cuMemMap",
            FaultKind::Query => "cuStreamQuery",
        }
    }

    /// The error an injected fault of this kind returns: out of memory for allocations (what a
    /// driver says when it fails them), `CUDA_ERROR_UNKNOWN` otherwise.
    pub fn error(self) -> Error {
        let (code, name) = match self {
            FaultKind::Allocate | FaultKind::HostAllocate | FaultKind::MemCreate => {
                (2, "CUDA_ERROR_OUT_OF_MEMORY")
            }
            _ => (999, "CUDA_ERROR_UNKNOWN"),
        };
        Error::Driver {
            call: self.call(),
            code,
            name: format!("{name} (injected by the simulated device)"),
        }
    }
}

/// When a rule fires.
#[derive(Debug)]
enum Trigger {
    /// The call that brings the count of this kind's calls (since the rule was armed) to this.
    Nth(u64),
    /// Every call.
    Always,
    /// Each call with this probability, drawn from a splitmix64 stream.
    Random { probability: f64, state: u64 },
}

#[derive(Debug)]
struct Rule {
    kind: FaultKind,
    trigger: Trigger,
    /// Calls of `kind` seen since the rule was armed.
    seen: u64,
}

#[derive(Debug, Default)]
struct Plan {
    rules: Vec<Rule>,
    /// Faults injected so far, per kind.
    injected: Vec<(FaultKind, u64)>,
}

/// A shared plan of driver faults for a simulated device (see the module docs). Clones share
/// the plan.
///
/// ```
/// use streamalloc::{Device, FaultKind, Faults, SimConfig};
///
/// let faults = Faults::new();
/// let device = Device::simulated(SimConfig { faults: faults.clone(), ..SimConfig::default() });
/// let stream = device.create_stream().unwrap();
/// faults.fail_next(FaultKind::Record);
/// let err = stream.record().unwrap_err();
/// assert!(err.to_string().contains("cuEventRecord"));
/// assert!(stream.record().is_ok()); // one fault, then calls work again
/// assert_eq!(faults.injected(FaultKind::Record), 1);
/// ```
#[derive(Clone, Default)]
pub struct Faults {
    inner: Arc<FaultsInner>,
}

#[derive(Default)]
struct FaultsInner {
    /// True while any rule is armed: the one load a call pays when nothing is.
    armed: AtomicBool,
    plan: Mutex<Plan>,
}

impl FaultsInner {
    /// The plan; a panic elsewhere while it was held leaves it as it was.
    fn plan(&self) -> MutexGuard<'_, Plan> {
        self.plan.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl fmt::Debug for Faults {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plan = self.inner.plan();
        f.debug_struct("Faults")
            .field("rules", &plan.rules)
            .field("injected", &plan.injected)
            .finish()
    }
}

impl Faults {
    /// An empty plan: no call fails.
    pub fn new() -> Faults {
        Faults::default()
    }

    fn arm(&self, kind: FaultKind, trigger: Trigger) {
        let mut plan = self.inner.plan();
        plan.rules.push(Rule {
            kind,
            trigger,
            seen: 0,
        });
        self.inner.armed.store(true, Ordering::Release);
    }

    /// The `n`th call of `kind` from now on fails (`n = 1`: the next one), once.
    /// `n = 0` is taken as 1.
    pub fn fail_nth(&self, kind: FaultKind, n: u64) {
        self.arm(kind, Trigger::Nth(n.max(1)));
    }

    /// The next call of `kind` fails, once.
    pub fn fail_next(&self, kind: FaultKind) {
        self.fail_nth(kind, 1);
    }

    /// Every call of `kind` fails until [`clear`](Self::clear).
    pub fn fail_always(&self, kind: FaultKind) {
        self.arm(kind, Trigger::Always);
    }

    /// Each call of `kind` fails with `probability` (0 to 1), drawn deterministically from
    /// `seed`, until [`clear`](Self::clear).
    pub fn fail_randomly(&self, kind: FaultKind, probability: f64, seed: u64) {
        self.arm(
            kind,
            Trigger::Random {
                probability: probability.clamp(0.0, 1.0),
                state: seed,
            },
        );
    }

    /// Disarms every rule: calls work again. The counts of injected faults stay.
    pub fn clear(&self) {
        let mut plan = self.inner.plan();
        plan.rules.clear();
        self.inner.armed.store(false, Ordering::Release);
    }

    /// How many faults of `kind` were injected so far.
    pub fn injected(&self, kind: FaultKind) -> u64 {
        let plan = self.inner.plan();
        plan.injected
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or(0, |(_, n)| *n)
    }

    /// Called by the simulated device before a call of `kind`: `Err` with the injected error
    /// if the plan says this call fails.
    pub(crate) fn check(&self, kind: FaultKind) -> Result<()> {
        if !self.inner.armed.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut plan = self.inner.plan();
        let mut fire = false;
        plan.rules.retain_mut(|rule| {
            if rule.kind != kind {
                return true;
            }
            rule.seen += 1;
            match &mut rule.trigger {
                Trigger::Nth(n) => {
                    if rule.seen == *n {
                        fire = true;
                        return false; // a one-shot rule is spent
                    }
                }
                Trigger::Always => fire = true,
                Trigger::Random { probability, state } => {
                    let draw = (splitmix64(state) >> 11) as f64 / (1u64 << 53) as f64;
                    fire |= draw < *probability;
                }
            }
            true
        });
        if plan.rules.is_empty() {
            self.inner.armed.store(false, Ordering::Release);
        }
        if !fire {
            return Ok(());
        }
        match plan.injected.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, n)) => *n += 1,
            None => plan.injected.push((kind, 1)),
        }
        drop(plan);
        tracing::debug!(call = kind.call(), "injected a simulated driver fault");
        Err(kind.error())
    }
}

/// WORKLOADS.md's generator, so a seed gives the same faults everywhere. (The crate's own
/// tests and `engine_lab` draw from it too.)
pub(crate) fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
