// cuBLASLt algorithms for a decode step's projections (diagnostic).
//
// For each projection y[m,n] = x[m,k] · W[n,k]ᵀ (bf16 in and out, fp32 accumulate) asks
// cuBLASLt's heuristic for up to 64 algorithms, times every one over four weight copies
// (so L2 cannot hold the weight), and prints the heuristic's first choice, the fastest,
// and the fastest's tile / split-K / stages. The question it answers: is there a faster
// cuBLAS kernel for 64-row projections (or 8,192-row prefill chunks) than the one the
// default path takes? Operands hold random bf16 values in [-1, 1): a GEMM's power draw,
// and with it the clock a compute-bound one runs at, depends on the bits it multiplies.
//
// build: bench/cpp/build_probe_cublaslt.sh   run: probe_cublaslt SHAPE(0.6b|8b) ROWS...
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CHECK_CUDA(x)                                                                    \
  do {                                                                                   \
    cudaError_t e = (x);                                                                 \
    if (e != cudaSuccess) {                                                              \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)
#define CHECK_LT(x)                                                                      \
  do {                                                                                   \
    cublasStatus_t s = (x);                                                              \
    if (s != CUBLAS_STATUS_SUCCESS) {                                                    \
      std::fprintf(stderr, "%s:%d %s: status %d\n", __FILE__, __LINE__, #x, (int)s);      \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

struct Proj {
  const char* name;
  int n, k;
};

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s SHAPE(0.6b|8b) ROWS [ROWS...]\n", argv[0]);
    return 2;
  }
  std::string shape = argv[1];
  int hidden, inter, q, kv;
  if (shape == "8b") {
    hidden = 4096, inter = 12288, q = 32 * 128, kv = 8 * 128;
  } else if (shape == "0.6b") {
    hidden = 1024, inter = 3072, q = 16 * 128, kv = 8 * 128;
  } else {
    std::fprintf(stderr, "unknown shape %s\n", argv[1]);
    return 2;
  }
  std::vector<Proj> projs = {{"qkv", q + 2 * kv, hidden},
                             {"o", hidden, q},
                             {"gate_up", 2 * inter, hidden},
                             {"down", hidden, inter}};
  cublasLtHandle_t lt;
  CHECK_LT(cublasLtCreate(&lt));
  cublasHandle_t blas;
  CHECK_LT(cublasCreate(&blas));
  cudaStream_t st;
  CHECK_CUDA(cudaStreamCreate(&st));
  CHECK_LT(cublasSetStream(blas, st));
  size_t ws_bytes = 64 << 20;
  void* ws;
  CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
  CHECK_LT(cublasSetWorkspace(blas, ws, ws_bytes));
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  const int copies = 4;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  // Random bf16 (truncated fp32) in [-1, 1), copied to the device.
  auto fill_random = [&](void* dst, size_t elems) {
    std::vector<uint16_t> host(elems);
    for (auto& h : host) {
      float f = uniform(rng);
      uint32_t bits;
      std::memcpy(&bits, &f, sizeof bits);
      h = static_cast<uint16_t>(bits >> 16);
    }
    CHECK_CUDA(cudaMemcpy(dst, host.data(), elems * 2, cudaMemcpyHostToDevice));
  };

  for (int ai = 2; ai < argc; ++ai) {
    int m = std::atoi(argv[ai]);
    double sum_default = 0, sum_h0 = 0, sum_best = 0;
    for (auto& p : projs) {
      std::vector<void*> w(copies);
      for (auto& ptr : w) {
        CHECK_CUDA(cudaMalloc(&ptr, (size_t)p.n * p.k * 2));
        fill_random(ptr, (size_t)p.n * p.k);
      }
      void *x, *y;
      CHECK_CUDA(cudaMalloc(&x, (size_t)m * p.k * 2));
      fill_random(x, (size_t)m * p.k);
      // About 20 ms of GEMMs per timing at 989 TFLOP/s, at least 3 and at most 40 calls.
      const double flops = 2.0 * m * p.n * p.k;
      const int reps = std::max(3, std::min(40, (int)(20e-3 * 989e12 / flops)));
      CHECK_CUDA(cudaMalloc(&y, (size_t)m * p.n * 2));
      float alpha = 1.f, beta = 0.f;

      // Column-major view: yᵀ (n × m) = op(A) · B with A = W stored k × n (transposed), B = x stored k × m.
      cublasLtMatmulDesc_t op;
      CHECK_LT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
      CHECK_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
      CHECK_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
      cublasLtMatrixLayout_t la, lb, lc;
      CHECK_LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, p.k, p.n, p.k));
      CHECK_LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, p.k, m, p.k));
      CHECK_LT(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, p.n, m, p.n));
      cublasLtMatmulPreference_t pref;
      CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
      CHECK_LT(cublasLtMatmulPreferenceSetAttribute(
          pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
      std::vector<cublasLtMatmulHeuristicResult_t> heur(64);
      int found = 0;
      CHECK_LT(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 64, heur.data(),
                                              &found));

      auto timed = [&](auto&& call) {
        for (int i = 0; i < 5; ++i) call(i % copies);
        CHECK_CUDA(cudaStreamSynchronize(st));
        std::vector<float> t;
        for (int r = 0; r < 5; ++r) {
          CHECK_CUDA(cudaEventRecord(a, st));
          for (int i = 0; i < reps; ++i) call(i % copies);
          CHECK_CUDA(cudaEventRecord(b, st));
          CHECK_CUDA(cudaEventSynchronize(b));
          float ms;
          CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
          t.push_back(ms * 1e3f / reps);
        }
        std::sort(t.begin(), t.end());
        return t[2];
      };
      // What torch's default bf16 linear does: cublasGemmEx, fp32 compute.
      float t_default = timed([&](int c) {
        CHECK_LT(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, p.n, m, p.k, &alpha, w[c],
                              CUDA_R_16BF, p.k, x, CUDA_R_16BF, p.k, &beta, y, CUDA_R_16BF,
                              p.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      });
      float t_h0 = -1, t_best = 1e30f;
      int best = -1;
      for (int h = 0; h < found; ++h) {
        bool failed = false;
        float t = timed([&](int c) {
          if (failed) return;
          if (cublasLtMatmul(lt, op, &alpha, w[c], la, x, lb, &beta, y, lc, y, lc,
                             &heur[h].algo, ws, ws_bytes, st) != CUBLAS_STATUS_SUCCESS)
            failed = true;
        });
        if (failed) continue;
        if (m >= 1024) std::printf("    candidate #%2d %8.1f us %5.0f TFLOP/s\n", h, t, flops / t / 1e6);
        if (h == 0) t_h0 = t;
        if (t < t_best) t_best = t, best = h;
      }
      int tile = -1, splitk = -1, stages = -1, red = -1, swizzle = -1, algo_id = -1;
      size_t wr;
      if (best >= 0) {
        auto& al = heur[best].algo;
        cublasLtMatmulAlgoConfigGetAttribute(&al, CUBLASLT_ALGO_CONFIG_ID, &algo_id, sizeof algo_id, &wr);
        cublasLtMatmulAlgoConfigGetAttribute(&al, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &wr);
        cublasLtMatmulAlgoConfigGetAttribute(&al, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk, &wr);
        cublasLtMatmulAlgoConfigGetAttribute(&al, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages, &wr);
        cublasLtMatmulAlgoConfigGetAttribute(&al, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &red, sizeof red, &wr);
        cublasLtMatmulAlgoConfigGetAttribute(&al, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle, sizeof swizzle, &wr);
      }
      double gb = (double)p.n * p.k * 2 / 1e3;
      std::printf(
          "%s rows %4d %8s n=%6d k=%6d: gemmEx %7.1f us (%4.0f GB/s) | lt[0] %7.1f | lt best "
          "#%2d/%2d %7.1f us (%4.0f GB/s) algo %d tile %d splitk %d stages %d red %d swz %d | "
          "TFLOP/s gemmEx %.0f best %.0f\n",
          shape.c_str(), m, p.name, p.n, p.k, t_default, gb / t_default, t_h0, best, found,
          t_best, gb / t_best, algo_id, tile, splitk, stages, red, swizzle,
          flops / t_default / 1e6, flops / t_best / 1e6);
      std::fflush(stdout);
      int layers = shape == "8b" ? 36 : 28;
      sum_default += t_default * layers;
      sum_h0 += t_h0 * layers;
      sum_best += t_best * layers;
      cublasLtMatmulPreferenceDestroy(pref);
      cublasLtMatrixLayoutDestroy(la);
      cublasLtMatrixLayoutDestroy(lb);
      cublasLtMatrixLayoutDestroy(lc);
      cublasLtMatmulDescDestroy(op);
      for (auto ptr : w) cudaFree(ptr);
      cudaFree(x);
      cudaFree(y);
    }
    std::printf("%s rows %4d all layers: gemmEx %.0f us, lt[0] %.0f us, lt best %.0f us\n",
                shape.c_str(), m, sum_default, sum_h0, sum_best);
  }
  return 0;
}
