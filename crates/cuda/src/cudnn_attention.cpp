// Prefill attention of packed variable-length sequences through cuDNN's fused flash
// attention (its Hopper kernel: warpgroup MMA, TMA). On an H200 at the peer benchmark's
// prefill chunks (16 sequences of 512 tokens, head_dim 128) it takes 101 µs where
// libtorch's FlashAttention-2 varlen takes 243 µs (8B heads) and 55 vs 125 µs (0.6B).
// libtorch reaches the same kernel only through a call that builds its cuDNN graph anew on
// every call (~50 ms), so this file builds the graph with cuDNN's frontend itself and keeps
// it, one per shape bucket: sequences and lengths round up to powers of two, and the real
// lengths travel in device tensors (a padding mask), so a run builds a few graphs, not one
// per prefill. cuDNN is the one libtorch already loads (libcudnn.so.9); the frontend
// (header-only, the nvidia-cudnn-frontend wheel) resolves its entry points from it.
// Every function catches C++ exceptions and returns non-zero with the message kept for
// manta_cuda_last_error().
#include "guarded.hpp"
#include <cstdint>
#include <string>

#if defined(MANTA_WITH_CUDA) && defined(MANTA_WITH_CUDNN)
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#include <ATen/ATen.h>
#include <ATen/cudnn/Handle.h>
#include <c10/core/DeviceGuard.h>
#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

// The frontend's handle on libcudnn, set before the first graph is built.
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}

namespace {

namespace fe = cudnn_frontend;
using manta::guarded;
using manta::last_error;

// The graph's tensors, by the ids the variant pack names them with.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kSeqQ, kSeqKv, kOffQ, kOffKv, kOffV };

// One cached graph per bucket. `b` is the sequence count rounded up to a power of two
// (the lengths tensor's size tells it); `sq` and `skv` the longest query and key runs
// rounded up to powers of two (at least 64).
struct Key {
  int device;
  bool half;
  int64_t b, hq, hkv, d, sq, skv;
  bool bottom_right;
  uint32_t scale_bits;
  auto tie() const { return std::tie(device, half, b, hq, hkv, d, sq, skv, bottom_right, scale_bits); }
  bool operator<(const Key& o) const { return tie() < o.tie(); }
};

// A built graph and its workspace, or why cuDNN would not take the bucket (kept, so a
// bucket it refuses costs one attempt, and the caller falls back every time after).
struct Entry {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace = 0;
  std::string refused;
};

std::mutex& graphs_mutex() {
  static std::mutex m;
  return m;
}
std::map<Key, Entry>& graphs() {
  static std::map<Key, Entry> g;
  return g;
}

int64_t pow2_at_least(int64_t n, int64_t floor) {
  int64_t b = floor;
  while (b < n) b *= 2;
  return b;
}

void load_cudnn() {
  if (fe::cudnn_dlhandle != nullptr) return;
  // libtorch_cuda links libcudnn.so.9, so it is normally loaded already.
  void* lib = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) lib = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_GLOBAL);
  TORCH_CHECK(lib != nullptr, "cannot load libcudnn.so.9: ", dlerror());
  fe::cudnn_dlhandle = lib;
}

// Builds the bucket's graph: Q, K, V and O in the packed [tokens, heads, head_dim] layout
// (cuDNN's THD: each sequence's rows start at its ragged offset, in elements), a padding
// mask from per-sequence lengths, causal within each sequence (the diagonal at the bottom
// right where a sequence has more keys than queries: its cached prefix).
Entry build(const Key& k, float scale, cudnnHandle_t handle) {
  Entry e;
  auto refuse = [&](const char* stage, fe::error_t st) {
    e.graph.reset();
    e.refused = std::string(stage) + ": " + st.get_message();
    return e;
  };
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(k.half ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto ints = [&](const char* name, int64_t uid, int64_t n) {
    return g->tensor(fe::graph::Tensor_attributes()
                         .set_name(name)
                         .set_uid(uid)
                         .set_dim({n, 1, 1, 1})
                         .set_stride({1, 1, 1, 1})
                         .set_data_type(fe::DataType_t::INT32));
  };
  auto seq_q = ints("seq_q", kSeqQ, k.b);
  auto seq_kv = ints("seq_kv", kSeqKv, k.b);
  auto off_q = ints("off_q", kOffQ, k.b + 1);
  auto off_k = ints("off_k", kOffKv, k.b + 1);
  auto off_v = ints("off_v", kOffV, k.b + 1);
  auto packed = [&](const char* name, int64_t uid, int64_t heads, int64_t s,
                    const std::shared_ptr<fe::graph::Tensor_attributes>& offsets) {
    return g->tensor(fe::graph::Tensor_attributes()
                         .set_name(name)
                         .set_uid(uid)
                         .set_dim({k.b, heads, s, k.d})
                         .set_stride({s * heads * k.d, k.d, heads * k.d, 1})
                         .set_ragged_offset(offsets));
  };
  auto q = packed("Q", kQ, k.hq, k.sq, off_q);
  auto kk = packed("K", kK, k.hkv, k.skv, off_k);
  auto v = packed("V", kV, k.hkv, k.skv, off_v);
  auto options = fe::graph::SDPA_attributes()
                     .set_name("prefill")
                     .set_generate_stats(false)
                     .set_attn_scale(scale)
                     .set_padding_mask(true)
                     .set_seq_len_q(seq_q)
                     .set_seq_len_kv(seq_kv);
  if (k.bottom_right) {
    options.set_causal_mask_bottom_right(true);
  } else {
    options.set_causal_mask(true);
  }
  auto [o, stats] = g->sdpa(q, kk, v, options);
  (void)stats;
  // O shares Q's layout, so it takes Q's offsets (same uid: one pointer in the pack).
  o->set_output(true)
      .set_uid(kO)
      .set_dim({k.b, k.hq, k.sq, k.d})
      .set_stride({k.sq * k.hq * k.d, k.d, k.hq * k.d, 1})
      .set_ragged_offset(off_q);
  if (auto st = g->validate(); !st.is_good()) return refuse("validate", st);
  if (auto st = g->build_operation_graph(handle); !st.is_good()) return refuse("build_operation_graph", st);
  if (auto st = g->create_execution_plans({fe::HeurMode_t::A}); !st.is_good())
    return refuse("create_execution_plans", st);
  if (auto st = g->check_support(handle); !st.is_good()) return refuse("check_support", st);
  if (auto st = g->build_plans(handle); !st.is_good()) return refuse("build_plans", st);
  if (auto st = g->get_workspace_size(e.workspace); !st.is_good()) return refuse("get_workspace_size", st);
  e.graph = std::move(g);
  return e;
}

void check_packed(const at::Tensor& t, const at::Tensor& q, const char* what) {
  TORCH_CHECK(t.is_cuda() && t.device() == q.device() && t.scalar_type() == q.scalar_type(), what,
              " must be a ", q.scalar_type(), " tensor on ", q.device(), ", is ", t.scalar_type(), " on ",
              t.device());
  TORCH_CHECK(t.dim() == 3 && t.is_contiguous(), what, " must be contiguous [tokens, heads, head_dim], is ",
              t.sizes(), t.is_contiguous() ? "" : " (not contiguous)");
}

}  // namespace
#endif

extern "C" {

int manta_cudnn_attention_built() {
#if defined(MANTA_WITH_CUDA) && defined(MANTA_WITH_CUDNN)
  return 1;
#else
  return 0;
#endif
}

// Causal attention of packed sequences: q [total_q, hq, d], k and v [total_k, hkv, d]
// (contiguous, bf16 or fp16, one CUDA device); `lengths` int32 on that device, 4b + 2
// entries for b sequence slots (a power of two; unused slots have length 0 and the last
// offset): each slot's query count, then its key count, then b + 1 query offsets and b + 1
// key offsets in elements (token offset × heads × d). `max_q` and `max_k` bound the
// lengths. A new tensor like q in *out.
int manta_cudnn_attention_varlen(void* q_, void* k_, void* v_, void* lengths_, int64_t max_q, int64_t max_k,
                                 double scale, void** out) {
#if defined(MANTA_WITH_CUDA) && defined(MANTA_WITH_CUDNN)
  return guarded([&] {
    const at::Tensor& q = *static_cast<at::Tensor*>(q_);
    const at::Tensor& k = *static_cast<at::Tensor*>(k_);
    const at::Tensor& v = *static_cast<at::Tensor*>(v_);
    const at::Tensor& lengths = *static_cast<at::Tensor*>(lengths_);
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
                "q must be bf16 or fp16, is ", q.scalar_type());
    check_packed(q, q, "q");
    check_packed(k, q, "k");
    check_packed(v, q, "v");
    TORCH_CHECK(k.sizes() == v.sizes(), "k and v must have one shape, are ", k.sizes(), " and ", v.sizes());
    TORCH_CHECK(q.size(2) == k.size(2) && q.size(1) % k.size(1) == 0,
                "q's heads must be a multiple of k's and their head_dim equal: q ", q.sizes(), ", k ", k.sizes());
    TORCH_CHECK(lengths.device() == q.device() && lengths.scalar_type() == at::kInt && lengths.is_contiguous() &&
                    lengths.dim() == 1 && lengths.numel() >= 6 && (lengths.numel() - 2) % 4 == 0,
                "lengths must be int32 [4b + 2] on q's device, is ", lengths.scalar_type(), " ", lengths.sizes(),
                " on ", lengths.device());
    const int64_t b = (lengths.numel() - 2) / 4;
    TORCH_CHECK((b & (b - 1)) == 0, "lengths must hold a power-of-two count of sequence slots, holds ", b);
    TORCH_CHECK(q.numel() < INT32_MAX && k.numel() < INT32_MAX, "cuDNN's 32-bit ragged offsets cannot address ",
                std::max(q.numel(), k.numel()), " elements");
    const c10::DeviceGuard guard(q.device());  // (the CUDA guard would link cudart itself)
    load_cudnn();
    const float fscale = static_cast<float>(scale);
    uint32_t scale_bits;
    std::memcpy(&scale_bits, &fscale, sizeof scale_bits);
    const Key key{q.get_device(),
                  q.scalar_type() == at::kHalf,
                  b,
                  q.size(1),
                  k.size(1),
                  q.size(2),
                  pow2_at_least(max_q, 64),
                  pow2_at_least(max_k, 64),
                  q.size(0) != k.size(0),
                  scale_bits};
    cudnnHandle_t handle = at::native::getCudnnHandle();  // on the current stream
    std::shared_ptr<fe::graph::Graph> graph;
    int64_t workspace = 0;
    {
      std::lock_guard<std::mutex> lock(graphs_mutex());
      auto it = graphs().find(key);
      if (it == graphs().end()) it = graphs().emplace(key, build(key, fscale, handle)).first;
      TORCH_CHECK(it->second.graph != nullptr, "cuDNN refused this attention shape (", it->second.refused, ")");
      graph = it->second.graph;
      workspace = it->second.workspace;
    }
    at::Tensor o = at::empty_like(q);
    at::Tensor ws = at::empty({std::max<int64_t>(workspace, 1)}, q.options().dtype(at::kByte));
    int32_t* len = lengths.data_ptr<int32_t>();
    std::unordered_map<int64_t, void*> pack = {
        {kQ, q.data_ptr()},       {kK, k.data_ptr()},         {kV, v.data_ptr()},
        {kO, o.data_ptr()},       {kSeqQ, len},               {kSeqKv, len + b},
        {kOffQ, len + 2 * b},     {kOffKv, len + 3 * b + 1},  {kOffV, len + 3 * b + 1},
    };
    auto st = graph->execute(handle, pack, ws.data_ptr());
    TORCH_CHECK(st.is_good(), "cuDNN attention failed: ", st.get_message());
    *out = new at::Tensor(std::move(o));
  });
#else
  (void)q_; (void)k_; (void)v_; (void)lengths_; (void)max_q; (void)max_k; (void)scale; (void)out;
  manta::last_error() = "built without cuDNN attention (no cuDNN or cudnn-frontend headers)";
  return 1;
#endif
}

}  // extern "C"
