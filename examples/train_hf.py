"""Train a Hugging Face Qwen3-architecture model three ways: unpatched (bf16 autocast),
through qkvfuse in bf16 (apply_qkvfuse(model)) and through qkvfuse in FP8
(apply_qkvfuse(model, fp8=True)); compare the loss curves and the step times.

--family picks the architecture (the same width, depth and heads): qwen3 (the default, below),
gemma4 (Gemma4ForCausalLM: 5 sliding layers to 1 global of twice the head width with one KV head
per two and V from the key projection, the last quarter of the layers sharing K and V), qwen3-next
(Qwen3NextForCausalLM: three linear-attention layers to one gated attention layer, partial rotary
on a quarter of the head, MoE MLPs) or olmo3 (Olmo3ForCausalLM: the token-wide QK norm, 3 sliding
layers to 1 full). One run per new family, on a GPU:

    python3 examples/train_hf.py --family gemma4 --steps 1000 --out runs/hf_gemma4
    python3 examples/train_hf.py --family qwen3-next --steps 1000 --out runs/hf_qwen3_next
    python3 examples/train_hf.py --family olmo3 --steps 1000 --out runs/hf_olmo3

(On CUDA the Gemma 4 and OLMo 3 layouts wait for the kernels of SPEC.md section 9: their qkvfuse
variants stop at the first forward with an error naming the pending option; on the CPU, --tiny,
every family runs.)

The model is transformers' own Qwen3ForCausalLM built from a config (random weights, nothing
downloaded): width 768, 12 layers, 12 query heads and 4 key/value heads (GQA) of width 128,
MLP 2048, vocabulary 256 (bytes): 95 M parameters. The data is examples/train_gpt.py's: the Python
standard library's sources, byte level, 90/10 train/validation. Each variant starts from the
same initial weights (seeded, built on the CPU) and sees the same batches; float32 master
weights, bf16 autocast, AdamW (lr 1e-3 with 100 warm-up steps and a linear decay to 10 %),
gradient clipping at 1. The FP8 variant needs no extra call in the loop: each patched forward
quantizes the layer's current q/k/v weights and its input, and its backward scales the gradients
from their amax (current scaling, qkvfuse.packed_fp8_qkv_current_scaling).

On the device machine (one H200), all three variants, 2000 steps of 16 x 1024 tokens, then the
profile of the patched part:

    python3 examples/train_hf.py --steps 2000 --out runs/hf_1gpu --profile

or one variant per command (same weights and batches: the seeds decide), then one plot:

    python3 examples/train_hf.py --steps 2000 --variants unpatched-bf16 --out runs/hf_unpatched \\
        --profile
    python3 examples/train_hf.py --steps 2000 --variants qkvfuse-bf16 --out runs/hf_bf16 --profile
    python3 examples/train_hf.py --steps 2000 --variants qkvfuse-fp8 --out runs/hf_fp8 --profile
    python3 examples/train_hf.py --plot-from runs/hf_unpatched runs/hf_bf16 runs/hf_fp8 \\
        --out runs/hf_1gpu --title "Qwen3 95M, H200"

DDP or FSDP2 (--parallel fsdp: fully_shard on every decoder layer, then on the whole model) on
two GPUs (NCCL), the FP8 variant at the same global batch (8 sequences per rank). Every rank
draws the same global batch and trains on its slice (examples/train_gpt.py's Batches): the
sequences of a one-GPU run with --batch 16, or exactly those of --batch 8 --accum 2.

    torchrun --standalone --nproc-per-node 2 examples/train_hf.py --steps 2000 --batch 8 \\
        --variants qkvfuse-fp8 --parallel fsdp --out runs/hf_fsdp2
    python3 examples/train_hf.py --plot-from runs/hf_1gpu=1gpu runs/hf_fsdp2=fsdp2 \\
        --out runs/hf_1gpu_vs_fsdp2 --title "Qwen3 95M: one GPU and FSDP2 on two"

Duration on an H200 (measured 2026-12-03): 64-92 ms per step depending on the variant, 561 s for
the first command (all three variants and their profiles); the DDP run (not yet measured) should
take about as long as one variant.

CPU smoke tests (a tiny config, a few seconds per variant; the others run DDP and FSDP2 over
gloo; tests/python/test_train_distributed.py compares them with one process, --accum 2):

    python3 examples/train_hf.py --device cpu --tiny --steps 5 --profile
    torchrun --standalone --nproc-per-node 2 examples/train_hf.py --device cpu --tiny --steps 5
    torchrun --standalone --nproc-per-node 2 examples/train_hf.py --device cpu --tiny --steps 5 \\
        --parallel fsdp

Writes OUT/loss.csv (step, variant, train and validation loss, ms/step; the format of
train_gpt.py, so its plots combine), OUT/loss.png and OUT/summary.txt (final losses, median step
times and their ratios; with --profile the device time of the patched part alone per step, and
OUT/profile_<variant>.txt, the profiler's table of a few whole steps).
"""
import argparse
import csv
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_gpt import (  # noqa: E402
    Batches, gradient_sync, init_distributed, mean_over_ranks, parallelize, plot_from,
    report_checksums, report_step_times, stdlib_bytes, write_plot)

import transformers  # noqa: E402

from qkvfuse.integrations import transformers as qkvfuse_hf  # noqa: E402

BF16 = torch.bfloat16
VARIANTS = ("unpatched-bf16", "qkvfuse-bf16", "qkvfuse-fp8")


# ---- the model -------------------------------------------------------------------------------

FAMILIES = ("qwen3", "gemma4", "qwen3-next", "olmo3")


def model_config(args):
    """The --family's config at the run's width, depth and heads (module docstring)."""
    common = dict(vocab_size=256, hidden_size=args.dim, intermediate_size=args.mlp,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads,
                  num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                  max_position_embeddings=max(2048, args.seq_len), rms_norm_eps=1e-6,
                  tie_word_embeddings=False, use_cache=False, attention_dropout=0.0,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    layers = args.layers
    if args.family == "qwen3":
        return transformers.Qwen3Config(**common)
    if args.family == "gemma4":
        # HF's 5:1 sliding / global pattern; a small model alternates so that both kinds precede
        # the KV-shared last quarter (a shared layer reads the last earlier layer of its kind).
        kinds = (None if layers >= 6 else
                 ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])
        return transformers.Gemma4TextConfig(
            **common, layer_types=kinds, sliding_window=max(8, args.seq_len // 2),
            global_head_dim=2 * args.head_dim,
            num_global_key_value_heads=max(1, args.kv_heads // 2), attention_k_eq_v=True,
            num_kv_shared_layers=layers // 4 if layers >= 4 else 0, hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=256)
    if args.family == "qwen3-next":
        kinds = ["full_attention" if (i + 1) % 4 == 0 or (layers < 4 and i == layers - 1)
                 else "linear_attention" for i in range(layers)]
        return transformers.Qwen3NextConfig(
            **common, layer_types=kinds, linear_num_key_heads=args.kv_heads,
            linear_num_value_heads=args.heads, linear_key_head_dim=args.head_dim,
            linear_value_head_dim=args.head_dim, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=args.mlp // 2, shared_expert_intermediate_size=args.mlp // 2)
    if args.family == "olmo3":
        return transformers.Olmo3Config(**common, sliding_window=max(8, args.seq_len // 2))
    raise ValueError(args.family)


def build_model(variant, config, initial_state, args, device):
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=args.attn)
    model.load_state_dict(initial_state)
    model.to(device).train()
    if variant == "qkvfuse-bf16":
        qkvfuse_hf.apply_qkvfuse(model)
    elif variant == "qkvfuse-fp8":
        qkvfuse_hf.apply_qkvfuse(model, fp8=True)
    return model


def loss_of(model, idx, targets, device):
    with torch.autocast(device.type, dtype=BF16):
        logits = model(input_ids=idx, use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---- training ------------------------------------------------------------------------------------

def train(variant, config, initial_state, args, data, device, rank, world):
    module = build_model(variant, config, initial_state, args, device)
    # DDP: the only buffers are the rotary frequencies, equal on every rank; the FP8 scaling
    # state is not a buffer (per call, outside the module). FSDP2: fully_shard on each decoder
    # layer, then the whole model (apply_qkvfuse's FP8 layers then quantize their gathered
    # weights in each call).
    model = parallelize(module, args.parallel, module.model.layers, device, world)
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 100) * (0.1 + 0.9 * (1 - s / args.steps)))
    split = int(0.9 * len(data))
    train_batches = Batches(data[:split], args.batch, args.seq_len, args.seed + 1, device,
                            rank, world)
    val_batches = Batches(data[split:], args.batch, args.seq_len, args.seed + 10_000, device)

    def step():
        """One optimizer step over args.accum micro-batches; returns this rank's mean loss."""
        micro = train_batches.next_step(args.accum)
        loss = 0.0
        for m, (idx, targets) in enumerate(micro):
            with gradient_sync(model, m == len(micro) - 1):
                micro_loss = loss_of(model, idx, targets, device)
                (micro_loss / len(micro)).backward()
            loss = loss + micro_loss.detach()
        torch.nn.utils.clip_grad_norm_(module.parameters(), args.clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        return loss / len(micro)

    rows, step_ms, last_val = [], [], float("nan")
    progress = range(args.steps)
    try:
        from tqdm import tqdm
        if rank == 0:
            progress = tqdm(progress, desc=variant, file=sys.stdout, mininterval=2)
    except ImportError:
        pass  # the plain progress line below stands in for the bar
    timer, logged = time.perf_counter(), -1
    for i in progress:
        loss = step()
        if i == 0:
            report_checksums(f"{variant}: after step 1", module, rank, world)
        if i % args.log_every == 0 or i == args.steps - 1:
            loss = mean_over_ranks(loss, world)
            if device.type == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            ms = (now - timer) * 1e3 / (i - logged)
            logged = i
            if i >= args.log_every:  # the first interval holds warm-up and autotuning
                step_ms.append(ms)
            if i % args.val_every == 0 or i == args.steps - 1:
                last_val = evaluate(model, val_batches, args, device)
            rows.append((i, variant, loss, last_val, ms))
            tokens_s = args.batch * args.seq_len * args.accum * world / (ms / 1e3)
            if hasattr(progress, "set_postfix"):
                progress.set_postfix(loss=f"{loss:.3f}", val=f"{last_val:.3f}",
                                     tok_s=f"{tokens_s:,.0f}")
            elif rank == 0 and i % (4 * args.log_every) == 0:
                print(f"{variant}: step {i}/{args.steps} loss {loss:.3f} "
                      f"val {last_val:.3f} {tokens_s:,.0f} tok/s", flush=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            timer = time.perf_counter()  # the validation is not a training step's time
    report_checksums(f"{variant}: after step {args.steps}", module, rank, world)
    notes = []
    median = sorted(step_ms)[len(step_ms) // 2] if step_ms else float("nan")
    report_step_times(variant, median, rank, world)
    profile = None
    if args.profile and world == 1:  # under DDP every rank would have to run the steps
        profile = profile_variant(variant, module, step, args, device)
    elif args.profile and rank == 0:
        notes.append("--profile runs in single-process runs only")
    return rows, median, notes, profile


@torch.no_grad()
def evaluate(model, batches, args, device):
    losses = [loss_of(model, *batches.next(), device).item() for _ in range(args.val_batches)]
    return sum(losses) / len(losses)


# ---- profile: the whole step and the patched part alone ----------------------------------------

def hf_attention_input(attn, hidden_states, position_embeddings):
    """What apply_qkvfuse replaces, as transformers' Qwen3Attention.forward computes it:
    q/k/v projections, q_norm / k_norm and apply_rotary_pos_emb (the family's own functions)."""
    family = sys.modules[type(attn).__module__]
    hidden_shape = (*hidden_states.shape[:-1], -1, attn.head_dim)
    q = attn.q_norm(attn.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    v = attn.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = family.apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


def device_ms(prof, device):
    """Summed time of everything the profiler saw run on the device (CUDA: kernels, copies,
    memsets), or of the CPU ops on the CPU. On CUDA only the device's own events count: the CPU op
    that launched a kernel reports that kernel's time as its own "self device time" too, so a sum
    over every event would count each kernel twice."""
    from torch.autograd import DeviceType

    total = 0.0
    for event in prof.key_averages():
        if device.type == "cuda":
            if event.device_type != DeviceType.CPU:
                total += getattr(event, "self_device_time_total", None) or getattr(
                    event, "self_cuda_time_total", 0.0)
        else:
            total += event.self_cpu_time_total
    return total / 1e3


def profile_variant(variant, module, step, args, device):
    """(ms of the whole step, ms of the patched part per step) from torch.profiler; writes the
    whole steps' table to OUT/profile_<variant>.txt."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    # 1. A few whole training steps (after the run: the reported losses are unaffected).
    for _ in range(2):
        step()
    sync()
    with profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            step()
        sync()
    step_ms = device_ms(prof, device) / args.profile_steps
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_{variant}.txt").write_text(
        prof.key_averages().table(sort_by=sort, row_limit=40))

    if args.family != "qwen3":
        return step_ms, None  # the unpatched part below is written as Qwen3Attention computes it
    # 2. The patched part alone: layer 0's attention input (x -> q, k, v), forward + backward
    # at the training shape, as the step runs it (autocast, float32 input from the layer norm).
    attn = module.model.layers[0].self_attn
    fn = (hf_attention_input if variant == "unpatched-bf16" else qkvfuse_hf.attention_input)
    hidden = torch.randn(args.batch, args.seq_len, args.dim, device=device, requires_grad=True)
    positions = torch.arange(args.seq_len, device=device)[None]
    with torch.no_grad(), torch.autocast(device.type, dtype=BF16):
        cos_sin = module.model.rotary_emb(hidden, positions)

    def attention_input():
        with torch.autocast(device.type, dtype=BF16):
            outputs = fn(attn, hidden, cos_sin)
        torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
        module.zero_grad(set_to_none=True)
        hidden.grad = None

    for _ in range(3):
        attention_input()
    sync()
    with profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            attention_input()
        sync()
    layer_ms = device_ms(prof, device) / args.profile_steps
    # ones_like for the output gradients: three fills per call, in every variant alike. The FP8
    # variant's weight quantization runs inside each call (current scaling).
    part_ms = layer_ms * len(module.model.layers)
    return step_ms, part_ms


# ---- main ----------------------------------------------------------------------------------------

def summarize(results, args, world):
    """Lines of the closing summary: losses, step times and their ratios to the unpatched run."""
    lines = []
    for variant, (final_val, median_ms, notes, profile) in results.items():
        line = (f"{variant:>15}: final validation loss {final_val:.4f}, median step "
                f"{median_ms:.2f} ms")
        if profile and profile[1] is None:
            line += f"; profiler: step {profile[0]:.2f} ms of device time"
        elif profile:
            step_ms, part_ms = profile
            line += (f"; profiler: step {step_ms:.2f} ms of device time, patched part "
                     f"(q/k/v projections + q/k norm + rotary, {args.layers} layers, forward + "
                     f"backward) {part_ms:.2f} ms = {100 * part_ms / step_ms:.1f} %")
        lines.append(line)
        lines += [f"{'':>17}{note}" for note in notes]
    base = results.get("unpatched-bf16")
    for variant, (final_val, median_ms, _, profile) in results.items():
        if base is None or variant == "unpatched-bf16":
            continue
        lines.append(f"{variant} / unpatched-bf16: validation loss ratio "
                     f"{final_val / base[0]:.4f} ({100 * abs(final_val / base[0] - 1):.2f} % "
                     f"apart); step time ratio {median_ms / base[1]:.3f}"
                     + (f"; patched part ratio {profile[1] / base[3][1]:.3f}"
                        if profile and base[3] and profile[1] and base[3][1] else ""))
    if "qkvfuse-bf16" in results and "qkvfuse-fp8" in results:
        bf16, fp8 = results["qkvfuse-bf16"], results["qkvfuse-fp8"]
        lines.append(f"qkvfuse-fp8 / qkvfuse-bf16: step time ratio {fp8[1] / bf16[1]:.3f}"
                     + (f"; patched part ratio {fp8[3][1] / bf16[3][1]:.3f}"
                        if fp8[3] and bf16[3] and fp8[3][1] and bf16[3][1] else ""))
    lines.append(f"{world} rank(s){f' ({args.parallel})' if world > 1 else ''}, "
                 f"{args.accum} x {args.batch} x {args.seq_len} tokens per rank and step, "
                 f"{args.steps} steps")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3", choices=FAMILIES,
                        help="the model architecture (module docstring)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=16,
                        help="sequences per micro-batch per rank")
    parser.add_argument("--accum", type=int, default=1,
                        help="micro-batches per step (gradient accumulation)")
    parser.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp",
                        help="under torchrun: DDP, or FSDP2 (fully_shard per decoder layer, "
                             "then the root)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--mlp", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--val-every", type=int, default=250)
    parser.add_argument("--val-batches", type=int, default=16)
    parser.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager, ...)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a few-second CPU smoke config")
    parser.add_argument("--profile", action="store_true",
                        help="after training, profile whole steps and the patched part alone")
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--out", default="runs/train_hf")
    parser.add_argument("--plot-from", nargs="+", metavar="RUN[=LABEL]",
                        help="train nothing: plot these runs (an OUT folder or its loss.csv) "
                             "into OUT/loss.png, each variant named LABEL variant")
    parser.add_argument("--title", default="", help="the plot's title with --plot-from")
    args = parser.parse_args()
    if args.plot_from:
        runs = []
        for spec in args.plot_from:
            path, sep, label = spec.partition("=")
            if Path(path).is_dir():
                path = str(Path(path) / "loss.csv")
            runs.append(path + sep + label)
        plot_from(runs, Path(args.out), args.title)
        return
    if args.tiny:
        args.batch, args.seq_len, args.dim, args.layers, args.mlp = 2, 32, 64, 2, 128
        args.heads, args.kv_heads, args.head_dim = 4, 2, 32
        args.log_every, args.val_every, args.val_batches, args.profile_steps = 1, 2, 1, 2
        if args.family == "gemma4":
            args.layers = 4  # a sliding and a global layer, then one KV-shared layer of each
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")

    rank, world, device = init_distributed(args.device)
    transformers.logging.set_verbosity_error()
    data = stdlib_bytes(64 << 20)
    config = model_config(args)
    torch.manual_seed(args.seed)  # the same initial weights for every variant and rank
    initial = transformers.AutoModelForCausalLM.from_config(config)
    initial_state = {k: v.clone() for k, v in initial.state_dict().items()}
    parameters = sum(p.numel() for p in initial.parameters())
    del initial
    if rank == 0:
        print(f"data: {len(data) / 1e6:.1f} MB of Python stdlib source; "
              f"{transformers.AutoModelForCausalLM._model_mapping[type(config)].__name__} "
              f"{parameters / 1e6:.1f} M parameters; {world} rank(s)"
              f"{f' ({args.parallel})' if world > 1 else ''}; "
              f"{args.batch * args.seq_len * args.accum * world} tokens per step; transformers "
              f"{transformers.__version__}, torch {torch.__version__}", flush=True)
    rows, results = [], {}
    for variant in variants:
        variant_rows, median_ms, notes, profile = train(variant, config, initial_state, args,
                                                        data, device, rank, world)
        rows += variant_rows
        results[variant] = (variant_rows[-1][3], median_ms, notes, profile)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        lines = summarize(results, args, world)
        print("\n".join(lines))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with (out / "loss.csv").open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["step", "variant", "train_loss", "val_loss", "ms_per_step"])
            writer.writerows(rows)
        (out / "summary.txt").write_text("\n".join(lines) + "\n")
        title = ", ".join(f"{v}: val {r[0]:.3f}, {r[1]:.1f} ms/step" for v, r in results.items())
        write_plot(out / "loss.png", rows, title)
    if world > 1:
        # Every rank reaches the teardown before any tears down: under load a rank that destroyed
        # the group while rank 0 was still writing its outputs has ended in "terminate called
        # without an active exception" after a finished run (seen 2 times in 17 CI-style runs).
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
