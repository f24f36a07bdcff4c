"""Side-by-side benchmark of the qkvfuse PyTorch ops on one GPU (SPEC.md section 7's workload).

For each shape it times, with triton.testing.do_bench medians (L2 flushed before every run by
do_bench, and inputs rotated across enough copies to exceed L2):
  - norm + rotary forward: qkvfuse vs the same math as an eager PyTorch chain, vs torch.compile of
    that chain, vs the reference Triton kernel (--reference);
  - the fused FP8 backward (norm/rotary grad + V grad into e4m3, row-major and transposed): same
    four;
  - the whole packed FP8 QKV op, forward alone and forward + backward (gradients of x, both weights
    and qkv_scale through torch.autograd.grad), eager and as a replayed CUDA graph, vs the reference
    PackedFP8QKV;
  - the three FP8 GEMMs of the op (forward, wgrad, dgrad): torch._scaled_mm vs qkvfuse.fp8_gemm;
  - the general layouts at the model shapes (Qwen3-8B, Gemma3-12B, Qwen3-0.6B; SPEC.md section 8):
    QK-norm with learned weights + NeoX rotary from a cos/sin cache, forward, backward and both,
    vs the eager Hugging Face chain, torch.compile of it, Liger-Kernel's ops (--liger-path) and
    axolotl's fused RMSNorm + RoPE kernel (--axolotl-path); bench/bench_general.py says what each
    row measures.
Memory-bound kernels report GB/s of their minimum traffic and % of a measured device copy (2 GiB
buffer); GEMMs report TFLOP/s. Results go to --out (markdown for *.md, CSV otherwise) with the
device, date and commit; a short table is printed last.

  python bench/bench_torch.py --out bench_torch_h200.csv \
      [--reference /path/to/seed.txt] [--commit SHA] [--tokens 49152] [--channels 768]
      [--sections norm,backward,packed,gemm,general] [--liger-path .whl]
      [--axolotl-path .seed/axolotl-kernel]
"""
import argparse
import time
import csv
import datetime
import importlib.machinery
import importlib.util
import math
import os
import statistics
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

import qkvfuse

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
EPS = torch.finfo(torch.float32).eps


@dataclass(frozen=True)
class Shape:
    heads: int
    qk_dim: int
    v_dim: int = 128
    mode: str = "plain"  # plain | paired | key_offset

    @property
    def paired(self):
        return self.mode == "paired"

    @property
    def key_offset(self):
        return self.mode == "key_offset"

    @property
    def rotary_dim(self):
        # The speedrun's long-window layers rotate half the head and shift the other half.
        return self.qk_dim // 2 if self.key_offset else self.qk_dim

    def label(self):
        return f"H={self.heads} D={self.qk_dim} Dv={self.v_dim}"


SHAPES = [
    Shape(6, 128), Shape(6, 128, mode="paired"), Shape(6, 128, mode="key_offset"),
    Shape(12, 64), Shape(6, 96),
]


@dataclass
class Row:
    section: str
    shape: str
    mode: str
    impl: str
    ms: float
    rate: Optional[float] = None  # GB/s or TFLOP/s
    unit: str = ""
    pct_copy: Optional[float] = None
    vs_qkvfuse: Optional[float] = None  # this impl's time / qkvfuse's time


# ---- timing ---------------------------------------------------------------------------------

def median_ms(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def rotating(make: Callable[[], tuple], l2_bytes: int, budget_bytes: int):
    """Input sets to cycle through so that consecutive runs never find their inputs in L2:
    enough copies to cover three times L2 (at least two), within a memory budget."""
    first = make()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in first if isinstance(t, torch.Tensor)}
    set_bytes = max(sum(storages.values()), 1)
    count = max(2, min(math.ceil(3 * l2_bytes / set_bytes), budget_bytes // set_bytes))
    return [first] + [make() for _ in range(count - 1)]


def cycle(sets, fn):
    """A closure that calls fn on the next input set each time."""
    state = {"i": 0}

    def run():
        args = sets[state["i"] % len(sets)]
        state["i"] += 1
        return fn(*args)

    return run


def copy_bandwidth_gbs(device) -> float:
    """Device-to-device copy of a 2 GiB buffer, bytes read + written per second."""
    nbytes = 2 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_ms(lambda: dst.copy_(src)) / 1e6


def steady_state_ms(fn, steps=100):
    """(wall ms per step, host ms per step) over `steps` back-to-back calls with no sync between:
    the wall time is max(host, GPU) per step once the queue is primed; the host time is how long
    the calls take to enqueue (the launch queue holds far more than `steps` steps' kernels)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    enqueued = time.perf_counter()
    torch.cuda.synchronize()
    end = time.perf_counter()
    return (end - start) * 1e3 / steps, (enqueued - start) * 1e3 / steps


def cuda_graph(fn):
    """fn captured in a CUDA graph (after warm-up on a side stream); returns graph.replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


# ---- the same math as plain PyTorch chains (the eager and torch.compile baselines) ----------

def swap_pairs(x):
    return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)


def chain_forward(qk, factor1, factor2, num_heads, rotary_dim, paired, key_offset):
    tokens, _, dim = qk.shape
    n = F.rms_norm(qk.float(), (dim,), eps=EPS)
    f1, f2 = factor1.float()[:, None], factor2.float()[:, None]

    def rotate(x):
        if paired:
            x = x.reshape(tokens, num_heads // 2, 2 * dim)
            return (f1 * x + f2 * swap_pairs(x)).reshape(2 * tokens, num_heads // 2, dim)
        return f1 * x + f2 * swap_pairs(x)

    q, k = rotate(n[:, :num_heads]), rotate(n[:, num_heads:])
    if key_offset:
        stationary = torch.cat((k[:1, :, rotary_dim:], n[:-1, num_heads:, rotary_dim:]))
        k = torch.cat((k[:, :, :rotary_dim], stationary), dim=-1)
    return q.to(BF16), k.to(BF16)


def chain_backward_fp8(grad_q, grad_k, grad_v, qk, factor1, factor2, grad_scale, num_heads,
                       rotary_dim, paired, key_offset):
    tokens, _, dim = qk.shape
    x = qk.float()
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS)
    n = x * rstd
    f1, f2 = factor1.float()[:, None], factor2.float()[:, None]

    def rotate_back(g):  # gradient of y = f1*n + f2*swap(n), gathered back to [T, H, D]
        if paired:
            g = g.reshape(tokens, num_heads // 2, 2 * dim).float()
            return (f1 * g + swap_pairs(f2 * g)).reshape(tokens, num_heads, dim)
        g = g.float()
        return f1 * g + swap_pairs(f2 * g)

    dn_q, dn_k = rotate_back(grad_q), rotate_back(grad_k)
    if key_offset:
        g = grad_k.float()[:, :, rotary_dim:]
        stationary = torch.cat((g[1:], torch.zeros_like(g[:1])))
        stationary[0] += g[0]
        dn_k = torch.cat((dn_k[:, :, :rotary_dim], stationary), dim=-1)
    dn = torch.cat((dn_q, dn_k), dim=1)
    dx = rstd * (dn - n * (dn * n).mean(-1, keepdim=True))
    features = torch.cat((dx.to(BF16).reshape(tokens, -1), grad_v.reshape(tokens, -1)), dim=1)
    grad_row = (features.float() / grad_scale).clamp(-448, 448).to(E4M3)
    return grad_row, grad_row.t().contiguous()


def chain_bf16_projection(x, qk_weight, v_weight, factor1, factor2, num_heads, rotary_dim, paired,
                          key_offset):
    """The unfused bf16 chain these ops replace: x @ W.T, split, rms_norm, rotary."""
    qk_features = qk_weight.shape[0]
    qkv = x @ torch.cat((qk_weight, v_weight)).T
    qk = qkv[:, :qk_features].view(x.shape[0], 2 * num_heads, -1)
    v = qkv[:, qk_features:].view(x.shape[0], num_heads, -1)
    q, k = chain_forward(qk, factor1, factor2, num_heads, rotary_dim, paired, key_offset)
    return q, k, v


# ---- the reference implementation (seed file) ---------------------------------------------

def load_reference(path):
    loader = importlib.machinery.SourceFileLoader("qkvfuse_reference", str(path))
    spec = importlib.util.spec_from_loader("qkvfuse_reference", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def reference_backward_fp8(seed, grad_q, grad_k, grad_v, qk, factor1, factor2, grad_scale,
                           num_heads, rotary_dim, paired, key_offset):
    """The reference's fused backward kernel alone, launched as its PackedFP8QKVFunction.backward
    launches it (grid, block sizes, warps), without the GEMMs around it."""
    tokens, _, qk_dim = qk.shape
    v_dim = grad_v.shape[-1]
    qkv_dim = 2 * num_heads * qk_dim + num_heads * v_dim
    grad_row = torch.empty((tokens, qkv_dim), device=qk.device, dtype=E4M3)
    grad_t = torch.empty((qkv_dim, tokens), device=qk.device, dtype=E4M3)
    block_t = 32
    seed._qkv_norm_rope_pack_fp8_backward_kernel[(num_heads, triton.cdiv(tokens, block_t))](
        grad_q, grad_k, grad_v, qk, factor1, factor2, grad_row, grad_t, grad_scale,
        tokens=tokens, num_heads=num_heads, qk_dim=qk_dim, rotary_dim=rotary_dim, v_dim=v_dim,
        qkv_dim=qkv_dim, stride_qkt=qk.stride(0), stride_qkh=qk.stride(1),
        factor_stride_t=factor1.stride(0),
        stride_grad_q_t=grad_q.stride(0), stride_grad_q_h=grad_q.stride(1),
        stride_grad_k_t=grad_k.stride(0), stride_grad_k_h=grad_k.stride(1),
        stride_grad_v_t=grad_v.stride(0), stride_grad_v_h=grad_v.stride(1),
        PAIRED=paired, KEY_OFFSET=key_offset, BLOCK_T=block_t,
        BLOCK_QK=triton.next_power_of_2(qk_dim), BLOCK_V=triton.next_power_of_2(v_dim),
        num_warps=4 if qk_dim <= 64 else 8,
    )
    return grad_row, grad_t


# ---- inputs -------------------------------------------------------------------------------

def rotary_tables(tokens, width, rotary_dim, device):
    pairs = torch.arange(width // 2, device=device, dtype=torch.float32)
    freq = torch.where(2 * pairs < rotary_dim, 1024.0 ** (-2 * pairs / rotary_dim), 0.0)
    theta = torch.arange(tokens, device=device, dtype=torch.float32)[:, None] * freq
    sign = torch.tensor([1.0, -1.0], device=device).repeat(width // 2)
    return (theta.cos().repeat_interleave(2, 1).to(BF16),
            (theta.sin().repeat_interleave(2, 1) * sign).to(BF16))


def qkv_dim(shape):
    return 2 * shape.heads * shape.qk_dim + shape.heads * shape.v_dim


def norm_inputs(shape, tokens, device):
    """qk as the Q/K column slice of a [T, qkv_dim] GEMM output, and bf16 factor tables."""
    qkv = torch.randn(tokens, qkv_dim(shape), device=device).to(BF16)
    qk = qkv[:, : 2 * shape.heads * shape.qk_dim].view(tokens, 2 * shape.heads, shape.qk_dim)
    width = 2 * shape.qk_dim if shape.paired else shape.qk_dim
    return (qk, *rotary_tables(tokens, width, shape.rotary_dim, device))


def backward_inputs(shape, tokens, device):
    qk, factor1, factor2 = norm_inputs(shape, tokens, device)
    out = ((2 * tokens, shape.heads // 2, shape.qk_dim) if shape.paired
           else (tokens, shape.heads, shape.qk_dim))
    grad_q = torch.randn(out, device=device).to(BF16)
    grad_k = torch.randn(out, device=device).to(BF16)
    grad_v = torch.randn(tokens, shape.heads, shape.v_dim, device=device).to(BF16)
    grad_scale = torch.tensor(1 / 448, device=device)
    return grad_q, grad_k, grad_v, qk, factor1, factor2, grad_scale


class PackedProblem:
    """One layer's packed-op inputs, as the speedrun builds them."""

    def __init__(self, shape, tokens, channels, device):
        self.shape = shape
        self.x = torch.randn(tokens, channels, device=device).to(BF16).requires_grad_()
        std = channels ** -0.5
        self.qk_weight = (torch.randn(2 * shape.heads * shape.qk_dim, channels, device=device)
                          * std).to(BF16).requires_grad_()
        self.v_weight = (torch.randn(shape.heads * shape.v_dim, channels, device=device)
                         * std).to(BF16).requires_grad_()
        self.qkv_scale = torch.tensor(1.0, device=device, requires_grad=True)
        self.x_scale = torch.tensor(8 / 448, device=device)
        self.grad_scale = torch.tensor(1 / 448, device=device)
        self.x_f8, self.x_f8_t = qkvfuse.quantize_dual_layout(self.x.detach(), self.x_scale)
        self.weight = qkvfuse.PackedWeightCache([(self.qk_weight, self.v_weight)])[0]
        width = 2 * shape.qk_dim if shape.paired else shape.qk_dim
        self.factor1, self.factor2 = rotary_tables(tokens, width, shape.rotary_dim, device)
        self.grads_out = None

    def arguments(self):
        s, w = self.shape, self.weight
        return (self.x, self.qk_weight, self.v_weight, w.weight_f8, w.weight_f8_t, w.weight_scale,
                self.qkv_scale, self.x_scale, self.grad_scale, self.factor1, self.factor2,
                s.heads, s.paired, s.key_offset, s.rotary_dim, self.x_f8, self.x_f8_t)

    def forward_backward(self, op):
        outputs = op(*self.arguments())
        if self.grads_out is None:
            self.grads_out = [torch.randn_like(t) for t in outputs]
        return torch.autograd.grad(outputs, (self.x, self.qk_weight, self.v_weight,
                                             self.qkv_scale), self.grads_out)


# ---- sections -----------------------------------------------------------------------------

def tensor_bytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_rows(section, shape, impls, min_bytes, copy_gbs):
    rows = []
    base = impls["qkvfuse"]
    for impl, ms in impls.items():
        gbs = min_bytes / ms / 1e6
        rows.append(Row(section, shape.label(), shape.mode, impl, ms, gbs, "GB/s",
                        100 * gbs / copy_gbs, ms / base))
    return rows


def bench_norm_forward(shape, args, seed, copy_gbs, l2_bytes):
    sets = rotating(lambda: norm_inputs(shape, args.tokens, "cuda"), l2_bytes,
                    args.budget_gib << 30)
    qk, factor1, factor2 = sets[0]
    q, k = qkvfuse.qk_norm_rope(qk, factor1, factor2, shape.heads, shape.rotary_dim, shape.paired,
                                shape.key_offset)
    layout = (shape.heads, shape.rotary_dim, shape.paired, shape.key_offset)
    compiled = torch.compile(chain_forward, fullgraph=True)
    impls = {
        "qkvfuse": median_ms(cycle(sets, lambda qk, f1, f2: torch.ops.qkvfuse.qk_norm_rope(
            qk, *qkvfuse.ops.rope_layout(*layout, factor1=f1, factor2=f2)))),
        "eager chain": median_ms(cycle(sets, lambda *a: chain_forward(*a, *layout))),
        "compiled chain": median_ms(cycle(sets, lambda *a: compiled(*a, *layout))),
    }
    if seed is not None:
        impls["reference"] = median_ms(
            cycle(sets, lambda *a: seed.qk_norm_rope_forward(*a, *layout)))
    # Minimum traffic: read Q/K and the factor tables once, write q and k.
    min_bytes = tensor_bytes(qk, factor1, factor2, q, k)
    return memory_rows("norm+rope forward", shape, impls, min_bytes, copy_gbs)


def bench_backward_fp8(shape, args, seed, copy_gbs, l2_bytes):
    sets = rotating(lambda: backward_inputs(shape, args.tokens, "cuda"), l2_bytes,
                    args.budget_gib << 30)
    first = sets[0]
    layout = (shape.heads, shape.rotary_dim, shape.paired, shape.key_offset)
    grad_row, grad_t = qkvfuse.qkv_backward_fp8(*first, *layout)
    compiled = torch.compile(chain_backward_fp8, fullgraph=True)
    impls = {
        "qkvfuse": median_ms(cycle(sets, lambda gq, gk, gv, qk, f1, f2, scale:
                                   torch.ops.qkvfuse.qkv_backward_fp8(
                                       gq, gk, gv, qk, scale,
                                       *qkvfuse.ops.rope_layout(*layout, factor1=f1,
                                                                factor2=f2)))),
        "eager chain": median_ms(cycle(sets, lambda *a: chain_backward_fp8(*a, *layout))),
        "compiled chain": median_ms(cycle(sets, lambda *a: compiled(*a, *layout))),
    }
    if seed is not None:
        impls["reference"] = median_ms(
            cycle(sets, lambda *a: reference_backward_fp8(seed, *a, *layout)))
    # Minimum traffic: read grad q/k/v, qk and the factors, write both e4m3 layouts.
    min_bytes = tensor_bytes(*first[:6], grad_row, grad_t)
    return memory_rows("fused fp8 backward", shape, impls, min_bytes, copy_gbs)


def bench_packed(shape, args, seed):
    problem = PackedProblem(shape, args.tokens, args.channels, "cuda")
    ops = {"qkvfuse": qkvfuse.packed_fp8_qkv}
    if seed is not None:
        ops["reference"] = seed.PackedFP8QKV
    rows = []
    base = {}
    for impl, op in ops.items():
        with torch.no_grad():
            forward_ms = median_ms(lambda: op(*problem.arguments()))
        step_ms = median_ms(lambda: problem.forward_backward(op))
        graph_ms = median_ms(cuda_graph(lambda: problem.forward_backward(op)))
        # Issue target: eager wall time per step within 15 % of CUDA-graph replay (host overhead).
        eager_wall, eager_host = steady_state_ms(lambda: problem.forward_backward(op))
        graph_wall, _ = steady_state_ms(cuda_graph(lambda: problem.forward_backward(op)))
        for what, ms in (("forward", forward_ms), ("fwd+bwd eager", step_ms),
                         ("fwd+bwd CUDA graph", graph_ms),
                         ("fwd+bwd eager wall/step", eager_wall),
                         ("fwd+bwd eager host/step", eager_host),
                         ("fwd+bwd graph wall/step", graph_wall)):
            base.setdefault(what, ms)
            rows.append(Row(f"packed op {what}", shape.label(), shape.mode, impl, ms,
                            vs_qkvfuse=ms / base[what]))
    # The bf16 chain these ops replace (projection + norm + rotary), forward + backward.
    chain_args = (problem.x, problem.qk_weight, problem.v_weight, problem.factor1,
                  problem.factor2, shape.heads, shape.rotary_dim, shape.paired, shape.key_offset)
    compiled = torch.compile(chain_bf16_projection, fullgraph=True)
    for impl, fn in (("bf16 eager chain", chain_bf16_projection),
                     ("bf16 compiled chain", compiled)):
        def step(fn=fn):
            outputs = fn(*chain_args)
            return torch.autograd.grad(outputs, (problem.x, problem.qk_weight, problem.v_weight),
                                       [torch.ones_like(t) for t in outputs])
        ms = median_ms(step)
        rows.append(Row("packed op fwd+bwd eager", shape.label(), shape.mode, impl, ms,
                        vs_qkvfuse=ms / base["fwd+bwd eager"]))
    return rows


def bench_gemms(shape, args):
    """The op's three GEMMs (d = a @ b^T, both operands K-major): forward (fast accumulation),
    wgrad and dgrad (exact accumulation)."""
    tokens, channels, features = args.tokens, args.channels, qkv_dim(shape)
    device = "cuda"

    def e4m3(rows, cols):
        return (torch.randn(rows, cols, device=device) * 64).clamp(-448, 448).to(E4M3)

    cases = [("forward", tokens, features, channels, True),
             ("wgrad", features, channels, tokens, False),
             ("dgrad", tokens, channels, features, False)]
    scale = torch.tensor(0.01, device=device)
    rows = []
    for name, m, n, k, fast_accum in cases:
        a, b = e4m3(m, k), e4m3(n, k)
        flops = 2.0 * m * n * k
        fns = {
            "qkvfuse": lambda: torch.ops.qkvfuse.fp8_gemm(a, b, scale, scale, None, fast_accum),
            "torch._scaled_mm": lambda: torch._scaled_mm(
                a, b.T, scale_a=scale, scale_b=scale, out_dtype=BF16, use_fast_accum=fast_accum),
        }
        # Interleaved rounds, the order alternating, median of the rounds: the two run the same
        # cuBLASLt kernel at most shapes, and a single back-to-back pair differed by up to 3 %
        # with the clock under the power cap (bench/results/
        # 2026-11-30_707eb03_h200_e4m3_xorsign_ab_gemm_picks.txt).
        times = {impl: [] for impl in fns}
        for r in range(5):
            for impl in (list(fns) if r % 2 == 0 else list(reversed(fns))):
                times[impl].append(median_ms(fns[impl]))
        impls = {impl: statistics.median(t) for impl, t in times.items()}
        for impl, ms in impls.items():
            rows.append(Row(f"fp8 gemm {name} [{m}x{n}x{k}]", shape.label(), shape.mode, impl, ms,
                            flops / ms / 1e9, "TFLOP/s", vs_qkvfuse=ms / impls["qkvfuse"]))
    return rows


# ---- output -------------------------------------------------------------------------------

def git_commit(given):
    if given:
        return given
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def fmt(value, digits):
    return "" if value is None else f"{value:.{digits}f}"


COLUMNS = ["section", "shape", "mode", "impl", "ms", "rate", "unit", "% copy", "x qkvfuse"]


def cells(row):
    return [row.section, row.shape, row.mode, row.impl, fmt(row.ms, 4), fmt(row.rate, 1),
            row.unit, fmt(row.pct_copy, 1), fmt(row.vs_qkvfuse, 2)]


def write_results(path, header, rows):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".md":
        lines = ["# qkvfuse PyTorch benchmark", ""]
        lines += [f"- {key}: {value}" for key, value in header.items()]
        lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
        lines += ["| " + " | ".join(cells(row)) + " |" for row in rows]
        path.write_text("\n".join(lines) + "\n")
    else:
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            for key, value in header.items():
                writer.writerow([f"# {key}", value])
            writer.writerow(COLUMNS)
            writer.writerows(cells(row) for row in rows)


def print_summary(rows):
    """One line per (section, shape, mode, impl), the ratio to qkvfuse last."""
    width = max(len(f"{r.section} | {r.shape} {r.mode} | {r.impl}") for r in rows)
    for r in rows:
        name = f"{r.section} | {r.shape} {r.mode} | {r.impl}"
        extra = f"{fmt(r.rate, 1)} {r.unit}".strip()
        if r.pct_copy is not None:
            extra += f" ({fmt(r.pct_copy, 1)} % copy)"
        ratio = f"x{r.vs_qkvfuse:.2f}" if r.vs_qkvfuse is not None else ""
        print(f"{name:<{width}}  {r.ms:8.4f} ms  {extra:<28} {ratio}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="results file: *.md for markdown, else CSV")
    parser.add_argument("--reference", help="path of the reference implementation (seed file)")
    parser.add_argument("--commit", help="git commit to record (default: git rev-parse HEAD)")
    parser.add_argument("--tokens", type=int, default=49152)
    parser.add_argument("--channels", type=int, default=768)
    parser.add_argument("--budget-gib", type=int, default=16,
                        help="device memory for rotated input copies")
    parser.add_argument("--sections", default="norm,backward,packed,gemm,general",
                        help="comma-separated subset of norm,backward,packed,gemm,general")
    parser.add_argument("--liger-path", default=os.environ.get("QKVFUSE_LIGER_PATH"),
                        help="general section: Liger-Kernel as a folder for sys.path, a "
                             "liger_kernel-*.whl or a folder holding one (default "
                             "$QKVFUSE_LIGER_PATH, else as installed; without it no Liger rows)")
    parser.add_argument("--axolotl-path", default=os.environ.get("QKVFUSE_AXOLOTL_PATH"),
                        help="general section: axolotl's fused RMSNorm + RoPE kernel, its file "
                             "or a folder holding it (default $QKVFUSE_AXOLOTL_PATH, else as "
                             "installed; without it no axolotl rows; it needs Liger-Kernel)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_torch.py needs a CUDA device")
    torch.manual_seed(0)
    seed = load_reference(args.reference) if args.reference else None
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 64 << 20)
    copy_gbs = copy_bandwidth_gbs("cuda")
    sections = set(args.sections.split(","))

    rows = []
    for shape in SHAPES:
        if "norm" in sections:
            rows += bench_norm_forward(shape, args, seed, copy_gbs, l2_bytes)
        if "backward" in sections:
            rows += bench_backward_fp8(shape, args, seed, copy_gbs, l2_bytes)
        if "packed" in sections:
            rows += bench_packed(shape, args, seed)
        torch.cuda.empty_cache()
    if "gemm" in sections:
        for shape in (Shape(6, 128), Shape(6, 96), Shape(12, 64)):
            rows += bench_gemms(shape, args)
    general_rows, general_header, general_passed = [], {}, True
    if "general" in sections:
        import bench_general  # the general layouts at the model shapes (its own module)
        try:
            general_rows, general_header, general_passed = bench_general.run(
                bench_general.section_args(args.liger_path, args.axolotl_path), copy_gbs,
                bench_general.Timers(median_ms, bench_general.cuda_split_ms, cycle),
                lambda make: rotating(make, l2_bytes, args.budget_gib << 30), Row)
        except Exception as error:  # keep the other sections' results
            traceback.print_exc()
            general_header = {"general check": "FAILED: the section raised "
                                               + bench_general.error_text(error)}
            general_passed = False
        rows += general_rows

    header = {
        "device": torch.cuda.get_device_name(0),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(args.commit),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "tokens": args.tokens,
        "channels": args.channels,
        "copy bandwidth (2 GiB buffer, read + write)": f"{copy_gbs:.0f} GB/s",
        "reference": args.reference or "not given",
        "timing": "triton.testing.do_bench median; L2 flushed per run, inputs rotated",
        **general_header,
    }
    write_results(args.out, header, rows)
    print(f"# {header['device']}, {header['date']}, commit {header['commit']}, "
          f"copy {copy_gbs:.0f} GB/s -> {args.out}")
    print_summary(rows)
    if general_rows:
        print("\n".join(bench_general.summary_lines(general_rows, copy_gbs)))
    if general_header:
        print(f"check {general_header['general check']}")
    if not general_passed:
        sys.exit(1)  # the results are written; a failed correctness check fails the run


if __name__ == "__main__":
    main()
