//! `AlignedAdaptor`: aligned results, frees of the right upstream pointer, the threshold, wrong
//! frees refused.

use super::*;

#[test]
fn aligned_results_and_frees_of_the_right_upstream_pointer() {
    for device in devices() {
        for alignment in [4096, MIB] {
            // Tracking below sees exactly what goes upstream; it refuses any wrong free.
            let aligned =
                AlignedAdaptor::new(TrackingAdaptor::new(CudaResource::new(&device)), alignment)
                    .unwrap();
            assert_eq!(aligned.alignment(), alignment);
            let s = device.create_stream().unwrap();
            let mut rng = SplitMix64(alignment as u64);
            let mut live = Vec::new();
            for _ in 0..16 {
                let bytes = 4 * (1 + (rng.next() % (MIB as u64 / 2)) as usize);
                let ptr = aligned.allocate(bytes, &s).unwrap();
                assert_eq!(
                    ptr.0 % alignment as u64,
                    0,
                    "{}: {bytes} B at {ptr:?}",
                    label(&device)
                );
                // The whole range is usable (the simulated device checks every access).
                // SAFETY: `bytes` live bytes at `ptr`, used on `s` only.
                unsafe { s.fill_u32(ptr, 0x5A5A_5A5A, bytes / 4) }.unwrap();
                assert_eq!(read_u32(&s, ptr.offset(bytes - 4), 1), [0x5A5A_5A5A]);
                live.push((ptr, bytes));
            }
            // Upstream: one padded allocation per aligned one, holding it.
            let upstream = aligned.upstream().outstanding();
            assert_eq!(upstream.len(), live.len());
            for &(ptr, bytes) in &live {
                let padded = bytes.next_multiple_of(alignment) + alignment - ALIGNMENT;
                let (up, size) = upstream
                    .iter()
                    .copied()
                    .find(|&(up, _)| up.0 <= ptr.0 && ptr.0 < up.0 + alignment as u64)
                    .expect("no upstream allocation holds the aligned one");
                assert_eq!(size, padded);
                assert!(ptr.0 + bytes as u64 <= up.0 + size as u64);
            }
            // A wrong free is refused before the upstream sees it.
            let (p0, b0) = live[0];
            assert_eq!(
                bad_free(&aligned, p0.offset(256), b0, &s),
                Error::UnknownPointer {
                    ptr: p0.0 + 256,
                    bytes: b0
                }
            );
            assert!(matches!(
                bad_free(&aligned, p0, b0 + 4, &s),
                Error::UnknownPointer { .. }
            ));
            // Every free reaches the upstream with its own pointer and size (Tracking would
            // refuse anything else).
            for (ptr, bytes) in live {
                free(&aligned, ptr, bytes, &s);
            }
            assert_eq!(aligned.upstream().outstanding_count(), 0);
        }
    }
}

#[test]
fn aligned_threshold_and_bad_alignments() {
    for device in devices() {
        for alignment in [0, 3, 768, 3000, (1 << 20) + 1] {
            assert_eq!(
                AlignedAdaptor::new(CudaResource::new(&device), alignment).unwrap_err(),
                Error::InvalidAlignment { alignment }
            );
        }
        // 256 and below change nothing.
        let plain = AlignedAdaptor::new(CudaResource::new(&device), 64).unwrap();
        assert_eq!(plain.alignment(), ALIGNMENT);

        let aligned = AlignedAdaptor::with_threshold(
            TrackingAdaptor::new(pool(&device, 0, 64 * MIB)),
            64 * KIB,
            MIB,
        )
        .unwrap();
        assert_eq!(aligned.threshold(), MIB);
        let s = device.create_stream().unwrap();
        // Below the threshold: straight through, not padded.
        let small = aligned.allocate(MIB - 1, &s).unwrap();
        assert_eq!(aligned.upstream().outstanding(), vec![(small, MIB - 1)]);
        // At the threshold: aligned and padded.
        let big = aligned.allocate(MIB, &s).unwrap();
        assert_eq!(big.0 % (64 * KIB) as u64, 0);
        assert_eq!(aligned.upstream().outstanding_count(), 2);
        let padded = aligned
            .upstream()
            .outstanding()
            .into_iter()
            .find(|&(p, _)| p != small)
            .unwrap();
        assert_eq!(padded.1, MIB + 64 * KIB - ALIGNMENT);
        assert!(padded.0 <= big && big.0 < padded.0 .0 + 64 * KIB as u64);
        free(&aligned, small, MIB - 1, &s);
        free(&aligned, big, MIB, &s);
        assert_eq!(aligned.upstream().outstanding_count(), 0);
        // Zero bytes pass through.
        let z = aligned.allocate(0, &s).unwrap();
        assert_eq!(z, DevicePtr(0));
        free(&aligned, z, 0, &s);
        assert!(matches!(
            aligned.allocate(usize::MAX - 10, &s),
            Err(Error::InvalidSize { .. })
        ));
    }
}

/// A free of an aligned allocation with a size below the threshold, one that would pass
/// straight through, is refused from the table before the upstream sees it. A review found it
/// passed upstream: `CudaResource` ignores the size and freed the memory, the table kept a
/// stale entry, and the right free afterwards failed.
#[test]
fn aligned_refuses_a_wrong_size_free_below_the_threshold() {
    for device in devices() {
        // Statistics sees every call that reaches the upstream; `CudaResource` under it ignores
        // sizes, as `cuMemFree` does, so only the adaptor can refuse.
        let aligned = AlignedAdaptor::with_threshold(
            StatisticsAdaptor::new(CudaResource::new(&device)),
            512,
            KIB,
        )
        .unwrap();
        let s = device.create_stream().unwrap();
        let ptr = aligned.allocate(2000, &s).unwrap();
        let before = aligned.upstream().counters();
        for wrong in [100, 0] {
            assert_eq!(
                bad_free(&aligned, ptr, wrong, &s),
                Error::UnknownPointer {
                    ptr: ptr.0,
                    bytes: wrong
                },
                "{}",
                label(&device)
            );
        }
        s.synchronize_blocking().unwrap();
        assert_eq!(
            aligned.upstream().counters(),
            before,
            "{}: a refused free reached the upstream",
            label(&device)
        );
        // Still allocated: the whole range is usable (the simulated device checks every access).
        // SAFETY: 2000 live bytes at `ptr`, used on `s` only.
        unsafe { s.fill_u32(ptr, 0x5A5A_5A5A, 500) }.unwrap();
        assert_eq!(read_u32(&s, ptr.offset(1996), 1), [0x5A5A_5A5A]);
        // The right free goes through, and everything is back.
        free(&aligned, ptr, 2000, &s);
        assert_eq!(aligned.upstream().counters().bytes.value, 0);
        assert_eq!(aligned.upstream().counters().allocations.value, 0);
        assert_eq!(
            bad_free(&aligned, ptr, 2000, &s),
            Error::UnknownPointer {
                ptr: ptr.0,
                bytes: 2000
            },
            "{}: still in the table after its free",
            label(&device)
        );
    }
}

/// When the upstream refuses the free of an aligned allocation, the error names the pointer
/// and size the caller gave, not the padded upstream allocation behind them.
#[test]
fn aligned_reports_the_callers_numbers_when_the_upstream_refuses_a_free() {
    for device in devices() {
        let aligned =
            AlignedAdaptor::new(TrackingAdaptor::new(CudaResource::new(&device)), 4096).unwrap();
        let s = device.create_stream().unwrap();
        let ptr = aligned.allocate(2000, &s).unwrap();
        let [(up, size)] = aligned.upstream().outstanding()[..] else {
            panic!("{}: not one upstream allocation", label(&device));
        };
        // Freed behind the adaptor's back, so that Tracking refuses the adaptor's free.
        // SAFETY: the upstream's own allocation with its size, never used, freed once (the
        // adaptor's free below is refused by Tracking before it reaches the device).
        unsafe { aligned.upstream().deallocate(up, size, &s) }.unwrap();
        assert_eq!(
            bad_free(&aligned, ptr, 2000, &s),
            Error::UnknownPointer {
                ptr: ptr.0,
                bytes: 2000
            },
            "{}",
            label(&device)
        );
    }
}

/// Behind a waiter, a request that fits the pool's maximum as asked but never once padded for
/// the alignment fails at once, as it does alone: a review found it queued until its turn.
#[test]
fn a_request_padded_past_the_maximum_fails_at_once_behind_a_waiter() {
    for device in devices() {
        let mr = AlignedAdaptor::new(common::waiting_pool(&device, 4 * MIB, 4 * MIB), MIB).unwrap();
        let s = device.create_stream().unwrap();
        let held = mr.upstream().allocate(4 * MIB, &s).unwrap();
        let mut waiter = Box::pin(mr.upstream().allocate_async(MIB, &s));
        assert!(common::poll_once(waiter.as_mut()).is_pending());
        let mut hopeless = Box::pin(mr.allocate_async(4 * MIB, &s));
        assert!(
            matches!(
                common::poll_once(hopeless.as_mut()),
                std::task::Poll::Ready(Err(Error::OutOfMemory { .. }))
            ),
            "{}: queued behind the waiter",
            label(&device)
        );
        // A size whose padding alone overflows: the adaptor's error, as alone.
        let mut overflow = Box::pin(mr.allocate_async(usize::MAX - 511, &s));
        assert!(
            matches!(
                common::poll_once(overflow.as_mut()),
                std::task::Poll::Ready(Err(Error::InvalidSize { .. }))
            ),
            "{}: a padding that overflows, behind the waiter",
            label(&device)
        );
        drop(waiter);
        free(mr.upstream(), held, 4 * MIB, &s);
    }
}
