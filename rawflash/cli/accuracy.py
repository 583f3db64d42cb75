"""Run a forward and a backward through the public API and grade them against the float64 reference.

The grade is flash-attn's rule (``reference.error_ratio_ok``): ``max|ours - ref| <= factor * max|base - ref| +
floor`` with ``base`` the same attention computed naively in the input precision; factor 2 for out and lse, 3 for
the gradients. Inputs are NumPy arrays drawn from a normal distribution (never zeros), so results come back as
NumPy whatever the backend.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Callable

import ml_dtypes
import numpy as np

from .. import reference
from ..problem import Problem
from . import sysinfo

DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
REFERENCE_BUDGET = 8 << 30
"""Bytes the float64 reference may take (about six score-sized float64 arrays) before a shape is refused."""


class Unavailable(RuntimeError):
    """The backend cannot run here (no GPU, or the Numba backend is missing); the message says which."""


def random_inputs(p: Problem, seed: int = 0) -> dict:
    """q, k, v and dout as host arrays of ``p.dtype`` drawn from N(0, 1)."""
    rng = np.random.default_rng(seed)
    dt = DTYPES[p.dtype]
    shape_q = (p.batch, p.seqlen_q, p.heads, p.head_dim)
    shape_k = (p.batch, p.seqlen_k, p.kv_heads, p.head_dim)
    return {name: rng.standard_normal(shape).astype(dt)
            for name, shape in (("q", shape_q), ("k", shape_k), ("v", shape_k), ("dout", shape_q))}


def reference_bytes(p: Problem) -> int:
    """Rough peak memory of the float64 reference of ``p``: six score-sized float64 arrays."""
    return 6 * 8 * p.batch * p.heads * p.seqlen_q * p.seqlen_k


def prepare_backend(backend: str, enable_simulator=None) -> str:
    """Check that ``backend`` can run in this process, or raise Unavailable; returns a line saying where it runs.

    Without a GPU the Numba backend runs on Numba's CUDA simulator, which must be switched on before numba is
    first imported (``NUMBA_ENABLE_CUDASIM`` is read once): ``enable_simulator()`` is then called, which the
    application supplies (the command line sets the variable for its own process; the library never does).
    """
    if backend == "reference":
        return "backend 'reference': float64 NumPy on the host"
    if backend == "cupy":
        if not sysinfo.gpu_available():
            raise Unavailable("backend 'cupy' needs a CUDA GPU and none is visible; use --backend reference, or "
                              "--backend numba (Numba's CUDA simulator on the CPU)")
        return f"backend 'cupy': CUDA C through NVRTC on {sysinfo.current_gpu().name}"
    if importlib.util.find_spec("rawflash.kernels.numba_backend") is None:
        raise Unavailable("backend 'numba' is not in this installation yet "
                          "(rawflash/kernels/numba_backend.py is missing)")
    if sysinfo.gpu_available():
        return f"backend 'numba': Numba CUDA kernels on {sysinfo.current_gpu().name}"
    if "numba" in sys.modules:
        import numba

        if not numba.config.ENABLE_CUDASIM:
            raise Unavailable("no GPU, and numba was imported in this process without its CUDA simulator: run "
                              "with NUMBA_ENABLE_CUDASIM=1 set in the environment")
    elif enable_simulator is not None:
        enable_simulator()
    elif os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        raise Unavailable("no GPU: the Numba backend needs NUMBA_ENABLE_CUDASIM=1 set before numba is imported")
    return "backend 'numba': no GPU, so the Numba kernels run on Numba's CUDA simulator on the CPU (slow)"


def _grade(name, ours, ref, base, dtype, factor) -> dict:
    ok, err, base_err, bound = reference.error_ratio_ok(ours, ref, base, dtype, factor)
    return {"quantity": name, "max_err": err, "base_err": base_err, "bound": bound, "factor": factor,
            "ratio": err / base_err if base_err else None, "result": "pass" if ok else "FAIL", "ok": ok}


def grade_forward(x: dict, out, lse, causal: bool, scale) -> list[dict]:
    """Grades of out and lse computed from the host inputs ``x``."""
    ref = reference.forward(x["q"], x["k"], x["v"], causal=causal, scale=scale)
    base = reference.forward(x["q"], x["k"], x["v"], causal=causal, scale=scale, upcast=False)
    dtype = x["q"].dtype
    return [_grade("out", out, ref[0], base[0], dtype, 2), _grade("lse", lse, ref[1], base[1], dtype, 2)]


def grade_backward(x: dict, grads, causal: bool, scale) -> list[dict]:
    """Grades of dq, dk, dv computed from the host inputs ``x``."""
    args = (x["dout"], x["q"], x["k"], x["v"])
    refs = reference.backward(*args, causal=causal, scale=scale)
    bases = reference.backward(*args, causal=causal, scale=scale, upcast=False)
    return [_grade(name, g, r, b, x["q"].dtype, 3) for name, g, r, b in zip(("dq", "dk", "dv"), grads, refs, bases)]


def check(p: Problem, *, kernel: str = "fa2", backend: str = "cupy", scale=None, deterministic: bool = False,
          seed: int = 0, backward: bool = True, step: Callable[[str], None] = lambda _: None) -> list[dict]:
    """Forward with ``kernel`` then (unless ``backward`` is False) the backward, through the public API, graded.

    Returns one row per quantity (out, lse, then dq, dk, dv) with the errors, the bound and ``ok``.
    """
    import rawflash

    x = random_inputs(p, seed)
    step(f"forward: kernel={kernel!r}, backend={backend!r}")
    out, lse = rawflash.forward(x["q"], x["k"], x["v"], causal=p.causal, scale=scale, kernel=kernel, backend=backend)
    if not backward:
        step("float64 reference and the same-precision baseline")
        return grade_forward(x, out, lse, p.causal, scale)
    step(f"backward: deterministic={deterministic}, backend={backend!r}")
    grads = rawflash.backward(x["dout"], x["q"], x["k"], x["v"], out, lse, causal=p.causal, scale=scale,
                              deterministic=deterministic, backend=backend)
    step("float64 reference and the same-precision baseline")
    return grade_forward(x, out, lse, p.causal, scale) + grade_backward(x, grads, p.causal, scale)
