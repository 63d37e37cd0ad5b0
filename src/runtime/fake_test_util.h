#pragma once
// Helpers for the fake-backend tests: a byte pattern derived from (seed,
// offset), written and checked by "kernels" enqueued on a fake compute stream.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

#include "spillway/runtime.h"

namespace spillway::testing {

inline std::uint8_t pattern_byte(std::uint64_t seed, std::uint64_t offset) {
  std::uint64_t x = offset + seed * 0x9E3779B97F4A7C15ull;
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  return static_cast<std::uint8_t>(x >> 24);
}

inline void fill_pattern(void* data, std::size_t bytes, std::uint64_t seed) {
  auto* p = static_cast<std::uint8_t*>(data);
  for (std::size_t i = 0; i < bytes; ++i) p[i] = pattern_byte(seed, i);
}

inline std::size_t count_mismatches(const void* data, std::size_t bytes, std::uint64_t seed) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < bytes; ++i) bad += p[i] != pattern_byte(seed, i);
  return bad;
}

// Enqueues a pattern fill on `stream`.
inline void launch_fill(FakeControls& fake, StreamHandle stream, void* data, std::size_t bytes,
                        std::uint64_t seed) {
  fake.launch(stream, [=] { fill_pattern(data, bytes, seed); });
}

// Enqueues a check on `stream`; mismatching bytes are added to *bad.
inline void launch_check(FakeControls& fake, StreamHandle stream, const void* data,
                         std::size_t bytes, std::uint64_t seed,
                         const std::shared_ptr<std::atomic<std::size_t>>& bad) {
  fake.launch(stream, [=] { *bad += count_mismatches(data, bytes, seed); });
}

}  // namespace spillway::testing
