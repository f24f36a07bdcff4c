// test_cpu_families.cpp: the options of SPEC.md section 9 on the CPU backend (head width up to
// 512, the V norm, the token-wide norm, query-only calls, calls without angles), against the
// float64 model of tests/reference.hpp: each option alone and with the others and with section
// 8's, at odd sizes, and at the real shapes of the families that need them (Gemma 4, Qwen3-Next,
// OLMo 2/3, GLM-4.5, SmolLM3). The cases and tolerances are family_checks.hpp's, shared with the
// CUDA backend's test_cuda_families.cpp.
#include <gtest/gtest.h>

#include "family_checks.hpp"
#include "qkvfuse/qk_norm_rope.hpp"
#include "qkvfuse/qkv_backward_fp8.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace qkvfuse::test {
namespace {

using families::FamilyParam;

/// The public API on the host tensors themselves.
families::FamilyRunner cpu_runner() {
  return {[](const QkNormRopeParams& p) { qk_norm_rope(p); },
          [](const QkNormRopeBackwardParams& p) {
            EXPECT_EQ(backward_workspace_size(p), 0) << "the CPU backend needs no workspace";
            qk_norm_rope_backward(p);
          },
          [](const QkvBackwardFp8Params& p) {
            EXPECT_EQ(backward_workspace_size(p), 0) << "the CPU backend needs no workspace";
            qkv_backward_fp8(p);
          }};
}

class CpuFamilies : public ::testing::TestWithParam<FamilyParam> {};

TEST_P(CpuFamilies, ForwardBackwardAndFp8MatchTheModel) {
  const FamilyParam& param = GetParam();
  SCOPED_TRACE(describe(param.rope) + "; " + param.spec.describe());
  auto rng = rng_for_test();
  RopeData data(param.rope, param.spec, rng);
  families::check_all(data, rng, cpu_runner());
}

INSTANTIATE_TEST_SUITE_P(Options, CpuFamilies, ::testing::ValuesIn(families::family_params()),
                         [](const ::testing::TestParamInfo<FamilyParam>& info) {
                           return info.param.name;
                         });

TEST(CpuFamilies, Gemma4SlidingAndGlobalLayers) {
  auto rng = rng_for_test();
  families::gemma4_layers(rng, cpu_runner(), 0);
}

TEST(CpuFamilies, Gemma4KeyEqualsValueReadsTheKeyRowsOfQk) {
  auto rng = rng_for_test();
  families::gemma4_key_equals_value(rng, cpu_runner(), 0);
}

TEST(CpuFamilies, Qwen3NextGatedQueryAndPartialRotary) {
  auto rng = rng_for_test();
  families::qwen3_next(rng, cpu_runner(), 0);
}

TEST(CpuFamilies, Olmo3TokenNorm) {
  auto rng = rng_for_test();
  families::olmo_token_norm(rng, cpu_runner(), 0);
}

TEST(CpuFamilies, Glm45AndSmolLm3) {
  auto rng = rng_for_test();
  families::glm45_and_smollm3(rng, cpu_runner(), 0);
}

TEST(CpuFamilies, NoAnglesIsTheIdentityWithoutTheNorm) {
  auto rng = rng_for_test();
  families::no_angles_is_the_identity(rng, cpu_runner());
}

TEST(CpuFamilies, EmptyCallsWriteZeroWeightGradients) {
  auto rng = rng_for_test();
  families::empty_calls(rng, cpu_runner());
}

}  // namespace
}  // namespace qkvfuse::test
