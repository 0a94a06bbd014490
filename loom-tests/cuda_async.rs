//! `CudaAsyncResource`'s count of the bytes it has handed out (src/resource/cuda_async.rs),
//! which is what holds its maximum exactly (the driver rounds a pool's `maxSize` up): a request
//! reserves its rounded size by compare-and-swap before the driver is asked, and gives it back
//! if the driver refuses.
//!
//! The crate's resource on the simulated device (run inline under the loom cfg): the count is
//! a loom atomic, the simulated pool plain memory.

use loom::thread;

use super::{check_paths, must_fail, CountingWaker, Seen, Shared};
use crate::resource::adaptor::LimitingAdaptor;
use crate::resource::cuda_async::{CudaAsyncOptions, CudaAsyncResource};
use crate::sync::Arc;
use crate::{Device, MemoryResource, RaceDetection, SimConfig};

const BLOCK: usize = 256;

const FIRST: &str = "the spawned thread's request served";
const SECOND: &str = "the model thread's request served";

/// A maximum of one block; two threads ask for one each, on their own streams: exactly one is
/// served, the other is out of memory with the maximum in its error, and the count is the
/// block's; once it is freed the count is 0 and a block can be had again.
fn two_requests_at_the_maximum(seen: &Shared<Seen>) {
    let device = Device::simulated(SimConfig {
        race_detection: RaceDetection::Panic,
        ..SimConfig::default()
    });
    let resource = Arc::new(
        CudaAsyncResource::new(
            &device,
            CudaAsyncOptions {
                maximum_pool_size: Some(BLOCK),
                ..CudaAsyncOptions::default()
            },
        )
        .unwrap(),
    );
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let other = {
        let (resource, b) = (resource.clone(), b.clone());
        thread::spawn(move || resource.allocate(BLOCK, &b).ok())
    };
    let mine = resource.allocate(BLOCK, &a);
    let theirs = other.join().unwrap();
    let (ptr, stream) = match (mine, theirs) {
        (Ok(ptr), None) => (ptr, &a),
        (Err(e), Some(ptr)) => {
            assert!(
                matches!(e, crate::Error::OutOfMemory { maximum: BLOCK, .. }),
                "{e}"
            );
            (ptr, &b)
        }
        (mine, theirs) => panic!(
            "a maximum of one block served {} requests (mine {mine:?}, theirs {theirs:?})",
            usize::from(mine.is_ok()) + usize::from(theirs.is_some())
        ),
    };
    seen.note(FIRST, stream.id() == b.id());
    seen.note(SECOND, stream.id() == a.id());
    assert_eq!(resource.allocated_bytes(), BLOCK, "the count");
    // SAFETY: allocated above with these bytes on `stream`, unused, freed once.
    unsafe { resource.deallocate(ptr, BLOCK, stream) }.unwrap();
    assert_eq!(resource.allocated_bytes(), 0, "the count after the free");
    let again = resource.allocate(BLOCK, &a).unwrap();
    // SAFETY: as above.
    unsafe { resource.deallocate(again, BLOCK, &a) }.unwrap();
    a.synchronize_blocking().unwrap();
    b.synchronize_blocking().unwrap();
}

#[test]
fn cuda_async_maximum_holds_for_racing_requests() {
    check_paths(Some(2), &[FIRST, SECOND], two_requests_at_the_maximum);
}

/// Bug: the maximum is checked with a load and the bytes counted with a separate add
/// (`limiting_planted::CHECK_THEN_ADD`, in the limiting adaptor's `Limit`, which the resource
/// counts with): both requests pass the check.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_check_then_add() {
    must_fail(
        module_path!(),
        "planted_check_then_add",
        "a maximum of one block served 2 requests",
        || {
            crate::resource::adaptor::limiting_planted::CHECK_THEN_ADD
                .store(true, std::sync::atomic::Ordering::Relaxed);
            check_paths(Some(2), &[], two_requests_at_the_maximum);
        },
    );
}

/// A free issued while nobody waits, racing a request that starts waiting: either the free
/// sees the waiter (and notifies it, and records an event), or the waiter, arriving after the
/// free's fence, finds the free's stream in its slot and records an event there, which wakes
/// it when the stream gets there (at once on the inline device). Either way the waiter is
/// woken: it never sleeps through a free issued just before it waited.
fn a_free_and_an_arriving_waiter(_: &Shared<Seen>) {
    a_free_and_a_waiter_arriving(false);
}

/// The same with the waiter in the queue of a limiting adaptor stacked over the resource (a
/// request the driver refused under a limit): its arrival starts what one in the resource's
/// own queue would (the hook passed up by `MemoryWaiters::stacked_over`).
fn a_free_and_a_waiter_arriving_above(_: &Shared<Seen>) {
    a_free_and_a_waiter_arriving(true);
}

fn a_free_and_a_waiter_arriving(stacked: bool) {
    let device = Device::simulated(SimConfig {
        race_detection: RaceDetection::Off,
        ..SimConfig::default()
    });
    // Std's `Arc`: a resource over it is a resource (the adaptor's upstream).
    let resource =
        std::sync::Arc::new(CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap());
    let limited = stacked.then(|| LimitingAdaptor::new(resource.clone(), 1 << 20));
    let stream = device.create_stream().unwrap();
    let ptr = resource.allocate(BLOCK, &stream).unwrap();
    let freeing = {
        let (resource, stream) = (resource.clone(), stream.clone());
        thread::spawn(move || {
            // SAFETY: allocated above with these bytes on `stream`, unused, freed once.
            unsafe { resource.deallocate(ptr, BLOCK, &stream) }.unwrap();
        })
    };
    let (counter, waker) = CountingWaker::new();
    let waiters = match &limited {
        Some(limited) => limited.memory_waiters(),
        None => resource.memory_waiters(),
    }
    .unwrap();
    let (id, _) = waiters.register(BLOCK, &waker);
    freeing.join().unwrap();
    assert!(
        counter.wakes() > 0,
        "the waiter slept through a free issued as it arrived"
    );
    waiters.remove(id, crate::resource::waiters::Leave::Cancelled);
    stream.synchronize_blocking().unwrap();
}

#[test]
fn cuda_async_an_arriving_waiter_learns_of_a_racing_free() {
    check_paths(Some(2), &[], a_free_and_an_arriving_waiter);
}

/// Bug: the free notes its stream after its notification's fence and its loads of the queues
/// (`cuda_async::planted::NOTE_AFTER`): a waiter registering in between sees neither.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_note_after() {
    must_fail(
        module_path!(),
        "planted_note_after",
        "the waiter slept through a free",
        || {
            crate::resource::cuda_async::planted::NOTE_AFTER
                .store(true, std::sync::atomic::Ordering::Relaxed);
            check_paths(Some(2), &[], a_free_and_an_arriving_waiter);
        },
    );
}

#[test]
fn cuda_async_a_waiter_arriving_above_learns_of_a_racing_free() {
    check_paths(Some(2), &[], a_free_and_a_waiter_arriving_above);
}

/// Bug: a limiting adaptor's queue does not get the arrival hook of the resource's queue
/// (`waiters::planted::HOOK_NOT_STACKED`): a free that found nobody waiting and a request that
/// waits above just after it never meet.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_hook_not_stacked() {
    must_fail(
        module_path!(),
        "planted_hook_not_stacked",
        "the waiter slept through a free",
        || {
            crate::resource::waiters::planted::HOOK_NOT_STACKED
                .store(true, std::sync::atomic::Ordering::Relaxed);
            check_paths(Some(2), &[], a_free_and_a_waiter_arriving_above);
        },
    );
}

const NOTED_FIRST: &str = "the first stream noted before the second";
const NOTED_SECOND: &str = "the second stream noted before the first";

/// Frees on two streams that share a slot (under loom there is one slot, so every two streams
/// do), issued while nobody waits, on two threads: the first stream's twice (its second free
/// finds it noted, or races its own noting), the second's once. Then a request starts waiting:
/// it must record an event on *both* streams, since the GPU's reaching either free is what
/// hands its memory to any stream, and it is woken.
///
/// The inline device completes every event at once, so a wake alone cannot tell whether the
/// first stream was forgotten (the second's event wakes the waiter too): the model reads the
/// streams that the arrival recorded an event on (`CudaAsyncResource::watched_streams`).
fn frees_on_streams_sharing_a_slot(seen: &Shared<Seen>) {
    let device = Device::simulated(SimConfig {
        race_detection: RaceDetection::Off,
        ..SimConfig::default()
    });
    let resource = Arc::new(CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap());
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let (a1, a2) = (
        resource.allocate(BLOCK, &a).unwrap(),
        resource.allocate(BLOCK, &a).unwrap(),
    );
    let b1 = resource.allocate(BLOCK, &b).unwrap();
    let freeing = {
        let (resource, a) = (resource.clone(), a.clone());
        thread::spawn(move || {
            for ptr in [a1, a2] {
                // SAFETY: allocated above with these bytes on `a`, unused, freed once.
                unsafe { resource.deallocate(ptr, BLOCK, &a) }.unwrap();
            }
        })
    };
    // SAFETY: as above, on `b`.
    unsafe { resource.deallocate(b1, BLOCK, &b) }.unwrap();
    freeing.join().unwrap();
    let (counter, waker) = CountingWaker::new();
    let waiters = resource.memory_waiters().unwrap();
    let (id, _) = waiters.register(BLOCK, &waker);
    let watched = resource.watched_streams();
    for (which, stream) in [("first", &a), ("second", &b)] {
        assert!(
            watched.contains(&stream.id().get()),
            "the {which} stream's free was forgotten: the arriving waiter recorded no event on \
             it (events on {watched:?})"
        );
    }
    assert!(
        counter.wakes() > 0,
        "the waiter slept through the frees issued before it arrived"
    );
    seen.note(NOTED_FIRST, watched.first() == Some(&a.id().get()));
    seen.note(NOTED_SECOND, watched.first() == Some(&b.id().get()));
    waiters.remove(id, crate::resource::waiters::Leave::Cancelled);
    a.synchronize_blocking().unwrap();
    b.synchronize_blocking().unwrap();
}

#[test]
fn cuda_async_frees_on_streams_sharing_a_slot_are_all_remembered() {
    check_paths(
        Some(2),
        &[NOTED_FIRST, NOTED_SECOND],
        frees_on_streams_sharing_a_slot,
    );
}

/// Bug: a slot keeps one stream, and a free on another stream of the slot replaces it
/// (`cuda_async::planted::ONE_PER_SLOT`, the code before the fix): the first stream's free is
/// forgotten.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_one_per_slot() {
    must_fail(
        module_path!(),
        "planted_one_per_slot",
        "stream's free was forgotten",
        || {
            crate::resource::cuda_async::planted::ONE_PER_SLOT
                .store(true, std::sync::atomic::Ordering::Relaxed);
            check_paths(Some(2), &[], frees_on_streams_sharing_a_slot);
        },
    );
}

const PRUNED: &str = "an idle stream pruned from a full slot";

/// Three streams in a slot of two ways (under loom): the third stream's free finds the ways
/// full and prunes the list, racing a free on the first stream (on another thread). A pruned
/// stream is one whose work the GPU finished (on the inline device, every stream), so its
/// free's memory is in the pool; every stream left in the list gets an event when a request
/// arrives, the third's among them, and the waiter is woken. Checks that pruning loses no
/// stream it must keep (the third, noted last) and that the ways stay coherent with the list
/// (a stream in a way but not in the list would skip its noting for good).
fn a_full_slot_pruned_while_a_stream_frees(seen: &Shared<Seen>) {
    let device = Device::simulated(SimConfig {
        race_detection: RaceDetection::Off,
        ..SimConfig::default()
    });
    let resource = Arc::new(CudaAsyncResource::new(&device, CudaAsyncOptions::default()).unwrap());
    let streams: Vec<_> = (0..3).map(|_| device.create_stream().unwrap()).collect();
    let blocks: Vec<_> = streams
        .iter()
        .map(|s| resource.allocate(BLOCK, s).unwrap())
        .collect();
    let again = resource.allocate(BLOCK, &streams[0]).unwrap();
    // The first two noted while nobody waits: the ways are full.
    for (ptr, stream) in blocks.iter().zip(&streams).take(2) {
        // SAFETY: allocated above with these bytes on `stream`, unused, freed once.
        unsafe { resource.deallocate(*ptr, BLOCK, stream) }.unwrap();
    }
    let freeing = {
        let (resource, first) = (resource.clone(), streams[0].clone());
        thread::spawn(move || {
            // SAFETY: as above.
            unsafe { resource.deallocate(again, BLOCK, &first) }.unwrap();
        })
    };
    // SAFETY: as above.
    unsafe { resource.deallocate(blocks[2], BLOCK, &streams[2]) }.unwrap();
    freeing.join().unwrap();
    let (counter, waker) = CountingWaker::new();
    let waiters = resource.memory_waiters().unwrap();
    let (id, _) = waiters.register(BLOCK, &waker);
    let watched = resource.watched_streams();
    assert!(
        watched.contains(&streams[2].id().get()),
        "the stream noted last was pruned or forgotten (events on {watched:?})"
    );
    assert!(
        counter.wakes() > 0,
        "the waiter slept through the frees issued before it arrived"
    );
    seen.note(PRUNED, !watched.contains(&streams[1].id().get()));
    waiters.remove(id, crate::resource::waiters::Leave::Cancelled);
    for stream in &streams {
        stream.synchronize_blocking().unwrap();
    }
}

#[test]
fn cuda_async_a_full_slot_pruned_while_a_stream_frees() {
    check_paths(Some(2), &[PRUNED], a_full_slot_pruned_while_a_stream_frees);
}
