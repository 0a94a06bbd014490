//! `PoolResource` and `FixedSizeResource` on every available device: RMM's memory-resource tests
//! and the pool's own promises (stream order with data, cross-stream reuse, coalescing across streams, growth, trim).

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::{check_pool, devices, free, label, pool, read_u32, SplitMix64};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::fixed_size::FixedSizeResource;
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{Device, DevicePtr, Error, MemoryResource, SimConfig, Stream, ALIGNMENT};

const MIB: usize = 1 << 20;

#[test]
fn zero_bytes_cost_nothing() {
    for device in devices() {
        let p = pool(&device, 0, 64 * MIB);
        let s = device.create_stream().unwrap();
        let ptr = p.allocate(0, &s).unwrap();
        assert_eq!(ptr, DevicePtr(0));
        free(&p, ptr, 0, &s);
        assert_eq!(p.stats().reserved, 0, "{}", label(&device));
        // On another device's stream, zero bytes are refused as any size is: the stream is
        // checked first (a review found a null pointer handed out).
        let other = Device::simulated(SimConfig::default());
        let foreign = other.create_stream().unwrap();
        let fixed = FixedSizeResource::new(CudaResource::new(&device), 4096, 4).unwrap();
        let resources: [&dyn MemoryResource; 2] = [&p, &fixed];
        for r in resources {
            let zero = r.allocate(0, &foreign);
            assert!(matches!(zero, Err(Error::WrongDevice { .. })), "{zero:?}");
            // SAFETY: refused before anything is freed (nothing would be).
            let freed = unsafe { r.deallocate(DevicePtr(0), 0, &foreign) };
            assert!(matches!(freed, Err(Error::WrongDevice { .. })), "{freed:?}");
        }
    }
}

#[test]
fn sizes_from_4_bytes_to_1_gib_are_aligned_and_distinct() {
    for device in devices() {
        let p = pool(&device, 0, 2048 * MIB);
        let s = device.create_stream().unwrap();
        let mut live = BTreeMap::new();
        let mut size = 4;
        while size <= 1 << 30 {
            let ptr = p.allocate(size, &s).unwrap();
            assert_ne!(ptr.0, 0);
            assert_eq!(
                ptr.0 % ALIGNMENT as u64,
                0,
                "{}: {size} B at {ptr:?}",
                label(&device)
            );
            live.insert(ptr.0, size);
            size *= 4;
        }
        // Distinct and not overlapping.
        let v: Vec<_> = live.iter().collect();
        for w in v.windows(2) {
            assert!(
                w[0].0 + *w[0].1 as u64 <= *w[1].0,
                "{}: overlap",
                label(&device)
            );
        }
        // Writable: the first and last 4 KiB of each that large.
        for (&ptr, &size) in live.iter().filter(|(_, &s)| s >= 8192) {
            let last = DevicePtr(ptr + size as u64 - 4096);
            // SAFETY: `size` live bytes at `ptr`, synchronized in read_u32.
            unsafe {
                s.fill_u32(DevicePtr(ptr), 0xAB, 1024).unwrap();
                s.fill_u32(last, 0xCD, 1024).unwrap();
            }
            assert_eq!(read_u32(&s, DevicePtr(ptr), 1), [0xAB]);
            assert_eq!(read_u32(&s, last.offset(4092), 1), [0xCD]);
        }
        for (ptr, size) in live {
            free(&p, DevicePtr(ptr), size, &s);
        }
        check_pool(&p);
    }
}

#[test]
fn one_pib_is_out_of_memory_and_the_pool_stays_usable() {
    for device in devices() {
        let p = pool(&device, 16 * MIB, 256 * MIB);
        let s = device.create_stream().unwrap();
        match p.allocate(1 << 50, &s) {
            Err(Error::OutOfMemory {
                requested, maximum, ..
            }) => {
                assert_eq!(requested, 1 << 50);
                assert_eq!(maximum, 256 * MIB);
            }
            other => panic!("{}: 1 PiB gave {other:?}", label(&device)),
        }
        let ptr = p.allocate(MIB, &s).unwrap();
        free(&p, ptr, MIB, &s);
        check_pool(&p);
        assert_eq!(p.stats().reserved, 16 * MIB);
    }
}

/// The random mixes' free: a live block, picked by `rng`, freed on the stream it was allocated
/// on or on another ordered behind that one first. Its size.
fn free_one_at_random(
    p: &PoolResource<CudaResource>,
    live: &mut Vec<(DevicePtr, usize, usize)>,
    streams: &[Stream],
    rng: &mut SplitMix64,
) -> usize {
    let (ptr, size, s) = live.swap_remove((rng.next() % live.len() as u64) as usize);
    let t = (rng.next() % streams.len() as u64) as usize;
    if t != s {
        streams[t].wait(&streams[s].record().unwrap()).unwrap();
    }
    free(p, ptr, size, &streams[t]);
    size
}

/// The random mixes' end: every block still live freed on the stream it was allocated on, the
/// invariants, and every byte the pool holds free again: its statistics.
fn free_all_and_account(
    p: &PoolResource<CudaResource>,
    live: Vec<(DevicePtr, usize, usize)>,
    streams: &[Stream],
    device: &Device,
) -> streamalloc::resource::pool::PoolStats {
    for (ptr, size, s) in live {
        free(p, ptr, size, &streams[s]);
    }
    check_pool(p);
    let stats = p.stats();
    assert_eq!(
        stats.free,
        stats.reserved,
        "{}: bytes lost: {stats:?}",
        label(device)
    );
    stats
}

#[test]
fn random_mixes_keep_the_invariants() {
    for device in devices() {
        let p = pool(&device, 32 * MIB, 512 * MIB);
        let streams: Vec<Stream> = (0..3).map(|_| device.create_stream().unwrap()).collect();
        let mut rng = SplitMix64(11);
        let mut live: Vec<(DevicePtr, usize, usize)> = Vec::new();
        for step in 0..4000 {
            let r = rng.next();
            if live.is_empty() || (r.is_multiple_of(2) && live.len() < 64) {
                let size = 1 + (rng.next() % (2 * MIB as u64)) as usize;
                let s = (rng.next() % 3) as usize;
                let ptr = p.allocate(size, &streams[s]).unwrap();
                live.push((ptr, size, s));
            } else {
                free_one_at_random(&p, &mut live, &streams, &mut rng);
            }
            if step % 250 == 0 {
                check_pool(&p);
                let mut ranges: Vec<_> = live.iter().map(|&(p, s, _)| (p.0, s as u64)).collect();
                ranges.sort_unstable();
                assert!(
                    ranges.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0),
                    "live blocks overlap"
                );
            }
        }
        free_all_and_account(&p, live, &streams, &device);
    }
}

#[test]
fn four_threads_at_once() {
    for device in devices() {
        let p = Arc::new(pool(&device, 64 * MIB, 1024 * MIB));
        std::thread::scope(|scope| {
            for t in 0..4u64 {
                let (p, device) = (p.clone(), device.clone());
                scope.spawn(move || {
                    let s = device.create_stream().unwrap();
                    let mut rng = SplitMix64(100 + t);
                    let mut live = Vec::new();
                    for _ in 0..3000 {
                        if live.is_empty() || rng.next().is_multiple_of(2) {
                            let size = 256 + (rng.next() % (256 << 10)) as usize;
                            live.push((p.allocate(size, &s).unwrap(), size));
                        } else {
                            let (ptr, size) =
                                live.swap_remove((rng.next() % live.len() as u64) as usize);
                            free(&*p, ptr, size, &s);
                        }
                    }
                    for (ptr, size) in live {
                        free(&*p, ptr, size, &s);
                    }
                });
            }
        });
        check_pool(&p);
        let stats = p.stats();
        assert_eq!(stats.free, stats.reserved, "{}: {stats:?}", label(&device));
    }
}

/// The initial memory, in pieces in the engine's reserve, goes to the threads' shards as they
/// need it: no thread grows the pool or takes memory from another thread's shard, and trim
/// gives back every piece, used or not.
#[test]
fn initial_memory_is_shared_out_as_threads_need_it_and_trimmed_whole() {
    for device in devices() {
        let p = Arc::new(pool(&device, 256 * MIB, 1024 * MIB));
        let start = p.stats();
        assert_eq!(
            (start.free, start.free_blocks, start.chunks, start.reserved),
            (256 * MIB, 8, 8, 256 * MIB),
            "{}: {start:?}",
            label(&device)
        );
        std::thread::scope(|scope| {
            for _ in 0..4 {
                let (p, device) = (p.clone(), device.clone());
                scope.spawn(move || {
                    let s = device.create_stream().unwrap();
                    let a = p.allocate(20 * MIB, &s).unwrap();
                    let b = p.allocate(8 * MIB, &s).unwrap();
                    free(&*p, a, 20 * MIB, &s);
                    free(&*p, b, 8 * MIB, &s);
                    s.synchronize_blocking().unwrap();
                });
            }
        });
        let used = p.stats();
        assert_eq!(
            (used.grows, used.shard_spills, used.free),
            (0, 0, used.reserved),
            "{}: {used:?}",
            label(&device)
        );
        check_pool(&p);
        assert_eq!(p.trim_blocking().unwrap(), 256 * MIB, "{}", label(&device));
        assert_eq!(p.stats().reserved, 0);
        let s = device.create_stream().unwrap();
        let c = p.allocate(MIB, &s).unwrap();
        free(&*p, c, MIB, &s);
        check_pool(&p);
    }
}

#[test]
fn producer_consumer_across_threads_and_streams() {
    for device in devices() {
        let p = Arc::new(pool(&device, 16 * MIB, 256 * MIB));
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            let (pa, da) = (p.clone(), device.clone());
            scope.spawn(move || {
                let a = da.create_stream().unwrap();
                for i in 0..200u32 {
                    let ptr = pa.allocate(4096, &a).unwrap();
                    // SAFETY: 4096 live bytes; the consumer frees them after waiting on `done`.
                    unsafe { a.fill_u32(ptr, i, 1024) }.unwrap();
                    tx.send((ptr, i, a.record().unwrap())).unwrap();
                }
            });
            let (pb, db) = (p.clone(), device.clone());
            scope.spawn(move || {
                let b = db.create_stream().unwrap();
                for (ptr, i, done) in rx {
                    b.wait(&done).unwrap();
                    assert_eq!(read_u32(&b, ptr, 1024), vec![i; 1024]);
                    free(&*pb, ptr, 4096, &b);
                }
            });
        });
        check_pool(&p);
        let stats = p.stats();
        assert_eq!(stats.free, stats.reserved, "{}: {stats:?}", label(&device));
    }
}

#[test]
fn a_stream_dropped_with_frees_pending_loses_nothing() {
    for device in devices() {
        let p = pool(&device, 0, 64 * MIB);
        let mut ptrs = Vec::new();
        {
            let a = device.create_stream().unwrap();
            for _ in 0..8 {
                ptrs.push(p.allocate(MIB, &a).unwrap());
            }
            a.spin(Duration::from_millis(20)).unwrap();
            for &ptr in &ptrs {
                free(&p, ptr, MIB, &a);
            }
            // `a` is dropped here with its work and its frees still queued.
        }
        let reserved = p.stats().reserved;
        let b = device.create_stream().unwrap();
        // B gets all of it back without growing: reusing what A freed (coalesced), after waiting for A.
        let again: Vec<_> = (0..8).map(|_| p.allocate(MIB, &b).unwrap()).collect();
        assert_eq!(
            p.stats().reserved,
            reserved,
            "{}: the pool grew",
            label(&device)
        );
        for ptr in again {
            free(&p, ptr, MIB, &b);
        }
        check_pool(&p);
    }
}

#[test]
fn growth_stops_at_the_maximum() {
    for device in devices() {
        let p = pool(&device, 0, 10 * MIB);
        let s = device.create_stream().unwrap();
        let mut live = Vec::new();
        loop {
            match p.allocate(MIB, &s) {
                Ok(ptr) => live.push(ptr),
                Err(Error::OutOfMemory {
                    requested,
                    available,
                    maximum,
                }) => {
                    assert_eq!((requested, maximum), (MIB, 10 * MIB), "{}", label(&device));
                    assert!(
                        available < MIB,
                        "{}: {available} available yet refused",
                        label(&device)
                    );
                    break;
                }
                Err(e) => panic!("{}: {e}", label(&device)),
            }
        }
        assert_eq!(live.len(), 10, "{}", label(&device));
        let stats = p.stats();
        assert!(
            stats.reserved <= 10 * MIB && stats.peak_reserved <= 10 * MIB,
            "{stats:?}"
        );
        for ptr in live {
            free(&p, ptr, MIB, &s);
        }
        let again: Vec<_> = (0..10).map(|_| p.allocate(MIB, &s).unwrap()).collect();
        assert_eq!(
            p.stats().reserved,
            10 * MIB,
            "{}: usable after OOM, without growing",
            label(&device)
        );
        for ptr in again {
            free(&p, ptr, MIB, &s);
        }
    }
}

/// `PoolOptions::growth_cap`: each growth keeps the pool within the cap times the most it had
/// in use at a growth (the request included), or, where even the request alone passes that
/// (free memory too fragmented to serve it), grows by the request alone (at least 2 MiB).
/// Doubling at each growth (`growth_divisor: 1`) makes the step large, so without the cap the
/// same churn breaks the rule: checked too, so that the rule is not one the churn never tests.
#[test]
fn growth_stays_within_the_cap() {
    for device in devices() {
        // Growths that broke the rule, and growths in all.
        let churn = |growth_cap: Option<f64>| {
            let p = PoolResource::new(
                CudaResource::new(&device),
                PoolOptions {
                    maximum: Some(512 * MIB),
                    growth_divisor: 1,
                    growth_cap,
                    ..PoolOptions::default()
                },
            )
            .unwrap();
            let s = device.create_stream().unwrap();
            let mut rng = SplitMix64(7);
            let (mut live, mut live_bytes, mut floor) = (Vec::new(), 0usize, 0usize);
            let (mut broken, mut growths) = (0, 0);
            for _ in 0..4000 {
                let (a, b) = (rng.next(), rng.next());
                if live.is_empty() || a & 1 == 0 {
                    // 256 B to just under 4 MiB, rounded up to the pool's alignment.
                    let e = 8 + b % 14;
                    let size = ((1usize << e) + (b >> 8) as usize % (1usize << e))
                        .next_multiple_of(ALIGNMENT);
                    let before = p.stats().reserved;
                    live.push((p.allocate(size, &s).unwrap(), size));
                    let after = p.stats().reserved;
                    if after > before {
                        growths += 1;
                        floor = floor.max(live_bytes + size);
                        // The growth is rounded up to the pool's alignment.
                        let capped = (floor as f64 * 1.3) as usize + ALIGNMENT;
                        if after > capped.max(before + size.max(2 * MIB)) {
                            broken += 1;
                        }
                    }
                    live_bytes += size;
                } else {
                    let (ptr, size) = live.swap_remove((a >> 1) as usize % live.len());
                    free(&p, ptr, size, &s);
                    live_bytes -= size;
                }
            }
            for (ptr, size) in live {
                free(&p, ptr, size, &s);
            }
            check_pool(&p);
            let stats = p.stats();
            assert_eq!(stats.grows, growths, "{}", label(&device));
            (broken, growths, stats.capped_grows)
        };
        let (broken, growths, capped) = churn(Some(1.3));
        assert_eq!(
            broken,
            0,
            "{}: {broken} of {growths} growths past the cap",
            label(&device)
        );
        assert!(
            capped > 0,
            "{}: the cap cut none of {growths} growths",
            label(&device)
        );
        let (broken, growths, capped) = churn(None);
        assert_eq!(capped, 0, "{}", label(&device));
        assert!(
            broken > 0 && growths > 1,
            "{}: without the cap, {broken} of {growths} growths broke the rule: the churn tests nothing",
            label(&device)
        );
    }
}

/// A pool that grew in small chunks up to its maximum, then has everything freed, must still
/// serve a request larger than any of its chunks: it gives the free chunks back and grows one
/// large enough. (Without that, blocks never merging across chunks, it would fail forever, and
/// an `allocate_async` would wait forever.)
#[test]
fn free_small_chunks_make_room_for_a_large_one_at_the_maximum() {
    let rt = common::runtime();
    for device in devices() {
        let p = pool(&device, 0, 8 * MIB);
        let s = device.create_stream().unwrap();
        let small: Vec<_> = (0..40)
            .map(|_| p.allocate(128 << 10, &s).unwrap())
            .collect();
        for ptr in small {
            free(&p, ptr, 128 << 10, &s);
        }
        s.synchronize_blocking().unwrap();
        assert!(p.stats().chunks > 1, "{:?}", p.stats());
        let big = rt
            .block_on(
                streamalloc::AllocateAsync::allocate_async(&p, 6 * MIB, &s)
                    .timeout(Duration::from_secs(5)),
            )
            .unwrap_or_else(|e| panic!("{}: {e}: {:?}", label(&device), p.stats()));
        let stats = p.stats();
        assert!(
            stats.reserved <= 8 * MIB && stats.peak_reserved <= 8 * MIB,
            "{stats:?}"
        );
        free(&p, big, 6 * MIB, &s);
        check_pool(&p);
    }
}

#[test]
fn bad_construction_arguments_are_errors() {
    let device = &devices()[0];
    let upstream = || CudaResource::new(device);
    let bad = |initial, maximum| {
        PoolResource::new(
            upstream(),
            PoolOptions {
                initial,
                maximum,
                ..PoolOptions::default()
            },
        )
        .unwrap_err()
    };
    assert!(matches!(
        bad(1000, Some(MIB)),
        Error::InvalidSize { size: 1000, .. }
    ));
    assert!(matches!(bad(0, Some(MIB + 1)), Error::InvalidSize { .. }));
    assert!(matches!(bad(2 * MIB, Some(MIB)), Error::InvalidSize { .. }));
    assert!(matches!(
        FixedSizeResource::new(upstream(), 0, 16).unwrap_err(),
        Error::InvalidSize { .. }
    ));
    let p = pool(device, 0, MIB);
    let s = device.create_stream().unwrap();
    // SAFETY: deliberately wrong pointers: the pool must refuse them without touching memory.
    unsafe {
        assert!(matches!(
            p.deallocate(DevicePtr(12345), 256, &s),
            Err(Error::UnknownPointer { .. })
        ));
        assert!(matches!(
            p.deallocate(DevicePtr(0x1000), 0, &s),
            Err(Error::UnknownPointer { .. })
        ));
    }
    let ptr = p.allocate(1024, &s).unwrap();
    // SAFETY: deliberately wrong ranges inside and past the pool's only chunk: refused.
    unsafe {
        assert!(matches!(
            p.deallocate(ptr.offset(512), MIB, &s),
            Err(Error::UnknownPointer { .. })
        ));
        assert!(matches!(
            p.deallocate(DevicePtr(ptr.0 + (1 << 40)), 256, &s),
            Err(Error::UnknownPointer { .. })
        ));
    }
    free(&p, ptr, 1024, &s);
    // SAFETY: a double free, which the pool detects and refuses.
    assert!(matches!(
        unsafe { p.deallocate(ptr, 1024, &s) },
        Err(Error::UnknownPointer { .. })
    ));
    let other = Device::simulated(Default::default())
        .create_stream()
        .unwrap();
    assert!(matches!(
        p.allocate(256, &other),
        Err(Error::WrongDevice { .. })
    ));
}

/// Stream order with data. A spins, then fills X; X is freed on A while the spin still runs.
/// B then gets X's memory and fills it with its own pattern. Unless the pool ordered B behind
/// A, A's late fill lands on top of B's.
#[test]
fn reuse_on_another_stream_waits_for_the_freeing_stream() {
    for device in devices() {
        let words = 256 * 1024;
        let bytes = words * 4;
        // Exactly one block: once A has freed it, B can only reuse it.
        let p = pool(&device, bytes, bytes);
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let x = p.allocate(bytes, &a).unwrap();
        a.spin(Duration::from_millis(100)).unwrap();
        // SAFETY: `bytes` live bytes at `x`, used on A before the free on A.
        unsafe { a.fill_u32(x, 0xAAAA_AAAA, words) }.unwrap();
        free(&p, x, bytes, &a);
        let y = p.allocate(bytes, &b).unwrap();
        assert_eq!(x, y, "{}: B did not get A's block", label(&device));
        // A wait on the GPU, or none if A was already idle (a host slower than the spin):
        // either way the data below must be B's.
        let stats = p.stats();
        assert_eq!(stats.stream_waits + stats.idle_reuses, 1, "{stats:?}");
        // SAFETY: B's block, used on B.
        unsafe { b.fill_u32(y, 0xBBBB_BBBB, words) }.unwrap();
        a.synchronize_blocking().unwrap();
        let back = read_u32(&b, y, words);
        assert!(
            back.iter().all(|&w| w == 0xBBBB_BBBB),
            "{}: A's fill overwrote B's: the reuse did not wait for A",
            label(&device)
        );
        free(&p, y, bytes, &b);
    }
}

/// RMM issues 2039 and 2489. Half a chunk is freed on A (then A is dropped: idle), half on B.
/// B's request for the whole chunk needs both halves: they must have coalesced (rather than the
/// pool grow), and B must wait for A. Then C takes that block after B freed it: C must be
/// ordered after A's work too, although B was the last to free it.
#[test]
fn coalesced_blocks_stay_ordered_behind_their_first_stream() {
    for device in devices() {
        let words = 256 * 1024;
        let half = words * 4;
        let p = pool(&device, 2 * half, 2 * half);
        let (b, c) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let (x1, x2);
        {
            let a = device.create_stream().unwrap();
            x1 = p.allocate(half, &a).unwrap();
            x2 = p.allocate(half, &b).unwrap();
            a.spin(Duration::from_millis(100)).unwrap();
            // SAFETY: `half` live bytes at x1, used on A, freed on A after.
            unsafe { a.fill_u32(x1, 0xAAAA_AAAA, words) }.unwrap();
            free(&p, x1, half, &a);
        }
        free(&p, x2, half, &b);
        let whole = p.allocate(2 * half, &b).unwrap();
        let stats = p.stats();
        assert_eq!(
            stats.reserved,
            2 * half,
            "{}: grew instead of coalescing: {stats:?}",
            label(&device)
        );
        assert!(stats.stream_waits + stats.idle_reuses >= 1, "{stats:?}");
        assert_eq!(whole.0, x1.0.min(x2.0));
        free(&p, whole, 2 * half, &b);
        let taken = p.allocate(2 * half, &c).unwrap();
        assert_eq!(taken, whole);
        // SAFETY: C's block, used on C.
        unsafe { c.fill_u32(taken, 0xCCCC_CCCC, 2 * words) }.unwrap();
        c.synchronize_blocking().unwrap();
        b.synchronize_blocking().unwrap();
        // A's stream is gone, but its fill may still run: wait for the whole device.
        std::thread::sleep(Duration::from_millis(150));
        let back = read_u32(&c, taken, 2 * words);
        assert!(
            back.iter().all(|&w| w == 0xCCCC_CCCC),
            "{}: A's fill overwrote C's: the coalesced block lost A's ordering",
            label(&device)
        );
        free(&p, taken, 2 * half, &c);
        check_pool(&p);
    }
}

/// Small blocks of a few sizes, so that the small-block caches serve many requests: allocations
/// and frees on three streams (a free on another stream than the allocation's after ordering
/// it behind the first, as a hand-off does), in a pool small enough to grow and to give chunks
/// back at its maximum; the invariant checker after every operation, every byte accounted for.
#[test]
fn random_small_blocks_through_the_cache_keep_the_invariants_at_every_step() {
    for device in devices() {
        let p = pool(&device, 0, 8 * MIB);
        let streams: Vec<Stream> = (0..3).map(|_| device.create_stream().unwrap()).collect();
        let mut rng = SplitMix64(5);
        let mut live: Vec<(DevicePtr, usize, usize)> = Vec::new();
        let mut live_bytes = 0;
        for step in 0..6000 {
            let r = rng.next();
            // 256 bytes to 64 KiB in 8 sizes, and now and then a block too large to cache.
            let size = if r.is_multiple_of(16) {
                96 * 1024
            } else {
                256 << (rng.next() % 8)
            };
            if live.is_empty() || (!(r >> 8).is_multiple_of(3) && live_bytes + size <= 6 * MIB) {
                let s = (rng.next() % 3) as usize;
                let ptr = p.allocate(size, &streams[s]).unwrap();
                live.push((ptr, size, s));
                live_bytes += size;
            } else {
                live_bytes -= free_one_at_random(&p, &mut live, &streams, &mut rng);
            }
            p.check_invariants()
                .unwrap_or_else(|e| panic!("{}: step {step}: {e}", label(&device)));
        }
        let stats = free_all_and_account(&p, live, &streams, &device);
        assert!(
            stats.cache_hits > 100 && stats.stream_waits + stats.idle_reuses > 0,
            "{}: the cache or the orderings went unused: {stats:?}",
            label(&device)
        );
    }
}

/// The small-block cache (`PoolOptions::small_block_cache`): a small block freed on A is kept
/// for A's next request of its size, and handed back to A at once (stream order). Another
/// stream's request of that size must not get it from the cache: it gets it from the free
/// blocks, after waiting for A's work. A's fill, queued behind a long spin, must land before
/// B's, so B reads its own.
#[test]
fn cached_small_blocks_are_reused_at_once_only_on_their_stream() {
    for device in devices() {
        let words = 4 * 1024;
        let bytes = words * 4;
        let p = pool(&device, 2 * MIB, 2 * MIB);
        let b = device.create_stream().unwrap();
        let a = device.create_stream().unwrap();
        // The same stream: the block comes back from the cache, with no wait.
        let x = p.allocate(bytes, &a).unwrap();
        free(&p, x, bytes, &a);
        assert_eq!(p.allocate(bytes, &a).unwrap(), x, "{}", label(&device));
        let stats = p.stats();
        assert_eq!((stats.cache_hits, stats.stream_waits), (1, 0), "{stats:?}");
        check_pool(&p);
        // Another stream: A still uses the block when it frees it.
        a.spin(Duration::from_millis(100)).unwrap();
        // SAFETY: `bytes` live bytes at x, used on A, freed on A after.
        unsafe { a.fill_u32(x, 0xAAAA_AAAA, words) }.unwrap();
        free(&p, x, bytes, &a);
        check_pool(&p);
        let y = p.allocate(bytes, &b).unwrap();
        check_pool(&p);
        let stats = p.stats();
        assert_eq!(
            stats.cache_hits,
            1,
            "{}: served from A's cache: {stats:?}",
            label(&device)
        );
        // SAFETY: B's block, used on B.
        unsafe { b.fill_u32(y, 0xBBBB_BBBB, words) }.unwrap();
        // The pool is otherwise empty: the block went back to the free blocks, coalesced
        // with the rest of the chunk, and B's best fit starts where it did.
        assert_eq!(y, x, "{}", label(&device));
        let back = read_u32(&b, y, words);
        assert!(
            back.iter().all(|&w| w == 0xBBBB_BBBB),
            "{}: A's fill landed after B's: the cached block was reused on B unordered",
            label(&device)
        );
        free(&p, y, bytes, &b);
        a.synchronize_blocking().unwrap();
        b.synchronize_blocking().unwrap();
        check_pool(&p);
        // Every byte back: the rest of the chunk, and the block in B's cache if it went there
        // (the statistics count a cached block as one, without emptying the cache).
        let stats = p.stats();
        assert_eq!(stats.free, 2 * MIB, "{stats:?}");
        assert!((1..=2).contains(&stats.free_blocks), "{stats:?}");
    }
}

#[test]
fn trim_returns_wholly_free_chunks() {
    let rt = common::runtime();
    for device in devices() {
        let p = pool(&device, 4 * MIB, 64 * MIB);
        let s = device.create_stream().unwrap();
        // Grow twice past the initial chunk.
        let a = p.allocate(4 * MIB, &s).unwrap();
        let b = p.allocate(8 * MIB, &s).unwrap();
        let grown = p.stats();
        assert!(grown.chunks >= 2, "{grown:?}");
        free(&p, b, 8 * MIB, &s);
        let released = rt.block_on(p.trim()).unwrap();
        let after = p.stats();
        assert!(
            released >= 8 * MIB,
            "{}: released {released}: {after:?}",
            label(&device)
        );
        assert_eq!(after.reserved, grown.reserved - released);
        free(&p, a, 4 * MIB, &s);
        let released = p.trim_blocking().unwrap();
        assert_eq!(
            p.stats().reserved,
            0,
            "{}: {released} released",
            label(&device)
        );
        // Still usable: it grows again.
        let c = p.allocate(MIB, &s).unwrap();
        free(&p, c, MIB, &s);
        check_pool(&p);
    }
}

#[test]
fn fixed_size_blocks() {
    for device in devices() {
        let f = FixedSizeResource::new(CudaResource::new(&device), 64 << 10, 16).unwrap();
        let (s, t) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let blocks: Vec<_> = (0..40).map(|_| f.allocate(1000, &s).unwrap()).collect();
        let mut sorted: Vec<_> = blocks.iter().map(|p| p.0).collect();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 40);
        assert!(sorted.windows(2).all(|w| w[1] - w[0] >= 64 << 10));
        assert_eq!(f.reserved(), 3 * 16 * (64 << 10), "{}", label(&device));
        assert!(matches!(
            f.allocate((64 << 10) + 1, &s),
            Err(Error::InvalidSize { .. })
        ));
        for p in &blocks {
            free(&f, *p, 1000, &s);
        }
        // Another stream reuses them (after waiting for the freeing stream) without growing.
        let again: Vec<_> = (0..40).map(|_| f.allocate(64 << 10, &t).unwrap()).collect();
        assert_eq!(f.reserved(), 3 * 16 * (64 << 10));
        for p in again {
            free(&f, p, 64 << 10, &t);
        }
        f.check_invariants().unwrap();
    }
}

/// A pool over a stream-ordered upstream (here another pool; the driver's pool is another):
/// the chunk it grows on stream `s` is ready only in `s`'s order, so a third stream that takes
/// the rest of it must be ordered after `s`. A review found the rest handed to `t` at once:
/// `t`'s data was overwritten by work still queued on the stream that freed the inner pool's
/// block.
#[test]
fn a_chunk_grown_on_a_stream_is_ordered_for_other_streams() {
    for device in devices() {
        let inner = Arc::new(common::waiting_pool(&device, 0, 64 * MIB));
        let outer = Arc::new(
            PoolResource::new(
                inner.clone(),
                PoolOptions {
                    initial: 0,
                    maximum: Some(64 * MIB),
                    ..PoolOptions::default()
                },
            )
            .unwrap(),
        );
        let (d, s, t) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        // A block of the inner pool, written on `d` late (behind a spin), freed on `d`.
        let mut x = streamalloc::DeviceBuffer::new(&inner, 4 * MIB, &d).unwrap();
        d.spin(Duration::from_millis(300)).unwrap();
        x.memset(1).unwrap();
        drop(x);
        // The outer pool grows on `s` (the inner pool orders `s` after `d`) ...
        let a = streamalloc::DeviceBuffer::new(&outer, MIB, &s).unwrap();
        assert_eq!(outer.stats().grows, 1, "{}", label(&device));
        // ... and hands the rest of that chunk to `t`.
        let mut b = streamalloc::DeviceBuffer::new(&outer, MIB, &t).unwrap();
        b.memset(2).unwrap();
        let back = common::runtime().block_on(b.to_host()).unwrap();
        d.synchronize_blocking().unwrap();
        let again = common::runtime().block_on(b.to_host()).unwrap();
        assert!(
            back.iter().chain(&again).all(|&v| v == 2),
            "{}: the grown chunk reached another stream before the memory was free",
            label(&device)
        );
        drop((a, b));
        for stream in [&d, &s, &t] {
            stream.synchronize_blocking().unwrap();
        }
        if device.is_simulated() {
            assert_eq!(device.take_races(), Vec::new(), "{}", label(&device));
        }
    }
}

/// A cap so large that the cap times the use passes `u64::MAX` allows every byte of room: no
/// overflow (a review found a panic in debug builds and growth by 0 bytes in release ones).
#[test]
fn a_huge_growth_cap_grows_as_no_cap() {
    for device in devices() {
        for cap in [f64::MAX, 1e30, f64::INFINITY] {
            let p = PoolResource::new(
                CudaResource::new(&device),
                PoolOptions {
                    initial: 0,
                    maximum: Some(64 * MIB),
                    growth_cap: Some(cap),
                    ..PoolOptions::default()
                },
            )
            .unwrap();
            let s = device.create_stream().unwrap();
            let ptr = p.allocate(MIB, &s).unwrap();
            free(&p, ptr, MIB, &s);
            check_pool(&p);
        }
    }
}

/// A trim that holds a chunk out (waiting for the stream that freed it) while an awaitable
/// request at the maximum comes: the request takes the chunk back and is served at once, and
/// the trim gives back nothing. A review found such a waiter asleep until its deadline after
/// the trim had made room; since the thirteenth session it does not wait for the trim at all
/// (`trim_cancel.rs` has the same for `allocate`).
#[test]
fn an_awaitable_request_at_the_maximum_takes_what_a_trim_holds() {
    use streamalloc::AllocateAsync;
    for device in devices() {
        let p = pool(&device, 0, 4 * MIB);
        let (s1, s2) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let x = p.allocate(4 * MIB, &s1).unwrap();
        s1.spin(Duration::from_millis(300)).unwrap();
        free(&p, x, 4 * MIB, &s1);
        let rt = common::runtime();
        std::thread::scope(|scope| {
            let trim = scope.spawn(|| p.trim_blocking());
            // The trim takes the chunk out, then waits for `s1`; the request comes meanwhile.
            assert!(common::eventually(Duration::from_secs(5), || {
                p.stats().free == 0
            }));
            let got = rt.block_on(
                p.allocate_async(4 * MIB, &s2)
                    .timeout(Duration::from_secs(30)),
            );
            let ptr = got.unwrap_or_else(|e| panic!("{}: {e}", label(&device)));
            assert_eq!(ptr, x, "{}: the chunk the trim held", label(&device));
            assert_eq!(trim.join().unwrap().unwrap(), 0, "{}", label(&device));
            free(&p, ptr, 4 * MIB, &s2);
        });
    }
}

/// A pool over a pool with a smaller maximum: a request above the inner maximum can never be
/// served, and the outer pool's error says so (its maximum and available no more than the
/// inner pool's), so that waiting for it fails at once. A review found the outer pool's own
/// maximum in the error, and `allocate_async` waiting for ever.
#[test]
fn a_pool_over_a_smaller_pool_reports_the_smaller_maximum() {
    use streamalloc::AllocateAsync;
    for device in devices() {
        let inner = Arc::new(pool(&device, 0, 4 * MIB));
        let outer = PoolResource::new(
            inner.clone(),
            PoolOptions {
                initial: 0,
                maximum: Some(64 * MIB),
                ..PoolOptions::default()
            },
        )
        .unwrap();
        let s = device.create_stream().unwrap();
        match outer.allocate(8 * MIB, &s) {
            Err(Error::OutOfMemory {
                requested,
                available,
                maximum,
            }) => {
                assert_eq!(
                    (requested, maximum),
                    (8 * MIB, 4 * MIB),
                    "{}",
                    label(&device)
                );
                assert!(
                    available <= 4 * MIB,
                    "{}: available {available}",
                    label(&device)
                );
            }
            other => panic!("{}: {other:?}", label(&device)),
        }
        let got = common::runtime().block_on(
            outer
                .allocate_async(8 * MIB, &s)
                .timeout(Duration::from_secs(30)),
        );
        assert!(
            matches!(got, Err(Error::OutOfMemory { .. })),
            "{}: {got:?}",
            label(&device)
        );
        // The inner pool holding 3 MiB: 2 MiB more cannot be had, and the error does not
        // claim the outer pool's room as available.
        let held = inner.allocate(3 * MIB, &s).unwrap();
        match outer.allocate(2 * MIB, &s) {
            Err(Error::OutOfMemory {
                requested,
                available,
                ..
            }) => assert!(available < requested, "{}: {available}", label(&device)),
            other => panic!("{}: {other:?}", label(&device)),
        }
        free(&*inner, held, 3 * MIB, &s);
    }
}

/// Looking at the statistics changes nothing: a small block freed, then the statistics read,
/// is still served from the cache to the next same-size request on its stream. (`stats` used
/// to empty the small-block caches into the free lists, so that request missed the cache.)
#[test]
fn reading_the_statistics_leaves_the_small_block_cache_alone() {
    for device in devices() {
        let p = pool(&device, 2 * MIB, 2 * MIB);
        let s = device.create_stream().unwrap();
        let x = p.allocate(4096, &s).unwrap();
        free(&p, x, 4096, &s);
        let before = p.stats();
        assert_eq!(before.free, 2 * MIB, "{before:?}");
        let y = p.allocate(4096, &s).unwrap();
        let after = p.stats();
        assert_eq!(
            after.cache_hits,
            before.cache_hits + 1,
            "{}: the request after a look at the statistics missed the cache: {after:?}",
            label(&device)
        );
        free(&p, y, 4096, &s);
        check_pool(&p);
    }
}
