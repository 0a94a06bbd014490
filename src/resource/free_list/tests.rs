//! The free list's unit tests: every step followed by `FreeList::check`.

use super::*;

const U: u64 = ALIGNMENT as u64;

#[test]
fn take_splits_and_give_coalesces() {
    let mut l: FreeList = FreeList::new();
    l.add_chunk(0x10000, 64 * U);
    assert!(!l.give(0x20000, U), "outside every chunk");
    assert!(!l.give(0x10000 + 60 * U, 8 * U), "runs past the chunk");
    assert!(l.give(0x10000, 64 * U));
    let a = l.take(4 * U).unwrap();
    let b = l.take(4 * U).unwrap();
    assert_eq!((a, b), (0x10000, 0x10000 + 4 * U));
    l.check().unwrap();
    assert!(l.give(a, 4 * U));
    assert!(!l.give(a, 4 * U), "double free must be refused");
    assert!(l.give(b, 4 * U));
    l.check().unwrap();
    assert_eq!(l.len(), 1);
    assert_eq!(l.free_bytes(), 64 * U);
}

#[test]
fn no_merge_across_chunks() {
    let mut l: FreeList = FreeList::new();
    l.add_chunk(0x10000, 8 * U);
    l.add_chunk(0x10000 + 8 * U, 8 * U);
    assert!(l.give(0x10000, 8 * U));
    assert!(l.give(0x10000 + 8 * U, 8 * U));
    l.check().unwrap();
    assert_eq!(l.len(), 2);
    assert!(l.take(16 * U).is_none());
    assert!(l.take_exact(0x10000, 8 * U));
    l.check().unwrap();
}

#[test]
fn exact_fits_are_preferred() {
    let mut l: FreeList = FreeList::new();
    // Separate chunks so nothing merges: sizes 37, 40, 33 units in one class.
    for (i, units) in [37u64, 40, 33].iter().enumerate() {
        let base = 0x1_0000_0000 * (i as u64 + 1);
        l.add_chunk(base, units * U);
        assert!(l.give(base, units * U));
    }
    assert_eq!(l.take(33 * U), Some(0x3_0000_0000));
    assert_eq!(l.take(37 * U), Some(0x1_0000_0000));
    l.check().unwrap();
}

#[test]
fn random_operations_keep_the_invariants() {
    let mut state = 7u64;
    let mut next = move || crate::device::sim::faults::splitmix64(&mut state);
    let mut l: FreeList = FreeList::new();
    let chunks = [
        (0x1000_0000u64, 4096 * U),
        (0x1000_0000 + 4096 * U, 1024 * U),
        (0x9000_0000, 2048 * U),
    ];
    for &(base, size) in &chunks {
        l.add_chunk(base, size);
        assert!(l.give(base, size));
    }
    let total: u64 = chunks.iter().map(|c| c.1).sum();
    let mut live: Vec<(u64, u64)> = Vec::new();
    for step in 0..20_000u32 {
        let r = next();
        if live.is_empty() || !r.is_multiple_of(3) {
            let size = (1 + next() % 64) * U;
            if let Some(addr) = l.take(size) {
                live.push((addr, size));
            }
        } else {
            let (addr, size) = live.swap_remove((next() as usize) % live.len());
            assert!(l.give(addr, size));
        }
        if step.is_multiple_of(97) {
            l.check().unwrap();
        }
        let live_bytes: u64 = live.iter().map(|b| b.1).sum();
        assert_eq!(live_bytes + l.free_bytes(), total);
    }
    for (addr, size) in live.drain(..) {
        assert!(l.give(addr, size));
    }
    l.check().unwrap();
    assert_eq!(
        l.len(),
        chunks.len(),
        "everything coalesces back into its chunk"
    );
}
