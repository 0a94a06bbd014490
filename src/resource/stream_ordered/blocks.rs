//! The engine's memory, block by block: every block of its chunks, free or handed out, linked
//! to its neighbours in address order, free blocks also filed by size (`tlsf.rs`).
//!
//! Why not the arena's free list (`free_list.rs`)? That one knows only free blocks, so a free
//! finds its neighbours in two hash maps (by start, by end), and the engine kept a third map of
//! the blocks handed out, to refuse a free of memory it never handed out: about ten hash-map
//! operations per allocate/free pair, most of the engine's time (`perf` on `engine_lab`'s
//! `engine_time_churn_1t`, issue 10). Here a block handed out keeps its slot and its links, so a
//! free is one lookup in the map of blocks in use, and its neighbours are one link away; a take
//! is one insertion. A free that does not name a block in use with its exact size is refused,
//! always: the check costs nothing more.
//!
//! Memory inside a chunk that is in no block is a *hole*: not yet given (a chunk is registered
//! before its memory is given), or taken out ([`take_exact`](BlockTable::take_exact),
//! [`take_aligned`](BlockTable::take_aligned): a chunk going back upstream, granules being
//! unmapped). Blocks link only to blocks that touch them, so nothing coalesces across a hole
//! or a chunk's start; giving a hole's memory back ([`give_range`](BlockTable::give_range))
//! finds its neighbours by a scan, which only the cold paths (growth, trim, their rollbacks) do.

use std::fmt;

use super::addr_map::AddrMap;
use crate::resource::free_list::BlockTag;
use crate::resource::tlsf::{Indexed, Links, SizeIndex, NIL};
use crate::resource::ALIGNMENT;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Free,
    Used,
    /// Freed, but kept aside whole in the small-block cache for its stream's next request of
    /// its size (still in the map of blocks in use, not coalesced, not filed by size).
    Cached,
    /// The slot holds no block (reusable).
    Spare,
}

#[derive(Clone, Debug)]
struct Block {
    addr: u64,
    size: u64,
    /// Its place in the size index (free blocks only).
    links: Links,
    /// The blocks that end where it starts and start where it ends, if any ([`NIL`]).
    before: u32,
    after: u32,
    state: State,
    /// Who the block was handed out to, as the caller named it ([`NO_OWNER`]: no one said):
    /// only its owner's free may keep it in the small-block cache. In the padding.
    owner: u16,
}

/// The owner of a block no caller named ([`BlockTable::take_tagged`]).
pub(crate) const NO_OWNER: u16 = u16::MAX;

impl Block {
    fn end(&self) -> u64 {
        self.addr + self.size
    }
}

impl Indexed for Block {
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

/// The free block a [`BlockTable::free_untagged`] ended in: valid until the table changes.
pub(crate) struct FreedBlock(u32);

/// A block in use, found by [`BlockTable::used_slot`]: its slot and its entry's position in the
/// map of blocks in use, valid until the table changes.
pub(crate) struct UsedBlock(u32, usize);

/// Every block of the engine's chunks (of one shard).
pub(crate) struct BlockTable<T: BlockTag> {
    blocks: Vec<Block>,
    /// What each slot's block's reuse waits for (free blocks; empty otherwise). Apart from the
    /// blocks, so that walking the size classes and the neighbours touches fewer cache lines:
    /// the engine's tag is 72 bytes, a block 40.
    tags: Vec<T>,
    /// Slots of [`State::Spare`], for reuse.
    spare: Vec<u32>,
    index: SizeIndex,
    /// Blocks handed out: start → slot.
    used: AddrMap,
    /// The chunks' `(start, end)`, sorted: blocks lie inside one, and none links across a start.
    chunks: Vec<(u64, u64)>,
    free_bytes: u64,
    free_blocks: usize,
    /// Placement: the lowest address among near fits ([`SizeIndex::find_low`]) instead of the
    /// closest fit ([`SizeIndex::find`]).
    low: bool,
    /// The small-block cache (see [`Cache`]). Boxed: inline, its fields spread the table's hot
    /// ones over more cache lines, and four threads on the engine ran 10 to 15% slower even
    /// with the cache off (`engine_lab::engine_four_real_threads`, `churn-xs-4t` from 2 GiB on
    /// the 2-core development machine: 47.8 to 49.8 ns/op against 39.5 to 47.1; boxed 41.0 to
    /// 46.3).
    cache: Box<Cache>,
}

/// The largest block the small-block cache keeps: a request at most this large may be served
/// from it.
pub(crate) const CACHE_MAX: u64 = 64 << 10;
/// Blocks the cache keeps of one size, at most.
const CACHE_DEPTH: usize = 16;
/// Size classes of the cache: one per multiple of [`ALIGNMENT`] up to [`CACHE_MAX`].
const CACHE_CLASSES: usize = (CACHE_MAX / ALIGNMENT as u64) as usize;

/// The small-block cache (issue 10's fast path): blocks of at most [`CACHE_MAX`] bytes freed
/// whole by their owner, kept aside by exact size instead of coalesced and filed, for the next
/// request of that size. Such a request takes the block back as it lies: no best-fit search,
/// no split, no new slot, no change to the map of blocks in use; its free is one lookup.
/// WORKLOADS.md's sizes repeat often at the small end (`churn-1t` has 2 sizes below 512 bytes
/// and 256 below 64 KiB), so 43% of its requests are served here.
///
/// Only a free by the block's *owner* (whoever took it, as the caller names it: the engine
/// names the stream, and only in the thread's own shard) is kept
/// ([`may_cache`](BlockTable::may_cache)): a block handed off to another stream, or freed into
/// another thread's shard, would wait for a request that may never look for it. A cached block
/// keeps its tag (the stream it was freed on and its epoch then), and the table hands it back only
/// to a caller that accepts the tag ([`take_cached`](BlockTable::take_cached): the engine
/// accepts a block freed on the requester's own stream, which stream order covers); when none
/// of its size is accepted, the last freed goes to the free blocks, coalesced and tagged as
/// any free, so the cache turns over. The cache holds at most `budget` bytes and
/// [`CACHE_DEPTH`] blocks of a size; a free past either goes to the free blocks. Whatever would
/// grow the pool, trim it or move memory empties the cache first
/// ([`uncache_all`](BlockTable::uncache_all)), and so does a request that finds no fit among
/// the free blocks, so a cached block never costs a growth or strands memory.
#[derive(Default)]
struct Cache {
    /// Per size class (`size / ALIGNMENT - 1`), the slots of the blocks it holds, last freed
    /// last (the first `lens[class]`). Allocated when the cache is turned on.
    lists: Box<[[u32; CACHE_DEPTH]]>,
    lens: Box<[u8]>,
    bytes: u64,
    blocks: usize,
    /// Bytes it may hold; 0: off.
    budget: u64,
    /// Requests it served.
    hits: u64,
}

impl Cache {
    /// The slots cached in `class`.
    fn list(&self, class: usize) -> &[u32] {
        &self.lists[class][..self.lens[class] as usize]
    }
}

impl<T: BlockTag> fmt::Debug for BlockTable<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockTable")
            .field("free_bytes", &self.free_bytes)
            .field("free_blocks", &self.free_blocks)
            .field("used_blocks", &self.used.len())
            .finish()
    }
}

impl<T: BlockTag> Default for BlockTable<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: BlockTag> BlockTable<T> {
    /// A table of no chunks.
    pub(crate) fn new() -> Self {
        BlockTable {
            blocks: Vec::new(),
            tags: Vec::new(),
            spare: Vec::new(),
            index: SizeIndex::default(),
            used: AddrMap::default(),
            chunks: Vec::new(),
            free_bytes: 0,
            free_blocks: 0,
            low: false,
            cache: Box::default(),
        }
    }

    /// Turns the small-block cache on with room for `budget` bytes (0: off, emptying it).
    pub(crate) fn set_cache(&mut self, budget: u64) {
        if budget == 0 {
            self.uncache_all();
        } else if self.cache.lists.is_empty() {
            self.cache.lists = vec![[NIL; CACHE_DEPTH]; CACHE_CLASSES].into_boxed_slice();
            self.cache.lens = vec![0; CACHE_CLASSES].into_boxed_slice();
        }
        self.cache.budget = budget;
    }

    /// Whether a block of `size` bytes may be served from (or kept in) the small-block cache.
    #[inline]
    pub(crate) fn caches(&self, size: u64) -> bool {
        size <= CACHE_MAX && self.cache.budget > 0
    }

    /// Whether the small-block cache holds a block of exactly `size` bytes (of any stream).
    #[inline]
    pub(crate) fn has_cached(&self, size: u64) -> bool {
        let class = (size / ALIGNMENT as u64).wrapping_sub(1) as usize;
        self.cache.lens.get(class).is_some_and(|&n| n > 0)
    }

    /// Blocks in the small-block cache now.
    pub(crate) fn cached_blocks(&self) -> usize {
        self.cache.blocks
    }

    /// Requests the small-block cache served so far.
    pub(crate) fn cache_hits(&self) -> u64 {
        self.cache.hits
    }

    /// Places blocks at the lowest address among the near fits ([`SizeIndex::find_low`]), not
    /// at the closest fit: the expandable pool's default, which keeps the top of its range free
    /// in whole granules (`ExpandablePlacement`).
    pub(crate) fn place_low(&mut self, on: bool) {
        self.low = on;
    }

    /// The free block a request of `size` bytes takes from, by the table's placement.
    #[inline]
    fn find(&self, size: u64) -> Option<u32> {
        if self.low {
            self.index.find_low(&self.blocks, size, |b| b.addr)
        } else {
            self.index.find(&self.blocks, size)
        }
    }

    /// Free bytes (the small-block cache's included).
    pub(crate) fn free_bytes(&self) -> u64 {
        self.free_bytes + self.cache.bytes
    }

    /// Free blocks (the small-block cache's included).
    pub(crate) fn len(&self) -> usize {
        self.free_blocks + self.cache.blocks
    }

    // ===== chunks =====

    /// Registers a chunk (its memory a hole until [`give_range`](Self::give_range)).
    pub(crate) fn add_chunk(&mut self, start: u64, size: u64) {
        let at = self.chunks.partition_point(|c| c.0 < start);
        if self.chunks.get(at).is_none_or(|c| c.0 != start) {
            self.chunks.insert(at, (start, start + size));
        }
    }

    /// Forgets a chunk, whose memory must all be a hole by now (taken out).
    pub(crate) fn remove_chunk(&mut self, start: u64) {
        debug_assert!(
            !self.slots().any(|i| {
                let b = &self.blocks[i as usize];
                self.chunk_of(b.addr).is_some_and(|c| c.0 == start)
            }),
            "a chunk removed while it still holds blocks"
        );
        self.chunks.retain(|c| c.0 != start);
    }

    fn is_chunk_start(&self, addr: u64) -> bool {
        self.chunks.binary_search_by_key(&addr, |c| c.0).is_ok()
    }

    /// The chunk holding the byte at `addr`.
    fn chunk_of(&self, addr: u64) -> Option<(u64, u64)> {
        let at = self.chunks.partition_point(|c| c.0 <= addr);
        (at > 0 && addr < self.chunks[at - 1].1).then(|| self.chunks[at - 1])
    }

    /// Whether `[addr, addr + size)` lies inside one chunk.
    fn inside_a_chunk(&self, addr: u64, size: u64) -> bool {
        self.chunk_of(addr)
            .is_some_and(|c| addr.checked_add(size).is_some_and(|end| end <= c.1))
    }

    // ===== slots =====

    /// The slots that hold a block.
    fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.blocks.len() as u32).filter(|&i| self.blocks[i as usize].state != State::Spare)
    }

    fn new_slot(&mut self, block: Block, tag: T) -> u32 {
        match self.spare.pop() {
            Some(i) => {
                self.blocks[i as usize] = block;
                self.tags[i as usize] = tag;
                i
            }
            None => {
                self.blocks.push(block);
                self.tags.push(tag);
                (self.blocks.len() - 1) as u32
            }
        }
    }

    /// A new block of `[addr, addr + size)` between `before` and `after` (either [`NIL`]),
    /// which are linked to it. Not filed: the caller files a free one, or coalesces it.
    #[inline]
    fn new_block(
        &mut self,
        (addr, size): (u64, u64),
        (before, after): (u32, u32),
        state: State,
        tag: T,
    ) -> u32 {
        let block = Block {
            addr,
            size,
            links: Links::default(),
            before,
            after,
            state,
            owner: NO_OWNER,
        };
        let i = self.new_slot(block, tag);
        if before != NIL {
            self.blocks[before as usize].after = i;
        }
        if after != NIL {
            self.blocks[after as usize].before = i;
        }
        i
    }

    fn release_slot(&mut self, i: u32) {
        self.blocks[i as usize].state = State::Spare;
        self.tags[i as usize] = T::default();
        self.spare.push(i);
    }

    /// Files free block `i` by size and counts it.
    #[inline]
    fn file(&mut self, i: u32) {
        self.index.link(&mut self.blocks, i);
        self.free_bytes += self.blocks[i as usize].size;
        self.free_blocks += 1;
    }

    /// Takes free block `i` out of the size index and the counts.
    #[inline]
    fn unfile(&mut self, i: u32) {
        self.index.unlink(&mut self.blocks, i);
        self.free_bytes -= self.blocks[i as usize].size;
        self.free_blocks -= 1;
    }

    fn is_free(&self, i: u32) -> bool {
        i != NIL && self.blocks[i as usize].state == State::Free
    }

    /// Unlinks block `i`'s neighbours from it (`i` becomes a hole).
    fn unlink_neighbours(&mut self, i: u32) {
        let Block { before, after, .. } = self.blocks[i as usize];
        if before != NIL {
            self.blocks[before as usize].after = NIL;
        }
        if after != NIL {
            self.blocks[after as usize].before = NIL;
        }
    }

    /// Merges free block `i` with its free neighbours, files it, and returns its slot.
    #[inline]
    fn coalesce_and_file(&mut self, mut i: u32) -> u32 {
        let after = self.blocks[i as usize].after;
        if self.is_free(after) {
            self.unfile(after);
            let Block {
                size, after: next, ..
            } = self.blocks[after as usize];
            let tag = std::mem::take(&mut self.tags[after as usize]);
            self.tags[i as usize].join(&tag);
            let b = &mut self.blocks[i as usize];
            b.size += size;
            b.after = next;
            if next != NIL {
                self.blocks[next as usize].before = i;
            }
            self.release_slot(after);
        }
        let before = self.blocks[i as usize].before;
        if self.is_free(before) {
            self.unfile(before);
            let Block {
                addr,
                size,
                after: next,
                ..
            } = self.blocks[i as usize];
            let tag = std::mem::take(&mut self.tags[i as usize]);
            self.tags[before as usize].join(&tag);
            let l = &mut self.blocks[before as usize];
            debug_assert_eq!(l.end(), addr);
            l.size += size;
            l.after = next;
            if next != NIL {
                self.blocks[next as usize].before = before;
            }
            self.release_slot(i);
            i = before;
        }
        self.file(i);
        i
    }

    // ===== take =====

    /// The size of the block [`take_tagged`](Self::take_tagged) would split for `size` bytes,
    /// if any: how good a fit this table has, to choose between shards.
    pub(crate) fn fit(&self, size: u64) -> Option<u64> {
        self.find(size).map(|i| self.blocks[i as usize].size)
    }

    /// Hands out `size` bytes (a multiple of [`ALIGNMENT`], non-zero) from a fit within 3% of
    /// the best, with the tag of the block it came from; `None` if no block is large enough.
    #[cfg(test)]
    pub(crate) fn take_tagged(&mut self, size: u64) -> Option<(u64, T)> {
        self.take_tagged_by(size, NO_OWNER)
    }

    /// [`take_tagged`](Self::take_tagged) for `owner`, whose free of the block may keep it in
    /// the small-block cache ([`may_cache`](Self::may_cache)).
    #[inline]
    pub(crate) fn take_tagged_by(&mut self, size: u64, owner: u16) -> Option<(u64, T)> {
        debug_assert!(size > 0 && size.is_multiple_of(ALIGNMENT as u64));
        let i = self.find(size)?;
        Some(self.take_from(i, size, owner))
    }

    /// [`take_tagged`](Self::take_tagged), preferring a block whose tag `prefer` accepts: if
    /// the block it would take is not one, the first such block at most `slack` (a fraction)
    /// larger, among a few of each size class up to that size, is taken instead. For `owner`,
    /// as [`take_tagged_by`](Self::take_tagged_by).
    pub(crate) fn take_preferring(
        &mut self,
        size: u64,
        slack: f64,
        prefer: impl Fn(&T) -> bool,
        owner: u16,
    ) -> Option<(u64, T)> {
        debug_assert!(size > 0 && size.is_multiple_of(ALIGNMENT as u64));
        let i = self.find(size)?;
        if slack <= 0.0 || prefer(&self.tags[i as usize]) {
            return Some(self.take_from(i, size, owner));
        }
        let limit = ((self.blocks[i as usize].size as f64) * (1.0 + slack)) as u64;
        let j = (self.index)
            .find_preferred(&self.blocks, size, limit, |j| {
                prefer(&self.tags[j as usize])
            })
            .unwrap_or(i);
        Some(self.take_from(j, size, owner))
    }

    /// Hands out the first `size` bytes of free block `i`: a new block in use before what
    /// stays free (which keeps the slot and the tag), for `owner`.
    #[inline]
    fn take_from(&mut self, i: u32, size: u64, owner: u16) -> (u64, T) {
        self.unfile(i);
        let (addr, have, before) = {
            let b = &self.blocks[i as usize];
            (b.addr, b.size, b.before)
        };
        let (used, tag) = if have > size {
            let tag = self.tags[i as usize].clone();
            let used = self.new_block((addr, size), (before, i), State::Used, T::default());
            let b = &mut self.blocks[i as usize];
            b.addr = addr + size;
            b.size = have - size;
            self.file(i);
            (used, tag)
        } else {
            self.blocks[i as usize].state = State::Used;
            (i, std::mem::take(&mut self.tags[i as usize]))
        };
        self.blocks[used as usize].owner = owner;
        self.used.insert(addr, used);
        (addr, tag)
    }

    // ===== give =====

    /// Takes back the block in use at `addr`, of exactly `size` bytes, carrying `tag` (joined
    /// with its free neighbours' as it coalesces with them). False, changing nothing, unless
    /// such a block is in use: a pointer never handed out, one inside a block, a wrong size and
    /// a second free are all refused.
    #[inline]
    pub(crate) fn free(&mut self, addr: u64, size: u64, tag: T) -> bool {
        self.free_untagged(addr, size)
            .map(|freed| self.join_tag(freed, &tag))
            .is_some()
    }

    /// [`free`](Self::free) with no tag yet: the free block the memory ended up in (after
    /// coalescing), to give its tag with [`join_tag`](Self::join_tag) under the same borrow,
    /// once the free is known to be good (the engine registers the freeing stream only then).
    #[inline]
    pub(crate) fn free_untagged(&mut self, addr: u64, size: u64) -> Option<FreedBlock> {
        let used = self.used_slot(addr, size)?;
        Some(self.free_used(used))
    }

    // ===== the small-block cache =====

    /// The block in use at `addr`, if it is exactly `size` bytes (a free's check, before
    /// [`may_cache`](Self::may_cache) chooses between [`cache`](Self::cache) and
    /// [`free_used`](Self::free_used)).
    #[inline]
    pub(crate) fn used_slot(&self, addr: u64, size: u64) -> Option<UsedBlock> {
        let (position, i) = self.used.position(addr)?;
        let b = &self.blocks[i as usize];
        (b.size == size && b.state == State::Used).then_some(UsedBlock(i, position))
    }

    /// Whether block `used`, freed by `owner`, goes into the small-block cache
    /// ([`cache`](Self::cache)) rather than the free blocks ([`free_used`](Self::free_used)):
    /// if `owner` is its taker's (a block freed by another, as a hand-off between streams does,
    /// would wait there for a request of its freer that may never come) and the cache has room
    /// for it.
    #[inline]
    pub(crate) fn may_cache(&self, used: &UsedBlock, owner: u16) -> bool {
        let b = &self.blocks[used.0 as usize];
        let class = (b.size / ALIGNMENT as u64 - 1) as usize;
        owner != NO_OWNER
            && owner == b.owner
            && self.cache.bytes + b.size <= self.cache.budget
            && self
                .cache
                .lens
                .get(class)
                .is_some_and(|&n| (n as usize) < CACHE_DEPTH)
    }

    /// Frees block `used` into the small-block cache with `tag` (after
    /// [`may_cache`](Self::may_cache) said so).
    #[inline]
    pub(crate) fn cache(&mut self, used: UsedBlock, tag: T) {
        let i = used.0;
        let size = self.blocks[i as usize].size;
        let class = (size / ALIGNMENT as u64 - 1) as usize;
        let len = self.cache.lens[class] as usize;
        debug_assert!(len < CACHE_DEPTH && self.cache.bytes + size <= self.cache.budget);
        self.cache.lists[class][len] = i;
        self.cache.lens[class] += 1;
        self.cache.bytes += size;
        self.cache.blocks += 1;
        self.blocks[i as usize].state = State::Cached;
        self.tags[i as usize] = tag;
    }

    /// Frees block `used` (in use, or cached) into the free blocks, coalesced: the free block it
    /// ended in, whose tag [`join_tag`](Self::join_tag) completes (as
    /// [`free_untagged`](Self::free_untagged), with the block already found).
    #[inline]
    pub(crate) fn free_used(&mut self, used: UsedBlock) -> FreedBlock {
        let UsedBlock(i, position) = used;
        self.used
            .remove_position(position, self.blocks[i as usize].addr);
        self.blocks[i as usize].state = State::Free;
        FreedBlock(self.coalesce_and_file(i))
    }

    /// Cached block `i` (out of the cache's lists already) into the free blocks with its tag,
    /// coalesced.
    fn release_cached(&mut self, i: u32) {
        let found = self.used.position(self.blocks[i as usize].addr);
        debug_assert_eq!(found.map(|f| f.1), Some(i), "a cached block not in the map");
        if let Some((position, _)) = found {
            self.free_used(UsedBlock(i, position));
        }
    }

    /// The block of exactly `size` bytes freed last into the small-block cache among those
    /// whose tag `accept` takes, handed out again to `owner`; `None` if the cache has none of
    /// that size, or none it accepts, in which case the last one freed goes to the free blocks
    /// (so that the caller's search finds it there, and the cache turns over).
    #[inline]
    pub(crate) fn take_cached(
        &mut self,
        size: u64,
        accept: impl Fn(&T) -> bool,
        owner: u16,
    ) -> Option<u64> {
        debug_assert!(size > 0 && size.is_multiple_of(ALIGNMENT as u64));
        let class = (size / ALIGNMENT as u64 - 1) as usize;
        let len = *self.cache.lens.get(class)? as usize;
        if len == 0 {
            return None;
        }
        let list = &mut self.cache.lists[class];
        let found = (0..len)
            .rev()
            .find(|&k| accept(&self.tags[list[k] as usize]));
        self.cache.lens[class] -= 1;
        self.cache.bytes -= size;
        self.cache.blocks -= 1;
        let Some(k) = found else {
            // None it accepts (blocks freed on other streams): the last freed goes to the free
            // blocks, so that a stream that frees what others allocate cannot fill the cache.
            let i = list[len - 1];
            self.release_cached(i);
            return None;
        };
        let i = list[k];
        // The order of the rest does not matter much: the last freed takes the hole.
        list[k] = list[len - 1];
        self.cache.hits += 1;
        self.tags[i as usize] = T::default();
        let b = &mut self.blocks[i as usize];
        b.state = State::Used;
        b.owner = owner;
        Some(b.addr)
    }

    /// Empties the small-block cache into the free blocks (before a growth, a trim, a move of
    /// memory, a snapshot): each block coalesced with its neighbours, with its tag.
    pub(crate) fn uncache_all(&mut self) {
        if self.cache.blocks == 0 {
            return;
        }
        for class in 0..self.cache.lens.len() {
            let len = std::mem::take(&mut self.cache.lens[class]) as usize;
            for k in 0..len {
                let i = self.cache.lists[class][k];
                self.release_cached(i);
            }
        }
        self.cache.bytes = 0;
        self.cache.blocks = 0;
    }

    /// Joins `tag` into the tag of the free block `freed` (from
    /// [`free_untagged`](Self::free_untagged), with nothing changed since).
    #[inline]
    pub(crate) fn join_tag(&mut self, freed: FreedBlock, tag: &T) {
        debug_assert_eq!(self.blocks[freed.0 as usize].state, State::Free);
        self.tags[freed.0 as usize].join(tag);
    }

    /// Gives `[addr, addr + size)`, a hole (memory in no block), to the free blocks with `tag`,
    /// coalescing with free neighbours. False, changing nothing, unless it lies inside one chunk
    /// and overlaps no block. A scan of every block: for growth, trims and their rollbacks.
    pub(crate) fn give_range(&mut self, addr: u64, size: u64, tag: T) -> bool {
        debug_assert!(
            size > 0
                && size.is_multiple_of(ALIGNMENT as u64)
                && addr.is_multiple_of(ALIGNMENT as u64)
        );
        if !self.inside_a_chunk(addr, size) {
            return false;
        }
        let end = addr + size;
        let (mut before, mut after) = (NIL, NIL);
        for i in self.slots() {
            let b = &self.blocks[i as usize];
            if b.addr < end && addr < b.end() {
                return false;
            }
            if b.end() == addr && !self.is_chunk_start(addr) {
                before = i;
            }
            if b.addr == end && !self.is_chunk_start(end) {
                after = i;
            }
        }
        let i = self.new_block((addr, size), (before, after), State::Free, tag);
        self.coalesce_and_file(i);
        true
    }

    // ===== holes =====

    /// The slot of the free block that starts at `addr` (a scan).
    fn free_at(&self, addr: u64) -> Option<u32> {
        self.slots().find(|&i| {
            let b = &self.blocks[i as usize];
            b.state == State::Free && b.addr == addr
        })
    }

    /// Makes free block `i` a hole: out of the index, unlinked from its neighbours.
    fn hollow(&mut self, i: u32) -> T {
        self.unfile(i);
        self.unlink_neighbours(i);
        let tag = std::mem::take(&mut self.tags[i as usize]);
        self.release_slot(i);
        tag
    }

    /// Hands out the first `size` bytes of the free block that starts at `addr`, if there is
    /// one of at least `size` bytes: `(addr, its tag)`. A scan of every block: for a request
    /// served from a chunk just grown (see `StreamHeap::take_fresh`).
    pub(crate) fn take_at(&mut self, addr: u64, size: u64) -> Option<(u64, T)> {
        let i = self.free_at(addr)?;
        if self.blocks[i as usize].size < size {
            return None;
        }
        Some(self.take_from(i, size, NO_OWNER))
    }

    /// Takes out the free block starting at `addr` if it is exactly `size` bytes (a whole
    /// chunk, for trimming), leaving a hole: its tag. Looked for among the free blocks of its
    /// size class, not every slot: the pool at its maximum asks this of every chunk it holds.
    pub(crate) fn take_exact_tagged(&mut self, addr: u64, size: u64) -> Option<T> {
        self.uncache_all();
        let blocks = &self.blocks;
        let i = self
            .index
            .find_exact(blocks, size, |i| blocks[i as usize].addr == addr)?;
        Some(self.hollow(i))
    }

    /// Takes the `granule`-aligned part out of every free block, leaving holes, for unmapping:
    /// `(start, size, the block's tag)`. The unaligned ends stay free.
    pub(crate) fn take_aligned(&mut self, granule: u64) -> Vec<(u64, u64, T)> {
        self.uncache_all();
        let free: Vec<u32> = self
            .slots()
            .filter(|&i| self.blocks[i as usize].state == State::Free)
            .collect();
        let mut out = Vec::new();
        for i in free {
            let (addr, end) = (self.blocks[i as usize].addr, self.blocks[i as usize].end());
            let (lo, hi) = (addr.next_multiple_of(granule), end / granule * granule);
            if lo >= hi {
                continue;
            }
            let Block { before, after, .. } = self.blocks[i as usize];
            let tag = self.hollow(i);
            // The pieces before and after stay free, linked to the neighbours they touch (they
            // cannot merge: the block was coalesced with its neighbours).
            if lo > addr {
                let j = self.new_block((addr, lo - addr), (before, NIL), State::Free, tag.clone());
                self.file(j);
            }
            if end > hi {
                let j = self.new_block((hi, end - hi), (NIL, after), State::Free, tag.clone());
                self.file(j);
            }
            out.push((lo, hi - lo, tag));
        }
        out
    }

    /// The size of the free block that ends at `addr`, or 0 if none does (a scan).
    pub(crate) fn free_ending_at(&self, addr: u64) -> u64 {
        self.slots()
            .map(|i| &self.blocks[i as usize])
            .find(|b| b.state == State::Free && b.end() == addr)
            .map_or(0, |b| b.size)
    }

    /// The size of the free block that starts at `addr`, or 0 if none does (a scan).
    pub(crate) fn free_starting_at(&self, addr: u64) -> u64 {
        self.free_at(addr)
            .map_or(0, |i| self.blocks[i as usize].size)
    }

    // ===== views =====

    /// Every free block `(addr, size)`.
    pub(crate) fn blocks(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.tagged_blocks().map(|(a, s, _)| (a, s))
    }

    /// Every free block with its tag (those of the small-block cache included).
    pub(crate) fn tagged_blocks(&self) -> impl Iterator<Item = (u64, u64, &T)> + '_ {
        (self.blocks.iter().zip(&self.tags))
            .filter(|(b, _)| matches!(b.state, State::Free | State::Cached))
            .map(|(b, tag)| (b.addr, b.size, tag))
    }

    /// Every block in use `(addr, size)` (not those of the small-block cache).
    pub(crate) fn used_blocks(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        (self.used.iter())
            .map(|(_, i)| &self.blocks[i as usize])
            .filter(|b| b.state == State::Used)
            .map(|b| (b.addr, b.size))
    }

    /// Bytes in use.
    pub(crate) fn used_bytes(&self) -> u64 {
        self.used_blocks().map(|b| b.1).sum()
    }

    /// Runs `f` on every free block's tag (those of the small-block cache included).
    pub(crate) fn for_each_tag(&mut self, mut f: impl FnMut(&mut T)) {
        for (b, tag) in self.blocks.iter().zip(&mut self.tags) {
            if matches!(b.state, State::Free | State::Cached) {
                f(tag);
            }
        }
    }

    /// Verifies every invariant; returns the first violation found. Not cheap: tests only.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut total = 0u64;
        let listed = self.index.check(&self.blocks, |i, b| {
            if b.state != State::Free {
                return Err(format!("block {i} is filed by size but not free ({b:?})"));
            }
            total += b.size;
            Ok(())
        })?;
        if listed != self.free_blocks || total != self.free_bytes {
            return Err(format!(
                "{listed} free blocks of {total} bytes filed, counted {} of {}",
                self.free_blocks, self.free_bytes
            ));
        }
        let mut listed_spare = vec![false; self.blocks.len()];
        for &i in &self.spare {
            let slot = listed_spare.get_mut(i as usize);
            if slot.as_deref() != Some(&false) || self.blocks[i as usize].state != State::Spare {
                return Err(format!(
                    "slot {i} listed spare twice, past the slab or in use"
                ));
            }
            if let Some(slot) = slot {
                *slot = true;
            }
        }
        if self.chunks.windows(2).any(|w| w[0].1 > w[1].0) {
            return Err(format!(
                "chunks overlap or are out of order: {:x?}",
                self.chunks
            ));
        }
        let mut spare = 0;
        for (i, b) in self.blocks.iter().enumerate() {
            let i = i as u32;
            if b.state == State::Spare {
                spare += 1;
                continue;
            }
            if b.size == 0
                || !b.size.is_multiple_of(ALIGNMENT as u64)
                || !b.addr.is_multiple_of(ALIGNMENT as u64)
                || !self.inside_a_chunk(b.addr, b.size)
            {
                return Err(format!(
                    "block {i}: empty, misaligned or outside a chunk ({b:?})"
                ));
            }
            if matches!(b.state, State::Used | State::Cached) != (self.used.get(b.addr) == Some(i))
            {
                return Err(format!(
                    "block {i}: the map of blocks in use disagrees ({b:?})"
                ));
            }
            if b.after != NIL {
                let a = &self.blocks[b.after as usize];
                if a.state == State::Spare || a.addr != b.end() || a.before != i {
                    return Err(format!(
                        "block {i}: broken link to what follows ({b:?}, {a:?})"
                    ));
                }
                if b.state == State::Free && a.state == State::Free {
                    return Err(format!("adjacent free blocks not merged: {b:?} and {a:?}"));
                }
            }
            if b.before != NIL {
                let l = &self.blocks[b.before as usize];
                if l.state == State::Spare || l.end() != b.addr || l.after != i {
                    return Err(format!(
                        "block {i}: broken link to what precedes ({b:?}, {l:?})"
                    ));
                }
            }
        }
        self.check_cache()?;
        if spare != self.spare.len()
            || self.used.len() + self.free_blocks + spare != self.blocks.len()
        {
            return Err(format!(
                "{} slots: {} in use, {} free, {spare} spare, {} listed spare",
                self.blocks.len(),
                self.used.len(),
                self.free_blocks,
                self.spare.len()
            ));
        }
        // Touching blocks must be linked (a free block not linked to a free neighbour would
        // never merge with it) and no two blocks may overlap.
        let mut sorted: Vec<(u64, u64, u32)> = self
            .slots()
            .map(|i| {
                (
                    self.blocks[i as usize].addr,
                    self.blocks[i as usize].end(),
                    i,
                )
            })
            .collect();
        sorted.sort_unstable();
        for w in sorted.windows(2) {
            let ((a, a_end, i), (b, _, j)) = (w[0], w[1]);
            if a_end > b {
                return Err(format!("blocks overlap: {i} at {a:x} and {j} at {b:x}"));
            }
            let linked = self.blocks[i as usize].after == j;
            let seam = self.is_chunk_start(b);
            if a_end == b && !seam && !linked {
                return Err(format!(
                    "touching blocks {i} and {j} at {b:x} are not linked"
                ));
            }
            if linked && (a_end != b || seam) {
                return Err(format!(
                    "blocks {i} and {j} linked across a gap or a chunk start"
                ));
            }
        }
        Ok(())
    }

    /// The small-block cache's part of [`check`](Self::check): every block it lists is cached,
    /// once, in its size's list, and the counts agree.
    fn check_cache(&self) -> Result<(), String> {
        let (mut bytes, mut blocks) = (0, 0);
        let mut seen = vec![false; self.blocks.len()];
        for class in 0..self.cache.lens.len() {
            if self.cache.lens[class] as usize > CACHE_DEPTH {
                return Err(format!(
                    "cache class {class} holds {} blocks",
                    self.cache.lens[class]
                ));
            }
            for &i in self.cache.list(class) {
                let b = &self.blocks[i as usize];
                if b.state != State::Cached
                    || (b.size / ALIGNMENT as u64 - 1) as usize != class
                    || std::mem::replace(&mut seen[i as usize], true)
                {
                    return Err(format!("cache class {class}: block {i} misfiled ({b:?})"));
                }
                bytes += b.size;
                blocks += 1;
            }
        }
        let cached = self
            .blocks
            .iter()
            .filter(|b| b.state == State::Cached)
            .count();
        if bytes != self.cache.bytes || blocks != self.cache.blocks || cached != blocks {
            return Err(format!(
                "the cache lists {blocks} blocks of {bytes} bytes, counted {} of {}, {cached} cached",
                self.cache.blocks, self.cache.bytes
            ));
        }
        if bytes > self.cache.budget {
            return Err(format!("the cache holds {bytes} bytes over its budget"));
        }
        Ok(())
    }
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests;
