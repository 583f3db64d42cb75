"""Attention of one ring block (local query rows against one received K/V block), forward and backward.

The forward is :func:`rawflash.forward`: its (out, lse) are merged across blocks with the lse combine.

The backward of a block needs the *global* softmax: ``P = exp(scale * q k^T - lse)`` with ``lse`` over every key
of the sequence, ``D = rowsum(dout * out)`` with the merged ``out``. The CUDA and Numba backends of
:func:`rawflash.backward` compute exactly that from the ``out`` and ``lse`` they are given, so on a K/V block they
return that block's share of dq and its dk, dv, and the shares add up to the gradients of the whole sequence.
``rawflash.backward(backend='reference')`` does not: it recomputes the softmax from the keys it is given (it
ignores ``out`` and ``lse``), which on a block normalises over that block alone. For ``backend='reference'`` the
block backward is therefore :func:`reference_backward` below, the kernels' formulas in float64.
"""
from __future__ import annotations

import numpy as np

from .. import api
from .._xp import Array, array_module


def forward(q: Array, k: Array, v: Array, *, causal: bool, scale: float, backend: str) -> tuple[Array, Array]:
    """(out like q, lse (batch, heads, seqlen_q) float32) of the block: :func:`rawflash.forward`."""
    return api.forward(q, k, v, causal=causal, scale=scale, backend=backend)


def backward(dout: Array, q: Array, k: Array, v: Array, out: Array, lse: Array, *, causal: bool, scale: float,
             deterministic: bool, backend: str) -> tuple[Array, Array, Array]:
    """The block's (dq like q, dk like k, dv like v) given the global ``out`` and ``lse`` of its query rows."""
    if backend == "reference":
        return reference_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    return api.backward(dout, q, k, v, out, lse, causal=causal, scale=scale, deterministic=deterministic,
                        backend=backend)


def reference_backward(dout: Array, q: Array, k: Array, v: Array, out: Array, lse: Array, *, causal: bool,
                       scale: float) -> tuple[Array, Array, Array]:
    """FlashAttention-2's backward recomputation in float64, from a given ``out`` and ``lse``.

    ``P = exp(scale * q k^T - lse)`` (0 where masked or where lse is -inf), ``dV = P^T dO``, ``dP = dO V^T``,
    ``D = rowsum(dO * O)``, ``dS = P * (dP - D)``, ``dQ = scale * dS K``, ``dK = scale * dS^T Q``; dK and dV
    summed over each GQA group. Shapes and the bottom-right causal mask are :func:`rawflash.backward`'s;
    results have q's dtype and come back as NumPy or CuPy arrays, as ``q`` is.
    """
    xp, dtypes = array_module(q), (q.dtype, k.dtype, v.dtype)
    dout, q, k, v, out, lse = (np.asarray(x if xp is np else x.get(), dtype=np.float64)
                               for x in (dout, q, k, v, out, lse))
    batch, nq, heads, d = q.shape
    nk, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    # query head h = kv_head * group + g (rawflash's GQA mapping)
    qg, dog, og = (x.reshape(batch, nq, kv_heads, group, d) for x in (q, dout, out))
    scores = np.einsum("bqcgd,bkcd->bcgqk", qg, k) * scale
    if causal:
        visible = np.arange(nk)[None, :] <= np.arange(nq)[:, None] + (nk - nq)
        scores = np.where(visible, scores, -np.inf)
    row_lse = lse.reshape(batch, kv_heads, group, nq)[..., None]
    row_lse = np.where(np.isfinite(row_lse), row_lse, np.inf)      # rows that see nothing: P = exp(-inf) = 0
    probs = np.exp(scores - row_lse)
    dv = np.einsum("bcgqk,bqcgd->bkcd", probs, dog)
    dprobs = np.einsum("bqcgd,bkcd->bcgqk", dog, v)
    delta = np.einsum("bqcgd,bqcgd->bcgq", dog, og)[..., None]
    dscores = probs * (dprobs - delta)
    dq = np.einsum("bcgqk,bkcd->bqcgd", dscores, k).reshape(batch, nq, heads, d) * scale
    dk = np.einsum("bcgqk,bqcgd->bkcd", dscores, qg) * scale
    return tuple(xp.asarray(g.astype(dtype)) for g, dtype in zip((dq, dk, dv), dtypes))
