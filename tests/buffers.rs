//! `DeviceBuffer`, `DeviceVec`, `DeviceScalar` on every available device.

mod common;

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use common::{devices, eventually, label, runtime};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::PoolResource;
use streamalloc::{Device, DeviceBuffer, DeviceScalar, DeviceVec, Error, SimConfig};

const MIB: usize = 1 << 20;

fn pool(device: &Device, initial: usize, maximum: usize) -> Arc<PoolResource<CudaResource>> {
    Arc::new(common::pool(device, initial, maximum))
}

#[test]
fn round_trips_of_vectors_and_scalars() {
    let rt = runtime();
    for device in devices() {
        let p = pool(&device, 16 * MIB, 64 * MIB);
        let s = device.create_stream().unwrap();
        let data: Vec<f32> = (0..100_000).map(|i| i as f32 * 0.5).collect();
        let v = DeviceVec::from_host(&p, &data, &s).unwrap();
        assert_eq!(v.len(), data.len());
        assert_eq!(
            rt.block_on(v.to_host(&s)).unwrap(),
            data,
            "{}",
            label(&device)
        );

        // On another stream: ordered after the vector's own.
        let t = device.create_stream().unwrap();
        assert_eq!(rt.block_on(v.to_host(&t)).unwrap(), data);

        let z = DeviceVec::<u64>::zeroed(&p, 1000, &s).unwrap();
        assert!(rt.block_on(z.to_host(&s)).unwrap().iter().all(|&x| x == 0));

        let mut w = v.try_clone().unwrap();
        w.resize(10).unwrap();
        assert_eq!(rt.block_on(w.to_host(&s)).unwrap(), data[..10]);
        w.resize(20).unwrap();
        assert_eq!(rt.block_on(w.to_host(&s)).unwrap()[..10], data[..10]);

        let mut x = DeviceScalar::from_value(&p, 42u32, &s).unwrap();
        assert_eq!(rt.block_on(x.value()).unwrap(), 42);
        x.set(7).unwrap();
        assert_eq!(rt.block_on(x.value()).unwrap(), 7);

        let mut b = DeviceBuffer::new(&p, 4096, &s).unwrap();
        b.memset(0x5A).unwrap();
        assert!(rt.block_on(b.to_host()).unwrap().iter().all(|&x| x == 0x5A));
        b.copy_from_host(&[1u8; 4096]).unwrap();
        assert!(rt.block_on(b.to_host()).unwrap().iter().all(|&x| x == 1));
        assert!(matches!(
            b.copy_from_host(&[0u8; 10]),
            Err(Error::InvalidSize { .. })
        ));
        drop((v, z, w, x, b));
        s.synchronize_blocking().unwrap();
        t.synchronize_blocking().unwrap();
        common::assert_all_back_within(&p, Duration::from_secs(5), &label(&device));
    }
}

#[test]
fn zero_length_and_overflow() {
    for device in devices() {
        let p = pool(&device, 0, 16 * MIB);
        let s = device.create_stream().unwrap();
        let empty = DeviceVec::<f64>::new(&p, 0, &s).unwrap();
        assert!(empty.is_empty() && empty.as_ptr().0 == 0);
        assert!(matches!(
            DeviceVec::<u64>::new(&p, usize::MAX / 4, &s),
            Err(Error::InvalidSize { .. })
        ));
        let other = Device::simulated(SimConfig::default())
            .create_stream()
            .unwrap();
        assert!(matches!(
            DeviceBuffer::new(&p, 256, &other),
            Err(Error::WrongDevice { .. })
        ));
    }
}

/// A buffer used on stream K (a spin, then a fill) and dropped at once: its memory must not be
/// handed out again until K is done with it. With one block in the pool, the next allocation
/// fails until then; once it gets the memory and writes its own pattern, K's late fill must not
/// land on top.
#[test]
fn a_drop_waits_for_every_recorded_stream() {
    let rt = runtime();
    for device in devices() {
        let words = 64 * 1024;
        let bytes = words * 4;
        let p = pool(&device, bytes, bytes);
        let (a, k) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        // K's spin keeps the memory in use for at least `spin` after its launch; the check
        // below must come before that. A host slower than the spin (a fresh H200 with the
        // other tests starting at once took over 30 ms for a few calls, run31) is no failure:
        // the spin lengthens. Memory back before the spin's time is.
        let mut checked = false;
        for spin in [100u64, 1000, 5000] {
            let mut x = DeviceBuffer::new(&p, bytes, &a).unwrap();
            let addr = x.as_ptr();
            k.wait(&a.record().unwrap()).unwrap();
            let launched = Instant::now();
            k.spin(Duration::from_millis(spin)).unwrap();
            // SAFETY: `x`'s memory, used on K, which is recorded on `x` before it is dropped.
            unsafe { k.fill_u32(addr, 0xAAAA_AAAA, words) }.unwrap();
            x.record_stream(&k).unwrap();
            drop(x);
            match DeviceBuffer::new(&p, bytes, &a) {
                Err(Error::OutOfMemory { .. }) => {}
                Ok(early) => {
                    let after = launched.elapsed();
                    assert!(
                        after >= Duration::from_millis(spin),
                        "{}: the memory came back {after:?} after the launch of a {spin} ms \
                         spin, while K still used it",
                        label(&device)
                    );
                    println!(
                        "{}: the host took {after:?}, past a {spin} ms spin: a longer one",
                        label(&device)
                    );
                    drop(early);
                    a.synchronize_blocking().unwrap();
                    continue;
                }
                Err(e) => panic!("{}: {e}", label(&device)),
            }
            // Waiting for it: it comes when K's work completes, through the reactor.
            let y = rt.block_on(DeviceBuffer::alloc(&p, bytes, &a)).unwrap();
            assert_eq!(y.as_ptr(), addr);
            let mut y = y;
            // SAFETY: `y`'s memory, used on A.
            unsafe { a.fill_u32(y.as_ptr(), 0xBBBB_BBBB, words) }.unwrap();
            // Had the memory come back before K finished, K's late fill would land now.
            k.synchronize_blocking().unwrap();
            let back = rt.block_on(y.to_host()).unwrap();
            assert!(
                back.chunks(4).all(|w| w == [0xBB; 4]),
                "{}: K's fill landed on the new owner's data",
                label(&device)
            );
            y.memset(0).unwrap();
            drop(y);
            checked = true;
            break;
        }
        assert!(
            checked,
            "{}: the host never came before a 5 s spin",
            label(&device)
        );
        a.synchronize_blocking().unwrap();
        common::assert_all_back_within(&p, Duration::from_secs(5), "all back");
    }
}

#[test]
fn memory_comes_back_exactly_once_whatever_the_order() {
    for device in devices() {
        let p = pool(&device, 32 * MIB, 32 * MIB);
        let streams: Vec<_> = (0..4).map(|_| device.create_stream().unwrap()).collect();
        std::thread::scope(|scope| {
            for t in 0..4 {
                let (p, streams) = (p.clone(), streams.clone());
                scope.spawn(move || {
                    for i in 0..100 {
                        let mut b = DeviceBuffer::new(&p, 64 << 10, &streams[t]).unwrap();
                        // Used on one or two other streams, moved between them.
                        b.record_stream(&streams[(t + 1) % 4]).unwrap();
                        if i % 3 == 0 {
                            streams[(t + 2) % 4]
                                .spin(Duration::from_micros(50))
                                .unwrap();
                            b.record_stream(&streams[(t + 2) % 4]).unwrap();
                        }
                        if i % 5 == 0 {
                            b.set_stream(&streams[(t + 3) % 4]).unwrap();
                        }
                        drop(b);
                    }
                });
            }
        });
        for s in &streams {
            s.synchronize_blocking().unwrap();
        }
        common::assert_all_back_within(&p, Duration::from_secs(5), &label(&device));
        p.check_invariants().unwrap();
    }
}

#[test]
fn alloc_waits_for_a_free() {
    let rt = runtime();
    for device in devices() {
        let p = pool(&device, 4 * MIB, 4 * MIB);
        let s = device.create_stream().unwrap();
        let held = DeviceBuffer::new(&p, 4 * MIB, &s).unwrap();
        let p2 = p.clone();
        let s2 = device.create_stream().unwrap();
        let waiter = rt.spawn(async move {
            DeviceBuffer::alloc(&p2, 4 * MIB, &s2)
                .await
                .map(|b| b.len())
        });
        assert!(
            eventually(Duration::from_secs(5), || p.wait_stats().waiting == 1),
            "{}",
            label(&device)
        );
        drop(held);
        assert_eq!(
            rt.block_on(waiter).unwrap().unwrap(),
            4 * MIB,
            "{}",
            label(&device)
        );
        assert_eq!(p.wait_stats().waits, 1);
        // More than the pool could ever hold fails at once; a deadline ends a wait.
        assert!(matches!(
            rt.block_on(DeviceBuffer::alloc(&p, 8 * MIB, &s)),
            Err(Error::OutOfMemory { .. })
        ));
        let _held = DeviceBuffer::new(&p, 4 * MIB, &s).unwrap();
        let timed = rt.block_on(DeviceBuffer::alloc_timeout(
            &p,
            MIB,
            &s,
            Duration::from_millis(50),
        ));
        match timed {
            Err(Error::Timeout { waited }) => assert!(waited >= Duration::from_millis(50)),
            other => panic!("{}: {other:?}", label(&device)),
        }
        assert_eq!(p.wait_stats().waiting, 0);
    }
}

#[test]
fn a_cancelled_copy_to_host_does_not_corrupt_staging() {
    let rt = runtime();
    for device in devices() {
        let p = pool(&device, 8 * MIB, 8 * MIB);
        let s = device.create_stream().unwrap();
        let v = DeviceVec::from_host(&p, &vec![3u32; 1 << 18], &s).unwrap();
        s.spin(Duration::from_millis(50)).unwrap();
        {
            let mut fut = Box::pin(v.to_host(&s));
            let waker = futures::task::noop_waker();
            assert!(fut
                .as_mut()
                .poll(&mut Context::from_waker(&waker))
                .is_pending());
            // Dropped while the copy into its staging block is still queued.
        }
        // Another copy right away must see its own data, not the first one's in-flight bytes.
        let w = DeviceVec::from_host(&p, &vec![9u32; 1 << 18], &s).unwrap();
        assert!(
            rt.block_on(w.to_host(&s)).unwrap().iter().all(|&x| x == 9),
            "{}",
            label(&device)
        );
        assert!(
            rt.block_on(v.to_host(&s)).unwrap().iter().all(|&x| x == 3),
            "{}",
            label(&device)
        );
        assert!(matches!(
            std::pin::pin!(v.to_host(&s))
                .poll(&mut Context::from_waker(&futures::task::noop_waker())),
            Poll::Pending | Poll::Ready(Ok(_))
        ));
    }
}

#[test]
fn buffers_and_their_futures_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>(_: &T) {}
    send_sync::<DeviceBuffer>();
    send_sync::<DeviceVec<f32>>();
    send_sync::<DeviceScalar<u64>>();
    let device = Device::simulated(SimConfig::default());
    let p = pool(&device, 0, MIB);
    let s = device.create_stream().unwrap();
    send(&DeviceBuffer::alloc(&p, 256, &s));
    let v = DeviceVec::<u8>::new(&p, 16, &s).unwrap();
    send(&v.to_host(&s));
}

// The cudarc launch on our buffers (and on our stream, with no synchronization) is in
// tests/cudarc_interop.rs.

/// `set_stream` orders the new stream after the old one: a buffer the pool handed out on the
/// old stream straight from a free there (no ordering: stream order) may still be written by
/// the previous owner's queued work. A review found the safe `memset` on the new stream racing
/// that work, and losing to it.
#[test]
fn set_stream_orders_the_new_stream_after_the_old() {
    for device in devices() {
        let p = pool(&device, 16 << 20, 64 << 20);
        let (s1, s2) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let mut a = DeviceBuffer::new(&p, 1 << 20, &s1).unwrap();
        let at = a.as_ptr();
        s1.spin(Duration::from_millis(200)).unwrap();
        a.memset(1).unwrap();
        drop(a); // freed on `s1`, its memset still queued there
        let mut b = DeviceBuffer::new(&p, 1 << 20, &s1).unwrap();
        assert_eq!(
            b.as_ptr(),
            at,
            "{}: the same block, reused in stream order",
            label(&device)
        );
        b.set_stream(&s2).unwrap();
        b.memset(2).unwrap();
        s1.synchronize_blocking().unwrap();
        let back = runtime().block_on(b.to_host()).unwrap();
        assert!(
            back.iter().all(|&v| v == 2),
            "{}: the old stream's queued write landed after the new stream's",
            label(&device)
        );
    }
}

/// A clone onto another stream reads the source before the writes queued on the source's own
/// stream after it: `try_clone_to` returns with its copy still queued behind a busy stream,
/// and the source's `memset` must wait for that copy. A review found the clone holding the
/// later bytes (the source's stream was not ordered after the read).
#[test]
fn a_clone_onto_another_stream_is_not_overtaken_by_later_writes() {
    let rt = runtime();
    for device in devices() {
        let p = pool(&device, 0, 64 * MIB);
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let mut buf = DeviceBuffer::new(&p, MIB, &a).unwrap();
        buf.memset(1).unwrap();
        b.spin(Duration::from_millis(200)).unwrap();
        let copy = buf.try_clone_to(&p, &b).unwrap();
        buf.memset(2).unwrap();
        let got = rt.block_on(copy.to_host()).unwrap();
        assert!(
            got.iter().all(|&x| x == 1),
            "{}: the clone holds {}",
            label(&device),
            got[0]
        );
        assert!(rt.block_on(buf.to_host()).unwrap().iter().all(|&x| x == 2));
    }
}
