//! The command-line tools of [streamalloc], apart from the library so that a
//! library user's dependencies stay the library's own (argument parsing, CSV, progress bars and
//! JSON are the tools'):
//!
//! - `streamalloc-replay` replays an RMM-format allocation log against one of the crate's
//!   resources and reports wall time, peak memory, failures and fragmentation (`replay`);
//! - `streamalloc-picture` draws a log, a recorded history or a snapshot as one self-contained
//!   HTML page (`picture`; `streamalloc-replay --picture` draws a replay with it).
//!
//! Each binary (`src/bin/`) only calls its `*_main` here; the code is in this library so that
//! both tools share the picture without compiling it twice.

#![warn(missing_docs, rust_2018_idioms)]
#![deny(unsafe_op_in_unsafe_fn)]

mod picture;
mod replay;

use std::process::ExitCode;

/// `streamalloc-replay`: parses its command line from the process's arguments, runs, and
/// returns the exit code (0 done; 1 an error; 2 a malformed log or bad arguments).
pub fn replay_main() -> ExitCode {
    replay::main()
}

/// `streamalloc-picture`: parses its command line from the process's arguments, draws, and
/// returns the exit code (0 done; 1 the input cannot be read or the output written; 2 bad
/// arguments).
pub fn picture_main() -> ExitCode {
    picture::cli::main()
}
