//! The models of event futures, a reactor thread and the fake GPU, and their default `#[test]`s,
//! on the crate's `Reactor`.

use super::*;

/// One event: the task awaits it while the GPU reaches it; then the reactor is dropped.
pub(super) fn await_one<R: UnderTest>(config: R::Config, publish: Publish) {
    let reactor = R::start(config);
    let marker = Marker::new(publish);
    let event = event(1, 0, &marker);
    let gpu = gpu(&reactor, vec![marker]);

    assert_eq!(block_on(EventFuture::new(&event, &reactor)), Ok(()));
    assert_eq!(event.completion().result(), Some(Ok(())));
    gpu.join().unwrap();
    drop(reactor);
}

/// The task polls the event once and drops the future (cancelled) while the GPU reaches the
/// event. If the future handed it to the reactor, the reactor still completes it and exits
/// after the drop: the run only ends if it does.
fn drop_while_finishing<R: UnderTest>(config: R::Config, publish: Publish) {
    let reactor = R::start(config);
    let marker = Marker::new(publish);
    let event = event(1, 0, &marker);
    let gpu = gpu(&reactor, vec![marker]);
    {
        let (_, waker) = CountingWaker::new();
        let mut future = EventFuture::new(&event, &reactor);
        let _ = Pin::new(&mut future).poll(&mut Context::from_waker(&waker));
    }
    gpu.join().unwrap();
    drop(reactor);
}

/// Two events of one stream, reached in order; the task awaits the later one first, so the
/// earlier one is inserted before it in the reactor's queue.
fn await_two_in_order<R: UnderTest>(config: R::Config, publish: Publish) {
    let reactor = R::start(config);
    let (m0, m1) = (Marker::new(publish), Marker::new(publish));
    let (e0, e1) = (event(1, 0, &m0), event(1, 1, &m1));
    let gpu = gpu(&reactor, vec![m0, m1]);

    assert_eq!(block_on(EventFuture::new(&e1, &reactor)), Ok(()));
    assert_eq!(block_on(EventFuture::new(&e0, &reactor)), Ok(()));
    gpu.join().unwrap();
    drop(reactor);
}

/// Two tasks on two threads await the same event: only the first registration hands it to the
/// reactor, and both resolve.
fn two_waiters<R: UnderTest + Send + Sync>(config: R::Config, publish: Publish) {
    let reactor = Arc::new(R::start(config));
    let marker = Marker::new(publish);
    let event = event(1, 0, &marker);
    let other = {
        let (reactor, event) = (reactor.clone(), event.clone());
        thread::spawn(move || {
            assert_eq!(block_on(EventFuture::new(&event, &*reactor)), Ok(()));
        })
    };
    let gpu = gpu(&*reactor, vec![marker]);
    assert_eq!(block_on(EventFuture::new(&event, &*reactor)), Ok(()));
    other.join().unwrap();
    gpu.join().unwrap();
    drop(reactor);
}

/// A deferred callback (`Event::on_complete`, how frees wait for the GPU) is registered, then
/// the reactor is dropped (the device goes away) before the GPU reaches the event. The reactor
/// must still run the callback, exactly once, before it exits.
pub(super) fn callback_then_shutdown<R: UnderTest>(config: R::Config, publish: Publish) {
    let reactor = R::start(config);
    let marker = Marker::new(publish);
    let event = event(1, 0, &marker);
    let guard = MustRun {
        ran: Arc::new(AtomicUsize::new(0)),
    };
    on_complete(
        &event,
        &reactor,
        Box::new(move |result: &Result<()>| {
            assert_eq!(*result, Ok(()));
            guard.ran.fetch_add(1, Ordering::SeqCst);
        }),
    );
    let gpu = gpu(&reactor, vec![marker]);
    drop(reactor);
    gpu.join().unwrap();
}

// The models on the crate's `Reactor` (src/reactor.rs). Under loom 0.7.2 they need what `sync`
// does under the cfg (park through a per-thread token: tokio-rs/loom#249) and what
// `Bell::wait` does (clear the flag with an acquiring swap: #254, and the lost ring that
// `planted_clear_without_acquire` shows). Until the eighteenth session these five ran on the
// mirror, and on the crate's `Reactor` as one test, `real_reactor_models`.

/// Preemption bound 3.
#[test]
fn await_one_event() {
    each_publish(Some(3), |p| await_one::<Reactor>((), p));
}

/// Preemption bound 3.
#[test]
fn drop_future_while_event_finishes() {
    each_publish(Some(3), |p| drop_while_finishing::<Reactor>((), p));
}

/// Preemption bound 3.
#[test]
fn await_two_events_of_one_stream() {
    each_publish(Some(3), |p| await_two_in_order::<Reactor>((), p));
}

/// Preemption bound 2 (4 threads).
#[test]
fn two_waiters_one_event() {
    each_publish(Some(2), |p| two_waiters::<Reactor>((), p));
}

/// Preemption bound 3.
#[test]
fn deferred_callback_survives_shutdown() {
    each_publish(Some(3), |p| callback_then_shutdown::<Reactor>((), p));
}
