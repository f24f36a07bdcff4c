// cutlass_fp8_gemm.cu: the plain-epilogue CUTLASS FP8 GEMM (fused_qkv_gemm.hpp): the main loop of
// the fused QKV GEMM (cutlass_sm90_gemm.cuh) with CUTLASS's stock TMA warp-specialized epilogue.
//
//   d[M, N] = bf16(acc * ((scale_a * scale_b) * alpha)),   acc = a[M, K] @ b[N, K]^T in fp32
//
// The epilogue is an epilogue visitor tree: a scalar broadcast that reads the three fp32 scalars
// from device memory and multiplies them in that order (Sm90ScalarBroadcast with BroadcastCount 3
// reduces with multiplies: ((s0 * s1) * s2), the CPU backend's order, src/cpu/fp8_gemm.cpp), times
// the accumulator, rounded to nearest bf16. The epilogue tile is CUTLASS's choice; subtiles go
// through shared memory and TMA stores. Its place in the library: the baseline that says how much
// of the fused GEMM's time is the main loop (against cuBLASLt) and how much is its epilogue.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/cutlass_sm90_gemm.cuh"
#include "cuda/fused_qkv_gemm.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "qkvfuse/error.hpp"
#include "validate.hpp"

namespace qkvfuse::cuda {
namespace {

using namespace cute;

using TileShape = Shape<_128, _128, _128>;
using ElementD = cutlass::bfloat16_t;
using LayoutD = cutlass::layout::RowMajor;
inline constexpr int kAlignmentD = 8;  // bf16 elements: 16-byte TMA rows

// d = bf16(scale * acc), scale = (scale_a * scale_b) * alpha read from device memory.
using ScaleAcc = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, ElementD, float,
                                           cutlass::FloatRoundStyle::round_to_nearest>,
    cutlass::epilogue::fusion::Sm90ScalarBroadcast<float, Stride<_0, _0, _0>, 3>,
    cutlass::epilogue::fusion::Sm90AccFetch>;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, sm90::ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, LayoutD, kAlignmentD,  // no source C
    ElementD, LayoutD, kAlignmentD, cutlass::epilogue::TmaWarpSpecialized,
    ScaleAcc>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<
    sm90::ProblemShape, sm90::Mainloop<TileShape, int(sizeof(typename Epilogue::SharedStorage))>,
    Epilogue>;

}  // namespace

void cutlass_fp8_gemm(const Fp8GemmParams& p) {
  const char* op = "cutlass_fp8_gemm";
  const Device device = validate::validate_fp8_gemm(p, op);
  QKVF_CHECK(device.type == DeviceType::kCUDA, op, ": runs on CUDA tensors only, got ",
             device_name(device));
  QKVF_CHECK(p.fast_accum, op, ": only fast_accum = true is instantiated");
  const int64_t m = p.a.sizes[0];
  const int64_t n = p.b.sizes[0];
  const int64_t k = p.a.sizes[1];
  if (m == 0 || n == 0) return;
  QKVF_CHECK(k > 0 && k % 16 == 0, op, ": K must be a positive multiple of 16 (TMA rows), got ", k);
  QKVF_CHECK(m < (int64_t(1) << 31) && n < (int64_t(1) << 31) && k < (int64_t(1) << 31), op,
             ": M, N and K must fit in int32");
  DeviceGuard guard(device);

  typename Kernel::Arguments arguments{};
  arguments.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  arguments.problem_shape = {int(m), int(n), int(k), 1};
  arguments.mainloop.ptr_A = static_cast<const sm90::ElementA*>(p.a.data);
  arguments.mainloop.dA = {p.a.strides[0], Int<1>{}, 0};
  arguments.mainloop.ptr_B = static_cast<const sm90::ElementB*>(p.b.data);
  arguments.mainloop.dB = {p.b.strides[0], Int<1>{}, 0};
  // EVT arguments: {children..., node}: {{scalar broadcast}, {acc fetch}, {multiplies}}.
  auto& scale = arguments.epilogue.thread;
  const float* alpha = is_absent(p.alpha) ? nullptr : static_cast<const float*>(p.alpha.data);
  scale = {{{1.0f, 1.0f, 1.0f},  // scalars used where a pointer is null: alpha absent = 1
            {static_cast<const float*>(p.scale_a.data), static_cast<const float*>(p.scale_b.data),
             alpha},
            {}},
           {},
           {}};
  arguments.epilogue.ptr_C = nullptr;
  arguments.epilogue.ptr_D = static_cast<ElementD*>(p.d.data);
  arguments.epilogue.dD = {p.d.strides[0], Int<1>{}, 0};
  arguments.hw_info.device_id = device.index;
  arguments.hw_info.sm_count = multiprocessor_count();
  sm90::launch<Kernel>(arguments, to_cuda(p.stream), op);
}

}  // namespace qkvfuse::cuda
