#pragma once
// AdamW on the host: the update of fp32 parameters and their optimizer state
// where they live, in pinned host memory, with the same arithmetic as the
// device kernel of the step it replaces, so that a step whose optimizer runs
// on the CPU stays bitwise equal to one whose optimizer runs on the GPU
// (Note [Host AdamW] in src/optim/adamw.cc says how each arithmetic was read
// off the device code and how it is checked).
//
// Thread-safety: HostAdamW::update() may be called from one thread at a time
// per object; distinct objects are independent. adamw_bias_correction() is a
// pure function.

#include <cstddef>
#include <memory>

namespace spillway {

// Which device kernel's arithmetic an update reproduces. Both are PyTorch's
// fused CUDA AdamW (torch.optim.AdamW(fused=True)) for fp32 tensors, as
// compiled for sm_90 by nvcc 13.0, in its two forms:
//   kCudaFusedDouble: hyperparameters in double, moments mixed into double
//                     (the form of torch 2.2 to at least 2.8);
//   kCudaFusedFloat:  everything in float, the moments as two FMAs (later).
// Which one a given torch build runs is found by probing it on the device
// (spillway.optim), not assumed.
enum class AdamWArithmetic { kCudaFusedDouble, kCudaFusedFloat };

struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool maximize = false;
};

// The per-step constants of an update: 1 - beta1^step, and the square root of
// 1 - beta2^step, each rounded to float as the device kernel rounds them.
// The power is the one source of device/host difference (the device's pow is
// not correctly rounded): callers with a device compute the powers there and
// pass them in (spillway.optim does); adamw_bias_correction() computes them
// with the host's pow.
struct AdamWBiasCorrection {
  float bias_correction1 = 1;
  float bias_correction2_sqrt = 1;
};

// From beta1^step and beta2^step (computed in double for kCudaFusedDouble,
// in float and passed widened for kCudaFusedFloat).
AdamWBiasCorrection adamw_bias_correction_from_powers(AdamWArithmetic arithmetic,
                                                      double beta1_pow, double beta2_pow);
// With the host's pow. Throws InvalidArgument for step < 1 or a beta outside [0, 1).
AdamWBiasCorrection adamw_bias_correction(AdamWArithmetic arithmetic, const AdamWHyper& hyper,
                                          double step);

// Updates param, exp_avg and exp_avg_sq (n fp32 values each, in place) from
// grad, spread over the object's threads and vectorised where the CPU allows
// (AVX-512, AVX2 with FMA, or scalar: the results are the same bits on each).
class HostAdamW {
 public:
  // threads >= 1: the calling thread and threads - 1 workers. Throws
  // InvalidArgument for threads < 1.
  explicit HostAdamW(int threads);
  ~HostAdamW();
  HostAdamW(const HostAdamW&) = delete;
  HostAdamW& operator=(const HostAdamW&) = delete;

  int threads() const;

  // Throws InvalidArgument (before touching any value) for a null pointer
  // with n > 0, overlapping arrays, a negative lr or eps, or a bias
  // correction that is not in (0, 1].
  void update(AdamWArithmetic arithmetic, const AdamWHyper& hyper,
              const AdamWBiasCorrection& correction, float* param, const float* grad,
              float* exp_avg, float* exp_avg_sq, std::size_t n);

 private:
  struct Pool;
  std::unique_ptr<Pool> pool_;
};

}  // namespace spillway
