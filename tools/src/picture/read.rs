//! Reading what the picture is made from: an RMM-format CSV log (RMM's `logging_resource_adaptor`,
//! this crate's `LoggingAdaptor`, or a history written with `History::write_csv`), a recorded
//! history as JSON (`HistoryAdaptor::history`), or a snapshot as JSON.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use indicatif::ProgressBar;
use streamalloc::resource::adaptor::{Action, History};
use streamalloc::resource::snapshot::Snapshot;

use super::model::{Act, Ev, Trace};

/// What a file holds.
#[derive(Debug)]
pub(crate) enum Input {
    Trace(Trace),
    Snapshot(Box<Snapshot>),
}

/// Reads `path`: JSON if its first non-blank byte is `{`, else an RMM-format CSV log.
pub(crate) fn read(path: &Path, progress: &ProgressBar) -> Result<Input, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let length = file.metadata().map(|m| m.len()).unwrap_or(0);
    let mut reader = std::io::BufReader::new(file);
    let mut first = [0u8; 64];
    let got = reader
        .read(&mut first)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let json = first[..got]
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|&b| b == b'{');
    let all = std::io::Cursor::new(first[..got].to_vec()).chain(reader);
    if json {
        read_json(all).map_err(|e| format!("{}: {e}", path.display()))
    } else {
        progress.set_length(length);
        read_csv(all, progress)
            .map(Input::Trace)
            .map_err(|e| format!("{}: {e}", path.display()))
    }
}

fn read_json(reader: impl Read) -> Result<Input, String> {
    let value: serde_json::Value =
        serde_json::from_reader(reader).map_err(|e| format!("not valid JSON: {e}"))?;
    if value.get("events").is_some() {
        let history: History =
            serde_json::from_value(value).map_err(|e| format!("not a history: {e}"))?;
        Ok(Input::Trace(trace_of_history(&history)?))
    } else if value.get("chunks").is_some() {
        let snapshot: Snapshot =
            serde_json::from_value(value).map_err(|e| format!("not a snapshot: {e}"))?;
        check_snapshot(&snapshot).map_err(|e| format!("a malformed snapshot: {e}"))?;
        Ok(Input::Snapshot(Box::new(snapshot)))
    } else {
        Err("JSON with neither `events` (a history) nor `chunks` (a snapshot)".into())
    }
}

/// Checks what the picture relies on in a snapshot read from a file: that its blocks tile its
/// chunks ([`Snapshot::check`]: a block larger than its chunk made the address map draw a
/// rectangle per row of the block, without end, a review's finding), and that the chunks'
/// sizes, over the snapshot and its parts, add up to at most `u64::MAX`, so that no sum of
/// blocks can overflow. `Err` names the first chunk or block that does not.
fn check_snapshot(snapshot: &Snapshot) -> Result<(), String> {
    snapshot.check()?;
    add_chunk_sizes(snapshot, &mut 0)
}

/// Adds the chunks' sizes of `snapshot` and its parts to `total`; `Err` at the chunk that
/// takes it past `u64::MAX`.
fn add_chunk_sizes(snapshot: &Snapshot, total: &mut u64) -> Result<(), String> {
    for chunk in &snapshot.chunks {
        *total = total.checked_add(chunk.size).ok_or_else(|| {
            format!(
                "the chunk at {:#x} of {} bytes: with it, the chunks' sizes add up past u64::MAX",
                chunk.base, chunk.size
            )
        })?;
    }
    for (i, part) in snapshot.parts.iter().enumerate() {
        add_chunk_sizes(part, total).map_err(|e| format!("part {i} ({}): {e}", part.resource))?;
    }
    Ok(())
}

/// Checks an allocation read from a file: it ends inside the address space. `Err` says so,
/// after `place`.
fn check_end(act: Act, ptr: u64, size: u64, place: impl FnOnce() -> String) -> Result<(), String> {
    if act == Act::Alloc && ptr.checked_add(size).is_none() {
        return Err(format!(
            "{}: an allocation of {size} bytes at {ptr:#x} passes the end of the address space",
            place()
        ));
    }
    Ok(())
}

/// A recorded history as a trace: times relative to its earliest event (not always the first:
/// the adaptor reads its clock before it takes its lock). `Err` names an allocation past the
/// end of the address space.
pub(crate) fn trace_of_history(history: &History) -> Result<Trace, String> {
    let t0 = history.events.iter().map(|e| e.time_us).min().unwrap_or(0);
    let mut trace = Trace {
        dropped: history.dropped,
        ..Trace::default()
    };
    let mut streams: HashMap<u64, u32> = HashMap::new();
    for (i, e) in history.events.iter().enumerate() {
        let act = match e.action {
            Action::Allocate => Act::Alloc,
            Action::Free => Act::Free,
            Action::AllocateFailure => Act::Fail,
        };
        // A zero-byte allocation (recorded as an allocation of null) or its free: nothing, as
        // in a log. Taken as an allocation at 0, a second one on another stream left its free
        // "unmatched" (a review's finding).
        let act = if e.ptr == 0 && act != Act::Fail {
            Act::Nop
        } else {
            act
        };
        check_end(act, e.ptr, e.size, || {
            format!("event {} of the history", i + 1)
        })?;
        let next = streams.len() as u32;
        let stream = *streams.entry(e.stream).or_insert_with(|| {
            trace.streams.push(e.stream.to_string());
            next
        });
        let backtrace = e.backtrace.as_ref().map(|b| {
            trace.backtraces.push(b.clone());
            (trace.backtraces.len() - 1) as u32
        });
        trace.events.push(Ev {
            t_us: Some(e.time_us.saturating_sub(t0)),
            act,
            ptr: e.ptr,
            size: e.size,
            stream,
            backtrace,
        });
    }
    Ok(trace)
}

/// `HH:MM:SS.ffffff` (any number of fraction digits) as microseconds of the day.
pub(crate) fn parse_time_of_day(text: &str) -> Option<u64> {
    let mut parts = text.trim().splitn(3, ':');
    let h: u64 = parts.next()?.parse().ok()?;
    let m: u64 = parts.next()?.parse().ok()?;
    let rest = parts.next()?;
    let (s, frac) = rest.split_once('.').unwrap_or((rest, ""));
    let s: u64 = s.parse().ok()?;
    let mut micros = 0u64;
    for (i, c) in frac.chars().take(6).enumerate() {
        micros += u64::from(c.to_digit(10)?) * 10u64.pow(5 - i as u32);
    }
    (h < 24 && m < 60 && s < 61).then_some(((h * 60 + m) * 60 + s) * 1_000_000 + micros)
}

fn parse_pointer(text: &str) -> Option<u64> {
    let t = text.trim();
    if ["(nil)", "nil", "null"]
        .iter()
        .any(|n| t.eq_ignore_ascii_case(n))
    {
        return Some(0);
    }
    let hex = t
        .strip_prefix("0x")
        .or_else(|| t.strip_prefix("0X"))
        .unwrap_or(t);
    u64::from_str_radix(hex, 16).ok()
}

/// An RMM-format CSV log: the columns found by name; `Time` and `Stream` optional.
pub(crate) fn read_csv(reader: impl Read, progress: &ProgressBar) -> Result<Trace, String> {
    let mut csv = csv::ReaderBuilder::new()
        .has_headers(true)
        .flexible(true)
        .trim(csv::Trim::All)
        .from_reader(reader);
    let headers = csv
        .headers()
        .map_err(|e| format!("line 1: cannot read the header: {e}"))?
        .clone();
    let column = |name: &str| headers.iter().position(|h| h.eq_ignore_ascii_case(name));
    let need = |name: &str| {
        column(name).ok_or_else(|| {
            format!("line 1: the header has no `{name}` column (expected Thread,Time,Action,Pointer,Size,Stream)")
        })
    };
    let (c_action, c_pointer, c_size) = (need("Action")?, need("Pointer")?, need("Size")?);
    let (c_time, c_stream) = (column("Time"), column("Stream"));
    let mut trace = Trace::default();
    let mut streams: HashMap<String, u32> = HashMap::new();
    let mut record = csv::StringRecord::new();
    // Times of day, unwrapped past midnight; made relative to the earliest at the end (lines
    // are not always in time order: threads stamp a line before they take the log's lock).
    let (mut earliest, mut last, mut days) = (u64::MAX, 0u64, 0u64);
    let mut times_ok = c_time.is_some();
    loop {
        match csv.read_record(&mut record) {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => {
                let line = e.position().map_or(0, |p| p.line());
                return Err(format!("line {line}: not valid CSV: {e}"));
            }
        }
        let line = record.position().map_or(0, |p| p.line());
        if trace.events.len() % 65536 == 0 {
            progress.set_position(record.position().map_or(0, |p| p.byte()));
        }
        let field = |c: usize| {
            record
                .get(c)
                .ok_or_else(|| format!("line {line}: too few fields"))
        };
        let act = match field(c_action)?.to_ascii_lowercase().as_str() {
            "allocate" => Act::Alloc,
            "free" => Act::Free,
            "allocate failure" => Act::Fail,
            other => return Err(format!("line {line}: unknown action `{other}`")),
        };
        let ptr = parse_pointer(field(c_pointer)?)
            .ok_or_else(|| format!("line {line}: `{}` is not a pointer", &record[c_pointer]))?;
        let size: u64 = field(c_size)?
            .parse()
            .map_err(|_| format!("line {line}: `{}` is not a size", &record[c_size]))?;
        // A zero-byte allocation or a free of null: kept as an event that does nothing, so
        // that events line up with the log's lines (a replay's numbers are by line).
        let act = if ptr == 0 && act != Act::Fail {
            Act::Nop
        } else {
            act
        };
        check_end(act, ptr, size, || format!("line {line}"))?;
        let name = c_stream.and_then(|c| record.get(c)).unwrap_or("0");
        let next = streams.len() as u32;
        let stream = *streams.entry(name.to_owned()).or_insert_with(|| {
            trace.streams.push(name.to_owned());
            next
        });
        let mut t_us = None;
        if times_ok {
            match c_time
                .and_then(|c| record.get(c))
                .and_then(parse_time_of_day)
            {
                Some(t) => {
                    // A time far before the last one is the next day (logs run past midnight).
                    if t + 12 * 3_600_000_000 < last {
                        days += 1;
                    }
                    last = t;
                    let abs = days.saturating_mul(86_400_000_000).saturating_add(t);
                    earliest = earliest.min(abs);
                    t_us = Some(abs);
                }
                None => times_ok = false,
            }
        }
        trace.events.push(Ev {
            t_us,
            act,
            ptr,
            size,
            stream,
            backtrace: None,
        });
        trace.lines.push(line);
    }
    for e in &mut trace.events {
        e.t_us = e.t_us.filter(|_| times_ok).map(|t| t - earliest);
    }
    progress.finish_and_clear();
    Ok(trace)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_of_day() {
        assert_eq!(parse_time_of_day("00:00:01.5"), Some(1_500_000));
        assert_eq!(parse_time_of_day("14:03:07.123456"), Some(50_587_123_456));
        assert_eq!(parse_time_of_day("soon"), None);
    }

    #[test]
    fn csv_past_midnight() {
        let log = "Thread,Time,Action,Pointer,Size,Stream\n\
                   1,23:59:59.900000,allocate,0x100,256,5\n\
                   1,00:00:00.100000,free,0x100,256,5\n";
        let trace = read_csv(log.as_bytes(), &ProgressBar::hidden()).unwrap();
        assert_eq!(trace.events[1].t_us, Some(200_000));
        assert_eq!(trace.streams, vec!["5".to_string()]);
    }

    /// A history records a zero-byte allocation as `allocate` of null (and its free as a free
    /// of null), as `HistoryAdaptor` does: nothing, as the CSV reader has it. Read as an
    /// allocation at 0, two of them on two streams left one free "unmatched", and the page
    /// said the log started while memory was allocated; the counts differed from the same
    /// history written as CSV.
    #[test]
    fn zero_byte_allocations_of_a_history_are_nothing() {
        use streamalloc::resource::adaptor::HistoryEvent;

        let event = |time_us, action, ptr, size, stream| HistoryEvent {
            thread: stream,
            time_us,
            action,
            ptr,
            size,
            stream,
            backtrace: None,
        };
        let history = History {
            capacity: 16,
            dropped: 0,
            events: vec![
                event(0, Action::Allocate, 0x1000, 256, 1),
                event(1, Action::Allocate, 0, 0, 1),
                event(2, Action::Allocate, 0, 0, 2),
                event(3, Action::Free, 0, 0, 1),
                event(4, Action::Free, 0, 0, 2),
                event(5, Action::Free, 0x1000, 256, 1),
            ],
        };
        let trace = trace_of_history(&history).unwrap();
        let picture =
            super::super::model::from_trace(&trace, "t".into(), None, &ProgressBar::hidden())
                .unwrap();
        assert_eq!(picture.counts.events, 6);
        assert_eq!(picture.counts.unmatched_frees, 0);
        assert_eq!((picture.counts.allocations, picture.counts.frees), (1, 1));
        assert_eq!(picture.peak_in_use, 256);
        assert!(
            !picture.notes.iter().any(|n| n.contains("no earlier event")),
            "{:?}",
            picture.notes
        );
        // The same history as CSV: the same counts.
        let mut csv = Vec::new();
        history.write_csv(&mut csv).unwrap();
        let from_csv = read_csv(csv.as_slice(), &ProgressBar::hidden()).unwrap();
        let acts = |t: &Trace| t.events.iter().map(|e| e.act).collect::<Vec<_>>();
        assert_eq!(acts(&trace), acts(&from_csv));
    }
}
