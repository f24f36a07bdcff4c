// test_util.hpp: shared helpers for the tests: seeded random inputs, poison, host buffers.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <random>
#include <vector>

#include "qkvfuse/numeric.hpp"
#include "qkvfuse/tensor.hpp"

namespace qkvfuse::test {

/// A fresh seed per test run (printed, so a failure can be replayed with QKVFUSE_SEED=<n>).
inline uint64_t test_seed() {
  static const uint64_t seed = [] {
    const char* fixed = std::getenv("QKVFUSE_SEED");
    const uint64_t value = fixed ? std::strtoull(fixed, nullptr, 10) : std::random_device{}();
    std::printf("[qkvfuse] random seed %llu (replay with QKVFUSE_SEED=%llu)\n",
                (unsigned long long)value, (unsigned long long)value);
    return value;
  }();
  return seed;
}

/// A generator seeded from the run's seed and the current test's name, so each test draws its
/// own stream and is replayable alone.
inline std::mt19937_64 rng_for_test() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "";
  return std::mt19937_64(test_seed() ^ std::hash<std::string>{}(name));
}

inline constexpr uint16_t kPoisonBF16 = 0x7fc1;  // a NaN no computation produces
inline constexpr uint8_t kPoisonE4M3 = 0x7f;     // NaN

/// Host bf16 storage with conversion helpers.
inline std::vector<uint16_t> random_bf16(std::mt19937_64& rng, size_t count, float scale = 1.0f) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<uint16_t> out(count);
  for (auto& v : out) v = float_to_bf16(normal(rng));
  return out;
}

inline std::vector<float> random_f32(std::mt19937_64& rng, size_t count, float scale = 1.0f) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> out(count);
  for (auto& v : out) v = normal(rng);
  return out;
}

inline std::vector<uint8_t> random_e4m3(std::mt19937_64& rng, size_t count, float scale = 8.0f) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<uint8_t> out(count);
  for (auto& v : out) v = float_to_e4m3(normal(rng));
  return out;
}

inline constexpr Device kCPU{DeviceType::kCPU, 0};

/// Interleaved rotary factor tables as the model builds them: factor1 = cos, factor2 = sin with
/// odd lanes negated; dims >= rotary_dim (within each head_dim chunk) stationary: (1, 0).
/// `copies` is 1, or 2 for paired tables [T, 2D]. Values are rounded to bf16 so one table serves
/// bf16 and fp32 factor tests.
inline void rotary_tables(int64_t tokens, int64_t head_dim, int64_t copies, int64_t rotary_dim,
                          std::vector<float>& factor1, std::vector<float>& factor2) {
  const int64_t width = head_dim * copies;
  factor1.assign(size_t(tokens * width), 1.0f);
  factor2.assign(size_t(tokens * width), 0.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < width; ++c) {
      const int64_t d = c % head_dim;
      if (d >= rotary_dim) continue;
      const double freq = std::pow(1.0 / 1024.0, double(d / 2 * 2 + (c / head_dim)) / double(width));
      const double angle = double(t + 1) * freq;
      factor1[size_t(t * width + c)] = round_to_bf16(float(std::cos(angle)));
      const float s = round_to_bf16(float(std::sin(angle)));
      factor2[size_t(t * width + c)] = (d % 2) ? -s : s;
    }
  }
}

}  // namespace qkvfuse::test
