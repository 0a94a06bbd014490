//! A waker that a waiting future stored is dropped after the lock it was stored under: a
//! waker's drop is the executor's code, and where it is a task's last handle it drops the
//! task's future, which may be another wait on the same queue or timer, whose drop takes that
//! lock again. A review found both the memory waiters' queue and the process-wide timer
//! deadlocked so (the timer then never fired again for any deadline in the process).

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Wake, Waker};
use std::time::Duration;

use streamalloc::{AllocateAsync, Device, DevicePtr, MemoryResource, SimConfig};

const MIB: usize = 1 << 20;

type Wait = Pin<Box<dyn Future<Output = streamalloc::Result<DevicePtr>> + Send>>;

/// A task as futures-style executors keep one: its future lives in the task, and goes when
/// the task's last waker goes.
struct Task(#[allow(dead_code)] Mutex<Option<Wait>>);

impl Wake for Task {
    fn wake(self: Arc<Self>) {}
}

/// How the first wait stops holding the task's waker.
#[derive(Clone, Copy)]
enum Then {
    /// Polled again by another task: the stored waker is replaced.
    PolledElsewhere,
    /// Dropped (cancelled): its entry leaves the queue, and its deadline is cancelled.
    Dropped,
}

/// A pool at its maximum and two waits for memory (with a deadline if `timed`): the second
/// lives in a task, whose only waker the first stores, then lets go of as `then` says. The
/// scene runs on a thread of its own, so that a deadlock fails the test instead of hanging it.
fn a_stored_waker_owns_another_wait(timed: bool, then: Then) {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let device = Device::simulated(SimConfig::default());
        let pool = Arc::new(common::waiting_pool(&device, 4 * MIB, 4 * MIB));
        let s = device.create_stream().unwrap();
        let held = pool.allocate(4 * MIB, &s).unwrap();
        let wait = || -> Wait {
            let (pool, s) = (pool.clone(), s.clone());
            Box::pin(async move {
                let wait = pool.allocate_async(MIB, &s);
                if timed {
                    wait.timeout(Duration::from_secs(3600)).await
                } else {
                    wait.await
                }
            })
        };
        let mut second = wait();
        let mut noop = Context::from_waker(Waker::noop());
        assert!(second.as_mut().poll(&mut noop).is_pending());
        let task = Waker::from(Arc::new(Task(Mutex::new(Some(second)))));
        let mut first = wait();
        assert!(first
            .as_mut()
            .poll(&mut Context::from_waker(&task))
            .is_pending());
        // The task is now held only by what the first wait stored.
        drop(task);
        match then {
            Then::PolledElsewhere => {
                assert!(first.as_mut().poll(&mut noop).is_pending());
                drop(first);
            }
            Then::Dropped => drop(first),
        }
        common::free(&*pool, held, 4 * MIB, &s);
        let _ = done.send(());
    });
    // Not a timing threshold: the scene takes milliseconds, a deadlock for ever.
    assert!(
        finished.recv_timeout(Duration::from_secs(60)).is_ok(),
        "deadlocked: a stored waker was dropped under the lock its drop takes"
    );
}

#[test]
fn a_waiters_replaced_waker_may_drop_another_wait() {
    a_stored_waker_owns_another_wait(false, Then::PolledElsewhere);
}

#[test]
fn a_cancelled_waiters_waker_may_drop_another_wait() {
    a_stored_waker_owns_another_wait(false, Then::Dropped);
}

#[test]
fn a_deadlines_replaced_waker_may_drop_another_timed_wait() {
    a_stored_waker_owns_another_wait(true, Then::PolledElsewhere);
}

#[test]
fn a_cancelled_deadlines_waker_may_drop_another_timed_wait() {
    a_stored_waker_owns_another_wait(true, Then::Dropped);
}
