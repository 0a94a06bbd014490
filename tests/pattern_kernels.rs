//! The pattern kernels (`Stream::fill_pattern_u32`, `Stream::count_mismatches_u32`), on every
//! device: what the fill writes is `Stream::pattern_u32` word for word, the count finds exactly
//! the words that differ and adds to its counter, and bad input is refused.
//!
//! On a GPU they run the kernels of `kernels/streamalloc.ptx` (compiled from
//! `kernels/streamalloc.cu` by `kernels/build.sh`): a PTX file older than the pattern kernels
//! fails them with `cuModuleGetFunction(streamalloc_fill_pattern_u32)`.

mod common;

use common::{devices, label, read_u32};
use streamalloc::{DevicePtr, Error, FaultKind, RaceDetection, SimConfig, Stream};

const WORDS: usize = 10_000;

fn counter_value(stream: &Stream, counter: DevicePtr) -> u64 {
    let words = read_u32(stream, counter, 2);
    u64::from(words[0]) | (u64::from(words[1]) << 32)
}

#[test]
fn fill_writes_the_pattern_and_the_count_finds_exactly_the_mismatches() {
    for device in devices() {
        let l = label(&device);
        let s = device.create_stream().unwrap();
        let buf = device.malloc(WORDS * 4).unwrap();
        let counter = device.malloc(8).unwrap();
        // SAFETY: both allocations are live until freed at the end, after a synchronize.
        unsafe {
            s.memset_d8(counter, 0, 8).unwrap();
            s.fill_pattern_u32(buf, 42, WORDS).unwrap();
        }
        let host = read_u32(&s, buf, WORDS);
        for (i, &v) in host.iter().enumerate() {
            assert_eq!(v, Stream::pattern_u32(42, i as u64), "{l}: word {i}");
        }

        // SAFETY: as above.
        unsafe { s.count_mismatches_u32(buf, 42, WORDS, counter) }.unwrap();
        assert_eq!(counter_value(&s, counter), 0, "{l}: the right seed");

        // Another seed: every word whose value differs is counted (and added to the 0).
        let differ = (0..WORDS as u64)
            .filter(|&i| Stream::pattern_u32(42, i) != Stream::pattern_u32(43, i))
            .count() as u64;
        assert!(differ > WORDS as u64 - 5, "{l}: unrelated sequences");
        // SAFETY: as above.
        unsafe { s.count_mismatches_u32(buf, 43, WORDS, counter) }.unwrap();
        assert_eq!(counter_value(&s, counter), differ, "{l}: another seed");

        // Seven words overwritten in the middle: exactly seven more.
        let at = 5_000;
        let value = (0..).find(|v| (at..at + 7).all(|i| Stream::pattern_u32(42, i) != *v));
        // SAFETY: words at..at+7 lie inside `buf`.
        unsafe {
            s.memset_d32(buf.offset(at as usize * 4), value.unwrap(), 7)
                .unwrap();
            s.count_mismatches_u32(buf, 42, WORDS, counter).unwrap();
        }
        assert_eq!(counter_value(&s, counter), differ + 7, "{l}: seven planted");

        // A prefix is checked as its own buffer: the pattern depends on the index only.
        // SAFETY: as above.
        unsafe {
            s.memset_d8(counter, 0, 8).unwrap();
            s.count_mismatches_u32(buf, 42, at as usize, counter)
                .unwrap();
        }
        assert_eq!(counter_value(&s, counter), 0, "{l}: the clean prefix");

        s.synchronize_blocking().unwrap();
        // SAFETY: nothing queued uses them any more.
        unsafe {
            device.free(buf).unwrap();
            device.free(counter).unwrap();
        }
    }
}

#[test]
fn bad_input_is_refused() {
    for device in devices() {
        let l = label(&device);
        let s = device.create_stream().unwrap();
        let buf = device.malloc(1024).unwrap();
        // SAFETY: nothing is queued (each call is refused before it is), or zero words.
        unsafe {
            assert!(
                matches!(
                    s.count_mismatches_u32(buf, 1, 16, buf.offset(4)),
                    Err(Error::InvalidArgument { .. })
                ),
                "{l}: an unaligned counter"
            );
            assert!(
                matches!(
                    s.fill_pattern_u32(buf, 1, usize::MAX),
                    Err(Error::InvalidSize { .. })
                ),
                "{l}: a count that overflows"
            );
            s.fill_pattern_u32(buf, 1, 0).unwrap();
            s.count_mismatches_u32(buf, 1, 0, buf).unwrap();
        }
        s.synchronize_blocking().unwrap();
        // SAFETY: nothing queued uses it.
        unsafe { device.free(buf) }.unwrap();
    }
}

#[test]
fn launch_faults_and_unordered_counters_are_reported_on_the_simulated_device() {
    let config = SimConfig {
        race_detection: RaceDetection::Error,
        ..SimConfig::default()
    };
    let device = streamalloc::Device::simulated(config);
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let buf = device.malloc(4096).unwrap();
    let counter = device.malloc(8).unwrap();
    let faults = device.faults().unwrap();
    faults.fail_next(FaultKind::Launch);
    // SAFETY: live allocations, freed after a synchronize below.
    let err = unsafe { a.fill_pattern_u32(buf, 7, 1024) }.unwrap_err();
    assert!(err.to_string().contains("cuLaunchKernel"), "{err}");
    // SAFETY: as above.
    unsafe {
        a.memset_d8(counter, 0, 8).unwrap();
        a.fill_pattern_u32(buf, 7, 1024).unwrap();
        a.count_mismatches_u32(buf, 7, 1024, counter).unwrap();
    }
    // B has not waited for A: its check reads what A wrote and adds to the counter A added
    // to, neither ordered after A. Refused as a race; once B waits for A, it is fine.
    // SAFETY: as above.
    let unordered = unsafe { b.count_mismatches_u32(buf, 7, 1024, counter) };
    assert!(
        matches!(unordered, Err(Error::StreamRace(_))),
        "{unordered:?}"
    );
    b.wait(&a.record().unwrap()).unwrap();
    // SAFETY: as above.
    unsafe { b.count_mismatches_u32(buf, 7, 1024, counter) }.unwrap();
    assert_eq!(counter_value(&b, counter), 0);
    a.synchronize_blocking().unwrap();
    // SAFETY: nothing queued uses them any more.
    unsafe {
        device.free(buf).unwrap();
        device.free(counter).unwrap();
    }
}

/// The host's definition against values computed by the CUDA source's `streamalloc_pattern`
/// (compiled for the host with g++), so the two cannot drift apart unseen.
#[test]
fn the_pattern_matches_the_cuda_source() {
    assert_eq!(Stream::pattern_u32(42, 0), 2_453_429_427);
    assert_eq!(Stream::pattern_u32(42, 9_999), 3_361_804_772);
    assert_eq!(Stream::pattern_u32(u64::MAX, 123_456_789), 2_619_912_228);
}
