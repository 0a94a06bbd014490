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
