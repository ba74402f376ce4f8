// CUDA graphs and memory info for tch callers. Every function catches C++ exceptions and
// returns non-zero with the message kept for manta_cuda_last_error().
#include "guarded.hpp"
#include "plain_kernel.hpp"
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <cstring>
#include <optional>
#include <string>

// Only functions exported by libtorch_cuda / libc10_cuda are called (no CUDA runtime
// calls of our own), so binaries need no direct link to libcudart.
#ifdef MANTA_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ATen.h>
#include <ATen/ops/_flash_attention_forward.h>
#include <cublasLt.h>
#include <cuda.h>
#include <dlfcn.h>
#include <nvrtc.h>
#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>
#include <algorithm>
#include <cstdint>
// From ATen/cuda/CUDAContextLight.h, whose other includes need more CUDA headers than the
// pip wheels ship.
namespace at::cuda {
cudaDeviceProp* getDeviceProperties(c10::DeviceIndex device);
cublasLtHandle_t getCurrentCUDABlasLtHandle();
void* getCUDABlasLtWorkspace();
size_t getCUDABlasLtWorkspaceSize();
}
#endif

namespace {
using manta::guarded;
using manta::last_error;

#ifdef MANTA_WITH_CUDA
#define MANTA_SYM(lib, name)                                               \
  auto name##_fn = reinterpret_cast<decltype(&name)>(dlsym(lib, #name)); \
  TORCH_CHECK(name##_fn != nullptr, "missing symbol " #name)

// Makes `device` the calling thread's current device until the scope ends. The driver API
// (module loads, launches, events) and cuBLASLt's handle act on the current device, and a
// thread may have last used another GPU (an engine on GPU 1 beside a trainer on GPU 0, a
// runtime thread that served another rank), so every entry point that touches a device
// says which one. (c10's CUDAGuard would do, but its inline code calls libcudart.)
class DeviceScope {
 public:
  explicit DeviceScope(int device)
      : previous_(c10::cuda::current_device()), device_(static_cast<c10::DeviceIndex>(device)) {
    if (previous_ != device_) c10::cuda::set_device(device_);
  }
  ~DeviceScope() {
    if (previous_ == device_) return;
    try {
      c10::cuda::set_device(previous_);
    } catch (...) {
      // The next call on this thread reports a broken device; a destructor cannot.
    }
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  c10::DeviceIndex previous_;
  c10::DeviceIndex device_;
};

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

// `source` with `defines` prepended, as a CUBIN for sm_<arch>.
std::string compile_kernels(const char* source, const std::string& defines, int arch) {
  void* nvrtc = load_nvrtc();
  MANTA_SYM(nvrtc, nvrtcCreateProgram);
  MANTA_SYM(nvrtc, nvrtcCompileProgram);
  MANTA_SYM(nvrtc, nvrtcGetProgramLogSize);
  MANTA_SYM(nvrtc, nvrtcGetProgramLog);
  MANTA_SYM(nvrtc, nvrtcGetCUBINSize);
  MANTA_SYM(nvrtc, nvrtcGetCUBIN);
  MANTA_SYM(nvrtc, nvrtcDestroyProgram);
  MANTA_SYM(nvrtc, nvrtcGetErrorString);
  std::string src = defines + source;
  nvrtcProgram prog;
  TORCH_CHECK(nvrtcCreateProgram_fn(&prog, src.c_str(), "manta_kernels.cu", 0, nullptr, nullptr) ==
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
    throw std::runtime_error(std::string("NVRTC compile failed (") + nvrtcGetErrorString_fn(rc) + ") with " +
                             defines + ": " + log);
  }
  size_t n = 0;
  nvrtcGetCUBINSize_fn(prog, &n);
  std::string cubin(n, '\0');
  nvrtcGetCUBIN_fn(prog, cubin.data());
  nvrtcDestroyProgram_fn(&prog);
  return cubin;
}

void* load_driver() {
  static void* driver = nullptr;
  if (driver == nullptr) {
    driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(driver != nullptr, "cannot load libcuda.so.1: ", dlerror());
  }
  return driver;
}

// Kernel `name` of `source` compiled with `defines` for `device`'s architecture; each
// (device, source, defines) is compiled and loaded once.
CUfunction kernel(const char* source, const std::string& defines, const char* name, int device) {
  static std::mutex mu;
  static std::map<std::string, CUmodule> modules;
  static std::map<std::string, CUfunction> functions;
  std::lock_guard<std::mutex> lock(mu);
  DeviceScope scope(device);  // the module loads into this device's context
  std::string module_key =
      std::to_string(device) + "|" + std::to_string(reinterpret_cast<uintptr_t>(source)) + "|" + defines;
  std::string function_key = module_key + "|" + name;
  auto found = functions.find(function_key);
  if (found != functions.end()) return found->second;
  void* driver = load_driver();
  MANTA_SYM(driver, cuModuleLoadData);
  MANTA_SYM(driver, cuModuleGetFunction);
  auto module = modules.find(module_key);
  if (module == modules.end()) {
    auto* props = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(device));
    std::string cubin = compile_kernels(source, defines, props->major * 10 + props->minor);
    CUmodule loaded;
    TORCH_CHECK(cuModuleLoadData_fn(&loaded, cubin.data()) == CUDA_SUCCESS, "cuModuleLoadData failed");
    module = modules.emplace(module_key, loaded).first;
  }
  CUfunction fn;
  TORCH_CHECK(cuModuleGetFunction_fn(&fn, module->second, name) == CUDA_SUCCESS, "cuModuleGetFunction failed for ",
              name);
  functions.emplace(function_key, fn);
  return fn;
}

// Kernel knobs (crates/knobs, KERNEL_KNOBS in this order): set by manta_cuda before each
// call that may read them, -1 where unset (the kernel's own default applies). Values were
// checked against what each knob takes there. Atomics: set from whichever thread calls in,
// read by the launching thread; read at every launch, so one process can capture graphs
// with several settings (bench/decode_step).
enum KnobId {
  kPdl, kPagedCtasPerSm, kPagedLanes, kPagedTt, kPagedWarps, kPagedMma, kPagedPdl, kSmallVec, kDecodeLt,
  kGemvKsplit, kGemvWarps, kGemvNormWarps, kGemvRows, kGemvNormKsplit, kGemvNormRows, kGemvSiluRows,
  kGemvDepth, kKnobCount
};
std::atomic<int64_t> g_knobs[kKnobCount] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
int64_t knob_or(KnobId id, int64_t fallback) {
  const int64_t v = g_knobs[id].load(std::memory_order_relaxed);
  return v < 0 ? fallback : v;
}

// Whether the decode kernels launch with programmatic stream serialization (programmatic
// dependent launch, sm_90+): each may start while the kernel before it finishes, overlapping
// its launch and first weight loads with that kernel's tail (bf16.cu.inc says what the
// kernels do for it). MANTA_PDL=0 turns it off, for A/B runs.
bool pdl_enabled(int device) {
  if (knob_or(kPdl, 1) == 0) return false;
  return at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(device))->major >= 9;
}

// Launches on `device`'s current stream, so a CUDA graph capturing the step captures it.
// `pdl`: the kernel waits for its predecessor with pdl_wait() before touching its data, so
// it may be launched as a programmatic dependent.
void launch(CUfunction fn, int device, unsigned gx, unsigned gy, unsigned gz, unsigned threads, void** args,
            bool pdl = false) {
  void* driver = load_driver();
  MANTA_SYM(driver, cuLaunchKernelEx);
  DeviceScope scope(device);
  auto stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  CUlaunchAttribute attribute{};
  attribute.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attribute.value.programmaticStreamSerializationAllowed = 1;
  CUlaunchConfig config{};
  config.gridDimX = gx;
  config.gridDimY = gy;
  config.gridDimZ = gz;
  config.blockDimX = threads;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.hStream = reinterpret_cast<CUstream>(stream);
  config.attrs = &attribute;
  config.numAttrs = pdl && pdl_enabled(device) ? 1 : 0;
  CUresult launched = cuLaunchKernelEx_fn(&config, fn, args, nullptr);
  TORCH_CHECK(launched == CUDA_SUCCESS, "cuLaunchKernelEx failed with CUresult ", static_cast<int>(launched), " (grid ",
              gx, "x", gy, "x", gz, ", ", threads, " threads)");
}

std::string define(const char* name, int64_t value) {
  return std::string("#define ") + name + " " + std::to_string(value) + "\n";
}

const at::Tensor& tensor(void* p) { return *static_cast<at::Tensor*>(p); }

void check_bf16(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kBFloat16 && t.is_contiguous(), what,
              " must be a contiguous bf16 CUDA tensor");
}


// Tuning knobs of the paged kernel for A/B runs (bench/decode_step): lanes per token
// (MANTA_PAGED_LANES), tokens per step (MANTA_PAGED_TT) and CTAs per SM the context is
// split to reach (MANTA_PAGED_CTAS_PER_SM).
// The context is split only while the batch's own CTAs (kv heads × sequences) are fewer
// than two per SM: past that, splitting adds short CTAs and merges without adding
// parallelism (H100, per decode step unsplit: 8B batch 64 10,262 -> 9,770 us, 0.6B batch
// 64 3,535 -> 3,264 us). MANTA_PAGED_CTAS_PER_SM overrides (A/B runs; 4 = the old rule).
int64_t paged_ctas_per_sm(int64_t ctas, int64_t sms) {
  return knob_or(kPagedCtasPerSm, ctas >= 2 * sms ? 2 : 4);
}
// Lanes per token in the paged kernel: enough for 8 elements of the head each (fewer
// shuffle rounds per score than a whole warp per token), or MANTA_PAGED_LANES (8, 16 or
// 32, where each lane then holds 2, 4 or 8 elements), for A/B runs.
int64_t paged_lanes(int64_t hd) {
  const int64_t lanes = knob_or(kPagedLanes, std::min<int64_t>(32, hd / 8));
  const int64_t per_lane = hd / lanes;
  return per_lane == 2 || per_lane == 4 || per_lane == 8 ? lanes : std::min<int64_t>(32, hd / 8);
}
// Tokens per lane group per step (MANTA_PAGED_TT: 1, 2, 4 or 8; default 4 for a whole warp
// per token, 2 for narrower groups, so a warp has ~4-8 tokens in flight either way).
int64_t paged_tokens_per_step(int64_t lanes) { return knob_or(kPagedTt, lanes == 32 ? 4 : 2); }
// Warps per paged-attention CTA: as many as static shared memory (48 KiB) allows, with one
// (max, sum, accumulator) per lane group; MANTA_PAGED_WARPS (2, 4 or 8) asks for fewer,
// for A/B runs (four were measured: BENCHMARKS.md).
int64_t paged_warps(int64_t hd, int64_t rep, int64_t lanes) {
  const int64_t per_warp = (32 / lanes) * hd * rep;
  const int64_t fits = per_warp <= 1024 ? 8 : per_warp <= 2048 ? 4 : 2;
  return std::min(fits, knob_or(kPagedWarps, fits));
}

// Each kernel's defines for one shape: what a launch compiles, and what the CPU-side
// compile check compiles (one definition for both).
std::string paged_defines(int64_t hd, int64_t rep, int64_t nkv, int64_t lanes, int64_t block_size) {
  return define("HD", hd) + define("REP", rep) + define("NKV", nkv) + define("WARPS", paged_warps(hd, rep, lanes)) +
         define("G", lanes) + define("TT", paged_tokens_per_step(lanes)) + define("BLOCK", block_size);
}

// The tensor-core variant of the paged kernel (MMA in paged_attention.cu.inc): two warps
// per CTA, each with its own double-buffered 16-token tiles (32 KiB of static shared
// memory at head_dim 128). It runs where the batch's CTAs alone fill the GPU (no context
// split) and head_dim ≤ 128; MANTA_PAGED_MMA=0 keeps the lane-group kernel (A/B runs).
constexpr int64_t kPagedMmaWarps = 2;
bool paged_mma(int64_t hd, int64_t splits) {
  return splits == 1 && (hd == 64 || hd == 128) && knob_or(kPagedMma, 1) == 1;
}
// Whether the paged kernel launches as a programmatic dependent of the kernel before it.
// The tensor-core kernel does not: measured on an H100, it is faster without (bench
// paged_attention 64 640: 62.1 against 64.5 µs; decode_step 8B batch 64: 9,362 against
// 9,497 µs per step, 0.6B batch 64 3,295 against 3,384). A likely cause, not verified:
// launched early, its single wave of equal CTAs takes SM slots while the kernel before
// still runs, spreads unevenly, and ends with the most-loaded SM. The lane-group kernel
// keeps PDL (it gains: 9,606 against 9,666 µs). MANTA_PAGED_PDL=0/1 overrides (A/B runs).
bool paged_pdl(bool mma) { return knob_or(kPagedPdl, mma ? 0 : 1) == 1; }
std::string paged_mma_defines(int64_t hd, int64_t rep, int64_t nkv, int64_t block_size) {
  return define("HD", hd) + define("REP", rep) + define("NKV", nkv) + define("WARPS", kPagedMmaWarps) +
         define("MMA", 1) + define("BLOCK", block_size);
}

// Whether every pointer is 16-byte aligned: the small kernels then move 8 bf16 per access
// (fused_ops.cu.inc's VEC), else one.
bool aligned16(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers)
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// Elements per access of the small kernels: 8 where a row is whole 8-element chunks and
// the rows start 16-byte aligned, else 1. On an H100 (decode_step, one process) eight per
// access took the 8B batch-64 step from 9,397 to 9,205 µs and 0.6B batch 64 from 3,129 to
// 3,088 (BENCHMARKS.md).
// MANTA_SMALL_VEC=0 keeps one element per access (A/B runs).
bool small_kernel_wide() { return knob_or(kSmallVec, 1) == 1; }
int64_t small_kernel_vec(int64_t width, bool aligned) {
  return aligned && width % 8 == 0 && small_kernel_wide() ? 8 : 1;
}

std::string qk_norm_rope_defines(int64_t hd, int64_t nh, int64_t nkv, bool norm, int64_t vec) {
  return define("HD", hd) + define("NH", nh) + define("NKV", nkv) + define("HAS_NORM", norm ? 1 : 0) +
         define("VEC", vec);
}

// One CTA per row: one 8-element chunk per thread up to 1,024 threads, or with scalar
// accesses 1,024 threads from hidden 4,096 and 256 below.
int64_t rms_norm_threads(int64_t hidden, int64_t vec) {
  if (vec == 1) return hidden >= 4096 ? 1024 : 256;
  return std::min<int64_t>(1024, (hidden / vec + 31) / 32 * 32);
}

std::string rms_norm_defines(int64_t hidden, int64_t vec) {
  return define("H", hidden) + define("THREADS", rms_norm_threads(hidden, vec)) + define("VEC", vec);
}

std::string silu_defines(int64_t inter, int64_t vec) { return define("I", inter) + define("VEC", vec); }

// Batch-invariant causal attention: one CTA per (query row, kv head), each row's keys in
// one fixed order (invariant_attention.cu.inc).
std::string invariant_defines(int64_t hd, int64_t rep, int64_t nkv) {
  return define("HD", hd) + define("REP", rep) + define("NKV", nkv);
}

void check_invariant_shape(int64_t hd, int64_t rep) {
  TORCH_CHECK(hd == 64 || hd == 128 || hd == 256, "head_dim must be 64, 128 or 256");
  TORCH_CHECK(rep >= 1 && rep * hd / 2 <= 1024 && rep * hd / 2 >= 32,
              "query heads per kv head x head_dim / 2 must be 32..1024 (threads per CTA)");
}

// cuBLASLt for the decode step's projections (manta_lt_linear). Its heuristic's first
// choice reads 64-row bf16 weights faster than the cuBLAS GEMM that at::linear takes (H100,
// decode_step: 8B batch 64 8,913 -> 8,833 µs, 0.6B batch 64 3,033 -> 3,010; BENCHMARKS.md),
// without switching the whole process (the trainer's GEMMs) to it as
// TORCH_BLAS_PREFER_CUBLASLT would. The entry points come from the libcublasLt that
// libtorch_cuda loaded.
struct LtApi {
  decltype(&cublasLtMatmulDescCreate) desc_create;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set;
  decltype(&cublasLtMatrixLayoutCreate) layout_create;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic;
  decltype(&cublasLtMatmul) matmul;
};

const LtApi& lt_api() {
  static const LtApi api = [] {
    void* lib = dlopen("libcublasLt.so.13", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcublasLt.so.13", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(lib != nullptr, "cannot load libcublasLt.so.13: ", dlerror());
    MANTA_SYM(lib, cublasLtMatmulDescCreate);
    MANTA_SYM(lib, cublasLtMatmulDescSetAttribute);
    MANTA_SYM(lib, cublasLtMatrixLayoutCreate);
    MANTA_SYM(lib, cublasLtMatmulPreferenceCreate);
    MANTA_SYM(lib, cublasLtMatmulPreferenceSetAttribute);
    MANTA_SYM(lib, cublasLtMatmulPreferenceDestroy);
    MANTA_SYM(lib, cublasLtMatmulAlgoGetHeuristic);
    MANTA_SYM(lib, cublasLtMatmul);
    return LtApi{cublasLtMatmulDescCreate_fn,      cublasLtMatmulDescSetAttribute_fn,
                 cublasLtMatrixLayoutCreate_fn,    cublasLtMatmulPreferenceCreate_fn,
                 cublasLtMatmulPreferenceSetAttribute_fn, cublasLtMatmulPreferenceDestroy_fn,
                 cublasLtMatmulAlgoGetHeuristic_fn, cublasLtMatmul_fn};
  }();
  return api;
}

// Largest power of two up to 16 that divides the address: cuBLASLt picks kernels by it.
uint32_t alignment(const void* p) {
  uint32_t a = 16;
  while (a > 1 && reinterpret_cast<uintptr_t>(p) % a != 0) a /= 2;
  return a;
}

// One shape's descriptors and chosen algorithm, made once and kept for the process (they
// are read-only to cublasLtMatmul, so threads and CUDA graphs share them). `ok` is false
// where the heuristic offered nothing; the caller then takes at::mm.
struct LtPlan {
  bool ok = false;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t w = nullptr, x = nullptr, y = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

const LtPlan& lt_plan(int device, int64_t m, int64_t n, int64_t k, uint32_t aw, uint32_t ax, uint32_t ay,
                      size_t workspace) {
  static std::mutex mu;
  static std::map<std::tuple<int, int64_t, int64_t, int64_t, uint32_t, uint32_t, uint32_t, size_t>, LtPlan> plans;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_tuple(device, m, n, k, aw, ax, ay, workspace);
  auto found = plans.find(key);
  if (found != plans.end()) return found->second;
  const LtApi& lt = lt_api();
  LtPlan plan;
  auto ok = [](cublasStatus_t s, const char* what) {
    TORCH_CHECK(s == CUBLAS_STATUS_SUCCESS, what, " failed with cuBLAS status ", static_cast<int>(s));
  };
  // Column-major view of y[m, n] = x[m, k] · w[n, k]ᵀ: yᵀ (n × m) = op(w) (n × k) · xᵀ (k × m),
  // w stored k × n and transposed, x stored k × m.
  ok(lt.desc_create(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
  ok(lt.desc_set(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof transpose), "set TRANSA");
  ok(lt.desc_set(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof keep), "set TRANSB");
  ok(lt.layout_create(&plan.w, CUDA_R_16BF, k, n, k), "cublasLtMatrixLayoutCreate (w)");
  ok(lt.layout_create(&plan.x, CUDA_R_16BF, k, m, k), "cublasLtMatrixLayoutCreate (x)");
  ok(lt.layout_create(&plan.y, CUDA_R_16BF, n, m, n), "cublasLtMatrixLayoutCreate (y)");
  cublasLtMatmulPreference_t pref;
  ok(lt.pref_create(&pref), "cublasLtMatmulPreferenceCreate");
  ok(lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof workspace), "set workspace");
  ok(lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aw, sizeof aw), "set A alignment");
  ok(lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ax, sizeof ax), "set B alignment");
  ok(lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ay, sizeof ay), "set C alignment");
  ok(lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ay, sizeof ay), "set D alignment");
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  const cublasStatus_t found_algo = lt.heuristic(at::cuda::getCurrentCUDABlasLtHandle(), plan.desc, plan.w, plan.x,
                                                 plan.y, plan.y, pref, 1, &result, &returned);
  lt.pref_destroy(pref);
  plan.ok = found_algo == CUBLAS_STATUS_SUCCESS && returned > 0;
  if (plan.ok) plan.algo = result.algo;
  return plans.emplace(key, plan).first->second;
}

// The driver's event functions, looked up once (manta_event_*).
struct EventApi {
  decltype(&cuEventCreate) create;
  decltype(&cuEventRecord) record;
  decltype(&cuEventSynchronize) synchronize;
  decltype(&cuEventDestroy) destroy;
};

const EventApi& event_api() {
  static const EventApi api = [] {
    void* driver = load_driver();
    MANTA_SYM(driver, cuEventCreate);
    MANTA_SYM(driver, cuEventRecord);
    MANTA_SYM(driver, cuEventSynchronize);
    MANTA_SYM(driver, cuEventDestroy_v2);
    return EventApi{cuEventCreate_fn, cuEventRecord_fn, cuEventSynchronize_fn, cuEventDestroy_v2_fn};
  }();
  return api;
}

// The driver's stream functions, looked up once (manta_stream_*): side streams whose
// collectives overlap the compute on libtorch's stream, ordered by events only.
struct StreamApi {
  decltype(&cuCtxGetStreamPriorityRange) priority_range;
  decltype(&cuStreamCreateWithPriority) create;
  decltype(&cuStreamWaitEvent) wait_event;
  decltype(&cuStreamSynchronize) synchronize;
  decltype(&cuStreamDestroy) destroy;
};

const StreamApi& stream_api() {
  static const StreamApi api = [] {
    void* driver = load_driver();
    MANTA_SYM(driver, cuCtxGetStreamPriorityRange);
    MANTA_SYM(driver, cuStreamCreateWithPriority);
    MANTA_SYM(driver, cuStreamWaitEvent);
    MANTA_SYM(driver, cuStreamSynchronize);
    MANTA_SYM(driver, cuStreamDestroy_v2);
    return StreamApi{cuCtxGetStreamPriorityRange_fn, cuStreamCreateWithPriority_fn, cuStreamWaitEvent_fn,
                     cuStreamSynchronize_fn, cuStreamDestroy_v2_fn};
  }();
  return api;
}

void check_cu(CUresult rc, const char* what) {
  TORCH_CHECK(rc == CUDA_SUCCESS, what, " failed with CUresult ", static_cast<int>(rc));
}

// Makes `device`'s primary context current on this thread before a driver-API call:
// DeviceScope skips setting a device that is already the current one, and on a thread
// that never touched CUDA that leaves no context bound (CUresult 201, invalid context).
void bind_context(int device) {
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device), /*force=*/true);
}

// cuBLASLt for the decode projections unless MANTA_DECODE_LT=0 (A/B runs: at::mm, cuBLAS).
bool decode_lt() { return knob_or(kDecodeLt, 1) == 1; }

struct Graph {
  at::cuda::CUDAGraph graph;
  // The stream that was current before capture, restored after it.
  std::optional<c10::cuda::CUDAStream> previous;
};
#endif
}  // namespace

extern "C" {

const char* manta_cuda_last_error() { return last_error().c_str(); }

// The kernel knobs, in KnobId order (-1: unset); see g_knobs.
void manta_set_kernel_knobs(const int64_t* values, int n) {
#ifdef MANTA_WITH_CUDA
  for (int i = 0; i < n && i < kKnobCount; ++i) g_knobs[i].store(values[i], std::memory_order_relaxed);
#else
  (void)values; (void)n;
#endif
}

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
  last_error() = "built without CUDA";
  return 1;
#endif
}

int manta_cuda_empty_cache() {
#ifdef MANTA_WITH_CUDA
  return guarded([&] { c10::cuda::CUDACachingAllocator::emptyCache(); });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// The raw cudaStream_t that libtorch queues `device`'s work on now, so collectives
// (NCCL) are ordered with the tensor ops around them.
int manta_cuda_current_stream(int device, void** stream) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    *stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// Makes `device` the calling thread's current CUDA device (NCCL binds a communicator
// to the device current at its creation).
int manta_cuda_set_device(int device) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] { c10::cuda::set_device(static_cast<c10::DeviceIndex>(device)); });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// The caching allocator's peak of allocated bytes on `device` since the process
// started or the last reset (torch.cuda.max_memory_allocated); `reset` starts a new peak.
int manta_cuda_peak_allocated(int device, int reset, size_t* bytes) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    auto index = static_cast<c10::DeviceIndex>(device);
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
    *bytes = static_cast<size_t>(
        stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak);
    if (reset) c10::cuda::CUDACachingAllocator::resetPeakStats(index);
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

int manta_cuda_device_arch(int device, int* arch) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    auto* props = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(device));
    *arch = props->major * 10 + props->minor;
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

void* manta_graph_new() {
#ifdef MANTA_WITH_CUDA
  Graph* g = nullptr;
  if (guarded([&] { g = new Graph(); })) return nullptr;
  return g;
#else
  last_error() = "built without CUDA";
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
  last_error() = "built without CUDA";
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
  last_error() = "built without CUDA";
  return 1;
#endif
}

int manta_graph_replay(void* g) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] { static_cast<Graph*>(g)->graph.replay(); });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// dst.copy_(src) queued without waiting for the device (from pinned host memory, the
// host returns at once). tch's copy_ always blocks.
int manta_copy_nonblocking(void* dst_, void* src_) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] { static_cast<at::Tensor*>(dst_)->copy_(tensor(src_), /*non_blocking=*/true); });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// A page-locked copy of the CPU tensor `src` in *out (a new at::Tensor the caller owns).
// tch's pin_memory always names a device, which libtorch warns is deprecated.
int manta_pin_memory(void* src_, void** out) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] { *out = new at::Tensor(tensor(src_).pin_memory()); });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// A CUDA event recorded on `device`'s current stream, in *out (free it with
// manta_event_free): the host can wait for the work queued so far while later work runs.
// Through the driver API, as every other CUDA call here (no link to libcudart).
int manta_event_record(int device, void** out) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    const EventApi& api = event_api();
    DeviceScope scope(device);  // the event belongs to the current context
    auto stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
    CUevent event = nullptr;
    CUresult created = api.create(&event, CU_EVENT_DISABLE_TIMING);
    TORCH_CHECK(created == CUDA_SUCCESS, "cuEventCreate failed with CUresult ", static_cast<int>(created));
    CUresult recorded = api.record(event, reinterpret_cast<CUstream>(stream));
    if (recorded != CUDA_SUCCESS) {
      api.destroy(event);
      TORCH_CHECK(false, "cuEventRecord failed with CUresult ", static_cast<int>(recorded));
    }
    *out = event;
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// Waits until the work queued before `event` was recorded has run.
int manta_event_synchronize(void* event) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    CUresult done = event_api().synchronize(static_cast<CUevent>(event));
    TORCH_CHECK(done == CUDA_SUCCESS, "cuEventSynchronize failed with CUresult ", static_cast<int>(done));
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

void manta_event_free(void* event) {
#ifdef MANTA_WITH_CUDA
  guarded([&] { event_api().destroy(static_cast<CUevent>(event)); });
#endif
}

// A new stream on `device` that does not wait for the legacy default stream (libtorch's
// default): only events order it with other streams. `high_priority`: the device's
// highest priority, so a collective's kernels start while compute kernels fill the GPU.
int manta_stream_create(int device, int high_priority, void** out) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    const StreamApi& api = stream_api();
    DeviceScope scope(device);
    bind_context(device);  // the stream belongs to the device's context
    int least = 0, greatest = 0;
    check_cu(api.priority_range(&least, &greatest), "cuCtxGetStreamPriorityRange");
    CUstream stream = nullptr;
    check_cu(api.create(&stream, CU_STREAM_NON_BLOCKING, high_priority ? greatest : least),
             "cuStreamCreateWithPriority");
    *out = stream;
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// Destroys a stream of manta_stream_create; work queued on it still runs.
void manta_stream_destroy(int device, void* stream) {
#ifdef MANTA_WITH_CUDA
  guarded([&] {
    DeviceScope scope(device);
    bind_context(device);
    stream_api().destroy(static_cast<CUstream>(stream));
  });
#endif
}

// Makes the work queued on `stream` of `device` after this call wait until `event` has
// completed (the host does not wait). A null stream is the legacy default stream.
int manta_stream_wait_event(int device, void* stream, void* event) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    DeviceScope scope(device);
    bind_context(device);
    check_cu(stream_api().wait_event(static_cast<CUstream>(stream), static_cast<CUevent>(event), 0),
             "cuStreamWaitEvent");
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// Blocks the host until the work queued on `stream` of `device` has run.
int manta_stream_synchronize(int device, void* stream) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    DeviceScope scope(device);
    bind_context(device);
    check_cu(stream_api().synchronize(static_cast<CUstream>(stream)), "cuStreamSynchronize");
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// A new event (manta_event_free frees it) recorded on `stream` of `device`: it completes
// once the work queued on that stream so far has run.
int manta_event_record_on(int device, void* stream, void** out) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    const EventApi& api = event_api();
    DeviceScope scope(device);
    bind_context(device);
    CUevent event = nullptr;
    check_cu(api.create(&event, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    CUresult recorded = api.record(event, static_cast<CUstream>(stream));
    if (recorded != CUDA_SUCCESS) {
      api.destroy(event);
      check_cu(recorded, "cuEventRecord");
    }
    *out = event;
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// Runs `f` with `stream` of `device` as libtorch's current stream there (tensor ops queue
// on it), then restores the stream that was current.
int manta_with_current_stream(int device, void* stream, void (*f)(void*), void* data) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    auto index = static_cast<c10::DeviceIndex>(device);
    c10::cuda::CUDAStream previous = c10::cuda::getCurrentCUDAStream(index);
    c10::cuda::setCurrentCUDAStream(
        c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), index));
    struct Restore {
      c10::cuda::CUDAStream previous;
      ~Restore() {
        try {
          c10::cuda::setCurrentCUDAStream(previous);
        } catch (...) {
        }
      }
    } restore{previous};
    f(data);
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

void manta_graph_free(void* g) {
#ifdef MANTA_WITH_CUDA
  guarded([&] { delete static_cast<Graph*>(g); });
#endif
}


// Paged decode attention (paged_attention.cu.inc, passed in as `source`). The context is
// split so that small batches still fill the GPU; with more than one split the last CTA of
// each (sequence, kv head) merges the partial softmaxes when `counters_` (int32 zeros, reset
// by the kernel) is given, else a second kernel does. NVRTC and the driver are dlopen'ed: nothing links them.
int manta_paged_decode_attention(const char* source, void* q_, void* kp_, void* vp_, void* tables_, void* lens_,
                                 void* counters_, void* out_, int block_size, float scale) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    const at::Tensor& q = tensor(q_);
    const at::Tensor& kp = tensor(kp_);
    const at::Tensor& vp = tensor(vp_);
    const at::Tensor& tables = tensor(tables_);
    const at::Tensor& lens = tensor(lens_);
    at::Tensor& out = *static_cast<at::Tensor*>(out_);
    check_bf16(q, "q");
    check_bf16(kp, "the key pool");
    check_bf16(vp, "the value pool");
    check_bf16(out, "out");
    TORCH_CHECK(q.dim() == 3 && kp.dim() == 3 && vp.sizes() == kp.sizes(),
                "q must be [B, heads, head_dim], pools [slots, kv_heads, head_dim]");
    TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kInt && tables.is_contiguous() &&
                    tables.size(0) == q.size(0),
                "block tables must be contiguous int32 [B, max_blocks]");
    TORCH_CHECK(lens.dim() == 1 && lens.scalar_type() == at::kInt && lens.size(0) == q.size(0),
                "lengths must be int32 [B]");
    TORCH_CHECK(out.sizes() == q.sizes(), "out must be like q");
    const int64_t hd = q.size(2), nkv = kp.size(1), nh = q.size(1), batch = q.size(0);
    TORCH_CHECK(kp.size(2) == hd && (hd == 64 || hd == 128 || hd == 256), "head_dim must be 64, 128 or 256");
    TORCH_CHECK(nh % nkv == 0 && nh / nkv <= 8, "query heads per kv head must be at most 8");
    if (batch == 0) return;
    const int64_t rep = nh / nkv;
    void* cp = nullptr;
    if (counters_ != nullptr) {
      const at::Tensor& counters = tensor(counters_);
      TORCH_CHECK(counters.is_cuda() && counters.scalar_type() == at::kInt && counters.is_contiguous() &&
                      counters.numel() >= batch * nkv,
                  "counters must be contiguous int32 zeros, at least batch x kv_heads of them");
      cp = counters.data_ptr();
    }
    const int device = q.get_device();
    const int64_t lanes = paged_lanes(hd);
    TORCH_CHECK(block_size > 0, "block_size must be positive, got ", block_size);
    int max_blocks = static_cast<int>(tables.size(1));
    const int64_t max_ctx = static_cast<int64_t>(max_blocks) * block_size;
    // Small batches: enough CTAs to fill every SM about four times over (several CTAs stay
    // resident per SM), each split at least 32 tokens long, at most 64 splits (the merge's
    // width). Batches of two or more CTAs per SM alone: no split.
    const int64_t sms = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(device))->multiProcessorCount;
    const int64_t ctas = nkv * batch;
    const int64_t target = paged_ctas_per_sm(ctas, sms) * sms;
    int64_t splits = std::max<int64_t>(1, std::min<int64_t>({(target + ctas - 1) / ctas, (max_ctx + 31) / 32, 64}));
    int chunk = static_cast<int>((max_ctx + splits - 1) / splits);
    int splits_i = static_cast<int>(splits);
    const bool mma = paged_mma(hd, splits);
    const std::string defines =
        mma ? paged_mma_defines(hd, rep, nkv, block_size) : paged_defines(hd, rep, nkv, lanes, block_size);
    const int64_t warps = mma ? kPagedMmaWarps : paged_warps(hd, rep, lanes);
    at::Tensor part_acc, part_ml;
    if (splits > 1) {
      part_acc = at::empty({batch, nh, splits, hd}, q.options().dtype(at::kFloat));
      part_ml = at::empty({batch, nh, splits, 2}, q.options().dtype(at::kFloat));
    }
    const void* qp = q.data_ptr();
    const void* kpp = kp.data_ptr();
    const void* vpp = vp.data_ptr();
    const void* tp = tables.data_ptr();
    const void* lp = lens.data_ptr();
    void* op = out.data_ptr();
    void* pa = splits > 1 ? part_acc.data_ptr() : nullptr;
    void* pm = splits > 1 ? part_ml.data_ptr() : nullptr;
    void* args[] = {&qp, &kpp, &vpp, &tp, &lp, &op, &pa, &pm, &cp, &max_blocks, &scale, &chunk, &splits_i};
    launch(kernel(source, defines, "paged_decode_attention", device), device, static_cast<unsigned>(nkv),
           static_cast<unsigned>(batch), static_cast<unsigned>(splits),
           static_cast<unsigned>(warps * 32), args, paged_pdl(mma));
    if (splits > 1 && cp == nullptr) {
      const void* pac = pa;
      const void* pmc = pm;
      void* combine_args[] = {&pac, &pmc, &lp, &op, &chunk, &splits_i};
      launch(kernel(source, defines, "paged_decode_combine", device), device, static_cast<unsigned>(batch),
             static_cast<unsigned>(nh), 1, static_cast<unsigned>(hd), combine_args, true);
    }
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// Batch-invariant causal attention (invariant_attention.cu.inc).
int manta_invariant_attention(const char* source, void* q_, void* k_, void* v_, void* tables_, void* row_ref_,
                              void* row_len_, void* out_, int block_size, float scale) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    const at::Tensor& q = tensor(q_);
    const at::Tensor& k = tensor(k_);
    const at::Tensor& v = tensor(v_);
    const at::Tensor& row_len = tensor(row_len_);
    at::Tensor& out = *static_cast<at::Tensor*>(out_);
    check_bf16(q, "q");
    check_bf16(k, "keys");
    check_bf16(v, "values");
    check_bf16(out, "out");
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(),
                "q must be [R, heads, head_dim], keys and values [slots, kv_heads, head_dim]");
    TORCH_CHECK(out.sizes() == q.sizes(), "out must be like q");
    const int64_t rows = q.size(0), nh = q.size(1), hd = q.size(2), nkv = k.size(1);
    TORCH_CHECK(k.size(2) == hd && nkv > 0 && nh % nkv == 0, "heads must be a multiple of kv_heads, head_dim equal");
    check_invariant_shape(hd, nh / nkv);
    auto check_rows = [&](const at::Tensor& t, const char* what) {
      TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kInt && t.is_contiguous() && t.dim() == 1 &&
                      t.size(0) == rows,
                  what, " must be a contiguous int32 CUDA tensor [rows]");
    };
    check_rows(row_len, "row lengths");
    int table_width = 0;
    const void* tp = nullptr;
    const void* rp = nullptr;
    if (tables_ != nullptr) {
      const at::Tensor& tables = tensor(tables_);
      TORCH_CHECK(tables.is_cuda() && tables.scalar_type() == at::kInt && tables.is_contiguous() && tables.dim() == 2,
                  "block tables must be contiguous int32 [S, max_blocks]");
      TORCH_CHECK(block_size > 0, "block_size must be positive");
      if (row_ref_ != nullptr) {
        check_rows(tensor(row_ref_), "row tables");
      } else {
        TORCH_CHECK(tables.size(0) == rows, "without row tables there must be one block table per row");
      }
      table_width = static_cast<int>(tables.size(1));
      tp = tables.data_ptr();
    } else {
      TORCH_CHECK(row_ref_ != nullptr, "contiguous keys need each row's first slot");
      check_rows(tensor(row_ref_), "first slots");
    }
    if (row_ref_ != nullptr) rp = tensor(row_ref_).data_ptr();
    if (rows == 0) return;
    const int device = q.get_device();
    const void* qp = q.data_ptr();
    const void* kp = k.data_ptr();
    const void* vp = v.data_ptr();
    const void* lp = row_len.data_ptr();
    void* op = out.data_ptr();
    void* args[] = {&qp, &kp, &vp, &tp, &rp, &lp, &op, &table_width, &block_size, &scale};
    launch(kernel(source, invariant_defines(hd, nh / nkv, nkv), "invariant_attention", device), device,
           static_cast<unsigned>(rows), static_cast<unsigned>(nkv), 1, static_cast<unsigned>(nh / nkv * hd / 2),
           args);
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

int manta_invariant_attention_compile_check(const char* source, int heads, int kv_heads, int head_dim, int arch) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
    check_invariant_shape(head_dim, heads / kv_heads);
    compile_kernels(source, invariant_defines(head_dim, heads / kv_heads, kv_heads), arch);
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// Qwen3's per-head q/k RMS norm (when the weights are given), rotary embedding, and the
// store of keys and values into their cache slots, for every token of a flat batch.
// The rotary table [N, head_dim] (bf16: cosines, then sines) of a forward's positions.
int manta_rope_table(const char* source, void* positions_, void* inv_freq_, void* table_) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    const at::Tensor& positions = tensor(positions_);
    const at::Tensor& inv_freq = tensor(inv_freq_);
    at::Tensor& table = *static_cast<at::Tensor*>(table_);
    check_bf16(table, "the rotary table");
    const int64_t n = positions.numel(), hd = 2 * inv_freq.numel();
    TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.dim() == 1,
                "positions must be int64 [N]");
    TORCH_CHECK(inv_freq.scalar_type() == at::kFloat && inv_freq.is_contiguous() && inv_freq.dim() == 1,
                "inv_freq must be float32 [head_dim / 2]");
    TORCH_CHECK(table.dim() == 2 && table.size(0) == n && table.size(1) == hd, "the rotary table must be [N, head_dim]");
    TORCH_CHECK(positions.device() == table.device() && inv_freq.device() == table.device(),
                "positions, inv_freq and the table must be on one GPU");
    if (n == 0) return;
    const int device = table.get_device();
    const void* pp = positions.data_ptr();
    const void* fp = inv_freq.data_ptr();
    void* tp = table.data_ptr();
    long tokens = static_cast<long>(n);
    void* args[] = {&pp, &fp, &tp, &tokens};
    const int64_t threads = n * (hd / 2);
    launch(kernel(source, define("HD", hd), "rope_table", device), device,
           static_cast<unsigned>((threads + 255) / 256), 1, 1, 256, args, true);
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

int manta_qk_norm_rope_store(const char* source, void* qkv_, void* q_w_, void* k_w_, void* rope_, void* slots_,
                             void* kp_, void* vp_, void* q_out_, float eps) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    const at::Tensor& qkv = tensor(qkv_);
    const at::Tensor& rope = tensor(rope_);
    const at::Tensor& slots = tensor(slots_);
    const at::Tensor& kp = tensor(kp_);
    const at::Tensor& vp = tensor(vp_);
    at::Tensor& q_out = *static_cast<at::Tensor*>(q_out_);
    check_bf16(qkv, "qkv");
    check_bf16(rope, "the rotary table");
    check_bf16(kp, "the key pool");
    check_bf16(vp, "the value pool");
    check_bf16(q_out, "q_out");
    const bool norm = q_w_ != nullptr && k_w_ != nullptr;
    if (norm) {
      check_bf16(tensor(q_w_), "q_norm weight");
      check_bf16(tensor(k_w_), "k_norm weight");
    }
    TORCH_CHECK(kp.dim() == 3 && vp.sizes() == kp.sizes(), "pools must be [slots, kv_heads, head_dim]");
    TORCH_CHECK(q_out.dim() == 3, "q_out must be [N, heads, head_dim]");
    const int64_t n = q_out.size(0), nh = q_out.size(1), hd = q_out.size(2), nkv = kp.size(1);
    TORCH_CHECK(hd == 64 || hd == 128 || hd == 256, "head_dim must be 64, 128 or 256");
    TORCH_CHECK(kp.size(2) == hd && qkv.numel() == n * (nh + 2 * nkv) * hd, "qkv must hold N x (heads + 2 kv_heads) x head_dim");
    TORCH_CHECK(rope.dim() == 2 && rope.size(0) == n && rope.size(1) == hd,
                "the rotary table must be [N, head_dim] (rope_table)");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == n,
                "slots must be int64 [N]");
    if (n == 0) return;
    const int device = qkv.get_device();
    const void* a = qkv.data_ptr();
    const void* qw = norm ? tensor(q_w_).data_ptr() : nullptr;
    const void* kw = norm ? tensor(k_w_).data_ptr() : nullptr;
    const void* rp = rope.data_ptr();
    const void* sp = slots.data_ptr();
    void* kpp = kp.data_ptr();
    void* vpp = vp.data_ptr();
    void* qo = q_out.data_ptr();
    // A lane's HD / 32 elements in one access where every row starts 16-byte aligned.
    const int64_t vec = aligned16({a, rp, kpp, vpp, qo}) && small_kernel_wide() ? hd / 32 : 1;
    const std::string defines = qk_norm_rope_defines(hd, nh, nkv, norm, vec);
    void* args[] = {&a, &qw, &kw, &rp, &sp, &kpp, &vpp, &qo, &eps};
    const int64_t heads = nh + 2 * nkv;
    launch(kernel(source, defines, "qk_norm_rope_store", device), device, static_cast<unsigned>(n),
           static_cast<unsigned>((heads + 7) / 8), 1, 256, args, true);
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// residual += delta (when given, in place), out = rms_norm(residual) * weight.
int manta_add_rms_norm(const char* source, void* residual_, void* delta_, void* weight_, void* out_, float eps) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    at::Tensor& residual = *static_cast<at::Tensor*>(residual_);
    const at::Tensor& weight = tensor(weight_);
    at::Tensor& out = *static_cast<at::Tensor*>(out_);
    check_bf16(residual, "residual");
    check_bf16(weight, "norm weight");
    check_bf16(out, "out");
    const int64_t h = weight.numel();
    TORCH_CHECK(residual.numel() % h == 0 && out.sizes() == residual.sizes(), "residual and out must be [N, hidden]");
    if (delta_ != nullptr) {
      check_bf16(tensor(delta_), "delta");
      TORCH_CHECK(tensor(delta_).sizes() == residual.sizes(), "delta must be like residual");
    }
    const int64_t rows = residual.numel() / h;
    if (rows == 0) return;
    const int device = residual.get_device();
    void* rp = residual.data_ptr();
    const void* dp = delta_ != nullptr ? tensor(delta_).data_ptr() : nullptr;
    const void* wp = weight.data_ptr();
    void* op = out.data_ptr();
    const int64_t vec = small_kernel_vec(h, aligned16({rp, dp, wp, op}));
    const int64_t threads = rms_norm_threads(h, vec);
    const std::string defines = rms_norm_defines(h, vec);
    void* args[] = {&rp, &dp, &wp, &op, &eps};
    launch(kernel(source, defines, "add_rms_norm", device), device, static_cast<unsigned>(rows), 1, 1,
           static_cast<unsigned>(threads), args, true);
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// y[m, n] = x[m, k] · w[n, k]ᵀ, bf16, fp32 accumulation, through cuBLASLt (lt_plan).
int manta_lt_linear(void* x_, void* w_, void* y_) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    const at::Tensor& x = tensor(x_);
    const at::Tensor& w = tensor(w_);
    at::Tensor& y = *static_cast<at::Tensor*>(y_);
    check_bf16(x, "x");
    check_bf16(w, "w");
    check_bf16(y, "y");
    TORCH_CHECK(w.dim() == 2, "w must be [out, in]");
    const int64_t n = w.size(0), k = w.size(1);
    TORCH_CHECK(x.size(-1) == k, "x's last size must be w's in size (", k, "), got ", x.size(-1));
    const int64_t m = x.numel() / k;
    TORCH_CHECK(y.numel() == m * n && y.size(-1) == n, "y must be [", m, ", ", n, "]");
    TORCH_CHECK(x.get_device() == w.get_device() && y.get_device() == w.get_device(), "x, w and y must share a device");
    if (m == 0) return;
    const at::Tensor x2 = x.view({m, k});
    at::Tensor y2 = y.view({m, n});
    const int device = w.get_device();
    DeviceScope scope(device);  // cuBLASLt's handle and workspace are the current device's
    const size_t workspace = at::cuda::getCUDABlasLtWorkspaceSize();
    static const LtPlan cublas;  // not ok: at::mm below
    const LtPlan& plan = decode_lt() ? lt_plan(device, m, n, k, alignment(w.data_ptr()), alignment(x.data_ptr()),
                                               alignment(y.data_ptr()), workspace)
                                     : cublas;
    if (!plan.ok) {
      at::mm_out(y2, x2, w.t());
      return;
    }
    const float alpha = 1.f, beta = 0.f;
    auto stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
    const cublasStatus_t done =
        lt_api().matmul(at::cuda::getCurrentCUDABlasLtHandle(), plan.desc, &alpha, w.data_ptr(), plan.w, x.data_ptr(),
                        plan.x, &beta, y.data_ptr(), plan.y, y.data_ptr(), plan.y, &plan.algo,
                        at::cuda::getCUDABlasLtWorkspace(), workspace, stream);
    TORCH_CHECK(done == CUBLAS_STATUS_SUCCESS, "cublasLtMatmul failed with cuBLAS status ", static_cast<int>(done),
                " (", m, " x ", k, " by ", n, " x ", k, ")");
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// Causal attention of packed variable-length sequences through libtorch's flash attention
// (FlashAttention-2's varlen forward): q [total_q, heads, hd], k and v [total_k, kv_heads,
// hd] (bf16 or fp16, CUDA), cumulative lengths cu_q and cu_k [seqs + 1] int32. A sequence
// with more keys than queries (a cached prefix) has its queries at the end of its keys: the
// causal mask is aligned at the bottom right. A new tensor like q in *out.
int manta_flash_varlen(void* q_, void* k_, void* v_, void* cu_q_, void* cu_k_, int64_t max_q, int64_t max_k,
                       double scale, void** out) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    const at::Tensor& q = tensor(q_);
    const at::Tensor& k = tensor(k_);
    const at::Tensor& v = tensor(v_);
    const at::Tensor& cu_q = tensor(cu_q_);
    const at::Tensor& cu_k = tensor(cu_k_);
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k and v must be [tokens, heads, head_dim]");
    TORCH_CHECK(cu_q.scalar_type() == at::kInt && cu_k.scalar_type() == at::kInt, "cu_q and cu_k must be int32");
    TORCH_CHECK(cu_q.numel() == cu_k.numel(), "cu_q and cu_k must have one entry per sequence plus one");
    auto result = at::_flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, /*is_causal=*/true,
                                               /*return_debug_mask=*/false, scale);
    *out = new at::Tensor(std::get<0>(result));
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// out = silu(gate) * up, for gate_up rows [gate | up].
int manta_silu_mul(const char* source, void* gate_up_, void* out_) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    const at::Tensor& gate_up = tensor(gate_up_);
    at::Tensor& out = *static_cast<at::Tensor*>(out_);
    check_bf16(gate_up, "gate_up");
    check_bf16(out, "out");
    const int64_t i = out.size(-1);
    TORCH_CHECK(gate_up.size(-1) == 2 * i && gate_up.numel() == 2 * out.numel(), "gate_up must be [N, 2 x out's width]");
    long long total = out.numel();
    if (total == 0) return;
    const int device = out.get_device();
    const void* gp = gate_up.data_ptr();
    void* op = out.data_ptr();
    void* args[] = {&gp, &op, &total};
    const int64_t vec = small_kernel_vec(i, aligned16({gp, op}));
    const long long blocks = std::min<long long>((total / vec + 255) / 256, 65535);
    launch(kernel(source, silu_defines(i, vec), "silu_mul", device), device, static_cast<unsigned>(blocks), 1, 1, 256,
           args, true);
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// Defines of the small-batch GEMV (gemv.cu.inc) for inner size k, up to `rows` input rows
// and n outputs.
int64_t gemv_max_rows(int64_t rows) { return rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : 8; }
// Output rows per warp. The plain products (o and down) take 4: with rolling loads each
// warp then streams four rows' weights from one set of input loads, and the grid is half as
// many CTAs (H200, 2026-11-28, decode_step graph replay: 8B batch 1 4,572 -> 4,424 us a
// step, batch 2 5,743 -> 5,490, 0.6B batch 1 788 -> 744; without rolling loads 8B gained
// 0.5 %). Products with a fused norm take 2 where there are enough rows that the grid stays
// large; the LM head (fp32 out) takes 2 too, gate/up (SiLU) 1 (2 was slower at both
// shapes). MANTA_GEMV_ROWS (1, 2, 4) overrides for the plain bf16 products,
// MANTA_GEMV_NORM_ROWS for those with a fused norm and no SiLU, MANTA_GEMV_SILU_ROWS for
// the gate/up product, for A/B runs.
int64_t gemv_rows_per_warp(int64_t n, bool silu, bool norm, bool out_f32) {
  if (silu) return knob_or(kGemvSiluRows, 1);
  const int64_t by_shape = n >= 4096 ? 2 : 1;
  if (out_f32) return by_shape;
  return norm ? knob_or(kGemvNormRows, by_shape) : knob_or(kGemvRows, 4);
}
// Warps sharing a row. A bf16 product without a fused norm (the o and down projections)
// takes 4: a grid of one CTA per 8 rows is about one wave on an H100/H200, so its last CTAs
// run alone, and with 4 warps a row it is four times as many CTAs (H200, 2026-11-27, 8B
// batch 1 decode step 4,974 -> 4,735 us; 2 was slower, 5,075 us, at ~1.5 waves). The
// others take 4 only with few outputs (n <= 2048). MANTA_GEMV_KSPLIT (1, 2 or 4)
// overrides for the bf16 products without a fused norm, MANTA_GEMV_NORM_KSPLIT for those
// with one (the qkv projection's 384 CTAs at 8B are ~1.5 waves too, but each CTA repeats
// the norm), for A/B runs.
int64_t gemv_k_split(int64_t k, int64_t n, bool norm, bool out_f32) {
  const int64_t few = n <= 2048 ? 4 : 1;
  const int64_t split = out_f32 ? few : norm ? knob_or(kGemvNormKsplit, few) : knob_or(kGemvKsplit, 4);
  return k % (256 * split) == 0 ? split : 1;
}
// Warps per CTA. The variants with the fused norm take 8: every CTA computes the norm of
// the whole input row before its products, so fewer, wider CTAs repeat it less (H100,
// 2026-11-24: 8B batch 1 144 -> 152 decode tokens/s, 0.6B batch 1 ~3 % in noisy A/Bs; 2
// warps were slower). MANTA_GEMV_WARPS (2, 4, 8) and MANTA_GEMV_NORM_WARPS (2, 4, 8, 16)
// override, for A/B runs.
int64_t gemv_warps(bool norm) {
  return norm ? knob_or(kGemvNormWarps, 8) : knob_or(kGemvWarps, 4);
}
int64_t gemv_split(int64_t k, int64_t n, bool norm, bool out_f32) {
  return std::min(gemv_k_split(k, n, norm, out_f32), gemv_warps(norm));
}
// 8 loads in flight per lane beat 16 (MANTA_GEMV_DEPTH; H200, 2026-11-28: 8B batch 1 4,364
// -> 4,226 us a step, 24 and 32 slower, 0.6B level): fewer registers a warp, more warps
// resident.
std::string gemv_defines(int64_t k, int64_t rows, int64_t n, bool silu, bool norm, bool out_f32 = false) {
  return (out_f32 ? define("OUT_F32", 1) : std::string()) + define("K", k) + define("MR", gemv_max_rows(rows)) +
         define("R", gemv_rows_per_warp(n, silu, norm, out_f32)) + define("SILU", silu ? 1 : 0) + define("NORM", norm ? 1 : 0) +
         define("KSPLIT", gemv_split(k, n, norm, out_f32)) + define("GEMV_WARPS", gemv_warps(norm)) +
         define("GEMV_DEPTH", knob_or(kGemvDepth, 8));
}
// NORM keeps the normalised input rows and the norm weight in static shared memory (at
// most 40 KiB of bf16, beside the partial sums, inside the 48 KiB a CTA may declare).
bool gemv_norm_fits(int64_t k, int64_t rows) { return (gemv_max_rows(rows) + 1) * k <= 20480; }

// y = x · wᵀ (or silu(gate) × up with `silu`, w = [gate | up] rows) for at most 8 rows of x.
// With `norm_w_`, x is a residual and the product's input is rms_norm(x (+ delta)) × norm_w;
// with `delta_` too, x + delta is stored to `x_out_`. y is bf16, or fp32 (plain products
// only: the LM head's unrounded logits).
int manta_gemv(const char* source, void* x_, void* delta_, void* norm_w_, void* x_out_, void* w_, void* y_, int silu,
               float eps) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    const at::Tensor& x = tensor(x_);
    const at::Tensor& w = tensor(w_);
    at::Tensor& y = *static_cast<at::Tensor*>(y_);
    check_bf16(x, "x");
    check_bf16(w, "w");
    const bool out_f32 = y.scalar_type() == at::kFloat;
    if (out_f32) {
      TORCH_CHECK(y.is_cuda() && y.is_contiguous() && y.get_device() == x.get_device(),
                  "y must be contiguous on x's device");
      TORCH_CHECK(silu == 0 && norm_w_ == nullptr, "an fp32 y takes a plain product (no silu, no fused norm)");
    } else {
      check_bf16(y, "y");
    }
    TORCH_CHECK(w.dim() == 2, "w must be [out, in]");
    const int64_t k = w.size(1);
    TORCH_CHECK(k % 256 == 0, "the inner size must be a multiple of 256, got ", k);
    TORCH_CHECK(x.size(-1) == k, "x's last size ", x.size(-1), " must be w's inner size ", k);
    const int64_t rows = x.numel() / k, n = y.size(-1);
    TORCH_CHECK(rows <= 8, "at most 8 rows, got ", rows);
    TORCH_CHECK(y.numel() == rows * n, "y must be [rows, out]");
    TORCH_CHECK(w.size(0) == (silu ? 2 * n : n), "w has ", w.size(0), " rows for ", n, silu ? " silu outputs" : " outputs");
    const bool norm = norm_w_ != nullptr;
    const void* dp = nullptr;
    const void* nwp = nullptr;
    void* xop = nullptr;
    if (norm) {
      TORCH_CHECK(gemv_norm_fits(k, rows), "a fused norm over ", rows, " rows of ", k, " does not fit shared memory");
      check_bf16(tensor(norm_w_), "norm weight");
      TORCH_CHECK(tensor(norm_w_).numel() == k, "norm weight must have ", k, " elements");
      nwp = tensor(norm_w_).data_ptr();
      if (delta_ != nullptr) {
        TORCH_CHECK(x_out_ != nullptr, "a delta needs x_out for residual + delta");
        check_bf16(tensor(delta_), "delta");
        check_bf16(tensor(x_out_), "x_out");
        TORCH_CHECK(tensor(delta_).sizes() == x.sizes() && tensor(x_out_).sizes() == x.sizes(),
                    "delta and x_out must be like x");
        TORCH_CHECK(tensor(x_out_).data_ptr() != x.data_ptr(), "x_out must not alias x (other CTAs still read x)");
        dp = tensor(delta_).data_ptr();
        xop = tensor(x_out_).data_ptr();
      }
    } else {
      TORCH_CHECK(delta_ == nullptr, "a delta needs a norm weight");
    }
    if (rows == 0 || n == 0) return;
    const int device = x.get_device();
    const void* xp = x.data_ptr();
    const void* wp = w.data_ptr();
    void* yp = y.data_ptr();
    int m_i = static_cast<int>(rows), n_i = static_cast<int>(n);
    void* args[] = {&xp, &dp, &nwp, &xop, &wp, &yp, &m_i, &n_i, &eps};
    const int64_t warps = gemv_warps(norm);
    const int64_t per_cta = warps / gemv_split(k, n, norm, out_f32) * gemv_rows_per_warp(n, silu != 0, norm, out_f32);
    launch(kernel(source, gemv_defines(k, rows, n, silu != 0, norm, out_f32), "gemv", device), device,
           static_cast<unsigned>((n + per_cta - 1) / per_cta), 1, 1, static_cast<unsigned>(warps * 32), args, true);
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// Compiles the GEMV for inner size k, n outputs, each row-count variant up to `max_rows`
// (with and without the fused norm where it fits), without a GPU.
int manta_gemv_compile_check(const char* source, int k, int n, int silu, int max_rows, int out_f32, int arch) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    TORCH_CHECK(!(out_f32 && silu), "an fp32 output takes a plain product (no silu)");
    for (int64_t rows : {1, 2, 4, 8}) {
      if (rows > gemv_max_rows(max_rows)) break;
      compile_kernels(source, gemv_defines(k, rows, n, silu != 0, false, out_f32 != 0), arch);
      if (out_f32) continue;
      if (gemv_norm_fits(k, rows)) compile_kernels(source, gemv_defines(k, rows, n, silu != 0, true), arch);
    }
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// Next-token choice for each row of fp32 `logits` [rows, vocab] (sampling.cu.inc):
// `params` [2, rows] fp32 (temperature, 0 = greedy; uniform draw), `out` [2, rows] f64
// (token id, log-prob).
int manta_sample_rows(const char* source, void* logits_, void* params_, void* out_) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    const at::Tensor& logits = tensor(logits_);
    const at::Tensor& params = tensor(params_);
    at::Tensor& out = *static_cast<at::Tensor*>(out_);
    TORCH_CHECK(logits.is_cuda() && logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
                "logits must be a contiguous float32 CUDA tensor [rows, vocab]");
    const int64_t rows = logits.size(0), vocab = logits.size(1);
    TORCH_CHECK(vocab > 0 && vocab < (int64_t{1} << 31), "vocab must be in 1..2^31");
    TORCH_CHECK(params.device() == logits.device() && params.scalar_type() == at::kFloat && params.is_contiguous() &&
                    params.numel() == 2 * rows,
                "params must be float32 [2, rows] on the logits' device");
    TORCH_CHECK(out.device() == logits.device() && out.scalar_type() == at::kDouble && out.is_contiguous() &&
                    out.numel() == 2 * rows,
                "out must be float64 [2, rows] on the logits' device");
    if (rows == 0) return;
    const int device = logits.get_device();
    // Chunks of ~2k logits spread a row over many SMs; the second kernel merges them.
    const int64_t chunks = std::min<int64_t>(256, std::max<int64_t>(1, (vocab + 2047) / 2048));
    const int64_t chunk = (vocab + chunks - 1) / chunks;
    at::Tensor parts = at::empty({rows, chunks, 4}, logits.options());
    const void* lp = logits.data_ptr();
    const void* pp = params.data_ptr();
    void* partp = parts.data_ptr();
    const void* partc = partp;
    void* op = out.data_ptr();
    int rows_i = static_cast<int>(rows), vocab_i = static_cast<int>(vocab);
    int chunk_i = static_cast<int>(chunk), chunks_i = static_cast<int>(chunks);
    void* chunk_args[] = {&lp, &pp, &partp, &vocab_i, &chunk_i};
    launch(kernel(source, "", "sample_chunks", device), device, static_cast<unsigned>(rows),
           static_cast<unsigned>(chunks), 1, 256, chunk_args);
    void* pick_args[] = {&lp, &pp, &partc, &op, &rows_i, &vocab_i, &chunk_i, &chunks_i};
    launch(kernel(source, "", "sample_pick", device), device, static_cast<unsigned>(rows), 1, 1, 256, pick_args);
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// Compiles a kernel source that takes no defines (the sampling, log-prob and optimizer
// kernels) for sm_<arch> without a GPU.
int manta_kernels_compile_check(const char* source, int arch) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] { compile_kernels(source, "", arch); });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

}  // extern "C"

#ifdef MANTA_WITH_CUDA
namespace {
// The log-prob kernels' common inputs: fp32 logits [rows, vocab] on CUDA, int64 targets
// [rows] beside them, a usable temperature. Returns rows.
int64_t logprob_check_rows(const at::Tensor& logits, const at::Tensor& targets, double temperature) {
  TORCH_CHECK(logits.is_cuda() && logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "logits must be a contiguous float32 CUDA tensor [rows, vocab]");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0 && vocab < (int64_t{1} << 31), "vocab must be in 1..2^31");
  TORCH_CHECK(targets.device() == logits.device() && targets.scalar_type() == at::kLong && targets.is_contiguous() &&
                  targets.numel() == rows,
              "targets must be int64 [rows] on the logits' device");
  TORCH_CHECK(temperature > 0.0 && std::isfinite(temperature), "temperature must be positive and finite, got ",
              temperature);
  return rows;
}

void logprob_check_f32(const at::Tensor& t, const at::Tensor& logits, int64_t numel, const char* what) {
  TORCH_CHECK(t.device() == logits.device() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.numel() == numel,
              what, " must be a contiguous float32 tensor of ", numel, " elements on the logits' device");
}
}  // namespace
#endif

extern "C" {

// The trainer's per-token log-probs (logprobs.cu.inc): per row of fp32 `logits` [rows, vocab]
// at `temperature`, the target's log-prob, the entropy and the row's softmax statistics
// (`stats` [rows, 2]: max and log-sum of logits / T), which the gradient kernel reuses.
int manta_logprob_rows(const char* source, void* logits_, void* targets_, double temperature, void* logp_,
                       void* entropy_, void* stats_) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    const at::Tensor& logits = tensor(logits_);
    const at::Tensor& targets = tensor(targets_);
    at::Tensor& logp = *static_cast<at::Tensor*>(logp_);
    at::Tensor& entropy = *static_cast<at::Tensor*>(entropy_);
    at::Tensor& stats = *static_cast<at::Tensor*>(stats_);
    const int64_t rows = logprob_check_rows(logits, targets, temperature);
    logprob_check_f32(logp, logits, rows, "log-probs");
    logprob_check_f32(entropy, logits, rows, "entropies");
    logprob_check_f32(stats, logits, 2 * rows, "stats");
    if (rows == 0) return;
    const int device = logits.get_device();
    const void* lp = logits.data_ptr();
    const void* tp = targets.data_ptr();
    void* op = logp.data_ptr();
    void* ep = entropy.data_ptr();
    void* sp = stats.data_ptr();
    // ATen divides fp32 logits by a scalar as a product with the scalar's fp32 reciprocal.
    float inv_t = 1.0f / static_cast<float>(temperature);
    int vocab = static_cast<int>(logits.size(1));
    int vec4 = vocab % 4 == 0 && aligned16({lp});
    void* args[] = {&lp, &tp, &inv_t, &vocab, &vec4, &op, &ep, &sp};
    launch(kernel(source, "", "logprob_rows", device), device, static_cast<unsigned>(rows), 1, 1, 512, args);
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// The gradient w.r.t. `logits` of g_logp · logp + g_ent · entropy (either may be null: that
// term is absent), written to `out` [rows, vocab] in bf16 or fp16, from the forward's
// `stats` and `entropy`.
int manta_logprob_grad(const char* source, void* logits_, void* targets_, void* stats_, void* entropy_,
                       void* g_logp_, void* g_ent_, double temperature, void* out_) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    const at::Tensor& logits = tensor(logits_);
    const at::Tensor& targets = tensor(targets_);
    at::Tensor& out = *static_cast<at::Tensor*>(out_);
    const int64_t rows = logprob_check_rows(logits, targets, temperature);
    logprob_check_f32(tensor(stats_), logits, 2 * rows, "stats");
    logprob_check_f32(tensor(entropy_), logits, rows, "entropies");
    if (g_logp_ != nullptr) logprob_check_f32(tensor(g_logp_), logits, rows, "log-prob gradients");
    if (g_ent_ != nullptr) logprob_check_f32(tensor(g_ent_), logits, rows, "entropy gradients");
    const bool half = out.scalar_type() == at::kHalf;
    TORCH_CHECK(out.device() == logits.device() && (half || out.scalar_type() == at::kBFloat16) &&
                    out.is_contiguous() && out.sizes() == logits.sizes(),
                "the logits' gradient must be a contiguous bf16 or fp16 tensor shaped like the logits, on their device");
    const int64_t vocab = logits.size(1);
    constexpr int64_t kTile = 256 * 4 * 8;  // LG_TILE
    const int64_t tiles = (vocab + kTile - 1) / kTile;
    TORCH_CHECK(tiles <= 65535, "vocab ", vocab, " is too wide for the gradient kernel's grid");
    if (rows == 0) return;
    const int device = logits.get_device();
    const void* lp = logits.data_ptr();
    const void* tp = targets.data_ptr();
    const void* sp = tensor(stats_).data_ptr();
    const void* ep = tensor(entropy_).data_ptr();
    const void* gl = g_logp_ != nullptr ? tensor(g_logp_).data_ptr() : nullptr;
    const void* ge = g_ent_ != nullptr ? tensor(g_ent_).data_ptr() : nullptr;
    void* op = out.data_ptr();
    float inv_t = 1.0f / static_cast<float>(temperature);
    int vocab_i = static_cast<int>(vocab);
    int vec4 = vocab % 4 == 0 && aligned16({lp}) && reinterpret_cast<uintptr_t>(op) % 8 == 0;
    void* args[] = {&lp, &tp, &sp, &ep, &gl, &ge, &inv_t, &vocab_i, &vec4, &op};
    launch(kernel(source, "", half ? "logprob_grad_f16" : "logprob_grad_bf16", device), device,
           static_cast<unsigned>(rows), static_cast<unsigned>(tiles), 1, 256, args);
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// `param.grad = grad` (tch has no setter): a gradient computed outside autograd becomes the
// parameter's, as autograd's first accumulation would make it.
int manta_set_grad(void* param_, void* grad_) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    at::Tensor& param = *static_cast<at::Tensor*>(param_);
    const at::Tensor& grad = tensor(grad_);
    TORCH_CHECK(grad.sizes() == param.sizes() && grad.scalar_type() == param.scalar_type() &&
                    grad.device() == param.device(),
                "a gradient must match its parameter's shape, kind and device");
    param.mutable_grad() = grad;
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// Compiles every decode kernel for one model shape and sm_<arch> without a GPU (NVRTC
// needs none), with the defines a launch would use, so CPU test machines catch what would
// fail on the device.
int manta_decode_kernels_compile_check(const char* paged_source, const char* fused_source, int hidden,
                                       int intermediate, int heads, int kv_heads, int head_dim, int qk_norm,
                                       int arch) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of kv_heads");
    compile_kernels(fused_source, define("HD", head_dim), arch);
    // The default lanes per token, and a whole warp per token (MANTA_PAGED_LANES=32), at
    // the engine's default block size.
    for (int64_t lanes : {paged_lanes(head_dim), int64_t{32}})
      compile_kernels(paged_source, paged_defines(head_dim, heads / kv_heads, kv_heads, lanes, 16), arch);
    if (head_dim == 64 || head_dim == 128)
      compile_kernels(paged_source, paged_mma_defines(head_dim, heads / kv_heads, kv_heads, 16), arch);
    // The small kernels with wide and with scalar accesses (the latter for unaligned rows).
    for (int64_t aligned : {1, 0}) {
      compile_kernels(fused_source,
                      qk_norm_rope_defines(head_dim, heads, kv_heads, qk_norm != 0, aligned ? head_dim / 32 : 1), arch);
      compile_kernels(fused_source, rms_norm_defines(hidden, small_kernel_vec(hidden, aligned)), arch);
      compile_kernels(fused_source, silu_defines(intermediate, small_kernel_vec(intermediate, aligned)), arch);
    }
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// One AdamW update of a rank's flat fp32 state from its bf16 gradient (optimizer.cu.inc,
// adamw_bf16_grad): `grad` bf16, `master`, `exp_avg`, `exp_avg_sq` fp32, `param` (may be
// null) the bf16 copy refreshed from the master, all contiguous, of one length, on one
// GPU. The hyperparameters are narrowed to fp32 here as ATen's fused AdamW narrows them
// (`step` as its fp32 step tensor); `grad_scale` as mul_'s scalar, applied when `scaled`.
int manta_adamw_bf16_grad(const char* source, void* grad_, void* master_, void* exp_avg_, void* exp_avg_sq_,
                          void* param_, int scaled, double grad_scale, double lr, double beta1, double beta2,
                          double weight_decay, double eps, double step) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    const at::Tensor& grad = tensor(grad_);
    const at::Tensor& master = tensor(master_);
    const at::Tensor& exp_avg = tensor(exp_avg_);
    const at::Tensor& exp_avg_sq = tensor(exp_avg_sq_);
    TORCH_CHECK(master.is_cuda() && master.scalar_type() == at::kFloat && master.is_contiguous(),
                "master must be a contiguous fp32 CUDA tensor");
    const int64_t n = master.numel();
    for (const at::Tensor* t : {&exp_avg, &exp_avg_sq}) {
      TORCH_CHECK(t->device() == master.device() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                      t->numel() == n,
                  "the moments must be contiguous fp32 tensors as long as the master (", n, ") on its device");
    }
    check_bf16(grad, "grad");
    TORCH_CHECK(grad.device() == master.device() && grad.numel() == n, "grad must have the master's ", n,
                " elements on its device, has ", grad.numel(), " on ", grad.device());
    void* param_ptr = nullptr;
    if (param_ != nullptr) {
      const at::Tensor& param = tensor(param_);
      check_bf16(param, "param");
      TORCH_CHECK(param.device() == master.device() && param.numel() == n, "param must have the master's ", n,
                  " elements on its device, has ", param.numel(), " on ", param.device());
      param_ptr = param.data_ptr();
    }
    if (n == 0) return;
    const int device = master.get_device();
    const void* gp = grad.data_ptr();
    void* mp = master.data_ptr();
    void* ap = exp_avg.data_ptr();
    void* sp = exp_avg_sq.data_ptr();
    auto aligned = [](const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; };
    const bool wide = aligned(mp, 16) && aligned(ap, 16) && aligned(sp, 16) && aligned(gp, 8) &&
                      (param_ptr == nullptr || aligned(param_ptr, 8));
    const int64_t per_thread = wide ? 4 : 1;
    const int64_t sms = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(device))->multiProcessorCount;
    // Four blocks an SM (the v4 kernel's 45 registers fit five): one wave, whose threads
    // stride over the shard and work out the bias corrections once each.
    const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((n / per_thread + 255) / 256, sms * 4));
    long long n_ll = n;
    int scaled_i = scaled != 0;
    float scale_f = static_cast<float>(grad_scale), lr_f = static_cast<float>(lr);
    float beta1_f = static_cast<float>(beta1), beta2_f = static_cast<float>(beta2);
    float wd_f = static_cast<float>(weight_decay), eps_f = static_cast<float>(eps), step_f = static_cast<float>(step);
    void* args[] = {&gp,     &mp,     &ap,      &sp,      &param_ptr, &n_ll, &scaled_i,
                    &scale_f, &lr_f, &beta1_f, &beta2_f, &wd_f,      &eps_f, &step_f};
    launch(kernel(source, "", wide ? "adamw_bf16_grad_v4" : "adamw_bf16_grad_v1", device), device,
           static_cast<unsigned>(blocks), 1, 1, 256, args);
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

// Σ x² of the flat bf16 or fp32 CUDA tensor `x` in fp64 into `out` (a one-element fp64
// tensor on x's device), in optimizer.cu.inc's fixed order: SQ_BLOCKS (528) partials,
// then one block adds them.
int manta_sum_of_squares(const char* source, void* x_, void* out_) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    const at::Tensor& x = tensor(x_);
    at::Tensor& out = *static_cast<at::Tensor*>(out_);
    TORCH_CHECK(x.is_cuda() && x.is_contiguous() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
                "x must be a contiguous bf16 or fp32 CUDA tensor, is ", x.scalar_type(), " on ", x.device());
    TORCH_CHECK(out.device() == x.device() && out.scalar_type() == at::kDouble && out.is_contiguous() && out.numel() == 1,
                "out must be one fp64 element on x's device");
    constexpr int64_t kBlocks = 528;  // SQ_BLOCKS
    const int device = x.get_device();
    at::Tensor partials = at::empty({kBlocks}, x.options().dtype(at::kDouble));
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    const bool wide = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
    const char* name = bf16 ? (wide ? "sum_squares_bf16_v16" : "sum_squares_bf16_v1")
                            : (wide ? "sum_squares_f32_v8" : "sum_squares_f32_v1");
    const void* xp = x.data_ptr();
    void* pp = partials.data_ptr();
    const void* pc = pp;
    void* op = out.data_ptr();
    long long n = x.numel();
    void* args[] = {&xp, &n, &pp};
    launch(kernel(source, "", name, device), device, kBlocks, 1, 1, 256, args);
    void* final_args[] = {&pc, &op};
    launch(kernel(source, "", "sum_partials", device), device, 1, 1, 1, 256, final_args);
  });
#else
  last_error() = "built without CUDA";
  return 1;
#endif
}

}

#ifdef MANTA_WITH_CUDA
namespace manta {
// plain_kernel.hpp: for the fused-op shims (rope.cpp, rms_norm.cpp, swiglu.cpp).
void launch_plain_kernel(const char* source, const char* name, int device, unsigned blocks, unsigned threads,
                         void** args) {
  launch(kernel(source, "", name, device), device, blocks, 1, 1, threads, args);
}
}  // namespace manta
#endif
