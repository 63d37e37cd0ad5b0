#include "sim/tensor_bytes.h"

#include <limits>

namespace spillway::sim {
namespace {

constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();

std::int64_t saturating_mul(std::int64_t a, std::int64_t b) {
  if (a == 0 || b == 0) return 0;
  if (a > kMax / b) return kMax;
  return a * b;
}

std::int64_t saturating_add(std::int64_t a, std::int64_t b) { return a > kMax - b ? kMax : a + b; }

}  // namespace

std::int64_t hinted_numel(const TensorInfo& info) {
  std::int64_t numel = 1;
  for (const SymSize& size : info.sizes) {
    if (!size.hint || *size.hint <= 0) return 0;
    numel = saturating_mul(numel, *size.hint);
  }
  return numel;
}

std::int64_t hinted_nbytes(const TensorInfo& info) {
  return saturating_mul(hinted_numel(info), info.element_size > 0 ? info.element_size : 0);
}

std::int64_t storage_extent(const TensorInfo& info) {
  if (info.strides.size() != info.sizes.size()) return hinted_nbytes(info);
  std::int64_t last = 0;  // offset of the last element, in elements
  for (std::size_t d = 0; d < info.sizes.size(); ++d) {
    const SymSize& size = info.sizes[d];
    const SymSize& stride = info.strides[d];
    if (!size.hint || *size.hint <= 0) return 0;
    if (!stride.hint) return hinted_nbytes(info);
    if (*stride.hint < 0) return hinted_nbytes(info);
    last = saturating_add(last, saturating_mul(*size.hint - 1, *stride.hint));
  }
  return saturating_mul(saturating_add(last, 1), info.element_size > 0 ? info.element_size : 0);
}

std::int64_t value_nbytes(const Value& value) {
  if (value.is_tensor()) return hinted_nbytes(value.tensor);
  std::int64_t total = 0;
  for (const Value& element : value.elements) total = saturating_add(total, value_nbytes(element));
  return total;
}

}  // namespace spillway::sim
