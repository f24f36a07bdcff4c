"""Timeline of one packed-op step (forward + backward through torch.autograd.grad) replayed as a
CUDA graph: each GPU activity's duration and the idle gap before it, from torch.profiler's trace,
for qkvfuse and, with --reference, the reference implementation. Shows where the step's time goes
without the timing overhead of a per-kernel benchmark; run it on an idle GPU (a long run at full
power lowers the SM clock: see docs/perf_notes.md).

  python bench/profile_packed.py [--reference /path/to/seed.txt] [--heads 6] [--head-dim 128]
      [--mode plain|paired|key_offset] [--tokens 49152] [--channels 768]
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_torch as bt  # noqa: E402  (PackedProblem, cuda_graph, load_reference)
import qkvfuse  # noqa: E402


def step_timeline(replay, replays=3):
    """GPU activities of the middle one of `replays` graph replays, in start order."""
    for _ in range(5):
        replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.load(open(trace.name))["traceEvents"]
    gpu = sorted((e for e in events if e.get("ph") == "X"
                  and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                 key=lambda e: e["ts"])
    per_step = len(gpu) // replays
    return gpu[per_step:2 * per_step], gpu[2 * per_step]["ts"] - gpu[per_step]["ts"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--mode", default="plain", choices=("plain", "paired", "key_offset"))
    parser.add_argument("--tokens", type=int, default=49152)
    parser.add_argument("--channels", type=int, default=768)
    args = parser.parse_args()
    shape = bt.Shape(args.heads, args.head_dim, mode=args.mode)
    problem = bt.PackedProblem(shape, args.tokens, args.channels, "cuda")
    ops = {"qkvfuse": qkvfuse.packed_fp8_qkv}
    if args.reference:
        ops["reference"] = bt.load_reference(args.reference).PackedFP8QKV
    for name, op in ops.items():
        step, period = step_timeline(bt.cuda_graph(lambda op=op: problem.forward_backward(op)))
        print(f"== {name}, {shape.label()} {shape.mode}, T = {args.tokens}: one graph replay")
        busy = gaps = 0.0
        previous_end = step[0]["ts"]
        for e in step:
            gap = max(e["ts"] - previous_end, 0.0)
            busy, gaps = busy + e["dur"], gaps + gap
            print(f"  gap {gap:7.2f} us  {e['dur']:8.2f} us  {e['name'][:96]}")
            previous_end = e["ts"] + e["dur"]
        print(f"  busy {busy:.1f} us + gaps {gaps:.1f} us; replay to replay {period:.1f} us")


if __name__ == "__main__":
    main()
