"""Benchmark report: turns the CSVs of the three benchmarks of one run into docs/benchmarks.md
(tables) and docs/benchmarks.png (chart). scripts/bench_report.sh runs the benchmarks and this.

  python3 bench/report.py --kernels K.csv --fp8 F.csv --torch T.csv \
      [--md docs/benchmarks.md] [--png docs/benchmarks.png]

  --kernels  qkvfuse_bench_kernels --csv: norm + rotary forward, bf16 backward, fused FP8 backward
  --fp8      qkvfuse_bench_fp8 --csv: FP8 GEMMs, quantize, the packed op through the C++ API
  --torch    bench/bench_torch.py --out X.csv: qkvfuse side by side with the eager PyTorch chain,
             torch.compile of it, the reference Triton implementation and torch._scaled_mm; and
             its general section (or bench/bench_general.py --out X.csv alone): the model shapes
             against the eager Hugging Face chain, torch.compile of it, Liger-Kernel and axolotl's
             fused kernel
Any of the three may be left out (its tables then say so). Every number in the report comes from
the CSVs; only the method text is fixed here. The chart needs matplotlib (imported only for it).
The whole-training-step sections that bench/bench_hf_step.py --markdown wrote into the file (between
its markers) are kept, after the tables: they come from another benchmark's run.
"""
import argparse
import csv
import math
import os
import re
import sys
import textwrap
from pathlib import Path

MODES = ("plain", "paired", "key_offset")


# ---- reading ------------------------------------------------------------------------------------

def number(text):
    """A CSV cell as a float; None for the benchmarks' empty, '-' and nan cells."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def read_cpp_csv(path):
    """The C++ benchmarks' CSV: '# key: value' lines (device, date, commit, copy bandwidth), then
    a header row and one row per case. Header values can hold commas, so they are not CSV."""
    meta, body = {}, []
    for line in Path(path).read_text().splitlines():
        if line.startswith("#"):
            key, sep, value = line[1:].strip().partition(": ")
            if sep:
                meta[key] = value
        elif line.strip():
            body.append(line)
    return meta, list(csv.DictReader(body))


def read_torch_csv(path):
    """bench_torch.py's CSV: ('# key', value) rows, then a header row and the results."""
    with open(path, newline="") as f:
        rows = [row for row in csv.reader(f) if row]
    meta = {row[0][1:].strip(): row[1] for row in rows if row[0].startswith("#") and len(row) > 1}
    data = [row for row in rows if not row[0].startswith("#")]
    return meta, [dict(zip(data[0], row)) for row in data[1:]] if data else []


def heads_dim(text):
    """(H, D) from a shape label such as 'H=6 D=128 Dv=128' or 'T=49152 H=12 D=64 Dv=128'."""
    match = re.search(r"H=(\d+) D=(\d+)", text)
    return (int(match[1]), int(match[2])) if match else (0, 0)


# ---- formatting ---------------------------------------------------------------------------------

def fmt(value, digits):
    return "-" if value is None else f"{value:.{digits}f}"


def ratio(value):
    return "-" if value is None else f"{value:.2f}x"


def paragraph(text):
    """Prose wrapped at 100 columns, as the project's other docs are."""
    return textwrap.fill(text, 100, break_on_hyphens=False)


def table(header, rows):
    """A markdown table, without the columns that hold no value in any row (a benchmark that
    did not run)."""
    keep = [i for i in range(len(header)) if any(str(row[i]) != "-" for row in rows)]
    header, rows = [header[i] for i in keep], [[row[i] for i in keep] for row in rows]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def shape_label(heads, dim):
    return f"H={heads} D={dim}"


# ---- the runs, as one object ---------------------------------------------------------------------

class Run:
    def __init__(self, kernels, fp8, torch_csv):
        self.sources = {}  # name -> (path, meta)
        self.kernels, self.fp8, self.torch = [], [], []
        if kernels:
            meta, self.kernels = read_cpp_csv(kernels)
            self.sources["qkvfuse_bench_kernels"] = (kernels, meta)
        if fp8:
            meta, self.fp8 = read_cpp_csv(fp8)
            self.sources["qkvfuse_bench_fp8"] = (fp8, meta)
        if torch_csv:
            meta, self.torch = read_torch_csv(torch_csv)
            self.sources["bench_torch"] = (torch_csv, meta)

    def meta_values(self, key):
        """{source: value} of one header key, over the sources that have it."""
        return {name: meta[key] for name, (_, meta) in self.sources.items() if meta.get(key)}

    def one_value(self, key):
        """The value of a header key; where the sources disagree, every value with its source."""
        values = self.meta_values(key)
        if not values:
            return "unknown"
        distinct = list(dict.fromkeys(values.values()))
        if len(distinct) == 1:
            return distinct[0]
        return ", ".join(f"{value} ({name})" for name, value in values.items())

    def device(self):
        # The C++ benchmarks' device lines carry the SM count (and for bench_fp8 the L2); all
        # start with the name bench_torch records.
        values = self.meta_values("device")
        names = {v.split(" (")[0] for v in values.values()}
        if len(names) > 1:
            return self.one_value("device")
        return max(values.values(), key=len) if values else "unknown"

    def date(self):
        dates = sorted(v[:10] for v in self.meta_values("date").values())
        return dates[0] if dates else "unknown"

    def torch_rows(self, section, impl=None):
        return [r for r in self.torch if r["section"] == section and (impl is None or
                                                                     r["impl"] == impl)]

    def failures(self):
        out = []
        for name, rows in (("qkvfuse_bench_kernels", self.kernels),
                           ("qkvfuse_bench_fp8", self.fp8)):
            for r in rows:
                if r.get("note", "").startswith("FAILED"):
                    what = " ".join(r.get(k, "") for k in ("kernel", "section", "name", "mode",
                                                           "shape") if r.get(k))
                    if "heads" in r:
                        what += f" {shape_label(r['heads'], r['head_dim'])}"
                    out.append(f"{name}: {what}: {r['note']}")
        return out


# ---- sections -----------------------------------------------------------------------------------

# C++ kernel name -> (title, bench_torch section timing the same kernel side by side)
KERNELS = [
    ("qk_norm_rope", "Norm + rotary forward (`qk_norm_rope`)", "norm+rope forward"),
    ("qk_norm_rope_backward", "bf16 backward (`qk_norm_rope_backward`)", None),
    ("qkv_backward_fp8", "Fused FP8 backward (`qkv_backward_fp8`)", "fused fp8 backward"),
]
BASELINES = ("eager chain", "compiled chain", "reference")


def memory_bound_section(run):
    out = []
    for kernel, title, torch_section in KERNELS:
        cases = {}  # (H, D, mode) -> {"ms", "gbps", "pct"}
        for r in run.kernels:
            if r["kernel"] == kernel:
                key = (int(r["heads"]), int(r["head_dim"]), r["mode"])
                cases[key] = {"ms": number(r["ms"]), "gbps": number(r["gbps"]),
                              "pct": number(r["pct_copy"])}
        ratios = {}  # (H, D, mode) -> {baseline: ratio}
        for r in run.torch_rows(torch_section) if torch_section else []:
            key = (*heads_dim(r["shape"]), r["mode"])
            if r["impl"] == "qkvfuse":
                cases.setdefault(key, {"ms": number(r["ms"]), "gbps": number(r["rate"]),
                                       "pct": number(r["% copy"])})
            else:
                ratios.setdefault(key, {})[r["impl"]] = number(r["x qkvfuse"])
        if not cases:
            continue
        baselines = [b for b in BASELINES if any(b in v for v in ratios.values())]
        rows = []
        for (heads, dim, mode), c in cases.items():
            ms = fmt(c["ms"], 4) if c["ms"] is not None else "failed"
            rows.append([shape_label(heads, dim), mode, ms, fmt(c["gbps"], 0), fmt(c["pct"], 1)] +
                        [ratio(ratios.get((heads, dim, mode), {}).get(b)) for b in baselines])
        out += [f"### {title}", "",
                table(["shape", "mode", "ms", "GB/s", "% copy"] + baselines, rows), ""]

    quantize = [r for r in run.fp8 if r["section"] == "quantize"]
    if quantize:
        rows = [[r["name"], r["shape"], fmt(number(r["ms"]), 4), fmt(number(r["gbps"]), 0),
                 fmt(number(r["pct_copy"]), 1), r["note"]] for r in quantize]
        out += ["### Quantize (`quantize_dual_layout`, `quantize_weight_bank`)", "",
                "From `qkvfuse_bench_fp8`; no baseline is timed for these.", "",
                table(["op", "shape", "ms", "GB/s", "% copy", "note"], rows), ""]
    intro = paragraph(
        "ms, GB/s and % copy: the C++ benchmark (`qkvfuse_bench_kernels`, through the C++ API); "
        "where it has no row, the PyTorch benchmark's qkvfuse row. Baseline columns: the "
        "baseline's time over qkvfuse's, both timed side by side in the PyTorch benchmark "
        "(above 1.00x qkvfuse is faster). Eager chain and compiled chain are the same math as "
        "PyTorch ops, run eagerly and through `torch.compile`; reference is the reference Triton "
        "kernel.")
    return ["## Memory-bound kernels", "", intro if out else "Not run.", ""] + out


def gemm_section(run):
    """One row per GEMM: bench_torch's qkvfuse and torch._scaled_mm side by side, and the C++
    benchmark's rate for the same M, N, K (which has alpha and rotates its operands)."""
    gemms = {}  # (name, m, n, k) -> {impl: row}
    for r in run.torch:
        match = re.match(r"fp8 gemm (\w+) \[(\d+)x(\d+)x(\d+)\]", r["section"])
        if match:
            key = (match[1], int(match[2]), int(match[3]), int(match[4]))
            gemms.setdefault(key, {"layer": r["shape"]})[r["impl"]] = r
    names = {"fwd": "forward"}
    for r in run.fp8:
        # C++ shape "[M,K]x[N,K]^T": d = a @ b^T.
        match = re.match(r"\[(\d+),(\d+)\]x\[(\d+),(\d+)\]", r["shape"])
        if r["section"] == "fp8_gemm" and match:
            key = (names.get(r["name"], r["name"]), int(match[1]), int(match[3]), int(match[2]))
            gemms.setdefault(key, {})["C++"] = r
    if not gemms:
        return ["## FP8 GEMMs", "", "Not run.", ""]
    rows = []
    for (name, m, n, k), impls in gemms.items():
        ours, theirs, cpp = impls.get("qkvfuse"), impls.get("torch._scaled_mm"), impls.get("C++")
        accum = " (fast accum)" if cpp and "fast_accum=1" in cpp["note"] else ""
        layer = shape_label(*heads_dim(impls["layer"])) if "layer" in impls else "-"
        rows.append([name + accum, f"{m} x {n} x {k}", layer,
                     fmt(number(ours["ms"]), 4) if ours else "-",
                     fmt(number(ours["rate"]), 0) if ours else "-",
                     fmt(number(theirs["rate"]), 0) if theirs else "-",
                     ratio(number(theirs["x qkvfuse"])) if theirs else "-",
                     fmt(number(cpp["tflops"]), 0) if cpp else "-"])
    return ["## FP8 GEMMs", "", paragraph(
        "d = a @ b^T, e4m3 in, bf16 out, per-tensor scales (cuBLASLt). TFLOP/s = 2 M N K / time. "
        "qkvfuse (`fp8_gemm`) and `torch._scaled_mm` are timed side by side in the PyTorch "
        "benchmark; the ratio is `_scaled_mm`'s time over qkvfuse's. The last column is the C++ "
        "benchmark (`qkvfuse_bench_fp8`) at the same M, N, K, with its own operands rotated."), "",
            table(["GEMM", "M x N x K", "layer", "qkvfuse ms", "qkvfuse TFLOP/s",
                   "_scaled_mm TFLOP/s", "_scaled_mm / qkvfuse", "C++ API TFLOP/s"], rows), ""]


PACKED_STEPS = [  # (row label, bench_torch section suffix, C++ (name suffix, note))
    ("forward", "forward", ("fwd", "eager")),
    ("backward", None, ("bwd", "eager")),
    ("fwd+bwd eager", "fwd+bwd eager", ("fwd+bwd", "eager")),
    ("fwd+bwd CUDA graph", "fwd+bwd CUDA graph", ("fwd+bwd", "CUDA graph replay")),
]
PACKED_BASELINES = ("reference", "bf16 eager chain", "bf16 compiled chain")


def packed_section(run):
    cpp = {}  # (H, D, mode, name suffix, note) -> ms
    for r in run.fp8:
        words = r["name"].split()
        if r["section"] == "packed_op" and len(words) > 1:
            mode = next((w for w in words if w in MODES), "?")
            cpp[(*heads_dim(r["shape"]), mode, words[-1], r["note"])] = number(r["ms"])
    shapes = list(dict.fromkeys([(*heads_dim(r["shape"]), r["mode"]) for r in run.torch
                                 if r["section"].startswith("packed op")] +
                                [key[:3] for key in cpp]))
    if not shapes:
        return ["## Whole packed FP8 QKV op", "", "Not run.", ""]
    baselines = [b for b in PACKED_BASELINES if any(r["impl"] == b for r in run.torch)]
    rows = []
    for heads, dim, mode in shapes:
        def torch_row(section, impl):
            for r in run.torch_rows(f"packed op {section}", impl):
                if heads_dim(r["shape"]) == (heads, dim) and r["mode"] == mode:
                    return r
            return None

        for label, section, cpp_key in PACKED_STEPS:
            ours = torch_row(section, "qkvfuse") if section else None
            cells = [torch_row(section, b) if section else None for b in baselines]
            cpp_ms = cpp.get((heads, dim, mode, *cpp_key))
            if ours is None and cpp_ms is None:
                continue
            rows.append([shape_label(heads, dim), mode, label,
                         fmt(number(ours["ms"]), 4) if ours else "-", fmt(cpp_ms, 4)] +
                        [f"{fmt(number(c['ms']), 4)} ({ratio(number(c['x qkvfuse']))})" if c
                         else "-" for c in cells])
    out = ["## Whole packed FP8 QKV op", "", paragraph(
        "Forward (quantized x given, as in training where layers share it) and forward + backward "
        "(gradients of x, both weights and qkv_scale), eager and as one replayed CUDA graph. "
        "qkvfuse (`qkvfuse.packed_fp8_qkv` through autograd) and the baselines are timed side by "
        "side in the PyTorch benchmark, each baseline as ms (its time over qkvfuse's); the bf16 "
        "chains are the unfused bf16 projection + norm + rotary that the op replaces. C++ API: "
        "`packed_qkv_forward` / `_backward` in `qkvfuse_bench_fp8`, without autograd."), "",
           table(["shape", "mode", "step", "qkvfuse ms", "C++ API ms"] +
                 [f"{b} ms" for b in baselines], rows), ""]

    overhead = []
    for heads, dim, mode in shapes:
        for impl in ("qkvfuse", "reference"):
            values = []
            for what in ("eager wall/step", "eager host/step", "graph wall/step"):
                found = [number(r["ms"]) for r in run.torch_rows(f"packed op fwd+bwd {what}", impl)
                         if heads_dim(r["shape"]) == (heads, dim) and r["mode"] == mode]
                values.append(found[0] if found else None)
            if all(v is None for v in values):
                continue
            eager, host, graph = values
            overhead.append([shape_label(heads, dim), mode, impl, fmt(eager, 4), fmt(host, 4),
                             fmt(graph, 4), ratio(eager / graph if eager and graph else None)])
    if overhead:
        out += ["### Host overhead", "", paragraph(
                "100 forward + backward steps back to back, no synchronization between: wall ms "
                "per step, and how long the host took to enqueue one eager step. An eager step is "
                "host-bound when its host time reaches the GPU time; eager / graph near 1.00x "
                "means the launch overhead is hidden."), "",
                table(["shape", "mode", "impl", "eager wall/step", "eager host/step",
                       "graph wall/step", "eager / graph"], overhead), ""]
    return out


GENERAL_STEPS = (("general fwd", "forward"), ("general bwd", "backward"),
                 ("general fwd+bwd", "fwd+bwd"))
GENERAL_BASELINES = ("eager HF chain", "torch.compile", "Liger", "Liger (dense q, k)", "axolotl",
                     "axolotl (dense q, k)")


def general_section(run):
    """The general layouts (SPEC.md section 8) at the model shapes: per shape and step, the
    bytes floor, qkvfuse and each baseline as ms (its time over qkvfuse's)."""
    title = "## General layouts at model shapes (QK-norm + NeoX rotary, cos/sin cache)"
    steps = dict(GENERAL_STEPS)
    found = [r for r in run.torch if r["section"] in steps]
    meta = run.sources.get("bench_torch", (None, {}))[1]
    if not found:  # not run, or it failed before any row (its check line says why)
        return [title, "", f"No results: {meta['general check']}" if meta.get("general check")
                else "Not run.", ""]
    cells = {(r["shape"], r["section"], r["impl"]): r for r in found}
    shapes = list(dict.fromkeys((r["shape"], r["mode"]) for r in found))
    baselines = [b for b in GENERAL_BASELINES if any(key[2] == b for key in cells)]
    rows = []
    for shape, mode in shapes:
        for section, step in GENERAL_STEPS:
            ours, floor = cells.get((shape, section, "qkvfuse")), cells.get(
                (shape, section, "bytes floor"))
            if ours is None:
                continue
            rows.append([shape, mode, step, fmt(number(floor["ms"]), 3) if floor else "-",
                         fmt(number(ours["ms"]), 4), fmt(number(ours["rate"]), 0),
                         fmt(number(ours["% copy"]), 1)] +
                        [f"{fmt(number(c['ms']), 3)} ({ratio(number(c['x qkvfuse']))})"
                         if c else "-" for c in (cells.get((shape, section, b))
                                                 for b in baselines)])
    out = [title, "", paragraph(
        "Per-head RMS-norm with a learned weight (Qwen3: w; Gemma 3: 1 + w) and NeoX rotary from "
        "a bf16 cos/sin cache read at int64 positions, bf16, the weights receiving gradients; q "
        "and k are the strided Q/K columns of a fused projection's output. Forward and backward "
        "alone: qkvfuse's registered ops; the baselines' training forward, and their autograd "
        "backward after a fresh forward. Fwd+bwd: everything through autograd. "
        "Floor: each input read once and each output written once at the measured copy "
        "bandwidth; GB/s and % copy count those bytes. Baselines, timed side by side: the eager "
        "Hugging Face chain (transformers' Qwen3/Gemma3 RMSNorm and apply_rotary_pos_emb, "
        "restated), torch.compile of it (static shapes), Liger-Kernel's RMSNorm + rope as its "
        "patches use them, with the copies its ops make of strided inputs, and the same with q "
        "and k as separate dense tensors (separate projections); axolotl's fused RMSNorm + RoPE "
        "Triton kernel with its backward as its attention patches call it, on the fused "
        "projection's columns and on dense q, k. Each as ms (its time over "
        "qkvfuse's; above 1.00x qkvfuse is faster). `bench/bench_general.py` documents every "
        "column. Targets (issue 20): forward and backward each at >= 88 % of copy, fwd+bwd >= "
        "3x faster than torch.compile and >= 5x faster than Liger."), ""]
    if meta.get("general problem"):
        out.append(f"- problem: {meta['general problem']}")
    if meta.get("general check"):
        # "passed: <model>: ... | <model>: ..." (or "FAILED: ..."): one item per model.
        status, _, details = meta["general check"].partition(": ")
        out.append(f"- check against the eager chain: {status}")
        out += [f"  - {detail}" for detail in details.split(" | ") if detail]
    if meta.get("liger"):
        out.append(f"- Liger-Kernel: {meta['liger']}")
    if meta.get("axolotl"):
        out.append(f"- axolotl: {meta['axolotl']}")
    return out + ["", table(["shape", "mode", "step", "floor ms", "qkvfuse ms", "GB/s", "% copy"]
                            + [f"{b} ms" for b in baselines], rows), ""]


HOW_MEASURED = (
    "Every time is a median. The C++ benchmarks time each iteration between its own pair of CUDA "
    "events (median of at least 50 after warm-up; for single kernels a spinning kernel holds the "
    "GPU while the iterations are enqueued, so launch overhead is not timed) and rotate their "
    "inputs through enough buffer sets to cover 3x the L2. The PyTorch benchmark uses "
    "`triton.testing.do_bench` medians, which flush the L2 before every run, and also rotates its "
    "inputs. GB/s counts the minimum bytes an op must move (each input read once, each output "
    "written once); % copy is that against the device-to-device copy bandwidth (a 2 GiB buffer, "
    "bytes read + written) that each benchmark measures in the same run (listed at the top).")


def copy_bandwidths(run):
    """'4271 GB/s (qkvfuse_bench_kernels), ...': each benchmark's own measurement."""
    copies = run.meta_values("copy bandwidth")
    copies.update(run.meta_values("copy bandwidth (2 GiB buffer, read + write)"))
    return ", ".join(f"{fmt(number(v.split()[0]), 0)} GB/s ({name})"
                     for name, v in copies.items()) or "not recorded"


def header(run, md_path, png_path):
    meta_torch = run.sources.get("bench_torch", (None, {}))[1]
    tokens = meta_torch.get("tokens") or next((r["tokens"] for r in run.kernels), "?")
    v_dims = sorted({int(r["v_dim"]) for r in run.kernels if number(r["v_dim"])} |
                    {int(m[1]) for r in run.torch for m in [re.search(r"Dv=(\d+)", r["shape"])]
                     if m})
    lines = ["# qkvfuse benchmarks", "",
             paragraph("Written by `scripts/bench_report.sh` (`bench/report.py`) from one run of "
                       "every benchmark; regenerate it rather than edit it."), "",
             f"- device: {run.device()}",
             f"- date: {run.date()}",
             f"- commit: {run.one_value('commit')}"]
    if meta_torch:
        lines.append(f"- torch: {meta_torch.get('torch', '?')}, triton "
                     f"{meta_torch.get('triton', '?')}; reference: "
                     f"{meta_torch.get('reference', '?')}")
    lines.append(f"- problem: T = {tokens} tokens"
                 + (f", C = {meta_torch['channels']} channels" if meta_torch.get("channels")
                    else "") + (f", V head width {v_dims[0]}" if len(v_dims) == 1 else ""))
    lines.append(f"- copy bandwidth (2 GiB device-to-device, read + write): {copy_bandwidths(run)}")
    lines.append("- raw results: " + ", ".join(f"`{path}`" for path, _ in run.sources.values()))
    missing = [n for n in ("qkvfuse_bench_kernels", "qkvfuse_bench_fp8", "bench_torch")
               if n not in run.sources]
    if missing:
        lines.append(f"- not run: {', '.join(missing)}")
    if png_path:
        lines += ["", f"![benchmark chart]({os.path.relpath(png_path, Path(md_path).parent)})"]
    return lines + [""]


# bench/bench_hf_step.py's sections: from its begin marker to the matching end marker.
KEPT_SECTION = re.compile(r"<!-- bench_hf_step (\S+): begin.*?<!-- bench_hf_step \1: end -->",
                          re.S)


def kept_sections(text):
    """The sections of `text` that another benchmark owns (KEPT_SECTION), in their order."""
    return [match.group(0) for match in KEPT_SECTION.finditer(text)]


def write_markdown(run, md_path, png_path):
    kept = kept_sections(Path(md_path).read_text()) if Path(md_path).exists() else []
    lines = header(run, md_path, png_path)
    lines += memory_bound_section(run) + gemm_section(run) + packed_section(run)
    lines += general_section(run)
    lines += ["## How measured", "", paragraph(HOW_MEASURED), ""]
    failures = run.failures()
    if failures:
        lines += ["## Failed cases", ""] + [f"- {f}" for f in failures] + [""]
    for section in kept:
        lines += [section, ""]
    Path(md_path).parent.mkdir(parents=True, exist_ok=True)
    Path(md_path).write_text("\n".join(lines).rstrip() + "\n")


# ---- chart --------------------------------------------------------------------------------------

def write_chart(run, png_path):
    """Left: % of copy bandwidth of the memory-bound kernels, qkvfuse next to its baselines (the
    PyTorch benchmark; without it, the C++ benchmark's qkvfuse alone). Right: the whole op's
    forward + backward time, eager and as a CUDA graph, qkvfuse and the reference."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("bench/report.py: matplotlib is needed for the chart (pip install matplotlib), "
                 "or pass --png '' to skip it; the markdown was written")

    bandwidth = {}  # group label -> {impl: % copy}, kernel by kernel
    for section, short in (("norm+rope forward", "fwd"), ("fused fp8 backward", "fp8 bwd")):
        for r in run.torch_rows(section):
            if number(r["% copy"]) is not None:
                h, d = heads_dim(r["shape"])
                label = f"{short} H={h} D={d} {r['mode']}"
                bandwidth.setdefault(label, {})[r["impl"]] = number(r["% copy"])
    if not bandwidth:
        for kernel, short in (("qk_norm_rope", "fwd"), ("qk_norm_rope_backward", "bf16 bwd"),
                              ("qkv_backward_fp8", "fp8 bwd")):
            for r in run.kernels:
                if r["kernel"] == kernel and number(r["pct_copy"]) is not None:
                    label = f"{short} H={r['heads']} D={r['head_dim']} {r['mode']}"
                    bandwidth[label] = {"qkvfuse": number(r["pct_copy"])}

    steps = {}  # shape label -> {series: ms}
    for r in run.torch:
        series = {("packed op fwd+bwd eager", "qkvfuse"): "qkvfuse eager",
                  ("packed op fwd+bwd CUDA graph", "qkvfuse"): "qkvfuse graph",
                  ("packed op fwd+bwd eager", "reference"): "reference eager",
                  ("packed op fwd+bwd CUDA graph", "reference"): "reference graph",
                  ("packed op fwd+bwd eager", "bf16 compiled chain"): "bf16 compiled chain",
                  }.get((r["section"], r["impl"]))
        if series and number(r["ms"]) is not None:
            h, d = heads_dim(r["shape"])
            steps.setdefault(f"H={h} D={d} {r['mode']}", {})[series] = number(r["ms"])

    panels = [p for p in (bandwidth, steps) if p]
    if not panels:
        print("bench/report.py: nothing to chart")
        return
    height = max(3.0, 0.22 * max(len(p) * len(next(iter(p.values()))) for p in panels) + 1.5)
    # At least 10 inches wide: the title (device, date, commit) must fit over a single panel.
    fig, axes = plt.subplots(1, len(panels), figsize=(max(10, 7.5 * len(panels)), min(height, 24)),
                             squeeze=False)
    axes = list(axes[0])
    if bandwidth:
        ax = axes.pop(0)
        grouped_bars(ax, bandwidth, "% of copy bandwidth (higher is better)")
        ax.set_xlim(0, 100)
        ax.set_title("memory-bound kernels", fontsize=10)
    if steps:
        ax = axes.pop(0)
        grouped_bars(ax, steps, "ms (lower is better)")
        ax.set_title("whole packed op, forward + backward", fontsize=10)
    fig.suptitle(f"qkvfuse benchmarks: {run.device()}, {run.date()}, commit "
                 f"{run.one_value('commit')}")
    fig.tight_layout()
    Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


# One colour per implementation in both panels; a CUDA graph is the lighter shade of its eager.
COLORS = {"qkvfuse": "#1f77b4", "qkvfuse eager": "#1f77b4", "qkvfuse graph": "#8cbfe6",
          "reference": "#ff7f0e", "reference eager": "#ff7f0e", "reference graph": "#ffc08a",
          "compiled chain": "#2ca02c", "bf16 compiled chain": "#2ca02c", "eager chain": "#d62728"}


def grouped_bars(ax, groups, xlabel):
    """Horizontal bars: one group per key of `groups` (top to bottom), one bar per series (in
    COLORS' order; a missing value leaves a gap)."""
    series = [name for name in COLORS if any(name in g for g in groups.values())]
    width = 0.8 / len(series)
    labels = list(groups)
    for i, name in enumerate(series):
        ys = [g + (i - (len(series) - 1) / 2) * width for g in range(len(labels))]
        values = [groups[label].get(name, 0.0) for label in labels]
        ax.barh(ys, values, height=width, label=name, color=COLORS[name])
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", help="qkvfuse_bench_kernels CSV")
    parser.add_argument("--fp8", help="qkvfuse_bench_fp8 CSV")
    parser.add_argument("--torch", help="bench_torch.py CSV")
    parser.add_argument("--md", default="docs/benchmarks.md")
    parser.add_argument("--png", default="docs/benchmarks.png", help="'' for no chart")
    args = parser.parse_args()
    paths = [p for p in (args.kernels, args.fp8, args.torch) if p]
    if not paths:
        parser.error("give at least one of --kernels, --fp8, --torch")
    for path in paths:
        if not Path(path).is_file():
            parser.error(f"no such file: {path}")
    run = Run(args.kernels, args.fp8, args.torch)
    write_markdown(run, args.md, args.png)
    print(f"wrote {args.md}")
    if args.png:
        write_chart(run, args.png)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
