//! The detector's shadow state, its helpers: the segments of known memory (split, gap-filled,
//! looked up), the raw blocks the driver handed out, the sites and blocks a report names, and
//! the check of one use against the last uses and the allocation's life.

use super::{Epoch, Life, Point, Seg, State, Use, KEPT_RAW_FREES, MAX_USES};
use crate::device::sim::races::{MemoryAccess, Race, RaceBlock, RaceKind, RaceSite};
use crate::device::DevicePtr;

impl State {
    pub(super) fn site(&self, p: Point) -> RaceSite {
        // The point's own stream, not the slot's: the slot may have gone to another stream
        // since (see `Detector::add_stream`).
        RaceSite {
            stream: p.id,
            op: p.op,
            position: p.epoch - p.base,
        }
    }

    pub(super) fn block_info(&self, life: &Life) -> RaceBlock {
        RaceBlock {
            ptr: DevicePtr(life.block.0),
            bytes: (life.block.1 - life.block.0) as usize,
            allocated: self.site(life.alloc),
            freed: life.freed.as_ref().map(|f| self.site(f.point)),
        }
    }

    /// Keeps `race` in the list and logs it; hands it back for the caller's mode.
    pub(super) fn note(&mut self, race: Option<Race>) -> Option<Race> {
        let race = race?;
        tracing::error!(%race, "the simulated device found a stream-order race");
        self.races.push(race.clone());
        Some(race)
    }

    /// Removes every segment of `[start, end)` (split at its ends first).
    pub(super) fn forget(&mut self, start: u64, end: u64) {
        self.split(start);
        self.split(end);
        let keys: Vec<u64> = self.segs.range(start..end).map(|(&k, _)| k).collect();
        for key in keys {
            self.segs.remove(&key);
        }
    }

    /// Splits the segment that holds `at` strictly inside it into two.
    pub(super) fn split(&mut self, at: u64) {
        let Some((&start, seg)) = self.segs.range_mut(..at).next_back() else {
            return;
        };
        if seg.end <= at {
            return;
        }
        let mut upper = seg.clone();
        seg.end = at;
        for life in &mut seg.stack {
            life.uses.retain(|u| u.start < at);
        }
        for life in &mut upper.stack {
            life.uses.retain(|u| u.end > at);
        }
        debug_assert!(start < at);
        self.segs.insert(at, upper);
    }

    /// Merges the neighbouring segments of `[start, end)` whose stacks hold the same lives, level
    /// by level (the same blocks, allocations and frees): their uses, each with its own range,
    /// go together. An allocation or a free leaves its block's segments alike; without this,
    /// every block boundary ever used stayed a segment, and an allocation walked all of those
    /// inside its block: a pool's `churn-1t` on the simulated device ran about 900 times slower
    /// with the detector on than off, slower with every operation (a review's finding).
    pub(super) fn merge_alike(&mut self, start: u64, end: u64) {
        let keys: Vec<u64> = self.segs.range(start..end).map(|(&k, _)| k).collect();
        let mut into: Option<u64> = None;
        for key in keys {
            if let Some(at) = into {
                let (a, b) = (&self.segs[&at], &self.segs[&key]);
                if a.end == key && alike(&a.stack, &b.stack) {
                    let seg = self.segs.remove(&key).expect("listed above");
                    let merged = self.segs.get_mut(&at).expect("kept above");
                    merged.end = seg.end;
                    for (life, from) in merged.stack.iter_mut().zip(seg.stack) {
                        life.uses.extend(from.uses);
                        // As elsewhere: past the bound the oldest go (a missed race, never a
                        // false one).
                        let excess = life.uses.len().saturating_sub(MAX_USES);
                        life.uses.drain(..excess);
                    }
                    continue;
                }
            }
            into = Some(key);
        }
    }

    /// Adds empty segments where `[start, end)` has none (memory the device does not know:
    /// blocks carved from it are still tracked).
    pub(super) fn fill_gaps(&mut self, start: u64, end: u64) {
        let mut gaps = Vec::new();
        let mut at = start;
        for (&k, seg) in self.segs.range(start..end) {
            if k > at {
                gaps.push((at, k));
            }
            at = seg.end;
        }
        if at < end {
            gaps.push((at, end));
        }
        for (s, e) in gaps {
            self.segs.insert(
                s,
                Seg {
                    end: e,
                    stack: Vec::new(),
                },
            );
        }
    }

    /// The segments that overlap `[start, end)`.
    pub(super) fn overlapping(&self, start: u64, end: u64) -> Vec<u64> {
        // An empty range overlaps nothing (and `start + 1..end` would be a reversed range,
        // which `BTreeMap::range` panics on: a zero-byte copy or memset did; review).
        if start >= end {
            return Vec::new();
        }
        let first = self
            .segs
            .range(..=start)
            .next_back()
            .filter(|(_, s)| s.end > start)
            .map(|(&k, _)| k);
        first
            .into_iter()
            .chain(self.segs.range(start + 1..end).map(|(&k, _)| k))
            .collect()
    }

    /// The live raw block that starts at `ptr`.
    pub(super) fn raw_block(&self, ptr: u64) -> Option<(u64, u64)> {
        let seg = self.segs.get(&ptr)?;
        seg.stack
            .iter()
            .find(|l| l.raw && l.block.0 == ptr && l.freed.is_none())
            .map(|l| l.block)
    }

    /// The freed raw block that starts at `ptr`.
    pub(super) fn freed_raw_block(&self, ptr: u64) -> Option<(u64, u64)> {
        let seg = self.segs.get(&ptr)?;
        let top = seg.stack.last()?;
        (top.raw && top.block.0 == ptr && top.freed.is_some()).then_some(top.block)
    }

    /// Whether the freed raw block at `ptr` is kept by a driver's pool (a pool's free).
    fn kept_by_a_pool(&self, ptr: u64) -> bool {
        (self.segs.get(&ptr))
            .and_then(|seg| seg.stack.last())
            .and_then(|top| top.freed.as_ref())
            .is_some_and(|freed| freed.pooled)
    }

    /// After a raw free: one segment for the whole block (the pieces inside it are gone), and
    /// (unless a driver's pool keeps the block: `pooled`) the oldest freed raw blocks
    /// forgotten past the bound. A pool's block joins them when the pool gives it back to the
    /// device ([`Detector::released_by_pool`](super::Detector::released_by_pool)).
    pub(super) fn merge_raw(&mut self, block: (u64, u64), pooled: bool) {
        let keys: Vec<u64> = self.segs.range(block.0..block.1).map(|(&k, _)| k).collect();
        let mut merged: Option<Seg> = None;
        for key in keys {
            let seg = self.segs.remove(&key).expect("listed above");
            match &mut merged {
                None => merged = Some(seg),
                Some(m) => {
                    if let (Some(into), Some(from)) = (m.stack.last_mut(), seg.stack.last()) {
                        into.uses.extend_from_slice(&from.uses);
                        into.uses.truncate(MAX_USES);
                    }
                    m.end = seg.end;
                }
            }
        }
        if let Some(m) = merged {
            self.segs.insert(block.0, m);
        }
        if !pooled {
            self.forget_old_frees(block);
        }
    }

    /// Counts `block` among the freed raw blocks kept, and forgets the oldest past the bound.
    pub(super) fn forget_old_frees(&mut self, block: (u64, u64)) {
        self.raw_frees.push_back(block);
        while self.raw_frees.len() > KEPT_RAW_FREES {
            if let Some(old) = self.raw_frees.pop_front() {
                // Not a block the driver's pool keeps to hand out again (a pool's free): its
                // address is still live memory, and a stale use of it must still be caught (a
                // review found it forgotten after 4,096 frees).
                if self.freed_raw_block(old.0) == Some(old) && !self.kept_by_a_pool(old.0) {
                    self.remove(old);
                }
            }
        }
    }

    /// Forgets the freed raw block `block`: the segments of its range whose top is still its
    /// free. Not the others: once the sweep of addresses has come round, a block allocated
    /// since may lie inside the range (a review found its segments forgotten with the old
    /// free, and its uses unchecked).
    pub(super) fn remove(&mut self, block: (u64, u64)) {
        let keys: Vec<u64> = (self.segs.range(block.0..block.1))
            .filter(|(_, seg)| {
                (seg.stack.last())
                    .is_some_and(|top| top.raw && top.block == block && top.freed.is_some())
            })
            .map(|(&k, _)| k)
            .collect();
        for key in keys {
            self.segs.remove(&key);
        }
    }

    /// Checks a use against each segment it touches: the first race found.
    pub(super) fn check_use(
        &self,
        ptr: u64,
        bytes: usize,
        at: Point,
        access: MemoryAccess,
        clock: &[Epoch],
    ) -> Option<Race> {
        let (start, end) = (ptr, ptr.saturating_add(bytes as u64));
        let write = access == MemoryAccess::Write;
        for key in self.overlapping(start, end) {
            let seg = &self.segs[&key];
            let Some(top) = seg.stack.last() else {
                continue;
            };
            let race = |kind, earlier: Point| Race {
                kind,
                ptr: DevicePtr(ptr),
                bytes,
                at: self.site(at),
                earlier: self.site(earlier),
                block: Some(self.block_info(top)),
            };
            if let Some(freed) = &top.freed {
                return Some(race(RaceKind::UseAfterFree, freed.point));
            }
            if !top.alloc.before(clock) {
                return Some(race(RaceKind::UseBeforeAllocation, top.alloc));
            }
            for u in &top.uses {
                if u.at.stream == at.stream || u.end <= start || u.start >= end {
                    continue;
                }
                if (u.write || write) && !u.at.before(clock) {
                    let kind = match (u.write, write) {
                        (true, true) => RaceKind::WriteAfterWrite,
                        (true, false) => RaceKind::ReadAfterWrite,
                        _ => RaceKind::WriteAfterRead,
                    };
                    return Some(race(kind, u.at));
                }
            }
        }
        None
    }

    /// Records a use in each live segment it touches, dropping the uses it covers and is
    /// ordered after (a later use conflicts with them only if it also conflicts with this one).
    pub(super) fn add_use(
        &mut self,
        ptr: u64,
        bytes: usize,
        at: Point,
        write: bool,
        clock: &[Epoch],
    ) {
        let (start, end) = (ptr, ptr.saturating_add(bytes as u64));
        for key in self.overlapping(start, end) {
            let seg = self.segs.get_mut(&key).expect("listed above");
            let (s, e) = (start.max(key), end.min(seg.end));
            let Some(top) = seg.stack.last_mut() else {
                continue;
            };
            if top.freed.is_some() {
                continue;
            }
            top.uses.retain(|u| {
                !(u.start >= s && u.end <= e && (write || !u.write) && u.at.before(clock))
            });
            if top.uses.len() >= MAX_USES {
                top.uses.remove(0);
            }
            top.uses.push(Use {
                start: s,
                end: e,
                at,
                write,
            });
        }
    }
}

/// Whether two stacks hold the same lives, level by level (their uses aside).
fn alike(a: &[Life], b: &[Life]) -> bool {
    let same = |p: &Point, q: &Point| (p.stream, p.epoch, p.op) == (q.stream, q.epoch, q.op);
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.block == y.block
                && x.raw == y.raw
                && same(&x.alloc, &y.alloc)
                && match (&x.freed, &y.freed) {
                    (None, None) => true,
                    (Some(f), Some(g)) => same(&f.point, &g.point) && f.pooled == g.pooled,
                    _ => false,
                }
        })
}
