//! The deadlines' timer (src/timer.rs): the crate's `Timer` and `Deadline` themselves, on a
//! clock the model moves by hand (`Timer::manual`, `Timer::advance`: loom has no time, and its
//! timed wait never times out, so the clock ends the thread's timed sleep as the OS would).
//!
//! Three threads besides the model's, which only joins: the timer thread (`Timer::run`); a task
//! that registers a deadline at 1 ms, registers a second one at 1 ms and cancels it (drops its
//! `Deadline`), then waits for the first to wake it; and the clock, which moves from 0 to
//! 1 ms. Checked: the kept deadline wakes its task exactly once and only once the clock reads
//! 1 ms (a lost registration leaves the task waiting: a loom deadlock); a deadline cancelled
//! while the clock still read 0 is never woken (one cancelled later may be: the thread may have
//! taken its waker out, due, just before); and the thread ends once shut down.

use std::task::{Wake, Waker};

use loom::thread;

use super::{check_paths, must_fail, Seen, Shared};
use crate::sync::{Condvar, Mutex};
use crate::timer::{planted, Deadline, Timer};

/// A task's waker: counts its wakes, and lets the task block until the first.
struct TaskWaker {
    wakes: Mutex<usize>,
    woken: Condvar,
}

impl TaskWaker {
    fn new() -> (std::sync::Arc<TaskWaker>, Waker) {
        let task = std::sync::Arc::new(TaskWaker {
            wakes: Mutex::new(0),
            woken: Condvar::new(),
        });
        let waker = Waker::from(task.clone());
        (task, waker)
    }

    fn wakes(&self) -> usize {
        *self.wakes.lock()
    }

    /// Blocks until woken at least once.
    fn wait(&self) {
        let mut wakes = self.wakes.lock();
        while *wakes == 0 {
            wakes = self.woken.wait(wakes);
        }
    }
}

impl Wake for TaskWaker {
    fn wake(self: std::sync::Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &std::sync::Arc<Self>) {
        *self.wakes.lock() += 1;
        self.woken.notify_all();
    }
}

/// The model; notes whether the cancel came before the clock moved (`cancelled early`).
fn register_cancel_and_fire(seen: &Shared<Seen>) {
    let timer = Timer::manual();
    let runner = {
        let timer = timer.clone();
        thread::spawn(move || timer.run())
    };
    let (kept, kept_waker) = TaskWaker::new();
    let (dropped, dropped_waker) = TaskWaker::new();
    let task = {
        let timer = timer.clone();
        let kept = kept.clone();
        thread::spawn(move || {
            let deadline = Deadline::on(timer.clone(), timer.at(1), &kept_waker);
            let cancelled = Deadline::on(timer.clone(), timer.at(1), &dropped_waker);
            drop(cancelled);
            let early = timer.millis() == 0;
            kept.wait();
            assert!(
                timer.millis() >= 1,
                "a deadline at 1 ms woke its task at {} ms",
                timer.millis()
            );
            drop(deadline);
            early
        })
    };
    let clock = {
        let timer = timer.clone();
        thread::spawn(move || timer.advance(1))
    };
    let early = task.join().unwrap();
    clock.join().unwrap();
    timer.shut_down();
    runner.join().unwrap();
    assert_eq!(
        kept.wakes(),
        1,
        "the kept deadline must wake its task exactly once"
    );
    assert!(dropped.wakes() <= 1, "a deadline woke its task twice");
    if early {
        assert_eq!(
            dropped.wakes(),
            0,
            "a deadline cancelled before it fell due woke its task"
        );
    }
    seen.note("cancelled early", early);
    seen.note(
        "cancelled deadline woken (it was due)",
        dropped.wakes() == 1,
    );
}

const PATHS: &[&str] = &["cancelled early"];

/// The crate's timer: a deadline registered, another registered and cancelled, and the clock
/// reaching them, racing the timer thread. Preemption bound 2.
#[test]
fn register_cancel_and_fire_race() {
    check_paths(Some(2), PATHS, register_cancel_and_fire);
}

/// Bug: a new deadline does not notify the timer thread (`timer::planted::NEW_WITHOUT_NOTIFY`):
/// asleep with nothing to wait for, it never fires it, and the task waits for good.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_new_without_notify() {
    must_fail(
        module_path!(),
        "planted_new_without_notify",
        "deadlock",
        || {
            planted::NEW_WITHOUT_NOTIFY.store(true, std::sync::atomic::Ordering::Relaxed);
            check_paths(Some(2), PATHS, register_cancel_and_fire);
        },
    );
}

/// Bug: a cancelled deadline keeps its waker (`timer::planted::CANCEL_KEEPS_WAKER`): it is woken
/// when it falls due, after its `Deadline` was dropped.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_cancel_keeps_waker() {
    must_fail(
        module_path!(),
        "planted_cancel_keeps_waker",
        "a deadline cancelled before it fell due woke its task",
        || {
            planted::CANCEL_KEEPS_WAKER.store(true, std::sync::atomic::Ordering::Relaxed);
            check_paths(Some(2), PATHS, register_cancel_and_fire);
        },
    );
}

/// Bug: the thread takes a deadline less than a millisecond away for due
/// (`timer::planted::FIRES_EARLY`): the task is woken while the clock still reads 0.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_fires_early() {
    must_fail(
        module_path!(),
        "planted_fires_early",
        "a deadline at 1 ms woke its task at 0 ms",
        || {
            planted::FIRES_EARLY.store(true, std::sync::atomic::Ordering::Relaxed);
            check_paths(Some(2), PATHS, register_cancel_and_fire);
        },
    );
}
