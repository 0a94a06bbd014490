//! [`HistoryAdaptor`]: the last N allocation events in memory (RMM's CSV fields, with an
//! optional backtrace each), and the live allocations that make snapshots exact.

use std::backtrace::Backtrace;
use std::collections::VecDeque;
use std::fmt;
use std::io::{self, Write};
use std::sync::Arc as StdArc;

use rustc_hash::FxHashMap;

use super::logging::{thread_number, TimeOfDay, HEADER};
use crate::device::{Device, DevicePtr};
use crate::error::Result;
use crate::resource::snapshot::{now_us, Block, BlockState, Snapshot};
use crate::resource::{aligned_size, MemoryKind, MemoryResource, MemoryWaiters};
use crate::stream::Stream;
use crate::sync::{AtomicBool, Mutex, Ordering};

/// What a [`HistoryAdaptor`] records.
#[derive(Debug, Clone)]
pub struct HistoryOptions {
    /// How many events it keeps: the oldest go first. 0 keeps none (live tracking alone).
    pub capacity: usize,
    /// Capture a backtrace at each allocation (tens of microseconds each; resolved only when
    /// the history or a snapshot is read).
    pub backtraces: bool,
    /// Keep every live allocation made while recording (address, size, stream, time, and
    /// backtrace), so that [`memory_snapshot`](MemoryResource::memory_snapshot) through the
    /// adaptor shows each allocation as its own block with its stream and time. One hash map
    /// insert per allocation and one removal per free.
    pub track_live: bool,
}

impl Default for HistoryOptions {
    /// 100,000 events, no backtraces, live tracking on.
    fn default() -> Self {
        Self {
            capacity: 100_000,
            backtraces: false,
            track_live: true,
        }
    }
}

/// What happened, in RMM's words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
pub enum Action {
    /// An allocation that succeeded.
    Allocate,
    /// A free.
    Free,
    /// An allocation that failed (`ptr` is 0).
    AllocateFailure,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Action::Allocate => "allocate",
            Action::Free => "free",
            Action::AllocateFailure => "allocate failure",
        })
    }
}

/// One recorded event: the fields of a line of RMM's log, with the time in full.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct HistoryEvent {
    /// A number for the calling thread (as the [`LoggingAdaptor`](super::LoggingAdaptor)
    /// writes it).
    pub thread: u64,
    /// When, in microseconds since the Unix epoch.
    pub time_us: u64,
    /// What.
    pub action: Action,
    /// The address (0 for a failure).
    pub ptr: u64,
    /// Bytes, as the caller gave them.
    pub size: u64,
    /// The stream's id ([`StreamId::get`](crate::StreamId::get)).
    pub stream: u64,
    /// The backtrace of an allocation, when captured.
    #[cfg_attr(feature = "serde", serde(default))]
    pub backtrace: Option<String>,
}

/// A copy of the recorded events, oldest first: serializable (JSON with the `serde` feature),
/// or written as RMM's CSV by [`write_csv`](Self::write_csv).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct History {
    /// How many events the recorder keeps.
    pub capacity: usize,
    /// Events recorded and then dropped to make room (the oldest).
    pub dropped: u64,
    /// The events kept, oldest first.
    pub events: Vec<HistoryEvent>,
}

impl History {
    /// Writes the events as RMM's CSV log (`Thread,Time,Action,Pointer,Size,Stream`, what the
    /// [`LoggingAdaptor`](super::LoggingAdaptor) writes), without backtraces: for
    /// `streamalloc-replay`, `streamalloc-picture` and RMM's tools.
    pub fn write_csv(&self, mut out: impl Write) -> io::Result<()> {
        writeln!(out, "{HEADER}")?;
        for e in &self.events {
            writeln!(
                out,
                "{},{},{},{:#x},{},{}",
                e.thread,
                TimeOfDay::from_unix_us(e.time_us),
                e.action,
                e.ptr,
                e.size,
                e.stream
            )?;
        }
        Ok(())
    }
}

// ===== the recorder =====

#[derive(Clone)]
struct Recorded {
    /// Its number among the events pushed (from 0), so that a free the upstream refused can
    /// be taken out of the ring again ([`Recorder::free_refused`]).
    seq: u64,
    thread: u64,
    time_us: u64,
    action: Action,
    ptr: u64,
    size: u64,
    stream: u64,
    backtrace: Option<StdArc<Backtrace>>,
}

/// A live allocation.
#[derive(Clone)]
pub(crate) struct Live {
    size: u64,
    stream: u64,
    time_us: u64,
    backtrace: Option<StdArc<Backtrace>>,
}

#[derive(Default)]
struct State {
    ring: VecDeque<Recorded>,
    dropped: u64,
    live: FxHashMap<u64, Live>,
    /// The `seq` of the next event pushed.
    next_seq: u64,
}

/// What [`Recorder::freeing`] did, for [`Recorder::free_refused`] to undo if the upstream
/// refuses the free.
pub(crate) struct Freeing {
    /// The live allocation forgotten, if it was live.
    live: Option<Live>,
    /// The `seq` of the `Free` event pushed, if one was.
    seq: Option<u64>,
}

/// The adaptor's shared state: a switch and, behind one lock, the ring of events and the live
/// allocations. Crate-private so that the loom model (`loom-tests/history.rs`) drives it.
pub(crate) struct Recorder {
    on: AtomicBool,
    capacity: usize,
    backtraces: bool,
    track_live: bool,
    /// The ring and the live table. Taken once per recorded event, never across an upstream
    /// call.
    state: Mutex<State>,
}

impl Recorder {
    pub(crate) fn new(options: &HistoryOptions) -> Self {
        Self {
            on: AtomicBool::new(false),
            capacity: options.capacity,
            backtraces: options.backtraces,
            track_live: options.track_live,
            state: Mutex::new(State::default()),
        }
    }

    /// One relaxed load: all that an adaptor that is off adds to an allocation.
    #[inline]
    pub(crate) fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    pub(crate) fn start(&self) {
        self.on.store(true, Ordering::Relaxed);
    }

    /// Stops recording and forgets the live allocations: their frees would not be seen, so
    /// the table would go stale (and a snapshot would show an allocation that is gone).
    pub(crate) fn stop(&self) {
        let mut state = self.state.lock();
        self.on.store(false, Ordering::Relaxed);
        state.live.clear();
    }

    fn backtrace(&self) -> Option<StdArc<Backtrace>> {
        self.backtraces
            .then(|| StdArc::new(Backtrace::force_capture()))
    }

    /// Pushes `event` (its `seq` is set here) and returns its `seq`; `None` if nothing is kept.
    fn push(&self, state: &mut State, mut event: Recorded) -> Option<u64> {
        if self.capacity == 0 {
            return None;
        }
        if state.ring.len() == self.capacity {
            state.ring.pop_front();
            state.dropped += 1;
        }
        let seq = state.next_seq;
        state.next_seq += 1;
        event.seq = seq;
        state.ring.push_back(event);
        Some(seq)
    }

    /// An allocation of `size` bytes at `ptr` on `stream` (0: it failed), made after the
    /// upstream returned.
    pub(crate) fn allocated(&self, ptr: u64, size: u64, stream: u64) {
        let backtrace = self.backtrace();
        let time_us = now_us();
        let mut state = self.state.lock();
        // Checked again under the lock: a `stop` in between cleared the table, and an entry
        // added after it would go stale.
        if !self.is_on() {
            return;
        }
        if ptr != 0 && self.track_live {
            let live = Live {
                size,
                stream,
                time_us,
                backtrace: backtrace.clone(),
            };
            state.live.insert(ptr, live);
        }
        let action = if ptr == 0 && size != 0 {
            Action::AllocateFailure
        } else {
            Action::Allocate
        };
        let event = Recorded {
            seq: 0,
            thread: thread_number(),
            time_us,
            action,
            ptr,
            size,
            stream,
            backtrace,
        };
        self.push(&mut state, event);
    }

    /// A free, recorded (and the allocation forgotten) *before* it is passed upstream: once
    /// the upstream has the memory, another thread may get the same address and record it,
    /// and forgetting after that would forget the new allocation. Returns what was done, for
    /// [`free_refused`](Self::free_refused) if the upstream refuses the free.
    pub(crate) fn freeing(&self, ptr: u64, size: u64, stream: u64) -> Freeing {
        let time_us = now_us();
        let mut state = self.state.lock();
        let live = state.live.remove(&ptr);
        let mut seq = None;
        if self.is_on() {
            let event = Recorded {
                seq: 0,
                thread: thread_number(),
                time_us,
                action: Action::Free,
                ptr,
                size,
                stream,
                backtrace: None,
            };
            seq = self.push(&mut state, event);
        }
        Freeing { live, seq }
    }

    /// Undoes [`freeing`](Self::freeing) for a free the upstream refused: nothing was freed,
    /// so the allocation is put back in the live table, and the `Free` event is taken out of
    /// the ring (if it is still there): a history showing a free that did not happen would
    /// free the allocation twice when replayed (a review found it kept).
    pub(crate) fn free_refused(&self, ptr: u64, freeing: Freeing) {
        let mut state = self.state.lock();
        if let Some(seq) = freeing.seq {
            // Newest first: the event is recent, and the ring holds `seq`s in order.
            if let Some(at) = state.ring.iter().rposition(|e| e.seq == seq) {
                state.ring.remove(at);
            }
        }
        if let Some(live) = freeing.live {
            if self.is_on() {
                state.live.entry(ptr).or_insert(live);
            }
        }
    }

    pub(crate) fn history(&self) -> History {
        let (dropped, recorded): (u64, Vec<Recorded>) = {
            let state = self.state.lock();
            (state.dropped, state.ring.iter().cloned().collect())
        };
        // Backtraces are resolved here, outside the lock.
        History {
            capacity: self.capacity,
            dropped,
            events: recorded
                .into_iter()
                .map(|e| HistoryEvent {
                    thread: e.thread,
                    time_us: e.time_us,
                    action: e.action,
                    ptr: e.ptr,
                    size: e.size,
                    stream: e.stream,
                    backtrace: e.backtrace.map(|b| b.to_string()),
                })
                .collect(),
        }
    }

    pub(crate) fn clear(&self) {
        let mut state = self.state.lock();
        state.ring.clear();
        state.dropped = 0;
    }

    /// The live allocations as snapshot blocks (size rounded up to 256 bytes).
    pub(crate) fn live_blocks(&self) -> Vec<Block> {
        let live: Vec<(u64, Live)> = self
            .state
            .lock()
            .live
            .iter()
            .map(|(&p, l)| (p, l.clone()))
            .collect();
        live.into_iter()
            .map(|(addr, l)| Block {
                addr,
                size: aligned_size(l.size as usize).map_or(l.size, |s| s as u64),
                state: BlockState::InUse,
                stream: Some(l.stream),
                requested: Some(l.size),
                allocated_at_us: Some(l.time_us),
                backtrace: l.backtrace.map(|b| b.to_string()),
            })
            .collect()
    }

    /// How many live allocations the table holds (for tests and the loom model).
    pub(crate) fn live_count(&self) -> usize {
        self.state.lock().live.len()
    }

    pub(crate) fn tracks_live(&self) -> bool {
        self.track_live
    }

    pub(crate) fn len(&self) -> usize {
        self.state.lock().ring.len()
    }
}

// ===== the adaptor =====

/// Keeps the last [`capacity`](HistoryOptions::capacity) allocation events in memory (RMM's
/// CSV fields: thread, time, action, pointer, size, stream; and a backtrace per allocation if
/// asked), and, with [`track_live`](HistoryOptions::track_live), every live allocation, so that
/// a [`memory_snapshot`](MemoryResource::memory_snapshot) through it shows each allocation
/// with its stream, its time and its backtrace.
///
/// **Off until [`start`](Self::start)**: while off, an operation costs one relaxed atomic load
/// more than the upstream's, nothing else. So a server can keep it in its stack and switch it
/// on when memory looks wrong; [`history`](Self::history) then gives the events (as JSON with
/// the `serde` feature, or as RMM's CSV with [`History::write_csv`]), and `streamalloc-picture`
/// draws either.
///
/// While on, each event takes one lock (the ring and the live table) around a few hash-map and
/// queue operations, never across the upstream call. A free is recorded before it is passed
/// upstream, as the [`LoggingAdaptor`](super::LoggingAdaptor) does.
///
/// ```
/// use streamalloc::resource::adaptor::{HistoryAdaptor, HistoryOptions};
/// use streamalloc::resource::cuda::CudaResource;
/// use streamalloc::resource::pool::{PoolOptions, PoolResource};
/// use streamalloc::{Device, MemoryResource, SimConfig};
///
/// let device = Device::simulated(SimConfig::default());
/// let pool = PoolResource::new(CudaResource::new(&device), PoolOptions { initial: 1 << 20, ..Default::default() })?;
/// let mr = HistoryAdaptor::new(pool, HistoryOptions::default());
/// mr.start();
/// let stream = device.create_stream()?;
/// let ptr = mr.allocate(1000, &stream)?;
/// let snapshot = mr.memory_snapshot().unwrap();
/// assert!(snapshot.blocks().any(|b| b.requested == Some(1000) && b.stream == Some(stream.id().get())));
/// // SAFETY: allocated above, unused, freed once.
/// unsafe { mr.deallocate(ptr, 1000, &stream)? };
/// assert_eq!(mr.history().events.len(), 2);
/// # Ok::<(), streamalloc::Error>(())
/// ```
pub struct HistoryAdaptor<U: MemoryResource> {
    upstream: U,
    recorder: Recorder,
}

impl<U: MemoryResource> fmt::Debug for HistoryAdaptor<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HistoryAdaptor")
            .field("upstream", &self.upstream)
            .field("recording", &self.recorder.is_on())
            .field("capacity", &self.recorder.capacity)
            .field("events", &self.recorder.len())
            .finish()
    }
}

impl<U: MemoryResource> HistoryAdaptor<U> {
    /// An adaptor over `upstream` that records nothing until [`start`](Self::start).
    pub fn new(upstream: U, options: HistoryOptions) -> Self {
        Self {
            recorder: Recorder::new(&options),
            upstream,
        }
    }

    /// The upstream resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }

    /// Starts recording (events, and live allocations if tracked). Allocations made before
    /// are not known: their frees are recorded, and their blocks show as untracked in use.
    pub fn start(&self) {
        self.recorder.start();
    }

    /// Stops recording; the events recorded stay, the table of live allocations is cleared.
    pub fn stop(&self) {
        self.recorder.stop();
    }

    /// Whether it records.
    pub fn is_recording(&self) -> bool {
        self.recorder.is_on()
    }

    /// A copy of the events kept, oldest first (backtraces resolved to text: slow the first
    /// time).
    pub fn history(&self) -> History {
        self.recorder.history()
    }

    /// Forgets the events kept (not the live allocations).
    pub fn clear(&self) {
        self.recorder.clear();
    }

    /// How many live allocations it tracks now.
    pub fn live_allocations(&self) -> usize {
        self.recorder.live_count()
    }
}

// SAFETY: every allocation is the upstream's (itself a `MemoryResource`), passed on unchanged;
// the adaptor only records.
unsafe impl<U: MemoryResource> MemoryResource for HistoryAdaptor<U> {
    fn device(&self) -> &Device {
        self.upstream.device()
    }

    fn memory_kind(&self) -> MemoryKind {
        self.upstream.memory_kind()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        let result = self.upstream.allocate(bytes, stream);
        if self.recorder.is_on() && bytes != 0 {
            let ptr = result.as_ref().map_or(0, |p| p.0);
            self.recorder
                .allocated(ptr, bytes as u64, stream.id().get());
        }
        result
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        if planted!(FORGET_AFTER_UPSTREAM) {
            // The planted bug: the memory goes back upstream before its entry is forgotten.
            // SAFETY: as below.
            unsafe { self.upstream.deallocate(ptr, bytes, stream) }?;
            if self.recorder.is_on() && bytes != 0 {
                self.recorder
                    .freeing(ptr.0, bytes as u64, stream.id().get());
            }
            return Ok(());
        }
        // Only while on: when off, the live table is empty.
        let freeing = if self.recorder.is_on() && bytes != 0 {
            Some(
                self.recorder
                    .freeing(ptr.0, bytes as u64, stream.id().get()),
            )
        } else {
            None
        };
        // SAFETY: the caller's contract, passed on.
        let result = unsafe { self.upstream.deallocate(ptr, bytes, stream) };
        if let (Err(_), Some(freeing)) = (&result, freeing) {
            // Nothing was freed: neither the live table nor the history may say it was.
            self.recorder.free_refused(ptr.0, freeing);
        }
        result
    }

    fn memory_waiters(&self) -> Option<&MemoryWaiters> {
        self.upstream.memory_waiters()
    }

    fn footprint(&self, bytes: usize) -> Result<usize> {
        self.upstream.footprint(bytes)
    }

    fn check_set(&self, sizes: &[usize]) -> Result<()> {
        self.upstream.check_set(sizes)
    }

    /// The upstream's snapshot; while recording with live tracking, its in-use blocks are
    /// split into the allocations made through this adaptor, each with its size asked for,
    /// stream, time and backtrace.
    fn memory_snapshot(&self) -> Option<Snapshot> {
        let mut snapshot = self.upstream.memory_snapshot()?;
        snapshot.resource = format!("history({})", snapshot.resource);
        if self.recorder.is_on() && self.recorder.tracks_live() {
            let mut live = self.recorder.live_blocks();
            snapshot.merge_live(&mut live);
            snapshot.notes.retain(|n| !n.contains("no live tracking"));
            snapshot.notes.push(
                "in-use blocks that no allocation through the history adaptor explains were allocated before it started, or by-passed it".into(),
            );
        }
        Some(snapshot)
    }
}

/// A bug the loom model plants (`loom-tests/adaptor_tables.rs`), constant off otherwise; read
/// through `planted!`.
#[cfg(streamalloc_loom)]
pub(crate) mod planted {
    /// `deallocate` gives the memory back upstream before the recorder forgets the live
    /// allocation: another thread can get the same address meanwhile, and its entry is the one
    /// forgotten.
    pub(crate) static FORGET_AFTER_UPSTREAM: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);
}
