"""Train a small GPT twice, with the attention input through qkvfuse.packed_fp8_qkv and through a
plain bf16 PyTorch chain, and compare the loss curves and step times.

The data is the Python standard library's own source, byte level (every machine with Python has it:
no download). The model mixes what the speedrun mixes: Q/K head widths 64, 96 and 128 with V width
128, one paired-head layer and one key-offset layer (rotary_dim = D/2). In the qkvfuse variant each
block quantizes its attention input once (x_f8, x_f8_t), and the packed e4m3 weights of every layer
are refreshed in one call after each optimizer step (PackedWeightCache).

    python examples/train_gpt.py --steps 2000 --out runs/gpt            # one GPU, both variants
    torchrun --nproc-per-node 2 examples/train_gpt.py --steps 2000 ...   # DDP over NCCL
    torchrun --nproc-per-node 2 examples/train_gpt.py --parallel fsdp ... # FSDP2 over NCCL
    python examples/train_gpt.py --device cpu --steps 3 --tiny           # smoke test on the CPU
    torchrun --nproc-per-node 2 examples/train_gpt.py --device cpu --tiny --steps 3  # gloo

Several processes (torchrun) train one model data-parallel: DDP, or FSDP2 (--parallel fsdp:
fully_shard on every block, then on the whole model). Every rank draws the same global batch of
batch x ranks x accum sequences per step and trains on its own slices, so a run on N ranks with
--batch B sees the sequences of a one-process run with --batch B --accum N, micro-batch for
micro-batch, and computes the same per-call FP8 scales (tests/python/test_train_distributed.py
checks the losses and parameters against that run).

Writes OUT/loss.csv (step, variant, train and validation loss, ms/step) and OUT/loss.png; the
train loss is the mean over every rank's and micro-batch's loss of the step.
"""
import argparse
import csv
import math
import os
import sys
import sysconfig
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import qkvfuse

BF16 = torch.bfloat16
EPS = torch.finfo(torch.float32).eps
E4M3_MAX = 448.0
# Gradient scaling. The gradients reaching the attention input are small (the loss is a mean over
# every token of the batch: about 1e-6 per element at 16k tokens), so a fixed grad_scale of 1/448
# divides them into e4m3's subnormal range and most round to zero: the Q/K/V weights then barely
# train (measured: validation loss 1.78 against the bf16 twin's 0.79 after 3000 steps). Instead
# each layer sets grad_scale from the amax of this step's grad q/k/v (current scaling, on the
# device, no host sync): the tensor hooks on q, k and v run before the packed op's backward reads
# the scale. GRAD_HEADROOM leaves room for the norm backward, whose output can exceed |grad q|.
GRAD_HEADROOM = 4.0


# ---- data -----------------------------------------------------------------------------------

def stdlib_bytes(limit: int) -> torch.Tensor:
    """The standard library's .py sources, concatenated, as a uint8 tensor (at most `limit`)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8)


class Batches:
    """Random windows of `seq_len + 1` bytes, `batch` per micro-batch. Every rank draws the same
    windows from one seeded stream: a step's batch x ranks x accum windows, of which micro-batch
    m of rank r is slice m * ranks + r. One process with accum = N therefore sees, micro-batch
    for micro-batch, what N ranks see (the losses of the two runs can be compared exactly)."""

    def __init__(self, data: torch.Tensor, batch: int, seq_len: int, seed: int, device,
                 rank: int = 0, world: int = 1):
        self.data, self.batch, self.seq_len, self.device = data, batch, seq_len, device
        self.rank, self.world = rank, world
        self.generator = torch.Generator().manual_seed(seed)

    def next_step(self, accum: int = 1):
        """This rank's `accum` micro-batches of the next step: [(inputs, targets)] [B, S]."""
        starts = torch.randint(0, len(self.data) - self.seq_len - 1,
                               (accum * self.world * self.batch,), generator=self.generator)
        out = []
        for m in range(accum):
            first = (m * self.world + self.rank) * self.batch
            windows = torch.stack([self.data[s:s + self.seq_len + 1]
                                   for s in starts[first:first + self.batch]]).long()
            windows = windows.to(self.device, non_blocking=True)
            out.append((windows[:, :-1], windows[:, 1:]))
        return out

    def next(self):
        return self.next_step(1)[0]


# ---- data parallel: DDP or FSDP2 under torchrun (shared with train_hf.py) ---------------------

def init_distributed(device_arg: str):
    """(rank, world, device) from torchrun's environment: NCCL with one GPU per process, gloo
    with --device cpu (the CPU check of the multi-process path); one process: --device as is."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world == 1:
        return rank, world, torch.device(device_arg)
    if device_arg == "cpu":
        dist.init_process_group("gloo")
        return rank, world, torch.device("cpu")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return rank, world, device


def parallelize(model: nn.Module, parallel: str, layers, device, world: int) -> nn.Module:
    """What the training loop calls: the model itself (one process), DDP around it, or the
    model with FSDP2's fully_shard applied to each of `layers` (its blocks), then to itself.
    Build the optimizer afterwards: fully_shard turns the parameters into DTensor shards."""
    if world == 1:
        return model
    if parallel == "ddp":
        # The buffers are per-rank scaling state or constants: nothing to broadcast.
        return nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            broadcast_buffers=False)
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    raise ValueError(f"--parallel: expected ddp or fsdp, got {parallel!r}")


def gradient_sync(model: nn.Module, last: bool):
    """Around one micro-batch's backward: the ranks reduce their gradients on the last one only
    (gradient accumulation). DDP: no_sync(); FSDP2: set_requires_gradient_sync."""
    if hasattr(model, "no_sync"):
        return nullcontext() if last else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last)
    return nullcontext()


def mean_over_ranks(value: torch.Tensor, world: int) -> float:
    """The mean of a scalar over the ranks (every rank calls it at the same steps)."""
    if world > 1:
        value = value.detach().clone()
        dist.all_reduce(value)
        value /= world
    return value.item()


# ---- rotary tables --------------------------------------------------------------------------

def rotary_tables(seq_len, batch, width, rotary_dim, device):
    """Interleaved rotary factors for `batch` packed sequences: factor1 = cos, factor2 = sin with
    odd lanes negated; dims >= rotary_dim (within each width-wide row) stationary (1, 0)."""
    position = torch.arange(seq_len, dtype=torch.float64).repeat(batch)[:, None]
    lane = torch.arange(width)
    pair = (lane % rotary_dim) // 2 if rotary_dim else lane * 0
    freq = (1 / 1024) ** (2 * pair.double() / max(rotary_dim, 1))
    angle = position * freq
    factor1 = torch.cos(angle)
    factor2 = torch.sin(angle) * torch.where(lane % 2 == 1, -1.0, 1.0)
    stationary = lane >= rotary_dim
    factor1[:, stationary], factor2[:, stationary] = 1.0, 0.0
    return factor1.to(device, BF16), factor2.to(device, BF16)


# ---- the attention input: qkvfuse and its bf16 twin ---------------------------------------------

@dataclass
class LayerSpec:
    qk_dim: int
    mode: str = "plain"  # plain | paired | key_offset

    @property
    def paired(self):
        return self.mode == "paired"

    @property
    def key_offset(self):
        return self.mode == "key_offset"

    @property
    def rotary_dim(self):
        return self.qk_dim // 2 if self.key_offset else self.qk_dim


def bf16_norm_rope(qk, factor1, factor2, heads, spec):
    """SPEC.md section 1 as a plain PyTorch chain (the reference the FP8 path is compared with)."""
    tokens, _, dim = qk.shape
    normed = F.rms_norm(qk.float(), (dim,), eps=EPS)
    out = []
    for part in (normed[:, :heads], normed[:, heads:]):
        n = part.reshape(tokens, heads // 2, 2 * dim) if spec.paired else part
        swapped = n.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        y = factor1.float()[:, None] * n + factor2.float()[:, None] * swapped
        out.append(y)
    q, k = out
    if spec.key_offset:
        # Key offset: a key's stationary dims (d >= rotary_dim) come from the normalized, unrotated
        # key of token t-1; token 0 keeps its own.
        shifted = torch.cat((k[:1], normed[:-1, heads:]), dim=0)
        k = torch.cat((k[..., :spec.rotary_dim], shifted[..., spec.rotary_dim:]), dim=-1)
    if spec.paired:
        q, k = q.reshape(2 * tokens, heads // 2, dim), k.reshape(2 * tokens, heads // 2, dim)
    return q.to(BF16), k.to(BF16)


class Attention(nn.Module):
    def __init__(self, dim, heads, v_dim, spec: LayerSpec, fp8: bool):
        super().__init__()
        self.heads, self.v_dim, self.spec, self.fp8 = heads, v_dim, spec, fp8
        std = dim ** -0.5
        self.qk_weight = nn.Parameter(torch.randn(2 * heads * spec.qk_dim, dim) * std)
        self.v_weight = nn.Parameter(torch.randn(heads * v_dim, dim) * std)
        # [1], not a scalar: FSDP2 shards parameters along dim 0 (the op reads it as [] below).
        self.qkv_scale = nn.Parameter(torch.ones(1))
        self.proj = nn.Linear(heads * v_dim, dim, bias=False)
        nn.init.zeros_(self.proj.weight)
        self.cache = None  # PackedWeight, set by the model's weight cache
        # The speedrun's activation scale: an RMS-normalized row of C elements has |x| <= sqrt(C),
        # so nothing saturates.
        self.register_buffer("x_scale", torch.tensor(dim ** 0.5 / E4M3_MAX), persistent=False)
        self.register_buffer("grad_scale", torch.tensor(1.0), persistent=False)
        self.register_buffer("grad_amax", torch.tensor(0.0), persistent=False)

    def _track_grad(self, grad):
        """Tensor hook on q, k and v: grad_scale = headroom * max|grad| / 448 over the three."""
        amax = torch.linalg.vector_norm(grad, float("inf")).float()
        torch.maximum(self.grad_amax, amax, out=self.grad_amax)
        # Never zero: a zero scale saturates every code (+-448, NaN for 0 / 0) and the backward
        # GEMMs then multiply by 0, so the gradients come out 0 or NaN (docs/special_values.md).
        torch.clamp_min(self.grad_amax * (GRAD_HEADROOM / E4M3_MAX), 2.0 ** -100,
                        out=self.grad_scale)

    def forward(self, x, x_q, factors, batch, seq_len):
        """x: the block's normalized input [T, C] bf16; x_q: its (x_f8, x_f8_t) quantization."""
        heads, spec = self.heads, self.spec
        factor1, factor2 = factors
        if self.fp8:
            # Under FSDP the model keeps no cache (GPT.per_call_weights): the block's forward
            # holds the full, freshly gathered weights, quantized here for this call.
            w = self.cache if self.cache is not None else qkvfuse.PackedWeightCache(
                [(self.qk_weight, self.v_weight)])[0]
            q, k, v = qkvfuse.packed_fp8_qkv(
                x, self.qk_weight.to(BF16), self.v_weight.to(BF16), w.weight_f8, w.weight_f8_t,
                w.weight_scale, self.qkv_scale.reshape(()), self.x_scale, self.grad_scale,
                factor1, factor2, heads, spec.paired, spec.key_offset, spec.rotary_dim, *x_q)
            if q.requires_grad:
                self.grad_amax.zero_()
                for output in (q, k, v):
                    output.register_hook(self._track_grad)
        else:
            weight = torch.cat((self.qk_weight, self.v_weight)).to(BF16)
            qkv = F.linear(x, weight) * self.qkv_scale.to(BF16)
            qk = qkv[:, :2 * heads * spec.qk_dim].view(-1, 2 * heads, spec.qk_dim)
            v = qkv[:, 2 * heads * spec.qk_dim:].reshape(-1, heads, self.v_dim)
            q, k = bf16_norm_rope(qk, factor1, factor2, heads, spec)
        # Paired layers see 2T positions of H/2 heads; the rest T positions of H heads.
        width = 2 if spec.paired else 1
        shape = (batch, width * seq_len, heads // width)
        q = q.reshape(*shape, spec.qk_dim).transpose(1, 2)
        k = k.reshape(*shape, spec.qk_dim).transpose(1, 2)
        v = v.reshape(*shape, self.v_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(batch * seq_len, heads * self.v_dim)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, dim, heads, v_dim, spec, fp8):
        super().__init__()
        self.attn = Attention(dim, heads, v_dim, spec, fp8)
        self.fc = nn.Linear(dim, 4 * dim, bias=False)
        self.out = nn.Linear(4 * dim, dim, bias=False)
        nn.init.zeros_(self.out.weight)

    def forward(self, x, factors, batch, seq_len):
        h = F.rms_norm(x, (x.shape[-1],)).to(BF16)
        # The block's activation quantize: done once, shared by whatever reads h in this block.
        x_q = qkvfuse.quantize_dual_layout(h.detach(), self.attn.x_scale) if self.attn.fp8 else None
        x = x + self.attn(h, x_q, factors, batch, seq_len)
        h = F.rms_norm(x, (x.shape[-1],)).to(BF16)
        return x + self.out(F.relu(self.fc(h)).square())


class GPT(nn.Module):
    def __init__(self, dim, heads, v_dim, specs, fp8):
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, v_dim, s, fp8) for s in specs)
        self.head = nn.Linear(dim, 256, bias=False)
        self.fp8 = fp8
        self.weight_cache = None
        # FSDP: between steps the weights are shards (DTensors), full only inside each block's
        # forward: each attention then quantizes its own weights per call (Attention.forward).
        self.per_call_weights = False

    def refresh_weight_cache(self):
        """After every optimizer step: re-quantize every layer's packed [Wq; Wk; Wv] in one call."""
        if not self.fp8 or self.per_call_weights:
            return
        if self.weight_cache is None:
            self.weight_cache = qkvfuse.PackedWeightCache(
                [(b.attn.qk_weight, b.attn.v_weight) for b in self.blocks])
        else:
            self.weight_cache.refresh()
        for i, block in enumerate(self.blocks):
            block.attn.cache = self.weight_cache[i]

    def forward(self, idx, targets, tables):
        batch, seq_len = idx.shape
        x = self.embed(idx).reshape(batch * seq_len, -1)
        for block in self.blocks:
            x = block(x, tables[block.attn.spec.qk_dim, block.attn.spec.mode], batch, seq_len)
        logits = self.head(F.rms_norm(x, (x.shape[-1],)).to(BF16)).float()
        return F.cross_entropy(logits, targets.reshape(-1))


# ---- training -------------------------------------------------------------------------------

def make_tables(specs, heads, batch, seq_len, device):
    tables = {}
    for spec in specs:
        width = 2 * spec.qk_dim if spec.paired else spec.qk_dim
        rotary = 2 * spec.rotary_dim if spec.paired else spec.rotary_dim
        tables[spec.qk_dim, spec.mode] = rotary_tables(seq_len, batch, width, rotary, device)
    return tables


def train(variant, args, data, device, rank, world):
    fp8 = variant == "qkvfuse-fp8"
    torch.manual_seed(args.seed)  # the same initial weights for both variants and every rank
    specs = args.specs
    module = GPT(args.dim, args.heads, args.v_dim, specs, fp8).to(device)
    module.per_call_weights = world > 1 and args.parallel == "fsdp"
    model = parallelize(module, args.parallel, module.blocks, device, world)
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 100) * (0.1 + 0.9 * (1 - s / args.steps)))
    split = int(0.9 * len(data))
    train_batches = Batches(data[:split], args.batch, args.seq_len, args.seed + 1, device,
                            rank, world)
    val_batches = Batches(data[split:], args.batch, args.seq_len, args.seed + 10_000, device)
    tables = make_tables(specs, args.heads, args.batch, args.seq_len, device)
    module.refresh_weight_cache()
    rows, step_ms, last_val = [], [], float("nan")
    progress = range(args.steps)
    try:
        from tqdm import tqdm
        if rank == 0:
            progress = tqdm(progress, desc=variant, file=sys.stdout, mininterval=2)
    except ImportError:
        pass  # the plain progress line below stands in for the bar
    timer = time.perf_counter()
    for step in progress:
        micro = train_batches.next_step(args.accum)
        loss = 0.0
        for m, (idx, targets) in enumerate(micro):
            with gradient_sync(model, m == len(micro) - 1):
                with torch.autocast(device.type, dtype=BF16):
                    micro_loss = model(idx, targets, tables)
                (micro_loss / len(micro)).backward()
            loss = loss + micro_loss.detach()
        loss = loss / len(micro)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        module.refresh_weight_cache()
        if step == 0:
            report_checksums(f"{variant}: after step 1", module, rank, world)
        if step % args.log_every == 0 or step == args.steps - 1:
            loss = mean_over_ranks(loss, world)
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            ms = (now - timer) * 1e3 / (args.log_every if step else 1)
            timer = now
            if step >= args.log_every:  # the first interval holds compilation and warm-up
                step_ms.append(ms)
            if step % args.val_every == 0 or step == args.steps - 1:
                last_val = evaluate(model, val_batches, tables, args, device)
            tokens_s = args.batch * args.seq_len * args.accum * world / (ms / 1e3)
            rows.append((step, variant, loss, last_val, ms))
            if hasattr(progress, "set_postfix"):
                progress.set_postfix(loss=f"{loss:.3f}", val=f"{last_val:.3f}",
                                     tok_s=f"{tokens_s:,.0f}")
            elif rank == 0 and step % (4 * args.log_every) == 0:
                print(f"{variant}: step {step}/{args.steps} loss {loss:.3f} "
                      f"val {last_val:.3f} {tokens_s:,.0f} tok/s", flush=True)
    report_checksums(f"{variant}: after step {args.steps}", module, rank, world)
    median = sorted(step_ms)[len(step_ms) // 2] if step_ms else float("nan")
    report_step_times(variant, median, rank, world)
    return rows, median


def report_checksums(when, module, rank, world):
    """Every rank must hold bit-identical parameters: the float64 sum of every tensor's float64
    sum, compared exactly across ranks (one process prints its own, for comparisons between
    runs). Under FSDP each parameter is first gathered whole (full_tensor: every rank calls)."""
    def whole(p):
        return p.full_tensor() if hasattr(p, "full_tensor") else p
    checksum = sum(whole(p.detach()).double().sum().item() for p in module.parameters())
    sums = [checksum]
    if world > 1:
        sums = [None] * world
        dist.all_gather_object(sums, checksum)
    if rank == 0:
        same = all(s == sums[0] for s in sums)
        print(f"{when}: parameter checksums per rank {sums}: "
              f"{'identical' if same else 'DIFFERENT'}", flush=True)


def report_step_times(variant, median_ms, rank, world):
    """Under several ranks: each rank's median step time (its own clock; the gradient reduction
    makes them wait for each other, so they differ by the ranks' own work between reductions)."""
    if world == 1:
        return
    times = [None] * world
    dist.all_gather_object(times, median_ms)
    if rank == 0:
        print(f"{variant}: median step per rank {', '.join(f'{t:.2f}' for t in times)} ms",
              flush=True)


@torch.no_grad()
def evaluate(model, batches, tables, args, device):
    losses = []
    for _ in range(args.val_batches):
        idx, targets = batches.next()
        with torch.autocast(device.type, dtype=BF16):
            losses.append(model(idx, targets, tables).item())
    return sum(losses) / len(losses)


def write_outputs(out, rows, summary):
    out.mkdir(parents=True, exist_ok=True)
    with (out / "loss.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "variant", "train_loss", "val_loss", "ms_per_step"])
        writer.writerows(rows)
    write_plot(out / "loss.png", rows, summary)


def write_plot(path, rows, title):
    """Train loss (faint) and validation loss (the last evaluation, as a step line) per variant;
    the y range leaves out the first steps' loss of a random model (about 5.6)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot written")
        return
    fig, ax = plt.subplots(figsize=(9, 5))
    for variant in dict.fromkeys(r[1] for r in rows):
        mine = [r for r in rows if r[1] == variant]
        line, = ax.plot([r[0] for r in mine], [r[2] for r in mine], alpha=0.35, linewidth=0.8,
                        label=f"{variant} train")
        ax.plot([r[0] for r in mine], [r[3] for r in mine], drawstyle="steps-post",
                color=line.get_color(), linewidth=1.8, label=f"{variant} validation")
    # The y range: every loss but those of the first 5 % of steps and the untrained model's
    # validation loss, which the step line carries until the first evaluation.
    first_val = {r[1]: r[3] for r in sorted(rows, key=lambda r: -r[0])}
    horizon = max(r[0] for r in rows) // 20
    late = [v for r in rows if r[0] > horizon for v in (r[2], r[3])
            if math.isfinite(v) and v != first_val[r[1]]]
    if late:
        ax.set_ylim(0.9 * min(late), 1.1 * max(late))
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def plot_from(specs, out, title):
    """--plot-from CSV[=LABEL] ...: one plot of earlier runs' curves, each variant named LABEL
    variant (e.g. the one-GPU and the two-GPU run side by side). Prints each curve's final
    validation loss and median logged step time, and how far the final loss is from the first
    run's for the same variant."""
    rows, first_label = [], None
    for spec in specs:
        path, _, label = spec.partition("=")
        first_label = label if first_label is None else first_label
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                name = f"{label} {r['variant']}" if label else r["variant"]
                rows.append((int(r["step"]), name, float(r["train_loss"]), float(r["val_loss"]),
                             float(r["ms_per_step"])))
    finals = {}
    for name in dict.fromkeys(r[1] for r in rows):
        mine = sorted(r for r in rows if r[1] == name)
        times = sorted(r[4] for r in mine[1:]) or [float("nan")]
        finals[name] = mine[-1][3]
        line = (f"{name}: final validation loss {mine[-1][3]:.4f} at step {mine[-1][0]}, "
                f"median logged step {times[len(times) // 2]:.2f} ms")
        base = f"{first_label} {name.split(' ', 1)[-1]}" if first_label else None
        if base in finals and base != name:
            line += f" ({100 * (finals[name] / finals[base] - 1):+.2f} % from {base})"
        print(line)
    out.mkdir(parents=True, exist_ok=True)
    write_plot(out / "loss.png", rows, title)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=16,
                        help="sequences per micro-batch per rank")
    parser.add_argument("--accum", type=int, default=1,
                        help="micro-batches per step (gradient accumulation)")
    parser.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp",
                        help="under torchrun: DDP, or FSDP2 (fully_shard per block, then root)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--v-dim", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--val-every", type=int, default=250)
    parser.add_argument("--val-batches", type=int, default=32)
    parser.add_argument("--variants", default="qkvfuse-fp8,bf16-chain",
                        help="comma-separated: qkvfuse-fp8 and/or bf16-chain")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a few-second CPU smoke configuration")
    parser.add_argument("--out", default="runs/train_gpt")
    parser.add_argument("--plot-from", nargs="+", metavar="CSV[=LABEL]",
                        help="train nothing: plot these runs' loss.csv into OUT/loss.png")
    parser.add_argument("--title", default="", help="the plot's title with --plot-from")
    args = parser.parse_args()
    if args.plot_from:
        plot_from(args.plot_from, Path(args.out), args.title)
        return
    args.specs = [LayerSpec(64), LayerSpec(64, "paired"), LayerSpec(96, "key_offset"),
                  LayerSpec(128)]
    if args.tiny:
        args.batch, args.seq_len, args.dim, args.heads, args.v_dim = 2, 16, 64, 2, 32
        args.specs = [LayerSpec(32), LayerSpec(32, "paired"), LayerSpec(32, "key_offset")]
        args.log_every, args.val_every, args.val_batches = 1, 1, 1

    rank, world, device = init_distributed(args.device)
    data = stdlib_bytes(64 << 20)
    if rank == 0:
        mode = f" ({args.parallel})" if world > 1 else ""
        print(f"data: {len(data) / 1e6:.1f} MB of Python stdlib source; {world} rank(s){mode}; "
              f"{args.batch * args.seq_len * args.accum * world} tokens per step")
    rows, summaries = [], []
    for variant in args.variants.split(","):
        variant_rows, median_ms = train(variant, args, data, device, rank, world)
        rows += variant_rows
        final_val = variant_rows[-1][3]
        summaries.append((variant, final_val, median_ms))
    if rank == 0:
        for variant, final_val, median_ms in summaries:
            print(f"{variant:>12}: final validation loss {final_val:.4f}, "
                  f"median step {median_ms:.2f} ms")
        if len(summaries) == 2:
            (_, fp8_val, fp8_ms), (_, ref_val, ref_ms) = summaries
            print(f"validation loss ratio fp8/bf16 = {fp8_val / ref_val:.4f} "
                  f"({100 * abs(fp8_val / ref_val - 1):.2f} % apart); step time ratio "
                  f"{fp8_ms / ref_ms:.3f}")
        summary = ", ".join(f"{v}: val {l:.3f}, {ms:.1f} ms/step" for v, l, ms in summaries)
        write_outputs(Path(args.out), rows, summary)
    if world > 1:
        # Every rank reaches the teardown before any tears down: under load a rank that destroyed
        # the group while rank 0 was still writing its outputs has ended in "terminate called
        # without an active exception" after a finished run (seen 2 times in 17 CI-style runs).
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
