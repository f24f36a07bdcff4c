"""The whole training step of a Hugging Face model, with qkvfuse on top of what users already run
(issue 31): unpatched, Liger-Kernel, torch.compile and torchao float8, each with and without
qkvfuse.

The step. transformers' Qwen3ForCausalLM built from a config (vocabulary 32768, random weights
from --seed, the same in every variant), float32 master weights, bf16 autocast, sdpa attention,
fused AdamW; one step = forward with labels (the model's own loss, or Liger's fused linear cross
entropy), backward, optimizer.step(), zero_grad(set_to_none=True), on one fixed batch of random
tokens. Shapes (--shapes):
  qwen3-0.6b  Qwen3-0.6B's: hidden 1024, 16 query / 8 key-value heads of 128, MLP 3072, tied
              embeddings; 12 layers, 8 x 2048 tokens
  qwen3-8b    Qwen3-8B's: hidden 4096, 32 query / 8 key-value heads of 128, MLP 12288; 4 layers,
              4 x 2048 tokens
  tiny        --smoke's (CPU, CI)
Variants (--variants; each in its own process, bench/hf_step_variant.py, since Liger patches
transformers' modules globally; the order within a name is the order of the calls):
  eager                 unpatched
  qkvfuse               apply_qkvfuse(model)
  qkvfuse-fp8           apply_qkvfuse(model, fp8=True)
  liger                 apply_liger_kernel_to_qwen3() with its defaults (rope, rms_norm, swiglu,
                        fused_linear_cross_entropy), before the model is built
  liger+qkvfuse         Liger, then apply_qkvfuse(model)
  liger+qkvfuse-fp8     Liger, then apply_qkvfuse(model, fp8=True)
  compile               torch.compile(model)
  qkvfuse+compile       apply_qkvfuse(model), then torch.compile(model)
  qkvfuse-fp8+compile   apply_qkvfuse(model, fp8=True), then torch.compile(model)
  torchao-fp8+compile   torchao.float8.convert_to_float8_training with a filter for q/k/v_proj
                        (its default recipe, tensorwise scaling), then torch.compile(model)
A variant that apply_qkvfuse refuses (UnsupportedModelError) is reported as refused with its
message, one whose package or device is missing as skipped, any other failure as an error with
its message; none of them stops the others.

Timing: --warmup steps (the first compiles, autotunes and allocates the optimizer's state; its
wall time is reported as first_step_s), then --steps steps, each between its own pair of CUDA
events with no synchronization until the end (the host runs ahead as in training); ms/step is
the median. tokens/s = batch x sequence / median. "vs baseline" = the baseline's median / this
row's (above 1: faster), against the row's natural baseline in the same run: eager rows against
eager, Liger rows against liger, compiled rows against compile. Peak memory:
torch.cuda.max_memory_allocated over the timed steps. First-step loss: before any optimizer step,
so every variant computes the same function of the same weights and batch; the check line
compares each row's with the eager row's (relative difference within LOSS_TOLERANCE: a few bf16
roundings of the attention input or a fused cross entropy move it by far less). Graph breaks:
torch._dynamo's graph_break counter of the compiled rows. The targets of issue 31 are printed from
the same run's ratios. Each variant's wall time (process start to end) is printed as it finishes.

  python bench/bench_hf_step.py [--shapes qwen3-0.6b,qwen3-8b] [--variants eager,qkvfuse,...]
      [--steps 25] [--warmup 3] [--out hf_step.csv] [--markdown [docs/benchmarks.md]]
      [--commit SHA] [--raw-path PATH]
  python bench/bench_hf_step.py --profile qkvfuse-fp8 [--shapes qwen3-0.6b]
      (the variant's timed row, then bench/hf_step_profile.py's tables: top kernels, and the share
      of the attention input, which bounds what qkvfuse can win)
  python bench/bench_hf_step.py --report a.csv b.csv --markdown   (no run: the markdown of
      earlier runs' CSVs, e.g. one call per shape)
  python bench/bench_hf_step.py --smoke --out /tmp/x.csv   (CPU, tiny model, 2 steps: CI)
--markdown replaces, per shape, the section between this shape's markers in the file (appends it
when absent); bench/report.py keeps those sections when it rewrites the file. The exit status is
1 when a variant failed (error, not refused or skipped) or the loss check failed.
"""
import argparse
import csv
import datetime
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from hf_step_variant import RESULT_PREFIX, SHAPES, VARIANTS

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LOSS_TOLERANCE = 2e-3
SMOKE = dict(shapes="tiny", device="cpu", steps=2, warmup=1)
DEFAULTS = dict(steps=25, warmup=3)
DEFAULT_SHAPES = "qwen3-0.6b,qwen3-8b"

# Issue 31's targets: (shape, variant, against, at least this ratio of medians).
TARGETS = (
    ("qwen3-0.6b", "liger+qkvfuse", "liger", 1.10),
    ("qwen3-0.6b", "liger+qkvfuse-fp8", "liger", 1.15),
    ("qwen3-0.6b", "qkvfuse+compile", "compile", 1.07),
    ("qwen3-0.6b", "qkvfuse-fp8+compile", "compile", 1.12),
    ("qwen3-8b", "qkvfuse-fp8+compile", "compile", 1.05),
    ("qwen3-8b", "qkvfuse-fp8+compile", "torchao-fp8+compile", 1.0),
)

COLUMNS = ("date", "commit", "device", "torch", "transformers", "triton", "liger_kernel",
           "torchao", "shape", "variant", "status", "reason", "steps", "warmup", "tokens",
           "ms_median", "ms_mean", "ms_min", "ms_max", "tokens_per_s", "baseline", "ratio",
           "peak_mem_gib", "first_loss", "last_loss", "graph_breaks", "graphs",
           "graph_break_reasons", "first_step_s", "wall_s")
ENVIRONMENT = ("device", "torch", "transformers", "triton", "liger_kernel", "torchao")


# ---- running the variants ----------------------------------------------------------------------

def run_variant(shape: str, variant: str, args) -> dict:
    """One variant in its own process; its RESULT line, or an error row for a process that died."""
    command = [sys.executable, str(HERE / "hf_step_variant.py"), "--shape", shape, "--variant",
               variant, "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed",
               str(args.seed), "--compile-backend", args.compile_backend]
    if args.device:
        command += ["--device", args.device]
    if args.profile:
        command.append("--profile")
    begin = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        stdout, stderr, rc = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:  # its output may come as bytes
        stdout, stderr = (x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                          for x in (expired.stdout, expired.stderr))
        rc = None
    wall = time.perf_counter() - begin
    lines = stdout.splitlines()
    results = [json.loads(line[len(RESULT_PREFIX):]) for line in lines
               if line.startswith(RESULT_PREFIX)]
    for line in lines:  # the profile's tables, anything else the variant printed
        if not line.startswith(RESULT_PREFIX):
            print(line)
    if results:
        row = results[-1]
    else:
        why = f"timed out after {args.timeout} s" if rc is None else f"exited with status {rc}"
        tail = [line for line in stderr.splitlines() if line.strip()][-1:] or [""]
        row = dict(shape=shape, variant=variant, status="error", reason=f"{why}: {tail[0]}")
    if row["status"] == "error" and stderr.strip():
        print(f"-- {shape} {variant}: stderr (last lines)", file=sys.stderr)
        print("\n".join(stderr.splitlines()[-15:]), file=sys.stderr)
    row["wall_s"] = round(wall, 1)
    return row


def run_all(args, shapes, variants) -> list:
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    rows = []
    begin = time.perf_counter()
    for shape in shapes:
        for variant in variants:
            row = run_variant(shape, variant, args)
            row.update(date=date, commit=args.commit, steps=args.steps, warmup=args.warmup,
                       tokens=SHAPES[shape].tokens)
            rows.append(row)
            if args.out:  # after every variant: a run cut short keeps the rows it finished
                add_ratios(rows)
                write_csv(rows, args.out)
            ms = f"{row['ms_median']:.2f} ms/step" if row.get("ms_median") is not None else ""
            print(f"[{shape} {variant}] {row['status']} {ms} {row.get('reason', '')[:200]}"
                  f" (wall {row['wall_s']} s, first step {row.get('first_step_s', '-')} s)",
                  flush=True)
    print(f"total wall time {time.perf_counter() - begin:.0f} s", flush=True)
    # Rows of a variant that died carry no environment: take it from a sibling row.
    known = next((r for r in rows if r.get("torch")), {})
    for row in rows:
        for key in ENVIRONMENT:
            row.setdefault(key, known.get(key, ""))
    return rows


# ---- the results -------------------------------------------------------------------------------

def number(value):
    """A float from a row's value (CSV rows hold strings), None when empty."""
    if value is None or value == "":
        return None
    return float(value)


def ok_row(rows, shape, variant):
    return next((r for r in rows if r["shape"] == shape and r["variant"] == variant
                 and r["status"] == "ok" and number(r.get("ms_median"))), None)


def add_ratios(rows) -> None:
    for row in rows:
        baseline = VARIANTS[row["variant"]].baseline
        base = ok_row(rows, row["shape"], baseline)
        row["baseline"] = baseline
        ms = number(row.get("ms_median"))
        row["ratio"] = round(number(base["ms_median"]) / ms, 4) if (
            base and ms and row["status"] == "ok") else ""


def loss_check(rows, shape) -> tuple:
    """(passed, line): every ok row's first-step loss against the eager row's."""
    ok = [r for r in rows if r["shape"] == shape and r["status"] == "ok"]
    if not ok:
        return True, f"check {shape}: no variant ran"
    reference = ok_row(rows, shape, "eager") or ok[0]
    ref = number(reference["first_loss"])
    worst = max(ok, key=lambda r: abs(number(r["first_loss"]) - ref))
    diff = abs(number(worst["first_loss"]) - ref) / abs(ref)
    passed = diff <= LOSS_TOLERANCE
    return passed, (f"check {shape}: first-step loss of {len(ok)} variants "
                    f"{'agrees' if passed else 'DISAGREES'} with {reference['variant']}'s "
                    f"{ref:.5f}: largest relative difference {diff:.2e} ({worst['variant']}, "
                    f"{number(worst['first_loss']):.5f}), tolerance {LOSS_TOLERANCE:g}")


def target_lines(rows) -> dict:
    """{shape: [lines]}: issue 31's targets, from the rows that ran."""
    lines = {}
    for shape, variant, against, goal in TARGETS:
        if not any(r["shape"] == shape for r in rows):
            continue
        row, base = ok_row(rows, shape, variant), ok_row(rows, shape, against)
        if row and base:
            ratio = number(base["ms_median"]) / number(row["ms_median"])
            text = f"{ratio:.3f}x, {'met' if ratio >= goal else 'NOT met'}"
        else:
            missing = []
            for name in (variant, against):
                ran = [r for r in rows if r["shape"] == shape and r["variant"] == name]
                if not ran:
                    missing.append(f"{name}: not run")
                elif ran[0]["status"] != "ok":
                    missing.append(f"{name}: {ran[0]['status']}")
            text = f"not measured ({', '.join(missing)})"
        lines.setdefault(shape, []).append(f"{variant} >= {goal:.2f}x {against}: {text}")
    return lines


def fmt(value, digits):
    x = number(value)
    return "" if x is None else f"{x:,.{digits}f}"


def print_table(rows, shape) -> None:
    print(f"== {SHAPES[shape].describe()}")
    print(f"{'variant':22} {'status':8} {'ms/step':>9} {'tokens/s':>10} {'vs base':>14} "
          f"{'peak GiB':>8} {'first loss':>10} {'breaks':>6} {'wall s':>6}")
    for row in (r for r in rows if r["shape"] == shape):
        ratio = f"{number(row['ratio']):.3f}x {row['baseline']}" if row.get("ratio") else ""
        print(f"{row['variant']:22} {row['status']:8} {fmt(row.get('ms_median'), 2):>9} "
              f"{fmt(row.get('tokens_per_s'), 0):>10} {ratio:>14} "
              f"{fmt(row.get('peak_mem_gib'), 2):>8} {fmt(row.get('first_loss'), 4):>10} "
              f"{str(row.get('graph_breaks', '')):>6} {fmt(row.get('wall_s'), 0):>6}")
        if row["status"] != "ok":
            print(f"    {row['reason']}")


def write_csv(rows, path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, "") for k in COLUMNS})


def repository_path(path) -> str:
    """`path` relative to the repository when it lies inside, else as given."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


def read_csv(paths) -> list:
    """The rows of earlier runs, each with the file it came from (the markdown cites it)."""
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            rows += [dict(row, source=repository_path(path)) for row in csv.DictReader(f)]
    unknown = {(r["shape"], r["variant"]) for r in rows
               if r["shape"] not in SHAPES or r["variant"] not in VARIANTS}
    if unknown:
        raise SystemExit(f"--report: rows of unknown shapes or variants: {sorted(unknown)}")
    return rows


# ---- markdown ----------------------------------------------------------------------------------

def markers(shape):
    return (f"<!-- bench_hf_step {shape}: begin (bench/bench_hf_step.py --markdown writes this "
            f"section; bench/report.py keeps it) -->", f"<!-- bench_hf_step {shape}: end -->")


def section(rows, shape, raw_path) -> str:
    s = SHAPES[shape]
    mine = [r for r in rows if r["shape"] == shape]
    first = mine[0]
    begin, end = markers(shape)
    versions = ", ".join(f"{name} {first.get(key)}" for name, key in (
        ("torch", "torch"), ("transformers", "transformers"), ("triton", "triton"),
        ("Liger-Kernel", "liger_kernel"), ("torchao", "torchao")) if first.get(key))
    lines = [begin, f"## Whole training step: {s.model} shapes, {s.layers} layers, "
             f"{s.batch} x {s.seq} tokens", "",
             f"`bench/bench_hf_step.py`: transformers `Qwen3ForCausalLM` from a config "
             f"({s.describe().split('(', 1)[1]}, random weights, float32 master weights, bf16 "
             f"autocast, sdpa attention, fused AdamW; forward, loss, backward and optimizer step; "
             f"median of {first.get('steps')} steps after {first.get('warmup')} warm-up step(s), "
             f"each variant in its own process. \"vs baseline\": the baseline's median over this "
             f"row's (above 1: faster).", "",
             f"- device: {first.get('device')}",
             f"- date: {first.get('date')}",
             f"- commit: {first.get('commit')}",
             f"- {versions}"]
    sources = [raw_path] if raw_path else list(dict.fromkeys(r["source"] for r in mine
                                                              if r.get("source")))
    if sources:
        lines.append("- raw results: " + ", ".join(f"`{source}`" for source in sources))
    lines += ["", "| variant | ms/step | tokens/s | vs baseline | peak memory (GiB) | "
              "first-step loss | graph breaks |",
              "| --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for row in mine:
        label = VARIANTS[row["variant"]].label
        if row["status"] != "ok":
            reason = row["reason"].replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {label} | {row['status']}: {reason} | | | | | |")
            continue
        ratio = f"{number(row['ratio']):.3f}x {row['baseline']}" if row.get("ratio") else ""
        lines.append(f"| {label} | {fmt(row['ms_median'], 1)} | {fmt(row['tokens_per_s'], 0)} | "
                     f"{ratio} | {fmt(row.get('peak_mem_gib'), 1)} | "
                     f"{fmt(row['first_loss'], 4)} | {row.get('graph_breaks', '')} |")
    lines += ["", f"- {loss_check(rows, shape)[1]}"]
    lines += [f"- target: {line}" for line in target_lines(rows).get(shape, [])]
    return "\n".join(lines + [end])


def write_markdown(rows, path, raw_path) -> None:
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    for shape in dict.fromkeys(r["shape"] for r in rows):
        new = section(rows, shape, raw_path)
        begin, end = markers(shape)
        pattern = re.compile(re.escape(begin.split(": begin")[0]) + r": begin.*?" +
                             re.escape(end), re.S)
        if pattern.search(text):
            text = pattern.sub(lambda _: new, text, count=1)
        else:
            text = text.rstrip("\n") + ("\n\n" if text else "") + new + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# ---- main --------------------------------------------------------------------------------------

def default_commit() -> str:
    recorded = ROOT / ".device" / "COMMIT"  # scripts/device_prepare.sh's, on the GPU machine
    if recorded.exists():
        return recorded.read_text().strip()
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                              cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def names(text, known, what):
    chosen = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in known]
    if unknown or not chosen:
        raise SystemExit(f"--{what}: unknown {what} {unknown or text!r}; choose from "
                         f"{', '.join(known)}")
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=None, help=f"comma-separated, of {', '.join(SHAPES)}"
                        f" (default {DEFAULT_SHAPES})")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--steps", type=int, help="timed steps (median; default 25)")
    parser.add_argument("--warmup", type=int, help="steps before timing (default 3, >= 1)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds per variant")
    parser.add_argument("--out", help="CSV of the rows")
    parser.add_argument("--markdown", nargs="?", const=str(ROOT / "docs" / "benchmarks.md"),
                        help="replace (or append) each shape's section of this file "
                             "(default docs/benchmarks.md)")
    parser.add_argument("--raw-path", help="where the markdown says the rows are kept (default: "
                                           "--out, or --report's CSVs)")
    parser.add_argument("--commit", default=None, help="default: .device/COMMIT or git describe")
    parser.add_argument("--profile", metavar="VARIANT",
                        help="run this variant alone (per shape) and profile it")
    parser.add_argument("--report", nargs="+", metavar="CSV",
                        help="no run: read these CSVs (earlier runs) and print / write markdown")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny model, 2 steps after 1 warm-up (CI)")
    args = parser.parse_args()
    for key, value in list(SMOKE.items() if args.smoke else []) + list(DEFAULTS.items()):
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps < 1 or args.warmup < 1:
        parser.error(f"--steps and --warmup must be at least 1, got {args.steps} and "
                     f"{args.warmup}")
    args.commit = args.commit or default_commit()

    if args.report:
        rows = read_csv(args.report)
        shapes = list(dict.fromkeys(r["shape"] for r in rows))
    else:
        shapes = names(args.shapes or DEFAULT_SHAPES, list(SHAPES), "shapes")
        variants = names(args.variants, list(VARIANTS), "variants")
        if args.profile:
            variants = names(args.profile, list(VARIANTS), "profile")
        rows = run_all(args, shapes, variants)
    add_ratios(rows)

    status = 0
    for shape in shapes:
        print_table(rows, shape)
        passed, line = loss_check(rows, shape)
        print(line)
        status |= not passed
        for target in target_lines(rows).get(shape, []):
            print(f"target: {target}")
    failed = [f"{r['shape']} {r['variant']}" for r in rows if r["status"] == "error"]
    if failed:
        print(f"failed variants: {', '.join(failed)}")
        status = 1
    if args.out:
        write_csv(rows, args.out)
        print(f"rows: {args.out}")
    if args.markdown and args.profile:
        print("--markdown: not written with --profile (one variant; the tables keep the full runs)")
    elif args.markdown:
        raw = args.raw_path or (repository_path(args.out) if args.out else None)
        write_markdown(rows, args.markdown, raw)
        print(f"markdown: {args.markdown}")
    return status


if __name__ == "__main__":
    sys.exit(main())
