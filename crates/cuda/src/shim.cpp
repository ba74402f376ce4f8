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

}
