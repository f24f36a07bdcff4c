// validate.hpp: the argument checks every public entry point runs before it touches memory.
// Internal.
//
// Each public op builds a Checker named after itself and checks dtype, device, shape, strides,
// alignment and overlap of every argument; a failure throws qkvfuse::Error whose message reads
//   "<op>: <argument>: expected <what>, got <what it got>"
// so the caller learns which argument is wrong and why. The backends then assume valid inputs
// (backend.hpp).
//
// Alignment on CUDA: a kernel reads a row of a tensor (its last dimension) with the widest
// vectors that tile it, up to 16 bytes. So a CUDA tensor's data pointer and every stride but the
// last must be multiples of the row's vector width: the largest power of two <= 16 that divides
// the row's byte width (16 for a 128-wide bf16 row, 4 for a 34-wide one). The CPU backend needs
// only natural element alignment.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "qkvfuse/fp8_gemm.hpp"
#include "qkvfuse/qk_norm_rope.hpp"
#include "qkvfuse/qkv_backward_fp8.hpp"
#include "qkvfuse/tensor.hpp"

namespace qkvfuse::validate {

/// A tensor argument and the name messages call it by.
/// An absent optional argument (is_absent) is skipped by the checks that take lists.
struct Arg {
  const TensorView& view;
  const char* name;
  bool optional = false;
};

/// One dimension of an expected shape: a fixed size, or any size, printed as its label ("T").
struct Dim {
  Dim(int64_t fixed) : size(fixed) {}  // NOLINT: implicit, so shapes read {Dim::any("T"), 12, 128}
  static Dim any(const char* label) {
    Dim dim(-1);
    dim.label = label;
    return dim;
  }
  int64_t size;
  const char* label = nullptr;
};

/// `first` followed by `second` (Arg holds a reference, so vectors of it grow by push_back only).
std::vector<Arg> concat(const std::vector<Arg>& first, const std::vector<Arg>& second);

/// The shapes of a rope call (SPEC.md sections 1 and 8), derived from qk and the layout.
struct RopeShape {
  int64_t tokens;       ///< T
  int64_t q_heads;      ///< Hq
  int64_t kv_heads;     ///< Hkv
  int64_t head_dim;     ///< D
  int64_t rotary_dim;   ///< r, resolved
  int64_t out_tokens;   ///< T, or 2T when paired
  int64_t q_out_heads;  ///< Hq, or Hq/2 when paired
  int64_t k_out_heads;  ///< Hkv, or Hkv/2 when paired
};

/// The widest head the rope ops take (D), on both backends; the CUDA kernels' widest tested one
/// (section 9's wider heads run only with the switch below).
inline constexpr int64_t kMaxHeadDim = 512;
inline constexpr int64_t kMaxCudaTestedHeadDim = 256;

/// QKVFUSE_CUDA_SECTION9=1 in the environment (read once per process, here and nowhere else):
/// the CUDA backend takes SPEC.md section 9's options (D up to 512, normalize_v, norm_scope
/// kToken, query_only, no angle source) on kernels that have not yet run on a GPU. Off by
/// default: they are refused by name (cuda_pending_option).
bool cuda_section9_enabled();
/// Tests only: sets the switch for the rest of the process (overriding the environment), so that
/// one test process can check both the refusals and the kernels.
void set_cuda_section9_for_testing(bool enabled);

/// The first layout option (SPEC.md section 9) the CUDA backend does not take yet, as the error
/// names it: the argument, then what of it where that is not the argument itself
/// ("layout.normalize_v", "layout.norm_scope: NormScope::kToken (...)"); empty when there is none.
/// With cuda_section9_enabled() the options whose kernels exist are not pending. A head width past kMaxHeadDim is no pending option: no
/// backend takes it.
std::string cuda_pending_option(const RopeLayout& layout, int64_t head_dim);

/// The checks of one op; every message starts with the op's name.
class Checker {
 public:
  explicit Checker(std::string op) : op_(std::move(op)) {}
  const std::string& op() const { return op_; }

  /// Every required argument is present, and all present ones (absent optional ones are
  /// skipped) live on one device, which is returned. Non-empty tensors must have data; on CUDA
  /// the runtime confirms each pointer is memory of that device (a clear error, not a crash, for
  /// host pointers or a CPU-only build). An empty call (no arguments) runs on the CPU.
  Device same_device(const std::vector<Arg>& args) const;

  void dtype(const TensorView& view, const char* name, DType expected) const;
  void dtype_in(const TensorView& view, const char* name,
                std::initializer_list<DType> allowed) const;
  /// Exact shape; `why` explains derived sizes, e.g. "(2*num_heads = 12 heads)".
  void shape(const TensorView& view, const char* name, std::initializer_list<Dim> expected,
             const std::string& why = {}) const;
  void ndim(const TensorView& view, const char* name, int expected) const;
  void last_dim_contiguous(const TensorView& view, const char* name) const;
  /// Row-major with no padding.
  void contiguous(const TensorView& view, const char* name) const;
  /// A 2-D row-major matrix: last dim contiguous, rows not overlapping (row stride >= columns).
  void row_major(const TensorView& view, const char* name) const;
  /// A float32 scalar: shape [] or [1].
  void scalar_f32(const TensorView& view, const char* name) const;
  /// The data pointer is a multiple of the element size (what any kernel needs).
  void element_aligned(const TensorView& view, const char* name) const;
  /// Natural element alignment everywhere; on CUDA the row-vector alignment described above.
  void aligned(const TensorView& view, const char* name, Device device) const;
  /// No output shares a byte with another output or with any input.
  void no_overlap(const std::vector<Arg>& outputs, const std::vector<Arg>& inputs) const;

  /// The layout's scalar options against D (qk's last dim), on every device: Hq >= 1,
  /// Hq % Hkv == 0, D even in [2, kMaxHeadDim], r even in [0, D], paired / key_offset only with
  /// Hq = Hkv (paired: Hq even, factor tables; not both), a known rotary style and norm scope,
  /// eps > 0 and finite, a finite weight offset, weights only with normalize, at most one angle
  /// source (none: rotary_dim -1 or 0), and the refusals of SPEC.md section 9 (query_only with
  /// paired, key_offset, k_weight, normalize_v or num_kv_heads; normalize_v with kToken).
  void rope_options(const RopeLayout& layout, int64_t head_dim) const;

  /// On CUDA tensors (qk's device), refuses an option the CUDA kernels do not take yet, naming
  /// it (cuda_pending_option). Reads only qk's device and shape, no memory: every rope op runs it
  /// first, so the refusal is the same in a build without CUDA.
  void not_pending_on_cuda(const RopeLayout& layout, const TensorView& qk) const;

 private:
  std::string op_;
};

/// The inputs shared by the rope ops: qk [T, Hq + Hkv, D] (bfloat16; float32 and float64 too on
/// the CPU when `wide_qk_on_cpu`), last dim contiguous; the layout's options (rope_options) and
/// tensors: factor tables [T, D or 2D] or cos_sin [P, r] + positions [T], weights [D]. Float
/// tables and weights are bfloat16 or float32 (or qk's own dtype on the CPU). Pointers need only
/// their elements' alignment, strides are free: the CUDA backend picks its access width from
/// them (src/cuda/rope_paths.hpp). Returns the shapes.
RopeShape rope_inputs(const Checker& check, const TensorView& qk, const RopeLayout& layout,
                      Device device, bool wide_qk_on_cpu);

/// Elements of the query (key: false) or key weight: D, or H*D of the kind under kToken.
int64_t weight_width(const RopeLayout& layout, const RopeShape& shape, bool key);
/// The weight's shape for messages, in parentheses with `also` after it: "([D])" or
/// "(layout.norm_scope = NormScope::kToken: [layout.num_heads * D])".
std::string weight_shape_why(const RopeLayout& layout, bool key, const char* also = "");

/// A V input of the V norm (v, or the backward's grad_v_out): present exactly when
/// layout.normalize_v; `dtype`, [T, Hkv, Dv] with Dv >= 1 (on CUDA at most cuda::kMaxVWidth: its
/// rows take the kernels' row geometry, 512 wide at most), last dim contiguous. Returns Dv (0
/// without the V norm).
int64_t rope_v_input(const Checker& check, const RopeLayout& layout, Arg v,
                     const RopeShape& shape, DType dtype, Device device);
/// A V tensor of v's shape [T, Hkv, v_dim] present exactly when layout.normalize_v: the
/// outputs v_out, grad_v (`contiguous`) or the backward's grad_v_out (last dim contiguous).
void rope_v_output(const Checker& check, const RopeLayout& layout, Arg out, const RopeShape& shape,
                   int64_t v_dim, DType dtype, bool contiguous);

/// The layout's tensors as optional arguments, for same_device and no_overlap.
std::vector<Arg> rope_tensor_args(const RopeLayout& layout);

/// A pair in the forward's output layout ([T, Hq, D] and [T, Hkv, D], or [2T, H/2, D] when
/// paired) of `dtype`: the outputs q, k (`contiguous`) or the gradients grad_q, grad_k (last
/// dim contiguous only).
void rope_output_pair(const Checker& check, Arg q, Arg k, const RopeShape& shape, DType dtype,
                      bool contiguous);

/// The backward's weight gradients (each present exactly when its weight is: [D], the weight's
/// dtype, contiguous) and the workspace (float32, contiguous, at least `workspace_size`
/// elements; may be absent when that is 0).
void rope_weight_grads(const Checker& check, const RopeLayout& layout, const RopeShape& shape,
                       Arg grad_q_weight, Arg grad_k_weight, Arg workspace,
                       int64_t workspace_size);

/// QKVFUSE_CHECK_POSITIONS=1 in the environment: every call with a cos/sin cache runs
/// check_positions before its kernels (it synchronizes).
void check_positions_if_asked(const RopeLayout& layout, Stream stream);

// Whole-op validators, defined next to each entry point (src/<op>.cpp). packed_qkv.cpp runs them
// on every step before launching any, so a bad argument never leaves half-written outputs. Each
// returns the device the op runs on; `op` prefixes the messages.
Device validate_qk_norm_rope(const QkNormRopeParams& params, const std::string& op);
Device validate_qkv_backward_fp8(const QkvBackwardFp8Params& params, const std::string& op);
Device validate_fp8_gemm(const Fp8GemmParams& params, const std::string& op);

/// Byte range [first, last) a view spans (empty for numel() == 0): the overlap test's unit.
struct ByteRange {
  uintptr_t first = 0;
  uintptr_t last = 0;
};
ByteRange byte_range(const TensorView& view);
/// False only when the two views provably share no byte (see validate.cpp for the test).
bool may_overlap(const TensorView& a, const TensorView& b);

}  // namespace qkvfuse::validate
