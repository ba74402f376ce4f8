//! `driver` and `worker` start without LD_LIBRARY_PATH and use CUDA without LD_PRELOAD:
//! see manta-libtorch-link.
fn main() {
    manta_libtorch_link::link_libtorch();
}
