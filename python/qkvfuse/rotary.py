"""Builders of the rotary angle tables the rope ops read (SPEC.md sections 1 and 8), so that no
caller has to reverse-engineer their layout or sign convention. Angles are computed in float64 and
rounded once to the requested dtype.

Two conventions, both a rotation of each lane pair (a, b) = (n[d], n[partner(d)]) by an angle
theta = position * inv_freq[i]:

- rotary_cos_sin: the cache `cos_sin` [P, r] (columns [0, r/2) cos, [r/2, r) sin of frequency i)
  that qk_norm_rope(cos_sin=..., positions=...) reads. The op turns each pair by +theta:
  (a, b) -> (a cos - b sin, b cos + a sin), the convention of Hugging Face's apply_rotary_pos_emb
  (NeoX lanes, rotate_half) and GPT-J (interleaved lanes).
- speedrun_factor_tables: the per-token tables factor1, factor2 [T, D] ([T, 2D] paired) of the
  modded-nanogpt speedrun (SPEC.md section 1): factor1 = cos, factor2 = sin with the odd lanes
  negated, stationary lanes (d >= rotary_dim, or inv_freq 0) 1 and 0. The op computes
  y[d] = factor1[d] n[d] + factor2[d] n[d ^ 1], which turns each pair by -theta. (Either sign
  encodes relative positions, as long as queries and keys share it.)
- factor_tables_from_cos_sin: factor tables that reproduce a cos/sin cache exactly (+theta, either
  rotary style), e.g. to check one path against the other.

Context-extension scalings (linear/position interpolation, NTK, YaRN, Llama 3, LongRoPE) change
the frequencies and sometimes scale cos and sin: pass their inv_freq (e.g. what a Hugging Face
rope init function returns) and attention_scaling.
"""
from typing import Optional, Union

import torch


def rotary_inv_freq(rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    """The standard rotary frequencies base ** (-2i / r), i in [0, r/2): float64 [r/2] on the
    CPU (Hugging Face's default rope init, computed in float64)."""
    _check_rotary_dim(rotary_dim, "rotary_dim")
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    return base ** -exponent


def rotary_cos_sin(positions: Union[int, torch.Tensor], rotary_dim: Optional[int] = None, *,
                   base: float = 10000.0, inv_freq: Optional[torch.Tensor] = None,
                   attention_scaling: float = 1.0, dtype: torch.dtype = torch.float32,
                   device: Optional[torch.device] = None) -> torch.Tensor:
    """The cos/sin cache [P, r] of qk_norm_rope(cos_sin=..., positions=...) (SPEC.md section 8):
    row p holds cos(p * inv_freq[i]) in column i and sin(p * inv_freq[i]) in column r/2 + i, both
    times attention_scaling.

      positions          P (rows for positions 0..P-1), or a tensor of the P positions to tabulate
      rotary_dim         r, even; default 2 * len(inv_freq)
      base, inv_freq     the frequencies: inv_freq [r/2] if given (any scaling applied),
                         else rotary_inv_freq(r, base) (base = rope_theta)
      attention_scaling  multiplies cos and sin (YaRN's / LongRoPE's attention factor)
      dtype, device      of the result (bfloat16 or float32 for the ops)
    """
    inv_freq = _frequencies(rotary_dim, base, inv_freq, "rotary_dim")
    angle = _positions(positions)[:, None] * inv_freq
    table = torch.cat((angle.cos(), angle.sin()), dim=1) * attention_scaling
    return table.to(device=_device(positions, device), dtype=dtype)


def speedrun_factor_tables(positions: Union[int, torch.Tensor], head_dim: int,
                           rotary_dim: Optional[int] = None, *, paired: bool = False,
                           base: float = 10000.0, inv_freq: Optional[torch.Tensor] = None,
                           dtype: torch.dtype = torch.bfloat16,
                           device: Optional[torch.device] = None):
    """(factor1, factor2): the speedrun's interleaved rotary tables (SPEC.md section 1), [T, D],
    or [T, 2D] when paired.

    Plain: lane d < r of token t has theta = positions[t] * inv_freq[d // 2]; factor1 = cos(theta),
    factor2 = sin(theta) for even d and -sin(theta) for odd d; lanes d >= r are stationary
    (factor1 = 1, factor2 = 0).
    Paired: one rotary of width 2r over the rotary lanes of both D-wide halves of a [T, 2D] row
    (exactly a rotary on the [T, H/2, 2D] view when r = D): lane d of half h has frequency
    h * r/2 + d // 2, and inv_freq has r entries.

      positions       T (positions 0..T-1), or the positions [T] of packed sequences' tokens
                      (e.g. torch.arange(seq_len).repeat(batch))
      head_dim        D
      rotary_dim      r, even, in [0, D]; default D (rotary_dim of qk_norm_rope, which must match)
      base, inv_freq  the frequencies: inv_freq [R/2] (R = r, or 2r paired; zeros make lanes
                      stationary) if given, else base ** (-2i / R). examples/train_gpt.py's
                      tables are base = 1024.
      dtype, device   of the tables (bfloat16 or float32)
    """
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    _check_rotary_dim(rotary_dim, "rotary_dim")
    if not 0 <= rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim: expected an even value in [0, head_dim = {head_dim}], "
                         f"got {rotary_dim}")
    halves = 2 if paired else 1
    inv_freq = _frequencies(halves * rotary_dim, base, inv_freq, "rotary_dim (x2 when paired)")
    angle = _positions(positions)[:, None] * inv_freq
    tokens = angle.shape[0]
    lane = torch.arange(rotary_dim)
    sign = torch.where(lane % 2 == 1, -1.0, 1.0).double()
    factor1 = angle.new_ones((tokens, halves, head_dim))
    factor2 = angle.new_zeros((tokens, halves, head_dim))
    for half in range(halves):
        theta = angle[:, half * (rotary_dim // 2) + lane // 2]
        factor1[:, half, :rotary_dim] = theta.cos()
        factor2[:, half, :rotary_dim] = theta.sin() * sign
    out = dict(device=_device(positions, device), dtype=dtype)
    width = halves * head_dim
    return factor1.reshape(tokens, width).to(**out), factor2.reshape(tokens, width).to(**out)


def factor_tables_from_cos_sin(cos_sin: torch.Tensor, positions: torch.Tensor, head_dim: int,
                               rotary_style: str = "interleaved", *,
                               dtype: Optional[torch.dtype] = None):
    """(factor1, factor2) [T, D] with which the factor-table path computes what the cos/sin path
    computes from (cos_sin [P, r], positions [T]) in `rotary_style`: for a rotary lane d of
    frequency i, factor1 = cos_i and factor2 = -sin_i for the first lane of its pair (even d
    interleaved, d < r/2 NeoX), +sin_i for the second; lanes d >= r stationary (1, 0). dtype
    defaults to cos_sin's. Positions must lie in [0, P)."""
    rotary_dim = cos_sin.shape[1]
    _check_rotary_dim(rotary_dim, "cos_sin.shape[1]")
    if rotary_style not in ("interleaved", "neox"):
        raise ValueError(f"rotary_style: expected 'interleaved' or 'neox', got {rotary_style!r}")
    half = rotary_dim // 2
    lane = torch.arange(rotary_dim, device=cos_sin.device)
    if rotary_style == "neox":
        frequency, leads = lane % half if half else lane, lane < half
    else:
        frequency, leads = lane // 2, lane % 2 == 0
    rows = cos_sin.double()[positions.long()]
    cos, sin = rows[:, frequency], rows[:, half + frequency]
    factor1 = rows.new_ones((rows.shape[0], head_dim))
    factor2 = rows.new_zeros((rows.shape[0], head_dim))
    factor1[:, :rotary_dim] = cos
    factor2[:, :rotary_dim] = torch.where(leads, -sin, sin)
    dtype = cos_sin.dtype if dtype is None else dtype
    return factor1.to(dtype), factor2.to(dtype)


def _check_rotary_dim(rotary_dim, name):
    if rotary_dim < 0 or rotary_dim % 2:
        raise ValueError(f"{name}: expected an even rotary width >= 0, got {rotary_dim}")


def _frequencies(rotary_dim, base, inv_freq, name):
    """inv_freq as float64 [r/2], from the given vector or base and r."""
    if inv_freq is None:
        if rotary_dim is None:
            raise ValueError("rotary_dim or inv_freq is required")
        return rotary_inv_freq(rotary_dim, base)
    inv_freq = torch.as_tensor(inv_freq).detach().to("cpu", torch.float64).reshape(-1)
    if rotary_dim is not None and 2 * inv_freq.numel() != rotary_dim:
        raise ValueError(f"inv_freq: expected {rotary_dim // 2} frequencies ({name} = "
                         f"{rotary_dim}), got {inv_freq.numel()}")
    return inv_freq


def _device(positions, device):
    if device is not None:
        return torch.device(device)
    return positions.device if isinstance(positions, torch.Tensor) else torch.device("cpu")


def _positions(positions):
    """float64 positions [T] on the CPU, where the tables are computed."""
    if isinstance(positions, torch.Tensor):
        return positions.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
    return torch.arange(positions, dtype=torch.float64)
