//! A review of `DeviceVec` against `Vec`'s expectations (element alignment, zero-sized
//! elements), on every available device.

mod common;

use std::sync::Arc;

use common::{devices, label, runtime};
use streamalloc::{DeviceBuffer, DeviceVec, Error, ALIGNMENT};

const MIB: usize = 1 << 20;

/// Plain data aligned past what a resource promises ([`ALIGNMENT`], 256 bytes).
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C, align(1024))]
struct OverAligned([u8; 1024]);

// SAFETY: `repr(C)`, one field of plain bytes filling the whole size: no padding, every bit
// pattern valid, zero included.
unsafe impl bytemuck::Zeroable for OverAligned {}
// SAFETY: as above; `Copy` and `'static`.
unsafe impl bytemuck::Pod for OverAligned {}

/// A vector of elements aligned past [`ALIGNMENT`] cannot be placed: the resource may hand
/// out an address that is not a multiple of the element's alignment, and a kernel that reads
/// the elements there faults (`CUDA_ERROR_MISALIGNED_ADDRESS`). Every constructor refuses
/// such a type with `InvalidAlignment` naming its alignment, and `from_buffer` hands the buffer
/// back; nothing is allocated or lost.
#[test]
fn elements_aligned_past_the_resource_alignment_are_refused() {
    assert!(std::mem::align_of::<OverAligned>() > ALIGNMENT);
    let rt = runtime();
    for device in devices() {
        let l = label(&device);
        let p = Arc::new(common::pool(&device, 0, 64 * MIB));
        let s = device.create_stream().unwrap();
        // A block first, so that the next one is not at the start of a chunk.
        let _first = DeviceBuffer::new(&p, 256, &s).unwrap();
        let refused = |r: Result<DeviceVec<OverAligned>, Error>| match r {
            Err(Error::InvalidAlignment { alignment: 1024 }) => {}
            Err(e) => panic!("{l}: {e:?}"),
            Ok(v) => panic!(
                "{l}: a vector of 1024-aligned elements at {:#x} (misaligned by {})",
                v.as_ptr().0,
                v.as_ptr().0 % 1024
            ),
        };
        refused(DeviceVec::new(&p, 1, &s));
        refused(rt.block_on(DeviceVec::alloc(&p, 1, &s)));
        refused(DeviceVec::zeroed(&p, 1, &s));
        refused(DeviceVec::from_host(&p, &[OverAligned([1; 1024])], &s));
        refused(rt.block_on(DeviceVec::alloc_from_host(
            &p,
            &[OverAligned([1; 1024])],
            &s,
        )));
        let buf = DeviceBuffer::new(&p, 1024, &s).unwrap();
        let ptr = buf.as_ptr();
        let err = DeviceVec::<OverAligned>::from_buffer(buf).unwrap_err();
        assert!(
            matches!(err.error(), Error::InvalidAlignment { alignment: 1024 }),
            "{l}: {err:?}"
        );
        assert_eq!(
            err.into_buffer().as_ptr(),
            ptr,
            "{l}: the buffer handed back"
        );
        let stats = p.stats();
        assert_eq!(
            stats.reserved - stats.free,
            256,
            "{l}: only the first block is out"
        );
    }
}

/// Zero-sized elements: a length but no memory, as a `Vec<()>`; every operation works and
/// none touches the device.
#[test]
fn zero_sized_elements_have_a_length_and_no_memory() {
    let rt = runtime();
    for device in devices() {
        let l = label(&device);
        let p = Arc::new(common::pool(&device, 0, 64 * MIB));
        let s = device.create_stream().unwrap();
        let mut v = DeviceVec::<()>::from_host(&p, &[(); 5], &s).unwrap();
        assert_eq!((v.len(), v.capacity()), (5, usize::MAX), "{l}");
        assert_eq!(rt.block_on(v.element(4)).unwrap(), (), "{l}");
        assert!(rt.block_on(v.element(5)).is_err(), "{l}");
        v.resize(1000).unwrap();
        v.reserve(10).unwrap();
        v.shrink_to_fit().unwrap();
        v.set_element(999, ()).unwrap();
        assert_eq!(rt.block_on(v.to_host(&s)).unwrap().len(), 1000, "{l}");
        assert_eq!(v.try_clone().unwrap().len(), 1000, "{l}");
        assert_eq!(v.buffer().len(), 0, "{l}");
    }
}

/// A vector of zero-sized elements may have any length, and reading it to the host costs
/// nothing per element: `to_host` of one of `usize::MAX` elements used to write them one by
/// one (`Vec::resize`) and never return.
#[test]
fn zero_sized_elements_to_the_host_at_any_length() {
    let rt = runtime();
    for device in devices() {
        let l = label(&device);
        let p = Arc::new(common::pool(&device, 0, 64 * MIB));
        let s = device.create_stream().unwrap();
        let v = DeviceVec::<()>::new(&p, usize::MAX, &s).unwrap();
        assert_eq!(v.len(), usize::MAX, "{l}");
        let out = rt.block_on(v.to_host(&s)).unwrap();
        assert_eq!(out.len(), usize::MAX, "{l}");
    }
}

/// A buffer of zero-sized elements: only an empty one is taken (as no elements), since its
/// length says nothing of how many there are; a non-empty one is handed back refused. (It used
/// to take a 10-byte buffer as 10 elements.)
#[test]
fn zero_sized_elements_from_a_buffer() {
    for device in devices() {
        let l = label(&device);
        let p = Arc::new(common::pool(&device, 0, 64 * MIB));
        let s = device.create_stream().unwrap();
        let buf = DeviceBuffer::new(&p, 10, &s).unwrap();
        let err = DeviceVec::<()>::from_buffer(buf).unwrap_err();
        assert!(
            matches!(err.error(), Error::InvalidSize { size: 10, .. }),
            "{l}: {:?}",
            err.error()
        );
        assert_eq!(err.into_buffer().len(), 10, "{l}");
        let empty = DeviceVec::<()>::from_host(&p, &[(); 5], &s)
            .unwrap()
            .into_buffer();
        let v = DeviceVec::<()>::from_buffer(empty).unwrap();
        assert_eq!(v.len(), 0, "{l}");
    }
}
