//! The pool's findings of the review (issue 19) and of RMM's tests (issue 20), each a test that
//! failed before its fix: a trim racing a grow, a request that fits but grew the pool, a request
//! for the whole pool refused at its maximum, streams kept alive by their lists, and the error
//! paths of cross-stream reuse, trims and releases under injected driver faults.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{check_pool, devices, faulty, free, label, pool, waiting_pool};
use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
use streamalloc::resource::callback::CallbackResource;
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{Device, DevicePtr, Error, FaultKind, Faults, MemoryResource, SimConfig, Stream};

const MIB: usize = 1 << 20;

/// Issue 19, finding 5: 2 contiguous MiB were free (1 MiB freed on `s` beside 1 MiB fresh), yet
/// the pool grew.
#[test]
fn a_request_that_fits_does_not_grow_the_pool() {
    for device in devices() {
        let pool = pool(&device, 2 * MIB, 64 * MIB);
        let s = device.create_stream().unwrap();
        let a = pool.allocate(MIB, &s).unwrap();
        free(&pool, a, MIB, &s);
        let b = pool.allocate(2 * MIB, &s).unwrap();
        let stats = pool.stats();
        assert_eq!(stats.grows, 0, "{}: {stats:?}", label(&device));
        assert_eq!(stats.reserved, 2 * MIB, "{}: {stats:?}", label(&device));
        free(&pool, b, 2 * MIB, &s);
        check_pool(&pool);
    }
}

/// Issue 20, finding 1 (the shape of RMM issue 2039): a pool at its maximum, every block free
/// but spread over two streams' lists, must serve a request for all of it at once.
#[test]
fn the_whole_pool_is_served_when_free_blocks_are_spread_over_streams() {
    for device in devices() {
        let pool = pool(&device, 0, 8 * MIB);
        let (a, b, c) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let blocks: Vec<DevicePtr> = (0..16)
            .map(|_| pool.allocate(MIB / 2, &a).unwrap())
            .collect();
        assert_eq!(pool.stats().reserved, 8 * MIB, "{}", label(&device));
        b.wait(&a.record().unwrap()).unwrap();
        for (i, p) in blocks.into_iter().enumerate() {
            free(&pool, p, MIB / 2, if i % 2 == 0 { &a } else { &b });
        }
        a.synchronize_blocking().unwrap();
        b.synchronize_blocking().unwrap();
        let all = pool
            .allocate(8 * MIB, &c)
            .unwrap_or_else(|e| panic!("{}: {e} ({:?})", label(&device), pool.stats()));
        check_pool(&pool);
        free(&pool, all, 8 * MIB, &c);
        c.synchronize_blocking().unwrap();
    }
}

/// Issue 20, finding 2: a stream per task, dropped after use, must not stay alive in the pool.
#[test]
fn dropped_streams_are_released_by_trim() {
    for device in devices() {
        let pool = pool(&device, 4 * MIB, 64 * MIB);
        let before = device.handle_count();
        for _ in 0..100 {
            let s = device.create_stream().unwrap();
            let p = pool.allocate(MIB, &s).unwrap();
            free(&pool, p, MIB, &s);
            s.synchronize_blocking().unwrap();
        }
        pool.trim_blocking().unwrap();
        let stats = pool.stats();
        assert_eq!(stats.streams, 0, "{}: {stats:?}", label(&device));
        assert_eq!(
            device.handle_count(),
            before,
            "{}: the pool keeps stream handles",
            label(&device)
        );
        assert_eq!(stats.in_use, 0, "{}: {stats:?}", label(&device));
        check_pool(&pool);
        // The folded memory serves any stream again.
        let s = device.create_stream().unwrap();
        let p = pool.allocate(4 * MIB, &s).unwrap();
        free(&pool, p, 4 * MIB, &s);
    }
}

/// Found by a review (fourteenth session): two resources that served one stream each took the
/// other's handle of it for the user's, so neither ever let go of a stream the user dropped: a
/// pool over a pool (whose growth takes memory upstream on the requesting stream, so the lower
/// pool serves that stream too), and a pool beside an arena.
#[test]
fn dropped_streams_are_released_when_two_resources_share_them() {
    for device in devices() {
        let inner = Arc::new(pool(&device, 0, 64 * MIB));
        let outer = PoolResource::new(
            inner.clone(),
            PoolOptions {
                initial: 0,
                maximum: Some(32 * MIB),
                ..PoolOptions::default()
            },
        )
        .unwrap();
        let arena =
            ArenaResource::new(CudaResource::new(&device), ArenaOptions::default()).unwrap();
        let before = device.handle_count();
        for _ in 0..20 {
            let s = device.create_stream().unwrap();
            // The outer pool holds nothing (trimmed below), so this grows it from the inner
            // pool on `s`.
            let p = outer.allocate(MIB, &s).unwrap();
            let q = arena.allocate(MIB, &s).unwrap();
            free(&outer, p, MIB, &s);
            free(&arena, q, MIB, &s);
            s.synchronize_blocking().unwrap();
            drop(s);
            outer.trim_blocking().unwrap();
            inner.trim_blocking().unwrap();
            arena.trim_blocking().unwrap();
        }
        let (o, i, a) = (outer.stats(), inner.stats(), arena.stats());
        let name = label(&device);
        assert_eq!(
            o.streams, 0,
            "{name}: the outer pool keeps dropped streams: {o:?}"
        );
        // The one left is the outer pool's own, alive: it gives its chunks back on it.
        assert!(
            i.streams <= 1,
            "{name}: the inner pool keeps dropped streams: {i:?}"
        );
        assert_eq!(
            a.streams, 0,
            "{name}: the arena keeps dropped streams: {a:?}"
        );
        assert_eq!(device.handle_count(), before, "{name}: stream handles kept");
        check_pool(&outer);
        check_pool(&inner);
    }
}

/// An upstream of fake addresses that reuses a freed address at once (as `cuMemAlloc` may) and
/// then takes 200 ms to return from its deallocate.
fn slow_reusing_upstream(device: &Device) -> CallbackResource {
    /// The next fresh base, and the bases given back.
    type Ranges = Arc<Mutex<(u64, Vec<u64>)>>;
    let ranges: Ranges = Arc::new(Mutex::new((1 << 40, Vec::new())));
    let (ra, rd) = (ranges.clone(), ranges);
    // SAFETY: the addresses are made up, and nothing in these tests touches the memory: only
    // the pool's bookkeeping of it is under test.
    unsafe {
        CallbackResource::new(
            device,
            move |bytes, _| {
                let mut r = ra.lock().unwrap();
                // Bases 1 GiB apart, so a freed base can be handed out again for any size.
                assert!(bytes <= 1 << 30);
                if let Some(base) = r.1.pop() {
                    return Ok(DevicePtr(base));
                }
                let base = r.0;
                r.0 += 1 << 30;
                Ok(DevicePtr(base))
            },
            move |ptr, _, _| {
                rd.lock().unwrap().1.push(ptr.0);
                std::thread::sleep(Duration::from_millis(200));
                Ok(())
            },
        )
    }
}

/// Issue 19, finding 2: the trim unregistered its chunk only after the upstream returned, by
/// when a concurrent grow had registered the same (reused) address: the live chunk was deleted.
#[test]
fn a_trim_racing_a_grow_keeps_the_new_chunk() {
    let device = Device::simulated(SimConfig::default());
    let pool = PoolResource::new(
        slow_reusing_upstream(&device),
        PoolOptions {
            initial: MIB,
            maximum: Some(64 * MIB),
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let s = device.create_stream().unwrap();
    let block = std::thread::scope(|scope| {
        let trim = scope.spawn(|| pool.trim_blocking());
        std::thread::sleep(Duration::from_millis(50)); // inside the upstream's deallocate
        let block = pool.allocate(MIB, &s).unwrap();
        assert_eq!(trim.join().unwrap().unwrap(), MIB);
        block
    });
    let stats = pool.stats();
    assert_eq!(stats.chunks, 1, "{stats:?}");
    assert_eq!(stats.free + stats.in_use, stats.reserved, "{stats:?}");
    free(&pool, block, MIB, &s);
    check_pool(&pool);
}

/// A cross-stream reuse whose ordering fails returns the error and loses nothing; the next try
/// reuses the block.
#[test]
fn a_failed_cross_stream_ordering_loses_nothing() {
    let (device, faults) = faulty();
    let pool = waiting_pool(&device, MIB, 64 * MIB);
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let p = pool.allocate(MIB, &a).unwrap();
    free(&pool, p, MIB, &a);
    faults.fail_next(FaultKind::Record);
    let err = pool.allocate(MIB, &b).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Driver {
                call: "cuEventRecord",
                ..
            }
        ),
        "{err}"
    );
    let stats = pool.stats();
    assert_eq!(
        (stats.free, stats.in_use, stats.grows),
        (MIB, 0, 0),
        "{stats:?}"
    );
    check_pool(&pool);
    let p = pool.allocate(MIB, &b).unwrap();
    assert_eq!(pool.stats().stream_waits, 1);
    free(&pool, p, MIB, &b);
}

/// Opportunistic reuse: memory freed on a stream whose work has all finished is reused on
/// another with no wait on the GPU (one stream query instead of a record and a wait); with the
/// option off, the same reuse waits.
#[test]
fn memory_of_an_idle_stream_is_reused_without_a_wait() {
    for device in devices() {
        for opportunistic in [true, false] {
            let pool = match opportunistic {
                true => pool(&device, MIB, 64 * MIB),
                false => waiting_pool(&device, MIB, 64 * MIB),
            };
            let (a, b) = (
                device.create_stream().unwrap(),
                device.create_stream().unwrap(),
            );
            let p = pool.allocate(MIB, &a).unwrap();
            free(&pool, p, MIB, &a);
            a.synchronize_blocking().unwrap();
            let q = pool.allocate(MIB, &b).unwrap();
            assert_eq!(q, p, "{}", label(&device));
            let stats = pool.stats();
            let expected = match opportunistic {
                true => (0, 1),
                false => (1, 0),
            };
            assert_eq!(
                (stats.stream_waits, stats.idle_reuses),
                expected,
                "{} opportunistic {opportunistic}: {stats:?}",
                label(&device)
            );
            free(&pool, q, MIB, &b);
            check_pool(&pool);
        }
    }
}

/// A stream query that fails counts as a busy stream: the reuse is ordered by a wait instead,
/// and nothing fails.
#[test]
fn a_failed_stream_query_is_taken_as_busy() {
    let (device, faults) = faulty();
    let pool = pool(&device, MIB, 64 * MIB);
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let p = pool.allocate(MIB, &a).unwrap();
    free(&pool, p, MIB, &a);
    a.synchronize_blocking().unwrap();
    faults.fail_next(FaultKind::Query);
    let q = pool.allocate(MIB, &b).unwrap();
    assert_eq!(faults.injected(FaultKind::Query), 1);
    let stats = pool.stats();
    assert_eq!((stats.stream_waits, stats.idle_reuses), (1, 0), "{stats:?}");
    free(&pool, q, MIB, &b);
    check_pool(&pool);
}

/// Issue 19: a failed synchronization in `trim` stranded the chunks it had taken out. Since
/// a failed stream no longer fails the trim (`tests/trim_failed_stream.rs`), the chunk is
/// kept in the pool, free, and the trim returns `Ok(0)`.
#[test]
fn a_failed_trim_puts_its_chunks_back() {
    let (device, faults) = faulty();
    let pool = pool(&device, 0, 64 * MIB);
    let a = device.create_stream().unwrap();
    let p = pool.allocate(2 * MIB, &a).unwrap();
    free(&pool, p, 2 * MIB, &a);
    faults.fail_next(FaultKind::Synchronize);
    assert_eq!(pool.trim_blocking().unwrap(), 0);
    assert_eq!(faults.injected(FaultKind::Synchronize), 1);
    let stats = pool.stats();
    assert_eq!(
        (stats.free, stats.reserved),
        (2 * MIB, 2 * MIB),
        "{stats:?}"
    );
    check_pool(&pool);
    assert_eq!(pool.trim_blocking().unwrap(), 2 * MIB);
    assert_eq!(pool.stats().reserved, 0);
}

/// Issue 19: at its maximum the pool returns free chunks to grow one large enough; when the
/// upstream's free fails, the chunk must stay with the stream it was freed on (reuse elsewhere
/// still ordered after that stream), not become fresh memory any stream takes at once.
#[test]
fn a_failed_release_at_the_maximum_keeps_stream_order() {
    let (device, faults) = faulty();
    let pool = waiting_pool(&device, 0, 4 * MIB);
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let x = pool.allocate(2 * MIB, &a).unwrap();
    let y = pool.allocate(2 * MIB, &a).unwrap();
    assert_eq!(pool.stats().chunks, 2);
    free(&pool, x, 2 * MIB, &a);
    free(&pool, y, 2 * MIB, &a);
    faults.fail_always(FaultKind::Free);
    let err = pool.allocate(4 * MIB, &a).unwrap_err();
    faults.clear();
    assert!(
        matches!(err, Error::OutOfMemory { .. } | Error::Driver { .. }),
        "{err}"
    );
    let stats = pool.stats();
    assert_eq!(
        (stats.free, stats.reserved),
        (4 * MIB, 4 * MIB),
        "{stats:?}"
    );
    check_pool(&pool);
    let waits = stats.stream_waits;
    let p = pool.allocate(2 * MIB, &b).unwrap();
    assert_eq!(pool.stats().stream_waits, waits + 1, "{:?}", pool.stats());
    free(&pool, p, 2 * MIB, &b);
    // And once the faults stop, the whole request is served.
    b.synchronize_blocking().unwrap();
    let all = pool.allocate(4 * MIB, &a).unwrap();
    free(&pool, all, 4 * MIB, &a);
}

/// `PoolStats` counts bytes in use and their peak.
#[test]
fn stats_count_bytes_in_use() {
    for device in devices() {
        let pool = pool(&device, 8 * MIB, 64 * MIB);
        let s = device.create_stream().unwrap();
        let blocks: Vec<DevicePtr> = (0..6).map(|_| pool.allocate(MIB, &s).unwrap()).collect();
        assert_eq!(pool.stats().in_use, 6 * MIB, "{}", label(&device));
        for p in blocks {
            free(&pool, p, MIB, &s);
        }
        let stats = pool.stats();
        assert_eq!(stats.in_use, 0, "{}: {stats:?}", label(&device));
        assert_eq!(stats.peak_in_use, 6 * MIB, "{}: {stats:?}", label(&device));
    }
}

/// Issue 10, in the style of the RMM 2489 test: two neighbours freed on two streams that are
/// still alive (one of them still writing its block) coalesce into one free block, which can
/// serve a request for both only after ordering the requesting stream after both: the request's
/// own write must land after the last write of the freeing stream.
#[test]
fn memory_coalesced_across_live_streams_is_reused_in_stream_order() {
    for device in devices() {
        let pool = pool(&device, 2 * MIB, 2 * MIB);
        let (a, b, c) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let x = pool.allocate(MIB, &a).unwrap();
        let y = pool.allocate(MIB, &b).unwrap();
        assert_eq!(y.0, x.0 + MIB as u64, "{}: the two halves", label(&device));
        // The last use of `x` on `a` runs late: a spin, then a write of ones.
        a.spin(Duration::from_millis(150)).unwrap();
        // SAFETY: `x` is 1 MiB of live memory until its free below, queued after this on `a`.
        unsafe { a.fill_u32(x, 1, MIB / 4) }.unwrap();
        free(&pool, x, MIB, &a);
        free(&pool, y, MIB, &b);
        // Only both halves together serve this: one block, freed on `a` and on `b`. `a` is
        // busy (its spin), so `c` waits for it on the GPU; `b` may be idle by now, and then
        // needs no wait (opportunistic reuse); so may `a`, on a host slower than the spin.
        let before = pool.stats();
        let z = pool.allocate(2 * MIB, &c).unwrap();
        assert_eq!(z, x, "{}", label(&device));
        let after = pool.stats();
        assert!(
            after.stream_waits + after.idle_reuses == before.stream_waits + before.idle_reuses + 2,
            "{}: {after:?}",
            label(&device),
        );
        // SAFETY: `z` is 2 MiB of live memory, ours on `c`.
        unsafe { c.fill_u32(z, 2, 2 * MIB / 4) }.unwrap();
        a.synchronize_blocking().unwrap();
        let words = common::read_u32(&c, z, 2 * MIB / 4);
        let stale = words.iter().filter(|&&w| w != 2).count();
        assert_eq!(
            stale,
            0,
            "{}: {stale} words of the coalesced block were overwritten by `a`'s last use",
            label(&device)
        );
        free(&pool, z, 2 * MIB, &c);
        c.synchronize_blocking().unwrap();
    }
}

/// Issue 10: random allocations and frees over three streams (frees on another stream after
/// ordering it behind the first, as a hand-off does), in a pool small enough that cross-stream
/// waits, growth and give-backs at the maximum all happen; the
/// invariant checker after every operation, and every byte accounted for.
#[test]
fn random_hand_offs_in_a_small_pool_keep_the_invariants_at_every_step() {
    for device in devices() {
        let pool = pool(&device, 2 * MIB, 48 * MIB);
        let streams: Vec<Stream> = (0..3).map(|_| device.create_stream().unwrap()).collect();
        let mut rng = common::SplitMix64(7);
        let mut live: Vec<(DevicePtr, usize)> = Vec::new();
        let (mut live_bytes, mut refused) = (0, 0);
        for step in 0..3000 {
            let r = rng.next();
            let size = 256 + (rng.next() % (3 * MIB as u64)) as usize;
            let s = (rng.next() % 3) as usize;
            if live.is_empty() || (!r.is_multiple_of(3) && live_bytes + size <= 32 * MIB) {
                match pool.allocate(size, &streams[s]) {
                    Ok(p) => {
                        live.push((p, size));
                        live_bytes += size;
                    }
                    // Free bytes spread over chunks can be too fragmented for a request; the
                    // error must then say what could have been served, less than asked.
                    Err(Error::OutOfMemory {
                        requested,
                        available,
                        ..
                    }) => {
                        refused += 1;
                        assert!(
                            available < requested,
                            "{} step {step}: refused {requested} with {available} available",
                            label(&device)
                        );
                    }
                    Err(e) => panic!("{} step {step}: {e}", label(&device)),
                }
            } else {
                let (p, size) = live.swap_remove((r >> 8) as usize % live.len());
                // Freed on stream `s`, after ordering `s` behind every stream (the block may
                // have been used on any of them).
                for t in 0..3 {
                    if t != s {
                        streams[s].wait(&streams[t].record().unwrap()).unwrap();
                    }
                }
                free(&pool, p, size, &streams[s]);
                live_bytes -= size;
            }
            check_pool(&pool);
            let stats = pool.stats();
            assert_eq!(
                stats.free + stats.in_use,
                stats.reserved,
                "{} step {step}: {stats:?}",
                label(&device)
            );
        }
        for (p, size) in live {
            free(&pool, p, size, &streams[0]);
        }
        let stats = pool.stats();
        assert!(stats.stream_waits + stats.idle_reuses > 0, "{stats:?}");
        assert!(
            refused < 300,
            "{}: {refused} of 3000 refused",
            label(&device)
        );
        assert_eq!((stats.in_use, stats.free), (0, stats.reserved), "{stats:?}");
        check_pool(&pool);
    }
}

/// Review finding: a failed synchronization of one dropped stream in `trim` dropped the blocks
/// of every other dropped stream it had taken out. Since a failed stream no longer fails the
/// trim (`tests/trim_failed_stream.rs`), the one whose synchronization failed is let go of
/// too (it is idle), and everything goes upstream, counted.
#[test]
fn a_failed_trim_of_dropped_streams_loses_nothing() {
    let (device, faults) = faulty();
    let pool = pool(&device, 0, 64 * MIB);
    let streams: Vec<Stream> = (0..2).map(|_| device.create_stream().unwrap()).collect();
    let blocks: Vec<DevicePtr> = streams
        .iter()
        .map(|s| pool.allocate(2 * MIB, s).unwrap())
        .collect();
    for (s, p) in streams.iter().zip(blocks) {
        free(&pool, p, 2 * MIB, s);
    }
    drop(streams);
    let before = pool.stats();
    assert_eq!((before.free, before.streams), (4 * MIB, 2), "{before:?}");
    faults.fail_next(FaultKind::Synchronize);
    assert_eq!(pool.trim_blocking().unwrap(), 4 * MIB);
    assert_eq!(faults.injected(FaultKind::Synchronize), 1);
    let after = pool.stats();
    assert_eq!((after.reserved, after.streams), (0, 0), "{after:?}");
    check_pool(&pool);
    assert_eq!(pool.trim_blocking().unwrap(), 0);
}

/// Review finding: the peak in use never exceeds what the pool ever held, and counts a peak
/// that `stats` did not see once its stream's count was shared.
#[test]
fn the_peak_in_use_is_bounded_by_the_peak_reserved() {
    for device in devices() {
        let pool = pool(&device, 64 * MIB, 256 * MIB);
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let blocks: Vec<DevicePtr> = (0..20).map(|_| pool.allocate(MIB, &a).unwrap()).collect();
        for p in blocks {
            free(&pool, p, MIB, &b);
        }
        let stats = pool.stats();
        assert_eq!(stats.in_use, 0, "{}: {stats:?}", label(&device));
        assert!(
            stats.peak_in_use >= 16 * MIB && stats.peak_in_use <= stats.peak_reserved,
            "{}: {stats:?}",
            label(&device)
        );
    }
}

/// Issue 16 (the pinned staging block that compute-sanitizer found leaked at exit): a thread's
/// cache of free lists kept the lists' streams, and so their devices, alive for as long as the
/// thread lived, after the pool and the device were dropped: a device never dropped never
/// frees its staging memory. Dropping the pool must let go of every stream it held.
#[test]
fn a_dropped_pool_lets_go_of_its_streams() {
    for device in devices() {
        let before = device.handle_count();
        {
            let pool = pool(&device, 4 * MIB, 64 * MIB);
            let s = device.create_stream().unwrap();
            let p = pool.allocate(MIB, &s).unwrap();
            free(&pool, p, MIB, &s);
            s.synchronize_blocking().unwrap();
        }
        assert_eq!(
            device.handle_count(),
            before,
            "{}: a dropped pool keeps its streams",
            label(&device)
        );
    }
}

/// The same for lists retired by `trim` while another thread, still alive, has them cached.
#[test]
fn streams_retired_by_trim_go_even_if_another_thread_cached_them() {
    for device in devices() {
        let pool = pool(&device, 4 * MIB, 64 * MIB);
        let before = device.handle_count();
        let (done, wait) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|scope| {
            let (pool, device) = (&pool, &device);
            let worker = scope.spawn(move || {
                for _ in 0..8 {
                    let s = device.create_stream().unwrap();
                    let p = pool.allocate(MIB, &s).unwrap();
                    free(pool, p, MIB, &s);
                    s.synchronize_blocking().unwrap();
                }
                // Stays alive, its cache full of lists, until the checks are done.
                wait.recv().ok();
            });
            // The worker's streams are dropped once its loop is over; trim folds their lists.
            while pool.stats().streams < 8 && !worker.is_finished() {
                std::thread::yield_now();
            }
            std::thread::sleep(Duration::from_millis(20));
            pool.trim_blocking().unwrap();
            let stats = pool.stats();
            let handles = device.handle_count();
            done.send(()).unwrap();
            assert_eq!(stats.streams, 0, "{}: {stats:?}", label(device));
            assert_eq!(
                handles,
                before,
                "{}: retired lists cached by a live thread keep their streams",
                label(device)
            );
        });
    }
}

/// A later review: a pool at its maximum refused a request with a free block of exactly its
/// size, because that block was ninth in its size class behind eight smaller ones and no
/// larger class held a block (the size index looked at eight). The request is served, with
/// that block, and an awaited request the same.
#[test]
fn a_fit_ninth_in_its_size_class_is_found_at_the_maximum() {
    let rt = common::runtime();
    for device in devices() {
        let pool = pool(&device, 4 * MIB, 4 * MIB);
        let s = device.create_stream().unwrap();
        let unit = 256;
        let want = 1055 * unit; // above the small-block cache's sizes
        let filler = 1024 * unit; // the same size class, smaller
        let target = pool.allocate(want, &s).unwrap();
        // Blocks of one unit between the others keep them apart when freed.
        let mut apart = vec![pool.allocate(unit, &s).unwrap()];
        let mut fillers = Vec::new();
        for _ in 0..8 {
            fillers.push(pool.allocate(filler, &s).unwrap());
            apart.push(pool.allocate(unit, &s).unwrap());
        }
        let rest = 4 * MIB - want - 8 * filler - 9 * unit;
        let tail = pool.allocate(rest, &s).unwrap();
        assert_eq!(
            pool.stats().free,
            0,
            "{}: {:?}",
            label(&device),
            pool.stats()
        );
        // The fit first, then the eight: the fit ends up last in its class.
        free(&pool, target, want, &s);
        for &f in &fillers {
            free(&pool, f, filler, &s);
        }
        let p = pool
            .allocate(want, &s)
            .unwrap_or_else(|e| panic!("{}: {e}", label(&device)));
        assert_eq!(p, target, "{}", label(&device));
        free(&pool, p, want, &s);
        let p = rt
            .block_on(async {
                use streamalloc::AllocateAsync;
                tokio::time::timeout(Duration::from_secs(10), pool.allocate_async(want, &s)).await
            })
            .expect("an awaited request that fits waited")
            .unwrap();
        free(&pool, p, want, &s);
        for a in apart {
            free(&pool, a, unit, &s);
        }
        free(&pool, tail, rest, &s);
        check_pool(&pool);
        assert_eq!(pool.stats().in_use, 0, "{}", label(&device));
        s.synchronize_blocking().unwrap();
    }
}

/// A later review: a cross-stream reuse whose ordering fails hands nothing out, and the pool's
/// peak in use (exact on one thread) must not count the block it never handed out.
#[test]
fn a_failed_ordering_does_not_raise_the_peak_in_use() {
    let faults = Faults::new();
    let device = Device::simulated(SimConfig {
        faults: faults.clone(),
        ..SimConfig::default()
    });
    let pool = PoolResource::new(
        streamalloc::resource::cuda::CudaResource::new(&device),
        PoolOptions {
            initial: 2 * MIB,
            maximum: Some(2 * MIB),
            opportunistic_reuse: false,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let y = pool.allocate(MIB, &a).unwrap();
    free(&pool, y, MIB, &a);
    // The same memory again on `a`; the other half is tagged `a` too.
    let x = pool.allocate(MIB, &a).unwrap();
    assert_eq!((x, pool.stats().peak_in_use), (y, MIB));
    faults.fail_next(FaultKind::Record);
    assert!(pool.allocate(MIB, &b).is_err(), "the ordering was to fail");
    let stats = pool.stats();
    assert_eq!((stats.in_use, stats.peak_in_use), (MIB, MIB), "{stats:?}");
    // The block went back: `b` takes it once the ordering can be made.
    let z = pool.allocate(MIB, &b).unwrap();
    assert_eq!(pool.stats().peak_in_use, 2 * MIB);
    free(&pool, x, MIB, &a);
    free(&pool, z, MIB, &b);
    check_pool(&pool);
    a.synchronize_blocking().unwrap();
    b.synchronize_blocking().unwrap();
}

/// A pool and an arena made with no maximum on a device whose memory is not a multiple of 256
/// bytes (a simulated device can be made with any size): the default maximum is the device's
/// memory rounded down, not an `InvalidSize` error blaming a maximum the user never gave
/// (found through `streamalloc-replay --sim-memory 1000`).
#[test]
fn a_device_of_odd_size_gives_a_default_maximum() {
    use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
    use streamalloc::resource::cuda::CudaResource;
    let device = Device::simulated(SimConfig {
        total_memory: 64 * MIB + 1000,
        ..SimConfig::default()
    });
    let pool = PoolResource::new(CudaResource::new(&device), PoolOptions::default())
        .expect("a pool with the default maximum");
    let s = device.create_stream().unwrap();
    let p = pool.allocate(4096, &s).unwrap();
    free(&pool, p, 4096, &s);
    drop(pool);
    let arena = ArenaResource::new(CudaResource::new(&device), ArenaOptions::default())
        .expect("an arena with the default maximum");
    let p = arena.allocate(4096, &s).unwrap();
    free(&arena, p, 4096, &s);
}

/// A request the upstream can serve, over an upstream with less room than the growth's step:
/// the step is halved down to the request itself. It stopped once half the step fell below
/// the request (2 MiB, then 1 MiB, for 1.25 MiB over a limit of 1.5 MiB: refused, with
/// `available` 1.5 MiB in the error, and an awaited request waited for ever: a review's
/// finding). The pool and the arena, plain and awaited, and a pool over a nearly full pool.
#[test]
fn a_growth_halves_down_to_the_request_itself() {
    use streamalloc::resource::adaptor::LimitingAdaptor;
    use streamalloc::AllocateAsync;
    let want = 5 * MIB / 4;
    for device in devices() {
        let what = label(&device);
        let s = device.create_stream().unwrap();
        let limited = || LimitingAdaptor::new(CudaResource::new(&device), 3 * MIB / 2);
        let pool = PoolResource::new(limited(), PoolOptions::default()).unwrap();
        let arena = ArenaResource::new(limited(), ArenaOptions::default()).unwrap();
        let resources: [(&str, &dyn MemoryResource); 2] = [("pool", &pool), ("arena", &arena)];
        for (name, r) in resources {
            let p = r
                .allocate(want, &s)
                .unwrap_or_else(|e| panic!("{what} {name}: the upstream had room: {e}"));
            free(r, p, want, &s);
        }
        let pool = PoolResource::new(limited(), PoolOptions::default()).unwrap();
        let awaited = futures::executor::block_on(
            pool.allocate_async(want, &s)
                .timeout(Duration::from_secs(2)),
        );
        let p = awaited.unwrap_or_else(|e| panic!("{what}: awaited: {e}"));
        free(&pool, p, want, &s);
        // Over a pool at its maximum of 4 MiB with 1.5 MiB of room.
        let inner = Arc::new(
            PoolResource::new(
                CudaResource::new(&device),
                PoolOptions {
                    maximum: Some(4 * MIB),
                    ..PoolOptions::default()
                },
            )
            .unwrap(),
        );
        let held = inner.allocate(5 * MIB / 2, &s).unwrap();
        let outer = PoolResource::new(inner.clone(), PoolOptions::default()).unwrap();
        let p = outer
            .allocate(want, &s)
            .unwrap_or_else(|e| panic!("{what}: refused while the inner pool had room: {e}"));
        free(&outer, p, want, &s);
        drop(outer);
        free(&*inner, held, 5 * MIB / 2, &s);
        s.synchronize_blocking().unwrap();
    }
}

/// At its maximum, a growth gives wholly free chunks back only if that can make room for the
/// request: with 2 MiB free in a chunk of its own and 6 MiB held, a request for 7 MiB cannot
/// be served however much goes back, so nothing goes (it gave the 2 MiB chunk back, each such
/// give-back a device-wide `cuMemFree`, and grew it again for the next small request: a
/// review's finding; the arena checked already).
#[test]
fn a_growth_at_the_maximum_gives_nothing_back_for_nothing() {
    for device in devices() {
        let what = label(&device);
        let pool = PoolResource::new(
            CudaResource::new(&device),
            PoolOptions {
                initial: 0,
                maximum: Some(8 * MIB),
                small_block_cache: 0,
                ..PoolOptions::default()
            },
        )
        .unwrap();
        let s = device.create_stream().unwrap();
        let a = pool.allocate(2 * MIB, &s).unwrap();
        let b = pool.allocate(6 * MIB, &s).unwrap();
        assert_eq!(pool.stats().chunks, 2, "{what}: the scene needs two chunks");
        free(&pool, a, 2 * MIB, &s);
        let refused = pool.allocate(7 * MIB, &s);
        assert!(
            matches!(refused, Err(Error::OutOfMemory { .. })),
            "{what}: {refused:?}"
        );
        let stats = pool.stats();
        assert_eq!(
            (stats.reserved, stats.chunks),
            (8 * MIB, 2),
            "{what}: a chunk given back for a request that could not be served"
        );
        // Awaited, the same request waits without waking itself: its own try, which takes
        // the free chunk out and puts it back, tells nobody (told, it would try again at
        // once, and again, for as long as the memory stays short).
        let wakes = Arc::new(CountWakes(std::sync::atomic::AtomicUsize::new(0)));
        let waker = std::task::Waker::from(wakes.clone());
        let mut cx = std::task::Context::from_waker(&waker);
        let mut wait = Box::pin(streamalloc::AllocateAsync::allocate_async(
            &pool,
            7 * MIB,
            &s,
        ));
        for _ in 0..3 {
            assert!(std::future::Future::poll(wait.as_mut(), &mut cx).is_pending());
        }
        assert_eq!(
            wakes.0.load(std::sync::atomic::Ordering::SeqCst),
            0,
            "{what}: the waiter woke itself"
        );
        drop(wait);
        let grows = stats.grows;
        let c = pool.allocate(MIB, &s).unwrap();
        assert_eq!(pool.stats().grows, grows, "{what}: grew for memory it had");
        free(&pool, c, MIB, &s);
        free(&pool, b, 6 * MIB, &s);
        s.synchronize_blocking().unwrap();
    }
}

/// A waker that counts its wakes.
struct CountWakes(std::sync::atomic::AtomicUsize);

impl std::task::Wake for CountWakes {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A user's upstream with a capacity of 8 MiB and a queue of its own (so a pool stacked over it
/// is relayed its notifications). When armed, its next `allocate` first lets go of a block it
/// kept (memory comes back, its queue is told), then panics.
#[derive(Debug)]
struct GivesBackThenPanics {
    inner: CudaResource,
    used: std::sync::atomic::AtomicUsize,
    waiters: streamalloc::MemoryWaiters,
    armed: Mutex<Option<(DevicePtr, usize, Stream)>>,
}

// SAFETY: passes every allocation on to `inner`.
unsafe impl MemoryResource for GivesBackThenPanics {
    fn device(&self) -> &Device {
        self.inner.device()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> streamalloc::Result<DevicePtr> {
        use std::sync::atomic::Ordering::SeqCst;
        const CAP: usize = 8 * MIB;
        let armed = self.armed.lock().unwrap().take();
        if let Some((p, n, s)) = armed {
            // SAFETY: allocated from this resource with these bytes on `s`, unused.
            unsafe { self.deallocate(p, n, &s) }.unwrap();
            panic!("the upstream fails after it gave memory back");
        }
        let now = self.used.fetch_add(bytes, SeqCst) + bytes;
        if now > CAP {
            self.used.fetch_sub(bytes, SeqCst);
            return Err(Error::OutOfMemory {
                requested: bytes,
                available: CAP - (now - bytes),
                maximum: CAP,
            });
        }
        self.inner.allocate(bytes, stream).inspect_err(|_| {
            self.used.fetch_sub(bytes, SeqCst);
        })
    }

    unsafe fn deallocate(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        stream: &Stream,
    ) -> streamalloc::Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.deallocate(ptr, bytes, stream) }?;
        self.used
            .fetch_sub(bytes, std::sync::atomic::Ordering::SeqCst);
        self.waiters.notify();
        Ok(())
    }

    fn memory_waiters(&self) -> Option<&streamalloc::MemoryWaiters> {
        Some(&self.waiters)
    }
}

/// The scene of the two tests below: a pool over [`GivesBackThenPanics`] with 8 MiB, 6 MiB of
/// it held elsewhere (`x`), and a task waiting on the pool for 4 MiB, with `waker`. The
/// upstream's next allocate (a growth of the pool for another request) gives `x` back, then
/// panics. Returns that panic, once the waiter has been served (polled with a waker that does
/// nothing) and everything freed: the test checks what `waker` saw.
fn a_growth_whose_upstream_gives_back_then_panics(
    waker: &std::task::Waker,
) -> Box<dyn std::any::Any + Send> {
    use std::sync::atomic::Ordering::SeqCst;
    let device = Device::simulated(SimConfig::default());
    let s = device.create_stream().unwrap();
    let upstream = Arc::new(GivesBackThenPanics {
        inner: CudaResource::new(&device),
        used: std::sync::atomic::AtomicUsize::new(0),
        waiters: streamalloc::MemoryWaiters::new(),
        armed: Mutex::new(None),
    });
    let options = PoolOptions {
        initial: 0,
        maximum: None,
        small_block_cache: 0,
        ..PoolOptions::default()
    };
    let pool = PoolResource::new(upstream.clone(), options).unwrap();
    let x = upstream.allocate(6 * MIB, &s).unwrap();
    let mut wait = Box::pin(streamalloc::AllocateAsync::allocate_async(
        &pool,
        4 * MIB,
        &s,
    ));
    let mut cx = std::task::Context::from_waker(waker);
    assert!(std::future::Future::poll(wait.as_mut(), &mut cx).is_pending());
    *upstream.armed.lock().unwrap() = Some((x, 6 * MIB, s.clone()));
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = pool.allocate(MIB, &s);
    }));
    let panic = panicked.expect_err("the upstream did not panic");
    assert_eq!(upstream.used.load(SeqCst), 0, "x given back upstream");
    // Served now.
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let p = match std::future::Future::poll(wait.as_mut(), &mut cx) {
        std::task::Poll::Ready(p) => p.unwrap(),
        std::task::Poll::Pending => panic!("the waiter was told, and still refused"),
    };
    free(&pool, p, 4 * MIB, &s);
    s.synchronize_blocking().unwrap();
    panic
}

/// A growth holds back what the upstream's queue relays to the pool's (it runs under the
/// pool's `slow`); an upstream whose `allocate` gives memory back (telling its queue) and then
/// panics must still have that told to the pool's waiter, once the panic has unwound past the
/// pool's locks. It was told by a line after the request, which the unwind skipped: the waiter
/// for 4 MiB slept with 6 MiB free upstream (a review of this session's change).
#[test]
fn a_growth_whose_upstream_panics_still_tells_what_it_held_back() {
    let wakes = Arc::new(CountWakes(std::sync::atomic::AtomicUsize::new(0)));
    a_growth_whose_upstream_gives_back_then_panics(&std::task::Waker::from(wakes.clone()));
    assert!(
        wakes.0.load(std::sync::atomic::Ordering::SeqCst) > 0,
        "6 MiB came back upstream, and the waiter for 4 MiB was not told"
    );
}

/// The same growth, and the waiter's waker panics when told: the notification is told while
/// the upstream's panic unwinds, and a second panic there aborted the process (a drop
/// panicking during a panic). The waker's panic is dropped; the upstream's goes on.
#[test]
fn a_panicking_waker_told_during_an_upstream_panic_does_not_abort() {
    let wakes = Arc::new(common::PanicsOnWake::default());
    let panic =
        a_growth_whose_upstream_gives_back_then_panics(&std::task::Waker::from(wakes.clone()));
    assert_eq!(
        panic.downcast_ref::<&str>().copied(),
        Some("the upstream fails after it gave memory back"),
        "the upstream's panic is the one that goes on"
    );
    assert_eq!(
        wakes.0.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the waiter was told once"
    );
}

/// An upstream whose first `allocate` waits at a gate (saying it entered), then fails out of
/// memory; every other call passes through.
#[derive(Debug)]
struct FailsAtGate {
    inner: CudaResource,
    armed: std::sync::atomic::AtomicBool,
    entered: std::sync::atomic::AtomicBool,
    open: Mutex<bool>,
    opened: std::sync::Condvar,
}

// SAFETY: passes every call on to `CudaResource`, except the armed allocate, which allocates
// nothing.
unsafe impl MemoryResource for FailsAtGate {
    fn device(&self) -> &Device {
        self.inner.device()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> streamalloc::Result<DevicePtr> {
        use std::sync::atomic::Ordering::SeqCst;
        if self.armed.swap(false, SeqCst) {
            self.entered.store(true, SeqCst);
            let mut open = self.open.lock().unwrap();
            while !*open {
                open = self.opened.wait(open).unwrap();
            }
            return Err(Error::OutOfMemory {
                requested: bytes,
                available: 0,
                maximum: 64 * MIB,
            });
        }
        self.inner.allocate(bytes, stream)
    }

    unsafe fn deallocate(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        stream: &Stream,
    ) -> streamalloc::Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.deallocate(ptr, bytes, stream) }
    }
}

/// A pool made over a limit grows its initial memory on the making thread, holding back
/// (stashing) what the upstream notifies meanwhile, as a request's growth does. The limit
/// refused a waiter while the pool's growth held a reservation; the growth fails and the
/// limit's rollback tells that waiter, on the making thread, stashed. `PoolResource::new` had
/// no request guard to wake what was stashed: the waiter slept (for ever once the thread
/// ended) with the memory free under the limit (a review of the stash).
#[test]
fn a_failed_initial_growth_wakes_the_limits_waiter() {
    use std::sync::atomic::Ordering::SeqCst;
    use streamalloc::resource::adaptor::LimitingAdaptor;
    use streamalloc::AllocateAsync;
    let device = Device::simulated(SimConfig::default());
    let s = device.create_stream().unwrap();
    let limit = Arc::new(LimitingAdaptor::new(
        FailsAtGate {
            inner: CudaResource::new(&device),
            armed: std::sync::atomic::AtomicBool::new(true),
            entered: std::sync::atomic::AtomicBool::new(false),
            open: Mutex::new(false),
            opened: std::sync::Condvar::new(),
        },
        4 * MIB,
    ));
    let made = {
        let limit = limit.clone();
        std::thread::spawn(move || {
            let options = PoolOptions {
                initial: 3 * MIB,
                ..PoolOptions::default()
            };
            PoolResource::new(limit, options).map(drop)
        })
    };
    assert!(
        common::eventually(Duration::from_secs(10), || limit
            .upstream()
            .entered
            .load(SeqCst)),
        "the pool's initial growth never reached the upstream"
    );
    let wakes = Arc::new(CountWakes(std::sync::atomic::AtomicUsize::new(0)));
    let waker = std::task::Waker::from(wakes.clone());
    let mut cx = std::task::Context::from_waker(&waker);
    // Refused by the limit while the growth holds 3 MiB of its 4: waits.
    let mut wait = Box::pin(limit.allocate_async(4 * MIB, &s));
    assert!(std::future::Future::poll(wait.as_mut(), &mut cx).is_pending());
    *limit.upstream().open.lock().unwrap() = true;
    limit.upstream().opened.notify_all();
    assert!(made.join().unwrap().is_err(), "the growth was to fail");
    assert!(
        wakes.0.load(SeqCst) > 0,
        "the limit's rollback did not wake its waiter"
    );
    let p = match std::future::Future::poll(wait.as_mut(), &mut cx) {
        std::task::Poll::Ready(p) => p.unwrap(),
        std::task::Poll::Pending => panic!("the waiter was told, and still refused"),
    };
    free(&*limit, p, 4 * MIB, &s);
    s.synchronize_blocking().unwrap();
}
