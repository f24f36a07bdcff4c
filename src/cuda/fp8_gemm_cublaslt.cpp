// fp8_gemm_cublaslt.cpp: the per-tensor scaled FP8 GEMM through cuBLASLt (the CUDA backend of
// qkvfuse::fp8_gemm).
//
//   d[M, N] (bf16) = (a[M, K] @ b[N, K]^T) * scale_a * scale_b * alpha
//   a, b: e4m3, row-major (K contiguous); fp32 accumulation; rounded to bf16 once.
//
// Row-major to column-major. cuBLASLt is column-major. A row-major matrix X[R, C] with row stride
// ld is, byte for byte, the column-major matrix X^T[C, R] with leading dimension ld. So the
// row-major result D[M, N] is the column-major D^T[N, M], and
//     D^T = (A B^T)^T = B A^T.
// cuBLASLt computes  D_cm[m', n'] = op(A') op(B')  with m' = N, n' = M, k' = K:
//   A' = b: row-major [N, K] = column-major [K, N] (ld = ldb); op(A') = A'^T = [N, K]: TRANSA = T
//   B' = a: row-major [M, K] = column-major [K, M] (ld = lda); op(B') = B'       : TRANSB = N
//   C' = D' = d: row-major [M, N] = column-major [N, M] (ld = ldd)
// This is the "TN" layout, the only one cuBLASLt's FP8 kernels take on Hopper: both operands
// K-major, which is what the wgmma instructions read for 8-bit types. Because the operands swap
// places, A_SCALE_POINTER is b's scale and B_SCALE_POINTER is a's scale.
//
// FP8 requirements (cuBLASLt "cublasLtMatmul" docs, FP8 section, plus what the kernels need):
//   - compute type CUBLAS_COMPUTE_32F, scale type CUDA_R_32F; A/B scales are fp32 device scalars;
//   - TN format (above); all matrix pointers 16-byte aligned;
//   - lda, ldb multiples of 16 bytes (= elements for e4m3); ldd * 2 bytes a multiple of 16;
//   - M, N, K multiples of 16 (the public validator in src/fp8_gemm.cpp refuses anything else
//     before we get here; the checks below repeat it because they cost nothing).
//
// Pointer mode and scales: what torch._scaled_mm does. CUBLASLT_POINTER_MODE_HOST with alpha = 1.0f
// and beta = 0.0f in host memory (captured by value at the call, so graph-safe); the per-tensor
// scales go in through A_SCALE_POINTER / B_SCALE_POINTER, device fp32 scalars. A device alpha
// (the packed op's qkv_scale) cannot be host alpha without a sync, so it is folded on the stream:
// a one-thread kernel writes combined = (scale_a * scale_b) * alpha (the CPU backend's order) and
// 1.0f into two 128-byte aligned slots at the head of the stream's workspace, and cuBLASLt gets
// B_SCALE = combined, A_SCALE = 1 (products with 1 are exact). Caller scales that are not 16-byte
// aligned are staged the same way (alpha absent: combined = scale_a * scale_b, one product, the
// same rounding cuBLASLt applies to the two scales). With no alpha and aligned scales there is
// no extra kernel: the caller's pointers go straight to cuBLASLt.
//
// Why not CUBLASLT_POINTER_MODE_DEVICE: the launch-time check (which the heuristic never sees)
// refused it with NOT_SUPPORTED for scalars packed in one small buffer, and where it ran it was
// no faster than the fold (docs/perf_notes.md). As a last line of defence a launch refused with
// NOT_SUPPORTED is retried with the heuristic's next algorithms (and with staged scales), and the
// algorithm that ran is remembered for the shape.
//
// Resources. One cuBLASLt handle per device, created on first use there (indexed by the tensors'
// device, never assuming device 0). One workspace per (device, stream): 256 bytes of scale slots,
// then 32 MiB for cuBLASLt (what TransformerEngine and PyTorch use on Hopper), allocated on the
// first GEMM issued on that stream. Per stream because split-K reductions and the scale slots are
// written by the kernels: GEMMs running concurrently on two streams of one device must not share
// them, and GEMMs on one stream are serialized by the stream, so one workspace per stream is
// exactly enough (PyTorch keys its cuBLAS workspaces by (handle, stream) for the same reason). A
// CUDA graph captured on a stream keeps that stream's workspace address: replaying it
// concurrently with other work on the capture stream would share it (as with PyTorch). Handles
// and workspaces live for the life of the process: destroying them from a static destructor would
// race the CUDA runtime's own teardown at exit.
//
// Algorithm choice. The heuristic is asked with only MAX_WORKSPACE_BYTES (and the pointer
// alignments) set, as torch._scaled_mm asks: first with no workspace at all, then with 32 MiB
// (heuristic_candidates). With 32 MiB its first algorithm for the forward and dgrad shapes is what
// torch runs (the same kernel in cuBLASLt's logs), and that kernel takes 4 bytes of workspace, a
// tile counter that cuBLASLt zeroes with a memset before every launch; in a CUDA-graph replay the
// memset node and the gap after it cost about 4 us per GEMM. Given no workspace, the same
// configuration runs a variant without the counter, as fast, so the workspace-free algorithms
// come first and those that need workspace (split-K, counters) after them, launched with the
// 32 MiB. The heuristic's first is not always the fastest it offers (on an H200 the op's forward
// GEMM runs fastest on a later candidate; docs/perf_notes.md), so the first call of each shape
// (per process and device) times up to kTuneAlgos candidates of each kind on the caller's stream,
// with the caller's operands (fastest_algorithm), memsets included, and keeps the fastest if it
// beats the first candidate by more than kTuneMargin, else the first: a near-tie resolves to the
// heuristic's choice. Later calls of the shape run that one algorithm (bit-identical results
// within the process). The timing synchronizes with the stream
// once per shape; a call made while the stream is being captured into a CUDA graph cannot
// synchronize, so it runs the first candidate (the heuristic's first workspace-free algorithm)
// and caches nothing (warm up eagerly before capturing to get the tuned one).
// QKVFUSE_FP8_GEMM_AUTOTUNE=0 in the environment turns the tuning off (=2 prints each shape's
// timings and pick; "w" marks the candidates launched with workspace).
//
// Split-K reductions. No REDUCTION_SCHEME_MASK: a COMPUTE_TYPE-only mask would keep split-K
// partial sums in fp32 (one bf16 rounding), but it can exclude the kernel the heuristic ranks
// first, which the long-K wgrad ([3072, 768], K = 49152: few output tiles for 132 SMs, where
// split-K pays) needs to match torch._scaled_mm (docs/perf_notes.md). The in-place / output-type
// schemes add one bf16 rounding per split (deterministic: INPLACE serializes the splits with
// counters); the tests' bounds and the packed op's tolerances allow it.
// QKVFUSE_FP8_GEMM_FP32_SPLITK=1 in the environment restores the mask.
// The result is cached per (device, M, N, K, lda, ldb, ldd, fast_accum, pointer alignment).
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "cuda/check.hpp"
#include "cuda/cublaslt_scalars.hpp"
#include "qkvfuse/error.hpp"

/// Throws qkvfuse::Error naming the call and cuBLASLt's status when a cuBLASLt call fails.
#define QKVF_CUBLASLT_CHECK(expr, what)                                                     \
  do {                                                                                      \
    const cublasStatus_t qkvf_blas_status_ = (expr);                                        \
    QKVF_CHECK(qkvf_blas_status_ == CUBLAS_STATUS_SUCCESS, "cuBLASLt: ", what, " failed: ", \
               cublasLtGetStatusName(qkvf_blas_status_), " (",                              \
               cublasLtGetStatusString(qkvf_blas_status_), ")");                            \
  } while (0)

namespace qkvfuse::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // cuBLASLt's part
// The head of each stream's workspace allocation: the staged scales. cuBLASLt's part follows at
// +256, which keeps the allocation's 256-byte alignment.
constexpr size_t kScalarSlotBytes = 256;
constexpr size_t kCombinedScaleOffset = 0;  // bytes: combined scale (fp32)
constexpr size_t kOneScaleOffset = 128;     // bytes: 1.0f
constexpr int kMaxDevices = 64;
// Algorithms kept per shape for the retry after a launch-time NOT_SUPPORTED (asked for only then).
constexpr int kFallbackAlgos = 8;
// Autotuning (see the header): candidates timed, launches per timing, and the margin by which a
// candidate must beat the heuristic's first choice to replace it.
constexpr int kTuneAlgos = 8;
constexpr int kTuneRounds = 3;    // every candidate timed once per round, rounds interleaved
constexpr int kTuneLaunches = 3;  // launches per timing
constexpr float kTuneMargin = 0.03f;

// ---- RAII wrappers for the cuBLASLt descriptors ------------------------------------------------

class MatmulDesc {
 public:
  MatmulDesc() {
    QKVF_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                        "cublasLtMatmulDescCreate");
  }
  ~MatmulDesc() {
    if (desc_) cublasLtMatmulDescDestroy(desc_);
  }
  MatmulDesc(const MatmulDesc&) = delete;
  MatmulDesc& operator=(const MatmulDesc&) = delete;

  template <typename T>
  void set(cublasLtMatmulDescAttributes_t attribute, const T& value, const char* name) {
    QKVF_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(desc_, attribute, &value, sizeof(T)), name);
  }
  cublasLtMatmulDesc_t get() const { return desc_; }

 private:
  cublasLtMatmulDesc_t desc_ = nullptr;
};

/// A column-major matrix layout: rows x cols with leading dimension ld (in elements).
class MatrixLayout {
 public:
  MatrixLayout(cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld) {
    QKVF_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&layout_, type, rows, cols, ld),
                        "cublasLtMatrixLayoutCreate");
  }
  ~MatrixLayout() {
    if (layout_) cublasLtMatrixLayoutDestroy(layout_);
  }
  MatrixLayout(const MatrixLayout&) = delete;
  MatrixLayout& operator=(const MatrixLayout&) = delete;
  cublasLtMatrixLayout_t get() const { return layout_; }

 private:
  cublasLtMatrixLayout_t layout_ = nullptr;
};

class MatmulPreference {
 public:
  MatmulPreference() {
    QKVF_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&preference_),
                        "cublasLtMatmulPreferenceCreate");
  }
  ~MatmulPreference() {
    if (preference_) cublasLtMatmulPreferenceDestroy(preference_);
  }
  MatmulPreference(const MatmulPreference&) = delete;
  MatmulPreference& operator=(const MatmulPreference&) = delete;

  template <typename T>
  void set(cublasLtMatmulPreferenceAttributes_t attribute, const T& value, const char* name) {
    QKVF_CUBLASLT_CHECK(
        cublasLtMatmulPreferenceSetAttribute(preference_, attribute, &value, sizeof(T)), name);
  }
  cublasLtMatmulPreference_t get() const { return preference_; }

 private:
  cublasLtMatmulPreference_t preference_ = nullptr;
};

// ---- per-device handle, per-(device, stream) workspace -----------------------------------------

/// Allocates with the calling thread's stream-capture mode relaxed: a first GEMM on a device or
/// stream may happen while some stream of the process is being captured into a CUDA graph, and in
/// the default (global) capture mode cudaMalloc is refused then. The allocation is not a stream
/// operation, so relaxing the check is safe.
void* capture_safe_malloc(size_t bytes) {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  QKVF_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  void* pointer = nullptr;
  const cudaError_t status = cudaMalloc(&pointer, bytes);
  cudaThreadExchangeStreamCaptureMode(&mode);  // restore the caller's mode
  QKVF_CHECK(status == cudaSuccess, "fp8_gemm: cudaMalloc of the ", bytes,
             "-byte cuBLASLt workspace failed: ", cudaGetErrorName(status), ": ",
             cudaGetErrorString(status));
  return pointer;
}

/// The device's cuBLASLt handle, created on first use. The caller has made `device` current.
cublasLtHandle_t handle_for(int device) {
  QKVF_CHECK(device >= 0 && device < kMaxDevices, "fp8_gemm: device ordinal ", device,
             " beyond the supported ", kMaxDevices);
  static std::array<std::once_flag, kMaxDevices> once;
  static std::array<cublasLtHandle_t, kMaxDevices> handles{};
  // call_once publishes the handle to every thread that passes it; if creation throws, the flag
  // stays unset and the next call retries.
  std::call_once(once[device], [device] {
    cublasLtHandle_t handle = nullptr;
    QKVF_CUBLASLT_CHECK(cublasLtCreate(&handle), "cublasLtCreate");
    handles[device] = handle;
  });
  return handles[device];
}

struct StreamKey {
  int device;
  cudaStream_t stream;
  bool operator==(const StreamKey& other) const {
    return device == other.device && stream == other.stream;
  }
};

struct StreamKeyHash {
  size_t operator()(const StreamKey& key) const {
    return std::hash<const void*>{}(static_cast<const void*>(key.stream)) ^
           (size_t(key.device) * 0x9e3779b97f4a7c15ull);
  }
};

/// The workspace of (device, stream): kScalarSlotBytes of scale slots, then kWorkspaceBytes for
/// cuBLASLt. Allocated on first use (the caller has made `device` current), kept for the process.
/// The map is guarded by a mutex: callers on any thread, any stream. A stream handle value that is
/// destroyed and reused by a new stream gets the old stream's workspace, which is fine: the GEMMs
/// of a destroyed stream are ordered before its destruction completes only from the host's view,
/// so callers must not destroy a stream with GEMMs pending and reuse the handle at once (the same
/// contract as any per-stream cache, PyTorch's included).
char* workspace_for(int device, cudaStream_t stream) {
  static std::mutex mutex;
  static std::unordered_map<StreamKey, char*, StreamKeyHash> workspaces;
  const StreamKey key{device, stream};
  std::lock_guard<std::mutex> lock(mutex);
  const auto found = workspaces.find(key);
  if (found != workspaces.end()) return found->second;
  // Allocated under the lock: a first use per stream is rare, and no two threads may allocate
  // for the same key.
  char* workspace = static_cast<char*>(capture_safe_malloc(kScalarSlotBytes + kWorkspaceBytes));
  workspaces.emplace(key, workspace);
  return workspace;
}

// ---- heuristic cache ---------------------------------------------------------------------------

struct PlanKey {
  int device;
  int64_t m, n, k;  // in the row-major (caller's) naming
  int64_t lda, ldb, ldd;
  bool fast_accum;
  bool fp32_splitk;  // REDUCTION_SCHEME_MASK = COMPUTE_TYPE (QKVFUSE_FP8_GEMM_FP32_SPLITK=1)
  int alignment;     // bytes: the smallest power-of-two alignment of a, b and d (capped at 256)

  bool operator==(const PlanKey& other) const {
    return device == other.device && m == other.m && n == other.n && k == other.k &&
           lda == other.lda && ldb == other.ldb && ldd == other.ldd &&
           fast_accum == other.fast_accum && fp32_splitk == other.fp32_splitk &&
           alignment == other.alignment;
  }
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& key) const {
    size_t hash = std::hash<int64_t>{}(key.m);
    const auto mix = [&hash](int64_t value) {
      hash ^= std::hash<int64_t>{}(value) + 0x9e3779b97f4a7c15ull + (hash << 6) + (hash >> 2);
    };
    mix(key.n);
    mix(key.k);
    mix(key.lda);
    mix(key.ldb);
    mix(key.ldd);
    mix(key.device);
    mix(int64_t(key.fast_accum) | (int64_t(key.fp32_splitk) << 1) |
        (int64_t(key.alignment) << 2));
    return hash;
  }
};

/// An algorithm and the workspace it is launched with. cuBLASLt picks the kernel at launch from
/// both: the same configuration given no workspace runs a variant that needs none.
struct Candidate {
  cublasLtMatmulAlgo_t algo;
  size_t workspace_bytes = 0;  ///< handed to cublasLtMatmul: 0 or kWorkspaceBytes
};

struct Plan {
  Candidate pick;             ///< the algorithm (and workspace) that runs this shape
  bool stage_scales = false;  ///< a launch with the caller's own scale pointers was refused
};

std::mutex g_plan_mutex;
std::unordered_map<PlanKey, Plan, PlanKeyHash> g_plans;

int pointer_alignment(const void* pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  int alignment = 256;
  while (alignment > 1 && address % uintptr_t(alignment) != 0) alignment /= 2;
  return alignment;
}

/// QKVFUSE_FP8_GEMM_AUTOTUNE: unset or 1 tunes, 0 runs the heuristic's first algorithm, 2 tunes
/// and prints each shape's timings and pick to stderr.
int autotune_mode() {
  static const int mode = [] {
    const char* value = std::getenv("QKVFUSE_FP8_GEMM_AUTOTUNE");
    if (value == nullptr || value[0] == '\0') return 1;
    return value[0] == '0' ? 0 : value[0] == '2' ? 2 : 1;
  }();
  return mode;
}

bool fp32_splitk_requested() {
  static const bool requested = [] {
    const char* value = std::getenv("QKVFUSE_FP8_GEMM_FP32_SPLITK");
    return value != nullptr && value[0] != '\0' && value[0] != '0';
  }();
  return requested;
}

/// Everything of one cublasLtMatmul call except the algorithm.
struct Operation {
  MatmulDesc desc;
  MatrixLayout a_layout;  // cuBLASLt's A: our b
  MatrixLayout b_layout;  // cuBLASLt's B: our a
  MatrixLayout d_layout;  // C and D: our d

  Operation(const PlanKey& key, const void* scale_of_b, const void* scale_of_a)
      : a_layout(CUDA_R_8F_E4M3, uint64_t(key.k), uint64_t(key.n), key.ldb),
        b_layout(CUDA_R_8F_E4M3, uint64_t(key.k), uint64_t(key.m), key.lda),
        d_layout(CUDA_R_16BF, uint64_t(key.n), uint64_t(key.m), key.ldd) {
    const int32_t transa = CUBLAS_OP_T;
    const int32_t transb = CUBLAS_OP_N;
    desc.set(CUBLASLT_MATMUL_DESC_TRANSA, transa, "set TRANSA");
    desc.set(CUBLASLT_MATMUL_DESC_TRANSB, transb, "set TRANSB");
    // Host mode is cuBLASLt's default; set explicitly because the whole design rests on it.
    const int32_t pointer_mode = CUBLASLT_POINTER_MODE_HOST;
    desc.set(CUBLASLT_MATMUL_DESC_POINTER_MODE, pointer_mode, "set POINTER_MODE");
    // Always set explicitly: the default (0, off) is cuBLASLt's choice today, not a contract.
    const int8_t fast_accum = key.fast_accum ? 1 : 0;
    desc.set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast_accum, "set FAST_ACCUM");
    desc.set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, scale_of_b, "set A_SCALE_POINTER");
    desc.set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, scale_of_a, "set B_SCALE_POINTER");
  }
};

/// Asks cuBLASLt's heuristic for up to `wanted` algorithms that fit `workspace_limit` bytes of
/// workspace, best first, each with the workspace it is to be launched with: none if it needs
/// none, else the limit. May be empty.
std::vector<Candidate> query_heuristic(cublasLtHandle_t handle, const PlanKey& key,
                                       const Operation& op, int wanted, uint64_t workspace_limit) {
  MatmulPreference preference;
  preference.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace_limit, "set MAX_WORKSPACE");
  if (key.fp32_splitk) {
    // Split-K partial sums only in fp32 (one bf16 rounding); see the header.
    const uint32_t reduction_mask = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    preference.set(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, reduction_mask,
                   "set REDUCTION_SCHEME_MASK");
  }
  // The actual pointer alignments: 256 (cuBLASLt's default, what torch leaves) for fresh
  // allocations; smaller for sliced operands, which excludes algorithms that need more.
  const uint32_t alignment = uint32_t(key.alignment);
  preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment, "set MIN_ALIGNMENT_A");
  preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment, "set MIN_ALIGNMENT_B");
  preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment, "set MIN_ALIGNMENT_C");
  preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment, "set MIN_ALIGNMENT_D");

  std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<size_t>(wanted));
  int returned = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      handle, op.desc.get(), op.a_layout.get(), op.b_layout.get(), op.d_layout.get(),
      op.d_layout.get(), preference.get(), wanted, results.data(), &returned);
  std::vector<Candidate> candidates;
  if (status != CUBLAS_STATUS_SUCCESS) return candidates;  // e.g. NOT_SUPPORTED: none fits
  for (int i = 0; i < returned; ++i) {
    const cublasLtMatmulHeuristicResult_t& result = results[size_t(i)];
    if (result.state == CUBLAS_STATUS_SUCCESS && result.workspaceSize <= workspace_limit) {
      // Launched with no workspace when it needs none: given some, cuBLASLt may pick a variant
      // of the kernel that uses it (and zeroes it first).
      candidates.push_back({result.algo, result.workspaceSize == 0 ? 0 : size_t(workspace_limit)});
    }
  }
  return candidates;
}

/// The algorithms to choose from, best first: up to `wanted` that need no workspace, then up to
/// `wanted` that need some (split-K reductions, tile counters), launched with kWorkspaceBytes.
/// Workspace-free first because a kernel that takes workspace for a tile counter has cuBLASLt
/// zero it with a memset before every launch: in a CUDA-graph replay of the packed op a memset
/// node and the gap after it cost 4 us per GEMM, and the workspace-free variant of the same
/// configuration ran as fast (bench/results/2026-11-30_9b461e3_h200_gemm_workspace_ab.txt: the
/// D = 128 step 8.6 us shorter). Throws when there is none.
std::vector<Candidate> heuristic_candidates(cublasLtHandle_t handle, const PlanKey& key,
                                            const Operation& op, int wanted) {
  std::vector<Candidate> candidates = query_heuristic(handle, key, op, wanted, 0);
  int with_workspace = 0;
  for (const Candidate& candidate : query_heuristic(handle, key, op, 2 * wanted, kWorkspaceBytes)) {
    if (with_workspace == wanted) break;
    if (candidate.workspace_bytes == 0) continue;  // the first query's kind
    const bool listed = std::any_of(candidates.begin(), candidates.end(), [&](const Candidate& c) {
      return std::memcmp(&c.algo, &candidate.algo, sizeof(candidate.algo)) == 0;
    });
    if (listed) continue;
    candidates.push_back(candidate);
    ++with_workspace;
  }
  QKVF_CHECK(!candidates.empty(), "fp8_gemm: cuBLASLt has no FP8 algorithm for M=", key.m, " N=",
             key.n, " K=", key.k, " lda=", key.lda, " ldb=", key.ldb, " ldd=", key.ldd,
             " fast_accum=", key.fast_accum, " alignment=", key.alignment,
             " bytes (the heuristic offered none, with or without workspace)");
  return candidates;
}

/// The autotuner's pick among `candidates` (best first by the heuristic). Each is launched once
/// (one cuBLASLt refuses is dropped: a refused launch enqueues nothing), then all are timed in
/// kTuneRounds interleaved rounds, kTuneLaunches launches between two events per timing, and a
/// candidate's time is its best round: interleaving keeps a clock ramp or a burst of other work
/// from favouring whichever candidate happened to run first. The fastest replaces candidates[0]
/// only when it is more than kTuneMargin faster. Every launch computes the caller's d, so the
/// call's own launch that follows overwrites it with the same kind of result.
template <typename Launch>
Candidate fastest_algorithm(const std::vector<Candidate>& candidates, const Launch& launch,
                            const Operation& op, cudaStream_t stream, const PlanKey& key) {
  struct Events {
    cudaEvent_t start = nullptr, stop = nullptr;
    ~Events() {
      if (start) cudaEventDestroy(start);
      if (stop) cudaEventDestroy(stop);
    }
  } events;
  QKVF_CUDA_CHECK(cudaEventCreate(&events.start));
  QKVF_CUDA_CHECK(cudaEventCreate(&events.stop));
  std::vector<float> best_ms(candidates.size(), -1.0f);  // -1: refused
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (launch(op, candidates[i]) == CUBLAS_STATUS_SUCCESS) best_ms[i] = 0.0f;
  }
  for (int round = 0; round < kTuneRounds; ++round) {
    for (size_t i = 0; i < candidates.size(); ++i) {
      if (best_ms[i] < 0.0f) continue;
      QKVF_CUDA_CHECK(cudaEventRecord(events.start, stream));
      bool launched = true;
      for (int r = 0; r < kTuneLaunches && launched; ++r) {
        launched = launch(op, candidates[i]) == CUBLAS_STATUS_SUCCESS;
      }
      QKVF_CUDA_CHECK(cudaEventRecord(events.stop, stream));
      QKVF_CUDA_CHECK(cudaEventSynchronize(events.stop));
      float ms = 0.0f;
      QKVF_CUDA_CHECK(cudaEventElapsedTime(&ms, events.start, events.stop));
      if (!launched) {
        best_ms[i] = -1.0f;
      } else if (best_ms[i] == 0.0f || ms < best_ms[i]) {
        best_ms[i] = ms;
      }
    }
  }
  size_t best = 0;
  for (size_t i = 1; i < candidates.size(); ++i) {
    if (best_ms[i] > 0.0f && (best_ms[best] <= 0.0f || best_ms[i] < best_ms[best])) best = i;
  }
  const bool keep_first =
      best_ms[best] <= 0.0f ||  // every candidate refused: the caller's retry path reports it
      (best_ms[0] > 0.0f && best_ms[best] > (1.0f - kTuneMargin) * best_ms[0]);
  const size_t pick = keep_first ? 0 : best;
  if (autotune_mode() == 2) {
    std::fprintf(stderr, "qkvfuse fp8_gemm autotune M=%lld N=%lld K=%lld fast_accum=%d: ms per "
                 "launch", (long long)key.m, (long long)key.n, (long long)key.k,
                 int(key.fast_accum));
    for (size_t i = 0; i < candidates.size(); ++i) {  // "w": launched with workspace
      std::fprintf(stderr, " %.4f%s", best_ms[i] / kTuneLaunches,
                   candidates[i].workspace_bytes != 0 ? "w" : "");
    }
    std::fprintf(stderr, " -> candidate %zu\n", pick);
  }
  return candidates[pick];
}

void check_scalar(const TensorView& view, const char* name) {
  QKVF_CHECK(view.dtype == DType::kFloat32 && view.numel() == 1 && view.data != nullptr,
             "fp8_gemm: ", name, " must be one float32 element, got ", view.describe());
  QKVF_CHECK(reinterpret_cast<uintptr_t>(view.data) % 4 == 0, "fp8_gemm: ", name,
             " must be 4-byte aligned");
}

}  // namespace

void fp8_gemm(const Fp8GemmParams& params) {
  const TensorView& a = params.a;
  const TensorView& b = params.b;
  const TensorView& d = params.d;
  // The public validator has checked all of this; repeating the cheap part keeps the backend safe
  // on its own (cuBLASLt's failure for a misaligned FP8 operand is an opaque INVALID_VALUE).
  QKVF_CHECK(a.ndim == 2 && b.ndim == 2 && d.ndim == 2, "fp8_gemm: a, b, d must be 2-D");
  QKVF_CHECK(a.dtype == DType::kFloat8E4M3 && b.dtype == DType::kFloat8E4M3 &&
                 d.dtype == DType::kBFloat16,
             "fp8_gemm: expected e4m3 a, b and bf16 d");
  const int64_t m = a.size(0), k = a.size(1), n = b.size(0);
  QKVF_CHECK(b.size(1) == k && d.size(0) == m && d.size(1) == n, "fp8_gemm: shapes a ",
             a.describe(), ", b ", b.describe(), ", d ", d.describe(), " do not match");
  QKVF_CHECK(m % 16 == 0 && n % 16 == 0 && k % 16 == 0,
             "fp8_gemm: cuBLASLt FP8 needs M, N, K multiples of 16, got M=", m, " N=", n, " K=", k);
  check_scalar(params.scale_a, "scale_a");
  check_scalar(params.scale_b, "scale_b");
  const bool has_alpha = !is_absent(params.alpha);
  if (has_alpha) check_scalar(params.alpha, "alpha");

  DeviceGuard guard(a.device);
  const cudaStream_t stream = to_cuda(params.stream);
  if (m == 0 || n == 0) return;
  // Size-1 dims have no meaningful stride; M, N >= 16 here, and K >= 16 below.
  const int64_t lda = a.stride(0), ldb = b.stride(0), ldd = d.stride(0);
  if (k == 0) {
    // An empty sum: d = 0 (cuBLASLt does not take K = 0).
    QKVF_CHECK(d.stride(1) == 1 && ldd >= n, "fp8_gemm: d must be row-major, got ", d.describe());
    QKVF_CUDA_CHECK(cudaMemset2DAsync(d.data, size_t(ldd) * 2, 0, size_t(n) * 2, size_t(m),
                                      stream));
    return;
  }
  QKVF_CHECK(a.stride(1) == 1 && b.stride(1) == 1 && d.stride(1) == 1,
             "fp8_gemm: last dims must be contiguous");
  QKVF_CHECK(lda >= k && ldb >= k && ldd >= n, "fp8_gemm: row strides lda=", lda, " ldb=", ldb,
             " ldd=", ldd, " smaller than the rows (K=", k, ", N=", n, ")");
  QKVF_CHECK(lda % 16 == 0 && ldb % 16 == 0 && ldd % 8 == 0,
             "fp8_gemm: cuBLASLt FP8 needs 16-byte row strides, got lda=", lda, " ldb=", ldb,
             " ldd=", ldd, " (elements)");
  for (const void* pointer : {a.data, b.data, d.data}) {
    QKVF_CHECK(reinterpret_cast<uintptr_t>(pointer) % 16 == 0,
               "fp8_gemm: cuBLASLt FP8 needs 16-byte aligned matrices");
  }

  int device = 0;
  QKVF_CUDA_CHECK(cudaGetDevice(&device));
  const cublasLtHandle_t handle = handle_for(device);
  char* const workspace = workspace_for(device, stream);
  float* const combined_slot = reinterpret_cast<float*>(workspace + kCombinedScaleOffset);
  float* const one_slot = reinterpret_cast<float*>(workspace + kOneScaleOffset);
  void* const lt_workspace = workspace + kScalarSlotBytes;

  PlanKey key{};
  key.device = device;
  key.m = m;
  key.n = n;
  key.k = k;
  key.lda = lda;
  key.ldb = ldb;
  key.ldd = ldd;
  key.fast_accum = params.fast_accum;
  key.fp32_splitk = fp32_splitk_requested();
  key.alignment = std::min({pointer_alignment(a.data), pointer_alignment(b.data),
                            pointer_alignment(d.data)});

  const float* const scale_a = static_cast<const float*>(params.scale_a.data);
  const float* const scale_b = static_cast<const float*>(params.scale_b.data);
  const float* const alpha = has_alpha ? static_cast<const float*>(params.alpha.data) : nullptr;
  const auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };

  Plan plan{};
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(g_plan_mutex);
    const auto found = g_plans.find(key);
    if (found != g_plans.end()) {
      plan = found->second;
      cached = true;
    }
  }

  // Host pointer mode: cuBLASLt copies these at the call (graph capture bakes them in).
  static const float kHostOne = 1.0f, kHostZero = 0.0f;
  bool staged = false;
  // Scale pointers for cuBLASLt's A (our b) and B (our a); stages on demand, once per call.
  const auto scale_pointers = [&](bool stage) -> std::pair<const void*, const void*> {
    if (!stage) return {scale_b, scale_a};
    if (!staged) {
      launch_fold_scales(scale_a, scale_b, alpha, combined_slot, one_slot, stream);
      staged = true;
    }
    return {one_slot, combined_slot};
  };
  const auto launch = [&](const Operation& op, const Candidate& candidate) {
    return cublasLtMatmul(handle, op.desc.get(), &kHostOne, b.data, op.a_layout.get(), a.data,
                          op.b_layout.get(), &kHostZero, d.data, op.d_layout.get(), d.data,
                          op.d_layout.get(), &candidate.algo,
                          candidate.workspace_bytes != 0 ? lt_workspace : nullptr,
                          candidate.workspace_bytes, stream);
  };

  bool stage = has_alpha || !aligned16(scale_a) || !aligned16(scale_b) || plan.stage_scales;
  auto [scale_of_b, scale_of_a] = scale_pointers(stage);
  Operation op(key, scale_of_b, scale_of_a);
  bool cacheable = true;
  if (!cached) {
    // Query (and tune) outside the lock; a racing thread computes a plan of its own, and the
    // first one stored wins (emplace), so every later call runs the same algorithm.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    QKVF_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (autotune_mode() != 0 && capture == cudaStreamCaptureStatusNone) {
      plan.pick = fastest_algorithm(heuristic_candidates(handle, key, op, kTuneAlgos), launch,
                                    op, stream, key);
    } else {
      plan.pick = heuristic_candidates(handle, key, op, 1).front();
      cacheable = capture == cudaStreamCaptureStatusNone;
    }
  }
  cublasStatus_t status = launch(op, plan.pick);
  if (status == CUBLAS_STATUS_SUCCESS) {
    if (!cached && cacheable) {
      std::lock_guard<std::mutex> lock(g_plan_mutex);
      g_plans.emplace(key, plan);
    }
    return;
  }
  const cublasStatus_t first_status = status;
  // Refused at launch although the heuristic offered the algorithm (the first H200 run's failure
  // mode). A refused launch enqueues nothing, so trying again is safe: the heuristic's next
  // algorithms, with the caller's scales and then with staged ones.
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) {
    const std::vector<bool> attempts = stage ? std::vector<bool>{true}
                                             : std::vector<bool>{false, true};
    for (const bool stage_now : attempts) {
      auto [sb, sa] = scale_pointers(stage_now);
      Operation retry(key, sb, sa);
      for (const Candidate& candidate : heuristic_candidates(handle, key, retry, kFallbackAlgos)) {
        status = launch(retry, candidate);
        if (status == CUBLAS_STATUS_SUCCESS) {
          plan.pick = candidate;
          plan.stage_scales = stage_now;
          std::lock_guard<std::mutex> lock(g_plan_mutex);
          g_plans[key] = plan;
          return;
        }
        if (status != CUBLAS_STATUS_NOT_SUPPORTED) break;
      }
      if (status != CUBLAS_STATUS_NOT_SUPPORTED) break;
    }
  }
  QKVF_CHECK(false, "cuBLASLt: cublasLtMatmul failed: ", cublasLtGetStatusName(first_status), " (",
             cublasLtGetStatusString(first_status), "); retries: ",
             cublasLtGetStatusName(status), " for M=", m, " N=", n, " K=", k, " lda=", lda,
             " ldb=", ldb, " ldd=", ldd, " fast_accum=", params.fast_accum, " alpha=", has_alpha,
             " alignment a/b/d=", pointer_alignment(a.data), "/", pointer_alignment(b.data), "/",
             pointer_alignment(d.data), " scale_a/scale_b alignment=", pointer_alignment(scale_a),
             "/", pointer_alignment(scale_b), " staged scales=", staged);
}

}  // namespace qkvfuse::cuda
