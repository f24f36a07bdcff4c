#!/usr/bin/env bash
# One call on the GPU machine for the fused QKV GEMM (issue 22): builds the library and the fused
# GEMM's three targets, runs the epilogue's host test, the GPU check and the benchmark, and prints
# a short table last. Logs go to $OUT (summary.txt, logs.tgz, fused_qkv_gemm_bench.csv).
#
#   scripts/device_fused_gemm.sh            about 5 minutes on an H200 machine with 16 cores
#
# Steps: build (~2 min), the host test (1 s), the GPU check (small problems and the speedrun's
# shapes, ~1 min), the benchmark (~40 s), Nsight Compute on one launch of the fused kernel and
# one of the plain CUTLASS GEMM at D = 128, compute-sanitizer memcheck over the small problems,
# then the tables. Every step after the build is time-boxed, and the boxes are cut to end by one
# deadline, QKVFUSE_FG_DEADLINE seconds after the start (default 345): a step that would start
# with less than 10 s left is skipped and says so. The build is boxed at 5 minutes and counts
# against the same deadline: worst case, about 6 minutes in all.
#
# Needs, carried next to the tree (git-ignored; the GPU machine has no network):
#   .deps/nvidia_cutlass-4.2.0.0-py3-none-any.whl   (scripts/fetch_cutlass.sh downloads it here
#                                                    and unpacks its headers; it is re-checked
#                                                    against the pinned sha256 there)
# No GoogleTest: the targets are plain executables. QKVFUSE_FG_ITERS sets the benchmark's
# iterations (default 100). QKVFUSE_FG_BUILD names a build folder already configured with CUTLASS
# (e.g. scripts/device_run.sh's build-device): its three targets are built there, nothing else.
set -uo pipefail
source "$(dirname "$0")/common.sh"  # the repository root; nvcc on PATH
OUT=${OUT:-/tmp/qkvfuse-fg-out}
LOG=/tmp/qkvfuse-fg-logs
build=${QKVFUSE_FG_BUILD:-build-fg}
rm -rf "$LOG"; mkdir -p "$OUT" "$LOG"
summary=$LOG/summary.txt
: >"$summary"
# Everything is packed after each step, so a run cut short still brings back what it finished.
pack() { tar czf "$OUT/logs.tgz" -C "$LOG" . 2>/dev/null; cp "$summary" "$OUT/summary.txt"; }
note() { echo "$*" | tee -a "$summary"; pack; }
deadline=${QKVFUSE_FG_DEADLINE:-345}
# box LIMIT: a step's time box in seconds, LIMIT or what is left before the deadline; fails (the
# step is skipped) with less than 10 s left.
box() {
  local left=$((deadline - SECONDS))
  [ "$left" -ge 10 ] || return 1
  echo $((left < $1 ? left : $1))
}

note "device: $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader 2>/dev/null | head -1)"
note "commit: ${QKVFUSE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  date: $(date -u +%F)  nvcc: $(nvcc --version | grep -o 'release [0-9.]*')"

# ---- CUTLASS headers from the carried wheel ----
inc=$(scripts/fetch_cutlass.sh 2>"$LOG/fetch_cutlass.log") || {
  note "fetch_cutlass.sh failed: $(tail -3 "$LOG/fetch_cutlass.log")"
  exit 1
}
note "cutlass: $inc"

# ---- build: the library and the three targets only (ENABLE_CUTLASS=ON: an error, not a build
# without the fused GEMM, if the headers are unusable) ----
start=$SECONDS
[ -n "${QKVFUSE_FG_BUILD:-}" ] && echo "using the configured build $build" >"$LOG/build.log" ||
cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
  -DQKVFUSE_BUILD_TESTS=OFF -DQKVFUSE_BUILD_BENCH=ON -DQKVFUSE_BUILD_EXAMPLES=OFF \
  -DQKVFUSE_ENABLE_CUTLASS=ON -DQKVFUSE_CUTLASS_INCLUDE_DIR="$inc" >"$LOG/build.log" 2>&1 &&
  timeout 300 ninja -C $build qkvfuse_fused_qkv_epilogue_host_test qkvfuse_fused_qkv_gemm_check \
    qkvfuse_bench_fused_qkv_gemm >>"$LOG/build.log" 2>&1
rc=$?
note "build: rc=$rc in $((SECONDS - start)) s; ptxas spill warnings: $(grep -c 'spilled' "$LOG/build.log")"
# One short line per kernel that spills (the mangled names are kilobytes long).
grep "spilled" "$LOG/build.log" | sed -E \
  -e "s/.*FusedQkvEpilogueI[^L]*Li([0-9]+)EL[^ ]*EpilogueWorkE([0-9])E.*', ([0-9]+) bytes spill stores, ([0-9]+) bytes spill loads.*/  fused D=\1 work \2 (0 full, 1 store-only, 2 norm-only): \3 B spill stores, \4 B spill loads/" \
  -e "s/.*Sm90TreeVisitor.*', ([0-9]+) bytes spill stores, ([0-9]+) bytes spill loads.*/  cutlass plain: \1 B spill stores, \2 B spill loads/" \
  | cut -c1-160 | sort -u | tee -a "$summary"
if [ $rc -ne 0 ]; then
  grep -E "error" -m 20 "$LOG/build.log"; tail -20 "$LOG/build.log"; pack; exit 1
fi

# ---- the epilogue's host test (no GPU needed; ctest runs it in any build with CUTLASS) ----
start=$SECONDS
if t=$(box 30); then
  timeout $t $build/tests/fused_qkv_gemm/qkvfuse_fused_qkv_epilogue_host_test >"$LOG/host_test.log" 2>&1
  note "host test: rc=$? in $((SECONDS - start)) s: $(tail -1 "$LOG/host_test.log")"
else
  note "host test: skipped (deadline)"
fi

# ---- the GPU check ----
start=$SECONDS
if t=$(box 120); then
  timeout $t $build/tests/fused_qkv_gemm/qkvfuse_fused_qkv_gemm_check >"$LOG/check.log" 2>&1
  rc=$?
  note "gpu check: rc=$rc in $((SECONDS - start)) s: $(tail -1 "$LOG/check.log")"
  grep -E "FAIL|SKIPPED" "$LOG/check.log" | head -20 | tee -a "$summary"
else
  note "gpu check: skipped (deadline)"
fi

# ---- the benchmark ----
start=$SECONDS
if t=$(box 90); then
  timeout $t $build/bench/qkvfuse_bench_fused_qkv_gemm --iters "${QKVFUSE_FG_ITERS:-100}" \
    --csv "$OUT/fused_qkv_gemm_bench.csv" >"$LOG/bench.log" 2>&1
  note "bench: rc=$? in $((SECONDS - start)) s"
else
  note "bench: skipped (deadline)"
fi

# ---- Nsight Compute: one launch of the fused kernel at D = 128, and of the plain CUTLASS GEMM
# (the same main loop) for comparison. The benchmark runs one variant (--kernel), so the only
# CUTLASS kernel it launches is that one (-k matches the function name without template
# arguments: cutlass::device_kernel); the third launch is profiled, at the clocks the benchmark
# sees. The report is read back three times: the details (ncu_<variant>.txt), the raw metrics
# (ncu_<variant>_raw.txt: the stall reasons for the summary) and the per-instruction source
# counters (ncu_<variant>_source.csv, SASS with stall samples); the report itself stays in /tmp.
if command -v ncu >/dev/null; then
  sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section SchedulerStats --section LaunchStats --section Occupancy --section SourceCounters"
  for variant in fused cutlass; do
    start=$SECONDS
    rep=/tmp/qkvfuse-fg-ncu-$variant
    rm -f "$rep.ncu-rep"
    if ! t=$(box 90); then note "ncu $variant: skipped (deadline)"; continue; fi
    # shellcheck disable=SC2086  # $sections is a word list
    timeout $t ncu --clock-control none -k regex:device_kernel --launch-skip 2 --launch-count 1 \
      $sections -o "$rep" $build/bench/qkvfuse_bench_fused_qkv_gemm --head-dim 128 \
      --kernel "$variant" --iters 50 >"$LOG/ncu_$variant.log" 2>&1
    rc=$?
    if [ -f "$rep.ncu-rep" ] && t=$(box 30); then
      # shellcheck disable=SC2016  # the inner script's own arguments
      timeout $t bash -c 'ncu --import "$1" >"$2.txt" 2>&1
        ncu --import "$1" --page raw >"$2_raw.txt" 2>&1
        ncu --import "$1" --page source --csv --print-source sass >"$2_source.csv" 2>&1' \
        _ "$rep.ncu-rep" "$LOG/ncu_$variant"
    fi
    # The stall reasons, in warp cycles per issued instruction (WarpStateStats), largest first.
    stalls=$(grep -E '^ +smsp__[a-z_]*issue_stalled_[a-z_]+_per_issue_active\.ratio .* [0-9.]+ *$' \
      "$LOG/ncu_${variant}_raw.txt" 2>/dev/null |
      sed -E 's/^ +smsp__[a-z_]*issue_stalled_([a-z_]+)_per_issue_active\.ratio .* ([0-9.]+) *$/\2 \1/' |
      sort -gr | head -5 | awk '{printf "%s%s %s", (NR > 1 ? ", " : ""), $2, $1}')
    note "ncu $variant (D=128): rc=$rc in $((SECONDS - start)) s: $(grep -E '^ +Duration' "$LOG/ncu_$variant.txt" 2>/dev/null | head -1 | tr -s ' ')"
    note "  stalls (cycles per issued instruction): ${stalls:-none found}; $(grep -E '^ +Warp Cycles Per Issued Instruction' "$LOG/ncu_$variant.txt" 2>/dev/null | head -1 | tr -s ' ')"
  done
else
  note "ncu: not found"
fi

# ---- compute-sanitizer memcheck over the small problems (out-of-bounds loads or stores of the
# epilogue: ragged T, partial V tiles, key offset's next-row writes); cuBLASLt's autotuning off to
# keep the launches few ----
if ! command -v compute-sanitizer >/dev/null; then
  note "memcheck: compute-sanitizer not found"
elif t=$(box 60); then
  start=$SECONDS
  QKVFUSE_FP8_GEMM_AUTOTUNE=0 timeout $t compute-sanitizer --tool memcheck --error-exitcode 9 \
    $build/tests/fused_qkv_gemm/qkvfuse_fused_qkv_gemm_check --quick >"$LOG/memcheck.log" 2>&1
  note "memcheck (--quick problems): rc=$? in $((SECONDS - start)) s: $(grep -E 'ERROR SUMMARY' "$LOG/memcheck.log" | tail -1) $(grep -E '^check_fused' "$LOG/memcheck.log" | tail -1)"
else
  note "memcheck: skipped (deadline)"
fi

# ---- the short table, last ----
{
  sed -n '/^== summary/,$p' "$LOG/check.log"
  echo "== bench"
  cat "$LOG/bench.log"
} | tee -a "$summary"
pack
