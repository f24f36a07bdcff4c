// fuzz.hpp: the pieces of the qkvfuse_fuzz harness (see fuzz_main.cpp for what it checks).
//
//   fuzz_case.cpp    draws a random case (op, layout options, shapes, strides, scales, special
//                    values) from the seed and the case number alone, and builds its inputs
//   fuzz_run.cpp     runs one case through the public API on a Memory (CPU views, or device
//                    copies on a CUDA stream) and reads back its outputs
//   fuzz_gpu.cpp     the CUDA Memory (built only with the CUDA backend; fuzz_no_gpu.cpp else)
//   fuzz_main.cpp    the driver: CPU backend vs the float64 model (--cpu-only), or the CUDA
//                    backend vs the CPU backend
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "qkvfuse/qkvfuse.hpp"

namespace qkvfuse::fuzz {

// ---- options and cases ---------------------------------------------------------------------------

struct Options {
  uint64_t seed = 0;
  int64_t cases = 1000;
  int64_t only_case = -1;  ///< --case K: run case K of the seed alone
  bool cpu_only = false;
  int64_t max_tokens = 100000;
  /// QKVFUSE_CUDA_SECTION9=1 (validate::cuda_section9_enabled): GPU mode's cases inside the CUDA
  /// rules draw SPEC.md section 9's options too (D up to 512, the token-wide norm, the V norm,
  /// query-only calls, no angles), which the CUDA backend then takes.
  bool section9 = false;
};

enum class Op : int {
  kRopeForward,      ///< qk_norm_rope
  kRopeBackward,     ///< qk_norm_rope_backward
  kQkvBackwardFp8,   ///< qkv_backward_fp8
  kQuantize,         ///< quantize_dual_layout [M, N], with or without amax
  kQuantizeBatched,  ///< quantize_dual_layout [B, M, N], one scale per entry
  kWeightBank,       ///< quantize_weight_bank [B, M, N]
  kPacked,           ///< packed_qkv_forward, then packed_qkv_backward on inputs of its own
};
inline constexpr int kOpCount = 7;
const char* op_name(Op op);
/// The ops that take a RopeLayout: the three rope ops and the packed op.
bool is_rope_op(Op op);

/// Kinds of special values a case may plant in its inputs.
enum Special : unsigned {
  kNaN = 1u << 0,
  kInf = 1u << 1,
  kHuge = 1u << 2,      ///< far beyond e4m3's 448 (bounded so fp32 sums cannot overflow in rope rows)
  kZeroRows = 1u << 3,  ///< whole rows (and, rarely, a whole tensor) of zeros
  kTiny = 1u << 4,      ///< bf16 subnormals and tiny normals
  kFactors = 1u << 5,   ///< the angles (tables or cos/sin cache) and norm weights get them too
};

/// Where a tensor lies in its buffer: sizes, strides (elements) and the element offset of its
/// first element (a column slice of a wider buffer starts at an offset).
struct Placement {
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t offset = 0;

  int64_t numel() const;
  /// Elements from the buffer's start to one past the view's last element.
  int64_t buffer_elements() const;
  std::string describe() const;
};

struct Case {
  uint64_t seed = 0;
  int64_t index = 0;
  bool cpu_only = false;
  bool section9 = false;  ///< Options::section9
  Op op = Op::kRopeForward;

  // rope ops (forward, backward, fp8 backward) and the packed op: SPEC.md sections 1 and 8
  int64_t tokens = 0;
  int64_t heads = 1;              ///< Hq
  int64_t kv_heads = 1;           ///< Hkv (Hq % Hkv == 0)
  bool kv_heads_zero = false;     ///< the layout says num_kv_heads = 0 (Hkv = Hq)
  int64_t head_dim = 0;
  int64_t v_dim = 0;              ///< fp8 backward and packed op
  bool neox = false;
  bool paired = false;
  bool key_offset = false;
  int64_t rotary_dim = 0;         ///< r, resolved: lanes [0, r) rotate, the rest pass through
  bool rotary_default = false;    ///< the layout says rotary_dim = -1 (D, or the cache's width)
  int64_t table_rotary = 0;       ///< tables: lanes of [0, r) that rotate (the rest (1, 0));
                                  ///< lanes >= r hold junk the op must not read
  bool normalize = true;
  float eps = kRmsNormEps;
  float weight_offset = 0.0f;
  bool q_weight = false;
  bool k_weight = false;
  DType weight_dtype = DType::kBFloat16;
  bool cache = false;             ///< cos_sin + positions instead of factor tables
  DType factor_dtype = DType::kBFloat16;  ///< the tables' or the cache's dtype
  DType position_dtype = DType::kInt64;
  int64_t cache_rows = 0;         ///< P
  bool packed_positions = false;  ///< documents restarting at position 0 (else random in [0, P))
  int64_t bad_positions = 0;      ///< tokens whose position lies outside [0, P) (NaN rotary lanes)
  // SPEC.md section 9, drawn in CPU-only cases and in GPU cases outside the CUDA rules (which
  // the CUDA backend refuses by name unless QKVFUSE_CUDA_SECTION9=1), and with that switch in
  // every GPU case; D up to 512 there too.
  bool token_norm = false;
  bool query_only = false;   ///< no key heads: kv_heads is 0
  bool normalize_v = false;  ///< the V norm: v [T, Hkv, Dv] (placement v_in); Dv drawn for every op
  bool angles = true;        ///< false: no angle source, nothing rotates (r = 0)
  /// `v`: grad_v (the gradient of the V the forward returns); `v_in`: the V norm's input v;
  /// `weight` the query weight's, `weight_k` the key weight's ([D], or [H*D] under token_norm).
  Placement qk, factor, grad_q, grad_k, v, v_in, cos_sin, positions, weight, weight_k;
  /// Elements between an output's aligned allocation and its first element (q, k, grad_qk,
  /// grad_row, grad_t): 0, or an offset that leaves a bf16 / e4m3 output off the 16 bytes.
  int64_t out_offset = 0;

  // packed op (its backward takes its own random qk, grad_q, grad_k, grad_v)
  int64_t channels = 0;              ///< C
  bool joined_qkv = true;            ///< qk and v column slices of one [T, qkv_dim] output
  bool joined_weight_grads = true;   ///< grad_qk_weight and grad_v_weight rows of one buffer
  float x_scale = 0, weight_scale = 0, qkv_scale = 0;

  // quantize ops
  int64_t batch = 0;  ///< 0: plain [M, N]
  int64_t rows = 0;
  int64_t cols = 0;
  bool with_amax = false;
  Placement src;

  // the fp8 backward's grad_scale, or the quantize scale(s) (one per batch entry)
  std::vector<float> scales;
  int scale_ndim = 0;  ///< plain scalars: shape [] (0) or [1] (1)

  unsigned specials = 0;
  /// Empty when the case lies inside the documented CUDA domain (rope ops: Dv <= 512;
  /// quantize: 16-byte vector alignment); otherwise why not: the CUDA backend must then either
  /// refuse it with qkvfuse::Error or compute it correctly.
  std::string outside_cuda;
  /// Rope ops: whether the arguments meet the CUDA 16-byte vector kernels' rule as
  /// qk_norm_rope.hpp states it (D a multiple of 8 in [32, 256], NeoX r a multiple of 16, a
  /// cache with interleaved lanes r a multiple of 8; qkv_backward_fp8: Dv a multiple of 8 up to
  /// 256; every pointer and every stride but the last a multiple of 16 bytes); if not, narrower
  /// accesses compute the case. For the log: the comparisons are the same.
  bool vector_path = false;

  int64_t input_heads() const { return heads + kv_heads; }
  int64_t out_tokens() const { return paired ? 2 * tokens : tokens; }
  int64_t q_out_heads() const { return paired ? heads / 2 : heads; }
  int64_t k_out_heads() const { return paired ? kv_heads / 2 : kv_heads; }
  int64_t factor_width() const { return paired ? 2 * head_dim : head_dim; }
  int64_t qk_features() const { return input_heads() * head_dim; }
  int64_t qkv_dim() const { return qk_features() + kv_heads * v_dim; }
  /// Elements of the query (key: false) or key weight: D, or H*D of the kind under token_norm.
  int64_t weight_width(bool key) const {
    return token_norm ? (key ? kv_heads : heads) * head_dim : head_dim;
  }
  /// Whether the case takes an option of SPEC.md section 9 (CUDA refuses those unless
  /// QKVFUSE_CUDA_SECTION9=1).
  bool families_option() const {
    return token_norm || query_only || normalize_v || !angles || head_dim > 256;
  }
  /// The layout's options; run_case adds its tensors.
  RopeLayout layout() const;
  /// Everything needed to understand and replay the case (with the seed and its number).
  std::string describe() const;
};

/// Case `index` of `options.seed`, a function of (seed, index, cpu_only, max_tokens) only.
Case draw_case(const Options& options, int64_t index);

// ---- host buffers ---------------------------------------------------------------------------------

/// The poison bytes outputs are filled with before a run: values no computation produces.
inline constexpr uint16_t kPoisonBF16 = 0x7fc1;  // a NaN payload no arithmetic makes
inline constexpr uint8_t kPoisonE4M3 = 0xff;     // negative NaN: every NaN result is 0x7f
inline constexpr float kPoisonF32 = -1234.5f;    // not bf16: never an amax nor amax / 448

/// A host tensor in a buffer of its own, placed as `placement` says. Buffer elements outside the
/// view hold the poison, so a read of padding shows up as NaN.
class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(DType dtype, Placement placement);

  DType dtype() const { return dtype_; }
  const Placement& placement() const { return placement_; }
  const std::vector<uint8_t>& bytes() const { return bytes_; }
  bool empty() const { return placement_.sizes.empty() && bytes_.empty(); }
  /// A CPU view of the tensor.
  TensorView view() const;

  /// Dense row-major values: bf16 bits for bf16 tensors, floats for float32 ones, integers for
  /// int32 / int64 ones, codes for e4m3 ones.
  void set_bf16(const std::vector<uint16_t>& dense);
  void set_f32(const std::vector<float>& dense);
  void set_ints(const std::vector<int64_t>& dense);
  void set_codes(const std::vector<uint8_t>& dense);
  std::vector<uint16_t> get_bf16() const;
  std::vector<float> get_f32() const;
  std::vector<int64_t> get_ints() const;
  std::vector<uint8_t> get_codes() const;
  /// Dense values as doubles (bf16 and float32 tensors).
  std::vector<double> get_values() const;

 private:
  DType dtype_ = DType::kBFloat16;
  Placement placement_;
  mutable std::vector<uint8_t> bytes_;  // mutable: views handed to the CPU backend are non-const
};

/// The inputs of one case; tensors the op does not take are empty. `scale` is grad_scale for the
/// rope and packed ops, the quantize scale(s) otherwise.
struct Inputs {
  HostBuffer qk, factor1, factor2, cos_sin, positions, q_weight, k_weight;
  HostBuffer v;  ///< the V norm's input (Case::normalize_v)
  HostBuffer grad_q, grad_k, grad_v, src, scale;
  // packed op
  HostBuffer x_f8, x_f8_t, weight_f8, weight_f8_t, qk_weight, v_weight;
  HostBuffer x_scale, weight_scale, qkv_scale;
};

Inputs make_inputs(const Case& c);

// ---- running ---------------------------------------------------------------------------------------

/// Where a run's tensors live: the CPU (views of the host buffers, outputs in host memory) or a
/// CUDA device (copies on the device, the op launched on a stream of its own).
class Memory {
 public:
  virtual ~Memory() = default;
  virtual Device device() const = 0;
  virtual Stream stream() const = 0;
  /// The input on this memory, with the same strides (and, on CUDA, the same pointer alignment
  /// modulo 16 bytes as the host view has within its buffer).
  virtual TensorView input(const HostBuffer& host) = 0;
  /// A contiguous output, every byte the dtype's poison, between guard bytes; its first element
  /// lies `offset` elements past a 16-byte aligned address.
  virtual TensorView output(const std::string& name, DType dtype, std::vector<int64_t> sizes,
                            int64_t offset = 0) = 0;
  /// Waits for the launched work (throws on a CUDA error).
  virtual void finish() = 0;
  /// The bytes of an output made by output().
  virtual std::vector<uint8_t> read(const TensorView& view) = 0;
  /// Names of outputs whose guard bytes were overwritten (writes out of bounds); empty if none.
  virtual std::string damaged_guards() = 0;
};

std::unique_ptr<Memory> make_cpu_memory();

/// Empty when a CUDA device the kernels run on is present, otherwise why not.
std::string gpu_unavailable_reason();
/// A Memory on CUDA device 0: fresh buffers per case, one stream for the whole run; `seed` picks
/// the buffers' alignments.
std::unique_ptr<Memory> make_gpu_memory(uint64_t seed);
/// Empty while the CUDA context is healthy (no sticky error, the stream completes), else the error.
std::string gpu_error_state();
/// "NVIDIA H200 (sm_90, 132 SMs)" for the log.
std::string gpu_name();

/// One named output's bytes.
struct Output {
  std::string name;
  DType dtype;
  std::vector<int64_t> sizes;
  std::vector<uint8_t> bytes;
};

/// Runs the case's op on `memory` through the public API and returns its outputs. Throws
/// qkvfuse::Error when the op refuses the arguments.
std::vector<Output> run_case(const Case& c, const Inputs& in, Memory& memory);

const Output& find_output(const std::vector<Output>& outputs, const std::string& name);

}  // namespace qkvfuse::fuzz
