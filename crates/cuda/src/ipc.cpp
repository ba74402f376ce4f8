// CUDA IPC for weight sync between processes on one GPU: export a tensor's device
// allocation as an IPC handle (plus the data pointer's offset from the allocation base),
// map such a handle in another process, and view or copy tensors out of the mapping.
// Driver API functions come from dlopen("libcuda.so.1"), as in shim.cpp; tensors and the
// current device go through libtorch. Every function catches C++ exceptions and returns
// non-zero with the message kept for manta_ipc_last_error().
#include "guarded.hpp"
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#ifdef MANTA_WITH_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <dlfcn.h>
#endif

namespace {
using manta::guarded;
using manta::last_error;

#ifdef MANTA_WITH_CUDA
void* ipc_driver() {
  static void* driver = nullptr;
  if (driver == nullptr) {
    driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(driver != nullptr, "cannot load libcuda.so.1: ", dlerror());
  }
  return driver;
}

// A driver function by its exported (versioned) name, typed by the header's declaration.
template <typename Fn>
Fn ipc_sym(const char* name) {
  void* f = dlsym(ipc_driver(), name);
  TORCH_CHECK(f != nullptr, "libcuda.so.1 has no symbol ", name);
  return reinterpret_cast<Fn>(f);
}

void ipc_check(CUresult rc, const char* what) {
  if (rc == CUDA_SUCCESS) return;
  const char* msg = nullptr;
  ipc_sym<decltype(&cuGetErrorString)>("cuGetErrorString")(rc, &msg);
  TORCH_CHECK(false, what, " failed: ", msg ? msg : "unknown error", " (CUresult ", static_cast<int>(rc), ")");
}

// Makes `device` current through libtorch, so its primary context is the driver's
// current context for the calls that follow.
void ipc_use_device(int device) {
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
  // A no-op stream query initialises the context if this thread never used the device.
  (void)c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
}
#endif
}  // namespace

extern "C" {

const char* manta_ipc_last_error() { return last_error().c_str(); }

// The IPC handle of the allocation holding `tensor_`'s data, the data pointer's offset
// from that allocation's base, the base itself (allocations repeat across tensors) and
// the device index.
int manta_ipc_export(void* tensor_, unsigned char* handle_out, uint64_t* offset, uint64_t* base_out,
                     int* device) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    const at::Tensor& t = *static_cast<at::Tensor*>(tensor_);
    TORCH_CHECK(t.is_cuda(), "CUDA IPC export needs a CUDA tensor, got one on ", t.device().str());
    ipc_use_device(t.get_device());
    auto ptr = reinterpret_cast<CUdeviceptr>(t.data_ptr());
    CUdeviceptr base = 0;
    size_t size = 0;
    ipc_check(ipc_sym<decltype(&cuMemGetAddressRange)>("cuMemGetAddressRange_v2")(&base, &size, ptr),
              "cuMemGetAddressRange");
    CUipcMemHandle handle;
    ipc_check(ipc_sym<decltype(&cuIpcGetMemHandle)>("cuIpcGetMemHandle")(&handle, base), "cuIpcGetMemHandle");
    std::memcpy(handle_out, handle.reserved, CU_IPC_HANDLE_SIZE);
    *offset = static_cast<uint64_t>(ptr - base);
    *base_out = static_cast<uint64_t>(base);
    *device = t.get_device();
  });
#else
  last_error() = "manta-cuda was built without CUDA: no CUDA IPC";
  return 1;
#endif
}

// Maps an exported allocation into this process on `device`; writes its base address.
int manta_ipc_open(const unsigned char* handle_in, int device, uint64_t* base_out) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    ipc_use_device(device);
    CUipcMemHandle handle;
    std::memcpy(handle.reserved, handle_in, CU_IPC_HANDLE_SIZE);
    CUdeviceptr base = 0;
    ipc_check(ipc_sym<decltype(&cuIpcOpenMemHandle)>("cuIpcOpenMemHandle_v2")(
                  &base, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
              "cuIpcOpenMemHandle");
    *base_out = static_cast<uint64_t>(base);
  });
#else
  last_error() = "manta-cuda was built without CUDA: no CUDA IPC";
  return 1;
#endif
}

// A tensor viewing `base + offset` (no ownership: valid while the mapping is open).
// `dtype` is a c10::ScalarType value.
void* manta_ipc_view(uint64_t base, uint64_t offset, const int64_t* shape, int ndim, int dtype, int device) {
#ifdef MANTA_WITH_CUDA
  void* out = nullptr;
  int rc = guarded([&] {
    TORCH_CHECK(base != 0, "CUDA IPC view of an unmapped allocation");
    std::vector<int64_t> sizes(shape, shape + ndim);
    auto options = at::TensorOptions()
                       .dtype(static_cast<at::ScalarType>(dtype))
                       .device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
    void* ptr = reinterpret_cast<void*>(base + offset);
    out = new at::Tensor(at::from_blob(ptr, sizes, [](void*) {}, options));
  });
  return rc == 0 ? out : nullptr;
#else
  last_error() = "manta-cuda was built without CUDA: no CUDA IPC";
  return nullptr;
#endif
}

// Unmaps an allocation opened with manta_ipc_open.
int manta_ipc_close(uint64_t base, int device) {
#ifdef MANTA_WITH_CUDA
  return guarded([&] {
    ipc_use_device(device);
    ipc_check(ipc_sym<decltype(&cuIpcCloseMemHandle)>("cuIpcCloseMemHandle")(static_cast<CUdeviceptr>(base)),
              "cuIpcCloseMemHandle");
  });
#else
  last_error() = "manta-cuda was built without CUDA: no CUDA IPC";
  return 1;
#endif
}
}
