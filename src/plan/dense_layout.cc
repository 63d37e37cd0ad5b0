#include "plan/dense_layout.h"

#include <algorithm>
#include <numeric>

namespace spillway::plan {
namespace {

std::string join(const std::vector<SymSize>& dims) {
  std::string text = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (i > 0) text += ", ";
    text += dims[i].hint ? std::to_string(*dims[i].hint) : dims[i].symbol;
  }
  return text + "]";
}

bool set_why(std::string* why, std::string text) {
  if (why != nullptr) *why = std::move(text);
  return false;
}

// torch's is_contiguous(): strides equal the contiguous ones, ignoring
// dimensions of size 1; true for an empty tensor.
bool is_contiguous_layout(const TensorInfo& tensor) {
  if (tensor.strides.size() != tensor.sizes.size()) return false;
  std::int64_t expected = 1;
  for (std::size_t i = tensor.sizes.size(); i-- > 0;) {
    const std::optional<std::int64_t>& size = tensor.sizes[i].hint;
    const std::optional<std::int64_t>& stride = tensor.strides[i].hint;
    if (!size || !stride) return false;
    if (*size == 0) return true;
    if (*size != 1 && *stride != expected) return false;
    expected *= *size;
  }
  return true;
}

}  // namespace

std::optional<std::vector<int>> dense_order(const TensorInfo& tensor, std::string* why) {
  const int rank = tensor.rank();
  if (tensor.strides.size() != tensor.sizes.size()) {
    set_why(why, "strides unknown");
    return std::nullopt;
  }
  std::vector<std::int64_t> sizes(static_cast<std::size_t>(rank));
  std::vector<std::int64_t> strides(static_cast<std::size_t>(rank));
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (!tensor.sizes[i].hint || !tensor.strides[i].hint) {
      set_why(why, "a size or stride has no hint");
      return std::nullopt;
    }
    sizes[i] = *tensor.sizes[i].hint;
    strides[i] = *tensor.strides[i].hint;
    if (sizes[i] < 1) {
      set_why(why, "empty (a size is 0)");
      return std::nullopt;
    }
  }
  // Outermost first: larger strides first; among equal strides, the one
  // dimension that may be larger than 1 sits outside the size-1 ones.
  std::vector<int> order(static_cast<std::size_t>(rank));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const auto ua = static_cast<std::size_t>(a);
    const auto ub = static_cast<std::size_t>(b);
    if (strides[ua] != strides[ub]) return strides[ua] > strides[ub];
    return (sizes[ua] > 1) > (sizes[ub] > 1);
  });
  std::int64_t expected = 1;
  for (std::size_t k = order.size(); k-- > 0;) {
    const auto dim = static_cast<std::size_t>(order[k]);
    if (strides[dim] != expected) {
      set_why(why, "strides " + join(tensor.strides) + " of sizes " + join(tensor.sizes) +
                       " are not a permutation of a contiguous layout (overlapping or with gaps)");
      return std::nullopt;
    }
    expected *= sizes[dim];
  }
  return order;
}

std::vector<int> inverse_order(const std::vector<int>& order) {
  std::vector<int> inverse(order.size());
  for (std::size_t i = 0; i < order.size(); ++i) {
    inverse[static_cast<std::size_t>(order[i])] = static_cast<int>(i);
  }
  return inverse;
}

TensorInfo permute_info(const TensorInfo& tensor, const std::vector<int>& order) {
  TensorInfo out = tensor;
  for (std::size_t i = 0; i < order.size(); ++i) {
    const auto from = static_cast<std::size_t>(order[i]);
    out.sizes[i] = tensor.sizes[from];
    if (!tensor.strides.empty()) out.strides[i] = tensor.strides[from];
  }
  out.contiguous = is_contiguous_layout(out);
  return out;
}

std::optional<std::int64_t> reach_bytes(const TensorInfo& tensor) {
  if (tensor.strides.size() != tensor.sizes.size()) return std::nullopt;
  std::int64_t reach = 1;
  for (std::size_t i = 0; i < tensor.sizes.size(); ++i) {
    if (!tensor.sizes[i].hint || !tensor.strides[i].hint) return std::nullopt;
    if (*tensor.sizes[i].hint == 0) return 0;
    reach += (*tensor.sizes[i].hint - 1) * std::max<std::int64_t>(*tensor.strides[i].hint, 0);
  }
  return reach * tensor.element_size;
}

OpSchema permute_schema() {
  OpSchema schema;
  schema.ns = "aten";
  schema.is_view = true;
  schema.arguments = {{"self", false, false}, {"dims", false, false}};
  return schema;
}

}  // namespace spillway::plan
