// test_cuda_concurrency.cpp: the ops issued from several host threads on several streams at once
// give the same bits as one serial run, and a device other than 0 works.
//
// Every op (qk_norm_rope, qk_norm_rope_backward, qkv_backward_fp8, quantize_dual_layout, fp8_gemm,
// packed_qkv_forward, packed_qkv_backward) runs once serially on one stream; its outputs are the
// expected bits. Then 4 threads, each with its own non-blocking stream and its own outputs (the
// inputs are shared, read-only), issue every op repeatedly, all at once, and compare their
// outputs with the serial ones bit for bit. What this catches: state shared between calls that
// is not per stream (cuBLASLt workspaces and staged scale slots, cached plans, handles), launches
// on the wrong stream (the default stream, or the one of another call), and host-side races in
// the library's caches. Outputs are poisoned (0xff bytes: NaN in bf16, e4m3 and float32, which no
// op writes) on the issuing stream before each op, so an element left unwritten fails too.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gpu_util.hpp"
#include "qkvfuse/qkvfuse.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace qkvfuse::test {
namespace {

// The workload's layer at a reduced token count (a multiple of 16, as the FP8 GEMMs need).
constexpr int64_t kT = 1008, kH = 6, kD = 128, kDv = 128, kC = 768;
constexpr int64_t kQkFeatures = 2 * kH * kD;
constexpr int64_t kQkv = kQkFeatures + kH * kDv;
constexpr int kThreads = 4;
constexpr int kRepeats = 6;

enum Op : int {
  kRopeForward,
  kRopeBackward,
  kQkvBackwardFp8,
  kQuantize,
  kGemm,
  kPackedForward,
  kPackedBackward,
  kOpCount
};
const char* const kOpNames[kOpCount] = {"qk_norm_rope",     "qk_norm_rope_backward",
                                        "qkv_backward_fp8", "quantize_dual_layout",
                                        "fp8_gemm",         "packed_qkv_forward",
                                        "packed_qkv_backward"};

void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(status) + ": " +
                             cudaGetErrorString(status));
  }
}

/// Makes `device` current for the scope (allocations, stream creation, frees).
class CurrentDevice {
 public:
  explicit CurrentDevice(int device) {
    cuda_check(cudaGetDevice(&previous_), "cudaGetDevice");
    cuda_check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~CurrentDevice() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

class OwnStream {
 public:
  OwnStream() { cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream"); }
  ~OwnStream() { cudaStreamDestroy(stream_); }
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// ---- inputs --------------------------------------------------------------------------------------

struct HostInputs {
  std::vector<uint16_t> qk, factor1, factor2, grad_q, grad_k, grad_v, src, qk_weight, v_weight;
  std::vector<uint8_t> x_f8, x_f8_t, weight_f8, weight_f8_t;
  // grad_scale, quantize scale, x_scale, weight_scale, qkv_scale
  std::vector<float> scalars = {1.0f / 448.0f, 8.0f / 448.0f, 8.0f / 448.0f, 0.0f, 1.3f};
};

HostInputs make_host_inputs(std::mt19937_64& rng) {
  HostInputs in;
  in.qk = random_bf16(rng, size_t(kT * 2 * kH * kD));
  std::vector<float> f1, f2;
  rotary_tables(kT, kD, 1, kD / 2, f1, f2);  // stationary upper half: the key offset's layout
  for (float v : f1) in.factor1.push_back(float_to_bf16(v));
  for (float v : f2) in.factor2.push_back(float_to_bf16(v));
  in.grad_q = random_bf16(rng, size_t(kT * kH * kD), 0.05f);
  in.grad_k = random_bf16(rng, size_t(kT * kH * kD), 0.05f);
  in.grad_v = random_bf16(rng, size_t(kT * kH * kDv), 0.05f);
  in.src = random_bf16(rng, size_t(kT * kC), 1.0f);
  // x_f8 / x_f8_t: src quantized with x_scale on the CPU.
  in.x_f8.resize(size_t(kT * kC));
  in.x_f8_t.resize(size_t(kT * kC));
  {
    QuantizeDualParams p;
    p.src = make_view(in.src.data(), DType::kBFloat16, kCPU, {kT, kC});
    p.scale = make_view(&in.scalars[2], DType::kFloat32, kCPU, {});
    p.row = make_view(in.x_f8.data(), DType::kFloat8E4M3, kCPU, {kT, kC});
    p.t = make_view(in.x_f8_t.data(), DType::kFloat8E4M3, kCPU, {kC, kT});
    quantize_dual_layout(p);
  }
  in.qk_weight = random_bf16(rng, size_t(kQkFeatures * kC), 0.02f);
  in.v_weight = random_bf16(rng, size_t(kH * kDv * kC), 0.02f);
  {
    std::vector<uint16_t> packed = in.qk_weight;
    packed.insert(packed.end(), in.v_weight.begin(), in.v_weight.end());
    in.weight_f8.resize(size_t(kQkv * kC));
    in.weight_f8_t.resize(size_t(kQkv * kC));
    QuantizeWeightBankParams p;
    p.src = make_view(packed.data(), DType::kBFloat16, kCPU, {1, kQkv, kC});
    p.scale = make_view(&in.scalars[3], DType::kFloat32, kCPU, {1});
    p.row = make_view(in.weight_f8.data(), DType::kFloat8E4M3, kCPU, {1, kQkv, kC});
    p.t = make_view(in.weight_f8_t.data(), DType::kFloat8E4M3, kCPU, {1, kC, kQkv});
    quantize_weight_bank(p);
  }
  return in;
}

/// The inputs on one device; shared, read-only, by every workload there. The buffers are freed
/// with their device current.
struct DeviceInputs {
  struct Buffers {
    DeviceBuffer qk, factor1, factor2, grad_q, grad_k, grad_v, src, qk_weight, v_weight;
    DeviceBuffer x_f8, x_f8_t, weight_f8, weight_f8_t;
    std::vector<DeviceBuffer> scalars;
  };
  Device device;
  std::unique_ptr<Buffers> buffers;

  DeviceInputs(const HostInputs& in, int index)
      : device{DeviceType::kCUDA, index}, buffers(std::make_unique<Buffers>()) {
    CurrentDevice current(index);
    Buffers& b = *buffers;
    b.qk = DeviceBuffer::from(in.qk);
    b.factor1 = DeviceBuffer::from(in.factor1);
    b.factor2 = DeviceBuffer::from(in.factor2);
    b.grad_q = DeviceBuffer::from(in.grad_q);
    b.grad_k = DeviceBuffer::from(in.grad_k);
    b.grad_v = DeviceBuffer::from(in.grad_v);
    b.src = DeviceBuffer::from(in.src);
    b.qk_weight = DeviceBuffer::from(in.qk_weight);
    b.v_weight = DeviceBuffer::from(in.v_weight);
    b.x_f8 = DeviceBuffer::from(in.x_f8);
    b.x_f8_t = DeviceBuffer::from(in.x_f8_t);
    b.weight_f8 = DeviceBuffer::from(in.weight_f8);
    b.weight_f8_t = DeviceBuffer::from(in.weight_f8_t);
    for (float value : in.scalars) b.scalars.push_back(DeviceBuffer::from(std::vector<float>{value}));
    // cudaMemcpy from pageable memory may return before the data lands, on the legacy stream,
    // which the non-blocking streams below do not wait for.
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize after the uploads");
  }
  ~DeviceInputs() {
    CurrentDevice current(device.index);
    buffers.reset();
  }
  DeviceInputs(const DeviceInputs&) = delete;
  DeviceInputs& operator=(const DeviceInputs&) = delete;

  const Buffers* operator->() const { return buffers.get(); }
  TensorView scalar(int i) const {
    return make_view(buffers->scalars[size_t(i)].data(), DType::kFloat32, device, {});
  }
  TensorView bf16(const DeviceBuffer& b, std::initializer_list<int64_t> sizes) const {
    return make_view(b.data(), DType::kBFloat16, device, sizes);
  }
  TensorView e4m3(const DeviceBuffer& b, std::initializer_list<int64_t> sizes) const {
    return make_view(b.data(), DType::kFloat8E4M3, device, sizes);
  }
};

// ---- one worker's outputs and ops ----------------------------------------------------------------

/// Outputs of every op, on the inputs' device; `issue` enqueues an op on a stream.
class Workload {
 public:
  explicit Workload(const DeviceInputs& in) : in_(in) {
    CurrentDevice current(in.device.index);
    const auto add = [&](Op op, size_t bytes) {
      outputs_[op].push_back(std::make_unique<DeviceBuffer>(bytes));
      return outputs_[op].back().get();
    };
    q_ = add(kRopeForward, kT * kH * kD * 2);
    k_ = add(kRopeForward, kT * kH * kD * 2);
    grad_qk_ = add(kRopeBackward, kT * 2 * kH * kD * 2);
    fp8_row_ = add(kQkvBackwardFp8, kT * kQkv);
    fp8_t_ = add(kQkvBackwardFp8, kT * kQkv);
    quant_row_ = add(kQuantize, kT * kC);
    quant_t_ = add(kQuantize, kT * kC);
    amax_ = add(kQuantize, 4);
    gemm_d_ = add(kGemm, kT * kQkv * 2);
    packed_qkv_ = add(kPackedForward, kT * kQkv * 2);
    packed_q_ = add(kPackedForward, kT * kH * kD * 2);
    packed_k_ = add(kPackedForward, kT * kH * kD * 2);
    bw_row_ = add(kPackedBackward, kT * kQkv);
    bw_t_ = add(kPackedBackward, kT * kQkv);
    grad_x_ = add(kPackedBackward, kT * kC * 2);
    grad_weight_ = add(kPackedBackward, kQkv * kC * 2);
    grad_qkv_scale_ = add(kPackedBackward, 4);
    partials_ = std::make_unique<DeviceBuffer>(kGradScalePartials * 4);  // workspace: not compared
  }

  ~Workload() {
    CurrentDevice current(in_.device.index);
    for (auto& list : outputs_) list.clear();
    partials_.reset();
  }

  /// Poisons the op's outputs and launches it, both on `stream`.
  void issue(Op op, cudaStream_t stream) {
    {
      CurrentDevice current(in_.device.index);  // the memsets: the op itself is called from the
      for (const auto& buffer : outputs_[op]) {  // caller's current device (its guard switches)
        cuda_check(cudaMemsetAsync(buffer->data(), 0xff, buffer->bytes(), stream), "poison");
      }
    }
    const DeviceInputs& in = in_;
    const Device dev = in.device;
    const TensorView factor1 = in.bf16(in->factor1, {kT, kD});
    const TensorView factor2 = in.bf16(in->factor2, {kT, kD});
    const RopeLayout key_offset = tables_layout(kH, kD / 2, false, true, factor1, factor2);
    const RopeLayout plain = tables_layout(kH, kD, false, false, factor1, factor2);
    switch (op) {
      case kRopeForward:
        qk_norm_rope({in.bf16(in->qk, {kT, 2 * kH, kD}), in.bf16(*q_, {kT, kH, kD}),
                      in.bf16(*k_, {kT, kH, kD}), key_offset, stream});
        break;
      case kRopeBackward:
        qk_norm_rope_backward({.grad_q = in.bf16(in->grad_q, {kT, kH, kD}),
                               .grad_k = in.bf16(in->grad_k, {kT, kH, kD}),
                               .qk = in.bf16(in->qk, {kT, 2 * kH, kD}),
                               .grad_qk = in.bf16(*grad_qk_, {kT, 2 * kH, kD}),
                               .layout = key_offset,
                               .stream = stream});
        break;
      case kQkvBackwardFp8: {
        QkvBackwardFp8Params p;
        p.grad_q = in.bf16(in->grad_q, {kT, kH, kD});
        p.grad_k = in.bf16(in->grad_k, {kT, kH, kD});
        p.grad_v = in.bf16(in->grad_v, {kT, kH, kDv});
        p.qk = in.bf16(in->qk, {kT, 2 * kH, kD});
        p.grad_scale = in.scalar(0);
        p.grad_row = in.e4m3(*fp8_row_, {kT, kQkv});
        p.grad_t = in.e4m3(*fp8_t_, {kQkv, kT});
        p.layout = key_offset;
        p.stream = stream;
        qkv_backward_fp8(p);
        break;
      }
      case kQuantize: {
        QuantizeDualParams p;
        p.src = in.bf16(in->src, {kT, kC});
        p.scale = in.scalar(1);
        p.row = in.e4m3(*quant_row_, {kT, kC});
        p.t = in.e4m3(*quant_t_, {kC, kT});
        p.amax = make_view(amax_->data(), DType::kFloat32, dev, {});
        p.stream = stream;
        quantize_dual_layout(p);
        break;
      }
      case kGemm: {
        Fp8GemmParams p;
        p.a = in.e4m3(in->x_f8, {kT, kC});
        p.b = in.e4m3(in->weight_f8, {kQkv, kC});
        p.scale_a = in.scalar(2);
        p.scale_b = in.scalar(3);
        p.alpha = in.scalar(4);
        p.d = make_view(gemm_d_->data(), DType::kBFloat16, dev, {kT, kQkv});
        p.fast_accum = true;
        p.stream = stream;
        fp8_gemm(p);
        break;
      }
      case kPackedForward: {
        PackedQkvForwardParams p;
        p.x_f8 = in.e4m3(in->x_f8, {kT, kC});
        p.weight_f8 = in.e4m3(in->weight_f8, {kQkv, kC});
        p.x_scale = in.scalar(2);
        p.weight_scale = in.scalar(3);
        p.qkv_scale = in.scalar(4);
        // qk and v: the two column slices of one [T, qkv_dim] buffer (one GEMM writes both).
        auto* base = static_cast<uint16_t*>(packed_qkv_->data());
        p.qk = make_view(base, DType::kBFloat16, dev, {kT, 2 * kH, kD}, {kQkv, kD, 1});
        p.v = make_view(base + kQkFeatures, DType::kBFloat16, dev, {kT, kH, kDv}, {kQkv, kDv, 1});
        p.q = in.bf16(*packed_q_, {kT, kH, kD});
        p.k = in.bf16(*packed_k_, {kT, kH, kD});
        p.layout = plain;
        p.stream = stream;
        packed_qkv_forward(p);
        break;
      }
      case kPackedBackward: {
        PackedQkvBackwardParams p;
        p.grad_q = in.bf16(in->grad_q, {kT, kH, kD});
        p.grad_k = in.bf16(in->grad_k, {kT, kH, kD});
        p.grad_v = in.bf16(in->grad_v, {kT, kH, kDv});
        p.qk = in.bf16(in->qk, {kT, 2 * kH, kD});
        p.x_f8_t = in.e4m3(in->x_f8_t, {kC, kT});
        p.weight_f8_t = in.e4m3(in->weight_f8_t, {kC, kQkv});
        p.qk_weight = in.bf16(in->qk_weight, {kQkFeatures, kC});
        p.v_weight = in.bf16(in->v_weight, {kH * kDv, kC});
        p.x_scale = in.scalar(2);
        p.weight_scale = in.scalar(3);
        p.qkv_scale = in.scalar(4);
        p.grad_scale = in.scalar(0);
        p.grad_row = in.e4m3(*bw_row_, {kT, kQkv});
        p.grad_t = in.e4m3(*bw_t_, {kQkv, kT});
        p.partials = make_view(partials_->data(), DType::kFloat32, dev, {kGradScalePartials});
        p.grad_x = in.bf16(*grad_x_, {kT, kC});
        auto* weight = static_cast<uint16_t*>(grad_weight_->data());
        p.grad_qk_weight = make_view(weight, DType::kBFloat16, dev, {kQkFeatures, kC});
        p.grad_v_weight = make_view(weight + kQkFeatures * kC, DType::kBFloat16, dev, {kH * kDv, kC});
        p.grad_qkv_scale = make_view(grad_qkv_scale_->data(), DType::kFloat32, dev, {});
        p.layout = plain;
        p.stream = stream;
        packed_qkv_backward(p);
        break;
      }
      default:
        break;
    }
  }

  /// The op's output bytes, downloaded on `stream` after its work.
  std::vector<std::vector<uint8_t>> collect(Op op, cudaStream_t stream) const {
    CurrentDevice current(in_.device.index);
    std::vector<std::vector<uint8_t>> out;
    for (const auto& buffer : outputs_[op]) {
      std::vector<uint8_t> bytes(buffer->bytes());
      cuda_check(cudaMemcpyAsync(bytes.data(), buffer->data(), bytes.size(), cudaMemcpyDeviceToHost,
                                 stream),
                 "download");
      out.push_back(std::move(bytes));
    }
    cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    return out;
  }

 private:
  const DeviceInputs& in_;
  std::vector<std::unique_ptr<DeviceBuffer>> outputs_[kOpCount];
  std::unique_ptr<DeviceBuffer> partials_;
  DeviceBuffer *q_, *k_, *grad_qk_, *fp8_row_, *fp8_t_, *quant_row_, *quant_t_, *amax_, *gemm_d_;
  DeviceBuffer *packed_qkv_, *packed_q_, *packed_k_, *bw_row_, *bw_t_, *grad_x_, *grad_weight_;
  DeviceBuffer* grad_qkv_scale_;
};

using Expected = std::vector<std::vector<std::vector<uint8_t>>>;  // [op][output][byte]

/// Every op once, serially on one stream: the expected bits. Checks nothing was left poisoned.
Expected serial_run(const DeviceInputs& in) {
  Workload work(in);
  CurrentDevice current(in.device.index);
  OwnStream stream;
  Expected expected(kOpCount);
  for (int op = 0; op < kOpCount; ++op) {
    work.issue(Op(op), stream.get());
    expected[size_t(op)] = work.collect(Op(op), stream.get());
  }
  for (int op = 0; op < kOpCount; ++op) {
    for (size_t o = 0; o < expected[size_t(op)].size(); ++o) {
      const std::vector<uint8_t>& bytes = expected[size_t(op)][o];
      // The poison: 0xffff is a bf16 NaN no op writes, 0xff an e4m3 NaN no op writes (NaN is
      // 0x7f), 0xffffffff a float NaN; inputs are finite, so no output holds any of them.
      int64_t poisoned = 0;
      if (bytes.size() == 4) {
        poisoned = bytes[0] == 0xff && bytes[1] == 0xff && bytes[2] == 0xff && bytes[3] == 0xff;
      } else {
        for (size_t i = 0; i + 1 < bytes.size(); i += 2) poisoned += bytes[i] == 0xff && bytes[i + 1] == 0xff;
      }
      EXPECT_EQ(poisoned, 0) << kOpNames[op] << " output " << o << " left poison unwritten";
    }
  }
  return expected;
}

/// What one thread saw: the first mismatch or error, and how many ops it checked.
struct ThreadReport {
  int64_t checked = 0;
  int64_t mismatched = 0;
  std::string first_problem;
};

/// `threads` workers on `devices[i % size]`, each on its own stream, issuing every op `repeats`
/// times; op order rotated per thread when `rotate`, else the same for all (every thread runs the
/// same op at once). Returns each thread's report.
std::vector<ThreadReport> concurrent_run(const std::vector<const DeviceInputs*>& devices,
                                         const std::vector<const Expected*>& expected, int threads,
                                         bool rotate) {
  std::vector<ThreadReport> reports(static_cast<size_t>(threads));
  // Each worker's outputs and stream, created and destroyed with its device current.
  struct Worker {
    int device;
    std::unique_ptr<Workload> work;
    std::unique_ptr<OwnStream> stream;
    ~Worker() {
      CurrentDevice current(device);
      stream.reset();
      work.reset();
    }
  };
  std::vector<std::unique_ptr<Worker>> workers;
  for (int i = 0; i < threads; ++i) {
    const DeviceInputs& in = *devices[size_t(i) % devices.size()];
    auto worker = std::make_unique<Worker>();
    worker->device = in.device.index;
    worker->work = std::make_unique<Workload>(in);
    CurrentDevice current(in.device.index);
    worker->stream = std::make_unique<OwnStream>();
    workers.push_back(std::move(worker));
  }
  std::atomic<int> ready{0};
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i) {
    pool.emplace_back([&, i] {
      ThreadReport& report = reports[size_t(i)];
      const Expected& want = *expected[size_t(i) % expected.size()];
      const cudaStream_t stream = workers[size_t(i)]->stream->get();
      Workload& work = *workers[size_t(i)]->work;
      try {
        // Issue from device 0's context whatever the tensors' device: the library must switch.
        cuda_check(cudaSetDevice(0), "cudaSetDevice(0)");
        ready.fetch_add(1);
        while (ready.load() < threads) std::this_thread::yield();  // start together
        for (int rep = 0; rep < kRepeats; ++rep) {
          for (int j = 0; j < kOpCount; ++j) {
            work.issue(Op(rotate ? (i + j) % kOpCount : j), stream);
          }
          for (int op = 0; op < kOpCount; ++op) {
            const auto got = work.collect(Op(op), stream);
            ++report.checked;
            if (got != want[size_t(op)]) {
              if (report.mismatched++ == 0) {
                std::ostringstream out;
                out << "thread " << i << " repeat " << rep << ": " << kOpNames[op]
                    << " differs from the serial run";
                report.first_problem = out.str();
              }
            }
          }
        }
      } catch (const std::exception& e) {
        ++report.mismatched;
        report.first_problem = std::string("thread ") + std::to_string(i) + " threw: " + e.what();
        ready.fetch_add(threads);  // never leave the others waiting
      }
    });
  }
  for (std::thread& t : pool) t.join();
  return reports;
}

void expect_clean(const std::vector<ThreadReport>& reports) {
  for (const ThreadReport& report : reports) {
    EXPECT_EQ(report.mismatched, 0) << report.first_problem;
    EXPECT_EQ(report.checked, int64_t(kRepeats) * kOpCount) << report.first_problem;
  }
}

/// Empty when device `index` can run the kernels, else why not.
std::string device_unusable(int index) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count <= index) {
    cudaGetLastError();
    return "only " + std::to_string(count) + " CUDA device(s)";
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, index) != cudaSuccess) return "cannot query the device";
  if (prop.major != 9) return std::string("kernels are built for sm_90a, device is ") + prop.name;
  return "";
}

// ---- tests ---------------------------------------------------------------------------------------

TEST(CudaConcurrency, FourThreadsFourStreamsMatchSerialBits) {
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  const HostInputs host = make_host_inputs(rng);
  const DeviceInputs in(host, 0);
  const Expected expected = serial_run(in);
  // Rotated op order: different ops overlap on different streams.
  expect_clean(concurrent_run({&in}, {&expected}, kThreads, /*rotate=*/true));
  synchronize();
}

TEST(CudaConcurrency, FourThreadsSameOpAtOnceMatchSerialBits) {
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  const HostInputs host = make_host_inputs(rng);
  const DeviceInputs in(host, 0);
  const Expected expected = serial_run(in);
  // Same order everywhere: four threads in the same op (the same cuBLASLt plan, first uses of
  // new streams' workspaces) at the same time.
  expect_clean(concurrent_run({&in}, {&expected}, kThreads, /*rotate=*/false));
  synchronize();
}

TEST(CudaConcurrency, SecondDeviceMatchesDeviceZero) {
  QKVF_REQUIRE_GPU();
  const std::string reason = device_unusable(1);
  if (!reason.empty()) GTEST_SKIP() << "needs a second sm_90 GPU: " << reason;
  auto rng = rng_for_test();
  const HostInputs host = make_host_inputs(rng);
  const DeviceInputs in0(host, 0);
  const Expected expected = serial_run(in0);
  {
    // Device 1 alone, issued while device 0 is current: the same bits as device 0.
    const DeviceInputs in1(host, 1);
    const Expected expected1 = serial_run(in1);
    for (int op = 0; op < kOpCount; ++op) {
      EXPECT_TRUE(expected1[size_t(op)] == expected[size_t(op)])
          << kOpNames[op] << " on cuda:1 differs from cuda:0";
    }
    // Both devices at once, two threads each.
    expect_clean(concurrent_run({&in0, &in1}, {&expected, &expected}, kThreads, /*rotate=*/true));
  }
  synchronize();
}

TEST(CudaConcurrency, CurrentDeviceIsRestored) {
  QKVF_REQUIRE_GPU();
  // An op on cuda:1 called while cuda:0 is current leaves cuda:0 current (the library's device
  // guard restores it); with one GPU, an op on cuda:0 leaves cuda:0 current.
  const int target = device_unusable(1).empty() ? 1 : 0;
  auto rng = rng_for_test();
  const HostInputs host = make_host_inputs(rng);
  const DeviceInputs in(host, target);
  Workload work(in);
  OwnStream* stream = nullptr;
  std::unique_ptr<OwnStream> owned;
  {
    CurrentDevice current(target);
    owned = std::make_unique<OwnStream>();
    stream = owned.get();
  }
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  for (int op = 0; op < kOpCount; ++op) {
    work.issue(Op(op), stream->get());
    int current = -1;
    ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
    EXPECT_EQ(current, 0) << kOpNames[op] << " changed the current device";
  }
  work.collect(kPackedBackward, stream->get());
  {
    CurrentDevice current(target);
    owned.reset();
  }
}

}  // namespace
}  // namespace qkvfuse::test
