//! Models of the deferred free of a buffer used on several streams (src/buffer.rs,
//! `DeviceBuffer`'s Drop): an event is recorded on each stream that used the buffer, and the
//! memory goes back once all of them have completed, through `release_after_all`, a countdown
//! over the events' `on_complete` callbacks.
//!
//! The events are the crate's `Completion`s (what every handle of a recorded event shares), and
//! `on_complete` does what `Event::on_complete` does minus the device query and the reactor:
//! run the callback now if the event is complete, else store it (or run it, if `complete` got
//! there first). Each "GPU" thread writes the buffer's memory (a loom `UnsafeCell`: its use on
//! that stream) and then completes its event, as the reactor does once the GPU reaches it. The
//! free reads and rewrites that memory (the next user's data), so a free not ordered after a
//! use is a loom causality violation, besides the model's own checks: the free runs exactly
//! once, and only after both events completed.
//!
//! Threads: the dropping thread (the model's main) and two GPU threads. Exhaustive.

use loom::cell::UnsafeCell;
use loom::thread;

use super::{check_paths, must_fail, Seen, Shared};
use crate::buffer::{free_planted as planted, release_after_all};
use crate::completion::{Callback, Completion};
use crate::sync::{Arc, AtomicUsize, Ordering};

type Ev = Arc<Completion>;

/// `Event::on_complete` without the device query and the reactor.
fn on_complete(event: &Ev, callback: Callback) {
    if let Some(result) = event.result() {
        return callback(&result);
    }
    match event.register_callback(callback) {
        Ok(_) => {}
        Err((callback, result)) => callback(&result),
    }
}

/// The buffer's memory, one byte per stream that used it, set to 1 by that stream's use.
/// Written by the GPU threads and by the free, so loom checks they are ordered.
struct Memory {
    uses: [UnsafeCell<u8>; 2],
}

// SAFETY: a test double; loom checks every access to the cells for races, which is the point.
unsafe impl Sync for Memory {}

/// The free ran on the dropping thread (every event had completed when its callback was
/// registered, or completed during the registrations) or on a GPU thread (the last `complete`).
const ON_DROPPING_THREAD: &str = "freed on the dropping thread";
const ON_GPU_THREAD: &str = "freed on a GPU thread";

/// The model, with `bug` (a switch of `buffer::free_planted`, `None` for none) switched on in
/// src. A planted test runs in a child process of its own (`must_fail`), so a switch stays on
/// only there.
fn deferred_free(bug: Option<&'static std::sync::atomic::AtomicBool>, seen: &Shared<Seen>) {
    if let Some(bug) = bug {
        bug.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    let events: Vec<Ev> = vec![Arc::new(Completion::new()), Arc::new(Completion::new())];
    let memory = Arc::new(Memory {
        uses: [UnsafeCell::new(0), UnsafeCell::new(0)],
    });
    let frees = Arc::new(AtomicUsize::new(0));

    // The streams' uses were queued before the drop: the GPU runs them and then reaches the
    // events, racing the drop's registrations.
    let gpus: Vec<_> = (0..2)
        .map(|i| {
            let (memory, event) = (memory.clone(), events[i].clone());
            thread::spawn(move || {
                memory.uses[i].with_mut(|byte| {
                    // SAFETY: a loom cell; loom reports a racing access.
                    unsafe { *byte = 1 }
                });
                assert!(event.complete(Ok(())));
            })
        })
        .collect();

    // The drop: record the events (done above), then free after all of them.
    let dropping = thread::current().id();
    let release = {
        let (memory, frees, events, seen) =
            (memory.clone(), frees.clone(), events.clone(), seen.clone());
        move || {
            if thread::current().id() == dropping {
                seen.note(ON_DROPPING_THREAD, true);
            } else {
                seen.note(ON_GPU_THREAD, true);
            }
            assert!(
                events.iter().all(|e| e.result().is_some()),
                "freed before every event completed"
            );
            for cell in &memory.uses {
                cell.with_mut(|byte| {
                    // SAFETY: a loom cell; loom reports a racing access.
                    unsafe {
                        assert_eq!(*byte, 1, "freed before a use ran");
                        *byte = 0;
                    }
                });
            }
            frees.fetch_add(1, Ordering::SeqCst);
        }
    };
    release_after_all(&events, release, on_complete);

    for gpu in gpus {
        gpu.join().unwrap();
    }
    assert_eq!(
        frees.load(Ordering::SeqCst),
        1,
        "the memory must be freed exactly once"
    );
}

/// Exhaustive (no preemption bound).
#[test]
fn free_after_two_events() {
    check_paths(None, &[ON_DROPPING_THREAD, ON_GPU_THREAD], |seen| {
        deferred_free(None, seen)
    });
}

// ---------------------------------------------------------------------------------------------
// Planted bugs: the same model with one bug switched on in src/buffer/free.rs's
// `release_after_all` (`buffer::free_planted`; until the eighteenth session, a copy).
// ---------------------------------------------------------------------------------------------

/// Bug: the count starts at zero and goes up as each callback is registered.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_count_up_while_registering() {
    must_fail(
        module_path!(),
        "planted_count_up_while_registering",
        "freed before every event completed",
        || {
            check_paths(None, &[], |seen| {
                deferred_free(Some(&planted::COUNT_UP), seen)
            })
        },
    );
}

/// Bug: the decrement tests the value after it (`== 0` on what `fetch_sub` returns, the value
/// before): nobody ever frees.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_wrong_comparison() {
    must_fail(
        module_path!(),
        "planted_wrong_comparison",
        "freed exactly once",
        || {
            check_paths(None, &[], |seen| {
                deferred_free(Some(&planted::WRONG_COMPARISON), seen)
            })
        },
    );
}

/// Bug: the first event to complete frees.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_free_on_first_event() {
    must_fail(
        module_path!(),
        "planted_free_on_first_event",
        "freed before every event completed",
        || {
            check_paths(None, &[], |seen| {
                deferred_free(Some(&planted::FIRST_EVENT), seen)
            })
        },
    );
}

/// Bug: the decrement is `Relaxed`: the callback that frees does not acquire what the other
/// event's thread did before its decrement (its `complete`, and its stream's use of the memory).
#[test]
#[ignore = "planted bug: must fail"]
fn planted_relaxed_countdown() {
    must_fail(
        module_path!(),
        "planted_relaxed_countdown",
        "freed before every event completed",
        || {
            check_paths(None, &[], |seen| {
                deferred_free(Some(&planted::RELAXED), seen)
            })
        },
    );
}
