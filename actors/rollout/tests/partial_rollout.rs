//! Partial rollouts: a generate call that a weight update aborts goes on from its
//! partial output with the new weights, and every token keeps the version that made it.
//!
//! The engine is the real native engine (tiny model, CPU) and the environment the real
//! built-in server. Only the moment of the interruption is staged: a thin wrapper cuts
//! the first generate call after a fixed number of tokens, reports it as aborted, and
//! loads the engine's weights again as the next version — what a weight sync with
//! `PauseMode::Abort` does, at a token position a test can rely on.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use manta_config::TrainConfig;
use manta_core::SampleStatus;
use manta_engine::{
    Engine, EngineError, FinishReason, GenerateOutput, GenerateRequest, NamedTensors, NativeEngine,
    NativeEngineOptions,
};
use manta_rollout::chat::ChatFormat;
use manta_rollout::episode::run_episode;
use manta_rollout::ors::{OrsClient, OrsClientOptions};
use manta_rollout::{
    EnvironmentHandle, EpisodeContext, EpisodeRequest, GenerationSettings, TaskRef,
};
use manta_tokenizer::Tokenizer;
use serde_json::json;

/// Tokens the first generate call produces before the staged weight update.
const CUT: usize = 3;
const MAX_RESPONSE_LEN: usize = 8;

/// The native engine, with its first generate call interrupted by a weight update.
struct InterruptedOnce {
    inner: Arc<NativeEngine>,
    calls: AtomicUsize,
}

#[async_trait]
impl Engine for InterruptedOnce {
    async fn generate(&self, mut request: GenerateRequest) -> Result<GenerateOutput, EngineError> {
        if self.calls.fetch_add(1, Ordering::SeqCst) > 0 {
            return self.inner.generate(request).await;
        }
        request.params.max_new_tokens = CUT;
        request.params.ignore_eos = true;
        let mut out = self.inner.generate(request).await?;
        assert_eq!(out.output_ids.len(), CUT, "the staged call runs to its cut");
        out.finish = FinishReason::Abort;
        let weights = self.inner.read_weights().await?;
        let next = self.inner.weight_version() + 1;
        self.inner.update_weights(weights, next).await?;
        Ok(out)
    }
    async fn update_weights(&self, w: NamedTensors, v: u64) -> Result<(), EngineError> {
        self.inner.update_weights(w, v).await
    }
    fn weight_version(&self) -> u64 {
        self.inner.weight_version()
    }
}

fn model_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tiny-qwen3")
}

async fn digits_episode(partial_rollout: bool) -> manta_core::Sample {
    let server = manta_envs::serve(
        "127.0.0.1:0".parse().unwrap(),
        manta_envs::builtin_environments(),
    )
    .await
    .unwrap();
    let yaml = "environments:\n  manta/Digits:\n    max_turns: 1\n";
    let train = TrainConfig::from_yaml_str(yaml, Path::new("test.yaml")).unwrap();
    let tokenizer = Arc::new(Tokenizer::from_dir(&model_dir()).unwrap());
    let native = NativeEngine::start(NativeEngineOptions {
        seed: 5,
        ..NativeEngineOptions::new(model_dir(), tch::Device::Cpu)
    })
    .unwrap();
    let engine = Arc::new(InterruptedOnce {
        inner: native,
        calls: AtomicUsize::new(0),
    });
    let ctx = EpisodeContext {
        engine,
        chat: ChatFormat::new(tokenizer, train.thinking),
        system_prompt_template: train.system_prompt_template.clone(),
        // No stop tokens: the resumed call runs to the token budget, so the count of
        // each version's tokens is known.
        stop_token_ids: Vec::new(),
        upload: None,
    };
    let client = OrsClient::new(OrsClientOptions {
        variant: Some("digits".into()),
        ..OrsClientOptions::new(server.base_url())
    })
    .unwrap();
    let (name, config) = train.environments.into_iter().next().unwrap();
    let env = EnvironmentHandle {
        name,
        client,
        config,
    };
    let request = EpisodeRequest {
        sample_id: 3,
        group_index: 0,
        index: 0,
        task: TaskRef {
            environment: "manta/Digits".into(),
            split: "train".into(),
            task_spec: json!({"target": 4}),
            task_hash: "h".into(),
            server_env: "digits".into(),
        },
    };
    let settings = GenerationSettings {
        temperature: 1.0,
        top_p: 1.0,
        top_k: -1,
        max_response_len: MAX_RESPONSE_LEN,
        context_len: 4096,
        partial_rollout,
        return_routed_experts: false,
    };
    let sample = run_episode(&ctx, &env, &request, settings).await;
    server.shutdown().await;
    sample
}

#[tokio::test(flavor = "multi_thread")]
async fn an_interrupted_call_resumes_with_the_new_weights_and_keeps_token_versions() {
    let sample = digits_episode(true).await;
    assert_ne!(
        sample.status,
        SampleStatus::Aborted,
        "{:?}",
        sample.metadata
    );
    assert_ne!(sample.status, SampleStatus::Failed, "{:?}", sample.metadata);
    sample.validate().unwrap();
    let versions = &sample.metadata.weight_versions;
    assert_eq!(versions.len(), sample.response_length);
    // One turn: the first CUT tokens came from version 0, the rest of the turn's
    // budget from version 1 after the update.
    let generated: Vec<u64> = versions
        .iter()
        .zip(&sample.loss_mask)
        .filter(|(_, &m)| m == 1)
        .map(|(&v, _)| v)
        .collect();
    let mut want = vec![0; CUT];
    want.extend(vec![1; MAX_RESPONSE_LEN - CUT]);
    assert_eq!(generated, want);
    // The sample's version is its oldest token's.
    assert_eq!(sample.weight_version, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn without_partial_rollout_the_interrupted_episode_ends_aborted() {
    let sample = digits_episode(false).await;
    assert_eq!(sample.status, SampleStatus::Aborted);
    assert_eq!(sample.metadata.weight_versions, vec![0; CUT]);
}
