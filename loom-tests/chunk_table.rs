//! The chunk table's sequence lock (`src/resource/stream_ordered/chunks.rs`): every free looks
//! up its chunk's shard there with no lock, while a growth or a trim changes the table in place.
//!
//! What must hold in every interleaving: a chunk that is in the table throughout is always
//! found, with its shard, whatever a change does around it (entries shifted up by an insert
//! before it, down by a removal, the whole array moved into a larger one). The reader keeps
//! only an answer read while the sequence number was even and unchanged; the planted bug keeps
//! whatever it read.
//!
//! Threads: 2 per model (the writer adds or removes a chunk before the one looked up, or adds
//! one to a full array; the reader looks it up once); bound 2.

use loom::thread;

use super::{check, must_fail};
use crate::resource::stream_ordered::ChunkTableForLoom as ChunkTable;
use crate::sync::Arc;

/// The chunk that stays: `[A, A + 4 KiB)` in shard 7.
const A: u64 = 0x10_0000;

/// What the writer does while the reader looks A up.
#[derive(Clone, Copy)]
enum Change {
    /// Adds a chunk below A: A's entry shifts up.
    Insert,
    /// Removes the chunk below A (added before): A's entry shifts down.
    Remove,
    /// Adds a chunk below A to a full array (under loom the first holds 2): the table moves
    /// into a larger array.
    Grow,
}

fn lookup_vs_change(change: Change) {
    let table = Arc::new(ChunkTable::new());
    table.add(A, 0x1000, 7);
    match change {
        Change::Insert => {}
        Change::Remove => table.add(0x1000, 0x1000, 1),
        Change::Grow => table.add(A + 0x10_0000, 0x1000, 2),
    }
    let writer = {
        let table = table.clone();
        thread::spawn(move || match change {
            Change::Insert | Change::Grow => table.add(0x1000, 0x1000, 1),
            Change::Remove => {
                table.remove(0x1000);
            }
        })
    };
    // The reader on a thread of its own too: with the main thread reading and the writer's
    // first step a lock, loom 0.7 explored one execution only (see the README).
    let reader = thread::spawn(move || {
        assert_eq!(
            table.shard_of(A + 0x800, 0x100),
            Some(7),
            "a chunk in the table throughout was not found"
        );
    });
    writer.join().unwrap();
    reader.join().unwrap();
}

#[test]
fn a_lookup_during_an_insert_finds_its_chunk() {
    check(Some(2), || lookup_vs_change(Change::Insert));
}

#[test]
fn a_lookup_during_a_removal_finds_its_chunk() {
    check(Some(2), || lookup_vs_change(Change::Remove));
}

#[test]
fn a_lookup_while_the_table_moves_to_a_larger_array_finds_its_chunk() {
    check(Some(2), || lookup_vs_change(Change::Grow));
}

/// Bug: the reader keeps an answer read during a change (no second look at the number).
#[test]
#[ignore = "planted bug: must fail"]
fn planted_torn_chunk_reads() {
    use crate::resource::stream_ordered::planted;
    use std::sync::atomic::Ordering::Relaxed;
    must_fail(
        module_path!(),
        "planted_torn_chunk_reads",
        "a chunk in the table throughout was not found",
        || {
            planted::TORN_CHUNK_READS.store(true, Relaxed);
            check(Some(2), || lookup_vs_change(Change::Insert));
        },
    );
}
