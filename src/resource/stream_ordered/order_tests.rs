//! A stream forgotten (and its slot taken by a new stream, or by the same stream registered
//! again) while `order` has let go of the shard's lock: what `order` notes on relocking must
//! not land on the newcomer, nor on the new registration (the same for a host's wait). Beside
//! it, the engine's other paths around its locks that need real threads or a stream that
//! counts what it is asked (idle answers, memory taken out, the look before the growth lock).

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64 as StdU64, Ordering::SeqCst};
use std::sync::Arc as StdArc;

use super::*;

struct Inner {
    uid: u64,
    idle: AtomicBool,
    orders: StdU64,
    queries: StdU64,
    /// Under a (pretend) graph capture: orderings through it are refused, as a real stream's.
    capturing: AtomicBool,
    /// What `activity` reports, if it reports anything.
    activity: Option<StdU64>,
}

/// A stream that counts its orderings and questions; its users are counted as a real
/// stream's are.
#[derive(Clone)]
struct Probe(StdArc<Inner>, super::Users);

impl Probe {
    /// A stream that reports no activity: every idle answer is asked of it.
    fn new(uid: u64, idle: bool) -> Self {
        Self::with(uid, idle, None)
    }

    /// A stream that reports its activity: work queued on it is counted ([`queue`]).
    fn counting(uid: u64, idle: bool) -> Self {
        Self::with(uid, idle, Some(StdU64::new(0)))
    }

    fn with(uid: u64, idle: bool, activity: Option<StdU64>) -> Self {
        Probe(
            StdArc::new(Inner {
                uid,
                idle: AtomicBool::new(idle),
                orders: StdU64::new(0),
                queries: StdU64::new(0),
                capturing: AtomicBool::new(false),
                activity,
            }),
            super::Users::new(),
        )
    }

    /// Work queued on the stream.
    fn queue(&self) {
        if let Some(a) = &self.0.activity {
            a.fetch_add(1, SeqCst);
        }
    }

    fn asked(&self) -> u64 {
        self.0.orders.load(SeqCst) + self.0.queries.load(SeqCst)
    }
}

thread_local! {
    /// What runs when stream 2 is asked whether it is idle: inside `order`'s window.
    static HOOK: RefCell<Option<Box<dyn FnOnce()>>> = const { RefCell::new(None) };
}

impl EngineStream for Probe {
    type Name = u64;

    fn uid(&self) -> u64 {
        self.0.uid
    }

    fn name(&self) -> u64 {
        self.0.uid
    }

    fn users(&self) -> usize {
        self.1.get()
    }

    fn set_kept(&self, kept: bool) {
        self.1.set_kept(kept)
    }

    fn order_before(&self, later: &Self) -> Result<()> {
        if self.0.capturing.load(SeqCst) || later.0.capturing.load(SeqCst) {
            return Err(Error::StreamCapturing {
                operation: "an ordering",
            });
        }
        self.0.orders.fetch_add(1, SeqCst);
        Ok(())
    }

    fn activity(&self) -> Option<u64> {
        // `new`'s report none: every idle answer is asked for (the hook runs inside `order`'s
        // window).
        self.0.activity.as_ref().map(|a| a.load(SeqCst))
    }

    fn is_idle(&self) -> bool {
        self.0.queries.fetch_add(1, SeqCst);
        if self.0.uid == 2 {
            if let Some(hook) = HOOK.with(|h| h.borrow_mut().take()) {
                hook();
            }
        }
        self.0.idle.load(SeqCst)
    }
}

struct NoGrowth;

/// Chunks of exactly what is asked, one after another from `next`.
struct Chunks {
    next: StdU64,
    grown: StdU64,
}

impl Grow<Probe> for Chunks {
    fn grow(&self, min: u64, _: &Probe) -> Result<(u64, u64)> {
        self.grown.fetch_add(1, SeqCst);
        Ok((self.next.fetch_add(min, SeqCst), min))
    }
}

/// A block freed on a stream that the user's code is now capturing into a graph, asked for on
/// another stream: the ordering is refused (no event can be recorded into the capture for
/// another stream to wait on), and the request is served from a chunk grown for it instead of
/// failing (a review found every request whose best fit was that block failing for as long
/// as the capture lasted). The same for a capturing requester and another stream's block;
/// and with no growth, the refusal is the request's error. Nothing is lost either way.
#[test]
fn a_block_a_capture_keeps_from_ordering_is_passed_over_for_a_growth() {
    const B: u64 = 1 << 20;
    let heap: StreamHeap<Probe> = StreamHeap::with_options(0.0, 1);
    heap.add_chunk(0x1000_0000, 2 * B);
    heap.give_fresh(0x1000_0000, 2 * B);
    let (captured, other) = (Probe::new(1, false), Probe::new(2, false));
    let a = heap.take(2 * B, &captured, &NoGrowth).unwrap();
    assert!(heap.give(a, 2 * B, &captured));
    captured.0.capturing.store(true, SeqCst);
    let chunks = Chunks {
        next: StdU64::new(0x2000_0000),
        grown: StdU64::new(0),
    };
    // Without growth: the refusal, and the block still free.
    match heap.take(B, &other, &NoGrowth) {
        Err(Error::StreamCapturing { .. }) => {}
        r => panic!("{r:?}"),
    }
    // With growth: served from the new chunk, unordered.
    let b = heap.take(B, &other, &chunks).unwrap();
    assert_eq!(b, 0x2000_0000);
    assert_eq!(chunks.grown.load(SeqCst), 1);
    assert_eq!(other.0.orders.load(SeqCst), 0);
    // The capturing stream asks for the other stream's memory: a growth again.
    assert!(heap.give(b, B, &other));
    let c = heap.take(B, &captured, &chunks).unwrap();
    assert_eq!(c, 0x2000_0000 + B);
    assert_eq!(chunks.grown.load(SeqCst), 2);
    // The capture over, the first block is ordered and handed out as before.
    captured.0.capturing.store(false, SeqCst);
    assert!(heap.give(c, B, &captured));
    let d = heap.take(2 * B, &other, &NoGrowth).unwrap();
    assert_eq!(d, 0x1000_0000);
    heap.check().unwrap();
}

impl Grow<Probe> for NoGrowth {
    fn grow(&self, _: u64, _: &Probe) -> Result<(u64, u64)> {
        Err(Error::InvalidArgument { what: "no growth" })
    }
}

/// The scene of the two tests below: one shard of 6 blocks of `B`, where `first` and `second`
/// (both idle) each freed a block (`a`, `b`, neighbours) and `taker` holds a third (`spare`).
/// Returns the heap, `first`, `taker` and the three blocks.
fn two_idle_frees_and_a_spare() -> (StdArc<StreamHeap<Probe>>, Probe, Probe, [u64; 3]) {
    let heap: StdArc<StreamHeap<Probe>> = StdArc::new(StreamHeap::with_options(0.0, 1));
    heap.add_chunk(0x1000_0000, 6 * B);
    heap.give_fresh(0x1000_0000, 6 * B);
    let first = Probe::new(1, true);
    let second = Probe::new(2, true);
    let taker = Probe::new(3, false);
    let a = heap.take(B, &first, &NoGrowth).unwrap();
    let b = heap.take(B, &second, &NoGrowth).unwrap();
    let spare = heap.take(B, &taker, &NoGrowth).unwrap();
    assert!(heap.give(a, B, &first));
    assert!(heap.give(b, B, &second));
    (heap, first, taker, [a, b, spare])
}

/// The end of the two tests below: the taker takes `a` and `b` coalesced (its tag names
/// `first` and `second`, both idle: `order` asks them, and the hook runs in its window); then
/// another stream takes `spare`, freed on `donor()` (looked up after the take) while it was
/// busy: it must be ordered after it or ask whether it is idle, never handed over as if the
/// donor had finished.
fn take_both_then_the_spare(
    heap: &StreamHeap<Probe>,
    taker: &Probe,
    [a, b, spare]: [u64; 3],
    donor: impl FnOnce() -> Probe,
) {
    let both = heap.take(2 * B, taker, &NoGrowth).unwrap();
    assert_eq!(both, a.min(b));
    assert!(HOOK.with(|h| h.borrow().is_none()), "the trim did not run");
    let donor = donor();
    let other = Probe::new(5, false);
    let before = donor.asked();
    assert_eq!(heap.take(B, &other, &NoGrowth).unwrap(), spare);
    assert!(
        donor.asked() > before,
        "a block freed on a busy stream was handed over with no ordering and no question"
    );
}

/// The block size of the tests of a stream forgotten in `order`'s window.
const B: u64 = 1 << 20;

#[test]
fn a_stream_forgotten_during_an_ordering_lends_nothing_to_its_slots_next_stream() {
    let (heap, first, taker, blocks) = two_idle_frees_and_a_spare();
    let spare = blocks[2];
    // The user drops `first`: the engine holds its only handles.
    drop(first);
    // A new stream, still busy with the block it is about to free.
    let newcomer = Probe::new(4, false);
    let (during, fresh) = (heap.clone(), newcomer.clone());
    HOOK.with(|h| {
        *h.borrow_mut() = Some(Box::new(move || {
            // A trim between `order`'s drop of `first`'s handle and its relock ...
            for idle in during.idle_streams() {
                during.forget(idle);
            }
            // ... and the newcomer frees a block, taking `first`'s old slot.
            assert!(during.give(spare, B, &fresh));
        }))
    });
    take_both_then_the_spare(&heap, &taker, blocks, || newcomer);
}

/// As the test above, but the stream forgotten in `order`'s window is the same stream
/// registered again in its old slot (a trim's put-back on it, `give_blocks_to`, or an outer
/// pool's release of a chunk to a pool on it), busy by then. Epochs count per registration:
/// the new one starts at 0, and `order` checked only that the slot still held the same uid,
/// so the idle answer noted for the old registration (done at epoch 1) covered the new
/// registration's first free, and another stream was handed that block with no ordering and
/// no question while the stream's work could still use it (a review's finding: failed before
/// the registration's number was checked instead of the uid).
#[test]
fn a_stream_forgotten_and_registered_again_gets_no_stale_note() {
    let (heap, first, taker, blocks) = two_idle_frees_and_a_spare();
    let spare = blocks[2];
    // Stands for the handle a trim's put-back holds (`onto_one`'s), taken before a concurrent
    // forget read the count: kept, so the forget still goes ahead.
    let engine_handle = Kept::new(&first);
    drop(first);
    let during = heap.clone();
    HOOK.with(|h| {
        *h.borrow_mut() = Some(Box::new(move || {
            // A trim in `order`'s window forgets `first` (dropped by the user, idle) ...
            for idle in during.idle_streams() {
                during.forget(idle);
            }
            // ... and `first`, busy again, is registered again in its old slot by a free.
            let inner: &Probe = &engine_handle;
            inner.0.idle.store(false, SeqCst);
            assert!(during.give(spare, B, inner));
            drop(engine_handle);
        }))
    });
    // `spare` was freed on `first`'s new registration.
    take_both_then_the_spare(&heap, &taker, blocks, || {
        (heap.idle_streams().into_iter())
            .find(|s| s.uid() == 1)
            .unwrap()
    });
}

/// The host's wait for a stream (the expandable pool's job for busy streams:
/// `bump_for_host_wait`, the wait, `note_host_waited`), with the stream forgotten and
/// registered again in its old slot between the bump and the note: the note is of the old
/// registration's epoch, and must not land on the new one, whose epochs start again at 0.
/// `note_host_waited` checked only the uid, and the new registration's first free (tagged at
/// epoch 0) was noted done by a wait that began before it: another stream was handed the
/// block with no ordering and no question (a review's finding, the same as the test above's
/// on this path: failed before the registration's number was checked). The pool's job holds
/// the stream's handle from the bump to the note, so a forget cannot come in between there
/// today; the engine does not count on it.
#[test]
fn a_host_wait_is_not_noted_on_its_streams_next_registration() {
    const B: u64 = 1 << 20;
    let heap: StreamHeap<Probe> = StreamHeap::with_options(0.0, 1);
    heap.add_chunk(0x1000_0000, 2 * B);
    heap.give_fresh(0x1000_0000, 2 * B);
    let first = Probe::new(1, false);
    let taker = Probe::new(3, false);
    // `first` registered by a free.
    let a = heap.take(B, &first, &NoGrowth).unwrap();
    let spare = heap.take(B, &taker, &NoGrowth).unwrap();
    assert!(heap.give(a, B, &first));
    // The job bumps `first`'s epoch before it waits on the host ...
    let wait = heap.bump_for_host_wait(&first);
    // ... `first`'s work finishes, its user drops it, and a trim forgets it ...
    let engine_handle = Kept::new(&first);
    drop(first);
    let inner: &Probe = &engine_handle;
    inner.0.idle.store(true, SeqCst);
    let forgotten = heap.idle_streams();
    assert_eq!(forgotten.len(), 1);
    for idle in forgotten {
        heap.forget(idle);
    }
    // (`a`, which needs no ordering now, in use again: the only free block left is `spare`.)
    assert_eq!(heap.take(B, &taker, &NoGrowth).unwrap(), a);
    // ... and it is registered again, busy, in its old slot, by a free.
    inner.0.idle.store(false, SeqCst);
    assert!(heap.give(spare, B, inner));
    // The host's wait ends: noted.
    heap.note_host_waited(wait);
    let again = (heap.idle_streams().into_iter())
        .find(|s| s.uid() == 1)
        .unwrap();
    drop(engine_handle);
    let other = Probe::new(5, false);
    let before = again.asked();
    assert_eq!(heap.take(B, &other, &NoGrowth).unwrap(), spare);
    assert!(
        again.asked() > before,
        "a block freed on a busy stream was handed over with no ordering and no question"
    );
    assert!(heap.give(a, B, &taker));
    heap.check().unwrap();
}

#[test]
fn a_stream_seen_idle_with_nothing_queued_since_is_not_asked_again() {
    const B: u64 = 1 << 20;
    let heap: StreamHeap<Probe> = StreamHeap::with_options(0.0, 1);
    heap.add_chunk(0x1000_0000, 8 * B);
    heap.give_fresh(0x1000_0000, 8 * B);
    let donor = Probe::counting(1, true);
    let taker = Probe::counting(2, false);
    // Four blocks in use on the donor, with a fresh block between each, held by the taker, so
    // that none coalesces with another.
    let mut blocks = Vec::new();
    let mut fences = Vec::new();
    for _ in 0..4 {
        blocks.push(heap.take(B, &donor, &NoGrowth).unwrap());
        fences.push(heap.take(B, &taker, &NoGrowth).unwrap());
    }
    let take_freed = |block: u64| {
        assert!(heap.give(block, B, &donor));
        assert_eq!(heap.take(B, &taker, &NoGrowth).unwrap(), block);
    };
    // The first hand-over asks: idle.
    take_freed(blocks[0]);
    assert_eq!(
        (donor.0.queries.load(SeqCst), donor.0.orders.load(SeqCst)),
        (1, 0)
    );
    // A block freed after that answer: nothing was queued on the donor since, so it is still
    // idle, and nobody asks.
    take_freed(blocks[1]);
    assert_eq!(
        (donor.0.queries.load(SeqCst), donor.0.orders.load(SeqCst)),
        (1, 0)
    );
    // Work queued on the donor: the next hand-over asks again ...
    donor.queue();
    take_freed(blocks[2]);
    assert_eq!(donor.0.queries.load(SeqCst), 2);
    // ... and a busy answer orders, and leaves the stream no longer quiet.
    donor.0.idle.store(false, SeqCst);
    donor.queue();
    take_freed(blocks[3]);
    assert_eq!(
        (donor.0.queries.load(SeqCst), donor.0.orders.load(SeqCst)),
        (3, 1)
    );
    assert_eq!(heap.stats().idle_skips, 3);
    for f in fences {
        assert!(heap.give(f, B, &taker));
    }
    for b in blocks {
        assert!(heap.give(b, B, &taker));
    }
    heap.check().unwrap();
}

#[test]
fn memory_taken_out_waits_for_its_other_streams_when_its_first_is_forgotten() {
    const B: u64 = 1 << 20;
    let heap: StreamHeap<Probe> = StreamHeap::with_options(0.0, 1);
    heap.add_chunk(0x1000_0000, 2 * B);
    heap.give_fresh(0x1000_0000, 2 * B);
    let first = Probe::new(1, true);
    let busy = Probe::new(3, false);
    let a = heap.take(B, &first, &NoGrowth).unwrap();
    let b = heap.take(B, &busy, &NoGrowth).unwrap();
    assert!(heap.give(a, B, &first));
    assert!(heap.give(b, B, &busy));
    // The whole chunk is free, tagged with both streams, `first` first: taken out (a chunk
    // going back upstream, or granules being unmapped) ...
    let shard = heap.shard_of(0x1000_0000, 2 * B).unwrap();
    let tag = (shard.lock().free)
        .take_exact_tagged(0x1000_0000, 2 * B)
        .unwrap();
    assert_eq!(tag.pairs().len(), 2);
    // ... and, before it is ordered, a trim on another thread forgets `first` (dropped by the
    // user, idle).
    drop(first);
    let forgotten = heap.idle_streams();
    assert_eq!(forgotten.len(), 1);
    for idle in forgotten {
        heap.forget(idle);
    }
    // The memory must still wait for `busy`.
    let onto = heap.onto_one(shard, &tag).unwrap();
    assert_eq!(
        onto.map(|s| s.uid()),
        Some(3),
        "memory freed on a busy stream released with no wait for it"
    );
}

/// A request whose only fit lies in another thread's shard, busy for a moment, is served
/// without the growth lock (`take_contended`'s look at every shard, waiting for each): here
/// the growth lock is held until the request is served. A request that queued for the growth
/// lock first, as before that look, would wait for it for ever; the holder gives up after 30 s
/// and the test fails.
#[test]
fn a_fit_in_a_busy_shard_is_found_without_the_growth_lock() {
    const B: u64 = 1 << 20;
    let heap: StreamHeap<Probe> = StreamHeap::with_options(0.0, 2);
    let other = 1 - heap.home();
    heap.add_chunk_to(other, 0x1000_0000, 2 * B);
    heap.give_fresh(0x1000_0000, 2 * B);
    let stream = Probe::new(1, true);
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    let (served_tx, served_rx) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        let heap = &heap;
        let holder = scope.spawn(move || {
            let growth = heap.slow.lock();
            let busy = heap.shards[other].lock();
            held_tx.send(()).unwrap();
            // Long enough for the request to find the shard busy and go past the look at the
            // shards whose lock is free (if it does not, it is served there: the test passes
            // without exercising the path, never fails for it).
            std::thread::sleep(std::time::Duration::from_millis(20));
            drop(busy);
            let served = served_rx.recv_timeout(std::time::Duration::from_secs(30));
            drop(growth);
            served.is_ok()
        });
        held_rx.recv().unwrap();
        let addr = heap
            .take(B, &stream, &NoGrowth)
            .expect("the fit in the busy shard");
        // (Fails once the holder has given up; its verdict says why.)
        let _ = served_tx.send(());
        assert!(
            holder.join().unwrap(),
            "the request waited for the growth lock"
        );
        assert_eq!(addr, 0x1000_0000);
        assert!(heap.give(addr, B, &stream));
    });
    heap.check().unwrap();
}
