"""Every file of the repository that a tracked file names must exist.

    python3 scripts/check_refs.py        (scripts/test.sh runs it; no dependencies, under a second)

What counts as naming a file: a word that ends in one of FILE_EXT (`docs/STATUS.md`,
`bench/results/<name>.txt`, `rope_common.cuh`, a markdown link `[x](benchmarks.md)`), or a folder
path that starts with a top-level folder of the repository (`bench/results/`). A path with a slash
must exist relative to the repository root, to the citing file's folder, or to include/ or src/
(how the sources name headers); a bare file name must be the name of some tracked file. Globs and
brace lists (`*_ncu_*.txt`, `<name>.{txt,csv}`) must match at least one file.

Not checked: URLs, absolute paths, `$VARIABLE` paths, #include lines (the compiler checks those),
paths under ../shared/ (the developers' shared folder, outside the repository, documented as
such), a file of another project named after its project and a colon
(`transformers:src/transformers/models/qwen3/modeling_qwen3.py`; any `word:path` is skipped), paths that git ignores (build trees, the carried .seed/ and .gtest/), and the output names
that programs write at run time (in a code file a bare name is checked only when it names a
source or a document; in Python only comments and strings are read). The raw benchmark outputs
under bench/results/ are records and are not scanned. Prints each missing reference as
`file:line: name` and exits 1 if there is one.
"""
import fnmatch
import io
import os
import re
import subprocess
import sys
import tokenize

FILE_EXT = ("md", "cu", "cuh", "cpp", "hpp", "h", "py", "sh", "txt", "csv", "png", "patch",
            "toml", "log")
# In code files (scripts, sources) a bare name is checked only for these: sources and documents.
CODE_NAME_EXT = ("md", "cu", "cuh", "cpp", "hpp", "py", "sh", "patch")
NOT_SCANNED = ("bench/results/",)
BINARY_EXT = (".png", ".csv", ".log", ".patch")
WORD = re.compile(r"[\w./{},*+-]+")
SKIP_LINE = re.compile(r"^\s*#\s*include\b")


def python_text(source):
    """(line number, text) of the comments and strings of a Python file: its prose."""
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type in (tokenize.COMMENT, tokenize.STRING):
                for i, text in enumerate(tok.string.splitlines()):
                    out.append((tok.start[0] + i, text))
    except (tokenize.TokenError, SyntaxError):
        return list(enumerate(source.splitlines(), 1))
    return out


def expand_braces(word):
    m = re.search(r"\{([^{}]*)\}", word)
    if not m:
        return [word]
    out = []
    for alt in m.group(1).split(","):
        out += expand_braces(word[:m.start()] + alt + word[m.end():])
    return out


def main():
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                          text=True, check=True).stdout.strip()
    os.chdir(root)
    files = [f for f in subprocess.run(["git", "ls-files", "-z"], capture_output=True,
                                       text=True, check=True).stdout.split("\0")
             if f and os.path.exists(f)]
    # A tracked file deleted in the working tree is gone; an untracked new file counts (so that a
    # change can be checked before it is committed).
    files += [f for f in subprocess.run(["git", "ls-files", "-z", "--others", "--exclude-standard"],
                                        capture_output=True, text=True,
                                        check=True).stdout.split("\0") if f]
    known = set(files)
    for f in files:
        d = os.path.dirname(f)
        while d:
            known.add(d)
            d = os.path.dirname(d)
    basenames = {os.path.basename(f) for f in files}
    top = {f.split("/")[0] for f in files if "/" in f}
    ext_re = re.compile(r"\.(%s)$" % "|".join(FILE_EXT))
    code_ext_re = re.compile(r"\.(%s)$" % "|".join(CODE_NAME_EXT))

    def exists(path, citing_dir):
        path = path.rstrip("/")
        bases = ["", citing_dir, "include", "src"]
        candidates = [os.path.normpath(os.path.join(b, path)) for b in bases]
        if any(ch in path for ch in "*?["):
            return any(fnmatch.filter(known, c) for c in candidates)
        return any(c in known for c in candidates)

    missing = []
    for f in files:
        if f.startswith(NOT_SCANNED) or f.endswith(BINARY_EXT):
            continue
        try:
            with open(f, encoding="utf-8") as fh:
                source = fh.read()
        except (UnicodeDecodeError, IsADirectoryError):
            continue
        lines = python_text(source) if f.endswith(".py") else enumerate(source.splitlines(), 1)
        is_doc = f.endswith(".md")
        citing_dir = os.path.dirname(f)
        for lineno, line in lines:
            if SKIP_LINE.match(line):
                continue
            for m in WORD.finditer(line):
                word = m.group(0).rstrip(".,")
                before = line[:m.start()]
                if (not word or word.startswith("{")
                        or (word.startswith(".") and "/" not in word)
                        or before.endswith(("$", "/", "://", ":", "~", "<", "-"))
                        or word.startswith(("/", "../shared/", "..")) or "://" in word):
                    continue
                for path in expand_braces(word):
                    head = path.split("/")[0]
                    if "/" in path:
                        if head.isupper():  # a placeholder folder: OUT/loss.csv
                            continue
                        if not (ext_re.search(path) or (head in top and path.endswith("/"))):
                            continue
                        if not exists(path, citing_dir):
                            missing.append((f, lineno, path))
                    elif (ext_re if is_doc else code_ext_re).search(path):
                        if any(ch in path for ch in "*?["):
                            ok = bool(fnmatch.filter(basenames, path))
                        else:
                            ok = path in basenames
                        if not ok:
                            missing.append((f, lineno, path))
    # What git ignores is built or carried at run time, not cited from the repository.
    ignored = set(subprocess.run(["git", "check-ignore", "--no-index", "--stdin"],
                                 input="\n".join(p for _, _, p in missing), capture_output=True,
                                 text=True).stdout.split())
    missing = [f"{f}:{n}: {p}" for f, n, p in missing if p not in ignored]
    for line in missing:
        print(line)
    if missing:
        print(f"check_refs: {len(missing)} reference(s) to files that do not exist", file=sys.stderr)
        return 1
    print(f"check_refs: ok, every file named in {len(files)} files exists")
    return 0


if __name__ == "__main__":
    sys.exit(main())
