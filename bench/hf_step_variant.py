"""One variant of bench/bench_hf_step.py's whole training step, in this process: builds the model,
applies the variant's patches in the order a user applies them, times the steps and prints one
line `RESULT {json}` (bench_hf_step.py runs each variant in its own process, since Liger-Kernel
patches transformers' module globally; bench_hf_step.py's docstring says what is measured).

    python bench/hf_step_variant.py --shape qwen3-0.6b --variant qkvfuse-fp8 [--steps 25]
        [--warmup 3] [--device cuda] [--seed 0] [--profile]

Statuses: ok; refused (apply_qkvfuse raised UnsupportedModelError: the message is the reason);
skipped (a package or device the variant needs is missing: the reason says which); error (any
other exception: its type and message, the traceback on stderr).
"""
import argparse
import json
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Optional

import torch

BF16 = torch.bfloat16
RESULT_PREFIX = "RESULT "
LEARNING_RATE = 3e-4


@dataclass(frozen=True)
class Shape:
    model: str         # the model whose shapes these are
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int        # fewer than the model's: a step's time is per layer plus the ends
    batch: int
    seq: int
    vocab: int = 32768
    tie: bool = False  # tie_word_embeddings, as the model's config sets it

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def describe(self) -> str:
        return (f"{self.model} shapes, {self.layers} layers, {self.batch} x {self.seq} tokens "
                f"(hidden {self.hidden}, {self.q_heads} query / {self.kv_heads} key-value heads "
                f"of {self.head_dim}, MLP {self.intermediate}, vocabulary {self.vocab}"
                f"{', tied embeddings' if self.tie else ''})")


SHAPES = {
    "qwen3-0.6b": Shape("Qwen3-0.6B", 1024, 16, 8, 128, 3072, layers=12, batch=8, seq=2048,
                        tie=True),
    "qwen3-8b": Shape("Qwen3-8B", 4096, 32, 8, 128, 12288, layers=4, batch=4, seq=2048),
    # --smoke (CPU, CI): every code path in seconds. T = 64 and C = 64 keep the FP8 path on.
    "tiny": Shape("tiny", 64, 4, 2, 16, 128, layers=2, batch=2, seq=32, vocab=1024),
}


@dataclass(frozen=True)
class Variant:
    label: str                     # how docs/benchmarks.md names it
    baseline: str                  # the row its ratio is taken against
    liger: bool = False            # apply_liger_kernel_to_qwen3() before the model is built
    qkvfuse: Optional[str] = None  # None, "bf16": apply_qkvfuse(model), "fp8": (model, fp8=True)
    torchao: bool = False          # torchao float8 training on q/k/v_proj
    compile: bool = False          # torch.compile(model), last


VARIANTS = {
    "eager": Variant("unpatched (eager)", "eager"),
    "qkvfuse": Variant("`apply_qkvfuse(model)`", "eager", qkvfuse="bf16"),
    "qkvfuse-fp8": Variant("`apply_qkvfuse(model, fp8=True)`", "eager", qkvfuse="fp8"),
    "liger": Variant("Liger-Kernel `apply_liger_kernel_to_qwen3()` (defaults: rope, RMSNorm, "
                     "SwiGLU, fused linear cross entropy)", "liger", liger=True),
    "liger+qkvfuse": Variant("Liger, then `apply_qkvfuse(model)`", "liger", liger=True,
                             qkvfuse="bf16"),
    "liger+qkvfuse-fp8": Variant("Liger, then `apply_qkvfuse(model, fp8=True)`", "liger",
                                 liger=True, qkvfuse="fp8"),
    "compile": Variant("`torch.compile(model)`", "compile", compile=True),
    "qkvfuse+compile": Variant("`apply_qkvfuse(model)`, then `torch.compile(model)`", "compile",
                               qkvfuse="bf16", compile=True),
    "qkvfuse-fp8+compile": Variant("`apply_qkvfuse(model, fp8=True)`, then "
                                   "`torch.compile(model)`", "compile", qkvfuse="fp8",
                                   compile=True),
    "torchao-fp8+compile": Variant("torchao `convert_to_float8_training` on q/k/v_proj "
                                   "(default recipe: tensorwise), then `torch.compile(model)`",
                                   "compile", torchao=True, compile=True),
}

# torchao's float8 training runs torch._scaled_mm, which needs FP8 tensor cores.
TORCHAO_CAPABILITY = (8, 9)


def package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return ""


def environment(device: torch.device) -> dict:
    """What the row was measured with."""
    import transformers
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return dict(device=name, torch=torch.__version__, transformers=transformers.__version__,
                triton=package_version("triton"), liger_kernel=package_version("liger-kernel"),
                torchao=package_version("torchao"))


def unavailable(variant: Variant, device: torch.device) -> str:
    """Why the variant cannot run here ("" if it can)."""
    if variant.liger:
        if device.type != "cuda":
            return f"Liger-Kernel's kernels are Triton kernels for CUDA devices, not {device.type}"
        if not package_version("liger-kernel"):
            return "liger_kernel is not installed (scripts/device_prepare.sh carries its wheel)"
    if variant.torchao:
        if device.type != "cuda":
            return f"torchao float8 training needs a CUDA device with FP8 tensor cores, not " \
                   f"{device.type}"
        capability = torch.cuda.get_device_capability(device)
        if capability < TORCHAO_CAPABILITY:
            return f"torchao float8 training needs compute capability 8.9+, this device has " \
                   f"{capability[0]}.{capability[1]}"
        if not package_version("torchao"):
            return "torchao is not installed (scripts/device_prepare.sh carries its wheel)"
    return ""


# ---- the model ---------------------------------------------------------------------------------

def build_model(shape: Shape, device: torch.device, seed: int) -> torch.nn.Module:
    """transformers' Qwen3ForCausalLM from a config, float32, sdpa, with weights that depend on
    the seed and the parameter names alone (so every variant, Liger's module classes included,
    starts from the same weights)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.q_heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=max(40960, shape.seq), rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=shape.tie, use_cache=False, attention_dropout=0.0,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):  # every RMSNorm: ones, as transformers initializes
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, config.initializer_range, generator=generator)
    return model.train()


def apply_torchao_float8(model: torch.nn.Module) -> None:
    from torchao.float8 import convert_to_float8_training

    def qkv_only(module, fqn):
        return fqn.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj")

    convert_to_float8_training(model, module_filter_fn=qkv_only)


def prepare(variant: Variant, shape: Shape, device: torch.device, seed: int,
            compile_backend: str):
    """(module, model): the patched module and what the step calls (the compiled wrapper or the
    module itself). Raises UnsupportedModelError when apply_qkvfuse refuses the model."""
    if variant.liger:
        # Its defaults, before the model is built, as its docs show: the module globals
        # (Qwen3RMSNorm, Qwen3MLP, apply_rotary_pos_emb) and Qwen3ForCausalLM.forward are patched.
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3
        apply_liger_kernel_to_qwen3()
    module = build_model(shape, device, seed)
    if variant.torchao:
        apply_torchao_float8(module)
    if variant.qkvfuse:
        from qkvfuse.integrations.transformers import apply_qkvfuse
        apply_qkvfuse(module, fp8=variant.qkvfuse == "fp8")
    model = torch.compile(module, backend=compile_backend) if variant.compile else module
    return module, model


# ---- the step ----------------------------------------------------------------------------------

def make_step(module, model, shape: Shape, device: torch.device, seed: int):
    optimizer = torch.optim.AdamW(module.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95),
                                  weight_decay=0.0, fused=True)
    generator = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=generator).to(device)

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=BF16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step, count: int, device: torch.device):
    """(per-step ms, per-step losses). On CUDA each step lies between its own pair of events and
    nothing synchronizes before the end, so the host enqueues ahead as in training; a step the
    host cannot feed fast enough shows its idle gaps. On the CPU: the wall clock per step."""
    losses, times = [], []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(count)]
        for start, end in events:
            start.record()
            losses.append(step())
            end.record()
        synchronize(device)
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(count):
            begin = time.perf_counter()
            losses.append(step())
            times.append((time.perf_counter() - begin) * 1e3)
    return times, [loss.item() for loss in losses]


def graph_breaks() -> tuple:
    """(graph breaks, compiled graphs, the first reasons) from torch._dynamo's counters."""
    from torch._dynamo.utils import counters
    breaks = counters["graph_break"]
    reasons = "; ".join(reason.splitlines()[0][:120] for reason in list(breaks)[:3])
    return sum(breaks.values()), counters["stats"]["unique_graphs"], reasons


def run(shape_name: str, variant_name: str, steps: int, warmup: int, device: torch.device,
        seed: int, compile_backend: str, profile: bool) -> dict:
    shape, variant = SHAPES[shape_name], VARIANTS[variant_name]
    result = dict(shape=shape_name, variant=variant_name, status="ok", reason="",
                  **environment(device))
    reason = unavailable(variant, device)
    if reason:
        return dict(result, status="skipped", reason=reason)
    from qkvfuse.integrations.transformers import UnsupportedModelError

    try:
        module, model = prepare(variant, shape, device, seed, compile_backend)
    except UnsupportedModelError as error:
        return dict(result, status="refused", reason=str(error))
    step = make_step(module, model, shape, device, seed)

    # Warm-up: the first step compiles (torch.compile, Triton's autotuning) and allocates the
    # optimizer's state; its loss is the one every variant must agree on (same weights, batch).
    synchronize(device)
    begin = time.perf_counter()
    first_loss = step().item()
    result["first_step_s"] = round(time.perf_counter() - begin, 2)
    for _ in range(warmup - 1):
        step()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = timed_steps(step, steps, device)
    if device.type == "cuda":
        result["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    median = statistics.median(times)
    result.update(ms_median=round(median, 3), ms_mean=round(statistics.fmean(times), 3),
                  ms_min=round(min(times), 3), ms_max=round(max(times), 3),
                  tokens_per_s=round(shape.tokens / median * 1e3),
                  first_loss=first_loss, last_loss=losses[-1])
    if variant.compile:
        result["graph_breaks"], result["graphs"], result["graph_break_reasons"] = graph_breaks()
    if not all(math.isfinite(x) for x in [first_loss] + losses):
        result.update(status="error", reason=f"non-finite loss (first {first_loss}, "
                                             f"last {losses[-1]})")
    if profile:
        import hf_step_profile
        hf_step_profile.report(variant_name, variant, shape, module, step, device)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--variant", choices=list(VARIANTS), required=True)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed steps, profile a few more (hf_step_profile.py)")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 1:
        parser.error(f"--steps and --warmup must be at least 1, got {args.steps} and "
                     f"{args.warmup}")
    device = torch.device(args.device)
    try:
        result = run(args.shape, args.variant, args.steps, args.warmup, device, args.seed,
                     args.compile_backend, args.profile)
    except Exception as error:  # reported in the variant's row; the other variants still run
        traceback.print_exc()
        message = str(error).strip().splitlines()
        result = dict(shape=args.shape, variant=args.variant, status="error",
                      reason=f"{type(error).__name__}: {message[0][:300] if message else ''}")
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
