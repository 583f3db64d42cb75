"""The public API: validation, then dispatch to a kernel and a backend.

Layout is flash-attn's: q (batch, seqlen_q, heads, head_dim); k, v (batch, seqlen_k, kv_heads, head_dim).
"""
from __future__ import annotations

import os

import numpy as np

from . import arrays, reference, validation
from .validation import Checked


def _import(named):
    return [arrays.import_array(x, name) for name, x in named]


def _empty_forward(c: Checked, xp, dtype):
    p = c.problem
    out = xp.zeros((p.batch, p.seqlen_q, p.heads, p.head_dim), dtype=dtype)
    lse = xp.full((p.batch, p.heads, p.seqlen_q), -np.inf, dtype=np.float32)
    return out, lse


def _is_empty(c: Checked) -> bool:
    p = c.problem
    return p.batch == 0 or p.seqlen_q == 0 or p.heads == 0 or p.seqlen_k == 0


def _xp(kind: str, backend: str):
    if kind == "numpy" and backend in ("reference", "numba"):
        return np
    import cupy

    return np if kind == "numpy" else cupy


def forward(q, k, v, *, causal=False, scale=None, kernel="fa2", backend="cupy", **switches):
    """Exact attention, forward.

    Parameters
    ----------
    q : array (batch, seqlen_q, heads, head_dim), float16, bfloat16 or float32
    k, v : arrays (batch, seqlen_k, kv_heads, head_dim), q's dtype; heads % kv_heads == 0 (GQA / MQA)
    causal : bool
        Query i sees key j iff j <= i + seqlen_k - seqlen_q (bottom-right aligned, as flash-attn >= 2.1).
    scale : float, optional
        Softmax scale, default 1/sqrt(head_dim).
    kernel : {'fa2', 'fa1', 'naive'}
    backend : {'cupy', 'numba', 'reference'}
    **switches
        fa2 only, for the ablation: ``defer_norm``, ``seq_parallel``, ``split_q`` (all True by default);
        ``wgmma`` (default: Hopper's warpgroup kernel where it applies, False forces mma.sync, True demands
        wgmma) and ``overlap`` (wgmma kernel: FA3's softmax / P V overlap, default True).

    Returns
    -------
    out : array like q
    lse : array (batch, heads, seqlen_q) float32, natural log of the softmax denominator; -inf for rows that
        see no key (their out is 0).

    CuPy and foreign device arrays give CuPy results; NumPy arrays are copied to the device and the results come
    back as NumPy. Work is queued on CuPy's current stream; nothing synchronises the host.
    """
    q, k, v = _import((("q", q), ("k", k), ("v", v)))
    c = validation.check_forward(q, k, v, causal, scale, kernel, backend)
    _check_switches(kernel, switches)
    to_numpy = c.kind == "numpy"
    if backend == "reference":
        out, lse = reference.forward(q, k, v, causal=c.problem.causal, scale=c.scale)
        return _host_result(out.astype(q.dtype), to_numpy), _host_result(lse.astype(np.float32), to_numpy)
    if _is_empty(c):
        out, lse = _empty_forward(c, _xp(c.kind, backend), q.dtype)
        return arrays.export(out, to_numpy), arrays.export(lse, to_numpy)
    _require_gpu(backend)
    with _device(c):
        if backend == "numba":
            from . import numba_backend

            out, lse = numba_backend.forward(c.problem, q, k, v, c.scale, kernel, **switches)
        else:
            from . import cupy_backend

            out, lse = cupy_backend.forward(c.problem, q, k, v, c.scale, kernel, **switches)
    return arrays.export(out, to_numpy), arrays.export(lse, to_numpy)


def backward(dout, q, k, v, out, lse, *, causal=False, scale=None, deterministic=False, backend="cupy"):
    """Gradients of ``sum(out * dout)`` with respect to q, k, v (FlashAttention-2 Algorithm 2).

    Parameters
    ----------
    dout : array like q
    q, k, v, causal, scale : as given to ``forward``
    out, lse : what ``forward`` returned
    deterministic : bool
        False (default): dQ is accumulated with float32 atomicAdd (fastest; equal only up to rounding from run
        to run). True: a separate dQ pass without atomics, bitwise repeatable.
    backend : {'cupy', 'numba', 'reference'}

    Returns
    -------
    dq : array like q
    dk, dv : arrays like k (summed over the query heads of each GQA group)
    """
    named = (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse))
    dout, q, k, v, out, lse = _import(named)
    c = validation.check_backward(dout, q, k, v, out, lse, causal, scale, deterministic, backend)
    to_numpy = c.kind == "numpy"
    p = c.problem
    if backend == "reference":
        grads = reference.backward(dout, q, k, v, causal=p.causal, scale=c.scale)
        return tuple(_host_result(g.astype(q.dtype), to_numpy) for g in grads)
    if _is_empty(c):
        xp = _xp(c.kind, backend)
        return (xp.zeros(q.shape, q.dtype), xp.zeros(k.shape, k.dtype), xp.zeros(v.shape, v.dtype))
    _require_gpu(backend)
    with _device(c):
        if backend == "numba":
            from . import numba_backend

            grads = numba_backend.backward(p, dout, q, k, v, out, lse, c.scale, deterministic)
        else:
            from . import cupy_backend

            grads = cupy_backend.backward(p, dout, q, k, v, out, lse, c.scale, deterministic)
    return tuple(arrays.export(g, to_numpy) for g in grads)


def attention(q, k, v, *, causal=False, scale=None):
    """Forward only: ``out`` of :func:`forward` with the default kernel and backend."""
    return forward(q, k, v, causal=causal, scale=scale)[0]


def vjp(q, k, v, *, causal=False, scale=None, deterministic=False):
    """``out`` and a pullback ``dout -> (dq, dk, dv)`` that reuses the forward's out and lse."""
    out, lse = forward(q, k, v, causal=causal, scale=scale)

    def pullback(dout):
        return backward(dout, q, k, v, out, lse, causal=causal, scale=scale, deterministic=deterministic)

    return out, pullback


def _check_switches(kernel: str, switches: dict) -> None:
    allowed = {"defer_norm", "seq_parallel", "split_q", "wgmma", "overlap"}
    unknown = set(switches) - allowed
    if unknown:
        raise TypeError(f"forward got unexpected keyword argument(s) {sorted(unknown)}; the fa2 ablation switches "
                        f"are {sorted(allowed)}")
    if switches and kernel != "fa2":
        raise ValueError(f"the ablation switches {sorted(switches)} apply to kernel='fa2' only, got kernel={kernel!r}")
    for name, value in switches.items():
        if not (name == "wgmma" and value is None):
            validation.check_flag(value, name)


def _require_gpu(backend: str) -> None:
    """A clear error instead of a CUDA runtime failure when no GPU is visible (the simulator serves 'numba')."""
    if backend == "numba" and os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return
    try:
        import cupy

        available = cupy.cuda.is_available()
    except Exception:
        available = False
    if not available:
        raise RuntimeError(f"backend={backend!r} needs a CUDA GPU and none is visible; use backend='reference' "
                           "(NumPy float64), or backend='numba' under NUMBA_ENABLE_CUDASIM=1 (Numba's CPU simulator)")


def _host_result(x, to_numpy: bool):
    """Reference results are NumPy; send them to the device when the caller gave device arrays."""
    if to_numpy:
        return x
    import cupy

    return cupy.asarray(x)


class _device:
    """Run under the inputs' CUDA device (and its current stream); a no-op for host inputs."""

    def __init__(self, c: Checked):
        self.device = c.device if isinstance(c.device, int) else None
        self._ctx = None

    def __enter__(self):
        if self.device is not None:
            import cupy

            self._ctx = cupy.cuda.Device(self.device)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
        return False
