//! The replay threads: one per thread of the log, each running its events against the resource
//! in the order `schedule` enforces, sharing the table of our pointers by allocation id.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use streamalloc::{DevicePtr, MemoryResource, Stream};

use super::args::Order;
use super::log::{Ev, Log, Op};
use super::schedule::{FAILED, FREED, PENDING};
use super::watch::Watch;
use crate::picture::bar;

/// What the threads share.
pub(super) struct Shared<'a> {
    pub(super) mr: &'a dyn MemoryResource,
    pub(super) streams: &'a [Stream],
    pub(super) order: Order,
    /// Our pointer for each allocation id, or PENDING / FAILED / FREED.
    pub(super) slots: Vec<AtomicU64>,
    /// `--order log`: the index of the event whose turn it is.
    pub(super) turn: AtomicU64,
    pub(super) owner: &'a [u32],
    /// Each replay thread's handle, for waking it when its turn comes.
    pub(super) handles: Vec<OnceLock<Thread>>,
    /// Whether each replay thread is parked (or about to park) waiting for its turn.
    pub(super) parked: Vec<AtomicBool>,
    /// `--order threads`: how many frees wait for their allocation, and who waits for which.
    pub(super) waiting: AtomicUsize,
    pub(super) slot_waiters: Mutex<HashMap<u32, Thread>>,
    pub(super) live: AtomicU64,
    pub(super) peak_live: AtomicU64,
    pub(super) failed: AtomicU64,
    pub(super) skipped_frees: AtomicU64,
    pub(super) fail_lines_failed: AtomicU64,
    pub(super) free_errors: AtomicU64,
    pub(super) first_error: Mutex<Option<String>>,
    pub(super) progress: ProgressBar,
    /// `--picture`: what the picture needs from the replay.
    pub(super) watch: Option<Watch<'a>>,
}

impl Shared<'_> {
    pub(super) fn error(&self, what: String) {
        self.first_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(what);
    }

    pub(super) fn run(&self, op: Op, stream: &Stream) {
        match op {
            Op::Alloc { id, size } => match self.mr.allocate(size as usize, stream) {
                Ok(ptr) => {
                    let live = self.live.fetch_add(size, Ordering::Relaxed) + size;
                    self.peak_live.fetch_max(live, Ordering::Relaxed);
                    self.fill_slot(id, ptr.0);
                }
                Err(_) => {
                    // The resource ran out (or refused): counted, and its free is skipped.
                    self.failed.fetch_add(1, Ordering::Relaxed);
                    self.fill_slot(id, FAILED);
                }
            },
            Op::Free { id, size } => {
                let ptr = match self.order {
                    Order::Log => self.slots[id as usize].load(Ordering::Acquire),
                    Order::Threads => self.wait_slot(id),
                };
                if ptr == FAILED || ptr == PENDING || ptr == FREED {
                    self.skipped_frees.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                self.slots[id as usize].store(FREED, Ordering::Relaxed);
                // SAFETY: `ptr` came from this resource's `allocate` with `size` bytes (the
                // log pairs each free with its allocation and checks the size), is freed once
                // (the slot is now FREED), and no GPU work uses it.
                match unsafe { self.mr.deallocate(DevicePtr(ptr), size as usize, stream) } {
                    Ok(()) => {
                        self.live.fetch_sub(size, Ordering::Relaxed);
                    }
                    Err(e) => {
                        self.free_errors.fetch_add(1, Ordering::Relaxed);
                        self.error(format!("free of {ptr:#x} ({size} bytes) failed: {e}"));
                    }
                }
            }
            Op::Fail { size } => match self.mr.allocate(size as usize, stream) {
                Ok(ptr) => {
                    // In use while held, if only for an instant: the resource was asked to
                    // hold it, and may have grown for it (fragmentation read 99.9% for every
                    // resource, `cuda` included, when a 1 GiB retry beside 1 MiB live was not
                    // counted).
                    let live = self.live.fetch_add(size, Ordering::Relaxed) + size;
                    self.peak_live.fetch_max(live, Ordering::Relaxed);
                    // SAFETY: just allocated with `size` bytes, unused, freed once.
                    match unsafe { self.mr.deallocate(ptr, size as usize, stream) } {
                        Ok(()) => {
                            self.live.fetch_sub(size, Ordering::Relaxed);
                        }
                        Err(e) => {
                            self.free_errors.fetch_add(1, Ordering::Relaxed);
                            self.error(format!("free of {:#x} ({size} bytes) failed: {e}", ptr.0));
                        }
                    }
                }
                Err(_) => {
                    self.fail_lines_failed.fetch_add(1, Ordering::Relaxed);
                }
            },
            Op::Nop => {}
        }
    }

    /// One replay thread: its events, in order, once every replay thread has started (none
    /// if the start is called off).
    pub(super) fn thread(&self, me: usize, events: &[Ev], start: &Start) {
        let _ = self.handles[me].set(std::thread::current());
        if !start.arrive_and_wait() {
            return;
        }
        let mut done = 0u64;
        for ev in events {
            let stream = &self.streams[ev.stream as usize];
            match self.order {
                Order::Log => {
                    self.wait_turn(ev.index, me);
                    self.run(ev.op, stream);
                    self.watch_after(ev.index);
                    self.pass_turn(ev.index, me);
                }
                Order::Threads => {
                    self.run(ev.op, stream);
                    self.watch_after(ev.index);
                }
            }
            done += 1;
            if done.is_multiple_of(1024) {
                self.progress.inc(1024);
            }
        }
        self.progress.inc(done % 1024);
    }
}

/// The start of the replay: each replay thread arrives and waits until the spawning thread
/// opens it (every thread started, the clock started) or calls it off (a thread could not be
/// started). A `Barrier` sized for all of them left the started ones waiting for ever when a
/// spawn failed (a review's finding).
pub(super) struct Start {
    /// Threads arrived, and the verdict: `None` while waiting, `Some(go)` once decided.
    state: Mutex<(usize, Option<bool>)>,
    changed: Condvar,
}

impl Start {
    fn new() -> Self {
        Self {
            state: Mutex::new((0, None)),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (usize, Option<bool>)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A replay thread: counts itself, then waits for the verdict. `true`: go.
    fn arrive_and_wait(&self) -> bool {
        let mut state = self.lock();
        state.0 += 1;
        self.changed.notify_all();
        loop {
            if let Some(go) = state.1 {
                return go;
            }
            state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The spawning thread: waits until `n` threads have arrived.
    fn wait_for(&self, n: usize) {
        let mut state = self.lock();
        while state.0 < n {
            state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The verdict: `true` starts the replay, `false` sends the threads home.
    fn decide(&self, go: bool) {
        self.lock().1 = Some(go);
        self.changed.notify_all();
    }
}

pub(super) struct Outcome {
    pub(super) wall: Duration,
    pub(super) peak_live: u64,
    pub(super) failed: u64,
    pub(super) skipped_frees: u64,
    pub(super) fail_lines_failed: u64,
    pub(super) free_errors: u64,
    pub(super) first_error: Option<String>,
    pub(super) leaked: u64,
    pub(super) leaked_bytes: u64,
}

/// Replays `log`: one thread per thread of the log. `Err` if one cannot be started (the
/// system's limit on threads or memory): the threads started return without replaying, and
/// nothing was allocated.
pub(super) fn replay<'a>(
    log: &'a Log,
    mr: &'a dyn MemoryResource,
    streams: &'a [Stream],
    order: Order,
    watch: Option<Watch<'a>>,
) -> Result<(Outcome, Option<Watch<'a>>), String> {
    let progress = bar(
        log.events,
        100_000,
        "replaying",
        "{msg} [{bar:40}] {human_pos}/{human_len} events, {elapsed} (eta {eta})",
    );
    let shared = Shared {
        mr,
        streams,
        order,
        slots: (0..log.allocs.len())
            .map(|_| AtomicU64::new(PENDING))
            .collect(),
        turn: AtomicU64::new(0),
        owner: &log.owner,
        handles: (0..log.threads.len()).map(|_| OnceLock::new()).collect(),
        parked: (0..log.threads.len())
            .map(|_| AtomicBool::new(false))
            .collect(),
        waiting: AtomicUsize::new(0),
        slot_waiters: Mutex::new(HashMap::new()),
        live: AtomicU64::new(0),
        peak_live: AtomicU64::new(0),
        failed: AtomicU64::new(0),
        skipped_frees: AtomicU64::new(0),
        fail_lines_failed: AtomicU64::new(0),
        free_errors: AtomicU64::new(0),
        first_error: Mutex::new(None),
        progress,
        watch,
    };
    let start = Start::new();
    let n = log.threads.len();
    let wall = std::thread::scope(|scope| {
        for (me, events) in log.threads.iter().enumerate() {
            let (shared, start) = (&shared, &start);
            let spawned = std::thread::Builder::new()
                .name(format!("replay-{me}"))
                .spawn_scoped(scope, move || shared.thread(me, events, start));
            if let Err(e) = spawned {
                // Those started go home; the scope waits for them.
                start.decide(false);
                return Err(format!(
                    "cannot start replay thread {} of {n} (one per thread of the log): {e}",
                    me + 1
                ));
            }
        }
        start.wait_for(n);
        let clock = Instant::now();
        start.decide(true);
        // Every thread has registered its handle before it arrived: wake the first event's
        // owner in case it parked already.
        for handle in &shared.handles {
            if let Some(h) = handle.get() {
                h.unpark();
            }
        }
        Ok(Clock(clock))
    });
    let wall = match wall {
        Ok(clock) => clock.0.elapsed(),
        Err(e) => {
            shared.progress.finish_and_clear();
            return Err(e);
        }
    };
    shared.progress.finish_and_clear();
    // Free what the log never freed.
    let (mut leaked, mut leaked_bytes) = (0, 0);
    for (id, slot) in shared.slots.iter().enumerate() {
        let ptr = slot.load(Ordering::Relaxed);
        if ptr > FREED {
            let (size, stream) = log.allocs[id];
            leaked += 1;
            leaked_bytes += size;
            // SAFETY: allocated by this resource with `size` bytes, never freed, unused.
            if let Err(e) =
                unsafe { mr.deallocate(DevicePtr(ptr), size as usize, &streams[stream as usize]) }
            {
                shared.free_errors.fetch_add(1, Ordering::Relaxed);
                shared.error(format!(
                    "free of leaked {ptr:#x} ({size} bytes) failed: {e}"
                ));
            }
        }
    }
    let outcome = Outcome {
        wall,
        peak_live: shared.peak_live.load(Ordering::Relaxed),
        failed: shared.failed.load(Ordering::Relaxed),
        skipped_frees: shared.skipped_frees.load(Ordering::Relaxed),
        fail_lines_failed: shared.fail_lines_failed.load(Ordering::Relaxed),
        free_errors: shared.free_errors.load(Ordering::Relaxed),
        first_error: shared
            .first_error
            .into_inner()
            .unwrap_or_else(|e| e.into_inner()),
        leaked,
        leaked_bytes,
    };
    Ok((outcome, shared.watch))
}

/// The instant the replay started (returned out of the thread scope, which ends when every
/// replay thread has finished).
pub(super) struct Clock(Instant);
