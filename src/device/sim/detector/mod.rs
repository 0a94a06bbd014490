//! The stream-order race detector of the simulated device (see `races.rs` for what it reports).
//!
//! Everything is decided when work is *queued*, on the thread that queues it: stream order is
//! fixed by the order of the queue, so a vector clock per stream, advanced under the queue's
//! lock, is exact. The only run-time input is what the host has seen complete, and it comes in
//! two kinds, kept apart so that the verdict depends on stream order and on what the user's
//! code did, never on when the crate happened to look:
//!
//! - The host clock: what the *user's* code observed complete (an event it awaited to
//!   completion, queried or synchronized on, a stream's synchronize or idle answer, and the
//!   crate's public calls that wait before they return). Joined into every stream at its next
//!   operation: whatever the user queues after the observation really comes after the work.
//! - The crate's clock: what the crate's *own* checks saw complete (an event asked by the
//!   completion reactor or by `on_complete` for a staging block or a deferred free, a pool's
//!   idle probe of a stream). Nothing the user queues is ordered by it (a review found a
//!   user's upload on one stream and unordered read on another unreported once the staging
//!   block's callback had asked the upload's event). It only vouches for what the crate does
//!   on that knowledge with memory it holds: a block handed out again without an ordering (a
//!   pool's reuse after an idle answer, checked against the block's free), a block going back
//!   (a deferred free runs once its events are complete; a chunk goes back once its blocks'
//!   frees ran) and unmapped granules.
//!
//! Memory is a map of disjoint segments, split at block boundaries. Each segment holds a stack
//! of lives, innermost last: the raw allocation, then the blocks that suballocating resources
//! carve out of it (a pool's block, a fixed-size block inside a pool's block). Only the top may
//! be a freed life, which keeps its free point (to check the next allocation against) and its
//! uses (to check a free of the block below against). Uses are epochs (a stream and a
//! position), pruned when a later use on an ordered stream covers them, so the lists stay short.
//!
//! The state is behind a plain (never loom) mutex, taken after a stream's queue lock and never
//! holding anything else: loom explores the protocol around it, not its bookkeeping.
//!
//! Each simulated device keeps its own detector (its own mode, its own races: tests run in
//! parallel in one process and must never see each other's), and devices meet in two ways:
//!
//! - A wait on another device's event. A stream's clock has a local part (this detector's
//!   streams) and a foreign part: for each other detector (by its process-wide id), what this
//!   stream is ordered after there. An event's snapshot carries both, so a chain A (device 0)
//!   -> C (device 1) -> B (device 0) brings A's component back into B's local clock, however
//!   many devices it passed through. A review found such a chain reported as a race, since a
//!   foreign event was once taken as a plain operation. The host clock is likewise forwarded:
//!   the user's code seeing an event complete orders later work on every device it knew of.
//! - A copy that reads another device's memory (`copy_peer`). Its source read is checked in
//!   the source device's detector, against what the copying stream knows of that device's
//!   streams (joined with that device's host clock), and the race, if any, is the copying
//!   device's: it is kept in *its* races and settled by *its* mode, as the race of any other
//!   operation queued on its stream. The read is not added to the source device's shadow
//!   (which has no index for a foreign stream), so a later write or free of the source not
//!   ordered after the copy goes unreported: a missed race, never a false one.
//!
//! Detectors find each other through a process-wide registry (by id, and by their device's
//! memory), which holds them weakly.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::memory::{PoolReleases, SimMemory};
use super::races::{MemoryAccess, Race, RaceDetection, RaceKind, RaceSite};
use crate::device::DevicePtr;
use crate::device::StreamId;
use crate::sync::plain::{Arc as PlainArc, Mutex as PlainMutex, MutexGuard as PlainGuard, Weak};

mod pending_free;
mod state;

pub(crate) use pending_free::PendingFree;

/// A position of a stream: how many of its operations came before, and this one. 64 bits: a
/// stream may run more than 2^32 operations (a soak run of a few hours), where a `u32` once
/// overflowed (a review's finding).
pub(crate) type Epoch = u64;

/// A vector clock: component `i` is how many operations of dense stream `i` are ordered before.
pub(crate) type Clock = Vec<Epoch>;

/// What a stream (or an event) is ordered after on other devices: a clock per other detector,
/// by its id. Short: one entry per device a chain of waits came through.
pub(crate) type Foreign = Vec<(u64, Clock)>;

/// What an event carries: the recording stream's clock, local to the detector `id`, and what
/// it knew of other devices.
#[derive(Debug)]
pub(crate) struct Snapshot {
    id: u64,
    pub(crate) local: Clock,
    foreign: Foreign,
}

/// The live detectors of the process: id, the device's memory (to find the detector of a peer
/// copy's source) and the detector, held weakly so that a device's end ends its detector.
type Registry = Vec<(u64, Weak<SimMemory>, Weak<Detector>)>;

static REGISTRY: PlainMutex<Registry> = PlainMutex::new(Vec::new());

fn registry() -> PlainGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// Makes `detector` (of the device whose memory is `memory`) findable by other devices', and
/// tells it when the memory's driver pools give blocks back.
pub(crate) fn register(memory: &PlainArc<SimMemory>, detector: &PlainArc<Detector>) {
    let listener: PlainArc<dyn PoolReleases> = detector.clone();
    memory.tell_pool_releases_to(PlainArc::downgrade(&listener));
    let mut reg = registry();
    reg.retain(|(_, _, d)| d.strong_count() > 0);
    reg.push((
        detector.id,
        PlainArc::downgrade(memory),
        PlainArc::downgrade(detector),
    ));
}

/// The detector of the device whose memory is `memory`, if detection is on there. (A listed
/// `Weak` keeps its allocation, so no later memory can take a listed one's address.)
pub(crate) fn of_memory(memory: &PlainArc<SimMemory>) -> Option<PlainArc<Detector>> {
    let reg = registry();
    reg.iter()
        .find(|(_, m, _)| std::ptr::eq(m.as_ptr(), PlainArc::as_ptr(memory)))
        .and_then(|(_, _, d)| d.upgrade())
}

/// The detector whose id is `id`, if it still lives.
fn by_id(id: u64) -> Option<PlainArc<Detector>> {
    let reg = registry();
    reg.iter()
        .find(|(i, _, _)| *i == id)
        .and_then(|(_, _, d)| d.upgrade())
}

/// Joins `from`, a clock of detector `id`, into a stream of detector `self_id` (its clock
/// `local` and its foreign part `into`): into the local clock if it is that stream's own
/// detector, else into that detector's entry.
fn join_foreign(local: &mut Clock, into: &mut Foreign, self_id: u64, id: u64, from: &[Epoch]) {
    if id == self_id {
        join(local, from);
    } else if let Some((_, c)) = into.iter_mut().find(|(i, _)| *i == id) {
        join(c, from);
    } else {
        into.push((id, from.to_vec()));
    }
}

/// Index 0 is the host: it has no operations of its own, so its component stays 0.
const HOST: u32 = 0;
/// The most uses a life keeps; past it the oldest goes (a missed race, never a false one).
const MAX_USES: usize = 64;
/// Raw frees whose freed segments are kept (to report uses after free); older ones are dropped
/// so that a long test does not grow the map without bound.
const KEPT_RAW_FREES: usize = 4096;

/// A point of a stream: the operation at `epoch` of slot `stream` (or the host, at epoch 0).
#[derive(Clone, Copy, Debug)]
struct Point {
    stream: u32,
    epoch: Epoch,
    op: &'static str,
    /// The stream that queued it, for a report: the slot may hold another stream by the time
    /// the point is reported (see [`Detector::add_stream`]).
    id: Option<StreamId>,
    /// The slot's count when that stream took it: `epoch - base` is the operation's position
    /// on its own stream.
    base: Epoch,
}

impl Point {
    /// A point of the host (ordered before everything): a synchronous `malloc`, `free`...
    fn host(op: &'static str) -> Point {
        Point {
            stream: HOST,
            epoch: 0,
            op,
            id: None,
            base: 0,
        }
    }

    /// Whether this point is ordered before work whose clock is `clock`.
    fn before(&self, clock: &[Epoch]) -> bool {
        self.epoch == 0
            || clock
                .get(self.stream as usize)
                .is_some_and(|&c| c >= self.epoch)
    }
}

#[derive(Clone, Copy, Debug)]
struct Use {
    start: u64,
    end: u64,
    at: Point,
    write: bool,
}

#[derive(Clone, Copy, Debug)]
struct Freed {
    point: Point,
    /// A driver pool's free: the device reuses the block only once the free has run
    /// ([`Reuse::Device`]), and the freed block is the pool's, not forgotten with old frees.
    pooled: bool,
}

#[derive(Clone, Debug)]
struct Life {
    block: (u64, u64),
    raw: bool,
    alloc: Point,
    freed: Option<Freed>,
    uses: Vec<Use>,
}

#[derive(Clone, Debug)]
struct Seg {
    end: u64,
    stack: Vec<Life>,
}

struct StreamState {
    id: Option<StreamId>,
    /// Empty once the stream is closed.
    clock: Clock,
    /// The slot's count when this stream took it (0 for the slot's first stream).
    base: Epoch,
    /// Once closed: the slot's count, the epoch of the stream's last operation.
    last: Epoch,
    /// What the stream is ordered after on other devices (see the module docs).
    foreign: Foreign,
    /// The host clock's version last joined.
    host_seen: u64,
}

struct State {
    /// By slot (a stream's dense index; 0 the host's). A closed stream's slot goes to a later
    /// stream once the host has seen all its work (see [`Detector::add_stream`]).
    streams: Vec<StreamState>,
    /// The slots of closed streams not yet handed to a new stream.
    closed: Vec<u32>,
    /// What the user's code has seen complete: joined into every stream at its next operation.
    host: Clock,
    host_version: u64,
    /// What the crate's own checks have seen complete (see the module docs): never joined into
    /// a stream, only consulted where the crate acts on it (a reuse, a free, an unmap).
    seen_by_crate: Clock,
    segs: BTreeMap<u64, Seg>,
    raw_frees: VecDeque<(u64, u64)>,
    races: Vec<Race>,
}

/// How an allocation point relates to the block's previous free.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reuse {
    /// Check it: a reuse not ordered after the previous free (nor after a free the crate has
    /// seen run, the pools' reuse of an idle stream's block) is a race.
    Check,
    /// The device vouches for it: a driver pool (and the simulated memory behind
    /// `cuMemAllocAsync`) reuses a block only once its free has run.
    /// That orders this block's reuse after its free, and nothing else: the allocating stream
    /// is not ordered after the freeing one (it once joined the freeing stream's whole clock,
    /// which hid the allocating stream's races on unrelated memory).
    Device,
}

/// The race detector of one simulated device.
pub(crate) struct Detector {
    /// Unique in the process: how events and other devices' streams name this detector.
    id: u64,
    mode: RaceDetection,
    state: PlainMutex<State>,
}

impl Detector {
    pub(crate) fn new(mode: RaceDetection) -> Self {
        static IDS: AtomicU64 = AtomicU64::new(1);
        Self {
            id: IDS.fetch_add(1, Relaxed),
            mode,
            state: PlainMutex::new(State {
                streams: vec![StreamState {
                    id: None,
                    clock: vec![0],
                    base: 0,
                    last: 0,
                    foreign: Vec::new(),
                    host_seen: 0,
                }],
                closed: Vec::new(),
                host: vec![0],
                host_version: 0,
                seen_by_crate: vec![0],
                segs: BTreeMap::new(),
                raw_frees: VecDeque::new(),
                races: Vec::new(),
            }),
        }
    }

    fn lock(&self) -> PlainGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a racing memory operation is refused (the `Error` mode).
    pub(crate) fn rejects(&self) -> bool {
        self.mode == RaceDetection::Error
    }

    /// Whether a racing memory operation is refused and then panics on (the `Panic` mode,
    /// on a thread not already panicking): it is not queued either. Queued, it would run
    /// while the panic unwinds the caller, whose host memory the operation names is freed
    /// on the way (a test harness catching the panic, as proptest does to shrink, saw a
    /// racing `copy_dtoh` write into its freed buffer and the heap abort).
    pub(crate) fn panics_now(&self) -> bool {
        self.mode == RaceDetection::Panic && !std::thread::panicking()
    }

    /// What the caller does about a race it was told of (already kept and logged): an error
    /// for an operation that was refused, a panic in the `Panic` mode (unless this thread is
    /// already panicking), else nothing.
    pub(crate) fn settle(&self, race: Option<Race>, refused: bool) -> crate::error::Result<()> {
        let Some(race) = race else {
            return Ok(());
        };
        match self.mode {
            RaceDetection::Panic if !std::thread::panicking() => panic!("{race}"),
            _ if refused => Err(crate::error::Error::StreamRace(Box::new(race))),
            _ => Ok(()),
        }
    }

    /// A new stream: its dense index (its slot, a component of every clock).
    ///
    /// A closed stream's slot is handed out again once the host clock covers the closed
    /// stream's last operation; else a new slot is added. Without reuse every clock (and every
    /// snapshot an event carries, every join) kept a component for every stream the device
    /// ever made, so a server making a stream per request slowed down and grew without bound.
    ///
    /// Why the reuse is sound. A slot's epochs go on counting across its streams: the new
    /// stream `B` starts at the old stream `A`'s last epoch `n`, so every point of either
    /// keeps a (slot, epoch) of its own, and a clock's component `c` for the slot still means
    /// "the slot's operations up to `c` are ordered before". That meaning holds for a
    /// component above `n` only if each of `B`'s operations is ordered after all of `A`'s
    /// (a clock that learns of `B`'s operation `n + 1` through an event learns of `A`'s `1..=n`
    /// with it, and `B`'s own clock claims them from its first operation). A new stream knows
    /// nothing of `A` of its own (it starts from the host clock, never from `A`'s clock,
    /// which went at `A`'s close), so that must already hold for *everything* queued from now
    /// on: the host clock covers `n` (the user's code saw `A`'s last operation complete: a
    /// synchronize, an idle answer, an event recorded last and awaited), which orders every
    /// later operation on every stream after all of `A`'s. (`B`'s first operation joins that
    /// host clock, so its count goes on above `n` even without the start set here.) The
    /// crate's own clock will not do: it orders none of the user's work. A slot whose stream
    /// was closed with work the host never saw complete stays closed until the host does (a
    /// missed reuse, never a missed race): `B` in it would take `A`'s unseen writes for its
    /// own past and miss their races with `B`'s uses. So streams dropped with work nobody
    /// waited for still widen the clocks, one slot each, until the host sees that work.
    ///
    /// Everything else of `A` stays as it was: its points in the shadow keep their epochs (at
    /// most `n`, ordered before `B`'s) and their stream's id and position for reports, and
    /// its `SimStream`, closed, no longer speaks for the slot (`idle_seen_by`).
    pub(crate) fn add_stream(&self, id: StreamId) -> u32 {
        let mut st = self.lock();
        let State {
            streams,
            closed,
            host,
            ..
        } = &mut *st;
        let seen = |i: u32| host.get(i as usize).copied().unwrap_or(0) >= streams[i as usize].last;
        if let Some(at) = closed.iter().position(|&i| seen(i)) {
            let idx = closed.swap_remove(at);
            let base = streams[idx as usize].last;
            let mut clock = vec![0; idx as usize + 1];
            clock[idx as usize] = base;
            streams[idx as usize] = StreamState {
                id: Some(id),
                clock,
                base,
                last: 0,
                foreign: Vec::new(),
                host_seen: 0,
            };
            return idx;
        }
        let idx = streams.len() as u32;
        streams.push(StreamState {
            id: Some(id),
            clock: vec![0; idx as usize + 1],
            base: 0,
            last: 0,
            foreign: Vec::new(),
            host_seen: 0,
        });
        idx
    }

    /// Stream `idx`'s handle is gone: nothing is queued on it again, so its clock (a word
    /// for every slot below it) and what it knew of other devices go. Its operations stay in
    /// the shadow as points (a slot and an epoch), which other streams' clocks order; its
    /// slot goes to a later stream once the host has seen them all
    /// ([`add_stream`](Self::add_stream)).
    pub(crate) fn close_stream(&self, idx: u32) {
        let mut st = self.lock();
        let s = &mut st.streams[idx as usize];
        if s.clock.is_empty() {
            return; // closed already: listed once
        }
        s.last = s.clock[idx as usize];
        s.clock = Vec::new();
        s.foreign = Vec::new();
        st.closed.push(idx);
    }

    /// The widest clock the detector holds (a stream's, the host's, the crate's) and the
    /// number of slots: a test's view of what an operation copies and joins.
    #[cfg(all(test, not(streamalloc_loom)))]
    pub(crate) fn clock_width(&self) -> usize {
        let st = self.lock();
        (st.streams.iter().map(|s| s.clock.len()))
            .chain([st.host.len(), st.seen_by_crate.len(), st.streams.len()])
            .max()
            .unwrap_or(0)
    }

    /// How many streams are open (made and not closed; not the host's clock, which has no
    /// stream id): a test's view.
    #[cfg(all(test, not(streamalloc_loom)))]
    pub(crate) fn open_streams(&self) -> usize {
        let st = self.lock();
        st.streams
            .iter()
            .filter(|s| s.id.is_some() && !s.clock.is_empty())
            .count()
    }

    /// How many segments the shadow holds: a test's view of its size.
    #[cfg(all(test, not(streamalloc_loom)))]
    pub(crate) fn segments(&self) -> usize {
        self.lock().segs.len()
    }

    /// The races found so far.
    pub(crate) fn races(&self) -> Vec<Race> {
        self.lock().races.clone()
    }

    /// Takes the races found so far.
    pub(crate) fn take_races(&self) -> Vec<Race> {
        std::mem::take(&mut self.lock().races)
    }

    /// The user's code saw an event complete whose snapshot is `snap`: everything queued from
    /// now on, on every stream, is ordered after it, on this device and on those the event's
    /// stream was ordered after (their detectors' host clocks join their parts).
    pub(crate) fn host_join(&self, snap: &Snapshot) {
        self.host_join_local(&snap.local);
        for (id, clock) in &snap.foreign {
            // One detector's lock at a time: this one's was released above.
            if let Some(other) = by_id(*id) {
                other.host_join_local(clock);
            }
        }
    }

    /// The host clock joins `clock` (of this detector's streams).
    fn host_join_local(&self, clock: &[Epoch]) {
        let mut st = self.lock();
        if join(&mut st.host, clock) {
            st.host_version += 1;
        }
    }

    /// The crate's own check saw an event complete whose stream's clock was `clock`: no stream
    /// is ordered after it, only what the crate does on that knowledge (see the module docs).
    pub(crate) fn crate_join(&self, clock: &[Epoch]) {
        join(&mut self.lock().seen_by_crate, clock);
    }

    /// Stream `idx` was seen idle (everything queued on it so far has run): by the user's code
    /// (`user`, `Stream::is_idle`: the host clock joins the stream's clock) or by the crate's
    /// own probe (a pool's question before a reuse: the crate's clock does). Called under the
    /// stream's queue lock, so that nothing is queued on it in between.
    ///
    /// The user's look also orders what the stream was ordered after on other devices (its
    /// waits for their events have run), as seeing an event complete does
    /// ([`host_join`](Self::host_join)): their host clocks join those parts. Only this
    /// device's was joined, so a host free on another device of memory whose last use the
    /// idle stream had waited for was reported as freed while in use (a review's finding).
    pub(crate) fn join_stream(&self, idx: u32, user: bool) {
        let foreign = {
            let mut st = self.lock();
            let State {
                streams,
                host,
                host_version,
                seen_by_crate,
                ..
            } = &mut *st;
            let stream = &streams[idx as usize];
            if !user {
                join(seen_by_crate, &stream.clock);
                return;
            }
            if join(host, &stream.clock) {
                *host_version += 1;
            }
            stream.foreign.clone()
        };
        for (id, clock) in &foreign {
            // One detector's lock at a time: this one's was released above.
            if let Some(other) = by_id(*id) {
                other.host_join_local(clock);
            }
        }
    }

    // ===== operations of a stream (called under its queue lock) =====

    /// Advances stream `idx` by one operation: its epoch.
    fn tick(st: &mut State, idx: u32) -> Epoch {
        let State {
            streams,
            host,
            host_version,
            ..
        } = st;
        let s = &mut streams[idx as usize];
        debug_assert!(
            s.clock.len() > idx as usize,
            "an operation on a closed stream"
        );
        if s.host_seen != *host_version {
            join(&mut s.clock, host);
            s.host_seen = *host_version;
        }
        let own = &mut s.clock[idx as usize];
        *own += 1;
        *own
    }

    /// Advances stream `idx` by one operation: its point.
    fn point(st: &mut State, idx: u32, op: &'static str) -> Point {
        let epoch = Self::tick(st, idx);
        let s = &st.streams[idx as usize];
        Point {
            stream: idx,
            epoch,
            op,
            id: s.id,
            base: s.base,
        }
    }

    /// An operation that touches no memory (a spin, a wait's own slot).
    pub(crate) fn plain_op(&self, idx: u32) {
        Self::tick(&mut self.lock(), idx);
    }

    /// A record: the snapshot of the stream's clock that the event carries.
    pub(crate) fn record(&self, idx: u32) -> PlainArc<Snapshot> {
        let mut st = self.lock();
        Self::tick(&mut st, idx);
        let s = &st.streams[idx as usize];
        PlainArc::new(Snapshot {
            id: self.id,
            local: s.clock.clone(),
            foreign: s.foreign.clone(),
        })
    }

    /// A wait for an event whose snapshot is `snap`, of this device or another: each part of
    /// it joins the stream's clock for its detector (see the module docs).
    pub(crate) fn wait(&self, idx: u32, snap: &Snapshot) {
        let mut st = self.lock();
        Self::tick(&mut st, idx);
        let s = &mut st.streams[idx as usize];
        join_foreign(&mut s.clock, &mut s.foreign, self.id, snap.id, &snap.local);
        for (id, clock) in &snap.foreign {
            join_foreign(&mut s.clock, &mut s.foreign, self.id, *id, clock);
        }
    }

    /// What stream `idx` is ordered after on the device of detector `other` (its clock there),
    /// and the site its next operation will have: for a check of a read of that device's
    /// memory ([`foreign_read`](Self::foreign_read)).
    pub(crate) fn knowledge_of(
        &self,
        idx: u32,
        other: &Detector,
        op: &'static str,
    ) -> (Clock, RaceSite) {
        let st = self.lock();
        let s = &st.streams[idx as usize];
        let clock = match other.id == self.id {
            true => s.clock.clone(),
            false => (s.foreign.iter())
                .find(|(i, _)| *i == other.id)
                .map(|(_, c)| c.clone())
                .unwrap_or_default(),
        };
        let site = RaceSite {
            stream: s.id,
            op,
            position: s.clock[idx as usize] + 1 - s.base,
        };
        (clock, site)
    }

    /// Another device's operation (at `at`, ordered after `clock` of this device's streams)
    /// reads `[ptr, ptr + bytes)` of this device's memory: the race, if it is not ordered
    /// after the memory's allocation and writes. Kept by neither detector: the caller keeps it
    /// in the reading device's ([`note_race`](Self::note_race)). The read leaves no use here
    /// (see the module docs).
    pub(crate) fn foreign_read(
        &self,
        ptr: u64,
        bytes: usize,
        clock: &[Epoch],
        at: RaceSite,
    ) -> Option<Race> {
        let st = self.lock();
        // What the host has seen complete here orders every later operation, on any device.
        let mut clock = clock.to_vec();
        join(&mut clock, &st.host);
        // No stream of this detector: never taken for the same stream as a use here.
        let point = Point {
            stream: u32::MAX,
            epoch: 1,
            op: at.op,
            id: None,
            base: 0,
        };
        let mut race = st.check_use(ptr, bytes, point, MemoryAccess::Read, &clock)?;
        race.at = at;
        Some(race)
    }

    /// Keeps and logs a race found on this device's stream by another detector.
    pub(crate) fn note_race(&self, race: Race) -> Option<Race> {
        self.lock().note(Some(race))
    }

    /// Work on stream `idx` (or the host) that touches `ranges`. With `reject` (the `Error`
    /// mode, for an operation that can fail), a race keeps the use out of the shadow: the
    /// caller will not queue the work.
    pub(crate) fn access(
        &self,
        idx: u32,
        op: &'static str,
        ranges: &[(u64, usize, MemoryAccess)],
        reject: bool,
    ) -> Option<Race> {
        let mut st = self.lock();
        let at = Self::point(&mut st, idx, op);
        let clock = st.streams[idx as usize].clock.clone();
        let mut found = None;
        for &(ptr, bytes, access) in ranges {
            if found.is_none() {
                found = st.check_use(ptr, bytes, at, access, &clock);
            }
        }
        if found.is_none() || !reject {
            for &(ptr, bytes, access) in ranges {
                st.add_use(ptr, bytes, at, access == MemoryAccess::Write, &clock);
            }
        }
        st.note(found)
    }

    /// A block of `bytes` at `ptr` handed out on stream `idx` (or the host), `raw` for device
    /// memory itself (else a block that a resource carves out of it).
    pub(crate) fn allocate(
        &self,
        idx: Option<u32>,
        ptr: u64,
        bytes: usize,
        raw: bool,
        reuse: Reuse,
    ) -> Option<Race> {
        let Some(end) = ptr.checked_add(bytes as u64) else {
            wraps("an allocation", ptr, bytes);
            return None;
        };
        let start = ptr;
        if start == end {
            return None;
        }
        let mut st = self.lock();
        let at = match idx {
            Some(idx) => Self::point(&mut st, idx, "allocate"),
            None => Point::host("malloc"),
        };
        st.split(start);
        st.split(end);
        st.fill_gaps(start, end);
        let mut found: Option<(Point, Life)> = None;
        let keys: Vec<u64> = st.segs.range(start..end).map(|(&k, _)| k).collect();
        for key in keys {
            let top = st.segs[&key].stack.last().cloned();
            if let Some(top) = top.filter(|t| t.freed.is_some()) {
                let freed = top.freed.expect("filtered");
                // A reuse the crate made because it saw the free run (a pool's idle answer) is
                // ordered for this block only: checked against the crate's clock, which no
                // stream joins.
                if reuse == Reuse::Check
                    && found.is_none()
                    && at.stream != HOST
                    && !freed.point.before(&st.streams[at.stream as usize].clock)
                    && !freed.point.before(&st.seen_by_crate)
                {
                    found = Some((freed.point, top.clone()));
                }
                let seg = st.segs.get_mut(&key).expect("listed above");
                let popped = seg.stack.pop().expect("the top, just read");
                // Its uses are what a free of the block below (a chunk a pool cut this block
                // from) must still be checked against: they move down rather than vanish (a
                // review found a chunk freed while a reused block's old use still ran, unseen).
                if let Some(below) = seg.stack.last_mut() {
                    below.uses.extend(popped.uses);
                    let excess = below.uses.len().saturating_sub(MAX_USES);
                    below.uses.drain(..excess);
                }
            }
            st.segs
                .get_mut(&key)
                .expect("listed above")
                .stack
                .push(Life {
                    block: (start, end),
                    raw,
                    alloc: at,
                    freed: None,
                    uses: Vec::new(),
                });
        }
        st.merge_alike(start, end);
        let race = found.map(|(earlier, block)| Race {
            kind: RaceKind::ReuseBeforeFree,
            ptr: DevicePtr(start),
            bytes,
            at: st.site(at),
            earlier: st.site(earlier),
            block: Some(st.block_info(&block)),
        });
        st.note(race)
    }

    /// The block `[ptr, ptr + bytes)` freed on stream `idx` (or by the host): every use must be
    /// ordered before this point, or seen complete by the crate (a deferred free runs once the
    /// events recorded after the uses on other streams are complete; a pool gives a chunk back
    /// once its blocks' frees ran). `bytes` is `None` for a raw free by address (the block's
    /// length is the device's to know). `pooled`: a driver pool's free, reused by the device
    /// ([`Reuse::Device`]).
    pub(crate) fn free(
        &self,
        idx: Option<u32>,
        ptr: u64,
        bytes: Option<usize>,
        raw: bool,
        pooled: bool,
    ) -> Option<Race> {
        let mut st = self.lock();
        Self::free_locked(&mut st, idx, ptr, bytes, raw, pooled)
    }

    /// Page-locked host memory at `ptr` (`malloc_host`, tracked as a raw allocation of the
    /// host) freed by the host: checked as `cuMemFree` is (every use by a stream ordered
    /// before what the host, or the crate, has seen complete), then its shadow is forgotten
    /// at once, under the same lock. Unlike device addresses, which the simulated memory
    /// hands out again only once its sweep comes round, the global allocator hands a freed
    /// host address out again at once, as pageable memory the detector does not track: a
    /// freed life kept there would report a copy from that pageable memory as a use after
    /// free (a false race). A use of the freed pinned block itself goes unreported here (the
    /// simulated memory refuses it when it runs), a missed race, never a false one.
    pub(crate) fn free_pinned(&self, ptr: u64) -> Option<Race> {
        let mut st = self.lock();
        // `pooled`: kept out of the bound of kept raw frees, since it is forgotten below.
        let race = Self::free_locked(&mut st, None, ptr, None, true, true);
        if let Some(block) = st.freed_raw_block(ptr) {
            st.remove(block);
        }
        race
    }

    /// [`free`](Self::free), under the detector's lock.
    fn free_locked(
        st: &mut State,
        idx: Option<u32>,
        ptr: u64,
        bytes: Option<usize>,
        raw: bool,
        pooled: bool,
    ) -> Option<Race> {
        let race = Self::free_unnoted(st, idx, ptr, bytes, raw, pooled);
        st.note(race)
    }

    /// [`free_locked`](Self::free_locked) without keeping or logging the race it finds.
    fn free_unnoted(
        st: &mut State,
        idx: Option<u32>,
        ptr: u64,
        bytes: Option<usize>,
        raw: bool,
        pooled: bool,
    ) -> Option<Race> {
        let (at, clock) = match idx {
            Some(idx) => {
                let at = Self::point(st, idx, "free");
                (at, st.streams[idx as usize].clock.clone())
            }
            None => (Point::host("free"), st.host.clone()),
        };
        let block = match bytes {
            Some(bytes) => match ptr.checked_add(bytes as u64) {
                Some(end) => (ptr, end),
                None => {
                    wraps("a free", ptr, bytes);
                    return None;
                }
            },
            None => st.raw_block(ptr)?,
        };
        if block.0 == block.1 {
            return None;
        }
        st.split(block.0);
        st.split(block.1);
        let mut found: Option<(Point, Life)> = None;
        let keys: Vec<u64> = st.segs.range(block.0..block.1).map(|(&k, _)| k).collect();
        let State {
            segs,
            seen_by_crate,
            ..
        } = &mut *st;
        for key in keys {
            let seg = segs.get_mut(&key).expect("listed above");
            let Some(i) = seg
                .stack
                .iter()
                .rposition(|l| l.block == block && l.raw == raw && l.freed.is_none())
            else {
                continue;
            };
            let mut uses = Vec::new();
            for life in &seg.stack[i..] {
                for u in &life.uses {
                    if found.is_none() && !u.at.before(&clock) && !u.at.before(seen_by_crate) {
                        found = Some((u.at, seg.stack[i].clone()));
                    }
                    uses.push(*u);
                }
            }
            let alloc = seg.stack[i].alloc;
            seg.stack.truncate(i);
            seg.stack.push(Life {
                block,
                raw,
                alloc,
                freed: Some(Freed { point: at, pooled }),
                uses,
            });
        }
        if raw {
            st.merge_raw(block, pooled);
        } else {
            st.merge_alike(block.0, block.1);
        }
        found.map(|(earlier, mut life)| {
            life.freed = Some(Freed {
                point: at,
                pooled: false,
            });
            Race {
                kind: RaceKind::FreedWhileInUse,
                ptr: DevicePtr(block.0),
                bytes: (block.1 - block.0) as usize,
                at: st.site(at),
                earlier: st.site(earlier),
                block: Some(st.block_info(&life)),
            }
        })
    }
}

impl Detector {
    /// The device reserved `[start, end)` for a virtual memory range (`cuMemAddressReserve`):
    /// nothing of what lived there before is left (the simulated memory hands addresses out
    /// again only once their frees have run, and a dropped reservation's blocks went with
    /// it), so the shadow of the range goes. Left in place, the raw blocks freed there made
    /// the first block a pool hands out in the range look like a reuse before their free on
    /// another stream (a review's finding, once the sweep of addresses had come round).
    pub(crate) fn reserved(&self, start: u64, end: u64) {
        self.lock().forget(start, end);
    }

    /// The device's reservation `[start, end)` went (`cuMemAddressFree`): what lived in it
    /// goes from the shadow. The simulated memory refuses every access to the range from now
    /// on (`InvalidAddress`, with the address), so nothing is left to check there; kept, the
    /// blocks a pool carved out of the range stayed as segments for the device's life (its
    /// sweep of addresses comes round to them only after 16 TiB), and a device that made and
    /// dropped expandable pools over and over grew the map without bound (a review's finding).
    pub(crate) fn unreserved(&self, start: u64, end: u64) {
        self.lock().forget(start, end);
    }

    /// A driver pool gave the freed block at `ptr` back to the device (past its release
    /// threshold, a trim, its destruction, or a device allocation short of memory): no longer
    /// the pool's, it is forgotten past the bound as any raw free is. It was kept for good
    /// before, so a pool that gives its blocks back (the default pool's threshold is 0) grew
    /// the map by a segment for each allocation (a review's finding).
    pub(crate) fn released_by_pool(&self, ptr: u64) {
        let mut st = self.lock();
        let Some(block) = st.freed_raw_block(ptr) else {
            return;
        };
        let mut was_pooled = false;
        for seg in st.segs.range_mut(block.0..block.1).map(|(_, seg)| seg) {
            let top = seg.stack.last_mut().filter(|l| l.raw && l.block == block);
            if let Some(Freed { pooled, .. }) = top.and_then(|l| l.freed.as_mut()) {
                was_pooled |= std::mem::replace(pooled, false);
            }
        }
        if was_pooled {
            st.forget_old_frees(block);
        }
    }

    /// The host unmapped `[start, end)` (granules of a reservation going back): as for a host
    /// free, every use of memory there must be ordered before what the host has seen finish,
    /// the user's code or the crate (an expandable pool unmaps free granules of streams it
    /// found idle).
    /// A review found unmapping invisible here, so an expandable pool's trim was checked only
    /// by the timing of an access to an unmapped granule.
    pub(crate) fn unmapped(&self, start: u64, end: u64) -> Option<Race> {
        let mut st = self.lock();
        let at = Point::host("unmap");
        let mut clock = st.host.clone();
        join(&mut clock, &st.seen_by_crate);
        let mut found: Option<(Point, Life)> = None;
        for key in st.overlapping(start, end) {
            for life in &st.segs[&key].stack {
                let late = (life.uses.iter())
                    .find(|u| u.start < end && start < u.end && !u.at.before(&clock));
                if let (None, Some(u)) = (&found, late) {
                    found = Some((u.at, life.clone()));
                }
            }
        }
        // The shadow stays: an access to the range before it is mapped and allocated again
        // is a use after free of what lived there.
        let race = found.map(|(earlier, life)| Race {
            kind: RaceKind::FreedWhileInUse,
            ptr: DevicePtr(start),
            bytes: (end - start) as usize,
            at: st.site(at),
            earlier: st.site(earlier),
            block: Some(st.block_info(&life)),
        });
        st.note(race)
    }
}

/// `into = max(into, from)`, componentwise; whether anything changed.
fn join(into: &mut Clock, from: &[Epoch]) -> bool {
    if into.len() < from.len() {
        into.resize(from.len(), 0);
    }
    let mut changed = false;
    for (a, &b) in into.iter_mut().zip(from) {
        if b > *a {
            *a = b;
            changed = true;
        }
    }
    changed
}

/// A block the detector is told of (a resource's `note_allocation` or `note_free`, the user's
/// own resources included) that wraps past the top of the address space: no memory lies
/// there, so it is an error of the caller's, logged and not tracked. Clipped at the top, as
/// it was, it shadowed everything above its start as one block.
#[cold]
fn wraps(what: &str, ptr: u64, bytes: usize) {
    tracing::error!(
        ptr,
        bytes,
        "the race detector was told of {what} that wraps past the top of the address space; \
         not tracked"
    );
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use super::*;

    /// An allocation or a free that wraps past the top of the address space is not tracked
    /// (logged at error level): before, it was clipped at the top and shadowed everything
    /// above its start as one block.
    #[test]
    fn a_block_that_wraps_past_the_top_is_not_tracked() {
        let detector = Detector::new(RaceDetection::Record);
        let s = detector.add_stream(StreamId::next());
        let ptr = u64::MAX - 255;
        assert!(detector
            .allocate(Some(s), ptr, 512, false, Reuse::Check)
            .is_none());
        assert!(
            detector.lock().segs.is_empty(),
            "a wrapping allocation was tracked"
        );
        assert!(detector
            .free(Some(s), ptr, Some(512), false, false)
            .is_none());
        assert!(
            detector.lock().segs.is_empty(),
            "a wrapping free was tracked"
        );
        assert!(detector.races().is_empty());
    }

    /// A stream's positions outlast 2^32 operations (a soak run of a few hours on one
    /// simulated stream): its clock once counted in `u32`, so the next operation overflowed,
    /// a panic under the detector's lock in a debug build, and in a release build a wrap to 0
    /// that took old uses for later ones (false races) and new ones for the host's (missed
    /// races). Here the stream starts just short of 2^32.
    #[test]
    fn a_stream_past_four_billion_operations_keeps_its_order() {
        let detector = Detector::new(RaceDetection::Record);
        let (a, b) = (
            detector.add_stream(StreamId::next()),
            detector.add_stream(StreamId::next()),
        );
        detector.lock().streams[a as usize].clock[a as usize] = u32::MAX.into();
        let (ptr, bytes) = (0x1000, 256);
        assert!(detector
            .allocate(None, ptr, bytes, true, Reuse::Check)
            .is_none());
        let write = [(ptr, bytes, MemoryAccess::Write)];
        let read = [(ptr, bytes, MemoryAccess::Read)];
        // `a` writes past 2^32; `b` reads after waiting for it: ordered.
        assert!(detector.access(a, "write", &write, false).is_none());
        let done = detector.record(a);
        detector.wait(b, &done);
        assert!(detector.access(b, "read", &read, false).is_none());
        // `a` writes again after `b`'s read, and `b` reads without waiting: a race, as ever.
        let read_done = detector.record(b);
        detector.wait(a, &read_done);
        assert!(detector.access(a, "write", &write, false).is_none());
        let race = detector.access(b, "read", &read, false);
        assert!(
            matches!(
                race,
                Some(Race {
                    kind: RaceKind::ReadAfterWrite,
                    ..
                })
            ),
            "{race:?}"
        );
        assert_eq!(detector.races().len(), 1);
    }

    /// A block allocated and freed over and over at random places in one raw allocation (as a
    /// pool suballocates a chunk) leaves the shadow a few segments, not one for every boundary
    /// ever used: before, an allocation walked every segment inside it, and a pool's
    /// `churn-1t` on the simulated device ran about 900 times slower with the detector on (a
    /// review's finding). Without merging, this loop leaves thousands.
    #[test]
    fn segments_do_not_pile_up_at_every_boundary_ever_used() {
        let detector = Detector::new(RaceDetection::Record);
        let s = detector.add_stream(StreamId::next());
        let (base, chunk) = (0x10_0000u64, 1u64 << 20);
        assert!(detector
            .allocate(None, base, chunk as usize, true, Reuse::Check)
            .is_none());
        let mut x = 42u64;
        let mut next = || {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            x >> 33
        };
        for _ in 0..10_000 {
            let start = base + next() % (chunk / 256) * 256;
            let bytes = (1 + next() % ((base + chunk - start) / 256)) * 256;
            let write = [(start, bytes as usize, MemoryAccess::Write)];
            assert!(detector
                .allocate(Some(s), start, bytes as usize, false, Reuse::Check)
                .is_none());
            assert!(detector.access(s, "write", &write, false).is_none());
            assert!(detector
                .free(Some(s), start, Some(bytes as usize), false, false)
                .is_none());
        }
        let segments = detector.lock().segs.len();
        assert!(segments < 64, "{segments} segments for one block at a time");
    }

    /// Forgetting an old raw free forgets only what is still that free's: once the device's
    /// sweep of addresses has come round (16 TiB of allocations, a few thousand of a few GiB),
    /// a new allocation may start inside a freed one, and forgetting the old block removed
    /// every segment of its range, the new block's too, whose uses then went unchecked.
    #[test]
    fn forgetting_an_old_free_keeps_a_block_allocated_inside_it_since() {
        let detector = Detector::new(RaceDetection::Record);
        let (a, b) = (
            detector.add_stream(StreamId::next()),
            detector.add_stream(StreamId::next()),
        );
        let (old, bytes) = (0x10_0000u64, 0x2000usize);
        assert!(detector
            .allocate(None, old, bytes, true, Reuse::Check)
            .is_none());
        assert!(detector.free(None, old, None, true, false).is_none());
        // Allocated since, at an address inside the freed block, and written on `a`.
        let new = old + 0x1000;
        assert!(detector
            .allocate(None, new, bytes, true, Reuse::Check)
            .is_none());
        let write = [(new, 0x100, MemoryAccess::Write)];
        assert!(detector.access(a, "write", &write, false).is_none());
        // Enough later frees that the old one is forgotten.
        for i in 0..KEPT_RAW_FREES as u64 {
            let ptr = 0x1_0000_0000 + i * 0x1000;
            assert!(detector
                .allocate(None, ptr, 0x100, true, Reuse::Check)
                .is_none());
            assert!(detector.free(None, ptr, None, true, false).is_none());
        }
        // `b` reads what `a` wrote, unordered: a race, as before the old free was forgotten.
        let read = [(new, 0x100, MemoryAccess::Read)];
        let race = detector.access(b, "read", &read, false);
        assert!(
            matches!(
                race,
                Some(Race {
                    kind: RaceKind::ReadAfterWrite,
                    ..
                })
            ),
            "{race:?}"
        );
    }

    /// A stream's clock (a word for every stream the device made before it) goes with the
    /// stream: nothing is queued on it once its handle is gone. It stayed, so a device that
    /// made `n` streams one after another held about `n * n / 2` words to its end (400 MB
    /// for 10,000 streams).
    #[test]
    fn a_dropped_streams_clock_goes_with_it() {
        use crate::device::Backend;
        let device = crate::Device::simulated(crate::SimConfig {
            race_detection: RaceDetection::Record,
            execution: crate::SimExecution::Inline,
            ..crate::SimConfig::default()
        });
        let ptr = device.malloc(1024).unwrap();
        let keep = device.create_stream().unwrap();
        for _ in 0..1000 {
            let s = device.create_stream().unwrap();
            s.wait(&keep.record().unwrap()).unwrap();
            s.declare_access(ptr, 1024, MemoryAccess::Write, "write")
                .unwrap();
            keep.wait(&s.record().unwrap()).unwrap();
        }
        // The streams kept their order: each wrote after the last, and `keep` after all.
        keep.declare_access(ptr, 1024, MemoryAccess::Write, "write")
            .unwrap();
        assert!(device.races().is_empty());
        let Backend::Sim(sim) = device.backend() else {
            unreachable!("a simulated device")
        };
        let words: usize = (sim.races.as_ref().unwrap().lock().streams.iter())
            .map(|s| s.clock.len())
            .sum();
        assert!(
            words < 10_000,
            "{words} words of clocks for two live streams"
        );
        // SAFETY: nothing is queued that uses it (the streams run inline).
        unsafe { device.free(ptr) }.unwrap();
    }

    /// A stream made and dropped per request (a server's pattern) leaves the clocks as wide
    /// as the streams alive at once, once the host has seen each one's work: its slot goes to
    /// the next stream. Every stream kept a slot, so every clock, snapshot and join grew by a
    /// word per stream ever made (1,002 wide here), and the server slowed down and grew.
    #[test]
    fn a_closed_streams_slot_goes_to_a_later_stream() {
        use crate::device::Backend;
        let device = crate::Device::simulated(crate::SimConfig {
            race_detection: RaceDetection::Record,
            execution: crate::SimExecution::Inline,
            ..crate::SimConfig::default()
        });
        let ptr = device.malloc(1024).unwrap();
        let keep = device.create_stream().unwrap();
        for _ in 0..1000 {
            let s = device.create_stream().unwrap();
            s.wait(&keep.record().unwrap()).unwrap();
            s.declare_access(ptr, 1024, MemoryAccess::Write, "write")
                .unwrap();
            keep.wait(&s.record().unwrap()).unwrap();
            s.synchronize_blocking().unwrap();
        }
        keep.declare_access(ptr, 1024, MemoryAccess::Write, "write")
            .unwrap();
        assert!(device.races().is_empty(), "{:?}", device.races());
        let Backend::Sim(sim) = device.backend() else {
            unreachable!("a simulated device")
        };
        let width = sim.races.as_ref().unwrap().clock_width();
        assert!(width <= 3, "clocks {width} wide for two live streams");
        // SAFETY: nothing is queued that uses it (the streams run inline).
        unsafe { device.free(ptr) }.unwrap();
    }

    /// What a reused slot must keep: a closed stream whose last write the host has not seen
    /// complete keeps its slot, so a new stream's unordered read of it is still a race (in the
    /// slot, the write would pass for the new stream's own past); a new stream in a slot
    /// whose old work the host saw is ordered after that work, and its own operations count
    /// on from the old stream's, so an older stream not ordered after them still races with
    /// them. Reports name the stream that queued each operation, and its position there.
    #[test]
    fn a_reused_slot_misses_no_race_and_makes_none() {
        let detector = Detector::new(RaceDetection::Record);
        let keep = detector.add_stream(StreamId::next());
        let (ptr, bytes) = (0x1000, 256);
        assert!(detector
            .allocate(None, ptr, bytes, true, Reuse::Check)
            .is_none());
        let write = [(ptr, bytes, MemoryAccess::Write)];
        let read = [(ptr, bytes, MemoryAccess::Read)];
        let seen_by_host = |idx| detector.host_join(&detector.record(idx));

        // The host saw `a` up to a record, not its write after it.
        let a_id = StreamId::next();
        let a = detector.add_stream(a_id);
        seen_by_host(a);
        assert!(detector.access(a, "write", &write, false).is_none());
        let a_done = detector.record(a);
        detector.close_stream(a);
        let b = detector.add_stream(StreamId::next());
        let race = detector.access(b, "read", &read, false).expect("a race");
        assert_eq!(race.kind, RaceKind::ReadAfterWrite);
        assert_eq!(
            (race.earlier.stream, race.earlier.position),
            (Some(a_id), 2)
        );
        detector.take_races();
        // The user's code awaits `a`'s last event: `a`'s slot goes to the next stream, which
        // is ordered after the write. (And sees `b`'s read done, which orders it before all
        // that follows.)
        detector.host_join(&a_done);
        seen_by_host(b);
        let c_id = StreamId::next();
        let c = detector.add_stream(c_id);
        assert_eq!(c, a, "the slot was not reused");
        assert!(detector.access(c, "read", &read, false).is_none());
        // `c` writes; `keep` reads without waiting for it: a race, as for any new stream.
        assert!(detector.access(c, "write", &write, false).is_none());
        let race = detector.access(keep, "read", &read, false).expect("a race");
        assert_eq!(race.kind, RaceKind::ReadAfterWrite);
        assert_eq!(
            (race.earlier.stream, race.earlier.position),
            (Some(c_id), 2)
        );
        detector.take_races();
        // Ordered by a wait: none.
        detector.wait(keep, &detector.record(c));
        assert!(detector.access(keep, "read", &read, false).is_none());
        assert!(detector.races().is_empty(), "{:?}", detector.races());

        // A block freed on `d`, which the host saw; `e` takes `d`'s slot and uses the block:
        // a use after free of `d`'s free (named as `d`'s, not `e`'s).
        let (block, len) = (0x1000, 128);
        let d_id = StreamId::next();
        let d = detector.add_stream(d_id);
        detector.wait(d, &detector.record(keep));
        assert!(detector
            .allocate(Some(d), block, len, false, Reuse::Check)
            .is_none());
        assert!(detector
            .free(Some(d), block, Some(len), false, false)
            .is_none());
        seen_by_host(d);
        detector.close_stream(d);
        let e_id = StreamId::next();
        let e = detector.add_stream(e_id);
        assert_eq!(e, d, "the slot was not reused");
        let race = (detector.access(e, "write", &[(block, len, MemoryAccess::Write)], false))
            .expect("a race");
        assert_eq!(race.kind, RaceKind::UseAfterFree);
        assert_eq!(
            (race.earlier.stream, race.earlier.position),
            (Some(d_id), 3)
        );
        assert_eq!(race.at.stream, Some(e_id));
        assert_eq!(race.at.position, 1);
    }

    /// Page-locked host memory is device memory to the detector: work on two streams racing
    /// on it is reported, as a host free not ordered after a stream's use of it is, and the
    /// same work ordered (a wait, a synchronize) is not. The detector did not know pinned
    /// memory, so none of these was reported.
    #[test]
    fn pinned_host_memory_is_checked_as_device_memory() {
        use crate::device::Backend;
        let device = crate::Device::simulated(crate::SimConfig {
            race_detection: RaceDetection::Record,
            execution: crate::SimExecution::Inline,
            ..crate::SimConfig::default()
        });
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let dev = device.malloc(4096).unwrap();
        let pinned = DevicePtr(device.malloc_host(4096).unwrap() as u64);
        // SAFETY: both ranges are live until the end (the streams run inline).
        unsafe { a.memset_d8(pinned, 1, 4096) }.unwrap();
        // Ordered after `a`'s write: no race.
        b.wait(&a.record().unwrap()).unwrap();
        // SAFETY: as above.
        unsafe { b.copy_dtod(dev, pinned, 4096) }.unwrap();
        assert!(device.races().is_empty(), "{:?}", device.races());
        // `a` writes again, not ordered after `b`'s read; `b` reads again, unordered.
        // SAFETY: as above.
        unsafe { a.memset_d8(pinned, 2, 4096) }.unwrap();
        let kinds = |races: Vec<Race>| races.iter().map(|r| r.kind).collect::<Vec<_>>();
        assert_eq!(kinds(device.take_races()), [RaceKind::WriteAfterRead]);
        // SAFETY: as above.
        unsafe { b.copy_dtod(dev, pinned, 4096) }.unwrap();
        assert_eq!(kinds(device.take_races()), [RaceKind::ReadAfterWrite]);
        // Freed by the host while `a`'s write is not known to be done: freed while in use.
        let other = device.malloc_host(4096).unwrap();
        // SAFETY: as above.
        unsafe { a.memset_d8(DevicePtr(other as u64), 3, 4096) }.unwrap();
        // SAFETY: the write ran (inline); the race is in stream order, which is the point.
        unsafe { device.free_host(other) }.unwrap();
        let races = device.take_races();
        assert_eq!(kinds(races.clone()), [RaceKind::FreedWhileInUse]);
        assert_eq!(races[0].ptr, DevicePtr(other as u64));
        // Freed once the host has seen the streams' work done: no race.
        a.synchronize_blocking().unwrap();
        b.synchronize_blocking().unwrap();
        // SAFETY: nothing queued uses it any more.
        unsafe { device.free_host(pinned.0 as *mut u8) }.unwrap();
        assert!(device.races().is_empty(), "{:?}", device.races());
        // The freed blocks are forgotten: the global allocator may hand their addresses out
        // again as pageable memory, which the detector does not track.
        let Backend::Sim(sim) = device.backend() else {
            unreachable!("a simulated device")
        };
        let st = sim.races.as_ref().unwrap().lock();
        for ptr in [pinned.0, other as u64] {
            assert!(st.overlapping(ptr, ptr + 4096).is_empty(), "{ptr:#x} kept");
        }
        drop(st);
        // SAFETY: nothing is queued that uses it.
        unsafe { device.free(dev) }.unwrap();
    }

    /// A driver pool that gives its freed blocks back to the device (release threshold 0, as
    /// the device's default pool) leaves their addresses forgotten past the bound of kept raw
    /// frees, as any raw free: the detector kept every block a pool had ever freed (taken for
    /// one the pool still keeps), so a long run of `cuMemAllocAsync`/`cuMemFreeAsync` grew
    /// its map by a segment for each allocation, without bound.
    #[test]
    fn blocks_a_pool_gave_back_are_forgotten_as_other_frees() {
        use crate::device::sim::{memory::SimPool, Op, SimConfig, SimDevice, SimExecution};
        let device = SimDevice::new(
            SimConfig {
                race_detection: RaceDetection::Record,
                execution: SimExecution::Inline,
                ..SimConfig::default()
            },
            None,
        );
        let stream = device.create_stream(StreamId::next()).unwrap();
        let pool = SimPool::create(&device.memory, 0, usize::MAX);
        for _ in 0..KEPT_RAW_FREES + 512 {
            let ptr = device.pool_alloc(&pool, 512, &stream).unwrap();
            pool.begin_free(ptr).unwrap();
            stream
                .push(Op::PoolFree {
                    pool: pool.clone(),
                    ptr,
                })
                .unwrap();
        }
        // The pool keeps nothing (threshold 0): every block went back to the device.
        assert_eq!(pool.counters(), (0, 0));
        let segments = device.races.as_ref().unwrap().lock().segs.len();
        assert!(
            segments <= KEPT_RAW_FREES,
            "{segments} segments kept for blocks the pool gave back"
        );
    }
}

impl PoolReleases for Detector {
    fn released_by_pool(&self, ptr: u64) {
        Detector::released_by_pool(self, ptr)
    }
}
