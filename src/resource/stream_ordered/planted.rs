//! Bugs the loom models plant, one at a time, to see them caught (`loom-tests/`): switches
//! that exist only under the loom cfg, and are constant `false` otherwise.

#[cfg(streamalloc_loom)]
use std::sync::atomic::{AtomicBool, Ordering};

/// `retire_idle` moves the live entries of dropped streams' lists to the orphans after it
/// has let go of the registry's lock (the lists already out of it): a free can miss them in
/// both places.
#[cfg(streamalloc_loom)]
pub(crate) static MOVE_UNLOCKED: AtomicBool = AtomicBool::new(false);
/// `take_whole_chunks` reports whole chunks of streams' lists as fresh: the pool would give
/// them back upstream on its own stream, not after their last use.
#[cfg(streamalloc_loom)]
pub(crate) static CHUNKS_AS_FRESH: AtomicBool = AtomicBool::new(false);

#[cfg(streamalloc_loom)]
pub(super) fn move_unlocked() -> bool {
    MOVE_UNLOCKED.load(Ordering::Relaxed)
}

#[cfg(streamalloc_loom)]
pub(super) fn chunks_as_fresh() -> bool {
    CHUNKS_AS_FRESH.load(Ordering::Relaxed)
}

#[cfg(not(streamalloc_loom))]
#[inline(always)]
pub(super) const fn move_unlocked() -> bool {
    false
}

#[cfg(not(streamalloc_loom))]
#[inline(always)]
pub(super) const fn chunks_as_fresh() -> bool {
    false
}
