//! Models of two paths of the pool's free lists (src/resource/stream_ordered/) that the models
//! of `free_lists` do not drive, on the same fake streams and fake GPU:
//!
//! - [`free_vs_retire`]: a free of a block handed out on a stream the user has dropped, on
//!   another stream, racing `retire_idle` (the trim that folds dropped streams' lists), which
//!   moves the block's live entry out of the list being retired. The free must find the entry
//!   wherever it is: a refused free of a good pointer would leak the block (issue 16's live-block
//!   table).
//! - [`regrow_at_max`]: the pool at its maximum gives whole free chunks back upstream and grows
//!   a larger one (the give-back-and-regrow path of `PoolResource::grow`, mirrored here on
//!   [`AtMax`]), while the stream that freed the chunk reuses its own memory. The chunk must go
//!   back on the stream it was freed on, so that the upstream orders its next user after that
//!   stream (issue 16: "the loom model of the pool's give-back-and-regrow path").
//!
//! Each has a planted bug, switched on in src (`stream_ordered::planted`, loom builds only),
//! that its model catches (`planted_*` below, run with `--ignored`).

use loom::thread;

use super::free_lists::{book, out_of_memory, streams, Book, FakeStream, BASE, BLOCK};
use super::{check_paths, must_fail, Seen, Shared};
use crate::error::Result;
use crate::resource::stream_ordered::{Grow, StreamLists};
use crate::sync::Arc;

const RETIRED_FIRST: &str = "retire returned before the free";
const FREED_FIRST: &str = "free returned before the retire";
const REGREW: &str = "gave back and regrew";
const OUT_OF_MEMORY: &str = "out of memory";

type Lists = StreamLists<FakeStream>;

/// Stream 0's user took a block and dropped the stream; another thread frees the block on
/// stream 1 while this one runs `retire_idle`, which moves stream 0's live entries aside.
fn free_vs_retire(seen: &Shared<Seen>) {
    let s = streams(2);
    let (s0, s1) = (s[0].clone(), s[1].clone());
    drop(s);
    let gpu = s1.inner.gpu.clone();
    let lists = Arc::new(Lists::new());
    lists.add_chunk(BASE, BLOCK);
    lists.give_fresh(BASE, BLOCK);
    let a = lists.take(BLOCK, &s0, &NoRoom).unwrap();
    book(&gpu).took("setup", s0.index(), a);
    drop(s0);

    // A std flag (invisible to loom): which of the two returned first, to name the paths.
    let freed = Shared::new(std::sync::atomic::AtomicBool::new(false));
    let freer = {
        let (lists, s1, freed) = (lists.clone(), s1.clone(), freed.clone());
        thread::spawn(move || {
            book(&s1.inner.gpu).freeing(s1.index(), a);
            assert!(
                lists.give(a, BLOCK, &s1),
                "a good free was refused while its list was retired"
            );
            freed.store(true, std::sync::atomic::Ordering::Relaxed);
        })
    };
    let retired = lists.retire_idle();
    let freed_first = freed.load(std::sync::atomic::Ordering::Relaxed);
    freer.join().unwrap();
    // The retired list held no free memory (its block was in use, then freed on stream 1).
    let blocks: usize = retired.iter().map(|(_, b)| b.len()).sum();
    assert_eq!(blocks, 0, "the retired list held free memory");
    seen.note(RETIRED_FIRST, !freed_first);
    seen.note(FREED_FIRST, freed_first);
    lists.check().expect("free-list invariants");
    assert_eq!(lists.free_bytes(), BLOCK, "the block was lost");
}

/// Bound 3: 2 threads.
#[test]
fn a_free_racing_a_retire_finds_its_block() {
    check_paths(Some(3), &[RETIRED_FIRST, FREED_FIRST], free_vs_retire);
}

/// An upstream with no room at all.
struct NoRoom;

impl Grow<FakeStream> for NoRoom {
    fn grow(&self, min: u64, _: &FakeStream) -> Result<(u64, u64)> {
        Err(out_of_memory(min))
    }
}

/// The pool's growth at its maximum (`PoolResource::grow`), over an upstream that orders its
/// memory by stream as a stream-ordered upstream does: a chunk given back on stream D is handed
/// out again to a request on S only after S waits on D. The maximum is two blocks; the pool
/// holds one chunk of one block, so a request of two blocks must give it back and regrow.
struct AtMax {
    lists: Arc<Lists>,
    gpu: Book,
    /// The pool's chunks (base, size).
    chunks: std::sync::Mutex<Vec<(u64, u64)>>,
    /// The stream index each released chunk was given back on.
    released_on: std::sync::Mutex<Vec<usize>>,
    /// The pool's own stream (for fresh memory).
    own: FakeStream,
}

const MAXIMUM: u64 = 2 * BLOCK;

impl Grow<FakeStream> for AtMax {
    fn grow(&self, min: u64, stream: &FakeStream) -> Result<(u64, u64)> {
        let reserved = |chunks: &[(u64, u64)]| chunks.iter().map(|c| c.1).sum::<u64>();
        let held = self.chunks.lock().unwrap().clone();
        if min > MAXIMUM - reserved(&held) {
            for (base, size, freed_on) in self.lists.take_whole_chunks(&held) {
                self.chunks.lock().unwrap().retain(|c| c.0 != base);
                self.lists.remove_chunk(base);
                let on = freed_on.as_ref().unwrap_or(&self.own);
                // Given back on `on`: the upstream's next user of the range waits on it.
                self.released_on.lock().unwrap().push(on.index());
                let _ = size;
            }
        }
        let mut chunks = self.chunks.lock().unwrap();
        if min > MAXIMUM - reserved(&chunks) || chunks.iter().any(|c| c.0 == BASE) {
            return Err(out_of_memory(min));
        }
        // The upstream hands out the range it got back, ordered after its release.
        for from in self.released_on.lock().unwrap().drain(..) {
            book(&self.gpu).order(from, stream.index());
        }
        chunks.push((BASE, min));
        Ok((BASE, min))
    }
}

fn regrow_at_max(seen: &Shared<Seen>) {
    let s = streams(3);
    let (s0, s1, own) = (s[0].clone(), s[1].clone(), s[2].clone());
    drop(s);
    let gpu = s0.inner.gpu.clone();
    // No merge of busy lists before growing: the chunk stays in stream 0's list, so only the
    // release on stream 0 orders stream 1 after its last use.
    let lists = Arc::new(Lists::with_merge_limit(0));
    lists.add_chunk(BASE, BLOCK);
    lists.give_fresh(BASE, BLOCK);
    let upstream = AtMax {
        lists: lists.clone(),
        gpu: gpu.clone(),
        chunks: std::sync::Mutex::new(vec![(BASE, BLOCK)]),
        released_on: std::sync::Mutex::new(Vec::new()),
        own,
    };
    let a = lists.take(BLOCK, &s0, &NoRoom).unwrap();
    book(&gpu).took("setup", s0.index(), a);

    let owner = {
        let (lists, s0) = (lists.clone(), s0.clone());
        thread::spawn(move || {
            book(&s0.inner.gpu).freeing(s0.index(), a);
            assert!(lists.give(a, BLOCK, &s0));
            // Reuse on the same stream, racing the give-back.
            if let Ok(x) = lists.take(BLOCK, &s0, &NoRoom) {
                book(&s0.inner.gpu).took("owner", s0.index(), x);
                book(&s0.inner.gpu).freeing(s0.index(), x);
                assert!(lists.give(x, BLOCK, &s0));
            }
        })
    };
    let grown = match lists.take(2 * BLOCK, &s1, &upstream) {
        Ok(addr) => {
            for block in [addr, addr + BLOCK] {
                book(&gpu).took("regrower", s1.index(), block);
            }
            for block in [addr, addr + BLOCK] {
                book(&gpu).freeing(s1.index(), block);
            }
            assert!(lists.give(addr, 2 * BLOCK, &s1));
            true
        }
        Err(e) => {
            assert!(e.is_out_of_memory(), "unexpected error: {e}");
            false
        }
    };
    owner.join().unwrap();
    seen.note(REGREW, grown);
    seen.note(OUT_OF_MEMORY, !grown);
    lists.check().expect("free-list invariants");
    let expected = if grown { 2 * BLOCK } else { BLOCK };
    assert_eq!(lists.free_bytes(), expected, "memory lost or counted twice");
}

/// Bound 3: 2 threads.
#[test]
fn give_back_and_regrow_at_the_maximum() {
    check_paths(Some(3), &[REGREW, OUT_OF_MEMORY], regrow_at_max);
}

// ---------------------------------------------------------------------------------------------
// Planted bugs, switched on in src for one model each (in a child process: see `must_fail`).
// ---------------------------------------------------------------------------------------------

use crate::resource::stream_ordered::planted;
use std::sync::atomic::Ordering::Relaxed;

/// Bug: `retire_idle` moves a dropped stream's live entries to the orphans after letting go of
/// the registry's lock: a free that searches between the two finds the entry neither in the
/// lists (its list is out of the registry) nor among the orphans, and refuses a good pointer.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_live_moved_unlocked() {
    must_fail(
        module_path!(),
        "planted_live_moved_unlocked",
        "a good free was refused while its list was retired",
        || {
            planted::MOVE_UNLOCKED.store(true, Relaxed);
            check_paths(Some(3), &[], free_vs_retire);
        },
    );
}

/// Bug: whole chunks of streams' lists are reported as fresh, so the pool gives them back on
/// its own stream: the regrown chunk's next user is not ordered after the last one.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_chunks_released_as_fresh() {
    must_fail(
        module_path!(),
        "planted_chunks_released_as_fresh",
        "handed to stream 1, which is ordered after only",
        || {
            planted::CHUNKS_AS_FRESH.store(true, Relaxed);
            check_paths(Some(3), &[], regrow_at_max);
        },
    );
}
