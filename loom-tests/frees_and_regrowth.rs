//! Models of paths of the pool's shared free list (src/resource/stream_ordered/) that the
//! models of `free_lists` do not drive, the first two on the same fake streams and fake GPU:
//!
//! - [`forget_vs_take`]: `trim` letting go of a stream (`idle_streams`, a host wait, then
//!   `forget`, which drops the stream from every free block's tag) racing a request on another
//!   stream for memory that stream freed. Either the request waits for the stream on the GPU,
//!   or the host had seen its work finish; and a stream that is not idle is never forgotten (a
//!   free on it after the host's wait would lose its ordering).
//! - [`put_back_vs_forget`]: memory going back upstream is ordered onto a stream the user
//!   dropped, its release fails and it goes back into the lists tagged with that stream, while
//!   `trim` lets go of the stream: the engine queued a wait on it after the host's wait, so
//!   `forget` must find it busy and keep it.
//! - [`regrow_at_max`]: the pool at its maximum gives whole free chunks back upstream and grows
//!   a larger one (the give-back-and-regrow path of `PoolResource::grow`: the crate's pool over
//!   `CudaAsyncResource` on the simulated device run inline, whose race detector checks the
//!   stream order), while the stream that freed the chunk reuses its own memory. The chunk must
//!   go back on the stream it was freed on, so that its release is ordered after its last use
//!   and the upstream orders its next user after that stream (issue 16: "the loom model of the
//!   pool's give-back-and-regrow path").
//!
//! Each has a planted bug, switched on in src (`stream_ordered::planted`, loom builds only),
//! that its model catches (`planted_*` below, run with `--ignored`).

use loom::thread;

use super::free_lists::{book, out_of_memory, streams, Book, FakeStream, BASE, BLOCK};
use super::{check_paths, must_fail, Seen, Shared};
use crate::error::Result;
use crate::resource::stream_ordered::{Grow, StreamHeap};
use crate::sync::Arc;

const FORGOTTEN: &str = "forgotten before the take";
const WAITED: &str = "the take waited on the GPU";
const REGREW: &str = "gave back and regrew";
const OUT_OF_MEMORY: &str = "out of memory";

type Lists = StreamHeap<FakeStream>;

/// Stream 0 used a block and freed it. A `trim` thread lets go of idle streams (host wait, then
/// `forget`) while this thread takes the block on stream 1. With `user_keeps_s0`, stream 0's
/// user still holds the stream and uses and frees a second block on it meanwhile: stream 0 is
/// not idle and must not be forgotten.
fn forget_vs_take(seen: &Shared<Seen>, user_keeps_s0: bool) {
    let s = streams(2);
    let (s0, s1) = (s[0].clone(), s[1].clone());
    drop(s);
    let gpu = s1.inner.gpu.clone();
    let lists = Arc::new(Lists::new());
    lists.add_chunk(BASE, 2 * BLOCK);
    lists.give_fresh(BASE, 2 * BLOCK);
    let a = lists.take(BLOCK, &s0, &NoRoom).unwrap();
    book(&gpu).took("setup", s0.index(), a);
    let b = lists.take(BLOCK, &s0, &NoRoom).unwrap();
    book(&gpu).took("setup", s0.index(), b);
    book(&gpu).freeing(s0.index(), a);
    assert!(lists.give(a, BLOCK, &s0));
    let user = user_keeps_s0.then(|| {
        let (lists, s0) = (lists.clone(), s0.clone());
        thread::spawn(move || {
            book(&s0.inner.gpu).queue(s0.index());
            book(&s0.inner.gpu).freeing(s0.index(), b);
            assert!(lists.give(b, BLOCK, &s0));
        })
    });
    if !user_keeps_s0 {
        book(&gpu).freeing(s0.index(), b);
        assert!(lists.give(b, BLOCK, &s0));
    }
    drop(s0);
    let trim = {
        let lists = lists.clone();
        thread::spawn(move || {
            for stream in lists.idle_streams() {
                book(&stream.inner.gpu).synchronize(stream.index());
                lists.forget(stream);
            }
        })
    };
    let waits = lists.stats().waits;
    let mut took = Vec::new();
    for _ in 0..2 {
        if let Ok(x) = lists.take(BLOCK, &s1, &NoRoom) {
            book(&gpu).took("taker", s1.index(), x);
            took.push(x);
        }
    }
    trim.join().unwrap();
    if let Some(user) = user {
        user.join().unwrap();
    }
    let waited = lists.stats().waits > waits;
    seen.note(WAITED, waited);
    seen.note(FORGOTTEN, !took.is_empty() && !waited);
    for x in took {
        book(&gpu).freeing(s1.index(), x);
        assert!(lists.give(x, BLOCK, &s1));
    }
    lists.check().expect("free-list invariants");
    assert_eq!(lists.stats().free_bytes, 2 * BLOCK, "memory lost");
}

/// Bound 3: 2 threads.
#[test]
fn a_take_racing_a_forget_is_ordered() {
    check_paths(Some(3), &[FORGOTTEN, WAITED], |seen| {
        forget_vs_take(seen, false)
    });
}

/// Bound 3: 3 threads.
#[test]
fn a_stream_in_use_is_not_forgotten() {
    check_paths(Some(3), &[WAITED], |seen| forget_vs_take(seen, true));
}

/// An upstream with no room at all.
struct NoRoom;

impl Grow<FakeStream> for NoRoom {
    fn grow(&self, min: u64, _: &FakeStream) -> Result<(u64, u64)> {
        Err(out_of_memory(min))
    }
}

/// A request size of the pool model (`regrow_at_max`).
const PIECE: usize = 256;

/// The pool's growth at its maximum: the crate's `PoolResource::grow` (give whole free chunks
/// back upstream, grow one large enough), on the simulated device run inline with its race
/// detector in the `Panic` mode, over `CudaAsyncResource` (a stream-ordered upstream: a chunk
/// given back on stream D is a `cuMemFreeAsync` on D, and the detector checks that the free is
/// ordered after every use of the chunk, and a reuse after the free). The maximum is two
/// pieces; the pool holds one chunk of one piece, which stream 0 wrote and freed, so a request
/// of two pieces on stream 1 must give it back and regrow, while stream 0's thread reuses its
/// own memory. The chunk must go back on stream 0, the stream it was freed on.
fn regrow_at_max(seen: &Shared<Seen>) {
    use crate::resource::cuda_async::{CudaAsyncOptions, CudaAsyncResource};
    use crate::resource::pool::{PoolOptions, PoolResource};
    use crate::{Device, MemoryAccess, MemoryResource, RaceDetection, SimConfig};

    let device = Device::simulated(SimConfig {
        race_detection: RaceDetection::Panic,
        ..SimConfig::default()
    });
    let upstream = CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap();
    let pool = Arc::new(
        PoolResource::new(
            upstream,
            PoolOptions {
                initial: PIECE,
                maximum: Some(2 * PIECE),
                ..PoolOptions::default()
            },
        )
        .unwrap(),
    );
    let (s0, s1) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let a = pool.allocate(PIECE, &s0).unwrap();
    s0.declare_access(a, PIECE, MemoryAccess::Write, "s0_writes_a")
        .unwrap();

    let owner = {
        let (pool, s0) = (pool.clone(), s0.clone());
        thread::spawn(move || {
            // SAFETY: `a` came from the pool with these bytes, is freed once, and its use is
            // queued on s0 before this point.
            unsafe { pool.deallocate(a, PIECE, &s0) }.unwrap();
            // Reuse on the same stream, racing the give-back.
            if let Ok(x) = pool.allocate(PIECE, &s0) {
                s0.declare_access(x, PIECE, MemoryAccess::Write, "s0_reuses")
                    .unwrap();
                // SAFETY: as above.
                unsafe { pool.deallocate(x, PIECE, &s0) }.unwrap();
            }
        })
    };
    let regrower = {
        let (pool, s1) = (pool.clone(), s1.clone());
        thread::spawn(move || match pool.allocate(2 * PIECE, &s1) {
            Ok(big) => {
                s1.declare_access(big, 2 * PIECE, MemoryAccess::Write, "s1_writes_big")
                    .unwrap();
                // SAFETY: as above, on s1.
                unsafe { pool.deallocate(big, 2 * PIECE, &s1) }.unwrap();
                true
            }
            Err(e) => {
                assert!(e.is_out_of_memory(), "unexpected error: {e}");
                false
            }
        })
    };
    owner.join().unwrap();
    let grown = regrower.join().unwrap();
    seen.note(REGREW, grown);
    seen.note(OUT_OF_MEMORY, !grown);
    pool.check_invariants().expect("free-list invariants");
    assert_eq!(device.races(), Vec::new());
}

/// Bound 3: 2 threads.
#[test]
fn give_back_and_regrow_at_the_maximum() {
    check_paths(Some(3), &[REGREW, OUT_OF_MEMORY], regrow_at_max);
}

/// The set-up of [`release_vs_forget`] and [`put_back_vs_forget`]: a chunk of two blocks,
/// one freed on stream 0 (then dropped by its user: idle, its work queued before) and one on
/// stream 1 (held, its work queued), and a `trim` thread that waits for every idle stream on
/// the host and forgets it. Returns stream 1 (its user's handle: the caller holds it to the
/// end), stream 2 (for the caller's own use), the fake GPU's book, the lists and the `trim`
/// thread.
fn chunk_freed_on_two_streams_then_a_trim() -> (
    FakeStream,
    FakeStream,
    Book,
    Arc<Lists>,
    thread::JoinHandle<()>,
) {
    let s = streams(3);
    let (s0, s1, third) = (s[0].clone(), s[1].clone(), s[2].clone());
    drop(s);
    let gpu = s1.inner.gpu.clone();
    let lists = Arc::new(Lists::new());
    lists.add_chunk(BASE, 2 * BLOCK);
    lists.give_fresh(BASE, 2 * BLOCK);
    let a = lists.take(BLOCK, &s0, &NoRoom).unwrap();
    book(&gpu).took("setup", s0.index(), a);
    let b = lists.take(BLOCK, &s1, &NoRoom).unwrap();
    book(&gpu).took("setup", s1.index(), b);
    for (stream, block) in [(&s0, a), (&s1, b)] {
        book(&gpu).queue(stream.index());
        book(&gpu).freeing(stream.index(), block);
        assert!(lists.give(block, BLOCK, stream));
    }
    drop(s0);
    let trim = {
        let lists = lists.clone();
        thread::spawn(move || {
            for stream in lists.idle_streams() {
                book(&stream.inner.gpu).synchronize(stream.index());
                lists.forget(stream);
            }
        })
    };
    (s1, third, gpu, lists, trim)
}

/// A whole chunk freed on two streams, 0 (dropped by its user, idle) and 1 (its user still
/// holds it, and its work is queued), goes back upstream (`take_whole_chunks`, as the pool at
/// its maximum or `trim` does) while a `trim` thread lets go of stream 0. The chunk is taken
/// out of its shard before it is ordered onto one of its streams, so the forget can fall in
/// between: the release must still come after stream 1's work (a review's finding: only the
/// tag's first stream was looked at, and that one forgotten, the chunk went back as fresh).
fn release_vs_forget(seen: &Shared<Seen>) {
    let (_s1, own, gpu, lists, trim) = chunk_freed_on_two_streams_then_a_trim();
    let released = lists.take_whole_chunks(&[(BASE, 2 * BLOCK)]);
    trim.join().unwrap();
    assert_eq!(released.len(), 1, "the whole chunk was not taken out");
    let (base, size, on) = &released[0];
    seen.note(RELEASED_ON_1, on.as_ref().is_some_and(|s| s.index() == 1));
    // Given back on `on` (or the pool's own stream for fresh memory): the upstream's next
    // user of the range is ordered after that point of it.
    let on = on.as_ref().unwrap_or(&own);
    book(&gpu).order(on.index(), own.index());
    for block in (0..*size / BLOCK).map(|i| base + i * BLOCK) {
        book(&gpu).took("the upstream's next user", own.index(), block);
    }
    lists.remove_chunk(BASE);
    lists.check().expect("free-list invariants");
}

const RELEASED_ON_1: &str = "released on stream 1";

/// Bound 3: 2 threads.
#[test]
fn a_release_racing_a_forget_waits_for_every_live_stream() {
    check_paths(Some(3), &[RELEASED_ON_1], release_vs_forget);
}

/// [`release_vs_forget`], with the release failing: the chunk goes back into the lists tagged
/// with the stream it was ordered onto (the pool's `put_back`, after a failed upstream free or
/// a trim ended early), and a third stream then takes it. When that stream is 0, it was made
/// to wait for stream 1 after the `trim` thread's host wait for it: the `trim` thread must not
/// forget it (clearing the tag) until that wait is over too (a review's finding: the chunk was
/// handed out, or given back upstream, with stream 1's work still running).
fn put_back_vs_forget(seen: &Shared<Seen>) {
    let (_s1, taker, gpu, lists, trim) = chunk_freed_on_two_streams_then_a_trim();
    let released = lists.take_whole_chunks(&[(BASE, 2 * BLOCK)]);
    assert_eq!(released.len(), 1, "the whole chunk was not taken out");
    for (base, size, on) in released {
        seen.note(
            ONTO_THE_DROPPED_STREAM,
            on.as_ref().is_some_and(|s| s.index() == 0),
        );
        match on {
            Some(on) => lists.give_blocks_to(&[(base, size)], &on),
            None => lists.give_fresh_blocks(&[(base, size)]),
        }
    }
    trim.join().unwrap();
    for _ in 0..2 {
        let x = lists.take(BLOCK, &taker, &NoRoom).unwrap();
        book(&gpu).took("taker", taker.index(), x);
    }
    lists.check().expect("free-list invariants");
}

const ONTO_THE_DROPPED_STREAM: &str = "ordered onto the dropped stream, put back";

/// Bound 3: 2 threads.
#[test]
fn a_release_put_back_waits_for_the_stream_it_was_ordered_onto() {
    check_paths(Some(3), &[ONTO_THE_DROPPED_STREAM], put_back_vs_forget);
}

// ---------------------------------------------------------------------------------------------
// Planted bugs, switched on in src for one model each (in a child process: see `must_fail`).
// ---------------------------------------------------------------------------------------------

use crate::resource::stream_ordered::planted;
use std::sync::atomic::Ordering::Relaxed;

/// Bug: `idle_streams` names every stream and `forget` lets go of one that its user still
/// holds: a block freed on it after the host's wait loses its ordering.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_stream_in_use_forgotten() {
    must_fail(
        module_path!(),
        "planted_stream_in_use_forgotten",
        "a reuse not ordered behind the free",
        || {
            planted::IDLE_IGNORES_HANDLES.store(true, Relaxed);
            check_paths(Some(3), &[], |seen| forget_vs_take(seen, true));
        },
    );
}

/// Bug: whole chunks freed on streams are reported as fresh, so the pool gives them back on
/// its own stream: the release (`cuMemFreeAsync` on the pool's stream) is not ordered after
/// stream 0's use of the chunk, which the detector reports.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_chunks_released_as_fresh() {
    must_fail(
        module_path!(),
        "planted_chunks_released_as_fresh",
        "is not ordered after s0_writes_a",
        || {
            planted::CHUNKS_AS_FRESH.store(true, Relaxed);
            check_paths(Some(3), &[], regrow_at_max);
        },
    );
}

/// Bug: memory taken out for release is ordered onto the tag's first stream only, and needs
/// nothing if that one was forgotten meanwhile.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_release_onto_the_first_stream_only() {
    must_fail(
        module_path!(),
        "planted_release_onto_the_first_stream_only",
        "which is ordered after only",
        || {
            planted::ONTO_FIRST_ONLY.store(true, Relaxed);
            check_paths(Some(3), &[], release_vs_forget);
        },
    );
}

/// Bug: `forget` lets go of a stream without asking whether it is still idle: the wait for
/// stream 1 that a release queued on it after the `trim` thread's host wait is taken as seen.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_forget_ignores_later_work() {
    must_fail(
        module_path!(),
        "planted_forget_ignores_later_work",
        "which is ordered after only",
        || {
            planted::FORGET_IGNORES_LATER_WORK.store(true, Relaxed);
            check_paths(Some(3), &[], put_back_vs_forget);
        },
    );
}
