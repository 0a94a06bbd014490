//! `LoggingAdaptor`: RMM's CSV lines, concurrent threads, files and the environment, write
//! errors.

use super::*;

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

/// A writer that panics (a user's sink with a bug, a `RefCell` borrowed twice...) is a write
/// error like any other: the allocation whose line it was writing is returned, and a free
/// whose line it was writing reaches the upstream. A review found the memory lost both ways:
/// the upstream's allocation dropped with the panic, and the free never passed on.
#[test]
fn logging_a_writer_that_panics_loses_no_memory() {
    struct Panicky(Arc<AtomicUsize>);
    impl Write for Panicky {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.0.load(Ordering::SeqCst) != 0 {
                panic!("the log writer panics");
            }
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    for device in devices() {
        let s = device.create_stream().unwrap();
        let armed = Arc::new(AtomicUsize::new(0));
        let log = LoggingAdaptor::new(
            TrackingAdaptor::new(CudaResource::new(&device)),
            Panicky(armed.clone()),
        );

        // The allocate line panics.
        armed.store(1, Ordering::SeqCst);
        let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| log.allocate(1024, &s)));
        armed.store(0, Ordering::SeqCst);
        let held: Vec<DevicePtr> = match got {
            Ok(Ok(ptr)) => vec![ptr],
            Ok(Err(e)) => panic!("{}: {e:?}", label(&device)),
            Err(_) => Vec::new(),
        };
        assert_eq!(
            log.upstream().outstanding_count(),
            held.len(),
            "{}: an allocation whose log line panicked was lost",
            label(&device)
        );

        // The free line panics.
        let p = log.allocate(2048, &s).unwrap();
        armed.store(1, Ordering::SeqCst);
        let freed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: allocated above with these bytes, never used, freed once.
            unsafe { log.deallocate(p, 2048, &s) }
        }));
        armed.store(0, Ordering::SeqCst);
        assert!(
            matches!(freed, Ok(Ok(()))),
            "{}: a free whose log line panicked did not succeed",
            label(&device)
        );
        assert_eq!(
            log.upstream().outstanding_count(),
            held.len(),
            "{}: a free whose log line panicked never reached the upstream",
            label(&device)
        );
        for ptr in held {
            free(&log, ptr, 1024, &s);
        }
        assert_eq!(log.upstream().outstanding_count(), 0);
        // The panics are reported as a write error, once.
        assert!(log.flush().is_err(), "{}", label(&device));
        assert!(log.flush().is_ok(), "{}", label(&device));
        s.synchronize_blocking().unwrap();
    }
}
