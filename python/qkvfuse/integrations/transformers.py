"""Hugging Face transformers models through qkvfuse, with one call.

    from qkvfuse.integrations.transformers import apply_qkvfuse
    model = AutoModelForCausalLM.from_config(config)   # or from_pretrained(...)
    apply_qkvfuse(model)              # q/k norm + rotary: one qkvfuse.qk_norm_rope per layer
    apply_qkvfuse(model, fp8=True)    # and the q/k/v projections: qkvfuse.packed_fp8_qkv

Supported (the attention modules' classes, matched exactly; SPEC.md section 8 has the math):

| family | attention class | per-head norm | qkvfuse layout |
| --- | --- | --- | --- |
| Qwen3 | Qwen3Attention | RMS * w (Qwen3RMSNorm) | NeoX, GQA, q/k weights, eps of the norm |
| Qwen3-MoE (attention only) | Qwen3MoeAttention | RMS * w (Qwen3MoeRMSNorm) | as Qwen3 |
| Gemma 3 (text) | Gemma3Attention | RMS * (1 + w) (Gemma3RMSNorm) | as Qwen3, weight_offset 1 |
| Llama | LlamaAttention | none | NeoX, GQA, normalize=False |
| Mistral | MistralAttention | none | as Llama |

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

What changes. apply_qkvfuse replaces, on each attention module *instance*, the bound method
`forward` (an instance attribute: the class, other models and other instances are untouched;
remove_qkvfuse(model) deletes it again). The new forward computes q, k and v as below, then runs
the rest of the library's forward as it is written there: the KV cache update (past_key_values,
named cache in later 5.x: the class's own signature decides), the attention function the config
selects (ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation), else the family's
own eager_attention_forward), with the same dropout, scaling, sliding window and keyword
arguments, and o_proj. No parameter, buffer or state-dict key is added, renamed or changed: a
patched model saves and loads like an unpatched one, and load_state_dict / from_pretrained
weights are used as they are.

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
- one GEMM against the concatenated weight torch.cat([Wq; Wk; Wv]) (cast to the compute dtype
  first, as autocast would): qk and v are then column views of one [T, F] output, with no copy of
  the activations; the extra traffic is one copy of the (Hq + 2 Hkv) * D x C weight per forward.
- three projections and torch.cat of the q and k outputs into [T, Hq + Hkv, D]: one copy of
  T * (Hq + Hkv) * D activations.
The first is cheaper when T * (Hq + Hkv) * D >= (Hq + 2 Hkv) * D * C, i.e. once T is about C or
more: every training step (T = batch x sequence is thousands of tokens), while generate's decode
steps (T = batch) take the second. Measured on the project's shared 2-core CPU (float32,
C = 768, Hq = 12, Hkv = 4, D = 128, T = 2048, forward + backward of the projections and the cat,
median of 7 runs, 3 interleaved rounds each): three projections + activation cat 787-844 ms,
weight cat + one GEMM 542-784 ms, the one GEMM faster in every round. Projections that are not
plain nn.Linear (e.g. PEFT's LoRA layers, quantized linears) are always called as modules, with
the activation cat.

FP8 (fp8=True). Each layer's q/k/v projection runs through qkvfuse.packed_fp8_qkv as
examples/train_gpt.py runs it:
- weights: an e4m3 copy of each layer's packed [Wq; Wk; Wv] with its current scale amax/448,
  quantized for all layers of one shape in one qkvfuse.quantize_weight_bank call. It is refreshed
  lazily, before the first forward that follows any change of those weights: each layer compares
  its three weights' autograd version counters (which every in-place update bumps: optimizer
  steps, load_state_dict, copy_) and data pointers (a .to() or an assigned state dict) with those
  the cache was built from. So the usual loop needs no extra call: optimizer.step() changes the
  weights, and the next forward re-quantizes every layer once (refresh_fp8_weights(model) does
  it eagerly).
  Under FSDP (fully_shard per decoder layer, or on the whole model) a layer's weights are shards
  between forwards and full only inside the forward of the module fully_shard wraps, gathered
  anew each time: such layers keep no cache and quantize their full weights in each call (one
  quantize_weight_bank per layer and forward; the activation and gradient are as below). The
  ranks therefore quantize the same full weights, and an optimizer step on the shards is seen
  by the next forward.
- the activation: the attention's input x (bf16) is quantized once, to x_f8 [T, C] and its
  transpose, shared by the Q, K and V columns of the one FP8 GEMM, with current scaling:
  x_scale = max|x| / 448 (one extra read of x, no host synchronization). HF's input norm
  multiplies by a learned weight, so the speedrun's fixed bound sqrt(C)/448 does not hold here.
- the gradient: grad_scale = 4 * max(|grad q|, |grad k|, |grad v|) / 448 of this call, set by
  one hook on the three gradients before the op's backward reads it (current scaling: a fixed scale
  lets small gradients round to zero in e4m3, docs/training/README.md).
- the master weights receive their gradients in their own dtype (fp32 under autocast), and so do
  the q/k norm weights (from the fused backward).
FP8 computes in bf16 (its q, k and v are cast back to the activations' dtype: a float32 model
without autocast runs too, on the CPU), and needs no q/k/v bias and C and the packed width
(Hq + 2 Hkv) * D multiples of 16 (cuBLASLt FP8), which apply_qkvfuse checks. A call whose token
count T = batch x sequence is not a multiple of 16 (generate's decode steps, odd batches) runs
the bf16 path for that call: same weights, no FP8 GEMM.

Numerics. HF rounds to the activation dtype between steps (the normalized row before the weight,
each product of the rotary); qkvfuse rounds once, so the patched bf16 model differs from the
unpatched one by a few bf16 roundings of q and k per layer (SPEC.md section 8), and is the
closer of the two to the exact value. On the CPU the patched path also runs float32 and float64
models (equal to the unpatched model to that precision); on CUDA qkvfuse needs bf16 activations.

torch.compile: the bf16 path traces into one graph (fullgraph=True works); the FP8 projection
runs eagerly between compiled graphs (torch.compiler.disable: the cache's version checks and the
per-call gradient hooks are Python), the rest of the layer compiles. Tested with the aot_eager
backend on the CPU.

Tested on the CPU (tests/python/test_transformers_integration.py): every family, GQA/MHA/MQA,
packed sequences, rope scalings, generate, save/load, gradient checkpointing, compile; DDP and
FSDP2 (fully_shard per decoder layer, two processes over gloo: tests/python/
test_transformers_fsdp.py, and examples/train_hf.py under torchrun, tests/python/
test_train_distributed.py; NCCL on GPUs). Not covered: pickling a patched model object (its
forward is a bound method: save the state dict, as save_pretrained does), and tensor or pipeline
parallel plans that shard q_proj/k_proj/v_proj (fp8=True refuses a DTensor weight by name).
"""
import inspect
import sys
import types
import weakref
from typing import List, NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import qkvfuse
from qkvfuse._layout import DEFAULT_EPS

from . import transformers_families as families

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
           "attention_states", "fp8_refresh_count", "refresh_fp8_weights", "remove_qkvfuse"]

E4M3_MAX = 448.0
# Headroom of the gradient scale over max |grad q, k, v|: the norm's backward can grow a row's
# gradient beyond its input's (examples/train_gpt.py uses the same).
GRAD_HEADROOM = 4.0
# Never a zero scale: it would saturate every e4m3 code (docs/special_values.md).
MIN_SCALE = 2.0**-100
# cuBLASLt FP8 GEMMs need M, N and K multiples of 16 (include/qkvfuse/packed_qkv.hpp).
FP8_MULTIPLE = 16


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


# ---- the per-model state: the FP8 weight cache and the rotary caches of one forward -------------

class _Fp8Weights:
    """The e4m3 packed [Wq; Wk; Wv] of every patched layer: a qkvfuse.PackedWeightCache over the
    layers' (Wq, Wk, Wv), rebuilt when the weights move and refreshed when they change (see the
    module docstring). Layers whose projections FSDP manages are not cached: get() quantizes
    them in every call, from the full weights FSDP has gathered for the forward (_fsdp_managed)."""

    def __init__(self, modules: List[nn.Module]):
        self._modules = modules
        self._layout = None   # per cached layer: its index, then (data pointer, device, dtype,
        #                       shape) of each weight
        self._seen = None     # layer index -> the version counters the entry was quantized from
        self._slot = {}       # layer index -> its position in self._cache
        self._cache = None
        self.refreshes = 0    # how many times the cache (or an FSDP layer) was quantized

    def _weights(self, i):
        """The row blocks of layer i's packed [Q | K | V] weight (q_proj, k_proj, v_proj's
        weights; their query rows only for a gated query, and so on: weight_blocks)."""
        m = self._modules[i]
        qk, v = families.weight_blocks(m, m._qkvfuse.spec, fp8=True)
        # Detached: the cache copies from them under no_grad, and a model holding row views of
        # its parameters made there could not be deep-copied (the views share the parameters'
        # storage and version counters either way).
        return tuple(w.detach() for w in qk + v)

    @staticmethod
    def _versions(weights):
        return tuple(w._version for w in weights) + tuple(w.data_ptr() for w in weights)

    def get(self, i: int) -> qkvfuse.PackedWeight:
        """Layer i's weight: quantized now if FSDP manages it, else the cached entry, refreshed
        first if any cached layer's weights changed since."""
        if _fsdp_managed(self._modules[i]):
            return self._quantize_layer(i)
        if self._seen is None or i not in self._seen or (
                self._versions(self._weights(i)) != self._seen[i]):
            self.refresh()
        return self._cache[self._slot[i]]

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-quantizes every cached layer (those FSDP does not manage) in one bank per shape."""
        resident = [i for i in range(len(self._modules))
                    if not _fsdp_managed(self._modules[i])]
        if not resident:
            return  # every layer is quantized per call: nothing is cached between forwards
        weights = [self._weights(i) for i in resident]
        layout = [(i,) + tuple((w.data_ptr(), w.device, w.dtype, tuple(w.shape)) for w in ws)
                  for i, ws in zip(resident, weights)]
        if layout != self._layout:
            self._cache = qkvfuse.PackedWeightCache(weights)  # quantizes once
            self._layout = layout
            self._slot = {i: slot for slot, i in enumerate(resident)}
        else:
            self._cache.refresh()
        self._seen = {i: self._versions(ws) for i, ws in zip(resident, weights)}
        self.refreshes += 1

    @torch.no_grad()
    def _quantize_layer(self, i: int) -> qkvfuse.PackedWeight:
        """Layer i's packed weight quantized from its weights as they are now: inside the
        layer's forward under FSDP, the full (all-gathered) weights."""
        module = self._modules[i]
        sharded = [f"{name}.weight" for name in ("q_proj", "k_proj", "v_proj")
                   if _is_dtensor(getattr(getattr(module, name, None), "weight", None))]
        if sharded:
            raise RuntimeError(
                f"qkvfuse: fp8=True: {type(module).__name__} layer {i}: "
                f"{', '.join(sharded)} {'is a DTensor' if len(sharded) == 1 else 'are DTensors'} "
                f"(sharded) in this forward; the FP8 weight is quantized from the full weights, "
                f"which FSDP gathers around the forward of the module fully_shard was applied to "
                f"(call the model, or that module, not the attention module alone). "
                f"Tensor-parallel plans that shard q_proj/k_proj/v_proj are not supported with "
                f"fp8=True")
        bank = torch.cat([w.to(torch.bfloat16) for w in self._weights(i)])[None]
        row, t, scale = qkvfuse.quantize_weight_bank(bank)
        self.refreshes += 1
        return qkvfuse.PackedWeight(row[0], t[0], scale[0])


def _fsdp_managed(attention: nn.Module) -> bool:
    """Whether FSDP manages the attention module's q/k/v projections. fully_shard (FSDP2; FSDP1
    as well) marks every module whose parameters it manages with _is_fsdp_managed_module (the
    flag torch.compile reads). Such a weight is not one tensor over time: between forwards the
    module holds a DTensor shard, and around the forward of the module fully_shard was applied to
    FSDP swaps in the full weight, gathered anew into storage it frees again afterwards, and
    gathers it without bumping its version counter. The cache's key (version counters and data
    pointers) can therefore not tell an updated weight from a stale one (a caching allocator
    may hand the freed block back at the same address), and a bank of every layer cannot be built
    while the other layers hold shards. Such layers are quantized in each call instead: one more
    read of a weight that FSDP has just gathered, from the full weight, never from a shard."""
    return any(getattr(getattr(attention, name, None), "_is_fsdp_managed_module", False)
               for name in ("q_proj", "k_proj", "v_proj"))


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return _DTensor is not None and isinstance(tensor, _DTensor)


class _ModelState:
    """Shared by the patched layers of one model."""

    def __init__(self, modules: List[nn.Module], fp8: bool):
        self.modules = modules
        self.fp8 = fp8
        self.weights = _Fp8Weights(modules) if fp8 else None
        self._rope = {}   # (id(cos), id(sin), B, S) -> (weakref cos, weakref sin, cos_sin, pos)
        self._ones = {}   # device -> float32 1.0 (packed_fp8_qkv's qkv_scale)

    def one(self, device) -> torch.Tensor:
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

    def __init__(self, module, family, state, index, fp8):
        self.family = family
        self.state = state
        self.index = index
        self.fp8 = fp8
        # What the module computes before its attention function (transformers_families.py).
        self.spec = spec = _spec_of(module, family)
        self.q_heads = spec.q_heads
        self.kv_heads = spec.kv_heads
        self.head_dim = spec.head_dim
        self.normalize = spec.normalize
        self.eps = _norm_eps(spec.q_norm) if self.normalize else DEFAULT_EPS
        if spec.v_norm is not None and not self.normalize:
            self.eps = _norm_eps(spec.v_norm)
        self.eager = sys.modules[type(module).__module__].eager_attention_forward
        # transformers >= 5.2x names the KV cache `cache` (past_key_values before) and hands the
        # call's keyword arguments to its update: the patched forward does what the class does.
        self.cache_kwargs = "cache" in inspect.signature(type(module).forward).parameters
        projections = families.projections(module, spec)
        self.plain = all(type(p) is nn.Linear for p in projections)
        self.bias = self.plain and any(p.bias is not None for p in projections)

    @property
    def qk_features(self):
        return (self.q_heads + self.kv_heads) * self.head_dim

    @property
    def features(self):
        """Output features of the one bf16 GEMM: Q, K, V (none for k_eq_v: V is K's rows) and
        the gate."""
        v_heads = 0 if self.spec.k_eq_v else self.kv_heads
        gate = self.q_heads if self.spec.gated else 0
        return (self.q_heads + self.kv_heads + v_heads + gate) * self.head_dim


def _spec_of(module, family):
    describe = getattr(family, "describe", None)
    return describe(module) if describe is not None else families.legacy_spec(module, family)


_norm_eps = families.norm_eps


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
                 norm_scope=spec.norm_scope)
    if spec.rotary:
        cos, sin = position_embeddings
        norms["cos_sin"], norms["positions"] = layer.state.rope(cos, sin, batch, seq,
                                                                layer.head_dim, accept)
    if layer.normalize:
        weights = spec.q_norm.weight, None if spec.kv_shared else spec.k_norm.weight
        norms.update(zip(("q_weight", "k_weight"),
                         (w if w is None or w.dtype in accept else w.float() for w in weights)),
                     weight_offset=layer.family.weight_offset, eps=layer.eps)
    if spec.v_norm is not None:
        norms.update(normalize_v=True, eps=layer.eps)
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
    """(qk [T, Hq + Hkv, D], v [T, Hkv, D] or None, gate [T, Hq*D] or None) in `dtype`: one GEMM
    against the concatenated weight rows (transformers_families.weight_blocks: a gated query's
    query rows first, its gate rows last), or the projections called as modules and a cat of q and
    k, whichever copies less (module docstring). attention_k_eq_v: v is a view of qk's key rows;
    a KV-shared layer: qk holds the query heads alone, v is None."""
    spec = layer.spec
    tokens = x.shape[0]
    d = layer.head_dim
    heads = layer.q_heads + layer.kv_heads
    if layer.plain and tokens * layer.qk_features >= layer.features * x.shape[1]:
        qk_rows, v_rows = families.weight_blocks(module, spec, fp8=False)
        gate_rows = families.gate_blocks(module, spec)
        weight = torch.cat([w.to(dtype) for w in qk_rows + v_rows + gate_rows])
        bias = None
        if layer.bias:
            qk_bias, v_bias = families.weight_blocks(module, spec, fp8=False, bias=True)
            bias = torch.cat([b.to(dtype) for b in qk_bias + v_bias +
                              families.gate_blocks(module, spec, bias=True)])
        out = F.linear(x, weight, bias)
        qk = out[:, :layer.qk_features].view(tokens, heads, d)
        v_features = sum(w.shape[0] for w in v_rows)
        v = out[:, layer.qk_features:layer.qk_features + v_features].view(tokens, -1, d)
        gate = out[:, layer.qk_features + v_features:] if spec.gated else None
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


@torch.compiler.disable
def _fp8_projection(module, layer, x, norms):
    """(q, k, v, gate) through packed_fp8_qkv, with current scaling of x and of the gradient.
    Runs eagerly under torch.compile (a graph break): the cache's version checks and the
    per-call gradient hooks are Python. A gated query's gate is the module's own projection
    (its rows of q_proj) in bf16: the packed op's features are Q, K and V."""
    bf16 = torch.bfloat16
    x = x.to(bf16)
    detached = x.detach()
    # Outside autocast, whose CUDA policy would reduce linalg_vector_norm in float32 (a cast).
    with torch.autocast(x.device.type, enabled=False):
        amax = torch.linalg.vector_norm(detached, float("inf")).float()
    x_scale = torch.clamp_min(amax, MIN_SCALE) / E4M3_MAX
    x_f8, x_f8_t = qkvfuse.quantize_dual_layout(detached, x_scale)
    cached = layer.state.weights.get(layer.index)
    qk_rows, v_rows = families.weight_blocks(module, layer.spec, fp8=True)
    qk_weight = torch.cat([w.to(bf16) for w in qk_rows])
    v_weight = (torch.cat([w.to(bf16) for w in v_rows]) if v_rows
                else x.new_empty((0, x.shape[1])))
    # This call's gradient scale, set by the hook below before the op's backward reads it: the
    # hook runs once the gradients of q, k and v have arrived, and the backward needs them first.
    grad_scale = torch.empty((), dtype=torch.float32, device=x.device)
    q, k, v = qkvfuse.packed_fp8_qkv(
        x, qk_weight, v_weight, cached.weight_f8, cached.weight_f8_t, cached.weight_scale,
        layer.state.one(x.device), x_scale, grad_scale, None, None, layer.q_heads, False, False,
        None, x_f8, x_f8_t, **norms)
    if q.requires_grad:
        # A per-call (not per-module) scale: correct with gradient accumulation, checkpointing
        # or several forwards before one backward. One hook for the three gradients: a third of
        # the Python calls and half the kernel launches of one hook per tensor.
        torch.autograd.graph.register_multi_grad_hook((q, k, v), _grad_scale_hook(grad_scale))
    gate = None
    if layer.spec.gated:
        gate_bias = families.gate_blocks(module, layer.spec, bias=True) if layer.bias else None
        gate = F.linear(x, torch.cat([w.to(bf16) for w in families.gate_blocks(
            module, layer.spec)]), torch.cat([b.to(bf16) for b in gate_bias]) if gate_bias else None)
    return q, k, v, gate


def _grad_scale_hook(grad_scale):
    """grad_scale = GRAD_HEADROOM * max |grad| / E4M3_MAX over the gradients of q, k and v (those
    that arrive: an unused output has none), never below MIN_SCALE."""
    @torch.no_grad()
    def hook(grads):
        present = [g.detach() for g in grads if g is not None]
        amax = torch.stack(torch._foreach_norm(present, float("inf"))).amax().float()
        torch.clamp_min(amax * (GRAD_HEADROOM / E4M3_MAX), MIN_SCALE, out=grad_scale)
    return hook


def _patched_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                     past_key_values=None, **kwargs):
    """The family's attention forward with q, k, v from attention_input; the rest as written in
    transformers (the Qwen3/Gemma3/Llama/Mistral forwards differ only in sliding_window). The KV
    cache arrives as past_key_values (transformers 5.17) or cache (later 5.x)."""
    layer = self._qkvfuse
    cache = kwargs.pop("cache", None) if past_key_values is None else past_key_values
    input_shape = hidden_states.shape[:-1]
    query_states, key_states, value_states, gate = attention_states(self, hidden_states,
                                                                    position_embeddings)

    if cache is not None:
        if layer.cache_kwargs:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx,
                                                    kwargs=kwargs)
        else:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)

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
    qk_norm_rope per layer; fp8=True: one packed_fp8_qkv per layer (module docstring). Calling it
    again re-patches with the new setting. Raises UnsupportedModelError, naming the model's class,
    for a model with no supported attention module or with any other attention module."""
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
    for name, module, family in found:
        _check_module(model_name, name, module, family, fp8)
    modules = [module for _, module, _ in found]
    state = _ModelState(modules, fp8)
    for index, (_, module, family) in enumerate(found):
        module._qkvfuse = _Layer(module, family, state, index, fp8)
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


def refresh_fp8_weights(model: nn.Module) -> int:
    """Re-quantizes the FP8 weight cache of a model patched with fp8=True now (the patched
    forward does it by itself after any change of the q/k/v weights). Returns how many times the
    cache has been quantized, this time included. Layers under FSDP keep no cache (their forward
    quantizes the gathered weights in each call): they are left out, and a model whose every
    layer is under FSDP has nothing to refresh."""
    state = _state(model)
    if state.weights is None:
        raise ValueError("qkvfuse.refresh_fp8_weights: the model was patched with fp8=False")
    state.weights.refresh()
    return state.weights.refreshes


def fp8_refresh_count(model: nn.Module) -> int:
    """How many times the FP8 weight cache of `model` has been quantized (0 before the first
    forward): e.g. to check that it follows the optimizer steps. A layer under FSDP adds one per
    forward call (it quantizes its gathered weights in each call)."""
    state = _state(model)
    return 0 if state.weights is None else state.weights.refreshes


def _state(model):
    state = getattr(model, "_qkvfuse_state", None)
    if state is None:
        raise ValueError(f"qkvfuse: {type(model).__name__} is not patched (apply_qkvfuse)")
    return state


def _check_module(model_name, name, module, family, fp8):
    where = f"qkvfuse.apply_qkvfuse: {model_name}: {name} ({type(module).__name__})"
    spec = _spec_of(module, family)
    q_heads, kv_heads, d = spec.q_heads, spec.kv_heads, spec.head_dim
    if d % 2 or not 2 <= d <= 512:
        raise UnsupportedModelError(f"{where}: head_dim {d}: qkvfuse needs an even head width "
                                    f"from 2 to 512")
    if kv_heads and q_heads % kv_heads:
        raise UnsupportedModelError(f"{where}: {kv_heads} key/value heads do not divide "
                                    f"{q_heads} query heads")
    widths = {"q_proj": q_heads * d * (2 if spec.gated else 1), "k_proj": kv_heads * d,
              "v_proj": kv_heads * d}
    for p in families.projections(module, spec):
        proj = next(n for n in widths if getattr(module, n, None) is p)
        out = getattr(p, "out_features", None)
        if out is not None and out != widths[proj]:
            raise UnsupportedModelError(f"{where}: {proj} has {out} outputs, expected "
                                        f"{widths[proj] // d} x {d}")
    if family.norm is not None and not hasattr(family, "describe"):
        for norm in ("q_norm", "k_norm"):
            cls = type(getattr(module, norm, None)).__name__
            if cls != family.norm:
                raise UnsupportedModelError(f"{where}: {norm} is {cls}, expected the family's "
                                            f"{family.norm} (another patch applied first?)")
    families.check_layer(where, module, spec, family, fp8, UnsupportedModelError)
    if "forward" in module.__dict__:
        raise UnsupportedModelError(f"{where}: its forward is already replaced on the instance "
                                    f"by something else")
    if fp8:
        projections = families.projections(module, spec)
        if not all(type(p) is nn.Linear for p in projections):
            kinds = ", ".join(type(p).__name__ for p in projections)
            raise UnsupportedModelError(f"{where}: fp8=True needs q_proj, k_proj and v_proj to be "
                                        f"plain nn.Linear, got {kinds}")
        if any(p.bias is not None for p in projections):
            raise UnsupportedModelError(f"{where}: fp8=True: the packed FP8 op has no q/k/v bias "
                                        f"(attention_bias=True); use fp8=False")
        channels = module.q_proj.in_features
        qk_rows, v_rows = families.weight_blocks(module, spec, fp8=True)
        packed = sum(w.shape[0] for w in qk_rows + v_rows)
        if channels % FP8_MULTIPLE or packed % FP8_MULTIPLE:
            raise UnsupportedModelError(
                f"{where}: fp8=True needs hidden_size ({channels}) and the packed q/k/v width "
                f"{packed} to be multiples of {FP8_MULTIPLE} (cuBLASLt FP8)")
