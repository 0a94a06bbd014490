//! Bugs the loom model of the arena plants (`loom-tests/arena.rs`), one at a time, to see them
//! caught. Only under the loom cfg; read through `planted!` (constant off otherwise).

use std::sync::atomic::AtomicBool;

/// A stream arena adopts the blocks freed on other streams without ordering its stream after
/// theirs (no event, no wait): a block freed on T is reused on S while T's work may still use it.
pub(crate) static ADOPT_UNORDERED: AtomicBool = AtomicBool::new(false);

/// A free of a block of another stream's arena lets go of the global arena's lock before it
/// takes the owner's: a superblock move in between takes the block to another arena, and the
/// free, looking in the old owner, refuses a good pointer (the block stays live for ever).
pub(crate) static GLOBAL_RELEASED_EARLY: AtomicBool = AtomicBool::new(false);

/// A growth giving whole chunks back upstream claims only their bytes, not the rest of the
/// room it needs, before it lets go of the growth lock: another request grows into that room
/// meanwhile, and the first fails though it gave its chunks back for it.
pub(crate) static CLAIM_ONLY_THE_CHUNKS: AtomicBool = AtomicBool::new(false);
