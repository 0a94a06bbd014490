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
//! The models drive the crate's `Reactor`, and the planted bugs are switches in src/reactor.rs
//! (`reactor::planted`). Two loom 0.7.2 bugs made it report failures that no real execution has
//! (README.md, "Loom incompatibilities"), until src changed to sidestep them:
//! - tokio-rs/loom#249: loom's `Thread::unpark` wakes a thread that is blocked on a *mutex*
//!   (not parked) and drops the token; `Bell::ring` unparks the reactor whenever it rings, and
//!   the reactor is often inside a lock then ("expected to be able to acquire lock", or a
//!   deadlock when the token was needed). `crate::sync::thread` parks through a per-thread
//!   mutex-and-condvar token under the loom cfg (std's semantics).
//! - tokio-rs/loom#254: a plain `store` racing a `swap` on one atomic can squeeze between the
//!   swap's read and write; `Bell::wait` cleared the flag with `store(false)` after parking
//!   while ringers `swap(true)`, so loom "lost" rings. It clears with `swap(false, AcqRel)` now
//!   (which a device flag published with an atomic needs anyway: `planted_clear_without_acquire`).
//!
//! [`mirror::Reactor`], a copy of `Bell`, `Reactor`, `run` and `poll_heads` cut down to what the
//! simulated device uses, with loom's park and the old `store` as switches, is kept only for the
//! `loom_false_positive_*` tests that pin the two loom bugs down.
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

// The copy of src's reactor the default models run on, and the models by what they check.
mod events;
mod mirror;
mod offload;
mod planted;
mod stamp;

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
    /// Only after a query panicked, which none of these does (and `catch_unwind` catches
    /// nothing under loom): waits as a spinning host would.
    fn wait_blocking(&self) -> Result<()> {
        while !self.marker.reached() {
            loom::thread::yield_now();
        }
        Ok(())
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
        Reactor::start("sa-reactor-loom".to_string(), FakeDoorbells).expect("the reactor thread")
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
};

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
