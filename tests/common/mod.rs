//! What every test file shares: the devices to run on.
//!
//! Tests are written once against `Device` and run on the simulated device always, and on CUDA
//! device 0 when a GPU is present. With `STREAMALLOC_REQUIRE_GPU=1`, a missing GPU fails the
//! test instead of falling back.

#![allow(dead_code)]

use std::time::Duration;

use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::cuda_async::{CudaAsyncOptions, CudaAsyncResource};
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{CudaOptions, Device, DevicePtr, Faults, MemoryResource, SimConfig, Stream};

/// The CUDA devices of [`devices`] (GPU 0 when there is one), for a test that only a GPU can
/// run; without one, empty, and the test (`test`) says it checked nothing and why (`why`).
pub fn gpus(test: &str, why: &str) -> Vec<Device> {
    let gpus: Vec<Device> = devices()
        .into_iter()
        .filter(|d| !d.is_simulated())
        .collect();
    if gpus.is_empty() {
        println!("{test}: skipped, no GPU: {why}");
    }
    gpus
}

/// The simulated device, plus CUDA device 0 when there is one.
pub fn devices() -> Vec<Device> {
    let mut devices = vec![Device::simulated(SimConfig::default())];
    match Device::cuda(0) {
        Ok(gpu) => devices.push(gpu),
        Err(why) => fail_if_a_gpu_is_required(&why),
    }
    devices
}

/// CUDA device 0 opened with `options`, for a test that needs a GPU; `None` without one, and
/// the test (`test`) says it checked nothing.
pub fn gpu_with(test: &str, options: CudaOptions) -> Option<Device> {
    match Device::cuda_with(0, options) {
        Ok(gpu) => Some(gpu),
        Err(why) => {
            fail_if_a_gpu_is_required(&why);
            println!("{test}: skipped, no GPU ({why})");
            None
        }
    }
}

/// With `STREAMALLOC_REQUIRE_GPU=1`, a GPU that could not be opened fails the test.
fn fail_if_a_gpu_is_required(why: &streamalloc::Error) {
    if std::env::var("STREAMALLOC_REQUIRE_GPU").as_deref() == Ok("1") {
        panic!("STREAMALLOC_REQUIRE_GPU=1 but no GPU could be opened: {why}");
    }
}

/// A label for assertion messages.
pub fn label(device: &Device) -> String {
    format!("{:?} ({})", device.kind(), device.name())
}

/// Waits (bounded) until `cond` holds; false if it never did.
pub fn eventually(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < timeout {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    cond()
}

/// One test of this binary at a time, among those that call it (the tests of one binary run
/// at once, on threads; each binary has its own copy of this lock). For tests that fill the
/// device, and for tests that time the GPU: while another test's `cuMemFree` or
/// `cuMemFreeHost` waits for the device to be idle, the driver holds up this thread's launches
/// and records (BENCHMARKS.md, "A waiting cuMemFree holds up the GPU's other threads"), and a
/// stream meant to be busy is done by the time they return.
pub fn take_turns() -> std::sync::MutexGuard<'static, ()> {
    static TURNS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURNS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Polls `fut` once, then drops it: a future cancelled where it first waits.
pub fn poll_once_and_drop<F: std::future::Future>(fut: F) {
    let mut fut = std::pin::pin!(fut);
    let waker = futures::task::noop_waker();
    let _ = fut
        .as_mut()
        .poll(&mut std::task::Context::from_waker(&waker));
}

/// Polls `fut` once (and keeps it, to poll again later).
pub fn poll_once<F: std::future::Future>(fut: std::pin::Pin<&mut F>) -> std::task::Poll<F::Output> {
    let waker = futures::task::noop_waker();
    fut.poll(&mut std::task::Context::from_waker(&waker))
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// Reads `count` words at `src` through `stream` (blocking: fine in tests).
pub fn read_u32(
    stream: &streamalloc::Stream,
    src: streamalloc::DevicePtr,
    count: usize,
) -> Vec<u32> {
    let mut host = vec![0u32; count];
    // SAFETY: `host` has `count` words and nothing touches it until the stream is synchronized.
    unsafe { stream.copy_dtoh(host.as_mut_ptr() as *mut u8, src, count * 4) }.unwrap();
    stream.synchronize_blocking().unwrap();
    host
}

/// splitmix64, as in shared/bench/WORKLOADS.md.
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// A pool over `cuMemAlloc` with these sizes and the default policies.
pub fn pool(device: &Device, initial: usize, maximum: usize) -> PoolResource<CudaResource> {
    PoolResource::new(
        CudaResource::new(device),
        PoolOptions {
            initial,
            maximum: Some(maximum),
            ..PoolOptions::default()
        },
    )
    .unwrap()
}

/// An arena over `cuMemAlloc` with these sizes and the default policies.
pub fn arena(device: &Device, initial: usize, maximum: usize) -> ArenaResource<CudaResource> {
    ArenaResource::new(
        CudaResource::new(device),
        ArenaOptions {
            initial,
            maximum: Some(maximum),
            ..ArenaOptions::default()
        },
    )
    .unwrap()
}

/// A simulated device whose driver calls fail where the returned [`Faults`] plant it.
pub fn faulty() -> (Device, Faults) {
    let faults = Faults::new();
    let device = Device::simulated(SimConfig {
        faults: faults.clone(),
        ..SimConfig::default()
    });
    (device, faults)
}

/// [`pool`] whose every cross-stream reuse waits on the GPU, idle streams or not
/// (`opportunistic_reuse` off): for tests that count or fail those waits.
#[allow(dead_code)]
pub fn waiting_pool(device: &Device, initial: usize, maximum: usize) -> PoolResource<CudaResource> {
    PoolResource::new(
        CudaResource::new(device),
        PoolOptions {
            initial,
            maximum: Some(maximum),
            opportunistic_reuse: false,
            ..PoolOptions::default()
        },
    )
    .unwrap()
}

/// Frees what `resource` handed out, expecting success.
pub fn free<R: MemoryResource + ?Sized>(
    resource: &R,
    ptr: DevicePtr,
    bytes: usize,
    stream: &Stream,
) {
    // SAFETY: every test frees what it allocated from `resource`, once, after its last use on
    // `stream` (or after ordering `stream` behind that use).
    unsafe { resource.deallocate(ptr, bytes, stream) }.unwrap();
}

/// Panics with the violation if the pool's invariant checker finds one.
pub fn check_pool<U: MemoryResource>(pool: &PoolResource<U>) {
    pool.check_invariants()
        .unwrap_or_else(|e| panic!("pool invariants: {e}"));
}

/// Waits (bounded by `timeout`) until every byte the pool holds is free again: deferred frees
/// run on the reactor, after the test's last line may have run.
pub fn assert_all_back_within<U: MemoryResource>(
    pool: &PoolResource<U>,
    timeout: Duration,
    what: &str,
) {
    assert!(
        eventually(timeout, || all_back(pool)),
        "{what}: memory did not come back: {:?}",
        pool.stats()
    );
}

/// True once every byte the pool holds is free again.
pub fn all_back<U: MemoryResource>(pool: &PoolResource<U>) -> bool {
    let s = pool.stats();
    s.free == s.reserved
}

/// Panics with the violation (and the arena's dump) if the arena's checker finds one.
pub fn check_arena(arena: &ArenaResource<CudaResource>) {
    arena
        .check_invariants()
        .unwrap_or_else(|e| panic!("arena invariants: {e}\n{}", arena.dump()));
}

/// After everything is freed and the arena defragmented, every byte is back in the global
/// arena; `what` names the case in the messages.
pub fn assert_arena_all_back(arena: &ArenaResource<CudaResource>, what: &str) {
    arena.defragment();
    check_arena(arena);
    let stats = arena.stats();
    assert_eq!(stats.in_use, 0, "{what}: {stats:?}");
    assert_eq!(
        stats.global_free,
        stats.reserved,
        "{what}: bytes not back: {stats:?}\n{}",
        arena.dump()
    );
}

/// A `CudaAsyncResource` on a new driver pool that `new` primed with `bytes` (allocated and
/// freed once, so the pool keeps them).
pub fn primed_async_pool(device: &Device, bytes: usize) -> CudaAsyncResource {
    CudaAsyncResource::new(
        device,
        CudaAsyncOptions {
            initial_pool_size: Some(bytes),
            ..CudaAsyncOptions::default()
        },
    )
    .unwrap()
}

/// A resource whose `allocate` panics on its `fail_at`-th call (counting from 1), or whose
/// `deallocate` does ([`on_free`](Self::on_free)), and passes every other call on to `inner`:
/// what a resource whose failure callback or log writer (the user's code) panics does to the
/// layers over it.
#[derive(Debug)]
pub struct PanicsOnCall<R> {
    pub inner: R,
    calls: std::sync::atomic::AtomicUsize,
    fail_at: usize,
    frees: std::sync::atomic::AtomicUsize,
    /// 0: no free panics.
    free_fail_at: usize,
}

impl<R> PanicsOnCall<R> {
    pub fn new(inner: R, fail_at: usize) -> Self {
        Self {
            inner,
            calls: std::sync::atomic::AtomicUsize::new(0),
            fail_at,
            frees: std::sync::atomic::AtomicUsize::new(0),
            free_fail_at: 0,
        }
    }

    /// Its `free_fail_at`-th `deallocate` (counting from 1) panics, before `inner` sees it.
    pub fn on_free(inner: R, free_fail_at: usize) -> Self {
        Self {
            free_fail_at,
            ..Self::new(inner, 0)
        }
    }
}

// SAFETY: passes every call on to `inner`, a resource (or panics before making one).
unsafe impl<R: MemoryResource> MemoryResource for PanicsOnCall<R> {
    fn device(&self) -> &Device {
        self.inner.device()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> streamalloc::Result<DevicePtr> {
        let call = (self.calls).fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        if call == self.fail_at {
            panic!("a resource that panics in allocate (call {call})");
        }
        self.inner.allocate(bytes, stream)
    }

    unsafe fn deallocate(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        stream: &Stream,
    ) -> streamalloc::Result<()> {
        let free = (self.frees).fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        if free == self.free_fail_at {
            panic!("a resource that panics in deallocate (call {free})");
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.deallocate(ptr, bytes, stream) }
    }
}

/// A waker that counts its wakes, then panics: an executor's code misbehaving.
#[derive(Debug, Default)]
pub struct PanicsOnWake(pub std::sync::atomic::AtomicUsize);

impl std::task::Wake for PanicsOnWake {
    fn wake(self: std::sync::Arc<Self>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        panic!("a waker that panics");
    }
}
