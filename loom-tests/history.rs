//! Models of the history recorder (`Recorder` in src/resource/adaptor/history.rs): the ring of
//! events and the table of live allocations that `HistoryAdaptor` keeps behind one lock, with
//! an on/off switch read without it.
//!
//! What must hold in every interleaving:
//! - a free forgets its allocation *before* the memory goes back upstream: once it is back,
//!   another thread may get the same address and record it, and a late forget would erase that
//!   live allocation (a snapshot would then show it as untracked);
//! - after `stop`, the live table is empty and stays so: an allocation that raced with the
//!   stop must not add an entry that no free will ever remove.
//!
//! The upstream is one address in an `AtomicBool` (taken or not). Threads: 2 per model;
//! bound 3.

use loom::thread;

use super::{check_paths, must_fail, Seen, Shared};
use crate::resource::adaptor::{HistoryOptions, Recorder};
use crate::sync::{Arc, AtomicBool, Ordering};

const P: u64 = 0x1000;

/// The upstream: one block, taken or free.
struct Upstream(AtomicBool);

impl Upstream {
    fn take(&self) -> bool {
        self.0
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    fn give(&self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Thread A frees P (live and recorded), thread B allocates from the upstream and records what
/// it got. `forget_first`: the adaptor's order (forget, then give upstream); false plants the
/// bug (give, then forget).
fn free_vs_reuse(seen: &Shared<Seen>, forget_first: bool) {
    let recorder = Arc::new(Recorder::new(&HistoryOptions {
        capacity: 4,
        ..HistoryOptions::default()
    }));
    recorder.start();
    let upstream = Arc::new(Upstream(AtomicBool::new(true)));
    recorder.allocated(P, 256, 1);
    let (r, u) = (recorder.clone(), upstream.clone());
    let a = thread::spawn(move || {
        if forget_first {
            r.freeing(P, 256, 1);
            u.give();
        } else {
            u.give();
            r.freeing(P, 256, 1);
        }
    });
    let (r, u) = (recorder.clone(), upstream.clone());
    let b = thread::spawn(move || {
        let got = u.take();
        if got {
            r.allocated(P, 512, 2);
        }
        got
    });
    a.join().unwrap();
    let reused = b.join().unwrap();
    seen.note("reused", reused);
    seen.note("not reused", !reused);
    assert_eq!(
        recorder.live_count(),
        usize::from(reused),
        "the live table lost (or kept) an allocation: reused = {reused}"
    );
}

#[test]
fn free_forgets_before_the_memory_goes_back() {
    check_paths(Some(3), &["reused", "not reused"], |seen| {
        free_vs_reuse(seen, true)
    });
}

#[test]
#[ignore = "planted bug: loom must catch it"]
fn planted_forget_after_the_memory_went_back() {
    must_fail(
        module_path!(),
        "planted_forget_after_the_memory_went_back",
        "the live table lost",
        || {
            check_paths(Some(3), &[], |seen| free_vs_reuse(seen, false));
        },
    );
}

#[test]
fn stop_vs_allocate_leaves_no_stale_entry() {
    check_paths(Some(3), &["recorded", "stopped first"], |seen| {
        let recorder = Arc::new(Recorder::new(&HistoryOptions::default()));
        recorder.start();
        let r = recorder.clone();
        let a = thread::spawn(move || {
            // The adaptor's allocate: the upstream returned P, then it records if on.
            if r.is_on() {
                r.allocated(P, 256, 1);
            }
        });
        let r = recorder.clone();
        let c = thread::spawn(move || r.stop());
        a.join().unwrap();
        c.join().unwrap();
        let events = recorder.history().events.len();
        seen.note("recorded", events == 1);
        seen.note("stopped first", events == 0);
        assert!(!recorder.is_on());
        assert_eq!(recorder.live_count(), 0, "a stale live entry after stop");
    });
}
