//! The block table's map of blocks handed out, start address → slot: one insertion per
//! allocation and one removal per free, so on every operation of the pool.
//!
//! Why not a `HashMap`: `cachegrind` on `engine_lab`'s `churn-1t` counted about 55 of the
//! engine's 560 instructions per operation in hashbrown's insert and remove (hashing, group
//! probing, growth checks, tombstones). This map knows its keys: block starts are multiples of
//! 256 below `u64::MAX`, so `u64::MAX` marks an empty slot, a multiplication spreads them, and
//! linear probing with removal by backward shift (no tombstones) keeps every probe short at a
//! load of at most a half.

/// An empty slot's key: no block starts there (starts are multiples of 256).
const EMPTY: u64 = u64::MAX;

/// Start address → slot, for the blocks handed out.
#[derive(Debug, Clone)]
pub(crate) struct AddrMap {
    /// `(key, value)`, a power of two of them; `EMPTY` keys are free.
    entries: Vec<(u64, u32)>,
    len: usize,
    /// `64 - log2(entries.len())`: the shift that turns a hash into an index.
    shift: u32,
}

impl Default for AddrMap {
    fn default() -> Self {
        Self::with_log2(4)
    }
}

impl AddrMap {
    fn with_log2(log2: u32) -> Self {
        AddrMap {
            entries: vec![(EMPTY, 0); 1 << log2],
            len: 0,
            shift: 64 - log2,
        }
    }

    /// How many entries.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    fn mask(&self) -> usize {
        self.entries.len() - 1
    }

    /// Where `key`'s probe starts (Fibonacci hashing of the 256-byte unit).
    #[inline]
    fn home(&self, key: u64) -> usize {
        ((key >> 8).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    /// The index of `key`'s entry, if present.
    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let k = self.entries[i].0;
            if k == key {
                return Some(i);
            }
            if k == EMPTY {
                return None;
            }
            i = (i + 1) & mask;
        }
    }

    /// The value of `key`, if present.
    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<u32> {
        debug_assert_ne!(key, EMPTY);
        self.find(key).map(|i| self.entries[i].1)
    }

    /// The entry of `key`, if present: its position (valid until the map changes) and value.
    #[inline]
    pub(crate) fn position(&self, key: u64) -> Option<(usize, u32)> {
        debug_assert_ne!(key, EMPTY);
        self.find(key).map(|i| (i, self.entries[i].1))
    }

    /// Removes the entry at `position` (from [`position`](Self::position), with nothing
    /// changed since), whose key is `key`. (The block table looks a block up, checks that the
    /// free names its exact size, and only then removes it.)
    #[inline]
    pub(crate) fn remove_position(&mut self, position: usize, key: u64) {
        debug_assert_eq!(self.entries[position].0, key);
        let _ = key;
        self.remove_at(position);
    }

    /// Sets `key` to `value` (a block start: never `u64::MAX`).
    #[inline]
    pub(crate) fn insert(&mut self, key: u64, value: u32) {
        debug_assert_ne!(key, EMPTY);
        if (self.len + 1) * 2 > self.entries.len() {
            self.grow();
        }
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let k = self.entries[i].0;
            if k == EMPTY {
                self.entries[i] = (key, value);
                self.len += 1;
                return;
            }
            if k == key {
                self.entries[i].1 = value;
                return;
            }
            i = (i + 1) & mask;
        }
    }

    /// Empties entry `i` and shifts back the entries of its probe run that would no longer be
    /// found past the hole (backward-shift deletion: no tombstones).
    fn remove_at(&mut self, mut hole: usize) {
        let mask = self.mask();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let k = self.entries[j].0;
            if k == EMPTY {
                break;
            }
            // The entry at `j` may move into the hole unless its home lies cyclically in
            // `(hole, j]`, where a probe for it starts after the hole.
            let home = self.home(k);
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.entries[hole] = self.entries[j];
                hole = j;
            }
        }
        self.entries[hole] = (EMPTY, 0);
        self.len -= 1;
    }

    /// Doubles the table.
    #[cold]
    fn grow(&mut self) {
        let log2 = self.entries.len().trailing_zeros() + 1;
        let old = std::mem::replace(self, Self::with_log2(log2));
        for (k, v) in old.entries {
            if k != EMPTY {
                self.insert(k, v);
            }
        }
    }

    /// Every `(key, value)`.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.entries.iter().copied().filter(|e| e.0 != EMPTY)
    }
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::device::sim::faults::splitmix64;

    /// A random mix of inserts and removals, checked against a `HashMap` after each: keys from
    /// a small range so that probe runs collide, wrap around the end and are shifted back.
    #[test]
    fn agrees_with_a_hash_map_through_random_inserts_and_removals() {
        let mut map = AddrMap::default();
        let mut model: HashMap<u64, u32> = HashMap::new();
        let mut state = 7u64;
        for step in 0..200_000u32 {
            let r = splitmix64(&mut state);
            let key = (r % 4096) << 8;
            match r >> 62 {
                0 | 1 => {
                    map.insert(key, step);
                    model.insert(key, step);
                }
                2 => {
                    let keep_odd = r & (1 << 40) != 0;
                    let got = map.position(key).and_then(|(at, v)| {
                        (!keep_odd || v % 2 == 0).then(|| map.remove_position(at, key))?;
                        Some(v)
                    });
                    let want = match model.get(&key) {
                        Some(&v) if !keep_odd || v % 2 == 0 => model.remove(&key),
                        _ => None,
                    };
                    assert_eq!(got, want, "step {step}");
                }
                _ => assert_eq!(map.get(key), model.get(&key).copied(), "step {step}"),
            }
            assert_eq!(map.len(), model.len());
        }
        let mut all: Vec<(u64, u32)> = map.iter().collect();
        let mut want: Vec<(u64, u32)> = model.into_iter().collect();
        all.sort_unstable();
        want.sort_unstable();
        assert_eq!(all, want);
    }
}
