//! One soak task: allocate, fill, hand between streams, check on the GPU, free; again and again
//! until the deadline.
//!
//! Stream order, as the task keeps it (the simulated device's race detector checks it):
//! - a buffer's last write is always on its own stream (`Held::own`): the fill after the
//!   allocation, or the rewrite after a move;
//! - a read (a check) on another stream is ordered after that write: the other stream waits on
//!   an event of the own one (GPU-side), or the host awaited such an event before queueing the
//!   read; the buffer records the stream (`record_stream`), so that its free waits for the read;
//! - a rewrite on a stream first makes that stream wait for every stream that used the buffer
//!   (its own and every reader), then moves the buffer there (`set_stream`);
//! - each stream adds its mismatch counts to a counter of its own, used on no other stream.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use streamalloc::resource::adaptor::StatisticsAdaptor;
use streamalloc::{DeviceBuffer, Error, Stream};

use crate::gate::{Checked, Gate};
use crate::tally::Tally;
use crate::BoxError;

/// What every task shares.
pub struct Shared<R: Checked> {
    /// What the tasks allocate from: statistics over the gate over the pool.
    pub front: Arc<StatisticsAdaptor<Arc<Gate<R>>>>,
    pub gate: Arc<Gate<R>>,
    /// The streams of the `StreamPool`, by index.
    pub streams: Vec<Stream>,
    /// One `u64` mismatch counter per stream, allocated on it and used only on it.
    pub counters: Vec<DeviceBuffer>,
    pub tally: Tally,
    /// When the tasks stop starting new work.
    pub end: tokio::time::Instant,
    pub seed: u64,
    /// Buffers filled so far: each fill's seed is derived from it, so every fill is unique.
    pub fills: AtomicU64,
    pub min_size: usize,
    pub max_size: usize,
    /// The most buffers a task keeps alive between its steps.
    pub hold: usize,
}

impl<R: Checked> Shared<R> {
    /// A seed no other fill of this run uses.
    fn fresh_seed(&self) -> u64 {
        let n = self
            .fills
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        SplitMix64(self.seed ^ n.wrapping_mul(0xA076_1D64_78BD_642F)).next()
    }

    /// The mismatches counted so far on every stream: each stream's counter, read after the
    /// checks queued on it so far.
    pub async fn mismatches(&self) -> Result<u64, BoxError> {
        let mut sum = 0;
        for counter in &self.counters {
            let bytes = counter.to_host().await?;
            Tally::add(&self.tally.host_waits, 1);
            sum += u64::from_le_bytes(bytes.as_slice().try_into()?);
        }
        Ok(sum)
    }
}

/// splitmix64.
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Log-uniform in `min..=max`, a multiple of 4 (the kernels work in 32-bit words): as many
    /// sizes between 256 B and 512 B as between 32 MiB and 64 MiB.
    fn size(&mut self, min: usize, max: usize) -> usize {
        let (lo, hi) = ((min as f64).ln(), (max as f64).ln());
        let x = (lo + self.unit() * (hi - lo)).exp() as usize;
        (x.clamp(min, max) & !3).max(4)
    }
}

/// A buffer a task holds, and what the task knows of its uses.
struct Held {
    buf: DeviceBuffer,
    /// The index of the buffer's stream, where its last write was queued.
    own: usize,
    /// Other streams that read it since that write.
    readers: Vec<usize>,
    /// The pattern it holds.
    seed: u64,
}

impl Held {
    fn words(&self) -> usize {
        self.buf.len() / 4
    }
}

/// How an allocation ended.
enum Got {
    Buffer(DeviceBuffer),
    /// Dropped while it waited.
    Cancelled,
    /// Ran past its deadline.
    Missed,
}

/// One task: runs until `shared.end`, then checks and drops what it holds.
pub async fn run<R: Checked>(shared: Arc<Shared<R>>, id: u64) -> Result<(), BoxError> {
    let mut rng = SplitMix64(shared.seed ^ (id + 1).wrapping_mul(0xE703_7ED1_A0B4_28DB));
    let n = shared.streams.len();
    let mut held: Vec<Held> = Vec::new();
    let result = async {
        while tokio::time::Instant::now() < shared.end {
            step(&shared, &mut rng, &mut held, n).await?;
        }
        Ok::<(), BoxError>(())
    }
    .await;
    // Whatever happened, what the task holds is checked and freed.
    for h in held.drain(..) {
        let own = h.own;
        retire(&shared, h, own)?;
    }
    result
}

async fn step<R: Checked>(
    shared: &Shared<R>,
    rng: &mut SplitMix64,
    held: &mut Vec<Held>,
    n: usize,
) -> Result<(), BoxError> {
    let t = &shared.tally;
    let size = rng.size(shared.min_size, shared.max_size);
    let a = rng.below(n);
    let buf = match allocate(shared, rng, size, a, !held.is_empty()).await? {
        Got::Buffer(buf) => buf,
        Got::Cancelled | Got::Missed => {
            // No memory in time: give some back (the oldest buffer, checked first).
            if !held.is_empty() {
                let h = held.remove(0);
                let own = h.own;
                retire(shared, h, own)?;
            }
            return Ok(());
        }
    };
    Tally::add(&t.allocations, 1);
    Tally::add(&t.bytes, size as u64);
    let mut h = Held {
        buf,
        own: a,
        readers: Vec::new(),
        seed: shared.fresh_seed(),
    };
    fill(shared, &h)?;
    if rng.below(4) == 0 {
        check_on(shared, &mut h, a)?;
    }

    // Hand it to another stream.
    if n > 1 {
        let b = (a + 1 + rng.below(n - 1)) % n;
        match rng.below(8) {
            0..=2 => {
                check_on(shared, &mut h, b)?;
                Tally::add(&t.handoffs_event, 1);
            }
            3 | 4 => {
                rewrite_on(shared, &mut h, b)?;
                Tally::add(&t.handoffs_moved, 1);
                let c = rng.below(n);
                check_on(shared, &mut h, c)?;
            }
            5 => {
                // The host awaits the fill; the read on `b` is then ordered after it without
                // a GPU-side wait.
                shared.streams[h.own].record()?.await?;
                Tally::add(&t.host_waits, 1);
                h.buf.record_stream(&shared.streams[b])?;
                if !h.readers.contains(&b) {
                    h.readers.push(b);
                }
                launch_check(shared, &h, b)?;
                Tally::add(&t.handoffs_host, 1);
            }
            _ => {}
        }
    }

    // Read an older buffer again, on any stream: the memory around it has changed hands since.
    if !held.is_empty() && rng.below(2) == 0 {
        let j = rng.below(held.len());
        let c = rng.below(n);
        check_on(shared, &mut held[j], c)?;
    }
    held.push(h);
    while held.len() > shared.hold {
        let j = rng.below(held.len());
        let on = if rng.below(2) == 0 {
            held[j].own
        } else {
            rng.below(n)
        };
        retire(shared, held.swap_remove(j), on)?;
    }
    if rng.below(64) == 0 {
        shared.streams[rng.below(n)].synchronize().await?;
        Tally::add(&t.host_waits, 1);
    }
    Ok(())
}

/// Allocates `size` bytes on stream `a`: awaited with no limit (only by a task that holds
/// nothing, so that tasks never wait on each other forever), with a deadline, or raced against
/// a timer and dropped if it loses.
async fn allocate<R: Checked>(
    shared: &Shared<R>,
    rng: &mut SplitMix64,
    size: usize,
    a: usize,
    holding: bool,
) -> Result<Got, BoxError> {
    let t = &shared.tally;
    let stream = &shared.streams[a];
    let how = rng.below(10);
    if !holding && how < 4 {
        Tally::add(&t.plain_awaits, 1);
        return Ok(Got::Buffer(
            DeviceBuffer::alloc(&shared.front, size, stream).await?,
        ));
    }
    if how < 7 {
        let limit = Duration::from_micros(100 + rng.below(50_000) as u64);
        return match DeviceBuffer::alloc_timeout(&shared.front, size, stream, limit).await {
            Ok(buf) => Ok(Got::Buffer(buf)),
            Err(Error::Timeout { .. }) => {
                Tally::add(&t.deadline_misses, 1);
                Ok(Got::Missed)
            }
            Err(e) => Err(e.into()),
        };
    }
    let patience = Duration::from_micros(rng.below(20_000) as u64);
    tokio::select! {
        // Polled first: a cancellation is always of an allocation that was waiting.
        biased;
        got = DeviceBuffer::alloc(&shared.front, size, stream) => Ok(Got::Buffer(got?)),
        () = tokio::time::sleep(patience) => {
            Tally::add(&t.cancellations, 1);
            Ok(Got::Cancelled)
        }
    }
}

/// Fills the buffer with its pattern, on its own stream.
fn fill<R: Checked>(shared: &Shared<R>, h: &Held) -> Result<(), BoxError> {
    // SAFETY: `h.buf` holds `4 * words` live bytes (256-aligned), freed in stream order after
    // this fill (it is queued on the buffer's own stream).
    unsafe {
        shared.streams[h.own].fill_pattern_u32(h.buf.as_ptr(), h.seed, h.words())?;
    }
    Tally::add(&shared.tally.fills, 1);
    Ok(())
}

/// Checks the buffer on stream `on`, ordered after its last write (see the module's notes).
fn check_on<R: Checked>(shared: &Shared<R>, h: &mut Held, on: usize) -> Result<(), BoxError> {
    if on != h.own {
        let stream = &shared.streams[on];
        // Recorded before anything is queued there, so the free waits for it whatever fails.
        h.buf.record_stream(stream)?;
        stream.wait(&shared.streams[h.own].record()?)?;
        Tally::add(&shared.tally.gpu_waits, 1);
        if !h.readers.contains(&on) {
            h.readers.push(on);
        }
    }
    launch_check(shared, h, on)
}

/// Queues the check kernel on stream `on`, counting into that stream's counter. The caller
/// ordered `on` after the buffer's last write.
fn launch_check<R: Checked>(shared: &Shared<R>, h: &Held, on: usize) -> Result<(), BoxError> {
    // SAFETY: the buffer's `4 * words` bytes stay live until this check has run (it is queued
    // on its own stream, or on a stream recorded with `record_stream`, which its free waits
    // for); the counter is 8 live, 256-aligned bytes of stream `on`'s own, freed after every
    // stream is synchronized at the end.
    unsafe {
        shared.streams[on].count_mismatches_u32(
            h.buf.as_ptr(),
            h.seed,
            h.words(),
            shared.counters[on].as_ptr(),
        )?;
    }
    Tally::add(&shared.tally.checks, 1);
    Tally::add(&shared.tally.bytes_checked, h.buf.len() as u64);
    Ok(())
}

/// Moves the buffer to stream `b` for good and writes a new pattern there: `b` first waits for
/// every stream that used it.
fn rewrite_on<R: Checked>(shared: &Shared<R>, h: &mut Held, b: usize) -> Result<(), BoxError> {
    let target = &shared.streams[b];
    for &s in std::iter::once(&h.own).chain(&h.readers) {
        if s != b {
            target.wait(&shared.streams[s].record()?)?;
            Tally::add(&shared.tally.gpu_waits, 1);
        }
    }
    h.buf.set_stream(target)?;
    h.own = b;
    h.readers.clear();
    h.seed = shared.fresh_seed();
    fill(shared, h)
}

/// A last check (on stream `on`), then the drop: the memory goes back in stream order, after
/// every stream that read it.
fn retire<R: Checked>(shared: &Shared<R>, mut h: Held, on: usize) -> Result<(), BoxError> {
    let checked = check_on(shared, &mut h, on);
    drop(h);
    Tally::add(&shared.tally.drops, 1);
    checked
}
