//! Second review of the resources (binning, fixed-size, free list, TLSF, current) and of the
//! aligned, history, tracking, prefetch and failure-callback adaptors: each test here failed
//! before the fix it names.

mod common;

use std::sync::Arc;

use common::{free, pool};
use streamalloc::resource::binning::BinningResource;
use streamalloc::resource::pool::PoolResource;
use streamalloc::resource::CudaResource;
use streamalloc::{Device, MemoryResource, ResourceRef, SimConfig};

const MIB: usize = 1 << 20;

fn sim() -> Device {
    Device::simulated(SimConfig::default())
}

/// A pool of exactly `bytes`, shared, as a `ResourceRef`.
fn shared_pool(device: &Device, bytes: usize) -> ResourceRef {
    let pool: PoolResource<CudaResource> = pool(device, bytes, bytes);
    Arc::new(pool)
}

/// A bin given to `add_bin` may be the very pool the binning resource sits on (its
/// documentation says so): the snapshot's `reserved` must count that pool's memory once, not
/// once for the bin and once for the fallback (the upstream).
#[test]
fn binning_snapshot_counts_a_bin_that_is_the_upstream_once() {
    let device = sim();
    let upstream = shared_pool(&device, 8 * MIB);
    let mr = BinningResource::builder(upstream.clone())
        .add_bin(4096, Some(upstream.clone()))
        .build()
        .unwrap();
    let s = device.create_stream().unwrap();
    let p = mr.allocate(1000, &s).unwrap();
    let snapshot = mr.snapshot();
    assert_eq!(snapshot.reserved, 8 * MIB as u64, "{snapshot:?}");
    free(&mr, p, 1000, &s);
}

/// The same for a fallback given that is the upstream, with fixed-size bins carved from it:
/// the bins' chunks are inside the fallback's memory, counted once.
#[test]
fn binning_snapshot_counts_a_fallback_that_is_the_upstream_once() {
    let device = sim();
    let upstream = shared_pool(&device, 8 * MIB);
    let mr = BinningResource::builder(upstream.clone())
        .bins_pow2(10, 12)
        .blocks_per_chunk(4)
        .fallback(upstream.clone())
        .build()
        .unwrap();
    let s = device.create_stream().unwrap();
    let p = mr.allocate(2000, &s).unwrap();
    let snapshot = mr.snapshot();
    assert_eq!(snapshot.reserved, 8 * MIB as u64, "{snapshot:?}");
    free(&mr, p, 2000, &s);
}

/// One resource given for two bins is one resource's memory.
#[test]
fn binning_snapshot_counts_a_resource_given_twice_once() {
    let device = sim();
    let other = shared_pool(&device, 4 * MIB);
    let mr = BinningResource::builder(pool(&device, 2 * MIB, 2 * MIB))
        .add_bin(4096, Some(other.clone()))
        .add_bin(8192, Some(other.clone()))
        .build()
        .unwrap();
    let snapshot = mr.snapshot();
    assert_eq!(snapshot.reserved, 6 * MIB as u64, "{snapshot:?}");
}

/// "A later bin of the same size replaces an earlier one" (`add_bin`), whether either bin is
/// given or fixed-size: a fixed-size bin's size is rounded up to 256, and the replacement
/// compared the rounded size with the given bin's size as asked, so both bins stayed and the
/// earlier one kept serving the smaller requests.
#[test]
fn binning_a_later_bin_of_the_same_size_replaces_an_earlier_one() {
    let device = sim();
    let other = shared_pool(&device, MIB);
    let fixed_later = BinningResource::builder(pool(&device, MIB, MIB))
        .add_bin(1000, Some(other.clone()))
        .add_bin(1000, None)
        .build()
        .unwrap();
    assert_eq!(fixed_later.bin_sizes(), vec![1024]);
    let given_later = BinningResource::builder(pool(&device, MIB, MIB))
        .add_bin(1000, None)
        .add_bin(1000, Some(other.clone()))
        .build()
        .unwrap();
    assert_eq!(given_later.bin_sizes(), vec![1000]);
    // The request goes to the bin given last: `other`.
    let s = device.create_stream().unwrap();
    let p = given_later.allocate(1000, &s).unwrap();
    let held = other.memory_snapshot().unwrap();
    assert_eq!(held.count(streamalloc::resource::BlockState::InUse), 1);
    free(&given_later, p, 1000, &s);
}
