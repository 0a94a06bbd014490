//! Memory that can be awaited: `allocate_async` and `DeviceBuffer::alloc` under pressure, on
//! every available device, for both pools: `PoolResource` and `ExpandablePoolResource` (each
//! test body is generic over [`Awaited`] and runs once per pool).

mod common;

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use common::{devices, eventually, label, runtime, SplitMix64};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::{PoolOptions, PoolResource, PoolStats};
use streamalloc::resource::WaitStats;
use streamalloc::{
    AllocateAsync, Device, DeviceBuffer, DevicePtr, Error, ExpandableOptions,
    ExpandablePoolResource, MemoryResource, SimConfig, StreamPool,
};

const MIB: usize = 1 << 20;

/// A pool whose memory can be awaited, and what the tests read of it.
trait Awaited: MemoryResource + 'static {
    fn stats(&self) -> PoolStats;
    fn wait_stats(&self) -> WaitStats;
    /// Growths that came with memory given up elsewhere under the maximum (the expandable
    /// pool's relocations between its address ranges); 0 for the pool, which never does.
    fn relocations(&self) -> u64;
}

impl Awaited for PoolResource<CudaResource> {
    fn stats(&self) -> PoolStats {
        PoolResource::stats(self)
    }
    fn wait_stats(&self) -> WaitStats {
        PoolResource::wait_stats(self)
    }
    fn relocations(&self) -> u64 {
        0
    }
}

impl Awaited for ExpandablePoolResource {
    fn stats(&self) -> PoolStats {
        ExpandablePoolResource::stats(self)
    }
    fn wait_stats(&self) -> WaitStats {
        ExpandablePoolResource::wait_stats(self)
    }
    fn relocations(&self) -> u64 {
        ExpandablePoolResource::relocations(self)
    }
}

/// Makes a pool of exactly `size` bytes, all of it taken at construction.
type MakePool<P> = fn(&Device, usize) -> Arc<P>;

/// An expandable pool of `size` bytes (a multiple of the 2 MiB granule in these tests), all
/// mapped at construction; mapped by the granule (not the default unit of 4), so that its
/// maximum is `size` exactly.
fn expandable(device: &Device, size: usize) -> Arc<ExpandablePoolResource> {
    Arc::new(
        ExpandablePoolResource::new(
            device,
            ExpandableOptions {
                initial: size,
                maximum: Some(size),
                map_unit: Some(1),
                ..ExpandableOptions::default()
            },
        )
        .unwrap(),
    )
}

/// `#[test] fn name()` running `name_on` once per pool.
macro_rules! on_both_pools {
    ($($name:ident => $body:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                $body(pool);
                $body(expandable);
            }
        )*
    };
}

on_both_pools! {
    sixty_four_tasks_each_needing_a_quarter => sixty_four_tasks_each_needing_a_quarter_on,
    a_large_waiter_is_not_starved_by_small_ones => a_large_waiter_is_not_starved_by_small_ones_on,
    cancellation_at_random_points_loses_nothing => cancellation_at_random_points_loses_nothing_on,
    a_waiter_wakes_only_after_the_gpu_frees_the_memory =>
        a_waiter_wakes_only_after_the_gpu_frees_the_memory_on,
    too_large_requests_fail_at_once_and_deadlines_expire =>
        too_large_requests_fail_at_once_and_deadlines_expire_on,
    the_allocate_future_is_send => the_allocate_future_is_send_on,
}

fn pool(device: &Device, size: usize) -> Arc<PoolResource<CudaResource>> {
    Arc::new(
        PoolResource::new(
            CudaResource::new(device),
            PoolOptions {
                initial: size,
                maximum: Some(size),
                ..PoolOptions::default()
            },
        )
        .unwrap(),
    )
}

/// 64 tasks, each needing a quarter of the pool, loop: all complete, none fails, and the pool
/// never holds more than its maximum.
fn sixty_four_tasks_each_needing_a_quarter_on<P: Awaited>(pool: MakePool<P>) {
    let rt = runtime();
    for device in devices() {
        let size = 64 * MIB;
        let p = pool(&device, size);
        let streams = StreamPool::new(&device, 8).unwrap();
        let done = Arc::new(AtomicUsize::new(0));
        rt.block_on(async {
            let tasks: Vec<_> = (0..64)
                .map(|t| {
                    let (p, streams, done) = (p.clone(), streams.clone(), done.clone());
                    tokio::spawn(async move {
                        let stream = streams.get_by_index(t);
                        for _ in 0..10 {
                            let buf = DeviceBuffer::alloc(&p, size / 4, &stream).await.unwrap();
                            // Touch it (the first 4 KiB: the simulated device's debug-build
                            // memset is slow, and the test is about waiting, not bandwidth).
                            // SAFETY: 4 KiB of `buf`'s memory, used on its stream.
                            unsafe { stream.memset_d8(buf.as_ptr(), t as u8, 4096) }.unwrap();
                            stream.spin(Duration::from_micros(200)).unwrap();
                            // Hold the memory across the wait for the GPU, as a pipeline does.
                            stream.synchronize().await.unwrap();
                            drop(buf);
                        }
                        done.fetch_add(1, Ordering::Relaxed);
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
        });
        assert_eq!(done.load(Ordering::Relaxed), 64, "{}", label(&device));
        let stats = p.stats();
        assert!(stats.peak_reserved <= size, "{}: {stats:?}", label(&device));
        // Nothing grows past the maximum. The expandable pool maps granules in a thread's own
        // address range after unmapping as many free ones of another range (a relocation, on
        // a machine whose tasks run on threads of different shards): a growth each, never one
        // without a relocation. The pool never grows at all.
        assert!(
            stats.grows <= p.relocations(),
            "{}: {} growths, {} relocations: {stats:?}",
            label(&device),
            stats.grows,
            p.relocations()
        );
        let waits = p.wait_stats();
        assert_eq!(waits.waiting, 0);
        assert!(
            waits.waits > 0,
            "{}: nobody ever waited: {waits:?}",
            label(&device)
        );
    }
}

/// One large waiter and a flood of small requests: the large one is served as soon as the
/// memory ahead of it comes back, not starved by small ones that keep fitting.
fn a_large_waiter_is_not_starved_by_small_ones_on<P: Awaited>(pool: MakePool<P>) {
    let rt = runtime();
    for device in devices() {
        let size = 16 * MIB;
        let p = pool(&device, size);
        let s = device.create_stream().unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        // Hold half the pool; the large request needs all of it.
        let half = DeviceBuffer::new(&p, size / 2, &s).unwrap();
        let (p2, s2, o2) = (p.clone(), s.clone(), order.clone());
        let large = rt.spawn(async move {
            let b = DeviceBuffer::alloc(&p2, size, &s2).await.unwrap();
            o2.lock().unwrap().push("large");
            drop(b);
        });
        assert!(eventually(Duration::from_secs(5), || p
            .wait_stats()
            .waiting
            == 1));
        // Small requests that would fit in the free half: they queue behind the large one.
        let smalls: Vec<_> = (0..20)
            .map(|i| {
                let (p, s, o) = (p.clone(), s.clone(), order.clone());
                rt.spawn(async move {
                    let b = DeviceBuffer::alloc(&p, MIB, &s).await.unwrap();
                    o.lock()
                        .unwrap()
                        .push(if i == 0 { "small-first" } else { "small" });
                    drop(b);
                })
            })
            .collect();
        assert!(eventually(Duration::from_secs(5), || p
            .wait_stats()
            .waiting
            == 21));
        drop(half);
        rt.block_on(large).unwrap();
        for t in smalls {
            rt.block_on(t).unwrap();
        }
        let order = order.lock().unwrap();
        assert_eq!(order[0], "large", "{}: {order:?}", label(&device));
        assert_eq!(order.len(), 21);
    }
}

/// Futures dropped before, during and after a wake, under load: every byte comes back and every
/// remaining waiter completes.
fn cancellation_at_random_points_loses_nothing_on<P: Awaited>(pool: MakePool<P>) {
    let rt = runtime();
    for device in devices() {
        let size = 8 * MIB;
        let p = pool(&device, size);
        let streams = StreamPool::new(&device, 4).unwrap();
        let completed = Arc::new(AtomicUsize::new(0));
        rt.block_on(async {
            let tasks: Vec<_> = (0..48u64)
                .map(|t| {
                    let (p, streams, completed) = (p.clone(), streams.clone(), completed.clone());
                    tokio::spawn(async move {
                        let mut rng = SplitMix64(t);
                        let stream = streams.get();
                        for _ in 0..20 {
                            let bytes = MIB * (1 + (rng.next() % 4) as usize);
                            let fut = DeviceBuffer::alloc(&p, bytes, &stream);
                            match rng.next() % 3 {
                                // Cancelled after a short while: before or after being woken.
                                0 => {
                                    let wait = Duration::from_micros(rng.next() % 500);
                                    if let Ok(Ok(b)) = tokio::time::timeout(wait, fut).await {
                                        drop(b);
                                    }
                                }
                                // Polled once, then dropped.
                                1 => {
                                    let mut fut = Box::pin(fut);
                                    let waker = futures::task::noop_waker();
                                    if let Poll::Ready(b) =
                                        fut.as_mut().poll(&mut Context::from_waker(&waker))
                                    {
                                        drop(b.unwrap());
                                    }
                                }
                                // Awaited to the end.
                                _ => {
                                    let b = fut.await.unwrap();
                                    stream.spin(Duration::from_micros(100)).unwrap();
                                    drop(b);
                                    completed.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                            tokio::task::yield_now().await;
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
        });
        for s in streams.streams() {
            s.synchronize_blocking().unwrap();
        }
        assert!(completed.load(Ordering::Relaxed) > 0);
        let waits = p.wait_stats();
        assert_eq!(
            (waits.waiting, waits.bytes_waiting),
            (0, 0),
            "{}: {waits:?}",
            label(&device)
        );
        let stats = p.stats();
        assert_eq!(
            stats.free,
            stats.reserved,
            "{}: bytes lost: {stats:?}",
            label(&device)
        );
        // The pool still serves everything.
        let all = rt
            .block_on(DeviceBuffer::alloc(&p, size, &streams.get()))
            .unwrap();
        drop(all);
    }
}

/// A buffer dropped while a spin kernel still uses it on another stream: a waiter for that
/// memory wakes only after the kernel finishes, and the kernel's data was not clobbered.
fn a_waiter_wakes_only_after_the_gpu_frees_the_memory_on<P: Awaited>(pool: MakePool<P>) {
    let rt = runtime();
    for device in devices() {
        // 2 MiB: the expandable pool's granule, so its maximum is exactly this.
        let words = 512 * 1024;
        let bytes = words * 4;
        let p = pool(&device, bytes);
        let (a, k) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let mut x = DeviceBuffer::new(&p, bytes, &a).unwrap();
        let addr = x.as_ptr();
        k.wait(&a.record().unwrap()).unwrap();
        k.spin(Duration::from_millis(100)).unwrap();
        // SAFETY: `x`'s memory, used on K, which is recorded on `x` before it is dropped.
        unsafe { k.fill_u32(addr, 0x1234_5678, words) }.unwrap();
        let kernel_done = k.record().unwrap();
        x.record_stream(&k).unwrap();
        let (p2, a2) = (p.clone(), a.clone());
        let waiter = rt.spawn(async move {
            let b = DeviceBuffer::alloc(&p2, bytes, &a2).await.unwrap();
            (b.as_ptr(), b)
        });
        assert!(eventually(Duration::from_secs(5), || p
            .wait_stats()
            .waiting
            == 1));
        drop(x);
        let (got, b) = rt.block_on(waiter).unwrap();
        assert_eq!(got, addr);
        assert!(
            kernel_done.is_complete(),
            "{}: woken before the kernel finished",
            label(&device)
        );
        // The kernel's data is intact: nothing wrote over it before the waiter got the memory.
        let back = rt.block_on(b.to_host()).unwrap();
        assert!(
            back.chunks(4).all(|w| w == 0x1234_5678u32.to_le_bytes()),
            "{}",
            label(&device)
        );
    }
}

fn too_large_requests_fail_at_once_and_deadlines_expire_on<P: Awaited>(pool: MakePool<P>) {
    let rt = runtime();
    for device in devices() {
        let p = pool(&device, 4 * MIB);
        let s = device.create_stream().unwrap();
        match rt.block_on(p.allocate_async(5 * MIB, &s)) {
            Err(Error::OutOfMemory {
                requested, maximum, ..
            }) => {
                assert_eq!(requested, 5 * MIB);
                assert_eq!(maximum, 4 * MIB);
            }
            other => panic!("{}: {other:?}", label(&device)),
        }
        let held = p.allocate(4 * MIB, &s).unwrap();
        let start = std::time::Instant::now();
        match rt.block_on(p.allocate_async(MIB, &s).timeout(Duration::from_millis(30))) {
            Err(Error::Timeout { waited }) => {
                assert!(
                    waited >= Duration::from_millis(30)
                        && start.elapsed() >= Duration::from_millis(30)
                );
                assert!(Error::Timeout { waited }
                    .to_string()
                    .contains("timed out after"));
            }
            other => panic!("{}: {other:?}", label(&device)),
        }
        assert_eq!(p.wait_stats().timeouts, 1);
        assert_eq!(p.wait_stats().waiting, 0);
        // SAFETY: allocated above, unused, freed once.
        unsafe { p.deallocate(held, 4 * MIB, &s) }.unwrap();
        // A resource that cannot get memory back does not wait: it fails like `allocate`.
        let plain = CudaResource::new(&device);
        assert!(rt.block_on(plain.allocate_async(1 << 50, &s)).is_err());
        // Immediate success costs one try and leaves no trace in the queue.
        let ptr = rt.block_on(p.allocate_async(MIB, &s)).unwrap();
        assert_eq!(p.wait_stats().waits, 0);
        // SAFETY: as above.
        unsafe { p.deallocate(ptr, MIB, &s) }.unwrap();
    }
}

fn the_allocate_future_is_send_on<P: Awaited>(pool: MakePool<P>) {
    fn send<T: Send>(_: &T) {}
    let device = Device::simulated(Default::default());
    let p = pool(&device, MIB);
    let s = device.create_stream().unwrap();
    send(&p.allocate_async(256, &s));
    send(&p.allocate_async(256, &s).timeout(Duration::from_secs(1)));
    let erased: streamalloc::ResourceRef = p.clone();
    send(&erased.allocate_async(256, &s));
}

/// A request that waiting cannot cure fails at once even while others wait (a review found it
/// queued without a try behind the first waiter, waiting until it reached the head), and one
/// that would fit now still queues behind them (FIFO), leaving the memory for the head.
#[test]
fn behind_a_waiter_a_hopeless_request_fails_at_once_and_a_fitting_one_queues() {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    for device in devices() {
        let what = label(&device);
        let mr = common::pool(&device, 4 * MIB, 4 * MIB);
        let s = device.create_stream().unwrap();
        let held = mr.allocate(3 * MIB, &s).unwrap();
        let mut head = Box::pin(mr.allocate_async(2 * MIB, &s));
        assert!(head.as_mut().poll(&mut cx).is_pending(), "{what}");
        let mut too_big = Box::pin(mr.allocate_async(64 * MIB, &s));
        assert!(
            matches!(
                too_big.as_mut().poll(&mut cx),
                Poll::Ready(Err(Error::OutOfMemory { .. }))
            ),
            "{what}: larger than the maximum"
        );
        let elsewhere = Device::simulated(SimConfig::default())
            .create_stream()
            .unwrap();
        let mut wrong = Box::pin(mr.allocate_async(MIB, &elsewhere));
        assert!(
            matches!(
                wrong.as_mut().poll(&mut cx),
                Poll::Ready(Err(Error::WrongDevice { .. }))
            ),
            "{what}: a stream of another device"
        );
        let mut overflow =
            Box::pin(mr.allocate_all_async([(usize::MAX - 1000, &s), (usize::MAX - 1000, &s)]));
        assert!(
            matches!(
                overflow.as_mut().poll(&mut cx),
                Poll::Ready(Err(Error::InvalidSize { .. }))
            ),
            "{what}: a set whose size overflows"
        );
        // 1 MiB is free: it fits the newcomer, not the head, and the newcomer queues.
        let mut fits = Box::pin(mr.allocate_async(MIB, &s));
        assert!(fits.as_mut().poll(&mut cx).is_pending(), "{what}: FIFO");
        let stats = mr.memory_waiters().unwrap().stats();
        assert_eq!((stats.waiting, stats.bytes_waiting), (2, 3 * MIB), "{what}");
        assert_eq!(
            mr.stats().in_use,
            3 * MIB,
            "{what}: nothing taken ahead of the head"
        );
        // The held memory goes back: the head is served first, then the newcomer.
        // SAFETY: allocated above, unused, freed once.
        unsafe { mr.deallocate(held, 3 * MIB, &s) }.unwrap();
        let Poll::Ready(Ok(a)) = head.as_mut().poll(&mut cx) else {
            panic!("{what}: the head was not served");
        };
        let Poll::Ready(Ok(b)) = fits.as_mut().poll(&mut cx) else {
            panic!("{what}: the newcomer was not served after the head");
        };
        // SAFETY: allocated above, unused, freed once each.
        unsafe {
            mr.deallocate(a, 2 * MIB, &s).unwrap();
            mr.deallocate(b, MIB, &s).unwrap();
        }
    }
}

/// A resource whose second try fails with a driver error.
#[derive(Debug)]
struct SecondTryFails {
    inner: PoolResource<CudaResource>,
    tries: AtomicUsize,
}

// SAFETY: every allocation is the inner pool's, passed on unchanged.
unsafe impl MemoryResource for SecondTryFails {
    fn device(&self) -> &Device {
        self.inner.device()
    }

    fn allocate(
        &self,
        bytes: usize,
        stream: &streamalloc::Stream,
    ) -> streamalloc::Result<DevicePtr> {
        if self.tries.fetch_add(1, Ordering::SeqCst) == 1 {
            return Err(Error::Driver {
                call: "cuFake",
                code: 999,
                name: "CUDA_ERROR_UNKNOWN".into(),
            });
        }
        self.inner.allocate(bytes, stream)
    }

    unsafe fn deallocate(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        stream: &streamalloc::Stream,
    ) -> streamalloc::Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.deallocate(ptr, bytes, stream) }
    }

    fn memory_waiters(&self) -> Option<&streamalloc::MemoryWaiters> {
        self.inner.memory_waiters()
    }
}

/// The try right after a request registers first in line ends the wait on an error that
/// waiting cannot cure, as every other try does (a review found it dropped: the request waited
/// for the next free, and its deadline then reported a timeout instead of the error).
#[test]
fn an_error_on_the_try_after_registering_ends_the_wait() {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let device = Device::simulated(SimConfig::default());
    let s = device.create_stream().unwrap();
    let mr = SecondTryFails {
        inner: common::pool(&device, 4 * MIB, 4 * MIB),
        tries: AtomicUsize::new(0),
    };
    let held = mr.inner.allocate(4 * MIB, &s).unwrap();
    let mut waiting = Box::pin(mr.allocate_async(MIB, &s));
    assert!(matches!(
        waiting.as_mut().poll(&mut cx),
        Poll::Ready(Err(Error::Driver { code: 999, .. }))
    ));
    assert_eq!(mr.memory_waiters().unwrap().stats().waiting, 0);
    // SAFETY: allocated above, unused, freed once.
    unsafe { mr.inner.deallocate(held, 4 * MIB, &s) }.unwrap();
}
