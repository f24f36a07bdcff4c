// gemm_algos.cu: a diagnostic sweep of cuBLASLt's algorithms for the three FP8 GEMMs of the
// packed QKV op. For each shape it answers: which algorithms does the heuristic offer, how fast is
// each, and how far is the heuristic's first choice (what torch._scaled_mm runs) from the fastest?
// qkvfuse::fp8_gemm itself autotunes: on the first call of a shape it times the heuristic's first
// workspace-free candidates (the "ws0" rows below), then those that need workspace, and keeps the
// fastest (src/cuda/fp8_gemm_cublaslt.cpp, "Algorithm choice").
//
//   qkvfuse_bench_gemm_algos [--csv PATH] [--tokens T] [--iters N] [--shapes all|d128|d96]
//                            [--sweep [--max-configs N] [--sweep-iters N]]
//
// The matmul is set up exactly as src/cuda/fp8_gemm_cublaslt.cpp sets it up: d[M,N] (bf16,
// row-major) = a[M,K] @ b[N,K]^T (e4m3, row-major), i.e. column-major TN with cuBLASLt's A = b
// (TRANSA = T), B = a (TRANSB = N), D = d as [N x M]; CUBLAS_COMPUTE_32F, scale type fp32, device
// fp32 A/B scale pointers, host alpha = 1 / beta = 0, FAST_ACCUM per shape; preference
// MAX_WORKSPACE_BYTES = 32 MiB (fp8_gemm's second query) and MIN_ALIGNMENT_{A,B,C,D} = 256. The heuristic is asked for up to
// 32 algorithms; each usable one is timed (median of --iters, all iterations queued behind a spin
// kernel, operands rotated over enough copies that one pass touches > 3x the L2). A second query,
// "ws1MiB", caps the workspace at 1 MiB (as torch._scaled_mm does when its cuBLASLt workspace is
// small) and times its rank-0 pick, to show whether a smaller workspace changes the choice; a
// third, "ws0", allows no workspace and times its first 8 candidates (graph form included).
// --shapes d128 or d96 keeps only that head dimension's three shapes (default: all six).
//
// --sweep asks whether configurations OUTSIDE the heuristic's short list are faster. After the
// default rows of a shape it enumerates configurations itself: every algorithm id that
// cublasLtMatmulAlgoGetIds lists for these types, each initialised by cublasLtMatmulAlgoInit and
// varied over what its capabilities allow: the tile ids (the heuristic's first, then the rest of
// CUBLASLT_ALGO_CAP_TILE_IDS), the cluster shapes the heuristic chose for that id (cuBLASLt 13
// exposes no cluster-shape capability; AUTO where the heuristic chose none), custom options
// 0..CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX (the heuristic's most used first) and CTA swizzling 0/1
// where CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT allows it. Split-K stays 1, so the count stays
// bounded and no configuration needs a reduction workspace. Stages are "auto": the first of the
// heuristic's stage ids, then the capability's *xAUTO ids, that cublasLtMatmulAlgoCheck accepts.
// The heuristic's own configurations (at split-K 1) come first; then, level by level with
// swizzle outermost and custom option next, every tile x every cluster shape, so a budget that
// runs out cuts custom options and swizzling before it cuts tiles. Configurations that
// cublasLtMatmulAlgoCheck rejects, or that need more than the 32 MiB workspace, are counted and
// skipped; at most --max-configs (default 400) valid ones per shape are timed, each the median of
// --sweep-iters (default 20) in the same loop as above, as rows of variant "sweep". The three
// fastest, the heuristic's rank 0 and its fastest candidate are then timed again with --iters
// (variant "confirm"): a minimum over hundreds of short medians favours a lucky one, so the
// per-shape summary compares those re-timed values. The summaries are repeated at the end.
// Runtime: each configuration costs (6 + sweep-iters) GEMMs of 0.11-0.16 ms, the spin kernel
// (0.8 ms at 20), host work and, the first time a kernel runs, its lazy module load: ~6-10 ms, so
// ~3-4 s a shape at the defaults and ~20-40 s for all six (half with --shapes d128).
//
// Each heuristic candidate is also run in the form a CUDA graph gives it (graph=, memsets=,
// kernels=): the memset and kernel nodes one launch adds to a captured graph (some cuBLASLt kernels
// zero part of their workspace before each launch) and the per-launch median of replays of a
// graph of 8 launches, which includes what a memset node and the gap after it cost.
//
// Output: one line per algorithm or configuration on stdout; --csv PATH writes the same rows.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bench_common.cuh"

namespace {

using namespace qkvfuse::bench;

constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // the library's cuBLASLt workspace
constexpr size_t kSmallWorkspaceBytes = size_t(1) << 20;
constexpr int kRequestedAlgos = 32;
// Launches per captured graph in the graph-form timing.
constexpr int kGraphLaunches = 8;

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

/// Reads a configuration attribute of `algo` into `value`; false where the query fails (e.g. the
/// cluster shape of an algorithm that has none).
template <typename T>
bool query_config(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attribute,
                  T& value) {
  size_t written = 0;
  return cublasLtMatmulAlgoConfigGetAttribute(&algo, attribute, &value, sizeof(value),
                                              &written) == CUBLAS_STATUS_SUCCESS;
}

/// One algorithm's identity, each field '-' when its query fails.
std::vector<std::string> algo_identity(const cublasLtMatmulAlgo_t& algo) {
  const auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attribute, auto zero) {
    decltype(zero) value = zero;
    return query_config(algo, attribute, value) ? std::to_string(value) : std::string("-");
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
  // CUDA-graph form (heuristic rows): memset and kernel nodes that one launch adds to a captured
  // graph, and the per-launch median of a replayed graph of kGraphLaunches launches.
  int memsets = -1, kernels = -1;
  double graph_ms = NAN;
};

std::vector<Row> g_rows;

void print_row(const Row& r) {
  const std::vector<std::string>& id = r.identity;
  const auto num = [](double v, const char* format) {
    char buffer[32] = "-";
    if (!std::isnan(v)) std::snprintf(buffer, sizeof(buffer), format, v);
    return std::string(buffer);
  };
  std::string graph;
  if (r.memsets >= 0) {
    graph = " graph=" + num(r.graph_ms, "%.4f") + " memsets=" + std::to_string(r.memsets) +
            " kernels=" + std::to_string(r.kernels);
  }
  std::printf("%-28s %-11s %4d %9s %8s  algo=%s tile=%s stages=%s splitk=%s red=%s swz=%s "
              "custom=%s cluster=%s ws=%zu%s%s%s\n",
              r.shape.c_str(), r.variant.c_str(), r.rank, num(r.ms, "%.4f").c_str(),
              num(r.tflops, "%.1f").c_str(), id[0].c_str(),
              id[1].c_str(), id[2].c_str(), id[3].c_str(), id[4].c_str(), id[5].c_str(),
              id[6].c_str(), id[7].c_str(), r.workspace, graph.c_str(),
              r.fastest ? "  <== fastest" : "", r.status.empty() ? "" : ("  " + r.status).c_str());
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

// ---- --sweep: configurations outside the heuristic's list ---------------------------------------

/// What --sweep adds to each shape (see the header).
struct SweepOptions {
  bool enabled = false;
  int max_configs = 400;  ///< valid configurations timed per shape
  int iters = 20;         ///< each one's median is over this many
  int confirm = 3;        ///< the fastest this many are timed again with --iters
};

/// A configuration's fields, less the stage id (resolved by cublasLtMatmulAlgoCheck, see
/// check_config) and split-K (always 1).
struct Config {
  int32_t algo_id = 0;
  uint32_t tile = 0;
  uint16_t cluster = 0;
  uint32_t custom = 0;
  uint32_t swizzle = 0;
  auto key() const { return std::make_tuple(algo_id, tile, cluster, custom, swizzle); }
};

/// One algorithm id and the values the sweep gives each field, in the order it tries them.
struct AlgoSpace {
  int32_t id = 0;
  cublasLtMatmulAlgo_t base{};     ///< as cublasLtMatmulAlgoInit leaves it
  bool offered = false;            ///< the heuristic chose this id at least once
  size_t offered_tiles = 0;        ///< tiles[0 .. offered_tiles) are the heuristic's
  std::vector<uint32_t> tiles;     ///< the heuristic's, then the rest of the capability's
  std::vector<uint32_t> stages;    ///< tried in turn; the first one Check accepts is kept
  std::vector<uint16_t> clusters;  ///< the heuristic's for this id, else AUTO
  std::vector<uint32_t> customs;   ///< the heuristic's most used first, then 0..max
  std::vector<uint32_t> swizzles;  ///< 0, and 1 where supported
  bool splitk = false;             ///< capability only (reported); the sweep keeps split-K 1
};

template <typename T>
void push_unique(std::vector<T>& values, T value) {
  if (std::find(values.begin(), values.end(), value) == values.end()) values.push_back(value);
}

template <typename T>
std::string join(const std::vector<T>& values) {
  std::string text;
  for (const T& value : values) text += (text.empty() ? "" : ",") + std::to_string(value);
  return text;
}

/// A configuration attribute of `algo`, or `fallback` where the query fails.
template <typename T>
T config_value(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attribute,
               T fallback) {
  T value = fallback;
  return query_config(algo, attribute, value) ? value : fallback;
}

/// A scalar capability of `algo`, or `fallback` where the query fails.
template <typename T>
T cap_value(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attribute,
            T fallback) {
  T value = fallback;
  size_t written = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoCapGetAttribute(&algo, attribute, &value, sizeof(value), &written);
  return status == CUBLAS_STATUS_SUCCESS ? value : fallback;
}

/// An array capability (tile or stage ids) of `algo`; empty where the query fails.
std::vector<uint32_t> cap_ids(const cublasLtMatmulAlgo_t& algo,
                              cublasLtMatmulAlgoCapAttributes_t attribute) {
  size_t bytes = 0;  // asked with sizeInBytes = 0, cuBLASLt reports the size it needs
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attribute, nullptr, 0, &bytes) !=
          CUBLAS_STATUS_SUCCESS ||
      bytes == 0) {
    return {};
  }
  std::vector<uint32_t> ids(bytes / sizeof(uint32_t));
  size_t written = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attribute, ids.data(),
                                        ids.size() * sizeof(uint32_t),
                                        &written) != CUBLAS_STATUS_SUCCESS) {
    return {};
  }
  ids.resize(written / sizeof(uint32_t));
  return ids;
}

bool is_auto_stages(uint32_t id) {
  return id >= CUBLASLT_MATMUL_STAGES_8xAUTO && id <= CUBLASLT_MATMUL_STAGES_768xAUTO;
}

/// The search space of every algorithm id cuBLASLt lists for the op's types (the heuristic's ids
/// first), seeded with what the heuristic `offered` for this shape.
std::vector<AlgoSpace> algo_spaces(cublasLtHandle_t handle,
                                   const std::vector<cublasLtMatmulHeuristicResult_t>& offered) {
  std::vector<int> ids(1024);
  int returned = 0;
  lt_check(cublasLtMatmulAlgoGetIds(handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_8F_E4M3,
                                    CUDA_R_8F_E4M3, CUDA_R_16BF, CUDA_R_16BF, int(ids.size()),
                                    ids.data(), &returned),
           "cublasLtMatmulAlgoGetIds");
  ids.resize(size_t(std::max(returned, 0)));
  std::printf("  sweep: cublasLtMatmulAlgoGetIds lists %zu algorithm ids: %s\n", ids.size(),
              join(ids).c_str());

  std::vector<AlgoSpace> spaces;
  for (const int id : ids) {
    AlgoSpace space;
    space.id = id;
    const cublasStatus_t init =
        cublasLtMatmulAlgoInit(handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_8F_E4M3,
                               CUDA_R_8F_E4M3, CUDA_R_16BF, CUDA_R_16BF, id, &space.base);
    if (init != CUBLAS_STATUS_SUCCESS) {
      std::printf("  sweep: algo %d skipped: cublasLtMatmulAlgoInit failed: %s\n", id,
                  cublasLtGetStatusName(init));
      continue;
    }
    const int32_t custom_max =
        std::max(cap_value<int32_t>(space.base, CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX, 0), 0);

    // What the heuristic chose for this id, in rank order; custom options counted by use.
    std::vector<uint32_t> offered_stages;
    std::map<uint32_t, int> custom_uses;
    std::vector<uint32_t> offered_customs;
    for (const cublasLtMatmulHeuristicResult_t& r : offered) {
      if (config_value<int32_t>(r.algo, CUBLASLT_ALGO_CONFIG_ID, -1) != id) continue;
      space.offered = true;
      push_unique(space.tiles, config_value<uint32_t>(r.algo, CUBLASLT_ALGO_CONFIG_TILE_ID, 0));
      push_unique(offered_stages,
                  config_value<uint32_t>(r.algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, 0));
      const uint16_t cluster =
          config_value<uint16_t>(r.algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, 0);
      if (cluster != CUBLASLT_CLUSTER_SHAPE_AUTO) push_unique(space.clusters, cluster);
      const uint32_t custom = config_value<uint32_t>(r.algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, 0);
      if (custom <= uint32_t(custom_max)) {
        ++custom_uses[custom];
        push_unique(offered_customs, custom);
      }
    }
    space.offered_tiles = space.tiles.size();

    const std::vector<uint32_t> cap_tiles = cap_ids(space.base, CUBLASLT_ALGO_CAP_TILE_IDS);
    for (const uint32_t tile : cap_tiles) push_unique(space.tiles, tile);
    if (space.tiles.empty()) space.tiles.push_back(CUBLASLT_MATMUL_TILE_UNDEFINED);

    // "Auto" stages: the heuristic's, then the capability's *xAUTO ids; where there are none,
    // UNDEFINED and then the capability's fixed ids (the first one Check accepts is kept).
    const std::vector<uint32_t> cap_stages = cap_ids(space.base, CUBLASLT_ALGO_CAP_STAGES_IDS);
    space.stages = offered_stages;
    for (const uint32_t stages : cap_stages) {
      if (is_auto_stages(stages)) push_unique(space.stages, stages);
    }
    if (space.stages.empty()) {
      space.stages.push_back(CUBLASLT_MATMUL_STAGES_UNDEFINED);
      for (const uint32_t stages : cap_stages) push_unique(space.stages, stages);
    }

    if (space.clusters.empty()) space.clusters.push_back(CUBLASLT_CLUSTER_SHAPE_AUTO);

    // Most used first; std::stable_sort keeps rank order among equal counts.
    std::stable_sort(offered_customs.begin(), offered_customs.end(),
                     [&](uint32_t x, uint32_t y) { return custom_uses[x] > custom_uses[y]; });
    space.customs = offered_customs;
    for (int32_t custom = 0; custom <= custom_max; ++custom) {
      push_unique(space.customs, uint32_t(custom));
    }

    space.swizzles.push_back(0);
    if (cap_value<uint32_t>(space.base, CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT, 0) != 0) {
      space.swizzles.push_back(1);
    }
    space.splitk = cap_value<int32_t>(space.base, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, 0) != 0;

    std::printf("  sweep: algo %d%s: %zu tile ids (%zu chosen by the heuristic), stages tried "
                "%s, clusters %s, custom options %s, swizzle %s, split-K %s (kept at 1)\n",
                id, space.offered ? " (heuristic's)" : "", space.tiles.size(),
                space.offered_tiles, join(space.stages).c_str(), join(space.clusters).c_str(),
                join(space.customs).c_str(), space.swizzles.size() > 1 ? "0,1" : "0",
                space.splitk ? "supported" : "unsupported");
    spaces.push_back(std::move(space));
  }
  std::stable_partition(spaces.begin(), spaces.end(),
                        [](const AlgoSpace& space) { return space.offered; });
  return spaces;
}

/// The candidates in the order the header gives: the heuristic's own configurations (at split-K
/// 1), then per (swizzle, custom option) level every algorithm's tiles x cluster shapes.
std::vector<Config> sweep_candidates(const std::vector<AlgoSpace>& spaces,
                                     const std::vector<cublasLtMatmulHeuristicResult_t>& offered) {
  std::vector<Config> candidates;
  std::set<decltype(Config().key())> seen;
  const auto add = [&](const Config& config) {
    if (seen.insert(config.key()).second) candidates.push_back(config);
  };
  for (const cublasLtMatmulHeuristicResult_t& r : offered) {
    Config config;
    config.algo_id = config_value<int32_t>(r.algo, CUBLASLT_ALGO_CONFIG_ID, -1);
    config.tile = config_value<uint32_t>(r.algo, CUBLASLT_ALGO_CONFIG_TILE_ID, 0);
    config.cluster = config_value<uint16_t>(r.algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, 0);
    config.custom = config_value<uint32_t>(r.algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, 0);
    config.swizzle = config_value<uint32_t>(r.algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, 0);
    const bool known = std::any_of(spaces.begin(), spaces.end(), [&](const AlgoSpace& space) {
      return space.id == config.algo_id;
    });
    if (known) add(config);
  }
  size_t levels_custom = 0, levels_swizzle = 0;
  for (const AlgoSpace& space : spaces) {
    levels_custom = std::max(levels_custom, space.customs.size());
    levels_swizzle = std::max(levels_swizzle, space.swizzles.size());
  }
  for (size_t swizzle = 0; swizzle < levels_swizzle; ++swizzle) {
    for (size_t custom = 0; custom < levels_custom; ++custom) {
      for (const AlgoSpace& space : spaces) {
        if (swizzle >= space.swizzles.size() || custom >= space.customs.size()) continue;
        for (const uint32_t tile : space.tiles) {
          for (const uint16_t cluster : space.clusters) {
            add({space.id, tile, cluster, space.customs[custom], space.swizzles[swizzle]});
          }
        }
      }
    }
  }
  return candidates;
}

/// Why candidates were not timed, counted for the shape's report.
struct Rejections {
  std::map<std::string, int> by_status;  ///< cublasLtMatmulAlgoCheck's status for the last stage
  int workspace = 0;                     ///< accepted, but needs more than kWorkspaceBytes
};

/// `config` applied to its algorithm, with the first of the space's stage ids that
/// cublasLtMatmulAlgoCheck accepts within the workspace; false (and why, in `rejections`) when
/// none is.
bool check_config(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t la,
                  cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t ld, const AlgoSpace& space,
                  const Config& config, cublasLtMatmulHeuristicResult_t& result,
                  Rejections& rejections) {
  cublasLtMatmulAlgo_t algo = space.base;
  const int32_t splitk = 1;
  const auto set = [&](cublasLtMatmulAlgoConfigAttributes_t attribute, const void* value,
                       size_t bytes) {
    return cublasLtMatmulAlgoConfigSetAttribute(&algo, attribute, value, bytes);
  };
  cublasStatus_t status = set(CUBLASLT_ALGO_CONFIG_TILE_ID, &config.tile, sizeof(config.tile));
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = set(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &config.cluster, sizeof(config.cluster));
  }
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = set(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &config.custom, sizeof(config.custom));
  }
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = set(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &config.swizzle, sizeof(config.swizzle));
  }
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = set(CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk));
  }
  if (status != CUBLAS_STATUS_SUCCESS) {
    ++rejections.by_status[std::string("ConfigSetAttribute ") + cublasLtGetStatusName(status)];
    return false;
  }
  bool too_large = false;
  for (const uint32_t stages : space.stages) {
    status = set(CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages));
    if (status != CUBLAS_STATUS_SUCCESS) continue;
    cublasLtMatmulHeuristicResult_t checked{};
    status = cublasLtMatmulAlgoCheck(handle, desc, la, lb, ld, ld, &algo, &checked);
    if (status != CUBLAS_STATUS_SUCCESS) continue;
    if (checked.workspaceSize > kWorkspaceBytes) {
      too_large = true;
      continue;
    }
    checked.algo = algo;  // Check reports on the algorithm but leaves this field alone
    checked.state = CUBLAS_STATUS_SUCCESS;
    result = checked;
    return true;
  }
  if (too_large) {
    ++rejections.workspace;
  } else {
    ++rejections.by_status[cublasLtGetStatusName(status)];
  }
  return false;
}

/// "algo=.. tile=.. ..." as print_row writes an identity.
std::string identity_text(const std::vector<std::string>& id) {
  return "algo=" + id[0] + " tile=" + id[1] + " stages=" + id[2] + " splitk=" + id[3] +
         " red=" + id[4] + " swz=" + id[5] + " custom=" + id[6] + " cluster=" + id[7];
}

/// Times one configuration into `row` (time_algo in bench_shape): the result, its workspace
/// limit and the number of iterations to take the median of.
using TimeAlgo =
    std::function<void(const cublasLtMatmulHeuristicResult_t&, size_t, int, Row&)>;

std::vector<std::string> g_sweep_summaries;

/// --sweep for one shape, after its default rows: `offered` and `offered_rows` are the
/// heuristic's candidates and their rows (the same order; rank 0's time sets the runtime
/// estimate), `confirm_iters` the --iters the final comparison uses. Appends its rows to `rows`.
void sweep_configs(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t la,
                   cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t ld, const std::string& label,
                   const std::vector<cublasLtMatmulHeuristicResult_t>& offered,
                   const std::vector<Row>& offered_rows, const SweepOptions& options,
                   int confirm_iters, const TimeAlgo& time_algo, std::vector<Row>& rows) {
  const auto start = std::chrono::steady_clock::now();
  const auto elapsed_s = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  const std::vector<AlgoSpace> spaces = algo_spaces(handle, offered);
  const std::vector<Config> candidates = sweep_candidates(spaces, offered);

  // Checking is host-only and cheap, but bounded too, in case an algorithm lists many tiles
  // that all fail.
  const size_t max_checks = size_t(options.max_configs) * 20;
  std::vector<cublasLtMatmulHeuristicResult_t> valid;
  Rejections rejections;
  size_t checked = 0;
  for (const Config& config : candidates) {
    if (valid.size() >= size_t(options.max_configs) || checked >= max_checks) break;
    ++checked;
    const auto space = std::find_if(spaces.begin(), spaces.end(),
                                    [&](const AlgoSpace& s) { return s.id == config.algo_id; });
    cublasLtMatmulHeuristicResult_t result{};
    if (check_config(handle, desc, la, lb, ld, *space, config, result, rejections)) {
      valid.push_back(result);
    }
  }
  std::string rejected;
  for (const auto& [status, count] : rejections.by_status) {
    rejected += " " + status + " x" + std::to_string(count) + ";";
  }
  std::printf("  sweep: %zu candidates, %zu checked in %.2f s, %zu valid (limit %d), rejected:%s "
              "workspace > 32 MiB x%d%s\n",
              candidates.size(), checked, elapsed_s(), valid.size(), options.max_configs,
              rejected.c_str(), rejections.workspace,
              checked < candidates.size() ? "; the rest not checked (raise --max-configs)" : "");

  // The estimate: warm-up (5) + first launch + iterations, the spin kernel that time_median
  // queues (30 us per iteration + 200 us), ~1 ms of host work.
  double reference_ms = offered_rows.empty() ? NAN : offered_rows[0].ms;
  if (std::isnan(reference_ms)) reference_ms = 0.15;
  const double per_config_ms =
      (6 + options.iters) * reference_ms + 0.03 * options.iters + 0.2 + 1.0;
  std::printf("  sweep: timing %zu configurations, median of %d each: about %.1f s\n",
              valid.size(), options.iters, double(valid.size()) * per_config_ms * 1e-3);
  std::fflush(stdout);

  std::vector<Row> sweep_rows;
  double best_ms = NAN;
  for (size_t i = 0; i < valid.size(); ++i) {
    Row row;
    row.shape = label;
    row.variant = "sweep";
    row.rank = int(i);
    time_algo(valid[i], kWorkspaceBytes, options.iters, row);
    print_row(row);
    if (!std::isnan(row.ms) && (std::isnan(best_ms) || row.ms < best_ms)) best_ms = row.ms;
    sweep_rows.push_back(row);
    if ((i + 1) % 50 == 0 && i + 1 < valid.size()) {
      std::printf("  sweep: %zu of %zu timed, %.1f s, best so far %.4f ms\n", i + 1,
                  valid.size(), elapsed_s(), best_ms);
    }
    std::fflush(stdout);
  }

  // Re-time the fastest few with --iters, beside the heuristic's rank 0 and fastest candidate.
  std::vector<size_t> order;
  for (size_t i = 0; i < sweep_rows.size(); ++i) {
    if (!std::isnan(sweep_rows[i].ms)) order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t x, size_t y) { return sweep_rows[x].ms < sweep_rows[y].ms; });
  order.resize(std::min(order.size(), size_t(options.confirm)));
  int offered_best = -1;
  for (size_t i = 0; i < offered_rows.size(); ++i) {
    const double ms = offered_rows[i].ms;
    if (!std::isnan(ms) && (offered_best < 0 || ms < offered_rows[size_t(offered_best)].ms)) {
      offered_best = int(i);
    }
  }
  struct Retime {
    const cublasLtMatmulHeuristicResult_t* result;
    int rank;
    std::string what;
  };
  std::vector<Retime> retimes;
  if (!offered_rows.empty() && !std::isnan(offered_rows[0].ms)) {
    retimes.push_back({&offered[0], 0, "heuristic rank 0"});
  }
  if (offered_best > 0) {
    retimes.push_back({&offered[size_t(offered_best)], offered_best, "heuristic fastest"});
  }
  for (const size_t i : order) retimes.push_back({&valid[i], int(i), "sweep"});
  std::printf("  sweep: re-timing %zu configurations, median of %d each:\n", retimes.size(),
              confirm_iters);
  std::vector<Row> confirm_rows;
  int best_sweep = -1;
  for (const Retime& retime : retimes) {
    Row row;
    row.shape = label;
    row.variant = "confirm";
    row.rank = retime.rank;
    time_algo(*retime.result, kWorkspaceBytes, confirm_iters, row);
    row.status = retime.what + (row.status.empty() ? "" : "; " + row.status);
    const bool is_sweep = retime.what == "sweep";
    if (is_sweep && !std::isnan(row.ms) &&
        (best_sweep < 0 || row.ms < confirm_rows[size_t(best_sweep)].ms)) {
      best_sweep = int(confirm_rows.size());
    }
    confirm_rows.push_back(row);
  }
  if (best_sweep >= 0) confirm_rows[size_t(best_sweep)].fastest = true;
  for (const Row& row : confirm_rows) print_row(row);

  // The summary, from the re-timed rows.
  char line[512];
  std::string summary = label + ": " + std::to_string(valid.size()) + " sweep configurations ";
  std::snprintf(line, sizeof(line), "(%zu checked of %zu candidates) in %.1f s\n", checked,
                candidates.size(), elapsed_s());
  summary += line;
  if (best_sweep < 0) {
    summary += "    no sweep configuration ran\n";
  } else {
    const Row& best = confirm_rows[size_t(best_sweep)];
    std::snprintf(line, sizeof(line), "    best sweep (#%d):        %.4f ms %7.1f TFLOP/s  %s\n",
                  best.rank, best.ms, best.tflops, identity_text(best.identity).c_str());
    summary += line;
    for (const Row& row : confirm_rows) {
      if (row.status.rfind("heuristic", 0) != 0 || std::isnan(row.ms)) continue;
      const std::string what =
          row.rank != 0 ? "heuristic fastest (rank " + std::to_string(row.rank) + "):"
          : offered_best == 0 ? std::string("heuristic rank 0 (also its fastest):")
                              : std::string("heuristic rank 0:");
      const double slower_percent = 100.0 * (row.ms / best.ms - 1.0);
      std::snprintf(line, sizeof(line), "    %s %.4f ms %7.1f TFLOP/s  %s; %.1f%% %s than the "
                    "best sweep\n",
                    what.c_str(), row.ms, row.tflops, identity_text(row.identity).c_str(),
                    std::fabs(slower_percent), slower_percent >= 0.0 ? "slower" : "faster");
      summary += line;
    }
  }
  std::printf("  sweep summary, %s", summary.c_str());
  std::fflush(stdout);
  g_sweep_summaries.push_back(summary);
  rows.insert(rows.end(), sweep_rows.begin(), sweep_rows.end());
  rows.insert(rows.end(), confirm_rows.begin(), confirm_rows.end());
}

/// The default rows of one shape (the heuristic's candidates, the ws1MiB variant), then --sweep's.
void bench_shape(cublasLtHandle_t handle, const Shape& s, size_t l2_bytes, void* workspace,
                 const void* scale, cudaStream_t stream, int iters, const SweepOptions& sweep) {
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

  // The graph form of one algorithm: some cuBLASLt kernels zero part of the workspace with a
  // memset before each launch, and in a CUDA graph a memset node costs its own ~0.8 us plus a
  // ~3 us gap before the next kernel node (the packed op's profile); a launch-loop timing hides
  // part of that. Counts the memset and kernel nodes one launch adds to a captured graph and
  // times replays of a graph of kGraphLaunches launches (per launch).
  const auto time_graph = [&](const std::function<cublasStatus_t(int)>& launch, int timing_iters,
                              Row& row) {
    cudaGraph_t graph = nullptr;
    BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
    for (int i = 0; i < kGraphLaunches && status == CUBLAS_STATUS_SUCCESS; ++i) status = launch(i);
    BENCH_CUDA(cudaStreamEndCapture(stream, &graph));
    if (status != CUBLAS_STATUS_SUCCESS) {
      cudaGraphDestroy(graph);
      row.status = std::string("GRAPH CAPTURE FAILED: ") + cublasLtGetStatusName(status);
      return;
    }
    size_t count = 0;
    BENCH_CUDA(cudaGraphGetNodes(graph, nullptr, &count));
    std::vector<cudaGraphNode_t> nodes(count);
    BENCH_CUDA(cudaGraphGetNodes(graph, nodes.data(), &count));
    int memsets = 0, kernels = 0;
    for (cudaGraphNode_t node : nodes) {
      cudaGraphNodeType type{};
      BENCH_CUDA(cudaGraphNodeGetType(node, &type));
      memsets += type == cudaGraphNodeTypeMemset;
      kernels += type == cudaGraphNodeTypeKernel;
    }
    row.memsets = memsets / kGraphLaunches;
    row.kernels = kernels / kGraphLaunches;
    cudaGraphExec_t exec = nullptr;
    BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    row.graph_ms = time_median([&](int) { BENCH_CUDA(cudaGraphLaunch(exec, stream)); }, stream,
                               std::max(20, timing_iters / 4), true) / kGraphLaunches;
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  };

  // Times one algorithm (median of `timing_iters`); a launch error is recorded on the row
  // instead of aborting the sweep. graph_form: also its graph form (time_graph).
  const auto time_algo = [&](const cublasLtMatmulHeuristicResult_t& r, size_t ws_limit,
                             int timing_iters, Row& row, bool graph_form = false) {
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
      row.ms = time_median([&](int i) { lt_check(launch(i), "cublasLtMatmul"); }, stream,
                           timing_iters, true);
      row.tflops = flops / (row.ms * 1e-3) / 1e12;
      if (graph_form) time_graph(launch, timing_iters, row);
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
    time_algo(main_results[i], kWorkspaceBytes, iters, row, true);
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
    time_algo(small[0], kSmallWorkspaceBytes, iters, row);
  }
  const bool same = !rows.empty() && rows[0].identity == row.identity;
  const std::vector<Row> offered_rows = rows;  // before ws1MiB joins them
  rows.push_back(row);
  std::printf("  variant ws1MiB (workspace limit 1 MiB, rank 0; %s heuristic32 rank 0):\n",
              same ? "same algorithm as" : "DIFFERENT from");
  print_row(row);
  std::fflush(stdout);

  // Variant: no workspace at all. The forward and dgrad kernels the heuristic ranks first take 4
  // bytes of workspace that cuBLASLt zeroes with a memset before every launch (memsets=1); with
  // a limit of 0 the heuristic can only offer kernels that need none.
  const auto none = heuristic(handle, desc, la, lb, ld, 0, kGraphLaunches);
  std::printf("  variant ws0 (workspace limit 0, %zu candidates):\n", none.size());
  for (size_t i = 0; i < none.size(); ++i) {
    Row zero_row;
    zero_row.shape = label;
    zero_row.variant = "ws0";
    zero_row.rank = int(i);
    time_algo(none[i], 0, iters, zero_row, true);
    print_row(zero_row);
    rows.push_back(zero_row);
  }
  std::fflush(stdout);

  if (sweep.enabled) {
    try {
      sweep_configs(handle, desc, la, lb, ld, label, main_results, offered_rows, sweep, iters,
                    time_algo, rows);
    } catch (const std::exception& e) {  // keep the shape's default rows
      std::printf("  sweep: FAILED: %s\n", e.what());
      BENCH_CUDA(cudaStreamSynchronize(stream));
    }
  }

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
                  "custom,cluster,workspace,status,graph_ms,memsets,kernels\n");
  const auto num = [](double v) { return std::isnan(v) ? std::string() : std::to_string(v); };
  for (const Row& r : g_rows) {
    std::string status = r.status + (r.fastest ? "fastest" : "");
    std::replace(status.begin(), status.end(), ',', ';');
    std::fprintf(f, "%s,%d,%s,%s,%s", r.shape.c_str(), r.rank, r.variant.c_str(),
                 num(r.ms).c_str(), num(r.tflops).c_str());
    for (const std::string& field : r.identity) std::fprintf(f, ",%s", field.c_str());
    std::fprintf(f, ",%zu,%s,%s,%d,%d\n", r.workspace, status.c_str(), num(r.graph_ms).c_str(),
                 r.memsets, r.kernels);
  }
  std::fclose(f);
  std::printf("wrote %s\n", path.c_str());
}

void print_usage(const char* program) {
  std::fprintf(stderr, "usage: %s [--csv PATH] [--tokens T] [--iters N (>= 50)] "
                       "[--shapes all|d128|d96] [--sweep [--max-configs N (>= 1)] "
                       "[--sweep-iters N (>= 5)]]\n", program);
}

/// Takes this tool's own options (--sweep, --max-configs, --sweep-iters, --shapes) out of argv
/// and leaves the shared ones in `rest` for parse_options; false (after the usage) on a bad value.
bool parse_tool_options(int argc, char** argv, SweepOptions& sweep, std::string& shapes,
                        std::vector<char*>& rest) {
  rest.assign(argv, argv + 1);
  bool ok = true;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--sweep") {
      sweep.enabled = true;
    } else if (arg == "--max-configs" && i + 1 < argc) {
      sweep.max_configs = std::atoi(argv[++i]);
      ok = ok && sweep.max_configs >= 1;
    } else if (arg == "--sweep-iters" && i + 1 < argc) {
      sweep.iters = std::atoi(argv[++i]);
      ok = ok && sweep.iters >= 5;
    } else if (arg == "--shapes" && i + 1 < argc) {
      shapes = argv[++i];
      ok = ok && (shapes == "all" || shapes == "d128" || shapes == "d96");
    } else {
      rest.push_back(argv[i]);
    }
  }
  if (!ok) print_usage(argv[0]);
  return ok;
}

int run(int argc, char** argv) {
  SweepOptions sweep;
  std::string shape_filter = "all";
  std::vector<char*> rest;
  if (!parse_tool_options(argc, argv, sweep, shape_filter, rest)) return 2;
  Options options;
  if (!parse_options(int(rest.size()), rest.data(), options)) {
    print_usage(argv[0]);  // parse_options' usage line lists only the shared options
    return 2;
  }
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
  if (sweep.enabled) {
    std::printf("sweep: up to %d valid configurations a shape, median of %d each; the fastest "
                "%d re-timed with --iters\n",
                sweep.max_configs, sweep.iters, sweep.confirm);
  }
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
    if (shape_filter != "all" && shape_filter != "d" + std::string(dname + 1)) continue;
    shapes.push_back({std::string("fwd_") + dname, t, qkv, c, true});
    shapes.push_back({std::string("wgrad_") + dname, qkv, c, t, false});
    shapes.push_back({std::string("dgrad_") + dname, t, c, qkv, false});
  }
  for (const Shape& s : shapes) {
    try {
      bench_shape(handle, s, l2_bytes, workspace.get(), scale.get(), stream, options.iters,
                  sweep);
    } catch (const std::exception& e) {
      std::printf("%s: FAILED: %s\n", s.name.c_str(), e.what());
      BENCH_CUDA(cudaDeviceSynchronize());
    }
  }
  if (!g_sweep_summaries.empty()) {
    std::printf("\n== sweep summary (re-timed, median of %d)\n", options.iters);
    for (const std::string& summary : g_sweep_summaries) std::printf("%s", summary.c_str());
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
