//! Review coverage for `ArenaResource` and `PinnedHostResource`: driver failures midway (the
//! memory stays the arena's and the statistics stay right), sizes at the edges, and the cache
//! limits of the pinned resource. On the simulated device, with injected faults.

#[path = "common/mod.rs"]
mod common;

use std::time::Duration;

use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pinned::{PinnedHostOptions, PinnedHostResource};
use streamalloc::{Device, FaultKind, Faults, MemoryResource, SimConfig};

use common::{arena, assert_arena_all_back, check_arena, faulty, free};

const MIB: usize = 1 << 20;

/// A large free whose guard event cannot be recorded is refused and the block stays handed
/// out; freed again, it comes back.
#[test]
fn large_free_with_a_failed_record_keeps_the_block() {
    let (device, faults) = faulty();
    let a = arena(&device, 8 * MIB, 64 * MIB);
    let s = device.create_stream().unwrap();
    let p = a.allocate(3 * MIB, &s).unwrap();
    faults.fail_next(FaultKind::Record);
    // SAFETY: allocated above, unused.
    assert!(unsafe { a.deallocate(p, 3 * MIB, &s) }.is_err());
    assert_eq!(a.stats().in_use, 3 * MIB);
    check_arena(&a);
    free(&a, p, 3 * MIB, &s);
    s.synchronize_blocking().unwrap();
    assert_arena_all_back(&a, "large free after a failed record");
}

/// A remote free adopted when the wait on the freeing stream fails: the request fails, the
/// block stays pending, and the next request adopts it.
#[test]
fn adoption_with_a_failed_wait_loses_nothing() {
    let (device, faults) = faulty();
    let a = arena(&device, 4 * MIB, 4 * MIB);
    let (s, t) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    // Four superblocks, each wholly taken on `s`.
    let blocks: Vec<_> = (0..4).map(|_| a.allocate(MIB, &s).unwrap()).collect();
    t.wait(&s.record().unwrap()).unwrap();
    free(&a, blocks[0], MIB, &t);
    assert_eq!(a.stats().remote_frees_pending, 1);
    faults.fail_next(FaultKind::Wait);
    assert!(a.allocate(MIB, &s).is_err());
    let stats = a.stats();
    assert_eq!(stats.remote_frees_pending, 1, "{stats:?}");
    assert_eq!(stats.in_use, 3 * MIB, "{stats:?}");
    check_arena(&a);
    let again = a.allocate(MIB, &s).unwrap();
    assert_eq!(again, blocks[0]);
    free(&a, again, MIB, &s);
    for &p in &blocks[1..] {
        free(&a, p, MIB, &s);
    }
    s.synchronize_blocking().unwrap();
    t.synchronize_blocking().unwrap();
    assert_arena_all_back(&a, "adoption after a failed wait");
}

/// A defragmentation whose guard cannot be recorded keeps the superblocks with their stream,
/// and says none went back.
#[test]
fn defragment_with_a_failed_record_reports_what_went_back() {
    let (device, faults) = faulty();
    let a = arena(&device, 4 * MIB, 4 * MIB);
    let s = device.create_stream().unwrap();
    let p = a.allocate(1000, &s).unwrap();
    free(&a, p, 1000, &s);
    assert_eq!(a.stats().superblocks, 1);
    faults.fail_next(FaultKind::Record);
    let returned = a.defragment();
    let stats = a.stats();
    assert_eq!(stats.superblocks, 1, "{stats:?}");
    assert_eq!(
        returned, 0,
        "defragment said {returned} superblock(s) went back, none did: {stats:?}"
    );
    check_arena(&a);
    assert_eq!(a.defragment(), 1);
    s.synchronize_blocking().unwrap();
    assert_arena_all_back(&a, "defragment after a failed record");
}

/// Growth whose guard cannot be recorded gives the new chunk back: nothing reserved.
#[test]
fn growth_with_a_failed_record_reserves_nothing() {
    let (device, faults) = faulty();
    let a = arena(&device, 0, 64 * MIB);
    let s = device.create_stream().unwrap();
    faults.fail_next(FaultKind::Record);
    assert!(a.allocate(1000, &s).is_err());
    let stats = a.stats();
    assert_eq!((stats.reserved, stats.chunks), (0, 0), "{stats:?}");
    check_arena(&a);
    let p = a.allocate(1000, &s).unwrap();
    free(&a, p, 1000, &s);
    s.synchronize_blocking().unwrap();
    assert_arena_all_back(&a, "growth after a failed record");
}

/// A superblock taken from the global arena whose guard cannot be waited on goes back there.
#[test]
fn superblock_with_a_failed_guard_wait_goes_back() {
    let (device, faults) = faulty();
    let a = arena(&device, 4 * MIB, 4 * MIB);
    let (s, t) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let large = a.allocate(4 * MIB, &t).unwrap();
    t.spin(Duration::from_millis(300)).unwrap();
    free(&a, large, 4 * MIB, &t);
    faults.fail_next(FaultKind::Wait);
    assert!(a.allocate(1000, &s).is_err());
    let stats = a.stats();
    assert_eq!((stats.global_free, stats.in_use), (4 * MIB, 0), "{stats:?}");
    check_arena(&a);
    let p = a.allocate(1000, &s).unwrap();
    free(&a, p, 1000, &s);
    s.synchronize_blocking().unwrap();
    t.synchronize_blocking().unwrap();
    assert_arena_all_back(&a, "superblock after a failed wait");
}

/// A move of a partly used superblock whose event cannot be recorded moves nothing.
#[test]
fn superblock_move_with_a_failed_record_moves_nothing() {
    let (device, faults) = faulty();
    let a = arena(&device, MIB, MIB);
    let (s, t) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let kept = a.allocate(1000, &s).unwrap();
    faults.fail_next(FaultKind::Record);
    assert!(a.allocate(1000, &t).is_err());
    assert_eq!(a.stats().superblock_moves, 0);
    check_arena(&a);
    let moved = a.allocate(1000, &t).unwrap();
    assert_eq!(a.stats().superblock_moves, 1);
    free(&a, moved, 1000, &t);
    free(&a, kept, 1000, &s);
    s.synchronize_blocking().unwrap();
    t.synchronize_blocking().unwrap();
    assert_arena_all_back(&a, "move after a failed record");
}

/// A trim whose upstream free fails keeps the chunk, usable, and counted.
#[test]
fn trim_with_a_failed_free_keeps_the_chunk() {
    let (device, faults) = faulty();
    let a = arena(&device, 4 * MIB, 8 * MIB);
    let s = device.create_stream().unwrap();
    let p = a.allocate(1000, &s).unwrap();
    free(&a, p, 1000, &s);
    faults.fail_next(FaultKind::Free);
    assert!(a.trim_blocking().is_err());
    let stats = a.stats();
    assert_eq!(
        (stats.reserved, stats.chunks, stats.global_free),
        (4 * MIB, 1, 4 * MIB),
        "{stats:?}"
    );
    check_arena(&a);
    assert_eq!(a.trim_blocking().unwrap(), 4 * MIB);
    assert_eq!(a.stats().reserved, 0);
}

/// Sizes at the edges: zero, the superblock size and one past it, the maximum and past it,
/// sizes that overflow; wrong sizes and pointers are refused with an error, never a panic.
#[test]
fn sizes_at_the_edges() {
    let (device, _faults) = faulty();
    let a = arena(&device, 0, 8 * MIB);
    let s = device.create_stream().unwrap();
    let zero = a.allocate(0, &s).unwrap();
    free(&a, zero, 0, &s);
    for bytes in [usize::MAX, usize::MAX - 255, 8 * MIB + 1, 1 << 62] {
        assert!(a.allocate(bytes, &s).is_err(), "{bytes}");
    }
    let sb = a.allocate(MIB, &s).unwrap();
    let past = a.allocate(MIB + 1, &s).unwrap();
    let small = a.allocate(MIB - 1, &s).unwrap();
    // SAFETY: every free below is refused (wrong size or pointer), nothing is given back.
    unsafe {
        assert!(a.deallocate(sb, MIB + 1, &s).is_err());
        assert!(a.deallocate(past, MIB, &s).is_err());
        assert!(a.deallocate(past, usize::MAX, &s).is_err());
        assert!(a.deallocate(small, 512, &s).is_err());
        assert!(a.deallocate(sb, 0, &s).is_err());
        assert!(a
            .deallocate(streamalloc::DevicePtr(u64::MAX - 255), 256, &s)
            .is_err());
        assert!(a
            .deallocate(streamalloc::DevicePtr(sb.0 + 256), 256, &s)
            .is_err());
    }
    check_arena(&a);
    free(&a, sb, MIB, &s);
    // SAFETY: freed just above: refused.
    assert!(unsafe { a.deallocate(sb, MIB, &s) }.is_err());
    free(&a, past, MIB + 1, &s);
    // SAFETY: freed just above: refused.
    assert!(unsafe { a.deallocate(past, MIB + 1, &s) }.is_err());
    free(&a, small, MIB - 1, &s);
    let whole = a.allocate(8 * MIB, &s).unwrap();
    free(&a, whole, 8 * MIB, &s);
    s.synchronize_blocking().unwrap();
    assert_arena_all_back(&a, "edges");
}

/// The pinned cache keeps no more than its limit ready, and the rest goes to the driver.
#[test]
fn pinned_cache_respects_its_limit() {
    let (device, _faults) = faulty();
    let r = PinnedHostResource::with_options(
        &device,
        PinnedHostOptions {
            max_cached_bytes: 4096,
        },
    );
    let s = device.create_stream().unwrap();
    let blocks: Vec<_> = (0..8).map(|_| r.allocate(1024, &s).unwrap()).collect();
    for &p in &blocks {
        free(&r, p, 1024, &s);
    }
    s.synchronize_blocking().unwrap();
    assert!(common::eventually(Duration::from_secs(5), || r
        .stats()
        .pending_blocks
        == 0));
    let stats = r.stats();
    assert!(stats.cached_bytes <= 4096, "{stats:?}");
    assert_eq!(stats.cached_blocks + stats.retired_blocks, 8, "{stats:?}");
    r.release().unwrap();
    let stats = r.stats();
    assert_eq!((stats.cached_blocks, stats.retired_blocks), (0, 0));
}

/// Threads on their own streams allocate, write, and free on their own stream or on another
/// (after ordering it behind the write), while defragmentations and trims run: superblocks go
/// back, move between streams and chunks go upstream. The race detector refuses any write
/// to memory not ordered after its last use.
#[test]
fn concurrent_reuse_is_ordered() {
    use std::sync::Arc;
    let device = Device::simulated(SimConfig {
        race_detection: streamalloc::RaceDetection::Error,
        op_jitter: Duration::from_micros(50),
        ..SimConfig::default()
    });
    let a = Arc::new(
        ArenaResource::new(
            CudaResource::new(&device),
            ArenaOptions {
                initial: 0,
                maximum: Some(8 * MIB),
                superblock_size: 256 << 10,
            },
        )
        .unwrap(),
    );
    let streams: Arc<Vec<streamalloc::Stream>> =
        Arc::new((0..4).map(|_| device.create_stream().unwrap()).collect());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let janitor = {
        let (a, stop) = (a.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                a.defragment();
                let _ = a.trim_blocking();
                std::thread::sleep(Duration::from_micros(300));
            }
        })
    };
    let workers: Vec<_> = (0..4)
        .map(|me| {
            let (a, streams) = (a.clone(), streams.clone());
            std::thread::spawn(move || {
                let mut rng = common::SplitMix64(me as u64 + 1);
                let s = &streams[me];
                let mut held: Vec<(streamalloc::DevicePtr, usize)> = Vec::new();
                for _ in 0..1500 {
                    if held.len() < 12 && !rng.next().is_multiple_of(3) {
                        let bytes = if rng.next().is_multiple_of(5) {
                            (300 << 10) + (rng.next() % (700 << 10)) as usize
                        } else {
                            1 + (rng.next() % (200 << 10)) as usize
                        };
                        match a.allocate(bytes, s) {
                            Ok(p) => {
                                // SAFETY: just allocated on `s`, `bytes` long.
                                unsafe { s.memset_d8(p, me as u8, bytes) }
                                    .unwrap_or_else(|e| panic!("{e}\n{}", a.dump()));
                                held.push((p, bytes));
                            }
                            Err(e) => assert!(e.is_out_of_memory(), "{e}"),
                        }
                    } else if !held.is_empty() {
                        let (p, bytes) = held.swap_remove((rng.next() as usize) % held.len());
                        let on = &streams[(rng.next() as usize) % streams.len()];
                        if on.id() != s.id() {
                            on.wait(&s.record().unwrap()).unwrap();
                        }
                        free(&*a, p, bytes, on);
                    }
                }
                for (p, bytes) in held {
                    free(&*a, p, bytes, s);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    janitor.join().unwrap();
    for s in streams.iter() {
        s.synchronize_blocking().unwrap();
    }
    a.defragment();
    a.check_invariants().unwrap();
    let stats = a.stats();
    assert_eq!(stats.in_use, 0, "{stats:?}");
}

/// A free refused because its guard event could not be recorded leaves the block the
/// caller's: using it afterwards is no race, and freeing it again works.
#[test]
fn a_refused_large_free_leaves_the_block_usable() {
    let faults = Faults::new();
    let device = Device::simulated(SimConfig {
        faults: faults.clone(),
        race_detection: streamalloc::RaceDetection::Error,
        ..SimConfig::default()
    });
    let a = arena(&device, 8 * MIB, 8 * MIB);
    let (s, t) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let p = a.allocate(3 * MIB, &s).unwrap();
    // SAFETY: allocated above on `s`.
    unsafe { s.memset_d8(p, 1, 3 * MIB) }.unwrap();
    faults.fail_next(FaultKind::Record);
    // SAFETY: refused: nothing is freed.
    assert!(unsafe { a.deallocate(p, 3 * MIB, &s) }.is_err());
    // SAFETY: still ours.
    unsafe { s.memset_d8(p, 2, 3 * MIB) }.unwrap();
    free(&a, p, 3 * MIB, &s);
    // Reused on another stream after the real free: ordered by the arena.
    let q = a.allocate(3 * MIB, &t).unwrap();
    // SAFETY: allocated above on `t`.
    unsafe { t.memset_d8(q, 3, 3 * MIB) }.unwrap();
    free(&a, q, 3 * MIB, &t);
    s.synchronize_blocking().unwrap();
    t.synchronize_blocking().unwrap();
}

/// What a block freed from a thread-local destructor saw: `Ok`, the arena's error, or a panic.
static FREED_AT_EXIT: std::sync::Mutex<Option<Result<(), String>>> = std::sync::Mutex::new(None);

type Held = (
    std::sync::Arc<ArenaResource<CudaResource>>,
    streamalloc::DevicePtr,
    streamalloc::Stream,
);

/// Frees its block when the thread's locals are destroyed.
struct FreeAtExit(Option<Held>);

impl Drop for FreeAtExit {
    fn drop(&mut self) {
        let Some((a, p, s)) = self.0.take() else {
            return;
        };
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: allocated on `s` and unused; freed once.
            unsafe { a.deallocate(p, 1000, &s) }
        }));
        *FREED_AT_EXIT.lock().unwrap() = Some(match outcome {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("the free panicked".into()),
        });
    }
}

thread_local! {
    static HELD: std::cell::RefCell<FreeAtExit> = const { std::cell::RefCell::new(FreeAtExit(None)) };
}

/// A block freed by a thread-local destructor, after the arena's own thread-local cache is
/// gone (thread-locals are destroyed in the reverse order of their first use): the free works,
/// it does not panic.
#[test]
fn a_free_during_thread_teardown_does_not_panic() {
    let device = Device::simulated(SimConfig::default());
    let a = std::sync::Arc::new(arena(&device, 4 * MIB, 4 * MIB));
    let s = device.create_stream().unwrap();
    {
        let (a, s) = (a.clone(), s.clone());
        std::thread::spawn(move || {
            // First used before the arena's cache: destroyed after it.
            HELD.with(|_| {});
            let p = a.allocate(1000, &s).unwrap();
            HELD.with(|h| h.borrow_mut().0 = Some((a, p, s)));
        })
        .join()
        .unwrap();
    }
    let outcome = FREED_AT_EXIT.lock().unwrap().take();
    assert_eq!(outcome, Some(Ok(())));
    s.synchronize_blocking().unwrap();
    assert_arena_all_back(&a, "freed at thread exit");
}

/// A trim cancelled while it waits for the GPU puts its chunks back, free and usable; a trim
/// whose chunks a request at the maximum took back meanwhile gives back only what is still
/// its own.
#[test]
fn trim_cancelled_or_recalled_loses_nothing() {
    let device = Device::simulated(SimConfig::default());
    let a = arena(&device, 0, 4 * MIB);
    let (s, t) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let p = a.allocate(3 * MIB, &s).unwrap();
    s.spin(Duration::from_millis(300)).unwrap();
    free(&a, p, 3 * MIB, &s);
    let before = a.stats();
    common::poll_once_and_drop(a.trim());
    let after = a.stats();
    assert_eq!(
        (after.reserved, after.chunks, after.global_free),
        (before.reserved, before.chunks, before.global_free),
        "{after:?}"
    );
    check_arena(&a);

    let mut trim = std::pin::pin!(a.trim());
    assert!(common::poll_once(trim.as_mut()).is_pending());
    assert_eq!(a.stats().chunks, 0);
    // At the maximum only the trim's chunk can serve it: taken back, ordered after `s`.
    let q = a.allocate(2 * MIB, &t).unwrap();
    let released = futures::executor::block_on(trim).unwrap();
    assert_eq!(released, 0);
    free(&a, q, 2 * MIB, &t);
    s.synchronize_blocking().unwrap();
    t.synchronize_blocking().unwrap();
    assert_arena_all_back(&a, "trim cancelled or recalled");
    assert_eq!(a.trim_blocking().unwrap(), 3 * MIB);
    assert_eq!(a.stats().reserved, 0);
}
