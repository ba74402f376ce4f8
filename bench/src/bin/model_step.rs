//! Forward + backward throughput of a Qwen3-0.6B-shaped random model in bf16 on CUDA:
//! the trainer's path (forward_hidden, chunked token log-probs, next-token loss,
//! backward). Prints one JSON object; bench/py/model_step_hf.py is the baseline.
//!
//! usage: model_step [BATCH] [SEQ] [ITERS]

use std::time::Instant;

use manta_bench::QWEN3_0_6B;
use manta_model::{Attention, CausalLm, ModelConfig};
use tch::{nn, Device, Kind, Tensor};

fn main() -> anyhow::Result<()> {
    let arg = |i: usize, default: i64| -> i64 {
        std::env::args()
            .nth(i)
            .and_then(|s| s.parse().ok())
            .unwrap_or(default)
    };
    let (batch, seq, iters) = (arg(1, 8), arg(2, 2048), arg(3, 10));
    anyhow::ensure!(
        tch::Cuda::is_available(),
        "CUDA is not available to libtorch"
    );
    let device = Device::Cuda(0);
    let cfg = ModelConfig::from_json_str(QWEN3_0_6B, "qwen3-0.6b shape")?;
    tch::manual_seed(0);
    let mut vs = nn::VarStore::new(device);
    let model = CausalLm::new(&vs.root(), &cfg);
    vs.bfloat16();
    let params = vs.trainable_variables();
    let ids = Tensor::randint(cfg.vocab_size, [batch, seq], (Kind::Int64, device));
    let positions = Tensor::arange(seq, (Kind::Int64, device))
        .unsqueeze(0)
        .expand([batch, seq], false);
    let hidden_size = cfg.hidden_size;
    let step = || {
        for p in &params {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        let hidden = model.forward_hidden(
            &ids,
            &positions,
            &Attention::Causal { key_mask: None },
            None,
        );
        let h = hidden.narrow(1, 0, seq - 1).reshape([-1, hidden_size]);
        let targets = ids.narrow(1, 1, seq - 1).reshape([-1]);
        let (logp, _entropy) = manta_model::token_logprobs(&model, &h, &targets, 1.0, 4096);
        let loss = -logp.mean(Kind::Float);
        loss.backward();
        loss
    };
    for _ in 0..3 {
        let _ = step();
    }
    tch::Cuda::synchronize(0);
    let mut times = Vec::new();
    let mut last_loss = 0.0;
    for _ in 0..iters {
        let t0 = Instant::now();
        let loss = step();
        tch::Cuda::synchronize(0);
        times.push(t0.elapsed().as_secs_f64());
        last_loss = loss.double_value(&[]);
    }
    let mut sorted = times.clone();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let median = sorted[sorted.len() / 2];
    let tokens = (batch * seq) as f64;
    println!(
        "{}",
        serde_json::json!({
            "impl": "manta (tch)",
            "batch": batch, "seq": seq, "iters": iters,
            "median_s": median, "times_s": times,
            "tokens_per_s": tokens / median,
            "loss": last_loss,
        })
    );
    Ok(())
}
