//! `ArenaResource` and the streams the user drops: a dropped stream's arena (which holds a
//! handle of the stream, and so the driver's stream) must not linger until a defragmentation,
//! and what it gives back must be reused in stream order. On the simulated device.

use std::time::Duration;

use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::{Device, MemoryResource, RaceDetection, SimConfig};

const MIB: usize = 1 << 20;

/// The arena of a dropped stream was forgotten only by a defragmentation, which runs only when
/// a request finds nothing: a program that makes a stream per task and never runs short kept
/// every stream it ever dropped. The next stream's arena lets go of it now; its free
/// superblock goes back to the global arena ordered after the dropped stream's work, and the
/// next stream that takes it waits for that work (the race detector sees no race).
#[test]
fn a_dropped_stream_is_let_go_of_when_the_next_stream_comes_not_at_a_defragmentation() {
    let device = Device::simulated(SimConfig {
        race_detection: RaceDetection::Record,
        ..SimConfig::default()
    });
    let arena = ArenaResource::new(
        CudaResource::new(&device),
        ArenaOptions {
            initial: 2 * MIB,
            maximum: Some(2 * MIB),
            superblock_size: MIB,
        },
    )
    .unwrap();
    let before = device.handle_count();
    let s = device.create_stream().unwrap();
    let p = arena.allocate(MIB, &s).unwrap();
    // Still writing the block on `s` when it is freed, the stream dropped and the memory
    // taken by another stream.
    s.spin(Duration::from_millis(50)).unwrap();
    // SAFETY: `MIB` live bytes, freed below on the same stream.
    unsafe { s.memset_d8(p, 1, MIB) }.unwrap();
    // SAFETY: allocated above on `s`, freed once.
    unsafe { arena.deallocate(p, MIB, &s) }.unwrap();
    drop(s);
    assert_eq!(arena.stats().streams, 1);

    let t = device.create_stream().unwrap();
    let q = arena.allocate(MIB, &t).unwrap();
    let stats = arena.stats();
    assert_eq!(
        (stats.streams, stats.defragments),
        (1, 0),
        "the arena of the dropped stream is kept: {stats:?}"
    );
    assert_eq!(
        (stats.superblocks, stats.global_free),
        (1, MIB),
        "its free superblock is not back in the global arena: {stats:?}"
    );
    arena.check_invariants().unwrap();

    // `t` has the dropped stream's superblock (the global arena's memory coalesced, so
    // either request may have taken it): its writes are ordered after the memset on `s`.
    let r = arena.allocate(MIB, &t).unwrap();
    assert!(
        q == p || r == p,
        "the dropped stream's superblock is not reused"
    );
    for ptr in [q, r] {
        // SAFETY: `MIB` live bytes of `t`'s.
        unsafe { t.memset_d8(ptr, 2, MIB) }.unwrap();
    }
    t.synchronize_blocking().unwrap();
    let races = device.take_races();
    assert!(races.is_empty(), "{races:#?}");
    assert_eq!(arena.stats().defragments, 0);
    for ptr in [q, r] {
        // SAFETY: allocated above on `t`, each freed once.
        unsafe { arena.deallocate(ptr, MIB, &t) }.unwrap();
    }
    t.synchronize_blocking().unwrap();
    // Nothing of the dropped stream is left: no handle of it, nor of an event recorded on it.
    assert_eq!(device.handle_count(), before + 1, "only `t` is left");
    arena.check_invariants().unwrap();
}

/// A dropped stream whose arena still holds a live block (allocated on it, not freed yet) is
/// kept until the block comes back (freed on another stream), then let go of by the next new
/// stream: its superblock goes back with its remote free adopted.
#[test]
fn a_dropped_stream_holding_a_live_block_is_let_go_of_once_it_is_freed() {
    let device = Device::simulated(SimConfig {
        race_detection: RaceDetection::Record,
        ..SimConfig::default()
    });
    let arena = ArenaResource::new(
        CudaResource::new(&device),
        ArenaOptions {
            initial: 4 * MIB,
            maximum: Some(4 * MIB),
            superblock_size: MIB,
        },
    )
    .unwrap();
    let s = device.create_stream().unwrap();
    let p = arena.allocate(4096, &s).unwrap();
    drop(s);
    let t = device.create_stream().unwrap();
    let q = arena.allocate(4096, &t).unwrap();
    // Live: it stays.
    assert_eq!(arena.stats().streams, 2);
    // SAFETY: allocated above, unused; freed once, on another stream than its arena's.
    unsafe { arena.deallocate(p, 4096, &t) }.unwrap();
    assert_eq!(arena.stats().remote_frees_pending, 1);
    let u = device.create_stream().unwrap();
    let r = arena.allocate(4096, &u).unwrap();
    let stats = arena.stats();
    assert_eq!(
        (stats.streams, stats.defragments, stats.remote_frees_pending),
        (2, 0, 0),
        "{stats:?}"
    );
    arena.check_invariants().unwrap();
    // SAFETY: allocated above, each freed once on its own stream.
    unsafe { arena.deallocate(q, 4096, &t) }.unwrap();
    // SAFETY: as above.
    unsafe { arena.deallocate(r, 4096, &u) }.unwrap();
    t.synchronize_blocking().unwrap();
    u.synchronize_blocking().unwrap();
    assert!(device.take_races().is_empty());
}
