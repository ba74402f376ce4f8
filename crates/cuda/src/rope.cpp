// The trainer's fused rotary embedding (rope.cu.inc) as a libtorch autograd function: the
// forward kernel's output carries a graph node whose backward runs the backward kernel, so
// the decoder's q and k go through one kernel each way instead of ATen's chain of strided
// element-wise ops. Every function catches C++ exceptions and returns non-zero with the
// message kept for manta_cuda_last_error().
#include "guarded.hpp"
#include <cstdint>
#include <string>

#ifdef MANTA_WITH_CUDA
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <algorithm>

#include "plain_kernel.hpp"

namespace {

constexpr int64_t kThreads = 256;  // RP_THREADS

// x [rows, heads, hd] and the tables [rows, hd]: contiguous, one 16-bit kind, one CUDA
// device, hd even.
void check_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const char* what) {
  TORCH_CHECK(x.is_cuda() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf),
              what, " must be a bf16 or fp16 CUDA tensor, is ", x.scalar_type(), " on ", x.device());
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous(), what, " must be contiguous [rows, heads, head_dim], is ",
              x.sizes(), x.is_contiguous() ? "" : " (not contiguous)");
  const int64_t rows = x.size(0), hd = x.size(2);
  TORCH_CHECK(hd % 2 == 0, "head_dim must be even, is ", hd);
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->device() == x.device() && t->scalar_type() == x.scalar_type() && t->is_contiguous() &&
                    t->dim() == 2 && t->size(0) == rows && t->size(1) == hd,
                "cos and sin must be contiguous [", rows, ", ", hd, "] ", x.scalar_type(), " tensors on ",
                x.device(), ", got ", t->sizes(), " ", t->scalar_type(), " on ", t->device());
  }
  TORCH_CHECK(x.size(1) <= INT32_MAX && hd <= INT32_MAX, "heads and head_dim must fit 32 bits");
}

// The forward (or, `backward`, the gradient) kernel over `in` into a new tensor like it.
at::Tensor run_rope(const char* source, bool backward, const at::Tensor& in, const at::Tensor& cos,
                    const at::Tensor& sin) {
  at::Tensor out = at::empty_like(in, at::MemoryFormat::Contiguous);
  const int64_t rows = in.size(0), heads = in.size(1), hd = in.size(2);
  if (in.numel() == 0) return out;
  const bool half = in.scalar_type() == at::kHalf;
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const void* ip = in.data_ptr();
  const void* cp = cos.data_ptr();
  const void* sp = sin.data_ptr();
  void* op = out.data_ptr();
  const bool wide = (hd / 2) % 8 == 0 && aligned(ip) && aligned(cp) && aligned(sp) && aligned(op);
  const int64_t per_thread = wide ? 8 : 1;
  const int64_t items = rows * heads * (hd / 2 / per_thread);
  // Threads stride over the items past this many blocks (far more than fill any GPU).
  const int64_t blocks = std::min<int64_t>((items + kThreads - 1) / kThreads, int64_t{1} << 20);
  long long rows_ll = rows;
  int heads_i = static_cast<int>(heads), hd_i = static_cast<int>(hd);
  void* args[] = {&ip, &cp, &sp, &op, &rows_ll, &heads_i, &hd_i};
  std::string name = std::string(backward ? "rope_bwd_" : "rope_fwd_") + (half ? "f16" : "bf16") +
                     (wide ? "_v8" : "_v1");
  manta::launch_plain_kernel(source, name.c_str(), in.get_device(), static_cast<unsigned>(blocks),
                             static_cast<unsigned>(kThreads), args);
  return out;
}

// out = x·cos + rotate_half(x)·sin; cos and sin are constants (no gradient). `source`: the
// kernels' NUL-terminated source (a static of the Rust side), as an integer so autograd
// passes it through.
struct RopeFunction : public torch::autograd::Function<RopeFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin, int64_t source) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["source"] = source;
    return run_rope(reinterpret_cast<const char*>(source), false, x, cos, sin);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto* source = reinterpret_cast<const char*>(ctx->saved_data["source"].toInt());
    const at::Tensor g = grads[0].contiguous();
    check_rope(g, saved[0], saved[1], "the rotary embedding's output gradient");
    return {run_rope(source, true, g, saved[0], saved[1]), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace
#endif

extern "C" {

// The rotary embedding of x [rows, heads, hd] with cos and sin [rows, hd] (rope.cu.inc), as
// a new tensor in *out whose autograd graph (when x requires grad) runs the backward kernel.
int manta_rope(const char* source, void* x_, void* cos_, void* sin_, void** out) {
#ifdef MANTA_WITH_CUDA
  return manta::guarded([&] {
    const at::Tensor& x = *static_cast<at::Tensor*>(x_);
    const at::Tensor& cos = *static_cast<at::Tensor*>(cos_);
    const at::Tensor& sin = *static_cast<at::Tensor*>(sin_);
    check_rope(x, cos, sin, "x");
    TORCH_CHECK(!cos.requires_grad() && !sin.requires_grad(),
                "cos and sin must not require grad (the fused rotary embedding gives them none)");
    *out = new at::Tensor(RopeFunction::apply(x, cos, sin, reinterpret_cast<int64_t>(source)));
  });
#else
  (void)source; (void)x_; (void)cos_; (void)sin_; (void)out;
  manta::last_error() = "built without CUDA";
  return 1;
#endif
}

}  // extern "C"
