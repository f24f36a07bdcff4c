// test_cuda_qkv_backward_fp8.cpp: the CUDA fused backward into FP8 (SPEC.md section 3), against
// the CPU backend through the public API.
//
// Each case runs the op on CPU views and on CUDA views of byte-identical copies and compares the
// e4m3 codes of grad_row and grad_t. V features involve no arithmetic besides the fp32 division
// and the cast, so they must match bit for bit. Q/K features come from a row computation whose
// fp32 sums run in a different order on the GPU: a code may then be one e4m3 step away (counted
// and printed); further only where the row cancels, within kSumOrderNoise of the row's largest
// value (counted and printed); anything else fails. The GPU's grad_t must be exactly the
// transpose of its grad_row. Outputs are poisoned with e4m3 NaN (0x7f) before every run, which a
// correct run never leaves (inputs are finite and the cast saturates), and every case is rerun
// to check bit-identical results.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "gpu_util.hpp"
#include "qkvfuse/qkvfuse.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace qkvfuse::test {
namespace {

// ---- streams -------------------------------------------------------------------------------------

class Stream {
 public:
  Stream() { EXPECT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess); }
  ~Stream() { cudaStreamDestroy(stream_); }
  cudaStream_t get() const { return stream_; }
  void sync() const { ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess); }

 private:
  cudaStream_t stream_ = nullptr;
};

// ---- cases ---------------------------------------------------------------------------------------

struct Fp8Case {
  int64_t tokens = 1;
  int64_t heads = 1;
  int64_t head_dim = 64;
  int64_t v_dim = 128;
  bool paired = false;
  bool key_offset = false;
  int64_t rotary_dim = 0;
  DType factor_dtype = DType::kBFloat16;
  float grad_scale = 1.0f / 448.0f;
  int scale_ndim = 0;            ///< grad_scale shape [] (0) or [1] (1)
  int64_t qk_extra_columns = 0;  ///< qk: a column slice of a wider [T, 2HD + extra] buffer
  int64_t grad_padding = 0;      ///< grad_q/grad_k/grad_v heads and token rows padded by this

  std::string describe() const {
    std::ostringstream out;
    out << "T=" << tokens << " H=" << heads << " D=" << head_dim << " Dv=" << v_dim
        << (paired ? " paired" : "");
    if (key_offset) out << " key_offset rotary_dim=" << rotary_dim;
    out << " factors " << dtype_name(factor_dtype) << " grad_scale " << grad_scale << " (ndim "
        << scale_ndim << ") qk extra columns " << qk_extra_columns << " grad padding "
        << grad_padding;
    return out.str();
  }
  int64_t out_tokens() const { return paired ? 2 * tokens : tokens; }
  int64_t out_heads() const { return paired ? heads / 2 : heads; }
  int64_t factor_width() const { return paired ? 2 * head_dim : head_dim; }
  int64_t qkv_dim() const { return 2 * heads * head_dim + heads * v_dim; }
  RopeLayout layout() const {
    return {heads, key_offset ? rotary_dim : head_dim, paired, key_offset};
  }
};

struct Fp8Inputs {
  HostTensor grad_q, grad_k, grad_v, qk, factor1, factor2;
  std::vector<float> scale;

  static HostTensor padded(const std::vector<int64_t>& sizes, int64_t padding) {
    const int64_t head_stride = sizes[2] + padding;
    return HostTensor(DType::kBFloat16, sizes,
                      {sizes[1] * head_stride + padding, head_stride, 1});
  }

  Fp8Inputs(const Fp8Case& c, std::mt19937_64& rng)
      : grad_q(padded({c.out_tokens(), c.out_heads(), c.head_dim}, c.grad_padding)),
        grad_k(padded({c.out_tokens(), c.out_heads(), c.head_dim}, c.grad_padding)),
        grad_v(padded({c.tokens, c.heads, c.v_dim}, c.grad_padding)),
        qk(DType::kBFloat16, {c.tokens, 2 * c.heads, c.head_dim},
           {2 * c.heads * c.head_dim + c.qk_extra_columns, c.head_dim, 1}),
        factor1(c.factor_dtype, {c.tokens, c.factor_width()}),
        factor2(c.factor_dtype, {c.tokens, c.factor_width()}),
        scale{c.grad_scale} {
    // Gradients of a few units of the scale's range, some past 448 * scale (saturation).
    const double g = 64.0 * c.grad_scale;
    grad_q.set(random_values(rng, size_t(c.out_tokens() * c.out_heads() * c.head_dim),
                             DType::kBFloat16, g));
    grad_k.set(random_values(rng, size_t(c.out_tokens() * c.out_heads() * c.head_dim),
                             DType::kBFloat16, g));
    grad_v.set(random_values(rng, size_t(c.tokens * c.heads * c.v_dim), DType::kBFloat16, g));
    std::vector<double> values =
        random_values(rng, size_t(c.tokens * 2 * c.heads * c.head_dim), DType::kBFloat16);
    std::uniform_int_distribution<int> exponent(-5, 5);
    for (size_t row = 0; row * c.head_dim < values.size(); ++row) {
      const double s = std::ldexp(1.0, exponent(rng));
      for (int64_t d = 0; d < c.head_dim; ++d) values[row * c.head_dim + d] *= s;
    }
    qk.set(values);
    std::vector<double> f1, f2;
    rotary_factor_values(rng, c.tokens, c.head_dim, c.paired ? 2 : 1,
                         c.key_offset ? c.rotary_dim : c.head_dim,
                         c.factor_dtype == DType::kFloat32, f1, f2);
    factor1.set(f1);
    factor2.set(f2);
  }
};

// ---- comparison ----------------------------------------------------------------------------------

int32_t e4m3_order(uint8_t code) {
  const int32_t magnitude = code & 0x7f;
  return (code & 0x80) ? -magnitude : magnitude;
}

bool e4m3_is_nan(uint8_t code) { return (code & 0x7f) == 0x7f; }

struct Diff {
  std::string what;
  int64_t count = 0, exact = 0, one_step = 0, in_noise = 0, nan = 0, bad = 0;
  std::string first_bad;
  std::string summary() const {
    std::ostringstream out;
    out << what << ": " << count << " codes, " << exact << " exact, " << one_step
        << " by 1 step, " << in_noise << " in sum-order noise, " << nan << " NaN, " << bad
        << " bad" << (first_bad.empty() ? "" : " (first: " + first_bad + ")");
    return out.str();
  }
};

::testing::AssertionResult clean(const Diff& diff) {
  std::printf("[gpu vs cpu] %s\n", diff.summary().c_str());
  if (diff.bad == 0 && diff.nan == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << diff.summary();
}

/// grad_row codes [T][qkv_dim], GPU against CPU: V features exact, Q/K features within a step
/// (or within the row's sum-order noise).
Diff compare_grad_row(const Fp8Case& c, const std::vector<uint8_t>& gpu,
                      const std::vector<uint8_t>& cpu) {
  Diff diff;
  diff.what = "grad_row";
  diff.count = int64_t(gpu.size());
  EXPECT_EQ(gpu.size(), cpu.size());
  const int64_t qk_features = 2 * c.heads * c.head_dim;
  for (int64_t t = 0; t < c.tokens; ++t) {
    const uint8_t* g = gpu.data() + t * c.qkv_dim();
    const uint8_t* r = cpu.data() + t * c.qkv_dim();
    // 2H Q/K rows of D features, then H V rows of Dv.
    for (int64_t row = 0; row < 3 * c.heads; ++row) {
      const bool qk_row = row < 2 * c.heads;
      const int64_t begin = qk_row ? row * c.head_dim : qk_features + (row - 2 * c.heads) * c.v_dim;
      const int64_t end = begin + (qk_row ? c.head_dim : c.v_dim);
      double row_max = 0;
      for (int64_t f = begin; f < end; ++f) {
        row_max = std::fmax(row_max, std::fabs(e4m3_to_float(r[f])));
      }
      for (int64_t f = begin; f < end; ++f) {
        const uint8_t a = g[f], b = r[f];
        if (e4m3_is_nan(a)) {
          ++diff.nan;
        } else if (a == b) {
          ++diff.exact;
        } else if (qk_row && std::abs(e4m3_order(a) - e4m3_order(b)) <= 1) {
          ++diff.one_step;
        } else if (qk_row && std::fabs(double(e4m3_to_float(a)) - double(e4m3_to_float(b))) <=
                                 kSumOrderNoise * row_max + std::fabs(e4m3_to_float(b)) / 16 +
                                     1.0 / 1024) {
          ++diff.in_noise;
        } else if (diff.bad++ == 0) {
          std::ostringstream out;
          out << "token " << t << " feature " << f << (qk_row ? " (Q/K)" : " (V)") << ": gpu 0x"
              << std::hex << int(a) << " cpu 0x" << int(b);
          diff.first_bad = out.str();
        }
      }
    }
  }
  return diff;
}

// ---- running -------------------------------------------------------------------------------------

struct Fp8Result {
  std::vector<uint8_t> row;
  std::vector<uint8_t> t;
};

struct DeviceInputs {
  DeviceView grad_q, grad_k, grad_v, qk, factor1, factor2, scale;
};

Fp8Result run_gpu(const Fp8Case& c, const DeviceInputs& in, const Stream& stream) {
  DeviceBuffer row(size_t(c.tokens * c.qkv_dim()));
  DeviceBuffer t(size_t(c.tokens * c.qkv_dim()));
  row.fill_byte(kPoisonE4M3);
  t.fill_byte(kPoisonE4M3);
  // The poison (and the inputs) were written by cudaMemcpy / cudaMemset on the legacy default
  // stream, which a cudaStreamNonBlocking stream does not wait for, and a pageable-memory
  // cudaMemcpy may return before its DMA lands: without this the kernel can race the poison
  // and outputs it wrote can be overwritten by NaN afterwards.
  synchronize();
  QkvBackwardFp8Params params;
  params.grad_q = in.grad_q.view;
  params.grad_k = in.grad_k.view;
  params.grad_v = in.grad_v.view;
  params.qk = in.qk.view;
  params.factor1 = in.factor1.view;
  params.factor2 = in.factor2.view;
  params.grad_scale = in.scale.view;
  params.grad_row = make_view(row.data(), DType::kFloat8E4M3, kGPU, {c.tokens, c.qkv_dim()});
  params.grad_t = make_view(t.data(), DType::kFloat8E4M3, kGPU, {c.qkv_dim(), c.tokens});
  params.layout = c.layout();
  params.stream = stream.get();
  qkv_backward_fp8(params);
  stream.sync();
  return {row.to_host<uint8_t>(), t.to_host<uint8_t>()};
}

TensorView scale_view(float* data, Device device, int ndim) {
  return ndim == 0 ? make_view(data, DType::kFloat32, device, {})
                   : make_view(data, DType::kFloat32, device, {1});
}

void check_fp8(const Fp8Case& c) {
  SCOPED_TRACE(c.describe());
  auto rng = rng_for_test();
  Fp8Inputs in(c, rng);

  HostTensor row(DType::kFloat8E4M3, {c.tokens, c.qkv_dim()});
  HostTensor t(DType::kFloat8E4M3, {c.qkv_dim(), c.tokens});
  QkvBackwardFp8Params cpu;
  cpu.grad_q = in.grad_q.view();
  cpu.grad_k = in.grad_k.view();
  cpu.grad_v = in.grad_v.view();
  cpu.qk = in.qk.view();
  cpu.factor1 = in.factor1.view();
  cpu.factor2 = in.factor2.view();
  cpu.grad_scale = scale_view(in.scale.data(), kCPU, c.scale_ndim);
  cpu.grad_row = row.view();
  cpu.grad_t = t.view();
  cpu.layout = c.layout();
  qkv_backward_fp8(cpu);

  DeviceInputs dev{to_device(in.grad_q.view()),  to_device(in.grad_k.view()),
                   to_device(in.grad_v.view()),  to_device(in.qk.view()),
                   to_device(in.factor1.view()), to_device(in.factor2.view()),
                   to_device(cpu.grad_scale)};
  dev.scale.view = scale_view(static_cast<float*>(dev.scale.buffer.data()), kGPU, c.scale_ndim);
  Stream stream;
  const Fp8Result first = run_gpu(c, dev, stream);
  EXPECT_TRUE(clean(compare_grad_row(c, first.row, row.get_codes())));
  EXPECT_TRUE(first.t == transpose(first.row, c.tokens, c.qkv_dim()))
      << "the GPU's grad_t is not the transpose of its grad_row";
  EXPECT_TRUE(clean(compare_grad_row(c, transpose(first.t, c.qkv_dim(), c.tokens),
                                     transpose(t.get_codes(), c.qkv_dim(), c.tokens))));

  const Fp8Result again = run_gpu(c, dev, stream);
  EXPECT_TRUE(again.row == first.row && again.t == first.t) << "a rerun is not bit-identical";
}

std::vector<Fp8Case> mode_cases(int64_t tokens, int64_t heads, int64_t head_dim, int64_t v_dim) {
  std::vector<Fp8Case> cases;
  Fp8Case plain;
  plain.tokens = tokens;
  plain.heads = heads;
  plain.head_dim = head_dim;
  plain.v_dim = v_dim;
  cases.push_back(plain);
  if (heads % 2 == 0) {
    Fp8Case paired = plain;
    paired.paired = true;
    cases.push_back(paired);
  }
  Fp8Case shifted = plain;
  shifted.key_offset = true;
  shifted.rotary_dim = head_dim / 2;
  cases.push_back(shifted);
  return cases;
}

// ---- tests ---------------------------------------------------------------------------------------

TEST(CudaQkvBackwardFp8, AllWidthsAndModes) {
  QKVF_REQUIRE_GPU();
  for (int64_t head_dim : {32, 64, 96, 128, 256, 40, 72, 136, 200}) {
    for (int64_t v_dim : {64, 128}) {
      for (int64_t tokens : {1, 3, 17}) {
        for (int64_t heads : {1, 2, 3}) {
          for (const Fp8Case& c : mode_cases(tokens, heads, head_dim, v_dim)) check_fp8(c);
        }
      }
    }
  }
}

TEST(CudaQkvBackwardFp8, OddVWidths) {
  QKVF_REQUIRE_GPU();
  for (int64_t v_dim : {8, 24, 96, 200, 256}) {
    for (const Fp8Case& c : mode_cases(33, 2, 64, v_dim)) check_fp8(c);
  }
}

TEST(CudaQkvBackwardFp8, TokenCountsAroundTheTile) {
  QKVF_REQUIRE_GPU();
  // 1000: grad_t rows not 16-byte aligned (byte path); 2064: aligned, a partial last tile;
  // 128 and 4096: whole tiles.
  for (int64_t tokens : {127, 128, 129, 1000, 2064}) {
    for (const Fp8Case& c : mode_cases(tokens, 6, 128, 128)) check_fp8(c);
  }
}

TEST(CudaQkvBackwardFp8, ModelShapes) {
  QKVF_REQUIRE_GPU();
  struct Shape {
    int64_t heads, head_dim;
  };
  for (const Shape s : {Shape{6, 128}, Shape{12, 64}, Shape{6, 96}}) {
    for (Fp8Case c : mode_cases(4096, s.heads, s.head_dim, 128)) {
      if (!c.paired) c.qk_extra_columns = s.heads * 128;
      check_fp8(c);
    }
  }
}

TEST(CudaQkvBackwardFp8, Float32FactorsStridesAndScales) {
  QKVF_REQUIRE_GPU();
  for (int64_t head_dim : {64, 96, 128}) {
    for (Fp8Case c : mode_cases(40, 2, head_dim, 64)) {
      c.factor_dtype = DType::kFloat32;
      c.scale_ndim = 1;
      check_fp8(c);
      c.factor_dtype = DType::kBFloat16;
      c.grad_padding = 8;
      c.qk_extra_columns = 2 * 64 + 8;
      c.grad_scale = 0.0371f;  // not a power of two: the division must be exact
      check_fp8(c);
      c.grad_scale = 1e-4f;  // most values saturate at +-448
      check_fp8(c);
    }
  }
}

TEST(CudaQkvBackwardFp8, ScalesAtTheFastDivisionEdges) {
  // The kernel divides with E4m3Scaler, whose branch-free path covers scales in [2^-29, 2^31]:
  // both edges from both sides, and the small non-power-of-two scales of current scaling.
  QKVF_REQUIRE_GPU();
  for (float scale : {0x1p-29f, 0x1.fffffep-30f, 0x1p31f, 0x1.000002p31f, 9.3e-8f, 3.3e-9f}) {
    for (Fp8Case c : mode_cases(129, 2, 64, 64)) {
      c.grad_scale = scale;
      check_fp8(c);
    }
  }
}

TEST(CudaQkvBackwardFp8, KeyOffsetRotaryEdges) {
  QKVF_REQUIRE_GPU();
  for (int64_t rotary_dim : {0, 36, 128}) {
    for (int64_t tokens : {1, 2, 129, 300}) {
      Fp8Case c;
      c.tokens = tokens;
      c.heads = 3;
      c.head_dim = 128;
      c.key_offset = true;
      c.rotary_dim = rotary_dim;
      check_fp8(c);
    }
  }
  for (int64_t head_dim : {72, 96, 136, 184}) {  // 3-chunk geometries: 16 lanes under key offset
    Fp8Case c;
    c.tokens = 37;
    c.heads = 2;
    c.head_dim = head_dim;
    c.key_offset = true;
    c.rotary_dim = head_dim / 2;
    check_fp8(c);
  }
}

TEST(CudaQkvBackwardFp8, RefusesUnsupportedWidths) {
  QKVF_REQUIRE_GPU();
  // Head widths and V widths the API takes but the 16-byte kernels do not: an error naming them.
  for (const auto& [head_dim, v_dim, name] :
       {std::tuple<int64_t, int64_t, const char*>{36, 64, "36"},
        std::tuple<int64_t, int64_t, const char*>{64, 12, "12"}}) {
    Fp8Case c;
    c.tokens = 4;
    c.heads = 2;
    c.head_dim = head_dim;
    c.v_dim = v_dim;
    auto rng = rng_for_test();
    Fp8Inputs in(c, rng);
    DeviceInputs dev{to_device(in.grad_q.view()),  to_device(in.grad_k.view()),
                     to_device(in.grad_v.view()),  to_device(in.qk.view()),
                     to_device(in.factor1.view()), to_device(in.factor2.view()),
                     to_device(scale_view(in.scale.data(), kCPU, 0))};
    dev.scale.view = scale_view(static_cast<float*>(dev.scale.buffer.data()), kGPU, 0);
    Stream stream;
    EXPECT_TRUE(throws_error([&] { run_gpu(c, dev, stream); }, {name}));
  }
}

}  // namespace
}  // namespace qkvfuse::test
