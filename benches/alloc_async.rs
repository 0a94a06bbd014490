//! What waiting for memory costs (issue 4's figures).
//!
//! 1. `allocate_async(..).await` that succeeds at once, against `allocate`: a tight
//!    allocate/free loop, and the `churn-1t` sequence of WORKLOADS.md (its checksum checked),
//!    each through both paths. The future is polled once by hand (no runtime in the way).
//! 2. Latency from the GPU finishing the work that frees memory to the waiting task holding its
//!    allocation: a one-block pool; its block is used by a spin kernel on stream K and dropped
//!    (the free is deferred until K's event completes); a task awaits `DeviceBuffer::alloc`. An
//!    observer spinning on an event recorded right after the kernel timestamps the completion.
//!    Reported to the waker (reactor + deferred free + queue) and to the task running.
//! 3. Throughput of 64 tasks, each needing a quarter of the pool, looping.
//!
//! `cargo bench --bench alloc_async`. GPU if there is one, else the simulated device.
//!
//! `cargo bench --bench alloc_async -- --help` says what it measures; it takes no flags, and an
//! unknown flag is an error.

use std::future::Future;
use std::sync::{mpsc, Arc};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

mod common;

use clap::Parser;
use common::{now_ns, quantiles, SplitMix64, Stamp, Stamped};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{
    AllocateAsync, CudaOptions, Device, DeviceBuffer, Event, MemoryResource, SimConfig, Stream,
    StreamPool,
};

const MIB: usize = 1 << 20;

fn open(options: CudaOptions) -> Device {
    Device::cuda_with(0, options).unwrap_or_else(|_| Device::simulated(SimConfig::default()))
}

fn pool(device: &Device, initial: usize, maximum: usize) -> Arc<PoolResource<CudaResource>> {
    Arc::new(
        PoolResource::new(
            CudaResource::new(device),
            PoolOptions {
                initial,
                maximum: Some(maximum),
                ..PoolOptions::default()
            },
        )
        .unwrap(),
    )
}

/// Polls a future once with a no-op waker: the cost of the future alone.
fn poll_once<F: Future>(f: F) -> Option<F::Output> {
    let mut f = std::pin::pin!(f);
    // (A no-op waker: the future alone is measured.)
    match f
        .as_mut()
        .poll(&mut Context::from_waker(futures::task::noop_waker_ref()))
    {
        Poll::Ready(v) => Some(v),
        Poll::Pending => None,
    }
}

/// churn(42, 1M ops, 1 GiB), allocating through `alloc`; returns (ns/op, allocations, bytes).
fn churn(
    p: &PoolResource<CudaResource>,
    s: &Stream,
    alloc: impl Fn(usize) -> streamalloc::DevicePtr,
) -> (f64, u64, u64) {
    let mut rng = SplitMix64(42);
    let mut live: Vec<(streamalloc::DevicePtr, usize)> = Vec::with_capacity(4096);
    let (mut live_bytes, mut n, mut bytes) = (0u64, 0u64, 0u64);
    let start = Instant::now();
    for _ in 0..1_000_000u64 {
        let (a, b) = (rng.next(), rng.next());
        let e = 8 + b % 15;
        let size = (1u64 << e) + (b >> 8) % (1u64 << e);
        if live.is_empty() || (a & 1 == 0 && live_bytes + size <= 1 << 30) {
            live.push((alloc(size as usize), size as usize));
            live_bytes += size;
            n += 1;
            bytes += size;
        } else {
            let (ptr, sz) = live.swap_remove(((a >> 1) % live.len() as u64) as usize);
            // SAFETY: allocated above from `p`, unused, freed once.
            unsafe { p.deallocate(ptr, sz, s) }.unwrap();
            live_bytes -= sz as u64;
        }
    }
    for (ptr, sz) in live {
        // SAFETY: as above.
        unsafe { p.deallocate(ptr, sz, s) }.unwrap();
    }
    s.synchronize_blocking().unwrap();
    (start.elapsed().as_nanos() as f64 / 1e6, n, bytes)
}

fn overhead(device: &Device) {
    println!(
        "\n1. allocate_async that succeeds at once, against allocate (ns per op; lower is better)"
    );
    let p = pool(device, 2 << 30, 8 << 30);
    let s = device.create_stream().unwrap();
    let n = 2_000_000;
    for round in 0..2 {
        let t = Instant::now();
        for _ in 0..n {
            let ptr = p.allocate(4096, &s).unwrap();
            // SAFETY: just allocated, unused.
            unsafe { p.deallocate(ptr, 4096, &s) }.unwrap();
        }
        let sync = t.elapsed().as_nanos() as f64 / (2 * n) as f64;
        let t = Instant::now();
        for _ in 0..n {
            let ptr = poll_once(p.allocate_async(4096, &s)).unwrap().unwrap();
            // SAFETY: as above.
            unsafe { p.deallocate(ptr, 4096, &s) }.unwrap();
        }
        let asynch = t.elapsed().as_nanos() as f64 / (2 * n) as f64;
        println!("   pair loop, round {round}: allocate {sync:6.1}   allocate_async {asynch:6.1}   ratio {:.3}", asynch / sync);
    }
    for round in 0..2 {
        let (sync, n1, b1) = churn(&p, &s, |size| p.allocate(size, &s).unwrap());
        let (asynch, n2, b2) = churn(&p, &s, |size| {
            poll_once(p.allocate_async(size, &s)).unwrap().unwrap()
        });
        let ok = (n1, b1) == (500_021, 418_895_256_400) && (n2, b2) == (n1, b1);
        println!(
            "   churn-1t,  round {round}: allocate {sync:6.1}   allocate_async {asynch:6.1}   ratio {:.3}   checksums {}",
            asynch / sync,
            if ok { "ok" } else { "MISMATCH" }
        );
    }
}

fn wake_latency(
    rt: &tokio::runtime::Runtime,
    name: &str,
    options: CudaOptions,
    kernel: Duration,
    samples: usize,
) {
    let device = open(options);
    let bytes = 64 * MIB;
    let p = pool(&device, bytes, bytes);
    let (a, k) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let (to_observer, rx) = mpsc::channel::<(Event, tokio::sync::oneshot::Sender<u64>)>();
    let observer = std::thread::spawn(move || {
        for (event, reply) in rx {
            while !event.is_complete() {
                std::hint::spin_loop();
            }
            let _ = reply.send(now_ns());
        }
    });
    let (to_waker, to_task) = rt.block_on(async {
        let (mut w, mut t) = (Vec::new(), Vec::new());
        for i in 0..samples + 50 {
            let mut x = DeviceBuffer::new(&p, bytes, &a).unwrap();
            k.wait(&a.record().unwrap()).unwrap();
            k.spin(kernel).unwrap();
            x.record_stream(&k).unwrap();
            let done = k.record().unwrap();
            drop(x);
            let (tx, reached) = tokio::sync::oneshot::channel();
            to_observer.send((done, tx)).unwrap();
            let stamp = Stamp::new();
            let buf = Stamped::new(DeviceBuffer::alloc(&p, bytes, &a), stamp.clone())
                .await
                .unwrap();
            let resumed = now_ns();
            let reached = reached.await.unwrap();
            drop(buf);
            if i >= 50 {
                let woken = stamp.woken_at();
                w.push(if woken == 0 {
                    0
                } else {
                    woken as i64 - reached as i64
                });
                t.push(resumed as i64 - reached as i64);
            }
        }
        (w, t)
    });
    drop(to_observer);
    observer.join().unwrap();
    println!(
        "   {name:<12} {kernel:>8?} {samples:>6}   {}   {}",
        quantiles(to_waker),
        quantiles(to_task)
    );
}

fn sixty_four_tasks(rt: &tokio::runtime::Runtime, device: &Device) {
    println!("\n3. 64 tasks, each needing a quarter of a 1 GiB pool, 50 rounds each (alloc, touch, 100 µs kernel, await it, free)");
    let size = 1 << 30;
    let p = pool(device, size, size);
    let streams = StreamPool::new(device, 16).unwrap();
    let start = Instant::now();
    rt.block_on(async {
        let tasks: Vec<_> = (0..64)
            .map(|t| {
                let (p, streams) = (p.clone(), streams.clone());
                tokio::spawn(async move {
                    let stream = streams.get_by_index(t);
                    for _ in 0..50 {
                        let buf = DeviceBuffer::alloc(&p, size / 4, &stream).await.unwrap();
                        // SAFETY: 4 KiB of `buf`, used on its stream.
                        unsafe { stream.memset_d8(buf.as_ptr(), t as u8, 4096) }.unwrap();
                        stream.spin(Duration::from_micros(100)).unwrap();
                        stream.synchronize().await.unwrap();
                        drop(buf);
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    });
    let wall = start.elapsed();
    let (stats, waits) = (p.stats(), p.wait_stats());
    println!(
        "   {} allocations in {wall:.2?}: {:.0} per s; out-of-memory errors: 0; peak reserved {} MiB of {} MiB; {} waits, mean {:.1?}, max {:.1?}",
        64 * 50,
        (64 * 50) as f64 / wall.as_secs_f64(),
        stats.peak_reserved / MIB,
        size / MIB,
        waits.waits,
        waits.total_wait / (waits.waits.max(1) as u32),
        waits.max_wait
    );
}

/// What waiting for memory costs (issue 4): `allocate_async` that succeeds at once against
/// `allocate`, the latency from the GPU freeing memory to the waiting task holding it, and the
/// throughput of 64 tasks sharing a pool. GPU if there is one, else the simulated device. No
/// flags.
#[derive(Parser)]
#[command(name = "alloc_async", bin_name = "alloc_async")]
struct Args {
    /// Passed by `cargo bench` to a bench without the test harness; ignored.
    #[arg(long = "bench", hide = true)]
    _bench: bool,
}

fn main() {
    Args::parse();
    let _ = now_ns();
    let device = open(CudaOptions::default());
    println!("device: {device}");
    let date = std::process::Command::new("date").arg("-u").output();
    println!(
        "date: {}",
        date.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default()
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap();
    overhead(&device);
    println!("\n2. GPU frees the memory -> waiting task holds it: median, p99, max");
    println!(
        "   {:<12} {:>8} {:>6}   {:^29}   {:^29}",
        "options", "kernel", "n", "to waker", "to task"
    );
    let n = if device.is_simulated() { 200 } else { 2000 };
    wake_latency(
        &rt,
        "default",
        CudaOptions::default(),
        Duration::from_micros(200),
        n,
    );
    wake_latency(
        &rt,
        "default",
        CudaOptions::default(),
        Duration::from_millis(2),
        n,
    );
    // The default before completion words (issue 18): every poll a driver query.
    let no_words = CudaOptions {
        completion_words: false,
        ..CudaOptions::default()
    };
    for kernel in [Duration::from_micros(200), Duration::from_millis(2)] {
        wake_latency(&rt, "no words", no_words.clone(), kernel, n);
    }
    wake_latency(
        &rt,
        "low_latency",
        CudaOptions::low_latency(),
        Duration::from_millis(2),
        n,
    );
    sixty_four_tasks(&rt, &device);
}
