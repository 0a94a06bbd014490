//! The race detector's hooks that take a stream: a resource's allocation and free of a block
//! on a stream ([`Device::note_allocation`], [`Device::note_free`]), a user's declared access
//! ([`Stream::declare_access`]) and the crate's own idle probe of a stream
//! ([`Stream::probe_idle`]). The rest (reading the races found, the simulated
//! device's side) is `device/sim/hooks.rs`.

use crate::device::sim::{MemoryAccess, SimDevice, SimStream};
use crate::device::{mismatch, Backend, Device, DevicePtr, FaultKind};
use crate::error::Result;
use crate::stream::{RawStream, Stream};

impl Device {
    /// Tells the simulated device's race detector that a resource handed out the block of
    /// `bytes` at `ptr` for use on `stream` (from this point of it), inside memory the device
    /// already knows (a chunk from an upstream resource). The detector then checks every use of
    /// the block against this allocation point, and the allocation against the block's previous
    /// free: a pool that hands a block to one stream while another may still use it is caught
    /// there, inside the chunk that the driver sees as one allocation.
    ///
    /// For authors of suballocating resources: call it after the block is taken from the
    /// resource's bookkeeping, and [`note_free`](Self::note_free) before it goes back. The
    /// crate's pool, arena and fixed-size resources do. A no-op on CUDA and when the detector
    /// is off (one branch); never fails (in the `Panic` mode, a race panics).
    #[inline]
    pub fn note_allocation(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) {
        if let Some((d, s)) = self.sim_with(stream) {
            d.note_allocation(ptr.0, bytes, s);
        }
    }

    /// Tells the simulated device's race detector that the block of `bytes` at `ptr` (as given
    /// to [`note_allocation`](Self::note_allocation)) was freed on `stream`, at this point of
    /// it: every use of the block must be ordered before it, and a later use is a use after
    /// free. A no-op on CUDA and when the detector is off.
    #[inline]
    pub fn note_free(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) {
        if let Some((d, s)) = self.sim_with(stream) {
            d.note_free(ptr.0, bytes, s);
        }
    }

    /// The simulated device and `stream`'s simulated stream, when both are this device's and
    /// the detector is on.
    #[inline]
    fn sim_with<'a>(&'a self, stream: &'a Stream) -> Option<(&'a SimDevice, &'a SimStream)> {
        match (self.backend(), stream.raw_unqueued()) {
            (Backend::Sim(d), RawStream::Sim(s))
                if d.races.is_some() && stream.device().id() == self.id() =>
            {
                Some((d, s))
            }
            _ => None,
        }
    }
}

impl Stream {
    /// Declares that work queued on this stream from here on (until the next operation) reads
    /// or writes `[ptr, ptr + bytes)`: the simulated device's race detector checks it as it
    /// checks its own copies and kernels (against the memory's allocation, free and uses on
    /// other streams) and remembers it. For simulated stand-ins of your own kernels: declare
    /// what the real kernel would touch, then queue the stand-in. `op` names it in reports.
    ///
    /// A no-op on CUDA and with the detector off. With
    /// [`RaceDetection::Error`](crate::RaceDetection::Error), a race is returned as
    /// [`Error::StreamRace`](crate::Error::StreamRace) (and the access is not remembered); with
    /// [`RaceDetection::Panic`](crate::RaceDetection::Panic), it panics.
    ///
    /// ```
    /// use streamalloc::{Device, MemoryAccess, RaceDetection, SimConfig};
    ///
    /// let device = Device::simulated(SimConfig {
    ///     race_detection: RaceDetection::Error,
    ///     ..SimConfig::default()
    /// });
    /// let (a, b) = (device.create_stream()?, device.create_stream()?);
    /// let ptr = device.malloc(1024)?;
    /// a.declare_access(ptr, 1024, MemoryAccess::Write, "my_kernel")?;
    /// // `b` reads what `a` writes without waiting for it:
    /// let race = b.declare_access(ptr, 1024, MemoryAccess::Read, "my_reader").unwrap_err();
    /// assert!(race.to_string().contains("read not ordered after a write"));
    /// b.wait(&a.record()?)?; // ordered now
    /// b.declare_access(ptr, 1024, MemoryAccess::Read, "my_reader")?;
    /// # b.synchronize_blocking()?;
    /// # unsafe { device.free(ptr)? };
    /// # Ok::<(), streamalloc::Error>(())
    /// ```
    pub fn declare_access(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        access: MemoryAccess,
        op: &'static str,
    ) -> Result<()> {
        let queued = self.queue_handle();
        let RawStream::Sim(s) = &*queued else {
            return Ok(());
        };
        let Some((races, idx)) = s.races() else {
            return Ok(());
        };
        let reject = races.rejects();
        let race = races.access(idx, op, &[(ptr.0, bytes, access)], reject);
        races.settle(race, reject)
    }

    /// [`is_idle`](Self::is_idle), asked by the crate for its own use: a pool's question
    /// before it reuses a block freed on this stream with no ordering (`idle_reuses`). On the
    /// simulated device an idle answer vouches for that reuse only: unlike the user's
    /// `is_idle`, it orders none of the user's later work after the stream's (the user's code
    /// did not look; a review found a pool's probe hiding a user's unordered read of unrelated
    /// memory). An injected `Query` fault fails it as it fails `is_idle`.
    pub(crate) fn probe_idle(&self) -> Result<bool> {
        match (&self.inner.raw, self.inner.device.backend()) {
            (RawStream::Cuda(s), Backend::Cuda(d)) => d.stream_idle(*s),
            (RawStream::Sim(s), Backend::Sim(d)) => {
                d.fault(FaultKind::Query)?;
                Ok(s.probe_idle())
            }
            _ => Err(mismatch()),
        }
    }
}
