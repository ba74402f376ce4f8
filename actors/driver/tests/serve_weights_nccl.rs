//! `driver serve`'s NCCL weight-update routes (SGLang's `/init_weights_update_group`,
//! `/update_weights_from_distributed`, `/destroy_weights_update_group`), over HTTP against
//! the real binary.
//!
//! On the CPU (every machine): bad requests are 400 with a message naming the field
//! (missing fields, backend, ranks, unknown tensor names, shape and dtype mismatches, no
//! group), a valid init says NCCL needs a CUDA device, and the server keeps serving with
//! its weights untouched.
//!
//! With two GPUs (the device machine; ignored elsewhere): a Manta trainer in this test
//! process hosts the group as rank 0 on GPU `MANTA_TEST_GPU` (`manta_cuda::process_group`),
//! the server on the other GPU joins as rank 1, receives random weights by broadcast, and
//! then generates exactly what it generates after loading the same weights from disk.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use manta_model::{CausalLm, ModelConfig};
use serde_json::{json, Value};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

#[path = "driver/common/mod.rs"]
mod common;
use common::serve::Server;

/// The tiny model's assets; from the repository root when the test binary runs on
/// another machine (the device machine runs it from a copy of the tree).
fn tiny_assets() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tiny-qwen3");
    if built.is_dir() {
        built
    } else {
        PathBuf::from("assets/tiny-qwen3")
    }
}

/// The `driver` binary: `MANTA_DRIVER_BIN` (e.g. `bin/driver` on the device machine),
/// else the one cargo built with this test.
fn driver_bin() -> PathBuf {
    std::env::var_os("MANTA_DRIVER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_driver")))
}

fn model_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tiny_assets().join(f), dir.path().join(f)).expect("copy tiny asset");
    }
    dir
}

/// `driver serve` with `device` flags, from [`driver_bin`].
fn start(model: &Path, device: &[&str]) -> Server {
    Server::start(driver_bin(), model, device)
}

/// Greedy tokens and their log-probs for a fixed prompt.
async fn greedy(server: &Server) -> (Vec<i64>, Vec<f64>) {
    let (status, out) = server
        .post(
            "/generate",
            json!({"input_ids": [1, 2, 3, 4, 5], "return_logprob": true,
                   "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": true}}),
        )
        .await;
    assert_eq!(status, 200, "{out}");
    let tokens = out["output_ids"]
        .as_array()
        .expect("output_ids")
        .iter()
        .map(|t| t.as_i64().unwrap())
        .collect();
    let logprobs = out["meta_info"]["output_token_logprobs"]
        .as_array()
        .expect("output_token_logprobs")
        .iter()
        .map(|e| e[0].as_f64().unwrap())
        .collect();
    (tokens, logprobs)
}

/// Asserts a refused call: 400, `success: false`, and a message containing `want`.
fn refused(call: &str, (status, body): (u16, Value), want: &str) {
    assert_eq!(status, 400, "{call}: {body}");
    assert_eq!(body["success"], json!(false), "{call}: {body}");
    let message = body["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(want),
        "{call}: {want:?} not in {message:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_weight_update_requests_are_refused_by_field_and_the_server_keeps_serving() {
    let model = model_dir();
    let server = start(model.path(), &["--device", "cpu"]);
    let version = server.get("/get_weight_version").await.1;
    let before = greedy(&server).await;
    let init = json!({"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1,
                      "world_size": 2, "group_name": "g", "backend": "nccl"});
    let with = |key: &str, value: Value| {
        let mut v = init.clone();
        v[key] = value;
        v
    };
    let without = |key: &str| {
        let mut v = init.clone();
        v.as_object_mut().unwrap().remove(key);
        v
    };

    // /init_weights_update_group
    for field in ["master_address", "master_port", "rank_offset", "world_size"] {
        refused(
            &format!("init without {field}"),
            server
                .post("/init_weights_update_group", without(field))
                .await,
            field,
        );
    }
    // (case, field, bad value, what the message must name)
    let bad_init = [
        ("init gloo", "backend", json!("gloo"), "backend"),
        ("init rank 0", "rank_offset", json!(0), "rank_offset"),
        (
            "init rank beyond the world",
            "rank_offset",
            json!(2),
            "world_size 2",
        ),
        ("init world 0", "world_size", json!(0), "world_size 0"),
        (
            "init port out of range",
            "master_port",
            json!(70000),
            "master_port",
        ),
    ];
    for (case, key, value, want) in bad_init {
        let answer = server
            .post("/init_weights_update_group", with(key, value))
            .await;
        refused(case, answer, want);
    }
    refused(
        "init on a CPU server",
        server
            .post("/init_weights_update_group", init.clone())
            .await,
        "NCCL needs a CUDA device",
    );

    // /update_weights_from_distributed: every check before the group's.
    let update = json!({"names": ["model.norm.weight"], "dtypes": ["bfloat16"], "shapes": [[64]],
                        "group_name": "g"});
    let upd = |key: &str, value: Value| {
        let mut v = update.clone();
        v[key] = value;
        v
    };
    for field in ["names", "dtypes", "shapes"] {
        let mut v = update.clone();
        v.as_object_mut().unwrap().remove(field);
        refused(
            &format!("update without {field}"),
            server.post("/update_weights_from_distributed", v).await,
            field,
        );
    }
    let bad_update = [
        (
            "update unknown tensor",
            "names",
            json!(["model.no_such.weight"]),
            "names[0]: unknown tensor \"model.no_such.weight\"",
        ),
        ("update wrong shape", "shapes", json!([[65]]), "shapes[0]"),
        (
            "update unknown dtype",
            "dtypes",
            json!(["quaternion"]),
            "dtypes[0]",
        ),
        (
            "update lists of different lengths",
            "dtypes",
            json!(["bfloat16", "bfloat16"]),
            "dtypes",
        ),
        (
            "update bad version",
            "weight_version",
            json!("v7"),
            "weight_version",
        ),
    ];
    for (case, key, value, want) in bad_update {
        let answer = server
            .post("/update_weights_from_distributed", upd(key, value))
            .await;
        refused(case, answer, want);
    }
    refused(
        "update without a group",
        server
            .post("/update_weights_from_distributed", update.clone())
            .await,
        "group_name: no weight update group \"g\"",
    );

    // /destroy_weights_update_group
    refused(
        "destroy without a group",
        server
            .post("/destroy_weights_update_group", json!({"group_name": "g"}))
            .await,
        "group_name",
    );

    // Still serving, weights and version untouched.
    assert_eq!(server.get("/get_weight_version").await.1, version);
    assert_eq!(greedy(&server).await, before);
}

/// Random weights for the tiny model on the CPU, named as the engine names its
/// parameters, scaled up (so outputs differ from the server's init) and exact in bf16 (so
/// the broadcast bf16 tensors and the fp32 files load to the same values).
fn random_weights(seed: i64) -> (VarStore, ModelConfig) {
    let cfg = ModelConfig::from_file(&tiny_assets().join("config.json")).expect("tiny config");
    tch::manual_seed(seed);
    let vs = VarStore::new(Device::Cpu);
    let _model = CausalLm::new(&vs.root(), &cfg);
    tch::no_grad(|| {
        for (_, mut var) in vs.variables() {
            let scaled = (&var * 20.0).to_kind(Kind::BFloat16).to_kind(Kind::Float);
            var.copy_(&scaled);
        }
    });
    (vs, cfg)
}

/// (trainer GPU, server GPU): the trainer on `MANTA_TEST_GPU` (0 or 1), the server on the
/// other, so one run per value proves both directions; `None` with fewer than two GPUs.
fn gpu_pair() -> Option<(usize, usize)> {
    if tch::Cuda::device_count() < 2 {
        return None;
    }
    let trainer = manta_cuda::test_gpu()?;
    assert!(
        trainer < 2,
        "MANTA_TEST_GPU={trainer}: these tests use GPUs 0 and 1"
    );
    Some((trainer, 1 - trainer))
}

#[ignore = "needs two CUDA devices: bench/run_gpu_tests.sh runs it"]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manta_trainer_broadcasts_weights_into_a_server_on_another_gpu() {
    use manta_cuda::process_group::{GroupSpec, ProcessGroup};
    let Some((trainer_gpu, server_gpu)) = gpu_pair() else {
        eprintln!("skipped: needs two CUDA devices (nvidia-h200-x2 runs this)");
        return;
    };
    let model = model_dir();
    let server = start(
        model.path(),
        &[
            "--device",
            "cuda",
            "--base-gpu-id",
            &server_gpu.to_string(),
            "--dtype",
            "bfloat16",
        ],
    );
    let untouched = greedy(&server).await;
    // The trainer: rank 0 on its GPU, hosting the store on a free port.
    let group = ProcessGroup::join(GroupSpec {
        master_address: "127.0.0.1".into(),
        master_port: 0,
        rank: 0,
        world_size: 2,
        group_name: "manta_test_group".into(),
        device: trainer_gpu,
        timeout: Duration::from_secs(120),
    })
    .expect("trainer joins as rank 0");
    let port = group.store_port();
    let (status, body) = server
        .post(
            "/init_weights_update_group",
            json!({"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                   "world_size": 2, "group_name": "manta_test_group", "backend": "nccl"}),
        )
        .await;
    assert_eq!(status, 200, "{body}");

    let (vs, cfg) = random_weights(5);
    let mut named: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(n, t)| {
            let t = t
                .to_device(Device::Cuda(trainer_gpu))
                .to_kind(Kind::BFloat16);
            (n, t.contiguous())
        })
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    // Two buckets, as SGLang callers send them; the version goes with the last.
    let half = named.len() / 2;
    let mut group = group;
    for (i, bucket) in [&named[..half], &named[half..]].into_iter().enumerate() {
        let body = json!({
            "names": bucket.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(),
            "dtypes": bucket.iter().map(|_| "bfloat16").collect::<Vec<_>>(),
            "shapes": bucket.iter().map(|(_, t)| t.size()).collect::<Vec<_>>(),
            "group_name": "manta_test_group",
            "weight_version": if i == 1 { "7" } else { "6" },
        });
        let post = server.post("/update_weights_from_distributed", body);
        let tensors: Vec<(String, Tensor)> = bucket
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        let send = tokio::task::spawn_blocking(move || {
            let r = group.broadcast(&tensors, 0);
            (group, r)
        });
        let ((status, answer), sent) = tokio::join!(post, send);
        let (g, sent) = sent.expect("broadcast thread");
        group = g;
        sent.expect("trainer broadcast");
        assert_eq!(status, 200, "{answer}");
    }
    assert_eq!(
        server.get("/get_weight_version").await.1["weight_version"],
        json!("7")
    );
    let broadcast = greedy(&server).await;
    assert_ne!(broadcast, untouched, "the weights changed");

    // The same weights from disk give the same tokens and log-probs, bit for bit.
    let dir = model_dir();
    manta_model::save_pretrained(&vs, &cfg, dir.path()).expect("save weights");
    let (status, body) = server
        .post(
            "/update_weights_from_disk",
            json!({"model_path": dir.path().display().to_string()}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(greedy(&server).await, broadcast);

    // Both sides tear the group down together, as SGLang's callers do: NCCL's finalize
    // waits for the peer, so the server's destroy cannot answer before ours runs.
    let destroy = server.post(
        "/destroy_weights_update_group",
        json!({"group_name": "manta_test_group"}),
    );
    let ours = tokio::task::spawn_blocking(move || drop(group));
    let ((status, body), dropped) = tokio::join!(destroy, ours);
    dropped.expect("dropping our side of the group");
    assert_eq!(status, 200, "{body}");
}

/// The trainer side for SGLang engines: `SglangEngine::feed_over_nccl` hosts the group as
/// rank 0 on cuda:0 and has the server (here `driver serve` on cuda:1, launched exactly as
/// `sglang.launch_server` would be) join; `update_weights` then goes over NCCL and the
/// server generates what the same weights loaded from disk generate.
#[ignore = "needs two CUDA devices: bench/run_gpu_tests.sh runs it"]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_engine_is_fed_over_nccl_by_the_trainer_side() {
    use manta_engine::sglang::LaunchSpec;
    use manta_engine::{
        Engine, GenerateRequest, NcclTarget, SamplingParams, SglangEngine, SglangOptions,
    };
    let Some((trainer_gpu, server_gpu)) = gpu_pair() else {
        eprintln!("skipped: needs two CUDA devices (nvidia-h200-x2 runs this)");
        return;
    };
    let model = model_dir();
    let logs = tempfile::tempdir().expect("log dir");
    let driver = driver_bin().display().to_string();
    let argv: Vec<String> = [
        driver.as_str(),
        "serve",
        "--model-path",
        &model.path().display().to_string(),
        "--host",
        "127.0.0.1",
        "--device",
        "cuda",
        "--base-gpu-id",
        &server_gpu.to_string(),
        "--dtype",
        "bfloat16",
        "--random-seed",
        "1",
    ]
    .map(String::from)
    .to_vec();
    let engine = SglangEngine::launch(SglangOptions {
        name: "engine-0".into(),
        launch: LaunchSpec {
            argv,
            log: logs.path().join("engine-0.log"),
            env: Vec::new(),
        },
        model_dir: model.path().to_path_buf(),
        health_timeout: Duration::from_secs(300),
        health_interval: Duration::from_millis(500),
        max_restarts: 0,
        request_timeout: Duration::from_secs(300),
    })
    .await
    .expect("launch the server");
    engine
        .feed_over_nccl(NcclTarget {
            device: trainer_gpu,
            master_address: "127.0.0.1".into(),
        })
        .await
        .expect("join the weight-update group");
    let greedy = || GenerateRequest {
        input_ids: vec![1, 2, 3, 4, 5],
        params: SamplingParams {
            max_new_tokens: 8,
            temperature: 0.0,
            ignore_eos: true,
            ..SamplingParams::default()
        },
        rid: None,
        return_routed_experts: false,
    };
    let (vs, cfg) = random_weights(9);
    let named: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(n, t)| (n, t.to_device(Device::Cuda(trainer_gpu))))
        .collect();
    engine
        .update_weights(named, 3)
        .await
        .expect("update over NCCL");
    assert_eq!(engine.weight_version(), 3);
    let over_nccl = engine.generate(greedy()).await.expect("generate");
    assert_eq!(over_nccl.weight_version, 3);

    let dir = model_dir();
    manta_model::save_pretrained(&vs, &cfg, dir.path()).expect("save weights");
    engine
        .update_weights_from_disk(dir.path().to_path_buf(), 4)
        .await
        .expect("update from disk");
    let from_disk = engine.generate(greedy()).await.expect("generate");
    assert_eq!(over_nccl.output_ids, from_disk.output_ids);
    assert_eq!(over_nccl.logprobs, from_disk.logprobs);

    // A server that refuses its half of an update (a tensor it does not have) never joins
    // the broadcast: the trainer's side is aborted at once instead of waiting out the
    // group's 600 s timeout, the disk route is tried, and it refuses the same tensor.
    let mut bad: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(n, t)| (n, t.to_device(Device::Cuda(trainer_gpu))))
        .collect();
    bad.push((
        "model.not_a_parameter".into(),
        Tensor::zeros([4], (tch::Kind::BFloat16, Device::Cuda(trainer_gpu))),
    ));
    let refused = tokio::time::timeout(Duration::from_secs(120), engine.update_weights(bad, 5))
        .await
        .expect("a refused NCCL update returns, it does not wait out the group timeout")
        .expect_err("an update with an unknown tensor");
    assert!(
        refused.to_string().contains("not_a_parameter"),
        "names the tensor: {refused}"
    );
    assert_eq!(
        engine.weight_version(),
        4,
        "a refused update changes nothing"
    );
    // Later updates take the disk route and land.
    let (vs2, _) = random_weights(10);
    let named2: Vec<(String, Tensor)> = vs2
        .variables()
        .into_iter()
        .map(|(n, t)| (n, t.to_device(Device::Cuda(trainer_gpu))))
        .collect();
    engine
        .update_weights(named2, 6)
        .await
        .expect("an update after the fallback, by disk");
    assert_eq!(engine.weight_version(), 6);
    let after = engine.generate(greedy()).await.expect("generate");
    assert_eq!(after.weight_version, 6);
    assert_ne!(
        after.logprobs, from_disk.logprobs,
        "the new weights are served"
    );
}

/// Without a CUDA device the trainer side refuses the NCCL route at once with a named
/// error, and the engine keeps its disk route: an update still lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_cuda_the_nccl_route_is_refused_and_the_disk_route_stays() {
    use manta_engine::sglang::LaunchSpec;
    use manta_engine::{
        Engine, GenerateRequest, NcclTarget, SamplingParams, SglangEngine, SglangOptions,
    };
    if tch::Cuda::device_count() > 0 {
        eprintln!("skipped: this machine has a CUDA device (the CPU machines run this)");
        return;
    }
    let model = model_dir();
    let logs = tempfile::tempdir().expect("log dir");
    let driver = driver_bin().display().to_string();
    let model_path = model.path().display().to_string();
    let argv: Vec<String> = [
        driver.as_str(),
        "serve",
        "--model-path",
        model_path.as_str(),
        "--host",
        "127.0.0.1",
        "--device",
        "cpu",
        "--random-seed",
        "1",
    ]
    .map(String::from)
    .to_vec();
    let engine = SglangEngine::launch(SglangOptions {
        name: "engine-0".into(),
        launch: LaunchSpec {
            argv,
            log: logs.path().join("engine-0.log"),
            env: Vec::new(),
        },
        model_dir: model.path().to_path_buf(),
        health_timeout: Duration::from_secs(120),
        health_interval: Duration::from_millis(500),
        max_restarts: 0,
        request_timeout: Duration::from_secs(120),
    })
    .await
    .expect("launch the server");
    let err = engine
        .feed_over_nccl(NcclTarget {
            device: 0,
            master_address: "127.0.0.1".into(),
        })
        .await
        .expect_err("no CUDA device")
        .to_string();
    assert!(
        err.contains("NCCL needs a CUDA device") || err.contains("no NCCL process group"),
        "{err}"
    );
    let (vs, _) = random_weights(9);
    let named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    engine
        .update_weights(named, 2)
        .await
        .expect("update through the disk");
    assert_eq!(engine.weight_version(), 2);
    let out = engine
        .generate(GenerateRequest {
            input_ids: vec![1, 2, 3],
            params: SamplingParams {
                max_new_tokens: 2,
                temperature: 0.0,
                ..SamplingParams::default()
            },
            rid: None,
            return_routed_experts: false,
        })
        .await
        .expect("generate");
    assert_eq!(out.weight_version, 2);
}

/// The repository root: where the test was built, else the working directory (the device
/// machine runs the binary from a copy of the tree).
fn workspace() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    if built.join("train_config.yaml").is_file() {
        built
    } else {
        PathBuf::from(".")
    }
}

/// Local mode as placement wires it: the trainer on GPU 0, one SGLang engine (`driver
/// serve` launched as `sglang.launch_server` would be) on GPU 1, so the weight-sync route
/// is NCCL; two steps train, every sync reaches the engine through
/// `/update_weights_from_distributed` (its log says so), and the steps' weight versions
/// are the engine's.
#[ignore = "needs two CUDA devices: bench/run_gpu_tests.sh runs it"]
#[test]
fn local_mode_feeds_an_sglang_engine_on_another_gpu_over_nccl() {
    // Placement gives the engine the GPU the trainer does not take.
    let Some((trainer_gpu, _)) = gpu_pair() else {
        eprintln!("skipped: needs two CUDA devices (nvidia-h200-x2 runs this)");
        return;
    };
    let tmp = tempfile::tempdir().expect("temp dir");
    let model = tmp.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tiny_assets().join(f), model.join(f)).expect("copy tiny asset");
    }
    let root = workspace().canonicalize().expect("repository root");
    let cluster = format!(
        "[cluster]\nmode = \"local\"\ntrain_config = {:?}\n\n\
         [trainer]\ngpus = [{trainer_gpu}]\n\n\
         [rollout]\nengine = \"sglang\"\nengines = 1\ngpus_per_engine = 1\n\
         command = [{:?}, \"serve\"]\nhealth_interval_ms = 500\nhealth_timeout_s = 300\n\n\
         [train]\nseed = 1\nlr = 0.003\ncontext_len = 512\ntemperature = 1.0\n",
        root.join("train_config.yaml").display().to_string(),
        driver_bin()
            .canonicalize()
            .expect("driver binary")
            .display()
            .to_string(),
    );
    std::fs::write(tmp.path().join("cluster.toml"), cluster).unwrap();
    let out = Command::new(driver_bin())
        .current_dir(&root)
        .args([
            "--cluster",
            tmp.path().join("cluster.toml").to_str().unwrap(),
        ])
        .args(["--model", model.to_str().unwrap()])
        .args(["--runs-dir", tmp.path().join("runs").to_str().unwrap()])
        .args(["--run-name", "t", "--save-interval", "0"])
        .args(["--save", tmp.path().join("ckpt").to_str().unwrap()])
        .args(["--rollout-batch-size", "4", "--n-samples", "4"])
        .args(["--max-response-len", "32", "--num-rollout", "2"])
        .env("RUST_LOG", "info")
        .output()
        .expect("run the driver");
    // The driver's log lines, wherever its subscriber writes them.
    let stderr = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let tail: String = stderr
        .lines()
        .rev()
        .take(40)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect::<Vec<_>>()
        .join("\n");
    assert!(out.status.success(), "driver failed:\n{tail}");
    assert!(
        stderr.contains("weight sync route: NCCL broadcast"),
        "the route was not NCCL:\n{tail}"
    );
    let run = tmp.path().join("runs/t");
    let log = std::fs::read_to_string(run.join("engines/0.log")).expect("engine log");
    assert!(
        log.matches("weights updated from distributed").count() >= 2,
        "an NCCL update per step in the engine's log:\n{log}"
    );
    assert!(
        !log.contains("weights updated from disk"),
        "no disk update: {log}"
    );
    let rows = manta_telemetry::read_metrics(&run.join("metrics.jsonl")).expect("metrics");
    assert_eq!(rows.len(), 2);
    for (step, m) in &rows {
        assert_eq!(m["weights/version"], *step as f64);
    }
}
