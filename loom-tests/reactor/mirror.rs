//! A copy of src/reactor.rs's `Bell`, `Reactor`, `run` and `poll_heads`, cut down to what the
//! simulated device uses (no spin, no timed sleeps, nothing to arm, no `forget_stream`), with
//! the two loom workarounds as switches, to pin down the two loom bugs
//! (`planted::loom_false_positive_*`; the planted bugs are switches in src/reactor.rs now). (src splits the loop body into
//! `Loop::turn`, run under `catch_unwind`, which is the identity under loom, and its `Reactor`
//! also owns the blocking-work queue; the steps of a turn are the same as here.)

use std::collections::{BTreeMap, VecDeque};

use super::Ev;
use crate::reactor::Watch;
use crate::sync::{Arc, AtomicBool, Condvar, Mutex, Ordering};
// loom's own threads, not `crate::sync::thread`: `Park::Loom` must stay loom's park even if
// src wraps it.
use loom::thread::{self, Thread};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) struct Config {
    pub(super) park: Park,
    pub(super) clear: Clear,
}

/// How the reactor thread parks.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Park {
    /// loom's `thread::park` / `Thread::unpark`, as src (tokio-rs/loom#249).
    Loom,
    /// [`Parker`]: std's semantics, from a loom mutex and condvar.
    Token,
}

/// How `Bell::wait` clears the flag after parking.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Clear {
    /// `store(false, Release)`, as src (tokio-rs/loom#254).
    Store,
    /// `swap(false, AcqRel)`: the proposed fix.
    SwapAcqRel,
}

/// `std::thread::park`/`unpark` semantics (one token, kept until the next park), built from
/// a loom mutex and condvar, so an unpark never disturbs a thread blocked elsewhere.
#[derive(Default)]
pub(super) struct Parker {
    token: Mutex<bool>,
    cv: Condvar,
}

impl Parker {
    fn park(&self) {
        let mut token = self.token.lock();
        while !*token {
            token = self.cv.wait(token);
        }
        *token = false;
    }

    fn unpark(&self) {
        *self.token.lock() = true;
        self.cv.notify_one();
    }
}

enum Handle {
    Loom(Thread),
    Token(Arc<Parker>),
}

impl Handle {
    fn unpark(&self) {
        match self {
            Handle::Loom(thread) => thread.unpark(),
            Handle::Token(parker) => parker.unpark(),
        }
    }

    fn park(&self) {
        match self {
            Handle::Loom(_) => thread::park(),
            Handle::Token(parker) => parker.park(),
        }
    }
}

pub(super) struct Bell {
    config: Config,
    notified: AtomicBool,
    thread: Mutex<Option<Arc<Handle>>>,
}

impl Bell {
    pub(super) fn ring(&self) {
        if !self.notified.swap(true, Ordering::AcqRel) {
            if let Some(thread) = &*self.thread.lock() {
                thread.unpark();
            }
        }
    }

    fn wait(&self, me: &Handle) {
        if self.notified.swap(false, Ordering::AcqRel) {
            return;
        }
        me.park();
        match self.config.clear {
            Clear::Store => self.notified.store(false, Ordering::Release),
            Clear::SwapAcqRel => {
                self.notified.swap(false, Ordering::AcqRel);
            }
        }
    }
}

#[derive(Default)]
struct Inbox {
    watch: Vec<Ev>,
    shutdown: bool,
}

struct Shared {
    config: Config,
    inbox: Mutex<Inbox>,
    bell: Arc<Bell>,
}

pub(super) struct Reactor {
    shared: Arc<Shared>,
}

impl Reactor {
    pub(super) fn start(config: Config) -> Self {
        let shared = Arc::new(Shared {
            config,
            inbox: Mutex::new(Inbox::default()),
            bell: Arc::new(Bell {
                config,
                notified: AtomicBool::new(false),
                thread: Mutex::new(None),
            }),
        });
        let theirs = shared.clone();
        thread::Builder::new()
            .name("sa-reactor-mirror".to_string())
            .spawn(move || run(theirs))
            .expect("loom could not start the thread");
        Self { shared }
    }

    pub(super) fn bell(&self) -> Arc<Bell> {
        self.shared.bell.clone()
    }

    pub(super) fn watch(&self, event: Ev) {
        self.shared.inbox.lock().watch.push(event);
        self.shared.bell.ring();
    }
}

impl Drop for Reactor {
    fn drop(&mut self) {
        self.shared.inbox.lock().shutdown = true;
        self.shared.bell.ring();
    }
}

fn run(shared: Arc<Shared>) {
    let me = Arc::new(match shared.config.park {
        Park::Loom => Handle::Loom(thread::current()),
        Park::Token => Handle::Token(Arc::new(Parker::default())),
    });
    *shared.bell.thread.lock() = Some(me.clone());
    let mut queues: BTreeMap<u64, VecDeque<Ev>> = BTreeMap::new();
    loop {
        let (new, shutdown) = {
            let mut inbox = shared.inbox.lock();
            (std::mem::take(&mut inbox.watch), inbox.shutdown)
        };
        for event in new {
            let queue = queues.entry(event.stream_id()).or_default();
            let at = queue.partition_point(|e| e.seq() < event.seq());
            queue.insert(at, event);
        }

        let progressed = poll_heads(&mut queues);
        if queues.is_empty() {
            if shutdown {
                return;
            }
            shared.bell.wait(&me);
            continue;
        }
        // src: with no spin, `hot_since` stays `None`, so progress loops straight back.
        if progressed {
            continue;
        }
        // src arms a doorbell per head here; the simulated device's `arm` does nothing.
        shared.bell.wait(&me);
    }
}

fn poll_heads(queues: &mut BTreeMap<u64, VecDeque<Ev>>) -> bool {
    let mut progressed = false;
    queues.retain(|_, queue| {
        while let Some(head) = queue.front() {
            if head.completion().result().is_none() {
                match head.query() {
                    Some(result) => {
                        head.completion().complete(result);
                    }
                    None => break,
                }
            }
            queue.pop_front();
            progressed = true;
        }
        !queue.is_empty()
    });
    progressed
}
