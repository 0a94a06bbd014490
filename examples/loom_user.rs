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
//! another stream, then gives it back for freeing. The producer then allocates again by
//! `.await`, from a resource limited to one buffer: it waits until the consumer's buffer is
//! freed, in stream order, by the reactor.
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
    use loom::sync::{Arc, Mutex};
    use loom::thread;

    use streamalloc::resource::adaptor::LimitingAdaptor;
    use streamalloc::resource::cuda_async::{CudaAsyncOptions, CudaAsyncResource};
    use streamalloc::{Device, DeviceBuffer, Event, MemoryAccess, RaceDetection, SimConfig};

    const BYTES: usize = 256;

    /// The user's code under test: a one-slot hand-off of a device buffer between two tasks on
    /// two streams. The buffer's writes are ordered before the consumer's kernel by the event
    /// that travels with it.
    #[derive(Default)]
    pub struct Handoff {
        buffer: Mutex<Option<DeviceBuffer>>,
        written: Mutex<Option<Event>>,
        /// Plants the bug: publish the buffer before its event.
        planted: bool,
    }

    impl Handoff {
        fn send(&self, buffer: DeviceBuffer, written: Event) {
            if self.planted {
                // BUG: a consumer that looks in between takes the buffer without the event.
                *self.buffer.lock().unwrap() = Some(buffer);
                *self.written.lock().unwrap() = Some(written);
            } else {
                *self.written.lock().unwrap() = Some(written);
                *self.buffer.lock().unwrap() = Some(buffer);
            }
        }

        fn recv(&self) -> (DeviceBuffer, Option<Event>) {
            loop {
                if let Some(buffer) = self.buffer.lock().unwrap().take() {
                    return (buffer, self.written.lock().unwrap().take());
                }
                thread::yield_now();
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
        // One buffer at a time: the producer's second allocation waits (by `.await`) for the
        // consumer's free.
        let mr = std::sync::Arc::new(LimitingAdaptor::new(
            CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap(),
            BYTES,
        ));
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
                // Waits until the consumer's buffer is back (its free runs on the reactor).
                let again = loom::future::block_on(DeviceBuffer::alloc(&mr, BYTES, &a)).unwrap();
                drop(again);
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
        // SAFETY: 64 live words, used on `b`, which is recorded on the buffer below.
        unsafe { b.scale_f32(buffer.as_ptr(), 2.0, BYTES / 4) }.unwrap();
        // Given back: its free (on the producer's stream) waits for our work on `b`.
        buffer.record_stream(&b).unwrap();
        drop(buffer);

        producer.join().unwrap();
        assert_eq!(device.races(), Vec::new());
        drop((a, b, mr, handoff));
        drop(device);
    }

    pub fn check(planted: bool) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(2);
        let started = std::time::Instant::now();
        builder.check(move || run(planted));
        println!(
            "loom explored the model in {:.1} s: no stream-order race, no deadlock",
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
