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
// Pointer mode. FP8 matmuls accept CUBLASLT_POINTER_MODE_DEVICE (TransformerEngine runs its
// grouped FP8 GEMMs and TensorRT-LLM its FP8 GEMMs that way), so alpha is read from device memory:
// the caller's alpha tensor when given, else a per-device 1.0f; beta points at a per-device 0.0f
// (cublaslt_scalars.cu). Device mode always, whether or not alpha is given, means one descriptor
// configuration, one cached heuristic per shape, no host read of any scale (no sync, graph-safe).
// Fallback, should a cuBLASLt build refuse device mode for a shape (its heuristic returns an error
// or no algorithm): host mode with alpha = 1, beta = 0, and the caller's alpha folded into a's
// scale by a one-thread kernel writing a scalar slot at the head of the per-device workspace
// (same stream, so it is ordered before the GEMM). Which mode a shape got is cached with it.
//
// Resources. One cuBLASLt handle and one 32 MiB workspace per device (what TransformerEngine
// uses on Hopper), created on first use on that device (indexed by the tensors' device, never
// assuming device 0) and kept for the life of the process: destroying them from a static
// destructor would race the CUDA runtime's own teardown at exit. The workspace is shared by all
// streams of the device: GEMMs issued concurrently on different streams of one device must not
// overlap in time (the library's ops run on the one stream they are given). The heuristic result
// is cached per (device, M, N, K, lda, ldb, ldd, fast_accum, pointer alignment). Split-K
// algorithms are restricted to fp32 partial sums (see query_heuristic), so the result is rounded
// to bf16 exactly once (reruns are checked bit for bit by tests/test_cuda_fp8_gemm.cpp).
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <unordered_map>

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

constexpr size_t kWorkspaceBytes = size_t(32) << 20;
// The head of the workspace allocation holds the folded-alpha scalar of the host-mode fallback;
// cuBLASLt gets the rest, which keeps its 256-byte alignment.
constexpr size_t kScalarSlotBytes = 256;
constexpr int kMaxDevices = 64;

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

// ---- per-device handle and workspace ------------------------------------------------------------

struct DeviceContext {
  cublasLtHandle_t handle = nullptr;
  char* workspace = nullptr;  ///< kScalarSlotBytes scalar slot, then cuBLASLt's workspace
};

/// Allocates with the calling thread's stream-capture mode relaxed: a first GEMM on a device may
/// happen while some stream of the process is being captured into a CUDA graph, and in the
/// default (global) capture mode cudaMalloc is refused then. The allocation is not a stream
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

/// The device's context, created on first use. The caller has made `device` current.
const DeviceContext& context_for(int device) {
  QKVF_CHECK(device >= 0 && device < kMaxDevices, "fp8_gemm: device ordinal ", device,
             " beyond the supported ", kMaxDevices);
  static std::array<std::once_flag, kMaxDevices> once;
  static std::array<DeviceContext, kMaxDevices> contexts;
  // call_once publishes the context to every thread that passes it; if creation throws, the
  // flag stays unset and the next call retries.
  std::call_once(once[device], [device] {
    DeviceContext context;
    QKVF_CUBLASLT_CHECK(cublasLtCreate(&context.handle), "cublasLtCreate");
    try {
      context.workspace = static_cast<char*>(capture_safe_malloc(kWorkspaceBytes));
    } catch (...) {
      cublasLtDestroy(context.handle);
      throw;
    }
    contexts[device] = context;
  });
  return contexts[device];
}

// ---- heuristic cache ---------------------------------------------------------------------------

struct PlanKey {
  int device;
  int64_t m, n, k;  // in the row-major (caller's) naming
  int64_t lda, ldb, ldd;
  bool fast_accum;
  int alignment;  // bytes: the smallest power-of-two alignment of a, b and d (capped at 256)

  bool operator==(const PlanKey& other) const {
    return device == other.device && m == other.m && n == other.n && k == other.k &&
           lda == other.lda && ldb == other.ldb && ldd == other.ldd &&
           fast_accum == other.fast_accum && alignment == other.alignment;
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
    mix(int64_t(key.fast_accum) | (int64_t(key.alignment) << 1));
    return hash;
  }
};

struct Plan {
  cublasLtMatmulAlgo_t algo;
  bool device_pointer_mode;  ///< false: the host-mode fallback with alpha folded into a scale
};

std::mutex g_plan_mutex;
std::unordered_map<PlanKey, Plan, PlanKeyHash> g_plans;

int pointer_alignment(const void* pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  int alignment = 256;
  while (alignment > 1 && address % uintptr_t(alignment) != 0) alignment /= 2;
  return alignment;
}

/// Everything of one cublasLtMatmul call except the algorithm.
struct Operation {
  MatmulDesc desc;
  MatrixLayout a_layout;  // cuBLASLt's A: our b
  MatrixLayout b_layout;  // cuBLASLt's B: our a
  MatrixLayout d_layout;  // C and D: our d

  Operation(const PlanKey& key, bool device_pointer_mode, const void* scale_of_b,
            const void* scale_of_a)
      : a_layout(CUDA_R_8F_E4M3, uint64_t(key.k), uint64_t(key.n), key.ldb),
        b_layout(CUDA_R_8F_E4M3, uint64_t(key.k), uint64_t(key.m), key.lda),
        d_layout(CUDA_R_16BF, uint64_t(key.n), uint64_t(key.m), key.ldd) {
    const int32_t transa = CUBLAS_OP_T;
    const int32_t transb = CUBLAS_OP_N;
    desc.set(CUBLASLT_MATMUL_DESC_TRANSA, transa, "set TRANSA");
    desc.set(CUBLASLT_MATMUL_DESC_TRANSB, transb, "set TRANSB");
    const int32_t pointer_mode =
        device_pointer_mode ? CUBLASLT_POINTER_MODE_DEVICE : CUBLASLT_POINTER_MODE_HOST;
    desc.set(CUBLASLT_MATMUL_DESC_POINTER_MODE, pointer_mode, "set POINTER_MODE");
    // Always set explicitly: the default (0, off) is cuBLASLt's choice today, not a contract.
    const int8_t fast_accum = key.fast_accum ? 1 : 0;
    desc.set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast_accum, "set FAST_ACCUM");
    desc.set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, scale_of_b, "set A_SCALE_POINTER");
    desc.set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, scale_of_a, "set B_SCALE_POINTER");
  }
};

/// Asks cuBLASLt's heuristic for the best algorithm: CUBLAS_STATUS_SUCCESS with *algo set, or the
/// reason there is none (NOT_SUPPORTED when the heuristic returned no algorithm).
cublasStatus_t query_heuristic(const DeviceContext& context, const PlanKey& key,
                               bool device_pointer_mode, const void* scale_of_b,
                               const void* scale_of_a, cublasLtMatmulAlgo_t* algo) {
  Operation op(key, device_pointer_mode, scale_of_b, scale_of_a);
  MatmulPreference preference;
  const uint64_t workspace_bytes = kWorkspaceBytes - kScalarSlotBytes;
  preference.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace_bytes, "set MAX_WORKSPACE");
  // Split-K partial sums only in fp32: the INPLACE and OUTPUT_TYPE schemes reduce through the bf16
  // output type, which would round the result more than once (the contract is one rounding).
  // Unsplit algorithms have no reduction and are not filtered by the mask.
  const uint32_t reduction_mask = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  preference.set(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, reduction_mask,
                 "set REDUCTION_SCHEME_MASK");
  const uint32_t alignment = uint32_t(key.alignment);
  preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignment, "set MIN_ALIGNMENT_A");
  preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignment, "set MIN_ALIGNMENT_B");
  preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignment, "set MIN_ALIGNMENT_C");
  preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignment, "set MIN_ALIGNMENT_D");

  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      context.handle, op.desc.get(), op.a_layout.get(), op.b_layout.get(), op.d_layout.get(),
      op.d_layout.get(), preference.get(), 1, &result, &returned);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  if (returned == 0) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (result.state != CUBLAS_STATUS_SUCCESS) return result.state;
  *algo = result.algo;
  return CUBLAS_STATUS_SUCCESS;
}

Plan find_plan(const DeviceContext& context, const PlanKey& key, const void* scale_of_b,
               const void* scale_of_a) {
  {
    std::lock_guard<std::mutex> lock(g_plan_mutex);
    const auto found = g_plans.find(key);
    if (found != g_plans.end()) return found->second;
  }
  // Query outside the lock (it takes tens of microseconds); a racing thread computes the same
  // plan and the first insertion wins.
  // Device pointer mode first; any refusal there (no algorithm, or a mode this cuBLASLt does not
  // take for FP8) falls back to host mode with alpha folded into a scale.
  Plan plan{};
  plan.device_pointer_mode = true;
  const cublasStatus_t device_status =
      query_heuristic(context, key, true, scale_of_b, scale_of_a, &plan.algo);
  if (device_status != CUBLAS_STATUS_SUCCESS) {
    plan.device_pointer_mode = false;
    const cublasStatus_t host_status =
        query_heuristic(context, key, false, scale_of_b, scale_of_a, &plan.algo);
    QKVF_CHECK(host_status == CUBLAS_STATUS_SUCCESS,
               "fp8_gemm: cuBLASLt has no FP8 algorithm for M=", key.m, " N=", key.n, " K=",
               key.k, " lda=", key.lda, " ldb=", key.ldb, " ldd=", key.ldd,
               " fast_accum=", key.fast_accum, " alignment=", key.alignment,
               " bytes (heuristic: device pointer mode ", cublasLtGetStatusName(device_status),
               ", host pointer mode ", cublasLtGetStatusName(host_status), ")");
  }
  std::lock_guard<std::mutex> lock(g_plan_mutex);
  return g_plans.emplace(key, plan).first->second;
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
  const DeviceContext& context = context_for(device);
  const float* one_zero = device_one_zero();

  PlanKey key{};
  key.device = device;
  key.m = m;
  key.n = n;
  key.k = k;
  key.lda = lda;
  key.ldb = ldb;
  key.ldd = ldd;
  key.fast_accum = params.fast_accum;
  key.alignment = std::min({pointer_alignment(a.data), pointer_alignment(b.data),
                            pointer_alignment(d.data)});

  const void* scale_of_a = params.scale_a.data;
  const void* scale_of_b = params.scale_b.data;
  const Plan plan = find_plan(context, key, scale_of_b, scale_of_a);

  const void* alpha = nullptr;
  const void* beta = nullptr;
  static const float kHostOne = 1.0f, kHostZero = 0.0f;
  if (plan.device_pointer_mode) {
    alpha = has_alpha ? params.alpha.data : static_cast<const void*>(one_zero);
    beta = one_zero + 1;
  } else {
    alpha = &kHostOne;
    beta = &kHostZero;
    if (has_alpha) {
      // Fallback: fold alpha into a's scale in the scalar slot (stream-ordered before the GEMM).
      float* folded = reinterpret_cast<float*>(context.workspace);
      launch_multiply_scalars(static_cast<const float*>(params.scale_a.data),
                              static_cast<const float*>(params.alpha.data), folded, stream);
      scale_of_a = folded;
    }
  }

  Operation op(key, plan.device_pointer_mode, scale_of_b, scale_of_a);
  QKVF_CUBLASLT_CHECK(
      cublasLtMatmul(context.handle, op.desc.get(), alpha, b.data, op.a_layout.get(), a.data,
                     op.b_layout.get(), beta, d.data, op.d_layout.get(), d.data,
                     op.d_layout.get(), &plan.algo, context.workspace + kScalarSlotBytes,
                     kWorkspaceBytes - kScalarSlotBytes, stream),
      "cublasLtMatmul");
}

}  // namespace qkvfuse::cuda
