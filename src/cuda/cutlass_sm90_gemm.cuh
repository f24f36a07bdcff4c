// cutlass_sm90_gemm.cuh: what the CUTLASS FP8 GEMMs of the forward share (cutlass_fp8_gemm.cu, the
// plain one; fused_qkv_gemm_d*.cu, the one whose epilogue does the QK-norm and rotary): the
// mainloop configuration and the launcher. Internal; included by .cu files only (CUTLASS 4.2).
//
// Mainloop. Both operands e4m3 and K-major (the one FP8 layout WGMMA reads from shared memory):
// a = x_f8 [M, K] row-major is CUTLASS's RowMajor A, b = weight_f8 [N, K] row-major is its
// ColumnMajor B, so D[M, N] = a @ b^T with no transposition anywhere. TMA loads 128x128x128 tiles
// (16 KiB of A and 16 KiB of B per stage) into a multi-stage ring; two consumer warpgroups run the
// WGMMAs ping-pong: each owns a whole 128x128 output tile, and while one runs its main loop the
// other runs its epilogue (KernelTmaWarpSpecializedPingpong: the kernel orders the two warpgroups'
// main loops and epilogues with a barrier, so the tensor cores are always fed by one of them). At
// K = 768 a tile's main loop is six k-blocks, about 1.7 us on an H200: an epilogue that is not
// overlapped costs more than the fusion saves, hence ping-pong rather than cooperative (quack
// measured +1-2 % for a norm epilogue with ping-pong, +10-15 % with cooperative). Fast
// accumulation (KernelTmaWarpSpecializedPingpongFP8FastAccum: no periodic promotion of the WGMMA
// accumulators into a second fp32 set) is what cuBLASLt's FAST_ACCUM does and what the op asks
// of the forward (SPEC.md section 6). Cluster 1x1x1: the 2x1 cluster measured slower at this
// shape (0.167 against 0.152 ms, issue 22). The persistent tile scheduler rasterizes along N when
// there are more M tiles than N tiles (the op's shape: 384 x 18 tiles), so the CTAs working at one
// time share A row blocks, and the factor rows of the rotary, in L2.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/device_kernel.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/numeric_types.h"

#include "cuda/check.hpp"
#include "qkvfuse/error.hpp"

namespace qkvfuse::cuda::sm90 {

using ElementA = cutlass::float_e4m3_t;
using ElementB = cutlass::float_e4m3_t;
using LayoutA = cutlass::layout::RowMajor;     // x_f8 [M, K]: K contiguous
using LayoutB = cutlass::layout::ColumnMajor;  // weight_f8 [N, K]: K contiguous
inline constexpr int kAlignmentA = 16;         // elements: TMA needs 16-byte rows
inline constexpr int kAlignmentB = 16;
using ElementAccumulator = float;
using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum;

/// Hopper's shared memory per block (227 KiB): what the kernel's SharedStorage must fit in.
inline constexpr int kSharedMemoryBytes = 232448;

/// The ping-pong FP8 main loop for a CTA tile, its stages sized to leave `kEpilogueSmemBytes` of
/// shared memory to the epilogue.
template <class TileShape, int kEpilogueSmemBytes>
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, kAlignmentA, ElementB,
    LayoutB, kAlignmentB, ElementAccumulator, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<kEpilogueSmemBytes>,
    MainloopSchedule>::CollectiveOp;

/// The problem shape every kernel here takes: (M, N, K, L = 1).
using ProblemShape = cute::Shape<int, int, int, int>;

/// Strides of a and b in CUTLASS's (M or N, K, L) convention: (row stride, 1, 0).
using StrideAB = cute::Stride<int64_t, cute::Int<1>, int64_t>;

/// Launches a CUTLASS 3.x/4.x kernel (GemmUniversal) on `stream`: checks that CUTLASS can run the
/// arguments and that they need no workspace (the persistent scheduler takes none), builds the
/// kernel parameters (TMA descriptors, encoded on the host: a few microseconds), raises the
/// dynamic shared memory limit once per device, and launches. Cluster 1x1x1, so a plain launch.
template <class GemmKernel>
void launch(const typename GemmKernel::Arguments& arguments, cudaStream_t stream,
            const char* name) {
  static_assert(GemmKernel::SharedStorageSize <= kSharedMemoryBytes,
                "the kernel's shared memory (main loop stages + epilogue) exceeds Hopper's 227 KiB");
  static_assert(cute::size(ClusterShape{}) == 1, "a cluster launch needs cudaLaunchKernelEx");
  QKVF_CHECK(GemmKernel::can_implement(arguments), name,
             ": CUTLASS cannot run these arguments (can_implement failed: sizes or alignment)");
  QKVF_CHECK(GemmKernel::get_workspace_size(arguments) == 0, name,
             ": unexpected CUTLASS workspace request");
  QKVF_CHECK(GemmKernel::initialize_workspace(arguments, nullptr, stream) == cutlass::Status::kSuccess,
             name, ": CUTLASS initialize_workspace failed");
  typename GemmKernel::Params params = GemmKernel::to_underlying_arguments(arguments, nullptr);

  // cudaFuncSetAttribute is per device; a host call, legal while a stream is being captured.
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> smem_configured[kMaxDevices];
  int device = 0;
  QKVF_CUDA_CHECK(cudaGetDevice(&device));
  QKVF_CHECK(device >= 0 && device < kMaxDevices, name, ": device ordinal ", device,
             " beyond the ", kMaxDevices, " this launcher tracks");
  if (!smem_configured[device].load(std::memory_order_acquire)) {
    QKVF_CUDA_CHECK(cudaFuncSetAttribute(cutlass::device_kernel<GemmKernel>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(GemmKernel::SharedStorageSize)));
    smem_configured[device].store(true, std::memory_order_release);
  }

  const dim3 grid = GemmKernel::get_grid_shape(params);
  const dim3 block = GemmKernel::get_block_shape();
  cutlass::device_kernel<GemmKernel>
      <<<grid, block, GemmKernel::SharedStorageSize, stream>>>(params);
  QKVF_CUDA_CHECK_LAUNCH("CUTLASS FP8 GEMM");
}

}  // namespace qkvfuse::cuda::sm90
