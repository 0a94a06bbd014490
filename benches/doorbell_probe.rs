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
//!
//! Then (issue 18) a host-visible flag: `cuStreamWriteValue32` into pinned, device-mapped host
//! memory, queued right after the event; a thread spins on the flag with plain loads while
//! another spins on `cuEventQuery`, and `writevalue-flag` is the flag's time minus the
//! query's. Last, what one poll costs the polling thread: `cuEventQuery` on a pending event
//! against a load of the flag.
//!
//! First, on any machine (issue 18): how late a timed sleep ends, as the predicting reactor
//! sleeps (`thread::park_timeout`, timer slack lowered to 1 ns), for sleeps of 20 µs to 20 ms.
//! The reactor sleeps towards a predicted completion in two stages, a coarse sleep ending 1 ms
//! early, then steps of at most 200 µs (`src/reactor/predict.rs`), on the premise that long
//! sleeps can end hundreds of µs late on a VM and short ones end nearly on time; this checks it.
//!
//! `cargo bench --bench doorbell_probe -- --help` lists its flag (`--no-sleeps`: skip the sleeps);
//! an unknown flag is an error.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use clap::Parser;
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

/// How late `park_timeout` ends for sleeps of several lengths, with the reactor's timer slack.
fn sleep_lateness() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_TIMERSLACK takes an unsigned long and changes only this thread's slack.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
    }
    println!("timed sleep lateness (park_timeout, timer slack 1 ns), µs: median p90 p99 max");
    for asked_us in [20u64, 100, 200, 1_000, 5_000, 20_000] {
        let asked = Duration::from_micros(asked_us);
        let n = (2_000_000 / asked_us).clamp(100, 2_000) as usize;
        let mut late: Vec<i64> = (0..n)
            .map(|_| {
                let start = Instant::now();
                // A spurious return (an unpark) is measured as early, never as late.
                std::thread::park_timeout(asked);
                start.elapsed().as_nanos() as i64 - asked.as_nanos() as i64
            })
            .collect();
        late.sort();
        let max = late[late.len() - 1] as f64 / 1000.0;
        println!(
            "  sleep {asked:>8?} {n:>5} samples {} {max:>9.1}",
            pct(late)
        );
    }
    println!();
}

/// How fast a parked host thread learns that a GPU event completed (the measurement behind the
/// reactor's design), after how late a timed sleep ends. GPU only, but for the sleeps; on the
/// simulated device it says so.
#[derive(Parser)]
#[command(name = "doorbell_probe", bin_name = "doorbell_probe")]
struct Args {
    /// Skips the first part, how late timed sleeps end (it runs on any machine).
    #[arg(long)]
    no_sleeps: bool,
    /// Passed by `cargo bench` to a bench without the test harness; ignored.
    #[arg(long = "bench", hide = true)]
    _bench: bool,
}

fn main() {
    let args = Args::parse();
    if !args.no_sleeps {
        sleep_lateness();
    }
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

    flag_probe(&stream, raw, plain, samples);

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

/// The host-visible flag: latency against `cuEventQuery`, and the cost of one poll of each.
fn flag_probe(
    stream: &streamalloc::Stream,
    raw: sys::CUstream,
    event: sys::CUevent,
    samples: usize,
) {
    println!("\nhost-visible flag (cuStreamWriteValue32_v2 into pinned device-mapped memory)");
    let ordinal = stream.device().ordinal().unwrap_or(0);
    let mut can = 0i32;
    // SAFETY: a plain attribute query into a local.
    let _ = unsafe {
        sys::cuDeviceGetAttribute(
            &mut can,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1,
            ordinal as i32,
        )
    };
    println!("CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1 = {can}");
    // SAFETY: a fresh pinned allocation of 64 bytes, freed at the end of this function.
    let host = match unsafe {
        result::malloc_host(
            64,
            sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
        )
    } {
        Ok(p) => p as *mut u32,
        Err(e) => {
            println!("cuMemHostAlloc failed ({e:?}): no flag figures");
            return;
        }
    };
    // SAFETY: `host` is 64 bytes, ours.
    unsafe { std::ptr::write_volatile(host, 0) };
    let mut dptr: sys::CUdeviceptr = 0;
    // SAFETY: `host` was allocated with DEVICEMAP.
    let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, host as *mut c_void, 0) };
    if mapped != sys::CUresult::CUDA_SUCCESS {
        println!("cuMemHostGetDevicePointer failed ({mapped:?}): no flag figures");
        return;
    }
    let host_addr = host as usize;
    let read = move || {
        // SAFETY: the allocation lives until this function frees it after every read.
        unsafe { std::ptr::read_volatile(host_addr as *const u32) }
    };
    // A thread that spins on cuEventQuery for each event it is sent and stamps.
    let ctx = result::ctx::get_current().unwrap().unwrap() as usize;
    let (to_query, query_rx) = std::sync::mpsc::channel::<usize>();
    let (query_tx, from_query) = std::sync::mpsc::channel::<u64>();
    let querier = std::thread::spawn(move || {
        // SAFETY: the primary context stays retained by the device for the whole run.
        unsafe { result::ctx::set_current(ctx as sys::CUcontext) }.unwrap();
        for ev in query_rx {
            query_tx.send(observe(ev as sys::CUevent)).unwrap();
        }
    });
    println!(
        "{:<16} {:>8} {:>29}",
        "mechanism", "kernel", "median       p90       p99"
    );
    let mut value = 0u32;
    let mut ok = true;
    'kernels: for kernel in [20u64, 200, 2000, 20000].map(Duration::from_micros) {
        let mut v = vec![];
        let n = if kernel.as_millis() >= 20 {
            samples / 3
        } else {
            samples
        };
        for _ in 0..n {
            value += 1;
            stream.spin(kernel).unwrap();
            // SAFETY: live handles; `dptr` maps our pinned block, which outlives the write
            // (the stream is synchronized below before anything is freed).
            let written = unsafe {
                result::event::record(event, raw).unwrap();
                sys::cuStreamWriteValue32_v2(raw, dptr, value, 0)
            };
            if written != sys::CUresult::CUDA_SUCCESS {
                println!("cuStreamWriteValue32_v2 failed ({written:?}): no flag figures");
                ok = false;
                stream.synchronize_blocking().unwrap();
                break 'kernels;
            }
            to_query.send(event as usize).unwrap();
            while read() != value {
                std::hint::spin_loop();
            }
            let seen = now_ns();
            let queried = from_query.recv().unwrap();
            v.push(seen as i64 - queried as i64);
            stream.synchronize_blocking().unwrap();
        }
        println!("{:<16} {:>8?} {}", "writevalue-flag", kernel, pct(v));
    }
    drop(to_query);
    querier.join().unwrap();
    if ok {
        // One poll's cost, on an event (and a flag) that stays pending for 50 ms.
        stream.spin(Duration::from_millis(50)).unwrap();
        // SAFETY: live handles.
        unsafe { result::event::record(event, raw) }.unwrap();
        let polls = 100_000;
        let start = Instant::now();
        let mut pending = 0;
        for _ in 0..polls {
            // SAFETY: the event is live.
            pending += usize::from(unsafe { result::event::query(event) }.is_err());
        }
        let query_ns = start.elapsed().as_nanos() as f64 / polls as f64;
        let start = Instant::now();
        let mut seen = 0u64;
        for _ in 0..polls {
            seen += u64::from(read());
        }
        let flag_ns = start.elapsed().as_nanos() as f64 / polls as f64;
        println!(
            "one poll: cuEventQuery {query_ns:.0} ns ({pending} of {polls} pending), flag load {flag_ns:.1} ns (sum {seen})"
        );
        stream.synchronize_blocking().unwrap();
        queue_costs(stream, raw, event, dptr);
    }
    // SAFETY: nothing queued writes the block any more (the stream is synchronized).
    let _ = unsafe { result::free_host(host as *mut c_void) };
}

/// What queuing each way of writing a completion word costs the host (issue 18's completion
/// words: the write follows every record), beside the record itself: 4,000 calls in each of 5
/// batches on an idle stream, synchronized every 1,000; the median batch. A way the driver
/// refuses is reported and skipped.
fn queue_costs(stream: &streamalloc::Stream, raw: sys::CUstream, event: sys::CUevent, dptr: u64) {
    println!("\nqueuing cost on the host, ns per call (median of 5 batches of 4,000)");
    let time = |name: &str, call: &mut dyn FnMut(u32) -> sys::CUresult| {
        let mut batches = vec![];
        for b in 0..5u32 {
            let start = Instant::now();
            for i in 0..4_000u32 {
                let r = call(b * 4_000 + i);
                if r != sys::CUresult::CUDA_SUCCESS {
                    stream.synchronize_blocking().unwrap();
                    return println!("  {name:<44} refused: {r:?}");
                }
                if i % 1_000 == 999 {
                    stream.synchronize_blocking().unwrap();
                }
            }
            batches.push(start.elapsed().as_nanos() as f64 / 4_000.0);
        }
        batches.sort_by(f64::total_cmp);
        println!("  {name:<44} {:>8.0}", batches[2]);
    };
    unsafe extern "C" fn nothing(_: *mut c_void) {}
    // SAFETY (each call below): live handles; `dptr` maps the caller's pinned block, which
    // outlives every write (the stream is synchronized before it is freed).
    time("cuEventRecord", &mut |_| unsafe {
        sys::cuEventRecord(event, raw)
    });
    time("cuStreamWriteValue32_v2 (barrier)", &mut |v| unsafe {
        sys::cuStreamWriteValue32_v2(raw, dptr, v, 0)
    });
    time("cuStreamWriteValue32_v2 (no barrier)", &mut |v| unsafe {
        sys::cuStreamWriteValue32_v2(
            raw,
            dptr,
            v,
            sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER as u32,
        )
    });
    time("cuMemsetD32Async (one word)", &mut |v| unsafe {
        sys::cuMemsetD32Async(dptr, v, 1, raw)
    });
    time("fill_u32 kernel (one word, Stream::fill_u32)", &mut |v| {
        // SAFETY: `dptr` is the caller's pinned word, mapped for the device.
        match unsafe { stream.fill_u32(streamalloc::DevicePtr(dptr), v, 1) } {
            Ok(()) => sys::CUresult::CUDA_SUCCESS,
            Err(_) => sys::CUresult::CUDA_ERROR_UNKNOWN,
        }
    });
    time("cuLaunchHostFunc (a no-op)", &mut |_| unsafe {
        sys::cuLaunchHostFunc(raw, Some(nothing), std::ptr::null_mut())
    });
}
