//! `ExpandablePoolResource` on every available device: growth without seams, trim that gives
//! memory back a granule at a time and in stream order, faults and bad input. (RMM's
//! memory-resource tests run on it in `base_resources/`, the awaitable-memory tests in
//! `awaitable.rs`.)

mod common;

use std::time::Duration;

use common::{devices, eventually, free, label, read_u32, take_turns};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::{
    Device, DevicePtr, Error, ExpandableOptions, ExpandablePlacement, ExpandablePoolResource,
    FaultKind, Faults, MemoryResource, SimConfig,
};

const MIB: usize = 1 << 20;

// Every test here takes turns (`take_turns`): some read the device's free memory before and
// after a trim, and another test mapping memory meanwhile (the same process, on the GPU) would
// hide the rise (run34: "free memory rose by 0 for 12582912 unmapped" while a test mapped
// 256 MiB).

fn expandable(device: &Device, options: ExpandableOptions) -> ExpandablePoolResource {
    ExpandablePoolResource::new(device, options).unwrap()
}

fn check(p: &ExpandablePoolResource) {
    p.check_invariants()
        .unwrap_or_else(|e| panic!("invariants: {e}"));
}

/// Buffers allocated one growth at a time, all freed: one request for all of them is served
/// from the coalesced memory, at the start of the reservation, without growing again. A pool
/// of separate chunks could not (blocks never merge across chunks).
#[test]
fn growths_coalesce_without_seams() {
    let _turn = take_turns();
    for device in devices() {
        let p = expandable(&device, ExpandableOptions::default());
        let g = p.granule();
        let s = device.create_stream().unwrap();
        let ptrs: Vec<DevicePtr> = (0..8).map(|_| p.allocate(g, &s).unwrap()).collect();
        let stats = p.stats();
        assert_eq!(stats.reserved, 8 * g, "{}: {stats:?}", label(&device));
        assert_eq!(stats.grows, 8);
        for w in ptrs.windows(2) {
            assert_eq!(w[1].0, w[0].0 + g as u64, "{}: contiguous", label(&device));
        }
        for &ptr in &ptrs {
            free(&p, ptr, g, &s);
        }
        check(&p);
        // Served at the start of the thread's shard's range, where the first growth mapped.
        let all = p.allocate(8 * g, &s).unwrap();
        assert_eq!(all, ptrs[0], "{}", label(&device));
        assert_eq!(p.stats().grows, 8, "{}: grew again", label(&device));
        free(&p, all, 8 * g, &s);
        // A growth extends the free block at the frontier by only what it lacks.
        let big = p.allocate(8 * g + MIB, &s).unwrap();
        let stats = p.stats();
        assert_eq!(stats.reserved, 9 * g, "{}: {stats:?}", label(&device));
        free(&p, big, 8 * g + MIB, &s);
        check(&p);
    }
}

/// `ExpandablePlacement`: with a free block a little larger than a request low in the range and
/// one of exactly its size higher up, `LowAddress` (the default) takes the low one, `ClosestFit`
/// the exact one; both leave the lists consistent.
#[test]
fn placement_low_address_or_closest_fit() {
    let _turn = take_turns();
    for device in devices() {
        for placement in [
            ExpandablePlacement::LowAddress,
            ExpandablePlacement::ClosestFit,
        ] {
            let p = expandable(
                &device,
                ExpandableOptions {
                    initial: 8 * MIB,
                    placement,
                    ..ExpandableOptions::default()
                },
            );
            let s = device.create_stream().unwrap();
            // Low: a block of 1 MiB + 64 KiB; then a spacer, an exact 1 MiB, another spacer,
            // and the rest of the memory free above them (a much larger size class).
            let sizes = [MIB + 64 * 1024, MIB, MIB, MIB];
            let ptrs: Vec<DevicePtr> = sizes.iter().map(|&n| p.allocate(n, &s).unwrap()).collect();
            for w in ptrs.windows(2) {
                assert!(w[0].0 < w[1].0, "{}: laid out in order", label(&device));
            }
            free(&p, ptrs[0], sizes[0], &s);
            free(&p, ptrs[2], sizes[2], &s);
            check(&p);
            let got = p.allocate(MIB, &s).unwrap();
            let want = match placement {
                ExpandablePlacement::LowAddress => ptrs[0],
                ExpandablePlacement::ClosestFit => ptrs[2],
            };
            assert_eq!(got, want, "{}: {placement:?}", label(&device));
            check(&p);
            for (ptr, n) in [(got, MIB), (ptrs[1], MIB), (ptrs[3], MIB)] {
                free(&p, ptr, n, &s);
            }
            check(&p);
            s.synchronize_blocking().unwrap();
        }
    }
}

/// Threads whose requests go to different shards grow in different ranges, each coalescing
/// on its own; one thread can still map the whole maximum as one block (each shard's range is
/// a whole reservation), and after everything is freed a trim gives all of it back.
#[test]
fn threads_grow_in_their_own_ranges_and_all_comes_back() {
    let _turn = take_turns();
    for device in devices() {
        let reserve = 64 * MIB;
        let p = expandable(
            &device,
            ExpandableOptions {
                reserve: Some(reserve),
                maximum: Some(reserve),
                ..ExpandableOptions::default()
            },
        );
        let (base, total) = p.reservation();
        assert!(
            total >= reserve && total.is_multiple_of(reserve),
            "{}: {total} bytes reserved",
            label(&device)
        );
        let g = p.granule();
        std::thread::scope(|scope| {
            for t in 0..4u64 {
                let (p, device) = (&p, &device);
                scope.spawn(move || {
                    let s = device.create_stream().unwrap();
                    let mut rng = common::SplitMix64(t + 1);
                    let mut live: Vec<(DevicePtr, usize)> = Vec::new();
                    for _ in 0..200 {
                        let size = 256 + (rng.next() % (2 * g as u64)) as usize;
                        if live.len() < 4 && rng.next().is_multiple_of(2) {
                            // The pool's maximum is shared: a thread may find it full.
                            if let Ok(ptr) = p.allocate(size, &s) {
                                let off = (ptr.0 - base.0) as usize;
                                assert!(off + size <= total, "{}", label(device));
                                live.push((ptr, size));
                            }
                        } else if let Some((ptr, size)) = live.pop() {
                            free(p, ptr, size, &s);
                        }
                    }
                    for (ptr, size) in live {
                        free(p, ptr, size, &s);
                    }
                    s.synchronize_blocking().unwrap();
                });
            }
        });
        check(&p);
        assert_eq!(p.stats().in_use, 0, "{}", label(&device));
        p.trim_blocking().unwrap();
        assert_eq!(p.stats().reserved, 0, "{}: {:?}", label(&device), p.stats());
        // The whole maximum, as one block, from this thread's range.
        let s = device.create_stream().unwrap();
        let all = p.allocate(reserve, &s).unwrap();
        check(&p);
        free(&p, all, reserve, &s);
        p.trim_blocking().unwrap();
        assert_eq!(p.stats().reserved, 0, "{}", label(&device));
    }
}

/// An initial size of 32 MiB per shard or more is spread over the shards' ranges (one free
/// block at the start of each), so threads on different shards start on different locks; a
/// smaller one stays in one range.
#[test]
fn the_initial_size_is_spread_over_the_shards() {
    let _turn = take_turns();
    for device in devices() {
        // 262 MiB: shares of unequal granule counts, exactly the initial size in all.
        for (initial, spread) in [(256 * MIB, true), (262 * MIB + 1, true), (16 * MIB, false)] {
            let reserve = 1 << 30;
            let p = expandable(
                &device,
                ExpandableOptions {
                    reserve: Some(reserve),
                    initial,
                    ..ExpandableOptions::default()
                },
            );
            let regions = p.reservation().1 / reserve;
            let stats = p.stats();
            let exact = initial.next_multiple_of(p.granule());
            assert_eq!(stats.reserved, exact, "{}: {stats:?}", label(&device));
            let blocks = if spread { regions } else { 1 };
            assert_eq!(stats.free_blocks, blocks, "{}: {stats:?}", label(&device));
            check(&p);
        }
    }
}

/// Trim with buffers alive: every fully free granule goes (the device's free memory rises by
/// as much), no granule under a live buffer does, the buffers' data is intact, and the pool
/// maps the holes again when it grows.
#[test]
fn trim_unmaps_free_granules_and_keeps_live_ones() {
    let _turn = take_turns();
    for device in devices() {
        let p = expandable(&device, ExpandableOptions::default());
        let g = p.granule();
        let s = device.create_stream().unwrap();
        let a = p.allocate(g, &s).unwrap();
        let b = p.allocate(6 * g, &s).unwrap();
        let c = p.allocate(g / 2, &s).unwrap();
        let words = g / 2 / 4;
        // SAFETY: `a` and `c` are live allocations of at least `words` words, used on `s`.
        unsafe {
            s.fill_u32(a, 0xAAAA_0001, g / 4).unwrap();
            s.fill_u32(c, 0xCCCC_0003, words).unwrap();
        }
        free(&p, b, 6 * g, &s);
        let before = device.free_memory().unwrap();
        let released = p.trim_blocking().unwrap();
        let after = device.free_memory().unwrap();
        // b's six granules are free; c's granule is half free (c lives there): it stays.
        assert_eq!(released, 6 * g, "{}: {:?}", label(&device), p.stats());
        assert_eq!(p.stats().reserved, 2 * g, "{}", label(&device));
        if device.is_simulated() {
            assert_eq!(after - before, released, "{}", label(&device));
        } else {
            // Other processes may allocate meanwhile; the rise is at least most of it.
            assert!(
                after.saturating_sub(before) >= released * 9 / 10,
                "{}: free memory rose by {} for {released} unmapped",
                label(&device),
                after.saturating_sub(before)
            );
        }
        assert!(read_u32(&s, a, g / 4).iter().all(|&w| w == 0xAAAA_0001));
        assert!(read_u32(&s, c, words).iter().all(|&w| w == 0xCCCC_0003));
        check(&p);
        // Nothing more to trim; the hole is mapped again for the next request.
        assert_eq!(p.trim_blocking().unwrap(), 0);
        let d = p.allocate(4 * g, &s).unwrap();
        assert_eq!(d, b, "{}: the hole is reused", label(&device));
        // SAFETY: `d` is live, used on `s`.
        unsafe { s.fill_u32(d, 7, 4 * g / 4) }.unwrap();
        assert!(read_u32(&s, d, 4 * g / 4).iter().all(|&w| w == 7));
        for (ptr, bytes) in [(a, g), (c, g / 2), (d, 4 * g)] {
            free(&p, ptr, bytes, &s);
        }
        assert_eq!(p.trim_blocking().unwrap(), 6 * g, "{}", label(&device));
        assert_eq!(p.stats().reserved, 0);
        check(&p);
    }
}

/// The data test of stream order: a buffer freed while work that uses it is still queued on
/// its stream (a spin, then a fill and a copy back): trim waits for that work before it
/// unmaps, so the work runs on mapped memory and the data comes back. (With the wait removed
/// from trim, the fill hits unmapped memory: the simulated device reports its address, and
/// this test fails.)
#[test]
fn trim_waits_for_the_stream_that_last_used_a_granule() {
    let _turn = take_turns();
    for device in devices() {
        let p = expandable(&device, ExpandableOptions::default());
        let g = p.granule();
        let bytes = 2 * g;
        let words = bytes / 4;
        let s = device.create_stream().unwrap();
        let other = device.create_stream().unwrap();
        let x = p.allocate(bytes, &s).unwrap();
        let mut host = vec![0u32; words];
        s.spin(Duration::from_millis(100)).unwrap();
        // SAFETY: `x` is live and used on `s` only, before its free below (stream order);
        // `host` has `words` words and is read only after `s` is synchronized.
        unsafe {
            s.fill_u32(x, 0x5EED_0001, words).unwrap();
            s.copy_dtoh(host.as_mut_ptr() as *mut u8, x, bytes).unwrap();
        }
        // SAFETY: freed once, after its last use on `s` (stream order).
        unsafe { p.deallocate(x, bytes, &s) }.unwrap();
        // Trim from another thread while the spin still runs.
        let released = std::thread::scope(|scope| scope.spawn(|| p.trim_blocking()).join())
            .unwrap()
            .unwrap();
        assert_eq!(released, bytes, "{}", label(&device));
        let synced = s.synchronize_blocking();
        assert!(
            synced.is_ok(),
            "{}: the stream's work failed: {synced:?}",
            label(&device)
        );
        assert!(
            host.iter().all(|&w| w == 0x5EED_0001),
            "{}: the data did not come back",
            label(&device)
        );
        // The pool grows again and serves another stream.
        let y = p.allocate(bytes, &other).unwrap();
        free(&p, y, bytes, &other);
        check(&p);
    }
}

/// On the simulated device, an access to a granule that was unmapped is an error naming the
/// first unmapped address.
#[test]
fn an_access_to_unmapped_memory_names_the_address() {
    let _turn = take_turns();
    // The race detector would panic at the memset (a use after free of the trimmed block):
    // here it only records it, so that the device's own check is what this test sees.
    let device = Device::simulated(SimConfig {
        race_detection: streamalloc::RaceDetection::Record,
        ..SimConfig::default()
    });
    let p = expandable(&device, ExpandableOptions::default());
    let g = p.granule();
    let s = device.create_stream().unwrap();
    let keep = p.allocate(g, &s).unwrap();
    let gone = p.allocate(2 * g, &s).unwrap();
    free(&p, gone, 2 * g, &s);
    assert_eq!(p.trim_blocking().unwrap(), 2 * g);
    // A memset over the live granule and into the unmapped ones: it fails at the boundary.
    // SAFETY: deliberately wrong: the simulated device checks every access and reports it.
    unsafe { s.memset_d8(keep, 1, 3 * g) }.unwrap();
    match s.synchronize_blocking() {
        Err(Error::InvalidAddress { ptr, bytes }) => {
            assert_eq!(ptr, gone.0);
            assert_eq!(bytes, 2 * g);
            assert!(Error::InvalidAddress { ptr, bytes }
                .to_string()
                .contains(&format!("{ptr:#x}")));
        }
        other => panic!("expected InvalidAddress, got {other:?}"),
    }
    let races = device.races();
    assert_eq!(races.len(), 1, "{races:?}");
    assert_eq!(
        races[0].kind,
        streamalloc::RaceKind::UseAfterFree,
        "{}",
        races[0]
    );
}

/// Faults midway through a growth (the second granule's map, a create that runs out of
/// memory): a typed error, nothing stays mapped, nothing leaks, and the pool still works.
#[test]
fn mapping_failures_midway_lose_nothing() {
    let _turn = take_turns();
    let faults = Faults::new();
    let device = Device::simulated(SimConfig {
        faults: faults.clone(),
        ..SimConfig::default()
    });
    let p = expandable(&device, ExpandableOptions::default());
    let g = p.granule();
    let s = device.create_stream().unwrap();
    let live = p.allocate(g, &s).unwrap();
    let free_before = device.free_memory().unwrap();
    let stats_before = p.stats();

    faults.fail_nth(FaultKind::MemMap, 2);
    match p.allocate(4 * g, &s) {
        Err(Error::Driver { call, .. }) => assert_eq!(call, "cuMemMap"),
        other => panic!("expected the injected cuMemMap failure, got {other:?}"),
    }
    assert_eq!(
        device.free_memory().unwrap(),
        free_before,
        "a granule leaked"
    );
    assert_eq!(p.stats().reserved, stats_before.reserved);
    check(&p);

    faults.fail_nth(FaultKind::MemCreate, 3);
    match p.allocate(4 * g, &s) {
        Err(e @ Error::OutOfMemory { .. }) => assert!(e.is_out_of_memory()),
        other => panic!("expected out of memory, got {other:?}"),
    }
    assert_eq!(
        device.free_memory().unwrap(),
        free_before,
        "a granule leaked"
    );
    assert_eq!(faults.injected(FaultKind::MemCreate), 1);
    check(&p);

    // Still usable, and the live buffer was never touched.
    let big = p.allocate(4 * g, &s).unwrap();
    free(&p, big, 4 * g, &s);
    free(&p, live, g, &s);
    assert_eq!(p.trim_blocking().unwrap(), 5 * g);
    assert_eq!(device.free_memory().unwrap(), device.total_memory());
}

/// Bad construction arguments and a reservation larger than the address space are errors, and
/// the device stays usable.
#[test]
fn bad_input_is_a_typed_error() {
    let _turn = take_turns();
    for device in devices() {
        let too_large = ExpandablePoolResource::new(
            &device,
            ExpandableOptions {
                reserve: Some(1 << 62),
                ..ExpandableOptions::default()
            },
        );
        match too_large {
            Err(Error::OutOfMemory { requested, .. }) => assert!(requested >= 1 << 62),
            Err(e) if !device.is_simulated() => {
                // The driver's own code for an impossible reservation.
                assert!(matches!(e, Error::Driver { .. }), "{e:?}");
            }
            other => panic!("{}: {other:?}", label(&device)),
        }
        let overflow = ExpandablePoolResource::new(
            &device,
            ExpandableOptions {
                reserve: Some(usize::MAX),
                ..ExpandableOptions::default()
            },
        );
        assert!(
            matches!(overflow, Err(Error::InvalidSize { .. })),
            "{overflow:?}"
        );
        let above = ExpandablePoolResource::new(
            &device,
            ExpandableOptions {
                reserve: Some(64 * MIB),
                maximum: Some(128 * MIB),
                ..ExpandableOptions::default()
            },
        );
        assert!(matches!(above, Err(Error::InvalidSize { .. })), "{above:?}");
        let initial = ExpandablePoolResource::new(
            &device,
            ExpandableOptions {
                maximum: Some(64 * MIB),
                initial: 65 * MIB,
                ..ExpandableOptions::default()
            },
        );
        assert!(
            matches!(initial, Err(Error::InvalidSize { .. })),
            "{initial:?}"
        );
        // A request above the maximum fails at once, and the pool still serves.
        let p = expandable(
            &device,
            ExpandableOptions {
                maximum: Some(16 * MIB),
                ..ExpandableOptions::default()
            },
        );
        let s = device.create_stream().unwrap();
        match p.allocate(17 * MIB, &s) {
            Err(Error::OutOfMemory { maximum, .. }) => assert_eq!(maximum, 16 * MIB),
            other => panic!("{other:?}"),
        }
        let ptr = p.allocate(16 * MIB, &s).unwrap();
        match p.allocate(1, &s) {
            Err(Error::OutOfMemory { .. }) => {}
            other => panic!("{other:?}"),
        }
        // Trimming while the buffer lives: nothing to give back, nothing unmapped under it.
        assert_eq!(p.trim_blocking().unwrap(), 0);
        // SAFETY: live, used on `s`.
        unsafe { s.memset_d8(ptr, 3, 16 * MIB) }.unwrap();
        s.synchronize_blocking().unwrap();
        free(&p, ptr, 16 * MIB, &s);
        // SAFETY: deliberately wrong: a pointer the pool never handed out.
        let bogus = unsafe { p.deallocate(DevicePtr(ptr.0 + 1), 256, &s) };
        assert!(matches!(bogus, Err(Error::UnknownPointer { .. })));
    }
}

/// With a release threshold, freed memory above it goes back on its own (on the device's
/// blocking-work thread), down to the threshold.
#[test]
fn the_release_threshold_gives_memory_back_on_its_own() {
    let _turn = take_turns();
    for device in devices() {
        let p = expandable(
            &device,
            ExpandableOptions {
                release_threshold: Some(8 * MIB),
                ..ExpandableOptions::default()
            },
        );
        let s = device.create_stream().unwrap();
        let ptr = p.allocate(64 * MIB, &s).unwrap();
        assert!(p.stats().reserved >= 64 * MIB);
        free(&p, ptr, 64 * MIB, &s);
        assert!(
            eventually(Duration::from_secs(10), || p.stats().reserved <= 8 * MIB),
            "{}: {:?}",
            label(&device),
            p.stats()
        );
        // Nothing was lost: the pool serves the whole amount again.
        let again = p.allocate(64 * MIB, &s).unwrap();
        free(&p, again, 64 * MIB, &s);
        check(&p);
    }
}

/// `trim` as a future, and `trim_to` keeping some memory mapped (the highest addresses go).
#[test]
fn trim_to_keeps_the_lowest_granules() {
    let _turn = take_turns();
    let rt = common::runtime();
    for device in devices() {
        let p = expandable(&device, ExpandableOptions::default());
        let g = p.granule();
        let s = device.create_stream().unwrap();
        let ptr = p.allocate(10 * g, &s).unwrap();
        free(&p, ptr, 10 * g, &s);
        let released = rt.block_on(p.trim_to(3 * g)).unwrap();
        assert_eq!(released, 7 * g, "{}", label(&device));
        assert_eq!(p.stats().reserved, 3 * g);
        // The kept granules serve without growing.
        let grows = p.stats().grows;
        let low = p.allocate(3 * g, &s).unwrap();
        assert_eq!(low, ptr);
        assert_eq!(p.stats().grows, grows);
        free(&p, low, 3 * g, &s);
        assert_eq!(rt.block_on(p.trim()).unwrap(), 3 * g);
        check(&p);
    }
}

/// The mapping unit (`ExpandableOptions::map_unit`): a multiple of the device's allocation
/// granularity (4 granules by default, rounded up otherwise, at least one), and what the pool
/// maps, unmaps and trims by: a request of one granule maps a whole unit, and the unit goes
/// back whole once all of it is free, not before.
#[test]
fn the_mapping_unit_is_what_grows_and_trims() {
    let _turn = take_turns();
    for device in devices() {
        let exact = expandable(
            &device,
            ExpandableOptions {
                map_unit: Some(1),
                ..ExpandableOptions::default()
            },
        );
        let granularity = exact.granule();
        assert!(granularity >= 256 && granularity.is_multiple_of(256));
        let default = expandable(&device, ExpandableOptions::default());
        let s = device.create_stream().unwrap();
        let unit = default.granule();
        // The range starts at a multiple of the unit, and memory allocated after it lies
        // outside it (the simulated device once aligned the start up without moving on).
        let (base, reserved) = default.reservation();
        assert_eq!(base.0 % unit as u64, 0, "{}", label(&device));
        let plain = CudaResource::new(&device);
        let other = plain.allocate(4096, &s).unwrap();
        assert!(
            other.0 >= base.0 + reserved as u64 || other.0 + 4096 <= base.0,
            "{}: {other:?} inside the reservation {base:?} + {reserved}",
            label(&device)
        );
        free(&plain, other, 4096, &s);
        s.synchronize_blocking().unwrap();
        assert_eq!(
            default.granule(),
            streamalloc::resource::expandable::DEFAULT_MAP_GRANULES * granularity,
            "{}",
            label(&device)
        );
        let rounded = expandable(
            &device,
            ExpandableOptions {
                map_unit: Some(granularity + 1),
                ..ExpandableOptions::default()
            },
        );
        assert_eq!(rounded.granule(), 2 * granularity, "{}", label(&device));
        assert!(matches!(
            ExpandablePoolResource::new(
                &device,
                ExpandableOptions {
                    map_unit: Some(usize::MAX),
                    ..ExpandableOptions::default()
                },
            ),
            Err(Error::InvalidSize { .. })
        ));
        drop((exact, rounded));

        let free_before = device.free_memory().unwrap();
        // One granule's request maps a whole unit.
        let a = default.allocate(granularity, &s).unwrap();
        assert_eq!(default.stats().reserved, unit, "{}", label(&device));
        assert_eq!(free_before - device.free_memory().unwrap(), unit);
        // The rest of the unit serves without growing; with `a` alive, trim keeps the unit.
        let b = default.allocate(unit - granularity, &s).unwrap();
        assert_eq!(default.stats().grows, 1, "{}", label(&device));
        free(&default, b, unit - granularity, &s);
        assert_eq!(default.trim_blocking().unwrap(), 0, "{}", label(&device));
        assert_eq!(default.stats().reserved, unit);
        // Still mapped: readable.
        let _ = read_u32(&s, a, 4);
        // All of it free: it goes back whole.
        free(&default, a, granularity, &s);
        assert_eq!(default.trim_blocking().unwrap(), unit, "{}", label(&device));
        assert_eq!(device.free_memory().unwrap(), free_before);
        check(&default);
    }
}

/// A trim takes out of the lists only what it gives back. Here the lowest free granule was
/// freed half on each of two busy streams (taking it out for unmapping orders one stream after
/// the other) and the highest on one stream only: a trim that gives nothing back makes no
/// stream wait, and one that gives back a granule takes the highest and makes no stream wait
/// for the granule it keeps, which still serves without growth. (A trim once took every free
/// granule out of every list, ordering each, and put back what it kept: in between, a request
/// on another thread found no free memory, grew needlessly, or was refused at the maximum.)
#[test]
fn a_trim_makes_no_stream_wait_for_memory_it_keeps() {
    let _turn = take_turns();
    for device in devices() {
        let p = expandable(&device, ExpandableOptions::default());
        let g = p.granule();
        let s1 = device.create_stream().unwrap();
        let s2 = device.create_stream().unwrap();
        // Granule 0: two halves; granule 1: live; granule 2: whole.
        let lo = p.allocate(g / 2, &s1).unwrap();
        let hi = p.allocate(g / 2, &s2).unwrap();
        let live = p.allocate(g, &s1).unwrap();
        let top = p.allocate(g, &s1).unwrap();
        assert_eq!(
            (hi.0 - lo.0, live.0 - lo.0, top.0 - lo.0),
            (g as u64 / 2, g as u64, 2 * g as u64),
            "{}",
            label(&device)
        );
        s1.spin(Duration::from_millis(300)).unwrap();
        s2.spin(Duration::from_millis(300)).unwrap();
        free(&p, lo, g / 2, &s1);
        free(&p, hi, g / 2, &s2);
        free(&p, top, g, &s1);
        let before = p.stats();
        assert_eq!(before.reserved, 3 * g);
        assert_eq!(p.trim_to_blocking(usize::MAX).unwrap(), 0);
        assert_eq!(p.trim_to_blocking(3 * g).unwrap(), 0);
        let kept = p.stats();
        assert_eq!(
            (
                kept.stream_waits,
                kept.reserved,
                kept.free,
                kept.free_blocks
            ),
            (before.stream_waits, 3 * g, 2 * g, 2),
            "{}: a trim that gave nothing back",
            label(&device)
        );
        assert_eq!(p.trim_to_blocking(2 * g).unwrap(), g, "{}", label(&device));
        let trimmed = p.stats();
        assert_eq!(
            (trimmed.stream_waits, trimmed.reserved, trimmed.free),
            (before.stream_waits, 2 * g, g),
            "{}: a trim that gave back the top granule",
            label(&device)
        );
        let again = p.allocate(g, &s1).unwrap();
        assert_eq!(again, lo, "{}", label(&device));
        assert_eq!(p.stats().grows, before.grows);
        free(&p, again, g, &s1);
        free(&p, live, g, &s1);
        check(&p);
    }
}

/// Requests on one thread, at the maximum, while another thread trims with nothing to give
/// back: every request is served from the free memory, which a trim must never hide.
#[test]
fn a_trim_that_keeps_everything_never_refuses_requests() {
    let _turn = take_turns();
    let d = Device::simulated(SimConfig::default());
    let p = expandable(
        &d,
        ExpandableOptions {
            maximum: Some(8 * MIB),
            map_unit: Some(8 * MIB),
            ..ExpandableOptions::default()
        },
    );
    assert_eq!(p.granule(), 8 * MIB);
    let done = std::sync::atomic::AtomicBool::new(false);
    let started = std::sync::Barrier::new(2);
    let refused = std::thread::scope(|scope| {
        let requests = scope.spawn(|| {
            let s = d.create_stream().unwrap();
            started.wait();
            let refused = (0..50_000).find_map(|i| match p.allocate(4 * MIB, &s) {
                Ok(ptr) => {
                    free(&p, ptr, 4 * MIB, &s);
                    None
                }
                Err(e) => Some(format!("request {i} refused: {e}")),
            });
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            refused
        });
        scope.spawn(|| {
            started.wait();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                assert_eq!(p.trim_to_blocking(usize::MAX).unwrap(), 0);
            }
        });
        requests.join().unwrap()
    });
    assert_eq!(refused, None, "{:?}", p.stats());
    check(&p);
}

/// With a release threshold, memory freed while an automatic release runs (here its job waits
/// for a busy stream, with the first granule taken) goes back too: those frees find a release
/// running and queue none, so the release looks again when it ends. (It once ended without
/// looking, and the second granule stayed mapped above the threshold until some later free.)
#[test]
fn memory_freed_during_an_automatic_release_goes_back_too() {
    let _turn = take_turns();
    for device in devices() {
        let p = expandable(
            &device,
            ExpandableOptions {
                release_threshold: Some(0),
                ..ExpandableOptions::default()
            },
        );
        let g = p.granule();
        let s1 = device.create_stream().unwrap();
        let s2 = device.create_stream().unwrap();
        let a = p.allocate(g, &s1).unwrap();
        let b = p.allocate(g, &s2).unwrap();
        assert_eq!(p.stats().reserved, 2 * g);
        s1.spin(Duration::from_millis(500)).unwrap();
        free(&p, a, g, &s1);
        // The release has taken a's granule out of the lists: it waits for s1's spin.
        assert!(
            eventually(Duration::from_secs(5), || p.stats().free == 0),
            "{}: the release did not start: {:?}",
            label(&device),
            p.stats()
        );
        free(&p, b, g, &s2);
        assert!(
            eventually(Duration::from_secs(5), || p.stats().reserved == 0),
            "{}: freed during the release, still mapped above the threshold: {:?}",
            label(&device),
            p.stats()
        );
        check(&p);
    }
}

/// At the maximum, a growth moves wholly free, idle granules of its own range too, not only of
/// the other ranges: here one thread's four granules, the second and fourth free (not
/// adjacent), and a request for two is served by unmapping the second and mapping its room
/// next to the fourth. The live granules are untouched.
#[test]
fn free_granules_of_the_own_range_move_at_the_maximum() {
    let _turn = take_turns();
    for device in devices() {
        let g = expandable(&device, ExpandableOptions::default()).granule();
        let p = expandable(
            &device,
            ExpandableOptions {
                maximum: Some(4 * g),
                ..ExpandableOptions::default()
            },
        );
        let s = device.create_stream().unwrap();
        let units: Vec<_> = (0..4).map(|_| p.allocate(g, &s).unwrap()).collect();
        // SAFETY: `units[0]` and `units[2]` are live, used on `s`.
        unsafe {
            s.fill_u32(units[0], 0xAAAA_0000, g / 4).unwrap();
            s.fill_u32(units[2], 0xAAAA_0002, g / 4).unwrap();
        }
        free(&p, units[1], g, &s);
        free(&p, units[3], g, &s);
        s.synchronize_blocking().unwrap();
        let both = p.allocate(2 * g, &s).unwrap_or_else(|e| {
            panic!(
                "{}: 2 granules refused with 2 wholly free idle granules mapped: {e}; {:?}",
                label(&device),
                p.stats()
            )
        });
        assert_eq!(both, units[3], "{}: extends the fourth", label(&device));
        assert_eq!(p.relocations(), 1);
        assert_eq!(p.stats().reserved, 4 * g);
        assert!(read_u32(&s, units[0], g / 4)
            .iter()
            .all(|&w| w == 0xAAAA_0000));
        assert!(read_u32(&s, units[2], g / 4)
            .iter()
            .all(|&w| w == 0xAAAA_0002));
        for (ptr, bytes) in [(units[0], g), (units[2], g), (both, 2 * g)] {
            free(&p, ptr, bytes, &s);
        }
        assert_eq!(p.trim_blocking().unwrap(), 4 * g, "{}", label(&device));
        check(&p);
    }
}
