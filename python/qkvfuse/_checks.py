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

# What the ops take for a scale: a tensor, whose value the library reads where it lives (so that
# nothing waits for a GPU).
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


def _refuse(op, name, value: torch.Tensor, expected: str):
    raise RuntimeError(f"{op}: {name}: expected {expected}, got {_describe(value)}")


def _describe(value: torch.Tensor) -> str:
    return (f"{value.dtype} tensor of shape {list(value.shape)}, strides {list(value.stride())}, "
            f"on {value.device}")


def _row_major(value: torch.Tensor) -> bool:
    """2-D, last dim contiguous, rows not overlapping (the library's row_major)."""
    rows, columns = value.shape
    return (columns <= 1 or value.stride(1) == 1) and (rows <= 1 or value.stride(0) >= columns)


def _f32_scalar(value: torch.Tensor) -> bool:
    return value.dtype == torch.float32 and value.dim() <= 1 and value.numel() == 1


# The packed op's forward reads x_f8, weight_f8, the three forward scales and the layout: the
# library checks those when the forward runs (and the fake kernels their devices, when one is on
# meta). Its backward alone reads the others, which are checked here.
PACKED_TENSORS = ("x", "qk_weight", "v_weight", "weight_f8", "weight_f8_t", "weight_scale",
                  "qkv_scale", "x_scale", "grad_scale", "x_f8", "x_f8_t")
_BACKWARD_ONLY = ("x", "qk_weight", "v_weight", "weight_f8_t", "grad_scale", "x_f8_t")


def packed_arguments(op: str, args: dict, layout) -> tuple:
    """Checks packed_fp8_qkv's arguments (`args`: PACKED_TENSORS by name) before its forward
    runs: the Python types of all, and the device, dtype and shape of those only the backward
    reads (x, the master weights, the transposed FP8 operands and grad_scale). Returns
    (qk_dim, v_dim), from the master weights' rows. Messages are built only on failure: this
    runs on every call, on the host's hot path."""
    for name in PACKED_TENSORS:
        if not isinstance(args[name], torch.Tensor):
            expected = SCALAR if name.endswith("scale") else ""
            hint = ("; the backward reads it when it runs, so that a hook can set it from the "
                    "gradients: e.g. torch.tensor(1 / 448, device=x.device)"
                    if name == "grad_scale" else "")
            tensor(op, name, args[name], expected=expected, hint=hint)
    x_f8 = args["x_f8"]
    device = x_f8.device
    for name in _BACKWARD_ONLY:
        if args[name].device != device:
            same_device(op, {"x_f8": x_f8, name: args[name]})
    if x_f8.dim() != 2:
        _refuse(op, "x_f8", x_f8, "2 dims [T, C]")
    tokens, channels = x_f8.shape
    x, x_f8_t = args["x"], args["x_f8_t"]
    if not (x.is_floating_point() and x.numel() == tokens * channels):
        _refuse(op, "x", x, f"a floating-point tensor of T * C = {tokens * channels} elements "
                            f"(x_f8 is [T, C] = [{tokens}, {channels}])")
    if not (x_f8_t.dtype == E4M3 and x_f8_t.shape == (channels, tokens) and _row_major(x_f8_t)):
        _refuse(op, "x_f8_t", x_f8_t, f"a row-major torch.float8_e4m3fn tensor of shape [C, T] = "
                                      f"[{channels}, {tokens}] (x_f8 transposed)")
    dims = []
    for name, heads, count, width in (
            ("qk_weight", layout.num_heads + layout.kv_heads, "num_heads + num_kv_heads", "D"),
            ("v_weight", layout.kv_heads, "num_kv_heads", "Dv")):
        weight = args[name]
        rows = weight.shape[0] if weight.dim() == 2 else 0
        # query_only has no V heads (heads = 0): v_weight is [0, C].
        if not (weight.dim() == 2 and (rows >= heads >= 1 and rows % heads == 0
                                       or rows == heads == 0)
                and weight.shape[1] == channels and weight.dtype == torch.bfloat16
                and weight.is_contiguous()):
            _refuse(op, name, weight, f"a contiguous torch.bfloat16 tensor of shape "
                                      f"[heads * {width}, C] with heads = {count} = {heads} and "
                                      f"C = {channels} (from x_f8)")
        # Without V heads any V width serves the empty V: D's.
        dims.append(rows // heads if heads else dims[0])
    weight_f8_t = args["weight_f8_t"]
    qkv_dim = args["qk_weight"].shape[0] + args["v_weight"].shape[0]
    if not (weight_f8_t.dtype == E4M3 and weight_f8_t.shape == (channels, qkv_dim)
            and _row_major(weight_f8_t)):
        _refuse(op, "weight_f8_t", weight_f8_t,
                f"a row-major torch.float8_e4m3fn tensor of shape [C, qkv_dim] = [{channels}, "
                f"{qkv_dim}] (qkv_dim: the rows of qk_weight and v_weight)")
    if not _f32_scalar(args["grad_scale"]):
        _refuse(op, "grad_scale", args["grad_scale"], "a torch.float32 tensor of shape [] or [1]")
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
