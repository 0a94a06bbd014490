//! What the tool prints after the replay: counts, wall time, peaks and fragmentation.

use super::args::fmt_bytes;
use super::log::Log;
use super::resources::Built;
use super::threads::Outcome;

/// Prints the replay's numbers (stdout).
pub(super) fn print(log: &Log, outcome: &Outcome, built: &Built) {
    println!("allocations: {}", log.alloc_lines);
    println!("failed allocations: {}", outcome.failed);
    println!("frees: {}", log.free_lines);
    println!(
        "skipped frees: {} (their allocation failed here)",
        outcome.skipped_frees
    );
    if log.unmatched_skipped > 0 {
        println!("unmatched frees skipped: {}", log.unmatched_skipped);
    }
    println!(
        "log allocation failures: {} (failed here too: {})",
        log.fail_lines, outcome.fail_lines_failed
    );
    println!(
        "leaked: {} allocation(s), {} bytes (freed after the replay)",
        outcome.leaked, outcome.leaked_bytes
    );
    println!("wall time: {:.3} ms", outcome.wall.as_secs_f64() * 1e3);
    println!(
        "peak in use: {} ({} bytes)",
        fmt_bytes(outcome.peak_live),
        outcome.peak_live
    );
    match built.peak_reserved() {
        Some(peak) => {
            println!("peak reserved: {} ({peak} bytes)", fmt_bytes(peak));
            if peak > 0 {
                let fragmentation = 1.0 - outcome.peak_live as f64 / peak as f64;
                println!(
                    "fragmentation: {:.1}% (1 - peak in use / peak reserved)",
                    fragmentation * 100.0
                );
            } else {
                println!("fragmentation: n/a (nothing reserved)");
            }
        }
        None => {
            if let Built::CudaAsync(r) = &built {
                match r.reserved_bytes() {
                    Ok(bytes) => println!(
                        "peak reserved: n/a (the driver pool reserves {} at the end)",
                        fmt_bytes(bytes as u64)
                    ),
                    Err(e) => println!("peak reserved: n/a ({e})"),
                }
            }
            println!("fragmentation: n/a (no peak reserved)");
        }
    }
    if let Built::Arena(arena) = &built {
        let stats = arena.stats();
        println!(
            "arena: {} defragmentation(s), {} grow(s)",
            stats.defragments, stats.grows
        );
    }
}
