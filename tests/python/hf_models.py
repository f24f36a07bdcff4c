"""Tiny Hugging Face models and the bounds their patched runs are held to, shared by
test_transformers_integration.py and test_transformers_compose.py. The models are built from
configs with random weights (nothing is downloaded); the norm weights are moved off their initial
1 (0 for Gemma's 1 + w) so that a misplaced weight or offset shows.

Three precisions, three kinds of bound:
- float64 on the CPU: the patched model equals the unpatched one to float32 rounding (HF's own
  per-head RMSNorm computes in float32 even for float64 inputs): logits, loss and every
  parameter's gradient within 2e-6 relative (L2 per tensor). The configs use rms_norm_eps = 1e-3,
  so a wrong eps (5e-4 relative) would show.
- bf16 (SPEC.md section 8: HF rounds between steps, qkvfuse once): both models are compared with
  the float64 model of the same weights, and the patched model's error must stay within 1.5x the
  unpatched model's own bf16 error plus half a bf16 step (2^-9), per tensor: logits and every
  gradient; the loss within one bf16 step (2^-8) relative. Measured: ratios 0.86-1.18.
- FP8 (fp8=True; see FP8_TOLERANCE): against the float64 model, relative L2 error of the logits
  <= 0.15, of the loss <= 0.01, of the whole gradient (every parameter's, concatenated) <= 0.2 with
  cosine >= 0.98, and of each parameter's gradient <= 0.35.
"""
import copy

import torch
import transformers

from qkvfuse.integrations.transformers import apply_qkvfuse

BF16 = torch.bfloat16
F64 = torch.float64
VOCAB = 97

FAMILIES = ["qwen3", "qwen3_moe", "gemma3", "llama", "mistral"]

# FP8 tolerance, relative L2 errors against the float64 model (measured worst over 6 seeds x 5
# families in brackets). e4m3 keeps 3 mantissa bits: rounding moves a value by up to 2^-4 =
# 6.25 % (3.6 % RMS). Each FP8 GEMM multiplies two quantized operands (about 5 % RMS per
# product), so q, k and v carry about 5 % and the logits, which the attention reaches through the
# residual stream, [9 %]. The backward quantizes grad q/k/v once more (current scaling: its
# largest element maps near 448 / 4) and both backward GEMMs again multiply two e4m3 operands: the
# Q/K/V weights' and norm weights' gradients add that error to the forward's, and grad x passes it
# on to every earlier parameter: [14 %] for the whole gradient (cosine [0.990]), [24 %] for the
# worst single tensor (a 32-element norm weight, whose sums cancel the most); the loss [0.4 %].
# The bounds are about 1.5x the measured worst.
FP8_TOLERANCE = dict(logits=0.15, loss=0.01, gradient=0.2, cosine=0.98, parameter=0.35)


# ---- models --------------------------------------------------------------------------------------

def make_config(family, **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-3,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    if family == "qwen3":
        return transformers.Qwen3Config(**common)
    if family == "qwen3_moe":
        # Every expert selected: the routing stays continuous, so rounding differences cannot
        # flip a token to another expert (the float64 tests also run top-2 routing).
        common = dict(dict(num_experts=4, num_experts_per_tok=4, moe_intermediate_size=32),
                      **common)
        return transformers.Qwen3MoeConfig(**common)
    if family == "gemma3":
        # One local (sliding window 8, theta 1e4) and one global layer (theta 1e6).
        common = dict(dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                           query_pre_attn_scalar=32), **common)
        return transformers.Gemma3TextConfig(**common)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":
        return transformers.MistralConfig(**dict(dict(sliding_window=8), **common))
    raise ValueError(family)


def build(family, dtype=F64, attn="sdpa", **overrides):
    config = make_config(family, **overrides)
    extra = dict(experts_implementation="eager") if family == "qwen3_moe" else {}
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                                          dtype=F64, **extra)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # the norm weights
                p.add_(0.3 * torch.randn_like(p))
    return cast(model, dtype).train()


def cast(model, dtype):
    """model.to(dtype), but the rotary frequencies stay float32, as from_config and
    from_pretrained keep them (.to() would round them to bf16)."""
    frequencies = [(module, name, buffer.float()) for module in model.modules()
                   for name, buffer in module._buffers.items()
                   if buffer is not None and name.endswith("inv_freq")]
    model.to(dtype)
    for module, name, buffer in frequencies:
        module._buffers[name] = buffer
    return model


def patched(model, fp8=False, dtype=None):
    twin = copy.deepcopy(model)
    if dtype is not None:
        cast(twin, dtype)
    return apply_qkvfuse(twin, fp8=fp8)


def batch(kind, batch_size=2, seq=24):
    """(input_ids, position_ids or None): a plain batch or one packed row of three documents."""
    if kind == "batch":
        return torch.randint(3, VOCAB, (batch_size, seq)), None
    lengths = [20, 17, 11]
    ids = torch.randint(3, VOCAB, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, positions


def run(model, ids, position_ids=None, autocast=False, call=None):
    """(logits, loss, {name: grad}) in float64 on the CPU, from one forward + backward on the
    device of `ids` (through `call`, e.g. a compiled model, if given)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=BF16, enabled=autocast):
        out = (model if call is None else call)(input_ids=ids, position_ids=position_ids,
                                                labels=ids, use_cache=False)
    out.loss.backward()
    grads = {name: p.grad.double().cpu() for name, p in model.named_parameters()
             if p.grad is not None}  # (a multimodal model's vision tower gets none from text)
    return out.logits.detach().double().cpu(), out.loss.detach().double().cpu(), grads


def rel(out, ref):
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def assert_close_f64(mine, theirs, tolerance=2e-6):
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = mine, theirs
    assert rel(logits, ref_logits) <= tolerance, rel(logits, ref_logits)
    assert rel(loss, ref_loss) <= tolerance
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert rel(grads[name], ref_grads[name]) <= tolerance, (name, rel(grads[name],
                                                                          ref_grads[name]))


def assert_within_bf16(mine, unpatched, exact):
    """The patched bf16 model's error against float64 <= 1.5x the unpatched bf16 model's + 2^-9."""
    def check(what, out, ref, want):
        e_out, e_ref = rel(out, want), rel(ref, want)
        assert e_out <= 1.5 * e_ref + 2**-9, (f"{what}: patched error {e_out:.3g} against "
                                             f"unpatched {e_ref:.3g}")
    check("logits", mine[0], unpatched[0], exact[0])
    assert abs(mine[1] - exact[1]) <= 2**-8 * abs(exact[1])
    for name in exact[2]:
        check(name, mine[2][name], unpatched[2][name], exact[2][name])


def assert_within_fp8(mine, exact):
    tol = FP8_TOLERANCE
    assert rel(mine[0], exact[0]) <= tol["logits"], rel(mine[0], exact[0])
    assert abs(mine[1] - exact[1]) <= tol["loss"] * abs(exact[1])
    for name in exact[2]:
        assert rel(mine[2][name], exact[2][name]) <= tol["parameter"], (
            name, rel(mine[2][name], exact[2][name]))
    flat = [torch.cat([g[n].flatten() for n in sorted(exact[2])]) for g in (mine[2], exact[2])]
    assert rel(*flat) <= tol["gradient"], rel(*flat)
    assert torch.nn.functional.cosine_similarity(*flat, dim=0).item() >= tol["cosine"]
