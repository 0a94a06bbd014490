//! What mapping physical memory costs (issue 11): the driver calls an expandable pool makes to
//! grow, timed one by one, so that its growth policy can be chosen from figures. GPU only; on
//! the simulated device it says so.
//!
//! `cargo bench --bench vmm_probe`
//!
//! 1. One granule at a time, as the pool maps it (`cuMemCreate` of one granule, `cuMemMap`,
//!    `cuMemSetAccess`), then unmapped and released: the mean of each call over 256 granules.
//! 2. `cuMemSetAccess` once over N granules mapped one by one (N = 1, 4, 16, 64): whether
//!    access is cheaper given to many granules at once.
//! 3. One physical allocation of N granules (N = 1, 4, 16): create, map, access per MiB.
//! 4. T threads (T = 1, 2, 4) each mapping 64 granules one by one in ranges of their own: the
//!    wall time, to see whether the driver serializes growths of different threads.
//! 5. The same for `cuMemAlloc`, what `PoolResource` grows by (issue 10): T threads (T = 1, 2,
//!    4) each allocating 10 chunks of 20 MiB (about what a thread of `churn-4t` grown from
//!    256 MiB grows by), the wall time to the last allocated; then freed.
//!
//! `cargo bench --bench vmm_probe -- --help` says what it measures; it takes no flags, and an
//! unknown flag is an error.

use std::time::Instant;

use clap::Parser;
use cudarc::driver::{result, sys};
use streamalloc::Device;

fn ok(name: &str, r: sys::CUresult) {
    if let Err(e) = r.result() {
        panic!("{name}: {e:?}");
    }
}

fn properties(ordinal: i32) -> sys::CUmemAllocationProp {
    // SAFETY: an all-zero CUmemAllocationProp is valid plain data; the fields that matter are set.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = ordinal;
    prop
}

fn access(ordinal: i32) -> sys::CUmemAccessDesc {
    // SAFETY: an all-zero CUmemAccessDesc is valid plain data; both fields are set.
    let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
    desc.location = properties(ordinal).location;
    desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    desc
}

/// Time of one call, in µs.
fn timed(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64() * 1e6
}

struct Range {
    base: u64,
    size: usize,
}

impl Range {
    fn reserve(size: usize, granule: usize) -> Self {
        let mut base = 0;
        // SAFETY: the driver writes one pointer into `base`.
        ok("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut base, size, granule, 0, 0)
        });
        Range { base, size }
    }
}

impl Drop for Range {
    fn drop(&mut self) {
        // SAFETY: our reservation, everything in it unmapped by the probes.
        unsafe { sys::cuMemAddressFree(self.base, self.size) };
    }
}

/// Maps `bytes` at `addr` as one physical allocation (with access), returning the handle and
/// the µs of (create, map, access).
fn map(addr: u64, bytes: usize, ordinal: i32, with_access: bool) -> (u64, [f64; 3]) {
    let prop = properties(ordinal);
    let mut handle = 0;
    // SAFETY: `prop` is initialized; one handle is written.
    let c = timed(|| {
        ok("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut handle, bytes, &prop, 0)
        })
    });
    // SAFETY: `addr..addr + bytes` is reserved and unmapped; `handle` is `bytes` long.
    let m = timed(|| {
        ok("cuMemMap", unsafe {
            sys::cuMemMap(addr, bytes, 0, handle, 0)
        })
    });
    let desc = access(ordinal);
    let a = if with_access {
        // SAFETY: the range just mapped; one descriptor.
        timed(|| {
            ok("cuMemSetAccess", unsafe {
                sys::cuMemSetAccess(addr, bytes, &desc, 1)
            })
        })
    } else {
        0.0
    };
    (handle, [c, m, a])
}

/// Unmaps and releases; the µs of (unmap, release).
fn unmap(addr: u64, bytes: usize, handle: u64) -> [f64; 2] {
    // SAFETY: exactly one mapping of ours, unused.
    let u = timed(|| ok("cuMemUnmap", unsafe { sys::cuMemUnmap(addr, bytes) }));
    // SAFETY: its handle, released once.
    let r = timed(|| ok("cuMemRelease", unsafe { sys::cuMemRelease(handle) }));
    [u, r]
}

/// What mapping physical memory costs (issue 11): the driver calls an expandable pool makes to
/// grow, timed one by one. GPU only; on the simulated device it says so. No flags.
#[derive(Parser)]
#[command(name = "vmm_probe", bin_name = "vmm_probe")]
struct Args {
    /// Passed by `cargo bench` to a bench without the test harness; ignored.
    #[arg(long = "bench", hide = true)]
    _bench: bool,
}

fn main() {
    Args::parse();
    let device = match Device::cuda(0) {
        Ok(d) => d,
        Err(why) => {
            println!("vmm_probe needs a GPU ({why}); nothing measured");
            return;
        }
    };
    let ordinal = 0;
    let ctx = result::ctx::get_current().unwrap().unwrap() as usize;
    let mut granule = 0usize;
    let prop = properties(ordinal);
    // SAFETY: `prop` is initialized; one size_t is written.
    ok("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granule,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    });
    println!("device: {}; granule {} KiB", device.name(), granule >> 10);

    // 1. One granule at a time.
    let n = 256;
    let range = Range::reserve(n * granule, granule);
    let mut sums = [0.0; 5];
    let mut handles = Vec::new();
    for i in 0..n {
        let (h, t) = map(range.base + (i * granule) as u64, granule, ordinal, true);
        handles.push(h);
        for k in 0..3 {
            sums[k] += t[k];
        }
    }
    for (i, h) in handles.drain(..).enumerate() {
        let t = unmap(range.base + (i * granule) as u64, granule, h);
        sums[3] += t[0];
        sums[4] += t[1];
    }
    println!(
        "one granule at a time, mean of {n}, µs: create {:.1}, map {:.1}, access {:.1}; unmap {:.1}, release {:.1}",
        sums[0] / n as f64,
        sums[1] / n as f64,
        sums[2] / n as f64,
        sums[3] / n as f64,
        sums[4] / n as f64
    );

    // 2. Access given once over N granules mapped one by one.
    for count in [1usize, 4, 16, 64] {
        let rounds = 4;
        let (mut per_granule, mut access_total) = (0.0, 0.0);
        for _ in 0..rounds {
            let t0 = Instant::now();
            let mapped: Vec<u64> = (0..count)
                .map(|i| map(range.base + (i * granule) as u64, granule, ordinal, false).0)
                .collect();
            let desc = access(ordinal);
            // SAFETY: the granules just mapped; one descriptor.
            access_total += timed(|| {
                ok("cuMemSetAccess", unsafe {
                    sys::cuMemSetAccess(range.base, count * granule, &desc, 1)
                })
            });
            per_granule += t0.elapsed().as_secs_f64() * 1e6 / count as f64;
            for (i, h) in mapped.into_iter().enumerate() {
                unmap(range.base + (i * granule) as u64, granule, h);
            }
        }
        println!(
            "{count:>3} granules mapped one by one, access once: {:.1} µs per granule in all, the access {:.1} µs",
            per_granule / rounds as f64,
            access_total / rounds as f64
        );
    }

    // 3. One allocation of N granules.
    for count in [1usize, 4, 16, 64] {
        let rounds = 4;
        let mut t = [0.0; 3];
        for _ in 0..rounds {
            let (h, c) = map(range.base, count * granule, ordinal, true);
            for k in 0..3 {
                t[k] += c[k];
            }
            unmap(range.base, count * granule, h);
        }
        let per = |x: f64| x / rounds as f64;
        println!(
            "one allocation of {count:>3} granules, µs: create {:.1}, map {:.1}, access {:.1} ({:.1} per granule)",
            per(t[0]),
            per(t[1]),
            per(t[2]),
            per(t[0] + t[1] + t[2]) / count as f64
        );
    }
    drop(range);

    // 4. Threads growing at once, each in a range of its own.
    for threads in [1usize, 2, 4] {
        let per_thread = 64;
        let ranges: Vec<Range> = (0..threads)
            .map(|_| Range::reserve(per_thread * granule, granule))
            .collect();
        let barrier = std::sync::Barrier::new(threads);
        let wall = std::thread::scope(|s| {
            let t0 = Instant::now();
            let joins: Vec<_> = ranges
                .iter()
                .map(|r| {
                    let (base, barrier) = (r.base, &barrier);
                    s.spawn(move || {
                        // SAFETY: the primary context stays retained by `device` meanwhile.
                        unsafe { result::ctx::set_current(ctx as sys::CUcontext) }.unwrap();
                        barrier.wait();
                        let hs: Vec<u64> = (0..per_thread)
                            .map(|i| map(base + (i * granule) as u64, granule, ordinal, true).0)
                            .collect();
                        let mapped = Instant::now();
                        for (i, h) in hs.into_iter().enumerate() {
                            unmap(base + (i * granule) as u64, granule, h);
                        }
                        mapped
                    })
                })
                .collect();
            let last = joins.into_iter().map(|j| j.join().unwrap()).max().unwrap();
            last.saturating_duration_since(t0)
        });
        println!(
            "{threads} thread(s) mapping {per_thread} granules each at once: {:.2} ms to the last mapped ({:.1} µs per granule overall)",
            wall.as_secs_f64() * 1e3,
            wall.as_secs_f64() * 1e6 / (threads * per_thread) as f64
        );
    }

    // 5. Threads growing by `cuMemAlloc` at once (the pool's growth).
    for chunk_mib in [20usize, 80] {
        for threads in [1usize, 2, 4] {
            let (per_thread, rounds) = (200 / chunk_mib, 3);
            let mut walls = Vec::new();
            for _ in 0..rounds {
                let barrier = std::sync::Barrier::new(threads);
                let wall = std::thread::scope(|s| {
                    let t0 = Instant::now();
                    let joins: Vec<_> = (0..threads)
                        .map(|_| {
                            let barrier = &barrier;
                            s.spawn(move || {
                                // SAFETY: the primary context stays retained by `device`.
                                unsafe { result::ctx::set_current(ctx as sys::CUcontext) }.unwrap();
                                barrier.wait();
                                let ptrs: Vec<u64> = (0..per_thread)
                                    .map(|_| {
                                        let mut p = 0;
                                        // SAFETY: one pointer written.
                                        ok("cuMemAlloc", unsafe {
                                            sys::cuMemAlloc_v2(&mut p, chunk_mib << 20)
                                        });
                                        p
                                    })
                                    .collect();
                                let done = Instant::now();
                                for p in ptrs {
                                    // SAFETY: ours, unused, freed once.
                                    ok("cuMemFree", unsafe { sys::cuMemFree_v2(p) });
                                }
                                done
                            })
                        })
                        .collect();
                    let last = joins.into_iter().map(|j| j.join().unwrap()).max().unwrap();
                    last.saturating_duration_since(t0)
                });
                walls.push(wall.as_secs_f64() * 1e3);
            }
            let mib = (threads * per_thread * chunk_mib) as f64;
            let best = walls.iter().cloned().fold(f64::INFINITY, f64::min);
            println!(
                "{threads} thread(s) cuMemAlloc {per_thread} x {chunk_mib} MiB each at once: {} ms to the last allocated (best {best:.2}: {:.2} µs per MiB overall)",
                walls.iter().map(|w| format!("{w:.2}")).collect::<Vec<_>>().join(", "),
                best * 1e3 / mib
            );
        }
    }
}
