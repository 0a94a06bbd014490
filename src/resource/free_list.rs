//! One free list: the free blocks of one stream (or the pool's fresh memory), coalesced.
//!
//! A two-level segregated fit (TLSF) index finds a block in O(1): sizes (in 256-byte units) map
//! to 32 linear sub-classes per power of two, two bitmaps name the non-empty classes, and each
//! class is a doubly linked list of blocks in a slab. A request first scans a few blocks of its
//! own class for the smallest that fits (exact fits are common: the same sizes come back), then
//! takes the first block of the smallest class whose every block fits. That is a fit within
//! 1/32 (3%) of the best, in constant time, where an exact best fit in a size-ordered tree costs
//! two tree updates per operation (we measured that budget: the pool's target is under 100 ns
//! per allocate or free, all included).
//!
//! Coalescing is O(1) too: two hash maps find a freed block's neighbours by address (the block
//! ending where it starts, the block starting where it ends). Blocks never merge across upstream
//! chunks: `chunks` holds every chunk's range (a few, sorted), a merge over a chunk start is
//! refused, and a freed range that does not lie inside one chunk is refused as not ours.
//!
//! Each block carries a *tag* ([`BlockTag`]; `()` for lists that need none): the pool's engine
//! keeps there the streams a block's reuse must be ordered after. Coalescing joins the tags of
//! the blocks it merges; a split leaves the tag on both pieces.
//!
//! [`FreeList::check`] verifies every invariant (talc's `scan_for_errors`); the tests call it
//! after every step.

use std::fmt;

use rustc_hash::FxHashMap;

use crate::resource::ALIGNMENT;

/// log2 of the sub-classes per power of two.
const SL_LOG: u32 = 5;
const SL: usize = 1 << SL_LOG;
/// First-level classes: enough for any 64-bit size in 256-byte units.
const FL: usize = 64 - SL_LOG as usize;
/// How many blocks of the request's own class to scan for a closer fit.
const SCAN: usize = 8;
const NIL: u32 = u32::MAX;
const UNIT_LOG: u32 = ALIGNMENT.trailing_zeros();

/// What a free block carries beside its range: joined when blocks coalesce, copied when one
/// splits.
pub(crate) trait BlockTag: Clone + Default + fmt::Debug {
    /// Folds `other` (a neighbour's tag, or a freed range's) into `self`.
    fn join(&mut self, other: &Self);
}

impl BlockTag for () {
    #[inline(always)]
    fn join(&mut self, _other: &Self) {}
}

#[derive(Clone, Debug)]
struct Block<T> {
    addr: u64,
    size: u64,
    prev: u32,
    next: u32,
    class: u16,
    tag: T,
}

/// The free blocks of one list.
#[derive(Debug)]
pub(crate) struct FreeList<T: BlockTag = ()> {
    blocks: Vec<Block<T>>,
    /// Slab slots free for reuse.
    spare: Vec<u32>,
    heads: Vec<u32>,
    fl_map: u64,
    sl_maps: [u32; FL],
    by_start: FxHashMap<u64, u32>,
    by_end: FxHashMap<u64, u32>,
    /// The upstream chunks' `(start, end)`, sorted: no merge crosses a start, and a freed range
    /// must lie inside one.
    chunks: Vec<(u64, u64)>,
    free_bytes: u64,
}

/// The class of a size in units: (first level, second level), flattened.
fn class_of(units: u64) -> usize {
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

impl<T: BlockTag> Default for FreeList<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: BlockTag> FreeList<T> {
    pub(crate) fn new() -> Self {
        Self {
            blocks: Vec::new(),
            spare: Vec::new(),
            heads: vec![NIL; FL * SL],
            fl_map: 0,
            sl_maps: [0; FL],
            by_start: FxHashMap::default(),
            by_end: FxHashMap::default(),
            chunks: Vec::new(),
            free_bytes: 0,
        }
    }

    /// Bytes in the list.
    pub(crate) fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Blocks in the list.
    pub(crate) fn len(&self) -> usize {
        self.by_start.len()
    }

    /// Registers an upstream chunk: no block will merge across its start, and freed ranges
    /// inside it are accepted.
    pub(crate) fn add_chunk(&mut self, start: u64, size: u64) {
        let at = self.chunks.partition_point(|c| c.0 < start);
        if self.chunks.get(at).is_none_or(|c| c.0 != start) {
            self.chunks.insert(at, (start, start + size));
        }
    }

    pub(crate) fn remove_chunk(&mut self, start: u64) {
        self.chunks.retain(|c| c.0 != start);
    }

    /// A chunk start without a known end: merges stop there, and frees after it are not
    /// checked against an end. (For callers that track their own chunk sizes.)
    pub(crate) fn add_boundary(&mut self, start: u64) {
        self.add_chunk(start, u64::MAX - start);
    }

    pub(crate) fn remove_boundary(&mut self, start: u64) {
        self.remove_chunk(start);
    }

    fn is_chunk_start(&self, addr: u64) -> bool {
        self.chunks.binary_search_by_key(&addr, |c| c.0).is_ok()
    }

    /// Whether `[addr, addr + size)` lies inside one registered chunk.
    fn inside_a_chunk(&self, addr: u64, size: u64) -> bool {
        let at = self.chunks.partition_point(|c| c.0 <= addr);
        at > 0
            && addr
                .checked_add(size)
                .is_some_and(|end| end <= self.chunks[at - 1].1)
    }

    // ===== class lists =====

    fn link(&mut self, i: u32) {
        let class = class_of(self.blocks[i as usize].size >> UNIT_LOG);
        let head = self.heads[class];
        {
            let b = &mut self.blocks[i as usize];
            b.class = class as u16;
            b.prev = NIL;
            b.next = head;
        }
        if head != NIL {
            self.blocks[head as usize].prev = i;
        }
        self.heads[class] = i;
        self.sl_maps[class / SL] |= 1 << (class % SL);
        self.fl_map |= 1 << (class / SL);
    }

    fn unlink(&mut self, i: u32) {
        let Block {
            prev, next, class, ..
        } = self.blocks[i as usize];
        let class = class as usize;
        if prev != NIL {
            self.blocks[prev as usize].next = next;
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
            self.blocks[next as usize].prev = prev;
        }
    }

    fn new_slot(&mut self, addr: u64, size: u64, tag: T) -> u32 {
        let block = Block {
            addr,
            size,
            prev: NIL,
            next: NIL,
            class: 0,
            tag,
        };
        match self.spare.pop() {
            Some(i) => {
                self.blocks[i as usize] = block;
                i
            }
            None => {
                self.blocks.push(block);
                (self.blocks.len() - 1) as u32
            }
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

    /// A block of at least `units`: the closest among the first few of its own class, else the
    /// head of the smallest class that surely fits.
    fn find(&self, units: u64) -> Option<u32> {
        let own = class_of(units);
        if own < FL * SL {
            let mut best: Option<u32> = None;
            let mut i = self.heads[own];
            for _ in 0..SCAN {
                if i == NIL {
                    break;
                }
                let b = &self.blocks[i as usize];
                if (b.size >> UNIT_LOG) >= units
                    && best.is_none_or(|j| b.size < self.blocks[j as usize].size)
                {
                    best = Some(i);
                    if b.size >> UNIT_LOG == units {
                        break;
                    }
                }
                i = b.next;
            }
            if best.is_some() {
                return best;
            }
        }
        let class = self.first_class_from(class_at_least(units)?)?;
        Some(self.heads[class])
    }

    // ===== take and give =====

    /// The size of the block [`take`](Self::take) would split for `size` bytes, if any: how
    /// good a fit this list has, to choose between lists.
    pub(crate) fn fit(&self, size: u64) -> Option<u64> {
        self.find(size >> UNIT_LOG)
            .map(|i| self.blocks[i as usize].size)
    }

    /// Takes `size` bytes (a multiple of [`ALIGNMENT`], non-zero) from the list; the remainder
    /// of the block stays. Returns the address, or `None` if no block is large enough.
    pub(crate) fn take(&mut self, size: u64) -> Option<u64> {
        self.take_tagged(size).map(|(addr, _)| addr)
    }

    /// [`take`](Self::take), with the tag of the block it came from.
    pub(crate) fn take_tagged(&mut self, size: u64) -> Option<(u64, T)> {
        debug_assert!(size > 0 && size.is_multiple_of(ALIGNMENT as u64));
        let i = self.find(size >> UNIT_LOG)?;
        Some(self.take_from(i, size))
    }

    /// [`take_tagged`](Self::take_tagged), preferring a block whose tag `prefer` accepts: if
    /// the block it would take is not one, the first such block at most `slack` (a fraction)
    /// larger, among a few of each size class up to that size, is taken instead.
    pub(crate) fn take_preferring(
        &mut self,
        size: u64,
        slack: f64,
        prefer: impl Fn(&T) -> bool,
    ) -> Option<(u64, T)> {
        debug_assert!(size > 0 && size.is_multiple_of(ALIGNMENT as u64));
        let units = size >> UNIT_LOG;
        let i = self.find(units)?;
        let b = &self.blocks[i as usize];
        if slack <= 0.0 || prefer(&b.tag) {
            return Some(self.take_from(i, size));
        }
        let limit = ((b.size as f64) * (1.0 + slack)) as u64;
        let mut class = class_of(units);
        while class < FL * SL {
            let Some(c) = self.first_class_from(class) else {
                break;
            };
            let mut j = self.heads[c];
            let mut looked = 0;
            let mut past = false;
            while j != NIL && looked < SCAN {
                let b = &self.blocks[j as usize];
                if b.size > limit {
                    past = true;
                } else if b.size >= size && prefer(&b.tag) {
                    return Some(self.take_from(j, size));
                }
                j = b.next;
                looked += 1;
            }
            // The smallest block a class holds is at least its base size: once a class's blocks
            // are past the limit, so are the next classes'.
            if past && looked < SCAN {
                break;
            }
            class = c + 1;
            if self.blocks[self.heads[c] as usize].size > limit {
                break;
            }
        }
        Some(self.take_from(i, size))
    }

    /// Takes `size` bytes from the start of block `i`; the remainder keeps the slot, its end
    /// and its tag.
    fn take_from(&mut self, i: u32, size: u64) -> (u64, T) {
        self.unlink(i);
        let (addr, have) = (self.blocks[i as usize].addr, self.blocks[i as usize].size);
        self.by_start.remove(&addr);
        let tag = if have > size {
            let b = &mut self.blocks[i as usize];
            b.addr = addr + size;
            b.size = have - size;
            let tag = b.tag.clone();
            self.by_start.insert(addr + size, i);
            self.link(i);
            tag
        } else {
            self.by_end.remove(&(addr + have));
            self.spare.push(i);
            std::mem::take(&mut self.blocks[i as usize].tag)
        };
        self.free_bytes -= size;
        (addr, tag)
    }

    /// Takes the block starting at `addr` if it is exactly `size` bytes (a whole chunk, for
    /// trimming).
    pub(crate) fn take_exact(&mut self, addr: u64, size: u64) -> bool {
        self.take_exact_tagged(addr, size).is_some()
    }

    /// [`take_exact`](Self::take_exact), with the block's tag.
    pub(crate) fn take_exact_tagged(&mut self, addr: u64, size: u64) -> Option<T> {
        match self.by_start.get(&addr) {
            Some(&i) if self.blocks[i as usize].size == size => {
                self.unlink(i);
                self.by_start.remove(&addr);
                self.by_end.remove(&(addr + size));
                self.spare.push(i);
                self.free_bytes -= size;
                Some(std::mem::take(&mut self.blocks[i as usize].tag))
            }
            _ => None,
        }
    }

    /// Gives `[addr, addr + size)` back, merging it with free neighbours of the same chunk.
    /// Returns false, changing nothing, if the range is not inside one chunk, or if a free block
    /// already starts or ends where it does (a double free).
    pub(crate) fn give(&mut self, addr: u64, size: u64) -> bool {
        self.give_tagged(addr, size, T::default())
    }

    /// [`give`](Self::give), the range carrying `tag` (joined with its neighbours' if it
    /// coalesces with them).
    pub(crate) fn give_tagged(&mut self, addr: u64, size: u64, tag: T) -> bool {
        debug_assert!(
            size > 0
                && size.is_multiple_of(ALIGNMENT as u64)
                && addr.is_multiple_of(ALIGNMENT as u64)
        );
        if !self.inside_a_chunk(addr, size)
            || self.by_start.contains_key(&addr)
            || self.by_end.contains_key(&(addr + size))
        {
            return false;
        }
        let end = addr + size;
        let left = if self.is_chunk_start(addr) {
            None
        } else {
            self.by_end.get(&addr).copied()
        };
        let right = if self.is_chunk_start(end) {
            None
        } else {
            self.by_start.get(&end).copied()
        };
        match (left, right) {
            (None, None) => {
                let i = self.new_slot(addr, size, tag);
                self.by_start.insert(addr, i);
                self.by_end.insert(end, i);
                self.link(i);
            }
            (Some(l), None) => {
                self.unlink(l);
                self.by_end.remove(&addr);
                self.by_end.insert(end, l);
                let b = &mut self.blocks[l as usize];
                b.size += size;
                b.tag.join(&tag);
                self.link(l);
            }
            (None, Some(r)) => {
                self.unlink(r);
                self.by_start.remove(&end);
                self.by_start.insert(addr, r);
                let b = &mut self.blocks[r as usize];
                b.addr = addr;
                b.size += size;
                b.tag.join(&tag);
                self.link(r);
            }
            (Some(l), Some(r)) => {
                self.unlink(l);
                self.unlink(r);
                let r_size = self.blocks[r as usize].size;
                self.by_end.remove(&addr);
                self.by_start.remove(&end);
                self.by_end.insert(end + r_size, l);
                let r_tag = std::mem::take(&mut self.blocks[r as usize].tag);
                let b = &mut self.blocks[l as usize];
                b.size += size + r_size;
                b.tag.join(&tag);
                b.tag.join(&r_tag);
                self.spare.push(r);
                self.link(l);
            }
        }
        self.free_bytes += size;
        true
    }

    /// Every block (for statistics and the invariant checker).
    pub(crate) fn blocks(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.by_start
            .values()
            .map(|&i| (self.blocks[i as usize].addr, self.blocks[i as usize].size))
    }

    /// Every block with its tag.
    pub(crate) fn tagged_blocks(&self) -> impl Iterator<Item = (u64, u64, &T)> + '_ {
        self.by_start.values().map(|&i| {
            let b = &self.blocks[i as usize];
            (b.addr, b.size, &b.tag)
        })
    }

    /// Runs `f` on every block's tag.
    pub(crate) fn for_each_tag(&mut self, mut f: impl FnMut(&mut T)) {
        for &i in self.by_start.values() {
            f(&mut self.blocks[i as usize].tag);
        }
    }

    /// Verifies every invariant; returns the first violation found. Not cheap: tests only.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut listed = 0usize;
        let mut total = 0u64;
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
                let b = &self.blocks[i as usize];
                if b.prev != prev || b.class as usize != class {
                    return Err(format!(
                        "block {i}: broken links or class ({b:?}, in class {class})"
                    ));
                }
                if class_of(b.size >> UNIT_LOG) != class {
                    return Err(format!("block {i}: size {} filed in class {class}", b.size));
                }
                if self.by_start.get(&b.addr) != Some(&i)
                    || self.by_end.get(&(b.addr + b.size)) != Some(&i)
                {
                    return Err(format!("block {i}: address maps disagree ({b:?})"));
                }
                if !self.inside_a_chunk(b.addr, b.size) {
                    return Err(format!("block {i} lies outside every chunk ({b:?})"));
                }
                if b.size == 0
                    || !b.size.is_multiple_of(ALIGNMENT as u64)
                    || !b.addr.is_multiple_of(ALIGNMENT as u64)
                {
                    return Err(format!("block {i}: misaligned or empty ({b:?})"));
                }
                listed += 1;
                total += b.size;
                prev = i;
                i = b.next;
            }
        }
        if listed != self.by_start.len() || listed != self.by_end.len() {
            return Err(format!(
                "{listed} blocks listed, {} by start, {} by end",
                self.by_start.len(),
                self.by_end.len()
            ));
        }
        if total != self.free_bytes {
            return Err(format!(
                "blocks hold {total} bytes, counter says {}",
                self.free_bytes
            ));
        }
        let mut sorted: Vec<(u64, u64)> = self.blocks().collect();
        sorted.sort_unstable();
        for w in sorted.windows(2) {
            let (a, b) = (w[0], w[1]);
            if a.0 + a.1 > b.0 {
                return Err(format!("blocks overlap: {a:x?} and {b:x?}"));
            }
            if a.0 + a.1 == b.0 && !self.is_chunk_start(b.0) {
                return Err(format!(
                    "adjacent blocks of one chunk not merged: {a:x?} and {b:x?}"
                ));
            }
        }
        Ok(())
    }

    // ===== for the expandable pool (resource/expandable): added by issue 11 =====

    /// The size of the free block that ends at `addr`, or 0 if none does.
    pub(crate) fn free_ending_at(&self, addr: u64) -> u64 {
        self.by_end
            .get(&addr)
            .map_or(0, |&i| self.blocks[i as usize].size)
    }

    /// The size of the free block that starts at `addr`, or 0 if none does.
    pub(crate) fn free_starting_at(&self, addr: u64) -> u64 {
        self.by_start
            .get(&addr)
            .map_or(0, |&i| self.blocks[i as usize].size)
    }

    /// Takes `[lo, hi)` out of the middle of the free block that starts at `block`, leaving
    /// its pieces before and after in the list (with the block's tag): the block's tag, or
    /// `None`, changing nothing, unless such a block holds all of the range.
    pub(crate) fn take_range_tagged(&mut self, block: u64, lo: u64, hi: u64) -> Option<T> {
        let size = self.free_starting_at(block);
        if size == 0 || lo < block || hi > block + size || lo >= hi {
            return None;
        }
        let tag = self.take_exact_tagged(block, size);
        debug_assert!(tag.is_some());
        let tag = tag.unwrap_or_default();
        // The pieces cannot merge with anything: the block was coalesced with its neighbours.
        for (addr, end) in [(block, lo), (hi, block + size)] {
            if end > addr {
                let given = self.give_tagged(addr, end - addr, tag.clone());
                debug_assert!(given, "a piece of a split block could not go back");
            }
        }
        Some(tag)
    }
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests;
