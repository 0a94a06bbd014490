//! Trims dropped while they wait for a stream (a timeout around `trim()`, a task cancelled):
//! what they took out of the lists goes back, free and usable, on every available device. A
//! later review found it out of the lists, never handed out again, until the pool was dropped.
//!
//! The tests take turns (`take_turns`): each needs its stream still busy when the trim first
//! waits, and beside another test's `cuMemFree` (which waits for the device to be idle) this
//! thread's calls are held up until it is not (run119: the pool's trim finished in its first
//! poll).

mod common;

use std::time::Duration;

use common::{check_pool, devices, free, label, poll_once_and_drop, pool, take_turns};
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
