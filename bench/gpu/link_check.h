#pragma once
// Proof that a benchmark batch really moved its bytes (bench/gpu only).
//
// The sources hold a position-dependent 64-bit pattern (a different seed per
// direction). Before each batch, untimed, `poison()` overwrites sampled words
// of the destination: the first and the last 16 bytes of every 64 KiB block
// (every chunk and transfer boundary of the benchmark is a multiple of 64
// KiB, so a missing, truncated or misplaced chunk hits a sample). After the
// batch, `mismatches()` reads the samples back (device samples gathered with
// one strided cudaMemcpy2D per side) and counts those that differ from the
// pattern. A batch that skipped any chunk cannot pass.
//
// Not thread-safe; call between batches, with the copy streams idle.
// Failures of CUDA calls throw CudaError.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "runtime/backend/cuda/cuda_check.h"

namespace spillway::bench {

inline std::uint64_t pattern_word(std::uint64_t seed, std::uint64_t index) {
  std::uint64_t x = index + seed * 0x9E3779B97F4A7C15ull;
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

inline void fill_pattern(void* data, std::size_t bytes, std::uint64_t seed) {
  auto* w = static_cast<std::uint64_t*>(data);
  for (std::size_t i = 0; i < bytes / 8; ++i) w[i] = pattern_word(seed, i);
}

class LinkCheck {
 public:
  static constexpr std::size_t kStride = std::size_t{64} << 10;
  static constexpr std::size_t kSample = 16;
  static constexpr std::uint64_t kPoison = 0xDBDBDBDBDBDBDBDBull;

  // `bytes` must be a multiple of kStride. The buffers are borrowed.
  LinkCheck(std::size_t bytes, std::uint64_t seed) : bytes_(bytes), seed_(seed) {
    blocks_ = bytes_ / kStride;
    covered_.assign(blocks_, 0);
    gathered_.resize(blocks_ * kSample * 2 / 8);
  }

  // The blocks written by the next batches: [offset, offset + size) each.
  void clear_coverage() { std::fill(covered_.begin(), covered_.end(), 0); }
  void cover(std::size_t offset, std::size_t size) {
    for (std::size_t k = offset / kStride; k < (offset + size + kStride - 1) / kStride; ++k) {
      covered_[k] = 1;
    }
  }

  void poison_host(void* dst) const {
    auto* base = static_cast<char*>(dst);
    for (std::size_t k = 0; k < blocks_; ++k) {
      std::memset(base + k * kStride, 0xDB, kSample);
      std::memset(base + (k + 1) * kStride - kSample, 0xDB, kSample);
    }
  }
  void poison_device(void* dst) const {
    auto* base = static_cast<char*>(dst);
    SPILLWAY_CUDA_CHECK(cudaMemset2D(base, kStride, 0xDB, kSample, blocks_));
    SPILLWAY_CUDA_CHECK(cudaMemset2D(base + kStride - kSample, kStride, 0xDB, kSample, blocks_));
    SPILLWAY_CUDA_CHECK(cudaDeviceSynchronize());
  }

  // Sampled words of a covered block that differ from the pattern.
  std::size_t mismatches_host(const void* dst) const {
    std::size_t bad = 0;
    const auto* base = static_cast<const char*>(dst);
    for (std::size_t k = 0; k < blocks_; ++k) {
      if (!covered_[k]) continue;
      bad += compare(base + k * kStride, k * kStride);
      bad += compare(base + (k + 1) * kStride - kSample, (k + 1) * kStride - kSample);
    }
    return bad;
  }
  std::size_t mismatches_device(const void* dst) {
    const auto* base = static_cast<const char*>(dst);
    char* head = reinterpret_cast<char*>(gathered_.data());
    char* tail = head + blocks_ * kSample;
    SPILLWAY_CUDA_CHECK(cudaMemcpy2D(head, kSample, base, kStride, kSample, blocks_,
                                     cudaMemcpyDeviceToHost));
    SPILLWAY_CUDA_CHECK(cudaMemcpy2D(tail, kSample, base + kStride - kSample, kStride, kSample,
                                     blocks_, cudaMemcpyDeviceToHost));
    std::size_t bad = 0;
    for (std::size_t k = 0; k < blocks_; ++k) {
      if (!covered_[k]) continue;
      bad += compare(head + k * kSample, k * kStride);
      bad += compare(tail + k * kSample, (k + 1) * kStride - kSample);
    }
    return bad;
  }

  std::uint64_t seed() const { return seed_; }

 private:
  // Words of the kSample bytes at `got` (buffer offset `at`) that are wrong.
  std::size_t compare(const char* got, std::size_t at) const {
    std::size_t bad = 0;
    for (std::size_t i = 0; i < kSample / 8; ++i) {
      std::uint64_t w;
      std::memcpy(&w, got + 8 * i, 8);
      bad += w != pattern_word(seed_, at / 8 + i);
    }
    return bad;
  }

  std::size_t bytes_;
  std::uint64_t seed_;
  std::size_t blocks_ = 0;
  std::vector<char> covered_;
  std::vector<std::uint64_t> gathered_;
};

}  // namespace spillway::bench
