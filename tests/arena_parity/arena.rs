//! The arena beside RMM's `arena_memory_resource`: whole-maximum requests after growth in
//! chunks, superblocks not pinned by small blocks, trim, and dropped arenas letting go of their
//! streams.

use super::*;

fn free(mr: &ArenaResource<CudaResource>, ptr: DevicePtr, bytes: usize, stream: &Stream) {
    // SAFETY: allocated from `mr` with `bytes`; its uses are ordered before this point of
    // `stream`; freed once.
    unsafe { mr.deallocate(ptr, bytes, stream) }
        .unwrap_or_else(|e| panic!("free of {ptr:?} ({bytes} bytes): {e}\n{}", mr.dump()));
}

/// Grows an arena of 8 MiB at most, from nothing, in four chunks (1, 1, 2 and 4 MiB) with
/// eight 1 MiB blocks on `a`, then frees them alternately on `a` and on `b` (ordered after
/// `a`), and lets the GPU finish: the arena is idle with everything free.
fn grown_in_four_chunks(device: &Device) -> ArenaResource<CudaResource> {
    let mr = arena(device, 0, 8 * MIB);
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let blocks: Vec<DevicePtr> = (0..8).map(|_| mr.allocate(MIB, &a).unwrap()).collect();
    let stats = mr.stats();
    assert_eq!(
        (stats.chunks, stats.reserved),
        (4, 8 * MIB),
        "{}: {stats:?}",
        label(device)
    );
    b.wait(&a.record().unwrap()).unwrap();
    for (i, ptr) in blocks.into_iter().enumerate() {
        free(&mr, ptr, MIB, if i % 2 == 0 { &a } else { &b });
    }
    a.synchronize_blocking().unwrap();
    b.synchronize_blocking().unwrap();
    check_arena(&mr);
    mr
}

/// Finding 3: `allocate(8 MiB)` on an idle, wholly free arena of 8 MiB that grew in four
/// chunks failed with `available: 8388608`.
#[test]
fn an_arena_grown_in_chunks_serves_its_whole_maximum() {
    for device in devices() {
        let what = label(&device);
        let mr = grown_in_four_chunks(&device);
        let c = device.create_stream().unwrap();
        let all = mr
            .allocate(8 * MIB, &c)
            .unwrap_or_else(|e| panic!("{what}: {e}\n{}", mr.dump()));
        let stats = mr.stats();
        assert_eq!(stats.reserved, 8 * MIB, "{what}: {stats:?}");
        assert!(stats.peak_reserved <= 8 * MIB, "{what}: {stats:?}");
        assert_eq!(stats.chunks, 1, "{what}: {stats:?}");
        assert_eq!(stats.chunks_released, 4, "{what}: {stats:?}");
        check_arena(&mr);
        // The whole block is usable on `c`.
        // SAFETY: `all` is 8 MiB of live memory, used on `c` only.
        unsafe { c.fill_u32(all, 0x5A5A_5A5A, 2 * MIB) }.unwrap();
        let back = read_u32(&c, all.offset(8 * MIB - 64), 16);
        assert!(back.iter().all(|&w| w == 0x5A5A_5A5A), "{what}");
        free(&mr, all, 8 * MIB, &c);
        assert_arena_all_back(&mr, &what);
    }
}

/// An arena whose maximum is not a whole number of superblocks past what it holds serves
/// small requests from the room left under it: grown from nothing to 1 MiB (one superblock) of
/// a 1.5 MiB maximum, a request of 256 KiB is served from the last 512 KiB. (A review found it
/// refused, `OutOfMemory` with 512 KiB available: a small request grew by a whole superblock
/// or not at all, so no small request could ever use that room.) The same with the initial
/// size 1 MiB.
#[test]
fn small_requests_use_the_room_under_the_maximum_less_than_a_superblock() {
    for device in devices() {
        for initial in [0, MIB] {
            let what = format!("{}, initial {initial}", label(&device));
            let mr = arena(&device, initial, 3 * MIB / 2);
            let a = device.create_stream().unwrap();
            let x = mr.allocate(MIB, &a).unwrap();
            let y = mr
                .allocate(256 * KIB, &a)
                .unwrap_or_else(|e| panic!("{what}: {e}\n{}", mr.dump()));
            let z = mr.allocate(256 * KIB, &a).unwrap();
            match mr.allocate(256, &a) {
                Err(Error::OutOfMemory { available, .. }) => assert_eq!(available, 0, "{what}"),
                other => panic!("{what}: {other:?}"),
            }
            assert_eq!(mr.stats().reserved, 3 * MIB / 2, "{what}");
            check_arena(&mr);
            for (ptr, bytes) in [(x, MIB), (y, 256 * KIB), (z, 256 * KIB)] {
                free(&mr, ptr, bytes, &a);
            }
            check_arena(&mr);
            a.synchronize_blocking().unwrap();
        }
    }
}

/// Finding 3, awaited: `allocate_async(8 MiB)` on the same arena waited forever. Now it is
/// served at its first poll.
#[test]
fn allocate_async_of_the_whole_maximum_is_served_at_once() {
    for device in devices() {
        let what = label(&device);
        let mr = grown_in_four_chunks(&device);
        let c = device.create_stream().unwrap();
        let all = mr
            .allocate_async(8 * MIB, &c)
            .now_or_never()
            .unwrap_or_else(|| panic!("{what}: waits although all 8 MiB are free\n{}", mr.dump()))
            .unwrap();
        assert_eq!(mr.stats().chunks, 1, "{what}");
        free(&mr, all, 8 * MIB, &c);
        assert_arena_all_back(&mr, &what);
    }
}

/// Finding 4, RMM's "free on another thread after superblocks moved between streams"
/// (`PerThreadToStreamDealloc`): a 2 MiB arena; 256 bytes live on `t` (the thread's stream),
/// 32 KiB allocated and freed on `s`; then 1 MiB and 32 KiB on `d`. The second needs the rest
/// of `t`'s superblock, which its one live block used to pin to `t`: it failed with 1,048,320
/// bytes available. The live block is then freed on `t`, after its superblock moved.
#[test]
fn one_small_live_block_does_not_pin_a_superblock() {
    for device in devices() {
        let what = label(&device);
        let mr = arena(&device, 2 * MIB, 2 * MIB);
        let (t, s, d) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let thread_ptr = mr.allocate(256, &t).unwrap();
        let ptr = mr.allocate(32 * KIB, &s).unwrap();
        free(&mr, ptr, 32 * KIB, &s);
        // The global arena is empty: this defragments and gets `s`'s superblock.
        let ptr1 = mr.allocate(MIB, &d).unwrap();
        // Nothing is free but the rest of `t`'s superblock.
        let ptr2 = mr
            .allocate(32 * KIB, &d)
            .unwrap_or_else(|e| panic!("{what}: {e}\n{}", mr.dump()));
        let stats = mr.stats();
        assert_eq!(stats.superblock_moves, 1, "{what}: {stats:?}");
        assert_eq!(stats.grows, 0, "{what}: {stats:?}");
        check_arena(&mr);
        // The live block's superblock belongs to `d` now: freed on `t`, it is a remote free.
        free(&mr, thread_ptr, 256, &t);
        assert_eq!(mr.stats().remote_frees_pending, 1, "{what}");
        free(&mr, ptr1, MIB, &d);
        free(&mr, ptr2, 32 * KIB, &d);
        check_arena(&mr);
        assert_arena_all_back(&mr, &what);
        // And the whole arena is one request again.
        let all = mr.allocate(2 * MIB, &s).unwrap();
        free(&mr, all, 2 * MIB, &s);
    }
}

/// A superblock that moves from `a` to `b` carries memory `a` wrote to (after a long kernel)
/// and freed: `b`'s use of it must be ordered after `a`'s write.
#[test]
fn a_moved_superblock_is_ordered_after_its_old_stream() {
    for device in devices() {
        let what = label(&device);
        let words = 512 * KIB / 4;
        let mr = arena(&device, 2 * MIB, 2 * MIB);
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let pin = mr.allocate(256, &a).unwrap();
        let x = mr.allocate(512 * KIB, &a).unwrap();
        a.spin(Duration::from_millis(100)).unwrap();
        // SAFETY: live bytes at x, used on `a`, freed on `a` after.
        unsafe { a.fill_u32(x, 0xAAAA_AAAA, words) }.unwrap();
        free(&mr, x, 512 * KIB, &a);
        // `b` takes the other superblock whole, then needs `a`'s.
        let y = mr.allocate(MIB, &b).unwrap();
        let z = mr
            .allocate(512 * KIB, &b)
            .unwrap_or_else(|e| panic!("{what}: {e}\n{}", mr.dump()));
        assert_eq!(mr.stats().superblock_moves, 1, "{what}");
        assert!(
            z.as_raw() < x.as_raw() + 512 * KIB as u64
                && x.as_raw() < z.as_raw() + 512 * KIB as u64,
            "{what}: z does not reuse x's memory, the test shows nothing"
        );
        // SAFETY: `b`'s block, used on `b`.
        unsafe { b.fill_u32(z, 0xBBBB_BBBB, words) }.unwrap();
        a.synchronize_blocking().unwrap();
        let back = read_u32(&b, z, words);
        assert!(
            back.iter().all(|&w| w == 0xBBBB_BBBB),
            "{what}: a's fill landed after b's: the move was not ordered"
        );
        free(&mr, pin, 256, &a);
        free(&mr, z, 512 * KIB, &b);
        free(&mr, y, MIB, &b);
        assert_arena_all_back(&mr, &what);
    }
}

/// `trim_blocking` gives back the wholly free chunks and keeps the one with a live block; after
/// that block is freed, `trim` (awaited) gives back the last one. The arena grows again
/// afterwards.
#[test]
fn trim_gives_wholly_free_chunks_back() {
    let rt = runtime();
    for device in devices() {
        let what = label(&device);
        let mr = arena(&device, 0, 8 * MIB);
        let a = device.create_stream().unwrap();
        // The first block is in the first chunk (1 MiB); the other seven fill the rest.
        let first = mr.allocate(256, &a).unwrap();
        let rest: Vec<DevicePtr> = (0..7).map(|_| mr.allocate(MIB, &a).unwrap()).collect();
        let stats = mr.stats();
        assert_eq!(stats.chunks, 4, "{what}: {stats:?}");
        for ptr in rest {
            free(&mr, ptr, MIB, &a);
        }
        let released = mr.trim_blocking().unwrap();
        let stats = mr.stats();
        assert_eq!(released, 7 * MIB, "{what}: {stats:?}\n{}", mr.dump());
        assert_eq!(
            (stats.chunks, stats.reserved),
            (1, MIB),
            "{what}: {stats:?}"
        );
        check_arena(&mr);
        free(&mr, first, 256, &a);
        let released = rt.block_on(mr.trim()).unwrap();
        let stats = mr.stats();
        assert_eq!(released, MIB, "{what}: {stats:?}");
        assert_eq!((stats.chunks, stats.reserved), (0, 0), "{what}: {stats:?}");
        assert_eq!(stats.chunks_released, 4, "{what}: {stats:?}");
        assert_eq!(
            mr.trim_blocking().unwrap(),
            0,
            "{what}: nothing left to trim"
        );
        check_arena(&mr);
        let again = mr.allocate(4 * MIB, &a).unwrap();
        free(&mr, again, 4 * MIB, &a);
        assert_arena_all_back(&mr, &what);
    }
}

/// A trim waits for the GPU work that used a chunk before it frees it upstream: a fill queued
/// behind a long kernel, freed at once, then trimmed. On the simulated device a fill into
/// memory already given back is an error at the stream; on a GPU, a write into freed memory.
#[test]
fn trim_waits_for_the_work_on_its_chunks() {
    let rt = runtime();
    for device in devices() {
        let what = label(&device);
        for awaited in [false, true] {
            let mr = arena(&device, 0, 16 * MIB);
            let a = device.create_stream().unwrap();
            let x = mr.allocate(4 * MIB, &a).unwrap();
            a.spin(Duration::from_millis(100)).unwrap();
            // SAFETY: live bytes at x, used on `a`, freed on `a` after.
            unsafe { a.fill_u32(x, 0xAAAA_AAAA, MIB) }.unwrap();
            free(&mr, x, 4 * MIB, &a);
            let released = if awaited {
                rt.block_on(mr.trim()).unwrap()
            } else {
                mr.trim_blocking().unwrap()
            };
            assert_eq!(released, 4 * MIB, "{what}");
            a.synchronize_blocking()
                .unwrap_or_else(|e| panic!("{what} (awaited: {awaited}): {e}"));
            assert_eq!(mr.stats().reserved, 0, "{what}");
        }
    }
}

/// The trim future can be sent to another thread (a runtime's worker).
#[test]
fn the_trim_future_is_send() {
    fn send<T: Send>(_: &T) {}
    let device = &devices()[0];
    let mr = arena(device, 0, MIB);
    let trim = mr.trim();
    send(&trim);
    drop(trim);
}

/// A `trim` dropped while it waits for the GPU puts the chunks it took back: nothing is lost,
/// the arena is whole and serves its maximum, and a later trim gives them back.
#[test]
fn a_cancelled_trim_loses_nothing() {
    for device in devices() {
        let what = label(&device);
        let mr = arena(&device, 0, 8 * MIB);
        let a = device.create_stream().unwrap();
        let x = mr.allocate(4 * MIB, &a).unwrap();
        a.spin(Duration::from_millis(300)).unwrap();
        free(&mr, x, 4 * MIB, &a);
        let before = mr.stats();
        // Polled once and dropped: it waits for `a`'s kernel (unless that already ran).
        let done = mr.trim().now_or_never();
        check_arena(&mr);
        let after = mr.stats();
        match done {
            None => {
                assert_eq!(after.reserved, before.reserved, "{what}: {after:?}");
                assert_eq!(after.chunks, before.chunks, "{what}: {after:?}");
                assert_eq!(after.global_free, before.reserved, "{what}: {after:?}");
                let all = mr.allocate(8 * MIB, &a).unwrap();
                free(&mr, all, 8 * MIB, &a);
            }
            Some(result) => assert_eq!(result.unwrap(), 4 * MIB, "{what}"),
        }
        mr.trim_blocking().unwrap();
        let stats = mr.stats();
        assert_eq!((stats.reserved, stats.chunks), (0, 0), "{what}: {stats:?}");
        a.synchronize_blocking().unwrap();
    }
}

/// An awaited request at the whole maximum while a `trim` holds the arena's only chunk (its
/// stream busy): served at once from that chunk, which the trim then does not give back; a
/// trim dropped afterwards leaves the arena whole. (A review first found such a request never
/// woken when a cancelled trim put the chunk back; since requests at the maximum take back
/// what trims hold, it no longer waits at all.)
#[test]
fn an_awaited_request_at_the_maximum_takes_what_a_trim_holds() {
    use std::future::Future;
    use std::task::{Context, Poll};

    for device in devices() {
        let what = label(&device);
        let mr = arena(&device, 0, 8 * MIB);
        let a = device.create_stream().unwrap();
        let x = mr.allocate(8 * MIB, &a).unwrap();
        a.spin(Duration::from_millis(300)).unwrap();
        free(&mr, x, 8 * MIB, &a);
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let mut trim = Box::pin(mr.trim());
        if trim.as_mut().poll(&mut cx).is_ready() {
            println!("{what}: the kernel ended before the trim waited; nothing shown");
            continue;
        }
        let mut all = Box::pin(mr.allocate_async(8 * MIB, &a));
        let ptr = match all.as_mut().poll(&mut cx) {
            Poll::Ready(ptr) => ptr.unwrap(),
            Poll::Pending => panic!("{what}: refused while the trim held the chunk"),
        };
        assert_eq!(ptr, x, "{what}: the chunk the trim held");
        drop(trim);
        assert_eq!(mr.stats().reserved, 8 * MIB, "{what}");
        free(&mr, ptr, 8 * MIB, &a);
        check_arena(&mr);
        a.synchronize_blocking().unwrap();
        assert_eq!(mr.trim_blocking().unwrap(), 8 * MIB, "{what}");
    }
}

/// Four threads on four streams under a tight maximum, small and large blocks, half of them
/// freed on the next thread's stream (remote frees, adopted and forwarded while superblocks
/// move), with defragmentations and trims in between: nothing is lost or overlaps, and every
/// byte comes back. Allocation failures are allowed (the maximum is tight).
#[test]
fn moves_trims_and_remote_frees_under_stress() {
    for device in devices() {
        let what = label(&device);
        let mr = arena(&device, 0, 12 * MIB);
        let (txs, rxs): (Vec<_>, Vec<_>) = (0..4)
            .map(|_| std::sync::mpsc::channel::<(DevicePtr, usize, streamalloc::Event)>())
            .unzip();
        std::thread::scope(|scope| {
            for (t, rx) in rxs.into_iter().enumerate() {
                let tx = txs[(t + 1) % 4].clone();
                let (mr, device) = (&mr, &device);
                scope.spawn(move || {
                    let s = device.create_stream().unwrap();
                    let mut rng = common::SplitMix64(11 + t as u64);
                    let mut mine: Vec<(DevicePtr, usize)> = Vec::new();
                    for step in 0..2000 {
                        while let Ok((ptr, size, done)) = rx.try_recv() {
                            s.wait(&done).unwrap();
                            free(mr, ptr, size, &s);
                        }
                        let r = rng.next();
                        if mine.is_empty() || (!r.is_multiple_of(3) && mine.len() < 64) {
                            let size = if r.is_multiple_of(29) {
                                MIB + (rng.next() % (2 * MIB as u64)) as usize
                            } else {
                                256 + (rng.next() % (96 * KIB as u64)) as usize
                            };
                            match mr.allocate(size, &s) {
                                Ok(ptr) => mine.push((ptr, size)),
                                Err(e) if e.is_out_of_memory() => {}
                                Err(e) => panic!("{e}"),
                            }
                        } else {
                            let (ptr, size) =
                                mine.swap_remove((rng.next() % mine.len() as u64) as usize);
                            if r.is_multiple_of(2) {
                                free(mr, ptr, size, &s);
                            } else if let Err(back) = tx.send((ptr, size, s.record().unwrap())) {
                                let (ptr, size, _) = back.0;
                                free(mr, ptr, size, &s);
                            }
                        }
                        if t == 0 && step % 150 == 0 {
                            mr.trim_blocking().unwrap();
                        }
                        if t == 1 && step % 200 == 0 {
                            mr.defragment();
                        }
                    }
                    for (ptr, size) in mine {
                        free(mr, ptr, size, &s);
                    }
                    drop(tx);
                    for (ptr, size, done) in rx {
                        s.wait(&done).unwrap();
                        free(mr, ptr, size, &s);
                    }
                    s.synchronize_blocking().unwrap();
                });
            }
            drop(txs);
        });
        check_arena(&mr);
        let stats = mr.stats();
        assert!(stats.reserved <= 12 * MIB, "{what}: {stats:?}");
        assert_arena_all_back(&mr, &what);
        mr.trim_blocking().unwrap();
        assert_eq!(mr.stats().reserved, 0, "{what}");
    }
}

/// Issue 16: another thread's cache of the last stream arena it used kept that stream arena,
/// its stream and so the device alive after the arena resource was dropped, for as long as the
/// thread lived.
#[test]
fn a_dropped_arena_lets_go_of_its_streams_on_every_thread() {
    for device in devices() {
        let before = device.handle_count();
        let (done, wait) = std::sync::mpsc::channel::<()>();
        let (used, was_used) = std::sync::mpsc::channel::<()>();
        let mr = std::sync::Arc::new(arena(&device, 4 * MIB, 64 * MIB));
        let s = device.create_stream().unwrap();
        let worker = {
            let (mr, s) = (mr.clone(), s.clone());
            std::thread::spawn(move || {
                let p = mr.allocate(64 * KIB, &s).unwrap();
                free(&mr, p, 64 * KIB, &s);
                s.synchronize_blocking().unwrap();
                drop((mr, s));
                used.send(()).unwrap();
                // Stays alive, its cache holding the stream arena, until the check is done.
                wait.recv().ok();
            })
        };
        was_used.recv().unwrap();
        drop((mr, s));
        let handles = device.handle_count();
        done.send(()).unwrap();
        worker.join().unwrap();
        assert_eq!(
            handles,
            before,
            "{}: a dropped arena keeps its streams",
            label(&device)
        );
    }
}
