"""qk_norm_rope against Hugging Face's own Qwen3 and Gemma 3 formulas (SPEC.md section 8).

The formulas are restated here from transformers' source (checked against transformers 5.17 and
5.25, the versions CI runs; 4.5x has the same code):
- transformers:src/transformers/models/qwen3/modeling_qwen3.py: Qwen3RMSNorm.forward (variance
  in float32, x * rsqrt(variance + eps), cast back to the input dtype, then weight * that), the
  rotary embedding Qwen3RotaryEmbedding (inv_freq = 1 / base ** (arange(0, D, 2) / D) in float32,
  freqs = positions * inv_freq, emb = cat(freqs, freqs), cos/sin [T, D] cast to the input dtype),
  rotate_half and apply_rotary_pos_emb (q * cos + rotate_half(q) * sin);
- transformers:src/transformers/models/gemma3/modeling_gemma3.py: Gemma3RMSNorm.forward
  (x * rsqrt(...) in float32, times (1 + w) in float32, then cast), with the same rotary functions.
When transformers is importable, its real functions are called too and must equal the
restatements bit for bit.

HF rounds to bf16 between steps (the normalized row, the product with the weight, each product of
the rotary and their sum, cos and sin themselves); qkvfuse rounds once. So the two agree within a
few bf16 steps of the terms, and qkvfuse is the closer to the float64 value of the same formula.
"""
import pytest
import torch

import qkvfuse
import reference as ref
from conftest import DEVICES, assert_bf16_close, rel_error

BF16 = torch.bfloat16

# ---- the formulas, restated ----------------------------------------------------------------------


def hf_qwen3_rms_norm(hidden_states, weight, eps):
    """Qwen3RMSNorm.forward."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def hf_gemma3_rms_norm(x, weight, eps):
    """Gemma3RMSNorm.forward."""
    output = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    output = output * (1.0 + weight.float())
    return output.type_as(x)


def hf_inv_freq(dim, base):
    """The default rope init (compute_default_rope_parameters), float32."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))


def hf_cos_sin(inv_freq, positions, dtype):
    """Qwen3RotaryEmbedding.forward (attention_scaling 1): cos, sin [T, D]."""
    freqs = positions[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


# ---- the models ---------------------------------------------------------------------------------

# (name, Hq, Hkv, D, rope_theta, norm, weight_offset): Qwen3 (GQA 2:1 here) and Gemma 3 (MQA).
MODELS = {
    "qwen3": dict(heads=4, kv=2, dim=64, base=1e6, norm=hf_qwen3_rms_norm, offset=0.0),
    "gemma3": dict(heads=4, kv=1, dim=32, base=1e4, norm=hf_gemma3_rms_norm, offset=1.0),
}
EPS = 1e-6
TOKENS = 48
MAX_POSITION = 512


def model_inputs(model, device):
    m = MODELS[model]
    qk = (torch.randn(TOKENS, m["heads"] + m["kv"], m["dim"], device=device) * 3).to(BF16)
    center = 0.0 if m["offset"] else 1.0
    q_weight = (center + 0.3 * torch.randn(m["dim"], device=device)).to(BF16)
    k_weight = (center + 0.3 * torch.randn(m["dim"], device=device)).to(BF16)
    positions = torch.randint(0, MAX_POSITION, (TOKENS,), device=device)
    return m, qk, q_weight, k_weight, positions


def hf_forward(m, qk, q_weight, k_weight, positions):
    """HF's q, k (bf16): per-head norm, then the rotary, in its order and dtypes."""
    q = m["norm"](qk[:, : m["heads"]], q_weight, EPS)
    k = m["norm"](qk[:, m["heads"] :], k_weight, EPS)
    cos, sin = hf_cos_sin(hf_inv_freq(m["dim"], m["base"]).to(qk.device), positions, qk.dtype)
    return hf_apply_rotary_pos_emb(q, k, cos, sin)


def ours(m, qk, q_weight, k_weight, positions, dtype=torch.float32):
    cos_sin = qkvfuse.rotary_cos_sin(MAX_POSITION, m["dim"], base=m["base"], dtype=dtype,
                                     device=qk.device)
    return qkvfuse.qk_norm_rope(qk, num_heads=m["heads"], num_kv_heads=m["kv"],
                                rotary_style="neox", q_weight=q_weight, k_weight=k_weight,
                                weight_offset=m["offset"], eps=EPS, cos_sin=cos_sin,
                                positions=positions)


def exact(m, qk, q_weight, k_weight, positions):
    """The same formula in float64 (reference.rope, with float64 angles), and the magnitude of
    the rotary's terms |n w| |cos| + |rotate_half(n w)| |sin| per element."""
    cos_sin = qkvfuse.rotary_cos_sin(MAX_POSITION, m["dim"], base=m["base"],
                                     dtype=torch.float64, device=qk.device)
    q, k = ref.rope(qk, num_heads=m["heads"], num_kv_heads=m["kv"], rotary_style="neox",
                    eps=EPS, weight_offset=m["offset"], cos_sin=cos_sin, positions=positions,
                    q_weight=q_weight, k_weight=k_weight)
    x = qk.double()
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    angles = cos_sin[positions][:, None]
    half = m["dim"] // 2
    cos = torch.cat((angles[..., :half], angles[..., :half]), dim=-1).abs()
    sin = torch.cat((angles[..., half:], angles[..., half:]), dim=-1).abs()
    terms = []
    for part, weight in ((n[:, : m["heads"]], q_weight), (n[:, m["heads"] :], k_weight)):
        nw = part * (weight.double() + m["offset"])
        terms.append(nw.abs() * cos + rotate_half(nw).abs() * sin)
    return (q, k), terms


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", list(MODELS))
def test_agrees_with_hf_and_is_closer_to_float64(device, model):
    m, qk, q_weight, k_weight, positions = model_inputs(model, device)
    ours_out = ours(m, qk, q_weight, k_weight, positions)
    hf_out = hf_forward(m, qk, q_weight, k_weight, positions)
    exact_out, terms = exact(m, qk, q_weight, k_weight, positions)
    for mine, theirs, want, term in zip(ours_out, hf_out, exact_out, terms):
        assert mine.dtype == theirs.dtype == BF16 and mine.shape == theirs.shape == want.shape
        # qkvfuse: one rounding of the float64 value (plus float32 arithmetic).
        assert_bf16_close(mine, want)
        # HF: within a few bf16 steps of the terms (it rounds up to 5 times, each <= 2^-8
        # relative; seen: 2.9), and so of qkvfuse.
        bound = 6 * 2**-8 * term + 1e-30
        assert ((theirs.double() - want).abs() <= bound).all()
        assert ((mine.double() - theirs.double()).abs() <= bound).all()
        # ... and qkvfuse is the closer to the exact value, by norm and on average.
        assert rel_error(mine, want) < rel_error(theirs, want)
        assert (mine.double() - want).abs().mean() < (theirs.double() - want).abs().mean()


@pytest.mark.parametrize("model", list(MODELS))
def test_bf16_cache_still_agrees(model):
    """A bf16 cos/sin cache (the angles rounded as HF rounds them) stays within HF's bounds."""
    m, qk, q_weight, k_weight, positions = model_inputs(model, "cpu")
    ours_out = ours(m, qk, q_weight, k_weight, positions, dtype=BF16)
    exact_out, terms = exact(m, qk, q_weight, k_weight, positions)
    for mine, want, term in zip(ours_out, exact_out, terms):
        assert ((mine.double() - want).abs() <= 2 * 2**-8 * term + 2**-9 * want.abs()).all()


@pytest.mark.parametrize("model", list(MODELS))
def test_gradients_match_hf_autograd(model):
    """The backward (qk and both weights) against autograd through HF's formulas in float64
    (HF's code is dtype-generic: float64 inputs keep it exact up to float64)."""
    m, qk, q_weight, k_weight, positions = model_inputs(model, "cpu")
    qk = qk.detach().requires_grad_()
    weights = [w.float().requires_grad_() for w in (q_weight, k_weight)]
    out = ours(m, qk, *weights, positions)
    grads_out = [torch.randn_like(t) for t in out]
    grads = torch.autograd.grad(out, (qk, *weights), grads_out)

    qk64 = qk.detach().double().requires_grad_()
    w64 = [w.detach().double().requires_grad_() for w in weights]
    q = m["norm"](qk64[:, : m["heads"]], w64[0], EPS)
    k = m["norm"](qk64[:, m["heads"] :], w64[1], EPS)
    inv_freq = qkvfuse.rotary_inv_freq(m["dim"], m["base"])
    freqs = positions[:, None].double() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    expected = torch.autograd.grad(hf_apply_rotary_pos_emb(q, k, emb.cos(), emb.sin()),
                                   (qk64, *w64), [g.double() for g in grads_out])
    assert_bf16_close(grads[0], expected[0])
    for grad, want in zip(grads[1:], expected[1:]):
        assert grad.dtype == torch.float32
        assert rel_error(grad, want) < 1e-5


# ---- transformers itself, when it is installed ---------------------------------------------------

def transformers_module(name):
    return pytest.importorskip(f"transformers.models.{name}.modeling_{name}")


def test_restated_formulas_equal_transformers():
    qwen3 = transformers_module("qwen3")
    gemma3 = transformers_module("gemma3")
    m, qk, q_weight, _, positions = model_inputs("qwen3", "cpu")
    x = qk[:, : m["heads"]]
    with torch.no_grad():
        norm = qwen3.Qwen3RMSNorm(m["dim"], eps=EPS).to(BF16)
        norm.weight.copy_(q_weight)
        assert torch.equal(norm(x), hf_qwen3_rms_norm(x, q_weight, EPS))
        gemma_norm = gemma3.Gemma3RMSNorm(m["dim"], eps=EPS).to(BF16)
        gemma_norm.weight.copy_(q_weight - 1)
        assert torch.equal(gemma_norm(x), hf_gemma3_rms_norm(x, q_weight - 1, EPS))
        assert torch.equal(qwen3.rotate_half(x), rotate_half(x))
        cos, sin = hf_cos_sin(hf_inv_freq(m["dim"], m["base"]), positions, BF16)
        k = qk[:, m["heads"] :]
        for a, b in zip(qwen3.apply_rotary_pos_emb(x, k, cos, sin),
                        hf_apply_rotary_pos_emb(x, k, cos, sin)):
            assert torch.equal(a, b)
        for a, b in zip(gemma3.apply_rotary_pos_emb(x, k, cos, sin),
                        hf_apply_rotary_pos_emb(x, k, cos, sin)):
            assert torch.equal(a, b)


def test_rotary_embedding_equals_transformers():
    """Qwen3RotaryEmbedding's cos/sin (float32 angles) against the restatement, and
    rotary_cos_sin's cache against both halves of HF's cos/sin."""
    qwen3 = transformers_module("qwen3")
    import transformers

    dim, base = 64, 1e6
    config = transformers.Qwen3Config(hidden_size=4 * dim, head_dim=dim, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=1024,
                                      rope_theta=base)
    embedding = qwen3.Qwen3RotaryEmbedding(config)
    positions = torch.arange(MAX_POSITION)
    cos, sin = embedding(torch.zeros(1), positions[None])
    cos_restated, sin_restated = hf_cos_sin(hf_inv_freq(dim, base), positions, torch.float32)
    assert torch.equal(cos[0], cos_restated) and torch.equal(sin[0], sin_restated)
    cache = qkvfuse.rotary_cos_sin(MAX_POSITION, dim, base=base)
    half = dim // 2
    # HF's angles are float32 products (|angle| < 512: error < 2^-15); the cache's are float64.
    for ours_part, theirs in ((cache[:, :half], cos[0]), (cache[:, half:], sin[0])):
        torch.testing.assert_close(ours_part, theirs[:, :half], atol=1e-4, rtol=0)
        torch.testing.assert_close(ours_part, theirs[:, half:], atol=1e-4, rtol=0)
