//! The pool beside the driver's stream-ordered pools, near the device's limit.
//!
//! A `cuMemAlloc` or `cuMemCreate` short of memory makes the driver release all that every
//! driver pool of the process keeps before it succeeds or fails (BENCHMARKS.md, "A failed
//! cuMemAlloc empties the driver's pools"; the simulated device does the same). A
//! `PoolResource` or `ArenaResource` over device memory grows beyond its request only out of the
//! free memory, so its growth step does not empty a `CudaAsyncResource`'s cache; a request of
//! its own may.
//!
//! Its own test binary: on a GPU a test takes all of the card but a few GiB for a moment, which
//! would fail the tests of another binary running beside it (each binary runs alone). Its two
//! GPU tests take turns (`GPU`): tests of one binary run on threads at once.

#[path = "common/mod.rs"]
mod common;

use common::{devices, label, primed_async_pool};
use std::future::Future;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use streamalloc::resource::adaptor::LimitingAdaptor;
use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::cuda_async::CudaAsyncOptions;
use streamalloc::resource::pool::{PoolOptions, PoolResource};

use streamalloc::{
    AllocateAsync, CudaAsyncResource, Device, DevicePtr, Error, ExpandableOptions,
    ExpandablePoolResource, FaultKind, MemoryResource, SimConfig,
};

// Each test that fills the device takes turns (`common::take_turns`).

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// Each device with the unit its sizes are in: the GPU's from `devices()`, and a simulated
/// device of 2 GiB (the default simulated device's 16 GiB would only take longer).
fn devices_and_units() -> Vec<(Device, usize)> {
    let mut all: Vec<(Device, usize)> = devices()
        .into_iter()
        .filter(|d| !d.is_simulated())
        .map(|d| (d, GIB))
        .collect();
    let small = Device::simulated(SimConfig {
        total_memory: 2 * GIB,
        ..SimConfig::default()
    });
    all.push((small, 256 * MIB));
    all
}

#[test]
fn a_pool_growing_near_the_device_limit_leaves_the_driver_pools_alone() {
    for (device, unit) in devices_and_units() {
        // Doubles at each growth.
        let pool = PoolResource::new(
            CudaResource::new(&device),
            PoolOptions {
                growth_divisor: 1,
                growth_cap: None,
                ..PoolOptions::default()
            },
        )
        .unwrap();
        grows_near_the_limit(&device, unit, "pool", &pool, &|| pool.stats().reserved);
    }
}

#[test]
fn an_arena_growing_near_the_device_limit_leaves_the_driver_pools_alone() {
    for (device, unit) in devices_and_units() {
        // Doubles at each growth, as RMM's.
        let arena =
            ArenaResource::new(CudaResource::new(&device), ArenaOptions::default()).unwrap();
        grows_near_the_limit(&device, unit, "arena", &arena, &|| arena.stats().reserved);
    }
}

/// `resource` (empty, over `CudaResource`, doubling what it holds at each growth) takes two
/// units, all of the device but one unit is taken, then `resource` is asked for 16 MiB: its
/// growth step (two units) is past the free memory, the request is not. It must grow by what
/// is free, and a `CudaAsyncResource` primed beforehand must keep its memory.
fn grows_near_the_limit(
    device: &Device,
    unit: usize,
    name: &str,
    resource: &dyn MemoryResource,
    reserved: &dyn Fn() -> usize,
) {
    let _turn = common::take_turns();
    let what = format!("{} {name}", label(device));
    let stream = device.create_stream().unwrap();
    let primed = primed_async_pool(device, unit / 4);
    let kept = primed.reserved_bytes().unwrap();
    assert!(kept >= unit / 4, "{what}: primed pool holds {kept}");

    let first = resource.allocate(2 * unit, &stream).unwrap();
    assert_eq!(reserved(), 2 * unit, "{what}");
    let direct = CudaResource::new(device);
    let filler_bytes = (device.free_memory().unwrap())
        .checked_sub(unit)
        .expect("less than one unit free: memory an earlier test held (a panic?)");
    let filler = direct.allocate(filler_bytes, &stream).unwrap();

    let second = resource.allocate(16 * MIB, &stream).unwrap();
    assert_eq!(
        primed.reserved_bytes().unwrap(),
        kept,
        "{what}: the driver pool's kept memory after the growth"
    );
    let held = reserved();
    assert!(
        held > 2 * unit + 16 * MIB && held < 3 * unit,
        "{what}: holds {held} bytes"
    );

    // SAFETY: nothing used them; each is freed once.
    unsafe {
        resource.deallocate(second, 16 * MIB, &stream).unwrap();
        resource.deallocate(first, 2 * unit, &stream).unwrap();
        direct.deallocate(filler, filler_bytes, &stream).unwrap();
    }
    stream.synchronize_blocking().unwrap();
}

/// The simulated device's `cuMemCreate` does what the driver's does short of memory (run99:
/// the pools kept nothing afterwards): the driver pools give back what they keep and the
/// request tries again, so an expandable pool's growth that fits only with that memory
/// succeeds. Simulated only: the GPU's behaviour is the probe's.
#[test]
fn an_expandable_pool_short_of_memory_takes_what_the_driver_pools_keep() {
    let device = Device::simulated(SimConfig {
        total_memory: 2 * GIB,
        ..SimConfig::default()
    });
    let stream = device.create_stream().unwrap();
    let primed = primed_async_pool(&device, 512 * MIB);
    assert_eq!(primed.reserved_bytes().unwrap(), 512 * MIB);
    let direct = CudaResource::new(&device);
    let filler_bytes = device.free_memory().unwrap() - 256 * MIB;
    let filler = direct.allocate(filler_bytes, &stream).unwrap();

    let expandable = ExpandablePoolResource::new(&device, ExpandableOptions::default()).unwrap();
    let big = expandable.allocate(512 * MIB, &stream).unwrap();
    assert_eq!(primed.reserved_bytes().unwrap(), 0);
    write_and_read_back(&stream, big, 512 * MIB);

    // SAFETY: their uses are synchronized; each is freed once.
    unsafe {
        expandable.deallocate(big, 512 * MIB, &stream).unwrap();
        direct.deallocate(filler, filler_bytes, &stream).unwrap();
    }
    stream.synchronize_blocking().unwrap();
}

/// `CudaAsyncResource::new` primes its pool with `initial_pool_size` by an allocation and a
/// free that only it knows of. A failed free there returned the error and dropped the pool with
/// the block still allocated: a driver pool releases its memory only once all of it is freed,
/// so the device's memory was gone for good (here 256 MiB of the simulated device's 2 GiB).
/// Nothing is lost when an error is returned: the free is tried again, and the memory is
/// the device's again once the resource goes.
#[test]
fn a_failed_priming_free_loses_no_device_memory() {
    let device = Device::simulated(SimConfig {
        total_memory: 2 * GIB,
        ..SimConfig::default()
    });
    let faults = device.faults().unwrap();
    let free = device.free_memory().unwrap();
    faults.fail_next(FaultKind::Free);
    let primed = CudaAsyncResource::new(
        &device,
        CudaAsyncOptions {
            initial_pool_size: Some(256 * MIB),
            ..CudaAsyncOptions::default()
        },
    );
    assert_eq!(faults.injected(FaultKind::Free), 1);
    drop(primed);
    assert_eq!(
        device.free_memory().unwrap(),
        free,
        "device memory lost to a failed priming free"
    );
}

/// Fills the first and last words of `bytes` at `ptr` and reads them back: the memory is mapped
/// and usable.
fn write_and_read_back(stream: &streamalloc::Stream, ptr: streamalloc::DevicePtr, bytes: usize) {
    let words = bytes / 4;
    // SAFETY: `ptr` holds `bytes` that nothing else uses.
    unsafe { stream.fill_u32(ptr, 0x5EED, words) }.unwrap();
    let mut last = 0u32;
    let at = streamalloc::DevicePtr(ptr.0 + (bytes - 4) as u64);
    // SAFETY: `at` is the last word of the block; `last` is the host's, read only after the
    // synchronization below.
    unsafe { stream.copy_dtoh(&mut last as *mut u32 as *mut u8, at, 4) }.unwrap();
    stream.synchronize_blocking().unwrap();
    assert_eq!(last, 0x5EED);
}

// ===== CudaAsyncResource waits for memory =====

/// A waker that records that it was woken.
struct Flag(std::sync::atomic::AtomicBool);

impl futures::task::ArcWake for Flag {
    fn wake_by_ref(arc_self: &std::sync::Arc<Self>) {
        arc_self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

fn flag() -> (std::sync::Arc<Flag>, std::task::Waker) {
    let flag = std::sync::Arc::new(Flag(std::sync::atomic::AtomicBool::new(false)));
    let waker = futures::task::waker(flag.clone());
    (flag, waker)
}

/// A resource with a maximum of 1 MiB on the simulated device, and four 256 KiB blocks that
/// fill it.
fn full_async_resource() -> (
    Device,
    CudaAsyncResource,
    streamalloc::Stream,
    Vec<DevicePtr>,
) {
    let device = Device::simulated(SimConfig {
        total_memory: 256 * MIB,
        ..SimConfig::default()
    });
    let resource = CudaAsyncResource::new(
        &device,
        CudaAsyncOptions {
            maximum_pool_size: Some(MIB),
            ..CudaAsyncOptions::default()
        },
    )
    .unwrap();
    let s = device.create_stream().unwrap();
    let blocks: Vec<DevicePtr> = (0..4)
        .map(|_| resource.allocate(256 * KIB, &s).unwrap())
        .collect();
    assert!(resource.allocate(256, &s).unwrap_err().is_out_of_memory());
    (device, resource, s, blocks)
}

/// `CudaAsyncResource` at its maximum can get memory back (a free through it), so
/// `allocate_async` must wait for it as the pools do. A review found it failing at once with
/// `OutOfMemory`: the resource had no queue of waiters (`memory_waiters` was `None`) and its
/// frees woke nobody. Behind the waiter a request larger than the maximum still fails at once,
/// with the numbers.
#[test]
fn cuda_async_allocate_async_at_its_maximum_waits_for_a_free() {
    let (_device, resource, s, blocks) = full_async_resource();
    let (flag, waker) = flag();
    let mut cx = Context::from_waker(&waker);
    let mut wait = Box::pin(resource.allocate_async(256 * KIB, &s));
    match wait.as_mut().poll(&mut cx) {
        Poll::Pending => {}
        Poll::Ready(r) => panic!("a request that could wait did not: {r:?}"),
    }
    assert_eq!(
        resource.memory_waiters().map(|w| w.stats().waiting),
        Some(1)
    );

    // Behind it: larger than the maximum can never fit, and fails at once with the numbers.
    let mut hopeless = Box::pin(resource.allocate_async(2 * MIB, &s));
    match hopeless.as_mut().poll(&mut cx) {
        Poll::Ready(Err(Error::OutOfMemory {
            requested, maximum, ..
        })) => {
            assert_eq!((requested, maximum), (2 * MIB, MIB));
        }
        other => panic!("a request over the maximum gave {other:?}"),
    }
    drop(hopeless);
    assert!(!flag.0.load(Ordering::SeqCst), "woken with nothing freed");

    // SAFETY: allocated above with 256 KiB on `s`, unused, freed once.
    unsafe { resource.deallocate(blocks[0], 256 * KIB, &s) }.unwrap();
    assert!(flag.0.load(Ordering::SeqCst), "a free woke nobody");
    let got = match wait.as_mut().poll(&mut cx) {
        Poll::Ready(Ok(ptr)) => ptr,
        other => panic!("the woken waiter was not served: {other:?}"),
    };
    drop(wait);
    assert!(resource.memory_waiters().unwrap().is_empty());
    for ptr in std::iter::once(got).chain(blocks[1..].iter().copied()) {
        // SAFETY: each allocated above with 256 KiB on `s`, unused, freed once.
        unsafe { resource.deallocate(ptr, 256 * KIB, &s) }.unwrap();
    }
    s.synchronize_blocking().unwrap();
    assert_eq!(resource.allocated_bytes(), 0);
}

/// A waiting request that is dropped leaves the queue, and the next free finds nobody; an
/// all-or-nothing set waits too, and one larger than the maximum fails at once.
#[test]
fn cuda_async_cancelled_waits_leave_nothing_and_sets_wait_or_fail_at_once() {
    let (_device, resource, s, blocks) = full_async_resource();
    let (_flag, waker) = flag();
    let mut cx = Context::from_waker(&waker);
    let mut wait = Box::pin(resource.allocate_async(256 * KIB, &s));
    assert!(wait.as_mut().poll(&mut cx).is_pending());
    drop(wait);
    let waiters = resource.memory_waiters().expect("a queue of waiters");
    assert!(waiters.is_empty(), "the cancelled wait stayed queued");
    assert_eq!(waiters.stats().bytes_waiting, 0);

    // A set of five 256 KiB blocks can never fit in 1 MiB: at once, with the numbers.
    let mut five = Box::pin(resource.allocate_all_async((0..5).map(|_| (256 * KIB, &s))));
    match five.as_mut().poll(&mut cx) {
        Poll::Ready(Err(Error::OutOfMemory {
            requested, maximum, ..
        })) => assert_eq!((requested, maximum), (5 * 256 * KIB, MIB)),
        other => panic!("a set over the maximum gave {other:?}"),
    }
    drop(five);

    // A set of two waits until two blocks come back, holding nothing meanwhile.
    let (flag, waker) = flag();
    let mut cx = Context::from_waker(&waker);
    let mut two = Box::pin(resource.allocate_all_async((0..2).map(|_| (256 * KIB, &s))));
    assert!(two.as_mut().poll(&mut cx).is_pending());
    assert_eq!(
        resource.allocated_bytes(),
        MIB,
        "the waiting set holds memory"
    );
    for &ptr in &blocks[..2] {
        // SAFETY: allocated above with 256 KiB on `s`, unused, freed once.
        unsafe { resource.deallocate(ptr, 256 * KIB, &s) }.unwrap();
    }
    assert!(flag.0.load(Ordering::SeqCst), "the frees woke nobody");
    let got = match two.as_mut().poll(&mut cx) {
        Poll::Ready(Ok(ptrs)) => ptrs,
        other => panic!("the set was not served: {other:?}"),
    };
    drop(two);
    assert!(waiters.is_empty());
    for ptr in got.into_iter().chain(blocks[2..].iter().copied()) {
        // SAFETY: each allocated above with 256 KiB on `s`, unused, freed once.
        unsafe { resource.deallocate(ptr, 256 * KIB, &s) }.unwrap();
    }
    s.synchronize_blocking().unwrap();
    assert_eq!(resource.allocated_bytes(), 0);
}

/// With no maximum of its own the resource runs out when the device does; memory freed
/// through it comes back to the driver pool once the stream reaches the free, and a waiting
/// request must be served then (not only woken when the free is issued, before the memory is
/// there, and left asleep after: a review's first fix did that, and this test hung until the
/// wait's deadline). The device's delay before each operation makes the free reach the pool
/// after the try that the free's first notification woke, as it mostly is on a GPU; the test
/// passes either way, it only shows the second path more often.
#[test]
fn cuda_async_allocate_async_waits_for_device_memory_freed_through_it() {
    let device = Device::simulated(SimConfig {
        total_memory: 64 * MIB,
        op_delay: std::time::Duration::from_millis(20),
        ..SimConfig::default()
    });
    let resource = CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap();
    let s = device.create_stream().unwrap();
    let other = device.create_stream().unwrap();
    let mut blocks = fill_device(&resource, &s);
    let rt = common::runtime();
    let (_flag, waker) = flag();
    let mut cx = Context::from_waker(&waker);
    // Waits on another stream than the free's: reuse there needs the stream to reach the free.
    let mut wait = Box::pin(
        resource
            .allocate_async(8 * MIB, &other)
            .timeout(std::time::Duration::from_secs(30)),
    );
    assert!(wait.as_mut().poll(&mut cx).is_pending(), "did not wait");
    let last = blocks.pop().unwrap();
    // SAFETY: allocated above with 8 MiB on `s`, unused, freed once.
    unsafe { resource.deallocate(last, 8 * MIB, &s) }.unwrap();
    // The try that the free's first notification wakes; mostly refused, the stream not there
    // yet (the test does not depend on it).
    if let Poll::Ready(r) = wait.as_mut().poll(&mut cx) {
        let got = r.expect("the woken waiter failed");
        give_back((&resource, got, &other), (&resource, blocks, &s));
        return;
    }
    let got = rt
        .block_on(wait)
        .expect("memory freed through the resource did not serve the waiter");
    assert!(resource.memory_waiters().unwrap().is_empty());
    give_back((&resource, got, &other), (&resource, blocks, &s));
}

/// A maximum that is not a multiple of 256 holds at most its multiple below (every size is
/// counted rounded up to 256): behind a waiter, a request of the maximum itself can never be
/// served, and must fail at once instead of queueing until its turn.
#[test]
fn cuda_async_behind_a_waiter_a_request_of_an_unaligned_maximum_fails_at_once() {
    let device = Device::simulated(SimConfig::default());
    let resource = CudaAsyncResource::new(
        &device,
        CudaAsyncOptions {
            maximum_pool_size: Some(1000),
            ..CudaAsyncOptions::default()
        },
    )
    .unwrap();
    let s = device.create_stream().unwrap();
    let held: Vec<DevicePtr> = (0..3)
        .map(|_| resource.allocate(256, &s).unwrap())
        .collect();
    let (_flag, waker) = flag();
    let mut cx = Context::from_waker(&waker);
    let mut wait = Box::pin(resource.allocate_async(256, &s));
    assert!(wait.as_mut().poll(&mut cx).is_pending());
    let mut hopeless = Box::pin(resource.allocate_async(1000, &s));
    match hopeless.as_mut().poll(&mut cx) {
        // The size counted (its footprint), as alone: 1,024.
        Poll::Ready(Err(Error::OutOfMemory { requested, .. })) => assert_eq!(requested, 1024),
        other => panic!("1,000 bytes (1,024 counted) under a maximum of 1,000 gave {other:?}"),
    }
    drop(hopeless);
    drop(wait);
    assert!(resource.memory_waiters().unwrap().is_empty());
    for ptr in held {
        // SAFETY: allocated above with 256 bytes on `s`, unused, freed once.
        unsafe { resource.deallocate(ptr, 256, &s) }.unwrap();
    }
    s.synchronize_blocking().unwrap();
}

/// Fills a simulated device of 64 MiB through `resource` with 8 MiB blocks on `s`; the blocks.
fn fill_device(resource: &CudaAsyncResource, s: &streamalloc::Stream) -> Vec<DevicePtr> {
    let mut blocks = Vec::new();
    let refused = loop {
        match resource.allocate(8 * MIB, s) {
            Ok(ptr) => blocks.push(ptr),
            Err(e) => break e,
        }
    };
    assert!(refused.is_out_of_memory(), "{refused:?}");
    assert!(!blocks.is_empty());
    blocks
}

/// Frees what a waiter got (8 MiB, from `got.0` on `got.2`) and the blocks that filled the
/// device (8 MiB each, from `blocks.0` on `blocks.2`), then waits for both streams.
fn give_back(
    got: (&CudaAsyncResource, DevicePtr, &streamalloc::Stream),
    blocks: (&CudaAsyncResource, Vec<DevicePtr>, &streamalloc::Stream),
) {
    // SAFETY: allocated by the caller with 8 MiB on that stream, unused, freed once.
    unsafe { got.0.deallocate(got.1, 8 * MIB, got.2) }.unwrap();
    for ptr in blocks.1 {
        // SAFETY: allocated by `fill_device` with 8 MiB on that stream, unused, freed once.
        unsafe { blocks.0.deallocate(ptr, 8 * MIB, blocks.2) }.unwrap();
    }
    blocks.2.synchronize_blocking().unwrap();
    got.2.synchronize_blocking().unwrap();
}

/// A free issued while nobody waits, whose stream is still busy (here a 300 ms spin before
/// it): a request that the driver refuses before the GPU reaches the free must be woken when
/// it does. Before the fix no event was recorded for such a free, and the request slept until
/// the next free or its deadline (here 10 s: it timed out).
#[test]
fn cuda_async_a_request_after_a_pending_free_is_woken_when_the_gpu_reaches_it() {
    let device = Device::simulated(SimConfig {
        total_memory: 64 * MIB,
        ..SimConfig::default()
    });
    let resource = CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap();
    let s = device.create_stream().unwrap();
    let other = device.create_stream().unwrap();
    let mut blocks = fill_device(&resource, &s);
    s.spin(std::time::Duration::from_millis(300)).unwrap();
    let last = blocks.pop().unwrap();
    // SAFETY: allocated above with 8 MiB on `s`, unused, freed once.
    unsafe { resource.deallocate(last, 8 * MIB, &s) }.unwrap();
    assert!(resource.memory_waiters().unwrap().is_empty());
    // Another stream, so the memory is reusable only once `s` reaches the free.
    let started = std::time::Instant::now();
    let got = common::runtime()
        .block_on(
            resource
                .allocate_async(8 * MIB, &other)
                .timeout(std::time::Duration::from_secs(10)),
        )
        .expect("the request slept through a free issued before it waited");
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    give_back((&resource, got, &other), (&resource, blocks, &s));
}

/// Two resources over the device's default pool: a request waiting in one must be woken by a
/// free through the other (the memory comes back to the one pool). Before the fix each had
/// its own queue that only its own frees woke, and the request slept until its deadline.
#[test]
fn cuda_async_a_free_through_one_view_wakes_a_waiter_of_another() {
    let device = Device::simulated(SimConfig {
        total_memory: 64 * MIB,
        ..SimConfig::default()
    });
    let a = CudaAsyncResource::default_pool(&device).unwrap();
    let b = CudaAsyncResource::default_pool(&device).unwrap();
    assert!(a.shares_pool_with(&b));
    let s = device.create_stream().unwrap();
    let other = device.create_stream().unwrap();
    let mut blocks = fill_device(&a, &s);
    let rt = common::runtime();
    let (_flag, waker) = flag();
    let mut cx = Context::from_waker(&waker);
    let mut wait = Box::pin(
        b.allocate_async(8 * MIB, &other)
            .timeout(std::time::Duration::from_secs(10)),
    );
    assert!(wait.as_mut().poll(&mut cx).is_pending(), "did not wait");
    let last = blocks.pop().unwrap();
    let started = std::time::Instant::now();
    // SAFETY: allocated above with 8 MiB on `s`, unused, freed once.
    unsafe { a.deallocate(last, 8 * MIB, &s) }.unwrap();
    let got = rt
        .block_on(wait)
        .expect("a free through one view did not wake the other's waiter");
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    give_back((&b, got, &other), (&a, blocks, &s));
}

/// A limiting adaptor over the driver pool, its limit above the device: a request the driver
/// refuses waits in the adaptor's queue, not the pool's. A free through the adaptor on a busy
/// stream (here a 300 ms spin before it), issued before the request waits or while it does,
/// must wake it when the GPU reaches the free, as it wakes the pool's own waiters. Before the
/// fix the pool neither counted the adaptor's waiters when a free was issued (no event for
/// them) nor heard of their arrival (no event behind the frees issued before it): the
/// request's try at the free's first wake was refused, and it slept until its deadline (10 s
/// here: it timed out).
#[test]
fn cuda_async_under_a_limit_a_waiter_is_woken_when_the_gpu_reaches_a_free() {
    for free_first in [true, false] {
        let device = Device::simulated(SimConfig {
            total_memory: 64 * MIB,
            ..SimConfig::default()
        });
        let pool = std::sync::Arc::new(
            CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap(),
        );
        let limited = LimitingAdaptor::new(pool.clone(), GIB);
        let s = device.create_stream().unwrap();
        let other = device.create_stream().unwrap();
        let mut blocks = Vec::new();
        let refused = loop {
            match limited.allocate(8 * MIB, &s) {
                Ok(ptr) => blocks.push(ptr),
                Err(e) => break e,
            }
        };
        assert!(refused.is_out_of_memory(), "{refused:?}");
        s.spin(std::time::Duration::from_millis(300)).unwrap();
        let last = blocks.pop().unwrap();
        let free = || {
            // SAFETY: allocated above with 8 MiB on `s`, unused, freed once.
            unsafe { limited.deallocate(last, 8 * MIB, &s) }.unwrap();
        };
        if free_first {
            free();
        }
        // Another stream, so the memory is reusable only once `s` reaches the free.
        let (_flag, waker) = flag();
        let mut cx = Context::from_waker(&waker);
        let mut wait = Box::pin(
            limited
                .allocate_async(8 * MIB, &other)
                .timeout(std::time::Duration::from_secs(10)),
        );
        assert!(wait.as_mut().poll(&mut cx).is_pending(), "did not wait");
        if !free_first {
            free();
        }
        let got = common::runtime().block_on(wait).unwrap_or_else(|e| {
            panic!("the waiter slept through a free (issued first: {free_first}): {e}")
        });
        // SAFETY: `got` was allocated with 8 MiB on `other`, the blocks with 8 MiB on `s`; all
        // unused, each freed once.
        unsafe {
            limited.deallocate(got, 8 * MIB, &other).unwrap();
            for ptr in blocks {
                limited.deallocate(ptr, 8 * MIB, &s).unwrap();
            }
        }
        s.synchronize_blocking().unwrap();
        other.synchronize_blocking().unwrap();
        assert!(limited.memory_waiters().unwrap().is_empty());
    }
}
