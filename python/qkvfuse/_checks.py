"""Argument checks of the Python entry points, for what the C++ library cannot check itself:
Python types (a float where the op takes a tensor), the arguments only a backward reads (checked
in the forward, so that a mistake shows at the call that made it), and tensors on one device in
the fake kernels (python/qkvfuse/_fake.py), which run instead of the library under torch.compile,
FakeTensor tracing and whenever one argument is on the `meta` device.

Messages read as the library's do, "<op>: <argument>: expected ..., got ...". A value of the wrong
Python type raises TypeError, a bad option value ValueError; a tensor of the wrong dtype, shape or
device RuntimeError, as the library's own checks (and torch's) raise for tensors.
"""
import math
import numbers

import torch

E4M3 = torch.float8_e4m3fn

# What the ops take for a scale (the library reads it on the device, never on the host).
SCALAR = "a torch.float32 tensor of shape [] or [1] on the op's device"

_INTEGERS = (int, torch.SymInt)
_NUMBERS = (int, float, torch.SymInt, torch.SymFloat)


def _got(value) -> str:
    if isinstance(value, (bool, int, float)):
        return f"{type(value).__name__} {value!r}"
    return type(value).__name__


def tensor(op: str, name: str, value, optional: bool = False, expected: str = "",
           hint: str = "") -> None:
    """`value` is a tensor (or None when optional); `expected` says which, `hint` follows."""
    if isinstance(value, torch.Tensor) or (optional and value is None):
        return
    expected = expected or ("a tensor or None" if optional else "a tensor")
    raise TypeError(f"{op}: {name}: expected {expected}, got {_got(value)}{hint}")


def integer(op: str, name: str, value, optional: bool = False, least=None) -> None:
    """`value` is an int (not a bool; None when optional), at least `least` when given."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not (isinstance(value, _INTEGERS)
                                       or isinstance(value, numbers.Integral)):
        expected = "an int or None" if optional else "an int"
        raise TypeError(f"{op}: {name}: expected {expected}, got {_got(value)}")
    if least is not None and value < least:
        raise ValueError(f"{op}: {name}: expected an int >= {least}"
                         f"{' or None (the default)' if optional else ''}, got {value}")


def flag(op: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name}: expected True or False, got {_got(value)}")


def number(op: str, name: str, value) -> None:
    if isinstance(value, bool) or not (isinstance(value, _NUMBERS)
                                       or isinstance(value, numbers.Real)):
        raise TypeError(f"{op}: {name}: expected a float, got {_got(value)}")


def same_device(op: str, tensors: dict) -> None:
    """Every tensor of `tensors` (name -> tensor or None) on the first one's device: the library's
    own rule and wording (src/validate.cpp, same_device)."""
    first = None
    for name, value in tensors.items():
        if value is None:
            continue
        if first is None:
            first = name, value.device
        elif value.device != first[1]:
            raise RuntimeError(f"{op}: {name}: is on {value.device}, but {first[0]} is on "
                               f"{first[1]}; all tensors of one call must share a device")


def _expect(op, name, value: torch.Tensor, ok: bool, expected: str) -> None:
    if not ok:
        raise RuntimeError(f"{op}: {name}: expected {expected}, got {_describe(value)}")


def _describe(value: torch.Tensor) -> str:
    return (f"{value.dtype} tensor of shape {list(value.shape)}, strides {list(value.stride())}, "
            f"on {value.device}")


def _row_major(value: torch.Tensor) -> bool:
    """2-D, last dim contiguous, rows not overlapping (the library's row_major)."""
    return value.dim() == 2 and (value.shape[1] <= 1 or value.stride(1) == 1) and (
        value.shape[0] <= 1 or value.stride(0) >= value.shape[1])


def _f32_scalar(op, name, value):
    _expect(op, name, value,
            value.dtype == torch.float32 and tuple(value.shape) in ((), (1,)),
            "a torch.float32 tensor of shape [] or [1]")


# The packed op's forward reads x_f8, weight_f8, the three forward scales and the layout: the
# library checks those when the forward runs. Its backward alone reads the others.
PACKED_TENSORS = ("x", "qk_weight", "v_weight", "weight_f8", "weight_f8_t", "weight_scale",
                  "qkv_scale", "x_scale", "grad_scale", "x_f8", "x_f8_t")


def packed_arguments(op: str, args: dict, layout) -> tuple:
    """Checks packed_fp8_qkv's arguments (`args`: PACKED_TENSORS by name) before its forward
    runs: the Python types of all, their devices (those of the layout too), and whatever only
    the backward reads (x, the master weights, the transposed FP8 operands and grad_scale).
    Returns (qk_dim, v_dim), from the master weights' rows."""
    for name in PACKED_TENSORS:
        expected = SCALAR if name.endswith("scale") else ""
        hint = ("; the backward reads it when it runs, so that a hook can set it from the "
                "gradients: e.g. torch.tensor(1 / 448, device=x.device)"
                if name == "grad_scale" else "")
        tensor(op, name, args[name], expected=expected, hint=hint)
    same_device(op, {**{name: args[name] for name in PACKED_TENSORS},
                     **layout.named_tensors()})
    x, x_f8, x_f8_t = args["x"], args["x_f8"], args["x_f8_t"]
    _expect(op, "x_f8", x_f8, x_f8.dim() == 2, "2 dims [T, C]")
    tokens, channels = x_f8.shape
    _expect(op, "x", x, x.is_floating_point() and x.numel() == tokens * channels,
            f"a floating-point tensor of T * C = {tokens * channels} elements (x_f8 is [T, C] = "
            f"[{tokens}, {channels}])")
    _expect(op, "x_f8_t", x_f8_t,
            x_f8_t.dtype == E4M3 and tuple(x_f8_t.shape) == (channels, tokens)
            and _row_major(x_f8_t),
            f"a row-major torch.float8_e4m3fn tensor of shape [C, T] = [{channels}, {tokens}] "
            f"(x_f8 transposed)")
    qk_heads = layout.num_heads + layout.kv_heads
    dims = []
    for name, heads, count, width in (("qk_weight", qk_heads, "num_heads + num_kv_heads", "D"),
                                      ("v_weight", layout.kv_heads, "num_kv_heads", "Dv")):
        weight = args[name]
        rows = weight.shape[0] if weight.dim() == 2 else 0
        _expect(op, name, weight,
                weight.dim() == 2 and heads >= 1 and rows >= heads and rows % heads == 0
                and weight.shape[1] == channels and weight.dtype == torch.bfloat16
                and weight.is_contiguous(),
                f"a contiguous torch.bfloat16 tensor of shape [heads * {width}, C] with heads = "
                f"{count} = {heads} and C = {channels} (from x_f8)")
        dims.append(rows // heads)
    qkv_dim = args["qk_weight"].shape[0] + args["v_weight"].shape[0]
    _expect(op, "weight_f8_t", args["weight_f8_t"],
            args["weight_f8_t"].dtype == E4M3
            and tuple(args["weight_f8_t"].shape) == (channels, qkv_dim)
            and _row_major(args["weight_f8_t"]),
            f"a row-major torch.float8_e4m3fn tensor of shape [C, qkv_dim] = [{channels}, "
            f"{qkv_dim}] (qkv_dim: the rows of qk_weight and v_weight)")
    _f32_scalar(op, "grad_scale", args["grad_scale"])
    return tuple(dims)


def positive_scale(op: str, name: str, value: torch.Tensor) -> None:
    """A scale on the CPU is positive and finite (reading it there costs nothing). On CUDA the
    kernels read it on the device and nothing checks it: a host check would synchronize."""
    if (value.device.type != "cpu" or torch.compiler.is_compiling()
            or type(value) not in (torch.Tensor, torch.nn.Parameter)):
        return  # a CUDA tensor, or a traced (fake, functional) one: no value to read
    scale = float(value.reshape(()))
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(
            f"{op}: {name}: expected a positive finite value when the backward runs, got {scale} "
            f"(a zero scale would make every gradient of the projection 0 or NaN; docs/"
            f"special_values.md)")
