// qkvfuse/quantize.hpp: bf16 -> e4m3 in row-major and transposed layouts from one read
// (SPEC.md section 5).
#pragma once

#include "qkvfuse/tensor.hpp"

namespace qkvfuse {

/// row = e4m3(src / scale), t = row^T, optionally amax = max|src|.
///
/// Plain:   src bf16 [M, N] (last dim contiguous, row stride arbitrary), scale float32 [] or [1],
///          row e4m3 [M, N] and t e4m3 [N, M], both row-major contiguous; amax float32 [] or [1]
///          or absent.
/// Batched: src bf16 [B, M, N], scale float32 [B], row [B, M, N], t [B, N, M], amax [B] or absent;
///          entry b uses scale[b].
/// amax is the max of |src| over finite and infinite values; NaN propagates (amax is NaN if any
/// element of its entry is NaN).
struct QuantizeDualParams {
  TensorView src;
  TensorView scale;
  TensorView row;
  TensorView t;
  TensorView amax;  ///< optional
  Stream stream = nullptr;
};

void quantize_dual_layout(const QuantizeDualParams& params);

/// The per-layer packed weight cache refresh (current scaling): for each entry b of src
/// bf16 [B, M, N], scale[b] = max|src[b]| / 448 (1 when the entry is all zeros, so that it
/// quantizes to zeros rather than NaN), then row[b] = e4m3(src[b] / scale[b]) and t[b] = row[b]^T.
/// Computed on the device with no host round trip.
///
///   src bf16 [B, M, N] (last dim contiguous); scale output float32 [B];
///   row e4m3 [B, M, N]; t e4m3 [B, N, M] (row-major contiguous)
struct QuantizeWeightBankParams {
  TensorView src;
  TensorView scale;
  TensorView row;
  TensorView t;
  Stream stream = nullptr;
};

void quantize_weight_bank(const QuantizeWeightBankParams& params);

}  // namespace qkvfuse
