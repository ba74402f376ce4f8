//! Next-token choice for a batch of rows, on the device that holds the logits.
//!
//! Sampling is inverse-CDF with one uniform number per row drawn on the host from the
//! request's own generator, so a request's tokens depend on its seed and prompt only, not
//! on which other requests share the batch. Reported log-probs are those of the sampled
//! token under `log_softmax(logits / temperature)` — the distribution the trainer scores
//! — whatever top-k / top-p / min-p filtering chose it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use tch::{Device, Kind, Tensor};

/// The per-row controls the sampler needs.
#[derive(Debug, Clone, Copy)]
pub struct RowSampling {
    pub greedy: bool,
    pub temperature: f64,
    pub top_k: i64,
    pub top_p: f64,
    pub min_p: f64,
    /// Uniform in [0, 1), from the request's generator.
    pub uniform: f64,
}

impl RowSampling {
    /// This row's two parameters for the sampling kernel: the temperature (0 for greedy
    /// rows) and the uniform draw.
    pub fn kernel_pair(&self) -> [f32; 2] {
        let temperature = if self.greedy {
            0.0
        } else {
            self.temperature as f32
        };
        [temperature, self.uniform as f32]
    }

    fn filters(&self, vocab: i64) -> bool {
        !self.greedy
            && ((self.top_k > 0 && self.top_k < vocab) || self.top_p < 1.0 || self.min_p > 0.0)
    }
}

/// Set once the sampling kernel has failed: tensor ops from then on.
static KERNEL_FAILED: AtomicBool = AtomicBool::new(false);

/// Whether this build and `MANTA_SAMPLING_KERNEL` (not `0`) allow the kernel; read once.
fn kernel_allowed() -> bool {
    static ALLOWED: OnceLock<bool> = OnceLock::new();
    *ALLOWED.get_or_init(|| manta_cuda::built_with_cuda() && manta_knobs::sampling_kernel())
}

/// Chooses one token per row of `logits` [S, V]; returns (token ids, log-probs).
pub fn sample(logits: &Tensor, rows: &[RowSampling]) -> (Vec<i64>, Vec<f32>) {
    let device = logits.device();
    let vocab = logits.size()[1];
    let logits = logits.to_kind(Kind::Float);
    if device.is_cuda() && kernel_handles(rows, vocab) {
        if let Some(chosen) = sample_with_kernel(&logits, rows) {
            return chosen;
        }
    }
    if rows.iter().all(|r| r.greedy) {
        // Greedy rows: the argmax and its log-prob at temperature 1, nothing else.
        let next = logits.argmax(-1, false);
        let lse = logits.logsumexp([-1], false);
        let next_logp = logits.gather(1, &next.unsqueeze(1), false).squeeze_dim(1) - lse;
        return to_host(&next, &next_logp);
    }
    let column = |values: Vec<f32>| Tensor::from_slice(&values).to(device).unsqueeze(1);
    // Greedy rows report the unscaled distribution (temperature 1).
    let temps = column(
        rows.iter()
            .map(|r| if r.greedy { 1.0 } else { r.temperature as f32 })
            .collect(),
    );
    let logp = (logits / temps).log_softmax(-1, Kind::Float);
    let argmax = logp.argmax(-1, false);
    let next = if rows.iter().all(|r| r.greedy) {
        argmax
    } else {
        let probs = logp.exp();
        let uniform = column(rows.iter().map(|r| r.uniform as f32).collect());
        let drawn = if rows.iter().any(|r| r.filters(vocab)) {
            let (sorted, order) = probs.sort(-1, true);
            let cdf = sorted.cumsum(-1, Kind::Float);
            let rank = Tensor::arange(vocab, (Kind::Int64, device)).unsqueeze(0);
            let top_k = Tensor::from_slice(
                &rows
                    .iter()
                    .map(|r| if r.top_k > 0 { r.top_k } else { vocab })
                    .collect::<Vec<i64>>(),
            )
            .to(device)
            .unsqueeze(1);
            let top_p = column(rows.iter().map(|r| r.top_p as f32).collect());
            let min_p = column(rows.iter().map(|r| r.min_p as f32).collect());
            // Mass before a token below top_p keeps it, so the most likely token always stays.
            let keep = (&cdf - &sorted)
                .lt_tensor(&top_p)
                .logical_and(&rank.lt_tensor(&top_k))
                .logical_and(&sorted.ge_tensor(&(sorted.narrow(1, 0, 1) * min_p)));
            let kept = sorted * keep.to_kind(Kind::Float);
            let kept_cdf = kept.cumsum(-1, Kind::Float);
            let target = uniform * kept_cdf.narrow(1, vocab - 1, 1);
            let pos = target
                .searchsorted(&kept_cdf, false, true, "right", None::<Tensor>)
                .clamp_max(vocab - 1);
            order.gather(1, &pos, false).squeeze_dim(1)
        } else {
            let cdf = probs.cumsum(-1, Kind::Float);
            let target = uniform * cdf.narrow(1, vocab - 1, 1);
            target
                .searchsorted(&cdf, false, true, "right", None::<Tensor>)
                .clamp_max(vocab - 1)
                .squeeze_dim(1)
        };
        let greedy =
            Tensor::from_slice(&rows.iter().map(|r| r.greedy).collect::<Vec<bool>>()).to(device);
        argmax.where_self(&greedy, &drawn)
    };
    let next_logp = logp.gather(1, &next.unsqueeze(1), false).squeeze_dim(1);
    to_host(&next, &next_logp)
}

/// Rows without top-k / top-p / min-p on CUDA: one kernel, one copy back
/// (`manta_cuda::sampling`); `None` when the kernel is off or fails (logged once).
fn sample_with_kernel(logits: &Tensor, rows: &[RowSampling]) -> Option<(Vec<i64>, Vec<f32>)> {
    if !kernel_usable() {
        return None;
    }
    let params = Tensor::from_slice(&kernel_params(rows)).to(logits.device());
    let out = sample_on_device(&logits.contiguous(), &params)?;
    Some(kernel_output_to_host(&out, rows.len()))
}

/// Whether the sampling kernel may run: allowed by the build and `MANTA_SAMPLING_KERNEL`,
/// and it has not failed.
pub fn kernel_usable() -> bool {
    kernel_allowed() && !KERNEL_FAILED.load(Ordering::Relaxed)
}

/// Whether every row can be sampled by the kernel (none filters by top-k, top-p or min-p).
pub fn kernel_handles(rows: &[RowSampling], vocab: i64) -> bool {
    !rows.iter().any(|r| r.filters(vocab))
}

/// The kernel's parameters for `rows`, as `[2, rows]` row-major: every row's temperature
/// (0 for greedy rows), then every row's uniform draw.
pub fn kernel_params(rows: &[RowSampling]) -> Vec<f32> {
    let pairs: Vec<[f32; 2]> = rows.iter().map(RowSampling::kernel_pair).collect();
    pairs
        .iter()
        .map(|p| p[0])
        .chain(pairs.iter().map(|p| p[1]))
        .collect()
}

/// Launches the sampling kernel over `logits` [B, V] fp32 with `params` [2, B] (see
/// [`kernel_params`]) and returns its output [2, B] f64 (token ids, log-probs) without
/// waiting for it, so a CUDA graph can capture it. `None` when the kernel fails (logged
/// once; the tensor-op sampler is used from then on).
pub fn sample_on_device(logits: &Tensor, params: &Tensor) -> Option<Tensor> {
    let mut out = Tensor::empty([2, logits.size()[0]], (Kind::Double, logits.device()));
    match manta_cuda::sampling::sample_rows(logits, params, &mut out) {
        Ok(()) => Some(out),
        Err(e) => {
            tracing::warn!(error = %e, "sampling kernel failed; sampling with tensor ops from now on");
            KERNEL_FAILED.store(true, Ordering::Relaxed);
            None
        }
    }
}

/// The first `rows` (token id, log-prob) pairs of a kernel output [2, B], in one copy to
/// the host (which waits for the device).
pub fn kernel_output_to_host(out: &Tensor, rows: usize) -> (Vec<i64>, Vec<f32>) {
    read_kernel_output(&out.to(Device::Cpu), rows)
}

/// The first `rows` (token id, log-prob) pairs of a kernel output [2, B] already on the
/// host. A failure here panics: the engine's step catches it and fails the batch's
/// requests.
pub fn read_kernel_output(host: &Tensor, rows: usize) -> (Vec<i64>, Vec<f32>) {
    // All of it (contiguous: one copy, no gather kernel).
    let both = Vec::<f64>::try_from(&host.view([-1])).expect("sampled ids to host");
    let width = both.len() / 2;
    (
        both[..rows].iter().map(|&t| t as i64).collect(),
        both[width..width + rows]
            .iter()
            .map(|&l| l as f32)
            .collect(),
    )
}

/// Token ids and log-probs to the host in one copy (one synchronisation per step).
fn to_host(next: &Tensor, next_logp: &Tensor) -> (Vec<i64>, Vec<f32>) {
    let both = Tensor::stack(
        &[next.to_kind(Kind::Double), next_logp.to_kind(Kind::Double)],
        0,
    );
    // A failure here panics: the engine's step catches it and fails the batch's requests
    // (an empty result would leave them waiting forever).
    let both = Vec::<f64>::try_from(&both.to(Device::Cpu).view([-1])).expect("sampled ids to host");
    let (ids, lps) = both.split_at(both.len() / 2);
    (
        ids.iter().map(|&t| t as i64).collect(),
        lps.iter().map(|&l| l as f32).collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(uniform: f64) -> RowSampling {
        RowSampling {
            greedy: false,
            temperature: 1.0,
            top_k: -1,
            top_p: 1.0,
            min_p: 0.0,
            uniform,
        }
    }

    #[test]
    fn kernel_params_are_temperatures_then_draws_with_greedy_as_zero() {
        let greedy = RowSampling {
            greedy: true,
            ..row(0.25)
        };
        let hot = RowSampling {
            temperature: 0.7,
            ..row(0.5)
        };
        assert_eq!(greedy.kernel_pair(), [0.0, 0.25]);
        assert_eq!(kernel_params(&[greedy, hot]), vec![0.0, 0.7, 0.25, 0.5]);
    }

    #[test]
    fn inverse_cdf_picks_the_token_whose_interval_holds_the_draw() {
        // probs 0.1, 0.2, 0.7
        let logits = Tensor::from_slice(&[0.1f32, 0.2, 0.7]).log().unsqueeze(0);
        let pick = |u| sample(&logits, &[row(u)]).0[0];
        assert_eq!(pick(0.05), 0);
        assert_eq!(pick(0.15), 1);
        assert_eq!(pick(0.95), 2);
        // top-k 1 keeps only the most likely token; top-p 0.6 too; min-p 0.2 drops token 0.
        let only = |r: RowSampling| sample(&logits, &[r]).0[0];
        assert_eq!(
            only(RowSampling {
                top_k: 1,
                ..row(0.0)
            }),
            2
        );
        assert_eq!(
            only(RowSampling {
                top_p: 0.6,
                ..row(0.99)
            }),
            2
        );
        assert_eq!(
            only(RowSampling {
                min_p: 0.2,
                ..row(0.999)
            }),
            1
        );
        // The reported log-prob is the unfiltered one.
        let (_, lp) = sample(
            &logits,
            &[RowSampling {
                top_k: 1,
                ..row(0.5)
            }],
        );
        assert!((lp[0] - 0.7f32.ln()).abs() < 1e-5);
    }
}
