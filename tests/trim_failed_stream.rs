//! A stream whose work failed (a sticky error: a faulting kernel poisons it, as it breaks a
//! CUDA context) must not block every trim. A review found `trim`/`trim_blocking` of both
//! pools returning that stream's error every time, releasing nothing, for ever: the first
//! stage synchronized every dropped stream and returned the first error before releasing
//! anything; the second returned the error of any stream its chunks waited for, putting
//! everything back. Simulated device, threaded execution (the default).

mod common;

use std::time::Duration;

use common::{arena, check_arena, check_pool, free, pool, runtime};
use streamalloc::{
    Device, DevicePtr, ExpandableOptions, ExpandablePoolResource, FaultKind, Faults,
    MemoryResource, RaceDetection, SimConfig, Stream,
};

const MIB: usize = 1 << 20;

/// A simulated device that records (rather than panics at) the use after free that poisons
/// a stream.
fn device() -> Device {
    Device::simulated(SimConfig {
        race_detection: RaceDetection::Record,
        ..SimConfig::default()
    })
}

/// Poisons `stream`: a kernel that writes to freed device memory fails when the stream runs
/// it, and every later synchronization of the stream fails with that error.
fn poison(device: &Device, stream: &Stream) {
    let ptr = device.malloc(4096).unwrap();
    // SAFETY: deliberately wrong on the simulated device, which checks every access and
    // reports it (poisoning the stream) instead of touching memory.
    unsafe {
        device.free(ptr).unwrap();
        stream.fill_u32(ptr, 1, 16).unwrap();
    }
    assert!(
        stream.synchronize_blocking().is_err(),
        "the stream is not poisoned"
    );
}

/// 8 MiB from `r` freed on each of two new streams, `bad` poisoned before its free and `good`
/// fine: `(bad, good)`.
fn freed_on_a_failed_and_a_good_stream<R: MemoryResource + ?Sized>(
    device: &Device,
    r: &R,
) -> (Stream, Stream) {
    let bad = device.create_stream().unwrap();
    let good = device.create_stream().unwrap();
    let a = r.allocate(8 * MIB, &bad).unwrap();
    let b = r.allocate(8 * MIB, &good).unwrap();
    poison(device, &bad);
    free(r, a, 8 * MIB, &bad);
    free(r, b, 8 * MIB, &good);
    (bad, good)
}

/// Two allocations of `bytes` at `a` and `b` do not overlap.
fn disjoint(a: DevicePtr, b: DevicePtr, bytes: usize) -> bool {
    let (a, b) = (a.as_raw(), b.as_raw());
    a + bytes as u64 <= b || b + bytes as u64 <= a
}

/// Memory freed on a stream that then failed, the stream dropped: the trim lets the stream go
/// (its work has ended), releases everything, and returns `Ok`; so does the next one.
#[test]
fn a_dropped_failed_stream_does_not_block_the_pools_trim() {
    let device = device();
    let pool = pool(&device, 0, 64 * MIB);
    let (bad, good) = freed_on_a_failed_and_a_good_stream(&device, &pool);
    drop(bad);
    let reserved = pool.stats().reserved;
    assert!(reserved >= 16 * MIB, "{:?}", pool.stats());
    let released = pool
        .trim_blocking()
        .expect("the trim failed for the dropped stream");
    assert_eq!(released, reserved, "{:?}", pool.stats());
    assert_eq!(pool.stats().reserved, 0, "{:?}", pool.stats());
    check_pool(&pool);
    assert_eq!(pool.trim_blocking().unwrap(), 0);
    check_pool(&pool);
    // Still works: nothing handed out twice.
    let c = pool.allocate(8 * MIB, &good).unwrap();
    let d = pool.allocate(8 * MIB, &good).unwrap();
    assert!(disjoint(c, d, 8 * MIB), "{c:?} and {d:?} overlap");
    free(&pool, c, 8 * MIB, &good);
    free(&pool, d, 8 * MIB, &good);
    check_pool(&pool);
}

/// As above, with the async `trim`.
#[test]
fn a_dropped_failed_stream_does_not_block_the_pools_async_trim() {
    let device = device();
    let pool = pool(&device, 0, 64 * MIB);
    let bad = device.create_stream().unwrap();
    let a = pool.allocate(8 * MIB, &bad).unwrap();
    poison(&device, &bad);
    free(&pool, a, 8 * MIB, &bad);
    drop(bad);
    let reserved = pool.stats().reserved;
    let rt = runtime();
    let released = rt
        .block_on(pool.trim())
        .expect("the trim failed for the dropped stream");
    assert_eq!(released, reserved, "{:?}", pool.stats());
    assert_eq!(rt.block_on(pool.trim()).unwrap(), 0);
    check_pool(&pool);
}

/// The failed stream still alive: the chunks last freed on it stay in the pool, free (still
/// ordered after it), the rest is released, and the trim returns `Ok` with those bytes.
#[test]
fn a_live_failed_streams_chunks_stay_and_the_rest_is_released() {
    let device = device();
    let pool = pool(&device, 0, 64 * MIB);
    let bad = device.create_stream().unwrap();
    let good = device.create_stream().unwrap();
    let a = pool.allocate(8 * MIB, &bad).unwrap();
    let b = pool.allocate(8 * MIB, &good).unwrap();
    free(&pool, b, 8 * MIB, &good);
    poison(&device, &bad);
    free(&pool, a, 8 * MIB, &bad);
    let before = pool.stats();
    for round in 0..2 {
        let released = pool
            .trim_blocking()
            .unwrap_or_else(|e| panic!("trim {round} failed for the live stream: {e}"));
        let after = pool.stats();
        check_pool(&pool);
        // A's chunk stays, free; the rest went (at the first trim).
        assert!(after.reserved >= 8 * MIB, "trim {round}: {after:?}");
        assert_eq!(after.free, after.reserved, "trim {round}: {after:?}");
        assert_eq!(
            released,
            if round == 0 {
                before.reserved - after.reserved
            } else {
                0
            },
            "trim {round}: {before:?} -> {after:?}"
        );
        assert!(released > 0 || round == 1, "trim {round}: {after:?}");
    }
    // The kept chunk is A's, still free as freed on `bad`: `bad` is served from it again.
    let again = pool.allocate(8 * MIB, &bad).unwrap();
    assert_eq!(again, a, "not served from the chunk kept");
    let other = pool.allocate(8 * MIB, &good).unwrap();
    assert!(
        disjoint(again, other, 8 * MIB),
        "{again:?} and {other:?} overlap"
    );
    free(&pool, again, 8 * MIB, &bad);
    free(&pool, other, 8 * MIB, &good);
    check_pool(&pool);
}

/// The expandable pool: a dropped failed stream is let go of; a live one's granules stay
/// mapped and free; the rest is unmapped, and the trim returns `Ok`.
#[test]
fn a_failed_stream_does_not_block_the_expandable_pools_trim() {
    let device = device();
    let p = ExpandablePoolResource::new(
        &device,
        ExpandableOptions {
            maximum: Some(64 * MIB),
            ..ExpandableOptions::default()
        },
    )
    .unwrap();
    let g = p.granule();
    let bad = device.create_stream().unwrap();
    let good = device.create_stream().unwrap();
    // `m` stays live between them: the granules freed on `bad` and on `good` do not coalesce.
    let a = p.allocate(g, &bad).unwrap();
    let m = p.allocate(g, &good).unwrap();
    let c = p.allocate(g, &good).unwrap();
    poison(&device, &bad);
    free(&p, a, g, &bad);
    free(&p, c, g, &good);
    let before = p.stats();
    for round in 0..2 {
        let unmapped = p
            .trim_blocking()
            .unwrap_or_else(|e| panic!("trim {round} failed for the live stream: {e}"));
        let after = p.stats();
        p.check_invariants().unwrap();
        // `a`'s granule stays mapped and free, `m`'s stays; `c`'s went at the first trim.
        assert_eq!(after.reserved, 2 * g, "trim {round}: {after:?}");
        assert_eq!(after.free, g, "trim {round}: {after:?}");
        let expected = if round == 0 {
            before.reserved - 2 * g
        } else {
            0
        };
        assert_eq!(unmapped, expected, "trim {round}: {before:?} -> {after:?}");
    }
    // The kept granule is `a`'s, free as freed on `bad`.
    let again = p.allocate(g, &bad).unwrap();
    assert_eq!(again, a, "not served from the granule kept");
    assert!(disjoint(again, m, g));
    free(&p, again, g, &bad);
    // Now dropped: the next trim lets it go (its work has ended) and unmaps its granule.
    drop(bad);
    let unmapped = p
        .trim_blocking()
        .expect("the trim failed for the dropped stream");
    assert_eq!(unmapped, g, "{:?}", p.stats());
    assert_eq!(p.stats().reserved, g, "{:?}", p.stats());
    free(&p, m, g, &good);
    p.check_invariants().unwrap();
    assert_eq!(p.trim_blocking().unwrap(), g);
    assert_eq!(p.stats().reserved, 0, "{:?}", p.stats());
}

/// A synchronization that fails as a call (an injected fault, before any wait) while a
/// dropped stream's work still runs: the trim goes on, but hands none of the memory freed on
/// that stream to another stream, or upstream, before that work has run (`forget` keeps a
/// stream that is not idle; the chunk waiting for it is kept). The race detector would see
/// the other stream's fill land on memory the first stream's fills still use.
#[test]
fn a_failed_synchronize_call_lets_nothing_go_while_the_stream_works() {
    let faults = Faults::new();
    let device = Device::simulated(SimConfig {
        race_detection: RaceDetection::Record,
        // The stream's fills keep it busy well past the trim (if not, the stream is idle
        // when the trim asks, and letting it go is right: the test then checks less).
        op_delay: Duration::from_millis(100),
        faults: faults.clone(),
        ..SimConfig::default()
    });
    let pool = pool(&device, 0, 8 * MIB);
    let s = device.create_stream().unwrap();
    let a = pool.allocate(8 * MIB, &s).unwrap();
    for _ in 0..20 {
        // SAFETY: `a` is ours until freed below, after these fills on `s`.
        unsafe { s.fill_u32(a, 7, 1024) }.unwrap();
    }
    free(&pool, a, 8 * MIB, &s);
    drop(s);
    faults.fail_always(FaultKind::Synchronize);
    pool.trim_blocking()
        .expect("the trim failed for a failed synchronization");
    assert!(faults.injected(FaultKind::Synchronize) >= 1);
    faults.clear();
    check_pool(&pool);
    let other = device.create_stream().unwrap();
    let b = pool.allocate(8 * MIB, &other).unwrap();
    // SAFETY: `b` is ours; the pool orders it after the work of the stream that freed it.
    unsafe { other.fill_u32(b, 1, 1024) }.unwrap();
    other.synchronize_blocking().unwrap();
    free(&pool, b, 8 * MIB, &other);
    let races = device.races();
    assert!(races.is_empty(), "{races:?}");
    check_pool(&pool);
}

/// The arena's trim waits for each chunk's guards, events recorded on the streams that last
/// used it: memory freed on a stream whose work failed (dropped or not) keeps its chunk in the
/// arena, free and still guarded, and the trim releases the rest and returns `Ok`, every time.
/// A review found it returning the failed event's error every time, releasing nothing.
#[test]
fn a_failed_stream_does_not_block_the_arenas_trim() {
    for drop_it in [false, true] {
        let device = device();
        let arena = arena(&device, 0, 64 * MIB);
        let (bad, good) = freed_on_a_failed_and_a_good_stream(&device, &arena);
        if drop_it {
            drop(bad);
        }
        let before = arena.stats();
        assert_eq!(before.chunks, 2, "one chunk each: {before:?}");
        let released = arena
            .trim_blocking()
            .expect("the arena's trim failed for the failed stream");
        let after = arena.stats();
        assert_eq!(released, 8 * MIB, "the good stream's chunk: {after:?}");
        assert_eq!(after.reserved, before.reserved - 8 * MIB, "{after:?}");
        check_arena(&arena);
        // The next trim too, by `.await`; the failed chunk stays.
        let again = runtime().block_on(arena.trim());
        assert_eq!(again.expect("the second trim failed"), 0);
        assert_eq!(arena.stats().reserved, after.reserved);
        check_arena(&arena);
        // Still usable: the kept chunk serves a request on the good stream.
        let c = arena.allocate(8 * MIB, &good).unwrap();
        free(&arena, c, 8 * MIB, &good);
        check_arena(&arena);
    }
}
