#!/usr/bin/env bash
# Counts the kernel entries (PTX .entry) of the library's CUDA objects, per object and in all,
# leaving out the CUTLASS GEMMs (cutlass_*, fused_qkv_gemm_*: their own budget); with --sass also
# each rope kernel's registers, SASS instructions and local-memory stores (STL: spills).
#
#   scripts/count_kernels.sh [--sass] [--max N] [BUILD_DIR]   (default build-device)
#
# --max N exits 1 when the total exceeds N (the kernel family's budget: docs/STATUS.md).
# cuobjdump comes from $CUOBJDUMP, PATH, /usr/local/cuda/bin, or the copy Triton's wheel carries
# (the CI machine's CUDA toolkit has nvcc but no cuobjdump; PyTorch brings Triton).
set -uo pipefail
sass=0 max=
while [ $# -gt 0 ]; do
  case $1 in
    --sass) sass=1; shift ;;
    --max) max=$2; shift 2 ;;
    *) break ;;
  esac
done
build=${1:-build-device}
cuobjdump=${CUOBJDUMP:-$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)}
if [ ! -x "$cuobjdump" ] && [ -z "${CUOBJDUMP:-}" ]; then
  cuobjdump=$(python3 -c 'import pathlib, triton
print(pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump")' 2>/dev/null)
fi
if [ ! -x "$cuobjdump" ]; then
  echo "count_kernels: no cuobjdump (set CUOBJDUMP)" >&2
  exit 2
fi
objects=$(find "$build/CMakeFiles/qkvfuse.dir/src/cuda" -name '*.cu.o' 2>/dev/null | sort |
          grep -vE '/(cutlass_|fused_qkv_gemm)')
if [ -z "$objects" ]; then
  echo "count_kernels: no CUDA objects under $build/CMakeFiles/qkvfuse.dir/src/cuda" >&2
  exit 2
fi
total=0
for object in $objects; do
  n=$("$cuobjdump" -ptx "$object" | grep -c '\.entry ')
  total=$((total + n))
  printf '%-32s %4d\n' "$(basename "$object")" "$n"
done
printf '%-32s %4d\n' "total (CUTLASS GEMMs left out)" "$total"

if [ $sass = 1 ]; then
  # One line per kernel: registers, SASS instructions, STL count, and the demangled template
  # arguments (configuration, geometry, angle type, exact width).
  for object in $objects; do
    case $object in *qk_norm_rope*|*qkv_backward_fp8*) ;; *) continue ;; esac
    echo "== $(basename "$object")"
    "$cuobjdump" -res-usage "$object" 2>/dev/null |
      awk '/Function /{name=$2; sub(":$","",name)} /REG:/{split($1,r,":"); print name, r[2]}' \
      >/tmp/count_kernels_regs.$$
    "$cuobjdump" -sass "$object" |
      awk '/Function : /{if (name) print name, n, stl; name=$3; n=0; stl=0; next}
           /\/\*[0-9a-f]+\*\//{n++; if ($0 ~ / STL[. ]/) stl++}
           END{if (name) print name, n, stl}' |
      while read -r name n stl; do
        regs=$(awk -v k="$name" '$1 == k {print $2}' /tmp/count_kernels_regs.$$)
        args=$(echo "$name" | c++filt | sed -E 's/^[^<]*<//; s/>\(.*$//; s/qkvfuse::cuda::rope:://g')
        printf '  %4s regs %6s instr %3s STL  %s\n' "$regs" "$n" "$stl" "$args"
      done
    rm -f /tmp/count_kernels_regs.$$
  done
fi
if [ -n "$max" ] && [ "$total" -gt "$max" ]; then
  echo "count_kernels: $total kernel entries, above the budget of $max" >&2
  exit 1
fi
