//! A two-level segregated fit (TLSF) index of free blocks by size, shared by the free list
//! (`free_list.rs`, the arena's) and the stream-ordered engine's block table
//! (`stream_ordered/blocks.rs`).
//!
//! Sizes (in 256-byte units) map to 32 linear sub-classes per power of two, two bitmaps name the
//! non-empty classes, and each class is a doubly linked list of blocks kept in the caller's slab
//! (the links live in each block: [`Links`]). A request first scans a few blocks of its own
//! class for the smallest that fits (exact fits are common: the same sizes come back), then
//! takes the first block of the smallest class whose every block fits. That is a fit within
//! 1/32 (3%) of the best, in constant time, where an exact best fit in a size-ordered tree costs
//! two tree updates per operation. Only when no larger class holds a block does it walk the rest
//! of its own class: no block that fits is ever missed.

use crate::resource::ALIGNMENT;

/// log2 of the sub-classes per power of two.
const SL_LOG: u32 = 5;
const SL: usize = 1 << SL_LOG;
/// First-level classes: enough for any 64-bit size in 256-byte units.
const FL: usize = 64 - SL_LOG as usize;
/// How many blocks of the request's own class to scan for a closer fit.
const SCAN: usize = 8;
/// How many blocks of each class [`SizeIndex::find_low`] looks at.
const LOW_SCAN: usize = 8;
/// No block (the end of a class list, or no neighbour).
pub(crate) const NIL: u32 = u32::MAX;
/// log2 of the size unit.
pub(crate) const UNIT_LOG: u32 = ALIGNMENT.trailing_zeros();

/// A block's place in its class list.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Links {
    prev: u32,
    next: u32,
    class: u16,
}

impl Default for Links {
    fn default() -> Self {
        Links {
            prev: NIL,
            next: NIL,
            class: 0,
        }
    }
}

/// What the index needs of a block in the caller's slab.
pub(crate) trait Indexed {
    /// The block's size in bytes (a multiple of [`ALIGNMENT`]).
    fn size(&self) -> u64;
    /// The block's place in its class list.
    fn links(&self) -> &Links;
    /// The same, to change.
    fn links_mut(&mut self) -> &mut Links;
}

/// The class of a size in units: (first level, second level), flattened.
pub(crate) fn class_of(units: u64) -> usize {
    if units < SL as u64 {
        units as usize
    } else {
        let msb = 63 - units.leading_zeros();
        let fl = (msb - SL_LOG + 1) as usize;
        let sl = ((units >> (msb - SL_LOG)) as usize) & (SL - 1);
        fl * SL + sl
    }
}

/// The smallest class whose every block holds `units`.
fn class_at_least(units: u64) -> Option<usize> {
    if units < SL as u64 {
        return Some(units as usize);
    }
    let msb = 63 - units.leading_zeros();
    let round = (1u64 << (msb - SL_LOG)) - 1;
    units
        .checked_add(round)
        .map(class_of)
        .filter(|&c| c < FL * SL)
}

/// The index: a list head per class and the bitmaps of non-empty classes.
#[derive(Debug)]
pub(crate) struct SizeIndex {
    heads: Vec<u32>,
    fl_map: u64,
    sl_maps: [u32; FL],
}

impl Default for SizeIndex {
    fn default() -> Self {
        SizeIndex {
            heads: vec![NIL; FL * SL],
            fl_map: 0,
            sl_maps: [0; FL],
        }
    }
}

impl SizeIndex {
    /// Files block `i` under its size's class.
    #[inline]
    pub(crate) fn link<B: Indexed>(&mut self, blocks: &mut [B], i: u32) {
        let class = class_of(blocks[i as usize].size() >> UNIT_LOG);
        let head = self.heads[class];
        *blocks[i as usize].links_mut() = Links {
            prev: NIL,
            next: head,
            class: class as u16,
        };
        if head != NIL {
            blocks[head as usize].links_mut().prev = i;
        }
        self.heads[class] = i;
        self.sl_maps[class / SL] |= 1 << (class % SL);
        self.fl_map |= 1 << (class / SL);
    }

    /// Takes block `i` out of its class list.
    #[inline]
    pub(crate) fn unlink<B: Indexed>(&mut self, blocks: &mut [B], i: u32) {
        let Links { prev, next, class } = *blocks[i as usize].links();
        let class = class as usize;
        if prev != NIL {
            blocks[prev as usize].links_mut().next = next;
        } else {
            self.heads[class] = next;
            if next == NIL {
                self.sl_maps[class / SL] &= !(1 << (class % SL));
                if self.sl_maps[class / SL] == 0 {
                    self.fl_map &= !(1 << (class / SL));
                }
            }
        }
        if next != NIL {
            blocks[next as usize].links_mut().prev = prev;
        }
    }

    /// The first non-empty class at or above `class`.
    fn first_class_from(&self, class: usize) -> Option<usize> {
        let (fl, sl) = (class / SL, class % SL);
        let sl_map = self.sl_maps[fl] & (u32::MAX << sl);
        if sl_map != 0 {
            return Some(fl * SL + sl_map.trailing_zeros() as usize);
        }
        let fl_map = if fl + 1 >= 64 {
            0
        } else {
            self.fl_map & (u64::MAX << (fl + 1))
        };
        if fl_map == 0 {
            return None;
        }
        let fl = fl_map.trailing_zeros() as usize;
        Some(fl * SL + self.sl_maps[fl].trailing_zeros() as usize)
    }

    /// A block of at least `size` bytes: the closest among the first few of its own class,
    /// else the head of the smallest class that surely fits, else (no larger class holds a
    /// block) the first that fits further down its own class. `None` only when no block fits:
    /// a request is never refused, nor the pool grown, while a free block could serve it (a
    /// review found one refused at the maximum with a block of exactly its size ninth in its
    /// class).
    #[inline]
    pub(crate) fn find<B: Indexed>(&self, blocks: &[B], size: u64) -> Option<u32> {
        let units = size >> UNIT_LOG;
        let own = class_of(units);
        if own < FL * SL {
            let mut best: Option<u32> = None;
            let mut i = self.heads[own];
            for _ in 0..SCAN {
                if i == NIL {
                    break;
                }
                let b = &blocks[i as usize];
                if b.size() >= size && best.is_none_or(|j| b.size() < blocks[j as usize].size()) {
                    best = Some(i);
                    if b.size() == size {
                        break;
                    }
                }
                i = b.links().next;
            }
            if best.is_some() {
                return best;
            }
        }
        match class_at_least(units).and_then(|c| self.first_class_from(c)) {
            Some(class) => Some(self.heads[class]),
            None => self.first_fit_past_scan(blocks, own, size),
        }
    }

    /// The first block of `class` past the [`SCAN`] [`find`](Self::find) looked at that holds
    /// `size` bytes: the cold end of a search that found no larger class.
    #[cold]
    fn first_fit_past_scan<B: Indexed>(
        &self,
        blocks: &[B],
        class: usize,
        size: u64,
    ) -> Option<u32> {
        let mut i = *self.heads.get(class)?;
        let mut looked = 0;
        while i != NIL {
            let b = &blocks[i as usize];
            if looked >= SCAN && b.size() >= size {
                return Some(i);
            }
            looked += 1;
            i = b.links().next;
        }
        None
    }

    /// A block of at least `size` bytes at the lowest address (`addr`) among the fitting
    /// blocks of the two smallest classes that hold one (a look at up to [`LOW_SCAN`] blocks
    /// of each class): a fit a little looser than [`find`](Self::find)'s, that keeps memory
    /// low in the address range, so that its top stays free in whole granules (the expandable
    /// pool's placement).
    #[inline]
    pub(crate) fn find_low<B: Indexed>(
        &self,
        blocks: &[B],
        size: u64,
        addr: impl Fn(&B) -> u64,
    ) -> Option<u32> {
        let mut class = class_of(size >> UNIT_LOG);
        let mut best: Option<(u64, u32)> = None;
        let mut classes = 0;
        while classes < 2 && class < FL * SL {
            let Some(c) = self.first_class_from(class) else {
                break;
            };
            let mut i = self.heads[c];
            let mut fits = false;
            for _ in 0..LOW_SCAN {
                if i == NIL {
                    break;
                }
                let b = &blocks[i as usize];
                if b.size() >= size {
                    fits = true;
                    if best.is_none_or(|(a, _)| addr(b) < a) {
                        best = Some((addr(b), i));
                    }
                }
                i = b.links().next;
            }
            classes += usize::from(fits);
            class = c + 1;
        }
        // None seen: a fitting block may still lie past the look at its class.
        best.map(|(_, i)| i).or_else(|| self.find(blocks, size))
    }

    /// A block of exactly `size` bytes that `accept` takes, looked for through the whole list
    /// of its class: for the cold paths that look for one block (a wholly free chunk), without
    /// a scan of every slot.
    pub(crate) fn find_exact<B: Indexed>(
        &self,
        blocks: &[B],
        size: u64,
        accept: impl Fn(u32) -> bool,
    ) -> Option<u32> {
        let class = class_of(size >> UNIT_LOG);
        let mut i = *self.heads.get(class)?;
        while i != NIL {
            let b = &blocks[i as usize];
            if b.size() == size && accept(i) {
                return Some(i);
            }
            i = b.links().next;
        }
        None
    }

    /// The first block (by slot) the predicate `prefer` accepts among those of at least `size` bytes and
    /// at most `limit`, looking at a few of each class up to that size.
    pub(crate) fn find_preferred<B: Indexed>(
        &self,
        blocks: &[B],
        size: u64,
        limit: u64,
        prefer: impl Fn(u32) -> bool,
    ) -> Option<u32> {
        let mut class = class_of(size >> UNIT_LOG);
        while class < FL * SL {
            let c = self.first_class_from(class)?;
            let mut j = self.heads[c];
            let mut looked = 0;
            let mut past = false;
            while j != NIL && looked < SCAN {
                let b = &blocks[j as usize];
                if b.size() > limit {
                    past = true;
                } else if b.size() >= size && prefer(j) {
                    return Some(j);
                }
                j = b.links().next;
                looked += 1;
            }
            // The smallest block a class holds is at least its base size: once a class's blocks
            // are past the limit, so are the next classes'.
            if past && looked < SCAN {
                return None;
            }
            class = c + 1;
            if blocks[self.heads[c] as usize].size() > limit {
                return None;
            }
        }
        None
    }

    /// Verifies the bitmaps and every class list (links, and each block filed under its size's
    /// class), calling `each` on every listed block; returns how many are listed.
    pub(crate) fn check<B: Indexed + std::fmt::Debug>(
        &self,
        blocks: &[B],
        mut each: impl FnMut(u32, &B) -> Result<(), String>,
    ) -> Result<usize, String> {
        let mut listed = 0usize;
        for class in 0..FL * SL {
            let bit = self.sl_maps[class / SL] & (1 << (class % SL)) != 0;
            if bit != (self.heads[class] != NIL) {
                return Err(format!(
                    "class {class}: bitmap {bit} but head {}",
                    self.heads[class]
                ));
            }
            if bit && self.fl_map & (1 << (class / SL)) == 0 {
                return Err(format!("class {class}: first-level bit missing"));
            }
            let (mut i, mut prev) = (self.heads[class], NIL);
            while i != NIL {
                let b = blocks
                    .get(i as usize)
                    .ok_or_else(|| format!("class {class} lists slot {i}, past the slab"))?;
                if b.links().prev != prev || b.links().class as usize != class {
                    return Err(format!(
                        "block {i}: broken links or class ({b:?}, in class {class})"
                    ));
                }
                if class_of(b.size() >> UNIT_LOG) != class {
                    return Err(format!(
                        "block {i}: size {} filed in class {class}",
                        b.size()
                    ));
                }
                each(i, b)?;
                listed += 1;
                prev = i;
                i = b.links().next;
            }
        }
        Ok(listed)
    }
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use super::*;

    /// The smallest size (in units) filed in `class`.
    fn class_min(class: usize) -> u64 {
        if class < SL {
            return class as u64;
        }
        let (fl, sl) = (class / SL, (class % SL) as u64);
        let msb = fl as u32 + SL_LOG - 1;
        (1u64 << msb) | (sl << (msb - SL_LOG))
    }

    #[derive(Debug)]
    struct TestBlock {
        addr: u64,
        size: u64,
        links: Links,
    }

    impl Indexed for TestBlock {
        fn size(&self) -> u64 {
            self.size
        }
        fn links(&self) -> &Links {
            &self.links
        }
        fn links_mut(&mut self) -> &mut Links {
            &mut self.links
        }
    }

    #[test]
    fn find_low_takes_the_lowest_fit_of_the_two_smallest_classes_that_fit() {
        let unit = 1u64 << UNIT_LOG;
        // (address, size in units): an exact fit high up, a looser fit low down, a block too
        // small lower still, and a much larger block lowest of all (a third class).
        let spec = [(5000, 10), (100, 12), (0, 9), (50, 40)];
        let mut blocks: Vec<TestBlock> = spec
            .iter()
            .map(|&(addr, units)| TestBlock {
                addr: addr * unit,
                size: units * unit,
                links: Links::default(),
            })
            .collect();
        let mut index = SizeIndex::default();
        for i in 0..blocks.len() as u32 {
            index.link(&mut blocks, i);
        }
        let request = 10 * unit;
        assert_eq!(
            index.find(&blocks, request),
            Some(0),
            "the closest fit is exact"
        );
        assert_eq!(
            index.find_low(&blocks, request, |b| b.addr),
            Some(1),
            "the lower of the two classes' fits, not the lowest block of a third class"
        );
        // Nothing fits: none.
        assert_eq!(index.find_low(&blocks, 41 * unit, |b| b.addr), None);
        // Only the large block fits.
        assert_eq!(index.find_low(&blocks, 13 * unit, |b| b.addr), Some(3));
        assert_eq!(index.check(&blocks, |_, _| Ok(())), Ok(4));
    }

    /// A block that fits, ninth in its class behind eight that do not, with no larger class:
    /// both searches find it.
    #[test]
    fn a_fit_past_the_scan_of_its_class_is_found_when_nothing_larger_is_free() {
        let unit = 1u64 << UNIT_LOG;
        // 1,024 to 1,055 units are one class. Linked first, the fit ends up last in its list.
        let mut sizes = vec![1055u64];
        sizes.extend([1024; SCAN]);
        let mut blocks: Vec<TestBlock> = (0..sizes.len())
            .map(|i| TestBlock {
                addr: i as u64 * 2000 * unit,
                size: sizes[i] * unit,
                links: Links::default(),
            })
            .collect();
        let mut index = SizeIndex::default();
        for i in 0..blocks.len() as u32 {
            index.link(&mut blocks, i);
        }
        assert_eq!(index.find(&blocks, 1055 * unit), Some(0));
        assert_eq!(index.find_low(&blocks, 1055 * unit, |b| b.addr), Some(0));
        assert_eq!(index.find(&blocks, 1056 * unit), None);
        assert_eq!(index.find_low(&blocks, 1056 * unit, |b| b.addr), None);
        // With a larger class free, its head is taken, as before (constant time).
        blocks.push(TestBlock {
            addr: 1 << 40,
            size: 4000 * unit,
            links: Links::default(),
        });
        index.link(&mut blocks, SCAN as u32 + 1);
        assert_eq!(index.find(&blocks, 1055 * unit), Some(SCAN as u32 + 1));
        assert_eq!(index.check(&blocks, |_, _| Ok(())), Ok(SCAN + 2));
    }

    #[test]
    fn classes_are_monotonic_and_search_rounds_up() {
        let small = 1..5000u64;
        let large = (13..50).flat_map(|p| {
            [
                (1u64 << p) - 1,
                1 << p,
                (1 << p) + 1,
                (1 << p) + (1 << (p - 6)) + 3,
            ]
        });
        let mut last = 0;
        for units in small.chain(large) {
            let c = class_of(units);
            assert!(
                c >= last && class_min(c) <= units,
                "units {units}: class {c}"
            );
            last = c;
            let at_least = class_at_least(units).unwrap();
            assert!(
                class_min(at_least) >= units,
                "units {units}: class {at_least} may hold less"
            );
            assert!(
                at_least <= c + 1,
                "units {units}: rounded up more than one class"
            );
        }
    }
}
