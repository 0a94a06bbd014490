//! A review of the limiting, aligned, tracking and history adaptors and of the driver
//! resources: each test here failed before the fix its commit names.

#[path = "common/mod.rs"]
mod common;

use common::{devices, free, label, pool};
use streamalloc::resource::adaptor::{Action, HistoryAdaptor, HistoryOptions};
use streamalloc::{DevicePtr, MemoryResource};

const MIB: usize = 1 << 20;

/// A free that the upstream refuses frees nothing, so the history must not show it: a replay
/// of the history (`streamalloc-replay`) would free the allocation twice, and the history
/// would disagree with the live table, which the adaptor restores.
#[test]
fn history_does_not_keep_a_free_the_upstream_refused() {
    for device in devices() {
        let what = label(&device);
        let mr = HistoryAdaptor::new(pool(&device, 4 * MIB, 8 * MIB), HistoryOptions::default());
        mr.start();
        let s = device.create_stream().unwrap();
        let p = mr.allocate(1000, &s).unwrap();
        // With another size, and a pointer inside the allocation: both refused below.
        // SAFETY: refused by the pool before anything is freed (checked).
        let wrong_size = unsafe { mr.deallocate(p, 300_000, &s) };
        assert!(wrong_size.is_err(), "{what}: {wrong_size:?}");
        // SAFETY: as above.
        let inside = unsafe { mr.deallocate(DevicePtr(p.0 + 256), 1000, &s) };
        assert!(inside.is_err(), "{what}: {inside:?}");
        assert_eq!(mr.live_allocations(), 1, "{what}");
        free(&mr, p, 1000, &s);
        let actions: Vec<(Action, u64)> = mr
            .history()
            .events
            .iter()
            .map(|e| (e.action, e.ptr))
            .collect();
        assert_eq!(
            actions,
            [(Action::Allocate, p.0), (Action::Free, p.0)],
            "{what}: the history shows frees that did not happen"
        );
        assert_eq!(mr.live_allocations(), 0, "{what}");
    }
}
