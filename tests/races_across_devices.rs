//! The race detector across simulated devices: ordering that passes through another device's
//! event (a chain of waits), and a peer copy's read of the other device's memory. Each device
//! reports only the races of operations queued on its own streams; a peer copy's race is the
//! copying device's.

use streamalloc::{Device, DevicePtr, RaceDetection, RaceKind, SimConfig, Stream};

const N: usize = 1 << 10;

fn device() -> Device {
    Device::simulated(SimConfig {
        race_detection: RaceDetection::Record,
        ..SimConfig::default()
    })
}

/// Two devices, a stream on each, and `N` u32s of memory on each.
struct Pair {
    d0: Device,
    d1: Device,
    s0: Stream,
    s1: Stream,
    p0: DevicePtr,
    p1: DevicePtr,
}

fn pair() -> Pair {
    let (d0, d1) = (device(), device());
    let (s0, s1) = (d0.create_stream().unwrap(), d1.create_stream().unwrap());
    let (p0, p1) = (d0.malloc(N * 4).unwrap(), d1.malloc(N * 4).unwrap());
    Pair {
        d0,
        d1,
        s0,
        s1,
        p0,
        p1,
    }
}

/// A (a stream of device 0) writes its memory, C (device 1) waits for A, and B (another stream
/// of device 0) writes the same memory, after a wait for C when `wait_for_c`.
fn chain(wait_for_c: bool) -> Pair {
    let pair = pair();
    let b = pair.d0.create_stream().unwrap();
    // SAFETY: `p0` holds `N` u32s of device 0 (never freed while the test runs).
    unsafe { pair.s0.fill_u32(pair.p0, 1, N) }.unwrap();
    let a_done = pair.s0.record().unwrap();
    pair.s1.wait(&a_done).unwrap();
    // SAFETY: `p1` holds `N` u32s of device 1.
    unsafe { pair.s1.fill_u32(pair.p1, 2, N) }.unwrap();
    let c_done = pair.s1.record().unwrap();
    if wait_for_c {
        b.wait(&c_done).unwrap();
    }
    // SAFETY: as above.
    unsafe { b.fill_u32(pair.p0, 3, N) }.unwrap();
    b.synchronize_blocking().unwrap();
    pair
}

#[test]
fn a_chain_through_another_device_orders() {
    let pair = chain(true);
    assert_eq!(pair.d0.races(), vec![], "device 0");
    assert_eq!(pair.d1.races(), vec![], "device 1");
}

#[test]
fn a_chain_without_its_last_wait_races_on_the_writing_device() {
    let pair = chain(false);
    let races = pair.d0.races();
    assert_eq!(races.len(), 1, "{races:#?}");
    assert_eq!(races[0].kind, RaceKind::WriteAfterWrite);
    assert_eq!(races[0].ptr, pair.p0);
    assert_eq!(pair.d1.races(), vec![], "device 1");
}

/// What the host saw complete on device 1 (an event that waited for device 0's work) orders
/// later work on device 0 too.
#[test]
fn the_host_seeing_another_devices_event_orders() {
    let pair = pair();
    let b = pair.d0.create_stream().unwrap();
    // SAFETY: `p0` holds `N` u32s of device 0.
    unsafe { pair.s0.fill_u32(pair.p0, 1, N) }.unwrap();
    pair.s1.wait(&pair.s0.record().unwrap()).unwrap();
    pair.s1.record().unwrap().synchronize_blocking().unwrap();
    // SAFETY: as above.
    unsafe { b.fill_u32(pair.p0, 3, N) }.unwrap();
    b.synchronize_blocking().unwrap();
    assert_eq!(pair.d0.races(), vec![], "device 0");
    assert_eq!(pair.d1.races(), vec![], "device 1");
}

/// Device 0 writes its memory; device 1 copies it, after a wait for the write when `wait`.
fn peer_copy(wait: bool) -> Pair {
    let pair = pair();
    // SAFETY: `p0` holds `N` u32s of device 0.
    unsafe { pair.s0.fill_u32(pair.p0, 7, N) }.unwrap();
    let written = pair.s0.record().unwrap();
    if wait {
        pair.s1.wait(&written).unwrap();
    }
    // SAFETY: both hold `N` u32s on their devices.
    unsafe { pair.s1.copy_peer(pair.p1, pair.p0, &pair.d0, N * 4) }.unwrap();
    pair.s1.synchronize_blocking().unwrap();
    pair
}

#[test]
fn a_peer_copy_not_ordered_after_the_sources_write_races_on_the_copying_device() {
    let pair = peer_copy(false);
    let races = pair.d1.races();
    assert_eq!(races.len(), 1, "{races:#?}");
    assert_eq!(races[0].kind, RaceKind::ReadAfterWrite);
    assert_eq!(races[0].ptr, pair.p0);
    assert_eq!(races[0].at.op, "copy_peer");
    assert_eq!(races[0].at.stream, Some(pair.s1.id()));
    assert_eq!(races[0].earlier.stream, Some(pair.s0.id()));
    assert_eq!(pair.d0.races(), vec![], "device 0");
}

#[test]
fn a_peer_copy_after_a_wait_for_the_sources_write_is_clean() {
    let pair = peer_copy(true);
    assert_eq!(pair.d0.races(), vec![], "device 0");
    assert_eq!(pair.d1.races(), vec![], "device 1");
}

/// A copy ordered only through a third device's event (device 1 waits for device 2, which
/// waited for device 0's write) is ordered too.
#[test]
fn a_peer_copy_ordered_through_a_third_device_is_clean() {
    let pair = pair();
    let d2 = device();
    let s2 = d2.create_stream().unwrap();
    // SAFETY: `p0` holds `N` u32s of device 0.
    unsafe { pair.s0.fill_u32(pair.p0, 7, N) }.unwrap();
    s2.wait(&pair.s0.record().unwrap()).unwrap();
    pair.s1.wait(&s2.record().unwrap()).unwrap();
    // SAFETY: both hold `N` u32s on their devices.
    unsafe { pair.s1.copy_peer(pair.p1, pair.p0, &pair.d0, N * 4) }.unwrap();
    pair.s1.synchronize_blocking().unwrap();
    assert_eq!(pair.d0.races(), vec![], "device 0");
    assert_eq!(pair.d1.races(), vec![], "device 1");
    assert_eq!(d2.races(), vec![], "device 2");
}

/// Logs written through `tracing` in a test, read back as text.
#[derive(Clone, Default)]
struct Logs(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `note_allocation` and `note_free` given another device's stream cannot reach the detector
/// (the stream has no clock there); they must say so, once per call, rather than drop the note
/// silently (a review found the detector missing such notes with nothing logged). A note on
/// the device's own stream logs nothing.
#[test]
fn a_race_note_with_another_devices_stream_is_warned_of() {
    let p = pair();
    let logs = Logs::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer({
            let logs = logs.clone();
            move || logs.clone()
        })
        .with_ansi(false)
        .finish();
    tracing::subscriber::with_default(subscriber, || {
        p.d0.note_allocation(p.p0, 1024, &p.s0);
        p.d0.note_free(p.p0, 1024, &p.s0);
        assert!(
            logs.0.lock().unwrap().is_empty(),
            "a note on its own stream warned"
        );
        p.d0.note_allocation(p.p0, 1024, &p.s1);
        p.d0.note_free(p.p0, 1024, &p.s1);
    });
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    let warnings: Vec<&str> = text.lines().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warnings.len(), 2, "one warning per note: {text}");
    for (line, hook) in warnings.iter().zip(["note_allocation", "note_free"]) {
        assert!(line.contains(hook), "{hook} not named: {line}");
        assert!(line.contains("another device"), "{line}");
        assert!(
            line.contains(&format!("stream_device={}", p.d1.id())),
            "the stream's device not named: {line}"
        );
    }
}
