//! The picture of a memory trace: one self-contained HTML file with memory over time (in use,
//! per stream, reserved when known), the address space at the peak (blocks coloured by stream
//! and state) and the largest allocations alive at the peak.
//!
//! Used by two tools: `streamalloc-picture` (`cli`), and `streamalloc-replay --picture`.
//!
//! - `read`: the inputs (an RMM-format CSV log, a history as JSON, a snapshot as JSON);
//! - `model`: what the page shows, computed from them;
//! - `svg`: the two drawings; `html`: the page.

pub(crate) mod cli;
pub(crate) mod html;
pub(crate) mod model;
pub(crate) mod read;
pub(crate) mod svg;

use std::io::IsTerminal;
use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};

/// A progress bar on stderr for jobs of at least `min` units, hidden when stderr is not a
/// terminal.
pub(crate) fn bar(length: u64, min: u64, message: &'static str, template: &str) -> ProgressBar {
    if length < min || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(length).with_message(message);
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// Reads `input` and writes its picture to `output`. Returns the picture's numbers (as the
/// page embeds them).
pub(crate) fn render_file(
    input: &Path,
    output: &Path,
    title: Option<String>,
) -> Result<serde_json::Value, String> {
    let size = std::fs::metadata(input).map_or(0, |m| m.len());
    let reading = bar(
        size,
        8 << 20,
        "reading",
        "{msg} [{bar:40}] {bytes}/{total_bytes} ({eta})",
    );
    let input_read = read::read(input, &reading)?;
    let name = input.file_name().map_or_else(
        || input.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let picture = match input_read {
        read::Input::Trace(trace) => {
            let computing = bar(
                2 * trace.events.len() as u64,
                400_000,
                "computing",
                "{msg} [{bar:40}] {human_pos}/{human_len} ({eta})",
            );
            model::from_trace(
                &trace,
                title.unwrap_or_else(|| format!("Memory of {name}")),
                None,
                &computing,
            )
            .map_err(|e| format!("{}: {e}", input.display()))?
        }
        read::Input::Snapshot(snapshot) => model::from_snapshot(
            &snapshot,
            title.unwrap_or_else(|| format!("Snapshot of a {} ({name})", snapshot.resource)),
        ),
    };
    write_page(&picture, &input.display().to_string(), output)?;
    Ok(html::data(&picture))
}

/// Writes the page of `picture` to `output`.
pub(crate) fn write_page(
    picture: &model::Picture,
    source: &str,
    output: &Path,
) -> Result<(), String> {
    std::fs::write(output, html::page(picture, source))
        .map_err(|e| format!("{}: {e}", output.display()))
}
