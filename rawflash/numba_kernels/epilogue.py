"""Epilogues of the twins: how a finished tile leaves the chip, the counterpart of ``cuda/epilogue.cuh``.

Forward, register mainloops: FA2 Alg.1 l.12-13, O_i = diag(l_i)^-1 O_i (and the sink's share of the denominator)
written in the output's dtype, L_i = m_i + log(l_i) to lse; rows past the sequence are not written.
"""
from __future__ import annotations

from numba import cuda

from .policy import sink_log2
from .softmax import finalize_row


@cuda.jit(device=True)
def epilogue_fwd(p, g, bi, o, m, l, normalized, r0):
    """Write query row r0 + threadIdx.x of the tile: its running O (``o``, D columns), max m and sum l."""
    # MIRROR: the thread's own row; the CUDA C's warps write 16 MT rows each from C fragments (store_rows and
    # store_row_values).
    f, lse = finalize_row(m, l, sink_log2(p, g, bi), normalized)
    row = r0 + cuda.threadIdx.x
    if row < bi.seqlen_q:
        for c in range(p.head_dim):
            g.o[bi.ab, bi.q_row0 + row, bi.h, c] = o[c] * f
        g.lse[bi.ab, bi.h, bi.q_row0 + row] = lse
