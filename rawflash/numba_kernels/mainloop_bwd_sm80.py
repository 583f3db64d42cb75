"""mainloop_bwd_sm80 twin: FA2's backward mainloop (Dao 2023, Alg.2 l.6-16) for one key block K_j, V_j,
mirroring ``cuda/mainloop_bwd_sm80.cuh``.

Each thread owns one key row of K_j and its rows of dK_j, dV_j. For each (query head, query block) of the walk:
S^T = K_j Q_i^T and dP^T = V_j dO_i^T, then P^T and dS^T element by element through the policy (scores, mask on
edge blocks, the transform's derivative), dV_j += P^T dO_i, dK_j += dS^T Q_i; with ATOMIC_DQ, dQ_i += dS K_j
through shared memory (dS^T) and float32 atomic adds into the per-row work buffer dq_ws.
"""
from __future__ import annotations

import functools

from numba import cuda, float32

from .block_info import set_head as info_set_head
from .bwd import qiter_block, qiter_edge, qiter_head
from .common import INF, ZERO, Mainloop, dot_cols, dot_rows, dot_vec_col, is_float32, load_tile, zero
from .policy import backward, set_head


@cuda.jit(device=True)
def load_query_block(sQ, sdO, sL, sDelta, q, dout, lse2, delta, q0, seqlen_q, head_dim):
    """Q_i, dO_i to shared memory and L_i, D_i beside them; rows past the sequence read L = +inf, D = 0.
    ``q``, ``dout`` are the sequence's rows (from its row 0), ``lse2``, ``delta`` its per-row values."""
    BR = sQ.shape[0]
    nq = min(BR, seqlen_q - q0)
    load_tile(sQ, q, q0, nq, head_dim)
    load_tile(sdO, dout, q0, nq, head_dim)
    for r in range(cuda.threadIdx.x, BR, cuda.blockDim.x):
        sL[r] = lse2[q0 + r] if r < nq else INF
        sDelta[r] = delta[q0 + r] if r < nq else ZERO


def threads(BC: int) -> int:
    """Threads per CTA of the twin: one per key row of K_j."""
    # MIRROR: thread kr owns key row k0 + kr and its whole rows of dK_j, dV_j, so a CTA has BC threads and the
    # column split WC has no counterpart; the CUDA C has 32 * NWARPS threads, warp (wk, wc) owning 16 * MTK keys
    # and D / WC columns.
    return BC


def smem_bytes(D: int, BR: int, BC: int, ATOMIC_DQ: bool) -> int:
    """K_j, V_j; one stage of Q_i, dO_i; dS^T (atomic dQ only); one stage of L_i, D_i, all float32."""
    # MIRROR: one stage of Q_i, dO_i, L_i, D_i where the CUDA C double-buffers them for cp.async.
    return ((2 * BC + 2 * BR) * D + (BC * BR if ATOMIC_DQ else 0) + 2 * BR) * 4


@functools.lru_cache(maxsize=None)
def make_mainloop_bwd_sm80(T: str, D: int, BR: int, BC: int, NWARPS: int, WC: int, KUNROLL: int, ATOMIC_DQ: bool,
                           MASK: int, GENERAL: bool) -> Mainloop:
    """MainloopBwdSm80<T, D, BR, BC, NWARPS, WC, KUNROLL, ATOMIC_DQ, Policy<MASK, GENERAL>>.

    NWARPS, WC and KUNROLL shape the CUDA C's warps only; the twin's State is the key row's dK (D words) and dV (D).
    """
    K_AT, V_AT, Q_AT, DO_AT, DS_AT = 0, BC * D, 2 * BC * D, (2 * BC + BR) * D, (2 * BC + 2 * BR) * D
    L_AT = DS_AT + (BC * BR if ATOMIC_DQ else 0)
    DELTA_AT = L_AT + BR
    END = DELTA_AT + BR
    DS_ROWS = BC if ATOMIC_DQ else 0

    @cuda.jit(device=True)
    def run(p, g, bi, pol, k0, walk, smem, st):
        sK = smem[K_AT:V_AT].reshape((BC, D))
        sV = smem[V_AT:Q_AT].reshape((BC, D))
        sQ = smem[Q_AT:DO_AT].reshape((BR, D))
        sdO = smem[DO_AT:DS_AT].reshape((BR, D))
        sdS = smem[DS_AT:L_AT].reshape((DS_ROWS, BR))
        sL = smem[L_AT:DELTA_AT]
        sDelta = smem[DELTA_AT:END]
        kr = cuda.threadIdx.x                                                # this thread's key row of K_j
        # ---- [mainloop_bwd_sm80:load_kv] Alg.2 l.6-7: K_j, V_j to shared memory once; dK_j = dV_j = 0 ----
        nk = min(BC, bi.seqlen_k - k0)
        load_tile(sK, g.k[bi.ab, bi.k_row0:, bi.hk], k0, nk, p.head_dim)
        load_tile(sV, g.v[bi.ab, bi.k_row0:, bi.hk], k0, nk, p.head_dim)
        # MIRROR: this key row's dK_j, dV_j (st) and its rows of S^T, dS^T live in thread-local arrays; the CUDA C
        # keeps them in registers as mma accumulators.
        zero(st)
        pp = cuda.local.array(BR, float32)
        ds = cuda.local.array(BR, float32)
        for it in range(walk.total):
            q0 = qiter_block(walk, it) * BR
            edge = qiter_edge(walk, it)
            bh = info_set_head(bi, qiter_head(walk, it))                     # the iteration's query head
            # MIRROR: the head's policy as a new value every iteration (a plain policy's slope stays 0), where the
            # CUDA C updates it in place under GENERAL only.
            hpol = set_head(pol, p, g, bh)
            # ---- [mainloop_bwd_sm80:load_q] Alg.2 l.8: Q_i, dO_i, L_i, D_i (the next block's stream in behind) ----
            # MIRROR: loaded here, in one stage; the CUDA C streams the next iteration's in behind this one (two
            # stages, cp.async).
            load_query_block(sQ, sdO, sL, sDelta, g.q[bh.ab, bh.q_row0:, bh.h], g.dout[bh.ab, bh.q_row0:, bh.h],
                             g.lse2[bh.ab, bh.h, bh.q_row0:], g.delta[bh.ab, bh.h, bh.q_row0:], q0, bh.seqlen_q,
                             p.head_dim)
            cuda.syncthreads()  # K_j, V_j and this stage's Q_i, dO_i, L_i, D_i are visible to every thread
            # ---- [mainloop_bwd_sm80:scores] Alg.2 l.9 and l.12: S^T = K_j Q_i^T, dP^T = V_j dO_i^T ----
            for c in range(BR):
                pp[c] = dot_rows(sK, kr, sQ, c)
                ds[c] = dot_rows(sV, kr, sdO, c)
            # ---- [mainloop_bwd_sm80:probs] Alg.2 l.10 and l.13: P^T = exp2(S^T - L), dS^T = P^T * (dP^T - D) ----
            for c in range(BR):
                x, y = backward(hpol, pp[c], ds[c], q0 + c, k0 + kr, sL[c], sDelta[c], edge)
                pp[c] = x
                ds[c] = y
            # ---- [mainloop_bwd_sm80:dkdv] Alg.2 l.11, l.15: dV_j += P^T dO_i, dK_j += dS^T Q_i (scale at the end) ----
            for d in range(D):
                st[D + d] += dot_vec_col(pp, sdO, 0, d)
                st[d] += dot_vec_col(ds, sQ, 0, d)
            # ---- [mainloop_bwd_sm80:dq] Alg.2 l.14: dQ_i += scale * dS K_j via shared memory and float32 atomics ----
            if ATOMIC_DQ:
                for c in range(BR):
                    sdS[kr, c] = ds[c]
                cuda.syncthreads()  # all of dS^T is in shared memory
                # MIRROR: the CTA's threads share the BR x D entries of dQ_i round-robin; the CUDA C gives each warp
                # a 16 x DQW tile of them.
                dq_rows = g.dq_ws[bh.ab, bh.h, bh.q_row0:]
                for x in range(kr, BR * D, cuda.blockDim.x):
                    r = x // D
                    c = x % D
                    if q0 + r < bh.seqlen_q and c < p.head_dim:
                        cuda.atomic.add(dq_rows, (q0 + r, c), p.scale * dot_cols(sdS, r, sK, c))
            cuda.syncthreads()  # every thread is done with this stage and dS before they are refilled

    @cuda.jit(device=True)
    def store(p, g, bi, k0, st):
        row = k0 + cuda.threadIdx.x
        if row < bi.seqlen_k:
            for c in range(p.head_dim):
                g.dk[bi.ab, bi.k_row0 + row, bi.hk, c] = st[c] * p.scale
                g.dv[bi.ab, bi.k_row0 + row, bi.hk, c] = st[D + c]

    return Mainloop(BR, BC, threads(BC), smem_bytes(D, BR, BC, ATOMIC_DQ), 2 * D, MASK, GENERAL, is_float32(T), run,
                    store)
