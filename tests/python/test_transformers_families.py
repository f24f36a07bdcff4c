"""apply_qkvfuse on the families of SPEC.md section 9 (docs/families.md): Gemma 4 (sliding and
global layers of widths 32 and 64, attention_k_eq_v, KV-shared layers), Qwen3-Next, Qwen3.5 and
Qwen3.5-MoE (gated query, partial rotary, 1 + w norms, linear-attention layers left alone),
GLM-4.x MoE (with and without use_qk_norm, partial rotary), OLMo 2 and OLMo 3 (token-wide norm,
sliding layers) and SmolLM3 (NoPE layers), each against the same model unpatched. Tiny models from
configs, random weights, nothing downloaded.

The bounds are those of test_transformers_integration.py, with one difference in float64: the
families' norms compute in float32 even for float64 inputs, so the reference is the unpatched model
with its q/k/v norms restated in float64 (exact_norms: the formula of each norm class, weight,
1 + w, or none): the patched model must equal it within 1e-6 relative (the layout's eps is a
float32, 1e-3 rounded: about 5e-8 relative in rstd, which the attention amplifies). Against the
plain unpatched model the patched one differs by that model's own float32 rounding (up to 7e-6
measured, Gemma 4's unscaled attention the most), which the bf16 bound covers.

Gemma 4's attention has no 1/sqrt(D) (scaling 1), so its logits react more to rounding in q and k:
the tests halve its q/k norm weights (a sharpness such a tiny random model would not train to), and
its FP8 bounds are GEMMA4_FP8's."""
import copy
import csv
import math
import subprocess
import sys
import types

import pytest
import torch

transformers = pytest.importorskip(
    "transformers",
    reason="Hugging Face transformers is not installed (pip install .[transformers])")

from conftest import CUDA_SECTION9, requires_cuda  # noqa: E402
from hf_models import (  # noqa: E402
    BF16,
    F64,
    FP8_TOLERANCE,
    VOCAB,
    assert_within_bf16,
    batch,
    cast,
    patched,
    rel,
    run,
)
from qkvfuse.integrations.transformers import (  # noqa: E402
    SUPPORTED,
    UnsupportedModelError,
    apply_qkvfuse,
    attention_states,
)
from test_transformers_compose import (  # noqa: E402
    LIGER,
    SETUPS,
    assert_attention_close,
    attention_calls,
    attention_run,
    compiled_run,
    dynamo_graphs,
    liger_patch,
    requires_liger,
    restored,
)
from test_transformers_integration import EXAMPLE  # noqa: E402

FAMILIES = ["gemma4", "qwen3_next", "qwen3_5", "qwen3_5_moe", "glm4_moe", "glm4_moe_no_norm",
            "olmo2", "olmo3", "smollm3"]
# Gemma 4's FP8 bounds, about 1.5x the worst measured over 6 seeds x 2 batches (logits 0.124, whole
# gradient 0.264 with cosine 0.966, worst parameter 0.356): its unscaled attention turns the e4m3
# error of q and k into more error of the attention weights than the other families' 1/sqrt(D).
GEMMA4_FP8 = dict(logits=0.2, gradient=0.4, cosine=0.95, parameter=0.5)
ZERO_CENTERED = {"Qwen3NextRMSNorm", "Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm"}


def make_config(family, **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-3,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    linear = dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                  linear_value_head_dim=16, layer_types=["full_attention", "linear_attention"])
    moe = dict(num_experts=4, num_experts_per_tok=4, moe_intermediate_size=32)
    if family == "gemma4":
        # Sliding (D = 32) and global (D = 64, one KV head, V = the key projection) layers; the
        # last two share the K and V of the first two (num_kv_shared_layers).
        common.update(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                      sliding_window=8, global_head_dim=64, num_global_key_value_heads=1,
                      attention_k_eq_v=True, num_kv_shared_layers=2, initializer_range=0.02,
                      hidden_size_per_layer_input=0, vocab_size_per_layer_input=VOCAB)
        config = transformers.Gemma4TextConfig
    elif family == "qwen3_next":
        common.update(linear, shared_expert_intermediate_size=32, **moe)
        config = transformers.Qwen3NextConfig
    elif family == "qwen3_5":
        common.update(linear)
        config = transformers.Qwen3_5TextConfig
    elif family == "qwen3_5_moe":
        common.update(linear, shared_expert_intermediate_size=32, **moe)
        config = transformers.Qwen3_5MoeTextConfig
    elif family in ("glm4_moe", "glm4_moe_no_norm"):
        common.update(use_qk_norm=family == "glm4_moe", n_routed_experts=4, num_experts_per_tok=4,
                      moe_intermediate_size=32, first_k_dense_replace=1)
        config = transformers.Glm4MoeConfig
    elif family == "olmo2":
        config = transformers.Olmo2Config
    elif family == "olmo3":
        common.update(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
        config = transformers.Olmo3Config
    elif family == "smollm3":
        # Layer 3 of 4 is NoPE (no_rope_layer_interval 4); layer 1 slides.
        common.update(num_hidden_layers=4)
        config = transformers.SmolLM3Config
    else:
        raise ValueError(family)
    common.update(overrides)
    return config(**common)


def build(family, dtype=F64, attn="sdpa", **overrides):
    config = make_config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn, dtype=F64, experts_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "linear_attn" not in name:  # the norm weights
                p.add_(0.3 * torch.randn_like(p))
            if family == "gemma4" and name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(0.5)  # see the module docstring
    return cast(model, dtype).train()


def assert_close_f64(mine, theirs, tolerance):
    """test_transformers_integration's float64 rule, but the linear-attention layers' own
    parameters (Qwen3-Next, Qwen3.5: their float32 delta rule, which the patched layer's
    gradient enters) within 2e-4: their gradients cancel (|g| about 1e-4) and carry the float32
    rounding of that code, not of qkvfuse's."""
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = mine, theirs
    assert rel(logits, ref_logits) <= tolerance, rel(logits, ref_logits)
    assert rel(loss, ref_loss) <= tolerance
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        bound = 2e-4 if "linear_attn" in name else tolerance
        assert rel(grads[name], ref_grads[name]) <= bound, (name, rel(grads[name],
                                                                      ref_grads[name]))


def _exact_norm(self, x):
    """A q/k/v norm of the families, restated in the input's precision."""
    eps = getattr(self, "variance_epsilon", None)
    eps = self.eps if eps is None else eps
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    weight = getattr(self, "weight", None)
    if weight is None:
        return n
    return n * (1 + weight) if type(self).__name__ in ZERO_CENTERED else n * weight


def exact_norms(model):
    """The model with every attention module's q_norm, k_norm and v_norm in float64."""
    for module in model.modules():
        if type(module).__name__.endswith("Attention"):
            for name in ("q_norm", "k_norm", "v_norm"):
                norm = getattr(module, name, None)
                if isinstance(norm, torch.nn.Module):
                    norm.forward = types.MethodType(_exact_norm, norm)
    return model


def per_tensor(name):
    """Whether a parameter's gradient is judged on its own, not only in the whole gradient: all
    but the linear-attention layers' (Qwen3-Next, Qwen3.5), which qkvfuse does not compute and
    whose per-head scalars (A_log, dt_bias) take gradients that cancel to 1e-4 of their terms, so
    that any rounding upstream, the unpatched bf16 model's too, moves them by percents."""
    return "linear_attn" not in name


def assert_within_bf16_families(mine, unpatched, exact):
    """assert_within_bf16 per tensor (but the linear-attention layers') and on the whole
    gradient."""
    keep = [n for n in exact[2] if per_tensor(n)]
    assert_within_bf16(*((a, b, {n: c[n] for n in keep}) for a, b, c in (mine, unpatched, exact)))
    flat = [torch.cat([g[2][n].flatten() for n in sorted(exact[2])])
            for g in (mine, unpatched, exact)]
    e_mine, e_unpatched = rel(flat[0], flat[2]), rel(flat[1], flat[2])
    assert e_mine <= 1.5 * e_unpatched + 2**-9, (e_mine, e_unpatched)


def assert_within_fp8(family, mine, exact):
    tol = dict(FP8_TOLERANCE, **(GEMMA4_FP8 if family == "gemma4" else {}))
    assert rel(mine[0], exact[0]) <= tol["logits"], rel(mine[0], exact[0])
    assert abs(mine[1] - exact[1]) <= tol["loss"] * abs(exact[1])
    for name in filter(per_tensor, exact[2]):
        assert rel(mine[2][name], exact[2][name]) <= tol["parameter"], (
            name, rel(mine[2][name], exact[2][name]))
    flat = [torch.cat([g[n].flatten() for n in sorted(exact[2])]) for g in (mine[2], exact[2])]
    assert rel(*flat) <= tol["gradient"], rel(*flat)
    assert torch.nn.functional.cosine_similarity(*flat, dim=0).item() >= tol["cosine"]


# ---- float64 ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_float64_equals_the_unpatched_math(family):
    model = build(family)
    ids, _ = batch("batch")
    mine = run(patched(model), ids)
    assert_close_f64(mine, run(exact_norms(copy.deepcopy(model)), ids), tolerance=1e-6)
    # And the plain unpatched model (float32 norms) within its own rounding.
    assert_close_f64(mine, run(model, ids), tolerance=3e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_float64_one_gemm_path(family):
    """T >= C (T = 4 x 24, C = 64): q and k from one GEMM against their concatenated rows (a
    gated query's query rows), v and the gate from GEMMs of their own (Gemma 4: V from the key
    rows, or no V on a KV-shared layer)."""
    model = build(family)
    ids, _ = batch("batch", batch_size=4)
    assert_close_f64(run(patched(model), ids), run(exact_norms(copy.deepcopy(model)), ids),
                     tolerance=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_float64_packed_sequences(family):
    """Packed documents (position ids restarting per document): equal to the unpatched math,
    and each document's logits equal those of the document alone."""
    model = build(family)
    ids, positions = batch("packed")
    mine = patched(model)
    assert_close_f64(run(mine, ids, positions),
                     run(exact_norms(copy.deepcopy(model)), ids, positions), tolerance=1e-6)
    if family.startswith(("qwen3_", )):
        return  # the linear-attention layers read the whole row: no per-document equality
    with torch.no_grad():
        packed_logits = mine(input_ids=ids, position_ids=positions, use_cache=False).logits
        start = 0
        for length in (20, 17, 11):
            alone = mine(input_ids=ids[:, start:start + length], use_cache=False).logits
            torch.testing.assert_close(packed_logits[:, start:start + length], alone,
                                       rtol=1e-6, atol=1e-6)
            start += length


@pytest.mark.parametrize("family", ["gemma4", "qwen3_next", "olmo3", "smollm3"])
def test_float64_eager_attention(family):
    model = build(family, attn="eager")
    ids, _ = batch("batch")
    assert_close_f64(run(patched(model), ids), run(exact_norms(copy.deepcopy(model)), ids),
                     tolerance=1e-6)


@pytest.mark.parametrize("family", ["gemma4", "qwen3_next", "olmo2"])
def test_float64_short_inputs_take_the_projection_path(family):
    """T < C: the projections called as modules (the gate split from q_proj's output; a
    KV-shared layer's query alone, a strided view) instead of one GEMM."""
    model = build(family, hidden_size=128)
    ids, _ = batch("batch", batch_size=1, seq=5)
    assert_close_f64(run(patched(model), ids), run(exact_norms(copy.deepcopy(model)), ids),
                     tolerance=1e-6)


def test_float64_gated_query_through_a_wrapped_projection():
    """q_proj replaced by another module (as PEFT's LoRA does): the gate comes from its output;
    fp8=True refuses it."""
    class Wrapped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.out_features = inner.out_features

        def forward(self, x):
            return self.inner(x) * 1.25

    model = build("qwen3_next")
    attention = model.model.layers[0].self_attn  # layer 1 is a linear-attention layer
    attention.q_proj = Wrapped(attention.q_proj)
    ids, _ = batch("batch")
    assert_close_f64(run(patched(model), ids), run(exact_norms(copy.deepcopy(model)), ids),
                     tolerance=1e-6)
    with pytest.raises(UnsupportedModelError,
                       match=r"plain torch.nn.Linear .*: q_proj is .*\.Wrapped\. Use fp8=False"):
        apply_qkvfuse(model, fp8=True)


def test_attention_states_of_each_layer_kind():
    """What the patch computes per Gemma 4 layer: q, k, v of the sliding and global layers (v
    normalized, the global layer's from the key projection), q alone on the KV-shared layers."""
    model = apply_qkvfuse(build("gemma4"))
    hidden = torch.randn(2, 6, 64, dtype=F64)
    positions = torch.arange(6)[None].expand(2, -1)
    for i, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        embeddings = model.model.rotary_emb(hidden, positions, attention.layer_type)
        q, k, v, gate = attention_states(attention, hidden, embeddings)
        assert gate is None and q.shape == (2, 4, 6, attention.head_dim)
        if attention.is_kv_shared_layer:
            assert k is None and v is None
            continue
        assert k.shape == v.shape
        # v is weightless-normalized per head row: its rows have mean square 1 / (1 + eps/ms).
        ms = v.pow(2).mean(-1)
        assert torch.all(ms < 1.0) and torch.all(ms > 0.9)


# ---- bf16 and FP8 -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["batch", "packed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_within_the_unpatched_models_rounding(family, kind):
    model = build(family)
    ids, positions = batch(kind)
    exact = run(model, ids, positions)
    unpatched = run(cast(copy.deepcopy(model), BF16), ids, positions)
    mine = run(patched(model, dtype=BF16), ids, positions)
    assert_within_bf16_families(mine, unpatched, exact)


@pytest.mark.parametrize("kind", ["batch", "packed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_within_stated_tolerance(family, kind):
    model = build(family)
    ids, positions = batch(kind)
    exact = run(model, ids, positions)
    fp8_model = patched(model, fp8=True, dtype=BF16)
    assert_within_fp8(family, run(fp8_model, ids, positions), exact)


@pytest.mark.parametrize("family", ["gemma4", "qwen3_next"])
def test_fp8_follows_optimizer_steps(family):
    """The e4m3 weight of a gated query (q_proj's query rows) and of k_eq_v (k_proj's rows
    twice), quantized in each call, follows the parameters: after steps, the same bits as a
    fresh patch."""
    model = apply_qkvfuse(build(family, dtype=BF16), fp8=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, _ = batch("batch")
    for step in range(2):
        run(model, ids)
        optimizer.step()
    with torch.no_grad():
        fresh = apply_qkvfuse(copy.deepcopy(model), fp8=True)
        assert torch.equal(model(input_ids=ids).logits, fresh(input_ids=ids).logits)


# ---- torch.compile ------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["gemma4", "qwen3_next", "olmo3", "smollm3"])
def test_compile_adds_no_graph_break(family):
    """The patched models (bf16 path and fp8=True: gated query, k_eq_v, V norm, KV-shared
    layers, token-wide norm, NoPE layers) trace into as many graphs, with as many breaks and the
    same reasons, as the unpatched model (one graph; Qwen3-Next's MoE routing breaks on its own
    nonzero), and the qkvfuse ops are in them."""
    dtype, autocast = SETUPS["autocast"]
    model = build(family, dtype=dtype)
    ids, _ = batch("batch")
    unpatched = dynamo_graphs(model, ids, autocast)
    assert "qkvfuse" not in unpatched[3]
    if family != "qwen3_next":
        assert unpatched[:2] == (1, 0)
    for fp8 in (False, True):
        mine = dynamo_graphs(apply_qkvfuse(copy.deepcopy(model), fp8=fp8), ids, autocast)
        assert mine[:3] == unpatched[:3], (fp8, mine[:3], unpatched[:3])
        assert "qkvfuse" in mine[3]


@pytest.mark.parametrize("family", ["gemma4", "olmo3"])
def test_compiled_training_step_aot_eager(family):
    """fullgraph=True forward and backward under autocast with float32 master weights: no graph
    break, no recompilation, and the compiled patched models within the eager bounds (bf16:
    against the compiled unpatched model's own error; FP8: against float64)."""
    model = build(family)
    ids, _ = batch("batch")
    exact = run(model, ids)
    unpatched, breaks = compiled_run(cast(copy.deepcopy(model), torch.float32), ids, "aot_eager")
    assert breaks == 0
    bf16, breaks = compiled_run(patched(model, dtype=torch.float32), ids, "aot_eager")
    assert breaks == 0
    assert_within_bf16_families(bf16, unpatched, exact)
    fp8, breaks = compiled_run(patched(model, fp8=True, dtype=torch.float32), ids, "aot_eager")
    assert breaks == 0
    assert_within_fp8(family, fp8, exact)


# ---- Liger-Kernel -------------------------------------------------------------------------------

def liger_model(family, reference, how):
    """test_transformers_compose.liger_model with this file's models."""
    if how == "class":
        liger_patch(family)()
        model = build(family, dtype=next(reference.parameters()).dtype)
        model.load_state_dict(reference.state_dict())
        return model
    model = copy.deepcopy(reference)
    liger_patch(family)(model=model)
    return model


@requires_liger
@pytest.mark.parametrize("family,how", [("qwen3_next", "class"), ("qwen3_next", "instance"),
                                        ("olmo3", "class"), ("gemma4", "instance")])
def test_liger_then_qkvfuse_equals_the_unpatched_family(family, how):
    """Liger-Kernel's q/k norms in the families it patches (Qwen3-Next's 1 + w, OLMo 3's
    token-wide [H * D] weights, Gemma 4's, whose weightless v_norm Liger leaves alone), then
    apply_qkvfuse: the patched attention modules equal the family's own math (float64 norms),
    outputs and every gradient. Liger's kernels are Triton: only the attention modules run, as
    in test_transformers_compose.py, each on its own (Gemma 4 without KV-shared layers, which
    would read the K and V another layer's call stored)."""
    reference = build(family, **({"num_kv_shared_layers": 0} if family == "gemma4" else {}))
    ids, _ = batch("batch")
    calls = attention_calls(reference, ids)
    want = attention_run(exact_norms(copy.deepcopy(reference)), calls)
    with restored(family):
        model = apply_qkvfuse(liger_model(family, reference, how))
        q_norm = model.model.layers[0].self_attn.q_norm
        assert isinstance(q_norm, LIGER.LigerRMSNorm) or (
            q_norm.__dict__["forward"].__func__ is LIGER.LigerRMSNorm.forward)
        assert_attention_close(attention_run(model, calls), want, tolerance=1e-6)


@requires_liger
def test_liger_gemma4_norm_class_is_refused_by_name():
    """Liger's class patch of Gemma 4 swaps in LigerRMSNormForGemma4, whose own forward qkvfuse
    does not read (its instance patch, above, is taken)."""
    with restored("gemma4"):
        liger_patch("gemma4")()
        model = build("gemma4")
        with pytest.raises(UnsupportedModelError, match="q_norm is .*LigerRMSNormForGemma4"):
            apply_qkvfuse(model)


# ---- generate, save and load --------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_generate_float64_same_tokens(family):
    """Greedy generation with the KV cache (Gemma 4's shared layers read the stored K and V):
    the same tokens as the unpatched model."""
    model = build(family).eval()
    ids = torch.randint(3, VOCAB, (2, 7))
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    want = exact_norms(copy.deepcopy(model)).generate(ids, **kwargs)
    got = apply_qkvfuse(model).generate(ids, **kwargs)
    assert torch.equal(got, want)


def test_gemma4_kv_shared_layers_on_the_kept_positions_float64():
    """transformers 5.25 runs Gemma 4's KV-shared layers on the last logits_to_keep positions only
    (generate's prefill: their K and V come from the earlier layers, with every position): the same
    logits as the unpatched model; on earlier versions those layers see every position."""
    model = build("gemma4").eval()
    ids = torch.randint(3, VOCAB, (2, 9))
    shared = model.model.layers[-1].self_attn
    assert shared.is_kv_shared_layer
    seen = []
    shared.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        (kwargs.get("hidden_states", args[0] if args else None)).shape[1]), with_kwargs=True)
    with torch.no_grad():
        want = exact_norms(copy.deepcopy(model))(ids, logits_to_keep=1, use_cache=True).logits
        got = apply_qkvfuse(model)(ids, logits_to_keep=1, use_cache=True).logits
    sliced = hasattr(model.model, "_maybe_slice_kv_shared_inputs")
    assert seen == [1 if sliced else 9] * 2  # the copy has the hook too
    assert got.shape == (2, 1, VOCAB)
    assert rel(got, want) <= 1e-6, rel(got, want)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("family", ["gemma4", "qwen3_next", "olmo3"])
def test_save_load_round_trip(tmp_path, family, fp8):
    model = build(family, dtype=BF16)
    reference = copy.deepcopy(model)
    apply_qkvfuse(model, fp8=fp8)
    ids, positions = batch("packed")
    before = run(model, ids, positions)
    assert model.state_dict().keys() == reference.state_dict().keys()
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=BF16, experts_implementation="eager")
    for name, tensor in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    after = run(apply_qkvfuse(loaded.train(), fp8=fp8), ids, positions)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


# ---- what is supported and refused --------------------------------------------------------------

def test_supported_lists_every_family():
    for cls in ("Gemma4TextAttention", "Qwen3NextAttention", "Qwen3_5Attention",
                "Qwen3_5MoeAttention", "Glm4MoeAttention", "Olmo2Attention", "Olmo3Attention",
                "SmolLM3Attention"):
        assert any(cls in entry for entry in SUPPORTED), cls


def eps_attribute(norm):
    """The attribute a family norm's forward reads its eps from: transformers 5.25 renamed Gemma
    4's `eps` to `variance_epsilon`, the other families' name."""
    return "variance_epsilon" if hasattr(norm, "variance_epsilon") else "eps"


def test_different_eps_of_q_and_v_norms_is_refused():
    model = build("gemma4")
    norm = model.model.layers[0].self_attn.v_norm
    setattr(norm, eps_attribute(norm), 1e-5)
    with pytest.raises(UnsupportedModelError, match="different eps"):
        apply_qkvfuse(model)


@pytest.mark.parametrize("name", ["q_norm", "k_norm", "v_norm"])
def test_a_norm_with_two_different_eps_is_refused(name):
    """A norm holding both eps and variance_epsilon, with different values: which one its forward
    reads is not known, so qkvfuse takes neither."""
    model = build("gemma4")
    norm = getattr(model.model.layers[0].self_attn, name)
    read = eps_attribute(norm)
    other = "eps" if read == "variance_epsilon" else "variance_epsilon"
    setattr(norm, other, 1e-5)
    with pytest.raises(UnsupportedModelError,
                       match=f"layers.0.self_attn .*: {name} has both variance_epsilon"):
        apply_qkvfuse(model)
    setattr(norm, other, getattr(norm, read))  # the same value: no doubt
    apply_qkvfuse(model)


def test_fp8_refuses_the_gated_families_bias():
    model = build("qwen3_next", attention_bias=True)
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        apply_qkvfuse(model, fp8=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.bias"):
                p.normal_()
    for size in (2, 4):  # the projections called as modules (T < C), the GEMMs (T >= C)
        ids, _ = batch("batch", batch_size=size)
        assert_close_f64(run(patched(model), ids), run(exact_norms(copy.deepcopy(model)), ids),
                         tolerance=1e-6)


# ---- CUDA ---------------------------------------------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("family", ["qwen3_next", "glm4_moe", "smollm3", "gemma4", "olmo3"])
def test_cuda(family, fp8):
    """On the GPU: the families whose layouts the CUDA kernels take without the switch (section
    8's options: Qwen3-Next's gated query and partial rotary, GLM's partial rotary, SmolLM3 in
    bf16, whose NoPE layers then need no op) within the CPU tests' bounds; the others refused at
    their first forward with an error naming the pending option (SPEC.md section 9), or, with
    QKVFUSE_CUDA_SECTION9=1, run on its untested kernels within the same bounds."""
    model = build(family)
    ids, positions = batch("packed")
    exact = run(model, ids, positions)

    def on_cuda(m):
        logits, loss, grads = run(m.cuda(), ids.cuda(), positions.cuda())
        return logits.cpu(), loss.cpu(), {name: g.cpu() for name, g in grads.items()}

    pending = not CUDA_SECTION9 and (family in ("gemma4", "olmo3") or
                                     (family == "smollm3" and fp8))
    mine = patched(model, fp8=fp8, dtype=BF16)
    if pending:
        with pytest.raises(RuntimeError, match="not yet on the CUDA backend"):
            on_cuda(mine)
        return
    if fp8:
        assert_within_fp8(family, on_cuda(mine), exact)
    else:
        assert_within_bf16_families(on_cuda(mine), on_cuda(cast(copy.deepcopy(model), BF16)),
                                    exact)


# ---- the example ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["gemma4", "qwen3-next", "olmo3"])
def test_train_hf_example_runs_each_family(tmp_path, family):
    """examples/train_hf.py --family: a few CPU steps of the three variants, from the same weights
    and batches (their first losses agree to bf16 / FP8 error)."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--device", "cpu", "--tiny", "--steps", "2", "--family",
         family, "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with (tmp_path / "loss.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["variant"] for r in rows} == {"unpatched-bf16", "qkvfuse-bf16", "qkvfuse-fp8"}
    for r in rows:
        assert math.isfinite(float(r["train_loss"])) and math.isfinite(float(r["val_loss"]))
    first = {r["variant"]: float(r["train_loss"]) for r in rows if r["step"] == "0"}
    assert max(first.values()) - min(first.values()) <= 0.02 * first["unpatched-bf16"]
