//! Waiting for memory without spinning, and deadlines that cannot overflow.
//!
//! - A task waiting in `allocate_async` is polled when memory may have come back, not in a loop:
//!   behind a `LimitingAdaptor` whose upstream is full, the rollback of the adaptor's
//!   reservation used to wake the waiting task itself (issue 19, finding 4). Every resource
//!   that can wait is checked for that shape, by counting polls over a window in which nothing
//!   is freed: a handful are due (the first poll, a retry), not thousands. The window is a
//!   duration, but the assertion is on the count of polls: no timing threshold.
//! - `Duration::MAX` as a timeout means "no limit" (issue 19, finding 6: it panicked once the
//!   allocation had to wait).

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use common::{devices, label, runtime};
use streamalloc::resource::adaptor::LimitingAdaptor;
use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{
    AllocateAsync, Device, DeviceBuffer, DevicePtr, Error, MemoryResource, ResourceRef, Stream,
};

const MIB: usize = 1 << 20;

/// How long a waiter is left alone with nothing freed.
const QUIET: Duration = Duration::from_millis(200);

/// Polls due in `QUIET`: the first, perhaps a retry or two. Generous: the bug gave thousands.
const MAX_QUIET_POLLS: usize = 20;

/// Counts the polls of the future it wraps.
struct CountPolls<F> {
    inner: Pin<Box<F>>,
    polls: Arc<AtomicUsize>,
}

impl<F: Future> Future for CountPolls<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        self.polls.fetch_add(1, Ordering::SeqCst);
        self.inner.as_mut().poll(cx)
    }
}

fn free(mr: &dyn MemoryResource, ptr: DevicePtr, bytes: usize, stream: &Stream) {
    // SAFETY: allocated from `mr` with `bytes`, unused, freed once.
    unsafe { mr.deallocate(ptr, bytes, stream) }.unwrap();
}

fn pool(device: &Device, maximum: usize) -> PoolResource<CudaResource> {
    PoolResource::new(
        CudaResource::new(device),
        PoolOptions {
            initial: maximum,
            maximum: Some(maximum),
            ..PoolOptions::default()
        },
    )
    .unwrap()
}

fn arena(device: &Device, maximum: usize) -> ArenaResource<CudaResource> {
    ArenaResource::new(
        CudaResource::new(device),
        ArenaOptions {
            initial: maximum,
            maximum: Some(maximum),
            ..ArenaOptions::default()
        },
    )
    .unwrap()
}

/// Every resource that can wait, full: (name, resource, what to allocate to fill it, what the
/// waiter asks for).
fn full_resources(device: &Device) -> Vec<(&'static str, ResourceRef, usize, usize)> {
    vec![
        // The repro of finding 4: the limit has room, the pool under it has none.
        (
            "limiting (4 MiB) over a full 1 MiB pool",
            Arc::new(LimitingAdaptor::new(pool(device, MIB), 4 * MIB)),
            MIB,
            MIB,
        ),
        (
            "limiting (4 MiB) over a full 1 MiB arena",
            Arc::new(LimitingAdaptor::new(arena(device, MIB), 4 * MIB)),
            MIB,
            MIB,
        ),
        (
            "limiting at its own limit",
            Arc::new(LimitingAdaptor::new(pool(device, 4 * MIB), MIB)),
            MIB,
            MIB,
        ),
        ("pool at its maximum", Arc::new(pool(device, MIB)), MIB, MIB),
        // A small request: each try adopts, acquires, defragments, moves superblocks and
        // grows before it fails.
        (
            "arena at its maximum, small request",
            Arc::new(arena(device, 2 * MIB)),
            2 * MIB,
            4096,
        ),
        // A large request: each try also looks for whole chunks to give back.
        (
            "arena at its maximum, large request",
            Arc::new(arena(device, 2 * MIB)),
            2 * MIB,
            2 * MIB,
        ),
    ]
}

/// A waiter behind a full resource is polled a handful of times while nothing is freed, and
/// is served once something is.
#[test]
fn a_waiter_does_not_spin_while_nothing_is_freed() {
    let rt = runtime();
    for device in devices() {
        for (name, mr, fill, want) in full_resources(&device) {
            let what = format!("{}: {name}", label(&device));
            let holder = device.create_stream().unwrap();
            let held = mr.allocate(fill, &holder).unwrap();
            let polls = Arc::new(AtomicUsize::new(0));
            let waiter = {
                let (mr, device, polls) = (mr.clone(), device.clone(), polls.clone());
                rt.spawn(async move {
                    let stream = device.create_stream().unwrap();
                    let ptr = CountPolls {
                        inner: Box::pin(mr.allocate_async(want, &stream)),
                        polls,
                    }
                    .await?;
                    free(&*mr, ptr, want, &stream);
                    Ok::<(), Error>(())
                })
            };
            std::thread::sleep(QUIET);
            let quiet = polls.load(Ordering::SeqCst);
            assert!(quiet >= 1, "{what}: never polled");
            assert!(
                !waiter.is_finished(),
                "{what}: served with nothing freed: {:?}",
                rt.block_on(waiter)
            );
            assert!(
                quiet < MAX_QUIET_POLLS,
                "{what}: polled {quiet} times in {QUIET:?} with nothing freed: it spins"
            );
            free(&*mr, held, fill, &holder);
            rt.block_on(waiter)
                .unwrap()
                .unwrap_or_else(|e| panic!("{what}: the waiter failed after the free: {e}"));
            let total = polls.load(Ordering::SeqCst);
            assert!(total < MAX_QUIET_POLLS + 5, "{what}: {total} polls in all");
        }
    }
}

/// Two waiters behind a limiting adaptor whose upstream is full: the first one's rollbacks must
/// neither spin it nor starve the second, and both are served as memory comes back.
#[test]
fn two_waiters_behind_a_limit_over_a_full_pool() {
    let rt = runtime();
    for device in devices() {
        let what = label(&device);
        let mr: ResourceRef = Arc::new(LimitingAdaptor::new(pool(&device, 2 * MIB), 8 * MIB));
        let holder = device.create_stream().unwrap();
        let held = [
            mr.allocate(MIB, &holder).unwrap(),
            mr.allocate(MIB, &holder).unwrap(),
        ];
        let polls = Arc::new(AtomicUsize::new(0));
        let waiters: Vec<_> = (0..2)
            .map(|_| {
                let (mr, device, polls) = (mr.clone(), device.clone(), polls.clone());
                let waiter = rt.spawn(async move {
                    let stream = device.create_stream().unwrap();
                    let ptr = CountPolls {
                        inner: Box::pin(mr.allocate_async(MIB, &stream)),
                        polls,
                    }
                    .await?;
                    stream.synchronize().await?;
                    Ok::<(DevicePtr, Stream), Error>((ptr, stream))
                });
                // Registered in this order.
                std::thread::sleep(Duration::from_millis(20));
                waiter
            })
            .collect();
        std::thread::sleep(QUIET);
        let quiet = polls.load(Ordering::SeqCst);
        assert!(
            quiet < 2 * MAX_QUIET_POLLS,
            "{what}: {quiet} polls of two waiters with nothing freed"
        );
        for ptr in held {
            free(&*mr, ptr, MIB, &holder);
        }
        holder.synchronize_blocking().unwrap();
        for waiter in waiters {
            let (ptr, stream) = rt.block_on(waiter).unwrap().unwrap();
            free(&*mr, ptr, MIB, &stream);
        }
    }
}

/// `Duration::MAX` as a timeout is no limit: the wait neither panics nor times out, and is
/// served when memory comes back; through `DeviceBuffer::alloc_timeout` and through
/// `Allocate::timeout`.
#[test]
fn a_timeout_of_duration_max_means_no_limit() {
    let rt = runtime();
    for device in devices() {
        let what = label(&device);
        let mr: Arc<PoolResource<CudaResource>> = Arc::new(pool(&device, MIB));
        for through_buffer in [true, false] {
            let holder = device.create_stream().unwrap();
            let held = mr.allocate(MIB, &holder).unwrap();
            let waiter = {
                let (mr, device) = (mr.clone(), device.clone());
                rt.spawn(async move {
                    let stream = device.create_stream().unwrap();
                    if through_buffer {
                        let buf =
                            DeviceBuffer::alloc_timeout(&mr, MIB, &stream, Duration::MAX).await?;
                        drop(buf);
                    } else {
                        let ptr = mr
                            .allocate_async(MIB, &stream)
                            .timeout(Duration::MAX)
                            .await?;
                        free(&*mr, ptr, MIB, &stream);
                    }
                    Ok::<(), Error>(())
                })
            };
            std::thread::sleep(Duration::from_millis(100));
            assert!(
                !waiter.is_finished(),
                "{what} (buffer: {through_buffer}): ended with nothing freed: {:?}",
                rt.block_on(waiter)
            );
            free(&*mr, held, MIB, &holder);
            rt.block_on(waiter)
                .unwrap_or_else(|e| panic!("{what} (buffer: {through_buffer}): {e}"))
                .unwrap();
        }
        // A limit that does fit still times out, and the shorter of a limit and a deadline
        // wins.
        let holder = device.create_stream().unwrap();
        let held = mr.allocate(MIB, &holder).unwrap();
        let stream = device.create_stream().unwrap();
        let far = std::time::Instant::now() + Duration::from_secs(3600);
        let timed_out = rt.block_on(
            mr.allocate_async(MIB, &stream)
                .timeout(Duration::from_millis(20))
                .deadline(far),
        );
        assert!(
            matches!(timed_out, Err(Error::Timeout { .. })),
            "{what}: {timed_out:?}"
        );
        free(&*mr, held, MIB, &holder);
    }
}
