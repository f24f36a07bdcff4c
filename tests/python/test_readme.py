"""README.md's Python blocks run as written: each ```python block is one test, run in a fresh
namespace, so that the README and the code cannot drift apart. A block runs on the GPU when there
is one and on the CPU otherwise; a block that needs more says so in an HTML comment on the line
before its fence, which the rendered README hides:
    <!-- readme-test: needs cuda -->           skipped without a CUDA device
    <!-- readme-test: needs transformers -->   skipped where that package is not installed
"""
import importlib.util
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = re.compile(r"<!-- readme-test: needs ([\w, ]+) -->")


def python_blocks():
    """(first line number, needs, code) of each ```python block."""
    lines = README.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            marker = MARKER.fullmatch(lines[i - 1].strip()) if i else None
            needs = [n.strip() for n in marker.group(1).split(",")] if marker else []
            end = lines.index("```", i + 1)
            blocks.append((i + 2, needs, "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        i += 1
    return blocks


BLOCKS = python_blocks()


def test_readme_has_its_examples():
    assert len(BLOCKS) >= 4, "README.md lost its Python examples"


@pytest.mark.parametrize("line, needs, code", BLOCKS, ids=[f"line{b[0]}" for b in BLOCKS])
def test_block_runs(line, needs, code):
    for need in needs:
        if need == "cuda":
            if not torch.cuda.is_available():
                pytest.skip(f"README.md:{line} needs a CUDA device")
        elif importlib.util.find_spec(need) is None:
            pytest.skip(f"README.md:{line} needs the {need} package")
    exec(compile("\n" * (line - 1) + code, str(README), "exec"), {"__name__": "readme"})
