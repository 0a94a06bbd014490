//! `streamalloc-replay`: replays an RMM-format memory-event log against one of streamalloc's
//! resources. `streamalloc-replay --help` for its options; the code and its documentation are
//! in the `streamalloc-tools` library (`src/replay/`).

fn main() -> std::process::ExitCode {
    streamalloc_tools::replay_main()
}
