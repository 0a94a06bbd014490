//! The simulated device's memory: host memory at addresses that look like device addresses.
//!
//! Every allocation gets a fresh address range (never reused, with a guard gap after it), so a
//! use after free or an overrun is an [`Error::InvalidAddress`], not a silent read of someone
//! else's bytes. Bytes are atomics: work on two streams that races on one buffer is a data race
//! in the user's program, as on a GPU, but never undefined behaviour in ours.

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;

use crate::error::{Error, Result};
use crate::sync::plain::{DataByte, RwLock, RwLockReadGuard, RwLockWriteGuard};
use crate::sync::Arc;

/// Where the simulated address space starts: high, like a GPU's unified addresses.
const BASE: u64 = 0x7f00_0000_0000;
/// Allocations start on this boundary (cudaMalloc gives at least 256).
pub(crate) const ALIGN: u64 = 512;
/// Unmapped bytes after each allocation, so overruns fault.
const GUARD: u64 = 64 << 10;

pub(crate) struct Block {
    base: u64,
    bytes: Box<[DataByte]>,
}

impl Block {
    /// The bytes of `[ptr, ptr + len)`, which must lie inside this block.
    fn range(&self, ptr: u64, len: usize) -> &[DataByte] {
        let start = (ptr - self.base) as usize;
        &self.bytes[start..start + len]
    }
}

struct State {
    blocks: BTreeMap<u64, Arc<Block>>,
    used: usize,
    next: u64,
}

pub(crate) struct SimMemory {
    total: usize,
    state: RwLock<State>,
}

impl SimMemory {
    pub(crate) fn new(total: usize) -> Self {
        Self {
            total,
            state: RwLock::new(State {
                blocks: BTreeMap::new(),
                used: 0,
                next: BASE,
            }),
        }
    }

    /// (free, total) in bytes.
    pub(crate) fn info(&self) -> (usize, usize) {
        let used = self.read().used;
        (self.total - used, self.total)
    }

    fn read(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn alloc(&self, bytes: usize) -> Result<u64> {
        if bytes == 0 {
            return Err(Error::InvalidSize {
                size: 0,
                reason: "a device allocation needs at least one byte",
            });
        }
        let rounded = bytes
            .checked_next_multiple_of(ALIGN as usize)
            .ok_or(Error::InvalidSize {
                size: bytes,
                reason: "the size overflows when rounded up to the allocation granularity",
            })?;
        let mut state = self.write();
        let available = self.total - state.used;
        if rounded > available {
            return Err(Error::OutOfMemory {
                requested: bytes,
                available,
                maximum: self.total,
            });
        }
        let storage = zeroed_bytes(rounded).ok_or(Error::OutOfMemory {
            requested: bytes,
            available,
            maximum: self.total,
        })?;
        let base = state.next;
        state.next += rounded as u64 + GUARD;
        state.used += rounded;
        state.blocks.insert(
            base,
            Arc::new(Block {
                base,
                bytes: storage,
            }),
        );
        Ok(base)
    }

    pub(crate) fn free(&self, ptr: u64) -> Result<()> {
        let mut state = self.write();
        match state.blocks.remove(&ptr) {
            Some(block) => {
                state.used -= block.bytes.len();
                Ok(())
            }
            None => Err(Error::InvalidAddress { ptr, bytes: 0 }),
        }
    }

    /// The live block that holds all of `[ptr, ptr + len)`.
    pub(crate) fn block(&self, ptr: u64, len: usize) -> Result<Arc<Block>> {
        let bad = Error::InvalidAddress { ptr, bytes: len };
        let state = self.read();
        let (_, block) = state.blocks.range(..=ptr).next_back().ok_or(bad.clone())?;
        let end = ptr.checked_add(len as u64).ok_or(bad.clone())?;
        if end > block.base + block.bytes.len() as u64 {
            return Err(bad);
        }
        Ok(block.clone())
    }

    /// Runs `f` on the bytes of `[ptr, ptr + len)`.
    pub(crate) fn with<R>(
        &self,
        ptr: u64,
        len: usize,
        f: impl FnOnce(&[DataByte]) -> R,
    ) -> Result<R> {
        let block = self.block(ptr, len)?;
        Ok(f(block.range(ptr, len)))
    }

    /// Copies `bytes` bytes from `src` to `dst`, each inside a live block.
    pub(crate) fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        let (from, to) = (self.block(src, bytes)?, self.block(dst, bytes)?);
        for (d, s) in to.range(dst, bytes).iter().zip(from.range(src, bytes)) {
            d.store(s.load(Relaxed), Relaxed);
        }
        Ok(())
    }
}

/// `len` zeroed atomic bytes, or `None` if the host cannot provide them. Large sizes come from
/// `alloc_zeroed`, so untouched pages cost nothing.
fn zeroed_bytes(len: usize) -> Option<Box<[DataByte]>> {
    let layout = Layout::array::<DataByte>(len).ok()?;
    // SAFETY: `layout` has a non-zero size (callers pass len >= ALIGN).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut DataByte;
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `ptr` is a fresh allocation of `len` zeroed bytes with the layout of
    // `[DataByte; len]` (an atomic byte has the size, alignment and validity of a `u8`, and zero
    // is a valid value), allocated by the global allocator as `Box` expects.
    Some(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, len)) })
}
