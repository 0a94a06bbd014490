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
//! nearest candidate. Separately, the reactor asks for sleeps that much shorter than the time
//! to the window as its sleeps of that length end late (the OS and the hypervisor: measured on
//! every sleep, short and long apart, see [`Oversleep`]), so that it wakes when the window
//! opens.
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
    /// A running mean of how far completions fell from their nearest candidate.
    error: Duration,
}

/// Where a head stands against its stream's predictions at some instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Plan {
    /// No prediction: a stream without history, or past every window.
    None,
    /// Inside a hot window: poll in a hot loop. `until` ends the window; `completion` is the
    /// candidate in it.
    Hot { completion: Instant, until: Instant },
    /// Before the next window: sleep until `wake` (the window's start); `completion` is its
    /// candidate.
    Ahead { completion: Instant, wake: Instant },
}

impl History {
    /// When the GPU could start on the work in front of a head registered at `watched`.
    pub(super) fn start(&self, watched: Instant) -> Instant {
        self.last_done.map_or(watched, |done| done.max(watched))
    }

    /// The half-width of this stream's windows.
    pub(super) fn margin(&self) -> Duration {
        (self.error * 2 + MIN_MARGIN).min(MAX_MARGIN)
    }

    /// The plan at `now` for a head whose work could start at `start`.
    pub(super) fn plan(&self, start: Instant, now: Instant, margin: Duration) -> Plan {
        let mut best = Plan::None;
        for &sample in &self.samples[..self.len] {
            let completion = start + sample;
            let (from, until) = (
                completion - margin.min(completion - start),
                completion + margin,
            );
            if now >= until {
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
    /// `now` (some candidate is less than `lead` ahead, or its window still open), and the next
    /// instant at which that changes, if it does.
    pub(super) fn hurry(
        &self,
        start: Instant,
        now: Instant,
        lead: Duration,
        margin: Duration,
    ) -> (bool, Option<Instant>) {
        let (mut want, mut change): (bool, Option<Instant>) = (false, None);
        for &sample in &self.samples[..self.len] {
            let completion = start + sample;
            let from = completion - lead.min(completion - start);
            let until = completion + margin;
            let at = if now < from {
                from
            } else if now < until {
                want = true;
                until
            } else {
                continue;
            };
            change = Some(change.map_or(at, |c| c.min(at)));
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
                // A mean over about four completions.
                self.error = (self.error * 3 + error.min(MAX_ERROR)) / 4;
            }
            if nearest.is_none_or(|e| e > SAME) {
                self.samples[self.next] = sample;
                self.next = (self.next + 1) % SAMPLES;
                self.len = (self.len + 1).min(SAMPLES);
            }
        }
        self.last_done = Some(now);
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
            *estimate + (late - *estimate) / 4
        } else {
            *estimate - (*estimate - late) / 16
        };
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
