//! Second review of `ArenaResource`: the numbers of its out-of-memory errors over an upstream
//! smaller than its own maximum, and statistics that must never count a byte twice. On the
//! simulated device.

#[path = "common/mod.rs"]
mod common;

use futures::FutureExt;

use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{AllocateAsync, Device, Error, MemoryResource, SimConfig};

const MIB: usize = 1 << 20;

/// An arena whose own maximum (the device's memory, by default) is above what its upstream can
/// ever hold: a request larger than the upstream's maximum can never succeed, so its error
/// must say so (`maximum` at most the upstream's), and `allocate_async` must fail at once
/// instead of waiting for ever for memory that cannot come.
#[test]
fn a_request_larger_than_the_upstream_can_hold_fails_at_once() {
    let device = Device::simulated(SimConfig::default());
    let upstream = PoolResource::new(
        CudaResource::new(&device),
        PoolOptions {
            initial: 0,
            maximum: Some(16 * MIB),
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let arena = ArenaResource::new(upstream, ArenaOptions::default()).unwrap();
    assert!(
        arena.maximum() > 32 * MIB,
        "the test needs a larger arena maximum"
    );
    let s = device.create_stream().unwrap();
    match arena.allocate(32 * MIB, &s) {
        Err(Error::OutOfMemory {
            requested, maximum, ..
        }) => {
            assert_eq!(requested, 32 * MIB);
            assert!(
                maximum <= 16 * MIB,
                "the error's maximum {maximum} is above what the upstream can ever hold"
            );
        }
        other => panic!("expected out of memory, got {other:?}"),
    }
    // Polled once: before the fix it queued, waiting for a free that could never make room.
    match arena.allocate_async(32 * MIB, &s).now_or_never() {
        Some(Err(e)) => assert!(e.is_out_of_memory(), "{e}"),
        Some(Ok(_)) => panic!("32 MiB served by an upstream of at most 16 MiB"),
        None => panic!("allocate_async waits for ever for a request the upstream can never hold"),
    }
    // A request that fits the upstream is still served.
    let p = arena.allocate(8 * MIB, &s).unwrap();
    common::free(&arena, p, 8 * MIB, &s);
    s.synchronize_blocking().unwrap();
}
