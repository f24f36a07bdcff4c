// test_cuda_qk_norm_rope.cpp: the CUDA QK-norm + rotary, forward and bf16 backward (SPEC.md
// sections 1 and 2), against the CPU backend through the public API.
//
// Each case runs the op twice on the same inputs: CPU views (the CPU backend) and CUDA views of
// byte-identical copies (the kernels), then compares the bf16 outputs bit by bit. Both compute
// in fp32 with the same explicitly rounded element-wise operations; only the order of the fp32
// row sums differs, so an element may land one bf16 ulp away (counted and printed). Further
// away is accepted only where the row's values cancel, within kSumOrderNoise of the row's
// largest value, raised in the backward to the size of the terms its values are differences of
// (ref::RopeGradients::term_scale): the error a different fp32 summation order can make there
// (counted and printed too); anything else fails. CUDA outputs are poisoned with a NaN pattern
// before every run, so an element the kernel never wrote shows as NaN (and the allocation around
// each output stays poisoned, so a write outside it shows too), and every case is run twice on
// the GPU to check bit-identical reruns.
//
// Two kernel families compute these ops: the 16-byte-vector kernels, for "vector friendly"
// arguments (D a multiple of 8 from 32, every pointer 16-byte aligned, every stride but the last
// a multiple of 16 bytes), and the element-pair kernels of the generic path for everything else
// the API takes (any even D in [2, 256], element-aligned pointers, any strides). The generic
// cases below reach the second family by their width (D in {2, 8, 34, ...}) or, at D = 128, by a
// single misaligned pointer or stride each (so a dispatcher that overlooks one tensor's
// alignment sends it to the vector kernels and fails here), and must agree with the CPU backend
// to the same tolerance.
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

/// Elements after each output, which no kernel may write.
constexpr int64_t kGuardElements = 16;

/// A contiguous bf16 device output `offset` elements past the start of its allocation (1: a
/// 2-byte aligned pointer), followed by kGuardElements. The whole allocation is poisoned with the
/// NaN pattern no computation produces.
DeviceView device_output(std::initializer_list<int64_t> sizes, int64_t offset = 0) {
  int64_t count = 1;
  for (int64_t s : sizes) count *= s;
  DeviceView out{DeviceBuffer(size_t(offset + count + kGuardElements) * 2), {}};
  out.view = make_view(static_cast<uint16_t*>(out.buffer.data()) + offset, DType::kBFloat16, kGPU,
                       sizes);
  fill_u16(out.buffer, kPoisonBF16);
  return out;
}

/// The elements of an output made by device_output, in order; fails the test when an element
/// of the allocation outside the view (before its offset, or in the guard after it) was written.
std::vector<uint16_t> read_output(const DeviceView& out, const char* name) {
  const std::vector<uint16_t> all = out.buffer.to_host<uint16_t>();
  const int64_t begin = static_cast<const uint16_t*>(out.view.data) -
                        static_cast<const uint16_t*>(out.buffer.data());
  const int64_t end = begin + out.view.numel();
  int64_t outside = 0;
  for (int64_t i = 0; i < int64_t(all.size()); ++i) {
    if ((i < begin || i >= end) && all[size_t(i)] != kPoisonBF16) ++outside;
  }
  EXPECT_EQ(outside, 0) << name << ": elements outside the output were written";
  return std::vector<uint16_t>(all.begin() + begin, all.begin() + end);
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

/// GPU against CPU, rows of `row_length` elements. `term_scale` (the backward's, one per row:
/// ref::RopeGradients::term_scale) raises a row's noise scale to the size of the terms its values
/// are differences of.
Diff compare_bf16(const std::string& what, const std::vector<uint16_t>& gpu,
                  const std::vector<uint16_t>& cpu, int64_t row_length,
                  const std::vector<double>& term_scale = {}) {
  Diff diff;
  diff.what = what;
  diff.count = int64_t(gpu.size());
  EXPECT_EQ(gpu.size(), cpu.size());
  for (size_t row = 0; row * row_length < gpu.size(); ++row) {
    double row_max = 0;
    for (int64_t i = 0; i < row_length; ++i) {
      row_max = std::fmax(row_max, std::fabs(bf16_to_float(cpu[row * row_length + i])));
    }
    if (!term_scale.empty() && std::isfinite(term_scale[row])) {
      row_max = std::fmax(row_max, term_scale[row]);
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
  int64_t rotary_dim = 0;        ///< with key offset (r = D otherwise: tables carry the rest)
  int64_t table_rotary = -1;     ///< rotating dims of the factor tables; -1: D (or rotary_dim)
  DType factor_dtype = DType::kBFloat16;
  int64_t qk_extra_columns = 0;  ///< qk is a column slice of a wider [T, 2HD + extra] buffer
  int64_t qk_head_padding = 0;   ///< qk head stride D + this
  int64_t factor_padding = 0;    ///< factor token stride W + this
  int64_t grad_padding = 0;      ///< backward: grad_q/grad_k heads and token rows padded by this
  // Device pointers: each device copy (and output) starts this many elements past the start of
  // its allocation, so 1 gives a bf16 pointer 2-byte aligned, off the 16-byte vectors.
  int64_t qk_offset = 0;
  int64_t factor_offset = 0;  ///< factor1 and factor2
  int64_t grad_offset = 0;    ///< grad_q and grad_k (backward)
  int64_t out_offset = 0;     ///< q and k (forward), grad_qk (backward)

  std::string describe() const {
    std::ostringstream out;
    out << "T=" << tokens << " H=" << heads << " D=" << head_dim << (paired ? " paired" : "");
    if (key_offset) out << " key_offset rotary_dim=" << rotary_dim;
    out << " tables rotate " << tables_rotary() << " factors " << dtype_name(factor_dtype)
        << " qk extra columns " << qk_extra_columns << " qk head padding " << qk_head_padding
        << " factor padding " << factor_padding << " grad padding " << grad_padding
        << " offsets (elements) qk " << qk_offset << " factors " << factor_offset << " grads "
        << grad_offset << " outputs " << out_offset << " (forward "
        << (vector_friendly(false) ? "vector" : "generic") << " path, backward "
        << (vector_friendly(true) ? "vector" : "generic") << " path)";
    return out.str();
  }
  int64_t factor_bytes() const { return int64_t(dtype_size(factor_dtype)); }
  /// The float64 model's description of the case (as the CPU tests' cases give it).
  ref::Rope rope() const {
    return {tokens, heads, head_dim, key_offset ? rotary_dim : -1, paired, key_offset};
  }
  int64_t qk_head_stride() const { return head_dim + qk_head_padding; }
  int64_t qk_token_stride() const { return 2 * heads * qk_head_stride() + qk_extra_columns; }
  int64_t factor_stride() const { return factor_width() + factor_padding; }
  int64_t grad_head_stride() const { return head_dim + grad_padding; }
  int64_t grad_token_stride() const { return out_heads() * grad_head_stride() + grad_padding; }
  /// Whether the forward's arguments (with `backward`, the backward's, which add grad_q and
  /// grad_k) meet the 16-byte vector kernels' rule. The generic cases check that they do not, so
  /// that they do reach the element-pair kernels. Strides of size-1 dimensions do not count.
  bool vector_friendly(bool backward) const {
    const auto aligned = [](int64_t bytes) { return bytes % 16 == 0; };
    const auto stride_ok = [&](int64_t size, int64_t stride, int64_t element) {
      return size <= 1 || aligned(stride * element);
    };
    bool ok = head_dim % 8 == 0 && head_dim >= 32 && aligned(qk_offset * 2) &&
              aligned(factor_offset * factor_bytes()) && aligned(out_offset * 2) &&
              stride_ok(tokens, qk_token_stride(), 2) &&
              stride_ok(2 * heads, qk_head_stride(), 2) &&
              stride_ok(tokens, factor_stride(), factor_bytes());
    if (backward) {
      ok = ok && aligned(grad_offset * 2) && stride_ok(out_tokens(), grad_token_stride(), 2) &&
           stride_ok(out_heads(), grad_head_stride(), 2);
    }
    return ok;
  }
  int64_t tables_rotary() const {
    return table_rotary >= 0 ? table_rotary : (key_offset ? rotary_dim : head_dim);
  }
  int64_t out_tokens() const { return paired ? 2 * tokens : tokens; }
  int64_t out_heads() const { return paired ? heads / 2 : heads; }
  int64_t factor_width() const { return paired ? 2 * head_dim : head_dim; }
  RopeLayout layout(const TensorView& factor1, const TensorView& factor2) const {
    return tables_layout(heads, key_offset ? rotary_dim : head_dim, paired, key_offset, factor1,
                         factor2);
  }
};

/// Host inputs of a case (CPU views), random and fresh per call.
struct RopeInputs {
  HostTensor qk;
  HostTensor factor1;
  HostTensor factor2;

  RopeInputs(const RopeCase& c, std::mt19937_64& rng)
      : qk(DType::kBFloat16, {c.tokens, 2 * c.heads, c.head_dim},
           {c.qk_token_stride(), c.qk_head_stride(), 1}),
        factor1(c.factor_dtype, {c.tokens, c.factor_width()}, {c.factor_stride(), 1}),
        factor2(c.factor_dtype, {c.tokens, c.factor_width()}, {c.factor_stride(), 1}) {
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
  DeviceView q = device_output({c.out_tokens(), c.out_heads(), c.head_dim}, c.out_offset);
  DeviceView k = device_output({c.out_tokens(), c.out_heads(), c.head_dim}, c.out_offset);
  // The poison (and the inputs) were written by cudaMemcpy / cudaMemset on the legacy default
  // stream, which a cudaStreamNonBlocking stream does not wait for, and a pageable-memory
  // cudaMemcpy may return before its DMA lands: without this the kernel can race the poison
  // and outputs it wrote can be overwritten by NaN afterwards.
  synchronize();
  QkNormRopeParams params{qk.view, q.view, k.view, c.layout(f1.view, f2.view), stream.get()};
  qk_norm_rope(params);
  stream.sync();
  return {read_output(q, "q"), read_output(k, "k")};
}

void check_forward(const RopeCase& c) {
  SCOPED_TRACE(c.describe());
  auto rng = rng_for_test();
  RopeInputs in(c, rng);

  HostTensor q(DType::kBFloat16, {c.out_tokens(), c.out_heads(), c.head_dim});
  HostTensor k(DType::kBFloat16, {c.out_tokens(), c.out_heads(), c.head_dim});
  qk_norm_rope({in.qk.view(), q.view(), k.view(), c.layout(in.factor1.view(), in.factor2.view())});

  const DeviceView qk = to_device(in.qk.view(), c.qk_offset);
  const DeviceView f1 = to_device(in.factor1.view(), c.factor_offset);
  const DeviceView f2 = to_device(in.factor2.view(), c.factor_offset);
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
  shifted.rotary_dim = head_dim / 4 * 2;  // D/2, rounded down to even for D = 2 mod 4
  cases.push_back(shifted);
  return cases;
}

/// mode_cases, plus key offset at the edges: rotary_dim 0 (every dim shifts) and D (none does).
std::vector<RopeCase> all_mode_cases(int64_t tokens, int64_t heads, int64_t head_dim) {
  std::vector<RopeCase> cases = mode_cases(tokens, heads, head_dim);
  for (int64_t rotary_dim : {int64_t(0), head_dim}) {
    RopeCase shifted = cases.front();
    shifted.key_offset = true;
    shifted.rotary_dim = rotary_dim;
    cases.push_back(shifted);
  }
  return cases;
}

// ---- the generic path: widths and misalignments -------------------------------------------------

// Head widths the vector kernels do not take (not a multiple of 8, or below 32), from the
// narrowest to the widest: the element-pair kernels at every width class.
constexpr int64_t kGenericWidths[] = {2, 8, 34, 50, 100, 126, 254};
// One token, either side of 32 and of 128 (the token tiles), and in between.
constexpr int64_t kGenericTokens[] = {1, 31, 33, 100, 129};

/// One way to send a vector-friendly case (D = 128) to the generic path.
struct Misalignment {
  const char* what;
  bool backward_only;  ///< misaligns grad_q / grad_k, which only the backward reads
  void (*apply)(RopeCase&);
};

/// Each misalignment alone (so that every tensor's pointer and strides are seen to matter),
/// pointers aligned to 4 and 8 bytes but not 16, and all of them at once. The cases they apply
/// to have H = 6 and T > 1, so no misaligned stride belongs to a size-1 dimension.
const std::vector<Misalignment>& misalignments() {
  static const std::vector<Misalignment> all = {
      // qk as the Q/K columns of a packed [T, 2HD + H*128] buffer, the slice one element off.
      {"qk one element off", false,
       [](RopeCase& c) {
         c.qk_offset = 1;
         c.qk_extra_columns = 6 * 128;
       }},
      {"qk 4-byte aligned", false, [](RopeCase& c) { c.qk_offset = 2; }},
      {"qk 8-byte aligned", false, [](RopeCase& c) { c.qk_offset = 4; }},
      {"qk odd token stride", false, [](RopeCase& c) { c.qk_extra_columns = 1; }},
      {"qk odd head stride", false, [](RopeCase& c) { c.qk_head_padding = 1; }},
      {"factors odd row stride", false, [](RopeCase& c) { c.factor_padding = 1; }},
      {"factors 8-byte row stride", false,
       [](RopeCase& c) { c.factor_padding = c.factor_dtype == DType::kFloat32 ? 2 : 4; }},
      {"factors one element off", false, [](RopeCase& c) { c.factor_offset = 1; }},
      {"outputs one element off", false, [](RopeCase& c) { c.out_offset = 1; }},
      {"grads odd strides", true, [](RopeCase& c) { c.grad_padding = 1; }},
      {"grads one element off", true, [](RopeCase& c) { c.grad_offset = 1; }},
      {"everything", false, [](RopeCase& c) {
         c.qk_offset = 3;
         c.qk_extra_columns = 5;
         c.qk_head_padding = 1;
         c.factor_padding = 3;
         c.factor_offset = 1;
         c.grad_padding = 3;
         c.grad_offset = 1;
         c.out_offset = 1;
       }},
  };
  return all;
}

TEST(CudaQkNormRope, ForwardAllWidthsAndModes) {
  QKVF_REQUIRE_GPU();
  // Vector kernels: 32/64/96/128/256 exact lane geometries (96: 4 lanes x 3 chunks); 40, 72, 136,
  // 200, 248 masked ones.
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

TEST(CudaQkNormRope, ForwardGenericWidthsAndModes) {
  QKVF_REQUIRE_GPU();
  for (int64_t head_dim : kGenericWidths) {
    for (int64_t tokens : kGenericTokens) {
      for (int64_t heads : {1, 2, 3}) {
        for (const RopeCase& c : all_mode_cases(tokens, heads, head_dim)) {
          ASSERT_FALSE(c.vector_friendly(false)) << c.describe();
          check_forward(c);
        }
      }
    }
  }
}

/// Odd paddings of every stride and every tensor one element off, on top of a case.
RopeCase misaligned_everywhere(RopeCase c) {
  c.qk_extra_columns = 3;
  c.qk_head_padding = 1;
  c.factor_padding = 1;
  c.grad_padding = 1;
  c.qk_offset = 1;
  c.factor_offset = 1;
  c.grad_offset = 1;
  c.out_offset = 1;
  return c;
}

TEST(CudaQkNormRope, ForwardGenericWidthsFloat32FactorsAndStrides) {
  QKVF_REQUIRE_GPU();
  for (int64_t head_dim : kGenericWidths) {
    for (int64_t tokens : {2, 33, 129}) {
      for (RopeCase c : all_mode_cases(tokens, 2, head_dim)) {
        c.factor_dtype = DType::kFloat32;
        check_forward(c);
        check_forward(misaligned_everywhere(c));
        c.factor_dtype = DType::kBFloat16;
        check_forward(misaligned_everywhere(c));
      }
    }
  }
}

TEST(CudaQkNormRope, ForwardMisalignedAtVectorWidths) {
  QKVF_REQUIRE_GPU();
  // D = 128, which the vector kernels take, sent to the generic path by one misalignment each.
  for (const Misalignment& m : misalignments()) {
    if (m.backward_only) continue;
    SCOPED_TRACE(m.what);
    for (DType factor_dtype : {DType::kBFloat16, DType::kFloat32}) {
      for (int64_t tokens : {33, 129}) {
        for (RopeCase c : all_mode_cases(tokens, 6, 128)) {
          c.factor_dtype = factor_dtype;
          m.apply(c);
          ASSERT_FALSE(c.vector_friendly(false)) << c.describe();
          check_forward(c);
        }
      }
    }
  }
  // Every misalignment at once at the other lane geometries of the vector kernels.
  for (int64_t head_dim : {32, 40, 64, 96, 256}) {
    for (const RopeCase& c : all_mode_cases(17, 2, head_dim)) {
      check_forward(misaligned_everywhere(c));
    }
  }
}

// ---- backward ------------------------------------------------------------------------------------

/// grad_q / grad_k host tensors in the forward's output layout, padded per head and token row.
HostTensor grad_tensor(const RopeCase& c, std::mt19937_64& rng) {
  HostTensor grad(DType::kBFloat16, {c.out_tokens(), c.out_heads(), c.head_dim},
                  {c.grad_token_stride(), c.grad_head_stride(), 1});
  grad.set(random_values(rng, size_t(c.out_tokens() * c.out_heads() * c.head_dim),
                         DType::kBFloat16));
  return grad;
}

std::vector<uint16_t> run_backward_gpu(const RopeCase& c, const DeviceView& grad_q,
                                       const DeviceView& grad_k, const DeviceView& qk,
                                       const DeviceView& f1, const DeviceView& f2,
                                       const Stream& stream) {
  DeviceView grad_qk = device_output({c.tokens, 2 * c.heads, c.head_dim}, c.out_offset);
  // The poison (and the inputs) were written by cudaMemcpy / cudaMemset on the legacy default
  // stream, which a cudaStreamNonBlocking stream does not wait for, and a pageable-memory
  // cudaMemcpy may return before its DMA lands: without this the kernel can race the poison
  // and outputs it wrote can be overwritten by NaN afterwards.
  synchronize();
  QkNormRopeBackwardParams params{.grad_q = grad_q.view,
                                  .grad_k = grad_k.view,
                                  .qk = qk.view,
                                  .grad_qk = grad_qk.view,
                                  .layout = c.layout(f1.view, f2.view),
                                  .stream = stream.get()};
  qk_norm_rope_backward(params);
  stream.sync();
  return read_output(grad_qk, "grad_qk");
}

void check_backward(const RopeCase& c) {
  SCOPED_TRACE(c.describe());
  auto rng = rng_for_test();
  RopeInputs in(c, rng);
  HostTensor grad_q = grad_tensor(c, rng);
  HostTensor grad_k = grad_tensor(c, rng);

  HostTensor grad_qk(DType::kBFloat16, {c.tokens, 2 * c.heads, c.head_dim});
  qk_norm_rope_backward({.grad_q = grad_q.view(),
                         .grad_k = grad_k.view(),
                         .qk = in.qk.view(),
                         .grad_qk = grad_qk.view(),
                         .layout = c.layout(in.factor1.view(), in.factor2.view())});

  // dx = rstd * (dn - n * sum(dn * n) / D) can cancel far below its terms (at D = 2, whenever dn
  // is nearly parallel to n); the fp32 sums of the two backends, which differ in order and in
  // fusing, then differ by a rounding of the terms: the float64 model's term scale per row.
  ref::RopeTensors tensors;
  tensors.factor1 = in.factor1.get();
  tensors.factor2 = in.factor2.get();
  const std::vector<double> term_scale =
      ref::rope_gradients(c.rope(), grad_q.get(), grad_k.get(), in.qk.get(), tensors).term_scale;

  const DeviceView dq = to_device(grad_q.view(), c.grad_offset);
  const DeviceView dk = to_device(grad_k.view(), c.grad_offset);
  const DeviceView qk = to_device(in.qk.view(), c.qk_offset);
  const DeviceView f1 = to_device(in.factor1.view(), c.factor_offset);
  const DeviceView f2 = to_device(in.factor2.view(), c.factor_offset);
  Stream stream;
  const std::vector<uint16_t> first = run_backward_gpu(c, dq, dk, qk, f1, f2, stream);
  EXPECT_TRUE(clean(
      compare_bf16("grad_qk", first, grad_qk.get_bf16_bits(), c.head_dim, term_scale)));
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

TEST(CudaQkNormRope, BackwardGenericWidthsAndModes) {
  QKVF_REQUIRE_GPU();
  for (int64_t head_dim : kGenericWidths) {
    for (int64_t tokens : kGenericTokens) {
      for (int64_t heads : {1, 2, 3}) {
        for (const RopeCase& c : all_mode_cases(tokens, heads, head_dim)) {
          ASSERT_FALSE(c.vector_friendly(true)) << c.describe();
          check_backward(c);
        }
      }
    }
  }
}

TEST(CudaQkNormRope, BackwardGenericWidthsFloat32FactorsAndStrides) {
  QKVF_REQUIRE_GPU();
  for (int64_t head_dim : kGenericWidths) {
    for (int64_t tokens : {2, 33, 129}) {
      for (RopeCase c : all_mode_cases(tokens, 2, head_dim)) {
        c.factor_dtype = DType::kFloat32;
        check_backward(c);
        check_backward(misaligned_everywhere(c));
        c.factor_dtype = DType::kBFloat16;
        check_backward(misaligned_everywhere(c));
      }
    }
  }
}

TEST(CudaQkNormRope, BackwardMisalignedAtVectorWidths) {
  QKVF_REQUIRE_GPU();
  for (const Misalignment& m : misalignments()) {
    SCOPED_TRACE(m.what);
    for (DType factor_dtype : {DType::kBFloat16, DType::kFloat32}) {
      for (int64_t tokens : {33, 129}) {
        for (RopeCase c : all_mode_cases(tokens, 6, 128)) {
          c.factor_dtype = factor_dtype;
          m.apply(c);
          ASSERT_FALSE(c.vector_friendly(true)) << c.describe();
          check_backward(c);
        }
      }
    }
  }
  for (int64_t head_dim : {32, 40, 64, 96, 256}) {
    for (const RopeCase& c : all_mode_cases(17, 2, head_dim)) {
      check_backward(misaligned_everywhere(c));
    }
  }
}

// ---- errors and edges ----------------------------------------------------------------------------

/// `view` with its data pointer moved by `bytes` (off its elements' alignment when odd).
TensorView shifted_bytes(TensorView view, int64_t bytes) {
  view.data = static_cast<char*>(view.data) + bytes;
  return view;
}

bool all_poison(const std::vector<uint16_t>& values) {
  for (uint16_t v : values) {
    if (v != kPoisonBF16) return false;
  }
  return true;
}

TEST(CudaQkNormRope, RefusesWhatIsStillOutsideTheDomain) {
  QKVF_REQUIRE_GPU();
  // What the CUDA backend still refuses, as the CPU does: D odd, past 256 or 0; a pointer off
  // its elements' alignment; outputs that are not row-major contiguous. Each is a qkvfuse::Error
  // naming the op and the argument, and nothing is written.
  RopeCase c;
  c.tokens = 4;
  c.heads = 2;
  c.head_dim = 32;
  auto rng = rng_for_test();
  RopeInputs in(c, rng);
  HostTensor grad_q = grad_tensor(c, rng);
  HostTensor grad_k = grad_tensor(c, rng);
  const DeviceView qk = to_device(in.qk.view());
  const DeviceView f1 = to_device(in.factor1.view());
  const DeviceView f2 = to_device(in.factor2.view());
  const DeviceView dq = to_device(grad_q.view());
  const DeviceView dk = to_device(grad_k.view());
  DeviceView q = device_output({c.tokens, c.heads, c.head_dim});
  DeviceView k = device_output({c.tokens, c.heads, c.head_dim});
  DeviceView grad_qk = device_output({c.tokens, 2 * c.heads, c.head_dim});
  // float32 factors one 2-byte step off their 4-byte alignment.
  DeviceBuffer f32(size_t(c.tokens * c.head_dim + 1) * 4);
  const QkNormRopeParams forward{qk.view, q.view, k.view, c.layout(f1.view, f2.view)};
  const QkNormRopeBackwardParams backward{.grad_q = dq.view,
                                          .grad_k = dk.view,
                                          .qk = qk.view,
                                          .grad_qk = grad_qk.view,
                                          .layout = c.layout(f1.view, f2.view)};

  for (int64_t bad : {33, 258, 0}) {
    const std::string what = "qk: head width D = " + std::to_string(bad);
    QkNormRopeParams p = forward;
    p.qk.sizes[2] = bad;
    EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); }, {"qk_norm_rope: " + what}));
    QkNormRopeBackwardParams b = backward;
    b.qk.sizes[2] = bad;
    EXPECT_TRUE(
        throws_error([&] { qk_norm_rope_backward(b); }, {"qk_norm_rope_backward: " + what}));
  }
  {
    QkNormRopeParams p = forward;
    p.qk = shifted_bytes(p.qk, 1);
    EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); }, {"qk_norm_rope: qk: ", "aligned"}));
    p = forward;
    p.layout.factor1 = p.layout.factor2 = make_view(static_cast<char*>(f32.data()) + 2,
                                                    DType::kFloat32, kGPU, {c.tokens, c.head_dim});
    EXPECT_TRUE(
        throws_error([&] { qk_norm_rope(p); }, {"qk_norm_rope: layout.factor1: ", "aligned"}));
    p = forward;
    p.k = shifted_bytes(p.k, 1);
    EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); }, {"qk_norm_rope: k: ", "aligned"}));
    p = forward;
    p.q.sizes[0] = c.tokens / 2;  // every other token row of a [T, H, D] buffer: padded rows
    p.q.strides[0] *= 2;
    p.qk.sizes[0] = p.layout.factor1.sizes[0] = p.layout.factor2.sizes[0] = p.k.sizes[0] =
        c.tokens / 2;
    EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); }, {"qk_norm_rope: q: ", "contiguous"}));
  }
  {
    QkNormRopeBackwardParams b = backward;
    b.grad_k = shifted_bytes(b.grad_k, 1);
    EXPECT_TRUE(throws_error([&] { qk_norm_rope_backward(b); },
                             {"qk_norm_rope_backward: grad_k: ", "aligned"}));
    b = backward;
    b.grad_qk = shifted_bytes(b.grad_qk, 1);
    EXPECT_TRUE(throws_error([&] { qk_norm_rope_backward(b); },
                             {"qk_norm_rope_backward: grad_qk: ", "aligned"}));
  }
  synchronize();
  EXPECT_TRUE(all_poison(read_output(q, "q")) && all_poison(read_output(k, "k")) &&
              all_poison(read_output(grad_qk, "grad_qk")))
      << "a refused call wrote an output";

  // The unmodified calls are valid: the refusals above are for the one thing each changed.
  EXPECT_NO_THROW(qk_norm_rope(forward));
  EXPECT_NO_THROW(qk_norm_rope_backward(backward));
  synchronize();
}

TEST(CudaQkNormRope, ZeroTokensIsANoOp) {
  QKVF_REQUIRE_GPU();
  DeviceBuffer a(256), b(256), c(256), d(256);
  for (int64_t D : {64, 34}) {  // the vector path's width and a generic one
    const TensorView qk = make_view(a.data(), DType::kBFloat16, kGPU, {0, 4, D});
    const TensorView f = make_view(b.data(), DType::kBFloat16, kGPU, {0, D});
    const TensorView q = make_view(c.data(), DType::kBFloat16, kGPU, {0, 2, D});
    const TensorView k = make_view(d.data(), DType::kBFloat16, kGPU, {0, 2, D});
    EXPECT_NO_THROW(qk_norm_rope({qk, q, k, tables_layout(2, D, false, false, f, f)}));
  }
  synchronize();
}

}  // namespace
}  // namespace qkvfuse::test
