"""Side-by-side benchmark of the fused part of issue 32's families (SPEC.md section 9), bf16,
forward and backward (the norm weights receive gradients), against torch.compile of each family's
own chain, at T = 32768 tokens:

  Gemma4-global  Gemma 4 31B's global layers: Hq = 32, Hkv = 4, D = Dv = 512; q_norm, k_norm
                 (Gemma4RMSNorm: fp32 norm * w, one cast) and the weightless v_norm on V, NeoX
                 rotary over the whole head from a cos/sin cache (proportional rope: its higher
                 frequencies are zero in the cache, the same traffic). qkvfuse: one call
                 qk_norm_rope(qk, ..., v=v, normalize_v=True) -> (q, k, v_out), which on CUDA
                 runs only with QKVFUSE_CUDA_SECTION9=1 (D = 512 and the V norm).
  Qwen3-Next     Hq = 16, Hkv = 2, D = 256, zero-centred norms (1 + w), NeoX rotary on r = 64 of
                 the 256 lanes. The family's chain reads the query as a strided view of
                 q_proj's [T, Hq, 2D] output (query lanes [0, D) of each head, the gate after
                 them) and the key from k_proj; qkvfuse reads one [T, Hq + Hkv, D] column slice
                 of the projection whose weight rows apply_qkvfuse gathers as [query; key; value;
                 gate] (head stride D; the gate a column slice after them), as its bf16 path
                 does. Both start from a projection output of the same bytes.

The problem: 4 sequences of 8192 tokens (positions 0..8191 per sequence, int64), the inputs the
columns of a fresh bf16 projection output, eps 1e-6, bf16 weights, a bf16 cos/sin cache of 8192
positions with Hugging Face's frequencies (rope_theta 1e6), the chain's cos, sin [B, S, r] made
outside the timed region (as a model makes them once per forward).

Rows: `qkvfuse`, `eager chain`, `torch.compile` (of the same chain, dynamic=False,
fullgraph=True; AOTAutograd's compiled backward) and the bytes floor (each input read once, each
output written once, at the copy bandwidth measured in the same run); sections fwd (the training
forward: inputs require grad), bwd (torch.autograd.grad after a fresh forward, timed alone) and
fwd+bwd; timing as bench_general.py (do_bench medians, L2 flushed, inputs rotated). Issue 32's
targets: fwd+bwd >= 3x torch.compile, forward and backward >= 85 % of copy.

    python3 bench/bench_families.py --out results.csv [--models Gemma4-global,Qwen3-Next]
    python3 bench/bench_families.py --dry-run          (the CPU, a tiny T: every call once)
"""
import argparse
import datetime
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import qkvfuse

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_general as general  # noqa: E402  (timing, Impl, checks' error measure)

BF16 = torch.bfloat16
EPS = 1e-6
SECTIONS = ("families fwd", "families bwd", "families fwd+bwd")


@dataclass(frozen=True)
class Family:
    name: str
    heads: int  # Hq
    kv_heads: int  # Hkv
    dim: int  # D (= Dv)
    rotary: int  # r
    v_norm: bool  # Gemma 4's weightless V norm in the same op
    offset: float  # 1: zero-centred weights (1 + w)

    def label(self):
        return f"{self.name} Hq={self.heads} Hkv={self.kv_heads} D={self.dim} r={self.rotary}"

    def mode(self):
        return ("neox w, v_norm, cache" if self.v_norm else
                "neox 1+w, partial rotary, gated query view, cache")


FAMILIES = [
    Family("Gemma4-global", 32, 4, 512, 512, True, 0.0),
    Family("Qwen3-Next", 16, 2, 256, 64, False, 1.0),
]


# ---- each family's own chain (transformers 5.17, restated) -------------------------------------
# transformers:src/transformers/models/gemma4/modeling_gemma4.py (Gemma4RMSNorm, with_scale=False
# for v_norm; Gemma4TextAttention.forward) and .../qwen3_next/modeling_qwen3_next.py
# (Qwen3NextRMSNorm: fp32 norm * (1 + w); Qwen3NextAttention.forward: q_proj(...).view(..., H, 2D)
# .chunk(2); apply_rotary_pos_emb on the first r lanes); docs/families.md has the table.

def rms(x, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(x, cos, sin):
    """NeoX on the first cos.shape[-1] lanes of [B, H, S, D]; the rest pass through."""
    r = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot, rest = x[..., :r], x[..., r:]
    rot = rot * cos + rotate_half(rot) * sin
    return torch.cat((rot, rest), dim=-1) if rest.shape[-1] else rot


def gemma4_chain(qkv, q_weight, k_weight, cos, sin, heads: int, kv_heads: int, dim: int,
                 batch: int):
    dtype = qkv.dtype
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q = (rms(q.view(batch, -1, heads, dim), EPS) * q_weight.float()).to(dtype)
    k = (rms(k.view(batch, -1, kv_heads, dim), EPS) * k_weight.float()).to(dtype)
    v = rms(v.view(batch, -1, kv_heads, dim), EPS).to(dtype)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return rotary(q, cos, sin), rotary(k, cos, sin), v


def qwen3_next_chain(proj, q_weight, k_weight, cos, sin, heads: int, kv_heads: int, dim: int,
                     batch: int):
    dtype = proj.dtype
    query_gate, k = proj.split([heads * 2 * dim, kv_heads * dim], dim=-1)
    query, _gate = query_gate.view(batch, -1, heads, 2 * dim).chunk(2, dim=-1)
    q = (rms(query, EPS) * (1.0 + q_weight.float())).to(dtype)
    k = (rms(k.view(batch, -1, kv_heads, dim), EPS) * (1.0 + k_weight.float())).to(dtype)
    q, k = (t.transpose(1, 2) for t in (q, k))
    return rotary(q, cos, sin), rotary(k, cos, sin)


# ---- the problem ---------------------------------------------------------------------------------

class Problem:
    def __init__(self, family: Family, batch: int, seq_len: int, device: str):
        f = self.family = family
        self.batch, self.seq_len, self.device = batch, seq_len, device
        self.tokens = batch * seq_len
        self.positions = torch.arange(seq_len, device=device).repeat(batch)
        self.cos_sin = qkvfuse.rotary_cos_sin(seq_len, f.rotary, base=1e6, dtype=BF16,
                                              device=device)
        half = f.rotary // 2
        angles = self.cos_sin[self.positions].view(batch, seq_len, f.rotary)
        # HF's cos, sin [B, S, r]: cat(freqs, freqs) of each, from the same cache values.
        self.cos = torch.cat((angles[..., :half], angles[..., :half]), dim=-1)
        self.sin = torch.cat((angles[..., half:], angles[..., half:]), dim=-1)
        mean = 0.0 if f.offset else 1.0
        self.q_weight = (mean + 0.1 * torch.randn(f.dim, device=device)).to(BF16).requires_grad_()
        self.k_weight = (mean + 0.1 * torch.randn(f.dim, device=device)).to(BF16).requires_grad_()

    def make_set(self):
        """(chain_proj, fused_proj, grads): a fresh bf16 projection output in the layout the
        family's chain reads and the same values in the layout qkvfuse reads (leaves requiring
        grad; Gemma 4: one tensor, [q | k | v]; Qwen3-Next: [query+gate per head | key] and the
        gathered [query | key | gate]), and the output gradients [T, H, D] of q, k (and v_out)."""
        f, tokens = self.family, self.tokens
        if f.v_norm:
            proj = torch.randn(tokens, (f.heads + 2 * f.kv_heads) * f.dim, device=self.device)
            proj = proj.to(BF16).requires_grad_()
            fused = proj
        else:
            proj = torch.randn(tokens, (2 * f.heads + f.kv_heads) * f.dim, device=self.device)
            proj = proj.to(BF16).requires_grad_()
            query_gate = proj.detach()[:, : 2 * f.heads * f.dim].view(tokens, f.heads, 2 * f.dim)
            fused = torch.cat((query_gate[..., : f.dim].reshape(tokens, -1),
                               proj.detach()[:, 2 * f.heads * f.dim:],
                               query_gate[..., f.dim:].reshape(tokens, -1)), dim=1)
            fused = fused.requires_grad_()
        grads = [torch.randn(tokens, f.heads, f.dim, device=self.device).to(BF16),
                 torch.randn(tokens, f.kv_heads, f.dim, device=self.device).to(BF16)]
        if f.v_norm:
            grads.append(torch.randn(tokens, f.kv_heads, f.dim, device=self.device).to(BF16))
        return proj, fused, grads

    def canonical_grad(self, proj_grad, fused: bool):
        """The projection's gradient as [T, Hq + Hkv (+ Hkv), D] rows of q, k (and v), from
        either layout (the check compares them)."""
        f, tokens = self.family, self.tokens
        if f.v_norm:
            return proj_grad.view(tokens, -1, f.dim)
        if fused:
            return proj_grad[:, : (f.heads + f.kv_heads) * f.dim].reshape(tokens, -1, f.dim)
        query = proj_grad[:, : 2 * f.heads * f.dim].view(tokens, f.heads, 2 * f.dim)[..., : f.dim]
        key = proj_grad[:, 2 * f.heads * f.dim:].view(tokens, f.kv_heads, f.dim)
        return torch.cat((query, key), dim=1)

    def qkvfuse_forward(self, s):
        f, proj = self.family, s[1]
        qk = proj[:, : (f.heads + f.kv_heads) * f.dim].view(self.tokens, -1, f.dim)
        kwargs = dict(num_heads=f.heads, num_kv_heads=f.kv_heads, rotary_style="neox",
                      q_weight=self.q_weight, k_weight=self.k_weight, weight_offset=f.offset,
                      eps=EPS, cos_sin=self.cos_sin, positions=self.positions)
        if f.v_norm:
            v = proj[:, (f.heads + f.kv_heads) * f.dim:].view(self.tokens, f.kv_heads, f.dim)
            return qkvfuse.qk_norm_rope(qk, v=v, normalize_v=True, **kwargs)
        return qkvfuse.qk_norm_rope(qk, **kwargs)

    def chain_args(self, proj):
        f = self.family
        return (proj, self.q_weight, self.k_weight, self.cos, self.sin, f.heads, f.kv_heads,
                f.dim, self.batch)

    def hf_grads(self, grads):
        """[T, H, D] -> the [B, H, S, D] transposes the chain's outputs have."""
        return tuple(g.unflatten(0, (self.batch, -1)).transpose(1, 2) for g in grads)

    def to_tokens(self, t):
        return t.transpose(1, 2).reshape(self.tokens, t.shape[1], t.shape[3])

    def floor_bytes(self):
        """{section: minimum bytes}: every input read once, every output written once."""
        f = self.family
        rows = f.heads + f.kv_heads + (f.kv_heads if f.v_norm else 0)
        values = self.tokens * rows * f.dim * 2
        angles = self.cos_sin.numel() * 2 + self.positions.numel() * 8
        weights = 2 * f.dim * 2
        forward = 2 * values + angles + weights
        backward = 3 * values + angles + 2 * weights
        return {SECTIONS[0]: forward, SECTIONS[1]: backward, SECTIONS[2]: forward + backward}


def implementations(p: Problem, compile_chain: bool):
    chain = gemma4_chain if p.family.v_norm else qwen3_next_chain
    chain_inputs = lambda s: (s[0], p.q_weight, p.k_weight)  # noqa: E731
    fused_inputs = lambda s: (s[1], p.q_weight, p.k_weight)  # noqa: E731
    hf_tokens = lambda outputs: tuple(p.to_tokens(t) for t in outputs)  # noqa: E731
    chain_grad = lambda g: (p.canonical_grad(g[0], fused=False), *g[1:])  # noqa: E731
    fused_grad = lambda g: (p.canonical_grad(g[0], fused=True), *g[1:])  # noqa: E731
    impls = [
        general.Impl("qkvfuse", p.qkvfuse_forward, fused_inputs, lambda s: tuple(s[2]), tuple,
                     grad_qk=fused_grad),
        general.Impl("eager chain", lambda s: chain(*p.chain_args(s[0])), chain_inputs,
                     lambda s: p.hf_grads(s[2]), hf_tokens, grad_qk=chain_grad),
    ]
    if compile_chain:
        compiled = torch.compile(chain, dynamic=False, fullgraph=True)
        impls.append(general.Impl("torch.compile", lambda s: compiled(*p.chain_args(s[0])),
                                  chain_inputs, lambda s: p.hf_grads(s[2]), hf_tokens,
                                  grad_qk=chain_grad))
    return impls


def check(p: Problem, impls, s):
    """(passed, line): each implementation's outputs and gradients against the eager chain's
    (relative error < 1e-2: both round to bf16)."""
    outputs, grads = {}, {}
    for impl in impls:
        out = impl.forward(s)
        outputs[impl.name] = [t.detach().float() for t in impl.tokens(out)]
        grads[impl.name] = [g.float() for g in impl.grad_qk(
            torch.autograd.grad(out, impl.inputs(s), impl.grads(s)))]
    want_out, want_grads = outputs["eager chain"], grads["eager chain"]
    parts, passed = [], True
    for impl in impls:
        if impl.name == "eager chain":
            continue
        worst = max([general.rel_error(a, b) for a, b in zip(outputs[impl.name], want_out)] +
                    [general.rel_error(a, b) for a, b in zip(grads[impl.name], want_grads)])
        ok = worst < 1e-2
        passed &= ok
        parts.append(f"{impl.name} {'ok' if ok else 'FAILED'} (worst rel error {worst:.2g})")
    return passed, f"{p.family.name}: " + ", ".join(parts)


def time_impl(impl, sets, timers):
    names = {"general fwd": SECTIONS[0], "general bwd": SECTIONS[1],
             "general fwd+bwd": SECTIONS[2]}
    return {names[k]: ms for k, ms in general.time_impl(impl, sets, timers).items()}


def bench_family(family, args, copy_gbs, timers, make_sets, row_type):
    p = Problem(family, args.batch, args.seq_len, args.device)
    sets = make_sets(p.make_set)
    impls = implementations(p, not args.no_compile)
    passed, line = check(p, impls, sets[0])
    print(f"check {line}", flush=True)
    times = {impl.name: time_impl(impl, sets, timers) for impl in impls}
    floor = p.floor_bytes()
    rows = []
    for section in SECTIONS:
        base = times["qkvfuse"][section]
        entries = [("bytes floor", floor[section] / copy_gbs / 1e6)] + [
            (name, t[section]) for name, t in times.items()]
        for name, ms in entries:
            gbs = floor[section] / ms / 1e6
            rows.append(row_type(section, family.label(), family.mode(), name, ms, gbs, "GB/s",
                                 100 * gbs / copy_gbs, ms / base))
    return rows, passed, line


def summary_lines(rows):
    by = {(r.shape, r.section, r.impl): r for r in rows}
    lines = []
    for shape in dict.fromkeys(r.shape for r in rows):
        q = {s: by[(shape, s, "qkvfuse")] for s in SECTIONS}
        compiled = by.get((shape, SECTIONS[2], "torch.compile"))
        parts = [f"fwd {q[SECTIONS[0]].ms:.3f} ms ({q[SECTIONS[0]].pct_copy:.0f}% copy, >= 85)",
                 f"bwd {q[SECTIONS[1]].ms:.3f} ms ({q[SECTIONS[1]].pct_copy:.0f}%, >= 85)",
                 f"fwd+bwd {q[SECTIONS[2]].ms:.3f} ms"]
        met = q[SECTIONS[0]].pct_copy >= 85 and q[SECTIONS[1]].pct_copy >= 85
        if compiled:
            parts.append(f"torch.compile {compiled.ms:.3f} ms ({compiled.vs_qkvfuse:.2f}x, >= 3)")
            met = met and compiled.vs_qkvfuse >= 3
        lines.append(f"families {shape.split()[0]}: {', '.join(parts)}: "
                     f"{'met' if met else 'NOT met'}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    general.main_arguments(parser)
    parser.add_argument("--models", default=",".join(f.name for f in FAMILIES),
                        help="comma-separated subset of " + ",".join(f.name for f in FAMILIES))
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    args = parser.parse_args()
    args.batch = args.batch or (2 if args.dry_run else 4)
    args.seq_len = args.seq_len or (16 if args.dry_run else 8192)
    import bench_torch as common

    torch.manual_seed(0)
    if args.dry_run:
        args.device = "cpu"
        nbytes = 64 << 20
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        copy_gbs = 2 * nbytes / general.cpu_median_ms(lambda: dst.copy_(src)) / 1e6
        timers = general.Timers(general.cpu_median_ms, general.cpu_split_ms, common.cycle)
        make_sets = lambda make: [make(), make()]  # noqa: E731
    else:
        if not args.out:
            parser.error("--out is required on the GPU")
        if not torch.cuda.is_available():
            raise SystemExit("bench_families.py needs a CUDA device (or --dry-run)")
        if os.environ.get("QKVFUSE_CUDA_SECTION9") != "1":
            print("note: QKVFUSE_CUDA_SECTION9=1 is not set: CUDA refuses Gemma 4's D = 512 and "
                  "V norm (its rows fail)", flush=True)
        args.device = "cuda"
        props = torch.cuda.get_device_properties(0)
        l2_bytes = getattr(props, "L2_cache_size", 64 << 20)
        copy_gbs = common.copy_bandwidth_gbs("cuda")
        timers = general.Timers(common.median_ms, general.cuda_split_ms, common.cycle)
        make_sets = lambda make: common.rotating(make, l2_bytes, args.budget_gib << 30)  # noqa

    wanted = [n for n in args.models.split(",") if n]
    unknown = set(wanted) - {f.name for f in FAMILIES}
    if unknown:
        raise SystemExit(f"unknown models {sorted(unknown)}; known: {[f.name for f in FAMILIES]}")
    rows, lines, passed = [], [], True
    for family in [f for f in FAMILIES if f.name in wanted]:
        try:
            family_rows, ok, line = bench_family(family, args, copy_gbs, timers, make_sets,
                                                 common.Row)
        except Exception as error:  # one family's failure costs its rows, not the run
            family_rows, ok, line = [], False, f"{family.name}: FAILED ({general.error_text(error)})"
            print(f"check {line}", flush=True)
        rows += family_rows
        lines.append(line)
        passed &= ok
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        header = {
            "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (dry run)",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": common.git_commit(args.commit),
            "torch": torch.__version__,
            "tokens": args.batch * args.seq_len,
            "copy bandwidth (2 GiB buffer, read + write)": f"{copy_gbs:.0f} GB/s",
            "QKVFUSE_CUDA_SECTION9": os.environ.get("QKVFUSE_CUDA_SECTION9", "unset"),
            "families check": ("passed: " if passed else "FAILED: ") + " | ".join(lines),
        }
        common.write_results(args.out, header, rows)
        print(f"-> {args.out}")
    if rows:
        common.print_summary(rows)
        print("\n".join(summary_lines(rows)))
    print(f"check {'passed' if passed else 'FAILED'}: " + " | ".join(lines))
    if not passed:
        sys.exit(1)


if __name__ == "__main__":
    main()
