//! Which granules of a simulated reservation are mapped ([`Granules`]), and the sizes of the
//! simulated virtual address space. Below both the memory, which checks every access to a
//! reservation against the table, and the virtual memory calls (`vmm.rs`), which set it.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::error::{Error, Result};

/// The simulated allocation granularity: 2 MiB, what the driver reports for an H100 or H200.
pub(crate) const GRANULE: usize = 2 << 20;

/// The largest reservation the simulated device takes: 128 TiB (a GPU's address space is 47 to
/// 57 bits), as [`MAX_RESERVATION`](crate::device::vmm::MAX_RESERVATION). The room for one is
/// smaller: each simulated device's addresses span 16 TiB (`memory.rs`'s `DEVICE_SPAN`), which
/// its reservations share with its allocations, so a reservation past what is left there is
/// [`Error::OutOfMemory`] (an expandable pool then reserves for fewer shards). On a GPU the room
/// is the driver's, far larger.
pub(crate) const ADDRESS_SPACE: u64 = 1 << 47;

/// Which granules of a reservation are mapped (a bit each). Checked on every access to the
/// reservation.
pub(crate) struct Granules {
    mapped: Box<[AtomicU64]>,
    pub(super) count: usize,
}

impl Granules {
    pub(super) fn new(count: usize) -> Self {
        Self {
            mapped: (0..count.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            count,
        }
    }

    pub(super) fn is_mapped(&self, index: usize) -> bool {
        self.mapped[index / 64].load(Relaxed) & (1 << (index % 64)) != 0
    }

    /// Sets granule `index` mapped or not; returns whether it was.
    pub(super) fn set(&self, index: usize, mapped: bool) -> bool {
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
        if len == 0 {
            // Zero bytes touch no granule (CUDA takes such work as a no-op); at the end of the
            // reservation the granule past it would be out of the table (a review found a
            // stream's worker panicking there, and every waiter on the stream hanging).
            return Ok(());
        }
        let first = ((ptr - base) / GRANULE as u64) as usize;
        let last = ((ptr + len as u64 - 1 - base) / GRANULE as u64) as usize;
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
