//! Projections of decode steps with at most [`MAX_ROWS`] rows (gemv.cu.inc): at a few rows
//! a projection is a stream of weight bytes, which cuBLAS's GEMM tiles read at a fraction of
//! the memory bandwidth. The same kernel folds in what surrounds a projection in a decoder
//! layer — the residual add and RMS norm before it, Qwen's SiLU × up after the gate/up
//! projection — since at a few rows each separate kernel costs as much as its work.

use std::ffi::{c_char, c_int, c_void};

use tch::Tensor;

use crate::{check, CudaError};

extern "C" {
    #[allow(clippy::too_many_arguments)]
    fn manta_gemv(
        source: *const c_char,
        x: *mut c_void,
        delta: *mut c_void,
        norm_w: *mut c_void,
        x_out: *mut c_void,
        w: *mut c_void,
        y: *mut c_void,
        silu: c_int,
        eps: f32,
    ) -> c_int;
    fn manta_gemv_compile_check(
        source: *const c_char,
        k: c_int,
        n: c_int,
        silu: c_int,
        max_rows: c_int,
        out_f32: c_int,
        arch: c_int,
    ) -> c_int;
}

/// The most rows of `x` the GEMV takes.
pub const MAX_ROWS: i64 = 8;

/// Up to how many rows decode steps should use the GEMV: on an H100 it beats cuBLAS at one
/// row (0.6B decode 776 vs 675 tokens/s with the fused norms), ties at two, and loses from
/// four on (0.6B 1,822 vs 2,471 tokens/s at four rows; bench/run_engine_decode.sh,
/// 2026-11-23).
pub const FASTER_UP_TO_ROWS: i64 = 2;

/// The GEMV's CUDA source, NUL-terminated for NVRTC.
const GEMV_SOURCE: &str = concat!(
    include_str!("bf16.cu.inc"),
    include_str!("gemv.cu.inc"),
    "\0"
);

/// Whether [`gemv`] takes a weight of inner size `k` (a multiple of 256).
pub fn supports(k: i64) -> bool {
    k > 0 && k % 256 == 0
}

/// `y = x · wᵀ` for `x` [rows ≤ 8, K], `w` [n, K], `y` [rows, n] (bf16, CUDA, contiguous);
/// with `silu`, `w` is [gate | up] ([2n, K]) and `y = silu(x · gateᵀ) × (x · upᵀ)`. A plain
/// product may write an fp32 `y`: the fp32 sums unrounded (an LM head's logits).
pub fn gemv(x: &Tensor, w: &Tensor, y: &mut Tensor, silu: bool) -> Result<(), CudaError> {
    crate::sync_kernel_knobs();
    launch(x, None, w, y, silu)
}

/// The RMS norm a [`gemv_norm`] applies to its input first.
pub struct InputNorm<'a> {
    /// Added to the residual first (rounded to bf16); the sum is stored to `residual_out`.
    pub delta: Option<(&'a Tensor, &'a mut Tensor)>,
    /// The norm's weight [K].
    pub weight: &'a Tensor,
    pub eps: f64,
}

/// Like [`gemv`], with the input `rms_norm(residual (+ delta)) × weight` made inside the
/// kernel (rounded as `add_rms_norm` rounds). Only where [`norm_fits`].
pub fn gemv_norm(
    residual: &Tensor,
    norm: InputNorm,
    w: &Tensor,
    y: &mut Tensor,
    silu: bool,
) -> Result<(), CudaError> {
    crate::sync_kernel_knobs();
    launch(residual, Some(norm), w, y, silu)
}

/// Whether [`gemv_norm`] takes `rows` rows of inner size `k` (they and the norm weight sit
/// in shared memory).
pub fn norm_fits(k: i64, rows: i64) -> bool {
    let rows = match rows {
        ..=1 => 1,
        2 => 2,
        3..=4 => 4,
        _ => 8,
    };
    (rows + 1) * k <= 20480
}

fn launch(
    x: &Tensor,
    norm: Option<InputNorm>,
    w: &Tensor,
    y: &mut Tensor,
    silu: bool,
) -> Result<(), CudaError> {
    let null = std::ptr::null_mut();
    let (delta, norm_w, x_out, eps) = match &norm {
        None => (null, null, null, 0.0),
        Some(n) => {
            let (delta, out) = match &n.delta {
                Some((d, o)) => (d.as_ptr() as *mut c_void, o.as_ptr() as *mut c_void),
                None => (null, null),
            };
            (delta, n.weight.as_ptr() as *mut c_void, out, n.eps as f32)
        }
    };
    // SAFETY: live tensor handles for the call (x_out is written through its handle, held
    // mutably by `norm`); the shim checks shapes, dtypes, devices and aliasing.
    check(unsafe {
        manta_gemv(
            GEMV_SOURCE.as_ptr() as *const c_char,
            x.as_ptr() as *mut c_void,
            delta,
            norm_w,
            x_out,
            w.as_ptr() as *mut c_void,
            y.as_mut_ptr() as *mut c_void,
            silu as c_int,
            eps,
        )
    })
}

/// Compiles the GEMV for inner size `k` and `n` outputs, the variants for up to
/// `max_rows` rows, for `sm_<arch>` (NVRTC needs no GPU).
pub fn gemv_compile(
    k: usize,
    n: usize,
    silu: bool,
    max_rows: i64,
    arch: u32,
) -> Result<(), CudaError> {
    crate::sync_kernel_knobs();
    // SAFETY: the source is a NUL-terminated static.
    check(unsafe {
        manta_gemv_compile_check(
            GEMV_SOURCE.as_ptr() as *const c_char,
            k as c_int,
            n as c_int,
            silu as c_int,
            max_rows as c_int,
            0,
            arch as c_int,
        )
    })
}

/// Compiles the fp32-output GEMV (logits) for inner size `k` and `n` outputs, the variants
/// for up to `max_rows` rows, for `sm_<arch>`.
pub fn logits_compile(k: usize, n: usize, max_rows: i64, arch: u32) -> Result<(), CudaError> {
    crate::sync_kernel_knobs();
    // SAFETY: the source is a NUL-terminated static.
    check(unsafe {
        manta_gemv_compile_check(
            GEMV_SOURCE.as_ptr() as *const c_char,
            k as c_int,
            n as c_int,
            0,
            max_rows as c_int,
            1,
            arch as c_int,
        )
    })
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    use super::*;
    use crate::built_with_cuda;

    #[test]
    fn gemv_compiles_for_hopper() {
        if !built_with_cuda() {
            eprintln!("skipped: this build has no CUDA headers or CUDA libtorch");
            return;
        }
        for (k, n, silu) in [
            (1024, 4096, false),
            (2048, 1024, false),
            (1024, 3072, true),
            (3072, 1024, false),
            (4096, 12288, true),
            (12288, 4096, false),
        ] {
            if let Err(e) = gemv_compile(k, n, silu, MAX_ROWS, 90) {
                panic!("k {k}, n {n}, silu {silu}: {e}");
            }
        }
        if let Err(e) = logits_compile(1024, 151_936, MAX_ROWS, 90) {
            panic!("logits: {e}");
        }
    }

    /// A GEMV layout the kernel knobs select: rows per warp (plain, fused norm, SiLU),
    /// warps sharing a row, and loads in flight per lane.
    #[derive(Debug, Clone, Copy)]
    struct Layout {
        rows: &'static str,
        norm_rows: &'static str,
        silu_rows: &'static str,
        split: &'static str,
        depth: &'static str,
    }

    impl Layout {
        fn set(&self) {
            for (name, value) in [
                ("MANTA_GEMV_ROWS", self.rows),
                ("MANTA_GEMV_NORM_ROWS", self.norm_rows),
                ("MANTA_GEMV_SILU_ROWS", self.silu_rows),
                ("MANTA_GEMV_KSPLIT", self.split),
                ("MANTA_GEMV_NORM_KSPLIT", self.split),
                ("MANTA_GEMV_DEPTH", self.depth),
            ] {
                manta_knobs::set_override(name, value).expect("a knob");
            }
        }
    }

    /// The layouts the A/B knobs reach: every split with several rows and depths.
    fn layouts() -> Vec<Layout> {
        [
            ("1", "1", "1", "1", "16"),
            ("1", "1", "1", "2", "8"),
            ("1", "2", "2", "4", "24"),
            ("2", "2", "1", "2", "32"),
            ("2", "4", "4", "4", "16"),
            ("4", "4", "2", "1", "24"),
            ("4", "1", "4", "2", "8"),
            ("4", "2", "1", "4", "32"),
        ]
        .into_iter()
        .map(|(rows, norm_rows, silu_rows, split, depth)| Layout {
            rows,
            norm_rows,
            silu_rows,
            split,
            depth,
        })
        .collect()
    }

    /// Every layout the knobs select (8B o, down, qkv and gate/up projections) compiles.
    #[test]
    fn gemv_layouts_compile_for_hopper() {
        if !built_with_cuda() {
            eprintln!("skipped: this build has no CUDA headers or CUDA libtorch");
            return;
        }
        let _knobs = crate::gpu_test_lock();
        for layout in layouts() {
            layout.set();
            let result = [
                (4096, 4096, false),
                (12288, 4096, false),
                (4096, 6144, false),
            ]
            .into_iter()
            .chain([(4096, 12288, true)])
            .try_for_each(|(k, n, silu)| gemv_compile(k, n, silu, MAX_ROWS, 90));
            manta_knobs::clear_overrides();
            if let Err(e) = result {
                panic!("{layout:?}: {e}");
            }
        }
    }

    /// Every layout the knobs select against cuBLAS, at the 8B decode shapes they are for:
    /// o and down projections (plain), qkv (fused norm), gate/up (fused norm, SiLU); and
    /// layouts that split rows alike bit for bit equal (the same sums in the same order).
    #[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
    #[test]
    fn gemv_layouts_match_linear() {
        let Some(gpu) = crate::test_gpu() else {
            eprintln!("skipped: no CUDA device (the device machine runs this)");
            return;
        };
        let _serial = crate::gpu_test_lock();
        let dev = Device::Cuda(gpu);
        tch::manual_seed(5);
        let residual = Tensor::randn([1, 4096], (Kind::BFloat16, dev));
        let weight = Tensor::rand([4096], (Kind::BFloat16, dev)) + 0.5;
        let mut normed = residual.empty_like();
        crate::add_rms_norm(&mut residual.copy(), None, &weight, &mut normed, 1e-6)
            .expect("add_rms_norm");
        let w_qkv = Tensor::randn([6144, 4096], (Kind::BFloat16, dev)) * 0.05;
        let w_gate_up = Tensor::randn([2 * 3072, 4096], (Kind::BFloat16, dev)) * 0.05;
        let want_qkv = normed.linear(&w_qkv, None::<Tensor>).to_kind(Kind::Float);
        let mut want_act = Tensor::empty([1, 3072], (Kind::BFloat16, dev));
        gemv(&normed, &w_gate_up, &mut want_act, true).expect("silu gemv");
        let want_act = want_act.to_kind(Kind::Float);
        // Rows per warp and loads in flight leave each row's sum in the same order:
        // every layout's outputs equal, bit for bit, the first layout's with the same split.
        let mut first_of_split = std::collections::HashMap::new();
        for layout in layouts() {
            layout.set();
            let what = format!("{layout:?}: ");
            let mut outputs = Vec::new();
            for (k, n) in [(4096i64, 4096i64), (12288, 4096)] {
                for rows in [1i64, 2, 8] {
                    tch::manual_seed(k * 10 + rows);
                    outputs.push(plain_gemv_matches_linear(dev, (k, n, rows), &what).2);
                }
            }
            for (w, silu, want, out_n) in [
                (&w_qkv, false, &want_qkv, 6144),
                (&w_gate_up, true, &want_act, 3072),
            ] {
                let mut got = Tensor::empty([1, out_n], (Kind::BFloat16, dev));
                let norm = InputNorm {
                    delta: None,
                    weight: &weight,
                    eps: 1e-6,
                };
                gemv_norm(&residual, norm, w, &mut got, silu).expect("gemv_norm");
                let (err, scale) = max_err(&got, want);
                assert!(
                    err <= scale * 2e-2,
                    "{what}norm, silu {silu}: {err} of {scale}"
                );
                outputs.push(got);
            }
            match first_of_split.get(layout.split) {
                None => {
                    first_of_split.insert(layout.split, (layout, outputs));
                }
                Some((first, theirs)) => {
                    for (i, (ours, theirs)) in outputs.iter().zip(theirs).enumerate() {
                        assert!(
                            ours.equal(theirs),
                            "{what}output {i} differs from {first:?}'s"
                        );
                    }
                }
            }
        }
        manta_knobs::clear_overrides();
    }

    /// `gemv` of a random [rows, k] by [n, k] against cuBLAS's `linear`: within a bf16
    /// rounding step of the output's size. Returns x, w and the output for more checks.
    fn plain_gemv_matches_linear(
        dev: Device,
        (k, n, rows): (i64, i64, i64),
        what: &str,
    ) -> (Tensor, Tensor, Tensor) {
        let x = Tensor::randn([rows, k], (Kind::BFloat16, dev));
        let w = Tensor::randn([n, k], (Kind::BFloat16, dev)) * 0.05;
        let want = x.linear(&w, None::<Tensor>).to_kind(Kind::Float);
        let mut y = Tensor::empty([rows, n], (Kind::BFloat16, dev));
        gemv(&x, &w, &mut y, false).expect("gemv runs");
        let (err, scale) = max_err(&y, &want);
        assert!(
            err <= scale * 8e-3,
            "{what}k {k} n {n} rows {rows}: {err} of {scale}"
        );
        (x, w, y)
    }

    /// Largest |got − want| and largest |want| (for a tolerance relative to the output's size).
    fn max_err(got: &Tensor, want: &Tensor) -> (f64, f64) {
        let err = (got.to_kind(Kind::Float) - want)
            .abs()
            .max()
            .double_value(&[]);
        (err, want.abs().max().double_value(&[]))
    }

    /// Against cuBLAS through `linear` (and silu × up over its bf16 output): fp32 sums in
    /// another order, so within a bf16 rounding step of the result. Plain products take
    /// the split-K layout (four warps per row).
    #[ignore = "needs a CUDA device: bench/run_gpu_tests.sh runs it"]
    #[test]
    fn gemv_matches_linear() {
        let Some(gpu) = crate::test_gpu() else {
            eprintln!("skipped: no CUDA device (the device machine runs this)");
            return;
        };
        let _serial = crate::gpu_test_lock();
        let dev = Device::Cuda(gpu);
        tch::manual_seed(3);
        for (k, n) in [(1024i64, 4096i64), (2048, 1024), (3072, 1024), (4096, 6144)] {
            for rows in [1i64, 2, 3, 8] {
                let (x, w, _) = plain_gemv_matches_linear(dev, (k, n, rows), "");
                // silu × up over [gate | up] = w split in halves.
                let half = n / 2;
                let gate_up = x.linear(&w, None::<Tensor>);
                let (g, u) = (gate_up.narrow(1, 0, half), gate_up.narrow(1, half, half));
                let want = (g
                    .to_kind(Kind::Float)
                    .silu()
                    .to_kind(Kind::BFloat16)
                    .to_kind(Kind::Float)
                    * u.to_kind(Kind::Float))
                .to_kind(Kind::Float);
                let mut act = Tensor::empty([rows, half], (Kind::BFloat16, dev));
                gemv(&x, &w, &mut act, true).expect("silu gemv runs");
                let (err, scale) = max_err(&act, &want);
                assert!(
                    err <= scale * 2e-2,
                    "silu k {k} n {n} rows {rows}: {err} of {scale}"
                );
            }
        }
        // fp32 logits against cuBLAS writing fp32 (mm_dtype): both sum in fp32, in other
        // orders, and neither rounds the result.
        for (k, n) in [(1024i64, 151_936i64), (4096, 8192)] {
            for rows in [1i64, 2] {
                let x = Tensor::randn([rows, k], (Kind::BFloat16, dev));
                let w = Tensor::randn([n, k], (Kind::BFloat16, dev)) * 0.05;
                let want = x.mm_dtype(&w.tr(), Kind::Float);
                let mut y = Tensor::empty([rows, n], (Kind::Float, dev));
                gemv(&x, &w, &mut y, false).expect("fp32 gemv runs");
                let (err, scale) = max_err(&y, &want);
                assert!(
                    err <= scale * 1e-5,
                    "fp32 k {k} n {n} rows {rows}: {err} of {scale}"
                );
                // Rounded to bf16, the error would be ~4e-3 of the scale: the test sees it.
                let (rounded, _) = max_err(&want.to_kind(Kind::BFloat16), &want);
                assert!(
                    rounded > scale * 1e-4,
                    "bf16 rounding went unseen: {rounded}"
                );
            }
        }
        let (x, w) = (
            Tensor::zeros([1, 1024], (Kind::BFloat16, dev)),
            Tensor::zeros([2048, 1024], (Kind::BFloat16, dev)),
        );
        let mut y = Tensor::zeros([1, 1024], (Kind::Float, dev));
        let e = gemv(&x, &w, &mut y, true).expect_err("fp32 silu");
        assert!(e.to_string().contains("plain product"), "{e}");
        // The fused norm against add_rms_norm, then the plain GEMV.
        for (k, n, silu) in [
            (1024i64, 4096i64, false),
            (1024, 6144, true),
            (4096, 4096, false),
            (1024, 1024, false), // few outputs: rows shared by four warps (KSPLIT)
        ] {
            for rows in [1i64, 3, 4] {
                let residual = Tensor::randn([rows, k], (Kind::BFloat16, dev));
                let delta = Tensor::randn([rows, k], (Kind::BFloat16, dev));
                let weight = Tensor::rand([k], (Kind::BFloat16, dev)) + 0.5;
                let w = Tensor::randn([n, k], (Kind::BFloat16, dev)) * 0.05;
                let mut want_residual = residual.copy();
                let mut normed = residual.empty_like();
                crate::add_rms_norm(&mut want_residual, Some(&delta), &weight, &mut normed, 1e-6)
                    .expect("add_rms_norm");
                let out_n = if silu { n / 2 } else { n };
                let mut want = Tensor::empty([rows, out_n], (Kind::BFloat16, dev));
                gemv(&normed, &w, &mut want, silu).expect("gemv");
                let mut got = want.empty_like();
                let mut residual_out = residual.empty_like();
                let norm = InputNorm {
                    delta: Some((&delta, &mut residual_out)),
                    weight: &weight,
                    eps: 1e-6,
                };
                gemv_norm(&residual, norm, &w, &mut got, silu).expect("gemv_norm");
                assert!(
                    residual_out.equal(&want_residual),
                    "k {k} rows {rows}: residual + delta differs"
                );
                let want = want.to_kind(Kind::Float);
                let (err, scale) = max_err(&got, &want);
                assert!(
                    err <= scale * 2e-2,
                    "norm k {k} n {n} rows {rows}: {err} of {scale}"
                );
            }
        }
        // Bad shapes are errors that name the problem, not launches.
        let x = Tensor::zeros([9, 1024], (Kind::BFloat16, dev));
        let w = Tensor::zeros([256, 1024], (Kind::BFloat16, dev));
        let mut y = Tensor::zeros([9, 256], (Kind::BFloat16, dev));
        let e = gemv(&x, &w, &mut y, false).expect_err("9 rows");
        assert!(e.to_string().contains("at most 8 rows"), "{e}");
    }
}
