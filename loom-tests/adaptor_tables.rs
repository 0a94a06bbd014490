//! The tables of the adaptors that remember what they handed out: `TrackingAdaptor`'s live
//! allocations (src/resource/adaptor/tracking.rs), `AlignedAdaptor`'s origins
//! (src/resource/adaptor/aligned.rs) and `HistoryAdaptor`'s live table
//! (src/resource/adaptor/history.rs: `history.rs` models its recorder with the adaptor's order
//! written in the model; this runs the adaptor's own `deallocate`). A free must forget its allocation before the
//! memory goes back upstream: once it is there another thread may get the same address and
//! record it, and a late forget erases that thread's entry (the history recorder's protocol,
//! `history.rs`, here on the adaptor itself).
//!
//! The crate's adaptor over a `PoolResource` of one block on the simulated device run inline
//! (its race detector in the `Panic` mode): a second request gets the same address once the
//! first is freed, or is out of memory.

use loom::thread;

use super::{check_paths, must_fail, Seen, Shared};
use crate::resource::adaptor::{AlignedAdaptor, HistoryAdaptor, HistoryOptions, TrackingAdaptor};
use crate::resource::cuda::CudaResource;
use crate::resource::pool::{PoolOptions, PoolResource};
use crate::sync::Arc;
use crate::{Device, MemoryResource, RaceDetection, SimConfig, Stream};

const BLOCK: usize = 256;

const REUSED: &str = "the freed address handed out again";
const REFUSED: &str = "out of memory before the free";

/// A pool of `bytes` (its initial size and its maximum) on a new simulated device, and a
/// stream of that device.
fn pool(bytes: usize) -> (PoolResource<CudaResource>, Stream) {
    let device = Device::simulated(SimConfig {
        race_detection: RaceDetection::Panic,
        ..SimConfig::default()
    });
    let pool = PoolResource::new(
        CudaResource::new(&device),
        PoolOptions {
            initial: bytes,
            maximum: Some(bytes),
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let stream = device.create_stream().unwrap();
    (pool, stream)
}

/// A thread frees the one block while the model's thread asks for one (on the same stream:
/// reuse needs no ordering). The table holds the new allocation iff it was served, and its
/// free is accepted.
fn tracking_free_vs_reuse(seen: &Shared<Seen>) {
    let (upstream, s) = pool(BLOCK);
    let tracking = Arc::new(TrackingAdaptor::new(upstream));
    let p = tracking.allocate(BLOCK, &s).unwrap();
    let freer = {
        let (tracking, s) = (tracking.clone(), s.clone());
        // SAFETY: allocated above with these bytes, unused, freed once.
        thread::spawn(move || unsafe { tracking.deallocate(p, BLOCK, &s) }.unwrap())
    };
    let q = tracking.allocate(BLOCK, &s).ok();
    freer.join().unwrap();
    seen.note(REUSED, q.is_some());
    seen.note(REFUSED, q.is_none());
    let expected: Vec<(crate::DevicePtr, usize)> = q.iter().map(|&q| (q, BLOCK)).collect();
    assert_eq!(
        tracking.outstanding(),
        expected,
        "the table lost (or kept) an allocation"
    );
    assert_eq!(tracking.allocated_bytes(), BLOCK * expected.len());
    if let Some(q) = q {
        // SAFETY: allocated above with these bytes, unused, freed once.
        unsafe { tracking.deallocate(q, BLOCK, &s) }
            .unwrap_or_else(|e| panic!("a good free was refused: {e}"));
    }
    assert_eq!(tracking.outstanding_count(), 0);
    s.synchronize_blocking().unwrap();
}

#[test]
fn tracking_free_forgets_before_the_memory_goes_back() {
    check_paths(Some(2), &[REUSED, REFUSED], tracking_free_vs_reuse);
}

/// Bug: the tracking adaptor gives the memory back upstream before it forgets the entry
/// (`tracking_planted::FORGET_AFTER_UPSTREAM`): the other thread's new entry is the one erased.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_tracking_forgets_after_upstream() {
    must_fail(
        module_path!(),
        "planted_tracking_forgets_after_upstream",
        "the table lost (or kept) an allocation",
        || {
            crate::resource::adaptor::tracking_planted::FORGET_AFTER_UPSTREAM
                .store(true, std::sync::atomic::Ordering::Relaxed);
            check_paths(Some(2), &[], tracking_free_vs_reuse);
        },
    );
}

/// The alignment of the aligned adaptor: each of its allocations of a block takes a block and
/// the slack to slide it up to this from the upstream.
const ALIGN: usize = 2 * BLOCK;

/// The same for the aligned adaptor: the upstream holds one aligned allocation's padded size.
/// The new allocation's origin must be in the table: its free is accepted (a lost origin makes
/// it an unknown pointer) and gives the memory back (the pool can serve the next one).
fn aligned_free_vs_reuse(seen: &Shared<Seen>) {
    let (upstream, s) = pool(ALIGN + ALIGN - BLOCK);
    let aligned = Arc::new(AlignedAdaptor::new(upstream, ALIGN).unwrap());
    let p = aligned.allocate(BLOCK, &s).unwrap();
    let freer = {
        let (aligned, s) = (aligned.clone(), s.clone());
        // SAFETY: allocated above with these bytes, unused, freed once.
        thread::spawn(move || unsafe { aligned.deallocate(p, BLOCK, &s) }.unwrap())
    };
    let q = aligned.allocate(BLOCK, &s).ok();
    freer.join().unwrap();
    seen.note(REUSED, q.is_some());
    seen.note(REFUSED, q.is_none());
    if let Some(q) = q {
        assert!(q.0.is_multiple_of(ALIGN as u64), "{q:?}");
        // SAFETY: allocated above with these bytes, unused, freed once.
        unsafe { aligned.deallocate(q, BLOCK, &s) }
            .unwrap_or_else(|e| panic!("a good free was refused: {e}"));
    }
    let last = aligned.allocate(BLOCK, &s).unwrap();
    // SAFETY: as above.
    unsafe { aligned.deallocate(last, BLOCK, &s) }.unwrap();
    s.synchronize_blocking().unwrap();
}

#[test]
fn aligned_free_forgets_before_the_memory_goes_back() {
    check_paths(Some(2), &[REUSED, REFUSED], aligned_free_vs_reuse);
}

/// Bug: the aligned adaptor gives the memory back upstream before it forgets the origin
/// (`aligned_planted::FORGET_AFTER_UPSTREAM`): the other thread's origin is the one erased, and
/// its free is refused.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_aligned_forgets_after_upstream() {
    must_fail(
        module_path!(),
        "planted_aligned_forgets_after_upstream",
        "a good free was refused",
        || {
            crate::resource::adaptor::aligned_planted::FORGET_AFTER_UPSTREAM
                .store(true, std::sync::atomic::Ordering::Relaxed);
            check_paths(Some(2), &[], aligned_free_vs_reuse);
        },
    );
}

/// The same for the history adaptor, recording with live tracking: the live table holds the
/// new allocation iff it was served.
fn history_free_vs_reuse(seen: &Shared<Seen>) {
    let (upstream, s) = pool(BLOCK);
    let history = Arc::new(HistoryAdaptor::new(
        upstream,
        HistoryOptions {
            capacity: 8,
            ..HistoryOptions::default()
        },
    ));
    history.start();
    let p = history.allocate(BLOCK, &s).unwrap();
    let freer = {
        let (history, s) = (history.clone(), s.clone());
        // SAFETY: allocated above with these bytes, unused, freed once.
        thread::spawn(move || unsafe { history.deallocate(p, BLOCK, &s) }.unwrap())
    };
    let q = history.allocate(BLOCK, &s).ok();
    freer.join().unwrap();
    seen.note(REUSED, q.is_some());
    seen.note(REFUSED, q.is_none());
    assert_eq!(
        history.live_allocations(),
        usize::from(q.is_some()),
        "the table lost (or kept) an allocation"
    );
    if let Some(q) = q {
        // SAFETY: allocated above with these bytes, unused, freed once.
        unsafe { history.deallocate(q, BLOCK, &s) }.unwrap();
    }
    assert_eq!(history.live_allocations(), 0);
    s.synchronize_blocking().unwrap();
}

#[test]
fn history_free_forgets_before_the_memory_goes_back() {
    check_paths(Some(2), &[REUSED, REFUSED], history_free_vs_reuse);
}

/// Bug: the history adaptor gives the memory back upstream before the recorder forgets it
/// (`history_planted::FORGET_AFTER_UPSTREAM`): the other thread's live entry is erased.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_history_forgets_after_upstream() {
    must_fail(
        module_path!(),
        "planted_history_forgets_after_upstream",
        "the table lost (or kept) an allocation",
        || {
            crate::resource::adaptor::history_planted::FORGET_AFTER_UPSTREAM
                .store(true, std::sync::atomic::Ordering::Relaxed);
            check_paths(Some(2), &[], history_free_vs_reuse);
        },
    );
}
