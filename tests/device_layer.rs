//! The device layer, streams and events, on every available device (see `common`).

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use common::{devices, eventually, label, runtime};
use futures::FutureExt;
use streamalloc::{Device, DevicePtr, Error, SimConfig, Stream, StreamPool};

/// Device memory freed when dropped (after synchronizing the device's stream `s`): enough for
/// these tests, which predate the buffers.
struct Mem<'a> {
    device: &'a Device,
    ptr: DevicePtr,
    bytes: usize,
}

impl<'a> Mem<'a> {
    fn new(device: &'a Device, bytes: usize) -> Self {
        let ptr = device.malloc(bytes).expect("malloc");
        Mem { device, ptr, bytes }
    }
}

impl Drop for Mem<'_> {
    fn drop(&mut self) {
        // SAFETY: every test synchronizes the streams that used the memory before dropping it.
        unsafe { self.device.free(self.ptr) }.expect("free");
    }
}

fn read_u32(stream: &Stream, src: DevicePtr, count: usize) -> Vec<u32> {
    let mut host = vec![0u32; count];
    // SAFETY: `host` has `count` words and is not touched until synchronize_blocking returns.
    unsafe { stream.copy_dtoh(host.as_mut_ptr() as *mut u8, src, count * 4) }.unwrap();
    stream.synchronize_blocking().unwrap();
    host
}

#[test]
fn order_within_a_stream() {
    for device in devices() {
        let stream = device.create_stream().unwrap();
        let n = 1 << 16;
        let mem = Mem::new(&device, n * 4);
        // SAFETY: `mem` holds n f32s and outlives the synchronize below.
        unsafe {
            stream.fill_u32(mem.ptr, 1.5f32.to_bits(), n).unwrap();
            stream.scale_f32(mem.ptr, 2.0, n).unwrap();
            stream.scale_f32(mem.ptr, -0.5, n).unwrap();
        }
        let back = read_u32(&stream, mem.ptr, n);
        assert!(
            back.iter().all(|&b| f32::from_bits(b) == -1.5),
            "{}: fill, scale, scale must run in order",
            label(&device)
        );
    }
}

#[test]
fn memset_and_device_to_device_copy() {
    for device in devices() {
        let stream = device.create_stream().unwrap();
        let (a, b) = (Mem::new(&device, 4096), Mem::new(&device, 4096));
        // SAFETY: both ranges are 4096 live bytes until the synchronize in read_u32.
        unsafe {
            stream.memset_d8(a.ptr, 0xAB, 4096).unwrap();
            stream
                .memset_d32(a.ptr.offset(1024), 0x0102_0304, 256)
                .unwrap();
            stream.copy_dtod(b.ptr, a.ptr, 4096).unwrap();
        }
        let back = read_u32(&stream, b.ptr, 1024);
        assert!(
            back[..256].iter().all(|&w| w == 0xABAB_ABAB),
            "{}",
            label(&device)
        );
        assert!(
            back[256..512].iter().all(|&w| w == 0x0102_0304),
            "{}",
            label(&device)
        );
        assert!(
            back[512..].iter().all(|&w| w == 0xABAB_ABAB),
            "{}",
            label(&device)
        );

        let data: Vec<u32> = (0..1024).collect();
        // SAFETY: `data` lives, unchanged, until the synchronize in read_u32.
        unsafe { stream.copy_htod(a.ptr, data.as_ptr() as *const u8, 4096) }.unwrap();
        assert_eq!(read_u32(&stream, a.ptr, 1024), data, "{}", label(&device));
    }
}

#[test]
fn order_across_streams_through_an_event() {
    for device in devices() {
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let n = 1 << 20;
        let x = Mem::new(&device, n * 4);
        // SAFETY: `x` outlives every synchronize below.
        unsafe { a.memset_d8(x.ptr, 0, n * 4) }.unwrap();
        a.synchronize_blocking().unwrap();
        a.spin(Duration::from_millis(30)).unwrap();
        // SAFETY: as above.
        unsafe { a.fill_u32(x.ptr, 0xC0FFEE, n) }.unwrap();
        let written = a.record().unwrap();
        b.wait(&written).unwrap();
        let back = read_u32(&b, x.ptr, n);
        assert!(
            back.iter().all(|&w| w == 0xC0FFEE),
            "{}: B read before A's fill although it waited on A's event",
            label(&device)
        );
        assert!(written.is_complete());
    }
}

#[test]
fn event_is_pending_while_a_spin_kernel_runs() {
    let rt = runtime();
    for device in devices() {
        let stream = device.create_stream().unwrap();
        // Queueing can itself block for as long as the kernel when another thread makes a
        // device-synchronizing driver call (cuMemFree, a copy to pageable memory) at the same
        // time, as the other tests of this file do. Only an attempt whose queueing was quick says
        // anything about the event; take the first of up to ten.
        let mut checked = false;
        for _ in 0..10 {
            let start = Instant::now();
            stream.spin(Duration::from_millis(50)).unwrap();
            let mut event = stream.record().unwrap();
            let pending = event.query().is_none();
            let queued = start.elapsed();
            if queued >= Duration::from_millis(40) {
                stream.synchronize_blocking().unwrap();
                continue;
            }
            assert!(
                pending,
                "{}: complete {queued:?} after queueing a 50 ms spin",
                label(&device)
            );
            assert!(!event.is_complete());
            assert!((&mut event).now_or_never().is_none(), "{}", label(&device));
            rt.block_on(async { event.clone().await }).unwrap();
            // The spin kernel ran for 50 ms of GPU time, all of it after `start`.
            assert!(
                start.elapsed() >= Duration::from_millis(50),
                "{}: resolved after {:?}, before the 50 ms kernel could end",
                label(&device),
                start.elapsed()
            );
            assert!(event.is_complete());
            // A resolved event stays resolved, however often it is polled or cloned.
            assert!(matches!((&mut event).now_or_never(), Some(Ok(()))));
            assert!(matches!(event.clone().now_or_never(), Some(Ok(()))));
            checked = true;
            break;
        }
        assert!(
            checked,
            "{}: queueing a kernel never took under 40 ms",
            label(&device)
        );
    }
}

#[test]
fn ten_thousand_events_from_many_tasks() {
    let rt = runtime();
    for device in devices() {
        let streams = Arc::new(StreamPool::new(&device, 8).unwrap());
        let resolved = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(HashSet::new()));
        rt.block_on(async {
            let mut tasks = Vec::new();
            for i in 0..10_000usize {
                let (streams, resolved, seen) = (streams.clone(), resolved.clone(), seen.clone());
                tasks.push(tokio::spawn(async move {
                    let stream = streams.get();
                    if i % 100 == 0 {
                        stream.spin(Duration::from_micros(200)).unwrap();
                    }
                    let event = stream.record().unwrap();
                    // Every tenth event is awaited twice, by clones in two tasks.
                    let twin = (i % 10 == 0).then(|| tokio::spawn(event.clone()));
                    tokio::task::yield_now().await;
                    event.await.unwrap();
                    if let Some(twin) = twin {
                        twin.await.unwrap().unwrap();
                    }
                    assert!(seen.lock().unwrap().insert(i), "task {i} resolved twice");
                    resolved.fetch_add(1, Ordering::Relaxed);
                }));
            }
            for task in tasks {
                task.await.unwrap();
            }
        });
        assert_eq!(
            resolved.load(Ordering::Relaxed),
            10_000,
            "{}",
            label(&device)
        );
        drop(streams);
        assert!(
            eventually(Duration::from_secs(5), || device.handle_count() == 1),
            "{}: {} handles still alive: streams or events leaked",
            label(&device),
            device.handle_count()
        );
    }
}

/// Counts wakes, to see which waker an event wakes.
struct CountingWaker(AtomicUsize);

impl Wake for CountingWaker {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn the_latest_waker_is_woken_when_a_task_moves() {
    for device in devices() {
        let stream = device.create_stream().unwrap();
        // Both polls must come while the spin runs. A host that stalls past it (seen once in
        // four runs of the suite on an H100 VM, run34, with a 20 ms spin) finds the event
        // complete: then the test starts again, with a longer spin.
        let (mut event, first, second) = 'polled: {
            for attempt in 0..5u32 {
                stream.spin(Duration::from_millis(50 << attempt)).unwrap();
                let mut event = stream.record().unwrap();
                let (first, second) = (
                    Arc::new(CountingWaker(AtomicUsize::new(0))),
                    Arc::new(CountingWaker(AtomicUsize::new(0))),
                );
                let pending = [&first, &second].into_iter().all(|waker| {
                    let waker = Waker::from(waker.clone());
                    event
                        .poll_unpin(&mut Context::from_waker(&waker))
                        .is_pending()
                });
                if pending {
                    break 'polled (event, first, second);
                }
                println!("attempt {attempt}: the spin ended before the second poll; again");
                stream.synchronize_blocking().unwrap();
            }
            panic!("{}: five spins ended before two polls", label(&device));
        };
        assert!(
            eventually(Duration::from_secs(5), || second.0.load(Ordering::SeqCst)
                == 1),
            "{}: the waker of the last poll was not woken",
            label(&device)
        );
        assert_eq!(
            first.0.load(Ordering::SeqCst),
            0,
            "{}: stale waker woken",
            label(&device)
        );
        let waker = Waker::from(second.clone());
        assert!(matches!(
            event.poll_unpin(&mut Context::from_waker(&waker)),
            Poll::Ready(Ok(()))
        ));
    }
}

/// A spin keeps its stream busy at least as long as asked: the tests that need a stream still
/// busy (a drop that must wait for it, a future still pending) rely on it. The host's time
/// from the launch to the stream seen idle bounds the spin from above, so a spin that ended
/// early is seen (only a lower bound is checked: a slow machine cannot fail it).
#[test]
fn a_spin_lasts_at_least_as_long_as_asked() {
    for device in devices() {
        let s = device.create_stream().unwrap();
        for ms in [1u64, 30, 100] {
            let start = Instant::now();
            s.spin(Duration::from_millis(ms)).unwrap();
            s.synchronize_blocking().unwrap();
            let took = start.elapsed();
            assert!(
                took >= Duration::from_millis(ms),
                "{}: a spin of {ms} ms ended after {took:?}",
                label(&device)
            );
        }
    }
}

#[test]
fn dropping_streams_and_futures_early_leaks_nothing_and_hangs_nothing() {
    for device in devices() {
        let free_before = device.free_memory().unwrap();
        // The future below must be polled while the event is still pending. On a fresh H200,
        // with the other tests of this binary starting at once, the host took 30.6 to 32.9 ms
        // from the spin's launch to the first poll (4 of 10 runs in run31), so the spin
        // lengthens until a poll finds the event pending; a spin that never outlasts the host
        // is a failure.
        let mut pending = None;
        for spin in [30u64, 300, 3000] {
            let stream = device.create_stream().unwrap();
            let other = device.create_stream().unwrap();
            let mem = device.malloc_async(1 << 20, &stream).unwrap();
            let launched = Instant::now();
            stream.spin(Duration::from_millis(spin)).unwrap();
            // SAFETY: 1 MiB from malloc_async on `stream`, freed in stream order after the fill.
            unsafe {
                stream.fill_u32(mem, 7, 1 << 18).unwrap();
                device.free_async(mem, &stream).unwrap();
            }
            let event = stream.record().unwrap();
            other.wait(&event).unwrap();
            // A future that registered with the reactor, then is dropped before it resolves.
            let mut waiting = event.clone();
            let waker = Waker::from(Arc::new(CountingWaker(AtomicUsize::new(0))));
            let polled = waiting.poll_unpin(&mut Context::from_waker(&waker));
            let first_poll = launched.elapsed();
            drop(waiting);
            // A future never polled, dropped; and the streams dropped with work queued (or,
            // when the event was already ready, done).
            drop(event.clone());
            drop(stream);
            drop(other);
            drop(event);
            match polled {
                Poll::Pending => {
                    pending = Some(spin);
                    break;
                }
                Poll::Ready(r) => println!(
                    "{}: the event after a {spin} ms spin was ready at the first poll, \
                     {first_poll:?} after the launch ({r:?}): a longer spin",
                    label(&device)
                ),
            }
        }
        assert!(
            pending.is_some(),
            "{}: the event was ready at the first poll even behind a 3 s spin",
            label(&device)
        );
        assert!(
            eventually(Duration::from_secs(5), || device.handle_count() == 1),
            "{}: {} device handles still alive after everything was dropped",
            label(&device),
            device.handle_count()
        );
        if device.is_simulated() {
            assert!(
                eventually(Duration::from_secs(5), || device.free_memory().unwrap()
                    == free_before),
                "simulated device: the stream-ordered free of a dropped stream was lost"
            );
        }
        // The device still works.
        let stream = device.create_stream().unwrap();
        stream.spin(Duration::from_millis(1)).unwrap();
        stream.synchronize_blocking().unwrap();
    }
}

#[test]
fn synchronize_async_and_blocking() {
    let rt = runtime();
    for device in devices() {
        let stream = device.create_stream().unwrap();
        stream.spin(Duration::from_millis(10)).unwrap();
        let start = Instant::now();
        rt.block_on(stream.synchronize()).unwrap();
        assert!(
            start.elapsed() >= Duration::from_millis(10),
            "{}",
            label(&device)
        );
        stream.spin(Duration::from_millis(10)).unwrap();
        let event = stream.record().unwrap();
        stream.synchronize_blocking().unwrap();
        assert!(event.is_complete(), "{}", label(&device));
        event.synchronize_blocking().unwrap();
    }
}

/// `synchronize()` waits for the work queued before the call, as its doc says, not also for
/// work queued between the call and the future's first poll (a review found the event recorded
/// at the first poll: a future made before more work was queued waited for that work too).
#[test]
fn synchronize_covers_the_work_queued_before_the_call() {
    let rt = runtime();
    for device in devices() {
        let stream = device.create_stream().unwrap();
        let done = stream.synchronize();
        // Queued after the call, before the first poll: not the future's to wait for.
        stream.spin(Duration::from_secs(3)).unwrap();
        let waited =
            rt.block_on(async { tokio::time::timeout(Duration::from_secs(1), done).await });
        assert!(
            matches!(waited, Ok(Ok(()))),
            "{}: synchronize() made before a 3 s spin was queued waited for the spin ({waited:?})",
            label(&device)
        );
    }
}

#[test]
fn malloc_async_round_trip() {
    let rt = runtime();
    for device in devices() {
        let stream = device.create_stream().unwrap();
        let n = 1000;
        let ptr = device.malloc_async(n * 4, &stream).unwrap();
        let mut host = vec![0u32; n];
        // SAFETY: `ptr` is n words from malloc_async on `stream`; `host` stays untouched until
        // the awaited synchronize; the free is ordered after the copy on the same stream.
        unsafe {
            stream.fill_u32(ptr, 42, n).unwrap();
            stream
                .copy_dtoh(host.as_mut_ptr() as *mut u8, ptr, n * 4)
                .unwrap();
            device.free_async(ptr, &stream).unwrap();
        }
        rt.block_on(stream.synchronize()).unwrap();
        assert!(host.iter().all(|&v| v == 42), "{}", label(&device));
    }
}

#[test]
fn stream_ids_are_unique_and_the_pool_is_round_robin() {
    for device in devices() {
        let pool = StreamPool::new(&device, 3).unwrap();
        assert_eq!(pool.len(), 3);
        let ids: Vec<_> = (0..6).map(|_| pool.get().id()).collect();
        assert_eq!(ids[0..3], ids[3..6], "{}", label(&device));
        assert_eq!(ids.iter().collect::<HashSet<_>>().len(), 3);
        assert_eq!(pool.get_by_index(4).id(), pool.streams()[1].id());
        // Ids are never reused, even after streams are dropped.
        let mut all = HashSet::new();
        for _ in 0..50 {
            assert!(all.insert(device.create_stream().unwrap().id()));
        }
        assert!(matches!(
            StreamPool::new(&device, 0),
            Err(Error::InvalidSize { size: 0, .. })
        ));
    }
}

#[test]
fn device_reports_name_and_memory() {
    for device in devices() {
        assert!(!device.name().is_empty());
        let total = device.total_memory();
        let free = device.free_memory().unwrap();
        assert!(
            total > 0 && free <= total,
            "{}: free {free} total {total}",
            label(&device)
        );
    }
}

#[test]
fn no_driver_or_bad_ordinal_is_an_error_not_a_panic() {
    match Device::cuda_device_count() {
        Err(Error::NoDriver) => {
            assert!(matches!(Device::cuda(0), Err(Error::NoDriver)));
            assert!(Device::cuda(0)
                .unwrap_err()
                .to_string()
                .contains("no CUDA driver"));
        }
        Ok(count) => {
            let err = Device::cuda(count).unwrap_err();
            assert_eq!(
                err,
                Error::InvalidDevice {
                    ordinal: count,
                    count
                }
            );
            assert!(err.to_string().contains(&count.to_string()));
        }
        Err(other) => panic!("unexpected error from cuda_device_count: {other}"),
    }
    // Whatever is here, the default device opens.
    let device = Device::default_device().unwrap();
    assert!(device.total_memory() > 0);
}

#[test]
fn bad_sizes_and_other_devices_give_typed_errors() {
    for device in devices() {
        assert!(matches!(
            device.malloc(0),
            Err(Error::InvalidSize { size: 0, .. })
        ));
        let huge = 1usize << 50; // 1 PiB
        match device.malloc(huge) {
            Err(Error::OutOfMemory {
                requested, maximum, ..
            }) => {
                assert_eq!(requested, huge);
                assert_eq!(maximum, device.total_memory());
            }
            other => panic!("{}: 1 PiB gave {other:?}", label(&device)),
        }
        // The device still allocates after that.
        let ok = Mem::new(&device, 256);
        assert_eq!(ok.bytes, 256);

        let other = Device::simulated(SimConfig::default());
        let theirs = other.create_stream().unwrap().record().unwrap();
        let ours = device.create_stream().unwrap();
        // An event of another simulated device: a GPU-side wait across devices, legal between
        // simulated devices as between GPUs (tests/multi_device.rs); a GPU's stream cannot wait
        // for a simulated device's event.
        if device.is_simulated() {
            ours.wait(&theirs).unwrap();
        } else {
            assert!(matches!(ours.wait(&theirs), Err(Error::WrongDevice { .. })));
        }
        assert!(matches!(
            device.malloc_async(256, &other.create_stream().unwrap()),
            Err(Error::WrongDevice { .. })
        ));
        // SAFETY: wait-count overflow is rejected before anything touches memory.
        let overflow = unsafe { ours.fill_u32(ok.ptr, 0, usize::MAX) };
        assert!(matches!(overflow, Err(Error::InvalidSize { .. })));
    }
}

#[test]
fn simulated_device_reports_a_use_after_free_through_the_event() {
    // The race detector would panic at the fill (a use after free): here it only records it,
    // so that the fault path is what this test sees.
    let device = Device::simulated(SimConfig {
        race_detection: streamalloc::RaceDetection::Record,
        ..SimConfig::default()
    });
    let stream = device.create_stream().unwrap();
    let ptr = device.malloc(1024).unwrap();
    // SAFETY: deliberately wrong on the simulated device, which checks every access and
    // reports it instead of touching memory.
    unsafe {
        device.free(ptr).unwrap();
        stream.fill_u32(ptr, 1, 256).unwrap();
    }
    let err = stream.record().unwrap().synchronize_blocking().unwrap_err();
    assert!(
        matches!(err, Error::InvalidAddress { ptr: p, bytes: 1024 } if p == ptr.as_raw()),
        "{err}"
    );
    // The stream stays poisoned, as a CUDA context does after a fault.
    assert!(stream.synchronize_blocking().is_err());
    // The race detector saw it when the fill was queued, with both sites.
    let races = device.races();
    assert_eq!(races.len(), 1, "{races:?}");
    assert_eq!(races[0].kind, streamalloc::RaceKind::UseAfterFree);
    assert_eq!(races[0].at.stream, Some(stream.id()));
    assert_eq!(
        (races[0].earlier.op, races[0].earlier.stream),
        ("free", None)
    );
}

/// A simulated device hands out addresses of its own 16 TiB range only, however much it has
/// allocated in all (no two simulated devices share an address, so a pointer used on the wrong
/// device is an `InvalidAddress`): once the range has been swept, it reuses freed addresses, never
/// a live block's. 2100 allocations of 8 GiB, each freed at once, pass the end of the range (the
/// host memory behind them is never touched, so they cost nothing).
#[test]
fn a_simulated_device_keeps_to_its_address_range_after_16_tib_of_allocations() {
    let device = Device::simulated(SimConfig::default());
    // Live throughout, at the start of the device's range: [first, first + 2^44) is the range.
    let first = Mem::new(&device, 4096);
    let limit = first.ptr.as_raw() + (1u64 << 44);
    const CHUNK: usize = 8 << 30;
    let mut last = first.ptr.as_raw();
    let mut wrapped = false;
    for i in 0..2100 {
        let p = device.malloc(CHUNK).unwrap().as_raw();
        assert!(
            p >= first.ptr.as_raw() + 4096 && p + CHUNK as u64 <= limit,
            "allocation {i} is at {p:#x}, outside the device's range [{:#x}, {limit:#x}) or on \
             its live first block",
            first.ptr.as_raw()
        );
        wrapped |= p < last;
        last = p;
        // SAFETY: allocated above, never used.
        unsafe { device.free(DevicePtr(p)) }.unwrap();
    }
    assert!(
        wrapped,
        "2100 allocations of 8 GiB never came back to the range's start"
    );
}

#[test]
fn simulated_delays_keep_stream_order() {
    let device = Device::simulated(SimConfig {
        op_delay: Duration::from_micros(200),
        op_jitter: Duration::from_micros(500),
        seed: 7,
        ..SimConfig::default()
    });
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let x = Mem::new(&device, 64 * 4);
    for round in 0..20u32 {
        // SAFETY: `x` outlives the synchronize in read_u32.
        unsafe { a.fill_u32(x.ptr, round, 64) }.unwrap();
        b.wait(&a.record().unwrap()).unwrap();
        assert!(read_u32(&b, x.ptr, 64).iter().all(|&v| v == round));
    }
}

#[test]
fn futures_and_handles_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>(_: &T) {}
    fn unpin<T: Unpin>() {}
    send_sync::<Device>();
    send_sync::<Stream>();
    send_sync::<streamalloc::Event>();
    send_sync::<StreamPool>();
    unpin::<streamalloc::Event>();
    let device = Device::simulated(SimConfig::default());
    let stream = device.create_stream().unwrap();
    send(&stream.synchronize());
}
