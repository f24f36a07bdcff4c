// fuzz_case.cpp: drawing a case and building its inputs (see fuzz.hpp).
//
// Everything random comes from a small counter-based generator (splitmix64) seeded by the seed
// and the case number, never from <random>'s distributions (whose results differ between
// standard libraries): a case drawn on one machine is the same case on another. The case's
// parameters and its input values come from two separate streams, so the description printed
// for a case is all its parameters and `--seed S --case K` rebuilds exactly its inputs.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "fuzz.hpp"
#include "qkvfuse/numeric.hpp"

namespace qkvfuse::fuzz {
namespace {

// ---- random numbers ------------------------------------------------------------------------------

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

class Rng {
 public:
  Rng(uint64_t seed, int64_t index, uint64_t stream) : state_(seed) {
    // Mix the three so that neighbouring seeds and case numbers give unrelated streams.
    uint64_t s = seed ^ 0x5851f42d4c957f2dull;
    state_ = splitmix64(s) ^ (uint64_t(index) * 0xd1342543de82ef95ull) ^ (stream << 56);
    splitmix64(state_);
  }
  uint64_t next() { return splitmix64(state_); }
  /// Uniform in [0, 1).
  double unit() { return double(next() >> 11) * (1.0 / 9007199254740992.0); }
  /// Uniform integer in [lo, hi].
  int64_t range(int64_t lo, int64_t hi) {
    if (hi <= lo) return lo;
    return lo + int64_t(next() % uint64_t(hi - lo + 1));
  }
  bool chance(double p) { return unit() < p; }
  template <typename T>
  T pick(std::initializer_list<T> values) {
    return *(values.begin() + range(0, int64_t(values.size()) - 1));
  }

 private:
  uint64_t state_;
};

// ---- placements ------------------------------------------------------------------------------------

/// A padding of `unit`-element steps, present with probability p.
int64_t maybe_pad(Rng& rng, double p, int64_t unit) {
  return rng.chance(p) ? unit * rng.range(1, 4) : 0;
}

/// [a, b, w] with each of the b heads padded to `head_stride`, rows of b heads padded by
/// `row_pad`, starting `offset` elements into the buffer.
Placement heads_placement(int64_t a, int64_t b, int64_t w, int64_t head_pad, int64_t row_pad,
                          int64_t offset) {
  const int64_t head_stride = w + head_pad;
  return {{a, b, w}, {b * head_stride + row_pad, head_stride, 1}, offset};
}

/// A random placement for a [a, b, w] tensor: `unit` keeps strides and offset multiples of the
/// 16-byte vector on CUDA (8 bf16 elements), or 1 for anything the CPU takes.
Placement random_heads_placement(Rng& rng, int64_t a, int64_t b, int64_t w, int64_t unit,
                                 int64_t wide_row_extra) {
  const int64_t head_pad = maybe_pad(rng, 0.25, unit);
  int64_t row_pad = 0;
  const double u = rng.unit();
  if (u < 0.2) {
    row_pad = wide_row_extra;  // a column slice of the packed [T, qkv_dim] GEMM buffer
  } else if (u < 0.4) {
    row_pad = unit * rng.range(1, 6);
  }
  const int64_t offset = rng.chance(0.2) ? unit * rng.range(1, 8) : 0;
  return heads_placement(a, b, w, head_pad, row_pad, offset);
}

/// The 16-byte-or-less vector a CUDA kernel reads a row of `row_elements` elements with.
int64_t row_vector_bytes(int64_t row_elements, int64_t element) {
  const int64_t row_bytes = row_elements * element;
  int64_t width = 16;
  while (width > element && row_bytes % width != 0) width /= 2;
  return width;
}

/// Empty when the placement meets the CUDA alignment rule (validate.hpp), else why not. The
/// device copies keep the view's offset within a 16-byte aligned buffer, so the pointer's
/// alignment is that of the offset.
std::string cuda_alignment_problem(const char* name, const Placement& p, int64_t element) {
  if (p.numel() == 0 || p.sizes.empty()) return "";
  const int64_t vector = row_vector_bytes(p.sizes.back(), element);
  bool ok = (p.offset * element) % vector == 0;
  for (size_t d = 0; d + 1 < p.sizes.size(); ++d) {
    ok = ok && (p.sizes[d] <= 1 || (p.strides[d] * element) % vector == 0);
  }
  if (ok) return "";
  std::ostringstream out;
  out << name << " " << p.describe() << " is not aligned to its " << vector << "-byte row vectors";
  return out.str();
}

// ---- sizes -----------------------------------------------------------------------------------------

int64_t draw_tokens(Rng& rng, int64_t max_tokens) {
  const double u = rng.unit();
  int64_t tokens = 0;
  if (u < 0.03) {
    tokens = 0;
  } else if (u < 0.13) {
    tokens = 1;
  } else if (u < 0.48) {
    tokens = rng.pick<int64_t>({2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 61, 67, 127, 131, 257});
  } else if (u < 0.58) {
    tokens = 16 * rng.range(1, 16) + rng.range(-1, 1);  // around the token tiles
  } else if (u < 0.92) {
    tokens = rng.range(2, 200);
  } else if (u < 0.98) {
    tokens = rng.range(200, 3000);
  } else {
    tokens = rng.range(1, std::max<int64_t>(1, max_tokens));
  }
  return std::min(tokens, max_tokens);
}

int64_t draw_matrix_dim(Rng& rng, int64_t max_large) {
  const double u = rng.unit();
  if (u < 0.02) return 0;
  if (u < 0.45) {
    return rng.pick<int64_t>({1, 2, 3, 5, 7, 8, 13, 15, 16, 17, 24, 31, 32, 33, 48, 63, 64, 65,
                              100, 127, 128, 129, 256, 768});
  }
  if (u < 0.80) return rng.range(1, 1024);
  if (u < 0.985) return 16 * rng.range(1, 160);
  return rng.range(1, std::max<int64_t>(1, max_large));
}

/// Element budget of one case: small cases keep 10 000 GPU cases near a minute; the few long
/// ones (many tokens) get more room but shrink their widths to fit.
int64_t element_budget(int64_t long_dim) { return long_dim > 3000 ? (int64_t(2) << 20) : (int64_t(1) << 20); }

// ---- scales ----------------------------------------------------------------------------------------

float draw_scale(Rng& rng, bool allow_special) {
  const double u = rng.unit();
  if (allow_special && u < 0.04) {
    // Division by zero, by infinity, by NaN, and a negative scale.
    return rng.pick<float>({0.0f, INFINITY, NAN, -1.0f / 448.0f});
  }
  if (u < 0.30) return 1.0f / 448.0f;
  if (u < 0.55) return std::ldexp(1.0f, int(rng.range(-12, 4)));
  if (u < 0.65) return 1e-4f;  // most values saturate at +-448
  if (u < 0.75) return 1.0f;
  // Not a power of two: a true division and x * (1 / scale) differ.
  return float(std::exp(std::log(1e-3) + rng.unit() * (std::log(10.0) - std::log(1e-3))));
}

// ---- drawing ---------------------------------------------------------------------------------------

/// `cuda_rules`: a GPU-mode case inside the CUDA domain; `cuda_outside`: a GPU-mode case drawn
/// outside it where anything is left outside (Dv past 512); neither: a CPU-only case.
void draw_rope(Case& c, Rng& rng, bool cuda_rules, bool cuda_outside, int64_t max_tokens) {
  const double mode = rng.unit();
  c.paired = mode >= 0.4 && mode < 0.7;
  c.key_offset = mode >= 0.7;
  // Mostly few heads (cheap cases), up to 16.
  const double h = rng.unit();
  const int64_t heads = h < 0.5 ? rng.range(1, 4) : h < 0.8 ? rng.range(5, 8) : rng.range(9, 16);
  c.heads = c.paired ? std::max<int64_t>(2, heads / 2 * 2) : heads;
  if (cuda_rules) {
    // Every even width CUDA takes. About 60 % of draws are widths of the 16-byte vector kernels
    // (multiples of 8 from 32: the first two branches, and a quarter of the last), the rest go
    // to the element-pair kernels of the generic path.
    const double u = rng.unit();
    c.head_dim = u < 0.2    ? rng.pick<int64_t>({64, 96, 128})
                 : u < 0.55 ? 8 * rng.range(4, 32)
                 : u < 0.7  ? rng.pick<int64_t>({2, 4, 6, 8, 10, 16, 24, 30, 34, 254})
                            : 2 * rng.range(1, 128);
  } else {
    const double u = rng.unit();
    c.head_dim = u < 0.4   ? 8 * rng.range(4, 32)
                 : u < 0.5 ? rng.pick<int64_t>({2, 4, 6, 8, 10, 30, 34})
                           : 2 * rng.range(1, 128);
  }
  const int64_t d = c.head_dim;
  if (c.key_offset) {
    const double u = rng.unit();
    c.rotary_dim = u < 0.1 ? 0 : u < 0.2 ? d : u < 0.4 ? d / 4 * 2 : 2 * rng.range(0, d / 2);
    c.table_rotary = rng.chance(0.8) ? c.rotary_dim : 2 * rng.range(0, c.rotary_dim / 2);
  } else {
    c.table_rotary = rng.chance(0.6) ? d : 2 * rng.range(0, d / 2);
  }
  c.factor_dtype = rng.chance(0.3) ? DType::kFloat32 : DType::kBFloat16;
  if (c.op == Op::kQkvBackwardFp8) {
    if (cuda_rules) {
      // Dv in [1, 512]: about 70 % on the vector kernel's widths (multiples of 8 up to 256), the
      // rest odd, not a multiple of 8, or past 256.
      const double u = rng.unit();
      c.v_dim = u < 0.25   ? 128
                : u < 0.7  ? 8 * rng.range(1, 32)
                : u < 0.8  ? rng.pick<int64_t>({1, 2, 3, 7, 9, 33, 130, 257, 264, 300, 511, 512})
                           : rng.range(1, 512);
    } else if (cuda_outside && rng.chance(0.5)) {
      c.v_dim = rng.range(513, 1024);  // past what the CUDA backend takes
    } else if (rng.chance(0.5)) {
      c.v_dim = rng.chance(0.3) ? 128 : 8 * rng.range(1, 32);
    } else {
      c.v_dim = rng.range(1, 256);
    }
  }
  c.tokens = draw_tokens(rng, max_tokens);

  // Keep tokens * features within the budget: long cases trade heads and widths for tokens.
  const int64_t budget = element_budget(c.tokens);
  const int64_t min_heads = c.paired ? 2 : 1;
  // A width of the CUDA vector kernels stays one when it shrinks.
  const bool vector_width = cuda_rules && c.head_dim % 8 == 0 && c.head_dim >= 32;
  const int64_t min_dim = vector_width ? 32 : 2;
  const auto features = [&] { return 2 * c.heads * c.head_dim + c.heads * c.v_dim; };
  while (c.tokens * features() > budget) {
    if (c.heads > min_heads) {
      c.heads = std::max(min_heads, c.paired ? c.heads / 4 * 2 : c.heads / 2);
    } else if (c.head_dim > min_dim) {
      const int64_t multiple = vector_width ? 8 : 2;
      c.head_dim = std::max(min_dim, c.head_dim / 2 / multiple * multiple);
      c.rotary_dim = std::min(c.rotary_dim, c.head_dim);
      c.table_rotary = std::min(c.table_rotary, c.key_offset ? c.rotary_dim : c.head_dim);
    } else if (c.v_dim > 8) {
      // Under the CUDA rules a V width off the multiples of 8 stays off them (the generic path).
      c.v_dim = cuda_rules && c.v_dim % 8 != 0 ? c.v_dim / 2
                                               : std::max<int64_t>(8, c.v_dim / 2 / 8 * 8);
    } else {
      c.tokens = std::max<int64_t>(1, budget / features());
    }
  }

  // Pads and offsets: CPU-only cases take any (unit 1). Under the CUDA rules they are multiples
  // of the 16-byte vector (`aligned` elements), except in about 20 % of cases ("misaligned"),
  // where each tensor draws unit 1 with even odds: odd pads and offsets, pointers aligned to
  // their elements only, which the generic path takes. Each tensor alone, or several at once.
  const bool misaligned = cuda_rules && rng.chance(0.2);
  const auto unit_for = [&](int64_t aligned) -> int64_t {
    if (!cuda_rules) return 1;
    return misaligned && rng.chance(0.5) ? 1 : aligned;
  };
  const int64_t v_extra = c.heads * (c.v_dim ? c.v_dim : 128);
  const int64_t qk_unit = unit_for(8);
  c.qk = random_heads_placement(rng, c.tokens, 2 * c.heads, c.head_dim, qk_unit, v_extra);
  const int64_t grad_unit = unit_for(8);
  c.grad = random_heads_placement(rng, c.out_tokens(), c.out_heads(), c.head_dim, grad_unit,
                                  grad_unit * 2);
  if (c.op == Op::kQkvBackwardFp8) {
    if (rng.chance(0.2)) {
      // The V columns of a packed [T, qkv_dim] gradient buffer.
      const int64_t qk_features = 2 * c.heads * c.head_dim;
      c.v = heads_placement(c.tokens, c.heads, c.v_dim, 0, qk_features, qk_features);
    } else {
      const int64_t v_unit = unit_for(8);
      c.v = random_heads_placement(rng, c.tokens, c.heads, c.v_dim, v_unit, v_unit * 3);
    }
  }
  const int64_t factor_unit = unit_for(c.factor_dtype == DType::kFloat32 ? 4 : 8);
  const int64_t width = c.factor_width();
  c.factor = {{c.tokens, width},
              {width + maybe_pad(rng, 0.3, factor_unit), 1},
              rng.chance(0.2) ? factor_unit * rng.range(1, 4) : 0};
  // Outputs (q, k, grad_qk: bf16; grad_row, grad_t: e4m3) 1 to 15 elements past 16 bytes.
  if (misaligned && rng.chance(0.5)) c.out_offset = rng.range(1, 15);
  if (c.op == Op::kQkvBackwardFp8) {
    c.scales = {draw_scale(rng, true)};
    c.scale_ndim = int(rng.range(0, 1));
  }
}

void draw_quantize(Case& c, Rng& rng, bool cuda_rules, int64_t max_tokens) {
  c.batch = c.op == Op::kQuantize ? 0 : rng.range(1, 4);
  c.rows = draw_matrix_dim(rng, max_tokens);
  c.cols = draw_matrix_dim(rng, 16384);
  const int64_t entries = std::max<int64_t>(1, c.batch);
  const int64_t budget = element_budget(std::max(c.rows, c.cols));
  while (entries * c.rows * c.cols > budget) {
    if (c.cols >= c.rows) {
      c.cols = std::max<int64_t>(1, c.cols / 2);
    } else {
      c.rows = std::max<int64_t>(1, c.rows / 2);
    }
  }
  c.with_amax = c.op != Op::kWeightBank && rng.chance(0.5);
  const int64_t unit = cuda_rules ? 8 : 1;
  const int64_t row_stride = c.cols + maybe_pad(rng, 0.3, unit);
  const int64_t offset = rng.chance(0.2) ? unit * rng.range(1, 8) : 0;
  if (c.batch == 0) {
    c.src = {{c.rows, c.cols}, {row_stride, 1}, offset};
  } else {
    const int64_t batch_stride = c.rows * row_stride + maybe_pad(rng, 0.3, unit);
    c.src = {{c.batch, c.rows, c.cols}, {batch_stride, row_stride, 1}, offset};
  }
  if (c.op != Op::kWeightBank) {
    for (int64_t b = 0; b < entries; ++b) c.scales.push_back(draw_scale(rng, true));
    c.scale_ndim = c.batch ? 1 : int(rng.range(0, 1));
  }
}

/// Why the case lies outside what the CUDA backend documents it takes; empty if inside.
std::string cuda_domain_problem(const Case& c) {
  if (is_rope_op(c.op)) {
    // CUDA takes what the CPU takes (every even D in [2, 256], the only widths drawn; any
    // strides, element-aligned pointers), but for Dv, which it bounds.
    if (c.op == Op::kQkvBackwardFp8 && c.v_dim > 512) {
      return "V width Dv = " + std::to_string(c.v_dim) + " (CUDA takes Dv in [1, 512])";
    }
    return "";
  }
  return cuda_alignment_problem("src", c.src, 2);
}

/// Whether a placement's first element and every stride but the last (of a dimension of more
/// than one element) are multiples of 16 bytes.
bool vector_aligned(const Placement& p, int64_t element) {
  if (p.numel() == 0 || p.sizes.empty()) return true;
  bool ok = (p.offset * element) % 16 == 0;
  for (size_t d = 0; d + 1 < p.sizes.size(); ++d) {
    ok = ok && (p.sizes[d] <= 1 || (p.strides[d] * element) % 16 == 0);
  }
  return ok;
}

/// Case::vector_path: the rule the CUDA backend picks its 16-byte vector kernels by.
bool rope_vector_path(const Case& c) {
  if (!is_rope_op(c.op)) return false;
  const bool fp8 = c.op == Op::kQkvBackwardFp8;
  const int64_t factor_size = c.factor_dtype == DType::kFloat32 ? 4 : 2;
  bool ok = c.head_dim % 8 == 0 && c.head_dim >= 32 && (c.out_offset * (fp8 ? 1 : 2)) % 16 == 0 &&
            vector_aligned(c.qk, 2) && vector_aligned(c.factor, factor_size);
  if (c.op != Op::kRopeForward) ok = ok && vector_aligned(c.grad, 2);
  if (fp8) ok = ok && c.v_dim % 8 == 0 && c.v_dim <= 256 && vector_aligned(c.v, 2);
  return ok;
}

std::string specials_text(unsigned specials) {
  std::string out;
  const std::pair<unsigned, const char*> names[] = {{kNaN, "nan"},       {kInf, "inf"},
                                                    {kHuge, "huge"},     {kZeroRows, "zero-rows"},
                                                    {kTiny, "tiny"},     {kFactors, "in-factors"}};
  for (const auto& [bit, name] : names) {
    if (specials & bit) out += (out.empty() ? "" : ",") + std::string(name);
  }
  return out.empty() ? "none" : out;
}

// ---- input values ----------------------------------------------------------------------------------

/// A few hundred rotation angles' cos and sin: factor tables look like the model's (unit-length
/// pairs, odd lanes' sin negated) at the cost of a table lookup.
struct AngleTable {
  std::vector<float> cos_values, sin_values;
  AngleTable() {
    for (int i = 0; i < 509; ++i) {
      const double angle = double(i) * 0.7853981633974483 * 1.37;
      cos_values.push_back(float(std::cos(angle)));
      sin_values.push_back(float(std::sin(angle)));
    }
  }
};

uint16_t bf16_of(float value) { return float_to_bf16(value); }

/// A power of two times +-1 with exponent in [lo, hi], as bf16.
uint16_t signed_power(Rng& rng, int lo, int hi) {
  const float magnitude = std::ldexp(1.0f + float(rng.range(0, 127)) / 128.0f, int(rng.range(lo, hi)));
  return bf16_of(rng.chance(0.5) ? -magnitude : magnitude);
}

/// Plants special values in a dense bf16 tensor of rows of `row_length` elements, in the first
/// `column_limit` columns of each row. `huge_lo`/`huge_hi` bound the exponent of huge values.
void plant_specials(Rng& rng, std::vector<uint16_t>& values, int64_t row_length,
                    int64_t column_limit, unsigned specials, int huge_lo, int huge_hi) {
  if (values.empty() || row_length == 0 || column_limit == 0) return;
  std::vector<unsigned> kinds;
  for (unsigned bit : {kNaN, kInf, kHuge, kZeroRows, kTiny}) {
    if (specials & bit) kinds.push_back(bit);
  }
  if (kinds.empty()) return;
  const int64_t rows = int64_t(values.size()) / row_length;
  if ((specials & kZeroRows) && rng.chance(0.1)) {
    // The whole tensor zero (an all-zero weight-bank entry gets scale 1).
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t col = 0; col < column_limit; ++col) values[size_t(r * row_length + col)] = 0;
    return;
  }
  const int64_t count = rng.range(1, 6);
  for (int64_t i = 0; i < count; ++i) {
    const unsigned kind = kinds[size_t(rng.range(0, int64_t(kinds.size()) - 1))];
    const int64_t row = rng.range(0, rows - 1);
    const size_t at = size_t(row * row_length + rng.range(0, column_limit - 1));
    switch (kind) {
      case kNaN: values[at] = rng.chance(0.5) ? 0x7fc0 : 0xffc0; break;
      case kInf: values[at] = rng.chance(0.5) ? 0x7f80 : 0xff80; break;
      case kHuge: values[at] = signed_power(rng, huge_lo, huge_hi); break;
      case kTiny:
        values[at] = rng.chance(0.5) ? uint16_t(rng.range(1, 127) | (rng.chance(0.5) ? 0x8000 : 0))
                                     : signed_power(rng, -133, -100);
        break;
      case kZeroRows:
        for (int64_t col = 0; col < column_limit; ++col) {
          values[size_t(row * row_length + col)] = rng.chance(0.2) ? 0x8000 : 0;
        }
        break;
    }
  }
}

/// Dense bf16 values of standard deviation ~1 (triangular: the sum of two 16-bit uniforms, two
/// values per 64-bit draw); every run of `row_length` scaled by 2^[row_lo, row_hi] * `scale`.
std::vector<uint16_t> normal_bf16(Rng& rng, int64_t count, int64_t row_length, float scale,
                                  int row_lo, int row_hi) {
  std::vector<uint16_t> out(size_t(std::max<int64_t>(count, 0)));
  if (row_length <= 0) return out;
  for (int64_t start = 0; start < count; start += row_length) {
    // 2.449 / 65536: the triangular distribution on (-2.449, 2.449) has deviation 1.
    const float step = std::ldexp(scale, int(rng.range(row_lo, row_hi))) * (2.4494897f / 65536.0f);
    const int64_t end = std::min(count, start + row_length);
    for (int64_t i = start; i < end; i += 2) {
      const uint64_t bits = rng.next();
      const int32_t a = int32_t(bits & 0xffff) + int32_t((bits >> 16) & 0xffff) - 65535;
      const int32_t b = int32_t((bits >> 32) & 0xffff) + int32_t(bits >> 48) - 65535;
      out[size_t(i)] = bf16_of(float(a) * step);
      if (i + 1 < end) out[size_t(i + 1)] = bf16_of(float(b) * step);
    }
  }
  return out;
}

/// A magnitude for gradients that makes value / scale land across e4m3's range.
float gradient_magnitude(float scale) {
  const float s = std::fabs(scale);
  return (std::isfinite(s) && s >= 1e-6f) ? 64.0f * s : 64.0f / 448.0f;
}

void fill_factors(const Case& c, Rng& rng, Inputs& in) {
  static const AngleTable angles;
  const int64_t width = c.factor_width();
  const int64_t count = c.tokens * width;
  std::vector<float> f1(size_t(count), 1.0f), f2(size_t(count), 0.0f);
  for (int64_t t = 0; t < c.tokens; ++t) {
    for (int64_t col = 0; col < width; col += 2) {
      if (col % c.head_dim >= c.table_rotary) continue;  // stationary: (1, 0)
      const size_t a = size_t(rng.range(0, int64_t(angles.cos_values.size()) - 1));
      const size_t at = size_t(t * width + col);
      f1[at] = f1[at + 1] = angles.cos_values[a];
      f2[at] = angles.sin_values[a];
      f2[at + 1] = -angles.sin_values[a];
    }
  }
  in.factor1 = HostBuffer(c.factor_dtype, c.factor);
  in.factor2 = HostBuffer(c.factor_dtype, c.factor);
  if (c.specials & kFactors) {
    // Key offset: the columns >= rotary_dim stay stationary (SPEC.md section 2 assumes it for
    // the keys' shifted dims), so only the rotating columns get special values.
    const int64_t limit = c.key_offset ? c.rotary_dim : width;
    for (std::vector<float>* table : {&f1, &f2}) {
      if (!rng.chance(0.6)) continue;
      std::vector<uint16_t> bits(table->size());
      for (size_t i = 0; i < bits.size(); ++i) bits[i] = bf16_of((*table)[i]);
      std::vector<uint16_t> planted = bits;
      plant_specials(rng, planted, width, limit, c.specials, 4, 16);
      for (size_t i = 0; i < bits.size(); ++i) {
        if (planted[i] != bits[i]) (*table)[i] = bf16_to_float(planted[i]);
      }
    }
  }
  if (c.factor_dtype == DType::kFloat32) {
    in.factor1.set_f32(f1);
    in.factor2.set_f32(f2);
  } else {
    std::vector<uint16_t> b1(f1.size()), b2(f2.size());
    for (size_t i = 0; i < f1.size(); ++i) {
      b1[i] = bf16_of(f1[i]);
      b2[i] = bf16_of(f2[i]);
    }
    in.factor1.set_bf16(b1);
    in.factor2.set_bf16(b2);
  }
}

HostBuffer scale_buffer(const std::vector<float>& scales, int ndim) {
  Placement p;
  if (ndim == 1) {
    p.sizes = {int64_t(scales.size())};
    p.strides = {1};
  }
  HostBuffer buffer(DType::kFloat32, p);
  buffer.set_f32(scales);
  return buffer;
}

}  // namespace

// ---- public ----------------------------------------------------------------------------------------

const char* op_name(Op op) {
  switch (op) {
    case Op::kRopeForward: return "qk_norm_rope";
    case Op::kRopeBackward: return "qk_norm_rope_backward";
    case Op::kQkvBackwardFp8: return "qkv_backward_fp8";
    case Op::kQuantize: return "quantize_dual_layout";
    case Op::kQuantizeBatched: return "quantize_dual_layout(batched)";
    case Op::kWeightBank: return "quantize_weight_bank";
  }
  return "?";
}

bool is_rope_op(Op op) {
  return op == Op::kRopeForward || op == Op::kRopeBackward || op == Op::kQkvBackwardFp8;
}

int64_t Placement::numel() const {
  int64_t count = 1;
  for (int64_t s : sizes) count *= s;
  return count;
}

int64_t Placement::buffer_elements() const {
  if (numel() == 0) return offset + 1;
  int64_t last = offset;
  for (size_t d = 0; d < sizes.size(); ++d) last += (sizes[d] - 1) * strides[d];
  return last + 1;
}

std::string Placement::describe() const {
  std::ostringstream out;
  out << "[";
  for (size_t d = 0; d < sizes.size(); ++d) out << (d ? "," : "") << sizes[d];
  out << "] strides [";
  for (size_t d = 0; d < strides.size(); ++d) out << (d ? "," : "") << strides[d];
  out << "] offset " << offset;
  return out.str();
}

RopeLayout Case::layout() const {
  RopeLayout layout;
  layout.num_heads = heads;
  layout.rotary_dim = rotary();
  layout.paired = paired;
  layout.key_offset = key_offset;
  return layout;
}

std::string Case::describe() const {
  std::ostringstream out;
  out.precision(9);
  out << "case " << index << " (seed " << seed << (cpu_only ? ", cpu-only" : "") << "): "
      << op_name(op);
  if (is_rope_op(op)) {
    out << " T=" << tokens << " H=" << heads << " D=" << head_dim;
    if (op == Op::kQkvBackwardFp8) out << " Dv=" << v_dim;
    out << (paired ? " paired" : key_offset ? " key_offset" : " plain");
    if (key_offset) out << " rotary_dim=" << rotary_dim;
    out << " tables_rotate=" << table_rotary << " factors=" << dtype_name(factor_dtype)
        << "\n    qk " << qk.describe() << "; factors " << factor.describe();
    if (op != Op::kRopeForward) out << "; grad_q/grad_k " << grad.describe();
    if (op == Op::kQkvBackwardFp8) out << "; grad_v " << v.describe();
    out << "; outputs offset " << out_offset;
    if (!cpu_only) out << " (CUDA " << (vector_path ? "vector" : "generic") << " path)";
  } else {
    out << " B=" << batch << " M=" << rows << " N=" << cols << (with_amax ? " amax" : "")
        << "\n    src " << src.describe();
  }
  if (!scales.empty()) {
    out << "\n    " << (op == Op::kQkvBackwardFp8 ? "grad_scale" : "scale") << (scales.size() > 1 ? "s" : "")
        << " (shape " << (scale_ndim ? "[n]" : "[]") << ")";
    for (float s : scales) {
      char hex[64];
      std::snprintf(hex, sizeof(hex), "%a", double(s));
      out << " " << s << " (" << hex << ")";
    }
  }
  out << "\n    specials " << specials_text(specials);
  if (!outside_cuda.empty()) out << "; outside the CUDA domain: " << outside_cuda;
  return out.str();
}

Case draw_case(const Options& options, int64_t index) {
  Rng rng(options.seed, index, 0);
  Case c;
  c.seed = options.seed;
  c.index = index;
  c.cpu_only = options.cpu_only;
  const double u = rng.unit();
  c.op = u < 0.25   ? Op::kRopeForward
         : u < 0.45 ? Op::kRopeBackward
         : u < 0.70 ? Op::kQkvBackwardFp8
         : u < 0.85 ? Op::kQuantize
         : u < 0.95 ? Op::kQuantizeBatched
                    : Op::kWeightBank;
  // GPU runs draw within the CUDA rules, except 3% of cases drawn as for the CPU: those test
  // that what the CUDA backend does not take is refused with a clear error (or computed right).
  const bool cuda_rules = !options.cpu_only && !rng.chance(0.03);
  if (is_rope_op(c.op)) {
    draw_rope(c, rng, cuda_rules, !options.cpu_only && !cuda_rules, options.max_tokens);
  } else {
    draw_quantize(c, rng, cuda_rules, options.max_tokens);
  }
  if (rng.chance(0.2)) {
    c.specials = unsigned(rng.range(1, 31));
    if (is_rope_op(c.op) && rng.chance(0.3)) c.specials |= kFactors;
  }
  c.outside_cuda = cuda_domain_problem(c);
  c.vector_path = rope_vector_path(c);
  return c;
}

// ---- host buffers ----------------------------------------------------------------------------------

HostBuffer::HostBuffer(DType dtype, Placement placement)
    : dtype_(dtype), placement_(std::move(placement)) {
  if (placement_.strides.empty() && !placement_.sizes.empty()) {
    placement_.strides.resize(placement_.sizes.size());
    int64_t stride = 1;
    for (size_t d = placement_.sizes.size(); d-- > 0;) {
      placement_.strides[d] = stride;
      stride *= placement_.sizes[d];
    }
  }
  const size_t element = dtype_size(dtype_);
  bytes_.resize(size_t(placement_.buffer_elements()) * element);
  // Padding poison: NaN for bf16 and float32 (a read of padding shows), e4m3 NaN.
  uint8_t pattern[4] = {0xff, 0xff, 0xff, 0xff};
  if (dtype_ == DType::kBFloat16) std::memcpy(pattern, &kPoisonBF16, 2);
  if (dtype_ == DType::kFloat32) {
    const uint32_t nan_bits = 0x7fc12345u;
    std::memcpy(pattern, &nan_bits, 4);
  }
  // One element, then doubling copies.
  std::memcpy(bytes_.data(), pattern, std::min(element, bytes_.size()));
  for (size_t filled = element; filled < bytes_.size(); filled *= 2) {
    std::memcpy(bytes_.data() + filled, bytes_.data(), std::min(filled, bytes_.size() - filled));
  }
}

TensorView HostBuffer::view() const {
  TensorView view;
  view.data = bytes_.data() + size_t(placement_.offset) * dtype_size(dtype_);
  view.dtype = dtype_;
  view.device = Device{DeviceType::kCPU, 0};
  view.ndim = int(placement_.sizes.size());
  for (int d = 0; d < view.ndim; ++d) {
    view.sizes[d] = placement_.sizes[size_t(d)];
    view.strides[d] = placement_.strides[size_t(d)];
  }
  return view;
}

/// Calls f(dense_index, buffer_index) for every element in row-major order: the last dim in an
/// inner loop, the others by an odometer (no division per element).
template <typename F>
void for_each_element(const Placement& p, F&& f) {
  const int64_t count = p.numel();
  if (count == 0) return;
  if (p.sizes.empty()) {
    f(0, p.offset);
    return;
  }
  const size_t outer_rank = p.sizes.size() - 1;
  const int64_t inner = p.sizes.back();
  const int64_t inner_stride = p.strides.back();
  std::vector<int64_t> index(outer_rank, 0);
  int64_t at = p.offset;
  for (int64_t dense = 0; dense < count; dense += inner) {
    for (int64_t i = 0; i < inner; ++i) f(dense + i, at + i * inner_stride);
    for (size_t d = outer_rank; d-- > 0;) {
      at += p.strides[d];
      if (++index[d] < p.sizes[d]) break;
      at -= p.strides[d] * p.sizes[d];
      index[d] = 0;
    }
  }
}

void HostBuffer::set_bf16(const std::vector<uint16_t>& dense) {
  for_each_element(placement_, [&](int64_t i, int64_t at) {
    std::memcpy(&bytes_[size_t(at) * 2], &dense[size_t(i)], 2);
  });
}

void HostBuffer::set_f32(const std::vector<float>& dense) {
  for_each_element(placement_, [&](int64_t i, int64_t at) {
    std::memcpy(&bytes_[size_t(at) * 4], &dense[size_t(i)], 4);
  });
}

std::vector<uint16_t> HostBuffer::get_bf16() const {
  std::vector<uint16_t> out(size_t(placement_.numel()));
  for_each_element(placement_, [&](int64_t i, int64_t at) {
    std::memcpy(&out[size_t(i)], &bytes_[size_t(at) * 2], 2);
  });
  return out;
}

std::vector<float> HostBuffer::get_f32() const {
  std::vector<float> out(size_t(placement_.numel()));
  for_each_element(placement_, [&](int64_t i, int64_t at) {
    std::memcpy(&out[size_t(i)], &bytes_[size_t(at) * 4], 4);
  });
  return out;
}

std::vector<double> HostBuffer::get_values() const {
  std::vector<double> out;
  if (dtype_ == DType::kFloat32) {
    for (float v : get_f32()) out.push_back(v);
  } else {
    for (uint16_t v : get_bf16()) out.push_back(bf16_to_float(v));
  }
  return out;
}

Inputs make_inputs(const Case& c) {
  Rng rng(c.seed, c.index, 1);
  Inputs in;
  if (is_rope_op(c.op)) {
    const int64_t d = c.head_dim;
    // Rows of very different scales: rstd from ~1e-2 to ~1e2.
    std::vector<uint16_t> qk = normal_bf16(rng, c.tokens * 2 * c.heads * d, d, 1.0f, -7, 7);
    // Huge rope inputs stay below 2^41, so a row's fp32 sum of squares (and every product in the
    // backward) stays finite: the float64 model would not overflow where fp32 does.
    plant_specials(rng, qk, d, d, c.specials, 16, 40);
    in.qk = HostBuffer(DType::kBFloat16, c.qk);
    in.qk.set_bf16(qk);
    fill_factors(c, rng, in);
    if (c.op != Op::kRopeForward) {
      const float magnitude = c.op == Op::kQkvBackwardFp8
                                  ? gradient_magnitude(c.scales[0])
                                  : std::ldexp(1.0f, int(rng.range(-3, 3)));
      const int64_t count = c.out_tokens() * c.out_heads() * d;
      // CPU-only key-offset cases plant no infinities in the gradients: the float64 model
      // differentiates through the stationary factors (1, 0) of the shifted key dims, and
      // 0 * inf = NaN there, where SPEC.md section 2 (and so both backends) skips the factors
      // and gets inf. GPU cases, compared backend to backend, keep them.
      const unsigned grad_specials = c.cpu_only && c.key_offset ? c.specials & ~unsigned(kInf) : c.specials;
      for (HostBuffer* grad : {&in.grad_q, &in.grad_k}) {
        std::vector<uint16_t> values = normal_bf16(rng, count, d, magnitude, -2, 2);
        plant_specials(rng, values, d, d, grad_specials, 16, 40);
        *grad = HostBuffer(DType::kBFloat16, c.grad);
        grad->set_bf16(values);
      }
    }
    if (c.op == Op::kQkvBackwardFp8) {
      std::vector<uint16_t> values = normal_bf16(rng, c.tokens * c.heads * c.v_dim, c.v_dim,
                                                 gradient_magnitude(c.scales[0]), -2, 2);
      plant_specials(rng, values, c.v_dim, c.v_dim, c.specials, 9, 127);
      in.grad_v = HostBuffer(DType::kBFloat16, c.v);
      in.grad_v.set_bf16(values);
      in.scale = scale_buffer(c.scales, c.scale_ndim);
    }
    return in;
  }
  const int64_t entries = std::max<int64_t>(1, c.batch);
  const int64_t entry_size = c.rows * c.cols;
  std::vector<uint16_t> src;
  for (int64_t b = 0; b < entries; ++b) {
    float sigma = std::ldexp(1.0f, int(rng.range(-8, 4)));
    if (c.op != Op::kWeightBank) {
      const float s = std::fabs(c.scales[size_t(b)]);
      if (std::isfinite(s) && s > 0) sigma = s * std::ldexp(1.0f, int(rng.range(2, 9)));
    }
    std::vector<uint16_t> entry = normal_bf16(rng, entry_size, c.cols, sigma, -1, 1);
    plant_specials(rng, entry, c.cols, c.cols, c.specials, 9, 127);
    src.insert(src.end(), entry.begin(), entry.end());
  }
  in.src = HostBuffer(DType::kBFloat16, c.src);
  in.src.set_bf16(src);
  if (c.op != Op::kWeightBank) in.scale = scale_buffer(c.scales, c.scale_ndim);
  return in;
}

}  // namespace qkvfuse::fuzz
