//! `ManagedResource`: more than the device holds, untouched allocations on a small device.

use super::*;

#[test]
fn managed_refuses_more_than_the_device_can_hold() {
    for device in devices() {
        let what = label(&device);
        let stream = device.create_stream().unwrap();
        let r = ManagedResource::new(&device);
        let free = device.free_memory().unwrap();
        match r.allocate(free + 64 * MIB, &stream) {
            Err(Error::OutOfMemory {
                requested,
                available,
                maximum,
            }) => {
                assert_eq!(requested, free + 64 * MIB, "{what}");
                assert!(available < requested, "{what}");
                assert_eq!(maximum, device.total_memory(), "{what}");
            }
            other => panic!("{what}: more than free memory gave {other:?}"),
        }
        // What it has handed out counts, touched or not: with 1 GiB out, a request for the
        // rest of the card plus one byte is refused without asking the driver.
        let held = r.allocate(GIB, &stream).unwrap();
        assert_eq!(r.outstanding_bytes(), GIB, "{what}");
        let rest = device.total_memory() - GIB + 1;
        match r.allocate(rest, &stream) {
            Err(Error::OutOfMemory { available, .. }) => {
                assert!(available <= device.total_memory() - GIB, "{what}")
            }
            other => panic!("{what}: oversubscription gave {other:?}"),
        }
        write_and_check(MemoryKind::Managed, held, GIB, &stream, 5);
        // SAFETY: its uses are synchronized; freed once.
        unsafe { r.deallocate(held, GIB, &stream) }.unwrap();
        assert_eq!(r.outstanding_bytes(), 0, "{what}");
        stream.synchronize_blocking().unwrap();
    }
}

#[test]
fn managed_on_a_small_simulated_device_adds_up_untouched_allocations() {
    let device = Device::simulated(SimConfig {
        total_memory: 64 * MIB,
        ..SimConfig::default()
    });
    let stream = device.create_stream().unwrap();
    let r = ManagedResource::new(&device);
    let a = r.allocate(40 * MIB, &stream).unwrap();
    let err = r.allocate(40 * MIB, &stream).unwrap_err();
    assert!(
        matches!(err, Error::OutOfMemory { requested, available, maximum }
            if requested == 40 * MIB && available <= 24 * MIB && maximum == 64 * MIB),
        "{err:?}"
    );
    let b = r.allocate(16 * MIB, &stream).unwrap();
    // SAFETY: unused, freed once each.
    unsafe {
        r.deallocate(a, 40 * MIB, &stream).unwrap();
        r.deallocate(b, 16 * MIB, &stream).unwrap();
    }
    stream.synchronize_blocking().unwrap();
    let c = r.allocate(40 * MIB, &stream).unwrap();
    // SAFETY: unused, freed once.
    unsafe { r.deallocate(c, 40 * MIB, &stream) }.unwrap();
    stream.synchronize_blocking().unwrap();
}
