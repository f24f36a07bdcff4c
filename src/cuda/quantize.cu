// quantize.cu: bf16 -> e4m3 in row-major and transposed layouts from one read of the source
// (SPEC.md section 5), the CUDA backend of quantize_dual_layout and quantize_weight_bank.
//
// Math, per batch entry b (a plain [M, N] source is B = 1):
//   row[b][m][n] = e4m3(src[b][m][n] / scale[b])     (true fp32 division, then RNE + satfinite)
//   t[b][n][m]   = row[b][m][n]
//   amax[b]      = max |src[b]|                       (NaN if any element of the entry is NaN)
// The codes are those of __fdiv_rn (IEEE round-to-nearest whatever the compile flags), so the
// result matches the CPU backend's `src / scale` bit for bit: the fast path divides with
// E4m3Scaler (device_math.cuh: three FMAs, a clamp and a sign copy per element, no branch), the
// generic path with __fdiv_rn itself; the cast is the hardware
// cvt.rn.satfinite.e4m3x2.f32 (float2_to_e4m3x2), which the numeric tests pin to the CPU
// conversion.
//
// Design: memory bound (2 bytes read, 2 bytes written per element), so one pass and full-width
// accesses. A block of 64 threads owns a 64 x 64 tile of one entry:
//   phase 1  8 coalesced 16-byte loads per thread (a warp instruction reads 4 whole 128-byte
//            rows), scale + convert, amax in registers, 8 e4m3 bytes per load to shared memory;
//   phase 2  from the 4 KB shared tile: t rows as 16-byte stores (each thread gathers a 16 x 4
//            byte block with 16 conflict-free 32-bit reads and transposes it 4 x 4 bytes at a
//            time with byte permutes), and row rows as 16-byte stores.
// Small blocks keep many tiles in flight per SM (the 9216 tiles of x [49152, 768] leave a short
// tail) and make the one __syncthreads cheap. Shared-memory banks: rows are 64 bytes (16 words),
// so two rows share the 32 banks; at each step of phase 2 a warp reads the same 8 words from
// each of 4 rows 16 apart, rows of one parity, which would all land in the same 8 banks. The
// tile is stored with row r's parity flipped when bit 4 of r is set and its word index XOR 8 when
// bit 5 is set: those four rows then fill four distinct 8-bank groups. Both swizzles keep 8- and
// 16-byte chunks whole, so phase 1's 8-byte and phase 2's 16-byte accesses stay single
// transactions and conflict-free (index math checked by simulation: no conflicts, exact
// transpose).
//
// The fast path needs M % 16 == 0 (16-byte t stores), N % 16 == 0 (16-byte row stores), a
// 16-byte aligned source with row and batch strides multiples of 8 elements. Anything else takes
// a simple 32 x 32 tile kernel with element-wise accesses: correct for any M, N >= 1, slower.
//
// amax: each block reduces max |x| over its tile as the fp32 bit pattern (for non-negative
// floats the unsigned order is the numeric order, +inf = 0x7f800000 is above every finite value
// and every NaN pattern is above +inf), canonicalizes a NaN to 0x7fffffff and merges it with
// atomicMax into the output, which is zeroed first on the stream. A max is exact and
// order-independent, so the result is deterministic.
//
// ---- the weight bank: two launches, no memset, no finalize, no scratch ---------------------------
// scale[b] = amax[b] / 448 (1 when amax[b] is 0; NaN / inf propagate through the division, as the
// CPU backend's) must exist before any element of entry b is quantized, so every element is read
// twice:
//   1. bank_scale_kernel: one thread-block cluster of kBankClusterSize CTAs per entry. Each CTA
//      reduces its share of the entry (16-byte loads, 8 in flight per thread, L2 evict_last); the
//      cluster combines the CTAs' maxima through distributed shared memory and rank 0 writes
//      scale[b] itself. Clusters are co-scheduled by the hardware, so the cluster barrier is safe
//      by construction: no atomics, no zero-initialised buffer (hence no memset), no separate
//      finalize, no workspace and no state shared between calls (any number of concurrent calls
//      and CUDA-graph replays are independent). Each CTA executes griddepcontrol.launch_dependents
//      once its loads have returned.
//   2. the quantize pass (quantize_tile_kernel<false, true>, or the generic kernel), entries in
//      reverse order, loads evict_first, launched with programmatic stream serialization: its CTAs
//      start as soon as every amax CTA has triggered, issue their tile loads, and only then execute
//      griddepcontrol.wait before reading scale[b] (the source is read-only, so loading it early is
//      safe; the scale is read after the amax kernel has completed and flushed).
// Why two launches: faster than the four-launch memset / amax / finalize / quantize pipeline, and
// the single cooperative kernels that kept the re-read in L2 lost more to cross-CTA signalling
// than they gained (measurements and what limits this structure: docs/perf_notes.md).
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend.hpp"
#include "cuda/check.hpp"
#include "cuda/device_math.cuh"
#include "qkvfuse/numeric.hpp"

namespace qkvfuse::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kTile = 64;          // fast path: 64 x 64 elements per block
constexpr int kTileThreads = 64;   // 2 warps
// 16 blocks (1024 threads, 128 KB of loads in flight) per SM: caps registers at 64 per thread.
constexpr int kTileMinBlocksPerSm = 16;
constexpr int kSlowTile = 32;      // generic path: 32 x 32 elements, 32 x 8 threads
constexpr int kSlowRowsPerPass = 8;
// Weight bank: the amax kernel's clusters (one per entry; 8 CTAs is the portable cluster size).
constexpr int kBankClusterSize = 8;
constexpr int kBankThreads = 1024;
constexpr int kBankUnroll = 8;  // 16-byte loads in flight per thread: 128 KB per CTA

static_assert(kTile * kTile / 8 == 8 * kTileThreads, "phase 1: 8 loads of 8 elements per thread");
static_assert((kTile / 4) * (kTile / 16) == kTileThreads,
              "phase 2: one 4 (n) x 16 (m) block of t per thread");

/// Arguments of the quantize kernels. Element strides; outputs are contiguous.
struct QuantizeArgs {
  const uint16_t* src;        // bf16 [B, M, N], last dim contiguous
  int64_t src_batch_stride;   // elements between entries
  int64_t src_row_stride;     // elements between rows
  const float* scale;         // scale of entry b at scale[b * scale_stride]
  int64_t scale_stride;       // 0: one scale for every entry
  uint8_t* row;               // e4m3 [B, M, N] contiguous
  uint8_t* t;                 // e4m3 [B, N, M] contiguous
  unsigned int* amax_bits;    // [B] fp32 bit patterns merged by atomicMax, or null
  int64_t m, n;
  int64_t tiles_n;            // tiles along N (blockIdx.x = tile_m * tiles_n + tile_n)
  int batch;                  // B
};

// ---- L2 cache policies (sm_80+: createpolicy + ld.global.L2::cache_hint) -----------------------

__device__ __forceinline__ uint64_t l2_evict_last_policy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

/// A 16-byte global load with an L2 eviction policy. Not volatile: the source is read-only for
/// the kernel's lifetime, so the compiler may schedule it like any load.
__device__ __forceinline__ Vec16 load16_with_policy(const void* pointer, uint64_t policy) {
  Vec16 v;
  asm("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
      : "l"(pointer), "l"(policy));
  return v;
}

/// |x| as its fp32 bit pattern: non-negative, so unsigned order = numeric order (NaN on top).
__device__ __forceinline__ unsigned int abs_bits(float x) {
  return __float_as_uint(x) & 0x7fffffffu;
}

/// |bf16| as the fp32 bit pattern of its value (a bf16 is the high half of an fp32).
__device__ __forceinline__ unsigned int bf16_abs_bits(uint32_t bf16) {
  return (bf16 << 16) & 0x7fffffffu;
}

/// One NaN pattern for the merged result, whatever NaN payloads the data held.
__device__ __forceinline__ unsigned int canonical_nan(unsigned int bits) {
  return bits > 0x7f800000u ? 0x7fffffffu : bits;
}

/// The weight bank's scale from its entry's amax bits: what the CPU backend computes.
__device__ __forceinline__ float bank_scale(unsigned int amax_bits) {
  const float amax = __uint_as_float(amax_bits);
  return amax == 0.0f ? 1.0f : __fdiv_rn(amax, E4M3::kMax);
}

/// Programmatic dependent launch (sm_90): griddepcontrol.wait returns once the preceding kernel
/// of the stream has completed and its memory is visible (at once when the launch was a plain
/// one); launch_dependents lets the next kernel, launched with programmatic stream serialization,
/// start before this one ends, once every CTA has executed it or exited.
__device__ __forceinline__ void wait_for_preceding_grid() {
  asm volatile("griddepcontrol.wait;" : : : "memory");
}
__device__ __forceinline__ void allow_dependent_grid() {
  asm volatile("griddepcontrol.launch_dependents;" : : : "memory");
}

/// Max over the block (blockDim.x multiple of 32, at most 1024 threads) into amax_bits[b];
/// all threads must call it. `scratch` holds at least blockDim.x / 32 words.
__device__ __forceinline__ void block_amax_merge(unsigned int local, unsigned int* scratch,
                                                 unsigned int* target) {
  const unsigned int warp_max = __reduce_max_sync(0xffffffffu, local);
  const int warp = threadIdx.x / 32 + threadIdx.y * (blockDim.x / 32);
  const int warps = (blockDim.x * blockDim.y) / 32;
  if ((threadIdx.x & 31) == 0) scratch[warp] = warp_max;
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0) {
    unsigned int block_max = 0;
    for (int w = 0; w < warps; ++w) block_max = max(block_max, scratch[w]);
    // Zero cannot raise the (zero-initialized) result: skip the atomic.
    if (block_max != 0) atomicMax(target, canonical_nan(block_max));
  }
}

// ---- fast path: 64 x 64 tiles, 16-byte accesses -------------------------------------------

/// Word index of (row r, 32-bit word w) in the swizzled 64 x 16-word shared tile.
__device__ __forceinline__ int tile_word(int r, int w) {
  const int physical_row = r ^ ((r >> 4) & 1);
  return physical_row * (kTile / 4) + (w ^ (((r >> 5) & 1) * 8));
}

/// Transposes a 4 x 4 block of bytes: in[i] holds bytes (c0..c3) of row i; out[j] gets bytes
/// (r0..r3) of column j, row 0 in the low byte.
__device__ __forceinline__ void transpose_4x4_bytes(const uint32_t (&in)[4], uint32_t (&out)[4]) {
  // __byte_perm(x, y, s): result byte k = byte s_k of the 8-byte value {y:x} (x = bytes 0-3).
  const uint32_t lo01 = __byte_perm(in[0], in[1], 0x5140);  // r0c0 r1c0 r0c1 r1c1
  const uint32_t hi01 = __byte_perm(in[0], in[1], 0x7362);  // r0c2 r1c2 r0c3 r1c3
  const uint32_t lo23 = __byte_perm(in[2], in[3], 0x5140);
  const uint32_t hi23 = __byte_perm(in[2], in[3], 0x7362);
  out[0] = __byte_perm(lo01, lo23, 0x5410);  // r0c0 r1c0 r2c0 r3c0
  out[1] = __byte_perm(lo01, lo23, 0x7632);
  out[2] = __byte_perm(hi01, hi23, 0x5410);
  out[3] = __byte_perm(hi01, hi23, 0x7632);
}

/// kLastUse: the weight bank's quantize pass: the source loaded with an evict_first L2 policy
/// (its last use), and the scale read only once the amax kernel before it has completed (the
/// pass is launched with programmatic stream serialization: see quantize_weight_bank).
template <bool kAmax, bool kLastUse>
__global__ void __launch_bounds__(kTileThreads, kTileMinBlocksPerSm)
    quantize_tile_kernel(const QuantizeArgs args) {
  __shared__ __align__(16) uint32_t tile[kTile * kTile / 4];
  __shared__ unsigned int warp_max[kTileThreads / 32];

  // Entries in reverse: after the weight bank's amax pass the last entries are the ones in L2.
  const int b = args.batch - 1 - int(blockIdx.y);
  // 32-bit: the launcher keeps the tile count below 2^31.
  const unsigned int tiles_n = unsigned(args.tiles_n);
  const int64_t m0 = int64_t(blockIdx.x / tiles_n) * kTile;
  const int64_t n0 = int64_t(blockIdx.x % tiles_n) * kTile;
  const int tid = threadIdx.x;
  const uint16_t* src = args.src + b * args.src_batch_stride;
  // The scale as early as possible, except in the weight bank's pass (see kLastUse).
  E4m3Scaler scale{kLastUse ? 1.0f : args.scale[b * args.scale_stride]};

  // ---- phase 1: load, quantize, stage in shared memory ----
  // Load j covers tile rows 8j..8j+7: thread tid reads row 8j + tid/8, columns 8*(tid%8)..+7.
  Vec16 loaded[8];
  uint64_t policy = 0;
  if constexpr (kLastUse) policy = l2_evict_first_policy();
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int r = (j * kTileThreads + tid) >> 3;
    const int c = ((j * kTileThreads + tid) & 7) * 8;
    const int64_t gm = m0 + r, gn = n0 + c;
    // N % 16 == 0: an 8-column chunk is wholly inside or wholly outside.
    if (gm < args.m && gn < args.n) {
      const uint16_t* pointer = src + gm * args.src_row_stride + gn;
      if constexpr (kLastUse) {
        loaded[j] = load16_with_policy(pointer, policy);
      } else {
        loaded[j] = *reinterpret_cast<const Vec16*>(pointer);
      }
    } else {
      loaded[j] = Vec16{{0u, 0u, 0u, 0u}};  // zeros: no effect on amax, never stored
    }
  }
  if constexpr (kLastUse) {
    wait_for_preceding_grid();  // the loads are in flight
    scale = E4m3Scaler{args.scale[b * args.scale_stride]};
  }
  unsigned int local_max = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int r = (j * kTileThreads + tid) >> 3;
    const int c = ((j * kTileThreads + tid) & 7) * 8;
    float x[8];
    bf16x8_to_float(loaded[j], x);
    if constexpr (kAmax) {
#pragma unroll
      for (int e = 0; e < 8; ++e) local_max = max(local_max, abs_bits(x[e]));
    }
    uint2 packed;
    scale(x, packed.x, packed.y);
    *reinterpret_cast<uint2*>(&tile[tile_word(r, c / 4)]) = packed;
  }
  if constexpr (kAmax) {
    block_amax_merge(local_max, warp_max, args.amax_bits + b);  // includes the __syncthreads
  } else {
    __syncthreads();
  }

  // ---- phase 2a: t[n][m], 4 t rows x 16 bytes per thread ----
  // Thread (q = tid/4, mc = tid%4): columns n0+4q..+3, rows m0+16mc..+15. Per store instruction a
  // warp writes 8 t rows x 64 contiguous bytes.
  {
    const int q = tid >> 2, mc = tid & 3;
    uint32_t words[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) words[i] = tile[tile_word(16 * mc + i, q)];
    uint32_t columns[4][4];  // [group of 4 rows][column j]
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const uint32_t block[4] = {words[4 * g], words[4 * g + 1], words[4 * g + 2],
                                 words[4 * g + 3]};
      transpose_4x4_bytes(block, columns[g]);
    }
    const int64_t gm = m0 + 16 * mc;
    uint8_t* t = args.t + int64_t(b) * args.m * args.n;
    if (gm < args.m) {  // M % 16 == 0: the 16 rows are wholly inside or outside
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t gn = n0 + 4 * q + j;
        if (gn < args.n) {
          *reinterpret_cast<Vec16*>(t + gn * args.m + gm) =
              Vec16{{columns[0][j], columns[1][j], columns[2][j], columns[3][j]}};
        }
      }
    }
  }

  // ---- phase 2b: row[m][n], 16 bytes per store ----
  {
    uint8_t* row = args.row + int64_t(b) * args.m * args.n;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int f = j * kTileThreads + tid;
      const int r = f >> 2, chunk = f & 3;
      const int64_t gm = m0 + r, gn = n0 + 16 * chunk;
      if (gm < args.m && gn < args.n) {
        const Vec16 v = *reinterpret_cast<const Vec16*>(&tile[tile_word(r, 4 * chunk)]);
        *reinterpret_cast<Vec16*>(row + gm * args.n + gn) = v;
      }
    }
  }
}

// ---- generic path: any M, N, element-wise ---------------------------------------------------

/// kLastUse: the weight bank's quantize pass (the scale read after the amax kernel completes).
template <bool kAmax, bool kLastUse>
__global__ void __launch_bounds__(kSlowTile * kSlowRowsPerPass)
    quantize_generic_kernel(const QuantizeArgs args) {
  __shared__ uint8_t tile[kSlowTile][kSlowTile + 1];
  __shared__ unsigned int warp_max[kSlowTile * kSlowRowsPerPass / 32];

  const int b = args.batch - 1 - int(blockIdx.y);
  const unsigned int tiles_n = unsigned(args.tiles_n);
  const int64_t m0 = int64_t(blockIdx.x / tiles_n) * kSlowTile;
  const int64_t n0 = int64_t(blockIdx.x % tiles_n) * kSlowTile;
  const uint16_t* src = args.src + b * args.src_batch_stride;
  uint8_t* row = args.row + int64_t(b) * args.m * args.n;
  uint8_t* t = args.t + int64_t(b) * args.m * args.n;
  if constexpr (kLastUse) wait_for_preceding_grid();
  const float scale = args.scale[b * args.scale_stride];
  const int tx = threadIdx.x, ty = threadIdx.y;

  unsigned int local_max = 0;
  for (int i = ty; i < kSlowTile; i += kSlowRowsPerPass) {
    const int64_t gm = m0 + i, gn = n0 + tx;
    if (gm < args.m && gn < args.n) {
      const float x = bf16_to_float(src[gm * args.src_row_stride + gn]);
      if constexpr (kAmax) local_max = max(local_max, abs_bits(x));
      const uint8_t q = uint8_t(float2_to_e4m3x2(__fdiv_rn(x, scale), 0.0f) & 0xffu);
      row[gm * args.n + gn] = q;
      tile[i][tx] = q;
    }
  }
  if constexpr (kAmax) {
    block_amax_merge(local_max, warp_max, args.amax_bits + b);
  } else {
    __syncthreads();
  }
  for (int i = ty; i < kSlowTile; i += kSlowRowsPerPass) {
    const int64_t gn = n0 + i, gm = m0 + tx;
    if (gn < args.n && gm < args.m) t[gn * args.m + gm] = tile[tx][i];
  }
}

// ---- weight bank: the amax kernel, one cluster per entry ---------------------------------------

/// scale[b] = bank_scale(max |src[b]|), by the cluster of kBankClusterSize CTAs of entry b
/// (blockIdx.x / kBankClusterSize): each CTA reduces every kBankClusterSize-th span of
/// kBankThreads units (16-byte chunks, or elements when !kVector) of the entry, and the cluster
/// combines the CTAs' maxima through distributed shared memory. kVector needs N % 8 == 0, a
/// 16-byte aligned source and row/batch strides multiples of 8 elements.
template <bool kVector>
__global__ void __cluster_dims__(kBankClusterSize, 1, 1) __launch_bounds__(kBankThreads, 1)
    bank_scale_kernel(const QuantizeArgs args, float* scale_out) {
  __shared__ unsigned int warp_max[kBankThreads / 32];
  __shared__ unsigned int cta_max;
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int b = int(blockIdx.x) / kBankClusterSize;
  const uint16_t* src = args.src + b * args.src_batch_stride;

  // This thread's units: first, first + S, first + 2S, ... (S = threads of the cluster), as
  // (row r, unit c of the row), advanced without a division per unit.
  const int64_t per_row = kVector ? args.n / 8 : args.n;
  const int64_t stride = int64_t(kBankClusterSize) * kBankThreads;
  const int64_t stride_rows = stride / per_row, stride_units = stride % per_row;
  const int64_t first = int64_t(rank) * kBankThreads + threadIdx.x;
  int64_t r = first / per_row, c = first % per_row;
  const auto advance = [&] {
    c += stride_units;
    r += stride_rows;
    if (c >= per_row) {
      c -= per_row;
      ++r;
    }
  };
  unsigned int local_max = 0;
  if constexpr (kVector) {
    // Keep the lines in L2 for the quantize pass that follows (see the header).
    const uint64_t policy = l2_evict_last_policy();
    while (r < args.m) {
      Vec16 v[kBankUnroll];
#pragma unroll
      for (int u = 0; u < kBankUnroll; ++u) {
        v[u] = r < args.m ? load16_with_policy(src + r * args.src_row_stride + 8 * c, policy)
                          : Vec16{{0u, 0u, 0u, 0u}};
        advance();
      }
#pragma unroll
      for (int u = 0; u < kBankUnroll; ++u) {
#pragma unroll
        for (int w = 0; w < 4; ++w) {  // two bf16 per word
          local_max = max(local_max, bf16_abs_bits(v[u].w[w]));
          local_max = max(local_max, v[u].w[w] & 0x7fff0000u);
        }
      }
    }
  } else {
    while (r < args.m) {
      uint32_t v[kBankUnroll];
#pragma unroll
      for (int u = 0; u < kBankUnroll; ++u) {
        v[u] = r < args.m ? uint32_t(src[r * args.src_row_stride + c]) : 0u;
        advance();
      }
#pragma unroll
      for (int u = 0; u < kBankUnroll; ++u) local_max = max(local_max, bf16_abs_bits(v[u]));
    }
  }
  // This thread's loads have returned: the quantize pass may start launching (its loads then
  // find the source in L2). Only a scheduling hint: the pass reads scale[] after
  // griddepcontrol.wait, i.e. after this kernel has completed.
  allow_dependent_grid();

  local_max = __reduce_max_sync(0xffffffffu, local_max);
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = local_max;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned int block_max = 0;
    for (int w = 0; w < kBankThreads / 32; ++w) block_max = max(block_max, warp_max[w]);
    cta_max = block_max;
  }
  cluster.sync();  // every CTA's cta_max is written (release/acquire at cluster scope)
  if (rank == 0 && threadIdx.x == 0) {
    unsigned int entry_max = 0;
    for (int i = 0; i < kBankClusterSize; ++i) {
      entry_max = max(entry_max, *cluster.map_shared_rank(&cta_max, i));
    }
    scale_out[b] = bank_scale(canonical_nan(entry_max));
  }
  cluster.sync();  // the other CTAs' shared memory stays alive until rank 0 has read it
}

// ---- host side --------------------------------------------------------------------------------

/// Views of one call normalized to a batch of B entries.
QuantizeArgs make_args(const TensorView& src, const TensorView& scale, const TensorView& row,
                       const TensorView& t) {
  QKVF_CHECK(src.ndim == 2 || src.ndim == 3, "quantize: src must be [M, N] or [B, M, N], got ",
             src.describe());
  QKVF_CHECK(src.dtype == DType::kBFloat16 && row.dtype == DType::kFloat8E4M3 &&
                 t.dtype == DType::kFloat8E4M3 && scale.dtype == DType::kFloat32,
             "quantize: expected bf16 src, e4m3 row and t, float32 scale");
  const bool batched = src.ndim == 3;
  QuantizeArgs args{};
  args.batch = batched ? int(src.size(0)) : 1;
  QKVF_CHECK(!batched || src.size(0) <= 65535, "quantize: at most 65535 batch entries, got ",
             src.size(0));
  args.m = src.size(src.ndim - 2);
  args.n = src.size(src.ndim - 1);
  QKVF_CHECK(args.n <= 1 || src.stride(src.ndim - 1) == 1,
             "quantize: src's last dim must be contiguous, got ", src.describe());
  QKVF_CHECK(row.is_contiguous() && t.is_contiguous(), "quantize: row and t must be contiguous");
  QKVF_CHECK(row.numel() == src.numel() && t.numel() == src.numel(),
             "quantize: row/t sizes do not match src");
  args.src = static_cast<const uint16_t*>(src.data);
  args.src_row_stride = src.stride(src.ndim - 2);
  args.src_batch_stride = batched ? src.stride(0) : 0;
  args.scale = static_cast<const float*>(scale.data);
  args.scale_stride = batched ? (scale.ndim == 1 ? scale.stride(0) : 0) : 0;
  args.row = static_cast<uint8_t*>(row.data);
  args.t = static_cast<uint8_t*>(t.data);
  return args;
}

bool fast_path_ok(const QuantizeArgs& args) {
  const auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return args.m % 16 == 0 && args.n % 16 == 0 && aligned16(args.src) && aligned16(args.row) &&
         aligned16(args.t) && (args.m <= 1 || args.src_row_stride % 8 == 0) &&
         (args.batch <= 1 || args.src_batch_stride % 8 == 0);
}

/// Launches the quantize pass (amax merged into args.amax_bits when it is set). `last_use`: the
/// weight bank's pass (kLastUse), launched with programmatic stream serialization so that it
/// starts while the amax kernel before it finishes.
void launch_quantize(QuantizeArgs args, cudaStream_t stream, bool last_use) {
  if (args.batch == 0 || args.m == 0 || args.n == 0) return;
  const bool amax = args.amax_bits != nullptr;
  const bool fast = fast_path_ok(args);
  const int tile = fast ? kTile : kSlowTile;
  args.tiles_n = (args.n + tile - 1) / tile;
  const int64_t tiles = args.tiles_n * ((args.m + tile - 1) / tile);
  QKVF_CHECK(tiles <= 0x7fffffff, "quantize: ", tiles, " tiles exceed the grid");
  const dim3 grid(unsigned(tiles), unsigned(args.batch));
  const dim3 block = fast ? dim3(kTileThreads) : dim3(kSlowTile, kSlowRowsPerPass);
  if (last_use) {
    QKVF_CHECK(!amax, "quantize: the weight bank's pass merges no amax");
    cudaLaunchAttribute attribute{};
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = block;
    config.stream = stream;
    config.attrs = &attribute;
    config.numAttrs = 1;
    const cudaError_t status =
        fast ? cudaLaunchKernelEx(&config, quantize_tile_kernel<false, true>, args)
             : cudaLaunchKernelEx(&config, quantize_generic_kernel<false, true>, args);
    if (status != cudaSuccess) cudaGetLastError();  // not left for a later launch check to find
    QKVF_CHECK(status == cudaSuccess, "launch of the weight bank's quantize pass failed: ",
               cudaGetErrorName(status), ": ", cudaGetErrorString(status));
    QKVF_CUDA_CHECK_LAUNCH("the weight bank's quantize pass");
  } else if (fast) {
    if (amax) {
      quantize_tile_kernel<true, false><<<grid, block, 0, stream>>>(args);
    } else {
      quantize_tile_kernel<false, false><<<grid, block, 0, stream>>>(args);
    }
    QKVF_CUDA_CHECK_LAUNCH("quantize_tile_kernel");
  } else {
    if (amax) {
      quantize_generic_kernel<true, false><<<grid, block, 0, stream>>>(args);
    } else {
      quantize_generic_kernel<false, false><<<grid, block, 0, stream>>>(args);
    }
    QKVF_CUDA_CHECK_LAUNCH("quantize_generic_kernel");
  }
}

}  // namespace

void quantize_dual_layout(const QuantizeDualParams& params) {
  QuantizeArgs args = make_args(params.src, params.scale, params.row, params.t);
  DeviceGuard guard(params.src.device);
  const cudaStream_t stream = to_cuda(params.stream);
  if (!is_absent(params.amax)) {
    const TensorView& amax = params.amax;
    QKVF_CHECK(amax.dtype == DType::kFloat32 && amax.numel() == args.batch && amax.ndim <= 1 &&
                   (amax.ndim == 0 || amax.size(0) <= 1 || amax.stride(0) == 1),
               "quantize_dual_layout: amax must be float32 with one contiguous element per "
               "entry, got ", amax.describe());
    // atomicMax merges into it: start from +0 (below every |x| pattern).
    QKVF_CUDA_CHECK(cudaMemsetAsync(params.amax.data, 0, sizeof(float) * size_t(args.batch),
                                    stream));
    args.amax_bits = static_cast<unsigned int*>(params.amax.data);
  }
  launch_quantize(args, stream, /*last_use=*/false);
}

void quantize_weight_bank(const QuantizeWeightBankParams& params) {
  QKVF_CHECK(params.src.ndim == 3, "quantize_weight_bank: src must be [B, M, N], got ",
             params.src.describe());
  QuantizeArgs args = make_args(params.src, params.scale, params.row, params.t);
  QKVF_CHECK(params.scale.ndim == 1 && params.scale.size(0) == args.batch &&
                 (args.batch <= 1 || params.scale.stride(0) == 1),
             "quantize_weight_bank: scale must be a contiguous float32 [B], got ",
             params.scale.describe());
  DeviceGuard guard(params.src.device);
  const cudaStream_t stream = to_cuda(params.stream);
  // An empty src never gets here (the public entry point returns first); guard all the same.
  if (args.batch == 0 || args.m == 0 || args.n == 0) return;
  float* scale = static_cast<float*>(params.scale.data);

  // 1. scale[b] = amax / 448 (1 when amax is 0), one cluster per entry: no memset, no finalize.
  const bool vector = args.n % 8 == 0 && reinterpret_cast<uintptr_t>(args.src) % 16 == 0 &&
                      (args.m <= 1 || args.src_row_stride % 8 == 0) &&
                      (args.batch <= 1 || args.src_batch_stride % 8 == 0);
  const dim3 grid(unsigned(args.batch) * kBankClusterSize);  // a multiple of the cluster size
  if (vector) {
    bank_scale_kernel<true><<<grid, kBankThreads, 0, stream>>>(args, scale);
  } else {
    bank_scale_kernel<false><<<grid, kBankThreads, 0, stream>>>(args, scale);
  }
  QKVF_CUDA_CHECK_LAUNCH("bank_scale_kernel");
  // 2. the quantize pass with the fresh scales (read after griddepcontrol.wait).
  args.scale = scale;
  args.scale_stride = 1;
  args.amax_bits = nullptr;
  launch_quantize(args, stream, /*last_use=*/true);
}

}  // namespace qkvfuse::cuda
