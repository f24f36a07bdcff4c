"""The memory traffic of a Hugging Face attention input, op by op, counted on the CPU (issue 31):
what one Qwen3 decoder layer does between its normed hidden states and sdpa's q, k, v, forward
and backward (down to the gradients of the fp32 master weights and of the hidden states), for
the variants bench/bench_hf_step.py times.

Every aten op (and qkvfuse op) that runs is recorded by a TorchDispatchMode with the bytes it
reads and writes: its tensor inputs and outputs at their logical sizes (a view costs nothing, an
in-place op reads and writes its self, copy_ and fills only write it). Liger-Kernel's Triton
kernels cannot run on the CPU: its RMSNorm and rotary functions are replaced by torch
equivalents that run unrecorded and are recorded as one op each with the bytes its kernel moves
(rms_norm: reads X, writes Y and the fp32 rstd; backward: reads dY, X, rstd, writes dX over dY;
rope: reads and writes q and k in place), the tensor handling around them (.contiguous(),
transposes) as it runs. GEMMs (mm, addmm) are listed apart: their traffic is the GEMM's own
(qkvfuse-fp8's GEMMs run inside its packed ops, whose bytes include their operands).

The layer runs at two token counts (batch 2 and 4 of --seq tokens, enough for the one-GEMM path
of apply_qkvfuse, which smaller token counts do not take; the cos/sin tables, [S, D] per forward,
are the traced S's) and each op's bytes are fitted
as a + b * tokens, then reported at the benchmark's shape (--batch x --seq-bench tokens): weight
casts and their gradients do not scale with the tokens, activations do. Milliseconds: the
non-GEMM bytes at --bandwidth, times --layers.

    python bench/attention_input_traffic.py [--variants eager,liger,qkvfuse,liger+qkvfuse,
        qkvfuse-fp8] [--ops]
(QKVFUSE_TORCH_LIBRARY and PYTHONPATH as for the tests; CPU only, a few seconds per variant.)
"""
import argparse
import contextlib
import sys
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

BF16 = torch.bfloat16
VARIANTS = ("eager", "liger", "qkvfuse", "liger+qkvfuse", "qkvfuse-fp8")

GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "fp8_gemm"}
FILLS = {"zeros", "zeros_like", "new_zeros", "fill_", "zero_", "full", "ones", "new_ones"}
COPIES = {"cat", "clone", "slice_backward", "select_backward", "stack", "index", "index_put_",
          "new_empty_strided", "_unsafe_index", "constant_pad_nd"}
REDUCTIONS = {"sum", "mean", "amax", "max", "var", "var_mean", "norm", "linalg_vector_norm"}
FREE = {"empty", "empty_like", "new_empty", "empty_strided", "_unsafe_view", "detach", "alias",
        "lift_fresh", "arange", "scalar_tensor", "_local_scalar_dense"}


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes of t's elements (a broadcast dim counts once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors(v)


@dataclass
class Op:
    name: str
    category: str
    read: int
    written: int
    phase: str
    shapes: str = ""


@dataclass
class Trace:
    ops: list = field(default_factory=list)
    phase: str = "forward"
    muted: int = 0

    def record(self, name, category, reads, writes, shapes=""):
        self.ops.append(Op(name, category, sum(map(tensor_bytes, reads)),
                           sum(map(tensor_bytes, writes)), self.phase, shapes))

    @contextlib.contextmanager
    def mute(self):
        self.muted += 1
        try:
            yield
        finally:
            self.muted -= 1


TRACE = Trace()


def _shape(t):
    return f"{list(t.shape)}{str(t.dtype).replace('torch.', ' ')}"


def _category(name, func, args, out):
    if name in GEMMS:
        return "GEMM"
    if func.namespace == "qkvfuse":
        return "fused op"
    if name in FILLS:
        return "fill"
    if name in ("_to_copy", "copy_"):
        src = args[1] if name == "copy_" else args[0]
        dst = args[0] if name == "copy_" else out
        return "cast" if src.dtype != dst.dtype else "copy"
    if name in COPIES or name.startswith("split") and name.endswith("backward"):
        return "copy"
    if name in REDUCTIONS:
        return "reduction"
    return "pointwise"


class Recorder(TorchDispatchMode):
    """Records every op below autograd (and autocast) with the bytes it reads and writes."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if TRACE.muted:
            return out
        name = func._schema.name.split("::")[-1]
        if func.is_view or name in FREE:
            return out
        inputs = list(tensors(list(args) + list(kwargs.values())))
        outputs = list(tensors(out))
        written = [a for i, a in enumerate(func._schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write]
        if written:  # in place or out=: the written tensors are outputs, read too unless copy/fill
            reads_self = name not in ("copy_", "fill_", "zero_") and not name.endswith("_out")
            written_tensors = [args[i] if i < len(args) else kwargs[a.name]
                               for i, a in enumerate(func._schema.arguments) if a in written]
            reads = [t for t in inputs if reads_self or all(t is not w for w in written_tensors)]
            writes = written_tensors
        else:
            storages = {t.untyped_storage().data_ptr() for t in inputs if t.device.type != "meta"}
            if outputs and all(o.untyped_storage().data_ptr() in storages for o in outputs):
                return out  # a view the schema does not call one (e.g. _unsafe_view)
            reads, writes = inputs, outputs
            if name in ("slice_backward", "select_backward"):
                writes = outputs + inputs  # a zero fill of the whole, then a copy into the part
        category = _category(name, func, args, out if isinstance(out, torch.Tensor) else None)
        shapes = ", ".join(_shape(t) for t in inputs[:3]) + " -> " + ", ".join(
            _shape(t) for t in writes[:3])
        TRACE.record(name, category, reads, writes, shapes)
        return out


# ---- Liger-Kernel's kernels as the CPU can run them, recorded as their kernels' traffic ---------

class LigerRMSNormOnCPU(torch.autograd.Function):
    """LigerRMSNormFunction's math in torch; one recorded op per kernel."""

    @staticmethod
    def forward(ctx, X, W, eps, offset=0.0, casting_mode="llama", in_place=True, row_mode=None):
        X = X.contiguous()  # its @ensure_contiguous
        with TRACE.mute():
            x = X.float()
            rstd = torch.rsqrt(x.pow(2).mean(-1) + eps)
            y = (x * rstd[..., None]).to(X.dtype)
            if W is not None:
                y = (y.float() * (W.float() + offset)).to(X.dtype)
        TRACE.record("liger_rms_norm_forward", "fused op", [X] + ([W] if W is not None else []),
                     [y, rstd], f"{_shape(X)} -> Y, rstd")
        ctx.save_for_backward(X, W, rstd)
        ctx.eps, ctx.offset = eps, offset
        return y

    @staticmethod
    def backward(ctx, dY):
        X, W, rstd = ctx.saved_tensors
        dY = dY.contiguous()
        with TRACE.mute():
            x = X.detach().float().requires_grad_()
            w = None if W is None else W.detach().float().requires_grad_()
            with torch.enable_grad():
                y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ctx.eps)
                if w is not None:
                    y = y * (w + ctx.offset)
                grads = torch.autograd.grad(y, (x,) if w is None else (x, w), dY.float())
            dX = grads[0].to(X.dtype)
        TRACE.record("liger_rms_norm_backward", "fused op", [dY, X, rstd], [dY],
                     f"{_shape(dY)} -> dX (in place)")
        dW = None
        if W is not None:
            with TRACE.mute():
                partial = torch.zeros(132, W.shape[0])  # one fp32 row per SM
            TRACE.record("liger_rms_norm_backward dW partials", "fused op", [], [partial])
            dW = grads[1].to(W.dtype)
            TRACE.record("sum (dW partials)", "reduction", [partial], [dW])
        return dX, dW, None, None, None, None, None


class LigerRopeOnCPU(torch.autograd.Function):
    """liger_rotary_pos_emb's math (HF's rotate_half) in torch; one recorded op per kernel, which
    rotates q and k in place."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        q = q.transpose(1, 2).contiguous()  # its physical layout [B, S, H, D]
        k = k.transpose(1, 2).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        with TRACE.mute():
            outs = [_rotate(t, cos, sin) for t in (q, k)]
        TRACE.record("liger_rope_forward", "fused op", [q, k, cos, sin], [q, k],
                     f"{_shape(q)}, {_shape(k)} in place")
        ctx.save_for_backward(cos, sin)
        return outs[0].transpose(1, 2), outs[1].transpose(1, 2)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq = dq.transpose(1, 2).contiguous()
        dk = dk.transpose(1, 2).contiguous()
        with TRACE.mute():
            outs = [_rotate(t, cos, -sin) for t in (dq, dk)]
        TRACE.record("liger_rope_backward", "fused op", [dq, dk, cos, sin], [dq, dk],
                     f"{_shape(dq)}, {_shape(dk)} in place")
        return outs[0].transpose(1, 2), outs[1].transpose(1, 2), None, None


def _rotate(t, cos, sin):
    """t [B, S, H, D] rotated NeoX-style by cos, sin [B or 1, S, D]."""
    half = t.shape[-1] // 2
    rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return (t.float() * cos[:, :, None].float() + rotated.float() * sin[:, :, None].float()).to(
        t.dtype)


def _liger_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    return LigerRopeOnCPU.apply(q, k, cos, sin)


def _patch_liger_for_cpu():
    import liger_kernel.transformers.rms_norm as rms_norm
    from liger_kernel.transformers import apply_liger_kernel_to_qwen3
    from transformers.models.qwen3 import modeling_qwen3

    apply_liger_kernel_to_qwen3()
    rms_norm.LigerRMSNormFunction = LigerRMSNormOnCPU
    modeling_qwen3.apply_rotary_pos_emb = _liger_rope


# ---- one layer's attention input ----------------------------------------------------------------

class Captured(Exception):
    """Raised by the attention function: the forward stops at sdpa with its q, k, v."""


def _capture(module, query, key, value, attention_mask, **kwargs):
    raise Captured(query, key, value)


@dataclass
class Config:
    hidden: int = 1024
    q_heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 3072


def build_attention(variant: str, cfg: Config):
    from transformers import Qwen3Config
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen3 import modeling_qwen3

    if variant.startswith("liger"):
        _patch_liger_for_cpu()
    ALL_ATTENTION_FUNCTIONS["qkvfuse_capture"] = _capture
    config = Qwen3Config(hidden_size=cfg.hidden, num_attention_heads=cfg.q_heads,
                         num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                         intermediate_size=cfg.intermediate, num_hidden_layers=1,
                         vocab_size=256, attn_implementation="sdpa")
    config._attn_implementation = "qkvfuse_capture"
    model = modeling_qwen3.Qwen3Model(config)
    if "qkvfuse" in variant:
        from qkvfuse.integrations.transformers import apply_qkvfuse
        apply_qkvfuse(model, fp8=variant.endswith("fp8"))
    return model


def trace_attention_input(model, batch: int, seq: int, seed: int = 0):
    """The recorded ops of one attention input, forward and backward: x (the normed hidden states,
    float32 as the decoder's RMSNorm returns them under autocast) -> q, k, v in bf16 (as sdpa's
    autocast casts them), under bf16 autocast; then backward from gradients laid out as flash
    attention's backward returns them ([B, S, H, D] storage, seen as [B, H, S, D])."""
    torch.manual_seed(seed)
    cfg = model.config
    attention = model.layers[0].self_attn
    model.zero_grad(set_to_none=True)
    leaf = torch.randn(batch, seq, cfg.hidden_size, requires_grad=True)
    # Not a leaf, as the decoder's norm output is not: autocast caches the casts of leaves only
    # (a view: its backward records nothing).
    x = leaf.view_as(leaf)
    positions = torch.arange(seq)[None]
    cos, sin = model.rotary_emb(x, positions)
    TRACE.ops.clear()
    TRACE.phase = "forward"
    with Recorder(), torch.autocast("cpu", dtype=BF16):
        try:
            attention(hidden_states=x, position_embeddings=(cos, sin), attention_mask=None)
        except Captured as stop:
            q, k, v = stop.args
        else:
            raise RuntimeError("the attention function was not reached")
        # sdpa's inputs as autocast casts them (HF's own rotary returns float32 q and k).
        outs = [t.to(BF16) for t in (q, k, v)]
    grads = [torch.randn(t.shape[0], t.shape[2], t.shape[1], t.shape[3], dtype=t.dtype
                         ).transpose(1, 2) for t in outs]
    TRACE.phase = "backward"
    with Recorder():
        torch.autograd.backward(outs, grads)
    layout = [f"{name} {list(t.shape)} strides {list(t.stride())}"
              for name, t in zip("qkv", outs)]
    return list(TRACE.ops), layout


def fit(small, large, tokens_small, tokens_large, tokens):
    """The ops of the two traces (the same sequence), their bytes fitted linearly in the tokens
    and evaluated at `tokens`."""
    names = [(o.name, o.phase) for o in small]
    if names != [(o.name, o.phase) for o in large]:
        import difflib
        diff = difflib.unified_diff([f"{o.phase} {o.name}" for o in small],
                                    [f"{o.phase} {o.name}" for o in large], lineterm="", n=1)
        raise RuntimeError("the two token counts ran different ops:\n" + "\n".join(diff))

    def at(a, b):
        return a + (b - a) * (tokens - tokens_small) / (tokens_large - tokens_small)

    def category(s, l):  # a cast whose bytes do not grow with the tokens casts weights
        if s.category != "cast":
            return s.category
        return "weight cast" if (s.read, s.written) == (l.read, l.written) else "cast"

    return [Op(s.name, category(s, l), int(at(s.read, l.read)), int(at(s.written, l.written)),
               s.phase, l.shapes) for s, l in zip(small, large)]


def run_variant(variant, args):
    model = build_attention(variant, Config())
    trace_attention_input(model, 2, args.seq)  # warm-up: what a patch creates once per model
    small, layout = trace_attention_input(model, 2, args.seq)
    large, _ = trace_attention_input(model, 4, args.seq)
    return fit(small, large, 2 * args.seq, 4 * args.seq, args.batch * args.seq_bench), layout


CATEGORIES = ("fused op", "weight cast", "cast", "copy", "fill", "pointwise", "reduction")


def summarize(variant, ops, args, show_ops):
    mb = 1e6
    non_gemm = [o for o in ops if o.category != "GEMM"]
    total = sum(o.read + o.written for o in non_gemm)
    ms = total / (args.bandwidth * 1e12) * 1e3 * args.layers
    lines = [f"### {variant}: {total / mb:.1f} MB of non-GEMM traffic per layer, "
             f"{ms:.2f} ms per step ({args.layers} layers at {args.bandwidth} TB/s)"]
    by = {}
    for o in non_gemm:
        key = (o.phase, o.category)
        by[key] = by.get(key, 0) + o.read + o.written
    lines.append("| phase | " + " | ".join(CATEGORIES) + " |")
    lines.append("| --- |" + " ---: |" * len(CATEGORIES))
    for phase in ("forward", "backward"):
        lines.append(f"| {phase} | " + " | ".join(
            f"{by.get((phase, c), 0) / mb:.1f}" for c in CATEGORIES) + " |")
    gemms = [o for o in ops if o.category == "GEMM"]
    lines.append(f"GEMMs: {len(gemms)} ({sum(o.read + o.written for o in gemms) / mb:.0f} MB of "
                 f"operands)")
    if show_ops:
        lines.append("")
        lines.append("| phase | op | category | read MB | written MB | shapes (trace) |")
        lines.append("| --- | --- | --- | ---: | ---: | --- |")
        for o in ops:
            lines.append(f"| {o.phase} | {o.name} | {o.category} | {o.read / mb:.1f} | "
                         f"{o.written / mb:.1f} | {o.shapes} |")
    return lines, total, ms


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--seq", type=int, default=1024,
                        help="tokens per sequence traced (batch 2 and 4); 2 x seq at least 1366 "
                             "for qkvfuse's one-GEMM path at the 0.6B shape")
    parser.add_argument("--batch", type=int, default=8, help="the benchmark's batch")
    parser.add_argument("--seq-bench", type=int, default=2048, help="the benchmark's sequence")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--bandwidth", type=float, default=3.0, help="TB/s")
    parser.add_argument("--ops", action="store_true", help="list every op")
    parser.add_argument("--variant-only", help=argparse.SUPPRESS)  # one variant in this process
    args = parser.parse_args(argv)
    if args.variant_only:
        ops, layout = run_variant(args.variant_only, args)
        lines, _, _ = summarize(args.variant_only, ops, args, args.ops)
        print("\n".join(lines))
        print("sdpa inputs: " + "; ".join(layout))
        return 0
    # Liger patches transformers' modules globally: one process per variant.
    import subprocess
    status = 0
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            parser.error(f"--variants: unknown {variant!r}; known: {', '.join(VARIANTS)}")
        command = [sys.executable, __file__, "--variant-only", variant, "--seq", str(args.seq),
                   "--batch", str(args.batch), "--seq-bench", str(args.seq_bench),
                   "--layers", str(args.layers), "--bandwidth", str(args.bandwidth)]
        if args.ops:
            command.append("--ops")
        done = subprocess.run(command)
        status = status or done.returncode
        print()
    return status


if __name__ == "__main__":
    sys.exit(main())
