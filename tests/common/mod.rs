//! What every test file shares: the devices to run on.
//!
//! Tests are written once against `Device` and run on the simulated device always, and on CUDA
//! device 0 when a GPU is present. With `STREAMALLOC_REQUIRE_GPU=1`, a missing GPU fails the
//! test instead of falling back.

#![allow(dead_code)]

use std::time::Duration;

use streamalloc::{Device, SimConfig};

/// The simulated device, plus CUDA device 0 when there is one.
pub fn devices() -> Vec<Device> {
    let mut devices = vec![Device::simulated(SimConfig::default())];
    match Device::cuda(0) {
        Ok(gpu) => devices.push(gpu),
        Err(why) => {
            if std::env::var("STREAMALLOC_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("STREAMALLOC_REQUIRE_GPU=1 but no GPU could be opened: {why}");
            }
        }
    }
    devices
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

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("tokio runtime")
}
