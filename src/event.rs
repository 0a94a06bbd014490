//! `Event`: a point in a stream, and a future that resolves when the GPU reaches it.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::completion::{run_callback, Callback, Completion, Registration};
use crate::device::StreamId;
use crate::device::{cuda, cuda_words, sim, Backend, Device};
use crate::error::Result;
use crate::reactor::Watch;
use crate::sync::Arc;

/// A recorded point of a stream ([`Stream::record`](crate::Stream::record)).
///
/// It is a cheap clonable handle and a future: `event.await` (or `event.clone().await`) resolves
/// when the GPU reaches it, with the error of a failed stream if there was one. While it waits,
/// the device's completion reactor watches it: no thread per future, no thread parked. Polling
/// from another task or thread moves the wakeup there.
///
/// The waker is called on whichever thread sees the event complete: mostly the device's
/// completion reactor thread, sometimes a thread that polls, queries or synchronizes another
/// handle of the same event just then. It must not block, and a panic in it is caught and
/// logged (see the crate docs, "The completion reactor thread").
///
/// # Cancel safety
/// Cancel-safe: dropping a waiting `Event` removes its waker; nothing on the GPU changes.
pub struct Event {
    inner: Arc<EventInner>,
    /// This handle's waker slot, while it waits.
    key: Option<usize>,
}

pub(crate) enum RawEvent {
    Cuda(cuda::RawEvent),
    Sim(Arc<sim::SimMarker>),
}

pub(crate) struct EventInner {
    stream: StreamId,
    /// Whether that stream still exists (its `alive` flag).
    stream_alive: std::sync::Arc<std::sync::atomic::AtomicBool>,
    seq: u64,
    raw: RawEvent,
    completion: Completion,
    /// Its stream's completion word and the value written into it right after the event
    /// (`CudaOptions::completion_words`).
    word: Option<(Arc<cuda_words::Word>, u32)>,
    /// When the driver was last asked about it while its word had not moved (ns, see
    /// [`Word::query_due`](cuda_words::Word::query_due)). Std's: a rate, not a synchronization.
    last_query: std::sync::atomic::AtomicU64,
    /// Last, so dropped last: where this handle is the device's last, the device's teardown
    /// (off the reactor threads) must come after the word above, whose last handle on the
    /// pages of words is then the device's, freed there (`cuMemFreeHost` blocks). Dropped
    /// first, it left the pages to whichever thread dropped the event, a reactor's perhaps
    /// (a review's finding).
    device: Device,
}

impl Drop for EventInner {
    fn drop(&mut self) {
        if let (RawEvent::Cuda(e), Backend::Cuda(d)) = (&self.raw, self.device.backend()) {
            d.release_event(*e);
        }
    }
}

impl Watch for EventInner {
    fn stream_id(&self) -> u64 {
        self.stream.get()
    }

    fn seq(&self) -> u64 {
        self.seq
    }

    fn query(&self) -> Option<Result<()>> {
        self.ask(false)
    }

    fn query_fresh(&self) -> Option<Result<()>> {
        self.ask(true)
    }

    fn wait_blocking(&self) -> Result<()> {
        self.wait_device()
    }

    fn completion(&self) -> &Completion {
        &self.completion
    }

    fn stream_alive(&self) -> bool {
        self.stream_alive.load(std::sync::atomic::Ordering::Acquire)
    }

    fn raw_cuda_event(&self) -> Option<cudarc::driver::sys::CUevent> {
        match self.raw {
            RawEvent::Cuda(e) => Some(e.0),
            RawEvent::Sim(_) => None,
        }
    }
}

impl EventInner {
    /// [`Watch::query`], or with `fresh` [`Watch::query_fresh`]: the completion word if the
    /// event has one and it was reached; else the driver, at most every 100 µs for an event
    /// with a word unless `fresh`.
    fn ask(&self, fresh: bool) -> Option<Result<()>> {
        match (&self.raw, self.device.backend()) {
            (RawEvent::Cuda(e), Backend::Cuda(d)) => {
                if let Some((word, value)) = &self.word {
                    if word.reached(*value) {
                        return Some(Ok(()));
                    }
                    if fresh {
                        cuda_words::Word::queried(&self.last_query);
                    } else if !cuda_words::Word::query_due(&self.last_query) {
                        return None;
                    }
                }
                d.query(*e)
            }
            (RawEvent::Sim(m), _) => m.try_result(),
            _ => Some(Err(crate::device::mismatch())),
        }
    }

    /// The result, asking the device if it is not known yet (and recording what it says). For
    /// the crate's own checks (`on_complete`); what the user's code observes goes through
    /// [`observe`](Self::observe).
    fn check(&self) -> Option<Result<()>> {
        self.check_with(|| self.query())
    }

    /// [`check`](Self::check), asking `query` (the device) if the result is not known yet. A
    /// test's seam: its `query` can complete the event as another thread would meanwhile.
    fn check_with(&self, query: impl FnOnce() -> Option<Result<()>>) -> Option<Result<()>> {
        if let Some(result) = self.completion.result() {
            return Some(result);
        }
        Some(self.settle(query()?))
    }

    /// Records `result`, what this thread learnt from the device, as the event's, and returns
    /// the event's result: `result`, unless another thread completed the event first, whose
    /// result then stands. Two looks at one event can hear different things (on CUDA the
    /// completion word says done while the driver reports a sticky error); every handle must
    /// see the one that was stored, not the one it happened to hear.
    fn settle(&self, result: Result<()>) -> Result<()> {
        if self.completion.complete_for(result.clone(), self.id()) {
            return result;
        }
        // Not the first: the event is complete, so `result()` is `Some`.
        self.completion.result().unwrap_or(result)
    }

    /// [`check`](Self::check), for the user's code (a query): a result is the user seeing the
    /// event complete.
    fn observe(&self) -> Option<Result<()>> {
        let result = self.check();
        if result.is_some() {
            self.seen_by_user();
        }
        result
    }

    /// The user's code has seen the event complete (it awaited, queried or synchronized it):
    /// the simulated device's race detector orders everything queued from now on after it.
    /// The crate's own looks (the reactor's polls, `on_complete` for a staging block or a
    /// deferred free) do not come here: the user's code did not depend on them, and a review
    /// found them hiding the user's unordered cross-stream reads. Call only once complete.
    #[inline]
    fn seen_by_user(&self) {
        if let RawEvent::Sim(m) = &self.raw {
            m.seen_by_host();
        }
    }

    /// Blocks until the device reaches the event and returns what it says, without looking at
    /// or recording the stored result.
    fn wait_device(&self) -> Result<()> {
        match (&self.raw, self.device.backend()) {
            (RawEvent::Cuda(e), Backend::Cuda(d)) => d.synchronize_event(*e),
            (RawEvent::Sim(m), _) => m.wait(),
            _ => Err(crate::device::mismatch()),
        }
    }

    /// `(stream id, sequence number)`, for logs.
    fn id(&self) -> Option<(u64, u64)> {
        Some((self.stream.get(), self.seq))
    }
}

impl Event {
    /// An event of `stream` (its id and its `alive` flag), number `seq` in its record order.
    pub(crate) fn new(
        device: Device,
        (stream, stream_alive): (StreamId, std::sync::Arc<std::sync::atomic::AtomicBool>),
        seq: u64,
        raw: RawEvent,
        word: Option<(Arc<cuda_words::Word>, u32)>,
    ) -> Event {
        Event {
            inner: Arc::new(EventInner {
                device,
                stream,
                stream_alive,
                seq,
                raw,
                completion: Completion::new(),
                word,
                last_query: std::sync::atomic::AtomicU64::new(0),
            }),
            key: None,
        }
    }

    pub(crate) fn raw(&self) -> &RawEvent {
        &self.inner.raw
    }

    /// Whether the stream it was recorded on still exists ([`Watch::stream_alive`]).
    #[cfg(all(test, not(streamalloc_loom)))]
    pub(crate) fn stream_alive(&self) -> bool {
        self.inner.stream_alive()
    }

    /// The device of the stream it was recorded on.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// The stream it was recorded on.
    pub fn stream_id(&self) -> StreamId {
        self.inner.stream
    }

    /// Whether the GPU has reached the event (successfully or not). Never blocks.
    pub fn is_complete(&self) -> bool {
        self.inner.observe().is_some()
    }

    /// The result if the GPU has reached the event, `None` if not yet. Never blocks.
    pub fn query(&self) -> Option<Result<()>> {
        self.inner.observe()
    }

    /// [`query`](Self::query) for the crate's own bookkeeping (a cache deciding whether a
    /// block's last use is done, a guard deciding whether to order a stream): on the
    /// simulated device, a result vouches for what the crate does on it and orders none of the
    /// user's work, which did not look.
    pub(crate) fn query_for_crate(&self) -> Option<Result<()>> {
        self.inner.check()
    }

    /// Blocks the calling thread until the GPU reaches the event. For synchronous code; in
    /// async code, `.await` the event.
    pub fn synchronize_blocking(&self) -> Result<()> {
        self.synchronize_with(|| self.inner.wait_device())
    }

    /// [`synchronize_blocking`](Self::synchronize_blocking), waiting with `wait` if the result
    /// is not known yet; the result is the stored one if another thread completed the event
    /// while this one waited ([`EventInner::settle`]). A test's seam, as `check_with`.
    fn synchronize_with(&self, wait: impl FnOnce() -> Result<()>) -> Result<()> {
        if let Some(result) = self.inner.completion.result() {
            // Completed by another thread's look (perhaps the crate's): this is the user's.
            self.inner.seen_by_user();
            return result;
        }
        self.inner.settle(wait())
    }

    /// Whether the event's callbacks are withheld (`reactor::settle_after_panic`: its query and
    /// its wait both panicked). Its result is an error, but nothing says the GPU is done with
    /// what it guards: memory behind it must be leaked, never reused or freed.
    pub(crate) fn withholds_callbacks(&self) -> bool {
        self.inner.completion.withholds_callbacks()
    }

    /// Puts the event in the state `reactor::settle_after_panic` leaves it in when the query
    /// and the wait both panic; for the tests of the code that must then leak what it guards.
    #[cfg(test)]
    pub(crate) fn withhold_callbacks_for_test(&self) -> usize {
        let error = crate::error::Error::InvalidArgument {
            what: "a test withheld this event's callbacks",
        };
        (self.inner.completion).fail_withholding_callbacks(error, None)
    }

    /// Runs `callback` once the GPU reaches the event: on the reactor thread, or right here if
    /// it already has. Never blocks. This is how frees are deferred until the GPU is done with
    /// the memory (buffers used on several streams, staging blocks).
    ///
    /// Wherever it runs, a panic in it is caught and logged, never propagated (see
    /// `completion.rs`). On the reactor thread it must not block: see the crate docs, "The
    /// completion reactor thread".
    pub(crate) fn on_complete(&self, callback: Callback) {
        if self.inner.completion.withholds_callbacks() {
            return self.withhold(callback);
        }
        if let Some(result) = self.inner.check() {
            // Looked at again now that there is a result: the withheld state is a result (an
            // error), set by `reactor::settle_after_panic` on another thread perhaps since the
            // look above, and it never changes once set (a review found the callback run).
            if self.inner.completion.withholds_callbacks() {
                return self.withhold(callback);
            }
            return run_callback(callback, &result, self.inner.id());
        }
        match self.inner.completion.register_callback(callback) {
            Ok(Registration::Stored { first: true }) => {
                self.inner.device.reactor().watch(self.inner.clone());
            }
            Ok(_) => {}
            // As above: a result came meanwhile, perhaps the withheld one.
            Err((callback, _)) if self.inner.completion.withholds_callbacks() => {
                self.withhold(callback)
            }
            Err((callback, result)) => run_callback(callback, &result, self.inner.id()),
        }
    }

    /// Drops `callback` unrun: nothing says the GPU is done with this event
    /// (`reactor::settle_after_panic`), so its memory is leaked rather than freed under
    /// running work.
    fn withhold(&self, callback: Callback) {
        tracing::error!(
            stream = self.inner.stream.get(),
            seq = self.inner.seq,
            "a callback on an event whose completion is unknown (its query and wait \
             panicked) is withheld; its memory is leaked"
        );
        // A capture whose drop panics (the last handle of a user's resource) is caught there,
        // as a run would be.
        crate::completion::drop_withheld(callback, self.inner.id())
    }
}

impl Clone for Event {
    fn clone(&self) -> Self {
        Event {
            inner: self.inner.clone(),
            key: None,
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.inner.completion.deregister(key);
        }
    }
}

impl fmt::Debug for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Event")
            .field("stream", &self.inner.stream)
            .field("seq", &self.inner.seq)
            .field("complete", &self.inner.completion.result().is_some())
            .finish()
    }
}

impl Future for Event {
    type Output = Result<()>;

    /// Ready is the awaiting code seeing the event complete (the race detector's host clock;
    /// the reactor's poll that woke it is not).
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = self.get_mut();
        if let Some(result) = this.inner.observe() {
            return Poll::Ready(result);
        }
        match this
            .inner
            .completion
            .register_waker(&mut this.key, cx.waker())
        {
            Registration::Done(result) => {
                this.inner.seen_by_user();
                Poll::Ready(result)
            }
            Registration::Stored { first } => {
                if first {
                    this.inner.device.reactor().watch(this.inner.clone());
                }
                Poll::Pending
            }
        }
    }
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use crate::error::Error;
    use crate::{Device, SimConfig, SimExecution};

    /// A recorded event of an inline simulated device (complete at once: Ok).
    fn event() -> super::Event {
        let device = Device::simulated(SimConfig {
            execution: SimExecution::Inline,
            ..SimConfig::default()
        });
        let stream = device.create_stream().expect("a stream");
        stream.record().expect("an event")
    }

    /// A callback handed to an event whose callbacks are withheld is dropped unrun; a panic of
    /// its captures' drop is caught there (it reached the caller, a deferred free being
    /// registered, before).
    #[test]
    fn a_withheld_callback_whose_drop_panics_stays_in_on_complete() {
        struct PanicsOnDrop;
        impl Drop for PanicsOnDrop {
            fn drop(&mut self) {
                panic!("a capture whose drop panics (event unit test)");
            }
        }
        let event = event();
        event.withhold_callbacks_for_test();
        let capture = PanicsOnDrop;
        let handed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            event.on_complete(Box::new(move |_| drop(capture)))
        }));
        assert!(handed.is_ok(), "the drop's panic reached the caller");
        assert!(event.withholds_callbacks());
    }

    /// `on_complete` while another thread withholds the event's callbacks (what
    /// `reactor::settle_after_panic` does): the callback must never run. It looked at the
    /// withheld state before the result, and a withhold between the two looks read as a
    /// completion (an error result), running the callback, a deferred free, under work that
    /// may still run (a review's finding; before the fix it failed in about half the runs).
    #[test]
    fn on_complete_racing_a_withhold_never_runs_the_callback() {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
        use std::sync::{mpsc, Arc, Barrier};
        let device = Device::simulated(SimConfig {
            execution: SimExecution::Inline,
            ..SimConfig::default()
        });
        let stream = device.create_stream().expect("a stream");
        let alive = Arc::new(AtomicBool::new(true));
        let ran = Arc::new(AtomicUsize::new(0));
        const ROUNDS: u64 = 20_000;
        let barrier = Arc::new(Barrier::new(2));
        let (tx, rx) = mpsc::sync_channel::<super::Event>(1);
        let withholder = {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                for _ in 0..ROUNDS {
                    let event = rx.recv().unwrap();
                    barrier.wait();
                    event.withhold_callbacks_for_test();
                }
            })
        };
        for seq in 0..ROUNDS {
            // A pending event: a marker that nothing will ever reach.
            let marker = crate::sync::Arc::new(crate::device::sim::SimMarker::new(None, None));
            let event = super::Event::new(
                device.clone(),
                (stream.id(), alive.clone()),
                1_000_000 + seq,
                super::RawEvent::Sim(marker),
                None,
            );
            tx.send(event.clone()).unwrap();
            barrier.wait();
            let ran = ran.clone();
            event.on_complete(Box::new(move |_| {
                ran.fetch_add(1, SeqCst);
            }));
        }
        withholder.join().unwrap();
        assert_eq!(ran.load(SeqCst), 0, "callbacks of withheld events ran");
    }

    /// The error another thread stores while this one asks the device.
    fn sticky() -> Error {
        Error::Driver {
            call: "cuEventQuery",
            code: 700,
            name: "CUDA_ERROR_ILLEGAL_ADDRESS (event unit test)".into(),
        }
    }

    /// A query that hears Ok (a completion word) while another thread completes the event with
    /// the driver's sticky error: the query returns the stored error, as every later look
    /// does, not the Ok it heard. It used to return its own Ok.
    #[test]
    fn a_query_that_loses_the_race_returns_the_stored_result() {
        let event = event();
        let inner = &event.inner;
        let answer = inner.check_with(|| {
            assert!(inner.completion.complete(Err(sticky())));
            Some(Ok(()))
        });
        assert_eq!(answer, Some(Err(sticky())));
        assert_eq!(event.query(), Some(Err(sticky())));
    }

    /// The same for a blocking synchronize that returns after another thread completed the
    /// event with a different result.
    #[test]
    fn a_synchronize_that_loses_the_race_returns_the_stored_result() {
        let event = event();
        let result = event.synchronize_with(|| {
            assert!(event.inner.completion.complete(Err(sticky())));
            Ok(())
        });
        assert_eq!(result, Err(sticky()));
        assert_eq!(event.synchronize_blocking(), Err(sticky()));
    }
}
