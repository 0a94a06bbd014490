//! What the benchmarks share: WORKLOADS.md's generator, a process clock, a waker that stamps
//! when it is woken, and quantiles.

#![allow(dead_code)] // each benchmark uses its own part

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

/// splitmix64, exactly as `shared/bench/WORKLOADS.md` specifies it.
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

static BASE: OnceLock<Instant> = OnceLock::new();

/// Nanoseconds since the first call (call it once early).
pub fn now_ns() -> u64 {
    BASE.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// A waker that stamps the time it is first woken, then wakes the task's own waker.
pub struct Stamp {
    at: AtomicU64,
    inner: Mutex<Option<Waker>>,
}

impl Stamp {
    pub fn new() -> Arc<Self> {
        Arc::new(Stamp {
            at: AtomicU64::new(0),
            inner: Mutex::new(None),
        })
    }

    /// When it was woken (`now_ns`), or 0 if never.
    pub fn woken_at(&self) -> u64 {
        self.at.load(Ordering::Acquire)
    }
}

impl Wake for Stamp {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref()
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let _ = self
            .at
            .compare_exchange(0, now_ns(), Ordering::AcqRel, Ordering::Acquire);
        if let Some(w) = self.inner.lock().unwrap().as_ref() {
            w.wake_by_ref();
        }
    }
}

/// Awaits `fut` through a [`Stamp`] waker.
pub struct Stamped<F> {
    fut: Pin<Box<F>>,
    stamp: Arc<Stamp>,
}

impl<F> Stamped<F> {
    pub fn new(fut: F, stamp: Arc<Stamp>) -> Self {
        Self {
            fut: Box::pin(fut),
            stamp,
        }
    }
}

impl<F: Future> Future for Stamped<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        *self.stamp.inner.lock().unwrap() = Some(cx.waker().clone());
        let waker = Waker::from(self.stamp.clone());
        self.fut.as_mut().poll(&mut Context::from_waker(&waker))
    }
}

/// "median p99 max" of nanosecond samples (negative ones count as zero).
pub fn quantiles(mut v: Vec<i64>) -> String {
    v.sort();
    let at =
        |q: f64| Duration::from_nanos(v[((v.len() - 1) as f64 * q).round() as usize].max(0) as u64);
    format!("{:>9.1?} {:>9.1?} {:>9.1?}", at(0.5), at(0.99), at(1.0))
}
