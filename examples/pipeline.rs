//! A two-stream GPU pipeline driven by async Rust: `cargo run --example pipeline`.
//!
//! Runs on CUDA device 0 when there is a GPU, else on the simulated device, and says which.
//! `--devices N` (at most 64) spreads the batches over N devices, round robin: GPUs 0..N, or
//! N simulated devices where the default device is simulated; each device has its own pool
//! and streams.
//! `--batches N` and `--floats N` set the work (32 batches of two 65,536-float buffers by
//! default).
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
//!    `output` and scale `output` by 2. On CUDA the scale is the example's own kernel (PTX
//!    below), loaded and launched with cudarc's launch builder on B itself
//!    (`Stream::cudarc_stream`), on our buffer, with nothing synchronized around it; on the
//!    simulated device, where cudarc cannot run, it is the simulated device's built-in
//!    `scale_f32`. `input` is now used on B too: `record_stream` tells it,
//!    so dropping it right away frees it only once B's copy has run;
//! 3. the task awaits `output.to_host(&b)` (the copy back runs after B's work; no thread
//!    blocks), checks the values and drops `output`, which goes back to the pool on B at once.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use streamalloc::cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use streamalloc::cudarc::nvrtc::Ptx;
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{Device, DeviceBuffer, DeviceVec, SimConfig, StreamPool};
use tokio::task::JoinSet;
use tracing_subscriber::EnvFilter;

/// The default shape; `--batches N` and `--floats N` change it (a larger one, for the scaling
/// over several GPUs that `BENCHMARKS.md` reports).
const BATCHES: usize = 32;
const FLOATS: usize = 1 << 16; // per buffer: 256 KiB

/// The shape of this run: (batches, floats per buffer), set once from the command line.
static SHAPE: std::sync::OnceLock<(usize, usize)> = std::sync::OnceLock::new();

fn batches() -> usize {
    SHAPE.get().map_or(BATCHES, |s| s.0)
}

fn floats() -> usize {
    SHAPE.get().map_or(FLOATS, |s| s.1)
}
const STREAMS: usize = 4;
/// The pool holds the buffers of this many batches at once.
const POOL_BATCHES: usize = 6;

type Pool = PoolResource<CudaResource>;

/// The example's own kernel: `data[i] *= factor` for `i < count`, `(float*, float, u64)`, in
/// PTX (the crate's `streamalloc_scale_f32`, under its own name), loaded through cudarc.
const SCALE_PTX: &str = r#"
.version 7.0
.target sm_75
.address_size 64

.visible .entry pipeline_scale_f32(
	.param .u64 pipeline_scale_f32_param_0,
	.param .f32 pipeline_scale_f32_param_1,
	.param .u64 pipeline_scale_f32_param_2
)
{
	.reg .pred 	%p<3>;
	.reg .f32 	%f<4>;
	.reg .b32 	%r<5>;
	.reg .b64 	%rd<15>;

	ld.param.u64 	%rd7, [pipeline_scale_f32_param_0];
	ld.param.f32 	%f1, [pipeline_scale_f32_param_1];
	ld.param.u64 	%rd8, [pipeline_scale_f32_param_2];
	mov.u32 	%r1, %ntid.x;
	cvt.u64.u32 	%rd1, %r1;
	mov.u32 	%r2, %ctaid.x;
	mul.wide.u32 	%rd9, %r2, %r1;
	mov.u32 	%r3, %tid.x;
	cvt.u64.u32 	%rd10, %r3;
	add.s64 	%rd14, %rd9, %rd10;
	setp.ge.u64 	%p1, %rd14, %rd8;
	@%p1 bra 	$L__BB0_3;

	mov.u32 	%r4, %nctaid.x;
	cvt.u64.u32 	%rd11, %r4;
	mul.lo.s64 	%rd3, %rd11, %rd1;
	cvta.to.global.u64 	%rd4, %rd7;

$L__BB0_2:
	shl.b64 	%rd12, %rd14, 2;
	add.s64 	%rd13, %rd4, %rd12;
	ld.global.f32 	%f2, [%rd13];
	mul.f32 	%f3, %f2, %f1;
	st.global.f32 	[%rd13], %f3;
	add.s64 	%rd14, %rd14, %rd3;
	setp.lt.u64 	%p2, %rd14, %rd8;
	@%p2 bra 	$L__BB0_2;

$L__BB0_3:
	ret;

}
"#;
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

/// One device's share of the pipeline: its pool, its streams, and (on CUDA) the example's own
/// kernel, loaded through cudarc in the device's context.
struct Lane {
    device: Device,
    pool: Arc<Pool>,
    streams: StreamPool,
    scale: Option<CudaFunction>,
}

/// The most `--devices`. Each simulated device starts threads of its own (its completion
/// reactor, a worker per stream): `--devices 100000` ran the process out of threads, and it
/// aborted ("fatal runtime error") instead of saying so. No host has more GPUs than this.
const MAX_DEVICES: usize = 64;

/// The command line: returns the device count and sets [`SHAPE`].
fn parse_args() -> Result<usize, BoxError> {
    let (devices, batches, floats) = parse(std::env::args().skip(1))?;
    let _ = SHAPE.set((batches, floats));
    Ok(devices)
}

/// `--devices N` (default 1, at most [`MAX_DEVICES`]), `--batches N` (default 32) and
/// `--floats N` (per buffer, default 65,536), parsed by hand: (devices, batches, floats).
fn parse(mut args: impl Iterator<Item = String>) -> Result<(usize, usize, usize), BoxError> {
    let (mut devices, mut batches, mut floats) = (1, BATCHES, FLOATS);
    while let Some(arg) = args.next() {
        let target = match arg.as_str() {
            "--devices" => &mut devices,
            "--batches" => &mut batches,
            "--floats" => &mut floats,
            other => {
                return Err(format!(
                    "unknown argument {other:?} (--devices N, --batches N, --floats N)"
                )
                .into())
            }
        };
        let n = args.next().ok_or(format!("{arg} needs a number"))?;
        *target = n.parse().map_err(|_| format!("{arg} {n}: not a number"))?;
        if *target == 0 {
            return Err(format!("{arg} must be at least 1").into());
        }
    }
    // The kernel's launch counts elements in a u32, and the pool holds POOL_BATCHES batches of
    // two buffers: refuse what would not fit rather than wrap.
    let fits = u32::try_from(floats).is_ok()
        && (floats * size_of::<f32>())
            .checked_next_multiple_of(256)
            .and_then(|buffer| buffer.checked_mul(2 * POOL_BATCHES))
            .and_then(|pool| pool.checked_mul(batches))
            .is_some();
    if !fits {
        return Err(format!("--batches {batches} --floats {floats}: too large").into());
    }
    if devices > MAX_DEVICES {
        return Err(format!("--devices {devices}: at most {MAX_DEVICES}").into());
    }
    Ok((devices, batches, floats))
}

/// The devices to run on: the default device, and with `--devices N` the first N GPUs, or
/// N simulated devices where the default device is simulated.
fn open_devices(n: usize) -> Result<Vec<Device>, BoxError> {
    let first = Device::default_device()?;
    let why = match (first.is_simulated(), std::env::var_os("STREAMALLOC_DEVICE")) {
        (false, _) => "",
        (true, Some(_)) => " (chosen by STREAMALLOC_DEVICE)",
        (true, None) => " (no GPU found; RUST_LOG=info says why)",
    };
    let mut devices = vec![first];
    for k in 1..n {
        devices.push(if devices[0].is_simulated() {
            Device::simulated(SimConfig::default())
        } else {
            let ordinal = devices[0].ordinal().unwrap_or(0) + k;
            Device::cuda(ordinal).map_err(|e| format!("--devices {n}: GPU {ordinal}: {e}"))?
        });
    }
    for d in &devices {
        println!("running on {d}{why}");
    }
    Ok(devices)
}

async fn run() -> Result<(), BoxError> {
    let devices = open_devices(parse_args()?)?;
    let lanes = devices
        .into_iter()
        .map(lane)
        .collect::<Result<Vec<_>, BoxError>>()?;
    let lanes: Vec<Arc<Lane>> = lanes.into_iter().map(Arc::new).collect();

    let start = Instant::now();
    let mut tasks = JoinSet::new();
    for i in 0..batches() {
        // Batches are spread over the devices round robin.
        tasks.spawn(batch(lanes[i % lanes.len()].clone(), i));
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
    for lane in &lanes {
        for stream in lane.streams.streams() {
            stream.synchronize().await?; // the deferred frees of the last inputs have run
        }
    }

    let pool_bytes = lanes[0].pool.stats().reserved;
    println!(
        "{} batches of 2 x {} f32 over {} device(s), {STREAMS} streams each, from \
         one pool of {} per device ({POOL_BATCHES} batches at a time): filled, scaled and \
         copied back {} in {elapsed:.1?}; all values correct",
        batches(),
        floats(),
        lanes.len(),
        human(pool_bytes),
        human(batches() * floats() * size_of::<f32>()),
    );
    for lane in &lanes {
        let how = if lane.scale.is_some() {
            "the example's own kernel, launched with cudarc on our stream"
        } else {
            "the simulated device's built-in scale kernel"
        };
        println!("{}: scaled by {how}", lane.device);
        print_stats(&lane.pool);
    }
    Ok(())
}

/// A device's pool, streams and kernel.
fn lane(device: Device) -> Result<Lane, BoxError> {
    // One pool for the device's batches. Its memory is taken from the device up front, in one
    // chunk (initial = maximum): a pool that grows chunk by chunk cannot serve a request larger
    // than its largest chunk, however much is free in the others.
    // Each buffer takes its size rounded up to the pool's 256-byte alignment (`--floats 65`
    // asked the pool for 520 bytes a batch, not a multiple of 256, and the run failed with the
    // pool's error about its initial size).
    let batch_bytes = 2 * (floats() * size_of::<f32>()).next_multiple_of(256);
    let pool_bytes = POOL_BATCHES * batch_bytes;
    let options = PoolOptions {
        initial: pool_bytes,
        maximum: Some(pool_bytes),
        ..PoolOptions::default()
    };
    let pool = Arc::new(PoolResource::new(CudaResource::new(&device), options)?);
    let streams = StreamPool::new(&device, STREAMS)?;
    // On CUDA, the example's own kernel, loaded with cudarc into the device's own context
    // (shared with streamalloc, not a second one). cudarc has no simulated device: there the
    // simulated device's built-in `scale_f32` does the same work.
    let scale = match device.cudarc_context() {
        Some(ctx) => {
            let module = ctx.load_module(Ptx::from_src(SCALE_PTX))?;
            Some(module.load_function("pipeline_scale_f32")?)
        }
        None => None,
    };
    Ok(Lane {
        device,
        pool,
        streams,
        scale,
    })
}

/// One batch: two stages on two streams, then the result back to the host.
async fn batch(lane: Arc<Lane>, i: usize) -> Result<(), BoxError> {
    let pool = &lane.pool;
    // Two different streams (by index, so that concurrent tasks cannot hand us the same one).
    let (a, b) = (
        lane.streams.get_by_index(i),
        lane.streams.get_by_index(i + 1),
    );

    // Take the batch's memory in one step, all or nothing. A task that held part of its memory
    // while it waited for the rest could deadlock with others doing the same, each holding
    // what the others wait for; `alloc_all` holds nothing while it waits (first come, first
    // served with the other waiters) and returns at once when the pool has the whole set.
    let bytes = floats() * size_of::<f32>();
    let mut set = DeviceBuffer::alloc_all(pool, &[(bytes, &a), (bytes, &b)]).await?;
    let mut output = DeviceVec::<f32>::from_buffer(set.pop().expect("two buffers"))?;
    let mut input = DeviceVec::<f32>::from_buffer(set.pop().expect("two buffers"))?;

    // Stage 1, on A.
    let value = (i + 1) as f32;
    // SAFETY: `input` is a live, 256-aligned allocation of `floats()` f32s, used on A. The fill is
    // queued on A, and the vector's free (at its drop) is ordered after it in stream order.
    unsafe { a.fill_u32(input.as_ptr(), value.to_bits(), floats())? };
    let filled = a.record()?;

    // Stage 2, on B: a GPU-side wait, so the copy runs after the fill without the host waiting.
    b.wait(&filled)?;
    // The copy below reads `input` on B: record that use, so that the free at its drop waits
    // for B's work queued up to then (an event, and the reactor), not only for A's.
    input.record_stream(&b)?;
    // SAFETY: both vectors are live allocations of `floats()` f32s. `output` lives on B; B is
    // ordered after the fill of `input` (the wait above), and the free of `input` after B's
    // work (`record_stream`); `output` is freed on B after this work, in stream order.
    unsafe { b.copy_dtod(output.as_ptr(), input.as_ptr(), floats() * size_of::<f32>())? };
    match &lane.scale {
        // Our stream handed to cudarc: the launch is queued on B itself, after the copy and
        // before the copy back, with nothing synchronized in between.
        Some(scale) => {
            let cs = b
                .cudarc_stream()
                .ok_or("a CUDA device's stream has a cudarc handle")?;
            let (factor, count) = (2.0f32, floats() as u64);
            let mut launch = cs.launch_builder(scale);
            launch.arg(&mut output).arg(&factor).arg(&count);
            // SAFETY: the kernel's signature is (float*, float, u64); `output` holds `floats()`
            // f32s allocated on B, and this launch is queued on B, after the copy into it and
            // before its copy back and its free.
            unsafe { launch.launch(LaunchConfig::for_num_elems(floats() as u32)) }?;
        }
        // SAFETY: as the copy above; `output` holds `floats()` f32s on B.
        None => unsafe { b.scale_f32(output.as_ptr(), 2.0, floats())? },
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

/// `bytes` for a summary line: whole MiB as `8 MiB`, other sizes from 1 MiB up with one
/// decimal, smaller ones in KiB (`--floats 4096` made the pool "0 MiB").
fn human(bytes: usize) -> String {
    const MIB: usize = 1 << 20;
    if bytes >= MIB && bytes.is_multiple_of(MIB) {
        format!("{} MiB", bytes / MIB)
    } else if bytes >= MIB {
        format!("{:.1} MiB", bytes as f64 / MIB as f64)
    } else {
        format!("{} KiB", bytes.div_ceil(1024))
    }
}

fn print_stats(pool: &Pool) {
    let s = pool.stats();
    let w = pool.wait_stats();
    println!(
        "pool: {} KiB reserved (peak {} KiB) in {} chunk(s), {} KiB free in {} block(s); \
         {} streams, {} grows, {} cross-stream waits",
        s.reserved >> 10,
        s.peak_reserved >> 10,
        s.chunks,
        s.free >> 10,
        s.free_blocks,
        s.streams,
        s.grows,
        s.stream_waits,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Result<(usize, usize, usize), BoxError> {
        parse(line.split_whitespace().map(String::from))
    }

    /// Bad arguments are errors, before any device is opened. `cargo test --example pipeline`.
    #[test]
    fn bad_arguments_are_errors() {
        assert_eq!(args("").unwrap(), (1, BATCHES, FLOATS));
        assert_eq!(
            args(&format!("--devices {MAX_DEVICES} --batches 4 --floats 65")).unwrap(),
            (MAX_DEVICES, 4, 65)
        );
        for bad in [
            "--devices 100000",
            "--devices 0",
            "--devices -1",
            "--devices",
            "--bogus",
            "--floats 4294967296",
            "--batches 18446744073709551615",
        ] {
            assert!(args(bad).is_err(), "{bad:?} was accepted");
        }
    }
}
