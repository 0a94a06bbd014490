//! `ArenaResource`, `BinningResource`, `CallbackResource` and the per-device current resource,
//! on every available device: RMM's shared memory-resource tests for each, then what is
//! particular to each (the arena's defragmentation and stream order, binning's routing, the
//! callbacks' arguments, the current resource's map).

#[path = "../common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{arena, assert_arena_all_back, check_arena, devices, label, read_u32, SplitMix64};
use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
use streamalloc::resource::binning::BinningResource;
use streamalloc::resource::callback::CallbackResource;
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::current::{
    current_resource, reset_current_resource, set_current_resource,
};
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{
    Device, DevicePtr, Error, MemoryKind, MemoryResource, ResourceRef, SimConfig, Stream, StreamId,
    ALIGNMENT,
};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn free<R: MemoryResource + ?Sized>(mr: &R, ptr: DevicePtr, bytes: usize, stream: &Stream) {
    // SAFETY: every test frees what it allocated from `mr`, once, after its last use on
    // `stream` (or after ordering `stream` behind that use).
    unsafe { mr.deallocate(ptr, bytes, stream) }.unwrap();
}

fn zero_bytes<R: MemoryResource + ?Sized>(mr: &R, device: &Device) {
    let s = device.create_stream().unwrap();
    let ptr = mr.allocate(0, &s).unwrap();
    assert_eq!(ptr, DevicePtr(0), "{}", label(device));
    free(mr, ptr, 0, &s);
    // SAFETY: a non-null pointer with zero bytes, which the resource must refuse.
    assert!(matches!(
        unsafe { mr.deallocate(DevicePtr(0x1000), 0, &s) },
        Err(Error::UnknownPointer { .. })
    ));
    // Zero bytes on another device's stream: the stream is checked first, whatever the size.
    let other = Device::simulated(SimConfig::default());
    let foreign = other.create_stream().unwrap();
    let zero = mr.allocate(0, &foreign);
    assert!(
        matches!(zero, Err(Error::WrongDevice { .. })),
        "{}: {zero:?}",
        label(device)
    );
    // SAFETY: refused before anything is freed (nothing would be).
    let zero_free = unsafe { mr.deallocate(DevicePtr(0), 0, &foreign) };
    assert!(
        matches!(zero_free, Err(Error::WrongDevice { .. })),
        "{}: {zero_free:?}",
        label(device)
    );
}

/// 4 B, 16 B, ... 1 GiB live at once: non-null, 256-aligned, distinct, writable at both ends.
fn sizes_from_4_bytes_to_1_gib<R: MemoryResource + ?Sized>(mr: &R, device: &Device) {
    let s = device.create_stream().unwrap();
    let mut live = BTreeMap::new();
    let mut size = 4;
    while size <= 1 << 30 {
        let ptr = mr.allocate(size, &s).unwrap();
        assert_ne!(ptr.0, 0, "{}: {size} B", label(device));
        assert_eq!(
            ptr.0 % ALIGNMENT as u64,
            0,
            "{}: {size} B at {ptr:?}",
            label(device)
        );
        assert!(
            live.insert(ptr.0, size).is_none(),
            "{}: reused",
            label(device)
        );
        size *= 4;
    }
    let v: Vec<_> = live.iter().collect();
    for w in v.windows(2) {
        assert!(
            w[0].0 + *w[0].1 as u64 <= *w[1].0,
            "{}: overlap",
            label(device)
        );
    }
    for (&ptr, &size) in live.iter().filter(|(_, &s)| s >= 8192) {
        let last = DevicePtr(ptr + size as u64 - 4096);
        // SAFETY: `size` live bytes at `ptr`, synchronized in read_u32.
        unsafe {
            s.fill_u32(DevicePtr(ptr), 0xAB, 1024).unwrap();
            s.fill_u32(last, 0xCD, 1024).unwrap();
        }
        assert_eq!(read_u32(&s, DevicePtr(ptr), 1), [0xAB]);
        assert_eq!(read_u32(&s, last.offset(4092), 1), [0xCD]);
    }
    for (ptr, size) in live {
        free(mr, DevicePtr(ptr), size, &s);
    }
}

/// 1 PiB is out of memory, and the resource works as before afterwards.
fn one_pib_is_out_of_memory<R: MemoryResource + ?Sized>(mr: &R, device: &Device) {
    let s = device.create_stream().unwrap();
    match mr.allocate(1 << 50, &s) {
        Err(Error::OutOfMemory { requested, .. }) => assert_eq!(requested, 1 << 50),
        other => panic!("{}: 1 PiB gave {other:?}", label(device)),
    }
    let ptr = mr.allocate(MIB, &s).unwrap();
    free(mr, ptr, MIB, &s);
}

/// Random allocations and frees on three streams; a free on another stream than the
/// allocation's is ordered after it first. `check` runs every 250 steps and at the end.
fn random_mix<R: MemoryResource + ?Sized>(mr: &R, device: &Device, check: &dyn Fn()) {
    let streams: Vec<Stream> = (0..3).map(|_| device.create_stream().unwrap()).collect();
    let mut rng = SplitMix64(11);
    let mut live: Vec<(DevicePtr, usize, usize)> = Vec::new();
    for step in 0..3000 {
        let r = rng.next();
        if live.is_empty() || (r.is_multiple_of(2) && live.len() < 64) {
            // Mostly small, sometimes above a superblock.
            let size = if rng.next().is_multiple_of(8) {
                1 + (rng.next() % (4 * MIB as u64)) as usize
            } else {
                1 + (rng.next() % (256 * KIB as u64)) as usize
            };
            let s = (rng.next() % 3) as usize;
            let ptr = mr.allocate(size, &streams[s]).unwrap();
            live.push((ptr, size, s));
        } else {
            let (ptr, size, s) = live.swap_remove((rng.next() % live.len() as u64) as usize);
            let t = (rng.next() % 3) as usize;
            if t != s {
                streams[t].wait(&streams[s].record().unwrap()).unwrap();
            }
            free(mr, ptr, size, &streams[t]);
        }
        if step % 250 == 0 {
            check();
            let mut ranges: Vec<_> = live.iter().map(|&(p, s, _)| (p.0, s as u64)).collect();
            ranges.sort_unstable();
            assert!(
                ranges.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0),
                "{}: live blocks overlap",
                label(device)
            );
        }
    }
    for (ptr, size, s) in live {
        free(mr, ptr, size, &streams[s]);
    }
    check();
}

/// Four threads at once, each on its own stream.
fn four_threads<R: MemoryResource + ?Sized>(mr: &R, device: &Device) {
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            scope.spawn(move || {
                let s = device.create_stream().unwrap();
                let mut rng = SplitMix64(100 + t);
                let mut live = Vec::new();
                for _ in 0..2000 {
                    if live.is_empty() || rng.next().is_multiple_of(2) {
                        let size = 256 + (rng.next() % (256 * KIB as u64)) as usize;
                        live.push((mr.allocate(size, &s).unwrap(), size));
                    } else {
                        let (ptr, size) =
                            live.swap_remove((rng.next() % live.len() as u64) as usize);
                        free(mr, ptr, size, &s);
                    }
                }
                for (ptr, size) in live {
                    free(mr, ptr, size, &s);
                }
            });
        }
    });
}

/// A producer thread allocates and fills on its stream; a consumer thread waits on the
/// producer's event, checks the data on its own stream and frees there.
fn producer_consumer<R: MemoryResource + ?Sized>(mr: &R, device: &Device) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|scope| {
        scope.spawn(move || {
            let a = device.create_stream().unwrap();
            for i in 0..200u32 {
                let ptr = mr.allocate(4096, &a).unwrap();
                // SAFETY: 4096 live bytes; the consumer frees them after waiting on `done`.
                unsafe { a.fill_u32(ptr, i, 1024) }.unwrap();
                tx.send((ptr, i, a.record().unwrap())).unwrap();
            }
        });
        scope.spawn(move || {
            let b = device.create_stream().unwrap();
            for (ptr, i, done) in rx {
                b.wait(&done).unwrap();
                assert_eq!(read_u32(&b, ptr, 1024), vec![i; 1024], "{}", label(device));
                free(mr, ptr, 4096, &b);
            }
        });
    });
}

mod arena;
mod binning;
mod callback;
mod current;
