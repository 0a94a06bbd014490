//! The cost of `CudaAsyncResource`'s free with nobody waiting, on the simulated device:
//! `STREAMALLOC_RACE_DETECTION=off cargo run --release --example free_hot_path`. Prints the
//! median over 15 rounds of ns per allocate + deallocate pair (same stream, 4 KiB).

use std::time::Instant;

use streamalloc::resource::cuda_async::{CudaAsyncOptions, CudaAsyncResource};
use streamalloc::{Device, MemoryResource, SimConfig};

fn main() {
    let device = Device::simulated(SimConfig::default());
    let resource = CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap();
    let stream = device.create_stream().unwrap();
    const N: u32 = 20_000;
    let mut rounds = Vec::new();
    for _ in 0..15 {
        let start = Instant::now();
        for _ in 0..N {
            let ptr = resource.allocate(4096, &stream).unwrap();
            // SAFETY: allocated just above on `stream`, unused, freed once.
            unsafe { resource.deallocate(ptr, 4096, &stream) }.unwrap();
        }
        stream.synchronize_blocking().unwrap();
        rounds.push(start.elapsed().as_nanos() as f64 / f64::from(N));
    }
    rounds.sort_by(|a, b| a.total_cmp(b));
    println!(
        "ns per allocate+free pair: median {:.0}, min {:.0}",
        rounds[rounds.len() / 2],
        rounds[0]
    );
}
