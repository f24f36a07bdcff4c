// fused_qkv_gemm_kernel.cuh: the fused QKV GEMM kernel: CUTLASS's ping-pong FP8 main loop
// (cutlass_sm90_gemm.cuh) with the norm + rotary epilogue (fused_qkv_epilogue.cuh), and its
// launcher. Internal; each fused_qkv_gemm_d<D>.cu instantiates one head width.
//
// Tile: 128 x 128 x 128. N = 128 holds one head at D = 128 and two at D = 64, so a row's sum over
// a head stays inside the quad that holds the row. D = 96 would need N = 96 or 192 (one or two
// heads): another main loop instantiation (and at N = 192, 192 accumulators per thread, too many
// for a ping-pong consumer): not built yet.
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/check.hpp"
#include "cuda/cutlass_sm90_gemm.cuh"
#include "cuda/fused_qkv_epilogue.cuh"
#include "cuda/fused_qkv_gemm_args.hpp"

namespace qkvfuse::cuda {
namespace fused {

using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;

template <int kHeadDim>
struct FusedQkvKernel {
  using Epilogue = FusedQkvCollectiveEpilogue<TileShape, kHeadDim>;
  // A register epilogue: the whole shared memory goes to the main loop's stages.
  using Mainloop = sm90::Mainloop<TileShape, 0>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<sm90::ProblemShape, Mainloop, Epilogue>;
};

}  // namespace fused

template <int kHeadDim>
void launch_fused_qkv_gemm(const FusedQkvKernelArgs& args, Stream stream) {
  using Kernel = typename fused::FusedQkvKernel<kHeadDim>::Kernel;
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
