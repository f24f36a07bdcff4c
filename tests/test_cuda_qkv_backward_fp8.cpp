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
// correct run never leaves (inputs are finite and the cast saturates), as is the allocation
// around them (a write outside an output shows), and every case is rerun to check bit-identical
// results.
//
// The op has two CUDA kernels: the 16-byte-vector one, for "vector friendly" arguments (D a
// multiple of 8 from 32, Dv a multiple of 8 up to 256, every bf16 and factor pointer and every
// stride but the last 16-byte aligned, grad_row and grad_t 16-byte aligned), and the
// element-pair kernel of the generic path for the rest of the domain (any even D in [2, 256], Dv
// in [1, 512], element-aligned pointers, any strides). The generic cases reach it by their
// widths or, at D = Dv = 128, by one misaligned pointer or stride each, and are held to the
// same comparison.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>
#include <utility>
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
  int64_t qk_head_padding = 0;   ///< qk head stride D + this
  int64_t factor_padding = 0;    ///< factor token stride W + this
  int64_t grad_padding = 0;      ///< grad_q/grad_k/grad_v heads and token rows padded by this
  int64_t v_padding = 0;         ///< grad_v's heads and token rows padded by this more
  // Device pointers: each device copy (and output) starts this many elements past the start of
  // its allocation, so 1 gives a bf16 pointer 2-byte aligned, off the 16-byte vectors.
  int64_t qk_offset = 0;
  int64_t factor_offset = 0;  ///< factor1 and factor2
  int64_t grad_offset = 0;    ///< grad_q and grad_k
  int64_t v_offset = 0;       ///< grad_v
  int64_t out_offset = 0;     ///< grad_row and grad_t (bytes: e4m3)

  std::string describe() const {
    std::ostringstream out;
    out << "T=" << tokens << " H=" << heads << " D=" << head_dim << " Dv=" << v_dim
        << (paired ? " paired" : "");
    if (key_offset) out << " key_offset rotary_dim=" << rotary_dim;
    out << " factors " << dtype_name(factor_dtype) << " grad_scale " << grad_scale << " (ndim "
        << scale_ndim << ") qk extra columns " << qk_extra_columns << " qk head padding "
        << qk_head_padding << " factor padding " << factor_padding << " grad padding "
        << grad_padding << " grad_v padding +" << v_padding << " offsets (elements) qk "
        << qk_offset << " factors " << factor_offset << " grad_q/k " << grad_offset
        << " grad_v " << v_offset << " outputs " << out_offset << " ("
        << (vector_friendly() ? "vector" : "generic") << " path)";
    return out.str();
  }
  int64_t factor_bytes() const { return int64_t(dtype_size(factor_dtype)); }
  int64_t qk_head_stride() const { return head_dim + qk_head_padding; }
  int64_t qk_token_stride() const { return 2 * heads * qk_head_stride() + qk_extra_columns; }
  int64_t factor_stride() const { return factor_width() + factor_padding; }
  /// Whether the arguments meet the 16-byte vector kernel's rule. The generic cases check that
  /// they do not, so that they do reach the element-pair kernel. Strides of size-1 dimensions do
  /// not count.
  bool vector_friendly() const {
    const auto aligned = [](int64_t bytes) { return bytes % 16 == 0; };
    const auto stride_ok = [&](int64_t size, int64_t stride, int64_t element) {
      return size <= 1 || aligned(stride * element);
    };
    // grad_q/grad_k [T', H', D] and grad_v [T, H, Dv] as Fp8Inputs::padded lays them out.
    const auto padded_ok = [&](int64_t size0, int64_t size1, int64_t width, int64_t padding) {
      const int64_t head_stride = width + padding;
      return stride_ok(size0, size1 * head_stride + padding, 2) && stride_ok(size1, head_stride, 2);
    };
    return head_dim % 8 == 0 && head_dim >= 32 && v_dim % 8 == 0 && v_dim <= 256 &&
           aligned(qk_offset * 2) && aligned(factor_offset * factor_bytes()) &&
           aligned(grad_offset * 2) && aligned(v_offset * 2) && aligned(out_offset) &&
           stride_ok(tokens, qk_token_stride(), 2) && stride_ok(2 * heads, qk_head_stride(), 2) &&
           stride_ok(tokens, factor_stride(), factor_bytes()) &&
           padded_ok(out_tokens(), out_heads(), head_dim, grad_padding) &&
           padded_ok(tokens, heads, v_dim, grad_padding + v_padding);
  }
  int64_t out_tokens() const { return paired ? 2 * tokens : tokens; }
  int64_t out_heads() const { return paired ? heads / 2 : heads; }
  int64_t factor_width() const { return paired ? 2 * head_dim : head_dim; }
  int64_t qkv_dim() const { return 2 * heads * head_dim + heads * v_dim; }
  RopeLayout layout(const TensorView& factor1, const TensorView& factor2) const {
    return tables_layout(heads, key_offset ? rotary_dim : head_dim, paired, key_offset, factor1,
                         factor2);
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
        grad_v(padded({c.tokens, c.heads, c.v_dim}, c.grad_padding + c.v_padding)),
        qk(DType::kBFloat16, {c.tokens, 2 * c.heads, c.head_dim},
           {c.qk_token_stride(), c.qk_head_stride(), 1}),
        factor1(c.factor_dtype, {c.tokens, c.factor_width()}, {c.factor_stride(), 1}),
        factor2(c.factor_dtype, {c.tokens, c.factor_width()}, {c.factor_stride(), 1}),
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

/// Bytes after each output, which no kernel may write.
constexpr size_t kGuardBytes = 64;

/// grad_row or grad_t: a poisoned allocation, the output `offset` bytes into it, guard after.
struct DeviceOutput {
  DeviceBuffer buffer;
  size_t offset = 0;
  size_t count = 0;

  DeviceOutput(size_t count_, int64_t offset_)
      : buffer(size_t(offset_) + count_ + kGuardBytes), offset(size_t(offset_)), count(count_) {
    buffer.fill_byte(kPoisonE4M3);
  }
  void* data() const { return static_cast<char*>(buffer.data()) + offset; }
  /// The output's codes; fails the test when a byte outside it was written.
  std::vector<uint8_t> read(const char* name) const {
    const std::vector<uint8_t> all = buffer.to_host<uint8_t>();
    int64_t outside = 0;
    for (size_t i = 0; i < all.size(); ++i) {
      if ((i < offset || i >= offset + count) && all[i] != kPoisonE4M3) ++outside;
    }
    EXPECT_EQ(outside, 0) << name << ": bytes outside the output were written";
    return std::vector<uint8_t>(all.begin() + long(offset), all.begin() + long(offset + count));
  }
};

/// The op's arguments on the device inputs, writing into `row` and `t`.
QkvBackwardFp8Params gpu_params(const Fp8Case& c, const DeviceInputs& in, const DeviceOutput& row,
                                const DeviceOutput& t, const Stream& stream) {
  QkvBackwardFp8Params params;
  params.grad_q = in.grad_q.view;
  params.grad_k = in.grad_k.view;
  params.grad_v = in.grad_v.view;
  params.qk = in.qk.view;
  params.grad_scale = in.scale.view;
  params.grad_row = make_view(row.data(), DType::kFloat8E4M3, kGPU, {c.tokens, c.qkv_dim()});
  params.grad_t = make_view(t.data(), DType::kFloat8E4M3, kGPU, {c.qkv_dim(), c.tokens});
  params.layout = c.layout(in.factor1.view, in.factor2.view);
  params.stream = stream.get();
  return params;
}

Fp8Result run_gpu(const Fp8Case& c, const DeviceInputs& in, const Stream& stream) {
  const DeviceOutput row(size_t(c.tokens * c.qkv_dim()), c.out_offset);
  const DeviceOutput t(size_t(c.tokens * c.qkv_dim()), c.out_offset);
  // The poison (and the inputs) were written by cudaMemcpy / cudaMemset on the legacy default
  // stream, which a cudaStreamNonBlocking stream does not wait for, and a pageable-memory
  // cudaMemcpy may return before its DMA lands: without this the kernel can race the poison
  // and outputs it wrote can be overwritten by NaN afterwards.
  synchronize();
  qkv_backward_fp8(gpu_params(c, in, row, t, stream));
  stream.sync();
  return {row.read("grad_row"), t.read("grad_t")};
}

TensorView scale_view(float* data, Device device, int ndim) {
  return ndim == 0 ? make_view(data, DType::kFloat32, device, {})
                   : make_view(data, DType::kFloat32, device, {1});
}

/// Device copies of the inputs, each at the case's element offset.
DeviceInputs device_inputs(const Fp8Case& c, Fp8Inputs& in, const TensorView& host_scale) {
  DeviceInputs dev{to_device(in.grad_q.view(), c.grad_offset),
                   to_device(in.grad_k.view(), c.grad_offset),
                   to_device(in.grad_v.view(), c.v_offset),
                   to_device(in.qk.view(), c.qk_offset),
                   to_device(in.factor1.view(), c.factor_offset),
                   to_device(in.factor2.view(), c.factor_offset),
                   to_device(host_scale)};
  dev.scale.view = scale_view(static_cast<float*>(dev.scale.buffer.data()), kGPU, c.scale_ndim);
  return dev;
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
  cpu.grad_scale = scale_view(in.scale.data(), kCPU, c.scale_ndim);
  cpu.grad_row = row.view();
  cpu.grad_t = t.view();
  cpu.layout = c.layout(in.factor1.view(), in.factor2.view());
  qkv_backward_fp8(cpu);

  const DeviceInputs dev = device_inputs(c, in, cpu.grad_scale);
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
  shifted.rotary_dim = head_dim / 4 * 2;  // D/2, rounded down to even for D = 2 mod 4
  cases.push_back(shifted);
  return cases;
}

/// mode_cases, plus key offset at the edges: rotary_dim 0 (every dim shifts) and D (none does).
std::vector<Fp8Case> all_mode_cases(int64_t tokens, int64_t heads, int64_t head_dim,
                                    int64_t v_dim) {
  std::vector<Fp8Case> cases = mode_cases(tokens, heads, head_dim, v_dim);
  for (int64_t rotary_dim : {int64_t(0), head_dim}) {
    Fp8Case shifted = cases.front();
    shifted.key_offset = true;
    shifted.rotary_dim = rotary_dim;
    cases.push_back(shifted);
  }
  return cases;
}

// ---- the generic path: widths and misalignments -------------------------------------------------

// Head widths the vector kernel does not take (not a multiple of 8, or below 32).
constexpr int64_t kGenericWidths[] = {2, 8, 34, 50, 100, 126, 254};
// V widths it does not take: odd, not a multiple of 8, past 256 (a multiple of 8 too), the most.
constexpr int64_t kGenericVWidths[] = {1, 7, 33, 130, 264, 300, 512};
// One token, either side of 32 and of 128 (the token tiles), and in between.
constexpr int64_t kGenericTokens[] = {1, 31, 33, 100, 129};

/// Odd paddings of every stride and every tensor one element off, on top of a case.
Fp8Case misaligned_everywhere(Fp8Case c) {
  c.qk_extra_columns = 3;
  c.qk_head_padding = 1;
  c.factor_padding = 1;
  c.grad_padding = 1;
  c.v_padding = 2;
  c.qk_offset = 1;
  c.factor_offset = 1;
  c.grad_offset = 1;
  c.v_offset = 3;
  c.out_offset = 1;
  return c;
}

/// One way to send a vector-friendly case (D = Dv = 128) to the generic path.
struct Misalignment {
  const char* what;
  void (*apply)(Fp8Case&);
};

/// Each misalignment alone (so that every tensor's pointer and strides are seen to matter),
/// pointers aligned to 4 and 8 bytes but not 16, and all of them at once. The cases they apply
/// to have H = 6 and T > 1, so no misaligned stride belongs to a size-1 dimension.
const std::vector<Misalignment>& misalignments() {
  static const std::vector<Misalignment> all = {
      // qk as the Q/K columns of the packed [T, qkv_dim] buffer, the slice one element off.
      {"qk one element off",
       [](Fp8Case& c) {
         c.qk_offset = 1;
         c.qk_extra_columns = 6 * 128;
       }},
      {"qk 4-byte aligned", [](Fp8Case& c) { c.qk_offset = 2; }},
      {"qk 8-byte aligned", [](Fp8Case& c) { c.qk_offset = 4; }},
      {"qk odd token stride", [](Fp8Case& c) { c.qk_extra_columns = 1; }},
      {"qk odd head stride", [](Fp8Case& c) { c.qk_head_padding = 1; }},
      {"factors odd row stride", [](Fp8Case& c) { c.factor_padding = 1; }},
      {"factors 8-byte row stride",
       [](Fp8Case& c) { c.factor_padding = c.factor_dtype == DType::kFloat32 ? 2 : 4; }},
      {"factors one element off", [](Fp8Case& c) { c.factor_offset = 1; }},
      {"grad_q/grad_k/grad_v odd strides", [](Fp8Case& c) { c.grad_padding = 1; }},
      {"grad_q/grad_k one element off", [](Fp8Case& c) { c.grad_offset = 1; }},
      {"grad_q/grad_k 8-byte aligned", [](Fp8Case& c) { c.grad_offset = 4; }},
      {"grad_v odd strides", [](Fp8Case& c) { c.v_padding = 1; }},
      {"grad_v one element off", [](Fp8Case& c) { c.v_offset = 1; }},
      {"grad_row/grad_t one byte off", [](Fp8Case& c) { c.out_offset = 1; }},
      {"grad_row/grad_t 8 bytes off", [](Fp8Case& c) { c.out_offset = 8; }},
      {"everything", [](Fp8Case& c) { c = misaligned_everywhere(c); }},
  };
  return all;
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
  // Masked geometries under key offset (72, 96: 16 x 1; 136, 184: 16 x 2): chunks partly past
  // rotary_dim and lanes past D.
  for (int64_t head_dim : {72, 96, 136, 184}) {
    Fp8Case c;
    c.tokens = 37;
    c.heads = 2;
    c.head_dim = head_dim;
    c.key_offset = true;
    c.rotary_dim = head_dim / 2;
    check_fp8(c);
  }
}

TEST(CudaQkvBackwardFp8, GenericWidthsAndModes) {
  QKVF_REQUIRE_GPU();
  // Generic head widths with a V width the vector kernel takes: the Q/K side of the generic
  // kernel.
  for (int64_t head_dim : kGenericWidths) {
    for (int64_t tokens : kGenericTokens) {
      for (int64_t heads : {1, 2, 3}) {
        for (const Fp8Case& c : all_mode_cases(tokens, heads, head_dim, 64)) {
          ASSERT_FALSE(c.vector_friendly()) << c.describe();
          check_fp8(c);
        }
      }
    }
  }
}

TEST(CudaQkvBackwardFp8, GenericVWidths) {
  QKVF_REQUIRE_GPU();
  // Generic V widths with a vector head width (128) and a generic one (34).
  for (int64_t v_dim : kGenericVWidths) {
    for (int64_t head_dim : {128, 34}) {
      for (int64_t tokens : {1, 33, 129}) {
        for (int64_t heads : {2, 3}) {
          for (const Fp8Case& c : mode_cases(tokens, heads, head_dim, v_dim)) {
            ASSERT_FALSE(c.vector_friendly()) << c.describe();
            check_fp8(c);
          }
        }
      }
    }
  }
}

TEST(CudaQkvBackwardFp8, GenericWidthsFloat32FactorsStridesAndScales) {
  QKVF_REQUIRE_GPU();
  for (int64_t head_dim : kGenericWidths) {
    for (int64_t v_dim : {int64_t(7), int64_t(128)}) {
      for (Fp8Case c : all_mode_cases(33, 2, head_dim, v_dim)) {
        c.factor_dtype = DType::kFloat32;
        c.scale_ndim = 1;
        check_fp8(c);
        c.grad_scale = 0.0371f;  // not a power of two: the division must be exact
        check_fp8(misaligned_everywhere(c));
        c.factor_dtype = DType::kBFloat16;
        c.grad_scale = 1e-4f;  // most values saturate at +-448
        check_fp8(misaligned_everywhere(c));
      }
    }
  }
}

TEST(CudaQkvBackwardFp8, GenericTokenCountsAroundTheTile) {
  QKVF_REQUIRE_GPU();
  // The generic kernel's token tiles (grad_t is written a tile of tokens at a time) at a generic
  // width, and at D = Dv = 128 with every pointer and stride misaligned.
  for (int64_t tokens : {2, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 257, 1000}) {
    for (const Fp8Case& c : mode_cases(tokens, 2, 100, 7)) check_fp8(c);
    for (const Fp8Case& c : mode_cases(tokens, 2, 128, 128)) check_fp8(misaligned_everywhere(c));
  }
}

TEST(CudaQkvBackwardFp8, MisalignedAtVectorWidths) {
  QKVF_REQUIRE_GPU();
  // D = Dv = 128, which the vector kernel takes, sent to the generic path by one misalignment
  // each.
  for (const Misalignment& m : misalignments()) {
    SCOPED_TRACE(m.what);
    for (DType factor_dtype : {DType::kBFloat16, DType::kFloat32}) {
      for (int64_t tokens : {33, 129}) {
        for (Fp8Case c : all_mode_cases(tokens, 6, 128, 128)) {
          c.factor_dtype = factor_dtype;
          m.apply(c);
          ASSERT_FALSE(c.vector_friendly()) << c.describe();
          check_fp8(c);
        }
      }
    }
  }
  // Every misalignment at once at the vector kernel's other geometries.
  for (int64_t head_dim : {32, 64, 72, 96, 256}) {
    for (int64_t v_dim : {8, 64, 256}) {
      for (const Fp8Case& c : all_mode_cases(17, 2, head_dim, v_dim)) {
        check_fp8(misaligned_everywhere(c));
      }
    }
  }
}

TEST(CudaQkvBackwardFp8, RefusesWhatIsStillOutsideTheDomain) {
  QKVF_REQUIRE_GPU();
  // Still refused on CUDA: Dv past 512 or 0; D odd, past 256 or 0; a pointer off its elements'
  // alignment. Each is a qkvfuse::Error naming the op and the argument, and nothing is written.
  for (int64_t v_dim : {513, 1024, 0}) {
    Fp8Case c;
    c.tokens = 4;
    c.heads = 2;
    c.head_dim = 64;
    c.v_dim = v_dim;
    SCOPED_TRACE(c.describe());
    auto rng = rng_for_test();
    Fp8Inputs in(c, rng);
    const DeviceInputs dev = device_inputs(c, in, scale_view(in.scale.data(), kCPU, 0));
    Stream stream;
    const DeviceOutput row(size_t(c.tokens * c.qkv_dim()), 0);
    const DeviceOutput t(size_t(c.tokens * c.qkv_dim()), 0);
    // The message names grad_v and shows its shape, Dv included.
    EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(gpu_params(c, dev, row, t, stream)); },
                             {"qkv_backward_fp8: grad_v: ", ", " + std::to_string(v_dim) + "]"}));
    synchronize();
    for (uint8_t code : row.read("grad_row")) ASSERT_EQ(code, kPoisonE4M3) << "grad_row written";
  }

  Fp8Case c;
  c.tokens = 4;
  c.heads = 2;
  c.head_dim = 32;
  c.v_dim = 16;
  auto rng = rng_for_test();
  Fp8Inputs in(c, rng);
  const DeviceInputs dev = device_inputs(c, in, scale_view(in.scale.data(), kCPU, 0));
  Stream stream;
  const DeviceOutput row(size_t(c.tokens * c.qkv_dim()), 0);
  const DeviceOutput t(size_t(c.tokens * c.qkv_dim()), 0);
  const QkvBackwardFp8Params valid = gpu_params(c, dev, row, t, stream);
  const auto shifted_bytes = [](TensorView view, int64_t bytes) {
    view.data = static_cast<char*>(view.data) + bytes;
    return view;
  };
  for (int64_t head_dim : {33, 258, 0}) {
    QkvBackwardFp8Params p = valid;
    p.qk.sizes[2] = head_dim;
    EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(p); },
                             {"qkv_backward_fp8: qk: head width D = " + std::to_string(head_dim)}));
  }
  QkvBackwardFp8Params p = valid;
  p.grad_v = shifted_bytes(p.grad_v, 1);
  EXPECT_TRUE(
      throws_error([&] { qkv_backward_fp8(p); }, {"qkv_backward_fp8: grad_v: ", "aligned"}));
  p = valid;
  p.grad_q = shifted_bytes(p.grad_q, 1);
  EXPECT_TRUE(
      throws_error([&] { qkv_backward_fp8(p); }, {"qkv_backward_fp8: grad_q: ", "aligned"}));
  p = valid;
  p.qk = shifted_bytes(p.qk, 1);
  EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(p); }, {"qkv_backward_fp8: qk: ", "aligned"}));
  p = valid;
  p.grad_scale = shifted_bytes(p.grad_scale, 2);
  EXPECT_TRUE(
      throws_error([&] { qkv_backward_fp8(p); }, {"qkv_backward_fp8: grad_scale: ", "aligned"}));
  p = valid;
  p.grad_t.strides[0] = c.tokens + 1;  // padded rows: the outputs must be contiguous
  EXPECT_TRUE(
      throws_error([&] { qkv_backward_fp8(p); }, {"qkv_backward_fp8: grad_t: ", "contiguous"}));
  synchronize();
  for (const auto& [out, name] : {std::pair<const DeviceOutput*, const char*>{&row, "grad_row"},
                                  std::pair<const DeviceOutput*, const char*>{&t, "grad_t"}}) {
    for (uint8_t code : out->read(name)) ASSERT_EQ(code, kPoisonE4M3) << name << " written";
  }
  EXPECT_NO_THROW(qkv_backward_fp8(valid));  // the one change each made is what was refused
  stream.sync();
}

}  // namespace
}  // namespace qkvfuse::test
