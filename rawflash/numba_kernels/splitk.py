"""The split-K partition of FlashAttention-1: the counterpart of ``cuda/splitk.cuh``.

Every warp of the CTA takes a slice of the Bc keys of a block for all Br query rows; the block's row maxima, row
sums and P~ V products are combined across warps through shared memory. fa1_fwd uses it, and so does fa2_fwd
with split_q off (the ablation).
"""
from __future__ import annotations

import collections
import functools

from numba import cuda, float32

from .common import NEG_INF, ONE, ZERO, block_needs_mask, dot_rows, dot_vec_col, exp2, row_end

# Views of the shared buffers of one split-K step: red_max, red_sum (warps, Br); acc (Br, D); alpha, beta (Br).
SplitK = collections.namedtuple("SplitK", ["red_max", "red_sum", "acc", "alpha", "beta"])


def splitk_offsets(base: int, br: int, d: int, warps: int) -> tuple[int, int, int, int, int, int]:
    """Start of red_max, red_sum, acc, alpha, beta and the end, in float32 words from the dynamic array's start."""
    red_max = base
    red_sum = red_max + warps * br
    acc = red_sum + warps * br
    alpha = acc + br * d
    beta = alpha + br
    return red_max, red_sum, acc, alpha, beta, beta + br


def splitk_threads(br: int, warps: int) -> int:
    """Threads of a split-K CTA in the twin: one per (warp, row)."""
    # MIRROR: thread tid is lane r = tid % Br of warp w = tid // Br and holds row r of warp w's key slice; in the
    # CUDA C a warp holds all Br rows of its slice in mma fragments. Every split-K row of configs.py has Br = 32,
    # so the twin's CTA is the CUDA C's: 32 * warps threads.
    return warps * br


@functools.lru_cache(maxsize=None)
def make_splitk(Br: int, Bc: int, D: int, warps: int):
    """Device functions ``splitk_block`` and ``splitk_merge`` for one tile shape.

    Parameters
    ----------
    Br, Bc : int
        Query rows and keys of a block.
    D : int
        Specialised head_dim (columns of the tiles).
    warps : int
        Key slices (the CUDA C's NWARPS); ``Bc % warps == 0``.

    Returns
    -------
    splitk_block, splitk_merge : numba.cuda device functions
    """
    if Bc % warps:
        raise ValueError(f"split-K: Bc = {Bc} keys do not split into {warps} equal slices")
    KEYS = Bc // warps

    @cuda.jit(device=True)
    def splitk_block(sk, sQ, sK, sV, mask, q0, k0, scale_log2):
        """One block step (FA1 Alg.1 l.9-11): S = Q K_j^T for this warp's keys, the block max across warps,
        P~ = exp2(S - m~), the block row sums, and P~ V summed over warps into sk.acc. Ends with a barrier."""
        w = cuda.threadIdx.x // Br
        r = cuda.threadIdx.x % Br
        kw = w * KEYS
        s = cuda.local.array(KEYS, float32)
        for y in range(KEYS):                                                # FA1 Alg.1 l.9: S_ij slice
            s[y] = dot_rows(sQ, r, sK, kw + y) * scale_log2
        if block_needs_mask(mask, q0, Br, k0, Bc):
            end = row_end(mask, q0 + r) - k0 - kw
            for y in range(max(0, end), KEYS):
                s[y] = NEG_INF
        mx = NEG_INF
        for y in range(KEYS):
            mx = max(mx, s[y])
        sk.red_max[w, r] = mx
        cuda.syncthreads()  # every warp's slice maximum is visible
        m = NEG_INF                                                          # FA1 Alg.1 l.10: m~ over the whole block
        for v in range(warps):
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
        """Merge the block in sk into the running state m, l (Br) and O (Br x D) (FA1 Alg.1 l.11-13).

        The state lives in HBM for fa1 and in shared memory for fa2 with split-K. ``normalize`` keeps O divided by
        l after every block (FA1); otherwise O stays unnormalised until the end (FA2's deferred normalisation).
        Rows ``>= nrows`` are left alone. Ends with sk.acc zeroed again and a barrier.
        """
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        for r in range(tid, Br, nthreads):
            m_blk = NEG_INF
            l_blk = ZERO
            for v in range(warps):
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
        for idx in range(tid, Br * D, nthreads):
            r = idx // D
            c = idx % D
            if r < nrows and c < ncols:
                O[r, c] = sk.alpha[r] * O[r, c] + sk.beta[r] * sk.acc[r, c]
            sk.acc[r, c] = ZERO
        cuda.syncthreads()  # acc is zero and the state is written before the next block reuses them

    return splitk_block, splitk_merge
