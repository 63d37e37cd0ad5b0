#include "cuda_allocator.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>

#include <string>

#include "spillway/error.h"

namespace spillway::python {
namespace {

class TorchCudaAllocator final : public DeviceAllocator {
 public:
  void* allocate(std::size_t bytes, void* stream) override {
    try {
      return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(
          bytes, static_cast<cudaStream_t>(stream));
    } catch (const c10::OutOfMemoryError& e) {
      throw OutOfMemory("torch_allocator", "PyTorch's CUDA caching allocator cannot supply " +
                                               std::to_string(bytes) +
                                               " bytes: " + e.what_without_backtrace());
    }
  }
  void deallocate(void* ptr, std::size_t /*bytes*/, void* /*stream*/) noexcept override {
    try {
      c10::cuda::CUDACachingAllocator::raw_delete(ptr);
    } catch (...) {
      // raw_delete of a pointer it handed out does not throw; nothing to report to.
    }
  }
};

}  // namespace

DeviceAllocator& torch_cuda_allocator() {
  static auto* allocator = new TorchCudaAllocator();
  return *allocator;
}

}  // namespace spillway::python
