//! All-or-nothing allocation: `allocate_all_async` and `DeviceBuffer::alloc_all`, on every
//! available device and on every resource that can wait (pool, arena, limiting adaptor, and
//! adaptors that forward their upstream's queue).

mod common;

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use common::{assert_all_back_within, devices, eventually, label, runtime, SplitMix64};
use streamalloc::resource::adaptor::{LimitingAdaptor, StatisticsAdaptor};
use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::PoolResource;
use streamalloc::{
    AllocateAsync, Device, DeviceBuffer, DevicePtr, Error, MemoryKind, MemoryResource,
    MemoryWaiters, Stream, StreamPool,
};

const MIB: usize = 1 << 20;

fn pool(device: &Device, size: usize) -> Arc<PoolResource<CudaResource>> {
    Arc::new(common::pool(device, size, size))
}

/// Many tasks, each needing three buffers (of different sizes, on two streams) at once, from a
/// pool that holds the sets of only a few: every task completes every round (no deadlock:
/// bounded by a generous timeout, which only a hang reaches), nobody ever holds part of a set
/// while waiting, and every byte comes back.
#[test]
fn many_tasks_each_needing_several_buffers() {
    let rt = runtime();
    for device in devices() {
        // A set is at most 1 + 2 + 3 = 6 MiB; the pool holds 14 MiB: two sets, rarely three.
        let size = 14 * MIB;
        let p = pool(&device, size);
        let streams = StreamPool::new(&device, 8).unwrap();
        let done = Arc::new(AtomicUsize::new(0));
        let outcome = rt.block_on(async {
            let tasks: Vec<_> = (0..48)
                .map(|t| {
                    let (p, streams, done) = (p.clone(), streams.clone(), done.clone());
                    tokio::spawn(async move {
                        let (a, b) = (streams.get_by_index(t), streams.get_by_index(t + 1));
                        let mut rng = SplitMix64(t as u64);
                        for _ in 0..6 {
                            let sizes = [
                                MIB + (rng.next() as usize % MIB),
                                2 * MIB,
                                2 * MIB + (rng.next() as usize % MIB),
                            ];
                            let set = DeviceBuffer::alloc_all(
                                &p,
                                &[(sizes[0], &a), (sizes[1], &b), (sizes[2], &a)],
                            )
                            .await
                            .unwrap();
                            assert_eq!(set.len(), 3);
                            for (buf, &bytes) in set.iter().zip(&sizes) {
                                assert_eq!(buf.len(), bytes);
                            }
                            // SAFETY: 4 KiB of each buffer, on the stream it was allocated for.
                            unsafe {
                                a.memset_d8(set[0].as_ptr(), t as u8, 4096).unwrap();
                                b.memset_d8(set[1].as_ptr(), t as u8, 4096).unwrap();
                            }
                            a.spin(Duration::from_micros(100)).unwrap();
                            // Hold the whole set across a wait for the GPU.
                            a.synchronize().await.unwrap();
                            b.synchronize().await.unwrap();
                            drop(set);
                        }
                        done.fetch_add(1, Ordering::Relaxed);
                    })
                })
                .collect();
            tokio::time::timeout(Duration::from_secs(300), async {
                for t in tasks {
                    t.await.unwrap();
                }
            })
            .await
        });
        assert!(
            outcome.is_ok(),
            "{}: tasks hung (deadlock?)",
            label(&device)
        );
        assert_eq!(done.load(Ordering::Relaxed), 48, "{}", label(&device));
        let waits = p.wait_stats();
        assert_eq!(waits.waiting, 0, "{}: {waits:?}", label(&device));
        assert!(
            waits.waits > 0,
            "{}: nobody waited: {waits:?}",
            label(&device)
        );
        assert!(p.stats().peak_reserved <= size);
        assert_all_back_within(&p, Duration::from_secs(10), &label(&device));
        common::check_pool(&p);
    }
}

/// A set waits in the same FIFO queue as single allocations: a set queued first is served
/// before a single request queued after it that would fit now, and a set queued behind a
/// single request is served after it.
#[test]
fn sets_are_served_first_come_first_served() {
    let rt = runtime();
    for device in devices() {
        let p = pool(&device, 8 * MIB);
        let s = device.create_stream().unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let held = DeviceBuffer::new(&p, 6 * MIB, &s).unwrap();

        // A single request for 4 MiB waits (2 free); then a set of 2 x 2 MiB queues behind it
        // although it would fit now; then a single 1 MiB behind both.
        let single = {
            let (p, s, o) = (p.clone(), s.clone(), order.clone());
            rt.spawn(async move {
                let b = DeviceBuffer::alloc(&p, 4 * MIB, &s).await.unwrap();
                o.lock().unwrap().push("single 4");
                drop(b);
            })
        };
        assert!(eventually(Duration::from_secs(5), || p
            .wait_stats()
            .waiting
            == 1));
        let set = {
            let (p, s, o) = (p.clone(), s.clone(), order.clone());
            rt.spawn(async move {
                let b = DeviceBuffer::alloc_all(&p, &[(2 * MIB, &s), (2 * MIB, &s)])
                    .await
                    .unwrap();
                o.lock().unwrap().push("set 2+2");
                drop(b);
            })
        };
        assert!(eventually(Duration::from_secs(5), || p
            .wait_stats()
            .waiting
            == 2));
        assert_eq!(p.wait_stats().bytes_waiting, 8 * MIB);
        let small = {
            let (p, s, o) = (p.clone(), s.clone(), order.clone());
            rt.spawn(async move {
                let b = DeviceBuffer::alloc(&p, MIB, &s).await.unwrap();
                o.lock().unwrap().push("single 1");
                drop(b);
            })
        };
        assert!(eventually(Duration::from_secs(5), || p
            .wait_stats()
            .waiting
            == 3));
        assert!(order.lock().unwrap().is_empty(), "{}", label(&device));
        drop(held);
        rt.block_on(async {
            single.await.unwrap();
            set.await.unwrap();
            small.await.unwrap();
        });
        assert_eq!(
            *order.lock().unwrap(),
            ["single 4", "set 2+2", "single 1"],
            "{}",
            label(&device)
        );
        assert_all_back_within(&p, Duration::from_secs(5), &label(&device));
    }
}

/// Through an aligned adaptor each request takes its padded size of the pool: a set whose
/// padded sizes add up to more than the pool's maximum can never fit, and fails at once
/// (an adaptors' review found it waiting, for ever without a deadline: the set was summed
/// unpadded, 4 MiB against the pool's 8). Under a limit, the limit's own count decides.
#[test]
fn a_set_through_an_aligned_adaptor_counts_its_padding() {
    use streamalloc::resource::adaptor::AlignedAdaptor;
    let rt = runtime();
    for device in devices() {
        let aligned = AlignedAdaptor::new(pool(&device, 8 * MIB), 4 * MIB).unwrap();
        let s = device.create_stream().unwrap();
        // Each 2 MiB request asks the pool for 8 MiB - 256: one fits, two never do.
        let one = rt
            .block_on(aligned.allocate_all_async([(2 * MIB, &s)]))
            .unwrap();
        let mut set = std::pin::pin!(aligned.allocate_all_async([(2 * MIB, &s), (2 * MIB, &s)]));
        match common::poll_once(set.as_mut()) {
            Poll::Ready(Err(Error::OutOfMemory {
                requested, maximum, ..
            })) => {
                assert_eq!(requested, 2 * (8 * MIB - 256), "{}", label(&device));
                assert_eq!(maximum, 8 * MIB);
            }
            Poll::Ready(other) => panic!("{}: {other:?}", label(&device)),
            Poll::Pending => panic!("{}: the set waits, though it can never fit", label(&device)),
        }
        for ptr in one {
            // SAFETY: allocated above through `aligned` with 2 MiB on `s`, never used.
            unsafe { aligned.deallocate(ptr, 2 * MIB, &s) }.unwrap();
        }
        // A limit above an aligned adaptor counts the unpadded sizes: 4 MiB fits a 6 MiB
        // limit, so the set waits for memory (here it is served: the pool below is larger).
        let wide = AlignedAdaptor::new(pool(&device, 32 * MIB), 4 * MIB).unwrap();
        let limited = LimitingAdaptor::new(wide, 6 * MIB);
        assert_eq!(limited.footprint(2 * MIB).unwrap(), 2 * MIB);
        let set = rt
            .block_on(limited.allocate_all_async([(2 * MIB, &s), (2 * MIB, &s)]))
            .unwrap();
        for ptr in set {
            // SAFETY: as above, through `limited`.
            unsafe { limited.deallocate(ptr, 2 * MIB, &s) }.unwrap();
        }
    }
}

/// Under a limit that counts the requests unpadded, over an aligned adaptor that asks a pool
/// for them padded: three 1 MiB requests (each 2 MiB - 256 of the 4 MiB pool) fit the limit
/// and each fits the pool alone, but together never fit the pool. The set waited for ever (on
/// every free it tried, failed, waited again): its error said 3 MiB, the unpadded total the
/// limit counts, against the pool's 4 MiB (an adaptors' review found it). It fails at once
/// with the pool's count; so does a lone request padded past the pool's maximum that would
/// have queued behind a waiter.
#[test]
fn a_set_padded_past_the_pool_under_a_limit_fails_at_once() {
    use streamalloc::resource::adaptor::AlignedAdaptor;
    for device in devices() {
        let what = label(&device);
        let limited = LimitingAdaptor::new(
            AlignedAdaptor::new(pool(&device, 4 * MIB), MIB).unwrap(),
            64 * MIB,
        );
        let s = device.create_stream().unwrap();
        let mut set = std::pin::pin!(limited.allocate_all_async([(MIB, &s), (MIB, &s), (MIB, &s)]));
        match common::poll_once(set.as_mut()) {
            Poll::Ready(Err(Error::OutOfMemory {
                requested, maximum, ..
            })) => {
                assert_eq!(requested, 3 * (2 * MIB - 256), "{what}");
                assert_eq!(maximum, 4 * MIB, "{what}");
            }
            Poll::Ready(other) => panic!("{what}: {other:?}"),
            Poll::Pending => panic!("{what}: the set waits, though it can never fit"),
        }
        // A waiter in the limit's queue (1 MiB, padded to 4 MiB - 256, while as much is
        // held), then a lone request whose padded size (6 MiB - 256 for 3 MiB aligned to
        // 2 MiB) is past the pool's maximum: it fails at once instead of queueing behind the
        // waiter.
        let wide = LimitingAdaptor::new(
            AlignedAdaptor::new(pool(&device, 4 * MIB), 2 * MIB).unwrap(),
            64 * MIB,
        );
        let held = wide.allocate(MIB, &s).unwrap();
        let mut waiter = std::pin::pin!(wide.allocate_async(MIB, &s));
        assert!(common::poll_once(waiter.as_mut()).is_pending(), "{what}");
        let mut lone = std::pin::pin!(wide.allocate_async(3 * MIB, &s));
        match common::poll_once(lone.as_mut()) {
            Poll::Ready(Err(Error::OutOfMemory {
                requested, maximum, ..
            })) => {
                assert_eq!(requested, 6 * MIB - 256, "{what}");
                assert_eq!(maximum, 4 * MIB, "{what}");
            }
            Poll::Ready(other) => panic!("{what}: {other:?}"),
            Poll::Pending => panic!("{what}: the request queued, though it can never fit"),
        }
        // SAFETY: allocated above through `wide` with 1 MiB on `s`, never used, freed once.
        unsafe { wide.deallocate(held, MIB, &s) }.unwrap();
        let got = match common::poll_once(waiter.as_mut()) {
            Poll::Ready(got) => got.unwrap(),
            Poll::Pending => panic!("{what}: the waiter was not served"),
        };
        // SAFETY: as above.
        unsafe { wide.deallocate(got, MIB, &s) }.unwrap();
        s.synchronize_blocking().unwrap();
    }
}

/// A set that can never fit fails at once, without waiting: one request above the maximum,
/// sizes that add up to more than the maximum (each fits alone), sizes whose sum overflows.
/// An empty set is served at once. Nothing is held afterwards.
#[test]
fn a_set_that_can_never_fit_fails_at_once() {
    let rt = runtime();
    for device in devices() {
        let p = pool(&device, 4 * MIB);
        let s = device.create_stream().unwrap();
        match rt.block_on(p.allocate_all_async([(MIB, &s), (5 * MIB, &s)])) {
            Err(Error::OutOfMemory {
                requested, maximum, ..
            }) => {
                assert_eq!(requested, 6 * MIB, "{}", label(&device));
                assert_eq!(maximum, 4 * MIB);
            }
            other => panic!("{}: {other:?}", label(&device)),
        }
        // Each fits alone; together they never will. Fails even while memory is held (it
        // would otherwise wait).
        let held = DeviceBuffer::new(&p, MIB, &s).unwrap();
        match rt.block_on(p.allocate_all_async([(2 * MIB, &s), (2 * MIB, &s), (256, &s)])) {
            Err(Error::OutOfMemory {
                requested, maximum, ..
            }) => {
                assert_eq!(requested, 4 * MIB + 256, "{}", label(&device));
                assert_eq!(maximum, 4 * MIB);
            }
            other => panic!("{}: {other:?}", label(&device)),
        }
        drop(held);
        match rt.block_on(p.allocate_all_async([(usize::MAX / 2, &s), (usize::MAX / 2, &s)])) {
            Err(Error::InvalidSize { .. }) => {}
            other => panic!("{}: {other:?}", label(&device)),
        }
        assert!(rt
            .block_on(p.allocate_all_async(std::iter::empty()))
            .unwrap()
            .is_empty());
        assert!(rt
            .block_on(DeviceBuffer::alloc_all(&p, &[]))
            .unwrap()
            .is_empty());
        let w = p.wait_stats();
        assert_eq!((w.waiting, w.waits, w.timeouts), (0, 0, 0), "{w:?}");
        assert_all_back_within(&p, Duration::from_secs(5), &label(&device));
        // A resource that cannot wait fails as `allocate` does, giving back what it took.
        let plain = CudaResource::new(&device);
        assert!(rt
            .block_on(plain.allocate_all_async([(MIB, &s), (1 << 60, &s)]))
            .is_err());
        // A set on a stream of another device is refused before anything is allocated.
        let other = Device::simulated(Default::default());
        let foreign = other.create_stream().unwrap();
        match rt.block_on(DeviceBuffer::alloc_all(&p, &[(MIB, &s), (MIB, &foreign)])) {
            Err(Error::WrongDevice { .. }) => {}
            other => panic!("{}: {other:?}", label(&device)),
        }
        assert_all_back_within(&p, Duration::from_secs(5), &label(&device));
    }
}

/// While a set waits it holds nothing: with 3 of 4 MiB held, a set of 3 x 1 MiB waits, and a
/// plain `allocate` of the 1 MiB free still succeeds (a set that kept its first piece would
/// have taken it). A dropped waiting set leaves the queue, and the waiter behind it is served.
/// A deadline ends the wait with `Timeout` and nothing held.
#[test]
fn a_waiting_set_holds_nothing_and_is_cancel_safe() {
    let rt = runtime();
    for device in devices() {
        let p = pool(&device, 4 * MIB);
        let s = device.create_stream().unwrap();
        let held = p.allocate(3 * MIB, &s).unwrap();
        let mut set = Box::pin(p.allocate_all_async([(MIB, &s), (MIB, &s), (MIB, &s)]));
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(
            set.as_mut().poll(&mut cx).is_pending(),
            "{}",
            label(&device)
        );
        assert_eq!(p.wait_stats().waiting, 1);
        assert_eq!(p.wait_stats().bytes_waiting, 3 * MIB);
        let one = p.allocate(MIB, &s).expect("the waiting set holds nothing");
        common::free(&*p, one, MIB, &s);

        // A waiter behind the set, then the set is dropped: the waiter gets the memory.
        let behind = {
            let (p, s) = (p.clone(), s.clone());
            rt.spawn(async move { DeviceBuffer::alloc(&p, MIB, &s).await.map(drop) })
        };
        assert!(eventually(Duration::from_secs(5), || p
            .wait_stats()
            .waiting
            == 2));
        drop(set);
        rt.block_on(behind).unwrap().unwrap();
        assert_eq!(p.wait_stats().waiting, 0, "{}", label(&device));

        // A deadline.
        match rt.block_on(
            p.allocate_all_async([(MIB, &s), (MIB, &s)])
                .timeout(Duration::from_millis(20)),
        ) {
            Err(Error::Timeout { .. }) => {}
            other => panic!("{}: {other:?}", label(&device)),
        }
        assert_eq!(p.wait_stats().timeouts, 1);
        assert!(p
            .allocate(MIB, &s)
            .map(|q| common::free(&*p, q, MIB, &s))
            .is_ok());
        common::free(&*p, held, 3 * MIB, &s);
        assert_all_back_within(&p, Duration::from_secs(5), &label(&device));
    }
}

/// A resource wrapper that counts `allocate` calls and forwards everything, its queue too.
#[derive(Debug)]
struct Counting<R> {
    inner: R,
    tries: AtomicUsize,
}

// SAFETY: every allocation is the upstream's, passed on unchanged; this only counts.
unsafe impl<R: MemoryResource> MemoryResource for Counting<R> {
    fn device(&self) -> &Device {
        self.inner.device()
    }
    fn memory_kind(&self) -> MemoryKind {
        self.inner.memory_kind()
    }
    fn allocate(&self, bytes: usize, stream: &Stream) -> streamalloc::Result<DevicePtr> {
        self.tries.fetch_add(1, Ordering::Relaxed);
        self.inner.allocate(bytes, stream)
    }
    unsafe fn deallocate(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        stream: &Stream,
    ) -> streamalloc::Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.deallocate(ptr, bytes, stream) }
    }
    fn memory_waiters(&self) -> Option<&MemoryWaiters> {
        self.inner.memory_waiters()
    }
}

/// The head of the queue gives back the part of its set that fitted without waking itself: a
/// set that half fits, waiting while nothing is freed, makes a bounded number of tries (its
/// first, its retry after registering, and each poll; it is polled here by hand, so a
/// self-wakeup would show as the waker's count growing). With a loud give-back every try
/// would wake it again, in a loop.
#[test]
fn the_head_does_not_wake_itself_with_its_own_give_back() {
    for device in devices() {
        let p = Counting {
            inner: common::pool(&device, 4 * MIB, 4 * MIB),
            tries: AtomicUsize::new(0),
        };
        let s = device.create_stream().unwrap();
        let held = p.allocate(2 * MIB, &s).unwrap();
        p.tries.store(0, Ordering::Relaxed);
        let wakes = Arc::new(AtomicUsize::new(0));
        let waker = futures::task::waker(Arc::new(CountWakes(wakes.clone())));
        let mut cx = Context::from_waker(&waker);
        // 1 + 1 fit in the free 2 MiB, the third does not: each try takes two and gives them
        // back.
        let mut set = Box::pin(p.allocate_all_async([(MIB, &s), (MIB, &s), (MIB, &s)]));
        assert!(set.as_mut().poll(&mut cx).is_pending());
        let tries = p.tries.load(Ordering::Relaxed);
        // First try (3 calls: two succeed, one fails) and the retry after registering first.
        assert_eq!(tries, 6, "{}", label(&device));
        assert_eq!(wakes.load(Ordering::Relaxed), 0, "it woke itself");
        // Polled again without a wakeup (spuriously): no baton, no try.
        assert!(set.as_mut().poll(&mut cx).is_pending());
        assert_eq!(p.tries.load(Ordering::Relaxed), tries);
        assert_eq!(wakes.load(Ordering::Relaxed), 0, "it woke itself");
        // A free wakes it once; it is served.
        common::free(&p, held, 2 * MIB, &s);
        assert_eq!(wakes.load(Ordering::Relaxed), 1);
        let Poll::Ready(Ok(ptrs)) = set.as_mut().poll(&mut cx) else {
            panic!("{}: not served after the free", label(&device))
        };
        for ptr in ptrs {
            common::free(&p, ptr, MIB, &s);
        }
        assert_all_back_within(&p.inner, Duration::from_secs(5), &label(&device));
    }
}

struct CountWakes(Arc<AtomicUsize>);

impl futures::task::ArcWake for CountWakes {
    fn wake_by_ref(this: &Arc<Self>) {
        this.0.fetch_add(1, Ordering::Relaxed);
    }
}

/// Sets on every resource that waits: an arena, a limiting adaptor (its own queue) over plain
/// device memory, and a statistics adaptor over a pool (the pool's queue). Tasks needing two
/// buffers each, more than fit at once: all complete, nothing stays held.
#[test]
fn sets_on_every_waiting_resource() {
    let rt = runtime();
    for device in devices() {
        let arena = Arc::new(
            ArenaResource::new(
                CudaResource::new(&device),
                ArenaOptions {
                    initial: 8 * MIB,
                    maximum: Some(8 * MIB),
                    ..ArenaOptions::default()
                },
            )
            .unwrap(),
        );
        let limited = Arc::new(LimitingAdaptor::new(CudaResource::new(&device), 6 * MIB));
        let stats = Arc::new(StatisticsAdaptor::new(common::pool(
            &device,
            6 * MIB,
            6 * MIB,
        )));
        let resources: Vec<(&str, streamalloc::ResourceRef)> = vec![
            ("arena", arena.clone()),
            ("limiting", limited.clone()),
            ("statistics over pool", stats.clone()),
        ];
        for (name, r) in resources {
            let streams = StreamPool::new(&device, 4).unwrap();
            let outcome = rt.block_on(async {
                tokio::time::timeout(
                    Duration::from_secs(120),
                    futures::future::join_all((0..16).map(|t| {
                        let (r, streams) = (r.clone(), streams.clone());
                        async move {
                            let s = streams.get_by_index(t);
                            for _ in 0..4 {
                                let set = DeviceBuffer::alloc_all(&r, &[(2 * MIB, &s), (MIB, &s)])
                                    .await
                                    .unwrap();
                                s.spin(Duration::from_micros(50)).unwrap();
                                s.synchronize().await.unwrap();
                                drop(set);
                            }
                        }
                    })),
                )
                .await
            });
            assert!(outcome.is_ok(), "{} on {name}: hung", label(&device));
            assert!(
                r.memory_waiters().unwrap().is_empty(),
                "{} on {name}",
                label(&device)
            );
        }
        assert!(eventually(Duration::from_secs(5), || limited.used() == 0));
        assert!(eventually(Duration::from_secs(5), || stats
            .bytes_counter()
            .value
            == 0));
        assert_all_back_within(stats.upstream(), Duration::from_secs(5), &label(&device));
        common::assert_arena_all_back(&arena, &label(&device));
    }
}

#[test]
fn the_allocate_all_future_is_send() {
    fn send<T: Send>(_: &T) {}
    let device = Device::simulated(Default::default());
    let p = pool(&device, MIB);
    let s = device.create_stream().unwrap();
    send(&p.allocate_all_async([(256, &s), (512, &s)]));
    send(
        &p.allocate_all_async([(256, &s)])
            .timeout(Duration::from_secs(1)),
    );
    let erased: streamalloc::ResourceRef = p.clone();
    send(&erased.allocate_all_async([(256, &s)]));
    send(&DeviceBuffer::alloc_all(&erased, &[(256, &s)]));
}

/// A set whose second allocation panics (caught by the caller): the first goes back to the
/// pool. It used to be kept: a try gave back what it took only on an error.
#[test]
fn a_set_whose_allocation_panics_gives_back_what_it_took() {
    let rt = runtime();
    for device in devices() {
        let p = pool(&device, 16 * MIB);
        let panicking = common::PanicsOnCall::new(p.clone(), 2);
        let s = device.create_stream().unwrap();
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            rt.block_on(panicking.allocate_all_async([(4 * MIB, &s), (2 * MIB, &s)]))
        }));
        assert!(
            caught.is_err(),
            "{}: the second allocation panics",
            label(&device)
        );
        assert_all_back_within(&p, Duration::from_secs(5), &label(&device));
    }
}

/// A set of requests of 0 bytes each is served at once (null pointers), as one request of 0
/// bytes is, even behind a waiter for memory that may never come (a review found it queued).
#[test]
fn a_set_of_empty_requests_never_waits() {
    for device in devices() {
        let p = pool(&device, MIB);
        let s = device.create_stream().unwrap();
        let held = p.allocate(MIB, &s).unwrap();
        let mut waiter = std::pin::pin!(p.allocate_async(4096, &s));
        assert!(common::poll_once(waiter.as_mut()).is_pending());
        let requests = [(0usize, &s)];
        let mut set = std::pin::pin!(DeviceBuffer::alloc_all(&p, &requests));
        match common::poll_once(set.as_mut()) {
            Poll::Ready(Ok(buffers)) => assert_eq!(buffers.len(), 1),
            other => panic!(
                "{}: a set of one empty request: {:?}",
                label(&device),
                other.map(|r| r.map(|b| b.len()))
            ),
        }
        let mut two = std::pin::pin!(p.allocate_all_async([(0usize, &s), (0, &s)]));
        assert!(
            matches!(common::poll_once(two.as_mut()), Poll::Ready(Ok(ref ptrs)) if ptrs.len() == 2),
            "{}: a set of two empty requests waited",
            label(&device)
        );
        common::free(&*p, held, MIB, &s);
    }
}
