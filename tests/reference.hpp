// reference.hpp: an independent float64 model of SPEC.md, the comparisons that judge a backend
// against it (and the GPU backend against the CPU's), and the host tensors and inputs the CPU tests
// share.
//
// The model (namespace ref) shares no code with src/ and does not use numeric.hpp: it restates
// the spec with nested loops over dense std::vector<double> arrays and its own rounding
// functions (a value is rounded by scaling it to an integer count of its quantum, which is exact
// in double). Where the spec prescribes a float32 operation (the division by a scale), the model
// performs exactly that float32 operation. Its rotary works on lane pairs as 2x2 rotations (the
// pairs enumerated per style), not on src/rope_math.hpp's per-lane partner, frequency and sign
// rules. Only test inputs (test_util.hpp's random values and rotary tables) are made with
// numeric.hpp (and compare_bf16_gpu_cpu, which holds two backends' outputs against each other and
// not against the model, decodes with it); the test helpers below read the public RopeLayout only
// to fill it.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "qkvfuse/qk_norm_rope.hpp"
#include "qkvfuse/tensor.hpp"

namespace qkvfuse::ref {

// ---- rounding and encodings --------------------------------------------------------------------

/// x rounded to the nearest bf16 (8 significant bits, ties to even); NaN stays NaN, overflow
/// past the largest bf16 gives infinity.
double round_bf16(double x);
/// The bits of a bf16-representable value (the result of round_bf16; NaN gives a quiet NaN).
uint16_t bf16_bits(double representable);
/// The value of bf16 bits.
double bf16_value(uint16_t bits);

/// The value of an e4m3 (float8_e4m3fn) code, from the format's definition: exponent field 0
/// is subnormal (m * 2^-9), 0x7f/0xff are NaN, else (1 + m/8) * 2^(e - 7).
double e4m3_value(uint8_t code);
/// x rounded to e4m3 with ties to even and saturation: |x| > 448 (infinity included) gives +-448;
/// NaN stays NaN. The sign of zero is kept.
double round_e4m3(double x);
/// The code of an e4m3-representable value (as from round_e4m3); NaN gives 0x7f.
uint8_t e4m3_code(double representable);
/// SPEC.md's cast of a bf16 value divided by a float32 scale: e4m3(float(value) / scale).
uint8_t quantize_code(double bf16_value, float scale);

// ---- QK-norm + rotary (SPEC.md sections 1, 2 and 8) -------------------------------------------

/// The shape and options of a rope call. The first six fields keep their order from the
/// speedrun's layout, so `{T, H, D, r, paired, key_offset}` still reads as before; r now applies
/// to every row (lanes >= r pass through), -1 meaning the whole head.
struct Rope {
  int64_t tokens = 0;       ///< T
  int64_t heads = 0;        ///< Hq: query heads
  int64_t head_dim = 0;     ///< D
  int64_t rotary_dim = -1;  ///< r: rotary lanes [0, r); -1 means D
  bool paired = false;
  bool key_offset = false;
  int64_t kv_heads = 0;     ///< Hkv: key heads; 0 means Hq
  bool neox = false;        ///< half-split pairs (d, d + r/2) instead of (2i, 2i + 1)
  bool normalize = true;    ///< false: n = x
  double eps = 1.0 / 8388608.0;  ///< the float32 eps of the layout, as a double
  double weight_offset = 0.0;    ///< the weights read as w + weight_offset
  // SPEC.md section 9
  bool token_norm = false;   ///< norm_scope kToken: one RMS per token over its heads of a kind
  bool query_only = false;   ///< qk holds the query heads only (Hkv = 0)
  bool angles = true;        ///< false: no angle source, nothing rotates (r = 0)
  bool normalize_v = false;  ///< the V norm (qkv_backward_values then reads v)

  int64_t k_heads() const { return query_only ? 0 : kv_heads > 0 ? kv_heads : heads; }
  int64_t input_heads() const { return heads + k_heads(); }  ///< Hq + Hkv: qk's rows per token
  int64_t rotary() const { return !angles ? 0 : rotary_dim < 0 ? head_dim : rotary_dim; }
  /// Elements of the query (key: false) or key weight: D, or H*D of the kind with token_norm.
  int64_t weight_width(bool key) const {
    return token_norm ? (key ? k_heads() : heads) * head_dim : head_dim;
  }
  int64_t out_tokens() const { return paired ? 2 * tokens : tokens; }
  int64_t q_out_heads() const { return paired ? heads / 2 : heads; }
  int64_t k_out_heads() const { return paired ? k_heads() / 2 : k_heads(); }
  /// Output heads of q (and of k when Hq = Hkv, the only case the speedrun's tests know).
  int64_t out_heads() const { return q_out_heads(); }
  int64_t factor_width() const { return paired ? 2 * head_dim : head_dim; }
  size_t qk_count() const { return size_t(tokens * input_heads() * head_dim); }
  size_t q_count() const { return size_t(out_tokens() * q_out_heads() * head_dim); }
  size_t k_count() const { return size_t(out_tokens() * k_out_heads() * head_dim); }
};

/// What a rope call reads besides qk: its angles (factor tables, or a cos/sin cache at per-token
/// positions) and its norm weights.
struct RopeTensors {
  std::vector<double> factor1, factor2;  ///< tables [T][factor_width] (cache == false)
  bool cache = false;
  int64_t cache_rows = 0;                ///< P
  std::vector<double> cos_sin;           ///< [P][r]: cos of frequency i at i, sin at r/2 + i
  std::vector<int64_t> positions;        ///< [T]; outside [0, P): NaN rotary lanes
  std::vector<double> q_weight;          ///< [D] ([Hq*D] token_norm), or empty: no query weight
  std::vector<double> k_weight;          ///< [D] ([Hkv*D] token_norm), or empty: no key weight
};

/// q [out_tokens][Hq'][D], k [out_tokens][Hkv'][D], unrounded.
struct QkPair {
  std::vector<double> q;
  std::vector<double> k;
};

/// qk [T][Hq + Hkv][D] -> q, k (SPEC.md sections 1 and 8).
QkPair rope_forward(const Rope& rope, const std::vector<double>& qk, const RopeTensors& tensors);
/// The same with factor tables and no weights.
QkPair rope_forward(const Rope& rope, const std::vector<double>& qk,
                    const std::vector<double>& factor1, const std::vector<double>& factor2);

/// The exact gradients of rope_forward, and the magnitudes a float32 computation of them rounds
/// against.
struct RopeGradients {
  std::vector<double> grad_qk;        ///< [T][Hq + Hkv][D]
  std::vector<double> grad_q_weight;  ///< [Wq]: sum over query rows of dL/d(nw)[d] * n[d]
  std::vector<double> grad_k_weight;  ///< [Wk]: the same over key rows (zeros without a weight)
  /// Per lane, the sum over that weight's rows of |n[d]| times the magnitudes of every term of
  /// dL/d(nw)[d]: the scale of a float32 sum's rounding error (fp32_sum_tolerance).
  std::vector<double> q_weight_magnitude;
  std::vector<double> k_weight_magnitude;
  int64_t q_weight_terms = 0;  ///< rows summed into grad_q_weight (T * Hq; token_norm: T)
  int64_t k_weight_terms = 0;  ///< T * Hkv (token_norm: T)
  /// Per input row [T][Hq + Hkv]: rstd * max_d (|dn[d]| + |n[d] * sum(dn * n) / D|) with dn's
  /// terms taken by magnitude: dx is a difference of such terms, so its float32 rounding error
  /// scales with this, not with dx (0 where not finite).
  std::vector<double> term_scale;
};

/// grad_q, grad_k in the output layouts -> the gradients (the chain rule, scattered from every
/// output element onto the values it was computed from).
RopeGradients rope_gradients(const Rope& rope, const std::vector<double>& grad_q,
                             const std::vector<double>& grad_k, const std::vector<double>& qk,
                             const RopeTensors& tensors);

/// grad_qk of rope_gradients with factor tables and no weights.
std::vector<double> rope_backward(const Rope& rope, const std::vector<double>& grad_q,
                                  const std::vector<double>& grad_k, const std::vector<double>& qk,
                                  const std::vector<double>& factor1,
                                  const std::vector<double>& factor2);

// ---- fused FP8 backward (SPEC.md sections 3 and 8) ---------------------------------------------

/// qkv_dim = (Hq + Hkv) * D + Hkv * Dv.
int64_t qkv_dim(const Rope& rope, int64_t v_dim);

// ---- the V norm (SPEC.md section 9) -------------------------------------------------------------

/// v [rows][Dv] -> v * rstd per row, rstd = 1 / sqrt(sum v^2 / Dv + eps), unrounded.
std::vector<double> v_norm_forward(int64_t rows, int64_t v_dim, double eps,
                                   const std::vector<double>& v);

/// The exact gradient of v_norm_forward, and per row the magnitude its float32 computation
/// rounds against (rstd * max_d (|g| + |n| * sum |g n| / Dv)), as RopeGradients::term_scale.
struct VNormGradients {
  std::vector<double> grad_v;      ///< [rows][Dv]
  std::vector<double> term_scale;  ///< [rows]
};
VNormGradients v_norm_gradients(int64_t rows, int64_t v_dim, double eps,
                                const std::vector<double>& v, const std::vector<double>& grad_v_out);

/// The value each feature of grad_row [T][qkv_dim] holds before its e4m3 cast: dqk (unrounded)
/// for the Q/K features, grad_v for the V features (grad_v [T][Hkv][Dv]), or with
/// rope.normalize_v the V norm's gradient of the pre-norm `v` (unrounded). The code of each is
/// quantize_code(round_bf16(value), grad_scale).
std::vector<double> qkv_backward_values(const Rope& rope, int64_t v_dim,
                                        const std::vector<double>& grad_q,
                                        const std::vector<double>& grad_k,
                                        const std::vector<double>& grad_v,
                                        const std::vector<double>& qk, const RopeTensors& tensors,
                                        const std::vector<double>& v = {});
/// The same with factor tables and no weights.
std::vector<double> qkv_backward_values(const Rope& rope, int64_t v_dim,
                                        const std::vector<double>& grad_q,
                                        const std::vector<double>& grad_k,
                                        const std::vector<double>& grad_v,
                                        const std::vector<double>& qk,
                                        const std::vector<double>& factor1,
                                        const std::vector<double>& factor2);

// ---- quantize (SPEC.md section 5) --------------------------------------------------------------

/// src [M][N] (bf16 values) -> row codes [M][N] and transposed codes [N][M].
struct Quantized {
  std::vector<uint8_t> row;
  std::vector<uint8_t> t;
};
Quantized quantize(const std::vector<double>& src, int64_t rows, int64_t cols, float scale);
/// max |x|; NaN if any element is NaN; 0 for no elements.
double amax(const std::vector<double>& values);

// ---- GEMM and the packed projection (SPEC.md section 6) ----------------------------------------

/// d[m][n] = sum_k a[m][k] * b[n][k] * scale, unrounded; a [M][K], b [N][K] as e4m3 codes.
std::vector<double> gemm(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, int64_t m,
                         int64_t n, int64_t k, double scale);

/// The packed forward's projection: qkv [T][qkv_dim] = x_f8 @ weight_f8^T * x_scale *
/// weight_scale * qkv_scale (unrounded). q and k follow from rope_forward on its bf16 Q/K columns.
std::vector<double> packed_projection(const std::vector<uint8_t>& x_f8,
                                      const std::vector<uint8_t>& weight_f8, int64_t tokens,
                                      int64_t qkv_dim, int64_t channels, float x_scale,
                                      float weight_scale, float qkv_scale);

/// The packed backward's weight step from the unscaled weight gradient `grad_weight`
/// [qkv_dim][C] (bf16 values) and the master weights [qk_weight; v_weight] (same shape):
/// the scaled gradient grad_weight * qkv_scale (unrounded; the op rounds it to bf16) and
/// grad_qkv_scale = sum(grad_weight * weight) in float64.
struct WeightGrads {
  std::vector<double> grad_weight;
  double grad_qkv_scale = 0;
};
WeightGrads packed_weight_grads(const std::vector<double>& grad_weight,
                                const std::vector<double>& weight, float qkv_scale);

}  // namespace qkvfuse::ref

namespace qkvfuse::test {

// ---- host tensors ------------------------------------------------------------------------------

/// A CPU tensor for the tests: `sizes` laid out with `strides` (elements; empty = row-major)
/// starting `offset` elements into a buffer that is created poisoned: bf16 elements hold
/// kPoisonBF16, e4m3 kPoisonE4M3, float ones NaN, integer ones 0x7fc1... (far outside any
/// position range). Padding between strided rows is poisoned too,
/// so writes outside the view are caught as well as elements the op skipped.
class HostTensor {
 public:
  HostTensor(DType dtype, std::vector<int64_t> sizes, std::vector<int64_t> strides = {},
             int64_t offset = 0);

  TensorView view();
  int64_t numel() const;

  /// Stores dense row-major values, rounded to the dtype (nearest even; e4m3 saturating;
  /// integers truncated).
  void set(const std::vector<double>& values);
  void set_ints(const std::vector<int64_t>& values);  ///< int32 / int64 only
  void set_codes(const std::vector<uint8_t>& codes);  ///< e4m3 only
  /// The elements in dense row-major order.
  std::vector<double> get() const;
  std::vector<uint16_t> get_bf16_bits() const;  ///< bf16 only
  std::vector<uint8_t> get_codes() const;       ///< e4m3 only

  void poison();
  /// Number of buffer elements outside the view that no longer hold the poison.
  int64_t padding_touched() const;
  /// Number of buffer elements, in the view or not, that no longer hold the exact poison bytes.
  int64_t elements_touched() const;

 private:
  /// Buffer elements that no longer hold the poison, outside the view only or all of them.
  int64_t touched(bool outside_view_only) const;
  int64_t buffer_index(int64_t dense_index) const;
  unsigned char* slot(int64_t buffer_element);
  const unsigned char* slot(int64_t buffer_element) const;

  DType dtype_;
  std::vector<int64_t> sizes_;
  std::vector<int64_t> strides_;
  int64_t offset_;
  std::vector<unsigned char> bytes_;
};

// ---- inputs ------------------------------------------------------------------------------------

/// `count` values drawn from normal(0, scale) and rounded to `dtype`, so storing them in a
/// HostTensor of that dtype loses nothing.
std::vector<double> random_values(std::mt19937_64& rng, size_t count, DType dtype,
                                  double scale = 1.0);

/// Rotary factor tables [T, copies * D] as the model builds them (test_util.hpp's rotary_tables;
/// dims >= rotary_dim of each head chunk stationary). With `off_bf16_grid`, every rotating entry
/// is nudged by a random relative 2^-12 or less, off the bf16 grid, so float32 factors are tested
/// as float32 values rather than as bf16 values in float32 storage.
void rotary_factor_values(std::mt19937_64& rng, int64_t tokens, int64_t head_dim, int64_t copies,
                          int64_t rotary_dim, bool off_bf16_grid, std::vector<double>& factor1,
                          std::vector<double>& factor2);

/// Values x (bf16, both signs) with x / scale exactly a midpoint between two consecutive e4m3
/// values, in fp32. A true division then ties and rounds to even; x * (1 / scale) does not tie
/// for scales whose reciprocal rounds far enough (7 and 7/4 do), so these inputs tell the two
/// apart where random inputs essentially never do.
std::vector<double> e4m3_tie_inputs(float scale);

/// The transpose of a dense row-major [rows, cols] matrix.
template <typename T>
std::vector<T> transpose(const std::vector<T>& in, int64_t rows, int64_t cols) {
  std::vector<T> out(in.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[size_t(c * rows + r)] = in[size_t(r * cols + c)];
  }
  return out;
}

// ---- judging a backend against the reference ----------------------------------------------------

/// The outcome of comparing one output, element by element.
struct Comparison {
  std::string what;
  int64_t count = 0;
  int64_t exact = 0;      ///< identical to the rounded reference
  int64_t one_step = 0;   ///< one bf16 ulp / one e4m3 step away
  int64_t in_noise = 0;   ///< further, but reachable from the reference moved by its noise bound
  int64_t unwritten = 0;  ///< still the poison pattern
  int64_t bad = 0;
  std::string first_bad;  ///< index, got and expected of the first failure

  bool ok() const { return bad == 0 && unwritten == 0; }
  /// "q: 4096 elements, 4001 exact, 95 by 1 step, 0 in noise, 0 unwritten, 0 bad".
  std::string summary() const;
};

/// Passes when the comparison is clean; prints its summary either way, so the counts of
/// one-step differences appear in the test log.
::testing::AssertionResult passes(const Comparison& comparison);

/// Per-element absolute noise bounds: relative * max |ref| over each run of `row_length`
/// elements. This is the error a correct fp32 computation may make on a row whose values nearly
/// cancel (the bound scales with the row, not with the tiny result).
std::vector<double> row_noise(const std::vector<double>& ref, int64_t row_length, double relative);

/// The noise bounds of the grad_row [T][qkv_dim] values of qkv_backward_values: `relative` times
/// the largest |value| of each Q/K head row (D features), raised to `relative` times the row's
/// term scale when one is given (ref::RopeGradients::term_scale); 0 for the V features, whose
/// bf16 input involves no arithmetic, unless the V norm computes them (rope.normalize_v): then
/// as the Q/K rows, with v_term_scale (ref::VNormGradients::term_scale).
std::vector<double> qkv_feature_noise(const ref::Rope& rope, int64_t v_dim,
                                      const std::vector<double>& values, double relative,
                                      const std::vector<double>& term_scale = {},
                                      const std::vector<double>& v_term_scale = {});

/// Raises each row's noise (rows of `row_length`) to `relative` times the row's term scale.
void widen_by_terms(std::vector<double>& noise, const std::vector<double>& term_scale,
                    int64_t row_length, double relative);

/// The error bound of a float32 sum of `terms` products whose magnitudes add to `magnitude`, per
/// element: 2^-24 * magnitude * (16 + sqrt(terms)), plus (terms + 16) * 2^-147 for products in
/// float32's subnormal range. The 16 covers each term's own rounding (the gradient's two
/// products, the normalized value, the product); sqrt(terms) the accumulation in any fixed order,
/// well above its typical error and far below any wrong term.
std::vector<double> fp32_sum_tolerance(const std::vector<double>& magnitude, int64_t terms);

/// bf16 results against unrounded reference values: each must lie within one ulp of the
/// interval [round_bf16(ref - noise), round_bf16(ref + noise)] (noise empty: zero).
Comparison compare_bf16(const std::string& what, const std::vector<uint16_t>& got,
                        const std::vector<double>& ref, const std::vector<double>& noise = {});

/// Division by a zero scale: whether a value within its noise of zero may round to exactly 0 in
/// fp32 on one side (0/0: code NaN) and to a tiny +-x on the other (+-inf: code +-448), which
/// depends only on the rounding of the row sums: both codes are then right.
inline bool zero_scale_ambiguous(double value, double noise) {
  return !std::isnan(value) && std::fabs(value) <= noise;
}

/// e4m3 codes against the values before the cast (see qkv_backward_values): each must lie within
/// one step of the codes of [value - noise, value + noise] under quantize_code(round_bf16(.));
/// for a zero scale, see zero_scale_ambiguous.
Comparison compare_e4m3(const std::string& what, const std::vector<uint8_t>& got,
                        const std::vector<double>& values, float scale,
                        const std::vector<double>& noise = {});

/// Wide-float results (float32, float64) against the reference: |got - ref| <= tolerance.
Comparison compare_close(const std::string& what, const std::vector<double>& got,
                         const std::vector<double>& ref, const std::vector<double>& tolerance);

// ---- judging one backend against another --------------------------------------------------------

/// bf16 outputs of the two backends on the same inputs, in rows of `row_length`: the GPU's
/// against the CPU's, the rule of the GPU tests and the fuzz's GPU mode. An element the GPU left
/// at kPoisonBF16 is unwritten; NaN must be NaN on both (and counts as exact); any other element
/// must be identical, one bf16 step away, or (where the row's fp32 sums may round differently)
/// within `relative_noise` times the row's largest finite |cpu| value, raised to the row's entry
/// of `term_scale` when one is given (the backward's term scales), plus |cpu| / 256. Different
/// sizes: every element bad, first_bad "sizes differ". first_bad gives the element, its row and
/// column, both values with their bits, and the row's largest value.
Comparison compare_bf16_gpu_cpu(const std::string& what, const std::vector<uint16_t>& gpu,
                                const std::vector<uint16_t>& cpu, int64_t row_length,
                                double relative_noise, const std::vector<double>& term_scale = {});

// ---- rope inputs --------------------------------------------------------------------------------

/// Factor tables [T][factor_width] for `rope` (its style and r): random angles, interleaved with
/// the speedrun's signs (f2 = +sin at even lanes, -sin at odd), NeoX with the half-split signs
/// (-sin for d < r/2, +sin for r/2 <= d < r); each D chunk of a paired table has its own angles.
/// Lanes >= r hold random values in [-4, 4]: the contract says they are never read. Values are
/// bf16, or nudged off the bf16 grid by a relative 2^-12 with `off_bf16_grid` (float32 tables).
void rope_tables(std::mt19937_64& rng, const ref::Rope& rope, bool off_bf16_grid,
                 std::vector<double>& factor1, std::vector<double>& factor2);

/// A cos/sin cache [P][r]: cos(p * f_i) at column i, sin(p * f_i) at r/2 + i, f_i = base^(-2i/r)
/// (the Hugging Face rotary frequencies), rounded to `dtype`.
std::vector<double> cos_sin_cache(int64_t rows, int64_t rotary, DType dtype,
                                  double base = 10000.0);

/// Positions of packed documents: each document counts 0, 1, 2, ... from its first token; the
/// lengths are random (1 to max(1, rows)), so positions restart several times within T.
std::vector<int64_t> packed_positions(std::mt19937_64& rng, int64_t tokens, int64_t rows);

/// How a test builds the tensors of a rope call around a ref::Rope.
struct RopeSpec {
  DType qk_dtype = DType::kBFloat16;
  bool cache = false;                        ///< cos_sin + positions instead of factor tables
  DType angle_dtype = DType::kBFloat16;      ///< of the tables or of cos_sin
  DType position_dtype = DType::kInt64;
  int64_t cache_rows = 0;                    ///< P; 0: T + 5
  bool packed = false;                       ///< positions of packed documents (else random)
  bool q_weight = false;
  bool k_weight = false;
  DType weight_dtype = DType::kBFloat16;
  double weight_mean = 1.0;                  ///< weights ~ normal(mean, 0.5), rounded to dtype
  int64_t qk_row_pad = 0;                    ///< qk a column slice: rows padded by this much
  double qk_scale = 1.0;                     ///< qk ~ normal(0, qk_scale)
  int64_t v_dim = 0;                         ///< Dv of the V norm's v (rope.normalize_v); 0: D
  int64_t v_row_pad = 0;                     ///< v a column slice: rows padded by this much

  std::string describe() const;
};

/// Fresh random inputs of one rope call: the model's values and host tensors holding them.
struct RopeData {
  ref::Rope rope;
  RopeSpec spec;
  std::vector<double> qk;
  ref::RopeTensors tensors;
  std::optional<HostTensor> qk_tensor, factor1, factor2, cos_sin, positions, q_weight, k_weight;
  std::vector<double> v;           ///< the V norm's input [T][Hkv][Dv] (rope.normalize_v)
  std::optional<HostTensor> v_tensor;

  RopeData(const ref::Rope& rope, const RopeSpec& spec, std::mt19937_64& rng);
  /// Stores changed values of qk / tensors into the host tensors.
  void refresh();
  /// The layout of the call: rope's options (rotary_dim as the rope says, -1 included) and the
  /// host tensors' views.
  RopeLayout layout();
};

/// The speedrun's layout (SPEC.md sections 1-7): Hq = Hkv = heads, interleaved rotary over
/// [0, rotary_dim) from the factor tables, weightless RMS-norm.
RopeLayout tables_layout(int64_t heads, int64_t rotary_dim, bool paired, bool key_offset,
                         const TensorView& factor1, const TensorView& factor2);

/// "T=3 Hq=4 Hkv=2 D=64 r=32 neox ..." for traces.
std::string describe(const ref::Rope& rope);

// ---- errors ------------------------------------------------------------------------------------

/// Passes when `call` throws qkvfuse::Error whose message contains every one of `parts`.
::testing::AssertionResult throws_error(const std::function<void()>& call,
                                        const std::vector<std::string>& parts);

}  // namespace qkvfuse::test
