//! A user's loom model of their own code (README, "loom models of your code"), written as a
//! user would from the README alone: two threads of the user's share a buffer through an
//! event slot. Run with
//! `RUSTFLAGS="--cfg streamalloc_loom -C debug-assertions" CARGO_TARGET_DIR=target/loom cargo test --release --test user_loom`.
#![cfg(streamalloc_loom)]

use loom::sync::{Arc, Mutex};
use loom::thread;

use streamalloc::{
    CudaResource, Device, DeviceBuffer, Event, MemoryAccess, PoolOptions, PoolResource,
    RaceDetection, SimConfig,
};

/// The user's code: a writer thread writes the buffer on stream `a` and publishes an event;
/// the reader waits for it on `b`, then reads. With `bug`, a reader that finds no event yet
/// assumes the writer is done and reads at once.
fn run(bug: bool) {
    let device = Device::simulated(SimConfig {
        race_detection: RaceDetection::Panic,
        ..SimConfig::default()
    });
    let pool = std::sync::Arc::new(
        PoolResource::new(
            CudaResource::new(&device),
            PoolOptions {
                initial: 0,
                maximum: Some(1 << 16),
                ..PoolOptions::default()
            },
        )
        .unwrap(),
    );
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let mut buf = DeviceBuffer::new(&pool, 256, &a).unwrap();
    let ptr = buf.as_ptr();
    // `b` is ordered after the allocation, not after the write.
    b.wait(&a.record().unwrap()).unwrap();
    let slot: Arc<Mutex<Option<Event>>> = Arc::new(Mutex::new(None));
    let writer = {
        let (slot, a) = (slot.clone(), a.clone());
        thread::spawn(move || {
            a.declare_access(ptr, 256, MemoryAccess::Write, "writer_kernel")
                .unwrap();
            *slot.lock().unwrap() = Some(a.record().unwrap());
        })
    };
    loop {
        let event = slot.lock().unwrap().take();
        match event {
            Some(event) => {
                b.wait(&event).unwrap();
                break;
            }
            None if bug => break, // BUG: "no event yet, so nothing to wait for"
            None => thread::yield_now(),
        }
    }
    b.declare_access(ptr, 256, MemoryAccess::Read, "reader_kernel")
        .unwrap();
    buf.record_stream(&b).unwrap();
    writer.join().unwrap();
    drop(buf);
    assert_eq!(device.races(), Vec::new());
    drop((a, b, pool));
}

fn check(bug: bool) -> usize {
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = runs.clone();
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    builder.check(move || {
        counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        run(bug)
    });
    runs.load(std::sync::atomic::Ordering::Relaxed)
}

#[test]
fn correct_handoff_passes() {
    let runs = check(false);
    println!("{runs} executions");
}

#[test]
fn planted_skip_of_the_wait_is_caught() {
    let caught = std::panic::catch_unwind(|| check(true)).unwrap_err();
    let msg = caught
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| caught.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    println!("caught: {msg}");
    assert!(
        msg.contains("stream-order race")
            && msg.contains("writer_kernel")
            && msg.contains("reader_kernel"),
        "{msg}"
    );
}

/// Two of the user's tasks on two streams take turns at a pool of one block, each by an
/// `.await`ed allocation: whoever comes second waits for the other's free and then reuses
/// its block across streams (the pool orders it). No deadlock, no race, nothing left over.
#[test]
fn two_tasks_share_a_pool_of_one_block() {
    const BYTES: usize = 256;
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    builder.check(|| {
        let device = Device::simulated(SimConfig {
            race_detection: RaceDetection::Panic,
            ..SimConfig::default()
        });
        let pool = std::sync::Arc::new(
            PoolResource::new(
                CudaResource::new(&device),
                PoolOptions {
                    initial: 0,
                    maximum: Some(BYTES),
                    ..PoolOptions::default()
                },
            )
            .unwrap(),
        );
        let task = |pool: std::sync::Arc<PoolResource<CudaResource>>, device: Device| {
            move || {
                let stream = device.create_stream().unwrap();
                let mut buf =
                    loom::future::block_on(DeviceBuffer::alloc(&pool, BYTES, &stream)).unwrap();
                buf.memset(1).unwrap();
                drop(buf);
            }
        };
        let other = thread::spawn(task(pool.clone(), device.clone()));
        task(pool.clone(), device.clone())();
        other.join().unwrap();
        assert_eq!(device.races(), Vec::new());
        let stats = pool.stats();
        assert_eq!(stats.free, stats.reserved, "{stats:?}");
        drop(pool);
    });
}
