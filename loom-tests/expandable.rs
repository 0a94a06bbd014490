//! Models of the expandable pool's shared bookkeeping (src/resource/expandable/core.rs,
//! `Expander`): a user allocates, uses and frees granule-sized blocks on a stream (growing the
//! pool by mapping granules when it must) while another thread trims (takes the free granules
//! out of the lists, waits for their streams, unmaps them). Checked: no block is handed out or
//! used on an unmapped granule, no granule is unmapped while a block in it is held or while
//! work queued before its free may still run, and in the end every mapped byte is free in the
//! lists, which are sound.
//!
//! The engine and `Expander` run on [`FakeStream`] and [`FakeBacking`]; their bookkeeping (what
//! is mapped, held, and which uses are still "on the GPU") sits behind a **std** mutex that
//! loom does not see, as in `free_lists.rs`: it adds no scheduling points and no
//! happens-before edges that could hide a bug. Everything the code under test shares is loom's
//! (`crate::sync`).
//!
//! The planted bug (`planted_synchronized_before_take`): trim waits for the stream *before* it
//! takes the free granules out of the lists; a block freed between the two is unmapped while
//! the work queued before its free may still run. Only some interleavings show it.
//!
//! `claims_of_the_initial_pieces_vs_trim`: the initial size in two unclaimed pieces, one per
//! range; a user's request claims both (moving the other range's) while a trim runs, and is
//! always served (from what the trim holds, if it must). Its planted bug went with the
//! thirteenth session: the claim and the trim's take now both run under the growth lock, so a
//! claim that let go of the table's lock between picking a piece and using it could no longer
//! lose the piece to the trim.
//!
//! `a_request_at_the_maximum_recalls_what_a_trim_holds`: a trim holds the only granule while it
//! waits for its stream; a request at the maximum takes it back (`held_for_trim.rs`) and is
//! served, and the trim unmaps only what is still its own. Planted bug
//! (`planted_trim_ignores_recall`): the trim unmaps all it took.
//!
//! `two_trims_keep_what_they_were_asked_to`: three granules mapped and free, two trims down to
//! one granule at once: at least one stays mapped whatever the interleaving. Planted bug
//! (`planted_trimming_ignored`): each trim takes what passes `keep` of what is mapped, not
//! counting what the other took and has not unmapped yet.
//!
//! `frees_during_an_automatic_release`: the release threshold's trigger (`ReleaseTrigger`):
//! two frees of half a granule each while a release runs and ends. Exactly one of the three
//! queues the next release: none would leave the granule mapped above the threshold, two
//! would run two at once.

use std::collections::{HashMap, HashSet};

use loom::thread;

use super::{check_paths, must_fail, Seen, Shared};
use crate::error::Result;
use crate::resource::expandable::core::{Backing, Expander, ReleaseTrigger};
use crate::resource::stream_ordered::{EngineStream, Users};
use crate::sync::Arc;

const GRANULE: u64 = 1024;
/// Granules of the reservation: three in one range, or two ranges of two.
const GRANULES: usize = 4;
const BASE: u64 = 0x10_0000;

const TRIMMED: &str = "trimmed a granule";
const GREW: &str = "grew";
const MOVED: &str = "claimed a piece of the other range (moved)";
const RECALLED: &str = "served from what the trim held (recalled)";
const REFUSED: &str = "refused while the trim unmapped";
const FREE_QUEUED: &str = "a free queued the next release";
const END_QUEUED: &str = "the release's end queued the next";
const OVERLAPPED: &str = "a trim took while the other held granules";

/// What the fake device has been asked to do.
#[derive(Default)]
struct Book {
    mapped: HashSet<usize>,
    /// Granules of blocks handed out now.
    held: HashSet<usize>,
    /// Granules whose last use was queued on the stream before its free, at this position of
    /// the stream: the use may run until the stream is synchronized past it.
    pending: HashMap<usize, u64>,
    /// The stream's operations queued so far, and how many a synchronization saw finish.
    queued: u64,
    done: u64,
    trimmed: usize,
    grew: usize,
    /// Trims whose unmapping (after taking back what is still theirs) has ended.
    gave_back: usize,
}

type Books = Shared<std::sync::Mutex<Book>>;

fn book(b: &Books) -> std::sync::MutexGuard<'_, Book> {
    b.lock().expect("bookkeeping lock poisoned")
}

fn index(addr: u64) -> usize {
    ((addr - BASE) / GRANULE) as usize
}

struct FakeBacking(Books);

impl Backing for FakeBacking {
    fn base(&self) -> u64 {
        BASE
    }
    fn granule(&self) -> u64 {
        GRANULE
    }
    fn granules(&self) -> usize {
        GRANULES
    }
    fn map(&self, first: usize, count: usize) -> Result<()> {
        let mut b = book(&self.0);
        for i in first..first + count {
            assert!(b.mapped.insert(i), "granule {i} mapped twice");
        }
        b.grew += 1;
        Ok(())
    }
    unsafe fn unmap(&self, i: usize) -> Result<()> {
        let mut b = book(&self.0);
        assert!(
            !b.held.contains(&i),
            "granule {i} unmapped while a block in it is handed out"
        );
        if let Some(&at) = b.pending.get(&i) {
            assert!(
                b.done >= at,
                "granule {i} unmapped while work queued before its free may still run"
            );
        }
        assert!(b.mapped.remove(&i), "granule {i} unmapped but not mapped");
        b.trimmed += 1;
        Ok(())
    }
}

struct FakeInner(Books);

/// One stream; clones are the same stream.
#[derive(Clone)]
struct FakeStream(Arc<FakeInner>, Users);

impl FakeStream {
    /// The host waits for everything queued on the stream so far.
    fn synchronize(&self) {
        let mut b = book(&self.0 .0);
        b.done = b.queued;
    }
}

impl EngineStream for FakeStream {
    type Name = u64;
    fn uid(&self) -> u64 {
        1
    }
    fn name(&self) -> u64 {
        1
    }
    fn users(&self) -> usize {
        self.1.get()
    }
    fn set_kept(&self, kept: bool) {
        self.1.set_kept(kept)
    }
    fn order_before(&self, _: &Self) -> Result<()> {
        Ok(())
    }
    fn is_idle(&self) -> bool {
        false // one stream: nothing is ever ordered
    }
    fn activity(&self) -> Option<u64> {
        None
    }
}

type Pool = Expander<FakeStream, FakeBacking>;

/// Allocates a granule on `s`, queues a use of it and frees it (the use stays pending until
/// the stream is synchronized). Out of memory is allowed: a trim may hold the free granules.
fn use_once(pool: &Pool, s: &FakeStream) {
    use_granules(pool, s, 1);
}

/// [`use_once`] of a block of `granules` granules; whether it was served.
fn use_granules(pool: &Pool, s: &FakeStream, granules: usize) -> bool {
    let size = granules as u64 * GRANULE;
    let Ok(addr) = pool.heap.take(size, s, pool) else {
        return false;
    };
    let first = index(addr);
    {
        let mut b = book(&s.0 .0);
        for i in first..first + granules {
            assert!(
                b.mapped.contains(&i),
                "block handed out on unmapped granule {i}"
            );
            assert!(b.held.insert(i), "granule {i} handed out twice");
        }
        b.queued += 1;
        let at = b.queued;
        for i in first..first + granules {
            b.held.remove(&i);
            b.pending.insert(i, at);
        }
    }
    assert!(pool.heap.give(addr, size, s), "free refused");
    true
}

/// The resource's trim, on the fake stream: take the free granules (held for the trim), wait
/// for their streams, unmap what is still the trim's (a request at the maximum may have
/// recalled some into the lists).
fn trim(pool: &Pool) {
    trim_to(pool, 0);
}

/// The planted bug: trim waits for the stream *before* it takes the free granules out of the
/// lists, so a block freed between the wait and the take is unmapped with its work pending.
fn trim_synchronized_too_early(pool: &Pool, stream: &FakeStream) {
    stream.synchronize();
    let (ticket, taken) = pool.hold_free(0);
    pool.order_held(ticket, taken);
    // SAFETY: none: this is the bug.
    let (_, result) = unsafe { pool.unmap_ranges(pool.release_held(ticket)) };
    result.unwrap();
}

/// A user on one stream allocates and frees twice (growing when a trim took the free
/// granules) while another thread trims. One granule is mapped and free at the start.
fn user_vs_trim(seen: &Shared<Seen>, trimmer: fn(&Pool, &FakeStream)) {
    let books: Books = Shared::new(std::sync::Mutex::new(Book::default()));
    let pool = Arc::new(Expander::new(FakeBacking(books.clone()), 3 * GRANULE));
    let s = FakeStream(Arc::new(FakeInner(books.clone())), Users::new());
    pool.map_initial(GRANULE).unwrap();
    use_once(&pool, &s);

    let user = {
        let (pool, s) = (pool.clone(), s.clone());
        thread::spawn(move || {
            use_once(&pool, &s);
            use_once(&pool, &s);
        })
    };
    let trimmer_thread = {
        let (pool, s) = (pool.clone(), s.clone());
        thread::spawn(move || trimmer(&pool, &s))
    };
    user.join().unwrap();
    trimmer_thread.join().unwrap();

    pool.heap.check().expect("free-list invariants");
    let b = book(&books);
    assert!(b.held.is_empty());
    assert_eq!(
        pool.stats().free_bytes,
        b.mapped.len() as u64 * GRANULE,
        "mapped memory lost, or free memory on unmapped granules"
    );
    assert_eq!(pool.reserved(), b.mapped.len() as u64 * GRANULE);
    seen.note(TRIMMED, b.trimmed > 0);
    seen.note(GREW, b.grew > 1);
}

#[test]
fn trim_vs_use_and_growth() {
    check_paths(Some(2), &[TRIMMED, GREW], |seen| {
        user_vs_trim(seen, |pool, _| trim(pool))
    });
}

/// Bug: trim waits for the stream before it takes the granules out of the lists. Only the
/// interleavings where the user frees between the two show it.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_synchronized_before_take() {
    must_fail(
        module_path!(),
        "planted_synchronized_before_take",
        "while work queued before its free may still run",
        || {
            check_paths(Some(2), &[], |seen| {
                user_vs_trim(seen, trim_synchronized_too_early)
            })
        },
    );
}

/// The initial memory in two pieces, one per range, that belong to no shard; one user asks for
/// two granules (it claims its range's piece, then moves the other range's into its own, where
/// they coalesce) while another thread trims (which releases unclaimed pieces first). Within a
/// maximum of two granules: the move must unmap before it maps.
fn claim_vs_trim(seen: &Shared<Seen>) {
    let books: Books = Shared::new(std::sync::Mutex::new(Book::default()));
    let pool = Arc::new(
        Expander::with_regions(FakeBacking(books.clone()), 2 * GRANULE, 2).with_split_min(GRANULE),
    );
    let s = FakeStream(Arc::new(FakeInner(books.clone())), Users::new());
    pool.map_initial(2 * GRANULE).unwrap();
    assert_eq!(
        pool.stats().free_bytes,
        2 * GRANULE,
        "unclaimed pieces are free"
    );

    let user = {
        let (pool, s) = (pool.clone(), s.clone());
        thread::spawn(move || served_unless_a_trim_gave_back(&pool, &s, 2))
    };
    let trimmer_thread = {
        let pool = pool.clone();
        thread::spawn(move || trim(&pool))
    };
    user.join().unwrap();
    trimmer_thread.join().unwrap();

    pool.heap.check().expect("free-list invariants");
    let b = book(&books);
    assert!(b.held.is_empty());
    assert!(b.mapped.len() <= 2, "mapped above the maximum");
    assert_eq!(
        pool.stats().free_bytes,
        b.mapped.len() as u64 * GRANULE,
        "mapped memory lost, or free memory on unmapped granules"
    );
    assert_eq!(pool.reserved(), b.mapped.len() as u64 * GRANULE);
    seen.note(MOVED, pool.claim_moves() > 0);
    seen.note(RECALLED, pool.trim_counts().0 > 0);
    seen.note(TRIMMED, b.trimmed > 0);
}

#[test]
fn claims_of_the_initial_pieces_vs_trim() {
    check_paths(Some(2), &[MOVED, RECALLED, TRIMMED], claim_vs_trim);
}

/// The maximum is one granule, mapped, its last use still pending on the stream and its block
/// free. A trim takes it out (held for the trim) and waits for the stream, while a user asks
/// for a granule: at the maximum, the user recalls what the trim holds and is served from it,
/// whichever comes first; the trim then unmaps only what is still its own. Before the recall
/// the user was refused (`tests/trim_cancel.rs`).
fn request_at_the_maximum_vs_trim(seen: &Shared<Seen>) {
    let books: Books = Shared::new(std::sync::Mutex::new(Book::default()));
    let pool = Arc::new(Expander::new(FakeBacking(books.clone()), GRANULE));
    let s = FakeStream(Arc::new(FakeInner(books.clone())), Users::new());
    pool.map_initial(GRANULE).unwrap();
    use_once(&pool, &s);

    let user = {
        let (pool, s) = (pool.clone(), s.clone());
        thread::spawn(move || served_unless_a_trim_gave_back(&pool, &s, 1))
    };
    let trimmer_thread = {
        let pool = pool.clone();
        thread::spawn(move || trim(&pool))
    };
    let served = user.join().unwrap();
    trimmer_thread.join().unwrap();

    pool.heap.check().expect("free-list invariants");
    let b = book(&books);
    assert!(b.mapped.len() <= 1, "mapped above the maximum");
    assert_eq!(
        pool.stats().free_bytes,
        b.mapped.len() as u64 * GRANULE,
        "mapped memory lost, or free memory on unmapped granules"
    );
    assert_eq!(pool.reserved(), b.mapped.len() as u64 * GRANULE);
    seen.note(RECALLED, pool.trim_counts().0 > 0);
    seen.note(TRIMMED, b.trimmed > 0);
    seen.note(REFUSED, !served);
}

/// Bound 2: 2 threads.
#[test]
fn a_request_at_the_maximum_recalls_what_a_trim_holds() {
    check_paths(
        Some(2),
        &[RECALLED, TRIMMED],
        request_at_the_maximum_vs_trim,
    );
}

/// [`use_granules`], which may be refused only while a trim gives memory back: a trim released
/// what it held before the request ended, and had not ended its unmapping when the request
/// began (the window `held_for_trim.rs` documents: the give-back runs with no lock held).
/// Whether it was served.
fn served_unless_a_trim_gave_back(pool: &Pool, s: &FakeStream, granules: usize) -> bool {
    let ended_before = book(&s.0 .0).gave_back;
    let served = use_granules(pool, s, granules);
    let released_by_now = pool.trim_counts().1;
    assert!(
        served || released_by_now > ended_before,
        "refused at the maximum with no trim giving memory back (the trim held it, or had \
         put it back)"
    );
    served
}

/// The same as [`request_at_the_maximum_vs_trim`], but the trim ends early (its future dropped
/// while it waits, or a failed synchronization) and puts the granule back: a request at the
/// maximum finds it held or back in the lists, never in between, and is served (a review found
/// it refused when the put-back ran after the held list's lock was let go).
fn request_at_the_maximum_vs_cancelled_trim(seen: &Shared<Seen>) {
    let books: Books = Shared::new(std::sync::Mutex::new(Book::default()));
    let pool = Arc::new(Expander::new(FakeBacking(books.clone()), GRANULE));
    let s = FakeStream(Arc::new(FakeInner(books.clone())), Users::new());
    pool.map_initial(GRANULE).unwrap();
    use_once(&pool, &s);

    let user = {
        let (pool, s) = (pool.clone(), s.clone());
        thread::spawn(move || use_granules(&pool, &s, 1))
    };
    let trimmer_thread = {
        let pool = pool.clone();
        thread::spawn(move || {
            let (ticket, _) = pool.hold_free(0);
            // Ended while it waits: as `TakenForTrim::drop` (expandable/mod.rs).
            pool.put_back_held(ticket);
        })
    };
    let served = user.join().unwrap();
    trimmer_thread.join().unwrap();
    assert!(
        served,
        "refused at the maximum: the ended trim's granule was in neither the held list nor the \
         lists"
    );
    pool.heap.check().expect("free-list invariants");
    assert_eq!(pool.stats().free_bytes, GRANULE, "the granule lost");
    seen.note(RECALLED, pool.trim_counts().0 > 0);
}

/// Bound 2: 2 threads.
#[test]
fn a_request_at_the_maximum_vs_a_cancelled_trim() {
    check_paths(
        Some(2),
        &[RECALLED],
        request_at_the_maximum_vs_cancelled_trim,
    );
}

/// Bug: the trim unmaps everything it took, though the user recalled the granule into the
/// lists and was handed it (its use then queued after the trim's wait).
#[test]
#[ignore = "planted bug: must fail"]
fn planted_trim_ignores_recall() {
    must_fail(
        module_path!(),
        "planted_trim_ignores_recall",
        "while work queued before its free may still run",
        || {
            crate::resource::stream_ordered::planted::TRIM_IGNORES_RECALL
                .store(true, std::sync::atomic::Ordering::Relaxed);
            check_paths(Some(2), &[], request_at_the_maximum_vs_trim);
        },
    );
}

/// Bug: the trim notes a granule as its own, ordered, though the user recalled it into the
/// lists while the trim ordered it (with the locks let go): the trim unmaps it, and the lists
/// keep it as free memory.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_replace_ignores_recall() {
    must_fail(
        module_path!(),
        "planted_replace_ignores_recall",
        "mapped memory lost, or free memory on unmapped granules",
        || {
            crate::resource::stream_ordered::planted::REPLACE_IGNORES_RECALL
                .store(true, std::sync::atomic::Ordering::Relaxed);
            check_paths(Some(2), &[], request_at_the_maximum_vs_trim);
        },
    );
}

/// A release is running (queued by a free of a granule) when two frees of half a granule each
/// come, and it ends meanwhile: whichever interleaving, exactly one of them queues the next
/// release, and it starts from a count of 0.
fn frees_vs_the_release_ending(seen: &Shared<Seen>) {
    let trigger = Arc::new(ReleaseTrigger::new(GRANULE));
    assert!(trigger.freed(GRANULE, || true), "the first release");
    let frees: Vec<_> = (0..2)
        .map(|_| {
            let trigger = trigger.clone();
            thread::spawn(move || trigger.freed(GRANULE / 2, || true))
        })
        .collect();
    let again = trigger.ended(|| true);
    let freed: Vec<bool> = frees.into_iter().map(|t| t.join().unwrap()).collect();
    let queued = freed.iter().filter(|&&q| q).count() + usize::from(again);
    assert_eq!(
        queued, 1,
        "releases queued for a granule freed while one ran (by the frees {freed:?}, by the end {again})"
    );
    seen.note(FREE_QUEUED, !again);
    seen.note(END_QUEUED, again);
    // The one queued runs and ends with nothing freed meanwhile: none is pending, and a
    // granule freed after it queues the next.
    assert!(
        !trigger.ended(|| true),
        "a release queued with nothing freed"
    );
    assert!(
        !trigger.freed(GRANULE / 2, || true),
        "queued for half a granule"
    );
    assert!(
        trigger.freed(GRANULE / 2, || true),
        "a granule freed, nothing queued"
    );
}

#[test]
fn frees_during_an_automatic_release() {
    check_paths(
        Some(2),
        &[FREE_QUEUED, END_QUEUED],
        frees_vs_the_release_ending,
    );
}

/// Bug: the end of a release only clears its pending bit (`RELEASE_END_ONLY_CLEARS`, the
/// protocol before a review's finding): the frees that found it pending queued nothing, and
/// nobody queues the next release for them.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_release_end_only_clears() {
    must_fail(
        module_path!(),
        "planted_release_end_only_clears",
        "releases queued for a granule freed while one ran",
        || {
            crate::resource::stream_ordered::planted::RELEASE_END_ONLY_CLEARS
                .store(true, std::sync::atomic::Ordering::Relaxed);
            check_paths(Some(2), &[], frees_vs_the_release_ending);
        },
    );
}

/// A trim down to `keep` bytes (take the free granules past it, held for the trim; order
/// each onto one of its streams with the locks let go; wait for those streams; unmap what is
/// still the trim's): whether it took while another trim held granules it had not unmapped
/// yet.
fn trim_to(pool: &Pool, keep: u64) -> bool {
    let (ticket, taken) = pool.hold_free(keep);
    // Another trim's granules out of the lists while this one took (or found nothing left to).
    let mine: u64 = taken.iter().map(|t| t.1).sum();
    let overlapped = pool.trimming() > mine;
    let (streams, _) = pool.order_held(ticket, taken);
    for stream in &streams {
        stream.synchronize();
    }
    let still_held = pool.release_held(ticket);
    // SAFETY: (of the model) each range's stream was synchronized after it was taken.
    let (_, result) = unsafe { pool.unmap_ranges(still_held) };
    result.unwrap();
    book(&pool.backing.0).gave_back += 1;
    pool.unmapped_held();
    overlapped
}

/// Three granules mapped and free (used once on a stream, their use still pending), two trims
/// to one granule at once: one stays mapped.
fn two_trims(seen: &Shared<Seen>) {
    let books: Books = Shared::new(std::sync::Mutex::new(Book::default()));
    let pool = Arc::new(Expander::new(FakeBacking(books.clone()), 3 * GRANULE));
    let s = FakeStream(Arc::new(FakeInner(books.clone())), Users::new());
    pool.map_initial(3 * GRANULE).unwrap();
    assert!(use_granules(&pool, &s, 3), "the three granules in use once");
    let trims: Vec<_> = (0..2)
        .map(|_| {
            let pool = pool.clone();
            thread::spawn(move || trim_to(&pool, GRANULE))
        })
        .collect();
    // Every trim joined (`any` alone would stop at the first that overlapped).
    let overlaps: Vec<bool> = trims.into_iter().map(|t| t.join().unwrap()).collect();
    let overlapped = overlaps.contains(&true);
    pool.heap.check().expect("free-list invariants");
    let b = book(&books);
    assert!(
        b.mapped.len() as u64 * GRANULE >= GRANULE,
        "two trims to one granule left {} mapped",
        b.mapped.len()
    );
    assert_eq!(pool.reserved(), b.mapped.len() as u64 * GRANULE);
    assert_eq!(
        pool.stats().free_bytes,
        b.mapped.len() as u64 * GRANULE,
        "mapped memory lost, or free memory on unmapped granules"
    );
    seen.note(OVERLAPPED, overlapped);
}

/// Bound 2: 2 threads.
#[test]
fn two_trims_keep_what_they_were_asked_to() {
    check_paths(Some(2), &[OVERLAPPED], two_trims);
}

/// Bug: each trim ignores what the other took (`TRIMMING_IGNORED`).
#[test]
#[ignore = "planted bug: must fail"]
fn planted_trimming_ignored() {
    must_fail(
        module_path!(),
        "planted_trimming_ignored",
        "two trims to one granule left",
        || {
            crate::resource::stream_ordered::planted::TRIMMING_IGNORED
                .store(true, std::sync::atomic::Ordering::Relaxed);
            check_paths(Some(2), &[], two_trims);
        },
    );
}
