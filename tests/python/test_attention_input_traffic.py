"""bench/attention_input_traffic.py stays runnable, and what it counts holds (issue 31): at the
Qwen3-0.6B training shape the patched attention input moves fewer non-GEMM bytes per layer than
the unpatched one and Liger-Kernel's, its forward casts the input once (T x C, float32 to bf16),
and its backward scatters no GEMM output's slices."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs Hugging Face transformers (the [transformers] "
                                           "extra)")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "attention_input_traffic.py"
TOKENS, CHANNELS = 8 * 2048, 1024  # the benchmark's shape, which the script reports at


def test_patched_attention_input_moves_the_fewest_bytes():
    try:
        import liger_kernel.transformers  # noqa: F401
        variants = ["eager", "liger", "qkvfuse"]
    except ImportError:
        variants = ["eager", "qkvfuse"]
    result = subprocess.run([sys.executable, str(SCRIPT), "--variants", ",".join(variants),
                             "--seq", "768", "--ops"], capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    sections = dict(re.findall(r"^### (\S+): (.*?)(?=^### |\Z)", result.stdout, re.S | re.M))
    assert list(sections) == variants
    total = {v: float(re.match(r"([\d.]+) MB", text).group(1)) for v, text in sections.items()}
    assert total["qkvfuse"] < min(t for v, t in total.items() if v != "qkvfuse"), total
    mine = sections["qkvfuse"]
    # One cast of x: read T x C float32, write it in bf16 (MB), in the forward's "cast" column.
    forward = re.search(r"^\| forward \| (.*) \|$", mine, re.M).group(1).split(" | ")
    assert float(forward[2]) == pytest.approx(TOKENS * CHANNELS * 6 / 1e6, abs=0.1)
    assert "slice_backward" not in mine and "| backward | cat |" not in mine
