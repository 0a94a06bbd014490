//! A resource never refuses a request that fits: threads allocating and freeing small blocks,
//! together holding a fraction of the maximum, each on a stream of its own, with fresh
//! resources again and again (so that the first requests race for the initial memory). Every
//! refusal here is a bug: the pool once failed 4 KiB with 16 MiB "available" while a chunk moved
//! from its reserve into a shard (8daa846; one run in fifteen of `multi_device`).
//!
//! The pool (initial memory in its reserve, and grown from nothing), the expandable pool, the
//! arena, the fixed-size resource and the binning resource, on every available device.

mod common;

use std::sync::Barrier;

use common::{devices, label, SplitMix64};
use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
use streamalloc::resource::binning::BinningResource;
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::fixed_size::FixedSizeResource;
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{Device, DevicePtr, ExpandableOptions, ExpandablePoolResource, MemoryResource};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const THREADS: usize = 8;
/// Live blocks per thread at most: 8 threads x 4 x 64 KiB = 2 MiB, an eighth of the maximum.
const LIVE: usize = 4;
const OPS: usize = 400;
/// Fresh resources per test: each first request races the others for the initial memory (the
/// pool's reserve race showed in about one run of this file in thirty at 12 rounds).
const ROUNDS: usize = 40;

/// `THREADS` threads, each on its own stream, allocating blocks of `sizes` (at most `LIVE`
/// live) and freeing them; panics, naming the resource, at the first refusal.
fn hammer(name: &str, device: &Device, r: &impl MemoryResource, sizes: (usize, usize)) {
    let barrier = Barrier::new(THREADS);
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let barrier = &barrier;
            scope.spawn(move || {
                let stream = device.create_stream().unwrap();
                let mut rng = SplitMix64(t as u64 + 1);
                let mut live: Vec<(DevicePtr, usize)> = Vec::new();
                barrier.wait();
                for op in 0..OPS {
                    let a = rng.next();
                    if live.len() < LIVE && (live.is_empty() || a & 1 == 0) {
                        let span = (sizes.1 - sizes.0) / 256 + 1;
                        let size = sizes.0 + (a >> 8) as usize % span * 256;
                        match r.allocate(size, &stream) {
                            Ok(ptr) => live.push((ptr, size)),
                            Err(e) => panic!(
                                "{}: {name} refused {size} bytes (thread {t}, op {op}, {} live \
                                 of its own): {e}",
                                label(device),
                                live.len()
                            ),
                        }
                    } else {
                        let (ptr, size) = live.swap_remove((a >> 1) as usize % live.len());
                        // SAFETY: allocated above from `r` with this size, on this stream.
                        unsafe { r.deallocate(ptr, size, &stream) }.unwrap();
                    }
                }
                for (ptr, size) in live {
                    // SAFETY: as above.
                    unsafe { r.deallocate(ptr, size, &stream) }.unwrap();
                }
                stream.synchronize_blocking().unwrap();
            });
        }
    });
}

#[test]
fn the_pool_never_refuses_a_request_that_fits() {
    for device in devices() {
        for round in 0..ROUNDS {
            // Its initial memory in the reserve (every 16 MiB of it), and grown from nothing.
            let initial = if round % 2 == 0 { 16 * MIB } else { 0 };
            let pool = PoolResource::new(
                CudaResource::new(&device),
                PoolOptions {
                    initial,
                    maximum: Some(16 * MIB),
                    ..PoolOptions::default()
                },
            )
            .unwrap();
            hammer("the pool", &device, &pool, (256, 64 * KIB));
            pool.check_invariants().unwrap();
            assert_eq!(pool.stats().in_use, 0, "{}", label(&device));
        }
    }
}

#[test]
fn the_expandable_pool_never_refuses_a_request_that_fits() {
    for device in devices() {
        for round in 0..ROUNDS / 4 {
            let pool = ExpandablePoolResource::new(
                &device,
                ExpandableOptions {
                    initial: if round % 2 == 0 { 16 * MIB } else { 0 },
                    maximum: Some(16 * MIB),
                    ..ExpandableOptions::default()
                },
            )
            .unwrap();
            hammer("the expandable pool", &device, &pool, (256, 64 * KIB));
            pool.check_invariants().unwrap();
            assert_eq!(pool.stats().in_use, 0, "{}", label(&device));
        }
    }
}

#[test]
fn the_arena_never_refuses_a_request_that_fits() {
    for device in devices() {
        for round in 0..ROUNDS {
            let arena = ArenaResource::new(
                CudaResource::new(&device),
                ArenaOptions {
                    initial: if round % 2 == 0 { 16 * MIB } else { 0 },
                    maximum: Some(16 * MIB),
                    ..ArenaOptions::default()
                },
            )
            .unwrap();
            hammer("the arena", &device, &arena, (256, 64 * KIB));
        }
    }
}

#[test]
fn the_fixed_size_resource_never_refuses_a_request_that_fits() {
    for device in devices() {
        for _ in 0..ROUNDS / 4 {
            let fixed = FixedSizeResource::new(CudaResource::new(&device), 64 * KIB, 64).unwrap();
            hammer("the fixed-size resource", &device, &fixed, (256, 64 * KIB));
        }
    }
}

#[test]
fn the_binning_resource_never_refuses_a_request_that_fits() {
    for device in devices() {
        for _ in 0..ROUNDS / 4 {
            // Bins of 2^12..2^16 bytes (their chunks from the pool), over a 16 MiB pool.
            let upstream = PoolResource::new(
                CudaResource::new(&device),
                PoolOptions {
                    initial: 16 * MIB,
                    maximum: Some(16 * MIB),
                    ..PoolOptions::default()
                },
            )
            .unwrap();
            let binning = BinningResource::new(upstream, 12, 16).unwrap();
            hammer("the binning resource", &device, &binning, (256, 64 * KIB));
        }
    }
}
