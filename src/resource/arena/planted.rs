//! Bugs the loom model of the arena plants (`loom-tests/arena.rs`), one at a time, to see them
//! caught. Only under the loom cfg.

use std::sync::atomic::AtomicBool;

/// A stream arena adopts the blocks freed on other streams without ordering its stream after
/// theirs (no event, no wait): a block freed on T is reused on S while T's work may still use it.
pub(crate) static ADOPT_UNORDERED: AtomicBool = AtomicBool::new(false);
