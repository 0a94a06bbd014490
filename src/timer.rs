//! Deadlines for futures on any runtime: one lazily started thread that sleeps until the next
//! deadline and wakes its waker. Used by `Allocate::timeout`; not on any fast path.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::{Condvar, Mutex, OnceLock};
use std::task::Waker;
use std::time::Instant;

/// The deadlines. Every live deadline has one entry in `heap` and its waker in `wakers`; a
/// cancelled one (its `Deadline` dropped) has only its heap entry, which the timer thread
/// discards when it reaches the top and [`compact`](State::compact) once such entries
/// outnumber the live ones.
struct State {
    heap: BinaryHeap<Reverse<(Instant, u64)>>,
    wakers: HashMap<u64, Waker>,
    next_id: u64,
}

impl State {
    /// Rebuilds the heap without its cancelled entries once they outnumber the live ones. A
    /// cancelled entry would otherwise stay until it fell due (an hour for an hour's timeout
    /// served at once: a server waiting for memory thousands of times a second kept millions).
    /// A compaction costs the heap's length, less than twice the entries cancelled since the
    /// last one: a constant per drop, amortised.
    fn compact(&mut self) {
        let live = self.wakers.len();
        if self.heap.len().saturating_sub(live) > live {
            let wakers = &self.wakers;
            self.heap
                .retain(|&Reverse((_, id))| wakers.contains_key(&id));
        }
    }
}

struct Timer {
    state: Mutex<State>,
    changed: Condvar,
}

fn timer() -> &'static Timer {
    static TIMER: OnceLock<&'static Timer> = OnceLock::new();
    TIMER.get_or_init(|| {
        let timer: &'static Timer = Box::leak(Box::new(Timer {
            state: Mutex::new(State {
                heap: BinaryHeap::new(),
                wakers: HashMap::new(),
                next_id: 0,
            }),
            changed: Condvar::new(),
        }));
        std::thread::Builder::new()
            .name("sa-timer".into())
            .spawn(move || run(timer))
            .expect("streamalloc: the OS could not start the timer thread");
        timer
    })
}

fn run(timer: &'static Timer) {
    let mut state = timer.state.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let now = Instant::now();
        let mut due = Vec::new();
        while let Some(&Reverse((at, id))) = state.heap.peek() {
            // A cancelled entry on top goes now, not when it falls due: the thread then sleeps
            // towards the first live deadline, and wakes for no cancelled one it has not
            // already started to wait for.
            if at > now && state.wakers.contains_key(&id) {
                break;
            }
            state.heap.pop();
            if let Some(waker) = state.wakers.remove(&id) {
                due.push(waker);
            }
        }
        if !due.is_empty() {
            drop(state);
            for waker in due {
                // A waker that panics must not end this thread: every later deadline would
                // then never fire (a review's finding). Logged, as the reactor does.
                if let Err(payload) = crate::completion::catch_unwind(|| waker.wake()) {
                    tracing::error!(
                        panic = crate::completion::panic_message(&*payload),
                        "a waker panicked when its deadline fell due; the timer goes on"
                    );
                }
            }
            state = timer.state.lock().unwrap_or_else(|e| e.into_inner());
            continue;
        }
        state = match state.heap.peek() {
            Some(&Reverse((at, _))) => {
                timer
                    .changed
                    .wait_timeout(state, at.saturating_duration_since(now))
                    .unwrap_or_else(|e| e.into_inner())
                    .0
            }
            None => timer.changed.wait(state).unwrap_or_else(|e| e.into_inner()),
        };
    }
}

/// A registered deadline; dropping it cancels the wakeup.
#[derive(Debug)]
pub(crate) struct Deadline {
    id: u64,
}

impl Deadline {
    /// Wakes `waker` at `at` (or soon after).
    pub(crate) fn new(at: Instant, waker: &Waker) -> Deadline {
        let timer = timer();
        let mut state = timer.state.lock().unwrap_or_else(|e| e.into_inner());
        let id = state.next_id;
        state.next_id += 1;
        state.heap.push(Reverse((at, id)));
        state.wakers.insert(id, waker.clone());
        timer.changed.notify_one();
        Deadline { id }
    }

    /// Wakes this waker instead.
    pub(crate) fn set_waker(&self, waker: &Waker) {
        let mut state = timer().state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = state.wakers.get_mut(&self.id) {
            if !old.will_wake(waker) {
                *old = waker.clone();
            }
        }
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        // The heap entry stays for now (removing it from a binary heap costs its length);
        // without its waker it wakes nobody, and it goes when it reaches the top or with the
        // next compaction. No need to wake the timer thread: at worst it wakes once at this
        // entry's instant, as it would have.
        let mut state = timer().state.lock().unwrap_or_else(|e| e.into_inner());
        if state.wakers.remove(&self.id).is_some() {
            state.compact();
        }
    }
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::task::{Wake, Waker};
    use std::time::{Duration, Instant};

    use super::{timer, Deadline};

    struct Panics;
    impl Wake for Panics {
        fn wake(self: Arc<Self>) {
            panic!("a waker that panics (timer test)");
        }
    }

    struct Flag(AtomicBool);
    impl Wake for Flag {
        fn wake(self: Arc<Self>) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    /// A waker that panics when its deadline falls due does not stop the deadlines after it
    /// (a review found the timer thread ended by the panic, and every later deadline lost).
    #[test]
    fn a_panicking_waker_does_not_stop_the_timer() {
        let panics = Deadline::new(Instant::now(), &Waker::from(Arc::new(Panics)));
        std::thread::sleep(Duration::from_millis(50));
        let flag = Arc::new(Flag(AtomicBool::new(false)));
        let later = Deadline::new(
            Instant::now() + Duration::from_millis(10),
            &Waker::from(flag.clone()),
        );
        let start = Instant::now();
        while !flag.0.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            flag.0.load(Ordering::SeqCst),
            "the deadline after a panic never fired"
        );
        drop((panics, later));
    }

    /// How many entries the timer's heap holds, live and cancelled.
    fn heap_len() -> usize {
        timer()
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .heap
            .len()
    }

    /// A request that waits for memory with a long timeout and is served early drops its
    /// deadline; the deadline's heap entry used to stay until the timeout's instant. A server
    /// under memory backpressure (say 1,000 waits a second with
    /// `Allocate::timeout(Duration::from_secs(3600))`) kept 3.6 million dead entries, growing
    /// memory, and the timer thread woke once for each when it fell due. Here 100,000 cancelled
    /// deadlines must leave fewer than 1,000 entries (other tests' deadlines may be live).
    #[test]
    fn cancelled_deadlines_do_not_pile_up_in_the_heap() {
        let waker = Waker::from(Arc::new(Flag(AtomicBool::new(false))));
        let at = Instant::now() + Duration::from_secs(3600);
        let before = heap_len();
        for _ in 0..100_000 {
            drop(Deadline::new(at, &waker));
        }
        let left = heap_len().saturating_sub(before);
        assert!(
            left < 1_000,
            "100,000 cancelled deadlines left {left} entries in the timer's heap"
        );
    }
}
