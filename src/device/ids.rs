//! The small types every layer names: a device address ([`DevicePtr`]) and a stream's identity
//! ([`StreamId`]). They live in the lowest layer so that the simulated device (which keys its
//! race detector by stream), events and resources can name them without naming `stream`.

use std::fmt;
use std::num::NonZeroU64;

/// A device address. Plain data: holding one is safe, using it is what the unsafe methods of
/// [`Stream`](crate::Stream) and [`Device`](crate::Device) guard.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The raw address (a `CUdeviceptr` on CUDA).
    pub fn as_raw(self) -> u64 {
        self.0
    }

    /// The address `bytes` further on. Wraps on overflow, like pointer arithmetic on the GPU.
    pub fn offset(self, bytes: usize) -> DevicePtr {
        DevicePtr(self.0.wrapping_add(bytes as u64))
    }
}

impl fmt::Debug for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DevicePtr({:#x})", self.0)
    }
}

/// A process-unique stream id: the key of per-stream state (free lists, the reactor's queues).
/// Unlike a driver handle, it is never reused while the process lives.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StreamId(NonZeroU64);

impl StreamId {
    /// The next id (each stream takes one when it is made).
    pub(crate) fn next() -> StreamId {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        StreamId(NonZeroU64::new(id).unwrap_or(NonZeroU64::MIN))
    }

    /// The id as a number.
    pub fn get(self) -> u64 {
        self.0.get()
    }
}

impl fmt::Debug for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stream#{}", self.0)
    }
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stream#{}", self.0)
    }
}
