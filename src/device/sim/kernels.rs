//! The simulated device's copies, memsets and built-in kernels. They mirror
//! `kernels/streamalloc.cu` element for element.

use std::sync::atomic::Ordering::Relaxed;

use super::memory::SimMemory;
use super::op::Op;
use crate::error::{Error, Result};
use crate::sync::plain::DataByte;

fn bytes_of(count: usize, size: usize) -> Result<usize> {
    count.checked_mul(size).ok_or(Error::InvalidSize {
        size: count,
        reason: "the element count overflows usize when multiplied by the element size",
    })
}

fn load_u32(b: &[DataByte]) -> u32 {
    u32::from_le_bytes([
        b[0].load(Relaxed),
        b[1].load(Relaxed),
        b[2].load(Relaxed),
        b[3].load(Relaxed),
    ])
}

fn store_u32(b: &[DataByte], v: u32) {
    for (byte, v) in b.iter().zip(v.to_le_bytes()) {
        byte.store(v, Relaxed);
    }
}

/// Executes one memory operation or kernel.
pub(crate) fn run(memory: &SimMemory, op: Op) -> Result<()> {
    match op {
        Op::Memset8 { dst, value, bytes } => memory.with(dst, bytes, |d| {
            d.iter().for_each(|b| b.store(value, Relaxed));
        }),
        Op::Memset32 { dst, value, count } | Op::FillU32 { dst, value, count } => {
            memory.with(dst, bytes_of(count, 4)?, |d| {
                d.chunks_exact(4).for_each(|w| store_u32(w, value));
            })
        }
        Op::ScaleF32 { dst, factor, count } => memory.with(dst, bytes_of(count, 4)?, |d| {
            d.chunks_exact(4)
                .for_each(|w| store_u32(w, (f32::from_bits(load_u32(w)) * factor).to_bits()));
        }),
        Op::HtoD { dst, src, bytes } => memory.with(dst, bytes, |d| {
            for (i, b) in d.iter().enumerate() {
                // SAFETY: the enqueuer promised `src` points to `bytes` readable bytes that
                // stay valid until this operation has run (see `HostPtr`).
                b.store(unsafe { src.0.add(i).read() }, Relaxed);
            }
        }),
        Op::DtoH { dst, src, bytes } => memory.with(src, bytes, |s| {
            for (i, b) in s.iter().enumerate() {
                // SAFETY: the enqueuer promised `dst` points to `bytes` writable bytes that
                // nobody else touches until this operation has run (see `HostPtr`).
                unsafe { dst.0.add(i).write(b.load(Relaxed)) };
            }
        }),
        Op::DtoD { dst, src, bytes } => memory.copy(dst, src, bytes),
        Op::CopyPeer {
            dst,
            from,
            src,
            bytes,
        } => memory.copy_from(dst, &from, src, bytes),
        Op::Spin(_) | Op::Record(_) | Op::Wait(_) | Op::Free(_) | Op::PoolFree { .. } => Ok(()),
    }
}
