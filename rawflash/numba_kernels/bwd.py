"""The backward skeleton of the twins: key-tile scheduler x mainloop x epilogue (FA2 Alg.2), mirroring
``cuda/bwd.cuh``.

One CTA per key block K_j, V_j of one kv head: the mainloop keeps K_j, V_j in shared memory and dK_j, dV_j on chip
while it walks every query head of the GQA group and every query block Q_i the policy says sees K_j (so the
group's sum needs no atomics); the epilogue writes dK_j, dV_j. Mainloop: mainloop_bwd_sm80.py.
"""
from __future__ import annotations

import collections

from numba import cuda, float32

from .block_info import block_info
from .common import Mainloop, cdiv
from .params import BwdArrays
from .policy import block, is_edge, make_policy, q_blocks, range_n
from .scheduler import k_tile_start

# The walk of one key tile over (query head, query block): iteration it is query block block(qb, s) of query head
# h0 + it / n, s = it % n, with the interior blocks of each head first and its edge blocks after them.
QIter = collections.namedtuple("QIter", ["qb", "h0", "n", "total"])


@cuda.jit(device=True)
def make_qiter(qb, hk, group):
    n = range_n(qb)
    return QIter(qb, hk * group, n, group * n)


@cuda.jit(device=True)
def qiter_head(w, it):
    return w.h0 + it // w.n


@cuda.jit(device=True)
def qiter_block(w, it):
    return block(w.qb, it % w.n)


@cuda.jit(device=True)
def qiter_edge(w, it):
    return is_edge(w.qb, it % w.n)


def make_bwd_kernel(name: str, ml: Mainloop):
    """bwd_kernel<Mainloop> as the kernel ``name`` (the CUDA C's __global__).

    The kernel takes ``(p, q, k, v, out, dout, dq, dk, dv, lse, lse2, delta, dq_ws, dsink_ws, cu_q, cu_k, used_k,
    slopes, sinks)``: the BwdParams namedtuple and the arrays of params.py's BwdArrays.
    """
    BR, BC, STATE, MASK, GENERAL, EXACT, run, store = (ml.BR, ml.BC, ml.STATE_WORDS, ml.MASK, ml.GENERAL, ml.EXACT,
                                                        ml.run, ml.store)

    def bwd_kernel(p, q, k, v, out, dout, dq, dk, dv, lse, lse2, delta, dq_ws, dsink_ws, cu_q, cu_k, used_k, slopes,
                   sinks):
        g = BwdArrays(q, k, v, out, dout, dq, dk, dv, lse, lse2, delta, dq_ws, dsink_ws, cu_q, cu_k, used_k, slopes,
                      sinks)
        # MIRROR: one dynamic float32 array carved like the CUDA C's extern __shared__ smem (static: 48 KB at most).
        smem = cuda.shared.array(0, float32)
        # ---- [bwd:schedule] this CTA's key block K_j of kv head hk, batch b ----
        ok, b, hk, j = k_tile_start(p, g, BC, GENERAL)
        if not ok:
            return
        group = p.heads // p.kv_heads
        bi = block_info(GENERAL, p, g, b, hk * group)
        k0 = j * BC
        if k0 >= bi.seqlen_k:
            return
        # ---- [bwd:setup] the policy, and the query blocks that see K_j (query blocks that do not are skipped) ----
        pol = make_policy(MASK, GENERAL, EXACT, p, g, bi)
        walk = make_qiter(q_blocks(pol, k0, BC, BR, cdiv(bi.seqlen_q, BR)), hk, group)
        st = cuda.local.array(STATE, float32)  # Mainloop::State
        # ---- [bwd:mainloop] Alg.2 l.6-16: dK_j, dV_j over every (h, i), dQ_i += dS K_j on the way ----
        run(p, g, bi, pol, k0, walk, smem, st)
        # ---- [bwd:epilogue] Alg.2 l.17: write dK_j (times scale) and dV_j (zero when no query sees K_j) ----
        store(p, g, bi, k0, st)

    bwd_kernel.__name__ = bwd_kernel.__qualname__ = name
    return cuda.jit(bwd_kernel)
