//! Bugs the loom models plant, one at a time, to see them caught (`loom-tests/`): switches
//! that exist only under the loom cfg, read through `planted!` (constant `false` otherwise).

#[cfg(streamalloc_loom)]
use std::sync::atomic::AtomicBool;

/// An ordering bumps the freeing stream's epoch only after the event is recorded: a free on
/// that stream in between is tagged with the old epoch, looks covered, and is not.
#[cfg(streamalloc_loom)]
pub(crate) static BUMP_AFTER_ORDER: AtomicBool = AtomicBool::new(false);
/// Orderings are noted but never made (no event, no wait).
#[cfg(streamalloc_loom)]
pub(crate) static UNORDERED: AtomicBool = AtomicBool::new(false);
/// `idle_streams` names every stream, and `forget` lets go of one whatever its handles.
#[cfg(streamalloc_loom)]
pub(crate) static IDLE_IGNORES_HANDLES: AtomicBool = AtomicBool::new(false);
/// `take_whole_chunks` reports whole chunks freed on streams as fresh: the pool would give
/// them back upstream on its own stream, not after their last use.
#[cfg(streamalloc_loom)]
pub(crate) static CHUNKS_AS_FRESH: AtomicBool = AtomicBool::new(false);

/// A freeing stream that says it is busy is taken as idle: no ordering is made.
#[cfg(streamalloc_loom)]
pub(crate) static BUSY_TAKEN_AS_IDLE: AtomicBool = AtomicBool::new(false);
/// A freeing stream seen idle is noted finished up to its epoch when the answer is noted, not
/// up to the epoch bumped before the question: a free on it in between looks finished.
#[cfg(streamalloc_loom)]
pub(crate) static DONE_AT_THE_ANSWER: AtomicBool = AtomicBool::new(false);

/// The freeing stream's activity count is read after its idle answer, not before the question:
/// work queued in between is taken as seen finished, and the stream as still idle after it.
#[cfg(streamalloc_loom)]
pub(crate) static ACTIVITY_AFTER_THE_ANSWER: AtomicBool = AtomicBool::new(false);
/// A freeing stream once seen idle is taken as still idle whatever was queued on it since.
#[cfg(streamalloc_loom)]
pub(crate) static QUIET_IGNORES_ACTIVITY: AtomicBool = AtomicBool::new(false);

/// A chunk of the reserve leaves the reserve's lock before it reaches its shard: `stats` in
/// between counts it nowhere.
#[cfg(streamalloc_loom)]
pub(crate) static RESERVE_RELEASED_EARLY: AtomicBool = AtomicBool::new(false);

/// A request about to grow does not look again after a chunk moved from the reserve into a
/// shard while it looked, nor once more before it reports out of memory: it fails at the
/// maximum with that memory free.
#[cfg(streamalloc_loom)]
pub(crate) static RESERVE_MOVES_IGNORED: AtomicBool = AtomicBool::new(false);

/// A growth at the maximum takes free memory whose streams say they are busy as finished,
/// and unmaps it (the expandable pool's `make_room`).
#[cfg(streamalloc_loom)]
pub(crate) static RELOCATED_BUSY: AtomicBool = AtomicBool::new(false);
/// The host's wait for a busy stream is noted finished up to an epoch bumped when the wait
/// has ended, not before it began: a free on the stream in between looks finished, though its
/// last use may have been queued after the wait began.
#[cfg(streamalloc_loom)]
pub(crate) static HOST_WAIT_BUMPED_AFTER: AtomicBool = AtomicBool::new(false);

/// Memory taken out for release is ordered onto the first stream its tag names, and needs
/// nothing if that stream was forgotten meanwhile (the others are not looked at).
#[cfg(streamalloc_loom)]
pub(crate) static ONTO_FIRST_ONLY: AtomicBool = AtomicBool::new(false);

/// The small-block cache hands a block back to any stream, not only the one that freed it:
/// another stream reuses it with no ordering after its last use.
#[cfg(streamalloc_loom)]
pub(crate) static CACHE_ANY_STREAM: AtomicBool = AtomicBool::new(false);

/// The chunk table's readers keep an answer read while a change was under way (no second look
/// at the sequence number).
#[cfg(streamalloc_loom)]
pub(crate) static TORN_CHUNK_READS: AtomicBool = AtomicBool::new(false);

/// `forget` lets go of a stream without asking whether it is still idle: work the engine queued
/// on it after the caller's wait (an ordering onto it, for memory going back) is taken as seen.
#[cfg(streamalloc_loom)]
pub(crate) static FORGET_IGNORES_LATER_WORK: AtomicBool = AtomicBool::new(false);

/// A trim gives back everything it took, though a request at the maximum recalled some of it
/// into the lists and was handed it (`resource/held_for_trim.rs`).
#[cfg(streamalloc_loom)]
pub(crate) static TRIM_IGNORES_RECALL: AtomicBool = AtomicBool::new(false);

/// A trim's note that it ordered a chunk (`HeldForTrim::replace`) holds the chunk as the trim's
/// even when a request at the maximum recalled it into the lists meanwhile: the trim then gives
/// upstream a chunk the lists hold too (`resource/held_for_trim.rs`).
#[cfg(streamalloc_loom)]
pub(crate) static REPLACE_IGNORES_RECALL: AtomicBool = AtomicBool::new(false);

/// The end of an automatic release only clears its pending bit (the release threshold's
/// protocol before a review): what was freed while it ran queues no release
/// (`resource/expandable/core.rs`, `ReleaseTrigger::ended`).
#[cfg(streamalloc_loom)]
pub(crate) static RELEASE_END_ONLY_CLEARS: AtomicBool = AtomicBool::new(false);

/// A block whose ordering a graph capture refused is handed out all the same, unordered,
/// instead of going back (`StreamHeap::take_locked`'s error path).
#[cfg(streamalloc_loom)]
pub(crate) static REFUSED_ORDER_HANDS_OUT: AtomicBool = AtomicBool::new(false);

/// A trim of the expandable pool takes what passes `keep` of what is mapped, ignoring what
/// other trims took and have not unmapped yet: two trims at once take `keep` away together.
#[cfg(streamalloc_loom)]
pub(crate) static TRIMMING_IGNORED: AtomicBool = AtomicBool::new(false);

/// A request waiting for growths' give-backs (`GiveBacks::wait_for_under_way`) waits only
/// until one of them ends, not for every one under way at its look (the behaviour before the
/// twenty-first session): with two under way it may fail while the other's room is coming.
#[cfg(streamalloc_loom)]
pub(crate) static WAITS_FOR_ONE_ONLY: AtomicBool = AtomicBool::new(false);

/// A growth's claim, dropped, tells the waiters before it counts its give-back ended: a waiter
/// woken then sees none ended, waits again, and is never told (`resource/give_backs.rs`).
#[cfg(streamalloc_loom)]
pub(crate) static TOLD_BEFORE_ENDED: AtomicBool = AtomicBool::new(false);
