"""The online softmax of the twins: the counterpart of ``cuda/softmax.cuh``.

FlashAttention's running softmax over key blocks (FA2 Alg.1 l.9-13) for the row a thread holds: its max m (log2
units) and sum l, their update by one block of scores, and the end of the row (the factor O is divided by, the
lse, the sink's share of the denominator, and the -inf guards of rows that see nothing).
"""
from __future__ import annotations

import math

from numba import cuda

from .common import LN2, NEG_INF, ONE, ZERO, exp2, row_max


@cuda.jit(device=True)
def finalize_row(m, l, sink_log2, normalized):
    """The end of a row (Alg.1 l.12-13) -> (f, lse): f multiplies the running O, lse is the natural-log denominator.

    A sink logit (log2 units, -inf for none) joins the denominator with no value. A row that saw no key gets f = 0
    and lse = -inf, or lse = sink with a sink. ``normalized``: O is already divided by l (per-step normalisation).
    """
    if sink_log2 == NEG_INF:
        f = (ONE if normalized else ONE / l) if l > ZERO else ZERO
        lse = m * LN2 + math.log(l) if l > ZERO else NEG_INF
    else:
        mm = max(m, sink_log2)
        a = exp2(m - mm)
        denom = l * a + exp2(sink_log2 - mm)
        f = (l if normalized else ONE) * a / denom
        lse = (mm + math.log2(denom)) * LN2
    return f, lse


@cuda.jit(device=True)
def update(s, scale, m, l, normalize, stale_log2):
    """One key block (Alg.1 l.9-10) for one row -> (m, l, fo).

    ``s`` (the row's scores times ``scale`` are in log2 units) becomes P = exp2(S scale - m_new) in place,
    l = e^(m_old - m_new) l + rowsum(P), and fo = e^(m_old - m_new) is the factor the running O must be multiplied
    by. ``normalize`` (FA1's per-step normalisation, the defer_norm=False ablation) also divides P by the new l and
    makes fo = l_old e^(m_old - m_new) / l_new, so the running O stays normalised. ``stale_log2`` (FA4's lazy
    rescale; 0: off): the max stays while the block's exceeds it by at most this; fo is then exactly 1 and P may
    reach 2^stale_log2.
    """
    # MIRROR: one row per thread, its max and sum by sequential loops; the CUDA C reduces each row over a quad.
    cand = max(m, row_max(s) * scale)
    keep = stale_log2 > ZERO and cand - m <= stale_log2  # (never while the row has seen nothing: inf or NaN)
    m_new = m if keep else cand
    mx = ZERO if m_new == NEG_INF else m_new  # a row with nothing visible yet keeps P = 0
    fo = ONE if keep else exp2(m - mx)
    rs = ZERO
    for y in range(s.shape[0]):
        s[y] = exp2(s[y] * scale - mx)
        rs += s[y]
    l_new = fo * l + rs
    if normalize:
        inv = ONE / l_new if l_new > ZERO else ZERO
        fo *= l * inv
        for y in range(s.shape[0]):
            s[y] *= inv
    return m_new, l_new, fo
