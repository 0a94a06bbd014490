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

/// `CudaResource` whose `deallocate`, once armed, waits at a gate and then refuses the free.
#[derive(Debug)]
struct RefusesAtGate {
    inner: streamalloc::resource::cuda::CudaResource,
    armed: std::sync::atomic::AtomicBool,
    entered: std::sync::atomic::AtomicBool,
    gate: std::sync::Mutex<bool>,
    opened: std::sync::Condvar,
}

// SAFETY: passes every call on to `CudaResource`, except armed frees, which it refuses
// without freeing anything.
unsafe impl MemoryResource for RefusesAtGate {
    fn device(&self) -> &streamalloc::Device {
        self.inner.device()
    }

    fn allocate(
        &self,
        bytes: usize,
        stream: &streamalloc::Stream,
    ) -> streamalloc::Result<DevicePtr> {
        self.inner.allocate(bytes, stream)
    }

    unsafe fn deallocate(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        stream: &streamalloc::Stream,
    ) -> streamalloc::Result<()> {
        use std::sync::atomic::Ordering;
        if self.armed.swap(false, Ordering::SeqCst) {
            self.entered.store(true, Ordering::SeqCst);
            let mut open = self.gate.lock().unwrap();
            while !*open {
                open = self.opened.wait(open).unwrap();
            }
            return Err(streamalloc::Error::UnknownPointer { ptr: ptr.0, bytes });
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.deallocate(ptr, bytes, stream) }
    }
}

/// A free the upstream refuses is counted as outstanding again in the scope it was subtracted
/// from, even if another thread pushed a scope while the upstream was deciding. Before, the
/// restore went to the innermost scope of the moment: the new scope showed 1000 bytes it never
/// allocated.
#[test]
fn statistics_restores_a_refused_free_in_the_scope_it_came_from() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use streamalloc::resource::adaptor::StatisticsAdaptor;
    for device in devices() {
        let what = label(&device);
        let mr = StatisticsAdaptor::new(RefusesAtGate {
            inner: streamalloc::resource::cuda::CudaResource::new(&device),
            armed: AtomicBool::new(false),
            entered: AtomicBool::new(false),
            gate: std::sync::Mutex::new(false),
            opened: std::sync::Condvar::new(),
        });
        let s = device.create_stream().unwrap();
        let p = mr.allocate(1000, &s).unwrap();
        mr.upstream().armed.store(true, Ordering::SeqCst);
        std::thread::scope(|scope| {
            // SAFETY: `p` came from `mr` on `s`; the upstream refuses this free (frees nothing).
            let refused = scope.spawn(|| unsafe { mr.deallocate(p, 1000, &s) });
            assert!(
                common::eventually(std::time::Duration::from_secs(10), || mr
                    .upstream()
                    .entered
                    .load(Ordering::SeqCst)),
                "{what}: the free never reached the upstream"
            );
            mr.push_counters();
            *mr.upstream().gate.lock().unwrap() = true;
            mr.upstream().opened.notify_all();
            assert!(refused.join().unwrap().is_err(), "{what}");
        });
        let inner = mr.pop_counters().unwrap();
        assert_eq!(inner.bytes.value, 0, "{what}: {inner:?}");
        assert_eq!(inner.allocations.value, 0, "{what}: {inner:?}");
        let outer = mr.counters();
        assert_eq!(outer.bytes.value, 1000, "{what}: {outer:?}");
        assert_eq!(outer.allocations.value, 1, "{what}: {outer:?}");
        // SAFETY: allocated above on `s`, never freed (the free was refused).
        unsafe { mr.deallocate(p, 1000, &s) }.unwrap();
        assert_eq!(mr.counters().bytes.value, 0, "{what}");
    }
}

/// A bad free (a size no allocation had) in a scope whose value is already negative (memory
/// from before the scope freed in it): subtracting the huge size overflowed the counter, a
/// panic in debug builds before the upstream could refuse the free. It is refused, and the
/// counts stay those of the real allocations.
#[test]
fn statistics_refuses_a_huge_bad_free_in_a_negative_scope() {
    use streamalloc::resource::adaptor::StatisticsAdaptor;
    const MIB: usize = 1 << 20;
    for device in devices() {
        let what = label(&device);
        let mr = StatisticsAdaptor::new(pool(&device, 0, 16 * MIB));
        let s = device.create_stream().unwrap();
        let p = mr.allocate(MIB, &s).unwrap();
        mr.push_counters();
        free(&mr, p, MIB, &s);
        assert_eq!(mr.counters().bytes.value, -(MIB as i64), "{what}");
        for bytes in [usize::MAX, i64::MAX as usize, i64::MAX as usize - 1] {
            let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // SAFETY: no allocation at this address or size: the upstream refuses it.
                unsafe { mr.deallocate(DevicePtr(0x1000), bytes, &s) }
            }));
            let refused =
                refused.unwrap_or_else(|_| panic!("{what}: a bad free of {bytes} panicked"));
            assert!(refused.is_err(), "{what}: a bad free of {bytes} was taken");
        }
        let scope = mr.pop_counters().unwrap();
        assert_eq!(scope.bytes.value, -(MIB as i64), "{what}: {scope:?}");
        assert_eq!(scope.allocations.value, -1, "{what}: {scope:?}");
        assert_eq!(mr.counters().bytes.value, 0, "{what}");
        s.synchronize_blocking().unwrap();
    }
}

/// The limiting adaptor gives a free's bytes back to its limit while the upstream's panic
/// unwinds, and tells its waiters there: a waiter whose waker panicked too aborted the process
/// (a panic in a drop during a panic). The waker's panic is dropped; the upstream's goes on,
/// and the waiter, told, is served.
#[test]
fn a_limit_told_during_an_upstream_panic_survives_a_panicking_waker() {
    use std::future::Future;
    use std::sync::atomic::Ordering::SeqCst;
    use streamalloc::resource::adaptor::LimitingAdaptor;
    use streamalloc::AllocateAsync;
    const MIB: usize = 1 << 20;
    for device in devices() {
        let what = label(&device);
        // Its first free (of `p`) panics: a user's upstream with a bug.
        let mr = LimitingAdaptor::new(
            common::PanicsOnCall::on_free(
                streamalloc::resource::cuda::CudaResource::new(&device),
                1,
            ),
            2 * MIB,
        );
        let s = device.create_stream().unwrap();
        let p = mr.allocate(2 * MIB, &s).unwrap();
        let wakes = std::sync::Arc::new(common::PanicsOnWake::default());
        let waker = std::task::Waker::from(wakes.clone());
        let mut wait = Box::pin(mr.allocate_async(MIB, &s));
        let mut cx = std::task::Context::from_waker(&waker);
        assert!(wait.as_mut().poll(&mut cx).is_pending(), "{what}");
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: allocated above on `s`, never used, freed once (the upstream panics
            // before it frees: the block leaks, the limit gives its bytes back).
            let _ = unsafe { mr.deallocate(p, 2 * MIB, &s) };
        }));
        let message = panicked.expect_err("the upstream did not panic");
        assert_eq!(
            message.downcast_ref::<String>().map(String::as_str),
            Some("a resource that panics in deallocate (call 1)"),
            "{what}: the upstream's panic is the one that goes on"
        );
        assert_eq!(wakes.0.load(SeqCst), 1, "{what}: the waiter was not told");
        let noop = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(noop);
        let q = match wait.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(q) => q.unwrap(),
            std::task::Poll::Pending => panic!("{what}: told, and still refused"),
        };
        free(&mr, q, MIB, &s);
        s.synchronize_blocking().unwrap();
    }
}
