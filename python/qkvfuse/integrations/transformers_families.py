"""The families of SPEC.md section 9 for qkvfuse.integrations.transformers: Gemma 4, Qwen3-Next,
Qwen3.5 and Qwen3.5-MoE, GLM-4.x MoE, OLMo 2, OLMo 3 and SmolLM3 (what each computes before its
attention function: docs/families.md).

Each family is a row of FAMILIES: its attention class (matched exactly, as in transformers.py),
its norm class, and `describe`, which reads one attention module into a LayerSpec: its heads and
width, which norms it has (and over what they run), whether its query carries a gate, whether it
normalizes V, takes V from the key projection or shares another layer's K and V, and whether it
rotates at all. transformers.py's forward is written against a LayerSpec (the families of section
8 have one too: legacy_spec), and weight_blocks / gate_blocks say which rows of q_proj, k_proj and
v_proj make the packed [Q | K | V] projection and the gate. Gemma 4 has a forward of its own
(gemma4_forward): its KV-shared layers read the K and V of an earlier layer.

What stays the model's own code, on the same tensors: the gate of Qwen3-Next / Qwen3.5
(`attention * sigmoid(gate)`, and under fp8=True the gate's projection, a bf16 GEMM over its rows
of q_proj), Gemma 4's sharing of K and V between layers, the attention function and o_proj.
"""
from typing import Callable, NamedTuple, Optional

import torch.nn as nn


class LayerSpec(NamedTuple):
    """What one attention module computes before its attention function, as qkvfuse takes it."""
    q_heads: int
    kv_heads: int                 # 0: a KV-shared layer (Gemma 4): only Q is projected
    head_dim: int
    q_norm: Optional[nn.Module]   # the modules holding the norm weights (None: no QK norm)
    k_norm: Optional[nn.Module]
    norm_scope: str = "head"      # "token": OLMo's norm over the token's H * D values
    gated: bool = False           # q_proj yields [H, 2D]: query lanes [0, D), gate [D, 2D)
    v_norm: Optional[nn.Module] = None  # Gemma 4's weightless RMS norm of V
    k_eq_v: bool = False          # V is the key projection before k_norm (Gemma 4 global layers)
    rotary: bool = True           # False: a NoPE layer (SmolLM3)

    @property
    def kv_shared(self) -> bool:
        return self.kv_heads == 0

    @property
    def normalize(self) -> bool:
        return self.q_norm is not None


class Family(NamedTuple):
    """A row of FAMILIES: the fields of transformers.py's _Family, then `describe` and the
    forward's name when the family needs its own ("gemma4")."""
    name: str
    module: str
    attention: str
    norm: Optional[str]
    weight_offset: float
    sliding: Optional[str]
    describe: Callable[[nn.Module], LayerSpec]
    forward: Optional[str] = None


def legacy_spec(module: nn.Module, family) -> LayerSpec:
    """The LayerSpec of a family of section 8 (Qwen3, Qwen3-MoE, Gemma 3, Llama, Mistral)."""
    config = module.config
    normalized = family.norm is not None
    return LayerSpec(config.num_attention_heads, config.num_key_value_heads, module.head_dim,
                     module.q_norm if normalized else None, module.k_norm if normalized else None)


def _kv_heads(module, head_dim):
    return module.k_proj.out_features // head_dim


def _describe_gemma4(module) -> LayerSpec:
    d = module.head_dim
    heads = module.q_proj.out_features // d
    if module.is_kv_shared_layer:
        return LayerSpec(heads, 0, d, module.q_norm, None)
    return LayerSpec(heads, _kv_heads(module, d), d, module.q_norm, module.k_norm,
                     v_norm=module.v_norm, k_eq_v=module.v_proj is None)


def _describe_gated(module) -> LayerSpec:
    d = module.head_dim
    return LayerSpec(module.config.num_attention_heads, _kv_heads(module, d), d, module.q_norm,
                     module.k_norm, gated=True)


def _describe_glm4_moe(module) -> LayerSpec:
    d = module.head_dim
    norms = (module.q_norm, module.k_norm) if module.use_qk_norm else (None, None)
    return LayerSpec(module.config.num_attention_heads, _kv_heads(module, d), d, *norms)


def _describe_olmo(module) -> LayerSpec:
    d = module.head_dim
    return LayerSpec(module.config.num_attention_heads, _kv_heads(module, d), d, module.q_norm,
                     module.k_norm, norm_scope="token")


def _describe_smollm3(module) -> LayerSpec:
    d = module.head_dim
    return LayerSpec(module.config.num_attention_heads, _kv_heads(module, d), d, None, None,
                     rotary=bool(module.use_rope))


def _models(name):
    return f"transformers.models.{name}.modeling_{name}"


FAMILIES = (
    Family("Gemma 4 (text)", _models("gemma4"), "Gemma4TextAttention", "Gemma4RMSNorm", 0.0,
           "module", _describe_gemma4, forward="gemma4"),
    Family("Qwen3-Next", _models("qwen3_next"), "Qwen3NextAttention", "Qwen3NextRMSNorm", 1.0,
           None, _describe_gated),
    Family("Qwen3.5", _models("qwen3_5"), "Qwen3_5Attention", "Qwen3_5RMSNorm", 1.0, None,
           _describe_gated),
    Family("Qwen3.5-MoE", _models("qwen3_5_moe"), "Qwen3_5MoeAttention", "Qwen3_5MoeRMSNorm", 1.0,
           None, _describe_gated),
    Family("GLM-4.x MoE", _models("glm4_moe"), "Glm4MoeAttention", "Glm4MoeRMSNorm", 0.0, None,
           _describe_glm4_moe),
    Family("OLMo 2", _models("olmo2"), "Olmo2Attention", "Olmo2RMSNorm", 0.0, None,
           _describe_olmo),
    Family("OLMo 3", _models("olmo3"), "Olmo3Attention", "Olmo3RMSNorm", 0.0, "module",
           _describe_olmo),
    Family("SmolLM3", _models("smollm3"), "SmolLM3Attention", None, 0.0, "module",
           _describe_smollm3),
)


# ---- the projection's rows -----------------------------------------------------------------------

def _query_rows(weight, spec, gate):
    """The rows of q_proj's weight (or bias) holding the query (gate: the gate) of each head, as
    one strided view [H, D, C] (bias: [H, D]): the projection is [H, 2D] per token, query lanes
    [0, D) then gate lanes [D, 2D) (docs/families.md). One view, not one per head: autograd then
    scatters its gradient into q_proj's once. None for a projection without a bias."""
    if weight is None:
        return None
    d = spec.head_dim
    return weight.view(spec.q_heads, 2, d, *weight.shape[1:])[:, 1 if gate else 0]


def weight_blocks(module, spec: LayerSpec, fp8: bool, bias: bool = False):
    """(qk blocks, v blocks): the row blocks of the packed projection's Q/K part ([Hq*D | Hkv*D]
    rows) and V part (Hkv*D rows), as views of the module's weights (biases with `bias`, None for
    a projection without one): each [rows, C] ([rows] for a bias), or a gated query's [Hq, D, C]
    ([Hq, D]), whose rows in order are the query's.

    The V part is empty for a KV-shared layer and, on the bf16 path, for attention_k_eq_v (V is
    then a view of the key rows of the Q/K GEMM's output); fp8=True repeats the key rows there,
    since the packed op's V has rows of its own (the GEMM computes them twice; both rows'
    gradients are summed into k_proj's)."""
    def rows(projection):
        return getattr(projection, "bias" if bias else "weight")

    q = rows(module.q_proj)
    qk = [_query_rows(q, spec, gate=False) if spec.gated else q]
    if spec.kv_shared:
        return qk, []
    qk.append(rows(module.k_proj))
    if spec.k_eq_v:
        return qk, [rows(module.k_proj)] if fp8 else []
    return qk, [rows(module.v_proj)]


def gate_blocks(module, spec: LayerSpec, bias: bool = False):
    """The gate's row blocks of q_proj (gated queries: one [Hq, D, C] view, [Hq, D] for the
    bias), else []."""
    if not spec.gated:
        return []
    return [_query_rows(getattr(module.q_proj, "bias" if bias else "weight"), spec, gate=True)]


def projections(module, spec: LayerSpec):
    """The projection modules the layer has (a KV-shared layer only q_proj; k_eq_v no v_proj)."""
    if spec.kv_shared:
        return (module.q_proj,)
    if spec.k_eq_v:
        return (module.q_proj, module.k_proj)
    return (module.q_proj, module.k_proj, module.v_proj)


def check_layer(where: str, spec: LayerSpec, family, error):
    """Refuses, naming the reason, a V norm qkvfuse would compute differently: of another class
    (another patch applied first) or with a weight (qkvfuse's V norm is weightless). The q/k norms
    (the family's or Liger-Kernel's) and the one eps of all three: transformers.py's _qk_norms."""
    norm = spec.v_norm
    if norm is None:
        return
    cls = type(norm).__name__
    if cls != family.norm:
        raise error(f"{where}: v_norm is {cls}, expected the family's {family.norm} "
                    f"(another patch applied first?)")
    if getattr(norm, "with_scale", False):
        raise error(f"{where}: v_norm has a weight; qkvfuse's V norm is weightless (SPEC.md 9)")


def norm_eps(norm, where: str, name: str, error):
    """A family norm's eps, from the attribute its forward reads: `variance_epsilon`, or `eps`
    (Gemma 4's Gemma4RMSNorm before transformers 5.25 renamed it to variance_epsilon). A norm that
    holds both, with different values, is refused: which of them its forward reads cannot be told
    from outside. (`where`: the layer, as in error messages; `name`: "q_norm", "k_norm", "v_norm".)"""
    eps = getattr(norm, "variance_epsilon", None)
    other = getattr(norm, "eps", None)
    if eps is None:
        return float(other)
    if other is not None and float(other) != float(eps):
        raise error(f"{where}: {name} has both variance_epsilon ({eps}) and eps ({other}); "
                    f"qkvfuse cannot tell which one its forward reads")
    return float(eps)


# ---- Gemma 4's forward ---------------------------------------------------------------------------

def gemma4_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                   shared_kv_states=None, past_key_values=None, **kwargs):
    """Gemma4TextAttention.forward with q, k, v (k, v: layers that project them) from qkvfuse;
    the sharing of K and V and the rest as transformers writes it."""
    from qkvfuse.integrations import transformers as integration  # the module that imports this

    layer = self._qkvfuse
    cache = kwargs.pop("cache", None) if past_key_values is None else past_key_values
    input_shape = hidden_states.shape[:-1]
    query_states, key_states, value_states, _ = integration.attention_states(
        self, hidden_states, position_embeddings)
    if self.is_kv_shared_layer:
        key_states, value_states = shared_kv_states[self.layer_type]
        key_states = key_states.to(query_states.device)
        value_states = value_states.to(query_states.device)
    elif cache is not None:
        key_states, value_states = integration.cache_update(self, cache, key_states,
                                                            value_states, kwargs)
    if self.store_full_length_kv:
        shared_kv_states[self.layer_type] = key_states, value_states

    attention_interface = integration.ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, layer.eager)
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask,
        dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling,
        sliding_window=self.sliding_window, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


FORWARDS = {"gemma4": gemma4_forward}
