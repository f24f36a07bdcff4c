"""apply_qkvfuse composed with what users already run (issue 31): Liger-Kernel's patches, PEFT
LoRA adapters, gradient checkpointing, torch.compile and TRL's SFTTrainer, each against the same
model without qkvfuse (tiny models, the bounds of hf_models.py).

Liger-Kernel's kernels are Triton and need a GPU, so on the CPU its patched models cannot run
whole: its module swaps (LigerRMSNorm as q_norm / k_norm, its rope in the modeling module, its
SwiGLU/GeGLU MLPs, its fused linear cross entropy) do happen on the CPU, and the patched attention
modules, which call none of Liger's kernels, run. Those are compared with the unpatched family's
attention modules, on the arguments the decoder hands them in a forward of the unpatched model.
The whole-model GPU runs are the whole-step benchmark's.
"""
import contextlib
import copy
import importlib
import math

import pytest
import torch
import torch.nn as nn

import qkvfuse

transformers = pytest.importorskip(
    "transformers",
    reason="Hugging Face transformers is not installed (pip install .[transformers])")

from conftest import DEVICES, requires_cuda  # noqa: E402
from hf_models import (  # noqa: E402
    BF16,
    F64,
    FAMILIES,
    FP8_TOLERANCE,
    VOCAB,
    assert_close_f64,
    assert_within_bf16,
    assert_within_fp8,
    batch,
    build,
    cast,
    patched,
    rel,
    run,
)
from qkvfuse.integrations.transformers import (  # noqa: E402
    UnsupportedModelError,
    apply_qkvfuse,
    remove_qkvfuse,
)


def optional(name):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


LIGER = optional("liger_kernel.transformers")
PEFT = optional("peft")
TRL = optional("trl")
requires_liger = pytest.mark.skipif(
    LIGER is None, reason="liger-kernel is not installed (scripts/test.sh installs it)")
requires_peft = pytest.mark.skipif(
    PEFT is None, reason="peft is not installed (scripts/test.sh installs it)")

MODELING = {
    "qwen3": "transformers.models.qwen3.modeling_qwen3",
    "qwen3_moe": "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "gemma3": "transformers.models.gemma3.modeling_gemma3",
    "llama": "transformers.models.llama.modeling_llama",
    "mistral": "transformers.models.mistral.modeling_mistral",
    # Families of SPEC.md section 9 that Liger-Kernel patches (test_transformers_families.py).
    "gemma4": "transformers.models.gemma4.modeling_gemma4",
    "qwen3_next": "transformers.models.qwen3_next.modeling_qwen3_next",
    "olmo3": "transformers.models.olmo3.modeling_olmo3",
}


# ---- Liger-Kernel ------------------------------------------------------------------------------

def liger_patch(family):
    """Liger-Kernel's patch function for the family (apply_liger_kernel_to_<family>)."""
    name = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}.get(family, family)
    return getattr(LIGER, f"apply_liger_kernel_to_{name}")


@contextlib.contextmanager
def restored(family):
    """Liger's patch functions assign to transformers' modeling module (its RMSNorm and MLP
    classes, apply_rotary_pos_emb) and, without a model, to the causal LM class's forward: for
    the whole process. Everything they change there is put back afterwards."""
    module = importlib.import_module(MODELING[family])
    names = dict(vars(module))
    classes = {cls: dict(vars(cls)) for cls in names.values()
               if isinstance(cls, type) and cls.__module__ == module.__name__}
    try:
        yield
    finally:
        for name in set(vars(module)) - set(names):
            delattr(module, name)
        for name, value in names.items():
            if vars(module).get(name) is not value:
                setattr(module, name, value)
        for cls, attributes in classes.items():
            for name in set(vars(cls)) - set(attributes):
                delattr(cls, name)
            for name, value in attributes.items():
                if vars(cls).get(name) is not value:
                    setattr(cls, name, value)


def liger_model(family, reference, how):
    """A copy of `reference` (same weights) patched by Liger-Kernel: "class" patches the modeling
    module before the model is built (its q/k norms are then LigerRMSNorm instances), "instance"
    patches the built model (its norms keep their class and run Liger's forward)."""
    if how == "class":
        liger_patch(family)()
        model = build(family, dtype=next(reference.parameters()).dtype)
        model.load_state_dict(reference.state_dict())
        return model
    model = copy.deepcopy(reference)
    liger_patch(family)(model=model)
    return model


def attention_calls(model, ids):
    """The keyword arguments every attention module receives in one forward of `model`, by
    module path (float64 tensors detached)."""
    calls = {}

    def capture(name):
        def hook(module, args, kwargs):
            assert not args
            calls[name] = {k: v.detach() if isinstance(v, torch.Tensor) else
                           tuple(t.detach() for t in v) if isinstance(v, tuple) else v
                           for k, v in kwargs.items()}
        return hook

    handles = [m.register_forward_pre_hook(capture(name), with_kwargs=True)
               for name, m in model.named_modules() if name.endswith("self_attn")]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for handle in handles:
        handle.remove()
    assert calls
    return calls


def attention_run(model, calls, dtype=F64):
    """(outputs, gradients) of the model's attention modules called with `calls` (inputs cast to
    `dtype`): each module's output and, from a fixed random output gradient, the gradients of
    its input and of its parameters, all in float64, by name."""
    modules = dict(model.named_modules())
    outputs, grads = {}, {}
    for i, (name, kwargs) in enumerate(sorted(calls.items())):
        module = modules[name]
        module.zero_grad(set_to_none=True)
        hidden = kwargs["hidden_states"].detach().to(dtype).requires_grad_()
        cos, sin = kwargs["position_embeddings"]
        out, _ = module(**dict(kwargs, hidden_states=hidden,
                               position_embeddings=(cos.to(dtype), sin.to(dtype))))
        generator = torch.Generator().manual_seed(i)
        out.backward(torch.randn(out.shape, generator=generator, dtype=F64).to(out.dtype))
        outputs[name] = out.detach().double()
        grads[f"{name}.input"] = hidden.grad.double()
        for pname, p in module.named_parameters():
            if p.grad is not None:
                grads[f"{name}.{pname}"] = p.grad.double()
    return outputs, grads


def assert_attention_close(mine, theirs, tolerance=2e-6):
    for got, want in zip(mine, theirs):
        assert got.keys() == want.keys()
        for name in want:
            assert rel(got[name], want[name]) <= tolerance, (name, rel(got[name], want[name]))


class ExactRMSNorm(nn.Module):
    """What Liger's RMSNorm computes, x / sqrt(mean(x^2) + eps) * (offset + w) (w absent: not
    multiplied), in float64: the reference for settings no family's own norm has."""

    def __init__(self, weight, offset, eps):
        super().__init__()
        self.weight = None if weight is None else nn.Parameter(weight.detach().clone())
        self.offset, self.eps = offset, eps

    def forward(self, x):
        x = x.double()
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return y if self.weight is None else y * (self.offset + self.weight.double())


LIGER_FAMILIES = FAMILIES  # every supported family has a Liger-Kernel patch


@requires_liger
@pytest.mark.parametrize("how", ["class", "instance"])
@pytest.mark.parametrize("family", LIGER_FAMILIES)
def test_liger_then_qkvfuse_equals_the_unpatched_family(family, how):
    """Liger first (the issue's refusal: "q_norm is LigerRMSNorm"), then apply_qkvfuse: the
    patched attention equals the family's own, float64, outputs and every gradient."""
    reference = build(family)
    ids, _ = batch("batch")
    calls = attention_calls(reference, ids)
    want = attention_run(reference, calls)  # outside `restored`: Liger's rope is not there
    with restored(family):
        model = apply_qkvfuse(liger_model(family, reference, how))
        if family in ("qwen3", "qwen3_moe", "gemma3"):
            q_norm = model.model.layers[0].self_attn.q_norm
            assert q_norm._get_name() == "LigerRMSNorm" or isinstance(q_norm,
                                                                      LIGER.LigerRMSNorm)
        assert_attention_close(attention_run(model, calls), want)


@requires_liger
@pytest.mark.parametrize("family", ["qwen3", "gemma3", "llama"])
def test_qkvfuse_then_liger(family):
    """The other order: Liger's instance patch after apply_qkvfuse rebinds the q/k norms' forward
    and sets their offset, eps and casting mode; the patched attention reads them at every
    forward and still equals the family's."""
    reference = build(family)
    ids, _ = batch("batch")
    calls = attention_calls(reference, ids)
    want = attention_run(reference, calls)
    model = apply_qkvfuse(copy.deepcopy(reference))
    with restored(family):
        liger_patch(family)(model=model)
        assert "forward" in model.model.layers[1].self_attn.__dict__  # still patched
        assert model.model.layers[1].mlp._get_name().startswith("Liger")
        assert_attention_close(attention_run(model, calls), want)


@requires_liger
@pytest.mark.parametrize("offset,eps,affine", [(0.5, 1e-2, True), (1.0, 1e-6, True),
                                               (0.0, 1e-3, False)])
def test_liger_norm_settings_are_read(offset, eps, affine):
    """A LigerRMSNorm's own offset, eps and weight (or none: elementwise_affine=False) become
    qkvfuse's weight_offset, eps and norm weight, whatever the family's norm would do."""
    base = build("qwen3")
    ids, _ = batch("batch")
    calls = attention_calls(base, ids)
    with restored("qwen3"):
        model = liger_model("qwen3", base, "class")
    reference = base
    for layer, ref_layer in zip(model.model.layers, reference.model.layers):
        for name in ("q_norm", "k_norm"):
            weight = getattr(ref_layer.self_attn, name).weight if affine else None
            setattr(ref_layer.self_attn, name, ExactRMSNorm(weight, offset, eps))
            norm = LIGER.LigerRMSNorm(32, eps=eps, offset=offset, casting_mode="gemma",
                                      elementwise_affine=affine).to(F64)
            if affine:
                norm.weight.data.copy_(weight)
            setattr(layer.self_attn, name, norm)
    apply_qkvfuse(model)
    assert_attention_close(attention_run(model, calls), attention_run(reference, calls))


@requires_liger
def test_liger_settings_qkvfuse_cannot_match_are_refused_by_name():
    def model_with(**settings):
        model = build("qwen3")
        liger_patch("qwen3")(model=model)
        for layer in model.model.layers:
            for name, value in settings.items():
                norm, attribute = name.split("__")
                setattr(getattr(layer.self_attn, norm), attribute, value)
        return model

    calls = attention_calls(build("qwen3"), batch("batch")[0])
    with restored("qwen3"):
        with pytest.raises(UnsupportedModelError,
                           match=r"q_norm \(Liger-Kernel's LigerRMSNorm\): casting_mode 'fp16'"):
            apply_qkvfuse(model_with(q_norm__casting_mode="fp16"))
        with pytest.raises(UnsupportedModelError,
                           match=r"q_norm and k_norm differ in eps \(0.001 and 0.01\): qkvfuse "
                                 r"applies one eps to both"):
            apply_qkvfuse(model_with(k_norm__variance_epsilon=1e-2))
        with pytest.raises(UnsupportedModelError, match=r"differ in offset \(1.0 and 0.0\)"):
            apply_qkvfuse(model_with(q_norm__offset=1.0))
        # Settings that change where Liger rounds, not what it computes, are accepted.
        apply_qkvfuse(model_with(q_norm__casting_mode="none", k_norm__in_place=False,
                                 q_norm__row_mode=True))
        # Patched first, then given a setting it cannot take: the next forward says so.
        model = apply_qkvfuse(model_with())
        model.model.layers[1].self_attn.k_norm.offset = 0.25
        with pytest.raises(UnsupportedModelError, match=r"layers\.1\.self_attn .* differ in "
                                                        r"offset \(0.0 and 0.25\)"):
            attention_run(model, calls)


@requires_liger
def test_other_norm_replacements_are_refused_by_name():
    model = build("qwen3")
    model.model.layers[0].self_attn.q_norm = LIGER.rms_norm.LigerRMSNormForGemma4(32)
    with pytest.raises(UnsupportedModelError,
                       match=r"q_norm is liger_kernel\.transformers\.rms_norm\."
                             r"LigerRMSNormForGemma4, expected the family's Qwen3RMSNorm or "
                             r"Liger-Kernel's LigerRMSNorm"):
        apply_qkvfuse(model)
    model = build("qwen3")
    norm = model.model.layers[1].self_attn.k_norm
    norm.forward = lambda x: x
    with pytest.raises(UnsupportedModelError,
                       match=r"k_norm \(Qwen3RMSNorm\) has its forward replaced on the instance "
                             r"by .*<lambda>"):
        apply_qkvfuse(model)


@requires_liger
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_liger_bf16_rounds_once(family):
    """bf16: qkvfuse computes the norm and rotary in fp32 and rounds q and k once, whatever
    Liger's casting_mode ("llama" for Qwen3, "gemma" for Gemma 3); the patched attention's error
    against float64 stays within the family's own bf16 attention's (which rounds as Liger's
    modes do), as hf_models.assert_within_bf16 bounds it."""
    reference = build(family)
    ids, _ = batch("batch")
    calls = attention_calls(reference, ids)
    exact = attention_run(reference, calls)
    unpatched = attention_run(cast(copy.deepcopy(reference), BF16), calls, BF16)
    with restored(family):
        model = apply_qkvfuse(cast(liger_model(family, reference, "instance"), BF16))
        mine = attention_run(model, calls, BF16)
    for part in range(2):
        for name in exact[part]:
            e_mine, e_ref = rel(mine[part][name], exact[part][name]), rel(
                unpatched[part][name], exact[part][name])
            assert e_mine <= 1.5 * e_ref + 2**-9, (name, e_mine, e_ref)


def loss_and_grads(model, ids, positions):
    """(loss, {name: grad}) in float64 on the CPU from one forward + backward on the model's
    device (Liger's fused linear cross entropy computes the loss without logits)."""
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids.to(device), position_ids=positions.to(device),
                labels=ids.to(device), use_cache=False)
    out.loss.backward()
    return out.loss.detach().double().cpu(), {
        name: p.grad.double().cpu() for name, p in model.named_parameters() if p.grad is not None}


@requires_cuda
@requires_liger
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("family", ["qwen3", "gemma3", "llama"])
def test_cuda_liger_then_qkvfuse_whole_model(family, fp8):
    """On the GPU the whole model runs: Liger-Kernel's kernels (RMSNorms, SwiGLU / GeGLU, fused
    linear cross entropy) and qkvfuse's attention input, bf16. Loss and every gradient against
    the float64 model (on the CPU): bf16 within 1.5x the error of Liger alone + 2^-9 per tensor,
    the loss within one bf16 step of it; FP8 within hf_models.FP8_TOLERANCE."""
    reference = build(family)
    ids, positions = batch("packed")
    exact = loss_and_grads(reference, ids, positions)
    with restored(family):
        liger_alone = liger_model(family, cast(copy.deepcopy(reference), BF16), "class").cuda()
        mine = apply_qkvfuse(copy.deepcopy(liger_alone), fp8=fp8)
        theirs = loss_and_grads(liger_alone, ids, positions)
        got = loss_and_grads(mine, ids, positions)
    assert got[1].keys() == exact[1].keys() == theirs[1].keys()
    if fp8:
        assert abs(got[0] - exact[0]) <= FP8_TOLERANCE["loss"] * abs(exact[0])
        for name in exact[1]:
            assert rel(got[1][name], exact[1][name]) <= FP8_TOLERANCE["parameter"], name
        return
    assert abs(got[0] - exact[0]) <= abs(theirs[0] - exact[0]) + 2**-8 * abs(exact[0])
    for name in exact[1]:
        e_mine, e_theirs = rel(got[1][name], exact[1][name]), rel(theirs[1][name], exact[1][name])
        assert e_mine <= 1.5 * e_theirs + 2**-9, (name, e_mine, e_theirs)


# ---- PEFT LoRA ---------------------------------------------------------------------------------

def lora(model, targets=("q_proj", "k_proj", "v_proj", "o_proj")):
    """The model with LoRA adapters (rank 4) on `targets`, their B matrices random (PEFT starts
    them at zero, which would hide an adapter left out of q, k or v)."""
    config = PEFT.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets),
                             init_lora_weights=False)
    return PEFT.get_peft_model(model, config)


@requires_peft
@pytest.mark.parametrize("targets", [("q_proj", "k_proj", "v_proj", "o_proj"),
                                     ("q_proj", "v_proj")])
@pytest.mark.parametrize("family", ["qwen3", "gemma3", "llama"])
def test_peft_lora_float64(family, targets):
    """apply_qkvfuse on a PEFT model: the projections run as modules (base + adapter), so the
    logits, loss and the adapters' gradients (the only trainable parameters) equal the PEFT
    model's without qkvfuse."""
    model = lora(build(family), targets)
    ids, _ = batch("batch")
    mine, want = run(apply_qkvfuse(copy.deepcopy(model)), ids), run(model, ids)
    assert want[2] and all("lora_" in name for name in want[2])
    assert_close_f64(mine, want)


@requires_peft
def test_peft_lora_bf16_within_the_unpatched_models_rounding():
    exact_model = lora(build("qwen3"))
    ids, positions = batch("packed")
    exact = run(exact_model, ids, positions)
    unpatched = run(cast(copy.deepcopy(exact_model), BF16), ids, positions)
    mine = run(apply_qkvfuse(cast(copy.deepcopy(exact_model), BF16)), ids, positions)
    assert_within_bf16(mine, unpatched, exact)


@requires_peft
def test_peft_merged_adapters():
    """merge_adapter() (the LoRA layers stay, their adapters folded into the base weights) and
    merge_and_unload() (plain nn.Linear again: the one-GEMM path, and fp8=True accepted)."""
    model = lora(build("qwen3"))
    ids, _ = batch("batch")
    merged = copy.deepcopy(model)
    merged.merge_adapter()
    merged.requires_grad_(True)  # the merged adapters get no gradient; the base weights do
    assert_close_f64(run(apply_qkvfuse(copy.deepcopy(merged)), ids), run(merged, ids))
    unloaded = copy.deepcopy(model).merge_and_unload().requires_grad_(True)
    assert type(unloaded.model.layers[0].self_attn.q_proj) is nn.Linear
    want = run(unloaded, ids)
    assert_close_f64(run(patched(unloaded), ids), want)
    assert_within_fp8(run(patched(unloaded, fp8=True, dtype=BF16), ids), want)


@requires_peft
def test_peft_lora_fp8_is_refused_by_name():
    model = lora(build("qwen3"), ("q_proj", "v_proj"))
    with pytest.raises(UnsupportedModelError,
                       match=r"fp8=True needs q_proj, k_proj and v_proj to be plain "
                             r"torch.nn.Linear .*: q_proj is peft\.tuners\.lora\.layer\.Linear "
                             r"\(a PEFT LoRA adapter layer\); v_proj is peft\.tuners\.lora\.layer"
                             r"\.Linear \(a PEFT LoRA adapter layer\)\. Use fp8=False, which "
                             r"calls them as modules, or merge the LoRA adapters into the "
                             r"weights first \(merge_and_unload\(\)\)"):
        apply_qkvfuse(model, fp8=True)


# ---- gradient checkpointing --------------------------------------------------------------------

@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("mode", ["float64", "bf16", "fp8", "lora"])
def test_gradient_checkpointing_same_loss_and_gradients(mode, use_reentrant):
    """gradient_checkpointing_enable() recomputes each layer's forward in the backward: the same
    loss and gradients, bit for bit, as without (FP8: each recomputed call quantizes the same
    weights and input again; its backward computes its own gradient scale)."""
    if mode == "lora" and PEFT is None:
        pytest.skip("peft is not installed (scripts/test.sh installs it)")
    dtype = F64 if mode in ("float64", "lora") else BF16
    model = build("qwen3", dtype=dtype)
    if mode == "lora":
        model = lora(model)
    apply_qkvfuse(model, fp8=mode == "fp8")
    ids, _ = batch("batch")
    plain = run(model, ids)
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs=dict(use_reentrant=use_reentrant))
    base = model.get_base_model() if mode == "lora" else model
    assert base.model.gradient_checkpointing
    again = run(model, ids)
    assert torch.equal(plain[0], again[0]) and torch.equal(plain[1], again[1])
    assert plain[2].keys() == again[2].keys()
    for name in plain[2]:
        assert torch.equal(plain[2][name], again[2][name]), name


# ---- FP8 in eager training loops ---------------------------------------------------------------

@pytest.mark.parametrize("how", ["accumulate", "one_backward"])
def test_fp8_each_call_scales_its_own_gradient(how):
    """Two micro-batches, one of them with its loss scaled by 2^10 (its gradients 1024x larger):
    accumulated over two backwards, or both forwards before one backward of the sum, the
    gradients equal the sum of each micro-batch's own, bit for bit. A gradient scale shared by
    the two calls (per module, or the last call's) would quantize one of them with the other's
    scale."""
    model = apply_qkvfuse(build("qwen3", dtype=torch.float32), fp8=True)
    (ids1, _), (ids2, _) = batch("batch"), batch("batch")

    def loss(ids, factor):
        with torch.autocast("cpu", dtype=BF16):
            return model(input_ids=ids, labels=ids, use_cache=False).loss * factor

    parts = []
    for ids, factor in ((ids1, 1.0), (ids2, 1024.0)):
        model.zero_grad(set_to_none=True)
        loss(ids, factor).backward()
        parts.append({n: p.grad.clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    if how == "accumulate":
        loss(ids1, 1.0).backward()
        loss(ids2, 1024.0).backward()
    else:
        (loss(ids1, 1.0) + loss(ids2, 1024.0)).backward()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, parts[0][name] + parts[1][name]), name


# ---- torch.compile -----------------------------------------------------------------------------

# (parameter dtype, bf16 autocast): examples/train_hf.py's float32 master weights under autocast,
# and a bf16 model.
SETUPS = {"autocast": (torch.float32, True), "bf16": (BF16, False)}


def loss_step(model, autocast):
    def step(ids):
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            return model(input_ids=ids, labels=ids, use_cache=False).loss
    return step


def dynamo_graphs(model, ids, autocast):
    """(graphs, graph breaks, their reasons, the graphs' code, subgraphs included) of the model's
    forward + loss, as torch._dynamo.explain counts them."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(loss_step(model, autocast))(ids)
    return (explained.graph_count, explained.graph_break_count,
            [str(r.reason) for r in explained.break_reasons],
            "".join(m.code for g in explained.graphs for m in g.modules()
                    if isinstance(m, torch.fx.GraphModule)))


@pytest.mark.parametrize("setup", list(SETUPS))
def test_compile_adds_no_graph_break(setup):
    """The patched models (bf16 path and fp8=True) trace into as many graphs, with as many
    breaks, as the unpatched model (today one graph, no break), and the qkvfuse ops are in
    them."""
    dtype, autocast = SETUPS[setup]
    model = build("qwen3", dtype=dtype)
    ids, _ = batch("batch")
    unpatched = dynamo_graphs(model, ids, autocast)
    assert "qkvfuse" not in unpatched[3]
    for fp8 in (False, True):
        mine = dynamo_graphs(apply_qkvfuse(copy.deepcopy(model), fp8=fp8), ids, autocast)
        assert mine[:3] == unpatched[:3], (fp8, mine[:3], unpatched[:3])
        assert "qkvfuse" in mine[3]


def compiled_run(model, ids, backend, autocast=True, fullgraph=True):
    """run() through torch.compile(model), twice: forward and backward compiled. Returns the
    first run's result and the graph breaks torch._dynamo counted; the second run must reuse
    the first one's graphs (no recompilation) and give the same bits."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(model, backend=backend, fullgraph=fullgraph)
    result = run(model, ids, autocast=autocast, call=compiled)
    graphs = counters["stats"]["unique_graphs"]
    again = run(model, ids, autocast=autocast, call=compiled)
    assert counters["stats"]["unique_graphs"] == graphs, "recompiled"
    assert torch.equal(result[0], again[0]) and torch.equal(result[1], again[1])
    return result, sum(counters["graph_break"].values())


@pytest.mark.parametrize("setup", list(SETUPS))
def test_compiled_training_step_aot_eager(setup):
    """fullgraph=True forward and backward (aot_eager: the traced graphs run by eager kernels):
    no graph break, and the compiled patched models within the bounds of the eager ones against
    float64 (bf16: against the compiled unpatched model's own error)."""
    dtype, autocast = SETUPS[setup]
    model = build("qwen3")
    ids, _ = batch("batch")
    exact = run(model, ids)
    unpatched, breaks = compiled_run(cast(copy.deepcopy(model), dtype), ids, "aot_eager",
                                     autocast)
    assert breaks == 0
    bf16, breaks = compiled_run(patched(model, dtype=dtype), ids, "aot_eager", autocast)
    assert breaks == 0
    assert_within_bf16(bf16, unpatched, exact)
    fp8, breaks = compiled_run(patched(model, fp8=True, dtype=dtype), ids, "aot_eager",
                               autocast)
    assert breaks == 0
    assert_within_fp8(fp8, exact)


def test_compiled_bf16_path_equals_eager_float32():
    """float32 on the CPU (no rounding to tell the paths apart): the compiled patched model
    computes what the eager one does."""
    model = apply_qkvfuse(build("qwen3", dtype=torch.float32))
    ids, _ = batch("batch")
    compiled, _ = compiled_run(model, ids, "aot_eager", autocast=False)
    assert_close_f64(compiled, run(model, ids), tolerance=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_training_step_inductor(device):
    """Inductor (the default backend; C++ kernels on the CPU, Triton on CUDA): fullgraph=True
    forward and backward of both patched paths, under autocast with float32 master weights."""
    model = build("qwen3", num_hidden_layers=1)
    ids, _ = batch("batch")
    exact = run(model, ids)
    ids = ids.to(device)
    bf16, breaks = compiled_run(patched(model, dtype=torch.float32).to(device), ids, "inductor")
    assert breaks == 0
    unpatched = run(cast(copy.deepcopy(model), torch.float32).to(device), ids, autocast=True)
    assert_within_bf16(bf16, unpatched, exact)
    fp8, breaks = compiled_run(patched(model, fp8=True, dtype=torch.float32).to(device), ids,
                               "inductor")
    assert breaks == 0
    assert_within_fp8(fp8, exact)


# ---- TRL ---------------------------------------------------------------------------------------

def word_tokenizer():
    """A tokenizer of the tiny models' vocabulary built in memory (t0 .. t96; nothing is
    downloaded): SFTTrainer wants one for its padding and special tokens."""
    from tokenizers import Tokenizer, models
    vocab = {f"t{i}": i for i in range(VOCAB)}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="t3")),
        pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3")


def sft_losses(model, tmp_path, steps):
    """The training losses of `steps` SFTTrainer steps (batches of 4 x 16 tokens, bf16 autocast
    on the CPU, constant learning rate) on a learnable in-memory dataset: rows counting up in
    steps of 5 modulo the vocabulary from random starts, already tokenized."""
    datasets = pytest.importorskip("datasets")
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(0, VOCAB - 3, (64,), generator=generator).tolist()
    rows = [[(start + 5 * i) % (VOCAB - 3) + 3 for i in range(16)] for start in starts]
    args = TRL.SFTConfig(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4,
        learning_rate=1e-2, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1,
        report_to="none", use_cpu=True, bf16=True, save_strategy="no", seed=0,
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = TRL.SFTTrainer(model=model, args=args,
                             train_dataset=datasets.Dataset.from_dict({"input_ids": rows}),
                             processing_class=word_tokenizer())
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]



@pytest.mark.skipif(TRL is None, reason="trl is not installed (scripts/test.sh installs it)")
def test_trl_sft_trainer_trains_a_patched_model(tmp_path, monkeypatch):
    """SFTTrainer trains the patched model (bf16 path and fp8=True) from the same weights on the
    same batches as the unpatched one: every step's loss finite and within 10 % of the
    unpatched model's (the first within the FP8 loss bound), and the loss falls below half of
    its first value. The FP8 op runs in every forward (4 x 16 tokens: T a multiple of 16)."""
    steps = 10
    model = build("qwen3", dtype=torch.float32)
    want = sft_losses(copy.deepcopy(model), tmp_path / "unpatched", steps)
    assert len(want) == steps and want[-1] < 0.5 * want[0]
    calls = []
    original = qkvfuse.packed_fp8_qkv_current_scaling
    monkeypatch.setattr(qkvfuse, "packed_fp8_qkv_current_scaling",
                        lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    for fp8 in (False, True):
        mine = sft_losses(apply_qkvfuse(copy.deepcopy(model), fp8=fp8), tmp_path / str(fp8),
                          steps)
        assert len(mine) == steps and all(math.isfinite(loss) for loss in mine)
        assert abs(mine[0] - want[0]) <= 0.01 * want[0], (fp8, mine[0], want[0])
        for got, ref in zip(mine, want):
            assert abs(got - ref) <= 0.1 * ref, (fp8, mine, want)
        assert mine[-1] < 0.5 * mine[0]
    assert len(calls) >= steps * len(model.model.layers)
