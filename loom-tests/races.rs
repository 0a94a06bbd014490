//! The race detector's one protocol between threads: how the host learns that a stream reached
//! an event (src/device/sim/stream.rs, `SimMarker::seen_by_host`).
//!
//! Every host thread that sees a marker reached (the reactor's query, a blocking wait, a
//! `query` of the event) joins the marker's clock into the host clock, which every stream then
//! joins at its next operation. The marker's `seen` flag saves the join after the first one.
//! The property: a thread that has seen the marker reached, and then queues work, finds the
//! marker's clock in the host clock; else work that really runs after the event is reported as
//! unordered (a false race: the detector found this one in the arena's stress test).
//!
//! src keeps `seen` and the detector's state in plain std primitives (loom must not see the
//! detector's bookkeeping in users' models), so this runs a copy of the protocol on loom's:
//! `observe` below must follow `seen_by_host`.

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::{Arc, Mutex};

use super::{check, must_fail};

/// The marker's clock, in the one component that matters here.
const CLOCK: u32 = 7;

#[derive(Default)]
struct Marker {
    seen: AtomicBool,
}

#[derive(Default)]
struct Host {
    clock: Mutex<u32>,
}

/// `SimMarker::seen_by_host`, with the detector's host clock as one number. `planted`: the flag
/// is taken before the join (a `swap`), so a second observer skips the join that the first has
/// not made yet.
fn observe(marker: &Marker, host: &Host, planted: bool) {
    let join = || {
        let mut clock = host.clock.lock().unwrap();
        *clock = (*clock).max(CLOCK);
    };
    if planted {
        if !marker.seen.swap(true, Ordering::AcqRel) {
            join();
        }
    } else if !marker.seen.load(Ordering::Acquire) {
        join();
        marker.seen.store(true, Ordering::Release);
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
            observe(&marker, &host, planted);
            *host.clock.lock().unwrap()
        })
    };
    observe(&marker, &host, planted);
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
