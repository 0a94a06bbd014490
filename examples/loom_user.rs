//! Model-checking your own code with loom, on the simulated device.
//!
//! Under `--cfg streamalloc_loom` streamalloc builds on loom's threads and locks (see the
//! README, "Testing your own code"), so a `loom::model` in your tests explores the
//! interleavings of your threads together with streamalloc's own: the completion reactor, each
//! simulated stream's worker, the memory waiters. The simulated device's race detector, in
//! its `Panic` mode, turns a stream-order bug that only some interleavings expose into a
//! failure that loom reports with the interleaving.
//!
//! The code under test is [`Handoff`]: a producer task fills a buffer on its stream and hands
//! it, with an event recorded after its writes, to a consumer task that runs a kernel on it on
//! another stream, waits for its kernel and gives the buffer back for freeing.
//!
//! ```sh
//! # the model passes:
//! RUSTFLAGS="--cfg streamalloc_loom" CARGO_TARGET_DIR=target/loom \
//!   cargo run --release --example loom_user -- correct
//! # the same model with a planted bug (the buffer is published before its event): fails
//! RUSTFLAGS="--cfg streamalloc_loom" CARGO_TARGET_DIR=target/loom \
//!   cargo run --release --example loom_user -- planted
//! ```

#[cfg(streamalloc_loom)]
mod model {
    use loom::sync::{Arc, Condvar, Mutex};
    use loom::thread;

    use streamalloc::resource::cuda_async::{CudaAsyncOptions, CudaAsyncResource};
    use streamalloc::{Device, DeviceBuffer, Event, MemoryAccess, RaceDetection, SimConfig};

    const BYTES: usize = 256;

    /// The user's code under test: a one-slot hand-off of a device buffer between two tasks on
    /// two streams. The buffer's writes are ordered before the consumer's kernel by the event
    /// that travels with it.
    #[derive(Default)]
    pub struct Handoff {
        slot: Mutex<(Option<DeviceBuffer>, Option<Event>)>,
        filled: Condvar,
        /// Plants the bug: publish the buffer before its event, in two steps.
        planted: bool,
    }

    impl Handoff {
        fn send(&self, buffer: DeviceBuffer, written: Event) {
            if self.planted {
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

    /// One execution: two tasks (the producer on its own thread, the consumer here), two
    /// streams, a device and its reactor: the five threads loom allows.
    fn run(planted: bool) {
        let device = Device::simulated(SimConfig {
            race_detection: RaceDetection::Panic,
            ..SimConfig::default()
        });
        let mr = std::sync::Arc::new(
            CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap(),
        );
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let handoff = Arc::new(Handoff {
            planted,
            ..Handoff::default()
        });

        let producer = {
            let (mr, a, handoff) = (mr.clone(), a.clone(), handoff.clone());
            thread::spawn(move || {
                let mut buffer =
                    loom::future::block_on(DeviceBuffer::alloc(&mr, BYTES, &a)).unwrap();
                buffer.memset(1).unwrap();
                handoff.send(buffer, a.record().unwrap());
            })
        };

        // The consumer.
        let (buffer, written) = handoff.recv();
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
        // SAFETY: 64 live words; the buffer is freed only after `b` is synchronized below.
        unsafe { b.scale_f32(buffer.as_ptr(), 2.0, BYTES / 4) }.unwrap();
        // Given back once our work is done (we await it: the reactor wakes us), so that its
        // free on the producer's stream comes after it. (`record_stream(&b)` and a drop would
        // not wait: the free would run on the reactor thread, and the blocking-work thread it
        // hands the resource's last handle to would be a sixth thread, one more than loom
        // allows.)
        loom::future::block_on(b.synchronize()).unwrap();
        drop(buffer);

        producer.join().unwrap();
        assert_eq!(device.races(), Vec::new());
        drop((a, b, mr, handoff));
        drop(device);
    }

    pub fn check(planted: bool) {
        use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
        let mut builder = loom::model::Builder::new();
        // Bound 1 explores the model in about 20 s (about 100 000 executions) and finds the
        // planted bug in under a second; bound 2 takes far longer than CI should (a variant
        // without the reactor was past 570 000 executions after 2 minutes).
        // `LOOM_MAX_PREEMPTIONS` overrides it.
        if builder.preemption_bound.is_none() {
            builder.preemption_bound = Some(1);
        }
        let started = std::time::Instant::now();
        let runs = std::sync::Arc::new(AtomicUsize::new(0));
        let counted = runs.clone();
        builder.check(move || {
            counted.fetch_add(1, Relaxed);
            run(planted)
        });
        println!(
            "loom explored {} executions (preemption bound {:?}) in {:.1} s: no stream-order \
             race, no deadlock",
            runs.load(Relaxed),
            builder.preemption_bound,
            started.elapsed().as_secs_f64()
        );
    }
}

#[cfg(streamalloc_loom)]
fn main() {
    match std::env::args().nth(1).as_deref() {
        Some("correct") | None => model::check(false),
        Some("planted") => model::check(true),
        Some(other) => {
            eprintln!("usage: loom_user [correct|planted] (got {other:?})");
            std::process::exit(2);
        }
    }
}

#[cfg(not(streamalloc_loom))]
fn main() {
    eprintln!(
        "this example is a loom model: run it with\n  RUSTFLAGS=\"--cfg streamalloc_loom\" \
         CARGO_TARGET_DIR=target/loom cargo run --release --example loom_user -- correct"
    );
}
