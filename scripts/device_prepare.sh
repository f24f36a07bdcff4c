#!/usr/bin/env bash
# Puts next to the tree what the GPU machine (no network) needs, in git-ignored folders that a
# device call carries, and prints that carry list:
#   .gtest/                     GoogleTest sources (Debian's googletest package; device_run.sh build)
#   .seed/reference_triton.py   the reference implementation, for side-by-side runs
#                               (QKVFUSE_SEED_DIR, default ../shared/seed: its one file)
#   .seed/axolotl-kernel/       axolotl's fused RMSNorm + RoPE Triton kernel, for
#                               bench_general.py's axolotl rows (AXOLOTL below)
#   .whl/                       the wheels of the Python packages the GPU machine lacks (WHEELS
#                               below), for its Python 3.12 on x86-64 Linux; device_run.sh's
#                               hfstep stage installs them
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
# "name==version sha256": pinned, downloaded with --no-deps and checked against the hash. The GPU
# machine has their dependencies (torch 2.11, triton; transformers and peft too).
#   liger-kernel   bench_torch.py's side-by-side rows; bench_hf_step.py's Liger rows
#   torchao        bench_hf_step.py's float8 row; 0.17.0 is the release torchao's compatibility
#                  table pairs with torch 2.11, the machine's
# TRL is not carried: its dependencies (datasets, pyarrow's 55 MB wheel, pandas 12 MB) do not fit
# the carry's 64 MiB beside the rest; its SFTTrainer test runs in CI on the CPU.
WHEELS=(
  "liger-kernel==0.8.5 60789cd576af073ab9b192b570d2597fd0cdad489cd62fb44fb16256d43754c9"
  "torchao==0.17.0 87a418ce0ec064a821ceab83c921b501acef0ce9a6ccd1be358fcd16c3ae8c58"
)
# download PIN SHA256 DIR: the wheel of PIN into DIR, checked against SHA256.
download() {
  local requirement
  requirement=$(mktemp)
  echo "$1 --hash=sha256:$2" >"$requirement"
  python3 -m pip download -q --no-deps --only-binary=:all: --require-hashes \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -r "$requirement" -d "$3" >&2
  rm -f "$requirement"
}
mkdir -p .whl
for entry in "${WHEELS[@]}"; do
  read -r pin sha256 <<<"$entry"
  name=${pin%%==*} version=${pin#*==}
  file=${name//-/_}
  # One version of each package: pip refuses to install two at once.
  find .whl -maxdepth 1 -name "$file-*.whl" ! -name "$file-$version-*" -delete
  wheel=$(compgen -G ".whl/$file-$version-*.whl" | head -1 || true)
  if [ -n "$wheel" ] && ! echo "$sha256  $wheel" | sha256sum -c --status; then
    echo "$wheel does not match its pinned sha256: downloading it again" >&2
    rm -f "$wheel"
    wheel=
  fi
  [ -n "$wheel" ] || download "$pin" "$sha256" .whl
done
# axolotl's kernel alone, not its wheel (1.6 MB, and hfstep installs every wheel in .whl/): the
# one file, which imports torch, triton and liger_kernel (carried above) and no other axolotl
# module, with the wheel's LICENSE (Apache-2.0) and a SOURCE line naming where it came from
# (bench_general.py records it). Extracted again when the pin changes.
AXOLOTL="axolotl==0.19.0 f28eb3ad3709975eec4adfe13307dd980c7e7917cc43cb03f2c6f26c007135cc"
read -r pin sha256 <<<"$AXOLOTL"
name=${pin%%==*} version=${pin#*==}
AXOLOTL_FILES=("$name/kernels/gemma4_fused_rope.py" "$name-$version.dist-info/licenses/LICENSE")
source_line="$pin sha256:$sha256 ${AXOLOTL_FILES[0]}"
if [ "$(cat .seed/axolotl-kernel/SOURCE 2>/dev/null)" != "$source_line" ]; then
  rm -rf .seed/axolotl-kernel
  tmp=$(mktemp -d)
  download "$pin" "$sha256" "$tmp"
  mkdir -p .seed/axolotl-kernel
  python3 - "$tmp"/*.whl .seed/axolotl-kernel "${AXOLOTL_FILES[@]}" <<'EOF'
import sys, zipfile
from pathlib import Path
wheel, folder, *members = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    for member in members:
        (Path(folder) / Path(member).name).write_bytes(z.read(member))
EOF
  rm -rf "$tmp"
  echo "$source_line" >.seed/axolotl-kernel/SOURCE
fi
echo "wheels: $(du -ch .whl/*.whl | tail -1 | cut -f1) in .whl:" $(cd .whl && echo *.whl) >&2
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
du -shc "${carry[@]}" >&2
printf '%s\n' "${carry[@]}"
