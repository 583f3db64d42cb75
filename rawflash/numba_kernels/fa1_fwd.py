"""fa1_fwd twin: FlashAttention-1 forward as published (Dao et al. 2022, Algorithm 1) and as released (flash-attn
1.x), mirroring ``cuda/fa1_fwd.cu``.

One CTA per (head, batch, split). The outer loop walks the key/value blocks K_j, V_j (loaded once each per CTA); the
inner loop walks the query blocks Q_i of this split (i % splits == split) that see K_j and reads O_i, l_i, m_i from
HBM and writes them back every step, with O_i normalised by diag(l_i)^-1 every step. Inside the CTA the warps split
the keys of K_j ("split-K") and merge their partial results through shared memory (splitk.py). O, l, m live in
float32 work buffers (o_ws (batch, heads, seqlen_q, head_dim), m_ws and l_ws (batch, heads, seqlen_q)); m is kept in
log2 units. fa1_finalize writes out (in the output's dtype) and lse = m + log(l) at the end. Plain attention only.
"""
from __future__ import annotations

import functools

from numba import cuda, float32

from .block_info import block_info
from .common import NEG_INF, ZERO, Twin, cdiv, is_float32, load_tile
from .params import FwdArrays
from .policy import make_policy, q_blocks
from .softmax import finalize_row
from .splitk import make_splitk, splitk_words, state_words, threads as splitk_threads


def smem_bytes(D: int, BR: int, BC: int, NWARPS: int) -> int:
    """Two Q_i buffers, K_j, V_j and the split-K slots as float32 (fa1_fwd.cu's SMEM_BYTES with T = float)."""
    return ((2 * BR + 2 * BC) * D + splitk_words(BR, D, NWARPS)) * 4


@functools.lru_cache(maxsize=None)
def make_fa1_fwd(T: str, D: int, BR: int, BC: int, NWARPS: int, MIN_BLOCKS: int, MASK: int, SMEM_BYTES: int) -> Twin:
    """The twin of ``fa1_fwd<...>``, taking the CUDA template's arguments in order (``Launch.template_args``).

    The kernel takes the forward's arguments (fwd.make_fwd_kernel's); o_ws, m_ws, l_ws must start at 0, -inf, 0.
    Launch it with the Launch's grid (its z is the split), ``Twin.threads`` threads and ``Twin.smem`` bytes; then
    fa1_finalize.
    """
    carve, init_state, splitk_block, splitk_merge = make_splitk(BR, BC, D, NWARPS)
    EXACT = is_float32(T)
    OWN = D // NWARPS
    STATE = state_words(D, NWARPS)
    Q1_AT, K_AT, V_AT, SK_AT = BR * D, 2 * BR * D, (2 * BR + BC) * D, (2 * BR + 2 * BC) * D

    @cuda.jit(device=True)
    def owned(pol, split, splits, tr, j, start):
        """This CTA's next query block >= start that sees K_j (i % splits == split), or -1."""
        qb = q_blocks(pol, j * BC, BC, BR, tr)
        i = max(start, qb.lo)
        i += ((split - i % splits) % splits + splits) % splits
        return i if i < qb.hi else -1

    @cuda.jit(device=True)
    def advance(pol, split, splits, tr, tc, j, i):
        """The step after (j, i): the next query block of K_j, else the first of the next K block with work."""
        i = owned(pol, split, splits, tr, j, i + 1)
        while i < 0:
            j += 1
            if j >= tc:
                break
            i = owned(pol, split, splits, tr, j, 0)
        return j, i

    @cuda.jit
    def fa1_fwd(p, q, k, v, o, lse, cu_q, cu_k, used_k, slopes, sinks, o_ws, m_ws, l_ws):
        g = FwdArrays(q, k, v, o, lse, cu_q, cu_k, used_k, slopes, sinks, o_ws, m_ws, l_ws)
        # ---- [fa1_fwd:setup] (batch, head, split) from the grid; the state of this head in HBM ----
        # MIRROR: one dynamic float32 array carved like the CUDA C's extern __shared__ smem (static: 48 KB at most).
        smem = cuda.shared.array(0, float32)
        bi = block_info(False, p, g, cuda.blockIdx.y, cuda.blockIdx.x)
        pol = make_policy(MASK, False, EXACT, p, g, bi)
        split = cuda.blockIdx.z
        splits = cuda.gridDim.z
        Q = g.q[bi.ab, bi.q_row0:, bi.h]
        K = g.k[bi.ab, bi.k_row0:, bi.hk]
        V = g.v[bi.ab, bi.k_row0:, bi.hk]
        O = g.o_ws[bi.ab, bi.h, bi.q_row0:]                                  # this head's state O, m, l in HBM
        m = g.m_ws[bi.ab, bi.h, bi.q_row0:]
        l = g.l_ws[bi.ab, bi.h, bi.q_row0:]
        sQ0 = smem[0:Q1_AT].reshape((BR, D))
        sQ1 = smem[Q1_AT:K_AT].reshape((BR, D))
        sK = smem[K_AT:V_AT].reshape((BC, D))
        sV = smem[V_AT:SK_AT].reshape((BC, D))
        sk = carve(smem, SK_AT)
        tr = cdiv(bi.seqlen_q, BR)
        tc = cdiv(bi.seqlen_k, BC)
        w = cuda.threadIdx.x // BR
        r = cuda.threadIdx.x % BR
        st = cuda.local.array(STATE, float32)
        j, i = advance(pol, split, splits, tr, tc, 0, -1)
        if j >= tc:
            return  # no query block of this split sees any key
        buf = 0
        # ---- [fa1_fwd:outer] Alg.1 l.5-6: for each K_j, V_j this CTA has work in: load them to shared memory once ----
        # MIRROR: plain copies that nothing overlaps (no cp.async); the barriers stay where the CUDA C has them.
        load_tile(sK, K, j * BC, min(BC, bi.seqlen_k - j * BC), p.head_dim)
        load_tile(sV, V, j * BC, min(BC, bi.seqlen_k - j * BC), p.head_dim)
        load_tile(sQ0, Q, i * BR, min(BR, bi.seqlen_q - i * BR), p.head_dim)
        while j < tc:
            jc = j
            k0 = j * BC
            qb = q_blocks(pol, k0, BC, BR, tr)
            # ---- [fa1_fwd:inner] Alg.1 l.7-8: for each Q_i of this split that sees K_j (others are skipped) ----
            while j == jc:
                jn, inext = advance(pol, split, splits, tr, tc, j, i)
                q0 = i * BR
                nq = min(BR, bi.seqlen_q - q0)
                # Q_i (and K_j, V_j) are visible; every thread is done with the slots and the other Q buffer
                cuda.syncthreads()
                if jn == j:                                                  # Q of the next step
                    load_tile(sQ1 if buf == 0 else sQ0, Q, inext * BR, min(BR, bi.seqlen_q - inext * BR), p.head_dim)
                # ---- [fa1_fwd:load] Alg.1 l.8: O_i, l_i, m_i from HBM into the merging warps' registers ----
                if r < nq:
                    for c in range(OWN):
                        st[c] = O[q0 + r, w * OWN + c] if w * OWN + c < p.head_dim else ZERO
                    st[OWN] = m[q0 + r]
                    st[OWN + 1] = l[q0 + r]
                else:
                    init_state(st)
                # ---- [fa1_fwd:block] Alg.1 l.9-10: S_ij, m~_ij, P~_ij, l~_ij, P~_ij V_j; keys split across warps ----
                edge = i < qb.lo_full or i >= qb.hi_full
                splitk_block(sk, sQ0 if buf == 0 else sQ1, sK, sV, pol, q0, k0, edge)
                cuda.syncthreads()  # every warp's partials are in its slot; K_j, V_j and this Q buffer are free
                if jn != j and jn < tc:                                      # the next K block and its first Q block
                    load_tile(sK, K, jn * BC, min(BC, bi.seqlen_k - jn * BC), p.head_dim)
                    load_tile(sV, V, jn * BC, min(BC, bi.seqlen_k - jn * BC), p.head_dim)
                    load_tile(sQ1 if buf == 0 else sQ0, Q, inext * BR, min(BR, bi.seqlen_q - inext * BR), p.head_dim)
                # ---- [fa1_fwd:update] Alg.1 l.11-13: merge into O_i, l_i, m_i, normalise, write them back to HBM ----
                splitk_merge(sk, st, True)
                if r < nq:
                    for c in range(OWN):
                        if w * OWN + c < p.head_dim:
                            O[q0 + r, w * OWN + c] = st[c]
                    if w == 0:
                        m[q0 + r] = st[OWN]
                        l[q0 + r] = st[OWN + 1]
                j = jn
                i = inext
                buf ^= 1

    return Twin(fa1_fwd, splitk_threads(BR, NWARPS), smem_bytes(D, BR, BC, NWARPS))


@functools.lru_cache(maxsize=None)
def make_fa1_finalize(T: str) -> Twin:
    """The twin of ``fa1_finalize<T>``: out = O in the output's dtype and lse = m + log(l) (natural log; m is in log2
    units); rows that saw no key get 0 and -inf. One thread per element of out, grid-stride over (batch, heads,
    seqlen_q, head_dim); launched with the Launch's own grid and block."""

    @cuda.jit
    def fa1_finalize(p, q, k, v, o, lse, cu_q, cu_k, used_k, slopes, sinks, o_ws, m_ws, l_ws):
        # ---- [fa1_fwd:finalize] ----
        n = p.batch * p.heads * p.seqlen_q * p.head_dim
        for x in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, n, cuda.gridDim.x * cuda.blockDim.x):
            c = x % p.head_dim
            row = x // p.head_dim                                            # (b * heads + h) * seqlen_q + i
            i = row % p.seqlen_q
            h = (row // p.seqlen_q) % p.heads
            b = row // (p.seqlen_q * p.heads)
            f, r_lse = finalize_row(m_ws[b, h, i], l_ws[b, h, i], NEG_INF, True)
            o[b, i, h, c] = o_ws[b, h, i, c] * f
            if c == 0:
                lse[b, h, i] = r_lse

    return Twin(fa1_finalize, None, 0)
