// Note [Host AdamW]
// ~~~~~~~~~~~~~~~~~
// A step whose optimizer state lives on the host can run its AdamW there
// (ZeRO-Offload's choice): gradients go down once, parameters come back once,
// and the moments never cross the link. That is only worth having if the
// result is the same bits as the device step it replaces, so the update
// below reproduces the device kernel operation by operation, roundings and
// fused multiply-adds included.
//
// The device kernel is PyTorch's fused CUDA AdamW for fp32 (adam_math in
// ATen's fused_adam_utils.cuh). Its source is not enough: nvcc contracts a
// multiply feeding an add into one FMA where it chooses, and ptxas fuses
// further. So each form was compiled for sm_90 with nvcc 13.0 (-O3, the
// default --fmad=true, as PyTorch builds it) and read back from SASS:
//
//   kCudaFusedDouble (hyperparameters are doubles, values floats, so the
//   moments are computed in double and rounded once):
//     p  = f32(fma(-(lr*wd), p, p))                 if wd != 0, in double
//     m  = f32(fma(1 - b1, g, b1 * m))              in double
//     v  = f32(fma(g, (1 - b2) * g, b2 * v))        in double
//     s  = f32(lr / bc1)                            in double
//     d  = f32(f32(sqrt(v) / bc2s) + eps)           sqrt and / in float, + in double
//     p  = p - (s * m) / d                          in float
//   kCudaFusedFloat (hyperparameters cast to float first):
//     p  = fma(-(lr*wd), p, p)                      if wd != 0
//     m  = fma(b1, m, fma(-b1, g, g))
//     v  = fma(b2, v, fma(-b2, g*g, g*g))
//     s  = lr / bc1;  d = sqrt(v) / bc2s + eps;  p = p - (s * m) / d
//
// with g negated first under maximize. Every operation is IEEE (division and
// sqrt correctly rounded on both sides: PyTorch does not build with
// --use_fast_math, and denormals are kept on both), so the host gets the same
// bits by doing the same operations in the same order with explicit fma and
// without letting its own compiler contract anything else: this file is
// built with -ffp-contract=off. The one function that is not IEEE on the
// device is pow, in the bias corrections; those are per step, not per
// element, and AdamWBiasCorrection carries them in from the device.
//
// Nothing here assumes that a given torch runs either form: spillway.optim
// probes the device's optimizer against both on random and extreme values at
// several step counts and uses the one that matches, or refuses the host
// optimizer with the mismatch named. adamw_test.cc checks this code against
// an independent exact evaluation of the same formulas.
//
// Speed: the loop is memory-bound (7 fp32 streams: p, g, m, v in; p, m, v
// out). It is compiled three times (AVX-512, AVX2+FMA, baseline x86-64) and
// the CPU's features pick one; std::fma is one instruction on the first two.
// Work is split into contiguous ranges over the object's threads.

#include "spillway/adamw.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "spillway/error.h"

namespace spillway {
namespace {

constexpr const char* kAdamWComponent = "adamw";

// What every element of one update shares.
struct AdamWConstants {
  // kCudaFusedDouble
  double neg_lr_wd = 0;
  double beta1 = 0, one_minus_beta1 = 0, beta2 = 0, one_minus_beta2 = 0, eps = 0;
  // kCudaFusedFloat
  float neg_lr_wd_f = 0, beta1_f = 0, beta2_f = 0, eps_f = 0;
  // both
  float step_size = 0;
  float bias_correction2_sqrt = 1;
  bool decay = false;
  bool maximize = false;
};

AdamWConstants adamw_constants(AdamWArithmetic arithmetic, const AdamWHyper& h,
                               const AdamWBiasCorrection& c) {
  AdamWConstants k;
  k.decay = h.weight_decay != 0;
  k.maximize = h.maximize;
  k.bias_correction2_sqrt = c.bias_correction2_sqrt;
  if (arithmetic == AdamWArithmetic::kCudaFusedDouble) {
    k.neg_lr_wd = -(h.lr * h.weight_decay);
    k.beta1 = h.beta1;
    k.one_minus_beta1 = 1 - h.beta1;
    k.beta2 = h.beta2;
    k.one_minus_beta2 = 1 - h.beta2;
    k.eps = h.eps;
    k.step_size = static_cast<float>(h.lr / static_cast<double>(c.bias_correction1));
  } else {
    const float lr = static_cast<float>(h.lr);
    k.neg_lr_wd_f = -(lr * static_cast<float>(h.weight_decay));
    k.beta1_f = static_cast<float>(h.beta1);
    k.beta2_f = static_cast<float>(h.beta2);
    k.eps_f = static_cast<float>(h.eps);
    k.step_size = lr / c.bias_correction1;
  }
  return k;
}

// One range of elements: the Note's formulas. Inlined into one function per
// instruction set below; each computes the same bits (see the Note).
template <AdamWArithmetic kArithmetic, bool kDecay, bool kMaximize>
__attribute__((always_inline)) inline void adamw_body(const AdamWConstants& k,
                                                      float* __restrict__ param,
                                                      const float* __restrict__ grad,
                                                      float* __restrict__ exp_avg,
                                                      float* __restrict__ exp_avg_sq,
                                                      std::size_t n) {
  const float step_size = k.step_size;
  const float bc2s = k.bias_correction2_sqrt;
  if constexpr (kArithmetic == AdamWArithmetic::kCudaFusedDouble) {
    const double neg_lr_wd = k.neg_lr_wd, b1 = k.beta1, omb1 = k.one_minus_beta1;
    const double b2 = k.beta2, omb2 = k.one_minus_beta2, eps = k.eps;
#pragma GCC ivdep
    for (std::size_t i = 0; i < n; ++i) {
      float p = param[i];
      const double g = kMaximize ? -static_cast<double>(grad[i]) : static_cast<double>(grad[i]);
      if constexpr (kDecay) {
        const double pd = p;
        p = static_cast<float>(std::fma(neg_lr_wd, pd, pd));
      }
      const float m = static_cast<float>(std::fma(omb1, g, b1 * static_cast<double>(exp_avg[i])));
      const float v =
          static_cast<float>(std::fma(g, omb2 * g, b2 * static_cast<double>(exp_avg_sq[i])));
      const float denom = static_cast<float>(static_cast<double>(std::sqrt(v) / bc2s) + eps);
      param[i] = p - (step_size * m) / denom;
      exp_avg[i] = m;
      exp_avg_sq[i] = v;
    }
  } else {
    const float neg_lr_wd = k.neg_lr_wd_f, b1 = k.beta1_f, b2 = k.beta2_f, eps = k.eps_f;
#pragma GCC ivdep
    for (std::size_t i = 0; i < n; ++i) {
      float p = param[i];
      const float g = kMaximize ? -grad[i] : grad[i];
      if constexpr (kDecay) p = std::fma(neg_lr_wd, p, p);
      const float m = std::fma(b1, exp_avg[i], std::fma(-b1, g, g));
      const float g2 = g * g;
      const float v = std::fma(b2, exp_avg_sq[i], std::fma(-b2, g2, g2));
      const float denom = std::sqrt(v) / bc2s + eps;
      param[i] = p - (step_size * m) / denom;
      exp_avg[i] = m;
      exp_avg_sq[i] = v;
    }
  }
}

using AdamWRangeFn = void (*)(const AdamWConstants&, float*, const float*, float*, float*,
                              std::size_t);

// The body compiled for one instruction set. Chosen at run time by hand
// (adamw_isa()), not with target_clones: its ifunc resolvers run before the
// sanitizers' runtimes are up and crash the TSan build.
#define SPILLWAY_ADAMW_RANGE(NAME, TARGET)                                                     \
  template <AdamWArithmetic kArithmetic, bool kDecay, bool kMaximize>                          \
  TARGET void NAME(const AdamWConstants& k, float* param, const float* grad, float* exp_avg,   \
                   float* exp_avg_sq, std::size_t n) {                                         \
    adamw_body<kArithmetic, kDecay, kMaximize>(k, param, grad, exp_avg, exp_avg_sq, n);        \
  }
SPILLWAY_ADAMW_RANGE(adamw_range_baseline, )
#if defined(__x86_64__)
SPILLWAY_ADAMW_RANGE(adamw_range_avx2, __attribute__((target("avx2,fma"))))
SPILLWAY_ADAMW_RANGE(adamw_range_avx512,
                     __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma"))))
#endif
#undef SPILLWAY_ADAMW_RANGE

enum class AdamWIsa { kBaseline, kAvx2, kAvx512 };

AdamWIsa adamw_isa() {
#if defined(__x86_64__)
  static const AdamWIsa isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")) {
      return AdamWIsa::kAvx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AdamWIsa::kAvx2;
    return AdamWIsa::kBaseline;
  }();
  return isa;
#else
  return AdamWIsa::kBaseline;
#endif
}

template <AdamWArithmetic kArithmetic, bool kDecay, bool kMaximize>
AdamWRangeFn adamw_range_for_isa() {
#if defined(__x86_64__)
  switch (adamw_isa()) {
    case AdamWIsa::kAvx512: return &adamw_range_avx512<kArithmetic, kDecay, kMaximize>;
    case AdamWIsa::kAvx2: return &adamw_range_avx2<kArithmetic, kDecay, kMaximize>;
    case AdamWIsa::kBaseline: break;
  }
#endif
  return &adamw_range_baseline<kArithmetic, kDecay, kMaximize>;
}

template <AdamWArithmetic kArithmetic>
AdamWRangeFn adamw_range_for(bool decay, bool maximize) {
  if (decay) {
    return maximize ? adamw_range_for_isa<kArithmetic, true, true>()
                    : adamw_range_for_isa<kArithmetic, true, false>();
  }
  return maximize ? adamw_range_for_isa<kArithmetic, false, true>()
                  : adamw_range_for_isa<kArithmetic, false, false>();
}

AdamWRangeFn adamw_range_fn(AdamWArithmetic arithmetic, bool decay, bool maximize) {
  return arithmetic == AdamWArithmetic::kCudaFusedDouble
             ? adamw_range_for<AdamWArithmetic::kCudaFusedDouble>(decay, maximize)
             : adamw_range_for<AdamWArithmetic::kCudaFusedFloat>(decay, maximize);
}

void check_beta(const char* name, double beta) {
  if (!(beta >= 0 && beta < 1)) {
    throw InvalidArgument(kAdamWComponent,
                          std::string(name) + " " + std::to_string(beta) + " is not in [0, 1)");
  }
}

bool overlaps(const void* a, const void* b, std::size_t bytes) {
  const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + bytes && y < x + bytes;
}

}  // namespace

AdamWBiasCorrection adamw_bias_correction_from_powers(AdamWArithmetic arithmetic,
                                                      double beta1_pow, double beta2_pow) {
  AdamWBiasCorrection c;
  if (arithmetic == AdamWArithmetic::kCudaFusedDouble) {
    c.bias_correction1 = static_cast<float>(1 - beta1_pow);
    c.bias_correction2_sqrt = static_cast<float>(std::sqrt(1 - beta2_pow));
  } else {
    c.bias_correction1 = 1.0F - static_cast<float>(beta1_pow);
    c.bias_correction2_sqrt = std::sqrt(1.0F - static_cast<float>(beta2_pow));
  }
  return c;
}

AdamWBiasCorrection adamw_bias_correction(AdamWArithmetic arithmetic, const AdamWHyper& hyper,
                                          double step) {
  check_beta("beta1", hyper.beta1);
  check_beta("beta2", hyper.beta2);
  if (!(step >= 1)) {
    throw InvalidArgument(kAdamWComponent,
                          "step " + std::to_string(step) + " is not >= 1 (the first step is 1)");
  }
  // The device kernel reads the step as a float.
  const float step_f = static_cast<float>(step);
  if (arithmetic == AdamWArithmetic::kCudaFusedDouble) {
    return adamw_bias_correction_from_powers(arithmetic, std::pow(hyper.beta1, double{step_f}),
                                             std::pow(hyper.beta2, double{step_f}));
  }
  return adamw_bias_correction_from_powers(
      arithmetic, std::pow(static_cast<float>(hyper.beta1), step_f),
      std::pow(static_cast<float>(hyper.beta2), step_f));
}

// A fixed set of workers that each run one range of the current update.
struct HostAdamW::Pool {
  explicit Pool(int n) : count(n) {
    for (int i = 1; i < n; ++i) workers.emplace_back([this, i] { work(i); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stopping = true;
    }
    wake.notify_all();
    for (auto& t : workers) t.join();
  }

  // Runs job(0 .. count-1), part 0 on the calling thread; returns when all are done.
  void run(const std::function<void(int)>& job) {
    std::lock_guard<std::mutex> serial(update_mutex);
    {
      std::lock_guard<std::mutex> lock(mutex);
      current = &job;
      remaining = count - 1;
      ++generation;
    }
    wake.notify_all();
    job(0);
    std::unique_lock<std::mutex> lock(mutex);
    done.wait(lock, [this] { return remaining == 0; });
    current = nullptr;
  }

  void work(int part) {
    std::uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* job = nullptr;
      {
        std::unique_lock<std::mutex> lock(mutex);
        wake.wait(lock, [&] { return stopping || generation != seen; });
        if (stopping) return;
        seen = generation;
        job = current;
      }
      (*job)(part);
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (--remaining == 0) done.notify_one();
      }
    }
  }

  const int count;
  std::mutex update_mutex;  // one update at a time
  std::mutex mutex;
  std::condition_variable wake, done;
  const std::function<void(int)>* current = nullptr;
  std::uint64_t generation = 0;
  int remaining = 0;
  bool stopping = false;
  std::vector<std::thread> workers;
};

HostAdamW::HostAdamW(int threads) {
  if (threads < 1) {
    throw InvalidArgument(kAdamWComponent,
                          "threads " + std::to_string(threads) + " is not >= 1");
  }
  pool_ = std::make_unique<Pool>(threads);
}

HostAdamW::~HostAdamW() = default;

int HostAdamW::threads() const { return pool_->count; }

void HostAdamW::update(AdamWArithmetic arithmetic, const AdamWHyper& hyper,
                       const AdamWBiasCorrection& correction, float* param, const float* grad,
                       float* exp_avg, float* exp_avg_sq, std::size_t n) {
  if (n == 0) return;
  if (param == nullptr || grad == nullptr || exp_avg == nullptr || exp_avg_sq == nullptr) {
    throw InvalidArgument(kAdamWComponent, "a null array with " + std::to_string(n) + " elements");
  }
  const std::size_t bytes = n * sizeof(float);
  const void* arrays[] = {param, grad, exp_avg, exp_avg_sq};
  for (int i = 0; i < 4; ++i) {
    for (int j = i + 1; j < 4; ++j) {
      if (overlaps(arrays[i], arrays[j], bytes)) {
        throw InvalidArgument(kAdamWComponent,
                              "param, grad, exp_avg and exp_avg_sq must not overlap");
      }
    }
  }
  if (!(hyper.lr >= 0) || !(hyper.eps >= 0)) {
    throw InvalidArgument(kAdamWComponent, "lr " + std::to_string(hyper.lr) + " and eps " +
                                               std::to_string(hyper.eps) + " must be >= 0");
  }
  check_beta("beta1", hyper.beta1);
  check_beta("beta2", hyper.beta2);
  for (float c : {correction.bias_correction1, correction.bias_correction2_sqrt}) {
    if (!(c > 0 && c <= 1)) {
      throw InvalidArgument(kAdamWComponent,
                            "bias correction " + std::to_string(c) + " is not in (0, 1]");
    }
  }
  const AdamWConstants k = adamw_constants(arithmetic, hyper, correction);
  const AdamWRangeFn fn = adamw_range_fn(arithmetic, k.decay, k.maximize);
  // Ranges of whole 64-byte lines, so that no two threads write one line.
  constexpr std::size_t kLine = 16;
  const auto parts = static_cast<std::size_t>(pool_->count);
  const std::size_t lines = (n + kLine - 1) / kLine;
  const std::size_t per_part = (lines + parts - 1) / parts * kLine;
  if (parts == 1 || n < 4096) {
    fn(k, param, grad, exp_avg, exp_avg_sq, n);
    return;
  }
  pool_->run([&](int part) {
    const std::size_t begin = std::min(n, static_cast<std::size_t>(part) * per_part);
    const std::size_t end = std::min(n, begin + per_part);
    if (begin < end) {
      fn(k, param + begin, grad + begin, exp_avg + begin, exp_avg_sq + begin, end - begin);
    }
  });
}

}  // namespace spillway
