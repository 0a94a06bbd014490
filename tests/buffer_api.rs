//! Issue 20's buffer and vector API beside RMM's (single elements; capacity, reserve and
//! shrink_to_fit; a copy onto another stream and resource; a buffer copied from a raw device
//! pointer), on every available device.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{devices, eventually, label, runtime};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::PoolResource;
use streamalloc::{Device, DeviceBuffer, DeviceVec, Error, SimConfig};

const MIB: usize = 1 << 20;

fn pool(device: &Device, maximum: usize) -> Arc<PoolResource<CudaResource>> {
    pool_with(device, 0, maximum)
}

fn pool_with(device: &Device, initial: usize, maximum: usize) -> Arc<PoolResource<CudaResource>> {
    Arc::new(common::pool(device, initial, maximum))
}

/// Bytes handed out by the pool right now.
fn used(p: &PoolResource<CudaResource>) -> usize {
    let s = p.stats();
    s.reserved - s.free
}

#[test]
fn single_elements_are_read_and_written_in_stream_order() {
    let rt = runtime();
    for device in devices() {
        let l = label(&device);
        let p = pool(&device, 64 * MIB);
        let s = device.create_stream().unwrap();
        let data: Vec<u32> = (0..10_000).collect();
        let mut v = DeviceVec::from_host(&p, &data, &s).unwrap();
        assert_eq!(rt.block_on(v.element(0)).unwrap(), 0, "{l}");
        assert_eq!(rt.block_on(v.element(4321)).unwrap(), 4321, "{l}");
        assert_eq!(rt.block_on(v.first()).unwrap(), Some(0), "{l}");
        assert_eq!(rt.block_on(v.last()).unwrap(), Some(9999), "{l}");

        // Work queued before a read is seen by it; a write is seen by work queued after it.
        s.spin(Duration::from_millis(20)).unwrap();
        // SAFETY: 10,000 live words of `v`, used in order on its stream.
        unsafe { s.fill_u32(v.as_ptr(), 5, data.len()) }.unwrap();
        assert_eq!(rt.block_on(v.element(17)).unwrap(), 5, "{l}");
        v.set_element(3, 9).unwrap();
        v.set_element(9999, 11).unwrap();
        assert_eq!(rt.block_on(v.element(3)).unwrap(), 9, "{l}");
        assert_eq!(rt.block_on(v.last()).unwrap(), Some(11), "{l}");
        let host = rt.block_on(v.to_host(&s)).unwrap();
        assert!(
            host.iter()
                .enumerate()
                .all(|(i, &x)| x == [5, 9, 11][(i == 3) as usize + 2 * (i == 9999) as usize]),
            "{l}: one element written, the others as filled"
        );

        // Bad indices: typed errors with the numbers, nothing queued, no panic.
        let err = rt.block_on(v.element(10_000)).unwrap_err();
        assert_eq!(
            err,
            Error::IndexOutOfBounds {
                index: 10_000,
                len: 10_000
            },
            "{l}"
        );
        assert!(err.to_string().contains("10000"), "{err}");
        assert!(matches!(
            v.set_element(usize::MAX, 1),
            Err(Error::IndexOutOfBounds {
                index: usize::MAX,
                len: 10_000
            })
        ));

        let mut empty = DeviceVec::<f64>::new(&p, 0, &s).unwrap();
        assert_eq!(rt.block_on(empty.first()).unwrap(), None, "{l}");
        assert_eq!(rt.block_on(empty.last()).unwrap(), None, "{l}");
        assert!(matches!(
            rt.block_on(empty.element(0)),
            Err(Error::IndexOutOfBounds { index: 0, len: 0 })
        ));
        assert!(matches!(
            empty.set_element(0, 1.0),
            Err(Error::IndexOutOfBounds { index: 0, len: 0 })
        ));

        // A struct element, at an offset that is not a multiple of 256.
        #[derive(Clone, Copy, Debug, PartialEq)]
        #[repr(C)]
        struct Pair {
            a: u32,
            b: f32,
        }
        // SAFETY: `repr(C)`, two 4-byte fields, no padding; every bit pattern is valid.
        unsafe impl bytemuck::Zeroable for Pair {}
        // SAFETY: as above, and `Copy + 'static`.
        unsafe impl bytemuck::Pod for Pair {}
        let pairs: Vec<Pair> = (0..100)
            .map(|i| Pair {
                a: i,
                b: i as f32 / 2.0,
            })
            .collect();
        let mut pv = DeviceVec::from_host(&p, &pairs, &s).unwrap();
        assert_eq!(rt.block_on(pv.element(33)).unwrap(), pairs[33], "{l}");
        pv.set_element(33, Pair { a: 1, b: 2.0 }).unwrap();
        let back = rt.block_on(pv.to_host(&s)).unwrap();
        assert_eq!(back[33], Pair { a: 1, b: 2.0 }, "{l}");
        assert_eq!((back[32], back[34]), (pairs[32], pairs[34]), "{l}");

        drop((v, empty, pv));
        s.synchronize_blocking().unwrap();
        common::assert_all_back_within(&p, Duration::from_secs(5), &l);
    }
}

#[test]
fn resize_smaller_keeps_the_pointer_and_shrink_to_fit_reallocates() {
    let rt = runtime();
    for device in devices() {
        let l = label(&device);
        let p = pool(&device, 64 * MIB);
        let s = device.create_stream().unwrap();
        let data: Vec<u64> = (0..1000).map(|i| i * 3).collect();
        let mut v = DeviceVec::from_host(&p, &data, &s).unwrap();
        let ptr = v.as_ptr();
        assert_eq!((v.len(), v.capacity()), (1000, 1000), "{l}");
        let held = used(&p);

        // RMM's ResizeSmaller: same memory, same address, capacity kept.
        v.resize(10).unwrap();
        assert_eq!((v.len(), v.capacity(), v.as_ptr()), (10, 1000, ptr), "{l}");
        assert_eq!(rt.block_on(v.to_host(&s)).unwrap(), data[..10], "{l}");
        assert_eq!(used(&p), held, "{l}: resize to smaller gave nothing back");
        // Growing within the capacity does not move it either.
        v.resize(500).unwrap();
        assert_eq!((v.capacity(), v.as_ptr()), (1000, ptr), "{l}");
        assert_eq!(rt.block_on(v.to_host(&s)).unwrap()[..10], data[..10], "{l}");

        // shrink_to_fit is the one that reallocates; the contents come along.
        v.resize(10).unwrap();
        v.shrink_to_fit().unwrap();
        assert_eq!((v.len(), v.capacity()), (10, 10), "{l}");
        assert_eq!(rt.block_on(v.to_host(&s)).unwrap(), data[..10], "{l}");
        s.synchronize_blocking().unwrap();
        assert!(
            eventually(Duration::from_secs(5), || used(&p) < held),
            "{l}: the old memory came back: {:?}",
            p.stats()
        );
        let at = v.as_ptr();
        v.shrink_to_fit().unwrap(); // already tight: nothing moves
        assert_eq!(v.as_ptr(), at, "{l}");

        // reserve: room past the length, contents kept, later growth without moving.
        v.reserve(990).unwrap();
        assert_eq!((v.len(), v.capacity()), (10, 1000), "{l}");
        let at = v.as_ptr();
        v.resize(1000).unwrap();
        assert_eq!(v.as_ptr(), at, "{l}");
        assert_eq!(rt.block_on(v.to_host(&s)).unwrap()[..10], data[..10], "{l}");
        v.reserve(0).unwrap();
        assert_eq!(
            v.as_ptr(),
            at,
            "{l}: reserve within the capacity does nothing"
        );
        assert!(matches!(
            v.reserve(usize::MAX),
            Err(Error::InvalidSize { .. })
        ));
        assert!(matches!(
            v.reserve(usize::MAX / 8),
            Err(Error::InvalidSize { .. })
        ));
        assert_eq!((v.len(), v.capacity(), v.as_ptr()), (1000, 1000, at), "{l}");
        // Past the capacity: a new allocation of exactly the new length.
        v.resize(1500).unwrap();
        assert_eq!((v.len(), v.capacity()), (1500, 1500), "{l}");
        assert_eq!(rt.block_on(v.to_host(&s)).unwrap()[..10], data[..10], "{l}");

        // To nothing: an empty vector holds no memory.
        v.resize(0).unwrap();
        v.shrink_to_fit().unwrap();
        assert_eq!((v.len(), v.capacity(), v.as_ptr().0), (0, 0, 0), "{l}");

        // The same on an untyped buffer.
        let mut b = DeviceBuffer::new(&p, 4096, &s).unwrap();
        b.memset(0xAB).unwrap();
        let bp = b.as_ptr();
        b.resize(100).unwrap();
        assert_eq!((b.len(), b.capacity(), b.as_ptr()), (100, 4096, bp), "{l}");
        assert_eq!(rt.block_on(b.to_host()).unwrap(), vec![0xAB; 100], "{l}");
        b.shrink_to_fit().unwrap();
        assert_eq!((b.len(), b.capacity()), (100, 100), "{l}");
        b.reserve(156).unwrap();
        assert_eq!((b.len(), b.capacity()), (100, 256), "{l}");
        assert_eq!(rt.block_on(b.to_host()).unwrap(), vec![0xAB; 100], "{l}");
        assert!(matches!(
            b.reserve(usize::MAX),
            Err(Error::InvalidSize { .. })
        ));

        // A buffer of a smaller length but a larger allocation gives it all back: the parts
        // carry the allocation's size.
        let mut c = DeviceBuffer::new(&p, 8192, &s).unwrap();
        c.resize(1).unwrap();
        let (ptr, bytes, resource, stream) = c.into_raw_parts().unwrap();
        assert_eq!(bytes, 8192, "{l}");
        // SAFETY: the parts of a buffer, taken back whole.
        drop(unsafe { DeviceBuffer::from_raw_parts(ptr, bytes, resource, &stream) });

        drop((v, b));
        s.synchronize_blocking().unwrap();
        common::assert_all_back_within(&p, Duration::from_secs(5), &l);
    }
}

/// A resize that fails (the pool is full) leaves the vector as it was.
#[test]
fn a_failed_reallocation_changes_nothing() {
    let rt = runtime();
    for device in devices() {
        let l = label(&device);
        let p = pool_with(&device, MIB, MIB); // one chunk, never grown
        let s = device.create_stream().unwrap();
        let mut v = DeviceVec::from_host(&p, &[1u32, 2, 3], &s).unwrap();
        let hog = DeviceBuffer::new(&p, MIB - 256, &s).unwrap();
        let at = v.as_ptr();
        assert!(v.resize(1 << 16).unwrap_err().is_out_of_memory(), "{l}");
        assert!(v.reserve(1 << 16).unwrap_err().is_out_of_memory(), "{l}");
        assert_eq!((v.len(), v.capacity(), v.as_ptr()), (3, 3, at), "{l}");
        assert_eq!(rt.block_on(v.to_host(&s)).unwrap(), [1, 2, 3], "{l}");
        drop((v, hog));
        s.synchronize_blocking().unwrap();
        common::assert_all_back_within(&p, Duration::from_secs(5), &l);
    }
}

/// RMM's `device_buffer(other, stream, mr)`: one call copies onto another stream, into memory
/// of another resource; the source can be dropped at once (its free waits for the copy) even
/// while its stream is busy with the work the copy must follow.
#[test]
fn a_copy_onto_another_stream_and_resource() {
    let rt = runtime();
    for device in devices() {
        let l = label(&device);
        let src_pool = pool(&device, 64 * MIB);
        let dst_pool = pool(&device, 64 * MIB);
        let a = device.create_stream().unwrap();
        let b = device.create_stream().unwrap();
        let words = 1 << 16;
        let v = DeviceVec::<u32>::new(&src_pool, words, &a).unwrap();
        a.spin(Duration::from_millis(100)).unwrap();
        // SAFETY: `words` live words of `v`, used in order on its stream.
        unsafe { a.fill_u32(v.as_ptr(), 0xC0FFEE, words) }.unwrap();
        let w = v.try_clone_to(&dst_pool, &b).unwrap();
        assert_eq!(w.stream().id(), b.id(), "{l}");
        assert_eq!(
            used(&dst_pool),
            words * 4,
            "{l}: the copy's memory is the target's"
        );
        drop(v);
        // The source's free waits for `b`'s copy: trimming its pool cannot take the memory.
        src_pool.trim_blocking().unwrap();
        let back = rt.block_on(w.to_host(&b)).unwrap();
        assert!(back.iter().all(|&x| x == 0xC0FFEE), "{l}");
        b.synchronize_blocking().unwrap();

        // Buffers too, and the same stream and resource (a plain clone).
        let mut buf = DeviceBuffer::new(&src_pool, 1000, &a).unwrap();
        buf.memset(3).unwrap();
        let same = buf.try_clone_to(&src_pool, &a).unwrap();
        let other = buf.try_clone_to(&dst_pool, &b).unwrap();
        drop(buf);
        assert_eq!(rt.block_on(same.to_host()).unwrap(), vec![3u8; 1000], "{l}");
        assert_eq!(
            rt.block_on(other.to_host()).unwrap(),
            vec![3u8; 1000],
            "{l}"
        );
        let empty = DeviceBuffer::new(&src_pool, 0, &a).unwrap();
        assert!(empty.try_clone_to(&dst_pool, &b).unwrap().is_empty());

        // Another device's stream or resource: a typed error, nothing allocated.
        let elsewhere = Device::simulated(SimConfig::default());
        let foreign_stream = elsewhere.create_stream().unwrap();
        let foreign_pool = pool(&elsewhere, MIB);
        let before = used(&dst_pool);
        assert!(matches!(
            same.try_clone_to(&dst_pool, &foreign_stream),
            Err(Error::WrongDevice { .. })
        ));
        // To another simulated device: a copy between devices (tests/multi_device.rs); from a
        // GPU to a simulated device: a typed error.
        match same.try_clone_to(&foreign_pool, &foreign_stream) {
            Ok(copy) if device.is_simulated() => drop(copy),
            Err(Error::WrongDevice { .. }) if !device.is_simulated() => {}
            other => panic!("{l}: {other:?}"),
        }
        assert!(matches!(
            same.try_clone_to(&foreign_pool, &b),
            Err(Error::WrongDevice { .. })
        ));
        assert_eq!(used(&dst_pool), before, "{l}");
        assert_eq!(used(&foreign_pool), 0, "{l}");

        drop((w, same, other, empty));
        a.synchronize_blocking().unwrap();
        b.synchronize_blocking().unwrap();
        for p in [&src_pool, &dst_pool] {
            common::assert_all_back_within(p, Duration::from_secs(5), &l);
        }
    }
}

/// A buffer built by copying from a raw device pointer: from `Device::malloc` memory, and from
/// the middle of another vector.
#[test]
fn a_buffer_copied_from_a_raw_device_pointer() {
    let rt = runtime();
    for device in devices() {
        let l = label(&device);
        let p = pool(&device, 64 * MIB);
        let s = device.create_stream().unwrap();
        let raw = device.malloc(4096).unwrap();
        // SAFETY: 4096 live bytes from `malloc`, freed only after the stream is synchronized.
        unsafe { s.memset_d8(raw, 0x42, 4096) }.unwrap();
        // SAFETY: as above; the memset is queued before the copy on `s`.
        let buf = unsafe { DeviceBuffer::copy_from_device_ptr(&p, raw, 4096, &s) }.unwrap();
        assert_eq!(
            rt.block_on(buf.to_host()).unwrap(),
            vec![0x42u8; 4096],
            "{l}"
        );
        s.synchronize_blocking().unwrap();
        // SAFETY: from `malloc`, freed once, nothing uses it any more.
        unsafe { device.free(raw) }.unwrap();

        let data: Vec<u16> = (0..1000).collect();
        let v = DeviceVec::from_host(&p, &data, &s).unwrap();
        // SAFETY: elements 100..300 of `v`: live, written before this point of `s`, and `v`
        // outlives the copy.
        let part =
            unsafe { DeviceVec::<u16>::copy_from_device_ptr(&p, v.as_ptr().offset(200), 200, &s) }
                .unwrap();
        assert_eq!(part.len(), 200, "{l}");
        assert_eq!(
            rt.block_on(part.to_host(&s)).unwrap(),
            data[100..300],
            "{l}"
        );
        // SAFETY: a zero-byte copy reads nothing.
        let none = unsafe { DeviceBuffer::copy_from_device_ptr(&p, v.as_ptr(), 0, &s) }.unwrap();
        assert!(none.is_empty());
        // SAFETY: the element count overflows before anything is read.
        let overflow =
            unsafe { DeviceVec::<u64>::copy_from_device_ptr(&p, v.as_ptr(), usize::MAX / 2, &s) };
        assert!(matches!(overflow, Err(Error::InvalidSize { .. })), "{l}");

        drop((buf, v, part, none));
        s.synchronize_blocking().unwrap();
        common::assert_all_back_within(&p, Duration::from_secs(5), &l);
    }
}

/// The new futures are `Send`, so they run on a multi-threaded runtime.
#[test]
fn element_futures_are_send() {
    fn send<T: Send>(_: &T) {}
    let device = Device::simulated(SimConfig::default());
    let p = pool(&device, MIB);
    let s = device.create_stream().unwrap();
    let v = DeviceVec::<u32>::new(&p, 4, &s).unwrap();
    send(&v.element(0));
    send(&v.first());
    send(&v.last());
}

/// A buffer whose length is not a multiple of the element size is refused by
/// `DeviceVec::from_buffer`, and handed back to the caller: nothing is freed or lost, and the
/// buffer still holds its contents.
#[test]
fn from_buffer_refused_hands_the_buffer_back() {
    let rt = runtime();
    for device in devices() {
        let l = label(&device);
        let p = pool(&device, 64 * MIB);
        let s = device.create_stream().unwrap();
        let mut buf = DeviceBuffer::new(&p, 10, &s).unwrap();
        buf.copy_from_host(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
            .unwrap();
        let (ptr, held) = (buf.as_ptr(), used(&p));
        assert!(held > 0, "{l}");

        let err = DeviceVec::<u32>::from_buffer(buf).unwrap_err();
        assert_eq!(
            *err.error(),
            Error::InvalidSize {
                size: 10,
                reason: "the buffer's length is not a multiple of the element size"
            },
            "{l}"
        );
        assert!(err.to_string().contains("10"), "{l}: {err}");
        let _: &dyn std::error::Error = &err;
        s.synchronize_blocking().unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(used(&p), held, "{l}: the refused buffer was freed");

        let buf = err.into_buffer();
        assert_eq!((buf.as_ptr(), buf.len()), (ptr, 10), "{l}");
        let v = DeviceVec::<u16>::from_buffer(buf).unwrap();
        assert_eq!(
            rt.block_on(v.to_host(&s)).unwrap(),
            [0x0201, 0x0403, 0x0605, 0x0807, 0x0a09],
            "{l}"
        );

        // Through `?` into the crate's error: the buffer is dropped, and freed.
        let b = DeviceBuffer::new(&p, 3, &s).unwrap();
        let as_error: Error = DeviceVec::<u16>::from_buffer(b).unwrap_err().into();
        assert!(
            matches!(as_error, Error::InvalidSize { size: 3, .. }),
            "{l}"
        );
        let (e, b) = DeviceVec::<u64>::from_buffer(DeviceBuffer::new(&p, 12, &s).unwrap())
            .unwrap_err()
            .into_parts();
        assert!(matches!(e, Error::InvalidSize { size: 12, .. }), "{l}");
        drop((v, b));
        s.synchronize_blocking().unwrap();
        common::assert_all_back_within(&p, Duration::from_secs(5), &l);
    }
}
