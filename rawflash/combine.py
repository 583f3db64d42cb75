"""Combining attention computed over disjoint key sets: the log-sum-exp (lse) merge.

If keys are split into sets ``K_1 .. K_S`` and attention over each set gives a normalised output ``o_s`` and a
log-sum-exp ``l_s = log sum_{j in K_s} exp(scale * q . k_j)``, attention over the union is::

    l = log sum_s exp(l_s)                 (computed as m + log sum_s exp(l_s - m), m = max_s l_s)
    o = sum_s exp(l_s - l) * o_s

This is what flash-decoding (split-KV) and ring attention (one K/V block per ring step) finish with.

Layout is rawflash's: an output is ``(batch, seqlen_q, heads, head_dim)`` and its lse ``(batch, heads,
seqlen_q)``, exactly what :func:`rawflash.forward` returns; :func:`combine` takes them stacked on a leading split
axis. lse is in natural log (as rawflash and flash-attn return it); FlashInfer's kernels use base 2, see
:func:`lse_to_base2` / :func:`lse_from_base2`. A row whose lse is ``-inf`` in every split (it saw no key) gets
``out = 0`` and ``lse = -inf``, never NaN and never a NumPy warning; such a row's partial outputs must be finite
(rawflash gives 0 there), since they are multiplied by a zero weight. A NaN or ``+inf`` lse gives NaN.

NumPy in, NumPy out; CuPy in, CuPy out (queued on the current stream). The math is float32 whatever the input
precision, and results are float32.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ._xp import Array, array_module
from .arrays import dtype_name

__all__ = ["combine", "merge", "lse_to_base2", "lse_from_base2"]

_OUT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_LSE_DTYPES = ("float32", "float64")
_LN2 = math.log(2.0)


def combine(out_partials: Array | Sequence[Array],
            lse_partials: Array | Sequence[Array]) -> tuple[Array, Array]:
    """Attention over the union of disjoint key sets, from the attention over each set.

    Parameters
    ----------
    out_partials : array (num_splits, batch, seqlen_q, heads, head_dim), or a sequence of num_splits arrays
        (batch, seqlen_q, heads, head_dim); float16, bfloat16, float32 or float64. Split ``s``'s normalised output.
    lse_partials : array (num_splits, batch, heads, seqlen_q), or a sequence of num_splits arrays
        (batch, heads, seqlen_q); float32 or float64, natural log. ``-inf`` where a row saw no key of split ``s``.

    Returns
    -------
    out : array (batch, seqlen_q, heads, head_dim) float32
        ``sum_s exp(lse_s - lse) * out_s``; 0 for rows with no key in any split.
    lse : array (batch, heads, seqlen_q) float32
        ``log sum_s exp(lse_s)``; ``-inf`` for rows with no key in any split.

    Raises
    ------
    TypeError
        An argument is not an array of a supported dtype, or the two mix NumPy and CuPy.
    ValueError
        Shapes do not follow the layout above, or ``num_splits`` is 0.
    """
    out_partials = _stacked(out_partials, "out_partials")
    lse_partials = _stacked(lse_partials, "lse_partials")
    xp = _check_pair(out_partials, lse_partials, "out_partials", "lse_partials", split_axis=True)
    f32 = np.float32
    lse = lse_partials.astype(f32, copy=False)
    row_max = lse.max(axis=0)
    shift = xp.where(row_max == -np.inf, f32(0), row_max)  # all -inf: any finite shift gives weights 0
    weights = xp.exp(lse - shift)                            # (num_splits, batch, heads, seqlen_q), -inf -> 0
    total = weights.sum(axis=0)
    seen = total > 0
    safe_total = xp.where(seen, total, f32(1))
    out_lse = xp.where(seen, shift + xp.log(safe_total), f32(-np.inf))
    weights = (weights / safe_total).transpose(0, 1, 3, 2)[..., None]   # to out's layout (s, b, seqlen_q, h, 1)
    out = (weights * out_partials.astype(f32, copy=False)).sum(axis=0)
    return out, out_lse


def merge(out_a: Array, lse_a: Array, out_b: Array, lse_b: Array) -> tuple[Array, Array]:
    """Two-operand :func:`combine` (``combine([out_a, out_b], [lse_a, lse_b])`` without stacking copies).

    For incremental use, e.g. one ring step at a time: ``out, lse = merge(out, lse, block_out, block_lse)``.

    Parameters
    ----------
    out_a, out_b : arrays (batch, seqlen_q, heads, head_dim), float16, bfloat16, float32 or float64
    lse_a, lse_b : arrays (batch, heads, seqlen_q), float32 or float64, natural log

    Returns
    -------
    out : array (batch, seqlen_q, heads, head_dim) float32
    lse : array (batch, heads, seqlen_q) float32
    """
    xp = _check_pair(out_a, lse_a, "out_a", "lse_a", split_axis=False)
    if array_module(out_b) is not xp:
        raise TypeError(f"out_b must be an array of the same library as out_a ({xp.__name__}), "
                        f"got {type(out_b).__name__}")
    _check_pair(out_b, lse_b, "out_b", "lse_b", split_axis=False)
    if tuple(out_b.shape) != tuple(out_a.shape):
        raise ValueError(f"out_b must have out_a's shape {tuple(out_a.shape)}, got {tuple(out_b.shape)}")
    f32 = np.float32
    la, lb = lse_a.astype(f32, copy=False), lse_b.astype(f32, copy=False)
    row_max = xp.maximum(la, lb)
    shift = xp.where(row_max == -np.inf, f32(0), row_max)
    wa, wb = xp.exp(la - shift), xp.exp(lb - shift)
    total = wa + wb
    seen = total > 0
    safe_total = xp.where(seen, total, f32(1))
    out_lse = xp.where(seen, shift + xp.log(safe_total), f32(-np.inf))
    wa = (wa / safe_total).transpose(0, 2, 1)[..., None]                # (batch, seqlen_q, heads, 1)
    wb = (wb / safe_total).transpose(0, 2, 1)[..., None]
    out = wa * out_a.astype(f32, copy=False) + wb * out_b.astype(f32, copy=False)
    return out, out_lse


def lse_to_base2(lse: Array) -> Array:
    """Natural-log lse -> base-2 lse (FlashInfer's convention): ``lse / ln 2``; ``-inf`` stays ``-inf``.

    Parameters
    ----------
    lse : array, any shape, float32 or float64

    Returns
    -------
    array like ``lse``
    """
    _check_lse_dtype(lse, "lse")
    return lse * lse.dtype.type(1.0 / _LN2)


def lse_from_base2(lse2: Array) -> Array:
    """Base-2 lse (FlashInfer's convention) -> natural-log lse: ``lse2 * ln 2``; ``-inf`` stays ``-inf``.

    Parameters
    ----------
    lse2 : array, any shape, float32 or float64

    Returns
    -------
    array like ``lse2``
    """
    _check_lse_dtype(lse2, "lse2")
    return lse2 * lse2.dtype.type(_LN2)


def _stacked(x, name: str):
    """An array as it is; a non-empty sequence of arrays stacked on a new leading axis."""
    if isinstance(x, Sequence) and not isinstance(x, (str, bytes)):
        if len(x) == 0:
            raise ValueError(f"{name} must hold at least one split, got an empty sequence")
        xp = array_module(_array(x[0], f"{name}[0]"))
        for i, part in enumerate(x):
            if array_module(_array(part, f"{name}[{i}]")) is not xp:
                raise TypeError(f"{name} must hold arrays of one library, got {type(x[0]).__name__} and "
                                f"{type(part).__name__}")
        return xp.stack(list(x))
    return _array(x, name)


def _array(x, name: str):
    if not (isinstance(x, np.ndarray) or type(x).__module__.startswith("cupy")):
        raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(x).__name__}")
    return x


def _check_lse_dtype(x, name: str) -> None:
    _array(x, name)
    if dtype_name(x.dtype) not in _LSE_DTYPES:
        raise TypeError(f"{name} must be float32 or float64, got {dtype_name(x.dtype)}")


def _check_pair(out, lse, out_name: str, lse_name: str, split_axis: bool):
    """Check an (out, lse) pair against the layout; returns their array module."""
    _array(out, out_name)
    _array(lse, lse_name)
    xp = array_module(out)
    if array_module(lse) is not xp:
        raise TypeError(f"{out_name} and {lse_name} must be arrays of one library (both NumPy or both CuPy), got "
                        f"{type(out).__name__} and {type(lse).__name__}")
    lead = "num_splits, " if split_axis else ""
    ndim = 5 if split_axis else 4
    shape = tuple(int(s) for s in out.shape)
    if len(shape) != ndim:
        raise ValueError(f"{out_name} must have {ndim} dimensions ({lead}batch, seqlen_q, heads, head_dim), got "
                         f"shape {shape}")
    if split_axis and shape[0] == 0:
        raise ValueError(f"{out_name} must hold at least one split, got num_splits 0")
    if dtype_name(out.dtype) not in _OUT_DTYPES:
        raise TypeError(f"{out_name} must have dtype float16, bfloat16, float32 or float64, got "
                        f"{dtype_name(out.dtype)}")
    _check_lse_dtype(lse, lse_name)
    want = shape[:-4] + (shape[-4], shape[-2], shape[-3])   # (num_splits,) batch, heads, seqlen_q
    if tuple(int(s) for s in lse.shape) != want:
        raise ValueError(f"{lse_name} must have shape ({lead}batch, heads, seqlen_q) = {want} to match "
                         f"{out_name} {shape}, got {tuple(lse.shape)}")
    return xp
