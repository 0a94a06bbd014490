//! Virtual memory management on the simulated device: what `cuMemAddressReserve`,
//! `cuMemCreate`, `cuMemMap`, `cuMemUnmap` and `cuMemRelease` do on a GPU.
//!
//! A reservation is one block of the simulated memory (`SimMemory::reserve`): an address range
//! backed by lazily zeroed host memory, with a table of which granules are mapped. Every access
//! to it (copies, memsets, kernels) checks the table, so an access to an unmapped granule is an
//! [`Error::InvalidAddress`] naming the first unmapped address, as a GPU would fault there.
//! Mapping a granule counts [`GRANULE`] bytes against the device's memory (so
//! `Device::free_memory` falls), unmapping gives them back (so it rises).
//!
//! The host bytes of a reservation cost nothing until touched (`HostBytes::reserved`), and
//! those of an unmapped granule stay until the reservation goes; what a test sees is the
//! device's memory counters, which follow the mappings exactly. Because the bytes stay, an
//! access racing with an unmap (a bug of the caller: it unmapped memory still in use) is never
//! undefined behaviour here: it either runs before the unmap or fails with the address.
//!
//! What differs from a GPU, beyond the fault on an unmapped access: injected faults reach only
//! `cuMemCreate` ([`FaultKind::MemCreate`]) and `cuMemMap` ([`FaultKind::MemMap`]), and the
//! device's memory running out fails the create as the driver's does. Giving access
//! (`cuMemSetAccess`, which the simulated device does not model: a mapped granule is
//! accessible), unmapping and releasing never fail here, so the paths that handle their
//! failure on a GPU (a mapping rolled back after a failed access; a trim or a move that puts
//! back a granule that would not unmap) run only there. A reservation's room is this device's
//! address range, not the driver's ([`ADDRESS_SPACE`]).
//!
//! [`Error::InvalidAddress`]: crate::Error::InvalidAddress

use super::detector::Detector;
use super::granules::{Granules, ADDRESS_SPACE, GRANULE};
use super::memory::SimMemory;
use super::{FaultKind, SimDevice};
use crate::error::Result;
use crate::sync::plain::Arc;

/// A reserved range of the simulated device's address space, mapped a unit (a whole number of
/// granules) at a time.
pub(crate) struct SimReservation {
    memory: Arc<SimMemory>,
    base: u64,
    granules: Arc<Granules>,
    /// Granules per unit of mapping.
    per_unit: usize,
    /// The device's race detector, if it is on: told when the range goes, so that it forgets
    /// what lived there.
    races: Option<Arc<Detector>>,
}

impl SimReservation {
    /// Reserves `size` bytes (a non-zero multiple of `unit`, itself a multiple of
    /// [`GRANULE`]).
    pub(crate) fn new(device: &SimDevice, size: usize, unit: usize) -> Result<Self> {
        debug_assert!(unit > 0 && unit.is_multiple_of(GRANULE));
        debug_assert!(size > 0 && size.is_multiple_of(unit) && size as u64 <= ADDRESS_SPACE);
        let granules = Arc::new(Granules::new(size / GRANULE));
        // At a multiple of the unit, as on a GPU (`cuMemAddressReserve` aligned to it), so
        // that units are aligned in absolute addresses: the pool finds free units by address.
        let base = device.memory.reserve(size, unit as u64, granules.clone())?;
        if let Some(races) = &device.races {
            races.reserved(base, base + size as u64);
        }
        Ok(Self {
            memory: device.memory.clone(),
            base,
            granules,
            per_unit: unit / GRANULE,
            races: device.races.clone(),
        })
    }

    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    fn unit_bytes(&self) -> usize {
        self.per_unit * GRANULE
    }

    /// Maps units `first..first + count`, each its own "physical allocation" (one create and
    /// one map, as on a GPU): all or none (on a fault midway, the ones this call mapped are
    /// unmapped again). The caller makes sure they are unmapped now.
    pub(crate) fn map(&self, device: &SimDevice, first: usize, count: usize) -> Result<()> {
        let unit = self.unit_bytes();
        for done in 0..count {
            let mapped = device
                .fault(FaultKind::MemCreate)
                .and_then(|()| self.memory.charge(unit))
                .and_then(|()| {
                    device.fault(FaultKind::MemMap).inspect_err(|_| {
                        self.memory.uncharge(unit);
                    })
                });
            if let Err(e) = mapped {
                for index in first..first + done {
                    self.unmap(index);
                }
                return Err(e);
            }
            let at = (first + done) * self.per_unit;
            for granule in at..at + self.per_unit {
                let was = self.granules.set(granule, true);
                debug_assert!(!was, "granule {granule} mapped twice");
            }
        }
        Ok(())
    }

    /// The addresses of unit `index`: `(start, end)`.
    pub(crate) fn unit_range(&self, index: usize) -> (u64, u64) {
        let unit = self.unit_bytes() as u64;
        let start = self.base + index as u64 * unit;
        (start, start + unit)
    }

    /// Unmaps unit `index` and releases its physical memory. Unmapping an unmapped unit does
    /// nothing.
    pub(crate) fn unmap(&self, index: usize) {
        let at = index * self.per_unit;
        let mut was = false;
        for granule in at..at + self.per_unit {
            was |= self.granules.set(granule, false);
        }
        if was {
            self.memory.uncharge(self.unit_bytes());
        }
    }
}

impl Drop for SimReservation {
    fn drop(&mut self) {
        for index in 0..self.granules.count / self.per_unit {
            self.unmap(index);
        }
        self.memory.unreserve(self.base);
        if let Some(races) = &self.races {
            // After the memory let the range go: an access to it fails there from now on.
            let size = (self.granules.count * GRANULE) as u64;
            races.unreserved(self.base, self.base + size);
        }
    }
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use super::*;
    use crate::device::sim::{MemoryAccess, RaceDetection, SimConfig, SimExecution};
    use crate::device::StreamId;

    /// A dropped reservation takes its shadow in the race detector with it: the blocks a pool
    /// carved out of it and freed stayed as segments for the device's life (the memory hands
    /// the range out again only once its sweep of 16 TiB comes round), so an expandable pool
    /// made and dropped over and over grew the detector's map without bound.
    #[test]
    fn a_dropped_reservation_leaves_no_shadow() {
        let device = SimDevice::new(
            SimConfig {
                race_detection: RaceDetection::Record,
                execution: SimExecution::Inline,
                ..SimConfig::default()
            },
            None,
        );
        let races = device.races.clone().unwrap();
        let stream = device.create_stream(StreamId::next()).unwrap();
        let (_, idx) = stream.races().unwrap();
        for _ in 0..100 {
            let reservation = SimReservation::new(&device, GRANULE, GRANULE).unwrap();
            reservation.map(&device, 0, 1).unwrap();
            let base = reservation.base();
            for offset in [0u64, 4096, 8192] {
                device.note_allocation(base + offset, 1024, &stream);
                let write = [(base + offset, 1024, MemoryAccess::Write)];
                assert!(races.access(idx, "write", &write, false).is_none());
                let (races, pending) = device.note_free(base + offset, 1024, &stream).unwrap();
                assert!(races.confirm_free(pending).is_none());
            }
            drop(reservation);
        }
        assert!(races.races().is_empty(), "{:?}", races.races());
        let segments = races.segments();
        assert!(segments < 10, "{segments} segments for no live memory");
    }
}
