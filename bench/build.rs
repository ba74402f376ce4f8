//! The bench binaries start without LD_LIBRARY_PATH, and libtorch_cuda.so (reached only
//! through static initialisers) stays linked so CUDA works: see manta-libtorch-link.
fn main() {
    manta_libtorch_link::link_libtorch();
}
