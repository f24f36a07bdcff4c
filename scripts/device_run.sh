#!/usr/bin/env bash
# One call on the GPU machine: build (C++ + CUDA + PyTorch extension), run the GPU tests, the
# sanitizers and the benchmarks, and print a short table last. Logs and result files go to $OUT.
#
#   scripts/device_run.sh [stage ...]     stages: build test sanitize fuzz python profile ncu train train2
#                                         train2hf train1hf ab general bench hfstep section9
#                                         (default: build test python bench)
# Needs, carried next to the tree (git-ignored): .gtest/ (GoogleTest sources; the GPU machine has
# no network), .seed/reference_triton.py (the reference implementation, for side-by-side runs),
# .seed/axolotl-kernel/ (axolotl's fused RMSNorm + RoPE kernel, for the general stage) and .whl/
# (the wheels of the packages the machine lacks); scripts/device_prepare.sh puts them there.
set -uo pipefail
source "$(dirname "$0")/common.sh"
# NVLink multicast stays off in every process started here (NCCL, PyTorch, NVSHMEM): a program
# that uses it can put a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/qkvfuse-out}
# $OUT brings back at most 8 files: logs and results are written to $LOG and packed into one
# archive at the end.
LOG=/tmp/qkvfuse-logs
rm -rf "$LOG"; mkdir -p "$OUT" "$LOG"
stages=${*:-build test python bench}
build=build-device
summary=$LOG/summary.txt
: >"$summary"
# Logs and summary are packed into $OUT after every note, not only at the end: a call cut short by
# the device's time limit still brings back what the finished stages wrote.
pack() { tar czf "$OUT/logs.tgz" -C "$LOG" . 2>/dev/null; cp "$summary" "$OUT/summary.txt"; }
note() { echo "$*" | tee -a "$summary"; pack; }
has() { [[ " $stages " == *" $1 "* ]]; }

note "device: $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null | head -1)"
# The commit device_prepare.sh recorded here: the device's copy of .git can be older than the tree.
commit=${QKVFUSE_COMMIT:-$(cat .device/COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)}
note "commit: $commit  date: $(date -u +%F)"

# The A/B's old sides from source (.device/old-src*/, common.sh's start_old_builds): their
# benchmarks build in the background beside the build stage. QKVFUSE_AB_OLD names one prebuilt
# binary instead.
old_bins=() old_builders=()
if has ab && [ -z "${QKVFUSE_AB_OLD:-}" ]; then
  # The benchmark needs no CUTLASS GEMM: old trees that have them build without (minutes saved).
  start_old_builds build-old qkvfuse_bench_kernels -DQKVFUSE_ENABLE_CUTLASS=OFF
fi
[ -n "${QKVFUSE_AB_OLD:-}" ] && old_bins=("$QKVFUSE_AB_OLD")

if has build; then
  torch_prefix=$(python_outside -c 'import torch; print(torch.utils.cmake_prefix_path)')
  start=$SECONDS
  cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DQKVFUSE_GTEST_SOURCE_DIR="$PWD/.gtest" -DQKVFUSE_BUILD_TORCH=ON \
    -DCMAKE_PREFIX_PATH="$torch_prefix" >"$LOG/build.log" 2>&1 &&
    ninja -C $build >>"$LOG/build.log" 2>&1
  rc=$?
  note "build: rc=$rc in $((SECONDS - start)) s; ptxas spill warnings: $(grep -c 'Registers are spilled' "$LOG/build.log")"
  if [ $rc -ne 0 ]; then grep -E "error|Error" -m 30 "$LOG/build.log"; tail -20 "$LOG/build.log"; exit 1; fi
  # Kernel entries of the library's CUDA objects (the rope family's budget: docs/STATUS.md), and
  # the rope objects' compile times.
  scripts/count_kernels.sh --sass $build >"$LOG/kernels.txt" 2>&1
  note "kernel entries: $(grep -E '^(qk|qkv|total)' "$LOG/kernels.txt" | tr -s ' ' | paste -sd ';')"
  note "rope objects (s): $(awk '$4 ~ /(qk_norm_rope|qk_norm_rope_backward|qkv_backward_fp8)\.cu\.o$/ {n=split($4, p, "/"); printf "%s %.1f; ", p[n], ($2 - $1) / 1000}' $build/.ninja_log)"
fi

if has test; then
  start=$SECONDS
  ctest --test-dir $build -j 8 --output-on-failure --timeout 300 >"$LOG/ctest.log" 2>&1
  rc=$?
  note "ctest: rc=$rc in $((SECONDS - start)) s: $(grep -E 'tests passed|tests failed' "$LOG/ctest.log")"
  grep -E "Failed|\*\*\*|SKIPPED" "$LOG/ctest.log" | head -40
  # The skipped count must be zero here: every GPU test runs on this machine.
  $build/tests/qkvfuse_tests --gtest_brief=1 2>&1 | grep -E "SKIPPED|PASSED|FAILED" | tail -5 | tee -a "$summary"
fi





# The op library of the build stage, loaded from the build tree (no second build by pip).
use_build_tree_python() {
  export QKVFUSE_TORCH_LIBRARY=$PWD/$build/bindings/torch/libqkvfuse_torch.so
  export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
  [ -f "$QKVFUSE_TORCH_LIBRARY" ] || note "no $QKVFUSE_TORCH_LIBRARY: run the build stage first"
}

if has python; then
  start=$SECONDS
  use_build_tree_python
  # test_transformers_compose.py's GPU tests run Liger-Kernel's kernels: its carried wheel
  # (scripts/device_prepare.sh) goes into a folder of its own on PYTHONPATH (they skip without).
  if ! python3 -c 'import liger_kernel' 2>/dev/null && compgen -G ".whl/liger_kernel-*.whl" >/dev/null
  then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/qkvfuse-liger \
      .whl/liger_kernel-*.whl >"$LOG/pip_liger.log" 2>&1
    note "Liger-Kernel for the composition tests: pip rc=$?"
    export PYTHONPATH=$PYTHONPATH:/tmp/qkvfuse-liger
  fi
  # One pytest process per file: a crash in one file is reported and the others still run.
  for file in ${QKVFUSE_PYTEST_FILES:-tests/python/test_*.py}; do
    name=$(basename "$file" .py)
    (cd tests/python && python3 -m pytest -q -ra "$name.py" >"$LOG/pytest_$name.log" 2>&1)
    note "pytest $name: rc=$? $(tail -1 "$LOG/pytest_$name.log")"
  done
  note "pytest: $((SECONDS - start)) s"
fi

# compute-sanitizer: memcheck and racecheck over the GPU tests (the kernels' test sweep; racecheck
# over the kernel tests only: it is slow), and the four tools over a sweep of the fuzz harness
# (small shapes). Each run is time-boxed; a timeout is reported as such. With
# QKVFUSE_SANITIZE_GPU=N it runs in the background on GPU N while the stages after it use GPU 0
# (on a two-GPU machine; train2 then shares GPU N with it) and is waited for at the end.
run_sanitize() {
  local start=$SECONDS
  local tests_timeout=${QKVFUSE_SANITIZE_TIMEOUT:-240}
  # Without --gtest_brief the logs list every test that finished, should a run be cut short.
  # QKVFUSE_SANITIZE_FILTER: the GPU tests memcheck runs (default all but CudaLarge);
  # QKVFUSE_SANITIZE_RACECHECK=0 skips racecheck over the kernel tests; QKVFUSE_SANITIZE_FUZZ_TOOLS:
  # the tools run over the fuzz sweep (default all four; empty: none).
  local filter=${QKVFUSE_SANITIZE_FILTER:-Cuda*-CudaLarge*}
  if [ "${QKVFUSE_SANITIZE_TESTS:-1}" = 1 ]; then
    timeout "$tests_timeout" compute-sanitizer --tool memcheck --error-exitcode 9 \
      $build/tests/qkvfuse_tests --gtest_filter="$filter" >"$LOG/sanitize_memcheck_tests.log" 2>&1
    note "compute-sanitizer memcheck ($filter): rc=$? $(grep -E 'ERROR SUMMARY' "$LOG/sanitize_memcheck_tests.log" | tail -1) $(grep -cE '^\[       OK' "$LOG/sanitize_memcheck_tests.log") tests OK, $(grep -cE '^\[  FAILED  \] [A-Z]' "$LOG/sanitize_memcheck_tests.log") failed in $((SECONDS - start)) s"
    if [ "${QKVFUSE_SANITIZE_RACECHECK:-1}" = 1 ]; then
      timeout "$tests_timeout" compute-sanitizer --tool racecheck --error-exitcode 9 \
        $build/tests/qkvfuse_tests --gtest_filter='CudaQkNormRope*:CudaQkvBackwardFp8*:CudaQuantize*' >"$LOG/sanitize_racecheck_tests.log" 2>&1
      note "compute-sanitizer racecheck (kernel GPU tests): rc=$? $(grep -E 'SUMMARY' "$LOG/sanitize_racecheck_tests.log" | tail -1) $(grep -cE '^\[       OK' "$LOG/sanitize_racecheck_tests.log") tests OK, $(grep -cE '^\[  FAILED  \] [A-Z]' "$LOG/sanitize_racecheck_tests.log") failed"
    fi
  fi
  for tool in ${QKVFUSE_SANITIZE_FUZZ_TOOLS-memcheck racecheck synccheck initcheck}; do
    timeout ${QKVFUSE_SANITIZE_FUZZ_TIMEOUT:-120} compute-sanitizer --tool $tool --error-exitcode 9 \
      $build/tests/fuzz/qkvfuse_fuzz --cases ${QKVFUSE_SANITIZE_CASES:-150} --seed 7 --max-tokens 200 >"$LOG/sanitize_$tool.log" 2>&1
    note "compute-sanitizer $tool (${QKVFUSE_SANITIZE_CASES:-150} fuzz cases, seed 7): rc=$? $(grep -E 'SUMMARY' "$LOG/sanitize_$tool.log" | tail -1) $(grep -E '^fuzz:' "$LOG/sanitize_$tool.log" | tail -1)"
  done
  note "sanitize: $((SECONDS - start)) s"
}
# Waits for the A/B's old builds once, keeping each one's exit status (old_build_rc).
old_build_rc=()
wait_old_builds() {
  [ ${#old_build_rc[@]} -eq ${#old_builders[@]} ] && return
  for i in "${!old_builders[@]}"; do
    wait "${old_builders[$i]}"
    old_build_rc[$i]=$?
  done
}

sanitize_pid=
if has sanitize; then
  if [ -n "${QKVFUSE_SANITIZE_GPU:-}" ]; then
    (export CUDA_VISIBLE_DEVICES=$QKVFUSE_SANITIZE_GPU; run_sanitize) &
    sanitize_pid=$!
  else
    run_sanitize
  fi
fi

if has fuzz; then
  # The harness's CPU reference is CPU-bound: let the A/B's old builds finish first (with three
  # of them compiling beside it, 10 000 cases did not finish in a call's time box).
  wait_old_builds
  start=$SECONDS
  seed=${QKVFUSE_FUZZ_SEED:-$RANDOM}
  $build/tests/fuzz/qkvfuse_fuzz --cases "${QKVFUSE_FUZZ_CASES:-10000}" --seed "$seed" >"$LOG/fuzz.log" 2>&1
  note "fuzz: rc=$? seed $seed: $(grep -E '^fuzz:' "$LOG/fuzz.log" | tail -1) in $((SECONDS - start)) s"
fi

if has section9; then
  # SPEC.md section 9 on CUDA (D up to 512, the V norm, the token-wide norm, query-only calls, no
  # angles): kernels that run only with QKVFUSE_CUDA_SECTION9=1 and had not run on a GPU before
  # this stage. Needs the build stage (this call's or an earlier one's on the same machine). Parts
  # (QKVFUSE_SECTION9_PARTS, default all, in this order): tests (the GPU tests of the families,
  # whose fixture sets the switch, and the dispatcher's), memcheck (compute-sanitizer over those
  # tests), fuzz (QKVFUSE_SECTION9_FUZZ_CASES, default 3000, the switch set: every GPU case may
  # draw section 9's options), python (the families' ops and models on CUDA with the switch, and
  # the refusals without it), bench (bench/bench_families.py: Gemma 4's global layers and
  # Qwen3-Next at T = 32768 against torch.compile of their chains).
  start=$SECONDS
  parts=" ${QKVFUSE_SECTION9_PARTS:-tests memcheck fuzz python bench} "
  if [[ $parts == *" tests "* ]]; then
    $build/tests/qkvfuse_tests --gtest_filter='*CudaFamilies*:RopeDispatch*:RopePaths*:ValidationFamilies*' \
      >"$LOG/section9_gtest.log" 2>&1
    note "section9 gtests: rc=$? $(grep -cE '^\[       OK' "$LOG/section9_gtest.log") OK, $(grep -cE '^\[  SKIPPED \] [A-Z]' "$LOG/section9_gtest.log") skipped, $(grep -cE '^\[  FAILED  \] [A-Z]' "$LOG/section9_gtest.log") failed"
    grep -E '^\[  FAILED  \] [A-Z]' "$LOG/section9_gtest.log" | head -20 | tee -a "$summary"
  fi
  if [[ $parts == *" memcheck "* ]]; then
    timeout "${QKVFUSE_SANITIZE_TIMEOUT:-300}" compute-sanitizer --tool memcheck --error-exitcode 9 \
      $build/tests/qkvfuse_tests --gtest_filter='*CudaFamilies*-*ManyTokens*' \
      >"$LOG/section9_memcheck.log" 2>&1
    note "section9 memcheck: rc=$? $(grep -E 'ERROR SUMMARY' "$LOG/section9_memcheck.log" | tail -1) $(grep -cE '^\[       OK' "$LOG/section9_memcheck.log") tests OK"
  fi
  if [[ $parts == *" fuzz "* ]]; then
    seed=${QKVFUSE_FUZZ_SEED:-$RANDOM}
    QKVFUSE_CUDA_SECTION9=1 $build/tests/fuzz/qkvfuse_fuzz --cases "${QKVFUSE_SECTION9_FUZZ_CASES:-3000}" \
      --seed "$seed" >"$LOG/section9_fuzz.log" 2>&1
    note "section9 fuzz: rc=$? seed $seed: $(grep -E '^fuzz:' "$LOG/section9_fuzz.log" | tail -1); $(grep -oE 'section 9 options: [^;]*' "$LOG/section9_fuzz.log" | tail -1)"
    grep -E '^MISMATCH' "$LOG/section9_fuzz.log" | head -10 | tee -a "$summary"
  fi
  if [[ $parts == *" python "* ]]; then
    use_build_tree_python
    for file in test_families_ops test_transformers_families test_errors; do
      (cd tests/python && QKVFUSE_CUDA_SECTION9=1 python3 -m pytest -q -ra "$file.py" -k cuda \
        >"$LOG/section9_pytest_$file.log" 2>&1)
      note "section9 pytest $file -k cuda (switch on): rc=$? $(tail -1 "$LOG/section9_pytest_$file.log")"
      (cd tests/python && python3 -m pytest -q -ra "$file.py" -k cuda \
        >"$LOG/section9_pytest_${file}_off.log" 2>&1)
      note "section9 pytest $file -k cuda (switch off): rc=$? $(tail -1 "$LOG/section9_pytest_${file}_off.log")"
    done
  fi
  if [[ $parts == *" bench "* ]]; then
    use_build_tree_python
    QKVFUSE_CUDA_SECTION9=1 python3 bench/bench_families.py --commit "$commit" \
      --out "$LOG/bench_families.csv" >"$LOG/bench_families.txt" 2>&1
    note "bench_families: rc=$?"
    cp "$LOG/bench_families.csv" "$OUT"/ 2>/dev/null
    grep -E "^families |^check" "$LOG/bench_families.txt" | tee -a "$summary"
  fi
  note "section9: $((SECONDS - start)) s"
fi

if has profile; then
  # One packed-op step replayed as a CUDA graph, kernel by kernel, qkvfuse and the reference
  # (needs the python stage); before the benchmarks, whose long full-power run lowers the clock.
  python3 bench/profile_packed.py --reference .seed/reference_triton.py \
    >"$LOG/profile_packed.txt" 2>&1
  note "profile_packed: rc=$? $(grep -E 'busy' "$LOG/profile_packed.txt" | tr -s ' ' | paste -sd ';')"
fi

if has ab; then
  # Same-run A/B of the rope kernels, each old build against this one: QKVFUSE_AB_ROUNDS
  # interleaved rounds (every old build, then the new one, ...); bench/ab_kernels.py takes the best
  # round of each. QKVFUSE_AB_ARGS adds arguments to every run (e.g. --head-dim 128). The Qwen3-8B
  # variants run unless QKVFUSE_BENCH_VARIANTS=0 (Qwen3-8B/no-norm is Llama's rotary-only layer).
  # One more side, "general-only", is this build with QKVFUSE_ROPE_GENERAL_ONLY=1: every call on
  # the general kernel, so that its table says what each specialization earns (old / new > 1: the
  # specialization is faster). QKVFUSE_AB_GENERAL=0 leaves it out. Another, "restored-rows", is
  # this build with QKVFUSE_ROPE_RESTORED_ROWS=1 (rope_dispatch.hpp RestoredRows): its table is
  # this build (old) against it (new), so > 1 there says a restored row is faster; the rows they
  # do not serve run the same kernels on both sides (the noise). QKVFUSE_AB_RESTORED=0 leaves it
  # out.
  start=$SECONDS
  wait_old_builds
  for i in "${!old_builders[@]}"; do
    note "old build ${old_bins[$i]}: rc=${old_build_rc[$i]} by $((SECONDS - start)) s"
  done
  export QKVFUSE_BENCH_VARIANTS=${QKVFUSE_BENCH_VARIANTS:-1}
  [ "$QKVFUSE_BENCH_VARIANTS" = 0 ] && unset QKVFUSE_BENCH_VARIANTS
  sides=("${old_bins[@]}")
  [ "${QKVFUSE_AB_GENERAL:-1}" = 1 ] && sides+=(general-only)
  [ "${QKVFUSE_AB_RESTORED:-1}" = 1 ] && sides+=(restored-rows)
  sides+=("$build/bench/qkvfuse_bench_kernels")
  for round in $(seq 1 "${QKVFUSE_AB_ROUNDS:-2}"); do
    for i in "${!sides[@]}"; do
      bin=${sides[$i]} env=()
      [ "$bin" = general-only ] && bin=$build/bench/qkvfuse_bench_kernels env=(QKVFUSE_ROPE_GENERAL_ONLY=1)
      [ "$bin" = restored-rows ] && bin=$build/bench/qkvfuse_bench_kernels env=(QKVFUSE_ROPE_RESTORED_ROWS=1)
      # shellcheck disable=SC2086
      env "${env[@]}" "$bin" --iters "${QKVFUSE_AB_ITERS:-100}" ${QKVFUSE_AB_ARGS:-} \
        --csv "$LOG/ab_${i}_$round.csv" >"$LOG/ab_${i}_$round.txt" 2>&1
      note "ab ${sides[$i]} round $round: rc=$? ($((SECONDS - start)) s)"
    done
  done
  new=$((${#sides[@]} - 1))
  for i in $(seq 0 $((new - 1))); do
    if [ "${sides[$i]}" = restored-rows ]; then
      note "ab: this build (old) against restored-rows (new, QKVFUSE_ROPE_RESTORED_ROWS=1)"
      python3 bench/ab_kernels.py --old "$LOG"/ab_"${new}"_*.csv --new "$LOG"/ab_"${i}"_*.csv \
        --out "$LOG/ab_$i.md" | tee -a "$summary"
      continue
    fi
    note "ab: ${sides[$i]} (old) against this build (new)"
    python3 bench/ab_kernels.py --old "$LOG"/ab_"${i}"_*.csv --new "$LOG"/ab_"${new}"_*.csv \
      --out "$LOG/ab_$i.md" | tee -a "$summary"
  done
  pack
fi

if has general; then
  # bench/bench_general.py alone (the model shapes against torch.compile, Liger-Kernel and
  # axolotl's kernel; the bench stage runs it too, inside bench_torch.py), on the build stage's op
  # library.
  start=$SECONDS
  axolotl=()
  [ -d .seed/axolotl-kernel ] && axolotl=(--axolotl-path .seed/axolotl-kernel)
  QKVFUSE_TORCH_LIBRARY=$PWD/$build/bindings/torch/libqkvfuse_torch.so \
    PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} \
    python3 bench/bench_general.py --liger-path .whl "${axolotl[@]}" --commit "$commit" \
    --out "$LOG/bench_general.csv" >"$LOG/bench_general.txt" 2>&1
  note "bench_general: rc=$? in $((SECONDS - start)) s"
  grep -E "^check|qkvfuse |^general fwd\+bwd|rows left out" "$LOG/bench_general.txt" |
    grep -vE "^check passed" |
    tee -a "$summary"
fi

if has bench; then
  # Every benchmark, then docs/benchmarks.md + .png (scripts/bench_report.sh). The outputs and
  # CSVs stay in $LOG as <date>_<commit>_<device>_<benchmark>.{txt,csv}; the report comes back.
  # The benchmarks take minutes: pack every 20 s, so that finished tables survive a time limit.
  (while sleep 20; do pack; done) &
  packer=$!
  QKVFUSE_BUILD_DIR=$build QKVFUSE_BENCH_DIR=$LOG QKVFUSE_COMMIT=$commit scripts/bench_report.sh \
    2>&1 | tee -a "$summary"
  rc=${PIPESTATUS[0]}
  kill "$packer" 2>/dev/null
  note "bench_report: rc=$rc"
  cp docs/benchmarks.md docs/benchmarks.png "$OUT"/ 2>/dev/null
  for f in "$LOG"/*_qkvfuse_bench_kernels.txt "$LOG"/*_qkvfuse_bench_fp8.txt "$LOG"/*_bench_torch.txt; do
    [ -f "$f" ] && { echo "== $(basename "$f")"; tail -40 "$f"; }
  done
fi

if has hfstep; then
  # bench/bench_hf_step.py: the whole training step of a transformers Qwen3 model, unpatched and
  # with Liger-Kernel, torch.compile and torchao float8, each with and without qkvfuse, on the build
  # stage's op library (this call's or an earlier call's on the same machine), with the carried
  # wheels (.whl/: Liger-Kernel, torchao) installed into /tmp/qkvfuse-site.
  # QKVFUSE_HFSTEP_SHAPES and QKVFUSE_HFSTEP_VARIANTS choose (default: both shapes, every variant),
  # QKVFUSE_HFSTEP_ARGS adds arguments (--steps 15; --profile VARIANT: that variant alone,
  # profiled, no markdown). The CSV goes to bench/results/ and $OUT, its sections to
  # docs/benchmarks.md, which comes back in $OUT.
  start=$SECONDS
  library=$PWD/$build/bindings/torch/libqkvfuse_torch.so
  site=/tmp/qkvfuse-site
  shapes=${QKVFUSE_HFSTEP_SHAPES:-qwen3-0.6b,qwen3-8b}
  prefix=$(date -u +%F)_${commit//[^A-Za-z0-9._-]/-}_$(device_slug)
  csv=bench/results/${prefix}_hf_step_${shapes//,/_}.csv
  # A profiled run's one row must not take the name of the full run's rows.
  [[ " ${QKVFUSE_HFSTEP_ARGS:-} " == *" --profile "* ]] && csv=${csv%.csv}_profile.csv
  if [ ! -f "$library" ]; then
    note "hfstep: $library is missing: run the build stage first"
  else
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target $site .whl/*.whl >"$LOG/hfstep_pip.log" 2>&1
    note "hfstep wheels: rc=$? $(cd .whl 2>/dev/null && echo *.whl)"
    # Variants finish one by one, minutes in all: pack every 20 s, so that the rows printed so far
    # (and the CSV, rewritten after each variant) survive the call's time limit.
    (while sleep 20; do cp "$csv" "$LOG"/ 2>/dev/null; pack; done) &
    packer=$!
    # shellcheck disable=SC2086  # QKVFUSE_HFSTEP_ARGS is a list of arguments
    QKVFUSE_TORCH_LIBRARY=$library PYTHONPATH=$PWD/python:$site${PYTHONPATH:+:$PYTHONPATH} \
      PYTHONUNBUFFERED=1 python3 bench/bench_hf_step.py --shapes "$shapes" \
      ${QKVFUSE_HFSTEP_VARIANTS:+--variants "$QKVFUSE_HFSTEP_VARIANTS"} --commit "$commit" \
      --out "$csv" --markdown docs/benchmarks.md ${QKVFUSE_HFSTEP_ARGS:-} >"$LOG/hf_step.txt" 2>&1
    rc=$?
    kill "$packer" 2>/dev/null
    cp "$csv" "$LOG"/ 2>/dev/null
    cp "$csv" docs/benchmarks.md "$OUT"/ 2>/dev/null
    note "bench_hf_step: rc=$rc in $((SECONDS - start)) s, rows: $csv"
    grep -E "^\[|^check|^target|^failed|^total wall|^== profile|^-- attention input|^bound" \
      "$LOG/hf_step.txt" | tee -a "$summary"
    pack
  fi
fi

if has ncu; then
  # Nsight Compute on one launch of each memory-bound kernel at the model shape (H=6, D=128,
  # plain: the first shape the benchmarks run). --clock-control none: the clocks the benchmarks see.
  # -k matches the function name without template arguments.
  start=$SECONDS
  sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --section WarpStateStats --section LaunchStats --section SchedulerStats --section SourceCounters"
  profile() {  # profile KERNEL BENCHMARK
    timeout 120 ncu --clock-control none -k "regex:$1" --launch-skip 5 --launch-count 1 $sections \
      "$build/bench/$2" --iters 50 >"$LOG/ncu_$1.txt" 2>&1
    note "ncu $1: rc=$? $(grep -E '^ +Duration' "$LOG/ncu_$1.txt" | head -1 | tr -s ' ')"
  }
  for kernel in qkv_backward_fp8_kernel qk_norm_rope_kernel qk_norm_rope_backward_kernel; do
    profile $kernel qkvfuse_bench_kernels
  done
  # x's quantize tile kernel (the first the FP8 benchmark runs) and the weight bank's amax kernel.
  for kernel in quantize_tile_kernel bank_scale_kernel; do
    profile $kernel qkvfuse_bench_fp8
  done
  note "ncu: $((SECONDS - start)) s"
fi

# run_example NAME SCRIPT TIMEOUT LAUNCHER... -- ARGS...: examples/SCRIPT under LAUNCHER (python3
# for one GPU, torchrun for several), time-boxed; its output stays in $LOG/NAME{.log,/}.
run_example() {
  local name=$1 script=$2 limit=$3 start=$SECONDS launcher=()
  shift 3
  while [ "$1" != "--" ]; do launcher+=("$1"); shift; done
  shift
  # shellcheck disable=SC2068  # the launcher and arguments are word lists
  timeout "${QKVFUSE_TRAIN_TIMEOUT:-$limit}" ${launcher[@]} "examples/$script" \
    --steps "${QKVFUSE_TRAIN_STEPS:-2000}" $@ --out "$LOG/$name" >"$LOG/$name.log" 2>&1
  note "$name: rc=$? in $((SECONDS - start)) s"
  grep -E "final validation|ratio|checksum|per rank|quantized" "$LOG/$name.log" | tee -a "$summary"
}
# train NAME LAUNCHER... -- ARGS...: examples/train_gpt.py; its loss CSV and plot come back as
# NAME_loss.{csv,png}.
train() {
  local name=$1
  shift
  run_example "$name" train_gpt.py 300 "$@"
  cp "$LOG/$name/loss.csv" "$OUT/${name}_loss.csv" 2>/dev/null
  cp "$LOG/$name/loss.png" "$OUT/${name}_loss.png" 2>/dev/null
}
# plot NAME TITLE RUN=LABEL...: one plot of these runs' curves ($OUT/NAME.png) and each run's
# final validation loss against the first run's (train_gpt.py --plot-from).
plot() {
  local name=$1 title=$2
  shift 2
  python3 examples/train_gpt.py --plot-from "$@" --out "$LOG/$name" --title "$title" \
    2>&1 | tee -a "$summary"
  cp "$LOG/$name/loss.png" "$OUT/$name.png" 2>/dev/null
}
# The examples load the op library of the build stage from the build tree, as the python stage.
if has train || has train2 || has train2hf || has train1hf; then use_build_tree_python; fi

# One GPU, both variants (qkvfuse FP8 and the bf16 chain), QKVFUSE_TRAIN_ARGS passed through.
has train && train train python3 -- ${QKVFUSE_TRAIN_ARGS:-}

# Several GPUs (issue 34), every GPU of the machine, NCCL (NVLink multicast off: the variables
# at the top). Two calls of about 6 minutes on two H100s: `build train2`, then `train2hf`
# (docs/training/README.md); `train1hf` (one GPU, about 5 minutes) is the same-card baseline.
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
torchrun_all=(torchrun --standalone --nproc-per-node "$gpus")
# The GPT of docs/training/README.md, FP8 variant, a global batch of 16 x 1024 tokens.
gpt_args="--seq-len 1024 --dim 768 --heads 6 --v-dim 128 --variants qkvfuse-fp8"
# The Qwen3 95M of docs/training/hf_qwen3.md, FP8 variant, a global batch of 32 x 1024 tokens:
# the sequences of docs/training/hf_b32_loss.csv (one H200), step for step.
hf_args="--variants qkvfuse-fp8"
if has train2 && [ "$gpus" -lt 2 ]; then
  note "train2: $gpus GPU(s) on this machine; the stage needs two or more"
elif has train2; then
  start=$SECONDS
  # The CUDA tests that need two devices: the C++ ones (skipped on one GPU; none may skip here)
  # and the FSDP2 composition of apply_qkvfuse over NCCL.
  $build/tests/qkvfuse_tests --gtest_brief=0 \
    --gtest_filter='CudaConcurrency.SecondDeviceMatchesDeviceZero:CudaConcurrency.CurrentDeviceIsRestored:CudaFp8Gemm.SecondDeviceUsesItsOwnContext' \
    >"$LOG/two_device_gtest.log" 2>&1
  note "two-device gtests: rc=$? $(grep -cE '^\[       OK' "$LOG/two_device_gtest.log") OK, $(grep -cE '^\[  SKIPPED' "$LOG/two_device_gtest.log") skipped, $(grep -cE '^\[  FAILED  \] [A-Z]' "$LOG/two_device_gtest.log") failed"
  (cd tests/python && timeout 300 python3 -m pytest -q -ra test_transformers_fsdp.py -k cuda \
    >"$LOG/pytest_fsdp_cuda.log" 2>&1)
  note "pytest test_transformers_fsdp (two GPUs, NCCL): rc=$? $(tail -1 "$LOG/pytest_fsdp_cuda.log")"
  # train_gpt.py, FP8: one GPU, then DDP and FSDP2 on every GPU at the same global batch.
  run_example gpt_1gpu train_gpt.py 240 env CUDA_VISIBLE_DEVICES=0 python3 -- \
    --batch 16 $gpt_args
  for parallel in ddp fsdp; do
    run_example "gpt_${parallel}$gpus" train_gpt.py 240 "${torchrun_all[@]}" -- \
      --batch $((16 / gpus)) --parallel $parallel $gpt_args
  done
  plot gpt_1gpu_vs_${gpus}gpu "train_gpt.py, FP8: one GPU, DDP and FSDP2 on $gpus" \
    "$LOG/gpt_1gpu/loss.csv=1gpu" "$LOG/gpt_ddp$gpus/loss.csv=ddp$gpus" \
    "$LOG/gpt_fsdp$gpus/loss.csv=fsdp$gpus"
  note "train2: $((SECONDS - start)) s"
fi
if has train2hf && [ "$gpus" -lt 2 ]; then
  note "train2hf: $gpus GPU(s) on this machine; the stage needs two or more"
elif has train2hf; then
  # train_hf.py, FP8, DDP and FSDP2 (fully_shard per decoder layer) on every GPU; plotted with
  # the one-GPU run of the same global batch kept in docs/training/.
  for parallel in ddp fsdp; do
    run_example "hf_${parallel}$gpus" train_hf.py 330 "${torchrun_all[@]}" -- \
      --batch $((32 / gpus)) --parallel $parallel $hf_args
  done
  plot hf_1gpu_vs_${gpus}gpu "Qwen3 95M, FP8: one GPU (H200, f0006af), DDP and FSDP2 on $gpus" \
    docs/training/hf_b32_loss.csv=1gpu "$LOG/hf_ddp$gpus/loss.csv=ddp$gpus" \
    "$LOG/hf_fsdp$gpus/loss.csv=fsdp$gpus"
fi
# train_hf.py, FP8, one GPU at the global batch of train2hf: the baseline on this machine's card.
has train1hf && run_example hf_1gpu train_hf.py 480 env CUDA_VISIBLE_DEVICES=0 python3 -- \
  --batch 32 $hf_args

if [ -n "$sanitize_pid" ]; then wait "$sanitize_pid"; fi
pack
echo "== summary"
cat "$summary"
