//! What the picture shows, computed from a trace of events (a log or a history) or from a
//! snapshot: memory over time, the address space at the peak, the largest live allocations.

use std::collections::HashMap;

use indicatif::ProgressBar;
use streamalloc::resource::snapshot::{BlockState, Snapshot};

/// At most this many streams are told apart; the others share the last colour.
pub(crate) const MAX_STREAMS: usize = 10;
/// Points of the timeline (each the maximum of its stretch of events).
const BUCKETS: usize = 1200;
/// Live allocations further apart than this are drawn as separate regions of the address map.
const REGION_GAP: u64 = 64 << 20;
/// Rows of the largest-allocations table.
const LARGEST: usize = 20;

/// What one event does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Act {
    Alloc,
    Free,
    Fail,
    /// A zero-byte allocation or a free of null.
    Nop,
}

/// One event of a trace.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ev {
    /// Microseconds since the trace's first event, if the trace has times.
    pub(crate) t_us: Option<u64>,
    pub(crate) act: Act,
    pub(crate) ptr: u64,
    pub(crate) size: u64,
    /// Index into [`Trace::streams`].
    pub(crate) stream: u32,
    /// Index into [`Trace::backtraces`].
    pub(crate) backtrace: Option<u32>,
}

/// Events read from a log or a history.
#[derive(Debug, Default)]
pub(crate) struct Trace {
    pub(crate) events: Vec<Ev>,
    /// The streams' names as the source writes them, by first appearance.
    pub(crate) streams: Vec<String>,
    pub(crate) backtraces: Vec<String>,
    /// Bytes reserved after each event, when known (a replay).
    pub(crate) reserved: Option<Vec<u64>>,
    /// Events the source dropped before the first one kept (a history's ring).
    pub(crate) dropped: u64,
}

/// What a block of the address map is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MapState {
    InUse,
    Free,
    Waiting,
    /// Between live allocations of a log: free, or not held at all (a log does not say).
    Unknown,
}

#[derive(Debug, Clone)]
pub(crate) struct MapBlock {
    pub(crate) addr: u64,
    pub(crate) size: u64,
    pub(crate) state: MapState,
    /// Index into [`Picture::streams`].
    pub(crate) stream: Option<usize>,
}

/// A contiguous stretch of addresses: a chunk of a snapshot, or a cluster of a log's live
/// allocations.
#[derive(Debug, Clone)]
pub(crate) struct Region {
    pub(crate) base: u64,
    pub(crate) size: u64,
    pub(crate) blocks: Vec<MapBlock>,
}

/// A live allocation at the peak.
#[derive(Debug, Clone)]
pub(crate) struct LiveAlloc {
    pub(crate) addr: u64,
    pub(crate) size: u64,
    pub(crate) stream: Option<usize>,
    /// Seconds since the trace's start (or the snapshot's allocation time, relative to the
    /// oldest), if known.
    pub(crate) allocated_at_s: Option<f64>,
    pub(crate) backtrace: Option<String>,
}

#[derive(Debug, Clone)]
pub(crate) struct StreamInfo {
    pub(crate) name: String,
    /// The most this stream had in use at once.
    pub(crate) peak: u64,
    /// Its bytes in use at the overall peak.
    pub(crate) at_peak: u64,
}

/// Memory over time, one point per stretch of events.
#[derive(Debug, Clone, Default)]
pub(crate) struct Timeline {
    /// `true`: `xs` are seconds since the start; `false`: event numbers.
    pub(crate) seconds: bool,
    pub(crate) xs: Vec<f64>,
    /// The most in use during each stretch.
    pub(crate) in_use: Vec<u64>,
    /// In use by each stream (of [`Picture::streams`]) at that moment.
    pub(crate) per_stream: Vec<Vec<u64>>,
    pub(crate) reserved: Option<Vec<u64>>,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct Counts {
    pub(crate) events: u64,
    pub(crate) allocations: u64,
    pub(crate) frees: u64,
    pub(crate) failures: u64,
    pub(crate) unmatched_frees: u64,
}

/// Everything the page shows.
#[derive(Debug, Clone, Default)]
pub(crate) struct Picture {
    pub(crate) title: String,
    pub(crate) timeline: Option<Timeline>,
    pub(crate) peak_in_use: u64,
    /// Seconds (or the event number) of the peak.
    pub(crate) peak_x: f64,
    pub(crate) peak_event: Option<u64>,
    pub(crate) peak_reserved: Option<u64>,
    pub(crate) counts: Counts,
    /// Ordered by their peak, largest first; at most [`MAX_STREAMS`] (the last may be
    /// "other streams").
    pub(crate) streams: Vec<StreamInfo>,
    pub(crate) regions: Vec<Region>,
    /// The address map shows free blocks (a snapshot), or only live ones (a log).
    pub(crate) map_from_snapshot: bool,
    pub(crate) largest: Vec<LiveAlloc>,
    pub(crate) notes: Vec<String>,
}

// ===== from a trace =====

/// The picture of a trace. `at_peak`: a snapshot taken at the peak (a replay's), drawn as the
/// address map instead of the log's live allocations, with the stream id (in the snapshot)
/// of each of the trace's streams.
pub(crate) fn from_trace(
    trace: &Trace,
    title: String,
    at_peak: Option<(&Snapshot, &[u64])>,
    progress: &ProgressBar,
) -> Picture {
    let n = trace.events.len();
    let seconds = trace.events.iter().all(|e| e.t_us.is_some()) && n > 0;
    let x_of = |i: usize| -> f64 {
        if seconds {
            trace.events[i].t_us.unwrap_or(0) as f64 / 1e6
        } else {
            i as f64
        }
    };
    let (x0, x1) = if n == 0 {
        (0.0, 1.0)
    } else {
        (x_of(0), x_of(n - 1).max(x_of(0) + 1e-9))
    };
    let buckets = n.clamp(1, BUCKETS);
    let bucket_of = |x: f64| (((x - x0) / (x1 - x0)) * (buckets - 1) as f64).round() as usize;

    // Streams by first appearance; the picture orders them by peak later.
    let streams = trace.streams.len().max(1);
    let mut counts = Counts {
        events: n as u64,
        ..Counts::default()
    };
    let mut live: HashMap<u64, (u64, u32)> = HashMap::new();
    let mut in_use = 0u64;
    let mut per = vec![0u64; streams];
    let mut stream_peak = vec![0u64; streams];
    let mut peak = (0u64, 0usize);
    let mut b_max: Vec<Option<u64>> = vec![None; buckets];
    let mut b_streams: Vec<Vec<u64>> = vec![Vec::new(); buckets];
    let mut b_reserved: Vec<u64> = vec![0; buckets];
    // The level (and each stream's) after each stretch's last event, carried over the
    // stretches with no event.
    let mut b_end: Vec<Option<(u64, Vec<u64>)>> = vec![None; buckets];
    let mut cur_b = 0usize;
    progress.set_length(2 * n as u64);
    for (i, e) in trace.events.iter().enumerate() {
        if i % 65536 == 0 {
            progress.set_position(i as u64);
        }
        let b = bucket_of(x_of(i));
        if b != cur_b {
            b_end[cur_b] = Some((in_use, per.clone()));
            cur_b = b;
        }
        match e.act {
            Act::Alloc => {
                counts.allocations += 1;
                if let Some((old, s)) = live.insert(e.ptr, (e.size, e.stream)) {
                    in_use -= old;
                    per[s as usize] -= old;
                }
                in_use += e.size;
                per[e.stream as usize] += e.size;
                let s = e.stream as usize;
                stream_peak[s] = stream_peak[s].max(per[s]);
            }
            Act::Free => {
                counts.frees += 1;
                match live.remove(&e.ptr) {
                    Some((size, s)) => {
                        in_use -= size;
                        per[s as usize] -= size;
                    }
                    None => counts.unmatched_frees += 1,
                }
            }
            Act::Fail => counts.failures += 1,
            Act::Nop => {}
        }
        if in_use > peak.0 {
            peak = (in_use, i);
        }
        if b_max[b].is_none_or(|m| in_use >= m) {
            b_max[b] = Some(in_use);
            b_streams[b].clone_from(&per);
        }
        if let Some(r) = &trace.reserved {
            b_reserved[b] = b_reserved[b].max(r[i]);
        }
    }
    b_end[cur_b] = Some((in_use, per.clone()));
    // Stretches with no event carry the level of the one before.
    let mut xs = Vec::with_capacity(buckets);
    let mut ys = Vec::with_capacity(buckets);
    let mut ss: Vec<Vec<u64>> = Vec::with_capacity(buckets);
    let mut rs = Vec::with_capacity(buckets);
    let (mut carry, mut carry_s, mut carry_r) = (0u64, vec![0u64; streams], 0u64);
    for b in 0..buckets {
        let x = x0 + (x1 - x0) * b as f64 / (buckets - 1).max(1) as f64;
        xs.push(x);
        match b_max[b] {
            Some(m) => {
                ys.push(m);
                ss.push(std::mem::take(&mut b_streams[b]));
                if trace.reserved.is_some() {
                    carry_r = b_reserved[b];
                }
                if let Some((level, s)) = b_end[b].take() {
                    carry = level;
                    carry_s = s;
                }
            }
            None => {
                ys.push(carry);
                ss.push(carry_s.clone());
            }
        }
        rs.push(carry_r);
    }

    // Live at the peak: replay up to it.
    let mut live_at_peak: HashMap<u64, (u64, u32, usize)> = HashMap::new();
    let mut per_at_peak = vec![0u64; streams];
    if peak.0 > 0 {
        for (i, e) in trace.events.iter().enumerate().take(peak.1 + 1) {
            if i % 65536 == 0 {
                progress.set_position((n + i) as u64);
            }
            match e.act {
                Act::Alloc => {
                    if let Some((old, s, _)) = live_at_peak.insert(e.ptr, (e.size, e.stream, i)) {
                        per_at_peak[s as usize] -= old;
                    }
                    per_at_peak[e.stream as usize] += e.size;
                }
                Act::Free => {
                    if let Some((size, s, _)) = live_at_peak.remove(&e.ptr) {
                        per_at_peak[s as usize] -= size;
                    }
                }
                Act::Fail | Act::Nop => {}
            }
        }
    }

    // Streams ordered by peak; the tail shares one entry.
    let (order, infos) = rank_streams(
        (0..streams)
            .map(|s| StreamInfo {
                name: trace
                    .streams
                    .get(s)
                    .map_or_else(|| "stream".into(), |n| format!("stream {n}")),
                peak: stream_peak[s],
                at_peak: per_at_peak[s],
            })
            .collect(),
    );
    let per_stream: Vec<Vec<u64>> = (0..infos.len())
        .map(|k| {
            ss.iter()
                .map(|v| {
                    v.iter()
                        .enumerate()
                        .filter(|(s, _)| order[*s] == k)
                        .map(|(_, b)| *b)
                        .sum()
                })
                .collect()
        })
        .collect();

    let mut largest: Vec<LiveAlloc> = live_at_peak
        .iter()
        .map(|(&addr, &(size, s, i))| LiveAlloc {
            addr,
            size,
            stream: Some(order[s as usize]),
            allocated_at_s: seconds.then(|| x_of(i) - x0),
            backtrace: trace.events[i]
                .backtrace
                .and_then(|b| trace.backtraces.get(b as usize).cloned()),
        })
        .collect();
    largest.sort_unstable_by(|a, b| b.size.cmp(&a.size).then(a.addr.cmp(&b.addr)));

    let mut picture = Picture {
        title,
        peak_in_use: peak.0,
        peak_x: if n == 0 {
            0.0
        } else {
            x_of(peak.1) - if seconds { x0 } else { 0.0 }
        },
        peak_event: (n > 0).then_some(peak.1 as u64),
        peak_reserved: trace
            .reserved
            .as_ref()
            .and_then(|r| r.iter().max().copied()),
        counts,
        streams: infos,
        timeline: Some(Timeline {
            seconds,
            xs: xs
                .iter()
                .map(|x| if seconds { x - x0 } else { *x })
                .collect(),
            in_use: ys,
            per_stream,
            reserved: trace.reserved.as_ref().map(|_| rs),
        }),
        ..Picture::default()
    };
    match at_peak {
        Some((snapshot, ids)) => {
            // The snapshot names streams by their ids in the replay: each stands for one of
            // the trace's streams.
            let (regions, _) = regions_of_snapshot(snapshot, &mut |id| {
                ids.iter().position(|&i| i == id).map(|s| order[s])
            });
            picture.regions = regions;
            picture.map_from_snapshot = true;
            picture.notes.push(
                "address space: the replayed resource's own snapshot after the log's peak event: its chunks, its free blocks by the stream whose list holds them, and the replay's live allocations at their addresses (a peak counted from the log's sizes; where the replay refused an allocation, its memory is missing there)".into(),
            );
            picture.notes.extend(snapshot.notes.iter().cloned());
        }
        None => {
            picture.regions = regions_of_live(&largest);
            picture.notes.push(
                "address space: the log's live allocations at the peak; the grey between them may be free or not held at all (a log does not say)".into(),
            );
        }
    }
    largest.truncate(LARGEST);
    picture.largest = largest;
    if trace.dropped > 0 {
        picture.notes.push(format!(
            "the history dropped its {} oldest events: allocations made before the first one kept are not counted",
            trace.dropped
        ));
    }
    if picture.counts.unmatched_frees > 0 {
        picture.notes.push(format!(
            "{} free(s) of pointers no earlier event allocated (the log started while memory was allocated) were ignored",
            picture.counts.unmatched_frees
        ));
    }
    progress.finish_and_clear();
    picture
}

/// The index of the event after which the most is in use (the first such), if anything is.
pub(crate) fn peak_index(trace: &Trace) -> Option<usize> {
    let mut live: HashMap<u64, u64> = HashMap::new();
    let (mut in_use, mut peak) = (0u64, None::<(u64, usize)>);
    for (i, e) in trace.events.iter().enumerate() {
        match e.act {
            Act::Alloc => {
                in_use += e.size;
                if let Some(old) = live.insert(e.ptr, e.size) {
                    in_use -= old;
                }
            }
            Act::Free => in_use -= live.remove(&e.ptr).unwrap_or(0),
            Act::Fail | Act::Nop => {}
        }
        if in_use > peak.map_or(0, |p| p.0) {
            peak = Some((in_use, i));
        }
    }
    peak.map(|p| p.1)
}

/// Orders streams by peak (largest first), keeping [`MAX_STREAMS`] - 1 and folding the rest
/// into "other streams". Returns each input stream's index in the result, and the result.
fn rank_streams(infos: Vec<StreamInfo>) -> (Vec<usize>, Vec<StreamInfo>) {
    let mut idx: Vec<usize> = (0..infos.len()).collect();
    idx.sort_by(|&a, &b| infos[b].peak.cmp(&infos[a].peak).then(a.cmp(&b)));
    let mut order = vec![0usize; infos.len()];
    let mut out: Vec<StreamInfo> = Vec::new();
    for (rank, &s) in idx.iter().enumerate() {
        if infos.len() > MAX_STREAMS && rank >= MAX_STREAMS - 1 {
            if out.len() < MAX_STREAMS {
                out.push(StreamInfo {
                    name: format!("{} other streams", infos.len() - (MAX_STREAMS - 1)),
                    peak: 0,
                    at_peak: 0,
                });
            }
            let other = out.last_mut().expect("pushed above");
            other.peak = other.peak.max(infos[s].peak);
            other.at_peak += infos[s].at_peak;
            order[s] = MAX_STREAMS - 1;
        } else {
            order[s] = out.len();
            out.push(infos[s].clone());
        }
    }
    (order, out)
}

/// Live allocations (sorted by address here) clustered into regions, with unknown gaps.
fn regions_of_live(live: &[LiveAlloc]) -> Vec<Region> {
    let mut sorted: Vec<&LiveAlloc> = live.iter().collect();
    sorted.sort_unstable_by_key(|a| a.addr);
    let mut regions: Vec<Region> = Vec::new();
    for a in sorted {
        let start_new = match regions.last() {
            None => true,
            Some(r) => a.addr > r.base + r.size + REGION_GAP || a.addr < r.base + r.size,
        };
        if start_new && regions.last().is_none_or(|r| a.addr >= r.base + r.size) {
            regions.push(Region {
                base: a.addr,
                size: 0,
                blocks: Vec::new(),
            });
        }
        let r = regions.last_mut().expect("pushed above");
        let end = r.base + r.size;
        if a.addr > end {
            r.blocks.push(MapBlock {
                addr: end,
                size: a.addr - end,
                state: MapState::Unknown,
                stream: None,
            });
        }
        if a.addr < end {
            continue; // overlaps the previous one: a malformed log; drawn once
        }
        r.blocks.push(MapBlock {
            addr: a.addr,
            size: a.size,
            state: MapState::InUse,
            stream: a.stream,
        });
        r.size = a.addr + a.size - r.base;
    }
    regions
}

// ===== from a snapshot =====

/// A snapshot's chunks (and its parts') as regions. `colour` maps a stream id to a stream
/// index of the picture. Returns the regions and the stream ids seen, in order of first sight.
fn regions_of_snapshot(
    snapshot: &Snapshot,
    colour: &mut dyn FnMut(u64) -> Option<usize>,
) -> (Vec<Region>, Vec<u64>) {
    let mut regions = Vec::new();
    let mut seen = Vec::new();
    let mut all: Vec<&Snapshot> = vec![snapshot];
    let mut i = 0;
    while i < all.len() {
        all.extend(all[i].parts.iter());
        i += 1;
    }
    for s in all {
        for chunk in &s.chunks {
            regions.push(Region {
                base: chunk.base,
                size: chunk.size,
                blocks: chunk
                    .blocks
                    .iter()
                    .map(|b| {
                        if let Some(id) = b.stream {
                            if !seen.contains(&id) {
                                seen.push(id);
                            }
                        }
                        MapBlock {
                            addr: b.addr,
                            size: b.size,
                            state: match b.state {
                                BlockState::InUse => MapState::InUse,
                                BlockState::Free => MapState::Free,
                                BlockState::WaitingForStream => MapState::Waiting,
                            },
                            stream: b.stream.and_then(&mut *colour),
                        }
                    })
                    .collect(),
            });
        }
    }
    regions.sort_by_key(|r| r.base);
    regions.dedup_by_key(|r| r.base);
    (regions, seen)
}

/// The picture of a snapshot: no timeline, its chunks as the address space, its in-use blocks
/// as the largest allocations.
pub(crate) fn from_snapshot(snapshot: &Snapshot, title: String) -> Picture {
    // Streams by the bytes they have in use, then those with only free blocks.
    let mut bytes: HashMap<u64, u64> = HashMap::new();
    for b in snapshot.blocks() {
        if let Some(s) = b.stream {
            let e = bytes.entry(s).or_default();
            if b.state == BlockState::InUse {
                *e += b.size;
            }
        }
    }
    let mut ids: Vec<u64> = bytes.keys().copied().collect();
    ids.sort_by(|a, b| bytes[b].cmp(&bytes[a]).then(a.cmp(b)));
    let (order, streams) = rank_streams(
        ids.iter()
            .map(|id| StreamInfo {
                name: format!("stream {id}"),
                peak: bytes[id],
                at_peak: bytes[id],
            })
            .collect(),
    );
    let index: HashMap<u64, usize> = ids
        .iter()
        .enumerate()
        .map(|(i, &id)| (id, order[i]))
        .collect();
    let (regions, _) = regions_of_snapshot(snapshot, &mut |id| index.get(&id).copied());
    let oldest = snapshot.blocks().filter_map(|b| b.allocated_at_us).min();
    let mut largest: Vec<LiveAlloc> = snapshot
        .blocks()
        .filter(|b| b.state == BlockState::InUse)
        .map(|b| LiveAlloc {
            addr: b.addr,
            size: b.requested.unwrap_or(b.size),
            stream: b.stream.and_then(|s| index.get(&s).copied()),
            allocated_at_s: b
                .allocated_at_us
                .zip(oldest)
                .map(|(t, o)| (t - o) as f64 / 1e6),
            backtrace: b.backtrace.clone(),
        })
        .collect();
    largest.sort_unstable_by(|a, b| b.size.cmp(&a.size).then(a.addr.cmp(&b.addr)));
    largest.truncate(LARGEST);
    let in_use = snapshot.bytes(BlockState::InUse);
    let mut notes = snapshot.notes.clone();
    if !snapshot.live_blocks_tracked {
        notes.push("largest allocations: without live tracking, an in-use block may be several adjacent allocations".into());
    }
    Picture {
        title,
        timeline: None,
        peak_in_use: in_use,
        peak_x: 0.0,
        peak_event: None,
        peak_reserved: Some(snapshot.reserved),
        counts: Counts::default(),
        streams,
        regions,
        map_from_snapshot: true,
        largest,
        notes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(t: u64, act: Act, ptr: u64, size: u64, stream: u32) -> Ev {
        Ev {
            t_us: Some(t),
            act,
            ptr,
            size,
            stream,
            backtrace: None,
        }
    }

    #[test]
    fn peak_and_live_at_peak() {
        let trace = Trace {
            events: vec![
                ev(0, Act::Alloc, 0x1000, 100, 0),
                ev(10, Act::Alloc, 0x2000, 300, 1),
                ev(20, Act::Free, 0x1000, 100, 0),
                ev(30, Act::Alloc, 0x3000, 50, 0),
                ev(40, Act::Free, 0x2000, 300, 1),
            ],
            streams: vec!["7".into(), "9".into()],
            ..Trace::default()
        };
        let p = from_trace(&trace, "t".into(), None, &ProgressBar::hidden());
        assert_eq!(p.peak_in_use, 400);
        assert_eq!(p.peak_event, Some(1));
        assert!((p.peak_x - 10e-6).abs() < 1e-12);
        assert_eq!(p.largest.len(), 2);
        assert_eq!(p.largest[0].size, 300);
        assert_eq!(p.streams[0].name, "stream 9");
        assert_eq!(p.streams[0].peak, 300);
        let t = p.timeline.unwrap();
        assert_eq!(t.in_use.iter().max(), Some(&400));
        assert_eq!(*t.in_use.last().unwrap(), 50);
        // One region: 0x1000..0x2000+300 with an unknown gap.
        assert_eq!(p.regions.len(), 1);
        assert_eq!(p.regions[0].blocks.len(), 3);
    }
}
