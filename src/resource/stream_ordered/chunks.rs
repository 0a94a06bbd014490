//! Which shard each chunk belongs to, read without a lock: a free finds the shard of its block
//! by address on every call, from any thread, and a lock there would be the one every thread
//! contends on (what the shards are for is that no such lock exists).
//!
//! A sequence lock: the table is a sorted array of atomics, changed in place under a mutex
//! (growth and trim, and the pool's give-back at its maximum: rare next to frees), with a
//! sequence number made odd while it changes. A reader reads the number, looks the address up
//! with plain (relaxed) loads, and keeps the answer only if the number was even and is the same
//! after (Boehm's fences: a reader that saw any store of a change also sees the change's odd
//! number). The array is replaced only when it is full, by one twice as large; the old ones
//! stay allocated until the table is dropped, so a reader never sees freed memory, and what
//! they hold is bounded (at most the current array's size again). Before, every change
//! published a whole new copy and kept every old one: a pool at its maximum that gives chunks
//! back and grows others, request after request, held more memory for each (an engine
//! review's finding).

// The planted bug's switch, read through `planted!` (it exists only under the loom cfg).
#[cfg(streamalloc_loom)]
use super::planted;
use crate::sync::{fence, AtomicPtr, AtomicU64, AtomicUsize, Mutex, Ordering};

/// One chunk: `[start, end)` in `shard`.
#[derive(Default)]
struct Entry {
    start: AtomicU64,
    end: AtomicU64,
    shard: AtomicU64,
}

/// Entries `0..len` sorted by start, not overlapping; the rest unused.
struct Array {
    len: AtomicUsize,
    entries: Box<[Entry]>,
}

impl Array {
    fn with_capacity(capacity: usize) -> Box<Self> {
        Box::new(Array {
            len: AtomicUsize::new(0),
            entries: (0..capacity).map(|_| Entry::default()).collect(),
        })
    }

    /// The entry `i`, read whole (relaxed: a torn read is thrown away by the sequence check).
    fn get(&self, i: usize) -> Option<(u64, u64, u32)> {
        let e = self.entries.get(i)?;
        Some((
            e.start.load(Ordering::Relaxed),
            e.end.load(Ordering::Relaxed),
            e.shard.load(Ordering::Relaxed) as u32,
        ))
    }

    fn set(&self, i: usize, (start, end, shard): (u64, u64, u32)) {
        let e = &self.entries[i];
        e.start.store(start, Ordering::Relaxed);
        e.end.store(end, Ordering::Relaxed);
        e.shard.store(u64::from(shard), Ordering::Relaxed);
    }

    /// The shard of the chunk holding `[addr, addr + size)`: a binary search that never
    /// indexes out of bounds, whatever a concurrent change makes it read.
    fn lookup(&self, addr: u64, size: u64) -> Option<u32> {
        let (mut low, mut high) = (0, self.len.load(Ordering::Relaxed).min(self.entries.len()));
        // The first entry starting above `addr` (only the starts are read on the way).
        while low < high {
            let mid = low + (high - low) / 2;
            // SAFETY: `mid < high <= entries.len()` (`high` starts at most there and only
            // falls).
            let start = unsafe { self.entries.get_unchecked(mid) }
                .start
                .load(Ordering::Relaxed);
            if start <= addr {
                low = mid + 1;
            } else {
                high = mid;
            }
        }
        let entry = self.entries.get(low.checked_sub(1)?)?;
        let end = entry.end.load(Ordering::Relaxed);
        (addr.checked_add(size)? <= end).then(|| entry.shard.load(Ordering::Relaxed) as u32)
    }
}

pub(crate) struct ChunkTable {
    /// The array readers look in (the last of `arrays`).
    current: AtomicPtr<Array>,
    /// Odd while a change is under way.
    seq: AtomicU64,
    /// Every array published, the current one last: kept so that `current` never dangles.
    /// Boxed: `current` points at an array itself, which must not move when this grows.
    #[allow(clippy::vec_box)]
    arrays: Mutex<Vec<Box<Array>>>,
}

impl ChunkTable {
    pub(crate) fn new() -> Self {
        // Small under loom, so that its model reaches the move into a larger array cheaply.
        let mut first = Array::with_capacity(if cfg!(streamalloc_loom) { 2 } else { 8 });
        let ptr: *mut Array = &mut *first;
        Self {
            current: AtomicPtr::new(ptr),
            seq: AtomicU64::new(0),
            arrays: Mutex::new(vec![first]),
        }
    }

    /// The shard of the chunk holding `[addr, addr + size)`, if one does.
    #[inline]
    pub(crate) fn shard_of(&self, addr: u64, size: u64) -> Option<u32> {
        let mut tries = 0u32;
        loop {
            let seq = self.seq.load(Ordering::Acquire);
            if seq & 1 == 0 {
                let ptr = self.current.load(Ordering::Acquire);
                // SAFETY: `current` always points to an array in `arrays`, which are freed only
                // with the table (`&self` keeps it alive); what it reads there are atomics, and
                // an answer read during a change is thrown away below.
                let found = unsafe { &*ptr }.lookup(addr, size);
                // Orders the loads above before the second read of `seq`: a reader that saw a
                // store of a change sees its odd number (or a later one) there.
                fence(Ordering::Acquire);
                if self.seq.load(Ordering::Relaxed) == seq || planted!(TORN_CHUNK_READS) {
                    return found;
                }
            }
            tries += 1;
            // A change is a few stores under the mutex; a writer preempted in the middle is
            // waited for without burning the whole time slice.
            // (Under loom every retry yields: a model spinning on the number would never end.)
            if tries < 64 && !cfg!(streamalloc_loom) {
                std::hint::spin_loop();
            } else {
                crate::sync::thread::yield_now();
            }
        }
    }

    /// Whether a chunk holds `[addr, addr + size)`.
    pub(crate) fn covers(&self, addr: u64, size: u64) -> bool {
        self.shard_of(addr, size).is_some()
    }

    /// Changes the table in place (or in a larger array, published, when it is full), with the
    /// sequence number odd throughout.
    fn update(&self, edit: impl FnOnce(&Array, usize) -> usize) {
        let mut arrays = self.arrays.lock();
        let seq = self.seq.load(Ordering::Relaxed);
        self.seq.store(seq + 1, Ordering::Relaxed);
        // Orders the odd number before every store of the change (Boehm's writer fence).
        fence(Ordering::Release);
        let array: &Array = arrays.last().expect("the table always has an array");
        let len = array.len.load(Ordering::Relaxed);
        if len == array.entries.len() {
            let bigger = Array::with_capacity(len * 2);
            for i in 0..len {
                bigger.set(i, array.get(i).expect("within len"));
            }
            bigger.len.store(len, Ordering::Relaxed);
            arrays.push(bigger);
            let newest: &Array = arrays.last().expect("just pushed");
            let ptr = newest as *const Array as *mut Array;
            self.current.store(ptr, Ordering::Release);
        }
        let array: &Array = arrays.last().expect("the table always has an array");
        let len = array.len.load(Ordering::Relaxed);
        let new_len = edit(array, len);
        array.len.store(new_len, Ordering::Relaxed);
        self.seq.store(seq + 2, Ordering::Release);
    }

    pub(crate) fn add(&self, start: u64, size: u64, shard: u32) {
        self.update(|array, len| {
            // Sorted by start: shift the later entries up one, from the end.
            let mut at = len;
            while at > 0 && array.get(at - 1).is_some_and(|e| e.0 > start) {
                array.set(at, array.get(at - 1).expect("within len"));
                at -= 1;
            }
            array.set(at, (start, start + size, shard));
            len + 1
        });
    }

    /// Removes the chunk starting at `start`; its shard, if there was one.
    pub(crate) fn remove(&self, start: u64) -> Option<u32> {
        let shard = self.shard_of(start, 1)?;
        self.update(|array, len| {
            let Some(at) = (0..len).find(|&i| array.get(i).is_some_and(|e| e.0 == start)) else {
                return len;
            };
            for i in at..len - 1 {
                array.set(i, array.get(i + 1).expect("within len"));
            }
            len - 1
        });
        Some(shard)
    }
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use super::*;

    /// Chunks added in any order and removed: each address finds its chunk's shard, addresses
    /// between and past chunks find none, and the array grows past its first capacity.
    #[test]
    fn lookups_follow_adds_and_removes() {
        let table = ChunkTable::new();
        let starts: Vec<u64> = (0..40).map(|i| (i * 7919 % 40) * 0x1000).collect();
        for (n, &start) in starts.iter().enumerate() {
            table.add(start + 0x10000, 0x800, n as u32);
        }
        for (n, &start) in starts.iter().enumerate() {
            assert_eq!(table.shard_of(start + 0x10000, 0x800), Some(n as u32));
            assert_eq!(table.shard_of(start + 0x10400, 0x400), Some(n as u32));
            assert_eq!(table.shard_of(start + 0x10400, 0x401), None, "past its end");
            assert_eq!(table.shard_of(start + 0x10800, 1), None, "between chunks");
        }
        assert_eq!(table.shard_of(0, 1), None);
        assert_eq!(table.shard_of(u64::MAX, 1), None);
        for &start in starts.iter().step_by(2) {
            assert!(table.remove(start + 0x10000).is_some());
            assert_eq!(table.shard_of(start + 0x10000, 1), None);
        }
        assert_eq!(table.remove(0x10000 + 0x1000 * 40), None);
        for (n, &start) in starts.iter().enumerate().skip(1).step_by(2) {
            assert_eq!(table.shard_of(start + 0x10000, 0x800), Some(n as u32));
        }
    }

    /// Adding and removing chunks for ever holds a bounded amount of memory: the arrays kept
    /// are those the table outgrew, not one per change (an engine review found one copy of the
    /// whole table kept for each change).
    #[test]
    fn changes_keep_no_copy_each() {
        let table = ChunkTable::new();
        for i in 0..4 {
            table.add(i << 30, 1 << 20, 0);
        }
        for round in 0..100_000u64 {
            let start = (8 + round % 3) << 30;
            table.add(start, 1 << 20, 1);
            assert_eq!(table.remove(start), Some(1));
        }
        assert_eq!(
            table.arrays.lock().len(),
            1,
            "the first array was never outgrown"
        );
    }
}
