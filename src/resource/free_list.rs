//! One free list: the free blocks of one of the arena's stream arenas, coalesced. (The pool's
//! engine has its own structure, `stream_ordered/blocks.rs`, which also knows the blocks in
//! use; moving the arena onto it needs a way to move a superblock's blocks, free and in use,
//! between stream arenas.)
//!
//! A two-level segregated fit index (`tlsf.rs`) finds a block in O(1), within 3% of the best
//! fit.
//!
//! Coalescing is O(1) too: two hash maps find a freed block's neighbours by address (the block
//! ending where it starts, the block starting where it ends). Blocks never merge across upstream
//! chunks: `chunks` holds every chunk's range (a few, sorted), a merge over a chunk start is
//! refused, and a freed range that does not lie inside one chunk is refused as not ours.
//!
//! Each block carries a *tag* ([`BlockTag`]; `()` for the arena, the only user now; the trait
//! is also the engine's block table's). Coalescing joins the tags of the blocks it merges; a
//! split leaves the tag on both pieces.
//!
//! [`FreeList::check`] verifies every invariant (talc's `scan_for_errors`); the tests call it
//! after every step.

use std::fmt;

use rustc_hash::FxHashMap;

use crate::resource::tlsf::{Indexed, Links, SizeIndex};
use crate::resource::ALIGNMENT;

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
    links: Links,
    tag: T,
}

impl<T> Indexed for Block<T> {
    #[inline]
    fn size(&self) -> u64 {
        self.size
    }
    #[inline]
    fn links(&self) -> &Links {
        &self.links
    }
    #[inline]
    fn links_mut(&mut self) -> &mut Links {
        &mut self.links
    }
}

/// The free blocks of one list.
#[derive(Debug)]
pub(crate) struct FreeList<T: BlockTag = ()> {
    blocks: Vec<Block<T>>,
    /// Slab slots free for reuse.
    spare: Vec<u32>,
    index: SizeIndex,
    by_start: FxHashMap<u64, u32>,
    by_end: FxHashMap<u64, u32>,
    /// The upstream chunks' `(start, end)`, sorted: no merge crosses a start, and a freed range
    /// must lie inside one.
    chunks: Vec<(u64, u64)>,
    free_bytes: u64,
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
            index: SizeIndex::default(),
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
        self.index.link(&mut self.blocks, i);
    }

    fn unlink(&mut self, i: u32) {
        self.index.unlink(&mut self.blocks, i);
    }

    fn new_slot(&mut self, addr: u64, size: u64, tag: T) -> u32 {
        let block = Block {
            addr,
            size,
            links: Links::default(),
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

    // ===== take and give =====

    /// Takes `size` bytes (a multiple of [`ALIGNMENT`], non-zero) from the list; the remainder
    /// of the block stays. Returns the address, or `None` if no block is large enough.
    pub(crate) fn take(&mut self, size: u64) -> Option<u64> {
        self.take_tagged(size).map(|(addr, _)| addr)
    }

    /// [`take`](Self::take), with the tag of the block it came from.
    pub(crate) fn take_tagged(&mut self, size: u64) -> Option<(u64, T)> {
        debug_assert!(size > 0 && size.is_multiple_of(ALIGNMENT as u64));
        let i = self.index.find(&self.blocks, size)?;
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

    /// Verifies every invariant; returns the first violation found. Not cheap: tests only.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut total = 0u64;
        let listed = self.index.check(&self.blocks, |i, b| {
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
            total += b.size;
            Ok(())
        })?;
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
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests;
