//! The training passes of [`CausalLm`]: forward + backward with per-layer recompute
//! (gradient checkpointing) and layer hooks (ZeRO-3), and the hooked no-grad forward.

use tch::{Kind, Tensor};

use super::{Attention, CausalLm};
use crate::layer_hooks::{LayerHooks, NoHooks};
use crate::recompute::{Recompute, RecomputeError};

impl CausalLm {
    /// Turns per-layer gradient checkpointing on (every layer recomputed, Megatron's
    /// uniform method with groups of one) or off (every activation kept).
    ///
    /// tch cannot define custom autograd functions, so checkpointing cannot hide inside
    /// `forward_hidden`; instead `forward_backward` keeps only the recomputed units' inputs
    /// during the forward pass and recomputes them during a unit-by-unit backward pass.
    pub fn set_gradient_checkpointing(&mut self, on: bool) {
        self.recompute = on.then_some(Recompute::EVERY_LAYER);
    }

    /// Which layers [`CausalLm::forward_backward`] recomputes (`--recompute-method`,
    /// `--recompute-num-layers`); `None` keeps every activation. Rejects a layer count
    /// outside 1..=num_hidden_layers.
    pub fn set_recompute(&mut self, recompute: Option<Recompute>) -> Result<(), RecomputeError> {
        if let Some(r) = &recompute {
            r.check(self.layers.len())?;
        }
        self.recompute = recompute;
        Ok(())
    }

    /// The recompute setting in force.
    pub fn recompute(&self) -> Option<Recompute> {
        self.recompute
    }

    /// Whether [`CausalLm::forward_backward`] recomputes any layer in the backward pass.
    pub fn gradient_checkpointing(&self) -> bool {
        self.recompute.is_some()
    }

    /// Training step helper: runs the forward pass, computes `loss_fn(final hidden [B, T, H])`
    /// (a scalar), back-propagates into the parameters' `.grad` (accumulating, like
    /// `backward`), and returns the detached loss. Recomputed units keep one [B, T, H]
    /// input each (plus one unit's internals while it is recomputed); kept layers keep
    /// their activations as a plain backward pass would.
    pub fn forward_backward(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        attn: &Attention,
        loss_fn: impl FnOnce(&Tensor) -> Tensor,
    ) -> Tensor {
        match self.forward_backward_hooked(input_ids, position_ids, attn, &mut NoHooks, loss_fn) {
            Ok(loss) => loss,
            Err(never) => match never {},
        }
    }

    /// [`CausalLm::forward_backward`] calling `hooks` around each decoder layer
    /// (crate::layer_hooks: ZeRO-3 gathers a layer's parameters there and reduces its
    /// gradients). Kept units (no recompute, or `block`'s tail) stay gathered from
    /// their forward to their backward, since their graph reads the parameters then;
    /// recomputed units hold one unit's parameters at a time. The embedding, final norm
    /// and LM head must be whole throughout. A hook's error stops the pass.
    pub fn forward_backward_hooked<H: LayerHooks>(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        attn: &Attention,
        hooks: &mut H,
        loss_fn: impl FnOnce(&Tensor) -> Tensor,
    ) -> Result<Tensor, H::Error> {
        let layers = self.layers.len();
        let Some(recompute) = self.recompute else {
            for i in 0..layers {
                hooks.gather(i)?;
            }
            let hidden = self.forward_hidden(input_ids, position_ids, attn, None);
            let loss = loss_fn(&hidden);
            with_aux(&loss, self.take_aux_loss()).backward();
            for i in (0..layers).rev() {
                hooks.reduce(i)?;
            }
            return Ok(loss.detach());
        };
        let units = recompute.units(layers);
        let (embedded, ctx) = tch::no_grad(|| self.prepare(input_ids, position_ids, attn, 0));
        let run = |range: &std::ops::Range<usize>, x: &Tensor| {
            self.layers[range.clone()]
                .iter()
                .fold(x.shallow_clone(), |x, layer| layer.forward(&x, &ctx, None))
        };
        // A recomputed unit keeps only its input; a kept unit runs with autograd from a
        // detached input, so its graph stops there and the backward pass resumes from it.
        // Each unit's load-balancing loss joins the backward call that covers its graph.
        let mut saved: Vec<(Tensor, Option<Tensor>, Option<Tensor>)> =
            Vec::with_capacity(units.len());
        let mut x = embedded;
        for (range, recomputed) in &units {
            if *recomputed {
                let mut next = x.shallow_clone();
                for i in range.clone() {
                    hooks.gather(i)?;
                    next = tch::no_grad(|| self.layers[i].forward(&next, &ctx, None));
                    hooks.release(i)?;
                }
                let _ = self.take_aux_loss();
                saved.push((x, None, None));
                x = next;
            } else {
                for i in range.clone() {
                    hooks.gather(i)?;
                }
                let input = x.detach().set_requires_grad(true);
                let out = run(range, &input);
                saved.push((input, Some(out.shallow_clone()), self.take_aux_loss()));
                x = out;
            }
        }
        // A kept last unit's graph runs on into the loss: one backward call covers both.
        let tail_kept = matches!(saved.last(), Some((_, Some(_), _)));
        let last = if tail_kept {
            x
        } else {
            x.detach().set_requires_grad(true)
        };
        let loss = loss_fn(&self.norm.forward(&last));
        let tail_aux = match saved.last_mut() {
            Some((_, Some(_), aux)) => aux.take(),
            _ => None,
        };
        with_aux(&loss, tail_aux).backward();
        let mut grad = match saved.pop() {
            Some((input, Some(_), _)) => {
                if let Some((range, _)) = units.last() {
                    for i in range.clone().rev() {
                        hooks.reduce(i)?;
                    }
                }
                input.grad()
            }
            other => {
                saved.extend(other);
                last.grad()
            }
        };
        for ((range, _), (input, out, aux)) in units[..saved.len()].iter().zip(saved).rev() {
            let (input, out, aux) = match out {
                Some(out) => (input, out, aux),
                None => {
                    for i in range.clone() {
                        hooks.gather(i)?;
                    }
                    let input = input.detach().set_requires_grad(true);
                    let out = run(range, &input);
                    (input, out, self.take_aux_loss())
                }
            };
            // d(sum(out * g))/d(out) = g: a vector-Jacobian product through this unit.
            with_aux(&(out * &grad).sum(None::<Kind>), aux).backward();
            grad = input.grad();
            for i in range.clone().rev() {
                hooks.reduce(i)?;
            }
        }
        let embedded = Tensor::embedding(&self.embed_tokens, input_ids, -1, false, false);
        (embedded * &grad).sum(None::<Kind>).backward();
        Ok(loss.detach())
    }

    /// [`CausalLm::forward_hidden`] without a cache, for passes with no backward
    /// (log-probs): each layer's parameters are gathered just before it runs and
    /// released right after (crate::layer_hooks). The embedding and final norm must be
    /// whole.
    pub fn forward_hidden_hooked<H: LayerHooks>(
        &self,
        input_ids: &Tensor,
        position_ids: &Tensor,
        attn: &Attention,
        hooks: &mut H,
    ) -> Result<Tensor, H::Error> {
        let (mut x, ctx) = self.prepare(input_ids, position_ids, attn, 0);
        for (i, layer) in self.layers.iter().enumerate() {
            hooks.gather(i)?;
            x = layer.forward(&x, &ctx, None);
            hooks.release(i)?;
        }
        Ok(self.norm.forward(&x))
    }
}

/// `loss` plus a unit's scaled load-balancing loss, when its sparse layers produced one.
fn with_aux(loss: &Tensor, aux: Option<Tensor>) -> Tensor {
    match aux {
        Some(aux) => loss + aux,
        None => loss.shallow_clone(),
    }
}
