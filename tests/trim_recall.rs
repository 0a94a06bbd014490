//! Requests that come while a trim waits for the GPU with free memory out of the lists
//! (`src/resource/held_for_trim.rs`), on every available device: at the maximum they take that
//! memory back and are served, below it they grow and leave the trim its memory, and none
//! waits for the trim's give-back (the upstream's free, the unmapping).
//!
//! The tests take turns (`take_turns`), as `trim_cancel.rs`'s: each needs its stream still busy
//! while the trim waits.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use common::{check_pool, devices, free, label, poll_once, pool, take_turns};
use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{
    Device, DevicePtr, ExpandableOptions, ExpandablePoolResource, MemoryResource, Result, Stream,
};

const MIB: usize = 1 << 20;

/// A request at the maximum while the pool's trim waits for the stream that freed the pool's
/// only chunk: served from that chunk (ordered after the stream, as any reuse), not refused;
/// the trim then gives back nothing. Before, the request failed with out of memory: the chunk
/// was out of the lists and still counted against the maximum, though the trim would have
/// freed it moments later.
#[test]
fn a_request_at_the_maximum_takes_what_the_pools_trim_holds() {
    let _turn = take_turns();
    for device in devices() {
        let p = pool(&device, 0, 4 * MIB);
        let (s1, s2) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let x = p.allocate(4 * MIB, &s1).unwrap();
        s1.spin(Duration::from_millis(300)).unwrap();
        free(&p, x, 4 * MIB, &s1); // the chunk waits for `s1`, busy
        let mut trim = std::pin::pin!(p.trim());
        assert!(poll_once(trim.as_mut()).is_pending(), "{}", label(&device));
        assert_eq!(
            p.stats().free,
            0,
            "{}: the trim holds the chunk",
            label(&device)
        );
        let before = p.stats();
        let y = p
            .allocate(4 * MIB, &s2)
            .unwrap_or_else(|e| panic!("{}: {e}", label(&device)));
        let after = p.stats();
        assert_eq!(y, x, "{}: the chunk the trim held", label(&device));
        assert_eq!(
            (after.grows, after.reserved),
            (before.grows, 4 * MIB),
            "{}",
            label(&device)
        );
        assert!(
            after.stream_waits + after.idle_reuses > before.stream_waits + before.idle_reuses,
            "{}: reused after `s1` without an ordering: {after:?}",
            label(&device)
        );
        assert_eq!(
            futures::executor::block_on(trim).unwrap(),
            0,
            "{}: nothing left to give back",
            label(&device)
        );
        free(&p, y, 4 * MIB, &s2);
        check_pool(&p);
        s2.synchronize_blocking().unwrap();
        assert_eq!(p.trim_blocking().unwrap(), 4 * MIB, "{}", label(&device));
    }
}

/// The same for the expandable pool's trim, which holds granules until their stream is done
/// before it unmaps them.
#[test]
fn a_request_at_the_maximum_takes_what_the_expandable_pools_trim_holds() {
    let _turn = take_turns();
    for device in devices() {
        let p = ExpandablePoolResource::new(
            &device,
            ExpandableOptions {
                maximum: Some(8 * MIB),
                ..ExpandableOptions::default()
            },
        )
        .unwrap();
        let (s1, s2) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let x = p.allocate(8 * MIB, &s1).unwrap();
        s1.spin(Duration::from_millis(300)).unwrap();
        free(&p, x, 8 * MIB, &s1); // the granules wait for `s1`, busy
        let mut trim = std::pin::pin!(p.trim());
        assert!(poll_once(trim.as_mut()).is_pending(), "{}", label(&device));
        assert_eq!(
            p.stats().free,
            0,
            "{}: the trim holds the granules",
            label(&device)
        );
        let y = p
            .allocate(8 * MIB, &s2)
            .unwrap_or_else(|e| panic!("{}: {e}", label(&device)));
        assert_eq!(y, x, "{}: the granules the trim held", label(&device));
        assert_eq!(p.stats().reserved, 8 * MIB, "{}", label(&device));
        assert_eq!(
            futures::executor::block_on(trim).unwrap(),
            0,
            "{}: nothing left to unmap",
            label(&device)
        );
        free(&p, y, 8 * MIB, &s2);
        p.check_invariants().unwrap();
        s2.synchronize_blocking().unwrap();
        assert_eq!(p.trim_blocking().unwrap(), 8 * MIB, "{}", label(&device));
    }
}

/// The same for the arena's trim, which holds whole free chunks until the streams that last
/// used them are done: a large request (served by the global arena) and a small one (a
/// superblock for its stream's arena), each at the maximum, each served from the chunk the
/// trim holds. Before, both failed with out of memory (an arena review's finding; the pool and
/// the expandable pool had the recall already).
#[test]
fn a_request_at_the_maximum_takes_what_the_arenas_trim_holds() {
    let _turn = take_turns();
    for device in devices() {
        for (bytes, what) in [(4 * MIB, "large"), (MIB / 2, "small")] {
            let maximum = if bytes > MIB { 4 * MIB } else { MIB };
            let arena = ArenaResource::new(
                CudaResource::new(&device),
                ArenaOptions {
                    maximum: Some(maximum),
                    ..ArenaOptions::default()
                },
            )
            .unwrap();
            let (s1, s2) = (
                device.create_stream().unwrap(),
                device.create_stream().unwrap(),
            );
            let x = arena.allocate(bytes, &s1).unwrap();
            // SAFETY: `bytes` of `x`, allocated for `s1`, written on `s1`.
            unsafe { s1.memset_d8(x, 1, bytes) }.unwrap();
            s1.spin(Duration::from_millis(300)).unwrap();
            free(&arena, x, bytes, &s1); // the chunk waits for `s1`, busy
            let mut trim = std::pin::pin!(arena.trim());
            assert!(poll_once(trim.as_mut()).is_pending(), "{}", label(&device));
            assert_eq!(
                arena.stats().global_free,
                0,
                "{what}: the trim holds the chunk"
            );
            let y = arena
                .allocate(bytes, &s2)
                .unwrap_or_else(|e| panic!("{} {what}: {e}", label(&device)));
            assert_eq!(y, x, "{} {what}: the chunk the trim held", label(&device));
            // Ordered after `s1`'s write (the simulated device's race detector would report
            // this write otherwise), and after it on the GPU: the bytes read back are ours.
            // SAFETY: `bytes` of `y`, allocated for `s2`, written on `s2`.
            unsafe { s2.memset_d8(y, 2, bytes) }.unwrap();
            let back = common::read_u32(&s2, y, 1024);
            assert!(
                back.iter().all(|&w| w == 0x0202_0202),
                "{} {what}",
                label(&device)
            );
            assert_eq!(arena.stats().reserved, maximum, "{what}");
            assert_eq!(
                futures::executor::block_on(trim).unwrap(),
                0,
                "{} {what}: nothing left to give back",
                label(&device)
            );
            free(&arena, y, bytes, &s2);
            s2.synchronize_blocking().unwrap();
            assert_eq!(arena.trim_blocking().unwrap(), maximum, "{what}");
        }
    }
}

/// Below the maximum a request grows as usual and leaves the trim what it holds: the trim holds
/// a 4 MiB chunk (its stream busy); a 16 MiB request, which that chunk cannot serve, grows; the
/// trim gives the chunk back. A review found the request taking the chunk back anyway (a recall
/// before every growth), the trim giving back nothing and the pool holding both.
#[test]
fn a_request_the_pools_trim_cannot_serve_leaves_it_its_chunk() {
    let _turn = take_turns();
    for device in devices() {
        let p = pool(&device, 0, 64 * MIB);
        let (s1, s2) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let x = p.allocate(4 * MIB, &s1).unwrap();
        let chunk = p.stats().reserved;
        s1.spin(Duration::from_millis(300)).unwrap();
        free(&p, x, 4 * MIB, &s1); // the chunk waits for `s1`, busy
        let mut trim = std::pin::pin!(p.trim());
        assert!(poll_once(trim.as_mut()).is_pending(), "{}", label(&device));
        assert_eq!(
            p.stats().free,
            0,
            "{}: the trim holds the chunk",
            label(&device)
        );
        // Larger than anything the trim holds: it can only be served by a growth.
        let y = p.allocate(16 * MIB, &s2).unwrap();
        let trimmed = futures::executor::block_on(trim).unwrap();
        let after = p.stats();
        assert_eq!(
            trimmed,
            chunk,
            "{}: the trim gave back {trimmed} of the {chunk} bytes it held, though the request \
             it lost them to was served by a growth; the pool still holds them free: {after:?}",
            label(&device)
        );
        free(&p, y, 16 * MIB, &s2);
        check_pool(&p);
        s2.synchronize_blocking().unwrap();
        p.trim_blocking().unwrap();
    }
}

/// The same for the expandable pool: granules a, b, c mapped and used; b freed on a busy
/// stream (c stays live, so b is no frontier for a growth to extend). The trim holds b; a
/// request of two granules, which b cannot serve, maps two more at the frontier; the trim
/// unmaps b.
#[test]
fn a_request_the_expandable_trim_cannot_serve_leaves_it_its_granule() {
    let _turn = take_turns();
    for device in devices() {
        let p = ExpandablePoolResource::new(
            &device,
            ExpandableOptions {
                maximum: Some(64 * MIB),
                ..ExpandableOptions::default()
            },
        )
        .unwrap();
        let g = p.granule();
        let (s1, s2) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let a = p.allocate(g, &s1).unwrap();
        let b = p.allocate(g, &s1).unwrap();
        let c = p.allocate(g, &s1).unwrap();
        s1.spin(Duration::from_millis(300)).unwrap();
        free(&p, b, g, &s1); // b's granule waits for `s1`, busy
        let mut trim = std::pin::pin!(p.trim());
        assert!(poll_once(trim.as_mut()).is_pending(), "{}", label(&device));
        assert_eq!(p.stats().free, 0, "{}: the trim holds b", label(&device));
        let d = p.allocate(2 * g, &s2).unwrap();
        assert_ne!(d, b, "{}", label(&device));
        let unmapped = futures::executor::block_on(trim).unwrap();
        let after = p.stats();
        assert_eq!(
            unmapped,
            g,
            "{}: the trim unmapped {unmapped} bytes of the granule it held, though the request \
             it lost it to was served elsewhere; it stays mapped, free: {after:?}",
            label(&device)
        );
        for (ptr, size, s) in [(a, g, &s1), (c, g, &s1), (d, 2 * g, &s2)] {
            free(&p, ptr, size, s);
        }
        p.check_invariants().unwrap();
        s1.synchronize_blocking().unwrap();
        s2.synchronize_blocking().unwrap();
        p.trim_blocking().unwrap();
    }
}

/// `CudaResource` whose `deallocate` can be made to block until opened, as `cuMemFree` does on a
/// GPU while any stream of the device still has work (the simulated device does not block).
#[derive(Debug)]
struct SlowFree {
    inner: CudaResource,
    closed: AtomicBool,
    entered: AtomicBool,
    gate: Mutex<bool>,
    opened: Condvar,
}

impl SlowFree {
    fn new(device: &Device) -> Self {
        Self {
            inner: CudaResource::new(device),
            closed: AtomicBool::new(false),
            entered: AtomicBool::new(false),
            gate: Mutex::new(false),
            opened: Condvar::new(),
        }
    }

    fn open(&self) {
        *self.gate.lock().unwrap() = true;
        self.opened.notify_all();
    }
}

// SAFETY: passes every call on to `CudaResource`, only later.
unsafe impl MemoryResource for SlowFree {
    fn device(&self) -> &Device {
        self.inner.device()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        self.inner.allocate(bytes, stream)
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        if self.closed.load(Ordering::SeqCst) {
            self.entered.store(true, Ordering::SeqCst);
            let mut open = self.gate.lock().unwrap();
            while !*open {
                open = self.opened.wait(open).unwrap();
            }
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.deallocate(ptr, bytes, stream) }
    }
}

/// While the pool's trim is inside its upstream's free, a request on another stream that misses
/// the lists (well below the maximum: a plain growth) does not wait for that free to end. A
/// review found it waiting (the trim gave back under the held list's lock, which the request's
/// recall took while it held the growth lock); over `CudaResource` that free is a `cuMemFree`,
/// which waits for the whole device to be idle.
#[test]
fn a_request_does_not_wait_for_the_pools_trim_to_free_upstream() {
    let _turn = take_turns();
    for device in devices() {
        let p = PoolResource::new(
            SlowFree::new(&device),
            PoolOptions {
                maximum: Some(64 * MIB),
                ..PoolOptions::default()
            },
        )
        .unwrap();
        let (s1, s2) = (
            device.create_stream().unwrap(),
            device.create_stream().unwrap(),
        );
        let x = p.allocate(4 * MIB, &s1).unwrap();
        free(&p, x, 4 * MIB, &s1);
        s1.synchronize_blocking().unwrap(); // the trim need not wait for the GPU
        p.upstream().closed.store(true, Ordering::SeqCst);
        let waited = std::thread::scope(|scope| {
            let trim = scope.spawn(|| p.trim_blocking());
            assert!(
                common::eventually(Duration::from_secs(10), || p
                    .upstream()
                    .entered
                    .load(Ordering::SeqCst)),
                "{}: the trim never freed upstream",
                label(&device)
            );
            let (tx, rx) = std::sync::mpsc::channel();
            let (p, s2) = (&p, &s2);
            let request = scope.spawn(move || {
                let started = Instant::now();
                let y = p.allocate(8 * MIB, s2);
                tx.send(()).unwrap();
                (y, started.elapsed())
            });
            let served_in_time = rx.recv_timeout(Duration::from_secs(2)).is_ok();
            p.upstream().open();
            let (y, took) = request.join().unwrap();
            trim.join().unwrap().unwrap();
            free(p, y.unwrap(), 8 * MIB, s2);
            (served_in_time, took)
        });
        assert!(
            waited.0,
            "{}: a request below the maximum waited {:?} for the trim's upstream free (the \
             engine's growth lock held, waiting for the held list's lock)",
            label(&device),
            waited.1
        );
        check_pool(&p);
    }
}

/// What [`growth_gives_back_without_the_lock`] reads of a resource over [`SlowFree`]: its
/// upstream, and its (chunks, reserved, in use).
struct GrowthView<R> {
    upstream: fn(&R) -> &SlowFree,
    counts: fn(&R) -> (usize, usize, usize),
    /// What holds the growth lock, for the failure message.
    lock: &'static str,
}

/// While a request at `r`'s maximum (16 MiB) gives its wholly free chunks back upstream to grow
/// a larger one, a request on another stream that needs growth too, for room still under the
/// maximum, does not wait for that free to end; and the room the first request gave chunks
/// back for stays its own (the second grows only into what is left). Before, the free ran
/// under the growth lock (`slow`), which the second request needs: over `CudaResource` that is
/// a `cuMemFree`, which waits for the whole device to be idle.
fn growth_gives_back_without_the_lock<R: MemoryResource + Sync>(
    device: &Device,
    r: &R,
    view: GrowthView<R>,
) {
    let (s1, s2) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let reserved = |r: &R| (view.counts)(r).1;
    // Two chunks of 2 MiB; the first wholly free again: 12 MiB of room, and 2 MiB of whole
    // free chunks.
    let x = r.allocate(2 * MIB, &s1).unwrap();
    let y = r.allocate(2 * MIB, &s1).unwrap();
    free(r, x, 2 * MIB, &s1);
    s1.synchronize_blocking().unwrap();
    assert_eq!((view.counts)(r).0, 2, "{}", label(device));
    (view.upstream)(r).closed.store(true, Ordering::SeqCst);
    let (served_in_time, took) = std::thread::scope(|scope| {
        // 13 MiB: more than the room, less than the room and the free chunk together.
        let big = scope.spawn(|| r.allocate(13 * MIB, &s1));
        assert!(
            common::eventually(Duration::from_secs(10), || (view.upstream)(r)
                .entered
                .load(Ordering::SeqCst)),
            "{}: the request never gave its free chunk back upstream",
            label(device)
        );
        let (tx, rx) = std::sync::mpsc::channel();
        let s2 = &s2;
        let small = scope.spawn(move || {
            let started = Instant::now();
            let z = r.allocate(MIB / 4, s2);
            tx.send(()).unwrap();
            (z, started.elapsed())
        });
        let served_in_time = rx.recv_timeout(Duration::from_secs(2)).is_ok();
        (view.upstream)(r).open();
        let (z, took) = small.join().unwrap();
        let big = big.join().unwrap();
        let z = z.unwrap_or_else(|e| panic!("{}: the small request: {e}", label(device)));
        let big = big.unwrap_or_else(|e| {
            panic!(
                "{}: the request that gave its chunk back to grow: {e}",
                label(device)
            )
        });
        assert!(reserved(r) <= 16 * MIB, "{}", label(device));
        free(r, big, 13 * MIB, &s1);
        free(r, z, MIB / 4, s2);
        (served_in_time, took)
    });
    assert!(
        served_in_time,
        "{}: a request below the maximum waited {took:?} for another's upstream free (the \
         {} held across it)",
        label(device),
        view.lock
    );
    free(r, y, 2 * MIB, &s1);
    let (_, reserved, in_use) = (view.counts)(r);
    assert!(reserved <= 16 * MIB, "{}: {reserved}", label(device));
    assert_eq!(in_use, 0, "{}", label(device));
}

#[test]
fn a_request_does_not_wait_for_the_arenas_growth_to_free_upstream() {
    let _turn = take_turns();
    for device in devices() {
        let arena = ArenaResource::new(
            SlowFree::new(&device),
            ArenaOptions {
                maximum: Some(16 * MIB),
                ..ArenaOptions::default()
            },
        )
        .unwrap();
        growth_gives_back_without_the_lock(
            &device,
            &arena,
            GrowthView {
                upstream: ArenaResource::upstream,
                counts: |a| {
                    let s = a.stats();
                    (s.chunks, s.reserved, s.in_use)
                },
                lock: "arena's growth lock",
            },
        );
    }
}

#[test]
fn a_request_does_not_wait_for_the_pools_growth_to_free_upstream() {
    let _turn = take_turns();
    for device in devices() {
        let p = PoolResource::new(
            SlowFree::new(&device),
            PoolOptions {
                maximum: Some(16 * MIB),
                growth_cap: None,
                ..PoolOptions::default()
            },
        )
        .unwrap();
        growth_gives_back_without_the_lock(
            &device,
            &p,
            GrowthView {
                upstream: PoolResource::upstream,
                counts: |p| {
                    let s = p.stats();
                    (s.chunks, s.reserved, s.in_use)
                },
                lock: "engine's growth lock",
            },
        );
        check_pool(&p);
    }
}

/// Two trims down to `keep` at once never leave less than `keep` mapped: the first holds the
/// top half of the pool (its stream busy) while the second runs to its end. Before, the second
/// took what went past `keep` as if the first were not there, and the two together unmapped
/// everything.
#[test]
fn two_trims_at_once_keep_what_they_were_asked_to() {
    let _turn = take_turns();
    for device in devices() {
        let p = ExpandablePoolResource::new(
            &device,
            ExpandableOptions {
                maximum: Some(8 * MIB),
                // Trims exact to the granule (2 MiB here), which `keep` is a multiple of.
                map_unit: Some(1),
                ..ExpandableOptions::default()
            },
        )
        .unwrap();
        let s1 = device.create_stream().unwrap();
        let x = p.allocate(8 * MIB, &s1).unwrap();
        s1.spin(Duration::from_millis(300)).unwrap();
        free(&p, x, 8 * MIB, &s1); // the granules wait for `s1`, busy
        let keep = 4 * MIB;
        let mut first = std::pin::pin!(p.trim_to(keep));
        assert!(poll_once(first.as_mut()).is_pending(), "{}", label(&device));
        let second = p.trim_to_blocking(keep).unwrap();
        let first = futures::executor::block_on(first).unwrap();
        let reserved = p.stats().reserved;
        assert!(
            reserved >= keep,
            "{}: two trims down to {keep} left {reserved} mapped (they unmapped {first} and \
             {second})",
            label(&device)
        );
        assert_eq!(first + second, 4 * MIB, "{}", label(&device));
        p.check_invariants().unwrap();
    }
}
