// bench_fp8.cu: timings of the FP8 pieces of qkvfuse at the speedrun's shapes, through the public
// API: the three FP8 GEMMs of the packed QKV op, the dual-layout quantize of the activation, the
// weight-bank refresh, and the whole packed op forward + backward (eager and as a CUDA graph).
//
//   qkvfuse_bench_fp8 [--csv PATH] [--tokens T] [--iters N] [--kernel gemm|quantize]
//   (--kernel: only the GEMM rows, or only the quantize rows, after the copy row)
//
// Method (the "Benchmarks" section of ../shared/STYLE.md, outside this repository): every measurement warms up first, then times each iteration
// with its own pair of CUDA events and reports the median of >= 50. Kernel-level rows enqueue a
// spinning kernel first so that all iterations are queued before the GPU reaches them: the events
// then measure GPU time, not launch overhead. The packed-op "eager" rows do not (host overhead is
// part of an eager op); the graph rows replay a captured forward + backward. Inputs rotate
// through enough buffer sets that one pass touches more than 3x the L2 before a set comes back,
// so nothing is timed from a warm L2. Memory-bound rows report GB/s for the minimum bytes the
// operation must move (each input read once, each output written once) and that as a share of
// the device-to-device copy bandwidth measured in the same run (a 2 GiB cudaMemcpyAsync, bytes
// read + written). GEMM rows report TFLOP/s (2*M*N*K).
// Results: a table on stdout; with --csv, the same rows plus the device, date and commit.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_common.cuh"
#include "qkvfuse/qkvfuse.hpp"

namespace {

using namespace qkvfuse;
using namespace qkvfuse::bench;

Buffer scalar(float value) {
  Buffer b = allocate(sizeof(float));
  BENCH_CUDA(cudaMemcpy(b.get(), &value, sizeof(float), cudaMemcpyHostToDevice));
  return b;
}

// ---- results ------------------------------------------------------------------------------------

struct Row {
  std::string section, name, shape;
  double ms = NAN, tflops = NAN, gbps = NAN, pct_copy = NAN;
  std::string note;
};

std::vector<Row> g_rows;
double g_copy_gbps = NAN;
size_t g_l2_bytes = 50u << 20;

void add_row(Row row) {
  auto num = [](double v, const char* fmt) {
    char buf[32];
    if (std::isnan(v)) return std::string("-");
    std::snprintf(buf, sizeof(buf), fmt, v);
    return std::string(buf);
  };
  std::printf("%-10s %-26s %-34s %9s %9s %9s %7s  %s\n", row.section.c_str(), row.name.c_str(),
              row.shape.c_str(), num(row.ms, "%.4f").c_str(), num(row.tflops, "%.1f").c_str(),
              num(row.gbps, "%.0f").c_str(), num(row.pct_copy, "%.1f").c_str(), row.note.c_str());
  std::fflush(stdout);
  g_rows.push_back(std::move(row));
}

void add_memory_row(const std::string& section, const std::string& name, const std::string& shape,
                    double ms, double bytes, const std::string& note = "") {
  Row row{section, name, shape};
  row.ms = ms;
  row.gbps = bytes / (ms * 1e-3) / 1e9;
  row.pct_copy = 100.0 * row.gbps / g_copy_gbps;
  row.note = note;
  add_row(row);
}

void add_error_row(const std::string& section, const std::string& name, const std::string& shape,
                   const std::exception& e) {
  Row row{section, name, shape};
  row.note = std::string("FAILED: ") + e.what();
  add_row(row);
}

/// Enough rotating sets that one pass over them exceeds 3x the L2.
int rotation_sets(double set_bytes) {
  return bench::rotation_sets(set_bytes, g_l2_bytes, 2);
}

std::string dims(std::initializer_list<int64_t> d) {
  std::string s = "[";
  for (int64_t v : d) s += (s.size() > 1 ? "," : "") + std::to_string(v);
  return s + "]";
}

// ---- copy bandwidth -----------------------------------------------------------------------------

void bench_copy(cudaStream_t stream, int iters) {
  const size_t bytes = size_t(2) << 30;
  Buffer src = allocate(bytes), dst = allocate(bytes);
  BENCH_CUDA(cudaMemsetAsync(src.get(), 1, bytes, stream));
  const float ms = time_median(
      [&](int) { BENCH_CUDA(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, stream)); },
      stream, std::max(10, iters / 5), false, 2);
  g_copy_gbps = 2.0 * double(bytes) / (ms * 1e-3) / 1e9;
  Row row{"copy", "cudaMemcpyAsync D2D", "2 GiB"};
  row.ms = ms;
  row.gbps = g_copy_gbps;
  row.pct_copy = 100.0;
  row.note = "bytes read + written";
  add_row(row);
}

// ---- FP8 GEMMs ----------------------------------------------------------------------------------

void bench_gemm(const char* name, int64_t m, int64_t n, int64_t k, bool fast_accum,
                bool with_alpha, cudaStream_t stream, int iters) {
  const double set_bytes = double(m * k + n * k + 2 * m * n);
  const int sets = rotation_sets(set_bytes);
  struct Set {
    Buffer a, b, d;
  };
  const std::string shape = dims({m, k}) + "x" + dims({n, k}) + "^T";
  try {
    std::vector<Set> s(static_cast<size_t>(sets));
    for (Set& set : s) {
      set.a = allocate(size_t(m * k));
      set.b = allocate(size_t(n * k));
      set.d = allocate(size_t(m * n) * 2);
      fill_e4m3(set.a.get(), size_t(m * k), 8.0f);
      fill_e4m3(set.b.get(), size_t(n * k), 8.0f);
    }
    Buffer scale_a = scalar(8.0f / 448.0f), scale_b = scalar(0.3f / 448.0f), alpha = scalar(1.3f);
    const float ms = time_median(
        [&](int i) {
          const Set& set = s[size_t(i % sets)];
          Fp8GemmParams p;
          p.a = make_view(set.a.get(), DType::kFloat8E4M3, kDevice, {m, k});
          p.b = make_view(set.b.get(), DType::kFloat8E4M3, kDevice, {n, k});
          p.scale_a = make_view(scale_a.get(), DType::kFloat32, kDevice, {});
          p.scale_b = make_view(scale_b.get(), DType::kFloat32, kDevice, {});
          if (with_alpha) p.alpha = make_view(alpha.get(), DType::kFloat32, kDevice, {});
          p.d = make_view(set.d.get(), DType::kBFloat16, kDevice, {m, n});
          p.fast_accum = fast_accum;
          p.stream = stream;
          fp8_gemm(p);
        },
        stream, iters, true);
    Row row{"fp8_gemm", name, shape};
    row.ms = ms;
    row.tflops = 2.0 * double(m) * double(n) * double(k) / (ms * 1e-3) / 1e12;
    row.note = std::string("fast_accum=") + (fast_accum ? "1" : "0");
    add_row(row);
  } catch (const std::exception& e) {
    add_error_row("fp8_gemm", name, shape, e);
  }
}

// ---- quantize -----------------------------------------------------------------------------------

void bench_quantize_x(int64_t tokens, int64_t channels, bool with_amax, cudaStream_t stream,
                      int iters) {
  const int64_t count = tokens * channels;
  const int sets = rotation_sets(4.0 * double(count));
  struct Set {
    Buffer src, row, t, amax;
  };
  const std::string shape = "x " + dims({tokens, channels});
  const char* name = with_amax ? "quantize_dual + amax" : "quantize_dual";
  try {
    std::vector<Set> s(static_cast<size_t>(sets));
    for (Set& set : s) {
      set.src = allocate(size_t(count) * 2);
      set.row = allocate(size_t(count));
      set.t = allocate(size_t(count));
      set.amax = allocate(sizeof(float));
      fill_bf16(set.src.get(), size_t(count), 1.0f);
    }
    Buffer scale = scalar(8.0f / 448.0f);
    const float ms = time_median(
        [&](int i) {
          const Set& set = s[size_t(i % sets)];
          QuantizeDualParams p;
          p.src = make_view(set.src.get(), DType::kBFloat16, kDevice, {tokens, channels});
          p.scale = make_view(scale.get(), DType::kFloat32, kDevice, {});
          p.row = make_view(set.row.get(), DType::kFloat8E4M3, kDevice, {tokens, channels});
          p.t = make_view(set.t.get(), DType::kFloat8E4M3, kDevice, {channels, tokens});
          if (with_amax) p.amax = make_view(set.amax.get(), DType::kFloat32, kDevice, {});
          p.stream = stream;
          quantize_dual_layout(p);
        },
        stream, iters, true);
    add_memory_row("quantize", name, shape, ms, 4.0 * double(count),
                   "read bf16 once, write e4m3 twice");
  } catch (const std::exception& e) {
    add_error_row("quantize", name, shape, e);
  }
}

void bench_weight_bank(int64_t layers, int64_t rows, int64_t channels, cudaStream_t stream,
                       int iters) {
  const int64_t count = layers * rows * channels;
  const int sets = rotation_sets(4.0 * double(count));
  struct Set {
    Buffer src, scale, row, t;
  };
  const std::string shape = "bank " + dims({layers, rows, channels});
  try {
    std::vector<Set> s(static_cast<size_t>(sets));
    for (Set& set : s) {
      set.src = allocate(size_t(count) * 2);
      set.scale = allocate(size_t(layers) * sizeof(float));
      set.row = allocate(size_t(count));
      set.t = allocate(size_t(count));
      fill_bf16(set.src.get(), size_t(count), 0.02f);
    }
    const float ms = time_median(
        [&](int i) {
          const Set& set = s[size_t(i % sets)];
          QuantizeWeightBankParams p;
          p.src = make_view(set.src.get(), DType::kBFloat16, kDevice, {layers, rows, channels});
          p.scale = make_view(set.scale.get(), DType::kFloat32, kDevice, {layers});
          p.row = make_view(set.row.get(), DType::kFloat8E4M3, kDevice, {layers, rows, channels});
          p.t = make_view(set.t.get(), DType::kFloat8E4M3, kDevice, {layers, channels, rows});
          p.stream = stream;
          quantize_weight_bank(p);
        },
        stream, iters, true);
    add_memory_row("quantize", "quantize_weight_bank", shape, ms, 4.0 * double(count),
                   "amax pass + quantize pass; bytes counted once");
  } catch (const std::exception& e) {
    add_error_row("quantize", "quantize_weight_bank", shape, e);
  }
}

// ---- the packed op ------------------------------------------------------------------------------

struct OpConfig {
  const char* name;
  int64_t heads, qk_dim, v_dim;
  bool paired, key_offset;
  int64_t rotary_dim;
};

/// All buffers of one forward + backward at one config, on the device.
struct OpBuffers {
  Buffer x_f8, x_f8_t, qkv, qk_sep, v_sep, q, k, grad_q, grad_k, grad_v, grad_row, grad_t, grad_x;
  Buffer grad_w, partials, grad_qkv_scale;
};

struct OpShared {
  Buffer weight_f8, weight_f8_t, weight_scale, qk_weight, v_weight, factor1, factor2;
  Buffer x_scale, qkv_scale, grad_scale;
};

void bench_packed_op(const OpConfig& cfg, int64_t tokens, int64_t channels, cudaStream_t stream,
                     int iters) {
  const int64_t t = tokens, c = channels, h = cfg.heads, d = cfg.qk_dim, dv = cfg.v_dim;
  const int64_t hd2 = 2 * h * d, hdv = h * dv, qkv = hd2 + hdv;
  const int64_t fw = d * (cfg.paired ? 2 : 1);
  const std::string shape = "T=" + std::to_string(t) + " H=" + std::to_string(h) +
                            " D=" + std::to_string(d) + " Dv=" + std::to_string(dv);
  RopeLayout layout;
  layout.num_heads = h;
  layout.rotary_dim = cfg.rotary_dim;
  layout.paired = cfg.paired;
  layout.key_offset = cfg.key_offset;

  OpShared sh;
  const int sets = 2;  // one set is ~1 GB at T = 49152: far beyond L2 already
  std::vector<OpBuffers> bufs(static_cast<size_t>(sets));
  const auto set_factors = [&](RopeLayout& l) {
    l.factor1 = make_view(sh.factor1.get(), DType::kBFloat16, kDevice, {t, fw});
    l.factor2 = make_view(sh.factor2.get(), DType::kBFloat16, kDevice, {t, fw});
  };
  try {
    sh.qk_weight = allocate(size_t(hd2 * c) * 2);
    sh.v_weight = allocate(size_t(hdv * c) * 2);
    fill_bf16(sh.qk_weight.get(), size_t(hd2 * c), 0.02f);
    fill_bf16(sh.v_weight.get(), size_t(hdv * c), 0.02f);
    sh.weight_f8 = allocate(size_t(qkv * c));
    sh.weight_f8_t = allocate(size_t(qkv * c));
    sh.weight_scale = allocate(sizeof(float));
    sh.factor1 = allocate(size_t(t * fw) * 2);
    sh.factor2 = allocate(size_t(t * fw) * 2);
    fill_bf16(sh.factor1.get(), size_t(t * fw), 0.7f);
    fill_bf16(sh.factor2.get(), size_t(t * fw), 0.7f);
    sh.x_scale = scalar(8.0f / 448.0f);
    sh.qkv_scale = scalar(1.3f);
    sh.grad_scale = scalar(1.0f / 448.0f);
    // The packed weight cache, as the model refreshes it: [Wq; Wk; Wv] in one bank entry.
    {
      Buffer packed = allocate(size_t(qkv * c) * 2);
      BENCH_CUDA(cudaMemcpyAsync(packed.get(), sh.qk_weight.get(), size_t(hd2 * c) * 2,
                                 cudaMemcpyDeviceToDevice, stream));
      BENCH_CUDA(cudaMemcpyAsync(static_cast<char*>(packed.get()) + hd2 * c * 2, sh.v_weight.get(),
                                 size_t(hdv * c) * 2, cudaMemcpyDeviceToDevice, stream));
      QuantizeWeightBankParams p;
      p.src = make_view(packed.get(), DType::kBFloat16, kDevice, {1, qkv, c});
      p.scale = make_view(sh.weight_scale.get(), DType::kFloat32, kDevice, {1});
      p.row = make_view(sh.weight_f8.get(), DType::kFloat8E4M3, kDevice, {1, qkv, c});
      p.t = make_view(sh.weight_f8_t.get(), DType::kFloat8E4M3, kDevice, {1, c, qkv});
      p.stream = stream;
      quantize_weight_bank(p);
      BENCH_CUDA(cudaStreamSynchronize(stream));
    }
    for (OpBuffers& b : bufs) {
      Buffer x = allocate(size_t(t * c) * 2);
      fill_bf16(x.get(), size_t(t * c), 1.0f);
      b.x_f8 = allocate(size_t(t * c));
      b.x_f8_t = allocate(size_t(t * c));
      QuantizeDualParams p;
      p.src = make_view(x.get(), DType::kBFloat16, kDevice, {t, c});
      p.scale = make_view(sh.x_scale.get(), DType::kFloat32, kDevice, {});
      p.row = make_view(b.x_f8.get(), DType::kFloat8E4M3, kDevice, {t, c});
      p.t = make_view(b.x_f8_t.get(), DType::kFloat8E4M3, kDevice, {c, t});
      p.stream = stream;
      quantize_dual_layout(p);
      BENCH_CUDA(cudaStreamSynchronize(stream));
      if (cfg.paired) {
        b.qk_sep = allocate(size_t(t * hd2) * 2);
        b.v_sep = allocate(size_t(t * hdv) * 2);
      } else {
        b.qkv = allocate(size_t(t * qkv) * 2);
      }
      b.q = allocate(size_t(t * h * d) * 2);
      b.k = allocate(size_t(t * h * d) * 2);
      b.grad_q = allocate(size_t(t * h * d) * 2);
      b.grad_k = allocate(size_t(t * h * d) * 2);
      b.grad_v = allocate(size_t(t * hdv) * 2);
      fill_bf16(b.grad_q.get(), size_t(t * h * d), 0.05f);
      fill_bf16(b.grad_k.get(), size_t(t * h * d), 0.05f);
      fill_bf16(b.grad_v.get(), size_t(t * hdv), 0.05f);
      b.grad_row = allocate(size_t(t * qkv));
      b.grad_t = allocate(size_t(t * qkv));
      b.grad_x = allocate(size_t(t * c) * 2);
      b.grad_w = allocate(size_t(qkv * c) * 2);
      b.partials = allocate(size_t(kGradScalePartials) * sizeof(float));
      b.grad_qkv_scale = allocate(sizeof(float));
    }
    BENCH_CUDA(cudaDeviceSynchronize());
  } catch (const std::exception& e) {
    add_error_row("packed_op", cfg.name, shape, e);
    return;
  }

  const auto out_view = [&](void* p) {
    return cfg.paired ? make_view(p, DType::kBFloat16, kDevice, {2 * t, h / 2, d})
                      : make_view(p, DType::kBFloat16, kDevice, {t, h, d});
  };
  const auto qk_view = [&](const OpBuffers& b) {
    return cfg.paired ? make_view(b.qk_sep.get(), DType::kBFloat16, kDevice, {t, 2 * h, d})
                      : make_view(b.qkv.get(), DType::kBFloat16, kDevice, {t, 2 * h, d}, {qkv, d, 1});
  };
  const auto forward = [&](const OpBuffers& b) {
    PackedQkvForwardParams p;
    p.x_f8 = make_view(b.x_f8.get(), DType::kFloat8E4M3, kDevice, {t, c});
    p.weight_f8 = make_view(sh.weight_f8.get(), DType::kFloat8E4M3, kDevice, {qkv, c});
    p.x_scale = make_view(sh.x_scale.get(), DType::kFloat32, kDevice, {});
    p.weight_scale = make_view(sh.weight_scale.get(), DType::kFloat32, kDevice, {1});
    p.qkv_scale = make_view(sh.qkv_scale.get(), DType::kFloat32, kDevice, {});
    p.qk = qk_view(b);
    p.v = cfg.paired
              ? make_view(b.v_sep.get(), DType::kBFloat16, kDevice, {t, h, dv})
              : make_view(static_cast<uint16_t*>(b.qkv.get()) + hd2, DType::kBFloat16, kDevice,
                          {t, h, dv}, {qkv, dv, 1});
    p.q = out_view(b.q.get());
    p.k = out_view(b.k.get());
    p.layout = layout;
    set_factors(p.layout);
    p.stream = stream;
    packed_qkv_forward(p);
  };
  const auto backward = [&](const OpBuffers& b) {
    PackedQkvBackwardParams p;
    p.grad_q = out_view(b.grad_q.get());
    p.grad_k = out_view(b.grad_k.get());
    p.grad_v = make_view(b.grad_v.get(), DType::kBFloat16, kDevice, {t, h, dv});
    p.qk = qk_view(b);
    p.x_f8_t = make_view(b.x_f8_t.get(), DType::kFloat8E4M3, kDevice, {c, t});
    p.weight_f8_t = make_view(sh.weight_f8_t.get(), DType::kFloat8E4M3, kDevice, {c, qkv});
    p.qk_weight = make_view(sh.qk_weight.get(), DType::kBFloat16, kDevice, {hd2, c});
    p.v_weight = make_view(sh.v_weight.get(), DType::kBFloat16, kDevice, {hdv, c});
    p.x_scale = make_view(sh.x_scale.get(), DType::kFloat32, kDevice, {});
    p.weight_scale = make_view(sh.weight_scale.get(), DType::kFloat32, kDevice, {1});
    p.qkv_scale = make_view(sh.qkv_scale.get(), DType::kFloat32, kDevice, {});
    p.grad_scale = make_view(sh.grad_scale.get(), DType::kFloat32, kDevice, {});
    p.grad_row = make_view(b.grad_row.get(), DType::kFloat8E4M3, kDevice, {t, qkv});
    p.grad_t = make_view(b.grad_t.get(), DType::kFloat8E4M3, kDevice, {qkv, t});
    p.partials = make_view(b.partials.get(), DType::kFloat32, kDevice, {kGradScalePartials});
    p.grad_x = make_view(b.grad_x.get(), DType::kBFloat16, kDevice, {t, c});
    p.grad_qk_weight = make_view(b.grad_w.get(), DType::kBFloat16, kDevice, {hd2, c});
    p.grad_v_weight = make_view(static_cast<uint16_t*>(b.grad_w.get()) + hd2 * c,
                                DType::kBFloat16, kDevice, {hdv, c});
    p.grad_qkv_scale = make_view(b.grad_qkv_scale.get(), DType::kFloat32, kDevice, {});
    p.layout = layout;
    set_factors(p.layout);
    p.stream = stream;
    packed_qkv_backward(p);
  };

  try {
    const float fwd = time_median([&](int i) { forward(bufs[size_t(i % sets)]); }, stream, iters,
                                  false);
    Row r1{"packed_op", std::string(cfg.name) + " fwd", shape};
    r1.ms = fwd;
    r1.note = "eager";
    add_row(r1);
    const float bwd = time_median([&](int i) { backward(bufs[size_t(i % sets)]); }, stream, iters,
                                  false);
    Row r2{"packed_op", std::string(cfg.name) + " bwd", shape};
    r2.ms = bwd;
    r2.note = "eager";
    add_row(r2);
    const float both = time_median(
        [&](int i) {
          forward(bufs[size_t(i % sets)]);
          backward(bufs[size_t(i % sets)]);
        },
        stream, iters, false);
    Row r3{"packed_op", std::string(cfg.name) + " fwd+bwd", shape};
    r3.ms = both;
    r3.note = "eager";
    add_row(r3);
  } catch (const std::exception& e) {
    add_error_row("packed_op", cfg.name, shape, e);
    return;
  }

  // CUDA graph: one captured forward + backward per buffer set, replayed in turn.
  std::vector<cudaGraphExec_t> execs;
  try {
    for (int sidx = 0; sidx < sets; ++sidx) {
      cudaGraph_t graph = nullptr;
      BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      try {
        forward(bufs[size_t(sidx)]);
        backward(bufs[size_t(sidx)]);
      } catch (...) {
        cudaStreamEndCapture(stream, &graph);
        if (graph) cudaGraphDestroy(graph);
        throw;
      }
      BENCH_CUDA(cudaStreamEndCapture(stream, &graph));
      cudaGraphExec_t exec = nullptr;
      const cudaError_t status = cudaGraphInstantiate(&exec, graph, 0);
      cudaGraphDestroy(graph);
      BENCH_CUDA(status);
      execs.push_back(exec);
    }
    const float ms = time_median(
        [&](int i) { BENCH_CUDA(cudaGraphLaunch(execs[size_t(i % sets)], stream)); }, stream,
        iters, false);
    Row row{"packed_op", std::string(cfg.name) + " fwd+bwd", shape};
    row.ms = ms;
    row.note = "CUDA graph replay";
    add_row(row);
  } catch (const std::exception& e) {
    add_error_row("packed_op", std::string(cfg.name) + " graph", shape, e);
  }
  for (cudaGraphExec_t exec : execs) cudaGraphExecDestroy(exec);
  cudaDeviceSynchronize();
}

// ---- main ---------------------------------------------------------------------------------------

void write_csv(const std::string& path, const cudaDeviceProp& prop) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    return;
  }
  char date[64];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  std::fprintf(f, "# qkvfuse_bench_fp8\n# device: %s (sm_%d%d, %d SMs, L2 %zu MiB)\n# date: %s\n",
               prop.name, prop.major, prop.minor, prop.multiProcessorCount,
               size_t(prop.l2CacheSize) >> 20, date);
  std::fprintf(f, "# commit: %s\n# copy bandwidth: %.1f GB/s\n", commit_id(), g_copy_gbps);
  std::fprintf(f, "section,name,shape,ms,tflops,gbps,pct_copy,note\n");
  auto num = [](double v) { return std::isnan(v) ? std::string() : std::to_string(v); };
  for (const Row& r : g_rows) {
    std::string note = r.note;
    std::replace(note.begin(), note.end(), '"', '\'');
    std::fprintf(f, "%s,%s,\"%s\",%s,%s,%s,%s,\"%s\"\n", r.section.c_str(), r.name.c_str(),
                 r.shape.c_str(), num(r.ms).c_str(), num(r.tflops).c_str(), num(r.gbps).c_str(),
                 num(r.pct_copy).c_str(), note.c_str());
  }
  std::fclose(f);
  std::printf("wrote %s\n", path.c_str());
}

}  // namespace

static int run(int argc, char** argv) {
  Options options;
  if (!parse_options(argc, argv, options)) return 2;
  const bool all = options.kernel.empty();
  if (!all && options.kernel != "gemm" && options.kernel != "quantize") {
    std::fprintf(stderr, "qkvfuse_bench_fp8: --kernel takes 'gemm' or 'quantize' (those rows "
                         "alone), got '%s'\n", options.kernel.c_str());
    return 2;
  }
  const std::string& csv = options.csv;
  const int64_t tokens = options.tokens;
  const int iters = options.iters;
  if (cuda_device_count() == 0) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  BENCH_CUDA(cudaSetDevice(0));
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  g_l2_bytes = size_t(prop.l2CacheSize);
  std::printf("device: %s, %d SMs, L2 %zu MiB; commit %s; T = %lld; median of %d\n", prop.name,
              prop.multiProcessorCount, g_l2_bytes >> 20, commit_id(), (long long)tokens,
              iters);
  cudaStream_t stream = nullptr;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf("%-10s %-26s %-34s %9s %9s %9s %7s  %s\n", "section", "name", "shape", "ms",
              "TFLOP/s", "GB/s", "%copy", "note");

  try {
    bench_copy(stream, iters);
  } catch (const std::exception& e) {
    add_error_row("copy", "cudaMemcpyAsync D2D", "2 GiB", e);  // % copy columns stay empty
  }

  // The op's three GEMMs at C = 768, H = 6, D = Dv = 128 (qkv_dim = 2304), as the op runs them.
  const int64_t c = 768, qkv = 2304;
  if (all || options.kernel == "gemm") {
    bench_gemm("fwd", tokens, qkv, c, true, true, stream, iters);
    bench_gemm("wgrad", qkv, c, tokens, false, false, stream, iters);
    bench_gemm("dgrad", tokens, c, qkv, false, true, stream, iters);
  }
  if (all || options.kernel == "quantize") {
    bench_quantize_x(tokens, c, false, stream, iters);
    bench_quantize_x(tokens, c, true, stream, iters);
    bench_weight_bank(10, qkv, c, stream, iters);
  }
  if (!all) {
    if (!csv.empty()) write_csv(csv, prop);
    cudaStreamDestroy(stream);
    return 0;
  }

  const OpConfig configs[] = {
      {"D128 plain", 6, 128, 128, false, false, 128},
      {"D128 paired", 6, 128, 128, true, false, 128},
      {"D128 key_offset", 6, 128, 128, false, true, 64},
      {"D96 plain", 6, 96, 128, false, false, 96},
      {"D64 H12 plain", 12, 64, 128, false, false, 64},
  };
  for (const OpConfig& cfg : configs) bench_packed_op(cfg, tokens, c, stream, std::max(50, iters / 2));

  if (!csv.empty()) write_csv(csv, prop);
  cudaStreamDestroy(stream);
  return 0;
}

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "qkvfuse_bench_fp8: %s\n", e.what());
    return 1;
  }
}
