//! A three-stage GPU pipeline driven by async Rust: `cargo run --example pipeline`.
//!
//! Runs on CUDA device 0 when there is a GPU, else on the simulated device, and says which.
//! `RUST_LOG=streamalloc=debug` shows what the crate does; `STREAMALLOC_DEVICE=sim|cuda|cuda:N`
//! picks the device.
//!
//! Each batch is one tokio task that spreads its work over two streams of a `StreamPool`:
//!
//! 1. on stream A: allocate device memory in stream order, fill it with `i + 1.0`, record `filled`;
//! 2. on stream B: wait for `filled` on the GPU (the host does not wait), scale by 2, record `scaled`;
//! 3. the task `.await`s `scaled` (no thread is blocked), copies the floats back to a host `Vec`
//!    on B, records `copied`, queues the free, awaits `copied` and checks the values.
//!
//! The batches run concurrently, and they wait for the GPU by `.await`, never by blocking a
//! thread. (This example uses raw device pointers; it moves to pool-allocated buffers when those
//! land.)

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use streamalloc::{Device, DeviceKind, StreamPool};
use tokio::task::JoinSet;
use tracing_subscriber::EnvFilter;

const BATCHES: usize = 32;
const FLOATS: usize = 1 << 16; // per batch: 256 KiB
const STREAMS: usize = 4;

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
    match device.kind() {
        DeviceKind::Cuda => {
            let ordinal = device.ordinal().unwrap_or(0);
            println!("running on CUDA device {ordinal}: {}", device.name());
        }
        DeviceKind::Simulated if std::env::var_os("STREAMALLOC_DEVICE").is_some() => {
            println!("running on the simulated device (chosen by STREAMALLOC_DEVICE)");
        }
        DeviceKind::Simulated => {
            println!("running on the simulated device (no GPU found; RUST_LOG=info says why)");
        }
    }

    let streams = Arc::new(StreamPool::new(&device, STREAMS)?);
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    for i in 0..BATCHES {
        tasks.spawn(batch(device.clone(), streams.clone(), i));
    }
    // Drain every task, even after a failure: dropping the JoinSet would abort the tasks still
    // running, and an aborted task drops its host Vec while a queued copy may still write to it.
    let mut first_error = None;
    while let Some(joined) = tasks.join_next().await {
        let result = joined.map_err(BoxError::from).and_then(|r| r);
        if let Err(e) = result {
            first_error.get_or_insert(e);
        }
    }
    if let Some(e) = first_error {
        return Err(e);
    }

    let bytes = BATCHES * FLOATS * 4;
    println!(
        "{BATCHES} batches of {FLOATS} f32 over {STREAMS} streams: filled, scaled and copied \
         back {} MiB in {:.1?}; all values correct",
        bytes >> 20,
        start.elapsed()
    );
    Ok(())
}

/// One batch: three stages on two streams.
async fn batch(device: Device, streams: Arc<StreamPool>, i: usize) -> Result<(), BoxError> {
    let bytes = FLOATS * 4;
    let (a, b) = (streams.get(), streams.get());

    // Stage 1, on A. The memory may be used at once by work queued on A after this call, and on
    // another stream once that stream is ordered after A (B is, through `filled`).
    let data = device.malloc_async(bytes, &a)?;
    let value = (i + 1) as f32;
    // SAFETY: `data` is a live, 4-aligned allocation of `bytes` bytes; it is freed only in
    // stage 3, on B, which is ordered after this fill through `filled`.
    unsafe { a.fill_u32(data, value.to_bits(), FLOATS)? };
    let filled = a.record()?;

    // Stage 2, on B: a GPU-side wait, so the scale runs after the fill without the host waiting.
    b.wait(&filled)?;
    // SAFETY: as above; the free is queued on B after this scale.
    unsafe { b.scale_f32(data, 2.0, FLOATS)? };
    let scaled = b.record()?;

    // Stage 3: copy back to the host. The task first awaits `scaled` (no thread is blocked): a
    // Vec is pageable memory, and CUDA returns from a copy into pageable memory only once the
    // copy has run, so queuing it behind unfinished work would hold this worker thread. (Pinned
    // host buffers, which come with the buffers, make the copy itself asynchronous.)
    scaled.await?;
    let mut host = vec![0.0f32; FLOATS];
    // SAFETY: `host` has room for `bytes` bytes and is neither read, moved nor dropped until
    // `copied` (recorded right after the copy) has completed: the one early return before the
    // await leaks it, and this task is never cancelled mid-await (`run` drains the JoinSet
    // rather than aborting tasks). `data` is live until the free queued after the copy.
    unsafe { b.copy_dtoh(host.as_mut_ptr().cast(), data, bytes)? };
    let copied = match b.record() {
        Ok(event) => event,
        Err(e) => {
            // Without the event we cannot know when the copy is done: leak the Vec rather
            // than free memory that the copy may still write to.
            std::mem::forget(host);
            return Err(e.into());
        }
    };
    // SAFETY: `data` came from `malloc_async` on this device and is freed once, here. Its uses
    // (the fill on A, the scale and the copy on B) are all ordered before this point of B.
    let freed = unsafe { device.free_async(data, &b) };
    copied.await?; // the task waits; no thread is blocked. `host` now holds the result.
    freed?;

    let expected = value * 2.0;
    if let Some(at) = host.iter().position(|&x| x != expected) {
        return Err(format!("batch {i}: host[{at}] = {}, expected {expected}", host[at]).into());
    }
    Ok(())
}
