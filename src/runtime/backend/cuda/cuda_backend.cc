// The CUDA backend: the only runtime code that includes CUDA headers.
//
// Streams are non-blocking (they do not synchronise with the legacy default
// stream); events are created with cudaEventDisableTiming (timing is done by
// the benchmarks themselves). Device memory comes from cudaMallocAsync /
// cudaFreeAsync on the caller's stream unless a DeviceAllocator is supplied.
// Every call goes through SPILLWAY_CUDA_CHECK; destructors log and never throw.

#include <cstdio>
#include <fstream>
#include <mutex>
#include <string>
#include <unordered_set>

#include "runtime/backend/backend.h"
#include "runtime/backend/cuda/cuda_check.h"
#include "runtime/thread_annotations.h"
#include "spillway/error.h"

#if defined(SPILLWAY_HAVE_NUMA)
#include <numa.h>
#endif

namespace spillway::runtime {
namespace {

template <typename F>
void log_on_failure(const char* what, F&& f) noexcept {
  try {
    f();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[cuda] %s: %s\n", what, e.what());
  }
}

class CudaStream final : public Stream {
 public:
  CudaStream(cudaStream_t stream, bool owned) : stream_(stream), owned_(owned) {}
  ~CudaStream() override {
    if (owned_) log_on_failure("destroying a stream", [&] {
        SPILLWAY_CUDA_CHECK(cudaStreamSynchronize(stream_));
        SPILLWAY_CUDA_CHECK(cudaStreamDestroy(stream_));
      });
  }
  void* native() const override { return stream_; }
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_;
  bool owned_;
};

class CudaEvent final : public Event {
 public:
  CudaEvent() { SPILLWAY_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
  ~CudaEvent() override {
    log_on_failure("destroying an event", [&] { SPILLWAY_CUDA_CHECK(cudaEventDestroy(event_)); });
  }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// Makes `device` current for a scope and restores the caller's device, so
// calls from a framework thread do not change its current device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    SPILLWAY_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) SPILLWAY_CUDA_CHECK(cudaSetDevice(device));
    else previous_ = -1;
  }
  ~DeviceGuard() {
    if (previous_ >= 0) {
      log_on_failure("restoring the current device",
                     [&] { SPILLWAY_CUDA_CHECK(cudaSetDevice(previous_)); });
    }
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

cudaStream_t as_cuda(Stream& s) { return static_cast<cudaStream_t>(s.native()); }
cudaEvent_t as_cuda(Event& e) { return static_cast<CudaEvent&>(e).get(); }

// A failure of work that ran before an event: CUDA reports it on the event.
[[noreturn]] void raise_transfer(const CudaError& e) {
  throw TransferError("cuda", std::string("work on a stream failed: ") + e.what());
}

class CudaBackend final : public Backend, public DeviceAllocator {
 public:
  explicit CudaBackend(int device) : device_(device) {
    int count = 0;
    SPILLWAY_CUDA_CHECK(cudaGetDeviceCount(&count));
    if (device < 0 || device >= count) {
      throw InvalidArgument("cuda", "device " + std::to_string(device) + " does not exist (" +
                                        std::to_string(count) + " visible)");
    }
  }

  std::string_view name() const override { return "cuda"; }

  std::unique_ptr<Stream> create_stream(FakeControls::Role) override {
    DeviceGuard guard(device_);
    cudaStream_t s = nullptr;
    SPILLWAY_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return std::make_unique<CudaStream>(s, true);
  }
  std::unique_ptr<Stream> wrap_stream(void* native) override {
    return std::make_unique<CudaStream>(static_cast<cudaStream_t>(native), false);
  }

  std::unique_ptr<Event> create_event() override {
    DeviceGuard guard(device_);
    return std::make_unique<CudaEvent>();
  }
  void record(Event& event, Stream& stream) override {
    SPILLWAY_CUDA_CHECK(cudaEventRecord(as_cuda(event), as_cuda(stream)));
  }
  void wait(Stream& stream, Event& event) override {
    SPILLWAY_CUDA_CHECK(cudaStreamWaitEvent(as_cuda(stream), as_cuda(event), 0));
  }
  bool query(Event& event) override {
    cudaError_t status = cudaEventQuery(as_cuda(event));
    if (status == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    try {
      SPILLWAY_CUDA_CHECK(status);
    } catch (const CudaError& e) {
      raise_transfer(e);
    }
    return true;
  }
  void synchronize(Event& event) override {
    try {
      SPILLWAY_CUDA_CHECK(cudaEventSynchronize(as_cuda(event)));
    } catch (const CudaError& e) {
      raise_transfer(e);
    }
  }
  void synchronize(Stream& stream) override {
    try {
      SPILLWAY_CUDA_CHECK(cudaStreamSynchronize(as_cuda(stream)));
    } catch (const CudaError& e) {
      raise_transfer(e);
    }
  }

  void* allocate_pinned(std::size_t bytes, int numa_node, int* placed_node) override {
    if (placed_node) *placed_node = -1;
    DeviceGuard guard(device_);
#if defined(SPILLWAY_HAVE_NUMA)
    if (numa_node >= 0 && numa_available() >= 0) {
      void* p = numa_alloc_onnode(bytes, numa_node);
      if (p) {
        try {
          SPILLWAY_CUDA_CHECK(cudaHostRegister(p, bytes, cudaHostRegisterPortable));
        } catch (const CudaError& e) {
          numa_free(p, bytes);
          throw OutOfMemory("cuda", e.what());
        }
        std::lock_guard<std::mutex> lock(mu_);
        numa_blocks_.insert(p);
        if (placed_node) *placed_node = numa_node;
        return p;
      }
    }
#else
    (void)numa_node;
#endif
    void* p = nullptr;
    try {
      SPILLWAY_CUDA_CHECK(cudaHostAlloc(&p, bytes == 0 ? 1 : bytes, cudaHostAllocPortable));
    } catch (const CudaError& e) {
      throw OutOfMemory("cuda", e.what());
    }
    return p;
  }
  void free_pinned(void* ptr, std::size_t bytes) noexcept override {
#if defined(SPILLWAY_HAVE_NUMA)
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (numa_blocks_.erase(ptr)) {
        log_on_failure("unregistering pinned memory",
                       [&] { SPILLWAY_CUDA_CHECK(cudaHostUnregister(ptr)); });
        numa_free(ptr, bytes);
        return;
      }
    }
#else
    (void)bytes;
#endif
    log_on_failure("freeing pinned memory", [&] { SPILLWAY_CUDA_CHECK(cudaFreeHost(ptr)); });
  }

  int device_numa_node() const override {
    char bus_id[32] = {};
    try {
      SPILLWAY_CUDA_CHECK(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device_));
    } catch (const CudaError&) {
      return -1;
    }
    std::string id(bus_id);
    for (char& c : id) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    std::ifstream in("/sys/bus/pci/devices/" + id + "/numa_node");
    int node = -1;
    if (!(in >> node)) return -1;
    return node;
  }

  DeviceAllocator& default_allocator() override { return *this; }

  void* allocate(std::size_t bytes, void* stream) override {
    DeviceGuard guard(device_);
    void* p = nullptr;
    try {
      SPILLWAY_CUDA_CHECK(
          cudaMallocAsync(&p, bytes == 0 ? 1 : bytes, static_cast<cudaStream_t>(stream)));
    } catch (const CudaError& e) {
      throw OutOfMemory("cuda", e.what());
    }
    return p;
  }
  void deallocate(void* ptr, std::size_t, void* stream) noexcept override {
    log_on_failure("freeing device memory", [&] {
      SPILLWAY_CUDA_CHECK(cudaFreeAsync(ptr, static_cast<cudaStream_t>(stream)));
    });
  }

  void copy(void* dst, const void* src, std::size_t bytes, CopyKind kind,
            Stream& stream) override {
    try {
      SPILLWAY_CUDA_CHECK(cudaMemcpyAsync(
          dst, src, bytes,
          kind == CopyKind::kDeviceToHost ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice,
          as_cuda(stream)));
    } catch (const CudaError& e) {
      throw TransferError("cuda", e.what());
    }
  }

  void bind_thread() override { SPILLWAY_CUDA_CHECK(cudaSetDevice(device_)); }

 private:
  const int device_;
  std::mutex mu_;
  std::unordered_set<void*> numa_blocks_ GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device) {
  return std::make_unique<CudaBackend>(device);
}

bool cuda_backend_built() { return true; }

}  // namespace spillway::runtime
