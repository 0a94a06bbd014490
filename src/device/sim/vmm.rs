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
//! The host bytes of an unmapped granule stay allocated until the reservation goes (the
//! simulated device has no way to give pages back without a dependency on `libc`); what a test
//! sees is the device's memory counters, which follow the mappings exactly. Because the bytes
//! stay, an access racing with an unmap (a bug of the caller: it unmapped memory still in use)
//! is never undefined behaviour here: it either runs before the unmap or fails with the address.
//!
//! [`Error::InvalidAddress`]: crate::Error::InvalidAddress

use super::granules::{Granules, ADDRESS_SPACE, GRANULE};
use super::memory::SimMemory;
use super::{FaultKind, SimDevice};
use crate::error::Result;
use crate::sync::plain::Arc;

/// A reserved range of the simulated device's address space.
pub(crate) struct SimReservation {
    memory: Arc<SimMemory>,
    base: u64,
    granules: Arc<Granules>,
}

impl SimReservation {
    /// Reserves `size` bytes (a non-zero multiple of [`GRANULE`]).
    pub(crate) fn new(device: &SimDevice, size: usize) -> Result<Self> {
        debug_assert!(size > 0 && size.is_multiple_of(GRANULE) && size as u64 <= ADDRESS_SPACE);
        let granules = Arc::new(Granules::new(size / GRANULE));
        let base = device.memory.reserve(size, granules.clone())?;
        Ok(Self {
            memory: device.memory.clone(),
            base,
            granules,
        })
    }

    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    /// Maps granules `first..first + count`, each its own "physical allocation": all or none
    /// (on a fault midway, the ones this call mapped are unmapped again). The caller makes
    /// sure they are unmapped now.
    pub(crate) fn map(&self, device: &SimDevice, first: usize, count: usize) -> Result<()> {
        for done in 0..count {
            let mapped = device
                .fault(FaultKind::MemCreate)
                .and_then(|()| self.memory.charge(GRANULE))
                .and_then(|()| {
                    device.fault(FaultKind::MemMap).inspect_err(|_| {
                        self.memory.uncharge(GRANULE);
                    })
                });
            if let Err(e) = mapped {
                for index in first..first + done {
                    self.unmap(index);
                }
                return Err(e);
            }
            let was = self.granules.set(first + done, true);
            debug_assert!(!was, "granule {} mapped twice", first + done);
        }
        Ok(())
    }

    /// Unmaps granule `index` and releases its physical memory. Unmapping an unmapped granule
    /// does nothing.
    pub(crate) fn unmap(&self, index: usize) {
        if self.granules.set(index, false) {
            self.memory.uncharge(GRANULE);
        }
    }
}

impl Drop for SimReservation {
    fn drop(&mut self) {
        for index in 0..self.granules.count {
            self.unmap(index);
        }
        self.memory.unreserve(self.base);
    }
}
