"""mainloop_fwd_sm80 twin: FA2's forward mainloop (Dao 2023, Alg.1 l.4-11) for one query tile Q_i, mirroring
``cuda/mainloop_fwd_sm80.cuh``.

Q_i stays in shared memory; each thread owns one whole query row ("split-Q"), so the softmax needs no exchange
between threads. The key blocks come from the policy's BlockRange: interior blocks skip the mask, edge blocks
apply it; blocks no row sees are never loaded. DEFER_NORM = False keeps O divided by l after every block (FA1's
normalisation; the ablation of FA2's idea).
"""
from __future__ import annotations

import functools

from numba import cuda, float32

from .common import NEG_INF, ONE, ZERO, Mainloop, dot_rows, dot_vec_col, is_float32, load_tile, zero
from .epilogue import epilogue_fwd
from .policy import block, is_edge, kv_blocks, mask, prescale, range_n, transform
from .softmax import update


def threads(BR: int) -> int:
    """Threads per CTA of the twin: one per query row."""
    # MIRROR: BR threads, one per row; the CUDA C has 32 * NWARPS threads whose warps own 16 * MT rows each.
    return BR


def smem_bytes(D: int, BR: int, BC: int) -> int:
    """Q_i, K_j, V_j as float32 tiles (MainloopFwdSm80::SMEM_BYTES with T = float)."""
    return (BR + 2 * BC) * D * 4


@functools.lru_cache(maxsize=None)
def make_mainloop_fwd_sm80(T: str, D: int, BR: int, BC: int, NWARPS: int, KUNROLL: int, DEFER_NORM: bool, MASK: int,
                           GENERAL: bool) -> Mainloop:
    """MainloopFwdSm80<T, D, BR, BC, NWARPS, KUNROLL, DEFER_NORM, Policy<MASK, GENERAL>>.

    NWARPS and KUNROLL shape the CUDA C's warps and unrolling only; the twin's State is the row's O (D words), m
    and l.
    """
    Q_AT, K_AT, V_AT, END = 0, BR * D, (BR + BC) * D, (BR + 2 * BC) * D
    M_AT, L_AT = D, D + 1

    @cuda.jit(device=True)
    def run(p, g, bi, pol, q0, smem, st):
        sQ = smem[Q_AT:K_AT].reshape((BR, D))
        sK = smem[K_AT:V_AT].reshape((BC, D))
        sV = smem[V_AT:END].reshape((BC, D))
        q = g.q[bi.ab, bi.q_row0:, bi.h]
        k = g.k[bi.ab, bi.k_row0:, bi.hk]
        v = g.v[bi.ab, bi.k_row0:, bi.hk]
        r = cuda.threadIdx.x                                                 # this thread's row of Q_i
        nrows = min(BR, bi.seqlen_q - q0)
        kv = kv_blocks(pol, q0, nrows, BC)                                   # blocks no row sees: never loaded
        n = range_n(kv)
        # ---- [mainloop_fwd_sm80:load_q] Alg.1 l.4: Q_i to shared memory, where it stays; the first K_j behind it ----
        load_tile(sQ, q, q0, nrows, p.head_dim)
        if n > 0:
            k0 = block(kv, 0) * BC
            load_tile(sK, k, k0, min(BC, bi.seqlen_k - k0), p.head_dim)
        # ---- [mainloop_fwd_sm80:init] Alg.1 l.5: O = 0, l = 0, m = -inf ----
        # MIRROR: the row's O lives in st (a thread-local array) and its S in s; the CUDA C keeps 16 * MT rows
        # per warp in registers as mma accumulators (with WC > 1, D / WC of O's columns per warp, each of the WC
        # warps forming the rows' S and softmax itself).
        zero(st)
        m = NEG_INF
        l = float32(0.0)
        s = cuda.local.array(BC, float32)
        for step in range(n):
            k0 = block(kv, step) * BC
            # ---- [mainloop_fwd_sm80:load_kv] Alg.1 l.7: V_j streams in while S = Q_i K_j^T is computed ----
            # MIRROR: a plain copy that nothing overlaps (no cp.async); the barriers stay where the CUDA C has them.
            cuda.syncthreads()  # K_j (and Q_i) are visible; every thread is done reading V_{j-1}
            load_tile(sV, v, k0, min(BC, bi.seqlen_k - k0), p.head_dim)
            # ---- [mainloop_fwd_sm80:scores] Alg.1 l.8: S_ij = Q_i K_j^T, through the policy's score transform ----
            for y in range(BC):
                s[y] = dot_rows(sQ, r, sK, y)
            transform(pol, s, q0 + r, k0)
            prescale(pol, s)  # S in log2 units
            # ---- [mainloop_fwd_sm80:mask] edge blocks only: hidden scores to -inf ----
            if is_edge(kv, step):
                mask(pol, s, q0 + r, k0)
            # ---- [mainloop_fwd_sm80:softmax] Alg.1 l.9-10: P = exp2(S - m_new); l, O scaled by e^(m_old - m_new) ----
            m, l, fo = update(s, ONE, m, l, not DEFER_NORM, ZERO)
            for c in range(D):
                st[c] *= fo
            # ---- [mainloop_fwd_sm80:wait_v] K_{j+1} streams in while O += P V_j is computed ----
            cuda.syncthreads()  # V_j is visible; every thread is done reading K_j
            if step + 1 < n:
                k1 = block(kv, step + 1) * BC
                load_tile(sK, k, k1, min(BC, bi.seqlen_k - k1), p.head_dim)
            # ---- [mainloop_fwd_sm80:pv] Alg.1 l.10: O += P V_j with P as the A operand straight from registers ----
            for c in range(D):
                st[c] += dot_vec_col(s, sV, 0, c)
        cuda.syncthreads()  # every thread is done with the tiles (with seq_parallel off the next block reuses them)
        st[M_AT] = m
        st[L_AT] = l

    @cuda.jit(device=True)
    def store(p, g, bi, pol, q0, smem, st):
        epilogue_fwd(p, g, bi, st, st[M_AT], st[L_AT], not DEFER_NORM, q0)

    return Mainloop(BR, BC, threads(BR), smem_bytes(D, BR, BC), D + 2, MASK, GENERAL, is_float32(T), run, store)
