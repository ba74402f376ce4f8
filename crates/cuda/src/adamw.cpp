// AdamW over fp32 master weights through ATen's multi-tensor `_fused_adamw_` (what
// torch.optim.AdamW(fused=True) runs), which tch does not expose: one pass over masters,
// gradients and moments per group of tensors instead of a chain of element-wise kernels
// per parameter. Gradients (bf16) are widened to fp32 a group at a time, so the temporary
// copy stays small; the low-precision parameters are then refreshed from the masters.
// Works on the CPU and on CUDA. Every function catches C++ exceptions and returns non-zero
// with the message kept for manta_adamw_last_error().
#include "guarded.hpp"
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

namespace {
const at::Tensor& as_tensor(void* p) { return *static_cast<at::Tensor*>(p); }
}  // namespace

extern "C" {

const char* manta_adamw_last_error() { return manta::last_error().c_str(); }

// `param.grad = None`: frees a gradient the optimizer no longer needs (ZeRO-2 keeps only
// its shard of the reduced gradients); the next backward pass allocates a new one.
int manta_clear_grad(void* param) {
  return manta::guarded([&] { static_cast<at::Tensor*>(param)->mutable_grad().reset(); });
}

// params[i] (any floating kind) is refreshed from masters[i] (fp32) after the update;
// grads[i] has params[i]'s kind; exp_avgs/exp_avg_sqs are fp32. `step` is the step number
// after this update (from 1). Tensors are taken in groups of at most `group_elems`
// elements (the largest tensor alone when it is bigger), which bounds the fp32 copy of
// the gradients.
int manta_fused_adamw_masters(void** params, void** grads, void** masters, void** exp_avgs,
                              void** exp_avg_sqs, int n, double step, double lr, double beta1,
                              double beta2, double weight_decay, double eps,
                              int64_t group_elems) {
  return manta::guarded([&] {
    c10::NoGradGuard no_grad;
    int start = 0;
    while (start < n) {
      int end = start;
      int64_t elems = 0;
      while (end < n && (end == start || elems + as_tensor(masters[end]).numel() <= group_elems)) {
        elems += as_tensor(masters[end]).numel();
        ++end;
      }
      std::vector<at::Tensor> m, g, a, s, steps;
      const auto& first = as_tensor(masters[start]);
      auto step_t = at::full({}, step, first.options().dtype(at::kFloat));
      for (int i = start; i < end; ++i) {
        m.push_back(as_tensor(masters[i]));
        g.push_back(as_tensor(grads[i]).to(at::kFloat));
        a.push_back(as_tensor(exp_avgs[i]));
        s.push_back(as_tensor(exp_avg_sqs[i]));
        steps.push_back(step_t);
      }
      at::_fused_adamw_(m, g, a, s, {}, steps, lr, beta1, beta2, weight_decay, eps,
                        /*amsgrad=*/false, /*maximize=*/false);
      for (int i = start; i < end; ++i) {
        auto p = as_tensor(params[i]);
        p.copy_(m[i - start]);
      }
      start = end;
    }
  });
}

// The gradient list's Σ ||g||² in fp64 as a new 0-d tensor in *out, each tensor's norm
// accumulated in fp32 by ATen's multi-tensor `_foreach_norm` (one launch for the list, where
// a norm per parameter is four launches and the host's turn between them).
int manta_foreach_sq_norm(void** tensors, int n, void** out) {
  return manta::guarded([&] {
    c10::NoGradGuard no_grad;
    TORCH_CHECK(n > 0, "the gradient norm needs at least one tensor");
    std::vector<at::Tensor> ts;
    for (int i = 0; i < n; ++i) ts.push_back(as_tensor(tensors[i]));
    const auto norms = at::_foreach_norm(ts, 2, at::kFloat);
    *out = new at::Tensor(at::stack(norms).to(at::kDouble).square().sum());
  });
}

// Every tensor of the list multiplied in place by `scale` (one multi-tensor launch).
int manta_foreach_scale_(void** tensors, int n, double scale) {
  return manta::guarded([&] {
    c10::NoGradGuard no_grad;
    std::vector<at::Tensor> ts;
    for (int i = 0; i < n; ++i) ts.push_back(as_tensor(tensors[i]));
    at::_foreach_mul_(ts, scale);
  });
}

// Every tensor of the list set to zero in place (one multi-tensor launch).
int manta_foreach_zero_(void** tensors, int n) {
  return manta::guarded([&] {
    c10::NoGradGuard no_grad;
    std::vector<at::Tensor> ts;
    for (int i = 0; i < n; ++i) ts.push_back(as_tensor(tensors[i]));
    at::_foreach_zero_(ts);
  });
}

}  // extern "C"
