// torch.distributed's TCPStore for Rust callers: libtorch's own c10d implementation, the
// rendezvous behind `init_process_group(init_method="tcp://…")` and SGLang's
// `init_weights_update_group`. Hosting or joining it through libtorch keeps Manta
// wire-compatible with those peers by construction. CPU only: no CUDA needed.
// Every function catches C++ exceptions and returns non-zero with the message kept for
// manta_store_last_error().
#include "guarded.hpp"
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {
using manta::guarded;
using manta::last_error;

using StorePtr = c10::intrusive_ptr<c10d::TCPStore>;

c10d::TCPStore& store(void* handle) { return **static_cast<StorePtr*>(handle); }
}  // namespace

extern "C" {

const char* manta_store_last_error() { return last_error().c_str(); }

// A store at host:port; the server (is_server) listens on `port` (0: any free port) and
// expects `world_size` members in all, itself included (0: unknown). Operations wait at
// most `timeout_ms` for a key or a connection.
int manta_tcp_store_new(const char* host, int port, int is_server, int world_size, long long timeout_ms,
                        void** out) {
  return guarded([&] {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<std::uint16_t>(port);
    opts.isServer = is_server != 0;
    if (world_size > 0) opts.numWorkers = static_cast<std::size_t>(world_size);
    opts.waitWorkers = false;
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    *out = new StorePtr(c10::make_intrusive<c10d::TCPStore>(std::string(host), opts));
  });
}

int manta_tcp_store_port(void* handle) { return static_cast<int>(store(handle).getPort()); }

int manta_tcp_store_set(void* handle, const char* key, const std::uint8_t* data, std::size_t len) {
  return guarded([&] { store(handle).set(key, std::vector<std::uint8_t>(data, data + len)); });
}

// The value of `key` once some member has set it; *data is malloc'ed (manta_store_free_bytes).
int manta_tcp_store_get(void* handle, const char* key, std::uint8_t** data, std::size_t* len) {
  return guarded([&] {
    std::vector<std::uint8_t> value = store(handle).get(key);
    *len = value.size();
    *data = static_cast<std::uint8_t*>(std::malloc(value.empty() ? 1 : value.size()));
    if (*data == nullptr) throw std::runtime_error("out of memory copying a store value");
    if (!value.empty()) std::memcpy(*data, value.data(), value.size());
  });
}

int manta_tcp_store_add(void* handle, const char* key, long long delta, long long* out) {
  return guarded([&] { *out = store(handle).add(key, delta); });
}

// Whether `key` is set, without waiting (a member polling can give up in between).
int manta_tcp_store_check(void* handle, const char* key, int* out) {
  return guarded([&] { *out = store(handle).check({std::string(key)}) ? 1 : 0; });
}

// Removes `key` (a no-op when it is unset), so a store carrying a stream of values stays bounded.
int manta_tcp_store_delete(void* handle, const char* key) {
  return guarded([&] { store(handle).deleteKey(key); });
}

void manta_store_free_bytes(std::uint8_t* data) { std::free(data); }

void manta_tcp_store_free(void* handle) {
  guarded([&] { delete static_cast<StorePtr*>(handle); });
}
}
