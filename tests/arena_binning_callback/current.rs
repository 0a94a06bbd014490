//! The per-device current resource: defaults, `set` returning the previous one, threads.

use super::*;

fn same(a: &ResourceRef, b: &ResourceRef) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}

#[test]
fn current_resource_defaults_and_set_returns_the_previous() {
    for device in devices() {
        let initial = current_resource(&device);
        assert_eq!(initial.device().id(), device.id());
        assert!(same(&initial, &current_resource(&device)), "made twice");
        let s = device.create_stream().unwrap();
        let ptr = initial.allocate(4096, &s).unwrap();
        free(&*initial, ptr, 4096, &s);

        let pool: ResourceRef = Arc::new(
            PoolResource::new(CudaResource::new(&device), PoolOptions::default()).unwrap(),
        );
        let previous = set_current_resource(&device, pool.clone()).unwrap();
        assert!(same(&previous, &initial));
        assert!(same(&current_resource(&device), &pool));
        let arena: ResourceRef = Arc::new(arena(&device, 0, 64 * MIB));
        assert!(same(
            &set_current_resource(&device, arena.clone()).unwrap(),
            &pool
        ));
        assert!(same(&reset_current_resource(&device).unwrap(), &arena));
        // After a reset, a new default.
        let fresh = current_resource(&device);
        assert!(!same(&fresh, &initial));
        reset_current_resource(&device);

        // A device with nothing set or made: set returns None.
        let other = Device::simulated(SimConfig::default());
        let cuda: ResourceRef = Arc::new(CudaResource::new(&other));
        assert!(set_current_resource(&other, cuda.clone()).is_none());
        assert!(same(&current_resource(&other), &cuda));
        // Devices do not share entries.
        assert!(!same(&current_resource(&device), &cuda));
        reset_current_resource(&other);
        reset_current_resource(&device);
    }
}

#[test]
fn current_resource_is_thread_safe() {
    let device = Device::simulated(SimConfig::default());
    let candidates: Vec<ResourceRef> = (0..4)
        .map(|_| Arc::new(CudaResource::new(&device)) as ResourceRef)
        .collect();
    let default = current_resource(&device);
    std::thread::scope(|scope| {
        for t in 0..4 {
            let (device, candidates, default) = (&device, &candidates, &default);
            scope.spawn(move || {
                let own = Device::simulated(SimConfig::default());
                let s = device.create_stream().unwrap();
                for i in 0..500 {
                    let previous = set_current_resource(device, candidates[(t + i) % 4].clone());
                    let previous = previous.expect("the default was made before");
                    assert!(
                        same(&previous, default) || candidates.iter().any(|c| same(c, &previous))
                    );
                    let now = current_resource(device);
                    assert!(candidates.iter().any(|c| same(c, &now)));
                    let ptr = now.allocate(256, &s).unwrap();
                    free(&*now, ptr, 256, &s);
                    // Each thread's own device, alongside.
                    let mine = current_resource(&own);
                    assert_eq!(mine.device().id(), own.id());
                }
                reset_current_resource(&own);
            });
        }
    });
    let last = reset_current_resource(&device).unwrap();
    assert!(candidates.iter().any(|c| same(c, &last)));
}
