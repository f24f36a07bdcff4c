"""bench/bench_hf_step.py stays runnable (its GPU run: scripts/device_run.sh hfstep). The CPU
smoke run builds the tiny Qwen3 model, runs every variant that runs on the CPU for two steps
(torch.compile through the aot_eager backend: Dynamo and AOTAutograd as on the GPU, without
Inductor's C++ compile, which takes minutes on a small CI machine) and reports Liger-Kernel and
torchao as skipped; the report's arithmetic and markdown are checked on rows made up here."""
import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs Hugging Face transformers (the [transformers] "
                                           "extra)")

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPT = BENCH / "bench_hf_step.py"
sys.path.insert(0, str(BENCH))
import bench_hf_step  # noqa: E402
import hf_step_variant  # noqa: E402
import report  # noqa: E402

RUNS_ON_CPU = ("eager", "qkvfuse", "qkvfuse-fp8", "compile", "qkvfuse+compile",
               "qkvfuse-fp8+compile")
NEEDS_CUDA = ("liger", "liger+qkvfuse", "liger+qkvfuse-fp8", "torchao-fp8+compile")


def run_script(*args, timeout=900):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke run of every variant: (completed process, rows, markdown path)."""
    folder = tmp_path_factory.mktemp("hf_step")
    markdown = folder / "benchmarks.md"
    markdown.write_text("# Benchmarks\n\nWritten by someone else.\n")
    result = run_script("--smoke", "--compile-backend", "aot_eager", "--out",
                        folder / "rows.csv", "--markdown", markdown, "--commit", "abc1234")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result, read_rows(folder / "rows.csv"), markdown


def test_smoke_runs_the_cpu_variants_and_skips_the_others_with_a_reason(smoke):
    result, rows, _ = smoke
    by_variant = {r["variant"]: r for r in rows}
    assert list(by_variant) == list(hf_step_variant.VARIANTS)
    for name in RUNS_ON_CPU:
        row = by_variant[name]
        assert row["status"] == "ok", row
        assert float(row["ms_median"]) > 0 and int(row["tokens"]) == 2 * 32
        assert float(row["tokens_per_s"]) == pytest.approx(64 / float(row["ms_median"]) * 1e3,
                                                           rel=1e-3, abs=1)
        # Random weights of std 0.02 in a 64-wide model: near-uniform predictions over the 1024
        # tokens of the vocabulary, whose cross entropy is ln 1024.
        assert abs(float(row["first_loss"]) - math.log(1024)) < 0.05, row
        assert math.isfinite(float(row["last_loss"]))
        assert row["commit"] == "abc1234" and row["device"] == "cpu"
    for name in NEEDS_CUDA:
        assert by_variant[name]["status"] == "skipped"
        assert "CUDA" in by_variant[name]["reason"]
    for name in ("compile", "qkvfuse+compile", "qkvfuse-fp8+compile"):
        assert by_variant[name]["graph_breaks"].isdigit()
    assert "check tiny: first-step loss of 6 variants agrees" in result.stdout
    for name in RUNS_ON_CPU + NEEDS_CUDA:
        assert f"[tiny {name}] " in result.stdout and "wall " in result.stdout


def test_smoke_ratios_are_against_each_rows_baseline(smoke):
    _, rows, _ = smoke
    ms = {r["variant"]: float(r["ms_median"]) for r in rows if r["status"] == "ok"}
    expected = {"eager": "eager", "qkvfuse": "eager", "qkvfuse-fp8": "eager",
                "compile": "compile", "qkvfuse+compile": "compile",
                "qkvfuse-fp8+compile": "compile"}
    for variant, baseline in expected.items():
        row = next(r for r in rows if r["variant"] == variant)
        assert row["baseline"] == baseline
        assert float(row["ratio"]) == pytest.approx(ms[baseline] / ms[variant], rel=1e-3)
    assert all(r["ratio"] == "" for r in rows if r["status"] != "ok")


def test_smoke_markdown_section_is_replaced_not_repeated(smoke, tmp_path):
    _, rows, markdown = smoke
    text = markdown.read_text()
    assert text.startswith("# Benchmarks\n\nWritten by someone else.\n")
    assert text.count("<!-- bench_hf_step tiny: begin") == 1
    assert text.count("<!-- bench_hf_step tiny: end -->") == 1
    for variant in hf_step_variant.VARIANTS.values():
        assert f"| {variant.label} |" in text
    assert "skipped: Liger-Kernel's kernels are Triton kernels for CUDA devices" in text
    # --report rewrites the section from the CSV: still one section, the other text kept.
    copy = tmp_path / "benchmarks.md"
    copy.write_text(text + "\nA later paragraph.\n")
    csv_path = tmp_path / "rows.csv"
    bench_hf_step.write_csv(rows, csv_path)
    result = run_script("--report", csv_path, "--markdown", copy, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    again = copy.read_text()
    assert again.count("<!-- bench_hf_step tiny: begin") == 1
    assert f"- raw results: `{csv_path}`" in again  # outside the repository: as given
    assert again.endswith("A later paragraph.\n")
    assert again.startswith("# Benchmarks\n\nWritten by someone else.\n")


def test_variants_that_die_are_error_rows_and_the_run_goes_on(tmp_path):
    # A third of a second is not enough for a process to import torch: every variant times out,
    # and each is still a row.
    result = run_script("--smoke", "--variants", "eager,liger", "--timeout", "0.3", "--out",
                        tmp_path / "rows.csv", timeout=300)
    assert result.returncode == 1
    rows = read_rows(tmp_path / "rows.csv")
    assert [r["variant"] for r in rows] == ["eager", "liger"]
    for row in rows:
        assert row["status"] == "error" and "timed out after 0.3 s" in row["reason"], row
    assert "failed variants: tiny eager, tiny liger" in result.stdout


def test_unknown_variant_is_refused_with_the_choices():
    result = run_script("--smoke", "--variants", "eager,ligr", timeout=300)
    assert result.returncode != 0
    assert "ligr" in result.stderr and "liger+qkvfuse" in result.stderr


def made_up_rows():
    def row(variant, status="ok", ms=None, loss=10.4, reason=""):
        return dict(shape="qwen3-0.6b", variant=variant, status=status, reason=reason,
                    ms_median=ms, tokens_per_s=16384 / ms * 1e3 if ms else None,
                    first_loss=loss if ms else None, steps=25, warmup=3, device="H100",
                    date="2026-12-07", commit="abc1234", torch="2.11.0")
    return [row("eager", ms=170.0), row("qkvfuse", ms=100.0),
            row("liger", ms=88.0), row("liger+qkvfuse", status="refused",
                                       reason="q_norm is LigerRMSNorm | expected Qwen3RMSNorm"),
            row("compile", ms=101.0), row("qkvfuse-fp8+compile", ms=90.0, loss=10.41)]


def test_report_ratios_targets_and_refusals_on_made_up_rows():
    rows = made_up_rows()
    bench_hf_step.add_ratios(rows)
    ratio = {r["variant"]: r["ratio"] for r in rows}
    assert ratio["qkvfuse"] == pytest.approx(1.7) and ratio["eager"] == pytest.approx(1.0)
    assert ratio["liger+qkvfuse"] == "" and ratio["qkvfuse-fp8+compile"] == pytest.approx(
        101 / 90, rel=1e-4)
    targets = bench_hf_step.target_lines(rows)["qwen3-0.6b"]
    assert "liger+qkvfuse >= 1.10x liger: not measured (liger+qkvfuse: refused)" in targets
    assert "qkvfuse-fp8+compile >= 1.12x compile: 1.122x, met" in targets
    assert any(t.startswith("qkvfuse+compile >= 1.07x compile: not measured") for t in targets)
    text = bench_hf_step.section(rows, "qwen3-0.6b", "/results/x.csv")
    # The refusal's message is the row, its "|" escaped so the table keeps its columns.
    assert "| refused: q_norm is LigerRMSNorm \\| expected Qwen3RMSNorm |" in text
    assert "| `apply_qkvfuse(model)` | 100.0 | 163,840 | 1.700x eager |" in text
    assert "- raw results: `/results/x.csv`" in text and "- device: H100" in text


def test_loss_check_fails_beyond_the_tolerance():
    rows = made_up_rows()
    assert bench_hf_step.loss_check(rows, "qwen3-0.6b")[0]  # 10.41 vs 10.4: 9.6e-4
    rows[-1]["first_loss"] = 10.4 * (1 + 2.5 * bench_hf_step.LOSS_TOLERANCE)
    passed, line = bench_hf_step.loss_check(rows, "qwen3-0.6b")
    assert not passed and "DISAGREES" in line and "qkvfuse-fp8+compile" in line


def test_report_py_keeps_the_sections_it_does_not_write(tmp_path):
    """bench/report.py rewrites docs/benchmarks.md from the kernel benchmarks; the whole-step
    sections between bench_hf_step.py's markers must survive it, each shape's once."""
    rows = made_up_rows()
    rows += [dict(row, shape="qwen3-8b") for row in made_up_rows()]
    bench_hf_step.add_ratios(rows)
    path = tmp_path / "benchmarks.md"
    path.write_text("# qkvfuse benchmarks\n\n## Memory-bound kernels\n\n| a | b |\n")
    bench_hf_step.write_markdown(rows, path, None)
    kept = report.kept_sections(path.read_text())
    assert [k.splitlines()[1] for k in kept] == [
        "## Whole training step: Qwen3-0.6B shapes, 12 layers, 8 x 2048 tokens",
        "## Whole training step: Qwen3-8B shapes, 4 layers, 4 x 2048 tokens"]
    assert kept == [bench_hf_step.section(rows, shape, None) for shape in ("qwen3-0.6b",
                                                                          "qwen3-8b")]
