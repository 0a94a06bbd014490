//! Review findings in the fixed-size and callback resources, each a test that failed before its
//! fix: a fixed-size resource whose `allocate_async` did not wait for a block to come back, and
//! a callback resource that passed frees it could tell were not its own to the user's closure.

mod common;

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use common::{devices, label, runtime};
use futures::task::ArcWake;
use streamalloc::resource::callback::CallbackResource;
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::fixed_size::FixedSizeResource;
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{AllocateAsync, DevicePtr, Error, MemoryResource};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// A waker that records that it was woken.
struct Flag(AtomicBool);

impl ArcWake for Flag {
    fn wake_by_ref(arc_self: &Arc<Self>) {
        arc_self.0.store(true, Ordering::SeqCst);
    }
}

/// Blocks of 256 KiB, four to a chunk, over a pool that can hold one chunk.
fn one_chunk_of_blocks(
    device: &streamalloc::Device,
) -> FixedSizeResource<PoolResource<CudaResource>> {
    let pool = PoolResource::new(
        CudaResource::new(device),
        PoolOptions {
            initial: 0,
            maximum: Some(MIB),
            ..PoolOptions::default()
        },
    )
    .unwrap();
    FixedSizeResource::new(pool, 256 * KIB, 4).unwrap()
}

/// A fixed-size resource over a pool at its maximum can run out and get memory back (a block
/// freed through it), so `allocate_async` must wait for that block, as it does for the pool
/// itself. A review found it failing at once with `OutOfMemory`: the resource had no queue of
/// waiters (`memory_waiters` was `None`), and its frees woke nobody.
#[test]
fn fixed_size_allocate_async_waits_for_a_block_to_come_back() {
    for device in devices() {
        let what = label(&device);
        let fixed = one_chunk_of_blocks(&device);
        let s = device.create_stream().unwrap();
        let blocks: Vec<DevicePtr> = (0..4).map(|_| fixed.allocate(1000, &s).unwrap()).collect();
        assert!(
            fixed.allocate(1000, &s).unwrap_err().is_out_of_memory(),
            "{what}"
        );

        let flag = Arc::new(Flag(AtomicBool::new(false)));
        let waker = futures::task::waker(flag.clone());
        let mut cx = Context::from_waker(&waker);
        let mut wait = Box::pin(fixed.allocate_async(1000, &s));
        match wait.as_mut().poll(&mut cx) {
            Poll::Pending => {}
            Poll::Ready(r) => panic!("{what}: a request that could wait did not: {r:?}"),
        }
        // A block comes back: the waiter is woken and served.
        // SAFETY: allocated above with 1000 bytes on `s`, unused, freed once.
        unsafe { fixed.deallocate(blocks[0], 1000, &s) }.unwrap();
        assert!(flag.0.load(Ordering::SeqCst), "{what}: a free woke nobody");
        let got = match wait.as_mut().poll(&mut cx) {
            Poll::Ready(Ok(ptr)) => ptr,
            other => panic!("{what}: the woken waiter was not served: {other:?}"),
        };
        assert_eq!(got, blocks[0], "{what}: the only free block");
        drop(wait);
        for ptr in std::iter::once(got).chain(blocks[1..].iter().copied()) {
            // SAFETY: each allocated above with 1000 bytes on `s`, unused, freed once.
            unsafe { fixed.deallocate(ptr, 1000, &s) }.unwrap();
        }
        s.synchronize_blocking().unwrap();
    }
}

/// With a queue of waiters, an all-or-nothing set must still fail at once when it can never
/// fit: five 1000-byte requests take five 256 KiB blocks, more than the pool's 1 MiB. The
/// resource counts a block for each ([`MemoryResource::footprint`]); with the default (1000
/// rounded to 1024 bytes) the set's sum looked small enough to wait for, for ever.
#[test]
fn fixed_size_set_that_can_never_fit_fails_at_once() {
    for device in devices() {
        let what = label(&device);
        let fixed = one_chunk_of_blocks(&device);
        assert_eq!(fixed.footprint(1000).unwrap(), 256 * KIB, "{what}");
        assert_eq!(fixed.footprint(0).unwrap(), 0, "{what}");
        let s = device.create_stream().unwrap();
        let rt = runtime();
        let set = rt.block_on(
            fixed
                .allocate_all_async((0..5).map(|_| (1000, &s)))
                .timeout(Duration::from_secs(5)),
        );
        assert!(
            matches!(set, Err(Error::OutOfMemory { .. })),
            "{what}: a set larger than the maximum gave {set:?}"
        );
        // Four fit, and are served.
        let four = rt
            .block_on(
                fixed
                    .allocate_all_async((0..4).map(|_| (1000, &s)))
                    .timeout(Duration::from_secs(5)),
            )
            .unwrap();
        for ptr in four {
            // SAFETY: allocated above with 1000 bytes on `s`, unused, freed once.
            unsafe { fixed.deallocate(ptr, 1000, &s) }.unwrap();
        }
        s.synchronize_blocking().unwrap();
    }
}

/// A null pointer with a non-zero size, or a pointer that is not 256-aligned, can never be one
/// the callback resource handed out (`allocate` refuses both from the closure), so
/// `deallocate` refuses them as every other resource does (`UnknownPointer`), without calling
/// the user's closure with them. A review found both passed on to the closure.
#[test]
fn callback_refuses_frees_it_never_handed_out() {
    let device = &devices()[0];
    let frees = Arc::new(AtomicUsize::new(0));
    let f = frees.clone();
    let (cuda_a, cuda_f) = (CudaResource::new(device), CudaResource::new(device));
    let allocate = move |bytes, stream: &streamalloc::Stream| cuda_a.allocate(bytes, stream);
    let deallocate = move |ptr, bytes, stream: &streamalloc::Stream| {
        f.fetch_add(1, Ordering::SeqCst);
        // SAFETY: only pointers of `cuda_a` reach here (the resource refuses others).
        unsafe { cuda_f.deallocate(ptr, bytes, stream) }
    };
    // SAFETY: every pointer is a `CudaResource` allocation, freed through the same resource.
    let mr = unsafe { CallbackResource::new(device, allocate, deallocate) };
    let s = device.create_stream().unwrap();
    let ptr = mr.allocate(1000, &s).unwrap();
    // SAFETY: deliberately wrong pointers: refused without touching memory.
    unsafe {
        assert!(matches!(
            mr.deallocate(DevicePtr(0), 1000, &s),
            Err(Error::UnknownPointer {
                ptr: 0,
                bytes: 1000
            })
        ));
        assert!(matches!(
            mr.deallocate(ptr.offset(16), 1000, &s),
            Err(Error::UnknownPointer { .. })
        ));
    }
    assert_eq!(
        frees.load(Ordering::SeqCst),
        0,
        "a closure was called with a pointer the resource never handed out"
    );
    // SAFETY: allocated above with 1000 bytes, unused, freed once.
    unsafe { mr.deallocate(ptr, 1000, &s) }.unwrap();
    assert_eq!(frees.load(Ordering::SeqCst), 1);
    s.synchronize_blocking().unwrap();
}

/// An upstream whose allocate panics during a growth (unwinding with the engine's growth lock
/// held) leaves the fixed-size resource consistent: no poisoned lock making later calls panic,
/// nothing counted as held that was never taken, and the next request grows as usual.
#[test]
fn fixed_size_works_after_its_upstream_panics_in_a_growth() {
    for device in devices() {
        let what = label(&device);
        let fixed = FixedSizeResource::new(
            // Its first allocate (the resource's first growth) panics.
            common::PanicsOnCall::new(CudaResource::new(&device), 1),
            256 * KIB,
            4,
        )
        .unwrap();
        let s = device.create_stream().unwrap();
        let panicked =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| fixed.allocate(1000, &s)));
        assert!(panicked.is_err(), "{what}: the upstream did not panic");
        assert_eq!(fixed.reserved(), 0, "{what}: a panicked growth counted");
        let blocks: Vec<DevicePtr> = (0..5).map(|_| fixed.allocate(1000, &s).unwrap()).collect();
        assert_eq!(fixed.reserved(), 2 * MIB, "{what}");
        for b in blocks {
            // SAFETY: allocated above on `s`, not used since.
            unsafe { fixed.deallocate(b, 1000, &s) }.unwrap();
        }
        fixed.check_invariants().unwrap();
        s.synchronize_blocking().unwrap();
    }
}

/// An upstream whose allocate panics during a growth of the resource `make` builds over it
/// (its first allocate panics) leaves the room under the maximum of 4 MiB as it was:
/// `reserved` reads 0, and the whole maximum can be had after.
fn keeps_its_room_after_its_upstream_panics_in_a_growth<R: MemoryResource>(
    make: impl Fn(common::PanicsOnCall<CudaResource>) -> R,
    reserved: impl Fn(&R) -> usize,
) {
    for device in devices() {
        let what = label(&device);
        let resource = make(common::PanicsOnCall::new(CudaResource::new(&device), 1));
        let s = device.create_stream().unwrap();
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            resource.allocate(4 * MIB, &s)
        }));
        assert!(panicked.is_err(), "{what}: the upstream did not panic");
        assert_eq!(
            reserved(&resource),
            0,
            "{what}: a panicked growth stayed counted"
        );
        let p = resource
            .allocate(4 * MIB, &s)
            .unwrap_or_else(|e| panic!("{what}: the whole maximum after the panic: {e}"));
        common::free(&resource, p, 4 * MIB, &s);
        s.synchronize_blocking().unwrap();
    }
}

/// The pool: before, the growth's claim on `reserved` stayed (it was taken back only on an
/// `Err`), and the pool could never again grow to its maximum.
#[test]
fn pool_keeps_its_room_after_its_upstream_panics_in_a_growth() {
    let options = PoolOptions {
        initial: 0,
        maximum: Some(4 * MIB),
        ..PoolOptions::default()
    };
    keeps_its_room_after_its_upstream_panics_in_a_growth(
        |upstream| PoolResource::new(upstream, options.clone()).unwrap(),
        |pool| {
            pool.check_invariants().unwrap();
            pool.stats().reserved
        },
    );
}

/// The arena, as the pool (a review found it left the same claim).
#[test]
fn arena_keeps_its_room_after_its_upstream_panics_in_a_growth() {
    use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
    let options = ArenaOptions {
        initial: 0,
        maximum: Some(4 * MIB),
        superblock_size: MIB,
    };
    keeps_its_room_after_its_upstream_panics_in_a_growth(
        |upstream| ArenaResource::new(upstream, options.clone()).unwrap(),
        |arena| arena.stats().reserved,
    );
}

/// How an upstream's panicking `deallocate` is met in
/// [`keeps_its_chunks_after_its_upstream_panics_in_a_release`].
#[derive(Clone, Copy, Debug)]
enum Release {
    /// A trim gives the free chunks back.
    Trim,
    /// A request for the whole maximum, at the maximum with only smaller free chunks, gives
    /// them back to grow one that holds it.
    Growth,
}

/// The resource `make` builds over an upstream whose second `deallocate` panics, filled to its
/// maximum of 8 MiB with 1 MiB blocks in several chunks, all freed; then a release (`how`)
/// gives the chunks back upstream and the second one panics. The chunk in flight is taken as
/// given back; the others must be back in the resource: a trim gives them back (`reserved`
/// reads 0 after it), and the whole maximum can be had. Before, they were out of the lists,
/// still counted, lost to the resource for good, and a growth's room with them.
fn keeps_its_chunks_after_its_upstream_panics_in_a_release<R: MemoryResource>(
    how: Release,
    make: impl Fn(common::PanicsOnCall<CudaResource>) -> R,
    reserved_and_chunks: impl Fn(&R) -> (usize, usize),
    trim: impl Fn(&R) -> streamalloc::Result<usize>,
) {
    const MAXIMUM: usize = 8 * MIB;
    for device in devices() {
        let what = format!("{} {how:?}", label(&device));
        let resource = make(common::PanicsOnCall::on_free(CudaResource::new(&device), 2));
        let s = device.create_stream().unwrap();
        let mut blocks = Vec::new();
        while let Ok(p) = resource.allocate(MIB, &s) {
            blocks.push(p);
        }
        let (reserved, chunks) = reserved_and_chunks(&resource);
        assert!(
            chunks >= 3 && reserved == MAXIMUM,
            "{what}: the scene needs three chunks or more at the maximum: {chunks}, {reserved}"
        );
        for p in blocks {
            common::free(&resource, p, MIB, &s);
        }
        s.synchronize_blocking().unwrap();
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match how {
            Release::Trim => drop(trim(&resource)),
            Release::Growth => drop(resource.allocate(MAXIMUM, &s)),
        }));
        assert!(panicked.is_err(), "{what}: the upstream did not panic");
        trim(&resource).unwrap_or_else(|e| panic!("{what}: the trim after the panic: {e}"));
        assert_eq!(
            reserved_and_chunks(&resource),
            (0, 0),
            "{what}: chunks left out of the resource by the panic"
        );
        let p = resource
            .allocate(MAXIMUM, &s)
            .unwrap_or_else(|e| panic!("{what}: the whole maximum after the panic: {e}"));
        common::free(&resource, p, MAXIMUM, &s);
        s.synchronize_blocking().unwrap();
    }
}

#[test]
fn pool_keeps_its_chunks_after_its_upstream_panics_in_a_release() {
    for how in [Release::Trim, Release::Growth] {
        keeps_its_chunks_after_its_upstream_panics_in_a_release(
            how,
            |upstream| {
                let options = PoolOptions {
                    initial: 0,
                    maximum: Some(8 * MIB),
                    ..PoolOptions::default()
                };
                PoolResource::new(upstream, options).unwrap()
            },
            |pool| {
                pool.check_invariants().unwrap();
                let stats = pool.stats();
                (stats.reserved, stats.chunks)
            },
            |pool| pool.trim_blocking(),
        );
    }
}

#[test]
fn arena_keeps_its_chunks_after_its_upstream_panics_in_a_release() {
    use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
    for how in [Release::Trim, Release::Growth] {
        keeps_its_chunks_after_its_upstream_panics_in_a_release(
            how,
            |upstream| {
                let options = ArenaOptions {
                    initial: 0,
                    maximum: Some(8 * MIB),
                    superblock_size: 256 * KIB,
                };
                ArenaResource::new(upstream, options).unwrap()
            },
            |arena| {
                let stats = arena.stats();
                (stats.reserved, stats.chunks)
            },
            |arena| arena.trim_blocking(),
        );
    }
}
