"""Hugging Face transformers models through qkvfuse, with one call.

    from qkvfuse.integrations.transformers import apply_qkvfuse
    model = AutoModelForCausalLM.from_config(config)   # or from_pretrained(...)
    apply_qkvfuse(model)              # q/k norm + rotary: one qkvfuse.qk_norm_rope per layer
    apply_qkvfuse(model, fp8=True)    # and the q/k/v projections in FP8:
                                      # qkvfuse.packed_fp8_qkv_current_scaling

Supported (the attention modules' classes, matched exactly; SPEC.md section 8 has the math):

| family | attention class | per-head norm | qkvfuse layout |
| --- | --- | --- | --- |
| Qwen3 | Qwen3Attention | RMS * w (Qwen3RMSNorm*) | NeoX, GQA, q/k weights, eps of the norm |
| Qwen3-MoE (attention only) | Qwen3MoeAttention | RMS * w (Qwen3MoeRMSNorm*) | as Qwen3 |
| Gemma 3 (text) | Gemma3Attention | RMS * (1 + w) (Gemma3RMSNorm*) | as Qwen3, weight_offset 1 |
| Llama | LlamaAttention | none | NeoX, GQA, normalize=False |
| Mistral | MistralAttention | none | as Llama |

* or Liger-Kernel's LigerRMSNorm, with the settings it carries (see "What it composes with").

and the families of SPEC.md section 9 (transformers_families.py; docs/families.md):

| family | attention class | qkvfuse layout (what stays the model's own code) |
| --- | --- | --- |
| Gemma 4 (text) | Gemma4TextAttention | RMS * w, V norm, D 256 / 512, k_eq_v (V from the key rows), KV-shared layers query-only (the sharing of K and V) |
| Qwen3-Next, Qwen3.5, Qwen3.5-MoE | Qwen3NextAttention, Qwen3_5Attention, Qwen3_5MoeAttention | RMS * (1 + w), partial rotary, gated query (the gate: sigmoid(gate) * attention; under fp8 its projection, bf16) |
| GLM-4.x MoE | Glm4MoeAttention | RMS * w when use_qk_norm, partial rotary |
| OLMo 2, OLMo 3 | Olmo2Attention, Olmo3Attention | token-wide RMS * w ([H * D] weights) |
| SmolLM3 | SmolLM3Attention | no norm; no rotary on NoPE layers |

A model with any other attention module (or none) is refused with UnsupportedModelError naming
the model's class and the attention classes found. The multimodal Gemma3ForConditionalGeneration
is refused for its vision tower's attention (SiglipAttention); its text model,
model.model.language_model (a Gemma3TextModel), can be patched on its own.

Which transformers. The patched forward restates the attention classes of the transformers
versions the tests pass on (5.17.0 and 5.25.0: scripts/test.sh). apply_qkvfuse compares each
family's attention class, q/k norm class, apply_rotary_pos_emb and rotate_half in the installed
transformers with their code in those versions (syntax trees: comments and formatting aside) and
refuses, naming them, pieces it has not seen, which could compute something the patched forward
does not (transformers_sources.py; QKVFUSE_ALLOW_UNCHECKED_TRANSFORMERS=1 makes it a warning).

What changes. apply_qkvfuse replaces, on each attention module *instance*, the bound method
`forward` (an instance attribute: the class, other models and other instances are untouched;
remove_qkvfuse(model) deletes it again). The new forward computes q, k and v as below, then runs
the rest of the library's forward as it is written there: the KV cache update (past_key_values,
named cache from transformers 5.24 on: the class's own signature decides), the attention
function the config selects (ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation),
else the family's own eager_attention_forward), with the same dropout, scaling, sliding window
and keyword arguments, and o_proj. No parameter, buffer or state-dict key is added, renamed or
changed: a patched model saves and loads like an unpatched one, and load_state_dict /
from_pretrained weights are used as they are.

Rotary angles. The model's rotary embedding still runs (the decoder passes its
position_embeddings = (cos, sin) [B or 1, S, D] to every attention layer, per layer type for
Gemma 3's local/global layers). The patched forward turns them into qkvfuse's cos/sin cache
[B*S, D] (cos of frequency i in column i, sin in column D/2 + i: HF's cos/sin are
cat(freqs, freqs), so their first halves hold every frequency) read at positions 0..B*S-1 (or
the sequence position when one [1, S, D] serves the whole batch). Everything the model's rotary
embedding does is therefore honoured without restating it: position_ids (packed sequences,
left-padded batches, generate's offsets past the KV cache), every rope type and its scaling
(linear, dynamic NTK with its recomputed inv_freq, YaRN and LongRoPE with their
attention_scaling, Llama 3), and Gemma 3's two thetas. The cache is built once per forward pass
for each distinct (cos, sin) pair (a small [B*S, D] concatenation; the layers that share the pair
reuse it) and the rotary width must be the full head width, as the families' own code requires.

The Q/K layout. qk_norm_rope reads qk [T, Hq + Hkv, D] (query heads first) and HF keeps q_proj,
k_proj and v_proj as three nn.Linear. The state dict must not change, so a packed weight cannot
be stored; two ways remain, and the patched forward takes the cheaper per call:
- one GEMM against the concatenated q and k weight rows torch.cat([Wq; Wk]), cast to the compute
  dtype in the same pass (as autocast would cast them): qk is that GEMM's whole output, with no
  copy of the activations. Float32 master weights under autocast are cast, i.e. copied, either
  way, so the concatenation costs nothing more; weights already in the compute dtype are copied,
  (Hq + Hkv) * D x C elements per forward.
- the projections called as modules and torch.cat of the q and k outputs: a copy of
  T * (Hq + Hkv) * D activations, and as much again in the backward.
The first is taken under autocast with float32 weights and otherwise from T >= C: every training
step (T = batch x sequence is thousands of tokens), while generate's decode steps (T = batch) of a
bf16 model take the second. v, and a gated query's gate, are GEMMs of their own, never column
slices of a wider GEMM output: autograd scatters the gradient of such a slice into a zero-filled
copy of the whole output and sums the parts (in eager mode seven passes over T x (Hq + 2 Hkv) * D;
under torch.compile a cat), while the input gradients of separate GEMMs are summed once over
[T, C] (under torch.compile by the next GEMM, as an addmm). At the Qwen3-0.6B training shape
(T = 16384) that is 0.84 GB less memory traffic per layer and step in eager mode, 0.23 GB under
torch.compile (bench/attention_input_traffic.py counts it). Projections that are not plain
nn.Linear (e.g. PEFT's LoRA layers, quantized linears) are always called as modules, with the
activation cat.

FP8 (fp8=True). Each layer's q/k/v projection runs through
qkvfuse.packed_fp8_qkv_current_scaling: one FP8 GEMM, then the norm + rotary, with current
scaling of everything it quantizes, computed on the device within the call (no host
synchronization, nothing kept between calls):
- the weights: the layer's master Wq, Wk, Wv concatenated in bf16 ([F, C]: the copy through which
  their gradients flow, which the backward also reads) and quantized to e4m3 in both layouts with
  scale max|W| / 448, in every forward. The e4m3 weight is therefore always the current one:
  after optimizer steps, load_state_dict, .to(), with no call in the training loop; under FSDP
  (fully_shard per decoder layer, or on the whole model) the full weights FSDP gathers for the
  forward are the ones quantized, so every rank quantizes the same full weights and sees the
  optimizer step on the shards. The cost, two passes over the bf16 weight, is under 1 % of the
  layer's forward at Qwen3-0.6B and 8B training shapes (the op's docstring has the bytes).
- the activation: the attention's input x (bf16) is quantized once, to x_f8 [T, C] and its
  transpose, shared by the Q, K and V columns of the one FP8 GEMM: x_scale = max|x| / 448 (one
  extra read of x). HF's input norm multiplies by a learned weight, so the speedrun's fixed bound
  sqrt(C)/448 does not hold here.
- the gradient: grad_scale = 4 * max(|grad q|, |grad k|, |grad v|) / 448, computed by the op's
  backward from the gradients that reach it (a fixed scale lets small gradients round to zero in
  e4m3, docs/training/README.md). Each call has its own: gradient accumulation, activation
  checkpointing and several forwards before one backward each scale their own gradients.
- the master weights receive their gradients in their own dtype (fp32 under autocast), and so do
  the q/k norm weights (from the fused backward).
- the families of section 9 (transformers_families.weight_blocks): the op's weight is the layer's
  [Q | K | V] rows gathered into the one bf16 copy, and the layout options ride along (a V norm,
  the token-wide norm, query_only, no angles). A gated query (Qwen3-Next, Qwen3.5) contributes
  its query rows of q_proj (one strided view); its gate rows are a bf16 GEMM of their own on the
  same x (the op's columns are Q, K and V only), so the gate, sigmoid(gate) * attention, is not
  quantized. Gemma 4's attention_k_eq_v passes k_proj's rows once and the copy holds them twice
  (K and V rows: the FP8 GEMM computes them twice; their gradients are summed into k_proj's);
  its KV-shared layers project Q alone (query_only).
FP8 computes in bf16 (its q, k and v are cast back to the activations' dtype: a float32 model
without autocast runs too, on the CPU), and needs no q/k/v bias, q/k/v projections that are plain
nn.Linear, and C and the packed width (Hq + 2 Hkv) * D multiples of 16 (cuBLASLt FP8), which
apply_qkvfuse checks. A call whose token count T = batch x sequence is not a multiple of 16
(generate's decode steps, odd batches) runs the bf16 path for that call: same weights, no FP8
GEMM. A q/k/v weight that is still a DTensor shard in the forward (the attention module called
alone under FSDP, or a tensor-parallel plan) is refused by name.

Numerics. HF rounds to the activation dtype between steps (the normalized row before the weight,
each product of the rotary); qkvfuse rounds once, so the patched bf16 model differs from the
unpatched one by a few bf16 roundings of q and k per layer (SPEC.md section 8), and is the
closer of the two to the exact value. On the CPU the patched path also runs float32 and float64
models (equal to the unpatched model to that precision); on CUDA qkvfuse needs bf16 activations.

What it composes with (tests/python/test_transformers_compose.py):
- Liger-Kernel (apply_liger_kernel_to_qwen3, _qwen3_moe, _gemma3_text, _llama, _mistral; of
  section 9's families _qwen3_next, _olmo3 and _gemma4_text's instance patch, whose class patch
  swaps in LigerRMSNormForGemma4, a forward qkvfuse does not read: refused by name), in
  either order, before or after the model is built. Its q_norm / k_norm (LigerRMSNorm, or the
  family's norm whose forward Liger rebound) are read at every forward: their weight (none with
  elementwise_affine=False), offset (qkvfuse's weight_offset) and variance_epsilon (eps). Their
  casting_mode ("llama", "gemma", "none"), in_place and row_mode decide where Liger rounds to
  the activation dtype and how it schedules its kernel, not what it computes: qkvfuse computes
  the norm and the rotary in fp32 and rounds q and k once in every mode (as "gemma" does for the
  norm; closer to the exact value than "llama" and "none"), without emulating their
  intermediate roundings. Refused with UnsupportedModelError naming the setting: a casting_mode
  Liger does not define; q_norm and k_norm with different eps or offsets (one of each serves
  both); a weight that is not [head_dim] ([heads * head_dim] for a token-wide norm); a norm
  class or instance forward qkvfuse does not know (named). Liger's rope (apply_rotary_pos_emb
  in the modeling module) is not called by the patched forward, which does its own rotary;
  Liger's decoder RMSNorms, SwiGLU / GeGLU MLPs and fused linear cross entropy are outside the
  attention input and run as Liger patched them.
- PEFT adapters (LoRA on q_proj, k_proj, v_proj, o_proj): the bf16 path calls such projections
  as modules, so the adapters' output is included; merged adapters too (merge_adapter(), or
  merge_and_unload(), after which the projections are plain nn.Linear again). fp8=True refuses
  adapter layers, naming their class, since the packed FP8 op reads the weights and not the
  modules' forward: merge the adapters first, or use fp8=False.
- gradient_checkpointing_enable(), with use_reentrant True or False: the same loss and gradients,
  bit for bit, as without.
- torch.compile(model): both paths trace into the model's graphs with no graph break the unpatched
  model does not have (fullgraph=True works, forward and backward; no recompilation on the next
  call). Tested with the aot_eager and inductor backends on the CPU; for the families of section
  9 too (Gemma 4, Qwen3-Next, OLMo 3, SmolLM3: tests/python/test_transformers_families.py).
- TRL's SFTTrainer trains a patched model (bf16 and FP8), tracking the unpatched model's losses.

Also tested on the CPU (tests/python/test_transformers_integration.py): every family,
GQA/MHA/MQA, packed sequences, rope scalings, generate, save/load; DDP and FSDP2 (fully_shard per
decoder layer, two processes over gloo: tests/python/test_transformers_fsdp.py, and
examples/train_hf.py under torchrun, tests/python/test_train_distributed.py; NCCL on GPUs). Not
covered: pickling a patched model object (its forward is a bound method: save the state dict, as
save_pretrained does), and tensor or pipeline parallel plans that shard q_proj/k_proj/v_proj
(fp8=True refuses a DTensor weight by name); a q_norm wrapped by PEFT's modules_to_save is
refused (its class is named).
"""
import inspect
import sys
import types
import weakref
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import qkvfuse

from . import transformers_families as families
from . import transformers_sources as sources

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch built without torch.distributed
    _DTensor = None

try:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
except ImportError as error:  # pragma: no cover - exercised only without the optional dependency
    raise ImportError(
        "qkvfuse.integrations.transformers needs Hugging Face transformers (5.x): "
        "pip install 'transformers>=5.17,<6', or install qkvfuse with the [transformers] extra"
    ) from error

__all__ = ["SUPPORTED", "UnsupportedModelError", "apply_qkvfuse", "attention_input",
           "attention_states", "remove_qkvfuse"]

# cuBLASLt FP8 GEMMs need M, N and K multiples of 16 (include/qkvfuse/packed_qkv.hpp).
FP8_MULTIPLE = 16
# Liger-Kernel's RMSNorm forward (liger-kernel:liger_kernel/transformers/rms_norm.py), of its class
# LigerRMSNorm or of a subclass, or bound by its monkey patch onto a family's norm instance.
LIGER_RMS_NORM = ("liger_kernel.transformers.rms_norm", "LigerRMSNorm.forward")
# Its casting modes (strings, or the codes its ops also take): where it rounds, not what it
# computes (module docstring).
LIGER_CASTING_MODES = ("llama", "gemma", "none", 0, 1, -1)


class UnsupportedModelError(ValueError):
    """apply_qkvfuse refused the model (its class and the reason are in the message)."""


class _Family(NamedTuple):
    name: str
    module: str          # the modeling module that defines the classes
    attention: str       # the attention class, matched exactly
    norm: Optional[str]  # the per-head norm class of q_norm / k_norm, None: no QK norm
    weight_offset: float  # 1.0: the norm multiplies by (1 + w)
    sliding: Optional[str]  # how the library's forward passes sliding_window: "module",
    #                         "config" (getattr(config, "sliding_window", None)) or None (not)


_FAMILIES = (
    _Family("Qwen3", "transformers.models.qwen3.modeling_qwen3", "Qwen3Attention",
            "Qwen3RMSNorm", 0.0, "module"),
    _Family("Qwen3-MoE", "transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeAttention",
            "Qwen3MoeRMSNorm", 0.0, "module"),
    _Family("Gemma 3", "transformers.models.gemma3.modeling_gemma3", "Gemma3Attention",
            "Gemma3RMSNorm", 1.0, "module"),
    _Family("Llama", "transformers.models.llama.modeling_llama", "LlamaAttention", None, 0.0,
            None),
    _Family("Mistral", "transformers.models.mistral.modeling_mistral", "MistralAttention", None,
            0.0, "config"),
) + families.FAMILIES  # SPEC.md section 9's: transformers_families.py
SUPPORTED = tuple(f"{f.name} ({f.attention})" for f in _FAMILIES)


def _family_of(module: nn.Module) -> Optional[_Family]:
    cls = type(module)
    for family in _FAMILIES:
        if cls.__name__ == family.attention and cls.__module__ == family.module:
            return family
    return None


def _looks_like_attention(module: nn.Module) -> bool:
    """Transformers names its attention classes XAttention, XSelfAttention, XFlashAttention2..."""
    name = type(module).__name__
    return name.endswith("Attention") or name.endswith("Attention2")


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return _DTensor is not None and isinstance(tensor, _DTensor)


# ---- the per-model state: the rotary caches of one forward ---------------------------------------

class _ModelState:
    """Shared by the patched layers of one model."""

    def __init__(self, fp8: bool):
        self.fp8 = fp8
        self._rope = {}   # (id(cos), id(sin), B, S) -> (weakref cos, weakref sin, cos_sin, pos)
        self._ones = {}   # device -> float32 1.0 (packed_fp8_qkv's qkv_scale)

    def one(self, device) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # A constant of the graph, instead of a tensor that the trace would store into the
            # dict (an extra graph output, and a recompilation once the dict has changed).
            return torch.ones((), dtype=torch.float32, device=device)
        one = self._ones.get(device)
        if one is None:
            one = self._ones[device] = torch.ones((), dtype=torch.float32, device=device)
        return one

    def rope(self, cos, sin, batch, seq, head_dim, accept):
        """(cos_sin, positions) of this forward's (cos, sin), built once per pair."""
        if torch.compiler.is_compiling():
            return _rope_cache(cos, sin, batch, seq, head_dim, accept)
        key = (id(cos), id(sin), batch, seq)
        hit = self._rope.get(key)
        if hit is not None and hit[0]() is cos and hit[1]() is sin and hit[2].dtype in accept:
            return hit[2], hit[3]
        cos_sin, positions = _rope_cache(cos, sin, batch, seq, head_dim, accept)
        # Keep the entries whose (cos, sin) are still alive (usually: this forward's pairs).
        self._rope = {k: v for k, v in self._rope.items()
                      if v[0]() is not None and v[1]() is not None}
        self._rope[key] = (weakref.ref(cos), weakref.ref(sin), cos_sin, positions)
        return cos_sin, positions


def _rope_cache(cos, sin, batch, seq, head_dim, accept):
    """qkvfuse's cos/sin cache [rows, r] and positions [B*S] from HF's cos, sin [B or 1, S, r]:
    r = head_dim, or a partial rotary's even r < head_dim (GLM-4.x, Qwen3-Next: the families'
    apply_rotary_pos_emb rotates lanes [0, r) and passes the rest through, as rotary_dim does)."""
    width = cos.shape[-1]
    if width % 2 or not 0 < width <= head_dim or sin.shape != cos.shape:
        raise ValueError(
            f"qkvfuse: position_embeddings: expected cos and sin of an even width up to head_dim "
            f"= {head_dim}, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    half = width // 2
    cos_sin = torch.cat((cos[..., :half], sin[..., :half]), dim=-1).reshape(-1, width)
    if cos_sin.dtype not in accept:
        cos_sin = cos_sin.float()
    tokens = batch * seq
    positions = torch.arange(tokens, dtype=torch.int32, device=cos.device)
    if cos_sin.shape[0] == seq and batch > 1:
        positions = positions % seq  # one [1, S, D] for the whole batch
    elif cos_sin.shape[0] != tokens:
        raise ValueError(
            f"qkvfuse: position_embeddings: expected cos of shape [B or 1, S, D] for hidden "
            f"states [B = {batch}, S = {seq}, C], got {tuple(cos.shape)}")
    return cos_sin, positions


# ---- one layer -----------------------------------------------------------------------------------

class _Layer:
    """What the patched forward of one attention module needs (set by apply_qkvfuse)."""

    def __init__(self, module, family, state, fp8, where):
        self.family = family
        self.state = state
        self.fp8 = fp8
        self.where = where  # "qkvfuse.apply_qkvfuse: <model>: <path> (<class>)", for errors
        # What the module computes before its attention function (transformers_families.py).
        self.spec = spec = _spec_of(module, family)
        self.q_heads = spec.q_heads
        self.kv_heads = spec.kv_heads
        self.head_dim = spec.head_dim
        self.normalize = spec.normalize
        # (q_norm, k_norm, their instance forwards, their kinds): see _qk_norms.
        self.norms = None
        self.eager = sys.modules[type(module).__module__].eager_attention_forward
        # transformers 5.24 renamed the KV cache `cache` (past_key_values before) and hands the
        # call's keyword arguments to its update: the patched forward does what the class does.
        self.cache_kwargs = "cache" in inspect.signature(type(module).forward).parameters
        projections = families.projections(module, spec)
        self.plain = all(type(p) is nn.Linear for p in projections)


def _spec_of(module, family):
    describe = getattr(family, "describe", None)
    return describe(module) if describe is not None else families.legacy_spec(module, family)


# ---- the q/k norms: the family's own or Liger-Kernel's ------------------------------------------

def _qualified(function_or_class) -> str:
    return f"{function_or_class.__module__}.{function_or_class.__qualname__}"


def _norm_kind(norm, name, layer) -> str:
    """"family" or "liger": whose math the module `norm` (a q_norm or k_norm) runs, by the
    function that runs as its forward (bound on the instance, as Liger's monkey patch does, or
    its class's). Raises UnsupportedModelError naming what qkvfuse cannot read. Its weight is
    [head_dim], or [heads * head_dim] for a token-wide norm (OLMo 2 / 3)."""
    bound = norm.__dict__.get("forward")
    function = type(norm).forward if bound is None else getattr(bound, "__func__", bound)
    key = (getattr(function, "__module__", None), getattr(function, "__qualname__", None))
    where, family = layer.where, layer.family
    if key == LIGER_RMS_NORM:
        kind, what = "liger", f"{where}: {name} (Liger-Kernel's LigerRMSNorm)"
        mode = getattr(norm, "casting_mode", None)
        if mode not in LIGER_CASTING_MODES:
            raise UnsupportedModelError(f"{what}: casting_mode {mode!r} is none of 'llama', "
                                        f"'gemma', 'none'")
    elif key == (family.module, f"{family.norm}.forward"):
        kind, what = "family", f"{where}: {name} ({family.norm})"
    elif bound is not None:
        raise UnsupportedModelError(
            f"{where}: {name} ({type(norm).__name__}) has its forward replaced on the instance "
            f"by {_qualified(function)}, which qkvfuse cannot read: it takes the family's "
            f"{family.norm} or Liger-Kernel's LigerRMSNorm")
    else:
        raise UnsupportedModelError(
            f"{where}: {name} is {_qualified(type(norm))}, expected the family's {family.norm} "
            f"or Liger-Kernel's LigerRMSNorm (another patch applied first?)")
    weight = norm.weight
    if layer.spec.norm_scope == "token":
        heads = layer.q_heads if name == "q_norm" else layer.kv_heads
        width = heads * layer.head_dim
        expected = f"[heads * head_dim] = [{heads} * {layer.head_dim}]"
    else:
        width, expected = layer.head_dim, f"[head_dim] = [{layer.head_dim}]"
    if weight is not None and tuple(weight.shape) != (width,):
        raise UnsupportedModelError(f"{what}: weight of shape {list(weight.shape)}, expected "
                                    f"{expected}")
    return kind


def _norm_settings(norm, name, kind, layer):
    """(weight_offset, eps) of the norm `name` of that kind, read as its forward reads them."""
    if kind == "liger":
        return float(norm.offset), float(norm.variance_epsilon)
    return layer.family.weight_offset, families.norm_eps(norm, layer.where, name,
                                                         UnsupportedModelError)


def _instance_forward(norm):
    return None if norm is None else norm.__dict__.get("forward")


def _qk_norms(module, layer) -> dict:
    """qk_norm_rope's norm keywords for `module`'s q_norm and k_norm (q_norm alone on a KV-shared
    layer). Whose math each norm runs is decided again whenever the norm module or its instance
    forward changes (a Liger patch applied after apply_qkvfuse rebinds it); their offsets and eps
    are read at every forward, as their own forward reads them, and so is a V norm's eps (Gemma
    4's weightless v_norm: the op takes one eps for the three)."""
    q = module.q_norm
    k = None if layer.spec.kv_shared else module.k_norm
    seen = layer.norms
    if (seen is None or seen[0] is not q or seen[1] is not k or
            seen[2] is not _instance_forward(q) or seen[3] is not _instance_forward(k)):
        kinds = (_norm_kind(q, "q_norm", layer),
                 None if k is None else _norm_kind(k, "k_norm", layer))
        seen = layer.norms = (q, k, _instance_forward(q), _instance_forward(k), kinds)
    q_offset, q_eps = _norm_settings(q, "q_norm", seen[4][0], layer)
    q_weight = q.weight
    if k is None:
        k_offset, k_eps, k_weight = q_offset, q_eps, None
    else:
        (k_offset, k_eps), k_weight = _norm_settings(k, "k_norm", seen[4][1], layer), k.weight
    # One eps and one weight_offset serve both (an offset matters only with a weight).
    if q_weight is None:
        q_offset = k_offset
    elif k_weight is None:
        k_offset = q_offset
    for setting, q_value, k_value in (("eps", q_eps, k_eps), ("offset", q_offset, k_offset)):
        if q_value != k_value:
            raise UnsupportedModelError(
                f"{layer.where}: q_norm and k_norm differ in {setting} ({q_value} and "
                f"{k_value}): qkvfuse applies one {setting} to both")
    if layer.spec.v_norm is not None:
        v_eps = families.norm_eps(module.v_norm, layer.where, "v_norm", UnsupportedModelError)
        if v_eps != q_eps:
            raise UnsupportedModelError(
                f"{layer.where}: q_norm, k_norm and v_norm have different eps ({q_eps} and "
                f"{v_eps}): qkvfuse takes one eps per call")
    return dict(q_weight=q_weight, k_weight=k_weight, weight_offset=q_offset, eps=q_eps)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def attention_input(module: nn.Module, hidden_states: torch.Tensor, position_embeddings):
    """The patched part of a patched attention module alone: (query, key, value) states
    [B, H, S, D] from its input hidden_states [B, S, C] and the decoder's position_embeddings,
    exactly as its patched forward computes them (for profiling and tests). A KV-shared layer's
    key and value are None; a gated query's gate: attention_states."""
    return attention_states(module, hidden_states, position_embeddings)[:3]


def attention_states(module: nn.Module, hidden_states: torch.Tensor, position_embeddings):
    """attention_input's (query, key, value) and the gate [B, S, Hq*D] of a gated query (None
    for other families)."""
    layer = module._qkvfuse
    spec = layer.spec
    if position_embeddings is None and spec.rotary:
        raise ValueError(f"qkvfuse: {type(module).__name__}.forward: position_embeddings "
                         f"(cos, sin) are required")
    if hidden_states.dim() != 3:
        raise ValueError(f"qkvfuse: {type(module).__name__}: expected hidden_states [B, S, C], "
                         f"got {tuple(hidden_states.shape)}")
    batch, seq, channels = hidden_states.shape
    tokens = batch * seq
    dtype = _compute_dtype(hidden_states)
    device = hidden_states.device
    if dtype not in (torch.bfloat16, torch.float32, torch.float64) or (
            device.type != "cpu" and dtype != torch.bfloat16):
        raise TypeError(
            f"qkvfuse: {type(module).__name__}: the attention runs in {dtype} on "
            f"{device.type}; qkvfuse needs bfloat16 activations (load the model in bfloat16 or "
            f"run it under torch.autocast(dtype=torch.bfloat16)); float32 and float64 run on the "
            f"CPU only")
    fp8 = layer.fp8 and tokens % FP8_MULTIPLE == 0 and tokens > 0
    # The cos/sin cache and the norm weights: bf16 or float32 (the CPU also takes qk's own dtype,
    # which is bf16 in the FP8 op).
    accept = (torch.bfloat16, torch.float32) + ((dtype,) if device.type == "cpu" and not fp8
                                                else ())
    norms = dict(num_kv_heads=layer.kv_heads or None, rotary_style="neox",
                 normalize=layer.normalize, query_only=spec.kv_shared,
                 norm_scope=spec.norm_scope, normalize_v=spec.v_norm is not None)
    if spec.rotary:
        cos, sin = position_embeddings
        norms["cos_sin"], norms["positions"] = layer.state.rope(cos, sin, batch, seq,
                                                                layer.head_dim, accept)
    if layer.normalize:
        norms.update(_qk_norms(module, layer))
        for name in ("q_weight", "k_weight"):
            weight = norms[name]
            if weight is not None and weight.dtype not in accept:
                norms[name] = weight.float()
    x = hidden_states.reshape(tokens, channels)
    if fp8:
        # The FP8 op reads x in bf16 and writes bf16: q, k, v (and a gate) come back in the
        # activations' dtype, so a float32 model without autocast runs FP8 too (at FP8's
        # precision), whatever T is, and a call whose T is no multiple of 16 runs the bf16 path
        # in that dtype.
        q, k, v, gate = (None if t is None else t.to(dtype)
                         for t in _fp8_projection(module, layer, x, norms))
    else:
        qk, v, gate = _bf16_projection(module, layer, x.to(dtype), dtype)
        if not (layer.normalize or spec.rotary or spec.v_norm is not None):
            # Nothing to fuse (SmolLM3's NoPE layers): the projection's views, as the model has.
            q, k = qk[:, :layer.q_heads], qk[:, layer.q_heads:]
        elif spec.v_norm is not None:
            q, k, v = qkvfuse.qk_norm_rope(qk, num_heads=layer.q_heads, v=v, **norms)
        else:
            q, k = qkvfuse.qk_norm_rope(qk, num_heads=layer.q_heads, **norms)
    if spec.kv_shared:
        k = v = None
    states = tuple(None if t is None else t.view(batch, seq, t.shape[1], t.shape[2]).transpose(1, 2)
                   for t in (q, k, v))
    return (*states, None if gate is None else gate.view(batch, seq, -1))


def _bf16_projection(module, layer, x, dtype):
    """(qk [T, Hq + Hkv, D], v [T, Hkv, D] or None, gate [T, Hq*D] or None) in `dtype`: qk from
    one GEMM against the concatenated q and k weight rows (transformers_families.weight_blocks: a
    gated query's query rows), whose whole output qk_norm_rope reads, and v and a gated query's
    gate from GEMMs of their own, never column slices of a wider output (module docstring, "The
    Q/K layout"); or the projections called as modules and a cat of q and k, where that copies
    less (_concatenate_weights) or they are not plain nn.Linear. attention_k_eq_v: v is a view of
    qk's key rows; a KV-shared layer: qk holds the query heads alone, v is None."""
    tokens = x.shape[0]
    d = layer.head_dim
    spec = layer.spec
    heads = layer.q_heads + layer.kv_heads
    blocks = families.weight_blocks(module, spec, fp8=False) if layer.plain else None
    if blocks is not None and _concatenate_weights(blocks[0], x, dtype):
        qk_rows, v_rows = blocks
        qk_bias, v_bias = families.weight_blocks(module, spec, fp8=False, bias=True)
        qk = _linear(x, qk_rows, qk_bias, dtype).view(tokens, heads, d)
        v = _linear(x, v_rows, v_bias, dtype).view(tokens, -1, d) if v_rows else None
        gate = _linear(x, families.gate_blocks(module, spec),
                       families.gate_blocks(module, spec, bias=True), dtype) if (
            spec.gated) else None
    else:
        q = module.q_proj(x).to(dtype)
        gate = None
        if spec.gated:
            q = q.view(tokens, layer.q_heads, 2 * d)
            q, gate = q[..., :d], q[..., d:].reshape(tokens, -1)
        q = q.view(tokens, layer.q_heads, d)
        if spec.kv_shared:
            return q, None, gate  # a query-only call reads q (a strided view when gated) as is
        k = module.k_proj(x).to(dtype).view(tokens, layer.kv_heads, d)
        qk = torch.cat((q, k), dim=1)
        v = None if spec.k_eq_v else module.v_proj(x).to(dtype).view(tokens, layer.kv_heads, d)
    if spec.k_eq_v:
        v = qk[:, layer.q_heads:]  # V is the key projection before k_norm
    return qk, None if spec.kv_shared else v, gate


def _concatenate_weights(qk_rows, x, dtype) -> bool:
    """Whether qk comes from one GEMM against the concatenated q and k weight rows rather than
    from a cat of the projections' outputs: weights cast to the compute dtype are copied either
    way; otherwise the weight copy (Fqk x C) is the smaller from T >= C (module docstring)."""
    tokens, channels = x.shape
    return tokens >= channels or any(w.dtype != dtype for w in qk_rows)


def _linear(x, blocks, bias_blocks, dtype):
    """x @ W^T + b for W the blocks' rows in order (_packed_weight) and b their biases (None
    where the projections have none), in `dtype`."""
    weight = _packed_weight(blocks, dtype)
    bias = None
    if any(b is not None for b in bias_blocks):
        bias = torch.cat([x.new_zeros(w.numel() // w.shape[-1], dtype=dtype) if b is None
                          else b.reshape(-1).to(dtype) for w, b in zip(blocks, bias_blocks)])
    return F.linear(x, weight, bias)


def _fp8_projection(module, layer, x, norms):
    """(q, k, v, gate) through packed_fp8_qkv_current_scaling: x, the weight and the gradient
    scaled from this call's own tensors (module docstring). Traceable: no Python state between
    calls. The op's weight is the layer's packed [Q | K | V] rows (transformers_families.
    weight_blocks: a gated query's query rows of q_proj, k_proj's rows twice for k_eq_v, Q alone
    for a KV-shared layer). A gated query's gate is a bf16 GEMM of its own over q_proj's gate
    rows: the op's columns are Q, K and V only."""
    spec = layer.spec
    sharded = [f"{name}.weight" for name in ("q_proj", "k_proj", "v_proj")
               if _is_dtensor(getattr(getattr(module, name, None), "weight", None))]
    if sharded:
        raise RuntimeError(
            f"qkvfuse: fp8=True: {layer.where}: {', '.join(sharded)} "
            f"{'is a DTensor' if len(sharded) == 1 else 'are DTensors'} (sharded) in this "
            f"forward; the FP8 weight is quantized from the full weights, which FSDP gathers "
            f"around the forward of the module fully_shard was applied to (call the model, or "
            f"that module, not the attention module alone). Tensor-parallel plans that shard "
            f"q_proj/k_proj/v_proj are not supported with fp8=True")
    bf16 = torch.bfloat16
    x = x.to(bf16)
    qk_rows, v_rows = families.weight_blocks(module, spec, fp8=True)
    q, k, v = qkvfuse.packed_fp8_qkv_current_scaling(
        x, _packed_weight(qk_rows + v_rows, bf16), layer.q_heads, layer.head_dim,
        qkv_scale=layer.state.one(x.device), **norms)
    # No bias here: fp8=True refuses q/k/v biases (_check_module).
    gate = F.linear(x, _packed_weight(families.gate_blocks(module, spec), bf16)) if (
        spec.gated) else None
    return q, k, v, gate


class _CastCat(torch.autograd.Function):
    """torch.cat([weights[i].to(dtype) for i in order]) in one pass over the weights: a cast and
    then a cat would write the copy twice and read it once more (under autocast the master
    weights are float32: 10 bytes per element instead of 6). Each weight is [rows, C] or
    [heads, rows, C] (a strided view, e.g. a gated query's query rows of q_proj): its rows in
    order. A weight may appear in `order` more than once (k_eq_v's key rows, also its V rows): it
    is passed once, since torch.compile cannot trace an autograd.Function given the same tensor
    twice, and its gradient is the sum of its parts'."""

    @staticmethod
    def forward(ctx, dtype, order, *weights):
        columns = weights[0].shape[-1]
        rows = [weights[i].numel() // columns for i in order]
        out = weights[0].new_empty((sum(rows), columns), dtype=dtype)
        for part, i in zip(out.split(rows), order):
            part.view(weights[i].shape).copy_(weights[i])
        ctx.order, ctx.rows = order, rows
        ctx.shapes = [w.shape for w in weights]
        ctx.dtypes = [w.dtype for w in weights]
        return out

    @staticmethod
    def backward(ctx, grad):
        grads = [None] * len(ctx.shapes)
        for part, i in zip(grad.split(ctx.rows), ctx.order):
            part = part.view(ctx.shapes[i])
            grads[i] = part if grads[i] is None else grads[i] + part
        return (None, None, *(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes)))


def _packed_weight(blocks, dtype) -> torch.Tensor:
    """The blocks' rows (e.g. [Wq; Wk; Wv]: transformers_families.weight_blocks) as one [F, C]
    in `dtype`, differentiable in the weights. One [F, C] block is the weight itself (cast when
    its dtype differs, as autocast would: no copy otherwise)."""
    if len(blocks) == 1 and blocks[0].dim() == 2:
        return blocks[0].to(dtype)
    weights, order = [], []
    for block in blocks:
        index = next((i for i, w in enumerate(weights) if w is block), None)
        if index is None:
            index = len(weights)
            weights.append(block)
        order.append(index)
    return _CastCat.apply(dtype, tuple(order), *weights)


def cache_update(module, cache, key_states, value_states, kwargs):
    """The KV cache's update as the class's own forward calls it: transformers >= 5.24 hands the
    call's keyword arguments to it (the layer's cache_kwargs)."""
    if module._qkvfuse.cache_kwargs:
        return cache.update(key_states, value_states, module.layer_idx, kwargs=kwargs)
    return cache.update(key_states, value_states, module.layer_idx)


def _patched_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                     past_key_values=None, **kwargs):
    """The family's attention forward with q, k, v from attention_input; the rest as written in
    transformers (the Qwen3/Gemma3/Llama/Mistral forwards differ only in sliding_window). The KV
    cache arrives as past_key_values (transformers < 5.24) or cache (5.24 on)."""
    layer = self._qkvfuse
    cache = kwargs.pop("cache", None) if past_key_values is None else past_key_values
    input_shape = hidden_states.shape[:-1]
    query_states, key_states, value_states, gate = attention_states(self, hidden_states,
                                                                    position_embeddings)

    if cache is not None:
        key_states, value_states = cache_update(self, cache, key_states, value_states, kwargs)

    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                layer.eager)
    if layer.family.sliding == "module":
        kwargs["sliding_window"] = self.sliding_window
    elif layer.family.sliding == "config":
        kwargs["sliding_window"] = getattr(self.config, "sliding_window", None)
    attn_output, attn_weights = attention_interface(
        self,
        query_states,
        key_states,
        value_states,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **kwargs,
    )

    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    if gate is not None:
        attn_output = attn_output * torch.sigmoid(gate)  # Qwen3-Next / Qwen3.5's gated query
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights


# ---- the public calls ----------------------------------------------------------------------------

def apply_qkvfuse(model: nn.Module, fp8: bool = False) -> nn.Module:
    """Patches every attention module of `model` (a transformers model of a supported family,
    e.g. Qwen3ForCausalLM, or any module containing their attention modules) in place, and
    returns it. fp8=False: projections in the model's (or autocast's) dtype, then one
    qk_norm_rope per layer; fp8=True: one packed_fp8_qkv_current_scaling per layer (module
    docstring). Calling it again re-patches with the new setting. Raises UnsupportedModelError,
    naming the model's class, for a model with no supported attention module or with any other
    attention module, and naming the module and the setting for what it cannot match (q/k norms,
    head widths, FP8's requirements), or the pieces of a family's code in the installed
    transformers that differ from the versions it was tested with (transformers_sources.py)."""
    if getattr(model, "_qkvfuse_state", None) is not None:
        remove_qkvfuse(model)
    found, unsupported = [], []
    for name, module in model.named_modules():
        family = _family_of(module)
        if family is not None:
            found.append((name, module, family))
        elif _looks_like_attention(module):
            unsupported.append(f"{name or '<root>'}: {type(module).__name__}")
    model_name = type(model).__name__
    if unsupported or not found:
        what = (f"its attention modules {', '.join(unsupported[:4])}"
                f"{' ...' if len(unsupported) > 4 else ''} are not supported" if unsupported
                else "it has no attention module qkvfuse supports")
        raise UnsupportedModelError(
            f"qkvfuse.apply_qkvfuse: {model_name} is not supported: {what}. Supported attention "
            f"classes: {', '.join(SUPPORTED)}")
    # The families' code in the installed transformers must be code the tests passed on: one the
    # patched forward does not know could compute something else (transformers_sources.py).
    for family in dict.fromkeys(family for _, _, family in found):
        sources.check(family, f"qkvfuse.apply_qkvfuse: {model_name}", UnsupportedModelError)
    state = _ModelState(fp8)
    layers = []
    for name, module, family in found:
        layer = _Layer(module, family, state, fp8,
                       f"qkvfuse.apply_qkvfuse: {model_name}: {name} ({type(module).__name__})")
        _check_module(module, layer)
        layers.append(layer)
    for (_, module, family), layer in zip(found, layers):
        module._qkvfuse = layer
        own = getattr(family, "forward", None)  # Gemma 4's (transformers_families.FORWARDS)
        forward = families.FORWARDS[own] if own else _patched_forward
        module.forward = types.MethodType(forward, module)
    model._qkvfuse_state = state
    return model


def remove_qkvfuse(model: nn.Module) -> nn.Module:
    """Undoes apply_qkvfuse: every patched attention module runs its class's forward again."""
    for module in model.modules():
        if "_qkvfuse" in module.__dict__:
            del module.__dict__["_qkvfuse"]
            module.__dict__.pop("forward", None)
    model.__dict__.pop("_qkvfuse_state", None)
    return model


def _check_module(module, layer):
    where = layer.where
    spec = layer.spec
    q_heads, kv_heads, d = layer.q_heads, layer.kv_heads, layer.head_dim
    if d % 2 or not 2 <= d <= 512:
        raise UnsupportedModelError(f"{where}: head_dim {d}: qkvfuse needs an even head width "
                                    f"from 2 to 512")
    if kv_heads and q_heads % kv_heads:
        raise UnsupportedModelError(f"{where}: {kv_heads} key/value heads do not divide "
                                    f"{q_heads} query heads")
    # A gated query's q_proj yields [H, 2D] (query and gate lanes).
    widths = {"q_proj": q_heads * d * (2 if spec.gated else 1), "k_proj": kv_heads * d,
              "v_proj": kv_heads * d}
    for p in families.projections(module, spec):
        proj = next(n for n in widths if getattr(module, n, None) is p)
        out = getattr(p, "out_features", None)
        if out is not None and out != widths[proj]:
            raise UnsupportedModelError(f"{where}: {proj} has {out} outputs, expected "
                                        f"{widths[proj] // d} x {d}")
    if layer.normalize:
        _qk_norms(module, layer)  # raises, naming the setting, for norms qkvfuse cannot read
    families.check_layer(where, spec, layer.family, UnsupportedModelError)
    if "forward" in module.__dict__:
        raise UnsupportedModelError(f"{where}: its forward is already replaced on the instance "
                                    f"by something else")
    fp8 = layer.fp8
    if fp8:
        projections = families.projections(module, spec)
        others = [(name, p) for name, p in zip(("q_proj", "k_proj", "v_proj"), projections)
                  if type(p) is not nn.Linear]
        if others:
            lora = " (a PEFT LoRA adapter layer)"
            kinds = "; ".join(f"{name} is {_qualified(type(p))}{lora if _is_lora(p) else ''}"
                              for name, p in others)
            merge = (", or merge the LoRA adapters into the weights first (merge_and_unload())"
                     if any(_is_lora(p) for _, p in others) else "")
            raise UnsupportedModelError(
                f"{where}: fp8=True needs q_proj, k_proj and v_proj to be plain torch.nn.Linear "
                f"(the packed FP8 op reads their weights, not their forward): {kinds}. Use "
                f"fp8=False, which calls them as modules{merge}")
        if any(p.bias is not None for p in projections):
            raise UnsupportedModelError(f"{where}: fp8=True: the packed FP8 op has no q/k/v bias "
                                        f"(attention_bias=True); use fp8=False")
        channels = module.q_proj.in_features
        qk_rows, v_rows = families.weight_blocks(module, spec, fp8=True)
        packed = sum(w.numel() // w.shape[-1] for w in qk_rows + v_rows)
        if channels % FP8_MULTIPLE or packed % FP8_MULTIPLE:
            raise UnsupportedModelError(
                f"{where}: fp8=True needs hidden_size ({channels}) and the packed q/k/v width "
                f"{packed} to be multiples of {FP8_MULTIPLE} (cuBLASLt FP8)")


def _is_lora(projection) -> bool:
    """PEFT's LoRA layers (peft.tuners.lora) carry their adapters as lora_A / lora_B."""
    return hasattr(projection, "lora_A") and hasattr(projection, "lora_B")
