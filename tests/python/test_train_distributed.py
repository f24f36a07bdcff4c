"""examples/train_gpt.py and examples/train_hf.py under torchrun, two processes over gloo on the
CPU (issue 34): DDP and FSDP2 (--parallel fsdp: fully_shard per block / decoder layer, then the
root), tiny configurations, a few steps, the bf16 and the FP8 variants of each script.

The one-process run at the same global batch is the script with --accum 2: every rank draws
the step's global batch and trains on its slice (the scripts' Batches), so the two ranks see
exactly the one process's two micro-batches, with the same per-call FP8 scales (current scaling
is per call: one call over the whole global batch would quantize with other scales). Asserted:
- the parameters identical across ranks after the first and the last step (float64 checksums
  gathered from every rank, compared exactly; under FSDP each parameter gathered whole);
- every logged train and validation loss equal to the one-process run's within LOSS_RTOL, and
  the parameters' checksums within CHECKSUM_ATOL.

Tolerances. Two ranks add each gradient element as a + b (one order) and divide by 2 (exact), so
DDP reproduces the one-process accumulation bit for bit (measured: identical losses and
checksums). Under FSDP, train_hf.py's clip_grad_norm_ sums the squares of each rank's shards
and then across ranks, another order than the one process's: its clip factor differs by float32
rounding (about 1e-7 relative), each parameter's update by that fraction (lr 1e-3: about 1e-10),
the checksum of the tiny models' ~1e5 parameters by at most ~1e-5 (measured 1.2e-8), and the
logged losses by far less than LOSS_RTOL (measured: the same bits). A wrong reduction (a rank
training alone, a stale FP8 weight) moves the losses by 1e-3 or more.
"""
import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

if not dist.is_available():  # pragma: no cover - torch builds without torch.distributed
    pytest.skip("torch.distributed is not available in this torch build", allow_module_level=True)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 3
LOSS_RTOL = 1e-6
CHECKSUM_ATOL = 1e-5
TIMEOUT_S = 600
SCRIPTS = {
    "train_gpt.py": ["--variants", "qkvfuse-fp8,bf16-chain"],
    "train_hf.py": ["--variants", "qkvfuse-bf16,qkvfuse-fp8"],
}
# The variant's name, then the line report_checksums prints (after a progress bar, at times).
CHECKSUMS = re.compile(r"([\w-]+): after step (\d+): parameter checksums per rank \[(.*?)\]: (\w+)")


def run(script, out, launcher, *extra):
    if script == "train_hf.py":
        pytest.importorskip("transformers", reason="Hugging Face transformers is not installed")
    # One thread per process: two ranks on a 2-core CI machine, and the same thread count in
    # the one-process run.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [*launcher, str(EXAMPLES / script), "--device", "cpu", "--tiny", "--steps", str(STEPS),
         *SCRIPTS[script], "--out", str(out), *extra],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with (out / "loss.csv").open(newline="") as f:
        losses = {(r["variant"], int(r["step"])): (float(r["train_loss"]), float(r["val_loss"]))
                  for r in csv.DictReader(f)}
    checksums = {(variant, int(step)): ([float(x) for x in sums.split(",")], verdict)
                 for variant, step, sums, verdict in CHECKSUMS.findall(result.stdout)}
    return losses, checksums, result.stdout


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Each script's one-process run with the global batch as two micro-batches."""
    runs = {}

    def get(script):
        if script not in runs:
            out = tmp_path_factory.mktemp(f"one_{Path(script).stem}")
            runs[script] = run(script, out, [sys.executable], "--accum", "2")
        return runs[script]
    return get


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_two_ranks_equal_one_process(tmp_path, one_process, script, parallel):
    want_losses, want_sums, _ = one_process(script)
    losses, sums, stdout = run(
        script, tmp_path,
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
        "--parallel", parallel)
    assert f"2 rank(s) ({parallel})" in stdout
    variants = SCRIPTS[script][1].split(",")
    assert {v for v, _ in losses} == set(variants)
    assert losses.keys() == want_losses.keys()
    for key, (train, val) in losses.items():
        want_train, want_val = want_losses[key]
        assert abs(train - want_train) <= LOSS_RTOL * abs(want_train), (key, train, want_train)
        assert abs(val - want_val) <= LOSS_RTOL * abs(want_val), (key, val, want_val)
    assert sums.keys() == {(v, s) for v in variants for s in (1, STEPS)}, stdout[-2000:]
    for key, (per_rank, verdict) in sums.items():
        assert len(per_rank) == 2 and per_rank[0] == per_rank[1] and verdict == "identical", key
        assert abs(per_rank[0] - want_sums[key][0][0]) <= CHECKSUM_ATOL, (
            key, per_rank[0], want_sums[key][0][0])
