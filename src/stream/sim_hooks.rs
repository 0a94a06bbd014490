//! The race detector's hooks that take a stream: a resource's allocation and free of a block
//! on a stream ([`Device::note_allocation`], [`Device::note_free`]), a user's declared access
//! ([`Stream::declare_access`]) and the crate's own idle probe of a stream
//! ([`Stream::probe_idle`]). The rest (reading the races found, the simulated
//! device's side) is `device/sim/hooks.rs`.

use crate::device::sim::{MemoryAccess, SimDevice, SimStream};
use crate::device::{mismatch, Backend, Device, DevicePtr, FaultKind};
use crate::error::Result;
use crate::stream::{RawStream, Stream};
use crate::sync::Ordering;

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
    ///
    /// `stream` must be this device's (as for the allocation itself, which a resource refuses
    /// with [`Error::WrongDevice`](crate::Error::WrongDevice) otherwise). Another device's
    /// stream has no clock in this device's detector, so the note cannot be taken: with the
    /// detector on, it is dropped with a `tracing` warning (both devices and the stream named),
    /// and the block's uses go unchecked against it. A block that wraps past the top of the
    /// address space holds no memory: it is logged at error level and not tracked (so is such
    /// a [`note_free`](Self::note_free)).
    #[inline]
    pub fn note_allocation(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) {
        if let Some((d, s)) = self.sim_with(stream, ptr, bytes, "note_allocation") {
            d.note_allocation(ptr.0, bytes, s);
        }
    }

    /// Tells the simulated device's race detector that the block of `bytes` at `ptr` (as given
    /// to [`note_allocation`](Self::note_allocation)) was freed on `stream`, at this point of
    /// it: every use of the block must be ordered before it, and a later use is a use after
    /// free. A no-op on CUDA and when the detector is off; another device's stream is
    /// dropped with a warning, as for [`note_allocation`](Self::note_allocation).
    ///
    /// In the `Panic` mode a race panics here, before your resource has taken the block back:
    /// a caller that catches the panic finds the block still out. The crate's own resources
    /// put the block back first and panic after.
    #[inline]
    pub fn note_free(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) {
        let _ = self.note_free_then(ptr, bytes, stream, || Ok(()));
    }

    /// [`note_free`](Self::note_free) for the crate's resources: the free is noted now (before
    /// the block is back where another thread may hand it out again), then `give` puts it
    /// back (and wakes whoever waits for memory), and only then does a race panic, in the
    /// `Panic` mode. A panic at the note itself left the block out of its resource for good:
    /// a test that caught the panic of a buffer dropped without `record_stream` (a task
    /// runtime does) found the pool a block short, and an allocation waiting for it waited
    /// forever (a review's finding).
    ///
    /// A free that `give` refuses (an error: a block the resource never handed out) is no free
    /// to the detector: the note is undone, so that the block, still its owner's, is not taken
    /// for freed (a review found the owner's next use reported as a use after free).
    #[inline]
    pub(crate) fn note_free_then<R>(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        stream: &Stream,
        give: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        let pending = match self.sim_with(stream, ptr, bytes, "note_free") {
            Some((d, s)) => d.note_free(ptr.0, bytes, s),
            None => None,
        };
        let given = give();
        if let Some((races, pending)) = pending {
            if given.is_ok() {
                let race = races.confirm_free(pending);
                let _ = races.settle(race, false);
            } else {
                races.refuse_free(pending);
            }
        }
        given
    }

    /// The simulated device and `stream`'s simulated stream, when the detector is on and the
    /// stream is this device's. A stream of another device (the caller's bug: its resource
    /// should have refused it) is warned of here rather than dropped silently: the detector
    /// misses the note, and whoever reads its reports must be able to tell why. `what` names
    /// the hook for the warning.
    #[inline]
    fn sim_with<'a>(
        &'a self,
        stream: &'a Stream,
        ptr: DevicePtr,
        bytes: usize,
        what: &'static str,
    ) -> Option<(&'a SimDevice, &'a SimStream)> {
        let Backend::Sim(d) = self.backend() else {
            return None;
        };
        d.races.as_ref()?;
        if stream.device().id() != self.id() {
            warn_other_device(self, stream, ptr, bytes, what);
            return None;
        }
        match stream.raw_unqueued() {
            RawStream::Sim(s) => Some((d, s)),
            // A stream of this device is of its backend: nothing else can come here.
            _ => None,
        }
    }
}

/// The warning of a race detector hook given another device's stream; out of line, so that
/// the hooks' common path stays small.
#[cold]
#[inline(never)]
fn warn_other_device(device: &Device, stream: &Stream, ptr: DevicePtr, bytes: usize, what: &str) {
    tracing::warn!(
        hook = what,
        device = device.id(),
        stream_device = stream.device().id(),
        stream = %stream.id(),
        ptr = format_args!("{:#x}", ptr.0),
        bytes,
        "race detector: a stream of another device; the note is dropped, and this block's uses \
         go unchecked against it"
    );
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
    /// A range that wraps past the top of the address space is refused with
    /// [`Error::InvalidAddress`](crate::Error::InvalidAddress), on every device (nothing is
    /// declared), as the stream's operations refuse one.
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
        // No memory holds a wrapping range: the detector clipped its end to the top and
        // checked (and remembered) the rest (a review's finding).
        super::check_range(ptr, bytes)?;
        let queued = self.queue_handle();
        let RawStream::Sim(s) = &*queued else {
            return Ok(());
        };
        let Some((races, idx)) = s.races() else {
            return Ok(());
        };
        // Refused (not noted as a use) in the `Panic` mode too, as a racing operation is
        // (`panics_now`): a caller that catches the panic goes on with the detector as if
        // the access had not been declared.
        let reject = races.rejects() || races.panics_now();
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
        #[cfg(test)]
        if self.pretending_capture() {
            return Ok(false);
        }
        match (&self.inner.raw, self.inner.device.backend()) {
            (RawStream::Cuda(s), Backend::Cuda(d)) => {
                d.stream_idle(*s, self.inner.exposed.load(Ordering::Relaxed))
            }
            (RawStream::Sim(s), Backend::Sim(d)) => {
                d.fault(FaultKind::Query)?;
                Ok(s.probe_idle())
            }
            _ => Err(mismatch()),
        }
    }
}
