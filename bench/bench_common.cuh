// bench_common.cuh: what the C++ benchmarks share: CUDA checks, device buffers, random fills
// generated on the device, and the CUDA-event timing loop. Each benchmark is one translation
// unit that includes this once.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "qkvfuse/qkvfuse.hpp"

#ifndef QKVFUSE_GIT_COMMIT
#define QKVFUSE_GIT_COMMIT "unknown"
#endif

#define BENCH_CUDA(expr)                                                                  \
  do {                                                                                    \
    const cudaError_t bench_status_ = (expr);                                             \
    if (bench_status_ != cudaSuccess) {                                                   \
      throw std::runtime_error(std::string(#expr) + " failed: " +                         \
                               cudaGetErrorString(bench_status_) + " [" + __FILE__ + ":" + \
                               std::to_string(__LINE__) + "]");                           \
    }                                                                                     \
  } while (0)

namespace qkvfuse::bench {

inline constexpr Device kDevice{DeviceType::kCUDA, 0};

/// The commit the results belong to: $QKVFUSE_COMMIT when set (the device machine's copy of the
/// tree has no .git), else the configure-time `git rev-parse`.
inline const char* commit_id() {
  const char* from_env = std::getenv("QKVFUSE_COMMIT");
  return from_env && *from_env ? from_env : QKVFUSE_GIT_COMMIT;
}

struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};
using Buffer = std::unique_ptr<void, DeviceFree>;

inline Buffer allocate(size_t bytes) {
  void* p = nullptr;
  BENCH_CUDA(cudaMalloc(&p, std::max<size_t>(bytes, 16)));
  return Buffer(p);
}

__device__ __forceinline__ float hash_normal(uint64_t i, uint64_t seed) {
  // Sum of 4 uniforms from a 64-bit mix: roughly normal, enough to give realistic bit patterns.
  uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull ^ seed;
  float sum = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    sum += float(x >> 40) * (1.0f / 16777216.0f);
  }
  return (sum - 2.0f) * 1.7320508f;  // unit variance
}

__global__ void fill_bf16_kernel(uint16_t* out, size_t count, uint64_t seed, float sigma) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    out[i] = float_to_bf16(sigma * hash_normal(i, seed));
  }
}

__global__ void fill_e4m3_kernel(uint8_t* out, size_t count, uint64_t seed, float sigma) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < count;
       i += size_t(gridDim.x) * blockDim.x) {
    out[i] = float_to_e4m3(sigma * hash_normal(i, seed));
  }
}

__global__ void spin_kernel(uint64_t nanoseconds) {
  uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < nanoseconds);
}

/// Buffer sets to rotate through so that one pass over them touches at least 3x the L2 (no
/// iteration reads what the previous ones left there), and at least `min_sets`.
inline int rotation_sets(double set_bytes, size_t l2_bytes, int min_sets) {
  return std::max(min_sets, int(std::ceil(3.0 * double(l2_bytes) / set_bytes)));
}

inline uint64_t g_seed = 1;

// Setup fills run on the legacy stream and finish before returning, so that the benchmark stream
// (non-blocking, hence unordered with the legacy stream) never sees a buffer half filled.
inline void fill_bf16(void* p, size_t count, float sigma) {
  fill_bf16_kernel<<<1024, 256>>>(static_cast<uint16_t*>(p), count, g_seed++, sigma);
  BENCH_CUDA(cudaGetLastError());
  BENCH_CUDA(cudaDeviceSynchronize());
}
inline void fill_e4m3(void* p, size_t count, float sigma) {
  fill_e4m3_kernel<<<1024, 256>>>(static_cast<uint8_t*>(p), count, g_seed++, sigma);
  BENCH_CUDA(cudaGetLastError());
  BENCH_CUDA(cudaDeviceSynchronize());
}
// ---- timing -------------------------------------------------------------------------------------

inline float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5f * (v[n / 2 - 1] + v[n / 2]);
}

/// Median ms of fn(i) over `iters` iterations after `warmup`, each between its own events.
/// `prequeue`: a spinning kernel first holds the GPU while all iterations are enqueued.
inline float time_median(const std::function<void(int)>& fn, cudaStream_t stream, int iters,
                  bool prequeue, int warmup = 5) {
  for (int i = 0; i < warmup; ++i) fn(i);
  BENCH_CUDA(cudaStreamSynchronize(stream));
  std::vector<cudaEvent_t> start(static_cast<size_t>(iters)), stop(static_cast<size_t>(iters));
  for (int i = 0; i < iters; ++i) {
    BENCH_CUDA(cudaEventCreate(&start[size_t(i)]));
    BENCH_CUDA(cudaEventCreate(&stop[size_t(i)]));
  }
  // ~30 us of host time per iteration is ample for a few launches and two event records.
  if (prequeue) spin_kernel<<<1, 1, 0, stream>>>(uint64_t(iters) * 30000ull + 200000ull);
  for (int i = 0; i < iters; ++i) {
    BENCH_CUDA(cudaEventRecord(start[size_t(i)], stream));
    fn(i);
    BENCH_CUDA(cudaEventRecord(stop[size_t(i)], stream));
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  std::vector<float> ms(static_cast<size_t>(iters));
  for (int i = 0; i < iters; ++i) {
    BENCH_CUDA(cudaEventElapsedTime(&ms[size_t(i)], start[size_t(i)], stop[size_t(i)]));
    cudaEventDestroy(start[size_t(i)]);
    cudaEventDestroy(stop[size_t(i)]);
  }
  return median(ms);
}

// ---- command line ---------------------------------------------------------------------------

/// The options every benchmark takes: [--csv PATH] [--tokens T] [--iters N (>= 50)].
struct Options {
  std::string csv;
  int64_t tokens = 49152;
  int iters = 100;
  std::string kernel;    ///< --kernel NAME: only that kernel's rows (qkvfuse_bench_kernels;
                         ///< gemm or quantize in qkvfuse_bench_fp8)
  int64_t head_dim = 0;  ///< --head-dim D: only shapes of that width (qkvfuse_bench_kernels)
  std::string model;     ///< --model NAME: only that model shape's rows, no speedrun shapes
                         ///< (qkvfuse_bench_kernels; e.g. for Nsight Compute at one shape)
};

/// Parses argv into `options`; prints the usage and returns false on anything else.
inline bool parse_options(int argc, char** argv, Options& options) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--csv" && i + 1 < argc) {
      options.csv = argv[++i];
    } else if (arg == "--tokens" && i + 1 < argc) {
      options.tokens = std::atoll(argv[++i]);
    } else if (arg == "--iters" && i + 1 < argc) {
      options.iters = std::max(50, std::atoi(argv[++i]));
    } else if (arg == "--kernel" && i + 1 < argc) {
      options.kernel = argv[++i];
    } else if (arg == "--head-dim" && i + 1 < argc) {
      options.head_dim = std::atoll(argv[++i]);
    } else if (arg == "--model" && i + 1 < argc) {
      options.model = argv[++i];
    } else {
      std::fprintf(stderr,
                   "usage: %s [--csv PATH] [--tokens T] [--iters N (>= 50)] [--kernel NAME] "
                   "[--head-dim D] [--model NAME]\n",
                   argv[0]);
      return false;
    }
  }
  return true;
}

}  // namespace qkvfuse::bench
