//! The `churn` workloads of `shared/bench/WORKLOADS.md`, exactly: splitmix64, the same decision
//! sequence for every allocator, and its checksums (allocations and bytes allocated).
//!
//! `cargo bench --bench churn [-- --resource pool|expandable|cuda-async|arena|binning|cuda|all] [--run RUN[,RUN..]|workloads|all] [--repeat N] [--initial MIB[,MIB..]] [--completion-words on|off]`
//!
//! Runs: `churn-1t`, `churn-4t`, `churn-xs-1t`, `churn-xs-4t` (`workloads`: these four), and
//! `scaling` (1, 2, 4 and 8 threads); `all` is every one.
//!
//! `--growth-divisor N` sets the pools' `PoolOptions::growth_divisor` (default 8);
//! `--reuse-slack X` sets `PoolOptions::reuse_slack` (default 0); `--opportunistic off` turns
//! `PoolOptions::opportunistic_reuse` off (every cross-stream reuse waits on the GPU);
//! `--growth-cap X|none` sets `PoolOptions::growth_cap` (default 1.3); `--small-block-cache KIB`
//! sets `PoolOptions::small_block_cache` (default 4096; 0 turns it off) and, only when given,
//! `ExpandableOptions::small_block_cache` (default none);
//! `--superblock MIB` sets the arena's `ArenaOptions::superblock_size` (default 1 MiB, RMM's);
//! `--map-unit MIB` sets the expandable pool's `ExpandableOptions::map_unit` (default: 4
//! granules, 8 MiB on an H100 or H200); `--placement low|closest` its
//! `ExpandableOptions::placement` (default `low`, `ExpandablePlacement::LowAddress`).
//!
//! `--initial` lists the sizes (MiB) the pool and the arena start with, each run once per size:
//! `2048` (the timed loop measures suballocation), `256` (WORKLOADS.md's growth from small), or
//! both (the default, `2048,256`); the maximum is 8 GiB.
//!
//! Resources: the pool (`PoolResource` over `CudaResource`), the driver's pool
//! (`CudaAsyncResource`), the arena, binning (fixed-size bins 2^18..2^22 over a pool, as the RMM
//! reference), and raw `cuMemAlloc` (`CudaResource`, sampled on 20,000 operations as
//! WORKLOADS.md did, so without checksums). The pool and the arena start with 2 GiB reserved and
//! may grow to 8 GiB, so the timed loop measures suballocation, not the driver. Reports wall time (start to the last stream
//! synchronized), ns per operation (wall / total ops), the checksums, and for the pool its peak
//! reserved bytes against the peak live bytes (summed over threads, an upper bound, as
//! WORKLOADS.md states RMM's). Runs on the GPU if there is one, else on the simulated device.

use std::sync::Barrier;
use std::time::{Duration, Instant};

mod common;

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

fn arg(name: &str, default: &str) -> String {
    std::env::args()
        .skip_while(|a| a != name)
        .nth(1)
        .unwrap_or_else(|| default.to_owned())
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
    let mut device = Device::default_device().expect("a device");
    // `--completion-words off`: the GPU's events polled through the driver, as before issue 18's
    // completion words (the arena's guards are recorded and queried on its paths).
    if arg("--completion-words", "on") == "off" {
        if let Some(ordinal) = device.ordinal() {
            let options = streamalloc::CudaOptions {
                completion_words: false,
                ..streamalloc::CudaOptions::default()
            };
            device = Device::cuda_with(ordinal, options).expect("the same GPU again");
        }
    }
    let resource = arg("--resource", "all");
    let which = arg("--run", "all");
    let repeat: usize = arg("--repeat", "1").parse().unwrap_or(1);
    let growth_divisor: u32 = arg("--growth-divisor", "8").parse().unwrap_or(8);
    let reuse_slack: f64 = arg("--reuse-slack", "0").parse().unwrap_or(0.0);
    let opportunistic_reuse = arg("--opportunistic", "on") != "off";
    let map_unit: Option<usize> = arg("--map-unit", "default").parse().ok();
    let growth_cap: Option<f64> = arg("--growth-cap", "1.3").parse().ok();
    let superblock: Option<usize> = arg("--superblock", "default").parse().ok();
    let small_block_cache: usize = arg("--small-block-cache", "4096")
        .parse::<usize>()
        .expect("--small-block-cache takes KiB")
        << 10;
    let placement = match arg("--placement", "low").as_str() {
        "closest" => ExpandablePlacement::ClosestFit,
        _ => ExpandablePlacement::LowAddress,
    };
    let initials: Vec<usize> = arg("--initial", "2048,256")
        .split(',')
        .map(|m| {
            m.trim()
                .parse::<usize>()
                .expect("--initial takes MiB, comma-separated")
                * MIB
        })
        .collect();
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
        if which == "all" || which.split(',').any(|w| w == r.name || w == "workloads") {
            runs.push(r);
        }
    }
    if which == "all" || which.split(',').any(|w| w == "scaling") {
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

    let report = |label: &str, run: &Run, wall: Duration, o: Outcome, extra: String| {
        let total_ops = run.threads * run.ops;
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
                if resource == "all" || resource == "pool" {
                    let pool = make_pool(initial);
                    let (wall, o) = run_on(&pool, &device, run);
                    let extra = pool_extra(&pool.stats(), &o);
                    report(&format!("pool{start}"), run, wall, o, extra);
                }
                if resource == "all" || resource == "expandable" {
                    // The pool on virtual memory: `initial` mapped, up to 8 GiB mapped.
                    let r = ExpandablePoolResource::new(
                        &device,
                        ExpandableOptions {
                            initial,
                            maximum: Some(8 * GIB),
                            map_unit: map_unit.map(|mib| mib * MIB),
                            placement,
                            // Its own default (none) unless asked for.
                            small_block_cache: std::env::args()
                                .any(|a| a == "--small-block-cache")
                                .then_some(small_block_cache),
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
                if resource == "all" || resource == "arena" {
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
                if resource == "all" || resource == "binning" {
                    // As WORKLOADS.md's RMM reference: fixed-size bins 2^18..2^22 over a pool, the
                    // pool serving what is larger.
                    let pool = make_pool(initial);
                    let r = BinningResource::new(pool, 18, 22).unwrap();
                    let (wall, o) = run_on(&r, &device, run);
                    report(&format!("binning{start}"), run, wall, o, String::new());
                }
            }
            if resource == "all" || resource == "cuda-async" {
                let r = CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap();
                let (wall, o) = run_on(&r, &device, run);
                let extra = format!(
                    "driver pool reserved {} MiB",
                    r.reserved_bytes().unwrap_or(0) / MIB
                );
                report("cuda-async", run, wall, o, extra);
            }
            if resource == "all" || resource == "cuda" {
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
    }
}

fn run_on(r: &impl MemoryResource, device: &Device, run: &Run) -> (Duration, Outcome) {
    run_threads(r, device, run)
}
