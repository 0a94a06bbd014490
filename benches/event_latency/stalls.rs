//! The host's stalls (issue 18): a thread that only spins on the clock, beside each cell, notes
//! every gap between two of its reads longer than [`NOTED`]. A spinning thread that stops for
//! 50 µs was not running: the OS or the hypervisor took its CPU. Any thread the wake path needs
//! (the reactor, a tokio worker polling a pre-woken task) can lose its CPU the same way, so the
//! share of instants at which a spinner would be 50 µs late bounds from below the share of
//! samples that no design running on this host can bring under 50 µs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Gaps shorter than this are the loop's own noise, not stalls.
const NOTED: Duration = Duration::from_micros(10);
/// How late counts as late: issue 18's p99 bound.
const LATE: Duration = Duration::from_micros(50);

/// The spinner, running until [`stop`](Self::stop).
pub struct Spinner {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<(Vec<Duration>, Duration)>,
}

/// What a spinner saw.
pub struct Stalls {
    /// Every gap of at least `NOTED`.
    gaps: Vec<Duration>,
    /// How long it spun.
    wall: Duration,
}

impl Spinner {
    /// Starts spinning on a thread of its own.
    pub fn start() -> Spinner {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("bench-spinner".into())
            .spawn(move || {
                let (start, mut last, mut gaps) = (Instant::now(), Instant::now(), Vec::new());
                while !flag.load(Ordering::Relaxed) {
                    let now = Instant::now();
                    if now - last >= NOTED {
                        gaps.push(now - last);
                    }
                    last = now;
                }
                (gaps, start.elapsed())
            })
            .expect("a spinner thread");
        Spinner { stop, thread }
    }

    /// Stops it and says what it saw.
    pub fn stop(self) -> Stalls {
        self.stop.store(true, Ordering::Relaxed);
        let (gaps, wall) = self.thread.join().expect("the spinner");
        Stalls { gaps, wall }
    }
}

impl Stalls {
    /// Stalls of at least 50 µs per second, the longest, and the share of instants at which a
    /// spinning thread would have been at least 50 µs late (inside a stall with 50 µs or more
    /// of it left).
    pub fn summary(&self) -> String {
        let long = self.gaps.iter().filter(|g| **g >= LATE).count();
        format!(
            "stalls >= 50µs {:.1}/s, longest {:.1?}, 50µs late at {:.3}% of instants",
            long as f64 / self.secs(),
            self.gaps.iter().max().copied().unwrap_or_default(),
            self.late_share()
        )
    }

    /// The share of instants (%) at which a spinning thread would have been at least 50 µs
    /// late.
    pub fn late_share(&self) -> f64 {
        let late: Duration = (self.gaps.iter())
            .filter(|g| **g >= LATE)
            .map(|g| *g - LATE)
            .sum();
        late.as_secs_f64() / self.secs() * 100.0
    }

    fn secs(&self) -> f64 {
        self.wall.as_secs_f64().max(1e-9)
    }
}
