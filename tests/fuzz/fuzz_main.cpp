// fuzz_main.cpp: qkvfuse_fuzz, random cases through the public API, every one checked.
//
//   qkvfuse_fuzz [--cases N] [--seed S] [--case K] [--cpu-only] [--max-tokens M]
//
// Each case draws an op (qk_norm_rope forward and backward, qkv_backward_fp8, the packed op's
// forward and backward, quantize_dual_layout plain with or without amax and batched,
// quantize_weight_bank) and, for the ops that take a RopeLayout, every option of SPEC.md
// section 8: heads (Hq 1..32, Hkv = Hq, a proper divisor, or 1; num_kv_heads given as 0 at times),
// a mode (plain, paired, key offset), the rotary style (interleaved or NeoX), its width r (D, any
// even part of D, 0, the edges; rotary_dim = -1 at times), the norm (none, RMS, RMS * w with either
// weight or both in bf16 or float32, with an offset of 1 (Gemma) or another), eps (2^-23, 1e-6,
// 1e-5, anything in [1e-12, 1]), the angles (bf16 / float32 factor tables whose lanes >= r hold
// junk or NaN; or a bf16 / float32 cos/sin cache at int32 / int64 positions, random or packed
// documents, now and then out of range), shapes (D any even width in [2, 256], Dv in [1, 512] in
// GPU mode (in [1, 256] in CPU-only mode), token counts from 0 to --max-tokens), strides (padded
// heads and rows, column slices of wider buffers, strided positions, offsets), scales (1/448,
// powers of two, 1e-4, 1, arbitrary, and rarely 0, inf, NaN, negative) and special input values
// (NaN, inf, values far beyond e4m3's range, zero rows, subnormals; in the angles too). The norm
// weights' gradients are asked for exactly when the weights are given, with the workspace
// backward_workspace_size asks for. Case K of seed S depends on nothing else, so
// `--seed S --case K` replays it alone.
//
// The rope ops' CUDA backend reads with 16-byte vectors where the arguments allow (D a multiple of
// 8 from 32, NeoX r a multiple of 16, a cache with interleaved lanes r a multiple of 8; Dv a
// multiple of 8 up to 256; every pointer and stride but the last a multiple of 16 bytes) and with
// narrower accesses for the rest. GPU mode keeps about 60 % of head widths on the vector widths
// (and 70 % of the V widths), and in about 20 % of rope cases gives some of the tensors, and the
// outputs, odd pads and offsets (pointers aligned to their elements only), one tensor at a time or
// several. Each case's description says which access the rule picks, and the summary counts them.
//
// GPU mode (default): the CUDA backend against the CPU backend on the same inputs, with the GPU
// tests' tolerances:
//   - bf16 outputs: bit-identical, one ulp apart, or (where the row's fp32 sums may legitimately
//     round differently) within 2^-18 of the row's largest finite value plus 2^-8 of the value;
//   - e4m3 outputs of qkv_backward_fp8: V features bit-identical; Q/K features within one e4m3
//     step, or within the same row noise; grad_t exactly grad_row transposed;
//   - the norm weights' gradients: within twice a float32 sum's error of each other (both are
//     within one of the exact sum; test::fp32_sum_tolerance), plus one ulp for bf16 weights;
//   - the packed op, stage by stage: qkv within 2^-6 of max(|cpu|, rms) (the GPU's fast
//     accumulation), q and k against the CPU's qk_norm_rope of the GPU's own qk, grad_row as
//     qkv_backward_fp8's, the weight gradient, grad_x and grad_qkv_scale against float64 GEMMs
//     of the GPU's own grad_t and grad_row;
//   - quantize outputs, amax and weight-bank scales: bit-identical;
//   - NaN exactly where the CPU has NaN; outputs are poisoned (bf16 0x7fc1, e4m3 0xff, float
//     -1234.5: values no computation produces) and guarded, so unwritten elements and writes out
//     of bounds are caught.
// With QKVFUSE_CUDA_SECTION9=1 in the environment (the CUDA backend's switch for SPEC.md section
// 9's untested kernels) GPU mode draws section 9's options inside the CUDA rules too: D up to 512,
// the token-wide norm, the V norm, query-only calls, no angles (the summary counts them).
// About 3% of GPU cases are drawn outside the CUDA rules: quantize sources with misaligned strides
// and, for qkv_backward_fp8, half the time Dv in [513, 1024], the rest of the rope cases as for
// the CPU (which CUDA now takes too). Cases outside the CUDA backend's documented domain must be
// refused with a qkvfuse::Error from the op's argument checks, or else computed correctly; cases
// inside it must be computed.
//
// CPU-only mode (--cpu-only): the CPU backend against the float64 model of tests/reference.hpp
// with the CPU tests' tolerances (bf16 within one ulp of the rounded model, or its row's fp32
// noise; e4m3 within one step; the norm weights' gradients within a float32 sum's error of the
// exact sums; the packed op stage by stage against float64 GEMMs of its own intermediate
// results; quantize bit-exact).
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
#include "validate.hpp"

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

bool e4m3_nan(uint8_t code) { return (code & 0x7f) == 0x7f; }
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

// ---- the float64 model of a case ---------------------------------------------------------------------

ref::Rope model_rope(const Case& c) {
  ref::Rope rope{c.tokens, c.heads, c.head_dim, c.rotary_dim, c.paired, c.key_offset};
  rope.kv_heads = c.kv_heads;
  rope.neox = c.neox;
  rope.normalize = c.normalize;
  rope.eps = double(c.eps);
  rope.weight_offset = double(c.weight_offset);
  rope.token_norm = c.token_norm;
  rope.query_only = c.query_only;
  rope.normalize_v = c.normalize_v;
  rope.angles = c.angles;
  return rope;
}

ref::RopeTensors model_tensors(const Case& c, const Inputs& in) {
  ref::RopeTensors tensors;
  tensors.cache = c.cache;
  if (!c.angles) {
    // No angle source (SPEC.md section 9): the model's rope.angles says so.
  } else if (c.cache) {
    tensors.cache_rows = c.cache_rows;
    tensors.cos_sin = in.cos_sin.get_values();
    tensors.positions = in.positions.get_ints();
  } else {
    tensors.factor1 = in.factor1.get_values();
    tensors.factor2 = in.factor2.get_values();
  }
  if (c.q_weight) tensors.q_weight = in.q_weight.get_values();
  if (c.k_weight) tensors.k_weight = in.k_weight.get_values();
  return tensors;
}

/// The relative row noise of a case's rope rows: kRowNoise, grown with the square root of the
/// values one RMS sums beyond 256 (a token-wide norm sums thousands, D up to 512): the rounding
/// of that sum moves the whole row.
double row_noise_of(const Case& c) {
  const int64_t values = c.token_norm ? std::max(c.heads, c.kv_heads) * c.head_dim : c.head_dim;
  return kRowNoise * std::max(1.0, std::sqrt(double(values) / 256.0));
}

/// The same for the V norm's rows of Dv values.
double v_row_noise_of(const Case& c) {
  return kRowNoise * std::max(1.0, std::sqrt(double(c.v_dim) / 256.0));
}

/// The V norm's gradient of a case (its input v and the gradient grad_v of v_out).
ref::VNormGradients model_v_gradients(const Case& c, const Inputs& in) {
  return ref::v_norm_gradients(c.tokens * c.kv_heads, c.v_dim, double(c.eps), in.v.get_values(),
                               in.grad_v.get_values());
}

/// grad_row's values before the e4m3 cast (ref::qkv_backward_values of the case's inputs).
std::vector<double> model_grad_row_values(const Case& c, const Inputs& in) {
  return ref::qkv_backward_values(model_rope(c), c.v_dim, in.grad_q.get_values(),
                                  in.grad_k.get_values(), in.grad_v.get_values(),
                                  in.qk.get_values(), model_tensors(c, in),
                                  c.normalize_v ? in.v.get_values() : std::vector<double>{});
}

/// The model's gradients of a backward case (its term scales: the rounding scale of dx per input
/// row, see ref::RopeGradients; and the weight gradients with their magnitudes).
ref::RopeGradients model_gradients(const Case& c, const Inputs& in) {
  return ref::rope_gradients(model_rope(c), in.grad_q.get_values(), in.grad_k.get_values(),
                             in.qk.get_values(), model_tensors(c, in));
}

// ---- GPU vs CPU ------------------------------------------------------------------------------------

/// The summary of one output compared GPU against CPU (its element counts; what and count unused).
std::string tally_summary(const test::Comparison& tally, const std::string& what) {
  std::ostringstream out;
  out << what << ": " << tally.exact << " exact, " << tally.one_step << " by 1 step, "
      << tally.in_noise << " in row noise, " << tally.unwritten << " unwritten, " << tally.bad
      << " bad";
  if (!tally.first_bad.empty()) out << " (first: " << tally.first_bad << ")";
  return out.str();
}

/// bf16 outputs in rows of `row_length`, GPU against CPU (the rule of test_cuda_qk_norm_rope.cpp,
/// test::compare_bf16_gpu_cpu within kRowNoise).
void compare_bf16_gpu(Findings& findings, const std::string& what, const std::vector<uint16_t>& gpu,
                      const std::vector<uint16_t>& cpu, int64_t row_length,
                      const std::vector<double>& term_scale = {}) {
  if (gpu.size() != cpu.size()) {
    findings.add(what + ": sizes differ");
    return;
  }
  const test::Comparison tally =
      test::compare_bf16_gpu_cpu(what, gpu, cpu, row_length, kRowNoise, term_scale);
  if (tally.bad || tally.unwritten) findings.add(tally_summary(tally, what + " [gpu vs cpu]"));
}

std::vector<double> feature_noise(const Case& c, const std::vector<double>& values,
                                  const std::vector<double>& term_scale,
                                  const std::vector<double>& v_term_scale = {});

/// For a zero grad_scale: which Q/K features of the float64 model are test::zero_scale_ambiguous
/// (NaN on one backend and +-448 on the other are both right there). Empty for any other scale.
std::vector<bool> zero_scale_ambiguity(const Case& c, const Inputs& in,
                                       const std::vector<double>& term_scale) {
  if (c.scales[0] != 0.0f) return {};
  const std::vector<double> values = model_grad_row_values(c, in);
  const std::vector<double> noise = feature_noise(c, values, term_scale);
  std::vector<bool> ambiguous(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    ambiguous[i] = test::zero_scale_ambiguous(values[i], noise[i]);
  }
  return ambiguous;
}

/// grad_row [T][qkv_dim], GPU against CPU (test_cuda_qkv_backward_fp8.cpp's rule): V features
/// exact (computed ones, under the V norm, as Q/K), Q/K within one step or the row noise, NaN
/// where the CPU has NaN (or, for a zero scale, where zero_scale_ambiguity allows it).
void compare_grad_row_gpu(Findings& findings, const Case& c, const std::vector<uint8_t>& gpu,
                          const std::vector<uint8_t>& cpu, const std::vector<double>& term_scale,
                          const std::vector<bool>& ambiguous) {
  const double scale = std::fabs(double(c.scales[0]));
  const bool scale_usable = std::isfinite(scale) && scale > 0;
  test::Comparison tally;
  const int64_t qk_rows = c.input_heads();
  const int64_t qk_features = c.qk_features();
  const int64_t qkv = c.qkv_dim();
  for (int64_t t = 0; t < c.tokens; ++t) {
    for (int64_t row = 0; row < qk_rows + c.kv_heads; ++row) {
      // Rows the backward computes: Q/K, and V under the V norm (its rows' term scale is not
      // tracked here: their row noise covers them).
      const bool term_row = row < qk_rows;
      const bool qk_row = term_row || c.normalize_v;
      const int64_t begin = term_row ? row * c.head_dim : qk_features + (row - qk_rows) * c.v_dim;
      const int64_t end = begin + (term_row ? c.head_dim : c.v_dim);
      double row_max = 0;
      for (int64_t f = begin; f < end; ++f) {
        const double v = std::fabs(double(e4m3_to_float(cpu[size_t(t * qkv + f)])));
        if (std::isfinite(v)) row_max = std::max(row_max, v);
      }
      if (term_row && scale_usable) {
        row_max = std::max(row_max, term_scale[size_t(t * qk_rows + row)] / scale);
      }
      for (int64_t f = begin; f < end; ++f) {
        const size_t i = size_t(t * qkv + f);
        const uint8_t a = gpu[i], b = cpu[i];
        bool ok = true;
        if (a == kPoisonE4M3) {
          ++tally.unwritten;
          continue;
        } else if (term_row && !ambiguous.empty() && ambiguous[i] &&
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
  if (tally.bad || tally.unwritten) findings.add(tally_summary(tally, "grad_row [gpu vs cpu]"));
}

/// The values of a float output's bytes (bf16 or float32).
std::vector<double> float_values(const Output& out) {
  std::vector<double> values;
  if (out.dtype == DType::kFloat32) {
    for (float v : as_f32(out.bytes)) values.push_back(v);
  } else {
    for (uint16_t v : as_u16(out.bytes)) values.push_back(bf16_to_float(v));
  }
  return values;
}

/// The tolerance of a weight gradient against the exact sum: a float32 sum of the model's terms,
/// each carrying n, whose rstd sums the RMS's squares (row_noise_of's share of each term).
std::vector<double> weight_tolerance(const Case& c, const ref::RopeGradients& model, int kind) {
  const std::vector<double>& magnitude = kind ? model.k_weight_magnitude : model.q_weight_magnitude;
  std::vector<double> tolerance =
      test::fp32_sum_tolerance(magnitude, kind ? model.k_weight_terms : model.q_weight_terms);
  const double norm_noise = row_noise_of(c) / kRowNoise * std::ldexp(1.0, -20);
  for (size_t i = 0; i < tolerance.size(); ++i) tolerance[i] += norm_noise * magnitude[i];
  return tolerance;
}

/// The norm weights' gradients GPU against CPU: both within a float32 sum's error of the exact
/// value, so within twice that of each other (plus one ulp of a bf16 weight's rounding).
void compare_weight_grads_gpu(Findings& findings, const Case& c, const std::vector<Output>& gpu,
                              const std::vector<Output>& cpu, const ref::RopeGradients& model) {
  for (int kind = 0; kind < 2; ++kind) {
    if (!(kind ? c.k_weight : c.q_weight)) continue;
    const std::string name = kind ? "grad_k_weight" : "grad_q_weight";
    const Output& g = find_output(gpu, name);
    const Output& h = find_output(cpu, name);
    const std::vector<double> a = float_values(g), b = float_values(h);
    const std::vector<double> tolerance = weight_tolerance(c, model, kind);
    for (size_t d = 0; d < a.size(); ++d) {
      const bool bf16 = c.weight_dtype == DType::kBFloat16;
      const bool unwritten = bf16 ? as_u16(g.bytes)[d] == kPoisonBF16 : as_f32(g.bytes)[d] == kPoisonF32;
      const double ulp = bf16 ? std::ldexp(std::fabs(b[d]), -7) : 0.0;
      const bool ok = !unwritten && ((std::isnan(a[d]) && std::isnan(b[d])) || a[d] == b[d] ||
                                     std::fabs(a[d] - b[d]) <= 2 * tolerance[d] + ulp);
      if (!ok) {
        std::ostringstream out;
        out.precision(9);
        out << name << "[" << d << "] [gpu vs cpu]: gpu " << a[d] << (unwritten ? " (unwritten)" : "")
            << ", cpu " << b[d] << ", tolerance " << 2 * tolerance[d] + ulp;
        findings.add(out.str());
        return;
      }
    }
  }
}

/// A GEMM output (or a value derived from one) against a reference: |got - want| within
/// 2^-6 * max(|want|, rms(want)) elementwise (two bf16 ulps, or the scale of the tensor where an
/// element cancels), as test_cuda_packed_qkv.cpp judges the GPU's fast-accumulating GEMMs.
void compare_gemm(Findings& findings, const std::string& what, const std::vector<double>& got,
                  const std::vector<double>& want) {
  if (got.size() != want.size()) {
    findings.add(what + ": sizes differ");
    return;
  }
  double squares = 0;
  for (double v : want) squares += v * v;
  const double rms = want.empty() ? 0.0 : std::sqrt(squares / double(want.size()));
  int64_t bad = 0;
  std::string first;
  for (size_t i = 0; i < want.size(); ++i) {
    const bool ok = (std::isnan(got[i]) && std::isnan(want[i])) ||
                    std::fabs(got[i] - want[i]) <= std::ldexp(std::max(std::fabs(want[i]), rms), -6);
    if (!ok && bad++ == 0) {
      std::ostringstream out;
      out.precision(9);
      out << "element " << i << ": got " << got[i] << ", expected " << want[i] << " (rms " << rms << ")";
      first = out.str();
    }
  }
  if (bad) findings.add(what + ": " + std::to_string(bad) + " elements off (first: " + first + ")");
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

// ---- the packed op's stages --------------------------------------------------------------------------

/// The packed forward's qkv [T][qkv_dim] as bf16 bits, from its joined or separate outputs.
std::vector<uint16_t> packed_qkv_bits(const Case& c, const std::vector<Output>& outputs) {
  if (c.joined_qkv) return as_u16(find_output(outputs, "qkv").bytes);
  const std::vector<uint16_t> qk = as_u16(find_output(outputs, "qk").bytes);
  const std::vector<uint16_t> v = as_u16(find_output(outputs, "v").bytes);
  const int64_t QK = c.qk_features(), V = c.kv_heads * c.v_dim;
  std::vector<uint16_t> qkv;
  for (int64_t t = 0; t < c.tokens; ++t) {
    qkv.insert(qkv.end(), qk.begin() + t * QK, qk.begin() + (t + 1) * QK);
    qkv.insert(qkv.end(), v.begin() + t * V, v.begin() + (t + 1) * V);
  }
  return qkv;
}

/// The projection's weight gradient [qkv_dim][C] as bf16 bits, joined or separate.
std::vector<uint16_t> packed_weight_grad_bits(const Case& c, const std::vector<Output>& outputs) {
  if (c.joined_weight_grads) return as_u16(find_output(outputs, "grad_weight").bytes);
  std::vector<uint16_t> all = as_u16(find_output(outputs, "grad_qk_weight").bytes);
  const std::vector<uint16_t> v = as_u16(find_output(outputs, "grad_v_weight").bytes);
  all.insert(all.end(), v.begin(), v.end());
  return all;
}

/// The CPU backend's qk_norm_rope of a given qk [T][Hq+Hkv][D] (bf16 bits) with the case's layout:
/// the forward's rope step judged on the qk that the op itself produced.
std::vector<Output> cpu_rope_of(const Case& c, const Inputs& in, const std::vector<uint16_t>& qk_bits) {
  Case rope_case = c;
  rope_case.op = Op::kRopeForward;
  rope_case.out_offset = 0;
  rope_case.qk = Placement{{c.tokens, c.input_heads(), c.head_dim}, {}, 0};
  Inputs rope_in = in;
  rope_in.qk = HostBuffer(DType::kBFloat16, rope_case.qk);
  std::vector<uint16_t> dense(qk_bits.size() / size_t(std::max<int64_t>(1, c.qkv_dim())) *
                              size_t(c.qk_features()));
  dense.clear();
  const int64_t F = c.qkv_dim(), QK = c.qk_features();
  for (int64_t t = 0; t < c.tokens; ++t) {
    dense.insert(dense.end(), qk_bits.begin() + t * F, qk_bits.begin() + t * F + QK);
  }
  rope_in.qk.set_bf16(dense);
  if (c.normalize_v) {
    // The V norm's input is the GEMM's raw V, the same columns of the GPU's output.
    rope_case.v_in = Placement{{c.tokens, c.kv_heads, c.v_dim}, {}, 0};
    rope_in.v = HostBuffer(DType::kBFloat16, rope_case.v_in);
    std::vector<uint16_t> v;
    for (int64_t t = 0; t < c.tokens; ++t) {
      v.insert(v.end(), qk_bits.begin() + t * F + QK, qk_bits.begin() + (t + 1) * F);
    }
    rope_in.v.set_bf16(v);
  }
  const std::unique_ptr<Memory> memory = make_cpu_memory();
  return run_case(rope_case, rope_in, *memory);
}

/// The packed backward's GEMM stages from its own FP8 gradient (bf16-rounded unscaled weight
/// gradient, then the scaled one and grad_qkv_scale; grad_x), in float64.
struct PackedGemms {
  std::vector<double> grad_weight;  ///< [qkv_dim][C], unrounded (the op rounds it to bf16)
  double grad_qkv_scale = 0;
  double grad_qkv_scale_scale = 0;  ///< sqrt(sum (g * w)^2): the dot product's scale
  std::vector<double> grad_x;       ///< [T][C], unrounded
};

PackedGemms packed_gemms(const Case& c, const Inputs& in, const std::vector<uint8_t>& grad_row,
                         const std::vector<uint8_t>& grad_t) {
  const int64_t T = c.tokens, C = c.channels, F = c.qkv_dim();
  const float grad_scale = c.scales[0];
  PackedGemms out;
  const std::vector<double> unscaled = ref::gemm(grad_t, in.x_f8_t.get_codes(), F, C, T,
                                                 double(grad_scale) * double(c.x_scale));
  std::vector<double> unscaled_bf16(unscaled.size());
  for (size_t i = 0; i < unscaled.size(); ++i) unscaled_bf16[i] = ref::round_bf16(unscaled[i]);
  std::vector<double> weights = in.qk_weight.get_values();
  const std::vector<double> v_weights = in.v_weight.get_values();
  weights.insert(weights.end(), v_weights.begin(), v_weights.end());
  const ref::WeightGrads w = ref::packed_weight_grads(unscaled_bf16, weights, c.qkv_scale);
  out.grad_weight = w.grad_weight;
  out.grad_qkv_scale = w.grad_qkv_scale;
  double squares = 0;
  for (size_t i = 0; i < weights.size(); ++i) squares += std::pow(unscaled_bf16[i] * weights[i], 2);
  out.grad_qkv_scale_scale = std::sqrt(squares);
  out.grad_x = ref::gemm(grad_row, in.weight_f8_t.get_codes(), T, C, F,
                         double(grad_scale) * double(c.weight_scale) * double(c.qkv_scale));
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
      if (c.normalize_v) {
        compare_bf16_gpu(findings, "v_out", as_u16(find_output(gpu, "v_out").bytes),
                         as_u16(find_output(cpu, "v_out").bytes), c.v_dim);
      }
      return;
    case Op::kRopeBackward: {
      const ref::RopeGradients model = model_gradients(c, in);
      compare_bf16_gpu(findings, "grad_qk", as_u16(find_output(gpu, "grad_qk").bytes),
                       as_u16(find_output(cpu, "grad_qk").bytes), c.head_dim, model.term_scale);
      compare_weight_grads_gpu(findings, c, gpu, cpu, model);
      if (c.normalize_v) {
        compare_bf16_gpu(findings, "grad_v", as_u16(find_output(gpu, "grad_v").bytes),
                         as_u16(find_output(cpu, "grad_v").bytes), c.v_dim,
                         model_v_gradients(c, in).term_scale);
      }
      return;
    }
    case Op::kQkvBackwardFp8: {
      const ref::RopeGradients model = model_gradients(c, in);
      const std::vector<uint8_t>& row = find_output(gpu, "grad_row").bytes;
      compare_grad_row_gpu(findings, c, row, find_output(cpu, "grad_row").bytes, model.term_scale,
                           zero_scale_ambiguity(c, in, model.term_scale));
      compare_bytes(findings, "grad_t [gpu] vs grad_row^T [gpu]", find_output(gpu, "grad_t").bytes,
                    transposed(row, 1, c.tokens, c.qkv_dim()));
      compare_weight_grads_gpu(findings, c, gpu, cpu, model);
      return;
    }
    case Op::kPacked: {
      if (c.tokens == 0) {
        // Nothing but the norm weights' gradients (zeros) is written, on either backend.
        for (const Output& out : cpu) {
          if (out.name == "workspace") continue;
          compare_bytes(findings, out.name + " [gpu vs cpu, T = 0]", find_output(gpu, out.name).bytes,
                        out.bytes);
        }
        return;
      }
      const ref::RopeGradients model = model_gradients(c, in);
      // Forward: the GEMM within its accumulation error, the rope step on the GPU's own qk.
      const std::vector<uint16_t> qkv_gpu = packed_qkv_bits(c, gpu), qkv_cpu = packed_qkv_bits(c, cpu);
      std::vector<double> a, b;
      for (uint16_t v : qkv_gpu) a.push_back(bf16_to_float(v));
      for (uint16_t v : qkv_cpu) b.push_back(bf16_to_float(v));
      compare_gemm(findings, "qkv [gpu vs cpu]", a, b);
      const std::vector<Output> rope = cpu_rope_of(c, in, qkv_gpu);
      for (const char* name : {"q", "k"}) {
        compare_bf16_gpu(findings, std::string(name) + " (on the GPU's qk)",
                         as_u16(find_output(gpu, name).bytes), as_u16(find_output(rope, name).bytes),
                         c.head_dim);
      }
      if (c.normalize_v) {
        compare_bf16_gpu(findings, "v_out (on the GPU's v)", as_u16(find_output(gpu, "v_out").bytes),
                         as_u16(find_output(rope, "v_out").bytes), c.v_dim);
      }
      // Backward: the FP8 gradient from identical inputs, the GEMMs from the GPU's own gradient.
      const std::vector<uint8_t>& row = find_output(gpu, "grad_row").bytes;
      const std::vector<uint8_t>& t = find_output(gpu, "grad_t").bytes;
      compare_grad_row_gpu(findings, c, row, find_output(cpu, "grad_row").bytes, model.term_scale, {});
      compare_bytes(findings, "grad_t [gpu] vs grad_row^T [gpu]", t,
                    transposed(row, 1, c.tokens, c.qkv_dim()));
      compare_weight_grads_gpu(findings, c, gpu, cpu, model);
      const PackedGemms want = packed_gemms(c, in, row, t);
      std::vector<double> grad_weight;
      for (uint16_t v : packed_weight_grad_bits(c, gpu)) grad_weight.push_back(bf16_to_float(v));
      compare_gemm(findings, "grad_qk_weight; grad_v_weight [gpu vs its grad_t]", grad_weight,
                   want.grad_weight);
      std::vector<double> grad_x;
      for (uint16_t v : as_u16(find_output(gpu, "grad_x").bytes)) grad_x.push_back(bf16_to_float(v));
      compare_gemm(findings, "grad_x [gpu vs its grad_row]", grad_x, want.grad_x);
      const double scale = as_f32(find_output(gpu, "grad_qkv_scale").bytes)[0];
      const bool both_nan = std::isnan(scale) && std::isnan(want.grad_qkv_scale);
      if (!both_nan &&
          !(std::fabs(scale - want.grad_qkv_scale) <= 1e-2 * want.grad_qkv_scale_scale + 1e-30)) {
        std::ostringstream out;
        out.precision(9);
        out << "grad_qkv_scale [gpu vs its grad_t]: got " << scale << ", expected "
            << want.grad_qkv_scale << " (scale " << want.grad_qkv_scale_scale << ")";
        findings.add(out.str());
      }
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

/// The row noise of grad_row's Q/K features (per head row of D, widened to the backward's term
/// scale), 0 for V features.
std::vector<double> feature_noise(const Case& c, const std::vector<double>& values,
                                  const std::vector<double>& term_scale,
                                  const std::vector<double>& v_term_scale) {
  return test::qkv_feature_noise(model_rope(c), c.v_dim, values,
                                 std::max(row_noise_of(c), v_row_noise_of(c)), term_scale,
                                 v_term_scale);
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

/// The norm weights' gradients against the model's exact sums (a float32 sum's tolerance, plus
/// one ulp for bf16 weights).
void compare_weight_grads_model(Findings& findings, const Case& c, const std::vector<Output>& cpu,
                                const ref::RopeGradients& model) {
  for (int kind = 0; kind < 2; ++kind) {
    if (!(kind ? c.k_weight : c.q_weight)) continue;
    const std::string name = kind ? "grad_k_weight" : "grad_q_weight";
    const Output& out = find_output(cpu, name);
    const std::vector<double>& want = kind ? model.grad_k_weight : model.grad_q_weight;
    const std::vector<double> tolerance = weight_tolerance(c, model, kind);
    if (c.weight_dtype == DType::kBFloat16) {
      add_comparison(findings, test::compare_bf16(name + " [cpu vs model]", as_u16(out.bytes), want,
                                                  tolerance));
    } else {
      add_comparison(findings, test::compare_close(name + " [cpu vs model]", float_values(out), want,
                                                   tolerance));
    }
  }
}

/// grad_row against the model's values: codes within one e4m3 step (or the row noise), V codes
/// exact, grad_t the transpose.
void compare_grad_row_model(Findings& findings, const Case& c, const Inputs& in,
                            const std::vector<Output>& cpu, const ref::RopeGradients& model) {
  const std::vector<double> values = model_grad_row_values(c, in);
  const std::vector<double> noise = feature_noise(
      c, values, model.term_scale,
      c.normalize_v ? model_v_gradients(c, in).term_scale : std::vector<double>{});
  const float scale = c.scales[0];
  const std::vector<uint8_t>& row = find_output(cpu, "grad_row").bytes;
  const std::vector<uint8_t>& t = find_output(cpu, "grad_t").bytes;
  check_poison_e4m3(findings, "grad_row", row);
  add_comparison(findings, test::compare_e4m3("grad_row [cpu vs model]", row, values, scale, noise));
  compare_bytes(findings, "grad_t vs grad_row^T", t, transposed(row, 1, c.tokens, c.qkv_dim()));
  // V features: no arithmetic but the fp32 division, so exact (the V norm's are computed).
  if (c.normalize_v) return;
  int64_t v_bad = 0;
  for (int64_t token = 0; token < c.tokens; ++token) {
    for (int64_t f = c.qk_features(); f < c.qkv_dim(); ++f) {
      const size_t i = size_t(token * c.qkv_dim() + f);
      v_bad += row[i] != ref::quantize_code(values[i], scale);
    }
  }
  if (v_bad) findings.add("grad_row: " + std::to_string(v_bad) + " V codes differ from e4m3(grad_v / grad_scale)");
}

/// The packed op on the CPU against the model, stage by stage on the inputs each stage received.
void compare_packed_model(Findings& findings, const Case& c, const Inputs& in,
                          const std::vector<Output>& cpu, const ref::RopeGradients& model) {
  const int64_t T = c.tokens, C = c.channels, F = c.qkv_dim(), QK = c.qk_features();
  const ref::Rope rope = model_rope(c);
  const ref::RopeTensors tensors = model_tensors(c, in);
  if (T == 0) {
    compare_weight_grads_model(findings, c, cpu, model);  // zeros
    for (const Output& out : cpu) {
      if (out.name == "grad_q_weight" || out.name == "grad_k_weight" || out.name == "workspace") {
        continue;
      }
      bool untouched = true;
      if (out.dtype == DType::kBFloat16) {
        for (uint16_t v : as_u16(out.bytes)) untouched = untouched && v == kPoisonBF16;
      } else if (out.dtype == DType::kFloat32) {
        for (float v : as_f32(out.bytes)) untouched = untouched && same_float(v, kPoisonF32);
      } else {
        for (uint8_t v : out.bytes) untouched = untouched && v == kPoisonE4M3;
      }
      if (!untouched) findings.add(out.name + ": written at T = 0 (only the norm weights' gradients are)");
    }
    return;
  }
  // The projection: the exact GEMM rounded once to bf16 (the CPU GEMM sums in fp32: slack 2^-22).
  const std::vector<uint16_t> qkv = packed_qkv_bits(c, cpu);
  const std::vector<double> expected_qkv = ref::packed_projection(
      in.x_f8.get_codes(), in.weight_f8.get_codes(), T, F, C, c.x_scale, c.weight_scale, c.qkv_scale);
  std::vector<double> slack(expected_qkv.size());
  for (size_t i = 0; i < slack.size(); ++i) slack[i] = std::ldexp(std::fabs(expected_qkv[i]), -22);
  add_comparison(findings, test::compare_bf16("qkv [cpu vs model]", qkv, expected_qkv, slack));
  // The rope step on the op's own qk.
  std::vector<double> qk;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t f = 0; f < QK; ++f) qk.push_back(bf16_to_float(qkv[size_t(t * F + f)]));
  }
  const ref::QkPair want = ref::rope_forward(rope, qk, tensors);
  for (const char* name : {"q", "k"}) {
    const std::vector<double>& values = name[0] == 'q' ? want.q : want.k;
    const std::vector<uint16_t> got = as_u16(find_output(cpu, name).bytes);
    add_comparison(findings, test::compare_bf16(std::string(name) + " [cpu vs model of its qk]", got,
                                                values, finite_row_noise(values, c.head_dim, row_noise_of(c))));
  }
  if (c.normalize_v) {
    // v_out from the op's own raw V (the GEMM's V columns).
    std::vector<double> v;
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t f = QK; f < F; ++f) v.push_back(bf16_to_float(qkv[size_t(t * F + f)]));
    }
    const std::vector<double> want_v = ref::v_norm_forward(T * c.kv_heads, c.v_dim, double(c.eps), v);
    add_comparison(findings, test::compare_bf16("v_out [cpu vs model of its v]",
                                                as_u16(find_output(cpu, "v_out").bytes), want_v,
                                                finite_row_noise(want_v, c.v_dim, v_row_noise_of(c))));
  }
  // Backward: the FP8 gradient and the norm weights' gradients against the model, the GEMMs
  // against the float64 GEMMs of the op's own FP8 gradient.
  compare_grad_row_model(findings, c, in, cpu, model);
  compare_weight_grads_model(findings, c, cpu, model);
  const std::vector<uint8_t>& row = find_output(cpu, "grad_row").bytes;
  const std::vector<uint8_t>& t = find_output(cpu, "grad_t").bytes;
  const PackedGemms gemms = packed_gemms(c, in, row, t);
  std::vector<double> carried(gemms.grad_weight.size());  // one ulp of the unscaled GEMM output
  for (size_t i = 0; i < carried.size(); ++i) carried[i] = std::ldexp(std::fabs(gemms.grad_weight[i]), -7);
  add_comparison(findings, test::compare_bf16("grad_qk_weight; grad_v_weight [cpu vs model]",
                                              packed_weight_grad_bits(c, cpu), gemms.grad_weight, carried));
  std::vector<double> x_slack(gemms.grad_x.size());
  for (size_t i = 0; i < x_slack.size(); ++i) x_slack[i] = std::ldexp(std::fabs(gemms.grad_x[i]), -22);
  add_comparison(findings, test::compare_bf16("grad_x [cpu vs model]",
                                              as_u16(find_output(cpu, "grad_x").bytes), gemms.grad_x, x_slack));
  const double scale = as_f32(find_output(cpu, "grad_qkv_scale").bytes)[0];
  add_comparison(findings, test::compare_close("grad_qkv_scale [cpu vs model]", {scale}, {gemms.grad_qkv_scale},
                                               {(1e-4 + std::ldexp(1.0, -7)) * gemms.grad_qkv_scale_scale}));
}

void compare_cpu_model(Findings& findings, const Case& c, const Inputs& in,
                       const std::vector<Output>& cpu) {
  if (c.op == Op::kPacked) {
    compare_packed_model(findings, c, in, cpu, model_gradients(c, in));
    return;
  }
  if (is_rope_op(c.op)) {
    const ref::Rope rope = model_rope(c);
    const ref::RopeTensors tensors = model_tensors(c, in);
    const std::vector<double> qk = in.qk.get_values();
    if (c.op == Op::kRopeForward) {
      const ref::QkPair expected = ref::rope_forward(rope, qk, tensors);
      for (const char* name : {"q", "k"}) {
        const std::vector<double>& values = name[0] == 'q' ? expected.q : expected.k;
        const std::vector<uint16_t> got = as_u16(find_output(cpu, name).bytes);
        check_poison_bf16(findings, name, got);
        add_comparison(findings, test::compare_bf16(std::string(name) + " [cpu vs model]", got, values,
                                                    finite_row_noise(values, c.head_dim, row_noise_of(c))));
      }
      if (c.normalize_v) {
        const std::vector<double> want =
            ref::v_norm_forward(c.tokens * c.kv_heads, c.v_dim, double(c.eps), in.v.get_values());
        const std::vector<uint16_t> got = as_u16(find_output(cpu, "v_out").bytes);
        check_poison_bf16(findings, "v_out", got);
        add_comparison(findings, test::compare_bf16("v_out [cpu vs model]", got, want,
                                                    finite_row_noise(want, c.v_dim, v_row_noise_of(c))));
      }
      return;
    }
    const ref::RopeGradients model = model_gradients(c, in);
    if (c.op == Op::kRopeBackward) {
      const std::vector<uint16_t> got = as_u16(find_output(cpu, "grad_qk").bytes);
      check_poison_bf16(findings, "grad_qk", got);
      std::vector<double> noise = finite_row_noise(model.grad_qk, c.head_dim, row_noise_of(c));
      test::widen_by_terms(noise, model.term_scale, c.head_dim, row_noise_of(c));
      add_comparison(findings, test::compare_bf16("grad_qk [cpu vs model]", got, model.grad_qk, noise));
      compare_weight_grads_model(findings, c, cpu, model);
      if (c.normalize_v) {
        const ref::VNormGradients want = model_v_gradients(c, in);
        const std::vector<uint16_t> dv = as_u16(find_output(cpu, "grad_v").bytes);
        check_poison_bf16(findings, "grad_v", dv);
        std::vector<double> v_noise = finite_row_noise(want.grad_v, c.v_dim, v_row_noise_of(c));
        test::widen_by_terms(v_noise, want.term_scale, c.v_dim, v_row_noise_of(c));
        add_comparison(findings, test::compare_bf16("grad_v [cpu vs model]", dv, want.grad_v, v_noise));
      }
      return;
    }
    compare_grad_row_model(findings, c, in, cpu, model);
    compare_weight_grads_model(findings, c, cpu, model);
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
    case Op::kPacked: return "packed_qkv_";
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

  // The switch of the CUDA backend, as the library reads it: its cases then draw section 9's
  // options inside the CUDA rules (a replay needs the same environment).
  options.section9 = validate::cuda_section9_enabled();
  std::string flags;
  if (options.cpu_only) flags += " --cpu-only";
  if (options.section9 && !options.cpu_only) flags += " (with QKVFUSE_CUDA_SECTION9=1)";
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
  // SPEC.md section 9's options drawn: D > 256, token norm, query-only, the V norm, no angles.
  int64_t wide = 0, token_norm = 0, query_only = 0, v_norm = 0, no_angles = 0;
  int64_t per_op[kOpCount] = {};
  int64_t rope_vector = 0, rope_generic = 0;  // by Case::vector_path
  for (int64_t k = first; k < first + count; ++k) {
    const Case c = draw_case(options, k);
    ++per_op[int(c.op)];
    with_specials += c.specials != 0;
    if (is_rope_op(c.op)) {
      wide += c.head_dim > 256;
      token_norm += c.token_norm;
      query_only += c.query_only;
      v_norm += c.normalize_v;
      no_angles += !c.angles;
    }
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
  for (int op = 0; op < kOpCount; ++op) std::printf(" %s %lld;", op_name(Op(op)), (long long)per_op[op]);
  std::printf(" with special values %lld", (long long)with_specials);
  std::printf("; section 9 options: D > 256 %lld, token norm %lld, query-only %lld, V norm %lld, "
              "no angles %lld",
              (long long)wide, (long long)token_norm, (long long)query_only, (long long)v_norm,
              (long long)no_angles);
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
