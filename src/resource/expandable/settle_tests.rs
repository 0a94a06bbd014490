//! The job that waits for the streams a move at the maximum found busy (`settle_busy`): at
//! most one queued per stream. Before the twenty-third session's review every refused request
//! queued one, each waiting for the same stream on the device's blocking-work thread.

use std::time::Duration;

use super::{ExpandableOptions, ExpandablePoolResource};
use crate::device::{Device, DevicePtr};
use crate::resource::MemoryResource;
use crate::stream::Stream;
use crate::SimConfig;

const MIB: usize = 1 << 20;

/// Hands out `bytes` on `stream` from a new thread (the next shard, and its range).
fn allocate_on_a_thread(pool: &ExpandablePoolResource, bytes: usize, stream: &Stream) -> DevicePtr {
    std::thread::scope(|scope| scope.spawn(|| pool.allocate(bytes, stream).unwrap()).join())
        .unwrap()
}

/// 2 MiB freed on `s` behind a 300 ms spin in one range and 2 MiB freed on an idle `u` in
/// another, at a maximum of 4 MiB: 50 requests for 4 MiB on `t` are refused (the move would
/// need `s`'s granule) and each notes `s` busy. One job runs (waiting for `s`) and at most one
/// more is queued; once `s` is done, the request is served.
#[test]
fn a_storm_of_refusals_queues_one_job_per_busy_stream() {
    let device = Device::simulated(SimConfig::default());
    let pool = ExpandablePoolResource::new(
        &device,
        ExpandableOptions {
            reserve: Some(64 * MIB),
            maximum: Some(4 * MIB),
            map_unit: Some(1),
            ..ExpandableOptions::default()
        },
    )
    .unwrap();
    let (s, u, t) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let a = allocate_on_a_thread(&pool, 2 * MIB, &s);
    let c = allocate_on_a_thread(&pool, 2 * MIB, &u);
    s.spin(Duration::from_millis(300)).unwrap();
    // SAFETY: handed out above, unused, freed once each on its stream.
    unsafe {
        pool.deallocate(a, 2 * MIB, &s).unwrap();
        pool.deallocate(c, 2 * MIB, &u).unwrap();
    }
    u.synchronize_blocking().unwrap();
    let refused = std::thread::scope(|scope| {
        scope
            .spawn(|| {
                (0..50)
                    .filter(|_| pool.allocate(4 * MIB, &t).is_err())
                    .count()
            })
            .join()
            .unwrap()
    });
    assert_eq!(refused, 50, "{:?}", pool.stats());
    let queued = device.reactor().queued_jobs();
    assert!(queued <= 1, "{queued} jobs queued for one busy stream");
    s.synchronize_blocking().unwrap();
    let served = std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let deadline = std::time::Instant::now() + Duration::from_secs(10);
                loop {
                    match pool.allocate(4 * MIB, &t) {
                        Ok(p) => return Some(p),
                        Err(_) if std::time::Instant::now() < deadline => {
                            std::thread::sleep(Duration::from_millis(5))
                        }
                        Err(_) => return None,
                    }
                }
            })
            .join()
            .unwrap()
    });
    let b = served.expect("never served once `s` was done");
    // SAFETY: handed out above on `t`, unused, freed once.
    unsafe { pool.deallocate(b, 4 * MIB, &t) }.unwrap();
    t.synchronize_blocking().unwrap();
    pool.check_invariants().unwrap();
}
