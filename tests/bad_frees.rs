//! Issue 16: frees that name memory the resource did not hand out, on every suballocating
//! resource. Before the fix, a pool of 64 MiB accepted a pointer inside its chunk that it never
//! handed out (a live block's address plus 1 MiB) and a 4 KiB block freed with a size of 1 MiB,
//! and then reported `two lists share memory`: it would have handed the same memory out twice.
//! Each bad free must be refused with `UnknownPointer`, change nothing, and leave the resource
//! serving good frees (on the same stream and on another one) and its invariants intact.
//!
//! Also the frees of the device itself (`cuMemFree`, `cuMemFreeAsync`) on the simulated device,
//! which queues them on a stream: a second free of a pointer whose first free has not run yet
//! must be refused at the call, as the driver refuses it, not fail later on the stream.

mod common;

use std::time::Duration;

use common::{check_arena, devices, free, label, pool, read_u32};
use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
use streamalloc::resource::binning::BinningResource;
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::cuda_async::{CudaAsyncOptions, CudaAsyncResource};
use streamalloc::resource::fixed_size::FixedSizeResource;
use streamalloc::resource::managed::ManagedResource;
use streamalloc::{Device, DevicePtr, Error, MemoryResource, SimConfig, Stream};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// Asserts that `resource` refuses to free `bytes` at `ptr` on `stream`.
fn refused<R: MemoryResource + ?Sized>(
    resource: &R,
    ptr: DevicePtr,
    bytes: usize,
    stream: &Stream,
    what: &str,
) {
    // SAFETY: a deliberately bad free: the resource must refuse it without touching memory.
    let result = unsafe { resource.deallocate(ptr, bytes, stream) };
    assert!(
        matches!(result, Err(Error::UnknownPointer { .. })),
        "{what}: freeing {bytes} bytes at {:#x} gave {result:?}",
        ptr.0
    );
}

/// The bad frees of the issue and their neighbours, then good frees on two streams. `check`
/// runs the resource's invariant checker; `small` and `large` are sizes it serves, which it
/// tells apart (a fixed-size resource does not: every size up to its block is its block).
fn bad_frees_are_refused<R: MemoryResource + ?Sized>(
    resource: &R,
    device: &Device,
    (small, large): (usize, usize),
    check: &dyn Fn(&str),
) {
    let s = device.create_stream().unwrap();
    let t = device.create_stream().unwrap();
    let a = resource.allocate(small, &s).unwrap();
    let b = resource.allocate(large, &s).unwrap();
    let c = resource.allocate(small, &t).unwrap();
    check("after the allocations");

    // A pointer inside the resource's memory that it never handed out.
    refused(resource, a.offset(MIB), 256, &s, "a live block + 1 MiB");
    refused(
        resource,
        a.offset(MIB),
        256,
        &t,
        "a live block + 1 MiB, another stream",
    );
    // A live block freed with the wrong size.
    if small != large {
        refused(resource, a, large, &s, "a small block freed as a large one");
        refused(resource, b, small, &s, "a large block freed as a small one");
    }
    refused(resource, a, 2 * MIB, &t, "a small block freed as 2 MiB");
    // A pointer inside a live block.
    refused(resource, b.offset(256), 256, &s, "inside a live block");
    refused(
        resource,
        b.offset(512),
        small,
        &t,
        "inside a live block, another stream",
    );
    check("after the bad frees");

    // Good frees still work, on the block's stream and on another; then a second free of each
    // is refused.
    free(resource, a, small, &s);
    free(resource, b, large, &t);
    free(resource, c, small, &s);
    refused(resource, a, small, &s, "a double free");
    refused(resource, b, large, &s, "a double free, another stream");
    check("after the good frees");
    s.synchronize_blocking().unwrap();
    t.synchronize_blocking().unwrap();

    // And the memory is served again.
    let d = resource.allocate(large, &s).unwrap();
    free(resource, d, large, &s);
    check("at the end");
}

#[test]
fn the_pool_refuses_frees_of_memory_it_did_not_hand_out() {
    for device in devices() {
        let what = label(&device);
        let pool = pool(&device, 64 * MIB, 64 * MIB);
        bad_frees_are_refused(&pool, &device, (4 * KIB, MIB), &|when| {
            pool.check_invariants()
                .unwrap_or_else(|e| panic!("{what}: {when}: {e}"));
        });
        let stats = pool.stats();
        assert_eq!(stats.free, stats.reserved, "{what}: {stats:?}");
        assert_eq!(stats.in_use, 0, "{what}: {stats:?}");
        // A refused free on a stream the pool never saw leaves no trace of that stream.
        let s = device.create_stream().unwrap();
        let x = pool.allocate(4 * KIB, &s).unwrap();
        let streams = pool.stats().streams;
        let new = device.create_stream().unwrap();
        refused(
            &pool,
            x.offset(256),
            256,
            &new,
            "inside a live block, a new stream",
        );
        assert_eq!(
            pool.stats().streams,
            streams,
            "{what}: the refused free's stream"
        );
        free(&pool, x, 4 * KIB, &s);
    }
}

#[test]
fn the_fixed_size_resource_refuses_frees_of_memory_it_did_not_hand_out() {
    for device in devices() {
        let what = label(&device);
        let fixed = FixedSizeResource::new(CudaResource::new(&device), 4 * KIB, 1024).unwrap();
        bad_frees_are_refused(&fixed, &device, (4 * KIB, 4 * KIB), &|when| {
            fixed
                .check_invariants()
                .unwrap_or_else(|e| panic!("{what}: {when}: {e}"));
        });
    }
}

#[test]
fn the_binning_resource_refuses_frees_of_memory_it_did_not_hand_out() {
    for device in devices() {
        let upstream = pool(&device, 64 * MIB, 64 * MIB);
        // Bins of 2^12..2^16 bytes; 1 MiB goes to the pool upstream.
        let binning = BinningResource::new(upstream, 12, 16).unwrap();
        bad_frees_are_refused(&binning, &device, (4 * KIB, MIB), &|_| {});
        binning
            .upstream()
            .check_invariants()
            .unwrap_or_else(|e| panic!("{}: {e}", label(&device)));
    }
}

#[test]
fn the_arena_refuses_frees_of_memory_it_did_not_hand_out() {
    for device in devices() {
        let arena = ArenaResource::new(
            CudaResource::new(&device),
            ArenaOptions {
                initial: 16 * MIB,
                maximum: Some(16 * MIB),
                ..ArenaOptions::default()
            },
        )
        .unwrap();
        bad_frees_are_refused(&arena, &device, (4 * KIB, MIB), &|_| check_arena(&arena));
    }
}

// ===== the device's own frees, queued on a stream =====
//
// Simulated only: on a GPU the second free is the driver's to refuse (with its own error), and a
// deliberate double free is not something to do to a real driver pool.

/// Keeps `stream` busy long enough that the frees queued behind this are still queued when the
/// test issues the next one.
fn keep_busy(stream: &Stream) {
    stream.spin(Duration::from_millis(200)).unwrap();
}

/// `stream` is not poisoned: new work queued on it runs (`ptr` is filled and read back) and its
/// synchronize succeeds.
fn still_usable(stream: &Stream, ptr: DevicePtr, what: &str) {
    // SAFETY: `ptr` is a live allocation of at least 1 KiB, used only on `stream`.
    unsafe { stream.fill_u32(ptr, 7, 256) }.unwrap();
    assert!(
        read_u32(stream, ptr, 256).iter().all(|&w| w == 7),
        "{what}: the stream skipped the fill"
    );
    stream
        .synchronize_blocking()
        .unwrap_or_else(|e| panic!("{what}: the stream is poisoned: {e}"));
}

#[test]
fn cuda_resource_refuses_a_second_free_queued_before_the_first_ran_and_the_stream_goes_on() {
    let device = Device::simulated(SimConfig::default());
    let stream = device.create_stream().unwrap();
    let mr = CudaResource::new(&device);
    let free_before = device.free_memory().unwrap();
    let ptr = mr.allocate(4 * KIB, &stream).unwrap();
    keep_busy(&stream);
    free(&mr, ptr, 4 * KIB, &stream);
    refused(&mr, ptr, 4 * KIB, &stream, "the first free still queued");
    let other = mr.allocate(4 * KIB, &stream).unwrap();
    still_usable(&stream, other, "after the refused free");
    // The first free ran, once: a third free is refused too, and the memory is back.
    refused(&mr, ptr, 4 * KIB, &stream, "a free after the first ran");
    free(&mr, other, 4 * KIB, &stream);
    stream.synchronize_blocking().unwrap();
    assert_eq!(device.free_memory().unwrap(), free_before);
}

#[test]
fn free_async_refuses_a_second_free_queued_before_the_first_ran_and_the_stream_goes_on() {
    let device = Device::simulated(SimConfig::default());
    let stream = device.create_stream().unwrap();
    let ptr = device.malloc_async(4 * KIB, &stream).unwrap();
    keep_busy(&stream);
    // SAFETY: allocated above, unused, freed once here.
    unsafe { device.free_async(ptr, &stream) }.unwrap();
    // SAFETY: a deliberate double free: refused without touching anything.
    let second = unsafe { device.free_async(ptr, &stream) };
    assert!(
        matches!(second, Err(Error::UnknownPointer { .. })),
        "a double free_async, the first still queued: {second:?}"
    );
    let other = device.malloc_async(4 * KIB, &stream).unwrap();
    still_usable(&stream, other, "after the refused free_async");
    // SAFETY: allocated above, its last use ordered before this point of `stream`.
    unsafe { device.free_async(other, &stream) }.unwrap();
    stream.synchronize_blocking().unwrap();
}

#[test]
fn cuda_async_resource_refuses_a_second_free_queued_before_the_first_ran_and_keeps_its_maximum() {
    let device = Device::simulated(SimConfig::default());
    let stream = device.create_stream().unwrap();
    let mr = CudaAsyncResource::new(
        &device,
        CudaAsyncOptions {
            maximum_pool_size: Some(4 * KIB),
            ..Default::default()
        },
    )
    .unwrap();
    let a = mr.allocate(KIB, &stream).unwrap();
    let b = mr.allocate(KIB, &stream).unwrap();
    keep_busy(&stream);
    free(&mr, a, KIB, &stream);
    refused(&mr, a, KIB, &stream, "the first free still queued");
    // The refused free counted nothing back: `b` is still counted, so the maximum holds.
    assert_eq!(mr.allocated_bytes(), KIB);
    let over = mr.allocate(4 * KIB, &stream);
    assert!(
        matches!(over, Err(Error::OutOfMemory { .. })),
        "4 KiB with 1 KiB live under a 4 KiB maximum: {over:?}"
    );
    let c = mr.allocate(3 * KIB, &stream).unwrap();
    still_usable(&stream, c, "after the refused free");
    refused(&mr, a, KIB, &stream, "a free after the first ran");
    free(&mr, b, KIB, &stream);
    free(&mr, c, 3 * KIB, &stream);
    stream.synchronize_blocking().unwrap();
    assert_eq!(mr.allocated_bytes(), 0);
    assert_eq!(mr.used_bytes().unwrap(), 0);
}

/// `Device::free` and `free_async` of the base of a reserved virtual range (an expandable
/// pool's, whose first block is handed out there): the driver refuses `cuMemFree` of a VMM
/// range, and so must the simulated device. A review found it taking the reservation out of
/// its table and its whole size out of the memory in use: 17.7 GB free on a 16 GiB device
/// (release), an overflow panic (debug).
#[test]
fn the_simulated_device_refuses_to_free_a_reservation() {
    use streamalloc::{ExpandableOptions, ExpandablePoolResource};
    let device = Device::simulated(SimConfig::default());
    let total = device.total_memory();
    let pool = ExpandablePoolResource::new(
        &device,
        ExpandableOptions {
            reserve: Some(64 * MIB),
            ..ExpandableOptions::default()
        },
    )
    .unwrap();
    let stream = device.create_stream().unwrap();
    let p = pool.allocate(4 * KIB, &stream).unwrap();
    let (base, _) = pool.reservation();
    let free_before = device.free_memory().unwrap();
    // SAFETY: deliberately wrong input: not a pointer from `malloc`; it must be refused.
    let now = unsafe { device.free(base) };
    assert!(
        matches!(now, Err(Error::InvalidAddress { .. })),
        "free of a reservation's base: {now:?}"
    );
    // SAFETY: as above.
    let queued = unsafe { device.free_async(base, &stream) };
    assert!(
        matches!(queued, Err(Error::UnknownPointer { .. })),
        "free_async of a reservation's base: {queued:?}"
    );
    stream.synchronize_blocking().unwrap();
    let free_after = device.free_memory().unwrap();
    assert!(
        free_after == free_before && free_after <= total,
        "free memory {free_before} before, {free_after} after, of {total}"
    );
    // The pool's memory is still there and usable.
    free(&pool, p, 4 * KIB, &stream);
    let q = pool.allocate(4 * KIB, &stream).unwrap();
    free(&pool, q, 4 * KIB, &stream);
    pool.check_invariants().unwrap();
}

/// `ManagedResource` counts what it handed out to refuse allocations that would oversubscribe
/// the device. A review found `deallocate` trusting the size it is given: a free with a wrong
/// size (or of a pointer of another resource of the device) went to the driver and moved the
/// count by that size, so the check let through what it is there to refuse. It now keeps a
/// table as `CudaAsyncResource` does, refuses such frees with `UnknownPointer` before the
/// driver, and counts back the allocation's own size.
#[test]
fn the_managed_resource_refuses_frees_of_memory_it_did_not_hand_out_and_keeps_its_count() {
    let device = Device::simulated(SimConfig {
        total_memory: 64 * MIB,
        ..SimConfig::default()
    });
    let mr = ManagedResource::new(&device);
    bad_frees_are_refused(&mr, &device, (64 * KIB, MIB), &|_| {});
    assert_eq!(mr.outstanding_bytes(), 0);

    let s = device.create_stream().unwrap();
    let a = mr.allocate(40 * MIB, &s).unwrap();
    let mut others = Vec::new();
    // Another resource's allocation of the same device: not this resource's to free.
    let theirs = CudaResource::new(&device).allocate(MIB, &s).unwrap();
    refused(&mr, theirs, MIB, &s, "another resource's allocation");
    // A wrong size, larger and smaller.
    refused(&mr, a, 60 * MIB, &s, "40 MiB freed as 60 MiB");
    refused(&mr, a, MIB, &s, "40 MiB freed as 1 MiB");
    assert_eq!(
        mr.outstanding_bytes(),
        40 * MIB,
        "a refused free moved the count"
    );
    // The count still refuses what would take it past the device.
    let over = mr.allocate(30 * MIB, &s);
    assert!(
        matches!(over, Err(Error::OutOfMemory { .. })),
        "30 MiB more beside 40 MiB on a 64 MiB device: {over:?}"
    );
    others.push(mr.allocate(8 * MIB, &s).unwrap());
    // A size that rounds to the allocation's is its size.
    free(&mr, a, 40 * MIB - 100, &s);
    refused(&mr, a, 40 * MIB, &s, "a double free");
    for ptr in others {
        free(&mr, ptr, 8 * MIB, &s);
    }
    free(&CudaResource::new(&device), theirs, MIB, &s);
    s.synchronize_blocking().unwrap();
    assert_eq!(mr.outstanding_bytes(), 0);
}
