//! `streamalloc-replay`: replays a memory-event log in RMM's CSV format (what RMM's
//! `logging_resource_adaptor` and this crate's `LoggingAdaptor` write) against one of this
//! crate's resources, and reports the wall time, peak memory, failed allocations and
//! fragmentation.
//!
//! ```text
//! streamalloc-replay log.csv --resource arena --arena-size 8GiB
//! streamalloc-replay log.csv --resource pool --initial 1GiB --maximum 16GiB
//! ```
//!
//! # The log
//!
//! `Thread,Time,Action,Pointer,Size,Stream` (the columns found by name in the header; `Time`
//! is ignored and `Stream` may be missing). `Action` is `allocate`, `free` or `allocate
//! failure`; `Pointer` is hex (`0x7f3a00000000`, `7f3a00000000`, or `(nil)` for null); `Size`
//! is decimal bytes. `Thread` and `Stream` are identifiers, compared as text: RMM writes
//! numbers and stream handles, this crate's adaptor stream ids. Each distinct thread of the log
//! is replayed by a thread of ours, each distinct stream by a stream of ours (RMM's default
//! stream, `0x0`, is a stream like any other here). A log with more threads than
//! `--max-threads` (4096 by default) is refused before anything runs (exit 1); so is a replay
//! whose threads the system cannot all start (its limit on threads or memory): the threads
//! started are sent home and the tool exits 1.
//!
//! A line that cannot be replayed stops the tool before anything runs, with its line number and
//! what is wrong, and exit code 2: a wrong number of fields, an unknown action, a bad number, an
//! `allocate` of a pointer still live, a `free` whose size differs from its allocation's, or a
//! `free` of a pointer no earlier line allocated (`--ignore-unmatched` skips those instead: a
//! log started while memory was already allocated has them).
//!
//! # How frees find their allocations, across threads
//!
//! Before replaying, one pass over the log in its order pairs each `free` with the `allocate`
//! that returned its pointer most recently (a pointer may be handed out many times), and gives
//! each allocation a number. During the replay, a shared table maps that number to the pointer
//! *our* resource returned, so a thread can free what another thread allocated.
//!
//! `--order log` (the default) is RMM's replay benchmark: each event waits for its turn in the
//! log's global order (a counter; the thread whose event is next is woken, with a short spin
//! before it parks), so the replay reproduces the log's interleaving exactly: the same memory
//! is live at every step, and the numbers are deterministic. Threads never run allocator code
//! at the same time, so this measures the allocator's decisions more than its scalability.
//!
//! `--order threads` lets every thread run through its own events freely, in its own order; a
//! `free` whose allocation has not been replayed yet waits for it (the allocation always comes
//! earlier in the log, so this cannot deadlock). Contention is real, but memory peaks may differ
//! from the log's.
//!
//! An `allocate failure` line is tried again (RMM's replay skips them): if it succeeds here the
//! memory is freed at once, so the replay keeps the log's memory use (it counts in the peak in
//! use for that instant: the resource held it, and may have grown for it). A replayed `allocate` that
//! fails here is counted, and its `free` is skipped. Allocations the log never frees are freed
//! at the end and reported.
//!
//! # What it prints
//!
//! Wall time of the replay (threads started and waiting at a barrier before the clock starts);
//! peak in use (the most bytes live at once, as the log's sizes add up, a retried failure that
//! succeeded included); peak reserved (the most
//! bytes the resource held from the device, counted by a wrapper around its upstream; for
//! `cuda-async`, the driver pool's reserve at the end); failed allocations; and fragmentation,
//! defined as `1 - peak in use / peak reserved`: the share of the memory taken from the device
//! at the peak that the allocator could not put to use (rounding, free blocks too small or on
//! the wrong stream, slack).
//!
//! `--picture memory.html` also writes the picture of the replay (what `streamalloc-picture`
//! draws from the log, plus the bytes the resource reserved from the device over time, and,
//! as the address space, the resource's own snapshot after the log's peak event: its chunks,
//! and its free blocks by stream).
//!
//! Exit codes: 0 done; 1 an error (the file cannot be read, the device or resource cannot be
//! made, the log has more threads than `--max-threads` or a replay thread cannot be started, a
//! free was refused by the resource); 2 a malformed log or bad arguments.

//!
//! # The code
//!
//! - `args`: the command line; `log`: the log parsed and checked, frees paired with their
//!   allocations; `resources`: the resource built over a counter of what it reserves, and the
//!   device;
//! - `schedule`: the order between threads (the log's turn, or a free waiting for its
//!   allocation); `threads`: the replay threads and what they share; `watch`: what `--picture`
//!   records, and the page; `report`: what the tool prints.

mod args;
mod log;
mod report;
mod resources;
mod schedule;
mod threads;
mod watch;

use std::process::ExitCode;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

use clap::Parser;
use indicatif::ProgressBar;
use streamalloc::Stream;

use crate::picture;
use args::{Args, Order};
use log::{parse_log, ParseError};
use resources::{build, open_device};
use threads::replay;
use watch::Watch;

/// The tool: parses the command line, replays, reports; returns the exit code.
pub(crate) fn main() -> ExitCode {
    let args = Args::parse();
    let log = match parse_log(&args.log, args.ignore_unmatched) {
        Ok(log) => log,
        Err(ParseError::Malformed(m)) => {
            eprintln!("streamalloc-replay: {}: {m}", args.log.display());
            return ExitCode::from(2);
        }
        Err(ParseError::Io(e)) => {
            eprintln!("streamalloc-replay: cannot read the log: {e}");
            return ExitCode::from(1);
        }
    };
    if log.threads.len() > args.max_threads as usize {
        eprintln!(
            "streamalloc-replay: {}: the log has {} threads, and the replay starts one per thread of the log: at most {} (--max-threads)",
            args.log.display(),
            log.threads.len(),
            args.max_threads
        );
        return ExitCode::from(1);
    }
    let device = match open_device(&args) {
        Ok(device) => device,
        Err(e) => {
            eprintln!("streamalloc-replay: cannot open the device: {e}");
            return ExitCode::from(1);
        }
    };
    println!("log: {}", args.log.display());
    println!("device: {device}");
    let (built, description) = match build(&args, &device) {
        Ok(built) => built,
        Err(e) => {
            eprintln!(
                "streamalloc-replay: cannot make the {} resource: {e}",
                args.resource
            );
            return ExitCode::from(1);
        }
    };
    println!("resource: {description}");
    let streams: Vec<Stream> = match (0..log.streams.max(1))
        .map(|_| device.create_stream())
        .collect()
    {
        Ok(streams) => streams,
        Err(e) => {
            eprintln!("streamalloc-replay: cannot create streams: {e}");
            return ExitCode::from(1);
        }
    };
    println!(
        "events: {} ({} threads, {} streams, order: {})",
        log.events,
        log.threads.len(),
        log.streams,
        match args.order {
            Order::Log => "log",
            Order::Threads => "threads",
        }
    );
    // `--picture`: the log read again as the picture reads it (its events line up with the
    // replay's, one per line), and the peak found before the replay so that the snapshot is
    // taken there.
    let trace = match &args.picture {
        Some(_) => match picture::read::read(&args.log, &ProgressBar::hidden()) {
            Ok(picture::read::Input::Trace(trace)) => Some(trace),
            Ok(picture::read::Input::Snapshot(_)) => None,
            Err(e) => {
                eprintln!("streamalloc-replay: cannot read the log for the picture: {e}");
                return ExitCode::from(1);
            }
        },
        None => None,
    };
    let snapshot_at = match trace.as_ref().map(picture::model::peak_index).transpose() {
        Ok(at) => at.flatten().map(|i| i as u64),
        Err(e) => {
            eprintln!(
                "streamalloc-replay: cannot draw {}: {e}",
                args.log.display()
            );
            return ExitCode::from(1);
        }
    };
    let watch = trace.as_ref().map(|_| Watch {
        reserved_now: built.counted().map(|c| &c.current),
        reserved: (0..log.events).map(|_| AtomicU64::new(0)).collect(),
        snapshot_at,
        snapshot: Mutex::new(None),
        allocs: &log.allocs,
    });
    let (outcome, watch) = match replay(&log, built.resource(), &streams, args.order, watch) {
        Ok(replayed) => replayed,
        Err(e) => {
            eprintln!("streamalloc-replay: {e}");
            return ExitCode::from(1);
        }
    };
    for stream in &streams {
        let _ = stream.synchronize_blocking();
    }
    report::print(&log, &outcome, &built);
    if let (Some(path), Some(trace), Some(watch)) = (&args.picture, trace, watch) {
        match watch::write_picture(path, &args.log, trace, watch, &streams, &description) {
            Ok(()) => println!("picture: {}", path.display()),
            Err(e) => {
                eprintln!("streamalloc-replay: cannot write the picture: {e}");
                return ExitCode::from(1);
            }
        }
    }
    drop(built);
    if outcome.free_errors > 0 {
        eprintln!(
            "streamalloc-replay: {} free(s) failed; the first: {}",
            outcome.free_errors,
            outcome.first_error.unwrap_or_default()
        );
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}
