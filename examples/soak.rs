//! A soak test of a pool under mixed load: `cargo run --release --example soak -- --minutes 10`.
//!
//! Runs on CUDA device 0 when there is a GPU, else on the simulated device, and says which
//! (`STREAMALLOC_DEVICE=sim|cuda|cuda:N` picks). Tokio tasks over the streams of a `StreamPool`
//! (8 by default) allocate buffers of random sizes (log-uniform, 256 B to 64 MiB) from one
//! pool whose maximum is below what they ask for together, so they wait for memory:
//!
//! - each allocation is awaited (`DeviceBuffer::alloc`, through `allocate_async`) with no limit
//!   (only by a task that holds no buffer: tasks that hold memory while waiting for more could
//!   wait on each other forever), with a deadline (`alloc_timeout`), or raced against a timer
//!   in `tokio::select!` and dropped if it loses; a task that gets no memory in time frees one
//!   of its buffers;
//! - every buffer is filled, on the GPU, with a pattern unique to it (`fill_pattern_u32`), and
//!   checked on the GPU (`count_mismatches_u32`: a kernel that counts the words that differ
//!   into a counter per stream, so only the counts are copied back);
//! - buffers are handed between streams: read on another stream after a GPU-side wait
//!   (`record`, `wait`, `record_stream`), moved to another stream for good and rewritten there
//!   (`wait` on every stream that used it, `set_stream`), or read elsewhere after the host
//!   awaited an event; older buffers are read again on any stream; each is checked once more
//!   just before it is dropped, on its own stream or another;
//! - every second (`--check-ms`) the pool's invariant checker runs, with no allocate or free in
//!   flight (see `soak/gate.rs`); every 30 s (`--progress-secs`) a progress line;
//! - at the end: no mismatch, every byte back (statistics: bytes and allocations outstanding 0,
//!   as many frees as allocations, the pool's bytes in use 0, every chunk back upstream, the
//!   device's free memory up by what the pool held when it is dropped, and on the simulated
//!   device as at the start), no task still waiting, the pool's count of deadline
//!   misses equal to the tasks', and on the simulated device no stream-order race.
//!
//! It prints a summary and exits non-zero if any of that fails. `--help` lists the options.

use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use streamalloc::resource::adaptor::StatisticsAdaptor;
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{
    Device, DeviceBuffer, ExpandableOptions, ExpandablePoolResource, FaultKind, StreamPool,
};
use tracing_subscriber::EnvFilter;

#[path = "soak/checks.rs"]
mod checks;
#[path = "soak/gate.rs"]
mod gate;
#[path = "soak/tally.rs"]
mod tally;
#[path = "soak/task.rs"]
mod task;

use checks::{check_at_rest, monitor, self_test};
use gate::{Checked, Gate};
use tally::{human, Tally};
use task::Shared;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The resource the tasks share.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Kind {
    /// `PoolResource` over `CudaResource` (chunks from cuMemAlloc).
    Pool,
    /// `ExpandablePoolResource` (reserved ranges, mapped a unit of granules at a time).
    Expandable,
}

/// A soak test of streamalloc's pools: mixed load over several streams, every buffer checked on
/// the GPU, every byte accounted for at the end.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// How long to run, in minutes (default: 1).
    #[arg(long, conflicts_with = "seconds")]
    minutes: Option<f64>,
    /// How long to run, in seconds (for short runs).
    #[arg(long)]
    seconds: Option<f64>,
    /// Seed of the sizes, streams and choices, and of the patterns.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The resource under test.
    #[arg(long, value_enum, default_value_t = Kind::Pool)]
    resource: Kind,
    /// Streams in the `StreamPool`.
    #[arg(long, default_value_t = 8)]
    streams: usize,
    /// Tokio tasks (default: 32 on a GPU, 16 on the simulated device).
    #[arg(long)]
    tasks: Option<usize>,
    /// The pool's maximum, in MiB (default: 1024 on a GPU, 256 on the simulated device).
    #[arg(long)]
    pool_mib: Option<usize>,
    /// The smallest buffer, in bytes.
    #[arg(long, default_value_t = 256)]
    min_size: usize,
    /// The largest buffer, in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    max_size: usize,
    /// Buffers each task keeps alive between its steps.
    #[arg(long, default_value_t = 4)]
    hold: usize,
    /// Milliseconds between runs of the invariant checker.
    #[arg(long, default_value_t = 1000)]
    check_ms: u64,
    /// Seconds between progress lines.
    #[arg(long, default_value_t = 30)]
    progress_secs: u64,
    /// To see that the soak catches ordering bugs (simulated device only): make this fraction
    /// of all GPU-side waits, the soak's and the pool's, silently do nothing
    /// (`FaultKind::SkipWait`). The run must then fail.
    #[arg(long, value_name = "FRACTION")]
    plant_skipped_waits: Option<f64>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    match run(args).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("soak failed: {e}");
            ExitCode::FAILURE
        }
    }
}

fn say(line: String) {
    println!("{line}");
    let _ = std::io::stdout().flush();
}

async fn run(args: Args) -> Result<bool, BoxError> {
    let device = Device::default_device()?;
    let why = match (
        device.is_simulated(),
        std::env::var_os("STREAMALLOC_DEVICE"),
    ) {
        (false, _) => "",
        (true, Some(_)) => " (chosen by STREAMALLOC_DEVICE)",
        (true, None) => " (no GPU found; RUST_LOG=info says why)",
    };
    say(format!("soak: running on {device}{why}"));
    let sim = device.is_simulated();
    let seconds = match (args.minutes, args.seconds) {
        (Some(m), _) => m * 60.0,
        (None, Some(s)) => s,
        (None, None) => 60.0,
    };
    let tasks = args.tasks.unwrap_or(if sim { 16 } else { 32 });
    let pool_bytes = pool_bytes(args.pool_mib.unwrap_or(if sim { 256 } else { 1024 }))?;
    let duration = run_length(seconds)?;
    if args.streams == 0 || tasks == 0 || args.hold == 0 {
        return Err("--streams, --tasks and --hold must be at least 1".into());
    }
    if args.min_size < 4 || args.min_size > args.max_size || args.max_size > pool_bytes {
        return Err(format!(
            "need 4 <= --min-size ({}) <= --max-size ({}) <= the pool ({pool_bytes})",
            args.min_size, args.max_size
        )
        .into());
    }
    let config = Config {
        duration,
        tasks,
        pool_bytes,
        args,
    };

    let streams = StreamPool::new(&device, config.args.streams)?;
    let free_before = device.free_memory()?;
    match config.args.resource {
        Kind::Pool => {
            // Statistics below the pool too: at the end, every chunk must be back upstream.
            let upstream = Arc::new(StatisticsAdaptor::new(CudaResource::new(&device)));
            let options = PoolOptions {
                initial: pool_bytes / 4 / 256 * 256,
                maximum: Some(pool_bytes),
                ..PoolOptions::default()
            };
            let pool = PoolResource::new(upstream.clone(), options)?;
            soak(
                &config,
                &device,
                &streams,
                pool,
                Some(upstream),
                free_before,
            )
            .await
        }
        Kind::Expandable => {
            let options = ExpandableOptions {
                reserve: Some(pool_bytes),
                maximum: Some(pool_bytes),
                ..ExpandableOptions::default()
            };
            let pool = ExpandablePoolResource::new(&device, options)?;
            soak(&config, &device, &streams, pool, None, free_before).await
        }
    }
}

/// `--pool-mib` in bytes. `Err` past `usize`: a shift wrapped it, and `--pool-mib
/// 17592186044417` soaked a pool of 1 MiB without a word.
fn pool_bytes(mib: usize) -> Result<usize, BoxError> {
    mib.checked_mul(1 << 20)
        .ok_or_else(|| format!("--pool-mib {mib}: more bytes than the address space").into())
}

/// The run's length from `--minutes`/`--seconds` (in seconds). `Err` unless it is positive,
/// finite, and ends at an instant the clock can count: `--seconds 1.5e19` is a `Duration`,
/// but adding it to now panicked ("overflow when adding duration to instant").
fn run_length(seconds: f64) -> Result<Duration, BoxError> {
    if !(seconds > 0.0 && seconds.is_finite()) {
        return Err("--minutes/--seconds must be a positive number".into());
    }
    let duration =
        Duration::try_from_secs_f64(seconds).map_err(|e| format!("a run of {seconds} s: {e}"))?;
    run_end(tokio::time::Instant::now(), duration)?;
    Ok(duration)
}

/// `at most` the resource's real maximum, and what `--pool-mib` asked where it differs: the
/// expandable pool maps whole units (8 MiB on the simulated device), and `--resource expandable
/// --pool-mib 1` said "at most 1.0 MiB" of a pool that then reserved 8.
fn at_most(maximum: usize, asked: usize) -> String {
    if maximum == asked {
        format!("at most {}", human(maximum as u64))
    } else {
        format!(
            "at most {} ({} asked, rounded by the resource)",
            human(maximum as u64),
            human(asked as u64)
        )
    }
}

/// When a run of `duration` that starts `now` ends; `Err` past what the clock can count.
/// Checked again where the run starts, so that no later `now` can overflow it either.
fn run_end(
    now: tokio::time::Instant,
    duration: Duration,
) -> Result<tokio::time::Instant, BoxError> {
    now.checked_add(duration).ok_or_else(|| {
        format!(
            "a run of {} s ends past what the clock can count",
            duration.as_secs()
        )
        .into()
    })
}

struct Config {
    duration: Duration,
    tasks: usize,
    pool_bytes: usize,
    args: Args,
}

async fn soak<R: Checked>(
    config: &Config,
    device: &Device,
    streams: &StreamPool,
    resource: R,
    upstream: Option<Arc<StatisticsAdaptor<CudaResource>>>,
    free_before: usize,
) -> Result<bool, BoxError> {
    let args = &config.args;
    let gate = Arc::new(Gate::new(resource));
    let front = Arc::new(StatisticsAdaptor::new(gate.clone()));
    // The mismatch counters: one per stream, from the device directly (not the pool, whose
    // statistics must end at zero), zeroed on their stream.
    let plain = Arc::new(CudaResource::new(device));
    let mut counters = Vec::new();
    for s in streams.streams() {
        let mut counter = DeviceBuffer::new(&plain, 8, s)?;
        counter.memset(0)?;
        counters.push(counter);
    }
    let started = Instant::now();
    let shared = Arc::new(Shared {
        front,
        gate: gate.clone(),
        streams: streams.streams().to_vec(),
        counters,
        tally: Tally::default(),
        end: run_end(tokio::time::Instant::now(), config.duration)?,
        seed: args.seed,
        fills: AtomicU64::new(0),
        min_size: args.min_size,
        max_size: args.max_size,
        hold: args.hold,
    });
    say(format!(
        "soak: {:?} resource of {}, {} tasks over {} streams, buffers {} to {} \
         (log-uniform), up to {} held per task, seed {}, for {:.0?}",
        args.resource,
        at_most(gate.inner().maximum(), config.pool_bytes),
        config.tasks,
        args.streams,
        human(args.min_size as u64),
        human(args.max_size as u64),
        args.hold,
        args.seed,
        config.duration,
    ));
    self_test(&shared).await?;
    if let Some(p) = args.plant_skipped_waits {
        if !(0.0..=1.0).contains(&p) {
            return Err(format!("--plant-skipped-waits {p}: a probability, from 0 to 1").into());
        }
        let faults = device
            .faults()
            .ok_or("--plant-skipped-waits needs the simulated device")?;
        faults.fail_randomly(FaultKind::SkipWait, p, args.seed);
        say(format!(
            "soak: PLANTED BUG: {:.1}% of GPU-side waits do nothing; this run must fail",
            p * 100.0
        ));
    }

    // The tasks, and the monitor: the invariant checker every second, progress now and then.
    let mut set = tokio::task::JoinSet::new();
    for id in 0..config.tasks {
        set.spawn(task::run(shared.clone(), id as u64));
    }
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let monitor = tokio::spawn(monitor(
        shared.clone(),
        Duration::from_secs(args.progress_secs.max(1)),
        Duration::from_millis(args.check_ms.max(1)),
        started,
        stopped,
    ));
    while let Some(joined) = set.join_next().await {
        if let Err(e) = joined.map_err(BoxError::from).and_then(|r| r) {
            shared.tally.fail(format!("a task failed: {e}"));
        }
    }
    let _ = stop.send(());
    monitor.await?;
    let elapsed = started.elapsed();

    // Drain: every stream's work done, every deferred free run.
    for s in &shared.streams {
        s.synchronize().await?;
    }
    let front = shared.front.clone();
    let settled = wait_until(Duration::from_secs(30), || {
        front.counters().bytes.value == 0 && gate.inner().pool_stats().in_use == 0
    })
    .await;
    if !settled {
        shared
            .tally
            .fail("memory still in use 30 s after every task ended".into());
    }
    let mismatches = shared.mismatches().await?;
    check_at_rest(&shared).await;
    let counters = front.counters();
    let stats = gate.inner().pool_stats();
    let waits = gate.inner().waits();
    let t = &shared.tally;
    let get = Tally::get;

    // What must add up.
    let mut fails = Vec::new();
    let mut expect = |ok: bool, what: String| {
        if !ok {
            fails.push(what);
        }
    };
    expect(mismatches == 0, format!("{mismatches} mismatched words"));
    expect(
        counters.bytes.value == 0 && counters.allocations.value == 0,
        format!(
            "still outstanding: {} bytes in {} allocations",
            counters.bytes.value, counters.allocations.value
        ),
    );
    expect(
        counters.allocations.total as u64 == get(&t.allocations)
            && counters.bytes.total as u64 == get(&t.bytes),
        format!(
            "the statistics saw {} allocations of {} bytes, the tasks made {} of {}",
            counters.allocations.total,
            counters.bytes.total,
            get(&t.allocations),
            get(&t.bytes)
        ),
    );
    expect(
        get(&t.drops) == get(&t.allocations),
        format!(
            "{} buffers dropped of {} allocated",
            get(&t.drops),
            get(&t.allocations)
        ),
    );
    expect(
        stats.in_use == 0 && stats.free == stats.reserved,
        format!(
            "the pool has {} bytes in use, {} free of {} reserved",
            stats.in_use, stats.free, stats.reserved
        ),
    );
    expect(
        waits.waiting == 0 && waits.bytes_waiting == 0,
        format!("{} tasks still waiting for memory", waits.waiting),
    );
    expect(
        waits.timeouts == get(&t.deadline_misses),
        format!(
            "the pool counted {} deadline misses, the tasks {}",
            waits.timeouts,
            get(&t.deadline_misses)
        ),
    );
    let races = device.races();
    expect(
        races.is_empty(),
        match races.first() {
            Some(first) => format!("{} stream-order races; the first: {first}", races.len()),
            None => String::new(),
        },
    );

    say(format!(
        "soak: ran {elapsed:.1?}; {} allocations ({}), {} frees; {} fills and {} checks on the \
         GPU ({} checked); mismatches: {mismatches}",
        get(&t.allocations),
        human(get(&t.bytes)),
        counters.allocations.total - counters.allocations.value,
        get(&t.fills),
        get(&t.checks),
        human(get(&t.bytes_checked)),
    ));
    say(format!(
        "hand-offs: {} ({} read after a GPU-side wait, {} moved and rewritten, {} read after \
         a host wait); waits: {} GPU-side, {} by the host, {} for memory (mean {:.1?}, longest \
         {:.1?})",
        t.handoffs(),
        get(&t.handoffs_event),
        get(&t.handoffs_moved),
        get(&t.handoffs_host),
        get(&t.gpu_waits),
        get(&t.host_waits),
        waits.waits,
        waits.total_wait.div_f64(waits.waits.max(1) as f64),
        waits.max_wait,
    ));
    say(format!(
        "allocations awaited: {} with no limit; cancellations: {}; deadline misses: {}; \
         invariant checks: {} run, {} failed",
        get(&t.plain_awaits),
        get(&t.cancellations),
        get(&t.deadline_misses),
        get(&t.invariant_checks),
        t.failures()
            .iter()
            .filter(|f| f.starts_with("invariant"))
            .count(),
    ));
    say(format!(
        "pool: peak {} reserved, peak {} in use, {} grows, {} cross-stream waits; at the end \
         {} in use, {} allocations outstanding of {}",
        human(stats.peak_reserved as u64),
        human(counters.bytes.peak as u64),
        stats.grows,
        stats.stream_waits,
        human(stats.in_use as u64),
        counters.allocations.value,
        counters.allocations.total,
    ));

    // Let go of the pool, and see its memory go back: upstream and on the device.
    let mut failures = t.failures();
    let free_with_pool = device.free_memory()?;
    drop(front);
    let weak = Arc::downgrade(&gate);
    drop(gate);
    drop(shared);
    let gone = wait_until(Duration::from_secs(30), || weak.strong_count() == 0).await;
    expect(gone, "the pool was still alive 30 s after the end".into());
    if let Some(upstream) = &upstream {
        let c = upstream.counters();
        expect(
            c.bytes.value == 0 && c.allocations.value == 0,
            format!(
                "upstream: {} bytes in {} chunks not returned",
                c.bytes.value, c.allocations.value
            ),
        );
        say(format!(
            "upstream: {} chunks ({}) taken and returned; {} outstanding",
            c.allocations.total,
            human(c.bytes.total as u64),
            human(c.bytes.value.max(0) as u64),
        ));
    }
    // The simulated device is exact. On a GPU, what the pool held must come back when it is
    // dropped (a leaked chunk or granule is 2 MiB or more), but other free memory can move
    // for reasons of its own (the driver's bookkeeping, a tool such as compute-sanitizer), so
    // there the comparison with the start is shown, not required.
    let exact = device.is_simulated();
    let slack = if exact { 0 } else { 2 << 20 };
    let expected = free_with_pool + stats.reserved;
    // Frees are queued in stream order (the counters' on their streams, the pool's chunks on
    // its own stream, which finishes its queue after the pool is gone): give them time to run.
    for s in streams.streams() {
        s.synchronize().await?;
    }
    wait_until(Duration::from_secs(10), || {
        device
            .free_memory()
            .is_ok_and(|free| free + slack >= expected && (!exact || free >= free_before))
    })
    .await;
    let free_after = device.free_memory()?;
    expect(
        free_after + slack >= expected,
        format!(
            "the pool held {} bytes, but the device's free memory rose only from {free_with_pool} \
             to {free_after} bytes when it was dropped",
            stats.reserved
        ),
    );
    expect(
        !exact || free_after >= free_before,
        format!(
            "the device had {free_before} bytes free before, {free_after} after ({} less)",
            human(free_before.saturating_sub(free_after) as u64)
        ),
    );
    say(format!(
        "device: {} free at the start, {} with the pool ({} reserved), {} after it was \
         dropped; race detector: {}",
        human(free_before as u64),
        human(free_with_pool as u64),
        human(stats.reserved as u64),
        human(free_after as u64),
        if device.is_simulated() {
            format!("{} races", races.len())
        } else {
            "not on a GPU".into()
        },
    ));
    failures.extend(fails);
    if failures.is_empty() {
        say("soak: PASS (no mismatch, every byte back, the statistics add up)".into());
        Ok(true)
    } else {
        for f in &failures {
            say(format!("soak: FAIL: {f}"));
        }
        Ok(false)
    }
}

/// Polls `cond` every 10 ms until it holds (true) or `limit` passes (false).
async fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while !cond() {
        if start.elapsed() > limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A length the clock cannot add to now is an error, not a panic; so are the lengths that
    /// are not positive numbers. `cargo test --example soak`.
    #[test]
    fn run_lengths_past_the_clock_are_refused() {
        assert_eq!(run_length(2.0).unwrap(), Duration::from_secs(2));
        for bad in [1.5e19, 1e30, 0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(run_length(bad).is_err(), "{bad} s was accepted");
        }
        assert!(run_end(tokio::time::Instant::now(), Duration::MAX).is_err());
    }

    /// The first lines say what the resource really holds at most. `cargo test --example soak`.
    #[test]
    fn the_resource_is_described_by_its_real_maximum() {
        use gate::Checked;

        let device = Device::simulated(streamalloc::SimConfig::default());
        let options = ExpandableOptions {
            reserve: Some(1 << 20),
            maximum: Some(1 << 20),
            ..ExpandableOptions::default()
        };
        let expandable = ExpandablePoolResource::new(&device, options).unwrap();
        let maximum = Checked::maximum(&expandable);
        assert!(maximum > 1 << 20, "{maximum}");
        assert_eq!(
            at_most(maximum, 1 << 20),
            format!(
                "at most {} (1.0 MiB asked, rounded by the resource)",
                human(maximum as u64)
            )
        );
        assert_eq!(at_most(16 << 20, 16 << 20), "at most 16.0 MiB");
    }

    /// `--pool-mib` past the address space is an error, not a pool of what the shift left.
    #[test]
    fn pool_sizes_past_the_address_space_are_refused() {
        assert_eq!(pool_bytes(16).unwrap(), 16 << 20);
        assert!(pool_bytes((1 << 44) + 1).is_err());
        assert!(pool_bytes(usize::MAX).is_err());
    }
}
