//! `TrackingAdaptor`: the report of outstanding allocations, backtraces, unknown frees.

use super::*;

#[test]
fn tracking_report_lists_exactly_the_outstanding_allocations() {
    for device in devices() {
        let tracking = TrackingAdaptor::new(pool(&device, 0, 64 * MIB));
        let s = device.create_stream().unwrap();
        let mut rng = SplitMix64(3);
        let mut live = BTreeMap::new();
        let mut freed = Vec::new();
        for i in 0..40 {
            let bytes = 1 + (rng.next() % (256 * KIB as u64)) as usize;
            let ptr = tracking.allocate(bytes, &s).unwrap();
            live.insert(ptr.0, bytes);
            if i % 3 == 0 {
                let (&p, &b) = live
                    .iter()
                    .nth((rng.next() % live.len() as u64) as usize)
                    .unwrap();
                free(&tracking, DevicePtr(p), b, &s);
                live.remove(&p);
                freed.push(p);
            }
        }
        let expected: Vec<(DevicePtr, usize)> =
            live.iter().map(|(&p, &b)| (DevicePtr(p), b)).collect();
        assert_eq!(tracking.outstanding(), expected, "{}", label(&device));
        assert_eq!(tracking.outstanding_count(), live.len());
        assert_eq!(tracking.allocated_bytes(), live.values().sum::<usize>());

        let report = tracking.report();
        let lines: Vec<&str> = report.lines().collect();
        assert_eq!(
            lines[0],
            format!(
                "{} outstanding allocations, {} bytes",
                live.len(),
                live.values().sum::<usize>()
            )
        );
        assert_eq!(lines.len(), 1 + live.len(), "{report}");
        for (line, (ptr, bytes)) in lines[1..].iter().zip(&live) {
            assert_eq!(
                *line,
                format!("  {ptr:#x}: {bytes} bytes on {}", s.id()),
                "{report}"
            );
        }
        for p in freed {
            // The freed pointers may have been reused; only check those that were not.
            if !live.contains_key(&p) {
                assert!(!report.contains(&format!("{p:#x}:")), "{report}");
            }
        }
        for (&p, &b) in &live {
            free(&tracking, DevicePtr(p), b, &s);
        }
        assert_eq!(tracking.outstanding_count(), 0);
        assert_eq!(tracking.report(), "0 outstanding allocations, 0 bytes\n");
    }
}

#[test]
fn tracking_with_backtraces_reports_where_each_allocation_was_made() {
    let device = devices().remove(0);
    let tracking = TrackingAdaptor::with_backtraces(CudaResource::new(&device));
    assert!(tracking.captures_backtraces());
    let s = device.create_stream().unwrap();
    let a = tracking.allocate(4096, &s).unwrap();
    let b = tracking.allocate(512, &s).unwrap();
    free(&tracking, b, 512, &s);
    let report = tracking.report();
    assert!(
        report.starts_with("1 outstanding allocation, 4096 bytes\n"),
        "{report}"
    );
    assert!(
        report.contains(&format!("{:#x}: 4096 bytes", a.0)),
        "{report}"
    );
    assert!(
        !report.contains(&format!("{:#x}:", b.0)) || a == b,
        "{report}"
    );
    assert_eq!(report.matches("allocated at:").count(), 1, "{report}");
    // Naming the function needs symbols and no inlining: a debug build. (The GPU runs use
    // release builds stripped of debug information, where the frame can vanish.)
    if cfg!(debug_assertions) {
        assert!(
            report.contains("tracking_with_backtraces_reports_where_each_allocation_was_made"),
            "the backtrace does not name the allocating function:\n{report}"
        );
    }
    free(&tracking, a, 4096, &s);
}

#[test]
fn tracking_refuses_unknown_frees_without_touching_the_upstream() {
    for device in devices() {
        // The upstream counts every free that reaches it.
        let tracking = TrackingAdaptor::new(StatisticsAdaptor::new(CudaResource::new(&device)));
        let s = device.create_stream().unwrap();
        let a = tracking.allocate(MIB, &s).unwrap();
        let before = tracking.upstream().counters();

        let logs = SharedBuf::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer({
                let logs = logs.clone();
                move || logs.clone()
            })
            .with_ansi(false)
            .finish();
        let errors = tracing::subscriber::with_default(subscriber, || {
            [
                (a.offset(256), MIB),   // not a pointer it handed out
                (a, MIB / 2),           // another size
                (DevicePtr(0x1000), 8), // never seen
                (DevicePtr(0), 256),    // null with bytes
                (a, 0),                 // a real pointer with zero bytes
            ]
            .map(|(ptr, bytes)| (ptr, bytes, bad_free(&tracking, ptr, bytes, &s)))
        });
        for (ptr, bytes, err) in errors {
            assert_eq!(
                err,
                Error::UnknownPointer { ptr: ptr.0, bytes },
                "{}",
                label(&device)
            );
        }
        assert_eq!(
            tracking.upstream().counters(),
            before,
            "the upstream saw a bad free"
        );
        assert_eq!(tracking.outstanding(), vec![(a, MIB)]);
        let logged = logs.text();
        assert_eq!(logged.matches("ERROR").count(), 5, "{logged}");
        assert!(logged.contains("did not hand out"), "{logged}");

        // The right free works, and a second one is refused.
        free(&tracking, a, MIB, &s);
        assert_eq!(tracking.upstream().allocations_counter().value, 0);
        assert_eq!(
            bad_free(&tracking, a, MIB, &s),
            Error::UnknownPointer {
                ptr: a.0,
                bytes: MIB
            }
        );
        assert_eq!(tracking.upstream().allocations_counter().value, 0);
        // Zero-byte allocations pass through untracked.
        let z = tracking.allocate(0, &s).unwrap();
        assert_eq!(tracking.outstanding_count(), 0);
        free(&tracking, z, 0, &s);
    }
}
