#!/usr/bin/env python3
"""The installed transformers' fingerprints of the pieces apply_qkvfuse checks
(python/qkvfuse/integrations/transformers_sources.py): which are new, and, with --write, adds them
to KNOWN there, under the installed version. Run it only for a version the Hugging Face tests
pass on (tests/python/test_transformers_*.py) and whose changed pieces you have read.

    python scripts/transformers_sources.py            # lists the pieces and what is new
    python scripts/transformers_sources.py --write    # records them as tested

Needs qkvfuse importable (installed, or PYTHONPATH=python with QKVFUSE_TORCH_LIBRARY) and the
transformers version to record.
"""
import argparse
import pathlib
import sys

import transformers
from packaging.version import Version

from qkvfuse.integrations import transformers as integration
from qkvfuse.integrations import transformers_sources as sources

BEGIN = "# ---- KNOWN: written by scripts/transformers_sources.py --write"
END = "# ---- end of KNOWN"
WIDTH = 100


def merged(version):
    """KNOWN with the installed version's fingerprints added; the new (module, piece) pairs."""
    known = {m: {p: dict(d) for p, d in ps.items()} for m, ps in sources.KNOWN.items()}
    new = []
    for family in integration._FAMILIES:
        names = sources.pieces(family)
        for name, digest in sources.fingerprints(family.module, names).items():
            if digest is None:
                sys.exit(f"{family.module} defines no {name}: update the family's row first")
            digests = known.setdefault(family.module, {}).setdefault(name, {})
            versions = set(filter(None, digests.get(digest, "").split(", "))) | {version}
            if digest not in digests:
                new.append((family.module, name, digest))
            digests[digest] = ", ".join(sorted(versions, key=Version))
    return known, new


def literal(known):
    """KNOWN as Python source, one line per piece where it fits in WIDTH columns."""
    lines = ["KNOWN = {"]
    for module in sorted(known):
        lines.append(f'    "{module}": {{')
        for name in sorted(known[module]):
            entries = [f'"{d}": "{v}"' for d, v in known[module][name].items()]
            one = f'        "{name}": {{{", ".join(entries)}}},'
            if len(one) <= WIDTH:
                lines.append(one)
            else:
                lines.append(f'        "{name}": {{')
                lines += [f"            {e}," for e in entries]
                lines.append("        },")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="add them to KNOWN")
    args = parser.parse_args()
    version = transformers.__version__
    known, new = merged(version)
    print(f"transformers {version} at {pathlib.Path(transformers.__file__).parent}")
    for module, name, digest in new:
        print(f"  new: {module} {name} {digest}")
    if not new:
        print("  every piece is in KNOWN already")
    if args.write:
        path = pathlib.Path(sources.__file__)
        text = path.read_text()
        head, rest = text.split(BEGIN, 1)
        first, rest = rest.split("\n", 1)
        _, tail = rest.split(END, 1)
        path.write_text(f"{head}{BEGIN}{first}\n{literal(known)}\n{END}{tail}")
        print(f"wrote {path} (transformers {version} recorded)")


if __name__ == "__main__":
    main()
