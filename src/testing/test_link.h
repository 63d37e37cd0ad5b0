#pragma once
// A cost model for unit tests whose link moves kLinkBytesPerMs bytes per ms in
// either direction, alone or duplex, allocations unrounded; its roofline (for
// nodes without time_ms) is the data sheet of no real device. Header-only,
// for tests only.
#include <cstdint>

#include "spillway/sim.h"

namespace spillway::testing {

constexpr std::int64_t kLinkBytesPerMs = 1'000'000;  // 1 GB/s

inline CostModel test_link() {
  DeviceProfile p;
  p.name = "test";
  p.h2d.points = {{1, 1.0}};  // 1 GB/s: kLinkBytesPerMs bytes per ms
  p.d2h = p.h2d_duplex = p.d2h_duplex = p.h2d;
  p.allocation_granularity = 1;
  p.memory_gbs = 1000;
  p.matmul_tflops_bf16 = p.matmul_tflops_fp32 = 100;
  return CostModel(p);
}

}  // namespace spillway::testing
