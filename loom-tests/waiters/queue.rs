//! The queue under `Allocate`: a waiter woken by a free (never lost), FIFO order, cancellation
//! at every point; and the planted bugs, switches in the crate's `Wait::poll`
//! (`resource::wait::planted`) and `MemoryWaiters` (`resource::waiters::planted`).

use super::*;

/// One waiter, no memory; another thread frees enough for it. The free may come before the
/// waiter's first try, between its try and its registration (nobody to notify: the retry after
/// registering must find it), or after it registered (`notify` must wake it).
fn wake_on_free(seen: &Seen) {
    let waiters = Arc::new(Real::new());
    let memory = Arc::new(Memory::new(0));
    let freer = {
        let (waiters, memory) = (waiters.clone(), memory.clone());
        thread::spawn(move || memory.give(N, &waiters))
    };
    let mut a = Alloc::new(&*memory, &waiters);
    block_on(&mut a);
    seen.note(a.served.expect("served"), true);
    drop(a);
    freer.join().unwrap();
    settled(&waiters, &memory, 0);
}

/// Two waiters, A registered before B; memory for one comes back. A must be served first: it
/// then frees its block, which B gets. (`order` records who was served, in order.)
fn fifo(seen: &Seen) {
    let waiters = Arc::new(Real::new());
    let memory = Arc::new(Memory::new(0));
    let order = Arc::new(Mutex::new(Vec::new()));

    // A registers first (its try fails: nothing is free yet).
    let (_, waker) = CountingWaker::new();
    let mut a = Alloc::new(&*memory, &waiters);
    assert!(poll_once(&mut a, &waker).is_pending());
    let a_id = a.wait.id.take().expect("A is queued");
    drop(a);

    let first = {
        let (waiters, memory, order) = (waiters.clone(), memory.clone(), order.clone());
        thread::spawn(move || {
            // The same waiter, now awaited on its own thread with another waker.
            let mut a = Alloc::new(&*memory, &waiters);
            a.wait.id = Some(a_id);
            block_on(&mut a);
            order.lock().push("A");
            memory.give(N, &waiters);
        })
    };
    let freer = {
        let (waiters, memory) = (waiters.clone(), memory.clone());
        thread::spawn(move || memory.give(N, &waiters))
    };
    let mut b = Alloc::new(&*memory, &waiters);
    block_on(&mut b);
    seen.note(b.served.expect("served"), true);
    drop(b);
    order.lock().push("B");
    memory.give(N, &waiters);

    first.join().unwrap();
    freer.join().unwrap();
    assert_eq!(
        *order.lock(),
        ["A", "B"],
        "not served first come, first served"
    );
    settled(&waiters, &memory, N);
}

/// A waiter X is polled `polls` times on its own thread (0: dropped before it ever registers;
/// 1: dropped while queued, holding the baton if the free came first; 2: dropped after a
/// second poll, its retry with the baton) and then dropped, while another thread frees memory
/// for one and a waiter B awaits on this thread. If X got the memory, it frees it again. B must
/// be served whatever X did: a notification X took is passed on when X leaves.
fn cancel(polls: usize, seen: &Shared<Seen>) {
    let waiters = Arc::new(Real::new());
    let memory = Arc::new(Memory::new(0));
    let cancelled = {
        let (waiters, memory, seen) = (waiters.clone(), memory.clone(), seen.clone());
        thread::spawn(move || {
            let (counter, waker) = CountingWaker::new();
            let mut x = Alloc::new(&*memory, &waiters);
            for _ in 0..polls {
                if poll_once(&mut x, &waker).is_ready() {
                    memory.give(N, &waiters);
                    break;
                }
            }
            seen.note(
                WOKEN_THEN_CANCELLED,
                x.wait.id.is_some() && counter.wakes() > 0,
            );
            drop(x);
        })
    };
    let freer = {
        let (waiters, memory) = (waiters.clone(), memory.clone());
        thread::spawn(move || memory.give(N, &waiters))
    };
    let mut b = Alloc::new(&*memory, &waiters);
    block_on(&mut b);
    seen.note(b.served.expect("served"), true);
    drop(b);
    memory.give(N, &waiters);
    cancelled.join().unwrap();
    freer.join().unwrap();
    settled(&waiters, &memory, N);
}

/// X was woken (a notification: it held the baton then) and was dropped while queued.
const WOKEN_THEN_CANCELLED: &str = "X woken, then cancelled";

/// Exhaustive (no preemption bound). Every way to be served is taken.
#[test]
fn wake_on_free_one_waiter() {
    check_paths(None, &[FAST, RETRY, BATON], |seen| wake_on_free(seen));
}

/// Bound 3: 3 threads.
#[test]
fn fifo_two_waiters() {
    check_paths(Some(4), &[BATON], |seen| fifo(seen));
}

/// Bound 3: 3 threads; one run per cancellation point. Dropped after a poll, X is dropped
/// holding a notification in some executions, and B is served by the baton it passed on.
#[test]
fn cancel_at_every_point() {
    for polls in 0..=2 {
        let paths: &[&str] = if polls == 0 {
            &[FAST, RETRY, BATON]
        } else {
            &[WOKEN_THEN_CANCELLED, BATON]
        };
        check_paths(Some(3), paths, move |seen| cancel(polls, seen));
    }
}

/// Bug: `Wait::poll` (`resource::wait::planted::NO_RETRY`) registers without trying again: a free between the failed try and the
/// registration notified nobody.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_no_retry_after_register() {
    must_fail(
        module_path!(),
        "planted_no_retry_after_register",
        "deadlock",
        || {
            crate::resource::wait::planted::NO_RETRY
                .store(true, std::sync::atomic::Ordering::Relaxed);
            check_paths(None, &[], |seen| wake_on_free(seen))
        },
    );
}

/// Bug: `remove` does not pass the baton to the next waiter when the first leaves
/// (`resource::waiters::planted::NO_HAND_OFF`).
#[test]
#[ignore = "planted bug: must fail"]
fn planted_no_baton_hand_off() {
    must_fail(
        module_path!(),
        "planted_no_baton_hand_off",
        "deadlock",
        || {
            crate::resource::waiters::planted::NO_HAND_OFF
                .store(true, std::sync::atomic::Ordering::Relaxed);
            check_paths(Some(3), &[], |seen| cancel(1, seen))
        },
    );
}

/// Bug: no SeqCst fences in `register` and `notify` (`resource::waiters::planted::NO_FENCES`): the waiter's retry and the free's `notify`
/// can each miss the other's write (store buffering).
#[test]
#[ignore = "planted bug: must fail"]
fn planted_no_fences() {
    must_fail(module_path!(), "planted_no_fences", "deadlock", || {
        crate::resource::waiters::planted::NO_FENCES
            .store(true, std::sync::atomic::Ordering::Relaxed);
        check_paths(None, &[], |seen| wake_on_free(seen))
    });
}

/// Bug: the first try of a new waiter ignores the queue (`resource::wait::planted::BARGING`) (takes memory ahead of earlier
/// waiters).
#[test]
#[ignore = "planted bug: must fail"]
fn planted_barging() {
    must_fail(
        module_path!(),
        "planted_barging",
        "not served first come, first served",
        || {
            crate::resource::wait::planted::BARGING
                .store(true, std::sync::atomic::Ordering::Relaxed);
            check_paths(Some(3), &[], |seen| fifo(seen))
        },
    );
}
