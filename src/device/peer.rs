//! Several devices: which streams, events and buffers of one device may meet another's, peer
//! access, and copies between devices.
//!
//! What CUDA allows across GPUs works here, on real GPUs and between simulated devices alike:
//! a stream of one device may wait for an event of another ([`Stream::wait`]: the GPU-side
//! dependency, `cuStreamWaitEvent`, is legal across devices); a buffer of one device may be
//! recorded as used by a stream of another
//! ([`DeviceBuffer::record_stream`](crate::DeviceBuffer::record_stream): its free then waits
//! for that stream too); memory is copied between devices in stream order
//! ([`DeviceBuffer::try_clone_to`](crate::DeviceBuffer::try_clone_to) with a resource of the
//! other device, or the raw [`Stream::copy_peer`]). What is wrong is an
//! [`Error::WrongDevice`]: allocating from one device's resource for a stream of another,
//! moving a buffer to another device's stream for good (`set_stream`), a simulated device
//! meeting a real one.
//!
//! Every device has its own completion reactor: an event is watched by the reactor of the
//! device it was recorded on, whoever awaits it.
//!
//! Simulated devices have disjoint address ranges (as unified addressing gives GPUs), so a
//! pointer of one used on another is an `InvalidAddress` reported through the stream, never
//! another allocation's bytes. Their peer access is always possible (all of it is host memory)
//! and enabling it changes nothing: the simulated kernels do not model access to another
//! device's memory, which is what peer access would allow on GPUs.
//!
//! [`Stream::wait`]: crate::Stream::wait
//! [`Stream::copy_peer`]: crate::Stream::copy_peer

use crate::device::{Backend, Device};
use crate::error::{Error, Result};

impl Device {
    /// `Ok` if streams, events and buffers of `self` and `other` may meet: the same device,
    /// two GPUs, or two simulated devices. `Err(WrongDevice)` for a simulated device and a GPU.
    pub(crate) fn check_peer(&self, other: &Device) -> Result<()> {
        if self.id() == other.id() || self.kind() == other.kind() {
            Ok(())
        } else {
            Err(Error::WrongDevice {
                expected: self.id(),
                found: other.id(),
            })
        }
    }

    /// Whether kernels on this device can access `peer`'s memory once peer access is enabled
    /// (`cuDeviceCanAccessPeer`): true for the device itself and between simulated devices;
    /// true between two `Device`s on one GPU, even on different CUDA contexts (a cudarc
    /// non-primary one beside the primary: their kernels reach each other's memory, though the
    /// driver answers `cuDeviceCanAccessPeer` with no for a GPU and itself, and
    /// `cuCtxEnablePeerAccess` between the two with `CUDA_ERROR_PEER_ACCESS_UNSUPPORTED`:
    /// checked on an H100, `tests/cudarc_interop.rs`); between GPUs what the hardware says
    /// (NVLink or a PCIe topology that allows it).
    /// `Err(WrongDevice)` for a simulated device and a GPU.
    pub fn can_access_peer(&self, peer: &Device) -> Result<bool> {
        self.check_peer(peer)?;
        if self.id() == peer.id() {
            return Ok(true);
        }
        match (self.backend(), peer.backend()) {
            (Backend::Cuda(a), Backend::Cuda(b)) if a.ordinal == b.ordinal => Ok(true),
            (Backend::Cuda(a), Backend::Cuda(b)) => a.can_access_peer(b),
            _ => Ok(true),
        }
    }

    /// Lets kernels queued on this device read and write `peer`'s memory
    /// (`cuCtxEnablePeerAccess`; one direction: enable it on both for both). Enabling it twice
    /// is fine. Copies between devices do not need it.
    ///
    /// **Only memory from `cuMemAlloc`** (`CudaResource`, and the pools, arenas and bins over
    /// it): the driver's stream-ordered pools (`CudaAsyncResource`, `Device::malloc_async`)
    /// and virtual-memory mappings (`ExpandablePoolResource`) do not follow
    /// `cuCtxEnablePeerAccess` (the CUDA programming guide, "Device accessibility for multi-GPU
    /// support"), and this crate does not yet grant their access to peers
    /// (`cuMemPoolSetAccess`, `cuMemSetAccess`): a peer's kernel touching them faults. Copies
    /// between devices work with every resource. (A review's finding; not yet tested on two
    /// GPUs.)
    ///
    /// Errors: [`Error::InvalidArgument`] where the hardware does not allow it (see
    /// [`can_access_peer`](Self::can_access_peer)), `WrongDevice` for a simulated device and a
    /// GPU, a driver error otherwise.
    pub fn enable_peer_access(&self, peer: &Device) -> Result<()> {
        if !self.can_access_peer(peer)? {
            return Err(Error::InvalidArgument {
                what: "peer access is not possible between these two GPUs \
                       (cuDeviceCanAccessPeer says no)",
            });
        }
        match (self.backend(), peer.backend()) {
            (Backend::Cuda(a), Backend::Cuda(b)) if a.ordinal != b.ordinal => {
                a.enable_peer_access(b)?;
                tracing::info!(device = a.ordinal, peer = b.ordinal, "enabled peer access");
                Ok(())
            }
            _ => Ok(()),
        }
    }
}
