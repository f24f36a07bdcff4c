// reference.hpp: an independent float64 model of SPEC.md, the comparisons that judge a backend
// against it, and the host tensors and inputs the CPU tests share.
//
// The model (namespace ref) shares no code with src/ and does not use numeric.hpp: it restates
// the spec with nested loops over dense std::vector<double> arrays and its own rounding
// functions (a value is rounded by scaling it to an integer count of its quantum, which is exact
// in double). Where the spec prescribes a float32 operation (the division by a scale), the model
// performs exactly that float32 operation. Only test inputs (test_util.hpp's random values and
// rotary tables) are made with numeric.hpp.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

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

// ---- QK-norm + rotary (SPEC.md sections 1 and 2) -----------------------------------------------

struct Rope {
  int64_t tokens = 0;      ///< T
  int64_t heads = 0;       ///< H
  int64_t head_dim = 0;    ///< D
  int64_t rotary_dim = 0;  ///< read only with key_offset
  bool paired = false;
  bool key_offset = false;

  int64_t out_tokens() const { return paired ? 2 * tokens : tokens; }
  int64_t out_heads() const { return paired ? heads / 2 : heads; }
  int64_t factor_width() const { return paired ? 2 * head_dim : head_dim; }
};

/// q, k: [out_tokens][out_heads][D], unrounded.
struct QkPair {
  std::vector<double> q;
  std::vector<double> k;
};

/// qk [T][2H][D], factors [T][factor_width] -> q, k.
QkPair rope_forward(const Rope& rope, const std::vector<double>& qk,
                    const std::vector<double>& factor1, const std::vector<double>& factor2);

/// grad_q, grad_k [out_tokens][out_heads][D] -> dqk [T][2H][D], unrounded. The exact gradient
/// of rope_forward; it equals SPEC.md section 2 when the factors are stationary (1, 0) at the
/// dims >= rotary_dim, which section 2 assumes for the key offset and every test table has.
std::vector<double> rope_backward(const Rope& rope, const std::vector<double>& grad_q,
                                  const std::vector<double>& grad_k, const std::vector<double>& qk,
                                  const std::vector<double>& factor1,
                                  const std::vector<double>& factor2);

// ---- fused FP8 backward (SPEC.md section 3) ----------------------------------------------------

/// The value each feature of grad_row [T][qkv_dim] holds before its e4m3 cast: dqk (unrounded)
/// for the Q/K features, grad_v for the V features (grad_v [T][H][Dv]). The code of each is
/// quantize_code(round_bf16(value), grad_scale).
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
/// kPoisonBF16, e4m3 kPoisonE4M3, float ones NaN. Padding between strided rows is poisoned too,
/// so writes outside the view are caught as well as elements the op skipped.
class HostTensor {
 public:
  HostTensor(DType dtype, std::vector<int64_t> sizes, std::vector<int64_t> strides = {},
             int64_t offset = 0);

  TensorView view();
  int64_t numel() const;

  /// Stores dense row-major values, rounded to the dtype (nearest even; e4m3 saturating).
  void set(const std::vector<double>& values);
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
/// the largest |value| of each Q/K head row (D features); 0 for the V features, whose bf16 input
/// involves no arithmetic.
std::vector<double> qkv_feature_noise(const ref::Rope& rope, int64_t v_dim,
                                      const std::vector<double>& values, double relative);

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

// ---- errors ------------------------------------------------------------------------------------

/// Passes when `call` throws qkvfuse::Error whose message contains every one of `parts`.
::testing::AssertionResult throws_error(const std::function<void()>& call,
                                        std::initializer_list<std::string> parts);

}  // namespace qkvfuse::test
