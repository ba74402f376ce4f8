// The launcher the trainer's fused-op shims (rope.cpp, rms_norm.cpp, swiglu.cpp) share;
// defined in shim.cpp with the NVRTC kernel cache.
#pragma once

namespace manta {
// Kernel `name` of `source` (NUL-terminated, no defines), compiled for `device` once and
// cached, launched on libtorch's current stream over `blocks` × `threads` with `args`.
void launch_plain_kernel(const char* source, const char* name, int device, unsigned blocks, unsigned threads,
                         void** args);
}  // namespace manta
