//! `streamalloc-replay`: replays a memory-event log in RMM's CSV format (what RMM's
//! `logging_resource_adaptor` and this crate's `LoggingAdaptor` write) against one of this
//! crate's resources, and reports the wall time, peak memory, failed allocations and
//! fragmentation.
//!
//! ```text
//! streamalloc-replay log.csv --resource arena --arena-size 8GiB
//! streamalloc-replay log.csv --resource pool --initial 1GiB --maximum 16GiB
//! ```
//!
//! # The log
//!
//! `Thread,Time,Action,Pointer,Size,Stream` (the columns found by name in the header; `Time`
//! is ignored and `Stream` may be missing). `Action` is `allocate`, `free` or `allocate
//! failure`; `Pointer` is hex (`0x7f3a00000000`, `7f3a00000000`, or `(nil)` for null); `Size`
//! is decimal bytes. `Thread` and `Stream` are identifiers, compared as text: RMM writes
//! numbers and stream handles, this crate's adaptor stream ids. Each distinct thread of the log
//! is replayed by a thread of ours, each distinct stream by a stream of ours (RMM's default
//! stream, `0x0`, is a stream like any other here).
//!
//! A line that cannot be replayed stops the tool before anything runs, with its line number and
//! what is wrong, and exit code 2: a wrong number of fields, an unknown action, a bad number, an
//! `allocate` of a pointer still live, a `free` whose size differs from its allocation's, or a
//! `free` of a pointer no earlier line allocated (`--ignore-unmatched` skips those instead: a
//! log started while memory was already allocated has them).
//!
//! # How frees find their allocations, across threads
//!
//! Before replaying, one pass over the log in its order pairs each `free` with the `allocate`
//! that returned its pointer most recently (a pointer may be handed out many times), and gives
//! each allocation a number. During the replay, a shared table maps that number to the pointer
//! *our* resource returned, so a thread can free what another thread allocated.
//!
//! `--order log` (the default) is RMM's replay benchmark: each event waits for its turn in the
//! log's global order (a counter; the thread whose event is next is woken, with a short spin
//! before it parks), so the replay reproduces the log's interleaving exactly: the same memory
//! is live at every step, and the numbers are deterministic. Threads never run allocator code
//! at the same time, so this measures the allocator's decisions more than its scalability.
//!
//! `--order threads` lets every thread run through its own events freely, in its own order; a
//! `free` whose allocation has not been replayed yet waits for it (the allocation always comes
//! earlier in the log, so this cannot deadlock). Contention is real, but memory peaks may differ
//! from the log's.
//!
//! An `allocate failure` line is tried again (RMM's replay skips them): if it succeeds here the
//! memory is freed at once, so the replay keeps the log's memory use. A replayed `allocate` that
//! fails here is counted, and its `free` is skipped. Allocations the log never frees are freed
//! at the end and reported.
//!
//! # What it prints
//!
//! Wall time of the replay (threads started and waiting at a barrier before the clock starts);
//! peak in use (the most bytes live at once, as the log's sizes add up); peak reserved (the most
//! bytes the resource held from the device, counted by a wrapper around its upstream; for
//! `cuda-async`, the driver pool's reserve at the end); failed allocations; and fragmentation,
//! defined as `1 - peak in use / peak reserved`: the share of the memory taken from the device
//! at the peak that the allocator could not put to use (rounding, free blocks too small or on
//! the wrong stream, slack).
//!
//! `--picture memory.html` also writes the picture of the replay (what `streamalloc-picture`
//! draws from the log, plus the bytes the resource reserved from the device over time, and,
//! as the address space, the resource's own snapshot after the log's peak event: its chunks,
//! and its free blocks by stream).
//!
//! Exit codes: 0 done; 1 an error (the file cannot be read, the device or resource cannot be
//! made, a free was refused by the resource); 2 a malformed log or bad arguments.

use std::collections::HashMap;
use std::fmt;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Barrier, Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
use streamalloc::resource::binning::BinningResource;
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::cuda_async::{CudaAsyncOptions, CudaAsyncResource};
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::resource::snapshot::{Block, BlockState, Snapshot};
use streamalloc::{Device, DevicePtr, MemoryKind, MemoryResource, SimConfig, Stream};

// The picture of `--picture`, shared with `streamalloc-picture`.
#[path = "../tools/picture/mod.rs"]
mod picture;

// ===== arguments =====

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ResourceKind {
    /// `PoolResource` over the device (`--initial`, `--maximum`).
    Pool,
    /// `ArenaResource` over the device (`--arena-size` or `--initial`/`--maximum`,
    /// `--superblock-size`).
    Arena,
    /// `BinningResource`: power-of-two fixed-size bins over a pool, the pool for larger
    /// requests (RMM's replay configuration: bins of 2^18..2^22 bytes).
    Binning,
    /// `CudaResource`: the driver's allocator, no pooling.
    Cuda,
    /// `CudaAsyncResource`: the driver's stream-ordered pool (`--initial`, `--maximum`,
    /// `--release-threshold`).
    CudaAsync,
}

impl fmt::Display for ResourceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ResourceKind::Pool => "pool",
            ResourceKind::Arena => "arena",
            ResourceKind::Binning => "binning",
            ResourceKind::Cuda => "cuda",
            ResourceKind::CudaAsync => "cuda-async",
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Order {
    /// Every event in the log's global order, as RMM's replay benchmark does.
    Log,
    /// Each thread in its own order; a free waits only for its allocation.
    Threads,
}

/// Replays an RMM-format memory-event log (Thread,Time,Action,Pointer,Size,Stream) against a
/// streamalloc resource and reports wall time, peak memory, failed allocations and
/// fragmentation.
///
/// Sizes take units: 4096, 64KiB, 1.5GiB, 2G (binary), 2GB (decimal).
#[derive(Debug, Parser)]
#[command(name = "streamalloc-replay", version)]
struct Args {
    /// The log file (CSV, with a header line).
    log: PathBuf,

    /// The resource to replay against.
    #[arg(short, long, value_enum, default_value_t = ResourceKind::Pool)]
    resource: ResourceKind,

    /// Bytes the pool, arena or cuda-async pool takes at start [default: 0].
    #[arg(long, value_parser = parse_size)]
    initial: Option<u64>,

    /// The most the pool, arena or cuda-async pool may hold [default: the device's memory].
    #[arg(long, value_parser = parse_size)]
    maximum: Option<u64>,

    /// Arena: RMM's `arena_size`, a fixed arena (initial = maximum = this, unless `--maximum`
    /// is given).
    #[arg(long, value_parser = parse_size)]
    arena_size: Option<u64>,

    /// Arena: the superblock size, also the largest request a stream arena serves.
    #[arg(long, value_parser = parse_size, default_value = "1MiB")]
    superblock_size: u64,

    /// Binning: the smallest bin is 2^this bytes.
    #[arg(long, default_value_t = 18)]
    bin_min_log2: u32,

    /// Binning: the largest bin is 2^this bytes.
    #[arg(long, default_value_t = 22)]
    bin_max_log2: u32,

    /// Binning: blocks each fixed-size bin takes from the pool at a time.
    #[arg(long, default_value_t = 128)]
    blocks_per_chunk: usize,

    /// cuda-async: freed bytes the driver pool keeps [default: all].
    #[arg(long, value_parser = parse_size)]
    release_threshold: Option<u64>,

    /// The order events are replayed in.
    #[arg(long, value_enum, default_value_t = Order::Log)]
    order: Order,

    /// Skip frees of pointers no earlier line allocated, instead of stopping.
    #[arg(long)]
    ignore_unmatched: bool,

    /// The device: `auto` (a GPU if there is one, else the simulated device; the
    /// STREAMALLOC_DEVICE variable can choose), `sim`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "auto")]
    device: String,

    /// Also write the picture of the replay to this HTML file (as `streamalloc-picture` draws
    /// a log, plus the memory the resource reserved over time and, as the address map, the
    /// resource's own snapshot at the log's peak).
    #[arg(long)]
    picture: Option<PathBuf>,

    /// The simulated device's memory [default: 16GiB].
    #[arg(long, value_parser = parse_size)]
    sim_memory: Option<u64>,
}

/// `4096`, `64KiB`, `1.5 GiB`, `2G` (binary), `2GB` (decimal).
fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number.parse().map_err(|_| {
        format!("`{text}` is not a size (a number, then a unit such as KiB, MiB, GiB)")
    })?;
    let multiplier: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "ki" | "kib" => 1024.0,
        "kb" => 1e3,
        "m" | "mi" | "mib" => 1024.0 * 1024.0,
        "mb" => 1e6,
        "g" | "gi" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "gb" => 1e9,
        "t" | "ti" | "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        "tb" => 1e12,
        other => {
            return Err(format!(
                "unknown unit `{other}` in `{text}` (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
            ))
        }
    };
    let bytes = value * multiplier;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(format!("`{text}` is out of range"));
    }
    Ok(bytes.round() as u64)
}

/// `1.50 MiB`.
fn fmt_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = "B";
    for u in UNITS {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = u;
    }
    format!("{value:.2} {unit}")
}

// ===== the log =====

/// A line that cannot be replayed.
#[derive(Debug)]
struct Malformed {
    line: u64,
    what: String,
}

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.what)
    }
}

#[derive(Debug, Clone, Copy)]
enum Op {
    /// Replay an allocation; `id` numbers it for its free.
    Alloc { id: u32, size: u64 },
    /// Free allocation `id`.
    Free { id: u32, size: u64 },
    /// An `allocate failure` line: try it again.
    Fail { size: u64 },
    /// A zero-byte allocate or free of null: nothing to do but keep the turn.
    Nop,
}

#[derive(Debug, Clone, Copy)]
struct Ev {
    /// The event's place in the log's order.
    index: u64,
    op: Op,
    stream: u32,
}

/// The log, split by thread, with each free paired with its allocation.
#[derive(Debug, Default)]
struct Log {
    threads: Vec<Vec<Ev>>,
    /// The thread of each event, by index (for `--order log`).
    owner: Vec<u32>,
    streams: usize,
    /// (size, stream) of each allocation, by id.
    allocs: Vec<(u64, u32)>,
    events: u64,
    alloc_lines: u64,
    free_lines: u64,
    fail_lines: u64,
    unmatched_skipped: u64,
}

const COLUMNS: &str = "Thread,Time,Action,Pointer,Size,Stream";

fn parse_pointer(text: &str) -> Option<u64> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("(nil)")
        || t.eq_ignore_ascii_case("nil")
        || t.eq_ignore_ascii_case("null")
    {
        return Some(0);
    }
    let hex = t
        .strip_prefix("0x")
        .or_else(|| t.strip_prefix("0X"))
        .unwrap_or(t);
    if hex.is_empty() {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

fn parse_log(path: &Path, ignore_unmatched: bool) -> Result<Log, ParseError> {
    let file = std::fs::File::open(path)
        .map_err(|e| ParseError::Io(format!("{}: {e}", path.display())))?;
    let length = file.metadata().map(|m| m.len()).unwrap_or(0);
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(true)
        .flexible(true)
        .trim(csv::Trim::All)
        .from_reader(std::io::BufReader::new(file));
    let malformed = |line: u64, what: String| ParseError::Malformed(Malformed { line, what });

    let headers = reader
        .headers()
        .map_err(|e| malformed(1, format!("cannot read the header: {e}")))?
        .clone();
    if headers.is_empty() || (headers.len() == 1 && headers[0].is_empty()) {
        return Err(malformed(
            1,
            format!("empty log: expected the header `{COLUMNS}`"),
        ));
    }
    let column = |name: &str| headers.iter().position(|h| h.eq_ignore_ascii_case(name));
    let mut required = [
        ("Thread", 0usize),
        ("Action", 0),
        ("Pointer", 0),
        ("Size", 0),
    ];
    for (name, index) in required.iter_mut() {
        *index = column(name).ok_or_else(|| {
            malformed(
                1,
                format!("the header has no `{name}` column (expected `{COLUMNS}`)"),
            )
        })?;
    }
    let [(_, c_thread), (_, c_action), (_, c_pointer), (_, c_size)] = required;
    let c_stream = column("Stream");

    let progress = bar(
        length,
        16 << 20,
        "parsing",
        "{msg} [{bar:40}] {bytes}/{total_bytes} ({eta})",
    );
    let mut log = Log::default();
    let mut threads: HashMap<String, u32> = HashMap::new();
    let mut streams: HashMap<String, u32> = HashMap::new();
    // Log pointer → (allocation id, size, line).
    let mut live: HashMap<u64, (u32, u64, u64)> = HashMap::new();
    let mut record = csv::StringRecord::new();
    loop {
        match reader.read_record(&mut record) {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => {
                let line = e.position().map_or(0, |p| p.line());
                return Err(malformed(line, format!("not valid CSV: {e}")));
            }
        }
        let line = record.position().map_or(0, |p| p.line());
        if log.events % 65536 == 0 {
            progress.set_position(record.position().map_or(0, |p| p.byte()));
        }
        if record.len() != headers.len() {
            return Err(malformed(
                line,
                format!(
                    "expected {} fields (as in the header), found {}",
                    headers.len(),
                    record.len()
                ),
            ));
        }
        let thread_key = &record[c_thread];
        if thread_key.is_empty() {
            return Err(malformed(line, "the Thread field is empty".into()));
        }
        let next = threads.len() as u32;
        let thread = *threads.entry(thread_key.to_owned()).or_insert(next);
        let stream_key = c_stream.map_or("0", |c| &record[c]);
        let next = streams.len() as u32;
        let stream = *streams.entry(stream_key.to_owned()).or_insert(next);
        let pointer = parse_pointer(&record[c_pointer]).ok_or_else(|| {
            malformed(
                line,
                format!(
                    "`{}` is not a pointer (hex, e.g. 0x7f3a00000000)",
                    &record[c_pointer]
                ),
            )
        })?;
        let size: u64 = record[c_size].parse().map_err(|_| {
            malformed(
                line,
                format!("`{}` is not a size in bytes", &record[c_size]),
            )
        })?;
        let action = record[c_action].to_ascii_lowercase();
        let op = match action.as_str() {
            "allocate" => {
                log.alloc_lines += 1;
                if pointer == 0 {
                    if size != 0 {
                        return Err(malformed(
                            line,
                            format!("allocate of {size} bytes returned a null pointer"),
                        ));
                    }
                    Op::Nop
                } else {
                    if let Some(&(_, _, since)) = live.get(&pointer) {
                        return Err(malformed(
                            line,
                            format!("allocate returned {pointer:#x}, which is still live (allocated at line {since})"),
                        ));
                    }
                    let id = u32::try_from(log.allocs.len())
                        .map_err(|_| malformed(line, "more than 2^32 allocations".into()))?;
                    log.allocs.push((size, stream));
                    live.insert(pointer, (id, size, line));
                    Op::Alloc { id, size }
                }
            }
            "free" => {
                log.free_lines += 1;
                if pointer == 0 {
                    if size != 0 {
                        return Err(malformed(
                            line,
                            format!("free of a null pointer with {size} bytes"),
                        ));
                    }
                    Op::Nop
                } else {
                    match live.remove(&pointer) {
                        Some((id, allocated, at)) => {
                            if allocated != size {
                                return Err(malformed(
                                    line,
                                    format!("free of {pointer:#x} with {size} bytes, allocated with {allocated} bytes at line {at}"),
                                ));
                            }
                            Op::Free { id, size }
                        }
                        None if ignore_unmatched => {
                            log.unmatched_skipped += 1;
                            Op::Nop
                        }
                        None => {
                            return Err(malformed(
                                line,
                                format!("free of {pointer:#x}, which no earlier line allocated or which was already freed (--ignore-unmatched skips these)"),
                            ))
                        }
                    }
                }
            }
            "allocate failure" => {
                log.fail_lines += 1;
                Op::Fail { size }
            }
            _ => {
                return Err(malformed(
                    line,
                    format!(
                        "unknown action `{}` (expected allocate, free or allocate failure)",
                        &record[c_action]
                    ),
                ))
            }
        };
        if thread as usize == log.threads.len() {
            log.threads.push(Vec::new());
        }
        log.threads[thread as usize].push(Ev {
            index: log.events,
            op,
            stream,
        });
        log.owner.push(thread);
        log.events += 1;
    }
    progress.finish_and_clear();
    log.streams = streams.len();
    Ok(log)
}

enum ParseError {
    Io(String),
    Malformed(Malformed),
}

// ===== resources =====

/// Counts the bytes a resource holds from its upstream: its reserve, current and peak.
#[derive(Debug)]
struct Counted<U> {
    inner: U,
    current: AtomicU64,
    peak: AtomicU64,
}

impl<U> Counted<U> {
    fn new(inner: U) -> Self {
        Self {
            inner,
            current: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        }
    }
}

impl<U: MemoryResource> MemoryResource for Counted<U> {
    fn device(&self) -> &Device {
        self.inner.device()
    }

    fn memory_kind(&self) -> MemoryKind {
        self.inner.memory_kind()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> streamalloc::Result<DevicePtr> {
        let ptr = self.inner.allocate(bytes, stream)?;
        let now = self.current.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
        self.peak.fetch_max(now, Ordering::Relaxed);
        Ok(ptr)
    }

    unsafe fn deallocate(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        stream: &Stream,
    ) -> streamalloc::Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.deallocate(ptr, bytes, stream) }?;
        self.current.fetch_sub(bytes as u64, Ordering::Relaxed);
        Ok(())
    }
}

/// The resource replayed against. One value for the whole run, so its size does not matter.
#[allow(clippy::large_enum_variant)]
enum Built {
    Pool(PoolResource<Counted<CudaResource>>),
    Arena(ArenaResource<Counted<CudaResource>>),
    Binning(BinningResource<PoolResource<Counted<CudaResource>>>),
    Cuda(Counted<CudaResource>),
    CudaAsync(CudaAsyncResource),
}

impl Built {
    fn resource(&self) -> &dyn MemoryResource {
        match self {
            Built::Pool(r) => r,
            Built::Arena(r) => r,
            Built::Binning(r) => r,
            Built::Cuda(r) => r,
            Built::CudaAsync(r) => r,
        }
    }

    /// The counter of bytes held from the device, if there is one.
    fn counted(&self) -> Option<&Counted<CudaResource>> {
        match self {
            Built::Pool(r) => Some(r.upstream()),
            Built::Arena(r) => Some(r.upstream()),
            Built::Binning(r) => Some(r.upstream().upstream()),
            Built::Cuda(r) => Some(r),
            Built::CudaAsync(_) => None,
        }
    }

    /// The most bytes held from the device, if known.
    fn peak_reserved(&self) -> Option<u64> {
        let counted = match self {
            Built::Pool(r) => r.upstream(),
            Built::Arena(r) => r.upstream(),
            Built::Binning(r) => r.upstream().upstream(),
            Built::Cuda(r) => r,
            Built::CudaAsync(_) => return None,
        };
        Some(counted.peak.load(Ordering::Relaxed))
    }
}

fn round256(bytes: u64) -> usize {
    bytes.next_multiple_of(256) as usize
}

fn build(args: &Args, device: &Device) -> streamalloc::Result<(Built, String)> {
    let cuda = || Counted::new(CudaResource::new(device));
    let total = device.total_memory() as u64;
    let pool = || {
        let options = PoolOptions {
            initial: round256(args.initial.unwrap_or(0)),
            maximum: args.maximum.map(round256),
            ..PoolOptions::default()
        };
        let text = format!(
            "initial {}, maximum {}",
            fmt_bytes(options.initial as u64),
            fmt_bytes(options.maximum.map_or(total, |m| m as u64))
        );
        PoolResource::new(cuda(), options).map(|p| (p, text))
    };
    Ok(match args.resource {
        ResourceKind::Pool => {
            let (p, text) = pool()?;
            (Built::Pool(p), format!("pool ({text})"))
        }
        ResourceKind::Arena => {
            let initial = round256(args.arena_size.or(args.initial).unwrap_or(0));
            let maximum = args.maximum.or(args.arena_size).map(round256);
            let options = ArenaOptions {
                initial,
                maximum,
                superblock_size: round256(args.superblock_size.max(1)),
            };
            let text = format!(
                "arena (initial {}, maximum {}, superblocks of {})",
                fmt_bytes(initial as u64),
                fmt_bytes(maximum.map_or(total, |m| m as u64)),
                fmt_bytes(options.superblock_size as u64)
            );
            (Built::Arena(ArenaResource::new(cuda(), options)?), text)
        }
        ResourceKind::Binning => {
            let (p, text) = pool()?;
            let b = BinningResource::builder(p)
                .bins_pow2(args.bin_min_log2, args.bin_max_log2)
                .blocks_per_chunk(args.blocks_per_chunk)
                .build()?;
            let text = format!(
                "binning (bins of {}..{}, {} blocks per chunk, over a pool: {text})",
                fmt_bytes(1u64.checked_shl(args.bin_min_log2).unwrap_or(0)),
                fmt_bytes(1u64.checked_shl(args.bin_max_log2).unwrap_or(0)),
                args.blocks_per_chunk
            );
            (Built::Binning(b), text)
        }
        ResourceKind::Cuda => (Built::Cuda(cuda()), "cuda".to_owned()),
        ResourceKind::CudaAsync => {
            let options = CudaAsyncOptions {
                release_threshold: args.release_threshold.map(|b| b as usize),
                initial_pool_size: args.initial.map(|b| b as usize),
                maximum_pool_size: args.maximum.map(|b| b as usize),
            };
            let text = format!(
                "cuda-async (initial {}, maximum {}, release threshold {})",
                fmt_bytes(args.initial.unwrap_or(0)),
                fmt_bytes(args.maximum.unwrap_or(total)),
                args.release_threshold
                    .map_or_else(|| "none: keeps all".to_owned(), fmt_bytes)
            );
            (
                Built::CudaAsync(CudaAsyncResource::new(device, options)?),
                text,
            )
        }
    })
}

fn open_device(args: &Args) -> streamalloc::Result<Device> {
    let sim = |memory: Option<u64>| {
        let mut config = SimConfig::default();
        if let Some(bytes) = memory {
            config.total_memory = bytes as usize;
        }
        Device::simulated(config)
    };
    match args.device.as_str() {
        "auto" => {
            let device = Device::default_device()?;
            Ok(if device.is_simulated() && args.sim_memory.is_some() {
                sim(args.sim_memory)
            } else {
                device
            })
        }
        "sim" | "simulated" => Ok(sim(args.sim_memory)),
        "cuda" => Device::cuda(0),
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(ordinal)) => Device::cuda(ordinal),
            _ => Err(streamalloc::Error::InvalidArgument {
                what: "--device must be auto, sim, cuda or cuda:N",
            }),
        },
    }
}

// ===== the replay =====

/// Slot values besides a pointer (pointers are 256-aligned, so never these).
const PENDING: u64 = 0;
const FAILED: u64 = 1;
const FREED: u64 = 2;

/// What the threads share.
struct Shared<'a> {
    mr: &'a dyn MemoryResource,
    streams: &'a [Stream],
    order: Order,
    /// Our pointer for each allocation id, or PENDING / FAILED / FREED.
    slots: Vec<AtomicU64>,
    /// `--order log`: the index of the event whose turn it is.
    turn: AtomicU64,
    owner: &'a [u32],
    /// Each replay thread's handle, for waking it when its turn comes.
    handles: Vec<OnceLock<Thread>>,
    /// Whether each replay thread is parked (or about to park) waiting for its turn.
    parked: Vec<AtomicBool>,
    /// `--order threads`: how many frees wait for their allocation, and who waits for which.
    waiting: AtomicUsize,
    slot_waiters: Mutex<HashMap<u32, Thread>>,
    live: AtomicU64,
    peak_live: AtomicU64,
    failed: AtomicU64,
    skipped_frees: AtomicU64,
    fail_lines_failed: AtomicU64,
    free_errors: AtomicU64,
    first_error: Mutex<Option<String>>,
    progress: ProgressBar,
    /// `--picture`: what the picture needs from the replay.
    watch: Option<Watch<'a>>,
}

/// What `--picture` records during the replay: the bytes reserved after each event, and the
/// resource's snapshot after the event at the log's peak.
struct Watch<'a> {
    /// The resource's reserve now (its upstream's counter), if known.
    reserved_now: Option<&'a AtomicU64>,
    reserved: Vec<AtomicU64>,
    snapshot_at: Option<u64>,
    snapshot: Mutex<Option<Snapshot>>,
    /// (size, stream) of each allocation, by id (the log's).
    allocs: &'a [(u64, u32)],
}

impl Shared<'_> {
    /// After event `index`: the reserve, and at the peak the resource's snapshot with the
    /// live allocations of the replay (their slots) as its in-use blocks.
    fn watch_after(&self, index: u64) {
        let Some(watch) = &self.watch else { return };
        if let Some(now) = watch.reserved_now {
            watch.reserved[index as usize].store(now.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        if watch.snapshot_at == Some(index) {
            let snapshot = self.mr.memory_snapshot().map(|mut snapshot| {
                let mut live: Vec<Block> = self
                    .slots
                    .iter()
                    .enumerate()
                    .filter_map(|(id, slot)| {
                        let ptr = slot.load(Ordering::Acquire);
                        (ptr != PENDING && ptr != FAILED && ptr != FREED).then(|| {
                            let (size, stream) = watch.allocs[id];
                            let mut block = Block::new(
                                ptr,
                                size.next_multiple_of(256),
                                BlockState::InUse,
                                Some(self.streams[stream as usize].id().get()),
                            );
                            block.requested = Some(size);
                            block
                        })
                    })
                    .collect();
                snapshot.merge_live(&mut live);
                snapshot
            });
            *watch.snapshot.lock().unwrap_or_else(|e| e.into_inner()) = snapshot;
        }
    }
}

impl Shared<'_> {
    /// `--order log`: waits until event `index` is next. Spins a little, then yields (the
    /// thread whose turn it is may need this core), then parks until the thread before hands
    /// over the turn.
    fn wait_turn(&self, index: u64, me: usize) {
        let mut tries = 0u32;
        while self.turn.load(Ordering::Acquire) != index {
            tries += 1;
            if tries < 64 {
                std::hint::spin_loop();
            } else if tries < 64 + 256 {
                std::thread::yield_now();
            } else {
                // Announce the park, then look again: `pass_turn` stores the turn and then
                // reads the flag (both SeqCst), so one of the two sees the other.
                self.parked[me].store(true, Ordering::SeqCst);
                if self.turn.load(Ordering::SeqCst) != index {
                    std::thread::park_timeout(Duration::from_millis(50));
                }
                self.parked[me].store(false, Ordering::Relaxed);
            }
        }
    }

    fn pass_turn(&self, index: u64, me: usize) {
        self.turn.store(index + 1, Ordering::SeqCst);
        if let Some(&next) = self.owner.get(index as usize + 1) {
            let next = next as usize;
            if next != me && self.parked[next].load(Ordering::SeqCst) {
                if let Some(handle) = self.handles[next].get() {
                    handle.unpark();
                }
            }
        }
    }

    /// `--order threads`: our pointer for allocation `id`, waiting until it is replayed.
    ///
    /// The waiter counts itself in `waiting`, registers in `slot_waiters`, then looks at the
    /// slot again; `fill_slot` stores the slot, then reads `waiting` (both SeqCst) and wakes
    /// the registered thread. Either the filler sees the count (and, through the map's lock,
    /// the registration or a registration that comes after its store), or the waiter sees the
    /// slot filled.
    fn wait_slot(&self, id: u32) -> u64 {
        let slot = &self.slots[id as usize];
        let value = slot.load(Ordering::SeqCst);
        if value != PENDING {
            return value;
        }
        self.waiting.fetch_add(1, Ordering::SeqCst);
        self.waiters().insert(id, std::thread::current());
        let value = loop {
            let value = slot.load(Ordering::SeqCst);
            if value != PENDING {
                break value;
            }
            std::thread::park_timeout(Duration::from_millis(50));
        };
        self.waiters().remove(&id);
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        value
    }

    fn waiters(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Thread>> {
        self.slot_waiters.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn fill_slot(&self, id: u32, value: u64) {
        self.slots[id as usize].store(value, Ordering::SeqCst);
        if self.order == Order::Threads && self.waiting.load(Ordering::SeqCst) > 0 {
            if let Some(waiter) = self.waiters().get(&id) {
                waiter.unpark();
            }
        }
    }

    fn error(&self, what: String) {
        self.first_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(what);
    }

    fn run(&self, op: Op, stream: &Stream) {
        match op {
            Op::Alloc { id, size } => match self.mr.allocate(size as usize, stream) {
                Ok(ptr) => {
                    let live = self.live.fetch_add(size, Ordering::Relaxed) + size;
                    self.peak_live.fetch_max(live, Ordering::Relaxed);
                    self.fill_slot(id, ptr.0);
                }
                Err(_) => {
                    // The resource ran out (or refused): counted, and its free is skipped.
                    self.failed.fetch_add(1, Ordering::Relaxed);
                    self.fill_slot(id, FAILED);
                }
            },
            Op::Free { id, size } => {
                let ptr = match self.order {
                    Order::Log => self.slots[id as usize].load(Ordering::Acquire),
                    Order::Threads => self.wait_slot(id),
                };
                if ptr == FAILED || ptr == PENDING || ptr == FREED {
                    self.skipped_frees.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                self.slots[id as usize].store(FREED, Ordering::Relaxed);
                // SAFETY: `ptr` came from this resource's `allocate` with `size` bytes (the
                // log pairs each free with its allocation and checks the size), is freed once
                // (the slot is now FREED), and no GPU work uses it.
                match unsafe { self.mr.deallocate(DevicePtr(ptr), size as usize, stream) } {
                    Ok(()) => {
                        self.live.fetch_sub(size, Ordering::Relaxed);
                    }
                    Err(e) => {
                        self.free_errors.fetch_add(1, Ordering::Relaxed);
                        self.error(format!("free of {ptr:#x} ({size} bytes) failed: {e}"));
                    }
                }
            }
            Op::Fail { size } => match self.mr.allocate(size as usize, stream) {
                Ok(ptr) => {
                    // SAFETY: just allocated with `size` bytes, unused, freed once.
                    if let Err(e) = unsafe { self.mr.deallocate(ptr, size as usize, stream) } {
                        self.free_errors.fetch_add(1, Ordering::Relaxed);
                        self.error(format!("free of {:#x} ({size} bytes) failed: {e}", ptr.0));
                    }
                }
                Err(_) => {
                    self.fail_lines_failed.fetch_add(1, Ordering::Relaxed);
                }
            },
            Op::Nop => {}
        }
    }

    /// One replay thread: its events, in order.
    fn thread(&self, me: usize, events: &[Ev], start: &Barrier) {
        let _ = self.handles[me].set(std::thread::current());
        start.wait();
        let mut done = 0u64;
        for ev in events {
            let stream = &self.streams[ev.stream as usize];
            match self.order {
                Order::Log => {
                    self.wait_turn(ev.index, me);
                    self.run(ev.op, stream);
                    self.watch_after(ev.index);
                    self.pass_turn(ev.index, me);
                }
                Order::Threads => {
                    self.run(ev.op, stream);
                    self.watch_after(ev.index);
                }
            }
            done += 1;
            if done.is_multiple_of(1024) {
                self.progress.inc(1024);
            }
        }
        self.progress.inc(done % 1024);
    }
}

/// A progress bar on stderr for jobs of at least `min` units, hidden when stderr is not a
/// terminal.
fn bar(length: u64, min: u64, message: &'static str, template: &str) -> ProgressBar {
    if length < min || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(length).with_message(message);
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

struct Outcome {
    wall: Duration,
    peak_live: u64,
    failed: u64,
    skipped_frees: u64,
    fail_lines_failed: u64,
    free_errors: u64,
    first_error: Option<String>,
    leaked: u64,
    leaked_bytes: u64,
}

fn replay<'a>(
    log: &'a Log,
    mr: &'a dyn MemoryResource,
    streams: &'a [Stream],
    order: Order,
    watch: Option<Watch<'a>>,
) -> (Outcome, Option<Watch<'a>>) {
    let progress = bar(
        log.events,
        100_000,
        "replaying",
        "{msg} [{bar:40}] {human_pos}/{human_len} events, {elapsed} (eta {eta})",
    );
    let shared = Shared {
        mr,
        streams,
        order,
        slots: (0..log.allocs.len())
            .map(|_| AtomicU64::new(PENDING))
            .collect(),
        turn: AtomicU64::new(0),
        owner: &log.owner,
        handles: (0..log.threads.len()).map(|_| OnceLock::new()).collect(),
        parked: (0..log.threads.len())
            .map(|_| AtomicBool::new(false))
            .collect(),
        waiting: AtomicUsize::new(0),
        slot_waiters: Mutex::new(HashMap::new()),
        live: AtomicU64::new(0),
        peak_live: AtomicU64::new(0),
        failed: AtomicU64::new(0),
        skipped_frees: AtomicU64::new(0),
        fail_lines_failed: AtomicU64::new(0),
        free_errors: AtomicU64::new(0),
        first_error: Mutex::new(None),
        progress,
        watch,
    };
    let start = Barrier::new(log.threads.len() + 1);
    let wall = std::thread::scope(|scope| {
        for (me, events) in log.threads.iter().enumerate() {
            let (shared, start) = (&shared, &start);
            std::thread::Builder::new()
                .name(format!("replay-{me}"))
                .spawn_scoped(scope, move || shared.thread(me, events, start))
                .expect("spawn a replay thread");
        }
        start.wait();
        let clock = Instant::now();
        // Every thread has registered its handle before the barrier: wake the first event's
        // owner in case it parked already.
        for handle in &shared.handles {
            if let Some(h) = handle.get() {
                h.unpark();
            }
        }
        Clock(clock)
    });
    let wall = wall.0.elapsed();
    shared.progress.finish_and_clear();
    // Free what the log never freed.
    let (mut leaked, mut leaked_bytes) = (0, 0);
    for (id, slot) in shared.slots.iter().enumerate() {
        let ptr = slot.load(Ordering::Relaxed);
        if ptr > FREED {
            let (size, stream) = log.allocs[id];
            leaked += 1;
            leaked_bytes += size;
            // SAFETY: allocated by this resource with `size` bytes, never freed, unused.
            if let Err(e) =
                unsafe { mr.deallocate(DevicePtr(ptr), size as usize, &streams[stream as usize]) }
            {
                shared.free_errors.fetch_add(1, Ordering::Relaxed);
                shared.error(format!(
                    "free of leaked {ptr:#x} ({size} bytes) failed: {e}"
                ));
            }
        }
    }
    let outcome = Outcome {
        wall,
        peak_live: shared.peak_live.load(Ordering::Relaxed),
        failed: shared.failed.load(Ordering::Relaxed),
        skipped_frees: shared.skipped_frees.load(Ordering::Relaxed),
        fail_lines_failed: shared.fail_lines_failed.load(Ordering::Relaxed),
        free_errors: shared.free_errors.load(Ordering::Relaxed),
        first_error: shared
            .first_error
            .into_inner()
            .unwrap_or_else(|e| e.into_inner()),
        leaked,
        leaked_bytes,
    };
    (outcome, shared.watch)
}

/// The instant the replay started (returned out of the thread scope, which ends when every
/// replay thread has finished).
struct Clock(Instant);

fn main() -> ExitCode {
    let args = Args::parse();
    let log = match parse_log(&args.log, args.ignore_unmatched) {
        Ok(log) => log,
        Err(ParseError::Malformed(m)) => {
            eprintln!("streamalloc-replay: {}: {m}", args.log.display());
            return ExitCode::from(2);
        }
        Err(ParseError::Io(e)) => {
            eprintln!("streamalloc-replay: cannot read the log: {e}");
            return ExitCode::from(1);
        }
    };
    let device = match open_device(&args) {
        Ok(device) => device,
        Err(e) => {
            eprintln!("streamalloc-replay: cannot open the device: {e}");
            return ExitCode::from(1);
        }
    };
    println!("log: {}", args.log.display());
    println!("device: {device}");
    let (built, description) = match build(&args, &device) {
        Ok(built) => built,
        Err(e) => {
            eprintln!(
                "streamalloc-replay: cannot make the {} resource: {e}",
                args.resource
            );
            return ExitCode::from(1);
        }
    };
    println!("resource: {description}");
    let streams: Vec<Stream> = match (0..log.streams.max(1))
        .map(|_| device.create_stream())
        .collect()
    {
        Ok(streams) => streams,
        Err(e) => {
            eprintln!("streamalloc-replay: cannot create streams: {e}");
            return ExitCode::from(1);
        }
    };
    println!(
        "events: {} ({} threads, {} streams, order: {})",
        log.events,
        log.threads.len(),
        log.streams,
        match args.order {
            Order::Log => "log",
            Order::Threads => "threads",
        }
    );
    // `--picture`: the log read again as the picture reads it (its events line up with the
    // replay's, one per line), and the peak found before the replay so that the snapshot is
    // taken there.
    let trace = match &args.picture {
        Some(_) => match picture::read::read(&args.log, &ProgressBar::hidden()) {
            Ok(picture::read::Input::Trace(trace)) => Some(trace),
            Ok(picture::read::Input::Snapshot(_)) => None,
            Err(e) => {
                eprintln!("streamalloc-replay: cannot read the log for the picture: {e}");
                return ExitCode::from(1);
            }
        },
        None => None,
    };
    let watch = trace.as_ref().map(|trace| Watch {
        reserved_now: built.counted().map(|c| &c.current),
        reserved: (0..log.events).map(|_| AtomicU64::new(0)).collect(),
        snapshot_at: picture::model::peak_index(trace).map(|i| i as u64),
        snapshot: Mutex::new(None),
        allocs: &log.allocs,
    });
    let (outcome, watch) = replay(&log, built.resource(), &streams, args.order, watch);
    for stream in &streams {
        let _ = stream.synchronize_blocking();
    }
    println!("allocations: {}", log.alloc_lines);
    println!("failed allocations: {}", outcome.failed);
    println!("frees: {}", log.free_lines);
    println!(
        "skipped frees: {} (their allocation failed here)",
        outcome.skipped_frees
    );
    if log.unmatched_skipped > 0 {
        println!("unmatched frees skipped: {}", log.unmatched_skipped);
    }
    println!(
        "log allocation failures: {} (failed here too: {})",
        log.fail_lines, outcome.fail_lines_failed
    );
    println!(
        "leaked: {} allocation(s), {} bytes (freed after the replay)",
        outcome.leaked, outcome.leaked_bytes
    );
    println!("wall time: {:.3} ms", outcome.wall.as_secs_f64() * 1e3);
    println!(
        "peak in use: {} ({} bytes)",
        fmt_bytes(outcome.peak_live),
        outcome.peak_live
    );
    match built.peak_reserved() {
        Some(peak) => {
            println!("peak reserved: {} ({peak} bytes)", fmt_bytes(peak));
            if peak > 0 {
                let fragmentation = 1.0 - outcome.peak_live as f64 / peak as f64;
                println!(
                    "fragmentation: {:.1}% (1 - peak in use / peak reserved)",
                    fragmentation * 100.0
                );
            } else {
                println!("fragmentation: n/a (nothing reserved)");
            }
        }
        None => {
            if let Built::CudaAsync(r) = &built {
                match r.reserved_bytes() {
                    Ok(bytes) => println!(
                        "peak reserved: n/a (the driver pool reserves {} at the end)",
                        fmt_bytes(bytes as u64)
                    ),
                    Err(e) => println!("peak reserved: n/a ({e})"),
                }
            }
            println!("fragmentation: n/a (no peak reserved)");
        }
    }
    if let Built::Arena(arena) = &built {
        let stats = arena.stats();
        println!(
            "arena: {} defragmentation(s), {} grow(s)",
            stats.defragments, stats.grows
        );
    }
    if let (Some(path), Some(mut trace), Some(watch)) = (&args.picture, trace, watch) {
        if watch.reserved_now.is_some() && trace.events.len() == watch.reserved.len() {
            trace.reserved = Some(
                watch
                    .reserved
                    .iter()
                    .map(|r| r.load(Ordering::Relaxed))
                    .collect(),
            );
        }
        let snapshot = watch
            .snapshot
            .into_inner()
            .unwrap_or_else(|e| e.into_inner());
        let computing = picture::bar(
            2 * trace.events.len() as u64,
            400_000,
            "drawing",
            "{msg} [{bar:40}] {human_pos}/{human_len} ({eta})",
        );
        let title = format!(
            "Replay of {} on {description}",
            args.log
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
        );
        let ids: Vec<u64> = streams.iter().map(|s| s.id().get()).collect();
        let drawn = picture::model::from_trace(
            &trace,
            title,
            snapshot.as_ref().map(|s| (s, ids.as_slice())),
            &computing,
        );
        match picture::write_page(&drawn, &args.log.display().to_string(), path) {
            Ok(()) => println!("picture: {}", path.display()),
            Err(e) => {
                eprintln!("streamalloc-replay: cannot write the picture: {e}");
                return ExitCode::from(1);
            }
        }
    }
    drop(built);
    if outcome.free_errors > 0 {
        eprintln!(
            "streamalloc-replay: {} free(s) failed; the first: {}",
            outcome.free_errors,
            outcome.first_error.unwrap_or_default()
        );
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}
