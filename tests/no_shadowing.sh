#!/usr/bin/env bash
# No folder or file of the repository may answer for a package the project imports.
#
# `python3 -c 'import torch'` run from the repository root puts the root first on sys.path: a
# top-level `torch/` folder (where the PyTorch binding once lived) is then imported as a namespace
# package, so on a machine without PyTorch the import succeeds, scripts/test.sh skips installing
# it, and the wheel build fails later with "module 'torch' has no attribute 'utils'".
#
# For every package the project's Python files import (outside the standard library), plus
# numpy and transformers, this runs `import <name>` from the root in a Python with nothing
# installed (-S: no site-packages; -E: no PYTHONPATH), where it must fail with an ImportError.
# Needs no PyTorch; scripts/test.sh runs it before the build.
set -euo pipefail
cd "$(dirname "$0")/.."

names=$(python3 -S -E - <<'PY'
import ast, pathlib, subprocess, sys
try:
    files = subprocess.run(["git", "ls-files", "*.py"], capture_output=True, text=True,
                           check=True).stdout.split()
except (OSError, subprocess.CalledProcessError):
    files = [str(p) for p in pathlib.Path(".").rglob("*.py") if not p.parts[0].startswith("build")]
names = {"torch", "numpy", "transformers"}
for f in files:
    for node in ast.walk(ast.parse(pathlib.Path(f).read_text(), f)):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
print(" ".join(sorted(names - set(sys.stdlib_module_names))))
PY
)

failed=0
for name in $names; do
  if err=$(python3 -S -E -c "import $name" 2>&1); then
    echo "no_shadowing: FAIL: \`import $name\` succeeds from the repository root in a Python without" \
         "it installed: a folder or file named $name shadows it; rename it" >&2
    failed=1
  elif ! grep -q "ImportError\|ModuleNotFoundError" <<<"$err"; then
    echo "no_shadowing: FAIL: \`import $name\` from the repository root failed otherwise than with an" \
         "ImportError:" >&2
    echo "$err" >&2
    failed=1
  fi
done
[ $failed = 0 ] && echo "no_shadowing: ok, none of $(wc -w <<<"$names") imported packages is shadowed ($names)"
exit $failed
