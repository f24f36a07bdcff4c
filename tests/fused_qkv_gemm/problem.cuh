// problem.cuh: one fused-QKV-forward problem on the GPU, for the check and the benchmark of the
// fused QKV GEMM: random e4m3 operands and rotary tables generated on the device, and the three
// ways to compute the forward:
//   unfused   fp8_gemm (cuBLASLt) into qkv [T, N], then qk_norm_rope on its Q/K columns with the
//             same RopeLayout: the library's forward today (SPEC.md section 6); v is qkv's V
//             columns. For a T that is not a multiple of 16 (cuBLASLt's FP8 rule) the GEMM runs
//             over zero rows up to the next multiple (gemm_rows()) and only the first T are read
//   cutlass   cutlass_fp8_gemm into qkv (over gemm_rows() too): the fused kernel's main loop with
//             a plain epilogue
//   fused     fused_qkv_gemm: q, k, v (and optionally the raw qk) straight from the GEMM
// Everything runs on the caller's stream. Included by one translation unit per executable.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/fused_qkv_gemm.hpp"
#include "fused_qkv_gemm/reference.hpp"
#include "qkvfuse/qkvfuse.hpp"

#define FQ_CUDA(expr)                                                                      \
  do {                                                                                     \
    const cudaError_t fq_status_ = (expr);                                                 \
    if (fq_status_ != cudaSuccess) {                                                       \
      throw std::runtime_error(std::string(#expr) + " failed: " +                          \
                               cudaGetErrorString(fq_status_) + " [" + __FILE__ + ":" +   \
                               std::to_string(__LINE__) + "]");                            \
    }                                                                                      \
  } while (0)

namespace qkvfuse::fused_test {

inline constexpr Device kGpu{DeviceType::kCUDA, 0};

struct CudaFree {
  void operator()(void* p) const { cudaFree(p); }
};
using DeviceBuffer = std::unique_ptr<void, CudaFree>;

inline DeviceBuffer device_alloc(size_t bytes) {
  void* p = nullptr;
  FQ_CUDA(cudaMalloc(&p, bytes < 16 ? 16 : bytes));
  return DeviceBuffer(p);
}

// ---- device-side generation ---------------------------------------------------------------------

__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 32);
}

/// Roughly normal (sum of 4 uniforms), unit variance: realistic bit patterns for GEMM operands.
__device__ __forceinline__ float hash_normal(uint64_t i, uint64_t seed) {
  uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull ^ seed;
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    x = mix64(x + k);
    sum += float(x >> 40) * (1.0f / 16777216.0f);
  }
  return (sum - 2.0f) * 1.7320508f;
}

__global__ void fill_e4m3_kernel(uint8_t* out, size_t count, uint64_t seed, float sigma) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    out[i] = float_to_e4m3(sigma * hash_normal(i, seed));
  }
}

/// Interleaved rotary tables [T, width] (width = D, or 2D paired: two D-wide halves): pair i of
/// each half turns by t * base^(-2i/r), r = rotary_dim. f1 = cos, f2 = sin with the first lane of
/// each pair negated (SPEC.md 1). Lanes >= r, which pass through without reading the tables
/// (SPEC.md 8), hold angles too (frequencies over D), not the stationary (1, 0): a kernel that
/// read them would show.
template <typename T>
__global__ void fill_factors_kernel(T* f1, T* f2, int64_t tokens, int width, int head_dim,
                                    int rotary_dim) {
  const int64_t count = tokens * width;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / width;
    const int d = int(i % width) % head_dim;
    float c, s;
    const int span = d < rotary_dim ? rotary_dim : head_dim;
    const float inv_freq = powf(1024.0f, -float(d / 2) * 2.0f / float(span));
    sincosf(float(t) * inv_freq, &s, &c);
    if (d % 2 == 0) s = -s;
    if constexpr (sizeof(T) == 2) {
      reinterpret_cast<uint16_t*>(f1)[i] = float_to_bf16(c);
      reinterpret_cast<uint16_t*>(f2)[i] = float_to_bf16(s);
    } else {
      f1[i] = c;
      f2[i] = s;
    }
  }
}

inline uint64_t g_seed = 1;

inline void fill_e4m3(void* p, size_t count, float sigma, cudaStream_t stream) {
  fill_e4m3_kernel<<<1024, 256, 0, stream>>>(static_cast<uint8_t*>(p), count, g_seed++, sigma);
  FQ_CUDA(cudaGetLastError());
}

// ---- the problem ------------------------------------------------------------------------------

/// Sizes and options of one forward.
struct ProblemSpec {
  QkvShape shape;
  int64_t channels = 768;   ///< C, the GEMM's K
  bool fp32_factors = false;
  std::string name() const {
    std::string s = "T=" + std::to_string(shape.tokens) + " D=" + std::to_string(shape.head_dim) +
                    " Hq=" + std::to_string(shape.q_heads) + " Hkv=" + std::to_string(shape.kv_heads) +
                    " Dv=" + std::to_string(shape.v_dim);
    if (shape.paired) s += " paired";
    if (shape.key_offset) s += " key_offset(r=" + std::to_string(shape.rotary_dim) + ")";
    if (shape.neox) s += " neox";
    s += fp32_factors ? " fp32-factors" : " bf16-factors";
    return s;
  }
};

/// The device buffers of one problem. Scales are the speedrun's kind of values: x_scale = 8/448,
/// weight scale amax/448-like, qkv_scale 1.3.
struct Problem {
  ProblemSpec spec;
  DeviceBuffer x, w, scale_a, scale_b, alpha, f1, f2;  // inputs; x [gemm_rows(), C]
  DeviceBuffer qkv;                                     // unfused GEMM output [gemm_rows(), N]
  DeviceBuffer q_ref, k_ref;                            // unfused q, k
  DeviceBuffer q, k, v, qk;                             // fused outputs

  explicit Problem(const ProblemSpec& s, cudaStream_t stream) : spec(s) {
    const QkvShape& sh = s.shape;
    const int64_t T = sh.tokens, C = s.channels, N = sh.n();
    const size_t fsize = s.fp32_factors ? 4 : 2;
    x = device_alloc(size_t(gemm_rows() * C));
    w = device_alloc(size_t(N * C));
    f1 = device_alloc(size_t(T * sh.factor_width()) * fsize);
    f2 = device_alloc(size_t(T * sh.factor_width()) * fsize);
    qkv = device_alloc(size_t(gemm_rows() * N) * 2);
    q_ref = device_alloc(q_elems() * 2);
    k_ref = device_alloc(k_elems() * 2);
    q = device_alloc(q_elems() * 2);
    k = device_alloc(k_elems() * 2);
    v = device_alloc(size_t(T * sh.kv_heads * sh.v_dim) * 2);
    qk = device_alloc(size_t(T * sh.qk_cols()) * 2);
    // e4m3 operands: x about N(0, 6^2), w N(0, 24^2) (a weight quantized with amax/448); x's
    // padding rows (gemm_rows()) zero.
    FQ_CUDA(cudaMemsetAsync(x.get(), 0, size_t(gemm_rows() * C), stream));
    fill_e4m3(x.get(), size_t(T * C), 6.0f, stream);
    fill_e4m3(w.get(), size_t(N * C), 24.0f, stream);
    const float scales[3] = {8.0f / 448.0f, 0.25f / 448.0f, 1.3f};
    scale_a = device_alloc(4);
    scale_b = device_alloc(4);
    alpha = device_alloc(4);
    FQ_CUDA(cudaMemcpyAsync(scale_a.get(), &scales[0], 4, cudaMemcpyHostToDevice, stream));
    FQ_CUDA(cudaMemcpyAsync(scale_b.get(), &scales[1], 4, cudaMemcpyHostToDevice, stream));
    FQ_CUDA(cudaMemcpyAsync(alpha.get(), &scales[2], 4, cudaMemcpyHostToDevice, stream));
    const int rotary = int(sh.rotary_dim);
    if (s.fp32_factors) {
      fill_factors_kernel<float><<<1024, 256, 0, stream>>>(
          static_cast<float*>(f1.get()), static_cast<float*>(f2.get()), T, int(sh.factor_width()),
          int(sh.head_dim), rotary);
    } else {
      fill_factors_kernel<uint16_t><<<1024, 256, 0, stream>>>(
          static_cast<uint16_t*>(f1.get()), static_cast<uint16_t*>(f2.get()), T,
          int(sh.factor_width()), int(sh.head_dim), rotary);
    }
    FQ_CUDA(cudaGetLastError());
    FQ_CUDA(cudaStreamSynchronize(stream));
  }

  /// Rows of the cuBLASLt GEMM: T rounded up to a multiple of 16, which cuBLASLt's FP8 GEMM
  /// needs (fp8_gemm refuses other M). x and qkv have that many rows, x's past T zero, so qkv's
  /// first T rows are the GEMM of the T tokens; everything else reads those first T rows only.
  int64_t gemm_rows() const { return (spec.shape.tokens + 15) / 16 * 16; }

  /// Elements of q and k: T*Hq*D and T*Hkv*D in either placement ([2T, H/2, D] when paired).
  size_t q_elems() const {
    return size_t(spec.shape.tokens * spec.shape.q_heads * spec.shape.head_dim);
  }
  size_t k_elems() const {
    return size_t(spec.shape.tokens * spec.shape.kv_heads * spec.shape.head_dim);
  }
  int64_t out_heads(int64_t heads) const { return spec.shape.paired ? heads / 2 : heads; }
  DType factor_dtype() const { return spec.fp32_factors ? DType::kFloat32 : DType::kBFloat16; }

  TensorView scalar(const DeviceBuffer& b) const {
    return make_view(b.get(), DType::kFloat32, kGpu, {});
  }

  /// cuBLASLt GEMM into qkv, over gemm_rows() rows (the padding rows come out zero).
  void gemm_cublaslt(cudaStream_t stream) const { fp8_gemm(gemm_params(gemm_rows(), stream)); }
  /// CUTLASS plain-epilogue GEMM into qkv, over gemm_rows() rows as well: cutlass_fp8_gemm
  /// shares fp8_gemm's validation, which asks for M % 16 == 0. Ragged T's edge tiles are the
  /// fused kernel's to exercise.
  void gemm_cutlass(cudaStream_t stream) const {
    cuda::cutlass_fp8_gemm(gemm_params(gemm_rows(), stream));
  }

  /// The norm + rotary of this problem, for the fused GEMM and qk_norm_rope alike.
  RopeLayout layout() const {
    const QkvShape& sh = spec.shape;
    RopeLayout l;
    l.num_heads = sh.q_heads;
    l.num_kv_heads = sh.kv_heads;
    l.rotary_dim = sh.rotary_dim;
    l.rotary_style = sh.neox ? RotaryStyle::kNeox : RotaryStyle::kInterleaved;
    l.eps = sh.eps;
    l.paired = sh.paired;
    l.key_offset = sh.key_offset;
    l.factor1 = make_view(f1.get(), factor_dtype(), kGpu, {sh.tokens, sh.factor_width()});
    l.factor2 = make_view(f2.get(), factor_dtype(), kGpu, {sh.tokens, sh.factor_width()});
    return l;
  }

  /// qk_norm_rope over qkv's Q/K columns into q_ref, k_ref.
  void rope_unfused(cudaStream_t stream) const { rope_from(qkv, spec.shape.n(), q_ref, k_ref, stream); }
  /// qk_norm_rope over the fused kernel's raw qk output into q_ref, k_ref: isolates the epilogue.
  void rope_from_raw(cudaStream_t stream) const {
    rope_from(qk, spec.shape.qk_cols(), q_ref, k_ref, stream);
  }

  void fused(cudaStream_t stream, bool raw_qk, int raster = 0, int swizzle = 1) const {
    cuda::fused_qkv_gemm(fused_params(stream, raw_qk, raster, swizzle));
  }
  /// The arguments of fused(): x, w and the scales in, q, k, v (and qk when raw_qk) out.
  cuda::FusedQkvGemmParams fused_params(cudaStream_t stream, bool raw_qk, int raster = 0,
                                        int swizzle = 1) const {
    const QkvShape& sh = spec.shape;
    const int64_t T = sh.tokens, D = sh.head_dim;
    cuda::FusedQkvGemmParams p;
    p.x_f8 = make_view(x.get(), DType::kFloat8E4M3, kGpu, {T, spec.channels});
    p.weight_f8 = make_view(w.get(), DType::kFloat8E4M3, kGpu, {sh.n(), spec.channels});
    p.scale_a = scalar(scale_a);
    p.scale_b = scalar(scale_b);
    p.alpha = scalar(alpha);
    p.q = make_view(q.get(), DType::kBFloat16, kGpu, {sh.out_tokens(), out_heads(sh.q_heads), D});
    p.k = make_view(k.get(), DType::kBFloat16, kGpu, {sh.out_tokens(), out_heads(sh.kv_heads), D});
    p.v = make_view(v.get(), DType::kBFloat16, kGpu, {T, sh.kv_heads, sh.v_dim});
    if (raw_qk) p.qk = make_view(qk.get(), DType::kBFloat16, kGpu, {T, sh.q_heads + sh.kv_heads, D});
    p.layout = layout();
    p.raster = raster;
    p.swizzle = swizzle;
    p.stream = stream;
    return p;
  }

 private:
  /// x [rows, C] @ w^T into qkv [rows, N]; rows <= gemm_rows().
  Fp8GemmParams gemm_params(int64_t rows, cudaStream_t stream) const {
    const int64_t N = spec.shape.n();
    Fp8GemmParams p;
    p.a = make_view(x.get(), DType::kFloat8E4M3, kGpu, {rows, spec.channels});
    p.b = make_view(w.get(), DType::kFloat8E4M3, kGpu, {N, spec.channels});
    p.scale_a = scalar(scale_a);
    p.scale_b = scalar(scale_b);
    p.alpha = scalar(alpha);
    p.d = make_view(qkv.get(), DType::kBFloat16, kGpu, {rows, N});
    p.fast_accum = true;
    p.stream = stream;
    return p;
  }

  void rope_from(const DeviceBuffer& src, int64_t row_stride, const DeviceBuffer& q_out,
                 const DeviceBuffer& k_out, cudaStream_t stream) const {
    const QkvShape& sh = spec.shape;
    const int64_t T = sh.tokens, D = sh.head_dim;
    QkNormRopeParams p;
    p.qk = make_view(src.get(), DType::kBFloat16, kGpu, {T, sh.q_heads + sh.kv_heads, D},
                     {row_stride, D, 1});
    p.q = make_view(q_out.get(), DType::kBFloat16, kGpu,
                    {sh.out_tokens(), out_heads(sh.q_heads), D});
    p.k = make_view(k_out.get(), DType::kBFloat16, kGpu,
                    {sh.out_tokens(), out_heads(sh.kv_heads), D});
    p.layout = layout();
    p.stream = stream;
    qk_norm_rope(p);
  }
};

/// A device buffer's bf16 bits on the host.
inline std::vector<uint16_t> to_host(const DeviceBuffer& b, size_t count, cudaStream_t stream) {
  std::vector<uint16_t> out(count);
  FQ_CUDA(cudaMemcpyAsync(out.data(), b.get(), count * 2, cudaMemcpyDeviceToHost, stream));
  FQ_CUDA(cudaStreamSynchronize(stream));
  return out;
}

}  // namespace qkvfuse::fused_test
