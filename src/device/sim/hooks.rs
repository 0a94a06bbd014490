//! What the race detector asks of the layers above, and offers them: resources that carve
//! blocks out of device memory tell the device when they hand one out and take it back
//! ([`Device::note_allocation`], [`Device::note_free`]), user code declares the memory its own
//! simulated work touches ([`Stream::declare_access`](crate::Stream::declare_access)), and
//! tests read the races found ([`Device::races`]). On CUDA, and with the detector off, each is
//! a no-op. The hooks that take a stream are the stream layer's (`stream/sim_hooks.rs`); the
//! simulated device's side of them is here.

use super::detector::{Detector, PendingFree, Reuse};
use super::races::{Race, RaceDetection};
use super::SimDevice;
use crate::device::{Backend, Device};
use crate::sync::plain::Arc as PlainArc;

impl Device {
    /// The stream-order races the simulated device has found so far (see
    /// [`RaceDetection`]); always empty on CUDA and with the detector off.
    pub fn races(&self) -> Vec<Race> {
        match self.backend() {
            Backend::Sim(SimDevice {
                races: Some(races), ..
            }) => races.races(),
            _ => Vec::new(),
        }
    }

    /// Takes the races found so far, leaving the list empty (for a test that plants one and
    /// then checks the rest of its run is clean).
    pub fn take_races(&self) -> Vec<Race> {
        match self.backend() {
            Backend::Sim(SimDevice {
                races: Some(races), ..
            }) => races.take_races(),
            _ => Vec::new(),
        }
    }

    /// What the race detector does with a race: [`RaceDetection::Off`] on CUDA.
    pub fn race_detection(&self) -> RaceDetection {
        match self.backend() {
            Backend::Sim(d) => d.config.race_detection,
            Backend::Cuda(_) => RaceDetection::Off,
        }
    }
}

impl SimDevice {
    /// The detector's side of [`Device::note_allocation`](crate::Device::note_allocation).
    pub(crate) fn note_allocation(&self, ptr: u64, bytes: usize, stream: &super::SimStream) {
        if let Some((races, idx)) = stream.races() {
            let race = races.allocate(Some(idx), ptr, bytes, false, Reuse::Check);
            let _ = races.settle(race, false);
        }
    }

    /// The detector's side of [`Device::note_free`](crate::Device::note_free): the free,
    /// pending until the caller has put the block back (or refused it), with the detector to
    /// confirm or refuse it then.
    pub(crate) fn note_free(
        &self,
        ptr: u64,
        bytes: usize,
        stream: &super::SimStream,
    ) -> Option<(PlainArc<Detector>, PendingFree)> {
        let (races, idx) = stream.races()?;
        let pending = races.free_pending(idx, ptr, bytes);
        Some((races.clone(), pending))
    }
}
