//! Whole episodes (`run_episode`) against environments written with the real `openreward`
//! Python SDK and served by its `Server` (`tests/envs/` at the workspace root; one process
//! per test binary, shared by the tests). Configuration comes from train_config.yaml text,
//! clients are built from it as the driver does, and the policy is a scripted `Engine`
//! (a random-init model does not write tool calls); everything else is the production path.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use manta_config::TrainConfig;
use manta_core::{Sample, SampleStatus};
use manta_engine::{
    Engine, EngineError, FinishReason, GenerateOutput, GenerateRequest, NamedTensors,
};
use manta_rollout::chat::ChatFormat;
use manta_rollout::episode::run_episode;
use manta_rollout::ors::{OrsClient, OrsClientOptions, RetryPolicy, ToolResult};
use manta_rollout::{
    EnvironmentHandle, EpisodeContext, EpisodeRequest, GenerationSettings, TaskRef,
};
use manta_tokenizer::Tokenizer;
use serde_json::{json, Value};

// ---------------------------------------------------------------------------------------
// The shared SDK server.

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn python() -> PathBuf {
    std::env::var_os("MANTA_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join(".venv/bin/python"))
}

/// The Python server process. Killed when the last test holding it drops it; it also
/// exits by itself when its stdin (held here) closes, e.g. if the test binary dies.
struct SdkServer {
    child: Mutex<Child>,
    _stdin: Option<ChildStdin>,
    base: String,
}

impl Drop for SdkServer {
    fn drop(&mut self) {
        let child = self.child.get_mut().unwrap_or_else(|p| p.into_inner());
        let _ = child.kill();
        let _ = child.wait();
    }
}

static SERVER: Mutex<Weak<SdkServer>> = Mutex::new(Weak::new());

/// The running server, started on first use (and again if every user has dropped it).
fn sdk_server() -> Arc<SdkServer> {
    let mut slot = SERVER.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(server) = slot.upgrade() {
        return server;
    }
    let server = Arc::new(start_sdk_server());
    *slot = Arc::downgrade(&server);
    server
}

fn start_sdk_server() -> SdkServer {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let script = workspace().join("tests/envs/serve_episode_envs.py");
    let mut child = Command::new(python())
        .arg(&script)
        .args(["127.0.0.1", &port.to_string()])
        .env("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {} {}: {e}", python().display(), script.display()));
    let stdin = child.stdin.take();
    let server = SdkServer {
        child: Mutex::new(child),
        _stdin: stdin,
        base: format!("http://127.0.0.1:{port}"),
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !healthy(port) {
        let exited = server
            .child
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .try_wait()
            .ok()
            .flatten();
        assert!(
            exited.is_none(),
            "the SDK server {} exited with {exited:?}; run it by hand to see why",
            script.display()
        );
        assert!(
            Instant::now() < deadline,
            "SDK server did not come up on port {port}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    server
}

/// `GET /health` answers 200.
fn healthy(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    if stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    answer.starts_with("HTTP/1.1 200")
}

// ---------------------------------------------------------------------------------------
// The scripted policy and episode set-up.

/// Replays scripted assistant turns; records every prompt it was given.
struct ScriptedPolicy {
    tokenizer: Arc<Tokenizer>,
    turns: Mutex<Vec<String>>,
    prompts: Mutex<Vec<Vec<u32>>>,
}

#[async_trait]
impl Engine for ScriptedPolicy {
    async fn generate(&self, request: GenerateRequest) -> Result<GenerateOutput, EngineError> {
        self.prompts.lock().unwrap().push(request.input_ids.clone());
        let text = {
            let mut turns = self.turns.lock().unwrap();
            assert!(
                !turns.is_empty(),
                "the episode asked for an unscripted turn"
            );
            turns.remove(0)
        };
        let mut ids = self.tokenizer.encode(&text).unwrap();
        ids.truncate(request.params.max_new_tokens);
        let stopped = ids
            .last()
            .is_some_and(|t| request.params.stop_token_ids.contains(t));
        Ok(GenerateOutput {
            logprobs: (0..ids.len()).map(|i| -0.25 - i as f32).collect(),
            output_ids: ids,
            finish: if stopped {
                FinishReason::Stop
            } else {
                FinishReason::Length
            },
            weight_version: 3,
            ..GenerateOutput::default()
        })
    }
    async fn update_weights(&self, _: NamedTensors, _: u64) -> Result<(), EngineError> {
        Ok(())
    }
    fn weight_version(&self) -> u64 {
        3
    }
}

fn tokenizer() -> Arc<Tokenizer> {
    static TOKENIZER: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOKENIZER
        .get_or_init(|| {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tiny-qwen3");
            Arc::new(Tokenizer::from_dir(&dir).expect("tiny-qwen3 tokenizer"))
        })
        .clone()
}

/// A tool call as the Qwen/Hermes format writes it.
fn call(name: &str, args: Value) -> String {
    format!(
        "<tool_call>\n{}\n</tool_call>",
        json!({"name": name, "arguments": args})
    )
}

const SETTINGS: GenerationSettings = GenerationSettings {
    temperature: 1.0,
    top_p: 1.0,
    top_k: -1,
    max_response_len: 96,
    context_len: 8192,
    partial_rollout: false,
    return_routed_experts: false,
};

/// One finished episode and what produced it.
struct Run {
    sample: Sample,
    policy: Arc<ScriptedPolicy>,
    tokenizer: Arc<Tokenizer>,
    /// Keeps the server up while the run is inspected.
    _server: Arc<SdkServer>,
}

impl Run {
    fn prompt_text(&self) -> String {
        let prompt = &self.sample.tokens[..self.sample.prompt_length()];
        self.tokenizer.decode(prompt, false).unwrap()
    }
    fn response_text(&self) -> String {
        let response = &self.sample.tokens[self.sample.prompt_length()..];
        self.tokenizer.decode(response, false).unwrap()
    }
    /// The response tokens under loss mask 1, and the scripted turns that were used.
    fn assert_mask_covers_exactly(&self, turns: &[String]) {
        let s = &self.sample;
        s.validate().unwrap();
        let generated: Vec<u32> = s.tokens[s.prompt_length()..]
            .iter()
            .zip(&s.loss_mask)
            .filter(|(_, &m)| m == 1)
            .map(|(&t, _)| t)
            .collect();
        let used = turns.len() - self.policy.turns.lock().unwrap().len();
        let expected: Vec<u32> = turns[..used]
            .iter()
            .flat_map(|t| self.tokenizer.encode(t).unwrap())
            .collect();
        assert_eq!(
            generated, expected,
            "loss mask 1 must be exactly the engine's tokens"
        );
        assert!(s
            .rollout_log_probs
            .iter()
            .zip(&s.loss_mask)
            .all(|(&lp, &m)| (m == 1) == (lp < 0.0)));
        // Every generate call saw exactly the tokens accumulated so far.
        for p in self.policy.prompts.lock().unwrap().iter() {
            assert_eq!(&s.tokens[..p.len()], p.as_slice());
        }
    }
}

/// Runs one episode of the (single) environment in `yaml` on `task_spec`. `{url}` in
/// the YAML becomes the SDK server's URL. The client is built as the driver builds it.
async fn episode(
    yaml: &str,
    task_spec: Value,
    turns: &[String],
    settings: GenerationSettings,
) -> Run {
    let server = sdk_server();
    let yaml = yaml.replace("{url}", &server.base);
    let train = TrainConfig::from_yaml_str(&yaml, Path::new("train_config.yaml"))
        .unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    let tokenizer = tokenizer();
    let policy = Arc::new(ScriptedPolicy {
        tokenizer: tokenizer.clone(),
        turns: Mutex::new(turns.to_vec()),
        prompts: Mutex::new(Vec::new()),
    });
    let ctx = EpisodeContext {
        engine: policy.clone(),
        chat: ChatFormat::new(tokenizer.clone(), train.thinking),
        system_prompt_template: train.system_prompt_template.clone(),
        stop_token_ids: ["<|im_end|>", "</tool_call>"]
            .iter()
            .filter_map(|t| tokenizer.token_to_id(t))
            .collect(),
        upload: None,
    };
    let (name, config) = train
        .environments
        .iter()
        .next()
        .map(|(n, c)| (n.clone(), c.clone()))
        .unwrap();
    let variant = config.variant.clone().expect("test configs name a variant");
    let client = OrsClient::new(OrsClientOptions {
        deployment: Some(name.clone()),
        variant: Some(variant.clone()),
        secrets: train.resolved_secrets(&name),
        ..OrsClientOptions::new(config.url.clone().expect("test configs name a url"))
    })
    .unwrap();
    let request = EpisodeRequest {
        sample_id: 5,
        group_index: 1,
        index: 0,
        task: TaskRef {
            environment: name.clone(),
            split: "train".into(),
            task_spec,
            task_hash: "0123456789abcdef".into(),
            server_env: variant,
        },
    };
    let env = EnvironmentHandle {
        name,
        client,
        config,
    };
    let sample = run_episode(&ctx, &env, &request, settings).await;
    Run {
        sample,
        policy,
        tokenizer,
        _server: server,
    }
}

/// A one-environment train_config.yaml in the cookbook's format (plus Manta's `url` and
/// `variant`); `options` are extra lines of the environment entry, 4-space indented.
fn config(env: &str, variant: &str, options: &str) -> String {
    format!(
        "environments:\n  {env}:\n    splits: [train]\n    url: \"{{url}}\"\n    variant: {variant}\n{options}\
         system_prompt_template: |\n  You act through tools.\n  {{tools}}\n  Reply with {{{{\"name\": ..., \"arguments\": ...}}}} in <tool_call> tags.\n\
         thinking: false\nopenreward_run_name: manta-sdk-episodes\n"
    )
}

fn assert_close(actual: f64, expected: f64, what: &str) {
    assert!(
        (actual - expected).abs() < 1e-9,
        "{what}: reward {actual}, expected {expected}"
    );
}

// ---------------------------------------------------------------------------------------
// 1. Single step.

#[tokio::test(flavor = "multi_thread")]
async fn single_step_answer_is_graded_and_ends_the_episode() {
    let yaml = config("Test/SingleStep", "singlestep", "    max_turns: 4\n");
    let task = json!({"question": "What is 6 times 7?", "answer": "42"});
    for (answer, reward, verdict) in [("42", 1.0, "correct"), ("41", 0.0, "wrong")] {
        let turns = vec![
            call("answer", json!({ "answer": answer })),
            call("answer", json!({"answer": "never sent"})),
        ];
        let run = episode(&yaml, task.clone(), &turns, SETTINGS).await;
        let s = &run.sample;
        assert_eq!(s.status, SampleStatus::Completed, "{:?}", s.metadata);
        assert_eq!(s.metadata.stop_reason, "terminal");
        assert_eq!(
            (s.metadata.num_turns, s.metadata.num_tool_calls),
            (1, 1),
            "{verdict}"
        );
        assert_eq!(s.metadata.step_rewards, vec![reward]);
        assert_eq!(s.reward, reward);
        assert_eq!((s.id, s.group_index, s.weight_version), (5, 1, 3));
        // `finished: true` ended it: the second scripted turn was never asked for, and the
        // response is the one generated turn, all under loss mask 1.
        assert_eq!(run.policy.turns.lock().unwrap().len(), 1);
        assert!(s.loss_mask.iter().all(|&m| m == 1));
        run.assert_mask_covers_exactly(&turns);
        let prompt = run.prompt_text();
        assert!(prompt.contains("What is 6 times 7?"), "{prompt}");
        assert!(
            prompt.contains(r#"{"name": "answer", "arguments_schema": {"#),
            "the SDK tool list reaches {{tools}}: {prompt}"
        );
        assert!(
            prompt.contains(r#"Reply with {"name": ..., "arguments": ...}"#),
            "{prompt}"
        );
    }
}

// 2 + 4. Multi-step rewards under every reduction, input validation errors.

const MULTI_TASK: &str = r#"{"rewards": [0.5, -0.25, 1.0], "final": 2.0}"#;

fn multi_step_turns() -> Vec<String> {
    vec![
        call("step", json!({"amount": 1})),     // reward 0.5
        call("step", json!({"amount": "two"})), // input_validation: an error turn
        call("note", json!({"text": "hi"})),    // reward null: not kept
        call("step", json!({"amount": 3})),     // reward -0.25
        call("step", json!({"amount": 4})),     // reward 1.0
        call("finish", json!({})),              // reward 2.0, finished
        call("step", json!({"amount": 9})),     // never asked for
    ]
}

#[tokio::test(flavor = "multi_thread")]
async fn multi_step_episode_keeps_step_rewards_masks_and_validation_errors() {
    let yaml = config(
        "Test/MultiStep",
        "multistep",
        "    max_turns: 10\n    reward_reduction: sum\n    nonterminal_reward: -1.0\n",
    );
    let turns = multi_step_turns();
    let run = episode(
        &yaml,
        serde_json::from_str(MULTI_TASK).unwrap(),
        &turns,
        SETTINGS,
    )
    .await;
    let s = &run.sample;
    assert_eq!(s.status, SampleStatus::Completed, "{:?}", s.metadata);
    let m = &s.metadata;
    assert_eq!(m.stop_reason, "terminal");
    assert_eq!(m.error, None);
    assert_eq!(m.num_turns, 6);
    assert_eq!((m.num_tool_calls, m.num_failed_tool_calls), (6, 1));
    assert_eq!(m.step_rewards, vec![0.5, -0.25, 1.0, 2.0]);
    // Terminal: the nonterminal reward is not added.
    assert_close(s.reward, 3.25, "sum");
    assert_eq!(run.policy.turns.lock().unwrap().len(), 1);
    run.assert_mask_covers_exactly(&turns);

    let text = run.response_text();
    for piece in [
        "<|im_start|>user\n<tool_response>\nstep 1: total 1\n</tool_response><|im_end|>",
        "<tool_response>\nError: Tool input validation error:",
        "<tool_response>\nnoted 'hi'\n</tool_response>",
        "<tool_response>\nstep 2: total 4\n</tool_response>",
        "<tool_response>\nstep 3: total 8\n</tool_response>",
    ] {
        assert!(text.contains(piece), "missing {piece:?} in\n{text}");
    }
    // The validation error names the field, and the episode went on after it.
    let error_at = text.find("Error: Tool input validation error").unwrap();
    assert!(text[error_at..].contains("amount"), "{text}");
    assert!(text[error_at..].contains("noted 'hi'"), "{text}");
    // The finishing call's output is not appended (the episode is over).
    assert!(!text.contains("finished after"), "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn reward_reductions_nonterminal_reward_and_clamps() {
    // (options, expected step rewards, expected reward, status)
    let full = vec![0.5, -0.25, 1.0, 2.0];
    let cut = vec![0.5];
    let cases: Vec<(&str, Vec<f64>, f64, SampleStatus)> = vec![
        ("    reward_reduction: sum\n", full.clone(), 3.25, SampleStatus::Completed),
        ("    reward_reduction: mean\n", full.clone(), 0.8125, SampleStatus::Completed),
        ("    reward_reduction: max\n", full.clone(), 2.0, SampleStatus::Completed),
        ("    reward_reduction: min\n", full.clone(), -0.25, SampleStatus::Completed),
        ("    max_reward: 1.5\n", full.clone(), 1.5, SampleStatus::Completed),
        (
            "    reward_reduction: min\n    min_reward: 0.0\n",
            full.clone(),
            0.0,
            SampleStatus::Completed,
        ),
        (
            "    reward_reduction: sum\n    nonterminal_reward: -1.0\n    max_turns: 3\n",
            cut.clone(),
            -0.5,
            SampleStatus::Truncated,
        ),
        (
            "    reward_reduction: mean\n    nonterminal_reward: -1.0\n    max_turns: 3\n",
            cut.clone(),
            -0.25,
            SampleStatus::Truncated,
        ),
        (
            "    reward_reduction: sum\n    nonterminal_reward: -1.0\n    min_reward: -0.1\n    max_turns: 3\n",
            cut.clone(),
            -0.1,
            SampleStatus::Truncated,
        ),
        (
            "    reward_reduction: max\n    max_turns: 3\n",
            cut.clone(),
            0.5,
            SampleStatus::Truncated,
        ),
        // `null` nonterminal reward: nothing is appended.
        (
            "    reward_reduction: min\n    max_turns: 1\n    nonterminal_reward: null\n",
            vec![0.5],
            0.5,
            SampleStatus::Truncated,
        ),
    ];
    let turns = multi_step_turns();
    let runs = futures::future::join_all(cases.iter().map(|(options, ..)| {
        let yaml = config("Test/MultiStep", "multistep", options);
        let turns = turns.clone();
        async move {
            episode(
                &yaml,
                serde_json::from_str(MULTI_TASK).unwrap(),
                &turns,
                SETTINGS,
            )
            .await
        }
    }))
    .await;
    for ((options, steps, reward, status), run) in cases.iter().zip(&runs) {
        let s = &run.sample;
        let what = options.trim().replace('\n', ",");
        assert_eq!(s.status, *status, "{what}: {:?}", s.metadata);
        assert_eq!(&s.metadata.step_rewards, steps, "{what}");
        assert_close(s.reward, *reward, &what);
        run.assert_mask_covers_exactly(&turns);
        if *status == SampleStatus::Truncated {
            // max_turns truncates: exactly that many generate calls, the last turn's tool
            // call ran, and nothing follows the last generated turn.
            assert_eq!(s.metadata.stop_reason, "max_turns", "{what}");
            let max_turns = s.metadata.num_turns as usize;
            assert_eq!(
                run.policy.prompts.lock().unwrap().len(),
                max_turns,
                "{what}"
            );
            assert_eq!(s.metadata.num_tool_calls as usize, max_turns, "{what}");
            assert_eq!(s.loss_mask.last(), Some(&1), "{what}");
        } else {
            assert_eq!(s.metadata.stop_reason, "terminal", "{what}");
        }
    }
}

// 3. A tool that raises.

#[tokio::test(flavor = "multi_thread")]
async fn raising_tool_fails_the_episode_and_keeps_it_out_of_training() {
    let yaml = config("Test/Faulty", "faulty", "    max_turns: 5\n");
    let turns = vec![
        call("calm", json!({})),
        call("explode", json!({})),
        call("calm", json!({})),
    ];
    let run = episode(&yaml, json!({"id": 0}), &turns, SETTINGS).await;
    let s = &run.sample;
    assert_eq!(s.status, SampleStatus::Failed, "{:?}", s.metadata);
    assert_eq!(s.metadata.stop_reason, "environment_error");
    let error = s.metadata.error.as_deref().unwrap_or("");
    assert!(
        error.contains("tool explode") && error.contains("faulty env: deliberate tool failure"),
        "{error}"
    );
    // The step reward before the failure is recorded, but a failed sample scores 0.
    assert_eq!(s.metadata.step_rewards, vec![0.3]);
    assert_eq!(s.reward, 0.0);
    assert_eq!(s.metadata.num_turns, 2);
    assert_eq!(run.policy.turns.lock().unwrap().len(), 1);
    run.assert_mask_covers_exactly(&turns);
}

// 5. A 4 MiB tool output.

/// The text `Bulk.big` returns (tests/envs/episode_envs.py `big_text`), rebuilt here.
fn big_text() -> String {
    let alphabet = "abcdefghijklmnopqrstuvwxyz";
    let mut out = String::new();
    let mut i = 0usize;
    while out.len() < 4 * 1024 * 1024 {
        let r = i % 26;
        out.push_str(&format!(
            " row {i:06} é日本 {}{} {{\"k\": [{i}]}}\n",
            &alphabet[r..],
            &alphabet[..r]
        ));
        i += 1;
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn four_megabyte_tool_output_reaches_the_transcript_intact() {
    let yaml = config("Test/Bulk", "bulk", "    max_turns: 3\n");
    let turns = vec![call("big", json!({})), call("done", json!({}))];
    let settings = GenerationSettings {
        context_len: 64 << 20,
        ..SETTINGS
    };
    let run = episode(&yaml, json!({"sleep": 0.0}), &turns, settings).await;
    let s = &run.sample;
    assert_eq!(s.status, SampleStatus::Completed, "{:?}", s.metadata);
    assert_eq!(s.metadata.step_rewards, vec![1.0]);
    run.assert_mask_covers_exactly(&turns);
    let text = run.response_text();
    let start = text.find("<tool_response>\n").expect("a tool response") + 16;
    let end = text[start..]
        .find("\n</tool_response>")
        .expect("the end of the tool response")
        + start;
    let got = &text[start..end];
    let expected = big_text();
    assert!(expected.len() >= 4 << 20);
    assert_eq!(got.len(), expected.len(), "tool output length");
    assert!(got == expected, "the 4 MiB tool output was altered");
}

// 6. A tool slower than the SSE ping interval.

#[tokio::test(flavor = "multi_thread")]
async fn tool_slower_than_the_ping_interval_still_succeeds() {
    let yaml = config("Test/Bulk", "bulk", "    max_turns: 2\n");
    let turns = vec![call("slow", json!({}))];
    let started = Instant::now();
    let run = episode(&yaml, json!({"sleep": 11.5}), &turns, SETTINGS).await;
    let s = &run.sample;
    assert!(started.elapsed() >= Duration::from_secs(11));
    assert_eq!(s.status, SampleStatus::Completed, "{:?}", s.metadata);
    assert_eq!(s.metadata.stop_reason, "terminal");
    assert_eq!(s.metadata.step_rewards, vec![0.75]);
}

/// The SSE idle limit counts any bytes, `: ping` comments included (sse.rs applies it to
/// the byte stream, below the SSE parser that swallows comments), so a tool that outlasts
/// the 11 s limit (12.5 s) while the server pings every 10 s succeeds without a resume:
/// the client makes a single attempt, and the result arrives.
#[tokio::test(flavor = "multi_thread")]
async fn ping_comments_keep_a_slow_call_alive_without_resuming() {
    let server = sdk_server();
    let client = OrsClient::new(OrsClientOptions {
        variant: Some("bulk".into()),
        sse_idle_timeout: Duration::from_secs(11),
        retry: RetryPolicy {
            max_attempts: 1,
            ..RetryPolicy::default()
        },
        ..OrsClientOptions::new(&server.base)
    })
    .unwrap();
    let session = client
        .open_session("bulk", &json!({"sleep": 12.5}))
        .await
        .unwrap();
    let result = session.call("slow", json!({})).await;
    session.close().await.unwrap();
    match result {
        Ok(ToolResult::Ok { reward, .. }) => assert_eq!(reward, Some(0.75)),
        other => panic!("expected the slow tool's result, got {other:?}"),
    }
}

// 7. A server that refuses to list all tasks.

#[tokio::test(flavor = "multi_thread")]
async fn task_listing_falls_back_to_num_tasks_and_task() {
    let server = sdk_server();
    // The SDK really refuses /tasks for this environment…
    let refused = reqwest::Client::new()
        .post(format!("{}/indexonly/tasks", server.base))
        .json(&json!({"split": "train"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status().as_u16(), 400);
    assert!(refused.text().await.unwrap().contains("not supported"));
    // …and the client reads it index by index instead, in order.
    let client = OrsClient::new(OrsClientOptions {
        variant: Some("indexonly".into()),
        ..OrsClientOptions::new(&server.base)
    })
    .unwrap();
    let train = client.list_tasks("train").await.unwrap();
    assert_eq!(train.env_name, "indexonly");
    let expected: Vec<Value> = (0..7)
        .map(|i| json!({"split": "train", "index": i, "square": i * i}))
        .collect();
    assert_eq!(train.tasks, expected);
    assert_eq!(client.list_tasks("test").await.unwrap().tasks.len(), 2);

    // A listed task runs as an episode.
    let yaml = config("Test/IndexOnly", "indexonly", "    max_turns: 2\n");
    let turns = vec![call("answer", json!({"answer": "9"}))];
    let run = episode(&yaml, train.tasks[3].clone(), &turns, SETTINGS).await;
    assert_eq!(run.sample.status, SampleStatus::Completed);
    assert_eq!(run.sample.reward, 1.0);
    assert!(run.prompt_text().contains("What is 3 squared?"));
}

// 8. Image blocks in the prompt.

#[tokio::test(flavor = "multi_thread")]
async fn image_prompt_blocks_are_dropped_and_text_blocks_kept() {
    let yaml = config("Test/Vision", "vision", "    max_turns: 2\n");
    let turns = vec![call("answer", json!({"answer": "transparent"}))];
    let run = episode(&yaml, json!({"id": 0}), &turns, SETTINGS).await;
    assert_eq!(run.sample.status, SampleStatus::Completed);
    assert_eq!(run.sample.reward, 1.0);
    let prompt = run.prompt_text();
    assert!(
        prompt.contains("<|im_start|>user\nLook at the picture.\nWhat colour is it?<|im_end|>"),
        "{prompt}"
    );
    assert!(
        !prompt.contains("iVBOR") && !prompt.contains("image/png"),
        "{prompt}"
    );
}

// 9. Secrets from train_config.yaml.

#[tokio::test(flavor = "multi_thread")]
async fn secrets_from_train_config_reach_the_environment() {
    let turns = vec![call("check", json!({}))];
    let task = json!({"expect": "per-env-456"});
    // Global secrets overlaid by the environment's own.
    let matching = config(
        "Test/Secretive",
        "secretive",
        "    max_turns: 2\n    secrets:\n      env_token: per-env-456\n",
    ) + "secrets:\n  shared_token: glob-123\n  env_token: global-loses\n";
    let wrong = config(
        "Test/Secretive",
        "secretive",
        "    max_turns: 2\n    secrets:\n      env_token: not-it\n",
    );
    let (good, bad) = tokio::join!(
        episode(&matching, task.clone(), &turns, SETTINGS),
        episode(&wrong, task.clone(), &turns, SETTINGS)
    );
    assert_eq!(good.sample.status, SampleStatus::Completed);
    assert_eq!(good.sample.reward, 1.0);
    let prompt = good.prompt_text();
    assert!(
        prompt.contains("secrets=[env_token,shared_token] shared_token=glob-123"),
        "{prompt}"
    );
    assert_eq!(bad.sample.status, SampleStatus::Completed);
    assert_eq!(bad.sample.reward, 0.0);
    assert!(
        bad.prompt_text()
            .contains("secrets=[env_token] shared_token=<none>"),
        "{}",
        bad.prompt_text()
    );
}
