//! `driver export` and `--save-hf`: Manta checkpoints as Hugging Face model directories.
//!
//! The same two debug-data steps are trained three ways — ZeRO-3 over two CPU ranks (with
//! `--save-hf`), ZeRO-2 over two ranks, one trainer — and each checkpoint is exported:
//! - transformers' `AutoModelForCausalLM.from_pretrained` loads the ZeRO-3 export (the
//!   project venv's real transformers), and its logits on a prompt equal those of Manta's
//!   model loaded from the checkpoint itself (fp32);
//! - the three exports hold the same tensors (up to fp32 summation order across ranks),
//!   `--save-hf`'s export equals `driver export`'s bit for bit, and the tokenizer comes
//!   along from `--tokenizer-from`;
//! - a missing shard, a shard of another step, a truncated weights file and an `--out`
//!   that is not an export fail naming the file, and leave no export behind.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use common::{
    assert_success, cluster, debug_data, debug_train_args, driver_run, driver_with_deadline,
    max_diff, sorted_weights, strings, workspace,
};
use manta_model::{load_weights, Attention, CausalLm, ModelConfig};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

/// A tiny-model run that takes longer waits in a collective only some ranks joined.
const DEADLINE: Duration = Duration::from_secs(180);

/// The prompt whose logits are compared.
const PROMPT: &str = "3,17,42,7,99,128,5,64";

/// Trains the two debug-data steps with `trainer` as cluster.toml's `[trainer]`, saving
/// after each into `dir/<name>`; `extra` flags appended.
fn train(dir: &Path, data: &Path, name: &str, trainer: &str, extra: &[&str]) -> PathBuf {
    let run_dir = dir.join(name);
    std::fs::create_dir_all(&run_dir).unwrap();
    let cluster = cluster(&run_dir, trainer);
    let save = run_dir.join("ckpt");
    let args = [
        strings(&["--cluster", cluster.to_str().unwrap()]),
        debug_train_args(data, 2, &save, 1, &run_dir.join("runs"), "r"),
        strings(&[
            "--lr",
            "0.01",
            "--adam-eps",
            "1e-4",
            "--use-rollout-logprobs",
        ]),
        strings(extra),
    ]
    .concat();
    assert_success(driver_with_deadline(&args, &[], &run_dir, DEADLINE));
    save
}

fn export(load: &Path, out: &Path, extra: &[&str]) -> Output {
    let mut args = strings(&[
        "export",
        "--load",
        load.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    args.extend(strings(extra));
    driver_run(&args)
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Fails unless the export failed naming `file`, leaving no directory at `out` and no
/// temporary one beside it.
fn assert_refused(out: Output, file: &str, dest: &Path) {
    assert!(!out.status.success(), "export succeeded: {}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains(file), "the error names {file}: {err}");
    assert!(!dest.exists(), "{} was left behind", dest.display());
    let parent = dest.parent().unwrap();
    let leftovers: Vec<String> = std::fs::read_dir(parent)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".partial-"))
        .collect();
    assert!(
        leftovers.is_empty(),
        "temporary exports left: {leftovers:?}"
    );
}

/// Copies checkpoint directory `from` to `to` (flat: checkpoints have no subdirectories).
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Manta's logits for `ids` from the weights in `dir` (fp32, CPU).
fn manta_logits(dir: &Path, ids: &Tensor) -> Tensor {
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let mut vs = VarStore::new(Device::Cpu);
    let model = CausalLm::new(&vs.root(), &cfg);
    load_weights(&mut vs, dir).unwrap();
    let t = ids.size()[1];
    let positions = Tensor::arange(t, (Kind::Int64, Device::Cpu)).unsqueeze(0);
    tch::no_grad(|| model.forward(ids, &positions, &Attention::Causal { key_mask: None }, None))
}

/// transformers' logits for [`PROMPT`] from the export in `dir`.
fn transformers_logits(dir: &Path, out: &Path) -> (Tensor, Tensor) {
    let ran = Command::new(common::python())
        .arg(workspace().join("actors/driver/tests/py/hf_export_logits.py"))
        .arg(dir)
        .arg(PROMPT)
        .arg(out)
        .output()
        .expect("run hf_export_logits.py (set MANTA_PYTHON)");
    assert!(
        ran.status.success(),
        "{}",
        String::from_utf8_lossy(&ran.stderr)
    );
    let mut read = Tensor::read_safetensors(out).unwrap();
    read.sort_by(|a, b| a.0.cmp(&b.0));
    let (ids, logits) = (read[0].1.shallow_clone(), read[1].1.shallow_clone());
    (ids, logits)
}

#[test]
fn exports_of_every_checkpoint_kind_load_in_transformers_and_agree() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let data = debug_data(dir, 2, 11);
    let zero3 = train(
        dir,
        &data,
        "zero3",
        "data_parallel_ranks = 2",
        &["--zero-stage", "3", "--save-hf"],
    );
    let zero2 = train(dir, &data, "zero2", "data_parallel_ranks = 2", &[]);
    let one = train(dir, &data, "one", "", &[]);
    let last = zero3.join("step_000002");
    for r in 0..2 {
        assert!(last
            .join(format!("optimizer.rank{r}-of-2.safetensors"))
            .is_file());
    }

    // `driver export` of the --save directory (its latest checkpoint), with the tokenizer.
    let hf3 = dir.join("hf3");
    let out = assert_success(export(
        &zero3,
        &hf3,
        &[
            "--tokenizer-from",
            workspace().join("assets/tiny-qwen3").to_str().unwrap(),
        ],
    ));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("step 2") && said.contains("ZeRO-3 shards of 2 ranks"),
        "{said}"
    );
    for f in [
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "manta_export.json",
    ] {
        assert!(hf3.join(f).is_file(), "{f} missing from the export");
    }
    let exported = sorted_weights(&hf3.join("model.safetensors"));
    // --save-hf wrote the same checkpoint at the end of the run: the same bits.
    let saved_hf = sorted_weights(&zero3.join("hf/model.safetensors"));
    assert_eq!(max_diff(&exported, &saved_hf), 0.0);
    // The export is the checkpoint's weights (fp32 run: auto is fp32) bit for bit.
    assert_eq!(
        max_diff(&exported, &sorted_weights(&last.join("model.safetensors"))),
        0.0
    );
    let start = sorted_weights(&data.join("model/model.safetensors"));
    assert!(
        max_diff(&start, &exported) > 1e-3,
        "training moved the weights"
    );

    // transformers loads it, and computes what Manta computes from the checkpoint.
    let (ids, hf_logits) = transformers_logits(&hf3, &dir.join("hf3_logits.safetensors"));
    let ours = manta_logits(&last, &ids);
    assert_eq!(ours.size(), hf_logits.size());
    let scale = hf_logits.abs().max().double_value(&[]);
    let d = (&ours - &hf_logits).abs().max().double_value(&[]);
    eprintln!("transformers vs Manta logits: max |diff| {d:e} (max |logit| {scale:e})");
    assert!(d <= 1e-5 * scale.max(1.0), "logits differ by {d:e}");

    // ZeRO-2 ranks and one trainer trained the same steps: their exports agree.
    for (name, save) in [("ZeRO-2", &zero2), ("one trainer", &one)] {
        let hf = dir.join(format!("hf-{}", name.replace(' ', "-")));
        let out = assert_success(export(save, &hf, &[]));
        let said = String::from_utf8_lossy(&out.stdout).into_owned();
        eprintln!("{said}");
        let theirs = sorted_weights(&hf.join("model.safetensors"));
        let d = max_diff(&exported, &theirs);
        assert!(d < 1e-5, "ZeRO-3's export differs from {name}'s by {d}");
    }
    let fp32 = dir.join("hf3-fp32");
    assert_success(export(&last, &fp32, &["--dtype", "float32"]));
    assert_eq!(
        max_diff(&exported, &sorted_weights(&fp32.join("model.safetensors"))),
        0.0
    );
    let bf16 = dir.join("hf3-bf16");
    assert_success(export(&last, &bf16, &["--dtype", "bfloat16"]));
    let halved = sorted_weights(&bf16.join("model.safetensors"));
    assert!(halved.iter().all(|(_, t)| t.kind() == Kind::BFloat16));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(bf16.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "bfloat16");

    // A later export replaces an earlier one in place.
    assert_success(export(&zero3.join("step_000001"), &hf3, &[]));
    assert!(max_diff(&exported, &sorted_weights(&hf3.join("model.safetensors"))) > 0.0);

    // Broken checkpoints: each failure names its file and leaves no export. With its
    // manifest.json the export refuses a changed file before reading it (tests/integrity.rs);
    // without one (a checkpoint from before manifests) its own cross-checks must find
    // each fault, so the copies here have none.
    let broken = dir.join("broken");
    let dest = dir.join("hf-broken");
    copy_dir(&last, &broken);
    std::fs::remove_file(broken.join("manifest.json")).unwrap();
    std::fs::remove_file(broken.join("optimizer.rank1-of-2.safetensors")).unwrap();
    assert_refused(
        export(&broken, &dest, &[]),
        "optimizer.rank1-of-2.safetensors",
        &dest,
    );
    // Rank 1's shard of step 1 beside step 2's weights: another step's masters.
    std::fs::copy(
        zero3.join("step_000001/optimizer.rank1-of-2.safetensors"),
        broken.join("optimizer.rank1-of-2.safetensors"),
    )
    .unwrap();
    let out = export(&broken, &dest, &[]);
    assert!(
        stderr(&out).contains("another run or step"),
        "{}",
        stderr(&out)
    );
    assert_refused(out, "optimizer.rank1-of-2.safetensors", &dest);
    // A ZeRO-2 shard among ZeRO-3 ones.
    std::fs::copy(
        zero2.join("step_000002/optimizer.rank1-of-2.safetensors"),
        broken.join("optimizer.rank1-of-2.safetensors"),
    )
    .unwrap();
    assert_refused(
        export(&broken, &dest, &[]),
        "optimizer.rank1-of-2.safetensors",
        &dest,
    );
    // A torn weights file.
    copy_dir(&last, &broken);
    let _ = std::fs::remove_file(broken.join("manifest.json"));
    let weights = broken.join("model.safetensors");
    let len = std::fs::metadata(&weights).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&weights)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    assert_refused(export(&broken, &dest, &[]), "model.safetensors", &dest);
    // An --out that holds something else is not replaced.
    let other = dir.join("not-an-export");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("notes.txt"), "mine").unwrap();
    let out = export(&last, &other, &[]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("not an earlier export"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        std::fs::read_to_string(other.join("notes.txt")).unwrap(),
        "mine"
    );
}

#[test]
fn export_help_explains_the_command_and_save_hf_needs_save() {
    let out = driver_run(&["export", "--help"]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for needle in ["--load", "--out", "--dtype", "--tokenizer-from", "ZeRO-3"] {
        assert!(
            help.contains(needle),
            "`driver export --help` lacks {needle}:\n{help}"
        );
    }
    let out = driver_run(&["--save-hf", "--num-rollout", "1"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--save-hf"), "{}", stderr(&out));
}
