// test_rope_paths.cpp: which access width the CUDA rope kernels use for a call
// (src/cuda/rope_paths.hpp; which configuration: test_rope_dispatch.cpp). Host code only, so it
// runs everywhere: the views carry made-up device addresses and are never read. The GPU tests
// check every width's results; this pins the choice.
#include <gtest/gtest.h>

#include <cstdint>

#include "cuda/rope_paths.hpp"
#include "qkvfuse/tensor.hpp"

namespace qkvfuse::test {
namespace {

const Device kGpu{DeviceType::kCUDA, 0};
constexpr uintptr_t kBase = uintptr_t(1) << 32;  // 256-byte aligned, like a fresh allocation

void* at(uintptr_t byte_offset) { return reinterpret_cast<void*>(kBase + byte_offset); }

/// The model's layer: qk the Q/K columns of the packed [T, qkv_dim] GEMM output, the tables
/// [T, D] bf16 (or a cos/sin cache [P, r]), the outputs and gradients contiguous, each at its own
/// aligned address.
struct Call {
  int64_t tokens = 64, heads = 6, kv_heads = 6, dim = 128, v_dim = 128;
  int64_t qk_offset = 0;       ///< bytes added to qk's pointer
  int64_t qk_row_pad = 0;      ///< elements added to qk's token stride
  int64_t grad_row_offset = 0;
  int64_t grad_t_offset = 0;
  DType factor_dtype = DType::kBFloat16;
  int64_t factor_row_pad = 0;
  bool cache = false;          ///< a cos/sin cache [64, rotary] instead of the tables
  int64_t rotary = -1;
  RotaryStyle style = RotaryStyle::kInterleaved;
  int64_t weight_offset = 0;   ///< bytes added to q_weight's pointer (-1: no weight)

  int64_t qkv_dim() const { return (heads + kv_heads) * dim + kv_heads * v_dim; }
  TensorView qk() const {
    return make_view(at(uintptr_t(qk_offset)), DType::kBFloat16, kGpu,
                     {tokens, heads + kv_heads, dim}, {qkv_dim() + qk_row_pad, dim, 1});
  }
  RopeLayout layout() const {
    RopeLayout l;
    l.num_heads = heads;
    l.num_kv_heads = kv_heads;
    l.rotary_dim = rotary;
    l.rotary_style = style;
    if (cache) {
      const int64_t r = rotary < 0 ? dim : rotary;
      l.cos_sin = make_view(at(uintptr_t(1) << 28), factor_dtype, kGpu, {64, r},
                            {r + factor_row_pad, 1});
      l.positions = make_view(at(uintptr_t(2) << 28), DType::kInt64, kGpu, {tokens});
    } else {
      for (int which = 0; which < 2; ++which) {
        (which ? l.factor2 : l.factor1) =
            make_view(at(uintptr_t(1 + which) << 28), factor_dtype, kGpu, {tokens, dim},
                      {dim + factor_row_pad, 1});
      }
    }
    if (weight_offset >= 0) {
      l.q_weight = make_view(at((uintptr_t(12) << 28) + uintptr_t(weight_offset)),
                             DType::kBFloat16, kGpu, {dim});
    }
    return l;
  }
  TensorView rows(int which, int64_t n) const {  // q, k, grad_q, grad_k
    return make_view(at(uintptr_t(3 + which) << 28), DType::kBFloat16, kGpu, {tokens, n, dim});
  }
  QkNormRopeParams forward() const {
    return {.qk = qk(), .q = rows(0, heads), .k = rows(1, kv_heads), .layout = layout()};
  }
  QkNormRopeBackwardParams backward() const {
    QkNormRopeBackwardParams p;
    p.grad_q = rows(2, heads);
    p.grad_k = rows(3, kv_heads);
    p.qk = qk();
    p.grad_qk = make_view(at(uintptr_t(7) << 28), DType::kBFloat16, kGpu,
                          {tokens, heads + kv_heads, dim});
    p.layout = layout();
    return p;
  }
  QkvBackwardFp8Params fp8() const {
    QkvBackwardFp8Params p;
    p.grad_q = rows(2, heads);
    p.grad_k = rows(3, kv_heads);
    p.grad_v = make_view(at(uintptr_t(8) << 28), DType::kBFloat16, kGpu, {tokens, kv_heads, v_dim});
    p.qk = qk();
    p.grad_scale = make_view(at(uintptr_t(9) << 28), DType::kFloat32, kGpu, {});
    p.grad_row = make_view(at((uintptr_t(10) << 28) + uintptr_t(grad_row_offset)),
                           DType::kFloat8E4M3, kGpu, {tokens, qkv_dim()});
    p.grad_t = make_view(at((uintptr_t(11) << 28) + uintptr_t(grad_t_offset)), DType::kFloat8E4M3,
                         kGpu, {qkv_dim(), tokens});
    p.layout = layout();
    return p;
  }
};

using cuda::rope::chunk_width;

/// The width every op takes, or -1 when they differ.
int widths(const Call& c) {
  const int forward = chunk_width(c.forward());
  const int backward = chunk_width(c.backward());
  const int fp8 = chunk_width(c.fp8());
  return forward == backward && backward == fp8 ? forward : -1;
}

TEST(RopePaths, ModelShapesTakeSixteenByteChunks) {
  // SPEC.md section 9's widths up to 512 (Gemma 4's global layers) too.
  for (const int64_t dim : {32, 64, 96, 128, 256, 264, 384, 512}) {
    Call c;
    c.dim = dim;
    EXPECT_EQ(widths(c), 8) << "D = " << dim;
  }
  Call fp32;
  fp32.factor_dtype = DType::kFloat32;
  EXPECT_EQ(widths(fp32), 8);
  Call odd_tokens;  // grad_t rows of 17 bytes: the kernel stores them byte by byte
  odd_tokens.tokens = 17;
  EXPECT_EQ(widths(odd_tokens), 8);
  Call qwen;  // Qwen3-8B: GQA, NeoX, a cache, a weight
  qwen.heads = 32;
  qwen.kv_heads = 8;
  qwen.cache = true;
  qwen.style = RotaryStyle::kNeox;
  EXPECT_EQ(widths(qwen), 8);
  Call glm = qwen;  // partial NeoX rotary, r a multiple of 16
  glm.rotary = 64;
  EXPECT_EQ(widths(glm), 8);
}

TEST(RopePaths, WidthsOffTheVectorGeometriesTakePairs) {
  for (const int64_t dim : {2, 8, 24, 34, 100, 254, 258, 510}) {
    Call c;
    c.dim = dim;
    EXPECT_EQ(widths(c), 2) << "D = " << dim;
  }
}

TEST(RopePaths, RotaryWidthsWhosePartnersOrFrequenciesSplitVectorsTakePairs) {
  Call neox;  // NeoX partners d +- 20: not a whole 8-element chunk apart
  neox.style = RotaryStyle::kNeox;
  neox.rotary = 40;
  EXPECT_EQ(widths(neox), 2);
  Call interleaved_tables = neox;  // interleaved partners sit in the chunk: any even r
  interleaved_tables.style = RotaryStyle::kInterleaved;
  interleaved_tables.rotary = 42;
  EXPECT_EQ(widths(interleaved_tables), 8);
  Call interleaved_cache = interleaved_tables;  // the chunk's 4 frequencies: r a multiple of 8
  interleaved_cache.cache = true;
  interleaved_cache.rotary = 44;
  EXPECT_EQ(widths(interleaved_cache), 2);
  interleaved_cache.rotary = 48;
  EXPECT_EQ(widths(interleaved_cache), 8);
}

TEST(RopePaths, MisalignedRowsTakeNarrowerChunks) {
  Call pointer;  // one bf16 element off a 16-byte boundary: single elements
  pointer.qk_offset = 2;
  EXPECT_EQ(widths(pointer), 1);
  Call pair;  // two elements off: pairs
  pair.qk_offset = 4;
  EXPECT_EQ(widths(pair), 2);
  Call stride;  // token stride 16-byte aligned no more (odd elements: single elements)
  stride.qk_row_pad = 3;
  EXPECT_EQ(widths(stride), 1);
  Call factors;  // fp32 table rows of 130 elements: 520 bytes
  factors.factor_dtype = DType::kFloat32;
  factors.factor_row_pad = 2;
  EXPECT_EQ(widths(factors), 2);
  Call cache;  // cache rows of 130 bf16 elements: 260 bytes
  cache.cache = true;
  cache.factor_row_pad = 2;
  EXPECT_EQ(widths(cache), 2);
  Call weight;  // a weight 8 bytes off a 16-byte boundary
  weight.weight_offset = 8;
  EXPECT_EQ(widths(weight), 2);
  Call one_token;  // a size-1 dim's stride is never used: it does not count
  one_token.tokens = 1;
  one_token.qk_row_pad = 3;
  EXPECT_EQ(widths(one_token), 8);
}

TEST(RopePaths, Fp8BackwardAlsoNeedsAlignedOutputs) {
  for (const int64_t v_dim : {1, 7, 130}) {
    Call c;
    c.v_dim = v_dim;
    c.qk_row_pad = (8 - c.qkv_dim() % 8) % 8;  // keep qk's rows 16-byte aligned
    EXPECT_EQ(chunk_width(c.forward()), 8) << "Dv = " << v_dim;
    // Dv not a multiple of 8: the tile's V part does not start on whole 8-byte words.
    EXPECT_EQ(chunk_width(c.fp8()), 2) << "Dv = " << v_dim;
  }
  for (const int64_t v_dim : {8, 64, 256, 264, 512}) {
    Call c;
    c.v_dim = v_dim;
    EXPECT_EQ(chunk_width(c.fp8()), 8) << "Dv = " << v_dim;
    EXPECT_TRUE(cuda::rope::fp8_v_vectors(c.fp8(), 8)) << "Dv = " << v_dim;
  }
  Call row;
  row.grad_row_offset = 8;
  EXPECT_EQ(chunk_width(row.fp8()), 2);
  Call transposed;
  transposed.grad_t_offset = 1;
  EXPECT_EQ(chunk_width(transposed.fp8()), 2);
  Call v_width;  // Dv = 12: pairs, and grad_v's rows read element by element
  v_width.v_dim = 12;
  v_width.qk_row_pad = (8 - v_width.qkv_dim() % 8) % 8;
  EXPECT_FALSE(cuda::rope::fp8_v_vectors(v_width.fp8(), chunk_width(v_width.fp8())));
}

TEST(RopePaths, TheVNormsRowsTakeTheChunksOfTheQkRows) {
  // SPEC.md section 9's V norm: v (and v_out, grad_v_out, grad_v) take the kernel's chunks, so
  // Dv must be a multiple of the chunk and their rows aligned for it.
  const auto with_v = [](const Call& c, int64_t v_dim, uintptr_t v_offset) {
    QkNormRopeParams f = c.forward();
    f.layout.normalize_v = true;
    f.v = make_view(at((uintptr_t(13) << 28) + v_offset), DType::kBFloat16, kGpu,
                    {c.tokens, c.kv_heads, v_dim});
    f.v_out = make_view(at(uintptr_t(14) << 28), DType::kBFloat16, kGpu,
                        {c.tokens, c.kv_heads, v_dim});
    return f;
  };
  const Call c;
  EXPECT_EQ(chunk_width(with_v(c, 128, 0)), 8);
  EXPECT_EQ(chunk_width(with_v(c, 512, 0)), 8);
  EXPECT_EQ(chunk_width(with_v(c, 12, 0)), 2) << "Dv not a multiple of 8";
  EXPECT_EQ(chunk_width(with_v(c, 13, 0)), 1) << "Dv odd";
  EXPECT_EQ(chunk_width(with_v(c, 128, 4)), 2) << "v 4-byte aligned only";
  EXPECT_EQ(chunk_width(with_v(c, 128, 2)), 1) << "v 2-byte aligned only";
  // The FP8 backward: grad_v and v take the Q/K rows' chunks under the V norm.
  QkvBackwardFp8Params p = c.fp8();
  p.layout.normalize_v = true;
  p.v = make_view(at(uintptr_t(13) << 28), DType::kBFloat16, kGpu, {c.tokens, c.kv_heads, 128});
  EXPECT_EQ(chunk_width(p), 8);
  p.grad_v.data = at((uintptr_t(8) << 28) + 4);
  EXPECT_EQ(chunk_width(p), 2) << "grad_v 4-byte aligned only";
}

}  // namespace
}  // namespace qkvfuse::test
