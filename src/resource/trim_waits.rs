//! A trim's waits for the GPU, written once for `.await` and for blocking code.
//!
//! The pool's, the expandable pool's and the arena's trims each come as an `async fn` and a
//! `_blocking` twin that differed only in how they wait (`stream.synchronize().await` against
//! `stream.synchronize_blocking()`): every fix had to go into both (the twentieth session's
//! failed-stream handling did). Each body is now one `async fn` generic over [`TrimWaits`]:
//! the `async` trim runs it with [`Await`]; the blocking one with [`Block`], whose waits are
//! over by the time they return a (ready) future, through [`run_blocking`].

use std::future::{self, Future};
use std::pin::pin;
use std::task::{Context, Poll, Wake, Waker};

use crate::error::Result;
use crate::event::Event;
use crate::stream::Stream;

/// How a trim waits for the GPU: for a stream's queued work, or for an event.
pub(crate) trait TrimWaits: Send + Sync {
    /// Waits for the work queued on `stream` so far ([`Stream::synchronize`] or
    /// [`Stream::synchronize_blocking`]).
    fn stream(&self, stream: &Stream) -> impl Future<Output = Result<()>> + Send + 'static;

    /// Waits for `event` (awaits it, or [`Event::synchronize_blocking`]).
    fn event(&self, event: &Event) -> impl Future<Output = Result<()>> + Send + 'static;
}

/// The `async` trims' waits: holding no thread, woken by the device's reactor.
pub(crate) struct Await;

impl TrimWaits for Await {
    fn stream(&self, stream: &Stream) -> impl Future<Output = Result<()>> + Send + 'static {
        stream.synchronize()
    }

    fn event(&self, event: &Event) -> impl Future<Output = Result<()>> + Send + 'static {
        event.clone()
    }
}

/// The blocking trims' waits: done on the calling thread before they return, so the futures
/// they return are ready.
pub(crate) struct Block;

impl TrimWaits for Block {
    fn stream(&self, stream: &Stream) -> impl Future<Output = Result<()>> + Send + 'static {
        future::ready(stream.synchronize_blocking())
    }

    fn event(&self, event: &Event) -> impl Future<Output = Result<()>> + Send + 'static {
        future::ready(event.synchronize_blocking())
    }
}

/// Runs a trim's body on the calling thread to its end: with [`Block`]'s waits it ends at the
/// first poll. Should a body ever wait on something else, the thread parks until woken
/// rather than fail.
pub(crate) fn run_blocking<F: Future>(body: F) -> F::Output {
    /// Wakes the thread that runs the body.
    struct Unpark(std::thread::Thread);

    impl Wake for Unpark {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.unpark();
        }
    }

    let mut body = pin!(body);
    let waker = Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(out) = body.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use super::run_blocking;
    use std::future::Future;
    use std::pin::Pin;
    use std::task::{Context, Poll};

    /// A body that is pending once (and wakes itself) still runs to its end.
    #[test]
    fn a_body_pending_once_runs_to_its_end() {
        struct Once(bool);
        impl Future for Once {
            type Output = u32;
            fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<u32> {
                if self.0 {
                    return Poll::Ready(7);
                }
                self.0 = true;
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
        assert_eq!(run_blocking(Once(false)), 7);
    }

    /// The `async` trims stay spawnable (a body generic over its waits must not lose `Send`),
    /// and each blocking twin runs to its end on a fresh resource.
    #[test]
    fn the_trim_futures_are_send_and_the_blocking_trims_end() {
        use crate::resource::arena::{ArenaOptions, ArenaResource};
        use crate::resource::cuda::CudaResource;
        use crate::resource::expandable::{ExpandableOptions, ExpandablePoolResource};
        use crate::resource::pool::{PoolOptions, PoolResource};
        use crate::{Device, SimConfig};

        fn send<T: Send>(t: T) -> T {
            t
        }
        let device = Device::simulated(SimConfig::default());
        let pool = PoolResource::new(CudaResource::new(&device), PoolOptions::default()).unwrap();
        let expandable =
            ExpandablePoolResource::new(&device, ExpandableOptions::default()).unwrap();
        let arena =
            ArenaResource::new(CudaResource::new(&device), ArenaOptions::default()).unwrap();
        drop((
            send(pool.trim()),
            send(expandable.trim()),
            send(expandable.trim_to(0)),
        ));
        drop(send(arena.trim()));
        assert!(pool.trim_blocking().is_ok());
        assert!(expandable.trim_blocking().is_ok());
        assert!(expandable.trim_to_blocking(0).is_ok());
        assert!(arena.trim_blocking().is_ok());
    }
}
