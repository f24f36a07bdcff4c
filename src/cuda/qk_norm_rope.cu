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

namespace qkvfuse::cuda {
namespace {

using rope::Chunk;
using rope::kRowThreads;

/// Everything the forward kernel reads, by value in constant memory.
struct ForwardArgs {
  rope::RopeInputs in;
  uint16_t* q;      ///< [T, Hq, D] ([2T, Hq/2, D] paired) bf16, row-major contiguous
  uint16_t* k;      ///< [T, Hkv, D] likewise, its own allocation
  int row_sets;     ///< NS, even: unit u = t * NS + s owns heads {s, s+NS, ...} of token t
  int64_t units;    ///< T * NS
};

/// Register budget, as resident 128-thread blocks per SM: 8 (32 warps, <= 64 registers) for the
/// speedrun's 16-byte kernels with bf16 factors; fp32 factor chunks take twice the registers, so
/// those get 6 (<= 80), and 5 (<= 96) at C = 3. The general layouts hold a row's weights and its
/// partners besides: 6 blocks, and 8 for one bf16 chunk per lane on 16 lanes (D in (64, 128], the
/// models' width), which fits 64 registers there but spills at 8 and 4 lanes. Chosen so that
/// ptxas spills nothing (check with -Xptxas -warn-spills).
template <class Geom, typename AngleT, class Features>
constexpr int forward_min_blocks() {
  // The models' two-chunk rows (their weights in shared memory, NeoX pairs in lane): 7 blocks
  // (<= 72 registers) on 8 or 4 lanes, 5 (<= 96) at D = 256 on 16.
  if constexpr (std::is_same_v<Features, rope::ModelFeatures> && Geom::V == 8 && Geom::C == 2 &&
                sizeof(AngleT) == 2) {
    return Geom::G == 16 ? 5 : 7;
  }
  if constexpr (Features::kGeneral && Geom::V == 8 && Geom::C == 1 && Geom::G == 16 &&
                sizeof(AngleT) == 2) {
    return 8;
  }
  if constexpr (Features::kGeneral || Geom::V != 8) return Geom::V * Geom::C > 8 ? 4 : 6;
  return sizeof(AngleT) == 4 ? (Geom::C == 3 ? 5 : 6) : 8;
}

/// Rows per lane group: 3 rows of one 16-byte chunk (plus the angle chunks) in flight per thread;
/// wider rows hold fewer, 4 / C (one at C = 3: D = 96 on 4 lanes, 3 row chunks and 6 angle
/// chunks). Narrow chunks: 8 elements of rows per thread (2 rows at D = 100: 27.9 % of copy,
/// against 22.3 % with 8 rows; perf_notes.md).
template <class Geom>
constexpr int forward_rows_per_group() {
  if constexpr (Geom::V == 8) return Geom::C == 1 ? 3 : (4 / Geom::C > 0 ? 4 / Geom::C : 1);
  return Geom::V * Geom::C >= 8 ? 1 : 8 / (Geom::V * Geom::C);
}

/// kFullWidth: rows of exactly Geom's full width (rope::has_full_width).
template <class Geom, int K, bool kKeyOffset, typename AngleT, bool kFullWidth, class Features>
__global__ void __launch_bounds__(kRowThreads, forward_min_blocks<Geom, AngleT, Features>())
    qk_norm_rope_kernel(const __grid_constant__ ForwardArgs p) {
  constexpr int G = Geom::G;
  constexpr int V = Geom::V;
  constexpr int C = Geom::C;
  static_assert(kRowThreads % 32 == 0 && 32 % G == 0, "lane groups must tile whole warps");
  static_assert(K >= 1 && K * V * C <= 32, "rows per lane group: keep the loads in registers");
  const int lane = int(threadIdx.x) % G;
  const int64_t unit = int64_t(blockIdx.x) * (kRowThreads / G) + threadIdx.x / G;
  const int64_t t = unit / p.row_sets;
  const int set = int(unit - t * p.row_sets);
  // Groups past the last unit (the last block only) load nothing and store nothing, but still
  // execute every shuffle: the row sums use full-warp masks.
  const bool token_ok = unit < p.units;
  const int heads2 = p.in.dims.q_heads + p.in.dims.kv_heads;
  const int D = rope::row_width<Geom, kFullWidth>(p.in.dims.head_dim);
  // A reference, or for ModelFeatures a copy with the layout's options as constants.
  const rope::RopeInputs& in = Features::known(p.in, D);
  const auto width = rope::row_width_divisor<Geom, kFullWidth>(D);
  const rope::LaneChunks<Geom> lanes(lane, D, in.dims.rotary_dim,
                                     Features::kAllRotary && !kKeyOffset);
  const bool exchange = rope::exchanges_partners<Features, V>(in);
  const rope::Partners<Geom> partners(lanes, lane, in.dims.rotary_dim,
                                      Features::kGeneral && in.dims.neox);

  // ---- loads: the K rows of the set (row k is input head set + NS*k; rows past Hq + Hkv are
  // masked), the norm weights and the token's angles, all issued before any use. A cos/sin
  // cache's row waits for the token's position: the position goes first, then what need not
  // wait, the angles last. ----
  // Paired: every head of the set has the set's parity, hence one angle half for all its rows.
  using Angles = rope::TokenAngles<Geom, AngleT, Features>;
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
  // The general layouts' norm weights: the block's copy, filled while the loads are in flight.
  extern __shared__ __align__(16) float weight_rows[];  // [2][D]
  const rope::SharedWeights weights{weight_rows};
  if constexpr (Features::kGeneral) {
    rope::SharedWeights::fill(in, D, weight_rows);
    __syncthreads();
  }

  // ---- per row: norm, rotate, store ----
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int head2 = set + p.row_sets * k;
    const bool is_key = head2 >= in.dims.q_heads;
    const bool normalize = !Features::kGeneral || in.normalize;
    const float rstd =
        normalize ? rope::row_rstd<G, V, C>(x[k], width, in.eps) : 1.0f;  // all lanes: shuffles
    // Rows (t, h) of q and k start at (t * heads + h) * D in both layouts: paired
    // (2t + h / (H/2), h mod (H/2)) is (2t + h / (H/2)) * (H/2) * D + (h mod (H/2)) * D.
    const bool row_ok = token_ok && head2 < heads2;
    const int heads = is_key ? in.dims.kv_heads : in.dims.q_heads;
    const int h = is_key ? head2 - in.dims.q_heads : head2;
    const int64_t out_token_step = int64_t(heads) * D;
    uint16_t* out = (is_key ? p.k : p.q) + t * out_token_step + int64_t(h) * D;
    const auto store = [&](int c, const Chunk<V>& y, const Chunk<V>& nw) {
      if (!(row_ok && lanes.ok[c])) return;
      if (kKeyOffset && is_key) {
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
    if constexpr (Features::kGeneral) {
      rope::forward_row<Geom, Features>(in, x[k], rstd, weights, is_key, D, angles, lanes,
                                        partners, exchange, store);  // shuffles
    } else {
#pragma unroll
      for (int c = 0; c < C; ++c) {
        Chunk<V> y;
        Chunk<V> n{};
        rope::forward_chunk<Geom, Features>(in, x[k], c, rstd, angles, lanes, y,
                                            kKeyOffset ? &n : nullptr);
        store(c, y, n);
      }
    }
  }
}

template <class Geom, bool kKeyOffset, typename AngleT, bool kFullWidth, class Features>
void launch_forward(ForwardArgs args, cudaStream_t stream) {
  constexpr int K = forward_rows_per_group<Geom>();
  constexpr auto kernel =
      qk_norm_rope_kernel<Geom, K, kKeyOffset, AngleT, kFullWidth, Features>;
  const rope::RowWork work = rope::plan_row_work(
      args.in.tokens, args.in.dims.q_heads + args.in.dims.kv_heads, K);
  args.row_sets = work.row_sets;
  args.units = work.units;
  const int64_t groups_per_block = kRowThreads / Geom::G;
  const unsigned blocks = rope::grid_size(
      "qk_norm_rope", (work.units + groups_per_block - 1) / groups_per_block, args.in.tokens);
  // The general layouts' norm weights, [2][D] floats (rope::SharedWeights).
  const size_t smem = Features::kGeneral ? 2 * size_t(args.in.dims.head_dim) * sizeof(float) : 0;
  kernel<<<dim3(blocks), dim3(kRowThreads), smem, stream>>>(args);
  QKVF_CUDA_CHECK_LAUNCH("qk_norm_rope_kernel");
}

}  // namespace

void qk_norm_rope(const QkNormRopeParams& params) {
  DeviceGuard guard(params.qk.device);
  const RopeLayout& layout = params.layout;
  const int64_t head_dim = params.qk.size(2);
  const ForwardArgs args{.in = rope::make_rope_inputs(layout, params.qk),
                         .q = static_cast<uint16_t*>(params.q.data),
                         .k = static_cast<uint16_t*>(params.k.data),
                         .row_sets = 0,
                         .units = 0};
  const int chunk = rope::chunk_width(params);
  // The speedrun's layout compiles without the general code in 16-byte and 4-byte chunks (its
  // rows of single elements, rare, take the general kernel), and has a kernel per full width too
  // (rope::has_full_width); the general layouts compute with the run-time width (fewer
  // instantiations to compile).
  const bool speedrun = chunk != 1 && rope::speedrun_layout(layout, head_dim);
  // The models' layout has its own kernels at 16-byte chunks, with a kernel per full width too.
  const bool model = chunk == 8 && rope::model_layout(layout, head_dim);
  const cudaStream_t stream = to_cuda(params.stream);
  chunk_width_switch("qk_norm_rope", chunk, [&](auto chunk_tag) {
    constexpr int V = decltype(chunk_tag)::value;
    // D = 96 on 4 lanes x 3 chunks: every lane loads and stores (perf_notes.md).
    rope::head_width_switch<V, rope::Width96::kFull4x3>("qk_norm_rope", head_dim, [&](auto geometry) {
      using Geom = decltype(geometry);
      bool_switch(layout.key_offset, [&](auto key_offset) {
        angle_dtype_switch("qk_norm_rope", rope::angle_dtype(layout), [&](auto angle_tag) {
          using AngleT = typename decltype(angle_tag)::type;
          constexpr bool kKeyOffset = decltype(key_offset)::value;
          if constexpr (V == 8) {
            if (speedrun) {
              rope::full_width_switch<Geom>(head_dim, [&](auto full_width) {
                launch_forward<Geom, kKeyOffset, AngleT, decltype(full_width)::value,
                               rope::SpeedrunFeatures>(args, stream);
              });
              return;
            }
            if constexpr (!kKeyOffset) {
              if (model) {
                rope::model_width_switch<Geom>(head_dim, [&](auto geometry, auto full_width) {
                  launch_forward<decltype(geometry), false, AngleT, decltype(full_width)::value,
                                 rope::ModelFeatures>(args, stream);
                });
                return;
              }
            }
          } else if constexpr (V == 2) {
            if (speedrun) {
              launch_forward<Geom, kKeyOffset, AngleT, false, rope::SpeedrunFeatures>(args, stream);
              return;
            }
          }
          launch_forward<Geom, kKeyOffset, AngleT, false, rope::GeneralFeatures>(args, stream);
        });
      });
    });
  });
}

}  // namespace qkvfuse::cuda
