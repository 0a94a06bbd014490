//! `ArenaResource`, `BinningResource`, `CallbackResource` and the per-device current resource,
//! on every available device: RMM's shared memory-resource tests for each, then what is
//! particular to each (the arena's defragmentation and stream order, binning's routing, the
//! callbacks' arguments, the current resource's map).

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{assert_arena_all_back, check_arena, devices, label, read_u32, SplitMix64};
use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
use streamalloc::resource::binning::BinningResource;
use streamalloc::resource::callback::CallbackResource;
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::current::{
    current_resource, reset_current_resource, set_current_resource,
};
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{
    Device, DevicePtr, Error, MemoryKind, MemoryResource, ResourceRef, SimConfig, Stream, StreamId,
    ALIGNMENT,
};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn free<R: MemoryResource + ?Sized>(mr: &R, ptr: DevicePtr, bytes: usize, stream: &Stream) {
    // SAFETY: every test frees what it allocated from `mr`, once, after its last use on
    // `stream` (or after ordering `stream` behind that use).
    unsafe { mr.deallocate(ptr, bytes, stream) }.unwrap();
}

// ===== RMM's shared memory-resource tests, for any resource =====

fn zero_bytes<R: MemoryResource + ?Sized>(mr: &R, device: &Device) {
    let s = device.create_stream().unwrap();
    let ptr = mr.allocate(0, &s).unwrap();
    assert_eq!(ptr, DevicePtr(0), "{}", label(device));
    free(mr, ptr, 0, &s);
    // SAFETY: a non-null pointer with zero bytes, which the resource must refuse.
    assert!(matches!(
        unsafe { mr.deallocate(DevicePtr(0x1000), 0, &s) },
        Err(Error::UnknownPointer { .. })
    ));
}

/// 4 B, 16 B, ... 1 GiB live at once: non-null, 256-aligned, distinct, writable at both ends.
fn sizes_from_4_bytes_to_1_gib<R: MemoryResource + ?Sized>(mr: &R, device: &Device) {
    let s = device.create_stream().unwrap();
    let mut live = BTreeMap::new();
    let mut size = 4;
    while size <= 1 << 30 {
        let ptr = mr.allocate(size, &s).unwrap();
        assert_ne!(ptr.0, 0, "{}: {size} B", label(device));
        assert_eq!(
            ptr.0 % ALIGNMENT as u64,
            0,
            "{}: {size} B at {ptr:?}",
            label(device)
        );
        assert!(
            live.insert(ptr.0, size).is_none(),
            "{}: reused",
            label(device)
        );
        size *= 4;
    }
    let v: Vec<_> = live.iter().collect();
    for w in v.windows(2) {
        assert!(
            w[0].0 + *w[0].1 as u64 <= *w[1].0,
            "{}: overlap",
            label(device)
        );
    }
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
        free(mr, DevicePtr(ptr), size, &s);
    }
}

/// 1 PiB is out of memory, and the resource works as before afterwards.
fn one_pib_is_out_of_memory<R: MemoryResource + ?Sized>(mr: &R, device: &Device) {
    let s = device.create_stream().unwrap();
    match mr.allocate(1 << 50, &s) {
        Err(Error::OutOfMemory { requested, .. }) => assert_eq!(requested, 1 << 50),
        other => panic!("{}: 1 PiB gave {other:?}", label(device)),
    }
    let ptr = mr.allocate(MIB, &s).unwrap();
    free(mr, ptr, MIB, &s);
}

/// Random allocations and frees on three streams; a free on another stream than the
/// allocation's is ordered after it first. `check` runs every 250 steps and at the end.
fn random_mix<R: MemoryResource + ?Sized>(mr: &R, device: &Device, check: &dyn Fn()) {
    let streams: Vec<Stream> = (0..3).map(|_| device.create_stream().unwrap()).collect();
    let mut rng = SplitMix64(11);
    let mut live: Vec<(DevicePtr, usize, usize)> = Vec::new();
    for step in 0..3000 {
        let r = rng.next();
        if live.is_empty() || (r.is_multiple_of(2) && live.len() < 64) {
            // Mostly small, sometimes above a superblock.
            let size = if rng.next().is_multiple_of(8) {
                1 + (rng.next() % (4 * MIB as u64)) as usize
            } else {
                1 + (rng.next() % (256 * KIB as u64)) as usize
            };
            let s = (rng.next() % 3) as usize;
            let ptr = mr.allocate(size, &streams[s]).unwrap();
            live.push((ptr, size, s));
        } else {
            let (ptr, size, s) = live.swap_remove((rng.next() % live.len() as u64) as usize);
            let t = (rng.next() % 3) as usize;
            if t != s {
                streams[t].wait(&streams[s].record().unwrap()).unwrap();
            }
            free(mr, ptr, size, &streams[t]);
        }
        if step % 250 == 0 {
            check();
            let mut ranges: Vec<_> = live.iter().map(|&(p, s, _)| (p.0, s as u64)).collect();
            ranges.sort_unstable();
            assert!(
                ranges.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0),
                "{}: live blocks overlap",
                label(device)
            );
        }
    }
    for (ptr, size, s) in live {
        free(mr, ptr, size, &streams[s]);
    }
    check();
}

/// Four threads at once, each on its own stream.
fn four_threads<R: MemoryResource + ?Sized>(mr: &R, device: &Device) {
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            scope.spawn(move || {
                let s = device.create_stream().unwrap();
                let mut rng = SplitMix64(100 + t);
                let mut live = Vec::new();
                for _ in 0..2000 {
                    if live.is_empty() || rng.next().is_multiple_of(2) {
                        let size = 256 + (rng.next() % (256 * KIB as u64)) as usize;
                        live.push((mr.allocate(size, &s).unwrap(), size));
                    } else {
                        let (ptr, size) =
                            live.swap_remove((rng.next() % live.len() as u64) as usize);
                        free(mr, ptr, size, &s);
                    }
                }
                for (ptr, size) in live {
                    free(mr, ptr, size, &s);
                }
            });
        }
    });
}

/// A producer thread allocates and fills on its stream; a consumer thread waits on the
/// producer's event, checks the data on its own stream and frees there.
fn producer_consumer<R: MemoryResource + ?Sized>(mr: &R, device: &Device) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        scope.spawn(move || {
            let a = device.create_stream().unwrap();
            for i in 0..200u32 {
                let ptr = mr.allocate(4096, &a).unwrap();
                // SAFETY: 4096 live bytes; the consumer frees them after waiting on `done`.
                unsafe { a.fill_u32(ptr, i, 1024) }.unwrap();
                tx.send((ptr, i, a.record().unwrap())).unwrap();
            }
        });
        scope.spawn(move || {
            let b = device.create_stream().unwrap();
            for (ptr, i, done) in rx {
                b.wait(&done).unwrap();
                assert_eq!(read_u32(&b, ptr, 1024), vec![i; 1024], "{}", label(device));
                free(mr, ptr, 4096, &b);
            }
        });
    });
}

// ===== arena =====

fn arena(device: &Device, initial: usize, maximum: usize) -> ArenaResource<CudaResource> {
    ArenaResource::new(
        CudaResource::new(device),
        ArenaOptions {
            initial,
            maximum: Some(maximum),
            ..ArenaOptions::default()
        },
    )
    .unwrap()
}

#[test]
fn arena_shared_tests() {
    for device in devices() {
        let a = arena(&device, 0, 2048 * MIB);
        zero_bytes(&a, &device);
        assert_eq!(
            a.stats().reserved,
            0,
            "{}: zero bytes cost memory",
            label(&device)
        );
        sizes_from_4_bytes_to_1_gib(&a, &device);
        check_arena(&a);
        assert_arena_all_back(&a, &label(&device));

        let a = arena(&device, 16 * MIB, 256 * MIB);
        one_pib_is_out_of_memory(&a, &device);
        check_arena(&a);

        let a = arena(&device, 32 * MIB, 512 * MIB);
        random_mix(&a, &device, &|| check_arena(&a));
        assert_arena_all_back(&a, &label(&device));

        let a = arena(&device, 64 * MIB, 1024 * MIB);
        four_threads(&a, &device);
        assert_arena_all_back(&a, &label(&device));

        let a = arena(&device, 16 * MIB, 256 * MIB);
        producer_consumer(&a, &device);
        // Every free was remote (allocated on the producer's stream, freed on the
        // consumer's): the producer's arena adopts them at the defragmentation.
        assert_arena_all_back(&a, &label(&device));
    }
}

#[test]
fn arena_small_and_large_requests() {
    for device in devices() {
        let a = arena(&device, 8 * MIB, 64 * MIB);
        let s = device.create_stream().unwrap();
        let small = a.allocate(1000, &s).unwrap();
        let stats = a.stats();
        assert_eq!((stats.superblocks, stats.streams), (1, 1), "{stats:?}");
        assert_eq!(stats.large_allocations, 0);
        let large = a.allocate(3 * MIB, &s).unwrap();
        let stats = a.stats();
        assert_eq!(
            (stats.superblocks, stats.large_allocations),
            (1, 1),
            "{stats:?}"
        );
        assert_eq!(stats.in_use, 1024 + 3 * MIB, "{stats:?}");
        // Same-stream reuse: the freed block comes straight back.
        free(&a, small, 1000, &s);
        assert_eq!(a.allocate(1000, &s).unwrap(), small, "{}", label(&device));
        free(&a, small, 1000, &s);
        free(&a, large, 3 * MIB, &s);
        check_arena(&a);
        assert_eq!(a.superblock_size(), MIB);
        assert_eq!(a.maximum(), 64 * MIB);
        assert_arena_all_back(&a, &label(&device));
    }
}

/// Free memory spread over two streams' arenas: A's and B's superblocks alternate, and every
/// block is freed, so the streams hold four free superblocks and the global arena nothing. 3 MiB
/// cannot be served without consolidating; with it (the superblocks go back and coalesce) it
/// can, without growing.
#[test]
fn arena_defragments_before_failing() {
    for device in devices() {
        let a_mr = arena(&device, 4 * MIB, 4 * MIB);
        let (a, b, c) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let mut blocks = Vec::new();
        for _ in 0..4 {
            blocks.push((a_mr.allocate(512 * KIB, &a).unwrap(), &a));
            blocks.push((a_mr.allocate(512 * KIB, &b).unwrap(), &b));
        }
        let stats = a_mr.stats();
        assert_eq!(stats.superblocks, 4, "{stats:?}");
        assert_eq!(stats.global_free, 0, "{stats:?}");
        for (ptr, s) in blocks {
            free(&a_mr, ptr, 512 * KIB, s);
        }
        check_arena(&a_mr);
        let before = a_mr.stats();
        assert_eq!(before.superblocks, 4, "{before:?}");
        assert_eq!(before.arena_free, 4 * MIB, "{before:?}");
        assert_eq!(
            (before.global_free, before.largest_global_free),
            (0, 0),
            "{before:?}"
        );
        let dump = a_mr.dump();
        assert!(
            dump.contains("global arena: 0 free region(s), 0 B free, largest 0 B"),
            "{dump}"
        );
        assert!(dump.contains("stream arenas: 2"), "{dump}");
        assert_eq!(
            dump.matches("2 superblock(s), 2.00 MiB free in 2 block(s)")
                .count(),
            2,
            "{dump}"
        );
        assert_eq!(dump.matches("(free)").count(), 4, "{dump}");

        let big = a_mr.allocate(3 * MIB, &c).unwrap();
        let after = a_mr.stats();
        assert_eq!(after.defragments, 1, "{after:?}");
        assert_eq!(after.grows, 0, "{after:?}");
        assert_eq!(after.reserved, 4 * MIB, "{after:?}");
        assert_eq!(after.superblocks, 0, "{after:?}");
        assert_eq!(
            (after.global_free, after.largest_global_free),
            (MIB, MIB),
            "{after:?}"
        );
        let dump = a_mr.dump();
        assert!(dump.contains("defragmentations: 1"), "{dump}");
        assert!(
            dump.contains("global arena: 1 free region(s), 1.00 MiB free, largest 1.00 MiB"),
            "{dump}"
        );
        assert!(
            dump.contains("large blocks: 1 (3.00 MiB), superblocks lent: 0"),
            "{dump}"
        );
        check_arena(&a_mr);
        free(&a_mr, big, 3 * MIB, &c);
        assert_arena_all_back(&a_mr, &label(&device));
    }
}

/// A superblock freed on A (after a long kernel and a fill) goes back to the global arena at a
/// defragmentation and to C as part of a large block: C must be ordered after A's fill.
#[test]
fn arena_superblock_moving_between_streams_waits() {
    for device in devices() {
        let words = MIB / 4;
        let a_mr = arena(&device, 2 * MIB, 2 * MIB);
        let (a, b, c) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let x = a_mr.allocate(MIB, &a).unwrap();
        let y = a_mr.allocate(MIB, &b).unwrap();
        a.spin(Duration::from_millis(100)).unwrap();
        // SAFETY: a superblock's worth of live bytes at x, used on A, freed on A after.
        unsafe { a.fill_u32(x, 0xAAAA_AAAA, words) }.unwrap();
        free(&a_mr, x, MIB, &a);
        free(&a_mr, y, MIB, &b);
        let z = a_mr.allocate(2 * MIB, &c).unwrap();
        assert_eq!(z.0, x.0.min(y.0), "{}: C did not get both", label(&device));
        assert_eq!(a_mr.stats().defragments, 1);
        // SAFETY: C's block, used on C.
        unsafe { c.fill_u32(z, 0xCCCC_CCCC, 2 * words) }.unwrap();
        a.synchronize_blocking().unwrap();
        let back = read_u32(&c, z, 2 * words);
        assert!(
            back.iter().all(|&w| w == 0xCCCC_CCCC),
            "{}: A's fill overwrote C's: the superblock's move was not ordered",
            label(&device)
        );
        free(&a_mr, z, 2 * MIB, &c);
        check_arena(&a_mr);
    }
}

/// A block of A's arena freed on B (after B's long kernel and fill) is adopted by A when A runs
/// short: A's later use must be ordered after B's.
#[test]
fn arena_remote_free_is_adopted_in_order() {
    for device in devices() {
        let words = MIB / 4;
        let a_mr = arena(&device, MIB, MIB);
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let x = a_mr.allocate(MIB, &a).unwrap();
        b.wait(&a.record().unwrap()).unwrap();
        b.spin(Duration::from_millis(100)).unwrap();
        // SAFETY: live bytes at x, used on B (ordered after A), freed on B after.
        unsafe { b.fill_u32(x, 0xBBBB_BBBB, words) }.unwrap();
        free(&a_mr, x, MIB, &b);
        assert_eq!(a_mr.stats().remote_frees_pending, 1);
        let y = a_mr.allocate(MIB, &a).unwrap();
        assert_eq!(y, x, "{}: A did not get its block back", label(&device));
        assert_eq!(a_mr.stats().remote_frees_pending, 0);
        // SAFETY: A's block, used on A.
        unsafe { a.fill_u32(y, 0xAAAA_AAAA, words) }.unwrap();
        b.synchronize_blocking().unwrap();
        let back = read_u32(&a, y, words);
        assert!(
            back.iter().all(|&w| w == 0xAAAA_AAAA),
            "{}: B's fill overwrote A's: the remote free was not ordered",
            label(&device)
        );
        free(&a_mr, y, MIB, &a);
        check_arena(&a_mr);
    }
}

/// A large block freed on A goes back to the global arena guarded by an event: B, taking it,
/// must be ordered after A's work.
#[test]
fn arena_large_block_reuse_waits_for_the_freeing_stream() {
    for device in devices() {
        let words = 2 * MIB / 4;
        let a_mr = arena(&device, 4 * MIB, 4 * MIB);
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let x = a_mr.allocate(2 * MIB, &a).unwrap();
        a.spin(Duration::from_millis(100)).unwrap();
        // SAFETY: live bytes at x, used on A, freed on A after.
        unsafe { a.fill_u32(x, 0xAAAA_AAAA, words) }.unwrap();
        free(&a_mr, x, 2 * MIB, &a);
        let y = a_mr.allocate(2 * MIB, &b).unwrap();
        assert_eq!(y, x, "{}", label(&device));
        // SAFETY: B's block, used on B.
        unsafe { b.fill_u32(y, 0xBBBB_BBBB, words) }.unwrap();
        a.synchronize_blocking().unwrap();
        let back = read_u32(&b, y, words);
        assert!(
            back.iter().all(|&w| w == 0xBBBB_BBBB),
            "{}: A's fill overwrote B's",
            label(&device)
        );
        free(&a_mr, y, 2 * MIB, &b);
        check_arena(&a_mr);
    }
}

/// Four threads on four streams under a tight maximum: each frees half of what it allocates
/// itself and hands the other half to the next thread (remote frees), with large blocks mixed
/// in, while one thread also defragments now and then. Allocation failures are allowed (the
/// maximum is tight, so allocation also adopts, defragments and fails), but nothing may be lost
/// or overlap.
#[test]
fn arena_stress_remote_frees_and_defragmentation() {
    for device in devices() {
        let a_mr = arena(&device, 0, 48 * MIB);
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..4)
            .map(|_| std::sync::mpsc::channel::<(DevicePtr, usize, streamalloc::Event)>())
            .unzip();
        let successes = Mutex::new(Vec::new());
        std::thread::scope(|scope| {
            for (t, rx) in rxs.into_iter().enumerate() {
                let tx = txs[(t + 1) % 4].clone();
                let (a_mr, device, all_successes) = (&a_mr, &device, &successes);
                scope.spawn(move || {
                    let s = device.create_stream().unwrap();
                    let mut rng = SplitMix64(7 + t as u64);
                    let mut mine: Vec<(DevicePtr, usize)> = Vec::new();
                    let mut succeeded = 0;
                    for step in 0..1500 {
                        // Free what others sent, on our stream, after their event.
                        while let Ok((ptr, size, done)) = rx.try_recv() {
                            s.wait(&done).unwrap();
                            free(a_mr, ptr, size, &s);
                        }
                        let r = rng.next();
                        if mine.is_empty() || (r.is_multiple_of(2) && mine.len() < 48) {
                            let size = if r.is_multiple_of(17) {
                                MIB + (rng.next() % (3 * MIB as u64)) as usize
                            } else {
                                256 + (rng.next() % (128 * KIB as u64)) as usize
                            };
                            match a_mr.allocate(size, &s) {
                                Ok(ptr) => {
                                    mine.push((ptr, size));
                                    succeeded += 1;
                                }
                                Err(Error::OutOfMemory { .. }) => {}
                                Err(e) => panic!("{e}"),
                            }
                        } else {
                            let (ptr, size) =
                                mine.swap_remove((rng.next() % mine.len() as u64) as usize);
                            if r % 4 == 1 {
                                free(a_mr, ptr, size, &s);
                            } else {
                                // The receiver may be gone already: then free it ourselves.
                                if let Err(back) = tx.send((ptr, size, s.record().unwrap())) {
                                    let (ptr, size, _) = back.0;
                                    free(a_mr, ptr, size, &s);
                                }
                            }
                        }
                        if t == 0 && step % 100 == 0 {
                            a_mr.defragment();
                        }
                    }
                    for (ptr, size) in mine {
                        free(a_mr, ptr, size, &s);
                    }
                    all_successes.lock().unwrap().push(succeeded);
                    // Keep receiving until every sender is done.
                    drop(tx);
                    for (ptr, size, done) in rx {
                        s.wait(&done).unwrap();
                        free(a_mr, ptr, size, &s);
                    }
                });
            }
            drop(txs);
        });
        check_arena(&a_mr);
        let stats = a_mr.stats();
        assert!(stats.reserved <= 48 * MIB, "{stats:?}");
        assert!(stats.defragments > 0, "{stats:?}");
        // The maximum is tight: failures happen, in numbers that depend on timing.
        let succeeded: usize = successes.lock().unwrap().iter().sum();
        assert!(
            succeeded > 1000,
            "{succeeded} allocations succeeded: {stats:?}"
        );
        assert_arena_all_back(&a_mr, &label(&device));
    }
}

#[test]
fn arena_growth_stops_at_the_maximum() {
    for device in devices() {
        let a_mr = arena(&device, 0, 10 * MIB);
        let s = device.create_stream().unwrap();
        let mut live = Vec::new();
        loop {
            match a_mr.allocate(MIB, &s) {
                Ok(ptr) => live.push(ptr),
                Err(Error::OutOfMemory {
                    requested,
                    available,
                    maximum,
                }) => {
                    assert_eq!((requested, maximum), (MIB, 10 * MIB), "{}", label(&device));
                    assert!(available < MIB, "{available} available yet refused");
                    break;
                }
                Err(e) => panic!("{}: {e}", label(&device)),
            }
        }
        assert_eq!(live.len(), 10, "{}", label(&device));
        let stats = a_mr.stats();
        assert!(stats.grows >= 2, "{stats:?}");
        assert!(stats.peak_reserved <= 10 * MIB, "{stats:?}");
        assert!(a_mr.dump().contains("stream arenas: 1"));
        for ptr in live {
            free(&a_mr, ptr, MIB, &s);
        }
        let again: Vec<_> = (0..10).map(|_| a_mr.allocate(MIB, &s).unwrap()).collect();
        assert_eq!(
            a_mr.stats().reserved,
            10 * MIB,
            "usable after OOM, without growing"
        );
        for ptr in again {
            free(&a_mr, ptr, MIB, &s);
        }
        check_arena(&a_mr);
    }
}

#[test]
fn arena_forgets_dropped_streams_that_hold_nothing() {
    for device in devices() {
        let a_mr = arena(&device, 4 * MIB, 4 * MIB);
        {
            let s = device.create_stream().unwrap();
            let ptr = a_mr.allocate(4 * KIB, &s).unwrap();
            free(&a_mr, ptr, 4 * KIB, &s);
        }
        assert_eq!(a_mr.stats().streams, 1);
        a_mr.defragment();
        let stats = a_mr.stats();
        assert_eq!((stats.streams, stats.superblocks), (0, 0), "{stats:?}");
        assert_eq!(stats.global_free, 4 * MIB);
        check_arena(&a_mr);
    }
}

#[test]
fn arena_bad_arguments_are_errors() {
    let device = &devices()[0];
    let bad = |initial, maximum, superblock_size| {
        ArenaResource::new(
            CudaResource::new(device),
            ArenaOptions {
                initial,
                maximum,
                superblock_size,
            },
        )
        .unwrap_err()
    };
    assert!(matches!(
        bad(1000, Some(MIB), MIB),
        Error::InvalidSize { size: 1000, .. }
    ));
    assert!(matches!(
        bad(0, Some(MIB + 1), MIB),
        Error::InvalidSize { .. }
    ));
    assert!(matches!(
        bad(2 * MIB, Some(MIB), MIB),
        Error::InvalidSize { .. }
    ));
    assert!(matches!(bad(0, None, 0), Error::InvalidSize { .. }));
    assert!(matches!(bad(0, None, 1000), Error::InvalidSize { .. }));

    let a_mr = arena(device, 4 * MIB, 16 * MIB);
    let s = device.create_stream().unwrap();
    // SAFETY: deliberately wrong pointers: the arena must refuse them without touching memory.
    unsafe {
        for (ptr, bytes) in [(12345, 256), (0x1000, 256), (0x1000, 2 * MIB), (0x1000, 0)] {
            assert!(
                matches!(
                    a_mr.deallocate(DevicePtr(ptr), bytes, &s),
                    Err(Error::UnknownPointer { .. })
                ),
                "{ptr:#x} {bytes}"
            );
        }
    }
    for bytes in [1024, 2 * MIB] {
        let ptr = a_mr.allocate(bytes, &s).unwrap();
        free(&a_mr, ptr, bytes, &s);
        // SAFETY: a double free, which the arena detects and refuses.
        assert!(matches!(
            unsafe { a_mr.deallocate(ptr, bytes, &s) },
            Err(Error::UnknownPointer { .. })
        ));
    }
    let other = Device::simulated(SimConfig::default())
        .create_stream()
        .unwrap();
    assert!(matches!(
        a_mr.allocate(256, &other),
        Err(Error::WrongDevice { .. })
    ));
    check_arena(&a_mr);
}

// ===== binning =====

/// Counts what goes through it: a tiny stand-in for a tracking adaptor.
#[derive(Debug)]
struct Counting {
    inner: CudaResource,
    allocs: Mutex<Vec<usize>>,
    frees: Mutex<Vec<usize>>,
}

impl Counting {
    fn new(device: &Device) -> Arc<Self> {
        Arc::new(Self {
            inner: CudaResource::new(device),
            allocs: Mutex::new(Vec::new()),
            frees: Mutex::new(Vec::new()),
        })
    }

    fn allocs(&self) -> Vec<usize> {
        self.allocs.lock().unwrap().clone()
    }

    fn frees(&self) -> Vec<usize> {
        self.frees.lock().unwrap().clone()
    }
}

impl MemoryResource for Counting {
    fn device(&self) -> &Device {
        self.inner.device()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> streamalloc::Result<DevicePtr> {
        self.allocs.lock().unwrap().push(bytes);
        self.inner.allocate(bytes, stream)
    }

    unsafe fn deallocate(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        stream: &Stream,
    ) -> streamalloc::Result<()> {
        self.frees.lock().unwrap().push(bytes);
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.deallocate(ptr, bytes, stream) }
    }
}

fn binning_over_pool(device: &Device) -> BinningResource<PoolResource<CudaResource>> {
    let pool = PoolResource::new(
        CudaResource::new(device),
        PoolOptions {
            initial: 0,
            maximum: Some(4096 * MIB),
            ..PoolOptions::default()
        },
    )
    .unwrap();
    BinningResource::builder(pool)
        .bins_pow2(18, 22)
        .blocks_per_chunk(8)
        .build()
        .unwrap()
}

#[test]
fn binning_shared_tests() {
    for device in devices() {
        let b = binning_over_pool(&device);
        zero_bytes(&b, &device);
        assert_eq!(b.upstream().stats().reserved, 0);
        sizes_from_4_bytes_to_1_gib(&b, &device);
        one_pib_is_out_of_memory(&b, &device);
        random_mix(&b, &device, &|| b.upstream().check_invariants().unwrap());
        four_threads(&b, &device);
        producer_consumer(&b, &device);
        b.upstream().check_invariants().unwrap();
    }
}

#[test]
fn binning_routes_sizes_to_the_smallest_bin_that_holds_them() {
    for device in devices() {
        let bins = [
            Counting::new(&device),
            Counting::new(&device),
            Counting::new(&device),
        ];
        let fallback = Counting::new(&device);
        let b = BinningResource::builder(CudaResource::new(&device))
            .add_bin(4 * KIB, bins[1].clone() as ResourceRef)
            .add_bin(KIB, bins[0].clone() as ResourceRef)
            .add_bin(64 * KIB, bins[2].clone() as ResourceRef)
            .fallback(fallback.clone())
            .build()
            .unwrap();
        assert_eq!(b.bin_sizes(), vec![KIB, 4 * KIB, 64 * KIB]);
        assert_eq!(b.bin_for(1), Some(0));
        assert_eq!(b.bin_for(KIB + 1), Some(1));
        assert_eq!(b.bin_for(64 * KIB + 1), None);
        let s = device.create_stream().unwrap();
        let sizes = [
            1,
            KIB,
            KIB + 1,
            4 * KIB,
            4 * KIB + 1,
            64 * KIB,
            64 * KIB + 1,
            MIB,
        ];
        let ptrs: Vec<_> = sizes.iter().map(|&n| b.allocate(n, &s).unwrap()).collect();
        assert_eq!(bins[0].allocs(), vec![1, KIB]);
        assert_eq!(bins[1].allocs(), vec![KIB + 1, 4 * KIB]);
        assert_eq!(bins[2].allocs(), vec![4 * KIB + 1, 64 * KIB]);
        assert_eq!(fallback.allocs(), vec![64 * KIB + 1, MIB]);
        for (ptr, n) in ptrs.into_iter().zip(sizes) {
            free(&b, ptr, n, &s);
        }
        // Frees go back by the same rule.
        assert_eq!(bins[0].frees(), vec![1, KIB]);
        assert_eq!(bins[1].frees(), vec![KIB + 1, 4 * KIB]);
        assert_eq!(bins[2].frees(), vec![4 * KIB + 1, 64 * KIB]);
        assert_eq!(fallback.frees(), vec![64 * KIB + 1, MIB]);
        // Zero bytes reach no bin.
        assert_eq!(b.allocate(0, &s).unwrap(), DevicePtr(0));
        assert_eq!(bins[0].allocs().len(), 2);
    }
}

/// Fixed-size bins take chunks of `blocks_per_chunk` blocks from the shared upstream; larger
/// requests go to the upstream as they are.
#[test]
fn binning_fixed_bins_share_the_upstream() {
    for device in devices() {
        let upstream = Counting::new(&device);
        let b = BinningResource::builder(upstream.clone())
            .bins_pow2(10, 12)
            .blocks_per_chunk(4)
            .build()
            .unwrap();
        assert_eq!(b.bin_sizes(), vec![1024, 2048, 4096]);
        let s = device.create_stream().unwrap();
        let sizes = [1000, 2000, 4000, 5000, 900];
        let ptrs: Vec<_> = sizes.iter().map(|&n| b.allocate(n, &s).unwrap()).collect();
        // One chunk per bin used (the second 1 KiB block comes from the first chunk), then
        // the fallback's request.
        assert_eq!(upstream.allocs(), vec![4 * 1024, 4 * 2048, 4 * 4096, 5000]);
        let mut sorted: Vec<u64> = ptrs.iter().map(|p| p.0).collect();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), sizes.len(), "{}", label(&device));
        for (ptr, n) in ptrs.into_iter().zip(sizes) {
            free(&b, ptr, n, &s);
        }
        assert_eq!(
            upstream.frees(),
            vec![5000],
            "bins keep their chunks until dropped"
        );
        drop(b);
        assert_eq!(
            upstream.frees().len(),
            4,
            "dropping the bins returns their chunks"
        );
    }
}

#[test]
fn binning_bad_arguments_are_errors() {
    let device = &devices()[0];
    let build_err = |builder: streamalloc::resource::binning::BinningBuilder<CudaResource>| {
        builder.build().unwrap_err()
    };
    let up = || BinningResource::builder(CudaResource::new(device));
    assert!(matches!(
        build_err(up().bins_pow2(12, 10)),
        Error::InvalidSize { .. }
    ));
    assert!(matches!(
        build_err(up().bins_pow2(10, 64)),
        Error::InvalidSize { .. }
    ));
    assert!(matches!(
        build_err(up().add_bin(0, None)),
        Error::InvalidSize { .. }
    ));
    assert!(matches!(
        build_err(up().add_bin(1024, None).blocks_per_chunk(0)),
        Error::InvalidSize { .. }
    ));
    let other = Device::simulated(SimConfig::default());
    assert!(matches!(
        build_err(up().add_bin(1024, Arc::new(CudaResource::new(&other)) as ResourceRef)),
        Error::WrongDevice { .. }
    ));
    assert!(matches!(
        build_err(up().fallback(Arc::new(CudaResource::new(&other)))),
        Error::WrongDevice { .. }
    ));
    // A later bin of the same size replaces the earlier one.
    let b = up()
        .add_bin(1000, None)
        .add_bin(1024, None)
        .build()
        .unwrap();
    assert_eq!(b.bin_sizes(), vec![1024]);
    let s = other.create_stream().unwrap();
    assert!(matches!(
        b.allocate(100, &s),
        Err(Error::WrongDevice { .. })
    ));
}

// ===== callback =====

type Calls = Arc<Mutex<Vec<(&'static str, u64, usize, StreamId)>>>;

/// A callback resource over the device's memory (through a `CudaResource`), recording every
/// call of its closures.
fn callback(device: &Device) -> (CallbackResource, Calls) {
    let calls: Calls = Arc::default();
    let (alloc_calls, free_calls) = (calls.clone(), calls.clone());
    let (cuda_a, cuda_f) = (CudaResource::new(device), CudaResource::new(device));
    let mr = CallbackResource::new(
        device,
        move |bytes, stream| {
            let ptr = cuda_a.allocate(bytes, stream)?;
            alloc_calls
                .lock()
                .unwrap()
                .push(("allocate", ptr.0, bytes, stream.id()));
            Ok(ptr)
        },
        move |ptr, bytes, stream| {
            free_calls
                .lock()
                .unwrap()
                .push(("deallocate", ptr.0, bytes, stream.id()));
            // SAFETY: only pointers from the allocate closure come back here, with their size.
            unsafe { cuda_f.deallocate(ptr, bytes, stream) }
        },
    );
    (mr, calls)
}

#[test]
fn callback_shared_tests() {
    for device in devices() {
        let (mr, calls) = callback(&device);
        zero_bytes(&mr, &device);
        assert!(
            calls.lock().unwrap().is_empty(),
            "zero bytes called a closure"
        );
        sizes_from_4_bytes_to_1_gib(&mr, &device);
        one_pib_is_out_of_memory(&mr, &device);
        random_mix(&mr, &device, &|| {});
        four_threads(&mr, &device);
        producer_consumer(&mr, &device);
        let calls = calls.lock().unwrap();
        let allocs = calls.iter().filter(|c| c.0 == "allocate").count();
        let frees = calls.iter().filter(|c| c.0 == "deallocate").count();
        assert_eq!(allocs, frees, "{}", label(&device));
    }
}

#[test]
fn callback_closures_get_the_right_arguments() {
    for device in devices() {
        let (mr, calls) = callback(&device);
        assert_eq!(mr.memory_kind(), MemoryKind::Device);
        let (s, t) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let ptr = mr.allocate(1000, &s).unwrap();
        t.wait(&s.record().unwrap()).unwrap();
        free(&mr, ptr, 1000, &t);
        assert_eq!(
            *calls.lock().unwrap(),
            vec![
                ("allocate", ptr.0, 1000, s.id()),
                ("deallocate", ptr.0, 1000, t.id())
            ]
        );
        let other = Device::simulated(SimConfig::default())
            .create_stream()
            .unwrap();
        assert!(matches!(
            mr.allocate(1, &other),
            Err(Error::WrongDevice { .. })
        ));
        assert_eq!(
            calls.lock().unwrap().len(),
            2,
            "a closure ran for a wrong stream"
        );
    }
}

#[test]
fn callback_pointers_that_break_the_contract_are_errors() {
    let device = &devices()[0];
    let freed = Arc::new(AtomicUsize::new(0));
    let f = freed.clone();
    let misaligned = CallbackResource::new(
        device,
        |_, _| Ok(DevicePtr(0x1010)),
        move |ptr, _, _| {
            assert_eq!(ptr, DevicePtr(0x1010));
            f.fetch_add(1, Ordering::SeqCst);
            Ok(())
        },
    )
    .with_memory_kind(MemoryKind::Managed);
    assert_eq!(misaligned.memory_kind(), MemoryKind::Managed);
    let s = device.create_stream().unwrap();
    assert!(matches!(
        misaligned.allocate(64, &s),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(
        freed.load(Ordering::SeqCst),
        1,
        "the misaligned pointer was not given back"
    );
    let null = CallbackResource::new(device, |_, _| Ok(DevicePtr(0)), |_, _, _| Ok(()));
    assert!(matches!(
        null.allocate(64, &s),
        Err(Error::InvalidArgument { .. })
    ));
    let failing = CallbackResource::new(
        device,
        |bytes, _| {
            Err(Error::OutOfMemory {
                requested: bytes,
                available: 0,
                maximum: 0,
            })
        },
        |_, _, _| Ok(()),
    );
    assert!(matches!(
        failing.allocate(64, &s),
        Err(Error::OutOfMemory { requested: 64, .. })
    ));
}

// ===== the current resource =====

fn same(a: &ResourceRef, b: &ResourceRef) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}

#[test]
fn current_resource_defaults_and_set_returns_the_previous() {
    for device in devices() {
        let initial = current_resource(&device);
        assert_eq!(initial.device().id(), device.id());
        assert!(same(&initial, &current_resource(&device)), "made twice");
        let s = device.create_stream().unwrap();
        let ptr = initial.allocate(4096, &s).unwrap();
        free(&*initial, ptr, 4096, &s);

        let pool: ResourceRef = Arc::new(
            PoolResource::new(CudaResource::new(&device), PoolOptions::default()).unwrap(),
        );
        let previous = set_current_resource(&device, pool.clone()).unwrap();
        assert!(same(&previous, &initial));
        assert!(same(&current_resource(&device), &pool));
        let arena: ResourceRef = Arc::new(arena(&device, 0, 64 * MIB));
        assert!(same(
            &set_current_resource(&device, arena.clone()).unwrap(),
            &pool
        ));
        assert!(same(&reset_current_resource(&device).unwrap(), &arena));
        // After a reset, a new default.
        let fresh = current_resource(&device);
        assert!(!same(&fresh, &initial));
        reset_current_resource(&device);

        // A device with nothing set or made: set returns None.
        let other = Device::simulated(SimConfig::default());
        let cuda: ResourceRef = Arc::new(CudaResource::new(&other));
        assert!(set_current_resource(&other, cuda.clone()).is_none());
        assert!(same(&current_resource(&other), &cuda));
        // Devices do not share entries.
        assert!(!same(&current_resource(&device), &cuda));
        reset_current_resource(&other);
        reset_current_resource(&device);
    }
}

#[test]
fn current_resource_is_thread_safe() {
    let device = Device::simulated(SimConfig::default());
    let candidates: Vec<ResourceRef> = (0..4)
        .map(|_| Arc::new(CudaResource::new(&device)) as ResourceRef)
        .collect();
    let default = current_resource(&device);
    std::thread::scope(|scope| {
        for t in 0..4 {
            let (device, candidates, default) = (&device, &candidates, &default);
            scope.spawn(move || {
                let own = Device::simulated(SimConfig::default());
                let s = device.create_stream().unwrap();
                for i in 0..500 {
                    let previous = set_current_resource(device, candidates[(t + i) % 4].clone());
                    let previous = previous.expect("the default was made before");
                    assert!(
                        same(&previous, default) || candidates.iter().any(|c| same(c, &previous))
                    );
                    let now = current_resource(device);
                    assert!(candidates.iter().any(|c| same(c, &now)));
                    let ptr = now.allocate(256, &s).unwrap();
                    free(&*now, ptr, 256, &s);
                    // Each thread's own device, alongside.
                    let mine = current_resource(&own);
                    assert_eq!(mine.device().id(), own.id());
                }
                reset_current_resource(&own);
            });
        }
    });
    let last = reset_current_resource(&device).unwrap();
    assert!(candidates.iter().any(|c| same(c, &last)));
}
