//! The resource adaptors on every available device (see `common`): what each one promises
//! (statistics, tracking, logging, limiting, alignment, failure callback, prefetch), that they
//! compose, and that `allocate_async` waits through them in the right queue.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{devices, eventually, free, label, pool, read_u32, SplitMix64};
use streamalloc::resource::adaptor::{
    AlignedAdaptor, Counter, Counters, FailureCallbackAdaptor, LimitingAdaptor, LoggingAdaptor,
    PrefetchAdaptor, StatisticsAdaptor, TrackingAdaptor, LOG_FILE_ENV,
};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::managed::ManagedResource;
use streamalloc::resource::pool::PoolResource;
use streamalloc::{AllocateAsync, DevicePtr, Error, MemoryKind, MemoryResource, Stream, ALIGNMENT};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const PIB: usize = 1 << 50;

type Pool = PoolResource<CudaResource>;

/// A deallocation that the test expects to be refused; returns the error.
fn bad_free(
    res: &(impl MemoryResource + ?Sized),
    ptr: DevicePtr,
    bytes: usize,
    stream: &Stream,
) -> Error {
    // SAFETY: the adaptors under test refuse these frees before any memory is touched (that is
    // what the tests check); nothing is freed.
    unsafe { res.deallocate(ptr, bytes, stream) }.expect_err("a bad free was accepted")
}

fn round_up(bytes: usize) -> usize {
    bytes.next_multiple_of(ALIGNMENT)
}

/// A `Write` whose bytes the test reads back.
#[derive(Clone, Default)]
struct SharedBuf(Arc<Mutex<Vec<u8>>>);

impl SharedBuf {
    fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

impl Write for SharedBuf {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "streamalloc-adaptors-{}-{name}.csv",
        std::process::id()
    ))
}

// ===== every adaptor =====

#[test]
fn adaptors_are_send_sync_and_debug() {
    fn send_sync<T: Send + Sync + std::fmt::Debug>() {}
    send_sync::<StatisticsAdaptor<Pool>>();
    send_sync::<TrackingAdaptor<Pool>>();
    send_sync::<LoggingAdaptor<Pool>>();
    send_sync::<LimitingAdaptor<Pool>>();
    send_sync::<AlignedAdaptor<Pool>>();
    send_sync::<FailureCallbackAdaptor<Pool>>();
    send_sync::<PrefetchAdaptor<Pool>>();
    send_sync::<StatisticsAdaptor<Arc<dyn MemoryResource>>>();

    let device = devices().remove(0);
    let cuda = || CudaResource::new(&device);
    let debug = [
        format!("{:?}", StatisticsAdaptor::new(cuda())),
        format!("{:?}", TrackingAdaptor::new(cuda())),
        format!("{:?}", LoggingAdaptor::new(cuda(), SharedBuf::default())),
        format!("{:?}", LimitingAdaptor::new(cuda(), MIB)),
        format!("{:?}", AlignedAdaptor::new(cuda(), 4096).unwrap()),
        format!("{:?}", FailureCallbackAdaptor::new(cuda(), |_| false)),
        format!("{:?}", PrefetchAdaptor::new(cuda())),
    ];
    for (text, name) in debug.iter().zip([
        "StatisticsAdaptor",
        "TrackingAdaptor",
        "LoggingAdaptor",
        "LimitingAdaptor",
        "AlignedAdaptor",
        "FailureCallbackAdaptor",
        "PrefetchAdaptor",
    ]) {
        assert!(text.starts_with(name), "{text}");
        assert!(text.contains("CudaResource"), "{text}");
    }
}

#[test]
fn device_kind_and_waiters_are_forwarded_and_only_the_limit_has_its_own_queue() {
    for device in devices() {
        let p = Arc::new(pool(&device, 0, 16 * MIB));
        let pool_waiters = p.memory_waiters().unwrap() as *const _;
        let forwarding: Vec<(&str, Box<dyn MemoryResource>)> = vec![
            ("statistics", Box::new(StatisticsAdaptor::new(p.clone()))),
            ("tracking", Box::new(TrackingAdaptor::new(p.clone()))),
            (
                "logging",
                Box::new(LoggingAdaptor::new(p.clone(), SharedBuf::default())),
            ),
            (
                "aligned",
                Box::new(AlignedAdaptor::new(p.clone(), 4096).unwrap()),
            ),
            (
                "failure callback",
                Box::new(FailureCallbackAdaptor::new(p.clone(), |_| false)),
            ),
            ("prefetch", Box::new(PrefetchAdaptor::new(p.clone()))),
        ];
        for (name, adaptor) in &forwarding {
            assert_eq!(adaptor.device().id(), device.id(), "{name}");
            assert_eq!(adaptor.memory_kind(), MemoryKind::Device, "{name}");
            assert!(
                std::ptr::eq(adaptor.memory_waiters().unwrap(), pool_waiters),
                "{}: {name} does not forward the pool's waiters",
                label(&device)
            );
        }
        let limiting = LimitingAdaptor::new(p.clone(), MIB);
        let own = limiting.memory_waiters().unwrap();
        assert!(!std::ptr::eq(own, pool_waiters));
        // ... and an adaptor over the limit forwards the limit's queue.
        let over = StatisticsAdaptor::new(limiting);
        assert!(std::ptr::eq(
            over.memory_waiters().unwrap(),
            over.upstream().memory_waiters().unwrap()
        ));
        // Without a queue upstream there is none.
        assert!(StatisticsAdaptor::new(CudaResource::new(&device))
            .memory_waiters()
            .is_none());
        let managed = PrefetchAdaptor::new(ManagedResource::new(&device));
        assert_eq!(managed.memory_kind(), MemoryKind::Managed);
    }
}

// ===== StatisticsAdaptor =====

/// The test's own model of RMM's counters.
#[derive(Clone, Copy, Default, Debug)]
struct Model {
    bytes: Counter,
    allocations: Counter,
}

impl Model {
    fn add(c: &mut Counter, n: i64) {
        c.value += n;
        c.total += n;
        c.peak = c.peak.max(c.value);
    }

    fn allocate(&mut self, bytes: usize) {
        Self::add(&mut self.bytes, bytes as i64);
        Self::add(&mut self.allocations, 1);
    }

    fn free(&mut self, bytes: usize) {
        self.bytes.value -= bytes as i64;
        self.allocations.value -= 1;
    }

    fn fold(outer: &mut Counter, inner: &Counter) {
        outer.peak = outer.peak.max(outer.value + inner.peak);
        outer.value += inner.value;
        outer.total += inner.total;
    }

    fn counters(&self) -> Counters {
        Counters {
            bytes: self.bytes,
            allocations: self.allocations,
        }
    }
}

#[test]
fn statistics_count_exactly_through_a_random_mix_with_scopes() {
    for device in devices() {
        let stats = StatisticsAdaptor::new(pool(&device, 0, 64 * MIB));
        let streams: Vec<Stream> = (0..2).map(|_| device.create_stream().unwrap()).collect();
        let mut rng = SplitMix64(7);
        let mut scopes = vec![Model::default()];
        let mut live: Vec<(DevicePtr, usize, usize)> = Vec::new();
        let (mut failures, mut zeros, mut pops) = (0, 0, 0);
        for step in 0..3000 {
            let r = rng.next() % 100;
            if r < 3 {
                // A request that cannot succeed: not counted.
                let s = &streams[step % 2];
                assert!(matches!(
                    stats.allocate(PIB, s),
                    Err(Error::OutOfMemory { .. })
                ));
                failures += 1;
            } else if r < 6 {
                // Zero bytes: passes through, not counted.
                let s = &streams[step % 2];
                let ptr = stats.allocate(0, s).unwrap();
                free(&stats, ptr, 0, s);
                zeros += 1;
            } else if r < 8 {
                let before = stats.push_counters();
                assert_eq!(before, scopes.last().unwrap().counters());
                scopes.push(Model::default());
            } else if r < 10 {
                let popped = stats.pop_counters();
                if scopes.len() < 2 {
                    assert!(matches!(popped, Err(Error::InvalidArgument { .. })));
                } else {
                    let inner = scopes.pop().unwrap();
                    assert_eq!(popped.unwrap(), inner.counters());
                    let outer = scopes.last_mut().unwrap();
                    Model::fold(&mut outer.bytes, &inner.bytes);
                    Model::fold(&mut outer.allocations, &inner.allocations);
                    pops += 1;
                }
            } else if live.is_empty() || (r < 55 && live.len() < 40) {
                let bytes = 1 + (rng.next() % (MIB as u64)) as usize;
                let s = (rng.next() % 2) as usize;
                let ptr = stats.allocate(bytes, &streams[s]).unwrap();
                live.push((ptr, bytes, s));
                scopes.last_mut().unwrap().allocate(bytes);
            } else {
                let (ptr, bytes, s) = live.swap_remove((rng.next() % live.len() as u64) as usize);
                free(&stats, ptr, bytes, &streams[s]);
                scopes.last_mut().unwrap().free(bytes);
            }
            assert_eq!(
                stats.counters(),
                scopes.last().unwrap().counters(),
                "{}: step {step}",
                label(&device)
            );
            assert_eq!(stats.depth(), scopes.len());
        }
        assert!(failures > 0 && zeros > 0 && pops > 0);
        // Close every scope: the outermost then describes the whole history.
        while scopes.len() > 1 {
            let inner = scopes.pop().unwrap();
            assert_eq!(stats.pop_counters().unwrap(), inner.counters());
            let outer = scopes.last_mut().unwrap();
            Model::fold(&mut outer.bytes, &inner.bytes);
            Model::fold(&mut outer.allocations, &inner.allocations);
        }
        let outstanding: usize = live.iter().map(|l| l.1).sum();
        let all = stats.counters();
        assert_eq!(all, scopes[0].counters());
        assert_eq!(all.bytes.value, outstanding as i64);
        assert_eq!(all.allocations.value, live.len() as i64);
        for (ptr, bytes, s) in live {
            free(&stats, ptr, bytes, &streams[s]);
        }
        assert_eq!(stats.bytes_counter().value, 0);
        assert_eq!(stats.allocations_counter().value, 0);
    }
}

#[test]
fn statistics_scopes_fold_into_the_outer_scope_as_rmm_does() {
    for device in devices() {
        let stats = StatisticsAdaptor::new(CudaResource::new(&device));
        let s = device.create_stream().unwrap();
        let c = |value, peak, total| Counter { value, peak, total };

        let a = stats.allocate(100, &s).unwrap();
        let outer = stats.push_counters();
        assert_eq!(outer.bytes, c(100, 100, 100));
        assert_eq!(outer.allocations, c(1, 1, 1));
        assert_eq!(
            stats.counters(),
            Counters::default(),
            "a new scope starts at zero"
        );

        let b = stats.allocate(200, &s).unwrap();
        let d = stats.allocate(300, &s).unwrap();
        free(&stats, b, 200, &s);
        // Freeing the outer scope's allocation takes the inner value below what it allocated.
        free(&stats, a, 100, &s);
        assert_eq!(stats.bytes_counter(), c(200, 500, 500));
        assert_eq!(stats.allocations_counter(), c(0, 2, 2));

        let inner = stats.pop_counters().unwrap();
        assert_eq!(inner.bytes, c(200, 500, 500));
        assert_eq!(inner.allocations, c(0, 2, 2));
        // value += inner.value, total += inner.total, peak = max(peak, value_before + inner.peak).
        assert_eq!(stats.bytes_counter(), c(300, 600, 600));
        assert_eq!(stats.allocations_counter(), c(1, 3, 3));
        assert_eq!(stats.depth(), 1);
        assert!(matches!(
            stats.pop_counters(),
            Err(Error::InvalidArgument { .. })
        ));

        // Negative inside a scope.
        stats.push_counters();
        free(&stats, d, 300, &s);
        assert_eq!(stats.bytes_counter(), c(-300, 0, 0));
        assert_eq!(stats.allocations_counter(), c(-1, 0, 0));
        stats.pop_counters().unwrap();
        assert_eq!(stats.bytes_counter(), c(0, 600, 600));
        assert_eq!(stats.allocations_counter(), c(0, 3, 3));
    }
}

#[test]
fn statistics_do_not_count_failures_zero_bytes_or_refused_frees() {
    for device in devices() {
        // Tracking below: an upstream that surely refuses a bad free.
        let stats = StatisticsAdaptor::new(TrackingAdaptor::new(pool(&device, 0, 4 * MIB)));
        let s = device.create_stream().unwrap();
        let a = stats.allocate(3 * MIB, &s).unwrap();
        let before = stats.counters();
        assert!(stats.allocate(2 * MIB, &s).is_err());
        assert!(stats.allocate(PIB, &s).is_err());
        let z = stats.allocate(0, &s).unwrap();
        assert_eq!(z, DevicePtr(0));
        free(&stats, z, 0, &s);
        assert_eq!(stats.counters(), before);
        // A free that the upstream refuses is not counted either.
        let err = bad_free(&stats, a.offset(256), 3 * MIB, &s);
        assert!(matches!(err, Error::UnknownPointer { .. }), "{err:?}");
        assert_eq!(stats.counters(), before, "{}", label(&device));
        free(&stats, a, 3 * MIB, &s);
        assert_eq!(stats.bytes_counter().value, 0);
        assert_eq!(stats.bytes_counter().total, 3 * MIB as i64);
    }
}

#[test]
fn statistics_are_exact_under_threads() {
    for device in devices() {
        let stats = Arc::new(StatisticsAdaptor::new(pool(&device, 0, 256 * MIB)));
        let totals: Vec<(usize, usize)> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..4u64)
                .map(|t| {
                    let (stats, device) = (stats.clone(), device.clone());
                    scope.spawn(move || {
                        let s = device.create_stream().unwrap();
                        let mut rng = SplitMix64(40 + t);
                        let (mut bytes, mut count) = (0, 0);
                        let mut live = Vec::new();
                        for _ in 0..2000 {
                            if live.is_empty() || rng.next().is_multiple_of(2) {
                                let size = 1 + (rng.next() % (64 * KIB as u64)) as usize;
                                live.push((stats.allocate(size, &s).unwrap(), size));
                                bytes += size;
                                count += 1;
                            } else {
                                let (ptr, size) =
                                    live.swap_remove((rng.next() % live.len() as u64) as usize);
                                free(&*stats, ptr, size, &s);
                            }
                        }
                        for (ptr, size) in live {
                            free(&*stats, ptr, size, &s);
                        }
                        (bytes, count)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let c = stats.counters();
        assert_eq!(c.bytes.value, 0, "{}", label(&device));
        assert_eq!(c.allocations.value, 0);
        assert_eq!(
            c.bytes.total,
            totals.iter().map(|t| t.0).sum::<usize>() as i64
        );
        assert_eq!(
            c.allocations.total,
            totals.iter().map(|t| t.1).sum::<usize>() as i64
        );
        assert!(c.allocations.peak >= 1 && c.allocations.peak <= 4 * 2000);
    }
}

// ===== TrackingAdaptor =====

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

// ===== LoggingAdaptor =====

#[derive(Debug, PartialEq, Eq, Clone)]
struct Line {
    thread: u64,
    action: String,
    ptr: u64,
    size: usize,
    stream: u64,
}

/// Parses a log as RMM's replay tool would, checking every column's form.
fn parse_log(text: &str) -> Vec<Line> {
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("Thread,Time,Action,Pointer,Size,Stream"));
    lines
        .map(|line| {
            let cols: Vec<&str> = line.split(',').collect();
            assert_eq!(cols.len(), 6, "{line}");
            // Time: HH:MM:SS.ffffff
            let t = cols[1].as_bytes();
            assert_eq!(t.len(), 15, "{line}");
            for (i, &ch) in t.iter().enumerate() {
                match i {
                    2 | 5 => assert_eq!(ch, b':', "{line}"),
                    8 => assert_eq!(ch, b'.', "{line}"),
                    _ => assert!(ch.is_ascii_digit(), "{line}"),
                }
            }
            assert!(cols[1][..2].parse::<u32>().unwrap() < 24);
            assert!(cols[3].starts_with("0x"), "{line}");
            Line {
                thread: cols[0].parse().unwrap(),
                action: cols[2].to_owned(),
                ptr: u64::from_str_radix(&cols[3][2..], 16).unwrap(),
                size: cols[4].parse().unwrap(),
                stream: cols[5].parse().unwrap(),
            }
        })
        .collect()
}

#[test]
fn logging_writes_one_rmm_csv_line_per_event() {
    for device in devices() {
        let buf = SharedBuf::default();
        let log = LoggingAdaptor::new(pool(&device, 0, 64 * MIB), buf.clone());
        let streams: Vec<Stream> = (0..2).map(|_| device.create_stream().unwrap()).collect();
        let mut rng = SplitMix64(5);
        let mut expected = Vec::new();
        let mut live = Vec::new();
        for i in 0..20 {
            let size = 1 + (rng.next() % (MIB as u64)) as usize;
            let s = &streams[i % 2];
            let ptr = log.allocate(size, s).unwrap();
            live.push((ptr, size, i % 2));
            expected.push(("allocate", ptr.0, size, s.id().get()));
        }
        assert!(log.allocate(PIB, &streams[1]).is_err());
        expected.push(("allocate failure", 0, PIB, streams[1].id().get()));
        for (ptr, size, s) in live.drain(..).rev() {
            free(&log, ptr, size, &streams[s]);
            expected.push(("free", ptr.0, size, streams[s].id().get()));
        }
        // Zero bytes are logged too.
        let z = log.allocate(0, &streams[0]).unwrap();
        free(&log, z, 0, &streams[0]);
        expected.push(("allocate", 0, 0, streams[0].id().get()));
        expected.push(("free", 0, 0, streams[0].id().get()));
        log.flush().unwrap();

        let lines = parse_log(&buf.text());
        assert_eq!(log.lines(), 1 + lines.len() as u64);
        let got: Vec<_> = lines
            .iter()
            .map(|l| (l.action.as_str(), l.ptr, l.size, l.stream))
            .collect();
        assert_eq!(got, expected, "{}", label(&device));
        assert_eq!(lines.iter().filter(|l| l.action == "allocate").count(), 21);
        assert_eq!(lines.iter().filter(|l| l.action == "free").count(), 21);
        assert_eq!(
            lines
                .iter()
                .filter(|l| l.action == "allocate failure")
                .count(),
            1
        );
        // One thread wrote every line.
        assert!(lines.iter().all(|l| l.thread == lines[0].thread));
    }
}

#[test]
fn logging_lines_of_concurrent_threads_stay_whole_and_name_their_thread() {
    let device = devices().remove(0);
    let buf = SharedBuf::default();
    let log = Arc::new(LoggingAdaptor::new(
        pool(&device, 0, 256 * MIB),
        buf.clone(),
    ));
    let per_thread: Vec<(BTreeSet<u64>, u64)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let (log, device) = (log.clone(), device.clone());
                scope.spawn(move || {
                    let s = device.create_stream().unwrap();
                    let mut ptrs = BTreeSet::new();
                    for i in 0..500 {
                        let size = 256 * (1 + i % 7);
                        let p = log.allocate(size, &s).unwrap();
                        ptrs.insert(p.0);
                        free(&*log, p, size, &s);
                    }
                    (ptrs, s.id().get())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    log.flush().unwrap();
    let lines = parse_log(&buf.text());
    assert_eq!(lines.len(), 4 * 1000);
    // Each stream's lines come from one thread, a different one per stream.
    let mut thread_of_stream = BTreeMap::new();
    for l in &lines {
        assert_eq!(
            *thread_of_stream.entry(l.stream).or_insert(l.thread),
            l.thread
        );
    }
    let threads: BTreeSet<u64> = thread_of_stream.values().copied().collect();
    assert_eq!(threads.len(), 4);
    // Per stream: allocate and free alternate, for the same pointer and size.
    for (_, stream) in &per_thread {
        let mine: Vec<&Line> = lines.iter().filter(|l| l.stream == *stream).collect();
        assert_eq!(mine.len(), 1000);
        for pair in mine.chunks(2) {
            assert_eq!(pair[0].action, "allocate");
            assert_eq!(pair[1].action, "free");
            assert_eq!((pair[0].ptr, pair[0].size), (pair[1].ptr, pair[1].size));
        }
    }
    // Across threads the log's order is the memory's order: a pointer is never allocated
    // twice without a free between.
    let mut out = BTreeSet::new();
    for l in &lines {
        match l.action.as_str() {
            "allocate" => assert!(out.insert(l.ptr), "{:#x} allocated twice", l.ptr),
            "free" => assert!(out.remove(&l.ptr)),
            other => panic!("{other}"),
        }
    }
}

#[test]
fn logging_to_a_file_and_from_the_environment() {
    let device = devices().remove(0);
    let s = device.create_stream().unwrap();

    let path = temp_path("file");
    {
        let log = LoggingAdaptor::to_file(CudaResource::new(&device), &path).unwrap();
        assert_eq!(log.path().as_deref(), Some(path.as_path()));
        let p = log.allocate(4096, &s).unwrap();
        free(&log, p, 4096, &s);
        // Dropping flushes.
    }
    let lines = parse_log(&std::fs::read_to_string(&path).unwrap());
    assert_eq!(lines.len(), 2);
    assert_eq!(
        (lines[0].action.as_str(), lines[0].size),
        ("allocate", 4096)
    );
    assert_eq!(lines[1].action, "free");
    std::fs::remove_file(&path).unwrap();

    // A file that cannot be created.
    let bad = std::env::temp_dir().join("streamalloc-no-such-dir/x/log.csv");
    assert!(matches!(
        LoggingAdaptor::to_file(CudaResource::new(&device), &bad),
        Err(Error::Io { .. })
    ));

    // The environment variable: only this test touches it.
    std::env::remove_var(LOG_FILE_ENV);
    assert!(matches!(
        LoggingAdaptor::from_env(CudaResource::new(&device)),
        Err(Error::InvalidArgument { .. })
    ));
    let path = temp_path("env");
    std::env::set_var(LOG_FILE_ENV, &path);
    let log = LoggingAdaptor::from_env(CudaResource::new(&device))
        .unwrap()
        .auto_flush(true);
    std::env::remove_var(LOG_FILE_ENV);
    let p = log.allocate(256, &s).unwrap();
    // Auto-flush: on disk before any flush or drop.
    let lines = parse_log(&std::fs::read_to_string(&path).unwrap());
    assert_eq!(lines.len(), 1);
    assert_eq!((lines[0].ptr, lines[0].size), (p.0, 256));
    free(&log, p, 256, &s);
    drop(log);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn logging_write_errors_do_not_fail_allocations_and_are_reported_by_flush() {
    struct Broken;
    impl Write for Broken {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(std::io::Error::other("disk full"))
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let device = devices().remove(0);
    let s = device.create_stream().unwrap();
    let log = LoggingAdaptor::new(CudaResource::new(&device), Broken);
    let p = log.allocate(1024, &s).unwrap();
    free(&log, p, 1024, &s);
    assert!(log.flush().is_err());
    assert!(log.flush().is_ok(), "the error is reported once");
}

// ===== LimitingAdaptor =====

#[test]
fn limiting_is_exact_at_the_edge() {
    for device in devices() {
        let limit = MIB;
        let lim = LimitingAdaptor::new(pool(&device, 0, 4 * MIB), limit);
        let s = device.create_stream().unwrap();
        assert_eq!(
            (lim.limit(), lim.used(), lim.available()),
            (limit, 0, limit)
        );

        // Exactly the limit in one allocation, then one byte more fails.
        let a = lim.allocate(limit, &s).unwrap();
        assert_eq!(lim.used(), limit);
        assert_eq!(
            lim.allocate(1, &s).unwrap_err(),
            Error::OutOfMemory {
                requested: ALIGNMENT,
                available: 0,
                maximum: limit
            },
            "{}",
            label(&device)
        );
        // Free, then it fits again.
        free(&lim, a, limit, &s);
        assert_eq!(lim.used(), 0);
        let b = lim.allocate(1, &s).unwrap();
        assert_eq!(lim.used(), ALIGNMENT, "one byte counts as 256");
        free(&lim, b, 1, &s);

        // In pieces with rounding: 1000 bytes count as 1024.
        let pieces: Vec<_> = (0..1024).map(|_| lim.allocate(1000, &s).unwrap()).collect();
        assert_eq!(lim.used(), limit);
        assert!(lim.allocate(1, &s).is_err());
        for p in pieces {
            free(&lim, p, 1000, &s);
        }

        // Up to 256 below the limit: 257 bytes need 512, 256 fit.
        let c = lim.allocate(limit - ALIGNMENT, &s).unwrap();
        assert_eq!(
            lim.allocate(ALIGNMENT + 1, &s).unwrap_err(),
            Error::OutOfMemory {
                requested: 2 * ALIGNMENT,
                available: ALIGNMENT,
                maximum: limit
            }
        );
        let d = lim.allocate(ALIGNMENT, &s).unwrap();
        assert_eq!(lim.available(), 0);
        free(&lim, d, ALIGNMENT, &s);
        free(&lim, c, limit - ALIGNMENT, &s);

        // Above the limit on its own.
        assert_eq!(
            lim.allocate(limit + 1, &s).unwrap_err(),
            Error::OutOfMemory {
                requested: limit + ALIGNMENT,
                available: limit,
                maximum: limit
            }
        );
        // Zero bytes are not limited.
        let z = lim.allocate(0, &s).unwrap();
        free(&lim, z, 0, &s);
        assert_eq!(lim.used(), 0);
        assert!(matches!(
            lim.allocate(usize::MAX, &s),
            Err(Error::InvalidSize { .. })
        ));
    }
}

#[test]
fn limiting_passes_upstream_failures_through_without_leaking() {
    for device in devices() {
        // The limit is above what the pool can hold. (Tracking: an upstream that surely
        // refuses a bad free.)
        let lim = LimitingAdaptor::new(TrackingAdaptor::new(pool(&device, 0, 4 * MIB)), 64 * MIB);
        let s = device.create_stream().unwrap();
        let a = lim.allocate(3 * MIB, &s).unwrap();
        match lim.allocate(2 * MIB, &s) {
            // The pool's own numbers.
            Err(Error::OutOfMemory { maximum, .. }) => assert_eq!(maximum, 4 * MIB),
            other => panic!("{}: {other:?}", label(&device)),
        }
        assert_eq!(
            lim.used(),
            3 * MIB,
            "the failed request's reservation leaked"
        );
        // A refused free changes nothing.
        assert!(matches!(
            bad_free(&lim, a.offset(512), MIB, &s),
            Error::UnknownPointer { .. }
        ));
        assert_eq!(lim.used(), 3 * MIB);
        free(&lim, a, 3 * MIB, &s);
        assert_eq!(lim.used(), 0);
    }
}

#[test]
fn limiting_allocate_async_waits_for_a_free_from_another_task() {
    let rt = common::runtime();
    for device in devices() {
        let limit = 4 * MIB;
        let lim = Arc::new(LimitingAdaptor::new(pool(&device, 0, 64 * MIB), limit));
        let s = device.create_stream().unwrap();
        let held = lim.allocate(limit, &s).unwrap();

        rt.block_on(async {
            // A request above the limit can never succeed: it fails at once.
            let never =
                tokio::time::timeout(Duration::from_secs(5), lim.allocate_async(limit + 1, &s))
                    .await
                    .expect("a request above the limit waited");
            assert!(matches!(never, Err(Error::OutOfMemory { .. })));

            let waiter = tokio::spawn({
                let (lim, s) = (lim.clone(), s.clone());
                async move { lim.allocate_async(limit / 2, &s).await }
            });
            assert!(
                eventually(Duration::from_secs(5), || lim.wait_stats().waiting == 1),
                "{}: the task did not wait",
                label(&device)
            );
            assert!(!waiter.is_finished());
            tokio::spawn({
                let (lim, s) = (lim.clone(), s.clone());
                async move { free(&*lim, held, limit, &s) }
            })
            .await
            .unwrap();
            let ptr = tokio::time::timeout(Duration::from_secs(5), waiter)
                .await
                .expect("the free did not wake the waiter")
                .unwrap()
                .unwrap();
            assert_eq!(lim.used(), limit / 2);
            let stats = lim.wait_stats();
            assert_eq!((stats.waiting, stats.waits), (0, 1));
            free(&*lim, ptr, limit / 2, &s);
        });
        assert_eq!(lim.used(), 0);
    }
}

// ===== AlignedAdaptor =====

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

// ===== FailureCallbackAdaptor =====

#[test]
fn failure_callback_frees_and_retries_until_it_says_no() {
    for device in devices() {
        let p = Arc::new(pool(&device, 0, 4 * MIB));
        let s = device.create_stream().unwrap();
        let held = Arc::new(Mutex::new(Some(p.allocate(4 * MIB, &s).unwrap())));
        let calls = Arc::new(Mutex::new(Vec::new()));
        let adaptor = FailureCallbackAdaptor::new(p.clone(), {
            let (p, s, held, calls) = (p.clone(), s.clone(), held.clone(), calls.clone());
            move |bytes| {
                calls.lock().unwrap().push(bytes);
                match held.lock().unwrap().take() {
                    Some(ptr) => {
                        free(&*p, ptr, 4 * MIB, &s);
                        true
                    }
                    None => false,
                }
            }
        });
        // Full: the callback frees the held block and asks for a retry, which succeeds.
        let a = adaptor.allocate(2 * MIB, &s).unwrap();
        assert_eq!(*calls.lock().unwrap(), [2 * MIB], "{}", label(&device));
        // Full again with nothing to free: the callback says no, the error comes back.
        match adaptor.allocate(3 * MIB, &s) {
            Err(Error::OutOfMemory { requested, .. }) => assert_eq!(requested, 3 * MIB),
            other => panic!("{other:?}"),
        }
        assert_eq!(*calls.lock().unwrap(), [2 * MIB, 3 * MIB]);
        assert_eq!(adaptor.callbacks(), 2);
        // Errors other than out-of-memory do not call it.
        assert!(matches!(
            adaptor.allocate(usize::MAX, &s),
            Err(Error::InvalidSize { .. })
        ));
        assert_eq!(adaptor.callbacks(), 2);
        // Enough memory: no call.
        let b = adaptor.allocate(MIB, &s).unwrap();
        assert_eq!(adaptor.callbacks(), 2);
        free(&adaptor, a, 2 * MIB, &s);
        free(&adaptor, b, MIB, &s);
    }
}

#[test]
fn failure_callback_retries_while_it_returns_true() {
    for device in devices() {
        let s = device.create_stream().unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        // Upstream: a log, to count the failed tries that reach it.
        let buf = SharedBuf::default();
        let adaptor = FailureCallbackAdaptor::new(
            LoggingAdaptor::new(pool(&device, 0, 4 * MIB), buf.clone()),
            {
                let calls = calls.clone();
                move |_| calls.fetch_add(1, Ordering::SeqCst) < 3
            },
        );
        assert!(adaptor
            .allocate(8 * MIB, &s)
            .unwrap_err()
            .is_out_of_memory());
        assert_eq!(calls.load(Ordering::SeqCst), 4);
        let lines = parse_log(&buf.text());
        assert_eq!(
            lines
                .iter()
                .filter(|l| l.action == "allocate failure")
                .count(),
            4,
            "{}",
            label(&device)
        );
    }
}

// ===== PrefetchAdaptor =====

#[test]
fn prefetch_managed_memory_and_pass_through_the_rest() {
    for device in devices() {
        let s = device.create_stream().unwrap();
        let managed = PrefetchAdaptor::new(ManagedResource::new(&device));
        assert_eq!(managed.memory_kind(), MemoryKind::Managed);
        let p = managed.allocate(MIB, &s).unwrap();
        assert_eq!(managed.prefetches_requested(), 1);
        // SAFETY: MIB live bytes at `p`, used on `s` only.
        unsafe { s.fill_u32(p, 7, MIB / 4) }.unwrap();
        assert_eq!(
            read_u32(&s, p.offset(MIB - 4), 1),
            [7],
            "{}",
            label(&device)
        );
        free(&managed, p, MIB, &s);
        let z = managed.allocate(0, &s).unwrap();
        free(&managed, z, 0, &s);
        assert_eq!(
            managed.prefetches_requested(),
            1,
            "zero bytes are not prefetched"
        );

        let device_memory = PrefetchAdaptor::new(CudaResource::new(&device));
        let p = device_memory.allocate(MIB, &s).unwrap();
        assert_eq!(device_memory.prefetches_requested(), 0);
        free(&device_memory, p, MIB, &s);
    }
}

// ===== composition =====

#[test]
fn statistics_over_a_limit_over_a_pool_end_to_end() {
    let rt = common::runtime();
    for device in devices() {
        let limit = 8 * MIB;
        let stack: Arc<StatisticsAdaptor<LimitingAdaptor<Pool>>> = Arc::new(
            StatisticsAdaptor::new(LimitingAdaptor::new(pool(&device, 0, 64 * MIB), limit)),
        );
        let s = device.create_stream().unwrap();
        let a = stack.allocate(3 * MIB, &s).unwrap();
        let b = stack.allocate(5 * MIB, &s).unwrap();
        // Data goes through the whole stack.
        // SAFETY: live bytes at `a` and `b`, used on `s` only.
        unsafe {
            s.fill_u32(a, 0xA, 3 * MIB / 4).unwrap();
            s.fill_u32(b, 0xB, 5 * MIB / 4).unwrap();
        }
        assert_eq!(read_u32(&s, a.offset(3 * MIB - 4), 1), [0xA]);
        assert_eq!(read_u32(&s, b, 1), [0xB]);
        assert_eq!(stack.bytes_counter().value, 8 * MIB as i64);
        // The limit's error, through the statistics, not counted.
        assert_eq!(
            stack.allocate(1, &s).unwrap_err(),
            Error::OutOfMemory {
                requested: ALIGNMENT,
                available: 0,
                maximum: limit
            }
        );
        assert_eq!(stack.allocations_counter().value, 2);

        // allocate_async through the statistics waits in the limit's queue.
        rt.block_on(async {
            let waiter = tokio::spawn({
                let (stack, s) = (stack.clone(), s.clone());
                async move { stack.allocate_async(4 * MIB, &s).await }
            });
            assert!(
                eventually(Duration::from_secs(5), || stack
                    .upstream()
                    .wait_stats()
                    .waiting
                    == 1),
                "{}",
                label(&device)
            );
            tokio::spawn({
                let (stack, s) = (stack.clone(), s.clone());
                async move { free(&*stack, b, 5 * MIB, &s) }
            })
            .await
            .unwrap();
            let c = tokio::time::timeout(Duration::from_secs(5), waiter)
                .await
                .expect("not woken")
                .unwrap()
                .unwrap();
            free(&*stack, c, 4 * MIB, &s);
        });
        free(&*stack, a, 3 * MIB, &s);
        let counters = stack.counters();
        assert_eq!(counters.bytes.value, 0);
        assert_eq!(counters.bytes.peak, 8 * MIB as i64);
        assert_eq!(counters.bytes.total, 12 * MIB as i64);
        assert_eq!(counters.allocations.total, 3);
        assert_eq!(stack.upstream().used(), 0);
        let pool_stats = stack.upstream().upstream().stats();
        assert_eq!(pool_stats.free, pool_stats.reserved);
        stack.upstream().upstream().check_invariants().unwrap();
    }
}

#[test]
fn allocate_async_through_statistics_waits_for_the_pool_and_is_woken_by_a_free() {
    let rt = common::runtime();
    for device in devices() {
        let stats = Arc::new(StatisticsAdaptor::new(pool(&device, 0, 4 * MIB)));
        let s = device.create_stream().unwrap();
        let full = stats.allocate(4 * MIB, &s).unwrap();
        rt.block_on(async {
            let waiter = tokio::spawn({
                let (stats, s) = (stats.clone(), s.clone());
                async move { stats.allocate_async(MIB, &s).await }
            });
            assert!(
                eventually(Duration::from_secs(5), || stats
                    .upstream()
                    .wait_stats()
                    .waiting
                    == 1),
                "{}: the task did not wait in the pool's queue",
                label(&device)
            );
            assert_eq!(stats.allocations_counter().value, 1);
            tokio::spawn({
                let (stats, s) = (stats.clone(), s.clone());
                async move { free(&*stats, full, 4 * MIB, &s) }
            })
            .await
            .unwrap();
            let ptr = tokio::time::timeout(Duration::from_secs(5), waiter)
                .await
                .expect("the free through the adaptor did not wake the waiter")
                .unwrap()
                .unwrap();
            assert_eq!(stats.bytes_counter().value, MIB as i64);
            free(&*stats, ptr, MIB, &s);
        });
        assert_eq!(
            stats.counters().allocations,
            Counter {
                value: 0,
                peak: 1,
                total: 2
            }
        );
    }
}

#[test]
fn every_adaptor_stacked_at_once() {
    for device in devices() {
        let buf = SharedBuf::default();
        let stack = LoggingAdaptor::new(
            TrackingAdaptor::new(StatisticsAdaptor::new(LimitingAdaptor::new(
                AlignedAdaptor::new(
                    FailureCallbackAdaptor::new(
                        PrefetchAdaptor::new(pool(&device, 0, 64 * MIB)),
                        |_| false,
                    ),
                    4096,
                )
                .unwrap(),
                16 * MIB,
            ))),
            buf.clone(),
        );
        let s = device.create_stream().unwrap();
        let ptrs: Vec<_> = (1..=5)
            .map(|i| (stack.allocate(i * 100 * KIB, &s).unwrap(), i * 100 * KIB))
            .collect();
        for &(p, _) in &ptrs {
            assert_eq!(p.0 % 4096, 0);
        }
        assert!(stack.allocate(32 * MIB, &s).is_err());
        let tracking = stack.upstream();
        let stats = tracking.upstream();
        let limiting = stats.upstream();
        assert_eq!(tracking.outstanding_count(), 5);
        assert_eq!(stats.allocations_counter().value, 5);
        assert_eq!(
            limiting.used(),
            (1..=5).map(|i| round_up(i * 100 * KIB)).sum()
        );
        assert!(std::ptr::eq(
            stack.memory_waiters().unwrap(),
            limiting.memory_waiters().unwrap()
        ));
        for (p, b) in ptrs {
            free(&stack, p, b, &s);
        }
        assert_eq!(tracking.outstanding_count(), 0);
        assert_eq!(limiting.used(), 0);
        stack.flush().unwrap();
        let lines = parse_log(&buf.text());
        assert_eq!(lines.len(), 11, "{}", label(&device));
    }
}
