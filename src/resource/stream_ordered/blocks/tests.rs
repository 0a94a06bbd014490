//! The block table's unit tests: every step followed by `BlockTable::check`.

use super::*;
use crate::device::sim::faults::splitmix64;

const U: u64 = ALIGNMENT as u64;

/// A tag that records which frees a block holds memory of (bit per free), to see joins.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Bits(u64);

impl BlockTag for Bits {
    fn join(&mut self, other: &Self) {
        self.0 |= other.0;
    }
}

fn table(start: u64, units: u64) -> BlockTable<Bits> {
    let mut t = BlockTable::new();
    t.add_chunk(start, units * U);
    assert!(t.give_range(start, units * U, Bits(0)));
    t.check().unwrap();
    t
}

#[test]
fn take_splits_and_free_coalesces_with_tags_joined() {
    let mut t = table(0x10000, 64);
    let a = t.take_tagged(4 * U).unwrap().0;
    let b = t.take_tagged(4 * U).unwrap().0;
    let c = t.take_tagged(4 * U).unwrap().0;
    assert_eq!((a, b, c), (0x10000, 0x10000 + 4 * U, 0x10000 + 8 * U));
    assert_eq!((t.len(), t.free_bytes()), (1, 52 * U));
    t.check().unwrap();
    assert!(t.free(a, 4 * U, Bits(1)));
    assert!(t.free(c, 4 * U, Bits(4)));
    t.check().unwrap();
    assert_eq!(
        t.len(),
        2,
        "a and c are apart (b is in use); c joined the rest"
    );
    assert!(t.free(b, 4 * U, Bits(2)));
    t.check().unwrap();
    let all: Vec<_> = t.tagged_blocks().map(|(a, s, g)| (a, s, *g)).collect();
    assert_eq!(all, vec![(0x10000, 64 * U, Bits(7))]);
    // A take of the block gets its joined tag.
    assert_eq!(t.take_tagged(64 * U), Some((0x10000, Bits(7))));
    assert_eq!(t.len(), 0);
    t.check().unwrap();
}

#[test]
fn frees_not_naming_a_block_in_use_are_refused() {
    let mut t = table(0x10000, 64);
    let a = t.take_tagged(8 * U).unwrap().0;
    assert!(!t.free(a + U, 7 * U, Bits(0)), "inside a block");
    assert!(!t.free(a, 4 * U, Bits(0)), "wrong size");
    assert!(!t.free(a, 16 * U, Bits(0)), "wrong size, past the block");
    assert!(!t.free(0x10000 + 32 * U, 4 * U, Bits(0)), "free memory");
    assert!(!t.free(0x90000, U, Bits(0)), "never handed out");
    t.check().unwrap();
    assert!(t.free(a, 8 * U, Bits(0)));
    assert!(!t.free(a, 8 * U, Bits(0)), "a second free");
    t.check().unwrap();
    assert_eq!(t.free_bytes(), 64 * U);
}

#[test]
fn ranges_go_only_into_holes_of_a_chunk_and_never_merge_across_chunks() {
    let mut t: BlockTable<Bits> = BlockTable::new();
    t.add_chunk(0x10000, 16 * U);
    t.add_chunk(0x10000 + 16 * U, 16 * U);
    assert!(
        !t.give_range(0x10000 + 12 * U, 8 * U, Bits(0)),
        "across two chunks"
    );
    assert!(!t.give_range(0x90000, U, Bits(0)), "in no chunk");
    assert!(t.give_range(0x10000, 16 * U, Bits(0)));
    assert!(t.give_range(0x10000 + 16 * U, 16 * U, Bits(0)));
    assert!(
        !t.give_range(0x10000 + 4 * U, U, Bits(0)),
        "overlaps a free block"
    );
    t.check().unwrap();
    assert_eq!(t.len(), 2, "chunks that touch stay apart");
    let a = t.take_tagged(16 * U).unwrap().0;
    assert!(!t.give_range(a, U, Bits(0)), "overlaps a block in use");
    assert!(t.free(a, 16 * U, Bits(0)));
    // A whole chunk goes out, and the chunk with it.
    assert_eq!(t.take_exact_tagged(0x10000, 16 * U), Some(Bits(0)));
    assert_eq!(
        t.take_exact_tagged(0x10000 + 16 * U, 8 * U),
        None,
        "not whole"
    );
    t.remove_chunk(0x10000);
    t.check().unwrap();
    assert!(!t.give_range(0x10000, U, Bits(0)), "the chunk is gone");
    assert_eq!(t.free_bytes(), 16 * U);
}

/// A whole chunk is found among other free blocks of its size class, and only at its address
/// with its exact size.
#[test]
fn a_whole_chunk_is_found_among_blocks_of_its_size() {
    let mut t: BlockTable<Bits> = BlockTable::new();
    let starts: Vec<u64> = (0..4).map(|k| 0x100000 * (k + 1)).collect();
    for (k, &start) in starts.iter().enumerate() {
        t.add_chunk(start, 32 * U);
        assert!(t.give_range(start, 32 * U, Bits(1 << k)));
    }
    // One chunk is partly in use, and one block of its size class lies in another.
    let used = t.take_tagged(U).unwrap().0;
    t.check().unwrap();
    assert_eq!(t.take_exact_tagged(used, 32 * U), None, "partly in use");
    assert_eq!(
        t.take_exact_tagged(starts[2] + U, 32 * U),
        None,
        "not at a start"
    );
    assert_eq!(t.take_exact_tagged(starts[2], 31 * U), None, "not its size");
    let tag = t.take_exact_tagged(starts[2], 32 * U).unwrap();
    assert_eq!(tag, Bits(1 << 2));
    t.remove_chunk(starts[2]);
    t.check().unwrap();
    assert_eq!(t.free_bytes(), (3 * 32 - 1) * U);
}

#[test]
fn aligned_parts_go_out_as_holes_and_come_back_coalesced() {
    let g = 8 * U;
    let mut t = table(0x100000, 64);
    // In use: [0, 3) and [20, 21); free: [3, 20) and [21, 64) (units).
    let a = t.take_tagged(3 * U).unwrap().0;
    let _ = t.take_tagged(17 * U).unwrap().0;
    let c = t.take_tagged(U).unwrap().0;
    assert!(t.free(a + 3 * U, 17 * U, Bits(1)));
    assert_eq!(a, 0x100000);
    assert_eq!(c, 0x100000 + 20 * U);
    let mut taken = t.take_aligned(g);
    taken.sort_unstable_by_key(|r| r.0);
    let base = 0x100000;
    assert_eq!(
        taken,
        vec![
            (base + 8 * U, 8 * U, Bits(1)),
            (base + 24 * U, 40 * U, Bits(0))
        ]
    );
    t.check().unwrap();
    assert_eq!(t.free_ending_at(base + 8 * U), 5 * U);
    assert_eq!(t.free_starting_at(base + 16 * U), 4 * U);
    assert_eq!(t.free_starting_at(base + 21 * U), 3 * U);
    // Back again: everything merges into what it touches.
    for (addr, size, tag) in taken {
        assert!(t.give_range(addr, size, tag));
        t.check().unwrap();
    }
    assert!(t.free(c, U, Bits(2)));
    t.check().unwrap();
    let free: Vec<_> = t.blocks().collect();
    assert_eq!(free, vec![(base + 3 * U, 61 * U)]);
}

/// The random tests' hole step: every 50th step (`r % 8 == 6`) cuts the granule-aligned holes
/// out of the free blocks; `r % 8 == 7` gives one back.
fn cut_or_fill(t: &mut BlockTable<Bits>, step: u64, r: u64, holes: &mut Vec<(u64, u64, Bits)>) {
    if r % 8 == 6 && step.is_multiple_of(50) {
        holes.extend(t.take_aligned(32 * U));
    } else if r % 8 == 7 && !holes.is_empty() {
        let (addr, size, tag) = holes.swap_remove((r >> 8) as usize % holes.len());
        assert!(t.give_range(addr, size, tag), "step {step}");
    }
}

/// The random tests' checks after each step: the invariants, and every byte free, in use
/// (`used`) or cut out (`holes`).
fn check_step(
    t: &BlockTable<Bits>,
    step: u64,
    used: &[(u64, u64)],
    holes: &[(u64, u64, Bits)],
    total: u64,
) {
    t.check().unwrap_or_else(|e| panic!("step {step}: {e}"));
    let in_use: u64 = used.iter().map(|u| u.1).sum();
    let hollow: u64 = holes.iter().map(|h| h.1).sum();
    assert_eq!(t.free_bytes() + in_use + hollow, total, "step {step}");
    assert_eq!(t.used_bytes(), in_use, "step {step}");
}

/// Random takes, frees (good and bad), holes cut and filled, against a model of what is in
/// use; the invariants after every step.
#[test]
fn random_operations_keep_every_invariant() {
    let mut rng = 7u64;
    let (base, units) = (1u64 << 32, 4096u64);
    let mut t: BlockTable<Bits> = BlockTable::new();
    // Two chunks that touch, and one apart.
    let chunks = [
        (base, units / 2),
        (base + units / 2 * U, units / 2),
        (base + 2 * units * U, units),
    ];
    for &(start, n) in &chunks {
        t.add_chunk(start, n * U);
        assert!(t.give_range(start, n * U, Bits(0)));
    }
    let total: u64 = chunks.iter().map(|c| c.1 * U).sum();
    let mut used: Vec<(u64, u64)> = Vec::new();
    let mut holes: Vec<(u64, u64, Bits)> = Vec::new();
    for step in 0..4000 {
        let r = splitmix64(&mut rng);
        match r % 8 {
            0..=3 => {
                let size = (1 + (r >> 8) % 64) * U;
                if let Some((addr, _)) = t.take_tagged(size) {
                    used.push((addr, size));
                }
            }
            4 | 5 if !used.is_empty() => {
                let (addr, size) = used.swap_remove((r >> 8) as usize % used.len());
                assert!(!t.free(addr, size + U, Bits(0)), "step {step}: wrong size");
                assert!(t.free(addr, size, Bits(1 << (step % 64))), "step {step}");
                assert!(!t.free(addr, size, Bits(0)), "step {step}: second free");
            }
            6 | 7 => cut_or_fill(&mut t, step, r, &mut holes),
            _ => {}
        }
        check_step(&t, step, &used, &holes, total);
    }
}

/// A slot listed spare while it holds a block would be handed to the next new block: the
/// checker must see it.
#[test]
fn the_checker_sees_a_block_in_use_listed_spare() {
    let mut t = table(0x10000, 64);
    let a = t.take_tagged(4 * U).unwrap().0;
    assert!(t.free(a, 4 * U, Bits(0)));
    let b = t.take_tagged(4 * U).unwrap().0;
    t.check().unwrap();
    t.spare.push(t.used.get(b).unwrap());
    assert!(t.check().is_err());
}

/// A table of one chunk of `units` with a small-block cache of `budget` units.
fn cached_table(start: u64, units: u64, budget: u64) -> BlockTable<Bits> {
    let mut t = table(start, units);
    t.set_cache(budget * U);
    t.check().unwrap();
    t
}

/// The owner the cache tests take and free blocks as.
const OWNER: u16 = 1;

/// A take by [`OWNER`].
fn take(t: &mut BlockTable<Bits>, size: u64) -> Option<(u64, Bits)> {
    t.take_tagged_by(size, OWNER)
}

/// Frees `addr` of `size` with `tag` by `owner`, as the engine does when the cache may keep it.
fn free_by(t: &mut BlockTable<Bits>, addr: u64, size: u64, tag: Bits, owner: u16) -> bool {
    match t.used_slot(addr, size) {
        Some(used) => {
            if t.may_cache(&used, owner) {
                t.cache(used, tag);
            } else {
                let freed = t.free_used(used);
                t.join_tag(freed, &tag);
            }
            true
        }
        None => false,
    }
}

/// [`free_by`] the block's owner.
fn cache_free(t: &mut BlockTable<Bits>, addr: u64, size: u64, tag: Bits) -> bool {
    free_by(t, addr, size, tag, OWNER)
}

#[test]
fn the_cache_serves_the_tag_it_accepts_and_frees_the_others() {
    let mut t = cached_table(0x10000, 64, 16);
    let a = take(&mut t, 4 * U).unwrap().0;
    let b = take(&mut t, 4 * U).unwrap().0;
    assert!(cache_free(&mut t, a, 4 * U, Bits(1)));
    t.check().unwrap();
    // Cached memory counts as free, but is not among the size index's blocks.
    assert_eq!((t.len(), t.free_bytes(), t.cached_blocks()), (2, 60 * U, 1));
    assert_eq!(t.used_bytes(), 4 * U);
    assert_eq!(
        t.fit(4 * U),
        Some(56 * U),
        "the search does not see the cached block"
    );
    // The same size, a tag it accepts: the same block back, with no split.
    assert_eq!(t.take_cached(4 * U, |g| *g == Bits(1), OWNER), Some(a));
    assert_eq!((t.cache_hits(), t.used_bytes()), (1, 8 * U));
    t.check().unwrap();
    // Another size finds nothing cached.
    assert!(cache_free(&mut t, a, 4 * U, Bits(2)));
    assert_eq!(t.take_cached(8 * U, |_| true, OWNER), None);
    // A tag it does not accept: the block goes to the free blocks, coalesced, with its tag.
    assert_eq!(t.take_cached(4 * U, |g| *g == Bits(1), OWNER), None);
    assert_eq!((t.cached_blocks(), t.cache_hits()), (0, 1));
    t.check().unwrap();
    let mut free: Vec<_> = t.tagged_blocks().map(|(a, s, g)| (a, s, *g)).collect();
    free.sort_unstable_by_key(|f| f.0);
    assert_eq!(
        free,
        vec![(a, 4 * U, Bits(2)), (b + 4 * U, 56 * U, Bits(0))]
    );
    assert!(t.free(b, 4 * U, Bits(4)));
    let free: Vec<_> = t.tagged_blocks().map(|(a, s, g)| (a, s, *g)).collect();
    assert_eq!(free, vec![(0x10000, 64 * U, Bits(6))]);
    t.check().unwrap();
}

#[test]
fn a_cached_block_refuses_a_second_free() {
    let mut t = cached_table(0x10000, 64, 16);
    let a = take(&mut t, 4 * U).unwrap().0;
    assert!(cache_free(&mut t, a, 4 * U, Bits(1)));
    assert!(
        !cache_free(&mut t, a, 4 * U, Bits(1)),
        "second free, cached"
    );
    assert!(
        !t.free(a, 4 * U, Bits(1)),
        "second free, through the free blocks"
    );
    assert!(!cache_free(&mut t, a + U, 3 * U, Bits(1)), "inside it");
    t.check().unwrap();
    assert_eq!(t.cached_blocks(), 1);
}

#[test]
fn the_cache_keeps_to_its_budget_and_depth() {
    // Budget 10 units: two blocks of 4, then the third goes to the free blocks.
    let mut t = cached_table(0x10000, 256, 10);
    let blocks: Vec<u64> = (0..3).map(|_| take(&mut t, 4 * U).unwrap().0).collect();
    for &a in &blocks {
        assert!(cache_free(&mut t, a, 4 * U, Bits(1)));
        t.check().unwrap();
    }
    assert_eq!(t.cached_blocks(), 2);
    // Depth: at most CACHE_DEPTH blocks of one size, whatever the budget.
    let mut t = cached_table(0x10000, 512, 256);
    let n = CACHE_DEPTH as u64 + 3;
    let blocks: Vec<u64> = (0..n).map(|_| take(&mut t, U).unwrap().0).collect();
    for &a in &blocks {
        assert!(cache_free(&mut t, a, U, Bits(1)));
    }
    t.check().unwrap();
    assert_eq!(t.cached_blocks(), CACHE_DEPTH);
    // Above CACHE_MAX nothing is cached.
    let big = take(&mut t, CACHE_MAX + U).unwrap().0;
    assert!(!t.caches(CACHE_MAX + U));
    assert!(cache_free(&mut t, big, CACHE_MAX + U, Bits(1)));
    assert_eq!(t.cached_blocks(), CACHE_DEPTH);
    t.check().unwrap();
}

#[test]
fn uncaching_coalesces_every_cached_block_with_its_tag() {
    let mut t = cached_table(0x10000, 64, 64);
    let mut blocks = Vec::new();
    while let Some((addr, _)) = take(&mut t, 2 * U) {
        blocks.push(addr);
    }
    assert_eq!(blocks.len(), 32);
    for (k, &a) in blocks.iter().enumerate() {
        assert!(cache_free(&mut t, a, 2 * U, Bits(1 << k)));
    }
    t.check().unwrap();
    // 16 cached (the depth), 16 coalesced into the free blocks.
    assert_eq!((t.free_bytes(), t.cached_blocks()), (64 * U, CACHE_DEPTH));
    t.uncache_all();
    t.check().unwrap();
    assert_eq!(t.cached_blocks(), 0);
    let free: Vec<_> = t.tagged_blocks().map(|(a, s, g)| (a, s, *g)).collect();
    assert_eq!(free, vec![(0x10000, 64 * U, Bits(u32::MAX as u64))]);
    // Turning the cache off empties it too.
    let a = take(&mut t, U).unwrap().0;
    assert!(cache_free(&mut t, a, U, Bits(1)));
    assert_eq!(t.cached_blocks(), 1);
    t.set_cache(0);
    assert_eq!((t.cached_blocks(), t.len()), (0, 1));
    assert!(!t.caches(U));
    t.check().unwrap();
}

/// [`random_operations_keep_every_invariant`] with the cache on: frees through the cache,
/// takes from it (its tag accepted or not), and whole-table operations that empty it.
#[test]
fn random_operations_with_the_cache_keep_every_invariant() {
    let mut rng = 11u64;
    let (base, units) = (1u64 << 32, 4096u64);
    let mut t = cached_table(base, units, 48);
    let total = units * U;
    let mut used: Vec<(u64, u64)> = Vec::new();
    let mut holes: Vec<(u64, u64, Bits)> = Vec::new();
    for step in 0..6000 {
        let r = splitmix64(&mut rng);
        let size = (1 + (r >> 8) % 8) * U;
        match r % 8 {
            0 | 1 => {
                if let Some((addr, _)) = take(&mut t, size) {
                    used.push((addr, size));
                }
            }
            2 | 3 => {
                let tag = Bits(1 << ((r >> 20) % 4));
                if let Some(addr) = t.take_cached(size, |g| *g == tag, OWNER) {
                    assert!(
                        used.iter().all(|u| u.0 != addr),
                        "step {step}: handed out twice"
                    );
                    used.push((addr, size));
                }
            }
            4 | 5 if !used.is_empty() => {
                let (addr, size) = used.swap_remove((r >> 8) as usize % used.len());
                assert!(
                    !cache_free(&mut t, addr, size + U, Bits(0)),
                    "step {step}: wrong size"
                );
                assert!(
                    cache_free(&mut t, addr, size, Bits(1 << ((r >> 20) % 4))),
                    "step {step}"
                );
                assert!(
                    !cache_free(&mut t, addr, size, Bits(0)),
                    "step {step}: second free"
                );
                assert!(!t.free(addr, size, Bits(0)), "step {step}: second free");
            }
            6 | 7 => cut_or_fill(&mut t, step, r, &mut holes),
            _ => {}
        }
        check_step(&t, step, &used, &holes, total);
    }
    assert!(t.cache_hits() > 100, "the cache served {}", t.cache_hits());
}

/// A block listed in the cache but marked in use would be handed out twice: the checker sees
/// it.
#[test]
fn the_checker_sees_a_cached_block_in_use() {
    let mut t = cached_table(0x10000, 64, 16);
    let a = take(&mut t, 4 * U).unwrap().0;
    assert!(cache_free(&mut t, a, 4 * U, Bits(1)));
    t.check().unwrap();
    let i = t.used.get(a).unwrap();
    t.blocks[i as usize].state = State::Used;
    assert!(t.check().is_err());
}

/// A block freed by another than its taker (a hand-off between streams) is not cached: the
/// freer's next request of that size may never come.
#[test]
fn only_the_taker_s_free_is_cached() {
    let mut t = cached_table(0x10000, 64, 16);
    let a = take(&mut t, 4 * U).unwrap().0;
    let b = t.take_tagged(4 * U).unwrap().0;
    assert!(free_by(&mut t, a, 4 * U, Bits(1), OWNER + 1));
    assert!(
        cache_free(&mut t, b, 4 * U, Bits(2)),
        "no owner named at the take"
    );
    assert_eq!((t.cached_blocks(), t.len()), (0, 1));
    t.check().unwrap();
    let c = take(&mut t, 4 * U).unwrap().0;
    assert!(free_by(&mut t, c, 4 * U, Bits(1), NO_OWNER));
    assert_eq!(t.cached_blocks(), 0);
    let d = take(&mut t, 4 * U).unwrap().0;
    assert!(cache_free(&mut t, d, 4 * U, Bits(1)));
    assert_eq!(t.cached_blocks(), 1);
    t.check().unwrap();
}
