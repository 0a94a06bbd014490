//! Models of the completion reactor (src/reactor.rs) with a fake device: an event future
//! registers with a running reactor thread while a "GPU" thread reaches the event and rings the
//! bell, as the simulated device does (`SimMarker::complete` stores the result, then
//! `bell.ring()`; `SimDoorbells` has no spin, no timed sleep, and `arm` does nothing).
//!
//! What must hold in every interleaving: every event completes, every waiting future resolves
//! (a lost wakeup leaves `block_on` or the reactor parked forever: loom reports "deadlock"),
//! deferred callbacks run even when the reactor is dropped first, and the reactor thread exits
//! once it is dropped and nothing is pending (loom requires every thread to finish).
//!
//! # Which reactor
//! The crate's `Reactor` cannot be checked by loom 0.7.2 as it is written: two loom bugs make
//! it report failures that no real execution has (README.md, "Loom incompatibilities"):
//! - tokio-rs/loom#249: loom's `Thread::unpark` wakes a thread that is blocked on a *mutex*
//!   (not parked) and drops the token; `Bell::ring` unparks the reactor whenever it rings, and
//!   the reactor is often inside a lock then ("expected to be able to acquire lock", or a
//!   deadlock when the token was needed);
//! - tokio-rs/loom#254: a plain `store` racing a `swap` on one atomic can squeeze between the
//!   swap's read and write; `Bell::wait` clears the flag with `store(false)` after parking while
//!   ringers `swap(true)`, so loom "loses" rings.
//!
//! So the models run by default drive [`mirror::Reactor`], a copy of `Bell`, `Reactor`, `run`
//! and `poll_heads` as the simulated device uses them (no spin, no timed sleep, nothing to arm)
//! that differs from src in exactly two places: it parks through a mutex-and-condvar
//! [`mirror::Parker`] with std's one-token semantics (#249), and `Bell::wait` clears the flag
//! after parking with `swap(false, AcqRel)` instead of `store(false, Release)` (#254; and see
//! `planted_clear_without_acquire`: with an atomic device flag the clear must also acquire).
//! The same models against the crate's `Reactor` are kept as `real_reactor_models`, ignored
//! until src or loom changes; the `loom_false_positive_*` tests pin the two loom bugs down.
//!
//! The fake device's "reached" flag is published two ways, and every model runs both:
//! - [`Publish::Mutex`], as the simulated device does (`SimMarker` keeps its result under a
//!   mutex that `query` locks);
//! - [`Publish::Atomic`], a release store / acquire load of an `AtomicBool`: the weakest
//!   publication a backend could use.
//!
//! Threads: the model's main thread (the task), the reactor thread and the GPU thread; 4 in
//! `two_waiters_one_event`. Preemption bounds are given per test; each test runs in seconds.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use loom::future::block_on;
use loom::thread;

use super::{check, must_fail, CountingWaker};
use crate::completion::{Completion, Registration};
use crate::error::Result;
use crate::reactor::{Bell, Doorbells, Reactor, Watch};
use crate::sync::{Arc, AtomicBool, AtomicUsize, Mutex, Ordering};

/// How the fake GPU publishes that it reached an event.
#[derive(Clone, Copy, Debug)]
enum Publish {
    /// Under a mutex, as `SimMarker` does.
    Mutex,
    /// With a release store that `query` reads with an acquire load.
    Atomic,
}

/// The fake device's side of one event: whether the GPU reached it.
struct Marker {
    publish: Publish,
    locked: Mutex<bool>,
    flag: AtomicBool,
}

impl Marker {
    fn new(publish: Publish) -> Arc<Marker> {
        Arc::new(Marker {
            publish,
            locked: Mutex::new(false),
            flag: AtomicBool::new(false),
        })
    }

    /// The GPU reaches the marker.
    fn reach(&self) {
        match self.publish {
            Publish::Mutex => *self.locked.lock() = true,
            Publish::Atomic => self.flag.store(true, Ordering::Release),
        }
    }

    fn reached(&self) -> bool {
        match self.publish {
            Publish::Mutex => *self.locked.lock(),
            Publish::Atomic => self.flag.load(Ordering::Acquire),
        }
    }
}

/// A recorded event of the fake device.
struct FakeEvent {
    stream: u64,
    seq: u64,
    marker: Arc<Marker>,
    completion: Completion,
}

impl Watch for FakeEvent {
    fn stream_id(&self) -> u64 {
        self.stream
    }
    fn seq(&self) -> u64 {
        self.seq
    }
    fn query(&self) -> Option<Result<()>> {
        self.marker.reached().then_some(Ok(()))
    }
    fn completion(&self) -> &Completion {
        &self.completion
    }
}

/// A handle of a fake event, as `Event` holds its `Arc<EventInner>`.
type Ev = Arc<FakeEvent>;

fn event(stream: u64, seq: u64, marker: &Arc<Marker>) -> Ev {
    Arc::new(FakeEvent {
        stream,
        seq,
        marker: marker.clone(),
        completion: Completion::new(),
    })
}

/// The simulated device's doorbells: no spin, no timed sleeps, nothing to arm (every marker
/// rings the bell itself).
struct FakeDoorbells;

impl Doorbells for FakeDoorbells {
    fn spin(&self) -> Duration {
        Duration::ZERO
    }
    fn max_sleep(&self) -> Option<Duration> {
        None
    }
    fn arm(&mut self, _: &dyn Watch, _: &Arc<Bell>) -> bool {
        true
    }
    fn forget(&mut self, _: u64) {}
}

/// What the models need from a reactor.
trait UnderTest: Sized + 'static {
    type Config: Copy + Send + Sync + 'static;
    type Bell: Send + Sync + 'static;
    fn start(config: Self::Config) -> Self;
    fn bell(&self) -> Arc<Self::Bell>;
    fn ring(bell: &Self::Bell);
    fn watch(&self, event: Ev);
}

impl UnderTest for Reactor {
    type Config = ();
    type Bell = Bell;
    fn start(_: ()) -> Self {
        Reactor::start("sa-reactor-loom".to_string(), FakeDoorbells)
    }
    fn bell(&self) -> Arc<Bell> {
        Reactor::bell(self)
    }
    fn ring(bell: &Bell) {
        bell.ring()
    }
    fn watch(&self, event: Ev) {
        Reactor::watch(self, event)
    }
}

/// The GPU thread: reaches each marker in order and rings the bell after each, as
/// `SimMarker::complete` does.
fn gpu<R: UnderTest>(reactor: &R, markers: Vec<Arc<Marker>>) -> thread::JoinHandle<()> {
    let bell = reactor.bell();
    thread::spawn(move || {
        for marker in markers {
            marker.reach();
            R::ring(&bell);
        }
    })
}

/// A future that waits as `Event::poll` does: the known result, else ask the device (and record
/// what it says), else register the waker, and hand the event to the reactor when told `first`.
/// Dropping it deregisters, as `Event`'s Drop does.
struct EventFuture<'r, R> {
    event: Ev,
    key: Option<usize>,
    reactor: &'r R,
}

impl<'r, R: UnderTest> EventFuture<'r, R> {
    fn new(event: &Ev, reactor: &'r R) -> Self {
        EventFuture {
            event: event.clone(),
            key: None,
            reactor,
        }
    }

    /// `EventInner::check`.
    fn check(&self) -> Option<Result<()>> {
        let completion = self.event.completion();
        if let Some(result) = completion.result() {
            return Some(result);
        }
        let result = self.event.query()?;
        completion.complete(result.clone());
        Some(result)
    }
}

impl<R: UnderTest> Future for EventFuture<'_, R> {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = self.get_mut();
        if let Some(result) = this.check() {
            return Poll::Ready(result);
        }
        match this
            .event
            .completion()
            .register_waker(&mut this.key, cx.waker())
        {
            Registration::Done(result) => Poll::Ready(result),
            Registration::Stored { first } => {
                if first {
                    this.reactor.watch(this.event.clone());
                }
                Poll::Pending
            }
        }
    }
}

impl<R> Drop for EventFuture<'_, R> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.event.completion().deregister(key);
        }
    }
}

/// `Event::on_complete`: run `callback` now if the event is done, else store it and hand the
/// event to the reactor when told `first`.
fn on_complete<R: UnderTest>(event: &Ev, reactor: &R, callback: crate::completion::Callback) {
    let completion = event.completion();
    let known = completion.result().or_else(|| {
        let result = event.query()?;
        completion.complete(result.clone());
        Some(result)
    });
    if let Some(result) = known {
        return callback(&result);
    }
    match completion.register_callback(callback) {
        Ok(Registration::Stored { first: true }) => reactor.watch(event.clone()),
        Ok(_) => {}
        Err((callback, result)) => callback(&result),
    }
}

// ---------------------------------------------------------------------------------------------
// The models.
// ---------------------------------------------------------------------------------------------

/// One event: the task awaits it while the GPU reaches it; then the reactor is dropped.
fn await_one<R: UnderTest>(config: R::Config, publish: Publish) {
    let reactor = R::start(config);
    let marker = Marker::new(publish);
    let event = event(1, 0, &marker);
    let gpu = gpu(&reactor, vec![marker]);

    assert_eq!(block_on(EventFuture::new(&event, &reactor)), Ok(()));
    assert_eq!(event.completion().result(), Some(Ok(())));
    gpu.join().unwrap();
    drop(reactor);
}

/// The task polls the event once and drops the future (cancelled) while the GPU reaches the
/// event. If the future handed it to the reactor, the reactor still completes it and exits
/// after the drop: the run only ends if it does.
fn drop_while_finishing<R: UnderTest>(config: R::Config, publish: Publish) {
    let reactor = R::start(config);
    let marker = Marker::new(publish);
    let event = event(1, 0, &marker);
    let gpu = gpu(&reactor, vec![marker]);
    {
        let (_, waker) = CountingWaker::new();
        let mut future = EventFuture::new(&event, &reactor);
        let _ = Pin::new(&mut future).poll(&mut Context::from_waker(&waker));
    }
    gpu.join().unwrap();
    drop(reactor);
}

/// Two events of one stream, reached in order; the task awaits the later one first, so the
/// earlier one is inserted before it in the reactor's queue.
fn await_two_in_order<R: UnderTest>(config: R::Config, publish: Publish) {
    let reactor = R::start(config);
    let (m0, m1) = (Marker::new(publish), Marker::new(publish));
    let (e0, e1) = (event(1, 0, &m0), event(1, 1, &m1));
    let gpu = gpu(&reactor, vec![m0, m1]);

    assert_eq!(block_on(EventFuture::new(&e1, &reactor)), Ok(()));
    assert_eq!(block_on(EventFuture::new(&e0, &reactor)), Ok(()));
    gpu.join().unwrap();
    drop(reactor);
}

/// Two tasks on two threads await the same event: only the first registration hands it to the
/// reactor, and both resolve.
fn two_waiters<R: UnderTest + Send + Sync>(config: R::Config, publish: Publish) {
    let reactor = Arc::new(R::start(config));
    let marker = Marker::new(publish);
    let event = event(1, 0, &marker);
    let other = {
        let (reactor, event) = (reactor.clone(), event.clone());
        thread::spawn(move || {
            assert_eq!(block_on(EventFuture::new(&event, &*reactor)), Ok(()));
        })
    };
    let gpu = gpu(&*reactor, vec![marker]);
    assert_eq!(block_on(EventFuture::new(&event, &*reactor)), Ok(()));
    other.join().unwrap();
    gpu.join().unwrap();
    drop(reactor);
}

/// Checks, when dropped, that the callback owning it ran (a deferred free that never runs is a
/// leak of device memory).
struct MustRun {
    ran: Arc<AtomicUsize>,
}

impl Drop for MustRun {
    fn drop(&mut self) {
        assert_eq!(
            self.ran.load(Ordering::SeqCst),
            1,
            "a deferred callback was dropped without running"
        );
    }
}

/// A deferred callback (`Event::on_complete`, how frees wait for the GPU) is registered, then
/// the reactor is dropped (the device goes away) before the GPU reaches the event. The reactor
/// must still run the callback, exactly once, before it exits.
fn callback_then_shutdown<R: UnderTest>(config: R::Config, publish: Publish) {
    let reactor = R::start(config);
    let marker = Marker::new(publish);
    let event = event(1, 0, &marker);
    let guard = MustRun {
        ran: Arc::new(AtomicUsize::new(0)),
    };
    on_complete(
        &event,
        &reactor,
        Box::new(move |result: &Result<()>| {
            assert_eq!(*result, Ok(()));
            guard.ran.fetch_add(1, Ordering::SeqCst);
        }),
    );
    let gpu = gpu(&reactor, vec![marker]);
    drop(reactor);
    gpu.join().unwrap();
}

/// Runs `model` once per way of publishing the device flag.
fn each_publish(bound: Option<usize>, model: impl Fn(Publish) + Sync + Send + 'static) {
    let model = std::sync::Arc::new(model);
    for publish in [Publish::Mutex, Publish::Atomic] {
        let model = model.clone();
        check(bound, move || model(publish));
    }
}

/// The mirror as it stands in for src (see the module docs).
const MIRROR: mirror::Config = mirror::Config {
    park: mirror::Park::Token,
    clear: mirror::Clear::SwapAcqRel,
    bug: mirror::Bug::None,
};

/// Preemption bound 3.
#[test]
fn await_one_event() {
    each_publish(Some(3), |p| await_one::<mirror::Reactor>(MIRROR, p));
}

/// Preemption bound 3.
#[test]
fn drop_future_while_event_finishes() {
    each_publish(Some(3), |p| {
        drop_while_finishing::<mirror::Reactor>(MIRROR, p)
    });
}

/// Preemption bound 3.
#[test]
fn await_two_events_of_one_stream() {
    each_publish(Some(3), |p| {
        await_two_in_order::<mirror::Reactor>(MIRROR, p)
    });
}

/// Preemption bound 2 (4 threads).
#[test]
fn two_waiters_one_event() {
    each_publish(Some(2), |p| two_waiters::<mirror::Reactor>(MIRROR, p));
}

/// Preemption bound 3.
#[test]
fn deferred_callback_survives_shutdown() {
    each_publish(Some(3), |p| {
        callback_then_shutdown::<mirror::Reactor>(MIRROR, p)
    });
}

/// The same models against the crate's `Reactor`. Under loom 0.7.2 they need what `sync` now
/// does under the cfg (park through a per-thread token: tokio-rs/loom#249) and what
/// `Bell::wait` now does (clear the flag with an acquiring swap: #254, and the lost ring that
/// `planted_clear_without_acquire` shows). Preemption bound 3 (2 for the four-thread model).
#[test]
fn real_reactor_models() {
    each_publish(Some(3), |p| await_one::<Reactor>((), p));
    each_publish(Some(3), |p| drop_while_finishing::<Reactor>((), p));
    each_publish(Some(3), |p| await_two_in_order::<Reactor>((), p));
    each_publish(Some(2), |p| two_waiters::<Reactor>((), p));
    each_publish(Some(3), |p| callback_then_shutdown::<Reactor>((), p));
}

/// The blocking-work queue (src/offload.rs), on the crate's `Offload`: two threads hand over
/// jobs (the first one starts the worker thread) while the queue's owner is dropped, as a
/// device goes away while its reactor still hands off frees. Every job runs exactly once
/// (`MustRun`), one thread's jobs in the order given, and the worker exits (loom requires every
/// thread to finish: a worker that misses the shutdown is a deadlock). Preemption bound 3.
#[test]
fn offload_jobs_vs_shutdown() {
    use crate::offload::{Job, Offload};

    fn job(after: Option<Arc<AtomicBool>>, done: Arc<AtomicBool>) -> Job {
        let guard = MustRun {
            ran: Arc::new(AtomicUsize::new(0)),
        };
        Box::new(move || {
            if let Some(before) = after {
                assert!(before.load(Ordering::SeqCst), "jobs out of order");
            }
            done.store(true, Ordering::SeqCst);
            guard.ran.fetch_add(1, Ordering::SeqCst);
        })
    }

    check(Some(3), || {
        let offload = Arc::new(Offload::new("sa-blocking-loom".to_string()));
        let other = {
            let offload = offload.clone();
            let late = job(None, Arc::new(AtomicBool::new(false)));
            thread::spawn(move || offload.run("loom: the other thread's job", late))
        };
        let a_done = Arc::new(AtomicBool::new(false));
        let a = job(None, a_done.clone());
        let b = job(Some(a_done), Arc::new(AtomicBool::new(false)));
        offload.run("loom: job a", a);
        offload.run("loom: job b", b);
        drop(offload);
        other.join().unwrap();
    });
}

// ---------------------------------------------------------------------------------------------
// Planted bugs: the models against the mirror with one bug each. Each must fail; they are
// ignored by default (`-- --ignored` runs them) and check how loom caught the bug.
// ---------------------------------------------------------------------------------------------

fn with_bug(bug: mirror::Bug) -> mirror::Config {
    mirror::Config { bug, ..MIRROR }
}

/// `Bell::wait` parks without first consuming a ring that came before it: a ring that found
/// the flag already set did not unpark, so nothing wakes the reactor.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_wait_skips_flag() {
    must_fail(
        module_path!(),
        "planted_wait_skips_flag",
        "deadlock; threads",
        || {
            check(Some(3), || {
                await_one::<mirror::Reactor>(with_bug(mirror::Bug::WaitSkipsFlag), Publish::Mutex)
            });
        },
    );
}

/// `Reactor::watch` rings before it pushes the event: the reactor can wake, find the inbox
/// empty and park again, and the event is never polled.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_ring_before_push() {
    must_fail(
        module_path!(),
        "planted_ring_before_push",
        "deadlock; threads",
        || {
            check(Some(3), || {
                await_one::<mirror::Reactor>(with_bug(mirror::Bug::RingBeforePush), Publish::Mutex)
            });
        },
    );
}

/// `Reactor`'s Drop sets `shutdown` without ringing: a parked reactor never exits.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_drop_without_ring() {
    must_fail(
        module_path!(),
        "planted_drop_without_ring",
        "deadlock; threads",
        || {
            check(Some(3), || {
                await_one::<mirror::Reactor>(with_bug(mirror::Bug::DropWithoutRing), Publish::Mutex)
            });
        },
    );
}

/// The thread exits on `shutdown` even while it still watches events: a deferred free
/// registered before the device was dropped never runs.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_shutdown_drops_pending() {
    must_fail(
        module_path!(),
        "planted_shutdown_drops_pending",
        "a deferred callback was dropped without running",
        || {
            check(Some(3), || {
                callback_then_shutdown::<mirror::Reactor>(
                    with_bug(mirror::Bug::ShutdownDropsPending),
                    Publish::Mutex,
                )
            });
        },
    );
}

/// `Bell::wait` clears the flag after parking with an RMW that does not acquire
/// (`swap(false, Release)`). A ring that found the flag set skipped the unpark, and the
/// reactor, not having acquired the ringer's release, reads the device flag stale and parks for
/// good. A real (C11-consistent) lost wakeup when the device publishes with an atomic; src's
/// `store(false, Release)` has the same weakness (README.md, "Findings").
#[test]
#[ignore = "planted bug: must fail"]
fn planted_clear_without_acquire() {
    must_fail(
        module_path!(),
        "planted_clear_without_acquire",
        "deadlock; threads",
        || {
            let config = mirror::Config {
                clear: mirror::Clear::SwapRelease,
                ..MIRROR
            };
            check(Some(3), move || {
                await_one::<mirror::Reactor>(config, Publish::Atomic)
            });
        },
    );
}

/// Not a bug of ours: the mirror with src's exact clear (`store(false, Release)`) and the
/// simulated device's mutex-published flag, which no C11 execution can deadlock, "deadlocks"
/// under loom 0.7.2 (tokio-rs/loom#254: the store is placed between a ringer's swap read and
/// write). Passes (loom reports the deadlock) while loom has the bug.
#[test]
#[ignore = "documents a loom 0.7.2 bug: passes while loom has it"]
fn loom_false_positive_store_races_swap() {
    must_fail(
        module_path!(),
        "loom_false_positive_store_races_swap",
        "deadlock; threads",
        || {
            let config = mirror::Config {
                clear: mirror::Clear::Store,
                ..MIRROR
            };
            check(Some(3), move || {
                await_one::<mirror::Reactor>(config, Publish::Mutex)
            });
        },
    );
}

/// Not a bug of ours: the mirror parking with loom's own `thread::park`/`unpark`, as src does,
/// fails under loom 0.7.2 (tokio-rs/loom#249: an unpark aimed at a thread blocked on a mutex
/// wakes it while the mutex is still held). Passes (loom reports the failure) while loom has
/// the bug.
#[test]
#[ignore = "documents a loom 0.7.2 bug: passes while loom has it"]
fn loom_false_positive_unpark_in_lock() {
    must_fail(
        module_path!(),
        "loom_false_positive_unpark_in_lock",
        "expected to be able to acquire lock",
        || {
            let config = mirror::Config {
                park: mirror::Park::Loom,
                ..MIRROR
            };
            check(Some(3), move || {
                await_one::<mirror::Reactor>(config, Publish::Mutex)
            });
        },
    );
}

/// A copy of src/reactor.rs's `Bell`, `Reactor`, `run` and `poll_heads`, cut down to what the
/// simulated device uses (no spin, no timed sleeps, nothing to arm, no `forget_stream`), with
/// the two loom workarounds and the planted bugs as switches. (src splits the loop body into
/// `Loop::turn`, run under `catch_unwind`, which is the identity under loom, and its `Reactor`
/// also owns the blocking-work queue; the steps of a turn are the same as here.)
mod mirror {
    use std::collections::{BTreeMap, VecDeque};

    use super::Ev;
    use crate::reactor::Watch;
    use crate::sync::{Arc, AtomicBool, Condvar, Mutex, Ordering};
    // loom's own threads, not `crate::sync::thread`: `Park::Loom` must stay loom's park even if
    // src wraps it.
    use loom::thread::{self, Thread};

    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    pub(super) struct Config {
        pub(super) park: Park,
        pub(super) clear: Clear,
        pub(super) bug: Bug,
    }

    /// How the reactor thread parks.
    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    pub(super) enum Park {
        /// loom's `thread::park` / `Thread::unpark`, as src (tokio-rs/loom#249).
        Loom,
        /// [`Parker`]: std's semantics, from a loom mutex and condvar.
        Token,
    }

    /// How `Bell::wait` clears the flag after parking.
    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    pub(super) enum Clear {
        /// `store(false, Release)`, as src (tokio-rs/loom#254).
        Store,
        /// `swap(false, Release)`: an RMW that does not acquire (planted bug).
        SwapRelease,
        /// `swap(false, AcqRel)`: the proposed fix.
        SwapAcqRel,
    }

    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    pub(super) enum Bug {
        None,
        /// `Bell::wait` parks without first consuming a ring that came before it.
        WaitSkipsFlag,
        /// `Reactor::watch` rings the bell before it pushes the event into the inbox.
        RingBeforePush,
        /// `Reactor`'s Drop sets `shutdown` without ringing the bell.
        DropWithoutRing,
        /// The thread exits on `shutdown` even while events are still watched.
        ShutdownDropsPending,
    }

    /// `std::thread::park`/`unpark` semantics (one token, kept until the next park), built from
    /// a loom mutex and condvar, so an unpark never disturbs a thread blocked elsewhere.
    #[derive(Default)]
    pub(super) struct Parker {
        token: Mutex<bool>,
        cv: Condvar,
    }

    impl Parker {
        fn park(&self) {
            let mut token = self.token.lock();
            while !*token {
                token = self.cv.wait(token);
            }
            *token = false;
        }

        fn unpark(&self) {
            *self.token.lock() = true;
            self.cv.notify_one();
        }
    }

    enum Handle {
        Loom(Thread),
        Token(Arc<Parker>),
    }

    impl Handle {
        fn unpark(&self) {
            match self {
                Handle::Loom(thread) => thread.unpark(),
                Handle::Token(parker) => parker.unpark(),
            }
        }

        fn park(&self) {
            match self {
                Handle::Loom(_) => thread::park(),
                Handle::Token(parker) => parker.park(),
            }
        }
    }

    pub(super) struct Bell {
        config: Config,
        notified: AtomicBool,
        thread: Mutex<Option<Arc<Handle>>>,
    }

    impl Bell {
        pub(super) fn ring(&self) {
            if !self.notified.swap(true, Ordering::AcqRel) {
                if let Some(thread) = &*self.thread.lock() {
                    thread.unpark();
                }
            }
        }

        fn wait(&self, me: &Handle) {
            if self.config.bug != Bug::WaitSkipsFlag && self.notified.swap(false, Ordering::AcqRel)
            {
                return;
            }
            me.park();
            match self.config.clear {
                Clear::Store => self.notified.store(false, Ordering::Release),
                Clear::SwapRelease => {
                    self.notified.swap(false, Ordering::Release);
                }
                Clear::SwapAcqRel => {
                    self.notified.swap(false, Ordering::AcqRel);
                }
            }
        }
    }

    #[derive(Default)]
    struct Inbox {
        watch: Vec<Ev>,
        shutdown: bool,
    }

    struct Shared {
        config: Config,
        inbox: Mutex<Inbox>,
        bell: Arc<Bell>,
    }

    pub(super) struct Reactor {
        shared: Arc<Shared>,
    }

    impl Reactor {
        pub(super) fn start(config: Config) -> Self {
            let shared = Arc::new(Shared {
                config,
                inbox: Mutex::new(Inbox::default()),
                bell: Arc::new(Bell {
                    config,
                    notified: AtomicBool::new(false),
                    thread: Mutex::new(None),
                }),
            });
            let theirs = shared.clone();
            thread::Builder::new()
                .name("sa-reactor-mirror".to_string())
                .spawn(move || run(theirs))
                .expect("loom could not start the thread");
            Self { shared }
        }

        pub(super) fn bell(&self) -> Arc<Bell> {
            self.shared.bell.clone()
        }

        pub(super) fn watch(&self, event: Ev) {
            if self.shared.config.bug == Bug::RingBeforePush {
                self.shared.bell.ring();
                self.shared.inbox.lock().watch.push(event);
                return;
            }
            self.shared.inbox.lock().watch.push(event);
            self.shared.bell.ring();
        }
    }

    impl Drop for Reactor {
        fn drop(&mut self) {
            self.shared.inbox.lock().shutdown = true;
            if self.shared.config.bug != Bug::DropWithoutRing {
                self.shared.bell.ring();
            }
        }
    }

    fn run(shared: Arc<Shared>) {
        let me = Arc::new(match shared.config.park {
            Park::Loom => Handle::Loom(thread::current()),
            Park::Token => Handle::Token(Arc::new(Parker::default())),
        });
        *shared.bell.thread.lock() = Some(me.clone());
        let mut queues: BTreeMap<u64, VecDeque<Ev>> = BTreeMap::new();
        loop {
            let (new, shutdown) = {
                let mut inbox = shared.inbox.lock();
                (std::mem::take(&mut inbox.watch), inbox.shutdown)
            };
            for event in new {
                let queue = queues.entry(event.stream_id()).or_default();
                let at = queue.partition_point(|e| e.seq() < event.seq());
                queue.insert(at, event);
            }
            if shared.config.bug == Bug::ShutdownDropsPending && shutdown {
                return;
            }

            let progressed = poll_heads(&mut queues);
            if queues.is_empty() {
                if shutdown {
                    return;
                }
                shared.bell.wait(&me);
                continue;
            }
            // src: with no spin, `hot_since` stays `None`, so progress loops straight back.
            if progressed {
                continue;
            }
            // src arms a doorbell per head here; the simulated device's `arm` does nothing.
            shared.bell.wait(&me);
        }
    }

    fn poll_heads(queues: &mut BTreeMap<u64, VecDeque<Ev>>) -> bool {
        let mut progressed = false;
        queues.retain(|_, queue| {
            while let Some(head) = queue.front() {
                if head.completion().result().is_none() {
                    match head.query() {
                        Some(result) => {
                            head.completion().complete(result);
                        }
                        None => break,
                    }
                }
                queue.pop_front();
                progressed = true;
            }
            !queue.is_empty()
        });
        progressed
    }
}

impl UnderTest for mirror::Reactor {
    type Config = mirror::Config;
    type Bell = mirror::Bell;
    fn start(config: mirror::Config) -> Self {
        mirror::Reactor::start(config)
    }
    fn bell(&self) -> Arc<mirror::Bell> {
        mirror::Reactor::bell(self)
    }
    fn ring(bell: &mirror::Bell) {
        bell.ring()
    }
    fn watch(&self, event: Ev) {
        mirror::Reactor::watch(self, event)
    }
}
