# scripts/common.sh: the set-up the scripts share (test.sh, demo.sh, device_run.sh,
# bench_report.sh). Sourced, not run; it leaves the working directory at the repository root.
#
#   need_build_tools [gtest]   installs cmake, ninja, g++ (and GoogleTest) with apt where missing
#   python_outside ARGS...     python3 ARGS run from an empty directory outside the source tree
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
