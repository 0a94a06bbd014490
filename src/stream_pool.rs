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
    /// The most streams one pool may hold. A GPU runs at most a few dozen streams' work at
    /// once (`CUDA_DEVICE_MAX_CONNECTIONS` is at most 32 hardware queues), so a pool past a
    /// thousand buys no concurrency, while each stream costs a driver object on CUDA and a
    /// worker thread on the simulated device. A larger count is a mistake (a size in bytes
    /// passed as a count, say) that would otherwise create streams until the OS or the driver
    /// refused one.
    pub const MAX_STREAMS: usize = 1024;

    /// Creates `count` streams on `device`. `Err(InvalidSize)` (with the count) for zero and
    /// for more than [`MAX_STREAMS`](Self::MAX_STREAMS); no stream is created then.
    pub fn new(device: &Device, count: usize) -> Result<StreamPool> {
        if count == 0 {
            return Err(Error::InvalidSize {
                size: 0,
                reason: "a stream pool needs at least one stream",
            });
        }
        // Checked before any stream is made: a count of millions (or `usize::MAX`) created
        // streams (worker threads on the simulated device) until one failed.
        if count > Self::MAX_STREAMS {
            return Err(Error::InvalidSize {
                size: count,
                reason: "a stream pool holds at most StreamPool::MAX_STREAMS (1024) streams",
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

    /// A count past `MAX_STREAMS` is refused with the count, before any stream is made (every
    /// stream was created, one simulated worker thread each, and `usize::MAX` went on until the
    /// OS refused a thread); `MAX_STREAMS` itself is taken.
    #[test]
    fn counts_past_the_bound_are_refused_before_any_stream_is_made() {
        // Inline: streams without worker threads, so the bound itself is cheap to take.
        let device = crate::Device::simulated(SimConfig {
            execution: crate::SimExecution::Inline,
            ..SimConfig::default()
        });
        for count in [StreamPool::MAX_STREAMS + 1, usize::MAX] {
            let before = device.inner.streams_created.load(Ordering::Relaxed);
            match StreamPool::new(&device, count) {
                Err(Error::InvalidSize { size, .. }) => assert_eq!(size, count),
                other => panic!("a pool of {count} streams: {other:?}"),
            }
            let made = device.inner.streams_created.load(Ordering::Relaxed) - before;
            assert_eq!(made, 0, "{made} streams made for a refused count");
        }
        let pool = StreamPool::new(&device, StreamPool::MAX_STREAMS).unwrap();
        assert_eq!(pool.len(), StreamPool::MAX_STREAMS);
    }
}
