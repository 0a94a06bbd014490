//! Trims beside a stream under a user's graph capture (pretended on the simulated device:
//! [`Stream::pretend_capture`]): what needs no ordering on the capturing stream is released,
//! what does stays (kept, not lost), and the trim returns `Ok` with the bytes it released.
//! Before, a trim failed as a whole with `StreamCapturing` and released nothing.

use std::time::{Duration, Instant};

use crate::resource::{ArenaOptions, ArenaResource};
use crate::{
    CudaResource, Device, ExpandableOptions, ExpandablePoolResource, MemoryResource, PoolOptions,
    PoolResource, SimConfig, Stream,
};

const MIB: usize = 1 << 20;

fn device() -> Device {
    Device::simulated(SimConfig::default())
}

/// A pool of two chunks, one freed on a stream then captured, one freed on another stream.
/// Returns the pool, the capturing stream, and the size of the capturing stream's chunk.
fn pool_with_a_captured_chunk(device: &Device) -> (PoolResource<CudaResource>, Stream, usize) {
    let pool = PoolResource::new(
        CudaResource::new(device),
        PoolOptions {
            initial: MIB,
            maximum: Some(64 * MIB),
            ..Default::default()
        },
    )
    .unwrap();
    let (captured, other) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    // The initial chunk, whole, to the captured stream; a chunk grown for the other's.
    let a = pool.allocate(MIB, &captured).unwrap();
    let b = pool.allocate(4 * MIB, &other).unwrap();
    assert_eq!(pool.stats().chunks, 2);
    // SAFETY: from `pool` with these sizes, unused.
    unsafe {
        pool.deallocate(a, MIB, &captured).unwrap();
        pool.deallocate(b, 4 * MIB, &other).unwrap();
    }
    captured.pretend_capture(true);
    (pool, captured, MIB)
}

#[test]
fn a_pool_trim_releases_what_no_capture_holds() {
    let device = device();
    let (pool, captured, kept) = pool_with_a_captured_chunk(&device);
    let before = pool.stats().reserved;
    let released = pool.trim_blocking().expect("a partial trim, not a refusal");
    assert_eq!(
        released,
        before - kept,
        "the other stream's chunk, and only it"
    );
    assert_eq!(pool.stats().reserved, kept);
    pool.check_invariants().unwrap();
    // Kept, not lost: once the capture ends, the next trim releases it.
    captured.pretend_capture(false);
    assert_eq!(pool.trim_blocking().unwrap(), kept);
    assert_eq!(pool.stats().reserved, 0);
}

#[test]
fn a_pool_async_trim_releases_what_no_capture_holds() {
    let device = device();
    let (pool, captured, kept) = pool_with_a_captured_chunk(&device);
    let before = pool.stats().reserved;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let released = rt.block_on(pool.trim()).expect("a partial trim");
    assert_eq!(released, before - kept);
    // The kept chunk still serves the capturing stream, unordered (it was freed there).
    let again = pool.allocate(MIB, &captured).unwrap();
    assert_eq!(pool.stats().reserved, kept);
    // SAFETY: from `pool` with this size, unused.
    unsafe { pool.deallocate(again, MIB, &captured).unwrap() };
    captured.pretend_capture(false);
    assert_eq!(rt.block_on(pool.trim()).unwrap(), kept);
}

/// Three granules: the first freed on a stream then captured, the second live (so that the
/// free granules around it do not coalesce into one block freed on both streams), the third
/// freed on another stream.
fn expandable_parts(
    pool: &ExpandablePoolResource,
    device: &Device,
) -> (Stream, Stream, [crate::DevicePtr; 3]) {
    let g = pool.granule();
    let (captured, other) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let a = pool.allocate(g, &captured).unwrap();
    let live = pool.allocate(g, &other).unwrap();
    let b = pool.allocate(g, &other).unwrap();
    (captured, other, [a, live, b])
}

fn expandable(device: &Device, threshold: Option<usize>) -> ExpandablePoolResource {
    ExpandablePoolResource::new(
        device,
        ExpandableOptions {
            initial: 0,
            release_threshold: threshold,
            small_block_cache: None,
            ..Default::default()
        },
    )
    .unwrap()
}

#[test]
fn an_expandable_trim_releases_what_no_capture_holds() {
    let device = device();
    let pool = expandable(&device, None);
    let g = pool.granule();
    let (captured, other, [a, live, b]) = expandable_parts(&pool, &device);
    // SAFETY: from `pool` with these sizes, unused.
    unsafe {
        pool.deallocate(a, g, &captured).unwrap();
        pool.deallocate(b, g, &other).unwrap();
    }
    captured.pretend_capture(true);
    assert_eq!(pool.stats().reserved, 3 * g);
    let released = pool.trim_blocking().expect("a partial trim, not a refusal");
    assert_eq!(released, g, "the other stream's granule, and only it");
    assert_eq!(pool.stats().reserved, 2 * g);
    pool.check_invariants().unwrap();
    captured.pretend_capture(false);
    assert_eq!(pool.trim_blocking().unwrap(), g);
    // SAFETY: from `pool` with this size, unused.
    unsafe { pool.deallocate(live, g, &other).unwrap() };
    assert_eq!(pool.trim_blocking().unwrap(), g);
    assert_eq!(pool.stats().reserved, 0);
}

/// The automatic release past the threshold (on the device's blocking-work thread) unmaps the
/// other stream's granule beside a capture; before, each release failed as a whole.
#[test]
fn an_expandable_release_past_its_threshold_goes_on_beside_a_capture() {
    let device = device();
    let pool = expandable(&device, Some(0));
    let g = pool.granule();
    let (captured, other, [a, live, b]) = expandable_parts(&pool, &device);
    captured.pretend_capture(true);
    // SAFETY: from `pool` with these sizes, unused.
    unsafe {
        pool.deallocate(a, g, &captured).unwrap();
        pool.deallocate(b, g, &other).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while pool.stats().reserved > 2 * g && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        pool.stats().reserved,
        2 * g,
        "the other stream's granule released, the captured one's kept"
    );
    pool.check_invariants().unwrap();
    captured.pretend_capture(false);
    // SAFETY: from `pool` with this size, unused.
    unsafe { pool.deallocate(live, g, &other).unwrap() };
    // The free queues an automatic release too; a trim beside it leaves it what it holds
    // (issue 11's concurrent trims), so the last granules may go with either: wait for both.
    pool.trim_blocking().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while pool.stats().reserved > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(pool.stats().reserved, 0);
}

/// The arena: superblocks a capturing stream's arena holds stay with it (no guard can be
/// recorded there), and a chunk freed on another stream goes.
#[test]
fn an_arena_trim_releases_what_no_capture_holds() {
    let device = device();
    let arena = ArenaResource::new(
        CudaResource::new(&device),
        ArenaOptions {
            initial: 0,
            maximum: Some(64 * MIB),
            superblock_size: MIB,
        },
    )
    .unwrap();
    let (captured, other) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let small = arena.allocate(4096, &captured).unwrap();
    let large = arena.allocate(8 * MIB, &other).unwrap();
    // SAFETY: from `arena` with these sizes, unused.
    unsafe {
        arena.deallocate(small, 4096, &captured).unwrap();
        arena.deallocate(large, 8 * MIB, &other).unwrap();
    }
    captured.pretend_capture(true);
    let before = arena.stats().reserved;
    let released = arena
        .trim_blocking()
        .expect("a partial trim, not a refusal");
    assert!(released >= 8 * MIB, "released {released} of {before}");
    assert!(
        arena.stats().reserved > 0,
        "the captured stream's chunk is kept"
    );
    captured.pretend_capture(false);
    let rest = arena.trim_blocking().unwrap();
    assert_eq!(released + rest, before);
    assert_eq!(arena.stats().reserved, 0);
}

/// A pool with no initial memory, no small-block cache and no growth cap, at most `maximum`
/// bytes: each request grows a chunk of its own size until the maximum.
fn pool_at_most(device: &Device, maximum: usize) -> PoolResource<CudaResource> {
    let options = PoolOptions {
        initial: 0,
        maximum: Some(maximum),
        small_block_cache: 0,
        growth_cap: None,
        ..Default::default()
    };
    PoolResource::new(CudaResource::new(device), options).unwrap()
}

/// A request on a capturing stream whose best fit needs an ordering the capture refuses, at
/// the pool's maximum, while a trim waits for the GPU with a whole chunk out of the lists: the
/// request takes that chunk back, as a request refused by no capture does, and is served from
/// it (freed on the capturing stream itself: no ordering). Before, this path never recalled
/// and failed with the memory in the pool.
#[test]
fn a_capturing_request_at_the_maximum_recalls_what_a_trim_holds() {
    let device = device();
    let pool = pool_at_most(&device, 6 * MIB);
    let (captured, other) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    // Chunk A (4 MiB), then chunk C (2 MiB): the pool at its maximum.
    let x = pool.allocate(4 * MIB, &other).unwrap();
    let c = pool.allocate(2 * MIB, &captured).unwrap();
    assert_eq!(pool.stats().chunks, 2);
    assert_eq!(pool.stats().reserved, 6 * MIB);
    // A: 0.5 MiB live, 3.5 MiB free on the other stream, busy (its reuse needs an ordering).
    // SAFETY: from `pool` with this size, unused.
    unsafe { pool.deallocate(x, 4 * MIB, &other).unwrap() };
    let live = pool.allocate(MIB / 2, &other).unwrap();
    other.spin(Duration::from_millis(1500)).unwrap();
    // C: whole and free on the capturing stream, busy: a trim takes it and waits.
    captured.spin(Duration::from_millis(1500)).unwrap();
    // SAFETY: from `pool` with this size, unused.
    unsafe { pool.deallocate(c, 2 * MIB, &captured).unwrap() };
    let mut trim = Box::pin(pool.trim());
    assert!(
        polled_pending(trim.as_mut()),
        "the trim waits for the stream"
    );
    assert_eq!(pool.stats().free, 7 * MIB / 2, "C is held by the trim");
    captured.pretend_capture(true);
    // The only fit in the lists is A's block, which the capture cannot be ordered after; C,
    // once recalled, is freed on the capturing stream and serves it as it is.
    let again = pool
        .allocate(2 * MIB, &captured)
        .expect("served from the chunk the trim held");
    assert!(
        (c.0..c.0 + 2 * MIB as u64).contains(&again.0),
        "served from C"
    );
    assert_eq!(pool.stats().reserved, 6 * MIB);
    pool.check_invariants().unwrap();
    captured.pretend_capture(false);
    // SAFETY: from `pool` with these sizes, unused.
    unsafe {
        pool.deallocate(again, 2 * MIB, &captured).unwrap();
        pool.deallocate(live, MIB / 2, &other).unwrap();
    }
    // The trim gives back nothing: what it held was taken back.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    assert_eq!(rt.block_on(trim).unwrap(), 0);
    assert_eq!(pool.stats().reserved, 6 * MIB);
    pool.check_invariants().unwrap();
}

/// As above, but the chunks the trim holds were freed on another stream, busy, and are each
/// smaller than the request: once recalled, the growth at the maximum gives them back upstream
/// (after that stream's work) and grows a fresh chunk, which the capturing stream uses with no
/// ordering. Before, the request failed with them held.
#[test]
fn a_capturing_request_at_the_maximum_regrows_from_what_a_trim_holds() {
    let device = device();
    let pool = pool_at_most(&device, 8 * MIB);
    let (captured, other) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    // Chunks of 4, 2 and 2 MiB: the pool at its maximum.
    let x = pool.allocate(4 * MIB, &other).unwrap();
    let c1 = pool.allocate(2 * MIB, &other).unwrap();
    let c2 = pool.allocate(2 * MIB, &other).unwrap();
    assert_eq!((pool.stats().chunks, pool.stats().reserved), (3, 8 * MIB));
    // The 4 MiB chunk: 0.5 MiB live, 3.5 MiB free on the other stream (busy).
    // SAFETY: from `pool` with this size, unused.
    unsafe { pool.deallocate(x, 4 * MIB, &other).unwrap() };
    let live = pool.allocate(MIB / 2, &other).unwrap();
    other.spin(Duration::from_millis(1500)).unwrap();
    // The two small chunks whole and free on it: a trim takes them and waits.
    // SAFETY: from `pool` with these sizes, unused.
    unsafe {
        pool.deallocate(c1, 2 * MIB, &other).unwrap();
        pool.deallocate(c2, 2 * MIB, &other).unwrap();
    }
    let mut trim = Box::pin(pool.trim());
    assert!(
        polled_pending(trim.as_mut()),
        "the trim waits for the stream"
    );
    captured.pretend_capture(true);
    let y = pool
        .allocate(3 * MIB, &captured)
        .expect("served from a chunk grown in the room of those the trim held");
    let stats = pool.stats();
    assert_eq!(stats.in_use, 7 * MIB / 2);
    assert!(stats.reserved <= 8 * MIB);
    pool.check_invariants().unwrap();
    captured.pretend_capture(false);
    // SAFETY: from `pool` with these sizes, unused.
    unsafe {
        pool.deallocate(y, 3 * MIB, &captured).unwrap();
        pool.deallocate(live, MIB / 2, &other).unwrap();
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    assert_eq!(rt.block_on(trim).unwrap(), 0, "what it held went upstream");
    pool.check_invariants().unwrap();
}

/// Polls `fut` once (with a waker that does nothing): whether it is pending.
fn polled_pending<F: std::future::Future>(fut: std::pin::Pin<&mut F>) -> bool {
    use std::sync::Arc;
    use std::task::{Context, Wake, Waker};

    struct Noop;
    impl Wake for Noop {
        fn wake(self: Arc<Self>) {}
    }
    let noop = Waker::from(Arc::new(Noop));
    fut.poll(&mut Context::from_waker(&noop)).is_pending()
}
