//! [`ExpandablePoolResource::snapshot`]: the mapped ranges and the blocks that tile them (see
//! [`resource::snapshot`](crate::resource::snapshot)).

use super::ExpandablePoolResource;
use crate::resource::snapshot::{free_blocks, tile, ChunkKind, Snapshot};

impl ExpandablePoolResource {
    /// Every mapped range of the reservation (runs of mapped granules, as
    /// [`ChunkKind::Mapped`] chunks) and the blocks that tile it: free blocks with the stream
    /// whose list holds them (`None`: fresh memory, the unclaimed pieces of the initial size
    /// among it), and between them the memory handed out, as in-use blocks with no stream or
    /// time, as in [`PoolResource::snapshot`](crate::resource::pool::PoolResource::snapshot)
    /// (whose notes on cost and atomicity hold here too). Unmapped address space is not shown.
    pub fn snapshot(&self) -> Snapshot {
        let core = &self.inner.core;
        let mut snapshot = Snapshot::new("expandable pool");
        snapshot.reserved = core.reserved();
        let (runs, mut lists, unclaimed) = core.snapshot_parts();
        // The initial size's pieces that no shard has claimed yet: fresh free memory.
        match lists.iter_mut().find(|l| l.0.is_none()) {
            Some(fresh) => fresh.1.extend(unclaimed),
            None => lists.push((None, unclaimed)),
        }
        let free = free_blocks(lists);
        snapshot.chunks = tile(&runs, ChunkKind::Mapped, free, &mut snapshot.notes);
        snapshot.notes.push(
            "in-use blocks are the gaps between free blocks in mapped memory: adjacent allocations show as one block, with no stream or time (no live tracking)".into(),
        );
        snapshot
    }
}
