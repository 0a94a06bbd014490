//! What the tools' tests share.

use std::path::PathBuf;

/// The tool `name`: where cargo built it, or, in binaries packed by `shared/tools/gpu-pack` for
/// a GPU machine (tests in `.gpu/tests`, binaries in `.gpu/bin`), beside them. `built` is
/// `env!("CARGO_BIN_EXE_<name>")`, which only the test's own crate can name.
pub fn tool(built: &str, name: &str) -> PathBuf {
    let built = PathBuf::from(built);
    if built.exists() {
        return built;
    }
    std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.join("bin").join(name)))
        .filter(|packed| packed.exists())
        .unwrap_or(built)
}

/// Runs `cmd` with its output captured, killing it after `limit`: `None` if it had to be
/// killed. For inputs that once made a tool hang or loop, so that the test cannot.
#[allow(dead_code)] // not every test file uses it
pub fn run_with_limit(
    mut cmd: std::process::Command,
    limit: std::time::Duration,
) -> Option<std::process::Output> {
    use std::process::Stdio;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the tool");
    // Read the pipes while waiting, so that a child writing much cannot block on them.
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let out = std::thread::spawn(move || {
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut out, &mut v).ok();
        v
    });
    let err = std::thread::spawn(move || {
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut err, &mut v).ok();
        v
    });
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the tool") {
            break Some(status);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let (stdout, stderr) = (out.join().unwrap(), err.join().unwrap());
    Some(std::process::Output {
        status: status?,
        stdout,
        stderr,
    })
}
