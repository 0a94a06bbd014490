//! `streamalloc-picture`: draws a memory trace (an RMM-format log, a history or a snapshot as
//! JSON) as one self-contained HTML page. `streamalloc-picture --help` for its options; the code
//! and its documentation are in the `streamalloc-tools` library (`src/picture/`).

fn main() -> std::process::ExitCode {
    streamalloc_tools::picture_main()
}
