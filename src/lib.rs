//! # streamalloc
//!
//! Stream-ordered GPU memory allocation for async Rust.
//!
//! Work on a GPU runs in *streams*, queues executed in order. streamalloc gives you streams and
//! events that are futures ([`Stream`], [`Event`]), a stream pool ([`StreamPool`]), and the
//! device layer they stand on ([`Device`]): a real GPU through the CUDA driver (loaded at run
//! time, so no toolkit is needed to build), or a simulated device with the same semantics on
//! host memory, which tests and CI use and which a machine without a GPU gets by default.
//!
//! ```
//! # fn main() -> streamalloc::Result<()> {
//! # let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
//! # rt.block_on(async {
//! use streamalloc::{Device, SimConfig};
//!
//! let device = Device::simulated(SimConfig::default());
//! let a = device.create_stream()?;
//! let b = device.create_stream()?;
//! a.spin(std::time::Duration::from_millis(5))?; // work in flight on `a`
//! let done = a.record()?;                         // an event: a point of stream `a`
//! b.wait(&done)?;                                 // `b` waits for it on the GPU; the host does not
//! done.clone().await?;                            // the task waits; no thread is parked
//! b.synchronize().await?;
//! # Ok::<(), streamalloc::Error>(())
//! # })
//! # }
//! ```
//!
//! ## Layers
//! `device` (CUDA through cudarc, or simulated) → `stream`, `event` and the completion
//! reactor → (memory resources and buffers build on these).

#![warn(
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unreachable_pub
)]
#![deny(unsafe_op_in_unsafe_fn)]

mod buffer;
mod completion;
mod device;
mod error;
mod event;
mod offload;
mod reactor;
pub mod resource;
mod stream;
mod stream_pool;
mod sync;
mod timer;
mod vec;

pub use crate::buffer::DeviceBuffer;
pub use crate::device::{CudaOptions, Device, DeviceKind, DevicePtr, FaultKind, Faults, SimConfig};
pub use crate::error::{Error, Result};
pub use crate::event::Event;
pub use crate::resource::{
    AllocateAsync, AsResourceRef, CudaAsyncResource, CudaResource, MemoryKind, MemoryResource,
    MemoryWaiters, PoolOptions, PoolResource, ResourceRef, ALIGNMENT,
};
pub use crate::stream::{Stream, StreamId};
pub use crate::stream_pool::StreamPool;
pub use crate::vec::{DeviceScalar, DeviceVec};
pub use bytemuck::Pod;

/// The loom models (`loom-tests/`), compiled into the crate so they reach its internals. Run
/// them with `RUSTFLAGS="--cfg streamalloc_loom" cargo test --release --lib loom_tests` (see
/// loom-tests/README.md); without the cfg this module does not exist.
#[cfg(all(test, streamalloc_loom))]
#[path = "../loom-tests/mod.rs"]
mod loom_tests;
