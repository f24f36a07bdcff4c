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
// partial sums stay few (weight_grad.hpp reduces them in a fixed order), a block of the weighted
// kernel walks all units of tokens_per_block consecutive tokens, its lane groups taking the units
// in turn, then adds its groups' sums in group order and writes one partial row.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

#include "backend.hpp"
#include "cuda/check.hpp"
#include "cuda/rope_args.hpp"
#include "cuda/rope_common.cuh"
#include "cuda/rope_paths.hpp"
#include "cuda/rope_rows.cuh"
#include "cuda/static_switch.hpp"
#include "cuda/weight_grad.hpp"

namespace qkvfuse::cuda {
namespace {

using rope::Chunk;
using rope::kRowThreads;

/// Rows a block of the weighted kernel walks, about: enough that its partial row (2D floats) is
/// under 1 % of the bytes it moves.
constexpr int64_t kRowsPerWeightBlock = 256;

/// Everything the bf16 backward kernel reads.
struct BackwardArgs {
  rope::RopeInputs in;
  rope::GradRows grad;
  uint16_t* grad_qk;         ///< [T, Hq + Hkv, D] row-major contiguous: (t, h2) at (t*heads2 + h2)*D
  float* partials;           ///< weighted kernels: [blocks][2][D], one row per block
  int row_sets;              ///< NS (rope::RowWork): unit u = t * NS + s
  int64_t units;             ///< T * NS
  int tokens_per_block;      ///< weighted kernels: a block walks the units of these many tokens
};

int64_t tokens_per_weight_block(int64_t heads2) {
  return (kRowsPerWeightBlock + heads2 - 1) / heads2;
}

/// Rows per lane group: each row needs g and x (two chunks per lane per chunk slot); one row for
/// C >= 2 (D = 96 on 4 lanes x 3 chunks included); narrow chunks: 8 elements of rows per thread.
template <class Geom>
constexpr int backward_rows_per_group() {
  if constexpr (Geom::V == 8) return Geom::C == 1 ? 2 : 1;
  return Geom::V * Geom::C >= 8 ? 1 : 8 / (Geom::V * Geom::C);
}

/// Register budget as resident 128-thread blocks per SM, chosen so that ptxas spills nothing:
/// 8 (<= 64 registers, 32 warps) for the speedrun's bf16-factor kernels of one chunk per lane,
/// key offset included, fewer for fp32 factors and wider rows. C = 3 (D = 96 on 4 lanes) holds
/// g, x (and g_next) and the 6 factor chunks of its one row at once: 6 blocks (80 registers)
/// with bf16 factors, 5 (92) under key offset, 4 (107 and 118) with fp32 factors. The general
/// layouts hold more (partners, run-time options): 4, 3 at C = 3. The models' weighted kernels
/// (their weights and gradient sums in shared memory) fit 6 blocks at one chunk per lane and 5
/// at two with bf16 angles, one block fewer with fp32 angles.
template <class Geom, bool kKeyOffset, typename AngleT, class Features, bool kWeightGrad>
constexpr int backward_min_blocks() {
  constexpr bool kWideFactors = sizeof(AngleT) == 4;
  if constexpr (std::is_same_v<Features, rope::ModelFeatures> && Geom::V == 8) {
    return (Geom::C == 1 || (Geom::kNeoxPairsInLane && Geom::G < 16) ? 6 : 5) -
           (kWideFactors ? 1 : 0);
  }
  if constexpr (Features::kGeneral || kWeightGrad || Geom::V != 8) return Geom::C >= 3 ? 3 : 4;
  constexpr int C = Geom::C;
  if constexpr (C == 1) return kKeyOffset && kWideFactors ? 5 : (kWideFactors ? 6 : 8);
  if constexpr (C == 3) return kWideFactors ? 4 : (kKeyOffset ? 5 : 6);
  return kWideFactors || kKeyOffset ? 4 : 5;
}

/// Branch-free row scalars (rope::backward_row) where they measured faster on the H200: key
/// offset and 4 lanes x 3 chunks of the 16-byte kernels; the plain and paired kernels of one
/// chunk per lane keep the branches (perf_notes.md). The narrow kernels keep them too: their
/// widths reach the subnormal row sums where divide_by_width is not __fdiv_rn.
template <class Geom, bool kKeyOffset>
constexpr bool backward_branch_free() {
  return Geom::V == 8 && (kKeyOffset || Geom::C == 3);
}

/// One unit: loads, dx of its K rows, stores; with `sums`, adds the rows' gw * n to them. The
/// general layouts read their norm weights from `weight_rows` (rope::SharedWeights, shared memory);
/// with `fill_weights` (block-uniform) the block fills them once its loads are issued and waits
/// for the copy (a barrier) before the math. Every lane of the warp must call it (shuffles).
/// `in`: p.in as the kernel sees it (Features::known).
template <class Geom, int K, bool kKeyOffset, typename AngleT, bool kFullWidth, class Features>
__device__ __forceinline__ void backward_unit(const BackwardArgs& p, const rope::RopeInputs& in,
                                              int64_t unit, int lane,
                                              const rope::LaneChunks<Geom>& lanes,
                                              const rope::Partners<Geom>& partners,
                                              float* weight_rows, bool fill_weights,
                                              const rope::WeightGradSums* sums) {
  constexpr int V = Geom::V;
  constexpr int C = Geom::C;
  const int64_t t = unit / p.row_sets;
  const int set = int(unit - t * p.row_sets);
  // Groups past the last unit load and store nothing but still execute every shuffle.
  const bool token_ok = unit < p.units;
  const int heads2 = in.dims.q_heads + in.dims.kv_heads;
  const int D = rope::row_width<Geom, kFullWidth>(in.dims.head_dim);
  const auto width = rope::row_width_divisor<Geom, kFullWidth>(D);
  const bool exchange = rope::exchanges_partners<Features, V>(in);
  const int64_t qk_row_step = int64_t(p.row_sets) * in.qk_stride_h;
  const uint16_t* qk_token = in.qk + t * in.qk_stride_t + int64_t(set) * in.qk_stride_h;

  // ---- loads: g and x of every row of the set, g_next of key rows, the angles ----
  Chunk<V> g[K][C];
  Chunk<V> x[K][C];
  Chunk<V> g_next[K][C];
  using Angles = rope::TokenAngles<Geom, AngleT, Features>;
  Angles angles;
  const int angle_offset = qkvfuse::rope::place(in.dims, t, set).angle_offset;
  // Issue order, for ptxas's schedule: the speedrun's kernels at C = 3 and under key offset load
  // the angles first, so that every row load precedes the rstd shuffles; its plain and paired
  // kernels of one chunk per lane keep the rows first (their SASS as measured; perf_notes.md).
  // The general layouts issue the token's position, then the rows, then the angles: a cos/sin
  // cache's row waits for the position, the rows need not.
  constexpr bool kAnglesFirst = !Features::kGeneral && (Geom::C == 3 || kKeyOffset);
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
    const bool next_ok = kKeyOffset && row_ok && is_key && t + 1 < in.tokens;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const bool ok = row_ok && lanes.ok[c];
      // Key offset: key grads are read twice (as g here, as g_next by the unit of t-1): cached.
      g[k][c] = kKeyOffset && is_key
                    ? rope::load_chunk_if<rope::Load::kCached, V>(ok, g_row + lanes.d0[c])
                    : rope::load_chunk_if<rope::Load::kStream, V>(ok, g_row + lanes.d0[c]);
      x[k][c] = rope::load_chunk_if<rope::Load::kStream, V>(ok, qk_token + k * qk_row_step +
                                                                    lanes.d0[c]);
      g_next[k][c] = rope::load_chunk_if<rope::Load::kCached, V>(
          next_ok && lanes.ok[c] && lanes.rot_end[c] < V, g_row + stride_t + lanes.d0[c]);
    }
  }
  if constexpr (!kAnglesFirst) {
    angles.load(in, t, row, angle_offset, lanes, token_ok, /*backward=*/true);
  }
  const rope::SharedWeights weights{weight_rows};
  if (fill_weights) {
    rope::SharedWeights::fill(in, D, weight_rows);
    __syncthreads();
  }

  // ---- per row: dx, store ----
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int head2 = set + p.row_sets * k;
    const bool is_key = head2 >= in.dims.q_heads;
    const bool shift_row = kKeyOffset && is_key;
    float dx[C][V];
    constexpr bool kBranchFree = backward_branch_free<Geom, kKeyOffset>();
    if constexpr (Features::kGeneral) {
      // Rows past the unit's heads (loads 0, the token's angles) add nothing to the sums.
      const bool row_ok = token_ok && head2 < heads2;
      rope::backward_row<Geom, Features, kBranchFree>(in, g[k], x[k], angles, g_next[k], lanes,
                                                      partners, exchange, &weights, sums, D,
                                                      is_key, row_ok, shift_row, t == 0, width,
                                                      dx);
    } else {
      rope::backward_row<Geom, Features, kBranchFree>(in, g[k], x[k], angles, g_next[k], lanes,
                                                      partners, exchange, nullptr, nullptr, D,
                                                      is_key, /*row_present=*/true, shift_row,
                                                      t == 0, width, dx);
    }
    if (!(token_ok && head2 < heads2)) continue;
    uint16_t* out = p.grad_qk + (t * heads2 + head2) * int64_t(D);
#pragma unroll
    for (int c = 0; c < C; ++c) {
      if (lanes.ok[c]) rope::store_chunk(out + lanes.d0[c], rope::to_bf16<V>(dx[c]));
    }
  }
}

/// kFullWidth: rows of exactly Geom's full width (rope::has_full_width). kWeightGrad: the block
/// walks tokens_per_block tokens and writes its partial row of the weights' gradient sums (when
/// partials is not null).
template <class Geom, int K, bool kKeyOffset, typename AngleT, bool kFullWidth, class Features,
          bool kWeightGrad>
__global__ void __launch_bounds__(
    kRowThreads, backward_min_blocks<Geom, kKeyOffset, AngleT, Features, kWeightGrad>())
    qk_norm_rope_backward_kernel(const __grid_constant__ BackwardArgs p) {
  constexpr int G = Geom::G;
  constexpr int V = Geom::V;
  constexpr int C = Geom::C;
  constexpr int kGroups = kRowThreads / G;
  static_assert(kRowThreads % 32 == 0 && 32 % G == 0, "lane groups must tile whole warps");
  static_assert(K >= 1 && K * V * C <= 32, "rows per lane group: keep the loads in registers");
  static_assert(!kWeightGrad || Features::kGeneral, "norm weights are a general layout");
  const int D = rope::row_width<Geom, kFullWidth>(p.in.dims.head_dim);
  // A reference, or for ModelFeatures a copy with the layout's options as constants.
  const rope::RopeInputs& in = Features::known(p.in, D);
  const int lane = int(threadIdx.x) % G;
  const int group = int(threadIdx.x) / G;
  const rope::LaneChunks<Geom> lanes(lane, D, in.dims.rotary_dim,
                                     Features::kAllRotary && !kKeyOffset);
  const rope::Partners<Geom> partners(lanes, lane, in.dims.rotary_dim,
                                      Features::kGeneral && in.dims.neox);
  // Shared memory, general layouts: the norm weights [2][D], then (weighted kernel) the lane
  // groups' weight-gradient sums [kGroups][2][D].
  extern __shared__ __align__(16) float shared_rows[];
  float* group_sums = shared_rows + 2 * D;

  if constexpr (!kWeightGrad) {
    backward_unit<Geom, K, kKeyOffset, AngleT, kFullWidth, Features>(
        p, in, int64_t(blockIdx.x) * kGroups + group, lane, lanes, partners, shared_rows,
        Features::kGeneral, nullptr);
  } else {
    const rope::WeightGradSums sums{group_sums + group * 2 * D};
    sums.clear(lanes, D);
    // The block's units, in turns of kGroups; the trip count is the same for every group, so the
    // loop stays warp-uniform (units past the block's end load nothing).
    const int64_t per_block = int64_t(p.tokens_per_block) * p.row_sets;
    const int64_t first = int64_t(blockIdx.x) * per_block;
    const int64_t last = first + per_block < p.units ? first + per_block : p.units;
    const int64_t turns = (per_block + kGroups - 1) / kGroups;
#pragma unroll 1
    for (int64_t turn = 0; turn < turns; ++turn) {
      const int64_t unit = first + turn * kGroups + group;
      backward_unit<Geom, K, kKeyOffset, AngleT, kFullWidth, Features>(
          p, in, unit < last ? unit : p.units, lane, lanes, partners, shared_rows, turn == 0,
          &sums);
    }
    rope::write_partial_row<kGroups, kRowThreads>(D, group_sums, p.partials);
  }
}

template <class Geom, bool kKeyOffset, typename AngleT, bool kFullWidth, class Features,
          bool kWeightGrad>
void launch_backward(BackwardArgs args, cudaStream_t stream) {
  constexpr int K = backward_rows_per_group<Geom>();
  constexpr int kGroups = kRowThreads / Geom::G;
  constexpr auto kernel =
      qk_norm_rope_backward_kernel<Geom, K, kKeyOffset, AngleT, kFullWidth, Features, kWeightGrad>;
  const int64_t heads2 = args.in.dims.q_heads + args.in.dims.kv_heads;
  const rope::RowWork work = rope::plan_row_work(args.in.tokens, heads2, K);
  args.row_sets = work.row_sets;
  args.units = work.units;
  int64_t blocks = (work.units + kGroups - 1) / kGroups;
  // Shared memory: the general layouts' norm weights, [2][D] floats, and the weighted kernel's
  // group sums, [kGroups][2][D].
  const size_t row_floats = 2 * size_t(args.in.dims.head_dim);
  size_t smem = Features::kGeneral ? row_floats * sizeof(float) : 0;
  if (!rope::has_weights_args(args.in)) args.partials = nullptr;
  if constexpr (kWeightGrad) {
    args.tokens_per_block = int(tokens_per_weight_block(heads2));
    blocks = (args.in.tokens + args.tokens_per_block - 1) / args.tokens_per_block;
    smem += size_t(kGroups) * row_floats * sizeof(float);
  }
  kernel<<<dim3(rope::grid_size("qk_norm_rope_backward", blocks, args.in.tokens)),
           dim3(kRowThreads), smem, stream>>>(args);
  QKVF_CUDA_CHECK_LAUNCH("qk_norm_rope_backward_kernel");
}

/// Partial rows of the weighted kernel: one per block of tokens_per_weight_block tokens.
int64_t weight_blocks(const QkNormRopeBackwardParams& params) {
  const int64_t heads2 = params.qk.sizes[1];
  const int64_t per_block = tokens_per_weight_block(heads2);
  return (params.qk.sizes[0] + per_block - 1) / per_block;
}

}  // namespace

int64_t backward_workspace_size(const QkNormRopeBackwardParams& params) {
  return weight_grad::workspace_floats(weight_blocks(params), params.qk.sizes[2]);
}

void qk_norm_rope_backward(const QkNormRopeBackwardParams& params) {
  DeviceGuard guard(params.qk.device);
  const RopeLayout& layout = params.layout;
  const int64_t head_dim = params.qk.size(2);
  const bool weighted = rope::has_weights(layout);
  const cudaStream_t stream = to_cuda(params.stream);
  float* workspace = static_cast<float*>(params.workspace.data);
  if (params.qk.size(0) == 0) {
    // Nothing to compute; the weight gradients of no rows are zeros.
    if (weighted) {
      weight_grad::reduce(workspace, 0, int(head_dim), params.grad_q_weight, params.grad_k_weight,
                          stream);
    }
    return;
  }
  const BackwardArgs args{.in = rope::make_rope_inputs(layout, params.qk),
                          .grad = rope::make_grad_rows(params.grad_q, params.grad_k),
                          .grad_qk = static_cast<uint16_t*>(params.grad_qk.data),
                          .partials = workspace,
                          .row_sets = 0,
                          .units = 0,
                          .tokens_per_block = 0};
  const int chunk = rope::chunk_width(params);
  // As the forward: the speedrun's layout without the general code in 16-byte and 4-byte chunks,
  // with a kernel per full width too (rope::has_full_width); the general layouts compute with the
  // run-time width, and their narrow-chunk kernels (rows not 16-byte aligned: rare) exist only in
  // the weighted form, which writes no partial row when the layout has no weight (fewer
  // instantiations to compile).
  const bool speedrun = chunk != 1 && rope::speedrun_layout(layout, head_dim);
  // The models' layout (weighted by definition) has its own kernels at 16-byte chunks, with a
  // kernel per full width too.
  const bool model = chunk == 8 && rope::model_layout(layout, head_dim);
  chunk_width_switch("qk_norm_rope_backward", chunk, [&](auto chunk_tag) {
    constexpr int V = decltype(chunk_tag)::value;
    // D = 96 on 4 lanes x 3 chunks: every lane loads and stores (perf_notes.md).
    rope::head_width_switch<V, rope::Width96::kFull4x3>(
        "qk_norm_rope_backward", head_dim, [&](auto geometry) {
          using Geom = decltype(geometry);
          bool_switch(layout.key_offset, [&](auto key_offset) {
            angle_dtype_switch(
                "qk_norm_rope_backward", rope::angle_dtype(layout), [&](auto angle_tag) {
                  using AngleT = typename decltype(angle_tag)::type;
                  constexpr bool kKeyOffset = decltype(key_offset)::value;
                  if constexpr (V == 8) {
                    if (speedrun) {
                      rope::full_width_switch<Geom>(head_dim, [&](auto full_width) {
                        launch_backward<Geom, kKeyOffset, AngleT, decltype(full_width)::value,
                                        rope::SpeedrunFeatures, false>(args, stream);
                      });
                    } else if (model && !kKeyOffset) {
                      if constexpr (!kKeyOffset) {
                        rope::model_width_switch<Geom>(head_dim, [&](auto geometry,
                                                                     auto full_width) {
                          launch_backward<decltype(geometry), false, AngleT,
                                          decltype(full_width)::value, rope::ModelFeatures, true>(
                              args, stream);
                        });
                      }
                    } else if (weighted) {
                      launch_backward<Geom, kKeyOffset, AngleT, false, rope::GeneralFeatures,
                                      true>(args, stream);
                    } else {
                      launch_backward<Geom, kKeyOffset, AngleT, false, rope::GeneralFeatures,
                                      false>(args, stream);
                    }
                  } else {
                    if constexpr (V == 2) {
                      if (speedrun) {
                        launch_backward<Geom, kKeyOffset, AngleT, false, rope::SpeedrunFeatures,
                                        false>(args, stream);
                        return;
                      }
                    }
                    launch_backward<Geom, kKeyOffset, AngleT, false, rope::GeneralFeatures, true>(
                        args, stream);
                  }
                });
          });
        });
  });
  if (weighted) {
    weight_grad::reduce(workspace, weight_blocks(params), int(head_dim), params.grad_q_weight,
                        params.grad_k_weight, stream);
  }
}

}  // namespace qkvfuse::cuda
