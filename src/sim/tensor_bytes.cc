#include "sim/tensor_bytes.h"

#include <limits>
#include <optional>
#include <string_view>

namespace spillway::sim {
namespace {

constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();

// Operands are >= 0. (No division: this runs for every value of every
// simulated graph.)
std::int64_t saturating_mul(std::int64_t a, std::int64_t b) {
  std::int64_t product = 0;
  return __builtin_mul_overflow(a, b, &product) ? kMax : product;
}

std::int64_t saturating_add(std::int64_t a, std::int64_t b) {
  std::int64_t sum = 0;
  return __builtin_add_overflow(a, b, &sum) ? kMax : sum;
}

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

TensorBytes tensor_bytes(const TensorInfo& info) {
  const std::int64_t element_size = info.element_size > 0 ? info.element_size : 0;
  const bool strided = info.strides.size() == info.sizes.size();
  std::int64_t numel = 1;
  std::int64_t last = 0;  // offset of the last element, in elements
  bool known_strides = strided;
  for (std::size_t d = 0; d < info.sizes.size(); ++d) {
    const SymSize& size = info.sizes[d];
    if (!size.hint || *size.hint <= 0) return {};
    numel = saturating_mul(numel, *size.hint);
    if (known_strides) {
      const SymSize& stride = info.strides[d];
      if (stride.hint && *stride.hint >= 0) {
        last = saturating_add(last, saturating_mul(*size.hint - 1, *stride.hint));
      } else {
        known_strides = false;
      }
    }
  }
  TensorBytes bytes;
  bytes.nbytes = saturating_mul(numel, element_size);
  bytes.extent =
      known_strides ? saturating_mul(saturating_add(last, 1), element_size) : bytes.nbytes;
  return bytes;
}

std::int64_t value_nbytes(const Value& value) {
  if (value.is_tensor()) return hinted_nbytes(value.tensor);
  std::int64_t total = 0;
  for (const Value& element : value.elements) total = saturating_add(total, value_nbytes(element));
  return total;
}

bool is_attention(std::string_view op) {
  return op.find("scaled_dot_product") != std::string_view::npos &&
         op.find("attention") != std::string_view::npos;
}

std::pair<std::int64_t, std::int64_t> scratch_bytes(const Node& node) {
  const std::string_view target = node.target;
  if (!is_attention(target) || target.find("_backward") == std::string_view::npos) {
    return {0, 0};
  }
  const Value& out = node.value;
  const Value* grad_query = out.is_tensor() ? &out
                            : !out.elements.empty() && out.elements[0].is_tensor()
                                ? &out.elements[0]
                                : nullptr;
  if (grad_query == nullptr || grad_query->tensor.sizes.empty()) return {0, 0};
  const TensorInfo& q = grad_query->tensor;
  const std::int64_t numel = hinted_numel(q);
  const std::optional<std::int64_t> last = q.sizes.back().hint;
  if (numel == 0 || !last || *last <= 0) return {0, 0};
  return {saturating_mul(numel, 4), saturating_mul(numel / *last, 4)};
}

std::int64_t add_bytes(std::int64_t a, std::int64_t b) { return saturating_add(a, b); }

}  // namespace spillway::sim
