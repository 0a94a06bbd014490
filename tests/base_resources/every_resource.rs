//! RMM's memory-resource tests for every base resource: zero bytes, sizes up to 1 GiB, out of
//! memory, random mixes, threads, producer/consumer, bad pointers, handles.

use super::*;

#[test]
fn zero_bytes_is_a_null_pointer_that_deallocates() {
    for device in devices() {
        let stream = device.create_stream().unwrap();
        for (name, r) in resources(&device) {
            let what = format!("{} {name}", label(&device));
            let ptr = r.allocate(0, &stream).unwrap();
            assert_eq!(ptr, DevicePtr(0), "{what}");
            // SAFETY: the null pointer of a zero-byte allocation, given back once.
            unsafe { r.deallocate(ptr, 0, &stream) }.unwrap();
            assert_eq!(r.device().id(), device.id(), "{what}");
        }
        stream.synchronize_blocking().unwrap();
    }
}

#[test]
fn sizes_from_4_bytes_to_1_gib_are_aligned_distinct_and_writable() {
    let sizes = [
        4,
        8,
        100,
        256,
        1000,
        4 * KIB,
        64 * KIB,
        MIB,
        10 * MIB + 4,
        100 * MIB,
        GIB,
    ];
    for device in devices() {
        let stream = device.create_stream().unwrap();
        for (name, r) in resources(&device) {
            let what = format!("{} {name}", label(&device));
            let mut live = BTreeMap::new();
            let mut blocks = Vec::new();
            for (i, &bytes) in sizes.iter().enumerate() {
                let ptr = r
                    .allocate(bytes, &stream)
                    .unwrap_or_else(|e| panic!("{what}: {bytes} bytes: {e}"));
                assert_ne!(ptr, DevicePtr(0), "{what}: {bytes} bytes");
                assert_eq!(
                    ptr.as_raw() % ALIGNMENT as u64,
                    0,
                    "{what}: {ptr:?} ({bytes} bytes) is not {ALIGNMENT}-aligned"
                );
                insert_disjoint(&mut live, ptr, bytes, &what);
                write_and_check(r.memory_kind(), ptr, bytes, &stream, 0x5A00 + i as u32);
                blocks.push((ptr, bytes));
            }
            for (ptr, bytes) in blocks {
                // SAFETY: allocated above with `bytes`, its uses synchronized, freed once.
                unsafe { r.deallocate(ptr, bytes, &stream) }.unwrap();
            }
            stream.synchronize_blocking().unwrap();
        }
    }
}

#[test]
fn one_pib_is_out_of_memory_and_the_resource_still_allocates() {
    for device in devices() {
        let stream = device.create_stream().unwrap();
        for (name, r) in resources(&device) {
            let what = format!("{} {name}", label(&device));
            match r.allocate(PIB, &stream) {
                Err(Error::OutOfMemory {
                    requested,
                    available,
                    ..
                }) => {
                    assert_eq!(requested, PIB, "{what}");
                    assert!(available < PIB, "{what}: available {available}");
                }
                other => panic!("{what}: 1 PiB gave {other:?}"),
            }
            let err = r.allocate(PIB, &stream).unwrap_err();
            assert!(err.is_out_of_memory(), "{what}: {err}");
            assert!(err.to_string().contains(&PIB.to_string()), "{what}: {err}");
            let ptr = r.allocate(MIB, &stream).unwrap();
            write_and_check(r.memory_kind(), ptr, MIB, &stream, 7);
            // SAFETY: allocated just above, its uses synchronized, freed once.
            unsafe { r.deallocate(ptr, MIB, &stream) }.unwrap();
        }
        stream.synchronize_blocking().unwrap();
    }
}

#[test]
fn random_allocate_free_mix_never_overlaps() {
    for device in devices() {
        let stream = device.create_stream().unwrap();
        for (name, r) in resources(&device) {
            let what = format!("{} {name}", label(&device));
            let mut rng = Rng(0x5EED ^ name.len() as u64);
            let mut live: BTreeMap<u64, usize> = BTreeMap::new();
            let ops = if device.is_simulated() { 3000 } else { 1000 };
            for _ in 0..ops {
                if live.is_empty() || rng.below(100) < 55 {
                    let bytes = rng.size(20); // up to 1 MiB
                    let ptr = r.allocate(bytes, &stream).unwrap();
                    if bytes == 0 {
                        assert_eq!(ptr, DevicePtr(0));
                        // SAFETY: the null pointer of a zero-byte allocation.
                        unsafe { r.deallocate(ptr, 0, &stream) }.unwrap();
                        continue;
                    }
                    assert_eq!(ptr.as_raw() % ALIGNMENT as u64, 0, "{what}");
                    insert_disjoint(&mut live, ptr, bytes, &what);
                } else {
                    let nth = rng.below(live.len() as u64) as usize;
                    let (&ptr, _) = live.iter().nth(nth).unwrap();
                    let bytes = live.remove(&ptr).unwrap();
                    // SAFETY: live and allocated with `bytes`; nothing uses it; freed once.
                    unsafe { r.deallocate(DevicePtr(ptr), bytes, &stream) }.unwrap();
                }
            }
            // Every live block holds its own word: overlapping blocks would clobber one.
            let blocks: Vec<(u64, usize)> = live.into_iter().collect();
            for (i, &(ptr, bytes)) in blocks.iter().enumerate() {
                if bytes >= 4 {
                    if r.memory_kind() == MemoryKind::PinnedHost {
                        // SAFETY: live host memory of at least 4 bytes, used by no one else.
                        unsafe { (host_ptr(DevicePtr(ptr)) as *mut u32).write(i as u32) };
                    } else {
                        // SAFETY: live memory of at least 4 bytes until the reads below.
                        unsafe { stream.fill_u32(DevicePtr(ptr), i as u32, 1) }.unwrap();
                    }
                }
            }
            for (i, &(ptr, bytes)) in blocks.iter().enumerate() {
                if bytes >= 4 {
                    let word = if r.memory_kind() == MemoryKind::PinnedHost {
                        // SAFETY: as above.
                        unsafe { (host_ptr(DevicePtr(ptr)) as *const u32).read() }
                    } else {
                        read_words(&stream, DevicePtr(ptr), 1)[0]
                    };
                    assert_eq!(word, i as u32, "{what}: block {ptr:#x} was overwritten");
                }
            }
            for (ptr, bytes) in blocks {
                // SAFETY: live, allocated with `bytes`, its uses synchronized, freed once.
                unsafe { r.deallocate(DevicePtr(ptr), bytes, &stream) }.unwrap();
            }
            stream.synchronize_blocking().unwrap();
        }
    }
}

#[test]
fn four_threads_at_once_each_on_its_own_stream() {
    for device in devices_with_a_slow_sim() {
        for (name, r) in resources(&device) {
            let what = format!("{} {name}", label(&device));
            // Every live range of every thread: no two may overlap.
            let live = Arc::new(Mutex::new(BTreeMap::new()));
            let threads: Vec<_> = (0..4u32)
                .map(|t| {
                    let (device, r, live, what) =
                        (device.clone(), r.clone(), live.clone(), what.clone());
                    std::thread::spawn(move || {
                        let stream = device.create_stream().unwrap();
                        let scratch = device.malloc(64 * KIB).unwrap();
                        let mut rng = Rng(u64::from(t) * 1_000_003 + 17);
                        for round in 0..60u32 {
                            let bytes = (rng.size(15) + 4) & !3; // 4 B to 32 KiB, whole words
                            let ptr = r.allocate(bytes, &stream).unwrap();
                            insert_disjoint(&mut live.lock().unwrap(), ptr, bytes, &what);
                            let tag = (t << 16) | round;
                            let words = bytes / 4;
                            if r.memory_kind() == MemoryKind::PinnedHost {
                                // Write on the host, copy to the device after some GPU work,
                                // and give the block back before that copy has run: nobody may
                                // get (and overwrite) it until it has.
                                let host = host_ptr(ptr) as *mut u32;
                                // SAFETY: `bytes` of live host memory, this thread's alone;
                                // `scratch` has room for 64 KiB.
                                unsafe {
                                    for w in 0..words {
                                        host.add(w).write(tag);
                                    }
                                    stream.spin(Duration::from_micros(200)).unwrap();
                                    stream.copy_htod(scratch, host as *const u8, bytes).unwrap();
                                }
                            } else {
                                // SAFETY: live memory until the stream runs the copy.
                                unsafe {
                                    stream.fill_u32(ptr, tag, words).unwrap();
                                    stream.copy_dtod(scratch, ptr, bytes).unwrap();
                                }
                            }
                            live.lock().unwrap().remove(&ptr.as_raw());
                            // SAFETY: allocated above with `bytes`; its uses are queued on
                            // `stream` before this point; freed once.
                            unsafe { r.deallocate(ptr, bytes, &stream) }.unwrap();
                            let back = read_words(&stream, scratch, words);
                            assert!(
                                back.iter().all(|&w| w == tag),
                                "{what}: thread {t} round {round}: the block was reused too soon"
                            );
                        }
                        stream.synchronize_blocking().unwrap();
                        // SAFETY: the stream that used it is synchronized.
                        unsafe { device.free(scratch) }.unwrap();
                    })
                })
                .collect();
            for thread in threads {
                thread.join().unwrap();
            }
        }
    }
}

#[test]
fn producer_and_consumer_on_two_threads_and_two_streams() {
    for device in devices_with_a_slow_sim() {
        for (name, r) in resources(&device) {
            let what = format!("{} {name}", label(&device));
            let (tx, rx) = mpsc::channel::<(DevicePtr, usize, u32, streamalloc::Event)>();
            let producer = {
                let (device, r) = (device.clone(), r.clone());
                std::thread::spawn(move || {
                    let a = device.create_stream().unwrap();
                    let mut rng = Rng(99);
                    for i in 0..100u32 {
                        let bytes = (rng.size(16) + 4) & !3;
                        let ptr = r.allocate(bytes, &a).unwrap();
                        if r.memory_kind() == MemoryKind::PinnedHost {
                            // SAFETY: `bytes` of live host memory, this thread's until sent.
                            unsafe { std::ptr::write_bytes(host_ptr(ptr), i as u8, bytes) };
                        } else {
                            // SAFETY: live until the consumer frees it after waiting for `a`.
                            unsafe { a.fill_u32(ptr, i, bytes / 4) }.unwrap();
                        }
                        tx.send((ptr, bytes, i, a.record().unwrap())).unwrap();
                    }
                })
            };
            let b = device.create_stream().unwrap();
            for (ptr, bytes, i, ready) in rx {
                b.wait(&ready).unwrap();
                if r.memory_kind() == MemoryKind::PinnedHost {
                    // SAFETY: the producer's writes happened before the send; live memory.
                    let first = unsafe { host_ptr(ptr).read() };
                    let last = unsafe { host_ptr(ptr).add(bytes - 1).read() };
                    assert_eq!((first, last), (i as u8, i as u8), "{what}: item {i}");
                } else {
                    let n = (bytes / 4).min(64);
                    let back = read_words(&b, ptr, n);
                    assert!(back.iter().all(|&w| w == i), "{what}: item {i}");
                }
                // SAFETY: allocated by the producer with `bytes`; every use is ordered before
                // this point of `b` (it waited for `a`); freed once.
                unsafe { r.deallocate(ptr, bytes, &b) }.unwrap();
            }
            producer.join().unwrap();
            b.synchronize_blocking().unwrap();
        }
    }
}

#[test]
fn freeing_memory_that_queued_work_still_uses_is_safe() {
    for device in devices() {
        let stream = device.create_stream().unwrap();
        for (name, r) in resources(&device) {
            let what = format!("{} {name}", label(&device));
            let ptr = r.allocate(MIB, &stream).unwrap();
            stream.spin(Duration::from_millis(20)).unwrap();
            if r.memory_kind() != MemoryKind::PinnedHost {
                // SAFETY: live until the free below, which is ordered after this fill.
                unsafe { stream.fill_u32(ptr, 3, MIB / 4) }.unwrap();
            }
            // SAFETY: allocated above; its only use is queued on `stream` before this point.
            unsafe { r.deallocate(ptr, MIB, &stream) }.unwrap();
            stream
                .synchronize_blocking()
                .unwrap_or_else(|e| panic!("{what}: the stream faulted: {e}"));
        }
    }
}

#[test]
fn bad_pointers_and_streams_of_other_devices_are_typed_errors() {
    for device in devices() {
        let stream = device.create_stream().unwrap();
        let other = Device::simulated(SimConfig::default());
        let foreign = other.create_stream().unwrap();
        for (name, r) in resources(&device) {
            let what = format!("{} {name}", label(&device));
            assert!(
                matches!(r.allocate(256, &foreign), Err(Error::WrongDevice { .. })),
                "{what}"
            );
            // Zero bytes too: the size must not hide the wrong stream.
            assert!(
                matches!(r.allocate(0, &foreign), Err(Error::WrongDevice { .. })),
                "{what}: zero bytes on another device's stream"
            );
            // SAFETY: refused before anything is freed (nothing would be).
            let zero_foreign = unsafe { r.deallocate(DevicePtr(0), 0, &foreign) };
            assert!(
                matches!(zero_foreign, Err(Error::WrongDevice { .. })),
                "{what}: {zero_foreign:?}"
            );
            // SAFETY: rejected before anything is freed.
            let null_with_bytes = unsafe { r.deallocate(DevicePtr(0), 256, &stream) };
            assert!(
                matches!(
                    null_with_bytes,
                    Err(Error::UnknownPointer { ptr: 0, bytes: 256 })
                ),
                "{what}: {null_with_bytes:?}"
            );
            let ptr = r.allocate(1000, &stream).unwrap();
            // SAFETY: rejected before anything is freed.
            let wrong = unsafe { r.deallocate(ptr, 1000, &foreign) };
            assert!(matches!(wrong, Err(Error::WrongDevice { .. })), "{what}");
            // SAFETY: zero bytes with a real pointer is rejected before anything is freed.
            let zero = unsafe { r.deallocate(ptr, 0, &stream) };
            assert!(matches!(zero, Err(Error::UnknownPointer { .. })), "{what}");
            // A pointer it never handed out: every resource can tell on the simulated device;
            // on a GPU only the pinned one checks (the driver's own error is not probed there).
            if device.is_simulated() || r.memory_kind() == MemoryKind::PinnedHost {
                let bogus = DevicePtr(ptr.as_raw() + 4096 * 1024 * 1024);
                // SAFETY: the resource must reject a pointer it never handed out.
                let err = unsafe { r.deallocate(bogus, 1000, &stream) }.unwrap_err();
                assert!(
                    matches!(err, Error::UnknownPointer { ptr: p, bytes: 1000 } if p == bogus.as_raw()),
                    "{what}: {err:?}"
                );
            }
            if r.memory_kind() == MemoryKind::PinnedHost {
                // Another size class than the block's.
                // SAFETY: rejected before anything is freed.
                let err = unsafe { r.deallocate(ptr, 100_000, &stream) }.unwrap_err();
                assert!(matches!(err, Error::UnknownPointer { .. }), "{what}");
            }
            // Nothing was lost: the real free still works.
            // SAFETY: allocated above with 1000 bytes, unused, freed once.
            unsafe { r.deallocate(ptr, 1000, &stream) }.unwrap();
        }
        stream.synchronize_blocking().unwrap();
    }
}

#[test]
fn dropping_resources_and_streams_leaks_no_handles() {
    for device in devices() {
        {
            let stream = device.create_stream().unwrap();
            let rs = resources(&device);
            for (_, r) in &rs {
                let ptr = r.allocate(4 * KIB, &stream).unwrap();
                stream.spin(Duration::from_millis(5)).unwrap();
                // SAFETY: unused, freed once.
                unsafe { r.deallocate(ptr, 4 * KIB, &stream) }.unwrap();
            }
            // Dropped with frees pending on the stream (the pinned resource waits for them).
        }
        assert!(
            eventually(Duration::from_secs(5), || device.handle_count() == 1),
            "{}: {} handles left",
            label(&device),
            device.handle_count()
        );
    }
}

#[test]
fn resources_are_send_sync_debug_and_report_their_kind() {
    fn send_sync<T: Send + Sync + std::fmt::Debug>() {}
    send_sync::<CudaResource>();
    send_sync::<CudaAsyncResource>();
    send_sync::<ManagedResource>();
    send_sync::<PinnedHostResource>();
    send_sync::<ExpandablePoolResource>();
    let device = Device::simulated(SimConfig::default());
    let kinds: Vec<MemoryKind> = resources(&device)
        .iter()
        .map(|(_, r)| r.memory_kind())
        .collect();
    assert_eq!(
        kinds,
        [
            MemoryKind::Device,
            MemoryKind::Device,
            MemoryKind::Managed,
            MemoryKind::PinnedHost,
            MemoryKind::Device
        ]
    );
    for (name, r) in resources(&device) {
        let debug = format!("{r:?}");
        assert!(!debug.is_empty(), "{name}");
    }
}
