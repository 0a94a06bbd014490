//! Models of the pool's per-stream free lists (src/resource/stream_ordered.rs, `StreamLists`):
//! threads allocate, free and steal on two streams, and every block must be handed out once at
//! a time, never lost, and used on its new stream only after its free on the old one.
//!
//! The engine is generic over [`EngineStream`]; here it runs on [`FakeStream`], whose
//! `order_before` (an event recorded on the donor, a wait for it on the thief) writes the edge
//! into a fake GPU: a vector clock per stream ([`Gpu`]). A block freed on stream D at position
//! p of D may be used on stream S only once S's clock has seen p of D (S == D: stream order).
//! The models check that at every hand-out, and that no block is held twice at once.
//!
//! The bookkeeping (`Gpu`) sits behind a **std** mutex, which loom does not see: loom runs one
//! thread at a time and the bookkeeping makes no loom call while it holds the lock, so it never
//! blocks, adds no scheduling points and no happens-before edges that could hide a bug of the
//! engine. Everything the engine shares is loom's (`crate::sync`).
//!
//! Fresh memory (never used by a stream) needs no ordering. The upstream cannot grow
//! ([`NoGrow`]; [`GrowOnce`] in `grow_vs_same_stream_reuse`), so a take that finds nothing goes
//! down the whole policy: own list, fresh, steal (best fit over the other lists), merge idle
//! lists and every other list, grow, merge every list again, out of memory. Each test also checks that some of its executions stole, merged (and grew) and
//! ran out of memory ([`check_paths`]), so that no check is vacuous.
//!
//! The thread-local list cache is compiled out under loom (and [`FakeStream`] has none), and
//! every request is one block. Not modelled: trimming (`take_whole_chunks`, `remove_chunk`),
//! including the pool's release of whole chunks when it grows at its maximum, and a failing
//! `order_before` (its error path puts the block back).

use std::collections::HashMap;

use loom::thread;

use super::{check_paths, must_fail, Seen, Shared};
use crate::error::{Error, Result};
use crate::resource::stream_ordered::{EngineStream, Grow, StreamLists};
use crate::sync::Arc;

// The paths of the policy an execution can take (see `check_paths`).
const STEAL: &str = "steal";
const MERGE: &str = "merge";
const GROW: &str = "grow";
const OUT_OF_MEMORY: &str = "out of memory";
const ALL_BUT_GROW: [&str; 3] = [STEAL, MERGE, OUT_OF_MEMORY];
const ALL: [&str; 4] = [STEAL, MERGE, GROW, OUT_OF_MEMORY];

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
}

impl Gpu {
    fn new(streams: usize) -> Self {
        Gpu {
            clocks: vec![vec![0; streams]; streams],
            freed: HashMap::new(),
            held: HashMap::new(),
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
            let seen = self.clocks[s][d];
            assert!(
                seen >= p,
                "block {addr:#x}, freed on stream {d} after its operation {p}, handed to stream \
                 {s}, which is ordered after only {seen} of them: a steal or merge not ordered \
                 behind the donor's free"
            );
        }
        self.clocks[s][s] += 1;
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

pub(super) struct FakeInner {
    index: usize,
    pub(super) gpu: Book,
}

/// A handle of a fake stream; clones are the same stream, as `Stream`'s.
#[derive(Clone)]
pub(super) struct FakeStream {
    pub(super) inner: Arc<FakeInner>,
}

impl FakeStream {
    pub(super) fn index(&self) -> usize {
        self.inner.index
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

    fn handle_count(&self) -> usize {
        Arc::strong_count(&self.inner)
    }

    fn order_before(&self, later: &Self) -> Result<()> {
        book(&self.inner.gpu).order(self.index(), later.index());
        Ok(())
    }
}

pub(super) fn streams(n: usize) -> Vec<FakeStream> {
    let gpu: Book = std::sync::Arc::new(std::sync::Mutex::new(Gpu::new(n)));
    (0..n)
        .map(|index| FakeStream {
            inner: Arc::new(FakeInner {
                index,
                gpu: gpu.clone(),
            }),
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
// What the models drive: the crate's engine, or the planted copy.
// ---------------------------------------------------------------------------------------------

trait Engine: Send + Sync + 'static {
    /// An engine with one chunk of `blocks` blocks, all fresh (as a pool's initial chunk).
    fn with_chunk(blocks: u64) -> Self;
    fn take(&self, size: u64, stream: &FakeStream, upstream: &impl Grow<FakeStream>)
        -> Result<u64>;
    fn give(&self, addr: u64, size: u64, stream: &FakeStream) -> bool;
    fn check(&self) -> std::result::Result<(), String>;
    fn free_bytes(&self) -> u64;
    /// How many steals and merges it made.
    fn steals_and_merges(&self) -> (u64, u64);
}

impl Engine for StreamLists<FakeStream> {
    fn with_chunk(blocks: u64) -> Self {
        let lists = StreamLists::new();
        lists.add_chunk(BASE, blocks * BLOCK);
        lists.give_fresh(BASE, blocks * BLOCK);
        lists
    }
    fn take(
        &self,
        size: u64,
        stream: &FakeStream,
        upstream: &impl Grow<FakeStream>,
    ) -> Result<u64> {
        StreamLists::take(self, size, stream, upstream)
    }
    fn give(&self, addr: u64, size: u64, stream: &FakeStream) -> bool {
        StreamLists::give(self, addr, size, stream)
    }
    fn check(&self) -> std::result::Result<(), String> {
        StreamLists::check(self)
    }
    fn free_bytes(&self) -> u64 {
        StreamLists::free_bytes(self)
    }
    fn steals_and_merges(&self) -> (u64, u64) {
        let stats = StreamLists::stats(self);
        (stats.steals, stats.merges)
    }
}

/// Allocates a block for `who` on `stream`: `None` if the engine is out of memory (the only
/// error it may give here). The upstream cannot grow.
fn alloc<E: Engine>(
    engine: &E,
    stream: &FakeStream,
    who: &'static str,
    seen: &Seen,
) -> Option<u64> {
    alloc_from(engine, stream, who, seen, &NoGrow)
}

fn alloc_from<E: Engine>(
    engine: &E,
    stream: &FakeStream,
    who: &'static str,
    seen: &Seen,
    upstream: &impl Grow<FakeStream>,
) -> Option<u64> {
    match engine.take(BLOCK, stream, upstream) {
        Ok(addr) => {
            book(&stream.inner.gpu).took(who, stream.index(), addr);
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
fn free<E: Engine>(engine: &E, stream: &FakeStream, addr: u64) {
    book(&stream.inner.gpu).freeing(stream.index(), addr);
    assert!(
        engine.give(addr, BLOCK, stream),
        "the engine refused the free of {addr:#x}"
    );
}

/// After every thread is done and every block was given back: the lists are sound, share no
/// byte, and hold all the memory. Notes which paths the execution took.
fn all_back<E: Engine>(engine: &E, blocks: u64, gpu: &Book, seen: &Seen) {
    engine.check().expect("free-list invariants");
    assert_eq!(
        engine.free_bytes(),
        blocks * BLOCK,
        "memory lost or counted twice"
    );
    assert!(book(gpu).held.is_empty());
    let (steals, merges) = engine.steals_and_merges();
    seen.note(STEAL, steals > 0);
    seen.note(MERGE, merges > 0);
}

// ---------------------------------------------------------------------------------------------
// The models.
// ---------------------------------------------------------------------------------------------

/// Two thieves and a donor. Stream 0's user (thread `donor`, which holds the stream's only
/// handle besides the engine's) frees two blocks on it and then drops the stream; two threads
/// on stream 1 allocate one block each, then free it. A thief finds the blocks in stream 0's
/// list (a steal), or moves the list into its own when stream 0 is idle (an idle merge), or
/// after the failed grow (a merge of every list), or finds nothing yet (out of memory).
fn two_thieves<E: Engine>(seen: &Shared<Seen>) {
    let mut s = streams(2);
    let (s1, s0) = (s.pop().unwrap(), s.pop().unwrap());
    let gpu = s0.inner.gpu.clone();
    let engine = Arc::new(E::with_chunk(2));
    let a = alloc(&*engine, &s0, "setup", seen).unwrap();
    let b = alloc(&*engine, &s0, "setup", seen).unwrap();

    let donor = {
        let engine = engine.clone();
        thread::spawn(move || {
            free(&*engine, &s0, a);
            free(&*engine, &s0, b);
            drop(s0);
        })
    };
    let thief = {
        let (engine, s1, seen) = (engine.clone(), s1.clone(), seen.clone());
        thread::spawn(move || {
            if let Some(x) = alloc(&*engine, &s1, "thief", &seen) {
                free(&*engine, &s1, x);
            }
        })
    };
    if let Some(y) = alloc(&*engine, &s1, "main", seen) {
        free(&*engine, &s1, y);
    }
    donor.join().unwrap();
    thief.join().unwrap();
    all_back(&*engine, 2, &gpu, seen);
}

/// A steal racing the donor's own reuse. Stream 0's thread frees a block and allocates again
/// on stream 0 (its own list serves it at once, if the block is still there); stream 1's
/// thread allocates (stealing it, or merging, or out of memory). A second block stays held by
/// the model until the end, so only one block is in play.
fn steal_vs_reuse<E: Engine>(seen: &Shared<Seen>) {
    let s = streams(2);
    let (s0, s1) = (s[0].clone(), s[1].clone());
    let gpu = s0.inner.gpu.clone();
    let engine = Arc::new(E::with_chunk(2));
    let a = alloc(&*engine, &s0, "setup", seen).unwrap();
    let b = alloc(&*engine, &s0, "kept", seen).unwrap();

    let owner = {
        let (engine, s0, seen) = (engine.clone(), s0.clone(), seen.clone());
        thread::spawn(move || {
            free(&*engine, &s0, a);
            if let Some(x) = alloc(&*engine, &s0, "owner", &seen) {
                free(&*engine, &s0, x);
            }
        })
    };
    if let Some(y) = alloc(&*engine, &s1, "thief", seen) {
        free(&*engine, &s1, y);
    }
    owner.join().unwrap();
    free(&*engine, &s0, b);
    all_back(&*engine, 2, &gpu, seen);
}

/// Growth racing a free and a reuse. The pool holds one block, in use on stream 0; stream 0's
/// thread frees it and allocates again; this thread allocates on stream 1 from an upstream
/// that can give one more chunk: it steals the block, or grows (the new chunk is registered
/// with every list while stream 0's thread uses its own), or merges, or finds nothing.
fn grow_vs_reuse<E: Engine>(seen: &Shared<Seen>) {
    let s = streams(2);
    let (s0, s1) = (s[0].clone(), s[1].clone());
    let gpu = s0.inner.gpu.clone();
    let engine = Arc::new(E::with_chunk(1));
    let a = alloc(&*engine, &s0, "setup", seen).unwrap();
    let upstream = GrowOnce(std::sync::atomic::AtomicBool::new(false));

    let owner = {
        let (engine, s0, seen) = (engine.clone(), s0.clone(), seen.clone());
        thread::spawn(move || {
            free(&*engine, &s0, a);
            if let Some(x) = alloc(&*engine, &s0, "owner", &seen) {
                free(&*engine, &s0, x);
            }
        })
    };
    if let Some(y) = alloc_from(&*engine, &s1, "grower", seen, &upstream) {
        free(&*engine, &s1, y);
    }
    owner.join().unwrap();
    let grown = upstream.0.load(std::sync::atomic::Ordering::Relaxed);
    seen.note(GROW, grown);
    all_back(&*engine, 1 + u64::from(grown), &gpu, seen);
}

/// Bound 4: 3 threads (the donor, a thief and the model's main thread, the other thief).
#[test]
fn two_thieves_one_donor() {
    check_paths(
        Some(4),
        &ALL_BUT_GROW,
        two_thieves::<StreamLists<FakeStream>>,
    );
}

/// Bound 5: 2 threads.
#[test]
fn steal_vs_same_stream_reuse() {
    check_paths(
        Some(5),
        &ALL_BUT_GROW,
        steal_vs_reuse::<StreamLists<FakeStream>>,
    );
}

/// Bound 5: 2 threads.
#[test]
fn grow_vs_same_stream_reuse() {
    check_paths(Some(5), &ALL, grow_vs_reuse::<StreamLists<FakeStream>>);
}

// ---------------------------------------------------------------------------------------------
// Planted bugs: the same models against a copy of the engine with one bug switched on.
// ---------------------------------------------------------------------------------------------

/// Sanity: the copy with no bug passes the models the real engine passes.
#[test]
#[ignore = "checks the planted copy itself; run with --ignored"]
fn planted_none_passes() {
    type E = planted::Lists<{ planted::NONE }>;
    check_paths(Some(4), &ALL_BUT_GROW, two_thieves::<E>);
    check_paths(Some(5), &ALL_BUT_GROW, steal_vs_reuse::<E>);
    check_paths(Some(5), &ALL, grow_vs_reuse::<E>);
}

/// Bug: the steal hands the block out without recording an event on the donor and making the
/// thief's stream wait on it.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_steal_unordered() {
    must_fail(
        module_path!(),
        "planted_steal_unordered",
        "not ordered behind the donor's free",
        || {
            check_paths(
                Some(5),
                &[],
                steal_vs_reuse::<planted::Lists<{ planted::STEAL_UNORDERED }>>,
            )
        },
    );
}

/// Bug: the steal takes the block from the donor's list without the donor's lock.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_steal_without_lock() {
    must_fail(
        module_path!(),
        "planted_steal_without_lock",
        "Causality violation",
        || {
            check_paths(
                Some(3),
                &[],
                two_thieves::<planted::Lists<{ planted::STEAL_UNLOCKED }>>,
            )
        },
    );
}

/// Bug: the steal records the event on the donor (and makes the thief wait on it) *before* it
/// takes the block from the donor's list: a block freed between the two is handed out with an
/// event that does not cover its free. Only some interleavings show it.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_steal_ordered_before_take() {
    must_fail(
        module_path!(),
        "planted_steal_ordered_before_take",
        "not ordered behind the donor's free",
        || {
            check_paths(
                Some(5),
                &[],
                steal_vs_reuse::<planted::Lists<{ planted::ORDER_BEFORE_TAKE }>>,
            )
        },
    );
}

/// Bug: a merge moves another stream's blocks into the caller's list without ordering the
/// caller after that stream.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_merge_unordered() {
    must_fail(
        module_path!(),
        "planted_merge_unordered",
        "not ordered behind the donor's free",
        || {
            check_paths(
                Some(3),
                &[],
                two_thieves::<planted::Lists<{ planted::MERGE_UNORDERED }>>,
            )
        },
    );
}

/// A copy of src/resource/stream_ordered.rs's `StreamLists`, cut to what the models use (no
/// cache, no trim, no statistics), with switchable bugs. A list's state is a loom `UnsafeCell`
/// guarded by a `Mutex<()>` instead of a `Mutex<ListState>`, so that the planted "no lock" bug
/// can be written; with the lock taken it is the same.
mod planted {
    use loom::cell::UnsafeCell;
    use rustc_hash::FxHashMap;

    use super::{Engine, FakeStream, BASE, BLOCK};
    use crate::error::{Error, Result};
    use crate::resource::free_list::FreeList;
    use crate::resource::stream_ordered::{EngineStream, Grow};
    use crate::sync::{Arc, AtomicU64, Mutex, Ordering};

    pub(super) const NONE: u8 = 0;
    /// `steal` skips `order_before`.
    pub(super) const STEAL_UNORDERED: u8 = 1;
    /// `steal` takes from the donor's list without its lock.
    pub(super) const STEAL_UNLOCKED: u8 = 2;
    /// `merge_into` skips `order_before`.
    pub(super) const MERGE_UNORDERED: u8 = 3;
    /// `steal` orders the thief after the donor first, then takes the block: a block freed in
    /// between is not covered by the event.
    pub(super) const ORDER_BEFORE_TAKE: u8 = 4;

    struct ListState {
        free: FreeList,
        retired: bool,
    }

    struct StreamList {
        stream: FakeStream,
        lock: Mutex<()>,
        state: UnsafeCell<ListState>,
    }

    // SAFETY: `state` is only reached through `locked`, under `lock` (the planted
    // `STEAL_UNLOCKED` bug aside, which is what loom must report).
    unsafe impl Sync for StreamList {}

    impl StreamList {
        fn locked<R>(&self, f: impl FnOnce(&mut ListState) -> R) -> R {
            let _guard = self.lock.lock();
            // SAFETY: the lock is held, so this is the only access.
            self.state.with_mut(|state| f(unsafe { &mut *state }))
        }

        /// The planted bug: the same access without the lock.
        fn unlocked<R>(&self, f: impl FnOnce(&mut ListState) -> R) -> R {
            // SAFETY: none; loom runs one thread at a time, so no two references exist at once
            // in the model, and loom reports the missing synchronisation.
            self.state.with_mut(|state| f(unsafe { &mut *state }))
        }
    }

    struct Registry {
        lists: FxHashMap<u64, Arc<StreamList>>,
        chunks: Vec<(u64, u64)>,
    }

    pub(super) struct Lists<const BUG: u8> {
        fresh: Mutex<FreeList>,
        registry: Mutex<Registry>,
        /// src's slow-path lock: merges and growth one request at a time.
        slow: Mutex<()>,
        steals: AtomicU64,
        merges: AtomicU64,
    }

    impl<const BUG: u8> Lists<BUG> {
        fn list_for(&self, stream: &FakeStream) -> Arc<StreamList> {
            let id = stream.uid();
            let mut registry = self.registry.lock();
            let chunks = registry.chunks.clone();
            registry
                .lists
                .entry(id)
                .or_insert_with(|| {
                    let mut free = FreeList::new();
                    for (start, size) in chunks {
                        free.add_chunk(start, size);
                    }
                    Arc::new(StreamList {
                        stream: stream.clone(),
                        lock: Mutex::new(()),
                        state: UnsafeCell::new(ListState {
                            free,
                            retired: false,
                        }),
                    })
                })
                .clone()
        }

        fn with_own<R>(&self, stream: &FakeStream, mut f: impl FnMut(&mut FreeList) -> R) -> R {
            loop {
                let list = self.list_for(stream);
                if let Some(r) = list.locked(|state| (!state.retired).then(|| f(&mut state.free))) {
                    return r;
                }
            }
        }

        fn add_chunk(&self, start: u64, size: u64) {
            let mut registry = self.registry.lock();
            registry.chunks.push((start, size));
            self.fresh.lock().add_chunk(start, size);
            for list in registry.lists.values() {
                list.locked(|state| state.free.add_chunk(start, size));
            }
        }

        fn give_to(&self, addr: u64, size: u64, stream: &FakeStream) -> bool {
            self.with_own(stream, |free| free.give(addr, size))
        }

        /// The best fit over the other lists, taken whole under the donor's lock, which is
        /// held through the ordering (src's `steal`).
        fn steal(&self, size: u64, stream: &FakeStream) -> Result<Option<u64>> {
            let me = stream.uid();
            let donors: Vec<Arc<StreamList>> = self
                .registry
                .lock()
                .lists
                .iter()
                .filter(|(&id, _)| id != me)
                .map(|(_, list)| list.clone())
                .collect();
            let mut best: Option<(u64, &Arc<StreamList>)> = None;
            for donor in &donors {
                let fit = donor.locked(|state| {
                    if state.retired {
                        None
                    } else {
                        state.free.fit(size)
                    }
                });
                if let Some(fit) = fit {
                    if best.is_none_or(|(b, _)| fit < b) {
                        best = Some((fit, donor));
                    }
                }
            }
            let Some((_, donor)) = best else {
                return Ok(None);
            };
            if BUG == ORDER_BEFORE_TAKE {
                donor.stream.order_before(stream)?;
            }
            let steal = |state: &mut ListState| -> Result<Option<(u64, u64)>> {
                if state.retired {
                    return Ok(None);
                }
                let Some((addr, whole)) = state.free.take_whole(size) else {
                    return Ok(None);
                };
                let ordered = if BUG == STEAL_UNORDERED || BUG == ORDER_BEFORE_TAKE {
                    Ok(())
                } else {
                    donor.stream.order_before(stream)
                };
                if let Err(e) = ordered {
                    state.free.give(addr, whole);
                    return Err(e);
                }
                Ok(Some((addr, whole)))
            };
            let got = if BUG == STEAL_UNLOCKED {
                donor.unlocked(steal)?
            } else {
                donor.locked(steal)?
            };
            let Some((addr, whole)) = got else {
                return Ok(None);
            };
            if whole > size {
                self.give_to(addr + size, whole - size, stream);
            }
            self.steals.fetch_add(1, Ordering::Relaxed);
            Ok(Some(addr))
        }

        /// src's `merge_into` with no limit: fresh memory, every idle list (retired) and every
        /// other list that holds memory, after the caller waits on each.
        fn merge_into(&self, stream: &FakeStream) -> Result<usize> {
            let fresh = self.fresh.lock().drain();
            for &(addr, size) in &fresh {
                self.give_to(addr, size, stream);
            }
            let mut moved = fresh.len();
            let me = stream.uid();
            let donors: Vec<(Arc<StreamList>, bool)> = {
                let mut registry = self.registry.lock();
                let chosen: Vec<(u64, bool)> = registry
                    .lists
                    .iter()
                    .filter(|(&id, _)| id != me)
                    .map(|(&id, list)| (id, list.stream.handle_count() == 1))
                    .collect();
                chosen
                    .into_iter()
                    .map(|(id, idle)| {
                        let list = if idle {
                            registry.lists.remove(&id)
                        } else {
                            registry.lists.get(&id).cloned()
                        };
                        (list.expect("chosen under the lock"), idle)
                    })
                    .collect()
            };
            if donors.is_empty() {
                return Ok(moved);
            }
            for (donor, idle) in donors {
                let blocks = donor.locked(|state| {
                    if state.retired {
                        return Vec::new();
                    }
                    state.retired |= idle;
                    state.free.drain()
                });
                if blocks.is_empty() {
                    continue;
                }
                let ordered = if BUG == MERGE_UNORDERED {
                    Ok(())
                } else {
                    donor.stream.order_before(stream)
                };
                if let Err(e) = ordered {
                    donor.locked(|state| {
                        state.retired = false;
                        for &(addr, size) in &blocks {
                            state.free.give(addr, size);
                        }
                    });
                    if idle {
                        self.registry
                            .lock()
                            .lists
                            .insert(donor.stream.uid(), donor.clone());
                    }
                    return Err(e);
                }
                for &(addr, size) in &blocks {
                    self.give_to(addr, size, stream);
                }
                moved += blocks.len();
            }
            self.merges.fetch_add(1, Ordering::Relaxed);
            Ok(moved)
        }
    }

    impl<const BUG: u8> Engine for Lists<BUG> {
        fn with_chunk(blocks: u64) -> Self {
            let mut fresh = FreeList::new();
            fresh.add_chunk(BASE, blocks * BLOCK);
            fresh.give(BASE, blocks * BLOCK);
            Lists {
                fresh: Mutex::new(fresh),
                registry: Mutex::new(Registry {
                    lists: FxHashMap::default(),
                    chunks: vec![(BASE, blocks * BLOCK)],
                }),
                slow: Mutex::new(()),
                steals: AtomicU64::new(0),
                merges: AtomicU64::new(0),
            }
        }

        fn take(
            &self,
            size: u64,
            stream: &FakeStream,
            upstream: &impl Grow<FakeStream>,
        ) -> Result<u64> {
            // src's `take`: the own list, then fresh memory, under the own list's lock.
            let own = self.with_own(stream, |free| {
                free.take(size).or_else(|| self.fresh.lock().take(size))
            });
            if let Some(addr) = own {
                return Ok(addr);
            }
            // src's `take_slow`.
            if let Some(addr) = self.steal(size, stream)? {
                return Ok(addr);
            }
            let _slow = self.slow.lock();
            let own = self.with_own(stream, |free| free.take(size));
            if let Some(addr) = own.or_else(|| self.fresh.lock().take(size)) {
                return Ok(addr);
            }
            if let Some(addr) = self.steal(size, stream)? {
                return Ok(addr);
            }
            if self.merge_into(stream)? > 0 {
                if let Some(addr) = self.with_own(stream, |free| free.take(size)) {
                    return Ok(addr);
                }
            }
            let (base, chunk) = match upstream.grow(size, stream) {
                Err(e) if e.is_out_of_memory() => {
                    if self.merge_into(stream)? == 0 {
                        return Err(e);
                    }
                    if let Some(addr) = self.with_own(stream, |free| free.take(size)) {
                        return Ok(addr);
                    }
                    upstream.grow(size, stream)?
                }
                other => other?,
            };
            self.add_chunk(base, chunk);
            let rest = self.with_own(stream, |free| {
                free.give(base, chunk);
                free.take(size)
            });
            rest.ok_or(Error::InvalidArgument {
                what: "the upstream gave a chunk smaller than asked for",
            })
        }

        fn give(&self, addr: u64, size: u64, stream: &FakeStream) -> bool {
            self.give_to(addr, size, stream)
        }

        fn check(&self) -> std::result::Result<(), String> {
            let mut all: Vec<(u64, u64)> = self.fresh.lock().blocks().collect();
            let lists: Vec<Arc<StreamList>> =
                self.registry.lock().lists.values().cloned().collect();
            for list in lists {
                list.locked(|state| {
                    state.free.check()?;
                    all.extend(state.free.blocks());
                    Ok::<(), String>(())
                })?;
            }
            all.sort_unstable();
            match all.windows(2).find(|w| w[0].0 + w[0].1 > w[1].0) {
                Some(w) => Err(format!("two lists share memory: {:x?}", w)),
                None => Ok(()),
            }
        }

        fn steals_and_merges(&self) -> (u64, u64) {
            (
                self.steals.load(Ordering::Relaxed),
                self.merges.load(Ordering::Relaxed),
            )
        }

        fn free_bytes(&self) -> u64 {
            let mut bytes = self.fresh.lock().free_bytes();
            let lists: Vec<Arc<StreamList>> =
                self.registry.lock().lists.values().cloned().collect();
            for list in lists {
                bytes += list.locked(|state| state.free.free_bytes());
            }
            bytes
        }
    }
}
