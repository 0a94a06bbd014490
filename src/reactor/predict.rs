//! Predicting when a stream's oldest watched event completes, from that stream's history
//! ([`WakeStrategy::Predict`](crate::WakeStrategy::Predict)).
//!
//! The quantity learnt is a *service time*: how long the GPU took from the moment it could
//! start on the work in front of an event to the event. That moment is the later of the
//! previous watched event's completion and the event's registration with the reactor (the
//! host cannot queue work in front of an event after recording it, and it registers the event
//! when a future first awaits it, usually right after the record). A registration later than
//! the record only makes the service time look shorter: the prediction comes early and costs
//! a little CPU, never latency.
//!
//! A stream keeps its last [`SAMPLES`] service times. Each one is a candidate completion
//! (`start + sample`): the reactor sleeps until just before the next candidate and polls in a
//! hot loop through a window around it; so a pipeline whose stages alternate between a few
//! lengths is predicted as well as one that repeats one. Past every window, the event has no
//! prediction and the reactor polls it as the backoff strategy does.
//!
//! The window's half-width (the margin) adapts to how far the stream's completions fell from the
//! nearest candidate: a high estimate of that error (about its 95th percentile, see
//! [`History::margin`]), not its mean, since a completion outside every window loses the
//! pre-wake and costs its task a parked worker's wakeup. The pre-wake (the hurry) runs from the
//! lead before a candidate to the lead after its window, so that a completion somewhat later
//! than every candidate still finds its task polling.
//!
//! Separately, the reactor sleeps towards a window in two stages ([`sleep_toward`]): a coarse
//! sleep that ends [`SETTLE`] before it, then short sleeps, each asked that much shorter than
//! the time left as short sleeps have been ending late (the OS and the hypervisor: measured on
//! every sleep, short and long apart, see [`Oversleep`]). A long sleep on a VM sometimes ends
//! hundreds of µs late; in two stages such a late end lands in the settling time, not past the
//! pre-wake.
//!
//! All of this state is the reactor thread's own: nothing here is shared.

use std::time::{Duration, Instant};

/// How many recent service times a stream keeps.
pub(super) const SAMPLES: usize = 8;
/// The smallest half-width of a hot window.
const MIN_MARGIN: Duration = Duration::from_micros(20);
/// The largest: a margin this wide means the predictions are not worth much.
const MAX_MARGIN: Duration = Duration::from_millis(1);
/// Completions further than this from every candidate count as this far (a stream that changes
/// its work should not widen its windows for long).
const MAX_ERROR: Duration = Duration::from_micros(500);
/// The most one completion raises a stream's spread (see [`History::margin`]).
const MAX_RISE: Duration = Duration::from_micros(25);
/// Samples closer than this to one already kept do not make a window of their own.
const SAME: Duration = Duration::from_micros(5);

/// One stream's history.
#[derive(Debug, Default)]
pub(super) struct History {
    /// When the previous watched event of the stream was seen complete.
    last_done: Option<Instant>,
    /// Recent service times, oldest overwritten first.
    samples: [Duration; SAMPLES],
    len: usize,
    next: usize,
    /// A high estimate of how far completions fell from their nearest candidate (see
    /// [`margin`](Self::margin)).
    spread: Duration,
}

/// Where a head stands against its stream's predictions at some instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Plan {
    /// No prediction: a stream without history, or past every window.
    None,
    /// Inside a hot window: poll in a hot loop. `until` ends the window (`None`: never, past
    /// what an `Instant` can hold); `completion` is the candidate in it.
    Hot {
        completion: Instant,
        until: Option<Instant>,
    },
    /// Before the next window: sleep until `wake` (the window's start); `completion` is its
    /// candidate.
    Ahead { completion: Instant, wake: Instant },
}

impl History {
    /// When the GPU could start on the work in front of a head registered at `watched`.
    pub(super) fn start(&self, watched: Instant) -> Instant {
        self.last_done.map_or(watched, |done| done.max(watched))
    }

    /// The half-width of this stream's windows: twice the spread, plus [`MIN_MARGIN`]. The
    /// spread rises by a quarter of any larger error (by at most [`MAX_RISE`]) and falls by a
    /// 32nd of the difference with each smaller one: an asymmetric average (an expectile) that
    /// follows the late end of recent errors, not their mean. For errors spread as an
    /// exponential distribution it settles near their 86th percentile (twice their mean), and
    /// twice it lies near their 98th; twice the mean, which the margin was before, let one
    /// completion in seven through (less the floor's share). The cap on a rise keeps one
    /// outlier (a new length of work, a preempted thread) from widening the windows, and the
    /// reactor's hot polling with them, for the next hundred completions.
    pub(super) fn margin(&self) -> Duration {
        self.spread
            .saturating_mul(2)
            .saturating_add(MIN_MARGIN)
            .min(MAX_MARGIN)
    }

    /// How far a completion at `done` of a head whose work could start at `start` falls from
    /// the nearest candidate: positive when it came later, in ns. `None` without candidates.
    /// (What the benchmark reports as the prediction error.)
    pub(super) fn error(&self, start: Instant, done: Instant) -> Option<i64> {
        let sample = done.saturating_duration_since(start);
        self.samples[..self.len]
            .iter()
            .map(|&s| sample.as_nanos() as i64 - s.as_nanos() as i64)
            .min_by_key(|e| e.unsigned_abs())
    }

    /// The recent service times kept (for the tests).
    #[cfg(all(test, not(streamalloc_loom)))]
    pub(super) fn samples(&self) -> &[Duration] {
        &self.samples[..self.len]
    }

    /// The plan at `now` for a head whose work could start at `start`.
    pub(super) fn plan(&self, start: Instant, now: Instant, margin: Duration) -> Plan {
        let mut best = Plan::None;
        for &sample in &self.samples[..self.len] {
            // A candidate past what an `Instant` can hold never comes: it has no window, and a
            // head with no other candidate is unpredicted (polled as the backoff does), which
            // is right for an event we cannot place in time.
            let Some(completion) = start.checked_add(sample) else {
                continue;
            };
            let from = completion - margin.min(completion - start);
            // A window whose end an `Instant` cannot hold never closes.
            let until = completion.checked_add(margin);
            if until.is_some_and(|until| now >= until) {
                continue;
            }
            let plan = if now >= from {
                Plan::Hot { completion, until }
            } else {
                Plan::Ahead {
                    completion,
                    wake: from,
                }
            };
            best = match (best, plan) {
                (Plan::None, p) => p,
                // Hot wins; among windows ahead, the nearest.
                (Plan::Hot { .. }, _) => best,
                (Plan::Ahead { .. }, p @ Plan::Hot { .. }) => p,
                (Plan::Ahead { wake: a, .. }, Plan::Ahead { wake: b, .. }) if b < a => plan,
                (Plan::Ahead { .. }, _) => best,
            };
        }
        best
    }

    /// Whether the tasks awaiting a head whose work could start at `start` should be hurried at
    /// `now` (some candidate is less than its lead ahead, or its window closed less than its
    /// lead ago: [`scaled_lead`]), and the next instant at which that changes, if it does.
    ///
    /// The hurry outlasts the window by the lead: a completion later than every window (the
    /// one in twenty the margin lets through, or a stream whose work grew) then still finds
    /// its task polling instead of parked, which is what the pre-wake is for. The price is the
    /// awaiting worker's CPU for at most `lead` more per such event.
    pub(super) fn hurry(
        &self,
        start: Instant,
        now: Instant,
        lead: Duration,
        margin: Duration,
    ) -> (bool, Option<Instant>) {
        let (mut want, mut change): (bool, Option<Instant>) = (false, None);
        for &sample in &self.samples[..self.len] {
            let lead = scaled_lead(lead, sample);
            // A candidate past what an `Instant` can hold never comes, so it is never near
            // enough to hurry for (as in `plan`, where it has no window).
            let Some(completion) = start.checked_add(sample) else {
                continue;
            };
            let from = completion - lead.min(completion - start);
            // The hurry's end, `None` when an `Instant` cannot hold it (a lead near
            // `Duration::MAX`, "always hurry"): then it never ends by time, which is what such
            // a lead asks for; the head's completion, or another head taking its place, still
            // ends it (`Loop::plan`). Saturating to some far instant instead would only
            // schedule a change that never comes.
            let until = completion.checked_add(margin.saturating_add(lead));
            let at = if now < from {
                Some(from)
            } else if until.is_none_or(|until| now < until) {
                want = true;
                until
            } else {
                continue;
            };
            if let Some(at) = at {
                change = Some(change.map_or(at, |c| c.min(at)));
            }
        }
        (want, change)
    }

    /// The head whose work could start at `start` was seen complete at `now`. `batch`: its
    /// time says nothing about its work, only that it was done by `now`: it was found complete
    /// in the same poll as the head before it (the GPU was past it before we looked), or another
    /// thread completed it first (a pre-woken task that polled its event).
    pub(super) fn completed(&mut self, start: Instant, now: Instant, batch: bool) {
        if !batch {
            let sample = now.saturating_duration_since(start);
            let nearest = self.samples[..self.len]
                .iter()
                .map(|s| s.abs_diff(sample))
                .min();
            if let Some(error) = nearest {
                let error = error.min(MAX_ERROR);
                self.spread = if error > self.spread {
                    self.spread
                        .saturating_add(((error - self.spread) / 4).min(MAX_RISE))
                } else {
                    self.spread - (self.spread - error) / 32
                };
            }
            if nearest.is_none_or(|e| e > SAME) {
                self.samples[self.next] = sample;
                self.next = (self.next + 1) % SAMPLES;
                self.len = (self.len + 1).min(SAMPLES);
            }
        }
        // Never backwards: a head found done in one poll after its predecessor can carry an
        // earlier stamp (the thread that completed it got there first).
        self.last_done = Some(self.last_done.map_or(now, |last| last.max(now)));
    }
}

/// How late the reactor's timed sleeps end, short ones and long ones apart (a VM's vCPU that
/// stays idle for long halts, and takes longer to wake, than one idle for a moment). Each
/// estimate rises fast with a late sleep and falls slowly, so that it follows the late end of
/// the distribution rather than its middle.
#[derive(Debug)]
pub(super) struct Oversleep {
    short: Duration,
    long: Duration,
}

/// The most a single late sleep teaches.
const MAX_LEARNT_OVERSLEEP: Duration = Duration::from_micros(300);
/// Sleeps up to this long count as short.
const SHORT_SLEEP: Duration = Duration::from_micros(250);

impl Default for Oversleep {
    fn default() -> Self {
        // Guesses until the first sleeps are measured.
        Self {
            short: Duration::from_micros(10),
            long: Duration::from_micros(50),
        }
    }
}

impl Oversleep {
    /// How late a sleep of `asked` is expected to end.
    pub(super) fn get(&self, asked: Duration) -> Duration {
        if asked <= SHORT_SLEEP {
            self.short
        } else {
            self.long
        }
    }

    /// A sleep of `asked` ended after `slept`. One that ended early was cut short by the bell
    /// and says nothing.
    pub(super) fn slept(&mut self, asked: Duration, slept: Duration) {
        if slept < asked {
            return;
        }
        // A sleep that ends much later than that was a preemption, not the timer: learn it as
        // only that late, so one does not widen the windows for long.
        let late = (slept - asked).min(MAX_LEARNT_OVERSLEEP);
        let estimate = if asked <= SHORT_SLEEP {
            &mut self.short
        } else {
            &mut self.long
        };
        *estimate = if late > *estimate {
            estimate.saturating_add((late - *estimate) / 4)
        } else {
            *estimate - (*estimate - late) / 16
        };
    }
}

/// How long before the instant it sleeps towards the reactor's coarse sleep ends: room for a
/// long sleep that ends late (a VM's halted vCPU, a preemption) without missing the pre-wake or
/// the window. The rest is slept in steps of at most [`STEP`].
pub(super) const SETTLE: Duration = Duration::from_millis(1);
/// The longest of the short sleeps that follow the coarse one: short enough to count as a short
/// sleep (whose lateness is measured apart, and is smaller on a VM whose vCPU has not halted
/// for long).
pub(super) const STEP: Duration = Duration::from_micros(200);

/// How long to ask to sleep when the next planned instant is `until` away: a coarse sleep that
/// ends [`SETTLE`] before it while it is further than that and a step, else a step of at most
/// [`STEP`], asked shorter by the usual lateness of a sleep that long. Returns `(asked,
/// coarse)`.
///
/// In steps, the reactor wakes every [`STEP`] through the last [`SETTLE`] before each planned
/// instant (at most six wakeups, each a turn of the loop: a few µs of CPU), instead of once:
/// the price of never trusting a long sleep to end on time.
pub(super) fn sleep_toward(until: Duration, oversleep: &Oversleep) -> (Duration, bool) {
    if until > SETTLE + STEP {
        (until - SETTLE, true)
    } else {
        let step = until.min(STEP);
        (step.saturating_sub(oversleep.get(step)), false)
    }
}

/// Asks Linux to end this thread's timed sleeps on time (the default slack lets a sleep end up
/// to 50 µs late, which the prediction's margin would have to cover with polling).
pub(super) fn lower_timer_slack() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_TIMERSLACK takes an unsigned long and changes only this thread's slack.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
    }
}

/// The pre-wake lead before a candidate completion `sample` after the work could start: the
/// configured `lead`, or 1/40 of the sample if that is longer, at most four times `lead`. The
/// runtime's wake of a worker parked for long has a longer tail (`event_latency`'s baseline: a
/// task parked 2 ms took up to 290 to 370 µs at p99 to run again), so a fixed 250 µs lead
/// left the p99 to the task at 91.6 µs behind 20 ms kernels on an H200, and 500 µs brought it
/// to 29.4, while 500 µs behind 2 ms kernels cost more than it saved (p99 75 µs against 46:
/// tasks hurried too early). 1/40 gives 500 µs at 20 ms and keeps 250 at 2 ms.
pub(super) fn scaled_lead(lead: Duration, sample: Duration) -> Duration {
    // Saturating: a lead near `Duration::MAX` ("always hurry") would overflow the product and
    // panic the reactor's loop on every turn.
    lead.max(sample / 40).min(lead.saturating_mul(4))
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn learns_one_length_and_plans_around_it() {
        let t0 = Instant::now();
        let mut h = History::default();
        assert_eq!(h.plan(t0, t0, us(20)), Plan::None);
        h.completed(t0, t0 + us(2000), false);
        // The next head registered at 2.1 ms: predicted at 4.1 ms.
        let start = h.start(t0 + us(2100));
        assert_eq!(start, t0 + us(2100));
        let margin = h.margin();
        assert!(margin >= us(20), "{margin:?}");
        match h.plan(start, start + us(100), margin) {
            Plan::Ahead { completion, wake } => {
                assert_eq!(completion, t0 + us(4100));
                assert_eq!(wake, completion - margin);
            }
            p => panic!("{p:?}"),
        }
        assert!(matches!(
            h.plan(start, t0 + us(4100), margin),
            Plan::Hot { .. }
        ));
        assert_eq!(h.plan(start, t0 + us(4100) + margin, margin), Plan::None);
    }

    #[test]
    fn alternating_lengths_give_two_windows_and_batches_teach_nothing() {
        let t0 = Instant::now();
        let mut h = History::default();
        h.completed(t0, t0 + us(2000), false);
        h.completed(t0 + us(2000), t0 + us(2200), false);
        h.completed(t0 + us(2200), t0 + us(2200), true);
        assert_eq!(h.len, 2);
        let start = h.start(t0);
        assert_eq!(start, t0 + us(2200));
        let m = us(20);
        // Before the short window, then between the two, then past both.
        assert!(
            matches!(h.plan(start, start, m), Plan::Ahead { wake, .. } if wake == start + us(180))
        );
        assert!(
            matches!(h.plan(start, start + us(300), m), Plan::Ahead { wake, .. } if wake == start + us(1980))
        );
        assert_eq!(h.plan(start, start + us(2100), m), Plan::None);
    }

    #[test]
    fn sleeps_towards_an_instant_in_two_stages() {
        let o = Oversleep::default();
        // Far: a coarse sleep that ends SETTLE early.
        assert_eq!(sleep_toward(us(20_000), &o), (us(19_000), true));
        // Within SETTLE and a step: steps of STEP less the short lateness (10 µs at first).
        assert_eq!(sleep_toward(us(1_100), &o), (us(190), false));
        assert_eq!(sleep_toward(us(150), &o), (us(140), false));
        assert_eq!(sleep_toward(us(8), &o), (Duration::ZERO, false));
    }

    #[test]
    fn margin_follows_the_late_errors_and_the_hurry_outlasts_the_window() {
        let t0 = Instant::now();
        let mut h = History::default();
        h.completed(t0, t0 + us(2000), false);
        // Errors of 0 then 40 µs: the spread jumps a quarter of the way up, then decays slowly.
        let mut start = t0 + us(2000);
        h.completed(start, start + us(2000), false);
        assert_eq!(h.margin(), us(20));
        start += us(2000);
        assert_eq!(h.error(start, start + us(2040)), Some(40_000));
        h.completed(start, start + us(2040), false);
        assert_eq!(h.margin(), us(20 + 2 * 10));
        start += us(2040);
        assert_eq!(h.error(start, start + us(2001)), Some(1_000));
        h.completed(start, start + us(2001), false);
        assert!(h.margin() > us(35), "{:?}", h.margin());
        // The hurry runs from the lead before the earliest candidate to the lead after the
        // latest window.
        start += us(2001);
        let (m, lead) = (h.margin(), us(250));
        assert_eq!(
            h.hurry(start, start + us(1700), lead, m),
            (false, Some(start + us(1750)))
        );
        let first_end = start + us(2000) + m + lead;
        assert_eq!(
            h.hurry(start, start + us(2100), lead, m),
            (true, Some(first_end))
        );
        let end = start + us(2040) + m + lead;
        assert_eq!(h.hurry(start, first_end, lead, m), (true, Some(end)));
        assert_eq!(h.hurry(start, end, lead, m), (false, None));
    }

    /// A lead of `Duration::MAX` (`reactor_prewake`'s "always hurry") hurries from the moment
    /// the work could start and never stops by time; it used to overflow (`lead * 4`, then the
    /// hurry's end as an `Instant`) and panic the reactor's loop on every turn.
    #[test]
    fn a_lead_of_duration_max_hurries_from_the_start_and_never_stops_by_time() {
        let t0 = Instant::now();
        let mut h = History::default();
        h.completed(t0, t0 + us(2000), false);
        let start = h.start(t0 + us(2100));
        let m = h.margin();
        assert_eq!(scaled_lead(Duration::MAX, us(2000)), Duration::MAX);
        assert_eq!(h.hurry(start, start, Duration::MAX, m), (true, None));
        let later = start + Duration::from_secs(3600);
        assert_eq!(h.hurry(start, later, Duration::MAX, m), (true, None));
    }

    #[test]
    fn oversleep_follows_late_sleeps_short_and_long_apart() {
        let mut o = Oversleep::default();
        o.slept(us(1000), us(500));
        assert_eq!(o.get(us(1000)), us(50), "a sleep cut short says nothing");
        o.slept(us(1000), us(1250));
        assert_eq!(o.get(us(1000)), us(100));
        o.slept(us(1000), us(9000));
        assert_eq!(
            o.get(us(1000)),
            us(150),
            "a preemption teaches at most 300 µs"
        );
        assert_eq!(o.get(us(100)), us(10), "short sleeps are apart");
        for _ in 0..200 {
            o.slept(us(1000), us(1005));
        }
        assert!(o.get(us(1000)) < us(10), "{:?}", o.get(us(1000)));
    }
}
