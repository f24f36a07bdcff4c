// demo.cpp: the library's main job on one GPT attention layer's input, end to end.
//
// x (bf16) -> quantize once (row-major + transposed e4m3) -> packed FP8 QKV GEMM against the
// cached [Wq; Wk; Wv] e4m3 weight -> QK RMS-norm + rotary -> q, k, v; then the backward from
// random grad_q, grad_k, grad_v -> fused FP8 backward -> dgrad and wgrad GEMMs -> grad x,
// grad W, grad qkv_scale. Runs on the GPU when one is present (and checks it against the CPU
// backend on the same inputs), on the CPU otherwise, and prints what it computed and checked.
//
//   qkvfuse_demo [--tokens T] [--cpu]
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "qkvfuse/qkvfuse.hpp"

#if defined(QKVFUSE_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

using namespace qkvfuse;

namespace {

// GPT layer shape of the modded-nanogpt speedrun (SPEC.md section 7).
constexpr int64_t kModel = 768, kHeads = 6, kHeadDim = 128, kValueDim = 128;
constexpr int64_t kQkvDim = 2 * kHeads * kHeadDim + kHeads * kValueDim;

/// Memory on one device, filled from and read back to host bytes.
class Buffer {
 public:
  Buffer(Device device, size_t bytes) : device_(device), bytes_(bytes) {
    if (device.type == DeviceType::kCPU) {
      host_.resize(bytes);
      data_ = host_.data();
    } else {
#if defined(QKVFUSE_WITH_CUDA)
      QKVF_CHECK(cudaMalloc(&data_, bytes) == cudaSuccess, "cudaMalloc of ", bytes, " bytes failed");
#endif
    }
  }
  ~Buffer() {
#if defined(QKVFUSE_WITH_CUDA)
    if (device_.type == DeviceType::kCUDA) cudaFree(data_);
#endif
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  template <typename T>
  void upload(const std::vector<T>& values) {
    copy(data_, values.data(), values.size() * sizeof(T), true);
  }
  template <typename T>
  std::vector<T> download() const {
    std::vector<T> values(bytes_ / sizeof(T));
    copy(values.data(), data_, bytes_, false);
    return values;
  }

 private:
  void copy(void* dst, const void* src, size_t bytes, bool to_device) const {
    if (device_.type == DeviceType::kCPU) {
      std::memcpy(dst, src, bytes);
      return;
    }
#if defined(QKVFUSE_WITH_CUDA)
    const auto kind = to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
    QKVF_CHECK(cudaMemcpy(dst, src, bytes, kind) == cudaSuccess, "cudaMemcpy failed");
#else
    (void)to_device;
#endif
  }

  Device device_;
  size_t bytes_;
  std::vector<uint8_t> host_;
  void* data_ = nullptr;
};

struct Inputs {
  std::vector<uint16_t> x, weight, grad_q, grad_k, grad_v;  // bf16 bits
  std::vector<uint16_t> factor1, factor2;
};

std::vector<uint16_t> normal_bf16(std::mt19937_64& rng, size_t count, double std) {
  std::normal_distribution<double> normal(0.0, std);
  std::vector<uint16_t> out(count);
  for (auto& v : out) v = float_to_bf16(float(normal(rng)));
  return out;
}

Inputs make_inputs(int64_t tokens) {
  std::mt19937_64 rng(2026);
  Inputs in;
  in.x = normal_bf16(rng, size_t(tokens * kModel), 1.0);
  in.weight = normal_bf16(rng, size_t(kQkvDim * kModel), 0.5 / std::sqrt(double(kModel)));
  in.grad_q = normal_bf16(rng, size_t(tokens * kHeads * kHeadDim), 1e-3);
  in.grad_k = normal_bf16(rng, size_t(tokens * kHeads * kHeadDim), 1e-3);
  in.grad_v = normal_bf16(rng, size_t(tokens * kHeads * kValueDim), 1e-3);
  // Interleaved rotary tables: factor1 = cos, factor2 = sin with odd lanes negated.
  in.factor1.resize(size_t(tokens * kHeadDim));
  in.factor2.resize(size_t(tokens * kHeadDim));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t d = 0; d < kHeadDim; ++d) {
      const double angle = double(t) * std::pow(1.0 / 1024.0, double(d / 2 * 2) / double(kHeadDim));
      in.factor1[size_t(t * kHeadDim + d)] = float_to_bf16(float(std::cos(angle)));
      const float s = float(std::sin(angle));
      in.factor2[size_t(t * kHeadDim + d)] = float_to_bf16(d % 2 ? -s : s);
    }
  }
  return in;
}

/// Everything one layer's forward + backward produces, downloaded to the host.
struct Results {
  std::vector<uint16_t> q, k, v, grad_x, grad_weight;
  float grad_qkv_scale = 0;
  float weight_scale = 0;
};

Results run_layer(Device device, int64_t tokens, const Inputs& in, Stream stream) {
  const auto bf16 = DType::kBFloat16, f32 = DType::kFloat32, e4m3 = DType::kFloat8E4M3;
  const int64_t T = tokens, C = kModel, H = kHeads, D = kHeadDim, Dv = kValueDim, F = kQkvDim;
  Buffer x(device, T * C * 2), weight(device, F * C * 2);
  Buffer x_f8(device, T * C), x_f8_t(device, C * T), w_f8(device, F * C), w_f8_t(device, C * F);
  Buffer scales(device, 5 * sizeof(float));  // x_scale, weight_scale, qkv_scale, grad_scale, grad_qkv_scale
  Buffer f1(device, T * D * 2), f2(device, T * D * 2);
  Buffer qkv(device, T * F * 2), q(device, T * H * D * 2), k(device, T * H * D * 2);
  Buffer gq(device, T * H * D * 2), gk(device, T * H * D * 2), gv(device, T * H * Dv * 2);
  Buffer grad_row(device, T * F), grad_t(device, F * T), partials(device, kGradScalePartials * 4);
  Buffer grad_x(device, T * C * 2), grad_w(device, F * C * 2);
  x.upload(in.x);
  weight.upload(in.weight);
  f1.upload(in.factor1);
  f2.upload(in.factor2);
  gq.upload(in.grad_q);
  gk.upload(in.grad_k);
  gv.upload(in.grad_v);
  // x_scale = 8/448 and grad_scale = 1/448 are the speedrun's static scales; qkv_scale is the
  // learnable scalar multiplying the whole weight.
  scales.upload(std::vector<float>{8.0f / 448.0f, 0.0f, 0.9f, 1.0f / 448.0f, 0.0f});
  auto scalar = [&](int i) {
    return make_view(static_cast<float*>(scales.data()) + i, f32, device, {});
  };

  // The per-layer weight cache: amax-derived scale and both e4m3 layouts, on the device.
  quantize_weight_bank({make_view(weight.data(), bf16, device, {1, F, C}),
                        make_view(static_cast<float*>(scales.data()) + 1, f32, device, {1}),
                        make_view(w_f8.data(), e4m3, device, {1, F, C}),
                        make_view(w_f8_t.data(), e4m3, device, {1, C, F}), stream});
  // The activation quantize, done once and shared by every layer reading x.
  quantize_dual_layout({make_view(x.data(), bf16, device, {T, C}), scalar(0),
                        make_view(x_f8.data(), e4m3, device, {T, C}),
                        make_view(x_f8_t.data(), e4m3, device, {C, T}), TensorView{}, stream});

  // The speedrun's layout: H query and key heads, weightless RMS-norm, interleaved rotary from
  // the factor tables (every RopeLayout default).
  RopeLayout layout;
  layout.num_heads = H;
  layout.factor1 = make_view(f1.data(), bf16, device, {T, D});
  layout.factor2 = make_view(f2.data(), bf16, device, {T, D});
  auto* qkv_base = static_cast<uint16_t*>(qkv.data());
  PackedQkvForwardParams fwd;
  fwd.x_f8 = make_view(x_f8.data(), e4m3, device, {T, C});
  fwd.weight_f8 = make_view(w_f8.data(), e4m3, device, {F, C});
  fwd.x_scale = scalar(0);
  fwd.weight_scale = scalar(1);
  fwd.qkv_scale = scalar(2);
  // q/k columns and v columns of one [T, F] GEMM output: one GEMM writes both.
  fwd.qk = make_view(qkv_base, bf16, device, {T, 2 * H, D}, {F, D, 1});
  fwd.v = make_view(qkv_base + 2 * H * D, bf16, device, {T, H, Dv}, {F, Dv, 1});
  fwd.q = make_view(q.data(), bf16, device, {T, H, D});
  fwd.k = make_view(k.data(), bf16, device, {T, H, D});
  fwd.layout = layout;
  fwd.stream = stream;
  packed_qkv_forward(fwd);

  auto* grad_w_base = static_cast<uint16_t*>(grad_w.data());
  PackedQkvBackwardParams bwd;
  bwd.grad_q = make_view(gq.data(), bf16, device, {T, H, D});
  bwd.grad_k = make_view(gk.data(), bf16, device, {T, H, D});
  bwd.grad_v = make_view(gv.data(), bf16, device, {T, H, Dv});
  bwd.qk = fwd.qk;
  bwd.x_f8_t = make_view(x_f8_t.data(), e4m3, device, {C, T});
  bwd.weight_f8_t = make_view(w_f8_t.data(), e4m3, device, {C, F});
  bwd.qk_weight = make_view(weight.data(), bf16, device, {2 * H * D, C});
  bwd.v_weight = make_view(static_cast<uint16_t*>(weight.data()) + 2 * H * D * C, bf16, device, {H * Dv, C});
  bwd.x_scale = scalar(0);
  bwd.weight_scale = scalar(1);
  bwd.qkv_scale = scalar(2);
  bwd.grad_scale = scalar(3);
  bwd.grad_row = make_view(grad_row.data(), e4m3, device, {T, F});
  bwd.grad_t = make_view(grad_t.data(), e4m3, device, {F, T});
  bwd.partials = make_view(partials.data(), f32, device, {kGradScalePartials});
  bwd.grad_x = make_view(grad_x.data(), bf16, device, {T, C});
  bwd.grad_qk_weight = make_view(grad_w_base, bf16, device, {2 * H * D, C});
  bwd.grad_v_weight = make_view(grad_w_base + 2 * H * D * C, bf16, device, {H * Dv, C});
  bwd.grad_qkv_scale = scalar(4);
  bwd.layout = layout;
  bwd.stream = stream;
  packed_qkv_backward(bwd);

  Results r;
  r.q = q.download<uint16_t>();
  r.k = k.download<uint16_t>();
  const auto all = qkv.download<uint16_t>();
  for (int64_t t = 0; t < T; ++t)
    r.v.insert(r.v.end(), all.begin() + t * F + 2 * H * D, all.begin() + (t + 1) * F);
  r.grad_x = grad_x.download<uint16_t>();
  r.grad_weight = grad_w.download<uint16_t>();
  const auto s = scales.download<float>();
  r.weight_scale = s[1];
  r.grad_qkv_scale = s[4];
  return r;
}

double relative_error(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  double diff = 0, ref = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = bf16_to_float(a[i]), y = bf16_to_float(b[i]);
    diff += (x - y) * (x - y);
    ref += y * y;
  }
  return std::sqrt(diff / (ref > 0 ? ref : 1));
}

/// The RMS of each q/k row: the norm makes it 1 and the rotation (cos^2 + sin^2 = 1) keeps it.
/// Returns whether every row is within 2 % of 1 (bf16 rounding of the factors and outputs).
bool check_row_rms(const char* name, const std::vector<uint16_t>& rows) {
  double lo = 1e9, hi = 0;
  for (size_t r = 0; r < rows.size() / kHeadDim; ++r) {
    double sum = 0;
    for (int64_t d = 0; d < kHeadDim; ++d) {
      const double v = bf16_to_float(rows[r * kHeadDim + d]);
      sum += v * v;
    }
    const double rms = std::sqrt(sum / kHeadDim);
    lo = std::min(lo, rms);
    hi = std::max(hi, rms);
  }
  const bool ok = lo > 0.98 && hi < 1.02;
  std::printf("  %s rows: RMS in [%.4f, %.4f] (rms-norm then rotation: expect 1 +- 2 %%) %s\n", name,
              lo, hi, ok ? "ok" : "FAILED");
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  bool force_cpu = false;
  int64_t tokens = -1;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--cpu") force_cpu = true;
    else if (arg == "--tokens" && i + 1 < argc) tokens = std::stoll(argv[++i]);
    else {
      std::fprintf(stderr, "usage: %s [--tokens T] [--cpu]\n", argv[0]);
      return 2;
    }
  }
  try {
    const bool gpu = !force_cpu && cuda_device_count() > 0;
    if (tokens < 0) tokens = gpu ? 2048 : 256;
    std::printf("qkvfuse demo: one attention layer, T=%lld tokens, C=%lld, H=%lld, D=%lld, Dv=%lld (%s)\n",
                (long long)tokens, (long long)kModel, (long long)kHeads, (long long)kHeadDim,
                (long long)kValueDim, gpu ? "CUDA backend, checked against the CPU backend" : "CPU backend");
    const Inputs in = make_inputs(tokens);
    const Results cpu_results = run_layer(Device{DeviceType::kCPU, 0}, tokens, in, nullptr);
    const Results& main_results = cpu_results;
    std::printf("forward: x -> e4m3 [T, C] + [C, T]; W -> e4m3 with weight_scale = amax/448 = %.3g\n",
                main_results.weight_scale);
    bool ok = check_row_rms("q", main_results.q) & check_row_rms("k", main_results.k);
    // grad qkv_scale = sum(grad_W_unscaled * W) and grad_W = bf16(grad_W_unscaled * qkv_scale), so
    // sum(grad_W * W) / qkv_scale recomputes it up to the bf16 rounding of each grad_W element
    // (2^-8 relative at most, random in sign: a 6-sigma bound on the sum of those errors).
    double grad_w_sq = 0, recomputed = 0, product_sq = 0;
    for (size_t i = 0; i < main_results.grad_weight.size(); ++i) {
      const double g = bf16_to_float(main_results.grad_weight[i]) / 0.9;
      const double w = bf16_to_float(in.weight[i]);
      grad_w_sq += g * g * 0.81;
      recomputed += g * w;
      product_sq += (g * w) * (g * w);
    }
    const double difference = std::fabs(recomputed - main_results.grad_qkv_scale);
    const double bound = 6 * std::ldexp(1.0, -8) * std::sqrt(product_sq);
    const bool identity_ok = difference <= bound;
    ok = ok && identity_ok;
    std::printf("backward: |grad W| = %.4g, grad qkv_scale = %.6g; sum(grad W * W) / qkv_scale = "
                "%.6g (difference %.1e, bound %.1e) %s\n",
                std::sqrt(grad_w_sq), main_results.grad_qkv_scale, recomputed, difference, bound,
                identity_ok ? "ok" : "FAILED");
    if (gpu) {
      const Results g = run_layer(Device{DeviceType::kCUDA, 0}, tokens, in, nullptr);
      struct Check { const char* name; double error, bound; } checks[] = {
          {"q", relative_error(g.q, cpu_results.q), 1e-2},
          {"k", relative_error(g.k, cpu_results.k), 1e-2},
          {"v", relative_error(g.v, cpu_results.v), 1e-2},
          {"grad x", relative_error(g.grad_x, cpu_results.grad_x), 2e-2},
          {"grad W", relative_error(g.grad_weight, cpu_results.grad_weight), 2e-2},
      };
      for (const auto& c : checks) {
        std::printf("  GPU vs CPU %-7s relative error %.2e (bound %.0e)\n", c.name, c.error, c.bound);
        ok = ok && c.error <= c.bound;
      }
      const double scale_error = std::fabs(g.grad_qkv_scale - cpu_results.grad_qkv_scale) /
                                 std::max(1e-30, double(std::fabs(cpu_results.grad_qkv_scale)));
      std::printf("  GPU vs CPU grad qkv_scale relative error %.2e (bound 2e-2)\n", scale_error);
      ok = ok && scale_error <= 2e-2;
      std::printf("%s\n", ok ? "OK: GPU matches the CPU reference" : "MISMATCH between GPU and CPU");
      return ok ? 0 : 1;
    }
    std::printf("%s\n", ok ? "OK: every check passed" : "FAILED");
    return ok ? 0 : 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "qkvfuse error: %s\n", e.what());
    return 1;
  }
}
