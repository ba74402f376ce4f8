//! AdamW (decoupled weight decay) over named parameters, written with tch ops so its
//! state (step, first and second moments) can be saved with a checkpoint and resumed.

use std::collections::BTreeMap;
use std::path::Path;

use tch::{Kind, Tensor};

/// AdamW hyperparameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// Optimizer state for a fixed set of named parameters.
pub struct AdamW {
    pub config: AdamWConfig,
    params: BTreeMap<String, Tensor>,
    exp_avg: BTreeMap<String, Tensor>,
    exp_avg_sq: BTreeMap<String, Tensor>,
    step: u64,
}

impl AdamW {
    /// `params` are the trainable variables (shallow handles to the model's tensors).
    pub fn new(params: BTreeMap<String, Tensor>, config: AdamWConfig) -> Self {
        let zeros = |p: &BTreeMap<String, Tensor>| {
            p.iter()
                .map(|(k, t)| (k.clone(), t.zeros_like().to_kind(Kind::Float)))
                .collect()
        };
        let exp_avg = zeros(&params);
        let exp_avg_sq = zeros(&params);
        Self {
            config,
            params,
            exp_avg,
            exp_avg_sq,
            step: 0,
        }
    }

    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// Global L2 norm of all gradients (parameters without a gradient count as zero).
    pub fn grad_norm(&self) -> f64 {
        tch::no_grad(|| {
            let mut total = 0.0f64;
            for p in self.params.values() {
                let g = p.grad();
                if g.defined() {
                    total += g
                        .to_kind(Kind::Double)
                        .pow_tensor_scalar(2)
                        .sum(Kind::Double)
                        .double_value(&[]);
                }
            }
            total.sqrt()
        })
    }

    /// Scales gradients so their global norm is at most `max_norm`; returns the norm before.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> f64 {
        let norm = self.grad_norm();
        if norm.is_finite() && norm > max_norm {
            let scale = max_norm / (norm + 1e-6);
            tch::no_grad(|| {
                for p in self.params.values() {
                    let mut g = p.grad();
                    if g.defined() {
                        let _ = g.g_mul_scalar_(scale);
                    }
                }
            });
        }
        norm
    }

    /// One AdamW update from the current gradients.
    pub fn step(&mut self) {
        self.step += 1;
        let c = self.config;
        let bias1 = 1.0 - c.beta1.powi(self.step as i32);
        let bias2 = 1.0 - c.beta2.powi(self.step as i32);
        tch::no_grad(|| {
            for (name, p) in self.params.iter_mut() {
                let g = p.grad();
                if !g.defined() {
                    continue;
                }
                let g = g.to_kind(Kind::Float);
                let (Some(m), Some(v)) =
                    (self.exp_avg.get_mut(name), self.exp_avg_sq.get_mut(name))
                else {
                    continue;
                };
                let _ = m.g_mul_scalar_(c.beta1).g_add_(&(&g * (1.0 - c.beta1)));
                let _ = v
                    .g_mul_scalar_(c.beta2)
                    .g_add_(&(&g * &g * (1.0 - c.beta2)));
                let denom = (&*v / bias2).sqrt() + c.eps;
                let update = (&*m / bias1) / denom * c.lr;
                if c.weight_decay != 0.0 {
                    let _ = p.g_mul_scalar_(1.0 - c.lr * c.weight_decay);
                }
                let _ = p.g_sub_(&update.to_kind(p.kind()));
            }
        });
    }

    /// Clears gradients before the next step.
    pub fn zero_grad(&mut self) {
        for p in self.params.values_mut() {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
    }

    /// Writes moments to `optimizer.safetensors` in `dir`; the step count goes in the
    /// caller's trainer state.
    pub fn save(&self, dir: &Path) -> Result<(), tch::TchError> {
        let mut named: Vec<(String, &Tensor)> = Vec::new();
        for (k, t) in &self.exp_avg {
            named.push((format!("exp_avg.{k}"), t));
        }
        for (k, t) in &self.exp_avg_sq {
            named.push((format!("exp_avg_sq.{k}"), t));
        }
        Tensor::write_safetensors(&named, dir.join("optimizer.safetensors"))
    }

    /// Restores moments saved by [`AdamW::save`]; a missing or mis-shaped tensor is an error
    /// naming it, and nothing is changed in that case.
    pub fn load(&mut self, dir: &Path, step: u64) -> Result<(), String> {
        let path = dir.join("optimizer.safetensors");
        let tensors =
            Tensor::read_safetensors(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let map: BTreeMap<String, Tensor> = tensors.into_iter().collect();
        let mut staged = Vec::new();
        for (prefix, store) in [("exp_avg", &self.exp_avg), ("exp_avg_sq", &self.exp_avg_sq)] {
            for (name, current) in store {
                let key = format!("{prefix}.{name}");
                let saved = map
                    .get(&key)
                    .ok_or_else(|| format!("{}: missing tensor {key}", path.display()))?;
                if saved.size() != current.size() {
                    return Err(format!(
                        "{}: tensor {key} has shape {:?}, expected {:?}",
                        path.display(),
                        saved.size(),
                        current.size()
                    ));
                }
                staged.push((prefix, name.clone(), saved.shallow_clone()));
            }
        }
        tch::no_grad(|| {
            for (prefix, name, saved) in staged {
                let store = if prefix == "exp_avg" {
                    &mut self.exp_avg
                } else {
                    &mut self.exp_avg_sq
                };
                if let Some(t) = store.get_mut(&name) {
                    t.copy_(&saved);
                }
            }
        });
        self.step = step;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_step_moves_each_weight_by_lr_against_the_gradient_sign() {
        // With bias correction, Adam's first update is lr * g/|g| (eps aside).
        let p = Tensor::from_slice(&[1.0f32, -1.0]).set_requires_grad(true);
        let mut opt = AdamW::new(
            [("w".to_string(), p.shallow_clone())].into(),
            AdamWConfig {
                lr: 0.1,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
            },
        );
        let loss = (&p * Tensor::from_slice(&[3.0f32, -0.5])).sum(Kind::Float);
        loss.backward();
        opt.step();
        let v = Vec::<f32>::try_from(p.detach()).unwrap();
        assert!(
            (v[0] - 0.9).abs() < 1e-6 && (v[1] + 0.9).abs() < 1e-6,
            "{v:?}"
        );
    }

    #[test]
    fn clip_scales_to_max_norm() {
        let p = Tensor::from_slice(&[0.0f32, 0.0]).set_requires_grad(true);
        let mut opt = AdamW::new(
            [("w".to_string(), p.shallow_clone())].into(),
            AdamWConfig {
                lr: 0.1,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
            },
        );
        (&p * Tensor::from_slice(&[3.0f32, 4.0]))
            .sum(Kind::Float)
            .backward();
        let before = opt.clip_grad_norm(1.0);
        assert!((before - 5.0).abs() < 1e-6);
        assert!((opt.grad_norm() - 1.0).abs() < 1e-4);
    }

    #[test]
    fn state_round_trips_and_bad_state_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        let cfg = AdamWConfig {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        };
        let mut opt = AdamW::new([("w".to_string(), p.shallow_clone())].into(), cfg);
        (&p * 2.0).sum(Kind::Float).backward();
        opt.step();
        opt.save(dir.path()).unwrap();
        let q = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        let mut restored = AdamW::new([("w".to_string(), q.shallow_clone())].into(), cfg);
        restored.load(dir.path(), 1).unwrap();
        assert_eq!(restored.step_count(), 1);
        let m = Vec::<f32>::try_from(&restored.exp_avg["w"]).unwrap();
        assert!((m[0] - 0.2).abs() < 1e-6);
        let r = Tensor::from_slice(&[1.0f32, 2.0, 3.0]).set_requires_grad(true);
        let mut wrong = AdamW::new([("w".to_string(), r)].into(), cfg);
        let err = wrong.load(dir.path(), 1).unwrap_err();
        assert!(err.contains("exp_avg.w") && err.contains("shape"), "{err}");
    }
}
