//! `CallbackResource`: RMM's shared tests, the closures' arguments, pointers that break the
//! contract.

use super::*;

type Calls = Arc<Mutex<Vec<(&'static str, u64, usize, StreamId)>>>;

/// A callback resource over the device's memory (through a `CudaResource`), recording every
/// call of its closures.
fn callback(device: &Device) -> (CallbackResource, Calls) {
    let calls: Calls = Arc::default();
    let (alloc_calls, free_calls) = (calls.clone(), calls.clone());
    let (cuda_a, cuda_f) = (CudaResource::new(device), CudaResource::new(device));
    let allocate = move |bytes, stream: &Stream| {
        let ptr = cuda_a.allocate(bytes, stream)?;
        alloc_calls
            .lock()
            .unwrap()
            .push(("allocate", ptr.0, bytes, stream.id()));
        Ok(ptr)
    };
    let deallocate = move |ptr: DevicePtr, bytes, stream: &Stream| {
        free_calls
            .lock()
            .unwrap()
            .push(("deallocate", ptr.0, bytes, stream.id()));
        // SAFETY: only pointers from the allocate closure come back here, with their size.
        unsafe { cuda_f.deallocate(ptr, bytes, stream) }
    };
    // SAFETY: every pointer is a `CudaResource` allocation, freed through the same resource.
    let mr = unsafe { CallbackResource::new(device, allocate, deallocate) };
    (mr, calls)
}

#[test]
fn callback_shared_tests() {
    for device in devices() {
        let (mr, calls) = callback(&device);
        zero_bytes(&mr, &device);
        assert!(
            calls.lock().unwrap().is_empty(),
            "zero bytes called a closure"
        );
        sizes_from_4_bytes_to_1_gib(&mr, &device);
        one_pib_is_out_of_memory(&mr, &device);
        random_mix(&mr, &device, &|| {});
        four_threads(&mr, &device);
        producer_consumer(&mr, &device);
        let calls = calls.lock().unwrap();
        let allocs = calls.iter().filter(|c| c.0 == "allocate").count();
        let frees = calls.iter().filter(|c| c.0 == "deallocate").count();
        assert_eq!(allocs, frees, "{}", label(&device));
    }
}

#[test]
fn callback_closures_get_the_right_arguments() {
    for device in devices() {
        let (mr, calls) = callback(&device);
        assert_eq!(mr.memory_kind(), MemoryKind::Device);
        let (s, t) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let ptr = mr.allocate(1000, &s).unwrap();
        t.wait(&s.record().unwrap()).unwrap();
        free(&mr, ptr, 1000, &t);
        assert_eq!(
            *calls.lock().unwrap(),
            vec![
                ("allocate", ptr.0, 1000, s.id()),
                ("deallocate", ptr.0, 1000, t.id())
            ]
        );
        let other = Device::simulated(SimConfig::default())
            .create_stream()
            .unwrap();
        assert!(matches!(
            mr.allocate(1, &other),
            Err(Error::WrongDevice { .. })
        ));
        assert_eq!(
            calls.lock().unwrap().len(),
            2,
            "a closure ran for a wrong stream"
        );
    }
}

#[test]
fn callback_pointers_that_break_the_contract_are_errors() {
    let device = &devices()[0];
    let freed = Arc::new(AtomicUsize::new(0));
    let f = freed.clone();
    // SAFETY: the address is made up and refused (misaligned) before anything could use it,
    // and the memory kind is never acted on.
    let misaligned = unsafe {
        CallbackResource::new(
            device,
            |_, _| Ok(DevicePtr(0x1010)),
            move |ptr, _, _| {
                assert_eq!(ptr, DevicePtr(0x1010));
                f.fetch_add(1, Ordering::SeqCst);
                Ok(())
            },
        )
        .with_memory_kind(MemoryKind::Managed)
    };
    assert_eq!(misaligned.memory_kind(), MemoryKind::Managed);
    let s = device.create_stream().unwrap();
    assert!(matches!(
        misaligned.allocate(64, &s),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(
        freed.load(Ordering::SeqCst),
        1,
        "the misaligned pointer was not given back"
    );
    // SAFETY: a null pointer, refused before anything could use it.
    let null = unsafe { CallbackResource::new(device, |_, _| Ok(DevicePtr(0)), |_, _, _| Ok(())) };
    assert!(matches!(
        null.allocate(64, &s),
        Err(Error::InvalidArgument { .. })
    ));
    // SAFETY: it never hands out memory.
    let failing = unsafe {
        CallbackResource::new(
            device,
            |bytes, _| {
                Err(Error::OutOfMemory {
                    requested: bytes,
                    available: 0,
                    maximum: 0,
                })
            },
            |_, _, _| Ok(()),
        )
    };
    assert!(matches!(
        failing.allocate(64, &s),
        Err(Error::OutOfMemory { requested: 64, .. })
    ));
}
