"""Input checking shared by every backend: bad input is refused here, before anything is launched.

Each error is a ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, wrong value) whose message
names the argument, what was expected and what was given.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from . import configs
from .launch import MAX_GRID_YZ, Problem

KERNELS = ("fa2", "fa1", "naive")
BACKENDS = ("cupy", "numba", "reference")


def dtype_name(dtype) -> str:
    """'float16', 'bfloat16', 'float32' (or whatever NumPy calls any other dtype)."""
    return np.dtype(dtype).name


def _is_cupy(x) -> bool:
    return type(x).__module__.startswith("cupy") and hasattr(x, "device") and hasattr(x, "data")


def array_kind(x, name: str) -> str:
    """'numpy', 'cupy' or 'foreign' (another library's device array); TypeError for anything else."""
    if isinstance(x, np.ndarray):
        return "numpy"
    if _is_cupy(x):
        return "cupy"
    if hasattr(x, "__cuda_array_interface__") or hasattr(x, "__dlpack__"):
        return "foreign"
    raise TypeError(f"{name} must be an array (CuPy, NumPy, or any object with __cuda_array_interface__ or "
                    f"__dlpack__), got {type(x).__name__}")


def device_of(x, kind: str):
    """An identifier of where the array lives: 'host' or the CUDA device id."""
    if kind == "numpy":
        return "host"
    if kind == "cupy":
        return int(x.device.id)
    if hasattr(x, "__dlpack_device__"):
        dev_type, dev_id = x.__dlpack_device__()
        return "host" if int(dev_type) == 1 else int(dev_id)
    return "cuda"


def check_flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_scale(scale, head_dim: int) -> float:
    """The softmax scale: ``1/sqrt(head_dim)`` by default, else a positive finite real number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a positive finite real number or None, got {type(scale).__name__} {scale!r}")
    value = float(scale)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"scale must be a positive finite real number or None, got {scale!r}")
    return value


def check_choice(value, name: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    return value


def _shape(x, name: str) -> tuple[int, ...]:
    shape = tuple(int(s) for s in x.shape)
    if len(shape) != 4:
        raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, heads, head_dim), got shape {shape}")
    return shape


def _dtype(x, name: str) -> str:
    try:
        dt = dtype_name(x.dtype)
    except TypeError:
        dt = str(x.dtype)
    if dt not in configs.DTYPES:
        raise TypeError(f"{name} must have dtype float16, bfloat16 or float32, got {dt}")
    return dt


@dataclasses.dataclass(frozen=True)
class Checked:
    """The outcome of validation: the problem, the scale, and where the arrays live."""

    problem: Problem
    scale: float
    kind: str              # 'numpy', 'cupy' or 'foreign' (of q; all inputs share a device)
    device: object


def check_forward(q, k, v, causal, scale, kernel: str = "fa2", backend: str = "cupy") -> Checked:
    """Validate a forward call (DESIGN.md section 1) and describe it; raises before anything is launched."""
    check_choice(kernel, "kernel", KERNELS)
    check_choice(backend, "backend", BACKENDS)
    causal = check_flag(causal, "causal")
    kinds = {name: array_kind(x, name) for name, x in (("q", q), ("k", k), ("v", v))}
    shapes = {"q": _shape(q, "q"), "k": _shape(k, "k"), "v": _shape(v, "v")}
    dtypes = {"q": _dtype(q, "q"), "k": _dtype(k, "k"), "v": _dtype(v, "v")}
    if len(set(dtypes.values())) > 1:
        given = ", ".join(f"{n} {d}" for n, d in dtypes.items())
        raise TypeError(f"q, k and v must share one dtype, got {given}")
    devices = {name: device_of(x, kinds[name]) for name, x in (("q", q), ("k", k), ("v", v))}
    if len(set(devices.values())) > 1:
        given = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"q, k and v must be on the same device, got {given}")
    (b, nq, h, d), (bk, nk, hk, dk), vshape = shapes["q"], shapes["k"], shapes["v"]
    if bk != b or vshape[0] != b:
        raise ValueError(f"q, k and v must have the same batch size, got q {b}, k {bk}, v {vshape[0]}")
    if dk != d or vshape[3] != d:
        raise ValueError(f"q, k and v must have the same head_dim, got q {d}, k {dk}, v {vshape[3]}")
    if vshape[1] != nk:
        raise ValueError(f"k and v must have the same seqlen_k, got k {nk}, v {vshape[1]}")
    if vshape[2] != hk:
        raise ValueError(f"k and v must have the same number of kv heads, got k {hk}, v {vshape[2]}")
    if hk < 1 or h % hk != 0:
        raise ValueError(f"heads of q must be a multiple of kv_heads of k and v (kv_heads >= 1), got heads {h}, "
                         f"kv_heads {hk}")
    if not 1 <= d <= configs.MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be between 1 and {configs.MAX_HEAD_DIM}, got {d}")
    if h > MAX_GRID_YZ or b > MAX_GRID_YZ:
        raise ValueError(f"heads and batch must each be at most {MAX_GRID_YZ}, got heads {h}, batch {b}")
    problem = Problem(b, nq, nk, h, hk, d, dtypes["q"], causal)
    return Checked(problem, check_scale(scale, d), kinds["q"], devices["q"])


def check_backward(dout, q, k, v, out, lse, causal, scale, deterministic, backend: str = "cupy") -> Checked:
    """Validate a backward call: the forward checks plus dout, out and lse against q."""
    checked = check_forward(q, k, v, causal, scale, "fa2", backend)
    check_flag(deterministic, "deterministic")
    p = checked.problem
    for name, x in (("dout", dout), ("out", out)):
        kind = array_kind(x, name)
        if tuple(int(s) for s in x.shape) != (p.batch, p.seqlen_q, p.heads, p.head_dim):
            raise ValueError(f"{name} must have q's shape {(p.batch, p.seqlen_q, p.heads, p.head_dim)}, "
                             f"got {tuple(x.shape)}")
        if _dtype(x, name) != p.dtype:
            raise TypeError(f"{name} must have q's dtype {p.dtype}, got {dtype_name(x.dtype)}")
        if device_of(x, kind) != checked.device:
            raise ValueError(f"{name} must be on q's device ({checked.device}), got {device_of(x, kind)}")
    kind = array_kind(lse, "lse")
    if tuple(int(s) for s in lse.shape) != (p.batch, p.heads, p.seqlen_q):
        raise ValueError(f"lse must have shape (batch, heads, seqlen_q) = {(p.batch, p.heads, p.seqlen_q)}, "
                         f"got {tuple(lse.shape)}")
    if dtype_name(lse.dtype) not in ("float32", "float64"):
        raise TypeError(f"lse must be float32 (as forward returns it), got {dtype_name(lse.dtype)}")
    if device_of(lse, kind) != checked.device:
        raise ValueError(f"lse must be on q's device ({checked.device}), got {device_of(lse, kind)}")
    return checked
