//! [`ArenaResource::snapshot`]: the arena's chunks and blocks (see
//! [`resource::snapshot`](crate::resource::snapshot)).

use super::ArenaResource;
use crate::resource::snapshot::{tile, Block, BlockState, ChunkKind, Snapshot};
use crate::resource::MemoryResource;
use crate::sync::Ordering;

impl<U: MemoryResource> ArenaResource<U> {
    /// Every chunk the arena holds and the blocks that tile it:
    ///
    /// - the global arena's free regions: [`Free`](BlockState::Free), with the stream that
    ///   last gave the memory back when one stream guards it (`None`: no guard, or several);
    /// - large blocks: [`InUse`](BlockState::InUse), their whole extent (with its slack), no
    ///   stream (the arena does not record it);
    /// - inside each superblock lent to a stream arena: its free blocks
    ///   ([`Free`](BlockState::Free), that stream's), the blocks freed on other streams and
    ///   not adopted yet ([`WaitingForStream`](BlockState::WaitingForStream), with the stream
    ///   that freed them), and between them the blocks handed out (in use, with the owning
    ///   stream; adjacent allocations show as one block).
    ///
    /// Locks: the global arena's, held while each stream arena's is taken in turn (as `stats`
    /// does): a superblock cannot move between two stream arenas meanwhile, nor be taken from
    /// the global arena and show both free there and in its stream arena (it did, before a
    /// review). One on its way between the global arena and a stream arena is in neither for
    /// a moment: `tile` shows it in use, with no stream.
    pub fn snapshot(&self) -> Snapshot {
        let mut snapshot = Snapshot::new("arena");
        snapshot.reserved = self.reserved.load(Ordering::Relaxed);
        let mut known: Vec<Block> = Vec::new();
        let global = self.global.lock();
        let chunks: Vec<(u64, u64)> = {
            for (&addr, region) in &global.regions {
                let stream = match region.guards.0.as_slice() {
                    [one] => Some(one.stream.get()),
                    _ => None,
                };
                known.push(Block::new(addr, region.size, BlockState::Free, stream));
            }
            for (&addr, large) in &global.large {
                let mut block = Block::new(addr, large.extent, BlockState::InUse, None);
                block.requested = Some(large.size);
                known.push(block);
            }
            // Leaked memory (its guard withholds its callbacks) is held for good: in use.
            for (&addr, &size) in &global.leaked {
                known.push(Block::new(addr, size, BlockState::InUse, None));
            }
            if !global.leaked.is_empty() {
                snapshot.notes.push(
                    "leaked regions (nothing says the GPU is done with them) show as in use".into(),
                );
            }
            global.chunks.iter().map(|(&b, &s)| (b, s)).collect()
        };
        for arena in self.arenas() {
            let owner = Some(arena.stream.id().get());
            let state = arena.state.lock();
            let mut inside: Vec<Block> = state
                .free
                .blocks()
                .map(|(addr, size)| Block::new(addr, size, BlockState::Free, owner))
                .chain(state.remote.iter().map(|r| {
                    Block::new(
                        r.addr,
                        r.size,
                        BlockState::WaitingForStream,
                        Some(r.stream.id().get()),
                    )
                }))
                .collect();
            let superblocks: Vec<(u64, u64)> = state
                .superblocks
                .iter()
                .map(|(&b, sb)| (b, sb.size))
                .collect();
            drop(state);
            inside.sort_unstable_by_key(|b| b.addr);
            // The gaps inside each superblock are its blocks in use, all of its stream arena.
            let mut next = 0;
            for (base, size) in superblocks {
                let mut at = base;
                while next < inside.len() && inside[next].addr < base + size {
                    let block = inside[next].clone();
                    next += 1;
                    if block.addr < at {
                        continue;
                    }
                    if block.addr > at {
                        known.push(Block::new(at, block.addr - at, BlockState::InUse, owner));
                    }
                    at = block.addr + block.size;
                    known.push(block);
                }
                if at < base + size {
                    known.push(Block::new(at, base + size - at, BlockState::InUse, owner));
                }
            }
        }
        drop(global);
        known.sort_unstable_by_key(|b| b.addr);
        let before = known.len();
        known.dedup_by_key(|b| b.addr);
        if known.len() != before {
            snapshot.notes.push(
                "a superblock moved between streams while the snapshot was taken: shown once"
                    .into(),
            );
        }
        snapshot.chunks = tile(&chunks, ChunkKind::Upstream, known, &mut snapshot.notes);
        snapshot.notes.push(
            "in-use blocks in a superblock are the gaps between its free blocks: adjacent allocations show as one block; large blocks have no stream (no live tracking)".into(),
        );
        snapshot
    }
}
