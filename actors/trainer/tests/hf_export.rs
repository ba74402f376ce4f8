//! `manta_trainer::export` on bf16 checkpoints (`--bf16`, run here on the CPU), where the
//! fp32 masters live apart from the weights: one trainer's `optimizer.safetensors`, ZeRO-2
//! shards cut in small buckets (parameters split across ranks and buckets) and ZeRO-3
//! shards over three ranks. Each export holds the trainer's bf16 weights bit for bit
//! (`--dtype auto`) or its fp32 masters bit for bit (`float32`, assembled from the
//! shards), and every checkpoint passes the masters-against-weights check; a shard whose
//! masters were changed fails it, naming that shard and the tensor.

mod common;

use std::path::Path;

use common::{adam, sample_at, tiny_model};
use manta_trainer::data_parallel::{Collective, ThreadCollective};
use manta_trainer::export::{export, ExportDtype, ExportError, ExportOptions};
use manta_trainer::{NamedTensors, TrainBatch, Trainer, TrainerOptions};
use tch::{Kind, Tensor};

fn options() -> TrainerOptions {
    TrainerOptions {
        model_dir: tiny_model(),
        seed: 3,
        adam: adam(1e-3),
        bf16: Some(true),
        ..common::options()
    }
}

fn batch(indices: std::ops::Range<u64>) -> TrainBatch {
    let samples: Vec<_> = indices
        .clone()
        .map(|i| sample_at(i, vec![3 + i as u32, 17, 42, 99, 7], vec![1, 1], -5.5))
        .collect();
    TrainBatch {
        advantages: indices
            .map(|i| if i % 2 == 0 { 1.0 } else { -0.5 })
            .collect(),
        samples,
        global_samples: 6,
    }
}

/// How a checkpoint's ranks are built.
#[derive(Clone, Copy)]
enum Writer {
    One,
    Zero2,
    Zero3,
}

/// Trains one step and saves `dir`; returns the bf16 weights and fp32 masters (rank 0's,
/// gathered).
fn train_and_save(kind: Writer, dir: &Path) -> (NamedTensors, NamedTensors) {
    let copy =
        |w: NamedTensors| -> NamedTensors { w.into_iter().map(|(k, t)| (k, t.copy())).collect() };
    if let Writer::One = kind {
        let mut t = Trainer::new(options()).unwrap();
        t.train_step(&batch(0..6)).unwrap();
        t.save_checkpoint(dir, 1).unwrap();
        return (copy(t.export_weights()), copy(t.master_weights()));
    }
    let world = 3;
    let handles: Vec<_> = ThreadCollective::group(world)
        .unwrap()
        .into_iter()
        .map(|comm| {
            let r = comm.rank() as u64;
            let dir = dir.to_path_buf();
            std::thread::spawn(move || {
                let mut t = match kind {
                    // Small buckets: parameters straddle ranks and buckets.
                    Writer::Zero2 => Trainer::new_data_parallel(options(), Box::new(comm), 1000),
                    _ => Trainer::new_zero3(options(), Box::new(comm)),
                }
                .unwrap();
                t.train_step(&batch(2 * r..2 * r + 2)).unwrap();
                t.save_checkpoint(&dir, 1).unwrap();
                (copy(t.export_weights()), copy(t.master_weights()))
            })
        })
        .collect();
    let mut all: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    all.swap_remove(0)
}

fn read(path: &Path) -> NamedTensors {
    let mut w = Tensor::read_safetensors(path).unwrap();
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

fn same_bits(a: &NamedTensors, b: &NamedTensors) {
    let mut b = b
        .iter()
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect::<Vec<_>>();
    b.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(a.len(), b.len());
    for ((na, ta), (nb, tb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        assert_eq!(ta.kind(), tb.kind(), "{na}");
        assert!(ta.equal(tb), "{na} differs");
    }
}

#[test]
fn bf16_exports_hold_the_weights_or_the_masters_bit_for_bit() {
    let _serial = common::one_at_a_time();
    for (kind, name) in [
        (Writer::One, "one trainer"),
        (Writer::Zero2, "ZeRO-2 shards of 3 ranks"),
        (Writer::Zero3, "ZeRO-3 shards of 3 ranks"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let ckpt = tmp.path().join("step_000001");
        let (weights, masters) = train_and_save(kind, &ckpt);
        assert!(weights.iter().all(|(_, t)| t.kind() == Kind::BFloat16));
        assert!(!masters.is_empty() && masters.iter().all(|(_, t)| t.kind() == Kind::Float));

        let auto = tmp.path().join("hf");
        let done = export(&ckpt, &auto, &ExportOptions::default()).unwrap();
        assert_eq!(done.written_by, name);
        assert_eq!((done.dtype, done.from_masters), ("bfloat16", false));
        same_bits(&read(&auto.join("model.safetensors")), &weights);

        let fp32 = tmp.path().join("hf32");
        let opts = ExportOptions {
            dtype: ExportDtype::Float32,
            tokenizer_from: Some(tiny_model()),
        };
        let done = export(&ckpt, &fp32, &opts).unwrap();
        assert_eq!((done.dtype, done.from_masters), ("float32", true), "{name}");
        assert!(done.copied.contains(&"tokenizer.json".to_string()));
        same_bits(&read(&fp32.join("model.safetensors")), &masters);
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fp32.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(config["torch_dtype"], "float32");
    }
}

#[test]
fn a_shard_whose_masters_do_not_round_to_the_weights_is_named() {
    let _serial = common::one_at_a_time();
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("step_000001");
    train_and_save(Writer::Zero3, &ckpt);
    // Rank 2's masters nudged by far more than bf16's rounding: another run's shard.
    let shard = ckpt.join("optimizer.rank2-of-3.safetensors");
    let mut tensors = Tensor::read_safetensors(&shard).unwrap();
    for (name, t) in &mut tensors {
        if name == "master" {
            *t = &*t + 1.0;
        }
    }
    let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    Tensor::write_safetensors(&named, &shard).unwrap();
    let out = tmp.path().join("hf");
    match export(&ckpt, &out, &ExportOptions::default()) {
        Err(ExportError::Tensor { path, message, .. }) => {
            assert_eq!(path, shard);
            assert!(message.contains("another run or step"), "{message}");
        }
        other => panic!("expected the shard to be named, got {other:?}"),
    }
    assert!(!out.exists());
}
