//! The loom models of streamalloc's concurrency cores. Compiled into the crate under
//! `cfg(all(test, streamalloc_loom))` (see `src/lib.rs`), so they drive the real internals.
//!
//! - [`adaptor_tables`]: the tracking and aligned adaptors forget an allocation before its
//!   memory goes back upstream, on the crate's adaptors over a pool of one block.
//! - [`arena`]: the arena's remote frees (a block freed on another stream than its stream
//!   arena's), on the crate's `ArenaResource` over the simulated device run inline, its race
//!   detector in the `Panic` mode: adopted only in stream order; found across a superblock move.
//! - [`cuda_async`]: `CudaAsyncResource`'s count of what it handed out, which holds its
//!   maximum: racing requests at the maximum, exactly one served; and the streams its frees
//!   were issued on while nobody waited, remembered for a request that starts waiting (none
//!   forgotten when two share a slot).
//! - [`completion`]: the wakeup protocol of `Completion` (wakers, deregistration, callbacks,
//!   concurrent completes, the reactor's pre-wake `hurry`), on the crate's own `Completion`.
//! - [`reactor`]: the registration path of an event future into a running reactor thread, with a
//!   fake device that rings the bell as the simulated one does, on the crate's `Reactor` (a
//!   mirror of it is kept only to pin down two loom 0.7.2 bugs; see that module and README.md).
//! - [`waiters`]: the memory waiters queue behind `allocate_async` (FIFO, baton passing, the
//!   fences against store buffering, cancellation), on src/resource/waiters.rs itself, polled
//!   by the crate's `Wait::poll` (what `Allocate::poll` runs) over a fake resource.
//! - [`free_lists`]: the pool's shared free list (`StreamHeap`) on fake streams that record the
//!   ordering edges: no block handed out twice or lost, every reuse on another stream ordered
//!   behind its free (the epoch protocol).
//! - [`chunk_table`]: the engine's table of chunks to shards, read by every free with no lock
//!   while growth and trims change it in place (a sequence lock): a chunk present throughout is
//!   always found.
//! - [`frees_and_regrowth`]: the same engine letting go of dropped streams (`forget` racing a
//!   take, a stream in use never forgotten) and its give-back-and-regrow path at the pool's
//!   maximum.
//! - [`expandable`]: the expandable pool's bookkeeping (`Expander`: growth by mapping, trim that
//!   takes free granules out, waits for their streams and unmaps them) on a fake stream and a
//!   fake address range: nothing handed out or used on an unmapped granule, nothing unmapped
//!   under a held block or pending work; the claims of the initial size's pieces against a
//!   trim; and a request at the maximum taking back what a trim holds.
//! - [`give_backs`]: a growth at the maximum giving whole chunks back with the growth lock let
//!   go, its room kept by a claim (`GiveBacks`, `GrowthClaim`), while requests at the maximum
//!   wait for it (`wait_for_under_way`): none fails while a give-back it saw is under way, the
//!   maximum holds, every claim's bytes come back.
//! - [`held_for_trim`]: the pool's trim ordering the chunks it took with the trims' lock let go
//!   (`HeldForTrim`: hold, replace, release) while a request at the maximum recalls them: each
//!   chunk ends given upstream (ordered, and noted so while held) or in the lists, never both.
//! - [`relocation`]: the expandable pool's move of free memory between its address ranges at
//!   its maximum: nothing unmapped under work still queued on the stream that freed it.
//! - [`history`]: the history recorder's live table (`HistoryAdaptor`): a free forgets its
//!   allocation before the memory goes back upstream, and a stop leaves no stale entry.
//! - [`deferred_free`]: the countdown that frees a buffer used on several streams once all their
//!   events completed (`release_after_all`), on the crate's `Completion`s.
//! - [`words`]: the completion words' bookkeeping (`WordSlots`): a stream's word goes to a new
//!   stream only after the GPU's last write for the old one landed (the GPU a thread).
//! - [`pinned`]: the pinned host cache (`PinnedHostResource`): a freed block goes to an
//!   allocation that claims it while pending or to the cache its completion callback fills,
//!   never both.
//! - [`timer`]: the deadlines' timer (`Timer`, `Deadline`) on a clock moved by hand: a deadline
//!   wakes its task once it is due, never before, and a cancelled one never after it was
//!   cancelled before falling due.
//! - [`races`]: how host threads that see an event reached tell the simulated device's race
//!   detector (`SimMarker::seen_by_host`: join, then mark seen), on a copy of the protocol.
//!
//! Each model states its preemption bound; it is set in the model, so `LOOM_MAX_PREEMPTIONS`
//! does not change it. The `#[ignore]`d tests, run with `-- --ignored`:
//! - `planted_*`: the same model against a copy of the code with a bug planted in it, or with a
//!   bug switched on in the crate's own code (a `planted` module of statics beside the code,
//!   compiled only under the loom cfg: the engine's `stream_ordered::planted`,
//!   `resource::wait::planted`, `timer::planted`, ...); each expects loom to catch it, and says
//!   how;
//! - `loom_false_positive_*`: pin down the two loom bugs (they pass while loom has them);
//!
//! See `loom-tests/README.md` for the command, timings and what each test catches.

mod adaptor_tables;
mod arena;
mod chunk_table;
mod completion;
mod cuda_async;
mod deferred_free;
mod expandable;
mod free_lists;
mod frees_and_regrowth;
mod give_backs;
mod held_for_trim;
mod history;
mod pinned;
mod races;
mod reactor;
mod relocation;
mod timer;
mod waiters;
mod words;

use std::task::{Wake, Waker};

use crate::sync::{AtomicUsize, Ordering};

/// Runs `f` under loom with the given preemption bound (`None`: exhaustive), and prints how many
/// executions loom explored (`--nocapture` shows it).
fn check(preemption_bound: Option<usize>, f: impl Fn() + Sync + Send + 'static) {
    use std::sync::atomic::{AtomicUsize as StdCount, Ordering::Relaxed};

    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = preemption_bound;
    // A plain counter: not a loom object, so it survives from one execution to the next.
    let runs = std::sync::Arc::new(StdCount::new(0));
    let counted = runs.clone();
    builder.check(move || {
        counted.fetch_add(1, Relaxed);
        f()
    });
    println!(
        "loom: {} executions, preemption bound {preemption_bound:?}",
        runs.load(Relaxed)
    );
}

/// Shared through std's `Arc`: the models' own bookkeeping, which loom does not see (it adds no
/// scheduling point and no happens-before edge), and which outlives one execution.
type Shared<T> = std::sync::Arc<T>;

/// How many executions of a `check` took each named path of the code under test. A model whose
/// executions never reach a path (never steal, never wait) would check nothing about it, so
/// [`check_paths`] asserts that each path it is given was taken at least once.
#[derive(Default)]
struct Seen(std::sync::Mutex<std::collections::BTreeMap<&'static str, usize>>);

impl Seen {
    /// Notes that this execution took `path` (if `taken`). Call once per execution and path.
    fn note(&self, path: &'static str, taken: bool) {
        if taken {
            *self
                .0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(path)
                .or_default() += 1;
        }
    }
}

/// [`check`], then asserts that some executions took each of `paths`, and prints how many.
fn check_paths(
    preemption_bound: Option<usize>,
    paths: &[&str],
    model: impl Fn(&Shared<Seen>) + Sync + Send + 'static,
) {
    let seen = Shared::new(Seen::default());
    let theirs = seen.clone();
    check(preemption_bound, move || model(&theirs));
    let seen = seen.0.lock().unwrap_or_else(|e| e.into_inner());
    for path in paths {
        let n = seen.get(path).copied().unwrap_or(0);
        assert!(
            n > 0,
            "no execution took the path {path:?}: the model checks nothing there"
        );
    }
    println!("paths taken (executions): {seen:?}");
}

/// Set in the child process that [`must_fail`] starts.
const CHILD: &str = "STREAMALLOC_LOOM_PLANTED_CHILD";

/// Asserts that `model` fails under loom with a message containing `expected`.
///
/// A model that loom finds deadlocked cannot be caught with `#[should_panic]`: after the
/// "deadlock" panic, loom objects dropped during unwinding panic again and the process aborts.
/// So the test runs itself again in a child process (this test binary, filtered to `test`)
/// where `model` runs directly, and checks that the child failed, and how.
fn must_fail(module: &str, test: &str, expected: &str, model: impl FnOnce()) {
    if std::env::var_os(CHILD).is_some() {
        model();
        return;
    }
    // `module_path!()` starts with the crate name, which test names do not.
    let module = module.split_once("::").map_or(module, |(_, rest)| rest);
    let name = format!("{module}::{test}");
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            name.as_str(),
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("could not run the test binary again");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("running 1 test"),
        "the child did not run {name}:\n{text}"
    );
    assert!(
        !out.status.success(),
        "planted bug not caught: {name} passed under loom"
    );
    // The child's own "test <name> ..." line may contain `expected` too: skip it.
    let line = text
        .lines()
        .find(|l| l.contains(expected) && !l.starts_with("test "))
        .unwrap_or_else(|| {
            panic!("{name} failed, but not with {expected:?}:\n{text}");
        });
    println!("{name}: caught: {}", line.trim());
}

/// A waker that counts its wakes (in a loom atomic, so every wake is an ordered event).
struct CountingWaker {
    wakes: AtomicUsize,
}

impl CountingWaker {
    /// A fresh waker and its counter. Build inside the model: it holds a loom object.
    fn new() -> (std::sync::Arc<CountingWaker>, Waker) {
        let counter = std::sync::Arc::new(CountingWaker {
            wakes: AtomicUsize::new(0),
        });
        let waker = Waker::from(counter.clone());
        (counter, waker)
    }

    fn wakes(&self) -> usize {
        self.wakes.load(Ordering::SeqCst)
    }
}

impl Wake for CountingWaker {
    fn wake(self: std::sync::Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &std::sync::Arc<Self>) {
        self.wakes.fetch_add(1, Ordering::SeqCst);
    }
}
