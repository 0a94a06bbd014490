//! The device's raw memory calls, not ordered on any stream: device memory (`cuMemAlloc`),
//! managed memory and page-locked host memory, each with its free, and the out-of-memory
//! errors they report. The stream-ordered calls (`malloc_async`, `free_async`, `free_after`,
//! the driver's pools) are the stream layer's: `stream/memory.rs`, `stream/async_pool.rs`.

use super::{Backend, Device, DevicePtr, FaultKind};
use crate::error::{Error, Result};

impl Device {
    pub(crate) fn oom(&self, requested: usize, err: Error) -> Error {
        if err.is_out_of_memory() {
            // The simulated device grants whole blocks: its free and total bytes were
            // reported, more than a request can get (`malloc(1000)` of a 1,000-byte device was
            // refused with 1,000 available).
            let (available, maximum) = match &self.inner.backend {
                Backend::Cuda(_) => (self.free_memory().unwrap_or(0), self.total_memory()),
                Backend::Sim(d) => d.memory.room(),
            };
            Error::OutOfMemory {
                requested,
                available,
                maximum,
            }
        } else {
            err
        }
    }

    /// The largest device allocation that could ever succeed: the total memory, in whole
    /// blocks on the simulated device.
    fn largest_allocation(&self) -> usize {
        match &self.inner.backend {
            Backend::Cuda(_) => self.total_memory(),
            Backend::Sim(_) => crate::device::sim::memory::usable(self.total_memory()),
        }
    }

    /// The host's numbers for an out-of-memory error of page-locked host memory.
    fn host_oom(requested: usize, err: Error) -> Error {
        if err.is_out_of_memory() {
            let (available, maximum) = host_memory().unwrap_or((0, 0));
            Error::OutOfMemory {
                requested,
                available,
                maximum,
            }
        } else {
            err
        }
    }

    /// Allocates `bytes` of device memory (`cuMemAlloc`), synchronously: slow (it may
    /// synchronize the device) and meant for the layers above, which pool it.
    ///
    /// Errors: [`Error::InvalidSize`] for zero bytes, [`Error::OutOfMemory`] when the device
    /// cannot provide them (more than the device could ever grant, its total memory, in
    /// whole 512-byte blocks on the simulated device, is refused without a driver call). On
    /// the simulated device its `available` is the largest request that would succeed now,
    /// its `maximum` the largest that ever could.
    pub fn malloc(&self, bytes: usize) -> Result<DevicePtr> {
        check_size(bytes)?;
        // Refused here, not by the driver: a `cuMemAlloc` short of memory makes the driver
        // release all that every stream-ordered pool of the process keeps before it tries
        // again (release thresholds notwithstanding; driver 580, BENCHMARKS.md "A failed
        // cuMemAlloc empties the driver's pools"), and a request larger than the device can
        // never succeed: it would cost every `CudaAsyncResource` its cache for nothing.
        if bytes > self.largest_allocation() {
            let err = Error::OutOfMemory {
                requested: bytes,
                available: 0,
                maximum: 0,
            };
            return Err(match &self.inner.backend {
                // What the driver pools keep counts: a `malloc` short of memory takes it (a
                // review found `available` short of a request that succeeded).
                Backend::Sim(d) => {
                    let (available, maximum) = d.memory.room_for_malloc();
                    Error::OutOfMemory {
                        requested: bytes,
                        available,
                        maximum,
                    }
                }
                Backend::Cuda(_) => self.oom(bytes, err),
            });
        }
        match &self.inner.backend {
            Backend::Cuda(d) => d.malloc(bytes),
            Backend::Sim(d) => d.fault(FaultKind::Allocate).and_then(|()| d.malloc(bytes)),
        }
        .map(DevicePtr)
        .map_err(|e| self.oom(bytes, e))
    }

    /// Frees memory from [`malloc`](Self::malloc).
    ///
    /// # Safety
    /// `ptr` came from `malloc` on this device, is freed once, and no queued or running work
    /// still uses it.
    pub unsafe fn free(&self, ptr: DevicePtr) -> Result<()> {
        match &self.inner.backend {
            // SAFETY: the caller's contract.
            Backend::Cuda(d) => unsafe { d.free(ptr.0) },
            Backend::Sim(d) => d.fault(FaultKind::Free).and_then(|()| d.free_now(ptr.0)),
        }
    }
    /// Allocates `bytes` of managed (unified) memory (`cuMemAllocManaged`, attached
    /// globally): usable by work on every stream and, on a GPU, by the host. Free it with
    /// [`free`](Self::free). On the simulated device it is device memory like
    /// [`malloc`](Self::malloc)'s (the host cannot dereference it there).
    ///
    /// The driver lets managed memory oversubscribe the GPU, and on some machines asking for
    /// more than the card has can hang it: check [`free_memory`](Self::free_memory) first, as
    /// `ManagedResource` does.
    ///
    /// Errors: [`Error::InvalidSize`] for zero bytes, [`Error::OutOfMemory`] when the driver
    /// refuses.
    pub fn malloc_managed(&self, bytes: usize) -> Result<DevicePtr> {
        check_size(bytes)?;
        match &self.inner.backend {
            Backend::Cuda(d) => d.malloc_managed(bytes),
            Backend::Sim(d) => d
                .fault(FaultKind::Allocate)
                .and_then(|()| d.malloc_managed(bytes)),
        }
        .map(DevicePtr)
        .map_err(|e| self.oom(bytes, e))
    }

    /// Allocates `bytes` of page-locked host memory (`cuMemHostAlloc`, portable and mapped):
    /// the host reads and writes it through the returned pointer, copies to and from it run
    /// without staging, and with unified addressing the GPU can use the same address. At
    /// least 256-aligned. Slow (the pages are pinned one by one): pool it. On the simulated
    /// device it is ordinary host memory, zeroed.
    ///
    /// A request for more than the host's available memory fails at once, without asking the
    /// driver: pinned memory cannot be swapped out.
    ///
    /// Errors: [`Error::InvalidSize`] for zero bytes, [`Error::OutOfMemory`] (with the host's
    /// available and total memory where the platform reports them, else zeros).
    pub fn malloc_host(&self, bytes: usize) -> Result<*mut u8> {
        check_size(bytes)?;
        if let Some((available, maximum)) = host_memory() {
            if bytes > available {
                return Err(Error::OutOfMemory {
                    requested: bytes,
                    available,
                    maximum,
                });
            }
        }
        match &self.inner.backend {
            Backend::Cuda(d) => d.malloc_host(bytes),
            Backend::Sim(d) => d
                .fault(FaultKind::HostAllocate)
                .and_then(|()| d.malloc_host(bytes)),
        }
        .map_err(|e| Self::host_oom(bytes, e))
    }

    /// Frees memory from [`malloc_host`](Self::malloc_host). On CUDA `cuMemFreeHost` may wait
    /// for the device. `Err(InvalidAddress)` on the simulated device for a pointer it did not
    /// hand out.
    ///
    /// # Safety
    /// `ptr` came from `malloc_host` on this device and is freed once; no queued or running
    /// work and no host code uses it any more.
    pub unsafe fn free_host(&self, ptr: *mut u8) -> Result<()> {
        match &self.inner.backend {
            // SAFETY: the caller's contract.
            Backend::Cuda(d) => unsafe { d.free_host(ptr) },
            Backend::Sim(d) => d.fault(FaultKind::HostFree).and_then(|()| d.free_host(ptr)),
        }
    }
}

/// The host's (available, total) memory in bytes, where the platform reports them
/// (`/proc/meminfo` on Linux).
fn host_memory() -> Option<(usize, usize)> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| -> Option<usize> {
        let line = info.lines().find(|l| l.starts_with(name))?;
        let kib: usize = line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        kib.checked_mul(1024)
    };
    let total = field("MemTotal:")?;
    let available = field("MemAvailable:").unwrap_or(total);
    Some((available, total))
}

pub(crate) fn check_size(bytes: usize) -> Result<()> {
    if bytes == 0 {
        Err(Error::InvalidSize {
            size: 0,
            reason: "a device allocation needs at least one byte",
        })
    } else {
        Ok(())
    }
}
