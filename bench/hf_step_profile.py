"""bench/bench_hf_step.py --profile VARIANT: where one variant's training step spends its device
time, and the share of the attention input, the part of the step apply_qkvfuse replaces.

1. A few whole steps under torch.profiler: device time per step, the top kernels and their groups
   (GEMMs, sdpa attention, qkvfuse's kernels, Inductor's and other Triton kernels, the optimizer).
2. The attention input alone: layer 0's hidden states -> q, k, v (q/k/v projections, q/k norm,
   rotary), forward and backward, at the step's shape, as the variant computes it
   (qkvfuse.integrations.transformers.attention_input for the qkvfuse variants, transformers'
   chain with the family's (possibly Liger-patched) norm and rotary otherwise, each under
   torch.compile in the compiled variants), times the layers (FP8: each call quantizes its
   layer's weights as well). Its share of the step's device time bounds what any change of the
   attention input can win: were it free, the step would be step / (step - part) times faster.
   Inside a compiled model Inductor may fuse across the part's edges, which the part compiled
   alone cannot; the bound is then approximate.
On the CPU the tables list CPU ops instead of kernels (for the smoke test: the code runs).
"""
import re
import sys

import torch

from hf_step_variant import BF16, Shape, Variant, synchronize

PROFILED_STEPS = 3
TOP_KERNELS = 15

# Kernel groups by name, the first match wins (demangled CUDA names; Triton kernels carry their
# Python function's name; Inductor's start with triton_).
GROUPS = (
    ("qkvfuse", re.compile(r"qkvfuse::")),
    ("attention (sdpa)", re.compile(r"flash|fmha|attention", re.I)),
    ("GEMM", re.compile(r"gemm|xmma|nvjet|cutlass|wgmma|cublas", re.I)),
    ("optimizer", re.compile(r"multi_tensor|fused_adam|adamw", re.I)),
    ("Inductor (Triton)", re.compile(r"^triton_")),
    ("other Triton (Liger, torchao)", re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")),
    ("copies, fills", re.compile(r"^Memcpy|^Memset|copy_kernel|fill_kernel", re.I)),
)


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if pattern.search(name):
            return group
    return "other (elementwise, reductions)"


def device_times(prof, device: torch.device) -> dict:
    """{kernel name: device ms summed over the profiled region}. On CUDA only the device's own
    events count (the CPU op that launched a kernel reports its time too); on the CPU, CPU ops'
    self time."""
    from torch.autograd import DeviceType

    times = {}
    for event in prof.key_averages():
        if device.type == "cuda":
            if event.device_type == DeviceType.CPU:
                continue
            us = getattr(event, "self_device_time_total", None)
            if us is None:
                us = event.self_cuda_time_total
        else:
            us = event.self_cpu_time_total
        if us:
            times[event.key] = times.get(event.key, 0.0) + us / 1e3
    return times


def profiled(fn, count: int, device: torch.device) -> dict:
    """device_times of `count` calls of fn, per call."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(count):
            fn()
        synchronize(device)
    return {name: ms / count for name, ms in device_times(prof, device).items()}


def by_group(times: dict) -> dict:
    groups = {}
    for name, ms in times.items():
        group = group_of(name)
        groups[group] = groups.get(group, 0.0) + ms
    return dict(sorted(groups.items(), key=lambda item: -item[1]))


def hf_attention_input(attn, hidden_states, position_embeddings):
    """What apply_qkvfuse replaces, as transformers' Qwen3Attention.forward computes it: q/k/v
    projections, q_norm / k_norm and the family module's apply_rotary_pos_emb (Liger's after
    apply_liger_kernel_to_qwen3). examples/train_hf.py profiles the same chain."""
    family = sys.modules[type(attn).__module__]
    hidden_shape = (*hidden_states.shape[:-1], -1, attn.head_dim)
    q = attn.q_norm(attn.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    v = attn.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = family.apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


def attention_input_part(variant: Variant, shape: Shape, module, device: torch.device) -> dict:
    """device_times per step of the attention input alone (module docstring, item 2)."""
    from qkvfuse.integrations import transformers as qkvfuse_hf

    attn = module.model.layers[0].self_attn
    fn = qkvfuse_hf.attention_input if variant.qkvfuse else hf_attention_input
    if variant.compile:
        fn = torch.compile(fn)
    # The residual stream is float32 (float32 master weights under autocast).
    hidden = torch.randn(shape.batch, shape.seq, shape.hidden, device=device, requires_grad=True)
    positions = torch.arange(shape.seq, device=device)[None]
    with torch.no_grad(), torch.autocast(device.type, dtype=BF16):
        position_embeddings = module.model.rotary_emb(hidden, positions)

    def part():
        with torch.autocast(device.type, dtype=BF16):
            outputs = fn(attn, hidden, position_embeddings)
        torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
        module.zero_grad(set_to_none=True)
        hidden.grad = None

    for _ in range(3):  # compiles where compiled
        part()
    # FP8: each call quantizes its layer's weights too (current scaling), inside `part`.
    return {name: ms * shape.layers for name, ms in profiled(part, PROFILED_STEPS,
                                                             device).items()}


def report(variant_name: str, variant: Variant, shape: Shape, module, step,
           device: torch.device) -> None:
    """Prints the profile of module docstring's items 1 and 2."""
    step()
    step_times = profiled(step, PROFILED_STEPS, device)
    step_ms = sum(step_times.values())
    unit = "device" if device.type == "cuda" else "CPU op"
    print(f"== profile {variant_name}, {shape.describe()}: {step_ms:.2f} ms of {unit} time per "
          f"step ({PROFILED_STEPS} steps)")
    print(f"-- top {TOP_KERNELS} {'kernels' if device.type == 'cuda' else 'ops'}, ms per step")
    for name, ms in sorted(step_times.items(), key=lambda item: -item[1])[:TOP_KERNELS]:
        print(f"{ms:9.3f}  {100 * ms / step_ms:5.1f} %  {name[:140]}")
    print("-- groups, ms per step")
    for group, ms in by_group(step_times).items():
        print(f"{ms:9.3f}  {100 * ms / step_ms:5.1f} %  {group}")

    part_times = attention_input_part(variant, shape, module, device)
    part_ms = sum(part_times.values())
    groups = by_group(part_times)
    share = part_ms / step_ms if step_ms else float("nan")
    print(f"-- attention input (q/k/v projections, q/k norm, rotary; layer 0 alone x "
          f"{shape.layers} layers{', FP8 weights quantized' if variant.qkvfuse == 'fp8' else ''}"
          f"): {part_ms:.2f} ms per step, {100 * share:.1f} % of the step")
    for group, ms in groups.items():
        print(f"{ms:9.3f}  {100 * ms / step_ms:5.1f} %  {group}")
    bound = step_ms / (step_ms - part_ms) if step_ms > part_ms else float("inf")
    print(f"bound: were the attention input free, this step would be at most {bound:.3f}x "
          f"faster ({step_ms:.2f} ms -> {step_ms - part_ms:.2f} ms of {unit} time)")
