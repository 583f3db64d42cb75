"""fa2_bwd twin: FlashAttention-2 backward (Dao 2023, Algorithm 2), mirroring ``cuda/fa2_bwd.cu``.

fa2_bwd_preprocess: D_i = rowsum(dO_i * O_i) and L_i in log2 units (hidden rows: +inf, so P = 0).
fa2_bwd: grid (Tc, kv_heads, batch); one CTA per key block K_j, V_j, which stay in shared memory while the CTA
  walks every query head of its GQA group and every query block Q_i that sees K_j; dK_j, dV_j stay on chip (so
  the group sum needs no atomics) and P is recomputed from L. With atomic_dq, dQ_i += dS K_j goes through shared
  memory (dS^T) and float32 atomic adds into a work buffer; fa2_bwd_convert_dq casts it.
fa2_bwd_dq: the deterministic dQ (no atomics): one CTA per query block, looping over key blocks.
"""
from __future__ import annotations

import functools

from numba import cuda, float32

from .common import (INF, LOG2E, NEG_INF, ZERO, Mask, apply_mask, apply_mask_t, block_needs_mask, dot_cols,
                     dot_rows, dot_vec_col, dot_vecs, exp2, first_query_block, key_blocks, load_tile)


def threads(Bc: int) -> int:
    """Threads per CTA of the fa2_bwd twin: one per key row of K_j."""
    # MIRROR: thread kr owns key row k0 + kr and its whole rows of dK_j, dV_j, so a CTA has Bc threads and the
    # column split wc of configs.py has no counterpart; the CUDA C has 32 * warps threads, warp (wk, wc) owning
    # 16 * MTK keys and D / WC columns.
    return Bc


def threads_dq(Br: int) -> int:
    """Threads per CTA of the fa2_bwd_dq twin: one per query row of Q_i."""
    # MIRROR: thread r owns query row q0 + r; the CUDA C's warps own 16 * MT rows each.
    return Br


def _offsets(Br: int, Bc: int, D: int, atomic_dq: bool) -> tuple[int, ...]:
    """fa2_bwd's shared buffers in float32 words: K_j, V_j, Q_i, dO_i, dS^T (atomic dQ only), L_i, D_i, and the end."""
    # MIRROR: one stage of Q_i, dO_i, L_i, D_i (the CUDA C double-buffers them for cp.async) and float32 tiles.
    k_at, v_at, q_at, do_at, ds_at = 0, Bc * D, 2 * Bc * D, (2 * Bc + Br) * D, (2 * Bc + 2 * Br) * D
    l_at = ds_at + (Bc * Br if atomic_dq else 0)
    return k_at, v_at, q_at, do_at, ds_at, l_at, l_at + Br, l_at + 2 * Br


def _offsets_dq(Br: int, Bc: int, D: int) -> tuple[int, ...]:
    """fa2_bwd_dq's shared buffers in float32 words: K_j, V_j, Q_i, dO_i, L_i, D_i, and the end."""
    k_at, v_at, q_at, do_at, l_at = 0, Bc * D, 2 * Bc * D, (2 * Bc + Br) * D, (2 * Bc + 2 * Br) * D
    return k_at, v_at, q_at, do_at, l_at, l_at + Br, l_at + 2 * Br


def smem_bytes(Br: int, Bc: int, D: int, atomic_dq: bool) -> int:
    """Dynamic shared memory of the fa2_bwd twin in bytes."""
    return 4 * _offsets(Br, Bc, D, atomic_dq)[-1]


def smem_bytes_dq(Br: int, Bc: int, D: int) -> int:
    """Dynamic shared memory of the fa2_bwd_dq twin in bytes: fa2_bwd.cu's Fa2BwdDqSmem with T = float."""
    return 4 * _offsets_dq(Br, Bc, D)[-1]


@cuda.jit(device=True)
def load_query_block(sQ, sdO, sL, sDelta, q, dout, lse2, delta, q0, seqlen_q, head_dim):
    """Q_i, dO_i to shared memory and L_i, D_i beside them; rows past seqlen_q read L = +inf, D = 0."""
    Br = sQ.shape[0]
    nq = min(Br, seqlen_q - q0)
    load_tile(sQ, q, q0, nq, head_dim)
    load_tile(sdO, dout, q0, nq, head_dim)
    for r in range(cuda.threadIdx.x, Br, cuda.blockDim.x):
        sL[r] = lse2[q0 + r] if r < nq else INF
        sDelta[r] = delta[q0 + r] if r < nq else ZERO


# MIRROR: 4-D and 3-D arrays (they carry their strides) where the CUDA C takes pointers plus strides.
@cuda.jit
def fa2_bwd_preprocess(out, dout, lse, lse2, delta, batch, seqlen_q, heads, head_dim):
    """D = rowsum(dO * O) and L in log2 units, (batch, heads, seqlen_q) float32; one thread per row."""
    # ---- [fa2_bwd:preprocess] Alg.2 l.4: D_i = rowsum(dO_i * O_i); one thread per row ----
    # MIRROR: the CUDA C reads 8 columns per 16-byte load where the rows are aligned; the sums are the same.
    # The sum runs over columns in dP's order (dot_rows), so a row whose P is a single 1 gets dP - D = 0 exactly,
    # as the naive computation does.
    row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x            # (b * heads + h) * seqlen_q + i
    if row >= batch * heads * seqlen_q:
        return
    i = row % seqlen_q
    h = (row // seqlen_q) % heads
    b = row // (seqlen_q * heads)
    delta[b, h, i] = dot_vecs(out[b, i, h, :head_dim], dout[b, i, h, :head_dim])
    lse2[b, h, i] = INF if lse[b, h, i] == NEG_INF else lse[b, h, i] * LOG2E


@functools.lru_cache(maxsize=None)
def make_fa2_bwd(D: int, Br: int, Bc: int, warps: int, causal: bool, atomic_dq: bool = True):
    """The fa2_bwd kernel (dK, dV, and with ``atomic_dq`` also dQ) for one tile shape (the CUDA template's arguments).

    Parameters
    ----------
    D : int
        Specialised head_dim: tile columns; the caller's head_dim (<= D) arrives at launch.
    Br, Bc, warps : int
        Query rows and keys of a block, from ``configs`` (row ``fa2_bwd``), and the CUDA C's warps (part of the
        template's signature; the twin's CTA has ``threads(Bc)`` threads whatever it is).
    causal : bool
        Bottom-right causal mask; query blocks wholly above the diagonal are skipped.
    atomic_dq : bool
        True: also accumulate dQ (times scale) into the float32 work buffer ``dq_ws`` with atomic adds.
        False: leave dQ to ``make_fa2_bwd_dq`` (deterministic); ``dq_ws`` is then any 4-D float32 array.

    Returns
    -------
    numba.cuda kernel
        ``fa2_bwd(q, k, v, dout, lse2, delta, dk, dv, dq_ws, seqlen_q, seqlen_k, heads, kv_heads, head_dim, scale,
        scale_log2)``: q, dout (batch, seqlen_q, heads, head_dim) and k, v, dk, dv (batch, seqlen_k, kv_heads,
        head_dim) float16 or float32; lse2, delta (batch, heads, seqlen_q) from ``fa2_bwd_preprocess``; dq_ws
        (batch, heads, seqlen_q, head_dim) float32 zeros; scale, scale_log2 float32. Launch it with
        ``launch.fa2_bwd``'s grid, ``threads(Bc)`` threads and ``smem_bytes(...)`` bytes of dynamic shared memory.
    """
    K_AT, V_AT, Q_AT, DO_AT, DS_AT, L_AT, DELTA_AT, END = _offsets(Br, Bc, D, atomic_dq)
    DS_ROWS = Bc if atomic_dq else 0

    @cuda.jit
    def fa2_bwd(q, k, v, dout, lse2, delta, dk, dv, dq_ws, seqlen_q, seqlen_k, heads, kv_heads, head_dim, scale,
                scale_log2):
        # ---- [fa2_bwd:setup] key block j, kv head hk, batch b; warp (wk, wc) owns keys kw.. and columns dc.. ----
        # MIRROR: one dynamic float32 array carved like the CUDA C's extern __shared__ smem (static: 48 KB at most).
        smem = cuda.shared.array(0, float32)
        j = cuda.blockIdx.x
        hk = cuda.blockIdx.y
        b = cuda.blockIdx.z
        group = heads // kv_heads
        kr = cuda.threadIdx.x                                                # this thread's key row of K_j
        k0 = j * Bc
        sK = smem[K_AT:V_AT].reshape((Bc, D))
        sV = smem[V_AT:Q_AT].reshape((Bc, D))
        sQ = smem[Q_AT:DO_AT].reshape((Br, D))
        sdO = smem[DO_AT:DS_AT].reshape((Br, D))
        sdS = smem[DS_AT:L_AT].reshape((DS_ROWS, Br))
        sL = smem[L_AT:DELTA_AT]
        sDelta = smem[DELTA_AT:END]
        mask = Mask(seqlen_q, seqlen_k, causal)
        nk = min(Bc, seqlen_k - k0)
        tr = (seqlen_q + Br - 1) // Br
        # The CTA visits (h, i) for every query head h of the group and every query block i that sees K_j, in order.
        i0 = first_query_block(mask, k0, Br)
        nqb = max(0, tr - i0)
        n_iter = group * nqb
        # ---- [fa2_bwd:load_kv] Alg.2 l.6-7: K_j, V_j to shared memory once; dK_j = dV_j = 0 ----
        load_tile(sK, k[b, :, hk], k0, nk, head_dim)
        load_tile(sV, v[b, :, hk], k0, nk, head_dim)
        # MIRROR: this key row's dK_j, dV_j and its rows of S^T, dS^T live in thread-local arrays; the CUDA C keeps
        # them in registers as mma accumulators.
        dk_acc = cuda.local.array(D, float32)
        dv_acc = cuda.local.array(D, float32)
        p = cuda.local.array(Br, float32)
        ds = cuda.local.array(Br, float32)
        for c in range(D):
            dk_acc[c] = ZERO
            dv_acc[c] = ZERO
        for it in range(n_iter):
            h = hk * group + it // nqb
            q0 = (i0 + it % nqb) * Br
            # ---- [fa2_bwd:load_q] Alg.2 l.8: Q_i, dO_i, L_i, D_i ----
            # MIRROR: loaded here, in one stage; the CUDA C streams the next block's in behind them (two stages).
            load_query_block(sQ, sdO, sL, sDelta, q[b, :, h], dout[b, :, h], lse2[b, h], delta[b, h], q0,
                             seqlen_q, head_dim)
            cuda.syncthreads()  # K_j, V_j, Q_i, dO_i, L_i, D_i are visible to every thread
            # ---- [fa2_bwd:scores] Alg.2 l.9-10: S^T = K_j Q_i^T, P^T = exp2(S^T - L) ----
            for c in range(Br):
                p[c] = dot_rows(sK, kr, sQ, c) * scale_log2
            if block_needs_mask(mask, q0, Br, k0, Bc):
                apply_mask_t(p, mask, k0 + kr, q0)
            for c in range(Br):
                p[c] = exp2(p[c] - sL[c])
            # ---- [fa2_bwd:dv] Alg.2 l.11: dV_j += P^T dO_i ----
            for d in range(D):
                dv_acc[d] += dot_vec_col(p, sdO, 0, d)
            # ---- [fa2_bwd:dp] Alg.2 l.12: dP^T = V_j dO_i^T ----
            for c in range(Br):
                ds[c] = dot_rows(sV, kr, sdO, c)
            # ---- [fa2_bwd:ds] Alg.2 l.13: dS^T = P^T * (dP^T - D_i) ----
            for c in range(Br):
                ds[c] = p[c] * (ds[c] - sDelta[c])
            # ---- [fa2_bwd:dk] Alg.2 l.15: dK_j += dS^T Q_i (scale applied at the end) ----
            for d in range(D):
                dk_acc[d] += dot_vec_col(ds, sQ, 0, d)
            # ---- [fa2_bwd:dq] Alg.2 l.14: dQ_i += scale * dS K_j, through shared memory and float32 atomics ----
            if atomic_dq:
                for c in range(Br):
                    sdS[kr, c] = ds[c]
                cuda.syncthreads()  # all of dS^T is in shared memory
                # MIRROR: the CTA's threads share the Br x head_dim entries of dQ_i round-robin; the CUDA C
                # gives each warp a 16 x DQW tile of them.
                for x in range(kr, Br * D, cuda.blockDim.x):
                    r = x // D
                    col = x % D
                    row = q0 + r
                    if row < seqlen_q and col < head_dim:
                        cuda.atomic.add(dq_ws, (b, h, row, col), scale * dot_cols(sdS, r, sK, col))
            cuda.syncthreads()  # every thread is done with Q_i, dO_i, dS, L, D before the next block overwrites them
        # ---- [fa2_bwd:epilogue] Alg.2 l.17: write dK_j (times scale) and dV_j (zero when no query sees K_j) ----
        row = k0 + kr
        if row < seqlen_k:
            for c in range(head_dim):
                dk[b, row, hk, c] = dk_acc[c] * scale
                dv[b, row, hk, c] = dv_acc[c]

    return fa2_bwd


@functools.lru_cache(maxsize=None)
def make_fa2_bwd_dq(D: int, Br: int, Bc: int, warps: int, causal: bool):
    """The deterministic dQ kernel for one tile shape (the CUDA template's arguments).

    Parameters
    ----------
    D : int
        Specialised head_dim.
    Br, Bc, warps : int
        From ``configs`` (row ``fa2_bwd_dq``); the twin's CTA has ``threads_dq(Br)`` threads whatever warps is.
    causal : bool
        Bottom-right causal mask; key blocks wholly past the diagonal are skipped.

    Returns
    -------
    numba.cuda kernel
        ``fa2_bwd_dq(q, k, v, dout, lse2, delta, dq, seqlen_q, seqlen_k, heads, kv_heads, head_dim, scale,
        scale_log2)``, arrays as for ``make_fa2_bwd`` and dq like q. Launch it with ``launch.fa2_bwd_dq``'s grid,
        ``threads_dq(Br)`` threads and ``smem_bytes_dq(...)`` bytes of dynamic shared memory.
    """
    K_AT, V_AT, Q_AT, DO_AT, L_AT, DELTA_AT, END = _offsets_dq(Br, Bc, D)

    @cuda.jit
    def fa2_bwd_dq(q, k, v, dout, lse2, delta, dq, seqlen_q, seqlen_k, heads, kv_heads, head_dim, scale,
                   scale_log2):
        # ---- [fa2_bwd:dq_setup] query block i of head h; warp w owns rows wq.. ----
        smem = cuda.shared.array(0, float32)
        i = cuda.blockIdx.x
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        hk = h // (heads // kv_heads)
        sK = smem[K_AT:V_AT].reshape((Bc, D))
        sV = smem[V_AT:Q_AT].reshape((Bc, D))
        sQ = smem[Q_AT:DO_AT].reshape((Br, D))
        sdO = smem[DO_AT:L_AT].reshape((Br, D))
        sL = smem[L_AT:DELTA_AT]
        sDelta = smem[DELTA_AT:END]
        mask = Mask(seqlen_q, seqlen_k, causal)
        q0 = i * Br
        r = cuda.threadIdx.x                                                 # this thread's query row of Q_i
        load_query_block(sQ, sdO, sL, sDelta, q[b, :, h], dout[b, :, h], lse2[b, h], delta[b, h], q0, seqlen_q,
                         head_dim)
        acc = cuda.local.array(D, float32)
        p = cuda.local.array(Bc, float32)
        ds = cuda.local.array(Bc, float32)
        for c in range(D):
            acc[c] = ZERO
        tc = key_blocks(mask, q0, min(Br, seqlen_q - q0), Bc)
        for j in range(tc):
            k0 = j * Bc
            nk = min(Bc, seqlen_k - k0)
            # ---- [fa2_bwd:dq_block] recompute P, dP and dS for K_j, V_j; dQ_i += dS K_j ----
            load_tile(sK, k[b, :, hk], k0, nk, head_dim)
            load_tile(sV, v[b, :, hk], k0, nk, head_dim)
            cuda.syncthreads()  # K_j, V_j (and Q_i, dO_i, L, D) are visible to every thread
            for y in range(Bc):                                              # S = Q_i K_j^T (log2 units)
                p[y] = dot_rows(sQ, r, sK, y) * scale_log2
            if block_needs_mask(mask, q0, Br, k0, Bc):
                apply_mask(p, mask, q0 + r, k0)
            for y in range(Bc):                                              # dP = dO_i V_j^T
                ds[y] = dot_rows(sdO, r, sV, y)
            for y in range(Bc):                                              # dS = P * (dP - D_i)
                ds[y] = exp2(p[y] - sL[r]) * (ds[y] - sDelta[r])
            for c in range(D):                                               # dQ_i += dS K_j
                acc[c] += dot_vec_col(ds, sK, 0, c)
            cuda.syncthreads()  # every thread is done with K_j, V_j before the next block overwrites them
        # ---- [fa2_bwd:dq_epilogue] dQ_i = scale * acc ----
        row = q0 + r
        if row < seqlen_q:
            for c in range(head_dim):
                dq[b, row, h, c] = acc[c] * scale

    return fa2_bwd_dq


@cuda.jit
def fa2_bwd_convert_dq(dq_ws, dq, batch, seqlen_q, heads, head_dim):
    """dQ = dq_ws (float32, (batch, heads, seqlen_q, head_dim), already scaled) in dq's dtype; grid-stride."""
    # ---- [fa2_bwd:convert] 8 columns per thread and step (head_dim is a multiple of 8: cupy_backend pads it) ----
    # MIRROR: one element per thread and step here; the CUDA C converts 8 columns (16-byte loads and stores).
    n = batch * heads * seqlen_q * head_dim
    for x in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, n, cuda.gridDim.x * cuda.blockDim.x):
        c = x % head_dim
        row = x // head_dim
        i = row % seqlen_q
        h = (row // seqlen_q) % heads
        b = row // (seqlen_q * heads)
        dq[b, i, h, c] = dq_ws[b, h, i, c]
