//! `StatisticsAdaptor`: exact counts against a model, scopes, what is not counted, threads.

use super::*;

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
