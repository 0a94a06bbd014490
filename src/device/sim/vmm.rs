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

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::memory::SimMemory;
use super::{FaultKind, SimDevice};
use crate::error::{Error, Result};
use crate::sync::plain::Arc;

/// The simulated allocation granularity: 2 MiB, what the driver reports for an H100 or H200.
pub(crate) const GRANULE: usize = 2 << 20;

/// The simulated device's virtual address space for reservations: 128 TiB (a GPU's is 47 to
/// 57 bits).
pub(crate) const ADDRESS_SPACE: u64 = 1 << 47;

/// Which granules of a reservation are mapped (a bit each). Checked on every access to the
/// reservation.
pub(crate) struct Granules {
    mapped: Box<[AtomicU64]>,
    count: usize,
}

impl Granules {
    fn new(count: usize) -> Self {
        Self {
            mapped: (0..count.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            count,
        }
    }

    fn is_mapped(&self, index: usize) -> bool {
        self.mapped[index / 64].load(Relaxed) & (1 << (index % 64)) != 0
    }

    /// Sets granule `index` mapped or not; returns whether it was.
    fn set(&self, index: usize, mapped: bool) -> bool {
        let bit = 1 << (index % 64);
        let word = &self.mapped[index / 64];
        let old = if mapped {
            word.fetch_or(bit, Relaxed)
        } else {
            word.fetch_and(!bit, Relaxed)
        };
        old & bit != 0
    }

    /// `Err(InvalidAddress)` with the first unmapped address if any byte of `[ptr, ptr + len)`
    /// (inside the reservation at `base`) lies in an unmapped granule.
    pub(crate) fn check(&self, base: u64, ptr: u64, len: usize) -> Result<()> {
        let first = ((ptr - base) / GRANULE as u64) as usize;
        let last = ((ptr + len.max(1) as u64 - 1 - base) / GRANULE as u64) as usize;
        for index in first..=last {
            // Relaxed: the stream worker that accesses the memory was ordered after the map by
            // the lock of the stream's queue (the op was pushed after `map` returned); an unmap
            // racing with the access is the caller's bug, which this reports when it sees it.
            if !self.is_mapped(index) {
                let at = (base + (index * GRANULE) as u64).max(ptr);
                return Err(Error::InvalidAddress {
                    ptr: at,
                    bytes: len - (at - ptr) as usize,
                });
            }
        }
        Ok(())
    }
}

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
