//! The `streamalloc-replay` binary: a hand-written RMM log replayed against every resource,
//! malformed logs, and a log written by this crate's `LoggingAdaptor`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use streamalloc::resource::adaptor::LoggingAdaptor;
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{Device, DevicePtr, MemoryResource, SimConfig};

mod common;

/// The tool (see `common::tool`).
fn bin() -> PathBuf {
    common::tool(
        env!("CARGO_BIN_EXE_streamalloc-replay"),
        "streamalloc-replay",
    )
}

/// A test log: its text is compiled into the test (so packed test binaries run anywhere, a GPU
/// machine included) and written to a fresh temporary file.
fn data(name: &str) -> Scratch {
    let text = match name {
        "rmm_small.csv" => include_str!("data/rmm_small.csv"),
        other => panic!("no test log named {other}"),
    };
    let path = temp(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// A fresh path in the system's temporary directory (not the build's: packed test binaries run
/// on machines without it), whose file is removed when the guard drops, even when the test
/// fails: a run of the suite leaves nothing behind.
fn temp(name: &str) -> Scratch {
    static N: AtomicUsize = AtomicUsize::new(0);
    Scratch(std::env::temp_dir().join(format!(
        "replay-{}-{}-{name}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )))
}

/// A scratch file's path; the file goes when this does.
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        std::fs::remove_file(&self.0).ok();
    }
}

fn run(log: &Path, args: &[&str]) -> Output {
    Command::new(bin())
        .arg(log)
        .args(args)
        .output()
        .expect("run streamalloc-replay")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The value after `key: ` on its line of the output.
fn field<'a>(text: &'a str, key: &str) -> &'a str {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(": "))
        .unwrap_or_else(|| panic!("no `{key}:` line in:\n{text}"))
}

/// The leading number of a field.
fn number(text: &str, key: &str) -> u64 {
    let value = field(text, key);
    value
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("`{key}: {value}` has no number"))
}

/// tests/data/rmm_small.csv: 3 threads, 2 streams, 14 events; frees across threads and
/// streams, a pointer handed out twice, one `allocate failure` of 1 PiB, one allocation never
/// freed (512 bytes). Its peak is 8454656 bytes live.
fn check_small_log(out: &Output, resource: &str) {
    let text = stdout(out);
    assert!(
        out.status.success(),
        "{resource}: exit {:?}\n{text}\n{}",
        out.status,
        stderr(out)
    );
    assert!(field(&text, "device").contains("simulated"), "{text}");
    assert!(field(&text, "resource").starts_with(resource), "{text}");
    assert!(
        field(&text, "events").starts_with("14 (3 threads, 2 streams"),
        "{text}"
    );
    assert_eq!(number(&text, "allocations"), 7, "{text}");
    assert_eq!(number(&text, "failed allocations"), 0, "{text}");
    assert_eq!(number(&text, "frees"), 6, "{text}");
    assert_eq!(number(&text, "skipped frees"), 0, "{text}");
    assert_eq!(
        field(&text, "log allocation failures"),
        "1 (failed here too: 1)",
        "{text}"
    );
    assert_eq!(
        field(&text, "leaked"),
        "1 allocation(s), 512 bytes (freed after the replay)",
        "{text}"
    );
    assert!(field(&text, "wall time").ends_with(" ms"), "{text}");
    assert!(
        field(&text, "peak in use").ends_with("(8454656 bytes)"),
        "{text}"
    );
}

#[test]
fn an_rmm_log_replays_against_every_resource() {
    let log = data("rmm_small.csv");
    for resource in ["pool", "arena", "binning", "cuda", "cuda-async"] {
        let out = run(&log, &["--device", "sim", "--resource", resource]);
        check_small_log(&out, resource);
        let text = stdout(&out);
        if resource != "cuda-async" {
            let reserved = field(&text, "peak reserved");
            let bytes: u64 = reserved
                .rsplit('(')
                .next()
                .and_then(|s| s.split(' ').next())
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("{reserved}"));
            assert!(bytes >= 8454656, "{resource}: {text}");
            assert!(
                field(&text, "fragmentation").ends_with("(1 - peak in use / peak reserved)"),
                "{text}"
            );
        }
        if resource == "cuda" {
            // Nothing pooled: what is reserved is what is live.
            assert_eq!(
                field(&text, "fragmentation"),
                "0.0% (1 - peak in use / peak reserved)"
            );
        }
    }
}

#[test]
fn options_reach_the_resources() {
    let log = data("rmm_small.csv");
    let out = run(
        &log,
        &["--device", "sim", "-r", "arena", "--arena-size", "16MiB"],
    );
    check_small_log(&out, "arena");
    let text = stdout(&out);
    assert!(
        field(&text, "resource").contains("initial 16.00 MiB, maximum 16.00 MiB"),
        "{text}"
    );
    assert!(field(&text, "arena").ends_with("0 grow(s)"), "{text}");

    let out = run(
        &log,
        &[
            "--device",
            "sim",
            "-r",
            "pool",
            "--initial",
            "4MiB",
            "--maximum",
            "1GiB",
        ],
    );
    check_small_log(&out, "pool");
    assert!(field(&stdout(&out), "resource").contains("initial 4.00 MiB, maximum 1.00 GiB"));

    let out = run(
        &log,
        &[
            "--device",
            "sim",
            "-r",
            "binning",
            "--bin-min-log2",
            "10",
            "--bin-max-log2",
            "12",
            "--blocks-per-chunk",
            "4",
        ],
    );
    check_small_log(&out, "binning");
    assert!(field(&stdout(&out), "resource").contains("bins of 1.00 KiB..4.00 KiB"));

    // A pool too small for the log's peak: failures counted, their frees skipped, no error.
    let out = run(
        &log,
        &["--device", "sim", "-r", "pool", "--maximum", "4MiB"],
    );
    let text = stdout(&out);
    assert!(out.status.success(), "{text}\n{}", stderr(&out));
    assert_eq!(number(&text, "failed allocations"), 1, "{text}");
    assert_eq!(number(&text, "skipped frees"), 1, "{text}");

    // Free-running threads: the same counts (the peak may differ).
    let out = run(&log, &["--device", "sim", "--order", "threads"]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}\n{}", stderr(&out));
    assert!(
        field(&text, "events").ends_with("order: threads)"),
        "{text}"
    );
    assert_eq!(number(&text, "allocations"), 7);
    assert_eq!(number(&text, "failed allocations"), 0);
    assert_eq!(number(&text, "leaked"), 1);

    // The default device (a GPU if there is one).
    let out = run(&log, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!field(&stdout(&out), "device").is_empty());
}

/// Each malformed log stops the tool before it replays anything: exit code 2, the line number
/// and what is wrong on stderr.
/// A zero-byte allocation with a non-null pointer (another allocator may log one) replays as
/// nothing, and so does its free, in both orders: replayed as an allocation, its free waited
/// for ever under `--order threads` (our `allocate(0)` returns null; review).
#[test]
fn a_zero_byte_allocation_with_a_pointer_replays_as_nothing() {
    let header = "Thread,Time,Action,Pointer,Size,Stream\n";
    let text = format!(
        "{header}1,10:00:00.000001,allocate,0x7f0000000000,0,0x0\n\
         2,10:00:00.000002,free,0x7f0000000000,0,0x0\n"
    );
    let path = temp("zero-bytes.csv");
    std::fs::write(&path, text).unwrap();
    for order in ["log", "threads"] {
        let out = run(&path, &["--device", "sim", "--order", order]);
        assert!(
            out.status.success(),
            "--order {order}: exit {:?}, stderr {}",
            out.status,
            stderr(&out)
        );
    }
}

#[test]
fn malformed_logs_report_the_line() {
    let header = "Thread,Time,Action,Pointer,Size,Stream\n";
    let good = "1,10:00:00.000001,allocate,0x7f0000000000,1024,0x0\n";
    let cases: [(String, &str); 9] = [
        (
            format!("{header}{good}2,10:00:00.000002,alloc,0x7f0000001000,64,0x0\n"),
            "line 3: unknown action `alloc`",
        ),
        (
            format!("{header}{good}{good}"),
            "line 3: allocate returned 0x7f0000000000, which is still live (allocated at line 2)",
        ),
        (
            format!("{header}{good}1,10:00:00.000002,allocate,0x7f0000001000,64\n"),
            "line 3: expected 6 fields (as in the header), found 5",
        ),
        (
            format!("{header}{good}1,10:00:00.000002,allocate,0x7f0000001000,12x,0x0\n"),
            "line 3: `12x` is not a size in bytes",
        ),
        (
            format!("{header}{good}1,10:00:00.000002,allocate,0xZZ,64,0x0\n"),
            "line 3: `0xZZ` is not a pointer",
        ),
        (
            format!("{header}1,10:00:00.000001,free,0x7f0000000400,1024,0x0\n{good}"),
            "line 2: free of 0x7f0000000400, which no earlier line allocated",
        ),
        (
            format!("{header}{good}1,10:00:00.000002,free,0x7f0000000000,1000,0x0\n"),
            "line 3: free of 0x7f0000000000 with 1000 bytes, allocated with 1024 bytes at line 2",
        ),
        (
            "Thread,Time,Action,Pointer,Stream\n1,10:00:00.000001,free,0x1,0x0\n".to_owned(),
            "line 1: the header has no `Size` column",
        ),
        (String::new(), "line 1: empty log"),
    ];
    for (text, expected) in cases {
        let path = temp("malformed.csv");
        std::fs::write(&path, &text).unwrap();
        let out = run(&path, &["--device", "sim"]);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{expected}: exit {:?}, stderr {}",
            out.status,
            stderr(&out)
        );
        assert!(
            stderr(&out).contains(expected),
            "expected `{expected}` in: {}",
            stderr(&out)
        );
        assert!(stdout(&out).is_empty(), "replayed anyway: {}", stdout(&out));
    }

    // With --ignore-unmatched, an unmatched free is skipped instead.
    let path = temp("unmatched.csv");
    std::fs::write(
        &path,
        format!("{header}1,10:00:00.000001,free,0x7f0000000400,1024,0x0\n{good}"),
    )
    .unwrap();
    let out = run(&path, &["--device", "sim", "--ignore-unmatched"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(number(&stdout(&out), "unmatched frees skipped"), 1);

    // A file that is not there is an error, not a malformed log.
    let out = run(Path::new("/nonexistent/log.csv"), &["--device", "sim"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    // Bad arguments are clap's usage errors.
    let out = run(&data("rmm_small.csv"), &["--resource", "nope"]);
    assert_eq!(out.status.code(), Some(2));
    let out = run(&data("rmm_small.csv"), &["--maximum", "12 parsecs"]);
    assert_eq!(out.status.code(), Some(2));
}

/// A log written by `LoggingAdaptor` while three threads on three streams allocate, free each
/// other's memory, ask for zero bytes and for 1 PiB: the replay sees the same counts.
#[test]
fn a_log_written_by_the_logging_adaptor_replays() {
    let device = Device::simulated(SimConfig::default());
    let path = temp("logging-adaptor.csv");
    let pool = PoolResource::new(CudaResource::new(&device), PoolOptions::default()).unwrap();
    let logged = Arc::new(LoggingAdaptor::to_file(pool, &path).unwrap());
    let (tx, rx) = std::sync::mpsc::channel::<(DevicePtr, usize)>();
    std::thread::scope(|scope| {
        // Two producers, each on its own stream: some blocks freed by themselves, some sent to
        // the consumer.
        for t in 0..2usize {
            let (logged, device, tx) = (logged.clone(), device.clone(), tx.clone());
            scope.spawn(move || {
                let s = device.create_stream().unwrap();
                for i in 0..50usize {
                    let size = 256 + 1000 * (i % 7) + t;
                    let ptr = logged.allocate(size, &s).unwrap();
                    if i % 3 == 0 {
                        // SAFETY: allocated above with `size` bytes, unused, freed once.
                        unsafe { logged.deallocate(ptr, size, &s) }.unwrap();
                    } else {
                        s.synchronize_blocking().unwrap();
                        tx.send((ptr, size)).unwrap();
                    }
                }
                let zero = logged.allocate(0, &s).unwrap();
                // SAFETY: the zero-byte allocation, given back with zero bytes.
                unsafe { logged.deallocate(zero, 0, &s) }.unwrap();
            });
        }
        drop(tx);
        let (logged, device) = (logged.clone(), device.clone());
        scope.spawn(move || {
            let s = device.create_stream().unwrap();
            assert!(logged.allocate(1 << 50, &s).is_err());
            for (ptr, size) in rx {
                // SAFETY: sent by a producer after its stream was synchronized; freed once.
                unsafe { logged.deallocate(ptr, size, &s) }.unwrap();
            }
        });
    });
    // Two producers: 50 allocations and one zero-byte allocation each, all freed; one failure.
    let (allocs, frees, failures) = (2 * 51, 2 * 51, 1);
    logged.flush().unwrap();
    drop(logged);
    for resource in ["pool", "arena", "binning", "cuda"] {
        let out = run(&path, &["--device", "sim", "--resource", resource]);
        let text = stdout(&out);
        assert!(out.status.success(), "{resource}: {text}\n{}", stderr(&out));
        assert!(
            field(&text, "events").starts_with(&format!(
                "{} (3 threads, 3 streams",
                allocs + frees + failures
            )),
            "{text}"
        );
        assert_eq!(number(&text, "allocations"), allocs, "{text}");
        assert_eq!(number(&text, "frees"), frees, "{text}");
        assert_eq!(number(&text, "failed allocations"), 0, "{text}");
        assert_eq!(
            field(&text, "log allocation failures"),
            "1 (failed here too: 1)",
            "{text}"
        );
        assert_eq!(number(&text, "leaked"), 0, "{text}");
    }
}

/// A size flag that the resource rounds up to 256 bytes, within 255 of `u64::MAX`, or one of
/// 2^64 (which was accepted, rounded to `u64::MAX`): a usage error (exit 2) naming the flag,
/// not an overflow. The largest size taken runs.
#[test]
fn size_flags_past_the_largest_size_are_usage_errors() {
    let log = data("rmm_small.csv");
    let too_large = "is too large: this size is rounded up to a multiple of 256 bytes, and the largest is 18446744073709551360 bytes";
    let out_of_range = "is out of range (the largest size is 18446744073709551615 bytes)";
    let cases: [(&[&str], &str, &str); 6] = [
        (
            &["--initial", "18446744073709551615"],
            "--initial",
            too_large,
        ),
        (
            &["--maximum", "18446744073709551615"],
            "--maximum",
            too_large,
        ),
        (
            &["-r", "arena", "--arena-size", "18446744073709551615"],
            "--arena-size",
            too_large,
        ),
        (
            &["-r", "arena", "--superblock-size", "18446744073709551600"],
            "--superblock-size",
            too_large,
        ),
        (
            &["--maximum", "18446744073709551616"],
            "--maximum",
            out_of_range,
        ),
        (&["--initial", "16777216TiB"], "--initial", out_of_range),
    ];
    for (flags, flag, expected) in cases {
        let mut args = vec!["--device", "sim"];
        args.extend_from_slice(flags);
        let out = run(&log, &args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {err}");
        assert!(
            err.contains(flag) && err.contains(expected),
            "{flags:?}: expected `{flag}` and `{expected}` in: {err}"
        );
    }
    // The largest: a maximum the device never reaches replays; an initial size the device
    // cannot give is the resource's error (exit 1).
    let out = run(
        &log,
        &["--device", "sim", "--maximum", "18446744073709551360"],
    );
    check_small_log(&out, "pool");
    let out = run(
        &log,
        &["--device", "sim", "--initial", "18446744073709551360"],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("cannot make the pool resource"));
}

/// The replay starts one thread per thread of the log: a log with more than `--max-threads`
/// is refused before anything runs (exit 1), naming the limit.
#[test]
fn a_log_with_more_threads_than_the_limit_is_refused() {
    let log = data("rmm_small.csv");
    let out = run(&log, &["--device", "sim", "--max-threads", "2"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(
            "the log has 3 threads, and the replay starts one per thread of the log: at most 2 (--max-threads)"
        ),
        "{}",
        stderr(&out)
    );
    assert!(stdout(&out).is_empty(), "replayed anyway: {}", stdout(&out));
    check_small_log(
        &run(&log, &["--device", "sim", "--max-threads", "3"]),
        "pool",
    );
    let out = run(&log, &["--device", "sim", "--max-threads", "0"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}

/// A log with more threads than the system lets the replay start: the failed start is an error
/// (exit 1), and the threads already started, which waited at a barrier for all of them, are
/// sent home instead of waiting for ever. Made certain by stacks of 64 MiB (`RUST_MIN_STACK`)
/// for 200 threads (12.5 GiB) in a 4 GB address space (`ulimit -v`); the tool is killed after
/// 30 s, so a hang fails the test instead of hanging it.
#[cfg(target_os = "linux")]
#[test]
fn a_replay_whose_threads_cannot_all_start_fails_cleanly() {
    let mut text = String::from("Thread,Time,Action,Pointer,Size,Stream\n");
    for i in 0..200u64 {
        text.push_str(&format!(
            "{i},10:00:00.000000,allocate,{:#x},256,0\n",
            0x7f00_0000_0000u64 + i * 0x1000
        ));
    }
    let log = temp("many-threads.csv");
    std::fs::write(&log, text).unwrap();
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(r#"ulimit -v 4000000 && exec "$0" "$1" --device sim"#)
        .arg(bin())
        .arg(&*log)
        .env("RUST_MIN_STACK", (64u64 << 20).to_string());
    let out = common::run_with_limit(cmd, std::time::Duration::from_secs(30))
        .expect("a replay whose threads cannot all start: still running after 30 s (a hang)");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot start replay thread ")
            && err.contains(" of 200 (one per thread of the log): "),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// An `allocate failure` retried with success counts in the peak in use while it is held: the
/// resource was asked to hold it and grew for it. Before, 1 GiB retried beside 1 MiB live read
/// 99.9% fragmentation on every resource, `cuda` (no pooling) included.
#[test]
fn a_retried_failure_counts_in_the_peak_in_use() {
    let header = "Thread,Time,Action,Pointer,Size,Stream\n";
    let mib = 1u64 << 20;
    let text = format!(
        "{header}1,10:00:00.000001,allocate,0x7f0000000000,{mib},0x0\n\
         1,10:00:00.000002,allocate failure,0x0,{},0x0\n\
         1,10:00:00.000003,free,0x7f0000000000,{mib},0x0\n",
        64 * mib
    );
    let path = temp("retried-failure.csv");
    std::fs::write(&path, text).unwrap();
    let out = run(&path, &["--device", "sim", "--resource", "cuda"]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert_eq!(number(&text, "peak in use"), 65, "{text}");
    assert!(field(&text, "fragmentation").starts_with("0.0%"), "{text}");
}

/// A simulated device whose memory is not a multiple of 256 bytes (`--sim-memory 1000`): the
/// pool, arena and binning resources default their maximum to the device's memory, which
/// they refused ("the pool's maximum size must be a multiple of 256 bytes", a flag the user
/// never gave). The default is the device's memory rounded down to 256 bytes: the replay runs
/// and counts what does not fit as failed allocations. An arena whose superblock cannot fit
/// is a clear error (exit 1) naming the superblock, not the maximum.
#[test]
fn a_small_simulated_device_replays_with_failures() {
    let log = data("rmm_small.csv");
    for resource in ["pool", "binning", "cuda"] {
        let out = run(
            &log,
            &["--device", "sim", "--sim-memory", "1000", "-r", resource],
        );
        let text = stdout(&out);
        assert!(
            out.status.success(),
            "{resource}: exit {:?}\n{text}\n{}",
            out.status,
            stderr(&out)
        );
        if resource != "cuda" {
            assert!(
                field(&text, "resource").contains("maximum 768 B"),
                "{resource}: {text}"
            );
        }
        // Only the 512-byte allocation fits (the 1024-byte one does not).
        assert!(
            number(&text, "failed allocations") >= 5,
            "{resource}: {text}"
        );
        assert!(number(&text, "peak reserved") <= 768, "{resource}: {text}");
    }
    // The arena: 768 bytes fit superblocks of 256 bytes, not the default 1 MiB.
    let out = run(
        &log,
        &[
            "--device",
            "sim",
            "--sim-memory",
            "1000",
            "-r",
            "arena",
            "--superblock-size",
            "256",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(field(&stdout(&out), "resource").contains("maximum 768 B"));
    let out = run(
        &log,
        &["--device", "sim", "--sim-memory", "1000", "-r", "arena"],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("superblock size is above its maximum"),
        "{}",
        stderr(&out)
    );
}

/// A `--device` that is none of `auto`, `sim`, `cuda`, `cuda:N` is a bad argument: a usage
/// error (exit 2, as the tool documents for bad arguments) before the log is read, not exit 1
/// as if a device had failed to open.
#[test]
fn an_unknown_device_is_a_usage_error() {
    let log = data("rmm_small.csv");
    for device in ["gpu", "cuda:x", "cuda:", "sim:0"] {
        let out = run(&log, &["--device", device]);
        assert_eq!(out.status.code(), Some(2), "{device}: {}", stderr(&out));
        assert!(
            stderr(&out).contains("--device") && stderr(&out).contains("cuda:N"),
            "{device}: {}",
            stderr(&out)
        );
        assert!(stdout(&out).is_empty(), "{device}: {}", stdout(&out));
    }
    check_small_log(&run(&log, &["--device", "simulated"]), "pool");
}

/// A log that cannot be read is exit 1, as the tool documents ("the file cannot be read"), not
/// exit 2, which says the log is malformed: a directory gave "line 1: cannot read the header:
/// Is a directory" and exit 2.
#[test]
fn a_log_that_cannot_be_read_is_exit_1() {
    let dir = std::env::temp_dir();
    let out = run(&dir, &[]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("cannot read the log"),
        "{}",
        stderr(&out)
    );
    assert!(stdout(&out).is_empty(), "{}", stdout(&out));
    // A malformed log is still exit 2.
    let log = temp("garbage.csv");
    std::fs::write(
        &log,
        b"Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate\n",
    )
    .unwrap();
    assert_eq!(run(&log, &[]).status.code(), Some(2));
}
