//! Adaptors composed: statistics over a limit over a pool, waits through them, every adaptor
//! stacked at once.

use super::*;

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
