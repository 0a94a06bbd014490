//! The log: RMM's CSV format read, checked line by line, split by thread, and each free paired
//! with the allocation that returned its pointer most recently (see the module docs above).

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use crate::picture::bar;

/// A line that cannot be replayed.
#[derive(Debug)]
pub(super) struct Malformed {
    pub(super) line: u64,
    pub(super) what: String,
}

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.what)
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Op {
    /// Replay an allocation; `id` numbers it for its free.
    Alloc { id: u32, size: u64 },
    /// Free allocation `id`.
    Free { id: u32, size: u64 },
    /// An `allocate failure` line: try it again.
    Fail { size: u64 },
    /// A zero-byte allocate or free of null: nothing to do but keep the turn.
    Nop,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Ev {
    /// The event's place in the log's order.
    pub(super) index: u64,
    pub(super) op: Op,
    pub(super) stream: u32,
}

/// The log, split by thread, with each free paired with its allocation.
#[derive(Debug, Default)]
pub(super) struct Log {
    pub(super) threads: Vec<Vec<Ev>>,
    /// The thread of each event, by index (for `--order log`).
    pub(super) owner: Vec<u32>,
    pub(super) streams: usize,
    /// (size, stream) of each allocation, by id.
    pub(super) allocs: Vec<(u64, u32)>,
    pub(super) events: u64,
    pub(super) alloc_lines: u64,
    pub(super) free_lines: u64,
    pub(super) fail_lines: u64,
    pub(super) unmatched_skipped: u64,
}

pub(super) const COLUMNS: &str = "Thread,Time,Action,Pointer,Size,Stream";

pub(super) fn parse_pointer(text: &str) -> Option<u64> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("(nil)")
        || t.eq_ignore_ascii_case("nil")
        || t.eq_ignore_ascii_case("null")
    {
        return Some(0);
    }
    let hex = t
        .strip_prefix("0x")
        .or_else(|| t.strip_prefix("0X"))
        .unwrap_or(t);
    if hex.is_empty() {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

pub(super) fn parse_log(path: &Path, ignore_unmatched: bool) -> Result<Log, ParseError> {
    let file = std::fs::File::open(path)
        .map_err(|e| ParseError::Io(format!("{}: {e}", path.display())))?;
    let length = file.metadata().map(|m| m.len()).unwrap_or(0);
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(true)
        .flexible(true)
        .trim(csv::Trim::All)
        .from_reader(std::io::BufReader::new(file));
    let malformed = |line: u64, what: String| ParseError::Malformed(Malformed { line, what });
    // A read that fails (a directory, a disk error) is the file that cannot be read (exit 1),
    // not a malformed log (exit 2): `streamalloc-replay /tmp` said "line 1: cannot read the
    // header: Is a directory" and exited 2.
    let unreadable = |e: &csv::Error| match e.kind() {
        csv::ErrorKind::Io(io) => Some(ParseError::Io(format!("{}: {io}", path.display()))),
        _ => None,
    };

    let headers = reader
        .headers()
        .map_err(|e| {
            unreadable(&e).unwrap_or_else(|| malformed(1, format!("cannot read the header: {e}")))
        })?
        .clone();
    if headers.is_empty() || (headers.len() == 1 && headers[0].is_empty()) {
        return Err(malformed(
            1,
            format!("empty log: expected the header `{COLUMNS}`"),
        ));
    }
    let column = |name: &str| headers.iter().position(|h| h.eq_ignore_ascii_case(name));
    let mut required = [
        ("Thread", 0usize),
        ("Action", 0),
        ("Pointer", 0),
        ("Size", 0),
    ];
    for (name, index) in required.iter_mut() {
        *index = column(name).ok_or_else(|| {
            malformed(
                1,
                format!("the header has no `{name}` column (expected `{COLUMNS}`)"),
            )
        })?;
    }
    let [(_, c_thread), (_, c_action), (_, c_pointer), (_, c_size)] = required;
    let c_stream = column("Stream");

    let progress = bar(
        length,
        16 << 20,
        "parsing",
        "{msg} [{bar:40}] {bytes}/{total_bytes} ({eta})",
    );
    let mut log = Log::default();
    let mut threads: HashMap<String, u32> = HashMap::new();
    let mut streams: HashMap<String, u32> = HashMap::new();
    // Log pointer → (allocation id, size, line).
    let mut live: HashMap<u64, (u32, u64, u64)> = HashMap::new();
    // Log pointers of zero-byte allocations (another allocator may hand out a non-null pointer
    // for 0 bytes; ours returns null): replayed as nothing, and so are their frees. Replaying
    // one as an allocation left its free waiting for ever under `--order threads` (review).
    let mut empty: std::collections::HashSet<u64> = std::collections::HashSet::new();
    let mut record = csv::StringRecord::new();
    loop {
        match reader.read_record(&mut record) {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => {
                let line = e.position().map_or(0, |p| p.line());
                return Err(unreadable(&e)
                    .unwrap_or_else(|| malformed(line, format!("not valid CSV: {e}"))));
            }
        }
        let line = record.position().map_or(0, |p| p.line());
        if log.events % 65536 == 0 {
            progress.set_position(record.position().map_or(0, |p| p.byte()));
        }
        if record.len() != headers.len() {
            return Err(malformed(
                line,
                format!(
                    "expected {} fields (as in the header), found {}",
                    headers.len(),
                    record.len()
                ),
            ));
        }
        let thread_key = &record[c_thread];
        if thread_key.is_empty() {
            return Err(malformed(line, "the Thread field is empty".into()));
        }
        let next = threads.len() as u32;
        let thread = *threads.entry(thread_key.to_owned()).or_insert(next);
        let stream_key = c_stream.map_or("0", |c| &record[c]);
        let next = streams.len() as u32;
        let stream = *streams.entry(stream_key.to_owned()).or_insert(next);
        let pointer = parse_pointer(&record[c_pointer]).ok_or_else(|| {
            malformed(
                line,
                format!(
                    "`{}` is not a pointer (hex, e.g. 0x7f3a00000000)",
                    &record[c_pointer]
                ),
            )
        })?;
        let size: u64 = record[c_size].parse().map_err(|_| {
            malformed(
                line,
                format!("`{}` is not a size in bytes", &record[c_size]),
            )
        })?;
        let action = record[c_action].to_ascii_lowercase();
        let op = match action.as_str() {
            "allocate" => {
                log.alloc_lines += 1;
                if pointer == 0 {
                    if size != 0 {
                        return Err(malformed(
                            line,
                            format!("allocate of {size} bytes returned a null pointer"),
                        ));
                    }
                    Op::Nop
                } else if size == 0 {
                    if live.contains_key(&pointer) || !empty.insert(pointer) {
                        return Err(malformed(
                            line,
                            format!("allocate returned {pointer:#x}, which is still live"),
                        ));
                    }
                    Op::Nop
                } else {
                    if let Some(&(_, _, since)) = live.get(&pointer) {
                        return Err(malformed(
                            line,
                            format!("allocate returned {pointer:#x}, which is still live (allocated at line {since})"),
                        ));
                    }
                    let id = u32::try_from(log.allocs.len())
                        .map_err(|_| malformed(line, "more than 2^32 allocations".into()))?;
                    log.allocs.push((size, stream));
                    live.insert(pointer, (id, size, line));
                    Op::Alloc { id, size }
                }
            }
            "free" => {
                log.free_lines += 1;
                if pointer == 0 {
                    if size != 0 {
                        return Err(malformed(
                            line,
                            format!("free of a null pointer with {size} bytes"),
                        ));
                    }
                    Op::Nop
                } else if size == 0 && empty.remove(&pointer) {
                    Op::Nop
                } else {
                    match live.remove(&pointer) {
                        Some((id, allocated, at)) => {
                            if allocated != size {
                                return Err(malformed(
                                    line,
                                    format!("free of {pointer:#x} with {size} bytes, allocated with {allocated} bytes at line {at}"),
                                ));
                            }
                            Op::Free { id, size }
                        }
                        None if ignore_unmatched => {
                            log.unmatched_skipped += 1;
                            Op::Nop
                        }
                        None => {
                            return Err(malformed(
                                line,
                                format!("free of {pointer:#x}, which no earlier line allocated or which was already freed (--ignore-unmatched skips these)"),
                            ))
                        }
                    }
                }
            }
            "allocate failure" => {
                log.fail_lines += 1;
                Op::Fail { size }
            }
            _ => {
                return Err(malformed(
                    line,
                    format!(
                        "unknown action `{}` (expected allocate, free or allocate failure)",
                        &record[c_action]
                    ),
                ))
            }
        };
        if thread as usize == log.threads.len() {
            log.threads.push(Vec::new());
        }
        log.threads[thread as usize].push(Ev {
            index: log.events,
            op,
            stream,
        });
        log.owner.push(thread);
        log.events += 1;
    }
    progress.finish_and_clear();
    log.streams = streams.len();
    Ok(log)
}

pub(super) enum ParseError {
    Io(String),
    Malformed(Malformed),
}
