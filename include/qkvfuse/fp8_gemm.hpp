// qkvfuse/fp8_gemm.hpp: per-tensor scaled FP8 GEMM, e4m3 x e4m3 -> bf16 (cuBLASLt on the GPU).
#pragma once

#include "qkvfuse/tensor.hpp"

namespace qkvfuse {

/// d = (a @ b^T) * scale_a * scale_b * alpha, fp32 accumulation, rounded to bf16.
///
///   a        e4m3 [M, K], row-major (row stride >= K, last dim contiguous)
///   b        e4m3 [N, K], row-major (row stride >= K, last dim contiguous)
///   scale_a, scale_b  float32 scalars ([] or [1]) on a's device
///   alpha    optional float32 scalar on a's device (absent = 1): a third factor, read on the
///            device like the scales (no host synchronization). On CUDA a one-thread kernel folds
///            it into the operand scale on the stream before the GEMM (about 1.3 us), because
///            cuBLASLt runs in host pointer mode, as torch._scaled_mm does
///   d        bf16 [M, N], last dim contiguous, row stride >= N
/// Both operands are K-major, the one FP8 layout Hopper's tensor cores take. On CUDA, M, N and K
/// must be multiples of 16 with K > 0, row strides multiples of 16 elements and pointers 16-byte
/// aligned (cuBLASLt's FP8 requirements); anything else is refused before the call. (The CPU
/// backend takes any sizes, K = 0 included: d = 0.)
/// fast_accum lets the tensor cores accumulate in reduced precision between promotions
/// (cuBLASLt's FAST_ACCUM); the CPU backend accumulates in double (exact for K < 2^17).
/// On CUDA, algorithms that split K may round each split's partial sum to bf16 before adding the
/// splits (one bf16 rounding per split, deterministic); QKVFUSE_FP8_GEMM_FP32_SPLITK=1 in the
/// environment keeps split-K partial sums in fp32, at the cost of excluding some fast algorithms.
/// On CUDA the first call of each shape (per process and device; the plan is keyed by M, N, K,
/// the row strides, fast_accum and the pointers' alignment) times cuBLASLt's candidate
/// algorithms on the call's stream in three rounds, synchronizing with the stream after each
/// timing (a few milliseconds in all), and keeps the fastest if it beats the heuristic's choice
/// by more than 3 %; later calls with that key run that one algorithm. Algorithms
/// that need no workspace rank first (cuBLASLt zeroes the workspace of the others with a memset
/// before each launch). The default choice is the heuristic's first workspace-free algorithm: a
/// first call made during CUDA-graph capture runs it (warm up before capturing), and
/// QKVFUSE_FP8_GEMM_AUTOTUNE=0 in the environment always runs it; =2 prints each shape's timings
/// and pick to stderr.
/// Resources (CUDA): one cuBLASLt handle per device, and one workspace per (device, stream) that
/// runs a GEMM: 32 MiB for cuBLASLt plus 256 bytes of scale slots, allocated with cudaMalloc by the
/// first GEMM on that stream (also during CUDA-graph capture) and kept for the life of the process.
/// GEMMs on different streams never share a workspace; a captured graph keeps its stream's.
struct Fp8GemmParams {
  TensorView a;
  TensorView b;
  TensorView scale_a;
  TensorView scale_b;
  TensorView alpha;
  TensorView d;
  bool fast_accum = false;
  Stream stream = nullptr;
};

void fp8_gemm(const Fp8GemmParams& params);

}  // namespace qkvfuse
