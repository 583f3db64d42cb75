"""The split-K warp partition of FlashAttention-1 (FA2 paper, section 3.3), mirroring ``cuda/splitk.cuh``.

Every warp of the CTA sees all BR query rows and a slice of the BC keys of a block; the block's row maxima, row
sums and P V products are combined across warps through shared memory. fa1_fwd uses it (``make_splitk``), and so
does fa2_fwd with split_q off (``make_mainloop_fwd_splitk``, the ablation of FA2's split-Q), whose running O, m, l
live in shared memory.
"""
from __future__ import annotations

import collections
import functools

from numba import cuda, float32

from .common import NEG_INF, ONE, ZERO, Mainloop, dot_rows, dot_vec_col, exp2, is_float32, load_tile, row_max
from .policy import block, is_edge, kv_blocks, mask, prescale, range_n, sink_log2, transform
from .softmax import finalize_row

# Views of the shared buffers of one split-K step: red_max, red_sum (warps, BR); acc (BR, D); alpha, beta (BR).
SplitK = collections.namedtuple("SplitK", ["red_max", "red_sum", "acc", "alpha", "beta"])


def splitk_words(BR: int, D: int, NWARPS: int) -> int:
    """SplitK::BYTES / 4: red_max, red_sum, acc, alpha, beta in float32 words."""
    return 2 * NWARPS * BR + BR * D + 2 * BR


def threads(BR: int, NWARPS: int) -> int:
    """Threads of a split-K CTA in the twin: one per (warp, row)."""
    # MIRROR: thread tid is row r = tid % BR of warp w = tid // BR's key slice; in the CUDA C a warp holds all BR
    # rows of its slice in mma fragments. Every split-K row of configs.py has BR = 32, so the twin's CTA is the
    # CUDA C's: 32 * NWARPS threads.
    return NWARPS * BR


@functools.lru_cache(maxsize=None)
def make_splitk(BR: int, BC: int, D: int, NWARPS: int):
    """The device functions ``carve``, ``splitk_block`` and ``splitk_merge`` for one tile shape."""
    if BC % NWARPS:
        raise ValueError(f"split-K: BC = {BC} keys do not split into {NWARPS} equal slices")
    KEYS = BC // NWARPS
    RED_MAX, RED_SUM, ACC = 0, NWARPS * BR, 2 * NWARPS * BR
    ALPHA = ACC + BR * D
    BETA = ALPHA + BR
    END = BETA + BR

    @cuda.jit(device=True)
    def carve(smem, at):
        """SplitK(base): the buffers from float32 word ``at`` of the dynamic shared array."""
        return SplitK(smem[at + RED_MAX:at + RED_SUM].reshape((NWARPS, BR)),
                      smem[at + RED_SUM:at + ACC].reshape((NWARPS, BR)), smem[at + ACC:at + ALPHA].reshape((BR, D)),
                      smem[at + ALPHA:at + BETA], smem[at + BETA:at + END])

    @cuda.jit(device=True)
    def splitk_block(sk, sQ, sK, sV, pol, q0, k0, edge):
        """One block step (FA1 Alg.1 l.9-11 within a CTA): S = Q K_j^T for this warp's keys (through the policy's
        transform and, on edge blocks, its mask), the block max across warps, P~ = exp2(S - m~), the block row
        sums, and P~ V summed over warps into sk.acc. Ends with a barrier: sk is complete when it returns."""
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
        sk.red_max[w, r] = row_max(s)
        cuda.syncthreads()  # every warp's slice maximum is visible
        m = NEG_INF                                                          # FA1 Alg.1 l.10: m~ over the whole block
        for v in range(NWARPS):
            m = max(m, sk.red_max[v, r])
        mx = ZERO if m == NEG_INF else m                                     # a fully hidden row keeps P~ = 0
        total = ZERO
        for y in range(KEYS):
            s[y] = exp2(s[y] - mx)
            total += s[y]
        sk.red_sum[w, r] = total
        for c in range(D):                                                   # P~ V over this warp's keys
            cuda.atomic.add(sk.acc, (r, c), dot_vec_col(s, sV, kw, c))
        cuda.syncthreads()  # partial sums and P~ V of every warp are in sk

    @cuda.jit(device=True)
    def splitk_merge(sk, m, l, O, nrows, ncols, normalize):
        """Merge the block in sk into a running state (FA1 Alg.1 l.11-13): m, l per row and O (rows x D), which
        live in global memory for fa1 and in shared memory for fa2 with split-K. ``normalize`` keeps O divided by
        l after every block (FA1); otherwise O stays unnormalised until the end (FA2's deferred normalisation).
        Rows ``>= nrows`` are left alone. Ends with sk.acc zeroed again and a barrier."""
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        for r in range(tid, BR, nthreads):
            m_blk = NEG_INF
            l_blk = ZERO
            for v in range(NWARPS):
                m_blk = max(m_blk, sk.red_max[v, r])
                l_blk += sk.red_sum[v, r]
            if r >= nrows:
                continue
            m_old = m[r]
            l_old = l[r]
            m_new = max(m_old, m_blk)
            m_use = ZERO if m_new == NEG_INF else m_new                      # nothing visible yet: keep factors finite
            a = exp2(m_old - m_use)
            b = ZERO if m_blk == NEG_INF else exp2(m_blk - m_use)
            l_new = a * l_old + b * l_blk
            inv = ONE / l_new if normalize and l_new > ZERO else ONE
            sk.alpha[r] = a * l_old * inv if normalize else a
            sk.beta[r] = b * inv
            m[r] = m_new
            l[r] = l_new
        cuda.syncthreads()  # alpha, beta of every row are visible
        for idx in range(tid, BR * D, nthreads):
            r = idx // D
            c = idx % D
            if r < nrows and c < ncols:
                O[r, c] = sk.alpha[r] * O[r, c] + sk.beta[r] * sk.acc[r, c]
            sk.acc[r, c] = ZERO
        cuda.syncthreads()  # acc is zero and the state is written before the next block reuses them

    return carve, splitk_block, splitk_merge


def smem_bytes(D: int, BR: int, BC: int, NWARPS: int) -> int:
    """MainloopFwdSplitK::SMEM_BYTES with T = float: Q_i, K_j, V_j, the SplitK buffers, and O, m, l."""
    return ((BR + 2 * BC) * D + splitk_words(BR, D, NWARPS) + BR * D + 2 * BR) * 4


@functools.lru_cache(maxsize=None)
def make_mainloop_fwd_splitk(T: str, D: int, BR: int, BC: int, NWARPS: int, DEFER_NORM: bool, MASK: int,
                             GENERAL: bool) -> Mainloop:
    """MainloopFwdSplitK<T, D, BR, BC, NWARPS, DEFER_NORM, Policy<MASK, GENERAL>>: all warps see all BR rows of Q_i
    and split the keys of each block; the running O, m, l live in shared memory and the tile's store writes them."""
    carve, splitk_block, splitk_merge = make_splitk(BR, BC, D, NWARPS)
    TILES = (BR + 2 * BC) * D
    SK_AT = TILES
    O_AT = SK_AT + splitk_words(BR, D, NWARPS)
    M_AT = O_AT + BR * D
    L_AT = M_AT + BR
    END = L_AT + BR

    @cuda.jit(device=True)
    def run(p, g, bi, pol, q0, smem, st):
        sQ = smem[0:BR * D].reshape((BR, D))
        sK = smem[BR * D:(BR + BC) * D].reshape((BC, D))
        sV = smem[(BR + BC) * D:TILES].reshape((BC, D))
        sk = carve(smem, SK_AT)
        sO = smem[O_AT:M_AT].reshape((BR, D))
        sM = smem[M_AT:L_AT]
        sL = smem[L_AT:END]
        q = g.q[bi.ab, bi.q_row0:, bi.h]
        k = g.k[bi.ab, bi.k_row0:, bi.hk]
        v = g.v[bi.ab, bi.k_row0:, bi.hk]
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        nrows = min(BR, bi.seqlen_q - q0)
        kv = kv_blocks(pol, q0, nrows, BC)
        # ---- [splitk:init] O = 0, m = -inf, l = 0 in shared memory ----
        for x in range(tid, BR * D, nthreads):
            sO[x // D, x % D] = ZERO
            sk.acc[x // D, x % D] = ZERO
        for r in range(tid, BR, nthreads):
            sM[r] = NEG_INF
            sL[r] = ZERO
        load_tile(sQ, q, q0, nrows, p.head_dim)
        for step in range(range_n(kv)):
            k0 = block(kv, step) * BC
            # ---- [splitk:step] every warp takes BC/NWARPS keys; rows are merged through shared memory ----
            load_tile(sK, k, k0, min(BC, bi.seqlen_k - k0), p.head_dim)
            load_tile(sV, v, k0, min(BC, bi.seqlen_k - k0), p.head_dim)
            cuda.syncthreads()  # Q_i, K_j, V_j and the zeroed state are visible to every thread
            splitk_block(sk, sQ, sK, sV, pol, q0, k0, is_edge(kv, step))
            splitk_merge(sk, sM, sL, sO, BR, D, not DEFER_NORM)
        cuda.syncthreads()  # the state is final (also when no key block was visible)

    # ---- [splitk:store] O_i = diag(l)^-1 O_i (or as kept), L_i = m_i + log(l_i), with the sink in the denominator ----
    @cuda.jit(device=True)
    def store(p, g, bi, pol, q0, smem, st):
        sO = smem[O_AT:M_AT].reshape((BR, D))
        sM = smem[M_AT:L_AT]
        sL = smem[L_AT:END]
        nrows = min(BR, bi.seqlen_q - q0)
        sink = sink_log2(p, g, bi)
        for x in range(cuda.threadIdx.x, nrows * p.head_dim, cuda.blockDim.x):
            r = x // p.head_dim
            c = x % p.head_dim
            f, lse = finalize_row(sM[r], sL[r], sink, not DEFER_NORM)
            g.o[bi.ab, bi.q_row0 + q0 + r, bi.h, c] = sO[r, c] * f
            if c == 0:
                g.lse[bi.ab, bi.h, bi.q_row0 + q0 + r] = lse
        cuda.syncthreads()  # every thread is done with the state before the next query block resets it

    return Mainloop(BR, BC, threads(BR, NWARPS), smem_bytes(D, BR, BC, NWARPS), 1, MASK, GENERAL, is_float32(T), run,
                    store)
