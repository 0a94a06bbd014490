//! The picture of a snapshot (one moment: no timeline), and a snapshot's chunks as regions of
//! the address map, which a replay's picture uses too.

use std::collections::HashMap;

use streamalloc::resource::snapshot::{Block, BlockState, Chunk, Snapshot};

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
    for b in snapshot.blocks() {
        if let Some(s) = b.stream {
            bytes.entry(s).or_default();
        }
    }
    let used = in_use_pieces(snapshot);
    let mut in_use = 0u64;
    for (b, pieces) in &used {
        let held = pieces.iter().fold(0u64, |t, p| t.saturating_add(p.1));
        in_use = in_use.saturating_add(held);
        if let Some(s) = b.stream {
            let e = bytes.entry(s).or_default();
            *e = e.saturating_add(held);
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
    let index = &index;
    let mut largest: Vec<LiveAlloc> = used
        .iter()
        .flat_map(|(b, pieces)| {
            let whole = pieces.as_slice() == [(b.addr, b.size)];
            pieces.iter().map(move |&(addr, size)| LiveAlloc {
                addr,
                size: if whole {
                    b.requested.unwrap_or(b.size)
                } else {
                    size
                },
                stream: b.stream.and_then(|s| index.get(&s).copied()),
                allocated_at_s: b
                    .allocated_at_us
                    .zip(oldest)
                    .map(|(t, o)| (t - o) as f64 / 1e6),
                backtrace: b.backtrace.clone(),
            })
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

/// The in-use blocks of `snapshot` and its parts, each with the pieces of it (address, size)
/// that are not another part's chunk. A part's chunks can be memory of another part's in-use
/// blocks (a binning resource's bins take theirs from its pool, which shows each as a block in
/// use, or, without live tracking, as part of one): counted there too, they were in use twice,
/// and a bin's whole chunk was listed as an allocation (a review's finding). A chunk of the
/// same range as the block's own chunk is inside it only if it comes first (a binning
/// resource's bins come before its pool).
fn in_use_pieces(snapshot: &Snapshot) -> Vec<(&Block, Vec<(u64, u64)>)> {
    fn walk<'a>(s: &'a Snapshot, out: &mut Vec<&'a Chunk>) {
        out.extend(s.chunks.iter());
        for part in &s.parts {
            walk(part, out);
        }
    }
    let mut chunks = Vec::new();
    walk(snapshot, &mut chunks);
    let end = |base: u64, size: u64| base.saturating_add(size);
    // (base, end, the chunk's place in `chunks`), by address.
    let mut ranges: Vec<(u64, u64, usize)> = (chunks.iter().enumerate())
        .map(|(i, c)| (c.base, end(c.base, c.size), i))
        .collect();
    ranges.sort_unstable();
    let mut out = Vec::new();
    for (own, chunk) in chunks.iter().enumerate() {
        let own_range = (chunk.base, end(chunk.base, chunk.size));
        for b in (chunk.blocks.iter()).filter(|b| b.state == BlockState::InUse) {
            let b_end = end(b.addr, b.size);
            let first = ranges.partition_point(|r| r.0 < b.addr);
            let (mut pieces, mut at) = (Vec::new(), b.addr);
            for &(base, c_end, i) in ranges[first..].iter().take_while(|r| r.0 < b_end) {
                let inside = i != own && c_end <= b_end && ((base, c_end) != own_range || i < own);
                if !inside || base < at {
                    continue;
                }
                if base > at {
                    pieces.push((at, base - at));
                }
                at = c_end;
            }
            if at < b_end {
                pieces.push((at, b_end - at));
            }
            out.push((b, pieces));
        }
    }
    out
}
