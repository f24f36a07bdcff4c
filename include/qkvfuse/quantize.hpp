// qkvfuse/quantize.hpp: bf16 -> e4m3 in row-major and transposed layouts from one read
// (SPEC.md section 5).
#pragma once

#include "qkvfuse/tensor.hpp"

namespace qkvfuse {

/// row = e4m3(src / scale), t = row^T, optionally amax = max|src|.
///
/// Plain:   src bf16 [M, N] (last dim contiguous; any row stride on the CPU), scale float32 []
///          or [1], row e4m3 [M, N] and t e4m3 [N, M], both row-major contiguous; amax float32
///          [] or [1] or absent.
/// Batched: src bf16 [B, M, N], scale float32 [B], row [B, M, N], t [B, N, M], amax [B] or absent;
///          entry b uses scale[b].
/// amax is the max of |src| over finite and infinite values; NaN propagates (amax is NaN if any
/// element of its entry is NaN).
/// On CUDA every tensor's data pointer and strides but the last, in bytes, must be multiples of
/// the vector width of its rows (the largest power of two up to 16 that divides a row's bytes,
/// scale and amax [B] counting as one row: 16 for the model's sizes), and B is at most 65535.
/// An empty src is a no-op: nothing is written, amax included (the PyTorch binding returns
/// amax = 0 for it).
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
/// CUDA alignment and B as for quantize_dual_layout. An empty src is a no-op: scale is not
/// written (the PyTorch binding returns scale = 1 for each entry, as for an all-zero one).
struct QuantizeWeightBankParams {
  TensorView src;
  TensorView scale;
  TensorView row;
  TensorView t;
  Stream stream = nullptr;
};

void quantize_weight_bank(const QuantizeWeightBankParams& params);

}  // namespace qkvfuse
