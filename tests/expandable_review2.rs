//! Second review of `ExpandablePoolResource` and the virtual memory layer under it (the
//! simulated device, with its fault injection): defects found, each with the test that
//! showed it.

mod common;

use std::future::Future;
use std::task::Context;

use common::free;
use streamalloc::{
    AllocateAsync, Device, Error, ExpandableOptions, ExpandablePoolResource, MemoryResource,
    SimConfig,
};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// A growth that the device cannot map (its memory short) fails with the request's numbers,
/// as the pool's own out-of-memory does (and `PoolResource`'s, over an upstream that runs
/// out): `requested` the request, `maximum` what the pool could ever hold on this device.
/// The review found the mapping's numbers passed through instead: `requested` only what the
/// growth lacked beyond the free block it extends, so a request larger than the device (the
/// reservation, and with it the pool's maximum, may be larger) looked curable, and
/// `allocate_async` waited for ever for memory that can never come.
#[test]
fn a_growth_the_device_cannot_map_fails_with_the_requests_numbers() {
    let device = Device::simulated(SimConfig {
        total_memory: GIB,
        ..SimConfig::default()
    });
    let p = ExpandablePoolResource::new(
        &device,
        ExpandableOptions {
            reserve: Some(2 * GIB),
            ..ExpandableOptions::default()
        },
    )
    .unwrap();
    assert_eq!(p.maximum(), 2 * GIB);
    let s = device.create_stream().unwrap();
    // 512 MiB mapped and free at the bottom of the range: a growth extends it.
    let a = p.allocate(512 * MIB, &s).unwrap();
    free(&p, a, 512 * MIB, &s);
    // More than the device has, within the pool's maximum: the growth maps 768 MiB (which
    // the device has not either) and fails.
    let request = GIB + 256 * MIB;
    match p.allocate(request, &s) {
        Err(Error::OutOfMemory {
            requested,
            available,
            maximum,
        }) => {
            assert_eq!(requested, request);
            assert_eq!(maximum, GIB, "the device's memory bounds the pool");
            assert!(available < requested, "{available}");
        }
        other => panic!("{other:?}"),
    }
    // Waiting cannot cure it: the awaitable request fails at once, as for a request above
    // the pool's own maximum.
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let mut waiting = Box::pin(p.allocate_async(request, &s));
    match waiting.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(Err(Error::OutOfMemory { requested, .. })) => {
            assert_eq!(requested, request)
        }
        other => panic!("a request larger than the device waits: {other:?}"),
    }
    drop(waiting);
    // A request the device can hold is served, from the same free block.
    let b = p.allocate(768 * MIB, &s).unwrap();
    free(&p, b, 768 * MIB, &s);
    assert_eq!(p.trim_blocking().unwrap(), 768 * MIB);
    assert_eq!(device.free_memory().unwrap(), GIB);
}
