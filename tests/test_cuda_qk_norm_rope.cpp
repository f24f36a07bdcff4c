// test_cuda_qk_norm_rope.cpp: the CUDA QK-norm + rotary, forward and bf16 backward (SPEC.md
// sections 1 and 2), against the CPU backend through the public API.
//
// Each case runs the op twice on the same inputs: CPU views (the CPU backend) and CUDA views of
// byte-identical copies (the kernels), then compares the bf16 outputs bit by bit. Both compute
// in fp32 with the same explicitly rounded element-wise operations; only the order of the fp32
// row sums differs, so an element may land one bf16 ulp away (counted and printed). Further
// away is accepted only where the row's values cancel, within kSumOrderNoise of the row's
// largest value (the error a different fp32 summation order can make there; counted and
// printed too); anything else fails. CUDA outputs are poisoned with a NaN pattern before every
// run, so an element the kernel never wrote shows as NaN, and every case is run twice on the
// GPU to check bit-identical reruns.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "gpu_util.hpp"
#include "qkvfuse/qkvfuse.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace qkvfuse::test {
namespace {

// ---- device copies -------------------------------------------------------------------------------

/// A contiguous bf16 device output, poisoned with the NaN pattern no computation produces.
DeviceView device_output(std::initializer_list<int64_t> sizes) {
  int64_t count = 1;
  for (int64_t s : sizes) count *= s;
  DeviceView out{DeviceBuffer(size_t(count) * 2), {}};
  out.view = make_view(out.buffer.data(), DType::kBFloat16, kGPU, sizes);
  fill_u16(out.buffer, kPoisonBF16);
  return out;
}

/// A CUDA stream of the test's own: the kernels must run on the stream they are given.
class Stream {
 public:
  Stream() { EXPECT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess); }
  ~Stream() { cudaStreamDestroy(stream_); }
  cudaStream_t get() const { return stream_; }
  void sync() const { ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess); }

 private:
  cudaStream_t stream_ = nullptr;
};

// ---- comparison ----------------------------------------------------------------------------------

/// bf16 bits on a line that is monotonic in value (-0 and +0 both 0).
int32_t bf16_order(uint16_t bits) {
  const int32_t magnitude = bits & 0x7fff;
  return (bits & 0x8000) ? -magnitude : magnitude;
}

bool bf16_is_nan(uint16_t bits) { return (bits & 0x7f80) == 0x7f80 && (bits & 0x007f) != 0; }

struct Diff {
  std::string what;
  int64_t count = 0;
  int64_t exact = 0;
  int64_t one_ulp = 0;    ///< one bf16 ulp apart (or +0 vs -0)
  int64_t in_noise = 0;   ///< further, within kSumOrderNoise of the row's largest value
  int64_t nan = 0;        ///< NaN on the GPU: unwritten (poison) or a computation gone wrong
  int64_t bad = 0;
  std::string first_bad;

  std::string summary() const {
    std::ostringstream out;
    out << what << ": " << count << " elements, " << exact << " exact, " << one_ulp
        << " by 1 ulp, " << in_noise << " in sum-order noise, " << nan << " NaN, " << bad
        << " bad" << (first_bad.empty() ? "" : " (first: " + first_bad + ")");
    return out.str();
  }
};

/// GPU against CPU, rows of `row_length` elements.
Diff compare_bf16(const std::string& what, const std::vector<uint16_t>& gpu,
                  const std::vector<uint16_t>& cpu, int64_t row_length) {
  Diff diff;
  diff.what = what;
  diff.count = int64_t(gpu.size());
  EXPECT_EQ(gpu.size(), cpu.size());
  for (size_t row = 0; row * row_length < gpu.size(); ++row) {
    double row_max = 0;
    for (int64_t i = 0; i < row_length; ++i) {
      row_max = std::fmax(row_max, std::fabs(bf16_to_float(cpu[row * row_length + i])));
    }
    for (int64_t i = 0; i < row_length; ++i) {
      const size_t at = row * row_length + size_t(i);
      const uint16_t a = gpu[at], b = cpu[at];
      if (bf16_is_nan(a)) {
        ++diff.nan;
      } else if (a == b) {
        ++diff.exact;
      } else if (std::abs(bf16_order(a) - bf16_order(b)) <= 1) {
        ++diff.one_ulp;
      } else if (std::fabs(double(bf16_to_float(a)) - double(bf16_to_float(b))) <=
                 kSumOrderNoise * row_max + std::fabs(double(bf16_to_float(b))) / 256) {
        ++diff.in_noise;
      } else {
        if (diff.bad++ == 0) {
          std::ostringstream out;
          out << "element " << at << ": gpu " << bf16_to_float(a) << " (0x" << std::hex << a
              << ") cpu " << std::dec << bf16_to_float(b) << " (0x" << std::hex << b << ")";
          diff.first_bad = out.str();
        }
      }
    }
  }
  return diff;
}

::testing::AssertionResult clean(const Diff& diff) {
  std::printf("[gpu vs cpu] %s\n", diff.summary().c_str());
  if (diff.bad == 0 && diff.nan == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << diff.summary();
}

// ---- cases ---------------------------------------------------------------------------------------

struct RopeCase {
  int64_t tokens = 1;
  int64_t heads = 1;
  int64_t head_dim = 64;
  bool paired = false;
  bool key_offset = false;
  int64_t rotary_dim = 0;        ///< key offset only
  int64_t table_rotary = -1;     ///< rotating dims of the factor tables; -1: D (or rotary_dim)
  DType factor_dtype = DType::kBFloat16;
  int64_t qk_extra_columns = 0;  ///< qk is a column slice of a wider [T, 2HD + extra] buffer
  int64_t qk_head_padding = 0;   ///< qk head stride D + this
  int64_t factor_padding = 0;    ///< factor token stride W + this
  int64_t grad_padding = 0;      ///< backward: grad_q/grad_k heads and token rows padded by this

  std::string describe() const {
    std::ostringstream out;
    out << "T=" << tokens << " H=" << heads << " D=" << head_dim << (paired ? " paired" : "");
    if (key_offset) out << " key_offset rotary_dim=" << rotary_dim;
    out << " tables rotate " << tables_rotary() << " factors " << dtype_name(factor_dtype)
        << " qk extra columns " << qk_extra_columns << " qk head padding " << qk_head_padding
        << " factor padding " << factor_padding << " grad padding " << grad_padding;
    return out.str();
  }
  int64_t tables_rotary() const {
    return table_rotary >= 0 ? table_rotary : (key_offset ? rotary_dim : head_dim);
  }
  int64_t out_tokens() const { return paired ? 2 * tokens : tokens; }
  int64_t out_heads() const { return paired ? heads / 2 : heads; }
  int64_t factor_width() const { return paired ? 2 * head_dim : head_dim; }
  RopeLayout layout() const {
    return {heads, key_offset ? rotary_dim : head_dim, paired, key_offset};
  }
};

/// Host inputs of a case (CPU views), random and fresh per call.
struct RopeInputs {
  HostTensor qk;
  HostTensor factor1;
  HostTensor factor2;

  RopeInputs(const RopeCase& c, std::mt19937_64& rng)
      : qk(DType::kBFloat16, {c.tokens, 2 * c.heads, c.head_dim},
           {2 * c.heads * (c.head_dim + c.qk_head_padding) + c.qk_extra_columns,
            c.head_dim + c.qk_head_padding, 1}),
        factor1(c.factor_dtype, {c.tokens, c.factor_width()},
                {c.factor_width() + c.factor_padding, 1}),
        factor2(c.factor_dtype, {c.tokens, c.factor_width()},
                {c.factor_width() + c.factor_padding, 1}) {
    // Rows of very different scales: rstd from ~1e-2 to ~1e2.
    std::vector<double> values =
        random_values(rng, size_t(c.tokens * 2 * c.heads * c.head_dim), DType::kBFloat16);
    std::uniform_int_distribution<int> exponent(-7, 7);
    for (size_t row = 0; row * c.head_dim < values.size(); ++row) {
      const double scale = std::ldexp(1.0, exponent(rng));
      for (int64_t d = 0; d < c.head_dim; ++d) values[row * c.head_dim + d] *= scale;
    }
    qk.set(values);
    std::vector<double> f1, f2;
    rotary_factor_values(rng, c.tokens, c.head_dim, c.paired ? 2 : 1, c.tables_rotary(),
                         c.factor_dtype == DType::kFloat32, f1, f2);
    factor1.set(f1);
    factor2.set(f2);
  }
};

// ---- forward -------------------------------------------------------------------------------------

struct ForwardResult {
  std::vector<uint16_t> q;
  std::vector<uint16_t> k;
};

ForwardResult run_forward_gpu(const RopeCase& c, const DeviceView& qk, const DeviceView& f1,
                              const DeviceView& f2, const Stream& stream) {
  DeviceView q = device_output({c.out_tokens(), c.out_heads(), c.head_dim});
  DeviceView k = device_output({c.out_tokens(), c.out_heads(), c.head_dim});
  // The poison (and the inputs) were written by cudaMemcpy / cudaMemset on the legacy default
  // stream, which a cudaStreamNonBlocking stream does not wait for, and a pageable-memory
  // cudaMemcpy may return before its DMA lands: without this the kernel can race the poison
  // and outputs it wrote can be overwritten by NaN afterwards.
  synchronize();
  QkNormRopeParams params{qk.view, f1.view, f2.view, q.view, k.view, c.layout(), stream.get()};
  qk_norm_rope(params);
  stream.sync();
  return {q.buffer.to_host<uint16_t>(), k.buffer.to_host<uint16_t>()};
}

void check_forward(const RopeCase& c) {
  SCOPED_TRACE(c.describe());
  auto rng = rng_for_test();
  RopeInputs in(c, rng);

  HostTensor q(DType::kBFloat16, {c.out_tokens(), c.out_heads(), c.head_dim});
  HostTensor k(DType::kBFloat16, {c.out_tokens(), c.out_heads(), c.head_dim});
  qk_norm_rope({in.qk.view(), in.factor1.view(), in.factor2.view(), q.view(), k.view(),
                c.layout()});

  const DeviceView qk = to_device(in.qk.view());
  const DeviceView f1 = to_device(in.factor1.view());
  const DeviceView f2 = to_device(in.factor2.view());
  Stream stream;
  const ForwardResult first = run_forward_gpu(c, qk, f1, f2, stream);
  EXPECT_TRUE(clean(compare_bf16("q", first.q, q.get_bf16_bits(), c.head_dim)));
  EXPECT_TRUE(clean(compare_bf16("k", first.k, k.get_bf16_bits(), c.head_dim)));

  const ForwardResult again = run_forward_gpu(c, qk, f1, f2, stream);
  EXPECT_TRUE(again.q == first.q && again.k == first.k) << "a rerun is not bit-identical";
}

/// Every mode at a width and token count: plain with the tables rotating all dims, plain with
/// partial rotary tables, paired (H even), key offset at D/2 and at the edges.
std::vector<RopeCase> mode_cases(int64_t tokens, int64_t heads, int64_t head_dim) {
  std::vector<RopeCase> cases;
  RopeCase plain;
  plain.tokens = tokens;
  plain.heads = heads;
  plain.head_dim = head_dim;
  cases.push_back(plain);
  RopeCase partial = plain;
  partial.table_rotary = head_dim / 4 * 2;
  cases.push_back(partial);
  if (heads % 2 == 0) {
    RopeCase paired = plain;
    paired.paired = true;
    cases.push_back(paired);
  }
  RopeCase shifted = plain;
  shifted.key_offset = true;
  shifted.rotary_dim = head_dim / 2;
  cases.push_back(shifted);
  return cases;
}

TEST(CudaQkNormRope, ForwardAllWidthsAndModes) {
  QKVF_REQUIRE_GPU();
  // 32/64/96/128/256: exact lane geometries; 40, 72, 136, 200, 248: masked generic ones.
  for (int64_t head_dim : {32, 64, 96, 128, 256, 40, 72, 136, 200, 248}) {
    for (int64_t tokens : {1, 3, 17}) {
      for (int64_t heads : {1, 2, 3, 6}) {
        for (const RopeCase& c : mode_cases(tokens, heads, head_dim)) check_forward(c);
      }
    }
  }
}

TEST(CudaQkNormRope, ForwardManyTokens) {
  QKVF_REQUIRE_GPU();
  for (int64_t head_dim : {64, 96, 128}) {
    for (const RopeCase& c : mode_cases(1000, 6, head_dim)) check_forward(c);
  }
}

TEST(CudaQkNormRope, ForwardModelShapes) {
  QKVF_REQUIRE_GPU();
  // T = 4096, qk the Q/K column block of the packed [T, 2HD + H*128] GEMM output.
  struct Shape {
    int64_t heads, head_dim;
  };
  for (const Shape s : {Shape{6, 128}, Shape{12, 64}, Shape{6, 96}, Shape{8, 128}}) {
    for (RopeCase c : mode_cases(4096, s.heads, s.head_dim)) {
      if (!c.paired) c.qk_extra_columns = s.heads * 128;
      check_forward(c);
    }
  }
}

TEST(CudaQkNormRope, ForwardFloat32Factors) {
  QKVF_REQUIRE_GPU();
  for (int64_t head_dim : {32, 64, 96, 128, 256, 72}) {
    for (RopeCase c : mode_cases(17, 2, head_dim)) {
      c.factor_dtype = DType::kFloat32;
      check_forward(c);
    }
  }
}

TEST(CudaQkNormRope, ForwardStridedInputs) {
  QKVF_REQUIRE_GPU();
  for (int64_t head_dim : {64, 96, 128}) {
    for (RopeCase c : mode_cases(33, 6, head_dim)) {
      c.qk_extra_columns = 6 * 128 + 8;
      c.qk_head_padding = 8;
      c.factor_padding = 16;
      check_forward(c);
    }
  }
}

TEST(CudaQkNormRope, ForwardKeyOffsetRotaryEdges) {
  QKVF_REQUIRE_GPU();
  // rotary_dim 0 (all dims shift), D (none), and values that split a 16-byte chunk.
  for (int64_t head_dim : {64, 96, 128}) {
    for (int64_t rotary_dim : {int64_t(0), int64_t(2), int64_t(36), head_dim - 2, head_dim}) {
      for (int64_t tokens : {1, 2, 17, 300}) {
        RopeCase c;
        c.tokens = tokens;
        c.heads = 3;
        c.head_dim = head_dim;
        c.key_offset = true;
        c.rotary_dim = rotary_dim;
        check_forward(c);
      }
    }
  }
}

// ---- backward ------------------------------------------------------------------------------------

/// grad_q / grad_k host tensors in the forward's output layout, padded per head and token row.
HostTensor grad_tensor(const RopeCase& c, std::mt19937_64& rng) {
  const int64_t head_stride = c.head_dim + c.grad_padding;
  HostTensor grad(DType::kBFloat16, {c.out_tokens(), c.out_heads(), c.head_dim},
                  {c.out_heads() * head_stride + c.grad_padding, head_stride, 1});
  grad.set(random_values(rng, size_t(c.out_tokens() * c.out_heads() * c.head_dim),
                         DType::kBFloat16));
  return grad;
}

std::vector<uint16_t> run_backward_gpu(const RopeCase& c, const DeviceView& grad_q,
                                       const DeviceView& grad_k, const DeviceView& qk,
                                       const DeviceView& f1, const DeviceView& f2,
                                       const Stream& stream) {
  DeviceView grad_qk = device_output({c.tokens, 2 * c.heads, c.head_dim});
  // The poison (and the inputs) were written by cudaMemcpy / cudaMemset on the legacy default
  // stream, which a cudaStreamNonBlocking stream does not wait for, and a pageable-memory
  // cudaMemcpy may return before its DMA lands: without this the kernel can race the poison
  // and outputs it wrote can be overwritten by NaN afterwards.
  synchronize();
  QkNormRopeBackwardParams params{grad_q.view, grad_k.view, qk.view,    f1.view,
                                  f2.view,     grad_qk.view, c.layout(), stream.get()};
  qk_norm_rope_backward(params);
  stream.sync();
  return grad_qk.buffer.to_host<uint16_t>();
}

void check_backward(const RopeCase& c) {
  SCOPED_TRACE(c.describe());
  auto rng = rng_for_test();
  RopeInputs in(c, rng);
  HostTensor grad_q = grad_tensor(c, rng);
  HostTensor grad_k = grad_tensor(c, rng);

  HostTensor grad_qk(DType::kBFloat16, {c.tokens, 2 * c.heads, c.head_dim});
  qk_norm_rope_backward({grad_q.view(), grad_k.view(), in.qk.view(), in.factor1.view(),
                         in.factor2.view(), grad_qk.view(), c.layout()});

  const DeviceView dq = to_device(grad_q.view());
  const DeviceView dk = to_device(grad_k.view());
  const DeviceView qk = to_device(in.qk.view());
  const DeviceView f1 = to_device(in.factor1.view());
  const DeviceView f2 = to_device(in.factor2.view());
  Stream stream;
  const std::vector<uint16_t> first = run_backward_gpu(c, dq, dk, qk, f1, f2, stream);
  EXPECT_TRUE(clean(compare_bf16("grad_qk", first, grad_qk.get_bf16_bits(), c.head_dim)));
  const std::vector<uint16_t> again = run_backward_gpu(c, dq, dk, qk, f1, f2, stream);
  EXPECT_TRUE(again == first) << "a rerun is not bit-identical";
}

TEST(CudaQkNormRope, BackwardAllWidthsAndModes) {
  QKVF_REQUIRE_GPU();
  for (int64_t head_dim : {32, 64, 96, 128, 256, 40, 72, 136, 200, 248}) {
    for (int64_t tokens : {1, 3, 17}) {
      for (int64_t heads : {1, 2, 3, 6}) {
        for (const RopeCase& c : mode_cases(tokens, heads, head_dim)) check_backward(c);
      }
    }
  }
}

TEST(CudaQkNormRope, BackwardManyTokensAndModelShapes) {
  QKVF_REQUIRE_GPU();
  for (int64_t head_dim : {64, 96, 128}) {
    for (const RopeCase& c : mode_cases(1000, 6, head_dim)) check_backward(c);
  }
  struct Shape {
    int64_t heads, head_dim;
  };
  for (const Shape s : {Shape{6, 128}, Shape{12, 64}, Shape{6, 96}}) {
    for (RopeCase c : mode_cases(4096, s.heads, s.head_dim)) {
      if (!c.paired) c.qk_extra_columns = s.heads * 128;
      check_backward(c);
    }
  }
}

TEST(CudaQkNormRope, BackwardFloat32FactorsAndStridedGrads) {
  QKVF_REQUIRE_GPU();
  for (int64_t head_dim : {32, 64, 96, 128, 256, 72}) {
    for (RopeCase c : mode_cases(17, 2, head_dim)) {
      c.factor_dtype = DType::kFloat32;
      check_backward(c);
      c.factor_dtype = DType::kBFloat16;
      c.grad_padding = 8;
      c.qk_extra_columns = 2 * 128 + 8;
      c.qk_head_padding = 8;
      c.factor_padding = 8;
      check_backward(c);
    }
  }
}

TEST(CudaQkNormRope, BackwardKeyOffsetRotaryEdges) {
  QKVF_REQUIRE_GPU();
  for (int64_t head_dim : {64, 128}) {
    for (int64_t rotary_dim : {int64_t(0), int64_t(36), head_dim}) {
      for (int64_t tokens : {1, 2, 300}) {
        RopeCase c;
        c.tokens = tokens;
        c.heads = 3;
        c.head_dim = head_dim;
        c.key_offset = true;
        c.rotary_dim = rotary_dim;
        c.grad_padding = 16;
        check_backward(c);
      }
    }
  }
}

// ---- errors and edges ----------------------------------------------------------------------------

TEST(CudaQkNormRope, RefusesWidthsNotMultipleOf8) {
  QKVF_REQUIRE_GPU();
  // Even widths the API takes but the 16-byte kernels do not: a clear error naming D.
  RopeCase c;
  c.tokens = 4;
  c.heads = 2;
  c.head_dim = 36;
  auto rng = rng_for_test();
  RopeInputs in(c, rng);
  DeviceView qk = to_device(in.qk.view());
  DeviceView f1 = to_device(in.factor1.view());
  DeviceView f2 = to_device(in.factor2.view());
  DeviceView q = device_output({c.tokens, c.heads, c.head_dim});
  DeviceView k = device_output({c.tokens, c.heads, c.head_dim});
  EXPECT_TRUE(throws_error(
      [&] { qk_norm_rope({qk.view, f1.view, f2.view, q.view, k.view, c.layout()}); }, {"36"}));
}

TEST(CudaQkNormRope, ZeroTokensIsANoOp) {
  QKVF_REQUIRE_GPU();
  DeviceBuffer a(256), b(256), c(256), d(256);
  const TensorView qk = make_view(a.data(), DType::kBFloat16, kGPU, {0, 4, 64});
  const TensorView f = make_view(b.data(), DType::kBFloat16, kGPU, {0, 64});
  const TensorView q = make_view(c.data(), DType::kBFloat16, kGPU, {0, 2, 64});
  const TensorView k = make_view(d.data(), DType::kBFloat16, kGPU, {0, 2, 64});
  EXPECT_NO_THROW(qk_norm_rope({qk, f, f, q, k, RopeLayout{2, 64, false, false}}));
  synchronize();
}

}  // namespace
}  // namespace qkvfuse::test
