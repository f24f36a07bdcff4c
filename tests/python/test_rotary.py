"""The rotary table builders (qkvfuse.rotary): the cos/sin cache's layout, the speedrun's factor
tables and their sign convention, checked through qk_norm_rope against the rotation formulas
written out here (GPT-J's interleaved rotate_every_two, NeoX's rotate_half) in float64."""
import importlib.util
from pathlib import Path

import pytest
import torch

import qkvfuse
import reference as ref
from conftest import assert_bf16_close

BF16 = torch.bfloat16
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"


def rotate_every_two(x):
    """GPT-J (transformers' modeling_gptj.rotate_every_two): (a, b) -> (-b, a) per lane pair."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def turned(n, theta, style):
    """n [T, H, r] turned by +theta [T, r/2] in float64: n cos + rotate(n) sin, with cos and sin
    laid out per lane as each style pairs them."""
    if style == "interleaved":
        cos = theta.cos().repeat_interleave(2, dim=-1)[:, None]
        sin = theta.sin().repeat_interleave(2, dim=-1)[:, None]
        return n * cos + rotate_every_two(n) * sin
    cos = torch.cat((theta.cos(), theta.cos()), dim=-1)[:, None]
    sin = torch.cat((theta.sin(), theta.sin()), dim=-1)[:, None]
    return n * cos + rotate_half(n) * sin


def normalized(qk):
    x = qk.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ref.EPS)


# ---- rotary_inv_freq, rotary_cos_sin -----------------------------------------------------------

def test_inv_freq_is_the_standard_one():
    inv_freq = qkvfuse.rotary_inv_freq(8, base=100.0)
    assert inv_freq.dtype == torch.float64
    torch.testing.assert_close(inv_freq, torch.tensor([1.0, 100 ** -0.25, 100 ** -0.5,
                                                       100 ** -0.75], dtype=torch.float64))


def test_cos_sin_layout():
    """Row p: cos(p f_i) in column i, sin(p f_i) in column r/2 + i; scaled by attention_scaling;
    a custom inv_freq (here position interpolation by 8) replaces base."""
    inv_freq = qkvfuse.rotary_inv_freq(16, base=1e6) / 8
    table = qkvfuse.rotary_cos_sin(40, inv_freq=inv_freq, attention_scaling=1.5,
                                   dtype=torch.float64)
    assert table.shape == (40, 16) and table.dtype == torch.float64
    theta = torch.arange(40, dtype=torch.float64)[:, None] * inv_freq
    torch.testing.assert_close(table[:, :8], 1.5 * theta.cos(), rtol=0, atol=1e-15)
    torch.testing.assert_close(table[:, 8:], 1.5 * theta.sin(), rtol=0, atol=1e-15)
    # Default dtype float32, positions as a tensor (any values: only those rows), bf16 rounded once.
    positions = torch.tensor([7, 3, 1000])
    part = qkvfuse.rotary_cos_sin(positions, 16, base=1e4)
    full = qkvfuse.rotary_cos_sin(1001, 16, base=1e4, dtype=torch.float64)
    assert part.dtype == torch.float32
    assert torch.equal(part, full[positions].float())
    assert torch.equal(qkvfuse.rotary_cos_sin(positions, 16, base=1e4, dtype=BF16),
                       full[positions].to(BF16))


def test_cos_sin_refuses_bad_widths():
    with pytest.raises(ValueError, match="rotary_dim: expected an even rotary width"):
        qkvfuse.rotary_cos_sin(4, 7)
    with pytest.raises(ValueError, match="inv_freq: expected 4 frequencies"):
        qkvfuse.rotary_cos_sin(4, 8, inv_freq=torch.ones(3))
    with pytest.raises(ValueError, match="rotary_dim or inv_freq is required"):
        qkvfuse.rotary_cos_sin(4)


@pytest.mark.parametrize("style", ["interleaved", "neox"])
@pytest.mark.parametrize("rotary_dim", [16, 6])
def test_cos_sin_turns_by_plus_theta(style, rotary_dim):
    """qk_norm_rope reading rotary_cos_sin turns each pair by +theta, as GPT-J (interleaved) and
    Hugging Face's rotate_half (NeoX) do; lanes past r pass through."""
    tokens, dim = 9, 16
    qk = torch.randn(tokens, 3, dim).to(BF16)
    positions = torch.randint(0, 100, (tokens,))
    cos_sin = qkvfuse.rotary_cos_sin(100, rotary_dim, base=500.0)
    q, k = qkvfuse.qk_norm_rope(qk, num_heads=2, num_kv_heads=1, rotary_style=style,
                                cos_sin=cos_sin, positions=positions)
    n = normalized(qk)
    theta = positions[:, None].double() * qkvfuse.rotary_inv_freq(rotary_dim, 500.0)
    expected = torch.cat((turned(n[..., :rotary_dim], theta, style), n[..., rotary_dim:]), -1)
    assert_bf16_close(q, expected[:, :2])
    assert_bf16_close(k, expected[:, 2:])


# ---- speedrun_factor_tables --------------------------------------------------------------------

def test_speedrun_tables_sign_convention():
    """SPEC.md section 1: factor1 = cos, factor2 = sin with the odd lanes negated; lanes past
    rotary_dim stationary (1, 0)."""
    f1, f2 = qkvfuse.speedrun_factor_tables(5, 12, 8, base=1024.0, dtype=torch.float64)
    assert f1.shape == f2.shape == (5, 12) and f1.dtype == torch.float64
    theta = torch.arange(5, dtype=torch.float64)[:, None] * qkvfuse.rotary_inv_freq(8, 1024.0)
    for i in range(4):
        assert torch.equal(f1[:, 2 * i], theta[:, i].cos())
        assert torch.equal(f1[:, 2 * i + 1], theta[:, i].cos())
        assert torch.equal(f2[:, 2 * i], theta[:, i].sin())
        assert torch.equal(f2[:, 2 * i + 1], -theta[:, i].sin())
    assert (f1[:, 8:] == 1).all() and (f2[:, 8:] == 0).all()


@pytest.mark.parametrize("rotary_dim", [16, 8, 0])
def test_speedrun_tables_turn_by_minus_theta(rotary_dim):
    """Through qk_norm_rope, the speedrun's tables turn each interleaved pair by -theta: the
    GPT-J rotation of the negated angle. The same as factor_tables_from_cos_sin of a cache at
    the negated positions."""
    tokens, dim = 7, 16
    qk = torch.randn(tokens, 4, dim).to(BF16)
    f1, f2 = qkvfuse.speedrun_factor_tables(tokens, dim, rotary_dim, base=1024.0,
                                            dtype=torch.float32)
    q, k = qkvfuse.qk_norm_rope(qk, f1, f2, 2, rotary_dim)
    n = normalized(qk)
    theta = -torch.arange(tokens, dtype=torch.float64)[:, None] * qkvfuse.rotary_inv_freq(
        rotary_dim, 1024.0)
    expected = torch.cat((turned(n[..., :rotary_dim], theta, "interleaved"),
                          n[..., rotary_dim:]), dim=-1)
    assert_bf16_close(q, expected[:, :2])
    assert_bf16_close(k, expected[:, 2:])
    if rotary_dim:
        negated = qkvfuse.rotary_cos_sin(-torch.arange(tokens), rotary_dim, base=1024.0,
                                         dtype=torch.float64)
        g1, g2 = qkvfuse.factor_tables_from_cos_sin(negated, torch.arange(tokens), dim)
        torch.testing.assert_close(f1, g1.float(), rtol=0, atol=1e-7)
        torch.testing.assert_close(f2, g2.float(), rtol=0, atol=1e-7)


def test_paired_tables_are_one_rotary_over_both_halves():
    """Paired [T, 2D] tables (r = D) are the plain tables of a 2D-wide head, and through
    qk_norm_rope they turn the [T, H/2, 2D] view of the normalized heads, then reshape it to
    [2T, H/2, D] (SPEC.md section 1)."""
    tokens, heads, dim = 6, 4, 8
    f1, f2 = qkvfuse.speedrun_factor_tables(tokens, dim, paired=True, base=1024.0,
                                            dtype=torch.float32)
    w1, w2 = qkvfuse.speedrun_factor_tables(tokens, 2 * dim, base=1024.0, dtype=torch.float32)
    assert f1.shape == (tokens, 2 * dim) and torch.equal(f1, w1) and torch.equal(f2, w2)
    qk = torch.randn(tokens, 2 * heads, dim).to(BF16)
    q, k = qkvfuse.qk_norm_rope(qk, f1, f2, heads, paired=True)
    n = normalized(qk).reshape(tokens, heads, 2 * dim)  # heads (2j, 2j+1) side by side
    theta = -torch.arange(tokens, dtype=torch.float64)[:, None] * qkvfuse.rotary_inv_freq(
        2 * dim, 1024.0)
    expected = turned(n, theta, "interleaved")
    half = heads // 2
    assert_bf16_close(q, expected[:, :half].reshape(2 * tokens, half, dim))
    assert_bf16_close(k, expected[:, half:].reshape(2 * tokens, half, dim))


def test_paired_partial_tables_rotate_each_halfs_lanes():
    """Paired with r < D: lane d < r of half h has frequency h * r/2 + d // 2; lanes >= r of
    each half are stationary."""
    f1, f2 = qkvfuse.speedrun_factor_tables(torch.tensor([3]), 8, 4, paired=True, base=10.0,
                                            dtype=torch.float64)
    inv_freq = qkvfuse.rotary_inv_freq(8, 10.0)  # 2r = 8 lanes: 4 frequencies
    expected_cos = [(3 * inv_freq[i]).cos().item() for i in (0, 0, 1, 1)]
    assert f1[0, :4].tolist() == expected_cos and (f1[0, 4:8] == 1).all()
    assert f1[0, 8:12].tolist() == [(3 * inv_freq[i]).cos().item() for i in (2, 2, 3, 3)]
    assert (f1[0, 12:] == 1).all() and (f2[0, 12:] == 0).all()


@pytest.mark.parametrize("mode", ["plain", "key_offset", "paired"])
def test_speedrun_tables_reproduce_the_example(mode):
    """examples/train_gpt.py's rotary_tables (packed sequences, base 1024) are
    speedrun_factor_tables(arange(seq_len).repeat(batch), ...)."""
    spec = importlib.util.spec_from_file_location("train_gpt_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    seq_len, batch, dim = 12, 3, 16
    rotary = dim // 2 if mode == "key_offset" else dim
    paired = mode == "paired"
    theirs = example.rotary_tables(seq_len, batch, 2 * dim if paired else dim,
                                   2 * rotary if paired else rotary, "cpu")
    ours = qkvfuse.speedrun_factor_tables(torch.arange(seq_len).repeat(batch), dim, rotary,
                                          paired=paired, base=1024.0)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype == BF16 and a.shape == b.shape
        # Both round the same float64 angle's cos/sin once (their frequencies may differ in the
        # last float64 bit).
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-8, atol=2**-12)


def test_speedrun_tables_refuse_bad_widths():
    with pytest.raises(ValueError, match="rotary_dim: expected an even rotary width"):
        qkvfuse.speedrun_factor_tables(4, 8, 3)
    with pytest.raises(ValueError, match=r"rotary_dim: expected an even value in \[0, head_dim"):
        qkvfuse.speedrun_factor_tables(4, 8, 10)
    with pytest.raises(ValueError, match="inv_freq: expected 8 frequencies"):
        qkvfuse.speedrun_factor_tables(4, 8, paired=True, inv_freq=torch.ones(4))


# ---- factor_tables_from_cos_sin ----------------------------------------------------------------

@pytest.mark.parametrize("style", ["interleaved", "neox"])
@pytest.mark.parametrize("rotary_dim", [16, 10])
def test_tables_from_cos_sin_match_the_cache_path(style, rotary_dim):
    """The factor-table path with tables built from a cache computes what the cache path
    computes, bit for bit (the same float32 products)."""
    tokens, dim = 11, 16
    qk = torch.randn(tokens, 6, dim).to(BF16)
    cos_sin = torch.randn(20, rotary_dim)
    positions = torch.randint(0, 20, (tokens,))
    f1, f2 = qkvfuse.factor_tables_from_cos_sin(cos_sin, positions, dim, style)
    assert f1.shape == (tokens, dim) and f1.dtype == torch.float32
    options = dict(num_heads=4, num_kv_heads=2, rotary_style=style, rotary_dim=rotary_dim)
    from_tables = qkvfuse.qk_norm_rope(qk, f1, f2, **options)
    from_cache = qkvfuse.qk_norm_rope(qk, cos_sin=cos_sin, positions=positions, **options)
    for a, b in zip(from_tables, from_cache):
        assert torch.equal(a, b)
