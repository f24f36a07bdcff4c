// cpu/quantize.cpp: the CPU reference of the dual-layout e4m3 quantize (SPEC.md section 5).
//
//   row[m, n] = t[n, m] = e4m3(float(src[m, n]) / scale)     (a true fp32 division, then RNE
//                                                             with saturation: numeric.hpp)
//   amax      = max |src|, NaN if any element is NaN
//   weight bank: scale = amax / 448 (1 when amax == 0, so an all-zero entry quantizes to zeros)
// A plain [M, N] call is one entry of a batch; a batch [B, M, N] runs its entries in turn, each
// split over rows across threads. The amax reduction keeps one partial per row and combines them
// in row order after the parallel pass (max is order-independent anyway, NaN included).
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "backend.hpp"
#include "cpu/parallel.hpp"
#include "qkvfuse/numeric.hpp"

namespace qkvfuse::cpu {
namespace {

/// One [M, N] entry: bf16 source rows (last dim contiguous) and its two e4m3 outputs.
struct Entry {
  const uint16_t* src;
  int64_t rows;
  int64_t cols;
  int64_t src_row_stride;
  uint8_t* row;         ///< [rows, cols] contiguous
  uint8_t* transposed;  ///< [cols, rows] contiguous
};

/// Entry b of a [M, N] (plain, b = 0) or [B, M, N] (batched) quantize.
Entry entry_of(const TensorView& src, const TensorView& row, const TensorView& t, int64_t b) {
  const bool batched = src.ndim == 3;
  const int dim = batched ? 1 : 0;
  const int64_t rows = src.sizes[dim];
  const int64_t cols = src.sizes[dim + 1];
  const int64_t src_offset = batched ? b * src.strides[0] : 0;
  return {src.ptr<const uint16_t>() + src_offset,
          rows,
          cols,
          src.strides[dim],
          row.ptr<uint8_t>() + b * rows * cols,
          t.ptr<uint8_t>() + b * rows * cols};
}

int64_t batch_count(const TensorView& src) { return src.ndim == 3 ? src.sizes[0] : 1; }

float nan_max(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<float>::quiet_NaN();
  return a > b ? a : b;
}

float entry_amax(const Entry& e) {
  std::vector<float> row_max(size_t(e.rows), 0.0f);
  parallel_for(e.rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const uint16_t* src = e.src + m * e.src_row_stride;
      float value = 0.0f;
      for (int64_t n = 0; n < e.cols; ++n) value = nan_max(value, std::fabs(bf16_to_float(src[n])));
      row_max[size_t(m)] = value;
    }
  });
  float amax = 0.0f;
  for (float value : row_max) amax = nan_max(amax, value);
  return amax;
}

void quantize_entry(const Entry& e, float scale) {
  parallel_for(e.rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const uint16_t* src = e.src + m * e.src_row_stride;
      for (int64_t n = 0; n < e.cols; ++n) {
        const uint8_t code = float_to_e4m3(bf16_to_float(src[n]) / scale);
        e.row[m * e.cols + n] = code;
        e.transposed[n * e.rows + m] = code;
      }
    }
  });
}

}  // namespace

void quantize_dual_layout(const QuantizeDualParams& p) {
  const float* scale = p.scale.ptr<const float>();
  float* amax = is_absent(p.amax) ? nullptr : p.amax.ptr<float>();
  for (int64_t b = 0; b < batch_count(p.src); ++b) {
    const Entry entry = entry_of(p.src, p.row, p.t, b);
    quantize_entry(entry, scale[b]);
    if (amax) amax[b] = entry_amax(entry);
  }
}

void quantize_weight_bank(const QuantizeWeightBankParams& p) {
  float* scale = p.scale.ptr<float>();
  for (int64_t b = 0; b < batch_count(p.src); ++b) {
    const Entry entry = entry_of(p.src, p.row, p.t, b);
    const float amax = entry_amax(entry);
    scale[b] = amax == 0.0f ? 1.0f : amax / E4M3::kMax;
    quantize_entry(entry, scale[b]);
  }
}

}  // namespace qkvfuse::cpu
