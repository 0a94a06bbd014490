//! The models: steals, merges and growth racing a donor's free and its own reuse, on the
//! crate's engine (the default `#[test]`s) and on the planted copy (the `#[ignore]`d ones).

use super::*;

/// Two thieves and a donor. Stream 0's user (thread `donor`, which holds the stream's only
/// handle besides the engine's) frees two blocks on it and then drops the stream; two threads
/// on stream 1 allocate one block each, then free it. A thief finds the blocks in stream 0's
/// list (a steal), or moves the list into its own when stream 0 is idle (an idle merge), or
/// after the failed grow (a merge of every list), or finds nothing yet (out of memory).
fn two_thieves<E: Engine>(seen: &Shared<Seen>) {
    let mut s = streams(2);
    let (s1, s0) = (s.pop().unwrap(), s.pop().unwrap());
    let gpu = s0.inner.gpu.clone();
    let engine = Arc::new(E::with_chunk(2));
    let a = alloc(&*engine, &s0, "setup", seen).unwrap();
    let b = alloc(&*engine, &s0, "setup", seen).unwrap();

    let donor = {
        let engine = engine.clone();
        thread::spawn(move || {
            free(&*engine, &s0, a);
            free(&*engine, &s0, b);
            drop(s0);
        })
    };
    let thief = {
        let (engine, s1, seen) = (engine.clone(), s1.clone(), seen.clone());
        thread::spawn(move || {
            if let Some(x) = alloc(&*engine, &s1, "thief", &seen) {
                free(&*engine, &s1, x);
            }
        })
    };
    if let Some(y) = alloc(&*engine, &s1, "main", seen) {
        free(&*engine, &s1, y);
    }
    donor.join().unwrap();
    thief.join().unwrap();
    all_back(&*engine, 2, &gpu, seen);
}

/// A steal racing the donor's own reuse. Stream 0's thread frees a block and allocates again
/// on stream 0 (its own list serves it at once, if the block is still there); stream 1's
/// thread allocates (stealing it, or merging, or out of memory). A second block stays held by
/// the model until the end, so only one block is in play.
fn steal_vs_reuse<E: Engine>(seen: &Shared<Seen>) {
    let s = streams(2);
    let (s0, s1) = (s[0].clone(), s[1].clone());
    let gpu = s0.inner.gpu.clone();
    let engine = Arc::new(E::with_chunk(2));
    let a = alloc(&*engine, &s0, "setup", seen).unwrap();
    let b = alloc(&*engine, &s0, "kept", seen).unwrap();

    let owner = {
        let (engine, s0, seen) = (engine.clone(), s0.clone(), seen.clone());
        thread::spawn(move || {
            free(&*engine, &s0, a);
            if let Some(x) = alloc(&*engine, &s0, "owner", &seen) {
                free(&*engine, &s0, x);
            }
        })
    };
    if let Some(y) = alloc(&*engine, &s1, "thief", seen) {
        free(&*engine, &s1, y);
    }
    owner.join().unwrap();
    free(&*engine, &s0, b);
    all_back(&*engine, 2, &gpu, seen);
}

/// Growth racing a free and a reuse. The pool holds one block, in use on stream 0; stream 0's
/// thread frees it and allocates again; this thread allocates on stream 1 from an upstream
/// that can give one more chunk: it steals the block, or grows (the new chunk is registered
/// with every list while stream 0's thread uses its own), or merges, or finds nothing.
fn grow_vs_reuse<E: Engine>(seen: &Shared<Seen>) {
    let s = streams(2);
    let (s0, s1) = (s[0].clone(), s[1].clone());
    let gpu = s0.inner.gpu.clone();
    let engine = Arc::new(E::with_chunk(1));
    let a = alloc(&*engine, &s0, "setup", seen).unwrap();
    let upstream = GrowOnce(std::sync::atomic::AtomicBool::new(false));

    let owner = {
        let (engine, s0, seen) = (engine.clone(), s0.clone(), seen.clone());
        thread::spawn(move || {
            free(&*engine, &s0, a);
            if let Some(x) = alloc(&*engine, &s0, "owner", &seen) {
                free(&*engine, &s0, x);
            }
        })
    };
    if let Some(y) = alloc_from(&*engine, &s1, "grower", seen, &upstream) {
        free(&*engine, &s1, y);
    }
    owner.join().unwrap();
    let grown = upstream.0.load(std::sync::atomic::Ordering::Relaxed);
    seen.note(GROW, grown);
    all_back(&*engine, 1 + u64::from(grown), &gpu, seen);
}

/// Bound 4: 3 threads (the donor, a thief and the model's main thread, the other thief).
#[test]
fn two_thieves_one_donor() {
    check_paths(
        Some(4),
        &ALL_BUT_GROW,
        two_thieves::<StreamLists<FakeStream>>,
    );
}

/// Bound 5: 2 threads.
#[test]
fn steal_vs_same_stream_reuse() {
    check_paths(
        Some(5),
        &ALL_BUT_GROW,
        steal_vs_reuse::<StreamLists<FakeStream>>,
    );
}

/// Bound 5: 2 threads.
#[test]
fn grow_vs_same_stream_reuse() {
    check_paths(Some(5), &ALL, grow_vs_reuse::<StreamLists<FakeStream>>);
}

// Planted bugs: the same models against a copy of the engine with one bug switched on.

/// Sanity: the copy with no bug passes the models the real engine passes.
#[test]
#[ignore = "checks the planted copy itself; run with --ignored"]
fn planted_none_passes() {
    type E = planted::Lists<{ planted::NONE }>;
    check_paths(Some(4), &ALL_BUT_GROW, two_thieves::<E>);
    check_paths(Some(5), &ALL_BUT_GROW, steal_vs_reuse::<E>);
    check_paths(Some(5), &ALL, grow_vs_reuse::<E>);
}

/// Bug: the steal hands the block out without recording an event on the donor and making the
/// thief's stream wait on it.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_steal_unordered() {
    must_fail(
        module_path!(),
        "planted_steal_unordered",
        "not ordered behind the donor's free",
        || {
            check_paths(
                Some(5),
                &[],
                steal_vs_reuse::<planted::Lists<{ planted::STEAL_UNORDERED }>>,
            )
        },
    );
}

/// Bug: the steal takes the block from the donor's list without the donor's lock.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_steal_without_lock() {
    must_fail(
        module_path!(),
        "planted_steal_without_lock",
        "Causality violation",
        || {
            check_paths(
                Some(3),
                &[],
                two_thieves::<planted::Lists<{ planted::STEAL_UNLOCKED }>>,
            )
        },
    );
}

/// Bug: the steal records the event on the donor (and makes the thief wait on it) *before* it
/// takes the block from the donor's list: a block freed between the two is handed out with an
/// event that does not cover its free. Only some interleavings show it.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_steal_ordered_before_take() {
    must_fail(
        module_path!(),
        "planted_steal_ordered_before_take",
        "not ordered behind the donor's free",
        || {
            check_paths(
                Some(5),
                &[],
                steal_vs_reuse::<planted::Lists<{ planted::ORDER_BEFORE_TAKE }>>,
            )
        },
    );
}

/// Bug: a merge moves another stream's blocks into the caller's list without ordering the
/// caller after that stream.
#[test]
#[ignore = "planted bug: must fail"]
fn planted_merge_unordered() {
    must_fail(
        module_path!(),
        "planted_merge_unordered",
        "not ordered behind the donor's free",
        || {
            check_paths(
                Some(3),
                &[],
                two_thieves::<planted::Lists<{ planted::MERGE_UNORDERED }>>,
            )
        },
    );
}
