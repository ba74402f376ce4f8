//! AdamW (decoupled weight decay) over named parameters, written with tch ops so its
//! state (step, first and second moments, master weights) can be saved with a checkpoint
//! and resumed.
//!
//! Mixed precision: parameters stored in less than fp32 (bf16) get an fp32 master copy.
//! The update is applied to the master and the parameter is refreshed from it, so steps
//! smaller than bf16's resolution accumulate instead of rounding away; the moments are
//! fp32 either way (Megatron's `--bf16` optimizer).

use std::collections::BTreeMap;
use std::path::Path;

use manta_cuda::adamw::{fused_adamw_masters, AdamWStep, MasterSlot};
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
    /// fp32 masters of the parameters that are not fp32 (none in an fp32 run).
    masters: BTreeMap<String, Tensor>,
    exp_avg: BTreeMap<String, Tensor>,
    exp_avg_sq: BTreeMap<String, Tensor>,
    step: u64,
}

impl AdamW {
    /// `params` are the trainable variables (shallow handles to the model's tensors);
    /// those not in fp32 get an fp32 master copy.
    pub fn new(params: BTreeMap<String, Tensor>, config: AdamWConfig) -> Self {
        let zeros = |p: &BTreeMap<String, Tensor>| {
            p.iter()
                .map(|(k, t)| (k.clone(), t.zeros_like().to_kind(Kind::Float)))
                .collect()
        };
        let exp_avg = zeros(&params);
        let exp_avg_sq = zeros(&params);
        let masters = master_copies(&params);
        Self {
            config,
            params,
            masters,
            exp_avg,
            exp_avg_sq,
            step: 0,
        }
    }

    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// Copies of the fp32 master weights by name.
    pub fn master_weights(&self) -> Vec<(String, Tensor)> {
        self.masters
            .iter()
            .map(|(k, t)| (k.clone(), t.detach().copy()))
            .collect()
    }

    /// Whether the parameters are updated through fp32 master weights.
    pub fn has_master_weights(&self) -> bool {
        !self.masters.is_empty()
    }

    /// The defined gradients when every one is bf16/fp16 on one CUDA device: the case ATen's
    /// multi-tensor ops take in one launch for the whole list (a GRPO step's optimizer phase
    /// otherwise launches several kernels per parameter). `None` otherwise, and the callers
    /// take their per-parameter ops.
    fn gpu_half_grads(&self) -> Option<Vec<Tensor>> {
        let grads: Vec<Tensor> = self
            .params
            .values()
            .map(|p| p.grad())
            .filter(|g| g.defined())
            .collect();
        let first = grads.first()?;
        let (device, kind) = (first.device(), first.kind());
        let usable = matches!(device, tch::Device::Cuda(_))
            && matches!(kind, Kind::BFloat16 | Kind::Half)
            && grads
                .iter()
                .all(|g| g.device() == device && g.kind() == kind);
        usable.then_some(grads)
    }

    /// Global L2 norm of all gradients (parameters without a gradient count as zero).
    /// Sums in fp64 on the parameters' device and reads the result back once.
    pub fn grad_norm(&self) -> f64 {
        self.grad_norm_with(self.gpu_half_grads().as_deref())
    }

    /// [`AdamW::grad_norm`], given [`AdamW::gpu_half_grads`]'s list (so a clip collects
    /// the gradients once for its norm and its scale).
    fn grad_norm_with(&self, half_grads: Option<&[Tensor]>) -> f64 {
        if let Some(grads) = half_grads {
            match manta_cuda::adamw::foreach_sq_norm(grads) {
                Ok(sq) => return sq.double_value(&[]).sqrt(),
                Err(e) => warn_foreach_once(&e),
            }
        }
        tch::no_grad(|| {
            let mut total: Option<Tensor> = None;
            for p in self.params.values() {
                let g = p.grad();
                if !g.defined() {
                    continue;
                }
                let sq = if g.kind() == Kind::Float {
                    g.to_kind(Kind::Double)
                        .pow_tensor_scalar(2)
                        .sum(Kind::Double)
                } else {
                    // bf16 gradients: an fp32-accumulated norm, no fp64 copy of the tensor.
                    g.norm_scalaropt_dtype(2, Kind::Float)
                        .to_kind(Kind::Double)
                        .pow_tensor_scalar(2)
                };
                total = Some(match total {
                    Some(t) => t + sq,
                    None => sq,
                });
            }
            total.map_or(0.0, |t| t.double_value(&[]).sqrt())
        })
    }

    /// Scales gradients so their global norm is at most `max_norm`; returns the norm before.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> f64 {
        let half_grads = self.gpu_half_grads();
        let norm = self.grad_norm_with(half_grads.as_deref());
        if norm.is_finite() && norm > max_norm {
            let scale = max_norm / (norm + 1e-6);
            if let Some(grads) = &half_grads {
                match manta_cuda::adamw::foreach_scale_(grads, scale) {
                    Ok(()) => return norm,
                    Err(e) => warn_foreach_once(&e),
                }
            }
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

    /// One AdamW update from the current gradients. With master weights the update goes
    /// to the fp32 master and the parameter is then overwritten with its rounded value.
    pub fn step(&mut self) {
        let fused = manta_knobs::fused_adamw();
        self.update(fused);
    }

    /// [`AdamW::step`]; masters go through the fused kernel when `allow_fused` and it is
    /// available. Returns whether it was used.
    fn update(&mut self, allow_fused: bool) -> bool {
        self.step += 1;
        let c = self.config;
        let bias1 = 1.0 - c.beta1.powi(self.step as i32);
        let bias2 = 1.0 - c.beta2.powi(self.step as i32);
        let fused = allow_fused && self.fused_master_step();
        tch::no_grad(|| {
            for (name, p) in self.params.iter_mut() {
                let g = p.grad();
                if !g.defined() || (fused && self.masters.contains_key(name)) {
                    continue;
                }
                let g = g.to_kind(Kind::Float);
                let (Some(m), Some(v)) =
                    (self.exp_avg.get_mut(name), self.exp_avg_sq.get_mut(name))
                else {
                    continue;
                };
                if let Some(master) = self.masters.get_mut(name) {
                    master_update(master, m, v, &g, c, bias1, bias2);
                    p.copy_(master);
                    continue;
                }
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
        fused
    }

    /// Updates every parameter with a master weight through ATen's fused multi-tensor
    /// AdamW (`step` has been counted already): one pass per group of tensors instead of
    /// a chain of kernels per parameter. Returns false, leaving everything as it was,
    /// when the kernel is unavailable (then the per-parameter path runs).
    fn fused_master_step(&mut self) -> bool {
        if self.masters.is_empty() {
            return false;
        }
        let grads: Vec<(&String, Tensor)> = self
            .masters
            .keys()
            .map(|name| (name, self.params[name].grad()))
            .filter(|(_, g)| g.defined())
            .collect();
        let slots: Vec<MasterSlot<'_>> = grads
            .iter()
            .map(|(name, grad)| MasterSlot {
                param: &self.params[*name],
                grad,
                master: &self.masters[*name],
                exp_avg: &self.exp_avg[*name],
                exp_avg_sq: &self.exp_avg_sq[*name],
            })
            .collect();
        let c = self.config;
        let step = AdamWStep {
            lr: c.lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: c.weight_decay,
            step: self.step,
        };
        match fused_adamw_masters(&slots, step) {
            Ok(()) => true,
            Err(e) => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(
                    || tracing::warn!(error = %e, "fused AdamW unavailable: per-parameter updates"),
                );
                false
            }
        }
    }

    /// Clears gradients before the next step.
    pub fn zero_grad(&mut self) {
        if let Some(grads) = self.gpu_half_grads() {
            match manta_cuda::adamw::foreach_zero_(&grads) {
                Ok(()) => return,
                Err(e) => warn_foreach_once(&e),
            }
        }
        for p in self.params.values_mut() {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
    }

    /// Writes moments (and fp32 masters, when kept) to `optimizer.safetensors` in `dir`;
    /// the step count goes in the caller's trainer state.
    pub fn save(&self, dir: &Path) -> Result<(), tch::TchError> {
        let mut named: Vec<(String, &Tensor)> = Vec::new();
        for (k, t) in &self.masters {
            named.push((format!("master.{k}"), t));
        }
        for (k, t) in &self.exp_avg {
            named.push((format!("exp_avg.{k}"), t));
        }
        for (k, t) in &self.exp_avg_sq {
            named.push((format!("exp_avg_sq.{k}"), t));
        }
        Tensor::write_safetensors(&named, dir.join("optimizer.safetensors"))
    }

    /// Restores moments saved by [`AdamW::save`]; a missing or mis-shaped tensor is an error
    /// naming it, and nothing is changed in that case. Masters come from the file when it
    /// has them (a bf16 run's checkpoint), else from the parameters as loaded; the
    /// parameters are then refreshed from the masters.
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
        let mut masters = Vec::new();
        for (name, current) in &self.masters {
            let key = format!("master.{name}");
            match map.get(&key) {
                Some(saved) if saved.size() != current.size() => {
                    return Err(format!(
                        "{}: tensor {key} has shape {:?}, expected {:?}",
                        path.display(),
                        saved.size(),
                        current.size()
                    ));
                }
                Some(saved) => masters.push((name.clone(), saved.shallow_clone())),
                None => {
                    let p = &self.params[name];
                    masters.push((name.clone(), p.detach().to_kind(Kind::Float)));
                }
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
            for (name, saved) in masters {
                if let (Some(master), Some(p)) =
                    (self.masters.get_mut(&name), self.params.get_mut(&name))
                {
                    master.copy_(&saved);
                    p.copy_(master);
                }
            }
        });
        self.step = step;
        Ok(())
    }
}

/// The AdamW update of one fp32 master in fewer passes over memory than the fp32 path
/// (large models spend a noticeable share of the step here): the moments by `lerp_`,
/// and `master += m / denom` with the step size folded into `denom`, so no update tensor
/// is materialised. Same formula: master -= lr · (m / bias1) / (sqrt(v / bias2) + eps).
pub(crate) fn master_update(
    master: &mut Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    g: &Tensor,
    c: AdamWConfig,
    bias1: f64,
    bias2: f64,
) {
    let _ = m.lerp_(g, 1.0 - c.beta1);
    let _ = v.lerp_(&g.square(), 1.0 - c.beta2);
    if c.weight_decay != 0.0 {
        let _ = master.g_mul_scalar_(1.0 - c.lr * c.weight_decay);
    }
    if c.lr == 0.0 {
        return;
    }
    // denom = -(bias1 / lr) · (sqrt(v) / sqrt(bias2) + eps)
    let scale = -bias1 / c.lr;
    let mut denom = v.sqrt();
    let _ = denom
        .g_mul_scalar_(scale / bias2.sqrt())
        .g_add_scalar_(scale * c.eps);
    let _ = master.addcdiv_(m, &denom);
}

/// fp32 copies of the parameters stored in another floating kind (bf16, f16).
fn master_copies(params: &BTreeMap<String, Tensor>) -> BTreeMap<String, Tensor> {
    tch::no_grad(|| {
        params
            .iter()
            .filter(|(_, p)| matches!(p.kind(), Kind::BFloat16 | Kind::Half))
            .map(|(k, p)| (k.clone(), p.detach().to_kind(Kind::Float)))
            .collect()
    })
}

/// Says once per process that the multi-tensor gradient ops failed (the per-parameter
/// ops then run, with the same result).
fn warn_foreach_once(e: &manta_cuda::CudaError) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(
        || tracing::warn!(error = %e, "multi-tensor gradient ops unavailable: per-parameter ops"),
    );
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

    #[test]
    fn bf16_weights_keep_updates_below_their_resolution_in_fp32_masters() {
        // bf16 keeps 8 significant bits: just below 1.0 its spacing is 2^-8, so a 1e-3
        // step applied to the bf16 weight itself rounds back to 1.0 every time.
        let p = Tensor::from_slice(&[1.0f32, -1.0])
            .to_kind(Kind::BFloat16)
            .set_requires_grad(true);
        let cfg = AdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        let mut opt = AdamW::new([("w".to_string(), p.shallow_clone())].into(), cfg);
        assert!(opt.has_master_weights());
        let direction = Tensor::from_slice(&[1.0f32, -1.0]).to_kind(Kind::BFloat16);
        for _ in 0..10 {
            opt.zero_grad();
            (&p * &direction).sum(Kind::Float).backward();
            opt.step();
        }
        // Adam moves each weight by lr per step against the gradient's sign.
        let master = Vec::<f32>::try_from(&opt.masters["w"]).unwrap();
        assert!(
            (master[0] - 0.99).abs() < 1e-5 && (master[1] + 0.99).abs() < 1e-5,
            "{master:?}"
        );
        assert_eq!(p.kind(), Kind::BFloat16);
        let w = Vec::<f32>::try_from(p.detach().to_kind(Kind::Float)).unwrap();
        let rounded = Vec::<f32>::try_from(
            opt.masters["w"]
                .to_kind(Kind::BFloat16)
                .to_kind(Kind::Float),
        )
        .unwrap();
        assert_eq!(w, rounded, "the bf16 weights are the rounded masters");
        assert!(w[0] < 1.0 && w[1] > -1.0, "the bf16 weights moved: {w:?}");

        // The masters travel with the checkpoint.
        let dir = tempfile::tempdir().unwrap();
        opt.save(dir.path()).unwrap();
        let q = Tensor::from_slice(&[1.0f32, -1.0])
            .to_kind(Kind::BFloat16)
            .set_requires_grad(true);
        let mut restored = AdamW::new([("w".to_string(), q.shallow_clone())].into(), cfg);
        restored.load(dir.path(), 10).unwrap();
        assert!(restored.masters["w"].equal(&opt.masters["w"]));
        assert!(
            q.equal(&p),
            "parameters are refreshed from the loaded masters"
        );
    }

    #[test]
    fn the_fused_master_update_equals_the_per_parameter_one() {
        // ATen's fused AdamW (CPU here) against the per-parameter op chain, on bf16
        // parameters of two sizes (two tensors, one group) over three steps.
        let cfg = AdamWConfig {
            lr: 0.05,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-3,
            weight_decay: 0.1,
        };
        let make = || -> (Vec<Tensor>, AdamW) {
            let ps = vec![
                Tensor::from_slice(&[0.5f32, -0.25, 2.0, 0.0]),
                Tensor::from_slice(&[1.5f32, -3.0]),
            ]
            .into_iter()
            .map(|t| t.to_kind(Kind::BFloat16).set_requires_grad(true))
            .collect::<Vec<_>>();
            let named = ps
                .iter()
                .enumerate()
                .map(|(i, p)| (format!("w{i}"), p.shallow_clone()))
                .collect();
            (ps, AdamW::new(named, cfg))
        };
        let (pa, mut a) = make();
        let (pb, mut b) = make();
        let grads = [
            ([1.0f32, -2.0, 0.5, 0.0], [0.25f32, -1.0]),
            ([0.25, 1.0, -4.0, 3.0], [2.0, 0.5]),
            ([-1.0, 0.5, 0.5, -0.125], [-0.5, 4.0]),
        ];
        for (g0, g1) in grads {
            for (ps, opt) in [(&pa, &mut a), (&pb, &mut b)] {
                opt.zero_grad();
                let loss = (&ps[0] * Tensor::from_slice(&g0).to_kind(Kind::BFloat16))
                    .sum(Kind::Float)
                    + (&ps[1] * Tensor::from_slice(&g1).to_kind(Kind::BFloat16)).sum(Kind::Float);
                loss.backward();
            }
            assert!(!a.update(false), "the per-parameter path ran");
            assert!(b.update(true), "the fused kernel is available on the CPU");
            for name in ["w0", "w1"] {
                let d = (&a.masters[name] - &b.masters[name])
                    .abs()
                    .max()
                    .double_value(&[]);
                assert!(d < 1e-6, "{name}: masters differ by {d}");
                assert!(
                    a.params[name].equal(&b.params[name]),
                    "{name}: bf16 weights differ"
                );
                let dm = (&a.exp_avg_sq[name] - &b.exp_avg_sq[name])
                    .abs()
                    .max()
                    .double_value(&[]);
                assert!(dm < 1e-6, "{name}: second moments differ by {dm}");
            }
        }
        assert!(
            a.masters["w0"].double_value(&[0]) != 0.5,
            "the masters moved"
        );
    }

    #[test]
    fn fp32_weights_have_no_masters() {
        let p = Tensor::from_slice(&[1.0f32]).set_requires_grad(true);
        let cfg = AdamWConfig {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        assert!(!AdamW::new([("w".to_string(), p)].into(), cfg).has_master_weights());
    }

    #[test]
    fn the_master_update_is_the_fp32_update() {
        // Same start, same gradients (exact in bf16): the bf16 parameter's fp32 master
        // follows the fp32 parameter step for step, weight decay and bias correction
        // included.
        let cfg = AdamWConfig {
            lr: 0.05,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-3,
            weight_decay: 0.1,
        };
        let start = [0.5f32, -0.25, 2.0, 0.0];
        let p32 = Tensor::from_slice(&start).set_requires_grad(true);
        let p16 = Tensor::from_slice(&start)
            .to_kind(Kind::BFloat16)
            .set_requires_grad(true);
        let mut a = AdamW::new([("w".to_string(), p32.shallow_clone())].into(), cfg);
        let mut b = AdamW::new([("w".to_string(), p16.shallow_clone())].into(), cfg);
        for grad in [
            [1.0f32, -2.0, 0.5, 0.0],
            [0.25, 1.0, -4.0, 3.0],
            [-1.0, 0.5, 0.5, -0.125],
        ] {
            a.zero_grad();
            b.zero_grad();
            let g = Tensor::from_slice(&grad);
            (&p32 * &g).sum(Kind::Float).backward();
            (&p16 * g.to_kind(Kind::BFloat16))
                .sum(Kind::Float)
                .backward();
            a.step();
            b.step();
            let d = (&b.masters["w"] - p32.detach())
                .abs()
                .max()
                .double_value(&[]);
            assert!(d < 1e-6, "master and fp32 weights differ by {d}");
        }
    }
}
