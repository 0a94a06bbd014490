//! Models of the pool's shared free list (src/resource/stream_ordered/, `StreamHeap`): threads
//! allocate and free on two streams, and every block must be handed out once at a time, never
//! lost, and used on its new stream only after its free on the old one.
//!
//! The engine is generic over [`EngineStream`]; here it runs on [`FakeStream`], whose
//! `order_before` (an event recorded on one stream, a wait for it on another) writes the edge
//! into a fake GPU: a vector clock per stream ([`Gpu`]). A block freed on stream D at position
//! p of D may be used on stream S only once S's clock has seen p of D (S == D: stream order),
//! or once the host has synchronized D past p. The models check that at every hand-out, and
//! that no block is held twice at once.
//!
//! The bookkeeping (`Gpu`) sits behind a **std** mutex, which loom does not see: loom runs one
//! thread at a time and the bookkeeping makes no loom call while it holds the lock, so it never
//! blocks, adds no scheduling points and no happens-before edges that could hide a bug of the
//! engine. Everything the engine shares is loom's (`crate::sync`).
//!
//! Fresh memory (never used by a stream) needs no ordering. The upstream cannot grow
//! ([`NoGrow`]; [`GrowOnce`] in `grow_vs_same_stream_reuse`), so a take that finds nothing
//! grows or runs out of memory. Each test also checks that some of its executions made an
//! ordering (and grew) and ran out of memory ([`check_paths`]), so that no check is vacuous.
//! The planted bugs are switches in the engine (`stream_ordered::planted`, loom builds only).
//!
//! A stream asked whether it is idle (the engine's opportunistic reuse) answers as the model
//! sets [`Gpu::idle`]: busy (the default, so the engine orders), or idle, which is the host
//! seeing everything queued on it so far finish. A stream whose work (and what it was ordered
//! after) the host has seen finish answers idle whatever the setting. Streams count what is queued on them
//! (`FakeInner::activity`), so a stream seen idle with nothing queued since is taken as still idle
//! without a question (*quiet*); the host then has seen nothing more, so the check at each
//! hand-out catches a stream wrongly taken as quiet.
//!
//! With the small-block cache on ([`with_cached_chunk`]), a free on a stream keeps its block
//! aside for that stream's next request, and another stream's request sends it to the free
//! blocks (and orders after its free) instead: `cached_reuse_vs_same_stream_reuse`, and its
//! planted bug, a cache that serves any stream.
//!
//! Every request is one block. Not modelled here: trimming (`take_whole_chunks`, see
//! `frees_and_regrowth`). A failing `order_before` (its error path puts the block back) only
//! as a graph capture's refusal (`capture.rs`).

use std::collections::HashMap;

use loom::thread;

use super::{check_paths, must_fail, Seen, Shared};
use crate::error::{Error, Result};
use crate::resource::stream_ordered::{EngineStream, Grow, StreamHeap, Users};
use crate::sync::{Arc, AtomicU64, Ordering::SeqCst};

// The models and their `#[test]`s.
mod capture;
mod reserve;
mod reuse;

// The paths of the policy an execution can take (see `check_paths`).
const WAIT: &str = "cross-stream wait";
const IDLE: &str = "idle freeing stream: no wait";
const QUIET: &str = "quiet freeing stream (seen idle, nothing queued since): no question";
const MOVING: &str = "statistics read with the reserved piece in use";
const GROW: &str = "grow";
const CACHED: &str = "a block reused from the small-block cache";
const OUT_OF_MEMORY: &str = "out of memory";
const ALL_BUT_GROW: [&str; 2] = [WAIT, OUT_OF_MEMORY];
const ALL: [&str; 3] = [WAIT, GROW, OUT_OF_MEMORY];
const IDLE_AND_OUT_OF_MEMORY: [&str; 2] = [IDLE, OUT_OF_MEMORY];
const IDLE_QUIET_AND_OUT_OF_MEMORY: [&str; 3] = [IDLE, QUIET, OUT_OF_MEMORY];

/// Every request is one block: addresses stay block-aligned through splits and merges, so a
/// block is named by its address.
pub(super) const BLOCK: u64 = 256;
pub(super) const BASE: u64 = 0x10000;

// ---------------------------------------------------------------------------------------------
// The fake GPU and its streams.
// ---------------------------------------------------------------------------------------------

/// What the fake GPU has been asked to order.
pub(super) struct Gpu {
    /// `clocks[s][t]`: how many operations of stream `t` come before the next one queued on
    /// stream `s`; `clocks[s][s]` counts `s`'s own.
    clocks: Vec<Vec<u64>>,
    /// Each block's last free: `(stream, position)`: ordered after the first `position`
    /// operations of `stream`, its last use among them.
    freed: HashMap<u64, (usize, u64)>,
    /// Who holds each block now.
    held: HashMap<u64, &'static str>,
    /// `synced[d]`: how many operations of stream `d` the host has seen finish.
    synced: Vec<u64>,
    /// What a stream says when asked whether it is idle (`cuStreamQuery`): `true`, everything
    /// queued on it so far has finished (the host has seen it: `synced`); `false`, busy.
    pub(super) idle: bool,
    /// How many times a stream was asked whether it is idle.
    queries: u64,
}

impl Gpu {
    fn new(streams: usize) -> Self {
        Gpu {
            clocks: vec![vec![0; streams]; streams],
            freed: HashMap::new(),
            held: HashMap::new(),
            synced: vec![0; streams],
            idle: false,
            queries: 0,
        }
    }

    /// An event recorded on `from` now, waited on by `to`.
    pub(super) fn order(&mut self, from: usize, to: usize) {
        let seen = self.clocks[from].clone();
        for (mine, theirs) in self.clocks[to].iter_mut().zip(seen) {
            *mine = (*mine).max(theirs);
        }
    }

    /// `who` got `addr` for use on stream `s`, and queues a use of it there.
    pub(super) fn took(&mut self, who: &'static str, s: usize, addr: u64) {
        if let Some(other) = self.held.insert(addr, who) {
            panic!("block {addr:#x} handed out twice: to {who} while {other} holds it");
        }
        if let Some(&(d, p)) = self.freed.get(&addr) {
            let seen = self.clocks[s][d].max(self.synced[d]);
            assert!(
                seen >= p,
                "block {addr:#x}, freed on stream {d} after its operation {p}, handed to stream \
                 {s}, which is ordered after only {seen} of them: a reuse not ordered \
                 behind the free"
            );
        }
        self.clocks[s][s] += 1;
    }

    /// A use of memory queued on stream `s` (a kernel, say) that is not a hand-out.
    pub(super) fn queue(&mut self, s: usize) {
        self.clocks[s][s] += 1;
    }

    /// The host waits for everything queued on `d` so far, and so for everything `d` was
    /// ordered after (its clock).
    pub(super) fn synchronize(&mut self, d: usize) {
        for (synced, &seen) in self.synced.iter_mut().zip(&self.clocks[d]) {
            *synced = (*synced).max(seen);
        }
    }

    /// Whether the host has seen everything queued on `d` finish, and everything `d` was
    /// ordered after: `d` is idle, whatever [`idle`](Self::idle) says.
    fn drained(&self, d: usize) -> bool {
        self.clocks[d]
            .iter()
            .zip(&self.synced)
            .all(|(&c, &s)| c <= s)
    }

    /// `addr` is freed on stream `s`: after every operation queued on `s` so far.
    pub(super) fn freeing(&mut self, s: usize, addr: u64) {
        self.held
            .remove(&addr)
            .unwrap_or_else(|| panic!("block {addr:#x} freed but not held"));
        self.freed.insert(addr, (s, self.clocks[s][s]));
    }
}

pub(super) type Book = Shared<std::sync::Mutex<Gpu>>;

pub(super) fn book(gpu: &Book) -> std::sync::MutexGuard<'_, Gpu> {
    gpu.lock().expect("bookkeeping lock poisoned")
}

/// Planted in the fake stream, not the engine: a use is counted as activity before it is
/// queued (what `Stream::queue_handle` would do if it counted when it lends the handle rather
/// than when the operation is in): an idle answer between the two looks as if it covered it.
pub(super) static COUNT_BEFORE_QUEUE: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

pub(super) struct FakeInner {
    index: usize,
    pub(super) gpu: Book,
    /// Operations queued on the stream (uses, hand-outs, events recorded and waits), what
    /// `Stream::activity` counts: a stream seen idle whose count has not moved since is still
    /// idle (the engine's *quiet* streams). Loom's atomic, not the bookkeeping's: loom must see
    /// a use queued and the engine's read of the count as operations that race, or it takes
    /// their two orders for one and explores only one of them.
    activity: AtomicU64,
    /// Uses that reached the fake GPU (see `FakeStream::reach_the_gpu`).
    uses: AtomicU64,
    /// Under a (pretend) graph capture: `order_before` through the stream is refused, as a
    /// real stream's (`capture.rs`). Set before the threads start (a std flag).
    pub(super) capturing: std::sync::atomic::AtomicBool,
    /// Orderings refused for the capture.
    pub(super) refused: std::sync::atomic::AtomicU64,
}

/// A handle of a fake stream; clones are the same stream, as `Stream`'s.
#[derive(Clone)]
pub(super) struct FakeStream {
    pub(super) inner: Arc<FakeInner>,
    /// Its users, counted as a real stream's are.
    users: Users,
}

impl FakeStream {
    pub(super) fn index(&self) -> usize {
        self.inner.index
    }

    /// A use of memory queued on the stream (a kernel, say) that is not a hand-out: queued,
    /// then counted, as `Stream`'s `Queuing` guard counts it when it goes.
    pub(super) fn queue(&self) {
        if COUNT_BEFORE_QUEUE.load(std::sync::atomic::Ordering::Relaxed) {
            self.queued();
            self.reach_the_gpu();
            return;
        }
        self.reach_the_gpu();
        self.queued();
    }

    /// The use reaches the fake GPU. Marked by a loom atomic that `is_idle` reads, so that loom
    /// sees the question and the use race (the bookkeeping's lock is invisible to it), and
    /// explores a question answered between the count and the use.
    fn reach_the_gpu(&self) {
        self.inner.uses.fetch_add(1, SeqCst);
        book(&self.inner.gpu).queue(self.index());
    }

    /// Counts an operation queued on the stream.
    fn queued(&self) {
        self.inner.activity.fetch_add(1, SeqCst);
    }
}

impl EngineStream for FakeStream {
    type Name = u64;

    fn uid(&self) -> u64 {
        self.inner.index as u64 + 1
    }

    fn name(&self) -> u64 {
        self.uid()
    }

    fn users(&self) -> usize {
        self.users.get()
    }

    fn set_kept(&self, kept: bool) {
        self.users.set_kept(kept)
    }

    fn order_before(&self, later: &Self) -> Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        if self.inner.capturing.load(Relaxed) || later.inner.capturing.load(Relaxed) {
            self.inner.refused.fetch_add(1, Relaxed);
            return Err(Error::StreamCapturing {
                operation: "an ordering",
            });
        }
        book(&self.inner.gpu).order(self.index(), later.index());
        self.queued();
        later.queued();
        Ok(())
    }

    fn is_idle(&self) -> bool {
        // The question races every use reaching the GPU (`reach_the_gpu`).
        self.inner.uses.load(SeqCst);
        let mut gpu = book(&self.inner.gpu);
        gpu.queries += 1;
        let idle = gpu.idle || gpu.drained(self.index());
        if idle {
            gpu.synchronize(self.index());
        }
        idle
    }

    fn activity(&self) -> Option<u64> {
        Some(self.inner.activity.load(SeqCst))
    }
}

pub(super) fn streams(n: usize) -> Vec<FakeStream> {
    let gpu: Book = std::sync::Arc::new(std::sync::Mutex::new(Gpu::new(n)));
    (0..n)
        .map(|index| FakeStream {
            inner: Arc::new(FakeInner {
                index,
                gpu: gpu.clone(),
                activity: AtomicU64::new(0),
                uses: AtomicU64::new(0),
                capturing: std::sync::atomic::AtomicBool::new(false),
                refused: std::sync::atomic::AtomicU64::new(0),
            }),
            users: Users::new(),
        })
        .collect()
}

pub(super) fn out_of_memory(min: u64) -> Error {
    Error::OutOfMemory {
        requested: min as usize,
        available: 0,
        maximum: 0,
    }
}

/// An upstream that cannot grow: the pool at its maximum.
struct NoGrow;

impl Grow<FakeStream> for NoGrow {
    fn grow(&self, min: u64, _: &FakeStream) -> Result<(u64, u64)> {
        Err(out_of_memory(min))
    }
}

/// Where the chunk of [`GrowOnce`] starts (apart from the first chunk).
const GROWN: u64 = BASE + 0x1000;

/// An upstream that gives one chunk of one block, then no more. (A std flag: the upstream's
/// own synchronisation is not what these models check.)
struct GrowOnce(std::sync::atomic::AtomicBool);

impl Grow<FakeStream> for GrowOnce {
    fn grow(&self, min: u64, _: &FakeStream) -> Result<(u64, u64)> {
        if min <= BLOCK && !self.0.swap(true, std::sync::atomic::Ordering::Relaxed) {
            Ok((GROWN, BLOCK))
        } else {
            Err(out_of_memory(min))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// What the models drive: the crate's engine.
// ---------------------------------------------------------------------------------------------

pub(super) type Engine = StreamHeap<FakeStream>;

/// An engine with one chunk of `blocks` blocks, all fresh (as a pool's initial chunk).
fn with_chunk(blocks: u64) -> Engine {
    let engine = StreamHeap::new();
    engine.add_chunk(BASE, blocks * BLOCK);
    engine.give_fresh(BASE, blocks * BLOCK);
    engine
}

/// [`with_chunk`] with a small-block cache (`blocks.rs`'s `Cache`) that holds every block.
fn with_cached_chunk(blocks: u64) -> Engine {
    let engine = with_chunk(blocks);
    engine.set_cache(blocks * BLOCK);
    engine
}

/// Allocates a block for `who` on `stream`: `None` if the engine is out of memory (the only
/// error it may give here). The upstream cannot grow.
fn alloc(engine: &Engine, stream: &FakeStream, who: &'static str, seen: &Seen) -> Option<u64> {
    alloc_from(engine, stream, who, seen, &NoGrow)
}

fn alloc_from(
    engine: &Engine,
    stream: &FakeStream,
    who: &'static str,
    seen: &Seen,
    upstream: &impl Grow<FakeStream>,
) -> Option<u64> {
    match engine.take(BLOCK, stream, upstream) {
        Ok(addr) => {
            book(&stream.inner.gpu).took(who, stream.index(), addr);
            stream.queued();
            Some(addr)
        }
        Err(e) => {
            assert!(e.is_out_of_memory(), "unexpected error: {e}");
            seen.note(OUT_OF_MEMORY, true);
            None
        }
    }
}

/// Frees `addr` on `stream`, in stream order.
fn free(engine: &Engine, stream: &FakeStream, addr: u64) {
    book(&stream.inner.gpu).freeing(stream.index(), addr);
    assert!(
        engine.give(addr, BLOCK, stream),
        "the engine refused the free of {addr:#x}"
    );
}

/// After every thread is done and every block was given back: the free list is sound and
/// holds all the memory. Notes which paths the execution took.
fn all_back(engine: &Engine, blocks: u64, gpu: &Book, seen: &Seen) {
    engine.check().expect("free-list invariants");
    let stats = engine.stats();
    assert_eq!(
        stats.free_bytes,
        blocks * BLOCK,
        "memory lost or counted twice"
    );
    assert!(book(gpu).held.is_empty());
    seen.note(WAIT, stats.waits > 0);
    seen.note(CACHED, stats.cache_hits > 0);
    seen.note(IDLE, stats.idle_skips > 0);
    // Every question is answered idle in the models that allow idle answers: skips beyond
    // the questions were quiet streams, taken as idle with no question.
    seen.note(QUIET, stats.idle_skips > book(gpu).queries);
}
