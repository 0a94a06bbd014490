//! Review of `ExpandablePoolResource` and the virtual memory layer under it: defects found by
//! the review, each with the test that showed it (on the simulated device, whose mapping
//! calls are counted in its free memory).

mod common;

use common::free;
use streamalloc::{Device, ExpandableOptions, ExpandablePoolResource, MemoryResource, SimConfig};

const GIB: usize = 1 << 30;

/// A trim's unmapping must not hold up a request that grows meanwhile (the docs: "the
/// give-back ... runs with no lock held, so that no request waits for it"). The review found
/// the trim unmapping every granule under the table's lock, which every growth takes: a
/// request that needed one more granule waited until the whole trim had unmapped (thousands
/// of `cuMemUnmap`s on a GPU, tens of µs each).
///
/// The test maps 32 GiB in 2 MiB units, frees it and trims it on another thread; once the
/// device's free memory starts to rise (the trim is unmapping), it asks for a block that needs
/// a growth (far below the maximum). With the lock held across the unmapping, the request is
/// served only after the last unmap, so the trim has always finished by then; without it, the
/// request is served while the trim still unmaps (tried a few times: a thread can be
/// descheduled for the whole trim on a loaded machine).
#[test]
fn a_growth_does_not_wait_for_a_trims_unmapping() {
    let total = 64 * GIB;
    let mut served_during_trim = false;
    for _attempt in 0..5 {
        let device = Device::simulated(SimConfig {
            total_memory: total,
            ..SimConfig::default()
        });
        let p = ExpandablePoolResource::new(
            &device,
            ExpandableOptions {
                map_unit: Some(1),
                ..ExpandableOptions::default()
            },
        )
        .unwrap();
        let g = p.granule();
        let s = device.create_stream().unwrap();
        let big = p.allocate(32 * GIB, &s).unwrap();
        free(&p, big, 32 * GIB, &s);
        s.synchronize_blocking().unwrap();
        let before = device.free_memory().unwrap();
        assert_eq!(before, total - 32 * GIB);
        let (free_after_request, trimmed) = std::thread::scope(|scope| {
            let trim = scope.spawn(|| p.trim_blocking());
            // Until the trim unmaps (or has finished, on a slow machine).
            while device.free_memory().unwrap() == before && !trim.is_finished() {
                std::hint::spin_loop();
            }
            let small = p.allocate(g, &s).unwrap();
            let after = device.free_memory().unwrap();
            free(&p, small, g, &s);
            (after, trim.join().unwrap())
        });
        assert_eq!(trimmed.unwrap(), 32 * GIB);
        // What the trim left mapped when the request was served, beyond the request's unit.
        if free_after_request < total - g {
            served_during_trim = true;
            break;
        }
    }
    assert!(
        served_during_trim,
        "every request that grew during a trim waited until the trim had unmapped everything"
    );
}
