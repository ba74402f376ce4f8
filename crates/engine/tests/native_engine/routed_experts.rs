//! The native engine's routed experts (SGLang's `--enable-return-routed-experts`, for
//! rollout routing replay) on the CPU: a request that asks gets one row per token of
//! prompt + output but the last, prefix-cached tokens included, and every row holds the
//! experts transformers' router picks for that token (a random-init Qwen3-MoE made by
//! tests/py/hf_engine_reference.py).

use std::path::Path;
use std::sync::Arc;

use manta_engine::{
    Engine, EngineError, GenerateOutput, GenerateRequest, NativeEngine, NativeEngineOptions,
};
use tch::Device;

use super::{greedy, reference, request, root};

/// The tiny Qwen3-MoE config (2 sparse layers, 4 experts, top-2), weights from
/// transformers' init with spread-out routers.
fn moe_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        root().join("assets/tiny-qwen3-moe/config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    reference(&["init", dir.path().to_str().unwrap(), "5"], None);
    dir
}

fn recording_engine(dir: &Path, record: bool) -> Result<Arc<NativeEngine>, EngineError> {
    let mut opts = NativeEngineOptions::new(dir, Device::Cpu);
    opts.enable_return_routed_experts = record;
    NativeEngine::start(opts)
}

fn routed_request(input_ids: Vec<u32>, new_tokens: usize, routed: bool) -> GenerateRequest {
    GenerateRequest {
        return_routed_experts: routed,
        ..request(input_ids, greedy(new_tokens))
    }
}

/// The answer's rows as [token][layer] ascending expert ids.
fn rows(out: &GenerateOutput) -> Vec<Vec<Vec<i32>>> {
    let r = out
        .routed_experts
        .as_ref()
        .expect("routed experts asked for");
    assert_eq!((r.layers, r.top_k), (2, 2));
    r.ids
        .chunks(4)
        .map(|row| {
            row.chunks(2)
                .map(|layer| {
                    let mut l = layer.to_vec();
                    l.sort();
                    l
                })
                .collect()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routed_experts_cover_every_token_but_the_last_and_follow_transformers() {
    let dir = moe_dir();
    let eng = recording_engine(dir.path(), true).unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 250).collect();
    let other: Vec<u32> = (0..23).map(|i| (i * 53 + 7) % 250).collect();
    // Two requests batched together, and one that does not ask.
    let (first, second, plain) = tokio::join!(
        eng.generate(routed_request(prompt.clone(), 9, true)),
        eng.generate(routed_request(other.clone(), 6, true)),
        eng.generate(routed_request(other.clone(), 3, false)),
    );
    let (first, second, plain) = (first.unwrap(), second.unwrap(), plain.unwrap());
    assert!(plain.routed_experts.is_none());
    // The next turn extends the first: its prompt's first blocks come from the cache.
    let mut next = prompt.clone();
    next.extend(&first.output_ids);
    next.extend([3, 4, 5]);
    let reused = eng
        .generate(routed_request(next.clone(), 5, true))
        .await
        .unwrap();
    assert!(reused.cached_tokens >= 32, "{}", reused.cached_tokens);

    let seq = |p: &[u32], out: &GenerateOutput| {
        let mut s = p.to_vec();
        s.extend(&out.output_ids);
        s.pop(); // the last token never ran
        s
    };
    let runs = [(&prompt, &first), (&other, &second), (&next, &reused)];
    let seqs: Vec<Vec<u32>> = runs.iter().map(|(p, o)| seq(p, o)).collect();
    let want: Vec<Vec<Vec<Vec<i32>>>> = serde_json::from_str(&reference(
        &["routed", dir.path().to_str().unwrap()],
        Some(&serde_json::to_string(&seqs).unwrap()),
    ))
    .unwrap();
    for ((s, (_, out)), want) in seqs.iter().zip(runs).zip(want) {
        let got = rows(out);
        assert_eq!(got.len(), s.len(), "one row per token but the last");
        let differ = got.iter().zip(&want).filter(|(g, w)| g != w).count();
        assert_eq!(
            differ,
            0,
            "{differ} of {} rows differ from transformers' routing",
            got.len()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routed_experts_need_the_engine_flag_and_a_moe_model() {
    let dir = moe_dir();
    let eng = recording_engine(dir.path(), false).unwrap();
    let err = eng
        .generate(routed_request(vec![1, 2, 3], 2, true))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("return_routed_experts"), "{err}");
    let dense = tempfile::tempdir().unwrap();
    std::fs::copy(
        root().join("assets/tiny-qwen3/config.json"),
        dense.path().join("config.json"),
    )
    .unwrap();
    let err = recording_engine(dense.path(), true)
        .err()
        .expect("a dense model refused");
    assert!(err.to_string().contains("dense model"), "{err}");
}
