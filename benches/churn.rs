//! The `churn` workloads of `shared/bench/WORKLOADS.md`, exactly: splitmix64, the same decision
//! sequence for every allocator, and its checksums (allocations and bytes allocated), over each
//! resource: the pool, the expandable pool, the driver's pool, the arena, binning and raw
//! `cuMemAlloc`.
//!
//! `cargo bench --bench churn -- --help` lists the flags (resources, runs, start sizes and pool
//! options), their values and their defaults; an unknown flag or a bad value is an error.
//! Runs on the GPU if there is one, else on the simulated device.

use std::cell::RefCell;
use std::sync::Barrier;
use std::time::{Duration, Instant};

mod common;

use clap::{Parser, ValueEnum};
use common::SplitMix64;
use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
use streamalloc::resource::binning::BinningResource;
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::cuda_async::{CudaAsyncOptions, CudaAsyncResource};
use streamalloc::resource::pool::{PoolOptions, PoolResource, PoolStats};
use streamalloc::{
    Device, ExpandableOptions, ExpandablePlacement, ExpandablePoolResource, MemoryResource,
};

const GIB: usize = 1 << 30;
const MIB: usize = 1 << 20;

#[derive(Default, Clone, Copy)]
struct Outcome {
    allocations: u64,
    bytes: u64,
    peak_live: u64,
}

/// One thread of `churn(seed, ops, max_live)` with min_exp 8 and max_exp 22, over `streams`.
///
/// Plain churn (`xs` false) allocates and frees on `streams[mine]`. `churn-xs` frees every block
/// on the stream after the one it was allocated on; one thread driving every stream picks the
/// allocating stream as `(a >> 40) % len` (`mine` is `None`), thread t allocates on stream t.
fn churn(
    r: &impl MemoryResource,
    streams: &[streamalloc::Stream],
    mine: Option<usize>,
    xs: bool,
    seed: u64,
    ops: u64,
    max_live: u64,
) -> Outcome {
    const MIN_EXP: u64 = 8;
    const MAX_EXP: u64 = 22;
    let n = streams.len();
    let free_on = |s: usize| if xs { (s + 1) % n } else { s };
    let mut rng = SplitMix64(seed);
    let mut live: Vec<(streamalloc::DevicePtr, usize, usize)> = Vec::with_capacity(4096);
    let (mut live_bytes, mut out) = (0u64, Outcome::default());
    for _ in 0..ops {
        let (a, b) = (rng.next(), rng.next());
        let e = MIN_EXP + b % (MAX_EXP - MIN_EXP + 1);
        let size = (1u64 << e) + (b >> 8) % (1u64 << e);
        if live.is_empty() || (a & 1 == 0 && live_bytes + size <= max_live) {
            let s = mine.unwrap_or(((a >> 40) % n as u64) as usize);
            let p = r.allocate(size as usize, &streams[s]).expect("allocate");
            live.push((p, size as usize, s));
            live_bytes += size;
            out.allocations += 1;
            out.bytes += size;
            out.peak_live = out.peak_live.max(live_bytes);
        } else {
            let i = ((a >> 1) % live.len() as u64) as usize;
            let (p, size, s) = live.swap_remove(i);
            // SAFETY: allocated above from `r` with this size, never used, freed once; the
            // stream it is freed on is ordered after nothing, but nothing used the block.
            unsafe { r.deallocate(p, size, &streams[free_on(s)]) }.expect("deallocate");
            live_bytes -= size as u64;
        }
    }
    for (p, size, s) in live.drain(..) {
        // SAFETY: as above.
        unsafe { r.deallocate(p, size, &streams[free_on(s)]) }.expect("deallocate");
    }
    out
}

/// `threads` threads, thread t with seed 42 + t; (wall to the last stream synchronized,
/// summed outcome). Plain churn: a stream per thread. `xs`: four streams, driven by one thread
/// or by four (thread t allocating on stream t).
fn run_threads(r: &impl MemoryResource, device: &Device, run: &Run) -> (Duration, Outcome) {
    let count = if run.xs { 4 } else { run.threads as usize };
    let streams: Vec<_> = (0..count)
        .map(|_| device.create_stream().unwrap())
        .collect();
    let barrier = Barrier::new(run.threads as usize + 1);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..run.threads as usize)
            .map(|t| {
                let barrier = &barrier;
                let streams = &streams;
                scope.spawn(move || {
                    barrier.wait();
                    let (slice, mine) = match (run.xs, run.threads) {
                        (false, _) => (&streams[t..t + 1], Some(0)),
                        (true, 1) => (&streams[..], None),
                        (true, _) => (&streams[..], Some(t)),
                    };
                    churn(r, slice, mine, run.xs, 42 + t as u64, run.ops, run.max_live)
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let outcomes: Vec<Outcome> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        for stream in &streams {
            stream.synchronize_blocking().expect("synchronize");
        }
        let wall = start.elapsed();
        let sum = outcomes.iter().fold(Outcome::default(), |a, o| Outcome {
            allocations: a.allocations + o.allocations,
            bytes: a.bytes + o.bytes,
            peak_live: a.peak_live + o.peak_live,
        });
        (wall, sum)
    })
}

struct Run {
    name: &'static str,
    threads: u64,
    /// `churn-xs`: blocks freed on the next of four streams.
    xs: bool,
    ops: u64,
    max_live: u64,
    checksum: Option<(u64, u64)>,
}

const RUNS: [Run; 4] = [
    Run {
        name: "churn-1t",
        threads: 1,
        xs: false,
        ops: 1_000_000,
        max_live: GIB as u64,
        checksum: Some((500_021, 418_895_256_400)),
    },
    Run {
        name: "churn-4t",
        threads: 4,
        xs: false,
        ops: 250_000,
        max_live: 256 * MIB as u64,
        checksum: Some((500_319, 417_711_213_153)),
    },
    Run {
        name: "churn-xs-1t",
        threads: 1,
        xs: true,
        ops: 1_000_000,
        max_live: GIB as u64,
        checksum: Some((500_021, 418_895_256_400)),
    },
    Run {
        name: "churn-xs-4t",
        threads: 4,
        xs: true,
        ops: 250_000,
        max_live: 256 * MIB as u64,
        checksum: Some((500_319, 417_711_213_153)),
    },
];

/// The `churn` workloads of WORKLOADS.md over each resource, with their checksums.
///
/// Runs: `churn-1t`, `churn-4t`, `churn-xs-1t`, `churn-xs-4t` (`workloads`: these four), and
/// `scaling` (1, 2, 4 and 8 threads); `all` is every one.
///
/// Resources: the pool (`PoolResource` over `CudaResource`), the expandable pool
/// (`ExpandablePoolResource`), the driver's pool (`CudaAsyncResource`), the arena, binning
/// (fixed-size bins 2^18..2^22 over a pool, as the RMM reference), and raw `cuMemAlloc`
/// (`CudaResource`, sampled on 20,000 operations as WORKLOADS.md did, so without checksums). The
/// pool, the expandable pool and the arena start with `--initial` reserved and may grow to 8 GiB.
///
/// Reports wall time (start to the last stream synchronized), ns per operation (wall / total
/// ops), the checksums, and for the pool its peak reserved bytes against the peak live bytes
/// (summed over threads, an upper bound, as WORKLOADS.md states RMM's). With more than one
/// `--initial`, after each run: every later start's ns/op over the first start's in the same
/// repeat (`pairs:`), the median over the repeats: growth from small against the 2 GiB start,
/// each compared with the run just before it (use `--repeat 10` or more). Runs on the GPU if
/// there is one, else on the simulated device.
#[derive(Parser)]
#[command(name = "churn", bin_name = "churn")]
struct Args {
    /// The resource to run (`all`: every one).
    #[arg(long, value_enum, value_name = "RESOURCE", default_value_t = Resource::All)]
    resource: Resource,
    /// The runs, comma-separated (`workloads`: the four churn runs; `all`: every one).
    #[arg(
        long,
        value_enum,
        value_name = "RUN[,RUN..]",
        value_delimiter = ',',
        default_value = "all"
    )]
    run: Vec<RunName>,
    /// How many times each run repeats.
    #[arg(long, value_name = "N", default_value_t = 1)]
    repeat: usize,
    /// The sizes (MiB, comma-separated) the pool, the expandable pool and the arena start with,
    /// each run once per size: `2048` (the timed loop measures suballocation), `256`
    /// (WORKLOADS.md's growth from small), or both; the maximum is 8 GiB.
    #[arg(
        long,
        value_name = "MIB[,MIB..]",
        value_delimiter = ',',
        default_value = "2048,256"
    )]
    initial: Vec<usize>,
    /// `off`: the GPU's events polled through the driver, as before issue 18's completion words
    /// (the arena's guards are recorded and queried on its paths).
    #[arg(long, value_enum, value_name = "on|off", default_value_t = OnOff::On)]
    completion_words: OnOff,
    /// The pools' `PoolOptions::growth_divisor`.
    #[arg(long, value_name = "N", default_value_t = 8)]
    growth_divisor: u32,
    /// The pools' `PoolOptions::reuse_slack`.
    #[arg(long, value_name = "X", default_value_t = 0.0)]
    reuse_slack: f64,
    /// `off` turns `PoolOptions::opportunistic_reuse` off (every cross-stream reuse waits on the
    /// GPU).
    #[arg(long, value_enum, value_name = "on|off", default_value_t = OnOff::On)]
    opportunistic: OnOff,
    /// The pools' `PoolOptions::growth_cap` (`none`: no cap).
    #[arg(long, value_name = "X|none", value_parser = growth_cap, default_value = "1.3")]
    growth_cap: GrowthCap,
    /// Sets `PoolOptions::small_block_cache` (default 4096; 0 turns it off) and, only when
    /// given, `ExpandableOptions::small_block_cache` (default none).
    #[arg(long, value_name = "KIB")]
    small_block_cache: Option<usize>,
    /// The arena's `ArenaOptions::superblock_size` [default: 1 MiB, RMM's].
    #[arg(long, value_name = "MIB")]
    superblock: Option<usize>,
    /// The expandable pool's `ExpandableOptions::map_unit` [default: 4 granules, 8 MiB on an
    /// H100 or H200].
    #[arg(long, value_name = "MIB")]
    map_unit: Option<usize>,
    /// The expandable pool's `ExpandableOptions::placement` (`low`:
    /// `ExpandablePlacement::LowAddress`, `closest`: `ClosestFit`).
    #[arg(long, value_enum, value_name = "low|closest", default_value_t = Placement::Low)]
    placement: Placement,
    /// Passed by `cargo bench` to a bench without the test harness; ignored.
    #[arg(long = "bench", hide = true)]
    _bench: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Resource {
    Pool,
    Expandable,
    CudaAsync,
    Arena,
    Binning,
    Cuda,
    All,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum RunName {
    #[value(name = "churn-1t")]
    Churn1t,
    #[value(name = "churn-4t")]
    Churn4t,
    #[value(name = "churn-xs-1t")]
    ChurnXs1t,
    #[value(name = "churn-xs-4t")]
    ChurnXs4t,
    /// The four above.
    Workloads,
    /// Plain churn on 1, 2, 4 and 8 threads.
    Scaling,
    /// Every run.
    All,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OnOff {
    On,
    Off,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Placement {
    /// `ExpandablePlacement::LowAddress`.
    Low,
    /// `ExpandablePlacement::ClosestFit`.
    Closest,
}

/// `PoolOptions::growth_cap`: a factor, or none.
#[derive(Clone, Copy)]
struct GrowthCap(Option<f64>);

fn growth_cap(s: &str) -> Result<GrowthCap, String> {
    if s == "none" {
        return Ok(GrowthCap(None));
    }
    s.parse::<f64>()
        .map(|x| GrowthCap(Some(x)))
        .map_err(|e| format!("a factor such as 1.3, or none ({e})"))
}

/// A pool's report column: peak reserved over peak live, and how it got there.
fn pool_extra(s: &PoolStats, o: &Outcome) -> String {
    format!(
        "{} MiB / {} MiB = {:.3} ({} grows, {} capped, {} stream waits, {} idle reuses, {} shard spills, {} cache hits, {:.1} ms growing)",
        s.peak_reserved / MIB,
        o.peak_live / MIB as u64,
        s.peak_reserved as f64 / o.peak_live as f64,
        s.grows,
        s.capped_grows,
        s.stream_waits,
        s.idle_reuses,
        s.shard_spills,
        s.cache_hits,
        s.growth_time.as_secs_f64() * 1e3
    )
}

fn main() {
    let args = Args::parse();
    let mut device = Device::default_device().expect("a device");
    // `--completion-words off`: the GPU's events polled through the driver, as before issue 18's
    // completion words (the arena's guards are recorded and queried on its paths).
    if args.completion_words == OnOff::Off {
        if let Some(ordinal) = device.ordinal() {
            let options = streamalloc::CudaOptions {
                completion_words: false,
                ..streamalloc::CudaOptions::default()
            };
            device = Device::cuda_with(ordinal, options).expect("the same GPU again");
        }
    }
    let on = |r: Resource| args.resource == Resource::All || args.resource == r;
    let which = &args.run;
    let repeat = args.repeat;
    let growth_divisor = args.growth_divisor;
    let reuse_slack = args.reuse_slack;
    let opportunistic_reuse = args.opportunistic == OnOff::On;
    let map_unit = args.map_unit;
    let GrowthCap(growth_cap) = args.growth_cap;
    let superblock = args.superblock;
    let small_block_cache = args.small_block_cache.unwrap_or(4096) << 10;
    let placement = match args.placement {
        Placement::Closest => ExpandablePlacement::ClosestFit,
        Placement::Low => ExpandablePlacement::LowAddress,
    };
    let initials: Vec<usize> = args.initial.iter().map(|mib| mib * MIB).collect();
    println!("device: {device}");
    let date = std::process::Command::new("date").arg("-u").output();
    println!(
        "date: {}",
        date.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default()
    );
    println!(
        "{:<12} {:<10} {:>3} {:>10} {:>9} {:>10} {:>18} {:>8}  pool: peak reserved / peak live",
        "resource", "run", "thr", "wall", "ns/op", "allocs", "bytes", "checks"
    );

    let mut runs: Vec<Run> = Vec::new();
    for r in RUNS {
        let named = |w: RunName| {
            w.to_possible_value()
                .is_some_and(|v| v.get_name() == r.name)
        };
        if which
            .iter()
            .any(|&w| matches!(w, RunName::All | RunName::Workloads) || named(w))
        {
            runs.push(r);
        }
    }
    if which
        .iter()
        .any(|&w| matches!(w, RunName::All | RunName::Scaling))
    {
        for threads in [1, 2, 4, 8] {
            runs.push(Run {
                name: "scaling",
                threads,
                xs: false,
                ops: 1_000_000 / threads,
                max_live: GIB as u64 / threads,
                checksum: None,
            });
        }
    }

    // Each timed run's (label, run, ns/op), for the growth-from-small pairs after each run.
    let timed: RefCell<Vec<(String, &'static str, f64)>> = RefCell::new(Vec::new());
    let report = |label: &str, run: &Run, wall: Duration, o: Outcome, extra: String| {
        let total_ops = run.threads * run.ops;
        timed.borrow_mut().push((
            label.to_owned(),
            run.name,
            wall.as_nanos() as f64 / total_ops as f64,
        ));
        let ok = match run.checksum {
            Some(c) => {
                if (o.allocations, o.bytes) == c {
                    "ok"
                } else {
                    "MISMATCH"
                }
            }
            None => "-",
        };
        println!(
            "{:<12} {:<10} {:>3} {:>10.1?} {:>9.1} {:>10} {:>18} {:>8}  {}",
            label,
            run.name,
            run.threads,
            wall,
            wall.as_nanos() as f64 / total_ops as f64,
            o.allocations,
            o.bytes,
            ok,
            extra
        );
        if ok == "MISMATCH" {
            eprintln!("checksum mismatch: expected {:?}", run.checksum);
            std::process::exit(1);
        }
    };

    // The pool under test, and under binning: `initial` reserved, up to 8 GiB.
    let make_pool = |initial: usize| {
        PoolResource::new(
            CudaResource::new(&device),
            PoolOptions {
                initial,
                maximum: Some(8 * GIB),
                growth_divisor,
                reuse_slack,
                opportunistic_reuse,
                growth_cap,
                small_block_cache,
            },
        )
        .unwrap()
    };
    for run in &runs {
        for _ in 0..repeat {
            for &initial in &initials {
                let start = format!(":{}M", initial / MIB);
                if on(Resource::Pool) {
                    let pool = make_pool(initial);
                    let (wall, o) = run_on(&pool, &device, run);
                    let extra = pool_extra(&pool.stats(), &o);
                    report(&format!("pool{start}"), run, wall, o, extra);
                }
                if on(Resource::Expandable) {
                    // The pool on virtual memory: `initial` mapped, up to 8 GiB mapped.
                    let r = ExpandablePoolResource::new(
                        &device,
                        ExpandableOptions {
                            initial,
                            maximum: Some(8 * GIB),
                            map_unit: map_unit.map(|mib| mib * MIB),
                            placement,
                            // Its own default (none) unless asked for.
                            small_block_cache: args.small_block_cache.map(|_| small_block_cache),
                            ..ExpandableOptions::default()
                        },
                    )
                    .unwrap();
                    let (wall, o) = run_on(&r, &device, run);
                    let extra = format!(
                        "{}, {} initial pieces moved",
                        pool_extra(&r.stats(), &o),
                        r.initial_moves()
                    );
                    report(&format!("expandable{start}"), run, wall, o, extra);
                }
                if on(Resource::Arena) {
                    // RMM's arena, sized as the pool: 2 GiB up front, up to 8 GiB.
                    let r = ArenaResource::new(
                        CudaResource::new(&device),
                        ArenaOptions {
                            initial,
                            maximum: Some(8 * GIB),
                            superblock_size: superblock
                                .map_or(ArenaOptions::default().superblock_size, |mib| mib * MIB),
                        },
                    )
                    .unwrap();
                    let (wall, o) = run_on(&r, &device, run);
                    let s = r.stats();
                    let extra = format!(
                        "{} MiB / {} MiB = {:.2}",
                        s.peak_reserved / MIB,
                        o.peak_live / MIB as u64,
                        s.peak_reserved as f64 / o.peak_live as f64
                    );
                    report(&format!("arena{start}"), run, wall, o, extra);
                }
                if on(Resource::Binning) {
                    // As WORKLOADS.md's RMM reference: fixed-size bins 2^18..2^22 over a pool, the
                    // pool serving what is larger.
                    let pool = make_pool(initial);
                    let r = BinningResource::new(pool, 18, 22).unwrap();
                    let (wall, o) = run_on(&r, &device, run);
                    report(&format!("binning{start}"), run, wall, o, String::new());
                }
            }
            if on(Resource::CudaAsync) {
                let r = CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap();
                let (wall, o) = run_on(&r, &device, run);
                let extra = format!(
                    "driver pool reserved {} MiB",
                    r.reserved_bytes().unwrap_or(0) / MIB
                );
                report("cuda-async", run, wall, o, extra);
            }
            if on(Resource::Cuda) {
                // Raw cuMemAlloc/cuMemFree, sampled as WORKLOADS.md did (20,000 operations in
                // all): the sequence is the same, cut short, so there is no checksum.
                let sampled = Run {
                    name: run.name,
                    threads: run.threads,
                    xs: run.xs,
                    ops: 20_000 / run.threads,
                    max_live: run.max_live,
                    checksum: None,
                };
                let r = CudaResource::new(&device);
                let (wall, o) = run_on(&r, &device, &sampled);
                report(
                    "cuda",
                    &sampled,
                    wall,
                    o,
                    "sampled: 20,000 operations".to_owned(),
                );
            }
        }
        print_pairs(&timed.borrow(), run.name, &initials);
    }
}

/// For each resource run from more than one start: every later start's ns/op over the first
/// start's in the same repeat, the two run one after the other. The GPU hosts change speed by
/// half again from second to second, and for a CPU-only loop too (`results/2026-11-27/run161`),
/// so a start is compared with the run just before it, not with runs far apart in time.
fn print_pairs(timed: &[(String, &'static str, f64)], run: &str, initials: &[usize]) {
    let Some((&first, rest)) = initials.split_first() else {
        return;
    };
    for resource in ["pool", "expandable", "arena", "binning"] {
        let of = |initial: usize| -> Vec<f64> {
            let label = format!("{resource}:{}M", initial / MIB);
            (timed.iter())
                .filter(|(l, r, _)| *l == label && *r == run)
                .map(|t| t.2)
                .collect()
        };
        let base = of(first);
        for &initial in rest {
            let mut ratios: Vec<f64> = (base.iter().zip(of(initial))).map(|(b, s)| s / b).collect();
            if ratios.is_empty() {
                continue;
            }
            ratios.sort_by(f64::total_cmp);
            let n = ratios.len();
            let median = (ratios[(n - 1) / 2] + ratios[n / 2]) / 2.0;
            println!(
                "pairs: {resource} {run} {}M / {}M, adjacent runs: median {:.3} ({:.3}..{:.3}, {} pairs)",
                initial / MIB,
                first / MIB,
                median,
                ratios[0],
                ratios[n - 1],
                n
            );
        }
    }
}

fn run_on(r: &impl MemoryResource, device: &Device, run: &Run) -> (Duration, Outcome) {
    run_threads(r, device, run)
}
