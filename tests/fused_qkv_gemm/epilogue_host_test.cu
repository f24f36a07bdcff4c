// epilogue_host_test.cu: the fused QKV GEMM's epilogue checked on the host, no GPU needed.
//
// The epilogue's per-thread math (fused_qkv_epilogue.cuh: fill_fragment, TileMath) is host-device
// code; only the quad butterfly (two shuffles) and the main loop are device-only. So this test
//   1. checks, for all 128 threads of the kernel's own TiledMma (the type the CUTLASS builder
//      makes for the ping-pong FP8 kernel), every layout fact the epilogue relies on: a thread's
//      values at fixed (row half, M repeat) share one row; value (v0, v1, j) sits at column
//      col0 + 8j + v0; the four threads of a quad (i ^ 1, i ^ 2) hold the same rows and together
//      every column once; every tile element belongs to exactly one thread;
//   2. runs the epilogue on whole tiles of random accumulators, thread by thread, with the
//      butterfly replayed in the device's order, for every M and N tile of small problems (the
//      speedrun layout, fp32 factors, D = 64, key offset, paired, GQA, NeoX, a ragged T, the raw
//      qk output; fp32 factors too, which the epilogue takes as a template parameter though the
//      library builds bf16 only), writing into poisoned host buffers, and compares q, k, v and qk with
//      reference.hpp (q, k within 1 bf16 ulp: the row sums add in another order; v, qk bit for
//      bit), with every output element written;
//   3. checks reference.hpp against the library's CPU qk_norm_rope, bit for bit, on the fused
//      GEMM's layouts (so the reference is SPEC.md's, not this file's opinion).
// The factor tables hold random angles in every lane, lanes >= r included, which the pass-through
// must not read (SPEC.md section 8).
// What it cannot check: the WGMMA hardware layout being what CuTe says (CuTe's definition is the
// one the kernel uses, so a mismatch would break every CUTLASS kernel), the shuffles, the memory
// instructions, and everything about the main loop: tests/fused_qkv_gemm/check_fused_qkv_gemm.cu
// runs on the GPU for that.
//
// Exit status 0 when every check passes; prints one line per case.
#include <algorithm>
#include <array>
#include <type_traits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/fused_qkv_gemm_kernel.cuh"
#include "fused_qkv_gemm/reference.hpp"
#include "qkvfuse/qkvfuse.hpp"

namespace {

using namespace qkvfuse;
using namespace qkvfuse::fused_test;
namespace qc = qkvfuse::cuda;  // unqualified `cuda` also names libcu++'s namespace
using qc::FusedQkvEpilogueArgs;

int g_failures = 0;

#define EXPECT(cond, ...)                                      \
  do {                                                         \
    if (!(cond)) {                                             \
      ++g_failures;                                            \
      std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::printf(__VA_ARGS__);                                \
      std::printf("\n");                                       \
    }                                                          \
  } while (0)

constexpr int kTileM = 128;
constexpr int kThreads = 128;  // one consumer warpgroup
constexpr uint16_t kPoison = 0xffffu;  // a bf16 NaN no correct output produces

// ---- the quad transpose across threads -------------------------------------------------------

/// quad_transpose (fused_qkv_epilogue.cuh) for all 128 threads at once: the same send / receive
/// select logic, the shuffles replaced by reading the partner thread's sent words.
template <class Math>
void quad_transpose_all(std::vector<typename Math::Fragment>& frags) {
  auto stage = [&](auto xor_tag) {
    constexpr int kXor = decltype(xor_tag)::value;
    for (int r = 0; r < Math::kRows; ++r) {
      for (int b = 0; b < Math::kBlocks; ++b) {
        std::vector<std::array<uint32_t, 2>> sent(frags.size());
        for (size_t i = 0; i < frags.size(); ++i) {
          uint32_t out[2];
          qc::fused::transpose_send<kXor>(&frags[i].x[r][4 * b], frags[i].lane(), out);
          sent[i] = {out[0], out[1]};
        }
        for (size_t i = 0; i < frags.size(); ++i) {
          const uint32_t in[2] = {sent[i ^ kXor][0], sent[i ^ kXor][1]};
          qc::fused::transpose_receive<kXor>(&frags[i].x[r][4 * b], frags[i].lane(), in);
        }
      }
    }
  };
  stage(std::integral_constant<int, 2>{});
  stage(std::integral_constant<int, 1>{});
}

// ---- 1. the accumulator layout ------------------------------------------------------------------

template <int kHeadDim>
void check_layout() {
  using namespace cute;
  using Kernel = qc::fused::FusedQkvKernel<kHeadDim, qc::EpilogueLayout::kGeneral, qc::FusedFactor>;
  using TiledMma = typename Kernel::Mainloop::TiledMma;
  using Math = typename qc::fused::FusedQkvEpilogue<typename Kernel::TileShape, kHeadDim,
                                                    qc::EpilogueLayout::kGeneral,
                                                    qc::FusedFactor>::Math;
  TiledMma mma;
  EXPECT(int(size(mma)) == kThreads, "TiledMma threads %d", int(size(mma)));
  constexpr int kTileN = Math::kTileN;
  std::vector<int> owner(size_t(kTileM * kTileN), -1);
  std::vector<int> row_of_thread(size_t(kThreads * Math::kRows));
  for (int i = 0; i < kThreads; ++i) {
    auto acc = partition_fragment_C(mma, Shape<Int<kTileM>, Int<Math::kTileN>>{});
    Tensor coords = mma.get_thread_slice(i).partition_C(
        make_identity_tensor(Shape<Int<kTileM>, Int<Math::kTileN>>{}));
    EXPECT(size(acc) == size(coords), "fragment %d vs coords %d", int(size(acc)), int(size(coords)));
    EXPECT(int(size(acc)) == Math::kRows * Math::kGroups * 2, "thread %d holds %d values", i,
           int(size(acc)));
    for (int k = 0; k < int(size(coords)); ++k) {
      const int m = get<0>(coords(k));
      const int n = get<1>(coords(k));
      int& o = owner[size_t(m * kTileN + n)];
      EXPECT(o == -1, "element (%d, %d) held by threads %d and %d", m, n, o, i);
      o = i;
    }
    const int col0 = get<1>(coords(make_coord(0, 0, 0), 0, 0));
    EXPECT(col0 == 2 * (i % 4), "thread %d: col0 %d", i, col0);
    for (int mm = 0; mm < Math::kRows / 2; ++mm) {
      for (int v1 = 0; v1 < 2; ++v1) {
        const int row = get<0>(coords(make_coord(0, v1, 0), mm, 0));
        row_of_thread[size_t(i * Math::kRows + 2 * mm + v1)] = row;
        for (int j = 0; j < Math::kGroups; ++j) {
          for (int v0 = 0; v0 < 2; ++v0) {
            const auto c = coords(make_coord(v0, v1, j), mm, 0);
            EXPECT(get<0>(c) == row && get<1>(c) == col0 + 8 * j + v0,
                   "thread %d value (%d, %d, %d, mm %d) at (%d, %d), expected (%d, %d)", i, v0, v1,
                   j, mm, int(get<0>(c)), int(get<1>(c)), row, col0 + 8 * j + v0);
          }
        }
      }
    }
  }
  for (size_t e = 0; e < owner.size(); ++e) {
    EXPECT(owner[e] >= 0, "element (%d, %d) held by no thread", int(e) / kTileN, int(e) % kTileN);
  }
  // A quad shares its rows (the butterfly's partners i ^ 1 and i ^ 2).
  for (int i = 0; i < kThreads; ++i) {
    for (int x : {1, 2, 3}) {
      for (int r = 0; r < Math::kRows; ++r) {
        EXPECT(row_of_thread[size_t(i * Math::kRows + r)] ==
                   row_of_thread[size_t((i ^ x) * Math::kRows + r)],
               "threads %d and %d differ on fragment row %d", i, i ^ x, r);
      }
    }
  }
  // After the quad transpose, word (r, 4b + w) of thread q holds columns 8(4b + q) + 2w, + 1 of
  // the same row: run the transpose on words that encode their own column.
  std::vector<typename Math::Fragment> frags(kThreads);
  for (int i = 0; i < kThreads; ++i) {
    auto acc = partition_fragment_C(mma, Shape<Int<kTileM>, Int<Math::kTileN>>{});
    Tensor coords = mma.get_thread_slice(i).partition_C(
        make_identity_tensor(Shape<Int<kTileM>, Int<Math::kTileN>>{}));
    // fill_fragment computes bf16(acc * 1): small integers are exact in bf16 (<= 256).
    for (int e = 0; e < int(size(acc)); ++e) acc(e) = float(get<1>(coords(e)) + 1);
    qc::fused::fill_fragment<Math, kTileM>(frags[size_t(i)], acc, mma, i, 1.0f);
  }
  const std::vector<typename Math::Fragment> before = frags;
  quad_transpose_all<Math>(frags);
  for (int i = 0; i < kThreads; ++i) {
    const auto& f = frags[size_t(i)];
    EXPECT(f.lane() == i % 4, "thread %d lane %d", i, f.lane());
    for (int r = 0; r < Math::kRows; ++r) {
      EXPECT(f.rows[r] == before[size_t(i)].rows[r], "thread %d row %d moved", i, r);
      for (int b = 0; b < Math::kBlocks; ++b) {
        for (int w = 0; w < 4; ++w) {
          const int col = f.chunk_col(b) + 2 * w;
          const uint32_t want = qc::fused::pack_bf16x2(float(col + 1), float(col + 2));
          EXPECT(f.x[r][4 * b + w] == want, "thread %d row %d block %d word %d: got %08x, want %08x",
                 i, r, b, w, f.x[r][4 * b + w], want);
        }
      }
    }
  }
  std::printf("layout D=%d: %d threads x %d rows x %d column pairs, and the quad transpose, checked\n",
              kHeadDim, kThreads, Math::kRows, Math::kGroups);
}

// ---- 2. whole tiles ----------------------------------------------------------------------------

struct Case {
  const char* name;
  QkvShape shape;
  bool fp32_factors = false;
  bool raw_qk = false;
};

/// The host buffers of one problem: the "accumulators" (what the main loop would hold), the
/// scales, the factor tables, the outputs.
struct HostProblem {
  QkvShape s;
  int64_t m_pad = 0;
  std::vector<float> acc;  ///< [m_pad, N]; rows >= T are zero, as TMA's out-of-bounds fill
  float scale_a = 0.5f, scale_b = 0.375f, alpha = 1.25f;
  std::vector<float> f1, f2;            ///< fp32 values [T, FW]
  std::vector<uint16_t> f1_bf16, f2_bf16;
  std::vector<uint16_t> q, k, v, qk;    ///< outputs, contiguous
};

void make_problem(const Case& c, HostProblem& p, uint32_t seed) {
  const QkvShape& s = c.shape;
  p.s = s;
  p.m_pad = (s.tokens + kTileM - 1) / kTileM * kTileM;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  p.acc.assign(size_t(p.m_pad * s.n()), 0.0f);
  for (int64_t t = 0; t < s.tokens; ++t) {
    for (int64_t j = 0; j < s.n(); ++j) p.acc[size_t(t * s.n() + j)] = normal(rng);
  }
  // One all-zero Q/K row (rstd = 1/sqrt(eps), n = 0) and one tiny one.
  if (s.tokens > 3) {
    for (int64_t d = 0; d < s.head_dim; ++d) p.acc[size_t(3 * s.n() + d)] = 0.0f;
    for (int64_t d = 0; d < s.head_dim; ++d) p.acc[size_t(2 * s.n() + s.head_dim + d)] *= 1e-20f;
  }
  const int64_t fw = s.factor_width();
  p.f1.resize(size_t(s.tokens * fw));
  p.f2.resize(size_t(s.tokens * fw));
  std::uniform_real_distribution<float> angle(-3.14159265f, 3.14159265f);
  for (int64_t t = 0; t < s.tokens; ++t) {
    for (int64_t j = 0; j < fw; j += 2) {
      // Lanes >= r too: not the stationary (1, 0), so that a lane read there shows.
      const float a = angle(rng);
      const float cs = std::cos(a);
      const float sn = std::sin(a);
      // Interleaved: (cos, -sin ; cos, +sin) on the pair; NeoX takes the same tables (SPEC.md 8:
      // the tables carry the signs), here simply random-signed.
      p.f1[size_t(t * fw + j)] = cs;
      p.f1[size_t(t * fw + j + 1)] = cs;
      p.f2[size_t(t * fw + j)] = -sn;
      p.f2[size_t(t * fw + j + 1)] = sn;
    }
  }
  if (!c.fp32_factors) {
    // bf16 tables: the kernel reads the bf16 values, so the reference takes the same values.
    p.f1_bf16.resize(p.f1.size());
    p.f2_bf16.resize(p.f2.size());
    for (size_t i = 0; i < p.f1.size(); ++i) {
      p.f1_bf16[i] = float_to_bf16(p.f1[i]);
      p.f2_bf16[i] = float_to_bf16(p.f2[i]);
      p.f1[i] = bf16_to_float(p.f1_bf16[i]);
      p.f2[i] = bf16_to_float(p.f2_bf16[i]);
    }
  }
  p.q.assign(size_t(s.tokens * s.q_heads * s.head_dim), kPoison);  // [T, H, D] or [2T, H/2, D]
  p.k.assign(size_t(s.tokens * s.kv_heads * s.head_dim), kPoison);
  p.v.assign(size_t(s.tokens * s.kv_heads * s.v_dim), kPoison);
  p.qk.assign(c.raw_qk ? size_t(s.tokens * s.qk_cols()) : 0, kPoison);
}

FusedQkvEpilogueArgs make_args(const Case& c, HostProblem& p) {
  const QkvShape& s = p.s;
  FusedQkvEpilogueArgs a;
  a.scale_a = &p.scale_a;
  a.scale_b = &p.scale_b;
  a.alpha = &p.alpha;
  a.tokens = int(s.tokens);
  a.head_dim = int(s.head_dim);
  a.q_heads = int(s.q_heads);
  a.kv_heads = int(s.kv_heads);
  a.v_dim = int(s.v_dim);
  a.rotary_dim = int(s.rotary_dim);
  a.paired = s.paired;
  a.key_offset = s.key_offset;
  a.neox = s.neox;
  a.eps = s.eps;
  a.factor1 = c.fp32_factors ? static_cast<const void*>(p.f1.data()) : p.f1_bf16.data();
  a.factor2 = c.fp32_factors ? static_cast<const void*>(p.f2.data()) : p.f2_bf16.data();
  a.factor1_stride = s.factor_width();
  a.factor2_stride = s.factor_width();
  const int64_t out_q_heads = s.paired ? s.q_heads / 2 : s.q_heads;
  const int64_t out_kv_heads = s.paired ? s.kv_heads / 2 : s.kv_heads;
  a.q = p.q.data();
  a.q_stride_t = out_q_heads * s.head_dim;
  a.q_stride_h = s.head_dim;
  a.k = p.k.data();
  a.k_stride_t = out_kv_heads * s.head_dim;
  a.k_stride_h = s.head_dim;
  a.v = p.v.data();
  a.v_stride_t = s.kv_heads * s.v_dim;
  a.v_stride_h = s.v_dim;
  a.qk = c.raw_qk ? p.qk.data() : nullptr;
  a.qk_stride_t = s.qk_cols();
  return a;
}

/// The device epilogue's qk_tile / store_v sequence (fused_qkv_epilogue.cuh,
/// FusedQkvEpilogue::operator()), for the 128 threads of one tile in turn, with the quad
/// butterfly done between the phases exactly as the shuffles do it.
template <int kHeadDim, qc::EpilogueLayout kLayout, typename FactorT>
void run_tile(const FusedQkvEpilogueArgs& a, const HostProblem& p, int m_tile, int n_tile) {
  using namespace cute;
  using Kernel = qc::fused::FusedQkvKernel<kHeadDim, kLayout, FactorT>;
  using Math =
      typename qc::fused::FusedQkvEpilogue<typename Kernel::TileShape, kHeadDim, kLayout, FactorT>::Math;
  typename Kernel::Mainloop::TiledMma mma;
  const int m0 = m_tile * kTileM;
  const int n0 = n_tile * Math::kTileN;
  const int64_t n = p.s.n();
  const float scale = Math::output_scale(a);

  std::vector<typename Math::Fragment> frags(kThreads);
  for (int i = 0; i < kThreads; ++i) {
    auto acc = partition_fragment_C(mma, Shape<Int<kTileM>, Int<Math::kTileN>>{});
    Tensor coords = mma.get_thread_slice(i).partition_C(
        make_identity_tensor(Shape<Int<kTileM>, Int<Math::kTileN>>{}));
    for (int e = 0; e < int(size(acc)); ++e) {
      const int m = get<0>(coords(e));
      const int col = get<1>(coords(e));
      acc(e) = n0 + col < n ? p.acc[size_t((m0 + m) * n + n0 + col)] : 0.0f;
    }
    qc::fused::fill_fragment<Math, kTileM>(frags[size_t(i)], acc, mma, i, scale);
  }
  quad_transpose_all<Math>(frags);
  if (n0 >= (a.q_heads + a.kv_heads) * kHeadDim) {
    for (int i = 0; i < kThreads; ++i) Math::store_v(a, m0, n0, frags[size_t(i)]);
    return;
  }
  struct Factors {
    typename Math::Factors f1, f2;
  };
  std::vector<Factors> factors(kThreads);
  struct SumsBox {
    typename Math::Sums s;
  };
  std::vector<SumsBox> partial(kThreads), sums(kThreads);
  for (int i = 0; i < kThreads; ++i) {
    Math::load_factors(a, m0, n0, frags[size_t(i)], 0, factors[size_t(i)].f1,
                       factors[size_t(i)].f2);
    Math::store_raw_qk(a, m0, n0, frags[size_t(i)]);
    Math::row_sums(frags[size_t(i)], partial[size_t(i)].s);
  }
  // s += shfl_xor(s, 1); s += shfl_xor(s, 2), each lane adding its own value first.
  for (int i = 0; i < kThreads; ++i) {
    for (int r = 0; r < Math::kRows; ++r) {
      for (int hh = 0; hh < Math::kHeadsPerTile; ++hh) {
        auto pair_sum = [&](int lane) {
          return qc::fused::add_rn(partial[size_t(lane)].s[r][hh], partial[size_t(lane ^ 1)].s[r][hh]);
        };
        sums[size_t(i)].s[r][hh] = qc::fused::add_rn(pair_sum(i), pair_sum(i ^ 2));
      }
    }
  }
  for (int i = 0; i < kThreads; ++i) {
    Math::store_qk_batches(a, m0, n0, frags[size_t(i)], sums[size_t(i)].s, factors[size_t(i)].f1,
                           factors[size_t(i)].f2);
  }
}

template <int kHeadDim, qc::EpilogueLayout kLayout>
void run_problem(const Case& c, const FusedQkvEpilogueArgs& a, const HostProblem& p) {
  const int m_tiles = int(p.m_pad / kTileM);
  const int tile_n = qc::fused_tile_n(kHeadDim);
  const int n_tiles = int((p.s.n() + tile_n - 1) / tile_n);
  for (int mt = 0; mt < m_tiles; ++mt) {
    for (int nt = 0; nt < n_tiles; ++nt) {
      if (c.fp32_factors) {
        run_tile<kHeadDim, kLayout, float>(a, p, mt, nt);
      } else {
        run_tile<kHeadDim, kLayout, uint16_t>(a, p, mt, nt);
      }
    }
  }
}

/// One case through the epilogue compiled for kLayout.
template <qc::EpilogueLayout kLayout>
void check_case(const Case& c, uint32_t seed) {
  HostProblem p;
  make_problem(c, p, seed);
  const FusedQkvEpilogueArgs a = make_args(c, p);
  switch (c.shape.head_dim) {
    case 128: run_problem<128, kLayout>(c, a, p); break;
    case 96: run_problem<96, kLayout>(c, a, p); break;
    case 64: run_problem<64, kLayout>(c, a, p); break;
    default: EXPECT(false, "no head width %d", int(c.shape.head_dim)); return;
  }
  const QkvShape& s = p.s;
  // The pre-norm rows the epilogue saw: bf16(acc * scale), scale in the CPU backend's order.
  const float scale = (p.scale_a * p.scale_b) * p.alpha;
  std::vector<uint16_t> x(size_t(s.tokens * s.n()));
  for (int64_t t = 0; t < s.tokens; ++t) {
    for (int64_t j = 0; j < s.n(); ++j) {
      x[size_t(t * s.n() + j)] = float_to_bf16(p.acc[size_t(t * s.n() + j)] * scale);
    }
  }
  std::vector<uint16_t> q_ref, k_ref;
  reference_qk(s, x.data(), s.n(), p.f1.data(), p.f2.data(), q_ref, k_ref);

  UlpStats qs, ks, vs, raws;
  int64_t unwritten = 0;
  for (size_t i = 0; i < q_ref.size(); ++i) {
    unwritten += p.q[i] == kPoison;
    qs.add(int64_t(i), p.q[i], q_ref[i]);
  }
  for (size_t i = 0; i < k_ref.size(); ++i) {
    unwritten += p.k[i] == kPoison;
    ks.add(int64_t(i), p.k[i], k_ref[i]);
  }
  for (int64_t t = 0; t < s.tokens; ++t) {
    for (int64_t j = 0; j < s.kv_heads * s.v_dim; ++j) {
      const uint16_t got = p.v[size_t(t * s.kv_heads * s.v_dim + j)];
      unwritten += got == kPoison;
      vs.add(t, got, x[size_t(t * s.n() + s.qk_cols() + j)]);
    }
    if (c.raw_qk) {
      for (int64_t j = 0; j < s.qk_cols(); ++j) {
        const uint16_t got = p.qk[size_t(t * s.qk_cols() + j)];
        unwritten += got == kPoison;
        raws.add(t, got, x[size_t(t * s.n() + j)]);
      }
    }
  }
  EXPECT(unwritten == 0, "%s: %lld output elements never written", c.name, (long long)unwritten);
  EXPECT(qs.all_explained() && ks.all_explained(),
         "%s: q max %lld ulps (first unexplained at %lld), k max %lld ulps (first at %lld)", c.name,
         (long long)qs.max_ulps, (long long)qs.first_bad, (long long)ks.max_ulps,
         (long long)ks.first_bad);
  EXPECT(qs.exact_fraction() > 0.99 && ks.exact_fraction() > 0.99,
         "%s: too few bit-exact (q %.5f, k %.5f): more than the row-sum order explains", c.name,
         qs.exact_fraction(), ks.exact_fraction());
  EXPECT(vs.max_ulps == 0 && raws.max_ulps == 0, "%s: v or qk not bit-exact (%lld, %lld ulps)",
         c.name, (long long)vs.max_ulps, (long long)raws.max_ulps);
  std::printf("%-40s %-7s q %.5f / k %.5f bit-exact, %lld / %lld beyond 1 ulp (largest |diff| "
              "%.3g); v%s exact; %lld unwritten\n",
              c.name, kLayout == qc::EpilogueLayout::kSimple ? "simple" : "general",
              qs.exact_fraction(), ks.exact_fraction(), (long long)(qs.count - qs.within1),
              (long long)(ks.count - ks.within1), std::max(qs.max_abs_beyond1, ks.max_abs_beyond1),
              c.raw_qk ? ", qk" : "", (long long)unwritten);
}

// ---- 3. the reference against the library's CPU backend -----------------------------------------

void check_reference_against_library(const QkvShape& s, bool fp32_factors, uint32_t seed) {
  Case c{"reference", s, fp32_factors, false};
  HostProblem p;
  make_problem(c, p, seed);
  std::vector<uint16_t> x(size_t(s.tokens * s.qk_cols()));
  for (size_t i = 0; i < x.size(); ++i) {
    const int64_t t = int64_t(i) / s.qk_cols(), j = int64_t(i) % s.qk_cols();
    x[i] = float_to_bf16(p.acc[size_t(t * s.n() + j)]);
  }
  std::vector<uint16_t> q_ref, k_ref;
  reference_qk(s, x.data(), s.qk_cols(), p.f1.data(), p.f2.data(), q_ref, k_ref);
  std::vector<uint16_t> q(q_ref.size()), k(k_ref.size());
  const Device cpu{DeviceType::kCPU, 0};
  const DType fdt = fp32_factors ? DType::kFloat32 : DType::kBFloat16;
  void* f1 = fp32_factors ? static_cast<void*>(p.f1.data()) : p.f1_bf16.data();
  void* f2 = fp32_factors ? static_cast<void*>(p.f2.data()) : p.f2_bf16.data();
  const int64_t q_out_heads = s.paired ? s.q_heads / 2 : s.q_heads;
  const int64_t k_out_heads = s.paired ? s.kv_heads / 2 : s.kv_heads;
  QkNormRopeParams params;
  params.qk = make_view(x.data(), DType::kBFloat16, cpu,
                        {s.tokens, s.q_heads + s.kv_heads, s.head_dim});
  params.q = make_view(q.data(), DType::kBFloat16, cpu, {s.out_tokens(), q_out_heads, s.head_dim});
  params.k = make_view(k.data(), DType::kBFloat16, cpu, {s.out_tokens(), k_out_heads, s.head_dim});
  params.layout.num_heads = s.q_heads;
  params.layout.num_kv_heads = s.kv_heads;
  params.layout.rotary_dim = s.rotary_dim;
  params.layout.rotary_style = s.neox ? RotaryStyle::kNeox : RotaryStyle::kInterleaved;
  params.layout.eps = s.eps;
  params.layout.paired = s.paired;
  params.layout.key_offset = s.key_offset;
  params.layout.factor1 = make_view(f1, fdt, cpu, {s.tokens, s.factor_width()});
  params.layout.factor2 = make_view(f2, fdt, cpu, {s.tokens, s.factor_width()});
  qk_norm_rope(params);
  const bool same = q == q_ref && k == k_ref;
  EXPECT(same, "reference.hpp differs from the CPU qk_norm_rope (D=%d Hq=%d Hkv=%d r=%d neox=%d "
         "paired=%d key_offset=%d)", int(s.head_dim), int(s.q_heads), int(s.kv_heads),
         int(s.rotary_dim), int(s.neox), int(s.paired), int(s.key_offset));
  std::printf("reference == CPU qk_norm_rope (D=%lld, Hq=%lld, Hkv=%lld, r=%lld, %s, paired=%d, "
              "key_offset=%d, %s factors): %s\n",
              (long long)s.head_dim, (long long)s.q_heads, (long long)s.kv_heads,
              (long long)s.rotary_dim, s.neox ? "NeoX" : "interleaved", int(s.paired),
              int(s.key_offset), fp32_factors ? "fp32" : "bf16", same ? "bit-exact" : "DIFFERENT");
}

}  // namespace

int main() {
  check_layout<128>();
  check_layout<96>();
  check_layout<64>();

  std::vector<Case> cases;
  cases.push_back({"D128 H6 plain bf16 factors, qk", make_shape(256, 6, 6, 128, 128), false, true});
  cases.push_back({"D128 H6 plain fp32 factors", make_shape(256, 6, 6, 128, 128), true, false});
  cases.push_back({"D128 H6 T=300 (ragged last tile)", make_shape(300, 6, 6, 128, 128), false, true});
  cases.push_back({"D64 H6 plain, qk", make_shape(200, 6, 6, 64, 128), false, true});
  cases.push_back({"D96 H6 plain, qk", make_shape(200, 6, 6, 96, 128), false, true});
  cases.push_back({"D96 H6 fp32 factors, T=129", make_shape(129, 6, 6, 96, 128), true, false});
  cases.push_back({"D96 GQA Hq=4 Hkv=2 Dv=64", make_shape(150, 4, 2, 96, 64), false, true});
  cases.push_back({"D64 H6 fp32 factors", make_shape(130, 6, 6, 64, 128), true, false});
  {
    QkvShape s = make_shape(300, 6, 6, 128, 128);
    s.key_offset = true;
    s.rotary_dim = 64;
    cases.push_back({"D128 key offset r=64", s, false, true});
    s.rotary_dim = 34;
    cases.push_back({"D128 key offset r=34 fp32", s, true, false});
    QkvShape s64 = make_shape(260, 6, 6, 64, 128);
    s64.key_offset = true;
    s64.rotary_dim = 32;
    cases.push_back({"D64 key offset r=32", s64, false, false});
    QkvShape s96 = make_shape(260, 6, 6, 96, 128);
    s96.key_offset = true;
    s96.rotary_dim = 48;
    cases.push_back({"D96 key offset r=48", s96, false, true});
    s96.rotary_dim = 44;
    cases.push_back({"D96 key offset r=44 fp32", s96, true, false});
  }
  {
    QkvShape s = make_shape(200, 6, 6, 128, 128);
    s.paired = true;
    cases.push_back({"D128 paired", s, false, true});
    QkvShape s64 = make_shape(140, 6, 6, 64, 128);
    s64.paired = true;
    cases.push_back({"D64 paired fp32", s64, true, false});
    QkvShape s96 = make_shape(140, 6, 6, 96, 128);
    s96.paired = true;
    cases.push_back({"D96 paired", s96, false, false});
  }
  cases.push_back({"D128 GQA Hq=8 Hkv=2 Dv=128", make_shape(200, 8, 2, 128, 128), false, true});
  cases.push_back({"D64 GQA Hq=6 Hkv=2 Dv=96", make_shape(150, 6, 2, 64, 96), false, true});
  cases.push_back({"D64 Hq=3 Hkv=1 (Q and K head in a tile)", make_shape(150, 3, 1, 64, 128), false, true});
  cases.push_back({"D128 Dv=64 (V tile of 2 heads)", make_shape(140, 4, 4, 128, 64), false, false});
  {
    QkvShape s = make_shape(180, 6, 6, 128, 128);
    s.neox = true;
    cases.push_back({"D128 NeoX", s, false, false});
    QkvShape s64 = make_shape(180, 6, 2, 64, 128);
    s64.neox = true;
    cases.push_back({"D64 NeoX GQA fp32", s64, true, true});
  }
  // Every case through the general epilogue (the library's kernel for every layout at D = 96 and
  // 64), and the simple layouts through the simple one too (the D = 128 hot path).
  uint32_t seed = 1;
  for (const Case& c : cases) {
    check_case<qc::EpilogueLayout::kGeneral>(c, seed);
    HostProblem p;
    make_problem(c, p, seed);
    if (qc::epilogue_layout(make_args(c, p)) == qc::EpilogueLayout::kSimple) {
      check_case<qc::EpilogueLayout::kSimple>(c, seed);
    }
    ++seed;
  }

  {
    QkvShape s = make_shape(70, 6, 6, 128, 128);
    check_reference_against_library(s, false, 100);
    check_reference_against_library(s, true, 101);
    s.paired = true;
    check_reference_against_library(s, false, 102);
    s.paired = false;
    s.key_offset = true;
    s.rotary_dim = 64;
    check_reference_against_library(s, false, 103);
    QkvShape s64 = make_shape(50, 4, 4, 64, 64);
    s64.key_offset = true;
    s64.rotary_dim = 32;
    check_reference_against_library(s64, true, 104);
    QkvShape s96 = make_shape(40, 6, 6, 96, 128);
    s96.paired = true;
    check_reference_against_library(s96, false, 105);
    s96.paired = false;
    s96.key_offset = true;
    s96.rotary_dim = 44;  // r splits a chunk
    check_reference_against_library(s96, true, 106);
    check_reference_against_library(make_shape(40, 8, 2, 128, 128), false, 107);  // GQA
    QkvShape neox = make_shape(40, 6, 6, 128, 128);
    neox.neox = true;
    check_reference_against_library(neox, false, 108);
    QkvShape neox64 = make_shape(40, 6, 2, 64, 128);
    neox64.neox = true;
    check_reference_against_library(neox64, true, 109);
  }

  if (g_failures) {
    std::printf("epilogue_host_test: %d FAILED checks\n", g_failures);
    return 1;
  }
  std::printf("epilogue_host_test: all checks passed\n");
  return 0;
}
