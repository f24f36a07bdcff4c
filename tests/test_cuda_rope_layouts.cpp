// test_cuda_rope_layouts.cpp: the general layouts of SPEC.md section 8 on the CUDA backend, against
// the CPU backend through the public API (which test_cpu_rope_layouts.cpp judges against the
// float64 model): GQA and MQA heads, NeoX and interleaved rotary (NeoX r % 16 != 0 too), partial
// and zero rotary widths, no norm / RMS / RMS * w / RMS * (1 + w) with any eps, factor tables or a
// cos/sin cache at int32 / int64 positions (packed documents, out-of-range positions), the norm
// weights' gradients and their workspace, real model shapes at a few thousand tokens, odd head
// widths (D = 100, 98, 34, ...) and misaligned pointers for the narrow accesses, and the packed op
// with GQA and weights.
//
// Every case runs the op on CPU views and on CUDA copies of the same bytes:
//   - bf16 outputs (q, k, grad_qk): identical, one bf16 ulp apart, or (where a row's fp32 sums
//     cancel and may round differently) within kSumOrderNoise of the row's largest value or of
//     the backward's term scale (ref::RopeGradients::term_scale);
//   - grad_row / grad_t: V codes identical, Q/K codes within one e4m3 step (or the same row
//     noise), grad_t exactly the GPU's grad_row transposed;
//   - the norm weights' gradients: both backends sum the same float32 terms in fixed but different
//     orders, each within test::fp32_sum_tolerance of the exact sum, so within twice that of each
//     other (plus one ulp of a bf16 weight);
//   - NaN exactly where the CPU has NaN; every GPU run twice, bit-identical.
// Outputs and workspaces are poisoned (bf16 0x7fc1, float32 0x7fc12345, e4m3 0xff: values no
// computation produces) inside guard bytes that must stay poisoned.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "gpu_util.hpp"
#include "qkvfuse/qkvfuse.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace qkvfuse::test {
namespace {

constexpr uint8_t kPoisonCode = 0xff;  // e4m3 negative NaN: every NaN result is 0x7f
constexpr uint32_t kPoisonF32Bits = 0x7fc12345u;
constexpr int64_t kGuardBytes = 64;

// ---- device memory ---------------------------------------------------------------------------------

/// The bytes of one poisoned element of `dtype`.
std::vector<uint8_t> poison_of(DType dtype) {
  std::vector<uint8_t> bytes(dtype_size(dtype), kPoisonCode);
  if (dtype == DType::kBFloat16) std::memcpy(bytes.data(), &kPoisonBF16, 2);
  if (dtype == DType::kFloat32) std::memcpy(bytes.data(), &kPoisonF32Bits, 4);
  return bytes;
}

/// A contiguous poisoned device output `offset` elements past its allocation's start, followed by
/// kGuardBytes of poison that no kernel may write.
class DeviceOut {
 public:
  DeviceOut(DType dtype, std::vector<int64_t> sizes, int64_t offset = 0)
      : dtype_(dtype), sizes_(std::move(sizes)), offset_(offset) {
    int64_t count = 1;
    for (int64_t s : sizes_) count *= s;
    count_ = count;
    const size_t element = dtype_size(dtype);
    const size_t bytes = size_t(offset + count) * element + kGuardBytes;
    buffer_ = DeviceBuffer(bytes);
    std::vector<uint8_t> pattern(bytes);
    const std::vector<uint8_t> poison = poison_of(dtype);
    for (size_t i = 0; i < bytes; ++i) pattern[i] = poison[i % element];
    buffer_.upload(pattern.data(), bytes);
  }
  TensorView view() const {
    char* data = static_cast<char*>(buffer_.data()) + offset_ * int64_t(dtype_size(dtype_));
    std::vector<int64_t> sizes = sizes_;
    switch (sizes.size()) {
      case 0: return make_view(data, dtype_, kGPU, {});
      case 1: return make_view(data, dtype_, kGPU, {sizes[0]});
      case 2: return make_view(data, dtype_, kGPU, {sizes[0], sizes[1]});
      default: return make_view(data, dtype_, kGPU, {sizes[0], sizes[1], sizes[2]});
    }
  }
  /// The output's bytes; fails the test when a byte outside it was written.
  std::vector<uint8_t> read(const std::string& name) const {
    synchronize();
    const std::vector<uint8_t> all = buffer_.to_host<uint8_t>();
    const size_t element = dtype_size(dtype_);
    const size_t begin = size_t(offset_) * element, end = begin + size_t(count_) * element;
    const std::vector<uint8_t> poison = poison_of(dtype_);
    int64_t outside = 0;
    for (size_t i = 0; i < all.size(); ++i) {
      if ((i < begin || i >= end) && all[i] != poison[i % element]) ++outside;
    }
    EXPECT_EQ(outside, 0) << name << ": bytes outside the output were written";
    return std::vector<uint8_t>(all.begin() + long(begin), all.begin() + long(end));
  }
  bool untouched() const {
    const std::vector<uint8_t> all = buffer_.to_host<uint8_t>();
    const std::vector<uint8_t> poison = poison_of(dtype_);
    for (size_t i = 0; i < all.size(); ++i) {
      if (all[i] != poison[i % poison.size()]) return false;
    }
    return true;
  }

 private:
  DType dtype_;
  std::vector<int64_t> sizes_;
  int64_t offset_ = 0;
  int64_t count_ = 0;
  DeviceBuffer buffer_;
};

std::vector<uint16_t> as_u16(const std::vector<uint8_t>& bytes) {
  std::vector<uint16_t> out(bytes.size() / 2);
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), out.size() * 2);
  return out;
}

/// Values of bf16 or float32 bytes.
std::vector<double> values_of(const std::vector<uint8_t>& bytes, DType dtype) {
  std::vector<double> out;
  if (dtype == DType::kFloat32) {
    for (size_t i = 0; i + 4 <= bytes.size(); i += 4) {
      float v = 0;
      std::memcpy(&v, &bytes[i], 4);
      out.push_back(v);
    }
  } else {
    for (uint16_t v : as_u16(bytes)) out.push_back(bf16_to_float(v));
  }
  return out;
}

/// Element offsets of the device copies (1 for a bf16 tensor: a 2-byte aligned pointer).
struct Offsets {
  int64_t qk = 0, angles = 0, positions = 0, weights = 0, grads = 0, outputs = 0;
  bool any() const { return qk || angles || positions || weights || grads || outputs; }
};

/// Device copies of a RopeData's inputs, and its layout on them.
struct DeviceRope {
  DeviceView qk;
  std::optional<DeviceView> factor1, factor2, cos_sin, positions, q_weight, k_weight;
  RopeLayout layout;

  DeviceRope(RopeData& data, const Offsets& at) : qk(to_device(data.qk_tensor->view(), at.qk)) {
    layout = data.layout();
    const auto copy = [](std::optional<DeviceView>& slot, const TensorView& host, int64_t offset,
                         TensorView& into) {
      if (is_absent(host)) return;
      slot.emplace(to_device(host, offset));
      into = slot->view;
    };
    copy(factor1, layout.factor1, at.angles, layout.factor1);
    copy(factor2, layout.factor2, at.angles, layout.factor2);
    copy(cos_sin, layout.cos_sin, at.angles, layout.cos_sin);
    copy(positions, layout.positions, at.positions, layout.positions);
    copy(q_weight, layout.q_weight, at.weights, layout.q_weight);
    copy(k_weight, layout.k_weight, at.weights, layout.k_weight);
  }
};

/// A CUDA stream of the test's own: the kernels must run on the stream they are given.
class TestStream {
 public:
  TestStream() { EXPECT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess); }
  ~TestStream() { cudaStreamDestroy(stream_); }
  cudaStream_t get() const { return stream_; }
  void sync() const { ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess); }

 private:
  cudaStream_t stream_ = nullptr;
};

// ---- comparisons ---------------------------------------------------------------------------------

int32_t e4m3_order(uint8_t code) {
  return (code & 0x80) ? -int32_t(code & 0x7f) : int32_t(code & 0x7f);
}
bool e4m3_nan(uint8_t code) { return (code & 0x7f) == 0x7f; }

/// A Comparison with this file's summary and log prefix.
struct Diff : Comparison {
  std::string summary() const {
    std::ostringstream out;
    out << what << ": " << count << " elements, " << exact << " exact, " << one_step
        << " by 1 step, " << in_noise << " in sum-order noise, " << unwritten << " unwritten, "
        << bad << " bad" << (first_bad.empty() ? "" : " (first: " + first_bad + ")");
    return out.str();
  }
};

::testing::AssertionResult clean(const Diff& diff) {
  std::printf("[gpu vs cpu] %s\n", diff.summary().c_str());
  if (diff.bad == 0 && diff.unwritten == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << diff.summary();
}

/// bf16 rows of `row_length`, GPU against CPU within kSumOrderNoise (compare_bf16_gpu_cpu);
/// `term_scale` per row widens the noise (backward).
Diff compare_rows(const std::string& what, const std::vector<uint16_t>& gpu,
                  const std::vector<uint16_t>& cpu, int64_t row_length,
                  const std::vector<double>& term_scale = {}) {
  return Diff{compare_bf16_gpu_cpu(what, gpu, cpu, row_length, kSumOrderNoise, term_scale)};
}

/// grad_row [T][qkv_dim], GPU against CPU: Q/K rows (Hq + Hkv of D) within one e4m3 step or the
/// row noise (with the term scale over grad_scale), V rows (Hkv of Dv) identical.
Diff compare_grad_row(const ref::Rope& rope, int64_t v_dim, float grad_scale,
                      const std::vector<uint8_t>& gpu, const std::vector<uint8_t>& cpu,
                      const std::vector<double>& term_scale) {
  Diff diff;
  diff.what = "grad_row";
  diff.count = int64_t(cpu.size());
  const int64_t rows = rope.input_heads(), D = rope.head_dim;
  const int64_t features = ref::qkv_dim(rope, v_dim);
  for (int64_t t = 0; t < rope.tokens; ++t) {
    for (int64_t row = 0; row < rows + rope.k_heads(); ++row) {
      const bool qk_row = row < rows;
      const int64_t begin = qk_row ? row * D : rows * D + (row - rows) * v_dim;
      const int64_t end = begin + (qk_row ? D : v_dim);
      double row_max = 0;
      for (int64_t f = begin; f < end; ++f) {
        const double v = std::fabs(double(e4m3_to_float(cpu[size_t(t * features + f)])));
        if (std::isfinite(v)) row_max = std::max(row_max, v);
      }
      if (qk_row && grad_scale > 0) {
        row_max = std::max(row_max, term_scale[size_t(t * rows + row)] / grad_scale);
      }
      for (int64_t f = begin; f < end; ++f) {
        const size_t i = size_t(t * features + f);
        const uint8_t a = gpu[i], b = cpu[i];
        bool ok = true;
        if (a == kPoisonCode) {
          ++diff.unwritten;
          continue;
        } else if (e4m3_nan(a) || e4m3_nan(b)) {
          ok = a == b;
          if (ok) ++diff.exact;
        } else if (a == b) {
          ++diff.exact;
        } else if (qk_row && std::abs(e4m3_order(a) - e4m3_order(b)) <= 1) {
          ++diff.one_step;
        } else if (qk_row && std::fabs(double(e4m3_to_float(a)) - double(e4m3_to_float(b))) <=
                                 kSumOrderNoise * row_max + std::fabs(e4m3_to_float(b)) / 16) {
          ++diff.in_noise;
        } else {
          ok = false;
        }
        if (!ok && diff.bad++ == 0) {
          std::ostringstream out;
          out << "token " << t << " feature " << f << (qk_row ? " (Q/K)" : " (V)") << ": gpu 0x"
              << std::hex << int(a) << " cpu 0x" << int(b);
          diff.first_bad = out.str();
        }
      }
    }
  }
  return diff;
}

/// A norm weight's gradient, GPU against CPU (see the header).
::testing::AssertionResult weight_grads_agree(const std::string& what, DType dtype,
                                              const std::vector<double>& gpu,
                                              const std::vector<double>& cpu,
                                              const std::vector<double>& magnitude,
                                              int64_t terms) {
  const std::vector<double> tolerance = fp32_sum_tolerance(magnitude, terms);
  for (size_t d = 0; d < cpu.size(); ++d) {
    const double ulp = dtype == DType::kBFloat16 ? std::ldexp(std::fabs(cpu[d]), -7) : 0.0;
    const bool ok = (std::isnan(gpu[d]) && std::isnan(cpu[d])) || gpu[d] == cpu[d] ||
                    std::fabs(gpu[d] - cpu[d]) <= 2 * tolerance[d] + ulp;
    if (!ok) {
      return ::testing::AssertionFailure()
             << what << "[" << d << "]: gpu " << gpu[d] << ", cpu " << cpu[d] << ", tolerance "
             << 2 * tolerance[d] + ulp;
    }
  }
  return ::testing::AssertionSuccess();
}

// ---- the ops on both backends ------------------------------------------------------------------------

/// Output gradients for a RopeData (bf16, dense), fresh random.
struct Grads {
  std::vector<double> q, k;
  HostTensor q_tensor, k_tensor;
  Grads(std::mt19937_64& rng, const ref::Rope& rope)
      : q(random_values(rng, rope.q_count(), DType::kBFloat16)),
        k(random_values(rng, rope.k_count(), DType::kBFloat16)),
        q_tensor(DType::kBFloat16, {rope.out_tokens(), rope.q_out_heads(), rope.head_dim}),
        k_tensor(DType::kBFloat16, {rope.out_tokens(), rope.k_out_heads(), rope.head_dim}) {
    q_tensor.set(q);
    k_tensor.set(k);
  }
};

/// The norm weights' gradients of one backward call, [D] in the weights' dtype, each present
/// exactly when its weight is: host tensors for the CPU's call (Tensor = HostTensor), poisoned
/// device outputs for a GPU run (Tensor = DeviceOut).
template <typename Tensor>
struct WeightGradOutputs {
  DType dtype;
  std::optional<Tensor> q, k;

  explicit WeightGradOutputs(const RopeData& data) : dtype(data.spec.weight_dtype) {
    if (data.q_weight) q.emplace(dtype, std::vector<int64_t>{data.rope.head_dim});
    if (data.k_weight) k.emplace(dtype, std::vector<int64_t>{data.rope.head_dim});
  }
  TensorView q_view() { return q ? q->view() : TensorView{}; }
  TensorView k_view() { return k ? k->view() : TensorView{}; }
  /// A GPU run's gradients, read back (no bytes for an absent weight).
  std::vector<uint8_t> read_q() const {
    return q ? q->read("grad_q_weight") : std::vector<uint8_t>{};
  }
  std::vector<uint8_t> read_k() const {
    return k ? k->read("grad_k_weight") : std::vector<uint8_t>{};
  }
};

/// A GPU run's weight gradients (`got_q`, `got_k`: WeightGradOutputs<DeviceOut>::read_q/read_k)
/// against the CPU's, for each weight given (weight_grads_agree).
void expect_weight_grads_agree(const WeightGradOutputs<HostTensor>& cpu,
                               const std::vector<uint8_t>& got_q, const std::vector<uint8_t>& got_k,
                               const ref::RopeGradients& model) {
  if (cpu.q) {
    EXPECT_TRUE(weight_grads_agree("grad_q_weight", cpu.dtype, values_of(got_q, cpu.dtype),
                                   cpu.q->get(), model.q_weight_magnitude, model.q_weight_terms));
  }
  if (cpu.k) {
    EXPECT_TRUE(weight_grads_agree("grad_k_weight", cpu.dtype, values_of(got_k, cpu.dtype),
                                   cpu.k->get(), model.k_weight_magnitude, model.k_weight_terms));
  }
}

/// Puts into `slot` (a workspace of `params`) the float32 workspace `params` asks for, poisoned
/// (NaN), held by `holder`; none when it asks for 0 elements. Returns the size asked for.
template <typename Params>
int64_t attach_workspace(Params& params, TensorView& slot, std::optional<DeviceOut>& holder) {
  const int64_t size = backward_workspace_size(params);
  if (size > 0) {
    holder.emplace(DType::kFloat32, std::vector<int64_t>{size});
    slot = holder->view();
  }
  return size;
}

void check_forward(RopeData& data, const Offsets& at = {}) {
  SCOPED_TRACE("forward");
  const ref::Rope& r = data.rope;
  HostTensor q(DType::kBFloat16, {r.out_tokens(), r.q_out_heads(), r.head_dim});
  HostTensor k(DType::kBFloat16, {r.out_tokens(), r.k_out_heads(), r.head_dim});
  qk_norm_rope({data.qk_tensor->view(), q.view(), k.view(), data.layout()});

  const DeviceRope dev(data, at);
  TestStream stream;
  std::vector<uint16_t> first_q, first_k;
  for (int run = 0; run < 2; ++run) {
    DeviceOut gq(DType::kBFloat16, {r.out_tokens(), r.q_out_heads(), r.head_dim}, at.outputs);
    DeviceOut gk(DType::kBFloat16, {r.out_tokens(), r.k_out_heads(), r.head_dim}, at.outputs);
    synchronize();  // the poison lands before the op's stream starts
    qk_norm_rope({dev.qk.view, gq.view(), gk.view(), dev.layout, stream.get()});
    stream.sync();
    const std::vector<uint16_t> got_q = as_u16(gq.read("q")), got_k = as_u16(gk.read("k"));
    if (run == 0) {
      EXPECT_TRUE(clean(compare_rows("q", got_q, q.get_bf16_bits(), r.head_dim)));
      EXPECT_TRUE(clean(compare_rows("k", got_k, k.get_bf16_bits(), r.head_dim)));
      first_q = got_q;
      first_k = got_k;
    } else {
      EXPECT_TRUE(got_q == first_q && got_k == first_k) << "a rerun is not bit-identical";
    }
  }
}

/// The bf16 backward with the weight gradients (and the workspace the CUDA backend asks for).
void check_backward(RopeData& data, std::mt19937_64& rng, const Offsets& at = {}) {
  SCOPED_TRACE("backward");
  const ref::Rope& r = data.rope;
  Grads grads(rng, r);
  HostTensor grad_qk(DType::kBFloat16, {r.tokens, r.input_heads(), r.head_dim});
  WeightGradOutputs<HostTensor> cpu_weights(data);
  qk_norm_rope_backward({.grad_q = grads.q_tensor.view(),
                         .grad_k = grads.k_tensor.view(),
                         .qk = data.qk_tensor->view(),
                         .grad_qk = grad_qk.view(),
                         .grad_q_weight = cpu_weights.q_view(),
                         .grad_k_weight = cpu_weights.k_view(),
                         .layout = data.layout()});
  const ref::RopeGradients model = ref::rope_gradients(r, grads.q, grads.k, data.qk, data.tensors);

  const DeviceRope dev(data, at);
  const DeviceView dq = to_device(grads.q_tensor.view(), at.grads);
  const DeviceView dk = to_device(grads.k_tensor.view(), at.grads);
  TestStream stream;
  std::vector<uint8_t> first[3];
  for (int run = 0; run < 2; ++run) {
    DeviceOut gqk(DType::kBFloat16, {r.tokens, r.input_heads(), r.head_dim}, at.outputs);
    WeightGradOutputs<DeviceOut> weights(data);
    std::optional<DeviceOut> workspace;
    QkNormRopeBackwardParams p{.grad_q = dq.view,
                               .grad_k = dk.view,
                               .qk = dev.qk.view,
                               .grad_qk = gqk.view(),
                               .grad_q_weight = weights.q_view(),
                               .grad_k_weight = weights.k_view(),
                               .layout = dev.layout,
                               .stream = stream.get()};
    const int64_t size = attach_workspace(p, p.workspace, workspace);
    if (!weights.q && !weights.k) EXPECT_EQ(size, 0) << "a workspace without norm weights";
    synchronize();
    qk_norm_rope_backward(p);
    stream.sync();
    const std::vector<uint8_t> got = gqk.read("grad_qk");
    const std::vector<uint8_t> got_qw = weights.read_q(), got_kw = weights.read_k();
    if (run == 0) {
      EXPECT_TRUE(clean(compare_rows("grad_qk", as_u16(got), grad_qk.get_bf16_bits(), r.head_dim,
                                     model.term_scale)));
      expect_weight_grads_agree(cpu_weights, got_qw, got_kw, model);
      first[0] = got;
      first[1] = got_qw;
      first[2] = got_kw;
    } else {
      EXPECT_TRUE(got == first[0]) << "grad_qk: a rerun is not bit-identical";
      EXPECT_TRUE(got_qw == first[1] && got_kw == first[2])
          << "the weight gradients of a rerun are not bit-identical";
    }
  }
}

/// qkv_backward_fp8 with the weight gradients.
void check_fp8(RopeData& data, std::mt19937_64& rng, int64_t v_dim, float grad_scale,
               const Offsets& at = {}) {
  SCOPED_TRACE(::testing::Message() << "qkv_backward_fp8 Dv=" << v_dim);
  const ref::Rope& r = data.rope;
  const int64_t T = r.tokens, features = ref::qkv_dim(r, v_dim);
  Grads grads(rng, r);
  HostTensor grad_v(DType::kBFloat16, {T, r.k_heads(), v_dim});
  grad_v.set(random_values(rng, size_t(T * r.k_heads() * v_dim), DType::kBFloat16));
  HostTensor scale(DType::kFloat32, {});
  scale.set({grad_scale});
  HostTensor row(DType::kFloat8E4M3, {T, features}), t(DType::kFloat8E4M3, {features, T});
  WeightGradOutputs<HostTensor> cpu_weights(data);
  qkv_backward_fp8({.grad_q = grads.q_tensor.view(),
                    .grad_k = grads.k_tensor.view(),
                    .grad_v = grad_v.view(),
                    .qk = data.qk_tensor->view(),
                    .grad_scale = scale.view(),
                    .grad_row = row.view(),
                    .grad_t = t.view(),
                    .grad_q_weight = cpu_weights.q_view(),
                    .grad_k_weight = cpu_weights.k_view(),
                    .layout = data.layout()});
  const ref::RopeGradients model = ref::rope_gradients(r, grads.q, grads.k, data.qk, data.tensors);

  const DeviceRope dev(data, at);
  const DeviceView dq = to_device(grads.q_tensor.view(), at.grads);
  const DeviceView dk = to_device(grads.k_tensor.view(), at.grads);
  const DeviceView dv = to_device(grad_v.view(), at.grads);
  const DeviceView ds = to_device(scale.view());
  TestStream stream;
  std::vector<uint8_t> first[4];
  for (int run = 0; run < 2; ++run) {
    DeviceOut grow(DType::kFloat8E4M3, {T, features}, at.outputs);
    DeviceOut gt(DType::kFloat8E4M3, {features, T}, at.outputs);
    WeightGradOutputs<DeviceOut> weights(data);
    std::optional<DeviceOut> workspace;
    QkvBackwardFp8Params p{.grad_q = dq.view,
                           .grad_k = dk.view,
                           .grad_v = dv.view,
                           .qk = dev.qk.view,
                           .grad_scale = ds.view,
                           .grad_row = grow.view(),
                           .grad_t = gt.view(),
                           .grad_q_weight = weights.q_view(),
                           .grad_k_weight = weights.k_view(),
                           .layout = dev.layout,
                           .stream = stream.get()};
    attach_workspace(p, p.workspace, workspace);
    synchronize();
    qkv_backward_fp8(p);
    stream.sync();
    const std::vector<uint8_t> got_row = grow.read("grad_row"), got_t = gt.read("grad_t");
    const std::vector<uint8_t> got_qw = weights.read_q(), got_kw = weights.read_k();
    if (run == 0) {
      EXPECT_TRUE(clean(compare_grad_row(r, v_dim, grad_scale, got_row, row.get_codes(),
                                         model.term_scale)));
      EXPECT_TRUE(got_t == transpose(got_row, T, features)) << "grad_t is not grad_row^T";
      expect_weight_grads_agree(cpu_weights, got_qw, got_kw, model);
      first[0] = got_row;
      first[1] = got_t;
      first[2] = got_qw;
      first[3] = got_kw;
    } else {
      EXPECT_TRUE(got_row == first[0] && got_t == first[1]) << "a rerun is not bit-identical";
      EXPECT_TRUE(got_qw == first[2] && got_kw == first[3])
          << "the weight gradients of a rerun are not bit-identical";
    }
  }
}

void check_all(RopeData& data, std::mt19937_64& rng, int64_t v_dim, const Offsets& at = {}) {
  check_forward(data, at);
  check_backward(data, rng, at);
  check_fp8(data, rng, v_dim, 1.0f / 64, at);
}

// ---- the options, combined ---------------------------------------------------------------------------

struct Options {
  int64_t q_heads, kv_heads, rotary;  ///< rotary: -1 the whole head
  bool neox, normalize, q_weight, k_weight;
  double offset, eps;
  bool cache;
  DType angle_dtype, position_dtype, weight_dtype;
};

/// Every option against each other at one width and token count.
std::vector<Options> option_grid(int64_t head_dim) {
  std::vector<Options> grid;
  const int64_t half = head_dim / 4 * 2;
  const int64_t heads[][2] = {{4, 4}, {8, 2}, {6, 1}, {3, 3}};
  const int64_t rotaries[] = {-1, half, 0, std::max<int64_t>(2, head_dim - 2)};
  int index = 0;
  for (const auto& h : heads) {
    for (bool neox : {false, true}) {
      for (int64_t rotary : rotaries) {
        for (int norm = 0; norm < 4; ++norm) {  // none, RMS, RMS * w (both), RMS * (1 + w)
          for (bool cache : {false, true}) {
            Options o{h[0], h[1], rotary, neox, norm != 0, norm >= 2, norm >= 2,
                      norm == 3 ? 1.0 : 0.0,
                      index % 3 == 0 ? 1.0 / 8388608.0 : double(1e-6f), cache,
                      index % 2 ? DType::kFloat32 : DType::kBFloat16,
                      index % 4 < 2 ? DType::kInt32 : DType::kInt64,
                      index % 5 == 0 ? DType::kFloat32 : DType::kBFloat16};
            if (norm == 2 && index % 3 == 1) o.k_weight = false;  // one weight alone
            grid.push_back(o);
            ++index;
          }
        }
      }
    }
  }
  return grid;
}

RopeData make_data(std::mt19937_64& rng, int64_t tokens, int64_t head_dim, const Options& o,
                   int64_t qk_row_pad = 0) {
  ref::Rope rope;
  rope.tokens = tokens;
  rope.heads = o.q_heads;
  rope.kv_heads = o.kv_heads;
  rope.head_dim = head_dim;
  rope.rotary_dim = o.rotary;
  rope.neox = o.neox;
  rope.normalize = o.normalize;
  rope.weight_offset = o.offset;
  rope.eps = o.eps;
  RopeSpec spec;
  spec.cache = o.cache;
  spec.angle_dtype = o.angle_dtype;
  spec.position_dtype = o.position_dtype;
  spec.packed = tokens % 2 == 1;
  spec.q_weight = o.q_weight;
  spec.k_weight = o.k_weight;
  spec.weight_dtype = o.weight_dtype;
  spec.weight_mean = o.offset != 0 ? 0.0 : 1.0;
  spec.qk_row_pad = qk_row_pad;
  return RopeData(rope, spec, rng);
}

std::string describe(const RopeData& data) {
  return qkvfuse::test::describe(data.rope) + "; " + data.spec.describe();
}

TEST(CudaRopeLayouts, EveryOptionAtVectorWidths) {
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  for (int64_t head_dim : {64, 128}) {
    int index = 0;
    for (const Options& o : option_grid(head_dim)) {
      const int64_t tokens = (index++ % 3 == 0) ? 130 : 17;
      RopeData data = make_data(rng, tokens, head_dim, o, index % 4 == 0 ? 8 * o.kv_heads : 0);
      SCOPED_TRACE(describe(data));
      check_all(data, rng, index % 2 ? head_dim : 96);
    }
  }
}

TEST(CudaRopeLayouts, EveryOptionAtOddWidths) {
  // Widths off the 16-byte vectors (D = 100, 98, 34, 2, 254): the narrow accesses.
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  for (int64_t head_dim : {100, 98, 34, 2, 254}) {
    int index = 0;
    for (const Options& o : option_grid(head_dim)) {
      if (index++ % 2 && head_dim != 100) continue;  // half the grid at the other widths
      RopeData data = make_data(rng, index % 3 ? 7 : 33, head_dim, o);
      SCOPED_TRACE(describe(data));
      check_all(data, rng, index % 2 ? 50 : 7);
    }
  }
}

TEST(CudaRopeLayouts, NeoxRotaryWidthsNotAMultipleOf16) {
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  for (int64_t rotary : {2, 8, 24, 40, 62, 88, 120, 126}) {
    for (bool cache : {false, true}) {
      Options o{8, 2, rotary, true, true, true, true, 0.0, double(1e-6f), cache,
                DType::kBFloat16, DType::kInt64, DType::kBFloat16};
      RopeData data = make_data(rng, 65, 128, o);
      SCOPED_TRACE(describe(data));
      check_all(data, rng, 128);
    }
  }
  // Interleaved lanes over a cache with r % 8 != 0.
  for (int64_t rotary : {2, 6, 18, 100}) {
    Options o{4, 4, rotary, false, true, true, false, 0.0, double(1e-6f), true, DType::kFloat32,
              DType::kInt32, DType::kFloat32};
    RopeData data = make_data(rng, 31, 128, o);
    SCOPED_TRACE(describe(data));
    check_all(data, rng, 64);
  }
}

TEST(CudaRopeLayouts, MisalignedPointers) {
  // Vector widths (D = 128, r = 64 NeoX, Dv = 128) with one tensor at a time (then all) one
  // element past 16 bytes: the CUDA backend must take each with narrower accesses and agree.
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  const Offsets cases[] = {{1, 0, 0, 0, 0, 0}, {0, 1, 0, 0, 0, 0}, {0, 0, 1, 0, 0, 0},
                           {0, 0, 0, 1, 0, 0}, {0, 0, 0, 0, 1, 0}, {0, 0, 0, 0, 0, 1},
                           {2, 2, 1, 2, 2, 2}, {3, 1, 1, 3, 1, 1}};
  for (bool cache : {true, false}) {
    for (const Offsets& at : cases) {
      Options o{8, 2, 64, true, true, true, true, 1.0, double(1e-6f), cache, DType::kBFloat16,
                DType::kInt32, DType::kBFloat16};
      RopeData data = make_data(rng, 40, 128, o, 24);
      SCOPED_TRACE(::testing::Message() << describe(data) << "; offsets qk " << at.qk << " angles "
                                        << at.angles << " positions " << at.positions
                                        << " weights " << at.weights << " grads " << at.grads
                                        << " outputs " << at.outputs);
      check_all(data, rng, 128, at);
    }
  }
}

TEST(CudaRopeLayouts, StridedPositionsPaddedCacheAndWeightOffsets) {
  // positions every other element of an int buffer, cos_sin rows padded, the weights one element
  // into their buffers: views the CPU backend reads through their strides, as CUDA must.
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  for (DType dtype : {DType::kInt32, DType::kInt64}) {
    for (int64_t head_dim : {128, 100}) {
      Options o{6, 2, head_dim / 2, true, true, true, true, 1.0, double(1e-6f), true,
                DType::kFloat32, dtype, DType::kBFloat16};
      RopeData data = make_data(rng, 45, head_dim, o);
      const int64_t P = data.tensors.cache_rows, r = data.rope.rotary();
      data.positions.emplace(dtype, std::vector<int64_t>{45}, std::vector<int64_t>{2}, 1);
      data.cos_sin.emplace(DType::kFloat32, std::vector<int64_t>{P, r},
                           std::vector<int64_t>{r + 3, 1}, 2);
      data.q_weight.emplace(DType::kBFloat16, std::vector<int64_t>{head_dim},
                            std::vector<int64_t>{1}, 1);
      data.refresh();
      SCOPED_TRACE(describe(data));
      check_all(data, rng, 40);
    }
  }
}

// ---- real model shapes at a few thousand tokens ----------------------------------------------------------

struct Model {
  const char* name;
  int64_t q_heads, kv_heads, head_dim, rotary, tokens;
  bool normalize, weights;
  double offset, eps;
};

const Model kModels[] = {
    {"Qwen3-8B", 32, 8, 128, -1, 2048, true, true, 0.0, double(1e-6f)},
    {"Qwen3-0.6B", 16, 8, 128, -1, 4096, true, true, 0.0, double(1e-6f)},
    {"Gemma3", 16, 8, 256, -1, 2048, true, true, 1.0, double(1e-6f)},
    {"GLM-partial", 32, 2, 128, 64, 2048, true, true, 0.0, double(1e-5f)},
    {"Llama-nonorm", 32, 8, 128, -1, 2048, false, false, 0.0, 1.0 / 8388608.0},
};

TEST(CudaRopeLayouts, RealModelShapes) {
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  for (const Model& m : kModels) {
    ref::Rope rope;
    rope.tokens = m.tokens;
    rope.heads = m.q_heads;
    rope.kv_heads = m.kv_heads;
    rope.head_dim = m.head_dim;
    rope.rotary_dim = m.rotary;
    rope.neox = true;
    rope.normalize = m.normalize;
    rope.weight_offset = m.offset;
    rope.eps = m.eps;
    RopeSpec spec;
    spec.cache = true;
    spec.packed = true;
    spec.cache_rows = 1024;
    spec.q_weight = spec.k_weight = m.weights;
    spec.weight_mean = m.offset != 0 ? 0.0 : 1.0;
    spec.qk_row_pad = m.kv_heads * m.head_dim;  // the Q/K columns of the GEMM output
    RopeData data(rope, spec, rng);
    SCOPED_TRACE(std::string(m.name) + ": " + describe(data));
    check_all(data, rng, m.head_dim);
  }
}

// ---- positions -----------------------------------------------------------------------------------------

TEST(CudaRopeLayouts, OutOfRangePositionsGiveNaNWhereTheCpuDoes) {
  // NaN in exactly the rotary lanes of the tokens at bad positions (the CPU backend agrees with
  // the model there: test_cpu_rope_layouts.cpp), and no read outside cos_sin (compute-sanitizer
  // sees any).
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  for (DType dtype : {DType::kInt32, DType::kInt64}) {
    for (bool neox : {false, true}) {
      Options o{4, 2, 32, neox, true, true, true, 0.0, double(1e-6f), true, DType::kBFloat16,
                dtype, DType::kFloat32};
      RopeData data = make_data(rng, 40, 64, o);
      const int64_t P = data.tensors.cache_rows;
      const int64_t huge = dtype == DType::kInt32 ? int64_t(std::numeric_limits<int32_t>::max())
                                                  : int64_t(1) << 40;
      const int64_t tiny = dtype == DType::kInt32 ? int64_t(std::numeric_limits<int32_t>::min())
                                                  : -(int64_t(1) << 40);
      data.tensors.positions[1] = -1;
      data.tensors.positions[7] = P;
      data.tensors.positions[20] = huge;
      data.tensors.positions[39] = tiny;
      data.refresh();
      SCOPED_TRACE(describe(data));
      check_all(data, rng, 64);

      // check_positions on the device names the first bad token.
      const DeviceView positions = to_device(data.positions->view());
      TestStream stream;
      EXPECT_TRUE(throws_error([&] { check_positions(positions.view, P, stream.get()); },
                               {"check_positions: positions[1] = -1 lies outside [0, " +
                                std::to_string(P) + ")"}));
      data.tensors.positions[1] = 0;
      data.refresh();
      const DeviceView later = to_device(data.positions->view());
      EXPECT_TRUE(throws_error([&] { check_positions(later.view, P, stream.get()); },
                               {"positions[7] = " + std::to_string(P)}));
      for (int64_t t : {7, 20, 39}) data.tensors.positions[size_t(t)] = t % P;
      data.refresh();
      const DeviceView good = to_device(data.positions->view());
      EXPECT_NO_THROW(check_positions(good.view, P, stream.get()));
    }
  }
}

/// The pattern of fuzz seed 20261203, cases 2363, 4705 and 8618: an infinite angle (f1, or the
/// cos of the lane's frequency) at lane `inf_lane` of token 2 and at lane `zero_lane` of token 4,
/// whose first key row is all zeros.
void plant_infinite_angles(RopeData& data, int64_t inf_lane, int64_t zero_lane) {
  const ref::Rope& r = data.rope;
  const int64_t D = r.head_dim, rows = r.input_heads(), rotary = r.rotary();
  for (const auto& [t, d] : {std::pair<int64_t, int64_t>{2, inf_lane}, {4, zero_lane}}) {
    if (data.spec.cache) {
      const int64_t i = r.neox ? d % (rotary / 2) : d / 2;  // the lane's frequency
      data.tensors.cos_sin[size_t(data.tensors.positions[size_t(t)] * rotary + i)] = INFINITY;
    } else {
      data.tensors.factor1[size_t(t * r.factor_width() + d)] = INFINITY;
    }
  }
  for (int64_t d = 0; d < D; ++d) data.qk[size_t((4 * rows + r.heads) * D + d)] = 0.0;
  data.refresh();
}

TEST(CudaRopeLayouts, InfiniteAngleWeightGradients) {
  // Fuzz seed 20261203, cases 2363, 4705 and 8618 (GPU NaN, CPU +-inf in grad_k_weight): the
  // kernels give a token's rows fixed slots (the bf16 backward: sets of K rows, NS * K >= Hq +
  // Hkv; qkv_backward_fp8: pairs of rows, one absent when Hq + Hkv is odd), and a slot past the
  // last head loads zeros but shares the token's angles. Under an infinite angle its gw * n was
  // inf * 0 = NaN, added to the key weight's sums. Only the op's rows add terms; a real zero row
  // under an infinite angle does give NaN (CpuSpecialValues.WeightGradientsOfAnInfiniteAngle).
  QKVF_REQUIRE_GPU();
  std::mt19937_64 rng(20261203);
  const int64_t heads[][2] = {{1, 1}, {2, 1}, {3, 3}, {6, 1}};
  for (int64_t head_dim : {64, 100, 34}) {  // 16-byte vectors; the narrow accesses
    for (const auto& h : heads) {
      for (bool cache : {false, true}) {
        for (bool neox : {false, true}) {
          const Options o{h[0], h[1], -1, neox, true, true, true, cache ? 1.0 : 0.0,
                          double(1e-6f), cache, DType::kBFloat16, DType::kInt32,
                          cache ? DType::kBFloat16 : DType::kFloat32};
          RopeData data = make_data(rng, 19, head_dim, o);
          plant_infinite_angles(data, 5, 10);
          SCOPED_TRACE(describe(data));
          check_backward(data, rng);
          check_fp8(data, rng, 104, 1.0f / 448);
        }
      }
    }
  }
}

TEST(CudaRopeLayouts, CheckPositionsRefusesDuringGraphCapture) {
  QKVF_REQUIRE_GPU();
  HostTensor host(DType::kInt32, {4});
  host.set_ints({0, 1, 2, 3});
  const DeviceView positions = to_device(host.view());
  TestStream stream;
  ASSERT_EQ(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_TRUE(throws_error([&] { check_positions(positions.view, 4, stream.get()); },
                           {"check_positions"}));
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(stream.get(), &graph), cudaSuccess);
  if (graph) cudaGraphDestroy(graph);
  EXPECT_NO_THROW(check_positions(positions.view, 4, stream.get()));
}

// ---- the workspace and empty calls ----------------------------------------------------------------------

TEST(CudaRopeLayouts, WorkspaceIsAskedForAndChecked) {
  // With a norm weight the CUDA backward needs a float32 workspace of backward_workspace_size
  // elements; a missing, smaller or non-float32 one is refused by name, and nothing is written.
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  Options o{8, 2, -1, true, true, true, true, 0.0, double(1e-6f), true, DType::kBFloat16,
            DType::kInt64, DType::kBFloat16};
  RopeData data = make_data(rng, 300, 128, o);
  Grads grads(rng, data.rope);
  const DeviceRope dev(data, {});
  const DeviceView dq = to_device(grads.q_tensor.view());
  const DeviceView dk = to_device(grads.k_tensor.view());
  DeviceOut gqk(DType::kBFloat16, {300, 10, 128});
  DeviceOut gqw(DType::kBFloat16, {128}), gkw(DType::kBFloat16, {128});
  QkNormRopeBackwardParams p{.grad_q = dq.view,
                             .grad_k = dk.view,
                             .qk = dev.qk.view,
                             .grad_qk = gqk.view(),
                             .grad_q_weight = gqw.view(),
                             .grad_k_weight = gkw.view(),
                             .layout = dev.layout};
  const int64_t size = backward_workspace_size(p);
  EXPECT_GT(size, 0) << "norm weights on CUDA need a workspace";
  QkNormRopeBackwardParams none = p;
  none.layout.q_weight = none.layout.k_weight = TensorView{};
  none.grad_q_weight = none.grad_k_weight = TensorView{};
  EXPECT_EQ(backward_workspace_size(none), 0);

  EXPECT_TRUE(throws_error([&] { qk_norm_rope_backward(p); },
                           {"qk_norm_rope_backward: workspace: "}));
  DeviceOut small(DType::kFloat32, {std::max<int64_t>(1, size - 1)});
  p.workspace = small.view();
  EXPECT_TRUE(throws_error([&] { qk_norm_rope_backward(p); },
                           {"qk_norm_rope_backward: workspace: expected at least " +
                            std::to_string(size) + " float32 elements"}));
  DeviceOut wrong(DType::kBFloat16, {2 * size});
  p.workspace = wrong.view();
  EXPECT_TRUE(throws_error([&] { qk_norm_rope_backward(p); },
                           {"qk_norm_rope_backward: workspace: expected dtype float32"}));
  synchronize();
  EXPECT_TRUE(gqk.untouched() && gqw.untouched() && gkw.untouched()) << "a refused call wrote";

  // The same for qkv_backward_fp8.
  HostTensor grad_v(DType::kBFloat16, {300, 2, 64});
  grad_v.set(random_values(rng, size_t(300 * 2 * 64), DType::kBFloat16));
  HostTensor scale(DType::kFloat32, {});
  scale.set({1.0 / 448});
  const DeviceView dv = to_device(grad_v.view()), ds = to_device(scale.view());
  const int64_t features = 10 * 128 + 2 * 64;
  DeviceOut row(DType::kFloat8E4M3, {300, features}), t(DType::kFloat8E4M3, {features, 300});
  QkvBackwardFp8Params f{.grad_q = dq.view,
                         .grad_k = dk.view,
                         .grad_v = dv.view,
                         .qk = dev.qk.view,
                         .grad_scale = ds.view,
                         .grad_row = row.view(),
                         .grad_t = t.view(),
                         .grad_q_weight = gqw.view(),
                         .grad_k_weight = gkw.view(),
                         .layout = dev.layout};
  const int64_t fp8_size = backward_workspace_size(f);
  EXPECT_GT(fp8_size, 0);
  EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(f); }, {"qkv_backward_fp8: workspace: "}));
  DeviceOut fp8_small(DType::kFloat32, {std::max<int64_t>(1, fp8_size - 1)});
  f.workspace = fp8_small.view();
  EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(f); },
                           {"qkv_backward_fp8: workspace: expected at least"}));
  synchronize();
  EXPECT_TRUE(row.untouched() && t.untouched() && gqw.untouched() && gkw.untouched());

  // A larger workspace than asked for is fine, whatever it holds.
  DeviceOut big(DType::kFloat32, {size + 1000});
  p.workspace = big.view();
  EXPECT_NO_THROW(qk_norm_rope_backward(p));
  synchronize();
}

TEST(CudaRopeLayouts, ZeroTokensWriteZeroWeightGradients) {
  QKVF_REQUIRE_GPU();
  for (DType weight_dtype : {DType::kBFloat16, DType::kFloat32}) {
    DeviceBuffer guard(1024);
    const int64_t D = 64;
    HostTensor w(weight_dtype, {D}), cos_sin(DType::kBFloat16, {4, D});
    w.set(std::vector<double>(D, 1.0));
    cos_sin.set(std::vector<double>(4 * D, 0.5));
    const DeviceView dw = to_device(w.view()), dc = to_device(cos_sin.view());
    RopeLayout layout;
    layout.num_heads = 4;
    layout.num_kv_heads = 2;
    layout.rotary_style = RotaryStyle::kNeox;
    layout.cos_sin = dc.view;
    layout.positions = make_view(guard.data(), DType::kInt64, kGPU, {0});
    layout.q_weight = layout.k_weight = dw.view;
    const auto empty = [&](int64_t heads) {
      return make_view(guard.data(), DType::kBFloat16, kGPU, {0, heads, D});
    };
    DeviceOut gqw(weight_dtype, {D}), gkw(weight_dtype, {D});
    QkNormRopeBackwardParams p{.grad_q = empty(4),
                               .grad_k = empty(2),
                               .qk = empty(6),
                               .grad_qk = empty(6),
                               .grad_q_weight = gqw.view(),
                               .grad_k_weight = gkw.view(),
                               .layout = layout};
    std::optional<DeviceOut> workspace;
    attach_workspace(p, p.workspace, workspace);
    EXPECT_NO_THROW(qk_norm_rope_backward(p));
    synchronize();
    for (double v : values_of(gqw.read("grad_q_weight"), weight_dtype)) EXPECT_EQ(v, 0.0);
    for (double v : values_of(gkw.read("grad_k_weight"), weight_dtype)) EXPECT_EQ(v, 0.0);
  }
}

// ---- the packed op with GQA and norm weights --------------------------------------------------------------

TEST(CudaRopeLayouts, PackedOpWithGqaWeightsAndACache) {
  // Qwen3-like heads (8 over 2, D = Dv = 128) at T = 256, C = 512: the GPU's forward GEMM within
  // 2^-6 of max(|cpu|, rms(cpu)) (fast accumulation), q and k within 1 ulp of the CPU's rope of the
  // GPU's own qk, the backward's FP8 gradient and the norm weights' gradients as above (same
  // inputs), grad_x and the weight gradient within 1e-2 relative Frobenius of the CPU's.
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  const int64_t T = 256, C = 512, Hq = 8, Hkv = 2, D = 128, Dv = 128;
  const int64_t QK = (Hq + Hkv) * D, V = Hkv * Dv, F = QK + V;
  Options o{Hq, Hkv, -1, true, true, true, true, 0.0, double(1e-6f), true, DType::kBFloat16,
            DType::kInt64, DType::kFloat32};
  RopeData data = make_data(rng, T, D, o);
  const std::vector<uint8_t> x = random_e4m3(rng, size_t(T * C));
  const std::vector<uint8_t> w = random_e4m3(rng, size_t(F * C), 100.0f);
  HostTensor x_f8(DType::kFloat8E4M3, {T, C}), x_f8_t(DType::kFloat8E4M3, {C, T});
  HostTensor w_f8(DType::kFloat8E4M3, {F, C}), w_f8_t(DType::kFloat8E4M3, {C, F});
  x_f8.set_codes(x);
  x_f8_t.set_codes(transpose(x, T, C));
  w_f8.set_codes(w);
  w_f8_t.set_codes(transpose(w, F, C));
  HostTensor x_scale(DType::kFloat32, {}), w_scale(DType::kFloat32, {}), qkv_scale(DType::kFloat32, {});
  x_scale.set({8.0 / 448});
  w_scale.set({0.05 / 448});
  qkv_scale.set({0.83});
  HostTensor qk_weight(DType::kBFloat16, {QK, C}), v_weight(DType::kBFloat16, {V, C});
  qk_weight.set(random_values(rng, size_t(QK * C), DType::kBFloat16, 0.02));
  v_weight.set(random_values(rng, size_t(V * C), DType::kBFloat16, 0.02));
  Grads grads(rng, data.rope);
  HostTensor grad_v(DType::kBFloat16, {T, Hkv, Dv});
  grad_v.set(random_values(rng, size_t(T * V), DType::kBFloat16, 0.02));
  HostTensor grad_scale(DType::kFloat32, {});
  grad_scale.set({1.0 / 448});

  // CPU.
  HostTensor qkv(DType::kBFloat16, {T, F});
  HostTensor q(DType::kBFloat16, {T, Hq, D}), k(DType::kBFloat16, {T, Hkv, D});
  const auto slices = [&](const TensorView& base, Device device) {
    const auto* data16 = static_cast<const uint16_t*>(base.data);
    return std::pair{make_view(const_cast<uint16_t*>(data16), DType::kBFloat16, device,
                               {T, Hq + Hkv, D}, {F, D, 1}),
                     make_view(const_cast<uint16_t*>(data16) + QK, DType::kBFloat16, device,
                               {T, Hkv, Dv}, {F, Dv, 1})};
  };
  const auto [cpu_qk, cpu_v] = slices(qkv.view(), kCPU);
  packed_qkv_forward({.x_f8 = x_f8.view(),
                      .weight_f8 = w_f8.view(),
                      .x_scale = x_scale.view(),
                      .weight_scale = w_scale.view(),
                      .qkv_scale = qkv_scale.view(),
                      .qk = cpu_qk,
                      .v = cpu_v,
                      .q = q.view(),
                      .k = k.view(),
                      .layout = data.layout()});
  HostTensor grad_row(DType::kFloat8E4M3, {T, F}), grad_t(DType::kFloat8E4M3, {F, T});
  HostTensor partials(DType::kFloat32, {kGradScalePartials});
  HostTensor grad_x(DType::kBFloat16, {T, C}), grad_weight(DType::kBFloat16, {F, C});
  HostTensor grad_qkv_scale(DType::kFloat32, {});
  HostTensor gqw(DType::kFloat32, {D}), gkw(DType::kFloat32, {D});
  const auto weight_rows = [&](const TensorView& base, Device device) {
    auto* data16 = static_cast<uint16_t*>(base.data);
    return std::pair{make_view(data16, DType::kBFloat16, device, {QK, C}),
                     make_view(data16 + QK * C, DType::kBFloat16, device, {V, C})};
  };
  const auto [cpu_gqk, cpu_gv] = weight_rows(grad_weight.view(), kCPU);
  packed_qkv_backward({.grad_q = grads.q_tensor.view(),
                       .grad_k = grads.k_tensor.view(),
                       .grad_v = grad_v.view(),
                       .qk = data.qk_tensor->view(),
                       .x_f8_t = x_f8_t.view(),
                       .weight_f8_t = w_f8_t.view(),
                       .qk_weight = qk_weight.view(),
                       .v_weight = v_weight.view(),
                       .x_scale = x_scale.view(),
                       .weight_scale = w_scale.view(),
                       .qkv_scale = qkv_scale.view(),
                       .grad_scale = grad_scale.view(),
                       .grad_row = grad_row.view(),
                       .grad_t = grad_t.view(),
                       .partials = partials.view(),
                       .grad_q_weight = gqw.view(),
                       .grad_k_weight = gkw.view(),
                       .grad_x = grad_x.view(),
                       .grad_qk_weight = cpu_gqk,
                       .grad_v_weight = cpu_gv,
                       .grad_qkv_scale = grad_qkv_scale.view(),
                       .layout = data.layout()});

  // GPU.
  const DeviceRope dev(data, {});
  const DeviceView d_x = to_device(x_f8.view()), d_xt = to_device(x_f8_t.view());
  const DeviceView d_w = to_device(w_f8.view()), d_wt = to_device(w_f8_t.view());
  const DeviceView d_xs = to_device(x_scale.view()), d_ws = to_device(w_scale.view());
  const DeviceView d_qs = to_device(qkv_scale.view()), d_gs = to_device(grad_scale.view());
  const DeviceView d_qkw = to_device(qk_weight.view()), d_vw = to_device(v_weight.view());
  const DeviceView d_gq = to_device(grads.q_tensor.view()), d_gk = to_device(grads.k_tensor.view());
  const DeviceView d_gv = to_device(grad_v.view());
  DeviceOut g_qkv(DType::kBFloat16, {T, F});
  DeviceOut g_q(DType::kBFloat16, {T, Hq, D}), g_k(DType::kBFloat16, {T, Hkv, D});
  const auto [gpu_qk, gpu_v] = slices(g_qkv.view(), kGPU);
  TestStream stream;
  synchronize();
  packed_qkv_forward({.x_f8 = d_x.view,
                      .weight_f8 = d_w.view,
                      .x_scale = d_xs.view,
                      .weight_scale = d_ws.view,
                      .qkv_scale = d_qs.view,
                      .qk = gpu_qk,
                      .v = gpu_v,
                      .q = g_q.view(),
                      .k = g_k.view(),
                      .layout = dev.layout,
                      .stream = stream.get()});
  stream.sync();
  const std::vector<uint16_t> gpu_qkv = as_u16(g_qkv.read("qkv"));
  const std::vector<uint16_t> cpu_qkv = qkv.get_bf16_bits();
  double squares = 0;
  for (uint16_t v : cpu_qkv) squares += std::pow(double(bf16_to_float(v)), 2);
  const double rms = std::sqrt(squares / double(cpu_qkv.size()));
  int64_t far = 0;
  for (size_t i = 0; i < cpu_qkv.size(); ++i) {
    const double a = bf16_to_float(gpu_qkv[i]), b = bf16_to_float(cpu_qkv[i]);
    far += !(std::fabs(a - b) <= std::ldexp(std::max(std::fabs(b), rms), -6));
  }
  EXPECT_EQ(far, 0) << "qkv elements beyond 2^-6 of max(|cpu|, rms)";
  // q and k against the CPU rope of the GPU's own qk.
  HostTensor own_qk(DType::kBFloat16, {T, Hq + Hkv, D});
  std::vector<double> own;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t f = 0; f < QK; ++f) own.push_back(bf16_to_float(gpu_qkv[size_t(t * F + f)]));
  }
  own_qk.set(own);
  HostTensor want_q(DType::kBFloat16, {T, Hq, D}), want_k(DType::kBFloat16, {T, Hkv, D});
  qk_norm_rope({own_qk.view(), want_q.view(), want_k.view(), data.layout()});
  EXPECT_TRUE(clean(compare_rows("q", as_u16(g_q.read("q")), want_q.get_bf16_bits(), D)));
  EXPECT_TRUE(clean(compare_rows("k", as_u16(g_k.read("k")), want_k.get_bf16_bits(), D)));

  DeviceOut g_row(DType::kFloat8E4M3, {T, F}), g_t(DType::kFloat8E4M3, {F, T});
  DeviceOut g_partials(DType::kFloat32, {kGradScalePartials});
  DeviceOut g_x(DType::kBFloat16, {T, C}), g_weight(DType::kBFloat16, {F, C});
  DeviceOut g_scale(DType::kFloat32, {}), g_qw(DType::kFloat32, {D}), g_kw(DType::kFloat32, {D});
  const auto [gpu_gqk, gpu_gv] = weight_rows(g_weight.view(), kGPU);
  PackedQkvBackwardParams b{.grad_q = d_gq.view,
                            .grad_k = d_gk.view,
                            .grad_v = d_gv.view,
                            .qk = dev.qk.view,
                            .x_f8_t = d_xt.view,
                            .weight_f8_t = d_wt.view,
                            .qk_weight = d_qkw.view,
                            .v_weight = d_vw.view,
                            .x_scale = d_xs.view,
                            .weight_scale = d_ws.view,
                            .qkv_scale = d_qs.view,
                            .grad_scale = d_gs.view,
                            .grad_row = g_row.view(),
                            .grad_t = g_t.view(),
                            .partials = g_partials.view(),
                            .grad_q_weight = g_qw.view(),
                            .grad_k_weight = g_kw.view(),
                            .grad_x = g_x.view(),
                            .grad_qk_weight = gpu_gqk,
                            .grad_v_weight = gpu_gv,
                            .grad_qkv_scale = g_scale.view(),
                            .layout = dev.layout,
                            .stream = stream.get()};
  std::optional<DeviceOut> workspace;
  const int64_t size = attach_workspace(b, b.rope_workspace, workspace);
  EXPECT_GT(size, 0);
  synchronize();
  packed_qkv_backward(b);
  stream.sync();
  const ref::RopeGradients model =
      ref::rope_gradients(data.rope, grads.q, grads.k, data.qk, data.tensors);
  const std::vector<uint8_t> row = g_row.read("grad_row");
  EXPECT_TRUE(clean(compare_grad_row(data.rope, Dv, 1.0f / 448, row, grad_row.get_codes(),
                                     model.term_scale)));
  EXPECT_TRUE(g_t.read("grad_t") == transpose(row, T, F));
  EXPECT_TRUE(weight_grads_agree("grad_q_weight", DType::kFloat32,
                                 values_of(g_qw.read("grad_q_weight"), DType::kFloat32), gqw.get(),
                                 model.q_weight_magnitude, model.q_weight_terms));
  EXPECT_TRUE(weight_grads_agree("grad_k_weight", DType::kFloat32,
                                 values_of(g_kw.read("grad_k_weight"), DType::kFloat32), gkw.get(),
                                 model.k_weight_magnitude, model.k_weight_terms));
  const auto frobenius = [](const std::vector<double>& a, const std::vector<double>& b) {
    double diff = 0, norm = 0;
    for (size_t i = 0; i < b.size(); ++i) {
      diff += (a[i] - b[i]) * (a[i] - b[i]);
      norm += b[i] * b[i];
    }
    return std::sqrt(diff / std::max(norm, 1e-300));
  };
  EXPECT_LT(frobenius(values_of(g_x.read("grad_x"), DType::kBFloat16), grad_x.get()), 1e-2);
  EXPECT_LT(frobenius(values_of(g_weight.read("grad_weight"), DType::kBFloat16), grad_weight.get()),
            1e-2);
}

}  // namespace
}  // namespace qkvfuse::test
