#pragma once
// spillway's DeviceAllocator on PyTorch's CUDA caching allocator, so device
// memory the runtime allocates, and memory it releases, is the model's memory
// (DESIGN.md: "Device memory in PyTorch mode comes from PyTorch's caching
// allocator"). Compiled only when torch has CUDA (SPILLWAY_TORCH_CUDA).

#include "spillway/runtime.h"

namespace spillway::python {

// The process-wide instance; never destroyed. Thread-safe (the caching
// allocator is). allocate() takes memory usable in order on the given
// cudaStream_t (raw_alloc_with_stream) and throws spillway::OutOfMemory when
// the caching allocator cannot supply it; deallocate() returns it to the pool
// of the stream it was allocated on (raw_delete).
DeviceAllocator& torch_cuda_allocator();

}  // namespace spillway::python
