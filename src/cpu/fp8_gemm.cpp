// cpu/fp8_gemm.cpp: the CPU reference of the per-tensor scaled FP8 GEMM.
//
//   d[m, n] = bf16( float(sum_k a[m, k] * b[n, k]) * (scale_a * scale_b * alpha) )
//
// Each product of two e4m3 values has at most 4 x 4 significant bits, so it is exact in fp32.
// Every e4m3 value is a multiple of 2^-9 below 2^9, so every product is a multiple of 2^-18 below
// 2^18, and a sum of K of them needs at most 36 + log2(K) bits: in double it is exact, in any
// order, for K < 2^17 (T = 49152 tokens included). The sum is therefore the exact dot product,
// at least as accurate as any fp32 accumulation the GPU may use, and independent of how the
// loop is split; beyond 2^17 it stays deterministic (the order is fixed). The scales combine in
// fp32, left to right, and the result is rounded to bf16 once. fast_accum only affects the GPU.
//
// b is decoded to fp32 once; the rows of d are split across threads, each row written by one.
#include <cstdint>
#include <vector>

#include "backend.hpp"
#include "cpu/parallel.hpp"
#include "qkvfuse/numeric.hpp"

namespace qkvfuse::cpu {
namespace {

/// The rows of an e4m3 [rows, cols] matrix (last dim contiguous) decoded to dense fp32.
std::vector<float> decode_rows(const TensorView& view, int64_t first_row, int64_t rows) {
  const int64_t cols = view.sizes[1];
  std::vector<float> out(size_t(rows * cols));
  const auto* data = view.ptr<const uint8_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* src = data + (first_row + r) * view.strides[0];
    for (int64_t k = 0; k < cols; ++k) out[size_t(r * cols + k)] = e4m3_to_float(src[k]);
  }
  return out;
}

/// The exact dot product of two decoded e4m3 rows (see the header comment). Independent
/// accumulators let the additions overlap; exactness makes their grouping irrelevant.
double dot(const float* a, const float* b, int64_t count) {
  constexpr int kLanes = 8;
  double lanes[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= count; k += kLanes) {
    for (int lane = 0; lane < kLanes; ++lane) lanes[lane] += double(a[k + lane] * b[k + lane]);
  }
  for (; k < count; ++k) lanes[0] += double(a[k] * b[k]);
  double sum = 0.0;
  for (double lane : lanes) sum += lane;
  return sum;
}

}  // namespace

void fp8_gemm(const Fp8GemmParams& p) {
  const int64_t m_size = p.a.sizes[0];
  const int64_t n_size = p.b.sizes[0];
  const int64_t k_size = p.a.sizes[1];
  const float alpha = is_absent(p.alpha) ? 1.0f : *p.alpha.ptr<const float>();
  const float scale = *p.scale_a.ptr<const float>() * *p.scale_b.ptr<const float>() * alpha;
  const std::vector<float> b = decode_rows(p.b, 0, n_size);

  parallel_for(m_size, 8, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const std::vector<float> a = decode_rows(p.a, m, 1);
      uint16_t* d = p.d.ptr<uint16_t>() + m * p.d.strides[0];
      for (int64_t n = 0; n < n_size; ++n) {
        d[n] = float_to_bf16(float(dot(a.data(), b.data() + n * k_size, k_size)) * scale);
      }
    }
  });
}

}  // namespace qkvfuse::cpu
