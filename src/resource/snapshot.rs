//! [`Snapshot`]: what a suballocating resource holds, block by block, at one moment.
//!
//! A snapshot lists every upstream chunk (or mapped range) a resource holds and tiles each
//! one with blocks: in use, free, or waiting for a stream, each with the stream that owns it
//! or last freed it. It is what PyTorch's `torch.cuda.memory._snapshot()` gives its users, for
//! this crate's resources: take one when memory runs out, save it as JSON (the `serde`
//! feature, on by default), and turn it into a picture with `streamalloc-picture`.
//!
//! ```
//! use streamalloc::resource::snapshot::BlockState;
//! use streamalloc::resource::cuda::CudaResource;
//! use streamalloc::resource::pool::{PoolOptions, PoolResource};
//! use streamalloc::{Device, MemoryResource, SimConfig};
//!
//! let device = Device::simulated(SimConfig::default());
//! let pool = PoolResource::new(CudaResource::new(&device), PoolOptions { initial: 1 << 20, ..Default::default() })?;
//! let stream = device.create_stream()?;
//! let ptr = pool.allocate(4096, &stream)?;
//! let snapshot = pool.snapshot();
//! assert_eq!(snapshot.reserved, 1 << 20);
//! assert_eq!(snapshot.bytes(BlockState::InUse), 4096);
//! // SAFETY: allocated above, unused, freed once.
//! unsafe { pool.deallocate(ptr, 4096, &stream)? };
//! # Ok::<(), streamalloc::Error>(())
//! ```
//!
//! # What a snapshot knows
//!
//! The resources keep their *free* memory in lists and know their chunks, but do not keep a
//! record of every live allocation (that would cost the fast path a map update). So a
//! snapshot's in-use blocks are, by default, the gaps between free blocks: one in-use block
//! may be several adjacent allocations, with no allocation time and no stream
//! ([`Snapshot::live_blocks_tracked`] is `false`). Put a
//! [`HistoryAdaptor`](super::adaptor::HistoryAdaptor) with live tracking in front of the
//! resource, and its snapshot splits those gaps into the real allocations, each with its size
//! as asked, its stream, its allocation time and, if captured, its backtrace.
//!
//! Memory a [`DeviceBuffer`](crate::DeviceBuffer) has dropped but whose free still waits for
//! other streams' work ([`record_stream`](crate::DeviceBuffer::record_stream)) has not reached
//! the resource yet: it shows as in use.

use std::time::{SystemTime, UNIX_EPOCH};

/// What a block is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
pub enum BlockState {
    /// Handed out and not given back.
    InUse,
    /// Given back and ready: usable at once by the stream in [`Block::stream`] (the stream
    /// whose free list holds it; any other stream must first wait for that one on the GPU,
    /// which the resource arranges), or by every stream if `stream` is `None` (memory no stream
    /// has used, or whose last use the host knows to be finished).
    Free,
    /// Given back on a stream ([`Block::stream`]), but not usable yet, even by the stream that
    /// holds it: the resource must first order itself after that stream (the arena's frees of
    /// another stream's blocks, before their owner adopts them).
    WaitingForStream,
}

/// What a chunk is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
pub enum ChunkKind {
    /// A chunk allocated from the upstream resource.
    Upstream,
    /// A range of reserved virtual addresses backed by mapped physical memory (a pool that
    /// grows by mapping pages into one reservation).
    Mapped,
}

/// One block of a chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Block {
    /// Its address.
    pub addr: u64,
    /// Its size in bytes, as the resource holds it (rounded up to 256 bytes, or more: a block
    /// handed out with slack).
    pub size: u64,
    /// In use, free, or waiting for a stream.
    pub state: BlockState,
    /// The stream ([`StreamId::get`](crate::StreamId::get)) that owns it: for a free block,
    /// the stream it was freed on (whose list holds it); for a block in use, the stream it
    /// was allocated on, when known. `None`: no stream (fresh memory), or not known.
    #[cfg_attr(feature = "serde", serde(default))]
    pub stream: Option<u64>,
    /// For a block in use: the bytes asked for, when known (live tracking).
    #[cfg_attr(feature = "serde", serde(default))]
    pub requested: Option<u64>,
    /// For a block in use: when it was allocated, in microseconds since the Unix epoch, when
    /// known (live tracking).
    #[cfg_attr(feature = "serde", serde(default))]
    pub allocated_at_us: Option<u64>,
    /// For a block in use: the backtrace captured at its allocation, when asked for.
    #[cfg_attr(feature = "serde", serde(default))]
    pub backtrace: Option<String>,
}

impl Block {
    /// A block with no allocation details.
    pub fn new(addr: u64, size: u64, state: BlockState, stream: Option<u64>) -> Self {
        Self {
            addr,
            size,
            state,
            stream,
            requested: None,
            allocated_at_us: None,
            backtrace: None,
        }
    }
}

/// One chunk (or mapped range) and the blocks that tile it, in address order.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Chunk {
    /// Its first address.
    pub base: u64,
    /// Its size in bytes.
    pub size: u64,
    /// Where it came from.
    pub kind: ChunkKind,
    /// Its blocks, in address order, covering it exactly.
    pub blocks: Vec<Block>,
}

/// What a resource held at one moment: chunks and their blocks. See the
/// [module documentation](self).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Snapshot {
    /// The kind of resource: `pool`, `arena`, `fixed_size`, `binning`, or one of an adaptor's
    /// (`history(pool)`).
    pub resource: String,
    /// When it was taken, in microseconds since the Unix epoch.
    pub taken_at_us: u64,
    /// Bytes held from the upstream (the sum of the chunks' sizes, plus chunks being grown or
    /// given back at that moment).
    pub reserved: u64,
    /// Every chunk, in address order.
    pub chunks: Vec<Chunk>,
    /// Resources inside this one, each with its own snapshot: a binning resource's bins and
    /// fallback. Their chunks are memory taken from this resource's upstream, so they are not
    /// in `chunks`.
    #[cfg_attr(feature = "serde", serde(default))]
    pub parts: Vec<Snapshot>,
    /// `true` when in-use blocks are the real allocations, with streams and times (a
    /// [`HistoryAdaptor`](super::adaptor::HistoryAdaptor) tracked them); `false` when they are
    /// the gaps between free blocks.
    #[cfg_attr(feature = "serde", serde(default))]
    pub live_blocks_tracked: bool,
    /// What the snapshot could not see, in words.
    #[cfg_attr(feature = "serde", serde(default))]
    pub notes: Vec<String>,
}

impl Snapshot {
    /// An empty snapshot of a `resource`, taken now.
    pub fn new(resource: impl Into<String>) -> Self {
        Self {
            resource: resource.into(),
            taken_at_us: now_us(),
            reserved: 0,
            chunks: Vec::new(),
            parts: Vec::new(),
            live_blocks_tracked: false,
            notes: Vec::new(),
        }
    }

    /// Every block of this snapshot and of its parts.
    pub fn blocks(&self) -> impl Iterator<Item = &Block> + '_ {
        let own = self.chunks.iter().flat_map(|c| c.blocks.iter());
        let parts: Box<dyn Iterator<Item = &Block> + '_> =
            Box::new(self.parts.iter().flat_map(|p| p.blocks()));
        own.chain(parts)
    }

    /// Bytes in blocks of `state`, over this snapshot and its parts (`u64::MAX` at most: a
    /// snapshot read from a file may hold any numbers).
    pub fn bytes(&self, state: BlockState) -> u64 {
        self.blocks()
            .filter(|b| b.state == state)
            .fold(0, |sum, b| sum.saturating_add(b.size))
    }

    /// How many blocks are in `state`, over this snapshot and its parts.
    pub fn count(&self, state: BlockState) -> usize {
        self.blocks().filter(|b| b.state == state).count()
    }

    /// Checks that every chunk's blocks tile it exactly, in address order, with no empty
    /// block, and that no chunk passes the end of the address space (as a resource's snapshot
    /// always does; one read from a file may hold any numbers, and nothing here overflows on
    /// them). `Err` names the first chunk or block that does not, and the part it is in.
    pub fn check(&self) -> Result<(), String> {
        for chunk in &self.chunks {
            let name = format!("the chunk at {:#x} of {} bytes", chunk.base, chunk.size);
            let end = chunk
                .base
                .checked_add(chunk.size)
                .ok_or_else(|| format!("{name} passes the end of the address space"))?;
            let mut at = chunk.base;
            for (i, block) in chunk.blocks.iter().enumerate() {
                let what = format!(
                    "{name}: its block {i} (at {:#x}, of {} bytes)",
                    block.addr, block.size
                );
                if block.addr != at {
                    return Err(format!(
                        "{what} does not start where the one before it ends ({at:#x}): blocks must tile their chunk"
                    ));
                }
                if block.size == 0 {
                    return Err(format!("{what} is empty"));
                }
                if block.size > end - at {
                    return Err(format!("{what} runs past the chunk's end ({end:#x})"));
                }
                at += block.size;
            }
            if at != end {
                return Err(format!(
                    "{name}: its blocks end at {at:#x}, short of the chunk's end ({end:#x}): blocks must tile their chunk"
                ));
            }
        }
        for (i, part) in self.parts.iter().enumerate() {
            part.check()
                .map_err(|e| format!("part {i} ({}): {e}", part.resource))?;
        }
        Ok(())
    }

    /// Splits the in-use blocks (of this snapshot and its parts) into the known allocations
    /// `live` that lie inside them (each an in-use block: its address, its size as the
    /// resource holds it, and whatever else is known: stream, size asked for, time), and marks
    /// the snapshot [`live_blocks_tracked`](Self::live_blocks_tracked). What a live-tracking
    /// adaptor does; a tool that knows the live allocations another way can do the same. What
    /// is left of an in-use block around them stays in use with nothing known about it;
    /// allocations that do not lie inside one in-use block are ignored.
    pub fn merge_live(&mut self, live: &mut [Block]) {
        live.sort_unstable_by_key(|b| b.addr);
        for chunk in &mut self.chunks {
            let mut blocks = Vec::with_capacity(chunk.blocks.len());
            for block in chunk.blocks.drain(..) {
                if block.state != BlockState::InUse {
                    blocks.push(block);
                    continue;
                }
                // (Checked: a snapshot read from a file may hold any numbers. A block that
                // runs past the end of the address space is left as it is.)
                let Some(end) = block.addr.checked_add(block.size) else {
                    blocks.push(block);
                    continue;
                };
                let first = live.partition_point(|l| l.addr < block.addr);
                let mut at = block.addr;
                for known in live[first..].iter().take_while(|l| l.addr < end) {
                    let Some(known_end) = known.addr.checked_add(known.size) else {
                        break;
                    };
                    if known_end > end {
                        break;
                    }
                    if known.addr > at {
                        blocks.push(Block::new(at, known.addr - at, BlockState::InUse, None));
                    }
                    blocks.push(known.clone());
                    at = known_end;
                }
                if at < end {
                    blocks.push(Block::new(at, end - at, BlockState::InUse, None));
                }
            }
            chunk.blocks = blocks;
        }
        for part in &mut self.parts {
            part.merge_live(live);
        }
        self.live_blocks_tracked = true;
    }
}

/// The free blocks of a free-list engine, list by list as
/// `StreamHeap::free_blocks_by_list` gives them, as snapshot blocks: each with the stream whose
/// list holds it (`None`: fresh memory). What the pool, the fixed-size resource and the
/// expandable pool hand to [`tile`].
pub(crate) fn free_blocks(by_list: Vec<super::stream_ordered::ListBlocks>) -> Vec<Block> {
    by_list
        .into_iter()
        .flat_map(|(stream, blocks)| {
            blocks
                .into_iter()
                .map(move |(addr, size)| Block::new(addr, size, BlockState::Free, stream))
        })
        .collect()
}

/// Tiles each chunk with the `free` blocks (any state and order; each inside one chunk) and, between them,
/// in-use blocks: what the resources that keep no record of live allocations know. A free
/// block that is not inside a chunk is dropped with a note (it cannot happen unless the
/// resource changed between the two reads).
pub(crate) fn tile(
    chunks: &[(u64, u64)],
    kind: ChunkKind,
    mut free: Vec<Block>,
    notes: &mut Vec<String>,
) -> Vec<Chunk> {
    free.sort_unstable_by_key(|b| b.addr);
    let mut chunks: Vec<(u64, u64)> = chunks.to_vec();
    chunks.sort_unstable();
    let mut out = Vec::with_capacity(chunks.len());
    let mut next = 0;
    let mut stray = 0usize;
    for (base, size) in chunks {
        let end = base + size;
        let mut blocks = Vec::new();
        let mut at = base;
        while next < free.len() && free[next].addr < end {
            let block = &free[next];
            next += 1;
            if block.addr < at || block.addr + block.size > end {
                stray += 1;
                continue;
            }
            if block.addr > at {
                blocks.push(Block::new(at, block.addr - at, BlockState::InUse, None));
            }
            at = block.addr + block.size;
            blocks.push(block.clone());
        }
        if at < end {
            blocks.push(Block::new(at, end - at, BlockState::InUse, None));
        }
        out.push(Chunk {
            base,
            size,
            kind,
            blocks,
        });
    }
    stray += free.len() - next;
    if stray > 0 {
        notes.push(format!(
            "{stray} free block(s) outside the chunks were left out (the resource changed while the snapshot was taken)"
        ));
    }
    out
}

/// Microseconds since the Unix epoch, now.
pub(crate) fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tile_fills_the_gaps_with_in_use_blocks() {
        let mut notes = Vec::new();
        let free = vec![
            Block::new(0x1100, 0x100, BlockState::Free, Some(3)),
            Block::new(0x1000, 0x100, BlockState::Free, None),
            Block::new(0x9000, 0x100, BlockState::Free, None),
        ];
        let chunks = tile(&[(0x1000, 0x400)], ChunkKind::Upstream, free, &mut notes);
        let blocks = &chunks[0].blocks;
        assert_eq!(blocks.len(), 3);
        assert_eq!(
            blocks[2],
            Block::new(0x1200, 0x200, BlockState::InUse, None)
        );
        assert_eq!(notes.len(), 1, "{notes:?}");
        let mut snapshot = Snapshot::new("test");
        snapshot.chunks = chunks;
        snapshot.check().unwrap();
        assert_eq!(snapshot.bytes(BlockState::InUse), 0x200);
        assert_eq!(snapshot.bytes(BlockState::Free), 0x200);
    }

    #[test]
    fn merge_live_splits_in_use_blocks() {
        let mut notes = Vec::new();
        let chunks = tile(&[(0, 0x1000)], ChunkKind::Upstream, Vec::new(), &mut notes);
        let mut snapshot = Snapshot::new("test");
        snapshot.chunks = chunks;
        let mut live = vec![
            Block::new(0x400, 0x100, BlockState::InUse, Some(7)),
            Block::new(0x100, 0x200, BlockState::InUse, Some(5)),
        ];
        snapshot.merge_live(&mut live);
        snapshot.check().unwrap();
        let streams: Vec<Option<u64>> =
            snapshot.chunks[0].blocks.iter().map(|b| b.stream).collect();
        assert_eq!(streams, vec![None, Some(5), None, Some(7), None]);
        assert!(snapshot.live_blocks_tracked);
    }

    /// A snapshot read from a file may hold any numbers: sums and ends that overflow are an
    /// `Err` from `check`, a saturated `bytes` and a block left alone by `merge_live`, never a
    /// panic (a review found the picture tool's reading of one panic here).
    #[test]
    fn numbers_that_overflow_are_no_panic() {
        let mut snapshot = Snapshot::new("from a file");
        snapshot.chunks = vec![Chunk {
            base: 0x1000,
            size: 0x200,
            kind: ChunkKind::Upstream,
            blocks: vec![
                Block::new(0x1000, 0x100, BlockState::InUse, None),
                Block::new(0x1100, u64::MAX, BlockState::InUse, None),
            ],
        }];
        let err = snapshot.check().unwrap_err();
        assert!(err.contains("runs past the chunk's end"), "{err}");
        assert_eq!(snapshot.bytes(BlockState::InUse), u64::MAX);
        let mut live = vec![
            Block::new(0x1000, u64::MAX, BlockState::InUse, Some(1)),
            Block::new(0x1100, 0x10, BlockState::InUse, Some(2)),
        ];
        snapshot.merge_live(&mut live);
        let blocks = &snapshot.chunks[0].blocks;
        assert_eq!(blocks.len(), 2, "{blocks:?}");
        assert_eq!(blocks[1].size, u64::MAX, "left as it was");
        let mut far = Snapshot::new("from a file");
        far.chunks = vec![Chunk {
            base: u64::MAX - 0xff,
            size: 0x200,
            kind: ChunkKind::Upstream,
            blocks: Vec::new(),
        }];
        let err = far.check().unwrap_err();
        assert!(err.contains("passes the end of the address space"), "{err}");
    }
}
