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
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        self.streams[i % self.streams.len()].clone()
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
