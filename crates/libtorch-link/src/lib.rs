//! Build-script helper for packages whose binaries link libtorch.
//!
//! Without it, a binary built against the venv's libtorch only starts with
//! `LD_LIBRARY_PATH` pointing there (`libtorch_cpu.so: cannot open shared object file`),
//! and `--as-needed` drops `libtorch_cuda.so` (reached only through static initialisers),
//! so CUDA tensors fail unless it is `LD_PRELOAD`ed (GPU.md).
//!
//! The calling package must depend on `torch-sys` directly: cargo hands torch-sys's
//! `libtorch_lib` metadata (the directory it linked against) only to direct dependents,
//! as `DEP_TCH_LIBTORCH_LIB`.

use std::path::{Path, PathBuf};

/// The environment variable cargo sets from torch-sys's `cargo:libtorch_lib=` line.
pub const LIBTORCH_LIB_ENV: &str = "DEP_TCH_LIBTORCH_LIB";

/// Linker arguments for a libtorch in `lib_dir`: a run path to it, and libtorch_cuda kept
/// as a needed library when that libtorch has one (a CPU-only libtorch does not).
pub fn link_args(lib_dir: &Path) -> Vec<String> {
    // A RUNPATH, not an RPATH: LD_LIBRARY_PATH still wins, so a node whose torch lives
    // elsewhere points the binary at it (docs/gpu.md, "Running the binaries on another machine").
    let mut args = vec![
        "-Wl,--enable-new-dtags".to_string(),
        format!("-Wl,-rpath,{}", lib_dir.display()),
    ];
    if lib_dir.join("libtorch_cuda.so").is_file() {
        args.push("-Wl,--no-as-needed,-ltorch_cuda,--as-needed".to_string());
    }
    args
}

/// Prints the `cargo:` lines for every linked target (binaries, tests, benches, examples)
/// of the calling package. Call it from `build.rs`.
pub fn link_libtorch() {
    println!("cargo:rerun-if-env-changed={LIBTORCH_LIB_ENV}");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        return;
    }
    let Some(dir) = std::env::var_os(LIBTORCH_LIB_ENV).map(PathBuf::from) else {
        println!(
            "cargo:warning={LIBTORCH_LIB_ENV} is not set (does this package depend on torch-sys \
             directly?): binaries will need LD_LIBRARY_PATH to find libtorch"
        );
        return;
    };
    for arg in link_args(&dir) {
        println!("cargo:rustc-link-arg={arg}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_is_linked_only_when_the_libtorch_has_it() {
        let dir = std::env::temp_dir().join(format!("libtorch-link-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let args = link_args(&dir);
        assert!(args.contains(&format!("-Wl,-rpath,{}", dir.display())));
        assert!(!args.iter().any(|a| a.contains("torch_cuda")));
        std::fs::write(dir.join("libtorch_cuda.so"), b"").unwrap();
        assert!(link_args(&dir).iter().any(|a| a.contains("-ltorch_cuda")));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
