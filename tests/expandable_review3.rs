//! Third review of `ExpandablePoolResource`: a trim's unmapping when the simulated device's
//! race detector, in its `Panic` mode, panics out of an unmap; then (the twenty-third
//! session's review) a device whose memory is not a whole number of mapping units, the peak
//! in use against the peak mapped, and memory freed on a stream that is never idle.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};

use common::free;
use streamalloc::{
    Device, ExpandableOptions, ExpandablePoolResource, MemoryAccess, MemoryResource, RaceDetection,
    SimConfig,
};

/// A trim that unmaps a granule another stream still uses (the user's race: the block was
/// freed on one stream while another's work, unordered with the free, still wrote it) panics
/// in the `Panic` mode, out of the unmap, after the granule was unmapped. The review found the
/// panic leaving the pool's bookkeeping behind: the unmapped granule still counted as mapped
/// (in `reserved`, in the chunks), the granules after it in no list, never handed out or
/// trimmed again. Now the trim notes what it unmapped and puts the rest back before the panic
/// goes on, and the pool works as before.
#[test]
fn a_trim_whose_unmap_panics_leaves_the_pool_consistent() {
    let device = Device::simulated(SimConfig {
        race_detection: RaceDetection::Panic,
        ..SimConfig::default()
    });
    let total = device.free_memory().unwrap();
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
    // Three granules, handed out on `a`; `b` ordered after the allocation, then writing the
    // middle one behind a spin.
    let x = p.allocate(3 * g, &a).unwrap();
    assert_eq!(p.stats().reserved, 3 * g);
    b.wait(&a.record().unwrap()).unwrap();
    b.spin(std::time::Duration::from_millis(50)).unwrap();
    let middle = streamalloc::DevicePtr(x.0 + g as u64);
    b.declare_access(middle, g, MemoryAccess::Write, "write on b")
        .unwrap();
    // Freed on `a`, not ordered after `b`'s write: the detector panics at the free, once the
    // block is back in `a`'s list.
    let freed = catch_unwind(AssertUnwindSafe(|| free(&p, x, 3 * g, &a)));
    assert!(freed.is_err(), "the racing free did not panic");
    // The trim waits for `a` only: its unmap of the middle granule races with `b`'s write (the
    // host never saw it finish), and panics once that granule is unmapped.
    let trimmed = catch_unwind(AssertUnwindSafe(|| p.trim_blocking()));
    assert!(
        trimmed.is_err(),
        "the racing unmap did not panic: {trimmed:?}"
    );
    // The first two granules are unmapped; the third is mapped, free, back in a list.
    p.check_invariants().unwrap();
    let stats = p.stats();
    assert_eq!(stats.reserved, g, "{stats:?}");
    assert_eq!(stats.chunks, 1, "{stats:?}");
    assert_eq!(stats.free, g, "{stats:?}");
    assert_eq!(device.free_memory().unwrap(), total - g);
    // The pool goes on as before: once `b` is done, the third granule trims.
    b.synchronize_blocking().unwrap();
    assert_eq!(p.trim_blocking().unwrap(), g);
    assert_eq!(p.stats().reserved, 0);
    assert_eq!(device.free_memory().unwrap(), total);
    // And it grows, serves, frees and trims the whole range again.
    let y = p.allocate(3 * g, &a).unwrap();
    assert_eq!(p.stats().reserved, 3 * g);
    free(&p, y, 3 * g, &a);
    p.check_invariants().unwrap();
    assert_eq!(p.trim_blocking().unwrap(), 3 * g);
    let stats = p.stats();
    assert_eq!((stats.reserved, stats.chunks), (0, 0), "{stats:?}");
    assert_eq!(device.free_memory().unwrap(), total);
}

/// The same for a growth at the maximum that first unmaps free granules elsewhere (a move:
/// `relocations`), under the table's lock: the panic out of that unmap left the granule
/// counted as mapped and the rest of the room it had taken in no list. Now the growth notes
/// what it unmapped, puts the rest back and lets the panic go on, and the pool serves the
/// request when it is tried again.
#[test]
fn a_growth_whose_move_panics_leaves_the_pool_consistent() {
    let device = Device::simulated(SimConfig {
        race_detection: RaceDetection::Panic,
        ..SimConfig::default()
    });
    let total = device.free_memory().unwrap();
    let g = 2 << 20;
    let p = ExpandablePoolResource::new(
        &device,
        ExpandableOptions {
            map_unit: Some(1),
            maximum: Some(4 * g),
            ..ExpandableOptions::default()
        },
    )
    .unwrap();
    assert_eq!(p.granule(), g);
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let x = p.allocate(g, &a).unwrap();
    let y = p.allocate(g, &a).unwrap();
    let z = p.allocate(g, &a).unwrap();
    // `b` writes `x`, ordered after its allocation; `x` is freed on `a` unordered with that
    // write (the detector panics at the free, once the block is back in `a`'s list).
    b.wait(&a.record().unwrap()).unwrap();
    b.declare_access(x, g, MemoryAccess::Write, "write on b")
        .unwrap();
    let freed = catch_unwind(AssertUnwindSafe(|| free(&p, x, g, &a)));
    assert!(freed.is_err(), "the racing free did not panic");
    free(&p, y, g, &a);
    a.synchronize_blocking().unwrap();
    // Three granules mapped, two free below the live `z`: a request of three more, past the
    // maximum, moves those two where it grows. The move's unmap of `x`'s granule races with
    // `b`'s write, and panics once that granule is unmapped.
    let grown = catch_unwind(AssertUnwindSafe(|| p.allocate(3 * g, &a)));
    assert!(grown.is_err(), "the racing unmap did not panic: {grown:?}");
    p.check_invariants().unwrap();
    assert_eq!(p.relocations(), 0, "a move that did not map is none");
    let stats = p.stats();
    assert_eq!((stats.reserved, stats.chunks), (2 * g, 2), "{stats:?}");
    assert_eq!(stats.free, g, "{stats:?}");
    assert_eq!(device.free_memory().unwrap(), total - 2 * g);
    // Once `b` is done the pool serves the request (moving `y`'s granule), and trims it all.
    b.synchronize_blocking().unwrap();
    let w = p.allocate(3 * g, &a).unwrap();
    assert_eq!(p.stats().reserved, 4 * g);
    assert_eq!(p.relocations(), 1);
    free(&p, w, 3 * g, &a);
    free(&p, z, g, &a);
    p.check_invariants().unwrap();
    assert_eq!(p.trim_blocking().unwrap(), 4 * g);
    assert_eq!(p.stats().reserved, 0);
    assert_eq!(device.free_memory().unwrap(), total);
}

/// The automatic release (a release threshold) runs a trim on the device's blocking-work
/// thread; its unmap of a granule another stream still writes panics in the `Panic` mode. That
/// thread caught the panic, but the release's trigger stayed pending, so the pool never
/// released again: memory freed later stayed mapped for the pool's life. Now the release
/// catches it and ends as usual, and later frees release again.
#[test]
fn an_automatic_release_whose_unmap_panics_still_releases_later() {
    let device = Device::simulated(SimConfig {
        race_detection: RaceDetection::Panic,
        ..SimConfig::default()
    });
    let p = ExpandablePoolResource::new(
        &device,
        ExpandableOptions {
            map_unit: Some(1),
            release_threshold: Some(0),
            ..ExpandableOptions::default()
        },
    )
    .unwrap();
    let g = p.granule();
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let x = p.allocate(3 * g, &a).unwrap();
    let w = p.allocate(g, &a).unwrap();
    b.wait(&a.record().unwrap()).unwrap();
    b.spin(std::time::Duration::from_millis(50)).unwrap();
    let middle = streamalloc::DevicePtr(x.0 + g as u64);
    b.declare_access(middle, g, MemoryAccess::Write, "write on b")
        .unwrap();
    // The racing free panics once the block is back in `a`'s list.
    let freed = catch_unwind(AssertUnwindSafe(|| free(&p, x, 3 * g, &a)));
    assert!(freed.is_err(), "the racing free did not panic");
    // This free starts a release: its trim waits for `a` and unmaps `x`'s granules while the
    // host has not seen `b`'s write finish, and panics at the middle one.
    free(&p, w, g, &a);
    b.synchronize_blocking().unwrap();
    // Later frees release again, down to the threshold.
    let y = p.allocate(g, &a).unwrap();
    free(&p, y, g, &a);
    assert!(
        common::eventually(std::time::Duration::from_secs(20), || p.stats().reserved
            == 0),
        "the pool stopped releasing: {:?}",
        p.stats()
    );
    p.check_invariants().unwrap();
}

/// A device of 100 MiB, mapped in units of 8 MiB: 96 MiB at most can ever be mapped, so a
/// request for 100 MiB fails at once, plain or awaited, with numbers that say so; and a unit
/// larger than the device is refused when the pool is made. The review found the reservation
/// and the maximum rounded up past the device (104 MiB), the error `requested == available ==
/// maximum`, and `allocate_async` waiting until its timeout; and with a unit of 256 MiB,
/// every request of any size waiting so.
#[test]
fn a_device_not_a_whole_number_of_units_refuses_what_it_cannot_map_at_once() {
    use std::time::Duration;
    use streamalloc::{AllocateAsync, Error};
    const MIB: usize = 1 << 20;
    let device = Device::simulated(SimConfig {
        total_memory: 100 * MIB,
        ..SimConfig::default()
    });
    let p = ExpandablePoolResource::new(&device, ExpandableOptions::default()).unwrap();
    assert_eq!(p.granule(), 8 * MIB, "the scene needs 8 MiB units");
    let s = device.create_stream().unwrap();
    match p.allocate(100 * MIB, &s) {
        Err(Error::OutOfMemory {
            requested,
            available,
            maximum,
        }) => assert!(
            maximum < requested && available <= maximum,
            "{requested} {available} {maximum}"
        ),
        other => panic!("{other:?}"),
    }
    let awaited = futures::executor::block_on(
        p.allocate_async(100 * MIB, &s)
            .timeout(Duration::from_secs(2)),
    );
    assert!(
        matches!(awaited, Err(Error::OutOfMemory { .. })),
        "{awaited:?}"
    );
    // What can be mapped still can.
    let q = p.allocate(96 * MIB, &s).unwrap();
    free(&p, q, 96 * MIB, &s);
    let unit = ExpandableOptions {
        map_unit: Some(256 * MIB),
        ..ExpandableOptions::default()
    };
    assert!(
        matches!(
            ExpandablePoolResource::new(&device, unit),
            Err(Error::InvalidSize { .. })
        ),
        "a unit larger than the device"
    );
    s.synchronize_blocking().unwrap();
}

/// `peak_in_use` is never above `peak_reserved` (as `PoolStats` promises): one thread's 64 MiB,
/// freed and trimmed, then another thread's (another shard, another range) 64 MiB, under a
/// maximum of 64 MiB. The engine sums its shards' peaks, and the review found 128 MiB in use
/// against 64 MiB ever mapped.
#[test]
fn the_peak_in_use_is_never_above_the_peak_mapped() {
    const MIB: usize = 1 << 20;
    let device = Device::simulated(SimConfig::default());
    let p = ExpandablePoolResource::new(
        &device,
        ExpandableOptions {
            maximum: Some(64 * MIB),
            ..ExpandableOptions::default()
        },
    )
    .unwrap();
    let s = device.create_stream().unwrap();
    for _ in 0..2 {
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let a = p.allocate(64 * MIB, &s).unwrap();
                free(&p, a, 64 * MIB, &s);
            });
        });
        s.synchronize_blocking().unwrap();
        p.trim_blocking().unwrap();
    }
    let stats = p.stats();
    assert!(
        stats.peak_in_use <= stats.peak_reserved,
        "{} in use at the peak, {} mapped",
        stats.peak_in_use,
        stats.peak_reserved
    );
    assert_eq!(stats.peak_in_use, 64 * MIB);
}

/// Memory freed on a stream that always has work queued (a pipeline's compute stream) moves at
/// the maximum once that work has finished, though the stream never answers idle: 64 MiB
/// reserved per range and a maximum of 64 MiB, 32 MiB freed on `s` in one range and 32 MiB on
/// `u` in another, both streams synchronized since; a feeder keeps `s` busy (never touching
/// that memory), and an awaited 64 MiB on `t` needs both halves moved into its range. The
/// review found the move asking `s` whether it was idle, every time: the job that waited for
/// `s` woke the waiter, whose retry found new work on `s` and was refused again, until the
/// timeout. Now that job notes `s` done up to the epoch it bumped before it waited, and the
/// move takes what `s` freed before it without asking.
#[test]
fn memory_freed_on_a_stream_never_idle_moves_once_its_work_is_done() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;
    use streamalloc::AllocateAsync;
    const MIB: usize = 1 << 20;
    let device = Device::simulated(SimConfig::default());
    let p = ExpandablePoolResource::new(
        &device,
        ExpandableOptions {
            reserve: Some(64 * MIB),
            maximum: Some(64 * MIB),
            ..ExpandableOptions::default()
        },
    )
    .unwrap();
    let (s, u, t) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    // Two threads, two shards, two ranges: 32 MiB freed on `s` in one, on `u` in the other.
    let (a, c) = std::thread::scope(|scope| {
        let a = scope.spawn(|| p.allocate(32 * MIB, &s).unwrap()).join();
        let c = scope.spawn(|| p.allocate(32 * MIB, &u).unwrap()).join();
        (a.unwrap(), c.unwrap())
    });
    free(&p, a, 32 * MIB, &s);
    free(&p, c, 32 * MIB, &u);
    s.synchronize_blocking().unwrap();
    u.synchronize_blocking().unwrap();
    assert_eq!(p.stats().reserved, 64 * MIB);
    let stop = AtomicBool::new(false);
    let served = std::thread::scope(|scope| {
        // `s` never idles: a spin of 5 ms queued every 4 ms.
        scope.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                s.spin(Duration::from_millis(5)).unwrap();
                std::thread::sleep(Duration::from_millis(4));
            }
        });
        std::thread::sleep(Duration::from_millis(20));
        let b = scope
            .spawn(|| {
                let b = futures::executor::block_on(
                    p.allocate_async(64 * MIB, &t)
                        .timeout(Duration::from_secs(3)),
                );
                if let Ok(b) = &b {
                    free(&p, *b, 64 * MIB, &t);
                }
                b
            })
            .join();
        // Stopped before a panic goes on: the scope waits for the feeder.
        stop.store(true, Ordering::Relaxed);
        b.unwrap()
    });
    assert!(served.is_ok(), "{served:?} {:?}", p.stats());
    assert!(p.relocations() >= 1);
    s.synchronize_blocking().unwrap();
    t.synchronize_blocking().unwrap();
    p.check_invariants().unwrap();
}
