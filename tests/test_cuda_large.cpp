// test_cuda_large.cpp: tensors of more than 2^31 elements (element offsets past int32, byte
// offsets past 2^32) run correctly.
//
//   - qk_norm_rope on qk [1 400 000, 12, 128] (2.15e9 elements, 4.3 GB; q and k 2.15 GB each),
//     plain and key offset;
//   - quantize_dual_layout (with amax) on src [65 552, 32 784] (2.15e9 elements), both layouts.
// The inputs are filled on the device: a host block of a prime number of elements is uploaded
// once and doubled by device-to-device copies, so element e holds block[e mod L]. No two rows
// repeat each other (L divides no row length nor power of two), so a read at a wrapped 32-bit
// offset gets different values and shows. Sampled rows (the first and last, those around element
// 2^31 and byte 2^32, and random ones) are checked against the CPU backend run on just those
// rows (for the key offset, the previous token's row too), with the GPU tests' tolerance for
// bf16 and bit for bit for e4m3. Outputs are poisoned first (0xff bytes: NaN patterns no op
// writes). Needs 20 GB of free GPU memory, else skips saying so.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gpu_util.hpp"
#include "qkvfuse/qkvfuse.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace qkvfuse::test {
namespace {

constexpr size_t kRequiredFreeBytes = size_t(20) << 30;
constexpr int64_t kPatternElements = 1000003;  // prime

/// Skips the test (with the reason) unless the GPU has kRequiredFreeBytes free.
#define QKVF_REQUIRE_FREE_MEMORY()                                                              \
  do {                                                                                          \
    size_t free_bytes = 0, total_bytes = 0;                                                     \
    ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);                          \
    if (free_bytes < kRequiredFreeBytes) {                                                      \
      GTEST_SKIP() << "needs 20 GB of free GPU memory, " << (free_bytes >> 20) << " MiB free"; \
    }                                                                                           \
  } while (0)

/// Fills `count` elements of `element_bytes` each at `device` with `pattern` repeated: one upload,
/// then copies of the filled prefix doubling it (the prefix is always whole periods long).
void fill_periodic(void* device, int64_t count, const void* pattern, int64_t period,
                   size_t element_bytes) {
  const int64_t first = std::min(count, period);
  ASSERT_EQ(cudaMemcpy(device, pattern, size_t(first) * element_bytes, cudaMemcpyHostToDevice),
            cudaSuccess);
  auto* bytes = static_cast<char*>(device);
  for (int64_t filled = first; filled < count;) {
    const int64_t n = std::min(filled, count - filled);
    ASSERT_EQ(cudaMemcpy(bytes + size_t(filled) * element_bytes, bytes, size_t(n) * element_bytes,
                         cudaMemcpyDeviceToDevice),
              cudaSuccess);
    filled += n;
  }
}

template <typename T>
std::vector<T> download(const void* device, int64_t first, int64_t count) {
  std::vector<T> host(static_cast<size_t>(count));
  EXPECT_EQ(cudaMemcpy(host.data(), static_cast<const T*>(device) + first, size_t(count) * sizeof(T),
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  return host;
}

int32_t bf16_order(uint16_t bits) {
  return (bits & 0x8000) ? -int32_t(bits & 0x7fff) : int32_t(bits & 0x7fff);
}
bool bf16_is_nan(uint16_t bits) { return (bits & 0x7f80) == 0x7f80 && (bits & 0x007f) != 0; }

/// GPU bf16 rows against the CPU's (test_cuda_qk_norm_rope.cpp's rule); returns the number of
/// bad elements and describes the first.
int64_t compare_rows(const std::vector<uint16_t>& gpu, const std::vector<uint16_t>& cpu,
                     int64_t row_length, std::string& first_bad) {
  int64_t bad = 0;
  for (size_t start = 0; start < cpu.size(); start += size_t(row_length)) {
    double row_max = 0;
    for (size_t i = start; i < start + size_t(row_length); ++i) {
      row_max = std::fmax(row_max, std::fabs(bf16_to_float(cpu[i])));
    }
    for (size_t i = start; i < start + size_t(row_length); ++i) {
      const uint16_t a = gpu[i], b = cpu[i];
      const double va = bf16_to_float(a), vb = bf16_to_float(b);
      const bool ok = !bf16_is_nan(a) && !bf16_is_nan(b) &&
                      (a == b || std::abs(bf16_order(a) - bf16_order(b)) <= 1 ||
                       std::fabs(va - vb) <= kSumOrderNoise * row_max + std::fabs(vb) / 256);
      if (!ok && bad++ == 0) {
        std::ostringstream out;
        out << "element " << i << ": gpu " << va << " (0x" << std::hex << a << ") cpu " << std::dec
            << vb << " (0x" << std::hex << b << ")";
        first_bad = out.str();
      }
    }
  }
  return bad;
}

/// Sample indices in [0, count): the ends, around `boundaries`, and `random` more.
std::vector<int64_t> samples(int64_t count, std::initializer_list<double> boundaries, int random,
                             std::mt19937_64& rng) {
  std::vector<int64_t> out = {0, 1, count - 2, count - 1};
  for (double b : boundaries) {
    const int64_t center = int64_t(b);
    for (int64_t i = center - 1; i <= center + 1; ++i) {
      if (i >= 0 && i < count) out.push_back(i);
    }
  }
  std::uniform_int_distribution<int64_t> pick(0, count - 1);
  for (int i = 0; i < random; ++i) out.push_back(pick(rng));
  return out;
}

// ---- qk_norm_rope ----------------------------------------------------------------------------------

TEST(CudaLarge, QkNormRopeOver2To31Elements) {
  QKVF_REQUIRE_GPU();
  QKVF_REQUIRE_FREE_MEMORY();
  constexpr int64_t kT = 1400000, kH = 6, kD = 128, kRow = 2 * kH * kD;
  static_assert(kT * kRow > (int64_t(1) << 31), "qk must exceed 2^31 elements");
  auto rng = rng_for_test();

  DeviceBuffer qk(size_t(kT * kRow) * 2);
  DeviceBuffer f1(size_t(kT * kD) * 2), f2(size_t(kT * kD) * 2);
  DeviceBuffer q(size_t(kT * kH * kD) * 2), k(size_t(kT * kH * kD) * 2);
  {
    const std::vector<uint16_t> pattern = random_bf16(rng, size_t(kPatternElements));
    fill_periodic(qk.data(), kT * kRow, pattern.data(), kPatternElements, 2);
    // Factor tables of 4099 tokens (prime), repeated; dims >= 64 stationary (key offset).
    constexpr int64_t kTableTokens = 4099;
    std::vector<float> t1, t2;
    rotary_tables(kTableTokens, kD, 1, kD / 2, t1, t2);
    std::vector<uint16_t> b1, b2;
    for (float v : t1) b1.push_back(float_to_bf16(v));
    for (float v : t2) b2.push_back(float_to_bf16(v));
    fill_periodic(f1.data(), kT * kD, b1.data(), kTableTokens * kD, 2);
    fill_periodic(f2.data(), kT * kD, b2.data(), kTableTokens * kD, 2);
  }
  // The fills ran on the legacy stream (device-to-device cudaMemcpy returns before it is done);
  // the op runs on a non-blocking stream, which does not wait for it.
  synchronize();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);

  // Token rows around qk element 2^31 and byte 2^32 (the same token here: 2^31 / 1536), and
  // around q/k element 2^30 = byte 2^31 (2^30 / 768: the same token again), and half way.
  const double boundary = double(int64_t(1) << 31) / double(kRow);
  const std::vector<int64_t> tokens = samples(kT, {boundary, boundary / 2, kT / 2.0}, 8, rng);

  for (bool key_offset : {false, true}) {
    SCOPED_TRACE(key_offset ? "key offset, rotary_dim 64" : "plain");
    const TensorView device_f1 = make_view(f1.data(), DType::kBFloat16, kGPU, {kT, kD});
    const TensorView device_f2 = make_view(f2.data(), DType::kBFloat16, kGPU, {kT, kD});
    q.fill_byte(0xff);
    k.fill_byte(0xff);
    synchronize();  // the poison (cudaMemset, legacy stream) lands before the op starts
    QkNormRopeParams params;
    params.qk = make_view(qk.data(), DType::kBFloat16, kGPU, {kT, 2 * kH, kD});
    params.q = make_view(q.data(), DType::kBFloat16, kGPU, {kT, kH, kD});
    params.k = make_view(k.data(), DType::kBFloat16, kGPU, {kT, kH, kD});
    params.layout =
        tables_layout(kH, key_offset ? kD / 2 : kD, false, key_offset, device_f1, device_f2);
    params.stream = stream;
    qk_norm_rope(params);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);

    for (int64_t t : tokens) {
      // The CPU backend on token t alone, or on tokens t-1 and t for the key offset (t > 0).
      const int64_t first = key_offset && t > 0 ? t - 1 : t;
      const int64_t n = t - first + 1;
      std::vector<uint16_t> host_qk = download<uint16_t>(qk.data(), first * kRow, n * kRow);
      std::vector<uint16_t> host_f1 = download<uint16_t>(f1.data(), first * kD, n * kD);
      std::vector<uint16_t> host_f2 = download<uint16_t>(f2.data(), first * kD, n * kD);
      std::vector<uint16_t> cpu_q(size_t(n * kH * kD)), cpu_k(size_t(n * kH * kD));
      qk_norm_rope({make_view(host_qk.data(), DType::kBFloat16, kCPU, {n, 2 * kH, kD}),
                    make_view(cpu_q.data(), DType::kBFloat16, kCPU, {n, kH, kD}),
                    make_view(cpu_k.data(), DType::kBFloat16, kCPU, {n, kH, kD}),
                    tables_layout(kH, key_offset ? kD / 2 : kD, false, key_offset,
                                  make_view(host_f1.data(), DType::kBFloat16, kCPU, {n, kD}),
                                  make_view(host_f2.data(), DType::kBFloat16, kCPU, {n, kD}))});
      const std::vector<uint16_t> want_q(cpu_q.end() - kH * kD, cpu_q.end());
      const std::vector<uint16_t> want_k(cpu_k.end() - kH * kD, cpu_k.end());
      const std::vector<uint16_t> got_q = download<uint16_t>(q.data(), t * kH * kD, kH * kD);
      const std::vector<uint16_t> got_k = download<uint16_t>(k.data(), t * kH * kD, kH * kD);
      std::string first_bad;
      EXPECT_EQ(compare_rows(got_q, want_q, kD, first_bad), 0) << "q token " << t << ": " << first_bad;
      EXPECT_EQ(compare_rows(got_k, want_k, kD, first_bad), 0) << "k token " << t << ": " << first_bad;
    }
  }
  cudaStreamDestroy(stream);
}

// ---- quantize_dual_layout --------------------------------------------------------------------------

TEST(CudaLarge, QuantizeOver2To31Elements) {
  QKVF_REQUIRE_GPU();
  QKVF_REQUIRE_FREE_MEMORY();
  constexpr int64_t kM = 65536 + 16, kN = 32768 + 16;
  static_assert(kM * kN > (int64_t(1) << 31), "src must exceed 2^31 elements");
  const float scale = 0.0371f;  // not a power of two; N(0, 2) / scale saturates now and then
  auto rng = rng_for_test();

  const std::vector<uint16_t> pattern = random_bf16(rng, size_t(kPatternElements), 2.0f);
  float pattern_amax = 0.0f;
  for (uint16_t v : pattern) pattern_amax = std::fmax(pattern_amax, std::fabs(bf16_to_float(v)));
  // Element (r, c) of src holds pattern[(r * N + c) mod L].
  const auto src_at = [&](int64_t r, int64_t c) {
    return pattern[size_t((r * kN + c) % kPatternElements)];
  };

  DeviceBuffer src(size_t(kM * kN) * 2);
  DeviceBuffer row(size_t(kM * kN)), t(size_t(kM * kN));
  DeviceBuffer scale_buffer = DeviceBuffer::from(std::vector<float>{scale});
  DeviceBuffer amax = DeviceBuffer::from(std::vector<float>{-1.0f});
  fill_periodic(src.data(), kM * kN, pattern.data(), kPatternElements, 2);
  row.fill_byte(0xff);
  t.fill_byte(0xff);
  synchronize();  // fills and poison (legacy stream) land before the op's non-blocking stream

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  QuantizeDualParams params;
  params.src = make_view(src.data(), DType::kBFloat16, kGPU, {kM, kN});
  params.scale = make_view(scale_buffer.data(), DType::kFloat32, kGPU, {});
  params.row = make_view(row.data(), DType::kFloat8E4M3, kGPU, {kM, kN});
  params.t = make_view(t.data(), DType::kFloat8E4M3, kGPU, {kN, kM});
  params.amax = make_view(amax.data(), DType::kFloat32, kGPU, {});
  params.stream = stream;
  quantize_dual_layout(params);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaStreamDestroy(stream);

  // Every pattern value occurs in src, so amax is the pattern's.
  EXPECT_EQ(download<float>(amax.data(), 0, 1)[0], pattern_amax);

  // Rows of the row layout: around element 2^31 (row 2^31 / N) and byte 2^32 of src.
  const double src_boundary = double(int64_t(1) << 31) / double(kN);
  for (int64_t r : samples(kM, {src_boundary, 2 * src_boundary}, 4, rng)) {
    std::vector<uint16_t> host(static_cast<size_t>(kN));
    for (int64_t c = 0; c < kN; ++c) host[size_t(c)] = src_at(r, c);
    std::vector<uint8_t> want(static_cast<size_t>(kN)), want_t(static_cast<size_t>(kN));
    float host_scale = scale;
    QuantizeDualParams cpu;
    cpu.src = make_view(host.data(), DType::kBFloat16, kCPU, {1, kN});
    cpu.scale = make_view(&host_scale, DType::kFloat32, kCPU, {});
    cpu.row = make_view(want.data(), DType::kFloat8E4M3, kCPU, {1, kN});
    cpu.t = make_view(want_t.data(), DType::kFloat8E4M3, kCPU, {kN, 1});
    quantize_dual_layout(cpu);
    EXPECT_TRUE(download<uint8_t>(row.data(), r * kN, kN) == want) << "row layout, row " << r;
  }
  // Rows of the transposed layout (columns of src): around t's element 2^31 (row 2^31 / M).
  const double t_boundary = double(int64_t(1) << 31) / double(kM);
  for (int64_t c : samples(kN, {t_boundary}, 4, rng)) {
    std::vector<uint16_t> host(static_cast<size_t>(kM));
    for (int64_t r = 0; r < kM; ++r) host[size_t(r)] = src_at(r, c);
    std::vector<uint8_t> want_row(static_cast<size_t>(kM)), want(static_cast<size_t>(kM));
    float host_scale = scale;
    QuantizeDualParams cpu;
    cpu.src = make_view(host.data(), DType::kBFloat16, kCPU, {kM, 1});
    cpu.scale = make_view(&host_scale, DType::kFloat32, kCPU, {});
    cpu.row = make_view(want_row.data(), DType::kFloat8E4M3, kCPU, {kM, 1});
    cpu.t = make_view(want.data(), DType::kFloat8E4M3, kCPU, {1, kM});
    quantize_dual_layout(cpu);
    EXPECT_TRUE(download<uint8_t>(t.data(), c * kM, kM) == want) << "transposed layout, row " << c;
  }
}

}  // namespace
}  // namespace qkvfuse::test
