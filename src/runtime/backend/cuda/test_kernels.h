#pragma once
// Compute kernels for the CUDA tests: they write and check a byte pattern
// derived from (seed, offset), so a test can tell every byte that came back.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace spillway::runtime::testing {

// The pattern byte at `offset` for `seed` (same function on host and device).
std::uint8_t pattern_byte(std::uint64_t seed, std::uint64_t offset);

// Writes the pattern into `bytes` of device memory on `stream`.
void launch_fill_pattern(void* data, std::size_t bytes, std::uint64_t seed, cudaStream_t stream);
// Adds to *mismatches (device memory) the number of bytes that differ from
// the pattern, on `stream`.
void launch_count_mismatches(const void* data, std::size_t bytes, std::uint64_t seed,
                             unsigned long long* mismatches, cudaStream_t stream);
// Keeps the SMs busy for about `microseconds` on `stream`.
void launch_spin(int microseconds, cudaStream_t stream);

}  // namespace spillway::runtime::testing
