// test_cuda_fp8_gemm.cpp: the cuBLASLt FP8 GEMM against the CPU backend and a float64 loop.
//
// What is checked, and why these bounds:
//   - Integer-valued operands with power-of-two scales: every partial sum is a small integer, so
//     any accumulation order, in any precision the tensor cores use, gives the exact sum, and the
//     scale products are exact. The GPU result must then equal bf16(exact) and the CPU backend bit
//     for bit, with and without fast accumulation and alpha. This pins the row/column-major
//     mapping, the operand order, every scale pointer and the strides exactly.
//   - Random operands: the float64 loop is exact (e4m3 products have 8 significant bits and these
//     sums span under 53 bits). Against it the GPU may differ by its bf16 rounding (half an ulp)
//     plus its accumulation error. Hopper's FP8 tensor cores do not accumulate in full fp32: the
//     QGMMA accumulator keeps about 13 mantissa bits (truncated) between promotions to fp32
//     (cuBLASLt promotes every few k-blocks when FAST_ACCUM is off, rarely when it is on). That
//     error scales with the partial sums, S = sum_k |a_ik b_jk| * |scales|, not with |d_ij|:
//         |gpu - ref| <= 1 ulp_bf16(ref) + eps * S,   eps = 2^-12 (fast_accum off), 2^-8 (on),
//     and the relative Frobenius error stays at bf16 level, <= 2^-8 (off) / 2^-7 (on).
//     A layout or scale bug is off by O(|d|), hundreds of times these bounds at K >= 256.
//     The share of elements within 1 / 2 bf16 ulps of bf16(ref) is printed for every case but
//     not asserted: elements that cancel to near zero have ulps far below the accumulator's
//     resolution at the partial sums, so "99.9% within 1 ulp" is a property of the hardware
//     accumulator (to be read off the printout on the H200), not of this code. The CPU backend
//     accumulates in double: it is held to the same bound.
//   - Shapes refused before the call (M = 17, misaligned operands) throw qkvfuse::Error.
//   - Reruns are bitwise identical, and the first call of a shape (which tunes the algorithm) is
//     correct eagerly and under CUDA-graph capture.
//   - At the model's shapes a captured call holds no memset node (the workspace-free algorithms
//     come first; see ModelShapesLaunchWithoutWorkspaceMemset).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "gpu_util.hpp"
#include "qkvfuse/qkvfuse.hpp"
#include "test_util.hpp"

namespace qkvfuse::test {
namespace {

constexpr double kEpsAccumExact = 1.0 / 4096.0;  // 2^-12: FAST_ACCUM off
constexpr double kEpsAccumFast = 1.0 / 256.0;    // 2^-8: FAST_ACCUM on
constexpr double kFrobeniusExact = 1.0 / 256.0;  // relative Frobenius error, FAST_ACCUM off
constexpr double kFrobeniusFast = 1.0 / 128.0;   // FAST_ACCUM on

/// One GEMM problem with host operands in their (possibly padded) row-major layouts.
struct Problem {
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldd = 0;
  bool fast_accum = false;
  bool with_alpha = false;
  float scale_a = 1.0f, scale_b = 1.0f, alpha = 1.0f;
  std::vector<uint8_t> a;  // [m, lda]
  std::vector<uint8_t> b;  // [n, ldb]
};

enum class Values { kRandom, kSmallIntegers };

Problem make_problem(std::mt19937_64& rng, int64_t m, int64_t n, int64_t k, Values values,
                     bool fast_accum, bool with_alpha, int64_t pad_a = 0, int64_t pad_b = 0,
                     int64_t pad_d = 0) {
  Problem p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.lda = k + pad_a;
  p.ldb = k + pad_b;
  p.ldd = n + pad_d;
  p.fast_accum = fast_accum;
  p.with_alpha = with_alpha;
  const auto fill = [&](std::vector<uint8_t>& out, int64_t rows, int64_t ld) {
    out.assign(size_t(rows * ld), E4M3::kNaN);  // padding is NaN: reading it would show
    std::uniform_int_distribution<int> small(-4, 4);
    std::normal_distribution<float> normal(0.0f, 8.0f);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < k; ++c) {
        const float v = values == Values::kSmallIntegers ? float(small(rng)) : normal(rng);
        out[size_t(r * ld + c)] = float_to_e4m3(v);
      }
    }
  };
  fill(p.a, m, p.lda);
  fill(p.b, n, p.ldb);
  if (values == Values::kSmallIntegers) {
    // Powers of two: every scale product is exact in fp32, in any order.
    p.scale_a = 0.125f;
    p.scale_b = 0.25f;
    p.alpha = with_alpha ? 2.0f : 1.0f;
  } else {
    p.scale_a = 8.0f / 448.0f;  // the workload's x_scale
    p.scale_b = 0.37f / 448.0f;
    p.alpha = with_alpha ? 1.7f : 1.0f;
  }
  return p;
}

Fp8GemmParams make_params(const Problem& p, Device device, void* a, void* b, void* scales,
                          void* d) {
  Fp8GemmParams params;
  params.a = make_view(a, DType::kFloat8E4M3, device, {p.m, p.k}, {p.lda, 1});
  params.b = make_view(b, DType::kFloat8E4M3, device, {p.n, p.k}, {p.ldb, 1});
  float* s = static_cast<float*>(scales);
  params.scale_a = make_view(s + 0, DType::kFloat32, device, {});
  params.scale_b = make_view(s + 1, DType::kFloat32, device, {1});
  if (p.with_alpha) params.alpha = make_view(s + 2, DType::kFloat32, device, {});
  params.d = make_view(d, DType::kBFloat16, device, {p.m, p.n}, {p.ldd, 1});
  params.fast_accum = p.fast_accum;
  return params;
}

/// d on the GPU ([m, ldd] host copy; padding keeps its poison). `stream` may be null.
std::vector<uint16_t> run_gpu(const Problem& p, cudaStream_t stream = nullptr) {
  DeviceBuffer a = DeviceBuffer::from(p.a);
  DeviceBuffer b = DeviceBuffer::from(p.b);
  DeviceBuffer scales = DeviceBuffer::from(std::vector<float>{p.scale_a, p.scale_b, p.alpha});
  DeviceBuffer d(size_t(p.m * p.ldd) * 2);
  fill_u16(d, kPoisonBF16);
  Fp8GemmParams params = make_params(p, kGPU, a.data(), b.data(), scales.data(), d.data());
  params.stream = stream;
  fp8_gemm(params);
  synchronize();
  return d.to_host<uint16_t>();
}

std::vector<uint16_t> run_cpu(const Problem& p) {
  std::vector<uint8_t> a = p.a, b = p.b;
  std::vector<float> scales{p.scale_a, p.scale_b, p.alpha};
  std::vector<uint16_t> d(size_t(p.m * p.ldd), kPoisonBF16);
  fp8_gemm(make_params(p, kCPU, a.data(), b.data(), scales.data(), d.data()));
  return d;
}

/// Exact products summed in float64 (exact here), times the scales; abs_sum gets S.
void reference(const Problem& p, std::vector<double>& value, std::vector<double>& abs_sum) {
  std::vector<double> a(size_t(p.m * p.k)), b(size_t(p.n * p.k));
  for (int64_t i = 0; i < p.m; ++i)
    for (int64_t c = 0; c < p.k; ++c) a[size_t(i * p.k + c)] = e4m3_to_float(p.a[size_t(i * p.lda + c)]);
  for (int64_t j = 0; j < p.n; ++j)
    for (int64_t c = 0; c < p.k; ++c) b[size_t(j * p.k + c)] = e4m3_to_float(p.b[size_t(j * p.ldb + c)]);
  const double scale = double(p.scale_a) * double(p.scale_b) * double(p.alpha);
  value.assign(size_t(p.m * p.n), 0.0);
  abs_sum.assign(size_t(p.m * p.n), 0.0);
  for (int64_t i = 0; i < p.m; ++i) {
    const double* ai = &a[size_t(i * p.k)];
    for (int64_t j = 0; j < p.n; ++j) {
      const double* bj = &b[size_t(j * p.k)];
      double sum = 0.0, abs = 0.0;
      for (int64_t c = 0; c < p.k; ++c) {
        const double prod = ai[c] * bj[c];
        sum += prod;
        abs += std::fabs(prod);
      }
      value[size_t(i * p.n + j)] = sum * scale;
      abs_sum[size_t(i * p.n + j)] = abs * std::fabs(scale);
    }
  }
}

/// Round-to-nearest-even double -> bf16 in one step (no intermediate fp32 rounding).
uint16_t double_to_bf16(double value) {
  const float f = float(value);  // exact enough: rounding to 24 bits first can only matter for
                                 // doubles within 2^-24 relative of a bf16 tie
  return float_to_bf16(f);
}

/// Distance in bf16 steps between two finite bf16 values (monotone ordering of sign/magnitude).
int64_t bf16_ulp_distance(uint16_t x, uint16_t y) {
  const auto ordered = [](uint16_t v) {
    return (v & 0x8000u) ? -int64_t(v & 0x7fffu) : int64_t(v & 0x7fffu);
  };
  return std::llabs(ordered(x) - ordered(y));
}

/// One bf16 ulp at |value| (the spacing of bf16 numbers there), subnormals included.
double bf16_ulp(double value) {
  const double magnitude = std::fabs(value);
  if (magnitude < std::ldexp(1.0, -126)) return std::ldexp(1.0, -133);
  return std::ldexp(1.0, std::ilogb(magnitude) - 7);
}

struct Stats {
  int64_t count = 0;
  int64_t within_1ulp = 0;
  int64_t within_2ulp = 0;
  int64_t max_ulp = 0;
  int64_t over_bound = 0;
  double worst_ratio = 0.0;  // max |err| / bound
  int64_t first_bad = -1;
  double err2 = 0.0, ref2 = 0.0;  // for the relative Frobenius error
  double frobenius() const { return std::sqrt(err2) / std::max(std::sqrt(ref2), 1e-300); }
};

/// Compares d ([m, ldd] with padding) with the reference under the bound of the file header.
Stats compare(const Problem& p, const std::vector<uint16_t>& d, const std::vector<double>& ref,
              const std::vector<double>& abs_sum, double eps) {
  Stats s;
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = 0; j < p.n; ++j) {
      const uint16_t got = d[size_t(i * p.ldd + j)];
      const double r = ref[size_t(i * p.n + j)];
      const double got_value = bf16_to_float(got);
      const int64_t ulps = std::isfinite(got_value) ? bf16_ulp_distance(got, double_to_bf16(r))
                                                    : int64_t(1) << 20;
      const double bound = bf16_ulp(r) + eps * abs_sum[size_t(i * p.n + j)];
      const double err = std::isfinite(got_value) ? std::fabs(got_value - r) : INFINITY;
      ++s.count;
      s.err2 += err * err;
      s.ref2 += r * r;
      s.within_1ulp += ulps <= 1;
      s.within_2ulp += ulps <= 2;
      s.max_ulp = std::max(s.max_ulp, ulps);
      s.worst_ratio = std::max(s.worst_ratio, err / bound);
      if (!(err <= bound)) {
        ++s.over_bound;
        if (s.first_bad < 0) s.first_bad = i * p.n + j;
      }
    }
  }
  return s;
}

void expect_padding_untouched(const Problem& p, const std::vector<uint16_t>& d) {
  for (int64_t i = 0; i < p.m; ++i)
    for (int64_t j = p.n; j < p.ldd; ++j)
      ASSERT_EQ(d[size_t(i * p.ldd + j)], kPoisonBF16) << "write beyond N at (" << i << ", " << j << ")";
}

/// Runs p on the GPU and the CPU and checks both against the float64 reference.
void check_random_problem(const Problem& p, const char* label) {
  SCOPED_TRACE(::testing::Message() << label << ": M=" << p.m << " N=" << p.n << " K=" << p.k
                                    << " lda=" << p.lda << " ldb=" << p.ldb << " ldd=" << p.ldd
                                    << " fast_accum=" << p.fast_accum << " alpha=" << p.with_alpha);
  std::vector<double> ref, abs_sum;
  reference(p, ref, abs_sum);
  const double eps = p.fast_accum ? kEpsAccumFast : kEpsAccumExact;
  const std::vector<uint16_t> gpu = run_gpu(p);
  expect_padding_untouched(p, gpu);
  const Stats g = compare(p, gpu, ref, abs_sum, eps);
  std::printf("[fp8_gemm] %-6s M=%-5lld N=%-5lld K=%-5lld fast=%d alpha=%d: within 1 ulp %.5f%%, "
              "within 2 ulp %.5f%%, max %lld ulp, worst err/bound %.3f, rel. Frobenius %.2e\n",
              label, (long long)p.m, (long long)p.n, (long long)p.k, int(p.fast_accum),
              int(p.with_alpha), 100.0 * double(g.within_1ulp) / double(g.count),
              100.0 * double(g.within_2ulp) / double(g.count), (long long)g.max_ulp, g.worst_ratio,
              g.frobenius());
  EXPECT_EQ(g.over_bound, 0) << g.over_bound << " GPU elements beyond 1 ulp + eps*S (eps = " << eps
                             << "); first at flat index " << g.first_bad << " ("
                             << (g.first_bad >= 0 ? bf16_to_float(gpu[size_t((g.first_bad / p.n) * p.ldd + g.first_bad % p.n)]) : 0.0f)
                             << " vs " << (g.first_bad >= 0 ? ref[size_t(g.first_bad)] : 0.0) << ")";
  EXPECT_LE(g.frobenius(), p.fast_accum ? kFrobeniusFast : kFrobeniusExact);

  const std::vector<uint16_t> cpu = run_cpu(p);
  const Stats c = compare(p, cpu, ref, abs_sum, kEpsAccumExact);
  EXPECT_EQ(c.over_bound, 0) << "the CPU backend is off the float64 reference";
  EXPECT_LE(c.frobenius(), kFrobeniusExact) << "the CPU backend";
  // GPU vs CPU: both are near the reference; their difference obeys the sum of the two bounds.
  int64_t gpu_cpu_far = 0;
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = 0; j < p.n; ++j) {
      const double x = bf16_to_float(gpu[size_t(i * p.ldd + j)]);
      const double y = bf16_to_float(cpu[size_t(i * p.ldd + j)]);
      const double r = ref[size_t(i * p.n + j)];
      const double bound = 2.0 * bf16_ulp(r) + (eps + kEpsAccumExact) * abs_sum[size_t(i * p.n + j)];
      gpu_cpu_far += !(std::fabs(x - y) <= bound);
    }
  }
  EXPECT_EQ(gpu_cpu_far, 0) << "GPU and CPU backends disagree beyond their combined bounds";
}

/// Exact case: the GPU must reproduce bf16(exact) and the CPU backend bit for bit.
void check_exact_problem(const Problem& p, const char* label) {
  SCOPED_TRACE(::testing::Message() << label << ": M=" << p.m << " N=" << p.n << " K=" << p.k
                                    << " fast_accum=" << p.fast_accum << " alpha=" << p.with_alpha);
  std::vector<double> ref, abs_sum;
  reference(p, ref, abs_sum);
  const std::vector<uint16_t> gpu = run_gpu(p);
  const std::vector<uint16_t> cpu = run_cpu(p);
  int64_t mismatches = 0, first = -1;
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = 0; j < p.n; ++j) {
      const uint16_t want = float_to_bf16(float(ref[size_t(i * p.n + j)]));
      const uint16_t got = gpu[size_t(i * p.ldd + j)];
      if (got != want || cpu[size_t(i * p.ldd + j)] != want) {
        if (first < 0) first = i * p.n + j;
        ++mismatches;
      }
    }
  }
  EXPECT_EQ(mismatches, 0) << "first mismatch at (" << (first >= 0 ? first / p.n : 0) << ", "
                           << (first >= 0 ? first % p.n : 0) << ")";
  expect_padding_untouched(p, gpu);
}

// ---- the tests ---------------------------------------------------------------------------------

TEST(CudaFp8Gemm, ExactIntegerOperandsMatchBitForBit) {
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  for (bool fast : {false, true}) {
    for (bool alpha : {false, true}) {
      check_exact_problem(make_problem(rng, 64, 2304, 768, Values::kSmallIntegers, fast, alpha), "fwd");
      check_exact_problem(make_problem(rng, 48, 80, 112, Values::kSmallIntegers, fast, alpha), "odd");
      // Padded rows everywhere: lda, ldb > K and ldd > N.
      check_exact_problem(
          make_problem(rng, 1008, 48, 784, Values::kSmallIntegers, fast, alpha, 16, 32, 16), "padded");
    }
  }
}

TEST(CudaFp8Gemm, OperatorShapesAtReducedTokens) {
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  const int64_t tokens = 256, c = 768, qkv = 2304;
  for (bool fast : {false, true}) {
    // Forward: [T, C] x [qkv, C]^T (the op uses fast accumulation), with the product of three
    // scales (x_scale * weight_scale * qkv_scale) as the op passes it.
    check_random_problem(make_problem(rng, tokens, qkv, c, Values::kRandom, fast, true), "fwd");
    // Weight gradient: [qkv, T] x [C, T]^T (the op: no fast accumulation).
    check_random_problem(make_problem(rng, qkv, c, tokens, Values::kRandom, fast, false), "wgrad");
    // Input gradient: [T, qkv] x [C, qkv]^T (the op: no fast accumulation).
    check_random_problem(make_problem(rng, tokens, c, qkv, Values::kRandom, fast, true), "dgrad");
  }
}

TEST(CudaFp8Gemm, OddMultiplesOf16) {
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  for (int64_t m : {16, 48, 1008}) {
    check_random_problem(make_problem(rng, m, 48, 784, Values::kRandom, false, false), "odd");
    check_random_problem(make_problem(rng, m, 16, 16, Values::kRandom, true, true), "odd");
  }
  check_random_problem(make_problem(rng, 1008, 1008, 1008, Values::kRandom, false, true), "odd");
}

TEST(CudaFp8Gemm, OutputColumnSliceOfWiderBuffer) {
  // The packed forward writes V as columns [2HD, qkv_dim) of the [T, qkv_dim] GEMM output: d is a
  // column slice with ldd > N at a column offset. Nothing outside the slice may change.
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  const int64_t t = 128, c = 768, width = 2304, offset = 1536, n = width - offset;
  Problem p = make_problem(rng, t, n, c, Values::kSmallIntegers, true, true);
  p.ldd = width;
  DeviceBuffer a = DeviceBuffer::from(p.a);
  DeviceBuffer b = DeviceBuffer::from(p.b);
  DeviceBuffer scales = DeviceBuffer::from(std::vector<float>{p.scale_a, p.scale_b, p.alpha});
  DeviceBuffer d(size_t(t * width) * 2);
  fill_u16(d, kPoisonBF16);
  fp8_gemm(make_params(p, kGPU, a.data(), b.data(), scales.data(),
                       static_cast<uint16_t*>(d.data()) + offset));
  synchronize();
  const std::vector<uint16_t> out = d.to_host<uint16_t>();
  std::vector<double> ref, abs_sum;
  reference(p, ref, abs_sum);
  int64_t bad = 0;
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t j = 0; j < width; ++j) {
      const uint16_t got = out[size_t(i * width + j)];
      if (j < offset) {
        bad += got != kPoisonBF16;
      } else {
        bad += got != float_to_bf16(float(ref[size_t(i * n + (j - offset))]));
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

TEST(CudaFp8Gemm, RerunsAreBitwiseIdenticalOnAnyStream) {
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (bool fast : {false, true}) {
    const Problem fwd = make_problem(rng, 512, 2304, 768, Values::kRandom, fast, true);
    const Problem wgrad = make_problem(rng, 2304, 768, 4096, Values::kRandom, fast, false);
    for (const Problem* p : {&fwd, &wgrad}) {
      const std::vector<uint16_t> first = run_gpu(*p);
      const std::vector<uint16_t> second = run_gpu(*p, stream);
      const std::vector<uint16_t> third = run_gpu(*p);
      EXPECT_TRUE(first == second && first == third) << "M=" << p->m << " fast=" << fast;
    }
  }
  cudaStreamDestroy(stream);
}

TEST(CudaFp8Gemm, FirstCallUnderGraphCaptureThenTunedEagerCalls) {
  // fp8_gemm tunes its algorithm on the first eager call of a shape, which synchronizes; a first
  // call during stream capture cannot, so it must run untuned, cache nothing, and stay correct
  // in the graph after a later eager call has tuned the shape. Integer operands: every algorithm
  // must give bf16(exact). The shape is used by no other test, so the capture is its first call.
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  const Problem p = make_problem(rng, 208, 176, 144, Values::kSmallIntegers, false, true);
  std::vector<double> ref, abs_sum;
  reference(p, ref, abs_sum);
  DeviceBuffer a = DeviceBuffer::from(p.a);
  DeviceBuffer b = DeviceBuffer::from(p.b);
  DeviceBuffer scales = DeviceBuffer::from(std::vector<float>{p.scale_a, p.scale_b, p.alpha});
  DeviceBuffer d(size_t(p.m * p.ldd) * 2);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  Fp8GemmParams params = make_params(p, kGPU, a.data(), b.data(), scales.data(), d.data());
  params.stream = stream;
  const auto mismatches = [&] {
    const std::vector<uint16_t> out = d.to_host<uint16_t>();
    int64_t bad = 0;
    for (int64_t i = 0; i < p.m; ++i) {
      for (int64_t j = 0; j < p.n; ++j) {
        bad += out[size_t(i * p.ldd + j)] != float_to_bf16(float(ref[size_t(i * p.n + j)]));
      }
    }
    return bad;
  };

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  fp8_gemm(params);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  fill_u16(d, kPoisonBF16);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(mismatches(), 0) << "captured first call";

  for (int call = 0; call < 2; ++call) {  // the first tunes, the second runs the tuned plan
    fill_u16(d, kPoisonBF16);
    fp8_gemm(params);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(mismatches(), 0) << "eager call " << call;
  }
  fill_u16(d, kPoisonBF16);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(mismatches(), 0) << "graph replayed after tuning";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(CudaFp8Gemm, ModelShapesLaunchWithoutWorkspaceMemset) {
  // At the speedrun's shapes (T = 49152, C = 768, qkv_dim = 2304) cuBLASLt offers workspace-free
  // algorithms as fast as its first choice, whose kernels take a 4-byte tile counter that cuBLASLt
  // zeroes with a memset before every launch (a memset node and a ~3 us gap per GEMM in a CUDA
  // graph). fp8_gemm ranks the workspace-free ones first, so after tuning, a captured call of each
  // shape holds kernel nodes only (the GEMM, and the scale-folding kernel where alpha is given).
  // A failure here means the step's graph has memsets again (a cuBLASLt change, or the candidate
  // order): bench/results/2026-11-30_9b461e3_h200_gemm_workspace_ab.txt measured what they cost.
  QKVF_REQUIRE_GPU();
  const int64_t t = 49152, c = 768, qkv = 2304;
  struct Shape {
    int64_t m, n, k;
    bool fast_accum, with_alpha;
  };
  const Shape shapes[] = {{t, qkv, c, true, true},      // forward
                          {qkv, c, t, false, false},    // wgrad
                          {t, c, qkv, false, true}};    // dgrad
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (const Shape& shape : shapes) {
    // The values play no part in the algorithm choice: operands of e4m3 1.0 (0x38), unit scales.
    Problem p;
    p.m = shape.m;
    p.n = shape.n;
    p.k = shape.k;
    p.lda = p.ldb = shape.k;
    p.ldd = shape.n;
    p.fast_accum = shape.fast_accum;
    p.with_alpha = shape.with_alpha;
    DeviceBuffer a(size_t(p.m * p.k));
    DeviceBuffer b(size_t(p.n * p.k));
    a.fill_byte(0x38);
    b.fill_byte(0x38);
    DeviceBuffer scales = DeviceBuffer::from(std::vector<float>{1.0f, 1.0f, 1.0f});
    DeviceBuffer d(size_t(p.m * p.ldd) * 2);
    Fp8GemmParams params = make_params(p, kGPU, a.data(), b.data(), scales.data(), d.data());
    params.stream = stream;
    fp8_gemm(params);  // tunes the shape
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    fp8_gemm(params);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    size_t count = 0;
    ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &count), cudaSuccess);
    std::vector<cudaGraphNode_t> nodes(count);
    ASSERT_EQ(cudaGraphGetNodes(graph, nodes.data(), &count), cudaSuccess);
    int memsets = 0, kernels = 0;
    for (cudaGraphNode_t node : nodes) {
      cudaGraphNodeType type{};
      ASSERT_EQ(cudaGraphNodeGetType(node, &type), cudaSuccess);
      memsets += type == cudaGraphNodeTypeMemset;
      kernels += type == cudaGraphNodeTypeKernel;
    }
    cudaGraphDestroy(graph);
    std::printf("  [%lld x %lld x %lld] captured: %d kernel node(s), %d memset node(s)\n",
                (long long)p.m, (long long)p.n, (long long)p.k, kernels, memsets);
    EXPECT_EQ(memsets, 0) << "M=" << p.m << " N=" << p.n << " K=" << p.k;
    EXPECT_GE(kernels, 1) << "M=" << p.m << " N=" << p.n << " K=" << p.k;
  }
  cudaStreamDestroy(stream);
}

TEST(CudaFp8Gemm, RefusesShapesCublasLtCannotTake) {
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  const auto expect_refused = [](const Problem& p, size_t byte_offset, const char* what) {
    DeviceBuffer a(p.a.size() + 64), b(p.b.size() + 64), scales(64), d(size_t(p.m * p.ldd) * 2 + 64);
    const std::vector<float> s{p.scale_a, p.scale_b, p.alpha};
    scales.upload(s.data(), s.size() * 4);
    Fp8GemmParams params = make_params(p, kGPU, static_cast<char*>(a.data()) + byte_offset,
                                       b.data(), scales.data(), d.data());
    EXPECT_THROW(fp8_gemm(params), Error) << what;
  };
  expect_refused(make_problem(rng, 17, 64, 64, Values::kRandom, false, false), 0, "M = 17");
  expect_refused(make_problem(rng, 64, 40, 64, Values::kRandom, false, false), 0, "N = 40");
  expect_refused(make_problem(rng, 64, 64, 40, Values::kRandom, false, false), 0, "K = 40");
  expect_refused(make_problem(rng, 64, 64, 64, Values::kRandom, false, false, 8), 0, "lda = K + 8");
  expect_refused(make_problem(rng, 64, 64, 64, Values::kRandom, false, false), 8, "a 8-byte aligned");
}

TEST(CudaFp8Gemm, SecondDeviceUsesItsOwnContext) {
  QKVF_REQUIRE_GPU();
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  auto rng = rng_for_test();
  const Problem p = make_problem(rng, 64, 256, 768, Values::kSmallIntegers, true, true);
  const std::vector<uint16_t> on_device0 = run_gpu(p);
  int previous = 0;
  ASSERT_EQ(cudaGetDevice(&previous), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  std::vector<uint16_t> on_device1;
  {
    DeviceBuffer a = DeviceBuffer::from(p.a);
    DeviceBuffer b = DeviceBuffer::from(p.b);
    DeviceBuffer scales = DeviceBuffer::from(std::vector<float>{p.scale_a, p.scale_b, p.alpha});
    DeviceBuffer d(size_t(p.m * p.ldd) * 2);
    fill_u16(d, kPoisonBF16);
    // Make device 0 current again: the call must switch to the tensors' device by itself.
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    const Device device1{DeviceType::kCUDA, 1};
    fp8_gemm(make_params(p, device1, a.data(), b.data(), scales.data(), d.data()));
    int current = -1;
    ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
    EXPECT_EQ(current, 0) << "fp8_gemm must restore the caller's current device";
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    synchronize();
    on_device1 = d.to_host<uint16_t>();
  }
  ASSERT_EQ(cudaSetDevice(previous), cudaSuccess);
  EXPECT_EQ(on_device0, on_device1);
}

}  // namespace
}  // namespace qkvfuse::test
