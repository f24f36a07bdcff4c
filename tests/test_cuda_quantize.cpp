// test_cuda_quantize.cpp: the CUDA dual-layout quantize and weight-bank refresh, bit for bit.
//
// Every output is compared bit for bit with the CPU backend (through the public API on CPU views)
// and with this file's own few-line reference (float_to_e4m3(src / scale), the transpose, the max
// of |src| with NaN propagating): the e4m3 cast and the fp32 division are exact operations, so
// there is no tolerance. Outputs are poisoned before each run (e4m3 0x7f is NaN; amax and scales
// get a finite junk value) so that an element never written shows. Sizes cover the 16-byte fast
// path (M, N multiples of 16), its edge tiles (1000, 2304 are not multiples of 64), and the
// element-wise path (1, 3, 17, an unaligned source); values cover NaN, +-inf, saturation past
// 448 * scale, e4m3 subnormals, -0 and bf16 subnormals.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "gpu_util.hpp"
#include "qkvfuse/qkvfuse.hpp"
#include "test_util.hpp"

namespace qkvfuse::test {
namespace {

constexpr float kJunk = 1234.5f;  // poison for float outputs

/// One quantize problem: a source in padded storage (any strides), its scales.
struct Case {
  int64_t batch = 0;  // 0: plain [M, N]
  int64_t m = 0, n = 0;
  int64_t row_stride = 0, batch_stride = 0, offset = 0;  // src view in `storage`, elements
  std::vector<uint16_t> storage;
  std::vector<float> scale;  // one per entry (one for plain)
  int scale_ndim = 0;        // plain: 0 ([]) or 1 ([1])
  bool with_amax = false;
  int amax_ndim = 0;         // plain: 0 or 1

  int64_t entries() const { return batch == 0 ? 1 : batch; }
  uint16_t at(int64_t b, int64_t i, int64_t j) const {
    return storage[size_t(offset + b * batch_stride + i * row_stride + j)];
  }
};

struct Result {
  std::vector<uint8_t> row;  // [B, M, N]
  std::vector<uint8_t> t;    // [B, N, M]
  std::vector<float> amax;   // [B] (empty when not requested)
};

Case make_case(std::mt19937_64& rng, int64_t batch, int64_t m, int64_t n, float sigma,
               int64_t row_pad = 0, int64_t batch_pad = 0, int64_t offset = 0) {
  Case c;
  c.batch = batch;
  c.m = m;
  c.n = n;
  c.row_stride = n + row_pad;
  c.batch_stride = m * c.row_stride + batch_pad;
  c.offset = offset;
  const int64_t entries = c.entries();
  c.storage.assign(size_t(offset + entries * c.batch_stride), float_to_bf16(NAN));  // padding: NaN
  std::normal_distribution<float> normal(0.0f, sigma);
  for (int64_t b = 0; b < entries; ++b)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j)
        c.storage[size_t(offset + b * c.batch_stride + i * c.row_stride + j)] = float_to_bf16(normal(rng));
  std::uniform_real_distribution<float> scales(0.5f / 448.0f, 16.0f / 448.0f);
  for (int64_t b = 0; b < entries; ++b) c.scale.push_back(scales(rng));
  return c;
}

QuantizeDualParams make_params(const Case& c, Device device, uint16_t* storage, float* scale,
                               uint8_t* row, uint8_t* t, float* amax) {
  QuantizeDualParams p;
  uint16_t* src = storage + c.offset;
  if (c.batch == 0) {
    p.src = make_view(src, DType::kBFloat16, device, {c.m, c.n}, {c.row_stride, 1});
    p.scale = c.scale_ndim == 0 ? make_view(scale, DType::kFloat32, device, {})
                                : make_view(scale, DType::kFloat32, device, {1});
    p.row = make_view(row, DType::kFloat8E4M3, device, {c.m, c.n});
    p.t = make_view(t, DType::kFloat8E4M3, device, {c.n, c.m});
    if (c.with_amax) {
      p.amax = c.amax_ndim == 0 ? make_view(amax, DType::kFloat32, device, {})
                                : make_view(amax, DType::kFloat32, device, {1});
    }
  } else {
    p.src = make_view(src, DType::kBFloat16, device, {c.batch, c.m, c.n},
                      {c.batch_stride, c.row_stride, 1});
    p.scale = make_view(scale, DType::kFloat32, device, {c.batch});
    p.row = make_view(row, DType::kFloat8E4M3, device, {c.batch, c.m, c.n});
    p.t = make_view(t, DType::kFloat8E4M3, device, {c.batch, c.n, c.m});
    if (c.with_amax) p.amax = make_view(amax, DType::kFloat32, device, {c.batch});
  }
  return p;
}

Result run_cpu(const Case& c) {
  const size_t count = size_t(c.entries() * c.m * c.n);
  std::vector<uint16_t> storage = c.storage;
  std::vector<float> scale = c.scale;
  Result r{std::vector<uint8_t>(count, kPoisonE4M3), std::vector<uint8_t>(count, kPoisonE4M3),
           std::vector<float>(size_t(c.entries()), kJunk)};
  quantize_dual_layout(make_params(c, kCPU, storage.data(), scale.data(), r.row.data(),
                                   r.t.data(), r.amax.data()));
  if (!c.with_amax) r.amax.clear();
  return r;
}

Result run_gpu(const Case& c, cudaStream_t stream = nullptr) {
  const size_t count = size_t(c.entries() * c.m * c.n);
  DeviceBuffer storage = DeviceBuffer::from(c.storage);
  DeviceBuffer scale = DeviceBuffer::from(c.scale);
  DeviceBuffer row(count), t(count);
  DeviceBuffer amax = DeviceBuffer::from(std::vector<float>(size_t(c.entries()), kJunk));
  row.fill_byte(kPoisonE4M3);
  t.fill_byte(kPoisonE4M3);
  QuantizeDualParams p = make_params(c, kGPU, static_cast<uint16_t*>(storage.data()),
                                     static_cast<float*>(scale.data()),
                                     static_cast<uint8_t*>(row.data()),
                                     static_cast<uint8_t*>(t.data()),
                                     static_cast<float*>(amax.data()));
  p.stream = stream;
  quantize_dual_layout(p);
  synchronize();
  Result r{row.to_host<uint8_t>(), t.to_host<uint8_t>(), amax.to_host<float>()};
  if (!c.with_amax) r.amax.clear();
  return r;
}

/// The few-line reference: e4m3(src / scale) (fp32 division, satfinite RNE), transpose, amax.
Result reference(const Case& c) {
  const int64_t entries = c.entries();
  Result r{std::vector<uint8_t>(size_t(entries * c.m * c.n)),
           std::vector<uint8_t>(size_t(entries * c.m * c.n)), {}};
  for (int64_t b = 0; b < entries; ++b) {
    float amax = 0.0f;
    bool nan = false;
    for (int64_t i = 0; i < c.m; ++i) {
      for (int64_t j = 0; j < c.n; ++j) {
        const float x = bf16_to_float(c.at(b, i, j));
        if (std::isnan(x)) nan = true;
        amax = std::max(amax, std::fabs(x));
        const uint8_t q = float_to_e4m3(x / c.scale[size_t(b)]);
        r.row[size_t((b * c.m + i) * c.n + j)] = q;
        r.t[size_t((b * c.n + j) * c.m + i)] = q;
      }
    }
    if (c.with_amax) r.amax.push_back(nan ? std::numeric_limits<float>::quiet_NaN() : amax);
  }
  return r;
}

/// Float equality that treats every NaN as equal to every NaN.
bool same_float(float x, float y) {
  return (std::isnan(x) && std::isnan(y)) || float_bits(x) == float_bits(y);
}

void expect_bytes_equal(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                        const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t mismatches = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      if (first < 0) first = int64_t(i);
      ++mismatches;
    }
  }
  EXPECT_EQ(mismatches, 0) << what << ": first mismatch at flat index " << first << " (got 0x"
                           << std::hex << int(first >= 0 ? got[size_t(first)] : 0) << ", want 0x"
                           << int(first >= 0 ? want[size_t(first)] : 0) << std::dec << ")";
}

void expect_results_equal(const Result& got, const Result& want, const char* against) {
  SCOPED_TRACE(against);
  expect_bytes_equal(got.row, want.row, "row");
  expect_bytes_equal(got.t, want.t, "t");
  ASSERT_EQ(got.amax.size(), want.amax.size());
  for (size_t b = 0; b < got.amax.size(); ++b) {
    EXPECT_TRUE(same_float(got.amax[b], want.amax[b]))
        << "amax[" << b << "]: got " << got.amax[b] << ", want " << want.amax[b];
  }
}

/// GPU vs CPU backend and vs the reference, plus a bitwise rerun.
void check_case(const Case& c) {
  SCOPED_TRACE(::testing::Message() << "B=" << c.batch << " M=" << c.m << " N=" << c.n
                                    << " row_stride=" << c.row_stride << " offset=" << c.offset
                                    << " amax=" << c.with_amax);
  const Result gpu = run_gpu(c);
  expect_results_equal(gpu, reference(c), "vs reference");
  expect_results_equal(gpu, run_cpu(c), "vs CPU backend");
  const Result again = run_gpu(c);
  EXPECT_TRUE(gpu.row == again.row && gpu.t == again.t) << "rerun differs";
  for (size_t b = 0; b < gpu.amax.size(); ++b) {
    EXPECT_EQ(float_bits(gpu.amax[b]), float_bits(again.amax[b])) << "rerun amax differs";
  }
}

/// Writes the special values at distinct random positions of every entry. NaN (when asked) and
/// +-inf go first, so they are always present even in an entry smaller than the list (3 x 3):
/// positions drawn with replacement let a later special overwrite the inf, which the first H200
/// run hit (amax 1e30 where inf was expected, the kernel agreeing with the reference).
void inject_special_values(Case& c, bool with_nan, std::mt19937_64& rng) {
  const float scale = c.scale[0];
  std::vector<float> specials;
  if (with_nan) {
    specials.push_back(NAN);
    specials.push_back(-NAN);
  }
  for (float v : {INFINITY, -INFINITY, 1e30f, -1e30f,
                  448.0f * scale, -448.0f * scale,     // exactly the largest e4m3
                  464.0f * scale, 500.0f * scale,      // past it: saturate
                  0.0f, -0.0f,
                  bf16_to_float(0x0001), bf16_to_float(0x8001),  // bf16 subnormals
                  0.001953125f * scale, 0.0009765625f * scale,   // e4m3 smallest subnormal, half (tie)
                  0.0029296875f * scale,                         // 1.5 * 2^-9: tie between subnormals
                  1.0625f * scale, 1.1875f * scale}) {           // ties between normals
    specials.push_back(v);
  }
  std::vector<int64_t> positions(size_t(c.m * c.n));
  for (size_t p = 0; p < positions.size(); ++p) positions[p] = int64_t(p);
  for (int64_t b = 0; b < c.entries(); ++b) {
    std::shuffle(positions.begin(), positions.end(), rng);
    const size_t count = std::min(specials.size(), positions.size());
    for (size_t s = 0; s < count; ++s) {
      const int64_t i = positions[s] / c.n, j = positions[s] % c.n;
      c.storage[size_t(c.offset + b * c.batch_stride + i * c.row_stride + j)] =
          float_to_bf16(specials[s]);
    }
  }
}

// ---- dual layout -------------------------------------------------------------------------------

TEST(CudaQuantize, PlainAllSizesBitExact) {
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  const int64_t sizes[] = {1, 3, 17, 1000, 768, 2304};
  int variant = 0;
  for (int64_t m : sizes) {
    for (int64_t n : sizes) {
      Case c = make_case(rng, 0, m, n, 2.0f);
      c.with_amax = variant % 3 != 2;
      c.amax_ndim = variant % 2;
      c.scale_ndim = (variant / 2) % 2;
      ++variant;
      check_case(c);
    }
  }
}

TEST(CudaQuantize, ActivationShape) {
  // x [T, C] at a reduced T, with the workload's static x_scale = 8/448.
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  Case c = make_case(rng, 0, 4096, 768, 1.0f);
  c.scale = {8.0f / 448.0f};
  c.with_amax = true;
  check_case(c);
}

TEST(CudaQuantize, StridedSources) {
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  // Padded rows on the 16-byte path (M, N multiples of 16).
  Case padded = make_case(rng, 0, 1008, 768, 2.0f, 64);
  padded.with_amax = true;
  check_case(padded);
  // Padded rows on the element-wise path: M, then N, not a multiple of 16.
  for (auto [m, n] : {std::pair<int64_t, int64_t>{1000, 768}, {768, 1000}, {64, 24}}) {
    Case c = make_case(rng, 0, m, n, 2.0f, 8);
    c.with_amax = true;
    check_case(c);
  }
}

TEST(CudaQuantize, MisalignedSourceIsRefusedNotRead) {
  // The public validator wants CUDA rows aligned to their vector width (16 bytes for N = 768);
  // the kernels rely on it. A misaligned view must throw before anything runs.
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  const Case c = make_case(rng, 0, 768, 768, 2.0f, 0, 0, 1);
  EXPECT_THROW(run_gpu(c), Error);
}

TEST(CudaQuantize, SpecialValues) {
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  for (bool with_nan : {true, false}) {
    for (auto [m, n] : {std::pair<int64_t, int64_t>{768, 768}, {1000, 2304}, {17, 1000}, {3, 3}}) {
      Case c = make_case(rng, 0, m, n, 2.0f);
      c.with_amax = true;
      inject_special_values(c, with_nan, rng);
      check_case(c);
      const Result gpu = run_gpu(c);
      if (with_nan) {
        EXPECT_TRUE(std::isnan(gpu.amax[0])) << "NaN must propagate into amax";
      } else {
        EXPECT_EQ(gpu.amax[0], INFINITY) << "inf is the largest |x|";
      }
    }
  }
}

TEST(CudaQuantize, EveryBf16ValueEveryScaleForm) {
  // All 65536 bf16 patterns (NaNs, infs, subnormals, exact e4m3 ties) under scales of every kind
  // (powers of two, the speedrun's 8/448, values whose quotients land on e4m3 rounding midpoints,
  // range edges, zero and infinity), as one [256, 256] entry per scale, bit for bit.
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  const float scales[] = {1.0f, 0.25f, 0x1p-20f, 0x1p40f, -2.0f,         // powers of two
                          8.0f / 448.0f, 1.5f, 3.0f, 0.75f, -0.1f,        // midpoints, ties
                          0x1.fffffep-126f, 0x1p-125f, 0x1p-126f, 1e-40f,  // range edges
                          0x1p125f, 0x1p126f, 0x1.fffffep127f, 0.0f, INFINITY,
                          // The edges of E4m3Scaler's fast path, [2^-29, 2^31], on both sides,
                          // and non-powers of two inside it (1/448, a tiny current-scaling
                          // gradient scale, a large one)
                          0x1p-29f, 0x1.fffffep-30f, 0x1p31f, 0x1.000002p31f,
                          1.0f / 448.0f, 9.3e-8f, 3.3e-9f, 1.7e9f};
  Case c = make_case(rng, int64_t(sizeof(scales) / sizeof(scales[0])), 256, 256, 1.0f);
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int64_t i = 0; i < 65536; ++i) {
      // A different permutation per entry so the tiles mix pattern kinds.
      c.storage[size_t(c.offset + b * c.batch_stride + i)] = uint16_t((i * 40503 + b * 7919) & 0xffff);
    }
    c.scale[size_t(b)] = scales[b];
  }
  c.with_amax = true;
  check_case(c);
  c.with_amax = false;
  check_case(c);
}

TEST(CudaQuantize, BatchedPerEntryScales) {
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  for (auto [m, n] : {std::pair<int64_t, int64_t>{768, 768}, {1000, 768}, {17, 1000}, {2304, 3}}) {
    Case c = make_case(rng, 3, m, n, 2.0f);
    c.with_amax = true;
    check_case(c);
    Case padded = make_case(rng, 3, m, n, 2.0f, 8, 16);
    padded.with_amax = false;
    check_case(padded);
  }
  // NaN in one entry only: only that entry's amax is NaN.
  Case c = make_case(rng, 3, 768, 768, 2.0f);
  c.with_amax = true;
  c.storage[size_t(c.batch_stride + 5 * c.row_stride + 7)] = float_to_bf16(NAN);
  check_case(c);
  const Result gpu = run_gpu(c);
  EXPECT_FALSE(std::isnan(gpu.amax[0]));
  EXPECT_TRUE(std::isnan(gpu.amax[1]));
  EXPECT_FALSE(std::isnan(gpu.amax[2]));
}

TEST(CudaQuantize, NonDefaultStream) {
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  Case c = make_case(rng, 2, 1024, 768, 2.0f);
  c.with_amax = true;
  const Result gpu = run_gpu(c, stream);
  expect_results_equal(gpu, reference(c), "on a non-blocking stream");
  cudaStreamDestroy(stream);
}

// ---- weight bank -------------------------------------------------------------------------------

struct BankResult {
  std::vector<float> scale;
  std::vector<uint8_t> row, t;
};

QuantizeWeightBankParams bank_params(const Case& c, Device device, uint16_t* storage, float* scale,
                                     uint8_t* row, uint8_t* t) {
  QuantizeWeightBankParams p;
  p.src = make_view(storage + c.offset, DType::kBFloat16, device, {c.batch, c.m, c.n},
                    {c.batch_stride, c.row_stride, 1});
  p.scale = make_view(scale, DType::kFloat32, device, {c.batch});
  p.row = make_view(row, DType::kFloat8E4M3, device, {c.batch, c.m, c.n});
  p.t = make_view(t, DType::kFloat8E4M3, device, {c.batch, c.n, c.m});
  return p;
}

BankResult run_bank_gpu(const Case& c) {
  const size_t count = size_t(c.batch * c.m * c.n);
  DeviceBuffer storage = DeviceBuffer::from(c.storage);
  DeviceBuffer scale = DeviceBuffer::from(std::vector<float>(size_t(c.batch), kJunk));
  DeviceBuffer row(count), t(count);
  row.fill_byte(kPoisonE4M3);
  t.fill_byte(kPoisonE4M3);
  quantize_weight_bank(bank_params(c, kGPU, static_cast<uint16_t*>(storage.data()),
                                   static_cast<float*>(scale.data()),
                                   static_cast<uint8_t*>(row.data()),
                                   static_cast<uint8_t*>(t.data())));
  synchronize();
  return {scale.to_host<float>(), row.to_host<uint8_t>(), t.to_host<uint8_t>()};
}

BankResult run_bank_cpu(const Case& c) {
  const size_t count = size_t(c.batch * c.m * c.n);
  std::vector<uint16_t> storage = c.storage;
  BankResult r{std::vector<float>(size_t(c.batch), kJunk), std::vector<uint8_t>(count, kPoisonE4M3),
               std::vector<uint8_t>(count, kPoisonE4M3)};
  quantize_weight_bank(bank_params(c, kCPU, storage.data(), r.scale.data(), r.row.data(),
                                   r.t.data()));
  return r;
}

void check_bank(Case c) {
  SCOPED_TRACE(::testing::Message() << "bank B=" << c.batch << " M=" << c.m << " N=" << c.n);
  const BankResult gpu = run_bank_gpu(c);
  // The reference: scale = amax / 448 (1 for an all-zero entry), then the dual quantize.
  c.with_amax = true;
  const Result amax = reference(c);
  std::vector<float> want_scale;
  for (float a : amax.amax) want_scale.push_back(a == 0.0f ? 1.0f : a / 448.0f);
  c.scale = want_scale;
  c.with_amax = false;
  const Result want = reference(c);
  for (size_t b = 0; b < want_scale.size(); ++b) {
    EXPECT_TRUE(same_float(gpu.scale[b], want_scale[b]))
        << "scale[" << b << "]: got " << gpu.scale[b] << ", want " << want_scale[b];
  }
  expect_bytes_equal(gpu.row, want.row, "bank row vs reference");
  expect_bytes_equal(gpu.t, want.t, "bank t vs reference");
  const BankResult cpu = run_bank_cpu(c);
  for (size_t b = 0; b < want_scale.size(); ++b) {
    EXPECT_TRUE(same_float(gpu.scale[b], cpu.scale[b])) << "scale[" << b << "] vs CPU backend";
  }
  expect_bytes_equal(gpu.row, cpu.row, "bank row vs CPU backend");
  expect_bytes_equal(gpu.t, cpu.t, "bank t vs CPU backend");
  const BankResult again = run_bank_gpu(c);
  EXPECT_TRUE(again.row == gpu.row && again.t == gpu.t) << "rerun differs";
  for (size_t b = 0; b < gpu.scale.size(); ++b) {
    EXPECT_EQ(float_bits(again.scale[b]), float_bits(gpu.scale[b])) << "rerun scale differs";
  }
}

TEST(CudaQuantize, WeightBankPackedQkvShape) {
  // The per-layer packed [Wq; Wk; Wv] cache: [2304, 768] per layer (H = 6, D = Dv = 128).
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  Case c = make_case(rng, 4, 2304, 768, 0.02f);
  // Entry 2 all zeros: its scale must be 1 and its e4m3 all zeros.
  for (int64_t i = 0; i < c.m; ++i)
    for (int64_t j = 0; j < c.n; ++j)
      c.storage[size_t(2 * c.batch_stride + i * c.row_stride + j)] = 0;
  check_bank(c);
  const BankResult gpu = run_bank_gpu(c);
  EXPECT_EQ(gpu.scale[2], 1.0f);
}

TEST(CudaQuantize, WeightBankOddSizesAndSpecials) {
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  check_bank(make_case(rng, 3, 17, 1000, 0.02f));
  check_bank(make_case(rng, 2, 1, 3, 0.02f));
  check_bank(make_case(rng, 2, 1000, 768, 0.02f, 8, 8));
  check_bank(make_case(rng, 2, 33, 17, 0.02f));   // N % 8 != 0: element-wise amax pass
  check_bank(make_case(rng, 2, 768, 24, 0.02f));  // 16-byte amax pass, element-wise quantize
  Case inf_entry = make_case(rng, 2, 768, 768, 0.02f);
  inf_entry.storage[size_t(inf_entry.batch_stride + 3)] = float_to_bf16(INFINITY);
  check_bank(inf_entry);  // entry 1: scale inf, finite values -> 0, the inf -> NaN
  Case nan_entry = make_case(rng, 2, 768, 768, 0.02f);
  nan_entry.storage[size_t(9)] = float_to_bf16(NAN);
  check_bank(nan_entry);  // entry 0: scale NaN, everything NaN
}

}  // namespace
}  // namespace qkvfuse::test
