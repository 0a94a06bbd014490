//! Review of `ExpandablePoolResource` and the virtual memory layer under it: defects found by
//! the review, each with the test that showed it (on the simulated device, whose mapping
//! calls are counted in its free memory).

mod common;

use common::free;
use streamalloc::{Device, ExpandableOptions, ExpandablePoolResource, MemoryResource, SimConfig};

const GIB: usize = 1 << 30;

/// A trim's unmapping must not hold up a request that grows meanwhile (the docs: "the
/// give-back ... runs with no lock held, so that no request waits for it"). The review found
/// the trim unmapping every granule under the table's lock, which every growth takes: a
/// request that needed one more granule waited until the whole trim had unmapped (thousands
/// of `cuMemUnmap`s on a GPU, tens of µs each).
///
/// The test maps 32 GiB in 2 MiB units, frees it and trims it on another thread; once the
/// device's free memory starts to rise (the trim is unmapping), it asks for a block that needs
/// a growth (far below the maximum). With the lock held across the unmapping, the request is
/// served only after the last unmap, so the trim has always finished by then; without it, the
/// request is served while the trim still unmaps (tried up to 25 times: a thread can be
/// descheduled for the whole trim on a loaded machine, and a trim of the simulated device
/// takes milliseconds; with 5 tries it failed 2 times in 4 runs beside a build on 2 cores).
#[test]
fn a_growth_does_not_wait_for_a_trims_unmapping() {
    let total = 64 * GIB;
    let mut served_during_trim = false;
    for _attempt in 0..25 {
        let device = Device::simulated(SimConfig {
            total_memory: total,
            ..SimConfig::default()
        });
        let p = ExpandablePoolResource::new(
            &device,
            ExpandableOptions {
                map_unit: Some(1),
                ..ExpandableOptions::default()
            },
        )
        .unwrap();
        let g = p.granule();
        let s = device.create_stream().unwrap();
        let big = p.allocate(32 * GIB, &s).unwrap();
        free(&p, big, 32 * GIB, &s);
        s.synchronize_blocking().unwrap();
        let before = device.free_memory().unwrap();
        assert_eq!(before, total - 32 * GIB);
        let (free_after_request, trimmed) = std::thread::scope(|scope| {
            let trim = scope.spawn(|| p.trim_blocking());
            // Until the trim unmaps (or has finished, on a slow machine).
            while device.free_memory().unwrap() == before && !trim.is_finished() {
                std::hint::spin_loop();
            }
            let small = p.allocate(g, &s).unwrap();
            let after = device.free_memory().unwrap();
            free(&p, small, g, &s);
            (after, trim.join().unwrap())
        });
        assert_eq!(trimmed.unwrap(), 32 * GIB);
        // What the trim left mapped when the request was served, beyond the request's unit.
        if free_after_request < total - g {
            served_during_trim = true;
            break;
        }
    }
    assert!(
        served_during_trim,
        "every request that grew during a trim waited until the trim had unmapped everything"
    );
}

/// Sizes past the address space or past `usize` (the reservation, the unit, the maximum, the
/// initial size, a request) are typed errors, never a panic or a wrapped size, and a pool
/// made afterwards on the same device works (no coverage gap found: this passed before the
/// review's fixes).
#[test]
fn sizes_past_the_address_space_are_typed_errors() {
    use streamalloc::Error;
    let device = Device::simulated(SimConfig::default());
    let bad = [
        ExpandableOptions {
            reserve: Some(usize::MAX),
            ..ExpandableOptions::default()
        },
        ExpandableOptions {
            reserve: Some(1 << 62),
            ..ExpandableOptions::default()
        },
        ExpandableOptions {
            reserve: Some(1 << 47),
            ..ExpandableOptions::default()
        },
        ExpandableOptions {
            map_unit: Some(usize::MAX),
            ..ExpandableOptions::default()
        },
        ExpandableOptions {
            map_unit: Some(1 << 62),
            ..ExpandableOptions::default()
        },
        ExpandableOptions {
            reserve: Some(GIB),
            maximum: Some(usize::MAX),
            ..ExpandableOptions::default()
        },
        ExpandableOptions {
            reserve: Some(GIB),
            initial: usize::MAX,
            ..ExpandableOptions::default()
        },
    ];
    for options in bad {
        let label = format!("{options:?}");
        match ExpandablePoolResource::new(&device, options) {
            Err(Error::InvalidSize { .. } | Error::OutOfMemory { .. }) => {}
            other => panic!("{label}: {other:?}"),
        }
    }
    let p = ExpandablePoolResource::new(
        &device,
        ExpandableOptions {
            reserve: Some(GIB),
            ..ExpandableOptions::default()
        },
    )
    .unwrap();
    let s = device.create_stream().unwrap();
    for bytes in [usize::MAX, usize::MAX - 255, 1 << 63, GIB + 1] {
        match p.allocate(bytes, &s) {
            Err(Error::InvalidSize { .. } | Error::OutOfMemory { .. }) => {}
            other => panic!("{bytes}: {other:?}"),
        }
    }
    let ptr = p.allocate(GIB, &s).unwrap();
    free(&p, ptr, GIB, &s);
    assert_eq!(p.trim_blocking().unwrap(), GIB);
    assert_eq!(p.stats().reserved, 0);
}

/// A construction whose initial size fails to map midway (the device short of memory, or a
/// failed `cuMemMap` on a later piece) is an error that leaves nothing mapped: the device's
/// free memory is back where it was (no defect found: passed before the review's fixes).
#[test]
fn an_initial_size_that_fails_midway_leaves_nothing_mapped() {
    use streamalloc::{Error, FaultKind, Faults};
    let faults = Faults::new();
    let device = Device::simulated(SimConfig {
        total_memory: 4 * GIB,
        faults: faults.clone(),
        ..SimConfig::default()
    });
    let total = device.total_memory();
    // More than the device has, spread over the ranges: the later pieces fail.
    let short = ExpandablePoolResource::new(
        &device,
        ExpandableOptions {
            reserve: Some(16 * GIB),
            initial: 8 * GIB,
            ..ExpandableOptions::default()
        },
    );
    assert!(matches!(short, Err(Error::OutOfMemory { .. })), "{short:?}");
    assert_eq!(device.free_memory().unwrap(), total);
    // A failed map in the third piece (2 GiB over 8 ranges: 32 units of 8 MiB a piece).
    faults.fail_nth(FaultKind::MemMap, 2 * 32 + 1);
    let failed = ExpandablePoolResource::new(
        &device,
        ExpandableOptions {
            initial: 2 * GIB,
            ..ExpandableOptions::default()
        },
    );
    assert!(matches!(failed, Err(Error::Driver { .. })), "{failed:?}");
    assert_eq!(faults.injected(FaultKind::MemMap), 1);
    assert_eq!(device.free_memory().unwrap(), total);
    // The device is still usable by a pool.
    let p = ExpandablePoolResource::new(
        &device,
        ExpandableOptions {
            initial: 2 * GIB,
            ..ExpandableOptions::default()
        },
    )
    .unwrap();
    assert_eq!(p.stats().reserved, 2 * GIB);
    assert_eq!(p.trim_blocking().unwrap(), 2 * GIB);
    assert_eq!(device.free_memory().unwrap(), total);
}

/// One granule shared by two blocks freed on two streams, both still running work on them:
/// a trim unmaps it only after both streams' work (the race detector, on by default in
/// tests, panics at an unmap of memory still in use), and both streams are idle when it
/// returns (no defect found: passed before the review's fixes).
#[test]
fn a_granule_freed_on_two_busy_streams_waits_for_both() {
    use std::time::Duration;
    let device = Device::simulated(SimConfig::default());
    let p = ExpandablePoolResource::new(
        &device,
        ExpandableOptions {
            map_unit: Some(1),
            ..ExpandableOptions::default()
        },
    )
    .unwrap();
    let g = p.granule();
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let x = p.allocate(g / 2, &a).unwrap();
    let y = p.allocate(g / 2, &b).unwrap();
    assert_eq!(p.stats().reserved, g, "both halves of one granule");
    for (ptr, s, ms) in [(x, &a, 150), (y, &b, 300)] {
        s.spin(Duration::from_millis(ms)).unwrap();
        // SAFETY: half a granule the pool handed out for `s`, freed after this on `s`.
        unsafe { s.memset_d8(ptr, 7, g / 2) }.unwrap();
        free(&p, ptr, g / 2, s);
    }
    assert_eq!(p.trim_blocking().unwrap(), g);
    assert!(a.is_idle().unwrap() && b.is_idle().unwrap());
    assert!(device.take_races().is_empty());
    assert_eq!(p.stats().reserved, 0);
}

/// [`relocations`](ExpandablePoolResource::relocations) counts growths that moved free memory:
/// a growth whose mapping fails after it unmapped the room moved nothing (the room went back
/// to the device, the request got the error), as a claim's move counts only once mapped
/// ([`initial_moves`](ExpandablePoolResource::initial_moves)). The review found it counted
/// such a failed growth.
#[test]
fn a_failed_growth_at_the_maximum_is_no_relocation() {
    use streamalloc::{Error, FaultKind, Faults};
    let faults = Faults::new();
    let device = Device::simulated(SimConfig {
        faults: faults.clone(),
        ..SimConfig::default()
    });
    let unit = ExpandablePoolResource::new(&device, ExpandableOptions::default())
        .unwrap()
        .granule();
    let p = ExpandablePoolResource::new(
        &device,
        ExpandableOptions {
            reserve: Some(8 * unit),
            maximum: Some(4 * unit),
            ..ExpandableOptions::default()
        },
    )
    .unwrap();
    let s = device.create_stream().unwrap();
    // Units 0 to 3, one block each; 0 and 2 freed (idle): at the maximum, with free memory
    // that no two-unit request fits in until it moves.
    let blocks: Vec<_> = (0..4).map(|_| p.allocate(unit, &s).unwrap()).collect();
    free(&p, blocks[0], unit, &s);
    free(&p, blocks[2], unit, &s);
    s.synchronize_blocking().unwrap();

    faults.fail_nth(FaultKind::MemMap, 1);
    match p.allocate(2 * unit, &s) {
        Err(Error::Driver { call, .. }) => assert_eq!(call, "cuMemMap"),
        other => panic!("expected the injected cuMemMap failure, got {other:?}"),
    }
    let stats = p.stats();
    assert_eq!(stats.reserved, 2 * unit, "the room went back: {stats:?}");
    assert_eq!(
        device.free_memory().unwrap(),
        device.total_memory() - 2 * unit
    );
    assert_eq!(p.relocations(), 0, "a failed growth counted as a move");

    // Units 1 and 3 live, 0 and 2 unmapped: two units fit under the maximum without a move.
    let e = p.allocate(2 * unit, &s).unwrap();
    assert_eq!(p.relocations(), 0);
    // A move that works counts: 1 freed beside the hole at 0, 3 freed away from it.
    free(&p, blocks[1], unit, &s);
    free(&p, blocks[3], unit, &s);
    s.synchronize_blocking().unwrap();
    let f = p.allocate(2 * unit, &s).unwrap();
    assert_eq!(p.relocations(), 1);
    assert!(p.stats().reserved <= 4 * unit);
    free(&p, e, 2 * unit, &s);
    free(&p, f, 2 * unit, &s);
    assert_eq!(p.trim_blocking().unwrap(), 4 * unit);
    assert_eq!(device.free_memory().unwrap(), device.total_memory());
}

/// Small blocks kept in the small-block cache are free memory to a trim: every granule comes
/// back (no defect found: passed before the review's fixes).
#[test]
fn a_trim_takes_cached_small_blocks_too() {
    let device = Device::simulated(SimConfig::default());
    let p = ExpandablePoolResource::new(
        &device,
        ExpandableOptions {
            small_block_cache: Some(4 << 20),
            ..ExpandableOptions::default()
        },
    )
    .unwrap();
    let s = device.create_stream().unwrap();
    let blocks: Vec<_> = (0..64).map(|_| p.allocate(4096, &s).unwrap()).collect();
    for &b in &blocks {
        free(&p, b, 4096, &s);
    }
    let reserved = p.stats().reserved;
    assert!(reserved > 0);
    assert_eq!(p.trim_blocking().unwrap(), reserved);
    assert_eq!(p.stats().reserved, 0);
    assert_eq!(device.free_memory().unwrap(), device.total_memory());
}
