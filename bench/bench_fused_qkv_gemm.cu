// bench_fused_qkv_gemm.cu: the fused QKV GEMM (src/cuda/fused_qkv_gemm.hpp) against the forward
// it replaces, side by side in one run, at the speedrun's shapes (issue 22):
//
//   cublaslt            fp8_gemm (cuBLASLt, autotuned, fast accumulation) -> qkv: the baseline
//   cublaslt+rope       the same, then qk_norm_rope on qkv's Q/K columns: today's forward
//   cutlass             cutlass_fp8_gemm: the fused kernel's main loop, stock TMA epilogue
//   fused store-only    D = 128 only: the fused kernel with its epilogue cut down to the bf16
//                       rounding and the stores of q, k (= x), v in their layouts (no factor
//                       loads, no norm, no rotary; EpilogueWork::kStoreOnly, wrong q and k)
//   fused norm-only     D = 128 only: also the row sums and rstd, q, k = x * rstd (kNormOnly)
//   fused general       D = 128 only: the general-layout epilogue (EpilogueLayout::kGeneral)
//                       on the same simple layout: what the simple layout's kernel saves
//   fused               fused_qkv_gemm -> q, k, v
//   fused+qk            the same, also writing the raw qk for the backward
//   fused alongM, N/sw2, N/sw4   the fused GEMM with other tile orders of the persistent scheduler
// The differences cutlass -> store-only -> norm-only -> fused are what the epilogue's stores, its
// norm, and its factor loads + rotary cost (fused_qkv_gemm_variants.cu). Shapes: D = 128, 96 and
// 64 in the plain layout, then D = 128 and 96 paired (q, k [2T, H/2, D], [T, 2D] tables; the
// baselines, the cutlass row and the fused rows only).
//
//   qkvfuse_bench_fused_qkv_gemm [--csv PATH] [--tokens T] [--iters N] [--head-dim D]
//                                [--kernel VARIANT]
// --head-dim runs one of the widths (128, 96, 64); --kernel runs one variant by its name (e.g.
// "fused"), so that a profiler sees few launches (scripts/device_fused_gemm.sh's ncu step).
//
// Method (the "Benchmarks" section of ../shared/STYLE.md, as bench_fp8.cu): warm-up (which also
// runs cuBLASLt's one-time algorithm timing), then one pair of CUDA events per iteration with a
// spinning kernel holding the GPU while all iterations are queued, median of N (default 100).
// Inputs and outputs rotate through buffer sets that together exceed 3x the L2, random e4m3
// operands (GEMM power and so timing depend on the data: constant operands run faster). TFLOP/s
// counts 2*T*N*C.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <ctime>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench_common.cuh"
#include "fused_qkv_gemm/problem.cuh"

namespace {

using namespace qkvfuse;
using qkvfuse::fused_test::Problem;
using qkvfuse::fused_test::ProblemSpec;
using qkvfuse::fused_test::QkvShape;

struct Row {
  std::string shape, name;
  double ms = NAN, tflops = NAN, ratio = NAN;
  std::string note;
};

std::vector<Row> g_rows;

void print_row(const Row& r) {
  std::printf("%-28s %-16s %9.4f %9.1f %8.3f  %s\n", r.shape.c_str(), r.name.c_str(), r.ms,
              r.tflops, r.ratio, r.note.c_str());
  std::fflush(stdout);
}

/// One D = 128 instantiation of the fused GEMM chosen here, not by fused_qkv_gemm: the general
/// epilogue on the simple layout, or the simple one with part of its epilogue
/// (fused_qkv_gemm_variants.cu); on the same validation and arguments as fused_qkv_gemm.
template <cuda::EpilogueLayout kLayout, cuda::EpilogueWork kWork>
void fused_d128(const Problem& p, cudaStream_t stream) {
  const cuda::FusedQkvKernelArgs args = cuda::fused_qkv_kernel_args(p.fused_params(stream, false));
  cuda::launch_fused_qkv_gemm<128, kLayout, cuda::FusedFactor, kWork>(args, stream);
}

void bench_shape(int64_t tokens, int64_t head_dim, bool paired, cudaStream_t stream, int iters,
                 size_t l2_bytes, const std::string& only) {
  ProblemSpec spec;
  spec.shape.tokens = tokens;
  spec.shape.q_heads = 6;
  spec.shape.kv_heads = 6;
  spec.shape.head_dim = head_dim;
  spec.shape.v_dim = 128;
  spec.shape.rotary_dim = head_dim;
  spec.shape.paired = paired;
  spec.channels = 768;
  const QkvShape& s = spec.shape;
  const double flops = 2.0 * double(tokens) * double(s.n()) * double(spec.channels);
  // One set (bytes per token): x (C), two bf16 factor rows (4 FW), qkv (2N), the unfused and the
  // fused q and k and the raw qk (3 x 2 (Hq+Hkv) D), v (2 Hkv Dv).
  const double set_bytes =
      double(tokens) * double(spec.channels + 4 * s.factor_width() + 2 * s.n() +
                              6 * s.qk_cols() + 2 * s.kv_heads * s.v_dim);
  const int sets = bench::rotation_sets(set_bytes, l2_bytes, 2);
  std::vector<std::unique_ptr<Problem>> problems;
  for (int i = 0; i < sets; ++i) problems.push_back(std::make_unique<Problem>(spec, stream));
  const std::string shape = "T=" + std::to_string(tokens) + " N=" + std::to_string(s.n()) +
                            " C=" + std::to_string(spec.channels) + " D=" + std::to_string(head_dim) +
                            (paired ? " paired" : "");

  struct Variant {
    const char* name;
    std::function<void(const Problem&)> run;
    const char* note;
  };
  std::vector<Variant> variants = {
      {"cublaslt", [&](const Problem& p) { p.gemm_cublaslt(stream); }, "plain GEMM -> qkv"},
      {"cublaslt+rope",
       [&](const Problem& p) {
         p.gemm_cublaslt(stream);
         p.rope_unfused(stream);
       },
       "today's forward (2 kernels)"},
      {"cutlass", [&](const Problem& p) { p.gemm_cutlass(stream); }, "ping-pong 128x128x128, TMA epilogue"},
  };
  if (head_dim == 128 && !paired) {
    using cuda::EpilogueLayout;
    using cuda::EpilogueWork;
    variants.push_back({"fused store-only",
                        [&](const Problem& p) {
                          fused_d128<EpilogueLayout::kSimple, EpilogueWork::kStoreOnly>(p, stream);
                        },
                        "epilogue: bf16 x stored as q, k, v; no factors, norm, rotary"});
    variants.push_back({"fused norm-only",
                        [&](const Problem& p) {
                          fused_d128<EpilogueLayout::kSimple, EpilogueWork::kNormOnly>(p, stream);
                        },
                        "epilogue: q, k = x * rstd; no factors, rotary"});
    variants.push_back({"fused general",
                        [&](const Problem& p) {
                          fused_d128<EpilogueLayout::kGeneral, EpilogueWork::kFull>(p, stream);
                        },
                        "the general-layout epilogue on this (simple) layout"});
  }
  variants.insert(variants.end(), {
      {"fused", [&](const Problem& p) { p.fused(stream, false); }, "GEMM + norm + rotary -> q, k, v"},
      {"fused+qk", [&](const Problem& p) { p.fused(stream, true); }, "also writes the raw qk"},
      // The scheduler's tile order (no recompile): which CTAs share A rows and factor rows in L2.
      {"fused alongM", [&](const Problem& p) { p.fused(stream, false, 1, 1); }, "raster along M"},
      {"fused N/sw2", [&](const Problem& p) { p.fused(stream, false, 2, 2); }, "raster along N, swizzle 2"},
      {"fused N/sw4", [&](const Problem& p) { p.fused(stream, false, 2, 4); }, "raster along N, swizzle 4"},
  });
  double baseline = NAN;  // cuBLASLt's time (NaN when --kernel leaves it out)
  for (const Variant& variant : variants) {
    if (!only.empty() && only != variant.name) continue;
    Row row{shape, variant.name};
    try {
      row.ms = bench::time_median([&](int i) { variant.run(*problems[size_t(i % sets)]); }, stream,
                                  iters, /*prequeue=*/true);
      row.tflops = flops / (row.ms * 1e-3) / 1e12;
      if (std::string(variant.name) == "cublaslt") baseline = row.ms;
      row.ratio = row.ms / baseline;
      row.note = variant.note;
    } catch (const std::exception& e) {
      row.note = std::string("FAILED: ") + e.what();
      // Leave the stream usable for the next variant.
      cudaStreamSynchronize(stream);
      cudaGetLastError();
    }
    print_row(row);
    g_rows.push_back(row);
  }
}

int run(int argc, char** argv) {
  bench::Options options;
  if (!bench::parse_options(argc, argv, options)) return 2;
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%d", std::gmtime(&now));
  std::printf("# qkvfuse_bench_fused_qkv_gemm  device: %s  date: %s  commit: %s  iters: %d\n",
              prop.name, date, bench::commit_id(), options.iters);
  if (!cuda::cutlass_gemms_available()) {
    std::printf("qkvfuse was built without CUTLASS: nothing to time\n");
    return 1;
  }
  std::printf("%-28s %-16s %9s %9s %8s  %s\n", "shape", "variant", "ms", "TFLOP/s", "x cuBLASLt",
              "note");
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const bool paired : {false, true}) {
    for (int64_t d : {128, 96, 64}) {
      if ((options.head_dim != 0 && d != options.head_dim) || (paired && d == 64)) continue;
      bench_shape(options.tokens, d, paired, stream, options.iters, size_t(prop.l2CacheSize),
                  options.kernel);
    }
  }
  BENCH_CUDA(cudaStreamDestroy(stream));
  if (g_rows.empty()) {
    std::fprintf(stderr, "no variant named \"%s\" at D = %lld\n", options.kernel.c_str(),
                 (long long)options.head_dim);
    return 2;
  }
  if (!options.csv.empty()) {
    FILE* f = std::fopen(options.csv.c_str(), "w");
    if (f) {
      std::fprintf(f, "device,date,commit,shape,variant,ms,tflops,ratio_cublaslt,note\n");
      for (const Row& r : g_rows) {
        std::fprintf(f, "%s,%s,%s,%s,%s,%.5f,%.2f,%.4f,\"%s\"\n", prop.name, date,
                     bench::commit_id(), r.shape.c_str(), r.name.c_str(), r.ms, r.tflops, r.ratio,
                     r.note.c_str());
      }
      std::fclose(f);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qkvfuse_bench_fused_qkv_gemm: %s\n", e.what());
    return 1;
  }
}
