"""fa1_fwd twin: FlashAttention-1 forward as published (Dao et al. 2022, Algorithm 1), mirroring ``cuda/fa1_fwd.cu``.

One CTA per (head, batch). The outer loop walks the key/value blocks K_j, V_j (loaded once each); the inner loop
walks the query blocks Q_i that see K_j and reads O_i, l_i, m_i from HBM and writes them back every step, with O_i
normalised by diag(l_i)^-1 every step. Inside the CTA the warps split the keys of K_j ("split-K") and combine
their partial results through shared memory (splitk.py). O, l, m live in float32 work buffers (o_ws (batch,
heads, seqlen_q, head_dim), m_ws and l_ws (batch, heads, seqlen_q)); m is kept in log2 units. fa1_finalize
writes out (in the output's dtype) and lse = m + log(l) at the end. Plain attention only (the plain policy).
"""
from __future__ import annotations

import functools

from numba import cuda, float32

from .block_info import block_info
from .common import NEG_INF, ZERO, Twin, cdiv, is_float32, load_tile
from .params import FwdArrays
from .policy import block, is_edge, make_policy, q_blocks, range_n
from .softmax import finalize_row
from .splitk import make_splitk, splitk_words, threads as splitk_threads


def smem_bytes(D: int, BR: int, BC: int, NWARPS: int) -> int:
    """Q_i, K_j, V_j and the SplitK buffers as float32 (fa1_fwd.cu's SMEM_BYTES with T = float)."""
    return ((BR + 2 * BC) * D + splitk_words(BR, D, NWARPS)) * 4


@functools.lru_cache(maxsize=None)
def make_fa1_fwd(T: str, D: int, BR: int, BC: int, NWARPS: int, MIN_BLOCKS: int, MASK: int, SMEM_BYTES: int) -> Twin:
    """The twin of ``fa1_fwd<...>``, taking the CUDA template's arguments in order (``Launch.template_args``).

    The kernel takes the forward's arguments (fwd.make_fwd_kernel's); o_ws, m_ws, l_ws must start at 0, -inf, 0.
    Launch it with the Launch's grid, ``Twin.threads`` threads and ``Twin.smem`` bytes; then fa1_finalize.
    """
    carve, splitk_block, splitk_merge = make_splitk(BR, BC, D, NWARPS)
    EXACT = is_float32(T)
    K_AT, V_AT, SK_AT = BR * D, (BR + BC) * D, (BR + 2 * BC) * D

    @cuda.jit
    def fa1_fwd(p, q, k, v, o, lse, cu_q, cu_k, used_k, slopes, sinks, o_ws, m_ws, l_ws):
        g = FwdArrays(q, k, v, o, lse, cu_q, cu_k, used_k, slopes, sinks, o_ws, m_ws, l_ws)
        # ---- [fa1_fwd:setup] (batch, head) from the grid; the state of this head in HBM ----
        # MIRROR: one dynamic float32 array carved like the CUDA C's extern __shared__ smem (static: 48 KB at most).
        smem = cuda.shared.array(0, float32)
        bi = block_info(False, p, g, cuda.blockIdx.y, cuda.blockIdx.x)
        pol = make_policy(MASK, False, EXACT, p, g, bi)
        Q = g.q[bi.ab, bi.q_row0:, bi.h]
        K = g.k[bi.ab, bi.k_row0:, bi.hk]
        V = g.v[bi.ab, bi.k_row0:, bi.hk]
        O = g.o_ws[bi.ab, bi.h, bi.q_row0:]                                  # this head's state O, m, l in HBM
        m = g.m_ws[bi.ab, bi.h, bi.q_row0:]
        l = g.l_ws[bi.ab, bi.h, bi.q_row0:]
        sQ = smem[0:K_AT].reshape((BR, D))
        sK = smem[K_AT:V_AT].reshape((BC, D))
        sV = smem[V_AT:SK_AT].reshape((BC, D))
        sk = carve(smem, SK_AT)
        tr = cdiv(bi.seqlen_q, BR)
        tc = cdiv(bi.seqlen_k, BC)
        for x in range(cuda.threadIdx.x, BR * D, cuda.blockDim.x):
            sk.acc[x // D, x % D] = ZERO
        # ---- [fa1_fwd:outer] Alg.1 l.5-6: for each K_j, V_j: load them to shared memory once ----
        for j in range(tc):
            k0 = j * BC
            nk = min(BC, bi.seqlen_k - k0)
            load_tile(sK, K, k0, nk, p.head_dim)
            load_tile(sV, V, k0, nk, p.head_dim)
            # ---- [fa1_fwd:inner] Alg.1 l.7-8: for each Q_i that sees K_j (blocks that see none of it are skipped) ----
            qb = q_blocks(pol, k0, BC, BR, tr)
            for s in range(range_n(qb)):
                q0 = block(qb, s) * BR
                nq = min(BR, bi.seqlen_q - q0)
                load_tile(sQ, Q, q0, nq, p.head_dim)
                cuda.syncthreads()  # Q_i, K_j, V_j are visible to every thread
                # ---- [fa1_fwd:block] Alg.1 l.9-11: S_ij, m~_ij, P~_ij, l~_ij and P~_ij V_j, keys split across warps ----
                splitk_block(sk, sQ, sK, sV, pol, q0, k0, is_edge(qb, s))
                # ---- [fa1_fwd:update] Alg.1 l.11-13: read O_i, l_i, m_i from HBM, merge, normalise, write back ----
                splitk_merge(sk, m[q0:], l[q0:], O[q0:], nq, p.head_dim, True)
            cuda.syncthreads()  # every thread is done with K_j, V_j before the next blocks overwrite them

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
