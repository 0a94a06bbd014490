//! `streamalloc-picture`: turns a memory trace into one self-contained HTML file that any
//! browser opens with no network: memory over time (in use, per stream), the address space at
//! the peak (blocks coloured by stream and state: where the fragmentation is), and the largest
//! allocations alive at the peak.
//!
//! ```text
//! streamalloc-picture server-log.csv -o memory.html       # an RMM-format log (RMM's or ours)
//! streamalloc-picture history.json -o memory.html         # HistoryAdaptor::history() as JSON
//! streamalloc-picture snapshot.json -o memory.html        # a resource's snapshot() as JSON
//! ```
//!
//! A log says what was allocated, not what the allocator held: its address map shows the live
//! allocations at the peak and, between them, memory that may be free or not held at all. For
//! the allocator's own view (chunks, free blocks by stream, reserved memory over time), replay
//! the log against a resource: `streamalloc-replay log.csv --picture memory.html`. A snapshot
//! has no timeline: it is one moment.
//!
//! Prints the output's path and the peak. Exit codes: 0 done; 1 the input cannot be read or
//! is refused (a snapshot whose blocks do not tile its chunks, sizes or addresses past
//! `u64::MAX`: the message names the line, event or block), or the output cannot be written;
//! 2 bad arguments.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

use crate::picture;

/// Turns an RMM-format CSV log, a recorded history (JSON) or a snapshot (JSON) into one
/// self-contained HTML picture.
#[derive(Debug, Parser)]
#[command(name = "streamalloc-picture", version)]
struct Args {
    /// The input: a CSV log with the header Thread,Time,Action,Pointer,Size,Stream, or JSON
    /// (a history or a snapshot).
    input: PathBuf,
    /// The HTML file to write [default: the input's name with `.html`].
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// The page's title.
    #[arg(long)]
    title: Option<String>,
}

/// The tool: parses the command line, draws; returns the exit code.
pub(crate) fn main() -> ExitCode {
    let args = Args::parse();
    let output = args
        .output
        .clone()
        .unwrap_or_else(|| args.input.with_extension("html"));
    match picture::render_file(&args.input, &output, args.title) {
        Ok(data) => {
            println!("wrote {}", output.display());
            println!(
                "peak in use: {} bytes; events: {}",
                data["peak_in_use"], data["events"]
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("streamalloc-picture: {e}");
            ExitCode::from(1)
        }
    }
}
