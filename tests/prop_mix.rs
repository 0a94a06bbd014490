//! Property-based mixes (proptest) of allocations (plain, or through `allocate_async` and
//! cancelled where it waits), frees on the block's stream or another one, trims,
//! defragmentations, synchronizations, busy streams and streams dropped and made anew ([`Op`]),
//! over `PoolResource`, `ExpandablePoolResource` and `ArenaResource`, on every available
//! device (a fresh simulated device per case, its race detector set to panic). After every
//! operation: the live blocks are pairwise disjoint, the resource's own invariant checker
//! passes, its count of bytes in use is the live blocks' sizes as it rounds them, and (on the
//! simulated device) the race detector has found nothing. Before a block is freed, its first
//! and last words are read back: a block handed to another request while still live would
//! have been overwritten with that block's word. At the end every byte comes back and a trim
//! gives everything back to the upstream.
//!
//! The hand-rolled mixes with fixed seeds (`pool.rs`, `base_resources/`,
//! `arena_binning_callback/`) run thousands of steps of one seed; these run many short random
//! sequences, and a failure is shrunk to a minimal sequence, printed as a list of [`Op`]s.
//!
//! `PROPTEST_CASES` overrides the case counts (every resource, every device). Failing seeds are
//! kept in `tests/prop_mix.proptest-regressions` and replayed first on later runs: commit that
//! file (as proptest recommends), with the fix of what it found or with the `#[ignore]`d test
//! that pins it.

mod common;

use std::task::Poll;
use std::time::Duration;

use common::{check_arena, check_pool, devices, free, label, poll_once, read_u32};
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestRunner};
use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::{
    AllocateAsync, Device, DeviceKind, DevicePtr, Error, ExpandableOptions, ExpandablePoolResource,
    MemoryResource, PoolOptions, PoolResource, RaceDetection, SimConfig, Stream, ALIGNMENT,
};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// How long [`Op::Busy`] keeps a stream busy.
const BUSY: Duration = Duration::from_micros(300);

/// Streams every case works on.
const STREAMS: usize = 3;

/// The most bytes any resource here may hold: small enough that a sequence of a few dozen
/// requests of up to 4 MiB runs out of memory now and then.
const MAXIMUM: usize = 8 * MIB;

/// One step of a generated sequence.
#[derive(Debug, Clone)]
enum Op {
    /// Allocate `size` bytes on stream `stream` and fill them with the block's own word; the
    /// block is known to later frees by `key`.
    Allocate { size: usize, stream: usize, key: u8 },
    /// Free a live block (nothing if none is live) on stream `on`: its own stream, or another
    /// one made to wait for it first. The block is the first live one in the order of keys
    /// (ties: the oldest first) whose key is at least `key`, else the first of all: so that
    /// shrinking, which deletes other operations, keeps the frees on the same blocks (an index
    /// into the live blocks would move to another block with every deletion before it).
    Free { key: u8, on: usize },
    /// [`Op::Allocate`] through `allocate_async`, polled once: served at once, or cancelled
    /// (dropped) where it waits for memory, which must leave nothing behind.
    AllocateAsync { size: usize, stream: usize, key: u8 },
    /// The resource's `trim_blocking`.
    Trim,
    /// The resource's other way of moving free memory about: the arena's `defragment`, the
    /// expandable pool's `trim_to_blocking` down to half its maximum; nothing for the pool.
    Tidy,
    /// A kernel that keeps one stream busy for a while: frees on it are then reused on other
    /// streams through the GPU-side wait rather than the idle shortcut.
    Busy(usize),
    /// `synchronize_blocking` of one stream.
    Synchronize(usize),
    /// Drop the handle of one stream and put a new stream in its place, ordered after the old
    /// one's work (its live blocks are the new stream's from then on): the resource still
    /// holds blocks freed on the dropped stream in its lists.
    DropAndRecreate(usize),
}

/// Request sizes from 1 byte to 4 MiB, mostly small.
fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        8 => 1usize..=256,
        5 => 257usize..=64 * KIB,
        3 => 64 * KIB + 1..=MIB,
        2 => MIB + 1..=4 * MIB,
    ]
}

/// One operation, allocations and frees the most often.
fn op() -> impl Strategy<Value = Op> {
    let stream = || 0..STREAMS;
    prop_oneof![
        12 => (size(), stream(), any::<u8>())
            .prop_map(|(size, stream, key)| Op::Allocate { size, stream, key }),
        7 => (any::<u8>(), stream()).prop_map(|(key, on)| Op::Free { key, on }),
        2 => (size(), stream(), any::<u8>())
            .prop_map(|(size, stream, key)| Op::AllocateAsync { size, stream, key }),
        1 => Just(Op::Trim),
        1 => Just(Op::Tidy),
        1 => stream().prop_map(Op::Busy),
        1 => stream().prop_map(Op::Synchronize),
        1 => stream().prop_map(Op::DropAndRecreate),
    ]
}

/// A sequence of at most `len` operations.
fn ops(len: usize) -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op(), 1..=len)
}

/// A resource under test: how to build it and what its checks and statistics are.
trait Subject: MemoryResource + Sized {
    /// Its name in messages.
    const NAME: &'static str;
    /// Whether an out-of-memory error's `available` is the largest request that could have
    /// succeeded (so below the request), rather than free bytes however scattered.
    const AVAILABLE_IS_LARGEST_REQUEST: bool;
    /// Whether a request up to the maximum must succeed while nothing is live.
    const NEVER_FAILS_WHEN_EMPTY: bool;
    /// A small instance on `device`, with a maximum of [`MAXIMUM`].
    fn build(device: &Device) -> Self;
    /// Panics with the violation if the resource's invariant checker finds one.
    fn check(&self);
    /// Bytes handed out, as its statistics count them.
    fn in_use(&self) -> usize;
    /// Bytes held from the upstream (or mapped).
    fn reserved(&self) -> usize;
    /// The most it may hold.
    fn cap(&self) -> usize;
    /// Its blocking trim: the bytes given back.
    fn trim(&self) -> streamalloc::Result<usize>;
    /// [`Op::Tidy`].
    fn tidy(&self);
    /// With nothing live and every stream synchronized: every byte held is free.
    fn assert_all_free(&self, what: &str);
}

impl Subject for PoolResource<CudaResource> {
    const NAME: &'static str = "PoolResource<CudaResource>";
    const AVAILABLE_IS_LARGEST_REQUEST: bool = true;
    const NEVER_FAILS_WHEN_EMPTY: bool = true;
    fn build(device: &Device) -> Self {
        PoolResource::new(
            CudaResource::new(device),
            PoolOptions {
                initial: 2 * MIB,
                maximum: Some(MAXIMUM),
                ..PoolOptions::default()
            },
        )
        .unwrap()
    }
    fn check(&self) {
        check_pool(self);
    }
    fn in_use(&self) -> usize {
        self.stats().in_use
    }
    fn reserved(&self) -> usize {
        self.stats().reserved
    }
    fn cap(&self) -> usize {
        self.maximum()
    }
    fn trim(&self) -> streamalloc::Result<usize> {
        self.trim_blocking()
    }
    fn tidy(&self) {}
    fn assert_all_free(&self, what: &str) {
        let stats = self.stats();
        assert_eq!(stats.free, stats.reserved, "{what}: bytes lost: {stats:?}");
    }
}

impl Subject for ExpandablePoolResource {
    const NAME: &'static str = "ExpandablePoolResource";
    const AVAILABLE_IS_LARGEST_REQUEST: bool = true;
    // Memory freed on a stream still busy is not moved between ranges: a request that needs
    // it fails until that work is done (documented on the type).
    const NEVER_FAILS_WHEN_EMPTY: bool = false;
    fn build(device: &Device) -> Self {
        ExpandablePoolResource::new(
            device,
            ExpandableOptions {
                reserve: Some(MAXIMUM),
                maximum: Some(MAXIMUM),
                initial: 4 * MIB,
                // One allocation granule: trims exact to the granule.
                map_unit: Some(1),
                ..ExpandableOptions::default()
            },
        )
        .unwrap()
    }
    fn check(&self) {
        self.check_invariants()
            .unwrap_or_else(|e| panic!("expandable pool invariants: {e}"));
    }
    fn in_use(&self) -> usize {
        self.stats().in_use
    }
    fn reserved(&self) -> usize {
        self.stats().reserved
    }
    fn cap(&self) -> usize {
        self.maximum()
    }
    fn trim(&self) -> streamalloc::Result<usize> {
        self.trim_blocking()
    }
    fn tidy(&self) {
        self.trim_to_blocking(MAXIMUM / 2)
            .unwrap_or_else(|e| panic!("trim_to_blocking failed: {e}"));
    }
    fn assert_all_free(&self, what: &str) {
        let stats = self.stats();
        assert_eq!(stats.free, stats.reserved, "{what}: bytes lost: {stats:?}");
    }
}

impl Subject for ArenaResource<CudaResource> {
    const NAME: &'static str = "ArenaResource<CudaResource>";
    // Its `available` is the room left plus every free byte, however scattered.
    const AVAILABLE_IS_LARGEST_REQUEST: bool = false;
    const NEVER_FAILS_WHEN_EMPTY: bool = true;
    fn build(device: &Device) -> Self {
        ArenaResource::new(
            CudaResource::new(device),
            ArenaOptions {
                initial: 2 * MIB,
                maximum: Some(MAXIMUM),
                ..ArenaOptions::default()
            },
        )
        .unwrap()
    }
    fn check(&self) {
        check_arena(self);
    }
    fn in_use(&self) -> usize {
        self.stats().in_use
    }
    fn reserved(&self) -> usize {
        self.stats().reserved
    }
    fn cap(&self) -> usize {
        self.maximum()
    }
    fn trim(&self) -> streamalloc::Result<usize> {
        self.trim_blocking()
    }
    fn tidy(&self) {
        self.defragment();
    }
    fn assert_all_free(&self, what: &str) {
        // Wholly free superblocks stay with their streams until a defragmentation.
        self.defragment();
        check_arena(self);
        let stats = self.stats();
        assert_eq!(
            stats.global_free,
            stats.reserved,
            "{what}: bytes not back: {stats:?}\n{}",
            self.dump()
        );
    }
}

/// A block the harness holds: where, how large, the stream it belongs to (whose work last
/// touched it), the word it was filled with and its key ([`Op::Free`]).
#[derive(Debug, Clone, Copy)]
struct Block {
    ptr: DevicePtr,
    size: usize,
    stream: usize,
    word: u32,
    key: u8,
}

impl Block {
    /// Whole 4-byte words in the block (blocks are 256-aligned).
    fn words(&self) -> usize {
        self.size / 4
    }
}

/// `size` rounded as every resource here rounds a request.
fn rounded(size: usize) -> usize {
    size.next_multiple_of(ALIGNMENT)
}

/// The device one case runs on: a fresh simulated device whose race detector panics (a race
/// fails the case where it happens), or the GPU shared by every case.
fn case_device(device: &Device) -> Device {
    match device.kind() {
        DeviceKind::Simulated => Device::simulated(SimConfig {
            race_detection: RaceDetection::Panic,
            // Stream workers that lag a little behind the host, at random.
            op_jitter: Duration::from_micros(20),
            ..SimConfig::default()
        }),
        DeviceKind::Cuda => device.clone(),
    }
}

/// One case: `ops` run on a new `R` over `device`, every check after every operation, then
/// everything freed and given back.
struct Case<'a, R: Subject> {
    device: &'a Device,
    resource: R,
    streams: Vec<Stream>,
    live: Vec<Block>,
    /// Blocks allocated so far: makes each block's word unique.
    serial: u32,
    what: String,
}

impl<'a, R: Subject> Case<'a, R> {
    /// A new resource and [`STREAMS`] new streams on `device`, nothing live.
    fn new(device: &'a Device) -> Self {
        let resource = R::build(device);
        let streams = (0..STREAMS)
            .map(|_| device.create_stream().unwrap())
            .collect();
        Case {
            device,
            resource,
            streams,
            live: Vec::new(),
            serial: 0,
            what: format!("{} on {}", R::NAME, label(device)),
        }
    }

    /// Runs `ops`, checking everything after each, then [`finish`](Self::finish)es.
    fn run(&mut self, ops: &[Op]) {
        for (i, op) in ops.iter().enumerate() {
            self.apply(op);
            self.check_all(&format!("after op {i} ({op:?})"));
        }
        self.finish();
    }

    /// Carries out one operation (a free of nothing, with no block live, does nothing).
    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Allocate { size, stream, key } => self.allocate(size, stream, key, false),
            Op::AllocateAsync { size, stream, key } => self.allocate(size, stream, key, true),
            Op::Free { key, on } => {
                // `live` is in allocation order: the first minimum is the oldest.
                let at_least = (self.live.iter().enumerate())
                    .filter(|(_, b)| b.key >= key)
                    .min_by_key(|(_, b)| b.key);
                let chosen =
                    at_least.or_else(|| (self.live.iter().enumerate()).min_by_key(|(_, b)| b.key));
                if let Some((i, _)) = chosen {
                    let block = self.live.remove(i);
                    self.free(block, on);
                }
            }
            Op::Trim => {
                let before = self.resource.reserved();
                let released = (self.resource.trim())
                    .unwrap_or_else(|e| panic!("{}: trim failed: {e}", self.what));
                let after = self.resource.reserved();
                assert!(
                    released <= before && after <= before,
                    "{}: trim gave back {released} of {before} bytes, {after} held after",
                    self.what
                );
            }
            Op::Tidy => self.resource.tidy(),
            Op::Synchronize(k) => self.streams[k].synchronize_blocking().unwrap(),
            Op::Busy(k) => self.streams[k].spin(BUSY).unwrap(),
            Op::DropAndRecreate(k) => {
                let new = self.device.create_stream().unwrap();
                new.wait(&self.streams[k].record().unwrap()).unwrap();
                // The old handle is dropped here; the resource may still hold clones.
                self.streams[k] = new;
            }
        }
    }

    /// [`Op::Allocate`] or (`awaited`) [`Op::AllocateAsync`].
    fn allocate(&mut self, size: usize, k: usize, key: u8, awaited: bool) {
        let stream = &self.streams[k];
        let result = if awaited {
            let mut fut = std::pin::pin!(self.resource.allocate_async(size, stream));
            match poll_once(fut.as_mut()) {
                Poll::Ready(result) => result,
                // Waiting for memory: dropped here, it must take nothing.
                Poll::Pending => return,
            }
        } else {
            self.resource.allocate(size, stream)
        };
        match result {
            Ok(ptr) => {
                assert!(
                    ptr.0 != 0 && ptr.0.is_multiple_of(ALIGNMENT as u64),
                    "{}: {size} B at {ptr:?}",
                    self.what
                );
                self.serial += 1;
                let word = self.serial.wrapping_mul(0x9E37_79B1) ^ 0xA5A5_A5A5;
                let block = Block {
                    ptr,
                    size,
                    stream: k,
                    word,
                    key,
                };
                // SAFETY: `size` live bytes at `ptr`, 256-aligned, freed only after this
                // stream's work (or after another stream is ordered behind it).
                unsafe { stream.fill_u32(ptr, word, block.words()) }.unwrap();
                self.live.push(block);
            }
            Err(Error::OutOfMemory {
                requested,
                available,
                maximum,
            }) => {
                let what = format!(
                    "{}: out of memory for {size} B (requested {requested}, available \
                     {available}, maximum {maximum}, {} B in use in {} blocks)",
                    self.what,
                    self.resource.in_use(),
                    self.live.len()
                );
                assert!(requested >= size && requested <= rounded(size), "{what}");
                assert_eq!(maximum, self.resource.cap(), "{what}");
                assert!(available <= maximum, "{what}");
                if R::AVAILABLE_IS_LARGEST_REQUEST {
                    assert!(available < requested, "{what}");
                }
                if R::NEVER_FAILS_WHEN_EMPTY {
                    assert!(!self.live.is_empty(), "{what}: nothing was live");
                }
            }
            Err(e) => panic!("{}: allocating {size} B failed: {e}", self.what),
        }
    }

    /// Checks `block`'s first and last words (on its stream), writes them again there (so that
    /// the free follows work its stream may not have finished: the read-back synchronized it),
    /// then frees it on stream `on`, ordered after the block's stream first if that is another
    /// one.
    fn free(&mut self, block: Block, on: usize) {
        self.check_words(&block);
        let s = &self.streams[block.stream];
        // SAFETY: the block is live until the free below, ordered after this.
        unsafe { s.fill_u32(block.ptr, block.word, block.words()) }.unwrap();
        let t = &self.streams[on];
        if on != block.stream {
            t.wait(&s.record().unwrap()).unwrap();
        }
        free(&self.resource, block.ptr, block.size, t);
    }

    /// The block's first and last words are still its own.
    fn check_words(&self, block: &Block) {
        if block.words() == 0 {
            return;
        }
        let s = &self.streams[block.stream];
        let first = read_u32(s, block.ptr, 1)[0];
        let last = read_u32(s, block.ptr.offset((block.words() - 1) * 4), 1)[0];
        assert_eq!(
            (first, last),
            (block.word, block.word),
            "{}: {block:?} was overwritten (first and last words)",
            self.what
        );
    }

    /// Live blocks disjoint, the resource's own checker, its count of bytes in use, no race
    /// found.
    fn check_all(&self, when: &str) {
        let mut ranges: Vec<(u64, u64)> =
            self.live.iter().map(|b| (b.ptr.0, b.size as u64)).collect();
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            assert!(
                w[0].0 + w[0].1 <= w[1].0,
                "{} {when}: live blocks overlap: {:x?} and {:x?}",
                self.what,
                w[0],
                w[1]
            );
        }
        self.resource.check();
        let want: usize = self.live.iter().map(|b| rounded(b.size)).sum();
        let in_use = self.resource.in_use();
        assert_eq!(in_use, want, "{} {when}: bytes in use", self.what);
        let reserved = self.resource.reserved();
        assert!(
            in_use <= reserved && reserved <= self.resource.cap(),
            "{} {when}: {in_use} B in use, {reserved} B held, maximum {}",
            self.what,
            self.resource.cap()
        );
        let races = self.device.races();
        assert!(races.is_empty(), "{} {when}: races: {races:?}", self.what);
    }

    /// Every live block checked and freed on its own stream, every stream synchronized: all
    /// memory free, and a trim gives all of it back (every resource here trims to nothing).
    fn finish(&mut self) {
        for block in std::mem::take(&mut self.live) {
            self.free(block, block.stream);
        }
        for s in &self.streams {
            s.synchronize_blocking().unwrap();
        }
        self.check_all("at the end");
        self.resource.assert_all_free(&self.what);
        self.resource
            .trim()
            .unwrap_or_else(|e| panic!("{}: final trim failed: {e}", self.what));
        assert_eq!(
            self.resource.reserved(),
            0,
            "{}: held after the final trim",
            self.what
        );
        self.check_all("after the final trim");
    }
}

/// `default`, or `PROPTEST_CASES` when set.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Runs sequences of at most `len` operations on `R`, on every device: `sim_cases` on the
/// simulated device (a fresh one per case), `gpu_cases` on the GPU if there is one.
fn check_resource<R: Subject>(sim_cases: u32, gpu_cases: u32, len: usize) {
    for device in devices() {
        let count = match device.kind() {
            DeviceKind::Simulated => sim_cases,
            DeviceKind::Cuda => gpu_cases,
        };
        let config = Config {
            cases: cases(count),
            // Failures are kept beside this file, in `prop_mix.proptest-regressions` (the
            // default looks for a `lib.rs` above it, and warns when it finds none).
            source_file: Some(file!()),
            failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
                "proptest-regressions",
            ))),
            ..Config::default()
        };
        let mut runner = TestRunner::new(config);
        let result = runner.run(&ops(len), |ops| {
            let device = case_device(&device);
            Case::<R>::new(&device).run(&ops);
            Ok(())
        });
        if let Err(e) = result {
            panic!("{} on {}: {e}", R::NAME, label(&device));
        }
    }
}

/// Cases on the simulated device: a debug build runs its work (the fills above all) about
/// thirty times slower than a release build (2 cores: about 40 s for the file in debug, a few
/// seconds in release).
const SIM_CASES: u32 = if cfg!(debug_assertions) { 40 } else { 256 };

/// Cases on the GPU: every read-back synchronizes a stream.
const GPU_CASES: u32 = 16;

/// Operations in a sequence, at most.
const LENGTH: usize = 64;

#[test]
fn pool_mixes() {
    check_resource::<PoolResource<CudaResource>>(SIM_CASES, GPU_CASES, LENGTH);
}

#[test]
fn expandable_mixes() {
    check_resource::<ExpandablePoolResource>(SIM_CASES, GPU_CASES, LENGTH);
}

#[test]
fn arena_mixes() {
    check_resource::<ArenaResource<CudaResource>>(SIM_CASES, GPU_CASES, LENGTH);
}
