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
// - A lane group owns a *set* of K input heads of one token (heads s, s+NS, ...) and issues the
//   loads of all K rows and of the token's factor chunks before using any, so each thread has
//   K+2 (bf16 factors) 16-byte loads in flight; the factor chunks are loaded once per token and
//   set, not once per row (the factor rows are shared by all 2H heads of a token).
// - Each group walks a contiguous range of tokens in order (a persistent one-wave grid; every
//   range has the same length). Under key offset it carries the previous token's normalized key
//   rows in registers (bf16: the value the output takes), so the shifted dims cost no extra
//   read. The one token per range whose predecessor belongs to the previous range is split at
//   rotary_dim: the group that owns the predecessor writes the stationary dims of that token's
//   key rows after its walk, the owner of the token writes the rotating dims. Every output byte
//   is still written exactly once, and no row is read twice.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "backend.hpp"
#include "cuda/check.hpp"
#include "cuda/device_math.cuh"
#include "cuda/rope_common.cuh"
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
  int row_sets;               ///< NS, even: a lane group owns heads {s, s+NS, ...} of its tokens
  int64_t num_ranges;         ///< token ranges; stream = range * NS + set
  int64_t tokens_per_range;   ///< L
};

/// Register budget, as resident 128-thread blocks per SM: 8 (32 warps, <= 64 registers) for the
/// bf16-factor kernels; the key-offset carry (K*C chunks) and fp32 factor chunks (twice the
/// registers) need more, so those get fewer, larger-register blocks (6: <= 80, 5: <= 96,
/// 4: <= 128), chosen so that ptxas spills nothing. The persistent grid is sized from the
/// occupancy the compiled kernel really has.
template <int C, bool kKeyOffset, typename FactorT>
constexpr int forward_min_blocks() {
  constexpr bool kWideFactors = sizeof(FactorT) == 4;
  if constexpr (!kKeyOffset && !kWideFactors) return 8;
  if constexpr (kKeyOffset && kWideFactors) return C == 1 ? 5 : 4;
  if constexpr (kWideFactors) return C == 1 || C == 2 ? 6 : 5;
  return C == 1 ? 6 : 5;  // key offset, bf16 factors
}

/// Rows per lane group: 3 chunks of 16 bytes (C = 1) plus the two factor chunks in flight per
/// thread; wider rows hold fewer.
template <int C>
constexpr int forward_rows_per_group() {
  return C == 1 ? 3 : (C == 2 ? 2 : 1);
}

template <class Geom, int K, bool kKeyOffset, typename FactorT>
__global__ void __launch_bounds__(kRowThreads, forward_min_blocks<Geom::C, kKeyOffset, FactorT>())
    qk_norm_rope_kernel(const __grid_constant__ QkNormRopeKernelParams p) {
  constexpr int G = Geom::G;
  constexpr int C = Geom::C;
  static_assert(kRowThreads % 32 == 0 && 32 % G == 0, "lane groups must tile whole warps");
  static_assert(K >= 1 && K * C <= 4, "rows per lane group: keep the loads in registers");

  const int lane = int(threadIdx.x) % G;
  const int64_t stream = int64_t(blockIdx.x) * (kRowThreads / G) + threadIdx.x / G;
  const int64_t range = stream / p.row_sets;
  const int set = int(stream - range * p.row_sets);
  const int64_t t_begin = range * p.tokens_per_range;
  // Idle groups (past the last range) walk an empty range: they still execute every shuffle.
  const int64_t t_end = range < p.num_ranges ? min(t_begin + p.tokens_per_range, p.tokens) : t_begin;
  const int H = p.num_heads;
  const int D = p.head_dim;
  const rope::UniformDivisor width{float(D)};

  int d0[C];
  bool chunk_ok[C];
  int stationary_from[C];
#pragma unroll
  for (int c = 0; c < C; ++c) {
    d0[c] = 8 * (c * G + lane);
    chunk_ok[c] = d0[c] < D;
    stationary_from[c] = rope::stationary_start(d0[c], p.rotary_dim);
  }

  // Row k of the set is input head set + NS*k; rows past 2H are masked.
  const int64_t qk_row_step = int64_t(p.row_sets) * p.qk_stride_h;
  const __nv_bfloat16* qk_set = p.qk + int64_t(set) * p.qk_stride_h;
  // Paired: every head of the set has the set's parity, hence one factor half for all its rows.
  const int factor_offset = p.paired ? (set & 1) * D : 0;
  const FactorT* factor1 = static_cast<const FactorT*>(p.factor1) + factor_offset;
  const FactorT* factor2 = static_cast<const FactorT*>(p.factor2) + factor_offset;
  const int64_t out_token_step = int64_t(H) * D;
  int64_t out_token = t_begin * out_token_step;

  // Issues every load of token t_begin + i: the K rows of the set and the factor chunks.
  auto load_token = [&](int64_t i, Vec16 (&x_raw)[K][C], FactorChunk<FactorT> (&f1)[C],
                        FactorChunk<FactorT> (&f2)[C]) {
    const int64_t t = t_begin + i;
    const bool token_ok = t < t_end;
    const __nv_bfloat16* qk_token = qk_set + t * p.qk_stride_t;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const bool row_ok = token_ok && set + p.row_sets * k < 2 * H;
#pragma unroll
      for (int c = 0; c < C; ++c) {
        x_raw[k][c] = row_ok && chunk_ok[c] ? rope::ld_stream(qk_token + k * qk_row_step + d0[c])
                                            : rope::zero_vec16();
      }
    }
#pragma unroll
    for (int c = 0; c < C; ++c) {
      f1[c].load(factor1 + t * p.factor1_stride_t + d0[c], token_ok && chunk_ok[c]);
      f2[c].load(factor2 + t * p.factor2_stride_t + d0[c], token_ok && chunk_ok[c]);
    }
  };

  // Key offset: bf16 of the previous token's normalized rows (only key rows are used).
  Vec16 carried[K][C];

  // No software pipelining across tokens: at <= 64 registers 32 warps per SM each keep K+2
  // 16-byte loads per lane in flight while they wait, several times the bytes HBM needs in
  // flight; a prefetch of the next token would cost ~20 registers, hence warps, for nothing.
  for (int64_t i = 0; i < p.tokens_per_range; ++i) {  // warp-uniform trip count
    const int64_t t = t_begin + i;
    const bool token_ok = t < t_end;
    Vec16 x_raw[K][C];
    FactorChunk<FactorT> f1[C];
    FactorChunk<FactorT> f2[C];
    load_token(i, x_raw, f1, f2);

    // ---- per row: norm, rotate, store ----
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
          const bool shift_row = is_key && t > 0;
          if (shift_row && i > 0) {
#pragma unroll
            for (int w = 0; w < 4; ++w) {
              if (2 * w >= stationary_from[c]) v.w[w] = carried[k][c].w[w];
            }
          }
          // First token of a range (t > 0): its stationary key dims belong to the previous
          // range's group, which writes them from its carried rows.
          rope::st_chunk_range(out + d0[c], v, 0, shift_row && i == 0 ? stationary_from[c] : 8);
          if (is_key) carried[k][c] = n;
        } else {
          rope::forward_chunk(x_raw[k][c], rstd, f1[c], f2[c], v, nullptr);
          rope::st_vec16(out + d0[c], v);
        }
      }
    }
    out_token += out_token_step;
  }

  if constexpr (kKeyOffset) {
    // Hand-off: the stationary dims of the next range's first token (t_end, whose row offset
    // out_token now is) are this group's last normalized key rows.
    if (range < p.num_ranges && t_end < p.tokens) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int head2 = set + p.row_sets * k;
        if (!(head2 < 2 * H && head2 >= H)) continue;
        __nv_bfloat16* out = p.k + out_token + (head2 - H) * D;
#pragma unroll
        for (int c = 0; c < C; ++c) {
          if (chunk_ok[c]) rope::st_chunk_range(out + d0[c], carried[k][c], stationary_from[c], 8);
        }
      }
    }
  }
}

template <class Geom, bool kKeyOffset, typename FactorT>
void launch_forward(QkNormRopeKernelParams kp, cudaStream_t stream) {
  constexpr int K = forward_rows_per_group<Geom::C>();
  constexpr auto kernel = qk_norm_rope_kernel<Geom, K, kKeyOffset, FactorT>;
  const rope::RowWork work = rope::plan_row_work(
      kp.tokens, 2 * int64_t(kp.num_heads), K, Geom::G,
      rope::resident_blocks_per_sm<kernel>(kRowThreads, 0), multiprocessor_count());
  kp.row_sets = work.row_sets;
  kp.num_ranges = work.num_ranges;
  kp.tokens_per_range = work.tokens_per_range;
  kernel<<<dim3(unsigned(work.blocks)), dim3(kRowThreads), 0, stream>>>(kp);
  QKVF_CUDA_CHECK_LAUNCH("qk_norm_rope_kernel");
}

}  // namespace

void qk_norm_rope(const QkNormRopeParams& params) {
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
  rope::head_width_switch("qk_norm_rope", head_dim, [&](auto geometry) {
    using Geom = decltype(geometry);
    bool_switch(layout.key_offset, [&](auto key_offset) {
      factor_dtype_switch("qk_norm_rope", params.factor1.dtype, [&](auto factor_tag) {
        using FactorT = typename decltype(factor_tag)::type;
        launch_forward<Geom, decltype(key_offset)::value, FactorT>(kp, stream);
      });
    });
  });
}

}  // namespace qkvfuse::cuda
