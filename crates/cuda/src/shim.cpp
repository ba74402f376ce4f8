// CUDA graphs and memory info for tch callers. Every function catches C++ exceptions and
// returns non-zero with the message kept for manta_cuda_last_error().
#include <cstddef>
#include <cstring>
#include <optional>
#include <string>

// Only functions exported by libtorch_cuda / libc10_cuda are called (no CUDA runtime
// calls of our own), so binaries need no direct link to libcudart.
#ifdef MANTA_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ATen.h>
#include <cuda.h>
#include <dlfcn.h>
#include <nvrtc.h>
#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>
// From ATen/cuda/CUDAContextLight.h, whose other includes need more CUDA headers than the
// pip wheels ship.
namespace at::cuda {
cudaDeviceProp* getDeviceProperties(c10::DeviceIndex device);
}
#endif

namespace {
thread_local std::string last_error;

template <typename F>
int guarded(F f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
  } catch (...) {
    last_error = "unknown C++ exception";
  }
  return 1;
}

#ifdef MANTA_WITH_CUDA
#define MANTA_SYM(lib, name)                                               \
  auto name##_fn = reinterpret_cast<decltype(&name)>(dlsym(lib, #name)); \
  TORCH_CHECK(name##_fn != nullptr, "missing symbol " #name)

// NVRTC from the wheel beside torch (site-packages/torch/lib -> site-packages/nvidia/cu13/lib),
// with its builtins library loaded first (NVRTC looks it up by name and fails otherwise).
void* load_nvrtc() {
  static void* nvrtc = nullptr;
  if (nvrtc != nullptr) return nvrtc;
  std::string dir;
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&at::cuda::getDeviceProperties), &info) && info.dli_fname) {
    std::string lib(info.dli_fname);
    dir = lib.substr(0, lib.rfind('/')) + "/../../nvidia/cu13/lib/";
  }
  if (!dir.empty()) dlopen((dir + "libnvrtc-builtins.so.13.0").c_str(), RTLD_NOW | RTLD_GLOBAL);
  nvrtc = dlopen("libnvrtc.so.13", RTLD_NOW | RTLD_GLOBAL);
  if (nvrtc == nullptr && !dir.empty()) nvrtc = dlopen((dir + "libnvrtc.so.13").c_str(), RTLD_NOW | RTLD_GLOBAL);
  TORCH_CHECK(nvrtc != nullptr, "cannot load libnvrtc.so.13 (NVRTC, from the nvidia-cuda-nvrtc wheel)");
  return nvrtc;
}

// The kernel for one shape, as a CUBIN for sm_<arch>.
std::string compile_paged_attention(const char* source, int64_t hd, int rep, int64_t nkv, int warps, int arch) {
  void* nvrtc = load_nvrtc();
  MANTA_SYM(nvrtc, nvrtcCreateProgram);
  MANTA_SYM(nvrtc, nvrtcCompileProgram);
  MANTA_SYM(nvrtc, nvrtcGetProgramLogSize);
  MANTA_SYM(nvrtc, nvrtcGetProgramLog);
  MANTA_SYM(nvrtc, nvrtcGetCUBINSize);
  MANTA_SYM(nvrtc, nvrtcGetCUBIN);
  MANTA_SYM(nvrtc, nvrtcDestroyProgram);
  MANTA_SYM(nvrtc, nvrtcGetErrorString);
  std::string src = "#define HD " + std::to_string(hd) + "\n#define REP " + std::to_string(rep) +
                    "\n#define NKV " + std::to_string(nkv) + "\n#define WARPS " + std::to_string(warps) +
                    "\n" + source;
  nvrtcProgram prog;
  TORCH_CHECK(nvrtcCreateProgram_fn(&prog, src.c_str(), "paged_attention.cu", 0, nullptr, nullptr) ==
                  NVRTC_SUCCESS,
              "nvrtcCreateProgram failed");
  std::string arch_flag = "--gpu-architecture=sm_" + std::to_string(arch);
  // NVRTC optimises by default and takes no -O flag (an unknown option fails the compile).
  const char* opts[] = {arch_flag.c_str(), "--std=c++17"};
  nvrtcResult rc = nvrtcCompileProgram_fn(prog, 2, opts);
  if (rc != NVRTC_SUCCESS) {
    size_t n = 0;
    nvrtcGetProgramLogSize_fn(prog, &n);
    std::string log(n, '\0');
    nvrtcGetProgramLog_fn(prog, log.data());
    nvrtcDestroyProgram_fn(&prog);
    throw std::runtime_error(std::string("NVRTC compile of the paged attention kernel failed (") +
                             nvrtcGetErrorString_fn(rc) + "): " + log);
  }
  size_t n = 0;
  nvrtcGetCUBINSize_fn(prog, &n);
  std::string cubin(n, '\0');
  nvrtcGetCUBIN_fn(prog, cubin.data());
  nvrtcDestroyProgram_fn(&prog);
  return cubin;
}

struct Graph {
  at::cuda::CUDAGraph graph;
  // The stream that was current before capture, restored after it.
  std::optional<c10::cuda::CUDAStream> previous;
};
#endif
}  // namespace

extern "C" {

const char* manta_cuda_last_error() { return last_error.c_str(); }

int manta_cuda_built_with_cuda() {
#ifdef MANTA_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

int manta_cuda_total_memory(int device, size_t* total_bytes) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    *total_bytes = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(device))->totalGlobalMem;
  });
#else
  last_error = "built without CUDA";
  return 1;
#endif
}

void* manta_graph_new() {
#ifdef MANTA_WITH_CUDA
  Graph* g = nullptr;
  if (guarded([&] { g = new Graph(); })) return nullptr;
  return g;
#else
  last_error = "built without CUDA";
  return nullptr;
#endif
}

// Starts capturing on a side stream of `device` (capture cannot use the default stream).
// `share_pool_with` (may be null) is a captured graph whose memory pool this one shares.
int manta_graph_capture_begin(void* g, int device, void* share_pool_with) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    auto* graph = static_cast<Graph*>(g);
    auto index = static_cast<c10::DeviceIndex>(device);
    c10::cuda::set_device(index);
    graph->previous.emplace(c10::cuda::getCurrentCUDAStream(index));
    c10::cuda::setCurrentCUDAStream(c10::cuda::getStreamFromPool(false, index));
    if (share_pool_with != nullptr) {
      graph->graph.capture_begin(static_cast<Graph*>(share_pool_with)->graph.pool(),
                                 cudaStreamCaptureModeThreadLocal);
    } else {
      // Thread-local: CUDA work of other threads (a trainer in the same process) does not
      // invalidate the capture.
      graph->graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    }
  });
#else
  last_error = "built without CUDA";
  return 1;
#endif
}

int manta_graph_capture_end(void* g) {
#ifdef MANTA_WITH_CUDA
  auto* graph = static_cast<Graph*>(g);
  int rc = guarded([&] { graph->graph.capture_end(); });
  if (graph->previous) {
    guarded([&] { c10::cuda::setCurrentCUDAStream(*graph->previous); });
    graph->previous.reset();
  }
  return rc;
#else
  last_error = "built without CUDA";
  return 1;
#endif
}

int manta_graph_replay(void* g) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] { static_cast<Graph*>(g)->graph.replay(); });
#else
  last_error = "built without CUDA";
  return 1;
#endif
}

void manta_graph_free(void* g) {
#ifdef MANTA_WITH_CUDA
  guarded([&] { delete static_cast<Graph*>(g); });
#endif
}


// Paged decode attention (src/paged_attention.cu.inc, passed in as `source`): compiled
// once per shape with NVRTC and launched with the driver API on the current stream, so a
// CUDA graph capturing the step captures it too. NVRTC and the driver are dlopen'ed:
// nothing here links against them.
int manta_paged_decode_attention(const char* source, void* q_, void* kp_, void* vp_,
                                 void* tables_, void* lens_, void* out_, int block_size,
                                 float scale) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    const at::Tensor& q = *static_cast<at::Tensor*>(q_);
    const at::Tensor& kp = *static_cast<at::Tensor*>(kp_);
    const at::Tensor& vp = *static_cast<at::Tensor*>(vp_);
    const at::Tensor& tables = *static_cast<at::Tensor*>(tables_);
    const at::Tensor& lens = *static_cast<at::Tensor*>(lens_);
    at::Tensor& out = *static_cast<at::Tensor*>(out_);
    TORCH_CHECK(q.is_cuda() && q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.is_contiguous(),
                "q must be a contiguous bf16 CUDA tensor [B, heads, head_dim]");
    TORCH_CHECK(kp.dim() == 3 && kp.scalar_type() == at::kBFloat16 && kp.is_contiguous() &&
                    vp.sizes() == kp.sizes() && vp.scalar_type() == at::kBFloat16 && vp.is_contiguous(),
                "pools must be contiguous bf16 [slots, kv_heads, head_dim]");
    TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kInt && tables.is_contiguous() &&
                    tables.size(0) == q.size(0),
                "block tables must be contiguous int32 [B, max_blocks]");
    TORCH_CHECK(lens.dim() == 1 && lens.scalar_type() == at::kInt && lens.size(0) == q.size(0),
                "lengths must be int32 [B]");
    TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kBFloat16 && out.is_contiguous(),
                "out must be like q");
    const int64_t hd = q.size(2), nkv = kp.size(1), nh = q.size(1);
    TORCH_CHECK(kp.size(2) == hd && hd % 32 == 0 && hd <= 256, "head_dim must be a multiple of 32, at most 256");
    TORCH_CHECK(nh % nkv == 0 && nh / nkv <= 8, "query heads per kv head must be at most 8");
    const int rep = static_cast<int>(nh / nkv);
    const int warps = 8;
    const int device = q.get_device();

    static std::mutex mu;
    static void* driver = nullptr;
    static std::map<std::tuple<int, int64_t, int, int64_t>, CUfunction> kernels;
    std::lock_guard<std::mutex> lock(mu);
    if (driver == nullptr) {
      driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
      TORCH_CHECK(driver != nullptr, "cannot load libcuda.so.1: ", dlerror());
    }
    MANTA_SYM(driver, cuLaunchKernel);
    auto key = std::make_tuple(device, hd, rep, nkv);
    auto found = kernels.find(key);
    CUfunction fn;
    if (found != kernels.end()) {
      fn = found->second;
    } else {
      MANTA_SYM(driver, cuModuleLoadData);
      MANTA_SYM(driver, cuModuleGetFunction);
      auto* props = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(device));
      std::string cubin = compile_paged_attention(source, hd, rep, nkv, warps, props->major * 10 + props->minor);
      CUmodule module;
      TORCH_CHECK(cuModuleLoadData_fn(&module, cubin.data()) == CUDA_SUCCESS, "cuModuleLoadData failed");
      TORCH_CHECK(cuModuleGetFunction_fn(&fn, module, "paged_decode_attention") == CUDA_SUCCESS,
                  "cuModuleGetFunction failed");
      kernels.emplace(key, fn);
    }
    const void* qp = q.data_ptr();
    const void* kpp = kp.data_ptr();
    const void* vpp = vp.data_ptr();
    const void* tp = tables.data_ptr();
    const void* lp = lens.data_ptr();
    void* op = out.data_ptr();
    int max_blocks = static_cast<int>(tables.size(1));
    void* args[] = {&qp, &kpp, &vpp, &tp, &lp, &op, &max_blocks, &block_size, &scale};
    auto stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
    CUresult launched = cuLaunchKernel_fn(fn, static_cast<unsigned>(nkv), static_cast<unsigned>(q.size(0)), 1,
                                          warps * 32, 1, 1, 0, reinterpret_cast<CUstream>(stream), args,
                                          nullptr);
    TORCH_CHECK(launched == CUDA_SUCCESS, "cuLaunchKernel failed with CUresult ", static_cast<int>(launched));
  });
#else
  last_error = "built without CUDA";
  return 1;
#endif
}

// Compiles the kernel for one shape and architecture without a GPU (NVRTC needs none), so
// CPU test machines catch what would fail on the device.
int manta_paged_attention_compile_check(const char* source, int hd, int rep, int nkv, int arch) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] { compile_paged_attention(source, hd, rep, nkv, 8, arch); });
#else
  last_error = "built without CUDA";
  return 1;
#endif
}
}
