"""apply_qkvfuse against transformers code it was not tested with (qkvfuse.integrations.
transformers_sources): every family's attention class, q/k norm class, apply_rotary_pos_emb and
rotate_half in the installed transformers are code of a tested version; a piece whose code
changes (a new attention option read from the config, another norm or rotary formula) is refused,
naming it; comments, docstrings and formatting are not changes. The changed code is made by
editing the real modeling module's syntax tree and handing it to the check as that module's
source."""
import ast
import re

import pytest
import torch

transformers = pytest.importorskip(
    "transformers",
    reason="Hugging Face transformers is not installed (pip install .[transformers])")

import hf_models  # noqa: E402
import test_transformers_families as families_tests  # noqa: E402
from hf_models import assert_close_f64, batch, patched, run  # noqa: E402
from qkvfuse.integrations import transformers_sources as sources  # noqa: E402
from qkvfuse.integrations.transformers import (  # noqa: E402
    _FAMILIES,
    UnsupportedModelError,
    apply_qkvfuse,
)

# (builder, family key, the family's row name): one of each kind of row.
MODELS = {
    "qwen3": (hf_models.build, "Qwen3"),
    "llama": (hf_models.build, "Llama"),
    "gemma4": (families_tests.build, "Gemma 4 (text)"),
    "olmo3": (families_tests.build, "OLMo 3"),
}


def row(name):
    return next(f for f in _FAMILIES if f.name == name)


@pytest.fixture
def edits(monkeypatch):
    """{module name: text -> text}: the check reads each module's source through these."""
    real = sources.source_of
    changes = {}

    def source_of(module_name):
        text = real(module_name)
        return changes[module_name](text) if module_name in changes else text

    monkeypatch.setattr(sources, "source_of", source_of)
    sources.fingerprints.cache_clear()
    yield changes
    sources.fingerprints.cache_clear()


def add_statement(piece, statement):
    """An edit that appends `statement` to the piece's body (a class: to its first method)."""
    def edit(text):
        tree = ast.parse(text)
        node = sources._find(tree, piece)
        if isinstance(node, ast.ClassDef):
            node = next(n for n in node.body if isinstance(n, ast.FunctionDef))
        node.body.append(ast.parse(statement).body[0])
        return ast.unparse(tree)
    return edit


# ---- the installed transformers ------------------------------------------------------------------

def test_the_installed_version_is_recorded_as_tested():
    """scripts/test.sh runs this suite on each transformers version it installs: each must be in
    KNOWN (scripts/transformers_sources.py --write, once its tests pass)."""
    assert transformers.__version__ in sources.tested_versions(), (
        f"transformers {transformers.__version__} is not recorded in transformers_sources.KNOWN "
        f"(tested: {sources.tested_versions()}); run scripts/transformers_sources.py")


@pytest.mark.parametrize("family", _FAMILIES, ids=lambda f: f.attention)
def test_every_family_is_code_of_a_tested_version(family):
    assert sources.unknown(family) == []
    assert None not in sources.fingerprints(family.module, sources.pieces(family)).values()


def test_pieces_name_the_attention_norm_and_rotary_functions():
    assert sources.pieces(row("Qwen3")) == ("Qwen3Attention", "Qwen3RMSNorm",
                                            "apply_rotary_pos_emb", "rotate_half")
    assert sources.pieces(row("Llama")) == ("LlamaAttention", "apply_rotary_pos_emb",
                                            "rotate_half")


# ---- what is a change --------------------------------------------------------------------------

CODE = '''
class Norm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.variance_epsilon = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
'''

SAME = '''
# a comment above
class Norm(nn.Module):
    """A docstring that was not there."""

    def __init__(self, hidden_size, eps=1e-6):  # a trailing comment
        super().__init__()
        self.variance_epsilon = (
            eps
        )

    def forward(self, x):
        """Another one."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                               + self.variance_epsilon)
'''


def digest(text, piece="Norm"):
    return sources.fingerprint(sources._find(ast.parse(text), piece))


def test_comments_docstrings_and_formatting_are_not_changes():
    assert digest(SAME) == digest(CODE)


@pytest.mark.parametrize("old, new", [
    ("eps=1e-6", "eps=1e-5"),                               # a default
    ("+ self.variance_epsilon", "- self.variance_epsilon"),  # an operator
    ("mean(-1", "mean(-2"),                                 # an argument
    ("self.variance_epsilon = eps", "self.eps = eps"),      # an attribute's name
    ("def forward(self, x):", "@torch.no_grad()\n    def forward(self, x):"),  # a decorator
    ("return x *", "return x.float() *"),                   # a call
])
def test_code_edits_are_changes(old, new):
    assert old in CODE
    assert digest(CODE.replace(old, new)) != digest(CODE)


def test_fields_python_leaves_empty_are_not_part_of_the_fingerprint():
    """Python 3.12 added FunctionDef.type_params ([] without type parameters): a tree that has
    the field empty and one that lacks it fingerprint alike."""
    node = sources._find(ast.parse(CODE), "Norm")
    with_field = sources._find(ast.parse(CODE), "Norm")
    for n in ast.walk(with_field):
        if isinstance(n, ast.FunctionDef) and "type_params" not in n._fields:
            n._fields = (*n._fields, "type_params")
            n.type_params = []
    assert sources.fingerprint(with_field) == sources.fingerprint(node)


def test_reformatted_modeling_modules_are_still_known(edits):
    """The real modules written back from their syntax trees (no comments, other formatting):
    the same fingerprints."""
    for family in _FAMILIES:
        edits[family.module] = lambda text: ast.unparse(ast.parse(text))
    for family in _FAMILIES:
        assert sources.unknown(family) == []


# ---- a changed piece is refused by name ----------------------------------------------------------

@pytest.mark.parametrize("piece", ["attention", "norm", "apply_rotary_pos_emb", "rotate_half"])
@pytest.mark.parametrize("model", list(MODELS))
def test_a_changed_piece_is_refused_by_name(edits, model, piece):
    build, name = MODELS[model]
    family = row(name)
    target = {"attention": family.attention, "norm": family.norm}.get(piece, piece)
    if target is None:
        pytest.skip(f"{name} has no q/k norm")
    # e.g. a new attention option read from the config in __init__
    edits[family.module] = add_statement(target, "new_option = 1")
    with pytest.raises(UnsupportedModelError) as error:
        apply_qkvfuse(build(model))
    message = str(error.value)
    assert f"transformers {transformers.__version__}'s {target} ({family.module}) differ" in (
        message)
    # The versions this family was tested with (5.24.0 is not one of Gemma 4's).
    versions = sources.tested_versions(family.module)
    assert versions and f"({', '.join(versions)})" in message
    assert "QKVFUSE_ALLOW_UNCHECKED_TRANSFORMERS=1" in message


def test_only_the_changed_pieces_are_named(edits):
    family = row("Qwen3")
    edits[family.module] = lambda text: add_statement("rotate_half", "x = x")(
        add_statement("Qwen3RMSNorm", "self.extra = 1")(text))
    with pytest.raises(UnsupportedModelError,
                       match=r"'s Qwen3RMSNorm, rotate_half \(transformers\.models\.qwen3"):
        apply_qkvfuse(hf_models.build("qwen3"))


def test_other_families_of_the_model_are_not_affected(edits):
    edits[row("Llama").module] = add_statement("LlamaAttention", "self.extra = 1")
    apply_qkvfuse(hf_models.build("qwen3"))


def test_a_module_without_source_is_refused_by_name(edits):
    family = row("Qwen3")

    def unreadable(text):
        raise OSError(f"no source file for {family.module}")

    edits[family.module] = unreadable
    with pytest.raises(UnsupportedModelError,
                       match=re.escape(f"Qwen3Attention ({family.module}) cannot be compared "
                                       f"with the tested code (no source file for")):
        apply_qkvfuse(hf_models.build("qwen3"))


def test_a_missing_piece_is_refused_by_name(edits):
    """A modeling module that no longer defines a piece (renamed, moved)."""
    family = row("Qwen3")
    edits[family.module] = lambda text: text.replace("def rotate_half(", "def rotate_halves(")
    with pytest.raises(UnsupportedModelError, match=r"'s rotate_half \("):
        apply_qkvfuse(hf_models.build("qwen3"))


def test_the_environment_variable_makes_it_a_warning(edits, monkeypatch):
    """QKVFUSE_ALLOW_UNCHECKED_TRANSFORMERS=1: the same message as a warning, and the model is
    patched (here the change is dead code, so it still equals the unpatched model)."""
    family = row("Qwen3")
    edits[family.module] = add_statement("apply_rotary_pos_emb", "unused = 1")
    monkeypatch.setenv(sources.ALLOW_ENV, "1")
    model = hf_models.build("qwen3")
    with pytest.warns(UserWarning, match=r"'s apply_rotary_pos_emb \(transformers"):
        mine = patched(model)
    assert all("forward" in m.__dict__ for m in mine.modules()
               if type(m).__name__ == "Qwen3Attention")
    ids, _ = batch("batch")
    assert_close_f64(run(mine, ids), run(model, ids))
    monkeypatch.setenv(sources.ALLOW_ENV, "0")  # anything but 1 refuses
    with pytest.raises(UnsupportedModelError):
        apply_qkvfuse(hf_models.build("qwen3"))


def test_no_error_leaves_the_model_half_patched(edits):
    """The check runs before any module is patched."""
    family = row("Qwen3")
    edits[family.module] = add_statement("Qwen3Attention", "self.extra = 1")
    model = hf_models.build("qwen3")
    with pytest.raises(UnsupportedModelError):
        apply_qkvfuse(model)
    assert not any("forward" in m.__dict__ or "_qkvfuse" in m.__dict__ for m in model.modules())
    assert "_qkvfuse_state" not in model.__dict__
    assert isinstance(model(torch.randint(3, hf_models.VOCAB, (1, 5))).logits, torch.Tensor)
