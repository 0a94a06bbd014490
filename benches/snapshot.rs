//! How long `PoolResource::snapshot` takes, and how long it holds up an allocation on the
//! stream whose free list it copies, on a pool with 10,000 free blocks (and 10,000 in use
//! between them) on one stream: the case where one lock is held longest (every free block in
//! one list). Prints; asserts nothing.
//!
//! ```text
//! cargo bench --bench snapshot
//! ```
//!
//! `cargo bench --bench snapshot -- --help` says what it measures; it takes no flags, and an
//! unknown flag is an error.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::resource::snapshot::BlockState;
use streamalloc::{Device, MemoryResource, SimConfig};

const BLOCKS: usize = 20_000;

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() as f64 * q) as usize).min(sorted.len() - 1)]
}

/// The longest and the 99.99th percentile of `rounds` same-stream allocate+free pairs,
/// while `snapshots` says whether another thread takes snapshots in a loop.
fn churn_latency(
    pool: &Arc<PoolResource<CudaResource>>,
    stream: &streamalloc::Stream,
    snapshots: bool,
) -> (Duration, Duration, usize) {
    let stop = Arc::new(AtomicBool::new(false));
    let taker = snapshots.then(|| {
        let (pool, stop) = (pool.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                std::hint::black_box(pool.snapshot());
                n += 1;
            }
            n
        })
    });
    let mut times = Vec::with_capacity(200_000);
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(2) {
        let t = Instant::now();
        let p = pool.allocate(768, stream).unwrap();
        // SAFETY: allocated above, unused, freed once.
        unsafe { pool.deallocate(p, 768, stream).unwrap() };
        times.push(t.elapsed());
    }
    stop.store(true, Ordering::Relaxed);
    let taken = taker.map_or(0, |t| t.join().unwrap());
    times.sort_unstable();
    (*times.last().unwrap(), percentile(&times, 0.9999), taken)
}

/// How long `PoolResource::snapshot` takes, and how long it holds up an allocation on the
/// stream whose free list it copies (20,000 blocks, half free, on the simulated device). No
/// flags.
#[derive(Parser)]
#[command(name = "snapshot", bin_name = "snapshot")]
struct Args {
    /// Passed by `cargo bench` to a bench without the test harness; ignored.
    #[arg(long = "bench", hide = true)]
    _bench: bool,
}

fn main() {
    Args::parse();
    let device = Device::simulated(SimConfig::default());
    let pool = Arc::new(
        PoolResource::new(
            CudaResource::new(&device),
            PoolOptions {
                initial: BLOCKS * 512,
                ..PoolOptions::default()
            },
        )
        .unwrap(),
    );
    let stream = device.create_stream().unwrap();
    let ptrs: Vec<_> = (0..BLOCKS)
        .map(|_| pool.allocate(512, &stream).unwrap())
        .collect();
    // Every other one back: 10,000 free blocks in the stream's list, none adjacent.
    for p in ptrs.iter().step_by(2) {
        // SAFETY: allocated above, unused, freed once.
        unsafe { pool.deallocate(*p, 512, &stream).unwrap() };
    }
    let snapshot = pool.snapshot();
    println!(
        "pool: {} chunk(s), {} free blocks, {} blocks in use",
        snapshot.chunks.len(),
        snapshot.count(BlockState::Free),
        snapshot.count(BlockState::InUse)
    );

    let mut whole = Vec::new();
    for _ in 0..50 {
        let t = Instant::now();
        std::hint::black_box(pool.snapshot());
        whole.push(t.elapsed());
    }
    whole.sort_unstable();
    println!(
        "snapshot(): median {:.1?}, max {:.1?} (50 runs; the whole call, locks and tiling)",
        percentile(&whole, 0.5),
        whole.last().unwrap()
    );
    // The part under the stream list's lock: copying its 10,000 blocks out. Measured from
    // outside as what it costs a thread that needs that lock.
    let (max_quiet, p9999_quiet, _) = churn_latency(&pool, &stream, false);
    let (max_busy, p9999_busy, taken) = churn_latency(&pool, &stream, true);
    println!(
        "allocate+free on that stream, 2 s each: without snapshots p99.99 {p9999_quiet:.1?}, max {max_quiet:.1?}; \
         with snapshots taken back to back ({taken} of them) p99.99 {p9999_busy:.1?}, max {max_busy:.1?}"
    );
    for p in ptrs.iter().skip(1).step_by(2) {
        // SAFETY: as above.
        unsafe { pool.deallocate(*p, 512, &stream).unwrap() };
    }
}
