"""fa2_fwd twin: FlashAttention-2 forward (Dao 2023, Algorithm 1), mirroring ``cuda/fa2_fwd.cu``.

Grid (Tr, heads, batch): one CTA per query block Q_i ("sequence parallelism"); Q_i stays in shared memory; each
thread owns one whole row ("split-Q"), so the softmax needs no exchange between threads; O is divided by l once
at the end ("deferred normalisation"). Each idea is a factory switch so it can be turned off alone:
seq_parallel=False loops over all query blocks in one CTA per (batch, head), split_q=False uses FA1's split-K
partition (splitk.py), defer_norm=False rescales O by 1/l after every key block.
Scores are kept in log2 units (scale_log2 = scale * log2(e)) so every exponential is one exp2.
"""
from __future__ import annotations

import collections
import functools
import math

from numba import cuda, float32

from .common import (LN2, NEG_INF, ONE, ZERO, Mask, apply_mask, block_needs_mask, dot_rows, dot_vec_col, exp2,
                     key_blocks, load_tile, row_max)
from .splitk import SplitK, make_splitk, splitk_offsets, splitk_threads

# Everything a block step needs besides the tiles; the arrays are already views at (batch, head).
FwdArgs = collections.namedtuple("FwdArgs", ["q", "k", "v", "o", "lse", "mask", "head_dim", "scale_log2"])


def threads(Br: int, warps: int, split_q: bool = True) -> int:
    """Threads per CTA of the twin: one per query row (split-Q), or one per (warp, row) (split-K)."""
    # MIRROR: split-Q gives each thread one row, so a CTA has Br threads; the CUDA C has 32 * warps threads whose
    # warps own 16 * MT rows each.
    return Br if split_q else splitk_threads(Br, warps)


def _offsets(Br: int, Bc: int, warps: int, D: int, split_q: bool) -> tuple[int, ...]:
    """Shared buffers in float32 words (fa2_fwd.cu's Fa2FwdSmem with T = float): Q_i, K_j, V_j, the split-K state
    (red_max, red_sum, acc, alpha, beta, O, m, l; offsets from its start, used with split_q off) and the end."""
    q_at, k_at, v_at, state = 0, Br * D, (Br + Bc) * D, (Br + 2 * Bc) * D
    red_max, red_sum, acc, alpha, beta, o_at = splitk_offsets(0, Br, D, warps)
    m_at = o_at + Br * D
    l_at = m_at + Br
    end = state + (0 if split_q else l_at + Br)
    return q_at, k_at, v_at, state, red_max, red_sum, acc, alpha, beta, o_at, m_at, l_at, end


def smem_bytes(Br: int, Bc: int, warps: int, D: int, split_q: bool = True) -> int:
    """Dynamic shared memory of the twin in bytes (inputs are upcast to float32 tiles on load)."""
    return 4 * _offsets(Br, Bc, warps, D, split_q)[-1]


@functools.lru_cache(maxsize=None)
def make_fa2_fwd(D: int, Br: int, Bc: int, warps: int, causal: bool, defer_norm: bool = True,
                 seq_parallel: bool = True, split_q: bool = True):
    """The fa2_fwd kernel for one tile shape and set of switches (the CUDA template's arguments).

    Parameters
    ----------
    D : int
        Specialised head_dim: tile columns; the caller's head_dim (<= D) arrives at launch.
    Br, Bc, warps : int
        Query rows and keys of a block, and warps (key slices of the split-K partition), from ``configs``.
    causal, defer_norm, seq_parallel, split_q : bool
        Bottom-right causal mask, and the three FA2 ideas the ablation turns off one by one.

    Returns
    -------
    numba.cuda kernel
        ``fa2_fwd(q, k, v, o, lse, seqlen_q, seqlen_k, heads, kv_heads, head_dim, scale_log2)`` with q, o
        (batch, seqlen_q, heads, head_dim), k, v (batch, seqlen_k, kv_heads, head_dim) float16 or float32, lse
        (batch, heads, seqlen_q) float32, scale_log2 a float32. Launch it with ``launch.fa2_fwd``'s grid,
        ``threads(Br, warps, split_q)`` threads and ``smem_bytes(...)`` bytes of dynamic shared memory.
    """
    Q_AT, K_AT, V_AT, STATE, RED_MAX, RED_SUM, ACC, ALPHA, BETA, O_AT, M_AT, L_AT, END = _offsets(Br, Bc, warps, D,
                                                                                                   split_q)
    splitk_block, splitk_merge = make_splitk(Br, Bc, D, warps)

    @cuda.jit(device=True)
    def fa2_block_split_q(sQ, sK, sV, state, a, i):
        """One query block with the split-Q partition: thread r owns row q0 + r (``state`` is split-K's, unused)."""
        mask = a.mask
        q0 = i * Br
        r = cuda.threadIdx.x
        nrows = min(Br, mask.seqlen_q - q0)
        # ---- [fa2_fwd:load_q] Alg.1 l.4: Q_i to shared memory, where it stays; K_0 behind it ----
        tc = key_blocks(mask, q0, nrows, Bc)                             # key blocks past the diagonal: never loaded
        load_tile(sQ, a.q, q0, nrows, a.head_dim)
        if tc > 0:
            load_tile(sK, a.k, 0, min(Bc, mask.seqlen_k), a.head_dim)
        # ---- [fa2_fwd:init] Alg.1 l.5: O = 0, l = 0, m = -inf ----
        # MIRROR: the row's O, m, l and S live in thread-local arrays; the CUDA C keeps 16 * MT rows per warp in
        # registers as mma accumulators.
        o = cuda.local.array(D, float32)
        s = cuda.local.array(Bc, float32)
        for c in range(D):
            o[c] = ZERO
        m = NEG_INF
        l = ZERO
        for j in range(tc):
            k0 = j * Bc
            # ---- [fa2_fwd:load_kv] Alg.1 l.7: V_j streams in while S = Q_i K_j^T is computed ----
            # MIRROR: a plain copy that nothing overlaps (no cp.async); the barriers stay where the CUDA C has them.
            cuda.syncthreads()  # K_j (and Q_i) are visible; every thread is done reading V_{j-1}
            load_tile(sV, a.v, k0, min(Bc, mask.seqlen_k - k0), a.head_dim)
            # ---- [fa2_fwd:scores] Alg.1 l.8: S_ij = Q_i K_j^T, scaled into log2 units ----
            for y in range(Bc):
                s[y] = dot_rows(sQ, r, sK, y) * a.scale_log2
            # ---- [fa2_fwd:mask] only blocks on the diagonal or the ragged edge pay for a mask ----
            if block_needs_mask(mask, q0, Br, k0, Bc):
                apply_mask(s, mask, q0 + r, k0)
            # ---- [fa2_fwd:softmax] Alg.1 l.9: m_new = max(m, rowmax S), P = exp2(S - m_new), l = e^(m-m_new) l + rowsum P ----
            m_new = max(m, row_max(s))
            mx = ZERO if m_new == NEG_INF else m_new                     # a row with nothing visible yet keeps P = 0
            fo = exp2(m - mx)
            m = m_new
            rs = ZERO
            for y in range(Bc):
                s[y] = exp2(s[y] - mx)
                rs += s[y]
            l_old = l
            l = fo * l_old + rs
            if not defer_norm:                                               # keep O normalised (FA1 Alg.1 l.12):
                inv = ONE / l if l > ZERO else ZERO                          # O = diag(l_old e^(m-m_new) / l_new) O
                fo *= l_old * inv                                            #     + diag(1 / l_new) P V
                for y in range(Bc):
                    s[y] *= inv
            for c in range(D):                                               # Alg.1 l.10: diag(e^(m_old - m_new)) O
                o[c] *= fo
            # ---- [fa2_fwd:wait_v] K_{j+1} streams in while O += P V_j is computed ----
            cuda.syncthreads()  # V_j is visible; every thread is done reading K_j
            if j + 1 < tc:
                load_tile(sK, a.k, k0 + Bc, min(Bc, mask.seqlen_k - k0 - Bc), a.head_dim)
            # ---- [fa2_fwd:pv] Alg.1 l.10: O += P V_j with P as the A operand straight from registers ----
            for c in range(D):
                o[c] += dot_vec_col(s, sV, 0, c)
        # ---- [fa2_fwd:epilogue] Alg.1 l.12-13: O_i = diag(l)^-1 O_i, L_i = m_i + log(l_i); hidden rows get 0 and -inf ----
        f = (ONE / l if defer_norm else ONE) if l > ZERO else ZERO
        row = q0 + r
        if row < mask.seqlen_q:
            for c in range(a.head_dim):
                a.o[row, c] = o[c] * f
            a.lse[row] = m * LN2 + math.log(l) if l > ZERO else NEG_INF
        cuda.syncthreads()  # with seq_parallel off the next query block overwrites sQ, sK and sV

    @cuda.jit(device=True)
    def fa2_block_split_k(sQ, sK, sV, state, a, i):
        """One query block with FA1's split-K partition (the ablation of split-Q): O, m, l live in shared memory."""
        mask = a.mask
        sk = SplitK(state[RED_MAX:RED_SUM].reshape((warps, Br)), state[RED_SUM:ACC].reshape((warps, Br)),
                    state[ACC:ALPHA].reshape((Br, D)), state[ALPHA:BETA], state[BETA:O_AT])
        sO = state[O_AT:M_AT].reshape((Br, D))
        sM = state[M_AT:L_AT]
        sL = state[L_AT:L_AT + Br]
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        q0 = i * Br
        nrows = min(Br, mask.seqlen_q - q0)
        tc = key_blocks(mask, q0, nrows, Bc)
        # ---- [fa2_fwd:splitk_init] O = 0, m = -inf, l = 0 in shared memory ----
        for x in range(tid, Br * D, nthreads):
            sO[x // D, x % D] = ZERO
            sk.acc[x // D, x % D] = ZERO
        for r in range(tid, Br, nthreads):
            sM[r] = NEG_INF
            sL[r] = ZERO
        load_tile(sQ, a.q, q0, nrows, a.head_dim)
        for j in range(tc):
            k0 = j * Bc
            # ---- [fa2_fwd:splitk_step] every warp takes BC/NWARPS keys; rows are merged through shared memory ----
            load_tile(sK, a.k, k0, min(Bc, mask.seqlen_k - k0), a.head_dim)
            load_tile(sV, a.v, k0, min(Bc, mask.seqlen_k - k0), a.head_dim)
            cuda.syncthreads()  # Q_i, K_j, V_j and the zeroed state are visible to every thread
            splitk_block(sk, sQ, sK, sV, mask, q0, k0, a.scale_log2)
            splitk_merge(sk, sM, sL, sO, Br, D, not defer_norm)
        # ---- [fa2_fwd:splitk_epilogue] O_i = diag(l)^-1 O_i (or as kept), L_i = m_i + log(l_i) ----
        cuda.syncthreads()  # the state is final (also when no key block was visible)
        for x in range(tid, nrows * a.head_dim, nthreads):
            r = x // a.head_dim
            c = x % a.head_dim
            f = (ONE / sL[r] if defer_norm else ONE) if sL[r] > ZERO else ZERO
            a.o[q0 + r, c] = sO[r, c] * f
        for r in range(tid, nrows, nthreads):
            a.lse[q0 + r] = sM[r] * LN2 + math.log(sL[r]) if sL[r] > ZERO else NEG_INF
        cuda.syncthreads()  # every thread is done with the state before the next query block resets it

    fa2_block = fa2_block_split_q if split_q else fa2_block_split_k        # if constexpr (SPLIT_Q)

    # MIRROR: arrays carry their shapes and strides, so the kernel takes 4-D arrays where the CUDA C takes
    # pointers plus (batch, seq, head) strides; any strides work.
    @cuda.jit
    def fa2_fwd(q, k, v, o, lse, seqlen_q, seqlen_k, heads, kv_heads, head_dim, scale_log2):
        # ---- [fa2_fwd:setup] (batch, head) from the grid; query head h reads kv head h / (heads / kv_heads) ----
        # MIRROR: one dynamic float32 array carved like the CUDA C's extern __shared__ smem: static shared arrays
        # stop at 48 KB and the tiles need up to 227 KB.
        smem = cuda.shared.array(0, float32)
        b = cuda.blockIdx.z
        h = cuda.blockIdx.y
        hk = h // (heads // kv_heads)
        sQ = smem[Q_AT:K_AT].reshape((Br, D))
        sK = smem[K_AT:V_AT].reshape((Bc, D))
        sV = smem[V_AT:STATE].reshape((Bc, D))
        state = smem[STATE:END]
        a = FwdArgs(q[b, :, h], k[b, :, hk], v[b, :, hk], o[b, :, h], lse[b, h], Mask(seqlen_q, seqlen_k, causal),
                    head_dim, scale_log2)
        # ---- [fa2_fwd:schedule] sequence parallelism: this CTA's query block, or all of them in turn ----
        tr = (seqlen_q + Br - 1) // Br
        i_first = tr - 1 - cuda.blockIdx.x if seq_parallel else 0            # longest causal rows start first
        i_end = i_first + 1 if seq_parallel else tr
        for i in range(i_first, i_end):
            fa2_block(sQ, sK, sV, state, a, i)

    return fa2_fwd
