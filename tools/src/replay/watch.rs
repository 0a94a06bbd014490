//! `--picture`: what the replay records for the picture (the bytes reserved after each event,
//! the resource's snapshot at the log's peak), and the page drawn from it.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use streamalloc::resource::snapshot::{Block, BlockState, Snapshot};
use streamalloc::Stream;

use crate::picture::{self, model::Trace};

use super::schedule::{FAILED, FREED, PENDING};
use super::threads::Shared;

/// What `--picture` records during the replay: the bytes reserved after each event, and the
/// resource's snapshot after the event at the log's peak.
pub(super) struct Watch<'a> {
    /// The resource's reserve now (its upstream's counter), if known.
    pub(super) reserved_now: Option<&'a AtomicU64>,
    pub(super) reserved: Vec<AtomicU64>,
    pub(super) snapshot_at: Option<u64>,
    pub(super) snapshot: Mutex<Option<Snapshot>>,
    /// (size, stream) of each allocation, by id (the log's).
    pub(super) allocs: &'a [(u64, u32)],
}

impl Shared<'_> {
    /// After event `index`: the reserve, and at the peak the resource's snapshot with the
    /// live allocations of the replay (their slots) as its in-use blocks.
    pub(super) fn watch_after(&self, index: u64) {
        let Some(watch) = &self.watch else { return };
        if let Some(now) = watch.reserved_now {
            watch.reserved[index as usize].store(now.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        if watch.snapshot_at == Some(index) {
            let snapshot = self.mr.memory_snapshot().map(|mut snapshot| {
                let mut live: Vec<Block> = self
                    .slots
                    .iter()
                    .enumerate()
                    .filter_map(|(id, slot)| {
                        let ptr = slot.load(Ordering::Acquire);
                        (ptr != PENDING && ptr != FAILED && ptr != FREED).then(|| {
                            let (size, stream) = watch.allocs[id];
                            let mut block = Block::new(
                                ptr,
                                size.next_multiple_of(256),
                                BlockState::InUse,
                                Some(self.streams[stream as usize].id().get()),
                            );
                            block.requested = Some(size);
                            block
                        })
                    })
                    .collect();
                snapshot.merge_live(&mut live);
                snapshot
            });
            *watch.snapshot.lock().unwrap_or_else(|e| e.into_inner()) = snapshot;
        }
    }
}

/// Writes the page of `--picture` to `path`: the log's `trace`, with the reserve after each
/// event and the resource's snapshot at the peak that `watch` recorded.
pub(super) fn write_picture(
    path: &Path,
    log_path: &Path,
    mut trace: Trace,
    watch: Watch<'_>,
    streams: &[Stream],
    description: &str,
) -> Result<(), String> {
    if watch.reserved_now.is_some() && trace.events.len() == watch.reserved.len() {
        trace.reserved = Some(
            watch
                .reserved
                .iter()
                .map(|r| r.load(Ordering::Relaxed))
                .collect(),
        );
    }
    let snapshot = watch
        .snapshot
        .into_inner()
        .unwrap_or_else(|e| e.into_inner());
    let computing = picture::bar(
        2 * trace.events.len() as u64,
        400_000,
        "drawing",
        "{msg} [{bar:40}] {human_pos}/{human_len} ({eta})",
    );
    let title = format!(
        "Replay of {} on {description}",
        log_path
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
    );
    let ids: Vec<u64> = streams.iter().map(|s| s.id().get()).collect();
    let drawn = picture::model::from_trace(
        &trace,
        title,
        snapshot.as_ref().map(|s| (s, ids.as_slice())),
        &computing,
    )?;
    picture::write_page(&drawn, &log_path.display().to_string(), path)
}
