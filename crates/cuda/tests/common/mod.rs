//! Helpers the fused-kernel GPU tests share (rope.rs, rms_norm.rs, swiglu.rs).

use tch::{Device, Kind, Tensor};

/// The test GPU, or None (and a "skipped" line) without one.
pub fn gpu() -> Option<Device> {
    let Some(index) = manta_cuda::test_gpu() else {
        eprintln!("skipped: no CUDA device (the device machine runs this)");
        return None;
    };
    Some(Device::Cuda(index))
}

/// The 16-bit kind's unit roundoff (2^-8 bf16, 2^-11 fp16).
#[allow(dead_code)] // not every test file uses it
pub fn unit(kind: Kind) -> f64 {
    if kind == Kind::Half {
        2f64.powi(-11)
    } else {
        2f64.powi(-8)
    }
}

/// A contiguous copy of `values` whose data starts 2 bytes past a 16-byte boundary (the
/// kernels' unaligned path).
pub fn misaligned(values: &Tensor) -> Tensor {
    let n = values.numel() as i64;
    let buffer = Tensor::zeros([n + 1], (values.kind(), values.device()));
    let t = buffer.narrow(0, 1, n).view(values.size().as_slice());
    t.shallow_clone().copy_(values);
    assert!(t.is_contiguous());
    t
}

/// The largest element of `t`, as an f64.
#[allow(dead_code)] // not every test file uses it
pub fn max(t: &Tensor) -> f64 {
    t.max().double_value(&[])
}
