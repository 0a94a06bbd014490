//! Issue 19's buffer findings: frees ordered after every stream that used the memory, and the
//! staging blocks of host copies, on the error paths too (simulated device, fault injection).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{eventually, poll_once_and_drop, runtime};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{
    Device, DeviceBuffer, DeviceVec, Error, FaultKind, Faults, RaceDetection, SimConfig,
};

const MIB: usize = 1 << 20;

fn sim() -> (Device, Faults) {
    let faults = Faults::new();
    let device = Device::simulated(SimConfig {
        faults: faults.clone(),
        ..SimConfig::default()
    });
    (device, faults)
}

/// A pool that starts empty, so that each allocation grows a chunk that `trim` can give back.
fn pool(device: &Device) -> Arc<PoolResource<CudaResource>> {
    Arc::new(common::pool(device, 0, 64 * MIB))
}

/// Issue 19, finding 1: `DeviceVec::to_host(&self, b)` queues a copy on `b`; the vector's free
/// (on its own stream) must wait for it even when the future is dropped before the copy ran.
/// Before the fix the free went back to the pool at once, `trim` returned the chunk upstream,
/// and `b`'s copy read freed memory (`InvalidAddress` from `b`).
#[test]
fn a_dropped_copy_on_another_stream_holds_the_free() {
    let (device, _) = sim();
    let p = pool(&device);
    let a = device.create_stream().unwrap();
    let b = device.create_stream().unwrap();
    let v = DeviceVec::from_host(&p, &vec![5u32; 1 << 16], &a).unwrap(); // 256 KiB
    b.spin(Duration::from_millis(300)).unwrap();
    poll_once_and_drop(v.to_host(&b));
    drop(v);
    p.trim_blocking().unwrap();
    b.synchronize_blocking()
        .expect("b's copy ran on memory that was freed under it");
    a.synchronize_blocking().unwrap();
    common::assert_all_back_within(&p, Duration::from_secs(10), "all back");
    p.trim_blocking().unwrap();
    assert_eq!(p.stats().reserved, 0, "{:?}", p.stats());
}

/// The same with a future that failed after its copy was queued (the event after the copy could
/// not be recorded): the copy still runs, so the free must still wait for it.
#[test]
fn a_failed_copy_on_another_stream_holds_the_free() {
    let (device, faults) = sim();
    let rt = runtime();
    let p = pool(&device);
    let a = device.create_stream().unwrap();
    let b = device.create_stream().unwrap();
    let v = DeviceVec::from_host(&p, &vec![5u32; 1 << 16], &a).unwrap();
    b.spin(Duration::from_millis(300)).unwrap();
    // Record #1 orders `b` after `a`; #2 is the event after the copy on `b`.
    faults.fail_nth(FaultKind::Record, 2);
    let err = rt.block_on(v.to_host(&b)).unwrap_err();
    assert!(matches!(err, Error::Driver { .. }), "{err:?}");
    assert_eq!(faults.injected(FaultKind::Record), 1);
    drop(v);
    p.trim_blocking().unwrap();
    b.synchronize_blocking()
        .expect("b's copy ran on memory that was freed under it");
    common::assert_all_back_within(&p, Duration::from_secs(10), "all back");
}

/// And with a future that completed: nothing is pending, the free is immediate and the memory
/// comes back.
#[test]
fn a_completed_copy_on_another_stream_frees_normally() {
    let (device, _) = sim();
    let rt = runtime();
    let p = pool(&device);
    let a = device.create_stream().unwrap();
    let b = device.create_stream().unwrap();
    let v = DeviceVec::from_host(&p, &[1u16, 2, 3], &a).unwrap();
    assert_eq!(rt.block_on(v.to_host(&b)).unwrap(), [1, 2, 3]);
    drop(v);
    a.synchronize_blocking().unwrap();
    b.synchronize_blocking().unwrap();
    common::assert_all_back_within(&p, Duration::from_secs(10), "all back");
}

/// A buffer used on a busy stream `b` (a fill queued behind a spin), given up with
/// `into_raw_parts` while a fault makes the ordering fail.
fn into_raw_parts_with_fault(kind: FaultKind) {
    let (device, faults) = sim();
    let p = pool(&device);
    let a = device.create_stream().unwrap();
    let b = device.create_stream().unwrap();
    let mut buf = DeviceBuffer::new(&p, 256 * 1024, &a).unwrap();
    buf.record_stream(&b).unwrap();
    // A use on `b` must be ordered after the allocation on `a` (the race detector checks it).
    b.wait(&a.record().unwrap()).unwrap();
    b.spin(Duration::from_millis(300)).unwrap();
    // SAFETY: 64 Ki words of live memory; `b` is recorded on the buffer, so its free waits.
    unsafe { b.fill_u32(buf.as_ptr(), 7, 1 << 16) }.unwrap();
    faults.fail_next(kind);
    let err = buf.into_raw_parts().unwrap_err();
    assert!(matches!(err, Error::Driver { .. }), "{kind:?}: {err:?}");
    assert_eq!(faults.injected(kind), 1);
    // The buffer is gone (freed as a drop frees it): the free must still wait for `b`.
    p.trim_blocking().unwrap();
    b.synchronize_blocking()
        .unwrap_or_else(|e| panic!("{kind:?}: b's fill ran on freed memory: {e}"));
    common::assert_all_back_within(&p, Duration::from_secs(10), &format!("{kind:?}"));
    p.trim_blocking().unwrap();
    assert_eq!(p.stats().reserved, 0, "{kind:?}: {:?}", p.stats());
}

/// Issue 19: `into_raw_parts` took the other streams out before a record/wait that can fail,
/// then freed at once on its own stream: `b`'s fill hit memory trimmed upstream.
#[test]
fn into_raw_parts_keeps_stream_order_when_record_fails() {
    into_raw_parts_with_fault(FaultKind::Record);
}

/// As above, with the GPU-side wait failing.
#[test]
fn into_raw_parts_keeps_stream_order_when_wait_fails() {
    into_raw_parts_with_fault(FaultKind::Wait);
}

/// `into_raw_parts` without faults: the parts come back with every other use ordered before
/// their stream, and freeing them there is safe.
#[test]
fn into_raw_parts_orders_other_streams_before_its_stream() {
    let (device, _) = sim();
    let p = pool(&device);
    let a = device.create_stream().unwrap();
    let b = device.create_stream().unwrap();
    let mut buf = DeviceBuffer::new(&p, 4096, &a).unwrap();
    buf.record_stream(&b).unwrap();
    // A use on `b` must be ordered after the allocation on `a` (the race detector checks it).
    b.wait(&a.record().unwrap()).unwrap();
    b.spin(Duration::from_millis(50)).unwrap();
    // SAFETY: 1 Ki words of live memory, `b` recorded on the buffer.
    unsafe { b.fill_u32(buf.as_ptr(), 3, 1024) }.unwrap();
    let (ptr, len, resource, stream) = buf.into_raw_parts().unwrap();
    assert_eq!((len, stream.id()), (4096, a.id()));
    // SAFETY: the parts of a buffer, taken back whole.
    let buf = unsafe { DeviceBuffer::from_raw_parts(ptr, len, resource, &stream) };
    let rt = runtime();
    let host = rt.block_on(buf.to_host()).unwrap();
    assert!(host.chunks(4).all(|w| w == 3u32.to_ne_bytes()));
    drop(buf);
    common::assert_all_back_within(&p, Duration::from_secs(10), "all back");
}

/// Issue 19: a copy to the host whose event could not be recorded gave its staging block back
/// to the cache while the copy into it was still queued; the next copy from the host staged its
/// data in the same block, and the late copy overwrote it (the second vector read back the
/// first one's data).
#[test]
fn a_failed_record_after_a_copy_out_keeps_its_staging_block() {
    let (device, faults) = sim();
    let rt = runtime();
    let p = pool(&device);
    let s = device.create_stream().unwrap();
    let v = DeviceVec::from_host(&p, &vec![3u32; 1 << 16], &s).unwrap();
    s.synchronize_blocking().unwrap();
    s.spin(Duration::from_millis(200)).unwrap();
    faults.fail_next(FaultKind::Record);
    let err = rt.block_on(v.to_host(&s)).unwrap_err();
    assert!(matches!(err, Error::Driver { .. }), "{err:?}");
    // Queued on `s` behind that copy: staged through a block of the same size.
    let w = DeviceVec::from_host(&p, &vec![9u32; 1 << 16], &s).unwrap();
    assert!(
        rt.block_on(w.to_host(&s)).unwrap().iter().all(|&x| x == 9),
        "the staging block was reused while a copy into it was queued"
    );
    assert!(rt.block_on(v.to_host(&s)).unwrap().iter().all(|&x| x == 3));
}

/// As above, with every record failing: the block cannot be given back safely and is kept out
/// of the cache (leaked); later copies still see their own data.
#[test]
fn a_copy_out_that_cannot_be_fenced_never_recycles_its_block() {
    let (device, faults) = sim();
    let rt = runtime();
    let p = pool(&device);
    let s = device.create_stream().unwrap();
    let v = DeviceVec::from_host(&p, &vec![3u32; 1 << 16], &s).unwrap();
    s.synchronize_blocking().unwrap();
    s.spin(Duration::from_millis(200)).unwrap();
    faults.fail_always(FaultKind::Record);
    assert!(rt.block_on(v.to_host(&s)).is_err());
    faults.clear();
    let w = DeviceVec::from_host(&p, &vec![9u32; 1 << 16], &s).unwrap();
    assert!(rt.block_on(w.to_host(&s)).unwrap().iter().all(|&x| x == 9));
}

/// The same for a copy *to* the device whose event could not be recorded: its block must not be
/// reused while the copy out of it is still queued.
#[test]
fn a_failed_record_after_a_copy_in_keeps_its_staging_block() {
    let (device, faults) = sim();
    let rt = runtime();
    let p = pool(&device);
    let s = device.create_stream().unwrap();
    let mut v = DeviceVec::<u32>::new(&p, 1 << 16, &s).unwrap();
    s.spin(Duration::from_millis(200)).unwrap();
    faults.fail_next(FaultKind::Record);
    assert!(v.copy_from_host(&vec![3u32; 1 << 16]).is_err());
    // The copy was queued; it carries 3s whatever happens next to its block.
    let w = DeviceVec::from_host(&p, &vec![9u32; 1 << 16], &s).unwrap();
    assert!(rt.block_on(v.to_host(&s)).unwrap().iter().all(|&x| x == 3));
    assert!(rt.block_on(w.to_host(&s)).unwrap().iter().all(|&x| x == 9));
}

/// Issue 19: a staging block returned when the device's cache (64 MiB) is full was freed with
/// `cuMemFreeHost` from the completion callback, on the reactor thread. Every host free is
/// made to fail here, so each attempt is counted: none may happen while only the reactor has
/// run, and the next copy on a host thread frees the block.
#[test]
fn staging_blocks_over_the_cache_are_freed_off_the_reactor() {
    let (device, faults) = sim();
    let p = Arc::new(
        PoolResource::new(
            CudaResource::new(&device),
            PoolOptions {
                initial: 0,
                maximum: Some(128 * MIB),
                ..PoolOptions::default()
            },
        )
        .unwrap(),
    );
    let s = device.create_stream().unwrap();
    let mut big = DeviceBuffer::new(&p, 64 * MIB, &s).unwrap();
    let mut small = DeviceBuffer::new(&p, 4096, &s).unwrap();
    let mut other = DeviceBuffer::new(&p, 8192, &s).unwrap();
    let idle = device.handle_count();
    s.spin(Duration::from_millis(100)).unwrap();
    // Two blocks in flight at once: 64 MiB fills the cache, the 4 KiB one is over it.
    big.copy_from_host(&vec![1u8; 64 * MIB]).unwrap();
    small.copy_from_host(&[2u8; 4096]).unwrap();
    faults.fail_always(FaultKind::HostFree);
    // Nobody awaits the copies' events: only the reactor sees them complete and runs the
    // callbacks that give the blocks back (each holds a device handle until it has run).
    assert!(
        eventually(Duration::from_secs(10), || device.handle_count() == idle),
        "the staging callbacks never ran"
    );
    assert_eq!(
        faults.injected(FaultKind::HostFree),
        0,
        "a staging block was freed on the reactor thread"
    );
    // The next staging call on a host thread frees it (a 8 KiB block: another size class).
    other.copy_from_host(&[3u8; 8192]).unwrap();
    assert_eq!(faults.injected(FaultKind::HostFree), 1);
    faults.clear();
    s.synchronize_blocking().unwrap();
}

/// Every API that queues work on a stream other than the memory's own: the copy onto another
/// stream (`try_clone_to`, issue 20's API) reads the source on the target stream, so the
/// source's free waits for it. With the target stream busy, the source dropped and its pool
/// trimmed at once, the copy must still read live memory and get the source's bytes.
#[test]
fn a_copy_onto_a_busy_stream_holds_the_source_free() {
    let (device, _) = sim();
    let rt = runtime();
    let src_pool = pool(&device);
    let dst_pool = pool(&device);
    let a = device.create_stream().unwrap();
    let b = device.create_stream().unwrap();
    let v = DeviceVec::from_host(&src_pool, &vec![6u32; 1 << 16], &a).unwrap();
    let mut buf = DeviceBuffer::new(&src_pool, 4096, &a).unwrap();
    buf.memset(4).unwrap();
    b.spin(Duration::from_millis(300)).unwrap();
    let w = v.try_clone_to(&dst_pool, &b).unwrap();
    let c = buf.try_clone_to(&dst_pool, &b).unwrap();
    drop((v, buf));
    a.synchronize_blocking().unwrap();
    src_pool.trim_blocking().unwrap();
    b.synchronize_blocking()
        .expect("b's copy ran on memory that was freed under it");
    assert!(rt.block_on(w.to_host(&b)).unwrap().iter().all(|&x| x == 6));
    assert!(rt.block_on(c.to_host()).unwrap().iter().all(|&x| x == 4));
    common::assert_all_back_within(&src_pool, Duration::from_secs(10), "the source pool");
}

/// The other direction: a read queued on another stream by a method that takes `&self` must
/// come before the writes queued on the memory's own stream once the borrow ends. A review
/// found `DeviceVec::to_host(&b)`, dropped before its copy ran, and then the safe
/// `copy_from_host` on the vector's stream, writing the memory while `b`'s read was unordered
/// with it; and the same after `set_stream` to a third stream (ordered after the old stream
/// only). The race detector, recording, sees every unordered pair.
#[test]
fn a_dropped_read_on_another_stream_comes_before_later_writes() {
    for move_first in [false, true] {
        let device = Device::simulated(SimConfig {
            race_detection: RaceDetection::Record,
            ..SimConfig::default()
        });
        let p = pool(&device);
        let (a, b, c) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let mut v = DeviceVec::from_host(&p, &[1u32; 1024], &a).unwrap();
        b.spin(Duration::from_millis(200)).unwrap();
        poll_once_and_drop(v.to_host(&b));
        if move_first {
            v.set_stream(&c).unwrap();
        }
        v.copy_from_host(&[2u32; 1024]).unwrap();
        for s in [&a, &b, &c] {
            s.synchronize_blocking().unwrap();
        }
        let races = device.take_races();
        assert!(
            races.is_empty(),
            "set_stream first: {move_first}: {races:#?}"
        );
    }
}

/// `record_stream` promises that the buffer's free waits for the work queued on the recorded
/// stream up to the drop. A reallocation (`resize` past the capacity, `reserve`,
/// `shrink_to_fit`) moves the buffer to new memory; the recorded streams must come along, or
/// a kernel on the recorded stream that uses the buffer after the resize (ordered after its
/// stream, as for any use) is not waited for: the memory is handed out again on the buffer's
/// stream at the drop while that kernel still runs.
#[test]
fn recorded_streams_survive_a_reallocation() {
    for how in ["resize", "reserve", "shrink_to_fit"] {
        let device = Device::simulated(SimConfig {
            race_detection: RaceDetection::Record,
            ..SimConfig::default()
        });
        let p = pool(&device);
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let mut buf = DeviceBuffer::new(&p, 4096, &a).unwrap();
        buf.memset(1).unwrap();
        buf.record_stream(&b).unwrap();
        match how {
            "resize" => buf.resize(8192).unwrap(),
            "reserve" => buf.reserve(8192).unwrap(),
            _ => {
                buf.resize(1024).unwrap();
                buf.shrink_to_fit().unwrap();
            }
        }
        // A use on `b` of the (new) memory, ordered after `a` as the caller must.
        b.wait(&a.record().unwrap()).unwrap();
        b.spin(Duration::from_millis(200)).unwrap();
        // SAFETY: `buf.len()` live bytes, used on `b` after `a`'s work; `b` is recorded as a
        // use of the buffer, so its free waits for this fill.
        unsafe { b.memset_d8(buf.as_ptr(), 2, buf.len()) }.unwrap();
        drop(buf);
        // The same stream gets freed memory back at once: it must not be `b`'s.
        let mut next = DeviceBuffer::new(&p, 8192, &a).unwrap();
        next.memset(3).unwrap();
        for s in [&a, &b] {
            s.synchronize_blocking().unwrap();
        }
        let races = device.take_races();
        assert!(races.is_empty(), "after {how}: {races:#?}");
        drop(next);
    }
}
