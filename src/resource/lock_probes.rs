//! `tracing` layers for tests that check what runs under a resource's locks: the pool's and
//! the expandable pool's trims order memory onto its streams (driver calls) with the locks
//! that every request at the maximum takes let go (`pool.rs`'s review tests,
//! `expandable/trim_order_tests.rs`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

/// Whether the locks a test watches are held now (by any thread).
pub(crate) type Locked = Box<dyn Fn() -> bool + Send + Sync>;

/// Notes, at each fault the simulated device injects (an event of its `faults` module,
/// logged from inside the failing driver call), whether the watched locks were held.
pub(crate) struct LockAtFault {
    pub(crate) locked: Locked,
    pub(crate) faults: Arc<AtomicUsize>,
    pub(crate) under_lock: Arc<AtomicBool>,
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for LockAtFault {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if !event.metadata().target().ends_with("sim::faults") {
            return;
        }
        self.faults.fetch_add(1, SeqCst);
        if (self.locked)() {
            self.under_lock.store(true, SeqCst);
        }
    }
}

/// Runs `action` once, when the first span named `name` is entered (on the thread that
/// enters it), unless the watched locks are held then (noted in `under_lock`: the action would
/// wait for ever on a lock its own thread holds).
pub(crate) struct AtSpan {
    pub(crate) name: &'static str,
    pub(crate) locked: Locked,
    pub(crate) action: Mutex<Option<Box<dyn FnOnce() + Send>>>,
    pub(crate) under_lock: Arc<AtomicBool>,
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for AtSpan {
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _: &tracing::span::Id,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        if attrs.metadata().name() != self.name {
            return;
        }
        if (self.locked)() {
            self.under_lock.store(true, SeqCst);
            return;
        }
        // Taken out first: the action enters such spans too.
        let action = self.action.lock().unwrap().take();
        if let Some(action) = action {
            action();
        }
    }
}
