//! Compiles proto/*.proto with tonic/prost, using the protoc that ships inside
//! the `protoc-bin-vendored` crate so no system protoc is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", protoc);
    let files = [
        "proto/common.proto",
        "proto/cluster.proto",
        "proto/rollout.proto",
        "proto/trainer.proto",
        "proto/weight_sync.proto",
        "proto/tensorboard.proto",
    ];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    tonic_prost_build::configure().compile_protos(&files, &["proto"])?;
    Ok(())
}
