//! The CUDA decode path of paged forwards: q/k/v and gate/up fused into one matrix each,
//! head norms + rotary + cache store in one kernel, residual add + RMS norm fused (into the
//! GEMV at a few rows), and the small-batch GEMV for projections and logits.

use tch::{Device, Kind, Tensor};

use super::paged::{PagedBatch, PagedKvCache};
use super::{CausalLm, RmsNorm, SelfAttention};

/// What [`CausalLm::enable_decode_kernels`] prepared.
pub(super) struct DecodeKernels {
    layers: Vec<FusedLayer>,
    /// fp32 logits of a few rows through the GEMV kernel rather than cuBLAS, which reads
    /// the LM head at about half the bandwidth at one row (H100, Qwen3-0.6B: ~230 of a
    /// ~1,100 µs decode step; BENCHMARKS.md). `MANTA_LOGITS_GEMV=0` turns it off (A/B).
    logits_gemv: bool,
}

/// One layer's projections laid out for the decode kernels: q/k/v in one matrix (one GEMM)
/// and gate/up in another. The model's own variables are views into these buffers, so a
/// weight update that copies into the variables updates them too.
pub(super) struct FusedLayer {
    qkv: Tensor,
    qkv_bias: Option<Tensor>,
    gate_up: Tensor,
    /// The down projection (the model's own variable).
    down: Tensor,
    /// Projections of at most `manta_cuda::gemv::FASTER_UP_TO_ROWS` rows run the GEMV kernel.
    gemv: bool,
}

/// `x · wᵀ` (+ bias) for the kernel path: the small-batch GEMV at a few rows (`gemv`),
/// cuBLASLt otherwise (cuBLAS with a bias).
fn project(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, gemv: bool) -> Tensor {
    let rows = x.size()[0];
    if bias.is_some() {
        return x.linear(w, bias);
    }
    if !(gemv && rows <= manta_cuda::gemv::FASTER_UP_TO_ROWS) {
        return lt_linear(x, w);
    }
    let mut y = Tensor::empty([rows, w.size()[0]], (x.kind(), x.device()));
    if let Err(e) = manta_cuda::gemv::gemv(&x.contiguous(), w, &mut y, false) {
        panic!("gemv kernel: {e}");
    }
    y
}

/// `x · wᵀ` through cuBLASLt (`manta_cuda::linear`), [.., out].
fn lt_linear(x: &Tensor, w: &Tensor) -> Tensor {
    let x = x.contiguous();
    let mut shape = x.size();
    if let Some(last) = shape.last_mut() {
        *last = w.size()[0];
    }
    let mut y = Tensor::empty(shape.as_slice(), (x.kind(), x.device()));
    if let Err(e) = manta_cuda::linear(&x, w, &mut y) {
        panic!("cuBLASLt projection: {e}");
    }
    y
}

/// silu(x · gateᵀ) × (x · upᵀ) for `gate_up` = [gate | up] rows, [N, inter].
fn gate_up_silu(x: &Tensor, gate_up: &Tensor, inter: i64, gemv: bool) -> Tensor {
    let rows = x.size()[0];
    let mut act = Tensor::empty([rows, inter], (x.kind(), x.device()));
    let done = if gemv && rows <= manta_cuda::gemv::FASTER_UP_TO_ROWS {
        manta_cuda::gemv::gemv(&x.contiguous(), gate_up, &mut act, true)
    } else {
        manta_cuda::silu_mul(&lt_linear(x, gate_up), &mut act)
    };
    if let Err(e) = done {
        panic!("silu x up kernel: {e}");
    }
    act
}

/// Concatenates `parts` along dim 0 and re-points each to its view of the result.
fn fuse_rows(parts: &mut [&mut Tensor]) -> Tensor {
    let fused = Tensor::cat(&parts.iter().map(|t| &**t).collect::<Vec<_>>(), 0);
    let mut start = 0;
    for part in parts.iter_mut() {
        let rows = part.size()[0];
        part.set_data(&fused.narrow(0, start, rows));
        start += rows;
    }
    fused
}

/// `x += delta` (when given), then the projection of `rms_norm(x) × norm.weight` by
/// `w` (+ bias) — or, with `silu_width`, silu × up of the [gate | up] projection. `fuse`
/// = (GEMV usable, norm fused into it): one kernel at a few rows, else the add + norm
/// kernel and then the projection.
fn normed_projection(
    x: &mut Tensor,
    delta: Option<Tensor>,
    norm: &RmsNorm,
    (w, bias): (&Tensor, Option<&Tensor>),
    silu_width: Option<i64>,
    (gemv, fuse): (bool, bool),
) -> Tensor {
    if !(fuse && bias.is_none()) {
        let mut normed = x.empty_like();
        if let Err(e) =
            manta_cuda::add_rms_norm(x, delta.as_ref(), &norm.weight, &mut normed, norm.eps)
        {
            panic!("residual + rms norm kernel: {e}");
        }
        return match silu_width {
            Some(width) => gate_up_silu(&normed, w, width, gemv),
            None => project(&normed, w, bias, gemv),
        };
    }
    let rows = x.size()[0];
    let width = silu_width.unwrap_or_else(|| w.size()[0]);
    let mut y = Tensor::empty([rows, width], (x.kind(), x.device()));
    let mut sum = delta.as_ref().map(|_| x.empty_like());
    let input = manta_cuda::gemv::InputNorm {
        delta: delta.as_ref().zip(sum.as_mut()),
        weight: &norm.weight,
        eps: norm.eps,
    };
    if let Err(e) = manta_cuda::gemv::gemv_norm(x, input, w, &mut y, silu_width.is_some()) {
        panic!("rms norm + gemv kernel: {e}");
    }
    if let Some(sum) = sum {
        *x = sum;
    }
    y
}

/// Whether decode steps of a few rows can run their projections through the GEMV kernel:
/// every inner size a multiple of 256, the kernel compiles, and `MANTA_DECODE_GEMV` is not
/// `0` (for A/B runs against cuBLAS).
fn decode_gemv_usable(shape: &manta_cuda::KernelShape, arch: u32) -> bool {
    if !manta_knobs::decode_gemv() {
        return false;
    }
    let (h, inter) = (shape.hidden, shape.intermediate);
    let (q, kv) = (
        shape.heads * shape.head_dim,
        shape.kv_heads * shape.head_dim,
    );
    let projections = [
        (h, q + 2 * kv, false),
        (q, h, false),
        (h, inter, true),
        (inter, h, false),
    ];
    for (k, n, silu) in projections {
        if !manta_cuda::gemv::supports(k as i64) {
            return false;
        }
        let rows = manta_cuda::gemv::FASTER_UP_TO_ROWS;
        if let Err(e) = manta_cuda::gemv::gemv_compile(k, n, silu, rows, arch) {
            tracing::warn!(error = %e, "GEMV kernel unusable; decode projections stay on cuBLAS");
            return false;
        }
    }
    true
}

impl SelfAttention {
    /// The kernel path from the fused q/k/v projection `qkv` [N, (heads + 2 kv_heads) × hd]
    /// (bf16, CUDA): one kernel for head norms, rotary embedding and the cache store, then
    /// attention and the output projection.
    fn forward_paged_kernels(
        &self,
        qkv: &Tensor,
        fused: &FusedLayer,
        rope: &Tensor,
        pools: (&Tensor, &Tensor),
        batch: &PagedBatch,
    ) -> Tensor {
        let n = qkv.size()[0];
        let mut q = Tensor::empty(
            [n, self.num_heads, self.head_dim],
            (qkv.kind(), qkv.device()),
        );
        let norms = self.q_norm.as_ref().zip(self.k_norm.as_ref());
        let eps = norms.map_or(1e-6, |(qn, _)| qn.eps);
        if let Err(e) = manta_cuda::qk_norm_rope_store(
            qkv,
            norms.map(|(qn, kn)| (&qn.weight, &kn.weight)),
            rope,
            &batch.slot_mapping,
            pools.0,
            pools.1,
            &mut q,
            eps,
        ) {
            panic!("q/k norm + rotary + cache store kernel: {e}");
        }
        project(
            &self.attend(&q, pools, batch, false),
            &self.o_proj,
            None,
            fused.gemv,
        )
    }
}

impl CausalLm {
    /// Switches paged forwards to the CUDA decode kernels (bf16 on CUDA): fused q/k/v and
    /// gate/up projections, one kernel for head norms + rotary + cache store, fused
    /// residual-add + RMS norm, SiLU×up, and paged attention in place. A decode step then
    /// launches about 10 kernels per layer instead of about 30. The kernels are compiled
    /// here, so a build or driver problem is reported now and the model stays as it was.
    pub fn enable_decode_kernels(&mut self) -> Result<(), String> {
        if self.invariant_attention {
            return Err(
                "the decode kernels round differently from the trainer's ops; true on-policy \
                 mode (batch-invariant attention) runs without them"
                    .into(),
            );
        }
        if self.cfg.moe().is_some() {
            return Err(format!(
                "the decode kernels do not run {} (mixture-of-experts) layers yet; its paged \
                 forward runs through tensor ops",
                self.cfg.model_type
            ));
        }
        let index = self.kernel_device("the decode kernels")?;
        let cfg = &self.cfg;
        let shape = manta_cuda::KernelShape {
            hidden: cfg.hidden_size as usize,
            intermediate: cfg.intermediate_size as usize,
            heads: cfg.num_attention_heads as usize,
            kv_heads: cfg.num_key_value_heads as usize,
            head_dim: cfg.head_dim() as usize,
            qk_norm: self
                .layers
                .first()
                .is_some_and(|l| l.self_attn.q_norm.is_some()),
        };
        let arch = manta_cuda::device_arch(index).map_err(|e| e.to_string())?;
        manta_cuda::decode_kernels_compile(shape, arch).map_err(|e| e.to_string())?;
        let gemv = decode_gemv_usable(&shape, arch);
        let _guard = tch::no_grad_guard();
        let mut fused = Vec::with_capacity(self.layers.len());
        for layer in &mut self.layers {
            let a = &mut layer.self_attn;
            let qkv = fuse_rows(&mut [&mut a.q_proj, &mut a.k_proj, &mut a.v_proj]);
            let qkv_bias = match (&mut a.q_bias, &mut a.k_bias, &mut a.v_bias) {
                (Some(q), Some(k), Some(v)) => Some(fuse_rows(&mut [q, k, v])),
                _ => None,
            };
            let Some(m) = layer.mlp.dense_mut() else {
                return Err("a sparse layer reached the decode kernels".into());
            };
            let gate_up = fuse_rows(&mut [&mut m.gate, &mut m.up]);
            let down = m.down.shallow_clone();
            fused.push(FusedLayer {
                qkv,
                qkv_bias,
                gate_up,
                down,
                gemv,
            });
        }
        // (`gemv` already means the hidden size suits the kernel: it is the q/k/v's K.)
        let logits_gemv = gemv
            && manta_knobs::logits_gemv()
            && match manta_cuda::gemv::logits_compile(
                cfg.hidden_size as usize,
                cfg.vocab_size as usize,
                manta_cuda::gemv::FASTER_UP_TO_ROWS,
                arch,
            ) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(error = %e, "logits GEMV unusable; the LM head stays on cuBLAS");
                    false
                }
            };
        self.decode_kernels = Some(DecodeKernels {
            layers: fused,
            logits_gemv,
        });
        Ok(())
    }

    /// fp32 logits of `hidden` [rows, H] through the GEMV kernel, where the decode kernels
    /// chose it and the rows are few; `None` leaves them to cuBLAS.
    pub(super) fn logits_gemv(&self, hidden: &Tensor) -> Option<Tensor> {
        let rows = hidden.size()[0];
        let usable = self.decode_kernels.as_ref().is_some_and(|k| k.logits_gemv)
            && (1..=manta_cuda::gemv::FASTER_UP_TO_ROWS).contains(&rows)
            && hidden.kind() == Kind::BFloat16
            && hidden.device() == self.lm_head.device();
        if !usable {
            return None;
        }
        let vocab = self.lm_head.size()[0];
        let mut logits = Tensor::empty([rows, vocab], (Kind::Float, hidden.device()));
        if let Err(e) =
            manta_cuda::gemv::gemv(&hidden.contiguous(), &self.lm_head, &mut logits, false)
        {
            panic!("logits gemv kernel: {e}");
        }
        Some(logits)
    }

    /// The CUDA device index of a bf16 model in a build with the CUDA kernels, or why
    /// `what` cannot run here.
    pub(super) fn kernel_device(&self, what: &str) -> Result<usize, String> {
        let Device::Cuda(index) = self.embed_tokens.device() else {
            return Err(format!("{what} run on CUDA only"));
        };
        if self.embed_tokens.kind() != Kind::BFloat16 {
            return Err(format!(
                "{what} need bf16 weights, not {:?}",
                self.embed_tokens.kind()
            ));
        }
        if !manta_cuda::built_with_cuda() {
            return Err("this build has no CUDA kernels (no CUDA headers at build time)".into());
        }
        Ok(index)
    }

    /// Whether paged forwards run the CUDA decode kernels.
    pub fn decode_kernels_enabled(&self) -> bool {
        self.decode_kernels.is_some()
    }

    /// The paged forward through the decode kernels that [`CausalLm::enable_decode_kernels`]
    /// prepared.
    pub(super) fn forward_paged_kernels(
        &self,
        kernels: &DecodeKernels,
        input_ids: &Tensor,
        positions: &Tensor,
        batch: &PagedBatch,
        cache: &PagedKvCache,
    ) -> Tensor {
        let fused = &kernels.layers;
        let mut x = Tensor::embedding(&self.embed_tokens, input_ids, -1, false, false);
        // Every layer's rotary cosines and sines for these positions, computed once.
        let rope = manta_cuda::rope_table(positions, &self.rotary.inv_freq)
            .unwrap_or_else(|e| panic!("rotary table kernel: {e}"));
        let inter = self.cfg.intermediate_size;
        let gemv = fused.first().is_some_and(|f| f.gemv);
        // At a few rows, each residual add + norm goes into the GEMV after it.
        let rows = x.size()[0];
        let fuse_norms = gemv
            && rows <= manta_cuda::gemv::FASTER_UP_TO_ROWS
            && manta_cuda::gemv::norm_fits(self.cfg.hidden_size, rows);
        // The last block's output, not yet added to the residual stream `x`.
        let mut delta: Option<Tensor> = None;
        for (i, (layer, f)) in self.layers.iter().zip(fused).enumerate() {
            let qkv = normed_projection(
                &mut x,
                delta.take(),
                &layer.input_layernorm,
                (&f.qkv, f.qkv_bias.as_ref()),
                None,
                (gemv, fuse_norms),
            );
            let attn = layer
                .self_attn
                .forward_paged_kernels(&qkv, f, &rope, cache.layer(i), batch);
            let act = normed_projection(
                &mut x,
                Some(attn),
                &layer.post_attention_layernorm,
                (&f.gate_up, None),
                Some(inter),
                (gemv, fuse_norms),
            );
            delta = Some(project(&act, &f.down, None, gemv));
        }
        let mut normed = x.empty_like();
        if let Err(e) = manta_cuda::add_rms_norm(
            &mut x,
            delta.as_ref(),
            &self.norm.weight,
            &mut normed,
            self.norm.eps,
        ) {
            panic!("residual + rms norm kernel: {e}");
        }
        normed
    }
}
