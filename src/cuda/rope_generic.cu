// rope_generic.cu: the element-pair kernels of the three QK-norm + rotary ops (forward, bf16
// backward, fused FP8 backward), for every call the 16-byte vector kernels do not take
// (rope_paths.hpp): any even head width D in [2, 256], any V width Dv in [1, 512], any strides,
// pointers aligned to their elements only.
//
// Math: SPEC.md sections 1-3, evaluated as the vector kernels evaluate them (rope_common.cuh):
// explicitly rounded fp32 operations in the CPU backend's order; the fp32 row sums are per-lane
// fmaf partials followed by a shuffle butterfly, so every lane of the row gets the same bits.
//
// Geometry: one warp per row. Lane l holds the element pairs (2i, 2i+1) for i = l + 32j, j < 4:
// D/2 <= 128 pairs, and a rotary pair never straddles two lanes. A pair moves as one 4-byte
// access when every bf16 tensor of the call has even pointers and strides (a flag uniform over
// the launch), else as two 2-byte accesses. Each warp access covers 128 (or 64) contiguous
// bytes, so it is coalesced, but it issues four to eight times the memory instructions of the
// 16-byte vector kernels: these kernels exist for generality, not for the model's shapes.
//
// The FP8 backward stages a tile of 32 tokens x the head's 2D + Dv features in shared memory,
// as the vector kernel does, and writes grad_t from it one feature row at a time: 32 contiguous
// bytes (one sector) per warp store instead of 32 scattered bytes.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>

#include "backend.hpp"
#include "cuda/check.hpp"
#include "cuda/device_math.cuh"
#include "cuda/rope_common.cuh"
#include "cuda/rope_paths.hpp"
#include "cuda/static_switch.hpp"

namespace qkvfuse::cuda::generic {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kPairsPerLane = 4;  // 32 lanes x 4 pairs = 256 elements: the widest row
constexpr int kTileTokens = 32;   // FP8 backward: tokens per CTA (one grad_t sector per feature)

using Pairs = float[kPairsPerLane][2];

// ------------------------------------------------------------------------------------------------
// Arguments
// ------------------------------------------------------------------------------------------------

/// What all three kernels read: the saved pre-norm qk, the factor tables, the layout.
struct RopeInputs {
  const __nv_bfloat16* qk;  ///< [T, 2H, D]: (t, h2, d) at t*qk_stride_t + h2*qk_stride_h + d
  int64_t qk_stride_t;
  int64_t qk_stride_h;
  const void* factor1;      ///< [T, D] ([T, 2D] paired), bf16 or fp32 (FactorT)
  const void* factor2;
  int64_t factor1_stride_t;
  int64_t factor2_stride_t;
  int64_t tokens;           ///< T >= 1
  int num_heads;            ///< H
  int head_dim;             ///< D, even, in [2, 256]
  int rotary_dim;           ///< key offset: dims >= rotary_dim of keys are stationary; even
  bool paired;
  bool pairs_aligned;       ///< every bf16 pointer and stride even: pairs as 4-byte accesses
};

/// The gradients of q and k, in the forward's output layouts, for the two backward kernels.
struct GradInputs {
  const __nv_bfloat16* grad_q;  ///< [T, H, D] ([2T, H/2, D] paired), strides in elements
  int64_t grad_q_stride_t;
  int64_t grad_q_stride_h;
  const __nv_bfloat16* grad_k;
  int64_t grad_k_stride_t;
  int64_t grad_k_stride_h;
};

struct ForwardParams {
  RopeInputs in;
  __nv_bfloat16* q;  ///< row-major contiguous; row (t, h) at (t*H + h)*D in both layouts
  __nv_bfloat16* k;
};

struct BackwardParams {
  RopeInputs in;
  GradInputs grad;
  __nv_bfloat16* grad_qk;  ///< [T, 2H, D] row-major contiguous
};

struct Fp8Params {
  RopeInputs in;
  GradInputs grad;
  const __nv_bfloat16* grad_v;  ///< [T, H, Dv]
  int64_t grad_v_stride_t;
  int64_t grad_v_stride_h;
  int v_dim;                    ///< Dv in [1, 512]
  const float* grad_scale;
  uint8_t* grad_row;            ///< e4m3 [T, qkv_dim] row-major contiguous
  uint8_t* grad_t;              ///< e4m3 [qkv_dim, T] row-major contiguous
  int64_t qkv_dim;
  bool row_pairs_aligned;       ///< grad_row and qkv_dim even: Q/K byte pairs as 2-byte stores
  int tile_pitch;               ///< bytes per token of the shared tile; pitch / 4 odd
};

// ------------------------------------------------------------------------------------------------
// Element pairs
// ------------------------------------------------------------------------------------------------

__device__ __forceinline__ void unpack_bf16x2(uint32_t w, float (&out)[2]) {
  out[0] = __uint_as_float(w << 16);
  out[1] = __uint_as_float(w & 0xffff0000u);
}

/// Elements 2i and 2i+1 of a bf16 row at p = row + 2i. Read-only during the launch: ld.nc.
__device__ __forceinline__ void load_pair(const __nv_bfloat16* p, bool aligned, float (&out)[2]) {
  uint32_t w;
  if (aligned) {
    w = __ldg(reinterpret_cast<const unsigned int*>(p));
  } else {
    const auto* half = reinterpret_cast<const unsigned short*>(p);
    w = uint32_t(__ldg(half)) | (uint32_t(__ldg(half + 1)) << 16);
  }
  unpack_bf16x2(w, out);
}

__device__ __forceinline__ void load_pair(const float* p, bool /*aligned*/, float (&out)[2]) {
  out[0] = __ldg(p);
  out[1] = __ldg(p + 1);
}

__device__ __forceinline__ void store_pair(__nv_bfloat16* p, bool aligned, float a, float b) {
  const uint32_t w = float2_to_bf16x2(a, b);
  if (aligned) {
    *reinterpret_cast<uint32_t*>(p) = w;
  } else {
    auto* half = reinterpret_cast<uint16_t*>(p);
    half[0] = uint16_t(w & 0xffffu);
    half[1] = uint16_t(w >> 16);
  }
}

/// Lane's pairs of a row starting at `row` (nullptr: zeros), pairs past D/2 zero.
template <typename T>
__device__ __forceinline__ void load_row(const T* row, int lane, int pairs, bool aligned,
                                         Pairs& out) {
#pragma unroll
  for (int j = 0; j < kPairsPerLane; ++j) {
    const int i = lane + 32 * j;
    if (row != nullptr && i < pairs) {
      load_pair(row + 2 * i, aligned, out[j]);
    } else {
      out[j][0] = out[j][1] = 0.0f;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Row math: rope_common.cuh's element formulas over a warp's element pairs
// ------------------------------------------------------------------------------------------------

/// Sum over the warp; all 32 lanes must be present (rows are warp-uniform).
__device__ __forceinline__ float warp_sum(float v) { return rope::group_sum<32>(v); }

__device__ __forceinline__ float row_rstd(const Pairs& x, int width) {
  float partial = 0.0f;
#pragma unroll
  for (int j = 0; j < kPairsPerLane; ++j) {
    partial = fmaf(x[j][0], x[j][0], partial);
    partial = fmaf(x[j][1], x[j][1], partial);
  }
  return rope::rstd_of_mean(__fdiv_rn(warp_sum(partial), float(width)));
}

/// dx of one row (SPEC.md section 2). Pairs i >= `stationary_pair` of a `shift_row` take the
/// key-offset form dn = g_next + (first_token ? g : 0).
__device__ __forceinline__ void backward_row(const Pairs& g, const Pairs& x, const Pairs& f1,
                                             const Pairs& f2, const Pairs& g_next, int lane,
                                             int stationary_pair, bool shift_row, bool first_token,
                                             int width, Pairs& dx) {
  const float rstd = row_rstd(x, width);
  float partial = 0.0f;
#pragma unroll
  for (int j = 0; j < kPairsPerLane; ++j) {
    const bool shifted = shift_row && lane + 32 * j >= stationary_pair;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float n = __fmul_rn(x[j][e], rstd);
      const float rotated = rope::rotate(f1[j][e], g[j][e], f2[j][e ^ 1], g[j][e ^ 1]);
      dx[j][e] = shifted ? rope::shifted_grad(g_next[j][e], g[j][e], first_token) : rotated;
      partial = fmaf(dx[j][e], n, partial);
    }
  }
  const float correction = __fdiv_rn(warp_sum(partial), float(width));
#pragma unroll
  for (int j = 0; j < kPairsPerLane; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float n = __fmul_rn(x[j][e], rstd);
      dx[j][e] = rope::norm_grad(rstd, dx[j][e], n, correction);
    }
  }
}

/// Row (t, head2)'s place in the inputs: its qk row, its factor rows, its gradient row.
template <typename FactorT>
struct RowPlace {
  const __nv_bfloat16* x;
  const FactorT* f1;
  const FactorT* f2;
  bool is_key;
  int head;  ///< logical head h = head2 mod H

  __device__ __forceinline__ RowPlace(const RopeInputs& in, int64_t t, int head2) {
    const int H = in.num_heads;
    is_key = head2 >= H;
    head = is_key ? head2 - H : head2;
    x = in.qk + t * in.qk_stride_t + int64_t(head2) * in.qk_stride_h;
    const int offset = in.paired ? (head & 1) * in.head_dim : 0;
    f1 = static_cast<const FactorT*>(in.factor1) + t * in.factor1_stride_t + offset;
    f2 = static_cast<const FactorT*>(in.factor2) + t * in.factor2_stride_t + offset;
  }

  /// The gradient row the forward's output position maps to: plain (t, h); paired
  /// (2t + h / (H/2), h mod (H/2)). `next` (key offset, plain layout): the same head at t+1.
  __device__ __forceinline__ const __nv_bfloat16* grad(const RopeInputs& in, const GradInputs& gr,
                                                       int64_t t, int64_t* next_step) const {
    const int half = in.num_heads / 2;
    const int sub_token = in.paired && head >= half ? 1 : 0;
    const int64_t out_token = in.paired ? 2 * t + sub_token : t;
    const int64_t stride_t = is_key ? gr.grad_k_stride_t : gr.grad_q_stride_t;
    const int64_t stride_h = is_key ? gr.grad_k_stride_h : gr.grad_q_stride_h;
    *next_step = stride_t;
    return (is_key ? gr.grad_k : gr.grad_q) + out_token * stride_t +
           int64_t(head - sub_token * half) * stride_h;
  }
};

/// dx of row (t, head2), with all its loads; every lane of the warp must call it.
template <bool kKeyOffset, typename FactorT>
__device__ __forceinline__ void row_gradient(const RopeInputs& in, const GradInputs& gr,
                                             int64_t t, int head2, int lane, Pairs& dx) {
  const RowPlace<FactorT> place(in, t, head2);
  const int pairs = in.head_dim / 2;
  const bool aligned = in.pairs_aligned;
  int64_t next_step = 0;
  const __nv_bfloat16* g_row = place.grad(in, gr, t, &next_step);
  const bool shift_row = kKeyOffset && place.is_key;
  Pairs g, x, f1, f2, g_next;
  load_row(g_row, lane, pairs, aligned, g);
  load_row(place.x, lane, pairs, aligned, x);
  load_row(place.f1, lane, pairs, aligned, f1);
  load_row(place.f2, lane, pairs, aligned, f2);
  // g at t+1: only the stationary pairs use it, the others load it as zeros.
  const int stationary_pair = in.rotary_dim / 2;
  const bool has_next = shift_row && t + 1 < in.tokens;
#pragma unroll
  for (int j = 0; j < kPairsPerLane; ++j) {
    const int i = lane + 32 * j;
    if (has_next && i >= stationary_pair && i < pairs) {
      load_pair(g_row + next_step + 2 * i, aligned, g_next[j]);
    } else {
      g_next[j][0] = g_next[j][1] = 0.0f;
    }
  }
  backward_row(g, x, f1, f2, g_next, lane, stationary_pair, shift_row, t == 0, in.head_dim, dx);
}

// ------------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------------

template <bool kKeyOffset, typename FactorT>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const __grid_constant__ ForwardParams p) {
  const RopeInputs& in = p.in;
  const int lane = int(threadIdx.x) % 32;
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int H = in.num_heads;
  const int D = in.head_dim;
  if (row >= in.tokens * 2 * H) return;  // the whole warp: rows are warp-uniform
  const int64_t t = row / (2 * H);
  const int head2 = int(row - t * 2 * H);
  const RowPlace<FactorT> place(in, t, head2);
  const int pairs = D / 2;
  const bool aligned = in.pairs_aligned;

  Pairs x, f1, f2;
  load_row(place.x, lane, pairs, aligned, x);
  load_row(place.f1, lane, pairs, aligned, f1);
  load_row(place.f2, lane, pairs, aligned, f2);
  const float rstd = row_rstd(x, D);

  __nv_bfloat16* out = (place.is_key ? p.k : p.q) + (t * H + place.head) * int64_t(D);
  const int64_t next_row = int64_t(H) * D;  // the same head at t+1
  const bool shift_row = kKeyOffset && place.is_key;
  const int stationary_pair = in.rotary_dim / 2;
#pragma unroll
  for (int j = 0; j < kPairsPerLane; ++j) {
    const int i = lane + 32 * j;
    if (i >= pairs) continue;
    const float n0 = __fmul_rn(x[j][0], rstd);
    const float n1 = __fmul_rn(x[j][1], rstd);
    const float y0 = rope::rotate(f1[j][0], n0, f2[j][0], n1);
    const float y1 = rope::rotate(f1[j][1], n1, f2[j][1], n0);
    if (shift_row && i >= stationary_pair) {
      // Stationary key dims: this row's own come from the warp of t-1 (t = 0 keeps y); the
      // row of t+1 gets this row's normalized values. Every element is written once.
      if (t == 0) store_pair(out + 2 * i, aligned, y0, y1);
      if (t + 1 < in.tokens) store_pair(out + next_row + 2 * i, aligned, n0, n1);
    } else {
      store_pair(out + 2 * i, aligned, y0, y1);
    }
  }
}

template <bool kKeyOffset, typename FactorT>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const __grid_constant__ BackwardParams p) {
  const RopeInputs& in = p.in;
  const int lane = int(threadIdx.x) % 32;
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int H = in.num_heads;
  if (row >= in.tokens * 2 * H) return;  // the whole warp
  const int64_t t = row / (2 * H);
  const int head2 = int(row - t * 2 * H);
  Pairs dx;
  row_gradient<kKeyOffset, FactorT>(in, p.grad, t, head2, lane, dx);
  __nv_bfloat16* out = p.grad_qk + row * in.head_dim;  // row = t*2H + head2
#pragma unroll
  for (int j = 0; j < kPairsPerLane; ++j) {
    const int i = lane + 32 * j;
    if (i < in.head_dim / 2) store_pair(out + 2 * i, in.pairs_aligned, dx[j][0], dx[j][1]);
  }
}

__device__ __forceinline__ void st_global_u8(uint8_t* p, uint32_t v) {
  asm volatile("st.global.u8 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

template <bool kKeyOffset, typename FactorT>
__global__ void __launch_bounds__(kThreads) fp8_kernel(const __grid_constant__ Fp8Params p) {
  extern __shared__ __align__(16) uint8_t tile[];  // [kTileTokens][tile_pitch] e4m3
  const RopeInputs& in = p.in;
  const int H = in.num_heads;
  const int D = in.head_dim;
  const int Dv = p.v_dim;
  const int h = int(blockIdx.x % unsigned(H));
  const int64_t t0 = int64_t(blockIdx.x / unsigned(H)) * kTileTokens;
  const int warp = int(threadIdx.x) / 32;
  const int lane = int(threadIdx.x) % 32;
  const int pitch = p.tile_pitch;
  const E4m3Scaler scale{*p.grad_scale};

  // ---- Q and K rows: warp w takes rows w, w + 8, ... of the tile's 2 x 32 ----
#pragma unroll 1
  for (int r = warp; r < 2 * kTileTokens; r += kWarps) {
    const int token = r / 2;
    const int part = r % 2;  // 0: the Q row, 1: the K row
    const int64_t t = t0 + token;
    if (t >= in.tokens) continue;  // warp-uniform
    Pairs dx;
    row_gradient<kKeyOffset, FactorT>(in, p.grad, t, part * H + h, lane, dx);
    uint8_t* out = p.grad_row + t * p.qkv_dim + (int64_t(part) * H + h) * D;
#pragma unroll
    for (int j = 0; j < kPairsPerLane; ++j) {
      const int i = lane + 32 * j;
      if (i >= D / 2) continue;
      // Round to bf16 first (the aten chain materialized the QK gradient in bf16).
      float rounded[2];
      unpack_bf16x2(float2_to_bf16x2(dx[j][0], dx[j][1]), rounded);
      const uint16_t codes = float2_to_e4m3x2(scale(rounded[0]), scale(rounded[1]));
      if (p.row_pairs_aligned) {
        *reinterpret_cast<uint16_t*>(out + 2 * i) = codes;
      } else {
        st_global_u8(out + 2 * i, codes & 0xffu);
        st_global_u8(out + 2 * i + 1, codes >> 8);
      }
      *reinterpret_cast<uint16_t*>(tile + token * pitch + part * D + 2 * i) = codes;
    }
  }

  // ---- the V rows, element-wise ----
  const __nv_bfloat16* gv = p.grad_v + int64_t(h) * p.grad_v_stride_h;
  const int64_t v_feature = 2 * int64_t(H) * D + int64_t(h) * Dv;
#pragma unroll 1
  for (int u = int(threadIdx.x); u < kTileTokens * Dv; u += kThreads) {
    const int token = u / Dv;
    const int c = u - token * Dv;
    const int64_t t = t0 + token;
    if (t >= in.tokens) continue;
    const auto* element = reinterpret_cast<const unsigned short*>(gv + t * p.grad_v_stride_t + c);
    const float value = __uint_as_float(uint32_t(__ldg(element)) << 16);
    const uint32_t code = float2_to_e4m3x2(scale(value), 0.0f) & 0xffu;
    st_global_u8(p.grad_row + t * p.qkv_dim + v_feature + c, code);
    tile[token * pitch + 2 * D + c] = uint8_t(code);
  }

  __syncthreads();

  // ---- grad_t: warp w writes feature rows w, w + 8, ...; lane = token ----
  const int features = 2 * D + Dv;
  const int64_t t = t0 + lane;
#pragma unroll 1
  for (int f = warp; f < features; f += kWarps) {
    const int64_t feature = rope::packed_feature(f, h, H, D, Dv);
    if (t < in.tokens) st_global_u8(p.grad_t + feature * in.tokens + t, tile[lane * pitch + f]);
  }
}

// ------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------

/// True when every bf16 view's rows are 4-byte aligned (pointer and strides even in elements):
/// its element pairs can move as one 4-byte access. fp32 factors load element by element.
bool pairs_aligned(std::initializer_list<const TensorView*> views) {
  for (const TensorView* view : views) {
    if (view->dtype == DType::kBFloat16 && !rope::rows_aligned(*view, 4)) return false;
  }
  return true;
}

RopeInputs rope_inputs(const TensorView& qk, const TensorView& factor1, const TensorView& factor2,
                       const RopeLayout& layout) {
  RopeInputs in{};
  in.qk = static_cast<const __nv_bfloat16*>(qk.data);
  in.qk_stride_t = qk.strides[0];
  in.qk_stride_h = qk.strides[1];
  in.factor1 = factor1.data;
  in.factor2 = factor2.data;
  in.factor1_stride_t = factor1.strides[0];
  in.factor2_stride_t = factor2.strides[0];
  in.tokens = qk.sizes[0];
  in.num_heads = int(layout.num_heads);
  in.head_dim = int(qk.sizes[2]);
  in.rotary_dim = layout.key_offset ? int(layout.rotary_dim) : in.head_dim;
  in.paired = layout.paired;
  return in;
}

GradInputs grad_inputs(const TensorView& grad_q, const TensorView& grad_k) {
  GradInputs g{};
  g.grad_q = static_cast<const __nv_bfloat16*>(grad_q.data);
  g.grad_q_stride_t = grad_q.strides[0];
  g.grad_q_stride_h = grad_q.strides[1];
  g.grad_k = static_cast<const __nv_bfloat16*>(grad_k.data);
  g.grad_k_stride_t = grad_k.strides[0];
  g.grad_k_stride_h = grad_k.strides[1];
  return g;
}

/// One warp per input row: T * 2H rows.
unsigned row_blocks(const char* op, int64_t tokens, int64_t heads) {
  const int64_t blocks = (tokens * 2 * heads + kWarps - 1) / kWarps;
  QKVF_CHECK(blocks <= int64_t(0x7fffffff), op, " (CUDA): ", tokens,
             " tokens need more blocks than one launch holds");
  return unsigned(blocks);
}

}  // namespace

void qk_norm_rope(const QkNormRopeParams& params) {
  DeviceGuard guard(params.qk.device);
  ForwardParams kp{};
  kp.in = rope_inputs(params.qk, params.factor1, params.factor2, params.layout);
  kp.in.pairs_aligned =
      pairs_aligned({&params.qk, &params.factor1, &params.factor2, &params.q, &params.k});
  kp.q = static_cast<__nv_bfloat16*>(params.q.data);
  kp.k = static_cast<__nv_bfloat16*>(params.k.data);
  const unsigned blocks = row_blocks("qk_norm_rope", kp.in.tokens, kp.in.num_heads);
  const cudaStream_t stream = to_cuda(params.stream);
  key_offset_factor_switch(
      "qk_norm_rope", params.layout.key_offset, params.factor1.dtype,
      [&](auto key_offset, auto factor_tag) {
        using FactorT = typename decltype(factor_tag)::type;
        forward_kernel<decltype(key_offset)::value, FactorT>
            <<<blocks, kThreads, 0, stream>>>(kp);
        QKVF_CUDA_CHECK_LAUNCH("generic::forward_kernel");
      });
}

void qk_norm_rope_backward(const QkNormRopeBackwardParams& params) {
  DeviceGuard guard(params.qk.device);
  BackwardParams kp{};
  kp.in = rope_inputs(params.qk, params.factor1, params.factor2, params.layout);
  kp.in.pairs_aligned = pairs_aligned({&params.grad_q, &params.grad_k, &params.qk,
                                       &params.factor1, &params.factor2, &params.grad_qk});
  kp.grad = grad_inputs(params.grad_q, params.grad_k);
  kp.grad_qk = static_cast<__nv_bfloat16*>(params.grad_qk.data);
  const unsigned blocks = row_blocks("qk_norm_rope_backward", kp.in.tokens, kp.in.num_heads);
  const cudaStream_t stream = to_cuda(params.stream);
  key_offset_factor_switch(
      "qk_norm_rope_backward", params.layout.key_offset, params.factor1.dtype,
      [&](auto key_offset, auto factor_tag) {
        using FactorT = typename decltype(factor_tag)::type;
        backward_kernel<decltype(key_offset)::value, FactorT>
            <<<blocks, kThreads, 0, stream>>>(kp);
        QKVF_CUDA_CHECK_LAUNCH("generic::backward_kernel");
      });
}

void qkv_backward_fp8(const QkvBackwardFp8Params& params) {
  DeviceGuard guard(params.qk.device);
  Fp8Params kp{};
  kp.in = rope_inputs(params.qk, params.factor1, params.factor2, params.layout);
  kp.in.pairs_aligned = pairs_aligned(
      {&params.grad_q, &params.grad_k, &params.qk, &params.factor1, &params.factor2});
  kp.grad = grad_inputs(params.grad_q, params.grad_k);
  const int64_t H = kp.in.num_heads;
  const int64_t D = kp.in.head_dim;
  const int64_t v_dim = params.grad_v.sizes[2];
  // Validated by the entry point; restated because the shared tile's size relies on it.
  QKVF_CHECK(v_dim >= 1 && v_dim <= kMaxVWidth, "qkv_backward_fp8 (CUDA): V width ", v_dim,
             " outside [1, ", kMaxVWidth, "]");
  kp.grad_v = static_cast<const __nv_bfloat16*>(params.grad_v.data);
  kp.grad_v_stride_t = params.grad_v.strides[0];
  kp.grad_v_stride_h = params.grad_v.strides[1];
  kp.v_dim = int(v_dim);
  kp.grad_scale = static_cast<const float*>(params.grad_scale.data);
  kp.grad_row = static_cast<uint8_t*>(params.grad_row.data);
  kp.grad_t = static_cast<uint8_t*>(params.grad_t.data);
  kp.qkv_dim = 2 * H * D + H * v_dim;
  kp.row_pairs_aligned =
      reinterpret_cast<uintptr_t>(params.grad_row.data) % 2 == 0 && kp.qkv_dim % 2 == 0;
  // A pitch of an odd number of words: the 32 tokens of a feature column sit in 32 banks.
  int pitch = int((2 * D + v_dim + 3) / 4 * 4);
  if ((pitch / 4) % 2 == 0) pitch += 4;
  kp.tile_pitch = pitch;
  const size_t smem = size_t(kTileTokens) * size_t(pitch);  // <= 32 x 1028 bytes: under 48 KB

  const int64_t blocks = (kp.in.tokens + kTileTokens - 1) / kTileTokens * H;
  QKVF_CHECK(blocks <= int64_t(0x7fffffff), "qkv_backward_fp8 (CUDA): ", kp.in.tokens,
             " tokens need more blocks than one launch holds");
  const cudaStream_t stream = to_cuda(params.stream);
  key_offset_factor_switch(
      "qkv_backward_fp8", params.layout.key_offset, params.factor1.dtype,
      [&](auto key_offset, auto factor_tag) {
        using FactorT = typename decltype(factor_tag)::type;
        fp8_kernel<decltype(key_offset)::value, FactorT>
            <<<unsigned(blocks), kThreads, smem, stream>>>(kp);
        QKVF_CUDA_CHECK_LAUNCH("generic::fp8_kernel");
      });
}

}  // namespace qkvfuse::cuda::generic
