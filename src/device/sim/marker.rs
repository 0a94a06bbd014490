//! A recorded event of the simulated device ([`SimMarker`]): completed by the stream's worker
//! when it reaches it, waited on by the host and by other streams' workers.

use super::detector::{Detector, Snapshot};
use crate::error::Result;
use crate::reactor::Bell;
use crate::sync::plain::{Arc as PlainArc, AtomicBool as PlainBool, OnceLock};
use crate::sync::{Arc, Condvar, Mutex};

/// A recorded event of the simulated device.
pub(crate) struct SimMarker {
    result: Mutex<Option<Result<()>>>,
    /// An inline stream's marker: its result, set when it is queued (it runs then), before
    /// anyone else can see the marker. Plain, so asking it is no loom operation.
    settled: OnceLock<Result<()>>,
    reached: Condvar,
    /// The reactor's bell; `None` on an inline device, whose markers are reached before anyone
    /// can watch them.
    bell: Option<Arc<Bell>>,
    /// The race detector, and the recording stream's clock (set when the record is queued).
    pub(super) races: Option<PlainArc<Detector>>,
    pub(super) clock: OnceLock<PlainArc<Snapshot>>,
    /// The user's code has seen the marker reached (and the host clock joined its clock).
    seen: PlainBool,
    /// The crate has seen the marker reached (and the detector's crate clock joined its clock).
    checked: PlainBool,
}

impl SimMarker {
    pub(crate) fn new(bell: Option<Arc<Bell>>, races: Option<PlainArc<Detector>>) -> Self {
        Self {
            result: Mutex::new(None),
            settled: OnceLock::new(),
            reached: Condvar::new(),
            bell,
            races,
            clock: OnceLock::new(),
            seen: PlainBool::new(false),
            checked: PlainBool::new(false),
        }
    }

    /// The host has seen the stream reach the marker, in the user's code (it awaited, queried
    /// or synchronized the event; the crate's own looks are
    /// [`checked_by_crate`](Self::checked_by_crate)): the host clock joins the marker's, so
    /// everything queued from now on is ordered after what the marker's stream had done, on
    /// every stream. Only once the marker is reached.
    pub(crate) fn seen_by_host(&self) {
        Self::join_once(&self.seen, || {
            if let (Some(races), Some(clock)) = (&self.races, self.clock.get()) {
                races.host_join(clock);
            }
        });
    }

    /// The crate's own check saw the marker reached (the reactor's poll, `on_complete`): what
    /// the crate does on it is vouched for (a deferred free, a staging block's return), and
    /// none of the user's work is ordered by it (see the detector's module docs).
    fn checked_by_crate(&self) {
        Self::join_once(&self.checked, || {
            if let (Some(races), Some(clock)) = (&self.races, self.clock.get()) {
                races.crate_join(&clock.local);
            }
        });
    }

    /// Runs `join` unless `flag` says it already ran.
    fn join_once(flag: &PlainBool, join: impl FnOnce()) {
        // Set only once joined: a second observer that finds it clear joins again (a join is
        // idempotent) rather than return before the first observer's join is done (the loom
        // model `loom-tests/races.rs`).
        if !flag.load(std::sync::atomic::Ordering::Acquire) {
            join();
            flag.store(true, std::sync::atomic::Ordering::Release);
        }
    }

    /// The stream reached the marker: record the result, release blocked waiters and tell the
    /// reactor.
    pub(crate) fn complete(&self, result: Result<()>) {
        *self.result.lock() = Some(result);
        self.reached.notify_all();
        if let Some(bell) = &self.bell {
            bell.ring();
        }
    }

    /// An inline stream reached the marker as it was queued: nobody can be waiting for it, or
    /// watching it, yet.
    pub(super) fn settle(&self, result: Result<()>) {
        let _ = self.settled.set(result);
    }

    /// The result, if the stream has reached the marker.
    pub(super) fn reached(&self) -> Option<Result<()>> {
        match self.settled.get() {
            Some(result) => Some(result.clone()),
            None => self.result.lock().clone(),
        }
    }

    /// What the stream reached the marker with, if it has: asked by the crate (the reactor,
    /// `on_complete`, and the user's queries, which then also call
    /// [`seen_by_host`](Self::seen_by_host)), so a result tells the race detector the crate
    /// has seen it.
    pub(crate) fn try_result(&self) -> Option<Result<()>> {
        let result = self.reached();
        if result.is_some() {
            self.checked_by_crate();
        }
        result
    }

    /// Blocks the calling thread until the stream reaches the marker (`synchronize_blocking`,
    /// the user's or one of the crate's public calls that waits before it returns: the host
    /// has waited, so it counts as seen by the user).
    pub(crate) fn wait(&self) -> Result<()> {
        let result = self.wait_reached();
        self.seen_by_host();
        result
    }

    /// As `wait`, for another stream's worker (not the host).
    pub(super) fn wait_reached(&self) -> Result<()> {
        if let Some(result) = self.settled.get() {
            return result.clone();
        }
        let mut result = self.result.lock();
        loop {
            if let Some(r) = &*result {
                return r.clone();
            }
            result = self.reached.wait(result);
        }
    }
}
