//! The completion reactor under faults (issue 19): user code that panics on the reactor thread,
//! and blocking frees that must not run there. Simulated device, public API.
//!
//! Every wait here is bounded: a reactor that died or stalls makes the test fail, not hang.

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use common::eventually;
use streamalloc::resource::callback::CallbackResource;
use streamalloc::resource::managed::ManagedResource;
use streamalloc::{CudaResource, Device, DeviceBuffer, Event, SimConfig};

/// A bound on waits that only a dead or stuck reactor exceeds.
const HANG: Duration = Duration::from_secs(20);

// ===== captured logs =====

/// Everything the crate logs in this test binary (every test's lines, interleaved), with the
/// name of the thread that logged it.
fn logs() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buffer = Arc::new(Mutex::new(Vec::new()));
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter("streamalloc=trace")
            .with_thread_names(true)
            .with_ansi(false)
            .with_writer(move || Capture(writer.clone()))
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("one global subscriber");
        buffer
    })
}

struct Capture(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Capture {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The captured lines that contain every one of `needles`.
fn lines_with(needles: &[&str]) -> Vec<String> {
    let logs = logs().lock().unwrap_or_else(|e| e.into_inner());
    String::from_utf8_lossy(&logs)
        .lines()
        .filter(|line| needles.iter().all(|n| line.contains(n)))
        .map(str::to_owned)
        .collect()
}

// ===== helpers =====

/// A waker that sends on a channel.
struct ChannelWaker(Mutex<mpsc::Sender<()>>);

impl Wake for ChannelWaker {
    fn wake(self: Arc<Self>) {
        let _ = self.0.lock().unwrap_or_else(|e| e.into_inner()).send(());
    }
}

fn channel_waker() -> (Waker, mpsc::Receiver<()>) {
    let (tx, rx) = mpsc::channel();
    (Waker::from(Arc::new(ChannelWaker(Mutex::new(tx)))), rx)
}

/// Polls `event` to completion, waiting for each wake-up at most [`HANG`]: `false` if a
/// wake-up never came (the reactor did not wake the task). A timeout that polls once more at
/// its deadline would find the event complete and hide a dead reactor; this does not.
fn woken_in_time(mut event: Event) -> bool {
    let (waker, woken) = channel_waker();
    loop {
        match Pin::new(&mut event).poll(&mut Context::from_waker(&waker)) {
            Poll::Ready(result) => {
                result.expect("the event failed");
                return true;
            }
            Poll::Pending => {
                if woken.recv_timeout(HANG).is_err() {
                    return false;
                }
            }
        }
    }
}

/// A waker whose `wake` panics.
struct PanickingWaker(String);

impl Wake for PanickingWaker {
    fn wake(self: Arc<Self>) {
        panic!("{}", self.0);
    }
}

/// Runs `attempt` with a busy stream's spin of 200 ms, then twice as long each time, until it
/// returns true: the attempt got its work queued before the GPU reached it, so the path under
/// test (the reactor's) was taken. On a slow machine the GPU may get there first and the work
/// runs on the test's thread instead, which proves nothing: then try again with a longer spin.
/// An attempt's own assertions hold whichever way it went.
fn with_growing_spin(mut attempt: impl FnMut(u32, Duration) -> bool) {
    for n in 0..6 {
        if attempt(n, Duration::from_millis(200 << n)) {
            return;
        }
    }
    panic!("in six attempts the GPU always reached the event before the test could queue its work");
}

// ===== panics on the reactor thread =====

/// A deferred free into a resource whose `deallocate` panics: the reactor catches it, logs it,
/// runs the other deferred free pending behind the same busy stream, and still wakes a task
/// awaiting a later event.
#[test]
fn a_panicking_deferred_free_does_not_kill_the_reactor() {
    logs();
    with_growing_spin(|n, spin| {
        let device = Device::simulated(SimConfig::default());
        let d = device.clone();
        let message = format!("test deallocate panics (reactor_faults: deferred free, try {n})");
        let panicked = message.clone();
        // SAFETY: memory from the device's own `malloc`; the free panics before it frees anything
        // (the test is about the panic).
        let panicking = Arc::new(unsafe {
            CallbackResource::new(
                &device,
                move |bytes, _| d.malloc(bytes),
                move |_, _, _| panic!("{panicked}"),
            )
        });
        let good = Arc::new(CudaResource::new(&device));
        let (s, busy) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        busy.spin(spin).unwrap();

        let mut doomed = DeviceBuffer::new(&panicking, 4096, &s).unwrap();
        doomed.record_stream(&busy).unwrap();
        drop(doomed); // its free waits for `busy`, then panics on the reactor thread
        let free_before = device.free_memory().unwrap();
        let mut kept = DeviceBuffer::new(&good, 1 << 20, &s).unwrap();
        kept.record_stream(&busy).unwrap();
        drop(kept); // a second deferred free, right behind the panicking one

        busy.spin(Duration::from_millis(100)).unwrap();
        let later = busy.record().unwrap();
        assert!(
            woken_in_time(later),
            "an event 100 ms after the panic never woke its task: the reactor died"
        );
        assert!(
            eventually(HANG, || device.free_memory().unwrap() == free_before),
            "the deferred free behind the panicking one was lost"
        );
        let logged = lines_with(&["ERROR", &message]);
        assert_eq!(
            logged.len(),
            1,
            "the panic was not logged at error level once: {logged:?}"
        );
        assert!(
            logged[0].contains("callback"),
            "the log does not say what panicked: {}",
            logged[0]
        );
        logged[0].contains(" sa-reactor-")
    });
}

/// A waker whose `wake` panics, registered before a good one on the same event: the good one
/// is still woken, and later events still wake their tasks.
#[test]
fn a_panicking_waker_does_not_kill_the_reactor() {
    logs();
    with_growing_spin(|n, spin| {
        let device = Device::simulated(SimConfig::default());
        let busy = device.create_stream().unwrap();
        busy.spin(spin).unwrap();
        let event = busy.record().unwrap();

        let message = format!("test waker panics (reactor_faults: waker, try {n})");
        let mut polled = event.clone();
        let waker = Waker::from(Arc::new(PanickingWaker(message.clone())));
        if Pin::new(&mut polled)
            .poll(&mut Context::from_waker(&waker))
            .is_ready()
        {
            return false; // the GPU got there first: nothing was registered
        }
        // A task awaiting the same event, registered after the panicking waker.
        let mut other = event.clone();
        let (other_waker, other_woken) = channel_waker();
        let registered = Pin::new(&mut other)
            .poll(&mut Context::from_waker(&other_waker))
            .is_pending();

        busy.spin(Duration::from_millis(100)).unwrap();
        let later = busy.record().unwrap();
        assert!(
            woken_in_time(later),
            "an event after the panicking waker never woke its task: the reactor died"
        );
        assert!(
            !registered || other_woken.recv_timeout(HANG).is_ok(),
            "the waker behind the panicking one was never woken"
        );
        drop(polled);
        let logged = lines_with(&["ERROR", &message]);
        assert_eq!(
            logged.len(),
            1,
            "the panic was not logged at error level once: {logged:?}"
        );
        assert!(
            logged[0].contains("wake"),
            "the log does not say what panicked: {}",
            logged[0]
        );
        registered
    });
}

// ===== blocking driver calls off the reactor =====

/// Deferred frees into `CudaResource` and `ManagedResource` (`cuMemFree`, which on a GPU waits
/// until the device is idle) do not run on the reactor thread, and none is lost: the device's
/// free memory and the managed resource's count come back.
#[test]
fn deferred_driver_frees_run_off_the_reactor() {
    logs();
    with_growing_spin(|n, spin| {
        let device = Device::simulated(SimConfig::default());
        let cuda = Arc::new(CudaResource::new(&device));
        let managed = Arc::new(ManagedResource::new(&device));
        let (s, busy) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let free_before = device.free_memory().unwrap();
        busy.spin(spin).unwrap();
        // Sizes no other test or try frees, to find these frees' log lines.
        let tag = 256 * (n as usize + 1);
        let (cuda_bytes, managed_bytes) = ((3 << 20) + tag, (5 << 20) + tag);
        let mut a = DeviceBuffer::new(&cuda, cuda_bytes, &s).unwrap();
        let mut b = DeviceBuffer::new(&managed, managed_bytes, &s).unwrap();
        a.record_stream(&busy).unwrap();
        b.record_stream(&busy).unwrap();
        let freed = [(a.as_ptr(), cuda_bytes), (b.as_ptr(), managed_bytes)];
        drop((a, b)); // both frees wait for `busy`, then run from the reactor's callbacks

        assert!(
            eventually(HANG, || device.free_memory().unwrap() == free_before),
            "a deferred driver free was lost"
        );
        assert!(
            eventually(HANG, || managed.outstanding_bytes() == 0),
            "ManagedResource still counts {} bytes",
            managed.outstanding_bytes()
        );
        let mut off_reactor = true;
        for (ptr, bytes) in freed {
            let lines = lines_with(&["cuMemFree", &format!("ptr={ptr:?} bytes={bytes}")]);
            assert_eq!(lines.len(), 1, "one cuMemFree of {ptr:?}: {lines:?}");
            assert!(
                !lines[0].contains(" sa-reactor-"),
                "cuMemFree ran on the reactor thread: {}",
                lines[0]
            );
            // Else it ran on this thread, at the drop: the GPU was already done.
            off_reactor &= lines[0].contains(" sa-blocking-");
        }
        off_reactor
    });
}

/// A resource that records the name of the thread that drops it.
#[derive(Debug)]
struct DropProbe {
    inner: CudaResource,
    dropped_on: Arc<Mutex<Option<String>>>,
}

// SAFETY: every allocation is the inner resource's, passed on unchanged.
unsafe impl streamalloc::MemoryResource for DropProbe {
    fn device(&self) -> &Device {
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

impl Drop for DropProbe {
    fn drop(&mut self) {
        *self.dropped_on.lock().unwrap() = std::thread::current().name().map(str::to_owned);
    }
}

/// Issue 19: when a deferred free holds the last handle of its resource, the resource's Drop
/// (a pool synchronizing its streams and freeing its chunks) must not run on the reactor.
#[test]
fn a_resource_whose_last_handle_a_deferred_free_holds_is_dropped_off_the_reactor() {
    let device = Device::simulated(SimConfig::default());
    let dropped_on = Arc::new(Mutex::new(None));
    let resource = Arc::new(DropProbe {
        inner: CudaResource::new(&device),
        dropped_on: dropped_on.clone(),
    });
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let mut buf = DeviceBuffer::new(&resource, 4096, &a).unwrap();
    b.spin(Duration::from_millis(50)).unwrap();
    buf.record_stream(&b).unwrap();
    drop(buf); // the free waits for `b`: the reactor will run it
    drop(resource); // the deferred free now holds the last handle
    assert!(
        eventually(Duration::from_secs(20), || dropped_on
            .lock()
            .unwrap()
            .is_some()),
        "the resource was never dropped"
    );
    let name = dropped_on.lock().unwrap().clone().unwrap();
    assert!(
        !name.starts_with("sa-reactor"),
        "the resource was dropped on the reactor thread ({name})"
    );
}
