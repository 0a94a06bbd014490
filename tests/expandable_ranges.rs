//! `ExpandablePoolResource` at its maximum with free memory spread over its shards' address
//! ranges (free memory in different ranges never coalesces): a request the free memory could
//! serve moves it, granules whose last users have finished unmapped in one range and mapped in
//! another, and never a granule that a stream may still use.

mod common;

use std::time::{Duration, Instant};

use common::{devices, free, label, read_u32, take_turns};
use streamalloc::resource::snapshot::BlockState;
use streamalloc::{
    AllocateAsync, Device, DevicePtr, Error, ExpandableOptions, ExpandablePoolResource, FaultKind,
    Faults, MemoryResource, SimConfig,
};

const MIB: usize = 1 << 20;

// One test at a time (`take_turns`): they fill the device's memory up to their maximum.

/// A pool whose reservation per shard, maximum and initial size are all `size`: the initial
/// memory is mapped in pieces over the shards' ranges (from 32 MiB a shard), which belong to
/// no shard until a thread's request claims one, and nothing more may map.
fn full_pool(device: &Device, size: usize) -> ExpandablePoolResource {
    ExpandablePoolResource::new(
        device,
        ExpandableOptions {
            reserve: Some(size),
            maximum: Some(size),
            initial: size,
            ..ExpandableOptions::default()
        },
    )
    .unwrap()
}

fn ranges(p: &ExpandablePoolResource, per_shard: usize) -> usize {
    p.reservation().1 / per_shard
}

/// `allocate(share)` on `stream` from `count` threads, one after another, each new: threads
/// are spread over the shards in the order they first ask, so each claims the piece of the
/// initial memory in a range of its own (one thread would claim them all into its own range,
/// moving the others). The blocks, one per range. This relies on no other thread asking a pool
/// for memory for the first time meanwhile (every test here holds `serial`); if one did, the
/// assertion below says so.
fn one_share_per_range(
    p: &ExpandablePoolResource,
    share: usize,
    stream: &streamalloc::Stream,
    count: usize,
) -> Vec<DevicePtr> {
    let blocks: Vec<DevicePtr> = (0..count)
        .map(|_| std::thread::scope(|scope| scope.spawn(|| p.allocate(share, stream)).join()))
        .map(|r| r.expect("an allocating thread").unwrap())
        .collect();
    assert_eq!(
        p.initial_moves(),
        0,
        "a thread claimed another range's piece"
    );
    blocks
}

fn check(p: &ExpandablePoolResource) {
    p.check_invariants()
        .unwrap_or_else(|e| panic!("invariants: {e}"));
}

/// A simulated device whose driver calls fail when told to.
fn faulty_device() -> (Faults, Device) {
    let faults = Faults::new();
    let device = Device::simulated(SimConfig {
        faults: faults.clone(),
        ..SimConfig::default()
    });
    (faults, device)
}

/// The pool's counts agree with each other and with the device's memory: every mapped byte is
/// free or in use, and the device has given out exactly what is mapped (no unit leaked).
fn counts_agree(device: &Device, p: &ExpandablePoolResource) {
    let stats = p.stats();
    assert_eq!(stats.free + stats.in_use, stats.reserved, "{stats:?}");
    assert_eq!(
        device.free_memory().unwrap(),
        device.total_memory() - stats.reserved,
        "a unit leaked: {stats:?}"
    );
    check(p);
}

/// A trim gives everything back: nothing mapped, the device's memory whole again.
fn trim_gives_everything_back(device: &Device, p: &ExpandablePoolResource) {
    p.trim_blocking().unwrap();
    assert_eq!(p.stats().reserved, 0);
    assert_eq!(device.free_memory().unwrap(), device.total_memory());
    check(p);
}

/// The review's first case: everything mapped up front, spread over the ranges, none of it
/// used; a request of half the maximum is served (its thread claimed the pieces of other
/// ranges, moving them into its own).
#[test]
fn fresh_memory_in_other_ranges_serves_a_request_at_the_maximum() {
    let _turn = take_turns();
    for device in devices() {
        let size = 256 * MIB;
        let p = full_pool(&device, size);
        let spread = ranges(&p, size) > 1;
        assert_eq!(p.stats().reserved, size, "{}", label(&device));
        let s = device.create_stream().unwrap();
        let half = p.allocate(size / 2, &s).unwrap();
        let stats = p.stats();
        assert!(stats.reserved <= size, "{}: {stats:?}", label(&device));
        if spread {
            assert!(p.initial_moves() >= 1, "{}: {stats:?}", label(&device));
        }
        check(&p);
        // The whole maximum too, once the half is back.
        free(&p, half, size / 2, &s);
        let all = p.allocate(size, &s).unwrap();
        assert!(p.stats().reserved <= size);
        check(&p);
        free(&p, all, size, &s);
        check(&p);
    }
}

/// The review's second case: four threads fill their ranges, free everything and synchronize;
/// a request of half the maximum from another thread is served.
#[test]
fn memory_threads_freed_in_their_ranges_serves_a_request_at_the_maximum() {
    let _turn = take_turns();
    for device in devices() {
        let size = 64 * MIB;
        let p = ExpandablePoolResource::new(
            &device,
            ExpandableOptions {
                reserve: Some(size),
                maximum: Some(size),
                ..ExpandableOptions::default()
            },
        )
        .unwrap();
        let g = p.granule();
        let per = size / 4;
        let barrier = std::sync::Barrier::new(4);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                let (p, device, barrier) = (&p, &device, &barrier);
                scope.spawn(move || {
                    let s = device.create_stream().unwrap();
                    let x = p.allocate(per - g, &s).unwrap();
                    barrier.wait();
                    free(p, x, per - g, &s);
                    s.synchronize_blocking().unwrap();
                });
            }
        });
        check(&p);
        let s = device.create_stream().unwrap();
        let half = p.allocate(size / 2, &s);
        assert!(half.is_ok(), "{}: {half:?} {:?}", label(&device), p.stats());
        assert!(p.stats().reserved <= size);
        free(&p, half.unwrap(), size / 2, &s);
        check(&p);
    }
}

/// Memory freed on a stream that is still busy is not moved: a request that needs it is
/// refused while the stream's work runs (the pool cannot wait on the host inside
/// `allocate`), and served once the work is done; the work that ran on the memory before its
/// free finished on mapped memory, with its data intact.
#[test]
fn memory_freed_on_a_busy_stream_is_not_moved() {
    let _turn = take_turns();
    for device in devices() {
        let size = 256 * MIB;
        let p = full_pool(&device, size);
        let regions = ranges(&p, size);
        if regions == 1 {
            continue; // one range: nothing ever moves
        }
        let share = size / regions;
        // The top granule of each share: a move takes the highest addresses first.
        let g = p.granule();
        let words = g / 4;
        let busy = device.create_stream().unwrap();
        let other = device.create_stream().unwrap();
        // Every share, on the busy stream, behind a spin; the top of each filled and read
        // back after it.
        let mut spin = Duration::from_millis(500);
        let launched = Instant::now();
        busy.spin(spin).unwrap();
        let blocks = one_share_per_range(&p, share, &busy, regions);
        let mut host = vec![vec![0u32; words]; regions];
        for (i, (&x, back)) in blocks.iter().zip(host.iter_mut()).enumerate() {
            // SAFETY: `x` is live and used on `busy` only, before its free below; `back` has
            // `words` words and is read only after `busy` is synchronized.
            unsafe {
                let top = DevicePtr(x.0 + (share - g) as u64);
                busy.fill_u32(top, 0xC0DE_0000 + i as u32, words).unwrap();
                busy.copy_dtoh(back.as_mut_ptr() as *mut u8, top, g)
                    .unwrap();
            }
        }
        for &x in &blocks {
            free(&p, x, share, &busy);
        }
        let refused = p.allocate(2 * share, &other);
        if launched.elapsed() >= spin {
            // The host came late (the spin may have ended): a success proves nothing.
            spin = Duration::ZERO;
        }
        let stats = p.stats();
        // Before any assertion: the queued copies write into `host`, which a panic would free.
        let synced = busy.synchronize_blocking();
        assert!(
            synced.is_ok(),
            "{}: the busy stream's work failed (memory moved under it?): {synced:?}",
            label(&device)
        );
        match &refused {
            Err(Error::OutOfMemory { requested, .. }) => assert_eq!(*requested, 2 * share),
            Ok(_) if spin.is_zero() => {}
            other => panic!(
                "{}: memory of a busy stream moved: {other:?} {stats:?}",
                label(&device)
            ),
        }
        if let Ok(ptr) = refused {
            free(&p, ptr, 2 * share, &other);
        }
        for (i, back) in host.iter().enumerate() {
            assert!(
                back.iter().all(|&w| w == 0xC0DE_0000 + i as u32),
                "{}: the data of share {i} did not come back",
                label(&device)
            );
        }
        let served = p.allocate(2 * share, &other).unwrap();
        assert!(p.relocations() >= 1, "{}", label(&device));
        assert!(p.stats().reserved <= size);
        // SAFETY: `served` is live and used on `other` only, before its free.
        unsafe { other.fill_u32(served, 7, 2 * share / 4) }.unwrap();
        assert_eq!(read_u32(&other, served, 2 * share / 4)[0], 7);
        free(&p, served, 2 * share, &other);
        check(&p);
    }
}

/// A failed question (`cuStreamQuery`) is a busy answer: nothing moves and the request is
/// refused with a typed error; a failed mapping after the move loses nothing but the room it
/// unmapped (given back to the device), and the pool stays usable.
#[test]
fn faults_while_moving_lose_nothing() {
    let _turn = take_turns();
    let (faults, device) = faulty_device();
    let size = 256 * MIB;
    let p = full_pool(&device, size);
    let share = size / ranges(&p, size);
    let s = device.create_stream().unwrap();
    let other = device.create_stream().unwrap();
    // Every share used and freed on `s`, whose work is done.
    let blocks = one_share_per_range(&p, share, &s, ranges(&p, size));
    for &x in &blocks {
        free(&p, x, share, &s);
    }
    s.synchronize_blocking().unwrap();

    faults.fail_always(FaultKind::Query);
    match p.allocate(2 * share, &other) {
        Err(e @ Error::OutOfMemory { .. }) => assert!(e.is_out_of_memory()),
        other => panic!("expected out of memory on failed queries, got {other:?}"),
    }
    faults.clear();
    assert_eq!(p.stats().reserved, size, "nothing moved");
    check(&p);

    faults.fail_nth(FaultKind::MemMap, 1);
    // The refused request above queued a wait for `s` off this thread (the pool's
    // `settle_busy`), which on the simulated device records an event on `s`: until that has
    // run, `s` answers busy and nothing moves (out of memory, the armed fault unused). Seen on
    // a 16-core host (2026-11-25): retry for a while.
    let mut tries = 0;
    loop {
        match p.allocate(2 * share, &other) {
            Err(Error::Driver { call, .. }) => {
                assert_eq!(call, "cuMemMap");
                break;
            }
            Err(Error::OutOfMemory { .. }) if tries < 2000 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            other => panic!("expected the injected cuMemMap failure, got {other:?}"),
        }
    }
    let stats = p.stats();
    assert_eq!(stats.free, stats.reserved, "free memory lost: {stats:?}");
    counts_agree(&device, &p);

    let served = p.allocate(2 * share, &other).unwrap();
    free(&p, served, 2 * share, &other);
    trim_gives_everything_back(&device, &p);
}

/// `allocate_async` of memory that only a move could give, the memory freed on a busy stream:
/// it waits (no free will come), and is served once that stream's work is done (the pool
/// waits for the stream off the caller's thread and wakes its waiters).
#[test]
fn an_awaited_request_is_served_once_the_busy_stream_finishes() {
    let _turn = take_turns();
    let rt = common::runtime();
    for device in devices() {
        let size = 256 * MIB;
        let p = full_pool(&device, size);
        let regions = ranges(&p, size);
        if regions == 1 {
            continue;
        }
        let share = size / regions;
        let busy = device.create_stream().unwrap();
        let other = device.create_stream().unwrap();
        busy.spin(Duration::from_millis(300)).unwrap();
        let blocks = one_share_per_range(&p, share, &busy, regions);
        for &x in &blocks {
            free(&p, x, share, &busy);
        }
        let got = rt
            .block_on(async {
                tokio::time::timeout(Duration::from_secs(20), p.allocate_async(2 * share, &other))
                    .await
            })
            .unwrap_or_else(|_| panic!("{}: waited 20 s: {:?}", label(&device), p.stats()))
            .unwrap();
        assert!(busy.is_idle().unwrap_or(true), "{}", label(&device));
        assert!(p.stats().reserved <= size);
        free(&p, got, 2 * share, &other);
        check(&p);
    }
}

/// The initial size is mapped in pieces, one per range, that belong to no shard until a
/// request claims one: they count as free (statistics and snapshots), and one thread's
/// requests claim them all into its own range (its range's piece as it is, the others moved)
/// before they take memory from another shard. So its blocks coalesce there: once it has
/// freed them, a request of nearly the whole initial size is served with no growth (with the
/// pieces left in their ranges, it would have needed a growth that moves memory at the
/// maximum).
#[test]
fn one_thread_claims_every_piece_into_its_own_range() {
    let _turn = take_turns();
    for device in devices() {
        let size = 256 * MIB;
        let p = full_pool(&device, size);
        let regions = ranges(&p, size);
        let piece = size / regions;
        let stats = p.stats();
        assert_eq!((stats.reserved, stats.free), (size, size), "{stats:?}");
        let free_shown = p.snapshot().bytes(BlockState::Free);
        assert_eq!(free_shown, size as u64, "{}: the snapshot", label(&device));

        let s = device.create_stream().unwrap();
        let block = piece - 2 * MIB;
        let blocks: Vec<DevicePtr> = (0..regions)
            .map(|_| p.allocate(block, &s).unwrap())
            .collect();
        let stats = p.stats();
        assert_eq!(
            p.initial_moves(),
            regions as u64 - 1,
            "{}: {stats:?}",
            label(&device)
        );
        assert_eq!(stats.shard_spills, 0, "{}: {stats:?}", label(&device));
        assert_eq!(stats.grows, 0, "{}: {stats:?}", label(&device));
        // The moves keep the initial size mapped: as many units mapped as unmapped.
        assert_eq!(stats.reserved, size, "{}: {stats:?}", label(&device));
        check(&p);
        for &x in &blocks {
            free(&p, x, block, &s);
        }
        let whole = regions * block;
        let x = p.allocate(whole, &s).unwrap();
        let stats = p.stats();
        assert_eq!(stats.grows, 0, "{}: {stats:?}", label(&device));
        assert_eq!(p.relocations(), 0, "{}: {stats:?}", label(&device));
        assert!(stats.reserved <= size, "{}: {stats:?}", label(&device));
        // SAFETY: `x` is live and used on `s` only, before its free.
        unsafe { s.fill_u32(x, 9, whole / 4) }.unwrap();
        assert_eq!(read_u32(&s, x, whole / 4)[whole / 4 - 1], 9);
        free(&p, x, whole, &s);
        check(&p);
        p.trim_blocking().unwrap();
        assert_eq!(p.stats().reserved, 0, "{}", label(&device));
    }
}

/// Pieces of the initial size larger than 64 MiB are not moved (a move costs driver calls per
/// unit, and a large initial size seldom grows): a thread that needs more than its range's
/// piece takes the others where they lie, each given to its own range's shard.
#[test]
fn large_pieces_stay_in_their_ranges() {
    let _turn = take_turns();
    for device in devices() {
        let size = 768 * MIB;
        let p = full_pool(&device, size);
        let regions = ranges(&p, size);
        if regions == 1 {
            continue; // one range: every piece is the thread's own
        }
        let piece = size / regions;
        let s = device.create_stream().unwrap();
        let block = piece - 2 * MIB;
        let a = p.allocate(block, &s).unwrap();
        let b = p.allocate(block, &s).unwrap();
        let stats = p.stats();
        assert_eq!(p.initial_moves(), 0, "{}: {stats:?}", label(&device));
        assert_eq!(stats.shard_spills, 1, "{}: {stats:?}", label(&device));
        assert_eq!(stats.reserved, size, "{}: {stats:?}", label(&device));
        assert_eq!(
            stats.free,
            size - 2 * block,
            "{}: {stats:?}",
            label(&device)
        );
        check(&p);
        free(&p, a, block, &s);
        free(&p, b, block, &s);
        check(&p);
    }
}

/// A move of a claimed piece whose mapping fails (the device out of memory between the unmap
/// and the map) loses nothing: the piece's memory went back to the device, the pool holds that
/// much less, and the request is served by the next piece; the counts agree with the device's.
/// (The simulated device's unmap does not fail; a failed unmap on a GPU leaves the units it
/// could not unmap mapped, as free memory of their own range.)
#[test]
fn faults_while_claiming_lose_nothing() {
    let _turn = take_turns();
    let (faults, device) = faulty_device();
    let size = 256 * MIB;
    let p = full_pool(&device, size);
    let regions = ranges(&p, size);
    assert!(regions > 2, "the simulated device has room for the ranges");
    let piece = size / regions;
    let block = piece - 2 * MIB;
    let s = device.create_stream().unwrap();
    // The thread's own piece, as it lies.
    let a = p.allocate(block, &s).unwrap();
    // The next piece's map fails after its unmap: that piece is gone, the one after serves.
    faults.fail_nth(FaultKind::MemMap, 1);
    let b = p.allocate(block, &s).unwrap();
    faults.clear();
    assert_eq!(p.stats().reserved, size - piece);
    assert_eq!(p.initial_moves(), 1, "the failed move is not counted");
    counts_agree(&device, &p);
    for x in [a, b] {
        free(&p, x, block, &s);
    }
    counts_agree(&device, &p);
    trim_gives_everything_back(&device, &p);
}

/// A simulated device the size of an H100 (80 GiB) makes an expandable pool with its default
/// options: a reservation of the device's size in each of its shards' ranges, whatever the
/// host's memory. A review found it refused on a 23 GiB host (the simulated reservation was
/// one host allocation of its whole size, which the kernel's overcommit policy refuses), and a
/// 16 GiB simulated device quietly making one range instead of eight.
#[test]
fn a_reservation_larger_than_the_host_costs_it_nothing() {
    // Its turn too: its first request spreads this thread over the shards, and one beside
    // `one_share_per_range` shifted those threads' shards (CI saw "a thread claimed another
    // range's piece" in `an_awaited_request_is_served_once_the_busy_stream_finishes`).
    let _turn = take_turns();
    let total = 80usize << 30;
    let h100 = Device::simulated(SimConfig {
        total_memory: total,
        ..SimConfig::default()
    });
    let pool = ExpandablePoolResource::new(&h100, ExpandableOptions::default())
        .expect("an expandable pool on a simulated 80 GiB device");
    let (_, reserved) = pool.reservation();
    assert_eq!(
        reserved,
        8 * total,
        "a range of the device's size for each of 8 shards"
    );
    let s = h100.create_stream().unwrap();
    let p = pool.allocate(MIB, &s).unwrap();
    free(&pool, p, MIB, &s);
    s.synchronize_blocking().unwrap();
}
