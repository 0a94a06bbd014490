//! `CudaAsyncResource`'s waiters, after reviews: a wake under the shared pool's lock of
//! queues, a reservation rolled back without waking the waiter it refused, a quiet give-back
//! above that stopped the wake-up of a waiter elsewhere, and a free forgotten when a free on
//! another stream took its slot. On the simulated device (a small one, and injected faults);
//! each failed before its fix.

mod common;

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::task::{Context, Wake, Waker};
use std::time::Duration;

use streamalloc::resource::adaptor::LimitingAdaptor;
use streamalloc::resource::cuda_async::CudaAsyncOptions;
use streamalloc::{
    AllocateAsync, CudaAsyncResource, Device, DevicePtr, FaultKind, Faults, MemoryResource,
    SimConfig, Stream,
};

const MIB: usize = 1 << 20;

/// A waker that counts its wake-ups.
struct Flag(AtomicUsize);

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, SeqCst);
    }
}

fn flag() -> (Arc<Flag>, Waker) {
    let flag = Arc::new(Flag(AtomicUsize::new(0)));
    (flag.clone(), Waker::from(flag))
}

/// Whether `flag` is woken within a while (a missed wake-up never is).
fn woken(flag: &Flag) -> bool {
    common::eventually(Duration::from_secs(10), || flag.0.load(SeqCst) > 0)
}

/// Polls `wait` each time its waker is woken until it is served; `None` if a wake-up is
/// missed (none comes for a while). A wake-up may come for an earlier free (each free wakes
/// at once, and again when the GPU reaches it), so one refused try is no failure.
fn served_when_woken<F>(
    mut wait: std::pin::Pin<&mut F>,
    flag: &Flag,
    waker: &Waker,
) -> Option<DevicePtr>
where
    F: Future<Output = streamalloc::Result<DevicePtr>>,
{
    loop {
        if !woken(flag) {
            return None;
        }
        flag.0.store(0, SeqCst);
        if let std::task::Poll::Ready(got) = wait.as_mut().poll(&mut Context::from_waker(waker)) {
            return Some(got.unwrap());
        }
    }
}

/// A waker whose wake drops a resource: what a wake that drops a task holding the resource's
/// last handle does.
struct DropsResource(Mutex<Option<CudaAsyncResource>>);

impl Wake for DropsResource {
    fn wake(self: Arc<Self>) {
        let taken = self.0.lock().unwrap().take();
        drop(taken);
    }
}

/// A free through one view of the default pool wakes a waiter of another, whose waker drops a
/// third view: its drop leaves the pool's list of queues, which the free held for reading
/// while it woke the waiters (a deadlock, on the scene's own thread).
#[test]
fn a_wake_that_drops_another_view_of_the_pool_does_not_deadlock() {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let device = Device::simulated(SimConfig {
            total_memory: 64 * MIB,
            ..SimConfig::default()
        });
        let views: Vec<_> = (0..3)
            .map(|_| CudaAsyncResource::default_pool(&device).unwrap())
            .collect();
        let [a, b, c] = <[_; 3]>::try_from(views).unwrap();
        let s = device.create_stream().unwrap();
        let mut blocks = Vec::new();
        while let Ok(p) = a.allocate(8 * MIB, &s) {
            blocks.push(p);
        }
        let waker = Waker::from(Arc::new(DropsResource(Mutex::new(Some(c)))));
        let mut wait = Box::pin(b.allocate_async(8 * MIB, &s));
        assert!(wait
            .as_mut()
            .poll(&mut Context::from_waker(&waker))
            .is_pending());
        // The free that wakes the waiter (and deadlocked).
        common::free(&a, blocks.pop().unwrap(), 8 * MIB, &s);
        drop(wait);
        for p in blocks {
            common::free(&a, p, 8 * MIB, &s);
        }
        s.synchronize_blocking().unwrap();
        let _ = done.send(());
    });
    // Not a timing threshold: the scene takes milliseconds, a deadlock for ever.
    assert!(
        finished.recv_timeout(Duration::from_secs(60)).is_ok(),
        "deadlocked: a waiter woken under the pool's list of queues dropped a view of the pool"
    );
}

/// Stops the thread that logs the simulated device's injected fault (inside the failing
/// driver call) until told to go on.
struct AtFault {
    hit: Mutex<Option<std::sync::mpsc::Sender<()>>>,
    go: Mutex<std::sync::mpsc::Receiver<()>>,
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for AtFault {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if !event.metadata().target().ends_with("sim::faults") {
            return;
        }
        if let Some(hit) = self.hit.lock().unwrap().take() {
            hit.send(()).unwrap();
            self.go.lock().unwrap().recv().unwrap();
        }
    }
}

/// A request X reserves the last room under the maximum and stops inside the driver; a
/// request W that comes meanwhile is refused by the count, because of X's reservation, and
/// waits; the driver then refuses X, which gives its reservation back: W is woken (the
/// maximum refused someone meanwhile) and served. It slept. No free in the scene, so no other
/// wake-up can come.
#[test]
fn a_rolled_back_reservation_wakes_the_waiter_it_refused() {
    use tracing_subscriber::layer::SubscriberExt;
    const K: usize = 256 << 10;
    let faults = Faults::new();
    let device = Device::simulated(SimConfig {
        faults: faults.clone(),
        ..SimConfig::default()
    });
    let options = CudaAsyncOptions {
        maximum_pool_size: Some(4 * K),
        ..CudaAsyncOptions::default()
    };
    let ca = Arc::new(CudaAsyncResource::new(&device, options).unwrap());
    let s = device.create_stream().unwrap();
    let held: Vec<DevicePtr> = (0..3).map(|_| ca.allocate(K, &s).unwrap()).collect();
    // X reserves the last room and stops inside the driver's allocation, which fails.
    let (hit, reached) = std::sync::mpsc::channel();
    let (go, wait_go) = std::sync::mpsc::channel();
    faults.fail_next(FaultKind::Allocate);
    let x = {
        let (ca, s) = (ca.clone(), s.clone());
        std::thread::spawn(move || {
            let stop = tracing_subscriber::registry().with(AtFault {
                hit: Mutex::new(Some(hit)),
                go: Mutex::new(wait_go),
            });
            tracing::subscriber::with_default(stop, || ca.allocate(K, &s))
        })
    };
    reached.recv().unwrap();
    assert_eq!(ca.allocated_bytes(), 4 * K, "X's reservation");
    // W: refused by the count, because of X's reservation; it waits.
    let (w_flag, w_waker) = flag();
    let mut w = Box::pin(ca.allocate_async(K, &s));
    assert!(w
        .as_mut()
        .poll(&mut Context::from_waker(&w_waker))
        .is_pending());
    go.send(()).unwrap();
    assert!(x.join().unwrap().is_err(), "X was to fail in the driver");
    assert_eq!(ca.allocated_bytes(), 3 * K, "rolled back");
    let got = served_when_woken(w.as_mut(), &w_flag, &w_waker)
        .expect("room under the maximum again, and W never woken");
    common::free(&*ca, got, K, &s);
    for p in held {
        common::free(&*ca, p, K, &s);
    }
    s.synchronize_blocking().unwrap();
}

/// A waiter W of the resource and the head H of a limiting adaptor's queue above it (a set),
/// the device full. One free wakes both: H takes part of its set and gives it back quietly on
/// a busy stream; W's try is refused (the driver has not reached that free). When the GPU
/// reaches it, W is woken: nothing recorded an event for it, since the quiet queue (H's) was
/// reachable from the resource's.
#[test]
fn a_quiet_give_back_above_does_not_leave_a_waiter_below_asleep() {
    let device = Device::simulated(SimConfig {
        total_memory: 64 * MIB,
        ..SimConfig::default()
    });
    let ca = Arc::new(CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap());
    let lim = LimitingAdaptor::new(ca.clone(), 1 << 40);
    let (s0, s1, s2) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let mut blocks = Vec::new();
    while let Ok(p) = ca.allocate(8 * MIB, &s0) {
        blocks.push(p);
    }
    let (w_flag, w_waker) = flag();
    let mut w = Box::pin(ca.allocate_async(8 * MIB, &s2));
    assert!(w
        .as_mut()
        .poll(&mut Context::from_waker(&w_waker))
        .is_pending());
    let mut h = Box::pin(lim.allocate_all_async([(8 * MIB, &s1), (8 * MIB, &s1)]));
    assert!(common::poll_once(h.as_mut()).is_pending());
    s1.spin(Duration::from_millis(500)).unwrap();
    common::free(&*ca, blocks.pop().unwrap(), 8 * MIB, &s0);
    s0.synchronize_blocking().unwrap();
    assert!(woken(&w_flag));
    // H first: takes 8 MiB on s1, fails the second, gives it back quietly (behind the spin).
    assert!(common::poll_once(h.as_mut()).is_pending());
    // W: refused, the free on s1 not reached yet.
    w_flag.0.store(0, SeqCst);
    assert!(
        w.as_mut()
            .poll(&mut Context::from_waker(&w_waker))
            .is_pending(),
        "W served before the GPU reached H's give-back"
    );
    drop(h);
    let got = served_when_woken(w.as_mut(), &w_flag, &w_waker)
        .expect("memory back in the pool, and W never woken");
    common::free(&*ca, got, 8 * MIB, &s2);
    for p in blocks {
        common::free(&*ca, p, 8 * MIB, &s0);
    }
    s0.synchronize_blocking().unwrap();
    s2.synchronize_blocking().unwrap();
}

// ===== frees issued while nobody waits, on streams that share a slot =====

/// Streams `x`, `y` and `z`, `x` and `y` with ids equal modulo 16 (the slots of the streams
/// noted for later waiters) if `collide`, different otherwise.
fn three_streams(device: &Device, collide: bool) -> (Stream, Stream, Stream) {
    let x = device.create_stream().unwrap();
    loop {
        let y = device.create_stream().unwrap();
        if (y.id().get() % 16 == x.id().get() % 16) == collide {
            return (x, y, device.create_stream().unwrap());
        }
    }
}

/// A free on `x` behind 500 ms of work and a free on `y`, both issued while nobody waits,
/// then a request on `z` that needs `x`'s block: whether it is woken (and served) once the
/// GPU reaches `x`'s free.
fn woken_for_a_free_noted_before_another(collide: bool) -> bool {
    let device = Device::simulated(SimConfig {
        total_memory: 64 * MIB,
        ..SimConfig::default()
    });
    let r = CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap();
    let (x, y, z) = three_streams(&device, collide);
    let a = r.allocate(60 * MIB, &x).unwrap();
    x.spin(Duration::from_millis(500)).unwrap();
    common::free(&r, a, 60 * MIB, &x);
    let b = r.allocate(MIB, &y).unwrap();
    common::free(&r, b, MIB, &y);
    y.synchronize_blocking().unwrap();
    let (flag, waker) = flag();
    let mut wait = Box::pin(r.allocate_async(60 * MIB, &z));
    assert!(wait
        .as_mut()
        .poll(&mut Context::from_waker(&waker))
        .is_pending());
    let served = served_when_woken(wait.as_mut(), &flag, &waker);
    x.synchronize_blocking().unwrap();
    match served {
        Some(got) => {
            common::free(&r, got, 60 * MIB, &z);
            z.synchronize_blocking().unwrap();
            true
        }
        None => false,
    }
}

/// The control: `x` and `y` in different slots.
#[test]
fn a_waiter_is_woken_for_a_free_noted_in_another_slot_than_a_later_one() {
    assert!(
        woken_for_a_free_noted_before_another(false),
        "memory back in the pool, and the waiter never woken"
    );
}

/// A slot kept one stream: `y`'s free replaced `x`, the waiter recorded an event on `y` only,
/// and slept with `x`'s block back in the pool (a review's finding; failed before the fix).
#[test]
fn a_waiter_is_woken_for_a_free_whose_slot_a_later_free_took() {
    assert!(
        woken_for_a_free_noted_before_another(true),
        "the waiter slept with the memory back in the pool: x's free was forgotten when y's \
         free took its slot"
    );
}
