//! [`FixedSizeResource::snapshot`]: its chunks and blocks (see
//! [`resource::snapshot`](crate::resource::snapshot)).

use super::FixedSizeResource;
use crate::resource::snapshot::{free_blocks, tile, Block, BlockState, ChunkKind, Snapshot};
use crate::resource::MemoryResource;
use crate::sync::Ordering;

impl<U: MemoryResource> FixedSizeResource<U> {
    /// Every chunk and its blocks, as [`PoolResource::snapshot`] gives them (free blocks with
    /// the stream whose list holds them; in use between them, one block each, since every
    /// block has the same size), with the same cost: one lock at a time.
    ///
    /// [`PoolResource::snapshot`]: crate::resource::pool::PoolResource::snapshot
    pub fn snapshot(&self) -> Snapshot {
        let mut snapshot = Snapshot::new(format!("fixed_size({})", self.block));
        // Both under the chunk list's lock, under which a growth adds to both: read apart, a
        // growth in between showed chunks summing to more than `reserved`.
        let chunks: Vec<(u64, u64)> = {
            let chunks = self.chunks.lock();
            snapshot.reserved = self.reserved.load(Ordering::Relaxed);
            chunks.clone()
        };
        let free = free_blocks(self.heap.free_blocks_by_list());
        snapshot.chunks = tile(&chunks, ChunkKind::Upstream, free, &mut snapshot.notes);
        // Every block is `block` bytes: a gap between free blocks is that many blocks in use.
        let block = self.block;
        for chunk in &mut snapshot.chunks {
            let mut blocks = Vec::with_capacity(chunk.blocks.len());
            for b in chunk.blocks.drain(..) {
                if b.state == BlockState::InUse && b.size > block {
                    let mut at = b.addr;
                    while at < b.addr + b.size {
                        let size = block.min(b.addr + b.size - at);
                        blocks.push(Block::new(at, size, BlockState::InUse, None));
                        at += size;
                    }
                } else {
                    blocks.push(b);
                }
            }
            chunk.blocks = blocks;
        }
        snapshot
            .notes
            .push("in-use blocks have no stream or time (no live tracking)".into());
        snapshot
    }
}
