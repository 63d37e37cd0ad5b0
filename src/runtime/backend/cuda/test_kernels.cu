#include "runtime/backend/cuda/test_kernels.h"

namespace spillway::runtime::testing {
namespace {

__host__ __device__ inline std::uint8_t mix(std::uint64_t seed, std::uint64_t offset) {
  std::uint64_t x = offset + seed * 0x9E3779B97F4A7C15ull;
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<std::uint8_t>(x);
}

__global__ void fill_pattern(std::uint8_t* data, std::size_t bytes, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < bytes;
       i += std::size_t{gridDim.x} * blockDim.x) {
    data[i] = mix(seed, i);
  }
}

__global__ void count_mismatches(const std::uint8_t* data, std::size_t bytes, std::uint64_t seed,
                                 unsigned long long* mismatches) {
  unsigned long long local = 0;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < bytes;
       i += std::size_t{gridDim.x} * blockDim.x) {
    local += data[i] != mix(seed, i);
  }
  if (local) atomicAdd(mismatches, local);
}

__global__ void spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

unsigned grid_for(std::size_t bytes) {
  std::size_t blocks = (bytes + 255) / 256;
  return static_cast<unsigned>(blocks < 4096 ? (blocks == 0 ? 1 : blocks) : 4096);
}

}  // namespace

std::uint8_t pattern_byte(std::uint64_t seed, std::uint64_t offset) { return mix(seed, offset); }

void launch_fill_pattern(void* data, std::size_t bytes, std::uint64_t seed, cudaStream_t stream) {
  fill_pattern<<<grid_for(bytes), 256, 0, stream>>>(static_cast<std::uint8_t*>(data), bytes, seed);
}

void launch_count_mismatches(const void* data, std::size_t bytes, std::uint64_t seed,
                             unsigned long long* mismatches, cudaStream_t stream) {
  count_mismatches<<<grid_for(bytes), 256, 0, stream>>>(static_cast<const std::uint8_t*>(data),
                                                         bytes, seed, mismatches);
}

void launch_spin(int microseconds, cudaStream_t stream) {
  // About 1.5 GHz when idle-clocked; the exact time does not matter.
  spin<<<132, 128, 0, stream>>>(static_cast<long long>(microseconds) * 1500);
}

}  // namespace spillway::runtime::testing
