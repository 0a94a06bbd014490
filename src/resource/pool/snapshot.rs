//! [`PoolResource::snapshot`]: the pool's chunks and blocks (see
//! [`resource::snapshot`](crate::resource::snapshot)).

use super::PoolResource;
use crate::resource::snapshot::{tile, Block, BlockState, ChunkKind, Snapshot};
use crate::resource::MemoryResource;
use crate::sync::Ordering;

impl<U: MemoryResource> PoolResource<U> {
    /// Every chunk the pool holds and the blocks that tile it: free blocks with the stream
    /// whose list holds them (`None`: fresh memory, any stream may take it at once), and
    /// between them the memory handed out, as in-use blocks with no stream or time (the pool
    /// keeps no record of live allocations: put a
    /// [`HistoryAdaptor`](crate::resource::adaptor::HistoryAdaptor) with live tracking in
    /// front of it for those).
    ///
    /// Cheap enough for a live server: it copies the chunk table under its lock, then each
    /// free list under that list's lock, one at a time (about 0.2 ms for a list of 10,000
    /// blocks on the simulated device's host; `benches/snapshot.rs` measures it). It is not
    /// atomic: an allocation or free between two of those reads shows in some and not
    /// others, and a chunk being given back upstream shows as in use.
    pub fn snapshot(&self) -> Snapshot {
        let mut snapshot = Snapshot::new("pool");
        snapshot.reserved = self.reserved.load(Ordering::Relaxed);
        let chunks: Vec<(u64, u64)> = self.chunks.lock().iter().map(|(&b, &s)| (b, s)).collect();
        let free: Vec<Block> = self
            .lists
            .free_blocks_by_list()
            .into_iter()
            .flat_map(|(stream, blocks)| {
                blocks
                    .into_iter()
                    .map(move |(addr, size)| Block::new(addr, size, BlockState::Free, stream))
            })
            .collect();
        snapshot.chunks = tile(&chunks, ChunkKind::Upstream, free, &mut snapshot.notes);
        snapshot.notes.push(
            "in-use blocks are the gaps between free blocks: adjacent allocations show as one block, with no stream or time (no live tracking)".into(),
        );
        snapshot
    }
}
