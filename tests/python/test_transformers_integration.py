"""qkvfuse.integrations.transformers: Hugging Face models patched with apply_qkvfuse against the
same models unpatched (issue 21), in float64, bf16 and FP8 (the bounds: hf_models.py). The
compositions with other libraries and with torch.compile are in test_transformers_compose.py."""
import copy
import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import qkvfuse

transformers = pytest.importorskip(
    "transformers",
    reason="Hugging Face transformers is not installed (pip install .[transformers])")

from conftest import requires_cuda  # noqa: E402
from hf_models import (  # noqa: E402
    BF16,
    F64,
    FAMILIES,
    VOCAB,
    assert_close_f64,
    assert_within_bf16,
    assert_within_fp8,
    batch,
    build,
    cast,
    make_config,
    patched,
    run,
)
from qkvfuse.integrations.transformers import (  # noqa: E402
    UnsupportedModelError,
    apply_qkvfuse,
    attention_input,
    remove_qkvfuse,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_hf.py"


# ---- float64: the patch computes the library's own math ------------------------------------------

@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_float64_equals_unpatched(family, attn):
    model = build(family, attn=attn)
    ids, _ = batch("batch")
    assert_close_f64(run(patched(model), ids), run(model, ids))


@pytest.mark.parametrize("family", FAMILIES)
def test_float64_packed_sequences(family):
    """Packed documents (position_ids restarting, no attention mask and no KV cache: HF's mask
    then keeps them apart): equal to the unpatched model, and each document's logits equal those
    of the document alone, so the positions reach the rotary."""
    model = build(family)
    ids, positions = batch("packed")
    mine = patched(model)
    assert_close_f64(run(mine, ids, positions), run(model, ids, positions))
    with torch.no_grad():
        packed_logits = mine(input_ids=ids, position_ids=positions, use_cache=False).logits
        start = 0
        for length in (20, 17, 11):
            alone = mine(input_ids=ids[:, start:start + length], use_cache=False).logits
            torch.testing.assert_close(packed_logits[:, start:start + length], alone,
                                       rtol=1e-6, atol=1e-9)
            start += length


@pytest.mark.parametrize("family,kv_heads", [("qwen3", 4), ("qwen3", 1), ("gemma3", 1),
                                             ("llama", 4), ("llama", 1)])
def test_float64_mha_and_mqa(family, kv_heads):
    model = build(family, num_key_value_heads=kv_heads)
    ids, _ = batch("batch")
    assert_close_f64(run(patched(model), ids), run(model, ids))


def test_float64_moe_top2_routing():
    model = build("qwen3_moe", num_experts_per_tok=2)
    ids, _ = batch("batch")
    assert_close_f64(run(patched(model), ids), run(model, ids))


@pytest.mark.parametrize("family,rope", [
    ("qwen3", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
    # Dynamic NTK recomputes inv_freq once the positions pass max_position_embeddings (32 < 48).
    ("qwen3", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
    # YaRN scales cos and sin by its attention factor (1.14 here).
    ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
               "rope_theta": 1e4}),
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
               "rope_theta": 5e5}),
    ("mistral", {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}),
])
def test_float64_rope_scaling(family, rope):
    model = build(family, rope_parameters=rope, max_position_embeddings=32)
    ids, _ = batch("batch", seq=48)
    assert_close_f64(run(patched(model), ids), run(model, ids))


@pytest.mark.parametrize("family", FAMILIES)
def test_float64_one_gemm_path(family):
    """T >= C (T = 4 x 24, C = 64): q and k from one GEMM against their concatenated weight rows,
    v from a GEMM of its own; the same values as the unpatched model."""
    model = build(family)
    ids, _ = batch("batch", batch_size=4)
    assert_close_f64(run(patched(model), ids), run(model, ids))


class OpLog(TorchDispatchMode):
    """Records (op name, args) of every op below autograd and autocast."""

    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func._schema.name, args))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("setup", ["autocast", "bf16"])
def test_one_gemm_path_scatters_no_gradient(setup):
    """The one-GEMM path hands qk_norm_rope the whole output of the q/k GEMM and gives v a GEMM
    of its own: the backward sums the two GEMMs' input gradients over [T, C], and neither
    scatters a gradient into a zero-filled copy of a wider output (slice_backward) nor
    concatenates gradients. v reaches the attention as the unpatched model's does ([B, S, Hkv, D]
    storage). Float32 master weights under autocast (T < C: the cast copies the weights anyway)
    and a bf16 model (T >= C)."""
    dtype, autocast, seq = (torch.float32, True, 24) if setup == "autocast" else (BF16, False, 48)
    model = patched(build("qwen3"), dtype=dtype)
    attention = model.model.layers[0].self_attn
    x = torch.randn(2, seq, 64, dtype=dtype, requires_grad=True)
    cos, sin = model.model.rotary_emb(x, torch.arange(seq)[None])
    calls = []
    with OpLog(calls), torch.autocast("cpu", dtype=BF16, enabled=autocast):
        q, k, v = attention_input(attention, x, (cos, sin))
    forward = len(calls)
    with OpLog(calls):
        torch.autograd.backward((q, k, v), [torch.randn_like(t) for t in (q, k, v)])
    backward = [name for name, _ in calls[forward:]]
    qk = next(args[0] for name, args in calls if name == "qkvfuse::qk_norm_rope")
    assert qk.is_contiguous() and qk.shape == (2 * seq, 6, 32)
    assert v.transpose(1, 2).is_contiguous()
    scatters = {"aten::slice_backward", "aten::cat", "aten::zeros", "aten::zero_", "aten::fill_"}
    assert not scatters & set(backward), backward
    assert backward.count("aten::mm") == 4, backward  # dgrad and wgrad of two GEMMs
    assert x.grad.dtype == dtype and all(
        p.grad.dtype == dtype for p in (attention.q_proj.weight, attention.v_proj.weight))


def test_float64_short_inputs_take_the_projection_path():
    """T < C: three projections and a cat of q and k (instead of one GEMM on the concatenated
    weight); the same values either way."""
    model = build("qwen3", hidden_size=128)
    ids, _ = batch("batch", batch_size=1, seq=5)
    assert_close_f64(run(patched(model), ids), run(model, ids))


def test_projections_that_are_not_plain_linear():
    """q_proj replaced by another module (as PEFT's LoRA does): the bf16 path calls it as a
    module; fp8=True refuses it."""
    class Wrapped(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.out_features = inner.out_features

        def forward(self, x):
            return self.inner(x) * 1.25

    model = build("qwen3")
    for layer in model.model.layers:
        layer.self_attn.q_proj = Wrapped(layer.self_attn.q_proj)
    ids, _ = batch("batch")
    assert_close_f64(run(patched(model), ids), run(model, ids))
    with pytest.raises(UnsupportedModelError,
                       match=r"plain torch.nn.Linear .*: q_proj is .*\.Wrapped\. Use fp8=False"):
        apply_qkvfuse(model, fp8=True)


@pytest.mark.parametrize("size", [2, 4])
def test_attention_bias_bf16_path(size):
    """Qwen3 with attention_bias=True: the biases of the projections called as modules (T < C)
    and of the q/k and v GEMMs (T >= C)."""
    model = build("qwen3", attention_bias=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.bias"):
                p.normal_()
    ids, _ = batch("batch", batch_size=size)
    assert_close_f64(run(patched(model), ids), run(model, ids))
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        apply_qkvfuse(model, fp8=True)


# ---- bf16 and FP8 ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["batch", "packed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_within_the_unpatched_models_rounding(family, kind):
    model = build(family)
    ids, positions = batch(kind)
    exact = run(model, ids, positions)
    unpatched = run(cast(copy.deepcopy(model), BF16), ids, positions)
    mine = run(patched(model, dtype=BF16), ids, positions)
    assert_within_bf16(mine, unpatched, exact)


@pytest.mark.parametrize("kind", ["batch", "packed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_within_stated_tolerance(family, kind):
    model = build(family)
    ids, positions = batch(kind)
    exact = run(model, ids, positions)
    fp8_model = patched(model, fp8=True, dtype=BF16)
    assert_within_fp8(run(fp8_model, ids, positions), exact)


@requires_cuda
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("family", ["qwen3", "gemma3", "llama"])
def test_cuda_against_float64(family, fp8):
    """On the GPU (the CUDA kernels, cuBLASLt's FP8 GEMMs with fast accumulation): the same
    bounds against the float64 model (on the CPU) as the CPU tests, packed sequences, T = 48."""
    model = build(family)
    ids, positions = batch("packed")
    exact = run(model, ids, positions)

    def on_cuda(m):
        logits, loss, grads = run(m.cuda(), ids.cuda(), positions.cuda())
        return logits.cpu(), loss.cpu(), {name: g.cpu() for name, g in grads.items()}

    unpatched = on_cuda(cast(copy.deepcopy(model), BF16))
    mine = on_cuda(patched(model, fp8=fp8, dtype=BF16))
    if fp8:
        assert_within_fp8(mine, exact)
    else:
        assert_within_bf16(mine, unpatched, exact)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_fp8_without_autocast_runs_whatever_the_token_count(dtype, monkeypatch):
    """fp8=True on a float32 (or float64) model without autocast: every call runs, whether its
    T = batch x sequence is a multiple of 16 (the FP8 op, computing in bf16, its q, k, v cast
    back to the model's dtype) or not (the path of fp8=False, in the model's dtype)."""
    calls = []
    op = qkvfuse.packed_fp8_qkv_current_scaling
    monkeypatch.setattr(qkvfuse, "packed_fp8_qkv_current_scaling",
                        lambda *args, **kwargs: calls.append(1) or op(*args, **kwargs))
    model = build("qwen3")
    fp8_model = patched(model, fp8=True, dtype=dtype)
    for seq in (24, 23):  # T = 48, a multiple of 16; T = 46, not
        ids, _ = batch("batch", seq=seq)
        exact = run(model, ids)
        mine = run(fp8_model, ids)
        assert all(p.grad.dtype == dtype for p in fp8_model.parameters())
        if seq == 24:
            assert_within_fp8(mine, exact)
        else:
            assert_close_f64(mine, exact, tolerance=2e-6 if dtype == F64 else 1e-5)
        # The FP8 op ran in every layer for T = 48, in none for T = 46.
        assert len(calls) == len(model.model.layers)


@pytest.mark.parametrize("fp8", [False, True])
def test_autocast_with_float32_master_weights(fp8):
    """The training set-up of examples/train_hf.py: float32 parameters, bf16 autocast; the
    gradients come back in float32."""
    model = build("qwen3")
    ids, _ = batch("batch")
    exact = run(model, ids)
    unpatched = run(cast(copy.deepcopy(model), torch.float32), ids, autocast=True)
    mine_model = patched(model, fp8=fp8, dtype=torch.float32)
    mine = run(mine_model, ids, autocast=True)
    assert all(p.grad.dtype == torch.float32 for p in mine_model.parameters())
    if fp8:
        assert_within_fp8(mine, exact)
    else:
        assert_within_bf16(mine, unpatched, exact)


# ---- weights: FP8 follows them, the state dict is untouched ----------------------------------

def test_fp8_follows_optimizer_steps_and_loaded_weights():
    """The e4m3 weight is quantized from the master weights in every call: after each optimizer
    step and after load_state_dict the patched model computes what a fresh patch of the current
    weights computes, bit for bit."""
    model = apply_qkvfuse(build("qwen3", dtype=BF16), fp8=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, _ = batch("batch")
    first = run(model, ids)
    for _ in range(2):
        optimizer.step()
        after = run(model, ids)
        fresh = run(apply_qkvfuse(remove_qkvfuse(copy.deepcopy(model)), fp8=True), ids)
        assert not torch.equal(after[0], first[0])  # the step changed the weights
        assert torch.equal(after[0], fresh[0]) and torch.equal(after[1], fresh[1])
        for name in fresh[2]:
            assert torch.equal(after[2][name], fresh[2][name]), name
    with torch.no_grad():
        other = build("qwen3", dtype=BF16)
        model.load_state_dict(other.state_dict())
        want = apply_qkvfuse(other, fp8=True)(input_ids=ids).logits
        assert torch.equal(model(input_ids=ids).logits, want)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_save_load_round_trip(tmp_path, family, fp8):
    """A patched model saves the unpatched model's state dict; loaded (unpatched) and patched
    again, it computes the same bits as before."""
    model = build(family, dtype=BF16)
    reference = copy.deepcopy(model)
    apply_qkvfuse(model, fp8=fp8)
    ids, positions = batch("packed")
    before = run(model, ids, positions)
    assert model.state_dict().keys() == reference.state_dict().keys()
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=BF16)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert "forward" not in loaded.model.layers[0].self_attn.__dict__  # loaded unpatched
    after = run(apply_qkvfuse(loaded.train(), fp8=fp8), ids, positions)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    for name in before[2]:
        assert torch.equal(before[2][name], after[2][name]), name


# ---- generate ----------------------------------------------------------------------------------

def prompts():
    """Two prompts of different lengths, left-padded (attention mask and position offsets)."""
    ids = torch.randint(3, VOCAB, (2, 7))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    return ids, mask


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_float64_same_tokens(family):
    model = build(family).eval()
    ids, mask = prompts()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **kwargs)
    got = patched(model).generate(ids, **kwargs)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fp8", [False, True])
def test_generate_bf16_and_fp8(fp8):
    """bf16 generate runs (FP8: the prefill of 2 x 8 tokens runs the FP8 op, each decode step of
    2 tokens the bf16 path) and keeps the prompts."""
    model = patched(build("gemma3"), fp8=fp8, dtype=BF16).eval()
    ids = torch.randint(3, VOCAB, (2, 8))
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 14) and torch.equal(out[:, :8], ids)


# ---- what is patched, and what is refused ------------------------------------------------------

def test_instance_level_and_removable():
    model = build("llama")
    other = copy.deepcopy(model)
    cls_forward = type(model.model.layers[0].self_attn).forward
    ids, _ = batch("batch")
    want = run(model, ids)
    apply_qkvfuse(model)
    attn = model.model.layers[0].self_attn
    assert "forward" in attn.__dict__ and type(attn).forward is cls_forward
    assert "forward" not in other.model.layers[0].self_attn.__dict__
    assert_close_f64(run(model, ids), want)
    apply_qkvfuse(model, fp8=True)  # re-patching switches the mode
    assert model.model.layers[1].self_attn._qkvfuse.fp8
    remove_qkvfuse(model)
    assert "forward" not in attn.__dict__ and not hasattr(model, "_qkvfuse_state")
    again = run(model, ids)
    assert torch.equal(again[0], want[0])


@pytest.mark.parametrize("make,name", [
    (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=1, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)),
     "GPT2LMHeadModel"),
    (lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2)), "Qwen2ForCausalLM"),
    (lambda: nn.Sequential(nn.Linear(4, 4)), "Sequential"),
])
def test_other_models_are_refused_by_class(make, name):
    with pytest.raises(UnsupportedModelError, match=f"{name} is not supported"):
        apply_qkvfuse(make())


def test_gemma3_multimodal_refused_but_its_text_model_patches():
    text = make_config("gemma3", vocab_size=300).to_dict()
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14).to_dict()
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4, boi_token_index=297,
                                       eoi_token_index=298, image_token_index=299)
    model = transformers.Gemma3ForConditionalGeneration(config).to(F64).train()
    with pytest.raises(UnsupportedModelError,
                       match="Gemma3ForConditionalGeneration is not supported.*SiglipAttention"):
        apply_qkvfuse(model)
    reference = copy.deepcopy(model)
    apply_qkvfuse(model.model.language_model)
    ids = torch.randint(3, 290, (2, 16))
    assert_close_f64(run(model, ids), run(reference, ids))


def test_float16_is_refused_with_a_reason():
    model = apply_qkvfuse(build("qwen3", dtype=torch.float16))
    with pytest.raises(TypeError, match="bfloat16"):
        model(input_ids=batch("batch")[0])


# ---- the example ---------------------------------------------------------------------------------

def test_train_hf_example_tiny_cpu_run(tmp_path):
    """examples/train_hf.py stays runnable: three variants from the same weights and batches."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--device", "cpu", "--tiny", "--steps", "3",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with (tmp_path / "loss.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["variant"] for r in rows} == {"unpatched-bf16", "qkvfuse-bf16", "qkvfuse-fp8"}
    for r in rows:
        assert math.isfinite(float(r["train_loss"])) and math.isfinite(float(r["val_loss"]))
    # Same initial weights and batches: the three variants' first losses agree to bf16/FP8 error.
    first = {r["variant"]: float(r["train_loss"]) for r in rows if r["step"] == "0"}
    assert max(first.values()) - min(first.values()) <= 0.02 * first["unpatched-bf16"]
    assert "step time ratio" in result.stdout
