#pragma once
// What torch.compile's Inductor computes inside fused kernels, read from a
// node's op. Shared by the budget planner's partitioner mode (which values the
// min-cut partitioner recomputes for free and which are never offloaded) and
// the simulator's SimOptions::inductor_fusion (which values are never
// materialised, and how much of a fused op's time is left).
//
// Note [What Inductor fuses]
// Inductor lowers pointwise ops to loop bodies that it inlines into the
// kernels of their readers, and lowers most reductions and layout ops to
// loop bodies too, so a chain of them becomes one generated kernel that
// reads its inputs once and writes only what something outside the kernel
// needs. Extern kernels (mm, attention, embedding_dense_backward's scatter)
// read and write buffers in memory. Evidence, torch 2.13 on the CPU
// (TORCH_LOGS=output_code; the kernel names list the source ATen ops):
//   * bf16 logits -> float() -> cross_entropy, and backward:
//     cpp_fused__log_softmax__to_copy_nll_loss_forward_0 writes only the
//     per-row max and log-sum-exp ([N, 1]) and the loss; backward's
//     cpp_fused__log_softmax__log_softmax_backward_data__to_copy_arange_eq_
//     expand_nll_loss_backward_nll_loss_forward_scalar_tensor_view_0 writes
//     only the bf16 gradient of the logits (read by the two mm). No [N, V]
//     fp32 buffer exists in either graph.
//   * the same loss decomposed (amax, sub, exp, sum, log, sub, gather, as
//     the joint graph of a bf16 Llama with a 32000 vocabulary has it):
//     cpp_fused__log_softmax__to_copy__unsafe_view_clone_constant_pad_nd_
//     nll_loss_forward_slice_view_7 reads the bf16 logits and writes amax,
//     log and the loss; the gather of the fp32 log-softmax [N, V] by label
//     runs inside it, and the forward saves no [N, V] buffer (2026-12-01).
//   * RMSNorm: cpp_fused__to_copy_add_mean_mul_pow_rsqrt_0 writes rsqrt
//     (saved) and the bf16 output (read by mm); backward's
//     cpp_fused__to_copy_add_div_expand_mul_pow_sum_view_4 fuses the sums.
//   * rotary: cpp_fused__unsafe_view_add_cat_clone_mul_neg_slice_transpose_
//     view_1, and backward's cpp_fused_add_clone_mul_neg_slice_slice_backward_
//     transpose_view_2.
//   * softmax, amax, constant_pad_nd, embedding:
//     cpp_fused__softmax__to_copy__unsafe_view_add_amax_constant_pad_nd_mean_
//     mul_slice_sum_1, cpp_fused__softmax__softmax_backward_data__..._sum_
//     view_0, cpp_fused_embedding_0.
// Lowering (which values are realised as buffers) and the scheduler are
// shared by the CPU and CUDA backends; each backend has its own rules for
// what may share a kernel, and these kernels were read on the CPU only.
// What the simulator's rule does not model: Inductor may still realise a
// pointwise value with many readers or a long body
// (realize_reads_threshold, realize_opcount_threshold), and the CPU backend
// kept softmax's exp() numerator in a scratch buffer inside its fused
// kernel.
//
// Thread-safety: pure functions.

#include "spillway/graph.h"

namespace spillway::analysis {

// Pointwise in the min-cut partitioner's and Inductor's sense: a
// call_function whose op carries torch.Tag.pointwise (`schema`'s
// is_pointwise), a dtype cast (aten._to_copy, prims.convert_element_type),
// aten.where.self or aten.clone. The partitioner recomputes such values in
// backward for free; they are what BudgetOptions::partitioner_recomputes_pointwise
// leaves to it. `schema` is the graph's schema for the node's target, or nullptr.
bool is_inductor_pointwise(const Node& node, const OpSchema* schema);

// Computed inside a fused kernel by Inductor: is_inductor_pointwise, or one of
// the reductions and layout ops Inductor lowers to loop bodies and fuses with
// them (Note [What Inductor fuses]): _log_softmax, _softmax and their
// _backward_data, nll_loss_forward, nll_loss_backward, gather, sum, mean, amax, cat,
// slice_backward, constant_pad_nd, embedding, and the constant producers
// arange and scalar_tensor. Such a node reads its inputs inside the kernel
// of its producer or reader and need not materialise its output.
bool is_inductor_fused(const Node& node, const OpSchema* schema);

}  // namespace spillway::analysis
