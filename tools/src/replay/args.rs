//! The command line: the resource to replay against, its sizes, the order, the device.

use std::fmt;
use std::path::PathBuf;

use clap::{Parser, ValueEnum};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(super) enum ResourceKind {
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
pub(super) enum Order {
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
pub(super) struct Args {
    /// The log file (CSV, with a header line).
    pub(super) log: PathBuf,

    /// The resource to replay against.
    #[arg(short, long, value_enum, default_value_t = ResourceKind::Pool)]
    pub(super) resource: ResourceKind,

    /// Bytes the pool, arena or cuda-async pool takes at start [default: 0].
    #[arg(long, value_parser = parse_rounded_size)]
    pub(super) initial: Option<u64>,

    /// The most the pool, arena or cuda-async pool may hold [default: the device's memory;
    /// for the pool and the arena, rounded down to a multiple of 256 bytes].
    #[arg(long, value_parser = parse_rounded_size)]
    pub(super) maximum: Option<u64>,

    /// Arena: RMM's `arena_size`, a fixed arena (initial = maximum = this, unless `--maximum`
    /// is given).
    #[arg(long, value_parser = parse_rounded_size)]
    pub(super) arena_size: Option<u64>,

    /// Arena: the superblock size, also the largest request a stream arena serves.
    #[arg(long, value_parser = parse_rounded_size, default_value = "1MiB")]
    pub(super) superblock_size: u64,

    /// Binning: the smallest bin is 2^this bytes.
    #[arg(long, default_value_t = 18)]
    pub(super) bin_min_log2: u32,

    /// Binning: the largest bin is 2^this bytes.
    #[arg(long, default_value_t = 22)]
    pub(super) bin_max_log2: u32,

    /// Binning: blocks each fixed-size bin takes from the pool at a time.
    #[arg(long, default_value_t = 128)]
    pub(super) blocks_per_chunk: usize,

    /// cuda-async: freed bytes the driver pool keeps [default: all].
    #[arg(long, value_parser = parse_size)]
    pub(super) release_threshold: Option<u64>,

    /// The order events are replayed in.
    #[arg(long, value_enum, default_value_t = Order::Log)]
    pub(super) order: Order,

    /// The most threads the replay starts: it starts one per thread of the log, and refuses a
    /// log with more (exit 1) before replaying. A replay thread the system cannot start (its
    /// limit on threads or memory) also stops the tool with exit 1.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    pub(super) max_threads: u32,

    /// Skip frees of pointers no earlier line allocated, instead of stopping.
    #[arg(long)]
    pub(super) ignore_unmatched: bool,

    /// The device: `auto` (a GPU if there is one, else the simulated device; the
    /// STREAMALLOC_DEVICE variable can choose), `sim`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    pub(super) device: String,

    /// Also write the picture of the replay to this HTML file (as `streamalloc-picture` draws
    /// a log, plus the memory the resource reserved over time and, as the address map, the
    /// resource's own snapshot at the log's peak).
    #[arg(long)]
    pub(super) picture: Option<PathBuf>,

    /// The simulated device's memory [default: 16GiB]; ignored (with a note) on a GPU.
    #[arg(long, value_parser = parse_size)]
    pub(super) sim_memory: Option<u64>,
}

/// `--device`: `auto`, `sim` (or `simulated`), `cuda` or `cuda:N`, checked while the command
/// line is parsed, so that another value is a usage error (exit 2, before the log is read)
/// rather than a device that failed to open (exit 1; a review's finding).
pub(super) fn parse_device(text: &str) -> Result<String, String> {
    let known = matches!(text, "auto" | "sim" | "simulated" | "cuda")
        || text
            .strip_prefix("cuda:")
            .is_some_and(|n| n.parse::<usize>().is_ok());
    if known {
        Ok(text.to_owned())
    } else {
        Err(format!(
            "`{text}` is not a device: auto, sim, cuda or cuda:N (N a GPU's ordinal)"
        ))
    }
}

/// The largest size [`parse_rounded_size`] takes: `u64::MAX` rounded down to 256 bytes.
pub(super) const MAX_ROUNDED: u64 = u64::MAX - 255;

/// A size that the resource rounds up to a multiple of 256 bytes (`--initial`, `--maximum`,
/// `--arena-size`, `--superblock-size`): [`parse_size`], at most [`MAX_ROUNDED`] (beyond, the
/// rounding overflowed: a review's finding).
pub(super) fn parse_rounded_size(text: &str) -> Result<u64, String> {
    let bytes = parse_size(text)?;
    if bytes > MAX_ROUNDED || usize::try_from(bytes).is_err() {
        return Err(format!(
            "`{}` is too large: this size is rounded up to a multiple of 256 bytes, and the largest is {} bytes",
            text.trim(),
            MAX_ROUNDED.min(usize::MAX as u64 & !255)
        ));
    }
    Ok(bytes)
}

/// `4096`, `64KiB`, `1.5 GiB`, `2G` (binary), `2GB` (decimal). A whole number of bytes is read
/// exactly; one with a unit or a fraction is rounded to a byte, and must be below 2^64.
pub(super) fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    if let Ok(bytes) = text.parse::<u64>() {
        return Ok(bytes);
    }
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
    // 2^64 (`u64::MAX as f64` rounds up to it): below it, a rounded value fits in a u64; at it,
    // `as` saturated to u64::MAX, accepting sizes past the largest (a review's finding).
    // NaN and the infinities are not in the range either.
    const LIMIT: f64 = 18_446_744_073_709_551_616.0;
    let bytes = (value * multiplier).round();
    if !(0.0..LIMIT).contains(&bytes) {
        return Err(format!(
            "`{text}` is out of range (the largest size is {} bytes)",
            u64::MAX
        ));
    }
    Ok(bytes as u64)
}

/// `1.50 MiB`.
pub(super) fn fmt_bytes(bytes: u64) -> String {
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
