// gemm_algos.cu: a diagnostic sweep of cuBLASLt's algorithms for the three FP8 GEMMs of the
// packed QKV op. For each shape it answers: which algorithms does the heuristic offer, how fast is
// each, and is the heuristic's first choice (the one qkvfuse::fp8_gemm runs) the fastest?
//
//   qkvfuse_bench_gemm_algos [--csv PATH] [--tokens T] [--iters N]
//
// The matmul is set up exactly as src/cuda/fp8_gemm_cublaslt.cpp sets it up: d[M,N] (bf16,
// row-major) = a[M,K] @ b[N,K]^T (e4m3, row-major), i.e. column-major TN with cuBLASLt's A = b
// (TRANSA = T), B = a (TRANSB = N), D = d as [N x M]; CUBLAS_COMPUTE_32F, scale type fp32, device
// fp32 A/B scale pointers, host alpha = 1 / beta = 0, FAST_ACCUM per shape; preference
// MAX_WORKSPACE_BYTES = 32 MiB and MIN_ALIGNMENT_{A,B,C,D} = 256. The heuristic is asked for up to
// 32 algorithms; each usable one is timed (median of --iters, all iterations queued behind a spin
// kernel, operands rotated over enough copies that one pass touches > 3x the L2). A second query,
// "ws1MiB", caps the workspace at 1 MiB (as torch._scaled_mm does when its cuBLASLt workspace is
// small) and times its rank-0 pick, to show whether a smaller workspace changes the choice.
// Output: one line per algorithm on stdout; --csv PATH writes the same rows.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bench_common.cuh"

namespace {

using namespace qkvfuse::bench;

constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // the library's cuBLASLt workspace
constexpr size_t kSmallWorkspaceBytes = size_t(1) << 20;
constexpr int kRequestedAlgos = 32;

void lt_check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string(what) + " failed: " + cublasLtGetStatusName(status));
  }
}

struct Shape {
  std::string name;
  int64_t m, n, k;
  bool fast_accum;
};

/// One algorithm's identity, each field '-' when its query fails.
std::vector<std::string> algo_identity(const cublasLtMatmulAlgo_t& algo) {
  const auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attribute, auto zero) {
    decltype(zero) value = zero;
    size_t written = 0;
    const cublasStatus_t status =
        cublasLtMatmulAlgoConfigGetAttribute(&algo, attribute, &value, sizeof(value), &written);
    return status == CUBLAS_STATUS_SUCCESS ? std::to_string(value) : std::string("-");
  };
  return {get(CUBLASLT_ALGO_CONFIG_ID, int32_t(0)),
          get(CUBLASLT_ALGO_CONFIG_TILE_ID, uint32_t(0)),
          get(CUBLASLT_ALGO_CONFIG_STAGES_ID, uint32_t(0)),
          get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM, int32_t(0)),
          get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, uint32_t(0)),
          get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, uint32_t(0)),
          get(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, uint32_t(0)),
          get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, uint16_t(0))};
}

struct Row {
  std::string shape, variant, status;
  int rank = 0;
  double ms = NAN, tflops = NAN;
  std::vector<std::string> identity;
  size_t workspace = 0;
  bool fastest = false;
};

std::vector<Row> g_rows;

void print_row(const Row& r) {
  const std::vector<std::string>& id = r.identity;
  const auto num = [](double v, const char* format) {
    char buffer[32] = "-";
    if (!std::isnan(v)) std::snprintf(buffer, sizeof(buffer), format, v);
    return std::string(buffer);
  };
  std::printf("%-28s %-11s %4d %9s %8s  algo=%s tile=%s stages=%s splitk=%s red=%s swz=%s "
              "custom=%s cluster=%s ws=%zu%s%s\n",
              r.shape.c_str(), r.variant.c_str(), r.rank, num(r.ms, "%.4f").c_str(),
              num(r.tflops, "%.1f").c_str(), id[0].c_str(),
              id[1].c_str(), id[2].c_str(), id[3].c_str(), id[4].c_str(), id[5].c_str(),
              id[6].c_str(), id[7].c_str(), r.workspace, r.fastest ? "  <== fastest" : "",
              r.status.empty() ? "" : ("  " + r.status).c_str());
}

/// The heuristic's answer under the library's preferences, with the given workspace limit.
std::vector<cublasLtMatmulHeuristicResult_t> heuristic(
    cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t la,
    cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t ld, uint64_t workspace_limit, int wanted) {
  cublasLtMatmulPreference_t pref = nullptr;
  lt_check(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  const uint32_t alignment = 256;
  cublasStatus_t set = cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_limit, sizeof(workspace_limit));
  for (auto attribute : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                         CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                         CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                         CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    if (set == CUBLAS_STATUS_SUCCESS) {
      set = cublasLtMatmulPreferenceSetAttribute(pref, attribute, &alignment, sizeof(alignment));
    }
  }
  if (set != CUBLAS_STATUS_SUCCESS) {
    cublasLtMatmulPreferenceDestroy(pref);
    lt_check(set, "cublasLtMatmulPreferenceSetAttribute");
  }
  std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<size_t>(wanted));
  int returned = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      handle, desc, la, lb, ld, ld, pref, wanted, results.data(), &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  if (status != CUBLAS_STATUS_SUCCESS) {
    std::printf("  heuristic query failed: %s\n", cublasLtGetStatusName(status));
    returned = 0;
  }
  results.resize(static_cast<size_t>(returned));
  return results;
}

void sweep(cublasLtHandle_t handle, const Shape& s, size_t l2_bytes, void* workspace,
           const void* scale, cudaStream_t stream, int iters) {
  const std::string label = s.name + "_" + std::to_string(s.m) + "x" + std::to_string(s.n) + "x" +
                            std::to_string(s.k);
  // Operands rotated over enough sets that one pass exceeds 3x the L2.
  const double set_bytes = double(s.m * s.k + s.n * s.k + 2 * s.m * s.n);
  const int sets = rotation_sets(set_bytes, l2_bytes, 2);
  struct Set {
    Buffer a, b, d;
  };
  std::vector<Set> bufs(static_cast<size_t>(sets));
  for (Set& set : bufs) {
    set.a = allocate(size_t(s.m * s.k));
    set.b = allocate(size_t(s.n * s.k));
    set.d = allocate(size_t(s.m * s.n) * 2);
    fill_e4m3(set.a.get(), size_t(s.m * s.k), 8.0f);
    fill_e4m3(set.b.get(), size_t(s.n * s.k), 8.0f);
  }

  // cuBLASLt's column-major view, as the library maps it (see the header).
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  lt_check(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
  lt_check(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, uint64_t(s.k), uint64_t(s.n), s.k),
           "MatrixLayoutCreate A");
  lt_check(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, uint64_t(s.k), uint64_t(s.m), s.k),
           "MatrixLayoutCreate B");
  lt_check(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, uint64_t(s.n), uint64_t(s.m), s.n),
           "MatrixLayoutCreate D");
  const int32_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  const int32_t pointer_mode = CUBLASLT_POINTER_MODE_HOST;
  const int8_t fast_accum = s.fast_accum ? 1 : 0;
  const auto set_desc = [&](cublasLtMatmulDescAttributes_t attribute, const void* v, size_t n) {
    lt_check(cublasLtMatmulDescSetAttribute(desc, attribute, v, n), "MatmulDescSetAttribute");
  };
  set_desc(CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa));
  set_desc(CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb));
  set_desc(CUBLASLT_MATMUL_DESC_POINTER_MODE, &pointer_mode, sizeof(pointer_mode));
  set_desc(CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum, sizeof(fast_accum));
  set_desc(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale, sizeof(scale));
  set_desc(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale, sizeof(scale));
  const float one = 1.0f, zero = 0.0f;
  const double flops = 2.0 * double(s.m) * double(s.n) * double(s.k);

  // Times one algorithm; a launch error is recorded on the row instead of aborting the sweep.
  const auto time_algo = [&](const cublasLtMatmulHeuristicResult_t& r, size_t ws_limit,
                             Row& row) {
    row.identity = algo_identity(r.algo);
    row.workspace = r.workspaceSize;
    if (r.state != CUBLAS_STATUS_SUCCESS || r.workspaceSize > ws_limit) {
      row.status = std::string("SKIPPED: state ") + cublasLtGetStatusName(r.state) +
                   ", workspace " + std::to_string(r.workspaceSize);
      return;
    }
    const auto launch = [&](int i) {
      const Set& set = bufs[size_t(i % sets)];
      return cublasLtMatmul(handle, desc, &one, set.b.get(), la, set.a.get(), lb, &zero,
                            set.d.get(), ld, set.d.get(), ld, &r.algo, workspace, ws_limit,
                            stream);
    };
    const cublasStatus_t first = launch(0);  // a refused launch enqueues nothing
    if (first != CUBLAS_STATUS_SUCCESS) {
      row.status = std::string("LAUNCH FAILED: ") + cublasLtGetStatusName(first);
      return;
    }
    BENCH_CUDA(cudaStreamSynchronize(stream));
    try {
      row.ms = time_median([&](int i) { lt_check(launch(i), "cublasLtMatmul"); }, stream, iters,
                           true);
      row.tflops = flops / (row.ms * 1e-3) / 1e12;
    } catch (const std::exception& e) {
      BENCH_CUDA(cudaStreamSynchronize(stream));
      row.status = std::string("FAILED: ") + e.what();
    }
  };

  const auto main_results = heuristic(handle, desc, la, lb, ld, kWorkspaceBytes, kRequestedAlgos);
  std::printf("\n%s (fast_accum=%d): heuristic returned %zu of %d requested algorithms\n",
              label.c_str(), int(fast_accum), main_results.size(), kRequestedAlgos);
  std::vector<Row> rows;
  for (size_t i = 0; i < main_results.size(); ++i) {
    Row row;
    row.shape = label;
    row.variant = "heuristic32";
    row.rank = int(i);
    time_algo(main_results[i], kWorkspaceBytes, row);
    rows.push_back(row);
  }
  int best = -1;
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!std::isnan(rows[i].ms) && (best < 0 || rows[i].ms < rows[size_t(best)].ms)) best = int(i);
  }
  if (best >= 0) rows[size_t(best)].fastest = true;
  for (const Row& row : rows) print_row(row);
  if (best >= 0 && !std::isnan(rows[0].ms)) {
    std::printf("  heuristic rank 0: %.4f ms; fastest rank %d: %.4f ms (rank 0 is %.1f%% slower)\n",
                rows[0].ms, best, rows[size_t(best)].ms,
                100.0 * (rows[0].ms / rows[size_t(best)].ms - 1.0));
  }

  // Variant: the same query with a 1 MiB workspace limit; its rank-0 pick only.
  const auto small = heuristic(handle, desc, la, lb, ld, kSmallWorkspaceBytes, 1);
  Row row;
  row.shape = label;
  row.variant = "ws1MiB";
  if (small.empty()) {
    row.identity.assign(8, "-");
    row.status = "heuristic returned no algorithm";
  } else {
    time_algo(small[0], kSmallWorkspaceBytes, row);
  }
  const bool same = !rows.empty() && rows[0].identity == row.identity;
  rows.push_back(row);
  std::printf("  variant ws1MiB (workspace limit 1 MiB, rank 0; %s heuristic32 rank 0):\n",
              same ? "same algorithm as" : "DIFFERENT from");
  print_row(row);
  std::fflush(stdout);

  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(desc);
  g_rows.insert(g_rows.end(), rows.begin(), rows.end());
}

void write_csv(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) throw std::runtime_error("cannot write " + path);
  std::fprintf(f, "shape,rank,variant,ms,tflops,algo_id,tile,stages,splitk,reduction,swizzle,"
                  "custom,cluster,workspace,status\n");
  const auto num = [](double v) { return std::isnan(v) ? std::string() : std::to_string(v); };
  for (const Row& r : g_rows) {
    std::string status = r.status + (r.fastest ? "fastest" : "");
    std::replace(status.begin(), status.end(), ',', ';');
    std::fprintf(f, "%s,%d,%s,%s,%s", r.shape.c_str(), r.rank, r.variant.c_str(),
                 num(r.ms).c_str(), num(r.tflops).c_str());
    for (const std::string& field : r.identity) std::fprintf(f, ",%s", field.c_str());
    std::fprintf(f, ",%zu,%s\n", r.workspace, status.c_str());
  }
  std::fclose(f);
  std::printf("wrote %s\n", path.c_str());
}

int run(int argc, char** argv) {
  Options options;
  if (!parse_options(argc, argv, options)) return 2;
  if (!options.kernel.empty()) {
    std::fprintf(stderr, "qkvfuse_bench_gemm_algos: --kernel is not an option of this tool\n");
    return 2;
  }
  int count = 0;
  const cudaError_t probe = cudaGetDeviceCount(&count);
  if (probe != cudaSuccess || count == 0) {
    std::fprintf(stderr, "qkvfuse_bench_gemm_algos: no CUDA device available (%s); run it on the "
                         "GPU machine\n", probe != cudaSuccess ? cudaGetErrorString(probe) : "0 devices");
    return 1;
  }
  BENCH_CUDA(cudaSetDevice(0));
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  const size_t l2_bytes = std::max(size_t(prop.l2CacheSize), size_t(60) << 20);
  std::printf("device: %s (sm_%d%d), L2 %d MiB; cuBLASLt %zu; T = %lld; median of %d\n",
              prop.name, prop.major, prop.minor, prop.l2CacheSize >> 20, cublasLtGetVersion(),
              (long long)options.tokens, options.iters);
  std::printf("%-28s %-11s %4s %9s %8s  identity\n", "shape", "variant", "rank", "ms", "TFLOP/s");

  cublasLtHandle_t handle = nullptr;
  lt_check(cublasLtCreate(&handle), "cublasLtCreate");
  cudaStream_t stream = nullptr;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Buffer workspace = allocate(kWorkspaceBytes);
  Buffer scale = allocate(sizeof(float));  // a separate 256-byte aligned allocation
  const float scale_value = 1.0f / 64.0f;
  BENCH_CUDA(cudaMemcpy(scale.get(), &scale_value, sizeof(float), cudaMemcpyHostToDevice));

  const int64_t t = options.tokens, c = 768;
  std::vector<Shape> shapes;
  const std::pair<const char*, int64_t> head_dims[] = {{"D128", 2304}, {"D96", 1920}};
  for (const auto& [dname, qkv] : head_dims) {
    shapes.push_back({std::string("fwd_") + dname, t, qkv, c, true});
    shapes.push_back({std::string("wgrad_") + dname, qkv, c, t, false});
    shapes.push_back({std::string("dgrad_") + dname, t, c, qkv, false});
  }
  for (const Shape& s : shapes) {
    try {
      sweep(handle, s, l2_bytes, workspace.get(), scale.get(), stream, options.iters);
    } catch (const std::exception& e) {
      std::printf("%s: FAILED: %s\n", s.name.c_str(), e.what());
      BENCH_CUDA(cudaDeviceSynchronize());
    }
  }
  if (!options.csv.empty()) write_csv(options.csv);
  cudaStreamDestroy(stream);
  cublasLtDestroy(handle);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qkvfuse_bench_gemm_algos: %s\n", e.what());
    return 1;
  }
}
