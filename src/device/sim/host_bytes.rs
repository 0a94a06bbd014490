//! The host bytes behind a block of simulated device memory: zeroed atomic bytes that cost
//! nothing until touched.
//!
//! An allocation's come from the global allocator (`calloc`'s lazily zeroed pages). A
//! reservation's may be far larger than the host's memory (an expandable pool reserves the
//! device's whole size by default, 80 GiB for a simulated H100): on Linux they are an anonymous
//! mapping with no swap reserved (`MAP_NORESERVE`), which the kernel's default overcommit
//! policy grants whatever the host has, where one `calloc` larger than the host's memory and
//! swap is refused (a review found an 80 GiB simulated device unable to make an expandable
//! pool on a 23 GiB host). Pages are backed as they are touched, that is, as mapped granules
//! are used.

use std::alloc::Layout;
use std::ptr::NonNull;

use crate::sync::plain::DataByte;

/// `len` zeroed atomic bytes, freed on drop.
pub(crate) struct HostBytes {
    ptr: NonNull<DataByte>,
    len: usize,
    source: Source,
}

enum Source {
    /// From the global allocator, with this layout.
    Heap(Layout),
    /// An anonymous private mapping of `len` bytes (`munmap` on drop).
    #[cfg(target_os = "linux")]
    Mapped,
}

// SAFETY: `HostBytes` owns its bytes, which are atomics: sharing or sending it is sharing or
// sending a `[DataByte]`, which is `Send` and `Sync`.
unsafe impl Send for HostBytes {}
// SAFETY: as above.
unsafe impl Sync for HostBytes {}

impl HostBytes {
    /// `len` (non-zero) zeroed bytes from the global allocator, or `None` if the host cannot
    /// provide them.
    pub(crate) fn zeroed(len: usize) -> Option<Self> {
        let layout = Layout::array::<DataByte>(len).ok()?;
        if layout.size() == 0 {
            return None;
        }
        // SAFETY: `layout` has a non-zero size.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) } as *mut DataByte)?;
        Some(Self {
            ptr,
            len,
            source: Source::Heap(layout),
        })
    }

    /// `len` (non-zero) zeroed bytes for a reservation: a mapping with no swap reserved where
    /// the platform has one, else as [`zeroed`](Self::zeroed).
    pub(crate) fn reserved(len: usize) -> Option<Self> {
        #[cfg(target_os = "linux")]
        {
            if len == 0 {
                return None;
            }
            // SAFETY: an anonymous private mapping at an address of the kernel's choosing
            // touches no existing memory; the result is checked before use.
            let ptr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            if ptr == libc::MAP_FAILED {
                return None;
            }
            Some(Self {
                ptr: NonNull::new(ptr as *mut DataByte)?,
                len,
                source: Source::Mapped,
            })
        }
        #[cfg(not(target_os = "linux"))]
        {
            Self::zeroed(len)
        }
    }
}

impl std::ops::Deref for HostBytes {
    type Target = [DataByte];

    fn deref(&self) -> &[DataByte] {
        // SAFETY: `ptr` points to `len` zeroed-at-first bytes owned by `self` until drop (an
        // allocation or a mapping of at least `len` bytes, page-aligned or aligned for
        // `DataByte`, whose alignment is 1); every value of an atomic byte is valid, and the
        // bytes are only ever accessed through atomics.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HostBytes {
    fn drop(&mut self) {
        match self.source {
            // SAFETY: allocated by the global allocator with exactly this layout, freed once.
            Source::Heap(layout) => unsafe {
                std::alloc::dealloc(self.ptr.as_ptr() as *mut u8, layout)
            },
            #[cfg(target_os = "linux")]
            Source::Mapped => {
                // SAFETY: the mapping of `len` bytes made in `reserved`, unmapped once; no
                // reference into it outlives `self`.
                let unmapped = unsafe { libc::munmap(self.ptr.as_ptr() as *mut _, self.len) };
                debug_assert_eq!(unmapped, 0, "munmap of a simulated reservation failed");
            }
        }
    }
}

#[cfg(all(test, not(streamalloc_loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering::Relaxed;

    #[cfg(target_os = "linux")]
    #[test]
    fn a_reservation_larger_than_the_host_costs_only_what_is_touched() {
        // 1 TiB: more than this project's hosts have, memory and swap together.
        let len = 1usize << 40;
        let bytes = HostBytes::reserved(len).expect("a reservation of address space only");
        assert_eq!(bytes.len(), len);
        for at in [0, len / 2, len - 1] {
            assert_eq!(bytes[at].load(Relaxed), 0);
            bytes[at].store(7, Relaxed);
            assert_eq!(bytes[at].load(Relaxed), 7);
        }
    }

    #[test]
    fn heap_bytes_are_zeroed_and_zero_is_refused() {
        let heap = HostBytes::zeroed(4096).unwrap();
        assert!(heap.iter().all(|b| b.load(Relaxed) == 0));
        assert!(HostBytes::zeroed(0).is_none() && HostBytes::reserved(0).is_none());
    }
}
