//! libtorch_cuda.so is only reached through static initialisers, so `--as-needed`
//! drops it and CUDA tensors then fail at run time; link it explicitly for the bench
//! binaries (GPU.md).
fn main() {
    println!("cargo:rustc-link-arg-bins=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
}
