//! Models of `Completion` (src/completion.rs): the lock protocol that makes a wakeup impossible to
//! lose, waiters that leave, callbacks that run exactly once, and racing `complete`s.
//!
//! Every model is written against the [`Core`] trait (the calls the event futures, the reactor
//! and `on_complete` make), implemented by the crate's `Completion`. The `#[ignore]`d
//! `planted_*` tests run the same models with one bug switched on in src/completion.rs
//! (`completion::planted`) and expect loom to catch it.
//!
//! All models here are small (2-3 threads, a handful of lock sections) and are explored
//! exhaustively: preemption bound `None` unless the test says otherwise.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use loom::future::block_on;
use loom::thread;

use super::{check, must_fail, CountingWaker};
use crate::completion::{Callback, Completion, Registration};
use crate::error::{Error, Result};
use crate::sync::{Arc, AtomicUsize, Ordering};

// The models, by what races what; each file has the models and their default `#[test]`s.
mod callbacks;
mod planted;
mod wakers;

/// What the models need from a completion state.
trait Core: Send + Sync + 'static {
    fn result(&self) -> Option<Result<()>>;
    fn complete(&self, result: Result<()>) -> bool;
    fn register_waker(&self, key: &mut Option<usize>, waker: &Waker) -> Registration;
    fn deregister(&self, key: usize);
    #[allow(clippy::type_complexity)]
    fn register_callback(
        &self,
        callback: Callback,
    ) -> std::result::Result<Registration, (Callback, Result<()>)>;
    fn waiting(&self) -> usize;
    fn hurry(&self, on: bool);
}

impl Core for Completion {
    fn result(&self) -> Option<Result<()>> {
        Completion::result(self)
    }
    fn complete(&self, result: Result<()>) -> bool {
        Completion::complete(self, result)
    }
    fn register_waker(&self, key: &mut Option<usize>, waker: &Waker) -> Registration {
        Completion::register_waker(self, key, waker)
    }
    fn deregister(&self, key: usize) {
        Completion::deregister(self, key)
    }
    fn register_callback(
        &self,
        callback: Callback,
    ) -> std::result::Result<Registration, (Callback, Result<()>)> {
        Completion::register_callback(self, callback)
    }
    fn waiting(&self) -> usize {
        Completion::waiting(self)
    }
    fn hurry(&self, on: bool) {
        Completion::hurry(self, on)
    }
}

fn real() -> Completion {
    Completion::new()
}

/// The failure the models complete with when they need an error (its payload is checked).
fn failure() -> Error {
    Error::Driver {
        call: "cuStreamSynchronize",
        code: 700,
        name: "CUDA_ERROR_ILLEGAL_ADDRESS".into(),
    }
}

/// A future that waits as `Event::poll` does, minus the device query: the lock-free
/// `result()` fast path, then `register_waker`. Dropping it deregisters, as `Event`'s Drop does.
struct Wait<C: Core> {
    core: Arc<C>,
    key: Option<usize>,
}

impl<C: Core> Future for Wait<C> {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let this = self.get_mut();
        if let Some(result) = this.core.result() {
            return Poll::Ready(result);
        }
        match this.core.register_waker(&mut this.key, cx.waker()) {
            Registration::Done(result) => Poll::Ready(result),
            Registration::Stored { .. } => Poll::Pending,
        }
    }
}

impl<C: Core> Drop for Wait<C> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.core.deregister(key);
        }
    }
}

/// A callback that counts its runs in `runs` and checks it is given `expected`.
fn counting_callback(runs: &Arc<AtomicUsize>, expected: Result<()>) -> Callback {
    let runs = runs.clone();
    Box::new(move |result: &Result<()>| {
        assert_eq!(*result, expected, "callback ran with the wrong result");
        runs.fetch_add(1, Ordering::SeqCst);
    })
}
