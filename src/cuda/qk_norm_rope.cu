// qk_norm_rope.cu: QK RMS-norm + interleaved rotary, forward (SPEC.md section 1), CUDA backend.
//
// Math, per input row (token t, input head h2 in [0, 2H)), fp32:
//   rstd = 1 / sqrt(sum(x^2) / D + 2^-23),  n = x * rstd
//   y[d] = f1[t, d + off] * n[d] + f2[t, d + off] * n[d ^ 1]
//   plain:  q/k[t, h]                         off = 0
//   paired: q/k[2t + h / (H/2), h mod (H/2)]  off = (h mod 2) * D
//   key offset (keys, t > 0, d >= rotary_dim): y[d] = n[t-1][d] (normalized, not rotated)
// with h = h2 mod H, queries (h2 < H) to q and keys to k, each rounded to bf16 once.
//
// Design. The op is pure streaming (read qk + the factor rows, write q and k: about 327 MB at
// T = 49152, H = 6, D = 128), so the kernel is built to keep HBM busy and touch each byte once:
// - A row is owned by a lane group of G lanes, 16 bytes per lane per chunk (rope_common.cuh):
//   every load and store is a coalesced 16-byte vector, the row sums are a few shuffles.
// - A lane group owns one work unit: a *set* of K input heads (s, s+NS, ...) of one token. It
//   issues the loads of all K rows and of the token's factor chunks before using any (K+2
//   16-byte loads in flight per thread with bf16 factors), computes, stores and exits. The
//   factor chunks are loaded once per unit, not once per row.
// - The grid is one lane group per unit (rope::plan_row_work), not a persistent walk over token
//   ranges: a walk with no prefetch serializes one load latency per token, and ranges of equal
//   length leave a tail. Tens of thousands of short blocks keep every SM at its occupancy limit
//   with all their loads in flight, which is what streaming kernels need on Hopper.
// - Key offset without re-reading: the group that normalizes key row (t, h) also writes the
//   stationary dims (>= rotary_dim) of key row (t+1, h), which are exactly its normalized values
//   (bf16), and writes only the rotating dims of its own row (all dims at t = 0). Every output
//   byte is written exactly once by one thread, so results are deterministic; chunks that
//   rotary_dim splits are written as 4-byte words (rotary_dim is even).
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

/// Everything the forward kernel reads, by value in constant memory. Strides are in elements.
struct QkNormRopeKernelParams {
  const __nv_bfloat16* qk;    ///< [T, 2H, D] bf16: (t, h2, d) at t*qk_stride_t + h2*qk_stride_h + d
  int64_t qk_stride_t;        ///< multiple of 8
  int64_t qk_stride_h;        ///< multiple of 8
  const void* factor1;        ///< [T, D] ([T, 2D] paired), bf16 or fp32 (FactorT): cos
  const void* factor2;        ///< same shape and dtype: sin with odd lanes negated
  int64_t factor1_stride_t;   ///< (t, j) at t*factor_stride_t + j; multiple of 8 elements
  int64_t factor2_stride_t;
  __nv_bfloat16* q;           ///< [T, H, D] ([2T, H/2, D] paired) bf16, row-major contiguous. In
                              ///< both layouts row (t, h) starts at element (t*H + h)*D: paired
                              ///< (2t + h/(H/2), h mod (H/2)) is (2t + h/(H/2))*(H/2)*D + (h mod (H/2))*D.
  __nv_bfloat16* k;           ///< same shape as q, its own allocation
  int64_t tokens;             ///< T >= 1
  int num_heads;              ///< H (even when paired)
  int head_dim;               ///< D, multiple of 8 in [32, 256]
  int rotary_dim;             ///< key offset: dims >= rotary_dim of keys shift; even, in [0, D]
  bool paired;
  int row_sets;               ///< NS, even: unit u = t * NS + s owns heads {s, s+NS, ...} of token t
  int64_t units;              ///< T * NS
};

/// Register budget, as resident 128-thread blocks per SM: 8 (32 warps, <= 64 registers) for the
/// bf16-factor kernels; fp32 factor chunks take twice the registers, so those get 6 (<= 80), and
/// 5 (<= 96) at C = 3, whose one row comes with 6 fp32 factor chunks (48 registers; at 80 ptxas
/// spills). Chosen so that ptxas spills nothing (check with -Xptxas -v).
template <int C, typename FactorT>
constexpr int forward_min_blocks() {
  return sizeof(FactorT) == 4 ? (C == 3 ? 5 : 6) : 8;
}

/// Rows per lane group: 3 chunks of 16 bytes (C = 1) plus the two factor chunks in flight per
/// thread; wider rows hold fewer, 4 / C (2 at C = 2; 1 at C = 3, D = 96 on 4 lanes: the same 3
/// row chunks per thread as C = 1, but 6 factor chunks, one token's per row).
template <int C>
constexpr int forward_rows_per_group() {
  return C == 1 ? 3 : 4 / C;
}

/// kFullWidth: rows of exactly Geom's full width (rope::has_full_width).
template <class Geom, int K, bool kKeyOffset, typename FactorT, bool kFullWidth>
__global__ void __launch_bounds__(kRowThreads, forward_min_blocks<Geom::C, FactorT>())
    qk_norm_rope_kernel(const __grid_constant__ QkNormRopeKernelParams p) {
  constexpr int G = Geom::G;
  constexpr int C = Geom::C;
  static_assert(kRowThreads % 32 == 0 && 32 % G == 0, "lane groups must tile whole warps");
  static_assert(K >= 1 && K * C <= 4, "rows per lane group: keep the loads in registers");

  const int lane = int(threadIdx.x) % G;
  const int64_t unit = int64_t(blockIdx.x) * (kRowThreads / G) + threadIdx.x / G;
  const int64_t t = unit / p.row_sets;
  const int set = int(unit - t * p.row_sets);
  // Groups past the last unit (the last block only) load nothing and store nothing, but still
  // execute every shuffle: the row sums use full-warp masks.
  const bool token_ok = unit < p.units;
  const int H = p.num_heads;
  const int D = rope::row_width<Geom, kFullWidth>(p.head_dim);
  const auto width = rope::row_width_divisor<Geom, kFullWidth>(D);

  int d0[C];
  bool chunk_ok[C];
  int stationary_from[C];
#pragma unroll
  for (int c = 0; c < C; ++c) {
    d0[c] = 8 * (c * G + lane);
    chunk_ok[c] = d0[c] < D;
    stationary_from[c] = rope::stationary_start(d0[c], p.rotary_dim);
  }

  // ---- loads: the K rows of the set (row k is input head set + NS*k; rows past 2H are masked)
  // and the token's factor chunks, all issued before any use ----
  // Paired: every head of the set has the set's parity, hence one factor half for all its rows.
  const int factor_offset = p.paired ? (set & 1) * D : 0;
  const FactorT* factor1 = static_cast<const FactorT*>(p.factor1) + factor_offset;
  const FactorT* factor2 = static_cast<const FactorT*>(p.factor2) + factor_offset;
  const __nv_bfloat16* qk_token = p.qk + t * p.qk_stride_t + int64_t(set) * p.qk_stride_h;
  const int64_t qk_row_step = int64_t(p.row_sets) * p.qk_stride_h;
  Vec16 x_raw[K][C];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const bool row_ok = token_ok && set + p.row_sets * k < 2 * H;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      x_raw[k][c] = row_ok && chunk_ok[c] ? rope::ld_stream(qk_token + k * qk_row_step + d0[c])
                                          : rope::zero_vec16();
    }
  }
  FactorChunk<FactorT> f1[C];
  FactorChunk<FactorT> f2[C];
#pragma unroll
  for (int c = 0; c < C; ++c) {
    f1[c].load(factor1 + t * p.factor1_stride_t + d0[c], token_ok && chunk_ok[c]);
    f2[c].load(factor2 + t * p.factor2_stride_t + d0[c], token_ok && chunk_ok[c]);
  }

  // ---- per row: norm, rotate, store ----
  const int64_t out_token_step = int64_t(H) * D;
  const int64_t out_token = t * out_token_step;  // row (t, h) at out_token + h*D in both layouts
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const float rstd = rope::row_rstd<G, C>(x_raw[k], width);  // all lanes: shuffles
    const int head2 = set + p.row_sets * k;
    if (!(token_ok && head2 < 2 * H)) continue;
    const bool is_key = head2 >= H;
    __nv_bfloat16* out = (is_key ? p.k : p.q) + out_token + (is_key ? head2 - H : head2) * D;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      if (!chunk_ok[c]) continue;
      Vec16 v;
      if constexpr (kKeyOffset) {
        Vec16 n;
        rope::forward_chunk(x_raw[k][c], rstd, f1[c], f2[c], v, &n);
        if (is_key) {
          // Own row: the rotating dims (every dim at t = 0); the stationary dims come from the
          // group of token t-1. Next token's row: its stationary dims are this row's n.
          rope::st_chunk_range(out + d0[c], v, 0, t == 0 ? 8 : stationary_from[c]);
          if (t + 1 < p.tokens && stationary_from[c] < 8) {
            rope::st_chunk_range(out + out_token_step + d0[c], n, stationary_from[c], 8);
          }
        } else {
          rope::st_vec16(out + d0[c], v);
        }
      } else {
        rope::forward_chunk(x_raw[k][c], rstd, f1[c], f2[c], v, nullptr);
        rope::st_vec16(out + d0[c], v);
      }
    }
  }
}

template <class Geom, bool kKeyOffset, typename FactorT, bool kFullWidth>
void launch_forward(QkNormRopeKernelParams kp, cudaStream_t stream) {
  constexpr int K = forward_rows_per_group<Geom::C>();
  constexpr auto kernel = qk_norm_rope_kernel<Geom, K, kKeyOffset, FactorT, kFullWidth>;
  const rope::RowWork work =
      rope::plan_row_work(kp.tokens, 2 * int64_t(kp.num_heads), K, Geom::G);
  kp.row_sets = work.row_sets;
  kp.units = work.units;
  kernel<<<dim3(unsigned(work.blocks)), dim3(kRowThreads), 0, stream>>>(kp);
  QKVF_CUDA_CHECK_LAUNCH("qk_norm_rope_kernel");
}

}  // namespace

void qk_norm_rope(const QkNormRopeParams& params) {
  if (!rope::vector_path(params)) return generic::qk_norm_rope(params);
  DeviceGuard guard(params.qk.device);
  const int64_t tokens = params.qk.size(0);
  if (tokens == 0) return;
  const RopeLayout& layout = params.layout;
  const int64_t head_dim = params.qk.size(2);
  // Validated by the entry point; restated because the kernel's addressing relies on it.
  QKVF_CHECK(params.q.is_contiguous() && params.k.is_contiguous(),
             "qk_norm_rope (CUDA): q and k must be row-major contiguous, got ", params.q.describe(),
             " and ", params.k.describe());

  QkNormRopeKernelParams kp{};
  kp.qk = static_cast<const __nv_bfloat16*>(params.qk.data);
  kp.qk_stride_t = params.qk.strides[0];
  kp.qk_stride_h = params.qk.strides[1];
  kp.factor1 = params.factor1.data;
  kp.factor2 = params.factor2.data;
  kp.factor1_stride_t = params.factor1.strides[0];
  kp.factor2_stride_t = params.factor2.strides[0];
  kp.q = static_cast<__nv_bfloat16*>(params.q.data);
  kp.k = static_cast<__nv_bfloat16*>(params.k.data);
  kp.tokens = tokens;
  kp.num_heads = int(layout.num_heads);
  kp.head_dim = int(head_dim);
  kp.rotary_dim = layout.key_offset ? int(layout.rotary_dim) : int(head_dim);
  kp.paired = layout.paired;

  const cudaStream_t stream = to_cuda(params.stream);
  // D = 96 on 4 lanes x 3 chunks: every lane loads and stores (16 x 1 idles 4 of 16 lanes);
  // 83.2 % of copy against 80.2 % at H = 6 plain on the H200 (key offset 80.6 against 75.5 %).
  rope::kernel_switch<rope::Width96::kFull4x3>(
      "qk_norm_rope", head_dim, layout.key_offset, params.factor1.dtype,
      [&](auto geometry, auto full_width, auto key_offset, auto factor_tag) {
        using FactorT = typename decltype(factor_tag)::type;
        launch_forward<decltype(geometry), decltype(key_offset)::value, FactorT,
                       decltype(full_width)::value>(kp, stream);
      });
}

}  // namespace qkvfuse::cuda
