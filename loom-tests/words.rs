//! A model of the completion words' bookkeeping (`WordSlots` in src/device/word_slots.rs): a
//! stream's word goes to a new stream only after the GPU's last write to it for the old one
//! has landed.
//!
//! The GPU is a thread that stores the old stream's two queued values into its word, in
//! order, at any point (two, so that a settle that took any landed write for the last one
//! would be caught); one host thread drops the old stream (retires its slot), another makes a new stream
//! (takes a slot, or makes one, and sets its word to "nothing reached", as `Words::word` does).
//! What must hold in every interleaving: once all three are done, the new stream's word still
//! says "nothing reached". A late write landing on it would make the new stream's first event
//! read complete while its work still runs.
//!
//! The words are loom atomics, the bookkeeping the crate's own code behind the crate's mutex.
//! Threads: 3; bound 3.

use loom::sync::atomic::AtomicU32;
use loom::thread;

use super::{check_paths, must_fail, Seen, Shared};
use crate::device::word_slots::{planted, WordSlots};
use crate::sync::{Arc, Mutex, Ordering};

/// What `Words::word` writes into a word it hands out.
const UNREACHED: u32 = u32::MAX;
/// The old stream's queued values: its first and second watched events.
const FIRST: u32 = 0;
const LAST: u32 = 1;

struct Device {
    slots: Mutex<WordSlots>,
    words: [AtomicU32; 2],
}

impl Device {
    /// `Words::word`: a slot (settling with the words' values), its word set to unreached.
    fn word(&self) -> u32 {
        let mut slots = self.slots.lock();
        let slot = match slots.take(|s| self.words[s as usize].load(Ordering::Acquire)) {
            Some(slot) => slot,
            None => slots.add(1),
        };
        self.words[slot as usize].store(UNREACHED, Ordering::Release);
        slot
    }
}

fn old_stream_gone_while_its_write_is_pending(seen: &Shared<Seen>) {
    let device = Arc::new(Device {
        slots: Mutex::new(WordSlots::default()),
        words: [AtomicU32::new(UNREACHED), AtomicU32::new(UNREACHED)],
    });
    // The old stream holds slot 0 and has queued the writes of FIRST and LAST to it.
    let old = device.word();
    assert_eq!(old, 0);
    let d = device.clone();
    let gpu = thread::spawn(move || {
        d.words[old as usize].store(FIRST, Ordering::Release);
        d.words[old as usize].store(LAST, Ordering::Release);
    });
    let d = device.clone();
    let drop_old = thread::spawn(move || d.slots.lock().retire(old, LAST));
    let d = device.clone();
    let make_new = thread::spawn(move || d.word());
    gpu.join().unwrap();
    drop_old.join().unwrap();
    let new = make_new.join().unwrap();
    seen.note("reused the old word", new == old);
    seen.note("made a new word", new != old);
    assert_eq!(
        device.words[new as usize].load(Ordering::Acquire),
        UNREACHED,
        "the old stream's late write reached the new stream's word {new}"
    );
}

#[test]
fn a_word_goes_to_a_new_stream_only_after_its_last_write() {
    check_paths(
        Some(3),
        &["reused the old word", "made a new word"],
        old_stream_gone_while_its_write_is_pending,
    );
}

#[test]
#[ignore = "planted bug: loom must catch it"]
fn planted_word_reused_at_once() {
    must_fail(
        module_path!(),
        "planted_word_reused_at_once",
        "late write reached the new stream's word",
        || {
            planted::REUSED_AT_ONCE.store(true, std::sync::atomic::Ordering::Relaxed);
            check_paths(Some(3), &[], old_stream_gone_while_its_write_is_pending);
        },
    );
}
