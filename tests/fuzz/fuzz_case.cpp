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

/// A random divisor of n in [1, n).
int64_t proper_divisor(Rng& rng, int64_t n) {
  std::vector<int64_t> divisors;
  for (int64_t d = 1; d < n; ++d) {
    if (n % d == 0) divisors.push_back(d);
  }
  return divisors.empty() ? 1 : divisors[size_t(rng.range(0, int64_t(divisors.size()) - 1))];
}

/// The layout options of SPEC.md section 8 (heads, style, rotary width, norm, eps, weights, angle
/// source, positions), drawn for a rope case whose mode (paired, key offset) and D are set; with
/// `families`, those of section 9 too (query_only is drawn later: draw_query_only).
void draw_layout_options(Case& c, Rng& rng, bool families) {
  // Heads: MHA, GQA (any proper divisor) or MQA; paired and key offset need Hq = Hkv.
  c.kv_heads = c.heads;
  if (!c.paired && !c.key_offset && c.heads > 1) {
    const double g = rng.unit();
    if (g < 0.2) {
      c.kv_heads = 1;
    } else if (g < 0.55) {
      c.kv_heads = proper_divisor(rng, c.heads);
    }
  }
  c.kv_heads_zero = c.kv_heads == c.heads && rng.chance(0.5);
  c.neox = rng.chance(0.5);
  c.cache = !c.paired && rng.chance(0.45);

  // Rotary width r: the whole head, any even part of it (NeoX r % 16 != 0 among them), none, the
  // edges. The key offset keeps its own distribution.
  const int64_t d = c.head_dim;
  const double u = rng.unit();
  if (c.key_offset) {
    c.rotary_dim = u < 0.1 ? 0 : u < 0.2 ? d : u < 0.4 ? d / 4 * 2 : 2 * rng.range(0, d / 2);
  } else {
    c.rotary_dim = u < 0.4    ? d
                   : u < 0.75 ? 2 * rng.range(0, d / 2)
                   : u < 0.85 ? 0
                              : rng.pick<int64_t>({2, std::max<int64_t>(0, d - 2), d / 4 * 2});
  }
  // rotary_dim = -1 means D with tables and the cache's width with a cache.
  c.rotary_default = (c.cache || c.rotary_dim == d) && rng.chance(0.5);
  c.table_rotary = rng.chance(0.8) ? c.rotary_dim : 2 * rng.range(0, c.rotary_dim / 2);
  c.factor_dtype = rng.chance(0.3) ? DType::kFloat32 : DType::kBFloat16;

  // Norm: none, RMS, RMS * w (either weight or both), RMS * (w + offset) (Gemma: offset 1).
  c.normalize = rng.chance(0.85);
  if (c.normalize && rng.chance(0.55)) {
    const double w = rng.unit();
    c.q_weight = w < 0.8;
    c.k_weight = w >= 0.6 || w < 0.2;
    const double o = rng.unit();
    c.weight_offset = o < 0.3 ? 1.0f : o < 0.36 ? rng.pick<float>({0.5f, -1.0f, 0.125f}) : 0.0f;
    c.weight_dtype = rng.chance(0.3) ? DType::kFloat32 : DType::kBFloat16;
  }
  const double e = rng.unit();
  c.eps = e < 0.4   ? kRmsNormEps
          : e < 0.7 ? 1e-6f
          : e < 0.8 ? 1e-5f
                    : float(std::exp(std::log(1e-12) + rng.unit() * (0.0 - std::log(1e-12))));

  // Section 9: the token-wide norm, the V norm, no angles.
  if (families && rng.chance(0.6)) {
    c.token_norm = c.normalize && rng.chance(0.4);
    c.normalize_v = !c.token_norm && rng.chance(0.4);
    if (!c.paired && rng.chance(0.25)) {
      c.angles = false;
      c.cache = false;
      c.rotary_dim = 0;
      c.table_rotary = 0;
      c.rotary_default = rng.chance(0.5);
    }
  }

  // Positions: int32 or int64, random in [0, P) or packed documents; now and then a few tokens
  // outside [0, P) (their rotary lanes come out NaN).
  if (c.cache) {
    c.position_dtype = rng.chance(0.5) ? DType::kInt32 : DType::kInt64;
    c.packed_positions = rng.chance(0.4);
    c.bad_positions = rng.chance(0.08) ? rng.range(1, 3) : 0;
  }
}

/// The tensors' placements of a rope or packed case whose shapes are set.
void draw_rope_placements(Case& c, Rng& rng, bool cuda_rules) {
  // Pads and offsets: CPU-only cases take any (unit 1). Under the CUDA rules they are multiples
  // of the 16-byte vector (`aligned` elements), except in about 20 % of cases ("misaligned"),
  // where each tensor draws unit 1 with even odds: odd pads and offsets, pointers aligned to
  // their elements only, which the narrower accesses take. Each tensor alone, or several at once.
  const bool misaligned = cuda_rules && c.op != Op::kPacked && rng.chance(0.2);
  const auto unit_for = [&](int64_t aligned) -> int64_t {
    if (!cuda_rules) return 1;
    return misaligned && rng.chance(0.5) ? 1 : aligned;
  };
  const int64_t v_extra = c.kv_heads * (c.v_dim ? c.v_dim : 128);
  const int64_t qk_unit = unit_for(8);
  c.qk = random_heads_placement(rng, c.tokens, c.input_heads(), c.head_dim, qk_unit, v_extra);
  const int64_t grad_unit = unit_for(8);
  c.grad_q = random_heads_placement(rng, c.out_tokens(), c.q_out_heads(), c.head_dim, grad_unit,
                                    grad_unit * 2);
  c.grad_k = random_heads_placement(rng, c.out_tokens(), c.k_out_heads(), c.head_dim, grad_unit,
                                    grad_unit * 3);
  if (c.op == Op::kQkvBackwardFp8 || c.op == Op::kPacked) {
    if (rng.chance(0.2)) {
      // The V columns of a packed [T, qkv_dim] gradient buffer.
      const int64_t qk_features = c.qk_features();
      c.v = heads_placement(c.tokens, c.kv_heads, c.v_dim, 0, qk_features, qk_features);
    } else {
      const int64_t v_unit = unit_for(8);
      c.v = random_heads_placement(rng, c.tokens, c.kv_heads, c.v_dim, v_unit, v_unit * 3);
    }
  }
  const int64_t factor_unit = unit_for(c.factor_dtype == DType::kFloat32 ? 4 : 8);
  if (c.cache) {
    c.cos_sin = {{c.cache_rows, c.rotary_dim},
                 {c.rotary_dim + maybe_pad(rng, 0.3, factor_unit), 1},
                 rng.chance(0.2) ? factor_unit * rng.range(1, 4) : 0};
    const int64_t position_stride = rng.chance(0.2) ? rng.range(2, 3) : 1;
    c.positions = {{c.tokens}, {position_stride}, rng.chance(0.2) ? rng.range(1, 5) : 0};
  } else {
    const int64_t width = c.factor_width();
    c.factor = {{c.tokens, width},
                {width + maybe_pad(rng, 0.3, factor_unit), 1},
                rng.chance(0.2) ? factor_unit * rng.range(1, 4) : 0};
  }
  const int64_t weight_unit = unit_for(c.weight_dtype == DType::kFloat32 ? 4 : 8);
  c.weight = {{c.weight_width(false)}, {1}, rng.chance(0.3) ? weight_unit * rng.range(1, 4) : 0};
  c.weight_k = {{c.weight_width(true)}, {1}, rng.chance(0.3) ? weight_unit * rng.range(1, 4) : 0};
  if (c.normalize_v) {
    // The V norm's input: its own tensor, or (Gemma 4's k_eq_v) a slice of a wider row.
    const int64_t v_unit = unit_for(8);
    c.v_in = random_heads_placement(rng, c.tokens, c.kv_heads, c.v_dim, v_unit, v_unit * 2);
    if (c.op == Op::kRopeForward || c.op == Op::kRopeBackward) {
      c.v = random_heads_placement(rng, c.tokens, c.kv_heads, c.v_dim, v_unit, v_unit * 5);
    }
  }
  // Outputs (q, k, grad_qk: bf16; grad_row, grad_t: e4m3) 1 to 15 elements past 16 bytes.
  if (misaligned && rng.chance(0.5)) c.out_offset = rng.range(1, 15);
}

/// Section 9's query-only calls: no key heads (nor their weight), for a case whose shapes are
/// drawn (the head budgets keep Hq % Hkv == 0 until then). Not with paired heads, key offset or
/// the V norm, which it does not combine with.
void draw_query_only(Case& c, Rng& rng) {
  if (c.paired || c.key_offset || c.normalize_v || !rng.chance(0.2)) return;
  c.query_only = true;
  c.kv_heads = 0;
  c.kv_heads_zero = false;
  c.k_weight = false;
}

/// `cuda_rules`: a GPU-mode case inside the CUDA domain; `cuda_outside`: a GPU-mode case drawn
/// outside it where anything is left outside (Dv past 512, section 9's options without the
/// switch); neither: a CPU-only case. `section9`: section 9's options are inside the CUDA domain
/// (QKVFUSE_CUDA_SECTION9=1).
void draw_rope(Case& c, Rng& rng, bool cuda_rules, bool cuda_outside, bool section9,
               int64_t max_tokens) {
  const double mode = rng.unit();
  c.paired = mode >= 0.55 && mode < 0.7;
  c.key_offset = mode >= 0.7 && mode < 0.85;
  // Mostly few heads (cheap cases), up to 32 (Qwen3-8B's).
  const double h = rng.unit();
  const int64_t heads = h < 0.5 ? rng.range(1, 4) : h < 0.8 ? rng.range(5, 8) : rng.range(9, 32);
  c.heads = c.paired ? std::max<int64_t>(2, heads / 2 * 2) : heads;
  if (cuda_rules) {
    // Every even width CUDA takes. About 60 % of draws are widths of the 16-byte vector kernels
    // (multiples of 8 from 32: the first two branches, and a quarter of the last), the rest go
    // to the narrower accesses.
    const double u = rng.unit();
    c.head_dim = u < 0.2    ? rng.pick<int64_t>({64, 96, 128, 256})
                 : u < 0.55 ? 8 * rng.range(4, 32)
                 : u < 0.7  ? rng.pick<int64_t>({2, 4, 6, 8, 10, 16, 24, 30, 34, 98, 100, 254})
                            : 2 * rng.range(1, 128);
    // With the switch, section 9's widths: 512 (Gemma 4), other multiples of 8 past 256 (the
    // 16-byte kernels), odd ones (the narrow accesses).
    if (section9 && rng.chance(0.15)) {
      c.head_dim = rng.pick<int64_t>({512, 512, 264, 384, 504, 258, 300, 510});
    }
  } else {
    const double u = rng.unit();
    c.head_dim = u < 0.4    ? 8 * rng.range(4, 32)
                 : u < 0.5  ? rng.pick<int64_t>({2, 4, 6, 8, 10, 30, 34, 100})
                 : u < 0.58 ? rng.pick<int64_t>({258, 320, 384, 510, 512})  // section 9
                            : 2 * rng.range(1, 128);
  }
  draw_layout_options(c, rng, !cuda_rules || section9);
  if (c.normalize_v && c.op != Op::kQkvBackwardFp8) c.v_dim = rng.range(1, 160);
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
  // A width of the CUDA vector kernels stays one when it shrinks.
  const bool vector_width = cuda_rules && c.head_dim % 8 == 0 && c.head_dim >= 32;
  // (A width past 256 may shrink below it: the case stays one of section 9's by its other
  // options, or becomes a section 8 case.)
  const int64_t min_dim = vector_width ? 32 : 2;
  while (c.tokens * c.qkv_dim() > budget) {
    if (c.paired ? c.heads > 2 : c.heads > 1) {
      // Halve both head counts, keeping Hq % Hkv == 0 (and Hq = Hkv even when paired).
      const int64_t group = c.heads / c.kv_heads;
      if (c.paired) {
        c.heads = c.kv_heads = std::max<int64_t>(2, c.heads / 4 * 2);
      } else if (c.kv_heads > 1) {
        c.kv_heads /= 2;
        c.heads = c.kv_heads * group;
      } else {
        c.heads = std::max<int64_t>(1, c.heads / 2);
      }
      if (c.heads == c.kv_heads && !c.paired && c.kv_heads == 1) c.kv_heads_zero = false;
    } else if (c.head_dim > min_dim) {
      const int64_t multiple = vector_width ? 8 : 2;
      c.head_dim = std::max(min_dim, c.head_dim / 2 / multiple * multiple);
      c.rotary_dim = std::min(c.rotary_dim, c.head_dim) / 2 * 2;
      c.rotary_default = c.rotary_default && (c.cache || c.rotary_dim == c.head_dim);
      c.table_rotary = std::min(c.table_rotary, c.rotary_dim) / 2 * 2;
    } else if (c.v_dim > 8) {
      // Under the CUDA rules a V width off the multiples of 8 stays off them.
      c.v_dim = cuda_rules && c.v_dim % 8 != 0 ? c.v_dim / 2
                                               : std::max<int64_t>(8, c.v_dim / 2 / 8 * 8);
    } else {
      c.tokens = std::max<int64_t>(1, budget / c.qkv_dim());
    }
  }
  if (c.kv_heads != c.heads) c.kv_heads_zero = false;
  if (!cuda_rules || section9) draw_query_only(c, rng);
  if (c.cache) {
    const double p = rng.unit();
    c.cache_rows = p < 0.5 ? c.tokens + rng.range(0, 16) : rng.range(1, 64);
    c.cache_rows = std::max<int64_t>(1, c.cache_rows);
  }
  draw_rope_placements(c, rng, cuda_rules);
  if (c.op == Op::kQkvBackwardFp8) {
    c.scales = {draw_scale(rng, true)};
    c.scale_ndim = int(rng.range(0, 1));
  }
}

/// The packed op: its GEMM shapes (under the CUDA rules T, C, D and Dv multiples of 16, so every
/// GEMM dimension is), the layout options, and the projection's scales.
void draw_packed(Case& c, Rng& rng, bool cuda_rules, bool section9, int64_t max_tokens) {
  const double mode = rng.unit();
  c.paired = mode >= 0.6 && mode < 0.75;
  c.key_offset = mode >= 0.75 && mode < 0.88;
  const int64_t heads = rng.range(1, 8);
  c.heads = c.paired ? std::max<int64_t>(2, heads / 2 * 2) : heads;
  const int64_t unit = cuda_rules ? 16 : 2;
  c.head_dim = cuda_rules ? 16 * rng.range(2, section9 ? 32 : 16)
                          : rng.pick<int64_t>({2, 6, 16, 34, 64, 100, 128, 256, 512});
  draw_layout_options(c, rng, !cuda_rules || section9);
  c.v_dim = cuda_rules ? 16 * rng.range(1, 16) : rng.range(1, 160);
  c.channels = cuda_rules ? 16 * rng.range(1, 24) : rng.range(1, 300);
  const double t = rng.unit();
  c.tokens = t < 0.03 ? 0 : t < 0.5 ? rng.range(1, 6) * (cuda_rules ? 16 : 1) + (cuda_rules ? 0 : rng.range(0, 15))
                                    : (cuda_rules ? 16 * rng.range(1, 16) : rng.range(1, 300));
  c.tokens = std::min(c.tokens, cuda_rules ? max_tokens / 16 * 16 : max_tokens);
  // The GEMMs' cost: T * C * qkv_dim multiply-adds (three GEMMs, and the float64 model's).
  const int64_t budget = int64_t(1) << 22;
  while (c.tokens * c.channels * c.qkv_dim() > budget) {
    if (c.channels > unit && c.channels >= c.tokens) {
      c.channels = std::max(unit, c.channels / 2 / unit * unit);
    } else if (c.tokens > unit) {
      c.tokens = std::max(unit, c.tokens / 2 / unit * unit);
    } else if (c.heads > 2 || (!c.paired && c.heads > 1)) {
      c.heads = c.paired ? std::max<int64_t>(2, c.heads / 4 * 2) : std::max<int64_t>(1, c.heads / 2);
      c.kv_heads = c.paired || c.key_offset ? c.heads : 1;
      c.kv_heads_zero = false;
    } else {
      c.v_dim = std::max(unit, c.v_dim / 2 / unit * unit);
      if (c.v_dim == unit) break;
    }
  }
  if (!cuda_rules || section9) draw_query_only(c, rng);
  if (c.cache) c.cache_rows = std::max<int64_t>(1, c.tokens + rng.range(0, 8));
  c.bad_positions = 0;  // NaN rotary lanes would reach every element of the GEMMs' outputs
  c.joined_qkv = !c.paired && rng.chance(0.7);
  c.joined_weight_grads = rng.chance(0.6);
  c.x_scale = 8.0f / 448;
  c.weight_scale = 0.05f / 448;
  c.qkv_scale = float(0.5 + rng.unit());
  draw_rope_placements(c, rng, cuda_rules);
  c.scales = {rng.pick<float>({1.0f / 448, 1.0f / 64, std::ldexp(1.0f, -12)})};
  c.scale_ndim = int(rng.range(0, 1));
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
  if (is_rope_op(c.op) && c.families_option() && !c.section9) {
    return "an option of SPEC.md section 9 (D > 256, token_norm, query_only, normalize_v or no "
           "angles: not yet on the CUDA backend without QKVFUSE_CUDA_SECTION9=1)";
  }
  if (c.op == Op::kPacked) {
    // fp8_gemm's rules: T, C and qkv_dim (with two GEMMs also QK and Hkv*Dv) multiples of 16.
    const bool ok = c.tokens % 16 == 0 && c.channels % 16 == 0 && c.qkv_dim() % 16 == 0 &&
                    (c.joined_qkv || (c.qk_features() % 16 == 0 && (c.kv_heads * c.v_dim) % 16 == 0)) &&
                    c.v_dim <= 512;
    return ok ? "" : "GEMM dims T, C, qkv_dim (and the QK / V parts) not all multiples of 16";
  }
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

/// Case::vector_path: the rule the CUDA backend picks its 16-byte vector kernels by, as
/// qk_norm_rope.hpp states it (for the log only).
bool rope_vector_path(const Case& c) {
  if (!is_rope_op(c.op) || c.op == Op::kPacked) return false;
  const bool fp8 = c.op == Op::kQkvBackwardFp8;
  const int64_t factor_size = c.factor_dtype == DType::kFloat32 ? 4 : 2;
  bool ok = c.head_dim % 8 == 0 && c.head_dim >= 32 && (c.out_offset * (fp8 ? 1 : 2)) % 16 == 0 &&
            vector_aligned(c.qk, 2) &&
            vector_aligned(c.cache ? c.cos_sin : c.factor, factor_size);
  if (c.neox) ok = ok && c.rotary_dim % 16 == 0;
  if (c.cache && !c.neox) ok = ok && c.rotary_dim % 8 == 0;
  if (c.op != Op::kRopeForward) ok = ok && vector_aligned(c.grad_q, 2) && vector_aligned(c.grad_k, 2);
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

/// Plants special values (kFactors) in a float table given as floats, in the first
/// `column_limit` columns of each row of `width`.
void plant_in_floats(Rng& rng, std::vector<float>& table, int64_t width, int64_t column_limit,
                     unsigned specials) {
  std::vector<uint16_t> bits(table.size());
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = bf16_of(table[i]);
  std::vector<uint16_t> planted = bits;
  plant_specials(rng, planted, width, column_limit, specials, 4, 16);
  for (size_t i = 0; i < bits.size(); ++i) {
    if (planted[i] != bits[i]) table[i] = bf16_to_float(planted[i]);
  }
}

void store_floats(HostBuffer& buffer, DType dtype, const Placement& placement,
                  const std::vector<float>& values) {
  buffer = HostBuffer(dtype, placement);
  if (dtype == DType::kFloat32) {
    buffer.set_f32(values);
  } else {
    std::vector<uint16_t> bits(values.size());
    for (size_t i = 0; i < values.size(); ++i) bits[i] = bf16_of(values[i]);
    buffer.set_bf16(bits);
  }
}

/// The angles of a rope case: factor tables (pairs of its style; pairs past table_rotary
/// stationary (1, 0); lanes >= r junk, NaN at times, which no backend may read), or a cos/sin
/// cache with its positions; and the norm weights.
void fill_angles(const Case& c, Rng& rng, Inputs& in) {
  static const AngleTable angles;
  const int64_t r = c.rotary_dim, half = r / 2;
  const auto angle = [&] { return size_t(rng.range(0, int64_t(angles.cos_values.size()) - 1)); };
  if (!c.angles) {
    // No angle source (SPEC.md section 9): nothing to fill.
  } else if (!c.cache) {
    const int64_t width = c.factor_width();
    const int64_t count = c.tokens * width;
    std::vector<float> f1(size_t(count), 1.0f), f2(size_t(count), 0.0f);
    const bool nan_junk = rng.chance(0.2);
    for (int64_t t = 0; t < c.tokens; ++t) {
      for (int64_t chunk = 0; chunk < width; chunk += c.head_dim) {
        const size_t base = size_t(t * width + chunk);
        for (int64_t d = r; d < c.head_dim; ++d) {
          f1[base + size_t(d)] = nan_junk ? NAN : 3.0f * angles.cos_values[angle()];
          f2[base + size_t(d)] = nan_junk ? NAN : 3.0f * angles.sin_values[angle()];
        }
        for (int64_t i = 0; i < c.table_rotary / 2; ++i) {
          const size_t a = angle();
          const size_t first = base + size_t(c.neox ? i : 2 * i);
          const size_t second = base + size_t(c.neox ? i + half : 2 * i + 1);
          f1[first] = f1[second] = angles.cos_values[a];
          // Interleaved: the speedrun's signs (+sin, -sin); NeoX: rotate_half's (-sin, +sin).
          f2[first] = c.neox ? -angles.sin_values[a] : angles.sin_values[a];
          f2[second] = -f2[first];
        }
      }
    }
    if (c.specials & kFactors) {
      // Only the rotary lanes: lanes >= r are never read (any value there would do).
      for (std::vector<float>* table : {&f1, &f2}) {
        if (rng.chance(0.6)) plant_in_floats(rng, *table, c.head_dim, r, c.specials);
      }
    }
    store_floats(in.factor1, c.factor_dtype, c.factor, f1);
    store_floats(in.factor2, c.factor_dtype, c.factor, f2);
  } else {
    std::vector<float> cache(size_t(c.cache_rows * r));
    for (int64_t p = 0; p < c.cache_rows; ++p) {
      for (int64_t i = 0; i < half; ++i) {
        const size_t a = angle();
        cache[size_t(p * r + i)] = angles.cos_values[a];
        cache[size_t(p * r + half + i)] = angles.sin_values[a];
      }
    }
    if ((c.specials & kFactors) && r > 0 && rng.chance(0.6)) {
      plant_in_floats(rng, cache, r, r, c.specials);
    }
    store_floats(in.cos_sin, c.factor_dtype, c.cos_sin, cache);
    std::vector<int64_t> positions(size_t(c.tokens));
    int64_t next = 0, document_end = 0;
    for (int64_t t = 0; t < c.tokens; ++t) {
      if (c.packed_positions) {
        if (next >= document_end || next >= c.cache_rows) {
          next = 0;
          document_end = rng.range(1, c.cache_rows);
        }
        positions[size_t(t)] = next++;
      } else {
        positions[size_t(t)] = rng.range(0, c.cache_rows - 1);
      }
    }
    const int64_t huge = c.position_dtype == DType::kInt32 ? int64_t(INT32_MAX) : int64_t(1) << 40;
    const int64_t tiny = c.position_dtype == DType::kInt32 ? int64_t(INT32_MIN) : -(int64_t(1) << 40);
    for (int64_t b = 0; b < c.bad_positions && c.tokens > 0; ++b) {
      positions[size_t(rng.range(0, c.tokens - 1))] =
          rng.pick<int64_t>({-1, c.cache_rows, c.cache_rows + 1000, huge, tiny});
    }
    in.positions = HostBuffer(c.position_dtype, c.positions);
    in.positions.set_ints(positions);
  }
  for (int kind = 0; kind < 2; ++kind) {
    if (!(kind == 0 ? c.q_weight : c.k_weight)) continue;
    // Around 1 (RMS * w), around 0 with an offset (Gemma's 1 + w).
    const float mean = c.weight_offset != 0.0f ? 0.0f : 1.0f;
    const int64_t width = c.weight_width(kind == 1);
    const std::vector<uint16_t> noise = normal_bf16(rng, width, c.head_dim, 0.5f, 0, 0);
    std::vector<float> w(static_cast<size_t>(width));
    for (size_t d = 0; d < w.size(); ++d) w[d] = mean + bf16_to_float(noise[d]);
    if ((c.specials & kFactors) && rng.chance(0.5)) plant_in_floats(rng, w, c.head_dim, c.head_dim, c.specials);
    store_floats(kind == 0 ? in.q_weight : in.k_weight, c.weight_dtype,
                 kind == 0 ? c.weight : c.weight_k, w);
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
    case Op::kPacked: return "packed_qkv";
  }
  return "?";
}

bool is_rope_op(Op op) {
  return op == Op::kRopeForward || op == Op::kRopeBackward || op == Op::kQkvBackwardFp8 ||
         op == Op::kPacked;
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
  layout.num_kv_heads = kv_heads_zero ? 0 : kv_heads;
  layout.rotary_dim = rotary_default ? -1 : rotary_dim;
  layout.rotary_style = neox ? RotaryStyle::kNeox : RotaryStyle::kInterleaved;
  layout.normalize = normalize;
  layout.eps = eps;
  layout.weight_offset = weight_offset;
  layout.paired = paired;
  layout.key_offset = key_offset;
  layout.normalize_v = normalize_v;
  layout.norm_scope = token_norm ? NormScope::kToken : NormScope::kHead;
  layout.query_only = query_only;
  return layout;
}

std::string Case::describe() const {
  std::ostringstream out;
  out.precision(9);
  out << "case " << index << " (seed " << seed << (cpu_only ? ", cpu-only" : "") << "): "
      << op_name(op);
  if (is_rope_op(op)) {
    out << " T=" << tokens << " Hq=" << heads << " Hkv=" << kv_heads
        << (kv_heads_zero ? " (as 0)" : "") << " D=" << head_dim;
    if (op == Op::kQkvBackwardFp8 || op == Op::kPacked) out << " Dv=" << v_dim;
    if (op == Op::kPacked) {
      out << " C=" << channels << (joined_qkv ? " one QKV GEMM" : " two QKV GEMMs")
          << (joined_weight_grads ? ", one wgrad GEMM" : ", two wgrad GEMMs")
          << " qkv_scale=" << qkv_scale;
    }
    if (normalize_v && op != Op::kQkvBackwardFp8 && op != Op::kPacked) out << " Dv=" << v_dim;
    out << (token_norm ? " token-norm" : "") << (query_only ? " query-only" : "")
        << (normalize_v ? " v-norm" : "") << (angles ? "" : " no-angles");
    out << (paired ? " paired" : key_offset ? " key_offset" : " plain")
        << (neox ? " neox" : " interleaved") << " r=" << rotary_dim
        << (rotary_default ? " (as -1)" : "");
    if (normalize) {
      out << " rms eps=" << eps;
      if (q_weight || k_weight) {
        out << " weights" << (q_weight ? " q" : "") << (k_weight ? " k" : "") << " "
            << dtype_name(weight_dtype) << " offset=" << weight_offset;
      }
    } else {
      out << " no-norm";
    }
    if (cache) {
      out << " cos_sin " << dtype_name(factor_dtype) << " P=" << cache_rows << " positions "
          << dtype_name(position_dtype) << (packed_positions ? " packed" : " random");
      if (bad_positions) out << " (" << bad_positions << " out of range)";
    } else {
      out << " tables " << dtype_name(factor_dtype) << " rotating " << table_rotary;
    }
    out << "\n    qk " << qk.describe();
    if (cache) {
      out << "; cos_sin " << cos_sin.describe() << "; positions " << positions.describe();
    } else {
      out << "; factors " << factor.describe();
    }
    if (q_weight || k_weight) out << "; weights " << weight.describe() << ", " << weight_k.describe();
    if (normalize_v) out << "; v " << v_in.describe();
    if (op != Op::kRopeForward) {
      out << "; grad_q " << grad_q.describe() << "; grad_k " << grad_k.describe();
    }
    if (op == Op::kQkvBackwardFp8 || op == Op::kPacked) out << "; grad_v " << v.describe();
    out << "; outputs offset " << out_offset;
    if (!cpu_only && op != Op::kPacked) {
      out << " (CUDA " << (vector_path ? "vector" : "narrow") << " accesses)";
    }
  } else {
    out << " B=" << batch << " M=" << rows << " N=" << cols << (with_amax ? " amax" : "")
        << "\n    src " << src.describe();
  }
  if (!scales.empty()) {
    out << "\n    " << (is_rope_op(op) ? "grad_scale" : "scale") << (scales.size() > 1 ? "s" : "")
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
  c.section9 = options.section9 && !options.cpu_only;
  const double u = rng.unit();
  c.op = u < 0.22   ? Op::kRopeForward
         : u < 0.40 ? Op::kRopeBackward
         : u < 0.62 ? Op::kQkvBackwardFp8
         : u < 0.74 ? Op::kPacked
         : u < 0.86 ? Op::kQuantize
         : u < 0.95 ? Op::kQuantizeBatched
                    : Op::kWeightBank;
  // GPU runs draw within the CUDA rules, except 3% of cases drawn as for the CPU: those test
  // that what the CUDA backend does not take is refused with a clear error (or computed right).
  const bool cuda_rules = !options.cpu_only && !rng.chance(0.03);
  if (c.op == Op::kPacked) {
    draw_packed(c, rng, cuda_rules, c.section9, options.max_tokens);
  } else if (is_rope_op(c.op)) {
    draw_rope(c, rng, cuda_rules, !options.cpu_only && !cuda_rules, c.section9,
              options.max_tokens);
  } else {
    draw_quantize(c, rng, cuda_rules, options.max_tokens);
  }
  // Special values: not in the packed op, whose GEMMs would spread them everywhere.
  if (c.op != Op::kPacked && rng.chance(0.2)) {
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

void HostBuffer::set_ints(const std::vector<int64_t>& dense) {
  for_each_element(placement_, [&](int64_t i, int64_t at) {
    if (dtype_ == DType::kInt32) {
      const auto narrow = int32_t(dense[size_t(i)]);
      std::memcpy(&bytes_[size_t(at) * 4], &narrow, 4);
    } else {
      std::memcpy(&bytes_[size_t(at) * 8], &dense[size_t(i)], 8);
    }
  });
}

void HostBuffer::set_codes(const std::vector<uint8_t>& dense) {
  for_each_element(placement_, [&](int64_t i, int64_t at) { bytes_[size_t(at)] = dense[size_t(i)]; });
}

std::vector<int64_t> HostBuffer::get_ints() const {
  std::vector<int64_t> out(size_t(placement_.numel()));
  for_each_element(placement_, [&](int64_t i, int64_t at) {
    if (dtype_ == DType::kInt32) {
      int32_t narrow = 0;
      std::memcpy(&narrow, &bytes_[size_t(at) * 4], 4);
      out[size_t(i)] = narrow;
    } else {
      std::memcpy(&out[size_t(i)], &bytes_[size_t(at) * 8], 8);
    }
  });
  return out;
}

std::vector<uint8_t> HostBuffer::get_codes() const {
  std::vector<uint8_t> out(size_t(placement_.numel()));
  for_each_element(placement_, [&](int64_t i, int64_t at) { out[size_t(i)] = bytes_[size_t(at)]; });
  return out;
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

/// e4m3 codes of normal(0, sigma) values (the packed op's x and weights).
std::vector<uint8_t> normal_e4m3(Rng& rng, int64_t count, float sigma) {
  const std::vector<uint16_t> values = normal_bf16(rng, count, std::max<int64_t>(count, 1), sigma, 0, 0);
  std::vector<uint8_t> codes(values.size());
  for (size_t i = 0; i < values.size(); ++i) codes[i] = float_to_e4m3(bf16_to_float(values[i]));
  return codes;
}

std::vector<uint8_t> transposed_codes(const std::vector<uint8_t>& in, int64_t rows, int64_t cols) {
  std::vector<uint8_t> out(in.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t col = 0; col < cols; ++col) out[size_t(col * rows + r)] = in[size_t(r * cols + col)];
  }
  return out;
}

HostBuffer code_buffer(const std::vector<uint8_t>& codes, int64_t rows, int64_t cols) {
  HostBuffer buffer(DType::kFloat8E4M3, Placement{{rows, cols}, {}, 0});
  buffer.set_codes(codes);
  return buffer;
}

Inputs make_inputs(const Case& c) {
  Rng rng(c.seed, c.index, 1);
  Inputs in;
  if (is_rope_op(c.op)) {
    const int64_t d = c.head_dim;
    // Rows of very different scales: rstd from ~1e-2 to ~1e2.
    std::vector<uint16_t> qk = normal_bf16(rng, c.tokens * c.input_heads() * d, d, 1.0f, -7, 7);
    // Huge rope inputs stay below 2^41, so a row's fp32 sum of squares (and every product in the
    // backward) stays finite: the float64 model would not overflow where fp32 does.
    plant_specials(rng, qk, d, d, c.specials, 16, 40);
    in.qk = HostBuffer(DType::kBFloat16, c.qk);
    in.qk.set_bf16(qk);
    fill_angles(c, rng, in);
    if (c.op != Op::kRopeForward) {
      const float magnitude = c.op == Op::kRopeBackward ? std::ldexp(1.0f, int(rng.range(-3, 3)))
                                                        : gradient_magnitude(c.scales[0]);
      for (int kind = 0; kind < 2; ++kind) {
        const int64_t heads = kind ? c.k_out_heads() : c.q_out_heads();
        std::vector<uint16_t> values = normal_bf16(rng, c.out_tokens() * heads * d, d, magnitude, -2, 2);
        plant_specials(rng, values, d, d, c.specials, 16, 40);
        HostBuffer& grad = kind ? in.grad_k : in.grad_q;
        grad = HostBuffer(DType::kBFloat16, kind ? c.grad_k : c.grad_q);
        grad.set_bf16(values);
      }
    }
    const bool fp8 = c.op == Op::kQkvBackwardFp8 || c.op == Op::kPacked;
    if (fp8 || (c.normalize_v && c.op == Op::kRopeBackward)) {
      // The gradient of the V the forward returns (v_out under the V norm).
      const float magnitude = fp8 ? gradient_magnitude(c.scales[0]) : 1.0f;
      std::vector<uint16_t> values =
          normal_bf16(rng, c.tokens * c.kv_heads * c.v_dim, c.v_dim, magnitude, -2, 2);
      plant_specials(rng, values, c.v_dim, c.v_dim, c.specials, 9, 127);
      in.grad_v = HostBuffer(DType::kBFloat16, c.v);
      in.grad_v.set_bf16(values);
    }
    if (fp8) in.scale = scale_buffer(c.scales, c.scale_ndim);
    if (c.normalize_v) {
      std::vector<uint16_t> v = normal_bf16(rng, c.tokens * c.kv_heads * c.v_dim, c.v_dim, 1.0f, -7, 7);
      plant_specials(rng, v, c.v_dim, c.v_dim, c.specials, 16, 40);
      in.v = HostBuffer(DType::kBFloat16, c.v_in);
      in.v.set_bf16(v);
    }
    if (c.op == Op::kPacked) {
      const int64_t T = c.tokens, C = c.channels, F = c.qkv_dim();
      const std::vector<uint8_t> x = normal_e4m3(rng, T * C, 8.0f);
      const std::vector<uint8_t> w = normal_e4m3(rng, F * C, 100.0f);
      in.x_f8 = code_buffer(x, T, C);
      in.x_f8_t = code_buffer(transposed_codes(x, T, C), C, T);
      in.weight_f8 = code_buffer(w, F, C);
      in.weight_f8_t = code_buffer(transposed_codes(w, F, C), C, F);
      const int64_t qk_rows = c.qk_features(), v_rows = c.kv_heads * c.v_dim;
      in.qk_weight = HostBuffer(DType::kBFloat16, Placement{{qk_rows, C}, {}, 0});
      in.qk_weight.set_bf16(normal_bf16(rng, qk_rows * C, C, 0.02f, 0, 0));
      in.v_weight = HostBuffer(DType::kBFloat16, Placement{{v_rows, C}, {}, 0});
      in.v_weight.set_bf16(normal_bf16(rng, v_rows * C, C, 0.02f, 0, 0));
      in.x_scale = scale_buffer({c.x_scale}, 0);
      in.weight_scale = scale_buffer({c.weight_scale}, 1);
      in.qkv_scale = scale_buffer({c.qkv_scale}, 0);
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
