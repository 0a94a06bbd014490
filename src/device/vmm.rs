//! Virtual memory management, on both devices: reserve a range of device addresses, map
//! physical memory into it a unit at a time (a multiple of the allocation granularity, one
//! physical allocation each), unmap it again. What an expandable pool
//! (`resource/expandable/`) grows and shrinks by.
//!
//! [`Reservation`] is the facade; `cuda_vmm.rs` makes the driver calls on a GPU
//! (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`, `cuMemUnmap`,
//! `cuMemRelease`, `cuMemAddressFree`), `sim/vmm.rs` does the same on the simulated device,
//! where an access to an unmapped granule is an [`Error::InvalidAddress`] with the address.

use std::fmt;

use super::{cuda_vmm, sim, Backend, Device};
use crate::error::{Error, Result};

enum Raw {
    Cuda(cuda_vmm::CudaReservation),
    Sim(sim::vmm::SimReservation),
}

/// A reserved range of a device's virtual addresses, with physical memory mapped at some of
/// its granules. Dropping it unmaps everything and frees the range: the owner makes sure no
/// work uses it by then.
pub(crate) struct Reservation {
    device: Device,
    base: u64,
    size: usize,
    granule: usize,
    raw: Raw,
    /// Left mapped at drop ([`keep_at_drop`](Self::keep_at_drop)).
    kept: std::sync::atomic::AtomicBool,
}

impl fmt::Debug for Reservation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reservation")
            .field("device", &self.device.id())
            .field("base", &format_args!("{:#x}", self.base))
            .field("size", &self.size)
            .field("granule", &self.granule)
            .finish()
    }
}

/// The largest reservation either device takes: 128 TiB, more than any GPU's memory and within
/// every GPU's virtual address space (47 to 57 bits). Larger is [`Error::OutOfMemory`], before
/// any driver call (the pool keeps a bit per granule of its reservation).
pub(crate) const MAX_RESERVATION: usize = 1 << 47;

/// The allocation granularity of `device`: the unit of mapping (2 MiB on an H100 or H200, and
/// on the simulated device).
pub(crate) fn granularity(device: &Device) -> Result<usize> {
    match device.backend() {
        Backend::Cuda(d) => cuda_vmm::granularity(d),
        Backend::Sim(_) => Ok(sim::granules::GRANULE),
    }
}

impl Reservation {
    /// Reserves at least `size` bytes (rounded up to `unit`) of `device`'s addresses, to be
    /// mapped `unit` bytes at a time, each unit one physical allocation (`unit` a non-zero
    /// multiple of the device's [`granularity`]). Nothing is mapped yet.
    ///
    /// Errors: [`Error::InvalidSize`] for zero, a size that overflows when rounded, or a unit
    /// that is not a multiple of the granularity; [`Error::OutOfMemory`] when the address
    /// space has no room for it (with the room left where the device knows it); the driver's
    /// error otherwise.
    pub(crate) fn new(device: &Device, size: usize, unit: usize) -> Result<Self> {
        if size == 0 {
            return Err(Error::InvalidSize {
                size,
                reason: "a virtual address reservation needs at least one byte",
            });
        }
        let granularity = granularity(device)?;
        if unit == 0 || !unit.is_multiple_of(granularity) {
            return Err(Error::InvalidSize {
                size: unit,
                reason:
                    "the mapping unit must be a non-zero multiple of the allocation granularity",
            });
        }
        let granule = unit;
        let size = size
            .checked_next_multiple_of(granule)
            .ok_or(Error::InvalidSize {
                size,
                reason: "the reservation overflows when rounded up to the allocation granularity",
            })?;
        if size > MAX_RESERVATION {
            return Err(Error::OutOfMemory {
                requested: size,
                available: MAX_RESERVATION,
                maximum: MAX_RESERVATION,
            });
        }
        let raw = match device.backend() {
            Backend::Cuda(d) => Raw::Cuda(
                cuda_vmm::CudaReservation::new(d, size, granule).map_err(|e| {
                    if e.is_out_of_memory() {
                        Error::OutOfMemory {
                            requested: size,
                            available: 0,
                            maximum: 0,
                        }
                    } else {
                        e
                    }
                })?,
            ),
            Backend::Sim(d) => Raw::Sim(sim::vmm::SimReservation::new(d, size, granule)?),
        };
        let base = match &raw {
            Raw::Cuda(r) => r.base(),
            Raw::Sim(r) => r.base(),
        };
        tracing::debug!(
            device = device.id(),
            base,
            size,
            granule,
            "reserved addresses"
        );
        Ok(Self {
            kept: std::sync::atomic::AtomicBool::new(false),
            device: device.clone(),
            base,
            size,
            granule,
            raw,
        })
    }

    /// The first address of the range.
    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    /// Bytes reserved (a multiple of the granule).
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// The unit of mapping (one physical allocation), in bytes.
    pub(crate) fn granule(&self) -> usize {
        self.granule
    }

    /// Maps fresh physical memory at units `first..first + count` (all unmapped now; the
    /// caller keeps the table), readable and writable by the device. All or none: after a
    /// failure midway (the device out of memory, a failed driver call) nothing this call mapped
    /// stays mapped. The device's out-of-memory becomes [`Error::OutOfMemory`] with its
    /// numbers.
    pub(crate) fn map(&self, first: usize, count: usize) -> Result<()> {
        debug_assert!(count > 0 && first + count <= self.size / self.granule);
        let result = match (&self.raw, self.device.backend()) {
            (Raw::Cuda(r), Backend::Cuda(d)) => r.map(d, first, count),
            (Raw::Sim(r), Backend::Sim(d)) => r.map(d, first, count),
            _ => Err(super::mismatch()),
        };
        result.map_err(|e| {
            if e.is_out_of_memory() {
                Error::OutOfMemory {
                    requested: count * self.granule,
                    available: self.device.free_memory().unwrap_or(0),
                    maximum: self.device.total_memory(),
                }
            } else {
                e
            }
        })
    }

    /// Unmaps unit `index` and releases its physical memory (nothing if it is unmapped).
    ///
    /// # Safety
    /// No queued or running work uses the granule (on a GPU, an access to it afterwards is a
    /// fault that breaks the context).
    pub(crate) unsafe fn unmap(&self, index: usize) -> Result<()> {
        match (&self.raw, self.device.backend()) {
            // SAFETY: the caller's contract.
            (Raw::Cuda(r), Backend::Cuda(d)) => unsafe { r.unmap(d, index) },
            (Raw::Sim(r), Backend::Sim(d)) => {
                r.unmap(index);
                // The race detector checks that nothing still used the memory. After the
                // unmap: a race's panic (the `Panic` mode) comes once the unit is unmapped,
                // which the expandable pool counts on to keep its table true
                // (`expandable::core::Backing::unmap`).
                match &d.races {
                    Some(races) => {
                        let (start, end) = r.unit_range(index);
                        let race = races.unmapped(start, end);
                        races.settle(race, false)
                    }
                    None => Ok(()),
                }
            }
            _ => Err(super::mismatch()),
        }
    }
}

impl Reservation {
    /// Leaves the range mapped and reserved when this is dropped (leaked): for a pool dropped
    /// while work that may still use its memory cannot be waited for (a stream under a user's
    /// graph capture). The simulated reservation is freed all the same (its memory is the
    /// host's, and the simulated device faults an access to it with its address).
    pub(crate) fn keep_at_drop(&self) {
        self.kept.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.kept.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        // The simulated reservation unmaps and frees itself when dropped.
        if let (Raw::Cuda(r), Backend::Cuda(d)) = (&self.raw, self.device.backend()) {
            // SAFETY: the owner's contract (the type's docs): no work uses the range any more,
            // and `&mut self` means nothing maps into it again.
            unsafe { r.free(d) }
        }
    }
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use super::*;
    use crate::{RaceDetection, SimConfig};

    /// Unmapping memory whose last use is still queued is a race, reported when the host
    /// unmaps (a review found it unseen: mapped again at once, the late write landed in the
    /// new memory with no error). After a synchronize it is not one.
    #[test]
    fn unmapping_memory_still_in_use_is_a_race() {
        for wait in [false, true] {
            let d = Device::simulated(SimConfig {
                race_detection: RaceDetection::Record,
                ..SimConfig::default()
            });
            let g = granularity(&d).unwrap();
            let r = Reservation::new(&d, 2 * g, g).unwrap();
            r.map(0, 1).unwrap();
            let s = d.create_stream().unwrap();
            let ptr = crate::DevicePtr(r.base());
            d.note_allocation(ptr, 4096, &s);
            s.spin(std::time::Duration::from_millis(100)).unwrap();
            // SAFETY: 4096 bytes of the mapped granule.
            unsafe { s.memset_d8(ptr, 1, 4096) }.unwrap();
            d.note_free(ptr, 4096, &s);
            if wait {
                s.synchronize_blocking().unwrap();
            }
            // SAFETY: deliberately early when `!wait` (the detector reports it).
            unsafe { r.unmap(0) }.unwrap();
            r.map(0, 1).unwrap();
            let _ = s.synchronize_blocking();
            let races = d.take_races();
            assert_eq!(
                races
                    .iter()
                    .any(|r| r.kind == crate::RaceKind::FreedWhileInUse),
                !wait,
                "wait {wait}: {races:?}"
            );
        }
    }

    /// Zero bytes at the end of a reservation touch nothing (CUDA takes such work as a
    /// no-op): a review found the granule past the end looked up, a stream's worker panicking
    /// with 64 granules, and every wait on the stream hanging.
    #[test]
    fn zero_bytes_at_the_end_of_a_reservation_are_nothing() {
        let d = Device::simulated(SimConfig {
            race_detection: RaceDetection::Record,
            ..SimConfig::default()
        });
        let g = granularity(&d).unwrap();
        let r = Reservation::new(&d, 64 * g, g).unwrap();
        r.map(0, 64).unwrap();
        let s = d.create_stream().unwrap();
        let end = crate::DevicePtr(r.base() + (64 * g) as u64);
        // SAFETY: zero bytes are written.
        unsafe { s.memset_d8(end, 0, 0) }.unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = s.clone();
        std::thread::spawn(move || tx.send(waiter.synchronize_blocking()));
        let synced = rx.recv_timeout(std::time::Duration::from_secs(30));
        assert!(matches!(synced, Ok(Ok(()))), "{synced:?}");
    }
}
