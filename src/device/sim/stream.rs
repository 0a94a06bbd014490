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

use super::detector::Detector;
use super::memory::SimMemory;
use super::op::Op;
use super::{SimConfig, SimExecution};
use crate::device::StreamId;
use crate::error::{Error, Result};
use crate::sync::plain::Arc as PlainArc;
use crate::sync::{thread, Arc, Condvar, Mutex};

#[derive(Default)]
struct Queue {
    ops: VecDeque<Op>,
    /// The worker is running an operation it took off `ops` (so an empty queue is not yet an
    /// idle stream).
    running: bool,
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
        let spawned = match refuse_worker() {
            Some(refused) => Err(refused),
            None => thread::Builder::new()
                .name(format!("sa-sim-{id}"))
                .spawn(move || worker.run())
                .map(drop),
        };
        if let Err(e) = spawned {
            tracing::error!(error = %e, stream = id, "the OS could not start a simulated stream's worker thread");
            // The stream is never handed out, so nothing will close it: its clock in the race
            // detector (a word for every stream made before it) would stay for the device's
            // life.
            stream.close();
            return Err(Error::io(
                "starting a simulated stream's worker thread (sa-sim-N)",
                &e,
            ));
        }
        Ok(stream)
    }

    /// Queues `op`. With the race detector on, the operation is checked first (under the
    /// queue's lock, so the detector sees this stream's operations in queue order); in the
    /// `Error` mode a racing memory operation is not queued and its race is returned, in the
    /// `Panic` mode this thread panics once the lock is released. A `memset_d32` to an address
    /// that is not 4-aligned is refused first, as the driver refuses it.
    pub(crate) fn push(&self, op: Op) -> Result<()> {
        // The driver checks a memset's alignment when it is called, and queues nothing.
        if let (Op::Memset32 { .. }, Some((dst, _))) = (&op, op.misaligned()) {
            return Err(Error::Driver {
                call: "cuMemsetD32Async",
                code: 1,
                name: format!(
                    "CUDA_ERROR_INVALID_VALUE (the simulated device: the destination {dst:#x} \
                     is not 4-aligned)"
                ),
            });
        }
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
        // Refused: not queued and not noted as a use (in the `Panic` mode too, which then
        // panics: see `panics_now`).
        let reject = (races.rejects() || races.panics_now()) && footprint.is_some();
        let mut queue = self.queue.lock();
        // A peer copy also reads the other device's memory: checked there first (see the
        // detector's module docs), so that a refused copy leaves no use here.
        let peer = match &op {
            Op::CopyPeer {
                from, src, bytes, ..
            } => super::detector::of_memory(from).and_then(|source| {
                let (clock, at) = races.knowledge_of(idx, &source, "copy_peer");
                let race = source.foreign_read(*src, *bytes, &clock, at)?;
                races.note_race(race)
            }),
            _ => None,
        };
        let race = match (&op, footprint) {
            (_, Some(_)) if peer.is_some() && reject => peer,
            (_, Some((name, ranges, n))) => races.access(idx, name, &ranges[..n], reject).or(peer),
            (Op::Record(marker), _) => {
                let _ = marker.clock.set(races.record(idx));
                None
            }
            (Op::Wait(marker), _) => {
                // An event of another simulated device with detection on carries its
                // detector's clock and what it knew of other devices: joined part by part.
                match marker.clock.get() {
                    Some(snap) => races.wait(idx, snap),
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

    /// Whether every operation queued so far has run (`cuStreamQuery`), asked by the user's
    /// code ([`Stream::is_idle`](crate::Stream::is_idle)). An idle answer is the host seeing
    /// the stream's work complete: the race detector orders everything queued after it behind
    /// that work, as it does for an event the user's code saw complete.
    pub(crate) fn idle(&self) -> bool {
        self.idle_seen_by(true)
    }

    /// As [`idle`](Self::idle), asked by the crate for its own use (a pool's probe before it
    /// reuses a block freed on the stream without an ordering): an idle answer vouches for
    /// what the crate does on it (the reuse), and orders none of the user's work, which did
    /// not look (see the detector's module docs).
    pub(crate) fn probe_idle(&self) -> bool {
        self.idle_seen_by(false)
    }

    /// Whether the stream is idle; if so, the race detector hears that the user's code
    /// (`user`) or the crate saw its work complete.
    fn idle_seen_by(&self, user: bool) -> bool {
        let queue = self.queue.lock();
        // An inline stream runs each operation as it is queued: it is always idle.
        let idle = queue.inline.is_some() || (queue.ops.is_empty() && !queue.running);
        // Not once closed: its slot in the detector may belong to a later stream by now.
        if idle && !queue.closed {
            if let Some((races, idx)) = &self.races {
                // Under the queue's lock (the detector's lock comes after it): no operation of
                // this stream can be queued in between and be taken as seen.
                races.join_stream(*idx, user);
            }
        }
        idle
    }

    /// This stream's index in the race detector's clocks, if it is on.
    pub(crate) fn races(&self) -> Option<(&PlainArc<Detector>, u32)> {
        self.races.as_ref().map(|(d, idx)| (d, *idx))
    }

    /// The stream's handle is gone: the worker finishes what is queued, then exits.
    pub(crate) fn close(&self) {
        let mut queue = self.queue.lock();
        queue.closed = true;
        if let Some((races, idx)) = &self.races {
            // Under the queue's lock, as every operation's clock: nothing is queued after.
            races.close_stream(*idx);
        }
        if queue.inline.is_some() {
            return; // nothing queued, no worker to tell
        }
        drop(queue);
        self.ready.notify_one();
    }
}

#[cfg(all(test, not(streamalloc_loom)))]
thread_local! {
    /// Set by a test: the next worker this thread starts is refused, as by an OS out of
    /// threads.
    static REFUSE_WORKER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The refusal a test asked for ([`REFUSE_WORKER`]), once.
#[cfg(all(test, not(streamalloc_loom)))]
fn refuse_worker() -> Option<std::io::Error> {
    REFUSE_WORKER
        .with(|refuse| refuse.replace(false))
        .then(|| std::io::Error::new(std::io::ErrorKind::WouldBlock, "refused by a test"))
}

/// The OS alone refuses a worker outside tests.
#[cfg(not(all(test, not(streamalloc_loom))))]
#[inline]
fn refuse_worker() -> Option<std::io::Error> {
    None
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
                // The last operation taken has run.
                queue.running = false;
                loop {
                    if let Some(op) = queue.ops.pop_front() {
                        // A record does no work: the stream is idle while it completes its
                        // marker, so that a host that saw the marker complete (a synchronize)
                        // finds the stream idle at once.
                        queue.running = !matches!(op, Op::Record(_));
                        break op;
                    }
                    if queue.closed {
                        return;
                    }
                    queue = self.stream.ready.wait(queue);
                }
            };
            // A panic in an operation (a bug of the simulator's) must not end the worker: the
            // markers queued behind it would never complete, and every wait on the stream
            // would hang. Logged; the stream goes on.
            let exec = &mut self.exec;
            if let Err(payload) = crate::completion::catch_unwind(|| exec.run(op)) {
                tracing::error!(
                    panic = crate::completion::panic_message(&*payload),
                    "a simulated stream's operation panicked; the stream goes on"
                );
            }
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
            // Saturating: a delay and jitter near `Duration::MAX` (absurd, but a user's
            // setting) would otherwise panic here and lose the operation (a review's note).
            pause = pause.saturating_add(
                (self.jitter).mul_f64((self.rng >> 11) as f64 / (1u64 << 53) as f64),
            );
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
            Op::Free(ptr) => self.memory.end_free(ptr),
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

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use super::*;
    use crate::device::sim::detector::Detector;
    use crate::device::sim::RaceDetection;

    /// A stream whose worker the OS refused is closed in the race detector: its clock used to
    /// stay there for the device's life, as if the stream were still open.
    #[test]
    fn a_refused_worker_leaves_no_open_stream_in_the_detector() {
        let detector = PlainArc::new(Detector::new(RaceDetection::Record));
        let memory = PlainArc::new(SimMemory::new(1 << 20));
        let config = SimConfig::default();
        REFUSE_WORKER.with(|refuse| refuse.set(true));
        let refused = SimStream::start(StreamId::next(), memory.clone(), &config, Some(&detector));
        assert!(
            matches!(refused, Err(Error::Io { .. })),
            "the refusal is not an Error::Io"
        );
        assert_eq!(
            detector.open_streams(),
            0,
            "the refused stream is still open"
        );
        let started =
            SimStream::start(StreamId::next(), memory, &config, Some(&detector)).expect("a stream");
        assert_eq!(detector.open_streams(), 1);
        started.close();
        assert_eq!(detector.open_streams(), 0);
    }
}
