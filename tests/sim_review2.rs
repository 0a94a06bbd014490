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
