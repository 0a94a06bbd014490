//! The predicting loop on a fake device whose events complete at given instants: every event
//! completes and wakes its task, whatever the predictions do. Correctness only: how early or
//! late the loop wakes is for `benches/event_latency.rs` to measure.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::task::{Wake, Waker};
use std::time::{Duration, Instant};

use super::{Bell, Doorbells, Reactor, Watch};
use crate::completion::{Completion, Registration};
use crate::error::Result;
use crate::sync::Arc;

struct Timed {
    stream: u64,
    seq: u64,
    done_at: Instant,
    completion: Completion,
}

impl Watch for Timed {
    fn stream_id(&self) -> u64 {
        self.stream
    }
    fn seq(&self) -> u64 {
        self.seq
    }
    fn query(&self) -> Option<Result<()>> {
        (Instant::now() >= self.done_at).then_some(Ok(()))
    }
    fn completion(&self) -> &Completion {
        &self.completion
    }
}

/// A CUDA-like device without doorbells, predicting, with a pre-wake.
struct Predicting;

impl Doorbells for Predicting {
    fn spin(&self) -> Duration {
        Duration::from_micros(100)
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
    fn arm(&mut self, _: &dyn Watch, _: &Arc<Bell>) -> bool {
        false
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
    let reactor = Reactor::start("sa-reactor-test-predict".into(), Predicting);
    let mut pre_woken = 0;
    for round in 0..12u64 {
        let now = Instant::now();
        let stage = if round % 2 == 0 { 1 } else { 4 };
        let events: Vec<Arc<Timed>> = vec![
            Arc::new(Timed {
                stream: 1,
                seq: round,
                done_at: now + Duration::from_millis(3),
                completion: Completion::new(),
            }),
            Arc::new(Timed {
                stream: 2,
                seq: 2 * round,
                done_at: now + Duration::from_millis(stage),
                completion: Completion::new(),
            }),
            // Queued behind the previous one: it completes with it.
            Arc::new(Timed {
                stream: 2,
                seq: 2 * round + 1,
                done_at: now + Duration::from_millis(stage),
                completion: Completion::new(),
            }),
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
    let reactor = Reactor::start("sa-reactor-test-lateness".into(), Predicting);
    for stage_us in [200u64, 2000, 20000] {
        let mut late = vec![];
        let mut pre = 0;
        for round in 0..40u64 {
            let done_at = Instant::now() + Duration::from_micros(stage_us);
            let event = Arc::new(Timed {
                stream: 10 + stage_us,
                seq: round,
                done_at,
                completion: Completion::new(),
            });
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
