//! Blocking work handed off the completion reactor: one lazily started thread per device.
//!
//! The reactor thread (`sa-reactor-N`) turns finished events into wakeups for every task and
//! deferred free of its device; anything that blocks it delays all of them. Yet some of the work
//! its callbacks start is a blocking driver call: a deferred free into [`CudaResource`] or
//! [`ManagedResource`] is `cuMemFree`, which waits until the whole device is idle. Such work
//! is handed to the device's *blocking-work thread* (`sa-blocking-N`) instead: started the
//! first time it is needed, it runs the jobs one at a time in the order they came, then parks
//! (no CPU while idle), and it exits once the device is gone and its queue is empty.
//!
//! [`run_blocking`](crate::device::run_blocking) (in the device layer, which names the device
//! this module must not) is the one call a resource needs: off the reactor it runs the job at once
//! and returns its result; on a reactor thread it queues the job, returns `Ok(())` and logs the
//! job's error, if any, at error level (the reactor's callers could only log it too). A job
//! that panics is caught and logged; the thread goes on with the next.
//!
//! The queue is written against `crate::sync`, so it compiles under loom like the reactor.
//!
//! [`CudaResource`]: crate::resource::cuda::CudaResource
//! [`ManagedResource`]: crate::resource::managed::ManagedResource

use std::cell::Cell;
use std::collections::VecDeque;

use crate::sync::thread;
use crate::sync::{Arc, Condvar, Mutex};

// Whether this thread is a completion reactor. A thread-local of loom's under loom, where every
// model thread runs on one OS thread.
#[cfg(not(streamalloc_loom))]
std::thread_local! {
    static ON_REACTOR: Cell<bool> = const { Cell::new(false) };
}
#[cfg(streamalloc_loom)]
loom::thread_local! {
    static ON_REACTOR: Cell<bool> = Cell::new(false);
}

/// Marks the calling thread as a completion reactor (`reactor::run` does, first thing).
pub(crate) fn mark_reactor_thread() {
    ON_REACTOR.with(|on| on.set(true));
}

/// Whether the calling thread is a completion reactor (of any device), where nothing may
/// block.
pub(crate) fn on_reactor_thread() -> bool {
    ON_REACTOR.with(Cell::get)
}

/// A job for the blocking-work thread.
pub(crate) type Job = Box<dyn FnOnce() + Send>;

/// The blocking-work queue of one device; the reactor handle owns it. Dropping it lets the
/// thread finish what is queued and exit.
pub(crate) struct Offload {
    /// The thread's name, `sa-blocking-N`.
    name: String,
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when a job is queued or the queue shuts down.
    ready: Condvar,
}

#[derive(Default)]
struct State {
    jobs: VecDeque<(&'static str, Job)>,
    /// Whether the thread was started (it is, from the first job on, until it exits).
    started: bool,
    /// Set when the owner is dropped: the thread exits once `jobs` is empty.
    shutdown: bool,
}

impl std::fmt::Debug for Offload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Offload")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Offload {
    /// A queue whose thread, once started, is called `name`. Starts nothing.
    pub(crate) fn new(name: String) -> Self {
        Self {
            name,
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                ready: Condvar::new(),
            }),
        }
    }

    /// How many jobs are queued and not started (the one running is not counted): for tests
    /// that bound what a resource queues.
    #[cfg(all(test, not(streamalloc_loom)))]
    pub(crate) fn queued(&self) -> usize {
        self.shared.state.lock().jobs.len()
    }

    /// Runs `job` on the blocking-work thread, after every job queued before it, starting the
    /// thread if this is the first. `what` names the job in the log of a panic. Never blocks
    /// on the job. If the OS cannot start the thread, the jobs run here instead (logged): late
    /// and blocking, but not lost.
    pub(crate) fn run(&self, what: &'static str, job: Job) {
        let mut state = self.shared.state.lock();
        state.jobs.push_back((what, job));
        if !state.started {
            let shared = self.shared.clone();
            match thread::Builder::new()
                .name(self.name.clone())
                .spawn(move || work(shared))
            {
                Ok(_) => state.started = true,
                Err(e) => {
                    let jobs = std::mem::take(&mut state.jobs);
                    drop(state);
                    tracing::error!(error = %e, thread = %self.name, "the OS could not start the blocking-work thread; running the job on this one");
                    for (what, job) in jobs {
                        run_job(what, job);
                    }
                    return;
                }
            }
        }
        drop(state);
        self.shared.ready.notify_one();
    }
}

impl Drop for Offload {
    fn drop(&mut self) {
        self.shared.state.lock().shutdown = true;
        self.shared.ready.notify_all();
    }
}

/// The blocking-work thread: runs jobs in order until shut down with none left.
fn work(shared: Arc<Shared>) {
    loop {
        let (what, job) = {
            let mut state = shared.state.lock();
            loop {
                if planted!(SHUTDOWN_BEFORE_DRAIN) && state.shutdown {
                    state.started = false;
                    return;
                }
                if let Some(next) = state.jobs.pop_front() {
                    break next;
                }
                if state.shutdown {
                    state.started = false;
                    return;
                }
                state = shared.ready.wait(state);
            }
        };
        run_job(what, job);
    }
}

/// Runs one job; a panic in it is caught and logged.
fn run_job(what: &'static str, job: Job) {
    if let Err(payload) = crate::completion::catch_unwind(job) {
        tracing::error!(
            job = what,
            panic = crate::completion::panic_message(&*payload),
            "a panic in blocking work handed off the completion reactor was caught"
        );
    }
}

/// A bug the loom model plants (`loom-tests/reactor/offload.rs`), constant off otherwise; read
/// through `planted!`.
#[cfg(streamalloc_loom)]
pub(crate) mod planted {
    /// The thread looks at `shutdown` before it drains its queue: jobs queued before the owner
    /// was dropped are dropped without running (a deferred `cuMemFree` lost).
    pub(crate) static SHUTDOWN_BEFORE_DRAIN: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);
}
