// qk_norm_rope_backward.cu: backward of QK-norm + rotary into bf16 (SPEC.md sections 2 and 8),
// CUDA backend.
//
// Math, per input row (token t, input head h2), fp32 (rope_rows.cuh backward_row):
//   g      = grad of y at the output position the forward wrote (rope_math.hpp place)
//   n      = x * rstd, rstd recomputed from the saved qk           (normalize = false: n = x)
//   gw[d]  = f1[d] * g[d] + f2[p(d)] * g[p(d)]   (d < r);   g[d]   (d >= r)
//   key offset, keys, d >= r: gw[d] = g_next[d] + (t == 0 ? g[d] : 0)
//   grad_w[d] += gw[d] * n[d];  dn = gw * (w + offset)           (with the row's weight)
//   dx     = rstd * (dn - n * (sum(dn * n) / D))  -> grad_qk[t, h2] in bf16  (dx = dn, no norm)
//
// Design: the forward's streaming layout (qk_norm_rope.cu, rope_common.cuh): a lane group of G
// lanes per row; a lane group owns one unit, K heads of one token (the angles are loaded once for
// them), issues all of the unit's loads before any math, and exits. Bytes: read grad_q, grad_k,
// qk and the angle rows once, write grad_qk once. Under key offset a key row also needs the lanes
// >= r of g at t+1: the row the neighbouring unit reads as its own g, so the extra read is an
// L1/L2 hit, not HBM traffic.
//
// Norm weights: the general kernels read them from the block's shared-memory copy
// (rope::SharedWeights). Their gradient is a sum over every row of its kind, which each lane group
// accumulates in its own row of shared memory (rope::WeightGradSums). So that the per-block
// partial sums stay few (weight_grad.hpp reduces them in a fixed order), a block walks all units of
// tokens_per_block consecutive tokens when the layout has weights, its lane groups taking the
// units in turn, then adds its groups' sums in group order and writes one partial row; without
// weights the same kernel takes one unit per lane group (one turn).
//
// The V norm (SPEC.md section 9, normalize_v; the Section9 configuration's kernels only): blocks
// after the Q/K blocks take the V rows, K per lane group, in the same row geometry: grad_v from
// grad_v_out and the saved v (rope_rows.cuh v_norm_backward). A block takes either kind, so the
// branch is block-uniform; the V blocks write no partial row.
//
// Kernels: one template for the whole family (rope_dispatch.hpp's table and rope_config.cuh's
// dispatcher pick the configuration and the launch policy).
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

#include "backend.hpp"
#include "cuda/check.hpp"
#include "cuda/rope_args.hpp"
#include "cuda/rope_common.cuh"
#include "cuda/rope_config.cuh"
#include "cuda/rope_dispatch.hpp"
#include "cuda/rope_rows.cuh"
#include "cuda/weight_grad.hpp"

namespace qkvfuse::cuda {
namespace {

using rope::Chunk;
using rope::Op;

/// Rows a block walks when the layout has weights, about: enough that its partial row (2D floats)
/// is under 1 % of the bytes it moves.
constexpr int64_t kRowsPerWeightBlock = 256;

/// Everything the bf16 backward kernel reads.
struct BackwardArgs {
  rope::RopeInputs in;
  rope::GradRows grad;
  uint16_t* grad_qk;         ///< [T, Hq + Hkv, D] row-major contiguous: (t, h2) at (t*heads2 + h2)*D
  float* partials;           ///< with weights: [blocks][2][D], one row per block; else nullptr
  int row_sets;              ///< NS (rope::RowWork): unit u = t * NS + s
  int64_t units;             ///< T * NS
  int tokens_per_block;      ///< with weights: a block walks the units of these many tokens
                             ///< (tokens_per_weight_block); 0: one unit per lane group
  // SPEC.md section 9 (the Section9 configuration's kernels only; after what the kernels of
  // sections 1-8 read, which so keep their parameter offsets)
  rope::Section9Inputs s9;
  // The V norm (s9.normalize_v)
  const uint16_t* grad_v_out;  ///< [T, Hkv, Dv]: (t, h, d) at t*grad_v_out_stride_t + h*..._h + d
  int64_t grad_v_out_stride_t;
  int64_t grad_v_out_stride_h;
  uint16_t* grad_v;            ///< [T, Hkv, Dv] row-major contiguous: row r = t*Hkv + h at r*Dv
  int64_t v_first_block;       ///< blocks from here on take V rows
};

int64_t tokens_per_weight_block(int64_t heads2) {
  return (kRowsPerWeightBlock + heads2 - 1) / heads2;
}

template <class Config, class Geom, typename AngleT>
using BackwardPolicy = rope::Policy<Op::kBackward, Config, Geom, AngleT>;

/// The V norm's rows of block blockIdx.x >= p.v_first_block: K consecutive rows r = t*Hkv + h per
/// lane group, all loads first; grad_v = the V norm's gradient of grad_v_out at the saved v.
/// Every lane of the block takes part.
template <class Geom, int K>
__device__ __forceinline__ void backward_v_rows(const BackwardArgs& p, int threads) {
  constexpr int G = Geom::G;
  constexpr int V = Geom::V;
  constexpr int C = Geom::C;
  const int lane = int(threadIdx.x) % G;
  const int64_t unit =
      (int64_t(blockIdx.x) - p.v_first_block) * (threads / G) + int(threadIdx.x) / G;
  const int Dv = p.s9.v_dim;
  const int kv = p.in.dims.kv_heads;
  const int64_t rows = p.in.tokens * kv;
  const rope::LaneChunks<Geom> lanes(lane, Dv, 0);
  const UniformDivisor width{float(Dv)};
  Chunk<V> g[K][C];
  Chunk<V> x[K][C];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t row = unit * K + k;
    const bool row_ok = row < rows;
    const int64_t t = row_ok ? row / kv : 0;
    const int64_t h = row - t * kv;
    const uint16_t* g_row = p.grad_v_out + t * p.grad_v_out_stride_t + h * p.grad_v_out_stride_h;
    const uint16_t* x_row = p.s9.v + t * p.s9.v_stride_t + h * p.s9.v_stride_h;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const bool ok = row_ok && lanes.ok[c];
      g[k][c] = rope::load_chunk_if<rope::Load::kStream, V>(ok, g_row + lanes.d0[c]);
      x[k][c] = rope::load_chunk_if<rope::Load::kStream, V>(ok, x_row + lanes.d0[c]);
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float dv[C][V];
    rope::v_norm_backward<Geom>(g[k], x[k], width, p.in.eps, dv);  // all lanes: shuffles
    const int64_t row = unit * K + k;
    if (row >= rows) continue;
    uint16_t* out = p.grad_v + row * Dv;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      if (lanes.ok[c]) rope::store_chunk(out + lanes.d0[c], rope::to_bf16<V>(dv[c]));
    }
  }
}

/// Branch-free row scalars (rope::backward_row) where they measured faster on the H200: key
/// offset and 4 lanes x 3 chunks of the 16-byte kernels; the plain and paired kernels of one
/// chunk per lane keep the branches (perf_notes.md). The narrow kernels keep them too: their
/// widths reach the subnormal row sums where divide_by_width is not __fdiv_rn.
template <class Geom, bool kKeyOffset>
constexpr bool backward_branch_free() {
  return Geom::V == 8 && (kKeyOffset || Geom::C == 3);
}

/// What backward_unit does with its rows (a compile-time choice, so that the per-head kernels hold
/// none of the token-wide norm's code): a per-head kernel's dx (stored); a token-wide norm's
/// (SPEC.md section 9) first pass, the lane's sums over its query and key rows of x^2 and of
/// dn * x (dn = gw * w) added to token_sums {x^2 query, x^2 key, dn x query, dn x key}; its second
/// pass, dx with the token's scalars token_scalars {rstd query, rstd key, correction query,
/// correction key} (shared memory; rope::KindScalars).
enum class UnitPass { kRows, kTokenSums, kTokenRows };

/// One unit: loads, dx of its K rows, stores; with `sums`, adds the rows' gw * n to them. The
/// norm weights come from `weight_rows` (rope::SharedWeights, shared memory: [2][D], [Hq*D +
/// Hkv*D] under a token-wide norm; configurations that may have weights); with `fill_weights`
/// (block-uniform) the block fills them once its loads are issued and waits for the copy (a
/// barrier) before the math. `token_scalars`, `token_sums`: the token-wide norm's passes only
/// (UnitPass). Every lane of the warp must call it (shuffles). `in`: p.in as the kernel sees it
/// (Fixed::known).
template <class Config, class Geom, typename AngleT, int K, bool kExactWidth,
          UnitPass kPass = UnitPass::kRows>
__device__ __forceinline__ void backward_unit(const BackwardArgs& p, const rope::RopeInputs& in,
                                              int64_t unit, int lane,
                                              const rope::LaneChunks<Geom>& lanes,
                                              const rope::Partners<Geom>& partners,
                                              float* weight_rows, bool fill_weights,
                                              const rope::WeightGradSums* sums,
                                              const float* token_scalars,
                                              float (&token_sums)[4]) {
  using Fix = rope::Fixed<Config>;
  constexpr int V = Geom::V;
  constexpr int C = Geom::C;
  const int64_t t = unit / p.row_sets;
  const int set = int(unit - t * p.row_sets);
  // Groups past the last unit load and store nothing but still execute every shuffle.
  const bool token_ok = unit < p.units;
  const int heads2 = in.dims.q_heads + in.dims.kv_heads;
  const int D = rope::row_width<Geom, kExactWidth>(in.dims.head_dim);
  const auto width = rope::row_width_divisor<Geom, kExactWidth>(D);
  const bool exchange = rope::exchanges_partners<V>(in);
  const int64_t qk_row_step = int64_t(p.row_sets) * in.qk_stride_h;
  const uint16_t* qk_token = in.qk + t * in.qk_stride_t + int64_t(set) * in.qk_stride_h;
  // Rotary alone (no norm, no weights) never reads the saved rows: dx = gw (reads_saved_rows).
  const bool read_x = rope::reads_saved_rows(in);

  // ---- loads: g and x of every row of the set, g_next of key rows, the angles ----
  Chunk<V> g[K][C];
  Chunk<V> x[K][C];
  Chunk<V> g_next[K][C];
  using Angles = rope::TokenAngles<Geom, AngleT, Config>;
  Angles angles;
  const int angle_offset = qkvfuse::rope::place(in.dims, t, set).angle_offset;
  // Issue order, for ptxas's schedule: the factor-table kernels of interleaved pairs without
  // weights load the angles first at C = 3 and under key offset, so that every row load precedes
  // the rstd shuffles; at one chunk per lane they keep the rows first (their SASS as measured;
  // perf_notes.md). The others issue the token's position, then the rows, then the angles: a
  // cos/sin cache's row waits for the position, the rows need not.
  constexpr bool kAnglesFirst =
      Fix::kTablesOnly && Fix::kChunkRotation && (Geom::C == 3 || Fix::kKeyOffset);
  const int row = Angles::cache_row(in, t, token_ok);
  if constexpr (kAnglesFirst) {
    angles.load(in, t, row, angle_offset, lanes, token_ok, /*backward=*/true);
  }
  // Every row's gradient address before any load: place()'s paired branch then precedes the
  // loads instead of splitting them into blocks (ptxas kept the second row's loads behind the
  // first row's shuffles).
  const uint16_t* g_rows[K];
  int64_t g_strides[K];
  bool row_is_key[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const qkvfuse::rope::Place at = qkvfuse::rope::place(in.dims, t, set + p.row_sets * k);
    row_is_key[k] = at.is_key;
    g_strides[k] = at.is_key ? p.grad.k_stride_t : p.grad.q_stride_t;
    const int64_t stride_h = at.is_key ? p.grad.k_stride_h : p.grad.q_stride_h;
    g_rows[k] = (at.is_key ? p.grad.k : p.grad.q) + at.token * g_strides[k] +
                int64_t(at.head) * stride_h;
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int head2 = set + p.row_sets * k;
    const bool row_ok = token_ok && head2 < heads2;
    const bool is_key = row_is_key[k];
    const uint16_t* g_row = g_rows[k];
    const int64_t stride_t = g_strides[k];
    // Key offset: g at t+1 of the same key head, for the lanes >= r.
    const bool shift_row = in.key_offset && is_key;
    const bool next_ok = shift_row && row_ok && t + 1 < in.tokens;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const bool ok = row_ok && lanes.ok[c];
      // Key offset: key grads are read twice (as g here, as g_next by the unit of t-1): cached.
      g[k][c] = shift_row
                    ? rope::load_chunk_if<rope::Load::kCached, V>(ok, g_row + lanes.d0[c])
                    : rope::load_chunk_if<rope::Load::kStream, V>(ok, g_row + lanes.d0[c]);
      x[k][c] = rope::load_chunk_if<rope::Load::kStream, V>(ok && read_x,
                                                             qk_token + k * qk_row_step +
                                                                 lanes.d0[c]);
      g_next[k][c] = rope::load_chunk_if<rope::Load::kCached, V>(
          next_ok && lanes.ok[c] && lanes.rot_end[c] < V, g_row + stride_t + lanes.d0[c]);
    }
  }
  if constexpr (!kAnglesFirst) {
    angles.load(in, t, row, angle_offset, lanes, token_ok, /*backward=*/true);
  }
  const rope::SharedWeights weights{weight_rows, kPass == UnitPass::kRows
                                                     ? rope::WeightLanes::per_head(D)
                                                     : rope::WeightLanes::per_token(in.dims, D)};
  if constexpr (!Fix::kWeightless) {
    if (fill_weights) {
      rope::SharedWeights::fill(in, weights.at, weight_rows);
      __syncthreads();
    }
  }

  // ---- per row: dx, store ----
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int head2 = set + p.row_sets * k;
    const bool is_key = head2 >= in.dims.q_heads;
    const bool shift_row = in.key_offset && is_key;
    // Rows past the unit's heads (loads 0, the token's angles) add nothing to the sums.
    const bool row_ok = token_ok && head2 < heads2;
    const int head = is_key ? head2 - in.dims.q_heads : head2;
    float dx[C][V];
    constexpr bool kBranchFree = backward_branch_free<Geom, Fix::kKeyOffset>();
    if constexpr (kPass == UnitPass::kTokenSums) {
      // dn without the norm (gw * w), then the lane's sums of x^2 and dn * x.
      rope::RopeInputs raw = in;
      raw.normalize = false;
      rope::backward_row<Geom, Config, kBranchFree>(
          raw, g[k], x[k], angles, g_next[k], lanes, partners, exchange,
          Fix::kWeightless ? nullptr : &weights, nullptr, head, is_key, false, shift_row, t == 0,
          width, dx);
      float squares = 0.0f;
      float dots = 0.0f;
#pragma unroll
      for (int c = 0; c < C; ++c) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
          squares = fmaf(x[k][c][i], x[k][c][i], squares);
          dots = fmaf(dx[c][i], x[k][c][i], dots);
        }
      }
      // Selects, not an index: the sums stay in registers. Absent rows add nothing (their g is
      // 0, but a NaN angle of the token would make their dn NaN).
      token_sums[0] += row_ok && !is_key ? squares : 0.0f;
      token_sums[1] += row_ok && is_key ? squares : 0.0f;
      token_sums[2] += row_ok && !is_key ? dots : 0.0f;
      token_sums[3] += row_ok && is_key ? dots : 0.0f;
      continue;
    }
    if constexpr (kPass == UnitPass::kTokenRows) {
      rope::backward_row<Geom, Config, kBranchFree>(
          in, g[k], x[k], angles, g_next[k], lanes, partners, exchange,
          Fix::kWeightless ? nullptr : &weights, sums, head, is_key, row_ok, shift_row, t == 0,
          width, dx,
          rope::KindScalars{true, token_scalars[is_key ? 1 : 0], token_scalars[is_key ? 3 : 2]});
    } else {
      rope::backward_row<Geom, Config, kBranchFree>(
          in, g[k], x[k], angles, g_next[k], lanes, partners, exchange,
          Fix::kWeightless ? nullptr : &weights, sums, head, is_key, row_ok, shift_row, t == 0,
          width, dx);
    }
    if (!row_ok) continue;
    uint16_t* out = p.grad_qk + (t * heads2 + head2) * int64_t(D);
#pragma unroll
    for (int c = 0; c < C; ++c) {
      if (lanes.ok[c]) rope::store_chunk(out + lanes.d0[c], rope::to_bf16<V>(dx[c]));
    }
  }
}

/// SPEC.md section 9's token-wide norm (norm_scope kToken; the general kernel): the block takes
/// p.tokens_per_block tokens one after the other, its lane groups each token's rows in turns (one
/// row per unit; rope::plan_token_work: row s is lane group s mod kGroups's, so each weight's
/// gradient column is one lane's, whatever the token). Per token a first pass sums each kind's x^2
/// and dn * x (dn = gw * w needs no rstd) over the lane's rows, then the group's butterfly, then
/// the groups' sums in group order in shared memory (every thread gets the same bits): rstd of the
/// kind, and its correction sum(dn * n) / (H*D) = rstd * sum(dn * x) / (H*D). A second pass runs
/// the rows with these (rope::KindScalars, read from shared memory by each row: held in registers
/// across the loop they made the kernels spill), adding gw * n into the block's one row of
/// gradient sums [Hq*D + Hkv*D], which becomes its partial row. Shared memory: the weights [W],
/// the sums [W] (with weights), the groups' sums [kGroups][4], the token's scalars [4]. Every
/// thread of the block takes part (barriers).
template <class Config, class Geom, typename AngleT, int kGroups>
__device__ __forceinline__ void backward_token_rows(const BackwardArgs& p) {
  using Fix = rope::Fixed<Config>;
  constexpr int G = Geom::G;
  const int lane = int(threadIdx.x) % G;
  const int group = int(threadIdx.x) / G;
  const int D = p.in.dims.head_dim;
  const rope::RopeInputs in = Fix::known(p.in, D);
  const rope::WeightLanes weight_lanes = rope::WeightLanes::per_token(in.dims, D);
  const int weight_floats = weight_lanes.floats;
  const bool weighted = p.partials != nullptr;
  extern __shared__ __align__(16) float token_shared[];
  float* block_sums = token_shared + weight_floats;
  float* group_sums = block_sums + (weighted ? weight_floats : 0);
  float* token_scalars = group_sums + 4 * kGroups;
  if constexpr (!Fix::kWeightless) rope::SharedWeights::fill(in, weight_lanes, token_shared);
  if (weighted) {
    for (int i = int(threadIdx.x); i < weight_floats; i += kGroups * G) block_sums[i] = 0.0f;
  }
  __syncthreads();
  const rope::WeightGradSums sums{weighted ? block_sums : nullptr};
  const int turns = p.row_sets / kGroups;  // the group's rows of a token
  const int64_t first = int64_t(blockIdx.x) * p.tokens_per_block;
#pragma unroll 1
  for (int64_t t = first; t < first + p.tokens_per_block; ++t) {  // block-uniform
    float token_sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 1
    for (int turn = 0; turn < turns; ++turn) {
      // An opaque copy of the lane keeps the compiler from hoisting the lane's chunk and partner
      // tables out of the loop, where they held registers across the turns.
      int turn_lane = lane;
      asm volatile("" : "+r"(turn_lane));
      const rope::LaneChunks<Geom> lanes(turn_lane, D, in.dims.rotary_dim, Fix::kAllRotary);
      const rope::Partners<Geom> partners(lanes, turn_lane, in.dims.rotary_dim, in.dims.neox);
      backward_unit<Config, Geom, AngleT, 1, false, UnitPass::kTokenSums>(
          p, in, t * p.row_sets + group + turn * kGroups, turn_lane, lanes, partners,
          token_shared, false, nullptr, nullptr, token_sums);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) token_sums[i] = rope::group_sum<G>(token_sums[i]);
    if (lane == 0) {
#pragma unroll
      for (int i = 0; i < 4; ++i) group_sums[4 * group + i] = token_sums[i];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      // The groups' sums in group order; then rstd and sum(dn * n) / (H*D) of each kind.
      float total[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (int g = 0; g < kGroups; ++g) {
#pragma unroll
        for (int i = 0; i < 4; ++i) total[i] = __fadd_rn(total[i], group_sums[4 * g + i]);
      }
      const float q_values = float(in.dims.q_heads * D);
      const float k_values = float(max(in.dims.kv_heads, 1) * D);
      const float q_rstd = rope::rstd_of_mean(__fdiv_rn(total[0], q_values), in.eps);
      const float k_rstd = rope::rstd_of_mean(__fdiv_rn(total[1], k_values), in.eps);
      token_scalars[0] = in.normalize ? q_rstd : 1.0f;
      token_scalars[1] = in.normalize ? k_rstd : 1.0f;
      token_scalars[2] = __fmul_rn(q_rstd, __fdiv_rn(total[2], q_values));
      token_scalars[3] = __fmul_rn(k_rstd, __fdiv_rn(total[3], k_values));
    }
    __syncthreads();  // the scalars are written, the groups' sums read
#pragma unroll 1
    for (int turn = 0; turn < turns; ++turn) {
      int turn_lane = lane;
      asm volatile("" : "+r"(turn_lane));
      const rope::LaneChunks<Geom> lanes(turn_lane, D, in.dims.rotary_dim, Fix::kAllRotary);
      const rope::Partners<Geom> partners(lanes, turn_lane, in.dims.rotary_dim, in.dims.neox);
      backward_unit<Config, Geom, AngleT, 1, false, UnitPass::kTokenRows>(
          p, in, t * p.row_sets + group + turn * kGroups, turn_lane, lanes, partners,
          token_shared, false, &sums, token_scalars, token_sums);
    }
  }
  if (weighted) {
    rope::write_partial_row<1, kGroups * G>(in.dims.q_heads + in.dims.kv_heads, D, block_sums,
                                            p.partials);
  }
}

/// Config: the configuration (rope_dispatch.hpp); kExactWidth: rows of exactly Geom's full width.
/// With weights (p.partials) a block walks the units of p.tokens_per_block tokens in turns of its
/// lane groups, then writes its partial row of the weights' gradient sums; else each lane group
/// takes one unit.
template <class Config, class Geom, typename AngleT, bool kExactWidth>
__global__ void __launch_bounds__(BackwardPolicy<Config, Geom, AngleT>::kThreads,
                                  BackwardPolicy<Config, Geom, AngleT>::min_blocks())
    qk_norm_rope_backward_kernel(const __grid_constant__ BackwardArgs p) {
  using Policy = BackwardPolicy<Config, Geom, AngleT>;
  using Fix = rope::Fixed<Config>;
  constexpr int G = Geom::G;
  constexpr int kGroups = Policy::kThreads / G;
  if constexpr (!Fix::kNoVNorm) {
    if (p.s9.normalize_v && int64_t(blockIdx.x) >= p.v_first_block) {  // block-uniform
      backward_v_rows<Geom, Policy::rows_per_group()>(p, Policy::kThreads);
      return;
    }
  }
  const int D = rope::row_width<Geom, kExactWidth>(p.in.dims.head_dim);
  // The inputs with what the configuration fixes as constants (a token-wide norm: the kernel
  // below).
  const rope::RopeInputs in = Fix::known(p.in, D);
  const int lane = int(threadIdx.x) % G;
  const int group = int(threadIdx.x) / G;
  const rope::LaneChunks<Geom> lanes(lane, D, in.dims.rotary_dim, Fix::kAllRotary);
  const rope::Partners<Geom> partners(lanes, lane, in.dims.rotary_dim, in.dims.neox);
  // Shared memory, configurations that may have weights: the norm weights [2][D], then the lane
  // groups' weight-gradient sums [kGroups][2][D].
  extern __shared__ __align__(16) float shared_rows[];
  float* group_sums = shared_rows + 2 * D;

  constexpr int K = Policy::rows_per_group();
  float no_sums[4] = {};  // (the token-wide norm's first pass only)
  if constexpr (Fix::kWeightless) {
    backward_unit<Config, Geom, AngleT, K, kExactWidth>(
        p, in, int64_t(blockIdx.x) * kGroups + group, lane, lanes, partners, shared_rows,
        /*fill_weights=*/false, nullptr, nullptr, no_sums);
  } else {
    const bool weighted = Fix::kSpec.weights.only(rope::Weights::kWeighted) || p.partials != nullptr;
    // Null rows without weights: one object either way, so that it stays in registers.
    const rope::WeightGradSums sums{weighted ? group_sums + group * 2 * D : nullptr};
    if (weighted) sums.clear(lanes, D);
    // The block's units, in turns of kGroups; the trip count is the same for every group, so the
    // loop stays warp-uniform (units past the block's end load nothing).
    const int64_t per_block =
        weighted ? int64_t(p.tokens_per_block) * p.row_sets : int64_t(kGroups);
    const int64_t first = int64_t(blockIdx.x) * per_block;
    const int64_t last = first + per_block < p.units ? first + per_block : p.units;
    const int64_t turns = (per_block + kGroups - 1) / kGroups;
#pragma unroll 1
    for (int64_t turn = 0; turn < turns; ++turn) {
      const int64_t unit = first + turn * kGroups + group;
      backward_unit<Config, Geom, AngleT, K, kExactWidth>(
          p, in, unit < last ? unit : p.units, lane, lanes, partners, shared_rows, turn == 0,
          &sums, nullptr, no_sums);
    }
    if (weighted) {
      rope::write_partial_row<kGroups, Policy::kThreads>(2, D, group_sums, p.partials);
    }
  }
}

/// A token-wide norm's kernel (backward_token_rows): the Section9 configuration's geometries, the
/// angles' dtype read at run time (one kernel for both).
template <class Config, class Geom>
__global__ void __launch_bounds__(
    BackwardPolicy<Config, Geom, rope::RunTimeAngles>::kThreads,
    BackwardPolicy<Config, Geom, rope::RunTimeAngles>::token_min_blocks())
    qk_norm_rope_backward_token_kernel(const __grid_constant__ BackwardArgs p) {
  constexpr int kGroups = BackwardPolicy<Config, Geom, rope::RunTimeAngles>::kThreads / Geom::G;
  backward_token_rows<Config, Geom, rope::RunTimeAngles, kGroups>(p);
}

/// A token-wide norm (SPEC.md section 9): blocks of kTokensPerTokenBlock tokens, one after the
/// other (backward_token_rows); shared memory: the norm weights and, with weights, their
/// gradient sums ([Hq*D + Hkv*D] floats each), the groups' sums [kGroups][4], the token's
/// scalars [4].
template <class Config, class Geom>
void launch_backward_tokens(BackwardArgs args, cudaStream_t stream) {
  using Policy = BackwardPolicy<Config, Geom, rope::RunTimeAngles>;
  constexpr int kGroups = Policy::kThreads / Geom::G;
  constexpr auto kernel = qk_norm_rope_backward_token_kernel<Config, Geom>;
  const rope::RowWork work = rope::plan_token_work(
      args.in.tokens, args.in.dims.q_heads + args.in.dims.kv_heads, 1, kGroups);
  args.row_sets = work.row_sets;
  args.units = work.units;
  if (!rope::has_weights_args(args.in)) args.partials = nullptr;
  args.tokens_per_block = rope::kTokensPerTokenBlock;
  const int64_t blocks = (args.in.tokens + args.tokens_per_block - 1) / args.tokens_per_block;
  const size_t weight_floats =
      size_t(rope::WeightLanes::per_token(args.in.dims, args.in.dims.head_dim).floats);
  const size_t smem =
      (weight_floats * (args.partials != nullptr ? 2 : 1) + 4 * size_t(kGroups) + 4) *
      sizeof(float);
  rope::allow_shared_memory("qk_norm_rope_backward", kernel, smem);
  kernel<<<dim3(rope::grid_size("qk_norm_rope_backward", blocks, args.in.tokens)),
           dim3(Policy::kThreads), smem, stream>>>(args);
  QKVF_CUDA_CHECK_LAUNCH("qk_norm_rope_backward_token_kernel");
}

template <class Config, class Geom, typename AngleT, bool kExactWidth>
void launch_backward(BackwardArgs args, cudaStream_t stream) {
  if constexpr (!rope::Fixed<Config>::kHeadScope) {
    if (args.s9.token_scope) return launch_backward_tokens<Config, Geom>(args, stream);
  }
  using Policy = BackwardPolicy<Config, Geom, AngleT>;
  constexpr int kGroups = Policy::kThreads / Geom::G;
  constexpr auto kernel = qk_norm_rope_backward_kernel<Config, Geom, AngleT, kExactWidth>;
  const int64_t heads2 = args.in.dims.q_heads + args.in.dims.kv_heads;
  const rope::RowWork work = rope::plan_row_work(args.in.tokens, heads2, Policy::rows_per_group());
  args.row_sets = work.row_sets;
  args.units = work.units;
  // Shared memory (configurations that may have weights): the norm weights, [2][D] floats, and
  // with weights the group sums, [kGroups][2][D].
  const size_t row_floats = 2 * size_t(args.in.dims.head_dim);
  size_t smem = rope::Fixed<Config>::kWeightless ? 0 : row_floats * sizeof(float);
  int64_t blocks = 0;
  if (rope::has_weights_args(args.in)) {
    args.tokens_per_block = int(tokens_per_weight_block(heads2));
    blocks = (args.in.tokens + args.tokens_per_block - 1) / args.tokens_per_block;
    smem += size_t(kGroups) * row_floats * sizeof(float);
  } else {
    args.partials = nullptr;
    args.tokens_per_block = 0;
    blocks = (work.units + kGroups - 1) / kGroups;
  }
  if constexpr (!rope::Fixed<Config>::kNoVNorm) {
    if (args.s9.normalize_v) {
      // The V rows' blocks after the Q/K blocks (K rows per lane group).
      args.v_first_block = blocks;
      constexpr int64_t kRows = Policy::rows_per_group();
      const int64_t v_units = (args.in.tokens * args.in.dims.kv_heads + kRows - 1) / kRows;
      blocks += (v_units + kGroups - 1) / kGroups;
    }
  }
  kernel<<<dim3(rope::grid_size("qk_norm_rope_backward", blocks, args.in.tokens)),
           dim3(Policy::kThreads), smem, stream>>>(args);
  QKVF_CUDA_CHECK_LAUNCH("qk_norm_rope_backward_kernel");
}

/// Partial rows with weights: one per block of tokens_per_weight_block tokens (of
/// kTokensPerTokenBlock under a token-wide norm).
int64_t weight_blocks(const QkNormRopeBackwardParams& params) {
  const int64_t heads2 = params.qk.sizes[1];
  const int64_t per_block = params.layout.norm_scope == NormScope::kToken
                                ? rope::kTokensPerTokenBlock
                                : tokens_per_weight_block(heads2);
  return (params.qk.sizes[0] + per_block - 1) / per_block;
}

/// The norm weights' gradient sums of the call into its weights' gradients.
void reduce_weight_grads(const QkNormRopeBackwardParams& params, int64_t partial_rows,
                         cudaStream_t stream) {
  const int64_t D = params.qk.sizes[2];
  weight_grad::reduce(static_cast<float*>(params.workspace.data), partial_rows,
                      int(rope::weight_lanes(params.layout, D, false)),
                      int(rope::weight_lanes(params.layout, D, true)), params.grad_q_weight,
                      params.grad_k_weight, stream);
}

}  // namespace

int64_t backward_workspace_size(const QkNormRopeBackwardParams& params) {
  const int64_t D = params.qk.sizes[2];
  return weight_grad::workspace_floats(weight_blocks(params),
                                       rope::weight_lanes(params.layout, D, false) +
                                           rope::weight_lanes(params.layout, D, true));
}

void qk_norm_rope_backward(const QkNormRopeBackwardParams& params) {
  DeviceGuard guard(params.qk.device);
  const RopeLayout& layout = params.layout;
  const bool weighted = rope::has_weights(layout);
  const cudaStream_t stream = to_cuda(params.stream);
  float* workspace = static_cast<float*>(params.workspace.data);
  if (params.qk.size(0) == 0) {
    // Nothing to compute; the weight gradients of no rows are zeros.
    if (weighted) reduce_weight_grads(params, 0, stream);
    return;
  }
  const BackwardArgs args{.in = rope::make_rope_inputs(layout, params.qk),
                          .grad = rope::make_grad_rows(params.grad_q, params.grad_k),
                          .grad_qk = static_cast<uint16_t*>(params.grad_qk.data),
                          .partials = workspace,
                          .row_sets = 0,
                          .units = 0,
                          .tokens_per_block = 0,
                          .s9 = rope::make_section9_inputs(layout, params.v),
                          .grad_v_out = static_cast<const uint16_t*>(params.grad_v_out.data),
                          .grad_v_out_stride_t = params.grad_v_out.strides[0],
                          .grad_v_out_stride_h = params.grad_v_out.strides[1],
                          .grad_v = static_cast<uint16_t*>(params.grad_v.data),
                          .v_first_block = 0};
  rope::dispatch<Op::kBackward>(
      "qk_norm_rope_backward", rope::rope_key(params),
      [&](auto config, auto geometry, auto angle, auto exact) {
        launch_backward<decltype(config), decltype(geometry), typename decltype(angle)::type,
                        decltype(exact)::value>(args, stream);
      });
  if (weighted) reduce_weight_grads(params, weight_blocks(params), stream);
}

}  // namespace qkvfuse::cuda
