"""Same-run A/B of two builds of qkvfuse_bench_kernels: the rows both builds measured, each the
best (lowest) median over the rounds, the ratio old / new (> 1: the new build is faster) and the
new build's % of the copy bandwidth measured in its run (the best round's).

  python bench/ab_kernels.py --old CSV [CSV ...] --new CSV [CSV ...] [--out PATH]

The rounds are meant to be interleaved (old, new, old, new) in one device session, so that clock
and power drift reach both builds alike; the best round per build counts.
"""
import argparse
import csv
from pathlib import Path


def read(paths):
    """{(kernel, mode, tokens, heads, kv_heads, head_dim, v_dim, n): [(ms, % copy), ...]} and the
    copy GB/s.

    n counts earlier rows of the same key in the file, and every build runs its cases in the same
    order (bench_kernels.cu), so the n-th such row is the same case in both builds. (The Qwen3-8B
    variants of QKVFUSE_BENCH_VARIANTS share its shape but carry their own mode labels,
    "Qwen3-8B/tables" and so on, so a variant one build lacks is left out, not mismatched.)"""
    rows, copy = {}, []
    for path in paths:
        lines = Path(path).read_text().splitlines()
        copy += [float(l.split(":")[1].split()[0]) for l in lines if l.startswith("# copy")]
        seen = {}
        for row in csv.DictReader(l for l in lines if not l.startswith("#")):
            shape = (row["kernel"], row["mode"], row["tokens"], row["heads"],
                     row.get("kv_heads", row["heads"]), row["head_dim"], row["v_dim"])
            n = seen.get(shape, 0)
            seen[shape] = n + 1
            if not row["ms"] or row["ms"] == "-":
                continue
            pct = row.get("pct_copy", "-")
            rows.setdefault(shape + (n,), []).append(
                (float(row["ms"]), float(pct) if pct not in ("", "-") else float("nan")))
    return rows, copy


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", nargs="+", required=True)
    parser.add_argument("--new", nargs="+", required=True)
    parser.add_argument("--out")
    args = parser.parse_args()
    old, old_copy = read(args.old)
    new, new_copy = read(args.new)
    lines = [f"copy GB/s: old {', '.join(f'{c:.0f}' for c in old_copy)}; "
             f"new {', '.join(f'{c:.0f}' for c in new_copy)}", "",
             "| kernel | mode | T | H | D | Dv | old ms | new ms | old / new | new % copy |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key in sorted(set(old) & set(new)):
        kernel, mode, tokens, heads, kv_heads, head_dim, v_dim, n = key
        a = min(old[key])[0]
        b, b_pct = min(new[key])
        heads_text = heads if kv_heads == heads else f"{heads}/{kv_heads}"
        mode_text = mode if n == 0 else f"{mode} #{n}"
        lines.append(f"| {kernel} | {mode_text} | {tokens} | {heads_text} | {head_dim} | {v_dim} | "
                     f"{a:.4f} | {b:.4f} | {a / b:.3f} | {b_pct:.1f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
