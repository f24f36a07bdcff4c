"""The transformers code apply_qkvfuse was checked against, and the check of the installed code.

The patched forward restates each supported attention class's forward with q, k and v from qkvfuse:
it reads the class's attributes (scaling, sliding window, KV sharing), its q/k norms' settings
and the model's cos/sin, and it rotates as the family's apply_rotary_pos_emb does. Should a
transformers release change one of these (a new attention option read in the class, another norm
formula, another rotary layout), a patched model would compute something other than the model
it patches, silently. So apply_qkvfuse compares, for each family it patches, the code of its
pieces in the installed transformers with the code of the versions the tests passed on, and
refuses the model, naming the pieces it does not know (UnsupportedModelError).

The pieces of a family (pieces()): its attention class (__init__ and forward: which config options
it reads and what its forward computes), its q/k norm class, and its modeling module's
apply_rotary_pos_emb and rotate_half (the NeoX lanes and the partial rotary that qkvfuse's rotation
matches, and the layout of cos and sin they consume, cat(freqs, freqs), of which the patched
forward reads the first half). The rotary embedding is not a piece: the patched forward takes
its cos and sin as it computes them (every rope type and scaling), and their layout is the one
those two functions read. A piece's fingerprint is a digest of its syntax tree, read from the
modeling module's source file (so a patch applied at run time, e.g. Liger-Kernel's, does not
change it): comments, docstrings and formatting are not part of it, and neither are fields left
empty (None or []), which Python versions add to the tree (3.12's FunctionDef.type_params), so
that the fingerprints do not depend on the Python version (recorded with 3.11).

KNOWN holds the fingerprints of each piece in the transformers versions the tests pass on
(scripts/test.sh runs them on each). A version whose pieces are each identical to those of a
tested one passes the check. Adding a version: run tests/python's Hugging Face tests under it,
review what changed in its modeling files, then `python scripts/transformers_sources.py --write`.
QKVFUSE_ALLOW_UNCHECKED_TRANSFORMERS=1 turns the refusal into a warning that names the same
pieces, for trying a release before it is checked.
"""
import ast
import functools
import hashlib
import importlib
import inspect
import os
import warnings

from packaging.version import Version  # a dependency of transformers

ALLOW_ENV = "QKVFUSE_ALLOW_UNCHECKED_TRANSFORMERS"
# The modeling module's functions every family's forward shares the rotary convention of.
ROTARY_FUNCTIONS = ("apply_rotary_pos_emb", "rotate_half")


def pieces(family) -> tuple:
    """The names of the family's pieces in its modeling module (classes and functions; the
    lookup also takes "Class.method")."""
    norm = (family.norm,) if family.norm else ()
    return (family.attention, *norm, *ROTARY_FUNCTIONS)


def _canonical(node) -> str:
    """The syntax tree as text: node types and fields, without positions, without fields that are
    None or empty (present or not depending on the Python version), without docstrings."""
    if isinstance(node, list):
        return "[" + ", ".join(_canonical(item) for item in node) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    fields = []
    for name in node._fields:
        value = getattr(node, name, None)
        if name == "body" and _has_docstring(node):
            value = value[1:]
        if value is None or (isinstance(value, list) and not value):
            continue
        fields.append(f"{name}={_canonical(value)}")
    return f"{type(node).__name__}({', '.join(fields)})"


def _has_docstring(node) -> bool:
    body = node.body if isinstance(node, (ast.ClassDef, ast.FunctionDef,
                                          ast.AsyncFunctionDef)) else None
    return bool(body) and isinstance(body[0], ast.Expr) and isinstance(
        body[0].value, ast.Constant) and isinstance(body[0].value.value, str)


def fingerprint(node) -> str:
    return hashlib.sha256(_canonical(node).encode()).hexdigest()[:16]


def _find(tree: ast.Module, piece: str):
    """The definition of `piece` ("name" or "Class.method") at the top of the module, or None."""
    name, _, method = piece.partition(".")
    node = next((n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))
                 and n.name == name), None)
    if node is not None and method:
        node = next((n for n in node.body if isinstance(n, ast.FunctionDef)
                     and n.name == method), None)
    return node


def source_of(module_name: str) -> str:
    """The text of the modeling module's source file (tests replace this to change a piece)."""
    module = importlib.import_module(module_name)
    path = inspect.getsourcefile(module)
    if path is None or not os.path.exists(path):
        raise OSError(f"no source file for {module_name}")
    with open(path, encoding="utf-8") as f:
        return f.read()


@functools.lru_cache(maxsize=None)
def fingerprints(module_name: str, names: tuple) -> dict:
    """{piece: its fingerprint, or None where the module does not define it}."""
    tree = ast.parse(source_of(module_name))
    return {name: None if (node := _find(tree, name)) is None else fingerprint(node)
            for name in names}


def unknown(family) -> list:
    """The family's pieces whose code in the installed transformers is in no tested version."""
    known = KNOWN.get(family.module, {})
    names = pieces(family)
    found = fingerprints(family.module, names)
    return [name for name in names if found[name] not in known.get(name, {})]


def tested_versions(module=None) -> list:
    """The versions recorded in KNOWN; with a module, those recorded for every one of its pieces
    (a version can be recorded for some families only: 5.24.0 not for Gemma 4)."""
    modules = [KNOWN.get(module, {})] if module else list(KNOWN.values())
    per_piece = [{v for listed in digests.values() for v in listed.split(", ")}
                 for pieces_ in modules for digests in pieces_.values()]
    versions = set.intersection(*per_piece) if module and per_piece else set().union(*per_piece)
    return sorted(versions, key=Version)


def check(family, where: str, error) -> None:
    """Raises `error` (warns, with QKVFUSE_ALLOW_UNCHECKED_TRANSFORMERS=1), naming the family's
    pieces that differ from every tested transformers version's."""
    import transformers

    try:
        differ = unknown(family)
        reason = (f"{'differs' if len(differ) == 1 else 'differ'} from the code of the "
                  f"transformers versions qkvfuse was tested with")
    except (OSError, SyntaxError, TypeError, ValueError) as exception:
        differ = [family.attention]
        reason = f"cannot be compared with the tested code ({exception})"
    if not differ:
        return
    message = (
        f"{where}: transformers {transformers.__version__}'s {', '.join(differ)} "
        f"({family.module}) {reason} ({', '.join(tested_versions(family.module))}): the patched forward "
        f"could compute something other than the model. Use one of those versions, or set "
        f"{ALLOW_ENV}=1 to patch anyway after checking that the change does not matter "
        f"(qkvfuse.integrations.transformers_sources)")
    if os.environ.get(ALLOW_ENV) == "1":
        warnings.warn(message, stacklevel=3)
        return
    raise error(message)


# ---- KNOWN: written by scripts/transformers_sources.py --write -----------------------------------
KNOWN = {
    "transformers.models.gemma3.modeling_gemma3": {
        "Gemma3Attention": {
            "7f237b0703376239": "5.17.0",
            "c94f030b9b243c8d": "5.25.0",
            "0ff9df1d559877a4": "5.24.0",
        },
        "Gemma3RMSNorm": {"a5f91cc31e4a9f9a": "5.17.0, 5.24.0", "b26bb972787c8bea": "5.25.0"},
        "apply_rotary_pos_emb": {"0a7ee152b7792a47": "5.17.0, 5.24.0, 5.25.0"},
        "rotate_half": {"458e8da1c9744213": "5.17.0, 5.24.0, 5.25.0"},
    },
    "transformers.models.gemma4.modeling_gemma4": {
        "Gemma4RMSNorm": {"a01a53a6b6826d09": "5.17.0, 5.24.0", "5f12a11dcc0ce7d8": "5.25.0"},
        "Gemma4TextAttention": {"d41c6c713eab4d2b": "5.17.0", "497c61e6ea606cc6": "5.25.0"},
        "apply_rotary_pos_emb": {"6e120d2f1b46d8be": "5.17.0, 5.24.0, 5.25.0"},
        "rotate_half": {"458e8da1c9744213": "5.17.0, 5.24.0, 5.25.0"},
    },
    "transformers.models.glm4_moe.modeling_glm4_moe": {
        "Glm4MoeAttention": {"82881210c74f92cf": "5.17.0", "6578bf33303e8787": "5.24.0, 5.25.0"},
        "Glm4MoeRMSNorm": {"401e8b8d2815f972": "5.17.0, 5.24.0, 5.25.0"},
        "apply_rotary_pos_emb": {"1791c045dc9ccc29": "5.17.0, 5.24.0, 5.25.0"},
        "rotate_half": {"458e8da1c9744213": "5.17.0, 5.24.0, 5.25.0"},
    },
    "transformers.models.llama.modeling_llama": {
        "LlamaAttention": {"ca0bd26bee8215dc": "5.17.0", "c4d83064659fc967": "5.24.0, 5.25.0"},
        "apply_rotary_pos_emb": {"0a7ee152b7792a47": "5.17.0, 5.24.0, 5.25.0"},
        "rotate_half": {"458e8da1c9744213": "5.17.0, 5.24.0, 5.25.0"},
    },
    "transformers.models.mistral.modeling_mistral": {
        "MistralAttention": {"951a7825a21963bd": "5.17.0", "9dc9088debfa9cdd": "5.24.0, 5.25.0"},
        "apply_rotary_pos_emb": {"0a7ee152b7792a47": "5.17.0, 5.24.0, 5.25.0"},
        "rotate_half": {"458e8da1c9744213": "5.17.0, 5.24.0, 5.25.0"},
    },
    "transformers.models.olmo2.modeling_olmo2": {
        "Olmo2Attention": {
            "07bb516b23722788": "5.17.0",
            "a458c75561e57a72": "5.25.0",
            "b798ad85e146d5ad": "5.24.0",
        },
        "Olmo2RMSNorm": {"7194868388932f62": "5.17.0, 5.24.0", "de1c09eadf2ce0b7": "5.25.0"},
        "apply_rotary_pos_emb": {
            "4eaa4a5620bf57df": "5.17.0, 5.24.0",
            "6e337e17be64229f": "5.25.0",
        },
        "rotate_half": {"458e8da1c9744213": "5.17.0, 5.24.0, 5.25.0"},
    },
    "transformers.models.olmo3.modeling_olmo3": {
        "Olmo3Attention": {
            "c1ff1f3fb64494de": "5.17.0",
            "51ed00ec36767d2f": "5.25.0",
            "25b6ab079161c867": "5.24.0",
        },
        "Olmo3RMSNorm": {"30129f7f01480e7c": "5.17.0, 5.24.0", "530c305928fd2bb8": "5.25.0"},
        "apply_rotary_pos_emb": {
            "4eaa4a5620bf57df": "5.17.0, 5.24.0",
            "6e337e17be64229f": "5.25.0",
        },
        "rotate_half": {"458e8da1c9744213": "5.17.0, 5.24.0, 5.25.0"},
    },
    "transformers.models.qwen3.modeling_qwen3": {
        "Qwen3Attention": {"bfa6497d6520e3e9": "5.17.0", "679c38ca1880240c": "5.24.0, 5.25.0"},
        "Qwen3RMSNorm": {"e5cec41077a19349": "5.17.0, 5.24.0, 5.25.0"},
        "apply_rotary_pos_emb": {"0a7ee152b7792a47": "5.17.0, 5.24.0, 5.25.0"},
        "rotate_half": {"458e8da1c9744213": "5.17.0, 5.24.0, 5.25.0"},
    },
    "transformers.models.qwen3_5.modeling_qwen3_5": {
        "Qwen3_5Attention": {"dcc436fe79b2cc93": "5.17.0", "17ce7b3a3fc616ed": "5.24.0, 5.25.0"},
        "Qwen3_5RMSNorm": {"fc58d65a70c3f9a2": "5.17.0, 5.24.0", "7ba373a39010c34d": "5.25.0"},
        "apply_rotary_pos_emb": {"1791c045dc9ccc29": "5.17.0, 5.24.0, 5.25.0"},
        "rotate_half": {"458e8da1c9744213": "5.17.0, 5.24.0, 5.25.0"},
    },
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe": {
        "Qwen3_5MoeAttention": {"bcacb83d48e717fd": "5.17.0", "c5bac1ad41acfcc1": "5.24.0, 5.25.0"},
        "Qwen3_5MoeRMSNorm": {
            "f6aeb8c503a6074c": "5.17.0",
            "4ebae64bb12db2ac": "5.25.0",
            "b94c1ad1d1d577d1": "5.24.0",
        },
        "apply_rotary_pos_emb": {"1791c045dc9ccc29": "5.17.0, 5.24.0, 5.25.0"},
        "rotate_half": {"458e8da1c9744213": "5.17.0, 5.24.0, 5.25.0"},
    },
    "transformers.models.qwen3_moe.modeling_qwen3_moe": {
        "Qwen3MoeAttention": {"903c4802739c4d2d": "5.17.0", "fe85c8cc28bf987d": "5.24.0, 5.25.0"},
        "Qwen3MoeRMSNorm": {"da51832aaea0a33f": "5.17.0, 5.24.0, 5.25.0"},
        "apply_rotary_pos_emb": {"0a7ee152b7792a47": "5.17.0, 5.24.0, 5.25.0"},
        "rotate_half": {"458e8da1c9744213": "5.17.0, 5.24.0, 5.25.0"},
    },
    "transformers.models.qwen3_next.modeling_qwen3_next": {
        "Qwen3NextAttention": {"1ab28312ee4e6694": "5.17.0", "c5ca255ee22e40be": "5.24.0, 5.25.0"},
        "Qwen3NextRMSNorm": {"d7f5c4db329c2350": "5.17.0, 5.24.0", "bf9fa9a93ef928e5": "5.25.0"},
        "apply_rotary_pos_emb": {"1791c045dc9ccc29": "5.17.0, 5.24.0, 5.25.0"},
        "rotate_half": {"458e8da1c9744213": "5.17.0, 5.24.0, 5.25.0"},
    },
    "transformers.models.smollm3.modeling_smollm3": {
        "SmolLM3Attention": {"8e22299a61e6bf48": "5.17.0", "cebe236fbdf696c0": "5.24.0, 5.25.0"},
        "apply_rotary_pos_emb": {"0a7ee152b7792a47": "5.17.0, 5.24.0, 5.25.0"},
        "rotate_half": {"458e8da1c9744213": "5.17.0, 5.24.0, 5.25.0"},
    },
}
# ---- end of KNOWN --------------------------------------------------------------------------------
