//! A model of a two-level engine (issue 10): per-stream lists for memory freed on the stream
//! that allocated it, and one shared, address-coalescing *heap* for everything else (fresh
//! memory, growth, and every block freed on another stream than its allocation's), whose
//! blocks carry the streams their reuse must be ordered after.

use std::collections::{BTreeMap, BTreeSet};

use crate::device::sim::faults::splitmix64;

/// The streams a free block's reuse must be ordered after: (stream, its epoch at the free).
pub(super) type Tag = Vec<(usize, u64)>;

/// Free blocks, address-ordered and coalesced, with a size index for best fit.
#[derive(Default)]
pub(super) struct Blocks {
    by_addr: BTreeMap<u64, (u64, Tag)>,
    by_size: BTreeSet<(u64, u64)>,
    bytes: u64,
}

fn join(tag: &mut Tag, other: Tag) {
    for (d, at) in other {
        match tag.iter_mut().find(|e| e.0 == d) {
            Some(e) => e.1 = e.1.max(at),
            None => tag.push((d, at)),
        }
    }
}

impl Blocks {
    pub(super) fn give(&mut self, mut addr: u64, size: u64, mut tag: Tag) {
        self.bytes += size;
        let mut end = addr + size;
        let before = self
            .by_addr
            .range(..addr)
            .next_back()
            .map(|(&a, v)| (a, v.0));
        if let Some((start, n)) = before.filter(|&(a, n)| a + n == addr) {
            let (_, other) = self.by_addr.remove(&start).unwrap();
            self.by_size.remove(&(n, start));
            join(&mut tag, other);
            addr = start;
        }
        if let Some((n, other)) = self.by_addr.remove(&end) {
            self.by_size.remove(&(n, end));
            join(&mut tag, other);
            end += n;
        }
        self.by_addr.insert(addr, (end - addr, tag));
        self.by_size.insert((end - addr, addr));
    }

    /// Best fit, or among fits at most `tolerance` larger the first that `prefer` accepts.
    pub(super) fn take(
        &mut self,
        size: u64,
        tolerance: f64,
        prefer: impl Fn(&Tag) -> bool,
    ) -> Option<(u64, Tag)> {
        let &(fit, addr) = self.by_size.range((size, 0)..).next()?;
        let bound = (fit as f64 * (1.0 + tolerance)) as u64;
        let (fit, addr) = self
            .by_size
            .range((fit, addr)..)
            .take_while(|&&(n, _)| n <= bound)
            .take(16)
            .find(|&&(_, a)| prefer(&self.by_addr[&a].1))
            .copied()
            .unwrap_or((fit, addr));
        self.by_size.remove(&(fit, addr));
        let (_, tag) = self.by_addr.remove(&addr).unwrap();
        if fit > size {
            self.by_addr.insert(addr + size, (fit - size, tag.clone()));
            self.by_size.insert((fit - size, addr + size));
        }
        self.bytes -= size;
        Some((addr, tag))
    }

    fn drain(&mut self) -> Vec<(u64, u64, Tag)> {
        self.by_size.clear();
        self.bytes = 0;
        std::mem::take(&mut self.by_addr)
            .into_iter()
            .map(|(a, (n, t))| (a, n, t))
            .collect()
    }
}

/// One thread of a churn run: WORKLOADS.md's generator and decisions.
struct Thread {
    rng: u64,
    ops: u64,
    max_live: u64,
    live: Vec<(u64, u64, usize)>,
    live_bytes: u64,
    peak: u64,
}

/// The policy's knobs.
#[derive(Clone, Copy)]
pub(super) struct Policy {
    /// Heap fits at most this much larger than the best that the taker is already ordered
    /// after are preferred.
    pub(super) tolerance: f64,
    /// Frees on the allocating stream go to its list (false: everything to the heap).
    pub(super) lists: bool,
    /// Bytes a stream's list may hold; a free past it goes to the heap.
    pub(super) cap: u64,
}

/// Runs churn: `threads` threads (interleaved one op each, in an order drawn from `mix`), each
/// with its own stream if `threads > 1`, else one thread over four streams; `hand_off`: frees
/// on the next stream. Returns peak reserved / peak live and counts.
pub(super) fn run(threads: usize, hand_off: bool, policy: Policy, mix: u64) -> String {
    let streams = 4usize;
    let (ops, max_live) = if threads == 1 {
        (1_000_000, 1u64 << 30)
    } else {
        (250_000, 256u64 << 20)
    };
    let mut ts: Vec<Thread> = (0..threads as u64)
        .map(|t| Thread {
            rng: 42 + t,
            ops,
            max_live,
            live: Vec::new(),
            live_bytes: 0,
            peak: 0,
        })
        .collect();
    let one_stream = threads == 1 && !hand_off;
    let mut lists: Vec<Blocks> = (0..streams).map(|_| Blocks::default()).collect();
    let mut heap = Blocks::default();
    let (mut held, mut peak_held, mut next_base) = (0u64, 0u64, 1u64 << 40);
    let mut epoch = vec![0u64; streams];
    let mut waited = vec![vec![0u64; streams]; streams];
    let (mut refreshes, mut takes, mut flushes, mut list_takes, mut flushed_blocks) =
        (0u64, 0u64, 0u64, 0u64, 0u64);
    let (mut live_sum, mut peak_live) = (0u64, 0u64);
    let mut grow = |min: u64, heap: &mut Blocks, held: &mut u64| {
        let size = (*held / 8).max(2 << 20).max(min).next_multiple_of(256);
        heap.give(next_base, size, Vec::new());
        next_base += size + (1 << 30);
        *held += size;
        peak_held = peak_held.max(*held);
    };
    grow(256 << 20, &mut heap, &mut held);
    let mut growths = 0u64;
    let mut mix_rng = mix;
    let mut left: Vec<usize> = (0..threads).collect();
    while !left.is_empty() {
        let pick = if mix == 0 {
            0
        } else {
            (splitmix64(&mut mix_rng) % left.len() as u64) as usize
        };
        let t = left[pick];
        let th = &mut ts[t];
        if mix == 0 {
            left.rotate_left(1);
        }
        if th.ops == 0 {
            // Finally, everything still live is freed.
            while let Some((addr, size, s)) = th.live.pop() {
                let d = if hand_off { (s + 1) % streams } else { s };
                live_sum -= size;
                free(&mut lists, &mut heap, &epoch, policy, addr, size, s, d);
            }
            left.retain(|&x| x != t);
            continue;
        }
        th.ops -= 1;
        let (a, b) = (splitmix64(&mut th.rng), splitmix64(&mut th.rng));
        let e = 8 + b % 15;
        let size = ((1u64 << e) + (b >> 8) % (1u64 << e)).next_multiple_of(256);
        if th.live.is_empty() || (a & 1 == 0 && th.live_bytes + size <= th.max_live) {
            let s = if one_stream {
                0
            } else if threads == 1 {
                ((a >> 40) % 4) as usize
            } else {
                t
            };
            th.live_bytes += size;
            th.peak = th.peak.max(th.live_bytes);
            live_sum += size;
            peak_live = peak_live.max(live_sum);
            takes += 1;
            let covered = |tag: &Tag, waited: &Vec<Vec<u64>>| {
                tag.iter().all(|&(d, at)| d == s || waited[s][d] > at)
            };
            let mut got = if policy.lists {
                lists[s].take(size, 0.0, |_| true).map(|(a, _)| a)
            } else {
                None
            };
            if got.is_some() {
                list_takes += 1;
            }
            for round in 0..3 {
                if got.is_some() {
                    break;
                }
                let w = waited.clone();
                if let Some((addr, tag)) = heap.take(size, policy.tolerance, |tag| covered(tag, &w))
                {
                    for &(d, at) in &tag {
                        if d != s && waited[s][d] <= at {
                            epoch[d] += 1;
                            waited[s][d] = epoch[d];
                            refreshes += 1;
                        }
                    }
                    got = Some(addr);
                } else if round == 0 && policy.lists {
                    flushes += 1;
                    for (d, list) in lists.iter_mut().enumerate() {
                        for (addr, n, _) in list.drain() {
                            flushed_blocks += 1;
                            heap.give(addr, n, vec![(d, epoch[d])]);
                        }
                    }
                } else {
                    growths += 1;
                    grow(size, &mut heap, &mut held);
                }
            }
            th.live.push((got.unwrap(), size, s));
        } else {
            let i = ((a >> 1) % th.live.len() as u64) as usize;
            let (addr, size, s) = th.live.swap_remove(i);
            th.live_bytes -= size;
            live_sum -= size;
            let d = if hand_off { (s + 1) % streams } else { s };
            free(&mut lists, &mut heap, &epoch, policy, addr, size, s, d);
        }
    }
    let _ = peak_live;
    let peak_live: u64 = ts.iter().map(|t| t.peak).sum();
    format!(
        "{:.3} ({growths} growths, {refreshes} refreshes in {takes} takes, {list_takes} from lists, {flushes} flushes of {flushed_blocks} blocks)",
        peak_held as f64 / peak_live as f64
    )
}

#[allow(clippy::too_many_arguments)]
fn free(
    lists: &mut [Blocks],
    heap: &mut Blocks,
    epoch: &[u64],
    policy: Policy,
    addr: u64,
    size: u64,
    s: usize,
    d: usize,
) {
    if policy.lists && s == d && lists[d].bytes + size <= policy.cap {
        lists[d].give(addr, size, vec![(d, epoch[d])]);
    } else {
        heap.give(addr, size, vec![(d, epoch[d])]);
    }
}

#[test]
#[ignore = "a measurement, not a check: run it with --ignored --nocapture"]
fn two_level_grown_from_256_mib() {
    for (lists, cap) in [
        (true, 4u64 << 20),
        (true, 16 << 20),
        (true, 64 << 20),
        (false, 0),
    ] {
        for tolerance in [0.0] {
            let p = Policy {
                tolerance,
                lists,
                cap,
            };
            eprintln!("lists {lists} cap {cap} tolerance {tolerance}");
            eprintln!("  churn-1t:    {}", run(1, false, p, 0));
            eprintln!("  churn-xs-1t: {}", run(1, true, p, 0));
            for mix in [0, 1, 2] {
                eprintln!("  churn-4t mix {mix}:    {}", run(4, false, p, mix));
                eprintln!("  churn-xs-4t mix {mix}: {}", run(4, true, p, mix));
            }
        }
    }
}
