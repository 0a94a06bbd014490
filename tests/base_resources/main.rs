//! The four base resources (`CudaResource`, `CudaAsyncResource`, `ManagedResource`,
//! `PinnedHostResource`), and the `ExpandablePoolResource` that stands on the device's virtual
//! memory calls, on every available device (see `common`), to the bar of RMM's
//! memory-resource tests: zero bytes, sizes up to 1 GiB, out of memory, random mixes,
//! threads, producer/consumer across streams, and each resource's own promises.

#[path = "../common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use common::{devices, eventually, label, primed_async_pool};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::cuda_async::{CudaAsyncOptions, CudaAsyncResource};
use streamalloc::resource::managed::ManagedResource;
use streamalloc::resource::pinned::{PinnedHostOptions, PinnedHostResource};
use streamalloc::{
    Device, DevicePtr, Error, ExpandablePoolResource, MemoryKind, MemoryResource, SimConfig,
    Stream, ALIGNMENT,
};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
const PIB: usize = 1 << 50;

/// splitmix64: a tiny seeded generator, enough for reproducible random mixes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Below `n` (n > 0).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// A size from 0 to `max`, spread evenly over the orders of magnitude.
    fn size(&mut self, max_log2: u32) -> usize {
        let bits = self.below(max_log2 as u64 + 1) as u32;
        self.below(1u64 << bits) as usize + usize::from(bits > 0)
    }
}

/// Every base resource of `device`, shared, with its name.
fn resources(device: &Device) -> Vec<(&'static str, Arc<dyn MemoryResource>)> {
    vec![
        ("cuda", Arc::new(CudaResource::new(device))),
        (
            "cuda_async",
            Arc::new(CudaAsyncResource::new(device, CudaAsyncOptions::default()).unwrap()),
        ),
        ("managed", Arc::new(ManagedResource::new(device))),
        ("pinned", Arc::new(PinnedHostResource::new(device))),
        (
            "expandable",
            Arc::new(ExpandablePoolResource::new(device, Default::default()).unwrap()),
        ),
    ]
}

/// The simulated device with delays that widen race windows, plus `devices()`.
fn devices_with_a_slow_sim() -> Vec<Device> {
    let mut all = devices();
    all.push(Device::simulated(SimConfig {
        op_delay: Duration::from_micros(20),
        op_jitter: Duration::from_micros(100),
        seed: 11,
        ..SimConfig::default()
    }));
    all
}

fn host_ptr(ptr: DevicePtr) -> *mut u8 {
    ptr.as_raw() as usize as *mut u8
}

/// Reads `count` words at `src` (device memory) on `stream`, waiting for them.
fn read_words(stream: &Stream, src: DevicePtr, count: usize) -> Vec<u32> {
    let mut host = vec![0u32; count];
    // SAFETY: `host` has `count` words and is not touched until synchronize_blocking returns;
    // callers pass live memory of at least `4 * count` bytes.
    unsafe { stream.copy_dtoh(host.as_mut_ptr() as *mut u8, src, count * 4) }.unwrap();
    stream.synchronize_blocking().unwrap();
    host
}

/// Writes `tag` at the start and the end of the allocation and reads it back: through the
/// host pointer for pinned memory, with the fill kernel and a copy back otherwise. Touches at
/// most 8 KiB at each end, so a lazily backed 1 GiB allocation stays cheap.
fn write_and_check(kind: MemoryKind, ptr: DevicePtr, bytes: usize, stream: &Stream, tag: u32) {
    if kind == MemoryKind::PinnedHost {
        let p = host_ptr(ptr);
        let n = bytes.min(8 * KIB);
        // SAFETY: `p` is `bytes` of live host memory that only this test uses.
        unsafe {
            std::ptr::write_bytes(p, tag as u8, n);
            std::ptr::write_bytes(p.add(bytes - n), tag as u8, n);
            assert_eq!(p.read(), tag as u8);
            assert_eq!(p.add(bytes - 1).read(), tag as u8);
            assert_eq!(p.add(bytes / 2).read_volatile(), p.add(bytes / 2).read());
        }
        return;
    }
    let words = bytes / 4;
    if words == 0 {
        return;
    }
    let n = words.min(2 * KIB);
    let tail = ptr.offset((words - n) * 4);
    // SAFETY: both ranges lie inside the `bytes` live bytes at `ptr`, which stay live until
    // read_words synchronizes the stream.
    unsafe {
        stream.fill_u32(ptr, tag, n).unwrap();
        stream.fill_u32(tail, tag, n).unwrap();
    }
    assert!(read_words(stream, ptr, n).iter().all(|&w| w == tag));
    assert!(read_words(stream, tail, n).iter().all(|&w| w == tag));
}

/// Inserts `[ptr, ptr + bytes)` into `live`, panicking if it overlaps a live range.
fn insert_disjoint(live: &mut BTreeMap<u64, usize>, ptr: DevicePtr, bytes: usize, what: &str) {
    let (start, end) = (ptr.as_raw(), ptr.as_raw() + bytes as u64);
    if let Some((&p, &b)) = live.range(..=start).next_back() {
        assert!(
            p + b as u64 <= start,
            "{what}: {ptr:?}+{bytes} overlaps {p:#x}+{b}"
        );
    }
    if let Some((&p, &b)) = live.range(start..).next() {
        assert!(end <= p, "{what}: {ptr:?}+{bytes} overlaps {p:#x}+{b}");
    }
    live.insert(start, bytes);
}

mod cuda_async;
mod every_resource;
mod managed;
mod pinned;
