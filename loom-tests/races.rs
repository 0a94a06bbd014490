//! The race detector's one protocol between threads: how the host learns that a stream reached
//! an event (src/device/sim/marker.rs, `SimMarker::seen_by_host` and `checked_by_crate`, both
//! through `join_once`).
//!
//! Two kinds of observer, two clocks, one flag each. The user's code (an event awaited to
//! completion, queried or synchronized on) joins the marker's clock into the host clock, which
//! every stream then joins at its next operation. The crate's own looks (the completion
//! reactor's poll, `on_complete` for a staging block or a deferred free) join it into the
//! crate's clock, which no stream joins: a review found the user's unordered cross-stream read
//! unreported once the crate had looked. Each observer joins, then sets its kind's flag, so
//! later observers of that kind skip the join.
//!
//! The properties: a thread that has seen the marker reached, and then queues work, finds the
//! marker's clock in the host clock, else work that really runs after the event is reported
//! as unordered (a false race: the detector found this one in the arena's stress test); and
//! the crate's look before the user's (the reactor completes the event, the user's poll then
//! returns Ready) neither skips the user's join nor joins the host clock itself.
//!
//! src keeps the flags and the detector's state in plain std primitives (loom must not see the
//! detector's bookkeeping in users' models), so this runs a copy of the protocol on loom's:
//! `observe` below must follow `join_once`.

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::{Arc, Mutex};

use super::{check, must_fail};

/// The marker's clock, in the one component that matters here.
const CLOCK: u32 = 7;

#[derive(Default)]
struct Marker {
    /// `SimMarker::seen`: the user's code joined the host clock.
    seen: AtomicBool,
    /// `SimMarker::checked`: the crate joined its own clock.
    checked: AtomicBool,
    /// The event's `Completion`: set once the crate (the reactor) has seen it reached.
    complete: AtomicBool,
}

#[derive(Default)]
struct Host {
    /// The detector's host clock, as one number.
    clock: Mutex<u32>,
    /// The detector's crate clock, as one number.
    by_crate: Mutex<u32>,
}

/// `SimMarker::join_once`: joins `CLOCK` into `clock` unless `flag` says it was. `planted`: the
/// flag is taken before the join (a `swap`), so a second observer skips the join that the
/// first has not made yet.
fn observe(flag: &AtomicBool, clock: &Mutex<u32>, planted: bool) {
    let join = || {
        let mut clock = clock.lock().unwrap();
        *clock = (*clock).max(CLOCK);
    };
    if planted {
        if !flag.swap(true, Ordering::AcqRel) {
            join();
        }
    } else if !flag.load(Ordering::Acquire) {
        join();
        flag.store(true, Ordering::Release);
    }
}

/// Two host threads see the marker reached, then each queues work (reads the host clock, as a
/// stream's next operation does).
fn two_observers(planted: bool) {
    let marker = Arc::new(Marker::default());
    let host = Arc::new(Host::default());
    let other = {
        let (marker, host) = (marker.clone(), host.clone());
        loom::thread::spawn(move || {
            observe(&marker.seen, &host.clock, planted);
            *host.clock.lock().unwrap()
        })
    };
    observe(&marker.seen, &host.clock, planted);
    let mine = *host.clock.lock().unwrap();
    let theirs = other.join().unwrap();
    assert!(
        mine >= CLOCK && theirs >= CLOCK,
        "work queued after seeing the event is not ordered after it (host clock {mine} and \
         {theirs}, event {CLOCK})"
    );
}

/// Exhaustive: 2 threads.
#[test]
fn host_join_before_seen() {
    check(None, || two_observers(false));
}

#[test]
#[ignore = "a planted bug: run with --ignored"]
fn planted_seen_before_join() {
    must_fail(
        module_path!(),
        "planted_seen_before_join",
        "work queued after seeing the event is not ordered after it",
        || check(None, || two_observers(true)),
    );
}

/// The reactor (the crate) sees the marker reached, joins the crate's clock and completes the
/// event; the user's task, polling, finds it complete and returns Ready (`Event::poll`, which
/// then calls `seen_by_host`), and queues work. `planted`: one flag for both kinds (the crate's
/// look sets the flag the user's checks), so the user's join is skipped.
fn crate_then_user(planted: bool) {
    let marker = Arc::new(Marker::default());
    let host = Arc::new(Host::default());
    let reactor = {
        let (marker, host) = (marker.clone(), host.clone());
        loom::thread::spawn(move || {
            let flag = if planted {
                &marker.seen
            } else {
                &marker.checked
            };
            observe(flag, &host.by_crate, false);
            marker.complete.store(true, Ordering::Release);
        })
    };
    while !marker.complete.load(Ordering::Acquire) {
        loom::thread::yield_now();
    }
    observe(&marker.seen, &host.clock, false);
    let mine = *host.clock.lock().unwrap();
    reactor.join().unwrap();
    assert!(
        mine >= CLOCK,
        "the user's poll returned Ready without joining the host clock (host clock {mine}, \
         event {CLOCK})"
    );
    assert_eq!(
        *host.by_crate.lock().unwrap(),
        CLOCK,
        "the crate's look did not join its clock"
    );
}

/// Exhaustive: 2 threads.
#[test]
fn user_joins_after_the_crates_look() {
    check(None, || crate_then_user(false));
}

#[test]
#[ignore = "a planted bug: run with --ignored"]
fn planted_one_flag_for_both_observers() {
    must_fail(
        module_path!(),
        "planted_one_flag_for_both_observers",
        "the user's poll returned Ready without joining the host clock",
        || check(None, || crate_then_user(true)),
    );
}
