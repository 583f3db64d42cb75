"""fa1_fwd twin: FlashAttention-1 forward as published (Dao et al. 2022, Algorithm 1), mirroring ``cuda/fa1_fwd.cu``.

One CTA per (batch, head). The outer loop walks the key/value blocks K_j, V_j (loaded once each); the inner loop
walks the query blocks Q_i and reads O_i, l_i, m_i from HBM and writes them back every step, with O_i normalised
by diag(l_i)^-1 every step. Inside the CTA the warps split the keys of K_j ("split-K") and combine their partial
results through shared memory (splitk.py).
O, l, m live in float32 work buffers (batch, heads, seqlen_q[, head_dim]); m is kept in log2 units.
fa1_finalize writes out (in the input dtype) and lse = m + log(l) at the end.
"""
from __future__ import annotations

import functools
import math

from numba import cuda, float32

from .common import LN2, NEG_INF, ZERO, Mask, first_query_block, load_tile
from .splitk import SplitK, make_splitk, splitk_offsets, splitk_threads


def threads(Br: int, warps: int) -> int:
    """Threads per CTA of the twin: one per (warp, row) of the split-K partition (32 * warps when Br = 32)."""
    return splitk_threads(Br, warps)


def _offsets(Br: int, Bc: int, warps: int, D: int) -> tuple[int, ...]:
    """Shared buffers in float32 words (fa1_fwd.cu's Fa1FwdSmem with T = float): Q_i, K_j, V_j, the split-K
    buffers (red_max, red_sum, acc, alpha, beta) and the end."""
    q_at, k_at, v_at, sk_at = 0, Br * D, (Br + Bc) * D, (Br + 2 * Bc) * D
    return (q_at, k_at, v_at) + splitk_offsets(sk_at, Br, D, warps)


def smem_bytes(Br: int, Bc: int, warps: int, D: int) -> int:
    """Dynamic shared memory of the twin in bytes (inputs are upcast to float32 tiles on load)."""
    return 4 * _offsets(Br, Bc, warps, D)[-1]


@functools.lru_cache(maxsize=None)
def make_fa1_fwd(D: int, Br: int, Bc: int, warps: int, causal: bool):
    """The fa1_fwd kernel for one tile shape (the CUDA template's arguments).

    Parameters
    ----------
    D : int
        Specialised head_dim: tile columns; the caller's head_dim (<= D) arrives at launch.
    Br, Bc, warps : int
        Query rows and keys of a block, and warps (each takes Bc / warps keys), from ``configs``.
    causal : bool
        Bottom-right causal mask; query blocks wholly above the diagonal are skipped.

    Returns
    -------
    numba.cuda kernel
        ``fa1_fwd(q, k, v, o_ws, m_ws, l_ws, seqlen_q, seqlen_k, heads, kv_heads, head_dim, scale_log2)`` with q
        (batch, seqlen_q, heads, head_dim), k, v (batch, seqlen_k, kv_heads, head_dim) float16 or float32; the
        float32 HBM state o_ws (batch, heads, seqlen_q, head_dim) = 0, m_ws (batch, heads, seqlen_q) = -inf and
        l_ws (same) = 0.
        Launch it with ``launch.fa1_fwd``'s grid, ``threads(Br, warps)`` threads and ``smem_bytes(...)`` bytes of
        dynamic shared memory; then ``fa1_finalize``.
    """
    Q_AT, K_AT, V_AT, RED_MAX, RED_SUM, ACC, ALPHA, BETA, END = _offsets(Br, Bc, warps, D)
    splitk_block, splitk_merge = make_splitk(Br, Bc, D, warps)

    # MIRROR: 4-D arrays (they carry their strides) where the CUDA C takes pointers plus (batch, seq, head) strides.
    @cuda.jit
    def fa1_fwd(q, k, v, o_ws, m_ws, l_ws, seqlen_q, seqlen_k, heads, kv_heads, head_dim, scale_log2):
        # ---- [fa1_fwd:setup] (batch, head) from the grid; the state of this head in HBM ----
        # MIRROR: one dynamic float32 array carved like the CUDA C's extern __shared__ smem (static: 48 KB at most).
        smem = cuda.shared.array(0, float32)
        b = cuda.blockIdx.y
        h = cuda.blockIdx.x
        hk = h // (heads // kv_heads)
        Q, K, V = q[b, :, h], k[b, :, hk], v[b, :, hk]                        # this head's N x d matrices
        O, m, l = o_ws[b, h], m_ws[b, h], l_ws[b, h]                          # its state O, m, l in HBM
        sQ = smem[Q_AT:K_AT].reshape((Br, D))
        sK = smem[K_AT:V_AT].reshape((Bc, D))
        sV = smem[V_AT:RED_MAX].reshape((Bc, D))
        sk = SplitK(smem[RED_MAX:RED_SUM].reshape((warps, Br)), smem[RED_SUM:ACC].reshape((warps, Br)),
                    smem[ACC:ALPHA].reshape((Br, D)), smem[ALPHA:BETA], smem[BETA:END])
        mask = Mask(seqlen_q, seqlen_k, causal)
        tr = (seqlen_q + Br - 1) // Br
        tc = (seqlen_k + Bc - 1) // Bc
        for x in range(cuda.threadIdx.x, Br * D, cuda.blockDim.x):
            sk.acc[x // D, x % D] = ZERO
        # ---- [fa1_fwd:outer] Alg.1 l.5-6: for each K_j, V_j: load them to shared memory once ----
        for j in range(tc):
            k0 = j * Bc
            nk = min(Bc, seqlen_k - k0)
            load_tile(sK, K, k0, nk, head_dim)
            load_tile(sV, V, k0, nk, head_dim)
            # ---- [fa1_fwd:inner] Alg.1 l.7-8: for each Q_i that sees K_j (blocks above the diagonal are skipped) ----
            for i in range(first_query_block(mask, k0, Br), tr):
                q0 = i * Br
                nq = min(Br, seqlen_q - q0)
                load_tile(sQ, Q, q0, nq, head_dim)
                cuda.syncthreads()  # Q_i, K_j, V_j are visible to every thread
                # ---- [fa1_fwd:block] Alg.1 l.9-11: S_ij, m~_ij, P~_ij, l~_ij and P~_ij V_j, keys split across warps ----
                splitk_block(sk, sQ, sK, sV, mask, q0, k0, scale_log2)
                # ---- [fa1_fwd:update] Alg.1 l.11-13: read O_i, l_i, m_i from HBM, merge, normalise, write back ----
                splitk_merge(sk, m[q0:], l[q0:], O[q0:], nq, head_dim, True)
            cuda.syncthreads()  # every thread is done with K_j, V_j before the next blocks overwrite them

    return fa1_fwd


@cuda.jit
def fa1_finalize(o_ws, m_ws, l_ws, o, lse, batch, seqlen_q, heads, head_dim):
    """out = O in the input dtype and lse = m + log(l) (natural log; m is in log2 units); rows that saw no key get
    0 and -inf. One thread per element of out; grid-stride (``launch.fa1_finalize``'s grid and block)."""
    # ---- [fa1_fwd:finalize] ----
    n = batch * heads * seqlen_q * head_dim
    for x in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, n, cuda.gridDim.x * cuda.blockDim.x):
        c = x % head_dim
        row = x // head_dim                                                  # (b * heads + h) * seqlen_q + i
        i = row % seqlen_q
        h = (row // seqlen_q) % heads
        b = row // (seqlen_q * heads)
        seen = l_ws[b, h, i] > ZERO
        o[b, i, h, c] = o_ws[b, h, i, c] if seen else ZERO
        if c == 0:
            lse[b, h, i] = m_ws[b, h, i] * LN2 + math.log(l_ws[b, h, i]) if seen else NEG_INF
