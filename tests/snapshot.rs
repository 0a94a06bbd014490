//! Snapshots (`resource::snapshot`) of the pool, fixed-size, arena and binning resources, and
//! the history adaptor: the blocks tile the chunks, their numbers agree with each resource's
//! statistics, and the history recorder is off until started.

mod common;

use common::{devices, free, label, pool};
use streamalloc::resource::adaptor::{
    Action, History, HistoryAdaptor, HistoryOptions, StatisticsAdaptor,
};
use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
use streamalloc::resource::binning::BinningResource;
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::fixed_size::FixedSizeResource;
use streamalloc::resource::snapshot::ChunkKind;
use streamalloc::resource::snapshot::{BlockState, Snapshot};
use streamalloc::{ExpandableOptions, ExpandablePoolResource, MemoryResource};

fn checked(snapshot: &Snapshot) {
    snapshot
        .check()
        .unwrap_or_else(|e| panic!("snapshot does not tile its chunks: {e}\n{snapshot:#?}"));
}

/// The expandable pool: its mapped ranges are the chunks, tiled by free blocks and the memory
/// handed out between them, in agreement with its statistics (through the trait, as a server
/// would take it).
#[test]
fn expandable_snapshot_tiles_its_mapped_ranges() {
    for device in devices() {
        let what = label(&device);
        let pool = ExpandablePoolResource::new(
            &device,
            ExpandableOptions {
                reserve: Some(64 << 20),
                ..ExpandableOptions::default()
            },
        )
        .unwrap();
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let sizes = [3 << 20, 1000, 1 << 20, 5000, 2 << 20];
        let ptrs: Vec<_> = sizes
            .iter()
            .enumerate()
            .map(|(i, &bytes)| {
                let s = if i % 2 == 0 { &a } else { &b };
                (pool.allocate(bytes, s).unwrap(), bytes, s)
            })
            .collect();
        for (ptr, bytes, s) in ptrs.iter().skip(1).step_by(2) {
            free(&pool, *ptr, *bytes, s);
        }
        let snapshot = pool.memory_snapshot().expect("a snapshot");
        checked(&snapshot);
        let stats = pool.stats();
        assert_eq!(snapshot.resource, "expandable pool");
        assert_eq!(snapshot.reserved, stats.reserved as u64, "{what}");
        assert!(snapshot.chunks.iter().all(|c| c.kind == ChunkKind::Mapped));
        let mapped: u64 = snapshot.chunks.iter().map(|c| c.size).sum();
        assert_eq!(mapped, stats.reserved as u64, "{what}");
        assert_eq!(
            snapshot.bytes(BlockState::Free),
            stats.free as u64,
            "{what}"
        );
        let live: u64 = ptrs
            .iter()
            .step_by(2)
            .map(|(_, bytes, _)| (*bytes as u64).next_multiple_of(256))
            .sum();
        assert_eq!(snapshot.bytes(BlockState::InUse), live, "{what}");
        for (ptr, bytes, s) in ptrs.iter().step_by(2) {
            free(&pool, *ptr, *bytes, s);
        }
    }
}

#[test]
fn pool_snapshot_agrees_with_its_stats() {
    for device in devices() {
        let what = label(&device);
        let pool = pool(&device, 1 << 20, 4 << 20);
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let ptrs: Vec<_> = (0..8)
            .map(|i| {
                let s = if i % 2 == 0 { &a } else { &b };
                (pool.allocate(1000 * (i + 1), s).unwrap(), 1000 * (i + 1), s)
            })
            .collect();
        // Free every other one: free blocks on `a`'s and `b`'s lists, in use between them.
        for (ptr, bytes, s) in ptrs.iter().skip(1).step_by(2) {
            free(&pool, *ptr, *bytes, s);
        }
        let snapshot = pool.snapshot();
        checked(&snapshot);
        let stats = pool.stats();
        assert_eq!(snapshot.resource, "pool");
        assert_eq!(snapshot.reserved, stats.reserved as u64, "{what}");
        assert_eq!(snapshot.chunks.len(), stats.chunks, "{what}");
        assert_eq!(
            snapshot.bytes(BlockState::Free),
            stats.free as u64,
            "{what}"
        );
        assert_eq!(
            snapshot.count(BlockState::Free),
            stats.free_blocks,
            "{what}"
        );
        let live: u64 = ptrs
            .iter()
            .step_by(2)
            .map(|(_, bytes, _)| (*bytes as u64).next_multiple_of(256))
            .sum();
        assert_eq!(snapshot.bytes(BlockState::InUse), live, "{what}");
        assert!(!snapshot.live_blocks_tracked);
        // The freed blocks sit in `b`'s list, with `b`'s id.
        let b_id = b.id().get();
        assert!(
            snapshot
                .blocks()
                .any(|blk| blk.state == BlockState::Free && blk.stream == Some(b_id)),
            "{what}: no free block of stream b: {snapshot:#?}"
        );
        // Through an adaptor (and an Arc), the trait method gives the same picture.
        let stats_mr = StatisticsAdaptor::new(std::sync::Arc::new(pool));
        let again = stats_mr.memory_snapshot().expect("the pool's snapshot");
        assert_eq!(again.bytes(BlockState::InUse), live, "{what}");
        for (ptr, bytes, s) in ptrs.iter().step_by(2) {
            free(&stats_mr, *ptr, *bytes, s);
        }
        let done = stats_mr.memory_snapshot().unwrap();
        assert_eq!(done.bytes(BlockState::InUse), 0, "{what}: {done:#?}");
        // Base resources have no blocks to show.
        assert!(CudaResource::new(&device).memory_snapshot().is_none());
    }
}

#[test]
fn fixed_size_snapshot_shows_one_block_per_allocation() {
    for device in devices() {
        let what = label(&device);
        let fixed = FixedSizeResource::new(CudaResource::new(&device), 4096, 16).unwrap();
        let s = device.create_stream().unwrap();
        let ptrs: Vec<_> = (0..5).map(|_| fixed.allocate(100, &s).unwrap()).collect();
        free(&fixed, ptrs[2], 100, &s);
        let snapshot = fixed.snapshot();
        checked(&snapshot);
        assert_eq!(snapshot.reserved, 16 * 4096, "{what}");
        assert_eq!(
            snapshot.count(BlockState::InUse),
            4,
            "{what}: {snapshot:#?}"
        );
        assert_eq!(snapshot.bytes(BlockState::InUse), 4 * 4096, "{what}");
        assert_eq!(snapshot.bytes(BlockState::Free), 12 * 4096, "{what}");
        for (i, p) in ptrs.into_iter().enumerate() {
            if i != 2 {
                free(&fixed, p, 100, &s);
            }
        }
    }
}

#[test]
fn arena_snapshot_tiles_its_chunks_and_shows_remote_frees() {
    for device in devices() {
        let what = label(&device);
        let arena = ArenaResource::new(
            CudaResource::new(&device),
            ArenaOptions {
                initial: 8 << 20,
                maximum: Some(16 << 20),
                superblock_size: 1 << 20,
            },
        )
        .unwrap();
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let small = arena.allocate(10_000, &a).unwrap();
        let small2 = arena.allocate(20_000, &a).unwrap();
        let large = arena.allocate(3 << 20, &b).unwrap();
        // Freed on `b`, a block of `a`'s arena: a remote free, waiting for `a` to adopt it.
        free(&arena, small2, 20_000, &b);
        let snapshot = arena.snapshot();
        checked(&snapshot);
        let stats = arena.stats();
        assert_eq!(snapshot.reserved, stats.reserved as u64, "{what}");
        let total: u64 = snapshot.blocks().map(|blk| blk.size).sum();
        assert_eq!(
            total, stats.reserved as u64,
            "{what}: the blocks tile the chunks"
        );
        let waiting: Vec<_> = snapshot
            .blocks()
            .filter(|blk| blk.state == BlockState::WaitingForStream)
            .collect();
        assert_eq!(waiting.len(), 1, "{what}: {snapshot:#?}");
        assert_eq!(waiting[0].stream, Some(b.id().get()), "{what}");
        assert!(
            snapshot.blocks().any(|blk| blk.addr == large.0
                && blk.state == BlockState::InUse
                && blk.requested == Some(3 << 20)),
            "{what}: the large block: {snapshot:#?}"
        );
        assert!(
            snapshot.blocks().any(|blk| blk.addr == small.0
                && blk.state == BlockState::InUse
                && blk.stream == Some(a.id().get())),
            "{what}: the small block, in a's superblock: {snapshot:#?}"
        );
        free(&arena, small, 10_000, &a);
        free(&arena, large, 3 << 20, &b);
    }
}

#[test]
fn binning_snapshot_has_a_part_per_bin_and_the_fallback() {
    for device in devices() {
        let what = label(&device);
        let mr = BinningResource::builder(pool(&device, 0, 64 << 20))
            .bins_pow2(10, 12)
            .blocks_per_chunk(4)
            .build()
            .unwrap();
        let s = device.create_stream().unwrap();
        let p = mr.allocate(2000, &s).unwrap();
        let big = mr.allocate(1 << 20, &s).unwrap();
        let snapshot = mr.snapshot();
        checked(&snapshot);
        assert_eq!(
            snapshot.parts.len(),
            4,
            "{what}: three bins and the fallback"
        );
        assert!(
            snapshot.parts[1].resource.contains("fixed_size(2048)"),
            "{what}"
        );
        assert_eq!(snapshot.parts[1].count(BlockState::InUse), 1, "{what}");
        // The fallback is the pool, which holds the bin's chunk and the large block in use.
        let fallback = &snapshot.parts[3];
        assert!(
            fallback
                .resource
                .starts_with("fallback (the upstream): pool"),
            "{what}"
        );
        assert_eq!(snapshot.reserved, fallback.reserved, "{what}");
        assert!(
            fallback.bytes(BlockState::InUse) >= (1 << 20) + 4 * 2048,
            "{what}"
        );
        free(&mr, p, 2000, &s);
        free(&mr, big, 1 << 20, &s);
    }
}

#[test]
fn history_is_off_until_started_and_keeps_the_last_events() {
    for device in devices() {
        let what = label(&device);
        let mr = HistoryAdaptor::new(
            pool(&device, 1 << 20, 4 << 20),
            HistoryOptions {
                capacity: 3,
                ..HistoryOptions::default()
            },
        );
        let s = device.create_stream().unwrap();
        let before = mr.allocate(512, &s).unwrap();
        assert!(!mr.is_recording());
        assert_eq!(
            mr.history(),
            History {
                capacity: 3,
                dropped: 0,
                events: vec![]
            }
        );
        assert_eq!(mr.live_allocations(), 0);
        mr.start();
        let p = mr.allocate(1000, &s).unwrap();
        let q = mr.allocate(3000, &s).unwrap();
        let snapshot = mr.memory_snapshot().unwrap();
        checked(&snapshot);
        assert!(snapshot.live_blocks_tracked, "{what}");
        assert_eq!(snapshot.resource, "history(pool)");
        let tracked: Vec<_> = snapshot
            .blocks()
            .filter(|b| b.requested.is_some())
            .collect();
        assert_eq!(tracked.len(), 2, "{what}: {snapshot:#?}");
        assert!(tracked.iter().all(|b| b.stream == Some(s.id().get())
            && b.allocated_at_us.is_some_and(|t| t <= snapshot.taken_at_us)));
        assert_eq!(tracked[0].size, 1024);
        // The block allocated before the start is in use, with nothing known about it.
        assert!(snapshot
            .blocks()
            .any(|b| b.addr == before.0 && b.state == BlockState::InUse && b.stream.is_none()));
        free(&mr, p, 1000, &s);
        free(&mr, q, 3000, &s);
        assert!(mr.allocate(usize::MAX / 2, &s).is_err());
        let history = mr.history();
        assert_eq!(history.dropped, 2, "{what}: {history:?}");
        let actions: Vec<Action> = history.events.iter().map(|e| e.action).collect();
        assert_eq!(
            actions,
            [Action::Free, Action::Free, Action::AllocateFailure]
        );
        assert_eq!(history.events[1].ptr, q.0);
        assert_eq!(history.events[1].size, 3000);
        // RMM's CSV, and JSON both ways.
        let mut csv = Vec::new();
        history.write_csv(&mut csv).unwrap();
        let csv = String::from_utf8(csv).unwrap();
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines[0], "Thread,Time,Action,Pointer,Size,Stream");
        assert!(
            lines[2].ends_with(&format!(",free,{:#x},3000,{}", q.0, s.id().get())),
            "{csv}"
        );
        assert!(lines[3].contains(",allocate failure,0x0,"), "{csv}");
        #[cfg(feature = "serde")]
        {
            let json = serde_json::to_string(&history).unwrap();
            let back: History = serde_json::from_str(&json).unwrap();
            assert_eq!(back, history);
        }
        mr.stop();
        assert_eq!(mr.live_allocations(), 0);
        free(&mr, before, 512, &s);
        assert_eq!(
            mr.history().events.len(),
            3,
            "nothing recorded while stopped"
        );
    }
}

#[test]
fn history_backtraces_reach_snapshots_and_json() {
    let device = streamalloc::Device::simulated(streamalloc::SimConfig::default());
    let mr = HistoryAdaptor::new(
        pool(&device, 1 << 20, 1 << 20),
        HistoryOptions {
            backtraces: true,
            ..HistoryOptions::default()
        },
    );
    mr.start();
    let s = device.create_stream().unwrap();
    let p = mr.allocate(256, &s).unwrap();
    let snapshot = mr.memory_snapshot().unwrap();
    let block = snapshot.blocks().find(|b| b.addr == p.0).unwrap();
    assert!(block.backtrace.as_deref().is_some_and(|b| !b.is_empty()));
    #[cfg(feature = "serde")]
    {
        let json = serde_json::to_string(&snapshot).unwrap();
        let back: Snapshot = serde_json::from_str(&json).unwrap();
        assert_eq!(back, snapshot);
    }
    free(&mr, p, 256, &s);
    assert!(mr.history().events[0].backtrace.is_some());
}
