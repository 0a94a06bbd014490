//! Completion words (issue 18): a word of pinned, device-mapped host memory per stream, which
//! the GPU writes with a count of the stream's watched events right after each of them
//! (`cuStreamWriteValue32`), so that whether the event completed is a load on the host, not a
//! driver call (`cuEventQuery`: ~130 to 230 ns, and calls from several threads at once wait
//! for each other in the driver: the reactor's hot window, a pre-woken task and anyone else).
//! `CudaOptions::completion_words` turns them on.
//!
//! A word only ever says "reached": a stream whose work failed never writes it, so an event
//! whose word has not moved is still asked of the driver now and then
//! ([`QUERY_EVERY`]), which reports the failure.
//!
//! Lifetime: the GPU may write a word after everything on the host that refers to it has gone
//! (a stream dropped with work queued). A word is therefore never freed or handed to another
//! stream until it holds the last value queued to it (`word_slots.rs`, which has a loom
//! model); pages go back to the driver only when every word of theirs is settled, else they
//! are leaked (with a warning) rather than freed under a pending write.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::sys;

use super::cuda::{raw, Context, RawStream};
use super::word_slots::WordSlots;
use crate::error::Result;

/// Bytes a page of words takes (one `cuMemHostAlloc`).
const PAGE: usize = 4096;
/// Bytes between two words: a cache line each, so that the GPU's write of one stream's word
/// does not take the line of another's from a host thread polling it.
const STRIDE: usize = 64;
const PER_PAGE: usize = PAGE / STRIDE;
/// A word's value before its stream's first watched event (value 0) is reached.
const UNREACHED: u32 = u32::MAX;
/// How often an event whose word has not moved is still asked of the driver, in ns: the
/// longest a failed stream's error waits to be seen by a poll.
pub(crate) const QUERY_EVERY: u64 = 100_000;

/// Whether `word` (the last value the GPU wrote) has reached `value` (an event's). Values count
/// the stream's watched events only (each one's write), so this is exact while fewer than 2^31
/// watched events lie between the last write that landed and the event asked about: pending
/// work of one stream, never near that many. (Counting every record instead, 2^31 records
/// only waited on by other streams, which write nothing, would wrap it: a review's finding.)
fn reached(word: u32, value: u32) -> bool {
    (word.wrapping_sub(value) as i32) >= 0
}

/// Nanoseconds since the first call, for [`Word::query_due`].
fn now_ns() -> u64 {
    static BASE: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    BASE.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// A device's pages of completion words. CUDA only, so std's mutex and `Arc`: the loom model
/// (`loom-tests/words.rs`) drives the bookkeeping behind the mutex, [`WordSlots`], alone.
pub(crate) struct Words {
    ctx: crate::sync::Arc<Context>,
    slab: Mutex<Slab>,
}

#[derive(Default)]
struct Slab {
    /// (host address, device address) of each page.
    pages: Vec<(usize, sys::CUdeviceptr)>,
    /// Which words are free, held or waiting for a last write.
    slots: WordSlots,
}

/// The host's view of word `slot` of `pages`.
fn word_at(pages: &[(usize, sys::CUdeviceptr)], slot: u32) -> &AtomicU32 {
    let (page, at) = (slot as usize / PER_PAGE, slot as usize % PER_PAGE);
    // SAFETY: the page is a live pinned allocation of PAGE bytes (pages are freed only when the
    // slab goes), `at * STRIDE` lies inside it and is 4-aligned, and every access to the word
    // from the host is atomic (the GPU's write is a plain 32-bit store to it).
    unsafe { AtomicU32::from_ptr((pages[page].0 + at * STRIDE) as *mut u32) }
}

/// The device's address of word `slot` of `pages`.
fn device_at(pages: &[(usize, sys::CUdeviceptr)], slot: u32) -> sys::CUdeviceptr {
    let (page, at) = (slot as usize / PER_PAGE, slot as usize % PER_PAGE);
    pages[page].1 + (at * STRIDE) as u64
}

impl Words {
    pub(crate) fn new(ctx: crate::sync::Arc<Context>) -> Arc<Words> {
        Arc::new(Words {
            ctx,
            slab: Mutex::new(Slab::default()),
        })
    }

    /// A word for a new stream, reading [`UNREACHED`].
    pub(crate) fn word(self: &Arc<Self>) -> Result<Word> {
        let mut slab = self.slab.lock().unwrap_or_else(|e| e.into_inner());
        let Slab { pages, slots } = &mut *slab;
        let read = |slot: u32| word_at(pages, slot).load(Ordering::Acquire);
        let slot = match slots.take(read) {
            Some(slot) => slot,
            None => {
                pages.push(self.new_page()?);
                slots.add(PER_PAGE as u32)
            }
        };
        let host = word_at(pages, slot);
        // No write is pending to it: fresh, or settled.
        host.store(UNREACHED, Ordering::Release);
        Ok(Word {
            words: self.clone(),
            slot,
            host: host as *const AtomicU32 as usize,
            device: device_at(pages, slot),
            last: AtomicU32::new(UNREACHED),
        })
    }

    fn new_page(&self) -> Result<(usize, sys::CUdeviceptr)> {
        let host = self.ctx.malloc_host(PAGE)?;
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `host` was just allocated with DEVICEMAP (the context is current: the
        // allocation bound it); writes one device address.
        let mapped = raw("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut device, host as *mut c_void, 0)
        });
        if let Err(e) = mapped {
            // SAFETY: ours, just allocated, unused.
            let _ = unsafe { self.ctx.free_host(host) };
            return Err(e);
        }
        Ok((host as usize, device))
    }

    fn retire(&self, slot: u32, last: u32) {
        let mut slab = self.slab.lock().unwrap_or_else(|e| e.into_inner());
        slab.slots.retire(slot, last);
    }
}

impl Drop for Words {
    fn drop(&mut self) {
        let Slab { pages, slots } = self.slab.get_mut().unwrap_or_else(|e| e.into_inner());
        slots.settle(|slot| word_at(pages, slot).load(Ordering::Acquire));
        let mut pending = vec![false; pages.len()];
        for slot in slots.unsettled() {
            pending[slot as usize / PER_PAGE] = true;
        }
        for (&(host, _), pending) in pages.iter().zip(pending) {
            if pending {
                tracing::warn!("a page of completion words leaked: the GPU may still write it");
                continue;
            }
            // SAFETY: every word of the page is settled (its last queued write landed) and no
            // `Word` holds one (each holds an `Arc` of this), so nothing writes or reads it.
            if let Err(e) = unsafe { self.ctx.free_host(host as *mut u8) } {
                tracing::warn!(error = %e, "could not free a page of completion words");
            }
        }
    }
}

/// One stream's completion word.
pub(crate) struct Word {
    words: Arc<Words>,
    slot: u32,
    /// The host's view of it (an `&AtomicU32` into a page that outlives `words`' last `Arc`).
    host: usize,
    device: sys::CUdeviceptr,
    /// The last value queued to it.
    last: AtomicU32,
}

// The host address points into a pinned page the slab keeps alive at least as long as this
// `Word` (it holds an `Arc` of the slab), and is only read atomically.
impl Word {
    fn host(&self) -> &AtomicU32 {
        // SAFETY: see above: a live, aligned word, accessed only atomically.
        unsafe { &*(self.host as *const AtomicU32) }
    }

    /// Queues on `stream`, after everything queued there so far, the GPU's write of the next
    /// value to the word, and returns that value: the event just recorded is reached once the
    /// word reaches it. The caller holds the stream's record lock, so values are queued in
    /// order. Not while the stream is being captured into a graph (the caller checks): every
    /// launch of the graph would write the value again, completing later events early.
    pub(crate) fn write(&self, stream: RawStream) -> Result<u32> {
        self.words.ctx.bind()?;
        let value = self.last.load(Ordering::Relaxed).wrapping_add(1);
        // Used up whether or not the call succeeds: the driver may return an error of earlier
        // asynchronous work with this write queued all the same, and the next event given
        // this value would then read complete when this write lands, before its own work (a
        // review's finding). A write that really was not queued costs this word's slot: it
        // never settles, and its page is kept when the device goes (with a warning).
        self.last.store(value, Ordering::Relaxed);
        // SAFETY: `stream` is live (the caller's), and `device` maps a word of a pinned page
        // that stays allocated until this write has landed (see `Words::retire`). Flags 0: the
        // write is ordered after the stream's earlier work and its memory (a barrier).
        raw("cuStreamWriteValue32", unsafe {
            sys::cuStreamWriteValue32_v2(stream.0, self.device, value, 0)
        })?;
        Ok(value)
    }

    /// Whether the GPU has passed the event whose write queued `value`.
    #[inline]
    pub(crate) fn reached(&self, value: u32) -> bool {
        reached(self.host().load(Ordering::Acquire), value)
    }

    /// Whether an event whose word has not moved is due to be asked of the driver (at most
    /// once per [`QUERY_EVERY`] for the event whose last query time is `last`, 0 if never).
    pub(crate) fn query_due(last: &AtomicU64) -> bool {
        let now = now_ns().max(1);
        let then = last.load(Ordering::Relaxed);
        (then == 0 || now.saturating_sub(then) >= QUERY_EVERY)
            && last
                .compare_exchange(then, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// Notes a driver query made now, whatever the rate (see `query_due`).
    pub(crate) fn queried(last: &AtomicU64) {
        last.store(now_ns().max(1), Ordering::Relaxed);
    }
}

impl Drop for Word {
    fn drop(&mut self) {
        self.words
            .retire(self.slot, self.last.load(Ordering::Relaxed));
    }
}

#[cfg(test)]
mod tests {
    use super::reached;

    #[test]
    fn reached_follows_the_values_across_the_wrap() {
        assert!(!reached(u32::MAX, 0), "a fresh word has reached nothing");
        assert!(reached(0, 0));
        assert!(reached(5, 3));
        assert!(!reached(3, 5));
        assert!(reached(2, u32::MAX - 1), "past the wrap");
        assert!(!reached(u32::MAX - 1, 2), "before the wrap");
    }
}
