"""Tile verbs of the Numba twins: the counterpart of ``cuda/core.cuh``, ``cuda/acc.cuh`` and ``cuda/sm80.cuh``.

The CUDA C spreads each tile over the 32 lanes of a warp in ``mma.sync`` fragments (``Acc<MT, NT>``); the twins
give every thread whole rows and do scalar float32 arithmetic, so fragments, ``ldmatrix``, ``mma``, swizzles, the
quad shuffles of ``row_max`` / ``row_sum`` and ``cp.async`` have no counterpart here. What is left: the constants,
the exponential, the global -> shared copy, the products (one output element per call) and the row verbs.

The products compute one output element per call (a device-function call costs a few microseconds on the
simulator, against about 1 us per multiply-add, so they are never called per term).
"""
from __future__ import annotations

import collections
import math

import numpy as np
from numba import cuda, float32

LOG2E = float32(1.4426950408889634)
LN2 = float32(0.6931471805599453)
LOG2E_D = 1.4426950408889634  # float64, as core.cuh's LOG2E_D
INF = float32(np.inf)
NEG_INF = float32(-np.inf)
ZERO = float32(0.0)
ONE = float32(1.0)

# What a twin factory returns: the compiled kernel, its threads per CTA (None: the launch's own block, as for the
# elementwise kernels) and its dynamic shared memory in bytes (float32 tiles).
Twin = collections.namedtuple("Twin", ["kernel", "threads", "smem"])

# A mainloop as the skeletons (fwd.py, bwd.py) compose it, the counterpart of a Mainloop template argument: its
# tile rows BR and columns BC, the twin's threads per CTA and shared memory (bytes), the float32 words of its
# per-thread State, its policy's constants (MASK, GENERAL, EXACT: T is float) and its device functions run, store.
Mainloop = collections.namedtuple("Mainloop", ["BR", "BC", "NTHREADS", "SMEM_BYTES", "STATE_WORDS", "MASK",
                                               "GENERAL", "EXACT", "run", "store"])


def is_float32(T: str) -> bool:
    """Whether the CUDA element type of a launch's template arguments is float (core.cuh's sizeof(T) == 4)."""
    return T == "float"


if hasattr(math, "exp2"):
    # MIRROR: exp2f for every dtype; the CUDA C's exp2_<float> goes through double (2 ulp apart, far below 1e-5).
    exp2 = math.exp2
else:  # Python 3.10 has no math.exp2

    @cuda.jit(device=True)
    def exp2(x):
        return math.pow(float32(2.0), x)


@cuda.jit(device=True)
def cdiv(a, b):
    """core.cuh's cdiv (its arguments are never negative in the kernels, so C and Python division agree)."""
    return (a + b - 1) // b


# ---------------------------------------------------------------- global -> shared copies
@cuda.jit(device=True)
def load_tile(s, g, row0, rows_valid, cols_valid):
    """Copy rows ``row0 ..`` of ``g`` (rows x head_dim, any dtype, any strides) into the float32 shared tile ``s``.

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


# ---------------------------------------------------------------- row verbs (a thread owns its row)
@cuda.jit(device=True)
def zero(x):
    """x = 0 (acc.cuh's zero for the row a thread holds)."""
    for c in range(x.shape[0]):
        x[c] = ZERO


@cuda.jit(device=True)
def row_max(s):
    """max_y s[y] (-inf for an empty or fully hidden row)."""
    # MIRROR: a sequential loop over the row; the CUDA C reduces a row over the 4 lanes of a quad with shuffles.
    m = NEG_INF
    for y in range(s.shape[0]):
        m = max(m, s[y])
    return m
