//! The blocking-work queue that takes `cuMemFree` off the reactor thread (src/offload.rs).

use super::*;

/// The model: two threads hand over jobs (the first starts the worker thread) while the
/// queue's owner is dropped.
fn jobs_vs_shutdown() {
    use crate::offload::{Job, Offload};

    fn job(after: Option<Arc<AtomicBool>>, done: Arc<AtomicBool>) -> Job {
        let guard = MustRun {
            ran: Arc::new(AtomicUsize::new(0)),
        };
        Box::new(move || {
            if let Some(before) = after {
                assert!(before.load(Ordering::SeqCst), "jobs out of order");
            }
            done.store(true, Ordering::SeqCst);
            guard.ran.fetch_add(1, Ordering::SeqCst);
        })
    }

    let offload = Arc::new(Offload::new("sa-blocking-loom".to_string()));
    let other = {
        let offload = offload.clone();
        let late = job(None, Arc::new(AtomicBool::new(false)));
        thread::spawn(move || offload.run("loom: the other thread's job", late))
    };
    let a_done = Arc::new(AtomicBool::new(false));
    let a = job(None, a_done.clone());
    let b = job(Some(a_done), Arc::new(AtomicBool::new(false)));
    offload.run("loom: job a", a);
    offload.run("loom: job b", b);
    drop(offload);
    other.join().unwrap();
}

/// The blocking-work queue (src/offload.rs), on the crate's `Offload`: two threads hand over
/// jobs (the first one starts the worker thread) while the queue's owner is dropped, as a
/// device goes away while its reactor still hands off frees. Every job runs exactly once
/// (`MustRun`), one thread's jobs in the order given, and the worker exits (loom requires every
/// thread to finish: a worker that misses the shutdown is a deadlock). Preemption bound 3.
#[test]
fn offload_jobs_vs_shutdown() {
    check(Some(3), jobs_vs_shutdown);
}

/// Bug: the worker looks at `shutdown` before it drains its queue
/// (`offload::planted::SHUTDOWN_BEFORE_DRAIN`): a job queued before the owner went away is
/// dropped without running (a deferred `cuMemFree` lost).
#[test]
#[ignore = "planted bug: must fail"]
fn planted_shutdown_before_drain() {
    must_fail(
        module_path!(),
        "planted_shutdown_before_drain",
        "a deferred callback was dropped without running",
        || {
            crate::offload::planted::SHUTDOWN_BEFORE_DRAIN
                .store(true, std::sync::atomic::Ordering::Relaxed);
            check(Some(3), jobs_vs_shutdown);
        },
    );
}
