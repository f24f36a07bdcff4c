// test_cuda_packed_qkv.cpp: the packed FP8 QKV op, forward and backward, on the GPU against the
// same op on the CPU backend (both through the public API), plus the CUDA grad-weight finalize
// against the CPU one and a float64 loop.
//
// Both backends get bit-identical inputs (e4m3 activations and weights quantized once, on the
// CPU). Where they may differ, and the tolerances that follow:
//   - Forward GEMM (qk, v): the GPU accumulates with fast accumulation on the tensor cores (an
//     accumulator of about 13 mantissa bits between rare promotions), the CPU exactly. Each
//     output is one bf16 rounding of nearly the same number, so most elements agree and the rest
//     are 1 ulp apart; elements that cancel to near zero can be further apart relative to
//     themselves but not relative to the tensor's scale. One bf16 ulp is up to 2^-7 of a value,
//     so checked: |gpu - cpu| <= 2^-6 * max(|cpu|, rms(cpu)) elementwise (2 ulps), relative
//     Frobenius <= 2^-7; the share within 1 bf16 ulp is printed (a property of the hardware
//     accumulator, not asserted).
//   - q, k: the norm + rotary of those slightly different qk rows, rounded once more. Checked:
//     2^-5 * max(|cpu|, rms(cpu)) elementwise, relative Frobenius <= 2^-6.
//   - Backward: both backends run from the same saved qk (the CPU forward's), so the gradients
//     differ only by the backward's own arithmetic. The e4m3 grad_row/grad_t may differ where a
//     bf16/e4m3 rounding of dx flips (fp32 reduction order of the norm gradient); one flipped
//     e4m3 step is a 6-12% change of that element, which the FP8 GEMMs carry into grad_x and the
//     weight gradients. Checked: relative Frobenius error < 1e-2 for grad_x and both weight
//     gradients, grad_qkv_scale within 1e-2 * ||G|| * ||W|| (the scale of that dot product), fewer
//     than 1% of e4m3 grad bytes differing, grad_t == grad_row^T exactly, and a bitwise rerun.
// GEMM dims must be multiples of 16 on CUDA, so T is (64 and 1008).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "gpu_util.hpp"
#include "qkvfuse/qkvfuse.hpp"
#include "test_util.hpp"

namespace qkvfuse::test {
namespace {

struct Config {
  const char* name;
  int64_t heads, qk_dim, v_dim, channels;
  bool paired, key_offset;
  int64_t rotary_dim;

  int64_t qk_features() const { return 2 * heads * qk_dim; }
  int64_t qkv_dim() const { return qk_features() + heads * v_dim; }
  RopeLayout layout() const {
    RopeLayout l;
    l.num_heads = heads;
    l.rotary_dim = rotary_dim;
    l.paired = paired;
    l.key_offset = key_offset;
    return l;
  }
};

const Config kConfigs[] = {
    {"D128_plain", 6, 128, 128, 768, false, false, 128},
    {"D128_paired", 6, 128, 128, 768, true, false, 128},
    {"D128_key_offset", 6, 128, 128, 768, false, true, 64},
    {"D96_plain", 6, 96, 128, 768, false, false, 96},
    {"D64_H12_plain", 12, 64, 128, 768, false, false, 64},
};

/// Host or device memory behind one API, so both backends run from the same code.
class Arena {
 public:
  explicit Arena(Device device) : device_(device) {}

  template <typename T>
  T* put(const std::vector<T>& values) {
    const size_t bytes = values.size() * sizeof(T);
    if (device_.type == DeviceType::kCPU) {
      host_.emplace_back(std::max<size_t>(bytes, 16));
      if (bytes) std::memcpy(host_.back().data(), values.data(), bytes);
      return reinterpret_cast<T*>(host_.back().data());
    }
    device_buffers_.push_back(DeviceBuffer(std::max<size_t>(bytes, 16)));
    device_buffers_.back().upload(values.data(), bytes);
    return static_cast<T*>(device_buffers_.back().data());
  }

  template <typename T>
  std::vector<T> get(const T* pointer, size_t count) const {
    std::vector<T> out(count);
    if (count == 0) return out;
    if (device_.type == DeviceType::kCPU) {
      std::memcpy(out.data(), pointer, count * sizeof(T));
    } else {
      EXPECT_EQ(cudaMemcpy(out.data(), pointer, count * sizeof(T), cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
    return out;
  }

  Device device() const { return device_; }

 private:
  Device device_;
  std::deque<std::vector<uint8_t>> host_;  // deque: growing never moves earlier buffers
  std::deque<DeviceBuffer> device_buffers_;
};

/// The op's inputs, host side, quantized once on the CPU.
struct Inputs {
  int64_t tokens = 0;
  std::vector<uint8_t> x_f8, x_f8_t, weight_f8, weight_f8_t;
  std::vector<uint16_t> qk_weight, v_weight, factor1, factor2, grad_q, grad_k, grad_v;
  float x_scale = 8.0f / 448.0f, weight_scale = 0.0f, qkv_scale = 1.3f, grad_scale = 1.0f / 448.0f;
};

std::vector<uint16_t> to_bf16(const std::vector<float>& values) {
  std::vector<uint16_t> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = float_to_bf16(values[i]);
  return out;
}

Inputs make_inputs(const Config& cfg, int64_t tokens, std::mt19937_64& rng) {
  Inputs in;
  in.tokens = tokens;
  const int64_t c = cfg.channels, qkv = cfg.qkv_dim();
  // x ~ N(0, 1) quantized with the workload's static x_scale.
  std::vector<uint16_t> x = random_bf16(rng, size_t(tokens * c), 1.0f);
  in.x_f8.resize(size_t(tokens * c));
  in.x_f8_t.resize(size_t(tokens * c));
  {
    std::vector<float> scale{in.x_scale};
    QuantizeDualParams p;
    p.src = make_view(x.data(), DType::kBFloat16, kCPU, {tokens, c});
    p.scale = make_view(scale.data(), DType::kFloat32, kCPU, {});
    p.row = make_view(in.x_f8.data(), DType::kFloat8E4M3, kCPU, {tokens, c});
    p.t = make_view(in.x_f8_t.data(), DType::kFloat8E4M3, kCPU, {c, tokens});
    quantize_dual_layout(p);
  }
  // Master weights and their packed e4m3 cache (current scaling, amax / 448).
  in.qk_weight = random_bf16(rng, size_t(cfg.qk_features() * c), 0.02f);
  in.v_weight = random_bf16(rng, size_t(cfg.heads * cfg.v_dim * c), 0.02f);
  {
    std::vector<uint16_t> packed = in.qk_weight;
    packed.insert(packed.end(), in.v_weight.begin(), in.v_weight.end());
    std::vector<float> scale(1);
    in.weight_f8.resize(size_t(qkv * c));
    in.weight_f8_t.resize(size_t(qkv * c));
    QuantizeWeightBankParams p;
    p.src = make_view(packed.data(), DType::kBFloat16, kCPU, {1, qkv, c});
    p.scale = make_view(scale.data(), DType::kFloat32, kCPU, {1});
    p.row = make_view(in.weight_f8.data(), DType::kFloat8E4M3, kCPU, {1, qkv, c});
    p.t = make_view(in.weight_f8_t.data(), DType::kFloat8E4M3, kCPU, {1, c, qkv});
    quantize_weight_bank(p);
    in.weight_scale = scale[0];
  }
  std::vector<float> f1, f2;
  rotary_tables(tokens, cfg.qk_dim, cfg.paired ? 2 : 1, cfg.rotary_dim, f1, f2);
  in.factor1 = to_bf16(f1);
  in.factor2 = to_bf16(f2);
  // Output gradients: dx / grad_scale and grad_v / grad_scale land around 10-100 in e4m3.
  const size_t qk_out = size_t(tokens * cfg.heads * cfg.qk_dim);
  in.grad_q = random_bf16(rng, qk_out, 0.05f);
  in.grad_k = random_bf16(rng, qk_out, 0.05f);
  in.grad_v = random_bf16(rng, size_t(tokens * cfg.heads * cfg.v_dim), 0.05f);
  return in;
}

/// Shapes of q/k (and grad_q/grad_k) in the config's layout.
TensorView qk_out_view(const Config& cfg, void* data, Device device, int64_t tokens) {
  if (cfg.paired) {
    return make_view(data, DType::kBFloat16, device, {2 * tokens, cfg.heads / 2, cfg.qk_dim});
  }
  return make_view(data, DType::kBFloat16, device, {tokens, cfg.heads, cfg.qk_dim});
}

struct ForwardOut {
  std::vector<uint16_t> qk;  // [T, 2H, D] compacted
  std::vector<uint16_t> v;   // [T, H, Dv] compacted
  std::vector<uint16_t> q, k;
};

/// One forward on `device`. Plain layouts write qk and v as two column slices of one
/// [T, qkv_dim] buffer (one GEMM); paired layouts as two dense buffers (two GEMMs).
ForwardOut run_forward(const Config& cfg, const Inputs& in, Device device) {
  Arena arena(device);
  const int64_t t = in.tokens, c = cfg.channels, qkv = cfg.qkv_dim(), hd2 = cfg.qk_features();
  const int64_t hdv = cfg.heads * cfg.v_dim;
  PackedQkvForwardParams p;
  p.x_f8 = make_view(arena.put(in.x_f8), DType::kFloat8E4M3, device, {t, c});
  p.weight_f8 = make_view(arena.put(in.weight_f8), DType::kFloat8E4M3, device, {qkv, c});
  p.x_scale = make_view(arena.put(std::vector<float>{in.x_scale}), DType::kFloat32, device, {});
  p.weight_scale =
      make_view(arena.put(std::vector<float>{in.weight_scale}), DType::kFloat32, device, {1});
  p.qkv_scale = make_view(arena.put(std::vector<float>{in.qkv_scale}), DType::kFloat32, device, {});
  const int64_t fw = cfg.qk_dim * (cfg.paired ? 2 : 1);
  p.layout = cfg.layout();
  p.layout.factor1 = make_view(arena.put(in.factor1), DType::kBFloat16, device, {t, fw});
  p.layout.factor2 = make_view(arena.put(in.factor2), DType::kBFloat16, device, {t, fw});
  uint16_t* qk_data = nullptr;
  uint16_t* v_data = nullptr;
  int64_t qk_stride = hd2, v_stride = hdv;
  if (!cfg.paired) {
    qk_data = arena.put(std::vector<uint16_t>(size_t(t * qkv), kPoisonBF16));
    v_data = qk_data + hd2;
    qk_stride = v_stride = qkv;
  } else {
    qk_data = arena.put(std::vector<uint16_t>(size_t(t * hd2), kPoisonBF16));
    v_data = arena.put(std::vector<uint16_t>(size_t(t * hdv), kPoisonBF16));
  }
  p.qk = make_view(qk_data, DType::kBFloat16, device, {t, 2 * cfg.heads, cfg.qk_dim},
                   {qk_stride, cfg.qk_dim, 1});
  p.v = make_view(v_data, DType::kBFloat16, device, {t, cfg.heads, cfg.v_dim},
                  {v_stride, cfg.v_dim, 1});
  const size_t qk_out = size_t(t * cfg.heads * cfg.qk_dim);
  uint16_t* q = arena.put(std::vector<uint16_t>(qk_out, kPoisonBF16));
  uint16_t* k = arena.put(std::vector<uint16_t>(qk_out, kPoisonBF16));
  p.q = qk_out_view(cfg, q, device, t);
  p.k = qk_out_view(cfg, k, device, t);
  packed_qkv_forward(p);
  if (device.type == DeviceType::kCUDA) synchronize();

  ForwardOut out;
  const std::vector<uint16_t> qk_rows = arena.get(qk_data, size_t((t - 1) * qk_stride + hd2));
  const std::vector<uint16_t> v_rows = arena.get(v_data, size_t((t - 1) * v_stride + hdv));
  for (int64_t i = 0; i < t; ++i) {
    out.qk.insert(out.qk.end(), qk_rows.begin() + i * qk_stride, qk_rows.begin() + i * qk_stride + hd2);
    out.v.insert(out.v.end(), v_rows.begin() + i * v_stride, v_rows.begin() + i * v_stride + hdv);
  }
  out.q = arena.get(q, qk_out);
  out.k = arena.get(k, qk_out);
  return out;
}

struct BackwardOut {
  std::vector<uint8_t> grad_row, grad_t;
  std::vector<uint16_t> grad_x, grad_qk_weight, grad_v_weight;
  float grad_qkv_scale = 0.0f;
};

/// One backward on `device` from the saved `qk` ([T, 2H, D] compacted). `one_buffer`: the weight
/// gradients are two row slices of one [qkv_dim, C] buffer (one wgrad GEMM); else two buffers.
BackwardOut run_backward(const Config& cfg, const Inputs& in, const std::vector<uint16_t>& qk,
                         Device device, bool one_buffer) {
  Arena arena(device);
  const int64_t t = in.tokens, c = cfg.channels, qkv = cfg.qkv_dim(), hd2 = cfg.qk_features();
  const int64_t hdv = cfg.heads * cfg.v_dim;
  PackedQkvBackwardParams p;
  p.grad_q = qk_out_view(cfg, arena.put(in.grad_q), device, t);
  p.grad_k = qk_out_view(cfg, arena.put(in.grad_k), device, t);
  p.grad_v = make_view(arena.put(in.grad_v), DType::kBFloat16, device, {t, cfg.heads, cfg.v_dim});
  // The saved qk as the forward leaves it: a column slice of [T, qkv_dim] unless paired.
  if (!cfg.paired) {
    std::vector<uint16_t> wide(size_t(t * qkv), float_to_bf16(NAN));
    for (int64_t i = 0; i < t; ++i)
      std::copy(qk.begin() + i * hd2, qk.begin() + (i + 1) * hd2, wide.begin() + i * qkv);
    p.qk = make_view(arena.put(wide), DType::kBFloat16, device, {t, 2 * cfg.heads, cfg.qk_dim},
                     {qkv, cfg.qk_dim, 1});
  } else {
    p.qk = make_view(arena.put(qk), DType::kBFloat16, device, {t, 2 * cfg.heads, cfg.qk_dim});
  }
  const int64_t fw = cfg.qk_dim * (cfg.paired ? 2 : 1);
  p.layout = cfg.layout();
  p.layout.factor1 = make_view(arena.put(in.factor1), DType::kBFloat16, device, {t, fw});
  p.layout.factor2 = make_view(arena.put(in.factor2), DType::kBFloat16, device, {t, fw});
  p.x_f8_t = make_view(arena.put(in.x_f8_t), DType::kFloat8E4M3, device, {c, t});
  p.weight_f8_t = make_view(arena.put(in.weight_f8_t), DType::kFloat8E4M3, device, {c, qkv});
  p.qk_weight = make_view(arena.put(in.qk_weight), DType::kBFloat16, device, {hd2, c});
  p.v_weight = make_view(arena.put(in.v_weight), DType::kBFloat16, device, {hdv, c});
  p.x_scale = make_view(arena.put(std::vector<float>{in.x_scale}), DType::kFloat32, device, {});
  p.weight_scale =
      make_view(arena.put(std::vector<float>{in.weight_scale}), DType::kFloat32, device, {1});
  p.qkv_scale = make_view(arena.put(std::vector<float>{in.qkv_scale}), DType::kFloat32, device, {});
  p.grad_scale = make_view(arena.put(std::vector<float>{in.grad_scale}), DType::kFloat32, device, {});
  uint8_t* grad_row = arena.put(std::vector<uint8_t>(size_t(t * qkv), kPoisonE4M3));
  uint8_t* grad_t = arena.put(std::vector<uint8_t>(size_t(t * qkv), kPoisonE4M3));
  p.grad_row = make_view(grad_row, DType::kFloat8E4M3, device, {t, qkv});
  p.grad_t = make_view(grad_t, DType::kFloat8E4M3, device, {qkv, t});
  p.partials = make_view(arena.put(std::vector<float>(size_t(kGradScalePartials), NAN)),
                         DType::kFloat32, device, {kGradScalePartials});
  uint16_t* grad_x = arena.put(std::vector<uint16_t>(size_t(t * c), kPoisonBF16));
  p.grad_x = make_view(grad_x, DType::kBFloat16, device, {t, c});
  uint16_t* grad_qk_w = nullptr;
  uint16_t* grad_v_w = nullptr;
  if (one_buffer) {
    grad_qk_w = arena.put(std::vector<uint16_t>(size_t(qkv * c), kPoisonBF16));
    grad_v_w = grad_qk_w + hd2 * c;
  } else {
    grad_qk_w = arena.put(std::vector<uint16_t>(size_t(hd2 * c), kPoisonBF16));
    grad_v_w = arena.put(std::vector<uint16_t>(size_t(hdv * c), kPoisonBF16));
  }
  p.grad_qk_weight = make_view(grad_qk_w, DType::kBFloat16, device, {hd2, c});
  p.grad_v_weight = make_view(grad_v_w, DType::kBFloat16, device, {hdv, c});
  float* grad_qkv_scale = arena.put(std::vector<float>{NAN});
  p.grad_qkv_scale = make_view(grad_qkv_scale, DType::kFloat32, device, {});
  packed_qkv_backward(p);
  if (device.type == DeviceType::kCUDA) synchronize();

  BackwardOut out;
  out.grad_row = arena.get(grad_row, size_t(t * qkv));
  out.grad_t = arena.get(grad_t, size_t(t * qkv));
  out.grad_x = arena.get(grad_x, size_t(t * c));
  out.grad_qk_weight = arena.get(grad_qk_w, size_t(hd2 * c));
  out.grad_v_weight = arena.get(grad_v_w, size_t(hdv * c));
  out.grad_qkv_scale = arena.get(grad_qkv_scale, 1)[0];
  return out;
}

// ---- comparisons --------------------------------------------------------------------------------

double rms(const std::vector<uint16_t>& x) {
  double sum = 0.0;
  for (uint16_t v : x) sum += double(bf16_to_float(v)) * double(bf16_to_float(v));
  return std::sqrt(sum / double(std::max<size_t>(x.size(), 1)));
}

double relative_frobenius(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = bf16_to_float(got[i]), w = bf16_to_float(want[i]);
    diff += (g - w) * (g - w);
    norm += w * w;
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

/// Elementwise |got - want| <= tol * max(|want|, rms(want)), relative Frobenius <= frob; prints
/// the share of elements within 1 bf16 ulp.
void expect_close(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want, double tol,
                  double frob, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const double scale = rms(want);
  int64_t bad = 0, first = -1, within = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float g = bf16_to_float(got[i]), w = bf16_to_float(want[i]);
    const double allowed = tol * std::max<double>(std::fabs(w), scale);
    if (!(std::fabs(double(g) - double(w)) <= allowed)) {
      if (first < 0) first = int64_t(i);
      ++bad;
    }
    const int32_t og = (got[i] & 0x8000) ? -int32_t(got[i] & 0x7fff) : int32_t(got[i] & 0x7fff);
    const int32_t ow = (want[i] & 0x8000) ? -int32_t(want[i] & 0x7fff) : int32_t(want[i] & 0x7fff);
    within += std::abs(og - ow) <= 1;
  }
  const double share = double(within) / double(std::max<size_t>(got.size(), 1));
  const double rel = relative_frobenius(got, want);
  std::printf("[packed_qkv] %-16s within 1 ulp %.4f%%, relative Frobenius %.3e\n", what,
              100.0 * share, rel);
  EXPECT_EQ(bad, 0) << what << ": " << bad << " elements beyond " << tol
                    << " * max(|cpu|, rms); first at " << first << ": gpu "
                    << (first >= 0 ? bf16_to_float(got[size_t(first)]) : 0.0f) << " vs cpu "
                    << (first >= 0 ? bf16_to_float(want[size_t(first)]) : 0.0f);
  EXPECT_LE(rel, frob) << what;
}

/// The gradients of two backward runs (`got` against `want`): relative Frobenius error < 1e-2
/// for grad_x and both weight gradients, grad_qkv_scale within 1e-2 * ||G|| * ||W|| (the scale of
/// that dot product), and every gradient finite.
void expect_same_gradients(const Inputs& in, const BackwardOut& got,
                           const BackwardOut& want) {
  const auto check_grad = [](const std::vector<uint16_t>& g, const std::vector<uint16_t>& w,
                             const char* what) {
    const double rel = relative_frobenius(g, w);
    std::printf("[packed_qkv] %-16s relative Frobenius %.3e\n", what, rel);
    EXPECT_LT(rel, 1e-2) << what;
    for (uint16_t v : g) {
      ASSERT_TRUE(std::isfinite(bf16_to_float(v))) << what << ": non-finite value (unwritten?)";
    }
  };
  check_grad(got.grad_x, want.grad_x, "grad_x");
  check_grad(got.grad_qk_weight, want.grad_qk_weight, "grad_qk_weight");
  check_grad(got.grad_v_weight, want.grad_v_weight, "grad_v_weight");

  // grad_qkv_scale = <G, W>: its natural scale is ||G|| * ||W|| (G unscaled = grad / qkv_scale).
  double g_norm = 0.0, w_norm = 0.0;
  for (uint16_t v : want.grad_qk_weight) g_norm += std::pow(bf16_to_float(v) / in.qkv_scale, 2);
  for (uint16_t v : want.grad_v_weight) g_norm += std::pow(bf16_to_float(v) / in.qkv_scale, 2);
  for (uint16_t v : in.qk_weight) w_norm += std::pow(bf16_to_float(v), 2);
  for (uint16_t v : in.v_weight) w_norm += std::pow(bf16_to_float(v), 2);
  const double dot_scale = std::sqrt(g_norm) * std::sqrt(w_norm);
  std::printf("[packed_qkv] grad_qkv_scale   %.6e against %.6e (|diff| / (||G|| ||W||) = %.3e)\n",
              got.grad_qkv_scale, want.grad_qkv_scale,
              std::fabs(double(got.grad_qkv_scale) - double(want.grad_qkv_scale)) / dot_scale);
  EXPECT_LE(std::fabs(double(got.grad_qkv_scale) - double(want.grad_qkv_scale)), 1e-2 * dot_scale);
}

void check_config(const Config& cfg, int64_t tokens) {
  SCOPED_TRACE(::testing::Message() << cfg.name << " T=" << tokens);
  auto rng = rng_for_test();
  const Inputs in = make_inputs(cfg, tokens, rng);

  // ---- forward ----
  const ForwardOut cpu = run_forward(cfg, in, kCPU);
  const ForwardOut gpu = run_forward(cfg, in, kGPU);
  expect_close(gpu.qk, cpu.qk, 1.0 / 64, 1.0 / 128, "qk (GEMM)");
  expect_close(gpu.v, cpu.v, 1.0 / 64, 1.0 / 128, "v (GEMM)");
  expect_close(gpu.q, cpu.q, 1.0 / 32, 1.0 / 64, "q");
  expect_close(gpu.k, cpu.k, 1.0 / 32, 1.0 / 64, "k");

  // ---- backward, both from the CPU forward's qk ----
  for (bool one_buffer : {true, false}) {
    SCOPED_TRACE(one_buffer ? "weight grads in one buffer" : "weight grads in two buffers");
    const BackwardOut cb = run_backward(cfg, in, cpu.qk, kCPU, one_buffer);
    const BackwardOut gb = run_backward(cfg, in, cpu.qk, kGPU, one_buffer);
    const int64_t t = tokens, qkv = cfg.qkv_dim();
    // grad_t is grad_row transposed, exactly.
    int64_t transpose_bad = 0, differing = 0;
    for (int64_t i = 0; i < t; ++i) {
      for (int64_t f = 0; f < qkv; ++f) {
        transpose_bad += gb.grad_row[size_t(i * qkv + f)] != gb.grad_t[size_t(f * t + i)];
        differing += gb.grad_row[size_t(i * qkv + f)] != cb.grad_row[size_t(i * qkv + f)];
      }
    }
    EXPECT_EQ(transpose_bad, 0) << "GPU grad_t is not grad_row transposed";
    EXPECT_LT(double(differing), 0.01 * double(t * qkv)) << differing << " e4m3 grad bytes differ";

    expect_same_gradients(in, gb, cb);

    // Bitwise rerun on the GPU: every output, grad_qkv_scale included.
    const BackwardOut again = run_backward(cfg, in, cpu.qk, kGPU, one_buffer);
    EXPECT_TRUE(again.grad_row == gb.grad_row && again.grad_t == gb.grad_t &&
                again.grad_x == gb.grad_x && again.grad_qk_weight == gb.grad_qk_weight &&
                again.grad_v_weight == gb.grad_v_weight)
        << "backward rerun differs";
    EXPECT_EQ(float_bits(again.grad_qkv_scale), float_bits(gb.grad_qkv_scale))
        << "grad_qkv_scale rerun differs";
  }
}

/// The parameterized suites' cases: every config of kConfigs at T = 64 and 1008, named
/// <config>_T<tokens>.
const auto kLayoutCases =
    ::testing::Combine(::testing::Range(0, int(sizeof(kConfigs) / sizeof(kConfigs[0]))),
                       ::testing::Values(int64_t(64), int64_t(1008)));

std::string layout_case_name(const ::testing::TestParamInfo<std::tuple<int, int64_t>>& info) {
  return std::string(kConfigs[std::get<0>(info.param)].name) + "_T" +
         std::to_string(std::get<1>(info.param));
}

class CudaPackedQkv : public ::testing::TestWithParam<std::tuple<int, int64_t>> {};

TEST_P(CudaPackedQkv, MatchesCpuBackend) {
  QKVF_REQUIRE_GPU();
  const auto [index, tokens] = GetParam();
  check_config(kConfigs[index], tokens);
}

INSTANTIATE_TEST_SUITE_P(Layouts, CudaPackedQkv, kLayoutCases, layout_case_name);

// T = 0 is a no-op on the GPU too: the wgrad GEMM (K = T) is not validated against cuBLASLt's
// K > 0 when it will not run, and nothing is written (the outputs keep their poison).
TEST(CudaPackedQkvZeroTokens, BackwardIsANoOp) {
  QKVF_REQUIRE_GPU();
  const Config& cfg = kConfigs[0];
  auto rng = rng_for_test();
  const Inputs in = make_inputs(cfg, 0, rng);
  BackwardOut out;
  ASSERT_NO_THROW(out = run_backward(cfg, in, {}, kGPU, true));
  EXPECT_TRUE(out.grad_row.empty() && out.grad_t.empty() && out.grad_x.empty());
  for (const std::vector<uint16_t>* grad : {&out.grad_qk_weight, &out.grad_v_weight}) {
    ASSERT_FALSE(grad->empty());
    EXPECT_TRUE(
        std::all_of(grad->begin(), grad->end(), [](uint16_t v) { return v == kPoisonBF16; }));
  }
  EXPECT_TRUE(std::isnan(out.grad_qkv_scale));
}

// ---- grad-weight finalize (the CUDA kernel alone) ----------------------------------------------

struct FinalizeCase {
  int64_t rows_qk, rows_v, cols;
  bool one_buffer;
  int64_t offset;  // elements: a nonzero value misaligns every buffer (the scalar path)
};

/// Runs the finalize on `device` from host G and W; returns the scaled G and grad_qkv_scale.
std::pair<std::vector<uint16_t>, float> run_finalize(const FinalizeCase& fc,
                                                     const std::vector<uint16_t>& grad,
                                                     const std::vector<uint16_t>& weight,
                                                     float qkv_scale, Device device) {
  Arena arena(device);
  std::vector<uint16_t> grad_storage(size_t(fc.offset) + grad.size());
  std::copy(grad.begin(), grad.end(), grad_storage.begin() + fc.offset);
  std::vector<uint16_t> weight_storage(size_t(fc.offset) + weight.size());
  std::copy(weight.begin(), weight.end(), weight_storage.begin() + fc.offset);
  uint16_t* g = arena.put(grad_storage) + fc.offset;
  uint16_t* w = arena.put(weight_storage) + fc.offset;
  uint16_t* g_v = g + fc.rows_qk * fc.cols;
  if (!fc.one_buffer) {
    // V part in a buffer of its own.
    std::vector<uint16_t> v_part(grad.begin() + fc.rows_qk * fc.cols, grad.end());
    g_v = arena.put(v_part);
  }
  GradWeightFinalizeParams p;
  p.grad_qk_weight = make_view(g, DType::kBFloat16, device, {fc.rows_qk, fc.cols});
  p.grad_v_weight = make_view(g_v, DType::kBFloat16, device, {fc.rows_v, fc.cols});
  p.qk_weight = make_view(w, DType::kBFloat16, device, {fc.rows_qk, fc.cols});
  p.v_weight = make_view(w + fc.rows_qk * fc.cols, DType::kBFloat16, device, {fc.rows_v, fc.cols});
  p.qkv_scale = make_view(arena.put(std::vector<float>{qkv_scale}), DType::kFloat32, device, {});
  p.partials = make_view(arena.put(std::vector<float>(size_t(kGradScalePartials), NAN)),
                         DType::kFloat32, device, {kGradScalePartials});
  float* out = arena.put(std::vector<float>{NAN});
  p.grad_qkv_scale = make_view(out, DType::kFloat32, device, {});
  if (device.type == DeviceType::kCUDA) {
    cuda::grad_weight_finalize(p);
    synchronize();
  } else {
    cpu::grad_weight_finalize(p);
  }
  std::vector<uint16_t> scaled = arena.get(g, size_t(fc.rows_qk * fc.cols));
  const std::vector<uint16_t> scaled_v = arena.get(g_v, size_t(fc.rows_v * fc.cols));
  scaled.insert(scaled.end(), scaled_v.begin(), scaled_v.end());
  return {scaled, arena.get(out, 1)[0]};
}

TEST(CudaGradWeightFinalize, MatchesCpuAndFloat64) {
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  const FinalizeCase cases[] = {
      {1536, 768, 768, true, 0},   // D = 128, H = 6, C = 768: the workload
      {1536, 768, 768, false, 0},  // weight grads in two buffers
      {1152, 768, 768, true, 0},   // D = 96
      {40, 24, 17, true, 0},       // C not a multiple of 8: the scalar path
      {64, 32, 768, true, 3},      // misaligned buffers: the scalar path
      {1, 1, 8, true, 0},          // fewer units than blocks: most partials are empty sums
  };
  for (const FinalizeCase& fc : cases) {
    SCOPED_TRACE(::testing::Message() << "rows " << fc.rows_qk << "+" << fc.rows_v << " cols "
                                      << fc.cols << " one_buffer " << fc.one_buffer << " offset "
                                      << fc.offset);
    const size_t count = size_t((fc.rows_qk + fc.rows_v) * fc.cols);
    const std::vector<uint16_t> grad = random_bf16(rng, count, 3e-3f);
    const std::vector<uint16_t> weight = random_bf16(rng, count, 0.02f);
    const float qkv_scale = 1.3f;
    const auto [gpu_grad, gpu_sum] = run_finalize(fc, grad, weight, qkv_scale, kGPU);
    const auto [cpu_grad, cpu_sum] = run_finalize(fc, grad, weight, qkv_scale, kCPU);
    // Scaled gradients: bf16(fp32(g * s)), exact, identical everywhere.
    int64_t bad = 0;
    for (size_t i = 0; i < count; ++i) {
      const uint16_t want = float_to_bf16(bf16_to_float(grad[i]) * qkv_scale);
      bad += gpu_grad[i] != want || cpu_grad[i] != want;
    }
    EXPECT_EQ(bad, 0) << "scaled gradients differ from bf16(g * qkv_scale)";
    // The sum: float64 of exact products. Both backends add in fp32 along chains no longer than
    // one partial's share of the elements plus the partials plus a 64-step tree, so the error is
    // at most that length * 2^-24 * sum |g w|.
    double exact = 0.0, abs_sum = 0.0;
    for (size_t i = 0; i < count; ++i) {
      const double prod = double(bf16_to_float(grad[i])) * double(bf16_to_float(weight[i]));
      exact += prod;
      abs_sum += std::fabs(prod);
    }
    const double chain = double(count) / double(kGradScalePartials) + double(kGradScalePartials) + 64.0;
    const double bound = chain * std::ldexp(1.0, -24) * abs_sum;
    EXPECT_LE(std::fabs(double(gpu_sum) - exact), bound) << "gpu " << gpu_sum << " exact " << exact;
    EXPECT_LE(std::fabs(double(cpu_sum) - exact), bound) << "cpu " << cpu_sum << " exact " << exact;
    // Determinism: a rerun gives the same bits.
    const auto [gpu_grad2, gpu_sum2] = run_finalize(fc, grad, weight, qkv_scale, kGPU);
    EXPECT_EQ(float_bits(gpu_sum2), float_bits(gpu_sum));
    EXPECT_TRUE(gpu_grad2 == gpu_grad);
  }
}

}  // namespace
}  // namespace qkvfuse::test
