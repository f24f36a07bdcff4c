"""bench/bench_families.py stays runnable (its GPU run: scripts/device_run.sh section9): the CPU
dry run checks qkvfuse against each family's own chain (Gemma 4's global layers with the V norm,
Qwen3-Next's gated query) and writes every row."""
import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "bench_families.py"


def test_dry_run_checks_every_family(tmp_path):
    out = tmp_path / "families.csv"
    result = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--no-compile", "--out",
                             str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    records = list(csv.reader(out.read_text().splitlines()))
    header = {r[0][2:]: r[1] for r in records if r[0].startswith("# ")}
    table = [r for r in records if not r[0].startswith("# ")]
    rows = [dict(zip(table[0], r)) for r in table[1:]]
    assert header["families check"].startswith("passed: "), header["families check"]
    for family in ("Gemma4-global", "Qwen3-Next"):
        assert f"{family}: qkvfuse ok" in header["families check"]
    assert {r["impl"] for r in rows} == {"bytes floor", "qkvfuse", "eager chain"}
    assert {r["section"] for r in rows} == {"families fwd", "families bwd", "families fwd+bwd"}
