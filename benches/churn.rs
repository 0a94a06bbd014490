//! The `churn` workloads of `shared/bench/WORKLOADS.md`, exactly: splitmix64, the same decision
//! sequence for every allocator, and its checksums (allocations and bytes allocated).
//!
//! `cargo bench --bench churn [-- --resource pool|cuda-async|arena|binning|cuda|all] [--run churn-1t|churn-4t|scaling|all] [--repeat N]`
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
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{Device, MemoryResource};

const GIB: usize = 1 << 30;
const MIB: usize = 1 << 20;

#[derive(Default, Clone, Copy)]
struct Outcome {
    allocations: u64,
    bytes: u64,
    peak_live: u64,
}

/// One thread of `churn(seed, ops, max_live)` on `stream`, with min_exp 8 and max_exp 22.
fn churn(
    r: &impl MemoryResource,
    stream: &streamalloc::Stream,
    seed: u64,
    ops: u64,
    max_live: u64,
) -> Outcome {
    const MIN_EXP: u64 = 8;
    const MAX_EXP: u64 = 22;
    let mut rng = SplitMix64(seed);
    let mut live: Vec<(streamalloc::DevicePtr, usize)> = Vec::with_capacity(4096);
    let (mut live_bytes, mut out) = (0u64, Outcome::default());
    for _ in 0..ops {
        let (a, b) = (rng.next(), rng.next());
        let e = MIN_EXP + b % (MAX_EXP - MIN_EXP + 1);
        let size = (1u64 << e) + (b >> 8) % (1u64 << e);
        if live.is_empty() || (a & 1 == 0 && live_bytes + size <= max_live) {
            let p = r.allocate(size as usize, stream).expect("allocate");
            live.push((p, size as usize));
            live_bytes += size;
            out.allocations += 1;
            out.bytes += size;
            out.peak_live = out.peak_live.max(live_bytes);
        } else {
            let i = ((a >> 1) % live.len() as u64) as usize;
            let (p, s) = live.swap_remove(i);
            // SAFETY: allocated above from `r` with this size, never used, freed once.
            unsafe { r.deallocate(p, s, stream) }.expect("deallocate");
            live_bytes -= s as u64;
        }
    }
    for (p, s) in live.drain(..) {
        // SAFETY: as above.
        unsafe { r.deallocate(p, s, stream) }.expect("deallocate");
    }
    stream.synchronize_blocking().expect("synchronize");
    out
}

/// `threads` threads, thread t with seed 42 + t on its own stream; (wall, summed outcome).
fn run_threads(
    r: &impl MemoryResource,
    device: &Device,
    threads: u64,
    ops: u64,
    max_live: u64,
) -> (Duration, Outcome) {
    let streams: Vec<_> = (0..threads)
        .map(|_| device.create_stream().unwrap())
        .collect();
    let barrier = Barrier::new(threads as usize + 1);
    std::thread::scope(|scope| {
        let handles: Vec<_> = streams
            .iter()
            .enumerate()
            .map(|(t, stream)| {
                let barrier = &barrier;
                scope.spawn(move || {
                    barrier.wait();
                    churn(r, stream, 42 + t as u64, ops, max_live)
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let outcomes: Vec<Outcome> = handles.into_iter().map(|h| h.join().unwrap()).collect();
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
    ops: u64,
    max_live: u64,
    checksum: Option<(u64, u64)>,
}

const RUNS: [Run; 2] = [
    Run {
        name: "churn-1t",
        threads: 1,
        ops: 1_000_000,
        max_live: GIB as u64,
        checksum: Some((500_021, 418_895_256_400)),
    },
    Run {
        name: "churn-4t",
        threads: 4,
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

fn main() {
    let device = Device::default_device().expect("a device");
    let resource = arg("--resource", "all");
    let which = arg("--run", "all");
    let repeat: usize = arg("--repeat", "1").parse().unwrap_or(1);
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
        if which == "all" || which == r.name {
            runs.push(r);
        }
    }
    if which == "all" || which == "scaling" {
        for threads in [1, 2, 4, 8] {
            runs.push(Run {
                name: "scaling",
                threads,
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

    for run in &runs {
        for _ in 0..repeat {
            if resource == "all" || resource == "pool" {
                let pool = PoolResource::new(
                    CudaResource::new(&device),
                    PoolOptions {
                        initial: 2 * GIB,
                        maximum: Some(8 * GIB),
                    },
                )
                .unwrap();
                let (wall, o) = run_on(&pool, &device, run);
                let s = pool.stats();
                let extra = format!(
                    "{} MiB / {} MiB = {:.2} ({} grows, {} steals)",
                    s.peak_reserved / MIB,
                    o.peak_live / MIB as u64,
                    s.peak_reserved as f64 / o.peak_live as f64,
                    s.grows,
                    s.steals
                );
                report("pool", run, wall, o, extra);
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
            if resource == "all" || resource == "arena" {
                // RMM's arena, sized as the pool: 2 GiB up front, up to 8 GiB.
                let r = ArenaResource::new(
                    CudaResource::new(&device),
                    ArenaOptions {
                        initial: 2 * GIB,
                        maximum: Some(8 * GIB),
                        ..ArenaOptions::default()
                    },
                )
                .unwrap();
                let (wall, o) = run_on(&r, &device, run);
                let s = r.stats();
                let extra = format!("peak reserved {} MiB", s.peak_reserved / MIB);
                report("arena", run, wall, o, extra);
            }
            if resource == "all" || resource == "binning" {
                // As WORKLOADS.md's RMM reference: fixed-size bins 2^18..2^22 over a pool, the
                // pool serving what is larger.
                let pool = PoolResource::new(
                    CudaResource::new(&device),
                    PoolOptions {
                        initial: 2 * GIB,
                        maximum: Some(8 * GIB),
                    },
                )
                .unwrap();
                let r = BinningResource::new(pool, 18, 22).unwrap();
                let (wall, o) = run_on(&r, &device, run);
                report("binning", run, wall, o, String::new());
            }
            if resource == "all" || resource == "cuda" {
                // Raw cuMemAlloc/cuMemFree, sampled as WORKLOADS.md did (20,000 operations in
                // all): the sequence is the same, cut short, so there is no checksum.
                let sampled = Run {
                    name: run.name,
                    threads: run.threads,
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
    run_threads(r, device, run.threads, run.ops, run.max_live)
}
