//! `driver generate`: one generate call on a checkpoint through the native engine, so a
//! user can smoke-test a model and anyone can check parity with Hugging Face from outside.

use std::path::Path;

use anyhow::{bail, Context};
use manta_engine::{Engine, GenerateRequest, NativeEngine, NativeEngineOptions, SamplingParams};
use manta_model::ModelConfig;
use manta_tokenizer::Tokenizer;
use serde::Serialize;
use tch::Device;

use crate::cli::GenerateArgs;

/// What `--json` prints: the generated ids and their log-probs, in that key order.
#[derive(Debug, Serialize)]
struct JsonOutput<'a> {
    output_ids: &'a [u32],
    logprobs: &'a [f32],
}

/// Loads `--model`, generates from the prompt and prints the result on stdout.
pub async fn generate(args: &GenerateArgs) -> anyhow::Result<()> {
    let dir = &args.model;
    let cfg = load_config(dir)?;
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        bail!(
            "--temperature {} must be a finite number >= 0",
            args.temperature
        );
    }
    // Loaded only when needed: --prompt-ids works without tokenizer files.
    let mut tokenizer = None;
    let input_ids = match (&args.prompt, &args.prompt_ids) {
        (Some(text), None) => {
            let tok = Tokenizer::from_dir(dir)
                .with_context(|| format!("--prompt needs the tokenizer of {}", dir.display()))?;
            let ids = tok
                .encode(text)
                .with_context(|| format!("--prompt {text:?} cannot be tokenized"))?;
            tokenizer = Some(tok);
            ids
        }
        (None, Some(ids)) => ids.clone(),
        _ => bail!("give exactly one of --prompt and --prompt-ids"),
    };
    if input_ids.is_empty() {
        bail!("the prompt is empty: --prompt / --prompt-ids must give at least one token");
    }
    if let Some(bad) = input_ids.iter().find(|&&t| i64::from(t) >= cfg.vocab_size) {
        bail!(
            "--prompt-ids: token id {bad} is outside the vocabulary of {} (vocab_size {})",
            dir.join("config.json").display(),
            cfg.vocab_size
        );
    }
    let stop_token_ids = cfg
        .eos_token_ids()
        .iter()
        .map(|&id| {
            u32::try_from(id).with_context(|| {
                format!(
                    "{}: eos_token_id {id} is not a token id",
                    dir.join("config.json").display()
                )
            })
        })
        .collect::<anyhow::Result<Vec<u32>>>()?;

    let engine = NativeEngine::start(NativeEngineOptions {
        seed: args.seed,
        max_running_requests: 1,
        ..NativeEngineOptions::new(dir.clone(), Device::cuda_if_available())
    })
    .with_context(|| format!("cannot load the model in {}", dir.display()))?;
    let out = engine
        .generate(GenerateRequest {
            input_ids,
            params: SamplingParams {
                max_new_tokens: args.max_new_tokens,
                temperature: args.temperature,
                stop_token_ids,
                ..SamplingParams::default()
            },
            rid: None,
            return_routed_experts: false,
        })
        .await
        .context("generation failed")?;

    if args.json {
        let json = serde_json::to_string(&JsonOutput {
            output_ids: &out.output_ids,
            logprobs: &out.logprobs,
        })?;
        println!("{json}");
    } else {
        let tok = match tokenizer {
            Some(tok) => tok,
            None => Tokenizer::from_dir(dir).with_context(|| {
                format!(
                    "printing text needs the tokenizer of {} (use --json for ids)",
                    dir.display()
                )
            })?,
        };
        println!("{}", tok.decode(&out.output_ids, true)?);
    }
    Ok(())
}

/// Reads `dir/config.json` and checks that the directory holds weights: this command never
/// random-initialises, since its output is meant to describe the checkpoint.
fn load_config(dir: &Path) -> anyhow::Result<ModelConfig> {
    if !dir.is_dir() {
        bail!("--model {}: no such directory", dir.display());
    }
    let cfg = ModelConfig::from_file(&dir.join("config.json"))
        .with_context(|| format!("--model {}: cannot read config.json", dir.display()))?;
    if !dir.join("model.safetensors").is_file()
        && !dir.join("model.safetensors.index.json").is_file()
    {
        bail!(
            "--model {}: no weights (model.safetensors or model.safetensors.index.json)",
            dir.display()
        );
    }
    Ok(cfg)
}
