//! The completion reactor: one thread per device that turns finished events into wakeups.
//!
//! Futures and deferred frees hand it the events they wait on (`watch`). The reactor keeps them
//! in one queue per stream, ordered by record sequence: events of one stream complete in order,
//! so it only asks the device about each queue's head. When a head completes it wakes the
//! waiters and runs the callbacks ([`Completion::complete`]) on this thread, never in a driver
//! callback. The order by sequence number is only right if the numbers follow the order in
//! which the records reach the GPU: `Stream::record` takes its number under the same lock as
//! the driver's record.
//!
//! # What runs on this thread, and what must not
//! (The user's side of this is in the crate docs, "The completion reactor thread".)
//! - Wakers and callbacks: other people's code. Each runs under `catch_unwind`
//!   ([`Completion::complete`]); a panic is logged at error level with what ran and the event,
//!   and the rest run. Each turn of the loop is guarded as well (`run`), so no panic ends the
//!   thread while wakeups or deferred frees are pending.
//! - Nothing that blocks: every wakeup of the device waits for it. A callback whose work is a
//!   blocking driver call (`cuMemFree` of a deferred free into `CudaResource` or
//!   `ManagedResource`) hands it to the device's blocking-work thread: [`Reactor::offload`],
//!   through `device::run_blocking`, which knows this thread by a thread-local mark set in
//!   `run`. What the reactor itself calls is non-blocking: `cuEventQuery`, and for doorbells
//!   `cuStreamWaitEvent` and `cuLaunchHostFunc` on watcher streams.
//! - In a driver callback (the doorbell's host function): only the bell's atomic swap and
//!   unpark; no CUDA call, and nothing dropped whose Drop could make one.
//!
//! How it waits, and why (figures in `benches/results/doorbell_probe.h200.txt`): on the H200 we
//! measured, every way the driver has to wake a sleeping thread (a host function, a
//! blocking-sync event) arrives 20 µs after the event at best and 250-450 µs after it once the
//! wait is longer than ~100 µs; polling `cuEventQuery` sees it within ~1 µs. So the reactor
//! polls while events are pending, and the device's [`WakeStrategy`](crate::WakeStrategy)
//! says when:
//! - nothing to watch: the thread parks with no timeout and burns no CPU (every strategy);
//! - `Predict` (the default, issue 18): each stream's history (`predict.rs`) predicts when its
//!   oldest watched event completes; the thread sleeps until just before the prediction and
//!   polls in a hot loop through a window around it. The window's margin adapts to the late
//!   end of how far off the stream's predictions were. The thread sleeps towards a window in
//!   two stages: a coarse sleep that ends a millisecond early (`predict::SETTLE`: a long sleep
//!   on a VM can end hundreds of µs late), then short steps asked shorter by how late its short
//!   sleeps have been ending (it lowers its timer slack; a VM's idle vCPU still wakes late), so
//!   that it is awake when the window opens. With a pre-wake lead
//!   (`CudaOptions::reactor_prewake`) it also *hurries* the awaiting tasks that long before the
//!   prediction, until that long after its window: `Completion::hurry` wakes them, and every
//!   poll of theirs while hurried wakes itself again, so the runtime's worker keeps polling the
//!   event instead of parking (a parked worker takes the runtime ~140 µs to wake on the VM we
//!   measured: the runtime's cost, which this hides at the price of that worker's CPU for the
//!   lead). A head with no prediction (a new stream, or past all its windows) is polled as
//!   `Backoff` does; every head also gets a doorbell, which cuts a sleep short when an
//!   event completes well before its prediction. Each stream's clock for its next head starts
//!   at its last completion: the instant the reactor's poll found it, or, when a pre-woken task
//!   found it first, the instant that task completed it (`Completion::completed_at`), not the
//!   later one at which the reactor looked;
//! - `Backoff` (the design before issue 18): after progress or a new registration it polls the
//!   heads in a hot loop for the spin budget (CUDA default 500 µs), then between sleeps that
//!   double from 20 µs up to a cap (CUDA default 1 ms); before each sleep it arms a *doorbell*
//!   for each head: on CUDA a host function queued on a watcher stream behind the head event,
//!   which only rings the [`Bell`] (an atomic flag and an unpark: no CUDA call, and nothing
//!   dropped there whose Drop could make one);
//! - `Spin`: a hot loop while anything is pending.
//!
//! What a poll asks, on CUDA: with completion words (`CudaOptions::completion_words`, the
//! default; `device/cuda_words.rs`) the GPU writes a count of its stream's watched events into
//! a word of pinned memory of the stream right after each, and a poll of the reactor or of a
//! hurried task is a load of that word; the driver is asked (`cuEventQuery`) only every 100 µs
//! about an event whose word has not moved, which is how a failed stream's error is seen.
//! Without words every poll is a driver query, and queries from several threads at once (the
//! reactor's hot window, a hurried task, anyone else's) wait for each other in the driver:
//! on four H100 hosts the words took p99 wake-ups to the task from 13 to 63 µs down to 2 to
//! 32 µs (`BENCHMARKS.md`, issue 18). The reactor keeps one flag for them: its first poll after
//! a sleep asks the driver about heads whose word has not moved ([`Watch::query_fresh`]), since
//! a word can lag its event (work another thread queued between the record and the write) and
//! a doorbell rings on the event.
//!
//! The simulated device rings the bell itself whenever a stream reaches an event, so its
//! reactor never needs to poll, predict or time out.

use std::collections::{BTreeMap, HashMap, VecDeque};

mod predict;
#[cfg(all(test, not(streamalloc_loom)))]
mod tests;
use std::time::{Duration, Instant};

use crate::completion::Completion;
use crate::error::Result;
use crate::offload::Offload;
use crate::sync::thread::{self, Thread};
use crate::sync::{Arc, AtomicBool, Mutex, Ordering};

/// Bugs the loom models plant (`loom-tests/reactor/planted.rs`), constant off otherwise; read
/// through `planted!`.
#[cfg(streamalloc_loom)]
pub(crate) mod planted {
    use std::sync::atomic::AtomicBool;

    /// `Bell::wait` parks without first consuming a ring that came before it.
    pub(crate) static WAIT_SKIPS_FLAG: AtomicBool = AtomicBool::new(false);
    /// `Reactor::watch` rings before it pushes the event into the inbox.
    pub(crate) static RING_BEFORE_PUSH: AtomicBool = AtomicBool::new(false);
    /// `Reactor`'s Drop sets `shutdown` without ringing.
    pub(crate) static DROP_WITHOUT_RING: AtomicBool = AtomicBool::new(false);
    /// The thread exits on `shutdown` while events are still watched.
    pub(crate) static SHUTDOWN_DROPS_PENDING: AtomicBool = AtomicBool::new(false);
    /// `Bell::wait` clears the flag after parking with `swap(false, Release)`: no acquire.
    pub(crate) static CLEAR_WITHOUT_ACQUIRE: AtomicBool = AtomicBool::new(false);
}

/// Something the reactor can watch: a recorded event.
pub(crate) trait Watch: Send + Sync {
    /// The unique id of the stream it was recorded on.
    fn stream_id(&self) -> u64;
    /// Its place in that stream's record order.
    fn seq(&self) -> u64;
    /// Asks the device, without blocking: `None` while the stream has not reached it. With a
    /// completion word (CUDA), a load, and a driver query at most every 100 µs.
    fn query(&self) -> Option<Result<()>>;
    /// [`query`](Self::query), asking the driver whenever a completion word has not moved: for
    /// the first poll after a sleep (a doorbell rang, or the sleep ended). The word can lag the
    /// event by work another thread queued between the two, and the doorbell rings on the
    /// event: a rate-limited poll would consume the ring and sleep on (a review's finding).
    fn query_fresh(&self) -> Option<Result<()>> {
        self.query()
    }
    /// Blocks until the device has reached it, by a path other than [`query`](Self::query)
    /// (CUDA: `cuEventSynchronize`; the simulated device: its marker's wait), and returns its
    /// result. Only for the blocking-work thread, when the reactor's query of the event
    /// panicked ([`settle_after_panic`]).
    fn wait_blocking(&self) -> Result<()>;
    /// Its shared completion state.
    fn completion(&self) -> &Completion;
    /// Whether the stream it was recorded on still exists. For one that is gone (forgotten, or
    /// about to be), doorbells keep nothing per stream: the reactor polls its events instead.
    fn stream_alive(&self) -> bool {
        true
    }
    /// The CUDA event behind it, for a doorbell; `None` on the simulated device. cudarc's raw
    /// handle, not the device layer's wrapper: the reactor sits below the device and names
    /// nothing of it.
    fn raw_cuda_event(&self) -> Option<cudarc::driver::sys::CUevent> {
        None
    }
}

/// What the reactor holds while it watches. A box, not an `Arc<dyn Watch>`: loom's `Arc` cannot
/// be coerced to a trait object, so each caller boxes its own handle (an `Arc` of its event).
pub(crate) type Watched = Box<dyn Watch>;

impl<T: Watch + ?Sized> Watch for Arc<T> {
    fn stream_id(&self) -> u64 {
        (**self).stream_id()
    }

    fn stream_alive(&self) -> bool {
        (**self).stream_alive()
    }

    fn seq(&self) -> u64 {
        (**self).seq()
    }

    fn query(&self) -> Option<Result<()>> {
        (**self).query()
    }

    fn query_fresh(&self) -> Option<Result<()>> {
        (**self).query_fresh()
    }

    fn wait_blocking(&self) -> Result<()> {
        (**self).wait_blocking()
    }

    fn completion(&self) -> &Completion {
        (**self).completion()
    }

    fn raw_cuda_event(&self) -> Option<cudarc::driver::sys::CUevent> {
        (**self).raw_cuda_event()
    }
}

/// What the reactor needs from a device to sleep well.
pub(crate) trait Doorbells: Send + 'static {
    /// Runs once on the reactor thread before its loop (CUDA: make the context current).
    fn start(&mut self) {}
    /// How long to poll in a hot loop after the last progress or registration.
    fn spin(&self) -> Duration;
    /// The longest sleep between polls while events are pending; `None` to sleep until the bell
    /// rings (for devices whose every completion rings it).
    fn max_sleep(&self) -> Option<Duration>;
    /// Whether to predict completions from each stream's history and sleep until just before
    /// them ([`WakeStrategy::Predict`](crate::WakeStrategy::Predict)).
    fn predict(&self) -> bool {
        false
    }
    /// While predicting: how long before a predicted completion to hurry the awaiting tasks
    /// (`Completion::hurry`).
    fn prewake(&self) -> Option<Duration> {
        None
    }
    /// Arranges for `bell` to ring once `head` completes (or at once if it already has).
    /// Returns false if it could not; the reactor then parks with a short timeout instead.
    fn arm(&mut self, head: &dyn Watch, bell: &Arc<Bell>) -> bool;
    /// The stream `stream` was dropped: release what was kept for it.
    fn forget(&mut self, stream: u64);
}

/// Wakes the reactor thread. Cheap enough to ring from a driver callback: one atomic swap, and
/// an unpark only when the flag was clear.
#[derive(Debug)]
pub(crate) struct Bell {
    notified: AtomicBool,
    /// The reactor thread, set by that thread when it starts. A ring before that sets the flag,
    /// which the thread checks before it first parks.
    thread: Mutex<Option<Thread>>,
}

impl Bell {
    pub(crate) fn new() -> Self {
        Self {
            notified: AtomicBool::new(false),
            thread: Mutex::new(None),
        }
    }

    pub(crate) fn ring(&self) {
        if !self.notified.swap(true, Ordering::AcqRel) {
            if let Some(thread) = &*self.thread.lock() {
                thread.unpark();
            }
        }
    }

    /// Parks until rung (or, with a timeout, until it passes). May return spuriously.
    fn wait(&self, timeout: Option<Duration>) {
        if !planted!(WAIT_SKIPS_FLAG) && self.notified.swap(false, Ordering::AcqRel) {
            return;
        }
        match timeout {
            None => thread::park(),
            Some(t) => thread::park_timeout(t),
        }
        // An acquiring RMW, not a store: it must see what every ringer released (a ring that
        // found the flag set did not unpark us), and a store would let a later ring read a
        // stale `true` (loom-tests/README.md, "Findings").
        let clear = if planted!(CLEAR_WITHOUT_ACQUIRE) {
            Ordering::Release
        } else {
            Ordering::AcqRel
        };
        self.notified.swap(false, clear);
    }
}

#[derive(Default)]
struct Inbox {
    /// Each with when it was handed over, while predicting.
    watch: Vec<(Watched, Option<Instant>)>,
    forget: Vec<u64>,
    shutdown: bool,
}

struct Shared {
    inbox: Mutex<Inbox>,
    /// Whether the loop predicts (then `watch` notes the time).
    predict: bool,
    bell: Arc<Bell>,
}

/// The handle a device keeps. Dropping it stops the thread once nothing is left to watch (and
/// the blocking-work thread once its queue is empty).
pub(crate) struct Reactor {
    shared: Arc<Shared>,
    /// Blocking work handed off the reactor thread (see `offload.rs`); shared with the loop,
    /// which hands it the events whose query panicked.
    offload: Arc<Offload>,
    /// No thread runs the loop ([`threadless`](Self::threadless)): `watch` asks the event
    /// itself.
    threadless: bool,
}

impl std::fmt::Debug for Reactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reactor").finish_non_exhaustive()
    }
}

impl Reactor {
    /// Starts the reactor thread, `name`. An [`Error::Io`](crate::Error::Io) if the
    /// operating system cannot start it.
    pub(crate) fn start(name: String, doorbells: impl Doorbells) -> Result<Self> {
        Self::start_with(name, doorbells, |name, run| {
            thread::Builder::new().name(name).spawn(run).map(drop)
        })
    }

    /// [`start`](Self::start), starting the thread with `spawn` (a test's seam: a refusal by
    /// the OS).
    pub(crate) fn start_with(
        name: String,
        doorbells: impl Doorbells,
        spawn: impl FnOnce(String, Box<dyn FnOnce() + Send>) -> std::io::Result<()>,
    ) -> Result<Self> {
        let shared = Arc::new(Shared {
            inbox: Mutex::new(Inbox::default()),
            predict: doorbells.predict(),
            bell: Arc::new(Bell::new()),
        });
        let theirs = shared.clone();
        let offload = Arc::new(Offload::new(blocking_name(&name)));
        let loop_offload = offload.clone();
        spawn(
            name.clone(),
            Box::new(move || run(theirs, doorbells, loop_offload)),
        )
        .map_err(|e| {
            tracing::error!(error = %e, thread = %name, "the OS could not start the completion reactor thread");
            crate::error::Error::io("starting the device's completion reactor thread (sa-reactor-N)", &e)
        })?;
        Ok(Self {
            shared,
            offload,
            threadless: false,
        })
    }

    /// A reactor with no thread, for an inline simulated device whose reactor thread the OS
    /// refused (`Device::reactor`). Such a device's events are complete when recorded (their
    /// stream runs each operation as it is queued), so `watch` completes an event at its first
    /// look, here, as the thread's first poll would; the blocking-work queue works as ever
    /// (its own thread, or in place if the OS refuses that too).
    pub(crate) fn threadless(name: String) -> Self {
        Self {
            shared: Arc::new(Shared {
                inbox: Mutex::new(Inbox::default()),
                predict: false,
                bell: Arc::new(Bell::new()),
            }),
            offload: Arc::new(Offload::new(blocking_name(&name))),
            threadless: true,
        }
    }

    /// Runs `job` on the device's blocking-work thread, started on first use, after every job
    /// handed over before it; never blocks on it. For blocking driver calls that work on the
    /// reactor thread would otherwise make (`device::run_blocking` decides). `what` names the
    /// job in logs.
    pub(crate) fn offload(&self, what: &'static str, job: crate::offload::Job) {
        self.offload.run(what, job);
    }

    /// How many jobs wait on the blocking-work thread, not started (see
    /// [`offload`](Self::offload)): for tests.
    #[cfg(all(test, not(streamalloc_loom)))]
    pub(crate) fn queued_jobs(&self) -> usize {
        self.offload.queued()
    }

    /// The bell a device rings when one of its streams reaches an event.
    pub(crate) fn bell(&self) -> Arc<Bell> {
        self.shared.bell.clone()
    }

    /// Watch `event` until it completes. Call once per event (see [`Registration`]).
    ///
    /// [`Registration`]: crate::completion::Registration
    pub(crate) fn watch(&self, event: impl Watch + 'static) {
        if self.threadless {
            return watch_in_place(Box::new(event));
        }
        let at = self.shared.predict.then(Instant::now);
        if planted!(RING_BEFORE_PUSH) {
            self.shared.bell.ring();
        }
        self.shared.inbox.lock().watch.push((Box::new(event), at));
        if !planted!(RING_BEFORE_PUSH) {
            self.shared.bell.ring();
        }
    }

    /// The stream `id` is gone; the backend may drop what it kept for it.
    pub(crate) fn forget_stream(&self, id: u64) {
        // No loop keeps anything for a stream, and none would drain the list: it grew by a
        // stream for every stream dropped, for the device's life (a review's finding).
        if self.threadless {
            return;
        }
        self.shared.inbox.lock().forget.push(id);
        self.shared.bell.ring();
    }
}

impl Drop for Reactor {
    fn drop(&mut self) {
        self.shared.inbox.lock().shutdown = true;
        if !planted!(DROP_WITHOUT_RING) {
            self.shared.bell.ring();
        }
    }
}

/// `sa-reactor-N` → `sa-blocking-N`: never a name that starts with `sa-reactor`.
fn blocking_name(name: &str) -> String {
    match name.strip_prefix("sa-reactor") {
        Some(rest) => format!("sa-blocking{rest}"),
        None => format!("sa-blocking ({name})"),
    }
}

/// A threadless reactor's `watch` ([`Reactor::threadless`]): asks the event once and completes
/// it. One that is not done yet (none of an inline device's) cannot be polled by anyone: it is
/// logged at error level and dropped, and its waiters wait on (a hang, never a free too early).
/// A query that panics is caught, as the reactor's thread catches it (`poll_heads`), and the
/// event is settled in place the way the blocking-work thread settles it there
/// ([`settle_after_panic`]): the panic would otherwise unwind into whoever handed the event
/// over (a buffer's drop recording its last use), and the event's deferred frees would never
/// run.
fn watch_in_place(event: Watched) {
    let id = Some((event.stream_id(), event.seq()));
    let asked = crate::completion::catch_unwind(|| event.query());
    match asked {
        Ok(Some(result)) => {
            event.completion().complete_for(result, id);
        }
        Err(payload) => {
            tracing::error!(
                stream = event.stream_id(),
                seq = event.seq(),
                panic = crate::completion::panic_message(&*payload),
                "an event's query panicked on a reactor with no thread; waiting for it in place"
            );
            settle_after_panic(event);
        }
        Ok(None) => tracing::error!(
            stream = event.stream_id(),
            seq = event.seq(),
            "an event not yet complete was handed to a device's reactor that has no thread (the \
             OS refused it); nothing will complete it"
        ),
    }
}

/// The blocking-work thread's end of an event whose query panicked on the reactor
/// (`poll_heads`): waits for the device by its other path ([`Watch::wait_blocking`]) and
/// completes the event with what it says, which wakes its tasks and runs its deferred frees,
/// now that the GPU is known to be done (the queue's other jobs wait behind it: a free delayed,
/// never one run early). Should that panic too, nothing says whether the GPU is done with the
/// memory of the event's callbacks: the event fails for its tasks, so that they wake with an
/// error rather than hang, and its callbacks are withheld, never run (their memory is
/// leaked, logged at error level), as a buffer whose uses could not be recorded is: a free
/// under running work would be worse than the leak.
fn settle_after_panic(event: Watched) {
    let (stream, seq) = (event.stream_id(), event.seq());
    match crate::completion::catch_unwind(|| event.wait_blocking()) {
        Ok(result) => {
            tracing::warn!(
                stream,
                seq,
                ok = result.is_ok(),
                "an event whose query panicked was waited for on the blocking-work thread"
            );
            event.completion().complete_for(result, Some((stream, seq)));
        }
        Err(payload) => {
            let withheld = event.completion().fail_withholding_callbacks(
                crate::error::Error::InvalidArgument {
                    what: "the device's query and wait of this event both panicked (a bug in \
                           streamalloc's device layer); its deferred frees were withheld",
                },
                Some((stream, seq)),
            );
            tracing::error!(
                stream,
                seq,
                withheld,
                panic = crate::completion::panic_message(&*payload),
                "the blocking wait for an event whose query panicked panicked too; its tasks \
                 get an error and its deferred frees never run (their memory is leaked, not \
                 freed under work that may still use it)"
            );
        }
    }
}

/// A watched event and, when predicting, when it was registered.
struct Entry {
    event: Watched,
    watched: Option<Instant>,
}

/// One stream's watched events, in record order.
#[derive(Default)]
struct StreamQueue {
    events: VecDeque<Entry>,
    /// The sequence number of the head a doorbell is armed for.
    armed: Option<u64>,
    /// The sequence number of the head whose tasks are hurried (`Completion::hurry`).
    hurried: Option<u64>,
}

impl StreamQueue {
    /// Stops hurrying the tasks of the event hurried, if any, and if it is still watched. Not
    /// always the head: an event of a lower number registered later goes in front of it.
    fn unhurry(&mut self) {
        if let Some(seq) = self.hurried.take() {
            if let Some(entry) = self.events.iter().find(|e| e.event.seq() == seq) {
                entry.event.completion().hurry(false);
            }
        }
    }
}

/// The most streams' histories the predicting reactor keeps before it forgets those of streams
/// with nothing pending.
const MAX_HISTORIES: usize = 1024;

/// The first sleep between polls after the hot spin; each further one doubles, up to the cap.
const FIRST_SLEEP: Duration = Duration::from_micros(20);
/// A sleep shorter than this is not worth a context switch: poll instead.
const MIN_SLEEP: Duration = Duration::from_micros(5);
/// The longest sleep towards a prediction while every head has a doorbell armed: a backstop,
/// should the doorbells never ring.
const LONG_SLEEP: Duration = Duration::from_millis(100);
/// The `tracing` target of the predicting reactor's trace-level measurements, one event per
/// completion it compares with its prediction (`error_ns`: completion minus nearest predicted
/// completion; `own`: whether the reactor's poll found it, else the completing thread's stamp
/// is used; `margin_ns`) and one per timed sleep (`asked_ns`, `slept_ns`, `kind`: `coarse`,
/// `step`, `backoff` or `cap`). Off unless a subscriber enables this target at trace level
/// (`benches/event_latency.rs` does): then a callsite check each, nothing more.
pub(crate) const STATS: &str = "streamalloc::reactor::stats";

fn run(shared: Arc<Shared>, mut doorbells: impl Doorbells, offload: Arc<Offload>) {
    crate::offload::mark_reactor_thread();
    *shared.bell.thread.lock() = Some(thread::current());
    doorbells.start();
    let predict = doorbells.predict();
    if predict {
        predict::lower_timer_slack();
    }
    let mut state = Loop {
        spin: doorbells.spin(),
        max_sleep: doorbells.max_sleep(),
        predict,
        prewake: doorbells.prewake(),
        doorbells,
        queues: BTreeMap::new(),
        history: HashMap::new(),
        oversleep: predict::Oversleep::default(),
        hot_since: None,
        fresh: false,
        sleep: FIRST_SLEEP,
        offload,
    };
    loop {
        // Wakers and callbacks are guarded one by one (`Completion::complete`); this catches
        // anything else, so that the thread, and with it every pending wakeup and deferred free
        // of the device, outlives a panic. The queues stay as they were: an event the panic
        // interrupted is polled again on the next turn.
        match crate::completion::catch_unwind(|| state.turn(&shared)) {
            Ok(Turn::Again) => {}
            Ok(Turn::Exit) => return,
            Err(payload) => {
                tracing::error!(
                    panic = crate::completion::panic_message(&*payload),
                    thread = std::thread::current().name().unwrap_or("<unnamed>"),
                    "the completion reactor caught a panic in its loop and goes on"
                );
                // Should the same panic come back on every turn, this keeps it from spinning.
                shared.bell.wait(Some(Duration::from_millis(1)));
            }
        }
    }
}

/// What the loop does after a turn.
enum Turn {
    Again,
    Exit,
}

/// The reactor thread's state between turns of its loop.
struct Loop<D> {
    doorbells: D,
    spin: Duration,
    max_sleep: Option<Duration>,
    /// [`WakeStrategy::Predict`](crate::WakeStrategy::Predict). Time is only read when this is
    /// on or spinning is, so that a loom model (neither) stays deterministic.
    predict: bool,
    /// How long before a predicted completion the awaiting tasks are hurried.
    prewake: Option<Duration>,
    queues: BTreeMap<u64, StreamQueue>,
    /// Per stream, while predicting; dropped when the stream is.
    history: HashMap<u64, predict::History>,
    oversleep: predict::Oversleep,
    hot_since: Option<Instant>,
    sleep: Duration,
    /// The thread slept since its last poll: the next one asks the driver about every head
    /// whose completion word has not moved ([`Watch::query_fresh`]).
    fresh: bool,
    /// The device's blocking-work queue, where events whose query panicked are waited for
    /// ([`settle_after_panic`]).
    offload: Arc<Offload>,
}

/// What the predictions ask of this turn.
#[derive(Default)]
struct Plans {
    /// Some head is inside a hot window.
    hot: bool,
    /// Some head has no prediction: the backoff rules apply to the turn.
    unpredicted: bool,
    /// The earliest instant at which a plan changes (a window opens, a hurry starts or ends).
    next: Option<Instant>,
}

impl<D: Doorbells> Loop<D> {
    /// Takes new registrations, completes what the device reports done, then spins, sleeps or
    /// parks. `Exit` once shut down with nothing left to watch.
    fn turn(&mut self, shared: &Shared) -> Turn {
        let (new, forget, shutdown) = {
            let mut inbox = shared.inbox.lock();
            (
                std::mem::take(&mut inbox.watch),
                std::mem::take(&mut inbox.forget),
                inbox.shutdown,
            )
        };
        let registered = !new.is_empty();
        for (event, watched) in new {
            let queue = self.queues.entry(event.stream_id()).or_default();
            let at = queue
                .events
                .partition_point(|e| e.event.seq() < event.seq());
            queue.events.insert(at, Entry { event, watched });
        }
        for stream in forget {
            self.doorbells.forget(stream);
            self.history.remove(&stream);
        }
        if planted!(SHUTDOWN_DROPS_PENDING) && shutdown {
            return Turn::Exit;
        }

        let history = self.predict.then_some(&mut self.history);
        let mut abandoned = Vec::new();
        let progressed = poll_heads(
            &mut self.queues,
            history,
            std::mem::take(&mut self.fresh),
            &mut abandoned,
        );
        for event in abandoned {
            self.offload.run(
                "wait for an event whose query panicked",
                Box::new(move || settle_after_panic(event)),
            );
        }
        if self.history.len() > MAX_HISTORIES {
            // Streams dropped while their events were pending teach a history after their
            // `forget` (stream ids are never reused, so nothing would remove it): keep only
            // the streams with events pending; the others learn again if they come back.
            let queues = &self.queues;
            self.history.retain(|stream, _| queues.contains_key(stream));
        }
        if self.queues.is_empty() {
            if shutdown {
                return Turn::Exit;
            }
            self.hot_since = None;
            shared.bell.wait(None);
            self.fresh = true;
            return Turn::Again;
        }
        if progressed || registered {
            self.sleep = FIRST_SLEEP;
            self.hot_since = (self.spin > Duration::ZERO).then(Instant::now);
        }
        let plans = if self.predict {
            self.plan()
        } else {
            Plans {
                unpredicted: true,
                ..Plans::default()
            }
        };
        if plans.hot {
            std::hint::spin_loop();
            return Turn::Again;
        }
        if plans.unpredicted {
            if let Some(since) = self.hot_since {
                if since.elapsed() < self.spin {
                    std::hint::spin_loop();
                    return Turn::Again;
                }
                self.hot_since = None;
            } else if progressed {
                return Turn::Again;
            }
        }

        let mut all_armed = true;
        for queue in self.queues.values_mut() {
            if let Some(head) = queue.events.front() {
                if queue.armed != Some(head.event.seq()) {
                    if self.doorbells.arm(&*head.event, &shared.bell) {
                        queue.armed = Some(head.event.seq());
                    } else {
                        all_armed = false;
                    }
                }
            }
        }
        // Predicting, a head with no prediction (a new stream's) is polled between sleeps that
        // double up to the cap; once they have reached it with every head's doorbell armed, the
        // doorbells wake the thread, `LONG_SLEEP` the backstop, as for predicted heads. Polling
        // on at the cap only backed up doorbells that ring on the event anyway, and cost the
        // first round of new streams some 800 wakes a second: 26 to 31 ms of CPU a second with
        // 1,000 events pending, against 7 to 9 so (an H200, run107).
        let doorbells_only =
            self.predict && all_armed && self.max_sleep.is_some_and(|cap| self.sleep >= cap);
        let backing_off = plans.unpredicted && !doorbells_only;
        let mut timeout = match self.max_sleep {
            Some(cap) if backing_off => {
                let sleep = self.sleep.min(cap);
                // Saturating: a cap of `Duration::MAX` (a user's "no cap") lets the doubling
                // pass `Duration::MAX / 2`, and a product that panicked would do so on every
                // turn (the loop catches it, logs it and retries a millisecond later).
                self.sleep = self.sleep.saturating_mul(2).min(cap);
                Some(sleep)
            }
            Some(cap) if !all_armed => Some(cap),
            Some(_) => Some(LONG_SLEEP),
            None if all_armed => None,
            None => Some(Duration::from_millis(1)),
        };
        // For the trace: a backoff sleep, or the longest sleep allowed (`max_sleep` while a
        // doorbell is missing, else `LONG_SLEEP`).
        let mut kind = if backing_off { "backoff" } else { "cap" };
        if let Some(next) = plans.next {
            // Towards `next` in two stages (`predict::sleep_toward`): a coarse sleep that ends
            // well before it, then steps that end at it once the usual lateness of a short
            // sleep is added; nearer than a step is worth, keep polling.
            let until = next.saturating_duration_since(Instant::now());
            let (asked, coarse) = predict::sleep_toward(until, &self.oversleep);
            if asked < MIN_SLEEP {
                std::hint::spin_loop();
                return Turn::Again;
            }
            if timeout.is_none_or(|t| asked < t) {
                timeout = Some(asked);
                kind = if coarse { "coarse" } else { "step" };
            }
        }
        match (self.predict, timeout) {
            (true, Some(asked)) => {
                let before = Instant::now();
                shared.bell.wait(Some(asked));
                let slept = before.elapsed();
                self.oversleep.slept(asked, slept);
                tracing::trace!(
                    target: STATS,
                    asked_ns = asked.as_nanos() as u64,
                    slept_ns = slept.as_nanos() as u64,
                    kind,
                    "timed sleep"
                );
            }
            (_, timeout) => shared.bell.wait(timeout),
        }
        self.fresh = true;
        Turn::Again
    }

    /// Each head against its stream's predictions: which are hot, which have none, when the
    /// next plan changes; hurries (or stops hurrying) the tasks of heads near their predicted
    /// completion.
    fn plan(&mut self) -> Plans {
        let now = Instant::now();
        let mut plans = Plans::default();
        let mut soonest = |at: Instant| {
            plans.next = Some(plans.next.map_or(at, |n: Instant| n.min(at)));
        };
        let mut hot = false;
        let mut unpredicted = false;
        for (stream, queue) in &mut self.queues {
            let Some(head_seq) = queue.events.front().map(|h| h.event.seq()) else {
                continue;
            };
            // A hurried event that is no longer the head (one of a lower number was registered
            // after it) must not stay hurried until it completes: its task would poll itself
            // all that time, a worker's whole CPU.
            if queue.hurried.is_some_and(|seq| seq != head_seq) {
                queue.unhurry();
            }
            let Some(history) = self.history.get(stream) else {
                // No history (a new stream, or one dropped since): no pre-wake either. A head
                // hurried before its stream's history went must not stay hurried, or its task
                // would poll itself until the GPU gets there.
                queue.unhurry();
                unpredicted = true;
                continue;
            };
            let Some(head) = queue.events.front() else {
                continue;
            };
            let start = history.start(head.watched.unwrap_or(now));
            let margin = history.margin();
            match history.plan(start, now, margin) {
                predict::Plan::None => unpredicted = true,
                predict::Plan::Hot { .. } => hot = true,
                predict::Plan::Ahead { wake, .. } => soonest(wake),
            }
            if let Some(lead) = self.prewake {
                let (want, change) = history.hurry(start, now, lead, margin);
                let seq = head.event.seq();
                if want != (queue.hurried == Some(seq)) {
                    head.event.completion().hurry(want);
                    queue.hurried = want.then_some(seq);
                }
                if let Some(at) = change {
                    soonest(at);
                }
            }
        }
        plans.hot = hot;
        plans.unpredicted = unpredicted;
        plans
    }
}

/// Completes every head that the device reports done; returns whether any was, or was
/// abandoned. While predicting (`history`), each completion teaches its stream's history. A
/// head whose query panics is taken off its queue into `abandoned`, for the blocking-work
/// thread to wait for ([`settle_after_panic`]).
fn poll_heads(
    queues: &mut BTreeMap<u64, StreamQueue>,
    mut history: Option<&mut HashMap<u64, predict::History>>,
    fresh: bool,
    abandoned: &mut Vec<Watched>,
) -> bool {
    let now = history.is_some().then(Instant::now);
    let mut progressed = false;
    queues.retain(|&stream, queue| {
        let mut batch = false;
        while let Some(head) = queue.events.front() {
            let event = &head.event;
            // Whether this poll is what found the event complete. One that another thread
            // completed first (a pre-woken task polls its event itself) was done some time
            // before we looked: its time says only that it is done by `now`, and learning it
            // as a service time would move the next prediction late, and every later one with
            // it (the pre-wake then starts after the completion, and the task learns it from
            // the reactor, later still).
            let mut seen_here = false;
            if event.completion().result().is_none() {
                let answer = crate::completion::catch_unwind(|| {
                    if fresh {
                        event.query_fresh()
                    } else {
                        event.query()
                    }
                });
                let answer = match answer {
                    Ok(answer) => answer,
                    Err(payload) => {
                        // A bug in a device's query path. Caught here, per event, not by the
                        // loop: that left every later stream unpolled with it. The event is
                        // not completed with an error here: its callbacks (deferred frees,
                        // staging blocks) take any result as the GPU being done with their
                        // memory, and nothing says it is. Nor is it polled again: a query that
                        // panics once may panic on every turn, and its frees would be stuck
                        // for good (the memory lost). It is handed to the blocking-work
                        // thread, which waits for the device by its other path and completes
                        // it with what that says (`settle_after_panic`). Its tasks are woken
                        // now, to ask the device themselves rather than wait for that.
                        let seq = event.seq();
                        tracing::error!(
                            stream,
                            seq,
                            panic = crate::completion::panic_message(&*payload),
                            "the completion reactor's query of an event panicked; the event is \
                             handed to the blocking-work thread, which waits for it, and its \
                             tasks were woken"
                        );
                        event.completion().wake_waiters();
                        // No longer planned for (`Loop::plan` only sees queued heads), so
                        // nothing would end its hurry: its tasks would wake themselves on
                        // every poll until the blocking wait completes it.
                        if queue.hurried == Some(seq) {
                            queue.hurried = None;
                            event.completion().hurry(false);
                        }
                        if let Some(entry) = queue.events.pop_front() {
                            abandoned.push(entry.event);
                        }
                        progressed = true;
                        // The next head is the next event of the stream: it has a query of
                        // its own.
                        continue;
                    }
                };
                match answer {
                    Some(result) => {
                        seen_here = true;
                        event
                            .completion()
                            .complete_for(result, Some((event.stream_id(), event.seq())));
                    }
                    None => break,
                }
            }
            if let (Some(history), Some(now)) = (history.as_deref_mut(), now) {
                let history = history.entry(stream).or_default();
                let start = history.start(head.watched.unwrap_or(now));
                // When it was done: now, if this poll found it; else when the thread that
                // completed it did (a pre-woken task polling its event: within µs of the GPU),
                // and never later than now. The next head's clock starts there: the time we
                // looked would start it late, and with it the next prediction and pre-wake.
                let done = if seen_here {
                    now
                } else {
                    event
                        .completion()
                        .completed_at()
                        .map_or(now, |at| at.min(now))
                };
                if !batch {
                    if let Some(error_ns) = history.error(start, done) {
                        tracing::trace!(
                            target: STATS,
                            stream,
                            error_ns,
                            own = seen_here,
                            margin_ns = history.margin().as_nanos() as u64,
                            "completion against its prediction"
                        );
                    }
                }
                history.completed(start, done, batch || !seen_here);
            }
            batch = true;
            queue.events.pop_front();
            progressed = true;
        }
        !queue.events.is_empty()
    });
    progressed
}
