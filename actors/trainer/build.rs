//! The trainer's test binaries keep libtorch_cuda.so linked (reached only through static
//! initialisers, `--as-needed` drops it), so its GPU tests see CUDA: see manta-libtorch-link.
fn main() {
    manta_libtorch_link::link_libtorch();
}
