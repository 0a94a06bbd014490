//! A simulated stream: a queue of operations that one worker thread executes in order.
//!
//! Like a GPU stream, the host only enqueues; the worker runs each operation when it reaches
//! it, completes markers (recorded events) as it passes them, and blocks on a `Wait` until the
//! other stream's marker completes. The first failing operation poisons the stream: every marker
//! after it completes with that error, as a CUDA context stays broken after a fault.
//!
//! With [`SimExecution::Inline`](super::SimExecution::Inline) there is no worker: the thread
//! that queues an operation runs it at once, under the queue's lock. Nothing is ever left
//! queued: a `Wait` names a marker recorded before it, which ran when it was queued, so no
//! inline stream waits for another (only for a marker of a threaded device).

use std::collections::VecDeque;
use std::time::Duration;

use super::detector::{Clock, Detector};
use super::memory::{SimMemory, SimPool};
use super::races::MemoryAccess;
use super::{SimConfig, SimExecution};
use crate::error::{Error, Result};
use crate::reactor::Bell;
use crate::stream::StreamId;
use crate::sync::plain::{Arc as PlainArc, AtomicBool as PlainBool, OnceLock};
use crate::sync::{thread, Arc, Condvar, Mutex};

/// A host pointer an operation will read or write when the stream reaches it.
pub(crate) struct HostPtr(pub(crate) *mut u8);

// SAFETY: the caller of the unsafe enqueue method that made this promised the pointee stays
// valid, and is not touched by anyone else, until the stream has executed the operation; the
// worker thread is the only one that dereferences it.
unsafe impl Send for HostPtr {}

pub(crate) enum Op {
    Memset8 {
        dst: u64,
        value: u8,
        bytes: usize,
    },
    Memset32 {
        dst: u64,
        value: u32,
        count: usize,
    },
    HtoD {
        dst: u64,
        src: HostPtr,
        bytes: usize,
    },
    DtoH {
        dst: HostPtr,
        src: u64,
        bytes: usize,
    },
    DtoD {
        dst: u64,
        src: u64,
        bytes: usize,
    },
    /// A copy from another simulated device's memory (`cuMemcpyPeerAsync`).
    CopyPeer {
        dst: u64,
        from: PlainArc<SimMemory>,
        src: u64,
        bytes: usize,
    },
    FillU32 {
        dst: u64,
        value: u32,
        count: usize,
    },
    ScaleF32 {
        dst: u64,
        factor: f32,
        count: usize,
    },
    FillPatternU32 {
        dst: u64,
        seed: u64,
        count: usize,
    },
    /// Counts the words of `src` that differ from the pattern of `seed` into the `u64` at
    /// `counter`.
    CountMismatchesU32 {
        src: u64,
        seed: u64,
        count: usize,
        counter: u64,
    },
    Spin(Duration),
    Record(Arc<SimMarker>),
    Wait(Arc<SimMarker>),
    Free(u64),
    /// `cuMemFreeAsync` of memory from a driver pool: the pool keeps the block from here on.
    PoolFree {
        pool: Arc<SimPool>,
        ptr: u64,
    },
}

/// An operation's name and the ranges it touches (the first `usize` of the two), for the race
/// detector.
type Footprint = (&'static str, [(u64, usize, MemoryAccess); 2], usize);

impl Op {
    /// The memory the operation reads and writes, for the race detector, and its name.
    fn footprint(&self) -> Option<Footprint> {
        use MemoryAccess::{Read, Write};
        let words = |count: usize| count.saturating_mul(4);
        let one = |op, ptr, bytes, access| Some((op, [(ptr, bytes, access); 2], 1));
        match *self {
            Op::Memset8 { dst, bytes, .. } => one("memset_d8", dst, bytes, Write),
            Op::Memset32 { dst, count, .. } => one("memset_d32", dst, words(count), Write),
            Op::HtoD { dst, bytes, .. } => one("copy_htod", dst, bytes, Write),
            Op::DtoH { src, bytes, .. } => one("copy_dtoh", src, bytes, Read),
            Op::DtoD { dst, src, bytes } => {
                Some(("copy_dtod", [(src, bytes, Read), (dst, bytes, Write)], 2))
            }
            // The source is another device's memory, which this device's detector does not
            // know (each device has its own).
            Op::CopyPeer { dst, bytes, .. } => one("copy_peer", dst, bytes, Write),
            Op::FillU32 { dst, count, .. } => one("fill_u32", dst, words(count), Write),
            Op::ScaleF32 { dst, count, .. } => one("scale_f32", dst, words(count), Write),
            Op::FillPatternU32 { dst, count, .. } => {
                one("fill_pattern_u32", dst, words(count), Write)
            }
            // The counter is read, added to and written: a write, for the detector.
            Op::CountMismatchesU32 {
                src,
                count,
                counter,
                ..
            } => Some((
                "count_mismatches_u32",
                [(src, words(count), Read), (counter, 8, Write)],
                2,
            )),
            _ => None,
        }
    }
}

/// A recorded event of the simulated device.
pub(crate) struct SimMarker {
    result: Mutex<Option<Result<()>>>,
    /// An inline stream's marker: its result, set when it is queued (it runs then), before
    /// anyone else can see the marker. Plain, so asking it is no loom operation.
    settled: OnceLock<Result<()>>,
    reached: Condvar,
    /// The reactor's bell; `None` on an inline device, whose markers are reached before anyone
    /// can watch them.
    bell: Option<Arc<Bell>>,
    /// The race detector, and the recording stream's clock (set when the record is queued).
    races: Option<PlainArc<Detector>>,
    clock: OnceLock<PlainArc<Clock>>,
    /// The host has seen the marker reached (and joined its clock).
    seen: PlainBool,
}

impl SimMarker {
    pub(crate) fn new(bell: Option<Arc<Bell>>, races: Option<PlainArc<Detector>>) -> Self {
        Self {
            result: Mutex::new(None),
            settled: OnceLock::new(),
            reached: Condvar::new(),
            bell,
            races,
            clock: OnceLock::new(),
            seen: PlainBool::new(false),
        }
    }

    /// The host has seen the stream reach the marker: everything it queues from now on is
    /// ordered after what the marker's stream had done, on every stream.
    fn seen_by_host(&self) {
        if let (Some(races), Some(clock)) = (&self.races, self.clock.get()) {
            // Set only once joined: a second observer that finds it clear joins again (a join
            // is idempotent) rather than return before the first observer's join is done.
            if !self.seen.load(std::sync::atomic::Ordering::Acquire) {
                races.host_join(clock);
                self.seen.store(true, std::sync::atomic::Ordering::Release);
            }
        }
    }

    /// The stream reached the marker: record the result, release blocked waiters and tell the
    /// reactor.
    pub(crate) fn complete(&self, result: Result<()>) {
        *self.result.lock() = Some(result);
        self.reached.notify_all();
        if let Some(bell) = &self.bell {
            bell.ring();
        }
    }

    /// An inline stream reached the marker as it was queued: nobody can be waiting for it, or
    /// watching it, yet.
    fn settle(&self, result: Result<()>) {
        let _ = self.settled.set(result);
    }

    /// The result, if the stream has reached the marker.
    fn reached(&self) -> Option<Result<()>> {
        match self.settled.get() {
            Some(result) => Some(result.clone()),
            None => self.result.lock().clone(),
        }
    }

    /// What the stream reached the marker with, if it has: asked by the host (the reactor, a
    /// query), so a result also tells the race detector the host has seen it.
    pub(crate) fn try_result(&self) -> Option<Result<()>> {
        let result = self.reached();
        if result.is_some() {
            self.seen_by_host();
        }
        result
    }

    /// Blocks the calling thread until the stream reaches the marker.
    pub(crate) fn wait(&self) -> Result<()> {
        let result = self.wait_reached();
        self.seen_by_host();
        result
    }

    /// As `wait`, for another stream's worker (not the host).
    fn wait_reached(&self) -> Result<()> {
        if let Some(result) = self.settled.get() {
            return result.clone();
        }
        let mut result = self.result.lock();
        loop {
            if let Some(r) = &*result {
                return r.clone();
            }
            result = self.reached.wait(result);
        }
    }
}

#[derive(Default)]
struct Queue {
    ops: VecDeque<Op>,
    closed: bool,
    /// An inline stream's executor, which whoever queues an operation runs under this lock
    /// (`None` on a stream with a worker thread, which owns its executor).
    inline: Option<Executor>,
}

pub(crate) struct SimStream {
    queue: Mutex<Queue>,
    ready: Condvar,
    /// The device's race detector and this stream's index in its clocks.
    races: Option<(PlainArc<Detector>, u32)>,
}

impl SimStream {
    /// Makes a stream and starts its worker (an inline stream has none).
    pub(crate) fn start(
        id: StreamId,
        memory: PlainArc<SimMemory>,
        config: &SimConfig,
        races: Option<&PlainArc<Detector>>,
    ) -> Result<Arc<Self>> {
        let races = races.map(|d| (d.clone(), d.add_stream(id)));
        let id = id.get();
        let inline = config.execution == SimExecution::Inline;
        let exec = Executor {
            memory,
            delay: config.op_delay,
            jitter: config.op_jitter,
            rng: config.seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
            error: None,
            inline,
        };
        let (queue, exec) = match inline {
            true => (
                Queue {
                    inline: Some(exec),
                    ..Queue::default()
                },
                None,
            ),
            false => (Queue::default(), Some(exec)),
        };
        let stream = Arc::new(Self {
            queue: Mutex::new(queue),
            ready: Condvar::new(),
            races,
        });
        let Some(exec) = exec else {
            return Ok(stream);
        };
        let worker = Worker {
            stream: stream.clone(),
            exec,
        };
        thread::Builder::new()
            .name(format!("sa-sim-{id}"))
            .spawn(move || worker.run())
            .map_err(|_| Error::InvalidArgument {
                what: "the OS could not start a simulated stream's worker thread",
            })?;
        Ok(stream)
    }

    /// Queues `op`. With the race detector on, the operation is checked first (under the
    /// queue's lock, so the detector sees this stream's operations in queue order); in the
    /// `Error` mode a racing memory operation is not queued and its race is returned, in the
    /// `Panic` mode this thread panics once the lock is released.
    pub(crate) fn push(&self, op: Op) -> Result<()> {
        let Some((races, idx)) = &self.races else {
            let mut queue = self.queue.lock();
            if let Some(exec) = &mut queue.inline {
                exec.run(op);
                return Ok(());
            }
            queue.ops.push_back(op);
            drop(queue);
            self.ready.notify_one();
            return Ok(());
        };
        let idx = *idx;
        let footprint = op.footprint();
        let reject = races.rejects() && footprint.is_some();
        let mut queue = self.queue.lock();
        let race = match (&op, footprint) {
            (_, Some((name, ranges, n))) => races.access(idx, name, &ranges[..n], reject),
            (Op::Record(marker), _) => {
                let _ = marker.clock.set(races.record(idx));
                None
            }
            (Op::Wait(marker), _) => {
                // An event of another simulated device carries another detector's clock (other
                // streams, other indices): its order is not this device's to know.
                let same = marker
                    .races
                    .as_ref()
                    .is_some_and(|d| PlainArc::ptr_eq(d, races));
                match marker.clock.get().filter(|_| same) {
                    Some(clock) => races.wait(idx, clock),
                    None => races.plain_op(idx),
                }
                None
            }
            (Op::Free(ptr), _) => races.free(Some(idx), *ptr, None, true, false),
            (Op::PoolFree { ptr, .. }, _) => races.free(Some(idx), *ptr, None, true, true),
            _ => {
                races.plain_op(idx);
                None
            }
        };
        let queued = race.is_none() || !reject;
        let notify = match (&mut queue.inline, queued) {
            (_, false) => false,
            (Some(exec), true) => {
                exec.run(op);
                false
            }
            (None, true) => {
                queue.ops.push_back(op);
                true
            }
        };
        drop(queue);
        if notify {
            self.ready.notify_one();
        }
        races.settle(race, reject)
    }

    /// This stream's index in the race detector's clocks, if it is on.
    pub(crate) fn races(&self) -> Option<(&PlainArc<Detector>, u32)> {
        self.races.as_ref().map(|(d, idx)| (d, *idx))
    }

    /// The stream's handle is gone: the worker finishes what is queued, then exits.
    pub(crate) fn close(&self) {
        let mut queue = self.queue.lock();
        queue.closed = true;
        if queue.inline.is_some() {
            return; // nothing queued, no worker to tell
        }
        drop(queue);
        self.ready.notify_one();
    }
}

/// A stream's worker thread.
struct Worker {
    stream: Arc<SimStream>,
    exec: Executor,
}

/// What runs a stream's operations, in order: its worker thread, or (inline) whoever queues.
struct Executor {
    memory: PlainArc<SimMemory>,
    delay: Duration,
    jitter: Duration,
    rng: u64,
    /// The first error this stream hit; it poisons every later marker.
    error: Option<Error>,
    /// Run by whoever queues (`SimExecution::Inline`).
    inline: bool,
}

impl Worker {
    fn run(mut self) {
        loop {
            let op = {
                let mut queue = self.stream.queue.lock();
                loop {
                    if let Some(op) = queue.ops.pop_front() {
                        break op;
                    }
                    if queue.closed {
                        return;
                    }
                    queue = self.stream.ready.wait(queue);
                }
            };
            self.exec.run(op);
        }
    }
}

impl Executor {
    /// Runs one operation, after the configured delay.
    fn run(&mut self, op: Op) {
        self.pause();
        self.execute(op);
    }

    /// The configured delay before each operation, to widen race windows in tests.
    fn pause(&mut self) {
        let mut pause = self.delay;
        if !self.jitter.is_zero() {
            // xorshift64: cheap, deterministic per stream and seed.
            self.rng ^= self.rng << 13;
            self.rng ^= self.rng >> 7;
            self.rng ^= self.rng << 17;
            pause += self
                .jitter
                .mul_f64((self.rng >> 11) as f64 / (1u64 << 53) as f64);
        }
        if !pause.is_zero() {
            std::thread::sleep(pause);
        }
    }

    fn execute(&mut self, op: Op) {
        let result = match op {
            Op::Record(marker) => {
                let result = self.error.clone().map_or(Ok(()), Err);
                match self.inline {
                    true => marker.settle(result),
                    false => marker.complete(result),
                }
                return;
            }
            Op::Wait(marker) => {
                // A failure on the other stream does not poison this one: CUDA reports it
                // through the event, and so do we.
                let _ = marker.wait_reached();
                return;
            }
            Op::Spin(d) => {
                std::thread::sleep(d);
                Ok(())
            }
            // Frees take effect even on a poisoned stream, so no memory is lost to a fault.
            Op::Free(ptr) => self.memory.free(ptr),
            Op::PoolFree { pool, ptr } => pool.free(ptr),
            _ if self.error.is_some() => return,
            op => super::kernels::run(&self.memory, op),
        };
        if let Err(e) = result {
            tracing::warn!(error = %e, "simulated stream operation failed; the stream is poisoned");
            self.error.get_or_insert(e);
        }
    }
}
