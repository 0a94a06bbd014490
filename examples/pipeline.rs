//! A two-stream GPU pipeline driven by async Rust: `cargo run --example pipeline`.
//!
//! Runs on CUDA device 0 when there is a GPU, else on the simulated device, and says which.
//! `RUST_LOG=streamalloc=debug` shows what the crate does; `STREAMALLOC_DEVICE=sim|cuda|cuda:N`
//! picks the device. Exits non-zero on a wrong value.
//!
//! Each batch is one tokio task. All batches share one pool of device memory, sized for only
//! `POOL_BATCHES` of them at a time: the others wait for memory by `.await` (no thread is
//! parked) until earlier batches free theirs. A batch takes its two buffers all or nothing
//! (`DeviceBuffer::alloc_all`), so that no batch holds one while it waits for the other. A batch spreads its work over two streams of a
//! `StreamPool`:
//!
//! 1. on stream A: fill the `input` vector with `i + 1.0`, record the event `filled`;
//! 2. on stream B: wait for `filled` on the GPU (the host does not wait), copy `input` into
//!    `output` and scale `output` by 2. `input` is now used on B too: `record_stream` tells it,
//!    so dropping it right away frees it only once B's copy has run;
//! 3. the task awaits `output.to_host(&b)` (the copy back runs after B's work; no thread
//!    blocks), checks the values and drops `output`, which goes back to the pool on B at once.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{Device, DeviceBuffer, DeviceVec, StreamPool};
use tokio::task::JoinSet;
use tracing_subscriber::EnvFilter;

const BATCHES: usize = 32;
const FLOATS: usize = 1 << 16; // per buffer: 256 KiB
const STREAMS: usize = 4;
/// The pool holds the buffers of this many batches at once.
const POOL_BATCHES: usize = 6;

type Pool = PoolResource<CudaResource>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> ExitCode {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();

    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pipeline failed: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), BoxError> {
    let device = Device::default_device()?;
    let why = match (
        device.is_simulated(),
        std::env::var_os("STREAMALLOC_DEVICE"),
    ) {
        (false, _) => "",
        (true, Some(_)) => " (chosen by STREAMALLOC_DEVICE)",
        (true, None) => " (no GPU found; RUST_LOG=info says why)",
    };
    println!("running on {device}{why}");

    // One pool for every batch. Its memory is taken from the device up front, in one chunk
    // (initial = maximum): a pool that grows chunk by chunk cannot serve a request larger than
    // its largest chunk, however much is free in the others.
    let batch_bytes = 2 * FLOATS * size_of::<f32>();
    let pool_bytes = POOL_BATCHES * batch_bytes;
    let options = PoolOptions {
        initial: pool_bytes,
        maximum: Some(pool_bytes),
        ..PoolOptions::default()
    };
    let pool = Arc::new(PoolResource::new(CudaResource::new(&device), options)?);
    let streams = StreamPool::new(&device, STREAMS)?;

    let start = Instant::now();
    let mut tasks = JoinSet::new();
    for i in 0..BATCHES {
        tasks.spawn(batch(pool.clone(), streams.clone(), i));
    }
    // Drain every task, even after a failure, so that the first error is the one reported.
    let mut first_error = None;
    while let Some(joined) = tasks.join_next().await {
        if let Err(e) = joined.map_err(BoxError::from).and_then(|r| r) {
            first_error.get_or_insert(e);
        }
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    let elapsed = start.elapsed();
    for stream in streams.streams() {
        stream.synchronize().await?; // the deferred frees of the last inputs have run
    }

    println!(
        "{BATCHES} batches of 2 x {FLOATS} f32 over {STREAMS} streams, from one pool of {} MiB \
         ({POOL_BATCHES} batches at a time): filled, scaled and copied back {} MiB in \
         {elapsed:.1?}; all values correct",
        pool_bytes >> 20,
        (BATCHES * FLOATS * size_of::<f32>()) >> 20,
    );
    print_stats(&pool);
    Ok(())
}

/// One batch: two stages on two streams, then the result back to the host.
async fn batch(pool: Arc<Pool>, streams: StreamPool, i: usize) -> Result<(), BoxError> {
    // Two different streams (by index, so that concurrent tasks cannot hand us the same one).
    let (a, b) = (streams.get_by_index(i), streams.get_by_index(i + 1));

    // Take the batch's memory in one step, all or nothing. A task that held part of its memory
    // while it waited for the rest could deadlock with others doing the same, each holding
    // what the others wait for; `alloc_all` holds nothing while it waits (first come, first
    // served with the other waiters) and returns at once when the pool has the whole set.
    let bytes = FLOATS * size_of::<f32>();
    let mut set = DeviceBuffer::alloc_all(&pool, &[(bytes, &a), (bytes, &b)]).await?;
    let output = DeviceVec::<f32>::from_buffer(set.pop().expect("two buffers"))?;
    let mut input = DeviceVec::<f32>::from_buffer(set.pop().expect("two buffers"))?;

    // Stage 1, on A.
    let value = (i + 1) as f32;
    // SAFETY: `input` is a live, 256-aligned allocation of FLOATS f32s, used on A. The fill is
    // queued on A, and the vector's free (at its drop) is ordered after it in stream order.
    unsafe { a.fill_u32(input.as_ptr(), value.to_bits(), FLOATS)? };
    let filled = a.record()?;

    // Stage 2, on B: a GPU-side wait, so the copy runs after the fill without the host waiting.
    b.wait(&filled)?;
    // The copy below reads `input` on B: record that use, so that the free at its drop waits
    // for B's work queued up to then (an event, and the reactor), not only for A's.
    input.record_stream(&b)?;
    // SAFETY: both vectors are live allocations of FLOATS f32s. `output` lives on B; B is
    // ordered after the fill of `input` (the wait above), and the free of `input` after B's
    // work (`record_stream`); `output` is freed on B after this work, in stream order.
    unsafe {
        b.copy_dtod(output.as_ptr(), input.as_ptr(), FLOATS * size_of::<f32>())?;
        b.scale_f32(output.as_ptr(), 2.0, FLOATS)?;
    }
    drop(input); // never blocks: its memory goes back to the pool once B's copy has run

    // Stage 3: await the result. The copy back is queued on B after the scale; the task waits
    // by `.await` for it, and no thread blocks.
    let host = output.to_host(&b).await?;
    let expected = value * 2.0;
    if let Some(at) = host.iter().position(|&x| x != expected) {
        return Err(format!(
            "batch {i}: element {at} = {}, expected {expected}",
            host[at]
        )
        .into());
    }
    Ok(())
}

fn print_stats(pool: &Pool) {
    let s = pool.stats();
    let w = pool.wait_stats();
    println!(
        "pool: {} KiB reserved (peak {} KiB) in {} chunk(s), {} KiB free in {} block(s); \
         {} stream lists, {} grows, {} steals, {} merges",
        s.reserved >> 10,
        s.peak_reserved >> 10,
        s.chunks,
        s.free >> 10,
        s.free_blocks,
        s.streams,
        s.grows,
        s.steals,
        s.merges,
    );
    let mean = w.total_wait.as_secs_f64() / w.waits.max(1) as f64;
    println!(
        "waits for memory: {} (mean {:.1?}, longest {:.1?}), {} timed out, {} waiting now",
        w.waits,
        Duration::from_secs_f64(mean),
        w.max_wait,
        w.timeouts,
        w.waiting,
    );
}
