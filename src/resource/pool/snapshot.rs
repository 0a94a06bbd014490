//! [`PoolResource::snapshot`]: the pool's chunks and blocks (see
//! [`resource::snapshot`](crate::resource::snapshot)).

use super::PoolResource;
use crate::resource::snapshot::{free_blocks, tile, ChunkKind, Snapshot};
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
    /// free list under that list's lock, one at a time: about 60 µs for a list of 10,000
    /// blocks (a 2-core host, release build; the test `lock_hold_on_10000_free_blocks` and
    /// `benches/snapshot.rs` measure it), and the rest of the work (about 0.2 ms there:
    /// sorting and tiling) outside every lock. It is not
    /// atomic: an allocation or free between two of those reads shows in some and not
    /// others, and a chunk being given back upstream shows as in use.
    pub fn snapshot(&self) -> Snapshot {
        let mut snapshot = Snapshot::new("pool");
        snapshot.reserved = self.reserved.load(Ordering::Relaxed);
        let chunks: Vec<(u64, u64)> = self.chunks.lock().iter().map(|(&b, &s)| (b, s)).collect();
        let free = free_blocks(self.heap.free_blocks_by_list());
        snapshot.chunks = tile(&chunks, ChunkKind::Upstream, free, &mut snapshot.notes);
        snapshot.notes.push(
            "in-use blocks are the gaps between free blocks: adjacent allocations show as one block, with no stream or time (no live tracking)".into(),
        );
        snapshot
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use crate::resource::cuda::CudaResource;
    use crate::resource::pool::{PoolOptions, PoolResource};
    use crate::{Device, MemoryResource, SimConfig};

    /// How long `snapshot` holds a free list's lock, on a pool with 10,000 free blocks in one
    /// stream's list (the longest any one lock is held): the time of the copy of every list,
    /// which for one stream is that list's copy (plus the empty fresh list and the registry's
    /// one entry). Prints; asserts nothing (`cargo test --release --lib lock_hold -- --nocapture`).
    #[test]
    fn lock_hold_on_10000_free_blocks() {
        let device = Device::simulated(SimConfig::default());
        let pool = PoolResource::new(
            CudaResource::new(&device),
            PoolOptions {
                initial: 20_000 * 512,
                ..PoolOptions::default()
            },
        )
        .unwrap();
        let stream = device.create_stream().unwrap();
        let ptrs: Vec<_> = (0..20_000)
            .map(|_| pool.allocate(512, &stream).unwrap())
            .collect();
        for p in ptrs.iter().step_by(2) {
            // SAFETY: allocated above, unused, freed once.
            unsafe { pool.deallocate(*p, 512, &stream).unwrap() };
        }
        let mut copy: Vec<Duration> = (0..50)
            .map(|_| {
                let t = Instant::now();
                let lists = pool.heap.free_blocks_by_list();
                let d = t.elapsed();
                assert_eq!(lists.iter().map(|l| l.1.len()).sum::<usize>(), 10_000);
                d
            })
            .collect();
        let mut whole: Vec<Duration> = (0..50)
            .map(|_| {
                let t = Instant::now();
                std::hint::black_box(pool.snapshot());
                t.elapsed()
            })
            .collect();
        copy.sort_unstable();
        whole.sort_unstable();
        println!(
            "10,000 free blocks in one list: the locked copy takes median {:.1?} (min {:.1?}, max {:.1?}); the whole snapshot() median {:.1?}",
            copy[25], copy[0], copy[49], whole[25]
        );
        for p in ptrs.iter().skip(1).step_by(2) {
            // SAFETY: as above.
            unsafe { pool.deallocate(*p, 512, &stream).unwrap() };
        }
    }
}
