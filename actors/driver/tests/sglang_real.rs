//! Manta's SGLang engine against the real SGLang server (0.5.17, installed on the GPU
//! machine by `bench/sglang/`), as `[rollout] engine = "sglang"` launches it: the
//! command line the rollout actor builds, health checks, generation with log-probs,
//! weights over NCCL from a trainer-side group on another GPU, the disk route, the
//! drain pause as SGLang does it (`retract`: running requests go back to the queue and
//! finish after the update), the abort pause, and a server killed with SIGKILL
//! mid-generation (restarted, every request answered, NCCL again into the new process).
//!
//! Weights are compared by SGLang itself: `/weights_checker` hashes every parameter as
//! the server holds it, so weights broadcast over NCCL and the same weights loaded from
//! a safetensors file must give the same checksum, bit for bit.
//!
//! Ignored everywhere: it needs two CUDA devices and SGLang importable by python3.
//! `bench/run_sglang_interop.sh` runs it on the device machine with
//! `MANTA_SGLANG_MODEL` (a config-only Qwen3 directory; the server starts with
//! `--load-format dummy`) and optionally `MANTA_SGLANG_ARGS` (extra server flags).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use manta_config::RolloutSection;
use manta_engine::{
    Engine, FinishReason, GenerateOutput, GenerateRequest, NcclTarget, PauseMode, SamplingParams,
    SglangEngine, SglangOptions,
};
use manta_model::{CausalLm, ModelConfig};
use serde_json::{json, Value};
use tch::nn::VarStore;
use tch::{Device, Tensor};

/// Random weights of the model's shape on `device`, in bf16 (the server's dtype), from
/// `seed`, named as Manta's trainer names them.
fn random_weights(cfg: &ModelConfig, seed: i64, device: Device) -> VarStore {
    tch::manual_seed(seed);
    let mut vs = VarStore::new(device);
    let _model = CausalLm::new(&vs.root(), cfg);
    vs.bfloat16();
    vs
}

fn named(vs: &VarStore) -> Vec<(String, Tensor)> {
    vs.variables().into_iter().collect()
}

/// The weights as a model directory the server can load: Manta's safetensors and the
/// original config.json (as the engine's own disk route writes them).
fn saved(vs: &VarStore, cfg: &ModelConfig, model: &Path, dir: &Path) {
    manta_model::save_pretrained(vs, cfg, dir).expect("save the weights");
    std::fs::copy(model.join("config.json"), dir.join("config.json")).expect("config.json");
}

/// SGLang's own checksum of every parameter it holds.
async fn checksum(engine: &SglangEngine) -> String {
    let answer: Value = reqwest::Client::new()
        .post(format!("{}/weights_checker", engine.base_url()))
        .json(&json!({"action": "checksum"}))
        .timeout(Duration::from_secs(120))
        .send()
        .await
        .expect("/weights_checker answers")
        .json()
        .await
        .expect("/weights_checker JSON");
    assert_eq!(answer["success"], true, "/weights_checker: {answer}");
    answer["per_engine_checksum"]
        .as_str()
        .unwrap_or_else(|| panic!("no per_engine_checksum: {answer}"))
        .to_string()
}

fn request(prompt: u32, new_tokens: usize, greedy: bool) -> GenerateRequest {
    GenerateRequest {
        input_ids: (0..16).map(|i| 1000 + prompt * 16 + i).collect(),
        params: SamplingParams {
            max_new_tokens: new_tokens,
            temperature: if greedy { 0.0 } else { 1.0 },
            ignore_eos: true,
            ..SamplingParams::default()
        },
        rid: None,
        return_routed_experts: false,
    }
}

/// `count` generations of `new_tokens` each, started now.
fn start_many(
    engine: &Arc<SglangEngine>,
    count: u32,
    new_tokens: usize,
) -> Vec<tokio::task::JoinHandle<Result<GenerateOutput, manta_engine::EngineError>>> {
    (0..count)
        .map(|i| {
            let engine = engine.clone();
            tokio::spawn(async move { engine.generate(request(i, new_tokens, false)).await })
        })
        .collect()
}

async fn finished(
    tasks: Vec<tokio::task::JoinHandle<Result<GenerateOutput, manta_engine::EngineError>>>,
) -> Vec<GenerateOutput> {
    let mut outs = Vec::new();
    for t in tasks {
        outs.push(t.await.expect("request task").expect("request answered"));
    }
    outs
}

fn log(start: Instant, what: &str) {
    eprintln!("[{:7.1} s] {what}", start.elapsed().as_secs_f64());
}

#[ignore = "needs two CUDA devices and SGLang: bench/run_sglang_interop.sh runs it"]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn real_sglang_takes_manta_weights_and_survives_pauses_and_a_kill() {
    let Ok(model) = std::env::var("MANTA_SGLANG_MODEL") else {
        eprintln!("skipped: MANTA_SGLANG_MODEL is not set (bench/run_sglang_interop.sh sets it)");
        return;
    };
    assert!(
        tch::Cuda::device_count() >= 2,
        "needs two CUDA devices: the trainer's side and the server"
    );
    let trainer_gpu = manta_cuda::test_gpu().expect("a CUDA device");
    assert!(
        trainer_gpu < 2,
        "MANTA_TEST_GPU={trainer_gpu}: GPUs 0 and 1"
    );
    let server_gpu = (1 - trainer_gpu) as u32;
    let model = PathBuf::from(model);
    let cfg = ModelConfig::from_file(&model.join("config.json")).expect("model config");
    // The server's log outlives the test where the script asks (MANTA_SGLANG_LOG_DIR).
    let logs = tempfile::tempdir().expect("log dir");
    let log_dir = std::env::var("MANTA_SGLANG_LOG_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| logs.path().to_path_buf());
    std::fs::create_dir_all(&log_dir).expect("log dir");
    let started = Instant::now();

    // The command line exactly as the rollout actor builds it from cluster.toml.
    let extra: Vec<String> = std::env::var("MANTA_SGLANG_ARGS")
        .unwrap_or_else(|_| "--attention-backend flashinfer".into())
        .split_whitespace()
        .map(String::from)
        .chain(["--load-format".into(), "dummy".into()])
        .collect();
    let rollout = RolloutSection {
        command: Some(vec![
            "python3".into(),
            "-m".into(),
            "sglang.launch_server".into(),
        ]),
        extra_args: extra,
        max_batch_size: 64,
        mem_fraction_static: Some(0.5),
        ..RolloutSection::default()
    };
    let mut opts = SglangOptions::new(
        &manta_driver::local::sglang_server(&rollout),
        "engine-0",
        &model,
        &[server_gpu],
        1,
        log_dir.join("engine-0.log"),
    );
    opts.health_timeout = Duration::from_secs(900);
    opts.health_interval = Duration::from_millis(500);
    opts.request_timeout = Duration::from_secs(600);
    opts.max_restarts = 2;
    let log_path = opts.launch.log.clone();
    let engine = match SglangEngine::launch(opts).await {
        Ok(e) => e,
        Err(e) => panic!("launch: {e}"),
    };
    log(started, "server healthy");

    // Generation with log-probs from the dummy weights (version 0).
    let out = engine
        .generate(request(0, 16, true))
        .await
        .expect("generate");
    assert_eq!(out.output_ids.len(), 16);
    assert_eq!(out.logprobs.len(), 16);
    assert!(out.logprobs.iter().all(|l| l.is_finite() && *l <= 0.0));
    assert_eq!(out.weight_version, 0);
    assert_eq!(out.prompt_tokens, 16, "meta_info.prompt_tokens");
    let dummy = checksum(&engine).await;

    // NCCL: the trainer's side is rank 0 on its own GPU; the server joins.
    engine
        .feed_over_nccl(NcclTarget {
            device: trainer_gpu,
            master_address: "127.0.0.1".into(),
        })
        .await
        .expect("/init_weights_update_group");
    let w1 = random_weights(&cfg, 1, Device::Cuda(trainer_gpu));
    let t = Instant::now();
    engine
        .update_weights(named(&w1), 1)
        .await
        .expect("update over NCCL");
    log(
        started,
        &format!("NCCL update: {:.3} s", t.elapsed().as_secs_f64()),
    );
    assert_eq!(engine.weight_version(), 1);
    let over_nccl = checksum(&engine).await;
    assert_ne!(
        over_nccl, dummy,
        "the broadcast changed the server's weights"
    );
    let g_nccl = engine
        .generate(request(0, 16, true))
        .await
        .expect("generate");
    assert_eq!(g_nccl.weight_version, 1, "meta_info.weight_version");

    // The same weights from disk: SGLang holds the same bits.
    let dir = tempfile::tempdir().expect("weights dir");
    saved(&w1, &cfg, &model, dir.path());
    engine
        .update_weights_from_disk(dir.path().to_path_buf(), 2)
        .await
        .expect("/update_weights_from_disk");
    assert_eq!(
        checksum(&engine).await,
        over_nccl,
        "NCCL and disk weights differ"
    );
    let g_disk = engine
        .generate(request(0, 16, true))
        .await
        .expect("generate");
    assert_eq!(g_disk.output_ids, g_nccl.output_ids);
    assert_eq!(g_disk.logprobs, g_nccl.logprobs);
    assert_eq!(g_disk.weight_version, 2);
    log(started, "NCCL weights equal disk weights bit for bit");

    // The drain pause: SGLang has none (its `retract` re-queues running requests, and an
    // update that flushes the cache then kills its scheduler), so Manta drains on its
    // side: running requests finish on the old weights, a request that comes during the
    // pause waits and runs on the new ones.
    let w2 = random_weights(&cfg, 2, Device::Cuda(trainer_gpu));
    let running = start_many(&engine, 32, 1024);
    tokio::time::sleep(Duration::from_millis(800)).await;
    let pausing = {
        let engine = engine.clone();
        tokio::spawn(async move { engine.pause(PauseMode::Drain).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let late = {
        let engine = engine.clone();
        tokio::spawn(async move { engine.generate(request(99, 16, true)).await })
    };
    pausing.await.expect("pause task").expect("drain");
    let outs = finished(running).await;
    for o in &outs {
        assert_eq!(o.finish, FinishReason::Length, "a drained request finishes");
        assert_eq!(o.output_ids.len(), 1024);
        assert_eq!(o.logprobs.len(), 1024);
        assert_eq!(o.weight_version, 2, "on the old weights");
    }
    assert!(!late.is_finished(), "a request during the pause waits");
    engine
        .update_weights(named(&w2), 3)
        .await
        .expect("update while drained");
    engine.resume().await.expect("resume");
    let late = late.await.expect("late task").expect("late request");
    assert_eq!(
        late.weight_version, 3,
        "the late request runs on the new weights"
    );
    assert_eq!(engine.restarts(), 0, "no restart so far");
    let w2_sum = checksum(&engine).await;
    assert_ne!(w2_sum, over_nccl);
    log(
        started,
        "drain: 32 requests finished on version 2, the late one on 3",
    );

    // The abort pause: running requests end now with what they generated.
    let running = start_many(&engine, 8, 2048);
    tokio::time::sleep(Duration::from_millis(800)).await;
    engine.pause(PauseMode::Abort).await.expect("pause (abort)");
    let outs = finished(running).await;
    engine.resume().await.expect("continue_generation");
    for o in &outs {
        assert_eq!(o.finish, FinishReason::Abort, "an aborted request says so");
        assert!(o.output_ids.len() < 2048);
        assert_eq!(o.output_ids.len(), o.logprobs.len());
    }
    log(
        started,
        "abort: 8 requests ended early with their partial output",
    );

    // SIGKILL mid-generation: the engine restarts the server and sends the requests in
    // flight again; the NCCL weights died with the process (version 0) and the next
    // update joins a new group.
    let pid = engine.pid().expect("server pid");
    let running = start_many(&engine, 16, 2048);
    tokio::time::sleep(Duration::from_millis(800)).await;
    let killed = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    log(started, &format!("killed the server (pid {pid})"));
    let outs = finished(running).await;
    assert_eq!(outs.len(), 16);
    for o in &outs {
        assert_eq!(o.output_ids.len(), 2048, "every request answered in full");
    }
    assert_eq!(engine.restarts(), 1);
    assert_ne!(engine.pid(), Some(pid));
    assert_eq!(
        engine.weight_version(),
        0,
        "NCCL weights die with the process"
    );
    log(started, "restarted; every request in flight answered");
    engine
        .update_weights(named(&w2), 4)
        .await
        .expect("NCCL into the restarted server");
    assert_eq!(
        checksum(&engine).await,
        w2_sum,
        "after the restart, bit for bit"
    );
    log(started, "NCCL into the restarted server: same checksum");
    drop(engine);
    let text = std::fs::read_to_string(&log_path).unwrap_or_default();
    eprintln!("engine log: {} lines", text.lines().count());
}
