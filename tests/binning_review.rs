//! Review of `BinningResource` with awaitable allocation: a request through the binning
//! resource waits for memory (as one through its fixed-size bins or its pool would) and is
//! woken when memory comes back through a bin, through the upstream, or by a request ahead of
//! it leaving; an all-or-nothing set through it fails at once when it can never fit.

mod common;

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use common::{devices, free, label, pool};
use streamalloc::resource::binning::BinningResource;
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::PoolResource;
use streamalloc::{AllocateAsync, Device, DevicePtr, Error, MemoryResource};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// A waker that counts its wakes.
#[derive(Default)]
struct Count(AtomicUsize);

impl Wake for Count {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn counter() -> (Arc<Count>, Waker) {
    let count = Arc::new(Count::default());
    (count.clone(), Waker::from(count))
}

fn woken(count: &Count) -> usize {
    count.0.load(Ordering::SeqCst)
}

/// A binning resource over a pool of exactly `pool_bytes` (all of it taken at once): bins of
/// 256 KiB and 512 KiB taking `blocks` blocks a chunk; larger requests go to the pool.
fn binning(
    device: &Device,
    pool_bytes: usize,
    blocks: usize,
) -> BinningResource<PoolResource<CudaResource>> {
    BinningResource::builder(pool(device, pool_bytes, pool_bytes))
        .bins_pow2(18, 19)
        .blocks_per_chunk(blocks)
        .build()
        .unwrap()
}

/// The 256 KiB bin full and the pool full: a request for the bin waits (it could be served
/// once a block comes back), and a block freed through the binning resource wakes it.
#[test]
fn a_request_through_a_full_bin_waits_and_a_free_through_the_bin_wakes_it() {
    for device in devices() {
        let at = label(&device);
        // One chunk of four 256 KiB blocks: the whole pool.
        let b = binning(&device, MIB, 4);
        let s = device.create_stream().unwrap();
        let held: Vec<DevicePtr> = (0..4).map(|_| b.allocate(200 * KIB, &s).unwrap()).collect();
        assert!(matches!(
            b.allocate(1000, &s),
            Err(Error::OutOfMemory { .. })
        ));
        let (count, waker) = counter();
        let mut cx = Context::from_waker(&waker);
        let mut fut = pin!(b.allocate_async(1000, &s));
        assert!(
            fut.as_mut().poll(&mut cx).is_pending(),
            "{at}: a request the bin could serve once a block comes back failed at once"
        );
        free(&b, held[0], 200 * KIB, &s);
        assert!(
            woken(&count) > 0,
            "{at}: the free through the bin woke nobody"
        );
        let Poll::Ready(Ok(ptr)) = fut.as_mut().poll(&mut cx) else {
            panic!("{at}: woken but not served");
        };
        free(&b, ptr, 1000, &s);
        for &p in &held[1..] {
            free(&b, p, 200 * KIB, &s);
        }
        assert!(b.memory_waiters().unwrap().is_empty());
    }
}

/// The pool holds the bin's chunk and a large allocation of the fallback: a request that needs
/// a new chunk for the bin waits, and is woken when the large allocation goes back to the pool
/// (through the binning resource, or straight into the pool by another of its users).
#[test]
fn a_request_for_a_new_chunk_is_woken_by_memory_coming_back_to_the_upstream() {
    for device in devices() {
        let at = label(&device);
        let b = binning(&device, 2 * MIB, 4);
        let s = device.create_stream().unwrap();
        let held: Vec<DevicePtr> = (0..4).map(|_| b.allocate(256 * KIB, &s).unwrap()).collect();
        for through_the_pool in [false, true] {
            let big = if through_the_pool {
                b.upstream().allocate(MIB, &s).unwrap()
            } else {
                b.allocate(MIB, &s).unwrap()
            };
            let (count, waker) = counter();
            let mut cx = Context::from_waker(&waker);
            let mut fut = pin!(b.allocate_async(100 * KIB, &s));
            assert!(
                fut.as_mut().poll(&mut cx).is_pending(),
                "{at}: a request the pool could serve once memory comes back failed at once"
            );
            if through_the_pool {
                free(b.upstream(), big, MIB, &s);
            } else {
                free(&b, big, MIB, &s);
            }
            assert!(
                woken(&count) > 0,
                "{at}: memory back in the pool (through the pool: {through_the_pool}) woke nobody"
            );
            let Poll::Ready(Ok(ptr)) = fut.as_mut().poll(&mut cx) else {
                panic!("{at}: woken but not served");
            };
            // The bin keeps its new chunk (a fixed-size resource returns chunks at drop only):
            // give the block back; the next round's large allocation needs the other MiB.
            free(&b, ptr, 100 * KIB, &s);
            if !through_the_pool {
                // The bin now holds the whole pool: end here.
                break;
            }
        }
        for p in held {
            free(&b, p, 256 * KIB, &s);
        }
    }
}

/// Two requests wait, for different bins: when the head is served by a block freed through its
/// bin, it passes the wake-up on, and the request behind it (for the other bin) is woken by a
/// block freed through that other bin.
#[test]
fn waiters_for_two_bins_are_each_woken_by_their_bins_frees() {
    for device in devices() {
        let at = label(&device);
        // The 256 KiB bin's chunk (512 KiB) and the 512 KiB bin's (1 MiB) fill the pool.
        let b = binning(&device, 3 * MIB / 2, 2);
        let s = device.create_stream().unwrap();
        let small: Vec<DevicePtr> = (0..2).map(|_| b.allocate(256 * KIB, &s).unwrap()).collect();
        let large: Vec<DevicePtr> = (0..2).map(|_| b.allocate(512 * KIB, &s).unwrap()).collect();
        let (count_a, waker_a) = counter();
        let (count_b, waker_b) = counter();
        let mut a = pin!(b.allocate_async(256 * KIB, &s));
        let mut c = pin!(b.allocate_async(512 * KIB, &s));
        assert!(a
            .as_mut()
            .poll(&mut Context::from_waker(&waker_a))
            .is_pending());
        assert!(c
            .as_mut()
            .poll(&mut Context::from_waker(&waker_b))
            .is_pending());
        free(&b, small[0], 256 * KIB, &s);
        assert!(woken(&count_a) > 0, "{at}: the head was not woken");
        let Poll::Ready(Ok(pa)) = a.as_mut().poll(&mut Context::from_waker(&waker_a)) else {
            panic!("{at}: the head was woken but not served");
        };
        free(&b, large[0], 512 * KIB, &s);
        assert!(woken(&count_b) > 0, "{at}: the second waiter was not woken");
        let Poll::Ready(Ok(pc)) = c.as_mut().poll(&mut Context::from_waker(&waker_b)) else {
            panic!("{at}: the second waiter was woken but not served");
        };
        free(&b, pa, 256 * KIB, &s);
        free(&b, pc, 512 * KIB, &s);
        free(&b, small[1], 256 * KIB, &s);
        free(&b, large[1], 512 * KIB, &s);
        assert!(b.memory_waiters().unwrap().is_empty());
    }
}

/// A cancelled waiter passes its wake-up on: the request behind it is served.
#[test]
fn a_cancelled_head_passes_its_wake_up_to_the_next_waiter() {
    for device in devices() {
        let at = label(&device);
        let b = binning(&device, MIB, 4);
        let s = device.create_stream().unwrap();
        let held: Vec<DevicePtr> = (0..4).map(|_| b.allocate(256 * KIB, &s).unwrap()).collect();
        let (_, waker_a) = counter();
        let (count_b, waker_b) = counter();
        let mut second = pin!(b.allocate_async(256 * KIB, &s));
        {
            let mut first = pin!(b.allocate_async(256 * KIB, &s));
            assert!(first
                .as_mut()
                .poll(&mut Context::from_waker(&waker_a))
                .is_pending());
            assert!(second
                .as_mut()
                .poll(&mut Context::from_waker(&waker_b))
                .is_pending());
            free(&b, held[0], 256 * KIB, &s);
            // Dropped with the baton.
        }
        assert!(woken(&count_b) > 0, "{at}: the wake-up was swallowed");
        let Poll::Ready(Ok(p)) = second.as_mut().poll(&mut Context::from_waker(&waker_b)) else {
            panic!("{at}: not served");
        };
        free(&b, p, 256 * KIB, &s);
        for &p in &held[1..] {
            free(&b, p, 256 * KIB, &s);
        }
        assert!(b.memory_waiters().unwrap().is_empty());
    }
}

/// An all-or-nothing set through the binning resource: sets that fit are served, and one that
/// waits for a free is woken by it; one that can never fit (more blocks than the pool holds)
/// fails at once instead of waiting for ever.
#[test]
fn an_all_or_nothing_set_through_binning() {
    for device in devices() {
        let at = label(&device);
        // One 256 KiB block a chunk: four chunks fill the pool.
        let b = binning(&device, MIB, 1);
        let s = device.create_stream().unwrap();
        // Five small requests need five 256 KiB blocks: more than the pool holds.
        let (_, waker) = counter();
        {
            let mut never = pin!(b.allocate_all_async((0..5).map(|_| (1usize, &s))));
            match never.as_mut().poll(&mut Context::from_waker(&waker)) {
                Poll::Ready(Err(Error::OutOfMemory { .. })) => {}
                Poll::Ready(other) => panic!("{at}: {other:?}"),
                Poll::Pending => panic!("{at}: a set that can never fit waits"),
            }
        }
        assert!(b.memory_waiters().unwrap().is_empty());
        // Three of the four blocks held: a set of two waits, holding nothing, and is served
        // once one comes back.
        let held: Vec<DevicePtr> = (0..3).map(|_| b.allocate(256 * KIB, &s).unwrap()).collect();
        let (count, waker) = counter();
        let mut cx = Context::from_waker(&waker);
        let mut set = pin!(b.allocate_all_async([(1000usize, &s), (100 * KIB, &s)]));
        assert!(set.as_mut().poll(&mut cx).is_pending(), "{at}");
        // It gave back what it took: the free block is there for a plain allocation.
        let p = b.allocate(256 * KIB, &s).unwrap();
        free(&b, p, 256 * KIB, &s);
        free(&b, held[0], 256 * KIB, &s);
        assert!(woken(&count) > 0, "{at}: the set was not woken");
        let Poll::Ready(Ok(got)) = set.as_mut().poll(&mut cx) else {
            panic!("{at}: woken but not served");
        };
        free(&b, got[0], 1000, &s);
        free(&b, got[1], 100 * KIB, &s);
        for &p in &held[1..] {
            free(&b, p, 256 * KIB, &s);
        }
        assert!(b.memory_waiters().unwrap().is_empty());
    }
}
