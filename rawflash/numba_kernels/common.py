"""Tile verbs of the Numba twins: the counterpart of ``cuda/common.cuh``.

The CUDA C spreads each tile over the 32 lanes of a warp in ``mma.sync`` fragments; the twins give every thread
whole rows and do scalar float32 arithmetic, so fragments, ``ldmatrix``, ``mma``, swizzles and the quad
shuffles of ``row_max``/``row_sum`` have no counterpart here. What is left: the mask rules (one owner, as in
the CUDA C), the exponential, and the global -> shared copy.

The products compute one output element per call (a device-function call costs about 20 us on the simulator,
against about 1 us per multiply-add, so they are never called per term).
"""
from __future__ import annotations

import collections
import math

import numpy as np
from numba import cuda, float32

LOG2E = float32(1.4426950408889634)
LN2 = float32(0.6931471805599453)
INF = float32(np.inf)
NEG_INF = float32(-np.inf)
ZERO = float32(0.0)
ONE = float32(1.0)

if hasattr(math, "exp2"):
    # MIRROR: exp2f for every dtype; the CUDA C's exp2_<float> goes through double (2 ulp apart, far below 1e-5).
    exp2 = math.exp2
else:  # Python 3.10 has no math.exp2

    @cuda.jit(device=True)
    def exp2(x):
        return math.pow(float32(2.0), x)


# ---------------------------------------------------------------- global -> shared copies
@cuda.jit(device=True)
def load_tile(s, g, row0, rows_valid, cols_valid):
    """Copy rows ``row0 ..`` of ``g`` (seqlen x head_dim, any dtype) into the float32 shared tile ``s``.

    Rows ``>= rows_valid`` and columns ``>= cols_valid`` of the tile read as 0. All threads of the CTA take part.
    """
    # MIRROR: a plain synchronous copy with an upcast (the CUDA C uses cp.async into swizzled 16-byte chunks of T);
    # the next cuda.syncthreads() makes it visible, where the CUDA C waits on cp.async first.
    rows, cols = s.shape
    for idx in range(cuda.threadIdx.x, rows * cols, cuda.blockDim.x):
        row = idx // cols
        col = idx % cols
        s[row, col] = float32(g[row0 + row, col]) if row < rows_valid and col < cols_valid else ZERO


# ---------------------------------------------------------------- products, one output element per call
# MIRROR: a scalar dot product per element where the CUDA C runs mma.sync (16-bit) or its FMA emulation (float32).
# Sums run in blocks of SUM_BLOCK terms that are then added (two-level summation), as the CUDA C's float32
# products do: the rounding error grows like 16 + n/16 terms instead of n.
SUM_BLOCK = 16


@cuda.jit(device=True)
def dot_rows(a, i, b, j):
    """sum_c a[i, c] * b[j, c]: one element of A B^T (gemm_abt)."""
    n = a.shape[1]
    acc = ZERO
    for c0 in range(0, n, SUM_BLOCK):
        part = ZERO
        for c in range(c0, min(c0 + SUM_BLOCK, n)):
            part += a[i, c] * b[j, c]
        acc += part
    return acc


@cuda.jit(device=True)
def dot_cols(a, i, b, j):
    """sum_y a[y, i] * b[y, j]: one element of A^T B (gemm_atb)."""
    n = a.shape[0]
    acc = ZERO
    for y0 in range(0, n, SUM_BLOCK):
        part = ZERO
        for y in range(y0, min(y0 + SUM_BLOCK, n)):
            part += a[y, i] * b[y, j]
        acc += part
    return acc


@cuda.jit(device=True)
def dot_vec_col(p, b, row0, j):
    """sum_y p[y] * b[row0 + y, j]: one element of P B with the row p of P held by this thread (gemm_rb)."""
    n = p.shape[0]
    acc = ZERO
    for y0 in range(0, n, SUM_BLOCK):
        part = ZERO
        for y in range(y0, min(y0 + SUM_BLOCK, n)):
            part += p[y] * b[row0 + y, j]
        acc += part
    return acc


@cuda.jit(device=True)
def dot_vecs(x, y):
    """sum_c x[c] * y[c] in float32 over two rows in global memory (any dtype), summed as dot_rows sums."""
    n = x.shape[0]
    acc = ZERO
    for c0 in range(0, n, SUM_BLOCK):
        part = ZERO
        for c in range(c0, min(c0 + SUM_BLOCK, n)):
            part += float32(x[c]) * float32(y[c])
        acc += part
    return acc


# ---------------------------------------------------------------- masking (one owner for every mask rule)
# Query row i sees key j iff j < seqlen_k and (not causal or j <= i + seqlen_k - seqlen_q): causal masks are
# aligned to the bottom-right corner. Sliding windows, soft-capping or ALiBi would join here.
Mask = collections.namedtuple("Mask", ["seqlen_q", "seqlen_k", "causal"])


@cuda.jit(device=True)
def row_end(mask, i):
    """Keys ``j < row_end(mask, i)`` are visible to query ``i``."""
    if mask.causal:
        return min(mask.seqlen_k, max(0, i + 1 + mask.seqlen_k - mask.seqlen_q))
    return mask.seqlen_k


@cuda.jit(device=True)
def block_needs_mask(mask, r0, nr, c0, nc):
    """True when some (i, j) of rows [r0, r0+nr) x cols [c0, c0+nc) is hidden: only those blocks mask."""
    return c0 + nc > mask.seqlen_k or (mask.causal and c0 + nc - 1 > r0 + mask.seqlen_k - mask.seqlen_q)


@cuda.jit(device=True)
def key_blocks(mask, r0, nr, bc):
    """Number of key blocks of width ``bc`` that the query rows [r0, r0+nr) see at all (later ones are skipped)."""
    last = mask.seqlen_k - 1
    if mask.causal:
        last = min(last, r0 + nr - 1 + mask.seqlen_k - mask.seqlen_q)
    return 0 if last < 0 else last // bc + 1


@cuda.jit(device=True)
def first_query_block(mask, c0, br):
    """First query block of height ``br`` that sees any key of the block starting at key ``c0``."""
    if not mask.causal:
        return 0
    first_row = c0 - (mask.seqlen_k - mask.seqlen_q)
    return 0 if first_row <= 0 else first_row // br


@cuda.jit(device=True)
def apply_mask(s, mask, row, c0):
    """Set ``s[y] = -inf`` for the keys ``c0 + y`` that query ``row`` does not see (``s`` is one row of S)."""
    # MIRROR: one row per thread; the CUDA C masks the C-fragment elements a lane holds.
    end = row_end(mask, row) - c0
    for y in range(max(0, end), s.shape[0]):
        s[y] = NEG_INF


@cuda.jit(device=True)
def apply_mask_t(p, mask, key, q0):
    """The same rule for one row of S^T: ``p[c] = -inf`` where query ``q0 + c`` does not see ``key``."""
    for c in range(p.shape[0]):
        if key >= row_end(mask, q0 + c):
            p[c] = NEG_INF


# ---------------------------------------------------------------- row statistics (a thread owns its row)
@cuda.jit(device=True)
def row_max(s):
    """max_y s[y] (-inf for an empty or fully hidden row)."""
    # MIRROR: a sequential loop over the row; the CUDA C reduces a row over the 4 lanes of a quad with shuffles.
    m = NEG_INF
    for y in range(s.shape[0]):
        m = max(m, s[y])
    return m
