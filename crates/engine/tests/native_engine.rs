//! The native engine on the CPU (fp32): continuous batching, paged KV with prefix reuse,
//! sampling and stops, checked against one-by-one runs and against transformers.
//!
//! The model is a random-init Qwen3 made by transformers (tests/py/hf_engine_reference.py)
//! with the tiny tokenizer from assets/tiny-qwen3; transformers also scores the outputs.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use futures::future::join_all;
use manta_engine::{
    Engine, EngineError, FinishReason, GenerateOutput, GenerateRequest, MatchedStop, NativeEngine,
    NativeEngineOptions, SamplingParams,
};
use manta_tokenizer::Tokenizer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tch::Device;

#[path = "native_engine/routed_experts.rs"]
mod routed_experts;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn python() -> PathBuf {
    std::env::var_os("MANTA_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv/bin/python"))
}

fn reference(args: &[&str], stdin: Option<&str>) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/hf_engine_reference.py");
    let mut child = Command::new(python())
        .arg(&script)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {} (set MANTA_PYTHON): {e}", python().display()));
    if let Some(input) = stdin {
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
    }
    drop(child.stdin.take());
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "hf_engine_reference.py {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A random-init model (transformers' init) with the tiny tokenizer, in a temp dir.
fn model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let assets = root().join("assets/tiny-qwen3");
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(assets.join("config.json")).unwrap())
            .unwrap();
    // Wider than the default init so distributions are neither flat nor one-hot.
    cfg["initializer_range"] = json!(0.1);
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(assets.join(f), dir.path().join(f)).unwrap();
    }
    reference(&["init", dir.path().to_str().unwrap(), "7"], None);
    dir
}

fn engine(dir: &Path, tweak: impl FnOnce(&mut NativeEngineOptions)) -> Arc<NativeEngine> {
    let mut opts = NativeEngineOptions::new(dir, Device::Cpu);
    opts.seed = 11;
    tweak(&mut opts);
    NativeEngine::start(opts).unwrap()
}

fn greedy(max_new_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_new_tokens,
        temperature: 0.0,
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

fn request(input_ids: Vec<u32>, params: SamplingParams) -> GenerateRequest {
    GenerateRequest {
        input_ids,
        params,
        rid: None,
        return_routed_experts: false,
    }
}

fn prompts(n: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|i| {
            let len = 5 + (i * 7) % 56;
            (0..len).map(|_| rng.random_range(0..256)).collect()
        })
        .collect()
}

async fn run_all(engine: &Arc<NativeEngine>, reqs: Vec<GenerateRequest>) -> Vec<GenerateOutput> {
    join_all(reqs.into_iter().map(|r| engine.generate(r)))
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect()
}

fn assert_same(a: &[GenerateOutput], b: &[GenerateOutput]) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.output_ids, y.output_ids, "request {i}: tokens differ");
        for (p, q) in x.logprobs.iter().zip(&y.logprobs) {
            assert!((p - q).abs() < 1e-4, "request {i}: log-prob {p} vs {q}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_match_one_by_one_runs() {
    let dir = model_dir();
    let ps = prompts(12, 1);
    let alone = engine(dir.path(), |o| o.max_running_requests = 1);
    let mut one_by_one = Vec::new();
    for p in &ps {
        one_by_one.push(
            alone
                .generate(request(p.clone(), greedy(24)))
                .await
                .unwrap(),
        );
    }
    // Small chunks and a small pool: prefill is chunked, requests join mid-decode.
    let batched = engine(dir.path(), |o| o.chunked_prefill_size = 32);
    let together = run_all(
        &batched,
        ps.iter().map(|p| request(p.clone(), greedy(24))).collect(),
    )
    .await;
    assert_same(&one_by_one, &together);
    assert!(together
        .iter()
        .all(|o| o.output_ids.len() == 24 && o.finish == FinishReason::Length));
    let steps = batched
        .stats()
        .steps
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        steps < 12 * 24,
        "requests were not batched together ({steps} steps for 12 x 24 tokens)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_and_sampling_follow_transformers() {
    let dir = model_dir();
    let eng = engine(dir.path(), |_| {});
    let temperature = 1.3;
    // Sampled continuations: every reported log-prob equals transformers'
    // log_softmax(logits / T) at that token.
    let ps = prompts(4, 2);
    let sampled = run_all(
        &eng,
        ps.iter()
            .enumerate()
            .map(|(i, p)| {
                request(
                    p.clone(),
                    SamplingParams {
                        max_new_tokens: 16,
                        temperature,
                        seed: Some(i as u64),
                        ignore_eos: true,
                        ..SamplingParams::default()
                    },
                )
            })
            .collect(),
    )
    .await;
    let items: Vec<Value> = ps
        .iter()
        .zip(&sampled)
        .map(|(p, o)| json!({"prompt": p, "output": o.output_ids, "temperature": temperature}))
        .collect();
    let scored: Vec<Value> = serde_json::from_str(&reference(
        &["score", dir.path().to_str().unwrap()],
        Some(&Value::Array(items).to_string()),
    ))
    .unwrap();
    for (o, s) in sampled.iter().zip(&scored) {
        for (mine, theirs) in o.logprobs.iter().zip(s["logprobs"].as_array().unwrap()) {
            let theirs = theirs.as_f64().unwrap();
            assert!(
                (*mine as f64 - theirs).abs() < 1e-4,
                "log-prob {mine} vs transformers {theirs}"
            );
        }
    }

    // First tokens of many seeded requests follow softmax(logits / T): chi-square test.
    let prompt = ps[0].clone();
    let probs: Vec<f64> = scored[0]["first_probs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_f64().unwrap())
        .collect();
    let first_tokens = |params: SamplingParams, n: u64| {
        let eng = eng.clone();
        let prompt = prompt.clone();
        async move {
            run_all(
                &eng,
                (0..n)
                    .map(|seed| {
                        request(
                            prompt.clone(),
                            SamplingParams {
                                max_new_tokens: 1,
                                temperature,
                                seed: Some(1000 + seed),
                                ignore_eos: true,
                                ..params.clone()
                            },
                        )
                    })
                    .collect(),
            )
            .await
            .into_iter()
            .map(|o| o.output_ids[0] as usize)
            .collect::<Vec<_>>()
        }
    };
    let n = 4000;
    let draws = first_tokens(SamplingParams::default(), n).await;
    let mut counts = vec![0f64; probs.len()];
    for &t in &draws {
        counts[t] += 1.0;
    }
    let chi = |expected: &[f64]| chi_square(&counts, expected, n as f64);
    let (stat, critical) = chi(&probs);
    assert!(
        stat < critical,
        "sampled first tokens do not follow softmax(logits / T): chi2 {stat:.1} >= {critical:.1}"
    );
    // The test can tell distributions apart: uniform is rejected.
    let uniform = vec![1.0 / probs.len() as f64; probs.len()];
    let (stat_u, critical_u) = chi(&uniform);
    assert!(
        stat_u > critical_u,
        "chi-square cannot reject a uniform distribution"
    );

    // Top-k and top-p never leave their sets, and still sample more than one token.
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
    let top_k: Vec<usize> = order[..4].to_vec();
    let mut nucleus = Vec::new();
    let mut mass = 0.0;
    for &t in &order {
        if mass >= 0.5 {
            break;
        }
        nucleus.push(t);
        mass += probs[t];
    }
    for (params, set) in [
        (
            SamplingParams {
                top_k: 4,
                ..SamplingParams::default()
            },
            &top_k,
        ),
        (
            SamplingParams {
                top_p: 0.5,
                ..SamplingParams::default()
            },
            &nucleus,
        ),
    ] {
        let draws = first_tokens(params.clone(), 400).await;
        assert!(
            draws.iter().all(|t| set.contains(t)),
            "{params:?} sampled outside {set:?}"
        );
        let distinct: std::collections::HashSet<_> = draws.iter().collect();
        assert!(distinct.len() > 1, "{params:?} sampled only {distinct:?}");
    }

    // Same seed, same tokens, whatever shares the batch.
    let seeded = |seed| {
        request(
            prompt.clone(),
            SamplingParams {
                max_new_tokens: 12,
                temperature,
                seed: Some(seed),
                ignore_eos: true,
                ..SamplingParams::default()
            },
        )
    };
    let alone = eng.generate(seeded(5)).await.unwrap();
    let mixed = run_all(&eng, vec![seeded(6), seeded(5), seeded(7)]).await;
    assert_eq!(alone.output_ids, mixed[1].output_ids);
}

/// Pearson's statistic over bins with expected count >= 5 (the rest pooled), and the
/// critical value at p = 0.001 (Wilson-Hilferty).
fn chi_square(counts: &[f64], probs: &[f64], n: f64) -> (f64, f64) {
    let (mut stat, mut bins) = (0.0, 0usize);
    let (mut pooled_obs, mut pooled_exp) = (0.0, 0.0);
    for (&c, &p) in counts.iter().zip(probs) {
        let e = p * n;
        if e >= 5.0 {
            stat += (c - e).powi(2) / e;
            bins += 1;
        } else {
            pooled_obs += c;
            pooled_exp += e;
        }
    }
    if pooled_exp > 0.0 {
        stat += (pooled_obs - pooled_exp).powi(2) / pooled_exp.max(1e-9);
        bins += 1;
    }
    let dof = (bins - 1) as f64;
    let z = 3.09;
    let a = 2.0 / (9.0 * dof);
    (stat, dof * (1.0 - a + z * a.sqrt()).powi(3))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_reuse_matches_a_fresh_prefill() {
    let dir = model_dir();
    let eng = engine(dir.path(), |_| {});
    let prompt = prompts(1, 3).remove(0);
    let prompt: Vec<u32> = prompt.into_iter().cycle().take(50).collect();
    let first = eng
        .generate(request(prompt.clone(), greedy(20)))
        .await
        .unwrap();
    assert_eq!(first.cached_tokens, 0);
    // The next turn extends the previous one (prompt + output + a tool result).
    let mut next = prompt.clone();
    next.extend(&first.output_ids);
    next.extend([10, 11, 12, 13, 14]);
    let reused = eng
        .generate(request(next.clone(), greedy(16)))
        .await
        .unwrap();
    // 50 + 19 tokens were computed: four whole blocks of 16.
    assert_eq!(reused.cached_tokens, 64);
    assert_eq!(reused.prompt_tokens, next.len());
    let fresh_engine = engine(dir.path(), |_| {});
    let fresh = fresh_engine
        .generate(request(next.clone(), greedy(16)))
        .await
        .unwrap();
    assert_eq!(fresh.cached_tokens, 0);
    assert_same(&[fresh], &[reused]);
    // flush_cache drops it.
    assert!(eng.flush_cache().await.unwrap());
    let after = eng.generate(request(next, greedy(1))).await.unwrap();
    assert_eq!(after.cached_tokens, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_ids_stop_strings_and_max_tokens_are_honoured() {
    let dir = model_dir();
    let eng = engine(dir.path(), |_| {});
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let prompt = prompts(1, 4).remove(0);
    let full = eng
        .generate(request(prompt.clone(), greedy(40)))
        .await
        .unwrap();
    let out = &full.output_ids;

    let k = (5..out.len())
        .find(|&k| !out[..k].contains(&out[k]))
        .expect("a token that first appears after position 5");
    let by_id = eng
        .generate(request(
            prompt.clone(),
            SamplingParams {
                stop_token_ids: vec![out[k]],
                ..greedy(40)
            },
        ))
        .await
        .unwrap();
    assert_eq!(by_id.output_ids, out[..=k]);
    assert_eq!(by_id.finish, FinishReason::Stop);
    assert_eq!(by_id.matched_stop, Some(MatchedStop::Token(out[k])));

    // A stop string: the text of two tokens from the middle of the output.
    let text = |ids: &[u32]| tok.decode(ids, false).unwrap();
    let stop = text(&out[20..22]);
    let end = (0..out.len())
        .find(|&e| text(&out[..=e]).contains(&stop))
        .unwrap();
    let by_text = eng
        .generate(request(
            prompt.clone(),
            SamplingParams {
                stop: vec![stop.clone()],
                ..greedy(40)
            },
        ))
        .await
        .unwrap();
    assert_eq!(by_text.output_ids, out[..=end], "stop string {stop:?}");
    assert_eq!(by_text.matched_stop, Some(MatchedStop::Text(stop)));

    let short = eng.generate(request(prompt, greedy(7))).await.unwrap();
    assert_eq!(short.output_ids, out[..7]);
    assert_eq!(short.finish, FinishReason::Length);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_exhaustion_queues_or_preempts_instead_of_failing() {
    let dir = model_dir();
    let big = engine(dir.path(), |_| {});
    let ps: Vec<Vec<u32>> = prompts(6, 5)
        .into_iter()
        .map(|p| p.into_iter().cycle().take(30).collect())
        .collect();
    let reqs = || ps.iter().map(|p| request(p.clone(), greedy(30))).collect();
    let expected = run_all(&big, reqs()).await;
    // 96 tokens of KV: one request (60 tokens) at a time fits, six together do not.
    let small = engine(dir.path(), |o| o.max_total_tokens = Some(96));
    let got = run_all(&small, reqs()).await;
    assert_same(&expected, &got);
    let preempted = small
        .stats()
        .preemptions
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(preempted > 0, "the small pool never had to preempt");
    // A prompt larger than the whole cache is refused with a message, not hung.
    let err = small
        .generate(request(vec![1; 200], greedy(4)))
        .await
        .unwrap_err();
    assert!(matches!(err, EngineError::BadRequest(_)), "{err}");
    assert!(err.to_string().contains("context length"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_returns_the_partial_output_and_bad_requests_name_the_field() {
    let dir = model_dir();
    let eng = engine(dir.path(), |_| {});
    let long = {
        let eng = eng.clone();
        tokio::spawn(async move {
            eng.generate(GenerateRequest {
                input_ids: vec![1, 2, 3],
                params: greedy(2000),
                rid: Some("long".into()),
                return_routed_experts: false,
            })
            .await
        })
    };
    while eng.stats().steps.load(std::sync::atomic::Ordering::Relaxed) < 5 {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    eng.abort(Some("long".into())).await.unwrap();
    let out = long.await.unwrap().unwrap();
    assert_eq!(out.finish, FinishReason::Abort);
    assert!(!out.output_ids.is_empty() && out.output_ids.len() < 2000);

    for (req, field) in [
        (request(vec![], greedy(1)), "input_ids"),
        (request(vec![9999], greedy(1)), "input_ids"),
        (
            request(
                vec![1],
                SamplingParams {
                    temperature: -1.0,
                    ..greedy(1)
                },
            ),
            "temperature",
        ),
        (
            request(
                vec![1],
                SamplingParams {
                    top_p: 0.0,
                    ..greedy(1)
                },
            ),
            "top_p",
        ),
    ] {
        let err = eng.generate(req).await.unwrap_err();
        assert!(err.to_string().contains(field), "{err} should name {field}");
    }
    // And the engine still serves.
    eng.generate(request(vec![1, 2], greedy(2))).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_weight_update_waits_for_earlier_requests_and_versions_follow() {
    let dir = model_dir();
    let eng = engine(dir.path(), |_| {});
    let prompt = prompts(1, 6).remove(0);
    let early = {
        let eng = eng.clone();
        let prompt = prompt.clone();
        tokio::spawn(async move { eng.generate(request(prompt, greedy(300))).await })
    };
    while eng.stats().steps.load(std::sync::atomic::Ordering::Relaxed) < 3 {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // Same weights, new version: the update applies once `early` is done.
    eng.update_weights_from_disk(dir.path().to_path_buf(), 5)
        .await
        .unwrap();
    let early = early.await.unwrap().unwrap();
    assert_eq!(
        early.output_ids.len(),
        300,
        "the earlier request finished first"
    );
    assert_eq!(early.weight_version, 0);
    assert_eq!(eng.weight_version(), 5);
    let late = eng.generate(request(prompt, greedy(4))).await.unwrap();
    assert_eq!(late.weight_version, 5);
    // The update cleared the prefix cache: nothing of the earlier request is reused.
    assert_eq!(late.cached_tokens, 0);
}

/// A colocated engine frees its KV cache while the trainer steps: refused while a request
/// runs; while released, new requests wait (no step runs); after the resume they finish
/// with the tokens a never-released engine gives, and nothing stale is reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn released_kv_memory_holds_requests_until_resumed() {
    use std::sync::atomic::Ordering;
    let dir = model_dir();
    let eng = engine(dir.path(), |_| {});
    let prompt = prompts(1, 9).remove(0);
    let expected = eng
        .generate(request(prompt.clone(), greedy(12)))
        .await
        .unwrap();

    // Busy: a long generation is running, so the release is refused.
    let before = eng.stats().steps.load(Ordering::Relaxed);
    let long = {
        let eng = eng.clone();
        let prompt = prompt.clone();
        tokio::spawn(async move { eng.generate(request(prompt, greedy(200))).await })
    };
    while eng.stats().steps.load(Ordering::Relaxed) < before + 3 {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!(!eng.release_memory_occupation().await.unwrap());
    long.await.unwrap().unwrap();

    assert!(eng.release_memory_occupation().await.unwrap());
    let steps = eng.stats().steps.load(Ordering::Relaxed);
    let waiting = {
        let eng = eng.clone();
        let prompt = prompt.clone();
        tokio::spawn(async move { eng.generate(request(prompt, greedy(12))).await })
    };
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "a request ran on a released KV cache"
    );
    assert_eq!(eng.stats().steps.load(Ordering::Relaxed), steps);

    eng.resume_memory_occupation().await.unwrap();
    let after = waiting.await.unwrap().unwrap();
    assert_eq!(after.output_ids, expected.output_ids);
    assert_eq!(
        after.cached_tokens, 0,
        "the prefix cache went with the memory"
    );
}

/// True on-policy mode needs the GPU kernel: on the CPU the engine refuses to start and
/// says why, instead of silently running the default numerics.
#[test]
fn true_on_policy_mode_on_the_cpu_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        root().join("assets/tiny-qwen3/config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let mut opts = NativeEngineOptions::new(dir.path(), Device::Cpu);
    opts.true_on_policy = true;
    let err = NativeEngine::start(opts)
        .err()
        .expect("true on-policy mode on the CPU must fail")
        .to_string();
    assert!(
        err.contains("true on-policy mode") && err.contains("CUDA"),
        "{err}"
    );
}
