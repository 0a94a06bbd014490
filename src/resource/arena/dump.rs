//! What an arena can say about itself: [`dump`](ArenaResource::dump) (RMM's
//! `dump_memory_log`) and the invariant checker the tests call after every step.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::ArenaResource;
use crate::resource::{MemoryResource, ALIGNMENT};

impl<U: MemoryResource> ArenaResource<U> {
    /// A description of the arena's state, RMM's `dump_memory_log`: what it holds, the global
    /// arena's free regions (with the fragmentation of its free memory, `1 - largest free
    /// region / free bytes`), and each stream arena's superblocks. Logged at `debug` level when
    /// an allocation fails.
    pub fn dump(&self) -> String {
        let stats = self.stats();
        let mut out = String::new();
        let _ = writeln!(
            out,
            "arena resource on {}: reserved {} in {} chunk(s) (peak {}, maximum {}), in use {}, \
             superblock size {}",
            self.device,
            fmt_bytes(stats.reserved as u64),
            stats.chunks,
            fmt_bytes(stats.peak_reserved as u64),
            fmt_bytes(self.maximum),
            fmt_bytes(stats.in_use as u64),
            fmt_bytes(self.superblock),
        );
        let _ = writeln!(
            out,
            "  defragmentations: {}, grows: {}, superblocks moved between streams: {}, chunks \
             given back upstream: {}",
            stats.defragments, stats.grows, stats.superblock_moves, stats.chunks_released
        );
        // Held while the stream arenas are listed (global, registry, stream arena: the order of
        // `stats`): a superblock taken from the global arena meanwhile was listed twice, as a
        // free region and in its stream arena (a review's finding).
        let global = self.global.lock();
        {
            let free = global.free_bytes();
            let largest = global.largest_free();
            let _ = writeln!(
                out,
                "  global arena: {} free region(s), {} free, largest {}, fragmentation {:.2}%",
                global.regions.len(),
                fmt_bytes(free),
                fmt_bytes(largest),
                fragmentation(free, largest)
            );
            for (&addr, region) in &global.regions {
                let _ = writeln!(
                    out,
                    "    free region {:#x}..{:#x} ({}){}",
                    addr,
                    addr + region.size,
                    fmt_bytes(region.size),
                    region.guards.describe()
                );
            }
            let large: u64 = global.large.values().map(|l| l.extent).sum();
            let _ = writeln!(
                out,
                "  large blocks: {} ({}), superblocks lent: {}",
                global.large.len(),
                fmt_bytes(large),
                global.lent.len()
            );
        }
        let arenas = self.arenas();
        let _ = writeln!(out, "  stream arenas: {}", arenas.len());
        for arena in arenas {
            let state = arena.state.lock();
            let _ = writeln!(
                out,
                "    {}: {} superblock(s), {} free in {} block(s), {} remote free(s) pending{}",
                arena.stream.id(),
                state.superblocks.len(),
                fmt_bytes(state.free.free_bytes()),
                state.free.len(),
                state.remote.len(),
                if arena.stream.users() == 0 {
                    " (stream dropped)"
                } else {
                    ""
                }
            );
            for (&base, sb) in &state.superblocks {
                let _ = writeln!(
                    out,
                    "      superblock {:#x}..{:#x} ({}): {} in use{}",
                    base,
                    base + sb.size,
                    fmt_bytes(sb.size),
                    fmt_bytes(sb.used),
                    if sb.used == 0 { " (free)" } else { "" }
                );
            }
        }
        drop(global);
        out
    }

    /// Checks the invariants of the global arena and of every stream arena, and that their
    /// memory tiles the upstream chunks exactly. Slow; for tests.
    ///
    /// Lock order: the global arena's, then each stream arena's in turn (as a move of a
    /// superblock between stream arenas takes them).
    #[doc(hidden)]
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let global = self.global.lock();
        let arenas = self.arenas();
        let mut pieces: Vec<(u64, u64, &'static str)> = Vec::new();
        let mut last_end: Option<u64> = None;
        for (&addr, region) in &global.regions {
            if region.size == 0 || !region.size.is_multiple_of(ALIGNMENT as u64) {
                return Err(format!("region {addr:#x}: bad size {}", region.size));
            }
            if !global.by_size.contains(&(region.size, addr)) {
                return Err(format!("region {addr:#x}: missing from the size index"));
            }
            if last_end == Some(addr) && !global.chunks.contains_key(&addr) {
                return Err(format!("regions at {addr:#x} not coalesced"));
            }
            last_end = Some(addr + region.size);
            pieces.push((addr, region.size, "free region"));
        }
        if global.by_size.len() != global.regions.len() {
            return Err("the size index and the regions disagree".into());
        }
        for (&base, lent) in &global.lent {
            pieces.push((base, lent.size, "superblock"));
            let state = lent.arena.state.lock();
            match state.superblocks.get(&base) {
                Some(sb) if sb.size == lent.size => {}
                _ => {
                    return Err(format!(
                        "superblock {base:#x} lent to {} which does not hold it",
                        lent.arena.stream.id()
                    ))
                }
            }
        }
        for (&addr, large) in &global.large {
            pieces.push((addr, large.extent, "large block"));
        }
        for (&addr, &size) in &global.leaked {
            pieces.push((addr, size, "leaked region"));
        }
        pieces.sort_unstable();
        for w in pieces.windows(2) {
            if w[0].0 + w[0].1 > w[1].0 {
                return Err(format!(
                    "{} {:#x}+{} overlaps {} {:#x}",
                    w[0].2, w[0].0, w[0].1, w[1].2, w[1].0
                ));
            }
        }
        for &(addr, size, what) in &pieces {
            let inside = global
                .chunks
                .range(..=addr)
                .next_back()
                .is_some_and(|(&b, &s)| addr + size <= b + s);
            if !inside {
                return Err(format!("{what} {addr:#x}+{size} is not inside one chunk"));
            }
        }
        let tiled: u64 = pieces.iter().map(|p| p.1).sum();
        let chunks: u64 = global.chunks.values().sum();
        if tiled != chunks {
            return Err(format!(
                "chunks hold {chunks} bytes, regions, superblocks, large blocks and leaks {tiled}"
            ));
        }
        for arena in arenas {
            let state = arena.state.lock();
            let id = arena.stream.id();
            state.free.check().map_err(|e| format!("{id}: {e}"))?;
            let mut free_in: BTreeMap<u64, u64> = BTreeMap::new();
            for (addr, size) in state.free.blocks() {
                let base = state.find(addr, size).ok_or_else(|| {
                    format!("{id}: free block {addr:#x}+{size} outside its superblocks")
                })?;
                *free_in.entry(base).or_default() += size;
            }
            // A block freed on another stream waits in the arena holding its superblock (an
            // adoption that failed once put one back into an arena the superblock had left).
            for r in &state.remote {
                if state.find(r.addr, r.size).is_none() {
                    return Err(format!(
                        "{id}: remote free {:#x}+{} outside its superblocks",
                        r.addr, r.size
                    ));
                }
            }
            for (&base, sb) in &state.superblocks {
                match global.lent.get(&base) {
                    Some(lent) if lent.arena.stream.id() == id => {}
                    _ => return Err(format!("{id}: superblock {base:#x} is not lent to it")),
                }
                let free = free_in.get(&base).copied().unwrap_or(0);
                if free + sb.used != sb.size {
                    return Err(format!(
                        "{id}: superblock {base:#x}: {free} free + {} used != {}",
                        sb.used, sb.size
                    ));
                }
            }
        }
        Ok(())
    }
}

/// `1 - largest / free`, in percent (0 with nothing free).
fn fragmentation(free: u64, largest: u64) -> f64 {
    if free == 0 {
        0.0
    } else {
        (1.0 - largest as f64 / free as f64) * 100.0
    }
}

/// `1.50 MiB (1572864 B)`-style sizes for the dump.
fn fmt_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = "B";
    for u in UNITS {
        if value < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = u;
    }
    format!("{value:.2} {unit}")
}
