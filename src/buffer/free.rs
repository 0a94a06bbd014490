//! How a buffer goes back to its resource: at once in stream order on its stream, or, with
//! other streams recorded, once the events recorded on each have all completed
//! ([`release_after_all`], on the completion reactor).

use std::mem::ManuallyDrop;
use std::sync::Arc as StdArc;

use crate::completion::Callback;
use crate::device::{Device, DevicePtr, SimExecution};
use crate::error::Result;
use crate::event::Event;
use crate::resource::ResourceRef;
use crate::stream::Stream;
use crate::sync::{Arc, AtomicUsize, Ordering};

use super::DeviceBuffer;

/// What a buffer with other uses leaves behind: freed once every use's event completes.
struct PendingFree {
    ptr: DevicePtr,
    /// The allocation's size (the buffer's capacity).
    len: usize,
    /// The buffer's own handle, moved here (not a clone: a second handle dropped on another
    /// thread at the same moment could leave each side seeing the other's, and the last
    /// decrement running the resource's Drop where it happened). Taken by the release, which
    /// runs once.
    resource: crate::sync::Mutex<Option<ResourceRef>>,
    stream: Stream,
}

impl PendingFree {
    fn release(&self) {
        let Some(resource) = self.resource.lock().take() else {
            return;
        };
        // This may be the last handle of the resource: its Drop (a pool synchronizing its
        // streams and returning its chunks) must not run here, on the completion reactor or on
        // the thread that dropped the buffer (the release runs there when every event was
        // complete already). A guard hands it off, so that this holds when `deallocate`
        // panics too (a pool does, once the memory is back, in the race detector's `Panic`
        // mode): the unwinding used to drop it right here, on the reactor.
        let resource = LetGo::new(resource, self.stream.device());
        let Some(r) = resource.get() else {
            return;
        };
        // SAFETY: the buffer's memory, from this resource with this length, freed once (only
        // the last of the events gets here, and it takes the resource); every use on other
        // streams has completed and later work on `stream` is ordered after the free.
        if let Err(e) = unsafe { r.deallocate(self.ptr, self.len, &self.stream) } {
            tracing::error!(error = %e, ptr = ?self.ptr, bytes = self.len, "a deferred free failed");
        }
    }
}

impl Drop for PendingFree {
    /// A release that never ran (its events' callbacks dropped unrun: `Event::withhold`, on the
    /// reactor perhaps) leaks the memory, but the resource handle still goes off this thread if
    /// it is the last.
    fn drop(&mut self) {
        if let Some(resource) = self.resource.lock().take() {
            drop(LetGo::new(resource, self.stream.device()));
        }
    }
}

/// A buffer's handle of its resource, let go of when this drops: if it is the last handle, it
/// is handed to the device's blocking-work thread (`offload.rs`) to be dropped there, so that
/// the resource's Drop (a pool synchronizing every stream it served and returning its chunks
/// upstream, `cuMemFree` on CUDA) never runs where a buffer drops: "dropping a buffer never
/// blocks the host", and the completion reactor (a waker dropping a task's future drops its
/// buffers there) must never block. Otherwise it is a reference-count decrement, here. (It
/// used to drop the handle where the buffer dropped, off the reactor, whatever it was: a
/// review found `drop(buf)` waiting for every stream of a pool the user had dropped, and, with
/// the buffer dropped by a waker, doing so on the reactor.)
///
/// "Last" is read as the strong count, 1: std's `Arc` has no "decrement unless last" for an
/// unsized value, so a handle dropped on another thread at the very moment (the user's own, or
/// another buffer's) can still leave the final decrement, and the Drop, to one of the two
/// threads; so on the completion reactor every handle is handed off, whatever the count. A
/// guard rather than a call at the end, so that a `deallocate` that panics hands the handle
/// off too.
struct LetGo<'a> {
    resource: Option<ResourceRef>,
    device: &'a Device,
}

impl<'a> LetGo<'a> {
    fn new(resource: ResourceRef, device: &'a Device) -> Self {
        Self {
            resource: Some(resource),
            device,
        }
    }

    fn get(&self) -> Option<&ResourceRef> {
        self.resource.as_ref()
    }

    /// The handle, no longer let go of by this guard.
    fn into_inner(mut self) -> Option<ResourceRef> {
        self.resource.take()
    }
}

impl Drop for LetGo<'_> {
    fn drop(&mut self) {
        let Some(resource) = self.resource.take() else {
            return;
        };
        // An inline simulated device (what loom models of users' code run on) starts no thread
        // for this off its reactor: its streams' work is done when queued, so the Drop has
        // nothing to wait for, and a thread would change what such a model runs.
        let inline = self.device.sim_execution() == Some(SimExecution::Inline);
        // On the completion reactor every handle goes, whatever the count: a count of 2 read
        // here can be the last by the time of the decrement (the user's handle dropped in
        // between), and the resource's Drop must never run there (it blocks every wake and
        // deferred free of the device). Elsewhere the count decides: at worst that race leaves
        // a blocking Drop to a user's thread (a review of this guard).
        let on_reactor = crate::offload::on_reactor_thread();
        if on_reactor || (StdArc::strong_count(&resource) == 1 && !inline) {
            self.device.reactor().offload(
                "drop a buffer's last resource handle",
                Box::new(move || drop(resource)),
            );
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: the field is taken once, here, and not used again (the buffer is being
        // dropped; nothing below reads `self.resource`).
        let resource = unsafe { ManuallyDrop::take(&mut self.resource) };
        let resource = LetGo::new(resource, self.stream.device());
        let uses = std::mem::take(&mut *self.uses.lock());
        if uses.is_empty() {
            let Some(r) = resource.get() else {
                return;
            };
            // SAFETY: our memory, from this resource with this size, used only on `stream`
            // (in stream order before this point), freed once.
            if let Err(e) = unsafe { r.deallocate(self.ptr, self.capacity, &self.stream) } {
                tracing::error!(error = %e, ptr = ?self.ptr, bytes = self.capacity, "freeing a buffer failed");
            }
            return;
        }
        let events: Result<Vec<Event>> = uses.iter().map(Stream::record).collect();
        let events = match events {
            Ok(events) => events,
            Err(e) => {
                // Without events we cannot know when the other streams are done: keep the
                // memory rather than risk handing it out under running work.
                tracing::error!(error = %e, ptr = ?self.ptr, bytes = self.capacity, "could not record the buffer's uses; its memory is leaked");
                return;
            }
        };
        let pending = PendingFree {
            ptr: self.ptr,
            len: self.capacity,
            resource: crate::sync::Mutex::new(resource.into_inner()),
            stream: self.stream.clone(),
        };
        release_after_all(&events, move || pending.release(), Event::on_complete);
    }
}

/// Runs `release` exactly once, after every one of `events` has completed (`on_complete`
/// registers a callback with one event, or runs it at once if the event is already complete).
///
/// The countdown starts at the number of events *before* the first callback is registered: a
/// callback may run during `on_complete`, or on another thread while the next one registers, so
/// counting up while registering could reach zero early. The callback that brings it to zero
/// releases; its `AcqRel` decrement makes the release see everything the other events'
/// callbacks saw. With no events, releases at once. The loom model `loom-tests/deferred_free.rs`
/// checks it.
pub(crate) fn release_after_all<E>(
    events: &[E],
    release: impl Fn() + Send + Sync + 'static,
    on_complete: impl Fn(&E, Callback),
) {
    if events.is_empty() {
        return release();
    }
    // The loom model's planted bugs (`planted`, read through `planted!`), each a line of this
    // function done wrong; constant `false` outside the loom cfg, where they fold away.
    let count = events.len();
    let start = if planted!(COUNT_UP) { 0 } else { count };
    let countdown = Arc::new((AtomicUsize::new(start), release));
    for event in events {
        if planted!(COUNT_UP) {
            countdown.0.fetch_add(1, Ordering::AcqRel);
        }
        let countdown = countdown.clone();
        on_complete(
            event,
            Box::new(move |_| {
                let (remaining, release) = &*countdown;
                let order = if planted!(RELAXED) {
                    Ordering::Relaxed
                } else {
                    Ordering::AcqRel
                };
                let before = remaining.fetch_sub(1, order);
                let last = match (planted!(WRONG_COMPARISON), planted!(FIRST_EVENT)) {
                    (true, _) => before == 0,
                    (_, true) => before == count,
                    _ => before == 1,
                };
                if last {
                    release();
                }
            }),
        );
    }
}

/// The bugs the loom model plants in [`release_after_all`] (`loom-tests/deferred_free.rs`),
/// one at a time; read through `planted!`, constant off outside the loom cfg.
#[cfg(streamalloc_loom)]
pub(crate) mod planted {
    use std::sync::atomic::AtomicBool;

    /// The countdown starts at 0 and counts up as each callback is registered.
    pub(crate) static COUNT_UP: AtomicBool = AtomicBool::new(false);
    /// The last callback is taken to be the one that reads 0 before its decrement.
    pub(crate) static WRONG_COMPARISON: AtomicBool = AtomicBool::new(false);
    /// The first event to complete frees.
    pub(crate) static FIRST_EVENT: AtomicBool = AtomicBool::new(false);
    /// The decrement is `Relaxed`: the freeing callback does not acquire the others'.
    pub(crate) static RELAXED: AtomicBool = AtomicBool::new(false);
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use std::sync::{Arc as StdArc, Mutex};
    use std::time::{Duration, Instant};

    use crate::device::{Device, DevicePtr};
    use crate::error::Result;
    use crate::resource::MemoryResource;
    use crate::stream::Stream;
    use crate::{CudaResource, DeviceBuffer, SimConfig};

    /// Gives the memory back, then panics (as a pool does in the race detector's `Panic` mode
    /// when a free races a use), and notes where its drop ran.
    #[derive(Debug)]
    struct PanicsAfterFree {
        inner: CudaResource,
        dropped_on_reactor: StdArc<Mutex<Option<bool>>>,
    }

    // SAFETY: forwards to `CudaResource`.
    unsafe impl MemoryResource for PanicsAfterFree {
        fn device(&self) -> &Device {
            self.inner.device()
        }

        fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
            self.inner.allocate(bytes, stream)
        }

        unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
            // SAFETY: the caller's contract, passed on.
            unsafe { self.inner.deallocate(ptr, bytes, stream) }?;
            panic!("a free that panics once the memory is back");
        }
    }

    impl Drop for PanicsAfterFree {
        fn drop(&mut self) {
            *self.dropped_on_reactor.lock().unwrap() = Some(crate::offload::on_reactor_thread());
        }
    }

    /// A deferred free whose resource panics in `deallocate` must still not drop the last
    /// handle of the resource on the completion reactor (its Drop may synchronize streams and
    /// free chunks): the unwinding release used to drop it right there.
    #[test]
    fn a_deferred_free_that_panics_drops_its_resource_off_the_reactor() {
        let device = Device::simulated(SimConfig::default());
        let dropped = StdArc::new(Mutex::new(None));
        let resource = StdArc::new(PanicsAfterFree {
            inner: CudaResource::new(&device),
            dropped_on_reactor: dropped.clone(),
        });
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let mut buf = DeviceBuffer::new(&resource, 64, &a).unwrap();
        buf.record_stream(&b).unwrap();
        // Keeps `b`'s event pending at the drop, so the release runs on the reactor.
        b.spin(Duration::from_millis(100)).unwrap();
        drop(resource);
        drop(buf);
        let deadline = Instant::now() + Duration::from_secs(10);
        let on_reactor = loop {
            if let Some(on_reactor) = *dropped.lock().unwrap() {
                break on_reactor;
            }
            assert!(Instant::now() < deadline, "the resource was never dropped");
            std::thread::sleep(Duration::from_millis(5));
        };
        assert!(
            !on_reactor,
            "the resource was dropped on the completion reactor"
        );
    }
}
