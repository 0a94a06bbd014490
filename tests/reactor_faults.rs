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
struct PanickingWaker(&'static str);

impl Wake for PanickingWaker {
    fn wake(self: Arc<Self>) {
        panic!("{}", self.0);
    }
}

// ===== panics on the reactor thread =====

/// A deferred free into a resource whose `deallocate` panics: the reactor catches it, logs it,
/// runs the other deferred free pending behind the same busy stream, and still wakes a task
/// awaiting a later event.
#[test]
fn a_panicking_deferred_free_does_not_kill_the_reactor() {
    logs();
    let device = Device::simulated(SimConfig::default());
    let d = device.clone();
    const PANIC: &str = "test deallocate panics (reactor_faults: deferred free)";
    let panicking = Arc::new(CallbackResource::new(
        &device,
        move |bytes, _| d.malloc(bytes),
        |_, _, _| panic!("{PANIC}"),
    ));
    let good = Arc::new(CudaResource::new(&device));
    let (s, busy) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    busy.spin(Duration::from_millis(50)).unwrap();

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
    let logged = lines_with(&["ERROR", PANIC]);
    assert!(
        !logged.is_empty(),
        "the panic was not logged at error level"
    );
    assert!(
        logged[0].contains("callback"),
        "the log does not say what panicked: {}",
        logged[0]
    );
}

/// A waker whose `wake` panics, registered before a good one on the same event: the good one
/// is still woken, and later events still wake their tasks.
#[test]
fn a_panicking_waker_does_not_kill_the_reactor() {
    logs();
    let device = Device::simulated(SimConfig::default());
    let busy = device.create_stream().unwrap();
    busy.spin(Duration::from_millis(50)).unwrap();
    let event = busy.record().unwrap();

    const PANIC: &str = "test waker panics (reactor_faults: waker)";
    let mut polled = event.clone();
    let waker = Waker::from(Arc::new(PanickingWaker(PANIC)));
    assert!(
        Pin::new(&mut polled)
            .poll(&mut Context::from_waker(&waker))
            .is_pending(),
        "the event completed before the test could wait for it"
    );
    // A task awaiting the same event, registered after the panicking waker.
    let mut other = event.clone();
    let (other_waker, other_woken) = channel_waker();
    assert!(Pin::new(&mut other)
        .poll(&mut Context::from_waker(&other_waker))
        .is_pending());

    busy.spin(Duration::from_millis(100)).unwrap();
    let later = busy.record().unwrap();
    assert!(
        woken_in_time(later),
        "an event after the panicking waker never woke its task: the reactor died"
    );
    assert!(
        other_woken.recv_timeout(HANG).is_ok(),
        "the waker behind the panicking one was never woken"
    );
    drop(polled);
    let logged = lines_with(&["ERROR", PANIC]);
    assert!(
        !logged.is_empty(),
        "the panic was not logged at error level"
    );
    assert!(
        logged[0].contains("wake"),
        "the log does not say what panicked: {}",
        logged[0]
    );
}

// ===== blocking driver calls off the reactor =====

/// Deferred frees into `CudaResource` and `ManagedResource` (`cuMemFree`, which on a GPU waits
/// until the device is idle) do not run on the reactor thread, and none is lost: the device's
/// free memory and the managed resource's count come back.
#[test]
fn deferred_driver_frees_run_off_the_reactor() {
    logs();
    let device = Device::simulated(SimConfig::default());
    let cuda = Arc::new(CudaResource::new(&device));
    let managed = Arc::new(ManagedResource::new(&device));
    let (s, busy) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let free_before = device.free_memory().unwrap();
    busy.spin(Duration::from_millis(50)).unwrap();
    // Sizes no other test here frees, to find these frees' log lines.
    let (cuda_bytes, managed_bytes) = ((3 << 20) + 256, (5 << 20) + 256);
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
    for (ptr, bytes) in freed {
        let lines = lines_with(&["cuMemFree", &format!("ptr={ptr:?} bytes={bytes}")]);
        assert_eq!(lines.len(), 1, "one cuMemFree of {ptr:?}: {lines:?}");
        assert!(
            !lines[0].contains(" sa-reactor-"),
            "cuMemFree ran on the reactor thread: {}",
            lines[0]
        );
        assert!(
            lines[0].contains(" sa-blocking-"),
            "cuMemFree did not run on the device's blocking-work thread: {}",
            lines[0]
        );
    }
}
