"""The rope layout, output shapes and the views cut from the packed ops' buffers: one definition
shared by the functional API, the fake kernels, the autograd functions and the tests
(bindings/torch/ops.cpp lays the buffers out the same way)."""
from typing import NamedTuple, Optional

import torch

# F.rms_norm's float32 eps, the default of every rope op (SPEC.md section 1).
DEFAULT_EPS = 2.0**-23


class RopeLayout(NamedTuple):
    """The layout arguments every rope op takes, in order: the schema fragment kRopeLayoutSchema
    of bindings/torch/ops.cpp, which the binding reads into qkvfuse::RopeLayout
    (include/qkvfuse/qk_norm_rope.hpp; SPEC.md section 8). `tuple(layout)` is those arguments;
    `RopeLayout.of_op(args)` reads them back from an op's arguments (the fake kernels).
    The same names as qk_norm_rope's arguments.

    None means the C++ default: num_kv_heads = num_heads; rotary_dim = D with factor tables,
    cos_sin's width with a cos/sin cache (0 without angles). The norm weights are separate tensor
    arguments of the ops so that autograd can return their gradients. rotary_style is always named
    here (the public functions require it with a cos/sin cache: ops.rope_layout). The last three
    fields (SPEC.md section 9) have defaults in the schemas too: calls written before them still
    work.
    """
    num_heads: int
    num_kv_heads: Optional[int] = None
    rotary_dim: Optional[int] = None
    rotary_style: str = "interleaved"
    normalize: bool = True
    eps: float = DEFAULT_EPS
    weight_offset: float = 0.0
    paired: bool = False
    key_offset: bool = False
    factor1: Optional[torch.Tensor] = None
    factor2: Optional[torch.Tensor] = None
    cos_sin: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None
    q_weight: Optional[torch.Tensor] = None
    k_weight: Optional[torch.Tensor] = None
    normalize_v: bool = False
    norm_scope: str = "head"
    query_only: bool = False

    @classmethod
    def of_op(cls, fragment, kwargs=None) -> "RopeLayout":
        """The layout of the fragment of a rope op's arguments (the fields in order, the trailing
        ones possibly absent, possibly passed by name in kwargs)."""
        named = {k: v for k, v in (kwargs or {}).items() if k in cls._fields}
        return cls(*fragment[:len(cls._fields)], **named)

    @classmethod
    def trailing(cls, fragment, name, kwargs=None):
        """An op's own argument after the layout fragment (e.g. qkv_backward_fp8's v), or None."""
        if len(fragment) > len(cls._fields):
            return fragment[len(cls._fields)]
        return (kwargs or {}).get(name)

    def options(self) -> tuple:
        """The non-tensor fields, e.g. for an autograd context; of_parts joins them again."""
        return tuple(getattr(self, name) for name in self._fields if name not in _TENSOR_FIELDS)

    def tensors(self) -> tuple:
        """The tensor fields (factor1 .. k_weight), e.g. to save for the backward."""
        return tuple(getattr(self, name) for name in _TENSOR_FIELDS)

    @classmethod
    def of_parts(cls, options, tensors) -> "RopeLayout":
        """The layout of options() and tensors()."""
        values = dict(zip((n for n in cls._fields if n not in _TENSOR_FIELDS), options))
        values.update(zip(_TENSOR_FIELDS, tensors))
        return cls(**values)

    def named_tensors(self) -> dict:
        """The tensor fields by name (None for the absent ones), e.g. for a device check."""
        return {name: getattr(self, name) for name in _TENSOR_FIELDS}

    @property
    def kv_heads(self) -> int:
        if self.query_only:
            return 0
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def output_shapes(self, tokens, head_dim):
        """(q's shape, k's shape): [T, Hq, D] and [T, Hkv, D]; [2T, Hq/2, D] each when paired."""
        if self.paired:
            return ((2 * tokens, self.num_heads // 2, head_dim),
                    (2 * tokens, self.kv_heads // 2, head_dim))
        return (tokens, self.num_heads, head_dim), (tokens, self.kv_heads, head_dim)

    def qkv_dim(self, head_dim, v_dim):
        """Features of the packed projection: (Hq + Hkv) * D + Hkv * Dv."""
        return (self.num_heads + self.kv_heads) * head_dim + self.kv_heads * v_dim

    def weight_grads_like(self, like: torch.Tensor):
        """Fake versions of the weight gradients a backward op returns: [D] in each weight's
        dtype, an empty float32 [0] for an absent weight (the schemas have no optional outputs)."""
        return tuple(like.new_empty((0,), dtype=torch.float32) if w is None
                     else like.new_empty(w.shape, dtype=w.dtype)
                     for w in (self.q_weight, self.k_weight))

    def weight_grads(self, grad_q_weight, grad_k_weight):
        """A backward op's weight gradients, None in place of an absent weight's placeholder."""
        return (None if self.q_weight is None else grad_q_weight,
                None if self.k_weight is None else grad_k_weight)


_TENSOR_FIELDS = ("factor1", "factor2", "cos_sin", "positions", "q_weight", "k_weight")


def qkv_views(qkv: torch.Tensor, tokens, layout: RopeLayout, qk_dim: int, v_dim: int):
    """(qk [T, Hq + Hkv, D], v [T, Hkv, Dv]) from packed_qkv_forward's flat buffer of T * qkv_dim.

    Plain layers: the buffer is row-major [T, qkv_dim], qk its first (Hq + Hkv) * D columns and v
    the rest (v strided, as one GEMM wrote both). Paired layers: qk [T, 2HD] then v [T, HDv], each
    dense, since paired attention merges v's token and head axes and would otherwise copy it.
    With layout.normalize_v, v is the GEMM's raw V (the backward's input): v_out_view cuts the
    normalized V that follows.
    """
    qk_heads = layout.num_heads + layout.kv_heads
    qk_features = qk_heads * qk_dim
    v_features = layout.kv_heads * v_dim
    projection = tokens * (qk_features + v_features)
    if layout.paired:
        qk_flat = qkv[: tokens * qk_features].view(tokens, qk_features)
        v_flat = qkv[tokens * qk_features : projection].view(tokens, v_features)
    else:
        rows = qkv[:projection].view(tokens, qk_features + v_features)
        qk_flat, v_flat = rows[:, :qk_features], rows[:, qk_features:]
    return qk_flat.view(tokens, qk_heads, qk_dim), v_flat.view(tokens, layout.kv_heads, v_dim)


def v_out_view(qkv: torch.Tensor, tokens, layout: RopeLayout, qk_dim: int, v_dim: int):
    """The V norm's output v_out [T, Hkv, Dv] (dense) at the end of packed_qkv_forward's buffer,
    which then holds T * (qkv_dim + Hkv * Dv) elements (layout.normalize_v); None otherwise."""
    if not layout.normalize_v:
        return None
    start = tokens * ((layout.num_heads + layout.kv_heads) * qk_dim + layout.kv_heads * v_dim)
    return qkv[start:].view(tokens, layout.kv_heads, v_dim)


def split_grad_weight(grad_weight: torch.Tensor, qk_rows: int):
    """(grad_qk_weight, grad_v_weight): the two row slices of packed_qkv_backward's [qkv_dim, C]."""
    return grad_weight[:qk_rows], grad_weight[qk_rows:]


def kernel_readable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` if the kernels can read it in place (last dim contiguous, no broadcast dims), else a
    dense copy. Gradients from autograd may be expanded (e.g. from .sum()) or transposed. An empty
    tensor becomes a fresh one with dense strides: .contiguous() keeps an empty expanded tensor as
    it is, and its zero strides fail the op's layout checks."""
    if tensor.numel() == 0:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    broadcast = any(s == 0 and n > 1 for s, n in zip(tensor.stride(), tensor.shape))
    if tensor.stride(-1) == 1 and not broadcast:
        return tensor
    return tensor.contiguous()
