//! `ArenaResource`: RMM's shared tests, small and large requests, defragmentation, superblocks
//! moving between streams, remote frees, growth, bad arguments.

use super::*;

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
    // A superblock above the maximum: small requests grow by a whole superblock, so every one
    // would fail (a review's finding).
    assert!(matches!(
        bad(0, Some(16 * MIB), 32 * MIB),
        Error::InvalidSize { size, .. } if size == 32 * MIB
    ));

    let a_mr = arena(device, 4 * MIB, 16 * MIB);
    let s = device.create_stream().unwrap();
    // SAFETY: deliberately wrong pointers: the arena must refuse them without touching memory.
    unsafe {
        // Near `u64::MAX` too, with and without a superblock on the stream (a review found
        // the bounds check overflowing there, a panic in debug builds).
        let held = a_mr.allocate(256, &s).unwrap();
        let near_max = u64::MAX - 255;
        for (ptr, bytes) in [
            (12345, 256),
            (0x1000, 256),
            (0x1000, 2 * MIB),
            (0x1000, 0),
            (near_max, 256),
            (near_max, 2 * MIB),
        ] {
            assert!(
                matches!(
                    a_mr.deallocate(DevicePtr(ptr), bytes, &s),
                    Err(Error::UnknownPointer { .. })
                ),
                "{ptr:#x} {bytes}"
            );
        }
        let other = a_mr.device().create_stream().unwrap();
        assert!(matches!(
            a_mr.deallocate(DevicePtr(near_max), 256, &other),
            Err(Error::UnknownPointer { .. })
        ));
        a_mr.deallocate(held, 256, &s).unwrap();
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
