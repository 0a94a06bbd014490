//! The simulated device, second review: its race detector and odd configurations.

use streamalloc::{Device, SimConfig};

/// A stream the user's code finds idle (`is_idle`) has run everything it was ordered after,
/// on other devices too: a stream of device 0 that waited for an event of device 1, found
/// idle, orders a host free of what device 1's stream used, as a synchronize of that stream
/// does. The idle answer joined only device 0's host clock, so the free was reported as
/// freed while in use on device 1 (a false race).
#[test]
fn an_idle_stream_orders_what_it_waited_for_on_another_device() {
    use streamalloc::RaceDetection;
    let config = || SimConfig {
        race_detection: RaceDetection::Record,
        ..SimConfig::default()
    };
    let (d0, d1) = (Device::simulated(config()), Device::simulated(config()));
    let b = d1.create_stream().unwrap();
    let ptr = d1.malloc(1024).unwrap();
    // SAFETY: `ptr` is freed only once the stream's work has run (the wait below).
    unsafe { b.memset_d8(ptr, 1, 1024) }.unwrap();
    let a = d0.create_stream().unwrap();
    a.wait(&b.record().unwrap()).unwrap();
    while !a.is_idle().unwrap() {
        std::thread::yield_now();
    }
    // SAFETY: the memset ran before `a`'s wait, which has run.
    unsafe { d1.free(ptr) }.unwrap();
    assert!(d1.races().is_empty(), "{:?}", d1.races());
    assert!(d0.races().is_empty(), "{:?}", d0.races());
}

/// The host's memory and swap, from `/proc/meminfo`.
#[cfg(target_os = "linux")]
fn host_ram_and_swap() -> usize {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kib = |name: &str| {
        let line = info.lines().find(|l| l.starts_with(name)).unwrap();
        let value = line[name.len()..].trim().trim_end_matches("kB").trim();
        value.parse::<usize>().unwrap() * 1024
    };
    kib("MemTotal:") + kib("SwapTotal:")
}

/// A simulated device larger than the host, asked for one block larger than the host's memory
/// and swap: its host bytes cost only the pages touched (as `SimConfig::total_memory`
/// promises), so the block is had; where the host refuses even that (strict overcommit), the
/// error is the host's, never the device out of memory with the device's numbers. It was
/// refused with `available` at the whole device, so an awaited request waited for ever (a
/// review's finding).
#[cfg(target_os = "linux")]
#[test]
fn a_block_larger_than_the_host_is_no_false_out_of_memory() {
    use std::time::Duration;
    use streamalloc::resource::cuda::CudaResource;
    use streamalloc::resource::pool::{PoolOptions, PoolResource};
    use streamalloc::{AllocateAsync, Error, MemoryResource};
    let request = host_ram_and_swap() + (1 << 30);
    let device = Device::simulated(SimConfig {
        total_memory: 2 * request,
        ..SimConfig::default()
    });
    match device.malloc(request) {
        // SAFETY: allocated above, never used.
        Ok(ptr) => unsafe { device.free(ptr) }.unwrap(),
        Err(Error::OutOfMemory { available, .. }) => {
            assert!(
                available < request,
                "refused {request} with {available} available"
            )
        }
        Err(e) => assert!(matches!(e, Error::HostOutOfMemory { .. }), "{e:?}"),
    }
    let pool = PoolResource::new(CudaResource::new(&device), PoolOptions::default()).unwrap();
    let stream = device.create_stream().unwrap();
    let got = futures::executor::block_on(
        pool.allocate_async(request, &stream)
            .timeout(Duration::from_secs(3)),
    );
    match got {
        // SAFETY: allocated above, never used, freed once.
        Ok(ptr) => unsafe { pool.deallocate(ptr, request, &stream) }.unwrap(),
        Err(e) => assert!(
            matches!(e, Error::HostOutOfMemory { .. }),
            "waited for, or refused, memory the device has: {e:?}"
        ),
    }
    stream.synchronize_blocking().unwrap();
}
