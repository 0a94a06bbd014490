//! The public face of the simulated device's stream-order race detector: what it reports
//! ([`Race`]), how ([`RaceDetection`]), and how user code declares its own accesses
//! ([`MemoryAccess`]). The machinery is in `detector.rs`.
//!
//! The detector keeps a vector clock per stream: every operation queued on a stream advances
//! the stream's own component, recording an event snapshots the clock, `wait` joins the event's
//! snapshot, and whatever the host has seen complete (an awaited or queried event, a blocking
//! synchronization) is joined into every operation queued afterwards. Each range of device
//! memory remembers the block it belongs to (a raw allocation, and inside it the blocks that
//! pools and other suballocating resources hand out, which they declare with
//! [`Device::note_allocation`](crate::Device::note_allocation) and
//! [`Device::note_free`](crate::Device::note_free)), where that block was allocated and freed,
//! and its recent uses. Every use is checked against them when it is queued.

use std::fmt;

use crate::device::DevicePtr;
use crate::device::StreamId;

/// What the simulated device does with a stream-order race it finds
/// ([`SimConfig::race_detection`](crate::SimConfig::race_detection)).
///
/// Every mode but [`Off`](Self::Off) keeps the races in
/// [`Device::races`](crate::Device::races) and logs each at `error` level.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RaceDetection {
    /// No detection: no clocks, no shadow memory, no cost.
    Off,
    /// Keep and log the races; every operation goes ahead.
    Record,
    /// As `Record`, and an operation that queues work on memory (a copy, a memset, a built-in
    /// kernel, a declared access) returns [`Error::StreamRace`](crate::Error::StreamRace)
    /// instead of being queued. Allocations and frees never fail for a race (failing them
    /// would lose memory): those are only recorded.
    Error,
    /// As `Record`, and the thread that queues the racing operation (or allocates or frees the
    /// block) panics at once, with both sites in the message: the stack trace points at the
    /// bug. A racing operation on memory is not queued, as in `Error` (queued, a copy would
    /// write into host memory that the panic frees as it unwinds the caller: a test that
    /// catches the panic would corrupt its heap). A racing free panics once the memory is
    /// back (in the crate's resources, or freed on the device), so a caller that catches the
    /// panic has lost nothing. A thread that is already panicking only records. A race found on the completion
    /// reactor's thread (a deferred free) is caught there and logged, so check
    /// [`Device::races`](crate::Device::races) at the end of a test as well.
    Panic,
}

impl Default for RaceDetection {
    /// [`Panic`](Self::Panic) in builds with debug assertions (tests, debug builds), else
    /// [`Record`](Self::Record): on by default, loud where it helps, never fatal in release.
    ///
    /// `STREAMALLOC_RACE_DETECTION` (`off`, `record`, `error` or `panic`) overrides it, for a
    /// whole test suite or a benchmark at once; another value is ignored (with a warning).
    fn default() -> Self {
        match std::env::var("STREAMALLOC_RACE_DETECTION").ok().as_deref() {
            Some("off") => return RaceDetection::Off,
            Some("record") => return RaceDetection::Record,
            Some("error") => return RaceDetection::Error,
            Some("panic") => return RaceDetection::Panic,
            Some(other) => tracing::warn!(
                value = other,
                "STREAMALLOC_RACE_DETECTION must be off, record, error or panic; ignored"
            ),
            None => {}
        }
        if cfg!(debug_assertions) {
            RaceDetection::Panic
        } else {
            RaceDetection::Record
        }
    }
}

/// How declared work uses a range of device memory
/// ([`Stream::declare_access`](crate::Stream::declare_access)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryAccess {
    /// The work only reads the range.
    Read,
    /// The work writes the range (or reads and writes it).
    Write,
}

/// What kind of stream-order race was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RaceKind {
    /// A use on a stream that is not ordered after the point where the block was allocated (on
    /// another stream): on a GPU, the block may still be in use there by its previous owner.
    UseBeforeAllocation,
    /// A use queued after the block was freed.
    UseAfterFree,
    /// A free at a point not ordered after an earlier use: memory that a stream may still be
    /// using was handed back (for example a buffer used on another stream and dropped without
    /// `record_stream`).
    FreedWhileInUse,
    /// A block handed out again at a point not ordered after its previous free on another
    /// stream (a pool that reuses memory freed on another stream without waiting for it).
    ReuseBeforeFree,
    /// Two writes on different streams, neither ordered before the other.
    WriteAfterWrite,
    /// A read on one stream of what another stream writes, not ordered after the write.
    ReadAfterWrite,
    /// A write on one stream of what another stream reads, not ordered after the read.
    WriteAfterRead,
}

impl RaceKind {
    fn describe(self) -> &'static str {
        match self {
            RaceKind::UseBeforeAllocation => "use not ordered after the block's allocation",
            RaceKind::UseAfterFree => "use after free",
            RaceKind::FreedWhileInUse => "free not ordered after a use",
            RaceKind::ReuseBeforeFree => "block reused before its free on another stream",
            RaceKind::WriteAfterWrite => "unordered writes on two streams",
            RaceKind::ReadAfterWrite => "read not ordered after a write on another stream",
            RaceKind::WriteAfterRead => "write not ordered after a read on another stream",
        }
    }
}

/// One side of a race: an operation, where it was queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RaceSite {
    /// The stream it was queued on; `None` for the host (a synchronous `malloc` or `free`).
    pub stream: Option<StreamId>,
    /// The operation: `memset_d8`, `copy_htod`, `allocate`, `free`, a declared access's name...
    pub op: &'static str,
    /// Its position on its stream: the detector's count of operations queued there before and
    /// including it (0 for the host).
    pub position: u64,
}

impl fmt::Display for RaceSite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.stream {
            Some(stream) => write!(f, "{} on {stream} (op {})", self.op, self.position),
            None => write!(f, "{} on the host", self.op),
        }
    }
}

/// A stream-order race found by the simulated device (see the module docs of
/// [`RaceDetection`]), with both sites.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Race {
    /// What was found.
    pub kind: RaceKind,
    /// The range the later operation touched (for a free, the block).
    pub ptr: DevicePtr,
    /// Its length in bytes.
    pub bytes: usize,
    /// The later operation: the one being queued (or allocated, or freed) when the race was
    /// found.
    pub at: RaceSite,
    /// The earlier one it races with: a use, the block's allocation, or its free.
    pub earlier: RaceSite,
    /// The block the memory belongs to (the innermost one the device knows): its start and
    /// length, where it was allocated, and where it was freed if it was.
    pub block: Option<RaceBlock>,
}

/// What the device knows of a block that a race touched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RaceBlock {
    /// Start of the block.
    pub ptr: DevicePtr,
    /// Its length in bytes.
    pub bytes: usize,
    /// Where it was allocated.
    pub allocated: RaceSite,
    /// Where it was freed, if it was (before the race, or by the racing free).
    pub freed: Option<RaceSite>,
}

impl fmt::Display for Race {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let relation = match self.kind {
            RaceKind::UseAfterFree => "comes after",
            _ => "is not ordered after",
        };
        write!(
            f,
            "stream-order race ({}): {} at {:#x}..{:#x} ({} bytes) {relation} {}",
            self.kind.describe(),
            self.at,
            self.ptr.0,
            self.ptr.0.saturating_add(self.bytes as u64),
            self.bytes,
            self.earlier,
        )?;
        if let Some(block) = &self.block {
            write!(
                f,
                "; block {:#x} ({} bytes) allocated by {}",
                block.ptr.0, block.bytes, block.allocated
            )?;
            if let Some(freed) = &block.freed {
                write!(f, ", freed by {freed}")?;
            }
        }
        Ok(())
    }
}
