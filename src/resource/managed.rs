//! [`ManagedResource`]: managed (unified) memory from `cuMemAllocManaged`, as RMM's
//! `managed_memory_resource`, but never oversubscribing the GPU.

use std::fmt;

use rustc_hash::FxHashMap;

use crate::device::{Device, DevicePtr};
use crate::error::{Error, Result};
use crate::resource::{aligned_size, check_stream, MemoryKind, MemoryResource};
use crate::stream::Stream;
use crate::sync::{Arc, Mutex};

/// Managed memory (`cuMemAllocManaged`, attached globally): one address that the host and
/// every stream of the GPU can use, with the driver migrating pages on demand.
///
/// What it promises:
///
/// - allocations are at least 256-aligned; zero bytes gives a null pointer without a driver
///   call, and `deallocate` takes it back with zero bytes;
/// - **it never asks for more than the device can hold.** The driver lets managed memory
///   oversubscribe the GPU, and on some machines a request larger than the card hangs it.
///   So before each allocation this resource computes what is available, the smaller of the
///   device's free memory and its total minus what this resource has handed out and not yet
///   got back, each allocation counted by its footprint, its size rounded up to the
///   alignment (managed pages only take device memory once touched, so free memory alone
///   would let untouched allocations add up past the card), and returns
///   [`Error::OutOfMemory`] with those numbers instead of asking the driver. The check and the
///   allocation happen under one lock, so threads sharing this resource cannot race past it;
///   other resources and processes are not counted beyond what the device reports free;
/// - **a free must name an allocation of this resource with its size.** It keeps a table of
///   what it handed out (pointer → bytes) and refuses, with [`Error::UnknownPointer`] and
///   before the driver is called, a free of a pointer it did not hand out (another
///   resource's, one inside an allocation, one already freed) or with a size that does not
///   round up (to 256 bytes) to the allocation's. The count falls by the allocation's size,
///   never by the size a free names: without the table a wrong size moved the count by that
///   size, and a count too low lets allocations through that oversubscribe the device,
///   which the check above is there to prevent. The table costs a map operation under the
///   lock that each allocation and free takes anyway, next to driver calls that cost far
///   more (`cuMemFree` waits for the device);
/// - `deallocate` is `cuMemFree`, which ignores stream order as in
///   [`CudaResource`](crate::resource::cuda::CudaResource): it waits for the device's pending
///   work, so the calling thread may block. The simulated device queues the free on the stream.
///   On a device's completion reactor thread (a buffer's deferred free) the `cuMemFree` is
///   handed to the device's blocking-work thread instead, and
///   [`outstanding_bytes`](Self::outstanding_bytes) counts the memory until it has run.
///
/// On the simulated device managed memory is device memory: the host cannot dereference it
/// there, only device operations can use it.
pub struct ManagedResource {
    device: Device,
    /// What it handed out and the bytes of it not yet given back. Read and updated, together
    /// with the driver call it guards, only while the lock is held. Shared with frees handed
    /// to the blocking-work thread, which count down once they have run.
    ledger: Arc<Mutex<Ledger>>,
}

/// What a [`ManagedResource`] handed out.
#[derive(Default)]
struct Ledger {
    /// Bytes handed out and not yet given back, each allocation by its footprint (a free
    /// counts once it has run).
    outstanding: usize,
    /// Live allocations: pointer → footprint (the bytes asked for, rounded up to
    /// [`ALIGNMENT`](crate::resource::ALIGNMENT)). A pointer leaves when its free is
    /// issued (so a second free is refused) and comes back if the driver refuses the free.
    live: FxHashMap<u64, usize>,
}

impl ManagedResource {
    /// A resource of `device`'s managed memory. Makes no driver call.
    pub fn new(device: &Device) -> Self {
        Self {
            device: device.clone(),
            ledger: Arc::new(Mutex::new(Ledger::default())),
        }
    }

    /// Bytes this resource has handed out and not yet got back, each allocation by its
    /// footprint (its size rounded up to [`ALIGNMENT`](crate::resource::ALIGNMENT)); a free
    /// handed to the blocking-work thread counts until it has run.
    pub fn outstanding_bytes(&self) -> usize {
        self.ledger.lock().outstanding
    }
}

impl fmt::Debug for ManagedResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ManagedResource")
            .field("device", &self.device.id())
            .field("outstanding", &self.outstanding_bytes())
            .finish()
    }
}

// SAFETY: each allocation is a fresh `cuMemAllocManaged` (the simulated device's managed memory)
// of at least the bytes asked for, freed only through `deallocate`.
unsafe impl MemoryResource for ManagedResource {
    fn device(&self) -> &Device {
        &self.device
    }

    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Managed
    }

    /// `cuMemAllocManaged`, after checking that the device can hold `bytes` (see the type's
    /// documentation). Not ordered on `stream`: the memory is usable by any stream at once.
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        check_stream(&self.device, stream)?;
        if bytes == 0 {
            return Ok(DevicePtr(0));
        }
        // Counted, and checked, by the footprint (the size rounded up to the alignment every
        // allocation has), not the bytes asked for: counted by the request, many small
        // allocations added up to far more than the count, and past the device.
        let footprint = self.footprint(bytes)?;
        let maximum = self.device.total_memory();
        let mut ledger = self.ledger.lock();
        let available = self
            .device
            .free_memory()?
            .min(maximum.saturating_sub(ledger.outstanding));
        if footprint > available {
            tracing::debug!(
                requested = bytes,
                available,
                maximum,
                "managed allocation refused: it would oversubscribe the device"
            );
            return Err(Error::OutOfMemory {
                requested: bytes,
                available,
                maximum,
            });
        }
        let ptr = self.device.malloc_managed(bytes)?;
        ledger.outstanding += footprint;
        ledger.live.insert(ptr.0, footprint);
        Ok(ptr)
    }

    /// `cuMemFree`: may block the calling thread until the device is idle. On a completion
    /// reactor thread (a deferred free) it is handed to the device's blocking-work thread
    /// instead, and returns at once.
    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        check_stream(&self.device, stream)?;
        match (ptr.0, bytes) {
            (0, 0) => return Ok(()),
            (0, _) | (_, 0) => return Err(Error::UnknownPointer { ptr: ptr.0, bytes }),
            _ => {}
        }
        let unknown = Error::UnknownPointer { ptr: ptr.0, bytes };
        // A size that cannot be rounded was never handed out.
        let rounded = aligned_size(bytes).map_err(|_| unknown.clone())?;
        // Out of the table first, so that two frees of one pointer racing each other cannot
        // both reach the driver; put back if the driver refuses.
        let size = {
            let mut ledger = self.ledger.lock();
            match ledger.live.get(&ptr.0) {
                Some(&size) if aligned_size(size).ok() == Some(rounded) => {
                    ledger.live.remove(&ptr.0);
                    size
                }
                have => {
                    tracing::debug!(
                        ptr = format_args!("{:#x}", ptr.0),
                        bytes,
                        handed_out = have,
                        "ManagedResource: a free of a pointer it did not hand out, or with \
                         another size"
                    );
                    return Err(unknown);
                }
            }
        };
        let (device, stream, ledger) = (self.device.clone(), stream.clone(), self.ledger.clone());
        crate::device::run_blocking(
            &self.device,
            "cuMemFree (ManagedResource::deallocate)",
            move || {
                // SAFETY: the caller's contract: `ptr` came from `allocate` (so from
                // `Device::malloc_managed` of this device), is freed once, and its uses are
                // ordered before this point of `stream`, so also before any later point (the
                // blocking-work thread may free it later; nobody else uses it). The table
                // just confirmed that it is a live allocation of this resource, of this size.
                let freeing = || unsafe { super::cuda::free(&device, ptr, bytes, &stream) };
                // A racing free panics in the simulated device's `Panic` mode once the free is
                // queued (the stream's push settles the race after queuing it): the block is
                // freed, so it is counted down before the panic goes on, as the other
                // resources give their blocks back first (`note_free_then`). The panic left
                // `outstanding` with the block for good (a review's finding).
                let freed = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(freeing)) {
                    Ok(freed) => freed,
                    Err(race) => {
                        let mut ledger = ledger.lock();
                        ledger.outstanding = ledger.outstanding.saturating_sub(size);
                        drop(ledger);
                        std::panic::resume_unwind(race);
                    }
                };
                let mut ledger = ledger.lock();
                if let Err(e) = freed {
                    // Nothing was freed: the allocation is still live, and still counted.
                    ledger.live.insert(ptr.0, size);
                    return Err(e);
                }
                // Counted down only once freed, so the oversubscription check stays on the
                // safe side while the free waits on the blocking-work thread; by the
                // allocation's size (the table's), not the size the free named.
                ledger.outstanding = ledger.outstanding.saturating_sub(size);
                Ok(())
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SimConfig;

    #[test]
    fn small_allocations_count_their_footprint() {
        let device = Device::simulated(SimConfig::default());
        let stream = device.create_stream().unwrap();
        let r = ManagedResource::new(&device);
        // One byte takes a whole 256-byte allocation: counted by the request, a card's worth
        // of them would have counted a 256th of what they hold.
        let ptrs: Vec<DevicePtr> = (0..4).map(|_| r.allocate(1, &stream).unwrap()).collect();
        assert_eq!(r.outstanding_bytes(), 4 * r.footprint(1).unwrap());
        for ptr in ptrs {
            // SAFETY: allocated above with one byte, never used; freed once.
            unsafe { r.deallocate(ptr, 1, &stream) }.unwrap();
        }
        stream.synchronize_blocking().unwrap();
        assert_eq!(r.outstanding_bytes(), 0);
    }
}
