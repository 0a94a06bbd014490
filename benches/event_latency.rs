//! Event wake latency and the completion reactor's CPU use.
//!
//! Latency: for each sample a stream runs a spin kernel, then records two events back to back.
//! A tokio task awaits the first; an observer thread spins on the second (`cuEventQuery` in a
//! tight loop) and timestamps the moment the GPU reached it. Two latencies per sample, from that
//! moment:
//! - `to waker`: until the reactor calls the task's waker (the reactor's own part);
//! - `to task`: until the awaiting task runs again (adds the executor waking a worker thread).
//!
//! The observer's event completes nanoseconds after the task's, so both slightly under-state,
//! never over-state, the latency.
//!
//! Regimes, each its own device handle: kernels of 20 µs and 200 µs (inside the default
//! reactor spin of 500 µs), 2 ms and 20 ms (past it: sleeping polls), and 2 ms with
//! `CudaOptions::low_latency()` (polling for as long as anything is pending).
//!
//! CPU: the reactor thread's on-CPU time (`/proc/self/task/<tid>/schedstat`) while idle for
//! 1 s, and while 1,000 events wait behind 1 s kernels on 10 streams.
//!
//! `cargo bench --bench event_latency [-- --samples N]`. Runs on the GPU if there is one, else
//! on the simulated device (whose figures only check the plumbing).

use std::sync::mpsc;
use std::time::{Duration, Instant};

mod common;

use common::{now_ns, quantiles, Stamp, Stamped};
use streamalloc::{CudaOptions, Device, Event, SimConfig};

fn open(options: CudaOptions) -> Device {
    match Device::cuda_with(0, options) {
        Ok(d) => d,
        Err(why) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| eprintln!("no GPU ({why}): measuring the simulated device"));
            Device::simulated(SimConfig::default())
        }
    }
}

/// On-CPU nanoseconds of this process's thread named `name`.
fn thread_cpu_ns(name: &str) -> Option<u64> {
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let path = task.ok()?.path();
        let comm = std::fs::read_to_string(path.join("comm")).ok()?;
        if comm.trim() == name {
            let stat = std::fs::read_to_string(path.join("schedstat")).ok()?;
            return stat.split_whitespace().next()?.parse().ok();
        }
    }
    None
}

/// (to waker, to task) latencies in ns; negative when the task ran before the observer saw it.
fn latency(
    rt: &tokio::runtime::Runtime,
    device: &Device,
    kernel: Duration,
    samples: usize,
) -> (Vec<i64>, Vec<i64>) {
    let stream = device.create_stream().unwrap();
    let (to_observer, observer_rx) = mpsc::channel::<(Event, tokio::sync::oneshot::Sender<u64>)>();
    let observer = std::thread::spawn(move || {
        for (event, reply) in observer_rx {
            while !event.is_complete() {
                std::hint::spin_loop();
            }
            let _ = reply.send(now_ns());
        }
    });
    let task = rt.spawn(async move {
        let (mut to_waker, mut to_task) =
            (Vec::with_capacity(samples), Vec::with_capacity(samples));
        for i in 0..samples + 100 {
            stream.spin(kernel).unwrap();
            let ours = stream.record().unwrap();
            let theirs = stream.record().unwrap();
            let (tx, rx) = tokio::sync::oneshot::channel();
            to_observer.send((theirs, tx)).unwrap();
            let stamp = Stamp::new();
            Stamped::new(ours, stamp.clone()).await.unwrap();
            let resumed = now_ns();
            let reached = rx.await.unwrap();
            let woken = stamp.woken_at();
            if i >= 100 {
                // The first 100 samples are warm-up. A task that found its event complete on its
                // first poll was never woken: count that as zero reactor latency.
                to_waker.push(if woken == 0 {
                    0
                } else {
                    woken as i64 - reached as i64
                });
                to_task.push(resumed as i64 - reached as i64);
            }
        }
        (to_waker, to_task)
    });
    let result = rt.block_on(task).unwrap();
    observer.join().unwrap();
    result
}

fn cpu_while(device: &Device, f: impl FnOnce()) -> Option<f64> {
    let name = format!("sa-reactor-{}", device.id());
    let before = thread_cpu_ns(&name)?;
    let start = Instant::now();
    f();
    let elapsed = start.elapsed();
    let after = thread_cpu_ns(&name)?;
    Some((after - before) as f64 / 1e6 / elapsed.as_secs_f64())
}

fn main() {
    let samples: usize = std::env::args()
        .skip_while(|a| a != "--samples")
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let _ = now_ns();

    let probe = open(CudaOptions::default());
    println!("device: {probe}");
    let date = std::process::Command::new("date").arg("-u").output();
    println!(
        "date: {}",
        date.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default()
    );
    drop(probe);

    println!("\nwake latency after the event completed: median, p99, max (default CudaOptions: spin 500 µs, max sleep 1 ms)");
    println!(
        "{:<12} {:>8} {:>7}   {:^29}   {:^29}",
        "options", "kernel", "samples", "to waker (reactor)", "to task (reactor + tokio)"
    );
    let regimes = [
        ("default", CudaOptions::default(), 20, samples),
        ("default", CudaOptions::default(), 200, samples),
        ("default", CudaOptions::default(), 2_000, samples),
        (
            "default",
            CudaOptions::default(),
            20_000,
            (samples / 20).max(100),
        ),
        ("low_latency", CudaOptions::low_latency(), 2_000, samples),
    ];
    for (name, options, kernel_us, n) in regimes {
        let device = open(options);
        let kernel = Duration::from_micros(kernel_us);
        let (to_waker, to_task) = latency(&rt, &device, kernel, n);
        println!(
            "{:<12} {:>8?} {:>7}   {}   {}",
            name,
            kernel,
            n,
            quantiles(to_waker),
            quantiles(to_task)
        );
    }

    println!("\nreactor CPU use, ms of CPU per s of wall time");
    for (name, options) in [
        ("default", CudaOptions::default()),
        ("low_latency", CudaOptions::low_latency()),
    ] {
        let device = open(options);
        std::thread::sleep(Duration::from_millis(100));
        let idle = cpu_while(&device, || std::thread::sleep(Duration::from_secs(1)));
        let streams: Vec<_> = (0..10).map(|_| device.create_stream().unwrap()).collect();
        let pending = cpu_while(&device, || {
            rt.block_on(async {
                for stream in &streams {
                    stream.spin(Duration::from_secs(1)).unwrap();
                }
                let tasks: Vec<_> = (0..1000)
                    .map(|i| tokio::spawn(streams[i % 10].record().unwrap()))
                    .collect();
                // Measure the window where all 1,000 wait behind the kernels.
                tokio::time::sleep(Duration::from_millis(800)).await;
                tasks
            });
        });
        let show = |v: Option<f64>| v.map_or("n/a (no /proc)".to_owned(), |ms| format!("{ms:8.3}"));
        println!(
            "{name:<12} idle: {}   1,000 events pending: {}",
            show(idle),
            show(pending)
        );
        for stream in &streams {
            stream.synchronize_blocking().unwrap();
        }
    }
}
