//! `driver serve` end to end: the real binary on a free port with the tiny Qwen3 model on
//! the CPU, spoken to over HTTP the way slime/Miles' rollout and the OpenReward cookbook
//! speak to SGLang.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use manta_model::{CausalLm, ModelConfig};
use manta_tokenizer::Tokenizer;
use serde_json::{json, Value};
use tch::nn::VarStore;
use tch::Device;

use crate::common;
use common::serve::Server;

fn tiny_assets() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tiny-qwen3")
}

/// A model directory with the tiny config and tokenizer; random init unless weights are
/// written into it.
fn model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tiny_assets().join(f), dir.path().join(f)).expect("copy tiny asset");
    }
    dir
}

/// A model directory holding safetensors of a model unlike the server's random init:
/// another seed and weights scaled up, so its greedy outputs and log-probs differ.
fn model_dir_with_weights(seed: i64) -> tempfile::TempDir {
    let dir = model_dir();
    let cfg = ModelConfig::from_file(&dir.path().join("config.json")).expect("tiny config");
    tch::manual_seed(seed);
    let vs = VarStore::new(Device::Cpu);
    let _model = CausalLm::new(&vs.root(), &cfg);
    tch::no_grad(|| {
        for (_, mut var) in vs.variables() {
            let scaled = &var * 20.0;
            var.copy_(&scaled);
        }
    });
    manta_model::save_pretrained(&vs, &cfg, dir.path()).expect("save weights");
    dir
}

/// `driver serve` on the CPU with `extra` flags.
fn start(model: &Path, extra: &[&str]) -> Server {
    let args = [&["--device", "cpu"][..], extra].concat();
    Server::start(env!("CARGO_BIN_EXE_driver"), model, &args)
}

/// Requests the engine holds (`/v1/loads`, what slime polls after an abort).
async fn in_flight(server: &Server) -> u64 {
    let (status, v) = server.get("/v1/loads").await;
    assert_eq!(status, 200);
    v["loads"][0]["num_reqs"].as_u64().expect("num_reqs")
}

/// Waits until the engine holds `n` requests. The deadline only stops a hung test.
async fn wait_in_flight(server: &Server, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while in_flight(server).await != n {
        assert!(
            Instant::now() < deadline,
            "the server never held {n} requests"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Checks one `/generate` answer against SGLang's shape; returns (output_ids, logprobs).
fn check_answer(v: &Value, prompt_tokens: usize, with_logprobs: bool) -> (Vec<u64>, Vec<f64>) {
    assert!(v["text"].is_string(), "text: {v}");
    let ids: Vec<u64> = v["output_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("output_ids: {v}"))
        .iter()
        .map(|x| x.as_u64().expect("output id"))
        .collect();
    let meta = &v["meta_info"];
    assert!(meta["id"].is_string(), "meta_info.id: {v}");
    let finish = &meta["finish_reason"];
    let kind = finish["type"].as_str().expect("finish_reason.type");
    assert!(matches!(kind, "stop" | "length" | "abort"), "{finish}");
    if kind == "stop" {
        assert!(
            finish["matched"].is_u64() || finish["matched"].is_string(),
            "{finish}"
        );
    }
    assert_eq!(
        meta["prompt_tokens"].as_u64(),
        Some(prompt_tokens as u64),
        "{v}"
    );
    assert_eq!(
        meta["completion_tokens"].as_u64(),
        Some(ids.len() as u64),
        "{v}"
    );
    assert!(meta["cached_tokens"].is_u64(), "{v}");
    assert!(meta["weight_version"].is_string(), "{v}");
    let mut logprobs = Vec::new();
    if with_logprobs {
        let entries = meta["output_token_logprobs"]
            .as_array()
            .unwrap_or_else(|| panic!("output_token_logprobs: {v}"));
        assert_eq!(
            entries.len(),
            ids.len(),
            "one log-prob per output token: {v}"
        );
        for (entry, &id) in entries.iter().zip(&ids) {
            let e = entry.as_array().expect("[logprob, id, null]");
            assert_eq!(e.len(), 3, "{entry}");
            let lp = e[0].as_f64().expect("logprob");
            assert!(lp <= 0.0, "{entry}");
            assert_eq!(e[1].as_u64(), Some(id), "{entry}");
            assert!(e[2].is_null(), "{entry}");
            logprobs.push(lp);
        }
    } else {
        assert!(meta.get("output_token_logprobs").is_none(), "{v}");
    }
    (ids, logprobs)
}

#[tokio::test]
async fn sglang_request_shapes() {
    let dir = model_dir();
    let server = start(dir.path(), &["--tp-size", "1", "--trust-remote-code"]);
    let tok = Tokenizer::from_dir(dir.path()).expect("tiny tokenizer");
    let (status, _) = server.get("/health").await;
    assert_eq!(status, 200);
    let (status, _) = server.get("/health_generate").await;
    assert_eq!(status, 200);

    // slime's GenerateState sampling params, input ids, return_logprob.
    let slime = server
        .generate(json!({
            "input_ids": [1, 2, 3, 4],
            "sampling_params": {
                "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 12,
                "stop": ["</tool_call>"], "stop_token_ids": [258],
                "skip_special_tokens": false, "no_stop_trim": true,
                "spaces_between_special_tokens": false,
                "sampling_seed": 5,
            },
            "return_logprob": true,
        }))
        .await;
    check_answer(&slime, 4, true);

    // The cookbook's sglang_generate: text in, stop strings kept, prompt log-probs asked.
    let prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
    let cookbook = server
        .generate(json!({
            "text": prompt,
            "sampling_params": {
                "max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0,
                "stop": ["<|im_end|>", "</tool_call>"],
                "include_stop_str_in_output": true,
            },
            "return_logprob": true,
            "logprob_start_len": 0,
        }))
        .await;
    check_answer(&cookbook, tok.encode(prompt).unwrap().len(), true);

    // Stop token: generation ends with it in output_ids; `text` drops it unless no_stop_trim.
    let sampled = |extra: Value| {
        let mut sp = json!({"max_new_tokens": 32, "temperature": 1.0, "sampling_seed": 11, "ignore_eos": true});
        if let (Value::Object(sp), Value::Object(extra)) = (&mut sp, extra) {
            sp.extend(extra);
        }
        json!({"input_ids": [10, 20, 30], "sampling_params": sp, "return_logprob": true})
    };
    let free = server.generate(sampled(json!({}))).await;
    let (ids, _) = check_answer(&free, 3, true);
    assert_eq!(ids.len(), 32);
    let k = (1..ids.len())
        .find(|&k| !ids[..k].contains(&ids[k]))
        .expect("a token that appears for the first time");
    let stop_id = ids[k];
    for no_stop_trim in [false, true] {
        let v = server
            .generate(sampled(json!({
                "stop_token_ids": [stop_id],
                "no_stop_trim": no_stop_trim,
                "skip_special_tokens": false,
            })))
            .await;
        let (got, _) = check_answer(&v, 3, true);
        assert_eq!(got, ids[..=k], "stops at the stop token, keeping it");
        let f = &v["meta_info"]["finish_reason"];
        assert_eq!(f["type"], "stop");
        assert_eq!(f["matched"].as_u64(), Some(stop_id));
        let keep = if no_stop_trim { k + 1 } else { k };
        let want: Vec<u32> = ids[..keep].iter().map(|&i| i as u32).collect();
        assert_eq!(
            v["text"],
            tok.decode(&want, false).unwrap(),
            "no_stop_trim {no_stop_trim}"
        );
    }

    // Stop string: the first printable ASCII token that is new in the text.
    let k = (0..ids.len())
        .find(|&k| {
            let c = ids[k];
            (0x21..=0x7e).contains(&c) && !ids[..k].contains(&c)
        })
        .expect("a printable ASCII token among 32 sampled ones");
    let stop = char::from(ids[k] as u8).to_string();
    for no_stop_trim in [false, true] {
        let v = server
            .generate(sampled(json!({"stop": stop, "no_stop_trim": no_stop_trim})))
            .await;
        let (got, _) = check_answer(&v, 3, true);
        assert_eq!(got, ids[..=k]);
        let f = &v["meta_info"]["finish_reason"];
        assert_eq!(f["type"], "stop");
        assert_eq!(f["matched"], json!(stop));
        let text = v["text"].as_str().unwrap();
        assert_eq!(text.ends_with(&stop), no_stop_trim, "{text:?}");
    }

    // Length: finish_reason says how many tokens.
    let v = server.generate(sampled(json!({"max_new_tokens": 3}))).await;
    assert_eq!(v["meta_info"]["finish_reason"]["type"], "length");

    // A batch of ids, a batch of texts: lists of answers in order, rids kept.
    let v = server
        .generate(json!({
            "input_ids": [[1, 2], [3, 4, 5]],
            "rid": ["a", "b"],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "return_logprob": [true, false],
        }))
        .await;
    let answers = v.as_array().expect("a batch answers a list");
    assert_eq!(answers.len(), 2);
    check_answer(&answers[0], 2, true);
    check_answer(&answers[1], 3, false);
    assert_eq!(answers[0]["meta_info"]["id"], "a");
    assert_eq!(answers[1]["meta_info"]["id"], "b");
    let v = server
        .generate(json!({"text": ["hello", "hi"], "sampling_params": {"max_new_tokens": 2}}))
        .await;
    let answers = v.as_array().expect("a batch answers a list");
    check_answer(&answers[0], 5, false);
    check_answer(&answers[1], 2, false);

    // Greedy is reproducible, and stream: true sends the whole result as one SSE event.
    let greedy =
        json!({"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 6, "temperature": 0}});
    let a = server.generate(greedy.clone()).await;
    let b = server.generate(greedy.clone()).await;
    assert_eq!(a["output_ids"], b["output_ids"]);
    let mut streamed = greedy.clone();
    streamed["stream"] = json!(true);
    let (status, body) = server.post("/generate", streamed).await;
    assert_eq!(status, 200);
    let body = body.as_str().expect("event stream text");
    let events: Vec<&str> = body
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .collect();
    assert_eq!(events.len(), 2, "{body}");
    assert_eq!(events[1], "[DONE]");
    let last: Value = serde_json::from_str(events[0]).expect("event JSON");
    assert_eq!(last["output_ids"], a["output_ids"]);

    let (status, info) = server.get("/get_model_info").await;
    assert_eq!(status, 200);
    assert_eq!(info["is_generation"], true);
    assert_eq!(info["model_path"], dir.path().display().to_string());
    assert!(info["tokenizer_path"].is_string());
    let (status, info) = server.get("/get_server_info").await;
    assert_eq!(status, 200);
    assert_eq!(info["tp_size"], 1);
    assert_eq!(info["device"], "cpu");
    assert_eq!(info["random_seed"], 1);
    assert!(info["context_length"].is_u64());
    assert_eq!(info["disable_overlap_schedule"], false);
    // The CPU engine has no CUDA graphs, so no step is launched ahead of the last.
    assert_eq!(info["internal_states"][0]["steps_ahead"], 0);
}

/// SGLang's `--disable-overlap-schedule` is accepted and reported.
#[tokio::test]
async fn disable_overlap_schedule_is_reported() {
    let dir = model_dir();
    let server = start(dir.path(), &["--disable-overlap-schedule"]);
    let (status, info) = server.get("/get_server_info").await;
    assert_eq!(status, 200);
    assert_eq!(info["disable_overlap_schedule"], true);
}

#[tokio::test]
async fn bad_requests_get_400_naming_the_field() {
    let dir = model_dir();
    let server = start(dir.path(), &[]);
    let cases: Vec<(&str, &str)> = vec![
        (r#"{"input_ids": [1, 2"#, "JSON"),
        (r#"{"input_ids": [1, 265]}"#, "input_ids[1]"),
        (r#"{"input_ids": [1, -3]}"#, "input_ids[1]"),
        (r#"{"input_ids": []}"#, "input_ids"),
        (r#"{"text": ""}"#, "text"),
        (r#"{}"#, "input_ids"),
        (r#"{"input_ids": "1 2 3"}"#, "input_ids"),
        (r#"{"text": 5}"#, "text"),
        (
            r#"{"input_ids": [1], "sampling_params": {"temperature": -0.5}}"#,
            "sampling_params.temperature",
        ),
        (
            r#"{"input_ids": [1], "sampling_params": {"temperature": "warm"}}"#,
            "sampling_params.temperature",
        ),
        (
            r#"{"input_ids": [1], "sampling_params": {"n": 4}}"#,
            "sampling_params.n",
        ),
        (
            r#"{"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}"#,
            "sampling_params.max_new_tokens",
        ),
        (
            r#"{"input_ids": [1], "sampling_params": {"top_p": 0}}"#,
            "sampling_params.top_p",
        ),
        (
            r#"{"input_ids": [1], "sampling_params": {"stop": 7}}"#,
            "sampling_params.stop",
        ),
        (
            r#"{"input_ids": [1], "sampling_params": {"presence_penalty": 1.0}}"#,
            "sampling_params.presence_penalty",
        ),
        (
            r#"{"input_ids": [1], "return_logprob": "yes"}"#,
            "return_logprob",
        ),
        (r#"{"input_ids": [[1], [2]], "rid": "x"}"#, "rid"),
    ];
    for (body, field) in cases {
        let (status, v) = server.post_raw("/generate", body).await;
        assert_eq!(status, 400, "{body} answered {status} {v}");
        let message = v["error"]["message"]
            .as_str()
            .unwrap_or_else(|| panic!("{body}: no error.message in {v}"));
        assert!(
            message.contains(field),
            "{body}: {message:?} does not name {field}"
        );
    }
    let (status, v) = server.post_raw("/abort_request", "{}").await;
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("rid"));
    let (status, v) = server
        .post("/pause_generation", json!({"mode": "sideways"}))
        .await;
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("mode"));
    let (status, _) = server.get("/no_such_route").await;
    assert_eq!(status, 404);

    // Still serving.
    let v = server
        .generate(json!({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}, "return_logprob": true}))
        .await;
    check_answer(&v, 2, true);
}

/// Greedy output ids and log-probs of a fixed prompt.
async fn greedy(server: &Server) -> (Vec<u64>, Vec<f64>, String) {
    let v = server
        .generate(json!({
            "input_ids": [5, 6, 7, 8],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": true},
            "return_logprob": true,
        }))
        .await;
    let (ids, lps) = check_answer(&v, 4, true);
    (
        ids,
        lps,
        v["meta_info"]["weight_version"]
            .as_str()
            .unwrap()
            .to_string(),
    )
}

fn assert_close(a: &[f64], b: &[f64]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < 1e-4, "{a:?} vs {b:?}");
    }
}

#[tokio::test]
async fn update_weights_from_disk_switches_weights_and_version() {
    let random = model_dir();
    let trained = model_dir_with_weights(1234);
    let server = start(random.path(), &[]);
    assert_eq!(server.weight_version().await, "0");
    let (before_ids, before_lps, version) = greedy(&server).await;
    assert_eq!(version, "0");

    let path = trained.path().display().to_string();
    let (status, v) = server
        .post("/update_weights_from_disk", json!({"model_path": path}))
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["success"], true, "{v}");
    assert!(v["message"].is_string());
    assert_eq!(server.weight_version().await, "1");
    let (after_ids, after_lps, version) = greedy(&server).await;
    assert_eq!(version, "1");
    assert!(
        after_ids != before_ids || after_lps != before_lps,
        "greedy output did not change with the weights"
    );
    let (_, info) = server.get("/get_model_info").await;
    assert_eq!(info["model_path"], path);

    // The same answer as a server started on those weights.
    let fresh = start(trained.path(), &[]);
    let (fresh_ids, fresh_lps, _) = greedy(&fresh).await;
    drop(fresh);
    assert_eq!(after_ids, fresh_ids);
    assert_close(&after_lps, &fresh_lps);

    // An explicit version; the weights reload unchanged.
    let (status, v) = server
        .post(
            "/update_weights_from_disk",
            json!({"model_path": path, "load_format": "auto", "weight_version": "7"}),
        )
        .await;
    assert_eq!((status, &v["success"]), (200, &json!(true)), "{v}");
    assert_eq!(server.weight_version().await, "7");

    // Refusals: success false, a message naming the problem, nothing changed.
    for (body, needle) in [
        (
            json!({"model_path": "/no/such/checkpoint"}),
            "/no/such/checkpoint".to_string(),
        ),
        (
            json!({"model_path": random.path()}),
            random.path().display().to_string(),
        ),
        (
            json!({"model_path": path, "weight_version": "v2"}),
            "weight_version".to_string(),
        ),
        (
            json!({"model_path": path, "load_format": "gguf"}),
            "load_format".to_string(),
        ),
    ] {
        let (status, v) = server.post("/update_weights_from_disk", body.clone()).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["success"], false, "{body}: {v}");
        let message = v["message"].as_str().unwrap();
        assert!(
            message.contains(&needle),
            "{body}: {message:?} does not name {needle}"
        );
    }
    assert_eq!(server.weight_version().await, "7");
    let (ids, lps, version) = greedy(&server).await;
    assert_eq!((ids, version), (after_ids, "7".to_string()));
    assert_close(&lps, &after_lps);
}

/// A request that runs for a long time unless stopped.
fn long_request(rid: &str) -> Value {
    json!({
        "input_ids": [1, 2, 3],
        "rid": rid,
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": true},
        "return_logprob": true,
    })
}

async fn tokens_sampled(server: &Server) -> u64 {
    let (status, info) = server.get("/get_server_info").await;
    assert_eq!(status, 200);
    info["internal_states"][0]["tokens_sampled"]
        .as_u64()
        .unwrap_or_else(|| panic!("internal_states[0].tokens_sampled: {info}"))
}

#[tokio::test]
async fn abort_pause_continue_and_flush() {
    let dir = model_dir();
    let server = std::sync::Arc::new(start(dir.path(), &[]));

    // Abort one request by rid: it answers with what it had, finish_reason abort.
    let s = server.clone();
    let long = tokio::spawn(async move { s.generate(long_request("long-1")).await });
    wait_in_flight(&server, 1).await;
    let (status, _) = server
        .post("/abort_request", json!({"rid": "long-1"}))
        .await;
    assert_eq!(status, 200);
    let v = long.await.expect("long request task");
    let (ids, _) = check_answer(&v, 3, true);
    assert_eq!(v["meta_info"]["finish_reason"]["type"], "abort", "{v}");
    assert!(ids.len() < 2000);

    // A caller that hangs up aborts its request: the engine stops well short of the
    // 2000 tokens it would otherwise compute for nobody.
    let sampled_before = tokens_sampled(&server).await;
    let s = server.clone();
    let gone = tokio::spawn(async move { s.generate(long_request("gone-1")).await });
    wait_in_flight(&server, 1).await;
    gone.abort();
    assert!(gone.await.is_err(), "the caller was cancelled");
    // flush_cache succeeds only once the engine has nothing running or waiting.
    let deadline = Instant::now() + Duration::from_secs(120);
    while server.get("/flush_cache").await.0 != 200 {
        assert!(Instant::now() < deadline, "the engine never went idle");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let sampled = tokens_sampled(&server).await - sampled_before;
    assert!(
        sampled < 2000,
        "{sampled} tokens sampled after the caller left"
    );

    // abort_all stops every request.
    let (s1, s2) = (server.clone(), server.clone());
    let a = tokio::spawn(async move { s1.generate(long_request("all-1")).await });
    let b = tokio::spawn(async move { s2.generate(long_request("all-2")).await });
    wait_in_flight(&server, 2).await;
    let (status, _) = server
        .post("/abort_request", json!({"abort_all": true}))
        .await;
    assert_eq!(status, 200);
    for t in [a, b] {
        let v = t.await.expect("task");
        assert_eq!(v["meta_info"]["finish_reason"]["type"], "abort", "{v}");
    }

    // pause_generation(abort) aborts what runs and holds new requests until continue.
    let s = server.clone();
    let long = tokio::spawn(async move { s.generate(long_request("paused-1")).await });
    wait_in_flight(&server, 1).await;
    let (status, v) = server
        .post("/pause_generation", json!({"mode": "abort"}))
        .await;
    assert_eq!(status, 200, "{v}");
    let v = long.await.expect("task");
    assert_eq!(v["meta_info"]["finish_reason"]["type"], "abort", "{v}");
    let s = server.clone();
    let held = tokio::spawn(async move {
        s.generate(json!({"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 3, "ignore_eos": true}}))
            .await
    });
    wait_in_flight(&server, 1).await;
    // A held request keeps the cache busy: flush_cache refuses (SGLang: 400) ...
    let (status, _) = server.get("/flush_cache").await;
    assert_eq!(status, 400);
    let (status, v) = server.post("/continue_generation", json!({})).await;
    assert_eq!(status, 200, "{v}");
    let v = held.await.expect("task");
    assert_eq!(v["meta_info"]["finish_reason"]["type"], "length", "{v}");
    assert_eq!(v["output_ids"].as_array().unwrap().len(), 3);
    // ... and flushes once idle, on GET and POST.
    wait_in_flight(&server, 0).await;
    let (status, _) = server.get("/flush_cache").await;
    assert_eq!(status, 200);
    let (status, _) = server.post("/flush_cache", json!({})).await;
    assert_eq!(status, 200);

    // in_place pauses keep requests where they are; continue finishes them.
    let (status, _) = server
        .post("/pause_generation", json!({"mode": "in_place"}))
        .await;
    assert_eq!(status, 200);
    let s = server.clone();
    let held = tokio::spawn(async move {
        s.generate(json!({"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 2, "ignore_eos": true}}))
            .await
    });
    wait_in_flight(&server, 1).await;
    let (status, _) = server.post("/continue_generation", json!({})).await;
    assert_eq!(status, 200);
    let v = held.await.expect("task");
    assert_eq!(v["meta_info"]["finish_reason"]["type"], "length", "{v}");

    // retract (served as a drain) with nothing running, and an empty pause body (abort).
    let (status, _) = server
        .post("/pause_generation", json!({"mode": "retract"}))
        .await;
    assert_eq!(status, 200);
    let (status, _) = server.post_raw("/pause_generation", "").await;
    assert_eq!(status, 200);
    let (status, _) = server.post("/continue_generation", json!({})).await;
    assert_eq!(status, 200);
    let (status, _) = server.get("/health_generate").await;
    assert_eq!(status, 200);
}

#[test]
fn tensor_parallel_is_refused_clearly() {
    let dir = model_dir();
    let out = Command::new(env!("CARGO_BIN_EXE_driver"))
        .args(["serve", "--model-path"])
        .arg(dir.path())
        .args(["--port", "0", "--device", "cpu", "--tp-size", "2"])
        .output()
        .expect("run driver serve");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--tp-size 2"), "{stderr}");
}

/// `--enable-deterministic-inference` needs the GPU kernel: on the CPU the server refuses
/// to start and names the flag and the reason.
#[test]
fn deterministic_inference_on_the_cpu_is_refused_clearly() {
    let dir = model_dir();
    let out = Command::new(env!("CARGO_BIN_EXE_driver"))
        .args(["serve", "--model-path"])
        .arg(dir.path())
        .args([
            "--port",
            "0",
            "--device",
            "cpu",
            "--enable-deterministic-inference",
        ])
        .output()
        .expect("run driver serve");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--enable-deterministic-inference") && stderr.contains("CUDA"),
        "{stderr}"
    );
}

/// `meta_info.routed_experts` decoded: [tokens][sparse layers × k] int32.
fn routed_rows(v: &Value, per_row: usize) -> Vec<Vec<i32>> {
    use base64::Engine as _;
    let text = v["meta_info"]["routed_experts"]
        .as_str()
        .unwrap_or_else(|| panic!("meta_info.routed_experts: {v}"));
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(text)
        .expect("base64");
    assert_eq!(
        bytes.len() % (4 * per_row),
        0,
        "whole rows: {}",
        bytes.len()
    );
    bytes
        .chunks_exact(4 * per_row)
        .map(|row| {
            row.chunks_exact(4)
                .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        })
        .collect()
}

/// SGLang's `return_routed_experts` on a mixture-of-experts model (tiny Qwen3-MoE: 2
/// sparse layers, 4 experts, top-2): base64 int32 rows for every token but the last,
/// the prefix-cached ones included (the same rows as when they were computed).
#[tokio::test]
async fn routed_experts_are_returned_when_asked() {
    let dir = tempfile::tempdir().expect("temp dir");
    let moe = tiny_assets().with_file_name("tiny-qwen3-moe");
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(moe.join(f), dir.path().join(f)).expect("copy tiny MoE asset");
    }
    let plain = start(dir.path(), &[]);
    let body = |ids: &[u64], routed: bool| {
        json!({
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": true},
            "return_routed_experts": routed,
        })
    };
    let prompt: Vec<u64> = (0..37).map(|i| (i * 29 + 3) % 250).collect();
    let (status, v) = plain.post("/generate", body(&prompt, true)).await;
    assert_eq!(status, 400, "{v}");
    assert!(v.to_string().contains("return_routed_experts"), "{v}");
    drop(plain);

    let server = start(dir.path(), &["--enable-return-routed-experts"]);
    let v = server.generate(body(&prompt, false)).await;
    assert!(v["meta_info"].get("routed_experts").is_none(), "{v}");
    let first = server.generate(body(&prompt, true)).await;
    let (out, _) = check_answer(&first, prompt.len(), false);
    let rows = routed_rows(&first, 4);
    assert_eq!(rows.len(), prompt.len() + out.len() - 1);
    for row in &rows {
        for layer in row.chunks(2) {
            assert!(layer.iter().all(|e| (0..4).contains(e)), "{row:?}");
            assert_ne!(layer[0], layer[1], "{row:?}");
        }
    }
    // The next turn: prompt + output + more, its first blocks from the prefix cache.
    let mut next = prompt.clone();
    next.extend(&out);
    next.extend([7, 8, 9]);
    let second = server.generate(body(&next, true)).await;
    let (out2, _) = check_answer(&second, next.len(), false);
    let cached = second["meta_info"]["cached_tokens"].as_u64().unwrap_or(0) as usize;
    assert!(cached >= 32, "{second}");
    let rows2 = routed_rows(&second, 4);
    assert_eq!(rows2.len(), next.len() + out2.len() - 1);
    assert_eq!(
        rows2[..cached],
        rows[..cached],
        "cached tokens keep their rows"
    );
}
