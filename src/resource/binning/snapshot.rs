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
    /// The fixed-size bins take their chunks from the upstream: where the upstream is the
    /// fallback and can be snapshotted (a pool), its part shows those chunks as blocks in use,
    /// and `reserved` is the upstream's (plus given resources'), not the sum of the parts.
    ///
    /// [`snapshot`]: crate::resource::fixed_size::FixedSizeResource::snapshot
    pub fn snapshot(&self) -> Snapshot {
        let mut snapshot = Snapshot::new("binning");
        let mut bins_reserved = 0;
        let mut given_reserved = 0;
        for bin in &self.bins {
            let part = match &bin.resource {
                BinResource::Fixed(fixed) => {
                    let part = fixed.snapshot();
                    bins_reserved += part.reserved;
                    Some(part)
                }
                BinResource::Given(resource) => {
                    let part = resource.memory_snapshot();
                    given_reserved += part.as_ref().map_or(0, |p| p.reserved);
                    part
                }
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
                if shared {
                    snapshot.reserved = part.reserved + given_reserved;
                    part.resource = format!("fallback (the upstream): {}", part.resource);
                } else {
                    snapshot.reserved = bins_reserved + given_reserved + part.reserved;
                    part.resource = format!("fallback: {}", part.resource);
                }
                snapshot.parts.push(part);
            }
            None => {
                snapshot.reserved = bins_reserved + given_reserved;
                snapshot.notes.push(
                    "the fallback gives no snapshot: its allocations, and memory it holds, are not shown"
                        .into(),
                );
            }
        }
        snapshot
    }
}
