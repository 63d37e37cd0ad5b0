#pragma once
// SPILLWAY_CUDA_CHECK(call): every CUDA runtime call goes through it. On
// failure it clears CUDA's last-error slot and throws CudaError naming the call
// and CUDA's error text. Destructors wrap it in try/catch and log instead.

#include <cuda_runtime_api.h>

#include <string>

#include "spillway/error.h"

namespace spillway::runtime {

[[noreturn]] inline void throw_cuda_error(cudaError_t error, const char* call) {
  (void)cudaGetLastError();  // clear a non-sticky error so later calls work
  throw CudaError("cuda", std::string(call) + " failed: " + cudaGetErrorName(error) + ": " +
                              cudaGetErrorString(error));
}

}  // namespace spillway::runtime

#define SPILLWAY_CUDA_CHECK(call)                                         \
  do {                                                                    \
    cudaError_t spillway_cuda_status_ = (call);                           \
    if (spillway_cuda_status_ != cudaSuccess) {                           \
      ::spillway::runtime::throw_cuda_error(spillway_cuda_status_, #call); \
    }                                                                     \
  } while (0)
