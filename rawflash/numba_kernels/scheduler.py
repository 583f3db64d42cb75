"""Tile schedulers of the twins: which tile a CTA works on, the counterpart of ``cuda/scheduler.cuh``.

One owner for the grid <-> tile mapping of every launch, so a kernel body never reads blockIdx itself;
launch.py's grid formulas (query_tile_grid / key_tile_grid) are the other half of each mapping.
"""
from __future__ import annotations

from numba import cuda

from .common import cdiv


@cuda.jit(device=True)
def varlen_tile(cu, batch, rows, t, reverse):
    """Tile t of packed sequences (cu: batch + 1 offsets) cut into tiles of ``rows`` -> (found, b, i): tile i of
    sequence b, counting the tiles of each sequence in turn; found is False past the last tile (the grid is an
    upper bound: cdiv(total, rows) + batch). Within a sequence the tiles come last-first when ``reverse``."""
    # MIRROR: each thread scans the batch by itself, one sequence at a time; the CUDA C's warps scan 32 sequences
    # at a time with a shuffle prefix sum and a ballot. Same (b, i) for every t.
    before = 0  # tiles of the sequences before b
    for b in range(batch):
        n = cdiv(cu[b + 1] - cu[b], rows)
        if t < before + n:
            return True, b, (before + n - 1 - t if reverse else t - before)
        before += n
    return False, 0, 0


@cuda.jit(device=True)
def q_tile_start(p, g, br, serial, varlen):
    """QTileScheduler<BR, SERIAL, VARLEN>::start -> (ok, b, h, i, stop): the CTA runs query tiles i .. stop - 1 of
    (b, h). Fixed lengths: grid (Tr, heads, batch), the tiles of one (b, h) last-first (under a causal mask the
    longest rows start first); ``serial`` (sequence parallelism off): grid (1, heads, batch), all of them in turn.
    Packed sequences: grid (an upper bound on the tiles of all sequences, heads, 1)."""
    h = cuda.blockIdx.y
    if varlen and p.has_cu:
        found, b, i = varlen_tile(g.cu_q, p.batch, br, cuda.blockIdx.x, True)
        return found, b, h, i, i + 1
    b = cuda.blockIdx.z
    tr = cdiv(p.seqlen_q, br)
    i = 0 if serial else tr - 1 - cuda.blockIdx.x
    stop = tr if serial else i + 1
    return i < stop, b, h, i, stop


@cuda.jit(device=True)
def k_tile_start(p, g, bc, varlen):
    """KTileScheduler<BC, VARLEN>::start -> (ok, b, hk, j): key tile j of kv head hk of sequence b. Grid (Tc,
    kv_heads, batch), or for packed sequences (an upper bound on the key tiles of all sequences, kv_heads, 1)."""
    hk = cuda.blockIdx.y
    if varlen and p.has_cu:
        found, b, j = varlen_tile(g.cu_k, p.batch, bc, cuda.blockIdx.x, False)
        return found, b, hk, j
    return True, cuda.blockIdx.z, hk, cuda.blockIdx.x
