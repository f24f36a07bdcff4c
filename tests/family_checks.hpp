// family_checks.hpp: the checks of SPEC.md section 9's options (head width up to 512, the V
// norm, the token-wide norm, query-only calls, calls without angles) against the float64 model
// of reference.hpp, shared by the CPU backend's tests (test_cpu_families.cpp) and the CUDA
// backend's (test_cuda_families.cpp): the same cases and the same tolerances, the ops run by a
// FamilyRunner on host tensors (the CPU) or on device copies of them (CUDA).
//
// Tolerances are those of test_cpu_rope_layouts.cpp: bf16 outputs within one ulp of the rounded
// model, further only within 2^-18 of the row's largest value or of the backward's term scale
// (grown with the square root of the values one RMS sums past 256); float32 outputs within the
// same noise, float64 within 1e-12 of it; weight gradients within the bound of a float32 sum of
// the model's terms. FP8: every code within one e4m3 step of the model's (or its row noise), and
// exactly the e4m3 of the same backend's bf16 backward (Q/K rows and, with the V norm, V rows).
// Every output is poisoned first, strided inputs and gradients have poisoned padding that must
// stay untouched, and every backward runs twice with the same bits.
#pragma once

#include <cstdint>
#include <functional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "qkvfuse/qk_norm_rope.hpp"
#include "qkvfuse/qkv_backward_fp8.hpp"
#include "reference.hpp"

namespace qkvfuse::test::families {

/// How the checks run the ops: each function runs its op on params whose tensors are host views
/// and leaves the outputs in the host tensors they view (the CPU backend directly; the CUDA one on
/// device copies, written back).
struct FamilyRunner {
  std::function<void(const QkNormRopeParams&)> forward;
  std::function<void(const QkNormRopeBackwardParams&)> backward;
  std::function<void(const QkvBackwardFp8Params&)> fp8;
};

/// Forward, backward (twice: the same bits) and, for bf16 qk, the FP8 backward (Dv = 3, or the V
/// norm's Dv) of one call, against the model.
void check_all(RopeData& data, std::mt19937_64& rng, const FamilyRunner& runner);
void check_forward(RopeData& data, const FamilyRunner& runner);
void check_backward(RopeData& data, std::mt19937_64& rng, const FamilyRunner& runner);

/// The sweep: every option alone and with the others and with section 8's, at odd sizes
/// (T = 1, 3, 17; D = 2, 6, 34, 130, 258, 512; Dv = 1, 3, 64).
struct FamilyParam {
  std::string name;
  ref::Rope rope;
  RopeSpec spec;
};
void PrintTo(const FamilyParam& param, std::ostream* out);
std::vector<FamilyParam> family_params();

// The families' real shapes, each at `tokens` tokens (0: the CPU tests' few).
/// Gemma 4: sliding (32/16 x 256) and global (32/4 x 512) layers with the V norm, KV-shared
/// layers (query-only).
void gemma4_layers(std::mt19937_64& rng, const FamilyRunner& runner, int64_t tokens);
/// Gemma 4's attention_k_eq_v: v is qk's own key rows; the same bits as a copy of them.
void gemma4_key_equals_value(std::mt19937_64& rng, const FamilyRunner& runner, int64_t tokens);
/// Qwen3-Next / Qwen3.5: 16/2 x 256, r = 64, (1 + w); the gated query read in place (query-only,
/// head stride 2D; the gate lanes untouched).
void qwen3_next(std::mt19937_64& rng, const FamilyRunner& runner, int64_t tokens);
/// OLMo 3 7B (32/32 x 128) and OLMo 2 1B (16/16 x 128): the token-wide norm.
void olmo_token_norm(std::mt19937_64& rng, const FamilyRunner& runner, int64_t tokens);
/// GLM-4.5 (96/8 x 128, r = 64, with and without the QK norm) and SmolLM3's NoPE layers.
void glm45_and_smollm3(std::mt19937_64& rng, const FamilyRunner& runner, int64_t tokens);
/// No angles and no norm: q and k are qk's rows exactly.
void no_angles_is_the_identity(std::mt19937_64& rng, const FamilyRunner& runner);
/// T = 0 with token-norm weights and with the V norm: zero weight gradients.
void empty_calls(std::mt19937_64& rng, const FamilyRunner& runner);

}  // namespace qkvfuse::test::families
