"""Every validation path a Python caller can reach, one case each: the call raises the expected
exception type, its message starts "<function>: <argument>:" with the argument as the Python
function spells it, says what was wrong, and speaks Python, not the C++ API (README.md, "Errors"):
no `layout.` prefix, no C++ enum (`kNeox`, `RotaryStyle::`), dtypes as torch spells them
(torch.bfloat16), True/False, and no source location (the C++ file and line are shown only with
TORCH_SHOW_CPP_STACKTRACES=1, tested below).

Not reachable from Python, and so not here: the checks of the outputs and workspaces the binding
allocates itself (tests/test_validation.cpp covers them through the C++ API), misaligned data
pointers (torch keeps every view element-aligned) and devices other than cpu, cuda and meta.
CUDA-only checks (alignment, cuBLASLt's multiples of 16, cpu-vs-cuda devices) run on a GPU; the
value of packed_fp8_qkv's grad_scale is checked on the CPU only.
"""
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

import qkvfuse
from conftest import DEVICES, requires_cuda, without_section9
from packed_problem import LAYOUT_CASES, LAYOUTS, Problem
from qkvfuse._layout import RopeLayout, qkv_views

BF16, F32, E4M3 = torch.bfloat16, torch.float32, torch.float8_e4m3fn


class Inputs:
    """Valid arguments of every op on one device; each case breaks one thing."""

    def __init__(self, device):
        self.device = device
        d = dict(device=device)
        t, h, kv, dim = 4, 4, 2, 32
        # The speedrun's layout: qk [T, 2H, D], factor tables [T, D].
        self.qk = torch.randn(t, 2 * 2, dim, **d).to(BF16)
        self.factor1, self.factor2 = qkvfuse.speedrun_factor_tables(t, dim, device=device)
        # Qwen3's: GQA 4/2, NeoX, a cos/sin cache, norm weights.
        self.gqa_qk = torch.randn(t, h + kv, dim, **d).to(BF16)
        self.gqa = dict(num_heads=h, num_kv_heads=kv, rotary_style="neox",
                        cos_sin=qkvfuse.rotary_cos_sin(16, dim, device=device),
                        positions=torch.tensor([0, 5, 2, 15], **d),
                        q_weight=torch.ones(dim, **d), k_weight=torch.ones(dim, **d).to(BF16),
                        eps=1e-6)
        self.grad_q = torch.randn(t, h, dim, **d).to(BF16)
        self.grad_k = torch.randn(t, kv, dim, **d).to(BF16)
        self.grad_v = torch.randn(t, kv, 16, **d).to(BF16)
        self.grad_scale = torch.tensor(1 / 448, **d)
        # Quantize and the FP8 GEMM.
        self.x = torch.randn(16, 32, **d).to(BF16)
        self.scale = torch.tensor(0.05, **d)
        self.a = (torch.randn(16, 32, **d) * 8).to(E4M3)
        self.b = (torch.randn(32, 32, **d) * 8).to(E4M3)
        self.one = torch.tensor(1.0, **d)

    # ---- calls with one change ----

    def rope(self, **changes):
        """qk_norm_rope on the Qwen3 layout, by keyword."""
        return qkvfuse.qk_norm_rope(changes.pop("qk", self.gqa_qk), **{**self.gqa, **changes})

    def tables(self, *args, **kwargs):
        """qk_norm_rope on the speedrun's layout; positional arguments after qk replace
        (factor1, factor2, num_heads) in order."""
        positional = (self.factor1, self.factor2, 2)
        positional = args + positional[len(args):]
        return qkvfuse.qk_norm_rope(kwargs.pop("qk", self.qk), *positional, **kwargs)

    def backward_op(self, **changes):
        """torch.ops.qkvfuse.qk_norm_rope_backward, called directly (autograd's calls are
        always well formed)."""
        grads = dict(grad_q=self.grad_q, grad_k=self.grad_k)
        grads.update({n: changes.pop(n) for n in list(changes) if n in grads})
        layout = RopeLayout(**{**self.gqa, **changes})
        return torch.ops.qkvfuse.qk_norm_rope_backward(grads["grad_q"], grads["grad_k"],
                                                       self.gqa_qk, *layout)

    def fp8_backward(self, **changes):
        args = dict(grad_q=self.grad_q, grad_k=self.grad_k, grad_v=self.grad_v, qk=self.gqa_qk,
                    grad_scale=self.grad_scale)
        args.update({n: changes.pop(n) for n in list(changes) if n in args})
        return qkvfuse.qkv_backward_fp8(**args, **{**self.gqa, **changes})

    def packed(self, **changes):
        """packed_fp8_qkv on packed_problem's qwen3_gqa layer; arguments by name."""
        layout, options = LAYOUT_CASES["qwen3_gqa"]
        p = Problem(layout, self.device, options)
        names = ("x", "qk_weight", "v_weight", "weight_f8", "weight_f8_t", "weight_scale",
                 "qkv_scale", "x_scale", "grad_scale", "factor1", "factor2", "num_heads",
                 "paired", "key_offset", "rotary_dim", "x_f8", "x_f8_t")
        args = dict(zip(names, p.arguments()))
        args.update({n: changes.pop(n) for n in list(changes) if n in args})
        return p, qkvfuse.packed_fp8_qkv(*args.values(), **{**p.options, **changes})

    def packed_backward_op(self, **changes):
        """torch.ops.qkvfuse.packed_qkv_backward, called directly: it checks the layout again."""
        layout, options = LAYOUT_CASES["qwen3_gqa"]
        p = Problem(layout, self.device, options)
        w = p.cache[0]
        rope = RopeLayout(**p.rope_layout(detach=True))
        q, k, qkv = torch.ops.qkvfuse.packed_qkv_forward(
            p.x_f8, w.weight_f8, p.x_scale, w.weight_scale, p.qkv_scale.detach(), p.qk_dim,
            p.v_dim, *rope)
        qk, v = qkv_views(qkv, p.tokens, rope, p.qk_dim, p.v_dim)
        args = dict(grad_q=q, grad_k=k, grad_v=v.contiguous(), qk=qk, x_f8_t=p.x_f8_t,
                    weight_f8_t=w.weight_f8_t, qk_weight=p.qk_weight.detach(),
                    v_weight=p.v_weight.detach(), x_scale=p.x_scale, weight_scale=w.weight_scale,
                    qkv_scale=p.qkv_scale.detach(), grad_scale=p.grad_scale)
        args.update({n: changes.pop(n) for n in list(changes) if n in args})
        return torch.ops.qkvfuse.packed_qkv_backward(*args.values(), *rope._replace(**changes))

    def packed_backward(self, grad_scale):
        """packed_fp8_qkv's backward with grad_scale's value set after the forward (as a hook
        would)."""
        p, (q, k, v) = self.packed()
        p.grad_scale.fill_(grad_scale)
        (q.float().sum() + k.float().sum() + v.float().sum()).backward()

    def quantize(self, x=None, scale=None, amax=False):
        return qkvfuse.quantize_dual_layout(self.x if x is None else x,
                                            self.scale if scale is None else scale, amax=amax)

    def gemm(self, **changes):
        args = dict(a=self.a, b=self.b, scale_a=self.one, scale_b=self.one, alpha=None)
        args.update(changes)
        return qkvfuse.fp8_gemm(**args)


def meta(tensor):
    return tensor.to("meta")


def strided_last(tensor):
    """The same values with the last dim's stride 2 (a column-strided view)."""
    wide = torch.zeros(*tensor.shape[:-1], 2 * tensor.shape[-1], dtype=tensor.dtype,
                       device=tensor.device)
    wide[..., ::2] = tensor
    return wide[..., ::2]


@dataclass
class Case:
    id: str
    call: Callable
    error: type
    function: str  # the message's first word: the Python function (or the op it runs)
    argument: str  # as the Python function spells it
    says: str      # a regular expression the rest of the message matches
    only: str = ""  # "cpu" or "cuda": a check made on that device only


C = Case
RT, TE, VE = RuntimeError, TypeError, ValueError
QNR, FB, PK = "qk_norm_rope", "qkv_backward_fp8", "packed_fp8_qkv"
PF = "packed_qkv_forward"
DT = r"expected dtype "

CASES = [
    # ---- qk_norm_rope: Python types and the general call (keywords from num_heads on) ----
    C("qk_not_a_tensor", lambda i: i.tables(qk=[1.0]), TE, QNR, "qk",
      "expected a tensor, got list"),
    C("num_heads_missing", lambda i: qkvfuse.qk_norm_rope(i.qk, i.factor1, i.factor2), TE, QNR,
      "num_heads", "missing"),
    C("num_heads_float", lambda i: i.tables(i.factor1, i.factor2, 2.0), TE, QNR, "num_heads",
      "expected an int, got float 2.0"),
    C("num_heads_second_without_keyword", lambda i: qkvfuse.qk_norm_rope(
        i.gqa_qk, 4, num_kv_heads=2, rotary_style="neox", cos_sin=i.gqa["cos_sin"],
        positions=i.gqa["positions"]), TE, QNR, "factor1",
      r"expected a tensor or None, got int 4; the general layouts pass num_heads and the angles "
      r"by keyword: qk_norm_rope\(\.\.\., num_heads=\.\.\."),
    C("factor2_not_a_tensor", lambda i: i.tables(i.factor1, [0.0]), TE, QNR, "factor2",
      "expected a tensor or None, got list"),
    C("rotary_style_missing_with_a_cache", lambda i: i.rope(rotary_style=None), VE, QNR,
      "rotary_style", 'required with a cos/sin cache.*"neox" for Hugging Face models'),
    C("rotary_style_unknown", lambda i: i.rope(rotary_style="gptj"), VE, QNR, "rotary_style",
      "expected \"interleaved\" or \"neox\", got 'gptj'"),
    C("rotary_dim_negative", lambda i: i.rope(rotary_dim=-2), VE, QNR, "rotary_dim",
      "expected an int >= 0 or None"),
    C("paired_not_a_bool", lambda i: i.tables(paired=1), TE, QNR, "paired",
      "expected True or False, got int 1"),
    C("eps_a_string", lambda i: i.rope(eps="1e-6"), TE, QNR, "eps", "expected a float, got str"),
    # ---- qk_norm_rope: the binding ----
    C("num_heads_zero", lambda i: i.rope(num_heads=0), RT, QNR, "num_heads", "expected >= 1"),
    C("num_kv_heads_zero", lambda i: i.rope(num_kv_heads=0), RT, QNR, "num_kv_heads",
      "expected >= 1"),
    C("qk_float16", lambda i: i.tables(qk=i.qk.half()), RT, QNR, "qk",
      DT + r"torch.bfloat16(, torch.float32 or torch.float64)?, got torch.float16$"),
    C("qk_int8", lambda i: i.tables(qk=i.qk.to(torch.int8)), RT, QNR, "qk",
      "got dtype torch.int8, which no qkvfuse op takes"),
    C("qk_two_dims", lambda i: i.tables(qk=i.qk.flatten(1)), RT, QNR, "qk",
      r"expected 3 dims \[T, Hq \+ Hkv, D\]"),
    C("factor2_five_dims", lambda i: i.tables(i.factor1, i.factor2.view(1, 1, 1, 4, 32)), RT,
      QNR, "factor2", "expected at most 4 dims"),
    # ---- qk_norm_rope: the layout's options ----
    C("num_kv_heads_not_a_divisor", lambda i: i.rope(num_kv_heads=3), RT, QNR, "num_kv_heads",
      "expected a divisor of num_heads = 4, got 3"),
    C("head_width_past_512", lambda i: i.tables(qk=torch.zeros(4, 4, 514, dtype=BF16,
                                                               device=i.device)), RT, QNR, "qk",
      r"head width D = 514 is not supported: expected an even D in \[2, 512\]"),
    C("both_angle_sources", lambda i: i.rope(factor1=i.factor1, factor2=i.factor2), RT, QNR,
      "factor1, cos_sin", "expected at most one angle source, got both the factor tables "
      r"\(factor1, factor2\) and a cos/sin cache \(cos_sin, positions\)"),
    C("factor1_alone", lambda i: i.tables(i.factor1, None), RT, QNR, "factor2",
      "missing: factor1 and factor2 go together, got only factor1"),
    C("cos_sin_alone", lambda i: i.rope(positions=None), RT, QNR, "positions",
      "missing: cos_sin and positions go together, got only cos_sin"),
    C("positions_alone", lambda i: i.rope(cos_sin=None, rotary_style=None), RT, QNR, "cos_sin",
      "missing: cos_sin and positions go together, got only positions"),
    C("cos_sin_one_dim", lambda i: i.rope(cos_sin=i.gqa["cos_sin"][0]), RT, QNR, "cos_sin",
      r"expected 2 dims \[P, r\]"),
    C("rotary_dim_odd", lambda i: i.tables(rotary_dim=7), RT, QNR, "rotary_dim",
      r"expected an even value in \[0, D = 32\], got 7"),
    C("rotary_dim_past_d", lambda i: i.tables(rotary_dim=34), RT, QNR, "rotary_dim",
      r"expected an even value in \[0, D = 32\], got 34"),
    C("cos_sin_odd_width", lambda i: i.rope(cos_sin=i.gqa["cos_sin"][:, :7]), RT, QNR, "cos_sin",
      r"expected an even width r in \[0, D = 32\], got 7"),
    C("cos_sin_width_not_rotary_dim", lambda i: i.rope(rotary_dim=16), RT, QNR, "cos_sin",
      r"expected width r = 16 \(rotary_dim\)"),
    C("paired_and_key_offset", lambda i: i.tables(paired=True, key_offset=True), RT, QNR,
      "paired, key_offset", "cannot both be set"),
    C("paired_gqa", lambda i: i.rope(paired=True), RT, QNR, "paired",
      "needs num_kv_heads = num_heads and an even num_heads, got 4 and 2"),
    C("paired_cache", lambda i: i.rope(paired=True, num_kv_heads=4,
                                       qk=torch.zeros(4, 8, 32, dtype=BF16, device=i.device)), RT,
      QNR, "paired", r"defined with factor tables \[T, 2D\] only, got a cos/sin cache"),
    C("key_offset_gqa", lambda i: i.rope(key_offset=True), RT, QNR, "key_offset",
      "needs num_kv_heads = num_heads, got 4 and 2"),
    C("weights_without_normalize", lambda i: i.rope(normalize=False), RT, QNR, "q_weight",
      "norm weights need normalize = True, got False"),
    C("eps_zero", lambda i: i.rope(eps=0.0), RT, QNR, "eps", "expected a positive finite value"),
    C("weight_offset_nan", lambda i: i.rope(weight_offset=float("nan")), RT, QNR,
      "weight_offset", "expected a finite value, got nan"),
    # ---- qk_norm_rope: SPEC.md section 9's options (the CPU backend; CUDA below) ----
    C("normalize_v_not_a_bool", lambda i: i.rope(normalize_v=1), TE, QNR, "normalize_v",
      "expected True or False, got int 1"),
    C("query_only_not_a_bool", lambda i: i.rope(query_only="yes"), TE, QNR, "query_only",
      "expected True or False, got str"),
    C("norm_scope_unknown", lambda i: i.rope(norm_scope="row"), VE, QNR, "norm_scope",
      "expected \"head\" or \"token\", got 'row'"),
    C("v_not_a_tensor", lambda i: i.rope(v=[1.0], normalize_v=True), TE, QNR, "v",
      "expected a tensor or None, got list"),
    C("v_missing_with_normalize_v", lambda i: i.rope(normalize_v=True), VE, QNR, "v",
      r"missing \(normalize_v=True normalizes v, the V heads \[T, Hkv, Dv\]\)"),
    C("v_without_normalize_v", lambda i: i.rope(v=i.grad_v), VE, QNR, "v",
      r"given, but normalize_v is False \(v is the V norm's input\)"),
    C("v_two_dims", lambda i: i.rope(v=i.grad_v.flatten(1), normalize_v=True), RT,
      "qkv_norm_rope", "v", r"expected 3 dims \[T, Hkv, Dv\]"),
    C("v_heads", lambda i: i.rope(v=i.grad_v[:, :1], normalize_v=True), RT, QNR, "v",
      r"expected shape \[4, 2, Dv\] \(T from qk, num_kv_heads\)", only="cpu"),
    C("v_float32", lambda i: i.rope(v=i.grad_v.float(), normalize_v=True), RT, QNR, "v",
      DT + "torch.bfloat16, got torch.float32", only="cpu"),
    C("v_on_meta", lambda i: i.rope(v=meta(i.grad_v), normalize_v=True), RT, "qkv_norm_rope",
      "v", "is on meta, but qk is on"),
    C("query_only_with_kv_heads", lambda i: i.rope(query_only=True, k_weight=None), RT, QNR,
      "num_kv_heads", r"expected 0 with query_only \(no key heads\), got 2", only="cpu"),
    C("query_only_key_offset", lambda i: i.tables(query_only=True, key_offset=True), RT, QNR,
      "query_only", r"has no key heads, so neither paired nor key_offset \(both need "
      r"num_kv_heads = num_heads\)", only="cpu"),
    C("query_only_k_weight", lambda i: i.rope(query_only=True, num_kv_heads=None), RT, QNR,
      "k_weight", "given, but query_only has no key rows", only="cpu"),
    C("query_only_normalize_v", lambda i: i.rope(query_only=True, num_kv_heads=None,
                                                 k_weight=None, v=i.grad_v, normalize_v=True),
      RT, QNR, "normalize_v",
      r"expected False with query_only \(no V heads to normalize\), got True", only="cpu"),
    C("normalize_v_token_scope", lambda i: i.rope(v=i.grad_v, normalize_v=True, norm_scope="token",
                                                  q_weight=None, k_weight=None), RT, QNR,
      "normalize_v", 'defined with norm_scope = "head" only', only="cpu"),
    C("token_scope_weight_width", lambda i: i.rope(norm_scope="token"), RT, QNR, "q_weight",
      r'expected shape \[128\] \(norm_scope = "token": \[num_heads \* D\]\), got \[32\]',
      only="cpu"),
    C("rotary_dim_without_angles", lambda i: i.rope(cos_sin=None, positions=None,
                                                    rotary_style=None, rotary_dim=32), RT, QNR,
      "rotary_dim", r"expected -1 \(the default\) or 0 without an angle source", only="cpu"),
    C("paired_without_angles", lambda i: i.tables(None, None, paired=True), RT, QNR, "paired",
      r"defined with factor tables \[T, 2D\] only, got no angle source", only="cpu"),
    C("eps_zero_v_norm_alone", lambda i: i.rope(normalize=False, q_weight=None, k_weight=None,
                                                v=i.grad_v, normalize_v=True, eps=0.0), RT, QNR,
      "eps", "expected a positive finite value", only="cpu"),
    # ---- ... on CUDA: refused by name until the kernels take them ----
    C("cuda_head_width_512", lambda i: i.tables(qk=torch.zeros(4, 4, 512, dtype=BF16,
                                                               device=i.device)), RT, QNR, "qk",
      r"head width D = 512 \(above 256\): not yet on the CUDA backend \(the CPU backend runs "
      r"it; SPEC.md section 9\)", only="cuda"),
    C("cuda_normalize_v", lambda i: i.rope(v=i.grad_v, normalize_v=True), RT, QNR, "normalize_v",
      "not yet on the CUDA backend", only="cuda"),
    C("cuda_norm_scope_token", lambda i: i.rope(norm_scope="token"), RT, QNR, "norm_scope",
      r'"token" \(one RMS over the token\): not yet on the CUDA backend', only="cuda"),
    C("cuda_query_only", lambda i: i.rope(qk=i.gqa_qk[:, :4], query_only=True, num_kv_heads=None,
                                          k_weight=None), RT, QNR, "query_only",
      "not yet on the CUDA backend", only="cuda"),
    C("cuda_no_angle_source", lambda i: i.rope(cos_sin=None, positions=None, rotary_style=None),
      RT, QNR, "factor1, cos_sin", r"none \(a call without rotary\): not yet on the CUDA backend",
      only="cuda"),
    C("cuda_backward_norm_scope_token", lambda i: i.backward_op(norm_scope="token"), RT,
      "qk_norm_rope_backward", "norm_scope", "not yet on the CUDA backend", only="cuda"),
    C("cuda_fp8_normalize_v", lambda i: i.fp8_backward(v=i.grad_v, normalize_v=True), RT, FB,
      "normalize_v", "not yet on the CUDA backend", only="cuda"),
    C("cuda_packed_no_angle_source", lambda i: i.packed(cos_sin=None, positions=None,
                                                        rotary_style=None), RT, PF,
      "factor1, cos_sin", "not yet on the CUDA backend", only="cuda"),
    # ---- qk_norm_rope: the tensors ----
    C("qk_heads", lambda i: i.tables(i.factor1, i.factor2, 3), RT, QNR, "qk",
      r"expected shape \[T, 6, 32\] \(num_heads \+ num_kv_heads = 6 heads\), got \[4, 4, 32\] "
      r"\(torch.bfloat16\[4, 4, 32\]"),
    C("qk_last_dim_strided", lambda i: i.tables(qk=strided_last(i.qk)), RT, QNR, "qk",
      r"expected its last dim contiguous \(stride 1\)"),
    C("factor1_float64", lambda i: i.tables(i.factor1.double(), i.factor2.double()), RT, QNR,
      "factor1", DT + r"torch.bfloat16 or torch.float32, got torch.float64"),
    C("factor2_other_dtype", lambda i: i.tables(i.factor1, i.factor2.float()), RT, QNR,
      "factor2", DT + "torch.bfloat16, got torch.float32"),
    C("factor1_rows", lambda i: i.tables(i.factor1[1:], i.factor2[1:]), RT, QNR, "factor1",
      r"expected shape \[4, 32\] \(\[T, D\]\)"),
    C("factor1_last_dim_strided", lambda i: i.tables(strided_last(i.factor1), i.factor2), RT,
      QNR, "factor1", "expected its last dim contiguous"),
    C("cos_sin_float64", lambda i: i.rope(cos_sin=i.gqa["cos_sin"].double()), RT, QNR,
      "cos_sin", DT + "torch.bfloat16 or torch.float32, got torch.float64"),
    C("cos_sin_no_rows", lambda i: i.rope(cos_sin=i.gqa["cos_sin"][:0]), RT, QNR, "cos_sin",
      "expected 1 <= P <= 2"),
    C("cos_sin_last_dim_strided", lambda i: i.rope(cos_sin=strided_last(i.gqa["cos_sin"])), RT,
      QNR, "cos_sin", "expected its last dim contiguous"),
    C("positions_float", lambda i: i.rope(positions=i.gqa["positions"].float()), RT, QNR,
      "positions", DT + "torch.int32 or torch.int64, got torch.float32"),
    C("positions_length", lambda i: i.rope(positions=i.gqa["positions"][1:]), RT, QNR,
      "positions", r"expected shape \[4\] \(\[T\], T from qk\)"),
    C("q_weight_width", lambda i: i.rope(q_weight=i.gqa["q_weight"][:30]), RT, QNR, "q_weight",
      r"expected shape \[32\] \(\[D\]\)"),
    C("k_weight_float16", lambda i: i.rope(k_weight=i.gqa["k_weight"].half()), RT, QNR,
      "k_weight", DT + "torch.bfloat16 or torch.float32, got torch.float16"),
    C("q_weight_strided", lambda i: i.rope(q_weight=strided_last(i.gqa["q_weight"])), RT, QNR,
      "q_weight", "expected its last dim contiguous"),
    # ---- devices: a meta tensor among real ones (the fake kernel runs), cpu among cuda ----
    C("factor2_on_meta", lambda i: i.tables(i.factor1, meta(i.factor2)), RT, QNR, "factor2",
      "is on meta, but qk is on (cpu|cuda:0); all tensors of one call must share a device"),
    C("positions_on_meta", lambda i: i.rope(positions=meta(i.gqa["positions"])), RT, QNR,
      "positions", "is on meta, but qk is on"),
    C("factor1_on_cpu", lambda i: i.tables(i.factor1.cpu(), i.factor2), RT, QNR, "factor1",
      "is on cpu, but qk is on cuda:0; all tensors of one call must share a device",
      only="cuda"),
    # ---- qk_norm_rope_backward (the op) ----
    C("backward_grad_q_float32", lambda i: i.backward_op(grad_q=i.grad_q.float()), RT,
      "qk_norm_rope_backward", "grad_q", DT + "torch.bfloat16, got torch.float32"),
    C("backward_grad_k_heads", lambda i: i.backward_op(grad_k=i.grad_k[:, :1]), RT,
      "qk_norm_rope_backward", "grad_k", r"expected shape \[4, 2, 32\]"),
    C("backward_grad_q_strided", lambda i: i.backward_op(grad_q=strided_last(i.grad_q)), RT,
      "qk_norm_rope_backward", "grad_q", "expected its last dim contiguous"),
    C("backward_k_weight", lambda i: i.backward_op(k_weight=i.gqa["k_weight"][:-2]), RT,
      "qk_norm_rope_backward", "k_weight", r"expected shape \[32\]"),
    C("backward_grad_k_on_meta", lambda i: i.backward_op(grad_k=meta(i.grad_k)), RT,
      "qk_norm_rope_backward", "grad_k", "is on meta, but grad_q is on"),
    C("backward_norm_scope_unknown", lambda i: i.backward_op(norm_scope="row"), RT,
      "qk_norm_rope_backward", "norm_scope", 'expected "head" or "token", got "row"'),
    # ---- qkv_backward_fp8 ----
    C("fp8_grad_scale_float", lambda i: i.fp8_backward(grad_scale=1 / 448), TE, FB, "grad_scale",
      r"expected a torch.float32 tensor of shape \[\] or \[1\] on the op's device, got float"),
    C("fp8_grad_scale_missing", lambda i: qkvfuse.qkv_backward_fp8(
        i.grad_q, i.grad_k, i.grad_v, i.gqa_qk, **i.gqa), TE, FB, "grad_scale", "missing"),
    C("fp8_grad_scale_float64", lambda i: i.fp8_backward(grad_scale=i.grad_scale.double()), RT,
      FB, "grad_scale", r"expected a torch.float32 scalar of shape \[\] or \[1\], got "
      r"torch.float64\[\]"),
    C("fp8_grad_scale_two", lambda i: i.fp8_backward(grad_scale=torch.ones(2, device=i.device)),
      RT, FB, "grad_scale", r"expected a torch.float32 scalar"),
    C("fp8_grad_v_float32", lambda i: i.fp8_backward(grad_v=i.grad_v.float()), RT, FB, "grad_v",
      DT + "torch.bfloat16, got torch.float32"),
    C("fp8_grad_v_heads", lambda i: i.fp8_backward(grad_v=i.grad_v[:, :1]), RT, FB, "grad_v",
      r"expected shape \[4, 2, Dv\] \(T from qk, num_kv_heads\)"),
    C("fp8_grad_v_empty_width", lambda i: i.fp8_backward(grad_v=i.grad_v[..., :0]), RT, FB,
      "grad_v", "expected a V head width Dv"),
    C("fp8_grad_v_two_dims", lambda i: i.fp8_backward(grad_v=i.grad_v.flatten(1)), RT, FB,
      "grad_v", r"expected 3 dims \[T, Hkv, Dv\]"),
    C("fp8_grad_v_strided", lambda i: i.fp8_backward(grad_v=strided_last(i.grad_v)), RT, FB,
      "grad_v", "expected its last dim contiguous"),
    C("fp8_grad_q_tokens", lambda i: i.fp8_backward(grad_q=i.grad_q[:-1]), RT, FB, "grad_q",
      r"expected shape \[4, 4, 32\]"),
    C("fp8_qk_float32", lambda i: i.fp8_backward(qk=i.gqa_qk.float()), RT, FB, "qk",
      DT + "torch.bfloat16, got torch.float32"),
    C("fp8_rotary_style_missing", lambda i: i.fp8_backward(rotary_style=None), VE, FB,
      "rotary_style", "required with a cos/sin cache"),
    C("fp8_v_missing_with_normalize_v", lambda i: i.fp8_backward(normalize_v=True), VE, FB, "v",
      r"missing \(normalize_v=True"),
    C("fp8_v_without_normalize_v", lambda i: i.fp8_backward(v=i.grad_v), VE, FB, "v",
      "given, but normalize_v is False"),
    C("fp8_v_heads", lambda i: i.fp8_backward(v=i.grad_v[:, :1], normalize_v=True), RT, FB, "v",
      r"expected shape \[4, 2, Dv\] \(T from qk, num_kv_heads\)", only="cpu"),
    C("fp8_v_on_meta", lambda i: i.fp8_backward(v=meta(i.grad_v), normalize_v=True), RT, FB, "v",
      "is on meta, but grad_q is on"),
    C("fp8_grad_scale_on_meta", lambda i: i.fp8_backward(grad_scale=meta(i.grad_scale)), RT, FB,
      "grad_scale", "is on meta, but grad_q is on"),
    # ---- packed_fp8_qkv: what its forward checks (the backward's arguments included) ----
    C("packed_grad_scale_float", lambda i: i.packed(grad_scale=1 / 448), TE, PK, "grad_scale",
      r"expected a torch.float32 tensor of shape \[\] or \[1\] on the op's device, got float "
      r"0.00223.*the backward reads it when it runs"),
    C("packed_x_scale_float", lambda i: i.packed(x_scale=0.02), TE, PK, "x_scale",
      "expected a torch.float32 tensor"),
    C("packed_qk_weight_columns", lambda i: i.packed(
        qk_weight=torch.zeros(192, 48, dtype=BF16, device=i.device)), RT, PK, "qk_weight",
      r"expected a contiguous torch.bfloat16 tensor of shape \[heads \* D, C\] with heads = "
      r"num_heads \+ num_kv_heads = 6 and C = 64"),
    C("packed_qk_weight_rows", lambda i: i.packed(
        qk_weight=torch.zeros(190, 64, dtype=BF16, device=i.device)), RT, PK, "qk_weight",
      r"heads = num_heads \+ num_kv_heads = 6"),
    C("packed_qk_weight_float32", lambda i: i.packed(
        qk_weight=torch.zeros(192, 64, device=i.device)), RT, PK, "qk_weight",
      r"expected a contiguous torch.bfloat16 tensor.*got torch.float32 tensor"),
    C("packed_qk_weight_transposed", lambda i: i.packed(
        qk_weight=torch.zeros(64, 192, dtype=BF16, device=i.device).T), RT, PK, "qk_weight",
      r"strides \[1, 192\]"),
    C("packed_v_weight_columns", lambda i: i.packed(
        v_weight=torch.zeros(64, 32, dtype=BF16, device=i.device)), RT, PK, "v_weight",
      "heads = num_kv_heads = 2 and C = 64"),
    C("packed_x_elements", lambda i: i.packed(
        x=torch.zeros(31, 64, dtype=BF16, device=i.device)), RT, PK, "x",
      r"expected a floating-point tensor of T \* C = 2048 elements"),
    C("packed_x_f8_t_shape", lambda i: i.packed(
        x_f8_t=torch.zeros(64, 31, device=i.device).to(E4M3)), RT, PK, "x_f8_t",
      r"shape \[C, T\] = \[64, 32\]"),
    C("packed_x_f8_t_bf16", lambda i: i.packed(
        x_f8_t=torch.zeros(64, 32, dtype=BF16, device=i.device)), RT, PK, "x_f8_t",
      "row-major torch.float8_e4m3fn tensor"),
    C("packed_weight_f8_t_shape", lambda i: i.packed(
        weight_f8_t=torch.zeros(64, 128, device=i.device).to(E4M3)), RT, PK, "weight_f8_t",
      r"shape \[C, qkv_dim\] = \[64, 256\]"),
    C("packed_grad_scale_float64", lambda i: i.packed(
        grad_scale=torch.tensor(0.5, dtype=torch.float64, device=i.device)), RT, PK,
      "grad_scale", r"expected a torch.float32 tensor of shape \[\] or \[1\]"),
    C("packed_grad_scale_on_meta", lambda i: i.packed(
        grad_scale=torch.tensor(0.5, device="meta")), RT, PK, "grad_scale",
      "is on meta, but x_f8 is on"),
    C("packed_qk_weight_on_meta", lambda i: i.packed(
        qk_weight=torch.zeros(192, 64, dtype=BF16, device="meta")), RT, PK, "qk_weight",
      "is on meta, but x_f8 is on"),
    C("packed_x_f8_one_dim", lambda i: i.packed(
        x_f8=torch.zeros(2048, device=i.device).to(E4M3)), RT, PK, "x_f8", r"expected 2 dims"),
    C("packed_x_f8_bf16", lambda i: i.packed(
        x_f8=torch.zeros(32, 64, dtype=BF16, device=i.device)), RT, PF, "x_f8",
      DT + "torch.float8_e4m3fn, got torch.bfloat16"),
    C("packed_weight_f8_shape", lambda i: i.packed(
        weight_f8=torch.zeros(240, 64, device=i.device).to(E4M3)), RT, PF, "weight_f8",
      r"expected shape \[256, 64\] \(qkv_dim = \(Hq \+ Hkv\)\*D \+ Hkv\*Dv = 256\)"),
    C("packed_weight_f8_e5m2", lambda i: i.packed(
        weight_f8=torch.zeros(256, 64, device=i.device).to(torch.float8_e5m2)), RT, PF,
      "weight_f8", DT + "torch.float8_e4m3fn, got torch.float8_e5m2"),
    C("packed_x_scale_two", lambda i: i.packed(x_scale=torch.ones(2, device=i.device)), RT, PF,
      "x_scale", r"expected a torch.float32 scalar of shape \[\] or \[1\]"),
    C("packed_qkv_scale_float64", lambda i: i.packed(
        qkv_scale=torch.tensor(1.0, dtype=torch.float64, device=i.device)), RT, PF, "qkv_scale",
      "expected a torch.float32 scalar"),
    C("packed_q_weight_width", lambda i: i.packed(
        q_weight=torch.ones(30, device=i.device)), RT, PF + ": qk_norm_rope", "q_weight",
      r"expected shape \[32\]"),
    C("packed_num_kv_heads", lambda i: i.packed(num_kv_heads=8), RT, PF, "num_kv_heads",
      "expected a divisor of num_heads = 4, got 8"),
    C("packed_rotary_style_missing", lambda i: i.packed(rotary_style=None), VE, PK,
      "rotary_style", "required with a cos/sin cache"),
    C("packed_num_heads_missing", lambda i: i.packed(num_heads=None), TE, PK, "num_heads",
      "missing"),
    C("packed_query_only_v_rows", lambda i: i.packed(query_only=True, num_kv_heads=None,
                                                     k_weight=None), RT, PK, "v_weight",
      r"heads = num_kv_heads = 0 and C = 64"),
    # ---- packed_fp8_qkv's backward: grad_scale's value, read when it runs (on the CPU only:
    # on CUDA reading it would synchronize) ----
    C("packed_grad_scale_zero", lambda i: i.packed_backward(0.0), VE, PK, "grad_scale",
      r"expected a positive finite value when the backward runs, got 0.0 \(a zero scale would "
      r"make every gradient of the projection 0 or NaN", only="cpu"),
    C("packed_grad_scale_negative", lambda i: i.packed_backward(-1.0), VE, PK, "grad_scale",
      "expected a positive finite value when the backward runs, got -1.0", only="cpu"),
    C("packed_grad_scale_nan", lambda i: i.packed_backward(float("nan")), VE, PK, "grad_scale",
      "got nan", only="cpu"),
    C("packed_grad_scale_inf", lambda i: i.packed_backward(float("inf")), VE, PK, "grad_scale",
      "got inf", only="cpu"),
    C("packed_backward_k_weight", lambda i: i.packed_backward_op(
        k_weight=torch.ones(30, dtype=BF16, device=i.device)), RT, "packed_qkv_backward",
      "k_weight", r"expected shape \[32\] \(\[D\]\)"),
    C("packed_backward_grad_v_float32", lambda i: i.packed_backward_op(
        grad_v=torch.zeros(32, 2, 32, device=i.device)), RT, "packed_qkv_backward", "grad_v",
      DT + "torch.bfloat16, got torch.float32"),
    C("packed_backward_grad_scale_two", lambda i: i.packed_backward_op(
        grad_scale=torch.ones(2, device=i.device)), RT, "packed_qkv_backward", "grad_scale",
      "expected a torch.float32 scalar"),
    # ---- check_positions ----
    C("positions_out_of_range", lambda i: qkvfuse.check_positions(i.gqa["positions"], 4), RT,
      "check_positions", "positions", r"^\[1\] = 5 lies outside \[0, 4\), the rows of cos_sin"),
    C("check_positions_float", lambda i: qkvfuse.check_positions(
        i.gqa["positions"].float(), 16), RT, "check_positions", "positions",
      DT + "torch.int32 or torch.int64, got torch.float32"),
    C("check_positions_two_dims", lambda i: qkvfuse.check_positions(
        i.gqa["positions"].view(2, 2), 16), RT, "check_positions", "positions",
      r"expected 1 dims, got shape \[2, 2\]"),
    C("check_positions_negative_count", lambda i: qkvfuse.check_positions(
        i.gqa["positions"], -1), RT, "check_positions", "num_positions", "expected >= 0, got -1"),
    C("check_positions_a_list", lambda i: qkvfuse.check_positions([0, 1], 2), TE,
      "check_positions", "positions", "expected a tensor, got list"),
    C("check_positions_count_float", lambda i: qkvfuse.check_positions(
        i.gqa["positions"], 16.0), TE, "check_positions", "num_positions", "expected an int"),
    # ---- quantize_dual_layout (the library's `src` is `x`) ----
    C("quantize_x_float32", lambda i: i.quantize(x=i.x.float()), RT, "quantize_dual_layout", "x",
      DT + "torch.bfloat16, got torch.float32"),
    C("quantize_x_one_dim", lambda i: i.quantize(x=i.x.flatten()), RT, "quantize_dual_layout",
      "x", r"expected 2 dims \[M, N\] or \[B, M, N\]"),
    C("quantize_x_strided", lambda i: i.quantize(x=strided_last(i.x)), RT,
      "quantize_dual_layout", "x", "expected its last dim contiguous"),
    C("quantize_scale_float64", lambda i: i.quantize(scale=i.scale.double()), RT,
      "quantize_dual_layout", "scale", r"expected a torch.float32 scalar of shape \[\] or \[1\]"),
    C("quantize_scale_two", lambda i: i.quantize(scale=torch.ones(2, device=i.device)), RT,
      "quantize_dual_layout", "scale", "expected a torch.float32 scalar"),
    C("quantize_batched_scales", lambda i: i.quantize(
        x=i.x.view(2, 8, 32), scale=torch.ones(3, device=i.device), amax=True), RT,
      "quantize_dual_layout", "scale", r"expected shape \[2\] \(one per batch entry of x\)"),
    C("quantize_scale_float", lambda i: i.quantize(scale=0.05), TE, "quantize_dual_layout",
      "scale", "expected a torch.float32 tensor"),
    C("quantize_scale_on_meta", lambda i: i.quantize(scale=meta(i.scale)), RT,
      "quantize_dual_layout", "scale", "is on meta, but x is on"),
    C("weight_bank_two_dims", lambda i: qkvfuse.quantize_weight_bank(i.x), RT,
      "quantize_weight_bank", "weights", r"expected 3 dims \[B, M, N\]"),
    C("weight_bank_float32", lambda i: qkvfuse.quantize_weight_bank(i.x.float()[None]), RT,
      "quantize_weight_bank", "weights", DT + "torch.bfloat16, got torch.float32"),
    C("weight_bank_strided", lambda i: qkvfuse.quantize_weight_bank(strided_last(i.x)[None]), RT,
      "quantize_weight_bank", "weights", "expected its last dim contiguous"),
    C("quantize_x_misaligned_rows", lambda i: i.quantize(x=torch.zeros(
        16, 40, dtype=BF16, device=i.device)[:, 1:33]), RT, "quantize_dual_layout", "x",
      "on CUDA, expected its data pointer and its strides", only="cuda"),
    # ---- fp8_gemm ----
    C("gemm_a_bf16", lambda i: i.gemm(a=i.a.to(BF16)), RT, "fp8_gemm", "a",
      DT + "torch.float8_e4m3fn, got torch.bfloat16"),
    C("gemm_a_three_dims", lambda i: i.gemm(a=i.a[None]), RT, "fp8_gemm", "a",
      r"expected 2 dims \[M, K\]"),
    C("gemm_b_k", lambda i: i.gemm(b=i.b[:, :16]), RT, "fp8_gemm", "b",
      r"expected shape \[N, 32\] \(K from a: both operands are K-major\)"),
    C("gemm_a_strided", lambda i: i.gemm(a=strided_last(i.a.view(torch.uint8)).view(E4M3)), RT,
      "fp8_gemm", "a", "expected its last dim contiguous"),
    C("gemm_a_overlapping_rows", lambda i: i.gemm(a=i.a.as_strided((16, 32), (8, 1))), RT,
      "fp8_gemm", "a", "expected a row stride >= its 32 columns"),
    C("gemm_scale_b_two", lambda i: i.gemm(scale_b=torch.ones(2, device=i.device)), RT,
      "fp8_gemm", "scale_b", "expected a torch.float32 scalar"),
    C("gemm_alpha_float64", lambda i: i.gemm(alpha=i.one.double()), RT, "fp8_gemm", "alpha",
      "expected a torch.float32 scalar"),
    C("gemm_scale_a_float", lambda i: i.gemm(scale_a=1.0), TE, "fp8_gemm", "scale_a",
      "expected a torch.float32 tensor"),
    C("gemm_alpha_on_meta", lambda i: i.gemm(alpha=meta(i.one)), RT, "fp8_gemm", "alpha",
      "is on meta, but a is on"),
    C("gemm_m_not_multiple_of_16", lambda i: i.gemm(a=i.a[:15]), RT, "fp8_gemm", "a, b",
      r"on CUDA, expected M \(a's rows\), N \(b's rows\) and K to be multiples of 16",
      only="cuda"),
]

assert len({case.id for case in CASES}) == len(CASES)

# What a Python user must not see: the C++ API's spellings and the build tree.
CPP_SPELLINGS = [
    (r"layout\.", "a layout. prefix"),
    (r"/src/|\.cpp|\.hpp|\.cu\b|:\d+\]", "a C++ source location"),
    (r"\bk[A-Z]\w*", "a C++ enum value"),
    (r"::", "a C++ qualified name"),
    (r"(?<!torch\.)\b(bfloat16|float16|float32|float64|float8_e4m3fn|float8_e5m2|int32|int64)\b",
     "a dtype not spelled as torch spells it"),
    (r"\b(true|false)\b", "a C++ bool"),
    (r"\bHalf\b|\bBFloat16\b|\bFloat\b", "a c10 ScalarType name"),
]


def params():
    for case in CASES:
        for device in DEVICES:
            name = getattr(device, "values", [device])[0]
            if case.only and case.only != name:
                continue
            marks = list(getattr(device, "marks", ()))
            if "not yet on the CUDA backend" in case.says:
                marks.append(without_section9)  # the switch's off state only
            yield pytest.param(case, name, marks=marks, id=f"{case.id}-{name}")


@pytest.mark.parametrize("case, device", list(params()))
def test_error_names_the_python_argument(case, device):
    inputs = Inputs(device)
    with pytest.raises(case.error) as raised:
        case.call(inputs)
    assert type(raised.value) is case.error, type(raised.value)
    message = str(raised.value)
    # "<function>: <argument>: ...", or "<function>: <argument>[i] ..." for an element.
    prefix = f"{case.function}: {case.argument}"
    assert message.startswith(prefix) and message[len(prefix)] in ":[", (
        f"expected {prefix!r} first: {message}")
    rest = message[len(prefix):].removeprefix(": ")
    assert re.search(case.says, rest), f"expected /{case.says}/ in: {message}"
    for pattern, what in CPP_SPELLINGS:
        found = re.search(pattern, message)
        assert found is None, f"{what} ({found.group(0)!r}) in: {message}"


LOCATION_CALL = """
import torch, qkvfuse
try:
    qkvfuse.qk_norm_rope(torch.zeros(4, 4, 32, dtype=torch.bfloat16), num_heads=3,
                         factor1=torch.ones(4, 32), factor2=torch.zeros(4, 32))
except RuntimeError as error:
    print(error)
"""


@pytest.mark.parametrize("show", ["0", "1"])
def test_cpp_location_behind_torch_show_cpp_stacktraces(show):
    """The C++ file and line that refused the call: in the message only with
    TORCH_SHOW_CPP_STACKTRACES=1, torch's switch for its own C++ locations."""
    env = dict(os.environ, TORCH_SHOW_CPP_STACKTRACES=show)
    result = subprocess.run([sys.executable, "-c", LOCATION_CALL], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    first = "qk_norm_rope: qk: expected shape [T, 6, 32]"
    assert result.stdout.startswith(first), result.stdout[:500]
    location = re.search(r"Exception raised from qkvfuse at (\S*src/validate\.cpp):(\d+)",
                         result.stdout)
    if show == "0":
        assert location is None and ".cpp" not in result.stdout, result.stdout
    else:
        assert location is not None, result.stdout[:2000]
        path = Path(location.group(1))  # the compiler's path (a pip build may have moved it)
        path = path if path.exists() else Path(__file__).resolve().parents[2] / "src/validate.cpp"
        line = path.read_text().splitlines()[int(location.group(2)) - 1]
        assert "QKVF_CHECK" in line, line
