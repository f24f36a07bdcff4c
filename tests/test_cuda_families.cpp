// test_cuda_families.cpp: SPEC.md section 9's options on the CUDA backend (head width up to 512,
// the V norm, the token-wide norm, query-only calls, calls without angles), which run only with
// QKVFUSE_CUDA_SECTION9=1 (set here through validate::set_cuda_section9_for_testing), against the
// float64 model: the cases and tolerances of family_checks.hpp (test_cpu_families.cpp judges the
// CPU backend by the same), each op run on device copies of the host tensors and written back, so
// that poisoned outputs left unwritten, touched padding of strided views and rerun bits are
// checked as on the CPU. The real shapes run at more tokens than on the CPU (several 16-token
// blocks of the token-wide norm's kernels, several FP8 tiles, a multi-level reduction of the
// weights' partial rows). bf16 qk only (the CUDA backend's dtype). Skipped without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <deque>
#include <optional>
#include <utility>
#include <vector>

#include "family_checks.hpp"
#include "gpu_util.hpp"
#include "qkvfuse/qk_norm_rope.hpp"
#include "qkvfuse/qkv_backward_fp8.hpp"
#include "reference.hpp"
#include "test_util.hpp"
#include "validate.hpp"

namespace qkvfuse::test {
namespace {

using families::FamilyParam;

/// Device copies of one call's host views: every byte from a view's first element to its last
/// (padding between strided rows included), written back to the host after the op, inputs too
/// (a kernel that wrote one shows there).
class Mirrors {
 public:
  TensorView operator()(const TensorView& host) {
    if (is_absent(host)) return host;
    if (host.numel() == 0) {  // nothing to copy; on the device all the same
      TensorView empty = host;
      empty.data = nullptr;
      empty.device = kGPU;
      return empty;
    }
    copies_.push_back({to_device(host), host});
    return copies_.back().device.view;
  }
  /// A poisoned (NaN) float32 workspace of `size` elements, or none for 0.
  TensorView workspace(int64_t size) {
    if (size == 0) return {};
    workspaces_.emplace_back(size_t(size) * sizeof(float));
    workspaces_.back().fill_byte(0xff);
    return make_view(workspaces_.back().data(), DType::kFloat32, kGPU, {size});
  }
  void write_back() {
    synchronize();
    for (const Copy& copy : copies_) {
      int64_t last = 0;
      for (int d = 0; d < copy.host.ndim; ++d) last += (copy.host.sizes[d] - 1) * copy.host.strides[d];
      const size_t bytes = size_t(last + 1) * dtype_size(copy.host.dtype);
      ASSERT_EQ(cudaMemcpy(copy.host.data, copy.device.view.data, bytes, cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
  }

 private:
  struct Copy {
    DeviceView device;
    TensorView host;
  };
  std::deque<Copy> copies_;
  std::deque<DeviceBuffer> workspaces_;
};

void mirror_layout(Mirrors& m, RopeLayout& layout) {
  for (TensorView* view : {&layout.factor1, &layout.factor2, &layout.cos_sin, &layout.positions,
                           &layout.q_weight, &layout.k_weight}) {
    *view = m(*view);
  }
}

/// The public API on device copies of the host tensors (and the workspace the backward asks for).
families::FamilyRunner cuda_runner() {
  return {[](const QkNormRopeParams& host) {
            Mirrors m;
            QkNormRopeParams p = host;
            p.qk = m(host.qk);
            p.q = m(host.q);
            p.k = m(host.k);
            p.v = m(host.v);
            p.v_out = m(host.v_out);
            mirror_layout(m, p.layout);
            qk_norm_rope(p);
            m.write_back();
          },
          [](const QkNormRopeBackwardParams& host) {
            Mirrors m;
            QkNormRopeBackwardParams p = host;
            p.grad_q = m(host.grad_q);
            p.grad_k = m(host.grad_k);
            p.qk = m(host.qk);
            p.grad_qk = m(host.grad_qk);
            p.grad_q_weight = m(host.grad_q_weight);
            p.grad_k_weight = m(host.grad_k_weight);
            p.grad_v_out = m(host.grad_v_out);
            p.v = m(host.v);
            p.grad_v = m(host.grad_v);
            mirror_layout(m, p.layout);
            p.workspace = m.workspace(backward_workspace_size(p));
            qk_norm_rope_backward(p);
            m.write_back();
          },
          [](const QkvBackwardFp8Params& host) {
            Mirrors m;
            QkvBackwardFp8Params p = host;
            p.grad_q = m(host.grad_q);
            p.grad_k = m(host.grad_k);
            p.grad_v = m(host.grad_v);
            p.qk = m(host.qk);
            p.grad_scale = m(host.grad_scale);
            p.grad_row = m(host.grad_row);
            p.grad_t = m(host.grad_t);
            p.grad_q_weight = m(host.grad_q_weight);
            p.grad_k_weight = m(host.grad_k_weight);
            p.v = m(host.v);
            mirror_layout(m, p.layout);
            p.workspace = m.workspace(backward_workspace_size(p));
            qkv_backward_fp8(p);
            m.write_back();
          }};
}

/// The switch on for the test (the kernels of section 9 run), off again after it.
class CudaFamiliesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    QKVF_REQUIRE_GPU();
    validate::set_cuda_section9_for_testing(true);
  }
  void TearDown() override { validate::set_cuda_section9_for_testing(false); }
};

class CudaFamilies : public ::testing::TestWithParam<FamilyParam> {
 protected:
  void SetUp() override {
    QKVF_REQUIRE_GPU();
    validate::set_cuda_section9_for_testing(true);
  }
  void TearDown() override { validate::set_cuda_section9_for_testing(false); }
};

/// The sweep's cases the CUDA backend takes: bf16 qk (the CPU's float32 and float64 cases left
/// out).
std::vector<FamilyParam> cuda_family_params() {
  std::vector<FamilyParam> params;
  for (const FamilyParam& param : families::family_params()) {
    if (param.spec.qk_dtype == DType::kBFloat16) params.push_back(param);
  }
  return params;
}

TEST_P(CudaFamilies, ForwardBackwardAndFp8MatchTheModel) {
  const FamilyParam& param = GetParam();
  SCOPED_TRACE(describe(param.rope) + "; " + param.spec.describe());
  auto rng = rng_for_test();
  RopeData data(param.rope, param.spec, rng);
  families::check_all(data, rng, cuda_runner());
}

INSTANTIATE_TEST_SUITE_P(Options, CudaFamilies, ::testing::ValuesIn(cuda_family_params()),
                         [](const ::testing::TestParamInfo<FamilyParam>& info) {
                           return info.param.name;
                         });

// The families' real shapes at 67 tokens: five blocks of the token-wide norm's kernels, the FP8
// backward's 64-token tiles at D = 512 twice.
constexpr int64_t kShapeTokens = 67;

TEST_F(CudaFamiliesTest, Gemma4SlidingAndGlobalLayers) {
  auto rng = rng_for_test();
  families::gemma4_layers(rng, cuda_runner(), kShapeTokens);
}

TEST_F(CudaFamiliesTest, Gemma4KeyEqualsValueReadsTheKeyRowsOfQk) {
  auto rng = rng_for_test();
  families::gemma4_key_equals_value(rng, cuda_runner(), kShapeTokens);
}

TEST_F(CudaFamiliesTest, Qwen3NextGatedQueryAndPartialRotary) {
  auto rng = rng_for_test();
  families::qwen3_next(rng, cuda_runner(), kShapeTokens);
}

TEST_F(CudaFamiliesTest, Olmo3TokenNorm) {
  auto rng = rng_for_test();
  families::olmo_token_norm(rng, cuda_runner(), kShapeTokens);
}

TEST_F(CudaFamiliesTest, Olmo3TokenNormManyTokens) {
  // 1100 tokens: 69 partial rows of the weights' gradients (two levels of their reduction).
  auto rng = rng_for_test();
  families::olmo_token_norm(rng, cuda_runner(), 1100);
}

TEST_F(CudaFamiliesTest, Glm45AndSmolLm3) {
  auto rng = rng_for_test();
  families::glm45_and_smollm3(rng, cuda_runner(), kShapeTokens);
}

TEST_F(CudaFamiliesTest, NoAnglesIsTheIdentityWithoutTheNorm) {
  auto rng = rng_for_test();
  families::no_angles_is_the_identity(rng, cuda_runner());
}

TEST_F(CudaFamiliesTest, EmptyCallsWriteZeroWeightGradients) {
  auto rng = rng_for_test();
  families::empty_calls(rng, cuda_runner());
}

TEST_F(CudaFamiliesTest, VNormWiderThan512IsRefused) {
  // The V rows take the kernels' row geometry, 512 wide at most: a wider Dv is refused by name.
  auto rng = rng_for_test();
  ref::Rope rope{3, 2, 64};
  rope.normalize_v = true;
  RopeSpec spec;
  spec.v_dim = 513;
  RopeData data(rope, spec, rng);
  HostTensor q(DType::kBFloat16, {3, 2, 64}), k(DType::kBFloat16, {3, 2, 64}),
      v_out(DType::kBFloat16, {3, 2, 513});
  QkNormRopeParams p{data.qk_tensor->view(), q.view(), k.view(), data.layout()};
  p.v = data.v_tensor->view();
  p.v_out = v_out.view();
  EXPECT_TRUE(throws_error([&] { cuda_runner().forward(p); },
                           {"qk_norm_rope: v: expected a V head width Dv in [1, 512] on cuda:0"}));
}

TEST(CudaFamiliesSwitch, OffByDefaultRefusesEachOptionByName) {
  // Without the switch the kernels above never run: the call is refused before any launch, and
  // the message says how to opt in.
  QKVF_REQUIRE_GPU();
  validate::set_cuda_section9_for_testing(false);
  auto rng = rng_for_test();
  ref::Rope rope{5, 4, 64};
  rope.kv_heads = 2;
  rope.token_norm = true;
  RopeSpec spec;
  spec.cache = true;
  RopeData data(rope, spec, rng);
  HostTensor q(DType::kBFloat16, {5, 4, 64}), k(DType::kBFloat16, {5, 2, 64});
  const families::FamilyRunner runner = cuda_runner();
  EXPECT_TRUE(throws_error(
      [&] { runner.forward({data.qk_tensor->view(), q.view(), k.view(), data.layout()}); },
      {"qk_norm_rope: layout.norm_scope: NormScope::kToken (one RMS over the token): not yet on "
       "the CUDA backend",
       "set QKVFUSE_CUDA_SECTION9=1 to try the untested kernels"}));
  EXPECT_EQ(q.elements_touched(), 0);
}

}  // namespace
}  // namespace qkvfuse::test
