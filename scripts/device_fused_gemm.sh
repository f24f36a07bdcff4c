#!/usr/bin/env bash
# One call on the GPU machine for the fused QKV GEMM (issue 22): builds the library and the fused
# GEMM's three targets, runs the epilogue's host test, the GPU check and the benchmark, and prints
# a short table last. Logs go to $OUT (summary.txt, logs.tgz, fused_qkv_gemm_bench.csv).
#
#   scripts/device_fused_gemm.sh            about 4-5 minutes on an H200 machine with 16 cores
#
# Steps: build (~2 min), the host test (1 s), the GPU check (small problems and the speedrun's
# shapes, ~1 min), the benchmark (~30 s), compute-sanitizer memcheck over the small problems
# (at most 60 s), then the tables. Worst case, every step timing out: about 6 minutes.
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
  ninja -C $build qkvfuse_fused_qkv_epilogue_host_test qkvfuse_fused_qkv_gemm_check \
    qkvfuse_bench_fused_qkv_gemm >>"$LOG/build.log" 2>&1
rc=$?
note "build: rc=$rc in $((SECONDS - start)) s; ptxas spill warnings: $(grep -c 'spilled' "$LOG/build.log")"
# One short line per kernel that spills (the mangled names are kilobytes long).
grep "spilled" "$LOG/build.log" | sed -E \
  -e "s/.*FusedQkvEpilogueI[^L]*Li([0-9]+)E.*', ([0-9]+) bytes spill stores, ([0-9]+) bytes spill loads.*/  fused D=\1: \2 B spill stores, \3 B spill loads/" \
  -e "s/.*Sm90TreeVisitor.*', ([0-9]+) bytes spill stores, ([0-9]+) bytes spill loads.*/  cutlass plain: \1 B spill stores, \2 B spill loads/" \
  | cut -c1-160 | sort -u | tee -a "$summary"
if [ $rc -ne 0 ]; then
  grep -E "error" -m 20 "$LOG/build.log"; tail -20 "$LOG/build.log"; pack; exit 1
fi

# ---- the epilogue's host test (no GPU needed; ctest runs it in any build with CUTLASS) ----
start=$SECONDS
timeout 120 $build/tests/fused_qkv_gemm/qkvfuse_fused_qkv_epilogue_host_test >"$LOG/host_test.log" 2>&1
note "host test: rc=$? in $((SECONDS - start)) s: $(tail -1 "$LOG/host_test.log")"

# ---- the GPU check ----
start=$SECONDS
timeout 120 $build/tests/fused_qkv_gemm/qkvfuse_fused_qkv_gemm_check >"$LOG/check.log" 2>&1
rc=$?
note "gpu check: rc=$rc in $((SECONDS - start)) s: $(tail -1 "$LOG/check.log")"
grep -E "FAIL|SKIPPED" "$LOG/check.log" | head -20 | tee -a "$summary"

# ---- the benchmark ----
start=$SECONDS
timeout 90 $build/bench/qkvfuse_bench_fused_qkv_gemm --iters "${QKVFUSE_FG_ITERS:-100}" \
  --csv "$OUT/fused_qkv_gemm_bench.csv" >"$LOG/bench.log" 2>&1
note "bench: rc=$? in $((SECONDS - start)) s"

# ---- compute-sanitizer memcheck over the small problems (out-of-bounds loads or stores of the
# epilogue: ragged T, partial V tiles, key offset's next-row writes); cuBLASLt's autotuning off to
# keep the launches few ----
if command -v compute-sanitizer >/dev/null; then
  start=$SECONDS
  QKVFUSE_FP8_GEMM_AUTOTUNE=0 timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 \
    $build/tests/fused_qkv_gemm/qkvfuse_fused_qkv_gemm_check --quick >"$LOG/memcheck.log" 2>&1
  note "memcheck (--quick problems): rc=$? in $((SECONDS - start)) s: $(grep -E 'ERROR SUMMARY' "$LOG/memcheck.log" | tail -1) $(grep -E '^check_fused' "$LOG/memcheck.log" | tail -1)"
else
  note "memcheck: compute-sanitizer not found"
fi

# ---- the short table, last ----
{
  sed -n '/^== summary/,$p' "$LOG/check.log"
  echo "== bench"
  cat "$LOG/bench.log"
} | tee -a "$summary"
pack
