//! Regenerates the shipped tiny model files: `cargo run -p manta-tokenizer --example write_tiny_assets [DIR]`
//! (default DIR: `<workspace>/assets/tiny-qwen3`).

use std::path::PathBuf;

fn main() -> Result<(), manta_tokenizer::TokenizerError> {
    let dir = std::env::args_os().nth(1).map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/tiny-qwen3"),
        PathBuf::from,
    );
    manta_tokenizer::write_tiny_model_files(&dir)?;
    println!("wrote {}", dir.display());
    Ok(())
}
