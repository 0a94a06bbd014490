//! `StreamPool`: a fixed set of streams handed out round-robin, as RMM's `cuda_stream_pool`.

use std::fmt;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::stream::Stream;
use crate::sync::{Arc, AtomicUsize, Ordering};

/// A fixed set of streams of one device, created up front and handed out round-robin
/// ([`get`](Self::get)) or by index ([`get_by_index`](Self::get_by_index)). Lets many tasks
/// spread their work over a bounded number of streams without creating one per task. Cheap to
/// clone: clones share the streams and the round-robin position.
#[derive(Clone)]
pub struct StreamPool {
    streams: Arc<Vec<Stream>>,
    next: Arc<AtomicUsize>,
}

impl fmt::Debug for StreamPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamPool")
            .field("streams", &self.streams.len())
            .finish()
    }
}

impl StreamPool {
    /// Creates `count` streams on `device`. `Err(InvalidSize)` for zero.
    pub fn new(device: &Device, count: usize) -> Result<StreamPool> {
        if count == 0 {
            return Err(Error::InvalidSize {
                size: 0,
                reason: "a stream pool needs at least one stream",
            });
        }
        let streams = (0..count)
            .map(|_| device.create_stream())
            .collect::<Result<Vec<_>>>()?;
        Ok(StreamPool {
            streams: Arc::new(streams),
            next: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// The next stream, round-robin. Safe to call from many threads at once.
    pub fn get(&self) -> Stream {
        // The position is kept below `len()` rather than counted up and reduced: a counter
        // that wraps at `usize::MAX` restarts at index 0 out of turn unless `len()` divides
        // 2^BITS (three streams: the same one twice in a row, another skipped).
        let len = self.streams.len();
        let step = |i: usize| Some(if i >= len - 1 { 0 } else { i + 1 });
        let i = match self
            .next
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, step)
        {
            Ok(i) | Err(i) => i,
        };
        self.streams[i % len].clone()
    }

    /// The stream at `index % len()` (RMM's `get_stream(stream_id)`).
    pub fn get_by_index(&self, index: usize) -> Stream {
        self.streams[index % self.streams.len()].clone()
    }

    /// How many streams the pool holds.
    pub fn len(&self) -> usize {
        self.streams.len()
    }

    /// Always false: a pool holds at least one stream.
    pub fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }

    /// All streams of the pool, in index order.
    pub fn streams(&self) -> &[Stream] {
        &self.streams
    }
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use super::*;
    use crate::SimConfig;

    /// Round-robin goes on evenly past the counter's end: with three streams, a counter that
    /// wrapped from `usize::MAX` (index 0) to 0 (index 0 again) handed out the same stream twice
    /// in a row and skipped another (a 32-bit target gets there after 2^32 calls).
    #[test]
    fn round_robin_stays_even_when_the_counter_wraps() {
        let device = crate::Device::simulated(SimConfig::default());
        let pool = StreamPool::new(&device, 3).unwrap();
        pool.next.store(usize::MAX - 1, Ordering::Relaxed);
        let ids: Vec<_> = (0..6).map(|_| pool.get().id()).collect();
        for pair in ids.windows(2) {
            assert_ne!(pair[0], pair[1], "the same stream twice in a row: {ids:?}");
        }
        for window in ids.windows(3) {
            let mut w = window.to_vec();
            w.sort();
            w.dedup();
            assert_eq!(
                w.len(),
                3,
                "three gets did not cover the three streams: {ids:?}"
            );
        }
    }
}
