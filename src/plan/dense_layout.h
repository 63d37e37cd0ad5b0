#pragma once
// Dense layouts: tensors that are not contiguous but whose strides are a
// permutation of a contiguous layout (non-overlapping and dense, like the
// transposed rotary Q/K of a Llama attention). Used by the planner when
// ActivationPlanOptions::dense_storages is on.
//
// Such a tensor T with permutation `order` (outermost dimension first) is
// moved as
//   forward:  D = aten.permute(T, order)            a view of T, contiguous
//             offload(D)                            moves numel * itemsize bytes
//   backward: W = wait(reload(...))                 contiguous, D's sizes
//             R = aten.permute(W, inverse(order))   T's sizes AND strides
// so backward readers see exactly T's sizes and strides, without a copy on
// either side (both permutes are views).
//
// Only hints are read (never a symbol is specialised). A dimension of size 1
// may have any stride in torch; the layout is accepted only when the strides
// that the rewrite reproduces equal the recorded ones for every dimension, so
// the restored value matches stride for stride.
//
// Thread-safety: pure functions.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "spillway/graph.h"

namespace spillway::plan {

// The permutation `order` (outermost dimension first) such that
// permute(tensor, order) is contiguous, when the tensor's strides are exactly
// a permutation of a contiguous layout: strides known with hints, every size
// hinted and >= 1, no overlap, no gaps. nullopt otherwise, with the reason in
// `why` when given.
std::optional<std::vector<int>> dense_order(const TensorInfo& tensor, std::string* why = nullptr);

// inverse[order[i]] = i.
std::vector<int> inverse_order(const std::vector<int>& order);

// The value of aten.permute(tensor, order): sizes and strides permuted,
// contiguity recomputed from the permuted strides; everything else kept.
TensorInfo permute_info(const TensorInfo& tensor, const std::vector<int>& order);

// 1 + sum((size - 1) * stride) elements times the element size: the bytes a
// strided tensor reaches from its first element. nullopt when a size or a
// stride has no hint, or strides are unknown. 0 for an empty tensor.
std::optional<std::int64_t> reach_bytes(const TensorInfo& tensor);

// The schema of aten.permute.default (a view: permute(Tensor(a) self, int[] dims)).
OpSchema permute_schema();

inline constexpr std::string_view kPermuteTarget = "aten.permute.default";

}  // namespace spillway::plan
