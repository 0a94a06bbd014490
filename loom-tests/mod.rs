//! The loom models of streamalloc's concurrency cores. Compiled into the crate under
//! `cfg(all(test, streamalloc_loom))` (see `src/lib.rs`), so they drive the real internals.
