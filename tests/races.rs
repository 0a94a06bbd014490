//! The simulated device's stream-order race detector: planted bugs, each caught by the detector
//! alone (no data is checked), and the same code without the bug, which must stay clean.
//!
//! The bugs in the crate's own ordering (a pool's reuse of memory freed on another stream, `to_host`'s wait) are planted
//! with `FaultKind::SkipWait`, which makes the next wait of a stream a silent no-op: no engine
//! change, and exactly the wait a buggy engine would forget. Simulated device only: the
//! detector is the simulated device's.

mod common;

use std::sync::Arc;
use std::time::Duration;

use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{
    Device, DeviceBuffer, DeviceVec, Error, FaultKind, Faults, MemoryAccess, MemoryResource, Race,
    RaceDetection, RaceKind, SimConfig, Stream,
};

fn device(mode: RaceDetection) -> (Device, Faults) {
    let faults = Faults::new();
    let device = Device::simulated(SimConfig {
        race_detection: mode,
        faults: faults.clone(),
        ..SimConfig::default()
    });
    (device, faults)
}

/// A pool that starts empty (its first chunk comes from a request, into that stream's list)
/// and can hold at most `maximum` bytes. Every cross-stream reuse waits on the GPU
/// (`opportunistic_reuse` off), so that the planted skipped waits are planted whatever the
/// freeing stream's progress; [`pool_opportunistic`] asks first.
fn pool(device: &Device, maximum: usize) -> Arc<PoolResource<CudaResource>> {
    pool_with(device, maximum, false)
}

/// [`pool`] with opportunistic reuse on (the default).
fn pool_opportunistic(device: &Device, maximum: usize) -> Arc<PoolResource<CudaResource>> {
    pool_with(device, maximum, true)
}

fn pool_with(
    device: &Device,
    maximum: usize,
    opportunistic_reuse: bool,
) -> Arc<PoolResource<CudaResource>> {
    Arc::new(
        PoolResource::new(
            CudaResource::new(device),
            PoolOptions {
                initial: 0,
                maximum: Some(maximum),
                opportunistic_reuse,
                ..PoolOptions::default()
            },
        )
        .unwrap(),
    )
}

/// The one race the device found, after letting deferred frees run.
fn the_race(device: &Device) -> Race {
    let mut races = device.take_races();
    assert_eq!(races.len(), 1, "expected exactly one race: {races:#?}");
    races.remove(0)
}

fn streams(device: &Device) -> (Stream, Stream) {
    (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    )
}

// ===== a buffer dropped without record_stream after a use on another stream =====

fn drop_after_use_elsewhere(record: bool) -> (Device, Stream, Stream) {
    let (device, _) = device(RaceDetection::Record);
    let p = pool(&device, 4 << 20);
    let (a, b) = streams(&device);
    let mut buf = DeviceBuffer::new(&p, 4096, &a).unwrap();
    b.wait(&a.record().unwrap()).unwrap(); // `b` is ordered after the allocation...
    b.spin(Duration::from_millis(20)).unwrap();
    // SAFETY: 4096 live bytes; the planted bug is in what follows, not in this use.
    unsafe { b.memset_d8(buf.as_ptr(), 1, 4096) }.unwrap();
    if record {
        buf.record_stream(&b).unwrap();
    }
    drop(buf); // ...but, without `record_stream`, the free on `a` is not ordered after `b`'s use
    b.synchronize_blocking().unwrap();
    a.synchronize_blocking().unwrap();
    common::assert_all_back_within(&p, Duration::from_secs(10), "buffer");
    (device, a, b)
}

#[test]
fn planted_drop_without_record_stream_is_caught() {
    let (device, a, b) = drop_after_use_elsewhere(false);
    let race = the_race(&device);
    assert_eq!(race.kind, RaceKind::FreedWhileInUse, "{race}");
    assert_eq!(
        (race.at.op, race.at.stream),
        ("free", Some(a.id())),
        "{race}"
    );
    assert_eq!(
        (race.earlier.op, race.earlier.stream),
        ("memset_d8", Some(b.id())),
        "{race}"
    );
    let block = race.block.expect("the block");
    assert_eq!(block.allocated.stream, Some(a.id()), "{race}");
    assert_eq!(block.freed.and_then(|f| f.stream), Some(a.id()), "{race}");
    println!("caught: {race}");
}

#[test]
fn drop_after_record_stream_is_clean() {
    let (device, ..) = drop_after_use_elsewhere(true);
    assert_eq!(device.races(), Vec::new());
}

// ===== a pool's cross-stream reuse that skips the wait =====

fn reuse(skip_wait: bool) -> (Device, Stream, Stream) {
    let (device, faults) = device(RaceDetection::Record);
    let p = pool(&device, 4 << 20);
    let (a, b) = streams(&device);
    // The block is used and freed on `a`.
    let mut buf = DeviceBuffer::new(&p, 4096, &a).unwrap();
    a.spin(Duration::from_millis(20)).unwrap();
    buf.memset(7).unwrap();
    drop(buf);
    // The pool has no other memory: `b` reuses `a`'s block, and must wait for `a` first.
    if skip_wait {
        faults.fail_next(FaultKind::SkipWait);
    }
    let mut stolen = DeviceBuffer::new(&p, 4096, &b).unwrap();
    assert_eq!(p.stats().stream_waits, 1, "{:?}", p.stats());
    assert_eq!(faults.injected(FaultKind::SkipWait), u64::from(skip_wait));
    stolen.memset(9).unwrap();
    drop(stolen);
    a.synchronize_blocking().unwrap();
    b.synchronize_blocking().unwrap();
    (device, a, b)
}

#[test]
fn planted_reuse_without_wait_is_caught() {
    let (device, a, b) = reuse(true);
    let race = the_race(&device);
    assert_eq!(race.kind, RaceKind::ReuseBeforeFree, "{race}");
    assert_eq!(
        (race.at.op, race.at.stream),
        ("allocate", Some(b.id())),
        "{race}"
    );
    assert_eq!(
        (race.earlier.op, race.earlier.stream),
        ("free", Some(a.id())),
        "{race}"
    );
    println!("caught: {race}");
}

#[test]
fn reuse_with_wait_is_clean() {
    let (device, ..) = reuse(false);
    assert_eq!(device.races(), Vec::new());
}

// ===== a pool's cross-stream reuse of an idle stream's memory, with no wait =====

/// The block is used and freed on `a`; `b` reuses it once `a` has gone idle with no event the
/// host saw: the pool's question (`cuStreamQuery`) is all that orders `b`'s use after `a`'s,
/// and the detector must take the idle answer as that order for this block (the crate saw
/// `a`'s work finish; since the thirteenth session it orders nothing else of `b`'s:
/// `races_host_clock.rs`). If `a` is still busy when asked, the reuse waits instead: clean
/// either way, and the counts say which path it took.
#[test]
fn reuse_of_an_idle_streams_memory_is_clean() {
    // Until the reuse took the idle path (the pool asked `a` and it was idle): a host slow
    // enough to ask before `a`'s worker ran the memset gets a wait, which checks nothing new.
    for attempt in 0..6u32 {
        let (device, _) = device(RaceDetection::Record);
        let p = pool_opportunistic(&device, 4 << 20);
        let (a, b) = streams(&device);
        let mut buf = DeviceBuffer::new(&p, 4096, &a).unwrap();
        buf.memset(7).unwrap();
        drop(buf);
        // Time for `a`'s worker to run the memset, without the host seeing an event of `a`
        // (asking `a` here would join its clock into the host's, as the pool's question does).
        std::thread::sleep(Duration::from_millis(100) * 2u32.pow(attempt));
        let mut stolen = DeviceBuffer::new(&p, 4096, &b).unwrap();
        let stats = p.stats();
        assert_eq!(stats.stream_waits + stats.idle_reuses, 1, "{stats:?}");
        stolen.memset(9).unwrap();
        drop(stolen);
        a.synchronize_blocking().unwrap();
        b.synchronize_blocking().unwrap();
        assert_eq!(device.races(), Vec::new(), "{stats:?}");
        if stats.idle_reuses == 1 {
            return;
        }
        println!("attempt {attempt}: reused after a wait, not an idle answer; again");
    }
    panic!("the pool never found the freeing stream idle");
}

// ===== a block coalesced across streams, reused without the waits =====

fn coalesced(skip_wait: bool) -> (Device, Stream, Stream, Stream) {
    const HALF: usize = 512 << 10;
    let (device, faults) = device(RaceDetection::Record);
    // One chunk of 1 MiB and no room to grow: a request for all of it can only be served by
    // the two halves, freed on two streams, coalesced: `b` must wait for both.
    let p = pool(&device, 2 * HALF);
    let (a, b) = streams(&device);
    let c = device.create_stream().unwrap();
    let mut x = DeviceBuffer::new(&p, HALF, &a).unwrap();
    let mut y = DeviceBuffer::new(&p, HALF, &a).unwrap();
    x.memset(1).unwrap();
    y.set_stream(&c).unwrap();
    c.wait(&a.record().unwrap()).unwrap();
    c.spin(Duration::from_millis(20)).unwrap();
    y.memset(2).unwrap();
    drop(x); // freed on `a`
             // `y` was moved to `c` (and `c` ordered after `a`): freed there.
    let (ptr, len, resource, stream) = y.into_raw_parts().unwrap();
    assert_eq!(stream.id(), c.id());
    // SAFETY: the parts of `y`, freed once, on `c` after its last use there.
    unsafe { resource.deallocate(ptr, len, &c) }.unwrap();
    if skip_wait {
        faults.fail_always(FaultKind::SkipWait);
    }
    let mut whole = DeviceBuffer::new(&p, 2 * HALF, &b).unwrap();
    faults.clear();
    let stats = p.stats();
    assert_eq!(
        stats.stream_waits, 2,
        "served after waiting on both: {stats:?}"
    );
    whole.memset(3).unwrap();
    drop(whole);
    for s in [&a, &b, &c] {
        s.synchronize_blocking().unwrap();
    }
    (device, a, b, c)
}

#[test]
fn planted_coalesced_reuse_without_waits_is_caught() {
    let (device, a, b, c) = coalesced(true);
    let race = the_race(&device);
    assert_eq!(race.kind, RaceKind::ReuseBeforeFree, "{race}");
    assert_eq!(
        (race.at.op, race.at.stream),
        ("allocate", Some(b.id())),
        "{race}"
    );
    assert_eq!(race.earlier.op, "free", "{race}");
    assert!(
        [Some(a.id()), Some(c.id())].contains(&race.earlier.stream),
        "{race}"
    );
    println!("caught: {race}");
}

#[test]
fn coalesced_reuse_with_waits_is_clean() {
    let (device, ..) = coalesced(false);
    assert_eq!(device.races(), Vec::new());
}

// ===== to_host on a stream that did not wait for the writer =====

#[test]
fn planted_to_host_without_wait_is_caught() {
    let (device, faults) = device(RaceDetection::Record);
    let p = pool(&device, 4 << 20);
    let (a, b) = streams(&device);
    let mut v = DeviceVec::<u32>::zeroed(&p, 1024, &a).unwrap();
    b.wait(&a.record().unwrap()).unwrap(); // `b` is ordered after the allocation...
    a.spin(Duration::from_millis(20)).unwrap();
    v.copy_from_host(&[5; 1024]).unwrap(); // ...not after this write on `a`,
    faults.fail_next(FaultKind::SkipWait); // which `to_host` would order it after.
    let rt = common::runtime();
    rt.block_on(v.to_host(&b)).unwrap();
    drop(v);
    a.synchronize_blocking().unwrap();
    let race = the_race(&device);
    assert_eq!(race.kind, RaceKind::ReadAfterWrite, "{race}");
    assert_eq!(
        (race.at.op, race.at.stream),
        ("copy_dtoh", Some(b.id())),
        "{race}"
    );
    assert_eq!(
        (race.earlier.op, race.earlier.stream),
        ("copy_htod", Some(a.id())),
        "{race}"
    );
    println!("caught: {race}");
}

/// The writer is a third stream, which `to_host` knows nothing of: the user's bug.
#[test]
fn to_host_not_ordered_after_another_writer_is_caught() {
    let (device, _) = device(RaceDetection::Record);
    let p = pool(&device, 4 << 20);
    let (a, b) = streams(&device);
    let w = device.create_stream().unwrap();
    let mut v = DeviceVec::<u32>::zeroed(&p, 1024, &a).unwrap();
    w.wait(&a.record().unwrap()).unwrap();
    w.spin(Duration::from_millis(20)).unwrap();
    v.record_stream(&w).unwrap();
    // SAFETY: 1024 live words; `w` is ordered after the allocation and recorded on the vector.
    unsafe { w.fill_u32(v.as_ptr(), 8, 1024) }.unwrap();
    let rt = common::runtime();
    rt.block_on(v.to_host(&b)).unwrap(); // `b` waits for `a`, not for `w`
    drop(v);
    w.synchronize_blocking().unwrap();
    let race = the_race(&device);
    assert_eq!(race.kind, RaceKind::ReadAfterWrite, "{race}");
    assert_eq!(
        (race.earlier.op, race.earlier.stream),
        ("fill_u32", Some(w.id())),
        "{race}"
    );
    println!("caught: {race}");
}

// ===== the modes =====

#[test]
fn error_mode_refuses_the_racing_operation() {
    let (device, _) = device(RaceDetection::Error);
    let (a, b) = streams(&device);
    let ptr = device.malloc(4096).unwrap();
    // SAFETY: 4096 live bytes, freed below after both streams are synchronized.
    unsafe { a.memset_d8(ptr, 1, 4096) }.unwrap();
    // SAFETY: as above; the race with `a`'s write is the point (and it is refused).
    let err = unsafe { b.memset_d8(ptr, 2, 4096) }.unwrap_err();
    let Error::StreamRace(race) = &err else {
        panic!("{err:?}");
    };
    assert_eq!(race.kind, RaceKind::WriteAfterWrite);
    assert!(err.to_string().contains("memset_d8 on"), "{err}");
    // Not queued, not remembered: once ordered, the same write goes through.
    b.wait(&a.record().unwrap()).unwrap();
    // SAFETY: as above, now ordered after `a`'s write.
    unsafe { b.memset_d8(ptr, 2, 4096) }.unwrap();
    b.declare_access(ptr, 4096, MemoryAccess::Read, "reader")
        .unwrap();
    a.synchronize_blocking().unwrap();
    b.synchronize_blocking().unwrap();
    assert_eq!(device.races().len(), 1);
    // SAFETY: from `malloc`, both streams synchronized.
    unsafe { device.free(ptr) }.unwrap();
    assert_eq!(device.races().len(), 1);
}

#[test]
#[should_panic(expected = "stream-order race (read not ordered after a write on another stream)")]
fn panic_mode_panics_at_the_racing_operation() {
    let (device, _) = device(RaceDetection::Panic);
    let (a, b) = streams(&device);
    let ptr = device.malloc(4096).unwrap();
    a.declare_access(ptr, 4096, MemoryAccess::Write, "producer")
        .unwrap();
    let _ = b.declare_access(ptr, 4096, MemoryAccess::Read, "consumer");
}

#[test]
fn a_synchronous_free_before_the_host_saw_the_use_is_caught() {
    let (device, _) = device(RaceDetection::Record);
    let a = device.create_stream().unwrap();
    let ptr = device.malloc(4096).unwrap();
    a.spin(Duration::from_millis(20)).unwrap();
    // SAFETY: 4096 live bytes.
    unsafe { a.memset_d8(ptr, 1, 4096) }.unwrap();
    // SAFETY: deliberately wrong: the memset may still be queued (the detector reports it;
    // the simulated device's worker then faults on the freed range, poisoning only `a`).
    unsafe { device.free(ptr) }.unwrap();
    let race = the_race(&device);
    assert_eq!(race.kind, RaceKind::FreedWhileInUse, "{race}");
    assert_eq!((race.at.op, race.at.stream), ("free", None), "{race}");
    let _ = a.synchronize_blocking();
}

#[test]
fn disjoint_halves_on_two_streams_are_not_a_race() {
    let (device, _) = device(RaceDetection::Error);
    let (a, b) = streams(&device);
    let ptr = device.malloc(8192).unwrap();
    // SAFETY: each stream writes its own half of 8192 live bytes.
    unsafe {
        a.memset_d8(ptr, 1, 4096).unwrap();
        b.memset_d8(ptr.offset(4096), 2, 4096).unwrap();
        a.fill_u32(ptr, 3, 1024).unwrap();
    }
    a.synchronize_blocking().unwrap();
    b.synchronize_blocking().unwrap();
    // SAFETY: both streams synchronized.
    unsafe { device.free(ptr) }.unwrap();
    assert_eq!(device.races(), Vec::new());
}

#[test]
fn off_records_nothing() {
    let (device, _) = device(RaceDetection::Off);
    let (a, b) = streams(&device);
    let ptr = device.malloc(4096).unwrap();
    // SAFETY: 4096 live bytes; the race between the two writes is the point.
    unsafe {
        a.memset_d8(ptr, 1, 4096).unwrap();
        b.memset_d8(ptr, 2, 4096).unwrap();
    }
    a.synchronize_blocking().unwrap();
    b.synchronize_blocking().unwrap();
    // SAFETY: from `malloc`, both streams synchronized.
    unsafe { device.free(ptr) }.unwrap();
    assert_eq!(device.races(), Vec::new());
    assert_eq!(device.race_detection(), RaceDetection::Off);
}

/// Zero-byte accesses, copies and fills are nothing to the race detector (CUDA takes them as
/// no-ops); a review found them panicking in its range lookup, on the default device.
#[test]
fn zero_byte_work_is_nothing_to_the_detector() {
    let device = Device::simulated(SimConfig::default());
    let s = device.create_stream().unwrap();
    let p = device.malloc(1024).unwrap();
    s.declare_access(p, 0, MemoryAccess::Read, "a kernel that reads nothing")
        .unwrap();
    // A byte at the last address ends past the top: refused at the call, as a stream
    // operation's range there is (it was clipped to nothing and taken).
    let past = s.declare_access(
        streamalloc::DevicePtr(u64::MAX),
        1,
        MemoryAccess::Write,
        "past the end",
    );
    assert!(
        matches!(past, Err(streamalloc::Error::InvalidAddress { .. })),
        "{past:?}"
    );
    // SAFETY: `p` is 1024 bytes of this device; zero bytes are written.
    unsafe {
        s.memset_d8(p, 7, 0).unwrap();
        s.memset_d32(p, 7, 0).unwrap();
    }
    s.synchronize_blocking().unwrap();
    assert_eq!(device.races(), Vec::new());
    // SAFETY: allocated above, nothing uses it any more.
    unsafe { device.free(p) }.unwrap();
}

/// A chunk cut into blocks (as a pool does): a block used on stream `b`, freed, allocated
/// again and freed with no use, then the chunk freed on `a`, which nothing orders after `b`:
/// `b`'s write may still run. A review found the reuse throwing the first life's uses away,
/// and the chunk's free unseen (the same without the reuse was caught).
#[test]
fn a_reused_block_keeps_its_old_uses_for_the_chunks_free() {
    for reuse in [false, true] {
        let (device, _) = device(RaceDetection::Record);
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let chunk = device.malloc_async(4096, &a).unwrap();
        b.wait(&a.record().unwrap()).unwrap();
        device.note_allocation(chunk, 1024, &b);
        b.declare_access(chunk, 1024, MemoryAccess::Write, "a kernel")
            .unwrap();
        device.note_free(chunk, 1024, &b);
        if reuse {
            device.note_allocation(chunk, 1024, &b);
            device.note_free(chunk, 1024, &b);
        }
        // SAFETY: the chunk came from `malloc_async` above and is freed once; the race is
        // the point (the simulated device detects it, and runs nothing that touches memory).
        unsafe { device.free_async(chunk, &a) }.unwrap();
        let races = device.take_races();
        assert!(
            races.iter().any(|r| r.kind == RaceKind::FreedWhileInUse),
            "reuse {reuse}: missed {races:?}"
        );
        a.synchronize_blocking().unwrap();
        b.synchronize_blocking().unwrap();
    }
}

/// A block the driver's pool keeps (freed, to be handed out again) is still caught when a
/// stale pointer uses it, however many frees came since: a review found the detector
/// forgetting it after 4,096 frees (its bound on the freed blocks it remembers), while the
/// pool still held the memory.
#[test]
fn a_stale_use_of_a_pool_block_is_caught_after_many_frees() {
    use streamalloc::resource::cuda_async::{CudaAsyncOptions, CudaAsyncResource};
    use streamalloc::MemoryResource;
    let (device, _) = device(RaceDetection::Record);
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let pool = CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap();
    let stale = pool.allocate(1 << 20, &a).unwrap();
    // SAFETY: allocated above, unused, freed once.
    unsafe { pool.deallocate(stale, 1 << 20, &a) }.unwrap();
    a.synchronize_blocking().unwrap();
    for _ in 0..5000 {
        let p = pool.allocate(4096, &a).unwrap();
        // SAFETY: allocated above, unused, freed once.
        unsafe { pool.deallocate(p, 4096, &a) }.unwrap();
    }
    // SAFETY: a use after free on purpose: the simulated device reports it (and the pool still
    // holds the memory, so nothing else is written).
    unsafe { b.memset_d8(stale, 1, 1 << 20) }.unwrap();
    b.synchronize_blocking().unwrap();
    let races = device.take_races();
    assert!(
        races.iter().any(|r| r.kind == RaceKind::UseAfterFree),
        "{races:?}"
    );
}

/// In the `Panic` mode a racing copy is refused before the panic, as in the `Error` mode: it
/// is not queued. Queued, it ran while the panic unwound its caller and wrote into the host
/// buffer the unwinding freed (a proptest harness, which catches panics to shrink, aborted with
/// a corrupted heap). Here the buffer outlives the panic, so the copy's write can be seen.
#[test]
fn a_racing_copy_that_panics_is_not_queued() {
    let (device, _) = device(RaceDetection::Panic);
    let mr = CudaResource::new(&device);
    let (s1, s2) = streams(&device);
    let ptr = mr.allocate(4096, &s1).unwrap();
    // SAFETY: 4096 live bytes at `ptr`, written on s1.
    unsafe { s1.memset_d8(ptr, 7, 4096) }.unwrap();
    let mut host = vec![0u8; 4096];
    let dst = host.as_mut_ptr();
    // SAFETY: `host` outlives the synchronization below. The read on s2 is not ordered after
    // s1's write: the race the detector must catch.
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe {
        s2.copy_dtoh(dst, ptr, 4096)
    }));
    assert!(caught.is_err(), "the racing copy did not panic");
    s1.synchronize_blocking().unwrap();
    s2.synchronize_blocking().unwrap();
    assert!(
        host.iter().all(|&b| b == 0),
        "the racing copy was queued and wrote the buffer"
    );
    assert_eq!(device.races().len(), 1);
    // SAFETY: from `allocate` with these bytes, freed once, after s1's work (synchronized).
    unsafe { mr.deallocate(ptr, 4096, &s1) }.unwrap();
}

/// The same for a declared access: in the `Panic` mode the racing access is not noted as a use
/// before the panic. Noted, the stream's own later write (ordered after everything that really
/// ran) raced the read that never happened, and a caller that had caught the first panic got a
/// second, false one.
#[test]
fn a_racing_declared_access_that_panics_is_not_noted() {
    let (device, _) = device(RaceDetection::Panic);
    let mr = CudaResource::new(&device);
    let (s1, s2) = streams(&device);
    let ptr = mr.allocate(4096, &s1).unwrap();
    s1.declare_access(ptr, 4096, MemoryAccess::Write, "write on s1")
        .unwrap();
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        s2.declare_access(ptr, 4096, MemoryAccess::Read, "unordered read on s2")
    }));
    assert!(caught.is_err(), "the racing access did not panic");
    s1.declare_access(ptr, 4096, MemoryAccess::Write, "write on s1 again")
        .unwrap();
    assert_eq!(device.races().len(), 1);
    // SAFETY: from `allocate` with these bytes, freed once, on the stream of its only use.
    unsafe { mr.deallocate(ptr, 4096, &s1) }.unwrap();
}

// ===== a racing free that panics has freed =====

/// 2 MiB from `r` on stream x, written by stream y (ordered after the allocation, 200 ms
/// behind), and freed on x, which is not ordered after y's write: the race, in the detector's
/// `Panic` mode. Returns (x, y) once the free panicked and x is done.
fn a_free_racing_a_use(r: &dyn MemoryResource, device: &Device) -> (Stream, Stream) {
    const MIB: usize = 1 << 20;
    let (x, y) = streams(device);
    let a = r.allocate(2 * MIB, &x).unwrap();
    y.wait(&x.record().unwrap()).unwrap();
    y.spin(Duration::from_millis(200)).unwrap();
    // SAFETY: 2 MiB live at `a`; y is ordered after the allocation.
    unsafe { y.memset_d8(a, 1, 2 * MIB) }.unwrap();
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: from `allocate` with these bytes, freed once (the race is the test's).
        unsafe { r.deallocate(a, 2 * MIB, &x) }
    }));
    assert!(caught.is_err(), "the racing free did not panic");
    x.synchronize_blocking().unwrap();
    (x, y)
}

/// `RaceDetection::Panic` promises that a racing free panics once the memory is back, so that
/// a caller that catches the panic has lost nothing. `CudaAsyncResource`'s racing free
/// panicked inside the stream's push, after its table dropped the block and before its count
/// gave the bytes back: `allocated_bytes` kept the block for good, and its maximum was a block
/// short (a review's finding; failed before the fix).
#[test]
fn a_racing_cuda_async_free_that_panics_gives_its_bytes_back() {
    use streamalloc::resource::cuda_async::CudaAsyncOptions;
    use streamalloc::CudaAsyncResource;
    const MIB: usize = 1 << 20;
    let (device, _) = device(RaceDetection::Panic);
    let r = CudaAsyncResource::new(
        &device,
        CudaAsyncOptions {
            maximum_pool_size: Some(2 * MIB),
            ..CudaAsyncOptions::default()
        },
    )
    .unwrap();
    let (x, y) = a_free_racing_a_use(&r, &device);
    y.synchronize_blocking().unwrap();
    assert_eq!(r.allocated_bytes(), 0, "the count kept the freed block");
    let again = r.allocate(2 * MIB, &x);
    assert!(
        again.is_ok(),
        "the maximum is a block short for good: {again:?}"
    );
    common::free(&r, again.unwrap(), 2 * MIB, &x);
    x.synchronize_blocking().unwrap();
}

/// The same for `ManagedResource`: its racing free panicked inside the stream's push, after
/// its ledger dropped the block and before `outstanding` fell (a review's finding; failed
/// before the fix).
#[test]
fn a_racing_managed_free_that_panics_counts_its_bytes_down() {
    use streamalloc::resource::managed::ManagedResource;
    let (device, _) = device(RaceDetection::Panic);
    let r = ManagedResource::new(&device);
    let (_x, y) = a_free_racing_a_use(&r, &device);
    // y's memset ran after the free: its error is the planted race's.
    let _ = y.synchronize_blocking();
    assert_eq!(r.outstanding_bytes(), 0, "the ledger kept the freed block");
}

// ===== a free the resource refuses is no free to the detector =====

/// What makes a resource, for tests that run on several.
type Maker<'a> = &'a dyn Fn() -> Box<dyn MemoryResource>;

/// A block of one resource freed into another of the same device (its own kind, on the same
/// stream) is refused with `UnknownPointer`, and the detector must forget the free it noted
/// first (a resource notes a free before the block is back in its lists): noted for good, it
/// marked the block, still its owner's, freed, so that the owner's next use read as a use after
/// free (a review's finding). The owner's real free is then checked as any free: a use on
/// another stream after it is caught.
#[test]
fn a_refused_free_leaves_the_block_live_to_the_detector() {
    use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
    use streamalloc::resource::fixed_size::FixedSizeResource;
    use streamalloc::{DevicePtr, ExpandableOptions, ExpandablePoolResource};
    const MIB: usize = 1 << 20;
    let (device, _) = device(RaceDetection::Record);
    let expandable = || {
        let options = ExpandableOptions {
            reserve: Some(64 * MIB),
            ..ExpandableOptions::default()
        };
        Box::new(ExpandablePoolResource::new(&device, options).unwrap()) as Box<dyn MemoryResource>
    };
    let arena = || {
        let options = ArenaOptions {
            initial: 0,
            maximum: Some(64 * MIB),
            ..ArenaOptions::default()
        };
        Box::new(ArenaResource::new(CudaResource::new(&device), options).unwrap())
            as Box<dyn MemoryResource>
    };
    let fixed = || {
        Box::new(FixedSizeResource::new(CudaResource::new(&device), 64 << 10, 4).unwrap())
            as Box<dyn MemoryResource>
    };
    let pooled = || Box::new(pool(&device, 64 * MIB)) as Box<dyn MemoryResource>;
    let makers: [(&str, Maker<'_>); 4] = [
        ("pool", &pooled),
        ("arena", &arena),
        ("fixed-size", &fixed),
        ("expandable", &expandable),
    ];
    let (s, other) = streams(&device);
    for (name, make) in makers {
        let (owner, stranger) = (make(), make());
        let bytes = 64 << 10;
        let p: DevicePtr = owner.allocate(bytes, &s).unwrap();
        // SAFETY: `p` is live and `stranger`'s to refuse: it never handed it out.
        let refused = unsafe { stranger.deallocate(p, bytes, &s) };
        assert!(
            matches!(refused, Err(Error::UnknownPointer { .. })),
            "{name}: {refused:?}"
        );
        // The owner goes on using its block: no race.
        // SAFETY: `p` is live (the free above was refused), `bytes` long, used on `s` only.
        unsafe { s.memset_d8(p, 7, bytes) }.unwrap();
        s.synchronize_blocking().unwrap();
        let races = device.take_races();
        assert!(races.is_empty(), "{name}: after a refused free: {races:#?}");
        // The real free, then a use on another stream that nothing orders after it.
        // SAFETY: allocated above from `owner`, its use synchronized, freed once.
        unsafe { owner.deallocate(p, bytes, &s) }.unwrap();
        // SAFETY: a use after free on purpose, for the detector (the memory stays the
        // resource's, so nothing else is written).
        unsafe { other.memset_d8(p, 1, bytes) }.unwrap();
        other.synchronize_blocking().unwrap();
        let races = device.take_races();
        assert!(
            races.iter().any(|r| r.kind == RaceKind::UseAfterFree),
            "{name}: the real free was not checked: {races:#?}"
        );
        drop((owner, stranger));
    }
}
