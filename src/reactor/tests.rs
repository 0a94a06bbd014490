//! The predicting loop on a fake device whose events complete at given instants: every event
//! completes and wakes its task, whatever the predictions do; and a new stream's event is left
//! to its doorbell once the backoff reaches its cap (counted in polls, which a slow machine only
//! lowers). The loop outlives the longest durations a user may set (`Duration::MAX`) without
//! panicking. How early or late the loop wakes is for `benches/event_latency.rs` to measure.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::task::{Wake, Waker};
use std::time::{Duration, Instant};

use std::collections::{BTreeMap, HashMap};

use super::predict::History;
use super::{poll_heads, Bell, Doorbells, Entry, Reactor, StreamQueue, Watch};
use crate::completion::{Completion, Registration};
use crate::error::Result;
use crate::sync::Arc;

struct Timed {
    stream: u64,
    seq: u64,
    done_at: Instant,
    completion: Completion,
    /// How often it was asked.
    polls: AtomicUsize,
}

impl Timed {
    fn new(stream: u64, seq: u64, done_at: Instant) -> Timed {
        Timed {
            stream,
            seq,
            done_at,
            completion: Completion::new(),
            polls: AtomicUsize::new(0),
        }
    }
}

impl Watch for Timed {
    fn stream_id(&self) -> u64 {
        self.stream
    }
    fn seq(&self) -> u64 {
        self.seq
    }
    fn query(&self) -> Option<Result<()>> {
        self.polls.fetch_add(1, SeqCst);
        (Instant::now() >= self.done_at).then_some(Ok(()))
    }
    fn wait_blocking(&self) -> Result<()> {
        std::thread::sleep(self.done_at.saturating_duration_since(Instant::now()));
        Ok(())
    }
    fn completion(&self) -> &Completion {
        &self.completion
    }
}

/// A CUDA-like device, predicting, with a pre-wake: without doorbells, or with doorbells that
/// ring at `ring_at` (the completion of the test's one event) from a thread of their own, as a
/// host function behind the event does.
struct Predicting {
    spin: Duration,
    ring_at: Option<Instant>,
}

/// [`Predicting`] without doorbells.
const PREDICTING: Predicting = Predicting {
    spin: Duration::from_micros(100),
    ring_at: None,
};

impl Doorbells for Predicting {
    fn spin(&self) -> Duration {
        self.spin
    }
    fn max_sleep(&self) -> Option<Duration> {
        Some(Duration::from_millis(1))
    }
    fn predict(&self) -> bool {
        true
    }
    fn prewake(&self) -> Option<Duration> {
        Some(Duration::from_micros(500))
    }
    fn arm(&mut self, _: &dyn Watch, bell: &Arc<Bell>) -> bool {
        let Some(at) = self.ring_at else {
            return false;
        };
        let bell = bell.clone();
        std::thread::spawn(move || {
            std::thread::sleep(at.saturating_duration_since(Instant::now()));
            bell.ring();
        });
        true
    }
    fn forget(&mut self, _: u64) {}
}

struct Counting(AtomicUsize);

impl Wake for Counting {
    fn wake(self: std::sync::Arc<Self>) {
        self.0.fetch_add(1, SeqCst);
    }
}

/// Waits until `event` is complete and its waker was called (the waker runs just after the
/// result is published, so the two are waited for apart).
fn wait_for(event: &Timed, counter: &Counting) {
    let give_up = Instant::now() + Duration::from_secs(20);
    while event.completion.result().is_none() || counter.0.load(SeqCst) == 0 {
        assert!(
            Instant::now() < give_up,
            "event {} never completed and woke",
            event.seq
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Two streams: one repeating a 3 ms stage, one alternating 1 ms and 4 ms stages, some events
/// awaited one at a time, some queued ahead; then a stream dropped and its history forgotten.
#[test]
fn predicted_events_all_complete_and_wake() {
    let reactor = Reactor::start("sa-reactor-test-predict".into(), PREDICTING).unwrap();
    let mut pre_woken = 0;
    for round in 0..12u64 {
        let now = Instant::now();
        let stage = if round % 2 == 0 { 1 } else { 4 };
        let events: Vec<Arc<Timed>> = vec![
            Arc::new(Timed::new(1, round, now + Duration::from_millis(3))),
            Arc::new(Timed::new(2, 2 * round, now + Duration::from_millis(stage))),
            // Queued behind the previous one: it completes with it.
            Arc::new(Timed::new(
                2,
                2 * round + 1,
                now + Duration::from_millis(stage),
            )),
        ];
        let counters: Vec<_> = events
            .iter()
            .map(|event| {
                let counter = std::sync::Arc::new(Counting(AtomicUsize::new(0)));
                let mut key = None;
                let registered = event
                    .completion
                    .register_waker(&mut key, &Waker::from(counter.clone()));
                assert!(matches!(registered, Registration::Stored { first: true }));
                reactor.watch(event.clone());
                counter
            })
            .collect();
        for (event, counter) in events.iter().zip(&counters) {
            wait_for(event, counter);
            pre_woken += usize::from(counter.0.load(SeqCst) > 1);
        }
    }
    reactor.forget_stream(2);
    // Timing decides how many were pre-woken; only say it.
    eprintln!("pre-woken: {pre_woken} of 36 (timing-dependent, not checked)");
}

/// Not a check: prints how late the predicting loop sees completions on this machine
/// (`cargo test --lib reactor::tests::lateness -- --ignored --nocapture`).
#[test]
#[ignore = "prints timings; checks nothing"]
fn lateness() {
    let reactor = Reactor::start("sa-reactor-test-lateness".into(), PREDICTING).unwrap();
    for stage_us in [200u64, 2000, 20000] {
        let mut late = vec![];
        let mut pre = 0;
        for round in 0..40u64 {
            let done_at = Instant::now() + Duration::from_micros(stage_us);
            let event = Arc::new(Timed::new(10 + stage_us, round, done_at));
            let counter = std::sync::Arc::new(Counting(AtomicUsize::new(0)));
            let mut key = None;
            let _ = event
                .completion
                .register_waker(&mut key, &Waker::from(counter.clone()));
            reactor.watch(event.clone());
            while event.completion.result().is_none() {
                std::hint::spin_loop();
            }
            late.push(Instant::now().duration_since(done_at));
            wait_for(&event, &counter);
            // The hurry flag stays as it was at the completion.
            pre += usize::from(event.completion.hurried());
        }
        late.sort();
        eprintln!(
            "stage {stage_us} µs: completion seen late by median {:?}, p90 {:?}, max {:?}; pre-woken {pre} of 40",
            late[20], late[36], late[39]
        );
    }
}

/// The drift fix (f646837): a head that another thread completed before the reactor's poll (a
/// pre-woken task polls its own event) teaches its stream no service time: the reactor looked
/// some time after it was done, and learning that as a service time made each prediction, and
/// each pre-wake, later than the last. The next head's clock starts at the completing thread's
/// stamp, not at the reactor's look. A head the reactor's own poll finds does teach.
#[test]
fn completions_found_by_others_teach_no_service_time() {
    let ms = Duration::from_millis;
    let t0 = Instant::now().checked_sub(ms(20)).expect("20 ms of uptime");
    let mut histories = HashMap::new();
    let mut history = History::default();
    history.completed(t0, t0 + ms(3), false);
    histories.insert(1, history);

    // Registered at 3 ms, reached by the GPU long ago, completed by a task; the reactor polls
    // 2 ms later.
    let by_task = Arc::new(Timed::new(1, 0, t0));
    assert!(by_task.completion.complete(Ok(())));
    let stamp = by_task
        .completion
        .completed_at()
        .expect("a complete event is stamped");
    std::thread::sleep(ms(2));
    let mut queues = BTreeMap::new();
    let queue: &mut StreamQueue = queues.entry(1).or_default();
    queue.events.push_back(Entry {
        event: Box::new(by_task),
        watched: Some(t0 + ms(3)),
    });
    assert!(poll_heads(
        &mut queues,
        Some(&mut histories),
        false,
        &mut Vec::new()
    ));
    let history = &histories[&1];
    assert_eq!(
        history.samples(),
        &[ms(3)],
        "a completion another thread found taught a service time"
    );
    assert_eq!(
        history.start(t0),
        stamp,
        "the next head's clock starts when the task completed the event"
    );

    // Registered at the stamp, and found complete by the reactor's own poll: learnt (some 2 ms
    // and more, apart from the 3 ms already kept).
    let own = Arc::new(Timed::new(1, 1, t0));
    queues.entry(1).or_default().events.push_back(Entry {
        event: Box::new(own.clone()),
        watched: Some(stamp),
    });
    assert!(poll_heads(
        &mut queues,
        Some(&mut histories),
        false,
        &mut Vec::new()
    ));
    assert_eq!(own.completion.result(), Some(Ok(())));
    assert_eq!(
        histories[&1].samples().len(),
        2,
        "the reactor's own find teaches"
    );
}

/// An event hurried as its stream's head, then passed by an event of a lower number registered
/// after it (tasks register in whatever order they are first polled), stops being hurried: its
/// task would otherwise poll itself until its event completes, a worker's whole CPU.
#[test]
fn a_hurried_event_that_is_no_longer_the_head_is_not_hurried() {
    let ms = Duration::from_millis;
    let now = Instant::now();
    let t0 = now.checked_sub(ms(60)).expect("60 ms of uptime");
    let event = |seq| Arc::new(Timed::new(1, seq, now + Duration::from_secs(3600)));
    let (later, earlier) = (event(5), event(0));
    // One service time of 20 ms, the last completion 40 ms ago: a head registered 20 ms ago is
    // predicted now, inside its pre-wake.
    let mut history = History::default();
    history.completed(t0, t0 + ms(20), false);
    let mut state = super::Loop {
        spin: Duration::ZERO,
        max_sleep: Some(ms(1)),
        predict: true,
        prewake: Some(ms(1)),
        doorbells: PREDICTING,
        queues: BTreeMap::new(),
        history: HashMap::from([(1, history)]),
        oversleep: super::predict::Oversleep::default(),
        hot_since: None,
        fresh: false,
        sleep: super::FIRST_SLEEP,
        offload: Arc::new(crate::offload::Offload::new("sa-blocking-test".into())),
    };
    let registered = Some(now - ms(20));
    let queue = state.queues.entry(1).or_default();
    queue.events.push_back(Entry {
        event: Box::new(later.clone()),
        watched: registered,
    });
    state.plan();
    assert!(
        later.completion.hurried(),
        "the head near its prediction is hurried"
    );
    let queue = state.queues.entry(1).or_default();
    queue.events.push_front(Entry {
        event: Box::new(earlier.clone()),
        watched: registered,
    });
    state.plan();
    assert!(
        !later.completion.hurried(),
        "an event no longer the head stayed hurried"
    );
    assert!(earlier.completion.hurried(), "the new head is hurried");
}

/// A stream's first event (no prediction), pending 200 ms with its doorbell armed: the loop
/// polls it while its sleeps double up to the cap (1 ms), then leaves it to the doorbell, which
/// wakes it. Polling on at the cap would ask it about 200 times; the bound below is far above
/// the dozen or so the backoff and the ring take, and a slow machine only polls less.
#[test]
fn a_new_streams_event_is_left_to_its_doorbell_once_the_backoff_reaches_the_cap() {
    let done_at = Instant::now() + Duration::from_millis(200);
    // No hot spin, so that the polls counted are the sleeps'.
    let doorbells = Predicting {
        spin: Duration::ZERO,
        ring_at: Some(done_at),
    };
    let reactor = Reactor::start("sa-reactor-test-ring".into(), doorbells).unwrap();
    let event = Arc::new(Timed::new(7, 0, done_at));
    let counter = std::sync::Arc::new(Counting(AtomicUsize::new(0)));
    let mut key = None;
    let registered = event
        .completion
        .register_waker(&mut key, &Waker::from(counter.clone()));
    assert!(matches!(registered, Registration::Stored { first: true }));
    reactor.watch(event.clone());
    wait_for(&event, &counter);
    let polls = event.polls.load(SeqCst);
    assert!(polls < 60, "asked {polls} times in 200 ms");
}

/// A device's doorbells with the durations a user may set through `CudaOptions`
/// (`reactor_max_sleep`, `reactor_prewake`); `arm` succeeds without ringing (a CUDA doorbell
/// rings only when its event completes, which these tests do by hand).
struct Configured {
    predict: bool,
    spin: Duration,
    max_sleep: Duration,
    prewake: Option<Duration>,
}

impl Doorbells for Configured {
    fn spin(&self) -> Duration {
        self.spin
    }
    fn max_sleep(&self) -> Option<Duration> {
        Some(self.max_sleep)
    }
    fn predict(&self) -> bool {
        self.predict
    }
    fn prewake(&self) -> Option<Duration> {
        self.prewake
    }
    fn arm(&mut self, _: &dyn Watch, _: &Arc<Bell>) -> bool {
        true
    }
    fn forget(&mut self, _: u64) {}
}

/// Counts the panics raised on the thread called `thread` (the reactor's loop catches them,
/// so only a hook sees them), then hands each to the hook that was there before.
fn count_panics_on(thread: &'static str) -> std::sync::Arc<AtomicUsize> {
    let count = std::sync::Arc::new(AtomicUsize::new(0));
    let theirs = count.clone();
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if std::thread::current().name() == Some(thread) {
            theirs.fetch_add(1, SeqCst);
        }
        previous(info);
    }));
    count
}

/// Registers `event` with a fresh waker and hands it to `reactor`.
fn watch_with_waker(reactor: &Reactor, event: &Arc<Timed>) -> std::sync::Arc<Counting> {
    let counter = std::sync::Arc::new(Counting(AtomicUsize::new(0)));
    let mut key = None;
    let registered = event
        .completion
        .register_waker(&mut key, &Waker::from(counter.clone()));
    assert!(matches!(registered, Registration::Stored { first: true }));
    reactor.watch(event.clone());
    counter
}

/// `CudaOptions { reactor_prewake: Some(Duration::MAX), .. }` ("always hurry"): once a stream
/// had a history, every turn of the predicting loop overflowed a `Duration` (`lead * 4` in
/// `scaled_lead`, then `completion + margin + lead` on an `Instant`) and panicked. The loop
/// caught it, so a user saw no crash but an error in the log about a thousand times a second
/// while the stream had an event pending, and tasks woken only by the loop's 1 ms retry.
#[test]
fn a_prewake_of_duration_max_does_not_panic_the_reactor() {
    const NAME: &str = "sa-reactor-test-prewake-max";
    let panics = count_panics_on(NAME);
    let reactor = Reactor::start(
        NAME.into(),
        Configured {
            predict: true,
            spin: Duration::from_micros(100),
            max_sleep: Duration::from_millis(1),
            prewake: Some(Duration::MAX),
        },
    )
    .unwrap();
    // Two events of one stream: the first teaches a service time, the second is planned with it.
    let first = Arc::new(Timed::new(11, 0, Instant::now() + Duration::from_millis(2)));
    let counter = watch_with_waker(&reactor, &first);
    wait_for(&first, &counter);
    let second = Arc::new(Timed::new(
        11,
        1,
        Instant::now() + Duration::from_millis(20),
    ));
    let counter = watch_with_waker(&reactor, &second);
    wait_for(&second, &counter);
    drop(reactor);
    let panics = panics.load(SeqCst);
    assert_eq!(
        panics, 0,
        "the reactor's loop panicked {panics} times with reactor_prewake = Some(Duration::MAX)"
    );
}

/// `CudaOptions { reactor_max_sleep: Duration::MAX, .. }` ("no cap, rely on the doorbells"):
/// each backoff sleep doubled the next one with `(self.sleep * 2).min(cap)`, which overflowed
/// once it passed `Duration::MAX / 2`. A ring of the bell that brings no completion and no
/// registration (here `forget_stream`: a stream dropped) ends a sleep, so some 80 streams
/// dropped while one event was pending got there; from then on a user saw an error in the log
/// on every turn of the loop (the panic caught, then a 1 ms wait) until the event completed.
#[test]
fn a_max_sleep_of_duration_max_does_not_panic_the_reactor() {
    const NAME: &str = "sa-reactor-test-max-sleep-max";
    let panics = count_panics_on(NAME);
    let reactor = Reactor::start(
        NAME.into(),
        Configured {
            predict: false,
            spin: Duration::ZERO,
            max_sleep: Duration::MAX,
            prewake: None,
        },
    )
    .unwrap();
    let done_at = Instant::now() + Duration::from_millis(800);
    let event = Arc::new(Timed::new(21, 0, done_at));
    let counter = watch_with_waker(&reactor, &event);
    // Streams of this device dropped while the event is pending: each ring ends a backoff sleep.
    for stream in 0..300u64 {
        reactor.forget_stream(1_000 + stream);
        std::thread::sleep(Duration::from_millis(1));
        if Instant::now() >= done_at {
            break;
        }
    }
    std::thread::sleep(done_at.saturating_duration_since(Instant::now()));
    // The event's doorbell.
    reactor.forget_stream(999);
    wait_for(&event, &counter);
    drop(reactor);
    let panics = panics.load(SeqCst);
    assert_eq!(
        panics, 0,
        "the reactor's loop panicked {panics} times with reactor_max_sleep = Duration::MAX"
    );
}

/// The OS refusing the reactor thread is an [`Error::Io`](crate::Error::Io) that names the
/// thread and the OS's message, not a panic (`Device::cuda` returns it).
#[test]
fn a_reactor_thread_the_os_refuses_is_an_error() {
    let refused = Reactor::start_with("sa-reactor-test-refused".into(), PREDICTING, |_, _| {
        Err(std::io::Error::new(
            std::io::ErrorKind::WouldBlock,
            "resource temporarily unavailable",
        ))
    });
    let err = refused.expect_err("a reactor without its thread was handed out");
    assert!(
        matches!(err, crate::Error::Io { .. })
            && err.to_string().contains("sa-reactor")
            && err.to_string().contains("unavailable"),
        "{err}"
    );
}

/// A threadless reactor (an inline simulated device's, its thread refused) completes an event
/// that is done when it is handed over, waking its task, and still runs blocking work.
#[test]
fn a_threadless_reactor_completes_what_it_is_handed() {
    let reactor = Reactor::threadless("sa-reactor-test-threadless".into());
    let event = Arc::new(Timed::new(31, 0, Instant::now()));
    let counter = watch_with_waker(&reactor, &event);
    assert_eq!(event.completion.result(), Some(Ok(())));
    assert_eq!(counter.0.load(SeqCst), 1, "the task was not woken");
    let (tx, rx) = std::sync::mpsc::channel();
    reactor.offload("threadless test", Box::new(move || tx.send(()).unwrap()));
    rx.recv().expect("the blocking work never ran");
}

/// A threadless reactor handed an event whose query panics: the panic stays in the reactor
/// (it used to unwind into the caller of `watch`), and the event is settled in place by its
/// blocking wait: its deferred free runs and its task wakes with the result.
#[test]
fn a_threadless_reactor_catches_a_panicking_query_and_waits_in_place() {
    let reactor = Reactor::threadless("sa-reactor-test-threadless-panic".into());
    let PanickingScene {
        event,
        freed,
        freed_with,
        counter,
    } = panicking_scene(43, false);
    let watched = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        reactor.watch(event.clone())
    }));
    assert!(
        watched.is_ok(),
        "the query's panic reached the caller of watch"
    );
    assert_eq!(event.completion.result(), Some(Ok(())));
    assert_eq!(freed.load(SeqCst), 1, "the deferred free never ran");
    assert_eq!(*freed_with.lock().unwrap(), Some(Ok(())));
    assert_eq!(counter.0.load(SeqCst), 1, "its task was not woken");
}

/// An event whose query panics (a bug in a device's query path); its blocking wait says the
/// GPU reached it, or with `wait_panics` panics too.
struct PanickingQuery {
    stream: u64,
    completion: Completion,
    wait_panics: bool,
}

/// A [`PanickingQuery`] with what its tests watch registered on it: a deferred free, and the
/// waker of a task awaiting it.
struct PanickingScene {
    event: Arc<PanickingQuery>,
    /// How often the deferred free ran...
    freed: std::sync::Arc<AtomicUsize>,
    /// ...and the result it last ran with.
    freed_with: std::sync::Arc<std::sync::Mutex<Option<Result<()>>>>,
    /// Counts the task's wakes.
    counter: std::sync::Arc<Counting>,
}

/// A [`PanickingScene`] on `stream`, whose event's blocking wait panics too with `wait_panics`.
/// The free is the event's first registration, so it hands the event to a reactor (`Stored {
/// first: true }`).
fn panicking_scene(stream: u64, wait_panics: bool) -> PanickingScene {
    let event = Arc::new(PanickingQuery {
        stream,
        completion: Completion::new(),
        wait_panics,
    });
    let freed = std::sync::Arc::new(AtomicUsize::new(0));
    let freed_with = std::sync::Arc::new(std::sync::Mutex::new(None));
    let (runs, with) = (freed.clone(), freed_with.clone());
    let registered = event.completion.register_callback(Box::new(move |result| {
        *with.lock().unwrap() = Some(result.clone());
        runs.fetch_add(1, SeqCst);
    }));
    assert!(matches!(
        registered,
        Ok(Registration::Stored { first: true })
    ));
    let counter = std::sync::Arc::new(Counting(AtomicUsize::new(0)));
    let mut key = None;
    let _ = event
        .completion
        .register_waker(&mut key, &Waker::from(counter.clone()));
    PanickingScene {
        event,
        freed,
        freed_with,
        counter,
    }
}

impl Watch for PanickingQuery {
    fn stream_id(&self) -> u64 {
        self.stream
    }
    fn seq(&self) -> u64 {
        0
    }
    fn query(&self) -> Option<Result<()>> {
        panic!("a query that panics (reactor unit test)")
    }
    fn wait_blocking(&self) -> Result<()> {
        assert!(!self.wait_panics, "a wait that panics (reactor unit test)");
        Ok(())
    }
    fn completion(&self) -> &Completion {
        &self.completion
    }
}

/// A head whose query panics, on stream 1, in front of a completed head on stream 2: the
/// poll completes stream 2's event, and keeps stream 1's pending (nothing says the GPU is done
/// with it, and its deferred frees must not run yet) but wakes its task, which then asks the
/// device itself, and takes it off its queue for the blocking-work thread to wait for
/// (`settle_after_panic`): polled again, a query that always panics left its frees stuck. The panic used to leave the poll at stream 1:
/// caught only by the loop, every later stream's events waited with it, and its task hung.
#[test]
fn a_query_that_panics_does_not_stop_the_poll_and_wakes_its_task() {
    let panicking = Arc::new(PanickingQuery {
        stream: 1,
        completion: Completion::new(),
        wait_panics: false,
    });
    let counter = std::sync::Arc::new(Counting(AtomicUsize::new(0)));
    let mut key = None;
    let _ = panicking
        .completion
        .register_waker(&mut key, &Waker::from(counter.clone()));
    let done = Arc::new(Timed::new(2, 0, Instant::now()));
    let mut queues: BTreeMap<u64, StreamQueue> = BTreeMap::new();
    for (stream, event) in [
        (1, Box::new(panicking.clone()) as super::Watched),
        (2, Box::new(done.clone())),
    ] {
        queues.entry(stream).or_default().events.push_back(Entry {
            event,
            watched: None,
        });
    }
    let mut abandoned = Vec::new();
    let panics = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        poll_heads(&mut queues, None, false, &mut abandoned)
    }));
    assert!(
        matches!(panics, Ok(true)),
        "the poll panicked or found nothing"
    );
    assert_eq!(
        done.completion.result(),
        Some(Ok(())),
        "stream 2 was not polled"
    );
    assert_eq!(
        panicking.completion.result(),
        None,
        "completed without an answer"
    );
    assert_eq!(
        queues.get(&1).map(|q| q.events.len()),
        None,
        "still polled by the reactor"
    );
    assert_eq!(abandoned.len(), 1, "not handed over to be waited for");
    assert_eq!(counter.0.load(SeqCst), 1, "its task was not woken");
}

/// An event whose every query panics, with a deferred free (a callback) on it, watched by a
/// running reactor: it must not stay stuck. The reactor stops polling it and hands it to the
/// blocking-work thread, which waits for the device by its other path (`wait_blocking`): the
/// free runs after that wait says the GPU reached the event, and the task wakes with the
/// result. It used to stay watched forever, its free never run: the memory lost.
#[test]
fn an_event_whose_query_always_panics_still_runs_its_deferred_frees() {
    let reactor = Reactor::start(
        "sa-reactor-test-query-panics".into(),
        Configured {
            predict: false,
            spin: Duration::ZERO,
            max_sleep: Duration::from_millis(1),
            prewake: None,
        },
    )
    .unwrap();
    // `panicking_scene` checks that the free's registration handed the event over.
    let PanickingScene {
        event,
        freed,
        freed_with,
        counter,
    } = panicking_scene(41, false);
    reactor.watch(event.clone());
    let give_up = Instant::now() + Duration::from_secs(10);
    while freed.load(SeqCst) == 0 && Instant::now() < give_up {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(
        freed.load(SeqCst),
        1,
        "the deferred free of an event whose query panics never ran"
    );
    assert_eq!(*freed_with.lock().unwrap(), Some(Ok(())));
    assert_eq!(event.completion.result(), Some(Ok(())));
    assert!(counter.0.load(SeqCst) >= 1, "its task was not woken");
}

/// Should the blocking wait panic too, nothing says whether the GPU is done: the task wakes
/// with an error, and the deferred free is never run (leaked, not freed under work that may
/// still use its memory), nor is one registered later.
#[test]
fn an_event_whose_query_and_wait_panic_fails_and_withholds_its_frees() {
    let PanickingScene {
        event,
        freed,
        counter,
        ..
    } = panicking_scene(42, true);
    super::settle_after_panic(Box::new(event.clone()));
    assert!(
        matches!(event.completion.result(), Some(Err(_))),
        "the task does not see an error"
    );
    assert_eq!(counter.0.load(SeqCst), 1, "its task was not woken");
    assert_eq!(
        freed.load(SeqCst),
        0,
        "a free ran with the GPU's state unknown"
    );
    assert!(event.completion.withholds_callbacks());
    let theirs = freed.clone();
    let late = event.completion.register_callback(Box::new(move |_| {
        theirs.fetch_add(1, SeqCst);
    }));
    assert!(matches!(late, Ok(Registration::Stored { first: false })));
    assert_eq!(
        freed.load(SeqCst),
        0,
        "a later free ran with the GPU's state unknown"
    );
}

/// A head whose tasks are hurried (near its prediction) and whose query panics: the reactor
/// hands it to the blocking-work thread and no longer plans for it, so it must stop hurrying
/// it. It stayed hurried until the blocking wait completed it: every poll of its task woke the
/// task again at once, a runtime worker's whole CPU for as long as the GPU took.
#[test]
fn an_abandoned_hurried_event_is_no_longer_hurried() {
    let panicking = Arc::new(PanickingQuery {
        stream: 1,
        completion: Completion::new(),
        wait_panics: false,
    });
    let counter = std::sync::Arc::new(Counting(AtomicUsize::new(0)));
    let mut key = None;
    let waker = Waker::from(counter.clone());
    let _ = panicking.completion.register_waker(&mut key, &waker);
    let mut queues: BTreeMap<u64, StreamQueue> = BTreeMap::new();
    let queue = queues.entry(1).or_default();
    queue.events.push_back(Entry {
        event: Box::new(panicking.clone()),
        watched: None,
    });
    // As `Loop::plan` hurries a head near its prediction.
    panicking.completion.hurry(true);
    queue.hurried = Some(0);
    let mut abandoned = Vec::new();
    assert!(poll_heads(&mut queues, None, false, &mut abandoned));
    assert_eq!(abandoned.len(), 1, "not handed over to be waited for");
    assert!(
        !panicking.completion.hurried(),
        "an abandoned event stayed hurried"
    );
    // Its task, polling again, registers without waking itself.
    let woken = counter.0.load(SeqCst);
    let _ = panicking.completion.register_waker(&mut key, &waker);
    assert_eq!(counter.0.load(SeqCst), woken, "the task woke itself again");
}
