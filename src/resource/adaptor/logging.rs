//! [`LoggingAdaptor`]: a CSV line per allocate, free and failed allocate, in the format of
//! RMM's `logging_resource_adaptor`, so that logs move between RMM's tools and this crate.

use std::fmt;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::device::{Device, DevicePtr};
use crate::error::{Error, Result};
use crate::resource::{MemoryKind, MemoryResource, MemoryWaiters};
use crate::stream::Stream;
use crate::sync::Mutex;

/// The environment variable [`LoggingAdaptor::from_env`] reads the log file's path from (RMM's
/// is `RMM_LOG_FILE`).
pub const LOG_FILE_ENV: &str = "STREAMALLOC_LOG_FILE";

/// The first line of every log: RMM's header.
pub(crate) const HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

struct Sink {
    writer: Box<dyn Write + Send>,
    /// Path of the file, for `Debug`; `None` for a writer given by the caller.
    path: Option<PathBuf>,
    /// The first write error since the last `flush`: a failed write never fails an
    /// allocation, it is reported by `flush`.
    error: Option<io::Error>,
    auto_flush: bool,
    lines: u64,
}

impl Sink {
    fn write_line(&mut self, line: &str) {
        let (writer, auto_flush) = (&mut self.writer, self.auto_flush);
        // A writer that panics (a user's sink) is a write error like any other. Let through,
        // the panic would leave the adaptor between the upstream and the caller: an allocation
        // the upstream made would never reach the caller, and a free logged before it is passed
        // on would never reach the upstream (lost memory both ways; a review's finding). The
        // writer is used again afterwards as it is, like one that returned an error.
        let result = panic::catch_unwind(AssertUnwindSafe(|| {
            let mut result = writer.write_all(line.as_bytes());
            if result.is_ok() && auto_flush {
                result = writer.flush();
            }
            result
        }))
        .unwrap_or_else(|_| Err(io::Error::other("the log writer panicked")));
        if let Err(e) = result {
            if self.error.is_none() {
                tracing::error!(error = %e, "LoggingAdaptor: could not write to the log");
                self.error = Some(e);
            }
        } else {
            self.lines += 1;
        }
    }
}

/// Writes one CSV line per allocate, free and failed allocate that goes through it, in the
/// format of RMM's `logging_resource_adaptor`, whose replay benchmark reads it back:
///
/// ```text
/// Thread,Time,Action,Pointer,Size,Stream
/// 1,14:03:07.123456,allocate,0x7f3a00000000,1024,3
/// 1,14:03:07.123502,free,0x7f3a00000000,1024,3
/// 2,14:03:07.124010,allocate failure,0x0,1125899906842624,4
/// ```
///
/// - **Thread**: a number for the calling thread, the same for every line the thread writes,
///   distinct between threads of the process (RMM writes the OS thread id: a number too).
/// - **Time**: the wall-clock time of day, `HH:MM:SS.ffffff` with microseconds (RMM's
///   `%H:%M:%S.%f`), in UTC (RMM uses local time; we have no time zone database).
/// - **Action**: `allocate`, `free`, or `allocate failure`.
/// - **Pointer**: the address in hex, `0x...`; `0x0` for a failed allocation (RMM writes the
///   null pointer there as well).
/// - **Size**: bytes, as the caller gave them.
/// - **Stream**: the stream's unique id ([`StreamId::get`](crate::StreamId::get)), in decimal.
///   RMM writes the driver's stream handle in hex, which its replay tool parses as a decimal
///   number; a decimal id replays correctly and, unlike a handle, is never reused.
///
/// Every call is logged, zero-byte ones included. An allocation is logged after the upstream
/// returns; a free is logged *before* it is passed upstream (as RMM does), so the log's order
/// is the memory's order: a pointer's `free` line always comes before the line of another
/// thread's `allocate` that reuses it. (A free that the upstream then rejects keeps its line;
/// the rejection is logged with `tracing::warn!`.)
///
/// Each line is formatted first and written with one call under one lock, so lines of
/// concurrent threads never interleave. A write error does not fail the allocation: the first
/// one is kept and returned by [`flush`](Self::flush). Output is buffered (files through a
/// `BufWriter`) unless [`auto_flush`](Self::auto_flush) is set; dropping the adaptor flushes.
pub struct LoggingAdaptor<U: MemoryResource> {
    upstream: U,
    sink: Mutex<Sink>,
}

impl<U: MemoryResource> fmt::Debug for LoggingAdaptor<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sink = self.sink.lock();
        f.debug_struct("LoggingAdaptor")
            .field("upstream", &self.upstream)
            .field("path", &sink.path)
            .field("lines", &sink.lines)
            .field("auto_flush", &sink.auto_flush)
            .field("write_error", &sink.error.as_ref().map(|e| e.to_string()))
            .finish()
    }
}

impl<U: MemoryResource> LoggingAdaptor<U> {
    /// Logs to `writer` (a file, a `Vec<u8>` behind a lock, stderr...), starting with the
    /// header line. Not buffered: wrap a slow writer in a `BufWriter`.
    pub fn new(upstream: U, writer: impl Write + Send + 'static) -> Self {
        Self::with_sink(upstream, Box::new(writer), None)
    }

    /// Logs to the file at `path`, created or truncated, through a `BufWriter`.
    /// `Err(Io)` if the file cannot be created. `upstream` is dropped on error.
    pub fn to_file(upstream: U, path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = File::create(path).map_err(|e| {
            tracing::error!(
                path = %path.display(),
                error = %e,
                "LoggingAdaptor: cannot create the log file"
            );
            Error::io("LoggingAdaptor: the log file cannot be created", &e)
        })?;
        Ok(Self::with_sink(
            upstream,
            Box::new(BufWriter::new(file)),
            Some(path.to_path_buf()),
        ))
    }

    /// Logs to the file named by the environment variable `STREAMALLOC_LOG_FILE`
    /// ([`LOG_FILE_ENV`]), as RMM's adaptor does with `RMM_LOG_FILE`. `Err(InvalidArgument)` if
    /// the variable is unset or empty, `Err(Io)` (as [`to_file`](Self::to_file)) if the file
    /// cannot be created. `upstream` is dropped on error.
    pub fn from_env(upstream: U) -> Result<Self> {
        match std::env::var_os(LOG_FILE_ENV) {
            Some(path) if !path.is_empty() => Self::to_file(upstream, PathBuf::from(path)),
            _ => Err(Error::InvalidArgument {
                what: "LoggingAdaptor::from_env: STREAMALLOC_LOG_FILE is not set",
            }),
        }
    }

    fn with_sink(upstream: U, writer: Box<dyn Write + Send>, path: Option<PathBuf>) -> Self {
        let mut sink = Sink {
            writer,
            path,
            error: None,
            auto_flush: false,
            lines: 0,
        };
        sink.write_line(&format!("{HEADER}\n"));
        Self {
            upstream,
            sink: Mutex::new(sink),
        }
    }

    /// Flushes after every line from now on (RMM's `auto_flush`): slower, but a crash loses
    /// nothing.
    pub fn auto_flush(self, on: bool) -> Self {
        self.sink.lock().auto_flush = on;
        self
    }

    /// The upstream resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }

    /// The path of the log file, if it logs to a file it opened.
    pub fn path(&self) -> Option<PathBuf> {
        self.sink.lock().path.clone()
    }

    /// Lines written so far, the header included.
    pub fn lines(&self) -> u64 {
        self.sink.lock().lines
    }

    /// Flushes the log. Returns the first write error since the last flush, if any
    /// (`Err(Io)`), and
    /// then forgets it.
    pub fn flush(&self) -> Result<()> {
        let mut sink = self.sink.lock();
        let flushed = sink.writer.flush();
        let error = sink.error.take();
        drop(sink);
        if let Err(e) = &flushed {
            tracing::error!(error = %e, "LoggingAdaptor: could not flush the log");
        }
        match (error, flushed) {
            (None, Ok(())) => Ok(()),
            (Some(e), _) | (None, Err(e)) => {
                Err(Error::io("LoggingAdaptor: writing the log failed", &e))
            }
        }
    }

    fn log(&self, action: &str, ptr: u64, bytes: usize, stream: &Stream) {
        let thread = thread_number();
        let stream = stream.id().get();
        let mut sink = self.sink.lock();
        // The time is read under the lock, so it never goes backwards down the file (as far
        // as the wall clock does not).
        let line = format!(
            "{thread},{},{action},{ptr:#x},{bytes},{stream}\n",
            TimeOfDay::now()
        );
        sink.write_line(&line);
    }
}

impl<U: MemoryResource> Drop for LoggingAdaptor<U> {
    fn drop(&mut self) {
        // A writer that panics here must not abort a drop made while unwinding.
        let mut sink = self.sink.lock();
        let _ = panic::catch_unwind(AssertUnwindSafe(|| sink.writer.flush()));
    }
}

// SAFETY: every allocation is the upstream's (itself a `MemoryResource`), passed on unchanged;
// the adaptor only logs.
unsafe impl<U: MemoryResource> MemoryResource for LoggingAdaptor<U> {
    fn device(&self) -> &Device {
        self.upstream.device()
    }

    fn memory_kind(&self) -> MemoryKind {
        self.upstream.memory_kind()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        match self.upstream.allocate(bytes, stream) {
            Ok(ptr) => {
                self.log("allocate", ptr.0, bytes, stream);
                Ok(ptr)
            }
            Err(e) => {
                self.log("allocate failure", 0, bytes, stream);
                Err(e)
            }
        }
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        // Before the upstream call: once it returns, another thread may get the memory back and
        // log its allocation, which must come after this line.
        self.log("free", ptr.0, bytes, stream);
        // SAFETY: the caller's contract, passed on.
        let result = unsafe { self.upstream.deallocate(ptr, bytes, stream) };
        if let Err(e) = &result {
            tracing::warn!(
                ptr = ptr.0,
                bytes,
                error = %e,
                "LoggingAdaptor: the upstream rejected a free that was logged"
            );
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

/// A number for the calling thread: 1 for the first thread that logs, 2 for the next...
/// (`ThreadId::as_u64` is unstable). A process-wide counter that loom never models, like
/// `StreamId`'s, so it names std's atomics directly.
pub(crate) fn thread_number() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    thread_local! {
        static NUMBER: u64 = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    NUMBER.with(|n| *n)
}

/// The UTC time of day, written as `HH:MM:SS.ffffff`.
pub(crate) struct TimeOfDay {
    seconds_of_day: u64,
    micros: u32,
}

impl TimeOfDay {
    /// The time of day of an instant given in microseconds since the Unix epoch.
    pub(crate) fn from_unix_us(us: u64) -> Self {
        Self {
            seconds_of_day: us / 1_000_000 % 86_400,
            micros: (us % 1_000_000) as u32,
        }
    }

    fn now() -> Self {
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Self {
            seconds_of_day: since_epoch.as_secs() % 86_400,
            micros: since_epoch.subsec_micros(),
        }
    }
}

impl fmt::Display for TimeOfDay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.seconds_of_day;
        write!(
            f,
            "{:02}:{:02}:{:02}.{:06}",
            s / 3600,
            s / 60 % 60,
            s % 60,
            self.micros
        )
    }
}
