// bench_kernels.cu: timings of the three QK-norm + rotary kernels through the public API: the
// forward (qk_norm_rope), the bf16 backward (qk_norm_rope_backward) and the fused FP8 backward
// (qkv_backward_fp8), at the speedrun's shapes (T = --tokens) and at the general layouts' model
// shapes of SPEC.md section 8 (Qwen3-8B, Gemma3-12B, Qwen3-0.6B, T = 32768 = 4 x 8192 tokens:
// NeoX rotary from a cos/sin cache at positions restarting per sequence, learned norm weights
// that receive gradients).
//
//   qkvfuse_bench_kernels [--csv PATH] [--tokens T] [--iters N] [--kernel NAME] [--head-dim D]
//   (--kernel copy: only the copy rows)
//
// Method (the "Benchmarks" section of ../shared/STYLE.md, outside this repository): each case warms up, then times every iteration between its own
// pair of CUDA events and reports the median of N >= 50. A spinning kernel holds the GPU while all
// iterations are enqueued, so the events measure GPU time, not launch overhead. Inputs and outputs
// rotate through at least 3 buffer sets, and through enough that one pass touches more than 3x
// the L2, so no iteration reads what the previous one left in L2. Inputs are random (normal, bf16).
// The layouts are the model's: qk is the Q/K column block of the packed [T, QK + Hkv*Dv] GEMM
// output (paired layers: a dense [T, 2H, D], their V has its own GEMM), angle tables bf16, grads
// dense, grad_scale = 1/448.
//
// Bytes: the minimum each kernel must move, each input read once and each output written once,
// counted exactly (with QK = (Hq + Hkv) * D features per token):
//   forward        qk 2*T*QK + angles + weights + q, k 2*T*QK
//   bf16 backward  grad_q, grad_k 2*T*QK + qk 2*T*QK + angles + weights + grad_qk 2*T*QK
//                  + the weights' gradients
//   FP8 backward   grad_q, grad_k 2*T*QK + grad_v 2*T*Hkv*Dv + qk 2*T*QK + angles + weights
//                  + grad_scale 4 + grad_row T*qkv_dim + grad_t T*qkv_dim + the weights' gradients
// (rotary alone, no norm and no weights as in the Qwen3-8B/no-norm variant, reads no qk), where
// the angles are factor tables 2*2*T*W (W = D, 2D paired) or a cos/sin cache read once
// (2*P*r) and its positions (8*T), and the weights 2*D each.
// GB/s = bytes / median time; "%copy" = that against the device-to-device copy bandwidth measured
// in the same run (cudaMemcpyAsync of a 2 GiB buffer, bytes read + written). "anchor" is the
// reference Triton kernel's time at that shape, as measured on an H200 in the developers' shared
// folder (../shared/ANCHORS.md, outside this repository; copied into anchor_ms below), and
// "speedup" the anchor over this run's median, where an anchor exists for the shape.
// Results: a table on stdout; with --csv, one line per case plus the device, date and commit.
// QKVFUSE_ROPE_GENERAL_ONLY=1 (read by the library) runs every rope call on the general kernel:
// against a normal run, what each specialization of the kernel family earns (device_run.sh ab).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_common.cuh"
#include "qkvfuse/qkvfuse.hpp"

namespace {

using namespace qkvfuse;
using namespace qkvfuse::bench;

// ---- results ------------------------------------------------------------------------------------

struct Row {
  std::string kernel, mode;
  int64_t tokens = 0, heads = 0, kv_heads = 0, head_dim = 0, v_dim = 0;
  double ms = NAN, bytes = NAN, gbps = NAN, pct_copy = NAN, anchor_ms = NAN;
  std::string note;
};

std::vector<Row> g_rows;
double g_copy_gbps = NAN;
size_t g_l2_bytes = 50u << 20;

std::string num(double v, const char* fmt) {
  if (std::isnan(v)) return "-";
  char buf[32];
  std::snprintf(buf, sizeof(buf), fmt, v);
  return buf;
}

void add_row(Row row) {
  if (!std::isnan(row.ms) && !std::isnan(row.bytes)) {
    row.gbps = row.bytes / (row.ms * 1e-3) / 1e9;
    row.pct_copy = 100.0 * row.gbps / g_copy_gbps;
  }
  const std::string heads = row.kv_heads == row.heads
                                ? " H=" + std::to_string(row.heads)
                                : " H=" + std::to_string(row.heads) + "/" +
                                      std::to_string(row.kv_heads);
  const std::string shape = "T=" + std::to_string(row.tokens) + heads +
                            " D=" + std::to_string(row.head_dim) +
                            (row.v_dim ? " Dv=" + std::to_string(row.v_dim) : std::string());
  std::printf("%-22s %-11s %-26s %9s %9s %8s %7s %9s %8s  %s\n", row.kernel.c_str(),
              row.mode.c_str(), shape.c_str(), num(row.ms, "%.4f").c_str(),
              num(row.bytes / 1e6, "%.1f").c_str(), num(row.gbps, "%.0f").c_str(),
              num(row.pct_copy, "%.1f").c_str(), num(row.anchor_ms, "%.4f").c_str(),
              num(row.anchor_ms / row.ms, "%.2fx").c_str(), row.note.c_str());
  std::fflush(stdout);
  g_rows.push_back(std::move(row));
}

/// Enough rotating sets (at least 3) that one pass over them exceeds 3x the L2.
int rotation_sets(double set_bytes) {
  return bench::rotation_sets(set_bytes, g_l2_bytes, 3);
}

void bench_copy(cudaStream_t stream, int iters) {
  const size_t bytes = size_t(2) << 30;
  Buffer src = allocate(bytes), dst = allocate(bytes);
  BENCH_CUDA(cudaMemsetAsync(src.get(), 1, bytes, stream));
  const float ms = time_median(
      [&](int) {
        BENCH_CUDA(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, stream));
      },
      stream, std::max(10, iters / 5), false, 2);
  g_copy_gbps = 2.0 * double(bytes) / (ms * 1e-3) / 1e9;
  std::printf("%-22s %-11s %-26s %9.4f %9.1f %8.0f %7.1f  bytes read + written\n", "copy",
              "D2D", "2 GiB", ms, 2.0 * double(bytes) / 1e6, g_copy_gbps, 100.0);
}

__global__ void empty_kernel() {}

/// Hand-written copies, to tell whether cudaMemcpyAsync is the ceiling of the timing method at a
/// size or merely one copy: 16-byte vectors, read-once loads that bypass L1, every thread's
/// kUnroll loads issued before its stores. One-shot grid (one thread per kUnroll vectors, like the
/// rope kernels' plain grids) when `persistent_blocks` is 0, else that many CTAs striding.
template <int kUnroll>
__global__ void __launch_bounds__(256) copy_kernel(const uint4* src, uint4* dst, size_t n,
                                                   unsigned persistent_blocks) {
  const size_t stride = persistent_blocks ? size_t(persistent_blocks) * 256 * kUnroll
                                          : size_t(gridDim.x) * 256 * kUnroll;
  for (size_t base = size_t(blockIdx.x) * 256 * kUnroll + threadIdx.x; base < n; base += stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const size_t i = base + size_t(k) * 256;
      if (i < n) {
        asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(v[k].x), "=r"(v[k].y), "=r"(v[k].z), "=r"(v[k].w)
            : "l"(src + i));
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const size_t i = base + size_t(k) * 256;
      if (i < n) dst[i] = v[k];
    }
  }
}

/// What the timing method itself allows at the kernels' sizes: cudaMemcpyAsync of exactly the
/// bytes a kernel moves (half read, half written), timed like the kernels (own events, GPU held by
/// the spin kernel, buffers rotated past L2), against the 2 GiB copy; and an empty kernel, the
/// fixed cost of one timed launch. A kernel of these sizes cannot be expected to beat the copy of
/// its own bytes. Printed only (not CSV rows): context for the % copy column.
void bench_copy_sizes(cudaStream_t stream, int iters) {
  const float empty_ms = time_median(
      [&](int) {
        empty_kernel<<<1, 32, 0, stream>>>();
        BENCH_CUDA(cudaGetLastError());
      },
      stream, iters, true);
  std::printf("%-22s %-11s %-26s %9.4f %9s %8s %7s  one timed launch of an empty kernel\n",
              "empty kernel", "-", "<<<1, 32>>>", empty_ms, "-", "-", "-");
  // Bytes moved (read + written) by: the weight bank quantize, quantize x, the forward, the bf16
  // backward and the FP8 backward at T = 49152, H = 6, D = Dv = 128.
  for (const double total_mb : {70.8, 151.0, 327.0, 478.0, 629.0}) {
    const size_t half = size_t(total_mb * 1e6 / 2) / 256 * 256;
    const int sets = rotation_sets(2.0 * double(half));
    std::vector<Buffer> src, dst;
    for (int i = 0; i < sets; ++i) {
      src.push_back(allocate(half));
      dst.push_back(allocate(half));
      BENCH_CUDA(cudaMemsetAsync(src.back().get(), 1, half, stream));
    }
    const float ms = time_median(
        [&](int i) {
          BENCH_CUDA(cudaMemcpyAsync(dst[size_t(i % sets)].get(), src[size_t(i % sets)].get(), half,
                                     cudaMemcpyDeviceToDevice, stream));
        },
        stream, iters, true);
    const double gbps = 2.0 * double(half) / (ms * 1e-3) / 1e9;
    std::printf("%-22s %-11s %-26s %9.4f %9.1f %8.0f %7.1f  same-size copy, %d rotating sets\n",
                "copy", "D2D", (std::to_string(int(total_mb)) + " MB moved").c_str(), ms,
                2.0 * double(half) / 1e6, gbps, 100.0 * gbps / g_copy_gbps, sets);
    // The hand-written copies of the same bytes, same buffers, same timing.
    const size_t vectors = half / 16;
    int sms = 0;
    BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    struct Variant {
      const char* name;
      void (*kernel)(const uint4*, uint4*, size_t, unsigned);
      int unroll;
      unsigned persistent;
    };
    const Variant variants[] = {
        {"kernel x2", copy_kernel<2>, 2, 0},
        {"kernel x4", copy_kernel<4>, 4, 0},
        {"kernel x8", copy_kernel<8>, 8, 0},
        {"kernel x4 8/SM", copy_kernel<4>, 4, unsigned(8 * sms)},
    };
    for (const Variant& variant : variants) {
      const size_t per_block = size_t(256) * size_t(variant.unroll);
      const unsigned blocks = variant.persistent
                                  ? variant.persistent
                                  : unsigned((vectors + per_block - 1) / per_block);
      const float kernel_ms = time_median(
          [&](int i) {
            variant.kernel<<<blocks, 256, 0, stream>>>(
                static_cast<const uint4*>(src[size_t(i % sets)].get()),
                static_cast<uint4*>(dst[size_t(i % sets)].get()), vectors, variant.persistent);
            BENCH_CUDA(cudaGetLastError());
          },
          stream, iters, true);
      const double kernel_gbps = 2.0 * double(half) / (kernel_ms * 1e-3) / 1e9;
      std::printf("%-22s %-11s %-26s %9.4f %9.1f %8.0f %7.1f  same-size copy kernel\n", "copy",
                  variant.name, (std::to_string(int(total_mb)) + " MB moved").c_str(), kernel_ms,
                  2.0 * double(half) / 1e6, kernel_gbps, 100.0 * kernel_gbps / g_copy_gbps);
    }
  }
}

// ---- the cases ----------------------------------------------------------------------------------

enum class Mode { kPlain, kPaired, kKeyOffset };

const char* mode_name(Mode m) {
  switch (m) {
    case Mode::kPlain: return "plain";
    case Mode::kPaired: return "paired";
    case Mode::kKeyOffset: return "key_offset";
  }
  return "?";
}

/// A layout and its sizes. The speedrun's cases (name empty) use factor tables, interleaved
/// lanes and a weightless norm; the model cases NeoX lanes, a cos/sin cache of kPositions rows
/// read at positions t mod kPositions, and both norm weights.
struct Shape {
  int64_t tokens, heads, head_dim, v_dim;
  Mode mode;
  int64_t kv_heads = 0;          ///< 0: heads
  const char* model = nullptr;  ///< the general layouts' model name, or nullptr (speedrun)
  float weight_offset = 0.0f;
  // The model cases' options (--variants turns them off one at a time).
  bool cache = true;    ///< cos/sin cache at positions (else factor tables)
  bool neox = true;     ///< NeoX lanes (else interleaved)
  bool weights = true;  ///< both norm weights
  bool normalize = true;  ///< the RMS norm (false, with no weights: Llama's and Mistral's layout)

  static constexpr int64_t kPositions = 8192;
  bool general() const { return model != nullptr; }
  int64_t kv() const { return kv_heads ? kv_heads : heads; }
  int64_t qk_features() const { return (heads + kv()) * head_dim; }
  int64_t qkv_dim() const { return qk_features() + kv() * v_dim; }
  int64_t factor_width() const { return mode == Mode::kPaired ? 2 * head_dim : head_dim; }
  int64_t out_tokens() const { return mode == Mode::kPaired ? 2 * tokens : tokens; }
  int64_t out_heads(int64_t n) const { return mode == Mode::kPaired ? n / 2 : n; }
  const char* label() const { return general() ? model : mode_name(mode); }
  /// qk as the model has it: the Q/K columns of the packed GEMM output (paired: dense).
  int64_t qk_row_stride() const { return mode == Mode::kPaired ? qk_features() : qkv_dim(); }
  /// Whether the backward reads the saved rows qk: not for rotary alone (no norm, no weights).
  bool reads_rows() const { return !general() || normalize || weights; }
  /// Bytes of both norm weights (bf16, D each): read by every kernel, and written again as their
  /// gradients by the backward kernels.
  double weight_bytes() const { return general() && weights ? 2 * 2.0 * head_dim : 0.0; }
  /// Bytes of the angle source and the weights (see the file comment).
  double angle_bytes() const {
    if (general() && cache) return 2.0 * kPositions * head_dim + 8.0 * tokens + weight_bytes();
    return 2 * 2.0 * tokens * factor_width() + weight_bytes();
  }
};

/// Reference Triton times (../shared/ANCHORS.md, outside the repository) for the shapes it lists,
/// else NaN.
double anchor_ms(const std::string& kernel, const Shape& s) {
  struct Anchor {
    const char* kernel;
    int64_t heads, head_dim;
    Mode mode;
    double ms;
  };
  static const Anchor anchors[] = {
      {"qk_norm_rope", 6, 128, Mode::kPlain, 0.0856},
      {"qk_norm_rope", 6, 128, Mode::kPaired, 0.0905},
      {"qk_norm_rope", 6, 128, Mode::kKeyOffset, 0.0964},
      {"qk_norm_rope", 12, 64, Mode::kPlain, 0.0945},
      {"qk_norm_rope", 8, 128, Mode::kPlain, 0.1082},
      {"qkv_backward_fp8", 6, 128, Mode::kPlain, 0.283},
      {"qkv_backward_fp8", 6, 128, Mode::kPaired, 0.285},
      {"qkv_backward_fp8", 6, 128, Mode::kKeyOffset, 0.332},
      {"qkv_backward_fp8", 12, 64, Mode::kPlain, 0.265},
      {"qkv_backward_fp8", 6, 96, Mode::kPlain, 0.213},
  };
  if (s.general() || s.tokens != 49152 || s.v_dim != 128) return NAN;
  for (const Anchor& a : anchors) {
    if (kernel == a.kernel && s.heads == a.heads && s.head_dim == a.head_dim && s.mode == a.mode) {
      return a.ms;
    }
  }
  return NAN;
}

__global__ void positions_kernel(int64_t* positions, int64_t tokens, int64_t period) {
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < tokens;
       t += int64_t(gridDim.x) * blockDim.x) {
    positions[t] = t % period;
  }
}

/// One rotating set of every buffer the three kernels touch.
struct BufferSet {
  Buffer qkv;                 // [T, qk_row_stride] bf16, qk at its start
  Buffer factor1, factor2;    // [T, W] bf16 (speedrun)
  Buffer cos_sin, positions;  // [P, D] bf16, [T] int64 (general)
  Buffer q_weight, k_weight;  // [D] bf16 (general)
  Buffer q, k;                // [outT, outH, D] bf16
  Buffer grad_q, grad_k;      // likewise
  Buffer grad_v;              // [T, Hkv, Dv] bf16
  Buffer grad_qk;             // [T, Hq + Hkv, D] bf16
  Buffer grad_row, grad_t;    // [T, qkv_dim], [qkv_dim, T] e4m3
  Buffer grad_q_weight, grad_k_weight, workspace;  // [D] bf16, float32 (general)
  Buffer grad_scale;          // float32 scalar
};

BufferSet make_set(const Shape& s) {
  BufferSet b;
  const size_t qk_elems = size_t(s.tokens * s.qk_row_stride());
  const size_t q_elems = size_t(s.out_tokens() * s.out_heads(s.heads) * s.head_dim);
  const size_t k_elems = size_t(s.out_tokens() * s.out_heads(s.kv()) * s.head_dim);
  const size_t v_elems = size_t(s.tokens * s.kv() * s.v_dim);
  b.qkv = allocate(2 * qk_elems);
  fill_bf16(b.qkv.get(), qk_elems, 1.0f);
  if (s.general() && s.cache) {
    const size_t cache_elems = size_t(Shape::kPositions * s.head_dim);
    b.cos_sin = allocate(2 * cache_elems);
    fill_bf16(b.cos_sin.get(), cache_elems, 0.5f);
    b.positions = allocate(8 * size_t(s.tokens));
    positions_kernel<<<256, 256>>>(static_cast<int64_t*>(b.positions.get()), s.tokens,
                                   Shape::kPositions);
    BENCH_CUDA(cudaGetLastError());
  }
  if (s.general() && s.weights) {
    b.q_weight = allocate(2 * size_t(s.head_dim));
    b.k_weight = allocate(2 * size_t(s.head_dim));
    fill_bf16(b.q_weight.get(), size_t(s.head_dim), 1.0f);
    fill_bf16(b.k_weight.get(), size_t(s.head_dim), 1.0f);
    b.grad_q_weight = allocate(2 * size_t(s.head_dim));
    b.grad_k_weight = allocate(2 * size_t(s.head_dim));
  }
  if (!(s.general() && s.cache)) {
    const size_t factor_elems = size_t(s.tokens * s.factor_width());
    b.factor1 = allocate(2 * factor_elems);
    b.factor2 = allocate(2 * factor_elems);
    fill_bf16(b.factor1.get(), factor_elems, 0.5f);
    fill_bf16(b.factor2.get(), factor_elems, 0.5f);
  }
  b.q = allocate(2 * q_elems);
  b.k = allocate(2 * k_elems);
  b.grad_q = allocate(2 * q_elems);
  b.grad_k = allocate(2 * k_elems);
  fill_bf16(b.grad_q.get(), q_elems, 0.01f);
  fill_bf16(b.grad_k.get(), k_elems, 0.01f);
  b.grad_v = allocate(2 * v_elems);
  fill_bf16(b.grad_v.get(), v_elems, 0.01f);
  b.grad_qk = allocate(2 * size_t(s.tokens * s.qk_features()));
  b.grad_row = allocate(size_t(s.tokens * s.qkv_dim()));
  b.grad_t = allocate(size_t(s.tokens * s.qkv_dim()));
  b.grad_scale = allocate(sizeof(float));
  const float scale = 1.0f / 448.0f;
  BENCH_CUDA(cudaMemcpy(b.grad_scale.get(), &scale, sizeof(float), cudaMemcpyHostToDevice));
  return b;
}

struct Views {
  TensorView qk, q, k, grad_q, grad_k, grad_v, grad_qk, grad_row, grad_t, grad_scale,
      grad_q_weight, grad_k_weight;
  RopeLayout layout;
};

Views views_of(const Shape& s, const BufferSet& b) {
  const DType bf16 = DType::kBFloat16;
  Views v;
  v.qk = make_view(b.qkv.get(), bf16, kDevice, {s.tokens, s.heads + s.kv(), s.head_dim},
                   {s.qk_row_stride(), s.head_dim, 1});
  const int64_t out_tokens = s.out_tokens();
  v.q = make_view(b.q.get(), bf16, kDevice, {out_tokens, s.out_heads(s.heads), s.head_dim});
  v.k = make_view(b.k.get(), bf16, kDevice, {out_tokens, s.out_heads(s.kv()), s.head_dim});
  v.grad_q = make_view(b.grad_q.get(), bf16, kDevice, {out_tokens, s.out_heads(s.heads), s.head_dim});
  v.grad_k = make_view(b.grad_k.get(), bf16, kDevice, {out_tokens, s.out_heads(s.kv()), s.head_dim});
  v.grad_v = make_view(b.grad_v.get(), bf16, kDevice, {s.tokens, s.kv(), s.v_dim});
  v.grad_qk = make_view(b.grad_qk.get(), bf16, kDevice, {s.tokens, s.heads + s.kv(), s.head_dim});
  v.grad_row = make_view(b.grad_row.get(), DType::kFloat8E4M3, kDevice, {s.tokens, s.qkv_dim()});
  v.grad_t = make_view(b.grad_t.get(), DType::kFloat8E4M3, kDevice, {s.qkv_dim(), s.tokens});
  v.grad_scale = make_view(b.grad_scale.get(), DType::kFloat32, kDevice, {});
  RopeLayout& layout = v.layout;
  layout.num_heads = s.heads;
  layout.num_kv_heads = s.kv();
  layout.paired = s.mode == Mode::kPaired;
  layout.key_offset = s.mode == Mode::kKeyOffset;
  if (s.general()) {
    layout.rotary_style = s.neox ? RotaryStyle::kNeox : RotaryStyle::kInterleaved;
    layout.normalize = s.normalize;
    layout.eps = 1e-6f;
    if (s.weights) {
      layout.weight_offset = s.weight_offset;
      layout.q_weight = make_view(b.q_weight.get(), bf16, kDevice, {s.head_dim});
      layout.k_weight = make_view(b.k_weight.get(), bf16, kDevice, {s.head_dim});
      v.grad_q_weight = make_view(b.grad_q_weight.get(), bf16, kDevice, {s.head_dim});
      v.grad_k_weight = make_view(b.grad_k_weight.get(), bf16, kDevice, {s.head_dim});
    }
  }
  if (s.general() && s.cache) {
    layout.cos_sin = make_view(b.cos_sin.get(), bf16, kDevice, {Shape::kPositions, s.head_dim});
    layout.positions = make_view(b.positions.get(), DType::kInt64, kDevice, {s.tokens});
  } else {
    layout.rotary_dim = layout.key_offset ? s.head_dim / 2 : s.head_dim;
    layout.factor1 = make_view(b.factor1.get(), bf16, kDevice, {s.tokens, s.factor_width()});
    layout.factor2 = make_view(b.factor2.get(), bf16, kDevice, {s.tokens, s.factor_width()});
  }
  return v;
}

/// The minimum bytes of each kernel (see the file comment).
double forward_bytes(const Shape& s) {
  const double qk = 2.0 * double(s.tokens) * double(s.qk_features());
  return qk + s.angle_bytes() + qk;
}
double backward_bytes(const Shape& s) {
  const double qk = 2.0 * double(s.tokens) * double(s.qk_features());
  return (s.reads_rows() ? 3 : 2) * qk + s.angle_bytes() + s.weight_bytes();
}
double fp8_bytes(const Shape& s) {
  const double t = double(s.tokens);
  const double qk = 2.0 * t * double(s.qk_features());
  return (s.reads_rows() ? 2 : 1) * qk + 2 * t * double(s.kv() * s.v_dim) + s.angle_bytes() + 4 +
         2 * t * double(s.qkv_dim()) + s.weight_bytes();
}

void bench_shape(const Shape& s, cudaStream_t stream, int iters, const std::string& only) {
  const double set_bytes = fp8_bytes(s) + forward_bytes(s) + backward_bytes(s);
  const int sets = rotation_sets(set_bytes / 3);
  std::vector<BufferSet> buffers;
  std::vector<Views> views;
  for (int i = 0; i < sets; ++i) {
    buffers.push_back(make_set(s));
    views.push_back(views_of(s, buffers.back()));
  }
  // The weight gradients' workspace: one per rotating set, sized by the library.
  std::vector<Buffer> workspaces;
  for (int i = 0; i < sets; ++i) {
    QkvBackwardFp8Params fp8;
    fp8.qk = views[size_t(i)].qk;
    fp8.layout = views[size_t(i)].layout;
    QkNormRopeBackwardParams bwd;
    bwd.qk = fp8.qk;
    bwd.layout = fp8.layout;
    const int64_t floats = std::max(backward_workspace_size(fp8), backward_workspace_size(bwd));
    workspaces.push_back(allocate(4 * size_t(std::max<int64_t>(floats, 1))));
  }
  const auto workspace = [&](int i, int64_t floats) {
    return floats ? make_view(workspaces[size_t(i)].get(), DType::kFloat32, kDevice, {floats})
                  : TensorView{};
  };
  const std::string note = std::to_string(sets) + " rotating sets";
  auto measure = [&](const char* kernel, double bytes, const std::function<void(int)>& op) {
    if (!only.empty() && only != kernel) return;
    Row row;
    row.kernel = kernel;
    row.mode = s.label();
    row.tokens = s.tokens;
    row.heads = s.heads;
    row.kv_heads = s.kv();
    row.head_dim = s.head_dim;
    row.v_dim = std::string(kernel) == "qkv_backward_fp8" ? s.v_dim : 0;
    row.bytes = bytes;
    row.anchor_ms = anchor_ms(kernel, s);
    row.note = note;
    try {
      row.ms = time_median([&](int i) { op(i % sets); }, stream, iters, true);
    } catch (const std::exception& e) {
      row.note = std::string("FAILED: ") + e.what();
    }
    add_row(row);
  };
  const Stream api_stream = stream;
  measure("qk_norm_rope", forward_bytes(s), [&](int i) {
    const Views& v = views[size_t(i)];
    qk_norm_rope({.qk = v.qk, .q = v.q, .k = v.k, .layout = v.layout, .stream = api_stream});
  });
  measure("qk_norm_rope_backward", backward_bytes(s), [&](int i) {
    const Views& v = views[size_t(i)];
    QkNormRopeBackwardParams p{.grad_q = v.grad_q,
                               .grad_k = v.grad_k,
                               .qk = v.qk,
                               .grad_qk = v.grad_qk,
                               .grad_q_weight = v.grad_q_weight,
                               .grad_k_weight = v.grad_k_weight,
                               .workspace = {},
                               .layout = v.layout,
                               .stream = api_stream};
    p.workspace = workspace(i, backward_workspace_size(p));
    qk_norm_rope_backward(p);
  });
  measure("qkv_backward_fp8", fp8_bytes(s), [&](int i) {
    const Views& v = views[size_t(i)];
    QkvBackwardFp8Params p{.grad_q = v.grad_q,
                           .grad_k = v.grad_k,
                           .grad_v = v.grad_v,
                           .qk = v.qk,
                           .grad_scale = v.grad_scale,
                           .grad_row = v.grad_row,
                           .grad_t = v.grad_t,
                           .grad_q_weight = v.grad_q_weight,
                           .grad_k_weight = v.grad_k_weight,
                           .workspace = {},
                           .layout = v.layout,
                           .stream = api_stream};
    p.workspace = workspace(i, backward_workspace_size(p));
    qkv_backward_fp8(p);
  });
}

void write_csv(const std::string& path, const cudaDeviceProp& prop) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    return;
  }
  const std::time_t now = std::time(nullptr);
  char date[64];
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  std::fprintf(f, "# qkvfuse_bench_kernels\n# device: %s (%d SMs)\n# date: %s\n# commit: %s\n",
               prop.name, prop.multiProcessorCount, date, commit_id());
  std::fprintf(f, "# copy bandwidth: %.1f GB/s\n", g_copy_gbps);
  std::fprintf(f,
               "kernel,mode,tokens,heads,kv_heads,head_dim,v_dim,ms,bytes,gbps,pct_copy,anchor_ms,"
               "speedup_vs_anchor,note\n");
  for (const Row& r : g_rows) {
    std::string note = r.note;
    std::replace(note.begin(), note.end(), ',', ';');
    std::fprintf(f, "%s,%s,%lld,%lld,%lld,%lld,%lld,%s,%.0f,%s,%s,%s,%s,%s\n", r.kernel.c_str(),
                 r.mode.c_str(), (long long)r.tokens, (long long)r.heads, (long long)r.kv_heads,
                 (long long)r.head_dim,
                 (long long)r.v_dim, num(r.ms, "%.5f").c_str(), r.bytes,
                 num(r.gbps, "%.1f").c_str(), num(r.pct_copy, "%.2f").c_str(),
                 num(r.anchor_ms, "%.4f").c_str(), num(r.anchor_ms / r.ms, "%.3f").c_str(),
                 note.c_str());
  }
  std::fclose(f);
}

int run(int argc, char** argv) {
  Options options;
  if (!parse_options(argc, argv, options)) return 2;
  const std::string& csv = options.csv;
  const int64_t tokens = options.tokens;
  const int iters = options.iters;
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  g_l2_bytes = size_t(prop.l2CacheSize);
  std::printf("device: %s, %d SMs, L2 %zu MiB; commit %s; T = %lld; median of %d\n", prop.name,
              prop.multiProcessorCount, g_l2_bytes >> 20, commit_id(), (long long)tokens, iters);
  std::printf("%-22s %-11s %-26s %9s %9s %8s %7s %9s %8s  %s\n", "kernel", "mode", "shape", "ms",
              "MB", "GB/s", "%copy", "anchor ms", "speedup", "note");
  cudaStream_t stream = nullptr;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  bench_copy(stream, iters);
  if ((options.kernel.empty() && options.model.empty()) || options.kernel == "copy") {
    bench_copy_sizes(stream, iters);
  }

  const Mode modes[] = {Mode::kPlain, Mode::kPaired, Mode::kKeyOffset};
  struct Config {
    int64_t heads, head_dim;
  };
  // The speedrun's layers (C = 768: H=6 at D=128/96, H=12 at D=64), a C = 1024 one (H=8), and
  // D = 100 (not a multiple of 8): the kernels' 4-byte chunks (src/cuda/rope_paths.hpp).
  for (const Config c : {Config{6, 128}, Config{12, 64}, Config{6, 96}, Config{8, 128}, Config{6, 100}}) {
    if (!options.model.empty()) break;
    if (options.head_dim != 0 && c.head_dim != options.head_dim) continue;
    for (Mode mode : modes) {
      try {
        bench_shape({tokens, c.heads, c.head_dim, 128, mode}, stream, iters, options.kernel);
      } catch (const std::exception& e) {
        std::printf("H=%lld D=%lld %s: FAILED: %s\n", (long long)c.heads, (long long)c.head_dim,
                    mode_name(mode), e.what());
      }
    }
  }
  // The general layouts' model shapes (SPEC.md section 8), T = 32768 = 4 sequences of 8192.
  const Shape models[] = {
      {32768, 32, 128, 128, Mode::kPlain, 8, "Qwen3-8B"},
      {32768, 16, 256, 256, Mode::kPlain, 8, "Gemma3-12B", 1.0f},
      {32768, 16, 128, 128, Mode::kPlain, 8, "Qwen3-0.6B"},
  };
  std::vector<Shape> cases(std::begin(models), std::end(models));
  if (std::getenv("QKVFUSE_BENCH_VARIANTS") != nullptr) {
    // Qwen3-8B with one option off at a time, to attribute the general layouts' cost.
    Shape tables = models[0], interleaved = models[0], no_weights = models[0], seed = models[0];
    tables.model = "Qwen3-8B/tables";
    tables.cache = false;
    interleaved.model = "Qwen3-8B/interleaved";
    interleaved.neox = false;
    no_weights.model = "Qwen3-8B/no-weights";
    no_weights.weights = false;
    seed.model = "Qwen3-8B/speedrun-layout";
    seed.cache = seed.neox = seed.weights = false;
    // No QK norm at all, the layout of Llama and Mistral (which the transformers integration
    // sends through the general kernels): rotary only, at Llama-3.1-8B's heads.
    Shape no_norm = models[0];
    no_norm.model = "Qwen3-8B/no-norm";
    no_norm.normalize = no_norm.weights = false;
    cases.insert(cases.end(), {tables, interleaved, no_weights, seed, no_norm});
  }
  for (const Shape& shape : cases) {
    if (options.head_dim != 0 && shape.head_dim != options.head_dim) continue;
    if (!options.model.empty() && options.model != shape.model) continue;
    try {
      bench_shape(shape, stream, iters, options.kernel);
    } catch (const std::exception& e) {
      std::printf("%s: FAILED: %s\n", shape.model, e.what());
    }
  }
  cudaStreamDestroy(stream);
  if (!csv.empty()) write_csv(csv, prop);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qkvfuse_bench_kernels: %s\n", e.what());
    return 1;
  }
}
