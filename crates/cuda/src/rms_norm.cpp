// The decoder's RMSNorm with Hugging Face's rounding (rms_norm.cu.inc) as a libtorch autograd
// function: one kernel forward, two backward (dx with the CTAs' dw partials, then their sum),
// where ATen's rms_norm, broadcast multiply, their gradients and a reduction over rows took
// four passes or more. Every function catches C++ exceptions and returns non-zero with the
// message kept for manta_cuda_last_error().
#include "guarded.hpp"
#include <cstdint>
#include <string>

#ifdef MANTA_WITH_CUDA
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/csrc/autograd/custom_function.h>
#include <algorithm>

#include "plain_kernel.hpp"

namespace {

constexpr int64_t kThreads = 256;   // RN_THREADS
constexpr int64_t kMaxDim = 8192;   // RN_THREADS · 8 · 4 (the widest kernel)

bool aligned(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// `t` as it is when 16-byte aligned, else an aligned copy (a narrowed view can start
// anywhere; the kernels load 8 elements at once).
at::Tensor aligned_copy(const at::Tensor& t) { return aligned(t) ? t : t.clone(at::MemoryFormat::Contiguous); }

void check_norm(const at::Tensor& x, const at::Tensor& w, const char* what) {
  TORCH_CHECK(x.is_cuda() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf), what,
              " must be a bf16 or fp16 CUDA tensor, is ", x.scalar_type(), " on ", x.device());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), what, " must be contiguous [rows, dim], is ", x.sizes(),
              x.is_contiguous() ? "" : " (not contiguous)");
  const int64_t dim = x.size(1);
  TORCH_CHECK(dim > 0 && dim % 8 == 0 && dim <= kMaxDim, "the fused RMSNorm takes dim a multiple of 8 up to ",
              kMaxDim, ", got ", dim);
  TORCH_CHECK(w.device() == x.device() && w.scalar_type() == x.scalar_type() && w.dim() == 1 && w.size(0) == dim &&
                  w.is_contiguous(),
              "the norm's weight must be a contiguous [", dim, "] ", x.scalar_type(), " tensor on ", x.device(),
              ", got ", w.sizes(), " ", w.scalar_type(), " on ", w.device());
}

// Chunks of 8 a thread (C) and threads a row (a power of two) for `dim`.
struct Shape {
  int64_t c, tpr;
};
Shape shape_of(int64_t dim) {
  const int64_t chunks = dim / 8;
  const int64_t c = chunks <= kThreads ? 1 : chunks <= 2 * kThreads ? 2 : 4;
  int64_t tpr = 1;
  while (tpr * c < chunks) tpr *= 2;
  return {c, std::min(tpr, kThreads)};
}

std::string kernel_name(const char* what, const at::Tensor& x, int64_t c) {
  return std::string("rms_norm_") + what + (x.scalar_type() == at::kHalf ? "_f16" : "_bf16") + "_c" +
         std::to_string(c);
}

// y [rows, dim] and rstd [rows] (fp32) of x [rows, dim].
std::pair<at::Tensor, at::Tensor> run_forward(const char* source, const at::Tensor& x_in, const at::Tensor& w_in,
                                              double eps) {
  const at::Tensor x = aligned_copy(x_in), w = aligned_copy(w_in);
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t rows = x.size(0), dim = x.size(1);
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  if (rows == 0) return {y, rstd};
  const Shape s = shape_of(dim);
  const int64_t groups = kThreads / s.tpr;
  const int64_t blocks = std::min<int64_t>((rows + groups - 1) / groups, int64_t{1} << 20);
  const void* xp = x.data_ptr();
  const void* wp = w.data_ptr();
  void* yp = y.data_ptr();
  void* rp = rstd.data_ptr();
  long long rows_ll = rows;
  int dim_i = static_cast<int>(dim), tpr_i = static_cast<int>(s.tpr);
  float eps_f = static_cast<float>(eps);
  void* args[] = {&xp, &wp, &yp, &rp, &rows_ll, &dim_i, &tpr_i, &eps_f};
  manta::launch_plain_kernel(source, kernel_name("fwd", x, s.c).c_str(), x.get_device(),
                             static_cast<unsigned>(blocks), static_cast<unsigned>(kThreads), args);
  return {y, rstd};
}

// dx [rows, dim] and dw [dim] for the output gradient dy.
std::pair<at::Tensor, at::Tensor> run_backward(const char* source, const at::Tensor& dy_in, const at::Tensor& x,
                                               const at::Tensor& w, const at::Tensor& rstd) {
  const at::Tensor dy = aligned_copy(dy_in.contiguous());
  const int64_t rows = x.size(0), dim = x.size(1);
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (rows == 0) return {dx, at::zeros_like(w)};
  const Shape s = shape_of(dim);
  const int64_t groups = kThreads / s.tpr;
  // Two CTAs an SM at most: each writes one fp32 partial row of dw.
  const int64_t sms = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(x.get_device()))->multiProcessorCount;
  const int64_t blocks = std::min<int64_t>((rows + groups - 1) / groups, 2 * sms);
  at::Tensor part = at::empty({blocks, dim}, x.options().dtype(at::kFloat));
  at::Tensor dw = at::empty_like(w, at::MemoryFormat::Contiguous);
  const void* dyp = dy.data_ptr();
  const void* xp = x.data_ptr();
  const void* wp = w.data_ptr();
  const void* rp = rstd.data_ptr();
  void* dxp = dx.data_ptr();
  void* pp = part.data_ptr();
  void* dwp = dw.data_ptr();
  long long rows_ll = rows;
  int dim_i = static_cast<int>(dim), tpr_i = static_cast<int>(s.tpr), parts_i = static_cast<int>(blocks);
  void* args[] = {&dyp, &xp, &wp, &rp, &dxp, &pp, &rows_ll, &dim_i, &tpr_i};
  manta::launch_plain_kernel(source, kernel_name("bwd", x, s.c).c_str(), x.get_device(),
                             static_cast<unsigned>(blocks), static_cast<unsigned>(kThreads), args);
  void* dw_args[] = {&pp, &dwp, &parts_i, &dim_i};
  const std::string dw_name = std::string("rms_norm_dw") + (x.scalar_type() == at::kHalf ? "_f16" : "_bf16");
  manta::launch_plain_kernel(source, dw_name.c_str(), x.get_device(),
                             static_cast<unsigned>((dim + kThreads - 1) / kThreads), static_cast<unsigned>(kThreads),
                             dw_args);
  return {dx, dw};
}

// y = R(R(rms_norm(x)) · w); x and w both get gradients. `source`: the kernels'
// NUL-terminated source (a static of the Rust side), as an integer so autograd passes it
// through.
struct RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            double eps, int64_t source) {
    auto [y, rstd] = run_forward(reinterpret_cast<const char*>(source), x, w, eps);
    ctx->save_for_backward({x, w, rstd});
    ctx->saved_data["source"] = source;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto* source = reinterpret_cast<const char*>(ctx->saved_data["source"].toInt());
    const at::Tensor& x = saved[0];
    const at::Tensor dy = grads[0].contiguous();
    TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type() && dy.device() == x.device(),
                "the RMSNorm output's gradient must be ", x.sizes(), " ", x.scalar_type(), " on ", x.device(),
                ", got ", dy.sizes(), " ", dy.scalar_type(), " on ", dy.device());
    auto [dx, dw] = run_backward(source, dy, aligned_copy(x), aligned_copy(saved[1]), saved[2]);
    return {dx, dw, at::Tensor(), at::Tensor()};
  }
};

}  // namespace
#endif

extern "C" {

// The RMSNorm of x [rows, dim] with weight w [dim] (rms_norm.cu.inc), as a new tensor in *out
// whose autograd graph (when x or w requires grad) runs the backward kernels.
int manta_rms_norm(const char* source, void* x_, void* w_, double eps, void** out) {
#ifdef MANTA_WITH_CUDA
  return manta::guarded([&] {
    const at::Tensor& x = *static_cast<at::Tensor*>(x_);
    const at::Tensor& w = *static_cast<at::Tensor*>(w_);
    check_norm(x, w, "x");
    TORCH_CHECK(eps >= 0.0, "the norm's eps must not be negative, got ", eps);
    *out = new at::Tensor(RmsNormFunction::apply(x, w, eps, reinterpret_cast<int64_t>(source)));
  });
#else
  (void)source; (void)x_; (void)w_; (void)eps; (void)out;
  manta::last_error() = "built without CUDA";
  return 1;
#endif
}

}  // extern "C"
