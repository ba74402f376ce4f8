//! The episode loop against Manta's built-in ORS server, over real HTTP/SSE, with the
//! tiny model's real tokenizer and chat template. The policy is scripted (an `Engine`
//! that replays fixed turns) because a random-init model does not write tool calls;
//! everything else — sessions, tools, rewards, masks — is the production path.

use std::path::Path;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use manta_config::TrainConfig;
use manta_core::SampleStatus;
use manta_engine::{
    Engine, EngineError, FinishReason, GenerateOutput, GenerateRequest, NamedTensors,
};
use manta_rollout::chat::ChatFormat;
use manta_rollout::episode::{run_episode, NO_TOOL_CALL_MESSAGE};
use manta_rollout::ors::{OrsClient, OrsClientOptions};
use manta_rollout::{
    EnvironmentHandle, EpisodeContext, EpisodeRequest, GenerationSettings, TaskRef,
};
use manta_tokenizer::Tokenizer;
use serde_json::json;

/// Replays scripted assistant turns; records every prompt it was given.
struct ScriptedPolicy {
    tokenizer: Arc<Tokenizer>,
    turns: Mutex<Vec<&'static str>>,
    prompts: Mutex<Vec<Vec<u32>>>,
}

#[async_trait]
impl Engine for ScriptedPolicy {
    async fn generate(&self, request: GenerateRequest) -> Result<GenerateOutput, EngineError> {
        self.prompts.lock().unwrap().push(request.input_ids.clone());
        let text = self.turns.lock().unwrap().remove(0);
        let mut ids = self.tokenizer.encode(text).unwrap();
        ids.truncate(request.params.max_new_tokens);
        let stopped = ids
            .last()
            .is_some_and(|t| request.params.stop_token_ids.contains(t));
        Ok(GenerateOutput {
            logprobs: (0..ids.len()).map(|i| -0.5 - i as f32).collect(),
            output_ids: ids,
            finish: if stopped {
                FinishReason::Stop
            } else {
                FinishReason::Length
            },
            weight_version: 7,
            ..GenerateOutput::default()
        })
    }
    async fn update_weights(&self, _: NamedTensors, _: u64) -> Result<(), EngineError> {
        Ok(())
    }
    fn weight_version(&self) -> u64 {
        7
    }
}

fn model_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tiny-qwen3")
}

async fn setup(
    config_yaml: &str,
    env: &str,
    turns: Vec<&'static str>,
) -> (
    manta_envs::ServerHandle,
    Arc<ScriptedPolicy>,
    EpisodeContext,
    EnvironmentHandle,
) {
    let server = manta_envs::serve(
        "127.0.0.1:0".parse().unwrap(),
        manta_envs::builtin_environments(),
    )
    .await
    .unwrap();
    let tokenizer = Arc::new(Tokenizer::from_dir(&model_dir()).unwrap());
    let policy = Arc::new(ScriptedPolicy {
        tokenizer: tokenizer.clone(),
        turns: Mutex::new(turns),
        prompts: Mutex::new(Vec::new()),
    });
    let train = TrainConfig::from_yaml_str(config_yaml, Path::new("test.yaml")).unwrap();
    let stop = ["<|im_end|>", "</tool_call>"]
        .iter()
        .filter_map(|t| tokenizer.token_to_id(t))
        .collect();
    let ctx = EpisodeContext {
        engine: policy.clone(),
        chat: ChatFormat::new(tokenizer, train.thinking),
        system_prompt_template: train.system_prompt_template.clone(),
        stop_token_ids: stop,
        upload: None,
    };
    let client = OrsClient::new(OrsClientOptions {
        variant: Some(env.to_string()),
        ..OrsClientOptions::new(server.base_url())
    })
    .unwrap();
    let (name, config) = train.environments.into_iter().next().unwrap();
    (
        server,
        policy,
        ctx,
        EnvironmentHandle {
            name,
            client,
            config,
        },
    )
}

fn request(env: &str, server_env: &str, spec: serde_json::Value) -> EpisodeRequest {
    EpisodeRequest {
        sample_id: 11,
        group_index: 2,
        index: 1,
        task: TaskRef {
            environment: env.into(),
            split: "train".into(),
            task_spec: spec,
            task_hash: "h".into(),
            server_env: server_env.into(),
        },
    }
}

const SETTINGS: GenerationSettings = GenerationSettings {
    temperature: 1.0,
    top_p: 1.0,
    top_k: -1,
    max_response_len: 64,
    context_len: 4096,
    partial_rollout: false,
    return_routed_experts: false,
};

#[tokio::test(flavor = "multi_thread")]
async fn multi_turn_counter_episode_keeps_per_step_rewards_and_masks() {
    let yaml = "environments:\n  manta/Counter:\n    reward_reduction: sum\n    max_turns: 6\n";
    let turns = vec![
        "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"amount\": 2}}\n</tool_call>",
        "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"amount\": }\n</tool_call>",
        "I think I am done.<|im_end|>",
        "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"amount\": \"x\"}}\n</tool_call>",
        "<tool_call>\n{\"name\": \"submit\", \"arguments\": {}}\n</tool_call>",
    ];
    let (server, policy, ctx, env) = setup(yaml, "counter", turns).await;
    let sample = run_episode(
        &ctx,
        &env,
        &request("manta/Counter", "counter", json!({"start": 1, "target": 3})),
        SETTINGS,
    )
    .await;
    assert_eq!(
        sample.status,
        SampleStatus::Completed,
        "{:?}",
        sample.metadata
    );
    let m = &sample.metadata;
    assert_eq!(m.stop_reason, "terminal");
    assert_eq!(m.num_turns, 5);
    // add(2), malformed JSON, (no call), add("x") rejected by validation, submit.
    assert_eq!(m.num_tool_calls, 4);
    assert_eq!(m.num_failed_tool_calls, 2);
    assert_eq!(m.step_rewards, vec![0.1, 1.0]);
    assert!((sample.reward - 1.1).abs() < 1e-9);
    assert_eq!(
        (
            sample.id,
            sample.group_index,
            sample.index,
            sample.weight_version
        ),
        (11, 2, 1, 7)
    );
    sample.validate().unwrap();

    // Loss mask is 1 exactly on the engine's tokens, and their log-probs are kept.
    let tok = ctx.chat.tokenizer();
    let prompt_len = sample.prompt_length();
    let response = &sample.tokens[prompt_len..];
    let generated: Vec<u32> = response
        .iter()
        .zip(&sample.loss_mask)
        .filter(|(_, &m)| m == 1)
        .map(|(&t, _)| t)
        .collect();
    let expected: Vec<u32> = [
        "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"amount\": 2}}\n</tool_call>",
        "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"amount\": }\n</tool_call>",
        "I think I am done.<|im_end|>",
        "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"amount\": \"x\"}}\n</tool_call>",
        "<tool_call>\n{\"name\": \"submit\", \"arguments\": {}}\n</tool_call>",
    ]
    .iter()
    .flat_map(|t| tok.encode(t).unwrap())
    .collect();
    assert_eq!(generated, expected);
    assert!(sample
        .rollout_log_probs
        .iter()
        .zip(&sample.loss_mask)
        .all(|(&lp, &m)| (m == 1) == (lp < 0.0)));

    // The conversation the trainer sees, decoded: tool results come back as user turns.
    let text = tok.decode(response, false).unwrap();
    assert!(
        text.contains("<|im_start|>user\n<tool_response>\nvalue is now 3"),
        "{text}"
    );
    assert!(
        text.contains("Error: malformed tool call: the tool call is not valid JSON"),
        "{text}"
    );
    assert!(text.contains(NO_TOOL_CALL_MESSAGE), "{text}");
    assert!(
        text.contains("Error: Tool input validation error"),
        "{text}"
    );

    // Each generate call saw exactly the tokens accumulated so far (no re-tokenization).
    let prompts = policy.prompts.lock().unwrap().clone();
    assert_eq!(prompts.len(), 5);
    for p in &prompts {
        assert_eq!(&sample.tokens[..p.len()], p.as_slice());
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn single_turn_plain_answer_goes_to_the_terminal_tool() {
    let yaml = "environments:\n  manta/Digits:\n    max_turns: 1\nsystem_prompt_template: 'Answer.{tools}'\n";
    let (server, _policy, ctx, env) = setup(yaml, "digits", vec!["77<|im_end|>"]).await;
    let sample = run_episode(
        &ctx,
        &env,
        &request("manta/Digits", "digits", json!({"target": 7})),
        SETTINGS,
    )
    .await;
    assert_eq!(sample.status, SampleStatus::Completed);
    assert_eq!(sample.metadata.step_rewards, vec![1.0]);
    assert_eq!(sample.reward, 1.0);
    assert_eq!(sample.metadata.num_tool_calls, 0);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn max_turns_truncates_and_adds_the_nonterminal_reward() {
    let yaml = "environments:\n  manta/Counter:\n    max_turns: 2\n    nonterminal_reward: -0.5\n";
    let turns = vec![
        "<tool_call>{\"name\": \"add\", \"arguments\": {\"amount\": 1}}</tool_call>",
        "<tool_call>{\"name\": \"add\", \"arguments\": {\"amount\": 1}}</tool_call>",
    ];
    let (server, _policy, ctx, env) = setup(yaml, "counter", turns).await;
    let sample = run_episode(
        &ctx,
        &env,
        &request("manta/Counter", "counter", json!({"start": 0, "target": 5})),
        SETTINGS,
    )
    .await;
    assert_eq!(sample.status, SampleStatus::Truncated);
    assert_eq!(sample.metadata.stop_reason, "max_turns");
    assert_eq!(sample.metadata.step_rewards, vec![0.1, 0.1]);
    assert!((sample.reward - (0.2 - 0.5)).abs() < 1e-9);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn unreachable_environment_gives_a_failed_sample_not_a_panic() {
    let yaml = "environments:\n  manta/Digits:\n    max_turns: 1\n";
    let (server, _policy, ctx, _) = setup(yaml, "digits", vec![]).await;
    let train = TrainConfig::from_yaml_str(yaml, Path::new("t.yaml")).unwrap();
    let env = EnvironmentHandle {
        name: "manta/Digits".into(),
        client: OrsClient::new(OrsClientOptions {
            request_timeout: std::time::Duration::from_secs(2),
            retry: manta_rollout::ors::RetryPolicy {
                max_attempts: 1,
                ..Default::default()
            },
            ..OrsClientOptions::new("http://127.0.0.1:9")
        })
        .unwrap(),
        config: train.environments["manta/Digits"].clone(),
    };
    let sample = run_episode(
        &ctx,
        &env,
        &request("manta/Digits", "digits", json!({"target": 1})),
        SETTINGS,
    )
    .await;
    assert_eq!(sample.status, SampleStatus::Failed);
    assert_eq!(sample.metadata.stop_reason, "environment_error");
    assert!(sample
        .metadata
        .error
        .as_deref()
        .unwrap_or("")
        .contains("opening session"));
    server.shutdown().await;
}

/// `thinking: true`: as the cookbook's generate.py, each turn's tokens through
/// `</think>` and the whitespace after it are out of the loss; the answer after it is
/// trained, and a turn without `</think>` is trained whole.
#[tokio::test(flavor = "multi_thread")]
async fn thinking_tokens_through_the_close_tag_are_out_of_the_loss() {
    let yaml =
        "environments:\n  manta/Counter:\n    reward_reduction: sum\n    max_turns: 4\nthinking: true\n";
    let think = "<think>\nadd two first\n</think>\n\n \r\n";
    let call = "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"amount\": 2}}\n</tool_call>";
    let submit = "<tool_call>\n{\"name\": \"submit\", \"arguments\": {}}\n</tool_call>";
    let turns = vec![
        Box::leak(format!("{think}{call}").into_boxed_str()) as &'static str,
        submit,
    ];
    let (server, _policy, ctx, env) = setup(yaml, "counter", turns).await;
    let sample = run_episode(
        &ctx,
        &env,
        &request("manta/Counter", "counter", json!({"start": 1, "target": 3})),
        GenerationSettings {
            max_response_len: 256,
            ..SETTINGS
        },
    )
    .await;
    assert_eq!(
        sample.status,
        SampleStatus::Completed,
        "{:?}",
        sample.metadata
    );
    let tok = ctx.chat.tokenizer();
    let response = &sample.tokens[sample.prompt_length()..];
    let trained: Vec<u32> = response
        .iter()
        .zip(&sample.loss_mask)
        .filter(|(_, &m)| m == 1)
        .map(|(&t, _)| t)
        .collect();
    let mut expected = tok.encode(call).unwrap();
    expected.extend(tok.encode(submit).unwrap());
    assert_eq!(trained, expected, "only the answers are trained");
    // The thinking tokens are in the sequence, with mask 0.
    let think_ids = tok.encode(think).unwrap();
    let at = response
        .windows(think_ids.len())
        .position(|w| w == think_ids.as_slice())
        .expect("the thinking tokens are kept in the sequence");
    assert!(sample.loss_mask[at..at + think_ids.len()]
        .iter()
        .all(|&m| m == 0));
    server.shutdown().await;
}
