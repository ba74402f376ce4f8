//! The hooked passes ZeRO-3 runs: the order in which they ask for each decoder layer's
//! parameters and hand back its gradients, for every recompute layout.

use manta_model::{Attention, CausalLm, LayerHooks, ModelConfig, Recompute, RecomputeMethod};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

const CONFIG: &str = r#"{"model_type": "qwen3", "vocab_size": 50, "hidden_size": 16,
    "intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 8, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": true}"#;

/// Records the calls, and checks that a layer is only read while gathered.
#[derive(Default)]
struct Recorder {
    calls: Vec<String>,
    gathered: Vec<bool>,
}

impl LayerHooks for Recorder {
    type Error = String;

    fn gather(&mut self, layer: usize) -> Result<(), String> {
        self.calls.push(format!("g{layer}"));
        self.gathered[layer] = true;
        Ok(())
    }

    fn release(&mut self, layer: usize) -> Result<(), String> {
        self.calls.push(format!("r{layer}"));
        self.gathered[layer] = false;
        Ok(())
    }

    fn reduce(&mut self, layer: usize) -> Result<(), String> {
        if !self.gathered[layer] {
            return Err(format!("layer {layer} reduced while not gathered"));
        }
        self.calls.push(format!("d{layer}"));
        self.gathered[layer] = false;
        Ok(())
    }
}

fn calls(recompute: Option<Recompute>) -> String {
    let cfg = ModelConfig::from_json_str(CONFIG, "hooks test").unwrap();
    tch::manual_seed(3);
    let vs = VarStore::new(Device::Cpu);
    let mut model = CausalLm::new(&vs.root(), &cfg);
    model.set_recompute(recompute).unwrap();
    let ids = Tensor::from_slice(&[1i64, 5, 9, 3]).view([1, 4]);
    let pos = Tensor::arange(4, (Kind::Int64, Device::Cpu)).view([1, 4]);
    let attn = Attention::Causal { key_mask: None };
    let mut hooks = Recorder {
        gathered: vec![false; 3],
        ..Default::default()
    };
    let loss = model
        .forward_backward_hooked(&ids, &pos, &attn, &mut hooks, |h| {
            h.square().sum(Kind::Float)
        })
        .unwrap();
    // The hooks change nothing in what is computed.
    let plain = model.forward_backward(&ids, &pos, &attn, |h| h.square().sum(Kind::Float));
    assert!(loss.equal(&plain));
    assert!(
        hooks.gathered.iter().all(|g| !g),
        "every layer ends released"
    );
    hooks.calls.join(" ")
}

#[test]
fn layers_are_gathered_for_each_pass_and_reduced_after_their_backward() {
    assert_eq!(
        calls(Some(Recompute::EVERY_LAYER)),
        "g0 r0 g1 r1 g2 r2 g2 d2 g1 d1 g0 d0"
    );
    let pairs = Recompute {
        method: RecomputeMethod::Uniform,
        num_layers: 2,
    };
    assert_eq!(calls(Some(pairs)), "g0 r0 g1 r1 g2 r2 g2 d2 g0 g1 d1 d0");
    // block 1: layers 1-2 kept, gathered from their forward to their backward.
    let block = Recompute {
        method: RecomputeMethod::Block,
        num_layers: 1,
    };
    assert_eq!(calls(Some(block)), "g0 r0 g1 g2 d2 d1 g0 d0");
    assert_eq!(calls(None), "g0 g1 g2 d2 d1 d0");
}
