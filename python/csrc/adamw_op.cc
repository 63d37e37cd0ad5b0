// torch.ops.spillway.adamw_update_: the host AdamW of include/spillway/adamw.h
// (Note [Host AdamW]) on fp32 CPU tensors, in place. spillway.optim is its user.
// beta1_pow and beta2_pow are beta^step as the device computes them (in
// double for arithmetic 0, cuda-fused-double; in float for 1, cuda-fused-float);
// the bias corrections are derived from them here, in the device's roundings.
// Runs with the GIL released (torch.ops calls do), on the op's thread pool.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <map>
#include <memory>
#include <mutex>

#include "spillway/adamw.h"
#include "spillway/error.h"

namespace spillway::python {
namespace {

// One HostAdamW (a set of threads) per thread count, made on first use and
// kept for the process.
HostAdamW& host_adamw(int threads) {
  static std::mutex mutex;
  static std::map<int, std::unique_ptr<HostAdamW>> pools;
  std::lock_guard<std::mutex> lock(mutex);
  auto& pool = pools[threads];
  if (!pool) pool = std::make_unique<HostAdamW>(threads);
  return *pool;
}

void check_operand(const at::Tensor& t, const char* name, const at::Tensor& param) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "[adamw] ", name, " is on ", t.device(),
                    ": the host update takes CPU tensors");
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, "[adamw] ", name, " is ", t.scalar_type(),
                    ": the host update takes float32");
  TORCH_CHECK_VALUE(t.is_contiguous(), "[adamw] ", name, " is not contiguous");
  TORCH_CHECK_VALUE(t.numel() == param.numel(), "[adamw] ", name, " has ", t.numel(),
                    " elements, param ", param.numel());
}

void adamw_update(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                  const at::Tensor& exp_avg_sq, double lr, double beta1, double beta2, double eps,
                  double weight_decay, bool maximize, double beta1_pow, double beta2_pow,
                  int64_t arithmetic, int64_t threads) {
  check_operand(param, "param", param);
  check_operand(grad, "grad", param);
  check_operand(exp_avg, "exp_avg", param);
  check_operand(exp_avg_sq, "exp_avg_sq", param);
  TORCH_CHECK_VALUE(arithmetic == 0 || arithmetic == 1, "[adamw] arithmetic ", arithmetic,
                    " is neither 0 (cuda-fused-double) nor 1 (cuda-fused-float)");
  TORCH_CHECK_VALUE(threads >= 1 && threads <= 1024, "[adamw] threads ", threads,
                    " is not in [1, 1024]");
  const AdamWHyper hyper{lr, beta1, beta2, eps, weight_decay, maximize};
  const AdamWArithmetic form =
      arithmetic == 0 ? AdamWArithmetic::kCudaFusedDouble : AdamWArithmetic::kCudaFusedFloat;
  const AdamWBiasCorrection correction =
      adamw_bias_correction_from_powers(form, beta1_pow, beta2_pow);
  try {
    host_adamw(static_cast<int>(threads))
        .update(form, hyper, correction, param.data_ptr<float>(), grad.data_ptr<float>(),
                exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
                static_cast<std::size_t>(param.numel()));
  } catch (const InvalidArgument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  } catch (const Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spillway, m) {
  m.def(
      "adamw_update_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "float lr, float beta1, float beta2, float eps, float weight_decay, bool maximize, "
      "float beta1_pow, float beta2_pow, int arithmetic, int threads) -> ()");
}

TORCH_LIBRARY_IMPL(spillway, CPU, m) { m.impl("adamw_update_", &adamw_update); }

}  // namespace spillway::python
