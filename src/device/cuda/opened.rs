//! What every device handle `Device::cuda` opens on one GPU shares while any of them is alive:
//! cudarc's handle of the primary context, the crate's kernels loaded into it, and the stream
//! that keeps cudarc in its multi-stream mode.
//!
//! Why shared: loading a module waits for all the work queued in the context (on an H100,
//! `cuModuleLoadData` took 3.0 s behind another device handle's 3 s kernel), and cudarc
//! synchronizes the whole context (`cuCtxSynchronize`) when a handle of it makes its first
//! stream, a call that crashed inside the driver twice in about 190 runs of the
//! `base_resources` tests, whose threads open devices while others work (tenth session). Made
//! once per GPU while any handle lives, neither waits for, nor races, the others' work. When
//! the last handle goes, the module is unloaded and the context released, as before.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock, Weak};

use super::{Context, CudaDevice, Kernels};
use crate::error::Result;
use crate::sync::Arc;

/// One GPU's entry: the shared part while a device of it lives, locked while one is made.
type Slot = std::sync::Arc<Mutex<Weak<Opened>>>;

/// The shared part of the devices opened on one GPU.
pub(crate) struct Opened {
    pub(super) ctx: Arc<Context>,
    pub(super) kernels: Kernels,
    /// Held so that cudarc counts one live stream of the context from the start (see
    /// `CudaDevice::first_stream`).
    _streams_alive: std::sync::Arc<cudarc::driver::CudaStream>,
}

// SAFETY: the module and function handles are driver handles usable from any thread once the
// context is current, which every use arranges first (as for `CudaDevice`); nothing in it
// changes after it is made.
unsafe impl Send for Opened {}
// SAFETY: as above.
unsafe impl Sync for Opened {}

impl Opened {
    /// What `ctx` needs, made now: the kernels loaded, the first stream made. `own`: the
    /// handle is one the crate made itself, that nothing else holds yet.
    pub(super) fn new(ctx: Context, own: bool) -> Result<Opened> {
        let ctx = Arc::new(ctx);
        ctx.bind()?;
        let kernels = CudaDevice::load_kernels()?;
        let streams_alive = match CudaDevice::first_stream(&ctx, own) {
            Ok(stream) => stream,
            Err(e) => {
                kernels.unload();
                return Err(e);
            }
        };
        Ok(Opened {
            ctx,
            kernels,
            _streams_alive: streams_alive,
        })
    }

    /// The shared part for GPU `ordinal`: the one the devices alive on it hold, else a new one.
    /// Opens of one GPU wait for each other here while a new one is made; other GPUs' do not.
    pub(super) fn of_gpu(ordinal: usize) -> Result<std::sync::Arc<Opened>> {
        static GPUS: OnceLock<Mutex<HashMap<usize, Slot>>> = OnceLock::new();
        let slot = {
            let mut gpus =
                (GPUS.get_or_init(Default::default).lock()).unwrap_or_else(|e| e.into_inner());
            gpus.entry(ordinal).or_default().clone()
        };
        let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(opened) = slot.upgrade() {
            return Ok(opened);
        }
        let opened = std::sync::Arc::new(Opened::new(Context::open(ordinal)?, true)?);
        *slot = std::sync::Arc::downgrade(&opened);
        Ok(opened)
    }
}

impl Drop for Opened {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // No function of the module can be launched once every device that shared it is
            // gone.
            self.kernels.unload();
        }
    }
}
