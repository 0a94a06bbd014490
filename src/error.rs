//! The crate's one error type.
//!
//! Every variant carries the numbers a user needs to act on it: the bytes asked for and what was
//! there, the driver's code and the call that returned it, the ordinal and how many devices exist.

use std::fmt;
use std::time::Duration;

/// Everything that can go wrong in streamalloc.
///
/// Errors are values, never panics: bad input returns one of these and leaves every resource as
/// it was (nothing allocated is lost when an error is returned).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// No CUDA driver library (`libcuda.so`) could be loaded on this machine.
    NoDriver,
    /// The driver is there but has no device with this ordinal.
    InvalidDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices the driver reports.
        count: usize,
    },
    /// A driver call failed.
    Driver {
        /// The driver function that failed, e.g. `cuMemAllocAsync`.
        call: &'static str,
        /// The driver's `CUresult` code.
        code: u32,
        /// The driver's name for the code, e.g. `CUDA_ERROR_OUT_OF_MEMORY`.
        name: String,
    },
    /// Not enough memory to serve a request.
    OutOfMemory {
        /// Bytes requested.
        requested: usize,
        /// What could still be had when the request failed: for the pool, the largest single
        /// request that would have succeeded (its largest free block, or the room left under
        /// its maximum); elsewhere, the bytes free or still obtainable.
        available: usize,
        /// The most this resource or device can ever hold.
        maximum: usize,
    },
    /// A size that is not valid for the call: zero where zero is not allowed, or a count of
    /// elements whose byte size overflows `usize`.
    InvalidSize {
        /// The size or element count given.
        size: usize,
        /// Why it is not valid.
        reason: &'static str,
    },
    /// An alignment that is not a power of two, or one larger than the memory can promise (a
    /// `DeviceVec` of an element type aligned past [`ALIGNMENT`](crate::ALIGNMENT)).
    InvalidAlignment {
        /// The alignment given.
        alignment: usize,
    },
    /// A pointer range that lies outside every live allocation of the device (the simulated
    /// device checks every access; a real GPU would fault).
    InvalidAddress {
        /// Start of the range.
        ptr: u64,
        /// Length of the range in bytes.
        bytes: usize,
    },
    /// A stream, event or pointer of one device was used with another.
    WrongDevice {
        /// The id of the device the call was made on.
        expected: u64,
        /// The id of the device the argument belongs to.
        found: u64,
    },
    /// A pointer given back to a resource that it did not hand out (or a size that does not
    /// match what it handed out there).
    UnknownPointer {
        /// The pointer.
        ptr: u64,
        /// The size given with it.
        bytes: usize,
    },
    /// An I/O operation of the crate failed (writing a log, reading a file).
    Io {
        /// What was being done.
        what: &'static str,
        /// The operating system's message.
        message: String,
    },
    /// A bad argument that no more specific variant describes.
    InvalidArgument {
        /// What was wrong.
        what: &'static str,
    },
    /// An element index past the end of a device vector.
    IndexOutOfBounds {
        /// The index given.
        index: usize,
        /// The vector's length.
        len: usize,
    },
    /// The host could not allocate memory the crate needed on it (the `Vec` a copy to the host
    /// fills, for a device buffer larger than what the host can give).
    HostOutOfMemory {
        /// Bytes requested on the host.
        requested: usize,
    },
    /// A wait ran past its deadline.
    Timeout {
        /// How long it waited.
        waited: Duration,
    },
    /// The simulated device's race detector found that this operation is not ordered with
    /// another use, the allocation or the free of the memory it touches (with
    /// [`RaceDetection::Error`](crate::RaceDetection::Error)); the operation was not queued.
    /// The report has both sites.
    StreamRace(Box<crate::Race>),
    /// The stream is being captured into a CUDA graph (by the user's code, through its cudarc
    /// handle), and this operation cannot be done during a capture without spoiling it or
    /// pulling another stream into it: recording a host-visible event, a blocking
    /// synchronization, an ordering of another stream after it. Nothing was done; try again
    /// once the capture has ended.
    StreamCapturing {
        /// What was refused.
        operation: &'static str,
    },
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Wraps a cudarc driver error with the name of the call that returned it.
    pub(crate) fn driver(call: &'static str, err: cudarc::driver::DriverError) -> Self {
        let name = err
            .error_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "CUDA_ERROR_UNKNOWN".to_owned());
        Error::Driver {
            call,
            code: err.0 as u32,
            name,
        }
    }

    /// Wraps an I/O error with what was being done.
    pub(crate) fn io(what: &'static str, err: &std::io::Error) -> Self {
        Error::Io {
            what,
            message: err.to_string(),
        }
    }

    /// True for every flavour of "not enough memory", the driver's included.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            Error::OutOfMemory { .. } | Error::HostOutOfMemory { .. } => true,
            Error::Driver { code, .. } => *code == 2, // CUDA_ERROR_OUT_OF_MEMORY
            _ => false,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NoDriver => write!(
                f,
                "no CUDA driver found: libcuda could not be loaded (use Device::simulated or \
                 Device::default_device to run without a GPU)"
            ),
            Error::InvalidDevice { ordinal, count } => write!(
                f,
                "no CUDA device with ordinal {ordinal}: the driver reports {count} device(s)"
            ),
            Error::Driver { call, code, name } => {
                write!(f, "{call} failed: {name} (CUresult {code})")
            }
            Error::OutOfMemory {
                requested,
                available,
                maximum,
            } => write!(
                f,
                "out of memory: requested {requested} bytes, {available} bytes available, \
                 maximum {maximum} bytes"
            ),
            Error::InvalidSize { size, reason } => write!(f, "invalid size {size}: {reason}"),
            Error::InvalidAlignment { alignment } => {
                write!(
                    f,
                    "invalid alignment {alignment}: not a power of two, or more than the memory \
                     is aligned to"
                )
            }
            Error::InvalidAddress { ptr, bytes } => write!(
                f,
                "invalid device address range {ptr:#x}..{:#x} ({bytes} bytes): not inside a live \
                 allocation",
                ptr.saturating_add(*bytes as u64)
            ),
            Error::WrongDevice { expected, found } => write!(
                f,
                "wrong device: the call is on device #{expected} but the argument belongs to \
                 device #{found}"
            ),
            Error::UnknownPointer { ptr, bytes } => write!(
                f,
                "unknown pointer {ptr:#x} ({bytes} bytes): this resource did not hand it out, or \
                 not with this size, or it was already freed"
            ),
            Error::Io { what, message } => write!(f, "{what}: {message}"),
            Error::InvalidArgument { what } => write!(f, "invalid argument: {what}"),
            Error::IndexOutOfBounds { index, len } => write!(
                f,
                "index {index} out of bounds: the vector has {len} element(s)"
            ),
            Error::HostOutOfMemory { requested } => write!(
                f,
                "out of host memory: {requested} bytes could not be allocated on the host"
            ),
            Error::Timeout { waited } => write!(f, "timed out after waiting {waited:?}"),
            Error::StreamRace(race) => write!(f, "{race}"),
            Error::StreamCapturing { operation } => write!(
                f,
                "{operation} refused: the stream is being captured into a CUDA graph"
            ),
        }
    }
}

impl std::error::Error for Error {}
