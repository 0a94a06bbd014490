//! The expandable pool's trim orders the ranges it took onto their streams (driver calls)
//! with the growth lock and the trims' list's lock let go, as the pool's trim does its chunks
//! (`pool.rs`'s review tests): every growth and every request at the maximum takes those
//! locks. Before the twenty-second session it ordered under both (a review's finding).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use super::{ExpandableOptions, ExpandablePoolResource};
use crate::device::{Device, DevicePtr};
use crate::resource::lock_probes::{LockAtFault, Locked};
use crate::resource::MemoryResource;
use crate::stream::Stream;
use crate::{FaultKind, Faults, SimConfig};
use tracing_subscriber::layer::SubscriberExt;

const MIB: usize = 1 << 20;

/// An expandable pool of at most 4 MiB (two 2 MiB granules, mapped one at a time) on a
/// simulated device with `faults`, and two streams.
fn scene(faults: Faults) -> (Arc<ExpandablePoolResource>, Stream, Stream, Device) {
    let device = Device::simulated(SimConfig {
        faults,
        ..SimConfig::default()
    });
    let options = ExpandableOptions {
        reserve: Some(64 * MIB),
        maximum: Some(4 * MIB),
        initial: 0,
        map_unit: Some(1),
        ..ExpandableOptions::default()
    };
    let pool = Arc::new(ExpandablePoolResource::new(&device, options).unwrap());
    let (s1, s2) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    (pool, s1, s2, device)
}

/// The pool's 4 MiB, handed out in halves, one on each stream, and freed there behind a 300 ms
/// spin queued on each: one free range whose tag names both busy streams (its ordering onto
/// one makes driver calls).
fn halves_freed_behind_spins(pool: &ExpandablePoolResource, s1: &Stream, s2: &Stream) {
    let x = pool.allocate(4 * MIB, s1).unwrap();
    // SAFETY: handed out above on `s1`, unused.
    unsafe { pool.deallocate(x, 4 * MIB, s1) }.unwrap();
    let halves: [(DevicePtr, &Stream); 2] = [
        (pool.allocate(2 * MIB, s1).unwrap(), s1),
        (pool.allocate(2 * MIB, s2).unwrap(), s2),
    ];
    assert_eq!(pool.stats().reserved, 4 * MIB);
    for (_, stream) in &halves {
        stream.spin(Duration::from_millis(300)).unwrap();
    }
    for (ptr, stream) in halves {
        // SAFETY: handed out above on `stream`, unused, freed once.
        unsafe { pool.deallocate(ptr, 2 * MIB, stream) }.unwrap();
    }
}

/// Whether `pool`'s growth lock or its trims' list is locked now (see `lock_probes`).
fn trim_locks_held(pool: &Arc<ExpandablePoolResource>) -> Locked {
    let pool = pool.clone();
    Box::new(move || pool.inner.core.trim_locks_held())
}

/// A trim orders a range freed on two busy streams onto one of them (a record on the other, a
/// wait) with the locks let go. The record fails here (an injected fault, so that the call can
/// be seen): the range stays mapped and free, and the next trim unmaps it.
#[test]
fn a_trim_orders_its_ranges_with_the_locks_let_go() {
    let faults = Faults::new();
    let (pool, s1, s2, _device) = scene(faults.clone());
    halves_freed_behind_spins(&pool, &s1, &s2);
    faults.fail_next(FaultKind::Record);
    let seen = Arc::new(AtomicUsize::new(0));
    let under_lock = Arc::new(AtomicBool::new(false));
    let subscriber = tracing_subscriber::registry().with(LockAtFault {
        locked: trim_locks_held(&pool),
        faults: seen.clone(),
        under_lock: under_lock.clone(),
    });
    let released = tracing::subscriber::with_default(subscriber, || pool.trim_blocking());
    assert_eq!(
        faults.injected(FaultKind::Record),
        1,
        "the trim ordered no range"
    );
    assert_eq!(seen.load(SeqCst), 1);
    assert!(
        !under_lock.load(SeqCst),
        "a trim's driver call under the growth lock or the trims' list's"
    );
    // The range whose ordering failed stays, mapped and free, as it was.
    assert_eq!(released.unwrap(), 0);
    assert_eq!(
        (pool.stats().reserved, pool.stats().free),
        (4 * MIB, 4 * MIB)
    );
    pool.check_invariants().unwrap();
    assert_eq!(pool.trim_blocking().unwrap(), 4 * MIB);
    assert_eq!(pool.stats().reserved, 0);
}

/// A request at the maximum recalls the range a trim holds between its taking and its
/// ordering (with the locks let go): it goes back to its list with its tag, as it was taken,
/// and serves the request; the trim's ordering then neither notes it as its own nor leaves it
/// to unmap. Step by step through the trim's own calls (`TakenForTrim::take`'s), so that the
/// moment is exact: the loom model (`loom-tests/expandable.rs`,
/// `planted_replace_ignores_recall`) takes every interleaving of the same.
#[test]
fn a_range_recalled_while_its_trim_orders_it_stays_mapped() {
    let (pool, s1, s2, device) = scene(Faults::new());
    let s3 = device.create_stream().unwrap();
    halves_freed_behind_spins(&pool, &s1, &s2);
    let core = &pool.inner.core;
    // The trim takes the range out, tagged with both streams.
    let (ticket, taken) = core.hold_free(0);
    assert_eq!(taken.len(), 1, "the trim took the freed range");
    // A request at the maximum recalls it, and is served from it.
    let y = pool
        .allocate(2 * MIB, &s3)
        .expect("served from the range the trim held");
    // The trim orders what it took: the range is no longer its own.
    let (streams, went_back) = core.order_held(ticket, taken);
    assert!(!went_back, "the ordering failed");
    assert!(
        streams.is_empty(),
        "the trim waits for a range it no longer holds"
    );
    assert!(
        core.release_held(ticket).is_empty(),
        "the trim would unmap a recalled range"
    );
    core.unmapped_held();
    let stats = pool.stats();
    assert_eq!((stats.reserved, stats.free), (4 * MIB, 2 * MIB));
    pool.check_invariants().unwrap();
    // SAFETY: handed out above on `s3`, unused.
    unsafe { pool.deallocate(y, 2 * MIB, &s3) }.unwrap();
    assert_eq!(pool.trim_blocking().unwrap(), 4 * MIB);
    assert_eq!(pool.stats().reserved, 0);
}
