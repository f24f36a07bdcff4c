"""Inputs of the general rope layouts (SPEC.md section 8), shared by the layout, FP8-backward,
packed-op, compile and CUDA-graph tests: each case names the options of one model family or edge,
and make() builds qk and the keyword arguments every rope function takes."""
import torch

BF16, F32 = torch.bfloat16, torch.float32

# Each case: tokens, heads (Hq), kv (Hkv), dim (D) and the options. "angles": "cache" (a random
# cos/sin cache read at random positions; rotary_dim, when given, is also the cache's width) or
# "tables" (random factor tables: the op reads them, whatever their values). "weights": which norm
# weights, of "weight_dtype". Random angle values test the indexing harder than real cos/sin would.
CASES = {
    # Qwen3 (dense and MoE): GQA, NeoX, RMS-norm times a weight, eps 1e-6, cos/sin cache.
    "qwen3_gqa": dict(tokens=13, heads=4, kv=2, dim=32, rotary_style="neox", angles="cache",
                      weights="qk", weight_dtype=F32, eps=1e-6),
    # Gemma 3: (1 + w) bf16 weights, MQA.
    "gemma3_mqa": dict(tokens=9, heads=2, kv=1, dim=16, rotary_style="neox", angles="cache",
                       weights="qk", weight_dtype=BF16, weight_offset=1.0, eps=1e-6),
    # GLM-4-style partial interleaved rotary, int32 positions, bf16 cache.
    "partial_interleaved_mqa": dict(tokens=11, heads=3, kv=1, dim=16, rotary_dim=8,
                                    angles="cache", cache_dtype=BF16, position_dtype=torch.int32),
    # Llama-style: no QK norm, rotary only.
    "rotary_only": dict(tokens=7, heads=2, kv=2, dim=8, rotary_style="neox", angles="cache",
                        normalize=False),
    # NeoX on factor tables, partial, a query weight only.
    "neox_tables_q_weight": dict(tokens=10, heads=2, kv=2, dim=16, rotary_dim=12,
                                 rotary_style="neox", angles="tables", weights="q",
                                 weight_dtype=F32),
    # Interleaved tables under GQA, a key weight only (bf16 tables).
    "gqa_tables_k_weight": dict(tokens=6, heads=4, kv=2, dim=8, angles="tables", weights="k",
                                weight_dtype=BF16, table_dtype=BF16),
    # The speedrun's layouts with weights and the other options.
    "paired_weights": dict(tokens=5, heads=4, kv=4, dim=8, paired=True, angles="tables",
                           weights="qk", weight_dtype=F32),
    "paired_neox_partial": dict(tokens=5, heads=2, kv=2, dim=8, rotary_dim=4, paired=True,
                                rotary_style="neox", angles="tables"),
    "key_offset_weights": dict(tokens=9, heads=2, kv=2, dim=16, rotary_dim=8, key_offset=True,
                               angles="tables", weights="qk", weight_dtype=F32,
                               weight_offset=1.0),
    "key_offset_neox_cache": dict(tokens=8, heads=3, kv=3, dim=16, rotary_dim=8,
                                  key_offset=True, rotary_style="neox", angles="cache"),
    # Edges: D = 2; no rotary lanes at all.
    "narrow_gqa": dict(tokens=4, heads=2, kv=1, dim=2, angles="cache", weights="qk",
                       weight_dtype=F32),
    "no_rotary_lanes": dict(tokens=4, heads=2, kv=1, dim=8, rotary_dim=0, angles="tables",
                            weights="k", weight_dtype=F32),
}

# A few cases that cover every option at once, for the slower tests (compile, opcheck).
MAIN_CASES = ["qwen3_gqa", "gemma3_mqa", "partial_interleaved_mqa", "rotary_only",
              "paired_weights", "key_offset_weights"]


def make(case, device, qk_dtype=BF16, tokens=None, requires_grad=False, pad=8):
    """(qk, kwargs): qk [T, Hq + Hkv, D] as a column slice of a wider buffer (a GEMM output's Q/K
    columns, `pad` more per row: 8 keeps bf16 rows 16-byte aligned, for CUDA's vector kernels; an
    odd pad leaves them 2-byte aligned) and the keyword arguments of qkvfuse.qk_norm_rope for the
    case (tensors on `device`; float64 tables and weights when qk is float64, as a gradient check
    needs)."""
    c = dict(CASES[case]) if isinstance(case, str) else dict(case)
    tokens = c["tokens"] if tokens is None else tokens
    heads, kv, dim = c["heads"], c["kv"], c["dim"]
    wide64 = qk_dtype == torch.float64
    wide = torch.randn(tokens, (heads + kv) * dim + pad, device=device).to(qk_dtype)
    qk = wide[:, : (heads + kv) * dim].view(tokens, heads + kv, dim)
    if requires_grad:
        qk = qk.detach().requires_grad_()
    kwargs = dict(num_heads=heads, num_kv_heads=kv, rotary_dim=c.get("rotary_dim"),
                  rotary_style=c.get("rotary_style", "interleaved"),
                  normalize=c.get("normalize", True), paired=c.get("paired", False),
                  key_offset=c.get("key_offset", False))
    if "eps" in c:
        kwargs["eps"] = c["eps"]
    if "weight_offset" in c:
        kwargs["weight_offset"] = c["weight_offset"]
    if c["angles"] == "cache":
        width = dim if c.get("rotary_dim") is None else c["rotary_dim"]
        positions = 3 + tokens
        dtype = torch.float64 if wide64 else c.get("cache_dtype", F32)
        kwargs["cos_sin"] = torch.randn(positions, width, device=device).to(dtype)
        kwargs["positions"] = torch.randint(0, positions, (tokens,), device=device,
                                            dtype=c.get("position_dtype", torch.int64))
    else:
        width = 2 * dim if c.get("paired") else dim
        dtype = torch.float64 if wide64 else c.get("table_dtype", F32)
        kwargs["factor1"] = torch.randn(tokens, width, device=device).to(dtype)
        kwargs["factor2"] = torch.randn(tokens, width, device=device).to(dtype)
    for kind in c.get("weights", ""):
        dtype = torch.float64 if wide64 else c["weight_dtype"]
        # Around 1 (or around 0 for Gemma's 1 + w), so the weights matter but keep the scale.
        center = 0.0 if c.get("weight_offset") else 1.0
        weight = (center + 0.5 * torch.randn(dim, device=device)).to(dtype)
        kwargs[f"{kind}_weight"] = weight.requires_grad_() if requires_grad else weight
    return qk, kwargs


def weights_of(kwargs):
    """The norm weights given in kwargs, by name."""
    return {name: kwargs[name] for name in ("q_weight", "k_weight") if kwargs.get(name) is not None}
