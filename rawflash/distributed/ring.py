"""Ring attention: exact attention over a sequence sharded across ranks, K/V blocks travelling a ring.

Each of the P ranks holds one shard of q, k, v (:mod:`rawflash.distributed.sharding`). At step s = 0 .. P-1 a
rank holds the K/V shard of rank ``src = (rank - s) mod P``; it computes attention of its queries against that
block (the part the causal mask lets it see, :func:`schedule`) while the block moves on to ``rank + 1`` and the
next one arrives from ``rank - 1``, and it merges the block's (out, lse) into its running result with the lse
combine (:func:`rawflash.combine.merge`). After P steps every query has seen every key.

Backward: the same blocks in the same order. Each block's gradients come from the kernels' recomputation with the
merged (global) ``out`` and ``lse`` (see :mod:`rawflash.distributed.blocks`), so they are that block's exact share.
dq is summed locally in float32; dk and dv are summed in float32 buffers that travel the ring with their K/V
block, every rank adding its share, and arrive back at the block's owner after P passes.

Causal masks are over global positions. Zigzag (rank r holds chunks r and 2P-1-r, each of length c = n/2 for a
local length n), at the step that brings rank ``src``'s block:

- ``src == rank``: the local block, causal (the local order of the two chunks is also their global order);
- ``src < rank``: every local query sees the block's first chunk (chunk src < r), none of its second chunk
  (2P-1-src > 2P-1-r): all local rows against K/V rows ``[0, c)``, not causal;
- ``src > rank``: only the local second chunk (2P-1-r > src, and > 2P-1-src) sees the block, all of it: local rows
  ``[c, 2c)`` against all K/V rows, not causal.

Every rank does the same causal work (half a block per step). Contiguous: blocks from ``src < rank`` are fully
visible, ``src == rank`` is causal, ``src > rank`` is skipped (the last rank does the most work).
"""
from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from .. import arrays, validation
from .._xp import Array, array_module
from ..combine import merge
from . import blocks
from .comm import Communicator
from .sharding import check_layout


@dataclasses.dataclass(frozen=True)
class Block:
    """One ring step's attention: local query rows ``rows`` against rows ``cols`` of the K/V block held."""

    rows: slice
    cols: slice
    causal: bool


def schedule(layout: str, causal: bool, rank: int, world_size: int, seqlen: int) -> list[Block | None]:
    """The block computed at each ring step (None: nothing visible, skipped), for a local length ``seqlen``.

    Step ``s`` holds the K/V shard of rank ``(rank - s) % world_size``; step 0 is always the whole local block.
    """
    check_layout(layout)
    every, half = slice(0, seqlen), seqlen // 2
    steps: list[Block | None] = []
    for step in range(world_size):
        src = (rank - step) % world_size
        if not causal:
            steps.append(Block(every, every, False))
        elif src == rank:
            steps.append(Block(every, every, True))
        elif layout == "contiguous":
            steps.append(Block(every, every, False) if src < rank else None)
        elif src < rank:
            steps.append(Block(every, slice(0, half), False))
        else:
            steps.append(Block(slice(half, seqlen), every, False))
    return steps


def ring_attention(q: Array, k: Array, v: Array, comm: Communicator, *, causal: bool = False,
                   scale: float | None = None, layout: str = "zigzag", backend: str = "cupy") -> tuple[Array, Array]:
    """Exact attention over a sequence sharded across the ranks of ``comm``: this rank's (out, lse).

    Every rank calls it with its own shards (:func:`rawflash.distributed.shard`), all of one shape.

    Parameters
    ----------
    q : array (batch, n, heads, head_dim), float16, bfloat16 or float32
        This rank's query shard: n = seqlen / world_size tokens, in ``layout``'s order.
    k, v : arrays (batch, n, kv_heads, head_dim), q's dtype; heads % kv_heads == 0 (GQA / MQA)
        This rank's key / value shards (the same tokens as q: ring attention is self-attention).
    comm : communicator
        :class:`~rawflash.distributed.NcclComm` (one process per GPU), or a rank of
        :class:`~rawflash.distributed.LocalRing` (in one process).
    causal : bool
        Causal over global positions (query i sees key j iff j <= i).
    scale : float, optional
        Softmax scale, default 1/sqrt(head_dim).
    layout : {'zigzag', 'contiguous'}
        How the sequence was sharded. zigzag needs n even (seqlen divisible by 2 * world_size).
    backend : {'cupy', 'numba', 'reference'}
        Computes each block (:func:`rawflash.forward`). The result is the same within rounding.

    Returns
    -------
    out : array like q
    lse : array (batch, heads, n) float32, natural log over every key of the sequence the row sees.

    The K/V block of the next step is sent and received while the current block is computed (on NCCL: on the
    communicator's stream, ordered against the current stream by events). Work is queued on CuPy's current stream.
    """
    q, k, v = (arrays.import_array(x, name) for name, x in (("q", q), ("k", k), ("v", v)))
    c = validation.check_forward(q, k, v, causal, scale, "fa2", backend)
    _check_ring(c.problem, comm, layout, {"q": q, "k": k, "v": v})
    p, xp, f32 = c.problem, array_module(q), np.float32
    if _is_empty(p):
        return xp.zeros(q.shape, q.dtype), xp.full((p.batch, p.heads, p.seqlen_q), -np.inf, dtype=f32)
    steps = schedule(layout, p.causal, comm.rank, comm.world_size, p.seqlen_q)
    out = lse = None
    kv = [k, v]
    for step, block in enumerate(steps):
        pending = comm.ring_pass(kv) if step + 1 < len(steps) else None     # the next block travels meanwhile
        if block is not None:
            bo, bl = blocks.forward(q[:, block.rows], kv[0][:, block.cols], kv[1][:, block.cols],
                                    causal=block.causal, scale=c.scale, backend=backend)
            if out is None:                                  # step 0: the whole local block
                out, lse = bo.astype(f32), bl.astype(f32)
            else:
                out, lse = _merge_rows(out, lse, block.rows, bo, bl)
        if pending is not None:
            kv = pending.wait()
    return out.astype(q.dtype), lse


def ring_attention_backward(dout: Array, q: Array, k: Array, v: Array, out: Array, lse: Array,
                            comm: Communicator, *, causal: bool = False, scale: float | None = None,
                            layout: str = "zigzag", deterministic: bool = False,
                            backend: str = "cupy") -> tuple[Array, Array, Array]:
    """Gradients of ``sum(out * dout)`` over the whole sequence, for this rank's shards.

    Parameters
    ----------
    dout : array like q
        The gradient of this rank's ``out``.
    q, k, v, comm, causal, scale, layout, backend
        As given to :func:`ring_attention`.
    out, lse : what :func:`ring_attention` returned on this rank
    deterministic : bool
        Passed to each block's :func:`rawflash.backward`; the ring adds the blocks in a fixed order, so True
        makes the whole result bitwise repeatable.

    Returns
    -------
    dq : array like q
    dk, dv : arrays like k: this rank's K/V shard's gradients, summed over every rank's queries (and over the
        query heads of each GQA group).
    """
    named = (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse))
    dout, q, k, v, out, lse = (arrays.import_array(x, name) for name, x in named)
    c = validation.check_backward(dout, q, k, v, out, lse, causal, scale, deterministic, backend)
    _check_ring(c.problem, comm, layout, dict(zip([n for n, _ in named], (dout, q, k, v, out, lse))))
    p, xp, f32 = c.problem, array_module(q), np.float32
    if _is_empty(p):
        return xp.zeros(q.shape, q.dtype), xp.zeros(k.shape, k.dtype), xp.zeros(v.shape, v.dtype)
    steps = schedule(layout, p.causal, comm.rank, comm.world_size, p.seqlen_q)
    world = len(steps)
    dq = xp.zeros(q.shape, f32)
    kv, dkv, dkv_pending = [k, v], None, None
    for step, block in enumerate(steps):
        kv_pending = comm.ring_pass(kv) if step + 1 < world else None
        grads = None
        if block is not None:
            r, cols = block.rows, block.cols
            grads = blocks.backward(dout[:, r], q[:, r], kv[0][:, cols], kv[1][:, cols], out[:, r], lse[:, :, r],
                                    causal=block.causal, scale=c.scale, deterministic=deterministic,
                                    backend=backend)
            dq[:, r] += grads[0].astype(f32)
        # the dk, dv buffers of the block held: the shares of the ranks it has visited, or new at step 0
        dkv = dkv_pending.wait() if dkv_pending is not None else [xp.zeros(k.shape, f32), xp.zeros(v.shape, f32)]
        if grads is not None:
            dkv[0][:, block.cols] += grads[1].astype(f32)
            dkv[1][:, block.cols] += grads[2].astype(f32)
        if world > 1:           # after the last step's pass each buffer is back with its block's owner
            dkv_pending = comm.ring_pass(dkv)
        if kv_pending is not None:
            kv = kv_pending.wait()
    dk, dv = dkv_pending.wait() if world > 1 else dkv
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _merge_rows(out, lse, rows: slice, block_out, block_lse):
    """Merge a block's (out, lse) into rows ``rows`` of the running (out, lse) (float32)."""
    if rows == slice(0, out.shape[1]):
        return merge(out, lse, block_out, block_lse)
    out[:, rows], lse[:, :, rows] = merge(out[:, rows], lse[:, :, rows], block_out, block_lse)
    return out, lse


def _is_empty(p) -> bool:
    return p.batch == 0 or p.seqlen_q == 0 or p.heads == 0


def _check_ring(p, comm, layout, named) -> None:
    """The ring's own checks, after the single-GPU API's: communicator, layout, shard lengths, array kinds."""
    for attr in ("rank", "world_size"):
        value = getattr(comm, attr, None)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"comm must be a communicator (rawflash.distributed.NcclComm, or a LocalRing rank) with "
                            f"int {attr}, got {type(comm).__name__}")
    for attr in ("ring_pass", "check"):
        if not callable(getattr(comm, attr, None)):
            raise TypeError(f"comm must be a communicator with a {attr}() method, got {type(comm).__name__}")
    if comm.world_size < 1 or not 0 <= comm.rank < comm.world_size:
        raise ValueError(f"comm must have world_size >= 1 and 0 <= rank < world_size, got rank {comm.rank}, "
                         f"world_size {comm.world_size}")
    check_layout(layout)
    if p.seqlen_q != p.seqlen_k:
        raise ValueError(f"ring attention is self-attention over one sharded sequence: q and k must hold the same "
                         f"number of tokens per rank, got q {p.seqlen_q}, k {p.seqlen_k}")
    if layout == "zigzag" and p.seqlen_q % 2:
        raise ValueError(f"layout='zigzag' holds two equal chunks per rank: the shard length (axis 1 of q) must be "
                         f"even, got {p.seqlen_q} (the sequence length must be divisible by 2 * world_size)")
    comm.check(named)
