"""Splitting one sequence across ranks, and putting it back together.

Two layouts of a sequence of length N over P ranks:

- ``contiguous``: N is cut into P chunks; rank r holds chunk r. Causal attention is unbalanced (rank P-1 does
  P times the work of rank 0).
- ``zigzag``: N is cut into 2P chunks; rank r holds chunks r and 2P-1-r, in that order. Every rank then does the
  same causal work (a chunk near the start pairs with one near the end).

N must be divisible by the number of chunks (P for contiguous, 2P for zigzag): every rank holds the same number
of tokens, which the ring exchange of equal-sized K/V blocks relies on.
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np

from .._xp import Array, array_module

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(repr(x) for x in LAYOUTS)}, got {layout!r}")
    return layout


def num_chunks(layout: str, world_size: int) -> int:
    """How many equal chunks the sequence is cut into: 2P for zigzag, P for contiguous."""
    return 2 * world_size if check_layout(layout) == "zigzag" else world_size


def chunks_of(rank: int, world_size: int, layout: str) -> tuple[int, ...]:
    """The chunk numbers rank ``rank`` holds, in the order they appear in its shard."""
    _check_rank(rank, world_size)
    return (rank, 2 * world_size - 1 - rank) if check_layout(layout) == "zigzag" else (rank,)


def shard_positions(seqlen: int, rank: int, world_size: int, layout: str = "zigzag") -> np.ndarray:
    """Global token positions of rank ``rank``'s shard (e.g. the position ids for rotary embeddings).

    Returns
    -------
    ndarray (seqlen // world_size,) int64
    """
    if isinstance(seqlen, bool) or not isinstance(seqlen, numbers.Integral):
        raise TypeError(f"seqlen must be an int, got {type(seqlen).__name__} {seqlen!r}")
    if seqlen < 0:
        raise ValueError(f"seqlen must be >= 0, got {seqlen}")
    chunk = _chunk_length(int(seqlen), world_size, layout, "seqlen")
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk, dtype=np.int64)
                           for c in chunks_of(rank, world_size, layout)])


def shard(x: Array, rank: int, world_size: int, *, layout: str = "zigzag", axis: int = 1) -> Array:
    """Rank ``rank``'s shard of the full-sequence array ``x``: a new array (NumPy or CuPy, as ``x``).

    Parameters
    ----------
    x : array whose axis ``axis`` is the sequence; e.g. q, k, v, out or dout (batch, seqlen, heads, head_dim)
        with ``axis=1``, or lse (batch, heads, seqlen) with ``axis=2``.
    rank, world_size : int, 0 <= rank < world_size
    layout : {'zigzag', 'contiguous'}
    axis : int

    Returns
    -------
    array like ``x`` with ``x.shape[axis] // world_size`` along ``axis``; zigzag: chunk ``rank`` then chunk
    ``2 * world_size - 1 - rank``.
    """
    axis = _check_axis(x, axis, "x")
    chunk = _chunk_length(int(x.shape[axis]), world_size, layout, "x")
    xp = array_module(x)
    parts = [_take(x, axis, c * chunk, (c + 1) * chunk) for c in chunks_of(rank, world_size, layout)]
    return xp.concatenate(parts, axis=axis) if len(parts) > 1 else parts[0].copy()


def gather(shards: Sequence[Array], *, layout: str = "zigzag", axis: int = 1) -> Array:
    """The full-sequence array from every rank's shard (the inverse of :func:`shard`).

    Parameters
    ----------
    shards : sequence of world_size arrays of one shape, in rank order (e.g. collected from every rank)
    layout : {'zigzag', 'contiguous'}
    axis : int, the sequence axis

    Returns
    -------
    array with ``world_size`` times the shards' length along ``axis``
    """
    check_layout(layout)
    if isinstance(shards, (str, bytes)) or not isinstance(shards, Sequence) or len(shards) == 0:
        raise TypeError(f"shards must be a non-empty sequence of arrays (one per rank), got {type(shards).__name__}")
    shape = tuple(shards[0].shape)
    for r, s in enumerate(shards):
        if tuple(s.shape) != shape:
            raise ValueError(f"shards must share one shape, got {shape} for rank 0 and {tuple(s.shape)} for rank {r}")
    axis = _check_axis(shards[0], axis, "shards[0]")
    world_size = len(shards)
    per_rank = len(chunks_of(0, world_size, layout))
    if shape[axis] % per_rank:
        raise ValueError(f"layout='zigzag' shards hold two equal chunks: their length along axis {axis} must be "
                         f"even, got {shape[axis]}")
    chunk = shape[axis] // per_rank
    ordered = [None] * num_chunks(layout, world_size)
    for r, s in enumerate(shards):
        for i, c in enumerate(chunks_of(r, world_size, layout)):
            ordered[c] = _take(s, axis, i * chunk, (i + 1) * chunk)
    return array_module(shards[0]).concatenate(ordered, axis=axis)


def _take(x, axis: int, start: int, stop: int):
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop)
    return x[tuple(index)]


def _check_rank(rank, world_size) -> None:
    for name, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size) = [0, {world_size}), got {rank}")


def _check_axis(x, axis, name: str) -> int:
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"axis must be an int, got {type(axis).__name__} {axis!r}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for {name} of shape {tuple(x.shape)}")
    return int(axis) % x.ndim


def _chunk_length(seqlen: int, world_size: int, layout: str, name: str) -> int:
    """The chunk length, or a ValueError naming ``name`` when the sequence does not cut evenly."""
    _check_rank(0, world_size)
    n = num_chunks(layout, world_size)
    if seqlen % n:
        rule = "2 * world_size" if layout == "zigzag" else "world_size"
        raise ValueError(f"layout={layout!r} cuts the sequence into {rule} = {n} equal chunks: {name}'s sequence "
                         f"length must be divisible by {n}, got {seqlen}")
    return seqlen // n
