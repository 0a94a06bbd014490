//! What the soak counts, shared by its tasks.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// Counters of everything the tasks do, and the failures they saw.
#[derive(Default)]
pub struct Tally {
    /// Buffers allocated (by any of the three ways of awaiting).
    pub allocations: AtomicU64,
    /// Their bytes.
    pub bytes: AtomicU64,
    /// Buffers dropped by the tasks (their memory goes back in stream order).
    pub drops: AtomicU64,
    /// Allocations awaited with no limit.
    pub plain_awaits: AtomicU64,
    /// Allocations dropped while they waited (lost a `select!` against a timer).
    pub cancellations: AtomicU64,
    /// Allocations that ran past their deadline (`Error::Timeout`).
    pub deadline_misses: AtomicU64,
    /// Buffers handed to another stream after a GPU-side wait, then read there
    /// (`record` + `wait` + `record_stream`).
    pub handoffs_event: AtomicU64,
    /// Buffers moved to another stream for good, and rewritten there (`wait` for every stream
    /// that used it, then `set_stream`).
    pub handoffs_moved: AtomicU64,
    /// Buffers handed to another stream after the host awaited an event of the first one.
    pub handoffs_host: AtomicU64,
    /// GPU-side waits queued (`Stream::wait`).
    pub gpu_waits: AtomicU64,
    /// Host waits by `.await` (events, `synchronize`).
    pub host_waits: AtomicU64,
    /// Fills with a pattern.
    pub fills: AtomicU64,
    /// Check kernels launched, and the bytes they checked.
    pub checks: AtomicU64,
    pub bytes_checked: AtomicU64,
    /// Invariant checks run, and the failures (their messages).
    pub invariant_checks: AtomicU64,
    pub failures: Mutex<Vec<String>>,
}

impl Tally {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Relaxed)
    }

    pub fn fail(&self, what: String) {
        eprintln!("soak: FAILURE: {what}");
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        failures.push(what);
    }

    pub fn failures(&self) -> Vec<String> {
        self.failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn handoffs(&self) -> u64 {
        Self::get(&self.handoffs_event)
            + Self::get(&self.handoffs_moved)
            + Self::get(&self.handoffs_host)
    }
}

/// Bytes for people: `12.3 GiB`, `512 KiB`, `300 B`.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}
