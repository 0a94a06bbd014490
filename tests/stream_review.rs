//! Review of the stream layer (`src/stream/`, `src/event.rs`): each test failed before the fix
//! its commit names.

use streamalloc::{Device, Error, FaultKind, Faults, SimConfig};

fn faulty() -> (Device, Faults) {
    let faults = Faults::new();
    let device = Device::simulated(SimConfig {
        faults: faults.clone(),
        ..SimConfig::default()
    });
    (device, faults)
}

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
