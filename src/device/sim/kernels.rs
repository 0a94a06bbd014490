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

/// The value word `index` of a buffer filled with `seed` holds (`streamalloc_pattern` of
/// `kernels/streamalloc.cu`): splitmix64's finalizer of `seed + (index + 1) * golden ratio`, its
/// halves xored.
pub(crate) fn pattern_u32(seed: u64, index: u64) -> u32 {
    let mut z = seed.wrapping_add(index.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z ^ (z >> 32)) as u32
}

/// Executes one memory operation or kernel.
///
/// A word accessed at an address not aligned for it fails the operation (and so poisons the
/// stream), as the access faults on a GPU with `CUDA_ERROR_MISALIGNED_ADDRESS`, a sticky
/// error; the simulated device once wrote such words without complaint, so a test with an
/// off-by-one offset passed there and failed on a GPU.
pub(crate) fn run(memory: &SimMemory, op: Op) -> Result<()> {
    if let Some((ptr, align)) = op.misaligned() {
        return Err(Error::Driver {
            call: "cuLaunchKernel",
            code: 716,
            name: format!(
                "CUDA_ERROR_MISALIGNED_ADDRESS (the simulated device: {ptr:#x} is not \
                 {align}-aligned)"
            ),
        });
    }
    match op {
        Op::Memset8 { dst, value, bytes } => memory.with(dst, bytes, |d| {
            d.iter().for_each(|b| b.store(value, Relaxed));
        }),
        Op::Memset32 { dst, value, count } | Op::FillU32 { dst, value, count } => {
            memory.with(dst, bytes_of(count, 4)?, |d| {
                d.chunks_exact(4).for_each(|w| store_u32(w, value));
            })
        }
        Op::FillPatternU32 { dst, seed, count } => memory.with(dst, bytes_of(count, 4)?, |d| {
            for (i, w) in d.chunks_exact(4).enumerate() {
                store_u32(w, pattern_u32(seed, i as u64));
            }
        }),
        Op::CountMismatchesU32 {
            src,
            seed,
            count,
            counter,
        } => {
            let found = memory.with(src, bytes_of(count, 4)?, |d| {
                d.chunks_exact(4)
                    .enumerate()
                    .filter(|&(i, w)| load_u32(w) != pattern_u32(seed, i as u64))
                    .count() as u64
            })?;
            // The thread that executes the stream (its worker, or the queueing thread inline) is
            // the only writer here; the race detector saw the add as a write of the counter, so
            // adds of unordered streams to one counter are reported.
            memory.with(counter, 8, |c| {
                let old = u64::from_le_bytes(std::array::from_fn(|k| c[k].load(Relaxed)));
                for (byte, v) in c.iter().zip(old.wrapping_add(found).to_le_bytes()) {
                    byte.store(v, Relaxed);
                }
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
