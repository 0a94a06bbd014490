//! The soak's checks of itself and of the pool while it runs: the check kernel's self-test, and
//! the monitor that runs the invariant checker at rest and prints the progress lines.

use std::sync::Arc;
use std::time::{Duration, Instant};

use streamalloc::DeviceBuffer;

use crate::gate::Checked;
use crate::tally::{human, Tally};
use crate::task::Shared;
use crate::{say, BoxError};

/// Checks that the check kernel finds what it should: a buffer with seven words overwritten
/// must count exactly seven mismatches. Without this, a kernel that counted nothing would pass.
pub async fn self_test<R: Checked>(shared: &Shared<R>) -> Result<(), BoxError> {
    let (s, counter) = (&shared.streams[0], &shared.counters[0]);
    let words = 1 << 18;
    let (seed, at) = (0x5EED_u64, 1000);
    let buf = DeviceBuffer::alloc(&shared.front, words * 4, s).await?;
    Tally::add(&shared.tally.allocations, 1);
    Tally::add(&shared.tally.bytes, words as u64 * 4);
    let planted = (0u32..)
        .find(|v| (at..at + 7).all(|i| streamalloc::Stream::pattern_u32(seed, i) != *v))
        .unwrap_or(0);
    // SAFETY: `buf` has `words` live words, used only on `s` (its stream) and freed in order
    // after these; the counter is stream `s`'s own, 8 live bytes.
    unsafe {
        s.fill_pattern_u32(buf.as_ptr(), seed, words)
            .map_err(kernels_missing)?;
        s.memset_d32(buf.as_ptr().offset(at as usize * 4), planted, 7)?;
        s.count_mismatches_u32(buf.as_ptr(), seed, words, counter.as_ptr())
            .map_err(kernels_missing)?;
    }
    drop(buf);
    Tally::add(&shared.tally.drops, 1);
    let found = shared.mismatches().await?;
    // SAFETY: the counter's 8 bytes, on its own stream, after the read above.
    unsafe { s.memset_d8(counter.as_ptr(), 0, 8)? };
    if found != 7 {
        return Err(format!(
            "self-test: the check kernel counted {found} mismatches where 7 were planted"
        )
        .into());
    }
    say("soak: self-test: the check kernel counted 7 of 7 planted mismatches".into());
    Ok(())
}

/// The pattern kernels are missing from an old `kernels/streamalloc.ptx`: say so.
fn kernels_missing(e: streamalloc::Error) -> BoxError {
    if e.to_string().contains("cuModuleGetFunction") {
        format!(
            "{e}: kernels/streamalloc.ptx predates the pattern kernels; regenerate it with \
             kernels/build.sh (nvcc) and rebuild"
        )
        .into()
    } else {
        e.into()
    }
}

/// Every `every`, the invariant checker; every `progress`, a line. Until `stopped`.
pub async fn monitor<R: Checked>(
    shared: Arc<Shared<R>>,
    progress: Duration,
    every: Duration,
    started: Instant,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = Instant::now();
    loop {
        tokio::select! {
            _ = &mut stopped => return,
            _ = tick.tick() => {}
        }
        check_at_rest(&shared).await;
        if last.elapsed() >= progress {
            last = Instant::now();
            let t = &shared.tally;
            let get = Tally::get;
            let mismatches = match shared.mismatches().await {
                Ok(n) => n.to_string(),
                Err(e) => format!("unreadable ({e})"),
            };
            let stats = shared.gate.inner().pool_stats();
            say(format!(
                "[{:>5.0} s] {} allocations ({}), {} hand-offs, {} cancellations, {} deadline \
                 misses, {} in use of {} reserved, {} invariant checks, mismatches so far: \
                 {mismatches}",
                started.elapsed().as_secs_f64(),
                get(&t.allocations),
                human(get(&t.bytes)),
                t.handoffs(),
                get(&t.cancellations),
                get(&t.deadline_misses),
                human(stats.in_use as u64),
                human(stats.reserved as u64),
                get(&t.invariant_checks),
            ));
        }
    }
}

/// Runs the pool's invariant checker with no allocate or free in flight (on a blocking
/// thread: it holds them all off for its duration), and notes a failure.
pub async fn check_at_rest<R: Checked>(shared: &Arc<Shared<R>>) {
    let gate = shared.gate.clone();
    let result = tokio::task::spawn_blocking(move || gate.check_at_rest()).await;
    Tally::add(&shared.tally.invariant_checks, 1);
    match result {
        Ok(Ok(())) => {}
        Ok(Err(e)) => shared.tally.fail(format!("invariant check failed: {e}")),
        Err(e) => shared
            .tally
            .fail(format!("invariant check failed: the checker panicked: {e}")),
    }
}
