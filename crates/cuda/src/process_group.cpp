// An NCCL process group for Rust callers: libtorch's own c10d::ProcessGroupNCCL over
// libtorch's TCPStore, wrapped in the same PrefixStores that SGLang's
// `init_custom_process_group(backend="nccl", init_method="tcp://addr:port", ...)` builds
// in Python (its PrefixStore(group_name), then torch's `_new_process_group_helper`
// PrefixStore("<group_name>/") and PrefixStore("cuda/")). Rank 0 hosts the store, as
// torch's tcp:// rendezvous does, so a Manta rank and a Python/SGLang rank meet on the
// same keys and the same NCCL unique id.
// Every function catches C++ exceptions and returns non-zero with the message kept for
// manta_pg_last_error().
#include "guarded.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>

#if defined(MANTA_WITH_NCCL)
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL
#endif
#include <c10/core/DeviceGuard.h>
#include <c10/core/Stream.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#endif

namespace {
using manta::guarded;
using manta::last_error;

#if defined(MANTA_WITH_NCCL)
struct Group {
  c10::intrusive_ptr<c10d::TCPStore> store;
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg;
  int device;
  std::chrono::milliseconds timeout;
  // Set once the group was aborted: its communicators are gone, shutdown must not wait
  // for peers.
  std::shared_ptr<std::atomic<bool>> aborted = std::make_shared<std::atomic<bool>>(false);
  // The NCCL communicator exists (connect() succeeded). Until then an abort only sets
  // `aborted`: the communicator may still be in the making on connect()'s thread, which
  // ProcessGroupNCCL::abort must not race.
  std::shared_ptr<std::atomic<bool>> connected = std::make_shared<std::atomic<bool>>(false);
};

// What another thread needs to abort a group while its owner waits in a collective.
struct Aborter {
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg;
  std::shared_ptr<std::atomic<bool>> aborted;
  std::shared_ptr<std::atomic<bool>> connected;
};

Group& group(void* handle) { return *static_cast<Group*>(handle); }

// Where the communicator's setup thread reports back.
struct Connecting {
  std::mutex mutex;
  std::condition_variable changed;
  bool done = false;
  std::exception_ptr error;
};

// Creates the group's NCCL communicator before its first collective, bounded by the
// group's timeout and by an abort. NCCL's blocking setup waits without limit for a peer
// that failed half-way through its own (seen: a trainer's rank 0 out of memory in
// ncclCommInitRank left an engine waiting for nine minutes), and no abort reaches a
// communicator that is still being made. So the setup runs on a thread of its own; if it
// does not finish in time, that thread is left behind (holding its own reference to the
// process group, which is never freed) and the group is marked aborted. NCCL allocates
// its buffers outside libtorch's caching allocator: the blocks the allocator keeps but
// does not use are handed back to the driver first (a trainer that just ran a step
// holds most of its GPU that way).
void connect(Group& g) {
  c10::cuda::CUDACachingAllocator::emptyCache();
  auto state = std::make_shared<Connecting>();
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg = g.pg;
  const auto device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(g.device));
  std::thread([pg, device, state] {
    std::exception_ptr error;
    try {
      c10::DeviceGuard guard(device);
      pg->eagerConnectSingleDevice(device);
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(state->mutex);
    state->done = true;
    state->error = error;
    state->changed.notify_all();
  }).detach();
  const auto deadline = std::chrono::steady_clock::now() + g.timeout;
  std::unique_lock<std::mutex> lock(state->mutex);
  while (!state->done) {
    if (g.aborted->load()) {
      throw std::runtime_error(
          "the group was aborted while its NCCL communicator was being set up (a peer failed "
          "or went away)");
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      g.aborted->store(true);
      throw std::runtime_error(
          "setting up the NCCL communicator took longer than the group's timeout of " +
          std::to_string(g.timeout.count() / 1000) +
          " s: a peer failed or went away during its setup (the group is abandoned)");
    }
    state->changed.wait_for(lock, std::chrono::milliseconds(20));
  }
  if (state->error) {
    std::rethrow_exception(state->error);
  }
  g.connected->store(true);
}
#endif
}  // namespace

extern "C" {

const char* manta_pg_last_error() { return last_error().c_str(); }

// 1 when this build has ProcessGroupNCCL (CUDA libtorch, CUDA and NCCL headers).
int manta_pg_built_with_nccl() {
#if defined(MANTA_WITH_NCCL)
  return 1;
#else
  return 0;
#endif
}

// Joins the group `group_name` of `world_size` ranks as `rank` on CUDA device `device`.
// Rank 0 hosts the TCPStore on `port` (0: any free port, see manta_pg_store_port); the
// others connect to host:port. No collective runs yet: NCCL's communicator is created at
// the first broadcast on every rank (connect(), bounded by `timeout_ms`).
int manta_pg_nccl_join(const char* host, int port, int rank, int world_size, const char* group_name,
                       int device, long long timeout_ms, void** out) {
  return guarded([&] {
#if defined(MANTA_WITH_NCCL)
    const int count = static_cast<int>(c10::cuda::device_count());
    if (count == 0) {
      throw std::runtime_error(
          "NCCL needs a CUDA device: none is visible to this process (no GPU or no CUDA driver)");
    }
    if (device < 0 || device >= count) {
      throw std::runtime_error("device cuda:" + std::to_string(device) + ": this process sees " +
                               std::to_string(count) + " CUDA device(s)");
    }
    // c10's generic guard and stream calls go through libtorch's registered CUDA
    // implementation; c10::cuda's inline ones would call the CUDA runtime from this object
    // and make every binary link libcudart itself.
    c10::DeviceGuard guard(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device)));
    const auto timeout = std::chrono::milliseconds(timeout_ms);

    // torch.distributed's tcp:// rendezvous: rank 0 is the server (multi-tenant); every
    // member counts itself in under the store's init key (a Python server waits for all).
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<std::uint16_t>(port);
    opts.isServer = rank == 0;
    opts.numWorkers = static_cast<std::size_t>(world_size);
    // A Manta host must not block here: it tells the engines its port afterwards.
    opts.waitWorkers = rank != 0;
    opts.multiTenant = true;
    opts.timeout = timeout;
    auto* g = new Group{};
    try {
      g->store = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
      g->store->setTimeout(timeout);
      const std::string name(group_name);
      c10::intrusive_ptr<c10d::Store> sglang_prefix =
          c10::make_intrusive<c10d::PrefixStore>(name, g->store);
      c10::intrusive_ptr<c10d::Store> group_prefix =
          c10::make_intrusive<c10d::PrefixStore>(name + "/", sglang_prefix);
      c10::intrusive_ptr<c10d::Store> backend_prefix =
          c10::make_intrusive<c10d::PrefixStore>("cuda/", group_prefix);
      auto options = c10d::ProcessGroupNCCL::Options::create(/*is_high_priority_stream=*/false);
      options->timeout = timeout;
      options->group_name = name;
      g->pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(backend_prefix, rank, world_size, options);
      g->pg->setSequenceNumberForGroup();
      g->pg->setGroupUid(name);
      g->device = device;
      g->timeout = timeout;
    } catch (...) {
      delete g;
      throw;
    }
    *out = g;
#else
    (void)host; (void)port; (void)rank; (void)world_size; (void)group_name; (void)device;
    (void)timeout_ms; (void)out;
    throw std::runtime_error(
        "this build of manta-cuda has no NCCL process group (it was compiled without CUDA "
        "libtorch, CUDA headers or nccl.h)");
#endif
  });
}

// The port of the group's TCPStore (the one chosen when rank 0 hosted on port 0).
int manta_pg_store_port(void* handle) {
#if defined(MANTA_WITH_NCCL)
  return static_cast<int>(group(handle).store->getPort());
#else
  (void)handle;
  return 0;
#endif
}

// Broadcasts `n` tensors (at::Tensor*, contiguous, on the group's device) from rank
// `src`, one NCCL broadcast each in order (what torch.distributed.broadcast issues per
// tensor), and returns once every tensor holds the root's data on this device.
// `*enqueue_seconds`: how long issuing the n collectives took on the host, beside the
// whole call: a launch-bound broadcast shows as the two being close.
int manta_pg_broadcast(void* handle, void** tensors, int n, int src, double* enqueue_seconds) {
  return guarded([&] {
#if defined(MANTA_WITH_NCCL)
    Group& g = group(handle);
    c10::DeviceGuard guard(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(g.device)));
    c10d::BroadcastOptions opts;
    opts.rootRank = src;
    opts.rootTensor = 0;
    opts.timeout = g.timeout;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    works.reserve(static_cast<std::size_t>(n));
    const auto check_aborted = [&] {
      if (g.aborted->load()) {
        throw std::runtime_error("the group was aborted (a peer failed or went away)");
      }
    };
    check_aborted();
    if (!g.connected->load()) {
      connect(g);
      check_aborted();
    }
    const auto enqueue_start = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) {
      const at::Tensor& t = *static_cast<at::Tensor*>(tensors[i]);
      if (!t.is_cuda() || t.get_device() != g.device) {
        throw std::runtime_error("tensor " + std::to_string(i) + " is on " + t.device().str() +
                                 ", the group is on cuda:" + std::to_string(g.device));
      }
      std::vector<at::Tensor> one{t};
      works.push_back(g.pg->broadcast(one, opts));
    }
    for (auto& w : works) w->wait();
    if (enqueue_seconds != nullptr) {
      *enqueue_seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - enqueue_start).count();
    }
    c10::Stream stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(g.device));
    stream.synchronize();
    // An aborted NCCL kernel returns early with nothing received: not a success.
    check_aborted();
#else
    (void)handle; (void)tensors; (void)n; (void)src; (void)enqueue_seconds;
    throw std::runtime_error("this build of manta-cuda has no NCCL process group");
#endif
  });
}

// A handle that aborts the group from any thread (manta_pg_abort), valid until
// manta_pg_aborter_free whether or not the group itself was freed first.
void* manta_pg_aborter(void* handle) {
#if defined(MANTA_WITH_NCCL)
  Group& g = group(handle);
  return new Aborter{g.pg, g.aborted, g.connected};
#else
  (void)handle;
  return nullptr;
#endif
}

// Aborts the group's NCCL communicators (ncclCommAbort, as torch's watchdog does on a
// timeout): a collective waiting on a peer that will never come returns with an error.
int manta_pg_abort(void* aborter) {
  return guarded([&] {
#if defined(MANTA_WITH_NCCL)
    auto* a = static_cast<Aborter*>(aborter);
    if (!a->aborted->exchange(true) && a->connected->load()) {
      a->pg->abort();
    }
#else
    (void)aborter;
    throw std::runtime_error("this build of manta-cuda has no NCCL process group");
#endif
  });
}

void manta_pg_aborter_free(void* aborter) {
#if defined(MANTA_WITH_NCCL)
  delete static_cast<Aborter*>(aborter);
#else
  (void)aborter;
#endif
}

// Destroys the group as torch.distributed.destroy_process_group does (shutdown, which
// finalises the NCCL communicators), then closes the store. An aborted group has no
// communicators left to finalise.
void manta_pg_free(void* handle) {
#if defined(MANTA_WITH_NCCL)
  guarded([&] {
    Group* g = static_cast<Group*>(handle);
    if (g->pg && !g->aborted->load()) {
      if (guarded([&] { g->pg->shutdown(); }) != 0) {
        guarded([&] { g->pg->abort(); });
      }
    }
    delete g;
  });
#else
  (void)handle;
#endif
}
}
