// libtorch's Kineto profiler (what torch.profiler drives from Python) for Rust callers:
// tch does not expose it, and on the GPU machines it is the only profiler there is (no
// nsys; CUPTI works through Kineto). One call enables it on the calling thread, the other
// disables it there and writes the Chrome trace. CPU activities are the aten ops the
// calling thread (and threads inheriting its thread-local state) records; CUDA activities
// come from CUPTI, for the whole process.
// Every function catches C++ exceptions and returns non-zero with the message kept for
// manta_torch_profiler_last_error().
#include "guarded.hpp"
#include <torch/csrc/autograd/profiler_kineto.h>

#include <set>
#include <stdexcept>
#include <string>

namespace {
using manta::guarded;
using manta::last_error;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

std::set<ActivityType> activities(bool cuda) {
  std::set<ActivityType> out{ActivityType::CPU};
  if (cuda) out.insert(ActivityType::CUDA);
  return out;
}

ProfilerConfig config() {
  // Input shapes tell one GEMM from another in the trace; stacks, memory and FLOP
  // counts would slow the profiled work more than they help here.
  return ProfilerConfig(ProfilerState::KINETO, /*report_input_shapes=*/true);
}
}  // namespace

extern "C" {

const char* manta_torch_profiler_last_error() { return last_error().c_str(); }

// Prepares and enables the profiler on this thread; with `cuda` CUPTI records the
// device's kernels, copies and runtime calls too.
int manta_torch_profiler_start(int cuda) {
  return guarded([&] {
    const auto acts = activities(cuda != 0);
    torch::autograd::profiler::prepareProfiler(config(), acts);
    torch::autograd::profiler::enableProfiler(config(), acts);
  });
}

// Disables the profiler this thread enabled and writes its Chrome trace to `path`.
int manta_torch_profiler_finish(const char* path) {
  return guarded([&] {
    auto result = torch::autograd::profiler::disableProfiler();
    if (!result) throw std::runtime_error("the profiler returned no result");
    result->save(std::string(path));
  });
}

// Disables the profiler this thread enabled and drops its result (the profiled work
// failed; the next profile must be able to start).
int manta_torch_profiler_discard() {
  return guarded([&] { torch::autograd::profiler::disableProfiler(); });
}
}
