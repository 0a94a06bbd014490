//! Which shard each chunk belongs to, read without a lock: a free finds the shard of its block
//! by address on every call, from any thread, and a lock there would be the one every thread
//! contends on (what the shards are for is that no such lock exists).
//!
//! The table is an immutable sorted vector, replaced whole when a chunk comes or goes (growth
//! and trim: tens of times in a pool's life) and published through an atomic pointer. Every
//! version stays allocated until the table is dropped, so a reader never sees freed memory.

use crate::sync::{AtomicPtr, Mutex, Ordering};

/// `(start, end, shard)`, sorted by start, not overlapping.
type Entries = Vec<(u64, u64, u32)>;

pub(super) struct ChunkTable {
    current: AtomicPtr<Entries>,
    /// Every version published (the last is current): kept so that `current` never dangles.
    /// Boxed: `current` points at a version's `Vec` itself, which must not move when this
    /// vector grows.
    #[allow(clippy::vec_box)]
    versions: Mutex<Vec<Box<Entries>>>,
}

impl ChunkTable {
    pub(super) fn new() -> Self {
        let mut first = Box::new(Entries::new());
        let ptr: *mut Entries = &mut *first;
        Self {
            current: AtomicPtr::new(ptr),
            versions: Mutex::new(vec![first]),
        }
    }

    /// The shard of the chunk holding `[addr, addr + size)`, if one does.
    #[inline]
    pub(super) fn shard_of(&self, addr: u64, size: u64) -> Option<u32> {
        let ptr = self.current.load(Ordering::Acquire);
        // SAFETY: `current` always points to a version in `versions`, which are freed only
        // with the table (`&self` keeps it alive), and a version is never changed after it is
        // published (stored with Release in `update` after it was written, loaded with Acquire
        // here).
        let entries = unsafe { &*ptr };
        let at = entries.partition_point(|e| e.0 <= addr);
        let &(_, end, shard) = entries.get(at.checked_sub(1)?)?;
        (addr.checked_add(size)? <= end).then_some(shard)
    }

    /// Whether a chunk holds `[addr, addr + size)`.
    pub(super) fn covers(&self, addr: u64, size: u64) -> bool {
        self.shard_of(addr, size).is_some()
    }

    /// Publishes a new version: `edit` applied to a copy of the current one.
    fn update(&self, edit: impl FnOnce(&mut Entries)) {
        let mut versions = self.versions.lock();
        let mut next = Box::new(versions.last().map_or_else(Entries::new, |v| (**v).clone()));
        edit(&mut next);
        next.sort_unstable();
        let ptr: *mut Entries = &mut *next;
        versions.push(next);
        self.current.store(ptr, Ordering::Release);
    }

    pub(super) fn add(&self, start: u64, size: u64, shard: u32) {
        self.update(|e| e.push((start, start + size, shard)));
    }

    /// Removes the chunk starting at `start`; its shard, if there was one.
    pub(super) fn remove(&self, start: u64) -> Option<u32> {
        let shard = self.shard_of(start, 1)?;
        self.update(|e| e.retain(|c| c.0 != start));
        Some(shard)
    }
}
