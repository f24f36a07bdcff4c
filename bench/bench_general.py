"""Side-by-side benchmark of the general layouts (SPEC.md section 8, issue 20): QK RMS-norm with a
learned weight + NeoX rotary from a cos/sin cache, forward and backward (the weights receive
gradients), bf16, at the model shapes, against what training users run today.

Models (their Hugging Face configs; the norm and rotary code path of transformers' attention):
  Qwen3-8B     Hq = 32, Hkv = 8, D = 128, rope_theta 1e6, RMSNorm * w        (Qwen3RMSNorm)
  Gemma3-12B   Hq = 16, Hkv = 8, D = 256, rope_theta 1e6 with the global layers' linear scaling
               (factor 8), RMSNorm * (1 + w)                                 (Gemma3RMSNorm)
               (the sliding-window layers' theta 1e4 and no scaling change no timing)
  Qwen3-0.6B   Hq = 16, Hkv = 8, D = 128, rope_theta 1e6, RMSNorm * w
The problem, for each model: T = 32768 tokens as 4 sequences of 8192 (positions 0..8191 repeated,
int64); qk = the Q and K columns of a [T, (Hq + 2 Hkv) D] bf16 projection output (strided views,
as a fused QKV projection leaves them); bf16 norm weights (Gemma's around 0 for 1 + w); eps 1e-6;
a bf16 cos/sin cache of 8192 positions with HF's frequencies (inv_freq = 1 / theta^(2i/D) in
float32, divided by the linear factor).

Implementations (rows `impl`):
  qkvfuse             qkvfuse.qk_norm_rope(qk, num_kv_heads=Hkv, rotary_style="neox", q_weight,
                      k_weight, weight_offset, eps, cos_sin, positions), fused kernels. Its
                      cache cos_sin [8192, D] comes from qkvfuse.rotary_cos_sin (HF's float32
                      inv_freq, angles in float64, rounded once to bf16) and is read at positions.
  eager HF chain      transformers' code for this part, restated below (hf_chain, which names
                      the source files; checked against transformers 5.25): split of the fused
                      projection (as a fused-QKV model splits it: torch.split), view to
                      [B, S, H, D], Qwen3RMSNorm / Gemma3RMSNorm (fp32 math, cast, weight), the
                      transposes to [B, H, S, D] in each model's order, apply_rotary_pos_emb with
                      rotate_half. cos, sin [B, S, D] bf16 are Qwen3RotaryEmbedding.forward's /
                      Gemma3RotaryEmbedding.forward's at position_ids [B, S]: a model computes
                      them once per forward and shares them across layers, so they are made
                      outside the timed region (in the baselines' favour: qkvfuse reads its cache
                      and the positions inside every timed call).
  torch.compile       torch.compile(the same chain, dynamic=False, fullgraph=True); the backward
                      is AOTAutograd's compiled backward. Compiled and warmed up before timing.
  Liger               Liger-Kernel's separate ops where its patches put them
                      (apply_liger_kernel_to_qwen3 / _gemma3_text): LigerRMSNormFunction on q and
                      on k (Qwen3: offset 0, casting "llama", in_place True; Gemma3: offset 1,
                      casting "gemma", in_place False), then LigerRopeFunction (the Triton
                      implementation liger_rotary_pos_emb dispatches to without the CuTe DSL) on
                      the [B, H, S, D] views with cos, sin [B, S, D]. Included in its time, since
                      a model pays them: the contiguous copies its ops make of strided inputs
                      (the fused projection's q/k columns; Gemma's norm input, which HF transposes
                      before the norm; Gemma's norm output, which Liger's rope transposes back to
                      [B, S, H, D]), and autograd's concatenation of grad q and grad k into
                      grad qk (torch.split's backward).
  Liger (dense q, k)  the same with q and k as separate contiguous tensors (separate q_proj and
                      k_proj, as HF's Qwen3 and Gemma3 have): no input copy for Qwen3's norm and
                      no gradient concatenation. Liger's best case at these shapes.
  axolotl             axolotl's fused RMSNorm + RoPE Triton kernel with its backward
                      (axolotl:src/axolotl/kernels/gemma4_fused_rope.py, fused_rms_norm_rope),
                      called as its Qwen3 and Gemma 4 attention patches call it: once on q, once
                      on k, as [B, S, H, D] views with its weight, HF's cos, sin [B, S, D] (the
                      whole head rotates) and eps, then transpose(1, 2). Gemma3's 1 + w is its
                      unit_offset=True (it scales by w + 1 in float32, as Gemma3RMSNorm does), so
                      every shape runs with the weights as they are. Included in its time, as for
                      Liger: its contiguous copy of the strided q/k columns, and the gradient
                      concatenation.
  axolotl (dense q, k)  the same on separate contiguous q and k (its patches' q_proj, k_proj).
  bytes floor         the minimum traffic at the copy bandwidth measured in the same run: forward
                      reads qk, the cache (P x D bf16), the positions and both weights once and
                      writes q and k once; backward reads grad q, grad k, qk, the cache, the
                      positions and the weights once and writes grad qk and both weight gradients
                      once; fwd+bwd is the sum.

Steps (rows `section`):
  general fwd       the forward alone: qkvfuse's registered op torch.ops.qkvfuse.qk_norm_rope
                    (what its autograd calls); the baselines' training forward (inputs and
                    weights require grad, so autograd records what the backward needs). Outputs
                    dropped.
  general bwd       the backward alone: qkvfuse's registered op torch.ops.qkvfuse.
                    qk_norm_rope_backward (grad qk and both weight gradients); the baselines'
                    torch.autograd.grad after a fresh forward, timed alone between CUDA events (the
                    forward enqueued first, then the L2 flushed as do_bench flushes it; median of
                    10-100 runs).
  general fwd+bwd   forward, then torch.autograd.grad of (q, k) with respect to qk (or q and k),
                    q_weight and k_weight, given grad q and grad k (random bf16, in the layout
                    each implementation's outputs have: [T, H, D] for qkvfuse, the [B, H, S, D]
                    transpose of a [B, S, H, D] buffer for the others, as FlashAttention's
                    backward returns them).
Columns: ms is the do_bench median (L2 flushed before every run, inputs rotated across copies
that exceed L2 as bench_torch.py's other sections do). do_bench's start event is recorded before
the call, so host time before the first kernel counts where it outlasts the flush (about 0.1 ms):
qkvfuse's fwd+bwd pays its Python autograd's launch latency there. GB/s is the step's floor bytes
/ ms; % copy is that against the measured copy bandwidth; x qkvfuse is ms / qkvfuse's ms of the
same step (above 1 qkvfuse is faster).

Before timing, every shape is checked once: q, k, grad qk and both weight gradients of qkvfuse,
torch.compile, Liger and axolotl against the eager HF chain, relative error ||a - b|| / ||b||
(in float64) below 1e-2 (HF rounds to bf16 between steps, qkvfuse and axolotl once: they differ by
a few bf16 steps). A failed check
is printed, recorded in the results' header ("general check") and makes the exit status 1.

Liger is imported from --liger-path (or $QKVFUSE_LIGER_PATH): a folder to put on sys.path (a pip
--target folder or Liger's src/), or a liger_kernel-*.whl, or a folder holding one (git-ignored
.whl/), which is installed first with pip --no-deps --no-index --target into a temporary folder;
without it, `import liger_kernel` as installed. When it does not import, its rows are left out
and the header says why.

axolotl's kernel is imported from --axolotl-path (or $QKVFUSE_AXOLOTL_PATH): its file, or a
folder holding it and an optional SOURCE line naming its origin (scripts/device_prepare.sh extracts
.seed/axolotl-kernel/gemma4_fused_rope.py and writes .seed/axolotl-kernel/SOURCE from the pinned
wheel); without it, `import axolotl.kernels.gemma4_fused_rope` as installed. It imports
liger_kernel, so it needs Liger too; when it does not import, its rows are left out and the header
says why.

  python bench/bench_general.py --out general.csv [--liger-path .whl]
      [--axolotl-path .seed/axolotl-kernel] [--models Qwen3-8B,...]
  python bench/bench_general.py --dry-run [--no-compile]   (CPU, tiny T: exercises every call)
bench_torch.py runs this section too (--sections general, in its default), into its own CSV.
The dry run imports Liger and axolotl and checks the signatures it calls, but does not run their
Triton kernels (Triton's interpreter runs Liger's rope, not its RMSNorm, which calls .to on a
Python float there; axolotl's backward asks CUDA for the SM count).
"""
import argparse
import datetime
import importlib.util
import inspect
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

import qkvfuse

BF16 = torch.bfloat16
EPS = 1e-6  # rms_norm_eps of all three configs
CHECK_TOLERANCE = 1e-2
SECTIONS = ("general fwd", "general bwd", "general fwd+bwd")
IMPLS = ("bytes floor", "qkvfuse", "eager HF chain", "torch.compile", "Liger",
         "Liger (dense q, k)", "axolotl", "axolotl (dense q, k)")


@dataclass(frozen=True)
class Model:
    name: str
    heads: int  # Hq
    kv_heads: int  # Hkv
    dim: int  # D
    theta: float  # rope_theta
    rope_factor: float  # linear scaling of the frequencies (1: none)
    family: str  # "qwen3" (RMSNorm * w) or "gemma3" (RMSNorm * (1 + w))

    @property
    def weight_offset(self):
        return 1.0 if self.family == "gemma3" else 0.0

    def label(self):
        return f"{self.name} Hq={self.heads} Hkv={self.kv_heads} D={self.dim}"

    def mode(self):
        return "neox 1+w cache" if self.weight_offset else "neox w cache"


MODELS = [
    Model("Qwen3-8B", 32, 8, 128, 1e6, 1.0, "qwen3"),
    Model("Gemma3-12B", 16, 8, 256, 1e6, 8.0, "gemma3"),
    Model("Qwen3-0.6B", 16, 8, 128, 1e6, 1.0, "qwen3"),
]


# ---- transformers' code for this part, restated ---------------------------------------------
# transformers:src/transformers/models/qwen3/modeling_qwen3.py (Qwen3RMSNorm.forward,
# Qwen3RotaryEmbedding, rotate_half, apply_rotary_pos_emb, Qwen3Attention.forward) and
# transformers:src/transformers/models/gemma3/modeling_gemma3.py (Gemma3RMSNorm.forward,
# Gemma3Attention.forward; the rotary functions are the same), transformers 5.25; the linear
# scaling (_compute_linear_scaling_rope_parameters in
# transformers:src/transformers/modeling_rope_utils.py) divides inv_freq by the factor.

def hf_inv_freq(model):
    """compute_default_rope_parameters (float32), then the linear scaling."""
    exponent = torch.arange(0, model.dim, 2, dtype=torch.int64).to(torch.float) / model.dim
    return 1.0 / (model.theta ** exponent) / model.rope_factor


def hf_cos_sin(inv_freq, position_ids, dtype):
    """Qwen3RotaryEmbedding.forward (attention_scaling 1): cos, sin [B, S, D] in x's dtype."""
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device, torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def qwen3_rms_norm(hidden_states, weight, eps):
    """Qwen3RMSNorm.forward."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def gemma3_rms_norm(x, weight, eps):
    """Gemma3RMSNorm.forward."""
    output = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    output = output * (1.0 + weight.float())
    return output.type_as(x)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def hf_chain(q, k, q_weight, k_weight, cos, sin, batch: int, family: str):
    """The attention's norm + rotary: q [T, Hq, D] and k [T, Hkv, D] (any strides) as the
    projections' .view(hidden_shape) [B, S, H, D]; returns q, k [B, H, S, D]."""
    q, k = q.unflatten(0, (batch, -1)), k.unflatten(0, (batch, -1))
    if family == "qwen3":  # Qwen3Attention.forward: norm, then transpose(1, 2)
        q = qwen3_rms_norm(q, q_weight, EPS).transpose(1, 2)
        k = qwen3_rms_norm(k, k_weight, EPS).transpose(1, 2)
    else:  # Gemma3Attention.forward: transpose(1, 2), then norm
        q = gemma3_rms_norm(q.transpose(1, 2), q_weight, EPS)
        k = gemma3_rms_norm(k.transpose(1, 2), k_weight, EPS)
    return apply_rotary_pos_emb(q, k, cos, sin)


def hf_chain_fused(qk, q_weight, k_weight, cos, sin, heads: int, kv_heads: int, batch: int,
                   family: str):
    """hf_chain on the fused projection's columns, split as a fused-QKV model splits them."""
    q, k = qk.split([heads, kv_heads], dim=1)
    return hf_chain(q, k, q_weight, k_weight, cos, sin, batch, family)


# ---- Liger-Kernel ----------------------------------------------------------------------------

@dataclass
class Liger:
    rms_norm: Callable  # LigerRMSNormFunction.apply
    rope: Callable  # LigerRopeFunction.apply
    version: str
    origin: str


# The positional parameters this bench passes, in order (checked at import: a renamed or moved
# parameter would otherwise be passed silently in the wrong place).
LIGER_SIGNATURES = {
    "LigerRMSNormFunction": ("ctx", "X", "W", "eps", "offset", "casting_mode", "in_place",
                             "row_mode"),
    "LigerRopeFunction": ("ctx", "q", "k", "cos", "sin", "position_ids", "unsqueeze_dim",
                          "rotary_dim"),
}


def install_wheel(wheel: Path) -> Path:
    """A pip --no-deps --no-index --target folder holding the wheel's packages (reused)."""
    target = Path(tempfile.gettempdir()) / f"qkvfuse-bench-{wheel.stem}"
    if not (target / "liger_kernel").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                        "--target", str(target), str(wheel)], check=True)
    return target


def load_liger(path) -> tuple:
    """(Liger, None), or (None, why it is not there)."""
    origin = "installed"
    if path:
        path = Path(path)
        wheels = sorted(path.glob("liger_kernel-*.whl")) if path.is_dir() else []
        if path.is_file() and path.suffix == ".whl":
            wheels = [path]
        try:
            folder = install_wheel(wheels[-1]) if wheels else path
        except (OSError, subprocess.CalledProcessError) as error:
            return None, f"not installed from {wheels[-1]}: {error}"
        sys.path.insert(0, str(folder))
        origin = f"{wheels[-1].name} -> {folder}" if wheels else str(folder)
    try:
        import liger_kernel
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.rope import LigerRopeFunction
    except Exception as error:  # ImportError, or whatever its import raised on this machine
        return None, f"not importable ({type(error).__name__}: {error})"
    for cls in (LigerRMSNormFunction, LigerRopeFunction):
        names = tuple(inspect.signature(cls.forward).parameters)
        want = LIGER_SIGNATURES[cls.__name__]
        if names[: len(want)] != want:
            return None, f"{cls.__name__}.forward{names} is not the expected {want}"
    try:
        from importlib.metadata import version
        liger_version = version("liger_kernel")
    except Exception:  # no dist-info on the path (a source tree)
        liger_version = getattr(liger_kernel, "__version__", "unknown version")
    origin += f" ({Path(liger_kernel.__file__).parent})"
    return Liger(LigerRMSNormFunction.apply, LigerRopeFunction.apply, liger_version, origin), None


def liger_chain(q, k, q_weight, k_weight, cos, sin, batch: int, family: str, liger: Liger):
    """hf_chain with Liger's ops in place of the norm modules and apply_rotary_pos_emb."""
    q, k = q.unflatten(0, (batch, -1)), k.unflatten(0, (batch, -1))
    if family == "qwen3":
        # LigerRMSNorm(head_dim, eps): offset 0, casting "llama", in_place True, row_mode None.
        q = liger.rms_norm(q, q_weight, EPS, 0.0, "llama", True, None).transpose(1, 2)
        k = liger.rms_norm(k, k_weight, EPS, 0.0, "llama", True, None).transpose(1, 2)
    else:
        # LigerRMSNormForGemma3(head_dim, eps): offset 1, casting "gemma", in_place False.
        q = liger.rms_norm(q.transpose(1, 2), q_weight, EPS, 1.0, "gemma", False, None)
        k = liger.rms_norm(k.transpose(1, 2), k_weight, EPS, 1.0, "gemma", False, None)
    # liger_rotary_pos_emb(q, k, cos, sin) -> dispatch("rope") -> the Triton implementation:
    # LigerRopeFunction.apply(q, k, cos, sin, position_ids, unsqueeze_dim, rotary_dim).
    return liger.rope(q, k, cos, sin, None, 1, None)


# ---- axolotl's fused RMSNorm + RoPE kernel -----------------------------------------------------

@dataclass
class Axolotl:
    fused_rms_norm_rope: Callable  # (x [B, S, H, D], weight [D], cos, sin [B, S, n_rot], eps,
    #                                 unit_offset) -> [B, S, H, D]
    origin: str


AXOLOTL_MODULE = "axolotl.kernels.gemma4_fused_rope"
AXOLOTL_SIGNATURE = ("x", "weight", "cos", "sin", "eps", "unit_offset")


def load_axolotl(path) -> tuple:
    """(Axolotl, None), or (None, why it is not there). Call after load_liger: the kernel imports
    liger_kernel's helpers. The file is loaded once per process (importing registers its
    torch.library ops, which a second import would register again)."""
    try:
        if path:
            path = Path(path)
            # A folder holds the module's file under its own name.
            file = path / (AXOLOTL_MODULE.rsplit(".", 1)[1] + ".py") if path.is_dir() else path
            if not file.is_file():
                return None, f"not found: no {file}"
            source = file.parent / "SOURCE"
            origin = (source.read_text().strip() if source.is_file() else "") + f" ({file})"
            module = sys.modules.get(AXOLOTL_MODULE)
            if module is None:
                spec = importlib.util.spec_from_file_location(AXOLOTL_MODULE, file)
                module = importlib.util.module_from_spec(spec)
                sys.modules[AXOLOTL_MODULE] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[AXOLOTL_MODULE]
                    raise
        else:
            import axolotl.kernels.gemma4_fused_rope as module
            origin = f"installed ({module.__file__})"
    except Exception as error:  # a missing file, liger_kernel missing, an older torch.library
        return None, f"not importable ({type(error).__name__}: {error})"
    names = tuple(inspect.signature(module.fused_rms_norm_rope).parameters)
    if names != AXOLOTL_SIGNATURE:
        return None, f"fused_rms_norm_rope{names} is not the expected {AXOLOTL_SIGNATURE}"
    return Axolotl(module.fused_rms_norm_rope, origin.strip()), None


def axolotl_chain(q, k, q_weight, k_weight, cos, sin, batch: int, family: str,
                  axolotl: Axolotl):
    """hf_chain with axolotl's kernel, as its attention patches call it
    (axolotl:src/axolotl/monkeypatch/models/qwen3/fused_attn.py): on the [B, S, H, D] views,
    then transpose(1, 2). The kernel flattens x to rows of D (a copy where x is strided) and
    reads cos, sin as [B * S, n_rot] rows; n_rot = D here (HF's full-width cos, sin). Gemma3's
    norm runs after the transpose in HF and before it here: it is per row, the same math."""
    q, k = q.unflatten(0, (batch, -1)), k.unflatten(0, (batch, -1))
    unit_offset = family == "gemma3"  # weight * (w + 1); Qwen3: weight * w
    return tuple(axolotl.fused_rms_norm_rope(x, w, cos, sin, eps=EPS, unit_offset=unit_offset)
                 .transpose(1, 2) for x, w in ((q, q_weight), (k, k_weight)))


# ---- the problem and the implementations ----------------------------------------------------

class Problem:
    """One model's shared inputs: positions, both angle sources, the norm weights (leaves)."""

    def __init__(self, model: Model, batch: int, seq_len: int, device):
        self.model, self.batch, self.seq_len, self.device = model, batch, seq_len, device
        self.tokens = batch * seq_len
        m = model
        self.positions = torch.arange(seq_len, device=device).repeat(batch)  # int64 [T]
        inv_freq = hf_inv_freq(m)
        # qkvfuse's cache [P, D]: cos of frequency i in column i, sin in column D/2 + i.
        self.cos_sin = qkvfuse.rotary_cos_sin(seq_len, m.dim, inv_freq=inv_freq, dtype=BF16,
                                              device=device)
        # HF's cos, sin [B, S, D] at position_ids, made once per model forward.
        self.cos, self.sin = hf_cos_sin(inv_freq, self.positions.view(batch, seq_len), BF16)
        center = 0.0 if m.weight_offset else 1.0
        self.q_weight = (center + 0.1 * torch.randn(m.dim, device=device)).to(BF16)
        self.k_weight = (center + 0.1 * torch.randn(m.dim, device=device)).to(BF16)
        self.q_weight.requires_grad_()
        self.k_weight.requires_grad_()
        self.layout = qkvfuse.ops.rope_layout(
            m.heads, num_kv_heads=m.kv_heads, rotary_style="neox", q_weight=self.q_weight,
            k_weight=self.k_weight, weight_offset=m.weight_offset, eps=EPS,
            cos_sin=self.cos_sin, positions=self.positions)

    def make_set(self, dense: bool):
        """(qk, grad_q, grad_k, q_dense, k_dense): qk the strided Q/K columns of a fresh
        [T, (Hq + 2 Hkv) D] projection output (a leaf requiring grad), bf16 output gradients
        [T, H, D], and (dense) q and k as separate contiguous leaves holding the same values."""
        m, tokens = self.model, self.tokens
        qkv = torch.randn(tokens, (m.heads + 2 * m.kv_heads) * m.dim, device=self.device)
        qkv = qkv.to(BF16)
        qk = qkv[:, : (m.heads + m.kv_heads) * m.dim].view(tokens, m.heads + m.kv_heads, m.dim)
        qk = qk.detach().requires_grad_()
        grad_q = torch.randn(tokens, m.heads, m.dim, device=self.device).to(BF16)
        grad_k = torch.randn(tokens, m.kv_heads, m.dim, device=self.device).to(BF16)
        q_dense = k_dense = None
        if dense:
            q_dense = qk.detach()[:, : m.heads].contiguous().requires_grad_()
            k_dense = qk.detach()[:, m.heads :].contiguous().requires_grad_()
        return qk, grad_q, grad_k, q_dense, k_dense

    def hf_grads(self, grad_q, grad_k):
        """The output gradients in the layout of the HF-shaped outputs [B, H, S, D]: transposes
        of [B, S, H, D] buffers (FlashAttention's dq, dk), the same values as qkvfuse's."""
        return tuple(g.unflatten(0, (self.batch, -1)).transpose(1, 2) for g in (grad_q, grad_k))

    def to_tokens(self, t):
        """[B, H, S, D] -> [T, H, D] (a copy), to compare with qkvfuse's outputs."""
        return t.transpose(1, 2).reshape(self.tokens, t.shape[1], t.shape[3])

    def floor_bytes(self):
        """{step: minimum bytes}: each input read once, each output written once."""
        m = self.model
        qk = self.tokens * (m.heads + m.kv_heads) * m.dim * 2
        angles = self.cos_sin.numel() * self.cos_sin.element_size() + self.positions.numel() * 8
        weights = 2 * m.dim * 2
        forward = 2 * qk + angles + weights
        backward = 3 * qk + angles + 2 * weights
        return {"general fwd": forward, "general bwd": backward,
                "general fwd+bwd": forward + backward}


class Impl:
    """One implementation on a Problem's input sets (Problem.make_set tuples).

    forward(s) -> its outputs, through autograd; inputs(s): what autograd differentiates;
    grads(s): the output gradients in its layout; forward_op(s), backward_op(s): the forward and
    the backward alone as registered ops, where they are (else the forward is timed through
    autograd and the backward after a fresh forward); tokens(outputs) -> (q [T, Hq, D],
    k [T, Hkv, D]); grad_qk(grads) -> (grad qk [T, Hq + Hkv, D], grad q_weight, grad k_weight)."""

    def __init__(self, name, forward, inputs, grads, tokens, grad_qk=lambda g: g,
                 forward_op=None, backward_op=None):
        self.name, self.forward, self.inputs, self.grads = name, forward, inputs, grads
        self.tokens, self.grad_qk = tokens, grad_qk
        self.forward_op, self.backward_op = forward_op, backward_op

    def step(self, s):
        return torch.autograd.grad(self.forward(s), self.inputs(s), self.grads(s))


def implementations(p: Problem, liger: Optional[Liger], axolotl: Optional[Axolotl],
                    compile_chain: bool):
    m = p.model
    weights = (p.q_weight, p.k_weight)
    angles = (p.cos, p.sin)

    def qkvfuse_forward(s):
        return qkvfuse.qk_norm_rope(
            s[0], num_heads=m.heads, num_kv_heads=m.kv_heads, rotary_style="neox",
            q_weight=p.q_weight, k_weight=p.k_weight, weight_offset=m.weight_offset, eps=EPS,
            cos_sin=p.cos_sin, positions=p.positions)

    # The registered ops alone (what qkvfuse's autograd calls), without autograd: the inputs
    # require grad, so under no_grad.
    def qkvfuse_forward_op(s):
        with torch.no_grad():
            return torch.ops.qkvfuse.qk_norm_rope(s[0], *p.layout)

    def qkvfuse_backward_op(s):
        with torch.no_grad():
            return torch.ops.qkvfuse.qk_norm_rope_backward(s[1], s[2], s[0], *p.layout)

    def hf_tokens(outputs):
        return tuple(p.to_tokens(t) for t in outputs)

    def fused(chain):
        return lambda s: chain(s[0], *weights, *angles, m.heads, m.kv_heads, p.batch, m.family)

    fused_inputs = lambda s: (s[0], *weights)  # noqa: E731
    dense_inputs = lambda s: (s[3], s[4], *weights)  # noqa: E731
    hf_grads = lambda s: p.hf_grads(s[1], s[2])  # noqa: E731
    dense_grad_qk = lambda g: (torch.cat((g[0], g[1]), dim=1), *g[2:])  # noqa: E731
    impls = [
        Impl("qkvfuse", qkvfuse_forward, fused_inputs, lambda s: (s[1], s[2]), tuple,
             forward_op=qkvfuse_forward_op, backward_op=qkvfuse_backward_op),
        Impl("eager HF chain", fused(hf_chain_fused), fused_inputs, hf_grads, hf_tokens),
    ]
    if compile_chain:
        compiled = torch.compile(hf_chain_fused, dynamic=False, fullgraph=True)
        impls.append(Impl("torch.compile", fused(compiled), fused_inputs, hf_grads, hf_tokens))
    if axolotl is not None:  # before Liger, whose backward writes into the output gradients
        def axolotl_fused(qk, q_weight, k_weight, cos, sin, heads, kv_heads, batch, family):
            q, k = qk.split([heads, kv_heads], dim=1)
            return axolotl_chain(q, k, q_weight, k_weight, cos, sin, batch, family, axolotl)

        def axolotl_dense(s):
            return axolotl_chain(s[3], s[4], *weights, *angles, p.batch, m.family, axolotl)

        impls.append(Impl("axolotl", fused(axolotl_fused), fused_inputs, hf_grads, hf_tokens))
        impls.append(Impl("axolotl (dense q, k)", axolotl_dense, dense_inputs, hf_grads,
                          hf_tokens, grad_qk=dense_grad_qk))
    if liger is not None:
        def liger_fused(qk, q_weight, k_weight, cos, sin, heads, kv_heads, batch, family):
            q, k = qk.split([heads, kv_heads], dim=1)
            return liger_chain(q, k, q_weight, k_weight, cos, sin, batch, family, liger)

        def liger_dense(s):
            return liger_chain(s[3], s[4], *weights, *angles, p.batch, m.family, liger)

        impls.append(Impl("Liger", fused(liger_fused), fused_inputs, hf_grads, hf_tokens))
        impls.append(Impl("Liger (dense q, k)", liger_dense, dense_inputs, hf_grads, hf_tokens,
                          grad_qk=dense_grad_qk))
    return impls


# ---- the check ------------------------------------------------------------------------------

def rel_error(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def outputs_and_grads(impl: Impl, s):
    """(q, k, grad qk, grad q_weight, grad k_weight) in qkvfuse's layout, from fresh copies of
    the output gradients (Liger's backward writes into them)."""
    outputs = impl.forward(s)
    grads = torch.autograd.grad(outputs, impl.inputs(s), [g.clone() for g in impl.grads(s)])
    return (*impl.tokens(outputs), *impl.grad_qk(grads))


def error_text(error):
    """An exception in one short line (it goes into a results header)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:160] if text else ''}".replace("|", "/")


def check(p: Problem, impls, s, raised):
    """(passed, one line): every implementation against the eager HF chain, and qkvfuse's cache
    against HF's cos/sin. An implementation that raises is named in `raised` (name -> message)
    and fails the check."""
    names = ("q", "k", "grad_qk", "grad_q_weight", "grad_k_weight")
    reference = {i.name: i for i in impls}["eager HF chain"]
    want = [t.detach() for t in outputs_and_grads(reference, s)]
    passed, parts = True, []
    for impl in impls:
        if impl is reference:
            continue
        try:
            got = outputs_and_grads(impl, s)
        except Exception as error:  # e.g. a baseline's kernels on this GPU / Triton version
            traceback.print_exc()
            raised[impl.name] = error_text(error)
            passed = False
            parts.append(f"{impl.name} FAILED ({raised[impl.name]})")
            continue
        errors = [rel_error(a, b) for a, b in zip(got, want)]
        worst = max(range(len(errors)), key=lambda i: errors[i])
        ok = all(e < CHECK_TOLERANCE for e in errors)  # NaN fails too
        passed &= ok
        parts.append(f"{impl.name} {'ok' if ok else 'FAILED'} (max rel err "
                     f"{errors[worst]:.1e} in {names[worst]})")
    half = p.model.dim // 2
    cache = p.cos_sin[p.positions].view(p.batch, p.seq_len, -1).float()
    diff = max((cache[..., :half] - p.cos[..., :half].float()).abs().max().item(),
               (cache[..., half:] - p.sin[..., :half].float()).abs().max().item())
    cache_ok = diff <= 2.0**-7  # one bf16 step below 1: HF's angles are float32 products
    passed &= cache_ok
    parts.append(f"cache vs HF cos/sin {'ok' if cache_ok else 'FAILED'} (max diff {diff:.1e})")
    return passed, f"{p.model.name}: " + "; ".join(parts)


# ---- timing ---------------------------------------------------------------------------------

def cpu_median_ms(fn, reps=3):
    """The dry run's stand-in for do_bench: a median of a few wall-clock runs."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def cpu_split_ms(prepare, fn, reps=3):
    """cpu_median_ms of fn(prepare()) without prepare's time."""
    fn(prepare())
    times = []
    for _ in range(reps):
        state = prepare()
        start = time.perf_counter()
        fn(state)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def cuda_split_ms(prepare, fn, target_ms=200.0):
    """Median GPU time of fn(prepare()) alone, do_bench's way: before each run prepare's work is
    enqueued and then the L2 flushed (a 256 MB memset, as do_bench does), then CUDA events
    around fn alone. For the backward after a fresh forward: a backward over a retained graph
    is not an option for torch.compile (AOTAutograd's donated buffers refuse retain_graph)."""
    flush = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")

    def once(events):
        state = prepare()
        flush.zero_()
        events[0].record()
        fn(state)
        events[1].record()
        del state

    def new_events():
        return [torch.cuda.Event(enable_timing=True) for _ in range(2)]

    probe = new_events()
    once(probe)  # warm-up (the first call of a compiled function may still set up)
    once(probe)
    torch.cuda.synchronize()
    reps = max(10, min(100, int(target_ms / max(probe[0].elapsed_time(probe[1]), 1e-3))))
    runs = [new_events() for _ in range(reps)]
    for events in runs:
        once(events)
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in runs)


@dataclass
class Timers:
    median: Callable  # median ms of fn()
    split: Callable  # median ms of fn(prepare()) without prepare
    cycle: Callable  # bench_torch.cycle: a closure over the rotated input sets


def time_impl(impl: Impl, sets, timers: Timers):
    """{section: ms} of one implementation."""
    cycle = timers.cycle
    forward = impl.forward_op or impl.forward
    result = {"general fwd": timers.median(cycle(sets, lambda *s: forward(s))),
              "general fwd+bwd": timers.median(cycle(sets, lambda *s: impl.step(s)))}
    if impl.backward_op is not None:
        result["general bwd"] = timers.median(cycle(sets, lambda *s: impl.backward_op(s)))
    else:
        result["general bwd"] = timers.split(
            cycle(sets, lambda *s: (impl.forward(s), s)),
            lambda state: torch.autograd.grad(state[0], impl.inputs(state[1]),
                                              impl.grads(state[1])))
    return result


def bench_model(model: Model, args, liger, axolotl, copy_gbs, timers, make_sets, row_type):
    """(rows, check passed, check line) for one model."""
    p = Problem(model, args.batch, args.seq_len, args.device)
    sets = make_sets(lambda: p.make_set(dense=liger is not None or axolotl is not None))
    impls = implementations(p, liger, axolotl, not args.no_compile)
    raised = {}  # implementation -> its exception, in one line: no rows for it
    passed, line = check(p, impls, sets[0], raised)
    print(f"check {line}", flush=True)
    times = {}
    # Liger last: its backward writes into the output gradients it is given.
    for impl in [i for i in impls if i.name not in raised]:
        try:
            times[impl.name] = time_impl(impl, sets, timers)
        except Exception as error:  # one implementation's failure costs its rows, not the run
            traceback.print_exc()
            raised[impl.name] = error_text(error)
            passed = False
            line += f"; {impl.name} FAILED while timed ({raised[impl.name]})"
            continue
        print(f"  {model.name} {impl.name}: " + ", ".join(
            f"{s.split()[-1]} {ms:.4f} ms" for s, ms in times[impl.name].items()), flush=True)
    impls = [i for i in impls if i.name in times]
    if "qkvfuse" not in times:
        return [], False, line
    floor = p.floor_bytes()
    rows = []
    for section in SECTIONS:
        base = times["qkvfuse"][section]
        floor_ms = floor[section] / copy_gbs / 1e6
        entries = [("bytes floor", floor_ms)] + [(i.name, times[i.name][section]) for i in impls]
        for impl, ms in entries:
            gbs = floor[section] / ms / 1e6
            rows.append(row_type(section, model.label(), model.mode(), impl, ms, gbs, "GB/s",
                                 100 * gbs / copy_gbs, ms / base))
    return rows, passed, line


def run(args, copy_gbs, timers, make_sets, row_type):
    """(rows, header entries, all checks passed) for every model of args.models."""
    liger, why = load_liger(args.liger_path)
    if liger is None:
        print(f"Liger rows left out: Liger-Kernel {why}", flush=True)
    elif args.device == "cpu":
        why = (f"liger-kernel {liger.version} from {liger.origin}: imported, signatures as "
               f"expected; not run (its Triton kernels need a GPU)")
        print(f"Liger rows left out: {why}", flush=True)
        liger = None
    axolotl, axolotl_why = load_axolotl(args.axolotl_path)
    if axolotl is None:
        print(f"axolotl rows left out: its kernel is {axolotl_why}", flush=True)
        axolotl_why = f"its kernel is {axolotl_why}"
    elif args.device == "cpu":
        axolotl_why = (f"{axolotl.origin}: imported, signature as expected; not run (its Triton "
                       f"kernels need a GPU)")
        print(f"axolotl rows left out: {axolotl_why}", flush=True)
        axolotl = None
    wanted = [name for name in args.models.split(",") if name]
    unknown = set(wanted) - {m.name for m in MODELS}
    if unknown:
        raise SystemExit(f"unknown models {sorted(unknown)}; known: {[m.name for m in MODELS]}")
    rows, lines, passed = [], [], True
    for model in [m for m in MODELS if m.name in wanted]:
        model_rows, ok, line = bench_model(model, args, liger, axolotl, copy_gbs, timers,
                                           make_sets, row_type)
        rows += model_rows
        lines.append(line)
        passed &= ok
        if args.device == "cuda":
            torch.cuda.empty_cache()
    header = {
        "general problem": f"T = {args.batch} x {args.seq_len} tokens (positions "
                           f"0..{args.seq_len - 1} per sequence, int64), qk = Q/K columns of "
                           f"the [T, (Hq + 2 Hkv) D] projection, bf16, eps {EPS}, weights bf16 "
                           f"with gradients",
        "general check": ("passed: " if passed else "FAILED: ") + " | ".join(lines),
        "liger": f"liger-kernel {liger.version} from {liger.origin}" if liger else why,
        "axolotl": f"fused_rms_norm_rope from {axolotl.origin}" if axolotl else axolotl_why,
    }
    return rows, header, passed


def section_args(liger_path, axolotl_path=None, device="cuda"):
    """The options run() reads, at their defaults (bench_torch.py's --sections general)."""
    return argparse.Namespace(liger_path=liger_path, axolotl_path=axolotl_path,
                              models=",".join(m.name for m in MODELS), no_compile=False, batch=4,
                              seq_len=8192, device=device)


def main_arguments(parser):
    """The options of a stand-alone run (bench_families.py takes them too): output, commit, the
    CPU dry run, the shape and the memory for rotated copies."""
    parser.add_argument("--out", help="results file: *.md for markdown, else CSV (required on "
                                      "the GPU)")
    parser.add_argument("--commit", help="git commit to record (default: git rev-parse HEAD)")
    parser.add_argument("--dry-run", action="store_true",
                        help="on the CPU at a tiny T: every call once, timings meaningless")
    parser.add_argument("--batch", type=int, help="sequences (default 4; 2 with --dry-run)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence = cache rows (default "
                                                    "8192; 16 with --dry-run)")
    parser.add_argument("--budget-gib", type=int, default=16,
                        help="device memory for rotated input copies")


def add_arguments(parser):
    """The options run() reads beyond section_args's (device, batch and seq_len come from
    main's)."""
    parser.add_argument("--liger-path", default=os.environ.get("QKVFUSE_LIGER_PATH"),
                        help="Liger-Kernel: a folder for sys.path, a liger_kernel-*.whl or a "
                             "folder holding one (default $QKVFUSE_LIGER_PATH, else as installed)")
    parser.add_argument("--axolotl-path", default=os.environ.get("QKVFUSE_AXOLOTL_PATH"),
                        help="axolotl's fused RMSNorm + RoPE kernel: its file or a folder "
                             "holding it, e.g. .seed/axolotl-kernel (default "
                             "$QKVFUSE_AXOLOTL_PATH, else as installed; it needs Liger-Kernel)")
    parser.add_argument("--models", default=",".join(m.name for m in MODELS),
                        help="comma-separated subset of " + ",".join(m.name for m in MODELS))
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")


def summary_lines(rows, copy_gbs):
    """A short table: per model, the floor, qkvfuse per step, each baseline's fwd+bwd with its
    ratio, and the issue's targets."""
    by = {(r.shape, r.section, r.impl): r for r in rows if r.section in SECTIONS}
    shapes = list(dict.fromkeys(r.shape for r in rows if r.section in SECTIONS))
    baselines = [i for i in IMPLS[2:] if any(k[2] == i for k in by)]
    lines = [f"general layouts, fwd+bwd unless said (ms; x = time / qkvfuse's; copy "
             f"{copy_gbs:.0f} GB/s)"]
    head = ["shape", "floor", "qkvfuse fwd", "bwd", "fwd+bwd"] + baselines
    table = []
    for shape in shapes:
        cells = [shape.split()[0], f"{by[(shape, SECTIONS[2], 'bytes floor')].ms:.3f}"]
        for section in SECTIONS:
            r = by[(shape, section, "qkvfuse")]
            cells.append(f"{r.ms:.3f} ({r.pct_copy:.0f}%)")
        for impl in baselines:
            r = by.get((shape, SECTIONS[2], impl))
            cells.append(f"{r.ms:.3f} ({r.vs_qkvfuse:.2f}x)" if r else "-")
        table.append(cells)
    widths = [max(len(c[i]) for c in [head] + table) for i in range(len(head))]
    for cells in [head] + table:
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
    for shape in shapes:
        q = {s: by[(shape, s, "qkvfuse")] for s in SECTIONS}
        targets = [f"fwd {q[SECTIONS[0]].pct_copy:.0f}% copy (>= 88)",
                   f"bwd {q[SECTIONS[1]].pct_copy:.0f}% (>= 88)"]
        for impl, want in (("torch.compile", 3), ("Liger", 5)):
            r = by.get((shape, SECTIONS[2], impl))
            if r:
                targets.append(f"{impl} {r.vs_qkvfuse:.2f}x (>= {want})")
        met = (q[SECTIONS[0]].pct_copy >= 88 and q[SECTIONS[1]].pct_copy >= 88 and all(
            by[(shape, SECTIONS[2], impl)].vs_qkvfuse >= want for impl, want in
            (("torch.compile", 3), ("Liger", 5)) if (shape, SECTIONS[2], impl) in by))
        lines.append(f"targets {shape.split()[0]}: {', '.join(targets)}: "
                     f"{'met' if met else 'NOT met'}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    main_arguments(parser)
    add_arguments(parser)
    args = parser.parse_args()
    args.batch = args.batch or (2 if args.dry_run else 4)
    args.seq_len = args.seq_len or (16 if args.dry_run else 8192)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_torch as common  # timing, rotation, rows and output of the other sections

    torch.manual_seed(0)
    if args.dry_run:
        args.device = "cpu"
        nbytes = 64 << 20
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        copy_gbs = 2 * nbytes / cpu_median_ms(lambda: dst.copy_(src)) / 1e6
        timers = Timers(cpu_median_ms, cpu_split_ms, common.cycle)
        make_sets = lambda make: [make(), make()]  # noqa: E731  (two, so cycling runs)
    else:
        if not args.out:
            parser.error("--out is required on the GPU")
        if not torch.cuda.is_available():
            raise SystemExit("bench_general.py needs a CUDA device (or --dry-run)")
        args.device = "cuda"
        props = torch.cuda.get_device_properties(0)
        l2_bytes = getattr(props, "L2_cache_size", 64 << 20)
        copy_gbs = common.copy_bandwidth_gbs("cuda")
        timers = Timers(common.median_ms, cuda_split_ms, common.cycle)
        make_sets = lambda make: common.rotating(make, l2_bytes, args.budget_gib << 30)  # noqa

    rows, general_header, passed = run(args, copy_gbs, timers, make_sets, common.Row)
    if args.out:
        header = {
            "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (dry run)",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": common.git_commit(args.commit),
            "torch": torch.__version__,
            "triton": common.triton.__version__,
            "tokens": args.batch * args.seq_len,
            "copy bandwidth (2 GiB buffer, read + write)": f"{copy_gbs:.0f} GB/s",
            "timing": "triton.testing.do_bench median; L2 flushed per run, inputs rotated"
                      if args.device == "cuda" else "dry run: wall-clock medians on the CPU",
            **general_header,
        }
        common.write_results(args.out, header, rows)
        print(f"-> {args.out}")
    if rows:
        common.print_summary(rows)
        print("\n".join(summary_lines(rows, copy_gbs)))
    print(f"check {general_header['general check']}")
    if not passed:
        sys.exit(1)


if __name__ == "__main__":
    main()
