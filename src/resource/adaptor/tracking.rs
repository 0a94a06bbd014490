//! [`TrackingAdaptor`]: every outstanding allocation, a report of them, and rejection of frees
//! it cannot match (RMM's `tracking_resource_adaptor`).

use std::backtrace::Backtrace;
use std::collections::BTreeMap;
use std::fmt::{self, Write as _};

use crate::device::{Device, DevicePtr};
use crate::error::{Error, Result};
use crate::resource::{MemoryKind, MemoryResource, MemoryWaiters};
use crate::stream::{Stream, StreamId};
use crate::sync::Mutex;

/// One outstanding allocation.
struct Entry {
    bytes: usize,
    /// The stream it was allocated on.
    stream: StreamId,
    /// Captured at allocation, if the adaptor was asked to.
    backtrace: Option<Backtrace>,
}

#[derive(Default)]
struct Table {
    /// Outstanding allocations by address.
    entries: BTreeMap<u64, Entry>,
    /// The sum of their sizes.
    bytes: usize,
}

/// Keeps every outstanding allocation made through it (pointer → size, stream, and a
/// [`Backtrace`] captured at allocation if asked), as RMM's `tracking_resource_adaptor`.
///
/// - [`outstanding`](Self::outstanding) and [`allocated_bytes`](Self::allocated_bytes) say what
///   is allocated and not yet freed; [`report`](Self::report) writes it out for a human
///   (sizes, pointers, streams, backtraces when captured), e.g. at shutdown to find a leak.
/// - A `deallocate` of a pointer it did not hand out, or with another size than it was
///   allocated with (or a second free of one), returns [`Error::UnknownPointer`], is logged with
///   `tracing::error!`, and is **not** passed upstream: the upstream never sees the bad free.
/// - Zero-byte allocations (a null pointer) are not tracked; they pass through.
///
/// One mutex guards the table, taken around the upstream call, never across it. Capturing a
/// backtrace costs tens of microseconds per allocation: ask for it while hunting a leak.
pub struct TrackingAdaptor<U: MemoryResource> {
    upstream: U,
    capture_backtraces: bool,
    table: Mutex<Table>,
}

impl<U: MemoryResource> fmt::Debug for TrackingAdaptor<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (count, bytes) = {
            let table = self.table.lock();
            (table.entries.len(), table.bytes)
        };
        f.debug_struct("TrackingAdaptor")
            .field("upstream", &self.upstream)
            .field("outstanding", &count)
            .field("allocated_bytes", &bytes)
            .field("capture_backtraces", &self.capture_backtraces)
            .finish()
    }
}

impl<U: MemoryResource> TrackingAdaptor<U> {
    /// Tracks the allocations made through it from `upstream`, without backtraces.
    pub fn new(upstream: U) -> Self {
        Self::with_options(upstream, false)
    }

    /// Tracks the allocations made through it from `upstream`, capturing a backtrace at each
    /// allocation (whatever `RUST_BACKTRACE` says) for [`report`](Self::report).
    pub fn with_backtraces(upstream: U) -> Self {
        Self::with_options(upstream, true)
    }

    /// [`new`](Self::new) or [`with_backtraces`](Self::with_backtraces), chosen by
    /// `capture_backtraces`.
    pub fn with_options(upstream: U, capture_backtraces: bool) -> Self {
        Self {
            upstream,
            capture_backtraces,
            table: Mutex::new(Table::default()),
        }
    }

    /// The upstream resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }

    /// Whether a backtrace is captured at each allocation.
    pub fn captures_backtraces(&self) -> bool {
        self.capture_backtraces
    }

    /// The outstanding allocations, `(pointer, bytes)` in address order.
    pub fn outstanding(&self) -> Vec<(DevicePtr, usize)> {
        self.table
            .lock()
            .entries
            .iter()
            .map(|(&ptr, e)| (DevicePtr(ptr), e.bytes))
            .collect()
    }

    /// How many allocations are outstanding.
    pub fn outstanding_count(&self) -> usize {
        self.table.lock().entries.len()
    }

    /// The bytes outstanding, as requested by the callers (RMM's `get_allocated_bytes`).
    pub fn allocated_bytes(&self) -> usize {
        self.table.lock().bytes
    }

    /// A human-readable list of what is still allocated: a summary line, then one line per
    /// allocation in address order (pointer, bytes, stream), each followed by its backtrace
    /// when one was captured (resolving symbols is slow the first time).
    ///
    /// ```text
    /// 2 outstanding allocations, 3072 bytes
    ///   0x7f3a00000000: 1024 bytes on stream#3
    ///   0x7f3a00000400: 2048 bytes on stream#3
    /// ```
    pub fn report(&self) -> String {
        let table = self.table.lock();
        let mut out = String::new();
        let plural = if table.entries.len() == 1 { "" } else { "s" };
        let _ = writeln!(
            out,
            "{} outstanding allocation{plural}, {} bytes",
            table.entries.len(),
            table.bytes
        );
        for (ptr, entry) in &table.entries {
            let _ = writeln!(out, "  {ptr:#x}: {} bytes on {}", entry.bytes, entry.stream);
            if let Some(backtrace) = &entry.backtrace {
                let _ = writeln!(out, "    allocated at:");
                for line in backtrace.to_string().lines() {
                    let _ = writeln!(out, "      {line}");
                }
            }
        }
        out
    }

    /// Logs [`report`](Self::report) with `tracing::debug!` (RMM's
    /// `log_outstanding_allocations`).
    pub fn log_outstanding(&self) {
        tracing::debug!(report = %self.report(), "outstanding allocations");
    }
}

// SAFETY: every allocation is the upstream's (itself a `MemoryResource`), passed on unchanged;
// the adaptor only tracks.
unsafe impl<U: MemoryResource> MemoryResource for TrackingAdaptor<U> {
    fn device(&self) -> &Device {
        self.upstream.device()
    }

    fn memory_kind(&self) -> MemoryKind {
        self.upstream.memory_kind()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        let ptr = self.upstream.allocate(bytes, stream)?;
        if bytes == 0 {
            return Ok(ptr);
        }
        let backtrace = self.capture_backtraces.then(Backtrace::force_capture);
        let mut table = self.table.lock();
        let entry = Entry {
            bytes,
            stream: stream.id(),
            backtrace,
        };
        if let Some(old) = table.entries.insert(ptr.0, entry) {
            // The upstream handed out memory that is still outstanding: its bug, not the
            // caller's. Keep the newer allocation, and say so loudly.
            table.bytes -= old.bytes;
            tracing::error!(
                ptr = ptr.0,
                bytes,
                old_bytes = old.bytes,
                "the upstream handed out a pointer that is still outstanding"
            );
        }
        table.bytes += bytes;
        Ok(ptr)
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        if bytes == 0 && ptr.0 == 0 {
            // SAFETY: the caller's contract, passed on (a zero-byte allocation's null pointer).
            return unsafe { self.upstream.deallocate(ptr, bytes, stream) };
        }
        if planted!(FORGET_AFTER_UPSTREAM) {
            // The planted bug: the memory goes back upstream before its entry is forgotten.
            let known = (self.table.lock().entries.get(&ptr.0)).is_some_and(|e| e.bytes == bytes);
            if !known {
                return Err(Error::UnknownPointer { ptr: ptr.0, bytes });
            }
            // SAFETY: as below.
            unsafe { self.upstream.deallocate(ptr, bytes, stream) }?;
            let mut table = self.table.lock();
            if let Some(entry) = table.entries.remove(&ptr.0) {
                table.bytes -= entry.bytes;
            }
            return Ok(());
        }
        let entry = {
            let mut table = self.table.lock();
            match table.entries.get(&ptr.0) {
                Some(entry) if entry.bytes == bytes => {
                    table.bytes -= bytes;
                    table.entries.remove(&ptr.0)
                }
                found => {
                    let tracked_bytes = found.map(|e| e.bytes);
                    drop(table);
                    tracing::error!(
                        ptr = ptr.0,
                        bytes,
                        ?tracked_bytes,
                        stream = %stream.id(),
                        "deallocate of a pointer this resource did not hand out (or not with \
                         this size, or already freed): not passed upstream"
                    );
                    return Err(Error::UnknownPointer { ptr: ptr.0, bytes });
                }
            }
        };
        // SAFETY: the caller's contract, passed on; and we checked that `ptr` is outstanding
        // from our `allocate` (so from the upstream's) with this `bytes`.
        let result = unsafe { self.upstream.deallocate(ptr, bytes, stream) };
        if result.is_err() {
            // Not freed: it is still outstanding.
            if let Some(entry) = entry {
                let mut table = self.table.lock();
                table.bytes += entry.bytes;
                table.entries.insert(ptr.0, entry);
            }
        }
        result
    }

    fn memory_waiters(&self) -> Option<&MemoryWaiters> {
        self.upstream.memory_waiters()
    }

    fn footprint(&self, bytes: usize) -> Result<usize> {
        self.upstream.footprint(bytes)
    }

    fn check_set(&self, sizes: &[usize]) -> Result<()> {
        self.upstream.check_set(sizes)
    }
    fn memory_snapshot(&self) -> Option<crate::resource::snapshot::Snapshot> {
        self.upstream.memory_snapshot()
    }
}

/// A bug the loom model plants (`loom-tests/adaptor_tables.rs`), constant off otherwise; read
/// through `planted!`.
#[cfg(streamalloc_loom)]
pub(crate) mod planted {
    /// `deallocate` gives the memory back upstream before it forgets the entry: another thread
    /// can get the same address meanwhile, and its entry is the one forgotten.
    pub(crate) static FORGET_AFTER_UPSTREAM: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);
}
