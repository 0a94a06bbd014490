//! Review of the stream layer (`src/stream/`, `src/event.rs`): each test failed before the fix
//! its commit names.

mod common;

use common::faulty;
use streamalloc::{Device, DevicePtr, Error, FaultKind, SimConfig};

/// `Stream::synchronize_blocking` on the simulated device is `cuStreamSynchronize`, which
/// records no event on a GPU: a fault planted for the next `cuEventRecord` must not fail it, nor
/// be used up by it (it was: the simulated path recorded an event through `Stream::record`, so
/// the synchronize failed with "cuEventRecord" and the record the test aimed at succeeded).
#[test]
fn synchronize_blocking_is_no_event_record() {
    let (device, faults) = faulty();
    let stream = device.create_stream().unwrap();
    stream.spin(std::time::Duration::from_millis(1)).unwrap();
    faults.fail_next(FaultKind::Record);
    stream
        .synchronize_blocking()
        .expect("cuStreamSynchronize records no event: a planted record fault is not its");
    assert_eq!(faults.injected(FaultKind::Record), 0);
    let err = stream.record().unwrap_err();
    assert!(
        matches!(
            err,
            Error::Driver {
                call: "cuEventRecord",
                ..
            }
        ),
        "the planted fault fails the next record: {err}"
    );
    // A fault planted for the synchronize still fails it.
    faults.fail_next(FaultKind::Synchronize);
    assert!(stream.synchronize_blocking().is_err());
    stream.synchronize_blocking().unwrap();
}

/// A range whose end wraps past the top of the address space is refused at the call with
/// `InvalidAddress`, by every memset, copy and kernel: before, each was queued, the simulated
/// stream failed when it reached it (poisoning every later event of the stream), and on CUDA
/// the driver or the kernel was handed a wrapping range.
#[test]
fn wrapping_ranges_are_refused_at_the_call() {
    let device = Device::simulated(SimConfig::default());
    let stream = device.create_stream().unwrap();
    let good = device.malloc(64).unwrap();
    let top = DevicePtr(u64::MAX - 7); // 8-aligned, 8 bytes below the top
    let mut host = [0u8; 64];
    let refused = |what: &str, r: streamalloc::Result<()>| match r {
        Err(Error::InvalidAddress { .. }) => {}
        other => panic!("{what}: {other:?}, not InvalidAddress"),
    };
    // SAFETY: none of these may reach memory: each range wraps, and is refused at the call
    // (before the fix, the simulated device's stream refused it when it got there: it checks
    // every device address against its allocations and touches no host memory for them).
    unsafe {
        refused("memset_d8", stream.memset_d8(top, 0, 16));
        refused("memset_d32", stream.memset_d32(top, 0, 4));
        refused("copy_htod", stream.copy_htod(top, host.as_ptr(), 16));
        refused("copy_dtoh", stream.copy_dtoh(host.as_mut_ptr(), top, 16));
        refused("copy_dtod to", stream.copy_dtod(top, good, 16));
        refused("copy_dtod from", stream.copy_dtod(good, top, 16));
        refused("copy_peer", stream.copy_peer(top, good, &device, 16));
        refused("prefetch", stream.prefetch(top, 16));
        refused("fill_u32", stream.fill_u32(top, 1, 4));
        refused("scale_f32", stream.scale_f32(top, 2.0, 4));
        refused("fill_pattern_u32", stream.fill_pattern_u32(top, 1, 4));
        refused(
            "count_mismatches_u32 src",
            stream.count_mismatches_u32(top, 1, 4, good),
        );
        refused(
            "count_mismatches_u32 counter",
            stream.count_mismatches_u32(good, 1, 4, top),
        );
        // Zero bytes are no memory at any address (CUDA takes them as no-ops).
        stream.memset_d8(top, 0, 0).unwrap();
        stream.copy_dtod(top, top, 0).unwrap();
    }
    // Nothing was queued: the stream is not poisoned.
    stream.synchronize_blocking().unwrap();
    stream.record().unwrap().synchronize_blocking().unwrap();
    host.fill(0);
    // SAFETY: `good` is 64 live bytes, `host` outlives the synchronize below.
    unsafe {
        stream.memset_d8(good, 7, 64).unwrap();
        stream.copy_dtoh(host.as_mut_ptr(), good, 64).unwrap();
    }
    stream.synchronize_blocking().unwrap();
    assert_eq!(host, [7u8; 64]);
    // SAFETY: no work uses it any more.
    unsafe { device.free(good).unwrap() };
}
