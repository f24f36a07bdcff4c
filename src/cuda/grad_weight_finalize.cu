// grad_weight_finalize.cu: the last step of the packed QKV backward (SPEC.md section 6), the CUDA
// backend of GradWeightFinalizeParams (src/backend.hpp).
//
// Math, with G = [grad_qk_weight; grad_v_weight] the unscaled wgrad GEMM output (bf16) and
// W = [qk_weight; v_weight] the bf16 master weights:
//   grad_qkv_scale = sum over all elements of G * W          (fp32)
//   G             <- bf16(G * qkv_scale)                      (in place; fp32 product, RNE)
// The sum reads G before it is scaled, as the reference does (its sum uses the GEMM output).
// A bf16 x bf16 product has at most 16 significant bits, so each product is exact in fp32 (short
// of overflow or underflow) and only the additions round.
//
// Design: one pass over G and W (read G and W, write G: the scale multiply rides along with the
// reduction's read instead of costing its own pass), then a one-warp kernel for the final sum.
// Determinism: exactly kGradScalePartials blocks, whatever the device. The flattened work (units
// of 8 elements, Q/K part then V part, row-major) is cut into kGradScalePartials contiguous
// ranges by a formula that depends only on the shapes; in block k thread i takes units
// begin_k + i, + 256, ... in increasing order and adds their products in element order; the
// block combines its threads with a fixed butterfly and writes partials[k]; the second kernel
// adds partials[0..P) in a fixed order. Every addition therefore happens in the same order on
// every run and every device: the bits of grad_qkv_scale depend only on the inputs.
// (264 = 2 x 132 blocks of 256 threads, each with 4 loads of G and 4 of W in flight, keep the H200
// busy for the ~11 MB this moves at C = 768, qkv_dim = 2304.)
#include <cuda_runtime.h>

#include <cstdint>

#include "backend.hpp"
#include "cuda/check.hpp"
#include "cuda/device_math.cuh"
#include "qkvfuse/packed_qkv.hpp"

namespace qkvfuse::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kBatch = 4;  // units loaded before any is used
constexpr int kPartials = int(kGradScalePartials);
static_assert(kThreads % 32 == 0 && kThreads <= 1024, "block of whole warps");

/// One of the two row blocks of G / W. Strides in elements.
struct FinalizePart {
  uint16_t* grad;          // bf16 [rows, C], row stride grad_stride; scaled in place
  const uint16_t* weight;  // bf16 [rows, C], row stride weight_stride
  int64_t grad_stride;
  int64_t weight_stride;
  int64_t rows;
};

struct FinalizeArgs {
  FinalizePart part[2];   // Q/K rows, then V rows
  int64_t cols;           // C
  const float* qkv_scale; // fp32 scalar
  float* partials;        // fp32 [kPartials]
};

/// Sum over the block in a fixed order: a butterfly within each warp, then warp 0 adds the
/// warp sums the same way. Every thread gets nothing back; thread 0 returns the total.
__device__ __forceinline__ float block_sum_fixed_order(float value, float* scratch) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  float total = 0.0f;
  if (warp == 0) {
    total = lane < kThreads / 32 ? scratch[lane] : 0.0f;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
  }
  return total;
}

/// Units are 8 elements (one 16-byte vector) in the vector variant, single elements otherwise.
template <bool kVector>
__global__ void __launch_bounds__(kThreads) grad_weight_finalize_kernel(const FinalizeArgs args) {
  __shared__ float scratch[kThreads / 32];
  constexpr int kUnit = kVector ? 8 : 1;
  const int64_t units_per_row = args.cols / kUnit;
  const int64_t units0 = args.part[0].rows * units_per_row;
  const int64_t units = units0 + args.part[1].rows * units_per_row;
  // Block k's contiguous range: a function of the shapes only.
  const int64_t begin = units * int64_t(blockIdx.x) / kPartials;
  const int64_t end = units * int64_t(blockIdx.x + 1) / kPartials;
  const float scale = *args.qkv_scale;

  float sum = 0.0f;
  for (int64_t base = begin + threadIdx.x; base < end; base += int64_t(kThreads) * kBatch) {
    uint16_t* grad_ptr[kBatch];
    Vec16 g[kBatch], w[kBatch];
    bool valid[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int64_t unit = base + int64_t(i) * kThreads;
      valid[i] = unit < end;
      // Selects, not a run-time index into the parameter struct (which would go through local
      // memory).
      const bool second = unit >= units0;
      const FinalizePart& p0 = args.part[0];
      const FinalizePart& p1 = args.part[1];
      const int64_t local = unit - (second ? units0 : 0);
      const int64_t r = local / units_per_row, c = (local % units_per_row) * kUnit;
      grad_ptr[i] = (second ? p1.grad : p0.grad) + r * (second ? p1.grad_stride : p0.grad_stride) + c;
      const uint16_t* weight_ptr = (second ? p1.weight : p0.weight) +
                                   r * (second ? p1.weight_stride : p0.weight_stride) + c;
      if (valid[i]) {
        if constexpr (kVector) {
          g[i] = *reinterpret_cast<const Vec16*>(grad_ptr[i]);
          w[i] = *reinterpret_cast<const Vec16*>(weight_ptr);
        } else {
          g[i].w[0] = *grad_ptr[i];
          w[i].w[0] = *weight_ptr;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      if (!valid[i]) continue;
      if constexpr (kVector) {
        float gf[8], wf[8], out[8];
        bf16x8_to_float(g[i], gf);
        bf16x8_to_float(w[i], wf);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          sum = __fadd_rn(sum, __fmul_rn(gf[e], wf[e]));  // the product is exact
          out[e] = __fmul_rn(gf[e], scale);
        }
        *reinterpret_cast<Vec16*>(grad_ptr[i]) = float_to_bf16x8(out);
      } else {
        const float gf = bf16_to_float(uint16_t(g[i].w[0]));
        const float wf = bf16_to_float(uint16_t(w[i].w[0]));
        sum = __fadd_rn(sum, __fmul_rn(gf, wf));
        *grad_ptr[i] = uint16_t(float2_to_bf16x2(__fmul_rn(gf, scale), 0.0f) & 0xffffu);
      }
    }
  }
  const float total = block_sum_fixed_order(sum, scratch);
  if (threadIdx.x == 0) args.partials[blockIdx.x] = total;
}

/// grad_qkv_scale = sum of the partials, in a fixed order: lane l adds l, l+32, ... in turn,
/// then a butterfly. One warp.
__global__ void sum_partials_kernel(const float* __restrict__ partials, float* __restrict__ out) {
  const int lane = threadIdx.x;
  float value = 0.0f;
  for (int i = lane; i < kPartials; i += 32) value = __fadd_rn(value, partials[i]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  if (lane == 0) out[0] = value;
}

bool aligned16(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 16 == 0; }

FinalizePart make_part(const TensorView& grad, const TensorView& weight, int64_t cols,
                       const char* name) {
  QKVF_CHECK(grad.ndim == 2 && weight.ndim == 2 && grad.dtype == DType::kBFloat16 &&
                 weight.dtype == DType::kBFloat16 && grad.size(0) == weight.size(0) &&
                 grad.size(1) == cols && weight.size(1) == cols,
             "grad_weight_finalize: ", name, ": grad ", grad.describe(), " and weight ",
             weight.describe(), " must be bf16 [rows, ", cols, "] alike");
  QKVF_CHECK(cols <= 1 || (grad.stride(1) == 1 && weight.stride(1) == 1),
             "grad_weight_finalize: ", name, ": last dims must be contiguous");
  FinalizePart part{};
  part.grad = static_cast<uint16_t*>(grad.data);
  part.weight = static_cast<const uint16_t*>(weight.data);
  part.rows = grad.size(0);
  part.grad_stride = part.rows > 1 ? grad.stride(0) : cols;
  part.weight_stride = part.rows > 1 ? weight.stride(0) : cols;
  return part;
}

}  // namespace

void grad_weight_finalize(const GradWeightFinalizeParams& params) {
  const int64_t cols = params.grad_qk_weight.ndim == 2 ? params.grad_qk_weight.size(1) : 0;
  FinalizeArgs args{};
  args.part[0] = make_part(params.grad_qk_weight, params.qk_weight, cols, "Q/K part");
  args.part[1] = make_part(params.grad_v_weight, params.v_weight, cols, "V part");
  args.cols = cols;
  QKVF_CHECK(params.qkv_scale.dtype == DType::kFloat32 && params.qkv_scale.numel() == 1,
             "grad_weight_finalize: qkv_scale must be one float32, got ",
             params.qkv_scale.describe());
  QKVF_CHECK(params.grad_qkv_scale.dtype == DType::kFloat32 &&
                 params.grad_qkv_scale.numel() == 1,
             "grad_weight_finalize: grad_qkv_scale must be one float32, got ",
             params.grad_qkv_scale.describe());
  QKVF_CHECK(params.partials.dtype == DType::kFloat32 &&
                 params.partials.numel() == kGradScalePartials && params.partials.ndim == 1 &&
                 params.partials.stride(0) == 1,
             "grad_weight_finalize: partials must be a contiguous float32 [", kGradScalePartials,
             "], got ", params.partials.describe());
  args.qkv_scale = static_cast<const float*>(params.qkv_scale.data);
  args.partials = static_cast<float*>(params.partials.data);

  bool vector = cols % 8 == 0;
  for (const FinalizePart& part : args.part) {
    vector = vector && aligned16(part.grad) && aligned16(part.weight) &&
             part.grad_stride % 8 == 0 && part.weight_stride % 8 == 0;
  }

  DeviceGuard guard(params.grad_qk_weight.device);
  const cudaStream_t stream = to_cuda(params.stream);
  if (vector) {
    grad_weight_finalize_kernel<true><<<kPartials, kThreads, 0, stream>>>(args);
  } else {
    grad_weight_finalize_kernel<false><<<kPartials, kThreads, 0, stream>>>(args);
  }
  QKVF_CUDA_CHECK_LAUNCH("grad_weight_finalize_kernel");
  sum_partials_kernel<<<1, 32, 0, stream>>>(args.partials,
                                            static_cast<float*>(params.grad_qkv_scale.data));
  QKVF_CUDA_CHECK_LAUNCH("sum_partials_kernel");
}

}  // namespace qkvfuse::cuda
