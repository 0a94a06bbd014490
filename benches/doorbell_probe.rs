//! How fast can a parked host thread learn that a GPU event completed? The measurement behind
//! the reactor's design (see `src/reactor.rs`). GPU only; on the simulated device it says so.
//!
//! For kernels of several lengths L, an observer spins on `cuEventQuery` to timestamp when the
//! event completed; the latency of each mechanism is its timestamp minus the observer's:
//! - `hostfn-watcher`: `cuStreamWaitEvent(watcher, ev)` + `cuLaunchHostFunc(watcher)`, armed right
//!   after the record (what the reactor's doorbell does);
//! - `hostfn-inline`: `cuLaunchHostFunc` on the same stream right after the kernel;
//! - `blocking-sync`: a thread in `cuEventSynchronize` on an event made with
//!   `CU_EVENT_BLOCKING_SYNC`;
//! - `spin-sync`: a thread in `cuEventSynchronize` on a default event (the driver spins).

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys};
use streamalloc::Device;

static BASE: OnceLock<Instant> = OnceLock::new();

fn now_ns() -> u64 {
    BASE.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

unsafe extern "C" fn stamp(data: *mut c_void) {
    // SAFETY: `data` points to an AtomicU64 that outlives the host function (the sample waits).
    let slot = unsafe { &*(data as *const AtomicU64) };
    slot.store(now_ns(), Ordering::Release);
}

fn observe(event: sys::CUevent) -> u64 {
    // SAFETY: the event is live for the whole sample.
    while unsafe { result::event::query(event) }.is_err() {
        std::hint::spin_loop();
    }
    now_ns()
}

fn pct(mut v: Vec<i64>) -> String {
    v.sort();
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize] as f64 / 1000.0;
    format!("{:>9.1} {:>9.1} {:>9.1}", at(0.5), at(0.9), at(0.99))
}

fn main() {
    let device = match Device::cuda(0) {
        Ok(d) => d,
        Err(why) => {
            println!("doorbell_probe needs a GPU ({why}); nothing measured");
            return;
        }
    };
    let _ = now_ns();
    let stream = device.create_stream().unwrap();
    let raw = stream.cuda_stream().unwrap();
    let watcher = result::stream::create(result::stream::StreamKind::NonBlocking).unwrap();
    let plain = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).unwrap();
    let blocking = result::event::create(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC).unwrap();
    let samples = 300;
    // A thread that waits in cuEventSynchronize for the events it is sent.
    let ctx = result::ctx::get_current().unwrap().unwrap() as usize;
    let (to_sync, sync_rx) = std::sync::mpsc::channel::<usize>();
    let (sync_tx, from_sync) = std::sync::mpsc::channel::<u64>();
    std::thread::spawn(move || {
        // SAFETY: the primary context stays retained by `device` for the whole run.
        unsafe { result::ctx::set_current(ctx as sys::CUcontext) }.unwrap();
        for ev in sync_rx {
            // SAFETY: the event is live until the main thread has the reply.
            unsafe { result::event::synchronize(ev as sys::CUevent) }.unwrap();
            sync_tx.send(now_ns()).unwrap();
        }
    });
    println!(
        "device: {}; latency after the event completed, µs: median p90 p99 ({samples} samples)",
        device.name()
    );
    println!(
        "{:<16} {:>8} {:>29}",
        "mechanism", "kernel", "median       p90       p99"
    );
    for kernel in [20u64, 100, 500, 2000].map(Duration::from_micros) {
        let mut results: Vec<(&str, Vec<i64>)> = vec![
            ("hostfn-watcher", vec![]),
            ("hostfn-inline", vec![]),
            ("blocking-sync", vec![]),
            ("spin-sync", vec![]),
        ];
        for _ in 0..samples {
            for (name, v) in results.iter_mut() {
                let slot = AtomicU64::new(0);
                let slot_ptr = &slot as *const AtomicU64 as *mut c_void;
                stream.spin(kernel).unwrap();
                // SAFETY: every handle is live; `slot` outlives the host function, because the
                // sample waits for it before `slot` goes out of scope.
                unsafe {
                    match *name {
                        "hostfn-watcher" => {
                            result::event::record(plain, raw).unwrap();
                            result::stream::wait_event(
                                watcher,
                                plain,
                                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                            )
                            .unwrap();
                            result::stream::launch_host_function(watcher, stamp, slot_ptr).unwrap();
                        }
                        "hostfn-inline" => {
                            result::event::record(plain, raw).unwrap();
                            result::stream::launch_host_function(raw, stamp, slot_ptr).unwrap();
                        }
                        _ => {
                            let ev = if *name == "blocking-sync" {
                                blocking
                            } else {
                                plain
                            };
                            result::event::record(ev, raw).unwrap();
                        }
                    }
                }
                let t = match *name {
                    "blocking-sync" | "spin-sync" => {
                        let ev = if *name == "blocking-sync" {
                            blocking
                        } else {
                            plain
                        };
                        to_sync.send(ev as usize).unwrap();
                        let t0 = observe(ev);
                        let t1 = from_sync.recv().unwrap();
                        t1 as i64 - t0 as i64
                    }
                    _ => {
                        let t0 = observe(plain);
                        while slot.load(Ordering::Acquire) == 0 {
                            std::hint::spin_loop();
                        }
                        slot.load(Ordering::Acquire) as i64 - t0 as i64
                    }
                };
                v.push(t);
                stream.synchronize_blocking().unwrap();
                // SAFETY: the watcher is ours.
                unsafe { result::stream::synchronize(watcher) }.unwrap();
            }
        }
        for (name, v) in results {
            println!("{:<16} {:>8?} {}", name, kernel, pct(v));
        }
    }

    println!("\nspin kernel of 50 ms, host-measured (cuStreamSynchronize), 20 launches:");
    let mut lens = vec![];
    for _ in 0..20 {
        let start = Instant::now();
        stream.spin(Duration::from_millis(50)).unwrap();
        stream.synchronize_blocking().unwrap();
        lens.push(start.elapsed().as_micros());
    }
    println!("{lens:?} µs");
}
