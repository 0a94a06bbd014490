//! The picture of a snapshot (one moment: no timeline), and a snapshot's chunks as regions of
//! the address map, which a replay's picture uses too.

use std::collections::HashMap;

use streamalloc::resource::snapshot::{BlockState, Snapshot};

use super::*;

/// A snapshot's chunks (and its parts') as regions. `colour` maps a stream id to a stream
/// index of the picture. Returns the regions and the stream ids seen, in order of first sight.
pub(super) fn regions_of_snapshot(
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
    // Every chunk of every part, none dropped: a part's chunks can lie inside another's (a
    // binning resource's bins take theirs from its pool, the first at the pool chunk's base).
    // Deduplicated by base, the pool's whole chunk was dropped (a review's finding). The
    // enclosing chunk first.
    regions.sort_by_key(|r| (r.base, std::cmp::Reverse(r.size)));
    (regions, seen)
}

/// The picture of a snapshot: no timeline, its chunks as the address space, its in-use blocks
/// as the largest allocations. Sums saturate: a snapshot read from a file is checked first (its
/// blocks tile its chunks, whose sizes add up to at most `u64::MAX`), so they do not.
pub(crate) fn from_snapshot(snapshot: &Snapshot, title: String) -> Picture {
    // Streams by the bytes they have in use, then those with only free blocks.
    let mut bytes: HashMap<u64, u64> = HashMap::new();
    let in_use = snapshot.bytes(BlockState::InUse);
    for b in snapshot.blocks() {
        if let Some(s) = b.stream {
            let e = bytes.entry(s).or_default();
            if b.state == BlockState::InUse {
                *e = e.saturating_add(b.size);
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
