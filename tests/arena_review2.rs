//! Second review of `ArenaResource`: the numbers of its out-of-memory errors over an upstream
//! smaller than its own maximum, and statistics that must never count a byte twice. On the
//! simulated device.

#[path = "common/mod.rs"]
mod common;

use futures::FutureExt;

use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{AllocateAsync, Device, Error, MemoryResource, SimConfig};

const MIB: usize = 1 << 20;

/// An arena whose own maximum (the device's memory, by default) is above what its upstream can
/// ever hold: a request larger than the upstream's maximum can never succeed, so its error
/// must say so (`maximum` at most the upstream's), and `allocate_async` must fail at once
/// instead of waiting for ever for memory that cannot come.
#[test]
fn a_request_larger_than_the_upstream_can_hold_fails_at_once() {
    let device = Device::simulated(SimConfig::default());
    let upstream = PoolResource::new(
        CudaResource::new(&device),
        PoolOptions {
            initial: 0,
            maximum: Some(16 * MIB),
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let arena = ArenaResource::new(upstream, ArenaOptions::default()).unwrap();
    assert!(
        arena.maximum() > 32 * MIB,
        "the test needs a larger arena maximum"
    );
    let s = device.create_stream().unwrap();
    match arena.allocate(32 * MIB, &s) {
        Err(Error::OutOfMemory {
            requested, maximum, ..
        }) => {
            assert_eq!(requested, 32 * MIB);
            assert!(
                maximum <= 16 * MIB,
                "the error's maximum {maximum} is above what the upstream can ever hold"
            );
        }
        other => panic!("expected out of memory, got {other:?}"),
    }
    // Polled once: before the fix it queued, waiting for a free that could never make room.
    match arena.allocate_async(32 * MIB, &s).now_or_never() {
        Some(Err(e)) => assert!(e.is_out_of_memory(), "{e}"),
        Some(Ok(_)) => panic!("32 MiB served by an upstream of at most 16 MiB"),
        None => panic!("allocate_async waits for ever for a request the upstream can never hold"),
    }
    // A request that fits the upstream is still served.
    let p = arena.allocate(8 * MIB, &s).unwrap();
    common::free(&arena, p, 8 * MIB, &s);
    s.synchronize_blocking().unwrap();
}

/// `stats` read the global arena, let go of its lock, then read the stream arenas one by one: a
/// superblock taken from the global arena by a stream arena read after that was counted twice,
/// free in the global arena and free (or in use) in its stream arena, so that `global_free +
/// arena_free + in_use` went above `reserved`. Another thread bounces one superblock between
/// the global arena and the last stream arena while this one reads the statistics; with a
/// fixed reserve no reading may count more than it. `snapshot` read the same way.
#[test]
fn stats_never_count_a_superblock_twice() {
    let mut reads = 0u64;
    with_a_bouncing_superblock(|arena| {
        reads += 1;
        if reads.is_multiple_of(4) {
            // The snapshot read the same way: the superblock showed free in both places.
            let snapshot = arena.snapshot();
            assert!(
                !snapshot.notes.iter().any(|n| n.contains("shown once")),
                "a superblock showed twice: {:?}",
                snapshot.notes
            );
        }
        let st = arena.stats();
        let counted = st.global_free + st.arena_free + st.in_use;
        assert!(
            counted <= st.reserved,
            "counted {counted} bytes of {} reserved: {st:?}",
            st.reserved
        );
    });
}

/// An arena of 16 MiB in superblocks of 64 KiB, with 64 stream arenas made before a busy one
/// (read first, they widen the window between a reader's looks at the global arena and at the
/// busy stream's arena), while another thread bounces one superblock between the global arena
/// and the busy stream's arena 3,000 times: `look` runs on this thread until that is over.
fn with_a_bouncing_superblock(mut look: impl FnMut(&ArenaResource<CudaResource>)) {
    let device = Device::simulated(SimConfig::default());
    let arena = ArenaResource::new(
        CudaResource::new(&device),
        ArenaOptions {
            initial: 16 * MIB,
            maximum: Some(16 * MIB),
            superblock_size: 64 << 10,
        },
    )
    .unwrap();
    let fillers: Vec<_> = (0..64).map(|_| device.create_stream().unwrap()).collect();
    for s in &fillers {
        let p = arena.allocate(256, s).unwrap();
        common::free(&arena, p, 256, s);
    }
    arena.defragment();
    let busy = device.create_stream().unwrap();
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for _ in 0..3000 {
                // A superblock from the global arena, then back there.
                let p = arena.allocate(256, &busy).unwrap();
                common::free(&arena, p, 256, &busy);
                arena.defragment();
            }
            done.store(true, std::sync::atomic::Ordering::Release);
        });
        while !done.load(std::sync::atomic::Ordering::Acquire) {
            look(&arena);
        }
    });
    busy.synchronize_blocking().unwrap();
    for s in &fillers {
        s.synchronize_blocking().unwrap();
    }
}

/// The `[start, end)` ranges of the dump's lines that begin with `what` (`free region`,
/// `superblock`), written `what 0xSTART..0xEND`.
fn dumped_ranges(dump: &str, what: &str) -> Vec<(u64, u64)> {
    dump.lines()
        .filter_map(|line| line.trim().strip_prefix(what))
        .filter_map(|rest| {
            let range = rest.split_whitespace().next()?;
            let (start, end) = range.split_once("..")?;
            let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
            Some((hex(start)?, hex(end)?))
        })
        .collect()
}

/// `dump` listed the global arena's free regions, let go of its lock, then listed the stream
/// arenas: a superblock taken from the global arena in between was listed both as (part of) a
/// free region and as a stream arena's superblock. The same bouncing superblock as above;
/// no dump may list one range in both places.
#[test]
fn dump_never_lists_a_superblock_as_free_too() {
    with_a_bouncing_superblock(|arena| {
        let dump = arena.dump();
        let free = dumped_ranges(&dump, "free region ");
        let lent = dumped_ranges(&dump, "superblock ");
        assert!(
            !free.is_empty() || !lent.is_empty(),
            "nothing parsed:\n{dump}"
        );
        for &(sb_start, sb_end) in &lent {
            for &(start, end) in &free {
                assert!(
                    sb_end <= start || end <= sb_start,
                    "superblock {sb_start:#x}..{sb_end:#x} listed inside free region \
                     {start:#x}..{end:#x}:\n{dump}"
                );
            }
        }
    });
}

/// An upstream whose out-of-memory errors carry no numbers (`available` and `maximum` 0, as
/// some of the device layer's do, for a caller to fill in): it refuses any request above 16 MiB.
#[derive(Debug)]
struct NoNumbers(CudaResource);

// SAFETY: every allocation is the inner resource's, passed on unchanged.
unsafe impl MemoryResource for NoNumbers {
    fn device(&self) -> &Device {
        self.0.device()
    }

    fn allocate(
        &self,
        bytes: usize,
        stream: &streamalloc::Stream,
    ) -> streamalloc::Result<streamalloc::DevicePtr> {
        if bytes > 16 * MIB {
            return Err(Error::OutOfMemory {
                requested: bytes,
                available: 0,
                maximum: 0,
            });
        }
        self.0.allocate(bytes, stream)
    }

    unsafe fn deallocate(
        &self,
        ptr: streamalloc::DevicePtr,
        bytes: usize,
        stream: &streamalloc::Stream,
    ) -> streamalloc::Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.0.deallocate(ptr, bytes, stream) }
    }
}

/// An upstream error with no numbers says nothing about the upstream's maximum: the arena's
/// own stays in its error (a maximum of 0 would have made every refused growth look like a
/// request that can never succeed).
#[test]
fn an_upstream_error_without_numbers_keeps_the_arenas_maximum() {
    let device = Device::simulated(SimConfig::default());
    let arena = ArenaResource::new(
        NoNumbers(CudaResource::new(&device)),
        ArenaOptions {
            initial: 0,
            maximum: Some(64 * MIB),
            ..ArenaOptions::default()
        },
    )
    .unwrap();
    let s = device.create_stream().unwrap();
    match arena.allocate(32 * MIB, &s) {
        Err(Error::OutOfMemory { maximum, .. }) => assert_eq!(maximum, 64 * MIB),
        other => panic!("expected out of memory, got {other:?}"),
    }
    s.synchronize_blocking().unwrap();
}

/// The pool's twin of the test above: its error over an upstream that refuses without numbers
/// said maximum 0, and so every `allocate_async` that needed a growth failed at once.
#[test]
fn an_upstream_error_without_numbers_keeps_the_pools_maximum() {
    let device = Device::simulated(SimConfig::default());
    let pool = PoolResource::new(
        NoNumbers(CudaResource::new(&device)),
        PoolOptions {
            initial: 0,
            maximum: Some(64 * MIB),
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let s = device.create_stream().unwrap();
    match pool.allocate(32 * MIB, &s) {
        Err(Error::OutOfMemory { maximum, .. }) => assert_eq!(maximum, 64 * MIB),
        other => panic!("expected out of memory, got {other:?}"),
    }
    s.synchronize_blocking().unwrap();
}
