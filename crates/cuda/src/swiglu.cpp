// The decoder MLP's `silu(gate) * up` (swiglu.cu.inc) as a libtorch autograd function: one
// kernel forward and one backward (both gradients), where ATen takes two forward and three
// backward. Every function catches C++ exceptions and returns non-zero with the message kept
// for manta_cuda_last_error().
#include "guarded.hpp"
#include <cstdint>
#include <string>

#ifdef MANTA_WITH_CUDA
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <algorithm>

#include "plain_kernel.hpp"

namespace {

constexpr int64_t kThreads = 256;  // SG_THREADS

void check_same(const at::Tensor& t, const at::Tensor& like, const char* what) {
  TORCH_CHECK(t.is_cuda() && (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf), what,
              " must be a bf16 or fp16 CUDA tensor, is ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.sizes() == like.sizes() && t.scalar_type() == like.scalar_type() && t.device() == like.device(),
              what, " must be ", like.sizes(), " ", like.scalar_type(), " on ", like.device(), " as the gate is, got ",
              t.sizes(), " ", t.scalar_type(), " on ", t.device());
}

// The forward (h) or backward (dg, du) kernel over contiguous copies of the inputs.
std::vector<at::Tensor> run_swiglu(const char* source, const at::Tensor& g_in, const at::Tensor& u_in,
                                   const at::Tensor* dh_in) {
  const at::Tensor g = g_in.contiguous(), u = u_in.contiguous();
  const at::Tensor dh = dh_in != nullptr ? dh_in->contiguous() : at::Tensor();
  at::Tensor out = at::empty_like(g, at::MemoryFormat::Contiguous);
  at::Tensor out2 = dh_in != nullptr ? at::empty_like(g, at::MemoryFormat::Contiguous) : at::Tensor();
  const int64_t n = g.numel();
  if (n == 0) return dh_in != nullptr ? std::vector<at::Tensor>{out, out2} : std::vector<at::Tensor>{out};
  auto aligned = [](const at::Tensor& t) {
    return !t.defined() || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  const bool wide = n % 8 == 0 && aligned(g) && aligned(u) && aligned(dh) && aligned(out) && aligned(out2);
  const int64_t per_thread = wide ? 8 : 1;
  const int64_t blocks = std::min<int64_t>((n / per_thread + kThreads - 1) / kThreads, int64_t{1} << 20);
  const void* gp = g.data_ptr();
  const void* up = u.data_ptr();
  const void* dp = dh.defined() ? dh.data_ptr() : nullptr;
  void* op = out.data_ptr();
  void* op2 = out2.defined() ? out2.data_ptr() : nullptr;
  long long n_ll = n;
  void* args[] = {&gp, &up, &dp, &op, &op2, &n_ll};
  const std::string name = std::string(dh_in != nullptr ? "swiglu_bwd_" : "swiglu_fwd_") +
                           (g.scalar_type() == at::kHalf ? "f16" : "bf16") + (wide ? "_v8" : "_v1");
  manta::launch_plain_kernel(source, name.c_str(), g.get_device(), static_cast<unsigned>(blocks),
                             static_cast<unsigned>(kThreads), args);
  return dh_in != nullptr ? std::vector<at::Tensor>{out, out2} : std::vector<at::Tensor>{out};
}

// h = silu(g) · u with the gate and up both differentiable. `source`: the kernels'
// NUL-terminated source (a static of the Rust side), as an integer so autograd passes it
// through.
struct SwigluFunction : public torch::autograd::Function<SwigluFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& g, const at::Tensor& u,
                            int64_t source) {
    ctx->save_for_backward({g, u});
    ctx->saved_data["source"] = source;
    return run_swiglu(reinterpret_cast<const char*>(source), g, u, nullptr)[0];
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto* source = reinterpret_cast<const char*>(ctx->saved_data["source"].toInt());
    check_same(grads[0], saved[0], "the gated activation's output gradient");
    auto both = run_swiglu(source, saved[0], saved[1], &grads[0]);
    return {both[0], both[1], at::Tensor()};
  }
};

}  // namespace
#endif

extern "C" {

// silu(gate) · up (swiglu.cu.inc) as a new tensor in *out whose autograd graph (when either
// requires grad) runs the backward kernel.
int manta_swiglu(const char* source, void* gate_, void* up_, void** out) {
#ifdef MANTA_WITH_CUDA
  return manta::guarded([&] {
    const at::Tensor& gate = *static_cast<at::Tensor*>(gate_);
    const at::Tensor& up = *static_cast<at::Tensor*>(up_);
    check_same(gate, gate, "the gate");
    check_same(up, gate, "up");
    *out = new at::Tensor(SwigluFunction::apply(gate, up, reinterpret_cast<int64_t>(source)));
  });
#else
  (void)source; (void)gate_; (void)up_; (void)out;
  manta::last_error() = "built without CUDA";
  return 1;
#endif
}

}  // extern "C"
