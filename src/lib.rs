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
//!
//! The modules form layers, lowest first. A module names only modules of lower layers (and its
//! own submodules); no arrow runs back up, so there is no import cycle. Where a lower layer must
//! reach a higher one, the higher one implements a trait of the lower (the reactor's `Watch`,
//! which an event implements) or adds the methods that name its own types in its own files
//! (`impl Device` blocks under `stream/` for the calls that take a [`Stream`]).
//!
//! 1. **Foundations**: `sync` (std, or loom under `--cfg streamalloc_loom`), `error`, `timer`,
//!    and `completion` (an event's completion state: wakers and deferred callbacks).
//! 2. **Threads that run completions**: `offload` (the per-device blocking-work thread), then
//!    `reactor` (the per-device completion reactor, its `Bell` and `Doorbells`, and the `Watch`
//!    trait that what it polls implements).
//! 3. **`device`**: the backends (`device::cuda` through cudarc, `device::sim` on host memory),
//!    the small types every layer above names (`device::ids`: [`DevicePtr`], [`StreamId`]), the
//!    [`Device`] handle, which owns its reactor, and its raw memory calls (`device::memory`:
//!    `malloc`, `free`, managed and page-locked host memory). It names neither streams nor
//!    events. The reactor below it names nothing of it either: its `Watch::raw_cuda_event`
//!    hands the CUDA doorbells cudarc's own raw handle (`sys::CUevent`).
//! 4. **`event`, then `stream`**: an [`Event`] names the device and the reactor; a [`Stream`]
//!    records events. The device's calls that take a stream live here: `create_stream`;
//!    `stream::memory` (`malloc_async`, `free_async`, `free_after`); `stream::async_pool` (the
//!    driver's pools); the staging blocks returned behind a copy; the race detector's hooks on
//!    a stream; cudarc streams.
//! 5. **`resource`** (memory resources, on devices, streams and events) and `stream_pool`.
//! 6. **`buffer`**, then `vec`: owning allocations, on resources.
//!
//! What each layer owns, and why it is built so: [`implementation`].
//!
//! ## The completion reactor thread
//!
//! Each [`Device`] has one completion reactor thread, `sa-reactor-N` (a simulated device that
//! runs its streams inline, [`SimExecution::Inline`], has nothing for it to do and starts it
//! only if asked). It turns finished events
//! into wakeups: it calls the [`Waker`](std::task::Waker)s of the tasks that await an
//! [`Event`] (and what is built on events: [`Stream::synchronize`], [`DeviceBuffer::alloc`],
//! `to_host`, ...), and it runs the work deferred until an event completes: the free of a
//! [`DeviceBuffer`] used on other streams ([`record_stream`](DeviceBuffer::record_stream)),
//! which calls its resource's [`deallocate`](MemoryResource::deallocate), and the return of
//! the page-locked blocks that host copies stage through. Every wakeup of the device waits while
//! any of that runs. So, for code that can end up there (a waker, a `deallocate` of your own
//! resource or of a [`CallbackResource`](resource::callback::CallbackResource), the `Drop` of
//! anything such a callback owns):
//!
//! - **Nothing may block.** No blocking driver call (`cuMemFree`, `cuMemFreeHost`,
//!   `cuStreamSynchronize`, `synchronize_blocking`, a `cuMemAlloc` that may wait), no lock that
//!   a thread waiting for the GPU may hold, no blocking I/O. A waker should only schedule its
//!   task, as every async runtime's does; a `deallocate` should be a stream-ordered free that
//!   returns at once (a pool's, `cuMemFreeAsync`). The crate's own resources whose free blocks,
//!   [`CudaResource`] and [`ManagedResource`](resource::managed::ManagedResource) (`cuMemFree`
//!   waits until the device is idle), notice that they run on a reactor thread and hand the free
//!   to the device's *blocking-work thread* (`sa-blocking-N`, started on first use), logging an
//!   error there instead of returning it. A resource of yours must do the same with its own
//!   thread. When a deferred free holds the last handle of its resource, that handle is
//!   dropped on the blocking-work thread too, so a pool's `Drop` (which synchronizes its
//!   streams) never runs on the reactor. And when the last handle of a [`Device`] goes there
//!   (an event's callback held it), the device is torn down on a short-lived thread of its own
//!   (`sa-teardown-N`): its teardown frees pinned pages and destroys events and pools.
//! - **Keep it short.** Microseconds, not milliseconds: the median wake latency the reactor
//!   aims at on a GPU is under 10 µs.
//! - **Panics are caught, not propagated.** A waker or deferred callback that panics is caught
//!   and logged through `tracing` at error level (what ran, the event's stream and sequence
//!   number, the panic's message); the reactor goes on, and the event's other wakers and
//!   callbacks still run. Whatever the panicking code was to do is not done: memory that a
//!   panicking `deallocate` was to free stays allocated. (With `panic = "abort"` there is
//!   nothing to catch.) The same holds on any thread that completes an event, e.g. a task that
//!   polls an `Event` and finds it done.
//!
//! ## Testing your own code with loom
//!
//! Built with `RUSTFLAGS="--cfg streamalloc_loom"`, the crate's locks, atomics, `Arc`s and
//! threads are [loom](https://docs.rs/loom/0.7)'s, so a `loom::model` of *your* code that uses
//! streamalloc on the simulated device explores your threads' interleavings together with the
//! crate's shared state (a pool's free lists and memory waiters, events' wakeups, deferred
//! frees). Under the cfg the simulated device runs stream work inline
//! ([`SimConfig::execution`] defaults to [`SimExecution::Inline`]): each operation runs on
//! the thread that queues it and every event is complete when recorded, so the crate starts no
//! thread (no stream worker, no reactor) and loom's five threads are all yours. Make the device
//! with [`RaceDetection::Panic`]: a stream-order bug in the interleaving loom chose (a use not
//! ordered after the writer's event, a free not ordered after a use) panics with both sites, and
//! loom reports the interleaving. Drive futures with `loom::future::block_on`, keep models to
//! two or three tasks and a few operations, and use preemption bound 3: the repository's
//! `examples/loom_user.rs` (two tasks, two streams, a pool of one buffer, an allocation that
//! waits for the other task's free) explores 1 542 executions in about 0.2 s. The README,
//! "Testing your own code", has the details.

#![warn(
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unreachable_pub
)]
#![deny(unsafe_op_in_unsafe_fn)]

/// Whether a loom model switched on the planted bug `planted::$name`, a static of the `planted`
/// module in scope (the invoker's own, or one it imports under the loom cfg) that exists only
/// under the loom cfg: a relaxed load under the loom cfg, the constant `false` otherwise, so the
/// branches it guards compile away in every other build (but still type-check there).
/// Defined before the modules, which its textual scope then covers.
macro_rules! planted {
    ($name:ident) => {{
        #[cfg(streamalloc_loom)]
        let on = planted::$name.load(std::sync::atomic::Ordering::Relaxed);
        #[cfg(not(streamalloc_loom))]
        let on = false;
        on
    }};
}

mod buffer;
mod completion;
mod device;
mod error;
mod event;
pub mod implementation;
mod offload;
mod reactor;
pub mod resource;
mod stream;
mod stream_pool;
mod sync;
mod timer;
mod vec;

pub use crate::buffer::DeviceBuffer;
pub use crate::device::{
    CudaOptions, Device, DeviceKind, DevicePtr, FaultKind, Faults, MemoryAccess, Race, RaceBlock,
    RaceDetection, RaceKind, RaceSite, SimConfig, SimExecution, WakeStrategy,
};
pub use crate::error::{Error, Result};
pub use crate::event::Event;
pub use crate::resource::{
    AllocateAsync, AsResourceRef, CudaAsyncResource, CudaResource, ExpandableOptions,
    ExpandablePlacement, ExpandablePoolResource, MemoryKind, MemoryResource, MemoryWaiters,
    PoolOptions, PoolResource, ResourceRef, ALIGNMENT,
};
pub use crate::stream::{Stream, StreamId};
pub use crate::stream_pool::StreamPool;
pub use crate::vec::{DeviceScalar, DeviceVec, FromBufferError};
pub use bytemuck::Pod;
/// The cudarc this crate is built on: use it (`streamalloc::cudarc`) for
/// [`Device::from_cudarc`], [`Stream::cudarc_stream`] and kernel launches on our buffers, so
/// that both sides name the same cudarc.
pub use cudarc;

/// The loom models (`loom-tests/`), compiled into the crate so they reach its internals. Run
/// them with `RUSTFLAGS="--cfg streamalloc_loom" cargo test --release -p streamalloc --lib
/// loom_tests` (see loom-tests/README.md); without the cfg this module does not exist.
#[cfg(all(test, streamalloc_loom))]
#[path = "../loom-tests/mod.rs"]
mod loom_tests;
