//! Trims dropped while they wait for a stream (a timeout around `trim()`, a task cancelled):
//! what they took out of the lists goes back, free and usable, on every available device. A
//! later review found it out of the lists, never handed out again, until the pool was dropped.
//! And requests at the maximum while a trim waits: served from what the trim holds, not
//! refused.
//!
//! The tests take turns (`take_turns`): each needs its stream still busy when the trim first
//! waits, and beside another test's `cuMemFree` (which waits for the device to be idle) this
//! thread's calls are held up until it is not (run119: the pool's trim finished in its first
//! poll).

mod common;

use std::time::Duration;

use common::{check_pool, devices, free, label, poll_once, poll_once_and_drop, pool, take_turns};
use streamalloc::{ExpandableOptions, ExpandablePoolResource, MemoryResource};

const MIB: usize = 1 << 20;

/// The pool's chunks go back.
#[test]
fn the_pools_chunks_go_back() {
    let _turn = take_turns();
    for device in devices() {
        let pool = pool(&device, 0, 64 * MIB);
        let s = device.create_stream().unwrap();
        let p = pool.allocate(4 * MIB, &s).unwrap();
        s.spin(Duration::from_millis(300)).unwrap();
        free(&pool, p, 4 * MIB, &s); // the chunk waits for `s`, busy
        let before = pool.stats();
        poll_once_and_drop(pool.trim());
        let after = pool.stats();
        assert_eq!(
            (after.free, after.reserved),
            (before.free, before.reserved),
            "{}: {after:?}",
            label(&device)
        );
        // Served from the chunk, in stream order on `s`: no growth.
        let q = pool.allocate(4 * MIB, &s).unwrap();
        assert_eq!(
            (q, pool.stats().grows),
            (p, before.grows),
            "{}",
            label(&device)
        );
        free(&pool, q, 4 * MIB, &s);
        check_pool(&pool);
        s.synchronize_blocking().unwrap();
        pool.trim_blocking().unwrap();
        assert_eq!(pool.stats().reserved, 0, "{}", label(&device));
    }
}

/// The expandable pool's granules go back, and a later trim unmaps them.
#[test]
fn the_expandable_pools_granules_go_back() {
    let _turn = take_turns();
    for device in devices() {
        let p = ExpandablePoolResource::new(
            &device,
            ExpandableOptions {
                maximum: Some(64 * MIB),
                ..ExpandableOptions::default()
            },
        )
        .unwrap();
        let g = p.granule();
        let s = device.create_stream().unwrap();
        let a = p.allocate(g, &s).unwrap();
        s.spin(Duration::from_millis(300)).unwrap();
        free(&p, a, g, &s); // the granule waits for `s`, busy
        let before = p.stats();
        poll_once_and_drop(p.trim());
        let after = p.stats();
        assert_eq!(
            (after.free, after.reserved),
            (before.free, before.reserved),
            "{}: {after:?}",
            label(&device)
        );
        let b = p.allocate(g, &s).unwrap();
        assert_eq!(b, a, "{}: served from the granule put back", label(&device));
        free(&p, b, g, &s);
        p.check_invariants().unwrap();
        s.synchronize_blocking().unwrap();
        p.trim_blocking().unwrap();
        assert_eq!(p.stats().reserved, 0, "{}", label(&device));
    }
}

/// A request at the maximum while the pool's trim waits for the stream that freed the pool's
/// only chunk: served from that chunk (ordered after the stream, as any reuse), not refused;
/// the trim then gives back nothing. Before, the request failed with out of memory: the chunk
/// was out of the lists and still counted against the maximum, though the trim would have
/// freed it moments later.
#[test]
fn a_request_at_the_maximum_takes_what_the_pools_trim_holds() {
    let _turn = take_turns();
    for device in devices() {
        let p = pool(&device, 0, 4 * MIB);
        let (s1, s2) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let x = p.allocate(4 * MIB, &s1).unwrap();
        s1.spin(Duration::from_millis(300)).unwrap();
        free(&p, x, 4 * MIB, &s1); // the chunk waits for `s1`, busy
        let mut trim = std::pin::pin!(p.trim());
        assert!(poll_once(trim.as_mut()).is_pending(), "{}", label(&device));
        assert_eq!(
            p.stats().free,
            0,
            "{}: the trim holds the chunk",
            label(&device)
        );
        let before = p.stats();
        let y = p
            .allocate(4 * MIB, &s2)
            .unwrap_or_else(|e| panic!("{}: {e}", label(&device)));
        let after = p.stats();
        assert_eq!(y, x, "{}: the chunk the trim held", label(&device));
        assert_eq!(
            (after.grows, after.reserved),
            (before.grows, 4 * MIB),
            "{}",
            label(&device)
        );
        assert!(
            after.stream_waits + after.idle_reuses > before.stream_waits + before.idle_reuses,
            "{}: reused after `s1` without an ordering: {after:?}",
            label(&device)
        );
        assert_eq!(
            futures::executor::block_on(trim).unwrap(),
            0,
            "{}: nothing left to give back",
            label(&device)
        );
        free(&p, y, 4 * MIB, &s2);
        check_pool(&p);
        s2.synchronize_blocking().unwrap();
        assert_eq!(p.trim_blocking().unwrap(), 4 * MIB, "{}", label(&device));
    }
}

/// The same for the expandable pool's trim, which holds granules until their stream is done
/// before it unmaps them.
#[test]
fn a_request_at_the_maximum_takes_what_the_expandable_pools_trim_holds() {
    let _turn = take_turns();
    for device in devices() {
        let p = ExpandablePoolResource::new(
            &device,
            ExpandableOptions {
                maximum: Some(8 * MIB),
                ..ExpandableOptions::default()
            },
        )
        .unwrap();
        let (s1, s2) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let x = p.allocate(8 * MIB, &s1).unwrap();
        s1.spin(Duration::from_millis(300)).unwrap();
        free(&p, x, 8 * MIB, &s1); // the granules wait for `s1`, busy
        let mut trim = std::pin::pin!(p.trim());
        assert!(poll_once(trim.as_mut()).is_pending(), "{}", label(&device));
        assert_eq!(
            p.stats().free,
            0,
            "{}: the trim holds the granules",
            label(&device)
        );
        let y = p
            .allocate(8 * MIB, &s2)
            .unwrap_or_else(|e| panic!("{}: {e}", label(&device)));
        assert_eq!(y, x, "{}: the granules the trim held", label(&device));
        assert_eq!(p.stats().reserved, 8 * MIB, "{}", label(&device));
        assert_eq!(
            futures::executor::block_on(trim).unwrap(),
            0,
            "{}: nothing left to unmap",
            label(&device)
        );
        free(&p, y, 8 * MIB, &s2);
        p.check_invariants().unwrap();
        s2.synchronize_blocking().unwrap();
        assert_eq!(p.trim_blocking().unwrap(), 8 * MIB, "{}", label(&device));
    }
}
