// qk_norm_rope.cu: QK-norm + rotary, forward (SPEC.md sections 1 and 8), CUDA backend.
//
// Math, per input row (token t, input head h2 in [0, Hq + Hkv)), fp32 (rope_rows.cuh):
//   n  = x * rstd, rstd = 1 / sqrt(sum(x^2) / D + eps)       (normalize = false: n = x)
//   nw = n * (w + offset)                                    (the row's weight, if any)
//   y[d] = f1[d] * nw[d] + f2[d] * nw[p(d)]  for d < r;  y[d] = nw[d]  for d >= r
//   key offset (keys, t > 0, d >= r): y[d] = nw of token t-1 (same head)
// placed by rope_math.hpp (plain: q/k[t, h]; paired: q/k[2t + h / (H/2), h mod (H/2)]), each
// element rounded to bf16 once.
//
// Kernels: one template for the whole family (rope_dispatch.hpp's table and rope_config.cuh's
// dispatcher pick the configuration and the launch policy), instantiated for the configurations,
// geometries and angle dtypes the table lists.
//
// Design. The op is pure streaming (read qk and the angle rows, write q and k: about 327 MB at
// the speedrun's T = 49152, H = 6, D = 128), so the kernel is built to keep HBM busy and touch
// each byte once:
// - A row is owned by a lane group of G lanes, V elements per lane per chunk (rope_common.cuh):
//   every load and store is a coalesced vector, the row sums are a few shuffles.
// - A lane group owns one work unit: a set of K input heads (s, s+NS, ...) of one token. It
//   issues the loads of all K rows and of the token's angles before using any, computes, stores
//   and exits. The angles are loaded once per unit, not once per row.
// - The grid is one lane group per unit (rope::plan_row_work), not a persistent walk: tens of
//   thousands of short blocks keep every SM at its occupancy limit with all their loads in
//   flight, which is what streaming kernels need on Hopper (perf_notes.md).
// - Key offset without re-reading: the group that normalizes key row (t, h) also writes the
//   lanes >= r of key row (t+1, h), which are exactly its nw (bf16), and writes only the rotary
//   lanes of its own row (all lanes at t = 0). Every output byte is written exactly once by one
//   thread, so results are deterministic.
// - The V norm (SPEC.md section 9, normalize_v; the Section9 configuration's kernels only):
//   blocks after the Q/K units' take the rows of v, K per lane group, in the same row geometry
//   (its width class covers Dv): v_out = v * rstd(v). A block takes either kind of row, so the
//   branch is block-uniform.
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

namespace qkvfuse::cuda {
namespace {

using rope::Chunk;
using rope::Op;

/// Everything the forward kernel reads, by value in constant memory.
struct ForwardArgs {
  rope::RopeInputs in;
  uint16_t* q;      ///< [T, Hq, D] ([2T, Hq/2, D] paired) bf16, row-major contiguous
  uint16_t* k;      ///< [T, Hkv, D] likewise, its own allocation
  int row_sets;     ///< NS, even: unit u = t * NS + s owns heads {s, s+NS, ...} of token t
  int64_t units;    ///< T * NS
  // SPEC.md section 9 (the Section9 configuration's kernels only; after what the kernels of
  // sections 1-8 read, which so keep their parameter offsets)
  rope::Section9Inputs s9;
  uint16_t* v_out;        ///< s9.normalize_v: [T, Hkv, Dv] bf16, row-major contiguous: row
                          ///< r = t*Hkv + h at r*Dv
  int64_t v_first_block;  ///< blocks from here on take V rows
  int tokens_per_block;   ///< a token-wide norm (s9.token_scope): the tokens of a block
};

template <class Config, class Geom, typename AngleT>
using ForwardPolicy = rope::Policy<Op::kForward, Config, Geom, AngleT>;

/// The V norm's rows of block blockIdx.x >= p.v_first_block: K consecutive rows r = t*Hkv + h of
/// v per lane group, all loads first; v_out = v * rstd(v). Every lane of the block takes part.
template <class Geom, int K>
__device__ __forceinline__ void forward_v_rows(const ForwardArgs& p, int threads) {
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
  Chunk<V> x[K][C];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t row = unit * K + k;
    const bool row_ok = row < rows;
    const int64_t t = row_ok ? row / kv : 0;
    const uint16_t* src = p.s9.v + t * p.s9.v_stride_t + (row - t * kv) * p.s9.v_stride_h;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      x[k][c] = rope::load_chunk_if<rope::Load::kStream, V>(row_ok && lanes.ok[c],
                                                             src + lanes.d0[c]);
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float y[C][V];
    rope::v_norm_forward<Geom>(x[k], width, p.in.eps, y);  // all lanes: shuffles
    const int64_t row = unit * K + k;
    if (row >= rows) continue;
    uint16_t* out = p.v_out + row * Dv;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      if (lanes.ok[c]) rope::store_chunk(out + lanes.d0[c], rope::to_bf16<V>(y[c]));
    }
  }
}

/// A token-wide norm's second pass over row head2 of token t (SPEC.md section 9): what the per-head
/// kernel does to a row (qk_norm_rope_kernel: the loads, the angles, forward_row, the stores in
/// the same placement, key offset included), with `rstd` its kind's over the token. One row per
/// call. Every lane of the warp must call it (shuffles).
template <class Config, class Geom, typename AngleT>
__device__ __forceinline__ void forward_token_row(const ForwardArgs& p, const rope::RopeInputs& in,
                                                  int D, int64_t t, int head2, bool token_ok,
                                                  int lane, const rope::SharedWeights& weights,
                                                  float rstd) {
  using Fix = rope::Fixed<Config>;
  constexpr int V = Geom::V;
  constexpr int C = Geom::C;
  const rope::LaneChunks<Geom> lanes(lane, D, in.dims.rotary_dim, Fix::kAllRotary);
  const bool exchange = rope::exchanges_partners<V>(in);
  const rope::Partners<Geom> partners(lanes, lane, in.dims.rotary_dim, in.dims.neox);
  const bool row_ok = token_ok && head2 < in.dims.q_heads + in.dims.kv_heads;
  using Angles = rope::TokenAngles<Geom, AngleT, Config>;
  const int cache_row = Angles::cache_row(in, t, token_ok);
  const uint16_t* x_row = in.qk + t * in.qk_stride_t + int64_t(head2) * in.qk_stride_h;
  Chunk<V> x[C];
#pragma unroll
  for (int c = 0; c < C; ++c) {
    x[c] = rope::load_chunk_if<rope::Load::kStream, V>(row_ok && lanes.ok[c], x_row + lanes.d0[c]);
  }
  Angles angles;
  angles.load(in, t, cache_row, qkvfuse::rope::place(in.dims, t, head2).angle_offset, lanes,
              token_ok, /*backward=*/false);
  const bool is_key = head2 >= in.dims.q_heads;
  const int heads = is_key ? in.dims.kv_heads : in.dims.q_heads;
  const int h = is_key ? head2 - in.dims.q_heads : head2;
  const int64_t out_token_step = int64_t(heads) * D;
  uint16_t* out = (is_key ? p.k : p.q) + t * out_token_step + int64_t(h) * D;
  const auto store = [&](int c, const Chunk<V>& y, const Chunk<V>& nw) {
    if (!(row_ok && lanes.ok[c])) return;
    if (in.key_offset && is_key) {
      // As the per-head kernel: the own row's rotary lanes (all at t = 0), the next token's
      // lanes >= r.
      rope::store_chunk_range(out + lanes.d0[c], y, 0, t == 0 ? V : lanes.rot_end[c]);
      if (t + 1 < in.tokens && lanes.rot_end[c] < V) {
        rope::store_chunk_range(out + out_token_step + lanes.d0[c], nw, lanes.rot_end[c], V);
      }
    } else {
      rope::store_chunk(out + lanes.d0[c], y);
    }
  };
  rope::forward_row<Geom, Config>(in, x, rstd, weights, is_key, h, angles, lanes, partners,
                                  exchange, store);  // shuffles
}

/// SPEC.md section 9's token-wide norm (norm_scope kToken; the general kernel): the block takes
/// p.tokens_per_block tokens, one after the other. The lane groups take a token's rows in turns
/// (rope::plan_token_work with one row per unit: row s by group s mod groups; one row at a time
/// keeps the loop within the kernel's registers); a first pass sums each kind's squares (a lane's
/// partials, the group's butterfly, then the groups' sums in group order in shared memory: the
/// same bits on every run), a second pass normalizes the rows with their kind's rstd
/// (forward_token_row, rows reloaded from L1 / L2) and weights [H*D] (rope::WeightLanes). Every
/// thread of the block takes part (barriers).
template <class Config, class Geom, typename AngleT>
__device__ __forceinline__ void forward_token_rows(const ForwardArgs& p, int threads) {
  using Fix = rope::Fixed<Config>;
  constexpr int G = Geom::G;
  constexpr int V = Geom::V;
  constexpr int C = Geom::C;
  const int groups = threads / G;
  const int lane = int(threadIdx.x) % G;
  const int group = int(threadIdx.x) / G;
  const int D = p.in.dims.head_dim;
  const rope::RopeInputs in = Fix::known(p.in, D);
  const int heads2 = in.dims.q_heads + in.dims.kv_heads;
  // Shared memory: the norm weights [Hq*D + Hkv*D], the groups' sums [groups][2], the token's
  // rstd of each kind [2] (read by each row: in registers across the loop they cost spills).
  extern __shared__ __align__(16) float token_shared[];
  const rope::WeightLanes weight_lanes = rope::WeightLanes::per_token(in.dims, D);
  float* group_sums = token_shared + weight_lanes.floats;
  float* token_rstd = group_sums + 2 * groups;
  const rope::SharedWeights weights{token_shared, weight_lanes};
  if constexpr (!Fix::kWeightless) {
    rope::SharedWeights::fill(in, weight_lanes, token_shared);
    __syncthreads();
  }
  const int turns = p.row_sets / groups;  // the group's rows of a token
  const int64_t first = int64_t(blockIdx.x) * p.tokens_per_block;
#pragma unroll 1
  for (int64_t t = first; t < first + p.tokens_per_block; ++t) {  // block-uniform
    const bool token_ok = t < in.tokens;
    // ---- pass 1: the kinds' sums of squares ----
    float sums[2] = {0.0f, 0.0f};
#pragma unroll 1
    for (int turn = 0; turn < turns; ++turn) {
      const int head2 = group + turn * groups;
      const rope::LaneChunks<Geom> lanes(lane, D, 0);
      const uint16_t* x_row = in.qk + t * in.qk_stride_t + int64_t(head2) * in.qk_stride_h;
      float partial = 0.0f;
#pragma unroll
      for (int c = 0; c < C; ++c) {
        // Cached: the second pass reads the row again.
        const Chunk<V> x = rope::load_chunk_if<rope::Load::kCached, V>(
            token_ok && head2 < heads2 && lanes.ok[c], x_row + lanes.d0[c]);
#pragma unroll
        for (int i = 0; i < V; ++i) partial = fmaf(x[i], x[i], partial);
      }
      // Selects, not an index: the sums stay in registers.
      const bool is_key = head2 >= in.dims.q_heads;
      sums[0] += is_key ? 0.0f : partial;
      sums[1] += is_key ? partial : 0.0f;
    }
    sums[0] = rope::group_sum<G>(sums[0]);
    sums[1] = rope::group_sum<G>(sums[1]);
    if (lane == 0) {
      group_sums[2 * group] = sums[0];
      group_sums[2 * group + 1] = sums[1];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float total[2] = {0.0f, 0.0f};
      for (int g = 0; g < groups; ++g) {  // group order: the same bits on every run
        total[0] = __fadd_rn(total[0], group_sums[2 * g]);
        total[1] = __fadd_rn(total[1], group_sums[2 * g + 1]);
      }
      const float q_values = float(in.dims.q_heads * D);
      const float k_values = float(max(in.dims.kv_heads, 1) * D);
      token_rstd[0] = in.normalize ? rope::rstd_of_mean(__fdiv_rn(total[0], q_values), in.eps) : 1.0f;
      token_rstd[1] = in.normalize ? rope::rstd_of_mean(__fdiv_rn(total[1], k_values), in.eps) : 1.0f;
    }
    __syncthreads();  // the rstd are written, the groups' sums read
    // ---- pass 2: the rows ----
#pragma unroll 1
    for (int turn = 0; turn < turns; ++turn) {
      // An opaque copy of the lane keeps the compiler from hoisting the lane's chunk and partner
      // tables (forward_token_row) out of the loop, where they held registers across the turns.
      int turn_lane = lane;
      asm volatile("" : "+r"(turn_lane));
      const int head2 = group + turn * groups;
      forward_token_row<Config, Geom, AngleT>(p, in, D, t, head2, token_ok, turn_lane, weights,
                                              token_rstd[head2 >= in.dims.q_heads ? 1 : 0]);
    }
  }
}

/// Config: the configuration (rope_dispatch.hpp); kExactWidth: rows of exactly Geom's full width,
/// D a compile-time constant.
template <class Config, class Geom, typename AngleT, bool kExactWidth>
__global__ void __launch_bounds__(ForwardPolicy<Config, Geom, AngleT>::kThreads,
                                  ForwardPolicy<Config, Geom, AngleT>::min_blocks())
    qk_norm_rope_kernel(const __grid_constant__ ForwardArgs p) {
  using Policy = ForwardPolicy<Config, Geom, AngleT>;
  using Fix = rope::Fixed<Config>;
  constexpr int G = Geom::G;
  constexpr int V = Geom::V;
  constexpr int C = Geom::C;
  constexpr int K = Policy::rows_per_group();
  if constexpr (!Fix::kNoVNorm) {
    if (p.s9.normalize_v && int64_t(blockIdx.x) >= p.v_first_block) {  // block-uniform
      forward_v_rows<Geom, K>(p, Policy::kThreads);
      return;
    }
  }
  const int lane = int(threadIdx.x) % G;
  const int64_t unit = int64_t(blockIdx.x) * (Policy::kThreads / G) + threadIdx.x / G;
  const int64_t t = unit / p.row_sets;
  const int set = int(unit - t * p.row_sets);
  // Groups past the last unit (the last block only) load nothing and store nothing, but still
  // execute every shuffle: the row sums use full-warp masks.
  const bool token_ok = unit < p.units;
  const int heads2 = p.in.dims.q_heads + p.in.dims.kv_heads;
  const int D = rope::row_width<Geom, kExactWidth>(p.in.dims.head_dim);
  // The inputs with what the configuration fixes as constants (a token-wide norm: its own kernel,
  // qk_norm_rope_token_kernel).
  const rope::RopeInputs in = Fix::known(p.in, D);
  const auto width = rope::row_width_divisor<Geom, kExactWidth>(D);
  const rope::LaneChunks<Geom> lanes(lane, D, in.dims.rotary_dim, Fix::kAllRotary);
  const bool exchange = rope::exchanges_partners<V>(in);
  const rope::Partners<Geom> partners(lanes, lane, in.dims.rotary_dim, in.dims.neox);

  // ---- loads: the K rows of the set (row k is input head set + NS*k; rows past Hq + Hkv are
  // masked), the norm weights and the token's angles, all issued before any use. A cos/sin
  // cache's row waits for the token's position: the position goes first, then what need not
  // wait, the angles last. ----
  // Paired: every head of the set has the set's parity, hence one angle half for all its rows.
  using Angles = rope::TokenAngles<Geom, AngleT, Config>;
  const int row = Angles::cache_row(in, t, token_ok);
  const uint16_t* qk_token = in.qk + t * in.qk_stride_t + int64_t(set) * in.qk_stride_h;
  const int64_t qk_row_step = int64_t(p.row_sets) * in.qk_stride_h;
  Chunk<V> x[K][C];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const bool row_ok = token_ok && set + p.row_sets * k < heads2;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      x[k][c] = rope::load_chunk_if<rope::Load::kStream, V>(row_ok && lanes.ok[c],
                                                             qk_token + k * qk_row_step + lanes.d0[c]);
    }
  }
  Angles angles;
  angles.load(in, t, row, qkvfuse::rope::place(in.dims, t, set).angle_offset, lanes, token_ok,
              /*backward=*/false);
  // The norm weights (configurations that may have them): the block's copy, filled while the
  // loads are in flight.
  extern __shared__ __align__(16) float weight_rows[];  // [2][D]
  const rope::SharedWeights weights{weight_rows, rope::WeightLanes::per_head(D)};
  if constexpr (!Fix::kWeightless) {
    rope::SharedWeights::fill(in, weights.at, weight_rows);
    __syncthreads();
  }

  // ---- per row: norm, rotate, store ----
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int head2 = set + p.row_sets * k;
    const bool is_key = head2 >= in.dims.q_heads;
    const float rstd =
        in.normalize ? rope::row_rstd<G, V, C>(x[k], width, in.eps) : 1.0f;  // all lanes: shuffles
    // Rows (t, h) of q and k start at (t * heads + h) * D in both layouts: paired
    // (2t + h / (H/2), h mod (H/2)) is (2t + h / (H/2)) * (H/2) * D + (h mod (H/2)) * D.
    const bool row_ok = token_ok && head2 < heads2;
    const int heads = is_key ? in.dims.kv_heads : in.dims.q_heads;
    const int h = is_key ? head2 - in.dims.q_heads : head2;
    const int64_t out_token_step = int64_t(heads) * D;
    uint16_t* out = (is_key ? p.k : p.q) + t * out_token_step + int64_t(h) * D;
    const auto store = [&](int c, const Chunk<V>& y, const Chunk<V>& nw) {
      if (!(row_ok && lanes.ok[c])) return;
      if (in.key_offset && is_key) {
        // Own row: the rotary lanes (every lane at t = 0); the lanes >= r come from the group
        // of token t-1. Next token's row: its lanes >= r are this row's nw.
        rope::store_chunk_range(out + lanes.d0[c], y, 0, t == 0 ? V : lanes.rot_end[c]);
        if (t + 1 < in.tokens && lanes.rot_end[c] < V) {
          rope::store_chunk_range(out + out_token_step + lanes.d0[c], nw, lanes.rot_end[c], V);
        }
      } else {
        rope::store_chunk(out + lanes.d0[c], y);
      }
    };
    if constexpr (Fix::kChunkRotation) {
      // n (the key-offset store's next-token lanes) wherever the row may take key offset: a
      // pointer chosen at run time puts n on the stack (key offset read at run time: the narrow
      // row).
      constexpr bool kMayKeyOffset = Fix::kSpec.placement.contains(rope::Placement::kKeyOffset);
#pragma unroll
      for (int c = 0; c < C; ++c) {
        Chunk<V> y;
        Chunk<V> n{};
        rope::forward_chunk<Geom, Config>(in, x[k], c, rstd, angles, lanes, y,
                                          kMayKeyOffset ? &n : nullptr);
        store(c, y, n);
      }
    } else {
      rope::forward_row<Geom, Config>(in, x[k], rstd, weights, is_key, h, angles, lanes, partners,
                                      exchange, store);  // shuffles
    }
  }
}

/// A token-wide norm's kernel (forward_token_rows): the Section9 configuration's geometries, the
/// angles' dtype read at run time (one kernel for both).
template <class Config, class Geom>
__global__ void __launch_bounds__(
    ForwardPolicy<Config, Geom, rope::RunTimeAngles>::kThreads,
    ForwardPolicy<Config, Geom, rope::RunTimeAngles>::token_min_blocks())
    qk_norm_rope_token_kernel(const __grid_constant__ ForwardArgs p) {
  forward_token_rows<Config, Geom, rope::RunTimeAngles>(
      p, ForwardPolicy<Config, Geom, rope::RunTimeAngles>::kThreads);
}

/// A token-wide norm (SPEC.md section 9): blocks of kTokensPerTokenBlock tokens, one after the
/// other (forward_token_rows); shared memory: the norm weights [Hq*D + Hkv*D], the lane groups'
/// sums [groups][2] and the token's rstd [2].
template <class Config, class Geom>
void launch_forward_tokens(ForwardArgs args, cudaStream_t stream) {
  using Policy = ForwardPolicy<Config, Geom, rope::RunTimeAngles>;
  constexpr auto kernel = qk_norm_rope_token_kernel<Config, Geom>;
  constexpr int64_t kGroups = Policy::kThreads / Geom::G;
  const rope::RowWork work = rope::plan_token_work(
      args.in.tokens, args.in.dims.q_heads + args.in.dims.kv_heads, 1, int(kGroups));
  args.row_sets = work.row_sets;
  args.units = work.units;
  args.tokens_per_block = rope::kTokensPerTokenBlock;
  const int64_t blocks = (args.in.tokens + args.tokens_per_block - 1) / args.tokens_per_block;
  const size_t smem =
      (size_t(rope::WeightLanes::per_token(args.in.dims, args.in.dims.head_dim).floats) +
       2 * size_t(kGroups) + 2) * sizeof(float);
  rope::allow_shared_memory("qk_norm_rope", kernel, smem);
  kernel<<<dim3(rope::grid_size("qk_norm_rope", blocks, args.in.tokens)), dim3(Policy::kThreads),
           smem, stream>>>(args);
  QKVF_CUDA_CHECK_LAUNCH("qk_norm_rope_token_kernel");
}

template <class Config, class Geom, typename AngleT, bool kExactWidth>
void launch_forward(ForwardArgs args, cudaStream_t stream) {
  if constexpr (!rope::Fixed<Config>::kHeadScope) {
    if (args.s9.token_scope) return launch_forward_tokens<Config, Geom>(args, stream);
  }
  using Policy = ForwardPolicy<Config, Geom, AngleT>;
  constexpr auto kernel = qk_norm_rope_kernel<Config, Geom, AngleT, kExactWidth>;
  const rope::RowWork work = rope::plan_row_work(
      args.in.tokens, args.in.dims.q_heads + args.in.dims.kv_heads, Policy::rows_per_group());
  args.row_sets = work.row_sets;
  args.units = work.units;
  const int64_t groups_per_block = Policy::kThreads / Geom::G;
  int64_t blocks = (work.units + groups_per_block - 1) / groups_per_block;
  if constexpr (!rope::Fixed<Config>::kNoVNorm) {
    if (args.s9.normalize_v) {
      // The V rows' blocks after the Q/K units' (K rows per lane group).
      args.v_first_block = blocks;
      constexpr int64_t kRows = Policy::rows_per_group();
      const int64_t v_units = (args.in.tokens * args.in.dims.kv_heads + kRows - 1) / kRows;
      blocks += (v_units + groups_per_block - 1) / groups_per_block;
    }
  }
  // The norm weights, [2][D] floats (rope::SharedWeights).
  const size_t smem = rope::Fixed<Config>::kWeightless
                          ? 0
                          : 2 * size_t(args.in.dims.head_dim) * sizeof(float);
  kernel<<<dim3(rope::grid_size("qk_norm_rope", blocks, args.in.tokens)), dim3(Policy::kThreads),
           smem, stream>>>(args);
  QKVF_CUDA_CHECK_LAUNCH("qk_norm_rope_kernel");
}

}  // namespace

void qk_norm_rope(const QkNormRopeParams& params) {
  DeviceGuard guard(params.qk.device);
  const ForwardArgs args{.in = rope::make_rope_inputs(params.layout, params.qk),
                         .q = static_cast<uint16_t*>(params.q.data),
                         .k = static_cast<uint16_t*>(params.k.data),
                         .row_sets = 0,
                         .units = 0,
                         .s9 = rope::make_section9_inputs(params.layout, params.v),
                         .v_out = static_cast<uint16_t*>(params.v_out.data),
                         .v_first_block = 0,
                         .tokens_per_block = 0};
  const cudaStream_t stream = to_cuda(params.stream);
  rope::dispatch<Op::kForward>(
      "qk_norm_rope", rope::rope_key(params), [&](auto config, auto geometry, auto angle, auto exact) {
        launch_forward<decltype(config), decltype(geometry), typename decltype(angle)::type,
                       decltype(exact)::value>(args, stream);
      });
}

}  // namespace qkvfuse::cuda
