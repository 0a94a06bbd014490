//! Several devices at once: per-device pools and current resources used from tasks that move
//! between threads, cross-device event waits and buffer uses, what is wrong across devices as
//! typed errors, peer access, copies between devices, one reactor per device.
//!
//! Runs on two simulated devices always, and on GPUs 0 and 1 when the machine has two (with
//! `STREAMALLOC_REQUIRE_GPUS=2`, fewer than two GPUs fails the GPU part instead of skipping it;
//! `STREAMALLOC_REQUIRE_GPU=1` alone, on a one-GPU machine, skips it and says so).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{assert_all_back_within, runtime};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::PoolResource;
use streamalloc::resource::{current_resource, reset_current_resource, set_current_resource};
use streamalloc::{Device, DeviceBuffer, DeviceVec, Error, MemoryResource, SimConfig};

const MIB: usize = 1 << 20;

type Pool = Arc<PoolResource<CudaResource>>;

/// Pairs of distinct devices to run on: two simulated devices, and GPUs 0 and 1 if there are
/// two.
fn pairs(test: &str) -> Vec<(Device, Device)> {
    let mut pairs = vec![(
        Device::simulated(SimConfig::default()),
        Device::simulated(SimConfig::default()),
    )];
    let gpus = Device::cuda_device_count().unwrap_or(0);
    if gpus >= 2 {
        pairs.push((Device::cuda(0).unwrap(), Device::cuda(1).unwrap()));
    } else if std::env::var("STREAMALLOC_REQUIRE_GPUS").as_deref() == Ok("2") {
        panic!("{test}: STREAMALLOC_REQUIRE_GPUS=2 but this machine has {gpus} GPU(s), not 2");
    } else {
        println!("{test}: GPU pair skipped ({gpus} GPU(s) here); ran on two simulated devices");
    }
    pairs
}

fn label(a: &Device, b: &Device) -> String {
    format!("{a} + {b}")
}

fn pool(device: &Device, size: usize) -> Pool {
    Arc::new(common::pool(device, size, size))
}

/// Each device has its own pool, set as its current resource. 32 tasks on a 4-thread runtime
/// switch devices every round and yield between steps (so they move between threads): every
/// allocation comes from the pool of the stream's device, the data is right, and every byte
/// goes back to the right pool.
#[test]
fn per_device_pools_and_current_resources_from_moving_tasks() {
    let rt = runtime();
    for (d0, d1) in pairs("per_device_pools_and_current_resources_from_moving_tasks") {
        let l = label(&d0, &d1);
        let pools = [pool(&d0, 16 * MIB), pool(&d1, 16 * MIB)];
        let devices = [d0.clone(), d1.clone()];
        set_current_resource(&d0, pools[0].clone());
        set_current_resource(&d1, pools[1].clone());
        let outcome = rt.block_on(async {
            let tasks: Vec<_> = (0..32)
                .map(|t| {
                    let (pools, devices) = (pools.clone(), devices.clone());
                    tokio::spawn(async move {
                        let streams = [
                            devices[0].create_stream().unwrap(),
                            devices[1].create_stream().unwrap(),
                        ];
                        for round in 0..8 {
                            let k = (t + round) % 2;
                            let s = &streams[k];
                            let current = current_resource(&devices[k]);
                            assert_eq!(current.device().id(), devices[k].id());
                            tokio::task::yield_now().await;
                            let a = DeviceBuffer::with_current_resource(4096, s).unwrap();
                            let b = DeviceBuffer::alloc(&pools[k], 4096, s).await.unwrap();
                            assert_eq!(a.resource().device().id(), devices[k].id());
                            assert_eq!(b.resource().device().id(), devices[k].id());
                            let value = (t * 100 + round) as u32;
                            let mut v = DeviceVec::<u32>::from_buffer(b).unwrap();
                            // SAFETY: `v` holds 1024 u32s on `s`.
                            unsafe { s.fill_u32(v.as_ptr(), value, 1024) }.unwrap();
                            tokio::task::yield_now().await;
                            let host = v.to_host(s).await.unwrap();
                            assert!(host.iter().all(|&x| x == value));
                            v.record_stream(s).unwrap();
                            drop((a, v));
                        }
                    })
                })
                .collect();
            tokio::time::timeout(Duration::from_secs(120), async {
                for t in tasks {
                    t.await.unwrap();
                }
            })
            .await
        });
        assert!(outcome.is_ok(), "{l}: hung");
        reset_current_resource(&d0);
        reset_current_resource(&d1);
        for p in &pools {
            assert_all_back_within(p, Duration::from_secs(10), &l);
        }
    }
}

/// What is wrong across devices is a typed error, and nothing is allocated.
#[test]
fn wrong_device_combinations_are_typed_errors() {
    let rt = runtime();
    for (d0, d1) in pairs("wrong_device_combinations_are_typed_errors") {
        let l = label(&d0, &d1);
        let (p0, p1) = (pool(&d0, 4 * MIB), pool(&d1, 4 * MIB));
        let (s0, s1) = (d0.create_stream().unwrap(), d1.create_stream().unwrap());
        let wrong = |r: streamalloc::Result<_>, what: &str| match r {
            Err(Error::WrongDevice { expected, found }) => assert_ne!(expected, found),
            Err(e) => panic!("{l}: {what}: {e}"),
            Ok(_) => panic!("{l}: {what}: succeeded"),
        };
        wrong(p0.allocate(256, &s1).map(drop), "pool of 0, stream of 1");
        wrong(
            DeviceBuffer::new(&p0, 256, &s1).map(drop),
            "buffer of 0 on 1",
        );
        wrong(
            rt.block_on(DeviceBuffer::alloc(&p0, 256, &s1)).map(drop),
            "alloc of 0 on 1",
        );
        wrong(
            rt.block_on(DeviceBuffer::alloc_all(&p0, &[(256, &s0), (256, &s1)]))
                .map(drop),
            "a set with a stream of 1",
        );
        let mut b0 = DeviceBuffer::new(&p0, 4096, &s0).unwrap();
        wrong(b0.set_stream(&s1), "moving a buffer of 0 to a stream of 1");
        wrong(
            b0.try_clone_to(&p0, &s1).map(drop),
            "a copy from the resource of 0 for a stream of 1",
        );
        wrong(
            rt.block_on(
                DeviceVec::<u8>::from_buffer(b0.try_clone().unwrap())
                    .unwrap()
                    .to_host(&s1),
            )
            .map(drop),
            "reading a buffer of 0 through a stream of 1",
        );
        // A simulated device and a GPU never meet.
        if !d0.is_simulated() {
            let sim = Device::simulated(SimConfig::default());
            let sim_stream = sim.create_stream().unwrap();
            wrong(s0.wait(&sim_stream.record().unwrap()), "GPU waits for sim");
            wrong(b0.record_stream(&sim_stream), "GPU buffer used on sim");
            wrong(sim.can_access_peer(&d0).map(drop), "sim peer of GPU");
        }
        drop(b0);
        s0.synchronize_blocking().unwrap();
        assert_all_back_within(&p0, Duration::from_secs(5), &l);
        assert_all_back_within(&p1, Duration::from_secs(5), &l);
    }
}

/// A stream of device 1 waits for an event of device 0 (GPU-side), then copies device 0's
/// buffer into its own: the copy sees the data written on device 0 after a long spin, which
/// only the cross-device wait orders before it. The buffer of device 0 records the stream of
/// device 1 as a use, so its free waits for the copy; every byte goes back to each pool.
#[test]
fn a_stream_waits_for_another_devices_event() {
    let rt = runtime();
    for (d0, d1) in pairs("a_stream_waits_for_another_devices_event") {
        let l = label(&d0, &d1);
        let (p0, p1) = (pool(&d0, 4 * MIB), pool(&d1, 4 * MIB));
        let (s0, s1) = (d0.create_stream().unwrap(), d1.create_stream().unwrap());
        let n = 1 << 14;
        let mut b0 = DeviceVec::<u32>::zeroed(&p0, n, &s0).unwrap();
        s0.spin(Duration::from_millis(30)).unwrap();
        // SAFETY: `b0` holds `n` u32s on `s0`.
        unsafe { s0.fill_u32(b0.as_ptr(), 0xabcd, n) }.unwrap();
        let written = s0.record().unwrap();
        s1.wait(&written).unwrap();
        let b1 = DeviceVec::<u32>::zeroed(&p1, n, &s1).unwrap();
        b0.record_stream(&s1).unwrap();
        // SAFETY: both hold `n` u32s on their devices; `s1` waits for the fill on `s0`, and
        // `b0`'s free waits for `s1` (recorded above); `b1` lives on `s1`.
        unsafe { s1.copy_peer(b1.as_ptr(), b0.as_ptr(), &d0, n * 4) }.unwrap();
        drop(b0); // freed on device 0 once device 1's copy has run
        let host = rt.block_on(b1.to_host(&s1)).unwrap();
        assert!(host.iter().all(|&x| x == 0xabcd), "{l}: {:x?}", &host[..4]);
        // The host awaits an event of each device on one task.
        rt.block_on(async {
            let (e0, e1) = (s0.record().unwrap(), s1.record().unwrap());
            e0.await.unwrap();
            e1.await.unwrap();
        });
        drop(b1);
        assert_all_back_within(&p0, Duration::from_secs(10), &l);
        assert_all_back_within(&p1, Duration::from_secs(10), &l);
    }
}

/// Peer access: possible between simulated devices (and said so, or not, by the GPUs);
/// enabling it twice is fine. Copies between devices in stream order with
/// `DeviceBuffer::try_clone_to`, both ways, and a chain 0 -> 1 -> 0.
#[test]
fn peer_access_and_copies_between_devices() {
    let rt = runtime();
    for (d0, d1) in pairs("peer_access_and_copies_between_devices") {
        let l = label(&d0, &d1);
        for (a, b) in [(&d0, &d1), (&d1, &d0)] {
            let can = a.can_access_peer(b).unwrap();
            println!("{l}: {a} can access {b}: {can}");
            if can {
                a.enable_peer_access(b).unwrap();
                a.enable_peer_access(b).unwrap();
            } else {
                assert!(matches!(
                    a.enable_peer_access(b),
                    Err(Error::InvalidArgument { .. })
                ));
            }
            assert!(a.can_access_peer(a).unwrap());
        }
        let (p0, p1) = (pool(&d0, 4 * MIB), pool(&d1, 4 * MIB));
        let (s0, s1) = (d0.create_stream().unwrap(), d1.create_stream().unwrap());
        let data: Vec<u8> = (0..MIB).map(|i| (i % 251) as u8).collect();
        let mut src = DeviceBuffer::new(&p0, MIB, &s0).unwrap();
        src.copy_from_host(&data).unwrap();
        let there = src.try_clone_to(&p1, &s1).unwrap();
        drop(src); // its free waits for the copy on device 1
        assert_eq!(there.stream().device().id(), d1.id());
        let back = there.try_clone_to(&p0, &s0).unwrap();
        drop(there);
        assert_eq!(rt.block_on(back.to_host()).unwrap(), data, "{l}");
        drop(back);
        assert_all_back_within(&p0, Duration::from_secs(10), &l);
        assert_all_back_within(&p1, Duration::from_secs(10), &l);
    }
}

/// Copies between devices work with every resource, as `Device::enable_peer_access` says:
/// memory of the driver's stream-ordered pools (`CudaAsyncResource`) and of virtual-memory
/// mappings (`ExpandablePoolResource`), which peer access does not reach, is copied to and from
/// another device's pool by `try_clone_to` (`cuMemcpyPeerAsync`), both ways.
#[test]
fn copies_between_devices_work_with_every_resource() {
    use streamalloc::resource::cuda_async::CudaAsyncOptions;
    use streamalloc::{CudaAsyncResource, ExpandableOptions, ExpandablePoolResource, ResourceRef};
    let rt = runtime();
    for (d0, d1) in pairs("copies_between_devices_work_with_every_resource") {
        let l = label(&d0, &d1);
        let (s0, s1) = (d0.create_stream().unwrap(), d1.create_stream().unwrap());
        let p1 = pool(&d1, 4 * MIB);
        let sources: Vec<(&str, ResourceRef)> = vec![
            (
                "CudaAsyncResource",
                Arc::new(CudaAsyncResource::new(&d0, CudaAsyncOptions::default()).unwrap()),
            ),
            (
                "ExpandablePoolResource",
                Arc::new(ExpandablePoolResource::new(&d0, ExpandableOptions::default()).unwrap()),
            ),
        ];
        let data: Vec<u8> = (0..MIB).map(|i| (i % 249) as u8).collect();
        for (name, r) in sources {
            let mut src = DeviceBuffer::new(&r, MIB, &s0).unwrap();
            src.copy_from_host(&data).unwrap();
            let there = src.try_clone_to(&p1, &s1).unwrap();
            drop(src);
            let back = there.try_clone_to(&r, &s0).unwrap();
            drop(there);
            assert_eq!(rt.block_on(back.to_host()).unwrap(), data, "{l}: {name}");
            drop(back);
        }
        s0.synchronize_blocking().unwrap();
        assert_all_back_within(&p1, Duration::from_secs(10), &l);
    }
}

/// Every device has its own completion reactor thread (`sa-reactor-<device id>`): the two
/// devices' events complete through two threads. (Linux: thread names from /proc.)
#[test]
fn one_completion_reactor_per_device() {
    let names: Vec<String> = match std::fs::read_dir("/proc/self/task") {
        Ok(_) => Vec::new(),
        Err(_) => {
            println!("one_completion_reactor_per_device: skipped, no /proc on this system");
            return;
        }
    };
    drop(names);
    for (d0, d1) in pairs("one_completion_reactor_per_device") {
        // Make each reactor watch something, so both are running.
        for d in [&d0, &d1] {
            let s = d.create_stream().unwrap();
            s.spin(Duration::from_millis(1)).unwrap();
            s.synchronize_blocking().unwrap();
        }
        let names: Vec<String> = std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .map(|n| n.trim().to_owned())
            .collect();
        for d in [&d0, &d1] {
            // Thread names are cut to 15 bytes.
            let mut want = format!("sa-reactor-{}", d.id());
            want.truncate(15);
            assert!(
                names.contains(&want),
                "{}: no reactor thread {want:?} among {names:?}",
                label(&d0, &d1)
            );
        }
    }
}
