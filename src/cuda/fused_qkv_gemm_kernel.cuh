// fused_qkv_gemm_kernel.cuh: the fused QKV GEMM kernel: CUTLASS's ping-pong FP8 main loop
// (cutlass_sm90_gemm.cuh) with the norm + rotary epilogue (fused_qkv_epilogue.cuh), and its
// launcher. Internal; each fused_qkv_gemm_d<D>*.cu instantiates one head width and layout.
//
// Tile: 128 x N x 128 with N a whole number of heads, so that a row's sum over a head stays inside
// the quad that holds the row: N = 128 for D = 128 (one head) and D = 64 (two), N = 96 for D = 96
// (one head; two would be N = 192, 192 fp32 accumulators per thread, too many next to the
// epilogue's registers in a ping-pong consumer). V columns take the same tiles (the last one
// partial when Hkv*Dv is not a multiple of N).
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/check.hpp"
#include "cuda/cutlass_sm90_gemm.cuh"
#include "cuda/fused_qkv_epilogue.cuh"
#include "cuda/fused_qkv_gemm_args.hpp"

namespace qkvfuse::cuda {
namespace fused {

template <int kHeadDim, EpilogueLayout kLayout, typename FactorT,
          EpilogueWork kWork = EpilogueWork::kFull>
struct FusedQkvKernel {
  static constexpr int kTileN = fused_tile_n(kHeadDim);
  static_assert(kTileN % kHeadDim == 0, "a CTA tile holds whole heads");
  using TileShape = cute::Shape<cute::_128, cute::Int<kTileN>, cute::_128>;
  using Epilogue = FusedQkvCollectiveEpilogue<TileShape, kHeadDim, kLayout, FactorT, kWork>;
  // A register epilogue: the whole shared memory goes to the main loop's stages.
  using Mainloop = sm90::Mainloop<TileShape, 0>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<sm90::ProblemShape, Mainloop, Epilogue>;
};

}  // namespace fused

template <int kHeadDim, EpilogueLayout kLayout, typename FactorT, EpilogueWork kWork>
void launch_fused_qkv_gemm(const FusedQkvKernelArgs& args, Stream stream) {
  using Kernel = typename fused::FusedQkvKernel<kHeadDim, kLayout, FactorT, kWork>::Kernel;
  typename Kernel::Arguments arguments{};
  arguments.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  arguments.problem_shape = {args.m, args.n, args.k, 1};
  arguments.mainloop.ptr_A = static_cast<const sm90::ElementA*>(args.a);
  arguments.mainloop.dA = {args.lda, cute::Int<1>{}, 0};
  arguments.mainloop.ptr_B = static_cast<const sm90::ElementB*>(args.b);
  arguments.mainloop.dB = {args.ldb, cute::Int<1>{}, 0};
  arguments.epilogue.args = args.epilogue;
  arguments.hw_info.device_id = args.device;
  arguments.hw_info.sm_count = args.sm_count;
  using RasterOrder = cutlass::gemm::kernel::detail::RasterOrderOptions;
  arguments.scheduler.raster_order = args.raster == 1   ? RasterOrder::AlongM
                                     : args.raster == 2 ? RasterOrder::AlongN
                                                        : RasterOrder::Heuristic;
  arguments.scheduler.max_swizzle_size = args.swizzle;
  sm90::launch<Kernel>(arguments, to_cuda(stream), "fused_qkv_gemm");
}

}  // namespace qkvfuse::cuda
