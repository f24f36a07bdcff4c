#!/usr/bin/env bash
# Puts next to the tree what the GPU machine (no network) needs, in git-ignored folders that a
# device call carries, and prints that carry list:
#   .gtest/                     GoogleTest sources (Debian's googletest package; device_run.sh build)
#   .seed/reference_triton.py   the reference implementation, for side-by-side runs
#                               (QKVFUSE_SEED_DIR, default ../shared/seed: its one file)
#   .whl/                       the Liger-Kernel wheel (bench_torch.py's side-by-side rows)
#   .device/COMMIT              this tree's commit (git describe: -dirty when it has changes), the
#                               one device_run.sh records (the device's copy of .git may be stale)
#   .device/old-src-N/          per COMMIT argument: that commit's tree, an old side of
#                               device_run.sh's ab stage (built there beside the new tree)
#
#   scripts/device_prepare.sh [COMMIT ...]
set -euo pipefail
source "$(dirname "$0")/common.sh"

need_build_tools gtest
rm -rf .gtest && cp -r /usr/src/googletest .gtest
seed_dir=${QKVFUSE_SEED_DIR:-../shared/seed}
seed_files=("$seed_dir"/*)
if [ ${#seed_files[@]} -ne 1 ] || [ ! -f "${seed_files[0]}" ]; then
  echo "expected one file (the reference) in $seed_dir, found ${#seed_files[@]}" >&2
  exit 1
fi
mkdir -p .seed && cp "${seed_files[0]}" .seed/reference_triton.py
mkdir -p .whl
ls .whl/liger_kernel-*.whl >/dev/null 2>&1 ||
  python3 -m pip download -q --no-deps --only-binary=:all: liger-kernel -d .whl
carry=(.gtest .seed .whl .device)
rm -rf .device/old-src*
mkdir -p .device
git describe --always --dirty --abbrev=7 >.device/COMMIT
for i in $(seq 1 $#); do
  commit=$(git rev-parse --short "${!i}^{commit}")
  mkdir -p ".device/old-src-$i"
  git archive "$commit" | tar -x -C ".device/old-src-$i"
  echo "$commit" >".device/old-src-$i/COMMIT"
done
du -sh "${carry[@]}" >&2
printf '%s\n' "${carry[@]}"
