// fuzz_main.cpp: qkvfuse_fuzz, random cases through the public API, every one checked.
//
//   qkvfuse_fuzz [--cases N] [--seed S] [--case K] [--cpu-only] [--max-tokens M]
//
// Each case draws an op (qk_norm_rope forward and backward, qkv_backward_fp8, quantize_dual_layout
// plain with or without amax and batched, quantize_weight_bank), a mode (plain, paired, key offset
// with any even rotary_dim), shapes (H 1..16, D any even width in [2, 256], Dv in [1, 512] in GPU
// mode (in [1, 256] in CPU-only mode), token counts from 0 to --max-tokens), strides (padded
// heads and rows, column slices of wider buffers, offsets), factor dtype, scales (1/448, powers of
// two, 1e-4, 1, arbitrary, and rarely 0, inf, NaN, negative) and special input values (NaN, inf,
// values far beyond e4m3's range, zero rows, subnormals). Case K of seed S depends on nothing
// else, so `--seed S --case K` replays it alone.
//
// The rope ops' CUDA backend has two kernel families: the 16-byte vector kernels (D a multiple of
// 8 from 32; Dv a multiple of 8 up to 256; every pointer and stride but the last a multiple of 16
// bytes) and the element-pair kernels of the generic path for the rest. GPU mode keeps about 60 %
// of head widths on the vector kernels' (and 70 % of the V widths), and in about 20 % of rope
// cases gives some of the tensors, and the outputs, odd pads and offsets (pointers aligned to
// their elements only), one tensor at a time or several: about half the rope cases take each
// path. Each case's description says which path the rule picks, and the summary counts them.
//
// GPU mode (default): the CUDA backend against the CPU backend on the same inputs, with the GPU
// tests' tolerances:
//   - bf16 outputs: bit-identical, one ulp apart, or (where the row's fp32 sums may legitimately
//     round differently) within 2^-18 of the row's largest finite value plus 2^-8 of the value;
//   - e4m3 outputs of qkv_backward_fp8: V features bit-identical; Q/K features within one e4m3
//     step, or within the same row noise; grad_t exactly grad_row transposed;
//   - quantize outputs, amax and weight-bank scales: bit-identical;
//   - NaN exactly where the CPU has NaN; outputs are poisoned (bf16 0x7fc1, e4m3 0xff, float
//     -1234.5: values no computation produces) and guarded, so unwritten elements and writes out
//     of bounds are caught.
// About 3% of GPU cases are drawn outside the CUDA rules: quantize sources with misaligned strides
// and, for qkv_backward_fp8, half the time Dv in [513, 1024], the rest of the rope cases as for
// the CPU (which CUDA now takes too). Cases outside the CUDA backend's documented domain must be
// refused with a qkvfuse::Error from the op's argument checks, or else computed correctly; cases
// inside it must be computed.
//
// CPU-only mode (--cpu-only): the CPU backend against the float64 model of tests/reference.hpp
// with the CPU tests' tolerances (bf16 within one ulp of the rounded model, or its row's fp32
// noise; e4m3 within one step; quantize bit-exact).
//
// Self-check (--self-check): GPU mode's cases and comparisons with the CPU backend in the GPU's
// place; every case must pass. It checks the harness (case drawing, poisoning, comparisons)
// where no GPU is.
//
// Output: the seed first, a progress line every 1000 cases, every mismatch with the full case
// and its replay command, then "fuzz: N cases, M mismatches" and "P passed, M failed". Exit
// status 0, 1 when any case mismatched, 77 when GPU mode finds no usable GPU, 2 for bad
// arguments.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz.hpp"
#include "qkvfuse/numeric.hpp"
#include "reference.hpp"

namespace qkvfuse::fuzz {
namespace {

constexpr double kRowNoise = 1.0 / (1 << 18);  // 64 fp32 ulps of the row's largest value

// ---- small helpers ---------------------------------------------------------------------------------

std::vector<uint16_t> as_u16(const std::vector<uint8_t>& bytes) {
  std::vector<uint16_t> out(bytes.size() / 2);
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), out.size() * 2);
  return out;
}

std::vector<float> as_f32(const std::vector<uint8_t>& bytes) {
  std::vector<float> out(bytes.size() / 4);
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), out.size() * 4);
  return out;
}

bool bf16_nan(uint16_t bits) { return (bits & 0x7f80) == 0x7f80 && (bits & 0x007f) != 0; }
bool e4m3_nan(uint8_t code) { return (code & 0x7f) == 0x7f; }
int32_t bf16_order(uint16_t bits) { return (bits & 0x8000) ? -int32_t(bits & 0x7fff) : int32_t(bits & 0x7fff); }
int32_t e4m3_order(uint8_t code) { return (code & 0x80) ? -int32_t(code & 0x7f) : int32_t(code & 0x7f); }

/// Float equality where every NaN equals every NaN.
bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || float_bits(a) == float_bits(b);
}

std::string hex(unsigned value) {
  char text[16];
  std::snprintf(text, sizeof(text), "0x%x", value);
  return text;
}

/// The problems found in one case, one line each.
struct Findings {
  std::vector<std::string> lines;
  void add(const std::string& line) { lines.push_back(line); }
  bool clean() const { return lines.empty(); }
};

// ---- the backward's rounding scale -------------------------------------------------------------------

/// For each input row (t, h2) of the rope backward: rstd * max_d (|dn[d]| + |n[d] * sum(dn * n) / D|),
/// computed in float64 from the inputs by SPEC.md section 2. dx = rstd * (dn - n * sum(dn n) / D)
/// is a difference of those terms, so an fp32 computation's error scales with them, not with dx:
/// where dn is nearly parallel to n (often so for small D) dx cancels to far below its terms,
/// and two correct fp32 computations may differ there by many ulps of dx. 0 for rows whose terms
/// are not finite (their outputs are compared exactly).
std::vector<double> backward_term_scale(const Case& c, const Inputs& in) {
  const int64_t d_size = c.head_dim, heads2 = 2 * c.heads, width = c.factor_width();
  const std::vector<double> qk = in.qk.get_values();
  const std::vector<double> f1 = in.factor1.get_values();
  const std::vector<double> f2 = in.factor2.get_values();
  const std::vector<double> grad_q = in.grad_q.get_values();
  const std::vector<double> grad_k = in.grad_k.get_values();
  std::vector<double> scale(size_t(c.tokens * heads2), 0.0);
  std::vector<double> n(static_cast<size_t>(d_size)), dn(static_cast<size_t>(d_size));
  for (int64_t t = 0; t < c.tokens; ++t) {
    for (int64_t h2 = 0; h2 < heads2; ++h2) {
      const double* x = &qk[size_t((t * heads2 + h2) * d_size)];
      double squares = 0;
      for (int64_t d = 0; d < d_size; ++d) squares += x[d] * x[d];
      const double rstd = 1.0 / std::sqrt(squares / double(d_size) + 1.1920928955078125e-7);
      for (int64_t d = 0; d < d_size; ++d) n[size_t(d)] = x[d] * rstd;
      const int64_t h = h2 % c.heads;
      const bool key = h2 >= c.heads;
      int64_t out_token = t, out_head = h, offset = 0;
      if (c.paired) {
        const int64_t half = c.heads / 2;
        out_token = 2 * t + h / half;
        out_head = h % half;
        offset = (h % 2) * d_size;
      }
      const std::vector<double>& grad = key ? grad_k : grad_q;
      const double* g = &grad[size_t((out_token * c.out_heads() + out_head) * d_size)];
      const double* a = &f1[size_t(t * width + offset)];
      const double* b = &f2[size_t(t * width + offset)];
      for (int64_t d = 0; d < d_size; ++d) dn[size_t(d)] = a[d] * g[d] + b[d ^ 1] * g[d ^ 1];
      if (c.key_offset && key) {
        for (int64_t d = c.rotary_dim; d < d_size; ++d) {
          const double next = t + 1 < c.tokens ? grad[size_t(((t + 1) * c.out_heads() + h) * d_size + d)] : 0.0;
          dn[size_t(d)] = next + (t == 0 ? g[d] : 0.0);
        }
      }
      double dot = 0;
      for (int64_t d = 0; d < d_size; ++d) dot += dn[size_t(d)] * n[size_t(d)];
      double largest = 0;
      for (int64_t d = 0; d < d_size; ++d) {
        largest = std::max(largest, std::fabs(dn[size_t(d)]) + std::fabs(n[size_t(d)] * dot / double(d_size)));
      }
      const double value = rstd * largest;
      scale[size_t(t * heads2 + h2)] = std::isfinite(value) ? value : 0.0;
    }
  }
  return scale;
}

// ---- GPU vs CPU ------------------------------------------------------------------------------------

/// Element counts of one output compared GPU against CPU.
struct Tally {
  int64_t exact = 0, one_step = 0, in_noise = 0, unwritten = 0, bad = 0;
  std::string first_bad;
  std::string summary(const std::string& what) const {
    std::ostringstream out;
    out << what << ": " << exact << " exact, " << one_step << " by 1 step, " << in_noise
        << " in row noise, " << unwritten << " unwritten, " << bad << " bad";
    if (!first_bad.empty()) out << " (first: " << first_bad << ")";
    return out.str();
  }
};

/// bf16 outputs in rows of `row_length`, GPU against CPU (the rule of test_cuda_qk_norm_rope.cpp).
void compare_bf16_gpu(Findings& findings, const std::string& what, const std::vector<uint16_t>& gpu,
                      const std::vector<uint16_t>& cpu, int64_t row_length,
                      const std::vector<double>& term_scale = {}) {
  Tally tally;
  if (gpu.size() != cpu.size()) {
    findings.add(what + ": sizes differ");
    return;
  }
  for (size_t start = 0; start < cpu.size(); start += size_t(row_length)) {
    double row_max = 0;  // over finite values: an inf must match exactly, not widen the row
    for (size_t i = start; i < start + size_t(row_length); ++i) {
      const double v = std::fabs(double(bf16_to_float(cpu[i])));
      if (std::isfinite(v)) row_max = std::max(row_max, v);
    }
    if (!term_scale.empty()) row_max = std::max(row_max, term_scale[start / size_t(row_length)]);
    for (size_t i = start; i < start + size_t(row_length); ++i) {
      const uint16_t a = gpu[i], b = cpu[i];
      const double va = bf16_to_float(a), vb = bf16_to_float(b);
      bool ok = true;
      if (a == kPoisonBF16) {
        ++tally.unwritten;
        continue;
      } else if (bf16_nan(a) || bf16_nan(b)) {
        ok = bf16_nan(a) && bf16_nan(b);
        if (ok) ++tally.exact;
      } else if (a == b) {
        ++tally.exact;
      } else if (std::abs(bf16_order(a) - bf16_order(b)) <= 1) {
        ++tally.one_step;
      } else if (std::isfinite(va) && std::isfinite(vb) &&
                 std::fabs(va - vb) <= kRowNoise * row_max + std::fabs(vb) / 256) {
        ++tally.in_noise;
      } else {
        ok = false;
      }
      if (!ok && tally.bad++ == 0) {
        std::ostringstream out;
        out << "element " << i << " (row " << i / size_t(row_length) << ", col "
            << i % size_t(row_length) << "): gpu " << va << " (" << hex(a) << ") cpu " << vb
            << " (" << hex(b) << "), row max " << row_max;
        tally.first_bad = out.str();
      }
    }
  }
  if (tally.bad || tally.unwritten) findings.add(tally.summary(what + " [gpu vs cpu]"));
}

std::vector<double> feature_noise(const Case& c, const std::vector<double>& values,
                                  const std::vector<double>& term_scale);

/// For a zero grad_scale: which Q/K features of the float64 model are test::zero_scale_ambiguous
/// (NaN on one backend and +-448 on the other are both right there). Empty for any other scale.
std::vector<bool> zero_scale_ambiguity(const Case& c, const Inputs& in,
                                       const std::vector<double>& term_scale) {
  if (c.scales[0] != 0.0f) return {};
  const ref::Rope rope{c.tokens, c.heads, c.head_dim, c.rotary(), c.paired, c.key_offset};
  const std::vector<double> values = ref::qkv_backward_values(
      rope, c.v_dim, in.grad_q.get_values(), in.grad_k.get_values(), in.grad_v.get_values(),
      in.qk.get_values(), in.factor1.get_values(), in.factor2.get_values());
  const std::vector<double> noise = feature_noise(c, values, term_scale);
  std::vector<bool> ambiguous(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    ambiguous[i] = test::zero_scale_ambiguous(values[i], noise[i]);
  }
  return ambiguous;
}

/// qkv_backward_fp8's grad_row [T][qkv_dim], GPU against CPU (test_cuda_qkv_backward_fp8.cpp's
/// rule): V features exact, Q/K within one step or the row noise, NaN where the CPU has NaN
/// (or, for a zero scale, where zero_scale_ambiguity allows it).
void compare_grad_row_gpu(Findings& findings, const Case& c, const std::vector<uint8_t>& gpu,
                          const std::vector<uint8_t>& cpu, const std::vector<double>& term_scale,
                          const std::vector<bool>& ambiguous) {
  const double scale = std::fabs(double(c.scales[0]));
  const bool scale_usable = std::isfinite(scale) && scale > 0;
  Tally tally;
  const int64_t qk_features = 2 * c.heads * c.head_dim;
  const int64_t qkv = c.qkv_dim();
  for (int64_t t = 0; t < c.tokens; ++t) {
    for (int64_t row = 0; row < 3 * c.heads; ++row) {
      const bool qk_row = row < 2 * c.heads;
      const int64_t begin = qk_row ? row * c.head_dim : qk_features + (row - 2 * c.heads) * c.v_dim;
      const int64_t end = begin + (qk_row ? c.head_dim : c.v_dim);
      double row_max = 0;
      for (int64_t f = begin; f < end; ++f) {
        const double v = std::fabs(double(e4m3_to_float(cpu[size_t(t * qkv + f)])));
        if (std::isfinite(v)) row_max = std::max(row_max, v);
      }
      if (qk_row && scale_usable) {
        row_max = std::max(row_max, term_scale[size_t(t * 2 * c.heads + row)] / scale);
      }
      for (int64_t f = begin; f < end; ++f) {
        const size_t i = size_t(t * qkv + f);
        const uint8_t a = gpu[i], b = cpu[i];
        bool ok = true;
        if (a == kPoisonE4M3) {
          ++tally.unwritten;
          continue;
        } else if (qk_row && !ambiguous.empty() && ambiguous[i] &&
                   (e4m3_nan(a) || e4m3_nan(b)) && (a & 0x7f) >= 0x7e && (b & 0x7f) >= 0x7e) {
          ++tally.in_noise;  // zero scale: NaN against +-448 where the value is within noise of 0
        } else if (e4m3_nan(a) || e4m3_nan(b)) {
          ok = a == b;  // NaN is 0x7f, whatever the sign of the NaN it came from
          if (ok) ++tally.exact;
        } else if (a == b) {
          ++tally.exact;
        } else if (qk_row && std::abs(e4m3_order(a) - e4m3_order(b)) <= 1) {
          ++tally.one_step;
        } else if (qk_row && std::fabs(double(e4m3_to_float(a)) - double(e4m3_to_float(b))) <=
                                 kRowNoise * row_max + std::fabs(e4m3_to_float(b)) / 16 + 1.0 / 1024) {
          ++tally.in_noise;
        } else {
          ok = false;
        }
        if (!ok && tally.bad++ == 0) {
          std::ostringstream out;
          out << "token " << t << " feature " << f << (qk_row ? " (Q/K)" : " (V)") << ": gpu "
              << hex(a) << " cpu " << hex(b);
          tally.first_bad = out.str();
        }
      }
    }
  }
  if (tally.bad || tally.unwritten) findings.add(tally.summary("grad_row [gpu vs cpu]"));
}

void compare_bytes(Findings& findings, const std::string& what, const std::vector<uint8_t>& got,
                   const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) {
    findings.add(what + ": sizes differ");
    return;
  }
  int64_t differing = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      if (first < 0) first = int64_t(i);
      ++differing;
    }
  }
  if (differing) {
    findings.add(what + ": " + std::to_string(differing) + " of " + std::to_string(got.size()) +
                 " bytes differ (first at " + std::to_string(first) + ": got " +
                 hex(got[size_t(first)]) + ", expected " + hex(want[size_t(first)]) + ")");
  }
}

void compare_floats(Findings& findings, const std::string& what, const std::vector<float>& got,
                    const std::vector<float>& want) {
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    if (!same_float(got[i], want[i])) {
      std::ostringstream out;
      out.precision(9);
      out << what << "[" << i << "]: got " << got[i] << ", expected " << want[i]
          << (got[i] == kPoisonF32 ? " (unwritten)" : "");
      findings.add(out.str());
    }
  }
}

std::vector<uint8_t> transposed(const std::vector<uint8_t>& in, int64_t batch, int64_t rows,
                                int64_t cols) {
  std::vector<uint8_t> out(in.size());
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t base = b * rows * cols;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t col = 0; col < cols; ++col)
        out[size_t(base + col * rows + r)] = in[size_t(base + r * cols + col)];
  }
  return out;
}

void compare_gpu_cpu(Findings& findings, const Case& c, const Inputs& in,
                     const std::vector<Output>& gpu, const std::vector<Output>& cpu) {
  switch (c.op) {
    case Op::kRopeForward:
      for (const char* name : {"q", "k"}) {
        compare_bf16_gpu(findings, name, as_u16(find_output(gpu, name).bytes),
                         as_u16(find_output(cpu, name).bytes), c.head_dim);
      }
      return;
    case Op::kRopeBackward:
      compare_bf16_gpu(findings, "grad_qk", as_u16(find_output(gpu, "grad_qk").bytes),
                       as_u16(find_output(cpu, "grad_qk").bytes), c.head_dim,
                       backward_term_scale(c, in));
      return;
    case Op::kQkvBackwardFp8: {
      const std::vector<uint8_t>& row = find_output(gpu, "grad_row").bytes;
      const std::vector<double> term_scale = backward_term_scale(c, in);
      compare_grad_row_gpu(findings, c, row, find_output(cpu, "grad_row").bytes, term_scale,
                           zero_scale_ambiguity(c, in, term_scale));
      compare_bytes(findings, "grad_t [gpu] vs grad_row^T [gpu]", find_output(gpu, "grad_t").bytes,
                    transposed(row, 1, c.tokens, c.qkv_dim()));
      return;
    }
    case Op::kQuantize:
    case Op::kQuantizeBatched:
    case Op::kWeightBank:
      for (const char* name : {"row", "t"}) {
        compare_bytes(findings, std::string(name) + " [gpu vs cpu]", find_output(gpu, name).bytes,
                      find_output(cpu, name).bytes);
      }
      for (const char* name : {"amax", "scale"}) {
        for (const Output& out : gpu) {
          if (out.name == name) {
            compare_floats(findings, std::string(name) + " [gpu vs cpu]", as_f32(out.bytes),
                           as_f32(find_output(cpu, name).bytes));
          }
        }
      }
      return;
  }
}

// ---- CPU vs the float64 model ----------------------------------------------------------------------

/// relative * the largest finite |value| of each run of `row_length` values.
std::vector<double> finite_row_noise(const std::vector<double>& values, int64_t row_length,
                                     double relative) {
  std::vector<double> noise(values.size(), 0.0);
  for (size_t start = 0; start < values.size(); start += size_t(row_length)) {
    const size_t end = std::min(values.size(), start + size_t(row_length));
    double largest = 0;
    for (size_t i = start; i < end; ++i) {
      if (std::isfinite(values[i])) largest = std::max(largest, std::fabs(values[i]));
    }
    for (size_t i = start; i < end; ++i) noise[i] = relative * largest;
  }
  return noise;
}

/// Raises each row's noise to kRowNoise * the row's backward term scale.
void widen_by_terms(std::vector<double>& noise, const std::vector<double>& term_scale,
                    int64_t row_length) {
  for (size_t i = 0; i < noise.size(); ++i) {
    noise[i] = std::max(noise[i], kRowNoise * term_scale[i / size_t(row_length)]);
  }
}

/// The row noise of grad_row's Q/K features (per head row of D, widened to the backward's term
/// scale), 0 for V features.
std::vector<double> feature_noise(const Case& c, const std::vector<double>& values,
                                  const std::vector<double>& term_scale) {
  const int64_t qk_features = 2 * c.heads * c.head_dim;
  const int64_t qkv = c.qkv_dim();
  std::vector<double> noise(values.size(), 0.0);
  for (int64_t t = 0; t < c.tokens; ++t) {
    for (int64_t start = 0; start < qk_features; start += c.head_dim) {
      const size_t base = size_t(t * qkv + start);
      double largest = 0;
      for (int64_t d = 0; d < c.head_dim; ++d) {
        const double v = values[base + size_t(d)];
        if (std::isfinite(v)) largest = std::max(largest, std::fabs(v));
      }
      largest = std::max(largest, term_scale[size_t(t * 2 * c.heads + start / c.head_dim)]);
      for (int64_t d = 0; d < c.head_dim; ++d) noise[base + size_t(d)] = kRowNoise * largest;
    }
  }
  return noise;
}

void add_comparison(Findings& findings, const test::Comparison& comparison) {
  if (!comparison.ok()) findings.add(comparison.summary());
}

void check_poison_bf16(Findings& findings, const std::string& what, const std::vector<uint16_t>& got) {
  const auto count = std::count(got.begin(), got.end(), kPoisonBF16);
  if (count) {
    const auto first = std::find(got.begin(), got.end(), kPoisonBF16) - got.begin();
    findings.add(what + ": " + std::to_string(count) + " elements unwritten (poison), the first at element " +
                 std::to_string(first));
  }
}

void check_poison_e4m3(Findings& findings, const std::string& what, const std::vector<uint8_t>& got) {
  const auto count = std::count(got.begin(), got.end(), kPoisonE4M3);
  if (count) {
    const auto first = std::find(got.begin(), got.end(), kPoisonE4M3) - got.begin();
    findings.add(what + ": " + std::to_string(count) +
                 " codes are 0xff (unwritten; a NaN result is 0x7f), the first at element " +
                 std::to_string(first));
  }
}

void compare_cpu_model(Findings& findings, const Case& c, const Inputs& in,
                       const std::vector<Output>& cpu) {
  if (is_rope_op(c.op)) {
    const ref::Rope rope{c.tokens, c.heads, c.head_dim, c.rotary(), c.paired, c.key_offset};
    const std::vector<double> qk = in.qk.get_values();
    const std::vector<double> f1 = in.factor1.get_values();
    const std::vector<double> f2 = in.factor2.get_values();
    if (c.op == Op::kRopeForward) {
      const ref::QkPair expected = ref::rope_forward(rope, qk, f1, f2);
      for (const char* name : {"q", "k"}) {
        const std::vector<double>& values = name[0] == 'q' ? expected.q : expected.k;
        const std::vector<uint16_t> got = as_u16(find_output(cpu, name).bytes);
        check_poison_bf16(findings, name, got);
        add_comparison(findings, test::compare_bf16(std::string(name) + " [cpu vs model]", got, values,
                                                    finite_row_noise(values, c.head_dim, kRowNoise)));
      }
      return;
    }
    const std::vector<double> grad_q = in.grad_q.get_values();
    const std::vector<double> grad_k = in.grad_k.get_values();
    if (c.op == Op::kRopeBackward) {
      const std::vector<double> expected = ref::rope_backward(rope, grad_q, grad_k, qk, f1, f2);
      const std::vector<uint16_t> got = as_u16(find_output(cpu, "grad_qk").bytes);
      check_poison_bf16(findings, "grad_qk", got);
      std::vector<double> noise = finite_row_noise(expected, c.head_dim, kRowNoise);
      widen_by_terms(noise, backward_term_scale(c, in), c.head_dim);
      add_comparison(findings, test::compare_bf16("grad_qk [cpu vs model]", got, expected, noise));
      return;
    }
    const std::vector<double> values = ref::qkv_backward_values(
        rope, c.v_dim, grad_q, grad_k, in.grad_v.get_values(), qk, f1, f2);
    const std::vector<double> noise = feature_noise(c, values, backward_term_scale(c, in));
    const float scale = c.scales[0];
    const std::vector<uint8_t>& row = find_output(cpu, "grad_row").bytes;
    const std::vector<uint8_t>& t = find_output(cpu, "grad_t").bytes;
    check_poison_e4m3(findings, "grad_row", row);
    add_comparison(findings, test::compare_e4m3("grad_row [cpu vs model]", row, values, scale, noise));
    compare_bytes(findings, "grad_t vs grad_row^T", t, transposed(row, 1, c.tokens, c.qkv_dim()));
    // V features: no arithmetic but the fp32 division, so exact.
    const int64_t qk_features = 2 * c.heads * c.head_dim;
    int64_t v_bad = 0;
    for (int64_t token = 0; token < c.tokens; ++token) {
      for (int64_t f = qk_features; f < c.qkv_dim(); ++f) {
        const size_t i = size_t(token * c.qkv_dim() + f);
        v_bad += row[i] != ref::quantize_code(values[i], scale);
      }
    }
    if (v_bad) findings.add("grad_row: " + std::to_string(v_bad) + " V codes differ from e4m3(grad_v / grad_scale)");
    return;
  }

  // Quantize ops: bit-exact against the model, entry by entry.
  const std::vector<double> src = in.src.get_values();
  const int64_t entries = std::max<int64_t>(1, c.batch);
  const size_t entry_size = size_t(c.rows * c.cols);
  const std::vector<uint8_t>& row = find_output(cpu, "row").bytes;
  const std::vector<uint8_t>& t = find_output(cpu, "t").bytes;
  check_poison_e4m3(findings, "row", row);
  std::vector<uint8_t> want_row, want_t;
  std::vector<float> want_floats;  // amax or the weight-bank scales
  for (int64_t b = 0; b < entries; ++b) {
    const std::vector<double> entry(src.begin() + long(size_t(b) * entry_size),
                                    src.begin() + long(size_t(b + 1) * entry_size));
    const double amax = ref::amax(entry);
    float scale = 0;
    if (c.op == Op::kWeightBank) {
      scale = amax == 0 ? 1.0f : float(amax) / 448.0f;  // SPEC: amax / 448 in fp32, 1 for zeros
      want_floats.push_back(scale);
    } else {
      scale = c.scales[size_t(b)];
      want_floats.push_back(float(amax));
    }
    const ref::Quantized q = ref::quantize(entry, c.rows, c.cols, scale);
    want_row.insert(want_row.end(), q.row.begin(), q.row.end());
    want_t.insert(want_t.end(), q.t.begin(), q.t.end());
  }
  compare_bytes(findings, "row [cpu vs model]", row, want_row);
  compare_bytes(findings, "t [cpu vs model]", t, want_t);
  const bool empty = entry_size == 0;
  if (empty) {
    // An empty src is a no-op: amax and the bank's scales are not written.
    for (float& w : want_floats) w = kPoisonF32;
  }
  if (c.op == Op::kWeightBank) {
    compare_floats(findings, "scale [cpu vs model]", as_f32(find_output(cpu, "scale").bytes), want_floats);
  } else if (c.with_amax) {
    compare_floats(findings, "amax [cpu vs model]", as_f32(find_output(cpu, "amax").bytes), want_floats);
  }
}

// ---- one case --------------------------------------------------------------------------------------

struct Verdict {
  Findings findings;
  bool refused = false;         ///< the CUDA backend refused a case outside its domain (fine)
  bool accepted_outside = false;  ///< the CUDA backend computed a case outside its domain
  bool fatal = false;           ///< the CUDA context is unusable: stop
};

/// The public op name validation messages start with.
std::string message_prefix(Op op) {
  switch (op) {
    case Op::kQuantizeBatched: return "quantize_dual_layout:";
    default: return std::string(op_name(op)) + ":";
  }
}

Verdict check_case(const Case& c, bool cpu_only, bool self_check) {
  Verdict verdict;
  Findings& findings = verdict.findings;
  const Inputs in = make_inputs(c);

  std::vector<Output> cpu;
  {
    const std::unique_ptr<Memory> memory = make_cpu_memory();
    try {
      cpu = run_case(c, in, *memory);
    } catch (const std::exception& e) {
      findings.add(std::string("the CPU backend refused a valid case: ") + e.what());
      return verdict;
    }
    const std::string damaged = memory->damaged_guards();
    if (!damaged.empty()) findings.add("CPU backend wrote outside outputs: " + damaged);
  }
  if (cpu_only) {
    compare_cpu_model(findings, c, in, cpu);
    return verdict;
  }

  std::vector<Output> gpu;
  try {
    const std::unique_ptr<Memory> memory =
        self_check ? make_cpu_memory()
                   : make_gpu_memory(c.seed * 0x9e3779b97f4a7c15ull + uint64_t(c.index));
    gpu = run_case(c, in, *memory);
    const std::string damaged = memory->damaged_guards();
    if (!damaged.empty()) findings.add("CUDA backend wrote outside outputs (guard bytes overwritten): " + damaged);
  } catch (const Error& e) {
    const std::string message = e.what();
    const std::string state = self_check ? "" : gpu_error_state();
    if (!state.empty()) {
      findings.add("CUDA error state after the op threw: " + state + "; the op said: " + message);
      verdict.fatal = true;
    } else if (c.outside_cuda.empty()) {
      findings.add("the CUDA backend refused a case inside its documented domain: " + message);
    } else if (message.rfind(message_prefix(c.op), 0) != 0) {
      findings.add("the CUDA backend failed with an error that is not an argument check: " + message);
    } else {
      verdict.refused = true;
    }
    return verdict;
  } catch (const std::exception& e) {
    findings.add(std::string("CUDA run failed: ") + e.what());
    verdict.fatal = !self_check && !gpu_error_state().empty();
    return verdict;
  }
  verdict.accepted_outside = !c.outside_cuda.empty();
  compare_gpu_cpu(findings, c, in, gpu, cpu);
  return verdict;
}

// ---- driver ----------------------------------------------------------------------------------------

int usage(const char* message) {
  if (message) std::fprintf(stderr, "qkvfuse_fuzz: %s\n", message);
  std::fprintf(stderr,
               "usage: qkvfuse_fuzz [--cases N] [--seed S] [--case K] [--cpu-only] [--max-tokens M]\n"
               "  --cases N       number of cases (default 1000)\n"
               "  --seed S        seed (default: random, printed)\n"
               "  --case K        run only case K of the seed (replay)\n"
               "  --cpu-only      CPU backend vs the float64 model (default: CUDA vs CPU backend)\n"
               "  --max-tokens M  largest token count / matrix dimension drawn (default 100000)\n"
               "  --self-check    GPU mode's cases and comparisons with the CPU backend on both\n"
               "                  sides: checks the harness itself, needs no GPU\n");
  return 2;
}

bool parse_int(const char* text, int64_t& value) {
  char* end = nullptr;
  const long long parsed = std::strtoll(text, &end, 10);
  if (!end || *end != '\0' || end == text) return false;
  value = parsed;
  return true;
}

int run(int argc, char** argv) {
  Options options;
  bool seeded = false;
  bool self_check = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    int64_t value = 0;
    if (arg == "--cpu-only") {
      options.cpu_only = true;
    } else if (arg == "--self-check") {
      self_check = true;
    } else if (arg == "--help" || arg == "-h") {
      return usage(nullptr);
    } else if ((arg == "--cases" || arg == "--case" || arg == "--max-tokens") && has_value) {
      if (!parse_int(argv[++i], value) || value < 0) return usage(("bad value for " + arg).c_str());
      if (arg == "--cases") options.cases = value;
      if (arg == "--case") options.only_case = value;
      if (arg == "--max-tokens") options.max_tokens = std::max<int64_t>(1, value);
    } else if (arg == "--seed" && has_value) {
      char* end = nullptr;
      options.seed = std::strtoull(argv[++i], &end, 10);
      if (!end || *end != '\0') return usage("bad value for --seed");
      seeded = true;
    } else {
      return usage(("unknown argument " + arg).c_str());
    }
  }
  if (!seeded) options.seed = (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();

  std::string flags;
  if (options.cpu_only) flags += " --cpu-only";
  if (self_check) flags += " --self-check";
  if (options.max_tokens != 100000) flags += " --max-tokens " + std::to_string(options.max_tokens);
  const int64_t first = options.only_case >= 0 ? options.only_case : 0;
  const int64_t count = options.only_case >= 0 ? 1 : options.cases;
  if (options.only_case >= 0) {
    std::printf("seed %llu, replay with --seed %llu --case %lld%s\n", (unsigned long long)options.seed,
                (unsigned long long)options.seed, (long long)options.only_case, flags.c_str());
  } else {
    std::printf("seed %llu, replay with --seed %llu --cases %lld%s\n", (unsigned long long)options.seed,
                (unsigned long long)options.seed, (long long)options.cases, flags.c_str());
  }
  if (options.cpu_only) {
    std::printf("mode: CPU backend vs the float64 model (tests/reference.hpp)\n");
  } else if (self_check) {
    std::printf("mode: self-check: GPU mode's cases and comparisons, the CPU backend on both sides\n");
  } else {
    const std::string reason = gpu_unavailable_reason();
    if (!reason.empty()) {
      std::printf("SKIP: GPU mode needs a CUDA device: %s (--cpu-only runs the CPU backend "
                  "against the float64 model)\n", reason.c_str());
      std::fflush(stdout);
      return 77;
    }
    std::printf("mode: CUDA backend on %s vs the CPU backend\n", gpu_name().c_str());
  }
  std::fflush(stdout);

  const auto start = std::chrono::steady_clock::now();
  const auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  int64_t done = 0, mismatches = 0, refused = 0, accepted_outside = 0, with_specials = 0;
  int64_t per_op[6] = {};
  int64_t rope_vector = 0, rope_generic = 0;  // by Case::vector_path
  for (int64_t k = first; k < first + count; ++k) {
    const Case c = draw_case(options, k);
    ++per_op[int(c.op)];
    with_specials += c.specials != 0;
    if (is_rope_op(c.op)) ++(c.vector_path ? rope_vector : rope_generic);
    Verdict verdict;
    try {
      verdict = check_case(c, options.cpu_only, self_check);
    } catch (const std::exception& e) {
      verdict.findings.add(std::string("the harness failed: ") + e.what());
    }
    ++done;
    refused += verdict.refused;
    accepted_outside += verdict.accepted_outside;
    if (!verdict.findings.clean()) {
      ++mismatches;
      std::printf("MISMATCH %s\n", c.describe().c_str());
      for (const std::string& line : verdict.findings.lines) std::printf("    %s\n", line.c_str());
      std::printf("    replay: qkvfuse_fuzz --seed %llu --case %lld%s\n",
                  (unsigned long long)options.seed, (long long)k, flags.c_str());
      std::fflush(stdout);
    }
    if (verdict.fatal) {
      std::printf("stopping: the CUDA context is unusable after case %lld\n", (long long)k);
      break;
    }
    if (done % 1000 == 0) {
      std::printf("progress: %lld/%lld cases, %lld mismatches, %.1f s\n", (long long)done,
                  (long long)count, (long long)mismatches, seconds());
      std::fflush(stdout);
    }
  }
  std::printf("cases by op:");
  for (int op = 0; op < 6; ++op) std::printf(" %s %lld;", op_name(Op(op)), (long long)per_op[op]);
  std::printf(" with special values %lld", (long long)with_specials);
  if (!options.cpu_only) {
    std::printf("; rope ops on the CUDA vector path %lld, generic path %lld", (long long)rope_vector,
                (long long)rope_generic);
    std::printf("; outside the CUDA domain: %lld refused, %lld computed", (long long)refused,
                (long long)accepted_outside);
  }
  std::printf("; %.1f s\n", seconds());
  std::printf("fuzz: %lld cases, %lld mismatches\n", (long long)done, (long long)mismatches);
  std::printf("%lld passed, %lld failed\n", (long long)(done - mismatches), (long long)mismatches);
  return mismatches || done < count ? 1 : 0;
}

}  // namespace
}  // namespace qkvfuse::fuzz

int main(int argc, char** argv) { return qkvfuse::fuzz::run(argc, argv); }
