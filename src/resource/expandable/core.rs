//! The bookkeeping of an expandable pool, generic over its streams and its address range so
//! that the loom model (`loom-tests/expandable.rs`) drives this very code with fake ones.
//!
//! [`Expander`] joins the pool's free-list engine ([`StreamHeap`]) to a reserved address range
//! ([`Backing`]) and a table of which granules are mapped. The range is cut into regions, one
//! per shard of the engine, each one chunk of it, so free blocks coalesce across every growth
//! in a region. It grows the engine ([`Grow`]) by mapping granules where the memory coalesces
//! with the requester's free blocks (at the maximum, first unmapping wholly free granules
//! elsewhere whose last users have finished: [`make_room`](Expander::make_room)), and it takes
//! fully free granules out of the lists for unmapping ([`hold_free`](Expander::hold_free)),
//! orders each onto one of its streams with every lock let go
//! ([`order_held`](Expander::order_held)), unmaps them once the caller has waited for those
//! streams ([`unmap_ranges`](Expander::unmap_ranges)), or puts them back.
//!
//! Lock order: the engine's growth lock (`slow`: growth and claims run under it, and a trim
//! takes its ranges out of the lists under it), then the list of what trims hold
//! (`held_for_trim.rs`: a trim takes into it, a request at the maximum recalls from it), then
//! the table, then a list (growth reads the requester's list, and takes idle free granules out
//! of the lists, while it holds the table); nothing takes the table while it holds a list's
//! lock, nor the growth lock while it holds either.

use super::super::stream_ordered::{
    EngineStats, EngineStream, Grow, HostWait, ListBlocks, StreamHeap,
};
use crate::error::{Error, Result};
use crate::resource::held_for_trim::{HeldForTrim, HeldOrder, Ticket};
use crate::sync::{AtomicU64, Mutex, Ordering};
// The planted bug's switch, read through `planted!` (it exists only under the loom cfg).
#[cfg(streamalloc_loom)]
use super::super::stream_ordered::planted;

/// A reserved address range that granules of physical memory can be mapped into.
pub(crate) trait Backing: Send + Sync {
    /// The first address.
    fn base(&self) -> u64;
    /// The unit of mapping, in bytes (a multiple of 256).
    fn granule(&self) -> u64;
    /// How many granules the range has.
    fn granules(&self) -> usize;
    /// Maps granules `first..first + count` (unmapped now): all, or none and an error.
    fn map(&self, first: usize, count: usize) -> Result<()>;
    /// Unmaps granule `index` and releases its memory.
    ///
    /// A panic out of it (the simulated device's race detector in its `Panic` mode, which
    /// reports work still using the granule) comes once the granule is unmapped: the caller
    /// counts it unmapped, and lets the panic go on once its bookkeeping is done.
    ///
    /// # Safety
    /// No queued or running work uses it.
    unsafe fn unmap(&self, index: usize) -> Result<()>;
}

impl Backing for crate::device::vmm::Reservation {
    fn base(&self) -> u64 {
        crate::device::vmm::Reservation::base(self)
    }
    fn granule(&self) -> u64 {
        crate::device::vmm::Reservation::granule(self) as u64
    }
    fn granules(&self) -> usize {
        self.size() / crate::device::vmm::Reservation::granule(self)
    }
    fn map(&self, first: usize, count: usize) -> Result<()> {
        crate::device::vmm::Reservation::map(self, first, count)
    }
    unsafe fn unmap(&self, index: usize) -> Result<()> {
        // The simulated device unmaps the unit before its race detector settles what it found
        // (and panics in the `Panic` mode): the trait's word on a panic holds.
        // SAFETY: the caller's contract, passed on.
        unsafe { crate::device::vmm::Reservation::unmap(self, index) }
    }
}

/// Which granules are mapped, a bit each: changed only under the table's lock (by growth and
/// trim), read without it by `deallocate`'s check of a pointer (`is_mapped`).
struct Bits(Vec<AtomicU64>);

impl Bits {
    fn new(len: usize) -> Self {
        Self((0..len.div_ceil(64)).map(|_| AtomicU64::new(0)).collect())
    }

    fn get(&self, index: usize) -> bool {
        self.0[index / 64].load(Ordering::Relaxed) & (1 << (index % 64)) != 0
    }

    /// The highest set bit in `start..end`, a word at a time.
    fn last_set(&self, start: usize, end: usize) -> Option<usize> {
        let mut i = end;
        while i > start {
            let word = (i - 1) / 64;
            let low = (word * 64).max(start);
            // The bits of this word in `low..i`.
            let width = i - low;
            let shift = low % 64;
            let mask = if width == 64 {
                u64::MAX
            } else {
                ((1u64 << width) - 1) << shift
            };
            let bits = self.0[word].load(Ordering::Relaxed) & mask;
            if bits != 0 {
                return Some(word * 64 + 63 - bits.leading_zeros() as usize);
            }
            i = low;
        }
        None
    }
}

/// The mapping state that growth and trim change, under one lock.
struct Table {
    /// How many granules each region has: region `r` is granules `r * per..(r + 1) * per`,
    /// one chunk of the engine, in shard `r`.
    per: usize,
    /// Per region, one past its highest mapped granule (its first granule if none is).
    frontiers: Vec<usize>,
    /// Mapped pieces of the initial size that belong to no shard yet, `(first granule,
    /// count)`: a thread claims one when its home shard cannot serve a request
    /// ([`Expander::claim_piece`]), one in its own region as it is, another region's moved
    /// into its own. So one thread's memory ends up in one range, where it coalesces, and
    /// threads take their shares as they need them (as the pool's reserve:
    /// `stream_ordered`'s `reserve`).
    unclaimed: Vec<(usize, usize)>,
}

impl Table {
    /// Marks granule `index` mapped or not (the caller holds the table's lock).
    fn set(&mut self, bits: &Bits, index: usize, mapped: bool) {
        let bit = 1 << (index % 64);
        if mapped {
            bits.0[index / 64].fetch_or(bit, Ordering::Relaxed);
        } else {
            bits.0[index / 64].fetch_and(!bit, Ordering::Relaxed);
        }
    }

    /// The granules of region `r`.
    fn region(&self, r: usize) -> std::ops::Range<usize> {
        r * self.per..(r + 1) * self.per
    }

    fn region_of(&self, index: usize) -> usize {
        index / self.per
    }

    /// Granules of the unclaimed pieces.
    fn unclaimed_granules(&self) -> usize {
        self.unclaimed.iter().map(|p| p.1).sum()
    }

    /// The runs of unmapped granules of region `r` below its frontier (holes a trim left),
    /// lowest first.
    fn holes<'a>(
        &self,
        bits: &'a Bits,
        r: usize,
    ) -> impl Iterator<Item = std::ops::Range<usize>> + 'a {
        let (mut i, frontier) = (self.region(r).start, self.frontiers[r]);
        std::iter::from_fn(move || {
            while i < frontier && bits.get(i) {
                i += 1;
            }
            let start = i;
            while i < frontier && !bits.get(i) {
                i += 1;
            }
            (start < i).then_some(start..i)
        })
    }

    /// Every region's frontier again, from the bits (after granules were unmapped: a
    /// frontier only moves down, so each region is scanned below its old one).
    fn recompute_frontiers(&mut self, bits: &Bits) {
        for r in 0..self.frontiers.len() {
            let start = self.region(r).start;
            self.frontiers[r] = bits
                .last_set(start, self.frontiers[r])
                .map_or(start, |i| i + 1);
        }
    }
}

/// The least initial memory per region for the initial size to be spread over the regions
/// (smaller initial sizes stay in one: a request larger than a share would make the pool
/// grow), as the pool's initial chunks (`pool::SPLIT_MIN`).
const SPLIT_MIN: u64 = 32 << 20;

/// The largest piece of the initial size that a claim moves into another range, in
/// [`SPLIT_MIN`]s (the initial sizes up to 512 MiB over 8 ranges); see
/// [`claim_piece`](Expander::claim_piece).
const MOVE_MAX_SHARES: u64 = 2;

/// What [`Expander::snapshot_parts`] reads: the mapped runs, the lists' free blocks and the
/// unclaimed pieces.
pub(crate) type SnapshotParts = (Vec<(u64, u64)>, Vec<ListBlocks>, Vec<(u64, u64)>);

/// A range taken out of the lists for unmapping: `(start, size, the stream whose list held
/// it)`, `None` for fresh memory.
pub(crate) type Taken<S> = (u64, u64, Option<S>);

/// A range a trim holds (`held_for_trim`): `(start, size, how it stands with the streams that
/// last used it)`; once ordered, a [`Taken`].
pub(crate) type HeldRange<S> = (u64, u64, HeldOrder<S>);

/// The payload of a panic out of [`Backing::unmap`], caught until the bookkeeping of what was
/// unmapped is done, then let go on (`std::panic::resume_unwind`).
type Panicked = Option<Box<dyn std::any::Any + Send>>;

/// When the release threshold's automatic release runs: the bytes freed since the last one
/// began, and whether one is queued or running ([`PENDING`](Self::PENDING)), in one word. A
/// free that finds a release pending queues none; the release, when it ends, looks at what was
/// freed meanwhile and goes again if it must ([`ended`](Self::ended)). In one word so that the
/// two never miss each other: a free's count lands before the end's look (which then sees it)
/// or after it (and then finds no release pending, and queues one itself).
pub(crate) struct ReleaseTrigger {
    state: AtomicU64,
    /// The bytes that must have been freed since the last release began for another.
    granule: u64,
}

impl ReleaseTrigger {
    /// The bit of a release queued or running; the bits below count bytes.
    const PENDING: u64 = 1 << 63;

    pub(crate) fn new(granule: u64) -> Self {
        Self {
            state: AtomicU64::new(0),
            granule,
        }
    }

    /// Counts `bytes` freed. Whether the caller must queue a release now: none is pending, a
    /// granule's worth was freed since the last began, and `above` says that more than the
    /// threshold is mapped. From then on one is pending, its count from 0, until it
    /// [`ended`](Self::ended).
    pub(crate) fn freed(&self, bytes: u64, above: impl Fn() -> bool) -> bool {
        // Saturating below the bit: a pool that never maps more than its threshold counts
        // every free, and the count must never reach the bit.
        let add = |state: u64| {
            let count = (state & !Self::PENDING).saturating_add(bytes);
            (state & Self::PENDING) | count.min(!Self::PENDING)
        };
        let was = self
            .state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |state| {
                Some(add(state))
            });
        let mut now = add(was.unwrap_or_else(|state| state));
        loop {
            if now & Self::PENDING != 0 || now < self.granule || !above() {
                return false;
            }
            match (self.state).compare_exchange(
                now,
                Self::PENDING,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(state) => now = state,
            }
        }
    }

    /// The pending release has ended. Whether the caller must queue another at once: a
    /// granule's worth was freed while it ran (those frees found it pending and queued
    /// nothing), and `above` says that more than the threshold is still mapped. Otherwise none
    /// is pending from now on, and the next free looks.
    pub(crate) fn ended(&self, above: impl Fn() -> bool) -> bool {
        if planted!(RELEASE_END_ONLY_CLEARS) {
            // The planted bug: the bytes freed meanwhile are never looked at.
            self.state.fetch_and(!Self::PENDING, Ordering::AcqRel);
            return false;
        }
        let mut now = self.state.load(Ordering::Acquire);
        loop {
            debug_assert!(
                now & Self::PENDING != 0,
                "a release ended that was not pending"
            );
            let again = now & !Self::PENDING >= self.granule && above();
            let next = if again {
                Self::PENDING
            } else {
                now & !Self::PENDING
            };
            // A free since the load changed the word: look again, its bytes counted.
            match (self.state).compare_exchange(now, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return again,
                Err(state) => now = state,
            }
        }
    }
}

/// An expandable pool's lists, address range and mapping table.
pub(crate) struct Expander<S: EngineStream, B: Backing> {
    pub(crate) heap: StreamHeap<S>,
    pub(crate) backing: B,
    table: Mutex<Table>,
    bits: Bits,
    /// Bytes mapped (written under the table's lock; read without it for statistics).
    reserved: AtomicU64,
    peak_reserved: AtomicU64,
    grows: AtomicU64,
    /// Nanoseconds spent mapping granules for growth.
    growth_nanos: AtomicU64,
    /// Streams whose free memory a move at the maximum could not take, their work still
    /// running: the resource waits for them off the caller's thread and wakes its memory
    /// waiters ([`take_busy`](Self::take_busy)).
    busy: Mutex<Vec<S>>,
    /// Uids of the streams handed out by [`take_busy`](Self::take_busy) whose job has not
    /// started yet ([`settle_started`](Self::settle_started)): at most one job is queued per
    /// stream. Without it every refused request queued one (a storm of refusals, a storm of
    /// jobs on the device's blocking-work thread, each waiting for the same stream).
    settling: Mutex<Vec<u64>>,
    /// Growths at the maximum that unmapped idle free granules elsewhere to map where they
    /// grow ([`make_room`](Self::make_room)), counted once mapped.
    relocations: AtomicU64,
    /// The most that may be mapped at once, in bytes (a multiple of the granule).
    maximum: u64,
    /// The least initial size per region for `map_initial` to spread it ([`SPLIT_MIN`]; the
    /// loom models use granules of a few bytes).
    split_min: u64,
    /// Bytes of the unclaimed pieces (written under the table's lock, from its list): read
    /// without it, as the engine's hint that there is memory to claim
    /// ([`Grow::has_unclaimed`]); statistics and snapshots read the list. Std's, not
    /// `crate::sync`'s: only a hint (claims look again under the lock), and a loom atomic
    /// would add scheduling points to every request of the models.
    unclaimed_bytes: std::sync::atomic::AtomicU64,
    /// Pieces claimed from another region (moved: unmapped there, mapped in the claimer's).
    moves: AtomicU64,
    /// Ranges that trims took out of the lists ([`hold_free`](Self::hold_free)) and hold while
    /// they wait for their streams: a request at the maximum takes them back
    /// ([`Grow::recall_trimmed`]).
    held_for_trim: HeldForTrim<HeldRange<S>>,
    /// Bytes that trims took out of the lists ([`hold_free`](Self::hold_free)) and that are
    /// neither unmapped nor back in the lists yet: held, or released and being unmapped. They
    /// still count in `reserved`, but will not stay mapped, so a trim beside them takes only
    /// what goes past `keep` without them (two trims down to `keep` together unmapped below
    /// it: each took `reserved - keep`). Added under the growth lock, taken off as they leave
    /// (the unmapped ones under the table's lock, with `reserved`; the ones put back after
    /// they are back): a trim reading both under the table's lock never counts a byte as
    /// going twice, at worst as staying once.
    trimming: AtomicU64,
}

impl<S: EngineStream, B: Backing> Expander<S, B> {
    /// The lists over `backing`'s whole range (one chunk, one shard), nothing mapped yet.
    #[cfg(all(streamalloc_loom, test))]
    pub(crate) fn new(backing: B, maximum: u64) -> Self {
        Self::with_regions(backing, maximum, 1)
    }

    /// The lists over `backing`'s range cut into `regions` equal regions (a power of two that
    /// divides its granules), each one chunk in a shard of its own, so that threads whose
    /// requests go to different shards take different locks and grow in different regions.
    /// Blocks coalesce within a region, across every growth there.
    pub(crate) fn with_regions(backing: B, maximum: u64, regions: usize) -> Self {
        let granules = backing.granules();
        let regions = regions.max(1);
        debug_assert!(regions.is_power_of_two() && granules.is_multiple_of(regions));
        let per = granules / regions;
        let heap = StreamHeap::with_options(0.0, regions);
        let g = backing.granule();
        // Free granules are found by address (`take_aligned` cuts free blocks at multiples of
        // the granule): the range must start at one.
        debug_assert!(
            backing.base().is_multiple_of(g),
            "the range does not start at a granule"
        );
        for r in 0..regions {
            heap.add_chunk_in(r, backing.base() + (r * per) as u64 * g, per as u64 * g);
        }
        Self {
            heap,
            table: Mutex::new(Table {
                per,
                frontiers: (0..regions).map(|r| r * per).collect(),
                unclaimed: Vec::new(),
            }),
            bits: Bits::new(granules),
            backing,
            reserved: AtomicU64::new(0),
            peak_reserved: AtomicU64::new(0),
            grows: AtomicU64::new(0),
            growth_nanos: AtomicU64::new(0),
            relocations: AtomicU64::new(0),
            busy: Mutex::new(Vec::new()),
            settling: Mutex::new(Vec::new()),
            maximum,
            split_min: SPLIT_MIN,
            unclaimed_bytes: std::sync::atomic::AtomicU64::new(0),
            moves: AtomicU64::new(0),
            held_for_trim: HeldForTrim::new(),
            trimming: AtomicU64::new(0),
        }
    }

    /// The same, spreading initial sizes from `bytes` per region (for the loom models).
    #[cfg(all(streamalloc_loom, test))]
    pub(crate) fn with_split_min(mut self, bytes: u64) -> Self {
        self.split_min = bytes;
        self
    }

    fn addr(&self, index: usize) -> u64 {
        self.backing.base() + index as u64 * self.backing.granule()
    }

    pub(crate) fn granule(&self) -> u64 {
        self.backing.granule()
    }

    pub(crate) fn maximum(&self) -> u64 {
        self.maximum
    }

    /// Bytes mapped now.
    pub(crate) fn reserved(&self) -> u64 {
        self.reserved.load(Ordering::Relaxed)
    }

    pub(crate) fn peak_reserved(&self) -> u64 {
        self.peak_reserved.load(Ordering::Relaxed)
    }

    pub(crate) fn grows(&self) -> u64 {
        self.grows.load(Ordering::Relaxed)
    }

    /// Time spent mapping granules for growth.
    pub(crate) fn growth_time(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.growth_nanos.load(Ordering::Relaxed))
    }

    /// The streams noted busy by refused moves since the last call (each once), less those
    /// already in a job that has not started: the caller queues a job for them, which calls
    /// [`settle_started`](Self::settle_started) first.
    pub(crate) fn take_busy(&self) -> Vec<S> {
        let busy = std::mem::take(&mut *self.busy.lock());
        if busy.is_empty() {
            return busy;
        }
        let (fresh, queued): (Vec<S>, Vec<S>) = {
            let mut settling = self.settling.lock();
            busy.into_iter().partition(|stream| {
                let uid = stream.uid();
                let fresh = !settling.contains(&uid);
                if fresh {
                    settling.push(uid);
                }
                fresh
            })
        };
        // Handles of streams already queued go after the lock: a stream's drop takes locks of
        // its own.
        drop(queued);
        fresh
    }

    /// The job for `streams` (from [`take_busy`](Self::take_busy)) has started: a refusal from
    /// now on queues another (it may have seen frees this job's bumps do not cover), and each
    /// stream's epochs are bumped before the job waits for it on the host
    /// ([`StreamHeap::bump_for_host_wait`]), for
    /// [`StreamHeap::note_host_waited`] once each wait has succeeded: a move then takes what
    /// the stream freed before, with no question, though the stream has new work by then.
    pub(crate) fn settle_started(&self, streams: &[S]) -> Vec<HostWait> {
        {
            let mut settling = self.settling.lock();
            settling.retain(|uid| !streams.iter().any(|s| s.uid() == *uid));
        }
        streams
            .iter()
            .map(|stream| self.heap.bump_for_host_wait(stream))
            .collect()
    }

    /// Growths that first moved free memory (see `make_room`).
    pub(crate) fn relocations(&self) -> u64 {
        self.relocations.load(Ordering::Relaxed)
    }

    /// Granules mapped now.
    pub(crate) fn mapped_granules(&self) -> usize {
        (self.reserved() / self.granule()) as usize
    }

    /// What a snapshot shows, read under the table's lock at once (a claim moves a piece
    /// under it, so no piece shows in two places or none): the mapped ranges `(start, size)`
    /// in address order (runs of mapped granules), every list's free blocks, and the unclaimed
    /// pieces `(start, size)`.
    pub(crate) fn snapshot_parts(&self) -> SnapshotParts {
        let table = self.table.lock();
        let g = self.granule();
        let runs = self.mapped_runs(&table);
        let lists = self.heap.free_blocks_by_list();
        let unclaimed = (table.unclaimed.iter())
            .map(|&(first, count)| (self.addr(first), count as u64 * g))
            .collect();
        (runs, lists, unclaimed)
    }

    /// The mapped ranges `(start, size)`, in address order: runs of mapped granules.
    fn mapped_runs(&self, table: &Table) -> Vec<(u64, u64)> {
        let g = self.granule();
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mapped = (0..table.frontiers.len())
            .flat_map(|r| table.region(r).start..table.frontiers[r])
            .filter(|&i| self.bits.get(i));
        for index in mapped {
            match runs.last_mut() {
                Some((start, size)) if *start + *size == self.addr(index) => *size += g,
                _ => runs.push((self.addr(index), g)),
            }
        }
        runs
    }

    /// Whether every granule of `[addr, addr + size)` lies in the range and is mapped: a
    /// pointer the pool may have handed out (a few relaxed loads, for `deallocate`).
    pub(crate) fn is_mapped(&self, addr: u64, size: u64) -> bool {
        let (base, g) = (self.backing.base(), self.granule());
        let Some(end) = addr.checked_add(size) else {
            return false;
        };
        if addr < base || size == 0 || end > base + self.backing.granules() as u64 * g {
            return false;
        }
        // On every free: a shift where the granule is a power of two (the driver's always is),
        // not two divisions.
        let index = |offset: u64| {
            if g.is_power_of_two() {
                (offset >> g.trailing_zeros()) as usize
            } else {
                (offset / g) as usize
            }
        };
        let (first, last) = (index(addr - base), index(end - 1 - base));
        (first..=last).all(|i| self.bits.get(i))
    }

    /// Maps `bytes` (rounded up to a granule) as fresh memory: the initial size, in pieces
    /// that belong to no shard until a thread claims one
    /// ([`claim_piece`](Self::claim_piece)). From [`SPLIT_MIN`] per region up, it is spread evenly over the regions, each piece at the
    /// start of its region, so that threads on different shards each find one at home (all of
    /// it in the first region kept every thread of a `churn-4t` run started at 2 GiB on one
    /// shard: 1,016 to 1,102 ns/op on an H200, run33); less is one piece in the first region.
    /// Until claimed, the pieces count as free (`free_bytes`, statistics, snapshots) and a
    /// trim releases them first.
    pub(crate) fn map_initial(&self, bytes: u64) -> Result<()> {
        let g = self.granule();
        let mut table = self.table.lock();
        let regions = table.frontiers.len();
        // The initial size in granules, dealt out: the first `total % pieces` regions get one
        // more, so that exactly the initial size (rounded up to a granule) is mapped.
        let total = bytes.div_ceil(g) as usize;
        let pieces = if bytes >= regions as u64 * self.split_min {
            regions
        } else {
            1
        };
        let share = |r: usize| total / pieces + usize::from(r < total % pieces);
        let mut result = Ok(());
        for r in (0..pieces).filter(|&r| share(r) > 0) {
            let first = table.region(r).start;
            // What was mapped before an error is the pool's memory all the same.
            match self.map_locked(&mut table, first, share(r), bytes) {
                Ok(_) => table.unclaimed.push((first, share(r))),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.note_unclaimed(&table);
        result
    }

    /// Gives every unclaimed piece to its own range's shard, as if a thread of each range had
    /// claimed it (for the loom models, whose threads all share one home shard).
    #[cfg(all(streamalloc_loom, test))]
    pub(crate) fn claim_all_in_place(&self) {
        self.give_all_in_place(&mut self.table.lock());
    }

    /// Gives every unclaimed piece to its own range's shard, as fresh memory.
    fn give_all_in_place(&self, table: &mut Table) {
        for (first, count) in std::mem::take(&mut table.unclaimed) {
            self.heap
                .give_fresh(self.addr(first), count as u64 * self.granule());
        }
        self.note_unclaimed(table);
    }

    /// Sets the hint of [`unclaimed_bytes`](Self::unclaimed_bytes) from `table`'s list.
    fn note_unclaimed(&self, table: &Table) {
        self.unclaimed_bytes.store(
            table.unclaimed_granules() as u64 * self.granule(),
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Bytes mapped that belong to no shard yet (the initial size's pieces not claimed).
    pub(crate) fn unclaimed_bytes(&self) -> u64 {
        self.unclaimed_bytes
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The engine's statistics, with the unclaimed pieces counted as free blocks: read under
    /// the table's lock (a claim moves a piece into a list under it, so no piece is counted
    /// twice or not at all).
    pub(crate) fn stats(&self) -> EngineStats {
        let table = self.table.lock();
        let mut stats = self.heap.stats();
        stats.free_bytes += table.unclaimed_granules() as u64 * self.granule();
        stats.free_blocks += table.unclaimed.len();
        stats
    }

    /// Pieces claimed from another region than the claimer's (moved between ranges).
    pub(crate) fn claim_moves(&self) -> u64 {
        self.moves.load(Ordering::Relaxed)
    }

    /// [`Grow::claim`]: gives an unclaimed piece to the requesting thread's home shard, as
    /// fresh memory: its own region's piece as it is; else another region's (the highest:
    /// threads are spread over the shards from the first, so the last ranges' pieces are the
    /// least likely to be claimed by a thread of their own), moved if it is at most
    /// [`MOVE_MAX_SHARES`] least shares: unmapped there (it was never used) and as many units
    /// mapped at the lowest place in the home range with room for them (its first hole that
    /// large, else its frontier, where it coalesces with the free block that ends there). A
    /// larger piece, and every piece left with it, goes to its own range's shard instead (the
    /// request then takes from it as from any other shard; no piece is unclaimed afterwards);
    /// so does a piece the home range has no room for. Under the table's lock throughout, so
    /// that a trim never finds the piece in neither place. Unmapping first keeps the pool
    /// within its maximum and its peak; if the map then fails (the device out of memory:
    /// another process took it meanwhile), the piece's memory has gone back to the device and
    /// the pool holds that much less: the request claims the next piece, or goes on to the
    /// other shards and growth, whose error it gets.
    fn claim_piece(&self, min: u64) -> bool {
        let mut table = self.table.lock();
        let regions = table.frontiers.len();
        let home = self.heap.home_shard() % regions;
        let pieces = table.unclaimed.iter().enumerate();
        let at = (pieces.clone())
            .find(|&(_, &(first, _))| table.region_of(first) == home)
            .or_else(|| pieces.max_by_key(|&(_, &(first, _))| first))
            .map(|(at, _)| at);
        let Some(at) = at else {
            self.note_unclaimed(&table);
            return false;
        };
        let (first, count) = table.unclaimed.swap_remove(at);
        let g = self.granule();
        if table.region_of(first) == home {
            self.note_unclaimed(&table);
            self.heap.give_fresh(self.addr(first), count as u64 * g);
            return true;
        }
        // Large pieces stay where they are: a move costs an unmap and a map per unit (about
        // 75 µs an 8 MiB unit on an H100), and buys memory only where the pool grows past its
        // initial size, which a large one seldom does. Started at 2 GiB (pieces of 256 MiB),
        // one thread that moved what it needed ran `churn-1t` in 105 ns/op against 99 for the
        // same thread taking the pieces where they lay, at the same peak (run42). So every
        // piece left goes to its own range's shard, where the request finds it among the
        // other shards' memory.
        if count as u64 * g > MOVE_MAX_SHARES * self.split_min {
            table.unclaimed.push((first, count));
            self.give_all_in_place(&mut table);
            return true;
        }
        self.note_unclaimed(&table);
        let (addr, size) = (self.addr(first), count as u64 * g);
        let Some(to) = self.room_for(&table, home, count) else {
            self.heap.give_fresh(addr, size);
            return true;
        };
        let _span = tracing::debug_span!("claim from another range", addr, size, home).entered();
        // SAFETY: the piece was in no list (nothing was ever handed out of it) and is in none
        // now: no work has used it or can.
        let (released, result, back, panicked) =
            unsafe { self.unmap_locked(&mut table, vec![(addr, size, None)]) };
        for (addr, size, _) in back {
            // Units that would not unmap stay mapped, as fresh memory of their own range.
            self.heap.give_fresh(addr, size);
        }
        if let Some(payload) = panicked {
            // What was unmapped is noted and the rest is back: the pool holds that much less,
            // as after a failed map below.
            drop(table);
            std::panic::resume_unwind(payload);
        }
        if let Err(e) = result {
            tracing::warn!(error = %e, released, "a claimed piece could not move: it stays");
        }
        // As many units as were unmapped: the pool keeps its initial size, and never passes its
        // peak for the move.
        let granules = (released / g) as usize;
        if granules == 0 {
            return true;
        }
        match self.map_timed(&mut table, to, granules, min) {
            Ok((addr, size)) => {
                self.moves.fetch_add(1, Ordering::Relaxed);
                self.heap.give_fresh(addr, size);
            }
            Err(e) => tracing::warn!(error = %e, size, "a claimed piece could not be mapped again"),
        }
        true
    }

    /// The first granule of the lowest run of `count` unmapped granules in region `r`: a hole
    /// (granules unmapped by a trim) below its frontier, else the frontier, if the region has
    /// room.
    fn room_for(&self, table: &Table, r: usize, count: usize) -> Option<usize> {
        let (region, frontier) = (table.region(r), table.frontiers[r]);
        (table.holes(&self.bits, r))
            .find(|hole| hole.len() >= count)
            .map(|hole| hole.start)
            .or((frontier + count <= region.end).then_some(frontier))
    }

    /// [`map_locked`](Self::map_locked), its time counted as growth's
    /// ([`growth_time`](Self::growth_time)).
    fn map_timed(
        &self,
        table: &mut Table,
        first: usize,
        count: usize,
        requested: u64,
    ) -> Result<(u64, u64)> {
        let started = std::time::Instant::now();
        let mapped = self.map_locked(table, first, count, requested);
        let nanos = started.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64;
        self.growth_nanos.fetch_add(nanos, Ordering::Relaxed);
        mapped
    }

    /// Maps `first..first + count` under the table's lock, within the maximum.
    fn map_locked(
        &self,
        table: &mut Table,
        first: usize,
        count: usize,
        requested: u64,
    ) -> Result<(u64, u64)> {
        let size = count as u64 * self.granule();
        let reserved = self.reserved();
        if reserved + size > self.maximum {
            return Err(self.out_of_memory(requested));
        }
        (self.backing.map(first, count)).map_err(|e| self.device_out_of_memory(requested, e))?;
        for index in first..first + count {
            table.set(&self.bits, index, true);
        }
        let r = table.region_of(first);
        table.frontiers[r] = table.frontiers[r].max(first + count);
        let now = reserved + size;
        self.reserved.store(now, Ordering::Relaxed);
        self.peak_reserved.fetch_max(now, Ordering::Relaxed);
        Ok((self.addr(first), size))
    }

    /// The error of a request of `requested` bytes that cannot be served: `available` is the
    /// largest request that could have been (the largest free block, or the room left under
    /// the maximum).
    pub(crate) fn out_of_memory(&self, requested: u64) -> Error {
        let room = self.maximum.saturating_sub(self.reserved());
        Error::OutOfMemory {
            requested: requested as usize,
            available: room.max(self.heap.largest_free_block()) as usize,
            maximum: self.maximum as usize,
        }
    }

    /// The error of a request of `requested` bytes whose mapping the device refused with
    /// `device`: its out-of-memory in the request's numbers, as [`out_of_memory`]'s (and the
    /// pool's over an upstream that runs out), bounded by the device's; any other error as it
    /// is. The device's own numbers are the mapping's: `requested` only what the growth lacked
    /// beyond the free block it extends, with the device's memory as the maximum, so a request
    /// larger than the device (within a reservation, and so a maximum, larger than it) looked
    /// curable, and `allocate_async` waited for ever (a review's finding:
    /// `tests/expandable_review2.rs`).
    ///
    /// [`out_of_memory`]: Self::out_of_memory
    fn device_out_of_memory(&self, requested: u64, device: Error) -> Error {
        let Error::OutOfMemory {
            available, maximum, ..
        } = device
        else {
            return device;
        };
        // The device's numbers in whole units, the most it could ever map for us: a device
        // whose memory is not a whole number of units (or is smaller than one) cannot map the
        // last part, and a request that needs it, reported against the bytes, looked curable
        // (a review's finding: 100 MiB asked of a 100 MiB device in 8 MiB units waited).
        let g = self.granule();
        let (available, maximum) = (available as u64 / g * g, maximum as u64 / g * g);
        let room = (self.maximum.saturating_sub(self.reserved())).min(available);
        Error::OutOfMemory {
            requested: requested as usize,
            available: room.max(self.heap.largest_free_block()) as usize,
            maximum: self.maximum.min(maximum) as usize,
        }
    }

    /// Where to map for a request of `min` bytes: `(first granule, count)`. In the region of
    /// the requesting thread's shard first, then in the others in turn: the lowest hole
    /// (granules unmapped by a trim) that, with the free blocks on either side, holds the
    /// request; else the region's frontier, counting the free block that ends there. Only as
    /// many granules as the request needs beyond those free blocks.
    fn place(&self, table: &Table, min: u64) -> Option<(usize, usize)> {
        let regions = table.frontiers.len();
        let home = self.heap.home_shard() % regions;
        (0..regions).find_map(|k| self.place_in(table, (home + k) % regions, min))
    }

    /// [`place`](Self::place) in region `r`.
    fn place_in(&self, table: &Table, r: usize, min: u64) -> Option<(usize, usize)> {
        let g = self.granule();
        let needed = |have: u64| (min.saturating_sub(have).div_ceil(g) as usize).max(1);
        let (region, frontier) = (table.region(r), table.frontiers[r]);
        for hole in table.holes(&self.bits, r) {
            let run = hole.len();
            let (left, right) =
                (self.heap).free_around(r, self.addr(hole.start), self.addr(hole.end));
            let count = needed(left);
            if count <= run {
                return Some((hole.start, count));
            }
            if left + run as u64 * g + right >= min {
                return Some((hole.start, run));
            }
        }
        let (left, _) = self.heap.free_around(r, self.addr(frontier), u64::MAX);
        let count = needed(left);
        (frontier + count <= region.end).then_some((frontier, count))
    }

    /// Takes fully free granules out of the lists for a trim, as many as it takes for at most
    /// `keep` bytes to stay mapped (the unclaimed pieces first, then the highest addresses of
    /// the lists); nothing else leaves the lists. What it takes is held for the trim: a request
    /// at the maximum may take it back ([`Grow::recall_trimmed`]). Returns the trim's ticket and
    /// a copy of what it took, each range with its tag: the caller orders those onto one stream
    /// each ([`order_held`](Self::order_held)), waits for those streams (all their work), then
    /// unmaps what is still its own ([`release_held`](Self::release_held),
    /// [`unmap_ranges`](Self::unmap_ranges)), or puts that back
    /// ([`put_back_held`](Self::put_back_held)) if it cannot.
    ///
    /// Under the engine's growth lock (`slow`): a request that misses while ranges are out of
    /// the lists here waits for it before its last look and its growth, and finds the lists as
    /// this leaves them, or what it took held, instead of growing, or failing at the maximum,
    /// for want of memory that stays. Only this part, which makes no driver call: the ordering
    /// and the waits for the streams come after it, with no lock held.
    pub(crate) fn hold_free(&self, keep: u64) -> (Ticket, Vec<HeldRange<S>>) {
        // Lock order: the growth lock, then the held list's (a recall holds the growth lock).
        let _growth = self.heap.growth_lock();
        self.held_for_trim.hold(|| self.take_free(keep))
    }

    /// Orders each range of `ranges` (what [`hold_free`](Self::hold_free) handed the trim of
    /// `ticket`) still tagged onto one stream of its tag (events recorded on the others, a
    /// wait on it: driver calls, made with no lock of the pool held, for every request at the
    /// maximum and every growth takes the locks `hold_free` held), and notes it as ordered
    /// ([`HeldForTrim::replace`]) if the trim still holds it. Returns the streams to wait for
    /// before unmapping (once each), and whether ranges went back to the lists (their
    /// ordering failed: a stream under a user's graph capture, a failed driver call), for the
    /// caller to tell the memory waiters.
    ///
    /// A range recalled meanwhile by a request at the maximum went back with its tag, as it
    /// was taken: its ordering here is then only one GPU-side wait more, and it is no longer
    /// the trim's to note, to wait for or to unmap. The caller puts back what the trim holds
    /// if this unwinds (its guard's drop): a range still tagged goes back as it was.
    pub(crate) fn order_held(&self, ticket: Ticket, ranges: Vec<HeldRange<S>>) -> (Vec<S>, bool) {
        let mut streams: Vec<S> = Vec::new();
        let mut wait_for = |stream: S| {
            if !streams.iter().any(|s| s.uid() == stream.uid()) {
                streams.push(stream);
            }
        };
        let mut went_back = false;
        for (addr, size, order) in ranges {
            let tag = match order {
                HeldOrder::Tagged(tag) => tag,
                // Fresh (an unclaimed piece): nothing to wait for.
                HeldOrder::On(None) => continue,
                HeldOrder::On(Some(stream)) => {
                    wait_for(stream);
                    continue;
                }
            };
            let is = |r: &HeldRange<S>| r.0 == addr;
            match self.heap.order_taken(addr, size, &tag) {
                Ok(on) => {
                    let ordered = (addr, size, HeldOrder::On(on.clone()));
                    if self.held_for_trim.replace(ticket, is, ordered) {
                        if let Some(on) = on {
                            wait_for(on);
                        }
                    }
                }
                // Stays free, as it was, if still the trim's; logged only then (one recalled
                // meanwhile is no longer the trim's).
                Err(e) => {
                    if self.put_back_some_held(ticket, is) > 0 {
                        went_back = true;
                        StreamHeap::<S>::log_kept(&e, addr, size);
                    }
                }
            }
        }
        (streams, went_back)
    }

    /// Whether the engine's growth lock or the trims' list's lock is held now (by any thread):
    /// for tests that check what runs under them.
    #[cfg(all(test, not(streamalloc_loom)))]
    pub(crate) fn trim_locks_held(&self) -> bool {
        self.held_for_trim.is_locked() || self.heap.slow_is_locked()
    }

    /// How many requests took back what trims held ([`Grow::recall_trimmed`]), and how many
    /// trims released what they held to unmap it.
    #[cfg(all(streamalloc_loom, test))]
    pub(crate) fn trim_counts(&self) -> (usize, usize) {
        self.held_for_trim.counts()
    }

    /// Bytes trims have taken out and not yet unmapped or put back (the loom model's view).
    #[cfg(all(test, streamalloc_loom))]
    pub(crate) fn trimming(&self) -> u64 {
        self.trimming.load(Ordering::Relaxed)
    }

    /// What the trim of `ticket` ([`hold_free`](Self::hold_free)) still holds, no longer held:
    /// to unmap once its streams were waited for ([`unmap_ranges`](Self::unmap_ranges)), then
    /// to say so ([`unmapped_held`](Self::unmapped_held)).
    ///
    /// A range never ordered ([`order_held`](Self::order_held) orders them all before the trim
    /// waits) goes back to the lists as it was, not to be unmapped under work that may still
    /// use it.
    pub(crate) fn release_held(&self, ticket: Ticket) -> Vec<Taken<S>> {
        let mut ordered = Vec::new();
        let mut tagged = Vec::new();
        for (addr, size, order) in self.held_for_trim.release(ticket) {
            match order {
                HeldOrder::On(on) => ordered.push((addr, size, on)),
                order @ HeldOrder::Tagged(_) => tagged.push((addr, size, order)),
            }
        }
        debug_assert!(tagged.is_empty(), "a trim's range was never ordered");
        self.put_back_trimmed(tagged);
        ordered
    }

    /// Notes that a trim has unmapped what [`release_held`](Self::release_held) handed it: a
    /// request refused meanwhile at the maximum looks again.
    pub(crate) fn unmapped_held(&self) {
        self.held_for_trim.given_back();
    }

    /// Puts back in the lists what the trim of `ticket` still holds (the trim ended early):
    /// whether there was any.
    pub(crate) fn put_back_held(&self, ticket: Ticket) -> bool {
        let mut any = false;
        self.held_for_trim.put_back(ticket, |ranges| {
            any = !ranges.is_empty();
            self.put_back_trimmed(ranges);
        });
        any
    }

    /// Puts back in the lists what the trim of `ticket` still holds and `stays` picks (ranges
    /// it cannot unmap now: their stream is under a user's graph capture); the rest stays held.
    /// Returns how many ranges went back.
    pub(crate) fn put_back_some_held(
        &self,
        ticket: Ticket,
        stays: impl FnMut(&HeldRange<S>) -> bool,
    ) -> usize {
        (self.held_for_trim).put_back_some(ticket, stays, |ranges| self.put_back_trimmed(ranges))
    }

    /// [`hold_free`](Self::hold_free)'s taking, with the growth lock held.
    fn take_free(&self, keep: u64) -> Vec<HeldRange<S>> {
        let g = self.granule();
        let mut out = Vec::new();
        // Unclaimed pieces first (fresh, needing no wait), the highest first, each from its
        // top: a piece partly released keeps its bottom, unclaimed. What is mapped is read
        // under the table's lock, which claims' moves hold while they unmap and map.
        let mut table = self.table.lock();
        // What other trims took stays counted in `reserved` until they unmap it: not ours to
        // take again.
        let going = if planted!(TRIMMING_IGNORED) {
            0
        } else {
            self.trimming.load(Ordering::Relaxed)
        };
        let mut excess = self.reserved().saturating_sub(going).saturating_sub(keep);
        if excess == 0 {
            // Nothing to give back: nothing leaves the lists, and no stream waits.
            return out;
        }
        let mut pieces = std::mem::take(&mut table.unclaimed);
        pieces.sort_unstable_by_key(|p| std::cmp::Reverse(p.0));
        for (first, count) in pieces {
            let part = (excess.div_ceil(g) as usize).min(count);
            excess = excess.saturating_sub(part as u64 * g);
            if part < count {
                table.unclaimed.push((first, count - part));
            }
            if part > 0 {
                let top = first + count - part;
                out.push((self.addr(top), part as u64 * g, HeldOrder::On(None)));
            }
        }
        self.note_unclaimed(&table);
        drop(table);
        if excess > 0 {
            let ranges = self.heap.take_aligned_tagged(g, excess);
            out.extend(
                (ranges.into_iter()).map(|(a, size, tag)| (a, size, HeldOrder::Tagged(tag))),
            );
        }
        self.trimming
            .fetch_add(Self::bytes_of(&out), Ordering::Relaxed);
        out
    }

    /// The bytes of `ranges`.
    fn bytes_of<T>(ranges: &[(u64, u64, T)]) -> u64 {
        ranges.iter().map(|r| r.1).sum()
    }

    /// Ranges that a trim took ([`hold_free`](Self::hold_free)) back in the lists, no longer
    /// counted as going (after they are back: see `trimming`). One still tagged goes back with
    /// its tag, as it was taken; one ordered, as freed on its stream.
    fn put_back_trimmed(&self, ranges: Vec<HeldRange<S>>) {
        let bytes = Self::bytes_of(&ranges);
        for (addr, size, order) in ranges {
            match order {
                HeldOrder::Tagged(tag) => self.heap.give_back_tagged(addr, size, tag),
                HeldOrder::On(on) => self.put_back_one(addr, size, on),
            }
        }
        self.trimming.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Ranges taken by [`hold_free`](Self::hold_free) go back where they were, free.
    pub(crate) fn put_back(&self, ranges: Vec<Taken<S>>) {
        for (addr, size, stream) in ranges {
            self.put_back_one(addr, size, stream);
        }
    }

    /// One range back where it was, free: as freed on `stream`, or fresh.
    fn put_back_one(&self, addr: u64, size: u64, stream: Option<S>) {
        match stream {
            Some(stream) => self.heap.give_blocks_to(&[(addr, size)], &stream),
            None => self.heap.give_fresh_blocks(&[(addr, size)]),
        }
    }

    /// Unmaps the granules of ranges taken by [`hold_free`](Self::hold_free). Returns the
    /// bytes unmapped and the first error; a range whose unmapping failed goes back to its
    /// list from the granule that failed on, so nothing is lost.
    ///
    /// The driver calls run with no lock of the pool held, the table's lock taken only after
    /// them to note what was unmapped: every growth takes that lock, and a request that needs
    /// one granule more must not wait for a trim's thousands of `cuMemUnmap`s (a review found
    /// it did: `tests/expandable_review.rs`, `a_growth_does_not_wait_for_a_trims_unmapping`).
    /// Until then the granules still count as mapped (their bits set, their bytes in
    /// `reserved`), so no growth maps over them and the maximum holds; they are in no list,
    /// so nothing hands them out or moves them.
    ///
    /// # Safety
    /// The work of every range's stream, up to the moment its range was taken, has finished
    /// (the caller synchronized the stream after `hold_free`); fresh ranges were never used.
    pub(crate) unsafe fn unmap_ranges(&self, ranges: Vec<Taken<S>>) -> (u64, Result<()>) {
        let taken = Self::bytes_of(&ranges);
        // SAFETY: the caller's contract, passed on.
        let (unmapped, result, back, panicked) = unsafe { self.unmap_unlocked(ranges) };
        let going_back = Self::bytes_of(&back);
        let released = {
            let mut table = self.table.lock();
            let released = self.note_unmapped(&mut table, &unmapped);
            // With `reserved`, under the table's lock: a trim reads both there.
            (self.trimming).fetch_sub(taken - going_back, Ordering::Relaxed);
            released
        };
        // Outside the table's lock: the handles' drops take locks of their own.
        self.put_back_trimmed(
            back.into_iter()
                .map(|(a, size, on)| (a, size, HeldOrder::On(on)))
                .collect(),
        );
        if let Some(payload) = panicked {
            // The caller unwinds before it says that the trim gave back what it unmapped: said
            // here, so a request refused at the maximum meanwhile looks again.
            self.held_for_trim.given_back();
            std::panic::resume_unwind(payload);
        }
        (released, result)
    }

    /// [`unmap_ranges`](Self::unmap_ranges) under the table's lock (a growth's move, a
    /// claim's: the request's own driver work). Returns what the caller must
    /// [`put_back`](Self::put_back) (the ranges from a granule that failed to unmap on) after
    /// letting go of the lock, and the payload of a panic out of an unmap, which the caller
    /// lets go on (`std::panic::resume_unwind`) once it has put that back: what was unmapped
    /// is noted here either way.
    ///
    /// # Safety
    /// As `unmap_ranges`.
    unsafe fn unmap_locked(
        &self,
        table: &mut Table,
        ranges: Vec<Taken<S>>,
    ) -> (u64, Result<()>, Vec<Taken<S>>, Panicked) {
        // SAFETY: the caller's contract, passed on.
        let (unmapped, result, back, panicked) = unsafe { self.unmap_unlocked(ranges) };
        (self.note_unmapped(table, &unmapped), result, back, panicked)
    }

    /// The driver's part of [`unmap_ranges`](Self::unmap_ranges): unmaps the granules of
    /// `ranges`, and touches no bookkeeping (the caller notes them, under the table's lock:
    /// [`note_unmapped`](Self::note_unmapped)). Returns the runs unmapped `(first granule,
    /// count)`, the first error, the ranges from a granule that failed to unmap on, and the
    /// payload of a panic out of an unmap.
    ///
    /// A panic out of [`Backing::unmap`] (the simulated device's race detector, in its `Panic`
    /// mode, reporting work that still uses the granule) is caught: the granule counts as
    /// unmapped (the trait's word), nothing more is unmapped, and the rest goes back with the
    /// ranges that failed, so that the caller's bookkeeping holds before it lets the panic go
    /// on. Uncaught, the granule stayed counted as mapped, the ranges after it were in no list
    /// for ever, and `trimming` stayed raised (a review's finding:
    /// `tests/expandable_review3.rs`).
    ///
    /// # Safety
    /// As `unmap_ranges`.
    #[allow(clippy::type_complexity)]
    unsafe fn unmap_unlocked(
        &self,
        ranges: Vec<Taken<S>>,
    ) -> (Vec<(usize, usize)>, Result<()>, Vec<Taken<S>>, Panicked) {
        let g = self.granule();
        let base = self.backing.base();
        let mut unmapped = Vec::new();
        let mut result = Ok(());
        let mut back = Vec::new();
        let mut panicked: Panicked = None;
        for (addr, size, stream) in ranges {
            if panicked.is_some() {
                back.push((addr, size, stream));
                continue;
            }
            let first = ((addr - base) / g) as usize;
            let count = (size / g) as usize;
            let mut done = 0;
            for index in first..first + count {
                debug_assert!(self.bits.get(index), "granule {index} free but unmapped");
                // Unwind safety: the closure touches only the backing, whose unmap is complete
                // when it panics (the trait's word); the pool's state is ours to finish after.
                // SAFETY: the granule lies in a range taken out of every list (nothing can
                // hand it out), wholly free, and the caller's contract says the work that
                // last used it has finished.
                let unmap =
                    crate::completion::catch_unwind(|| unsafe { self.backing.unmap(index) });
                match unmap {
                    Ok(Ok(())) => done += 1,
                    Err(payload) => {
                        done += 1;
                        let at = self.addr(index + 1);
                        if at < addr + size {
                            back.push((at, addr + size - at, stream.clone()));
                        }
                        panicked = Some(payload);
                        break;
                    }
                    Ok(Err(e)) => {
                        let at = self.addr(index);
                        back.push((at, addr + size - at, stream.clone()));
                        if result.is_ok() {
                            result = Err(e);
                        }
                        break;
                    }
                }
            }
            if done > 0 {
                unmapped.push((first, done));
            }
        }
        (unmapped, result, back, panicked)
    }

    /// Notes the runs `(first granule, count)` that [`unmap_unlocked`](Self::unmap_unlocked)
    /// unmapped, under the table's lock: their bits, the frontiers, the bytes mapped. Returns
    /// those bytes.
    fn note_unmapped(&self, table: &mut Table, unmapped: &[(usize, usize)]) -> u64 {
        let mut released = 0;
        for &(first, count) in unmapped {
            for index in first..first + count {
                table.set(&self.bits, index, false);
            }
            released += count as u64 * self.granule();
        }
        if !unmapped.is_empty() {
            table.recompute_frontiers(&self.bits);
        }
        self.reserved.fetch_sub(released, Ordering::Relaxed);
        released
    }

    /// Room under the maximum for a growth that maps `run` (granules of region `keep`) and
    /// lacks `bytes` of it: unmaps at least `bytes` of wholly free granules whose last users
    /// have finished, of the other regions and of `keep` outside the run and the free blocks
    /// on either side of it, which the request counts on (free memory does not coalesce
    /// across a region, nor across a live block, so without this a pool at its maximum would
    /// refuse a request its free memory could serve once moved). Unmaps nothing unless it
    /// finds enough. Returns whether there is room now, what the caller must put back after
    /// letting go of the table's lock, the streams whose memory was left because they
    /// were busy, and the payload of a panic out of an unmap (for the caller to let go on
    /// after putting back: [`unmap_locked`](Self::unmap_locked)).
    #[allow(clippy::type_complexity)]
    fn make_room(
        &self,
        table: &mut Table,
        keep: usize,
        run: std::ops::Range<usize>,
        bytes: u64,
    ) -> (bool, Vec<Taken<S>>, Vec<S>, Panicked) {
        let (start, end) = (self.addr(run.start), self.addr(run.end));
        let (left, right) = self.heap.free_around(keep, start, end);
        let kept = start - left..end + right;
        let (ranges, busy) = (self.heap).take_idle_aligned(self.granule(), keep, kept, bytes);
        let ranges: Vec<Taken<S>> = ranges
            .into_iter()
            .map(|(addr, size)| (addr, size, None))
            .collect();
        let found: u64 = ranges.iter().map(|r| r.1).sum();
        if found < bytes {
            return (false, ranges, busy, None);
        }
        let _span = tracing::debug_span!("relocate", bytes, found, keep).entered();
        // SAFETY: `take_idle_aligned` took the ranges out of every list, and the work of
        // every stream that freed them has finished (or none ever used them).
        let (released, result, back, panicked) = unsafe { self.unmap_locked(table, ranges) };
        if let Err(e) = &result {
            tracing::warn!(error = %e, released, "relocation stopped: an unmap failed");
        }
        let room = result.is_ok() && panicked.is_none() && released >= bytes;
        (room, back, busy, panicked)
    }
}

impl<S: EngineStream, B: Backing> Grow<S> for Expander<S, B> {
    #[inline]
    fn has_unclaimed(&self) -> bool {
        self.unclaimed_bytes() > 0
    }

    fn claim(&self, min: u64, _stream: &S) -> bool {
        self.claim_piece(min)
    }

    fn trim_epoch(&self) -> u64 {
        self.held_for_trim.epoch()
    }

    fn recall_trimmed(&self, epoch: u64) -> bool {
        (self.held_for_trim).recall(epoch, |ranges| self.put_back_trimmed(ranges))
    }

    /// Maps granules for a request of `min` bytes where they coalesce with the requester's
    /// free memory; never a new chunk. The engine gives the range to the requester's list,
    /// where it merges with its free neighbours.
    fn grow(&self, min: u64, _stream: &S) -> Result<(u64, u64)> {
        let mut table = self.table.lock();
        let Some((first, count)) = self.place(&table, min) else {
            tracing::debug!(requested = min, "no room left in the reserved addresses");
            return Err(self.out_of_memory(min));
        };
        let _span = tracing::debug_span!("grow", requested = min, first, count).entered();
        let over = (self.reserved() + count as u64 * self.granule()).saturating_sub(self.maximum);
        let (mut back, mut unused) = (Vec::new(), Vec::new());
        if over > 0 {
            let region = table.region_of(first);
            let (room, rest, busy, panicked) =
                self.make_room(&mut table, region, first..first + count, over);
            back = rest;
            if let Some(payload) = panicked {
                // What was unmapped is noted; the rest goes back before the panic goes on.
                drop(table);
                self.put_back(back);
                drop(busy);
                std::panic::resume_unwind(payload);
            }
            if !room {
                drop(table);
                self.put_back(back);
                if !busy.is_empty() {
                    let mut noted = self.busy.lock();
                    for stream in busy {
                        if !noted.iter().any(|s| s.uid() == stream.uid()) {
                            noted.push(stream);
                        }
                    }
                }
                return Err(self.out_of_memory(min));
            }
            // Handles of busy streams go after the table's lock.
            unused = busy;
        }
        let grown = self.map_timed(&mut table, first, count, min);
        drop(table);
        drop(unused);
        self.put_back(back);
        let grown = grown?;
        self.grows.fetch_add(1, Ordering::Relaxed);
        if over > 0 {
            // A move counts once its room is mapped where the request grows, as a claim's
            // (`moves`): a growth whose map failed after `make_room` unmapped moved nothing
            // (a review found it counted: `a_failed_growth_at_the_maximum_is_no_relocation`).
            self.relocations.fetch_add(1, Ordering::Relaxed);
        }
        Ok(grown)
    }
}
