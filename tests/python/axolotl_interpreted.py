"""Run by test_bench_general.py in a fresh process with TRITON_INTERPRET=1 (set before triton is
imported): bench_general.py's check of axolotl's kernel against the eager HF chain, on the CPU
through Triton's interpreter, at every model shape (T = 2 x 7), and once more at Qwen3-0.6B with
the weight convention swapped (unit_offset negated), which must fail. Prints one JSON object:
{model: [passed, line], "swapped": [passed, line]}.

  python axolotl_interpreted.py KERNEL_PATH   (the kernel's file or a folder holding it)"""
import json
import sys
import types
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_general as bg  # noqa: E402


@triton.jit
def interpreted_rsqrt(x):
    return tl.rsqrt(x)


def load(path):
    """bench_general's loader, then three stand-ins for what the interpreter lacks (the kernels'
    arithmetic unchanged): libdevice's rsqrt, the SM count the backward sizes its grid from, and
    the autotuner, which times its configurations on a GPU (the kernel runs with the first)."""
    axolotl, why = bg.load_axolotl(path)
    if axolotl is None:
        raise SystemExit(f"axolotl's kernel: {why}")
    module = sys.modules[bg.AXOLOTL_MODULE]
    module.rsqrt = interpreted_rsqrt
    module._rms_norm_rope_backward_kernel = module._rms_norm_rope_backward_kernel.fn
    torch.cuda.get_device_properties = lambda device: types.SimpleNamespace(
        multi_processor_count=2)
    return axolotl


def check(model, axolotl):
    p = bg.Problem(model, 2, 7, "cpu")
    return bg.check(p, bg.implementations(p, None, axolotl, False), p.make_set(dense=True), {})


def main():
    axolotl = load(sys.argv[1])
    torch.manual_seed(0)
    results = {m.name: check(m, axolotl) for m in bg.MODELS}
    swapped = bg.Axolotl(lambda x, w, cos, sin, eps, unit_offset: axolotl.fused_rms_norm_rope(
        x, w, cos, sin, eps=eps, unit_offset=not unit_offset), "unit_offset swapped")
    results["swapped"] = check(next(m for m in bg.MODELS if m.name == "Qwen3-0.6B"), swapped)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
