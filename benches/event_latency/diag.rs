//! Where the wake latency's tail comes from (issue 18): the predicting reactor's own
//! measurements, collected from its trace-level `tracing` events (target
//! `streamalloc::reactor::stats`, see `STATS` in src/reactor.rs), and what each sample's task
//! saw of the pre-wake.

use std::sync::Mutex;

use tracing::field::{Field, Visit};
use tracing::subscriber::Interest;
use tracing::Metadata;
use tracing_subscriber::layer::{Context, Layer};

/// The reactor's target for its measurements.
const TARGET: &str = "streamalloc::reactor::stats";

/// What the reactor reported since the last [`take`].
#[derive(Default)]
pub struct Reported {
    /// Per completion compared with its prediction: completion minus the nearest predicted
    /// completion (ns), whether the reactor's poll found it (else the completing thread's
    /// stamp), and the stream's margin then (ns).
    pub errors: Vec<(i64, bool, u64)>,
    /// Per timed sleep: its kind (`coarse`, `step`, `backoff`), asked and slept (ns).
    pub sleeps: Vec<(String, u64, u64)>,
}

static REPORTED: Mutex<Option<Reported>> = Mutex::new(None);

/// Starts collecting (a global `tracing` subscriber that takes only the reactor's target).
pub fn install() {
    use tracing_subscriber::layer::SubscriberExt;
    *REPORTED.lock().unwrap() = Some(Reported::default());
    let subscriber = tracing_subscriber::registry().with(Collect);
    if tracing::subscriber::set_global_default(subscriber).is_err() {
        eprintln!("a tracing subscriber was already set: no reactor measurements");
    }
}

/// What was reported since the last call.
pub fn take() -> Reported {
    REPORTED
        .lock()
        .unwrap()
        .as_mut()
        .map(std::mem::take)
        .unwrap_or_default()
}

struct Collect;

#[derive(Default)]
struct Fields {
    error_ns: Option<i64>,
    own: Option<bool>,
    margin_ns: Option<u64>,
    asked_ns: Option<u64>,
    slept_ns: Option<u64>,
    kind: Option<String>,
}

impl Visit for Fields {
    fn record_i64(&mut self, field: &Field, value: i64) {
        match field.name() {
            "error_ns" => self.error_ns = Some(value),
            "margin_ns" => self.margin_ns = u64::try_from(value).ok(),
            "asked_ns" => self.asked_ns = u64::try_from(value).ok(),
            "slept_ns" => self.slept_ns = u64::try_from(value).ok(),
            _ => {}
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        match field.name() {
            "error_ns" => self.error_ns = i64::try_from(value).ok(),
            "margin_ns" => self.margin_ns = Some(value),
            "asked_ns" => self.asked_ns = Some(value),
            "slept_ns" => self.slept_ns = Some(value),
            _ => {}
        }
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        if field.name() == "own" {
            self.own = Some(value);
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "kind" {
            self.kind = Some(value.to_owned());
        }
    }

    fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
}

impl<S: tracing::Subscriber> Layer<S> for Collect {
    fn register_callsite(&self, meta: &'static Metadata<'static>) -> Interest {
        if meta.target() == TARGET {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, meta: &Metadata<'_>, _: Context<'_, S>) -> bool {
        meta.target() == TARGET
    }

    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut f = Fields::default();
        event.record(&mut f);
        let mut reported = REPORTED.lock().unwrap();
        let Some(reported) = reported.as_mut() else {
            return;
        };
        if let (Some(error), Some(own), Some(margin)) = (f.error_ns, f.own, f.margin_ns) {
            reported.errors.push((error, own, margin));
        } else if let (Some(kind), Some(asked), Some(slept)) = (f.kind, f.asked_ns, f.slept_ns) {
            reported.sleeps.push((kind, asked, slept));
        }
    }
}

/// What the task saw of one sample, in ns after the observer saw the GPU reach the event
/// (negative: before it).
#[derive(Clone, Copy, Debug)]
pub struct Seen {
    /// The task resumed.
    pub to_task: i64,
    /// The reactor's pre-wake (its first call of the waker, if more than 5 µs before).
    pub prewake: Option<i64>,
    /// The task's first poll after the pre-wake.
    pub first_poll: Option<i64>,
    /// The task's last poll before the GPU reached the event.
    pub last_poll_before: Option<i64>,
}

/// A sorted copy's quantile `q`, µs (`-` when empty).
fn q_us(sorted: &[i64], q: f64) -> String {
    if sorted.is_empty() {
        return "-".into();
    }
    let v = sorted[((sorted.len() - 1) as f64 * q).round() as usize];
    format!("{:.1}", v as f64 / 1e3)
}

/// "p1/median/p99" (µs) of `v`.
fn spread(mut v: Vec<i64>) -> String {
    v.sort_unstable();
    format!("{}/{}/{}", q_us(&v, 0.01), q_us(&v, 0.5), q_us(&v, 0.99))
}

/// "median/p99/max" (µs) of `v`.
fn late(mut v: Vec<i64>) -> String {
    v.sort_unstable();
    format!("{}/{}/{}", q_us(&v, 0.5), q_us(&v, 0.99), q_us(&v, 1.0))
}

/// The header of [`line`]'s table.
pub fn header() {
    println!(
        "\nwhere the tail comes from (µs)\n\
         - error: completion minus the nearest prediction, p1/median/p99, n, and the share the \
         reactor's own poll found (else the completing thread's stamp); margin: median\n\
         - sleeps late: how late the reactor's timed sleeps ended, median/p99/max, n, by kind \
         (coarse, step: towards a prediction; backoff; cap: the longest allowed)\n\
         - lead: the pre-wake before the GPU reached the event; worker: the task's first poll \
         after the pre-wake (p1/median/p99)\n\
         - tail: of the samples later than 50 µs to the task, those not pre-woken / pre-woken \
         but first polled after the event / not polling at the event (the last poll 20 µs or \
         more before it) / polling"
    );
}

/// One line per cell: the reactor's reports and the task's samples.
pub fn line(name: &str, kernel: std::time::Duration, reported: Reported, seen: &[Seen]) {
    let n = reported.errors.len();
    let own = reported.errors.iter().filter(|e| e.1).count();
    let mut margins: Vec<i64> = reported.errors.iter().map(|e| e.2 as i64).collect();
    margins.sort_unstable();
    let errors = spread(reported.errors.iter().map(|e| e.0).collect());
    let sleeps = |kind: &str| {
        let v: Vec<i64> = reported
            .sleeps
            .iter()
            .filter(|s| s.0 == kind && s.2 >= s.1)
            .map(|s| (s.2 - s.1) as i64)
            .collect();
        let n = v.len();
        format!("{kind} {} n={n}", late(v))
    };
    let leads = spread(seen.iter().filter_map(|s| s.prewake.map(|p| -p)).collect());
    let worker = spread(
        seen.iter()
            .filter_map(|s| Some(s.first_poll? - s.prewake?))
            .collect(),
    );
    let (mut none, mut up_late, mut idle, mut polling) = (0, 0, 0, 0);
    for s in seen.iter().filter(|s| s.to_task > 50_000) {
        match (s.prewake, s.first_poll, s.last_poll_before) {
            (None, ..) => none += 1,
            (Some(_), first, _) if first.is_none_or(|f| f > 0) => up_late += 1,
            (_, _, last) if last.is_none_or(|l| l < -20_000) => idle += 1,
            _ => polling += 1,
        }
    }
    println!(
        "{name:<9} {kernel:>8?}  error {errors} n={n} own={:.0}% margin {}  sleeps late: {}, {}, {}, {}  \
         lead {leads} worker {worker}  tail {none}/{up_late}/{idle}/{polling}",
        if n == 0 { 0.0 } else { own as f64 * 100.0 / n as f64 },
        q_us(&margins, 0.5),
        sleeps("coarse"),
        sleeps("step"),
        sleeps("backoff"),
        sleeps("cap"),
    );
}
