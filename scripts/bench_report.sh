#!/usr/bin/env bash
# The one-command benchmark report. On the GPU machine, with a built tree, it runs every benchmark
# of the project and writes docs/benchmarks.md (tables) and docs/benchmarks.png (chart):
#
#   scripts/bench_report.sh        (scripts/device_run.sh's bench stage calls it)
#
# It runs $QKVFUSE_BUILD_DIR/bench/qkvfuse_bench_kernels and qkvfuse_bench_fp8 with --csv, then
# bench/bench_torch.py (when the qkvfuse package imports; against the reference Triton
# implementation when .seed/reference_triton.py exists), then bench/report.py on the three CSVs.
# Each benchmark's output (.txt: stdout + stderr) and CSV go to $QKVFUSE_BENCH_DIR as
# <date>_<commit>_<device>_<benchmark>.{txt,csv}; the CSVs are also copied to bench/results/, where
# the report cites them. Commit docs/benchmarks.md, docs/benchmarks.png and those CSVs together.
#
# Environment:
#   QKVFUSE_BUILD_DIR    build tree with the benchmarks (default build-device)
#   QKVFUSE_BENCH_DIR    raw outputs (default /tmp/qkvfuse-bench)
#   QKVFUSE_COMMIT       commit to record (default: git rev-parse --short HEAD; device_run.sh
#                        passes the one device_prepare.sh wrote, the device's .git may be stale)
#   QKVFUSE_DEVICE_SLUG  device part of the file names (default from nvidia-smi: h200, h100-...)
#   QKVFUSE_BENCH_TORCH  0 skips the PyTorch benchmark (default 1)
#   QKVFUSE_REFERENCE    reference implementation (default .seed/reference_triton.py)
#   QKVFUSE_LIGER_PATH   Liger-Kernel for bench_torch.py's general section: a folder for
#                        sys.path, a liger_kernel-*.whl or a folder holding one (default .whl/,
#                        git-ignored: `pip download --no-deps liger-kernel -d .whl`); none: no
#                        Liger rows
#   QKVFUSE_AXOLOTL_PATH axolotl's fused RMSNorm + RoPE kernel for the same section: its file or
#                        a folder holding it (default .seed/axolotl-kernel/, where
#                        scripts/device_prepare.sh extracts it); none: no axolotl rows
#   QKVFUSE_BENCH_ARGS   extra arguments for the C++ benchmarks (e.g. --iters 200)
# Prints one line per step. Exit status 1 when a benchmark or the report failed; the report is
# still written from whatever ran.
set -uo pipefail
source "$(dirname "$0")/common.sh" || exit 1
build=${QKVFUSE_BUILD_DIR:-build-device}
dir=${QKVFUSE_BENCH_DIR:-/tmp/qkvfuse-bench}
reference=${QKVFUSE_REFERENCE:-.seed/reference_triton.py}
# The C++ benchmarks read $QKVFUSE_COMMIT too, so all three record the same commit.
export QKVFUSE_COMMIT=${QKVFUSE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

# File names: <date>_<commit>_<device>_<benchmark>, as in bench/results/ ("NVIDIA H200" -> h200).
slug=$(device_slug)
prefix=$(date -u +%F)_${QKVFUSE_COMMIT//[^A-Za-z0-9._-]/-}_${slug:-gpu}
mkdir -p "$dir" bench/results docs
status=0
report_args=()  # --kernels / --fp8 / --torch with the copies in bench/results/
copied=()

# run NAME REPORT_FLAG COMMAND...: runs one benchmark, which writes $dir/${prefix}_NAME.csv; when
# it did, copies that to bench/results/ and hands the copy to the report.
run() {
  local name=$1 flag=$2
  shift 2
  local csv=$dir/${prefix}_$name.csv
  rm -f "$csv"  # never report a CSV left by an earlier run
  "$@" >"$dir/${prefix}_$name.txt" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || status=1
  if [ -s "$csv" ]; then
    cp "$csv" bench/results/
    copied+=("bench/results/${prefix}_$name.csv")
    report_args+=("$flag" "${copied[-1]}")
    echo "$name: rc=$rc"
  else
    echo "$name: rc=$rc, no CSV (see $dir/${prefix}_$name.txt)"
    status=1
  fi
}

for name in qkvfuse_bench_kernels qkvfuse_bench_fp8; do
  flag=--kernels
  [ $name = qkvfuse_bench_fp8 ] && flag=--fp8
  if [ -x "$build/bench/$name" ]; then
    # shellcheck disable=SC2086  # QKVFUSE_BENCH_ARGS is a list of arguments
    run $name $flag "$build/bench/$name" --csv "$dir/${prefix}_$name.csv" ${QKVFUSE_BENCH_ARGS:-}
  else
    echo "$name: not built in $build"
    status=1
  fi
done

if [ "${QKVFUSE_BENCH_TORCH:-1}" = 1 ]; then
  if python_outside -c 'import qkvfuse, triton' 2>/dev/null; then
    ref=()
    [ -f "$reference" ] && ref=(--reference "$reference")
    baselines=() # Liger-Kernel and axolotl's kernel for the general section's baselines
    liger=${QKVFUSE_LIGER_PATH:-.whl} axolotl=${QKVFUSE_AXOLOTL_PATH:-.seed/axolotl-kernel}
    [ -e "$liger" ] && baselines+=(--liger-path "$liger")
    [ -e "$axolotl" ] && baselines+=(--axolotl-path "$axolotl")
    run bench_torch --torch python3 bench/bench_torch.py "${ref[@]}" "${baselines[@]}" \
      --out "$dir/${prefix}_bench_torch.csv" --commit "$QKVFUSE_COMMIT"
  else
    echo "bench_torch: skipped: qkvfuse or triton does not import (pip install .)"
    status=1
  fi
fi

if [ ${#report_args[@]} -eq 0 ]; then
  echo "report: no benchmark results, nothing written"
  exit 1
fi
python3 bench/report.py "${report_args[@]}" --md docs/benchmarks.md --png docs/benchmarks.png ||
  status=1
echo "raw results: ${copied[*]}"
exit $status
