// Host AdamW: the vectorised, threaded update gives the bits of a plain
// scalar evaluation of the device kernel's operations (Note [Host AdamW]) for
// every size, thread count, option and value range; bad input is refused
// before anything is written.

#include "spillway/adamw.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "spillway/error.h"

namespace spillway {
namespace {

// The formulas of the Note, one element at a time, written independently of
// adamw.cc (this file is compiled without FMA instructions, so nothing here
// is contracted; std::fma is the library's correctly rounded one).
void reference_update(AdamWArithmetic arithmetic, const AdamWHyper& h,
                      const AdamWBiasCorrection& c, float& p, float g_in, float& m, float& v) {
  if (arithmetic == AdamWArithmetic::kCudaFusedDouble) {
    const double g = h.maximize ? -double{g_in} : double{g_in};
    if (h.weight_decay != 0) p = static_cast<float>(std::fma(-(h.lr * h.weight_decay), p, p));
    m = static_cast<float>(std::fma(1 - h.beta1, g, h.beta1 * m));
    v = static_cast<float>(std::fma(g, (1 - h.beta2) * g, h.beta2 * v));
    const auto step_size = static_cast<float>(h.lr / c.bias_correction1);
    const float root = std::sqrt(v) / c.bias_correction2_sqrt;
    const auto denom = static_cast<float>(root + h.eps);
    const float update = step_size * m;
    p = p - update / denom;
    return;
  }
  const float g = h.maximize ? -g_in : g_in;
  const auto lr = static_cast<float>(h.lr), b1 = static_cast<float>(h.beta1);
  const auto b2 = static_cast<float>(h.beta2), eps = static_cast<float>(h.eps);
  if (h.weight_decay != 0) {
    const float lr_wd = lr * static_cast<float>(h.weight_decay);
    p = std::fma(-lr_wd, p, p);
  }
  m = std::fma(b1, m, std::fma(-b1, g, g));
  const float g2 = g * g;
  v = std::fma(b2, v, std::fma(-b2, g2, g2));
  const float step_size = lr / c.bias_correction1;
  const float root = std::sqrt(v) / c.bias_correction2_sqrt;
  const float denom = root + eps;
  const float update = step_size * m;
  p = p - update / denom;
}

// Values over many binades, with zeros, signs and subnormals among them.
std::vector<float> values(std::size_t n, std::uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> mantissa(-1, 1);
  std::uniform_int_distribution<int> exponent(-30, 4);
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    switch (rng() % 16) {
      case 0: out[i] = 0; break;
      case 1: out[i] = -0.0F; break;
      case 2: out[i] = std::ldexp(mantissa(rng), -140); break;  // subnormal
      default: out[i] = scale * std::ldexp(mantissa(rng), exponent(rng));
    }
  }
  return out;
}

std::vector<std::uint32_t> bits(const std::vector<float>& x) {
  std::vector<std::uint32_t> out;
  for (float f : x) out.push_back(std::bit_cast<std::uint32_t>(f));
  return out;
}

struct Case {
  AdamWArithmetic arithmetic;
  std::size_t n;
  int threads;
  double weight_decay;
  bool maximize;
};

class HostAdamWBits : public ::testing::TestWithParam<Case> {};

TEST_P(HostAdamWBits, EqualTheScalarEvaluationOverSteps) {
  const Case k = GetParam();
  AdamWHyper h;
  h.lr = 3e-4;
  h.weight_decay = k.weight_decay;
  h.maximize = k.maximize;
  std::vector<float> p = values(k.n, 1, 1), m(k.n, 0), v(k.n, 0);
  std::vector<float> rp = p, rm = m, rv = v;
  HostAdamW adamw(k.threads);
  for (int step = 1; step <= 4; ++step) {
    const std::vector<float> g = values(k.n, 100 + step, step == 3 ? 1e4F : 1);
    const AdamWBiasCorrection c = adamw_bias_correction(k.arithmetic, h, step);
    adamw.update(k.arithmetic, h, c, p.data(), g.data(), m.data(), v.data(), k.n);
    for (std::size_t i = 0; i < k.n; ++i) reference_update(k.arithmetic, h, c, rp[i], g[i], rm[i], rv[i]);
    ASSERT_EQ(bits(p), bits(rp)) << "param, step " << step;
    ASSERT_EQ(bits(m), bits(rm)) << "exp_avg, step " << step;
    ASSERT_EQ(bits(v), bits(rv)) << "exp_avg_sq, step " << step;
  }
}

INSTANTIATE_TEST_SUITE_P(
    SizesThreadsOptions, HostAdamWBits,
    ::testing::Values(Case{AdamWArithmetic::kCudaFusedDouble, 1, 1, 0.01, false},
                      Case{AdamWArithmetic::kCudaFusedDouble, 4097, 3, 0.01, false},
                      Case{AdamWArithmetic::kCudaFusedDouble, 100003, 4, 0, true},
                      Case{AdamWArithmetic::kCudaFusedFloat, 15, 1, 0.01, false},
                      Case{AdamWArithmetic::kCudaFusedFloat, 100003, 3, 0.01, true},
                      Case{AdamWArithmetic::kCudaFusedFloat, 70001, 2, 0, false}));

TEST(HostAdamW, TheTwoArithmeticsDifferSomewhere) {
  // Otherwise the device probe could not tell them apart.
  const std::size_t n = 4096;
  AdamWHyper h;
  std::vector<float> g = values(n, 7, 1);
  std::vector<float> p1 = values(n, 8, 1), m1(n, 0.25F), v1(n, 0.5F);
  std::vector<float> p2 = p1, m2 = m1, v2 = v1;
  HostAdamW adamw(1);
  adamw.update(AdamWArithmetic::kCudaFusedDouble, h,
               adamw_bias_correction(AdamWArithmetic::kCudaFusedDouble, h, 1), p1.data(), g.data(),
               m1.data(), v1.data(), n);
  adamw.update(AdamWArithmetic::kCudaFusedFloat, h,
               adamw_bias_correction(AdamWArithmetic::kCudaFusedFloat, h, 1), p2.data(), g.data(),
               m2.data(), v2.data(), n);
  EXPECT_NE(bits(m1), bits(m2));
}

TEST(HostAdamW, BadInputIsRefusedBeforeAnythingIsWritten) {
  AdamWHyper h;
  HostAdamW adamw(2);
  std::vector<float> p(64, 1), g(64, 1), m(64, 0), v(64, 0);
  const AdamWBiasCorrection c = adamw_bias_correction(AdamWArithmetic::kCudaFusedDouble, h, 1);
  const auto a = AdamWArithmetic::kCudaFusedDouble;
  EXPECT_THROW(adamw.update(a, h, c, p.data(), g.data(), p.data() + 8, v.data(), 32),
               InvalidArgument);
  EXPECT_THROW(adamw.update(a, h, c, nullptr, g.data(), m.data(), v.data(), 64), InvalidArgument);
  AdamWHyper bad = h;
  bad.beta2 = 1;
  EXPECT_THROW(adamw.update(a, bad, c, p.data(), g.data(), m.data(), v.data(), 64),
               InvalidArgument);
  bad = h;
  bad.lr = -1;
  EXPECT_THROW(adamw.update(a, bad, c, p.data(), g.data(), m.data(), v.data(), 64),
               InvalidArgument);
  EXPECT_THROW(adamw.update(a, h, AdamWBiasCorrection{0, 1}, p.data(), g.data(), m.data(),
                            v.data(), 64),
               InvalidArgument);
  EXPECT_EQ(p, std::vector<float>(64, 1));
  EXPECT_EQ(m, std::vector<float>(64, 0));
  EXPECT_THROW(adamw_bias_correction(a, h, 0), InvalidArgument);
  EXPECT_THROW(HostAdamW(0), InvalidArgument);
  adamw.update(a, h, c, nullptr, nullptr, nullptr, nullptr, 0);  // nothing to do
}

TEST(HostAdamW, ManyUpdatesFromOneObjectReuseItsThreads) {
  AdamWHyper h;
  HostAdamW adamw(3);
  const std::size_t n = 10000;
  std::vector<float> p(n, 1), g(n, 0.5F), m(n, 0), v(n, 0);
  for (int step = 1; step <= 200; ++step) {
    adamw.update(AdamWArithmetic::kCudaFusedFloat, h,
                 adamw_bias_correction(AdamWArithmetic::kCudaFusedFloat, h, step), p.data(),
                 g.data(), m.data(), v.data(), n);
  }
  EXPECT_EQ(adamw.threads(), 3);
  EXPECT_LT(p[0], 1);
  EXPECT_EQ(bits(std::vector<float>(p.begin(), p.begin() + 1)),
            bits(std::vector<float>(p.end() - 1, p.end())));
}

}  // namespace
}  // namespace spillway
