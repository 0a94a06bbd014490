//! Model-checking your own code with loom, on the simulated device.
//!
//! Under `--cfg streamalloc_loom` streamalloc builds on loom's threads and locks (see the
//! README, "Testing your own code"), so a `loom::model` in your tests explores the
//! interleavings of your threads together with what streamalloc shares between them: the
//! pool's free lists, its queue of tasks waiting for memory, events and their wakeups. The
//! simulated device runs stream work inline there (`SimExecution::Inline`: each operation runs
//! on the thread that queues it, so the crate adds no thread of its own), and its race
//! detector, in the `Panic` mode, turns a stream-order bug that only some interleavings expose
//! into a failure that loom reports with the interleaving.
//!
//! The code under test is `model::Handoff` (built only under the cfg): a producer task allocates a
//! buffer from a pool (by `.await`), fills it on its stream and hands it, with an event recorded
//! after its writes, to a consumer task that runs a kernel on it on another stream and drops it,
//! its use on the other stream recorded (`record_stream`). The pool holds one buffer at most, so
//! the producer's next allocation waits, as a future, until the consumer's drop gives the memory
//! back.
//!
//! ```sh
//! # (the RUSTFLAGS of the README, CI and loom-tests/, so that one build in target/loom serves all)
//! # the model passes:
//! RUSTFLAGS="--cfg streamalloc_loom -C debug-assertions" CARGO_TARGET_DIR=target/loom \
//!   cargo run --release --example loom_user -- correct
//! # the buffer is published before its event: fails in the interleavings where the consumer
//! # takes it in between
//! RUSTFLAGS="--cfg streamalloc_loom -C debug-assertions" CARGO_TARGET_DIR=target/loom \
//!   cargo run --release --example loom_user -- planted
//! # the consumer drops the buffer without `record_stream`: its memory goes back to the pool
//! # while the consumer's kernel may still use it
//! RUSTFLAGS="--cfg streamalloc_loom -C debug-assertions" CARGO_TARGET_DIR=target/loom \
//!   cargo run --release --example loom_user -- planted-free
//! ```

#[cfg(streamalloc_loom)]
mod model {
    use loom::sync::{Arc, Condvar, Mutex};
    use loom::thread;

    use streamalloc::resource::cuda_async::{CudaAsyncOptions, CudaAsyncResource};
    use streamalloc::{
        Device, DeviceBuffer, Event, MemoryAccess, PoolOptions, PoolResource, RaceDetection,
        SimConfig,
    };

    const BYTES: usize = 256;

    /// A bug to plant in the user's code.
    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    pub enum Bug {
        None,
        /// The hand-off publishes the buffer before its event, in two steps.
        EventAfterBuffer,
        /// The consumer drops the buffer without `record_stream`: it is freed on the
        /// producer's stream, which is not ordered after the consumer's kernel.
        NoRecordStream,
    }

    /// The user's code under test: a one-slot hand-off of a device buffer between two tasks on
    /// two streams. The buffer's writes are ordered before the consumer's kernel by the event
    /// that travels with it.
    pub struct Handoff {
        slot: Mutex<(Option<DeviceBuffer>, Option<Event>)>,
        filled: Condvar,
        bug: Bug,
    }

    impl Handoff {
        fn send(&self, buffer: DeviceBuffer, written: Event) {
            if self.bug == Bug::EventAfterBuffer {
                // BUG: a consumer that looks in between takes the buffer without the event.
                self.slot.lock().unwrap().0 = Some(buffer);
                self.filled.notify_one();
                self.slot.lock().unwrap().1 = Some(written);
            } else {
                *self.slot.lock().unwrap() = (Some(buffer), Some(written));
                self.filled.notify_one();
            }
        }

        fn recv(&self) -> (DeviceBuffer, Option<Event>) {
            let mut slot = self.slot.lock().unwrap();
            loop {
                if let Some(buffer) = slot.0.take() {
                    return (buffer, slot.1.take());
                }
                slot = self.filled.wait(slot).unwrap();
            }
        }
    }

    /// What one execution saw, for the summary.
    pub struct Seen {
        /// The producer's second allocation waited for the consumer's free.
        pub waited: bool,
    }

    /// One execution: two tasks (the producer on its own thread, the consumer here), two
    /// streams of theirs, a pool (which makes a stream of its own) of one buffer at most.
    fn run(bug: Bug) -> Seen {
        let device = Device::simulated(SimConfig {
            race_detection: RaceDetection::Panic,
            ..SimConfig::default()
        });
        let upstream = CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap();
        let pool = std::sync::Arc::new(
            PoolResource::new(
                upstream,
                PoolOptions {
                    maximum: Some(BYTES),
                    ..PoolOptions::default()
                },
            )
            .unwrap(),
        );
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let handoff = Arc::new(Handoff {
            slot: Mutex::new((None, None)),
            filled: Condvar::new(),
            bug,
        });

        let producer = {
            let (pool, a, handoff) = (pool.clone(), a.clone(), handoff.clone());
            thread::spawn(move || {
                let mut buffer =
                    loom::future::block_on(DeviceBuffer::alloc(&pool, BYTES, &a)).unwrap();
                buffer.memset(1).unwrap();
                handoff.send(buffer, a.record().unwrap());
                // The pool is full until the consumer drops the first buffer: this waits (as
                // a future: loom runs the consumer meanwhile) unless the drop came first.
                let mut next =
                    loom::future::block_on(DeviceBuffer::alloc(&pool, BYTES, &a)).unwrap();
                next.memset(2).unwrap();
            })
        };

        // The consumer.
        let (mut buffer, written) = handoff.recv();
        if let Some(written) = written {
            b.wait(&written).unwrap();
        }
        // Our kernel reads the buffer on `b` (declared, so the detector checks it); a
        // built-in kernel then scales it in place there.
        b.declare_access(
            buffer.as_ptr(),
            BYTES,
            MemoryAccess::Read,
            "consumer_kernel",
        )
        .unwrap();
        // SAFETY: 64 live words; the buffer's free waits for `b` (record_stream below).
        unsafe { b.scale_f32(buffer.as_ptr(), 2.0, BYTES / 4) }.unwrap();
        if bug != Bug::NoRecordStream {
            // The free waits for our work on `b`. (The event is recorded at the drop.)
            buffer.record_stream(&b).unwrap();
        }
        drop(buffer);

        producer.join().unwrap();
        let waited = pool.wait_stats().waits > 0;
        assert_eq!(device.races(), Vec::new());
        drop((a, b, pool, handoff));
        assert_eq!(
            device.handle_count(),
            1,
            "a stream or an event of the device leaked"
        );
        Seen { waited }
    }

    pub fn check(bug: Bug) {
        use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
        let mut builder = loom::model::Builder::new();
        // `LOOM_MAX_PREEMPTIONS` sets the bound; without it, 3.
        if builder.preemption_bound.is_none() {
            builder.preemption_bound = Some(3);
        }
        let started = std::time::Instant::now();
        // Plain std counters: not loom objects, so they outlive one execution.
        let runs = std::sync::Arc::new(AtomicUsize::new(0));
        let waits = std::sync::Arc::new(AtomicUsize::new(0));
        let (counted, waited) = (runs.clone(), waits.clone());
        builder.check(move || {
            counted.fetch_add(1, Relaxed);
            if run(bug).waited {
                waited.fetch_add(1, Relaxed);
            }
        });
        let (runs, waits) = (runs.load(Relaxed), waits.load(Relaxed));
        println!(
            "loom explored {runs} executions (preemption bound {:?}) in {:.1} s: no \
             stream-order race, no deadlock; the producer's second allocation waited for the \
             consumer's free in {waits} of them",
            builder.preemption_bound,
            started.elapsed().as_secs_f64()
        );
        // A model whose allocation never waited would not check the wait.
        assert!(waits > 0, "no execution took the waiting path");
    }
}

#[cfg(streamalloc_loom)]
fn main() {
    use model::Bug;
    let bug = match std::env::args().nth(1).as_deref() {
        Some("correct") | None => Bug::None,
        Some("planted") => Bug::EventAfterBuffer,
        Some("planted-free") => Bug::NoRecordStream,
        Some(other) => {
            eprintln!("usage: loom_user [correct|planted|planted-free] (got {other:?})");
            std::process::exit(2);
        }
    };
    model::check(bug);
}

/// Without the cfg there is no model to run: exit 2, so that a script that runs `planted`
/// this way and expects it to fail, or `correct` and expects a pass, does not read the usage
/// note as either (it exited 0).
#[cfg(not(streamalloc_loom))]
fn main() -> std::process::ExitCode {
    eprintln!(
        "this example is a loom model: run it with\n  RUSTFLAGS=\"--cfg streamalloc_loom \
         -C debug-assertions\" CARGO_TARGET_DIR=target/loom cargo run --release --example \
         loom_user -- correct"
    );
    std::process::ExitCode::from(2)
}
