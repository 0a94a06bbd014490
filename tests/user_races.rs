//! The race detector as a user meets it (README, "Testing your own code"): the user's own
//! kernels declared with `declare_access`, the user's own suballocator told to the device with
//! `note_allocation`/`note_free`, and the four modes. Simulated device only.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{
    CudaResource, Device, DeviceBuffer, DevicePtr, Error, MemoryAccess, Race, RaceDetection,
    RaceKind, SimConfig, Stream,
};

fn device(mode: RaceDetection) -> Device {
    Device::simulated(SimConfig {
        race_detection: mode,
        ..SimConfig::default()
    })
}

fn two(device: &Device) -> (Stream, Stream) {
    (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    )
}

fn pool(device: &Device) -> Arc<PoolResource<CudaResource>> {
    Arc::new(
        PoolResource::new(
            CudaResource::new(device),
            PoolOptions {
                initial: 0,
                maximum: Some(1 << 20),
                ..PoolOptions::default()
            },
        )
        .unwrap(),
    )
}

fn one(device: &Device) -> Race {
    let mut races = device.take_races();
    assert_eq!(races.len(), 1, "{races:#?}");
    races.remove(0)
}

/// A user's kernel writes on `a`; another reads on `b` without a wait: ReadAfterWrite, with
/// both of the user's op names and streams.
#[test]
fn users_unordered_read_is_reported_with_both_sites() {
    let device = device(RaceDetection::Record);
    let (a, b) = two(&device);
    let p = pool(&device);
    let buf = DeviceBuffer::new(&p, 4096, &a).unwrap();
    // `b` is ordered after the allocation, not after the write.
    b.wait(&a.record().unwrap()).unwrap();
    a.declare_access(buf.as_ptr(), 4096, MemoryAccess::Write, "producer")
        .unwrap();
    b.declare_access(buf.as_ptr(), 4096, MemoryAccess::Read, "consumer")
        .unwrap();
    let race = one(&device);
    assert_eq!(race.kind, RaceKind::ReadAfterWrite, "{race}");
    assert_eq!((race.at.op, race.at.stream), ("consumer", Some(b.id())));
    assert_eq!(
        (race.earlier.op, race.earlier.stream),
        ("producer", Some(a.id()))
    );
    assert_eq!(race.block.unwrap().allocated.stream, Some(a.id()));
    b.synchronize_blocking().unwrap();
    let mut buf = buf;
    buf.record_stream(&b).unwrap();
    drop(buf);
    a.synchronize_blocking().unwrap();
    assert_eq!(device.races(), Vec::new());
}

#[test]
fn users_unordered_writes_and_write_after_read() {
    let device = device(RaceDetection::Record);
    let (a, b) = two(&device);
    let ptr = device.malloc(1024).unwrap();
    a.declare_access(ptr, 1024, MemoryAccess::Write, "w1")
        .unwrap();
    b.declare_access(ptr, 1024, MemoryAccess::Write, "w2")
        .unwrap();
    let race = one(&device);
    assert_eq!(race.kind, RaceKind::WriteAfterWrite, "{race}");
    assert_eq!((race.at.op, race.earlier.op), ("w2", "w1"));

    let ptr2 = device.malloc(1024).unwrap();
    a.declare_access(ptr2, 1024, MemoryAccess::Read, "r")
        .unwrap();
    b.declare_access(ptr2, 1024, MemoryAccess::Write, "w")
        .unwrap();
    let race = one(&device);
    assert_eq!(race.kind, RaceKind::WriteAfterRead, "{race}");
    assert_eq!((race.at.op, race.earlier.op), ("w", "r"));
    a.synchronize_blocking().unwrap();
    b.synchronize_blocking().unwrap();
    unsafe {
        device.free(ptr).unwrap();
        device.free(ptr2).unwrap();
    }
    assert_eq!(device.races(), Vec::new());
}

/// A pool block allocated on `a`, used on `b` with no ordering at all.
#[test]
fn use_before_allocation_in_a_pool() {
    let device = device(RaceDetection::Record);
    let (a, b) = two(&device);
    let p = pool(&device);
    let mut buf = DeviceBuffer::new(&p, 4096, &a).unwrap();
    b.declare_access(buf.as_ptr(), 4096, MemoryAccess::Read, "early")
        .unwrap();
    let race = one(&device);
    assert_eq!(race.kind, RaceKind::UseBeforeAllocation, "{race}");
    assert_eq!((race.at.op, race.at.stream), ("early", Some(b.id())));
    assert_eq!(race.earlier.stream, Some(a.id()));
    buf.record_stream(&b).unwrap();
    drop(buf);
    b.synchronize_blocking().unwrap();
    a.synchronize_blocking().unwrap();
    assert_eq!(device.races(), Vec::new());
}

/// Every way the README names of ordering a user's work reports nothing.
#[test]
fn ordered_code_reports_nothing() {
    let device = device(RaceDetection::Panic);
    let (a, b) = two(&device);
    let p = pool(&device);
    // event wait
    let mut buf = DeviceBuffer::new(&p, 4096, &a).unwrap();
    buf.memset(1).unwrap();
    b.wait(&a.record().unwrap()).unwrap();
    b.declare_access(buf.as_ptr(), 4096, MemoryAccess::Write, "k1")
        .unwrap();
    // awaiting an event of `b` orders `a`'s next work after k1
    futures::executor::block_on(b.record().unwrap()).unwrap();
    a.declare_access(buf.as_ptr(), 4096, MemoryAccess::Read, "k2")
        .unwrap();
    // synchronize (async) orders `b`'s next work after k2
    futures::executor::block_on(a.synchronize()).unwrap();
    b.declare_access(buf.as_ptr(), 4096, MemoryAccess::Write, "k3")
        .unwrap();
    // blocking synchronize
    b.synchronize_blocking().unwrap();
    a.declare_access(buf.as_ptr(), 4096, MemoryAccess::Read, "k4")
        .unwrap();
    // a use on `b`, then record_stream: the drop's free waits for it
    b.wait(&a.record().unwrap()).unwrap();
    b.declare_access(buf.as_ptr(), 4096, MemoryAccess::Write, "k5")
        .unwrap();
    buf.record_stream(&b).unwrap();
    drop(buf);
    // to_host awaited, then reuse on the other stream
    let mut buf = DeviceBuffer::new(&p, 4096, &b).unwrap();
    buf.memset(3).unwrap();
    let host = futures::executor::block_on(buf.to_host()).unwrap();
    assert!(host.iter().all(|&x| x == 3));
    a.declare_access(buf.as_ptr(), 4096, MemoryAccess::Read, "k6")
        .unwrap();
    buf.record_stream(&a).unwrap();
    drop(buf);
    a.synchronize_blocking().unwrap();
    b.synchronize_blocking().unwrap();
    assert_eq!(device.races(), Vec::new());
}

/// A user's own suballocator: two halves of one raw allocation, noted. The second half is
/// reused on `b` right after its free on `a`, with no wait: ReuseBeforeFree. Its use on `b`
/// after that is not also a use before allocation.
#[test]
fn own_suballocator_reuse_before_free() {
    let device = device(RaceDetection::Record);
    let (a, b) = two(&device);
    let chunk = device.malloc(8192).unwrap();
    let half = DevicePtr(chunk.0 + 4096);
    device.note_allocation(half, 4096, &a);
    a.declare_access(half, 4096, MemoryAccess::Write, "k_a")
        .unwrap();
    device.note_free(half, 4096, &a);
    assert_eq!(device.races(), Vec::new());
    device.note_allocation(half, 4096, &b);
    let race = one(&device);
    assert_eq!(race.kind, RaceKind::ReuseBeforeFree, "{race}");
    assert_eq!(race.at.stream, Some(b.id()));
    assert_eq!(race.earlier.stream, Some(a.id()));
    // Use after the (racing) reuse: only its own ordering is checked.
    b.declare_access(half, 4096, MemoryAccess::Write, "k_b")
        .unwrap();
    device.note_free(half, 4096, &b);
    // use after free on the host-ordered side
    b.declare_access(half, 4096, MemoryAccess::Read, "late")
        .unwrap();
    let race = one(&device);
    assert_eq!(race.kind, RaceKind::UseAfterFree, "{race}");
    assert_eq!(race.at.op, "late");
    a.synchronize_blocking().unwrap();
    b.synchronize_blocking().unwrap();
    unsafe { device.free(chunk).unwrap() };
    assert_eq!(device.races(), Vec::new());

    // The same with the wait: clean.
    let chunk = device.malloc(8192).unwrap();
    device.note_allocation(chunk, 4096, &a);
    a.declare_access(chunk, 4096, MemoryAccess::Write, "k_a")
        .unwrap();
    device.note_free(chunk, 4096, &a);
    b.wait(&a.record().unwrap()).unwrap();
    device.note_allocation(chunk, 4096, &b);
    b.declare_access(chunk, 4096, MemoryAccess::Write, "k_b")
        .unwrap();
    device.note_free(chunk, 4096, &b);
    b.synchronize_blocking().unwrap();
    unsafe { device.free(chunk).unwrap() };
    assert_eq!(device.races(), Vec::new());
}

fn plant(device: &Device) -> (Stream, Stream, DevicePtr) {
    let (a, b) = two(device);
    let ptr = device.malloc(1024).unwrap();
    a.declare_access(ptr, 1024, MemoryAccess::Write, "w")
        .unwrap();
    (a, b, ptr)
}

#[test]
fn mode_off_sees_nothing() {
    let device = device(RaceDetection::Off);
    assert_eq!(device.race_detection(), RaceDetection::Off);
    let (_a, b, ptr) = plant(&device);
    b.declare_access(ptr, 1024, MemoryAccess::Read, "r")
        .unwrap();
    assert_eq!(device.races(), Vec::new());
    unsafe { device.free(ptr).unwrap() };
}

#[test]
fn mode_error_refuses_and_keeps_the_race() {
    let device = device(RaceDetection::Error);
    let (a, b, ptr) = plant(&device);
    match b.declare_access(ptr, 1024, MemoryAccess::Read, "r") {
        Err(Error::StreamRace(race)) => assert_eq!(race.kind, RaceKind::ReadAfterWrite),
        other => panic!("{other:?}"),
    }
    // A built-in operation is refused too, and not queued.
    let err = unsafe { b.memset_d8(ptr, 0, 1024) }.unwrap_err();
    assert!(matches!(err, Error::StreamRace(_)), "{err}");
    assert_eq!(device.races().len(), 2);
    // The refused read was not remembered: a write on `a` after it is no WriteAfterRead.
    device.take_races();
    a.declare_access(ptr, 1024, MemoryAccess::Write, "w2")
        .unwrap();
    assert_eq!(device.races(), Vec::new());
    a.synchronize_blocking().unwrap();
    unsafe { device.free(ptr).unwrap() };
}

#[test]
fn mode_panic_panics_with_both_sites_and_keeps_the_race() {
    let device = device(RaceDetection::Panic);
    let (a, b, ptr) = plant(&device);
    let err = catch_unwind(AssertUnwindSafe(|| {
        let _ = b.declare_access(ptr, 1024, MemoryAccess::Read, "r");
    }))
    .unwrap_err();
    let msg = err
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap();
    assert!(msg.contains("r on ") && msg.contains("w on "), "{msg}");
    assert!(msg.contains(&a.id().to_string()), "{msg}");
    assert!(msg.contains(&b.id().to_string()), "{msg}");
    assert_eq!(device.races().len(), 1);
    a.synchronize_blocking().unwrap();
    unsafe { device.free(ptr).unwrap() };
}

#[test]
fn mode_record_goes_ahead() {
    let device = device(RaceDetection::Record);
    let (a, b, ptr) = plant(&device);
    b.declare_access(ptr, 1024, MemoryAccess::Read, "r")
        .unwrap();
    unsafe { b.memset_d8(ptr, 0, 1024) }.unwrap();
    assert_eq!(device.races().len(), 2, "{:#?}", device.races());
    a.synchronize_blocking().unwrap();
    b.synchronize_blocking().unwrap();
    unsafe { device.free(ptr).unwrap() };
}

/// The README's one-line snippet, as written.
#[test]
fn readme_declare_access_snippet() -> streamalloc::Result<()> {
    let device = device(RaceDetection::Panic);
    let stream = device.create_stream()?;
    let p = pool(&device);
    let buf = DeviceBuffer::new(&p, 256, &stream)?;
    stream.declare_access(buf.as_ptr(), buf.len(), MemoryAccess::Read, "my_kernel")?;
    Ok(())
}

/// Panic mode: a buffer used on `b` and dropped without `record_stream` panics at its free
/// (the user's bug). A test that catches the panic (a task runtime does) must still find the
/// memory back in the pool: the panic reports the race, it must not also leak the block.
#[test]
fn panic_at_a_racing_free_loses_no_memory() {
    let device = device(RaceDetection::Panic);
    let (a, b) = two(&device);
    let p = Arc::new(
        PoolResource::new(
            CudaResource::new(&device),
            PoolOptions {
                initial: 0,
                maximum: Some(4096),
                ..PoolOptions::default()
            },
        )
        .unwrap(),
    );
    let buf = DeviceBuffer::new(&p, 4096, &a).unwrap();
    b.wait(&a.record().unwrap()).unwrap();
    b.declare_access(buf.as_ptr(), 4096, MemoryAccess::Write, "k")
        .unwrap();
    let caught = catch_unwind(AssertUnwindSafe(|| drop(buf)));
    assert!(caught.is_err(), "the racing free did not panic");
    assert_eq!(device.take_races().len(), 1);
    b.synchronize_blocking().unwrap();
    a.synchronize_blocking().unwrap();
    assert_eq!(p.stats().free, p.stats().reserved, "{:?}", p.stats());
    // The pool holds one block at most: it is there again.
    let again = DeviceBuffer::new(&p, 4096, &a).unwrap();
    drop(again);
    a.synchronize_blocking().unwrap();
    assert_eq!(device.races(), Vec::new());
}

/// Panic mode: a synchronous `free` of memory another stream uses unordered panics, and the
/// memory is freed all the same.
#[test]
fn panic_at_a_racing_raw_free_frees_the_memory() {
    let device = device(RaceDetection::Panic);
    let (_a, b) = two(&device);
    let before = device.free_memory().unwrap();
    let ptr = device.malloc(1 << 20).unwrap();
    b.declare_access(ptr, 1 << 20, MemoryAccess::Write, "k")
        .unwrap();
    b.synchronize_blocking().unwrap();
    // Ordered after `b` by the synchronize: clean. Another use, not seen complete, then a free.
    b.declare_access(ptr, 1 << 20, MemoryAccess::Write, "k2")
        .unwrap();
    let caught = catch_unwind(AssertUnwindSafe(|| unsafe { device.free(ptr) }));
    assert!(caught.is_err(), "the racing free did not panic");
    assert_eq!(device.take_races()[0].kind, RaceKind::FreedWhileInUse);
    b.synchronize_blocking().unwrap();
    assert_eq!(device.free_memory().unwrap(), before);
}

/// [`panic_at_a_racing_free_loses_no_memory`] for each suballocating resource: after the
/// caught panic, the block is free again (the same block comes back on the freeing stream).
fn racing_free_loses_nothing<R: streamalloc::AsResourceRef>(device: &Device, r: &R) {
    let (a, b) = two(device);
    let buf = DeviceBuffer::new(r, 4096, &a).unwrap();
    let ptr = buf.as_ptr();
    b.wait(&a.record().unwrap()).unwrap();
    b.declare_access(ptr, 4096, MemoryAccess::Write, "k")
        .unwrap();
    assert!(catch_unwind(AssertUnwindSafe(|| drop(buf))).is_err());
    assert_eq!(device.take_races().len(), 1);
    b.synchronize_blocking().unwrap();
    let again = DeviceBuffer::new(r, 4096, &a).unwrap();
    assert_eq!(again.as_ptr(), ptr, "the racing free's block was lost");
    drop(again);
    a.synchronize_blocking().unwrap();
    assert_eq!(device.races(), Vec::new());
}

#[test]
fn panic_at_a_racing_free_loses_nothing_in_any_resource() {
    use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
    use streamalloc::resource::fixed_size::FixedSizeResource;
    use streamalloc::{ExpandableOptions, ExpandablePoolResource};
    let device = device(RaceDetection::Panic);
    let arena = Arc::new(
        ArenaResource::new(
            CudaResource::new(&device),
            ArenaOptions {
                maximum: Some(1 << 20),
                ..ArenaOptions::default()
            },
        )
        .unwrap(),
    );
    racing_free_loses_nothing(&device, &arena);
    let fixed = Arc::new(FixedSizeResource::new(CudaResource::new(&device), 4096, 1).unwrap());
    racing_free_loses_nothing(&device, &fixed);
    let expandable =
        Arc::new(ExpandablePoolResource::new(&device, ExpandableOptions::default()).unwrap());
    racing_free_loses_nothing(&device, &expandable);
}

/// `SimConfig::default()`'s mode: `STREAMALLOC_RACE_DETECTION` if set, else `Panic` in a
/// build with debug assertions and `Record` in one without.
#[test]
fn default_mode() {
    let expected = match std::env::var("STREAMALLOC_RACE_DETECTION").ok().as_deref() {
        Some("off") => RaceDetection::Off,
        Some("record") => RaceDetection::Record,
        Some("error") => RaceDetection::Error,
        Some("panic") => RaceDetection::Panic,
        _ if cfg!(debug_assertions) => RaceDetection::Panic,
        _ => RaceDetection::Record,
    };
    let device = Device::simulated(SimConfig::default());
    assert_eq!(device.race_detection(), expected);
}

/// Panic mode, a racing free deferred to the completion reactor (a use recorded on `b`, one
/// on `c` forgotten): the race is in `Device::races()` (the panic is caught on the reactor's
/// thread) and the block is back in the pool.
#[test]
fn deferred_racing_free_is_recorded_and_loses_nothing() {
    let device = device(RaceDetection::Panic);
    let (a, b) = two(&device);
    let c = device.create_stream().unwrap();
    let p = pool(&device);
    let mut buf = DeviceBuffer::new(&p, 4096, &a).unwrap();
    let ready = a.record().unwrap();
    b.wait(&ready).unwrap();
    c.wait(&ready).unwrap();
    b.spin(std::time::Duration::from_millis(20)).unwrap();
    b.declare_access(buf.as_ptr(), 4096, MemoryAccess::Read, "kb")
        .unwrap();
    c.declare_access(buf.as_ptr(), 4096, MemoryAccess::Read, "kc")
        .unwrap();
    buf.record_stream(&b).unwrap();
    drop(buf); // freed on `a` after `b`'s event: not ordered after `kc`
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while device.races().is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let race = one(&device);
    assert_eq!(race.kind, RaceKind::FreedWhileInUse, "{race}");
    assert_eq!((race.earlier.op, race.earlier.stream), ("kc", Some(c.id())));
    for s in [&a, &b, &c] {
        s.synchronize_blocking().unwrap();
    }
    // The reactor puts the block back just after it notes the race: wait for it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while p.stats().free != p.stats().reserved && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let stats = p.stats();
    assert_eq!(stats.free, stats.reserved, "{stats:?}");
}

/// Panic mode through a `LimitingAdaptor`: the racing free's panic comes out of the upstream's
/// `deallocate` with the block back there; the adaptor's budget must come back with it.
#[test]
fn panic_at_a_racing_free_under_a_limit_returns_the_budget() {
    use streamalloc::resource::adaptor::LimitingAdaptor;
    let device = device(RaceDetection::Panic);
    let limited = Arc::new(LimitingAdaptor::new(pool(&device), 4096));
    racing_free_loses_nothing(&device, &limited);
}

/// A declared access after a raw `free`: a use after free, refused in the `Error` mode; a
/// zero-byte declaration touches nothing.
#[test]
fn declared_use_after_a_raw_free() {
    let device = device(RaceDetection::Error);
    let a = device.create_stream().unwrap();
    let ptr = device.malloc(1024).unwrap();
    a.declare_access(ptr, 0, MemoryAccess::Write, "nothing")
        .unwrap();
    a.declare_access(ptr, 1024, MemoryAccess::Write, "k")
        .unwrap();
    a.synchronize_blocking().unwrap();
    unsafe { device.free(ptr).unwrap() };
    match a.declare_access(ptr, 1024, MemoryAccess::Read, "late") {
        Err(Error::StreamRace(race)) => {
            assert_eq!(race.kind, RaceKind::UseAfterFree, "{race}");
            assert_eq!(race.at.op, "late");
            assert_eq!(race.block.and_then(|b| b.freed), Some(race.earlier));
        }
        other => panic!("{other:?}"),
    }
}
