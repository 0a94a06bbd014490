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
use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::cuda_async::CudaAsyncOptions;
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{
    CudaAsyncResource, Device, ExpandableOptions, ExpandablePoolResource, FaultKind,
    MemoryResource, SimConfig,
};

// Each test that fills the device takes turns (`common::take_turns`).

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
