"""Moving arrays in and out: what kind of array a value is and where it lives, foreign device arrays without copies,
NumPy through the device, kernel-ready views. Imports nothing of rawflash (validation and the backends build on it).
"""
from __future__ import annotations

import sys

import numpy as np


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


def import_array(x, name: str):
    """NumPy and CuPy arrays as they are; any other device array as a CuPy array sharing its memory.

    DLPack is tried first because it describes bfloat16 (``__cuda_array_interface__`` cannot).
    """
    if x.__class__ is _NDARRAY or x.__class__ is np.ndarray or is_cupy_array(x):
        return x
    kind = array_kind(x, name)
    if kind != "foreign":
        return x
    import cupy

    if hasattr(x, "__dlpack__"):
        return cupy.from_dlpack(x)
    return cupy.asarray(x)


_NDARRAY = None  # cupy.ndarray, once an array of it was seen


def is_cupy_array(x) -> bool:
    """Whether ``x`` is a ``cupy.ndarray``, without importing CuPy (an array of it exists only once it is). The
    exact class is one comparison: the public calls ask this of every array."""
    global _NDARRAY
    if x.__class__ is _NDARRAY:
        return True
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return False
    _NDARRAY = cupy.ndarray
    return isinstance(x, _NDARRAY)


def kernel_ready(x, chunk_elems: int):
    """``x`` itself when the kernels can read it in place, else a contiguous copy (also of a contiguous array whose
    base is not 16-byte aligned).

    The kernels read 16-byte chunks along head_dim: the last stride must be 1, the base 16-byte aligned and
    every other stride a multiple of the chunk (8 half-precision or 4 single-precision elements).
    """
    item = x.dtype.itemsize
    strides = [s // item for s in x.strides]
    ok = (x.strides[-1] == item or x.shape[-1] == 1) and x.data.ptr % 16 == 0
    ok = ok and all(s % chunk_elems == 0 for s, n in zip(strides[:-1], x.shape[:-1]) if n > 1)
    return x if ok else x.copy(order="C")  # (a new allocation: aligned, whatever x's base was)


def pad_head_dim(x, head_dim: int):
    """Zero-pad the last axis to ``head_dim`` (a copy); the kernels then never read past the caller's data."""
    import cupy

    if x.shape[-1] == head_dim:
        return x
    out = cupy.zeros(x.shape[:-1] + (head_dim,), dtype=x.dtype)
    out[..., : x.shape[-1]] = x
    return out


def element_strides(x) -> tuple[int, ...]:
    """Strides in elements (CuPy and NumPy report bytes)."""
    return tuple(s // x.dtype.itemsize for s in x.strides)


def export(x, to_numpy: bool):
    """Results go back the way the inputs came: NumPy for NumPy callers, CuPy otherwise."""
    if to_numpy:
        return x.get() if hasattr(x, "get") else np.asarray(x)
    return x
