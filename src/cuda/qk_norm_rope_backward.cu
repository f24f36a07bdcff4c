// qk_norm_rope_backward.cu: backward of QK RMS-norm + rotary into bf16 (SPEC.md section 2), CUDA
// backend.
//
// Math, per input row (token t, input head h2, logical head h = h2 mod H), fp32:
//   g      = grad of y at the output position the forward wrote (plain (t, h); paired
//            (2t + h / (H/2), h mod (H/2)), factor column offset (h mod 2) * D)
//   rstd   = 1 / sqrt(sum(x^2) / D + 2^-23) recomputed from the saved qk, n = x * rstd
//   dn[d]  = f1[d] * g[d] + f2[d ^ 1] * g[d ^ 1]
//   key offset, keys, d >= rotary_dim: dn[d] = g_next[d] + (t == 0 ? g[d] : 0), g_next the grad
//            of the same key head at token t+1 (0 for the last token)
//   dx     = rstd * (dn - n * (sum(dn * n) / D))          -> grad_qk[t, h2] in bf16
//
// Design: the same streaming layout as the forward (qk_norm_rope.cu, rope_common.cuh): a lane
// group of G lanes per row, 16-byte vectors; a lane group owns one unit, K heads of one token
// (the factor chunks are loaded once for them), issues all of the unit's loads (g and x of each
// row, the factor chunks) before any math, and exits: one group per unit, no persistent walk.
// Bytes: read grad_q, grad_k, qk and the factor rows once, write grad_qk once. Under key offset
// a key row also needs the stationary dims of g at t+1: the row the neighbouring unit (same set,
// next token, a group of the same or the next block, running at about the same time) reads as
// its own g, so the extra read is an L1/L2 hit, not HBM traffic.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "backend.hpp"
#include "cuda/check.hpp"
#include "cuda/device_math.cuh"
#include "cuda/rope_common.cuh"
#include "cuda/rope_paths.hpp"
#include "cuda/static_switch.hpp"

namespace qkvfuse::cuda {
namespace {

using rope::FactorChunk;
using rope::kRowThreads;

/// Everything the bf16 backward kernel reads. Strides are in elements, multiples of 8.
struct QkNormRopeBackwardKernelParams {
  const __nv_bfloat16* grad_q;  ///< [T, H, D] ([2T, H/2, D] paired): (t', h', d) at
                                ///< t'*grad_q_stride_t + h'*grad_q_stride_h + d
  int64_t grad_q_stride_t;
  int64_t grad_q_stride_h;
  const __nv_bfloat16* grad_k;  ///< same shape as grad_q, its own strides
  int64_t grad_k_stride_t;
  int64_t grad_k_stride_h;
  const __nv_bfloat16* qk;      ///< [T, 2H, D]: (t, h2, d) at t*qk_stride_t + h2*qk_stride_h + d
  int64_t qk_stride_t;
  int64_t qk_stride_h;
  const void* factor1;          ///< [T, D] ([T, 2D] paired), bf16 or fp32 (FactorT)
  const void* factor2;          ///< same shape and dtype
  int64_t factor1_stride_t;     ///< (t, j) at t*factor_stride_t + j
  int64_t factor2_stride_t;
  __nv_bfloat16* grad_qk;       ///< [T, 2H, D] row-major contiguous: (t, h2) at (t*2H + h2)*D
  int64_t tokens;               ///< T >= 1
  int num_heads;                ///< H
  int head_dim;                 ///< D, multiple of 8 in [32, 256]
  int rotary_dim;               ///< key offset: dims >= rotary_dim of keys; even, in [0, D]
  bool paired;
  int row_sets;                 ///< NS (rope::RowWork): unit u = t * NS + s
  int64_t units;                ///< T * NS
};

/// Rows per lane group: each row needs g and x (two chunks per lane per chunk slot); one row for
/// C >= 2 (D = 96 on 4 lanes x 3 chunks included).
template <int C>
constexpr int backward_rows_per_group() {
  return C == 1 ? 2 : 1;
}

/// Register budget as resident 128-thread blocks per SM, chosen so that ptxas spills nothing:
/// 8 (<= 64 registers, 32 warps) for the bf16-factor kernels of one chunk per lane, key offset
/// included (its g_next chunks fit: 64 registers, no spill), fewer for fp32 factors and wider
/// rows. C = 3 (D = 96 on 4 lanes) holds g, x (and g_next) and the 6 factor chunks of its one
/// row at once: 6 blocks (80 registers) with bf16 factors, 5 (92) under key offset, 4 (107 and
/// 118) with fp32 factors; one block more spills in each case.
template <int C, bool kKeyOffset, typename FactorT>
constexpr int backward_min_blocks() {
  constexpr bool kWideFactors = sizeof(FactorT) == 4;
  if constexpr (C == 1) return kKeyOffset && kWideFactors ? 5 : (kWideFactors ? 6 : 8);
  if constexpr (C == 3) return kWideFactors ? 4 : (kKeyOffset ? 5 : 6);
  return kWideFactors || kKeyOffset ? 4 : 5;
}

/// Branch-free row scalars (rope::backward_row) where they measured faster on the H200: key
/// offset (D = 128: 80.7 against 77.6 % of copy, D = 64: 80.0 against 75.3 %) and 4 lanes x 3
/// chunks (D = 96 plain 86.4 against 85.2 %, paired 88.0 against 84.7 %). The plain and paired
/// kernels of one chunk per lane keep the branches: 86.9 against 93.0 % at D = 128 without them
/// (bench/results/2026-11-30_289d2bb_h200_branch_free_ab.txt).
template <int C, bool kKeyOffset>
constexpr bool backward_branch_free() {
  return kKeyOffset || C == 3;
}

/// kFullWidth: rows of exactly Geom's full width (rope::has_full_width).
template <class Geom, int K, bool kKeyOffset, typename FactorT, bool kFullWidth>
__global__ void __launch_bounds__(kRowThreads, backward_min_blocks<Geom::C, kKeyOffset, FactorT>())
    qk_norm_rope_backward_kernel(const __grid_constant__ QkNormRopeBackwardKernelParams p) {
  constexpr int G = Geom::G;
  constexpr int C = Geom::C;
  static_assert(kRowThreads % 32 == 0 && 32 % G == 0, "lane groups must tile whole warps");
  static_assert(K >= 1 && K * C <= 4, "rows per lane group: keep the loads in registers");

  const int lane = int(threadIdx.x) % G;
  const int64_t unit = int64_t(blockIdx.x) * (kRowThreads / G) + threadIdx.x / G;
  const int64_t t = unit / p.row_sets;
  const int set = int(unit - t * p.row_sets);
  // Groups past the last unit load and store nothing but still execute every shuffle.
  const bool token_ok = unit < p.units;
  const int H = p.num_heads;
  const int D = rope::row_width<Geom, kFullWidth>(p.head_dim);
  const auto width = rope::row_width_divisor<Geom, kFullWidth>(D);

  int d0[C];
  bool chunk_ok[C];
  int stationary_from[C];  // key rows under key offset only
#pragma unroll
  for (int c = 0; c < C; ++c) {
    d0[c] = 8 * (c * G + lane);
    chunk_ok[c] = d0[c] < D;
    stationary_from[c] = kKeyOffset ? rope::stationary_start(d0[c], p.rotary_dim) : 8;
  }

  const int64_t qk_row_step = int64_t(p.row_sets) * p.qk_stride_h;
  const __nv_bfloat16* qk_token = p.qk + t * p.qk_stride_t + int64_t(set) * p.qk_stride_h;
  const int factor_offset = p.paired ? (set & 1) * D : 0;
  const FactorT* factor1 = static_cast<const FactorT*>(p.factor1) + factor_offset;
  const FactorT* factor2 = static_cast<const FactorT*>(p.factor2) + factor_offset;
  const int half = H / 2;

  // ---- loads: g and x of every row of the set, g_next of key rows, the factor chunks ----
  Vec16 g_raw[K][C];
  Vec16 x_raw[K][C];
  Vec16 g_next_raw[K][C];
  FactorChunk<FactorT> f1[C];
  FactorChunk<FactorT> f2[C];
  // Issue order, for ptxas's schedule: at C = 3 (D = 96 on 4 lanes) and under key offset, with
  // the rows first, ptxas issues a factor load (and at C = 3 the last g chunk) after the rstd
  // shuffles, i.e. after x has arrived (a second memory latency per unit); with the factors
  // first the row loads precede the shuffles (key offset on the H200: D = 128 82.1 against
  // 80.5 %, D = 64 81.2 against 79.8 % of copy, bench/results/2026-11-30_ef35459_h200_fp8_v_ab.txt).
  // The plain and paired kernels of one chunk per lane keep the rows first (their SASS as
  // measured). The loop is written twice on purpose: as one lambda called from both places it
  // changed the C = 3 SASS.
  constexpr bool kFactorsFirst = C == 3 || kKeyOffset;
  if constexpr (kFactorsFirst) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
      f1[c].load(factor1 + t * p.factor1_stride_t + d0[c], token_ok && chunk_ok[c]);
      f2[c].load(factor2 + t * p.factor2_stride_t + d0[c], token_ok && chunk_ok[c]);
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int head2 = set + p.row_sets * k;
    const bool row_ok = token_ok && head2 < 2 * H;
    // Where the forward wrote row (t, head2): plain (t, h); paired (2t + h / (H/2), h mod (H/2)).
    const bool is_key = head2 >= H;
    const int h = is_key ? head2 - H : head2;
    const int64_t stride_t = is_key ? p.grad_k_stride_t : p.grad_q_stride_t;
    const int64_t stride_h = is_key ? p.grad_k_stride_h : p.grad_q_stride_h;
    const int sub_token = p.paired && h >= half ? 1 : 0;
    const int64_t out_token = p.paired ? 2 * t + sub_token : t;
    const __nv_bfloat16* g_row = (is_key ? p.grad_k : p.grad_q) + out_token * stride_t +
                                 int64_t(h - sub_token * half) * stride_h;
    // Key offset: g at t+1 of the same key head, for the stationary dims.
    const bool next_ok = kKeyOffset && row_ok && is_key && t + 1 < p.tokens;
    const __nv_bfloat16* g_next_row = g_row + p.grad_k_stride_t;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const bool ok = row_ok && chunk_ok[c];
      // Key offset: key grads are read twice (as g here, as g_next by the unit of t-1): cached.
      g_raw[k][c] = ok ? (kKeyOffset && is_key ? rope::ld_cached(g_row + d0[c])
                                               : rope::ld_stream(g_row + d0[c]))
                       : rope::zero_vec16();
      x_raw[k][c] = ok ? rope::ld_stream(qk_token + k * qk_row_step + d0[c]) : rope::zero_vec16();
      g_next_raw[k][c] = next_ok && chunk_ok[c] && stationary_from[c] < 8
                             ? rope::ld_cached(g_next_row + d0[c])
                             : rope::zero_vec16();
    }
  }
  if constexpr (!kFactorsFirst) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
      f1[c].load(factor1 + t * p.factor1_stride_t + d0[c], token_ok && chunk_ok[c]);
      f2[c].load(factor2 + t * p.factor2_stride_t + d0[c], token_ok && chunk_ok[c]);
    }
  }

  // ---- per row: dx, store ----
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int head2 = set + p.row_sets * k;
    const bool shift_row = kKeyOffset && head2 >= H;
    float dx[C][8];
    rope::backward_row<G, C, backward_branch_free<C, kKeyOffset>()>(
        g_raw[k], x_raw[k], f1, f2, g_next_raw[k], stationary_from, shift_row, t == 0, width,
        dx);  // all lanes: shuffles
    if (!(token_ok && head2 < 2 * H)) continue;
    __nv_bfloat16* out = p.grad_qk + (t * 2 * H + head2) * int64_t(D);
#pragma unroll
    for (int c = 0; c < C; ++c) {
      if (chunk_ok[c]) rope::st_vec16(out + d0[c], float_to_bf16x8(dx[c]));
    }
  }
}

template <class Geom, bool kKeyOffset, typename FactorT, bool kFullWidth>
void launch_backward(QkNormRopeBackwardKernelParams kp, cudaStream_t stream) {
  constexpr int K = backward_rows_per_group<Geom::C>();
  constexpr auto kernel = qk_norm_rope_backward_kernel<Geom, K, kKeyOffset, FactorT, kFullWidth>;
  const rope::RowWork work =
      rope::plan_row_work(kp.tokens, 2 * int64_t(kp.num_heads), K, Geom::G);
  kp.row_sets = work.row_sets;
  kp.units = work.units;
  kernel<<<dim3(unsigned(work.blocks)), dim3(kRowThreads), 0, stream>>>(kp);
  QKVF_CUDA_CHECK_LAUNCH("qk_norm_rope_backward_kernel");
}

}  // namespace

void qk_norm_rope_backward(const QkNormRopeBackwardParams& params) {
  if (!rope::vector_path(params)) return generic::qk_norm_rope_backward(params);
  DeviceGuard guard(params.qk.device);
  const int64_t tokens = params.qk.size(0);
  if (tokens == 0) return;
  const RopeLayout& layout = params.layout;
  const int64_t head_dim = params.qk.size(2);
  // Validated by the entry point; restated because the kernel's addressing relies on it.
  QKVF_CHECK(params.grad_qk.is_contiguous(),
             "qk_norm_rope_backward (CUDA): grad_qk must be row-major contiguous, got ",
             params.grad_qk.describe());

  QkNormRopeBackwardKernelParams kp{};
  kp.grad_q = static_cast<const __nv_bfloat16*>(params.grad_q.data);
  kp.grad_q_stride_t = params.grad_q.strides[0];
  kp.grad_q_stride_h = params.grad_q.strides[1];
  kp.grad_k = static_cast<const __nv_bfloat16*>(params.grad_k.data);
  kp.grad_k_stride_t = params.grad_k.strides[0];
  kp.grad_k_stride_h = params.grad_k.strides[1];
  kp.qk = static_cast<const __nv_bfloat16*>(params.qk.data);
  kp.qk_stride_t = params.qk.strides[0];
  kp.qk_stride_h = params.qk.strides[1];
  kp.factor1 = params.factor1.data;
  kp.factor2 = params.factor2.data;
  kp.factor1_stride_t = params.factor1.strides[0];
  kp.factor2_stride_t = params.factor2.strides[0];
  kp.grad_qk = static_cast<__nv_bfloat16*>(params.grad_qk.data);
  kp.tokens = tokens;
  kp.num_heads = int(layout.num_heads);
  kp.head_dim = int(head_dim);
  kp.rotary_dim = layout.key_offset ? int(layout.rotary_dim) : int(head_dim);
  kp.paired = layout.paired;

  const cudaStream_t stream = to_cuda(params.stream);
  // D = 96 on 4 lanes x 3 chunks: every lane loads and stores (16 x 1 idles 4 of 16 lanes);
  // 84.7 % of copy against 78.8 % at H = 6 plain on the H200 (key offset 85.5 against 61.0 %).
  rope::kernel_switch<rope::Width96::kFull4x3>(
      "qk_norm_rope_backward", head_dim, layout.key_offset, params.factor1.dtype,
      [&](auto geometry, auto full_width, auto key_offset, auto factor_tag) {
        using FactorT = typename decltype(factor_tag)::type;
        launch_backward<decltype(geometry), decltype(key_offset)::value, FactorT,
                        decltype(full_width)::value>(kp, stream);
      });
}

}  // namespace qkvfuse::cuda
