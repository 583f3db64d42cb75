"""The split-K warp partition of FlashAttention-1 (FA2 paper, section 3.3), mirroring ``cuda/splitk.cuh``.

Every warp of the CTA sees all BR query rows and a slice of BC / NWARPS keys of a block. Each warp writes its
partial row max, row sum and P~ V for its keys to its own slot of shared memory (plain stores, no atomics); after
one barrier every warp merges, for D / NWARPS columns of all BR rows, the slots of all warps into the running state
it holds. fa1_fwd uses it (``make_splitk``) with its state in HBM, and so does fa2_fwd with split_q off
(``make_mainloop_fwd_splitk``, the ablation of FA2's split-Q) with its state in the threads' own arrays.
"""
from __future__ import annotations

import collections
import functools

from numba import cuda, float32

from .common import NEG_INF, ONE, ZERO, Mainloop, dot_rows, dot_vec_col, exp2, is_float32, load_tile, row_max
from .policy import block, is_edge, kv_blocks, mask, prescale, range_n, sink_log2, transform
from .softmax import finalize_row

# Views of the slots of one split-K step: o (warps, BR, D) each warp's P~ V; mx, sum (warps, BR) its row max and sum.
SplitK = collections.namedtuple("SplitK", ["o", "mx", "sum"])


def splitk_words(BR: int, D: int, NWARPS: int) -> int:
    """SplitK::BYTES / 4: the warps' slots of partial O, row max and row sum in float32 words."""
    return NWARPS * BR * D + 2 * NWARPS * BR


def threads(BR: int, NWARPS: int) -> int:
    """Threads of a split-K CTA in the twin: one per (warp, row)."""
    # MIRROR: thread tid is row r = tid % BR of warp w = tid // BR's key slice (and, when merging, of its D / NWARPS
    # columns); in the CUDA C a warp holds all BR rows of its slice in mma fragments, 32 * NWARPS threads.
    return NWARPS * BR


def state_words(D: int, NWARPS: int) -> int:
    """SplitKState for the row a twin thread merges: its D / NWARPS columns of O, then m and l."""
    return D // NWARPS + 2


@functools.lru_cache(maxsize=None)
def make_splitk(BR: int, BC: int, D: int, NWARPS: int):
    """The device functions ``carve``, ``init_state``, ``splitk_block`` and ``splitk_merge`` for one tile shape."""
    if BC % NWARPS or D % NWARPS:
        raise ValueError(f"split-K: BC = {BC} keys and D = {D} columns must split into {NWARPS} equal slices")
    KEYS = BC // NWARPS
    OWN = D // NWARPS
    O_AT, MX_AT = 0, NWARPS * BR * D
    SUM_AT = MX_AT + NWARPS * BR
    END = SUM_AT + NWARPS * BR
    M, L = OWN, OWN + 1  # where the state keeps m and l

    @cuda.jit(device=True)
    def carve(smem, at):
        """SplitK(base): the slots from float32 word ``at`` of the dynamic shared array."""
        # MIRROR: each slot row-major (warps, BR, D); the CUDA C stores a warp's partial O in C-fragment order.
        return SplitK(smem[at + O_AT:at + MX_AT].reshape((NWARPS, BR, D)),
                      smem[at + MX_AT:at + SUM_AT].reshape((NWARPS, BR)),
                      smem[at + SUM_AT:at + END].reshape((NWARPS, BR)))

    @cuda.jit(device=True)
    def init_state(st):
        """SplitKState::init: O = 0, m = -inf, l = 0."""
        for c in range(OWN):
            st[c] = ZERO
        st[M] = NEG_INF
        st[L] = ZERO

    @cuda.jit(device=True)
    def splitk_block(sk, sQ, sK, sV, pol, q0, k0, edge):
        """One block step (FA1 Alg.1 l.9-10 within a CTA) for this warp's keys: S = Q K^T (through the policy's
        transform and, on edge blocks, its mask), the warp's own row max m_w, P~ = exp2(S - m_w), its row sum l_w
        and P~ V, all into the warp's slot. No barrier: the caller's next syncthreads() publishes it."""
        w = cuda.threadIdx.x // BR
        r = cuda.threadIdx.x % BR
        kw = w * KEYS
        s = cuda.local.array(KEYS, float32)
        for y in range(KEYS):                                                # FA1 Alg.1 l.9: S_ij slice
            s[y] = dot_rows(sQ, r, sK, kw + y)
        transform(pol, s, q0 + r, k0 + kw)
        if edge:
            mask(pol, s, q0 + r, k0 + kw)
        prescale(pol, s)
        mx = row_max(s)                                                      # FA1 Alg.1 l.10: m~ of this slice
        base = ZERO if mx == NEG_INF else mx                                 # a hidden row keeps P~ = 0
        total = ZERO
        for y in range(KEYS):
            s[y] = exp2(s[y] - base)
            total += s[y]
        sk.mx[w, r] = mx
        sk.sum[w, r] = total
        for c in range(D):                                                   # P~ V over this warp's keys
            sk.o[w, r, c] = dot_vec_col(s, sV, kw, c)

    @cuda.jit(device=True)
    def splitk_merge(sk, st, normalize):
        """Merge the block in the slots into the running state (FA1 Alg.1 l.11-12), after the barrier that follows
        splitk_block: m_new = max(m, m_w over warps), l_new = e^(m - m_new) l + sum_w e^(m_w - m_new) l_w, and for
        this thread's columns O_new = e^(m - m_new) O + sum_w e^(m_w - m_new) (P~ V)_w. ``normalize`` keeps O divided
        by l after every block (FA1); otherwise O stays unnormalised until the end. Reads the slots only."""
        w = cuda.threadIdx.x // BR
        r = cuda.threadIdx.x % BR
        m_old = st[M]
        l_old = st[L]
        m_new = m_old
        for v in range(NWARPS):
            m_new = max(m_new, sk.mx[v, r])
        m_use = ZERO if m_new == NEG_INF else m_new                          # nothing visible yet: finite factors
        a = exp2(m_old - m_use)
        f = cuda.local.array(NWARPS, float32)
        l_new = a * l_old
        for v in range(NWARPS):
            f[v] = ZERO if sk.mx[v, r] == NEG_INF else exp2(sk.mx[v, r] - m_use)
            l_new += f[v] * sk.sum[v, r]
        inv = ONE / l_new if normalize and l_new > ZERO else ONE
        alpha = a * l_old * inv if normalize else a
        for v in range(NWARPS):
            f[v] *= inv
        st[M] = m_new
        st[L] = l_new
        for c in range(OWN):
            x = alpha * st[c]
            for v in range(NWARPS):
                x += f[v] * sk.o[v, r, w * OWN + c]
            st[c] = x

    return carve, init_state, splitk_block, splitk_merge


def smem_bytes(D: int, BR: int, BC: int, NWARPS: int) -> int:
    """MainloopFwdSplitK::SMEM_BYTES with T = float: Q_i, K_j, V_j and the slots."""
    return ((BR + 2 * BC) * D + splitk_words(BR, D, NWARPS)) * 4


@functools.lru_cache(maxsize=None)
def make_mainloop_fwd_splitk(T: str, D: int, BR: int, BC: int, NWARPS: int, DEFER_NORM: bool, MASK: int,
                             GENERAL: bool) -> Mainloop:
    """MainloopFwdSplitK<T, D, BR, BC, NWARPS, DEFER_NORM, Policy<MASK, GENERAL>>: all warps see all BR rows of Q_i
    and split the keys of each block; the running O, m, l live with the threads that merge them (the State) and the
    tile's store writes them out."""
    carve, init_state, splitk_block, splitk_merge = make_splitk(BR, BC, D, NWARPS)
    TILES = (BR + 2 * BC) * D
    OWN = D // NWARPS

    @cuda.jit(device=True)
    def run(p, g, bi, pol, q0, smem, st):
        sQ = smem[0:BR * D].reshape((BR, D))
        sK = smem[BR * D:(BR + BC) * D].reshape((BC, D))
        sV = smem[(BR + BC) * D:TILES].reshape((BC, D))
        sk = carve(smem, TILES)
        q = g.q[bi.ab, bi.q_row0:, bi.h]
        k = g.k[bi.ab, bi.k_row0:, bi.hk]
        v = g.v[bi.ab, bi.k_row0:, bi.hk]
        nrows = min(BR, bi.seqlen_q - q0)
        kv = kv_blocks(pol, q0, nrows, BC)
        n = range_n(kv)
        # ---- [splitk:init] O = 0, m = -inf, l = 0 in registers; Q_i and the first K_j, V_j to shared memory ----
        init_state(st)
        load_tile(sQ, q, q0, nrows, p.head_dim)
        if n > 0:
            k0 = block(kv, 0) * BC
            load_tile(sK, k, k0, min(BC, bi.seqlen_k - k0), p.head_dim)
            load_tile(sV, v, k0, min(BC, bi.seqlen_k - k0), p.head_dim)
        for step in range(n):
            # ---- [splitk:step] every warp takes BC/NWARPS keys into its slot; one barrier; every warp merges ----
            cuda.syncthreads()  # K_j, V_j (and Q_i) are visible; every thread is done merging the previous slots
            splitk_block(sk, sQ, sK, sV, pol, q0, block(kv, step) * BC, is_edge(kv, step))
            cuda.syncthreads()  # every warp's partials are in its slot; K_j, V_j are free
            if step + 1 < n:
                k1 = block(kv, step + 1) * BC
                load_tile(sK, k, k1, min(BC, bi.seqlen_k - k1), p.head_dim)
                load_tile(sV, v, k1, min(BC, bi.seqlen_k - k1), p.head_dim)
            splitk_merge(sk, st, not DEFER_NORM)
        cuda.syncthreads()  # every thread is done with the tiles and slots (the next query tile reuses them)

    # ---- [splitk:store] O_i = diag(l)^-1 O_i (or as kept), L_i = m_i + log(l_i), with the sink in the denominator ----
    @cuda.jit(device=True)
    def store(p, g, bi, pol, q0, smem, st):
        w = cuda.threadIdx.x // BR
        r = cuda.threadIdx.x % BR
        row = q0 + r
        if row < bi.seqlen_q:
            f, lse = finalize_row(st[OWN], st[OWN + 1], sink_log2(p, g, bi), not DEFER_NORM)
            for c in range(OWN):
                if w * OWN + c < p.head_dim:
                    g.o[bi.ab, bi.q_row0 + row, bi.h, w * OWN + c] = st[c] * f
            if w == 0:
                g.lse[bi.ab, bi.h, bi.q_row0 + row] = lse

    return Mainloop(BR, BC, threads(BR, NWARPS), smem_bytes(D, BR, BC, NWARPS), state_words(D, NWARPS), MASK, GENERAL,
                    is_float32(T), run, store)
