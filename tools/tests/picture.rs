//! `streamalloc-picture` and `streamalloc-replay --picture`: the numbers in the HTML agree with
//! a log whose numbers are known, and the page fetches nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use streamalloc::resource::adaptor::{HistoryAdaptor, HistoryOptions};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{Device, MemoryResource, SimConfig};

mod common;

/// The picture tool (see `common::tool`).
fn picture_bin() -> PathBuf {
    common::tool(
        env!("CARGO_BIN_EXE_streamalloc-picture"),
        "streamalloc-picture",
    )
}

/// The replay tool.
fn replay_bin() -> PathBuf {
    common::tool(
        env!("CARGO_BIN_EXE_streamalloc-replay"),
        "streamalloc-replay",
    )
}

/// A scratch directory, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("streamalloc-picture-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Streams 5 and 6; the peak (3.5 MiB) after the third line, at 0.2 s.
const LOG: &str = "Thread,Time,Action,Pointer,Size,Stream
1,10:00:00.000000,allocate,0x7f0000000000,1048576,5
1,10:00:00.100000,allocate,0x7f0000100000,2097152,6
2,10:00:00.200000,allocate,0x7f0000300000,524288,5
1,10:00:00.300000,free,0x7f0000000000,1048576,5
2,10:00:00.400000,allocate failure,0x0,99999999999,6
2,10:00:00.500000,allocate,0x7f0000000000,262144,6
2,10:00:00.600000,free,0x7f0000100000,2097152,6
1,10:00:00.700000,free,0x7f0000300000,524288,5
2,10:00:00.800000,free,0x7f0000000000,262144,6
";

fn run(exe: &Path, args: &[&Path]) -> String {
    let out = Command::new(exe).args(args).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{} failed:\n{text}", exe.display());
    text
}

/// The page, and the numbers it embeds.
fn page(path: &Path) -> (String, Value) {
    let html = std::fs::read_to_string(path).unwrap();
    let start = html
        .find(r#"<script type="application/json" id="streamalloc-data">"#)
        .expect("the data block");
    let json = &html[start..];
    let json = &json[json.find('>').unwrap() + 1..json.find("</script>").unwrap()];
    let data: Value = serde_json::from_str(&json.replace("<\\/", "</")).unwrap();
    // Self-contained: nothing to fetch (the SVG namespace is a name, not a fetch).
    let fetches = html.replace("http://www.w3.org/2000/svg", "");
    for needle in ["http://", "https://", " src=", "<link", "@import"] {
        assert!(!fetches.contains(needle), "the page refers to {needle}");
    }
    (html, data)
}

#[test]
fn a_known_log_gives_its_numbers() {
    let dir = Scratch::new("log");
    let (log, html) = (dir.path("log.csv"), dir.path("log.html"));
    std::fs::write(&log, LOG).unwrap();
    let out = run(&picture_bin(), &[&log, Path::new("-o"), &html]);
    assert!(
        out.contains("peak in use: 3670016 bytes; events: 9"),
        "{out}"
    );
    let (text, data) = page(&html);
    assert_eq!(data["peak_in_use"], 3_670_016);
    assert_eq!(data["peak_event"], 2);
    assert!(
        (data["peak_x"].as_f64().unwrap() - 0.2).abs() < 1e-9,
        "{data}"
    );
    assert_eq!(data["x_is_seconds"], true);
    assert_eq!(data["events"], 9);
    assert_eq!(data["allocations"], 4);
    assert_eq!(data["frees"], 4);
    assert_eq!(data["failures"], 1);
    assert_eq!(data["peak_reserved"], Value::Null, "a log does not know");
    // Stream 6 peaks at 2 MiB + 256 KiB (line 6), stream 5 at 1.5 MiB.
    let streams = data["streams"].as_array().unwrap();
    assert_eq!(streams[0]["name"], "stream 6");
    assert_eq!(streams[0]["peak"], 2_359_296);
    assert_eq!(streams[0]["at_peak"], 2_097_152);
    assert_eq!(streams[1]["name"], "stream 5");
    assert_eq!(streams[1]["peak"], 1_572_864);
    let largest: Vec<u64> = data["largest"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["size"].as_u64().unwrap())
        .collect();
    assert_eq!(largest, [2_097_152, 1_048_576, 524_288]);
    assert_eq!(data["largest"][0]["addr"], 0x7f00_0010_0000u64);
    // One region of the address map: the three live blocks, adjacent.
    assert_eq!(data["regions"][0]["base"], 0x7f00_0000_0000u64);
    assert_eq!(data["regions"][0]["size"], 3_670_016);
    // What a person reads.
    assert!(text.contains(r#"peak in use <b id="peak-in-use">3.50 MiB</b> (3670016 bytes)"#));
    assert!(text.contains("peak at <b>0.200000 s</b> (event 3)"));
    assert!(text.contains("0x7f0000100000"));
}

#[test]
fn a_log_without_times_is_drawn_by_event_number() {
    let dir = Scratch::new("notime");
    let (log, html) = (dir.path("log.csv"), dir.path("log.html"));
    std::fs::write(
        &log,
        "Thread,Action,Pointer,Size\n1,allocate,0x1000,512\n1,allocate,0x2000,256\n1,free,0x1000,512\n1,free,0x9999,8\n",
    )
    .unwrap();
    run(&picture_bin(), &[&log, Path::new("-o"), &html]);
    let (_, data) = page(&html);
    assert_eq!(data["x_is_seconds"], false);
    assert_eq!(data["peak_in_use"], 768);
    assert_eq!(data["unmatched_frees"], 1);
}

#[test]
fn a_history_and_a_snapshot_are_drawn() {
    let dir = Scratch::new("json");
    let device = Device::simulated(SimConfig::default());
    let pool = PoolResource::new(
        CudaResource::new(&device),
        PoolOptions {
            initial: 4 << 20,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let mr = HistoryAdaptor::new(pool, HistoryOptions::default());
    mr.start();
    let (a, b) = (
        device.create_stream().unwrap(),
        device.create_stream().unwrap(),
    );
    let p = mr.allocate(1 << 20, &a).unwrap();
    let q = mr.allocate(300_000, &b).unwrap();
    let r = mr.allocate(5000, &a).unwrap();
    // SAFETY: allocated above, unused, freed once.
    unsafe { mr.deallocate(q, 300_000, &b).unwrap() };
    let snapshot = mr.memory_snapshot().unwrap();
    let history = mr.history();
    for (ptr, bytes) in [(p, 1 << 20), (r, 5000)] {
        // SAFETY: as above.
        unsafe { mr.deallocate(ptr, bytes, &a).unwrap() };
    }
    let (hist, snap) = (dir.path("history.json"), dir.path("snapshot.json"));
    std::fs::write(&hist, serde_json::to_string(&history).unwrap()).unwrap();
    std::fs::write(&snap, serde_json::to_string_pretty(&snapshot).unwrap()).unwrap();

    let out = dir.path("history.html");
    run(&picture_bin(), &[&hist, Path::new("-o"), &out]);
    let (_, data) = page(&out);
    assert_eq!(data["peak_in_use"], (1 << 20) + 300_000 + 5000);
    assert_eq!(data["allocations"], 3);
    assert_eq!(data["streams"].as_array().unwrap().len(), 2);

    let out = dir.path("snapshot.html");
    run(&picture_bin(), &[&snap, Path::new("-o"), &out]);
    let (text, data) = page(&out);
    // In use: the two live blocks (rounded to 256); reserved: the pool's 4 MiB.
    assert_eq!(data["peak_in_use"], (1 << 20) + 5120);
    assert_eq!(data["peak_reserved"], 4 << 20);
    let largest: Vec<u64> = data["largest"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["size"].as_u64().unwrap())
        .collect();
    assert_eq!(
        largest,
        [1 << 20, 5000],
        "sizes as asked: the history tracked them"
    );
    assert_eq!(data["regions"][0]["size"], 4 << 20);
    assert!(text.contains("no timeline"));
}

#[test]
fn the_replay_draws_its_resource() {
    let dir = Scratch::new("replay");
    let (log, html) = (dir.path("log.csv"), dir.path("replay.html"));
    std::fs::write(&log, LOG).unwrap();
    let out = run(
        &replay_bin(),
        &[
            &log,
            Path::new("--device"),
            Path::new("sim"),
            Path::new("--picture"),
            &html,
        ],
    );
    assert!(out.contains("picture: "), "{out}");
    let (text, data) = page(&html);
    assert_eq!(data["peak_in_use"], 3_670_016);
    // The pool reserved at least the peak, and the address map is its snapshot (one chunk or
    // more, tiled with free and in-use blocks).
    assert!(
        data["peak_reserved"].as_u64().unwrap() >= 3_670_016,
        "{data}"
    );
    assert!(
        text.contains("free, in that stream"),
        "the snapshot's legend"
    );
    let mapped: u64 = data["regions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["size"].as_u64().unwrap())
        .sum();
    assert!(mapped >= 3_670_016, "{data}");
}

/// Events out of time order (RMM's logger stamps a line before it takes its lock, and so does
/// `HistoryAdaptor`): the timeline spans the earliest event to the latest, and a picture is
/// drawn, by the picture tool and by the replay's `--picture`.
#[test]
fn a_log_out_of_time_order_is_drawn() {
    let dir = Scratch::new("out-of-order");
    let (log, html) = (dir.path("log.csv"), dir.path("log.html"));
    std::fs::write(
        &log,
        "Thread,Time,Action,Pointer,Size,Stream\n\
         1,00:00:00.100,allocate,0x100,256,0\n\
         2,00:00:00.500,allocate,0x200,256,0\n\
         1,00:00:00.200,free,0x100,256,0\n",
    )
    .unwrap();
    run(&picture_bin(), &[&log, Path::new("-o"), &html]);
    let (_, data) = page(&html);
    assert_eq!(data["peak_in_use"], 512);
    assert_eq!(data["peak_event"], 1);
    // The peak is the second line's, 0.4 s after the earliest.
    assert!(
        (data["peak_x"].as_f64().unwrap() - 0.4).abs() < 1e-9,
        "{data}"
    );

    let replayed = dir.path("replay.html");
    run(
        &replay_bin(),
        &[
            &log,
            Path::new("--device"),
            Path::new("sim"),
            Path::new("--picture"),
            &replayed,
        ],
    );
    let (_, data) = page(&replayed);
    assert_eq!(data["peak_in_use"], 512);
}

/// A history whose next-to-last event was pushed before the last one but read its clock after
/// it (10 µs later, in a 10 ms history) is drawn.
#[test]
fn a_history_out_of_time_order_is_drawn() {
    let dir = Scratch::new("history-out-of-order");
    let mut events = Vec::new();
    let mut t = 1_000_000u64;
    for i in 0..1000u64 {
        for action in ["allocate", "free"] {
            events.push(format!(
                r#"{{"thread":1,"time_us":{t},"action":"{action}","ptr":{},"size":256,"stream":1}}"#,
                0x1000 + i * 0x1000
            ));
            t += 5;
        }
    }
    let n = events.len();
    events[n - 2] = events[n - 2].replace(&format!("{}", t - 10), &format!("{t}"));
    let (hist, html) = (dir.path("history.json"), dir.path("history.html"));
    std::fs::write(
        &hist,
        format!(
            r#"{{"capacity":4096,"dropped":0,"events":[{}]}}"#,
            events.join(",")
        ),
    )
    .unwrap();
    run(&picture_bin(), &[&hist, Path::new("-o"), &html]);
    let (_, data) = page(&html);
    assert_eq!(data["allocations"], 1000);
    assert_eq!(data["frees"], 1000);
    assert_eq!(data["peak_in_use"], 256);
}

/// Runs the picture tool on `input`, which it must refuse: exit code 1 (not a panic's 101),
/// within 30 s, no page written. Returns what it wrote to stderr.
fn refused(input: &Path, html: &Path) -> String {
    let mut cmd = Command::new(picture_bin());
    cmd.arg(input).arg("-o").arg(html);
    let out = common::run_with_limit(cmd, std::time::Duration::from_secs(30))
        .unwrap_or_else(|| panic!("{}: still running after 30 s", input.display()));
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!html.exists(), "a page was written");
    stderr
}

/// A snapshot from a file whose blocks do not tile their chunks (a chunk of 256 bytes holding
/// a block of 10^12 bytes made the address map loop, a rectangle per row of the block) is
/// refused, naming the block.
#[test]
fn a_snapshot_whose_blocks_do_not_tile_their_chunks_is_refused() {
    let dir = Scratch::new("bad-snapshot");
    let chunk = |blocks: &str| {
        format!(
            r#"{{"resource":"pool","taken_at_us":0,"reserved":256,"chunks":[{{"base":0,"size":256,"kind":"upstream","blocks":[{blocks}]}}]}}"#
        )
    };
    let cases = [
        (
            chunk(r#"{"addr":0,"size":1000000000000,"state":"in_use"}"#),
            "the chunk at 0x0 of 256 bytes: its block 0 (at 0x0, of 1000000000000 bytes) runs past the chunk's end (0x100)",
        ),
        (
            chunk(r#"{"addr":0,"size":128,"state":"in_use"},{"addr":192,"size":64,"state":"free"}"#),
            "the chunk at 0x0 of 256 bytes: its block 1 (at 0xc0, of 64 bytes) does not start where the one before it ends (0x80)",
        ),
        (
            chunk(r#"{"addr":0,"size":128,"state":"in_use"}"#),
            "the chunk at 0x0 of 256 bytes: its blocks end at 0x80, short of the chunk's end (0x100)",
        ),
    ];
    for (text, expected) in cases {
        let (snap, html) = (dir.path("snapshot.json"), dir.path("snapshot.html"));
        std::fs::write(&snap, text).unwrap();
        let stderr = refused(&snap, &html);
        assert!(
            stderr.contains(expected),
            "expected `{expected}` in: {stderr}"
        );
    }
}

/// Sizes and addresses from a file that pass `u64::MAX` (in the bytes in use, or at an
/// allocation's end, or in a snapshot's chunks) are refused with the line, event or chunk
/// named; they panicked in a debug build and gave wrapped numbers in a release build. The
/// replay's `--picture` refuses such a log before replaying it.
#[test]
fn sizes_and_addresses_that_overflow_are_refused() {
    let dir = Scratch::new("overflow");
    let header = "Thread,Time,Action,Pointer,Size,Stream\n";
    let cases = [
        (
            "log.csv",
            format!(
                "{header}1,00:00:00.0,allocate,0x1000,18446744073709551615,0\n\
                 1,00:00:00.1,allocate,0x2000,16,0\n"
            ),
            "line 2: an allocation of 18446744073709551615 bytes at 0x1000 passes the end of the address space",
        ),
        (
            "log.csv",
            format!("{header}1,00:00:00.0,allocate,0xffffffffffffff00,512,0\n"),
            "line 2: an allocation of 512 bytes at 0xffffffffffffff00 passes the end of the address space",
        ),
        (
            // Each inside the address space, overlapping: 2^64 bytes in use.
            "log.csv",
            format!(
                "{header}1,00:00:00.0,allocate,0x100,9223372036854775808,0\n\
                 1,00:00:00.1,allocate,0x200,9223372036854775808,0\n"
            ),
            "line 3: an allocation of 9223372036854775808 bytes while 9223372036854775808 are in use",
        ),
        (
            "history.json",
            r#"{"capacity":4,"dropped":0,"events":[
                {"thread":1,"time_us":1,"action":"allocate","ptr":256,"size":9223372036854775808,"stream":1},
                {"thread":1,"time_us":2,"action":"allocate","ptr":512,"size":9223372036854775808,"stream":1}]}"#
                .to_owned(),
            "event 2 of the history: an allocation of 9223372036854775808 bytes while 9223372036854775808 are in use",
        ),
        (
            "snapshot.json",
            r#"{"resource":"pool","taken_at_us":0,"reserved":0,"chunks":[
                {"base":0,"size":9223372036854775808,"kind":"upstream","blocks":[{"addr":0,"size":9223372036854775808,"state":"in_use"}]},
                {"base":0,"size":9223372036854775808,"kind":"upstream","blocks":[{"addr":0,"size":9223372036854775808,"state":"in_use"}]}]}"#
                .to_owned(),
            "the chunk at 0x0 of 9223372036854775808 bytes: with it, the chunks' sizes add up past u64::MAX",
        ),
    ];
    for (name, text, expected) in &cases {
        let (input, html) = (dir.path(name), dir.path("overflow.html"));
        std::fs::write(&input, text).unwrap();
        let stderr = refused(&input, &html);
        assert!(
            stderr.contains(expected),
            "expected `{expected}` in: {stderr}"
        );
    }

    let log = dir.path("log.csv");
    std::fs::write(&log, &cases[2].1).unwrap();
    let html = dir.path("replay.html");
    let mut cmd = Command::new(replay_bin());
    cmd.arg(&log)
        .args(["--device", "sim", "--picture"])
        .arg(&html);
    let out = common::run_with_limit(cmd, std::time::Duration::from_secs(30))
        .expect("replay --picture: still running after 30 s");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(cases[2].2), "{stderr}");
    assert!(!html.exists(), "a page was written");
}

/// A binning resource's snapshot has a part per bin and one for its pool, and the bins' chunks
/// are blocks of the pool's chunk: the first bin chunk starts where the pool's chunk does.
/// Regions were deduplicated by their base, so the pool's whole chunk (with the 8 MiB
/// allocation alive at the peak) was dropped from the replay's address map.
#[test]
fn the_replay_of_a_binning_resource_draws_its_pool_and_its_bins() {
    let dir = Scratch::new("binning");
    let (log, html) = (dir.path("log.csv"), dir.path("replay.html"));
    std::fs::write(
        &log,
        "Thread,Time,Action,Pointer,Size,Stream
1,00:00:00.000001,allocate,0x1000,1000,0
1,00:00:00.000002,allocate,0x100000,8388608,0
1,00:00:00.000003,free,0x1000,1000,0
1,00:00:00.000004,free,0x100000,8388608,0
",
    )
    .unwrap();
    let out = run(
        &replay_bin(),
        &[
            &log,
            Path::new("--device"),
            Path::new("sim"),
            Path::new("--resource"),
            Path::new("binning"),
            Path::new("--initial"),
            Path::new("64MiB"),
            Path::new("--picture"),
            &html,
        ],
    );
    assert!(out.contains("picture: "), "{out}");
    let (_, data) = page(&html);
    let sizes: Vec<u64> = data["regions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["size"].as_u64().unwrap())
        .collect();
    // The pool's chunk (64 MiB: the 8 MiB allocation and the bin's chunk in it), and the
    // bin's chunk (128 blocks of 256 KiB) drawn on its own.
    assert!(sizes.contains(&(64 << 20)), "the pool's chunk: {sizes:?}");
    assert!(sizes.contains(&(32 << 20)), "the bin's chunk: {sizes:?}");
}

/// The snapshot of a binning resource over a pool: the pool's part shows each bin's chunk as a
/// block in use, and the bin's part shows that chunk again with its own blocks. In use counted
/// the bin's chunk twice (as a block of the pool and through its blocks), and the largest
/// allocation listed was the bin's chunk, which no one asked for.
#[test]
fn a_binning_snapshot_counts_its_bins_chunks_once() {
    use streamalloc::resource::binning::BinningResource;

    let dir = Scratch::new("binning-snapshot");
    let device = Device::simulated(SimConfig::default());
    let pool = PoolResource::new(
        CudaResource::new(&device),
        PoolOptions {
            initial: 64 << 20,
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let mr = BinningResource::builder(pool)
        .bins_pow2(18, 22)
        .blocks_per_chunk(128)
        .build()
        .unwrap();
    let stream = device.create_stream().unwrap();
    let small = mr.allocate(1000, &stream).unwrap();
    let large = mr.allocate(8 << 20, &stream).unwrap();
    let snapshot = mr.memory_snapshot().unwrap();
    // SAFETY: allocated above, unused, freed once.
    unsafe {
        mr.deallocate(small, 1000, &stream).unwrap();
        mr.deallocate(large, 8 << 20, &stream).unwrap();
    }
    let snap = dir.path("snapshot.json");
    std::fs::write(&snap, serde_json::to_string(&snapshot).unwrap()).unwrap();
    let out = dir.path("snapshot.html");
    run(&picture_bin(), &[&snap, Path::new("-o"), &out]);
    let (_, data) = page(&out);
    // The small one's block of its bin (256 KiB) and the large one; not the bin's 32 MiB chunk.
    assert_eq!(data["peak_in_use"], (256 << 10) + (8 << 20), "{data}");
    let largest: Vec<u64> = data["largest"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["size"].as_u64().unwrap())
        .collect();
    assert_eq!(largest, [8 << 20, 256 << 10], "{data}");
}
