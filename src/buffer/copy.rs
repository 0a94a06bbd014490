//! Copies between a buffer and the host: `memset`, `copy_from_host`, `to_host`, and the staged
//! copies under them (`copy_in`, `copy_out`, which `DeviceVec` uses too), which never block the
//! host on the GPU.

use crate::device::DevicePtr;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::stream::Stream;

use super::DeviceBuffer;

impl DeviceBuffer {
    /// Sets every byte to `value`, on the buffer's stream.
    pub fn memset(&mut self, value: u8) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        // SAFETY: `len` live bytes, used in order on the buffer's stream.
        unsafe { self.stream.memset_d8(self.ptr, value, self.len) }
    }

    /// Copies `data` (exactly `len()` bytes) to the device, on the buffer's stream. Never blocks
    /// on the GPU: the bytes go through a page-locked staging block that returns to the device's
    /// cache once the copy has run.
    pub fn copy_from_host(&mut self, data: &[u8]) -> Result<()> {
        if data.len() != self.len {
            return Err(Error::InvalidSize {
                size: data.len(),
                reason: "copy_from_host needs exactly the buffer's length",
            });
        }
        copy_in(&self.stream, self.ptr, data)
    }

    /// The contents, copied to the host after the work queued on the buffer's stream so far.
    /// The task waits by `.await`; no thread blocks.
    ///
    /// # Cancel safety
    /// Cancel-safe: the staging block of a dropped future returns to the cache only once the
    /// copy into it has run.
    pub async fn to_host(&self) -> Result<Vec<u8>> {
        let mut out = host_vec(self.len)?;
        copy_out(&self.stream, self.ptr, &mut out, &self.stream).await?;
        Ok(out)
    }
}

/// `len` zeroed elements on the host, or `Err(HostOutOfMemory)` where `vec!` would abort the
/// process (a device buffer can be larger than what the host can give).
///
/// Elements of no size are not written one by one: a `DeviceVec<()>` may have any length
/// (its bytes are none), and `resize` looped `len` times for one of `usize::MAX` (a review's
/// finding: `to_host` of such a vector never returned).
pub(crate) fn host_vec<T: bytemuck::Pod>(len: usize) -> Result<Vec<T>> {
    let mut out = Vec::new();
    if size_of::<T>() == 0 {
        // SAFETY: a `Vec` of a zero-sized type has capacity `usize::MAX` from the start, so
        // `len` is within it; the elements occupy no bytes, and a zero-sized `Pod` value is
        // valid as those no bytes (any bytes, all zeroes among them), so each of the `len`
        // elements is initialized. (`Pod` is `Copy`: dropping the vector runs no Drop `len`
        // times either.)
        unsafe { out.set_len(len) };
        return Ok(out);
    }
    if out.try_reserve_exact(len).is_err() {
        return Err(Error::HostOutOfMemory {
            requested: len.saturating_mul(size_of::<T>()),
        });
    }
    out.resize(len, T::zeroed());
    Ok(out)
}

/// Stages `data` and queues its copy to `dst` on `stream`. Never blocks on the GPU.
///
/// On error the copy may or may not have been queued (the event after it could not be
/// recorded): the destination's contents are then unspecified, and the staging block goes back
/// to the cache only behind a later event of `stream` (`Device::return_staging_after_queued`).
pub(crate) fn copy_in(stream: &Stream, dst: DevicePtr, data: &[u8]) -> Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    // Before anything is queued: under a user's graph capture the copy would be captured (to
    // run at each launch of the graph, from a staging block reused meanwhile) and the event
    // after it refused, leaving a captured copy into memory the caller then frees (a review's
    // finding). Refused whole instead.
    stream.refuse_while_capturing("a staged copy to the device")?;
    // The block is held by a guard, which gives it back on every way out: after the copy's
    // event, or (the copy may be queued) behind a later event of `stream` on an error, and on
    // a panic too (the simulated device panics at a racing copy in the race detector's `Panic`
    // mode, and a caller may catch it: the block, held bare, used to be leaked).
    let mut guard = StagingGuard {
        stream,
        block: Some(stream.device().staging_block(data.len())?),
        queued: false,
        event: None,
    };
    let block_ptr = guard.ptr();
    // SAFETY: the block has at least `data.len()` bytes and is ours alone until the guard
    // returns it.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), block_ptr, data.len()) };
    guard.queued = true;
    // SAFETY: `dst` is a live allocation of `data.len()` bytes (the caller's buffer); the block
    // stays valid and unchanged until the guard returns it, once the copy can no longer read it.
    unsafe { stream.copy_htod(dst, block_ptr, data.len()) }?;
    guard.event = Some(stream.record()?);
    Ok(())
}

/// A staging block lent to one copy on `stream`, given back when dropped (whether the copy
/// completed, failed or the caller unwound) only once nothing queued can still use it: at once
/// if no copy was asked of the stream, after the copy's event if it was recorded, else behind a
/// later event of `stream` (or never, if none can be recorded).
struct StagingGuard<'a> {
    stream: &'a Stream,
    block: Option<crate::device::staging::StagingBlock>,
    /// A copy with the block was asked of the stream (it may be queued even if the call
    /// failed).
    queued: bool,
    /// Recorded after the copy.
    event: Option<Event>,
}

impl StagingGuard<'_> {
    /// The block's host address (null once it was given back).
    fn ptr(&self) -> *mut u8 {
        self.block.as_ref().map_or(std::ptr::null_mut(), |b| b.ptr)
    }
}

impl Drop for StagingGuard<'_> {
    fn drop(&mut self) {
        if let Some(block) = self.block.take() {
            let device = self.stream.device();
            match (&self.event, self.queued) {
                (Some(event), _) => device.return_staging_after(block, event),
                (None, true) => device.return_staging_after_queued(block, self.stream),
                (None, false) => device.return_staging(block),
            }
        }
    }
}

/// Copies `out.len()` bytes from `src` to `out` through a staging block, after the work queued
/// on `stream`.
///
/// `owner` is the stream the memory at `src` is used on (its buffer's). When the copy runs on
/// another stream, `owner` is ordered after it (GPU-side) before the future first waits: the
/// caller's borrow of the buffer ends when the future completes or is dropped, and a write
/// queued on `owner` after that (a `&mut` method, or the user's own kernel) must not overtake
/// the read still queued on `stream`. If that ordering cannot be queued (a driver error), the
/// error is returned and the read may still be queued: later writes are then unordered with it.
///
/// The staging block goes back to the device's cache only once nothing queued can still write
/// it: at once if no copy was attempted, after the copy's event if it was recorded, else behind
/// a later event of `stream` (or never, if none can be recorded): whether the future
/// completes, fails or is dropped.
pub(crate) async fn copy_out(
    stream: &Stream,
    src: DevicePtr,
    out: &mut [u8],
    owner: &Stream,
) -> Result<()> {
    if out.is_empty() {
        return Ok(());
    }
    // As in `copy_in`: nothing is queued if either stream is under a user's graph capture.
    stream.refuse_while_capturing("a staged copy to the host")?;
    if owner.id() != stream.id() {
        owner.refuse_while_capturing("a staged copy to the host")?;
    }
    let device = stream.device();
    let mut guard = StagingGuard {
        stream,
        block: Some(device.staging_block(out.len())?),
        queued: false,
        event: None,
    };
    // (The raw pointer is re-read from the guard after the await, so the future stays `Send`.)
    let block_ptr = |guard: &StagingGuard<'_>| guard.ptr();
    guard.queued = true;
    // SAFETY: `src` is a live allocation of `out.len()` bytes (the caller's buffer); the block
    // has at least that many bytes and nobody else touches it until the guard returns it, which
    // is only once the copy can no longer write it.
    unsafe { stream.copy_dtoh(block_ptr(&guard), src, out.len()) }?;
    let event = stream.record()?;
    guard.event = Some(event.clone());
    if owner.id() != stream.id() {
        owner.wait(&event)?;
    }
    event.await?;
    // SAFETY: the copy into the block has completed (the event after it did).
    unsafe { std::ptr::copy_nonoverlapping(block_ptr(&guard), out.as_mut_ptr(), out.len()) };
    // Nothing queued uses the block any more: give it back here, on the caller's thread, where
    // a block the cache cannot hold is freed at once. (Through the guard it would go back as
    // from the reactor, which may not free: retired, it stayed pinned until the next staging
    // call or the device's drop.)
    if let Some(block) = guard.block.take() {
        device.return_staging(block);
    }
    Ok(())
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use super::*;

    /// More than the host can give is an error, not an abort (`vec!` aborts the process).
    #[test]
    fn a_host_vec_too_large_is_an_error() {
        assert!(matches!(
            host_vec::<u8>(usize::MAX),
            Err(Error::HostOutOfMemory {
                requested: usize::MAX
            })
        ));
        assert!(matches!(
            host_vec::<u64>(usize::MAX / 4),
            Err(Error::HostOutOfMemory { .. })
        ));
        assert_eq!(host_vec::<u32>(3).unwrap(), vec![0, 0, 0]);
    }

    /// A completed `to_host` gives its staging block back on the caller's thread, which frees
    /// a block the cache cannot hold (over 64 MiB) at once: it used to go back as if from the
    /// reactor and be retired, pinned host memory held until the next staging call or the
    /// device's drop.
    #[test]
    fn a_completed_download_frees_a_block_the_cache_cannot_hold() {
        use crate::{CudaResource, Device, SimConfig};
        let device = Device::simulated(SimConfig::default());
        let resource = std::sync::Arc::new(CudaResource::new(&device));
        let stream = device.create_stream().unwrap();
        let bytes = (64 << 20) + 1;
        let mut buf = DeviceBuffer::new(&resource, bytes, &stream).unwrap();
        buf.memset(7).unwrap();
        let out = futures::executor::block_on(buf.to_host()).unwrap();
        assert_eq!((out.len(), out[0], out[bytes - 1]), (bytes, 7, 7));
        assert_eq!(device.inner.staging.retired_bytes(), 0);
    }

    /// The race detector's `Panic` mode panics inside `copy_in` (its copy races a user's
    /// declared write on another stream). A caller that catches the panic must not lose the
    /// staging block: it goes back to the cache as on an error (it used to be leaked, pinned
    /// host memory held until the process ends).
    #[test]
    fn a_staged_copy_that_panics_gives_its_block_back() {
        use std::panic::{catch_unwind, AssertUnwindSafe};
        use std::time::{Duration, Instant};

        use crate::{CudaResource, Device, MemoryAccess, RaceDetection, SimConfig};
        let device = Device::simulated(SimConfig {
            race_detection: RaceDetection::Panic,
            ..SimConfig::default()
        });
        let resource = std::sync::Arc::new(CudaResource::new(&device));
        let (a, b) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let mut buf = DeviceBuffer::new(&resource, 64, &a).unwrap();
        b.wait(&a.record().unwrap()).unwrap();
        b.declare_access(buf.as_ptr(), 64, MemoryAccess::Write, "writer")
            .unwrap();
        // The block the copy will take: the one the cache holds for this size.
        let block = device.staging_block(64).unwrap();
        let cached = block.ptr;
        device.return_staging(block);
        let panicked = catch_unwind(AssertUnwindSafe(|| buf.copy_from_host(&[1; 64]))).is_err();
        assert!(panicked, "the racing copy panics in the Panic mode");
        a.synchronize_blocking().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        // Several at a time: a block made fresh by an earlier look is cached too, and may be
        // handed out before the one that came back (run168 on a GPU host: the one-at-a-time
        // look never saw it again).
        let back = loop {
            let blocks: Vec<_> = (0..8).map(|_| device.staging_block(64).unwrap()).collect();
            let same = blocks.iter().any(|block| block.ptr == cached);
            for block in blocks {
                device.return_staging(block);
            }
            if same || Instant::now() > deadline {
                break same;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        assert!(back, "the staging block of the panicking copy was lost");
        a.wait(&b.record().unwrap()).unwrap();
    }
}
