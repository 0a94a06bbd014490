//! The picture of a trace of events (a log, a history, or a replay with its snapshot at the
//! peak): the timeline in buckets, the peak, what was live there, and the address map.

use std::collections::HashMap;

use indicatif::ProgressBar;
use streamalloc::resource::snapshot::Snapshot;

use super::snapshot::regions_of_snapshot;
use super::*;

/// The picture of a trace. `at_peak`: a snapshot taken at the peak (a replay's), drawn as the
/// address map instead of the log's live allocations, with the stream id (in the snapshot)
/// of each of the trace's streams.
///
/// `Err` names the event after which the bytes in use pass `u64::MAX` (sizes from a file: no
/// real trace has them). The sums of streams' bytes are parts of that total, so cannot pass it.
pub(crate) fn from_trace(
    trace: &Trace,
    title: String,
    at_peak: Option<(&Snapshot, &[u64])>,
    progress: &ProgressBar,
) -> Result<Picture, String> {
    let n = trace.events.len();
    let seconds = trace.events.iter().all(|e| e.t_us.is_some()) && n > 0;
    let x_of = |i: usize| -> f64 {
        if seconds {
            trace.events[i].t_us.unwrap_or(0) as f64 / 1e6
        } else {
            i as f64
        }
    };
    // The timeline spans the earliest to the latest event: times need not be in order (a
    // history reads its clock before its lock, and an RMM log is written by several threads),
    // and an event later than the last one fell past the end (a review's finding).
    let (x0, x1) = if n == 0 {
        (0.0, 1.0)
    } else {
        let (lo, hi) = (0..n)
            .map(x_of)
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
                (lo.min(x), hi.max(x))
            });
        (lo, hi.max(lo + 1e-9))
    };
    let buckets = n.clamp(1, BUCKETS);
    let bucket_of = |x: f64| {
        let b = (((x - x0) / (x1 - x0)) * (buckets - 1) as f64).round();
        // Clamped: in range by construction, but a bucket is an index.
        (b.max(0.0) as usize).min(buckets - 1)
    };

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
                in_use = add_in_use(trace, i, in_use, e.size)?;
                // At most `in_use`, which did not overflow.
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
    Ok(picture)
}

/// `in_use + size` after event `i`, or an error that names it.
fn add_in_use(trace: &Trace, i: usize, in_use: u64, size: u64) -> Result<u64, String> {
    in_use.checked_add(size).ok_or_else(|| {
        format!(
            "{}: an allocation of {size} bytes while {in_use} are in use: more than u64::MAX bytes in use at once, which no real trace has",
            trace.place(i)
        )
    })
}

/// The index of the event after which the most is in use (the first such), if anything is.
/// `Err` as [`from_trace`]'s.
pub(crate) fn peak_index(trace: &Trace) -> Result<Option<usize>, String> {
    let mut live: HashMap<u64, u64> = HashMap::new();
    let (mut in_use, mut peak) = (0u64, None::<(u64, usize)>);
    for (i, e) in trace.events.iter().enumerate() {
        match e.act {
            Act::Alloc => {
                if let Some(old) = live.insert(e.ptr, e.size) {
                    in_use -= old;
                }
                in_use = add_in_use(trace, i, in_use, e.size)?;
            }
            Act::Free => in_use -= live.remove(&e.ptr).unwrap_or(0),
            Act::Fail | Act::Nop => {}
        }
        if in_use > peak.map_or(0, |p| p.0) {
            peak = Some((in_use, i));
        }
    }
    Ok(peak.map(|p| p.1))
}

/// Live allocations (sorted by address here) clustered into regions, with unknown gaps. Ends
/// saturate at `u64::MAX` (the readers refuse an allocation past the end of the address space).
fn regions_of_live(live: &[LiveAlloc]) -> Vec<Region> {
    let mut sorted: Vec<&LiveAlloc> = live.iter().collect();
    sorted.sort_unstable_by_key(|a| a.addr);
    let mut regions: Vec<Region> = Vec::new();
    let end_of = |r: &Region| r.base.saturating_add(r.size);
    for a in sorted {
        let start_new = match regions.last() {
            None => true,
            Some(r) => a.addr > end_of(r).saturating_add(REGION_GAP) || a.addr < end_of(r),
        };
        if start_new && regions.last().is_none_or(|r| a.addr >= end_of(r)) {
            regions.push(Region {
                base: a.addr,
                size: 0,
                blocks: Vec::new(),
            });
        }
        let r = regions.last_mut().expect("pushed above");
        let end = end_of(r);
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
        r.size = a.addr.saturating_add(a.size) - r.base;
    }
    regions
}
