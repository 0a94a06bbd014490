//! [`BinningResource::snapshot`]: its bins and fallback, each a part (see
//! [`resource::snapshot`](crate::resource::snapshot)).

use super::{BinResource, BinningResource, Fallback};
use crate::resource::snapshot::Snapshot;
use crate::resource::MemoryResource;

impl<U: MemoryResource> BinningResource<U> {
    /// A snapshot with no chunks of its own and one part per bin, smallest first, then one
    /// for the fallback: each the [`memory_snapshot`](MemoryResource::memory_snapshot) of the
    /// resource that serves it (a fixed-size bin's [`snapshot`], a given resource's own), or
    /// a note where that resource has none (the upstream when it is a base resource such as
    /// `CudaResource`, which hands out whole allocations).
    ///
    /// `reserved` counts each piece of memory once: the parts' `reserved`, less those of parts
    /// whose chunks all lie inside another part's chunks. The fixed-size bins take their
    /// chunks from the upstream: where the upstream is the fallback and can be snapshotted (a
    /// pool), its part shows those chunks as blocks in use, and `reserved` is the upstream's
    /// (plus given resources'), not the sum of the parts. So is a resource given for a bin or
    /// as the fallback that is the upstream itself, or that is given twice: counted once (a
    /// review found such a pool counted once per part).
    ///
    /// [`snapshot`]: crate::resource::fixed_size::FixedSizeResource::snapshot
    pub fn snapshot(&self) -> Snapshot {
        let mut snapshot = Snapshot::new("binning");
        for bin in &self.bins {
            let part = match &bin.resource {
                BinResource::Fixed(fixed) => Some(fixed.snapshot()),
                BinResource::Given(resource) => resource.memory_snapshot(),
            };
            match part {
                Some(mut part) => {
                    part.resource = format!("bin <= {} B: {}", bin.size, part.resource);
                    snapshot.parts.push(part);
                }
                None => snapshot.notes.push(format!(
                    "bin <= {} B: its resource gives no snapshot",
                    bin.size
                )),
            }
        }
        let (fallback, shared) = match &self.fallback {
            Fallback::Upstream => (self.upstream.memory_snapshot(), true),
            Fallback::Given(resource) => (resource.memory_snapshot(), false),
        };
        match fallback {
            Some(mut part) => {
                part.resource = if shared {
                    format!("fallback (the upstream): {}", part.resource)
                } else {
                    format!("fallback: {}", part.resource)
                };
                snapshot.parts.push(part);
            }
            None => snapshot.notes.push(
                "the fallback gives no snapshot: its allocations, and memory it holds, are not shown"
                    .into(),
            ),
        }
        snapshot.reserved = reserved_once(&snapshot.parts);
        snapshot
    }
}

/// The sum of the parts' `reserved`, each piece of memory once: a part whose chunks all lie
/// inside the chunks of another part holds memory that part already counts (a fixed-size
/// bin's chunks inside the upstream pool's blocks; the same resource given twice, or given
/// and also the upstream: the first of them is counted). A part with no chunks is counted
/// (what it reserves is being grown or given back, which no other part shows).
fn reserved_once(parts: &[Snapshot]) -> u64 {
    // Each part's chunks as sorted `(base, end)`: a lookup is a binary search (a fixed-size
    // bin may hold thousands of chunks).
    let ranges: Vec<Vec<(u64, u64)>> = parts
        .iter()
        .map(|p| {
            let mut r: Vec<(u64, u64)> = (p.chunks.iter())
                .map(|c| (c.base, c.base.saturating_add(c.size)))
                .collect();
            r.sort_unstable();
            r
        })
        .collect();
    let inside = |inner: &[(u64, u64)], outer: &[(u64, u64)]| {
        !inner.is_empty()
            && inner.iter().all(|&(base, end)| {
                // The last outer chunk that starts at or before `base` is the only candidate
                // (an upstream's chunks do not overlap).
                let at = outer.partition_point(|o| o.0 <= base);
                at > 0 && end <= outer[at - 1].1
            })
    };
    let mut reserved = 0u64;
    for (i, part) in parts.iter().enumerate() {
        let counted_elsewhere = (0..parts.len()).any(|j| {
            // Two parts inside each other hold the same chunks: the first one counts them.
            j != i && inside(&ranges[i], &ranges[j]) && (j < i || !inside(&ranges[j], &ranges[i]))
        });
        if !counted_elsewhere {
            reserved = reserved.saturating_add(part.reserved);
        }
    }
    reserved
}
