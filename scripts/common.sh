# scripts/common.sh: the set-up the scripts share (test.sh, demo.sh, device_run.sh,
# bench_report.sh). Sourced, not run; it leaves the working directory at the repository root.
#
#   need_build_tools [gtest]   installs cmake, ninja, g++ (and GoogleTest) with apt where missing
#   python_outside ARGS...     python3 ARGS run from an empty directory outside the source tree
#   start_old_builds DIR TARGET [CMAKE_ARG...]
#                              the A/B's old sides, built in the background (device scripts)
#   device_slug                the GPU's name for result file names ("NVIDIA H200" -> h200;
#                              QKVFUSE_DEVICE_SLUG overrides)
#
# nvcc usually lives outside PATH in a fresh shell: /usr/local/cuda/bin joins PATH when it has one.
cd "$(dirname "${BASH_SOURCE[0]}")/.."

need_build_tools() {
  local need=()
  command -v cmake >/dev/null || need+=(cmake)
  command -v ninja >/dev/null || need+=(ninja-build)
  command -v g++ >/dev/null || need+=(g++)
  if [ "${1:-}" = gtest ] && [ ! -e /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ] &&
     [ ! -e /usr/lib/cmake/GTest/GTestConfig.cmake ]; then
    need+=(libgtest-dev)
  fi
  if [ ${#need[@]} -gt 0 ]; then
    echo "== installing ${need[*]}"
    apt-get update -qq && apt-get install -y -qq "${need[@]}"
  fi
}

if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

# `python3 -c 'import torch'` run from the repository root puts the root first on sys.path, so a
# folder there named like a package would answer for it (a namespace package, importable where
# the package is not installed). Checks for installed Python packages run from an empty directory.
python_outside() {
  local dir rc
  dir=$(mktemp -d)
  rc=0
  (cd "$dir" && python3 "$@") || rc=$?
  rmdir "$dir"
  return $rc
}

# An A/B's old sides (device_run.sh): each .device/old-src*/ holds another commit's tree
# (scripts/device_prepare.sh COMMIT ...). Configures each in DIR-<commit> (Release, sm_90a, no tests
# or examples, plus CMAKE_ARGs) and builds TARGET there in the background, logging to
# $LOG/build_old_<commit>.log. Sets old_sides (the commits), old_builders (the background
# builds' pids) and old_bins (each side's DIR-<commit>/bench/TARGET).
start_old_builds() {
  local dir=$1 target=$2 src name
  shift 2
  old_sides=() old_builders=() old_bins=()
  for src in .device/old-src*/; do
    [ -f "$src/CMakeLists.txt" ] || continue
    name=$(cat "$src/COMMIT")
    (cmake -S "$src" -B "$dir-$name" -G Ninja -DCMAKE_BUILD_TYPE=Release \
       -DCMAKE_CUDA_ARCHITECTURES=90a -DQKVFUSE_BUILD_TESTS=OFF -DQKVFUSE_BUILD_EXAMPLES=OFF "$@" &&
       ninja -C "$dir-$name" "$target") >"$LOG/build_old_$name.log" 2>&1 &
    old_builders+=($!)
    old_sides+=("$name")
    old_bins+=("$dir-$name/bench/$target")
  done
}

# The device part of bench/results/ file names: <date>_<commit>_<device>_<benchmark>.
device_slug() {
  local gpu
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  echo "${QKVFUSE_DEVICE_SLUG:-$(echo "${gpu:-gpu}" | tr '[:upper:]' '[:lower:]' |
    sed -E 's/^nvidia //; s/[^a-z0-9]+/-/g; s/^-+|-+$//g')}"
}
