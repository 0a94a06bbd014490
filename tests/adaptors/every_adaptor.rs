//! What every adaptor promises: `Send`, `Sync` and `Debug`, the device, kind and waiters
//! forwarded, and only the limit with its own queue.

use super::*;

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
