//! The arena beside RMM's `arena_memory_resource` and beside the pool's promises (issue 20,
//! findings 3 and 4, and an arena that can trim):
//!
//! - an arena that grew in several chunks serves a request for its whole maximum once
//!   everything is free (it gives the wholly free chunks back upstream and grows one large
//!   enough), by `allocate` and by `allocate_async`;
//! - one small live block does not pin a superblock to its stream: another stream that needs
//!   the rest of it gets it (RMM's "free on another thread after superblocks moved between
//!   streams"), in stream order, and the live block is freed on its old stream afterwards;
//! - `trim` and `trim_blocking` give wholly free chunks back upstream, after the GPU work that
//!   used them, keep the chunks with live blocks, and a cancelled `trim` loses nothing.
//!
//! And the driver pool beside RMM's `cuda_async_memory_resource` (issue 20, finding 5, and
//! `cuda_async_view_memory_resource`):
//!
//! - `CudaAsyncResource`'s maximum holds exactly on every device (the driver rounds `maxSize`
//!   up: on an H200, 4 MiB and then 1 MiB more were served under a 4 MiB maximum);
//! - a resource over the device's default pool, or over a pool someone else made, shares that
//!   pool and leaves it alone when dropped.
//!
//! Every test runs on every device of `devices()`.

#[path = "../common/mod.rs"]
mod common;

use std::time::Duration;

use common::{arena, assert_arena_all_back, check_arena, devices, label, read_u32, runtime};
use futures::FutureExt;
use streamalloc::resource::arena::ArenaResource;
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::cuda_async::{CudaAsyncOptions, CudaAsyncResource};
use streamalloc::{AllocateAsync, Device, DevicePtr, Error, MemoryResource, Stream};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

mod arena;
mod cuda_async;
