//! A simulated stream: a queue of operations that one worker thread executes in order.
//!
//! Like a GPU stream, the host only enqueues; the worker runs each operation when it reaches
//! it, completes markers (recorded events) as it passes them, and blocks on a `Wait` until the
//! other stream's marker completes. The first failing operation poisons the stream: every marker
//! after it completes with that error, as a CUDA context stays broken after a fault.

use std::collections::VecDeque;
use std::time::Duration;

use super::memory::{SimMemory, SimPool};
use super::SimConfig;
use crate::error::{Error, Result};
use crate::reactor::Bell;
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
        from: Arc<SimMemory>,
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

/// A recorded event of the simulated device.
pub(crate) struct SimMarker {
    result: Mutex<Option<Result<()>>>,
    reached: Condvar,
    bell: Arc<Bell>,
}

impl SimMarker {
    pub(crate) fn new(bell: Arc<Bell>) -> Self {
        Self {
            result: Mutex::new(None),
            reached: Condvar::new(),
            bell,
        }
    }

    /// The stream reached the marker: record the result, release blocked waiters and tell the
    /// reactor.
    pub(crate) fn complete(&self, result: Result<()>) {
        *self.result.lock() = Some(result);
        self.reached.notify_all();
        self.bell.ring();
    }

    pub(crate) fn try_result(&self) -> Option<Result<()>> {
        self.result.lock().clone()
    }

    /// Blocks the calling thread until the stream reaches the marker.
    pub(crate) fn wait(&self) -> Result<()> {
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
}

pub(crate) struct SimStream {
    queue: Mutex<Queue>,
    ready: Condvar,
}

impl SimStream {
    /// Makes a stream and starts its worker.
    pub(crate) fn start(id: u64, memory: Arc<SimMemory>, config: &SimConfig) -> Result<Arc<Self>> {
        let stream = Arc::new(Self {
            queue: Mutex::new(Queue::default()),
            ready: Condvar::new(),
        });
        let worker = Worker {
            stream: stream.clone(),
            memory,
            delay: config.op_delay,
            jitter: config.op_jitter,
            rng: config.seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
            error: None,
        };
        thread::Builder::new()
            .name(format!("sa-sim-{id}"))
            .spawn(move || worker.run())
            .map_err(|_| Error::InvalidArgument {
                what: "the OS could not start a simulated stream's worker thread",
            })?;
        Ok(stream)
    }

    pub(crate) fn push(&self, op: Op) {
        self.queue.lock().ops.push_back(op);
        self.ready.notify_one();
    }

    /// The stream's handle is gone: the worker finishes what is queued, then exits.
    pub(crate) fn close(&self) {
        self.queue.lock().closed = true;
        self.ready.notify_one();
    }
}

struct Worker {
    stream: Arc<SimStream>,
    memory: Arc<SimMemory>,
    delay: Duration,
    jitter: Duration,
    rng: u64,
    /// The first error this stream hit; it poisons every later marker.
    error: Option<Error>,
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
            self.pause();
            self.execute(op);
        }
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
                marker.complete(self.error.clone().map_or(Ok(()), Err));
                return;
            }
            Op::Wait(marker) => {
                // A failure on the other stream does not poison this one: CUDA reports it
                // through the event, and so do we.
                let _ = marker.wait();
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
