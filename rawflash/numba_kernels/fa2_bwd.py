"""fa2_bwd twin: FlashAttention-2 backward (Dao 2023, Algorithm 2), mirroring ``cuda/fa2_bwd.cu``.

fa2_bwd_preprocess: D_i = rowsum(dO_i * O_i) and L_i in log2 units (hidden rows: +inf, so P = 0), and with sinks
  each row's share of the sink gradient.
fa2_bwd: the bwd.py skeleton with mainloop_bwd_sm80.py: grid (Tc, kv_heads, batch), one CTA per key block; with
  ATOMIC_DQ it also accumulates dQ into a float32 buffer that fa2_bwd_convert_dq casts.
fa2_bwd_dq: the deterministic dQ (no atomics): one CTA per query block, looping over key blocks.
Every kernel takes the backward's arguments (bwd.make_bwd_kernel's). Rows of the per-row buffers (L, D, dQ's
accumulator, the sink terms) are (rows_batch, heads, rows_seqlen): (1, heads, total_q) for packed sequences.
"""
from __future__ import annotations

import functools
import math

from numba import cuda, float32, float64

from .block_info import block_info
from .bwd import make_bwd_kernel
from .common import INF, LOG2E, NEG_INF, Twin, dot_rows, dot_vec_col, dot_vecs, is_float32, load_tile, zero
from .mainloop_bwd_sm80 import load_query_block, make_mainloop_bwd_sm80
from .params import BwdArrays
from .policy import backward, block, is_edge, kv_blocks, make_policy, range_n
from .scheduler import q_tile_start


@functools.lru_cache(maxsize=None)
def make_fa2_bwd_preprocess(T: str) -> Twin:
    """The twin of ``fa2_bwd_preprocess<T>``: a group of threads per row in a grid-stride loop, launched with the
    Launch's own grid and block."""
    EXACT = is_float32(T)

    @cuda.jit
    def fa2_bwd_preprocess(p, q, k, v, out, dout, dq, dk, dv, lse, lse2, delta, dq_ws, dsink_ws, cu_q, cu_k, used_k,
                           slopes, sinks):
        # ---- [fa2_bwd:preprocess] Alg.2 l.4: D_i = rowsum(dO_i * O_i); a group of threads per row ----
        # The sum runs in the order the products accumulate dP (blocks of 16 columns, added up in order), so a row
        # whose P is a single 1 gets dP - D = 0 exactly in float32, as the naive computation does.
        # MIRROR: the group's first thread forms the whole sum, one column at a time (the same order); in the CUDA C
        # each thread forms its 16-column block's chain and the group adds them up through shuffles.
        lanes = 1
        while lanes < (p.head_dim + 15) // 16:
            lanes *= 2
        n = p.rows_batch * p.heads * p.rows_seqlen * lanes
        x = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        while x < n:
            row = x // lanes
            blk = x % lanes
            i = row % p.rows_seqlen
            h = (row // p.rows_seqlen) % p.heads
            b = row // (p.rows_seqlen * p.heads)
            # ---- [fa2_bwd:zero_dq] the float32 dQ rows the main pass adds into start at zero (these columns) ----
            if dq_ws.shape[3] == p.head_dim:  # (the deterministic backward passes a dummy of one element)
                for c in range(16 * blk, min(16 * blk + 16, p.head_dim)):
                    dq_ws[b, h, i, c] = 0
            if blk == 0:
                acc = dot_vecs(out[b, i, h, :p.head_dim], dout[b, i, h, :p.head_dim])
                r_lse = lse[b, h, i]
                delta[b, h, i] = acc
                lse2[b, h, i] = INF if r_lse == NEG_INF else r_lse * LOG2E
                # ---- [fa2_bwd:sink_terms] d(loss)/d(sink_h) = -sum_i exp(sink_h - lse_i) D_i: this row's term ----
                if p.has_sinks:
                    sink = sinks[h]
                    if EXACT:
                        term = float32(math.exp(float64(sink) - float64(r_lse)))
                    else:
                        term = float32(math.exp(sink - r_lse))
                    dsink_ws[b, h, i] = term * acc
            x += cuda.gridDim.x * cuda.blockDim.x

    return Twin(fa2_bwd_preprocess, None, 0)


@functools.lru_cache(maxsize=None)
def make_fa2_bwd(T: str, D: int, BR: int, BC: int, NWARPS: int, WC: int, MIN_BLOCKS: int, KUNROLL: int, MASK: int,
                 GENERAL: bool, ATOMIC_DQ: bool, EARLY_DV: bool, SMEM_BYTES: int) -> Twin:
    """The twin of ``fa2_bwd<...>``, taking the CUDA template's arguments in order (``Launch.template_args``).

    MIN_BLOCKS has no counterpart, nor has EARLY_DV (the order of two products: the same results); SMEM_BYTES is
    the CUDA C's size, the twin's own is ``Twin.smem``. With ATOMIC_DQ the kernel adds dQ (times scale) into dq_ws,
    which must start at 0.
    """
    ml = make_mainloop_bwd_sm80(T, D, BR, BC, NWARPS, WC, KUNROLL, ATOMIC_DQ, MASK, GENERAL)
    return Twin(make_bwd_kernel("fa2_bwd", ml), ml.NTHREADS, ml.SMEM_BYTES)


def threads_dq(BR: int) -> int:
    """Threads per CTA of the fa2_bwd_dq twin: one per query row of Q_i."""
    # MIRROR: thread r owns query row q0 + r; the CUDA C's warps own 16 * MT rows each.
    return BR


def smem_bytes_dq(D: int, BR: int, BC: int) -> int:
    """K_j, V_j, Q_i, dO_i, L_i, D_i as float32 (fa2_bwd_dq's SMEM_BYTES with T = float)."""
    return ((2 * BC + 2 * BR) * D + 2 * BR) * 4


@functools.lru_cache(maxsize=None)
def make_fa2_bwd_dq(T: str, D: int, BR: int, BC: int, NWARPS: int, MIN_BLOCKS: int, KUNROLL: int, MASK: int,
                    GENERAL: bool, SMEM_BYTES: int, WC: int = 1) -> Twin:
    """The twin of ``fa2_bwd_dq<...>`` (the deterministic dQ: one CTA per query block, no atomics), taking the CUDA
    template's arguments in order. WC (warps that share rows and split dQ_i's columns, head_dim 512) shapes the
    CUDA C's warps only: a twin thread holds its row's whole dQ."""
    EXACT = is_float32(T)
    K_AT, V_AT, Q_AT, DO_AT, L_AT = 0, BC * D, 2 * BC * D, (2 * BC + BR) * D, (2 * BC + 2 * BR) * D
    DELTA_AT = L_AT + BR
    END = DELTA_AT + BR

    @cuda.jit
    def fa2_bwd_dq(p, q, k, v, out, dout, dq, dk, dv, lse, lse2, delta, dq_ws, dsink_ws, cu_q, cu_k, used_k, slopes,
                   sinks):
        g = BwdArrays(q, k, v, out, dout, dq, dk, dv, lse, lse2, delta, dq_ws, dsink_ws, cu_q, cu_k, used_k, slopes,
                      sinks)
        # ---- [fa2_bwd:dq_setup] query block i of head h; warp w owns rows wq.. ----
        smem = cuda.shared.array(0, float32)
        sK = smem[K_AT:V_AT].reshape((BC, D))
        sV = smem[V_AT:Q_AT].reshape((BC, D))
        sQ = smem[Q_AT:DO_AT].reshape((BR, D))
        sdO = smem[DO_AT:L_AT].reshape((BR, D))
        sL = smem[L_AT:DELTA_AT]
        sDelta = smem[DELTA_AT:END]
        ok, b, h, i, stop = q_tile_start(p, g, BR, False, GENERAL)
        if not ok:
            return
        bi = block_info(GENERAL, p, g, b, h)
        q0 = i * BR
        r = cuda.threadIdx.x                                                 # this thread's query row of Q_i
        if q0 >= bi.seqlen_q:
            return
        pol = make_policy(MASK, GENERAL, EXACT, p, g, bi)
        load_query_block(sQ, sdO, sL, sDelta, g.q[bi.ab, bi.q_row0:, bi.h], g.dout[bi.ab, bi.q_row0:, bi.h],
                         g.lse2[bi.ab, bi.h, bi.q_row0:], g.delta[bi.ab, bi.h, bi.q_row0:], q0, bi.seqlen_q,
                         p.head_dim)
        acc = cuda.local.array(D, float32)
        pp = cuda.local.array(BC, float32)
        ds = cuda.local.array(BC, float32)
        zero(acc)
        kv = kv_blocks(pol, q0, min(BR, bi.seqlen_q - q0), BC)
        kk = g.k[bi.ab, bi.k_row0:, bi.hk]
        vv = g.v[bi.ab, bi.k_row0:, bi.hk]
        for s in range(range_n(kv)):
            k0 = block(kv, s) * BC
            nk = min(BC, bi.seqlen_k - k0)
            edge = is_edge(kv, s)
            # ---- [fa2_bwd:dq_block] recompute P, dP and dS for K_j, V_j; dQ_i += dS K_j ----
            load_tile(sK, kk, k0, nk, p.head_dim)
            load_tile(sV, vv, k0, nk, p.head_dim)
            cuda.syncthreads()  # K_j, V_j (and Q_i, dO_i, L, D) are visible to every thread
            for y in range(BC):
                pp[y] = dot_rows(sQ, r, sK, y)
                ds[y] = dot_rows(sdO, r, sV, y)
            for y in range(BC):
                x, z = backward(pol, pp[y], ds[y], q0 + r, k0 + y, sL[r], sDelta[r], edge)
                pp[y] = x
                ds[y] = z
            for c in range(D):
                acc[c] += dot_vec_col(ds, sK, 0, c)
            cuda.syncthreads()  # every thread is done with K_j, V_j before the next block overwrites them
        # ---- [fa2_bwd:dq_epilogue] dQ_i = scale * acc ----
        row = q0 + r
        if row < bi.seqlen_q:
            for c in range(p.head_dim):
                g.dq[bi.ab, bi.q_row0 + row, bi.h, c] = acc[c] * p.scale

    return Twin(fa2_bwd_dq, threads_dq(BR), smem_bytes_dq(D, BR, BC))


@functools.lru_cache(maxsize=None)
def make_fa2_bwd_convert_dq(T: str) -> Twin:
    """The twin of ``fa2_bwd_convert_dq<T>``: dQ = dq_ws (float32 per-row buffer, already scaled) in dq's dtype;
    grid-stride, launched with the Launch's own grid and block."""

    @cuda.jit
    def fa2_bwd_convert_dq(p, q, k, v, out, dout, dq, dk, dv, lse, lse2, delta, dq_ws, dsink_ws, cu_q, cu_k, used_k,
                           slopes, sinks):
        # ---- [fa2_bwd:convert] 8 columns per thread and step (head_dim is a multiple of 8: the backend pads it) ----
        # MIRROR: one element per thread and step here; the CUDA C converts 8 columns (16-byte loads and stores).
        n = p.rows_batch * p.heads * p.rows_seqlen * p.head_dim
        for x in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, n, cuda.gridDim.x * cuda.blockDim.x):
            c = x % p.head_dim
            row = x // p.head_dim
            i = row % p.rows_seqlen
            h = (row // p.rows_seqlen) % p.heads
            b = row // (p.rows_seqlen * p.heads)
            dq[b, i, h, c] = dq_ws[b, h, i, c]

    return Twin(fa2_bwd_convert_dq, None, 0)
