//! A review of `DeviceBuffer`'s reallocation and `DeviceVec` (sizes at the edge, zero-sized
//! elements, a buffer moved between streams), on every available device.

mod common;

use std::sync::Arc;

use common::{devices, label};
use streamalloc::{DeviceBuffer, DeviceVec, Error};

const MIB: usize = 1 << 20;

/// Sizes that no resource can give: a typed error, never a panic, and the buffer as it was.
#[test]
fn huge_reallocations_are_errors() {
    for device in devices() {
        let l = label(&device);
        let p = Arc::new(common::pool(&device, 0, 64 * MIB));
        let direct = Arc::new(streamalloc::CudaResource::new(&device));
        let s = device.create_stream().unwrap();
        for huge in [usize::MAX, usize::MAX - 255, usize::MAX / 2 + 1, 1 << 62] {
            let mut b = DeviceBuffer::new(&p, 100, &s).unwrap();
            assert!(b.resize(huge).is_err(), "{l}");
            assert!(b.reserve(huge - 100).is_err(), "{l}");
            assert_eq!((b.len(), b.capacity()), (100, 100), "{l}");
            let mut b = DeviceBuffer::new(&direct, 100, &s).unwrap();
            assert!(b.resize(huge).is_err(), "{l}");
            let mut v = DeviceVec::<u8>::new(&p, 3, &s).unwrap();
            assert!(v.resize(huge).is_err(), "{l}");
            assert!(v.reserve(huge).is_err(), "{l}");
            assert_eq!((v.len(), v.capacity()), (3, 3), "{l}");
            assert!(matches!(
                DeviceVec::<u32>::new(&p, huge, &s),
                Err(Error::InvalidSize { .. })
            ));
        }
    }
}

/// A mix of moves between streams, reads on other streams and reallocations, with the race
/// detector recording: nothing the crate queues itself may race.
#[test]
fn moves_reads_and_reallocations_do_not_race() {
    use std::time::Duration;
    use streamalloc::{Device, RaceDetection, SimConfig};
    let device = Device::simulated(SimConfig {
        race_detection: RaceDetection::Record,
        ..SimConfig::default()
    });
    let rt = common::runtime();
    let p = Arc::new(common::pool(&device, 0, 64 * MIB));
    let (a, b, c) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    for how in 0..6 {
        let mut v = DeviceVec::<u32>::zeroed(&p, 1 << 14, &a).unwrap();
        b.spin(Duration::from_millis(50)).unwrap();
        common::poll_once_and_drop(v.to_host(&b));
        match how {
            0 => v.set_stream(&c).unwrap(),
            1 => v.resize(1 << 15).unwrap(),
            2 => {
                v.set_stream(&c).unwrap();
                v.resize(1 << 15).unwrap();
            }
            3 => {
                let w = v.try_clone_to(&p, &c).unwrap();
                drop(v);
                v = w;
            }
            4 => {
                v.resize(10).unwrap();
                v.shrink_to_fit().unwrap();
                v.set_stream(&b).unwrap();
            }
            _ => {
                v = {
                    let (ptr, cap, res, s) = v.into_buffer().into_raw_parts().unwrap();
                    // SAFETY: what `into_raw_parts` gave up, taken back once.
                    let buf = unsafe { DeviceBuffer::from_raw_parts(ptr, cap, res, &s) };
                    DeviceVec::from_buffer(buf).unwrap()
                };
            }
        }
        let mut v2 = v.try_clone().unwrap();
        v2.set_element(0, 9).unwrap();
        v.set_element(0, 7).unwrap();
        assert_eq!(rt.block_on(v.element(0)).unwrap(), 7);
        assert_eq!(rt.block_on(v2.element(0)).unwrap(), 9);
        drop((v, v2));
        for s in [&a, &b, &c] {
            let mut n = DeviceBuffer::new(&p, 1 << 16, s).unwrap();
            n.memset(3).unwrap();
        }
        for s in [&a, &b, &c] {
            s.synchronize_blocking().unwrap();
        }
        let races = device.take_races();
        assert!(races.is_empty(), "case {how}: {races:#?}");
    }
}

/// The race detector's `Panic` mode panics inside a crate call (here the copy of a
/// reallocation, racing a user's declared write on another stream). A caller that catches the
/// panic (a test harness, a task runtime) must find nothing lost: the buffer as it was, and
/// the new allocation given back. It used to be leaked: the pool stayed a block short.
#[test]
fn a_reallocation_that_panics_loses_no_memory() {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use streamalloc::{Device, MemoryAccess, RaceDetection, SimConfig};
    let device = Device::simulated(SimConfig {
        race_detection: RaceDetection::Panic,
        ..SimConfig::default()
    });
    let p = Arc::new(common::pool(&device, 0, 64 * MIB));
    let used = |p: &streamalloc::PoolResource<streamalloc::CudaResource>| {
        let s = p.stats();
        s.reserved - s.free
    };
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let mut buf = DeviceBuffer::new(&p, 4096, &a).unwrap();
    // The user's kernel on `b` writes the buffer, ordered after its allocation but not
    // before the reallocation's copy on `a`.
    b.wait(&a.record().unwrap()).unwrap();
    b.declare_access(buf.as_ptr(), 4096, MemoryAccess::Write, "writer")
        .unwrap();
    let before = used(&p);
    let panicked = catch_unwind(AssertUnwindSafe(|| buf.resize(1 << 20))).is_err();
    assert!(panicked, "the racing copy panics in the Panic mode");
    assert_eq!((buf.len(), buf.capacity()), (4096, 4096));
    // Order the user's write before the buffer's free, then free it.
    a.wait(&b.record().unwrap()).unwrap();
    drop(buf);
    for s in [&a, &b] {
        s.synchronize_blocking().unwrap();
    }
    assert_eq!(used(&p), 0, "in use before the resize: {before}");
}

/// A long-lived buffer read on a fresh stream per request (marked with `record_stream`),
/// each stream then dropped: the buffer lets go of those streams (a review found it kept all
/// of them until it dropped, so that no trim let the pool forget them, and each simulated
/// stream's thread lived on), and the reads still order its free: the buffer's own stream
/// waits for a dropped stream's work before the handle goes. (The race detector cannot show
/// that order: a dropped simulated stream's unseen work leaves its view.)
#[test]
fn a_long_lived_buffer_lets_go_of_dropped_streams_it_was_used_on() {
    let device = streamalloc::Device::simulated(streamalloc::SimConfig::default());
    let p = Arc::new(common::pool(&device, 0, 64 * MIB));
    let home = device.create_stream().unwrap();
    let mut weights = DeviceBuffer::new(&p, 1 << 16, &home).unwrap();
    weights.memset(0).unwrap();
    home.synchronize_blocking().unwrap();
    // A slow reader, dropped; then eight uses on streams the test keeps, and a ninth: the
    // buffer keeps eight, and lets go of the slow one, its own stream ordered behind it.
    let slow = device.create_stream().unwrap();
    weights.record_stream(&slow).unwrap();
    slow.spin(std::time::Duration::from_secs(1)).unwrap();
    drop(slow);
    let kept: Vec<_> = (0..9)
        .map(|_| {
            let s = device.create_stream().unwrap();
            weights.record_stream(&s).unwrap();
            s
        })
        .collect();
    assert!(
        !home.is_idle().unwrap(),
        "the buffer let go of a dropped stream without waiting for its work"
    );
    home.synchronize_blocking().unwrap();
    drop(kept);
    // Per request: a fresh stream, a clone there, then both dropped.
    for _ in 0..40 {
        let s = device.create_stream().unwrap();
        drop(weights.try_clone_to(&p, &s).unwrap());
    }
    p.trim_blocking().unwrap();
    // The home stream, and at most the 8 uses the buffer keeps before it lets go.
    let streams = p.stats().streams;
    assert!(streams <= 9, "the pool still knows {streams} streams");
}

/// A stream whose driver handle was handed out (`cuda_stream`, `cudarc_stream`) may get work
/// through that handle with no `Stream` of ours left: a buffer used there keeps it as a use
/// however many uses come after (a review found it let go of, its later work then unordered
/// before the free).
#[test]
fn a_buffer_keeps_an_exposed_stream_it_was_used_on() {
    let device = streamalloc::Device::simulated(streamalloc::SimConfig::default());
    let p = Arc::new(common::pool(&device, 0, 64 * MIB));
    let home = device.create_stream().unwrap();
    let mut weights = DeviceBuffer::new(&p, 1 << 16, &home).unwrap();
    let exposed = device.create_stream().unwrap();
    let _handle = exposed.cuda_stream();
    let id = format!("{:?}", exposed.id());
    weights.record_stream(&exposed).unwrap();
    drop(exposed);
    for _ in 0..12 {
        weights
            .record_stream(&device.create_stream().unwrap())
            .unwrap();
    }
    let uses = format!("{weights:?}");
    assert!(uses.contains(&id), "{id} let go of: {uses}");
}

/// A resource that notes the name of the thread its Drop ran on.
#[derive(Debug)]
struct NotesDrop {
    inner: streamalloc::CudaResource,
    dropped_on: Arc<std::sync::Mutex<Option<String>>>,
}

// SAFETY: every allocation is the inner resource's, passed on unchanged.
unsafe impl streamalloc::MemoryResource for NotesDrop {
    fn device(&self) -> &streamalloc::Device {
        self.inner.device()
    }

    fn allocate(
        &self,
        bytes: usize,
        stream: &streamalloc::Stream,
    ) -> streamalloc::Result<streamalloc::DevicePtr> {
        self.inner.allocate(bytes, stream)
    }

    unsafe fn deallocate(
        &self,
        ptr: streamalloc::DevicePtr,
        bytes: usize,
        stream: &streamalloc::Stream,
    ) -> streamalloc::Result<()> {
        // SAFETY: the caller's contract, passed on to the resource that allocated it.
        unsafe { self.inner.deallocate(ptr, bytes, stream) }
    }
}

impl Drop for NotesDrop {
    fn drop(&mut self) {
        let name = std::thread::current()
            .name()
            .unwrap_or("unnamed")
            .to_owned();
        *self.dropped_on.lock().unwrap() = Some(name);
    }
}

/// Waits for a `NotesDrop` to be dropped, and says on which thread.
fn dropped_on(dropped_on: &std::sync::Mutex<Option<String>>) -> String {
    assert!(
        common::eventually(std::time::Duration::from_secs(20), || dropped_on
            .lock()
            .unwrap()
            .is_some()),
        "the resource was never dropped"
    );
    dropped_on.lock().unwrap().clone().unwrap()
}

/// "Dropping it never blocks the host", for a buffer that holds the last handle of a pool: the
/// pool's Drop waits for every stream it served, and it ran inside `drop(buf)`, which returned
/// only once unrelated work on another stream was done (a review's finding). Now the drop
/// returns with that work still running, the pool is dropped on the blocking-work thread, and
/// its memory goes back upstream once that work is done.
#[test]
fn dropping_the_last_buffer_of_a_dropped_pool_does_not_wait_for_its_streams() {
    use std::time::Duration;
    for device in devices() {
        let l = label(&device);
        let free_before = device.free_memory().unwrap();
        let pool = Arc::new(common::pool(&device, 0, 64 * MIB));
        let (s, other) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let mut buf = DeviceBuffer::new(&pool, 4096, &s).unwrap();
        buf.memset(1).unwrap();
        // A sibling freed on `other`: the pool served it, and its Drop waits for it.
        drop(DeviceBuffer::new(&pool, 4096, &other).unwrap());
        // Unrelated work there, long enough that nothing but a wait for it sees it done.
        other.spin(Duration::from_secs(5)).unwrap();
        drop(pool);
        drop(buf);
        assert!(
            !other.is_idle().unwrap(),
            "{l}: drop(buf) waited for the pool's other stream"
        );
        if device.is_simulated() {
            // The pool's chunks go back to the device once `other` is done.
            assert!(
                common::eventually(Duration::from_secs(60), || device.free_memory().unwrap()
                    == free_before),
                "{l}: the dropped pool's memory never went back"
            );
        }
    }
}

/// Where the resource's Drop runs when a buffer (used on its own stream only) holds the last
/// handle: on the blocking-work thread, whether the buffer drops on a user's thread or in a
/// waker on the completion reactor (a task's last handle dropped there drops its future's
/// buffers). It ran where the buffer dropped: on the caller's thread, and on the reactor
/// (a review's finding; only a deferred free's release handed it off, and only from the
/// reactor).
#[test]
fn the_last_resource_handle_of_a_buffer_is_dropped_on_the_blocking_work_thread() {
    use std::future::Future;
    use std::time::Duration;

    struct DropsOnWake(std::sync::Mutex<Option<DeviceBuffer>>);
    impl std::task::Wake for DropsOnWake {
        fn wake(self: Arc<Self>) {
            self.0.lock().unwrap().take();
        }
    }

    let device = streamalloc::Device::simulated(streamalloc::SimConfig::default());
    let s = device.create_stream().unwrap();
    let blocking = format!("sa-blocking-{}", device.id());
    let noted = || {
        let dropped_on = Arc::new(std::sync::Mutex::new(None));
        let resource = Arc::new(NotesDrop {
            inner: streamalloc::CudaResource::new(&device),
            dropped_on: dropped_on.clone(),
        });
        (resource, dropped_on)
    };

    // Dropped on this thread, with and without another stream recorded (the deferred free
    // releases here if its event is complete when it registers, else on the reactor).
    for other_use in [false, true] {
        let (resource, noted_on) = noted();
        let mut buf = DeviceBuffer::new(&resource, 64, &s).unwrap();
        if other_use {
            let other = device.create_stream().unwrap();
            buf.record_stream(&other).unwrap();
            other.synchronize_blocking().unwrap();
        }
        drop(resource);
        drop(buf);
        let on = dropped_on(&noted_on);
        assert_eq!(on, blocking, "other stream recorded: {other_use}");
    }

    // Dropped by a waker that the completion reactor calls.
    let (resource, noted_on) = noted();
    let buf = DeviceBuffer::new(&resource, 64, &s).unwrap();
    drop(resource);
    s.spin(Duration::from_millis(100)).unwrap();
    let mut event = Box::pin(s.record().unwrap());
    let waker = std::task::Waker::from(Arc::new(DropsOnWake(std::sync::Mutex::new(Some(buf)))));
    let mut cx = std::task::Context::from_waker(&waker);
    assert!(event.as_mut().poll(&mut cx).is_pending());
    drop(waker);
    let on = dropped_on(&noted_on);
    assert_eq!(on, blocking, "dropped by a waker on the reactor");
}
